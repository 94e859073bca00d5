//! Benchmark: live output over Server-Sent Events, on the backend `SANDBOX_RUNTIME` names
//! (`local`, `runc`, `gvisor`).
//!
//! 1. Line latency: a python3 run prints its wall clock on a line every 50 ms; for every `stdout`
//!    event the client subtracts the oldest stamp the event carries from the time it read the
//!    event. Same-run baseline: the same script as a plain child process of this benchmark,
//!    read from its stdout pipe (the floor any transport sits on).
//! 2. Streaming overhead: `echo hi` as a synchronous call against the same call streamed (until
//!    its `result` event is read), interleaved in blocks of 25 so load changes weigh on both.
//!
//! Targets: line latency p50 at most 5 ms; streaming p50 at most 1.1x the JSON call's.
//!
//! Run: `scripts/bench-stream.sh` (builds release and runs this as root). Prints p50/p95/p99 and
//! the ratios; `BENCH_JSON=<path>` also writes them as JSON, `BENCH_QUICK=1` takes a tenth of the
//! samples (see `scripts/bench.sh`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use executor_arm::config::TokenKind;
use support::report::{Report, Series, Target, count};

mod support;

const LINES: usize = 20;
const LATENCY_RUNS: usize = 15;
const ECHO_N: usize = 200;
const BLOCK: usize = 25;
const WARMUP: usize = 10;

const SCRIPT: &str = "import time\nfor i in range(20):\n    print(repr(time.time()), flush=True)\n    time.sleep(0.05)";

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Milliseconds between each line's stamp and when this process read it from a pipe.
fn pipe_latencies(out: &mut Vec<f64>) {
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let read = now();
        let stamp: f64 = line.unwrap().trim().parse().unwrap();
        out.push((read - stamp) * 1000.0);
    }
    child.wait().unwrap();
}

/// Reads SSE events from a response; calls `on` with each event's name and data.
async fn read_events(mut resp: reqwest::Response, mut on: impl FnMut(&str, &serde_json::Value)) {
    let mut buf = String::new();
    while let Some(chunk) = resp.chunk().await.expect("stream") {
        buf.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let mut event = "";
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    event = v;
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push_str(v);
                }
            }
            if !event.is_empty() {
                let v: serde_json::Value = serde_json::from_str(&data).expect("json");
                on(event, &v);
            }
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let runtime = std::env::var("SANDBOX_RUNTIME").unwrap_or_else(|_| "local".into());
    let (latency_runs, echo_n, warmup) = (
        count(LATENCY_RUNS, 3),
        count(ECHO_N, 2 * BLOCK),
        count(WARMUP, 3),
    );
    let daemon = support::Daemon::start(&[("SANDBOX_RUNTIME", runtime.as_str())]);
    let addr = daemon.addr.clone();
    let mint = |kind, caps: &[&str]| daemon.mint(kind, caps);
    let svc = format!("Bearer {}", mint(TokenKind::Service, &[]));
    let cap = mint(TokenKind::Capability, &["ShellExecute", "PythonExecute"]);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .expect("client");
    let url = format!("http://{addr}/execute");
    let post = |body: serde_json::Value, stream: bool| {
        let mut rb = client
            .post(&url)
            .header("authorization", &svc)
            .header("content-type", "application/json")
            .body(body.to_string());
        if stream {
            rb = rb.header("accept", "text/event-stream");
        }
        rb.send()
    };

    // 1. Line latency.
    let py = serde_json::json!({"action_type": "python", "command": "python3", "args": ["-c", SCRIPT], "capability_token": cap});
    let (mut sse, mut pipe) = (Vec::new(), Vec::new());
    for run in 0..latency_runs + 1 {
        let resp = post(py.clone(), true).await.expect("request");
        assert!(resp.status().is_success(), "{}", resp.status());
        let mut lat = Vec::new();
        let mut lines = 0;
        read_events(resp, |event, data| {
            if event == "stdout" {
                let read = now();
                let text = data["data"].as_str().expect("text");
                let first: f64 = text.lines().next().unwrap().trim().parse().unwrap();
                lines += text.lines().count();
                lat.push((read - first) * 1000.0);
            }
        })
        .await;
        assert_eq!(lines, LINES, "every line streamed");
        let mut p = Vec::new();
        pipe_latencies(&mut p);
        // The first run warms the pool / caches.
        if run > 0 {
            sse.extend(lat);
            pipe.extend(p);
        }
    }

    // 2. Overhead on echo hi.
    let echo = serde_json::json!({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap});
    let sync_once = || async {
        let t = Instant::now();
        let r = post(echo.clone(), false).await.expect("request");
        let text = r.text().await.expect("body");
        assert!(text.contains("\"stdout\":\"hi\\n\""), "{text}");
        t.elapsed().as_secs_f64() * 1000.0
    };
    let stream_once = || async {
        let t = Instant::now();
        let r = post(echo.clone(), true).await.expect("request");
        let mut got = false;
        read_events(r, |event, data| {
            if event == "result" {
                got = data["stdout"] == "hi\n";
            }
        })
        .await;
        assert!(got, "streamed result");
        t.elapsed().as_secs_f64() * 1000.0
    };
    for _ in 0..warmup {
        sync_once().await;
        stream_once().await;
    }
    let (mut sync, mut streamed) = (Vec::new(), Vec::new());
    for _ in 0..echo_n / BLOCK {
        for _ in 0..BLOCK {
            sync.push(sync_once().await);
        }
        for _ in 0..BLOCK {
            streamed.push(stream_once().await);
        }
    }
    drop(daemon);

    println!(
        "executor-arm streaming benchmark, SANDBOX_RUNTIME={runtime} ({latency_runs} runs of \
         {LINES} lines 50 ms apart; {echo_n} echo calls per series in blocks of {BLOCK})"
    );
    let mut report = Report::new(&format!("stream-{runtime}"), 52);
    report.fact("backend", runtime.as_str());
    report.fact("latency_runs", latency_runs);
    report.fact("lines_per_run", LINES);
    report.fact("echo_n", echo_n);
    report.fact("block", BLOCK);
    let id = |what: &str| format!("stream.{runtime}.{what}");
    let (line_sse, line_pipe) = (id("line_sse"), id("line_pipe"));
    let (echo_json, echo_sse) = (id("echo_json"), id("echo_sse"));
    let series = |id, label, baseline| Series {
        id,
        label,
        backend: &runtime,
        baseline,
    };
    let p_sse = report.series(
        series(
            &line_sse,
            "line written -> SSE event read",
            Some(&line_pipe),
        ),
        &sse,
    );
    let p_pipe = report.series(
        series(
            &line_pipe,
            "line written -> read from a pipe (baseline)",
            None,
        ),
        &pipe,
    );
    report.target(
        &id("line_sse.p50"),
        &format!("line latency p50 ({runtime})"),
        p_sse.p50,
        "ms",
        Target::AtMost(5.0),
    );
    println!("{:.3} ms above the pipe", p_sse.p50 - p_pipe.p50);
    report.fact("line_p50_above_pipe_ms", p_sse.p50 - p_pipe.p50);
    let p_sync = report.series(
        series(&echo_json, "POST /execute echo hi (JSON)", None),
        &sync,
    );
    let p_stream = report.series(
        series(
            &echo_sse,
            "POST /execute echo hi (SSE, to the result event)",
            Some(&echo_json),
        ),
        &streamed,
    );
    report.ratio(
        &id("echo_sse_vs_json"),
        &format!("p50 streamed / JSON ({runtime})"),
        p_stream.p50 / p_sync.p50,
        Some(Target::AtMost(1.1)),
    );
    report.write();
}
