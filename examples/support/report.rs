//! A benchmark's results: each series printed as a p50/p95/p99 line as it is recorded, and, when
//! `BENCH_JSON=<path>` is set, all of them written to that path as one JSON document (read by
//! `scripts/bench/report.py`):
//!
//! `{"bench", "series": [{id, label, backend, baseline, n, errors, p50_ms, p95_ms, p99_ms,
//! throughput_per_s, samples_ms}], "ratios": [{id, label, value, target, met}],
//! "targets": [{id, label, value, unit, target, met}], "facts": {}}`
//!
//! A series' `baseline` names the same-run series it is compared with (null for a baseline). A
//! ratio or target may also carry `before`: the same figure of another build of the daemon
//! measured in the same run (`EXECUTOR_ARM_BASELINE_BIN`).

use serde_json::{Map, Value, json};

/// Whether `BENCH_QUICK` asks for a short run (small sample counts: a check that the benchmark
/// works, not a measurement).
pub fn quick() -> bool {
    std::env::var("BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// `n`, or a tenth of it (at least `min`) in a quick run.
pub fn count(n: usize, min: usize) -> usize {
    if quick() { (n / 10).max(min) } else { n }
}

/// A bound a figure is held to.
#[derive(Clone, Copy)]
pub enum Target {
    AtMost(f64),
    AtLeast(f64),
}

impl Target {
    fn met(self, value: f64) -> bool {
        match self {
            Target::AtMost(t) => value <= t,
            Target::AtLeast(t) => value >= t,
        }
    }

    fn text(self) -> String {
        match self {
            Target::AtMost(t) => format!("<= {t:?}"),
            Target::AtLeast(t) => format!(">= {t:?}"),
        }
    }
}

/// The percentiles of a recorded series, in milliseconds.
#[derive(Clone, Copy)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// One series before it is recorded: what it measured and against what.
pub struct Series<'a> {
    pub id: &'a str,
    pub label: &'a str,
    pub backend: &'a str,
    /// The id of the same-run series this one is compared with.
    pub baseline: Option<&'a str>,
}

pub struct Report {
    bench: String,
    /// Width of the label column of the printed lines.
    width: usize,
    series: Vec<Value>,
    ratios: Vec<Value>,
    targets: Vec<Value>,
    facts: Map<String, Value>,
}

/// Nearest-rank percentile of sorted samples.
fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

impl Report {
    pub fn new(bench: &str, width: usize) -> Report {
        Report {
            bench: bench.into(),
            width,
            series: Vec::new(),
            ratios: Vec::new(),
            targets: Vec::new(),
            facts: Map::new(),
        }
    }

    /// Records a latency series (milliseconds, in the order measured) and prints its line.
    pub fn series(&mut self, s: Series, samples_ms: &[f64]) -> Percentiles {
        self.record(s, samples_ms, 0, None)
    }

    /// Records a series run at some concurrency: its latencies, the requests that failed and the
    /// completed requests per second over the series' wall time.
    pub fn throughput(
        &mut self,
        s: Series,
        samples_ms: &[f64],
        errors: usize,
        per_s: f64,
    ) -> Percentiles {
        self.record(s, samples_ms, errors, Some(per_s))
    }

    fn record(
        &mut self,
        s: Series,
        samples_ms: &[f64],
        errors: usize,
        per_s: Option<f64>,
    ) -> Percentiles {
        let mut sorted = samples_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        let p = if sorted.is_empty() {
            Percentiles {
                p50: f64::NAN,
                p95: f64::NAN,
                p99: f64::NAN,
            }
        } else {
            Percentiles {
                p50: pct(&sorted, 0.50),
                p95: pct(&sorted, 0.95),
                p99: pct(&sorted, 0.99),
            }
        };
        let width = self.width;
        let mut line = format!(
            "{:<width$} n={:<4} p50={:>8.3} ms  p95={:>8.3} ms  p99={:>8.3} ms",
            s.label,
            sorted.len(),
            p.p50,
            p.p95,
            p.p99
        );
        if let Some(t) = per_s {
            line.push_str(&format!("  {t:>7.1} req/s  errors={errors}"));
        }
        println!("{line}");
        let finite = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
        self.series.push(json!({
            "id": s.id,
            "label": s.label,
            "backend": s.backend,
            "baseline": s.baseline,
            "n": sorted.len(),
            "errors": errors,
            "p50_ms": finite(p.p50),
            "p95_ms": finite(p.p95),
            "p99_ms": finite(p.p99),
            "throughput_per_s": per_s.map(finite),
            "samples_ms": samples_ms,
        }));
        p
    }

    /// Records and prints a ratio of two same-run figures, with the bound it is held to if any.
    pub fn ratio(&mut self, id: &str, label: &str, value: f64, target: Option<Target>) -> f64 {
        let bound = target.map(|t| format!("   (target {}x)", t.text()));
        println!("ratio {label}: {value:.2}x{}", bound.unwrap_or_default());
        self.ratios.push(json!({
            "id": id,
            "label": label,
            "value": value,
            "target": target.map(Target::text),
            "met": target.map(|t| t.met(value)),
        }));
        value
    }

    /// Adds `before` to the ratio recorded as `id`: the same figure of the baseline build, measured
    /// in the same run.
    pub fn before(&mut self, id: &str, value: f64) {
        let ratio = self
            .ratios
            .iter_mut()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no ratio {id} recorded"));
        println!("  baseline build: {value:.2}x");
        ratio["before"] = json!(value);
    }

    /// Records and prints an absolute figure held to a bound.
    pub fn target(&mut self, id: &str, label: &str, value: f64, unit: &str, target: Target) {
        println!(
            "{label}: {value:.3} {unit} (target {} {unit})",
            target.text()
        );
        self.targets.push(json!({
            "id": id,
            "label": label,
            "value": value,
            "unit": unit,
            "target": target.text(),
            "met": target.met(value),
        }));
    }

    /// Records a fact about the run (sample counts, the backend, a binary's path).
    pub fn fact(&mut self, key: &str, value: impl Into<Value>) {
        self.facts.insert(key.into(), value.into());
    }

    /// Writes the document to `BENCH_JSON` when it is set.
    pub fn write(&self) {
        let Ok(path) = std::env::var("BENCH_JSON") else {
            return;
        };
        let doc = json!({
            "bench": self.bench,
            "series": self.series,
            "ratios": self.ratios,
            "targets": self.targets,
            "facts": self.facts,
        });
        let text = serde_json::to_string_pretty(&doc).expect("serialise results");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {path}: {e}"));
        println!("results written to {path}");
    }
}
