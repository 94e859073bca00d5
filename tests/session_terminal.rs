//! A session's terminal, through a real daemon on every backend: a WebSocket attached to the
//! session's shell on a pseudo-terminal inside the sandbox. It runs what is typed, a resize
//! reaches `stty size`, closing the socket leaves no process of it (checked from outside the
//! terminal), and its audit line counts the bytes. Then the refusals: no token (401), another
//! tenant or no such session (404), one process past `sessions.max_processes` (429), a frame
//! over `sessions.max_frame_bytes` (close 1009), a text frame that is not a resize (close 1003).

mod common;

use std::time::Instant;

use common::backends::Backend;
use common::docker::SOCKET;
use common::sessions::{SandboxClient, koder, new_session};
use common::wait::{CLEANUP, wait_for_async};
use common::{Daemon, Opts};
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The daemon for `backend`: at most `max` processes per session, frames of at most 1 KiB.
fn opts(backend: Backend, max: usize) -> Opts {
    let mut config = common::docker::config(1, SOCKET);
    config.push_str(&format!(
        "\n[sessions]\nmax_processes = {max}\nmax_frame_bytes = 1024\n"
    ));
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config: Some(config),
        ..Default::default()
    }
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandbox/sessions/{id}{rest}")
}

/// Opens session `id`'s terminal as `c`: the socket, or the HTTP status it was refused with.
async fn connect(c: &SandboxClient<'_>, id: &str) -> Result<Ws, u16> {
    let url = format!("ws://{}{}", c.d.addr, path(id, "/terminal"));
    let mut req = url.into_client_request().expect("request");
    for (k, v) in c.headers() {
        req.headers_mut().insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("terminal connect: {e}"),
    }
}

/// Reads the terminal until its output has a line equal to `line` (bounded); the output seen.
async fn read_until_line(ws: &mut Ws, seen: &mut String, line: &str) {
    let deadline = Instant::now() + CLEANUP;
    loop {
        if seen.split(['\r', '\n']).any(|l| l.trim() == line) {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no line {line:?} in the terminal; it showed {seen:?}"
        );
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
            Ok(other) => {
                panic!("terminal ended while waiting for {line:?}: {other:?}; it showed {seen:?}")
            }
            Err(_) => panic!("no line {line:?} in the terminal; it showed {seen:?}"),
        }
    }
}

/// The close code the daemon ends the socket with (bounded), skipping output.
async fn close_code(ws: &mut Ws) -> Option<CloseCode> {
    let deadline = Instant::now() + CLEANUP;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Close(f)))) => return f.map(|f| f.code),
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => panic!("socket failed before its close frame: {e}"),
            Ok(None) => return None,
            Err(_) => panic!("the daemon never closed the socket"),
        }
    }
}

/// Lines of the processes of the session's container (or local sandbox) whose command line
/// names the terminal or a shell, as a fresh exec of the session sees them in /proc.
async fn shells_seen(c: &SandboxClient<'_>, id: &str) -> String {
    let code = "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n            cmd = open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ').decode()\n        except OSError:\n            continue\n        if 'pty' in cmd or 'bash' in cmd or '/bin/sh' in cmd or 'sleep' in cmd:\n            print(p, cmd)";
    let r = c.exec(id, json!({"code": code, "timeout_ms": 60000})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["stdout"].as_str().unwrap_or_default().to_string()
}

/// The terminal runs what is typed in the sandbox; a resize reaches the shell; closing the
/// socket hangs it up and leaves no process of it; its audit line counts the bytes.
async fn a_terminal_runs_resizes_and_leaves_nothing(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let mut ws = connect(&c, &id).await.expect("terminal");
    let mut seen = String::new();
    ws.send(Message::Binary(b"echo $((6*7))\n".to_vec().into()))
        .await
        .unwrap();
    read_until_line(&mut ws, &mut seen, "42").await;
    ws.send(Message::Text(
        json!({"resize": {"cols": 123, "rows": 45}})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    ws.send(Message::Binary(b"stty size\n".to_vec().into()))
        .await
        .unwrap();
    read_until_line(&mut ws, &mut seen, "45 123").await;
    // A process the shell leaves behind goes with the terminal too.
    ws.send(Message::Binary(
        b"sleep 600 &\necho started\n".to_vec().into(),
    ))
    .await
    .unwrap();
    read_until_line(&mut ws, &mut seen, "started").await;
    if backend.is_container() {
        // What the check below relies on: the session's execs see the terminal's processes.
        let running = shells_seen(&c, &id).await;
        assert!(running.contains("sleep 600"), "{running}");
    }
    // It is one of the session's processes while it runs.
    let r = c.call("GET", &path(&id, "/processes"), None).await;
    let procs = r.json["processes"].as_array().cloned().unwrap_or_default();
    assert_eq!(procs.len(), 1, "{}", r.text);
    assert_eq!(procs[0]["state"], json!("running"), "{}", r.text);
    let pid = procs[0]["process_id"].as_str().unwrap().to_string();
    // Its stdin carries the terminal's own frames: raw bytes from the process routes would be
    // taken as frames (typing the audit line does not count, signals, a hang-up).
    let raw = c
        .call(
            "POST",
            &path(&id, &format!("/processes/{pid}/stdin")),
            Some(b"i\x00\x00\x00\x03ls\n".to_vec()),
        )
        .await;
    assert_eq!(raw.status, 400, "{}", raw.text);
    assert!(raw.text.contains("terminal"), "{}", raw.text);
    // TERM is the shell's, which ignores it on a terminal, as an interactive shell does: the
    // terminal goes on.
    let r = c
        .call(
            "POST",
            &path(&id, &format!("/processes/{pid}/signal")),
            Some(json!({"signal": "TERM"}).to_string().into_bytes()),
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    ws.send(Message::Binary(b"echo $((7*8))\n".to_vec().into()))
        .await
        .unwrap();
    read_until_line(&mut ws, &mut seen, "56").await;

    ws.close(None).await.unwrap();
    drop(ws);
    let line = d.wait_for_audit_line("the terminal's line", |l| {
        l["event"] == "session_terminal" && l["session_id"] == json!(id)
    });
    assert_eq!(line["process_id"], json!(pid), "{line}");
    assert_eq!(line["end"], json!("closed"), "{line}");
    let typed = "echo $((6*7))\nstty size\nsleep 600 &\necho started\necho $((7*8))\n".len() as u64;
    assert_eq!(line["bytes_in"], json!(typed), "{line}");
    assert!(
        line["bytes_out"].as_u64().unwrap_or(0) >= "42\n45 123\nstarted\n".len() as u64,
        "{line}"
    );
    assert!(
        !line.to_string().contains("6*7"),
        "no keystrokes in the audit log: {line}"
    );
    // The terminal's run ended, and nothing of it is left.
    let e = wait_for_async(
        "the terminal's process ended",
        CLEANUP,
        || async {
            let r = c.call("GET", &path(&id, "/processes"), None).await;
            r.json["processes"][0].clone()
        },
        |p: &Value| p["state"] == json!("exited"),
    )
    .await;
    assert_eq!(e["process_id"], json!(pid), "{e}");
    if backend.is_container() {
        let left = shells_seen(&c, &id).await;
        assert!(
            !left.lines().any(|l| !l.contains("python")),
            "processes left: {left}"
        );
    } else {
        d.wait_for_no_run_cgroups();
    }
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// What a terminal refuses: before the upgrade, with a session route's statuses; after it, by
/// closing the socket with a code that says why.
async fn a_terminal_refuses_bad_input(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 1));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;

    // No token: 401; another tenant, or no such session: 404; not a WebSocket: 400.
    let r = d
        .client
        .get(format!("{}{}", d.base, path(&id, "/terminal")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let other = koder(&d, Some("team-b"));
    assert_eq!(connect(&other, &id).await.err(), Some(404));
    assert_eq!(connect(&c, "ses_nosuchsession").await.err(), Some(404));
    let r = c.call("GET", &path(&id, "/terminal"), None).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("WebSocket"), "{}", r.text);

    // A frame over sessions.max_frame_bytes (1 KiB here) closes the socket with 1009.
    let mut ws = connect(&c, &id).await.expect("terminal");
    // One terminal is the session's one process: another is 429.
    assert_eq!(connect(&c, &id).await.err(), Some(429));
    ws.send(Message::Binary(vec![b'x'; 1025].into()))
        .await
        .unwrap();
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Size));
    drop(ws);
    d.wait_for_audit_line("the refused terminal's line", |l| {
        l["event"] == "session_terminal" && l["end"] == "refused" && l["bytes_in"] == json!(0)
    });

    // A text frame that is not a resize closes it with 1003 (its place is free again: the
    // first terminal's end gave it back).
    let mut ws = wait_for_async(
        "the session's process place given back",
        CLEANUP,
        || connect(&c, &id),
        Result::is_ok,
    )
    .await
    .unwrap();
    ws.send(Message::Text(r#"{"resize": {"cols": 0}}"#.into()))
        .await
        .unwrap();
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Unsupported));
    drop(ws);

    // The session's end ends a terminal: the socket closes with 1000.
    let mut ws = wait_for_async(
        "the session's process place given back",
        CLEANUP,
        || connect(&c, &id),
        Result::is_ok,
    )
    .await
    .unwrap();
    let mut seen = String::new();
    ws.send(Message::Binary(b"echo ready\n".to_vec().into()))
        .await
        .unwrap();
    read_until_line(&mut ws, &mut seen, "ready").await;
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Normal));
    if !backend.is_container() {
        d.wait_for_no_run_cgroups();
    }
}

/// A terminal's output is not cut at the session's `output_bytes`: 40 KB of it in a session
/// whose cap is 1000 bytes all reach the socket, and the shell answers after them.
async fn a_terminals_output_passes_the_sessions_output_cap(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let r = c
        .create(json!({"language": "python", "limits": {"output_bytes": 1000}, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().expect("id").to_string();
    let mut ws = connect(&c, &id).await.expect("terminal");
    let mut seen = String::new();
    ws.send(Message::Binary(
        b"yes yy | head -n 20000; echo $((40+2))\n".to_vec().into(),
    ))
    .await
    .unwrap();
    read_until_line(&mut ws, &mut seen, "42").await;
    let lines = seen.split(['\r', '\n']).filter(|l| *l == "yy").count();
    assert_eq!(lines, 20000, "{} bytes seen", seen.len());
    ws.close(None).await.unwrap();
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// A terminal still open when the daemon is stopped (SIGTERM) ends with the daemon's sessions,
/// and its audit line is written before the daemon exits; the log verifies.
async fn a_terminal_open_at_shutdown_is_audited(backend: Backend) {
    let mut d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let mut ws = connect(&c, &id).await.expect("terminal");
    let mut seen = String::new();
    ws.send(Message::Binary(b"echo $((6*7))\n".to_vec().into()))
        .await
        .unwrap();
    read_until_line(&mut ws, &mut seen, "42").await;
    // The socket stays open while the daemon stops.
    let stopped = tokio::task::spawn_blocking(move || {
        let code = d.stop();
        (d, code)
    });
    let (d, code) = stopped.await.expect("stop");
    assert_eq!(code, Some(0), "the daemon's exit");
    drop(ws);
    let lines = d.audit_lines();
    let line = lines
        .iter()
        .find(|l| l["event"] == "session_terminal" && l["session_id"] == json!(id))
        .unwrap_or_else(|| panic!("no session_terminal line for {id} in {lines:#?}"));
    assert_eq!(line["end"], json!("exited"), "{line}");
    assert_eq!(line["bytes_in"], json!(14), "{line}");
    let verify = common::audit_verify(&d.audit);
    assert!(verify.status.success(), "{verify:?}");
}

on_every_backend!(
    multi_thread;
    a_terminals_output_passes_the_sessions_output_cap,
    a_terminal_open_at_shutdown_is_audited,
    a_terminal_runs_resizes_and_leaves_nothing,
    a_terminal_refuses_bad_input,
);
