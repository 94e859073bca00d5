//! Benchmark: end-to-end `POST /execute` of `echo hi` on the local backend, 500 sequential
//! requests over one keep-alive connection, beside two baselines measured in the same run:
//! a raw fork/exec of /bin/echo and `bwrap --ro-bind / / --unshare-all /bin/echo`.
//! The three series are interleaved in blocks of 25, so a change in machine load during the run
//! weighs on all of them alike instead of on whichever series happened to run then. A second,
//! sporadic part sends one request (and runs one bwrap) every 500 ms: latency after idle spells.
//!
//! Run: `scripts/bench.sh` (builds release and runs this as root). Prints p50/p95/p99 and ratios.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use executor_arm::auth::{MintRequest, mint_hs256};
use executor_arm::config::TokenKind;

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
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = "bench-secret-0123456789abcdef0123456789abcdef";
    std::fs::write(dir.path().join("secret"), secret).expect("secret");
    let bin =
        std::env::var("EXECUTOR_ARM_BIN").unwrap_or_else(|_| "target/release/executor-arm".into());
    let mut child = Command::new(&bin)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("EXECUTOR_ARM_JWT_SECRET_FILE", dir.path().join("secret"))
        .env("EXECUTOR_ARM_AUDIT_LOG", dir.path().join("audit.jsonl"))
        // Production logging (every execution is also logged): the cost is part of the figure.
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start daemon");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    // Keep draining the daemon's log so it never blocks on a full pipe.
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("\"listening\"")
                && let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
            {
                let _ = tx.send(v["fields"]["addr"].as_str().unwrap_or_default().to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("daemon address");
    let mint = |kind, caps: &[&str]| {
        mint_hs256(
            secret.as_bytes(),
            &MintRequest {
                kind: Some(kind),
                capabilities: caps.iter().map(|s| s.to_string()).collect(),
                ttl_seconds: 3000,
                aud: "executor-arm".into(),
                sub: Some("bench".into()),
                ..Default::default()
            },
        )
        .expect("mint")
    };
    let svc = format!("Bearer {}", mint(TokenKind::Service, &[]));
    let body = serde_json::json!({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": mint(TokenKind::Capability, &["ShellExecute"])}).to_string();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .expect("client");
    let url = format!("http://{addr}/execute");
    let request = || async {
        let t = Instant::now();
        let r = client
            .post(&url)
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
    let (mut api, mut fork, mut bw) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..N / BLOCK {
        for _ in 0..BLOCK {
            api.push(request().await);
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
    // SAFETY: signal our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();

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
