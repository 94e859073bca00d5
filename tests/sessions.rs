//! Sessions (`/v1/sandbox/sessions`) on the local backend, through a real daemon: the calls a
//! workflow engine's code step makes, the workspace that persists between execs, files, tenancy,
//! limits and lifetimes.

mod common;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use common::sessions::{SandboxClient, koder, new_session};
use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use serde_json::{Value, json};

/// What a session's exec sees of its sandbox's pid 1 names nothing of the daemon: not its binary,
/// not its command line (`serve --listen <address>`), not its listen address, not its exe link.
/// pid 1 shares the daemon's memory (and with it the daemon's argv), so it is not visible to the
/// command at all; every process the command can see is its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_sees_nothing_of_the_daemons_command_line_in_its_pid_1() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let code = r#"
import os
def get(f):
    try:
        return repr(f())
    except OSError as e:
        return "ERR " + os.strerror(e.errno)
for p in ["1"] + sorted(p for p in os.listdir("/proc") if p.isdigit()):
    print(p, "cmdline", get(lambda: open(f"/proc/{p}/cmdline", "rb").read()))
    print(p, "comm", get(lambda: open(f"/proc/{p}/comm").read()))
    print(p, "status", get(lambda: open(f"/proc/{p}/status").read().splitlines()[0]))
    print(p, "exe", get(lambda: os.readlink(f"/proc/{p}/exe")))
"#;
    let r = c
        .exec(&id, json!({"code": code, "timeout_ms": 20000}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let out = r.json["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("cmdline"), "{}", r.text);
    let daemon = common::bin();
    let name = std::path::Path::new(daemon)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    for needle in [daemon, name.as_str(), d.addr.as_str(), "--listen", "serve"] {
        assert!(!out.contains(needle), "the sandbox sees {needle:?}:\n{out}");
    }
    // Whatever the command can see of pid 1, it is not readable as the daemon's.
    for line in out.lines().filter(|l| l.starts_with("1 ")) {
        assert!(
            line.contains("ERR ") || line.contains("init"),
            "pid 1 as the sandbox sees it: {line}"
        );
    }
}

/// The mount table a session's exec reads names no directory of the daemon: its code file is
/// bound from a file system of the session's own, so the host path of `sessions.dir` (and the
/// daemon's directory around it) never shows as a bind's source root.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_sees_nothing_of_the_daemons_directories_in_its_mount_table() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let code = r#"
for f in ["/proc/self/mountinfo", "/proc/self/mounts", "/proc/1/mountinfo"]:
    try:
        print(f, open(f).read())
    except OSError as e:
        print(f, "ERR", e.strerror)
"#;
    let r = c
        .exec(&id, json!({"code": code, "timeout_ms": 20000}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let out = r.json["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("/run/session/main.py"), "{}", r.text);
    let sessions = d.dir.path().join("sessions");
    for needle in [
        d.dir.path().display().to_string(),
        sessions.display().to_string(),
        id.clone(),
    ] {
        assert!(
            !out.contains(&needle),
            "the sandbox sees {needle:?}:\n{out}"
        );
    }
}

/// The seed's two calls: create a python session, run code, read every ExecResponse field, and
/// reuse the session for a second exec that reads what the first wrote. Then bash does the same.
#[tokio::test(flavor = "multi_thread")]
async fn a_code_step_runs_and_reuses_its_session_in_python_and_bash() {
    let d = Daemon::start();
    let caps = d.get("/capabilities").await;
    let languages: Vec<&str> = caps.json["session_languages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert!(
        languages.contains(&"python") && languages.contains(&"bash"),
        "{languages:?}"
    );
    let c = koder(&d, Some("user-1"));
    for (language, write, read) in [
        (
            "python",
            "open('note.txt','w').write('kept')\nprint('wrote')",
            "print(open('note.txt').read())",
        ),
        ("bash", "echo kept > note.txt; echo wrote", "cat note.txt"),
    ] {
        let id = new_session(&c, language).await;
        let first = c
            .exec(&id, json!({"code": write, "timeout_ms": 20000}))
            .await;
        assert_eq!(first.status, 200, "{}", first.text);
        for field in [
            "exec_id",
            "exit_code",
            "stdout",
            "stderr",
            "stdout_truncated",
            "stderr_truncated",
            "duration_ms",
            "peak_memory_kib",
            "oom",
            "killed_reason",
            "outcome",
            "provenance",
        ] {
            assert!(
                first.json.get(field).is_some(),
                "{field} missing: {}",
                first.text
            );
        }
        assert_eq!(first.json["exit_code"], 0, "{}", first.text);
        assert_eq!(first.json["stdout"], "wrote\n");
        let p = &first.json["provenance"];
        assert_eq!(p["session_id"], id.as_str());
        assert!(p["code_sha256"].as_str().unwrap().starts_with("sha256:"));
        assert!(p["audit_seq"].is_u64());
        let second = c.exec(&id, json!({"code": read})).await;
        assert_eq!(second.status, 200, "{}", second.text);
        assert_eq!(second.json["stdout"].as_str().unwrap().trim(), "kept");
        // Processes do not outlive their exec: a background child is gone with it.
        let (bg, needle) = if language == "python" {
            (
                "import subprocess\nsubprocess.Popen(['sleep','31.25'])\nprint('started')",
                "sleep 31.25",
            )
        } else {
            ("sleep 32.25 & echo started", "sleep 32.25")
        };
        let r = c.exec(&id, json!({"code": bg})).await;
        assert_eq!(r.json["stdout"], "started\n", "{}", r.text);
        assert!(
            common::pids_with_cmdline(needle).is_empty(),
            "a process outlived its exec"
        );
        let gone = c
            .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
            .await;
        assert_eq!(gone.status, 204, "{}", gone.text);
        let again = c.exec(&id, json!({"code": read})).await;
        assert_eq!(again.status, 404, "{}", again.text);
    }
    assert_eq!(
        std::fs::read_dir(d.dir.path().join("sessions"))
            .unwrap()
            .count(),
        0,
        "deleted sessions leave nothing"
    );
}

/// `cwd` is a directory of the workspace; anything outside it is 400.
#[tokio::test(flavor = "multi_thread")]
async fn cwd_stays_inside_the_workspace() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "bash").await;
    let r = c.exec(&id, json!({"code": "mkdir -p sub/dir"})).await;
    assert_eq!(r.json["exit_code"], 0, "{}", r.text);
    for cwd in ["sub/dir", "/workspace/sub/dir"] {
        let r = c.exec(&id, json!({"code": "pwd", "cwd": cwd})).await;
        assert_eq!(r.json["stdout"], "/workspace/sub/dir\n", "{}", r.text);
    }
    for bad in [
        "..",
        "../etc",
        "/etc",
        "/workspace/../etc",
        "sub/../../x",
        "missing",
    ] {
        let r = c.exec(&id, json!({"code": "pwd", "cwd": bad})).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text);
        assert_eq!(r.json["retryable"], false);
    }
    // A symlink the sandbox planted is no way out either.
    let r = c.exec(&id, json!({"code": "ln -s / root"})).await;
    assert_eq!(r.json["exit_code"], 0, "{}", r.text);
    let r = c.exec(&id, json!({"code": "pwd", "cwd": "root"})).await;
    assert_eq!(r.status, 400, "{}", r.text);
}

/// Files: upload then read inside; write inside then download byte for byte; 1 MiB of binary
/// round trip; traversal and planted symlinks fail.
#[tokio::test(flavor = "multi_thread")]
async fn files_go_in_and_out_and_never_outside() {
    let d = Daemon::start();
    let c = koder(&d, Some("t"));
    let id = new_session(&c, "python").await;
    let base = format!("/v1/sandbox/sessions/{id}/files");
    let put = c
        .call(
            "PUT",
            &format!("{base}/in/data.txt"),
            Some(b"uploaded".to_vec()),
        )
        .await;
    assert_eq!(put.status, 204, "{}", put.text);
    let line = d
        .audit_lines()
        .into_iter()
        .find(|l| l["event"] == "session_file")
        .expect("the upload's audit line");
    assert_eq!(line["path"], "in/data.txt");
    assert_eq!(line["bytes"], 8);
    assert_eq!(line["session_id"], id.as_str());
    let r = c
        .exec(&id, json!({"code": "print(open('in/data.txt').read())\nopen('out.bin','wb').write(bytes(range(256))*4096)"}))
        .await;
    assert_eq!(r.json["stdout"], "uploaded\n", "{}", r.text);
    let got = d
        .client
        .get(format!("{}{base}/out.bin", d.base))
        .header("authorization", format!("Bearer {}", c.service))
        .header("x-koder-tenant", "t")
        .send()
        .await
        .unwrap();
    assert_eq!(got.status().as_u16(), 200);
    let bytes = got.bytes().await.unwrap();
    assert_eq!(bytes.len(), 1 << 20);
    assert!(bytes.iter().enumerate().all(|(i, b)| *b == (i % 256) as u8));
    // 1 MiB of binary up and back.
    let blob: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    let put = c
        .call("PUT", &format!("{base}/blob"), Some(blob.clone()))
        .await;
    assert_eq!(put.status, 204, "{}", put.text);
    let back = d
        .client
        .get(format!("{}{base}/blob", d.base))
        .header("authorization", format!("Bearer {}", c.service))
        .header("x-koder-tenant", "t")
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(back[..] == blob[..], "the blob came back changed");
    let list = c.call("GET", &base, None).await;
    let names: Vec<&str> = list.json["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["blob", "in", "out.bin"], "{}", list.text);
    // Traversal, in every spelling.
    for bad in [
        "..%2f..%2fetc%2fpasswd",
        "%2e%2e/x",
        "a/../../x",
        "%2fetc%2fpasswd",
    ] {
        let r = c.call("GET", &format!("{base}/{bad}"), None).await;
        assert!(
            matches!(r.status, 400 | 404),
            "{bad}: {} {}",
            r.status,
            r.text
        );
        assert_ne!(r.status, 200);
    }
    // A symlink the sandbox planted is never followed by the daemon, reading or writing.
    let r = c
        .exec(&id, json!({"code": "import os\nos.symlink('/etc/shadow','shadow')\nos.symlink('/etc','etc')"}))
        .await;
    assert_eq!(r.json["exit_code"], 0, "{}", r.text);
    for path in ["shadow", "etc/shadow", "etc/passwd"] {
        let r = c.call("GET", &format!("{base}/{path}"), None).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text);
        assert!(!r.text.contains("root:"), "{}", r.text);
    }
    let r = c
        .call("PUT", &format!("{base}/etc/evil"), Some(b"x".to_vec()))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(!std::path::Path::new("/etc/evil").exists());
    let r = c
        .call("PUT", &format!("{base}/shadow"), Some(b"x".to_vec()))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
}

/// Filling the workspace is ENOSPC inside; the session stays usable; the host is untouched.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_workspace_is_enospc_inside_and_the_session_goes_on() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let r = c
        .create(
            json!({"language": "bash", "limits": {"disk_mb": 8}, "capability_token": d.cap_all()}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let r = c
        .exec(
            &id,
            json!({"code": "head -c 20000000 /dev/zero > big; echo rc=$?"}),
        )
        .await;
    assert!(
        r.json["stderr"].as_str().unwrap().contains("No space left"),
        "{}",
        r.text
    );
    assert_eq!(r.json["stdout"], "rc=1\n", "{}", r.text);
    let r = c
        .exec(&id, json!({"code": "rm big; echo ok > small; cat small"}))
        .await;
    assert_eq!(r.json["stdout"], "ok\n", "{}", r.text);
    // An upload past the quota is refused as such, and the file it was to replace is intact.
    let path = format!("/v1/sandbox/sessions/{id}/files/up");
    let r = c.call("PUT", &path, Some(b"old".to_vec())).await;
    assert_eq!(r.status, 204, "{}", r.text);
    let big = vec![0u8; 9 << 20];
    let r = c.call("PUT", &path, Some(big)).await;
    assert_eq!(r.status, 507, "{}", r.text);
    let r = c.call("GET", &path, None).await;
    assert_eq!(r.text, "old");
    let list = c
        .call("GET", &format!("/v1/sandbox/sessions/{id}/files"), None)
        .await;
    assert_eq!(
        list.json["entries"].as_array().unwrap().len(),
        2,
        "{}",
        list.text
    );
}

/// Another tenant or another service gets 404 on everything; no tenant is a tenant of its own.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_are_invisible_to_other_tenants_and_services() {
    let d = Daemon::start();
    let owner = koder(&d, Some("alice"));
    let id = new_session(&owner, "python").await;
    let other_service = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 300,
        aud: "executor-arm".into(),
        sub: Some("another-service".into()),
        ..Default::default()
    });
    let strangers = [
        koder(&d, Some("bob")),
        koder(&d, None),
        SandboxClient {
            d: &d,
            service: other_service,
            tenant: Some("alice"),
        },
    ];
    for s in &strangers {
        let base = format!("/v1/sandbox/sessions/{id}");
        let answers = [
            s.call("GET", &base, None).await,
            s.exec(&id, json!({"code": "print(1)"})).await,
            s.call("GET", &format!("{base}/files"), None).await,
            s.call("PUT", &format!("{base}/files/x"), Some(b"x".to_vec()))
                .await,
            s.call("GET", &format!("{base}/files/x"), None).await,
            s.call("DELETE", &base, None).await,
        ];
        for r in answers {
            assert_eq!(r.status, 404, "{}", r.text);
            assert_eq!(r.json["error_type"], "NotFound");
        }
    }
    let r = owner.exec(&id, json!({"code": "print(1)"})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    // A session's exec is a run of (service, tenant): the tenant-less run routes do not find it,
    // even for the same service.
    let exec_id = r.json["exec_id"].as_str().unwrap();
    for path in [
        format!("/v1/executions/{exec_id}"),
        format!("/v1/executions/{exec_id}/stream"),
    ] {
        let r = owner.call("GET", &path, None).await;
        assert_eq!(r.status, 404, "{path}: {}", r.text);
    }
    let r = owner
        .call(
            "POST",
            &format!("/v1/executions/{exec_id}/cancel"),
            Some(vec![]),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    // Under its session, a single-use service token is used once per call, not twice.
    d.wait_until_tokens_postdate_start();
    let once = SandboxClient {
        d: &d,
        service: d.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 300,
            aud: "executor-arm".into(),
            sub: Some("orchestrator".into()),
            single_use: true,
            ..Default::default()
        }),
        tenant: Some("alice"),
    };
    let r = once
        .call(
            "GET",
            &format!("/v1/sandbox/sessions/{id}/execs/{exec_id}"),
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["status"], "finished", "{}", r.text);
}

/// One exec at a time: a second while one runs is 409 SessionBusy. An async exec is read,
/// streamed and cancelled under the session's routes; delete during an exec kills it.
#[tokio::test(flavor = "multi_thread")]
async fn async_execs_are_polled_streamed_and_cancelled_one_at_a_time() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let r = c
        .exec(&id, json!({"code": "import time\nprint('tick', flush=True)\ntime.sleep(30)", "async": true}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    let busy = c.exec(&id, json!({"code": "print(1)"})).await;
    assert_eq!(busy.status, 409, "{}", busy.text);
    assert_eq!(busy.json["error_type"], "SessionBusy");
    let base = format!("/v1/sandbox/sessions/{id}/execs/{exec_id}");
    // The 202's links are the session's exec routes, and they answer.
    assert_eq!(r.json["links"]["self"], base.as_str(), "{}", r.text);
    assert_eq!(
        r.json["links"]["stream"],
        format!("{base}/stream"),
        "{}",
        r.text
    );
    assert_eq!(
        r.json["links"]["cancel"],
        format!("{base}/cancel"),
        "{}",
        r.text
    );
    let r = c
        .call("GET", r.json["links"]["self"].as_str().unwrap(), None)
        .await;
    assert_eq!(r.json["status"], "running", "{}", r.text);
    // Under another session of the same caller, the exec is not found.
    let other = new_session(&c, "python").await;
    let r = c
        .call(
            "GET",
            &format!("/v1/sandbox/sessions/{other}/execs/{exec_id}"),
            None,
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    // Followed until it printed, cancelled, followed to its result.
    let mut stream = d
        .client
        .get(format!("{}{base}/stream", d.base))
        .header("authorization", format!("Bearer {}", c.service))
        .send()
        .await
        .unwrap();
    let mut text = String::new();
    while !text.contains("tick") {
        let chunk = stream
            .chunk()
            .await
            .unwrap()
            .expect("the stream ended early");
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let cancel = c
        .call(
            "POST",
            &format!("{base}/cancel"),
            Some(b"{\"grace_seconds\":0}".to_vec()),
        )
        .await;
    assert_eq!(cancel.status, 202, "{}", cancel.text);
    while let Some(chunk) = stream.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(text.contains("event: result"), "{text}");
    let r = c.call("GET", &base, None).await;
    assert_eq!(r.json["result"]["outcome"], "cancelled", "{}", r.text);
    // Free again; then a delete in the middle of an exec kills it and removes everything.
    let r = c
        .exec(
            &id,
            json!({"code": "import time\ntime.sleep(3600)", "async": true}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let killed = r.json["exec_id"].as_str().unwrap().to_string();
    let started = Instant::now();
    let gone = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert_eq!(gone.status, 204, "{}", gone.text);
    // A bound, not a timing check: the DELETE killed the hour-long exec instead of waiting.
    assert!(started.elapsed() < Duration::from_secs(600));
    let end = d
        .audit_lines()
        .into_iter()
        .find(|l| l["event"] == "execution" && l["exec_id"] == killed.as_str())
        .expect("the killed exec's end line");
    assert_eq!(end["outcome"], "cancelled", "{end}");
    assert!(!d.dir.path().join("sessions").join(&id).exists());
}

/// Idle sessions end after their idle time, everything removed; limits are per tenant.
#[tokio::test(flavor = "multi_thread")]
async fn idle_sessions_expire_and_limits_hold() {
    let d = Daemon::start_with(Opts {
        config: Some("[sessions]\nmax_per_tenant = 2\nmax_total = 3\n".into()),
        ..Opts::default()
    });
    let c = koder(&d, Some("a"));
    let r = c
        .create(json!({"language": "python", "idle_timeout_seconds": 1, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let idle = r.json["id"].as_str().unwrap().to_string();
    let _second = new_session(&c, "python").await;
    let third = c
        .create(json!({"language": "python", "capability_token": d.cap_all()}))
        .await;
    assert_eq!(third.status, 429, "{}", third.text);
    assert!(third.headers.get("retry-after").is_some());
    common::wait::wait_for_async(
        "the idle session to expire (404)",
        common::wait::CLEANUP,
        || async {
            c.call("GET", &format!("/v1/sandbox/sessions/{idle}"), None)
                .await
                .status
        },
        |status| *status == 404,
    )
    .await;
    // Its end line follows the removal of its workspace.
    d.wait_for_audit_line("session_end", |l| l["event"] == "session_end");
    let ends: Vec<Value> = d
        .audit_lines()
        .into_iter()
        .filter(|l| l["event"] == "session_end")
        .collect();
    assert_eq!(ends.len(), 1, "{ends:#?}");
    assert_eq!(ends[0]["reason"], "idle");
    assert!(!d.dir.path().join("sessions").join(&idle).exists());
    // A place came free.
    new_session(&c, "python").await;
}

/// Without a capability token creation is 401, unless the operator accepts the service
/// token's own capabilities.
#[tokio::test(flavor = "multi_thread")]
async fn a_service_token_alone_is_a_grant_only_when_the_operator_says_so() {
    let service_with_caps = |d: &Daemon| {
        d.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 300,
            aud: "executor-arm".into(),
            sub: Some("koder-runner".into()),
            capabilities: vec!["PythonExecute".into()],
            ..Default::default()
        })
    };
    let off = Daemon::start();
    let c = SandboxClient {
        d: &off,
        service: service_with_caps(&off),
        tenant: Some("u"),
    };
    let r = c.create(json!({"language": "python"})).await;
    assert_eq!(r.status, 401, "{}", r.text);
    let on = Daemon::start_with(Opts {
        config: Some("[sessions]\naccept_service_capabilities = true\n".into()),
        ..Opts::default()
    });
    let c = SandboxClient {
        d: &on,
        service: service_with_caps(&on),
        tenant: Some("u"),
    };
    let r = c.create(json!({"language": "python"})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap();
    let r = c.exec(id, json!({"code": "print(6*7)"})).await;
    assert_eq!(r.json["stdout"], "42\n", "{}", r.text);
    // The grant holds: bash needs ShellExecute, which this service does not have.
    let r = c.create(json!({"language": "bash"})).await;
    assert_eq!(r.status, 403, "{}", r.text);
}

/// A fork bomb, a memory bomb and an output flood are contained and the session survives.
#[tokio::test(flavor = "multi_thread")]
async fn bombs_inside_a_session_are_contained_and_it_survives() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let fork = c
        .exec(&id, json!({"code": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout_ms": 3000}))
        .await;
    assert_eq!(fork.status, 200, "{}", fork.text);
    assert_ne!(fork.json["outcome"], "success");
    let mem = c
        .exec(
            &id,
            json!({"code": "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"}),
        )
        .await;
    assert_eq!(mem.json["oom"], true, "{}", mem.text);
    let flood = c
        .exec(
            &id,
            json!({"code": "import os\nfor _ in range(100):\n    os.write(1, b'x' * 65536)"}),
        )
        .await;
    assert_eq!(flood.json["stdout_truncated"], true, "{}", flood.text);
    let ok = c.exec(&id, json!({"code": "print('alive')"})).await;
    assert_eq!(ok.json["stdout"], "alive\n", "{}", ok.text);
    // A deadline ends a run with 200 and says so.
    let slow = c
        .exec(
            &id,
            json!({"code": "import time\ntime.sleep(10)", "timeout_ms": 500}),
        )
        .await;
    assert_eq!(slow.status, 200, "{}", slow.text);
    assert_eq!(slow.json["killed_reason"], "timeout", "{}", slow.text);
    assert!(
        slow.json["duration_ms"].as_u64().unwrap() < 3000,
        "{}",
        slow.text
    );
}

/// A daemon killed with SIGKILL leaves its sessions' directories and mounts; the next start
/// removes them.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_after_sigkill_removes_the_old_sessions() {
    let mut d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let mounted = |id: &str| {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(id)
    };
    assert!(mounted(&id));
    d.kill9();
    assert!(d.dir.path().join("sessions").join(&id).exists());
    let d = d.restart(Opts::default());
    assert!(!d.dir.path().join("sessions").join(&id).exists());
    assert!(!mounted(&id), "the workspace is still mounted");
}

/// A session ends at its TTL even while used, its running exec killed; an Idempotency-Key on an
/// exec replays the stored answer instead of running again.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_ends_at_its_ttl_and_exec_keys_replay() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let r = c
        .create(json!({"language": "bash", "ttl_seconds": 3, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let keyed = |body: Value| {
        d.client
            .post(format!("{}/v1/sandbox/sessions/{id}/exec", d.base))
            .header("authorization", format!("Bearer {}", c.service))
            .header("idempotency-key", "step-7")
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let code = json!({"code": "echo run >> runs.txt; wc -l < runs.txt"});
    let first = Daemon::read(keyed(code.clone()).await.unwrap()).await;
    assert_eq!(first.json["stdout"], "1\n", "{}", first.text);
    let again = Daemon::read(keyed(code.clone()).await.unwrap()).await;
    assert_eq!(
        again.json["exec_id"], first.json["exec_id"],
        "{}",
        again.text
    );
    assert!(again.headers.get("idempotent-replayed").is_some());
    let other = Daemon::read(keyed(json!({"code": "true"})).await.unwrap()).await;
    assert_eq!(other.status, 422, "{}", other.text);
    // Used all along, it still ends at its TTL; the exec running then is killed.
    let r = c
        .exec(&id, json!({"code": "sleep 30", "timeout_ms": 60000}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "cancelled", "{}", r.text);
    let gone = c
        .call("GET", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert_eq!(gone.status, 404);
    // The session's end line follows its exec's answer (the workspace is removed in between).
    let end = d.wait_for_audit_line("session_end", |l| l["event"] == "session_end");
    assert_eq!(end["reason"], "expired", "{end}");
    assert!(!d.dir.path().join("sessions").join(&id).exists());
}

/// A DELETE whose client goes away while the session's end is under way still ends it whole:
/// its workspace unmounted and removed, its end line written. (The end waits for an exec still
/// queued for a run slot: the only slot is held by another run.)
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_whose_client_leaves_midway_still_removes_everything() {
    use tokio::io::AsyncWriteExt;
    let d = Daemon::start_with(Opts {
        config: Some("[server.concurrency]\nlocal = 1\n".into()),
        ..Opts::default()
    });
    let blocker = d
        .exec(json!({"action_type": "python", "command": "python3",
            "args": ["-c", "import time\ntime.sleep(60)"], "async": true}))
        .await;
    assert_eq!(blocker.status, 202, "{}", blocker.text);
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    // Queued behind the blocker: the session is busy starting it.
    let queued = {
        let path = format!("{}/v1/sandbox/sessions/{id}/exec", d.base);
        let client = d.client.clone();
        let auth = format!("Bearer {}", c.service);
        tokio::spawn(async move {
            client
                .post(path)
                .header("authorization", auth)
                .header("content-type", "application/json")
                .body(json!({"code": "print(1)", "async": true}).to_string())
                .send()
                .await
        })
    };
    d.wait_for_metric("executor_queue_waiting{backend=\"local\"} 1")
        .await;
    let mut s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
    let req = format!(
        "DELETE /v1/sandbox/sessions/{id} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
        c.service
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // The end is under way once the session is gone from the table (it then waits for the
    // queued exec): only then does the client leave.
    common::wait::wait_for_async(
        "the DELETE to take the session out of the table",
        common::wait::CLEANUP,
        || async {
            c.call("GET", &format!("/v1/sandbox/sessions/{id}"), None)
                .await
                .status
        },
        |status| *status == 404,
    )
    .await;
    drop(s);
    d.wait_for_audit_line("the session's end line (its end was not cut short)", |l| {
        l["event"] == "session_end" && l["session_id"] == id.as_str()
    });
    assert!(!d.dir.path().join("sessions").join(&id).exists());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&id), "the workspace is still mounted");
    queued.abort();
}

/// A single-use capability token is used up only by a session that is made: one refused (429
/// at the tenant's limit) stays usable.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_creation_leaves_a_single_use_token_unused() {
    let d = Daemon::start_with(Opts {
        config: Some("[sessions]\nmax_per_tenant = 1\n".into()),
        ..Opts::default()
    });
    d.wait_until_tokens_postdate_start();
    let c = koder(&d, Some("t"));
    let first = new_session(&c, "python").await;
    let once = d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 120,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["PythonExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let body = json!({"language": "python", "capability_token": once});
    let refused = c.create(body.clone()).await;
    assert_eq!(refused.status, 429, "{}", refused.text);
    assert!(
        refused.json["error"]
            .as_str()
            .unwrap()
            .starts_with("Too many sessions"),
        "{}",
        refused.text
    );
    let gone = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{first}"), None)
        .await;
    assert_eq!(gone.status, 204);
    let made = c.create(body.clone()).await;
    assert_eq!(made.status, 201, "{}", made.text);
    let made = made.json["id"].as_str().unwrap().to_string();
    c.call("DELETE", &format!("/v1/sandbox/sessions/{made}"), None)
        .await;
    let replayed = c.create(body).await;
    assert_eq!(replayed.status, 401, "{}", replayed.text);
}

/// A sessions directory belongs to one daemon: a second one started on it neither reaps the
/// first one's sessions nor makes any (503); a directory reached through a symlink, or writable
/// by others, is refused too.
#[tokio::test(flavor = "multi_thread")]
async fn a_sessions_directory_is_one_daemons_alone() {
    let first = Daemon::start();
    let c = koder(&first, None);
    let id = new_session(&c, "python").await;
    let shared = first.dir.path().join("sessions");
    let second = Daemon::start_with(Opts {
        env: vec![(
            "EXECUTOR_ARM_SESSIONS_DIR".into(),
            shared.to_string_lossy().into_owned(),
        )],
        ..Opts::default()
    });
    let r = koder(&second, None)
        .create(json!({"language": "python", "capability_token": second.cap_all()}))
        .await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert!(r.text.contains("in use by another"), "{}", r.text);
    let r = c.exec(&id, json!({"code": "print('still here')"})).await;
    assert_eq!(r.json["stdout"], "still here\n", "{}", r.text);
    // Through a symlink, or open to others: refused.
    let scratch = tempfile::tempdir().unwrap();
    let link = scratch.path().join("link");
    std::os::unix::fs::symlink(scratch.path(), &link).unwrap();
    let open = scratch.path().join("open");
    std::fs::create_dir(&open).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    for dir in [link, open] {
        let d = Daemon::start_with(Opts {
            env: vec![(
                "EXECUTOR_ARM_SESSIONS_DIR".into(),
                dir.to_string_lossy().into_owned(),
            )],
            ..Opts::default()
        });
        let r = koder(&d, None)
            .create(json!({"language": "python", "capability_token": d.cap_all()}))
            .await;
        assert_eq!(r.status, 503, "{}: {}", dir.display(), r.text);
    }
}

/// File transfers hold a file's bytes in memory: at most eight at once on a daemon, the ninth
/// is 429 (here eight uploads whose bodies never come hold the places).
#[tokio::test(flavor = "multi_thread")]
async fn file_transfers_at_once_are_bounded() {
    use tokio::io::AsyncWriteExt;
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    // An upload whose body never comes: it holds a place from when the daemon reads its headers
    // (in its own time) until its body deadline.
    let hold = |name: String| {
        let (addr, service, id) = (d.addr.clone(), c.service.clone(), id.clone());
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let req = format!(
                "PUT /v1/sandbox/sessions/{id}/files/{name} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {service}\r\nContent-Length: 100\r\n\r\n"
            );
            s.write_all(req.as_bytes()).await.unwrap();
            s
        }
    };
    let mut held = Vec::new();
    for i in 0..8 {
        held.push(hold(format!("f{i}")).await);
    }
    // A probe that comes before the daemon read all eight takes a place itself, and the upload
    // read meanwhile is refused: such an upload is replaced, so that eight are in progress
    // whenever a probe is answered 204.
    let held = tokio::sync::Mutex::new(held);
    let replaced = std::sync::atomic::AtomicUsize::new(0);
    let r = common::wait::wait_for_async(
        "a ninth upload refused while eight hold the places",
        common::wait::CLEANUP,
        || async {
            let r = c
                .call(
                    "PUT",
                    &format!("/v1/sandbox/sessions/{id}/files/x"),
                    Some(b"x".to_vec()),
                )
                .await;
            let mut held = held.lock().await;
            for s in held.iter_mut() {
                let mut buf = [0u8; 512];
                if !matches!(s.try_read(&mut buf), Err(e) if e.kind() == ErrorKind::WouldBlock) {
                    let n = replaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    *s = hold(format!("r{n}")).await;
                }
            }
            (r.status, r.text, r.headers)
        },
        |(status, _, _)| *status == 429,
    )
    .await;
    assert!(r.2.get("retry-after").is_some());
    // Reads take the same places.
    for path in [
        format!("/v1/sandbox/sessions/{id}/files"),
        format!("/v1/sandbox/sessions/{id}/files/f0"),
    ] {
        let r = c.call("GET", &path, None).await;
        assert_eq!(r.status, 429, "GET {path}: {}", r.text);
        assert_eq!(r.json["error_type"], "Overloaded", "GET {path}");
    }
    // Archives too, both ways.
    let r = common::archives::get_archive(&c, &id, "").await;
    assert_eq!(r.status, 429, "GET archive: {}", r.text);
    let tar = common::archives::tar_of(&[common::archives::file("a", b"a")]);
    let r = common::archives::put_archive(&c, &id, "", tar).await;
    assert_eq!(r.status, 429, "PUT archive: {}", r.text);
    drop(held);
    common::wait::wait_for_async(
        "the places given back (an upload answered 204)",
        common::wait::CLEANUP,
        || async {
            let r = c
                .call(
                    "PUT",
                    &format!("/v1/sandbox/sessions/{id}/files/x"),
                    Some(b"x".to_vec()),
                )
                .await;
            (r.status, r.text)
        },
        |(status, _)| *status == 204,
    )
    .await;
}

/// Any config key can come from the environment (`EXECUTOR_ARM__<SECTION>__<KEY>`), and a name
/// that is no key keeps the daemon from starting, as an unknown key in the file does.
#[tokio::test(flavor = "multi_thread")]
async fn every_config_key_has_an_environment_override() {
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM__SESSIONS__MAX_TOTAL".into(), "1".into())],
        ..Default::default()
    });
    let c = koder(&d, None);
    new_session(&c, "bash").await;
    let second = c
        .create(json!({"language": "bash", "capability_token": d.cap_all()}))
        .await;
    assert_eq!(second.status, 429, "{}", second.text);
    assert!(
        second.text.contains("sessions.max_total"),
        "{}",
        second.text
    );

    let out = common::run_until_exit(&[("EXECUTOR_ARM__SESSIONS__MAX_TOTL", "1")]);
    assert!(!out.status.success(), "started with an unknown key");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_totl"), "{err}");
}

/// Koder's step timeout: `timeout_ms: 0` is the service default, and a synchronous exec may ask
/// for more than 300 s (a step runs synchronously with its own TimeoutSec): the profile's async
/// maximum clamps it, as for an async exec.
#[tokio::test(flavor = "multi_thread")]
async fn a_sync_exec_takes_zero_as_the_default_and_a_step_timeout_past_300_s() {
    let d = Daemon::start();
    let c = koder(&d, Some("t1"));
    let id = new_session(&c, "python").await;
    let timeout_of = |exec_id: &str| {
        d.audit_lines()
            .into_iter()
            .find(|l| l["event"] == "execution_start" && l["exec_id"] == exec_id)
            .map(|l| l["timeout_seconds"].clone())
    };
    let zero = c
        .exec(&id, json!({"code": "print('zero')", "timeout_ms": 0}))
        .await;
    assert_eq!(zero.status, 200, "{}", zero.text);
    assert_eq!(zero.json["stdout"], "zero\n");
    let none = c.exec(&id, json!({"code": "print('none')"})).await;
    assert_eq!(none.status, 200, "{}", none.text);
    let default = timeout_of(none.json["exec_id"].as_str().unwrap()).unwrap();
    assert_eq!(
        timeout_of(zero.json["exec_id"].as_str().unwrap()),
        Some(default)
    );
    let long = c
        .exec(
            &id,
            json!({"code": "print('long')", "timeout_ms": 1_800_000}),
        )
        .await;
    assert_eq!(long.status, 200, "{}", long.text);
    assert_eq!(long.json["stdout"], "long\n");
    assert_eq!(
        timeout_of(long.json["exec_id"].as_str().unwrap()),
        Some(json!(1800)),
        "the step's own timeout, within the profile's async maximum"
    );
    let over = c
        .exec(
            &id,
            json!({"code": "print(1)", "timeout_ms": 86_400_001u64}),
        )
        .await;
    assert_eq!(over.status, 400, "{}", over.text);
}

/// Every optional field of the session bodies (as the OpenAPI document lists them) may be
/// `null`, the same as leaving it out.
#[tokio::test(flavor = "multi_thread")]
async fn null_is_absent_for_every_optional_field_of_the_session_bodies() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let doc = d.get("/openapi.json").await.json;
    let optional = |name: &str| -> Vec<String> {
        let schema = &doc["components"]["schemas"][name];
        let required: Vec<&Value> = schema["required"]
            .as_array()
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        schema["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("{name}: {schema}"))
            .keys()
            .filter(|k| !required.contains(&&json!(k)))
            .cloned()
            .collect()
    };
    let create = optional("CreateBody");
    assert!(create.len() >= 5, "{create:?}");
    let base = json!({"language": "python", "capability_token": d.cap_all()});
    let mut all = base.clone();
    for field in create.iter().filter(|f| *f != "capability_token") {
        let mut one = base.clone();
        one[field.as_str()] = Value::Null;
        let r = c.create(one).await;
        assert_eq!(r.status, 201, "{field}: null: {}", r.text);
        c.call(
            "DELETE",
            &format!("/v1/sandbox/sessions/{}", r.json["id"].as_str().unwrap()),
            None,
        )
        .await;
        all[field.as_str()] = Value::Null;
    }
    let r = c.create(all).await;
    assert_eq!(r.status, 201, "all null: {}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let exec = optional("ExecBody");
    assert!(exec.len() >= 6, "{exec:?}");
    let base = json!({"code": "print('n')"});
    let mut all = base.clone();
    for field in &exec {
        let mut one = base.clone();
        one[field.as_str()] = Value::Null;
        let r = c.exec(&id, one).await;
        assert_eq!(r.status, 200, "{field}: null: {}", r.text);
        all[field.as_str()] = Value::Null;
    }
    let r = c.exec(&id, all).await;
    assert_eq!(r.status, 200, "all null: {}", r.text);
    assert_eq!(r.json["stdout"], "n\n");
}

/// A session exec's Idempotency-Key is checked like `/execute`'s: one that is not visible ASCII
/// is a 400 and runs nothing. Its replay is bound to the session, not to the bytes of the body.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_exec_key_is_checked_and_bound_to_what_runs() {
    let d = Daemon::start();
    let c = koder(&d, Some("t1"));
    let id = new_session(&c, "python").await;
    let exec = |key: &[u8], body: String, session: &str| {
        let mut rb = d
            .client
            .post(format!("{}/v1/sandbox/sessions/{session}/exec", d.base))
            .header("content-type", "application/json")
            .header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            )
            .body(body);
        for (k, v) in c.headers() {
            rb = rb.header(k, v);
        }
        async move { Daemon::read(rb.send().await.unwrap()).await }
    };
    let code = "import uuid; print(uuid.uuid4())";
    let r = exec(b"k\xfc", json!({"code": code}).to_string(), &id).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.json["error_type"], "InvalidRequest");
    assert_eq!(
        d.audit_lines()
            .iter()
            .filter(|l| l["event"] == "execution_start")
            .count(),
        0
    );
    let first = exec(b"step-1", json!({"code": code, "env": {}}).to_string(), &id).await;
    assert_eq!(first.status, 200, "{}", first.text);
    // The same exec spelt otherwise (a field null, keys reordered): the stored answer.
    let again = exec(
        b"step-1",
        format!(r#"{{"stdin": null, "code": {}}}"#, json!(code)),
        &id,
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.json["stdout"], first.json["stdout"]);
    assert_eq!(again.headers.get("idempotent-replayed").unwrap(), "true");
    let other = exec(b"step-1", json!({"code": "print(2)"}).to_string(), &id).await;
    assert_eq!(other.status, 422, "{}", other.text);
}

/// A service token whose subject joins another service's name and a tenant with a control
/// character is refused: it cannot read that service's session execs as runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_subject_with_a_control_character_reads_no_ones_session_execs() {
    let d = Daemon::start();
    let svc_a = |sub: &str| {
        d.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 300,
            aud: "executor-arm".into(),
            sub: Some(sub.into()),
            ..Default::default()
        })
    };
    let c = SandboxClient {
        d: &d,
        service: svc_a("svcA"),
        tenant: Some("t1"),
    };
    let id = new_session(&c, "python").await;
    let r = c
        .exec(
            &id,
            json!({"code": "import time\ntime.sleep(2)\nprint('secret')", "async": true}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    for forged in ["svcA\u{1}t1", "\u{1}4:svcA:t1"] {
        let r = d
            .client
            .get(format!("{}/v1/executions/{exec_id}", d.base))
            .header("authorization", format!("Bearer {}", svc_a(forged)))
            .send()
            .await
            .unwrap();
        let r = Daemon::read(r).await;
        assert_eq!(r.status, 401, "{forged:?}: {}", r.text);
    }
    // Through its session, its owner reads it.
    let mine = c
        .call(
            "GET",
            &format!("/v1/sandbox/sessions/{id}/execs/{exec_id}"),
            None,
        )
        .await;
    assert_eq!(mine.status, 200, "{}", mine.text);
}

/// Sends `PUT path` with `body` on a raw connection, then resets it (SO_LINGER 0) `after`
/// the last byte, without reading the answer.
async fn put_then_reset(d: &Daemon, service: &str, path: &str, body: &[u8], after: Duration) {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
    let head = format!(
        "PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {service}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s.flush().await.unwrap();
    tokio::time::sleep(after).await;
    s.set_zero_linger().unwrap();
    drop(s);
}

/// An upload whose client resets the connection right after its last byte either lands with
/// its `session_file` audit line or does not land: the write and its line are one unit of work
/// that the client's going away does not cut.
#[tokio::test(flavor = "multi_thread")]
async fn an_upload_reset_after_its_last_byte_is_audited_if_it_landed() {
    use sha2::{Digest, Sha256};
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let path = format!("/v1/sandbox/sessions/{id}/files/x.bin");
    let mut landed = 0;
    for i in 0..12u8 {
        let mut body = vec![i; 16 << 20];
        body[..8].copy_from_slice(&u64::from(i).to_be_bytes());
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        put_then_reset(
            &d,
            &c.service,
            &path,
            &body,
            Duration::from_millis(u64::from(i % 5)),
        )
        .await;
        // Whether this upload landed: the file has its bytes (looked for a while; one found
        // later is only not checked).
        let until = Instant::now() + Duration::from_secs(3);
        let mut arrived = false;
        while Instant::now() < until {
            let r = c.call("GET", &path, None).await;
            if r.status == 200
                && format!("sha256:{}", hex::encode(Sha256::digest(&r.bytes))) == digest
            {
                arrived = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if !arrived {
            continue;
        }
        landed += 1;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let audited = d.audit_lines().iter().any(|l| {
                l["event"] == "session_file"
                    && l["session_id"] == id.as_str()
                    && l["sha256"] == digest.as_str()
            });
            if audited {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "upload {i} is in the workspace with no session_file line"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(landed > 0, "no upload landed: the test checked nothing");
    assert!(
        common::audit_verify(&d.audit).status.success(),
        "the audit log stays intact"
    );
}

/// An upload whose body is still arriving when its session is deleted is refused as one to no
/// session: no upload is answered 204 into an ended session, and no `session_file` line
/// follows the session's `session_end`.
#[tokio::test(flavor = "multi_thread")]
async fn an_upload_still_arriving_when_its_session_is_deleted_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let body = vec![7u8; 1 << 20];
    let mut uploads = Vec::new();
    for i in 0..4 {
        let mut s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
        let head = format!(
            "PUT /v1/sandbox/sessions/{id}/files/d{i}/f.bin HTTP/1.1\r\nHost: x\r\n\
             Authorization: Bearer {}\r\nContent-Type: application/octet-stream\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            c.service,
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body[..body.len() / 2]).await.unwrap();
        uploads.push(s);
    }
    // Time for the uploads to look their session up before the delete. One that has not yet
    // gets the same 404 (the session is gone when it looks), so the assertions below hold either
    // way; the pause only makes the race they guard against the likely case.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    for mut s in uploads {
        s.write_all(&body[body.len() / 2..]).await.unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 404"),
            "an upload into a deleted session was answered: {answer}"
        );
    }
    let lines = d.audit_lines();
    let end = lines
        .iter()
        .position(|l| l["event"] == "session_end" && l["session_id"] == id.as_str())
        .expect("the session_end line");
    assert!(
        !lines[end..]
            .iter()
            .any(|l| l["event"] == "session_file" && l["session_id"] == id.as_str()),
        "a session_file line follows session_end"
    );
    assert!(
        common::audit_verify(&d.audit).status.success(),
        "the audit log stays intact"
    );
}

/// Sandboxes (session directories) made in `dir`, as inotify reports their creation.
struct DirWatch(std::os::fd::OwnedFd);

impl DirWatch {
    fn new(dir: &std::path::Path) -> DirWatch {
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: plain syscalls on a fd made here and a NUL-terminated path that outlives them.
        unsafe {
            let fd = libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC);
            assert!(fd >= 0, "inotify_init1");
            let watch = libc::inotify_add_watch(fd, path.as_ptr(), libc::IN_CREATE);
            assert!(watch >= 0, "inotify_add_watch {}", dir.display());
            DirWatch(std::os::fd::OwnedFd::from_raw_fd(fd))
        }
    }

    /// The directories created since the last call whose names start with `ses_`.
    fn sessions_made(&self) -> Vec<String> {
        use std::os::fd::AsRawFd;
        let mut made = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // SAFETY: reads into a buffer of its length, on the fd this struct owns.
            let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return made;
            }
            let mut at = 0;
            let head = std::mem::size_of::<libc::inotify_event>();
            while at + head <= n as usize {
                // SAFETY: the kernel wrote a whole event at `at`; read unaligned.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                let name = &buf[at + head..at + head + ev.len as usize];
                let name = String::from_utf8_lossy(name)
                    .trim_end_matches('\0')
                    .to_string();
                if ev.mask & libc::IN_ISDIR != 0 && name.starts_with("ses_") {
                    made.push(name);
                }
                at += head + ev.len as usize;
            }
        }
    }
}

/// A burst of creations for one tenant launches no sandbox past the tenant's limit: the place is
/// taken before the sandbox is made (and given back when it is not).
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_creations_launches_no_sandbox_past_the_limit() {
    let d = Daemon::start_with(Opts {
        config: Some("[sessions]\nmax_per_tenant = 8\nmax_total = 64\n".into()),
        ..Opts::default()
    });
    let watch = DirWatch::new(&d.dir.path().join("sessions"));
    let c = koder(&d, Some("burst"));
    let creates =
        (0..24).map(|_| c.create(json!({"language": "python", "capability_token": d.cap_all()})));
    let answers = futures::future::join_all(creates).await;
    let made = answers.iter().filter(|r| r.status == 201).count();
    let refused = answers.iter().filter(|r| r.status == 429).count();
    assert_eq!(
        (made, refused),
        (8, 16),
        "{:?}",
        answers.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let launched = watch.sessions_made();
    assert_eq!(launched.len(), 8, "sandboxes launched: {launched:?}");
    // A creation that fails once its sandbox is made (its single-use token was used already)
    // gives its place back: with one place free, it is 401, and the next creation is made.
    let first = answers.iter().find(|r| r.status == 201).unwrap();
    let r = c
        .call(
            "DELETE",
            &format!(
                "/v1/sandbox/sessions/{}",
                first.json["id"].as_str().unwrap()
            ),
            None,
        )
        .await;
    assert_eq!(r.status, 204);
    d.wait_until_tokens_postdate_start();
    let once = d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 120,
        aud: "executor-arm".into(),
        capabilities: vec!["PythonExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let used = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "1"], "capability_token": once}))
        .await;
    assert_eq!(used.status, 200, "{}", used.text);
    let replayed = c
        .create(json!({"language": "python", "capability_token": once}))
        .await;
    assert_eq!(replayed.status, 401, "{}", replayed.text);
    new_session(&c, "python").await;
    assert_eq!(
        watch.sessions_made().len(),
        2,
        "the refused one and the last one"
    );
}

/// A tar goes into a directory of the workspace (made for it) with its nested directories, file
/// and in-tree symlink; an exec sees them; its `session_archive` line has its digest; GET gives
/// them back, the symlink as a symlink.
#[tokio::test(flavor = "multi_thread")]
async fn an_archive_goes_into_the_workspace_and_comes_back_out() {
    use common::archives::{dir, file, get_archive, link, members, put_archive, tar_of};
    let d = Daemon::start();
    let c = koder(&d, Some("t"));
    let id = new_session(&c, "bash").await;
    let tar = tar_of(&[
        dir("a/"),
        dir("a/b/"),
        file("a/b/c.txt", b"hello"),
        link("a/link", "b/c.txt"),
        link("a/up", "../top"),
    ]);
    let r = put_archive(&c, &id, "proj", tar.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["members"], 5, "{}", r.text);
    let line = d
        .audit_lines()
        .into_iter()
        .find(|l| l["event"] == "session_archive")
        .expect("the archive's audit line");
    assert_eq!(line["path"], "proj");
    assert_eq!(line["members"], 5);
    assert_eq!(line["bytes"], tar.len());
    assert_eq!(line["sha256"], r.json["sha256"]);
    assert_eq!(line["session_id"], id.as_str());
    let r = c
        .exec(
            &id,
            json!({"code": "cat proj/a/link; echo; readlink proj/a/link; stat -c %U proj/a/b/c.txt | grep -vq root && echo owned"}),
        )
        .await;
    assert_eq!(r.json["stdout"], "hello\nb/c.txt\nowned\n", "{}", r.text);
    let out = get_archive(&c, &id, "proj").await;
    assert_eq!(out.status, 200, "{}", out.text);
    assert_eq!(
        out.headers["content-type"], "application/x-tar",
        "{:?}",
        out.headers
    );
    let got = members(&out.bytes);
    let want: Vec<(String, String)> = [
        ("a", "dir"),
        ("a/b", "dir"),
        ("a/b/c.txt", "file hello"),
        ("a/link", "-> b/c.txt"),
        ("a/up", "-> ../top"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(got, want);
    // Not a directory, or none: refused before any byte.
    assert_eq!(get_archive(&c, &id, "nope").await.status, 404);
    assert_eq!(get_archive(&c, &id, "proj/a/link").await.status, 400);
    assert_eq!(get_archive(&c, &id, "../x").await.status, 400);
    // Another tenant sees no such session.
    let other = koder(&d, Some("u"));
    assert_eq!(get_archive(&other, &id, "").await.status, 404);
    assert_eq!(put_archive(&other, &id, "", tar).await.status, 404);
}

/// Hostile archives are refused (400, or 507 past the quota) and the workspace is exactly as it
/// was, from the API's side and the host's.
#[tokio::test(flavor = "multi_thread")]
async fn hostile_archives_are_refused_and_leave_the_workspace_as_it_was() {
    use common::archives::{M, dir, file, link, put_archive, sparse_10_gib, tar_of, workspace};
    let d = Daemon::start();
    let c = koder(&d, None);
    let r = c
        .create(
            json!({"language": "bash", "limits": {"disk_mb": 8}, "capability_token": d.cap_all()}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let r = put_archive(
        &c,
        &id,
        "",
        tar_of(&[
            dir("d/"),
            file("d/f", b"keep"),
            link("d/l", "f"),
            file("top", b"t"),
        ]),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let before = workspace(&c, &id).await;
    let outside = std::env::temp_dir().join(format!("archive-escape-{}", std::process::id()));
    let outside_name = outside.display().to_string();
    let mut truncated = tar_of(&[file("t", &[b'x'; 4000])]);
    truncated.truncate(2048);
    let big = vec![b'z'; 9 << 20];
    // A header that declares 100 GiB, and a body that ends long before.
    let declared_big = {
        let mut h = tar::Header::new_gnu();
        h.set_path("huge").unwrap();
        h.set_size(100 << 30);
        h.set_mode(0o644);
        h.set_cksum();
        [h.as_bytes().as_slice(), &[b'y'; 4096]].concat()
    };
    let special = |name: &'static str, ty: u8, mode: u32| M {
        name,
        ty,
        mode,
        data: b"",
    };
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "a ../ name",
            tar_of(&[file("ok", b"1"), file("../escape", b"x")]),
            400,
        ),
        (
            "a ../ inside a name",
            tar_of(&[file("d/../../escape", b"x")]),
            400,
        ),
        (
            "an absolute name",
            tar_of(&[file("ok", b"1"), file(&outside_name, b"x")]),
            400,
        ),
        (
            "a symlink out, then a file through it",
            tar_of(&[
                link("out", "../../../../../../tmp"),
                file("out/escape", b"x"),
            ]),
            400,
        ),
        (
            "an absolute symlink, then a file through it",
            tar_of(&[link("abs", "/tmp"), file("abs/escape", b"x")]),
            400,
        ),
        (
            "a file through the workspace's own symlink",
            tar_of(&[file("d/l/x", b"x")]),
            400,
        ),
        (
            "a symlink in-tree, then a file through it",
            tar_of(&[link("in", "d"), file("in/x", b"x")]),
            400,
        ),
        (
            "a hard link",
            tar_of(&[M {
                name: "h",
                ty: b'1',
                mode: 0o644,
                data: b"top",
            }]),
            400,
        ),
        ("a FIFO", tar_of(&[special("fifo", b'6', 0o644)]), 400),
        (
            "a char device",
            tar_of(&[special("null", b'3', 0o666)]),
            400,
        ),
        (
            "a block device",
            tar_of(&[special("sda", b'4', 0o660)]),
            400,
        ),
        (
            "a setuid file",
            tar_of(&[M {
                name: "suid",
                ty: b'0',
                mode: 0o4755,
                data: b"#!",
            }]),
            400,
        ),
        (
            "a setgid directory",
            tar_of(&[M {
                name: "sg/",
                ty: b'5',
                mode: 0o2755,
                data: b"",
            }]),
            400,
        ),
        ("a 10 GiB GNU sparse member", sparse_10_gib(), 400),
        (
            "a file over a directory",
            tar_of(&[file("new", b"1"), file("d", b"x")]),
            400,
        ),
        (
            "a directory over a file",
            tar_of(&[file("new", b"1"), dir("top/")]),
            400,
        ),
        ("a truncated tar", truncated, 400),
        ("a header declaring 100 GiB", declared_big, 400),
        (
            "not a tar",
            b"just some bytes, not a tar archive".repeat(20),
            400,
        ),
        (
            "a member past the quota",
            tar_of(&[file("ok", b"1"), file("big", &big)]),
            507,
        ),
    ];
    for (what, tar, status) in cases {
        let r = put_archive(&c, &id, "", tar).await;
        assert_eq!(r.status, status, "{what}: {}", r.text);
        assert_eq!(workspace(&c, &id).await, before, "{what}");
        assert!(!outside.exists(), "{what}: a file outside the workspace");
        assert!(!std::path::Path::new("/tmp/escape").exists(), "{what}");
    }
    // Into a path through the workspace's symlink: refused too.
    let r = put_archive(&c, &id, "d/l", tar_of(&[file("x", b"x")])).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(workspace(&c, &id).await, before);
    // No staging directory is left, and nothing of the refused archives is audited.
    let r = c.exec(&id, json!({"code": "ls -A | tr '\\n' ' '"})).await;
    assert_eq!(r.json["stdout"], "d top ", "{}", r.text);
    let archives = d
        .audit_lines()
        .into_iter()
        .filter(|l| l["event"] == "session_archive")
        .count();
    assert_eq!(archives, 1, "only the first archive went in");
}

/// A million empty files, streamed: the inode limit stops it (507) long before the end; the
/// workspace is unchanged and the daemon takes the next archive.
#[tokio::test(flavor = "multi_thread")]
async fn a_million_empty_files_are_refused_and_change_nothing() {
    use common::archives::{file, put_archive, put_generated, tar_of, workspace};
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "bash").await;
    let r = put_archive(&c, &id, "", tar_of(&[file("keep", b"k")])).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let before = workspace(&c, &id).await;
    let (addr, headers, id2) = (d.addr.clone(), c.headers(), id.clone());
    let status =
        tokio::task::spawn_blocking(move || put_generated(&addr, &headers, &id2, 1_000_000))
            .await
            .unwrap();
    assert_eq!(status, 507);
    assert_eq!(workspace(&c, &id).await, before);
    let r = put_archive(&c, &id, "", tar_of(&[file("after", b"a")])).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = c.exec(&id, json!({"code": "ls -A | tr '\\n' ' '"})).await;
    assert_eq!(r.json["stdout"], "after keep ", "{}", r.text);
}

/// Archives wait for the session's exec: both calls are 409 while one runs, and nothing of the
/// refused upload is audited.
#[tokio::test(flavor = "multi_thread")]
async fn archives_are_refused_while_an_exec_runs() {
    use common::archives::{file, get_archive, put_archive, tar_of};
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "bash").await;
    let r = c
        .exec(&id, json!({"code": "sleep 30", "async": true}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let put = put_archive(&c, &id, "", tar_of(&[file("x", b"x")])).await;
    assert_eq!(put.status, 409, "{}", put.text);
    assert_eq!(put.json["error_type"], "SessionBusy");
    assert_eq!(get_archive(&c, &id, "").await.status, 409);
    assert!(
        !d.audit_lines()
            .iter()
            .any(|l| l["event"] == "session_archive")
    );
    let r = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert!(r.status < 300, "{}", r.text);
}

/// An archive larger than the workspace could hold (its size plus 64 MiB; here zeros after the
/// end of a valid tar, which take no space) is 413 and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_archive_larger_than_the_workspace_is_413() {
    use common::archives::{file, put_archive, tar_of, workspace};
    let d = Daemon::start();
    let c = koder(&d, None);
    let r = c
        .create(
            json!({"language": "bash", "limits": {"disk_mb": 1}, "capability_token": d.cap_all()}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let before = workspace(&c, &id).await;
    let mut tar = tar_of(&[file("small", b"s")]);
    tar.resize(tar.len() + (66 << 20), 0);
    let r = put_archive(&c, &id, "", tar).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(r.json["error_type"], "PayloadTooLarge", "{}", r.text);
    assert_eq!(workspace(&c, &id).await, before);
}

/// An exec waits for an archive call in flight: while a download is still being read, an exec
/// is 409 `SessionBusy`; once the download is dropped, execs run again.
#[tokio::test(flavor = "multi_thread")]
async fn an_exec_is_refused_while_an_archive_is_read() {
    let d = Daemon::start();
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    let r = c
        .exec(
            &id,
            json!({"code": "import os\nopen('big.bin','wb').write(os.urandom(48 << 20))", "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let mut rb = d
        .client
        .get(format!("{}/v1/sandbox/sessions/{id}/archive", d.base));
    for (k, v) in c.headers() {
        rb = rb.header(k, v);
    }
    // The answer's head only: the tar is not read, so the download stays in flight.
    let download = rb.send().await.expect("download");
    assert_eq!(download.status().as_u16(), 200);
    let busy = c.exec(&id, json!({"code": "print(1)"})).await;
    assert_eq!(busy.status, 409, "{}", busy.text);
    assert_eq!(busy.json["error_type"], "SessionBusy", "{}", busy.text);
    drop(download);
    let r = common::wait::wait_for_async(
        "an exec once the download is gone",
        Duration::from_secs(30),
        || async {
            let r = c.exec(&id, json!({"code": "print(1)"})).await;
            (r.status, r.json)
        },
        |(status, _): &(u16, Value)| *status == 200,
    )
    .await;
    assert_eq!(r.1["stdout"], "1\n", "{:?}", r);
}
