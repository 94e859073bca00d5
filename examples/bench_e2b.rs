//! Benchmark: `Sandbox.create()` + `commands.run("echo hi")` through the official E2B Python SDK
//! (the current pinned version, scripts/e2b-sdk-venv.sh) against the same two steps over the REST
//! API (`POST /v1/sandbox/sessions` of a bash session, then its exec of `echo hi`), on one backend
//! (`BACKEND`: local, runc or gvisor; default local), one at a time, interleaved in blocks of 10.
//! Both are timed by one Python process (scripts/bench/e2b_bench.py, httpx for REST), so the
//! ratio weighs the E2B front end and the SDK's own work, not a difference of client languages.
//! The sandbox's end follows each sample, untimed.
//!
//! Run: `scripts/bench-e2b.sh` (builds release and runs this as root for each backend). Prints
//! p50/p95/p99 and the ratio; `BENCH_JSON=<path>` also writes them as JSON, `BENCH_QUICK=1` takes
//! a tenth of the samples.

use executor_arm::config::TokenKind;
use support::report::{Report, Series, count};

mod support;

const N: usize = 100;
const BLOCK: usize = 10;

fn main() {
    let backend = std::env::var("BACKEND").unwrap_or_else(|_| "local".into());
    let containers = backend != "local";
    let envd = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .to_string();
    let mut env = vec![("EXECUTOR_ARM__E2B__ENVD_LISTEN", envd.as_str())];
    if containers {
        env.push(("SANDBOX_RUNTIME", backend.as_str()));
    }
    let d = support::Daemon::start(&env);
    let n = count(if containers { N / 2 } else { N }, 2 * BLOCK);
    let python = std::process::Command::new("scripts/e2b-sdk-venv.sh")
        .arg("2.63.0")
        .output()
        .expect("scripts/e2b-sdk-venv.sh");
    assert!(python.status.success(), "scripts/e2b-sdk-venv.sh failed");
    let python = String::from_utf8_lossy(&python.stdout).trim().to_string();
    let base = format!("http://{}", d.addr);
    let out = std::process::Command::new(python)
        .arg("scripts/bench/e2b_bench.py")
        .env("E2B_API_URL", format!("{base}/e2b"))
        .env("E2B_SANDBOX_URL", format!("http://{envd}"))
        .env("E2B_API_KEY", d.mint(TokenKind::Service, &["ShellExecute"]))
        .env("BENCH_REST_URL", &base)
        .env(
            "BENCH_CAPABILITY_TOKEN",
            d.mint(TokenKind::Capability, &["ShellExecute"]),
        )
        .env("BENCH_N", n.to_string())
        .env("BENCH_BLOCK", BLOCK.to_string())
        .env("BENCH_WARMUP", count(3, 1).to_string())
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .expect("run scripts/bench/e2b_bench.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "e2b_bench.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("samples");
    let of = |k: &str| -> Vec<f64> {
        samples[k]
            .as_array()
            .expect("samples")
            .iter()
            .filter_map(|v| v.as_f64())
            .collect()
    };
    let (sdk, rest) = (of("sdk"), of("rest"));
    println!("{backend} backend, {n} each, interleaved in blocks of {BLOCK}");
    let name = format!("e2b-{backend}");
    let mut report = Report::new(&name, 60);
    report.fact("backend", backend.as_str());
    report.fact("n", n);
    report.fact("block", BLOCK);
    report.fact("sdk", "e2b 2.63.0 (Python)");
    let sdk_id = format!("e2b.{backend}.sdk");
    let rest_id = format!("e2b.{backend}.rest");
    let a = report.series(
        Series {
            id: &sdk_id,
            label: "E2B SDK: Sandbox.create + commands.run(echo hi)",
            backend: &backend,
            baseline: Some(&rest_id),
        },
        &sdk,
    );
    let b = report.series(
        Series {
            id: &rest_id,
            label: "REST: create session + exec echo hi (baseline)",
            backend: &backend,
            baseline: None,
        },
        &rest,
    );
    report.ratio(
        &format!("e2b.{backend}.sdk_vs_rest"),
        &format!("p50 E2B SDK / REST ({backend})"),
        a.p50 / b.p50,
        None,
    );
    report.write();
}
