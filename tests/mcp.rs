//! `/mcp` driven by a real MCP client: the official MCP Python SDK (pinned in
//! scripts/mcp-client-venv.sh) runs tests/mcp/test_mcp.py against a daemon on the local backend:
//! the session era and the stateless revision, every tool, errors as the REST bodies, progress
//! notifications, 401 and 403 admission, and the audit lines of an MCP run against its REST
//! twin's; and the official conformance suite (npm, pinned in scripts/mcp-conformance.sh).

mod common;

use std::path::Path;
use std::process::Command;

use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;

/// The venv's python, made (or found cached) by scripts/mcp-client-venv.sh.
fn python() -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(repo.join("scripts/mcp-client-venv.sh"))
        .output()
        .expect("run scripts/mcp-client-venv.sh");
    assert!(
        out.status.success(),
        "scripts/mcp-client-venv.sh failed (it installs the MCP Python SDK from PyPI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .last()
        .expect("the venv's python")
        .trim()
        .to_string()
}

#[test]
fn python_sdk_drives_mcp() {
    let python = python();
    let d = Daemon::start_with(Opts::default());
    // The service token's capabilities are the grant of calls without a capability token.
    let service = d.mint(MintRequest {
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
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/test_mcp.py");
    let out = Command::new(&python)
        .arg(&script)
        .env("MCP_BASE", &d.base)
        .env("MCP_SERVICE_TOKEN", &service)
        .env("MCP_CAPABILITY_TOKEN", d.cap_all())
        .env("MCP_AUDIT_LOG", &d.audit)
        .output()
        .expect("run the MCP client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("mcp: OK"),
        "{} failed:\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Serves on a loopback port what `target` serves, with `Authorization: Bearer <token>` added to
/// every request (the conformance suite sends no credentials). Host and everything else pass
/// unchanged.
async fn bearer_proxy(target: String, token: String) -> String {
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the proxy");
    let addr = listener.local_addr().expect("proxy address");
    let auth = hyper::header::HeaderValue::from_str(&format!("Bearer {token}")).expect("header");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (target, auth) = (target.clone(), auth.clone());
            let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
                let (target, auth) = (target.clone(), auth.clone());
                async move {
                    req.headers_mut().insert(hyper::header::AUTHORIZATION, auth);
                    let upstream = tokio::net::TcpStream::connect(&target).await?;
                    let (mut sender, conn) =
                        hyper::client::conn::http1::handshake(TokioIo::new(upstream))
                            .await
                            .map_err(std::io::Error::other)?;
                    tokio::spawn(conn);
                    sender
                        .send_request(req)
                        .await
                        .map_err(std::io::Error::other)
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    format!("http://{addr}/mcp")
}

/// The official MCP conformance suite's server scenarios that concern a server with these tools
/// (the others call the suite's own test tools, or need resources, prompts, completions or
/// sampling): the handshake, ping, the tool list, SSE streams, and the DNS rebinding protection
/// (`Host` and `Origin`). The daemon is reached through a proxy that adds the service token.
#[tokio::test]
async fn conformance_suite() {
    let d = Daemon::start_with(Opts::default());
    let url = bearer_proxy(d.addr.clone(), d.service_token()).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mcp-conformance.sh");
    let scenarios = [
        "server-initialize",
        "ping",
        "tools-list",
        "server-sse-multiple-streams",
        "server-sse-polling",
        "dns-rebinding-protection",
    ];
    let out = tokio::process::Command::new(&script)
        .arg(&url)
        .args(scenarios)
        .output()
        .await
        .expect("run scripts/mcp-conformance.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the conformance suite failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
