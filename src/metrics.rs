//! Prometheus metrics. Seed names are kept exactly; every label value comes from a closed enum
//! or from configuration (profile names), never from request content.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub executions: IntCounterVec,
    pub executions_by_backend: IntCounterVec,
    pub duration: Histogram,
    pub duration_by_backend: HistogramVec,
    pub capability_violations: IntCounter,
    pub timeouts: IntCounter,
    pub auth_failures: IntCounter,
    pub ooms: IntCounter,
    pub output_truncations: IntCounter,
    pub rejected: IntCounterVec,
    pub inflight: IntGaugeVec,
    pub pool_size: IntGaugeVec,
    pub pool_events: IntCounterVec,
    pub egress_connections: IntCounterVec,
    pub audit_segments_recovered: IntCounter,
    pub audit_append_failures: IntCounterVec,
    pub interrupted_runs: IntCounter,
    pub audit_refusals_suppressed: IntCounterVec,
    pub queue_waiting: IntGaugeVec,
    pub queue_wait: HistogramVec,
    pub live_runs: IntGauge,
    pub runs_started: IntCounterVec,
    pub cancels: IntCounter,
    pub open_streams: IntGauge,
    pub sessions_open: IntGaugeVec,
    pub sessions_ended: IntCounterVec,
}

/// Waits for a run slot: none (0) up to the default 30 s limit.
const QUEUE_BUCKETS: &[f64] = &[
    0.0, 0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

const BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let executions = IntCounterVec::new(
            Opts::new("executor_executions_total", "Total number of executions"),
            &["action_type", "success"],
        )
        .expect("metric");
        let executions_by_backend = IntCounterVec::new(
            Opts::new(
                "executor_backend_executions_total",
                "Executions by backend, profile and outcome",
            ),
            &["backend", "profile", "outcome"],
        )
        .expect("metric");
        let duration = Histogram::with_opts(
            HistogramOpts::new("executor_execution_duration_seconds", "Execution duration")
                .buckets(BUCKETS.to_vec()),
        )
        .expect("metric");
        let duration_by_backend = HistogramVec::new(
            HistogramOpts::new(
                "executor_backend_execution_duration_seconds",
                "Execution duration by backend",
            )
            .buckets(BUCKETS.to_vec()),
            &["backend"],
        )
        .expect("metric");
        let capability_violations = IntCounter::new(
            "executor_capability_violations_total",
            "Capability violations",
        )
        .expect("metric");
        let timeouts =
            IntCounter::new("executor_timeouts_total", "Execution timeouts").expect("metric");
        let auth_failures =
            IntCounter::new("executor_auth_failures_total", "Requests refused with 401")
                .expect("metric");
        let ooms = IntCounter::new(
            "executor_oom_kills_total",
            "Executions ended by the memory limit",
        )
        .expect("metric");
        let output_truncations = IntCounter::new(
            "executor_output_truncations_total",
            "Executions whose output went past the output limit (cut, and stopped under on_overflow = kill)",
        )
        .expect("metric");
        let rejected = IntCounterVec::new(
            Opts::new("executor_rejected_total", "Requests refused before running"),
            &["reason"],
        )
        .expect("metric");
        let inflight = IntGaugeVec::new(
            Opts::new("executor_inflight_executions", "Executions running now"),
            &["backend"],
        )
        .expect("metric");
        let pool_size = IntGaugeVec::new(
            Opts::new(
                "executor_pool_idle_containers",
                "Idle pre-started containers",
            ),
            &["backend", "profile"],
        )
        .expect("metric");
        let egress_connections = IntCounterVec::new(
            Opts::new(
                "executor_egress_connections_total",
                "Outbound connections through the egress proxy",
            ),
            &["verdict"],
        )
        .expect("metric");
        let pool_events = IntCounterVec::new(
            Opts::new("executor_pool_events_total", "Warm pool hits and misses"),
            &["backend", "event"],
        )
        .expect("metric");
        let audit_segments_recovered = IntCounter::new(
            "executor_audit_segments_recovered_total",
            "Audit logs that did not verify at start, moved aside for a new segment",
        )
        .expect("metric");
        let audit_append_failures = IntCounterVec::new(
            Opts::new(
                "executor_audit_append_failures_total",
                "Audit lines that could not be written, by event",
            ),
            &["event"],
        )
        .expect("metric");
        let interrupted_runs = IntCounter::new(
            "executor_interrupted_runs_total",
            "Runs an earlier daemon process started and never ended (it stopped mid-run), recorded at start",
        )
        .expect("metric");
        let audit_refusals_suppressed = IntCounterVec::new(
            Opts::new(
                "executor_audit_refusals_suppressed_total",
                "Refusals over their class's audit rate, counted in a refusals_suppressed line instead of a line each, by HTTP status",
            ),
            &["status"],
        )
        .expect("metric");
        let queue_waiting = IntGaugeVec::new(
            Opts::new(
                "executor_queue_waiting",
                "Requests waiting for a run slot of their backend now",
            ),
            &["backend"],
        )
        .expect("metric");
        let queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "executor_queue_wait_seconds",
                "Time admitted or refused requests waited for a run slot (0 when one was free)",
            )
            .buckets(QUEUE_BUCKETS.to_vec()),
            &["backend"],
        )
        .expect("metric");
        let live_runs = IntGauge::new(
            "executor_runs_live",
            "Runs of this daemon that started and have not finished",
        )
        .expect("metric");
        let runs_started = IntCounterVec::new(
            Opts::new(
                "executor_runs_started_total",
                "Runs started, by how the caller waits",
            ),
            &["mode"],
        )
        .expect("metric");
        let cancels = IntCounter::new("executor_cancels_total", "Runs a caller asked to stop")
            .expect("metric");
        let open_streams = IntGauge::new(
            "executor_open_streams",
            "Server-Sent Event streams of runs open now",
        )
        .expect("metric");
        let sessions_open = IntGaugeVec::new(
            Opts::new("executor_sessions_open", "Sessions open now, by backend"),
            &["backend"],
        )
        .expect("metric");
        let sessions_ended = IntCounterVec::new(
            Opts::new(
                "executor_sessions_ended_total",
                "Sessions ended, by why (deleted, expired, idle, shutdown)",
            ),
            &["reason"],
        )
        .expect("metric");
        for c in [
            Box::new(executions.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(sessions_open.clone()),
            Box::new(sessions_ended.clone()),
            Box::new(executions_by_backend.clone()),
            Box::new(duration.clone()),
            Box::new(duration_by_backend.clone()),
            Box::new(capability_violations.clone()),
            Box::new(timeouts.clone()),
            Box::new(auth_failures.clone()),
            Box::new(ooms.clone()),
            Box::new(output_truncations.clone()),
            Box::new(rejected.clone()),
            Box::new(inflight.clone()),
            Box::new(pool_size.clone()),
            Box::new(pool_events.clone()),
            Box::new(egress_connections.clone()),
            Box::new(audit_segments_recovered.clone()),
            Box::new(audit_append_failures.clone()),
            Box::new(interrupted_runs.clone()),
            Box::new(audit_refusals_suppressed.clone()),
            Box::new(queue_waiting.clone()),
            Box::new(queue_wait.clone()),
            Box::new(live_runs.clone()),
            Box::new(runs_started.clone()),
            Box::new(cancels.clone()),
            Box::new(open_streams.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        Metrics {
            registry,
            executions,
            executions_by_backend,
            duration,
            duration_by_backend,
            capability_violations,
            timeouts,
            auth_failures,
            ooms,
            output_truncations,
            rejected,
            inflight,
            pool_size,
            pool_events,
            egress_connections,
            audit_segments_recovered,
            audit_append_failures,
            interrupted_runs,
            audit_refusals_suppressed,
            queue_waiting,
            queue_wait,
            live_runs,
            runs_started,
            cancels,
            open_streams,
            sessions_open,
            sessions_ended,
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
