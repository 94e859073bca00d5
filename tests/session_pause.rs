//! Pause and resume of sessions, through a real daemon: the workspace saved to
//! `sessions.store_dir`, the sandbox freed, and a fresh sandbox with that workspace after a
//! resume, an exec or a file call, across a daemon restart, on every backend. Then the faults:
//! a pause while an exec runs, a store that is full or cannot be written, an expired paused
//! session, and a daemon killed mid-pause.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::backends::Backend;
use common::docker::{SOCKET, docker_ps, instance_of, one_at_a_time};
use common::sessions::{SandboxClient, koder, new_session};
use common::wait::wait_until;
use common::{Daemon, Opts};
use serde_json::{Value, json};

/// The daemon's options for `backend`, with `extra` TOML (a `[sessions]` table, if any).
fn opts(backend: Backend, extra: &str) -> Opts {
    let mut config = common::docker::config(1, SOCKET);
    config.push_str(extra);
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config: Some(config),
        ..Default::default()
    }
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandbox/sessions/{id}{rest}")
}

async fn run(c: &SandboxClient<'_>, id: &str, code: &str) -> Value {
    let r = c.exec(id, json!({"code": code, "timeout_ms": 60000})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json
}

/// The session directories of the daemon's paused store.
fn stored(d: &Daemon) -> Vec<String> {
    let dir = d.dir.path().join("state").join("sessions");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Whether anything of session `id` is still a sandbox: its local workspace mount, or its
/// container.
fn sandbox_of(d: &Daemon, backend: Backend, id: &str) -> bool {
    if backend.is_container() {
        !docker_ps(&[
            format!("label=executor-arm.instance={}", instance_of(d)),
            format!("name=executor-arm-{id}"),
        ])
        .is_empty()
    } else {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        mounts.contains(id)
    }
}

fn audit_events<'a>(lines: &'a [Value], event: &str, id: &str) -> Vec<&'a Value> {
    lines
        .iter()
        .filter(|l| l["event"] == event && l["session_id"] == id)
        .collect()
}

/// A file, a directory and a symlink written before the pause are there after a pause, a daemon
/// restart and a resume; the sandbox was freed meanwhile; the paused session reads as paused;
/// the audit log has the pause and the resume with one digest; a delete leaves nothing in the
/// store.
async fn pause_restart_resume_keeps_the_workspace(backend: Backend) {
    let _serial = if backend.is_container() {
        Some(one_at_a_time().await)
    } else {
        None
    };
    let d = Daemon::start_with(opts(backend, ""));
    let c = koder(&d, Some("team-p"));
    let id = new_session(&c, "python").await;
    let wrote = run(
        &c,
        &id,
        "import os\nos.makedirs('src/pkg', exist_ok=True)\nopen('src/pkg/mod.py','w').write('X = 42\\n')\n\
         os.symlink('src/pkg/mod.py', 'link.py')\nopen('big.bin','wb').write(os.urandom(3 << 20))\n\
         import hashlib\nprint(hashlib.sha256(open('big.bin','rb').read()).hexdigest())",
    )
    .await;
    let digest = wrote["stdout"].as_str().unwrap().trim().to_string();

    let r = c.call("POST", &path(&id, "/pause"), None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["state"], "paused", "{}", r.text);
    assert!(r.json["paused_until"].is_string(), "{}", r.text);
    // A container is removed in the background once the pause is committed.
    wait_until("the sandbox is freed", Duration::from_secs(30), || {
        !sandbox_of(&d, backend, &id)
    });
    assert_eq!(stored(&d), vec![id.clone()]);
    // Pausing a paused session answers it as it is.
    let again = c.call("POST", &path(&id, "/pause"), None).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.json["state"], "paused");

    let d = d.restart(opts(backend, ""));
    let c = koder(&d, Some("team-p"));
    let got = c.call("GET", &path(&id, ""), None).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.json["state"], "paused", "{}", got.text);
    // Another tenant finds nothing, paused or not.
    let other = koder(&d, Some("team-q"));
    assert_eq!(other.call("GET", &path(&id, ""), None).await.status, 404);
    assert_eq!(
        other.call("POST", &path(&id, "/resume"), None).await.status,
        404
    );

    // An exec resumes it.
    let back = run(
        &c,
        &id,
        "import hashlib, os\nfrom importlib import util\nprint(open('link.py').read().strip(), os.readlink('link.py'))\n\
         print(hashlib.sha256(open('big.bin','rb').read()).hexdigest())",
    )
    .await;
    let out = back["stdout"].as_str().unwrap();
    assert!(out.contains("X = 42 src/pkg/mod.py"), "{out}");
    assert!(out.contains(&digest), "{out}");
    let now = c.call("GET", &path(&id, ""), None).await;
    assert_eq!(now.json["state"], "running", "{}", now.text);
    assert!(now.json.get("paused_until").is_none(), "{}", now.text);
    assert!(sandbox_of(&d, backend, &id));
    assert!(stored(&d).is_empty(), "a resumed session leaves the store");

    let lines = d.audit_lines();
    let paused = audit_events(&lines, "session_pause", &id);
    let resumed = audit_events(&lines, "session_resume", &id);
    assert_eq!((paused.len(), resumed.len()), (1, 1), "{lines:#?}");
    assert_eq!(
        paused[0]["workspace_sha256"],
        resumed[0]["workspace_sha256"]
    );
    assert!(
        paused[0]["workspace_sha256"]
            .as_str()
            .unwrap()
            .starts_with("sha256:")
    );

    // Paused again, then deleted while paused: nothing is left.
    assert_eq!(c.call("POST", &path(&id, "/pause"), None).await.status, 200);
    assert_eq!(c.call("DELETE", &path(&id, ""), None).await.status, 204);
    assert!(stored(&d).is_empty());
    assert_eq!(c.call("GET", &path(&id, ""), None).await.status, 404);
    wait_until("the sandbox is freed", Duration::from_secs(30), || {
        !sandbox_of(&d, backend, &id)
    });
    common::docker::finish(d);
}

on_every_backend!(multi_thread; pause_restart_resume_keeps_the_workspace);

/// A pause while an exec runs is 409, and the exec goes on; a resume of a running session
/// answers it as it is.
#[tokio::test(flavor = "multi_thread")]
async fn a_pause_while_an_exec_runs_is_409() {
    let d = Daemon::start_with(opts(Backend::Local, ""));
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let r = c
        .exec(
            &id,
            json!({"code": "import time\ntime.sleep(3)\nprint('done')", "async": true}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    let p = c.call("POST", &path(&id, "/pause"), None).await;
    assert_eq!(p.status, 409, "{}", p.text);
    assert_eq!(p.json["error_type"], "SessionBusy");
    let resumed = c.call("POST", &path(&id, "/resume"), None).await;
    assert_eq!(resumed.status, 200, "{}", resumed.text);
    assert_eq!(resumed.json["state"], "running");
    let exec_path = path(&id, &format!("/execs/{exec_id}"));
    let last = common::wait::wait_for_async(
        "the exec to end",
        Duration::from_secs(30),
        || async { c.call("GET", &exec_path, None).await.json },
        |v: &Value| v["status"] == "finished",
    )
    .await;
    assert_eq!(last["result"]["stdout"], "done\n", "{last}");
    assert!(stored(&d).is_empty());
}

/// A store that cannot be written is 503 and a full one 507; either way the session runs on,
/// its workspace as it was, and nothing is left in the store.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_is_full_or_unwritable_leaves_the_session_running() {
    let store = tempfile::tempdir().unwrap();
    let mnt = store.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(mounted.success());
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let extra = format!("[sessions]\nstore_dir = \"{}\"\n", mnt.display());
    let d = Daemon::start_with(opts(Backend::Local, &extra));
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    run(
        &c,
        &id,
        "import os\nopen('big.bin','wb').write(os.urandom(2 << 20))\nopen('keep.txt','w').write('kept')",
    )
    .await;

    let full = c.call("POST", &path(&id, "/pause"), None).await;
    assert_eq!(full.status, 507, "{}", full.text);
    assert_eq!(full.json["error_type"], "StoreFull", "{}", full.text);
    let listed = std::fs::read_dir(&mnt).unwrap().count();
    assert_eq!(listed, 0, "nothing is left in the store");
    let after = run(&c, &id, "print(open('keep.txt').read())").await;
    assert_eq!(after["stdout"], "kept\n");

    // Unwritable: the store's directory is made read-only (root is refused by a read-only
    // remount, not by permission bits).
    let ro = std::process::Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(ro.success());
    run(&c, &id, "import os\nos.remove('big.bin')").await;
    let unwritable = c.call("POST", &path(&id, "/pause"), None).await;
    assert_eq!(unwritable.status, 503, "{}", unwritable.text);
    assert_eq!(unwritable.json["error_type"], "SandboxUnavailable");
    let after = run(&c, &id, "print(open('keep.txt').read())").await;
    assert_eq!(after["stdout"], "kept\n");
    let got = c.call("GET", &path(&id, ""), None).await;
    assert_eq!(got.json["state"], "running");
}

/// A paused session past `sessions.paused_ttl_seconds` is gone: its resume is 404, its store
/// directory removed, its end audited as expired.
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_of_an_expired_session_is_404() {
    let d = Daemon::start_with(opts(Backend::Local, "[sessions]\npaused_ttl_seconds = 1\n"));
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    assert_eq!(c.call("POST", &path(&id, "/pause"), None).await.status, 200);
    std::thread::sleep(Duration::from_millis(1500));
    let r = c.call("POST", &path(&id, "/resume"), None).await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(stored(&d).is_empty(), "{:?}", stored(&d));
    let lines = d.audit_lines();
    let ends = audit_events(&lines, "session_end", &id);
    assert_eq!(ends.len(), 1, "{lines:#?}");
    assert_eq!(ends[0]["reason"], "expired");
}

/// The daemon killed at some point of a pause and restarted: the session is then either paused
/// with its whole workspace (every byte checked) or gone with the daemon as a running session
/// is; never a part of a workspace, and nothing of the pause is left in the store.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_killed_mid_pause_leaves_the_old_state_or_the_new() {
    let mut d = Daemon::start_with(opts(Backend::Local, ""));
    for delay_ms in [0u64, 40, 150, 400] {
        let c = koder(&d, None);
        let id = new_session(&c, "python").await;
        let wrote = run(
            &c,
            &id,
            "import os, hashlib\nh = hashlib.sha256()\nfor i in range(24):\n    b = os.urandom(1 << 20)\n    h.update(b)\n    open('f%02d' % i, 'wb').write(b)\nprint(h.hexdigest())",
        )
        .await;
        let digest = wrote["stdout"].as_str().unwrap().trim().to_string();
        let base = d.base.clone();
        let headers = c.headers();
        let client = d.client.clone();
        let url = format!("{base}{}", path(&id, "/pause"));
        let pause = tokio::spawn(async move {
            let mut rb = client.post(url);
            for (k, v) in headers {
                rb = rb.header(k, v);
            }
            let _ = rb.send().await;
        });
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        d.kill9();
        pause.abort();
        d = d.restart(opts(Backend::Local, ""));
        let c = koder(&d, None);
        let got = c.call("GET", &path(&id, ""), None).await;
        match got.status {
            200 => {
                assert_eq!(got.json["state"], "paused", "{}", got.text);
                let back = run(
                    &c,
                    &id,
                    "import hashlib\nh = hashlib.sha256()\nfor i in range(24):\n    h.update(open('f%02d' % i, 'rb').read())\nprint(h.hexdigest())",
                )
                .await;
                assert_eq!(
                    back["stdout"].as_str().unwrap().trim(),
                    digest,
                    "after {delay_ms} ms"
                );
                assert_eq!(c.call("DELETE", &path(&id, ""), None).await.status, 204);
            }
            404 => {}
            other => panic!("after {delay_ms} ms: {other} {}", got.text),
        }
        // What an uncommitted pause left is cleaned up by the restarted daemon.
        let store = d.dir.path().join("state").join("sessions");
        wait_until(
            "the store holds no leftovers",
            Duration::from_secs(30),
            || std::fs::read_dir(&store).is_ok_and(|r| r.count() == 0),
        );
    }
}

/// A daemon stopped with SIGTERM pauses its sessions, which its successor resumes with their
/// workspace; with `sessions.pause_on_shutdown = false` they end with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_restart_pauses_sessions_unless_told_not_to() {
    let d = Daemon::start_with(opts(Backend::Local, ""));
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    run(&c, &id, "open('notes.txt','w').write('across the restart')").await;
    let d = d.restart(opts(
        Backend::Local,
        "[sessions]\npause_on_shutdown = false\n",
    ));
    let c = koder(&d, None);
    let got = c.call("GET", &path(&id, ""), None).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.json["state"], "paused", "{}", got.text);
    let back = run(&c, &id, "print(open('notes.txt').read())").await;
    assert_eq!(back["stdout"], "across the restart\n");

    let d = d.restart(opts(Backend::Local, ""));
    let c = koder(&d, None);
    assert_eq!(c.call("GET", &path(&id, ""), None).await.status, 404);
    assert!(stored(&d).is_empty());
    let lines = d.audit_lines();
    let ends = audit_events(&lines, "session_end", &id);
    assert_eq!(ends.len(), 1, "{lines:#?}");
    assert_eq!(ends[0]["reason"], "shutdown");
}

/// A resume is a new sandbox under the limits and under today's policy: past
/// `sessions.max_per_tenant` it is 429 and the session stays paused; after a restart whose
/// configuration no longer lets the session's grant run its language it is 403, audited.
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_is_decided_again_and_counted_against_the_limits() {
    let one = "[sessions]\nmax_per_tenant = 1\n";
    let d = Daemon::start_with(opts(Backend::Local, one));
    let c = koder(&d, None);
    let r = c
        .create(json!({"language": "python", "capability_token": d.cap(&["PythonExecute"])}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    assert_eq!(c.call("POST", &path(&id, "/pause"), None).await.status, 200);
    // A paused session holds no sandbox: another may be made in its place.
    let other = new_session(&c, "python").await;
    let full = c.call("POST", &path(&id, "/resume"), None).await;
    assert_eq!(full.status, 429, "{}", full.text);
    assert_eq!(
        c.call("GET", &path(&id, ""), None).await.json["state"],
        "paused"
    );
    assert_eq!(c.call("DELETE", &path(&other, ""), None).await.status, 204);

    let stricter = format!("{one}[sessions.languages.python]\ncapability = \"ShellExecute\"\n");
    let d = d.restart(opts(Backend::Local, &stricter));
    let c = koder(&d, None);
    let refused = c.call("POST", &path(&id, "/resume"), None).await;
    assert_eq!(refused.status, 403, "{}", refused.text);
    assert_eq!(refused.json["error_type"], "CapabilityViolation");
    assert!(
        d.audit_lines()
            .iter()
            .any(|l| l["event"] == "refusal" && l["status"] == 403),
        "the refusal is audited"
    );
    assert_eq!(
        c.call("GET", &path(&id, ""), None).await.json["state"],
        "paused"
    );
}

/// A saved workspace changed on disk is not restored: the resume is 500 naming the digest
/// mismatch, the session stays paused, and nothing of the tar reached a sandbox.
#[tokio::test(flavor = "multi_thread")]
async fn a_saved_workspace_changed_on_disk_is_not_restored() {
    let d = Daemon::start_with(opts(Backend::Local, ""));
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    run(&c, &id, "open('a.txt','w').write('original')").await;
    assert_eq!(c.call("POST", &path(&id, "/pause"), None).await.status, 200);
    let dir = d.dir.path().join("state").join("sessions").join(&id);
    let tar = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "tar"))
        .expect("the saved tar");
    let bytes = std::fs::read(&tar).unwrap();
    let at = bytes
        .windows(8)
        .position(|w| w == b"original")
        .expect("the file's bytes in the tar");
    let mut changed = bytes.clone();
    changed[at..at + 8].copy_from_slice(b"tampered");
    std::fs::write(&tar, &changed).unwrap();

    let r = c.call("POST", &path(&id, "/resume"), None).await;
    assert_eq!(r.status, 500, "{}", r.text);
    // The answer says no more than an internal error does; the daemon's log says which.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match d.log.recv_timeout(Duration::from_millis(200)) {
            Ok(line) if line.contains("does not match its record") => break,
            Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("the daemon's log ended: {e}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the log did not name the digest mismatch"
        );
    }
    assert_eq!(
        c.call("GET", &path(&id, ""), None).await.json["state"],
        "paused"
    );
    let exec = c
        .exec(&id, json!({"code": "print(open('a.txt').read())"}))
        .await;
    assert_eq!(exec.status, 500, "{}", exec.text);
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(&id),
        "no workspace of the session is left mounted"
    );
}

/// A workspace whose files are hard links of one another fits its quota once; its saved tar
/// holds each link's data again. A pause that the resume cannot restore strands the session:
/// every call then fails, for as long as it stays paused. Such a workspace is either saved so
/// that it fits again, or its pause is refused while the session still runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_workspace_of_hard_links_can_be_resumed() {
    let d = Daemon::start_with(opts(Backend::Local, ""));
    let c = koder(&d, None);
    let r = c
        .create(json!({"language": "python", "limits": {"disk_mb": 16}, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    // 10 MiB once on disk, linked under a second name (as `cp -al`, git or a package cache do).
    let wrote = c
        .exec(
            &id,
            json!({"code": "import os\nopen('a.bin','wb').write(os.urandom(10 << 20))\nos.link('a.bin','b.bin')\nprint('ok')",
                   "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(wrote.status, 200, "{}", wrote.text);
    assert_eq!(wrote.json["stdout"], "ok\n", "{}", wrote.text);

    let paused = c.call("POST", &path(&id, "/pause"), None).await;
    if paused.status == 200 {
        let resumed = c.call("POST", &path(&id, "/resume"), None).await;
        assert_eq!(
            resumed.status, 200,
            "a session the daemon paused must come back: {}",
            resumed.text
        );
        let back = c
            .exec(
                &id,
                json!({"code": "import os\nprint(os.path.getsize('a.bin'), os.path.getsize('b.bin'))", "timeout_ms": 60000}),
            )
            .await;
        assert_eq!(back.status, 200, "{}", back.text);
        assert_eq!(back.json["stdout"], "10485760 10485760\n", "{}", back.text);
    } else {
        // Refused as a store without room: the session runs on with its workspace.
        assert_eq!(paused.status, 507, "{}", paused.text);
        assert_eq!(paused.json["error_type"], "StoreFull", "{}", paused.text);
        let still = c.call("GET", &path(&id, ""), None).await;
        assert_eq!(still.json["state"], "running", "{}", still.text);
    }
    assert_eq!(c.call("DELETE", &path(&id, ""), None).await.status, 204);
}

/// `sessions.max_paused_per_tenant` bounds what one tenant keeps in the store: a pause past it
/// is 429 and that session runs on; another tenant is not counted with it.
#[tokio::test(flavor = "multi_thread")]
async fn paused_sessions_per_tenant_are_bounded() {
    let d = Daemon::start_with(opts(
        Backend::Local,
        "[sessions]\nmax_paused_per_tenant = 1\n",
    ));
    let c = koder(&d, Some("t1"));
    let first = new_session(&c, "python").await;
    let second = new_session(&c, "python").await;
    assert_eq!(
        c.call("POST", &path(&first, "/pause"), None).await.status,
        200
    );
    let refused = c.call("POST", &path(&second, "/pause"), None).await;
    assert_eq!(refused.status, 429, "{}", refused.text);
    assert_eq!(refused.json["error_type"], "Overloaded", "{}", refused.text);
    let still = c.call("GET", &path(&second, ""), None).await;
    assert_eq!(still.json["state"], "running", "{}", still.text);
    let other = koder(&d, Some("t2"));
    let theirs = new_session(&other, "python").await;
    assert_eq!(
        other
            .call("POST", &path(&theirs, "/pause"), None)
            .await
            .status,
        200
    );
}
