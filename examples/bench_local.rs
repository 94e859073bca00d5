//! Benchmark: end-to-end `POST /execute` of `echo hi` on the local backend, 500 sequential
//! requests over one keep-alive connection, beside two baselines measured in the same run:
//! a raw fork/exec of /bin/echo and `bwrap --ro-bind / / --unshare-all /bin/echo`.
//! The three series are interleaved in blocks of 25, so a change in machine load during the run
//! weighs on all of them alike instead of on whichever series happened to run then. A second,
//! sporadic part sends one request (and runs one bwrap) every 500 ms: latency after idle spells.
//!
//! With `EXECUTOR_ARM_BASELINE_BIN` set (another build of the daemon, e.g. an older commit's), a
//! second daemon from that binary serves a fourth series in the same blocks, every third sporadic
//! request, and its own turn in each throughput round: old beside new in one run, each target's
//! ratio also given for the old build (`before` in the JSON).
//!
//! A last part measures throughput at 16 in flight: `CONC_N` requests from 16 concurrent clients
//! (the default `server.concurrency.local`, set explicitly here so all 16 are admitted) against
//! the same number of bwrap runs, 16 at a time, interleaved in rounds.
//!
//! Run: `scripts/bench.sh` (builds release and runs this as root). Prints p50/p95/p99 and ratios;
//! `BENCH_JSON=<path>` also writes them as JSON, `BENCH_QUICK=1` takes a tenth of the samples
//! (see `scripts/bench.sh`).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use executor_arm::config::TokenKind;
use support::report::{Report, Series, Target, count};

mod support;

const N: usize = 500;
const WARMUP: usize = 20;
const BLOCK: usize = 25;
const SPORADIC: usize = 40;
const SPORADIC_GAP: Duration = Duration::from_millis(250);
/// Requests (and bwrap runs) of the 16-in-flight throughput series.
const CONC_N: usize = 800;
const CONC: usize = 16;
const CONC_ROUNDS: usize = 4;

const BWRAP: [&str; 7] = [
    "bwrap",
    "--ro-bind",
    "/",
    "/",
    "--unshare-all",
    "/bin/echo",
    "hi",
];

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn time_cmd(argv: &[&str], n: usize, out: &mut Vec<f64>) {
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
        out.push(ms(d));
    }
}

/// One `POST /execute` of `echo hi`: its latency, or what went wrong.
async fn execute(
    client: &reqwest::Client,
    url: &str,
    svc: &str,
    body: &str,
) -> Result<Duration, String> {
    let t = Instant::now();
    let r = client
        .post(url)
        .header("authorization", svc)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let text = r.text().await.map_err(|e| e.to_string())?;
    let d = t.elapsed();
    if status.is_success() && text.contains("\"stdout\":\"hi\\n\"") {
        Ok(d)
    } else {
        Err(format!("{status} {text}"))
    }
}

/// `n` requests from `CONC` concurrent clients: the latencies of the answered ones, the number
/// that failed, and the wall time.
async fn execute_concurrent(
    client: &reqwest::Client,
    url: &str,
    svc: &str,
    body: &str,
    n: usize,
) -> (Vec<f64>, usize, Duration) {
    let left = Arc::new(AtomicUsize::new(n));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CONC {
        let (client, url, svc, body) = (
            client.clone(),
            url.to_string(),
            svc.to_string(),
            body.to_string(),
        );
        let left = left.clone();
        tasks.spawn(async move {
            let (mut lat, mut errors) = (Vec::new(), 0);
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
                .is_ok()
            {
                match execute(&client, &url, &svc, &body).await {
                    Ok(d) => lat.push(ms(d)),
                    Err(e) => {
                        eprintln!("concurrent request failed: {e}");
                        errors += 1;
                    }
                }
            }
            (lat, errors)
        });
    }
    let (mut lat, mut errors) = (Vec::new(), 0);
    while let Some(done) = tasks.join_next().await {
        let (l, e) = done.expect("client task");
        lat.extend(l);
        errors += e;
    }
    (lat, errors, start.elapsed())
}

/// `n` runs of `argv`, `CONC` at a time: their latencies and the wall time.
fn cmd_concurrent(argv: &[&str], n: usize) -> (Vec<f64>, Duration) {
    let left = AtomicUsize::new(n);
    let start = Instant::now();
    let lat = std::thread::scope(|s| {
        let workers: Vec<_> = (0..CONC)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    while left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
                        .is_ok()
                    {
                        time_cmd(argv, 1, &mut out);
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("bwrap worker"))
            .collect::<Vec<_>>()
    });
    (lat, start.elapsed())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let (n, warmup, sporadic, conc_n) = (
        count(N, 2 * BLOCK),
        count(WARMUP, 5),
        count(SPORADIC, 8),
        count(CONC_N, 4 * CONC),
    );
    let concurrency = CONC.to_string();
    // The baseline first: an older build sweeps the run cgroups of its own name at start, so the
    // daemon under test, started after it, uses a name of its own.
    let baseline_bin = std::env::var("EXECUTOR_ARM_BASELINE_BIN").ok();
    let baseline = baseline_bin.as_deref().map(|bin| {
        support::Daemon::start_bin(
            bin,
            &[(
                "EXECUTOR_ARM__SERVER__CONCURRENCY__LOCAL",
                concurrency.as_str(),
            )],
        )
    });
    let daemon = support::Daemon::start(&[
        (
            "EXECUTOR_ARM__SANDBOX__LOCAL__CGROUP_NAME",
            "executor-arm-bench",
        ),
        (
            "EXECUTOR_ARM__SERVER__CONCURRENCY__LOCAL",
            concurrency.as_str(),
        ),
    ]);
    let addr = daemon.addr.clone();
    let mint = |kind, caps: &[&str]| daemon.mint(kind, caps);
    let svc = format!("Bearer {}", mint(TokenKind::Service, &[]));
    let body = serde_json::json!({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": mint(TokenKind::Capability, &["ShellExecute"])}).to_string();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONC)
        .build()
        .expect("client");
    let url = format!("http://{addr}/execute");
    let baseline_url = baseline
        .as_ref()
        .map(|b| format!("http://{}/execute", b.addr));
    let send = |url: String| {
        let (client, svc, body) = (&client, &svc, &body);
        async move {
            ms(execute(client, &url, svc, body)
                .await
                .unwrap_or_else(|e| panic!("{e}")))
        }
    };
    let request = || send(url.clone());
    let mut discard = Vec::new();
    for _ in 0..warmup {
        request().await;
    }
    time_cmd(&["/bin/echo", "hi"], warmup, &mut discard);
    time_cmd(&BWRAP, warmup, &mut discard);
    if let Some(u) = &baseline_url {
        for _ in 0..warmup {
            send(u.clone()).await;
        }
    }
    let (mut api, mut fork, mut bw, mut old) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n / BLOCK {
        for _ in 0..BLOCK {
            api.push(request().await);
        }
        if let Some(u) = &baseline_url {
            for _ in 0..BLOCK {
                old.push(send(u.clone()).await);
            }
        }
        time_cmd(&["/bin/echo", "hi"], BLOCK, &mut fork);
        time_cmd(&BWRAP, BLOCK, &mut bw);
    }
    // Sporadic traffic: one request (and one bwrap) every SPORADIC_GAP, the way an orchestrator
    // with little to do calls. Idle CPUs and idle kernel state (RCU, cgroup locks) show here.
    let (mut api_idle, mut bw_idle, mut old_idle) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..sporadic {
        tokio::time::sleep(SPORADIC_GAP).await;
        api_idle.push(request().await);
        tokio::time::sleep(SPORADIC_GAP).await;
        time_cmd(&BWRAP, 1, &mut bw_idle);
        if let Some(u) = &baseline_url {
            tokio::time::sleep(SPORADIC_GAP).await;
            old_idle.push(send(u.clone()).await);
        }
    }
    // Throughput at 16 in flight, the daemon and bwrap taking turns in rounds.
    let (mut conc, mut conc_errors, mut conc_wall) = (Vec::new(), 0, Duration::ZERO);
    let (mut bw_conc, mut bw_conc_wall) = (Vec::new(), Duration::ZERO);
    let (mut old_conc, mut old_conc_errors, mut old_conc_wall) = (Vec::new(), 0, Duration::ZERO);
    for _ in 0..CONC_ROUNDS {
        let (l, e, w) = execute_concurrent(&client, &url, &svc, &body, conc_n / CONC_ROUNDS).await;
        conc.extend(l);
        conc_errors += e;
        conc_wall += w;
        let (l, w) = cmd_concurrent(&BWRAP, conc_n / CONC_ROUNDS);
        bw_conc.extend(l);
        bw_conc_wall += w;
        if let Some(u) = &baseline_url {
            let (l, e, w) = execute_concurrent(&client, u, &svc, &body, conc_n / CONC_ROUNDS).await;
            old_conc.extend(l);
            old_conc_errors += e;
            old_conc_wall += w;
        }
    }
    drop(daemon);
    drop(baseline);

    println!(
        "executor-arm local backend benchmark ({n} sequential requests per series, interleaved in \
         blocks of {BLOCK}, {warmup} warm-up discarded)"
    );
    let mut report = Report::new("local", 44);
    report.fact("n_sequential", n);
    report.fact("block", BLOCK);
    report.fact("warmup", warmup);
    let local = |id, label, baseline| Series {
        id,
        label,
        backend: "local",
        baseline,
    };
    let p_api = report.series(
        local(
            "local.execute.seq",
            "POST /execute echo hi (local, keep-alive)",
            Some("local.bwrap"),
        ),
        &api,
    );
    let p_fork = report.series(local("local.fork", "fork/exec /bin/echo", None), &fork);
    let p_bwrap = report.series(
        local(
            "local.bwrap",
            "bwrap --ro-bind / / --unshare-all /bin/echo",
            None,
        ),
        &bw,
    );
    report.ratio(
        "local.p50_vs_fork",
        "p50 execute / fork-exec",
        p_api.p50 / p_fork.p50,
        None,
    );
    report.ratio(
        "local.p50_vs_bwrap",
        "p50 execute / bwrap",
        p_api.p50 / p_bwrap.p50,
        Some(Target::AtMost(1.1)),
    );
    report.ratio(
        "local.p95_vs_bwrap",
        "p95 execute / bwrap",
        p_api.p95 / p_bwrap.p95,
        Some(Target::AtMost(1.5)),
    );
    report.ratio(
        "local.p99_vs_bwrap",
        "p99 execute / bwrap",
        p_api.p99 / p_bwrap.p99,
        Some(Target::AtMost(2.0)),
    );
    if let Some(bin) = &baseline_bin {
        let p_old = report.series(
            local(
                "local.execute.baseline_bin",
                "POST /execute echo hi (baseline binary)",
                None,
            ),
            &old,
        );
        println!("baseline binary: {bin}");
        report.fact("baseline_bin", bin.as_str());
        report.ratio(
            "local.p50_vs_baseline_bin",
            "p50 execute / baseline binary",
            p_api.p50 / p_old.p50,
            None,
        );
        report.before("local.p50_vs_bwrap", p_old.p50 / p_bwrap.p50);
        report.before("local.p95_vs_bwrap", p_old.p95 / p_bwrap.p95);
        report.before("local.p99_vs_bwrap", p_old.p99 / p_bwrap.p99);
    }
    println!(
        "sporadic: {sporadic} of each, one every {} ms",
        SPORADIC_GAP.as_millis() * 2
    );
    report.fact("n_sporadic", sporadic);
    report.fact("sporadic_gap_ms", SPORADIC_GAP.as_millis() as u64 * 2);
    let p_api_idle = report.series(
        local(
            "local.execute.sporadic",
            "POST /execute echo hi (sporadic)",
            Some("local.bwrap.sporadic"),
        ),
        &api_idle,
    );
    let p_bw_idle = report.series(
        local(
            "local.bwrap.sporadic",
            "bwrap --unshare-all /bin/echo (sporadic)",
            None,
        ),
        &bw_idle,
    );
    report.ratio(
        "local.sporadic.p50_vs_bwrap",
        "p50 execute / bwrap (sporadic)",
        p_api_idle.p50 / p_bw_idle.p50,
        Some(Target::AtMost(1.1)),
    );
    if baseline_bin.is_some() {
        let p_old_idle = report.series(
            local(
                "local.execute.sporadic.baseline_bin",
                "POST /execute echo hi (sporadic, baseline binary)",
                None,
            ),
            &old_idle,
        );
        report.before(
            "local.sporadic.p50_vs_bwrap",
            p_old_idle.p50 / p_bw_idle.p50,
        );
    }
    println!(
        "concurrency {CONC}: {conc_n} of each, in {CONC_ROUNDS} rounds taking turns \
         (server.concurrency.local = {CONC})"
    );
    report.fact("n_concurrent", conc_n);
    report.fact("concurrency", CONC);
    let tput = conc.len() as f64 / conc_wall.as_secs_f64();
    let bw_tput = bw_conc.len() as f64 / bw_conc_wall.as_secs_f64();
    report.throughput(
        local(
            "local.conc16",
            "POST /execute echo hi (16 in flight)",
            Some("local.bwrap16"),
        ),
        &conc,
        conc_errors,
        tput,
    );
    report.throughput(
        local("local.bwrap16", "bwrap /bin/echo (16 at a time)", None),
        &bw_conc,
        0,
        bw_tput,
    );
    report.ratio(
        "local.conc16.tput_vs_bwrap16",
        "throughput execute / bwrap, 16 in flight",
        tput / bw_tput,
        Some(Target::AtLeast(1.0)),
    );
    if baseline_bin.is_some() {
        let old_tput = old_conc.len() as f64 / old_conc_wall.as_secs_f64();
        report.throughput(
            local(
                "local.conc16.baseline_bin",
                "POST /execute echo hi (16 in flight, baseline binary)",
                None,
            ),
            &old_conc,
            old_conc_errors,
            old_tput,
        );
        report.before("local.conc16.tput_vs_bwrap16", old_tput / bw_tput);
    }
    report.write();
}
