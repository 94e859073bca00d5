//! Benchmark: end-to-end `POST /execute` of `echo hi` on the local backend, 500 sequential
//! requests over one keep-alive connection, beside two baselines measured in the same run:
//! a raw fork/exec of /bin/echo and `bwrap --ro-bind / / --unshare-all /bin/echo`.
//! The three series are interleaved in blocks of 25, so a change in machine load during the run
//! weighs on all of them alike instead of on whichever series happened to run then. A second,
//! sporadic part sends one request (and runs one bwrap) every 500 ms: latency after idle spells.
//!
//! With `EXECUTOR_ARM_BASELINE_BIN` set (another build of the daemon, e.g. an older commit's), a
//! second daemon from that binary serves a fourth series in the same blocks: old beside new in one
//! run.
//!
//! Run: `scripts/bench.sh` (builds release and runs this as root). Prints p50/p95/p99 and ratios.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use executor_arm::config::TokenKind;

mod support;

const N: usize = 500;
const WARMUP: usize = 20;
const BLOCK: usize = 25;
const SPORADIC: usize = 40;
const SPORADIC_GAP: Duration = Duration::from_millis(250);

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

fn summary(name: &str, mut v: Vec<Duration>) -> f64 {
    v.sort();
    let (p50, p95, p99) = (pct(&v, 0.50), pct(&v, 0.95), pct(&v, 0.99));
    println!(
        "{name:<44} n={:<4} p50={p50:>8.3} ms  p95={p95:>8.3} ms  p99={p99:>8.3} ms",
        v.len()
    );
    p50
}

fn time_cmd(argv: &[&str], n: usize, out: &mut Vec<Duration>) {
    for _ in 0..n {
        let t = Instant::now();
        let st = Command::new(argv[0])
            .args(&argv[1..])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("spawn");
        let d = t.elapsed();
        assert!(st.success(), "{argv:?} failed");
        out.push(d);
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // The baseline first: an older build sweeps the run cgroups of its own name at start, so the
    // daemon under test, started after it, uses a name of its own.
    let baseline_bin = std::env::var("EXECUTOR_ARM_BASELINE_BIN").ok();
    let baseline = baseline_bin
        .as_deref()
        .map(|bin| support::Daemon::start_bin(bin, &[]));
    let daemon = support::Daemon::start(&[(
        "EXECUTOR_ARM__SANDBOX__LOCAL__CGROUP_NAME",
        "executor-arm-bench",
    )]);
    let addr = daemon.addr.clone();
    let mint = |kind, caps: &[&str]| daemon.mint(kind, caps);
    let svc = format!("Bearer {}", mint(TokenKind::Service, &[]));
    let body = serde_json::json!({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": mint(TokenKind::Capability, &["ShellExecute"])}).to_string();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .expect("client");
    let url = format!("http://{addr}/execute");
    let baseline_url = baseline
        .as_ref()
        .map(|b| format!("http://{}/execute", b.addr));
    let send = |url: String| async {
        let t = Instant::now();
        let r = client
            .post(url)
            .header("authorization", &svc)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .expect("request");
        let status = r.status();
        let text = r.text().await.expect("body");
        let d = t.elapsed();
        assert!(
            status.is_success() && text.contains("\"stdout\":\"hi\\n\""),
            "{status} {text}"
        );
        d
    };
    let request = || send(url.clone());
    let bwrap = [
        "bwrap",
        "--ro-bind",
        "/",
        "/",
        "--unshare-all",
        "/bin/echo",
        "hi",
    ];
    let mut discard = Vec::new();
    for _ in 0..WARMUP {
        request().await;
    }
    time_cmd(&["/bin/echo", "hi"], WARMUP, &mut discard);
    time_cmd(&bwrap, WARMUP, &mut discard);
    if let Some(u) = &baseline_url {
        for _ in 0..WARMUP {
            send(u.clone()).await;
        }
    }
    let (mut api, mut fork, mut bw, mut old) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..N / BLOCK {
        for _ in 0..BLOCK {
            api.push(request().await);
        }
        if let Some(u) = &baseline_url {
            for _ in 0..BLOCK {
                old.push(send(u.clone()).await);
            }
        }
        time_cmd(&["/bin/echo", "hi"], BLOCK, &mut fork);
        time_cmd(&bwrap, BLOCK, &mut bw);
    }
    // Sporadic traffic: one request (and one bwrap) every SPORADIC_GAP, the way an orchestrator
    // with little to do calls. Idle CPUs and idle kernel state (RCU, cgroup locks) show here.
    let (mut api_idle, mut bw_idle) = (Vec::new(), Vec::new());
    for _ in 0..SPORADIC {
        tokio::time::sleep(SPORADIC_GAP).await;
        api_idle.push(request().await);
        tokio::time::sleep(SPORADIC_GAP).await;
        time_cmd(&bwrap, 1, &mut bw_idle);
    }
    drop(daemon);
    drop(baseline);

    println!(
        "executor-arm local backend benchmark ({N} sequential requests per series, interleaved in \
         blocks of {BLOCK}, {WARMUP} warm-up discarded)"
    );
    let p_api = summary("POST /execute echo hi (local, keep-alive)", api);
    let p_fork = summary("fork/exec /bin/echo", fork);
    let p_bwrap = summary("bwrap --ro-bind / / --unshare-all /bin/echo", bw);
    println!("ratio p50 execute / fork-exec: {:.2}x", p_api / p_fork);
    println!(
        "ratio p50 execute / bwrap:     {:.2}x   (target <= 1.5x)",
        p_api / p_bwrap
    );
    if let Some(bin) = &baseline_bin {
        let p_old = summary("POST /execute echo hi (baseline binary)", old);
        println!("baseline binary: {bin}");
        println!("ratio p50 execute / baseline binary: {:.2}x", p_api / p_old);
    }
    println!(
        "sporadic: {SPORADIC} of each, one every {} ms",
        SPORADIC_GAP.as_millis() * 2
    );
    let p_api_idle = summary("POST /execute echo hi (sporadic)", api_idle);
    let p_bw_idle = summary("bwrap --unshare-all /bin/echo (sporadic)", bw_idle);
    println!(
        "ratio p50 execute / bwrap (sporadic): {:.2}x",
        p_api_idle / p_bw_idle
    );
}
