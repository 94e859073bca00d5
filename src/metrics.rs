//! Prometheus metrics, instrumented through the `metrics` facade and rendered by
//! `metrics-exporter-prometheus`. Seed names are kept exactly; every label value comes from a
//! closed enum or from configuration (profile names), never from request content.
//!
//! Each `Metrics` owns its recorder instead of installing a process-global one: a test process
//! runs many daemons' services side by side, and each must count only its own work.

use std::marker::PhantomData;
use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

/// Waits for a run slot: none (0) up to the default 30 s limit.
const QUEUE_BUCKETS: &[f64] = &[
    0.0, 0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Execution durations; includes the seed's 0.5, 1.0 and 5.0 s bounds.
const BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Every handle is registered with the same metadata: the recorder ignores it.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// An instrument kind a [`Family`] hands out.
pub trait Instrument {
    fn register(recorder: &PrometheusRecorder, key: &Key) -> Self;
}

impl Instrument for Counter {
    fn register(recorder: &PrometheusRecorder, key: &Key) -> Self {
        recorder.register_counter(key, &METADATA)
    }
}

impl Instrument for Gauge {
    fn register(recorder: &PrometheusRecorder, key: &Key) -> Self {
        recorder.register_gauge(key, &METADATA)
    }
}

impl Instrument for Histogram {
    fn register(recorder: &PrometheusRecorder, key: &Key) -> Self {
        recorder.register_histogram(key, &METADATA)
    }
}

/// A metric with labels: one instrument per combination of label values.
pub struct Family<T> {
    recorder: Arc<PrometheusRecorder>,
    name: &'static str,
    labels: &'static [&'static str],
    kind: PhantomData<fn() -> T>,
}

impl<T> Clone for Family<T> {
    fn clone(&self) -> Self {
        Family {
            recorder: self.recorder.clone(),
            name: self.name,
            labels: self.labels,
            kind: PhantomData,
        }
    }
}

impl<T: Instrument> Family<T> {
    /// The instrument for these label values, given in the order the family declares its labels.
    pub fn with_label_values(&self, values: &[&str]) -> T {
        debug_assert_eq!(values.len(), self.labels.len(), "{}", self.name);
        // Labels go out sorted by name, so a line reads the same however a family lists them.
        let mut labels: Vec<Label> = self
            .labels
            .iter()
            .zip(values)
            .map(|(k, v)| Label::new(*k, v.to_string()))
            .collect();
        labels.sort_by(|a, b| a.key().cmp(b.key()));
        T::register(&self.recorder, &Key::from_parts(self.name, labels))
    }
}

pub type CounterVec = Family<Counter>;
pub type GaugeVec = Family<Gauge>;
pub type HistogramVec = Family<Histogram>;

pub struct Metrics {
    recorder: Arc<PrometheusRecorder>,
    process: metrics_process::Collector,
    pub executions: CounterVec,
    pub executions_by_backend: CounterVec,
    pub duration: Histogram,
    pub duration_by_backend: HistogramVec,
    pub capability_violations: Counter,
    pub timeouts: Counter,
    pub auth_failures: Counter,
    pub ooms: Counter,
    pub output_truncations: Counter,
    pub rejected: CounterVec,
    pub inflight: GaugeVec,
    pub pool_size: GaugeVec,
    pub pool_events: CounterVec,
    pub egress_connections: CounterVec,
    pub audit_segments_recovered: Counter,
    pub audit_append_failures: CounterVec,
    pub interrupted_runs: Counter,
    pub audit_refusals_suppressed: CounterVec,
    pub queue_waiting: GaugeVec,
    pub queue_wait: HistogramVec,
    pub live_runs: Gauge,
    pub runs_started: CounterVec,
    pub cancels: Counter,
    pub open_streams: Gauge,
    pub sessions_open: GaugeVec,
    pub sessions_ended: CounterVec,
    pub sessions_paused: Gauge,
    pub backend_ready: GaugeVec,
}

/// Registers metrics with their help texts on one recorder.
struct Registrar {
    recorder: Arc<PrometheusRecorder>,
}

impl Registrar {
    fn counter(&self, name: &'static str, help: &'static str) -> Counter {
        self.recorder.describe_counter(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.recorder
            .register_counter(&Key::from_static_name(name), &METADATA)
    }

    fn gauge(&self, name: &'static str, help: &'static str) -> Gauge {
        self.recorder.describe_gauge(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.recorder
            .register_gauge(&Key::from_static_name(name), &METADATA)
    }

    fn histogram(&self, name: &'static str, help: &'static str) -> Histogram {
        self.recorder.describe_histogram(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.recorder
            .register_histogram(&Key::from_static_name(name), &METADATA)
    }

    fn counters(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> CounterVec {
        self.recorder.describe_counter(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.family(name, labels)
    }

    fn gauges(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> GaugeVec {
        self.recorder.describe_gauge(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.family(name, labels)
    }

    fn histograms(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> HistogramVec {
        self.recorder.describe_histogram(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.family(name, labels)
    }

    fn family<T>(&self, name: &'static str, labels: &'static [&'static str]) -> Family<T> {
        Family {
            recorder: self.recorder.clone(),
            name,
            labels,
            kind: PhantomData,
        }
    }
}

/// The closed label sets whose series exist from the start, at 0: `increase()` and `rate()` then
/// see a series' first event (a series that appears at 1 shows no increase), and dashboards and
/// alerts find every series they query before anything happened.
pub const BACKENDS: &[&str] = &["local", "docker", "gvisor"];
/// `AuditEvent::name()` of every audit line.
pub const AUDIT_EVENTS: &[&str] = &[
    "refusal",
    "execution_start",
    "execution",
    "execution_error",
    "segment_start",
    "refusals_suppressed",
    "execution_cancel",
    "session_create",
    "session_end",
    "session_file",
    "session_pause",
    "session_resume",
    "session_archive",
];
/// `reason` of `executor_rejected_total`.
pub const REJECT_REASONS: &[&str] = &[
    "overloaded",
    "payload_too_large",
    "body_timeout",
    "invalid_request",
    "sandbox_unavailable",
    "idempotency",
];
/// `verdict` of `executor_egress_connections_total`.
pub const EGRESS_VERDICTS: &[&str] = &["allowed", "refused", "failed"];
/// HTTP statuses of refusals that are audited (and may be suppressed).
pub const REFUSAL_STATUSES: &[&str] = &["401", "403"];

const DURATION: &str = "executor_execution_duration_seconds";
const DURATION_BY_BACKEND: &str = "executor_backend_execution_duration_seconds";
const QUEUE_WAIT: &str = "executor_queue_wait_seconds";

impl Metrics {
    pub fn new() -> Self {
        let buckets = |builder: PrometheusBuilder, name: &str, bounds: &[f64]| {
            builder
                .set_buckets_for_metric(Matcher::Full(name.to_string()), bounds)
                .expect("non-empty buckets")
        };
        let builder = PrometheusBuilder::new();
        let builder = buckets(builder, DURATION, BUCKETS);
        let builder = buckets(builder, DURATION_BY_BACKEND, BUCKETS);
        let builder = buckets(builder, QUEUE_WAIT, QUEUE_BUCKETS);
        let recorder = Arc::new(builder.build_recorder());
        let r = Registrar {
            recorder: recorder.clone(),
        };

        let build_info = r.gauges(
            "executor_arm_build_info",
            "This daemon's version and the commit it was built from (always 1)",
            &["version", "git_sha"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), env!("EXECUTOR_ARM_GIT_SHA")])
            .set(1.0);
        let process = metrics_process::Collector::default();
        metrics::with_local_recorder(recorder.as_ref(), || process.describe());

        let m = Metrics {
            executions: r.counters(
                "executor_executions_total",
                "Total number of executions",
                &["action_type", "success"],
            ),
            executions_by_backend: r.counters(
                "executor_backend_executions_total",
                "Executions by backend, profile and outcome",
                &["backend", "profile", "outcome"],
            ),
            duration: r.histogram(DURATION, "Execution duration"),
            duration_by_backend: r.histograms(
                DURATION_BY_BACKEND,
                "Execution duration by backend",
                &["backend"],
            ),
            capability_violations: r.counter(
                "executor_capability_violations_total",
                "Capability violations",
            ),
            timeouts: r.counter("executor_timeouts_total", "Execution timeouts"),
            auth_failures: r.counter("executor_auth_failures_total", "Requests refused with 401"),
            ooms: r.counter(
                "executor_oom_kills_total",
                "Executions ended by the memory limit",
            ),
            output_truncations: r.counter(
                "executor_output_truncations_total",
                "Executions whose output went past the output limit (cut, and stopped under on_overflow = kill)",
            ),
            rejected: r.counters(
                "executor_rejected_total",
                "Requests refused before running",
                &["reason"],
            ),
            inflight: r.gauges(
                "executor_inflight_executions",
                "Executions running now",
                &["backend"],
            ),
            pool_size: r.gauges(
                "executor_pool_idle_containers",
                "Idle pre-started containers",
                &["backend", "profile"],
            ),
            pool_events: r.counters(
                "executor_pool_events_total",
                "Warm pool hits and misses, and runs served by a reused container",
                &["backend", "event"],
            ),
            egress_connections: r.counters(
                "executor_egress_connections_total",
                "Outbound connections through the egress proxy",
                &["verdict"],
            ),
            audit_segments_recovered: r.counter(
                "executor_audit_segments_recovered_total",
                "Audit logs that did not verify at start, moved aside for a new segment",
            ),
            audit_append_failures: r.counters(
                "executor_audit_append_failures_total",
                "Audit lines that could not be written, by event",
                &["event"],
            ),
            interrupted_runs: r.counter(
                "executor_interrupted_runs_total",
                "Runs an earlier daemon process started and never ended (it stopped mid-run), recorded at start",
            ),
            audit_refusals_suppressed: r.counters(
                "executor_audit_refusals_suppressed_total",
                "Refusals over their class's audit rate, counted in a refusals_suppressed line instead of a line each, by HTTP status",
                &["status"],
            ),
            queue_waiting: r.gauges(
                "executor_queue_waiting",
                "Requests waiting for a run slot of their backend now",
                &["backend"],
            ),
            queue_wait: r.histograms(
                QUEUE_WAIT,
                "Time admitted or refused requests waited for a run slot (0 when one was free)",
                &["backend"],
            ),
            live_runs: r.gauge(
                "executor_runs_live",
                "Runs of this daemon that started and have not finished",
            ),
            runs_started: r.counters(
                "executor_runs_started_total",
                "Runs started, by how the caller waits",
                &["mode"],
            ),
            cancels: r.counter("executor_cancels_total", "Runs a caller asked to stop"),
            open_streams: r.gauge(
                "executor_open_streams",
                "Server-Sent Event streams of runs open now",
            ),
            sessions_open: r.gauges(
                "executor_sessions_open",
                "Sessions open now, by backend",
                &["backend"],
            ),
            sessions_ended: r.counters(
                "executor_sessions_ended_total",
                "Sessions ended, by why (deleted, expired, idle, shutdown, sandbox_gone)",
                &["reason"],
            ),
            sessions_paused: r.gauge(
                "executor_sessions_paused",
                "Paused sessions in the paused store (sessions.store_dir), as last counted",
            ),
            backend_ready: r.gauges(
                "executor_backend_ready",
                "Whether a backend can run work now (1) or not (0), as /readyz checks it",
                &["backend"],
            ),
            recorder,
            process,
        };
        m.register_known_series();
        m
    }

    /// Registers every series of the closed label sets above at 0.
    fn register_known_series(&self) {
        for b in BACKENDS {
            self.inflight.with_label_values(&[b]).increment(0.0);
            self.queue_waiting.with_label_values(&[b]).increment(0.0);
            self.sessions_open.with_label_values(&[b]).increment(0.0);
        }
        for e in AUDIT_EVENTS {
            self.audit_append_failures
                .with_label_values(&[e])
                .increment(0);
        }
        for r in REJECT_REASONS {
            self.rejected.with_label_values(&[r]).increment(0);
        }
        for v in EGRESS_VERDICTS {
            self.egress_connections.with_label_values(&[v]).increment(0);
        }
        for s in REFUSAL_STATUSES {
            self.audit_refusals_suppressed
                .with_label_values(&[s])
                .increment(0);
        }
    }

    /// The Prometheus text exposition, with this process's RSS, open fds and CPU time read now.
    pub fn render(&self) -> String {
        metrics::with_local_recorder(self.recorder.as_ref(), || self.process.collect());
        float_bucket_bounds(&self.recorder.handle().render())
    }

    /// The value of one sample (`name` with exactly these labels, in any order), as rendered.
    #[cfg(test)]
    pub fn sample(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        labels.sort();
        let series = if labels.is_empty() {
            name.to_string()
        } else {
            format!("{name}{{{}}}", labels.join(","))
        };
        self.render().lines().find_map(|l| {
            let (s, v) = l.rsplit_once(' ')?;
            (s == series).then(|| v.parse().ok())?
        })
    }
}

/// Writes every integral histogram bound as a float (`le="1.0"`, not `le="1"`), the canonical
/// form OpenMetrics asks for and the form the seed's examples and dashboards match. The exporter
/// prints bounds with Rust's shortest float formatting and has no option for this, so the
/// rendered text is adjusted here; values and other labels are left as they are.
fn float_bucket_bounds(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.split_inclusive('\n') {
        // The exporter writes `le` last: the bound is between the last `le="` and its quote.
        let bound = line
            .find("_bucket{")
            .and_then(|_| line.rfind("le=\""))
            .filter(|&at| matches!(line.as_bytes()[at - 1], b'{' | b','))
            .map(|at| at + "le=\"".len())
            .and_then(|start| Some((start, start + line[start..].find('"')?)));
        match bound {
            Some((start, end)) if is_integral(&line[start..end]) => {
                out.push_str(&line[..end]);
                out.push_str(".0");
                out.push_str(&line[end..]);
            }
            _ => out.push_str(line),
        }
    }
    out
}

fn is_integral(bound: &str) -> bool {
    let digits = bound.strip_prefix('-').unwrap_or(bound);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_label_sets_start_at_zero() {
        let m = Metrics::new();
        for b in BACKENDS {
            assert_eq!(
                m.sample("executor_queue_waiting", &[("backend", b)]),
                Some(0.0)
            );
            assert_eq!(
                m.sample("executor_sessions_open", &[("backend", b)]),
                Some(0.0)
            );
        }
        assert_eq!(
            m.sample(
                "executor_audit_append_failures_total",
                &[("event", "execution_start")]
            ),
            Some(0.0)
        );
        assert_eq!(
            m.sample("executor_rejected_total", &[("reason", "overloaded")]),
            Some(0.0)
        );
        assert_eq!(
            m.sample(
                "executor_egress_connections_total",
                &[("verdict", "refused")]
            ),
            Some(0.0)
        );
        assert_eq!(
            m.sample(
                "executor_audit_refusals_suppressed_total",
                &[("status", "401")]
            ),
            Some(0.0)
        );
    }

    #[test]
    fn the_seed_bucket_lines_appear_exactly() {
        let m = Metrics::new();
        m.duration.record(0.7);
        m.duration.record(3.0);
        let text = m.render();
        for line in [
            "executor_execution_duration_seconds_bucket{le=\"0.5\"} 0",
            "executor_execution_duration_seconds_bucket{le=\"1.0\"} 1",
            "executor_execution_duration_seconds_bucket{le=\"5.0\"} 2",
            "executor_execution_duration_seconds_bucket{le=\"+Inf\"} 2",
            "executor_execution_duration_seconds_count 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing in:\n{text}"
            );
        }
    }

    #[test]
    fn labels_render_sorted_by_name_and_counters_start_at_zero() {
        let m = Metrics::new();
        m.executions_by_backend
            .with_label_values(&["local", "shell-readonly", "success"])
            .increment(2);
        let text = m.render();
        assert!(text.lines().any(|l| l
            == "executor_backend_executions_total{backend=\"local\",outcome=\"success\",profile=\"shell-readonly\"} 2"));
        assert!(text.lines().any(|l| l == "executor_timeouts_total 0"));
        assert_eq!(
            m.sample(
                "executor_backend_executions_total",
                &[
                    ("profile", "shell-readonly"),
                    ("backend", "local"),
                    ("outcome", "success")
                ]
            ),
            Some(2.0)
        );
    }

    #[test]
    fn build_info_and_process_metrics_are_exposed() {
        let m = Metrics::new();
        let text = m.render();
        let info = format!(
            "executor_arm_build_info{{git_sha=\"{}\",version=\"{}\"}} 1",
            env!("EXECUTOR_ARM_GIT_SHA"),
            env!("CARGO_PKG_VERSION")
        );
        assert!(
            text.lines().any(|l| l == info),
            "{info} missing in:\n{text}"
        );
        for name in [
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_cpu_seconds_total",
        ] {
            let v = m
                .sample(name, &[])
                .unwrap_or_else(|| panic!("{name} in:\n{text}"));
            assert!(
                v > 0.0 || name == "process_cpu_seconds_total",
                "{name} = {v}"
            );
        }
    }

    #[test]
    fn two_metrics_count_apart() {
        let (a, b) = (Metrics::new(), Metrics::new());
        a.timeouts.increment(1);
        assert_eq!(a.sample("executor_timeouts_total", &[]), Some(1.0));
        assert_eq!(b.sample("executor_timeouts_total", &[]), Some(0.0));
    }

    #[test]
    fn only_integral_bucket_bounds_change() {
        let text = "a_bucket{profile=\"p\",le=\"10\"} 3\na_bucket{le=\"0.25\"} 1\na_bucket{le=\"+Inf\"} 4\nb{le=\"1\"} 2\n";
        assert_eq!(
            float_bucket_bounds(text),
            "a_bucket{profile=\"p\",le=\"10.0\"} 3\na_bucket{le=\"0.25\"} 1\na_bucket{le=\"+Inf\"} 4\nb{le=\"1\"} 2\n"
        );
    }
}
