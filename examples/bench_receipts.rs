//! Benchmark: what a run's receipt costs.
//!
//! 1. In process: making one receipt as the execution service makes it at a run's end (the
//!    statement's JSON, the Ed25519 signature over DSSE's pre-authentication encoding, the
//!    envelope's JSON), one at a time. Every run that ends with an outcome pays this, whether
//!    its caller asks for the receipt or not.
//! 2. End to end, on the local backend: `POST /execute` of `echo hi` with `"receipt": true`
//!    against the same request without it, one at a time on a kept connection, interleaved in
//!    blocks of 25 so load changes weigh on both. Both runs are signed; the first also carries
//!    the envelope in its answer.
//!
//! Target: signing adds at most 0.3 ms at p50 (the in-process p50 of a receipt).
//!
//! Run: `scripts/bench-receipts.sh` (builds release and runs this as root). Prints p50/p95/p99
//! and the ratio; `BENCH_JSON=<path>` also writes them as JSON, `BENCH_QUICK=1` takes a tenth of
//! the samples.

use std::time::Instant;

use executor_arm::config::TokenKind;
use executor_arm::provenance::keys::SigningKey;
use executor_arm::provenance::receipt::{
    AuditPosition, Receipt, RunLimits, RunResult, Statement, Subject, What, When, Who, sign_receipt,
};
use support::report::{Report, Series, Target, count};

mod support;

const N: usize = 400;
const SIGN_N: usize = 5000;
const BLOCK: usize = 25;
const WARMUP: usize = 10;

/// A statement the size of an `echo` run's.
fn statement(i: usize) -> Statement {
    let h = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    Statement::new(
        vec![
            Subject::sha256("command", &h('a')),
            Subject::sha256("stdout", &h('b')),
            Subject::sha256("stderr", &h('c')),
        ],
        Receipt {
            who: Who {
                subject: Some("orchestrator".into()),
                token_id: Some("7c1f0e2a-4f7b-4d7e-9a55-3f1b2c3d4e5f".into()),
                tenant: None,
            },
            what: What {
                exec_id: format!("0190f3a4-6c1d-7b2e-9f00-{i:012}"),
                request_id: format!("req-{i}"),
                action_type: "shell".into(),
                command_hash: h('a'),
                invocation_hash: h('d'),
                profile: "shell-readonly".into(),
                backend: "local".into(),
                limits: RunLimits {
                    timeout_seconds: 30,
                    cpus: 1.0,
                    memory_bytes: 512 << 20,
                    disk_bytes: 1 << 30,
                    pids: 64,
                    output_bytes: 1 << 20,
                    on_overflow: "truncate".into(),
                    nofile: 256,
                },
                session_id: None,
                executor_def_sha256: None,
            },
            result: RunResult {
                outcome: "success".into(),
                exit_code: 0,
                killed_reason: None,
                duration_ms: 4,
                peak_memory_kib: Some(1800),
                oom: false,
                stdout_truncated: false,
                stderr_truncated: false,
                error_code: None,
                network: vec![],
            },
            when: When {
                started_at: "2026-11-29T22:00:00.000Z".into(),
                ended_at: "2026-11-29T22:00:00.004Z".into(),
            },
            audit: AuditPosition {
                audit_seq: i as u64,
                entry_hash: h('e'),
            },
        },
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // 1. In process.
    let key = SigningKey::from_bytes(&rand::random());
    let sign_n = count(SIGN_N, 100);
    let mut signing = Vec::with_capacity(sign_n);
    for i in 0..sign_n + 100 {
        let st = statement(i);
        let t = Instant::now();
        let env = sign_receipt(&st, &key).expect("sign");
        let json = serde_json::to_string(&env).expect("envelope JSON");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        assert!(json.len() > 100);
        if i >= 100 {
            signing.push(ms);
        }
    }

    // 2. End to end.
    let d = support::Daemon::start(&[]);
    let n = count(N, 2 * BLOCK);
    let base = format!("http://{}", d.addr);
    let svc = d.mint(TokenKind::Service, &[]);
    let cap = d.mint(TokenKind::Capability, &["ShellExecute"]);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(2)
        .build()
        .expect("client");
    let body = |receipt: bool| {
        serde_json::json!({
            "action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap,
            "receipt": receipt,
        })
        .to_string()
    };
    let (with, without) = (body(true), body(false));
    let run = |body: String, receipt: bool| {
        let (client, base, svc) = (&client, &base, &svc);
        async move {
            let t = Instant::now();
            let r = client
                .post(format!("{base}/execute"))
                .header("authorization", format!("Bearer {svc}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("execute");
            let v: serde_json::Value = r.json().await.expect("json");
            let ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(v["stdout"], "hi\n", "{v}");
            assert_eq!(v.get("receipt").is_some(), receipt, "{v}");
            ms
        }
    };
    for _ in 0..count(WARMUP, 3) {
        run(with.clone(), true).await;
        run(without.clone(), false).await;
    }
    let (mut a, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
    while a.len() < n {
        for _ in 0..BLOCK {
            a.push(run(with.clone(), true).await);
        }
        for _ in 0..BLOCK {
            b.push(run(without.clone(), false).await);
        }
    }

    println!(
        "in process: {sign_n} receipts; local backend: {n} runs each, interleaved in blocks of {BLOCK}"
    );
    let mut report = Report::new("receipts-local", 56);
    report.fact("backend", "local");
    report.fact("n", n);
    report.fact("sign_n", sign_n);
    report.fact("block", BLOCK);
    let s = report.series(
        Series {
            id: "receipts.sign",
            label: "one receipt made and signed (in process)",
            backend: "-",
            baseline: None,
        },
        &signing,
    );
    let x = report.series(
        Series {
            id: "receipts.local.inline",
            label: "POST /execute echo hi, \"receipt\": true",
            backend: "local",
            baseline: Some("receipts.local.plain"),
        },
        &a,
    );
    let y = report.series(
        Series {
            id: "receipts.local.plain",
            label: "POST /execute echo hi (baseline)",
            backend: "local",
            baseline: None,
        },
        &b,
    );
    report.ratio(
        "receipts.local.inline_vs_plain",
        "p50 with \"receipt\": true / without (local)",
        x.p50 / y.p50,
        None,
    );
    report.target(
        "receipts.sign_p50",
        "signing a receipt, p50",
        s.p50,
        "ms",
        Target::AtMost(0.3),
    );
    report.write();
}
