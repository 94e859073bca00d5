//! A session's ports proxy against a hostile server in the sandbox: a listener that never
//! accepts (its queue full) costs the daemon no thread and its callers an answer (502) in
//! bounded time; a malformed answer (both `Content-Length` and `Transfer-Encoding`) is not
//! forwarded with a length that cuts its body; a `101` to a request that asked for no upgrade
//! is refused (502); a percent-encoded port is read as the port it names.

mod common;

use std::time::Duration;

use common::backends::Backend;
use common::docker::SOCKET;
use common::sessions::{SandboxClient, koder, new_session};
use common::wait::{CLEANUP, wait_for_async};
use common::{Daemon, Opts};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn opts(backend: Backend) -> Opts {
    let mut config = common::docker::config(1, SOCKET);
    config.push_str("\n[sessions]\nmax_processes = 4\nallowed_ports = [\"8000-8999\"]\n");
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config: Some(config),
        ..Default::default()
    }
}

/// Port 8005: a listener that never accepts (the one place of its queue, `listen(0)`, is taken
/// by the first connection; the kernel drops the next ones' SYNs).
/// Port 8006: every request answered with both `Content-Length: 5` and a chunked body of
/// `hello world`. Port 8007: every request answered `101 Switching Protocols`. Port 8008: a
/// plain answer, `plain`.
const HOSTILE: &str = r#"
import socket, threading, time
full = socket.socket()
full.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
full.bind(("127.0.0.1", 8005))
full.listen(0)
def serve(port, answer):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            d = c.recv(4096)
            if not d:
                break
            data += d
        c.sendall(answer)
        time.sleep(0.2)
        c.close()
for port, answer in [
    (8006, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n"),
    (8007, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: smuggled\r\nConnection: Upgrade\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
    (8008, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nplain"),
]:
    threading.Thread(target=serve, args=(port, answer), daemon=True).start()
time.sleep(3600)
"#;

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandbox/sessions/{id}{rest}")
}

/// One raw HTTP/1.1 request to the daemon (`Connection: close`): everything it answered, or
/// None when no answer came within `limit`.
async fn raw(c: &SandboxClient<'_>, target: &str, extra: &str, limit: Duration) -> Option<String> {
    let addr = c.d.base.trim_start_matches("http://").to_string();
    let mut head = format!("GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in c.headers() {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(extra);
    head.push_str("\r\n");
    let go = async {
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(head.as_bytes()).await.expect("write");
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    };
    tokio::time::timeout(limit, go).await.ok()
}

/// The status of a raw answer.
fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The daemon's threads that connect inside a sandbox's network namespace.
fn netns_threads(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim() == "netns-connect")
                })
                .count()
        })
        .unwrap_or(0)
}

async fn a_hostile_server_costs_the_daemon_nothing(backend: Backend) {
    let d = Daemon::start_with(opts(backend));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let r = c
        .exec(
            &id,
            json!({"code": HOSTILE, "background": true, "timeout_ms": 300000}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let p8008 = path(&id, "/ports/8008/");
    let plain = wait_for_async(
        "the hostile server answers on 8008",
        CLEANUP,
        || raw(&c, &p8008, "", CLEANUP),
        |a| a.as_deref().is_some_and(|a| status(a) == 200),
    )
    .await
    .unwrap_or_default();
    assert!(plain.ends_with("plain"), "{plain}");

    // Every refusal below is checked, then all of them reported at once.
    let mut wrong = Vec::new();
    // A percent-encoded port names the same port (not a 500).
    let a = raw(&c, &path(&id, "/ports/%38008/x"), "", CLEANUP)
        .await
        .expect("an answer");
    if status(&a) != 200 || !a.ends_with("plain") {
        wrong.push(format!("a percent-encoded port: {a:?}"));
    }

    // Both Content-Length and Transfer-Encoding: the chunked body wins, and the length that
    // would cut it is not forwarded.
    let a = raw(&c, &path(&id, "/ports/8006/"), "", CLEANUP)
        .await
        .expect("an answer");
    if status(&a) != 200
        || a.to_ascii_lowercase().contains("content-length: 5\r\n")
        || !a.contains("hello world")
    {
        wrong.push(format!("the conflicting length was forwarded: {a:?}"));
    }

    // A 101 to a request that asked for no upgrade is the server's error, not a switch.
    let a = raw(&c, &path(&id, "/ports/8007/"), "", CLEANUP)
        .await
        .expect("an answer");
    if status(&a) != 502 || a.contains("smuggled") {
        wrong.push(format!(
            "a 101 that no upgrade asked for was passed on: {a:?}"
        ));
    }

    // A listener that never accepts: every caller gets 502 in bounded time, and no thread of
    // the daemon stays blocked on it.
    let p8005 = path(&id, "/ports/8005/");
    // The first connection takes the place in the queue, and its request is never answered.
    let first = raw(&c, &p8005, "", Duration::from_secs(3)).await;
    if first.is_some() {
        wrong.push(format!(
            "the first request to a listener that never accepts: {first:?}"
        ));
    }
    let answers = futures::future::join_all((0..6).map(|_| raw(&c, &p8005, "", CLEANUP))).await;
    for a in &answers {
        match a.as_deref() {
            Some(a) if status(a) == 502 && a.contains("PortClosed") => {}
            other => wrong.push(format!("a full listener's caller got {other:?}")),
        }
    }
    // (Polled: a thread that made its socket may still be on its way out.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut threads = netns_threads(d.pid());
    while threads != 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        threads = netns_threads(d.pid());
    }
    if threads != 0 {
        wrong.push(format!(
            "{threads} daemon threads still connecting into the sandbox"
        ));
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The server still answers once the refusals are over.
    let a = raw(&c, &path(&id, "/ports/8008/"), "", CLEANUP)
        .await
        .expect("an answer");
    assert_eq!(status(&a), 200, "{a}");
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

on_every_backend!(multi_thread; a_hostile_server_costs_the_daemon_nothing);
