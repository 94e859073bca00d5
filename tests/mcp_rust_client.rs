//! `/mcp` driven by the official Rust MCP SDK's own client (`rmcp`, Streamable HTTP over
//! reqwest), without Python: the tool list, `execute`, a session with a file written, run,
//! read and listed, an async run started and cancelled, another tenant's session as not found,
//! and no token refused before the protocol starts.

mod common;

use std::collections::HashMap;

use axum::http::{HeaderName, HeaderValue};
use common::Daemon;
use common::wait::wait_for_async;
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::{Value, json};

type Client = RunningService<RoleClient, ()>;

/// A service token whose capabilities are the grant of calls that carry no capability token.
fn service_token(d: &Daemon) -> String {
    d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec![
            "ShellExecute".into(),
            "PythonExecute".into(),
            "FilesystemRead".into(),
            "FilesystemWrite".into(),
        ],
        ..Default::default()
    })
}

fn config(d: &Daemon, token: &str, tenant: &str) -> StreamableHttpClientTransportConfig {
    let mut headers = HashMap::new();
    headers.insert(
        HeaderName::from_static("x-tenant-id"),
        HeaderValue::from_str(tenant).expect("tenant header"),
    );
    StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", d.base))
        .auth_header(token.to_string())
        .custom_headers(headers)
}

async fn connect(d: &Daemon, token: &str, tenant: &str) -> Client {
    ().serve(StreamableHttpClientTransport::from_config(config(
        d, token, tenant,
    )))
    .await
    .expect("initialize the MCP session")
}

async fn call(c: &Client, tool: &'static str, args: Value) -> CallToolResult {
    let Value::Object(args) = args else {
        unreachable!("tool arguments are objects")
    };
    c.call_tool(CallToolRequestParams::new(tool).with_arguments(args))
        .await
        .unwrap_or_else(|e| panic!("{tool}: {e}"))
}

/// The structured result of a call that succeeded.
fn ok(r: &CallToolResult) -> Value {
    assert_ne!(r.is_error, Some(true), "{r:?}");
    r.structured_content.clone().expect("structuredContent")
}

/// The REST error body of a call that failed.
fn err(r: &CallToolResult) -> Value {
    assert_eq!(r.is_error, Some(true), "{r:?}");
    r.structured_content.clone().expect("structuredContent")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_sdk_client_runs_tools_and_sessions() {
    let d = Daemon::start();
    let token = service_token(&d);
    let c = connect(&d, &token, "team-a").await;

    let names: Vec<String> = c
        .list_all_tools()
        .await
        .expect("tools/list")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    for tool in [
        "execute",
        "session_create",
        "session_exec",
        "files_read",
        "run_cancel",
    ] {
        assert!(names.iter().any(|n| n == tool), "{tool} in {names:?}");
    }

    let r = ok(&call(
        &c,
        "execute",
        json!({"action_type": "shell", "command": "echo", "args": ["from rmcp"]}),
    )
    .await);
    assert_eq!(
        (r["exit_code"].as_i64(), r["stdout"].as_str()),
        (Some(0), Some("from rmcp\n"))
    );
    let e = err(&call(
        &c,
        "execute",
        json!({"action_type": "shell", "command": "rm"}),
    )
    .await);
    assert_eq!(e["error_type"], "CapabilityViolation", "{e}");

    // A session: a file in, code that reads it, the file it wrote out, the listing.
    let ses = ok(&call(&c, "session_create", json!({"language": "python"})).await);
    let sid = ses["id"].as_str().expect("session id").to_string();
    ok(&call(
        &c,
        "files_write",
        json!({"session_id": sid, "path": "in.txt", "content": "rust sdk\n"}),
    )
    .await);
    let r = ok(&call(
        &c,
        "session_exec",
        json!({"session_id": sid, "code": "t = open('in.txt').read()\nopen('out.txt', 'w').write(t.upper())\nprint(t.strip())"}),
    )
    .await);
    assert_eq!(r["stdout"], "rust sdk\n", "{r}");
    let r = ok(&call(
        &c,
        "files_read",
        json!({"session_id": sid, "path": "out.txt"}),
    )
    .await);
    assert_eq!(r["content"], "RUST SDK\n", "{r}");
    let r = ok(&call(&c, "files_list", json!({"session_id": sid})).await);
    let mut listed: Vec<&str> = r["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    listed.sort();
    assert_eq!(listed, ["in.txt", "out.txt"], "{r}");

    // Another tenant of the same service finds nothing of it.
    let other = connect(&d, &token, "team-b").await;
    for (tool, args) in [
        ("files_read", json!({"session_id": sid, "path": "in.txt"})),
        (
            "session_exec",
            json!({"session_id": sid, "code": "print(1)"}),
        ),
        ("session_delete", json!({"session_id": sid})),
    ] {
        let e = err(&call(&other, tool, args).await);
        assert_eq!(e["error_type"], "NotFound", "{tool}: {e}");
    }
    let _ = other.cancel().await;

    // An async run: started, cancelled, finished as cancelled.
    let r = ok(&call(
        &c,
        "run_start",
        json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(120)"], "timeout_seconds": 600}),
    )
    .await);
    let exec_id = r["exec_id"].as_str().expect("exec_id").to_string();
    let r = ok(&call(
        &c,
        "run_cancel",
        json!({"exec_id": exec_id, "grace_seconds": 0}),
    )
    .await);
    assert_eq!(r["status"], "cancelling", "{r}");
    let done = wait_for_async(
        "the cancelled run to finish",
        std::time::Duration::from_secs(30),
        || async { ok(&call(&c, "run_status", json!({"exec_id": exec_id})).await) },
        |s| s["status"] == "finished",
    )
    .await;
    assert_eq!(done["result"]["outcome"], "cancelled", "{done}");

    let r = ok(&call(&c, "session_delete", json!({"session_id": sid})).await);
    assert_eq!(r, json!({"session_id": sid, "deleted": true}));
    let _ = c.cancel().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_sdk_client_without_a_valid_token_is_refused() {
    let d = Daemon::start();
    let refused = ()
        .serve(StreamableHttpClientTransport::from_config(config(
            &d,
            "not-a-token",
            "team-a",
        )))
        .await;
    assert!(refused.is_err(), "initialize with a bad token succeeded");
}
