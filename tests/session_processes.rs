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

/// Sends KILL to process `pid` and waits (bounded) until it has ended.
async fn kill(c: &SandboxClient<'_>, id: &str, pid: &str) {
    let r = c
        .call(
            "POST",
            &path(id, &format!("/processes/{pid}/signal")),
            Some(json!({"signal": "KILL"}).to_string().into_bytes()),
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    ended(c, id, pid).await;
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
    // The same output read by offsets, without a stream.
    let out = c
        .call("GET", &path(&id, &format!("/processes/{pid}/output")), None)
        .await;
    assert_eq!(out.status, 200, "{}", out.text);
    assert_eq!(out.json["process_id"], json!(pid), "{}", out.text);
    assert_eq!(out.json["stdout"]["from"], json!(0), "{}", out.text);
    let text = out.json["stdout"]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("got: hello\n") && text.contains("got: world"),
        "{}",
        out.text
    );
    let next = out.json["stdout"]["next"].as_u64().unwrap();
    let rest = c
        .call(
            "GET",
            &path(&id, &format!("/processes/{pid}/output?stdout_from={next}")),
            None,
        )
        .await;
    assert_eq!(rest.json["stdout"]["from"], json!(next), "{}", rest.text);
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
        ("GET", format!("/processes/{a}/output"), None),
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
        .call("GET", &path(&id2, &format!("/processes/{a}/output")), None)
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
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
    kill(&c, &id, &a).await;
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
    // The daemon answers an exec meanwhile. The bomb holds the session's pids, which every run
    // of the session shares, so the exec may find no process to start its command with: a
    // retryable 429 that says so.
    let r = c
        .exec(
            &id,
            json!({"code": "print('still here')", "timeout_ms": 120000}),
        )
        .await;
    assert!(matches!(r.status, 200 | 429), "{}", r.text);
    if r.status == 200 {
        assert!(r.json["exit_code"].is_i64(), "{}", r.text);
    } else {
        assert_pids_held(&r);
    }
    kill(&c, &id, &pid).await;
    let r = c
        .exec(&id, json!({"code": "print('after')", "timeout_ms": 60000}))
        .await;
    assert_eq!(r.json["stdout"], json!("after\n"), "{}", r.text);
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// The answer of a run that found every pid of its session held: 429 `Overloaded`, retryable,
/// with `Retry-After`, saying so.
fn assert_pids_held(r: &common::Resp) {
    assert_eq!(r.status, 429, "{}", r.text);
    assert_eq!(r.json["error_type"], json!("Overloaded"), "{}", r.text);
    assert_eq!(r.json["retryable"], json!(true), "{}", r.text);
    assert!(
        r.json["error"]
            .as_str()
            .is_some_and(|e| e.contains("hold all of its pids")),
        "{}",
        r.text
    );
    assert_eq!(
        r.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..]),
        "{}",
        r.text
    );
}

/// A background process that forks until its session's pids limit refuses it, then holds every
/// pid: a foreground exec is a retryable 429 that says so, not a daemon failure, and so is a
/// background one (its record keeps the 429; the audit log its `execution_error`), and so is a
/// file or archive call that needs a process in a container (the session goes on: no call
/// leaves its sandbox out of step); once the holder is killed, execs and file calls run again. On gVisor the session's pids bound the sandbox user's
/// processes (RLIMIT_NPROC: the sentry keeps no pids cgroup of its own), and the supervisor, root,
/// still forks the one process a run starts with: there the exec may run.
async fn a_session_whose_pids_are_all_held_answers_429(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let r = c
        .create(
            json!({"language": "python", "limits": {"pids": 24}, "capability_token": d.cap_all()}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().expect("id").to_string();
    let hold = "import os, time\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(600)\n            os._exit(0)\n    except OSError:\n        break\n    n += 1\nprint('holding', n, flush=True)\ntime.sleep(600)";
    let pid = start(&c, &id, hold).await;
    stdout_until(&c, &id, &pid, "holding").await;
    let strict = backend != Backend::Gvisor;
    let r = c
        .exec(&id, json!({"code": "print('x')", "timeout_ms": 60000}))
        .await;
    if strict || r.status != 200 {
        assert_pids_held(&r);
    }
    // A background start is answered before it runs: its record keeps the 429.
    let r = c
        .exec(&id, json!({"code": "print('x')", "background": true}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let second = r.json["process_id"]
        .as_str()
        .expect("process_id")
        .to_string();
    ended(&c, &id, &second).await;
    let r = c
        .call("GET", &path(&id, &format!("/execs/{second}")), None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    if strict || r.json["http_status"] != json!(200) {
        assert_eq!(r.json["http_status"], json!(429), "{}", r.text);
        assert_eq!(
            r.json["result"]["error_type"],
            json!("Overloaded"),
            "{}",
            r.text
        );
        assert_eq!(r.json["result"]["retryable"], json!(true), "{}", r.text);
        d.wait_for_audit_line("the refused background run's error line", |l| {
            l["event"] == "execution_error"
                && l["exec_id"] == json!(second)
                && l["error_type"] == json!("Overloaded")
        });
    }
    // File calls: on runc each is a helper process the supervisor forks (the local backend
    // and gVisor's root supervisor need none the limit holds back).
    let calls = [
        ("PUT", path(&id, "/files/f.txt"), Some(b"data".to_vec())),
        ("GET", path(&id, "/files/f.txt"), None),
        ("GET", path(&id, "/files"), None),
        ("GET", path(&id, "/archive"), None),
    ];
    for (method, route, body) in &calls {
        let r = c.call(method, route, body.clone()).await;
        if backend == Backend::Docker {
            assert_pids_held(&r);
        } else {
            assert!(r.status < 300, "{method} {route}: {}", r.text);
        }
    }
    kill(&c, &id, &pid).await;
    // The holder's pids come back to the session (bounded: a kill ends its processes
    // asynchronously on containers).
    wait_for_async(
        "the session's pids given back",
        CLEANUP,
        || async {
            c.exec(&id, json!({"code": "print('after')", "timeout_ms": 60000}))
                .await
                .json["stdout"]
                .clone()
        },
        |out| out == &json!("after\n"),
    )
    .await;
    for (method, route, body) in &calls {
        let r = c.call(method, route, body.clone()).await;
        assert!(r.status < 300, "{method} {route}: {}", r.text);
    }
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    if backend == Backend::Local {
        d.wait_for_no_run_cgroups();
    }
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
/// stdin than the run buffers, and more still coming while the signal goes, TERM reaches the
/// sleeping process and ends it, and its end is reported although stdin bytes were still on
/// their way (a container run's supervisor reads no more of them once its command is gone, and
/// calls of 8 MiB keep more on their way than the pipes between the daemon and it hold).
async fn a_signal_passes_stdin_the_process_does_not_read(backend: Backend) {
    const CALL: usize = 8 << 20;
    let mut o = opts(backend, 4);
    if let Some(config) = o.config.as_mut() {
        config.push_str(&format!("\n[server]\nbody_limit_bytes = {CALL}\n"));
    }
    let d = Daemon::start_with(o);
    let c = koder(&d, Some("team-a"));
    let id = new_session(&c, "python").await;
    let pid = start(&c, &id, SLEEPER).await;
    stdout_until(&c, &id, &pid, "sleeping").await;
    let stdin = path(&id, &format!("/processes/{pid}/stdin"));
    let signal = path(&id, &format!("/processes/{pid}/signal"));
    // Past what a run queues for a stdin nobody reads, and more on their way while the signal
    // is sent (two callers, so that one always waits for room), so that the run ends with stdin
    // bytes in flight.
    let answered = std::sync::atomic::AtomicUsize::new(0);
    // Local holds less for a stdin nobody reads (later calls wait, unanswered) than a container
    // run, whose supervisor takes the bytes and drops what its 4 MiB cannot hold.
    let before_signal = if backend == Backend::Local { 2 } else { 3 };
    let feed = || async {
        for _ in 0..6 {
            let r = c.call("POST", &stdin, Some(vec![b'x'; CALL])).await;
            if r.status != 204 {
                // The process ended while this call waited: refused as every late one is.
                let n = answered.load(std::sync::atomic::Ordering::SeqCst);
                assert!(
                    n >= before_signal,
                    "after {n} calls: {} {}",
                    r.status,
                    r.text
                );
                assert_eq!(r.status, 409, "{}", r.text);
                assert_eq!(r.json["error_type"], json!("AlreadyFinished"), "{}", r.text);
                return;
            }
            answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    };
    let term = async {
        let deadline = Instant::now() + CLEANUP;
        while answered.load(std::sync::atomic::Ordering::SeqCst) < before_signal {
            assert!(
                Instant::now() < deadline,
                "the stdin calls were not answered"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let body = json!({"signal": "TERM"}).to_string().into_bytes();
        let r = c.call("POST", &signal, Some(body)).await;
        assert_eq!(r.status, 204, "{}", r.text);
    };
    tokio::join!(feed(), feed(), term);
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

/// A session's runs count together in its pids limit: with a background process holding 25
/// processes of a session's 40, a foreground exec cannot start 25 more; once the background
/// process is killed, it can (its pids are given back).
async fn background_processes_share_the_sessions_limits(backend: Backend) {
    let d = Daemon::start_with(opts(backend, 4));
    let c = koder(&d, Some("team-a"));
    let r = c
        .create(
            json!({"language": "python", "limits": {"pids": 40}, "capability_token": d.cap_all()}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().expect("id").to_string();
    let hold = "import subprocess, time\nkids = [subprocess.Popen(['sleep', '600']) for _ in range(25)]\nprint('holding', len(kids), flush=True)\ntime.sleep(600)";
    let pid = start(&c, &id, hold).await;
    stdout_until(&c, &id, &pid, "holding 25").await;
    let spawn = "import subprocess\nkids = []\ntry:\n    for _ in range(25):\n        kids.append(subprocess.Popen(['sleep', '600']))\nexcept OSError:\n    pass\nprint('started', len(kids))\nfor k in kids:\n    k.kill()\n    k.wait()";
    let r = c
        .exec(&id, json!({"code": spawn, "timeout_ms": 120000}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let started: usize = r.json["stdout"]
        .as_str()
        .and_then(|s| s.trim().strip_prefix("started "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count: {}", r.text));
    assert!(
        started < 25,
        "a foreground exec started {started} processes beside the 25 of a background one, in a session of 40 pids"
    );
    kill(&c, &id, &pid).await;
    // The killed process's pids come back to the session (bounded: the kill ends its processes
    // asynchronously on containers).
    wait_for_async(
        "the session's pids given back",
        CLEANUP,
        || async {
            c.exec(&id, json!({"code": spawn, "timeout_ms": 120000}))
                .await
                .json["stdout"]
                .clone()
        },
        |out| out == &json!("started 25\n"),
    )
    .await;
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    if backend == Backend::Local {
        d.wait_for_no_run_cgroups();
    }
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

const BATCHES: &str = "import sys\nprint('ready', flush=True)\nfor line in sys.stdin:\n    n = int(line)\n    for i in range(200):\n        print(f'{n}:{i:04d} ' + 'x' * 40, flush=True)\n    print(f'done {n}', flush=True)";

/// The `offset` of the first `stdout` event of an SSE text.
fn first_stdout_offset(sse: &str) -> Option<u64> {
    sse.split("\n\n")
        .filter(|e| e.lines().any(|l| l == "event: stdout"))
        .find_map(|e| {
            e.lines()
                .find_map(|l| l.strip_prefix("data: "))
                .and_then(|d| serde_json::from_str::<Value>(d).ok())
                .and_then(|v| v["offset"].as_u64())
        })
}

/// A background process's stream follows its output past the session's `output_bytes`: the
/// newest bytes reach its readers while the oldest leave its ring (a reader from the start
/// begins at the oldest byte kept, its event's offset says which), and its record keeps the
/// first `output_bytes`, truncated, as every run's does.
async fn a_background_process_streams_past_its_output_cap_through_its_ring(backend: Backend) {
    let mut o = opts(backend, 4);
    if let Some(config) = o.config.as_mut() {
        config.push_str("process_output_ring_bytes = 4096\n");
    }
    let d = Daemon::start_with(o);
    let c = koder(&d, Some("team-a"));
    let r = c
        .create(json!({"language": "python", "limits": {"output_bytes": 1000}, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().expect("id").to_string();
    let pid = start(&c, &id, BATCHES).await;
    stdout_until(&c, &id, &pid, "ready").await;
    let stdin = path(&id, &format!("/processes/{pid}/stdin"));
    for n in 0..3 {
        let r = c
            .call("POST", &stdin, Some(format!("{n}\n").into_bytes()))
            .await;
        assert_eq!(r.status, 204, "{}", r.text);
        // Each batch is about 10 KB, past the cap of 1000 bytes and past the ring.
        // A reader follows all of it, past the cap; once a batch has passed, what came before
        // it has left the ring.
        let seen = stdout_until(&c, &id, &pid, &format!("done {n}")).await;
        if n > 0 {
            assert!(
                !seen.contains("ready"),
                "the oldest bytes did not leave the ring ({} bytes seen)",
                seen.len()
            );
        }
    }
    // A reader from the start begins at the oldest byte kept, well past the first.
    let url = format!(
        "{}{}",
        d.base,
        path(&id, &format!("/processes/{pid}/stream"))
    );
    let mut rb = d.client.get(url).header("accept", "text/event-stream");
    for (k, v) in c.headers() {
        rb = rb.header(k, v);
    }
    let mut resp = rb.send().await.expect("stream");
    assert_eq!(resp.status().as_u16(), 200);
    let mut text = String::new();
    let until = Instant::now() + CLEANUP;
    while first_stdout_offset(&text).is_none() && Instant::now() < until {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, resp.chunk()).await {
            Ok(Ok(Some(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
            _ => break,
        }
    }
    let offset = first_stdout_offset(&text).expect("a stdout event");
    assert!(offset > 20_000, "the first kept byte is at {offset}");
    drop(resp);

    let r = c
        .call("POST", &format!("{stdin}?eof=true"), Some(Vec::new()))
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    ended(&c, &id, &pid).await;
    let r = c
        .call("GET", &path(&id, &format!("/execs/{pid}")), None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let result = &r.json["result"];
    assert_eq!(result["stdout_truncated"], json!(true), "{}", r.text);
    assert_eq!(
        result["stdout"].as_str().map(str::len),
        Some(1000),
        "{}",
        r.text
    );
    assert!(
        result["stdout"]
            .as_str()
            .is_some_and(|s| s.starts_with("ready\n0:0000 ")),
        "{}",
        r.text
    );
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
}

on_every_backend!(
    multi_thread;
    a_background_process_streams_past_its_output_cap_through_its_ring,
    a_foreground_exec_takes_stdin_while_it_runs,
    a_background_process_takes_stdin_beside_foreground_execs,
    signals_reach_a_background_process,
    processes_are_bounded_and_private,
    processes_end_with_the_session,
    a_background_fork_bomb_is_held,
    a_session_whose_pids_are_all_held_answers_429,
    a_signal_passes_stdin_the_process_does_not_read,
    background_processes_count_among_the_sessions_execs,
    background_processes_share_the_sessions_limits,
    stdin_after_its_end_is_refused,
);

/// A runc session whose profile has raw TCP rules refuses background processes with a clear
/// 400 (the rules' listeners are one per destination port and container, which the foreground
/// execs hold); a foreground exec runs as before. (Egress through the proxy works for background
/// processes: tests/egress.rs.)
async fn container_tcp_rule_sessions_refuse_background_processes(backend: Backend) {
    let profile = common::shipped_profile("python-packages")
        .replace("[network]\n", "[network]\ntcp = [\"10.0.0.0/8:5432\"]\n");
    let profiles = common::profiles_with(&[("python-tcp", profile)]);
    let mut o = opts(backend, 4);
    o.env.push((
        "EXECUTOR_ARM_PROFILES_DIR".into(),
        profiles.path().display().to_string(),
    ));
    let d = Daemon::start_with(o);
    let c = koder(&d, Some("team-a"));
    let cap = d.mint(executor_arm::auth::MintRequest {
        kind: Some(executor_arm::config::TokenKind::Capability),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["PythonExecute".into(), "NetworkAccess".into()],
        profiles: Some(vec!["python-tcp".into()]),
        ..Default::default()
    });
    let r = c
        .create(json!({"language": "python", "profile": "python-tcp", "capability_token": cap}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let r = c
        .exec(&id, json!({"code": SLEEPER, "background": true}))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("cannot have raw TCP rules"), "{}", r.text);
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
    async fn docker_tcp_rule_sessions_refuse_background_processes() {
        Backend::Docker.require("containers::docker_tcp_rule_sessions_refuse_background_processes");
        super::container_tcp_rule_sessions_refuse_background_processes(Backend::Docker).await;
    }
}

/// A local session's runs share its `memory_mb` through the session's group cgroup: a
/// background process holding 60 MiB and a foreground exec taking 50 MiB more do not both fit
/// in a session of 96 MiB, though each fits alone. The group's OOM kill takes one of them, and
/// the run it killed says so (`oom`), whichever it is.
///
/// Local only: a container session's processes share its container's memory, a limit the
/// engine sets (docker's own cgroup), not the daemon's group.
#[tokio::test(flavor = "multi_thread")]
async fn local_background_processes_share_the_sessions_memory() {
    let d = Daemon::start_with(opts(Backend::Local, 4));
    let c = koder(&d, Some("team-a"));
    let r = c
        .create(json!({"language": "python", "limits": {"memory_mb": 96}, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().expect("id").to_string();
    let touch = |mib: u32, then: &str| {
        format!(
            "b = bytearray({mib} << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\n{then}"
        )
    };
    let hold = touch(
        60,
        "import time\nprint('holding', flush=True)\ntime.sleep(600)",
    );
    let pid = start(&c, &id, &hold).await;
    stdout_until(&c, &id, &pid, "holding").await;
    let r = c
        .exec(
            &id,
            json!({"code": touch(50, "print('ate')"), "timeout_ms": 120000}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    if r.json["killed_reason"] == json!("oom") {
        assert_eq!(r.json["oom"], json!(true), "{}", r.text);
    } else {
        // The foreground exec ran: the group's kill took the background process.
        assert_eq!(r.json["stdout"], json!("ate\n"), "{}", r.text);
        let e = ended(&c, &id, &pid).await;
        assert_eq!(e["exit_code"], json!(137), "{e}");
        let line = d.wait_for_audit_line("the background process's execution line", |l| {
            l["exec_id"] == json!(pid) && l["event"] == "execution"
        });
        assert_eq!(line["killed_reason"], json!("oom"), "{line}");
    }
    let r = c.call("DELETE", &path(&id, ""), None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    d.wait_for_no_run_cgroups();
}
