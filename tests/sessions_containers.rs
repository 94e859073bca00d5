//! Sessions on the docker (runc) and gvisor (runsc) backends, through a real daemon and the real
//! engine: one container per session kept for its life, every exec started in it by the
//! supervisor, the workspace inside it, files through the supervisor, and nothing left behind.
//!
//! Needs dockerd with both runtimes and the sandbox image (the test command sets them up); the
//! tests never skip.

mod common;

use std::time::Duration;

use common::docker::{
    SOCKET, config, docker_ps, finish, instance_of, one_at_a_time, require_docker, volumes,
};
use common::sessions::{SandboxClient, koder, new_session};
use common::wait::wait_until;
use common::{Daemon, Opts};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const RUNTIMES: [(&str, &str); 2] = [("runc", "docker"), ("gvisor", "gvisor")];

fn start(runtime: &str) -> Daemon {
    Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), runtime.into())],
        config: Some(config(1, SOCKET)),
        ..Default::default()
    })
}

/// The containers of a daemon that serve a session (named after it).
fn session_containers(d: &Daemon, session: &str) -> Vec<String> {
    docker_ps(&[
        format!("label=executor-arm.instance={}", instance_of(d)),
        format!("name=executor-arm-{session}"),
    ])
}

async fn run(c: &SandboxClient<'_>, id: &str, code: &str) -> Value {
    let r = c.exec(id, json!({"code": code, "timeout_ms": 60000})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandbox/sessions/{id}/{rest}")
}

/// Processes inside the sandbox whose command line contains `needle`, seen from an exec of the
/// session (gVisor's processes are not host processes).
const PS: &str = "import os,sys\nn=0\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n            c=open('/proc/%s/cmdline'%p,'rb').read()\n        except OSError:\n            continue\n        if sys.argv[0] and b'NEEDLE' in c: n+=1\nprint(n)";

/// An exec whose double-forked, setsid'd child keeps killing every process of its uid for two
/// seconds (anything that would sweep it with the same uid), then sleeps.
const SURVIVOR: &str = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        fd = os.open('/dev/null', os.O_RDWR)\n        for i in (0, 1, 2): os.dup2(fd, i)\n        t = time.time()\n        while time.time() - t < 2:\n            try: os.kill(-1, 9)\n            except ProcessLookupError: pass\n        time.sleep(3600)\n    os._exit(0)\nos.wait()\ntime.sleep(0.5)\nprint('planted')";

/// The seed's calls on a kept container: a python session runs code, keeps its files across
/// execs in the same container, starts in `cwd`, moves files in and out byte-exact, refuses
/// symlinks and escapes, and leaves nothing of an exec behind; delete removes the container
/// and its volume.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_keeps_one_container_with_its_files_across_execs() {
    let _serial = one_at_a_time().await;
    require_docker("a_session_keeps_one_container_with_its_files_across_execs");
    for (runtime, backend) in RUNTIMES {
        let d = start(runtime);
        let c = koder(&d, Some("team-a"));
        let r = c
            .create(json!({"language": "python", "capability_token": d.cap_all()}))
            .await;
        assert_eq!(r.status, 201, "{runtime}: {}", r.text);
        assert_eq!(r.json["backend"], backend, "{}", r.text);
        let id = r.json["id"].as_str().unwrap().to_string();
        assert_eq!(
            session_containers(&d, &id).len(),
            1,
            "{runtime}: one container"
        );

        let first = run(
            &c,
            &id,
            "open('note.txt','w').write('kept')\nprint('wrote')",
        )
        .await;
        assert_eq!(first["exit_code"], 0, "{runtime}: {first}");
        assert_eq!(first["stdout"], "wrote\n");
        for field in [
            "exec_id",
            "stderr",
            "stdout_truncated",
            "stderr_truncated",
            "duration_ms",
            "oom",
            "killed_reason",
            "outcome",
            "provenance",
        ] {
            assert!(
                first.get(field).is_some(),
                "{runtime}: {field} missing: {first}"
            );
        }
        assert_eq!(first["provenance"]["session_id"], id.as_str());
        let second = run(
            &c,
            &id,
            "import os\nprint(open('note.txt').read(), os.getcwd(), os.environ['HOME'])",
        )
        .await;
        assert_eq!(
            second["stdout"], "kept /workspace /workspace\n",
            "{runtime}: {second}"
        );
        let ids = session_containers(&d, &id);
        assert_eq!(ids.len(), 1, "{runtime}: still the one container");

        // Nothing of an exec outlives it, in the kept container too.
        let bg = run(&c, &id, "import subprocess\nsubprocess.Popen(['sleep','31.75'], start_new_session=True)\nprint('started')").await;
        assert_eq!(bg["stdout"], "started\n", "{runtime}: {bg}");
        let ps = run(&c, &id, &PS.replace("NEEDLE", "31.75")).await;
        assert_eq!(
            ps["stdout"], "0\n",
            "{runtime}: a process outlived its exec"
        );

        // A leftover that kills every process of its uid (the supervisor's own helpers would be
        // among them) still does not outlive its exec: the supervisor kills as root.
        for round in 0..5 {
            run(&c, &id, SURVIVOR).await;
            let left = run(&c, &id, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())))").await;
            assert_eq!(
                left["stdout"], "[]\n",
                "{runtime}: round {round}: a process outlived its exec"
            );
        }
        // No SysV IPC or message queue outlives an exec on runc: none can be made (gVisor
        // ignores the sysctls that say so; docs/security.md).
        let ipc = run(&c, &id, "import ctypes\nlibc = ctypes.CDLL(None)\nprint(libc.shmget(0, 4096, 0o1600), libc.msgget(0, 0o1600))").await;
        if runtime == "runc" {
            assert_eq!(ipc["stdout"], "-1 -1\n", "{runtime}: {ipc}");
        }
        // An exec that takes the workspace's permissions away does not break the next ones.
        run(&c, &id, "import os\nos.chmod('/workspace', 0)").await;
        assert_eq!(
            run(&c, &id, "print(open('note.txt').read())").await["stdout"],
            "kept\n",
            "{runtime}"
        );
        assert_eq!(
            c.call("GET", &path(&id, "files/note.txt"), None)
                .await
                .bytes,
            b"kept",
            "{runtime}"
        );

        // cwd: inside the workspace only, through directories only.
        run(
            &c,
            &id,
            "import os\nos.makedirs('sub/deeper')\nos.symlink('/etc','etc-link')",
        )
        .await;
        let r = c
            .exec(
                &id,
                json!({"code": "import os\nprint(os.getcwd())", "cwd": "sub/deeper"}),
            )
            .await;
        assert_eq!(
            r.json["stdout"], "/workspace/sub/deeper\n",
            "{runtime}: {}",
            r.text
        );
        let r = c
            .exec(
                &id,
                json!({"code": "import os\nprint(os.getcwd())", "cwd": "/workspace/sub"}),
            )
            .await;
        assert_eq!(
            r.json["stdout"], "/workspace/sub\n",
            "{runtime}: {}",
            r.text
        );
        for bad in [
            "../x",
            "/etc",
            "sub/../..",
            "missing",
            "etc-link",
            "note.txt",
        ] {
            let r = c.exec(&id, json!({"code": "print(1)", "cwd": bad})).await;
            assert_eq!(r.status, 400, "{runtime}: cwd {bad}: {}", r.text);
        }

        // Files: a 1 MiB binary goes in and is read by an exec; what an exec writes comes out.
        let blob: Vec<u8> = (0..(1u32 << 20))
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let put = c
            .call("PUT", &path(&id, "files/in/blob.bin"), Some(blob.clone()))
            .await;
        assert_eq!(put.status, 204, "{runtime}: {}", put.text);
        let digest = run(
            &c,
            &id,
            "import hashlib\nprint(hashlib.sha256(open('in/blob.bin','rb').read()).hexdigest())",
        )
        .await;
        assert_eq!(
            digest["stdout"].as_str().unwrap().trim(),
            hex::encode(Sha256::digest(&blob)),
            "{runtime}"
        );
        run(
            &c,
            &id,
            "open('out.bin','wb').write(bytes(range(256))*4096)",
        )
        .await;
        let got = c.call("GET", &path(&id, "files/out.bin"), None).await;
        assert_eq!(got.status, 200, "{runtime}: {}", got.text);
        assert_eq!(
            got.bytes,
            (0..=255u8).collect::<Vec<u8>>().repeat(4096),
            "{runtime}: byte-exact"
        );
        let list = c.call("GET", &path(&id, "files?path=in"), None).await;
        assert_eq!(list.status, 200, "{}", list.text);
        assert_eq!(list.json["entries"][0]["name"], "blob.bin", "{}", list.text);
        assert_eq!(list.json["entries"][0]["size"], 1 << 20);

        // A symlink the sandbox planted is never followed.
        run(
            &c,
            &id,
            "import os\nos.symlink('/etc/shadow','leak')\nos.symlink('/etc','etc')",
        )
        .await;
        for p in ["files/leak", "files/etc/passwd", "files/etc-link/hostname"] {
            let r = c.call("GET", &path(&id, p), None).await;
            assert_eq!(r.status, 400, "{runtime}: {p}: {}", r.text);
            assert!(!r.text.contains("root:"), "{runtime}: {p} leaked");
        }
        let r = c
            .call("PUT", &path(&id, "files/leak"), Some(b"x".to_vec()))
            .await;
        assert_eq!(
            r.status, 400,
            "{runtime}: writing through a symlink: {}",
            r.text
        );
        let r = c
            .call("PUT", &path(&id, "files/etc/evil"), Some(b"x".to_vec()))
            .await;
        assert_eq!(
            r.status, 400,
            "{runtime}: writing below a symlink: {}",
            r.text
        );
        for p in [
            "files/..%2Fetc%2Fpasswd",
            "files/%2Fetc%2Fpasswd",
            "files/a%2F..%2F..%2Fb",
        ] {
            let r = c.call("GET", &path(&id, p), None).await;
            assert_eq!(r.status, 400, "{runtime}: {p}: {}", r.text);
        }
        let r = c.call("GET", &path(&id, "files/nope.txt"), None).await;
        assert_eq!(r.status, 404, "{runtime}: {}", r.text);

        // Another tenant sees nothing of it.
        let other = koder(&d, Some("team-b"));
        for (m, p) in [
            ("GET", format!("/v1/sandbox/sessions/{id}")),
            ("GET", path(&id, "files/note.txt")),
            ("DELETE", format!("/v1/sandbox/sessions/{id}")),
        ] {
            assert_eq!(
                other.call(m, &p, None).await.status,
                404,
                "{runtime}: {m} {p}"
            );
        }
        assert_eq!(
            other.exec(&id, json!({"code": "print(1)"})).await.status,
            404
        );

        let volume_label = format!("executor-arm.instance={}", instance_of(&d));
        let gone = c
            .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
            .await;
        assert_eq!(gone.status, 204, "{}", gone.text);
        wait_until(
            "the session's container removed",
            Duration::from_secs(60),
            || session_containers(&d, &id).is_empty(),
        );
        assert_eq!(c.exec(&id, json!({"code": "print(1)"})).await.status, 404);
        // Its disk volume goes with it (the pool's idle containers keep theirs).
        let idle = docker_ps(&[format!("label={volume_label}")]).len();
        wait_until(
            "only the pool's volumes left",
            Duration::from_secs(60),
            || volumes(&volume_label).len() <= idle,
        );
        finish(d);
    }
}

/// Limits inside a kept container: the workspace quota is ENOSPC inside and the session goes on;
/// a timeout, a fork bomb and an output flood kill the exec, not the session; a memory bomb is an
/// OOM or refused allocations, after which the session goes on; an async exec is
/// polled and cancelled, and file calls wait their turn (409) while it runs.
#[tokio::test(flavor = "multi_thread")]
async fn limits_and_cancels_end_the_exec_not_the_session() {
    let _serial = one_at_a_time().await;
    require_docker("limits_and_cancels_end_the_exec_not_the_session");
    for (runtime, _) in RUNTIMES {
        let d = start(runtime);
        let c = koder(&d, None);
        let create = json!({"language": "bash", "capability_token": d.cap_all(), "limits": {"disk_mb": 8, "memory_mb": 256, "pids": 32}});
        let r = c.create(create.clone()).await;
        assert_eq!(r.status, 201, "{runtime}: {}", r.text);
        let mut id = r.json["id"].as_str().unwrap().to_string();
        let ok = |v: &Value| v["stdout"].as_str().unwrap_or_default().trim().to_string();

        let full = run(&c, &id, "head -c 12000000 /dev/zero > big; echo rc=$?; rm -f big; echo after > a.txt; cat a.txt").await;
        assert!(ok(&full).contains("after"), "{runtime}: {full}");
        assert!(
            full["stderr"].as_str().unwrap().contains("No space left"),
            "{runtime}: {full}"
        );
        run(&c, &id, "head -c 12000000 /dev/zero > big; true").await;
        let r = c
            .call(
                "PUT",
                &path(&id, "files/more.bin"),
                Some(vec![7u8; 1 << 20]),
            )
            .await;
        assert_eq!(r.status, 507, "{runtime}: {}", r.text);
        run(&c, &id, "rm -f big").await;
        // The workspace's entries are bounded too (a listing is held whole in memory).
        let made = run(&c, &id, "python3 -c 'import os\nos.mkdir(\"many\")\nn=0\ntry:\n    while n < 20000:\n        open(\"many/%d\" % n, \"w\").close(); n += 1\nexcept OSError as e:\n    print(e.errno == 28)\nprint(n)'; rm -rf many").await;
        let lines: Vec<&str> = made["stdout"].as_str().unwrap().lines().collect();
        assert_eq!(
            lines.first(),
            Some(&"True"),
            "{runtime}: ENOSPC at the inode limit: {made}"
        );
        let n: u64 = lines[1].parse().unwrap();
        assert!(n < 16384, "{runtime}: {n} files");

        let t = c
            .exec(
                &id,
                json!({"code": "echo start; sleep 60", "timeout_ms": 1500}),
            )
            .await;
        assert_eq!(t.status, 200, "{runtime}: {}", t.text);
        assert_eq!(t.json["killed_reason"], "timeout", "{runtime}: {}", t.text);
        assert_eq!(ok(&t.json), "start");
        assert_eq!(
            ok(&run(&c, &id, "cat a.txt").await),
            "after",
            "{runtime}: alive after a timeout"
        );

        let bomb = c
            .exec(
                &id,
                json!({"code": "b(){ b | b & }; b; sleep 3; echo done", "timeout_ms": 8000}),
            )
            .await;
        assert_eq!(bomb.status, 200, "{runtime}: {}", bomb.text);
        let after = c.exec(&id, json!({"code": "cat a.txt"})).await;
        if after.status == 404 {
            // The bomb held every process the pids limit allows until the supervisor gave the
            // container up: the session ended, and says so. The rest goes on in a new one.
            assert!(
                after.text.contains("sandbox is gone"),
                "{runtime}: {}",
                after.text
            );
            let r = c.create(create.clone()).await;
            assert_eq!(r.status, 201, "{runtime}: {}", r.text);
            id = r.json["id"].as_str().unwrap().to_string();
            run(&c, &id, "echo after > a.txt").await;
        } else {
            assert_eq!(
                ok(&after.json),
                "after",
                "{runtime}: alive after a fork bomb: {}",
                after.text
            );
        }

        let flood = c
            .exec(&id, json!({"code": "yes flood", "timeout_ms": 3000}))
            .await;
        assert_eq!(flood.status, 200, "{runtime}: {}", flood.text);
        assert_eq!(flood.json["stdout_truncated"], true, "{runtime}");
        assert_eq!(
            ok(&run(&c, &id, "cat a.txt").await),
            "after",
            "{runtime}: alive after a flood"
        );

        // Async, polled, busy, cancelled.
        let a = c
            .exec(
                &id,
                json!({"code": "echo working; sleep 120", "async": true, "timeout_ms": 120000}),
            )
            .await;
        assert_eq!(a.status, 202, "{runtime}: {}", a.text);
        let exec_id = a.json["exec_id"].as_str().unwrap().to_string();
        assert_eq!(c.exec(&id, json!({"code": "true"})).await.status, 409);
        let busy = c.call("GET", &path(&id, "files/a.txt"), None).await;
        assert_eq!(busy.status, 409, "{runtime}: files wait for the exec");
        assert!(
            busy.text
                .contains(&format!("Session {id} is running another exec")),
            "{runtime}: {}",
            busy.text
        );
        for (method, p, body) in [
            ("GET", path(&id, "files"), None),
            ("PUT", path(&id, "files/b.txt"), Some(b"b".to_vec())),
        ] {
            let busy = c.call(method, &p, body).await;
            assert_eq!(busy.status, 409, "{runtime}: {method} {p}: {}", busy.text);
            assert_eq!(
                busy.json["error_type"], "SessionBusy",
                "{runtime}: {method} {p}"
            );
        }
        let cancel = c
            .call(
                "POST",
                &path(&id, &format!("execs/{exec_id}/cancel")),
                Some(b"{}".to_vec()),
            )
            .await;
        assert!(
            cancel.status == 202 || cancel.status == 200,
            "{runtime}: {}",
            cancel.text
        );
        let last = common::wait::wait_for_async(
            &format!("{runtime}: the cancelled exec to end"),
            common::wait::CLEANUP,
            || async {
                c.call("GET", &path(&id, &format!("execs/{exec_id}")), None)
                    .await
                    .json
            },
            |last| last["status"] != "running" && last["status"] != "queued",
        )
        .await;
        assert_eq!(
            last["result"]["killed_reason"], "cancelled",
            "{runtime}: {last}"
        );
        let got = c.call("GET", &path(&id, "files/a.txt"), None).await;
        assert_eq!(got.bytes, b"after\n", "{runtime}: files after the cancel");

        // A memory bomb ends at the memory limit: an OOM kill (runc), or allocations refused
        // (gVisor's sentry); either way it never holds more than the limit.
        let bomb = "python3 -c 'import sys\nx=[]\nwhile True:\n    x.append(bytearray(16<<20))\n    print(len(x), flush=True)'";
        let mem = c
            .exec(&id, json!({"code": bomb, "timeout_ms": 30000}))
            .await;
        assert_eq!(mem.status, 200, "{runtime}: {}", mem.text);
        assert!(
            mem.json["oom"] == true || mem.json["exit_code"] != 0,
            "{runtime}: {}",
            mem.text
        );
        let held: u64 = ok(&mem.json)
            .lines()
            .last()
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        assert!(
            held * 16 <= 256,
            "{runtime}: held {} MiB under a 256 MiB limit",
            held * 16
        );
        // The session goes on on both runtimes (gVisor: the command's address space stays
        // below the container's memory, so the sentry keeps its headroom).
        let after = c.exec(&id, json!({"code": "cat a.txt"})).await;
        assert_eq!(after.status, 200, "{runtime}: {}", after.text);
        assert_eq!(ok(&after.json), "after", "{runtime}");
        finish(d);
    }
}

/// A memory bomb under a gVisor session's default limits ends the exec (refused allocations, a
/// non-zero exit, or an OOM kill) and the session goes on: the command's address space is kept
/// below the container's memory, so the sentry, which shares that cgroup, is never the one to go.
#[tokio::test(flavor = "multi_thread")]
async fn a_memory_bomb_in_a_gvisor_session_ends_the_exec_not_the_session() {
    let _serial = one_at_a_time().await;
    require_docker("a_memory_bomb_in_a_gvisor_session_ends_the_exec_not_the_session");
    let d = start("gvisor");
    let c = koder(&d, None);
    let r = c
        .create(json!({"language": "bash", "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let before = run(&c, &id, "echo kept > k.txt; cat k.txt").await;
    assert_eq!(before["stdout"], "kept\n", "{before}");
    for bomb in [
        "python3 -c 'bytearray(2 << 30)'",
        "python3 -c 'x=[]\nwhile True: x.append(bytearray(16<<20))'",
    ] {
        let mem = c
            .exec(&id, json!({"code": bomb, "timeout_ms": 60000}))
            .await;
        assert_eq!(mem.status, 200, "{bomb}: {}", mem.text);
        assert!(
            mem.json["oom"] == true
                || (mem.json["exit_code"].is_i64() && mem.json["exit_code"] != 0),
            "{bomb}: {}",
            mem.text
        );
        let after = c.exec(&id, json!({"code": "cat k.txt"})).await;
        assert_eq!(
            after.status, 200,
            "{bomb}: the session ended: {}",
            after.text
        );
        assert_eq!(after.json["stdout"], "kept\n", "{bomb}: {}", after.text);
    }
    // Ordinary allocations well below the limit still work.
    let fits = run(
        &c,
        &id,
        "python3 -c 'b = bytearray(200 << 20); print(len(b) >> 20)'",
    )
    .await;
    assert_eq!(fits["stdout"], "200\n", "{fits}");
    finish(d);
}

/// A session whose container dies (here: killed from outside) ends: every later call is 404 with
/// a message that says its sandbox is gone, and the end is audited.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_whose_container_dies_ends_with_a_clear_error() {
    let _serial = one_at_a_time().await;
    require_docker("a_session_whose_container_dies_ends_with_a_clear_error");
    for (runtime, _) in RUNTIMES {
        let d = start(runtime);
        let c = koder(&d, None);
        let id = new_session(&c, "bash").await;
        run(&c, &id, "echo hi > x").await;
        let ids = session_containers(&d, &id);
        assert_eq!(ids.len(), 1);
        common::docker::docker(&["kill", &ids[0]]).expect("docker kill");
        // The daemon learns of the kill from the engine in its own time.
        let (_, text) = common::wait::wait_for_async(
            &format!("{runtime}: an exec in the killed sandbox to be 404"),
            common::wait::CLEANUP,
            || async {
                let r = c.exec(&id, json!({"code": "cat x"})).await;
                (r.status, r.text)
            },
            |(status, _)| *status == 404,
        )
        .await;
        assert!(text.contains("sandbox is gone"), "{runtime}: {text}");
        let g = c
            .call("GET", &format!("/v1/sandbox/sessions/{id}"), None)
            .await;
        assert!(
            g.status == 404 && g.text.contains("sandbox is gone"),
            "{runtime}: {}",
            g.text
        );
        let ended = d.audit_lines().into_iter().any(|l| {
            l["event"] == "session_end"
                && l["session_id"] == id.as_str()
                && l["reason"] == "sandbox_gone"
        });
        assert!(ended, "{runtime}: session_end sandbox_gone audited");
        wait_until(
            "the dead container removed",
            Duration::from_secs(60),
            || session_containers(&d, &id).is_empty(),
        );
        finish(d);
    }
}

/// A daemon killed with SIGKILL leaves its session containers; the next start removes them.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_after_sigkill_removes_the_old_session_containers() {
    let _serial = one_at_a_time().await;
    require_docker("a_restart_after_sigkill_removes_the_old_session_containers");
    let d = start("runc");
    let c = koder(&d, None);
    let id = new_session(&c, "python").await;
    run(&c, &id, "open('x','w').write('1')").await;
    let label = format!("executor-arm.instance={}", instance_of(&d));
    assert_eq!(session_containers(&d, &id).len(), 1);
    let mut d = d;
    d.kill9();
    let next = start("runc");
    wait_until(
        "the dead daemon's containers removed",
        Duration::from_secs(120),
        || docker_ps(&[format!("label={label}")]).is_empty(),
    );
    wait_until("their volumes removed", Duration::from_secs(60), || {
        volumes(&label).is_empty()
    });
    finish(next);
}

/// Archives on a kept container, through its supervisor: a tar with nested directories, a file
/// and an in-tree symlink goes in (the exec sees it) and comes back out; a `../` name, a symlink
/// out then a file through it, and a member past the quota are refused (400, 507) with the
/// workspace exactly as it was; the container serves the next call.
#[tokio::test(flavor = "multi_thread")]
async fn archives_go_in_and_out_of_a_kept_container_and_hostile_ones_change_nothing() {
    use common::archives::{dir, file, get_archive, link, members, put_archive, tar_of, workspace};
    let _serial = one_at_a_time().await;
    require_docker("archives_go_in_and_out_of_a_kept_container_and_hostile_ones_change_nothing");
    for (runtime, backend) in RUNTIMES {
        let d = start(runtime);
        let c = koder(&d, None);
        let r = c
            .create(json!({"language": "bash", "limits": {"disk_mb": 8}, "capability_token": d.cap_all()}))
            .await;
        assert_eq!(r.status, 201, "{runtime}: {}", r.text);
        assert_eq!(r.json["backend"], backend, "{}", r.text);
        let id = r.json["id"].as_str().unwrap().to_string();
        let tar = tar_of(&[
            dir("a/"),
            dir("a/b/"),
            file("a/b/c.txt", b"hello"),
            link("a/link", "b/c.txt"),
        ]);
        let r = put_archive(&c, &id, "proj", tar.clone()).await;
        assert_eq!(r.status, 200, "{runtime}: {}", r.text);
        assert_eq!(r.json["members"], 4, "{runtime}: {}", r.text);
        let line = d
            .audit_lines()
            .into_iter()
            .find(|l| l["event"] == "session_archive")
            .expect("the archive's audit line");
        assert_eq!(line["bytes"], tar.len());
        let out = run(&c, &id, "cat proj/a/link; echo; readlink proj/a/link").await;
        assert_eq!(out["stdout"], "hello\nb/c.txt\n", "{runtime}: {out}");
        let got = get_archive(&c, &id, "proj").await;
        assert_eq!(got.status, 200, "{runtime}: {}", got.text);
        assert_eq!(
            members(&got.bytes),
            [
                ("a", "dir"),
                ("a/b", "dir"),
                ("a/b/c.txt", "file hello"),
                ("a/link", "-> b/c.txt"),
            ]
            .map(|(a, b)| (a.to_string(), b.to_string())),
            "{runtime}"
        );
        assert_eq!(get_archive(&c, &id, "nope").await.status, 404, "{runtime}");
        let before = workspace(&c, &id).await;
        let big = vec![b'z'; 9 << 20];
        for (what, tar, status) in [
            (
                "a ../ name",
                tar_of(&[file("ok", b"1"), file("../escape", b"x")]),
                400,
            ),
            (
                "a symlink out, then a file through it",
                tar_of(&[link("out", "../../../tmp"), file("out/escape", b"x")]),
                400,
            ),
            (
                "a file through the workspace's own symlink",
                tar_of(&[file("proj/a/link/x", b"x")]),
                400,
            ),
            (
                "a member past the quota",
                tar_of(&[file("ok", b"1"), file("big", &big)]),
                507,
            ),
        ] {
            let r = put_archive(&c, &id, "", tar).await;
            assert_eq!(r.status, status, "{runtime}: {what}: {}", r.text);
            assert_eq!(workspace(&c, &id).await, before, "{runtime}: {what}");
        }
        let out = run(&c, &id, "ls -A /tmp | grep -c escape; ls -A | tr '\\n' ' '").await;
        assert_eq!(out["stdout"], "0\nproj ", "{runtime}: {out}");
        finish(d);
    }
}
