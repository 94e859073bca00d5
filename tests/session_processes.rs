//! A session's background processes, through a real daemon: an exec with `"background": true`
//! answers 202 at once and keeps running beside the session's later execs; its output is a
//! stream, its stdin takes bytes, it takes signals, it is listed, and it ends with the session
//! (delete, pause). Then the refusals: a process of another session or tenant, a signal not in
//! the set, stdin to an ended process, one process past `sessions.max_processes`; and a fork
//! bomb in the background, which the session's limits hold.

mod common;

use std::time::{Duration, Instant};

use common::backends::Backend;
use common::docker::SOCKET;
use common::sessions::{SandboxClient, koder, new_session};
use common::wait::{CLEANUP, wait_for_async};
use common::{Daemon, Opts};
use serde_json::{Value, json};

/// The daemon's options for `backend`, with at most `max` background processes per session.
fn opts(backend: Backend, max: usize) -> Opts {
    let mut config = common::docker::config(1, SOCKET);
    config.push_str(&format!("\n[sessions]\nmax_processes = {max}\n"));
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config: Some(config),
        ..Default::default()
    }
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandbox/sessions/{id}{rest}")
}

/// Starts `code` as a background process of session `id`: its process id.
async fn start(c: &SandboxClient<'_>, id: &str, code: &str) -> String {
    let r = c.exec(id, json!({"code": code, "background": true})).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let pid = r.json["process_id"]
        .as_str()
        .expect("process_id")
        .to_string();
    assert_eq!(r.json["exec_id"], json!(pid), "{}", r.text);
    assert_eq!(
        r.json["links"]["stdin"],
        json!(path(id, &format!("/processes/{pid}/stdin"))),
        "{}",
        r.text
    );
    pid
}

/// The process's entry in its session's list.
async fn entry(c: &SandboxClient<'_>, id: &str, pid: &str) -> Value {
    let r = c.call("GET", &path(id, "/processes"), None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["processes"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["process_id"] == json!(pid)).cloned())
        .unwrap_or(Value::Null)
}

/// Waits (bounded) until process `pid` has ended; its entry.
async fn ended(c: &SandboxClient<'_>, id: &str, pid: &str) -> Value {
    wait_for_async(
        &format!("process {pid} ended"),
        CLEANUP,
        || entry(c, id, pid),
        |e| e["state"] == json!("exited"),
    )
    .await
}

/// Reads the process's output stream until its stdout holds `needle` (bounded); the stdout
/// seen.
async fn stdout_until(c: &SandboxClient<'_>, id: &str, pid: &str, needle: &str) -> String {
    let deadline = Instant::now() + CLEANUP;
    let mut seen = String::new();
    while Instant::now() < deadline {
        let url = format!(
            "{}{}",
            c.d.base,
            path(id, &format!("/processes/{pid}/stream"))
        );
        let mut rb = c.d.client.get(url).header("accept", "text/event-stream");
        for (k, v) in c.headers() {
            rb = rb.header(k, v);
        }
        let mut resp = rb.send().await.expect("stream");
        assert_eq!(resp.status().as_u16(), 200);
        let mut text = String::new();
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, resp.chunk()).await {
                Ok(Ok(Some(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
                _ => break,
            }
            seen = stdout_of(&text);
            if seen.contains(needle) {
                return seen;
            }
        }
    }
    panic!("the process's stdout never held {needle:?}; it held {seen:?}");
}

/// The stdout of an SSE text: the `data` of its `stdout` events, in order.
fn stdout_of(sse: &str) -> String {
    let mut out = String::new();
    for event in sse.split("\n\n") {
        if !event.lines().any(|l| l == "event: stdout") {
            continue;
        }
        for l in event.lines() {
            if let Some(d) = l.strip_prefix("data: ")
                && let Ok(v) = serde_json::from_str::<Value>(d)
                && let Some(s) = v["data"].as_str()
            {
                out.push_str(s);
            }
        }
    }
    out
}

const ECHO: &str = "import sys\nprint('ready', flush=True)\nfor line in sys.stdin:\n    print('got:', line.strip(), flush=True)\nprint('bye', flush=True)";
const SLEEPER: &str = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)";

/// A background process reads what its stdin gets and answers on its stream while foreground
/// execs come and go; its stdin's end ends it, and the list shows its exit code.
async fn a_background_process_takes_stdin_beside_foreground_execs(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, ECHO).await;
    stdout_until(&c, &id, &pid, "ready").await;
    let e = entry(&c, &id, &pid).await;
    assert_eq!(e["state"], json!("running"), "{e}");
    assert!(
        e["code_sha256"]
            .as_str()
            .is_some_and(|s| s.starts_with("sha256:")),
        "{e}"
    );

    // Foreground execs run meanwhile; their leftovers die with them, the process does not.
    for i in 0..3 {
        let r = c
            .exec(&id, json!({"code": format!("import subprocess\nsubprocess.Popen(['sleep', '300'])\nprint({i})"), "timeout_ms": 60000}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.json["stdout"], json!(format!("{i}\n")), "{}", r.text);
    }
    assert_eq!(entry(&c, &id, &pid).await["state"], json!("running"));

    let stdin = path(&id, &format!("/processes/{pid}/stdin"));
    let r = c
        .call("POST", &stdin, Some(b"hello\nworld\n".to_vec()))
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    stdout_until(&c, &id, &pid, "got: world").await;
    let r = c
        .call("POST", &format!("{stdin}?eof=true"), Some(Vec::new()))
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    let e = ended(&c, &id, &pid).await;
    assert_eq!(e["exit_code"], json!(0), "{e}");
    let out = stdout_until(&c, &id, &pid, "bye").await;
    assert_eq!(out, "ready\ngot: hello\ngot: world\nbye\n");

    // Its result is at its exec's route, and its end is in the audit log.
    let r = c
        .call("GET", &path(&id, &format!("/execs/{pid}")), None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["status"], json!("finished"), "{}", r.text);
    let line = d.wait_for_audit_line("the process's execution line", |l| {
        l["exec_id"] == json!(pid) && l["event"] == "execution"
    });
    assert_eq!(line["exit_code"], json!(0), "{line}");

    // Stdin to an ended process is 409; so is a signal.
    let r = c.call("POST", &stdin, Some(b"late\n".to_vec())).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json["error_type"], json!("AlreadyFinished"), "{}", r.text);
    let signal = path(&id, &format!("/processes/{pid}/signal"));
    let r = c
        .call(
            "POST",
            &signal,
            Some(json!({"signal": "TERM"}).to_string().into_bytes()),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.text);
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// Signals: INT ends a sleeping python (KeyboardInterrupt), KILL ends another at once; a signal
/// not in the set is 400 and changes nothing.
async fn signals_reach_a_background_process(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let a = start(&c, &id, SLEEPER).await;
    let b = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &a, "sleeping").await;
    stdout_until(&c, &id, &b, "sleeping").await;
    let send = |pid: &str, sig: &str| {
        let p = path(&id, &format!("/processes/{pid}/signal"));
        let body = json!({"signal": sig}).to_string().into_bytes();
        let c = &c;
        async move { c.call("POST", &p, Some(body)).await }
    };
    let r = send(&a, "STOP").await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(entry(&c, &id, &a).await["state"], json!("running"));

    let r = send(&a, "INT").await;
    assert_eq!(r.status, 204, "{}", r.text);
    let e = ended(&c, &id, &a).await;
    assert_ne!(e["exit_code"], json!(0), "{e}");
    assert_eq!(entry(&c, &id, &b).await["state"], json!("running"));

    let r = send(&b, "KILL").await;
    assert_eq!(r.status, 204, "{}", r.text);
    ended(&c, &id, &b).await;
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// `sessions.max_processes` bounds a session's running processes (429); an ended one frees its
/// place. Another session's or tenant's process is 404 in every process route.
async fn processes_are_bounded_and_private(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 2));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let a = start(&c, &id, SLEEPER).await;
    let _b = start(&c, &id, SLEEPER).await;
    let r = c
        .exec(&id, json!({"code": SLEEPER, "background": true}))
        .await;
    assert_eq!(r.status, 429, "{}", r.text);
    assert!(r.text.contains("sessions.max_processes"), "{}", r.text);

    // Another tenant of the same service sees neither the session nor its process.
    let other = koder(&d, Some("team-b"));
    for (m, rest, body) in [
        ("GET", "/processes".to_string(), None),
        ("GET", format!("/processes/{a}/stream"), None),
        ("POST", format!("/processes/{a}/stdin"), Some(b"x".to_vec())),
        (
            "POST",
            format!("/processes/{a}/signal"),
            Some(json!({"signal": "KILL"}).to_string().into_bytes()),
        ),
    ] {
        let r = other.call(m, &path(&id, &rest), body).await;
        assert_eq!(r.status, 404, "{rest}: {}", r.text);
    }
    // Another session of the same caller does not have it.
    let id2 = new_session(&c, "python").await;
    let r = c
        .call(
            "POST",
            &path(&id2, &format!("/processes/{a}/signal")),
            Some(json!({"signal": "KILL"}).to_string().into_bytes()),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert_eq!(entry(&c, &id, &a).await["state"], json!("running"));

    // An ended process frees its place.
    let r = c
        .call(
            "POST",
            &path(&id, &format!("/processes/{a}/signal")),
            Some(json!({"signal": "KILL"}).to_string().into_bytes()),
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    ended(&c, &id, &a).await;
    start(&c, &id, SLEEPER).await;
    for s in [&id, &id2] {
        let r = c.call("DELETE", &path(s, ""), None).await;
        assert_eq!(r.status, 204, "{}", r.text);
    }
}

/// A session's end takes its processes: DELETE kills them (nothing of them is left), and a
/// pause ends them before the workspace is saved (the resumed session lists none).
async fn processes_end_with_the_session(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &pid, "sleeping").await;
    let r = c.call("POST", &path(&id, "/pause"), None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = c.call("GET", &path(&id, "/processes"), None).await;
    assert_eq!(r.json["processes"], json!([]), "{}", r.text);
    let line = d.wait_for_audit_line("the process's execution line", |l| {
        l["exec_id"] == json!(pid) && l["event"] == "execution"
    });
    assert_eq!(line["killed_reason"], json!("cancelled"), "{line}");
    let r = c.call("POST", &path(&id, "/resume"), None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = c.call("GET", &path(&id, "/processes"), None).await;
    assert_eq!(r.json["processes"], json!([]), "{}", r.text);

    let pid = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &pid, "sleeping").await;
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    let line = d.wait_for_audit_line("the process's execution line", |l| {
        l["exec_id"] == json!(pid) && l["event"] == "execution"
    });
    assert_eq!(line["killed_reason"], json!("cancelled"), "{line}");
    if !backend.is_container() {
        d.wait_for_no_run_cgroups();
    }
}

/// A fork bomb in the background is held by the session's pids limit, and the session goes on:
/// a foreground exec still runs, and the bomb is killed when asked.
async fn a_background_fork_bomb_is_held(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let bomb = "import os, time\nprint('bombing', flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)";
    let pid = start(&c, &id, bomb).await;
    stdout_until(&c, &id, &pid, "bombing").await;
    // The daemon answers an exec meanwhile. On a container the bomb holds the session's shared
    // pids, so the exec may find no process to start its command with (a 500 that says so in the
    // daemon's log); on local each process is a sandbox of its own.
    let r = c
        .exec(
            &id,
            json!({"code": "print('still here')", "timeout_ms": 120000}),
        )
        .await;
    if backend.is_container() {
        assert!(matches!(r.status, 200 | 500), "{}", r.text);
    } else {
        assert_eq!(r.json["stdout"], json!("still here\n"), "{}", r.text);
    }
    let r = c
        .call(
            "POST",
            &path(&id, &format!("/processes/{pid}/signal")),
            Some(json!({"signal": "KILL"}).to_string().into_bytes()),
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    ended(&c, &id, &pid).await;
    let r = c
        .exec(&id, json!({"code": "print('after')", "timeout_ms": 60000}))
        .await;
    assert_eq!(r.json["stdout"], json!("after\n"), "{}", r.text);
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// A foreground exec started with `stdin_open` (async) reads what its stdin route gets while it
/// runs; its end closes it (409), an exec without it is 409 `StdinClosed`, a synchronous one
/// with it is 400.
async fn a_foreground_exec_takes_stdin_while_it_runs(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let r = c
        .exec(
            &id,
            json!({"code": ECHO, "stdin_open": true, "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("stdin_open"), "{}", r.text);

    let r = c
        .exec(
            &id,
            json!({"code": ECHO, "stdin": "first\n", "stdin_open": true, "async": true, "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    let stdin = path(&id, &format!("/execs/{exec_id}/stdin"));
    let r = c.call("POST", &stdin, Some(b"second\n".to_vec())).await;
    assert_eq!(r.status, 204, "{}", r.text);
    let r = c
        .call("POST", &format!("{stdin}?eof=true"), Some(Vec::new()))
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    let exec_path = path(&id, &format!("/execs/{exec_id}"));
    let done = wait_for_async(
        "the exec's answer",
        CLEANUP,
        || async { c.call("GET", &exec_path, None).await.json },
        |v| v["status"] == json!("finished"),
    )
    .await;
    assert_eq!(
        done["result"]["stdout"],
        json!("ready\ngot: first\ngot: second\nbye\n"),
        "{done}"
    );
    let r = c.call("POST", &stdin, Some(b"late\n".to_vec())).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json["error_type"], json!("AlreadyFinished"), "{}", r.text);

    // An async exec without stdin_open: its stdin is closed.
    let r = c
        .exec(
            &id,
            json!({"code": SLEEPER, "async": true, "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    let r = c
        .call(
            "POST",
            &path(&id, &format!("/execs/{exec_id}/stdin")),
            Some(b"x".to_vec()),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json["error_type"], json!("StdinClosed"), "{}", r.text);
    // Another session's exec id is 404 here.
    let r = c
        .call(
            "POST",
            &path(&id, "/execs/exe_unknown/stdin"),
            Some(b"x".to_vec()),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// A signal is not held back by stdin the process does not read: with more bytes queued for its
/// stdin than the run buffers, TERM still reaches the sleeping process and ends it.
async fn a_signal_passes_stdin_the_process_does_not_read(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &pid, "sleeping").await;
    // Past what a run queues for a stdin nobody reads (the body limit is 1 MiB).
    let stdin = path(&id, &format!("/processes/{pid}/stdin"));
    for _ in 0..6 {
        let r = c.call("POST", &stdin, Some(vec![b'x'; 1 << 20])).await;
        assert_eq!(r.status, 204, "{}", r.text);
    }
    let signal = path(&id, &format!("/processes/{pid}/signal"));
    let body = json!({"signal": "TERM"}).to_string().into_bytes();
    let r = c.call("POST", &signal, Some(body)).await;
    assert_eq!(r.status, 204, "{}", r.text);
    let e = ended(&c, &id, &pid).await;
    assert_eq!(e["exit_code"], json!(128 + 15), "{e}");
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// What the daemon holds for a stdin nobody reads is bounded in bytes, not in calls: once a few
/// MiB wait for a process that never reads, the next call waits for them (it is not answered),
/// rather than each of dozens of 1 MiB calls being queued in the daemon's memory.
async fn stdin_nobody_reads_is_bounded_in_bytes(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &pid, "sleeping").await;
    let stdin = path(&id, &format!("/processes/{pid}/stdin"));
    let mut queued = 0usize;
    loop {
        let call = c.call("POST", &stdin, Some(vec![b'x'; 1 << 20]));
        match tokio::time::timeout(Duration::from_secs(5), call).await {
            Ok(r) => {
                assert_eq!(r.status, 204, "{}", r.text);
                queued += 1;
                assert!(queued <= 16, "{queued} MiB queued for a stdin nobody reads");
            }
            // Held back: the queue is full.
            Err(_) => break,
        }
    }
    let signal = path(&id, &format!("/processes/{pid}/signal"));
    let body = json!({"signal": "KILL"}).to_string().into_bytes();
    let r = c.call("POST", &signal, Some(body)).await;
    assert_eq!(r.status, 204, "{}", r.text);
    ended(&c, &id, &pid).await;
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// A background process is one of the session's execs: the session's `execs` count and its
/// `session_end` audit line count it, as they count every `execution` line with its id.
async fn background_processes_count_among_the_sessions_execs(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, "print('done')").await;
    ended(&c, &id, &pid).await;
    let r = c.call("GET", &path(&id, ""), None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["execs"], json!(1), "{}", r.text);
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    let line = d.wait_for_audit_line("the session's end", |l| {
        l["event"] == "session_end" && l["session_id"] == json!(id)
    });
    assert_eq!(line["execs"], json!(1), "{line}");
}

/// Bytes for a stdin already closed (`?eof=true`) are refused with 409, not answered 204 and
/// dropped: the caller learns they never reach the process.
async fn stdin_after_its_end_is_refused(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &pid, "sleeping").await;
    let stdin = path(&id, &format!("/processes/{pid}/stdin"));
    let r = c
        .call("POST", &format!("{stdin}?eof=true"), Some(vec![]))
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    let r = c.call("POST", &stdin, Some(b"late\n".to_vec())).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(r.text.contains("stdin"), "{}", r.text);
    // Closing it again changes nothing.
    let r = c
        .call("POST", &format!("{stdin}?eof=true"), Some(vec![]))
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(entry(&c, &id, &pid).await["state"], json!("running"));
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

on_every_backend!(
    multi_thread;
    a_foreground_exec_takes_stdin_while_it_runs,
    a_background_process_takes_stdin_beside_foreground_execs,
    signals_reach_a_background_process,
    processes_are_bounded_and_private,
    processes_end_with_the_session,
    a_background_fork_bomb_is_held,
    a_signal_passes_stdin_the_process_does_not_read,
    background_processes_count_among_the_sessions_execs,
    stdin_after_its_end_is_refused,
);

/// A container session whose profile has egress refuses background processes with a clear 400:
/// the exec proxy's loopback port in the container serves one exec at a time.
async fn container_egress_sessions_refuse_background_processes(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let cap = d.mint(executor_arm::auth::MintRequest {
        kind: Some(executor_arm::config::TokenKind::Capability),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["PythonExecute".into(), "NetworkAccess".into()],
        profiles: Some(vec!["python-packages".into()]),
        ..Default::default()
    });
    let r = c
        .create(
            json!({"language": "python", "profile": "python-packages", "capability_token": cap}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let r = c
        .exec(&id, json!({"code": SLEEPER, "background": true}))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("no network egress yet"), "{}", r.text);
    // A foreground exec of the session runs as before.
    let r = c
        .exec(&id, json!({"code": "print('fine')", "timeout_ms": 60000}))
        .await;
    assert_eq!(r.json["stdout"], json!("fine\n"), "{}", r.text);
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

// Local only: in a container the supervisor takes the bytes off the daemon as they come and
// keeps at most 4 MiB for a command that does not read them (the rest is dropped and the run
// reports `stdin_broken_pipe`), so no call is held back there.
mod local_stdin {
    #[tokio::test(flavor = "multi_thread")]
    async fn stdin_nobody_reads_is_bounded_in_bytes() {
        super::stdin_nobody_reads_is_bounded_in_bytes(super::Backend::Local).await;
    }
}

mod containers {
    use super::Backend;

    #[tokio::test(flavor = "multi_thread")]
    async fn docker_egress_sessions_refuse_background_processes() {
        Backend::Docker.require("containers::docker_egress_sessions_refuse_background_processes");
        super::container_egress_sessions_refuse_background_processes(Backend::Docker).await;
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn gvisor_egress_sessions_refuse_background_processes() {
        Backend::Gvisor.require("containers::gvisor_egress_sessions_refuse_background_processes");
        super::container_egress_sessions_refuse_background_processes(Backend::Gvisor).await;
    }
}
