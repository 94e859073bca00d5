//! Benchmark: `execute` of `echo hi` through `/mcp` against `POST /execute` of the same command,
//! on the local backend, one request at a time, interleaved in blocks of 25 so load changes weigh
//! on both.
//!
//! The MCP client is the official Rust SDK's (`rmcp`, Streamable HTTP over reqwest, one MCP
//! session kept open, as an agent holds it); the REST client is reqwest on a kept connection.
//! Each MCP call is a JSON-RPC `tools/call` answered with its result (no progress token: the
//! synchronous run); its figure includes the SDK's own JSON-RPC work on both ends.
//!
//! Target: the MCP p50 at most 1.2x the `/execute` p50.
//!
//! Run: `scripts/bench-mcp.sh` (builds release and runs this as root). Prints p50/p95/p99 and the
//! ratio; `BENCH_JSON=<path>` also writes them as JSON, `BENCH_QUICK=1` takes a tenth of the
//! samples.

use std::time::Instant;

use executor_arm::config::TokenKind;
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use support::report::{Report, Series, Target, count};

mod support;

const N: usize = 200;
const BLOCK: usize = 25;
const WARMUP: usize = 10;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let d = support::Daemon::start(&[]);
    let n = count(N, 2 * BLOCK);
    let base = format!("http://{}", d.addr);
    // MCP calls without a capability token have the service token's capabilities as grant.
    let svc = d.mint(TokenKind::Service, &["ShellExecute"]);
    let cap = d.mint(TokenKind::Capability, &["ShellExecute"]);
    let rest = reqwest::Client::builder()
        .pool_max_idle_per_host(2)
        .build()
        .expect("client");
    let mcp = ()
        .serve(StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(format!("{base}/mcp"))
                .auth_header(svc.clone()),
        ))
        .await
        .expect("initialize the MCP session");
    let args = serde_json::json!({"action_type": "shell", "command": "echo", "args": ["hi"]});
    let serde_json::Value::Object(args) = args else {
        unreachable!()
    };
    let via_mcp = || async {
        let t = Instant::now();
        let r = mcp
            .call_tool(CallToolRequestParams::new("execute").with_arguments(args.clone()))
            .await
            .expect("tools/call");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let s = r.structured_content.expect("structuredContent");
        assert_eq!(s["stdout"], "hi\n", "{s}");
        ms
    };
    let body = serde_json::json!({
        "action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap,
    })
    .to_string();
    let via_rest = || async {
        let t = Instant::now();
        let r = rest
            .post(format!("{base}/execute"))
            .header("authorization", format!("Bearer {svc}"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .expect("execute");
        let v: serde_json::Value = r.json().await.expect("json");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(v["stdout"], "hi\n", "{v}");
        ms
    };
    for _ in 0..count(WARMUP, 3) {
        via_mcp().await;
        via_rest().await;
    }
    let (mut m, mut r) = (Vec::with_capacity(n), Vec::with_capacity(n));
    while m.len() < n {
        for _ in 0..BLOCK {
            m.push(via_mcp().await);
        }
        for _ in 0..BLOCK {
            r.push(via_rest().await);
        }
    }
    println!("local backend, {n} each, interleaved in blocks of {BLOCK}");
    let mut report = Report::new("mcp-local", 52);
    report.fact("backend", "local");
    report.fact("n", n);
    report.fact("block", BLOCK);
    let a = report.series(
        Series {
            id: "mcp.local.execute",
            label: "MCP tools/call execute echo hi",
            backend: "local",
            baseline: Some("mcp.local.rest"),
        },
        &m,
    );
    let b = report.series(
        Series {
            id: "mcp.local.rest",
            label: "POST /execute echo hi (baseline)",
            backend: "local",
            baseline: None,
        },
        &r,
    );
    report.ratio(
        "mcp.local.execute_vs_rest",
        "p50 MCP execute / POST /execute (local)",
        a.p50 / b.p50,
        Some(Target::AtMost(1.2)),
    );
    report.write();
    let _ = mcp.cancel().await;
}
