//! `/mcp` driven by a real MCP client: the official MCP Python SDK (pinned in
//! scripts/mcp-client-venv.sh) runs tests/mcp/test_mcp.py against a daemon on the local backend
//! and on runc:
//! the session era and the stateless revision, every tool, errors as the REST bodies, progress
//! notifications, 401 and 403 admission, and the audit lines of an MCP run against its REST
//! twin's; and the official conformance suite (npm, pinned in scripts/mcp-conformance.sh).

mod common;

use std::path::Path;
use std::process::Command;

use common::backends::Backend;
use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;

/// The venv's python, made (or found cached) by scripts/mcp-client-venv.sh.
fn python() -> String {
    common::venv_python("mcp-client-venv.sh")
}

#[test]
fn python_sdk_drives_mcp() {
    drive_with_python_sdk(Opts::default());
}

/// The same calls with runs and sessions in runc containers.
#[test]
fn python_sdk_drives_mcp_on_runc() {
    drive_with_python_sdk(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), Backend::Docker.runtime().into())],
        config: Some(common::docker::config(1, common::docker::SOCKET)),
        ..Default::default()
    });
}

/// tests/mcp/test_mcp.py against a daemon started with `opts`.
fn drive_with_python_sdk(opts: Opts) {
    let python = python();
    let d = Daemon::start_with(opts);
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

/// What a stand-in replica received: each request's method, path and headers.
type Received = std::sync::Arc<std::sync::Mutex<Vec<(String, String, hyper::HeaderMap)>>>;

/// A replica stand-in on a loopback port that records every request: a session exec is answered
/// after `exec_delay` (a synchronous exec's answer begins when its run ends) with a result, any
/// other call with the REST 404 of an unknown session.
async fn peer_replica(exec_delay: std::time::Duration) -> (String, Received) {
    use http_body_util::Full;
    use hyper::body::{Bytes, Incoming};
    use hyper_util::rt::TokioIo;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the peer");
    let addr = listener.local_addr().expect("peer address");
    let received: Received = Default::default();
    let log = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let log = log.clone();
                async move {
                    let path = req.uri().to_string();
                    log.lock().unwrap().push((
                        req.method().to_string(),
                        path.clone(),
                        req.headers().clone(),
                    ));
                    let (status, body) = if path.ends_with("/exec") {
                        tokio::time::sleep(exec_delay).await;
                        (
                            200,
                            r#"{"success":true,"exit_code":0,"stdout":"from the peer\n","stderr":""}"#,
                        )
                    } else {
                        (
                            404,
                            r#"{"success":false,"error":"Session not found","error_type":"NotFound","retryable":false}"#,
                        )
                    };
                    let resp = hyper::Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(body.as_bytes())))
                        .expect("answer");
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (format!("http://{addr}"), received)
}

/// `/mcp` as a hostile or unlucky client meets it, beside the REST twin of each call: a session
/// another replica holds (the state store says where) whose replica cannot be reached is an
/// unknown session that names no address; one whose replica answers a synchronous exec only
/// after a while (longer than a cancel's wait) has that answer relayed, with the caller's
/// credentials and tenant and nothing else of the `/mcp` request; `files_write` is bounded by
/// `sessions.max_file_bytes` as the REST `PUT` is; a single-use service token grants the one
/// call it authenticates; an MCP session is the calling service's that opened it.
#[tokio::test]
async fn mcp_edges() {
    let python = python();
    let url = std::env::var("EXECUTOR_ARM_TEST_REDIS_URL").expect(
        "EXECUTOR_ARM_TEST_REDIS_URL is not set: start redis-server --port 6390 and set it to \
         redis://127.0.0.1:6390/0",
    );
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_REDIS_URL".into(), url.clone())],
        config: Some("[sessions]\nmax_file_bytes = 4096\n".into()),
        ..Default::default()
    });
    let caps = vec![
        "ShellExecute".to_string(),
        "PythonExecute".into(),
        "FilesystemRead".into(),
        "FilesystemWrite".into(),
    ];
    let service = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: caps.clone(),
        ..Default::default()
    });
    let single_use = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: caps,
        single_use: true,
        ..Default::default()
    });

    let other = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("intruder".into()),
        ..Default::default()
    });

    // A replica that answers a synchronous exec after 35 s, and one that is gone.
    let (peer, received) = peer_replica(std::time::Duration::from_secs(35)).await;
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", l.local_addr().expect("address"))
    };
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (held_by_peer, held_by_gone) = (format!("ses_peer{suffix}"), format!("ses_gone{suffix}"));
    let mut redis = redis::Client::open(url.as_str())
        .and_then(|c| c.get_connection())
        .expect("redis");
    for (id, instance, address) in [
        (&held_by_peer, "i-peer", &peer),
        (&held_by_gone, "i-gone", &gone),
    ] {
        let record = serde_json::json!({"instance": instance, "address": address}).to_string();
        let _: () = redis::cmd("SET")
            .arg(format!("executor-arm:session:{id}"))
            .arg(record)
            .query(&mut redis)
            .expect("record the session");
    }

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/test_mcp_edges.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .env("MCP_BASE", &d.base)
        .env("MCP_SERVICE_TOKEN", &service)
        .env("MCP_SINGLE_USE_TOKEN", &single_use)
        .env("MCP_OTHER_SERVICE_TOKEN", &other)
        .env("MCP_PEER_SESSION", &held_by_peer)
        .env("MCP_GONE_SESSION", &held_by_gone)
        .env("MCP_GONE_ADDRESS", &gone)
        .output()
        .await
        .expect("run the MCP client");
    for id in [&held_by_peer, &held_by_gone] {
        let _: () = redis::cmd("DEL")
            .arg(format!("executor-arm:session:{id}"))
            .query(&mut redis)
            .expect("forget the session");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("mcp edges: OK"),
        "{} failed:\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );

    // The held session's calls reached its replica as their REST twins: the caller's own
    // credentials and tenant, marked forwarded, ids and paths encoded, no other header of the
    // `/mcp` request.
    let received = received.lock().unwrap().clone();
    let exec = received
        .iter()
        .find(|(m, p, _)| m == "POST" && p == &format!("/v1/sandbox/sessions/{held_by_peer}/exec"))
        .unwrap_or_else(|| panic!("no exec reached the replica: {received:?}"));
    let h = &exec.2;
    assert_eq!(h["authorization"], format!("Bearer {service}").as_str());
    assert_eq!(h["x-tenant-id"], "tenant-edges");
    assert!(h.contains_key("x-executor-arm-forwarded"), "{h:?}");
    assert!(
        !h.contains_key("cookie") && !h.contains_key("x-smuggled"),
        "{h:?}"
    );
    let read = received
        .iter()
        .find(|(m, _, _)| m == "GET")
        .unwrap_or_else(|| panic!("no file read reached the replica: {received:?}"));
    assert_eq!(
        read.1,
        format!("/v1/sandbox/sessions/{held_by_peer}/files/a/..%3Fx%23y"),
        "{received:?}"
    );
}
