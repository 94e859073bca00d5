//! Several replicas share replay and idempotency state through a real redis-server.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use serde_json::json;

struct Redis {
    child: Child,
    url: String,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a private redis-server on a free loopback port. Missing redis-server is a failure
/// (the test command installs it).
fn redis() -> Redis {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!("redis-server is not installed (scripts/test-all.sh installs it)");
    }
    let port = free_port();
    serve_redis(
        &["--port", &port.to_string()],
        port,
        format!("redis://127.0.0.1:{port}/0"),
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts redis-server with `args` (loopback only, no persistence) and waits until `port` takes
/// connections; the guard kills and reaps it.
fn serve_redis(args: &[&str], port: u16, url: String) -> Redis {
    let child = Command::new("redis-server")
        .args(args)
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server");
    let redis = Redis { child, url };
    common::wait::wait_until(
        "redis-server to accept connections",
        common::wait::CLEANUP,
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
    );
    redis
}

/// Starts a private redis-server that speaks TLS only, with a certificate for 127.0.0.1 signed
/// by a CA made here; returns it and the CA's PEM file.
fn redis_tls(dir: &std::path::Path) -> (Redis, std::path::PathBuf) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=executor-arm test CA",
        "-days",
        "1",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    ]);
    let port = free_port();
    let file = |f: &str| dir.join(f).to_string_lossy().into_owned();
    let redis = serve_redis(
        &[
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &file("server.pem"),
            "--tls-key-file",
            &file("server.key"),
            "--tls-ca-cert-file",
            &file("ca.pem"),
            "--tls-auth-clients",
            "no",
        ],
        port,
        format!("rediss://127.0.0.1:{port}/0"),
    );
    (redis, dir.join("ca.pem"))
}

fn replica(url: &str) -> Daemon {
    Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_REDIS_URL".into(), url.into())],
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_share_replay_and_idempotency_state() {
    let redis = redis();
    let a = replica(&redis.url);
    let b = replica(&redis.url);
    assert_eq!(a.get("/readyz").await.json["state_store"], json!("redis"));

    // A single-use token used on A is a replay on B.
    let once = a.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 60,
        aud: "executor-arm".into(),
        capabilities: vec!["ShellExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let r = a.exec(json!({"action_type": "shell", "command": "echo", "args": ["once"], "capability_token": once})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = b.exec(json!({"action_type": "shell", "command": "echo", "args": ["once"], "capability_token": once})).await;
    assert_eq!(r.status, 401, "{}", r.text);

    // An idempotency key finished on A returns A's stored result on B, without running there.
    let svc = format!("Bearer {}", a.service_token());
    let body = json!({"action_type": "python", "command": "python3", "args": ["-c", "import uuid; print(uuid.uuid4())"], "capability_token": a.cap_all()}).to_string();
    let h = [
        ("authorization", svc.as_str()),
        ("idempotency-key", "shared-key-1"),
    ];
    let first = a.post("/execute", &h, body.clone()).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let second = b.post("/execute", &h, body).await;
    assert_eq!(second.status, 200, "{}", second.text);
    assert_eq!(second.json["exec_id"], first.json["exec_id"]);
    assert_eq!(second.json["stdout"], first.json["stdout"]);
    assert_eq!(second.headers.get("idempotent-replayed").unwrap(), "true");
    assert!(
        b.audit_lines()
            .iter()
            .all(|l| !l["event"].as_str().unwrap_or("").starts_with("execution")),
        "B admitted and ran nothing"
    );
}

/// `rediss://`: replicas share their state over TLS, and a server whose certificate the daemon
/// cannot verify is refused (the daemon does not start).
#[tokio::test(flavor = "multi_thread")]
async fn replicas_share_state_over_tls_and_check_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let (redis, ca) = redis_tls(dir.path());
    let with_ca = |url: &str| {
        Daemon::start_with(Opts {
            env: vec![("EXECUTOR_ARM_REDIS_URL".into(), url.into())],
            config: Some(format!("[state]\nredis_ca_file = \"{}\"\n", ca.display())),
            ..Default::default()
        })
    };
    let a = with_ca(&redis.url);
    let b = with_ca(&redis.url);
    assert_eq!(a.get("/readyz").await.json["state_store"], json!("redis"));
    let once = a.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 60,
        aud: "executor-arm".into(),
        capabilities: vec!["ShellExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let body = json!({"action_type": "shell", "command": "echo", "args": ["once"], "capability_token": once});
    assert_eq!(a.exec(body.clone()).await.status, 200);
    assert_eq!(
        b.exec(body).await.status,
        401,
        "a replay across replicas over TLS"
    );

    // Without the CA the server's certificate is not trusted: the daemon refuses to start.
    let out = common::run_until_exit(&[("EXECUTOR_ARM_REDIS_URL", &redis.url)]);
    assert!(
        !out.status.success(),
        "started against an unverified server"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.to_ascii_lowercase().contains("certificate"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_down_is_a_clear_503_for_requests_that_need_it() {
    let mut redis = redis();
    let d = replica(&redis.url);
    let _ = redis.child.kill();
    let _ = redis.child.wait();

    let once = d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 60,
        aud: "executor-arm".into(),
        capabilities: vec!["ShellExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "capability_token": once}))
        .await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json["error_type"], json!("SandboxUnavailable"));
    assert!(
        r.json["error"].as_str().unwrap().contains("redis"),
        "{}",
        r.text
    );

    let svc = format!("Bearer {}", d.service_token());
    let body = json!({"action_type": "shell", "command": "echo", "capability_token": d.cap_all()})
        .to_string();
    let r = d
        .post(
            "/execute",
            &[("authorization", svc.as_str()), ("idempotency-key", "k")],
            body,
        )
        .await;
    assert_eq!(r.status, 503, "{}", r.text);

    // Every route that must ask the store where a session or a run is answers 503 too.
    let run = "/v1/executions/00000000-0000-4000-8000-000000000000";
    let ses = "/v1/sandbox/sessions/ses_0123456789abcdef0123456789abcdef";
    let exec = format!("{ses}/execs/00000000-0000-4000-8000-000000000000");
    let grace = r#"{"grace_seconds":0}"#;
    for (method, path, body) in [
        ("GET", run.to_string(), None),
        ("GET", format!("{run}/stream"), None),
        ("GET", format!("{run}/receipt"), None),
        ("POST", format!("{run}/cancel"), Some(grace)),
        ("GET", ses.to_string(), None),
        ("DELETE", ses.to_string(), None),
        (
            "POST",
            format!("{ses}/exec"),
            Some(r#"{"code":"print(1)"}"#),
        ),
        ("GET", exec.clone(), None),
        ("GET", format!("{exec}/stream"), None),
        ("GET", format!("{exec}/receipt"), None),
        ("POST", format!("{exec}/cancel"), Some(grace)),
        ("GET", format!("{ses}/files"), None),
        ("GET", format!("{ses}/files/a.txt"), None),
        ("PUT", format!("{ses}/files/a.txt"), Some("x")),
        ("GET", format!("{ses}/archive"), None),
        ("PUT", format!("{ses}/archive"), Some("x")),
        ("POST", format!("{ses}/pause"), None),
        ("POST", format!("{ses}/resume"), None),
        ("POST", format!("{exec}/stdin"), Some("x")),
        ("GET", format!("{ses}/processes"), None),
        ("GET", format!("{ses}/processes/p/stream"), None),
        ("GET", format!("{ses}/processes/p/output"), None),
        ("POST", format!("{ses}/processes/p/stdin"), Some("x")),
        (
            "POST",
            format!("{ses}/processes/p/signal"),
            Some(r#"{"signal":"TERM"}"#),
        ),
        ("GET", format!("{ses}/terminal"), None),
        ("GET", format!("{ses}/ports/8000/x"), None),
        ("POST", format!("{ses}/ports/8000/x"), Some("x")),
        ("PUT", format!("{ses}/ports/8000/x"), Some("x")),
        ("PATCH", format!("{ses}/ports/8000/x"), Some("x")),
        ("DELETE", format!("{ses}/ports/8000/x"), None),
        ("OPTIONS", format!("{ses}/ports/8000/x"), None),
        ("HEAD", format!("{ses}/ports/8000/x"), None),
    ] {
        let mut rb = d
            .client
            .request(method.parse().unwrap(), format!("{}{path}", d.base))
            .header("authorization", svc.as_str());
        if let Some(b) = body {
            rb = rb.header("content-type", "application/json").body(b);
        }
        let r = Daemon::read(rb.send().await.unwrap()).await;
        assert_eq!(r.status, 503, "{method} {path}: {}", r.text);
        if method == "HEAD" {
            // An answer to HEAD has no body.
            continue;
        }
        assert_eq!(
            r.json["error_type"],
            json!("SandboxUnavailable"),
            "{method} {path}"
        );
    }

    // Requests that need no shared state still run; readiness reports the store.
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["still"]}))
        .await;
    assert_eq!(r.json["stdout"], json!("still\n"));
    let ready = d.get("/readyz").await;
    assert_eq!(ready.status, 503);
    assert!(ready.text.contains("redis"), "{}", ready.text);
    assert_eq!(d.get("/health").await.status, 200);
}

/// A run started on one replica is read, streamed and cancelled through another: reading
/// answers from the shared store, streaming and cancelling are handed to the replica that runs
/// it; another calling service still gets 404 through either.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_started_on_one_replica_is_read_streamed_and_cancelled_through_another() {
    let redis = redis();
    let a = replica(&redis.url);
    let b = replica(&redis.url);
    let svc = format!("Bearer {}", a.service_token());
    let code =
        "import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.2)";
    let started = a
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", code], "async": true}))
        .await;
    assert_eq!(started.status, 202, "{}", started.text);
    let exec_id = started.json["exec_id"].as_str().unwrap().to_string();
    let get_b = |id: String| {
        let client = b.client.clone();
        let url = format!("{}/v1/executions/{id}", b.base);
        let svc = svc.clone();
        async move {
            let r = client
                .get(url)
                .header("authorization", svc)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (
                status,
                r.json::<serde_json::Value>().await.unwrap_or_default(),
            )
        }
    };
    let (status, body) = get_b(exec_id.clone()).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("running")),
        "{body}"
    );

    // Streamed through B, one event per line: every line and the result.
    let mut resp = b
        .client
        .get(format!(
            "{}/v1/executions/{exec_id}/stream?framing=lines",
            b.base
        ))
        .header("authorization", &svc)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut text = String::new();
    let mut counted_on_b = false;
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        // While B relays the stream, it counts it among its open streams.
        if !counted_on_b && !text.contains("event: result") {
            counted_on_b = b
                .get("/metrics")
                .await
                .text
                .contains("executor_open_streams 1\n");
        }
    }
    assert!(counted_on_b, "B did not count the stream it relayed");
    assert!(text.starts_with("event: start"), "{text}");
    // The relayed start event names the run's backend and profile, as A's own would.
    let start: serde_json::Value = text
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .and_then(|d| serde_json::from_str(d).ok())
        .expect("start event data");
    assert_eq!(start["exec_id"], exec_id.as_str(), "{start}");
    assert_eq!(start["backend"], "local", "{start}");
    assert_eq!(start["profile"], "python", "{start}");
    for i in 0..6 {
        assert!(
            text.contains(&format!("data: {{\"data\":\"tick {i}\\n\"")),
            "{text}"
        );
    }
    assert_eq!(text.matches("event: stdout").count(), 6, "{text}");
    assert!(text.contains("event: result"), "{text}");
    let (status, body) = get_b(exec_id.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(body["status"], "finished", "{body}");
    let released = b.get("/metrics").await.text;
    assert!(released.contains("executor_open_streams 0\n"), "{released}");
    assert_eq!(
        body["result"]["stdout"].as_str().unwrap().lines().count(),
        6
    );

    // Cancelled through B.
    let sleeper = a
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "import time\ntime.sleep(60)"], "async": true}))
        .await;
    let sleeper_id = sleeper.json["exec_id"].as_str().unwrap().to_string();
    let other = b.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 300,
        aud: "executor-arm".into(),
        sub: Some("another-service".into()),
        ..Default::default()
    });
    let url = format!("{}/v1/executions/{sleeper_id}/cancel", b.base);
    let foreign = b
        .client
        .post(&url)
        .header("authorization", format!("Bearer {other}"))
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status().as_u16(), 404);
    let cancelled = b
        .client
        .post(&url)
        .header("authorization", &svc)
        .body(r#"{"grace_seconds": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status().as_u16(), 202);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = get_b(sleeper_id.clone()).await;
        if body["status"] == "finished" {
            assert_eq!(body["result"]["outcome"], "cancelled", "{body}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not cancelled: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The cancel was audited on the replica that ran it.
    assert!(
        a.audit_lines()
            .iter()
            .any(|l| l["event"] == "execution_cancel" && l["exec_id"] == sleeper_id.as_str())
    );
}

/// A session made on one replica is used through another: execs, files and delete are handed to
/// the replica that holds it; another tenant still gets 404 through either; once that replica is
/// gone, the other answers every caller as for an unknown id and logs where the session was.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_made_on_one_replica_is_used_through_another() {
    let redis = redis();
    let mut a = replica(&redis.url);
    let b = replica(&redis.url);
    let svc = format!("Bearer {}", a.service_token());
    let call = |d: &Daemon, method: reqwest::Method, path: String, tenant: &str, body: Vec<u8>| {
        d.client
            .request(method, format!("{}{path}", d.base))
            .header("authorization", &svc)
            .header("x-tenant-id", tenant)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let created = call(
        &a,
        reqwest::Method::POST,
        "/v1/sandbox/sessions".into(),
        "t1",
        json!({"language": "python", "capability_token": a.cap_all()})
            .to_string()
            .into_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(created.status().as_u16(), 201);
    let id = created.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let base = format!("/v1/sandbox/sessions/{id}");
    let exec = call(
        &b,
        reqwest::Method::POST,
        format!("{base}/exec"),
        "t1",
        json!({"code": "open('made-on-a.txt','w').write('through b')\nprint('ok')"})
            .to_string()
            .into_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(exec.status().as_u16(), 200);
    let result: serde_json::Value = exec.json().await.unwrap();
    assert_eq!(result["stdout"], "ok\n", "{result}");
    let file = call(
        &b,
        reqwest::Method::GET,
        format!("{base}/files/made-on-a.txt"),
        "t1",
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(file.status().as_u16(), 200);
    assert_eq!(file.bytes().await.unwrap(), "through b");
    let stranger = call(&b, reqwest::Method::GET, base.clone(), "t2", vec![])
        .await
        .unwrap();
    assert_eq!(stranger.status().as_u16(), 404);
    // A's audit log has the exec: it ran there.
    assert!(
        a.audit_lines()
            .iter()
            .any(|l| l["event"] == "execution" && l["invocation_hash"].is_string())
    );
    a.kill9();
    // Without a service token, nothing is said about where the session lived.
    let anon = b
        .client
        .get(format!("{}{base}", b.base))
        .send()
        .await
        .unwrap();
    assert_eq!(anon.status().as_u16(), 401);
    // The replica that could check the caller is gone: whoever asks (the owner, another
    // service) gets exactly what an unknown id gets, and where the session lived is only logged.
    let other_svc = format!(
        "Bearer {}",
        b.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 60,
            aud: "executor-arm".into(),
            sub: Some("another-service".into()),
            ..Default::default()
        })
    );
    let answer = |svc: String, path: String| {
        let b = &b;
        async move {
            let r = b
                .client
                .get(format!("{}{path}", b.base))
                .header("authorization", svc)
                .header("x-tenant-id", "t1")
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<serde_json::Value>().await.unwrap())
        }
    };
    let unknown = answer(svc.clone(), "/v1/sandbox/sessions/ses_0000".into()).await;
    assert_eq!(unknown.0, 404, "{}", unknown.1);
    for who in [svc.clone(), other_svc] {
        for path in [base.clone(), format!("{base}/files/made-on-a.txt")] {
            let gone = answer(who.clone(), path.clone()).await;
            assert_eq!(gone, unknown, "{path}");
            assert!(!gone.1.to_string().contains(&a.addr), "{}", gone.1);
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match b.log.recv_timeout(Duration::from_millis(200)) {
            Ok(line) if line.contains("cannot be reached") && line.contains(&a.addr) => break,
            Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("b's log ended: {e}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b did not log the unreachable replica's address"
        );
    }
    // A's restart removes the workspace its crash left mounted.
    let a = a.restart(Opts {
        env: vec![("EXECUTOR_ARM_REDIS_URL".into(), redis.url.clone())],
        ..Default::default()
    });
    assert!(!a.dir.path().join("sessions").join(&id).exists());
}

/// A session paused on one replica is resumed by another that shares Redis and the paused
/// store, with its workspace; the first then hands its calls to the second.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_paused_on_one_replica_is_resumed_by_another() {
    let redis = redis();
    let store = tempfile::tempdir().unwrap();
    let shared = |url: &str| Opts {
        env: vec![
            ("EXECUTOR_ARM_REDIS_URL".into(), url.into()),
            (
                "EXECUTOR_ARM__SESSIONS__STORE_DIR".into(),
                store.path().display().to_string(),
            ),
        ],
        ..Default::default()
    };
    let a = Daemon::start_with(shared(&redis.url));
    let b = Daemon::start_with(shared(&redis.url));
    let svc = format!("Bearer {}", a.service_token());
    let call = |d: &Daemon, path: String, body: Option<serde_json::Value>| {
        let rb = d
            .client
            .post(format!("{}{path}", d.base))
            .header("authorization", &svc)
            .header("x-tenant-id", "t1");
        match body {
            Some(b) => rb.json(&b).send(),
            None => rb.send(),
        }
    };
    let created = call(
        &a,
        "/v1/sandbox/sessions".into(),
        Some(json!({"language": "python", "capability_token": a.cap_all()})),
    )
    .await
    .unwrap();
    assert_eq!(created.status().as_u16(), 201);
    let id = created.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let base = format!("/v1/sandbox/sessions/{id}");
    let wrote = call(
        &a,
        format!("{base}/exec"),
        Some(json!({"code": "open('kept.txt','w').write('paused on a')"})),
    )
    .await
    .unwrap();
    assert_eq!(wrote.status().as_u16(), 200);
    let paused = call(&a, format!("{base}/pause"), None).await.unwrap();
    assert_eq!(paused.status().as_u16(), 200);

    let back = call(
        &b,
        format!("{base}/exec"),
        Some(json!({"code": "print(open('kept.txt').read())"})),
    )
    .await
    .unwrap();
    assert_eq!(back.status().as_u16(), 200);
    let result: serde_json::Value = back.json().await.unwrap();
    assert_eq!(result["stdout"], "paused on a\n", "{result}");
    // B holds it now: A hands its calls over.
    let through_a = call(
        &a,
        format!("{base}/exec"),
        Some(json!({"code": "print(open('kept.txt').read().upper())"})),
    )
    .await
    .unwrap();
    assert_eq!(through_a.status().as_u16(), 200);
    let result: serde_json::Value = through_a.json().await.unwrap();
    assert_eq!(result["stdout"], "PAUSED ON A\n", "{result}");
    let resumes = b
        .audit_lines()
        .into_iter()
        .filter(|l| l["event"] == "session_resume" && l["session_id"] == id.as_str())
        .count();
    assert_eq!(resumes, 1);
}

/// Answers `GET /headers` with the request's headers as JSON, echoes a POST's chunks
/// upper-cased as they come, and to a request with `Upgrade` answers 101 and echoes bytes.
const PORT_SERVER: &str = r#"
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade"):
            self.send_response(101)
            self.send_header("Upgrade", self.headers["Upgrade"])
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            while True:
                d = self.connection.recv(4096)
                if not d:
                    return
                self.connection.sendall(d)
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                self.rfile.readline()
                break
            data = self.rfile.read(size).upper()
            self.rfile.readline()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

/// A session's ports through a replica that does not hold it: the request is forwarded with its
/// own headers, its body streamed both ways (the first chunk's echo comes back before the
/// request's body ended), and an upgrade is relayed end to end.
#[tokio::test(flavor = "multi_thread")]
async fn a_sessions_ports_are_reached_through_another_replica() {
    use http_body_util::{BodyExt as _, StreamBody};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let redis = redis();
    let a = replica(&redis.url);
    let b = replica(&redis.url);
    let headers = [
        ("authorization", format!("Bearer {}", a.service_token())),
        ("x-tenant-id", "t1".to_string()),
    ];
    let created = a
        .client
        .post(format!("{}/v1/sandbox/sessions", a.base))
        .header(headers[0].0, &headers[0].1)
        .header(headers[1].0, &headers[1].1)
        .json(&json!({"language": "python", "capability_token": a.cap_all()}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status().as_u16(), 201);
    let id = created.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let base = format!("/v1/sandbox/sessions/{id}");
    let started = a
        .client
        .post(format!("{}{base}/exec", a.base))
        .header(headers[0].0, &headers[0].1)
        .header(headers[1].0, &headers[1].1)
        .json(&json!({"code": PORT_SERVER, "background": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status().as_u16(), 202);

    // A GET through B, with a header of the caller's own.
    let seen = common::wait::wait_for_async(
        "the session's server answered through the other replica",
        common::wait::CLEANUP,
        || async {
            let r = b
                .client
                .get(format!("{}{base}/ports/8000/headers", b.base))
                .header(headers[0].0, &headers[0].1)
                .header(headers[1].0, &headers[1].1)
                .header("x-app", "kept")
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        },
        |(s, _)| *s == 200,
    )
    .await
    .1;
    let seen: serde_json::Value = serde_json::from_str(&seen).unwrap();
    assert_eq!(seen["x-app"], json!("kept"), "{seen}");
    for h in ["authorization", "x-tenant-id", "x-executor-arm-forwarded"] {
        assert!(seen.get(h).is_none(), "{h} reached the sandbox: {seen}");
    }

    // A POST streamed both ways through B.
    let mut sender = connect(&b.addr).await;
    let (mut tx, rx) = futures::channel::mpsc::channel::<
        Result<hyper::body::Frame<bytes::Bytes>, std::convert::Infallible>,
    >(4);
    let mut req = hyper::Request::post(format!("{base}/ports/8000/echo"))
        .header("host", &b.addr)
        .body(StreamBody::new(rx))
        .unwrap();
    for (k, v) in &headers {
        req.headers_mut().insert(*k, v.parse().unwrap());
    }
    use futures::SinkExt as _;
    tx.send(Ok(hyper::body::Frame::data(bytes::Bytes::from_static(
        b"one ",
    ))))
    .await
    .unwrap();
    let resp = tokio::time::timeout(common::wait::CLEANUP, sender.send_request(req))
        .await
        .expect("answer in time")
        .expect("answer");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while !got.ends_with(b"ONE ") {
        let f = tokio::time::timeout(common::wait::CLEANUP, body.frame())
            .await
            .expect("the first echo before the request's body ended")
            .expect("a frame")
            .expect("a good frame");
        if let Ok(data) = f.into_data() {
            got.extend_from_slice(&data);
        }
    }
    tx.send(Ok(hyper::body::Frame::data(bytes::Bytes::from_static(
        b"two",
    ))))
    .await
    .unwrap();
    drop(tx);
    let rest = tokio::time::timeout(common::wait::CLEANUP, body.collect())
        .await
        .expect("the rest in time")
        .expect("the rest")
        .to_bytes();
    got.extend_from_slice(&rest);
    assert_eq!(String::from_utf8_lossy(&got), "ONE TWO");

    // An upgrade through B: 101, then bytes both ways.
    let mut sender = connect(&b.addr).await;
    let mut req = hyper::Request::get(format!("{base}/ports/8000/up"))
        .header("host", &b.addr)
        .header("connection", "upgrade")
        .header("upgrade", "x-echo")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    for (k, v) in &headers {
        req.headers_mut().insert(*k, v.parse().unwrap());
    }
    let resp = tokio::time::timeout(common::wait::CLEANUP, sender.send_request(req))
        .await
        .expect("answer in time")
        .expect("answer");
    assert_eq!(resp.status(), 101);
    let up = tokio::time::timeout(common::wait::CLEANUP, hyper::upgrade::on(resp))
        .await
        .expect("upgrade in time")
        .expect("upgrade");
    let mut io = hyper_util::rt::TokioIo::new(up);
    for word in [&b"ping"[..], b"pong"] {
        io.write_all(word).await.unwrap();
        let mut back = [0u8; 4];
        tokio::time::timeout(common::wait::CLEANUP, io.read_exact(&mut back))
            .await
            .expect("echo in time")
            .expect("echo");
        assert_eq!(&back, word);
    }
    drop(io);
    let r = b
        .client
        .delete(format!("{}{base}", b.base))
        .header(headers[0].0, &headers[0].1)
        .header(headers[1].0, &headers[1].1)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    a.wait_for_no_run_cgroups();
}

/// An HTTP/1 connection to `addr` that may be upgraded.
async fn connect<B>(addr: &str) -> hyper::client::conn::http1::SendRequest<B>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn.with_upgrades());
    sender
}

/// The keys `/v1/receipts/keys` lists on `d`.
async fn listed(d: &Daemon) -> Vec<serde_json::Value> {
    let r = d.get_authorized("/v1/receipts/keys").await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["keys"].as_array().cloned().unwrap_or_default()
}

/// Each replica signs with a key of its own, and `/v1/receipts/keys` on any replica lists every
/// replica's key (published through the store): a receipt one replica signed, read through the
/// other, verifies with the key the other lists.
#[tokio::test(flavor = "multi_thread")]
async fn every_replica_lists_every_replicas_receipts_key() {
    let redis = redis();
    let a = replica(&redis.url);
    let b = replica(&redis.url);
    let own = |keys: &[serde_json::Value]| {
        keys.iter()
            .find(|k| k["signing"] == true)
            .map(|k| k["keyid"].as_str().unwrap().to_string())
            .expect("a signing key")
    };
    let (ka, kb) = (own(&listed(&a).await), own(&listed(&b).await));
    assert_ne!(ka, kb, "each replica has its own key");
    for (d, other) in [(&a, &kb), (&b, &ka)] {
        let keys = common::wait::wait_for_async(
            "the other replica's key to be listed",
            common::wait::CLEANUP,
            || listed(d),
            |keys| keys.iter().any(|k| k["keyid"] == other.as_str()),
        )
        .await;
        let k = keys.iter().find(|k| k["keyid"] == other.as_str()).unwrap();
        assert_eq!(
            (k["signing"].clone(), k["source"].clone()),
            (json!(false), json!("another replica"))
        );
    }

    // A's receipt, read through B, verifies with the key B lists for A.
    let r = a
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["signed by a"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap();
    let receipt = b
        .get_authorized(&format!("/v1/executions/{exec_id}/receipt"))
        .await;
    assert_eq!(receipt.status, 200, "{}", receipt.text);
    assert_eq!(receipt.json["signatures"][0]["keyid"], ka.as_str());
    let keys = listed(&b).await;
    let pem = keys.iter().find(|k| k["keyid"] == ka.as_str()).unwrap()["public_key_pem"]
        .as_str()
        .unwrap()
        .to_string();
    let (key_file, env_file) = (
        b.dir.path().join("a.pub.pem"),
        b.dir.path().join("a.dsse.json"),
    );
    std::fs::write(&key_file, pem).unwrap();
    std::fs::write(&env_file, &receipt.text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_executor-arm"))
        .args(["receipt", "verify"])
        .arg(&env_file)
        .arg("--key")
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
