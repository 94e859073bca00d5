//! The error statuses every route shares, asked of every route that documents them, through a
//! real daemon on the local backend: no service token (401), disagreeing tenant headers (400), a
//! body over the limit (413) or too slow to arrive (408), and the statuses of session execs and
//! files that only a session in a given state answers (403, 404, 409, 413).
//!
//! Each route's own behaviour is tested where the route is (tests/api.rs, runs.rs, sessions.rs);
//! here the point is that the shared machinery holds on every route, as the OpenAPI document
//! says (scripts/api-fuzz.sh checks that every documented status was answered by some test).

mod common;

use std::time::Duration;

use common::sessions::{koder, new_session};
use common::{Daemon, Opts, Resp};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A daemon that gives a body two seconds and keeps session files to 4 KiB.
fn daemon() -> Daemon {
    Daemon::start_with(Opts {
        config: Some(
            "[server]\nbody_read_timeout_seconds = 2\n\n[sessions]\nmax_file_bytes = 4096\n".into(),
        ),
        ..Default::default()
    })
}

/// Sends `method path` with `headers` and `body` (JSON content type when there is one).
async fn call(
    d: &Daemon,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Resp {
    let url = format!("{}{path}", d.base);
    // A connection of its own: the daemon closes one whose body it refused unread (413), and a
    // pooled connection could be that one.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let mut rb = client.request(method.parse().expect("method"), url);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    if let Some(b) = body {
        rb = rb.header("content-type", "application/json").body(b);
    }
    Daemon::read(rb.send().await.expect("request")).await
}

fn assert_error(r: &Resp, status: u16, error_type: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text);
    assert_eq!(r.json["error_type"], error_type, "{what}: {}", r.text);
}

/// A session with one finished exec and one async exec still running; the routes of both.
struct Fixture {
    session: String,
    finished: String,
    running: String,
    run: String,
    /// A background process of the session.
    process: String,
}

impl Fixture {
    /// Every route under one session or run, with a body where the route takes one.
    fn routes(&self) -> Vec<(&'static str, String, Option<Value>)> {
        let s = format!("/v1/sandbox/sessions/{}", self.session);
        let e = format!("{s}/execs/{}", self.running);
        let r = format!("/v1/executions/{}", self.run);
        vec![
            ("GET", s.clone(), None),
            (
                "DELETE",
                format!(
                    "/v1/sandbox/sessions/{}",
                    "ses_00000000000000000000000000000000"
                ),
                None,
            ),
            (
                "POST",
                format!("{s}/exec"),
                Some(json!({"code": "print(1)"})),
            ),
            ("GET", e.clone(), None),
            ("GET", format!("{e}/stream"), None),
            ("GET", format!("{e}/receipt"), None),
            (
                "POST",
                format!("{e}/cancel"),
                Some(json!({"grace_seconds": 0})),
            ),
            ("GET", format!("{s}/files"), None),
            ("GET", format!("{s}/files/note.txt"), None),
            ("PUT", format!("{s}/files/note.txt"), Some(json!("x"))),
            ("GET", format!("{s}/archive"), None),
            ("PUT", format!("{s}/archive?path=x"), Some(json!("x"))),
            ("POST", format!("{s}/pause"), None),
            ("POST", format!("{s}/resume"), None),
            ("POST", format!("{e}/stdin"), Some(json!("x"))),
            ("GET", format!("{s}/processes"), None),
            (
                "GET",
                format!("{s}/processes/{}/stream", self.process),
                None,
            ),
            (
                "GET",
                format!("{s}/processes/{}/output", self.process),
                None,
            ),
            (
                "POST",
                format!("{s}/processes/{}/stdin", self.process),
                Some(json!("x")),
            ),
            (
                "POST",
                format!("{s}/processes/{}/signal", self.process),
                Some(json!({"signal": "TERM"})),
            ),
            ("GET", format!("{s}/terminal"), None),
            ("GET", format!("{s}/ports/8000/x"), None),
            ("GET", r.clone(), None),
            ("GET", format!("{r}/stream"), None),
            ("GET", format!("{r}/receipt"), None),
            ("GET", "/v1/receipts/keys".into(), None),
            (
                "POST",
                format!("{r}/cancel"),
                Some(json!({"grace_seconds": 0})),
            ),
        ]
    }
}

async fn fixture(d: &Daemon) -> Fixture {
    let c = koder(d, None);
    let session = new_session(&c, "python").await;
    let done = c
        .exec(
            &session,
            json!({"code": "open('note.txt','w').write('kept')"}),
        )
        .await;
    assert_eq!(done.status, 200, "{}", done.text);
    let finished = done.json["exec_id"].as_str().expect("exec_id").to_string();
    let running = c
        .exec(
            &session,
            json!({"code": "import time\ntime.sleep(60)", "async": true}),
        )
        .await;
    assert_eq!(running.status, 202, "{}", running.text);
    let running = running.json["exec_id"]
        .as_str()
        .expect("exec_id")
        .to_string();
    let run = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(60)"], "async": true}))
        .await;
    assert_eq!(run.status, 202, "{}", run.text);
    let run = run.json["exec_id"].as_str().expect("exec_id").to_string();
    let process = c
        .exec(
            &session,
            json!({"code": "import time\ntime.sleep(60)", "background": true}),
        )
        .await;
    assert_eq!(process.status, 202, "{}", process.text);
    let process = process.json["process_id"]
        .as_str()
        .expect("process_id")
        .to_string();
    Fixture {
        session,
        finished,
        running,
        run,
        process,
    }
}

/// Without a service token every route under a session or a run is 401, whatever it asks.
#[tokio::test(flavor = "multi_thread")]
async fn every_route_refuses_a_call_without_a_service_token() {
    let d = daemon();
    let f = fixture(&d).await;
    for (method, path, body) in f.routes() {
        let body = body.map(|b| b.to_string().into_bytes());
        let r = call(&d, method, &path, &[], body.clone()).await;
        assert_error(&r, 401, "Unauthorized", &format!("{method} {path}"));
        let r = call(
            &d,
            method,
            &path,
            &[("authorization", "Bearer not-a-token")],
            body,
        )
        .await;
        assert_error(
            &r,
            401,
            "Unauthorized",
            &format!("{method} {path} (bad token)"),
        );
    }
    let r = call(
        &d,
        "POST",
        "/v1/sandbox/sessions",
        &[],
        Some(b"{}".to_vec()),
    )
    .await;
    assert_error(&r, 401, "Unauthorized", "POST /v1/sandbox/sessions");
}

/// Every session route reads the tenant the same way: the two headers naming different tenants
/// is a 400 before anything else is looked at.
#[tokio::test(flavor = "multi_thread")]
async fn every_session_route_refuses_disagreeing_tenant_headers() {
    let d = daemon();
    let f = fixture(&d).await;
    let svc = format!("Bearer {}", d.service_token());
    let headers = [
        ("authorization", svc.as_str()),
        ("x-tenant-id", "a"),
        ("x-koder-tenant", "b"),
    ];
    let mut routes: Vec<(&str, String, Option<Value>)> = f
        .routes()
        .into_iter()
        .filter(|(_, p, _)| p.starts_with("/v1/sandbox/sessions/"))
        .collect();
    routes.push((
        "POST",
        "/v1/sandbox/sessions".into(),
        Some(json!({"language": "python", "capability_token": d.cap_all()})),
    ));
    for (method, path, body) in routes {
        let r = call(
            &d,
            method,
            &path,
            &headers,
            body.map(|b| b.to_string().into_bytes()),
        )
        .await;
        assert_error(&r, 400, "InvalidRequest", &format!("{method} {path}"));
        assert!(r.text.contains("tenant"), "{method} {path}: {}", r.text);
    }
}

/// A body over `server.body_limit_bytes` (a file over `sessions.max_file_bytes`) is 413 on
/// every route that takes one but an archive, and one that does not arrive within
/// `server.body_read_timeout_seconds` is 408.
#[tokio::test(flavor = "multi_thread")]
async fn every_body_is_bounded_in_size_and_time() {
    let d = daemon();
    let f = fixture(&d).await;
    let svc = format!("Bearer {}", d.service_token());
    // An archive's body is bounded by the workspace instead (its own test in tests/sessions.rs).
    let mut routes: Vec<(&str, String)> = f
        .routes()
        .into_iter()
        .filter(|(_, p, b)| b.is_some() && !p.contains("/archive"))
        .map(|(m, p, _)| (m, p))
        .collect();
    routes.push(("POST", "/v1/sandbox/sessions".into()));
    routes.push(("POST", "/execute".into()));
    for (method, path) in &routes {
        // 1 MiB is the default body limit; the session's file limit is 4 KiB.
        let size = if *method == "PUT" {
            4097
        } else {
            (1 << 20) + 1
        };
        let r = call(
            &d,
            method,
            path,
            &[("authorization", svc.as_str())],
            Some(vec![b' '; size]),
        )
        .await;
        assert_error(&r, 413, "PayloadTooLarge", &format!("{method} {path}"));
    }
    // All at once: each waits out the same two seconds; a file upload gets at least 60 s (a large
    // file on a slow link).
    let slow = routes.iter().map(|(method, path)| {
        let addr = d.addr.clone();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {svc}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        );
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.expect("connect");
            s.write_all(head.as_bytes()).await.expect("write");
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(90), s.read_to_end(&mut answer)).await;
            (format!("{method} {path}"), String::from_utf8_lossy(&answer).into_owned())
        }
    });
    for (what, answer) in futures::future::join_all(slow).await {
        assert!(answer.starts_with("HTTP/1.1 408"), "{what}: {answer}");
        assert!(
            answer.contains("\"error_type\":\"RequestTimeout\""),
            "{what}: {answer}"
        );
    }
}

/// The statuses of a session's execs and files that only a session in a given state answers.
#[tokio::test(flavor = "multi_thread")]
async fn session_execs_and_files_answer_their_documented_errors() {
    let d = daemon();
    let f = fixture(&d).await;
    let c = koder(&d, None);
    let s = format!("/v1/sandbox/sessions/{}", f.session);
    let grace = Some(br#"{"grace_seconds":0}"#.to_vec());

    // Execs that do not exist, and one that has finished.
    let unknown = "00000000-0000-4000-8000-000000000000";
    let r = c
        .call("GET", &format!("{s}/execs/{unknown}/stream"), None)
        .await;
    assert_error(&r, 404, "NotFound", "stream of an unknown exec");
    let r = c
        .call(
            "POST",
            &format!("{s}/execs/{unknown}/cancel"),
            grace.clone(),
        )
        .await;
    assert_error(&r, 404, "NotFound", "cancel of an unknown exec");
    let r = c
        .call(
            "POST",
            &format!("{s}/execs/{}/cancel", f.finished),
            grace.clone(),
        )
        .await;
    assert_error(&r, 409, "AlreadyFinished", "cancel of a finished exec");
    let r = c
        .call(
            "POST",
            &format!("{s}/execs/{}/cancel", f.running),
            Some(br#"{"grace_seconds":31}"#.to_vec()),
        )
        .await;
    assert_error(&r, 400, "InvalidRequest", "cancel with grace_seconds 31");

    // A listing outside the workspace, a file over the limit.
    let r = c.call("GET", &format!("{s}/files?path=../etc"), None).await;
    assert_error(&r, 400, "InvalidRequest", "listing ../etc");
    let r = c
        .call(
            "POST",
            &format!("{s}/execs/{}/cancel", f.running),
            grace.clone(),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    // Once the cancelled exec has ended: an env name no profile may set.
    let exec = || {
        c.exec(
            &f.session,
            json!({"code": "print(1)", "env": {"LD_PRELOAD": "/tmp/x.so"}}),
        )
    };
    common::wait::wait_for_async(
        "the cancelled exec to end (no more 409)",
        common::wait::CLEANUP,
        || async { exec().await.status },
        |status| *status != 409,
    )
    .await;
    let r = exec().await;
    assert_error(&r, 403, "CapabilityViolation", "exec with LD_PRELOAD");
    let big = c
        .exec(
            &f.session,
            json!({"code": "open('big.bin','w').write('x' * 4097)"}),
        )
        .await;
    assert_eq!(big.status, 200, "{}", big.text);
    let r = c.call("GET", &format!("{s}/files/big.bin"), None).await;
    assert_error(
        &r,
        413,
        "PayloadTooLarge",
        "a file over sessions.max_file_bytes",
    );

    // A malformed creation body.
    let r = c.create(json!({"language": 7})).await;
    assert_error(&r, 400, "InvalidRequest", "language 7");
}

/// With `executions.max_open_streams` streams open, a session exec's stream is 429, whether
/// asked of a running exec or as the answer to a new one.
#[tokio::test(flavor = "multi_thread")]
async fn session_streams_are_bounded_with_the_others() {
    let d = Daemon::start_with(Opts {
        config: Some("[executions]\nmax_open_streams = 1\n".into()),
        ..Default::default()
    });
    let c = koder(&d, None);
    let run = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(30)"], "async": true}))
        .await;
    assert_eq!(run.status, 202, "{}", run.text);
    let run = run.json["exec_id"].as_str().expect("exec_id").to_string();
    let held = d
        .client
        .get(format!("{}/v1/executions/{run}/stream", d.base))
        .header("authorization", format!("Bearer {}", c.service))
        .send()
        .await
        .expect("stream");
    assert_eq!(held.status(), 200);

    let first = new_session(&c, "python").await;
    let exec = c
        .exec(
            &first,
            json!({"code": "import time\ntime.sleep(30)", "async": true}),
        )
        .await;
    assert_eq!(exec.status, 202, "{}", exec.text);
    let exec = exec.json["exec_id"].as_str().expect("exec_id").to_string();
    let r = c
        .call(
            "GET",
            &format!("/v1/sandbox/sessions/{first}/execs/{exec}/stream"),
            None,
        )
        .await;
    assert_error(&r, 429, "Overloaded", "stream of a running exec");
    assert!(r.headers.get("retry-after").is_some(), "{:?}", r.headers);
    let process = c
        .exec(
            &first,
            json!({"code": "import time\ntime.sleep(30)", "background": true}),
        )
        .await;
    assert_eq!(process.status, 202, "{}", process.text);
    let process = process.json["process_id"].as_str().expect("process_id");
    let r = c
        .call(
            "GET",
            &format!("/v1/sandbox/sessions/{first}/processes/{process}/stream"),
            None,
        )
        .await;
    assert_error(&r, 429, "Overloaded", "stream of a background process");

    let second = new_session(&c, "python").await;
    let svc = format!("Bearer {}", c.service);
    let r = call(
        &d,
        "POST",
        &format!("/v1/sandbox/sessions/{second}/exec"),
        &[
            ("authorization", svc.as_str()),
            ("accept", "text/event-stream"),
        ],
        Some(br#"{"code":"print(1)"}"#.to_vec()),
    )
    .await;
    assert_error(&r, 429, "Overloaded", "a streamed exec");
    drop(held);
}
