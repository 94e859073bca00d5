//! The docker (runc) and gvisor (runsc) backends against the real engine, through the real daemon.
//!
//! Needs a running dockerd with the runc and runsc runtimes and the sandbox image
//! (`scripts/setup-docker.sh`, `scripts/build-sandbox-image.sh`). Without them every test fails;
//! they never skip.
//!
//! Every test checks from the host that no container of its daemon is left once it stops.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::docker::{
    SOCKET, assert_nothing_left, assigned_containers, config, container_exists, container_of,
    containers, docker, finish, instance_of, pool_containers, remove_all, require_docker,
    running_containers, volumes, wait_for_assigned,
};
use common::wait::wait_until;
use common::{Daemon, Opts};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RUNTIMES: [&str; 2] = ["runc", "gvisor"];

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

fn start(runtime: &str, pool: usize) -> Daemon {
    start_with_socket(runtime, pool, SOCKET)
}

/// A daemon with `pool_reuse = false`: one container per run, for the tests of a container's
/// own life (its pool, its name, its volume, its removal once its run ended).
fn start_one_per_run(runtime: &str, pool: usize) -> Daemon {
    Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), runtime.into())],
        config: Some(format!("{}pool_reuse = false\n", config(pool, SOCKET))),
        ..Default::default()
    })
}

fn start_with_socket(runtime: &str, pool: usize, socket: &str) -> Daemon {
    Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), runtime.into())],
        config: Some(config(pool, socket)),
        ..Default::default()
    })
}

async fn py(d: &Daemon, code: &str, extra: Value) -> common::Resp {
    let mut body = json!({"action_type": "python", "command": "python3", "args": ["-c", code]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    d.exec(body).await
}

async fn sh(d: &Daemon, command: &str, args: &[&str]) -> common::Resp {
    d.exec(json!({"action_type": "shell", "command": command, "args": args}))
        .await
}

fn out(r: &common::Resp) -> &str {
    r.json["stdout"].as_str().unwrap_or_default()
}

/// Processes on the host whose command line contains `needle` (runc runs are host processes).
fn host_processes(needle: &str) -> Vec<i32> {
    common::pids_with_cmdline(needle)
        .into_iter()
        .filter(|p| *p != std::process::id() as i32)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_examples_run_in_a_fresh_container_each() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("seed_examples_run_in_a_fresh_container_each");
    for rt in RUNTIMES {
        let d = start_one_per_run(rt, 1);
        let mut log = Vec::new();
        let backend = if rt == "runc" { "docker" } else { "gvisor" };

        // The wire contract's examples, as written there (timeouts included). Example 2 (curl)
        // needs egress: tests/egress.rs runs it on every backend.
        // Example 1: ls -la /tmp.
        let r = d
            .exec(json!({"action_type": "shell", "command": "ls", "args": ["-la", "/tmp"], "timeout_seconds": 10}))
            .await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(r.json["backend"], backend);
        assert_eq!(r.json["success"], true, "{rt}: {}", r.text);
        assert!(out(&r).starts_with("total"), "{rt}: {}", r.text);
        assert_eq!(r.json["stderr"], "", "{rt}: {}", r.text);
        assert_eq!(
            r.json["provenance"]["capabilities_used"],
            json!(["ShellRead", "FilesystemRead"])
        );

        // Example 3: the python3 script.
        let script =
            "\nimport sys\nprint(\"Python version:\", sys.version)\nprint(\"2 + 2 =\", 2 + 2)\n";
        let r = d
            .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", script], "timeout_seconds": 10}))
            .await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert!(
            out(&r).starts_with("Python version: 3."),
            "{rt}: {}",
            r.text
        );
        assert!(out(&r).ends_with("2 + 2 = 4\n"), "{rt}: {}", r.text);

        // Example 5: nmap with a timeout, aimed at the sandbox's own loopback (no network is
        // reached from a test): it runs, scans and reports the ports closed.
        let r = d
            .exec(json!({"action_type": "shell", "command": "nmap", "args": ["-p", "80,443", "127.0.0.1"], "timeout_seconds": 60}))
            .await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(r.json["success"], true, "{rt}: {}", r.text);
        assert!(
            out(&r).contains("Nmap done: 1 IP address"),
            "{rt}: {}",
            r.text
        );

        // Example 4: cat of a missing file.
        let r = sh(&d, "cat", &["/nonexistent/file.txt"]).await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(r.json["success"], false);
        assert_eq!(r.json["exit_code"], 1);
        assert!(
            r.json["stderr"]
                .as_str()
                .unwrap_or_default()
                .contains("No such file"),
            "{rt}: {}",
            r.text
        );

        let r = py(
            &d,
            "import sys; print(sum(range(10)), sys.version_info[0])",
            json!({}),
        )
        .await;
        assert_eq!((r.status, out(&r)), (200, "45 3\n"), "{rt}: {}", r.text);

        // No shell anywhere: metacharacters are data.
        let r = sh(&d, "echo", &["$(id)", "`id`", "a;b", "|", "*"]).await;
        assert_eq!(out(&r), "$(id) `id` a;b | *\n", "{rt}: {}", r.text);

        // stdin and env reach the command exactly.
        let r = d.exec(json!({"action_type": "shell", "command": "cat", "args": [], "stdin": "line 1\nline 2"})).await;
        assert_eq!(out(&r), "line 1\nline 2", "{rt}: {}", r.text);
        let r = py(&d, "import os; print(os.environ.get('TZ'), os.environ.get('HOME'), 'PERL5OPT' in os.environ)", json!({"env": {"TZ": "UTC"}})).await;
        assert_eq!(out(&r), "UTC /work False\n", "{rt}: {}", r.text);

        // Bytes that are not UTF-8 come back exactly, in base64, and match their digest.
        let r = py(
            &d,
            "import sys; sys.stdout.buffer.write(b'ok\\xff\\x00\\xfe'); print('fine', file=sys.stderr)",
            json!({}),
        )
        .await;
        common::assert_binary_output(&r, b"ok\xff\x00\xfe", rt);

        // With pool_reuse off, never reused: what one run leaves in /tmp and /work, the next
        // one does not see, and every run had a container of its own (tests/container_reuse.rs:
        // with it on).
        let a = py(
            &d,
            "open('/tmp/left','w').write('x'); open('/work/left','w').write('x'); print('ok')",
            json!({}),
        )
        .await;
        assert_eq!(out(&a), "ok\n", "{rt}: {}", a.text);
        let b = py(
            &d,
            "import os; print(os.path.exists('/tmp/left'), os.path.exists('/work/left'))",
            json!({}),
        )
        .await;
        assert_eq!(out(&b), "False False\n", "{rt}: {}", b.text);
        let ids: BTreeSet<String> = [&a, &b]
            .iter()
            .map(|r| container_of(&d, r.json["exec_id"].as_str().unwrap_or_default(), &mut log))
            .collect();
        assert_eq!(ids.len(), 2, "{rt}: two runs, two containers");
        for id in &ids {
            wait_until(
                &format!("{rt}: container {id} removed"),
                Duration::from_secs(10),
                || !container_exists(id),
            );
        }
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confinement_holds() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("confinement_holds");
    let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("listener");
    let port = listener.local_addr().expect("addr").port();
    listener.set_nonblocking(true).expect("nonblocking");
    for rt in RUNTIMES {
        let d = start(rt, 1);

        // Writes: only the workdir and /tmp.
        let code = r#"
import os
for p in ["/etc/x", "/usr/x", "/x", "/bin/x", "/work/x", "/tmp/x"]:
    try:
        open(p, "w").write("x"); print(p, "written")
    except OSError as e:
        print(p, "refused", e.strerror)
print("uid", os.getuid(), os.getgid(), "cwd", os.getcwd())
"#;
        let r = py(&d, code, json!({})).await;
        let o = out(&r);
        for p in ["/etc/x", "/usr/x", "/x", "/bin/x"] {
            assert!(o.contains(&format!("{p} refused")), "{rt}: {o}");
        }
        assert!(
            o.contains("/work/x written") && o.contains("/tmp/x written"),
            "{rt}: {o}"
        );
        // A host uid of the container's own from the uid block, the profile's gid.
        let ids = o
            .lines()
            .find_map(|l| l.strip_prefix("uid "))
            .and_then(|l| l.strip_suffix(" cwd /work"))
            .and_then(|l| l.split_once(' '))
            .and_then(|(u, g)| Some((u.parse::<u32>().ok()?, g.parse::<u32>().ok()?)));
        assert!(
            ids.is_some_and(|(u, g)| (200_000..265_536).contains(&u) && g == 65534),
            "{rt}: {o}"
        );

        // Only stdio reaches the command (3 is listdir's own fd).
        let r = py(
            &d,
            "import os; print(sorted(os.listdir('/proc/self/fd')))",
            json!({}),
        )
        .await;
        assert_eq!(out(&r), "['0', '1', '2', '3']\n", "{rt}: {}", r.text);

        // No privilege: setuid fails, no capabilities, no_new_privs (gVisor does not show the
        // flag in /proc; the setuid refusal is the proof there).
        let code = r#"
import os
for f, a in [(os.setuid, 0), (os.setgid, 0), (os.seteuid, 0)]:
    try:
        f(a); print(f.__name__, "succeeded")
    except PermissionError:
        print(f.__name__, "refused")
st = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
print("CapEff", st["CapEff"].strip(), "NoNewPrivs", st.get("NoNewPrivs", "-").strip())
"#;
        let r = py(&d, code, json!({})).await;
        let o = out(&r);
        assert!(
            o.contains("setuid refused")
                && o.contains("setgid refused")
                && o.contains("seteuid refused"),
            "{rt}: {o}"
        );
        assert!(o.contains("CapEff 0000000000000000"), "{rt}: {o}");
        if rt == "runc" {
            assert!(o.contains("NoNewPrivs 1"), "{rt}: {o}");
        }

        // Network none: a listener on the host (loopback and docker bridge) is unreachable.
        let code = format!(
            r#"
import socket
for host in ["127.0.0.1", "172.17.0.1", "10.0.0.1"]:
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((host, {port})); print(host, "CONNECTED")
    except OSError as e:
        print(host, "blocked", e.errno)
print([n for _, n in socket.if_nameindex()])
"#
        );
        let r = py(&d, &code, json!({})).await;
        let o = out(&r);
        assert!(
            !o.contains("CONNECTED") && o.matches("blocked").count() == 3,
            "{rt}: {o}"
        );
        assert!(
            listener.accept().is_err(),
            "{rt}: the host listener got a connection"
        );
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_contain_bombs_and_floods() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("limits_contain_bombs_and_floods");
    for rt in RUNTIMES {
        let d = start(rt, 1);

        // pids: forks are refused below the profile's 64.
        let code = r#"
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(60); os._exit(0)
        n += 1
    print("forked", n)
except OSError as e:
    print("refused after", n, e.errno)
"#;
        let r = py(&d, code, json!({})).await;
        let o = out(&r);
        let n: u32 = o
            .strip_prefix("refused after ")
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(u32::MAX);
        assert!(n < 64, "{rt}: {o} {}", r.text);

        // A real fork bomb ends at the wall clock (or, under gVisor, where each guest process
        // also costs sentry memory, possibly at the memory limit first), and the next request
        // still works.
        let r = py(
            &d,
            "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
            json!({"timeout_seconds": 3}),
        )
        .await;
        assert!(
            r.status == 408 || (r.status == 200 && r.json["oom"] == true),
            "{rt}: {}",
            r.text
        );
        let r = sh(&d, "echo", &["still", "here"]).await;
        assert_eq!(out(&r), "still here\n", "{rt}: {}", r.text);

        // Memory: the container's limit, read back from the engine as an OOM kill.
        let r = py(&d, "s = 'x' * (1 << 30)\nprint(len(s))", json!({})).await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(r.json["oom"], true, "{rt}: {}", r.text);
        assert_eq!(r.json["outcome"], "oom", "{rt}: {}", r.text);
        assert_eq!(r.json["killed_reason"], "oom", "{rt}: {}", r.text);

        // Output: capped per stream and flagged; the rest is drained and the run goes on.
        let r = py(&d, FLOOD_THEN_EXIT, json!({"timeout_seconds": 60})).await;
        assert_eq!(r.status, 200, "{rt}: {}", brief(&r));
        assert_eq!(out(&r).len(), 1 << 20, "{rt}");
        assert_eq!(r.json["stdout_truncated"], true, "{rt}");
        assert_eq!(r.json["success"], true, "{rt}: {}", brief(&r));
        assert_eq!(r.json["killed_reason"], Value::Null, "{rt}: {}", brief(&r));
        assert_eq!(
            r.json["stderr"], "flood over\n",
            "{rt}: the run went on past the cap"
        );
        finish(d);
    }
}

/// Writes 64 KiB blocks to stdout for two seconds (several times the 1 MiB cap), then
/// "flood over" to stderr, and exits 0.
const FLOOD_THEN_EXIT: &str = "import sys, time\nend = time.monotonic() + 2\nwhile time.monotonic() < end:\n    sys.stdout.write('x' * 65536)\nsys.stdout.flush()\nsys.stderr.write('flood over\\n')";

fn brief(r: &common::Resp) -> String {
    r.text.chars().take(300).collect()
}

/// Under `[output] on_overflow = "kill"` a container run is stopped at the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_on_overflow_profile_stops_container_runs_at_the_cap() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_kill_on_overflow_profile_stops_container_runs_at_the_cap");
    let profile = format!(
        "{}\n[output]\non_overflow = \"kill\"\n",
        common::shipped_profile("python")
    );
    let profiles = common::profiles_with(&[("python-kill", profile)]);
    for rt in RUNTIMES {
        let d = Daemon::start_with(Opts {
            env: vec![
                ("SANDBOX_RUNTIME".into(), rt.into()),
                (
                    "EXECUTOR_ARM_PROFILES_DIR".into(),
                    profiles.path().display().to_string(),
                ),
            ],
            config: Some(format!(
                "{}[commands.python3]\naction_types = [\"python\"]\ncapabilities = [\"PythonExecute\"]\nprofile = \"python-kill\"\n",
                config(0, SOCKET)
            )),
            ..Default::default()
        });
        let r = py(&d, FLOOD_THEN_EXIT, json!({"timeout_seconds": 20})).await;
        assert_eq!(r.status, 200, "{rt}: {}", brief(&r));
        assert_eq!(out(&r).len(), 1 << 20, "{rt}");
        assert_eq!(r.json["stdout_truncated"], true, "{rt}");
        assert_eq!(
            r.json["killed_reason"],
            "output_limit",
            "{rt}: {}",
            brief(&r)
        );
        assert_eq!(r.json["success"], false, "{rt}");
        assert!(
            !r.json["stderr"]
                .as_str()
                .unwrap_or_default()
                .contains("flood over"),
            "{rt}: stopped at the cap, not at its end"
        );
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_kill_everything_and_orphans_are_reaped() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("timeouts_kill_everything_and_orphans_are_reaped");
    for rt in RUNTIMES {
        let d = start(rt, 1);
        let mut log = Vec::new();

        // Timeout: 408 with the partial output, and the container is gone.
        let r = py(
            &d,
            "print('partial', flush=True)\nimport time; time.sleep(60)",
            json!({"timeout_seconds": 2}),
        )
        .await;
        assert_eq!(r.status, 408, "{rt}: {}", r.text);
        assert_eq!(r.json["error_type"], "ExecutionTimeout");
        assert_eq!(out(&r), "partial\n", "{rt}: {}", r.text);
        let id = container_of(&d, r.json["exec_id"].as_str().unwrap_or_default(), &mut log);
        wait_until(
            &format!("{rt}: timed-out container removed"),
            Duration::from_secs(15),
            || !container_exists(&id),
        );

        // A setsid + double-forked survivor dies with its container, after a normal exit and
        // after a timeout.
        for (exit_how, timeout) in [("exits", 30), ("hangs", 2)] {
            let marker = format!("survivor-{}", uuid::Uuid::new_v4().simple());
            let code = format!(
                r#"
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", "{marker}"])
    os._exit(0)
time.sleep(0.5)
print("parent {exit_how}", flush=True)
if "{exit_how}" == "hangs":
    time.sleep(60)
"#
            );
            let r = py(&d, &code, json!({"timeout_seconds": timeout})).await;
            assert!(
                out(&r).contains(&format!("parent {exit_how}")),
                "{rt}: {}",
                r.text
            );
            let id = container_of(&d, r.json["exec_id"].as_str().unwrap_or_default(), &mut log);
            // A run that ended by itself leaves a runc container to serve again (pool_reuse, on
            // by default): its survivor is killed all the same, checked below.
            if !(rt == "runc" && exit_how == "exits") {
                wait_until(
                    &format!("{rt}: container of the {exit_how} run removed"),
                    Duration::from_secs(15),
                    || !container_exists(&id),
                );
            }
            if rt == "runc" {
                wait_until(
                    &format!("{rt}: survivor {marker} gone"),
                    Duration::from_secs(10),
                    || host_processes(&marker).is_empty(),
                );
            }
        }

        // Zombies: an orphan that exits is reaped by the container's PID 1.
        let code = r#"
import os, time
pid = os.fork()
if pid == 0:
    if os.fork() == 0:
        time.sleep(0.3); os._exit(0)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(1.5)
z = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                z.append(p)
        except OSError:
            pass
print("zombies", len(z))
"#;
        let r = py(&d, code, json!({})).await;
        assert_eq!(out(&r), "zombies 0\n", "{rt}: {}", r.text);
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_runs_under_gvisor_and_runc_does_not() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("gvisor_runs_under_gvisor_and_runc_does_not");
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    for rt in RUNTIMES {
        let d = start(rt, 0);
        let r = sh(&d, "cat", &["/proc/version"]).await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        let version = out(&r);
        let r = py(&d, "import ctypes\nb = ctypes.create_string_buffer(1 << 16)\nn = ctypes.CDLL(None).klogctl(3, b, len(b))\nprint(b.raw[:max(n, 0)].decode(errors='replace'))", json!({})).await;
        let dmesg = out(&r).to_string();
        if rt == "gvisor" {
            assert!(
                version.contains("4.4.0") || dmesg.contains("gVisor"),
                "not gVisor: {version} / {dmesg}"
            );
            assert!(
                !version.contains(host_kernel.trim()),
                "gVisor showed the host kernel: {version}"
            );
        } else {
            assert!(
                version.contains(host_kernel.trim()),
                "runc should show the host kernel {host_kernel}: {version}"
            );
            assert!(!dmesg.contains("gVisor"), "{dmesg}");
        }
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pool_serves_hits_and_pool_off_still_works() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("warm_pool_serves_hits_and_pool_off_still_works");
    for rt in RUNTIMES {
        let backend = if rt == "runc" { "docker" } else { "gvisor" };
        let d = start_one_per_run(rt, 2);
        let instance = instance_of(&d);
        // First use of the profile is a miss that creates its pool.
        let r = sh(&d, "echo", &["warm"]).await;
        assert_eq!(out(&r), "warm\n", "{rt}: {}", r.text);
        let idle = format!(
            "executor_pool_idle_containers{{backend=\"{backend}\",profile=\"shell-readonly\"}} 2"
        );
        let t = Instant::now();
        loop {
            let m = d.get("/metrics").await.text;
            if m.contains(&idle) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{rt}: pool never filled: {m}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let pooled = pool_containers(&instance);
        assert_eq!(pooled.len(), 2, "{rt}: the idle containers");
        for _ in 0..3 {
            let r = sh(&d, "echo", &["hot"]).await;
            assert_eq!(out(&r), "hot\n", "{rt}: {}", r.text);
        }
        let m = d.get("/metrics").await.text;
        assert!(
            m.contains(&format!(
                "executor_pool_events_total{{backend=\"{backend}\",event=\"hit\"}}"
            )),
            "{rt}: {m}"
        );
        assert!(
            m.contains(&format!(
                "executor_pool_events_total{{backend=\"{backend}\",event=\"miss\"}}"
            )),
            "{rt}: {m}"
        );
        // The idle containers that served runs are gone; none came back to the pool.
        wait_until(
            &format!("{rt}: used pool containers removed"),
            Duration::from_secs(15),
            || {
                let now = containers(&format!("executor-arm.instance={instance}"));
                pooled.iter().all(|p| !now.contains(p))
            },
        );
        let ready = d.get("/ready").await;
        assert_eq!(ready.status, 200, "{rt}: {}", ready.text);
        finish(d);

        let d = start_one_per_run(rt, 0);
        let r = sh(&d, "echo", &["cold"]).await;
        assert_eq!(out(&r), "cold\n", "{rt}: {}", r.text);
        assert!(
            !d.get("/metrics").await.text.contains("event=\"hit\""),
            "{rt}: pool off serves no hits"
        );
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_of_a_killed_daemon_are_removed_at_restart() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("orphans_of_a_killed_daemon_are_removed_at_restart");
    let mut d = start("runc", 1);
    let old = instance_of(&d);
    let mut log = Vec::new();
    let base = d.base.clone();
    let svc = d.service_token();
    let cap = d.cap_all();
    let body = json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(120)"], "capability_token": cap});
    let running = tokio::spawn(async move {
        let _ = reqwest::Client::new()
            .post(format!("{base}/execute"))
            .bearer_auth(svc)
            .json(&body)
            .send()
            .await;
    });
    // Wait until the run has its container, then kill -9 the daemon mid-run.
    let id = wait_for_assigned(&d, &mut log, 1, common::wait::CLEANUP, |_| true)[0].clone();
    if let Some(mut child) = d.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    running.abort();
    assert!(
        container_exists(&id),
        "the run's container (stopped with its daemon, see containers_die_with_their_daemon) is \
         still there to be swept"
    );
    assert!(!containers(&format!("executor-arm.instance={old}")).is_empty());

    // A new daemon on this host removes them all at startup.
    let d2 = start("runc", 1);
    wait_until(
        "orphans of the killed daemon removed",
        Duration::from_secs(30),
        || containers(&format!("executor-arm.instance={old}")).is_empty(),
    );
    let r = sh(&d2, "echo", &["after"]).await;
    assert_eq!(out(&r), "after\n", "{}", r.text);
    finish(d2);
    drop(d);
}

/// A unix-socket proxy in front of dockerd that a test can cut and restore, standing in for a
/// dockerd that dies and comes back (without killing the machine's real dockerd).
struct EngineProxy {
    path: PathBuf,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl EngineProxy {
    fn start(path: &Path) -> EngineProxy {
        EngineProxy::start_delaying_creates(path, Duration::ZERO)
    }

    /// A proxy that holds every container-create request for `delay` before passing it on, as
    /// a loaded dockerd would take that long: a test can act while a launch is in flight.
    fn start_delaying_creates(path: &Path, delay: Duration) -> EngineProxy {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path).expect("bind proxy");
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    break;
                };
                conns.spawn(async move {
                    let Ok(mut upstream) = tokio::net::UnixStream::connect(SOCKET).await else {
                        return;
                    };
                    if delay.is_zero() {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        return;
                    }
                    let (mut from_client, mut to_client) = client.into_split();
                    let (mut from_engine, mut to_engine) = upstream.into_split();
                    let requests = async {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from_client.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            let chunk = &buf[..n];
                            if chunk.windows(18).any(|w| w == b"/containers/create") {
                                tokio::time::sleep(delay).await;
                            }
                            if to_engine.write_all(chunk).await.is_err() {
                                break;
                            }
                        }
                        let _ = to_engine.shutdown().await;
                    };
                    let answers = tokio::io::copy(&mut from_engine, &mut to_client);
                    let _ = tokio::join!(requests, answers);
                });
            }
        });
        EngineProxy {
            path: path.to_path_buf(),
            task: Some(task),
        }
    }

    /// Drops the listener and every connection through it.
    fn cut(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_loss_fails_the_run_and_leaves_nothing_once_back() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("engine_loss_fails_the_run_and_leaves_nothing_once_back");
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("engine.sock");
    let mut proxy = EngineProxy::start(&sock);
    let d = start_with_socket("runc", 1, sock.to_str().unwrap_or_default());
    let instance = instance_of(&d);
    let mut log = Vec::new();
    let r = sh(&d, "echo", &["through", "proxy"]).await;
    assert_eq!(out(&r), "through proxy\n", "{}", r.text);

    let run = py(
        &d,
        "print('started', flush=True)\nimport time; time.sleep(60)",
        json!({"timeout_seconds": 120}),
    );
    let cut = async {
        let t = Instant::now();
        loop {
            if assigned_containers(&d, &mut log).len() >= 2 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the long run never got a container"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        proxy.cut();
    };
    let (r, ()) = tokio::join!(run, cut);
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json["error_type"], "SandboxUnavailable", "{}", r.text);
    assert!(r.text.contains("docker engine"), "{}", r.text);
    let ready = d.get("/ready").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
    assert!(
        !containers(&format!("executor-arm.instance={instance}")).is_empty(),
        "the real engine still runs the cut-off container"
    );

    // The engine is back: everything of that run goes, the daemon serves again.
    let _proxy = EngineProxy::start(&sock);
    wait_until(
        "containers of the lost run removed",
        Duration::from_secs(30),
        || {
            let ids = containers(&format!("executor-arm.instance={instance}"));
            ids.iter().all(|id| {
                docker(&["inspect", "--format", "{{.Name}}", id])
                    .is_some_and(|n| n.contains("executor-arm-pool-"))
            })
        },
    );
    let t = Instant::now();
    loop {
        let r = sh(&d, "echo", &["back"]).await;
        if out(&r) == "back\n" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "daemon did not recover: {}",
            r.text
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    finish(d);
}

/// A daemon told to stop while its pool is launching a container (each run's container is
/// replaced as it is handed out) waits for that launch before its last sweep: no container is
/// created after the daemon is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_launch_in_flight_at_shutdown_leaves_no_container() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_pool_launch_in_flight_at_shutdown_leaves_no_container");
    let delay = Duration::from_secs(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("engine.sock");
    let _proxy = EngineProxy::start_delaying_creates(&sock, delay);
    let mut d = start_with_socket("runc", 1, sock.to_str().unwrap_or_default());
    let label = format!("executor-arm.instance={}", instance_of(&d));
    // The first run makes the pool; the second takes its container, which starts a refill
    // whose create the proxy holds back.
    for _ in 0..2 {
        let r = sh(&d, "echo", &["x"]).await;
        assert_eq!(out(&r), "x\n", "{}", r.text);
    }
    let code = tokio::task::spawn_blocking(move || d.stop())
        .await
        .expect("stop");
    assert_eq!(code, Some(0), "the daemon did not exit by itself");
    // A create released after the daemon's last sweep would land by now.
    tokio::time::sleep(delay + Duration::from_secs(1)).await;
    assert_nothing_left(&label, Duration::from_secs(30));
}

/// A session's container launched for its creation (no warm pool) is still being created when
/// the shutdown grace runs out: the exit waits for that launch too, so the container does not
/// outlive the daemon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_launch_in_flight_when_the_grace_ends_leaves_no_container() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_cold_launch_in_flight_when_the_grace_ends_leaves_no_container");
    let delay = Duration::from_secs(4);
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("engine.sock");
    let _proxy = EngineProxy::start_delaying_creates(&sock, delay);
    let config = format!(
        "{}\n[server]\nshutdown_grace_seconds = 1\n",
        config(0, sock.to_str().unwrap_or_default())
    );
    let mut d = Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), "runc".into())],
        config: Some(config),
        ..Default::default()
    });
    let label = format!("executor-arm.instance={}", instance_of(&d));
    let svc = format!("Bearer {}", d.service_token());
    let body = json!({"language": "bash", "capability_token": d.cap_all()}).to_string();
    let url = format!("{}/v1/sandbox/sessions", d.base);
    let client = d.client.clone();
    let create = tokio::spawn(async move {
        client
            .post(url)
            .header("authorization", svc)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
    });
    // The creation is waiting for its container (the proxy holds the create back).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let code = tokio::task::spawn_blocking(move || d.stop())
        .await
        .expect("stop");
    assert_eq!(code, Some(0), "the daemon did not exit by itself");
    let _ = create.await;
    // A create released after the daemon's last sweep would land by now.
    tokio::time::sleep(delay).await;
    assert_nothing_left(&label, Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_engine_is_not_ready_and_refuses_with_503() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("unreachable_engine_is_not_ready_and_refuses_with_503");
    let d = start_with_socket("runc", 1, "/nonexistent/docker.sock");
    let ready = d.get("/ready").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
    assert!(
        ready.text.contains("docker engine unreachable"),
        "{}",
        ready.text
    );
    let r = sh(&d, "echo", &["x"]).await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json["error_type"], "SandboxUnavailable", "{}", r.text);
    assert!(r.text.contains("docker engine unreachable"), "{}", r.text);
    finish(d);
}

/// Writes a forged report onto the supervisor's stdout (the attach stream) through
/// `/proc/1/fd/1`, then exits 7.
const FORGE: &str = r#"
import os, struct, sys
kind = sys.argv[1].encode()
def frame(t, p): return t + struct.pack(">I", len(p)) + p
forged = frame(b"o", b"forged output\n") + frame(b"x", b"exit 0 0 - 0 0") if kind == b"x" else frame(b"u", b"forged: egress relay cannot reach")
try:
    fd = os.open("/proc/1/fd/1", os.O_WRONLY)
    os.write(fd, forged)
    print("report channel written")
except OSError as e:
    print("report channel refused", e.errno)
print("real output", flush=True)
sys.exit(7)
"#;

/// Reaches for the supervisor (PID 1) and for syscalls the sandbox's seccomp profile refuses.
const PROBE_SUPERVISOR: &str = r#"
import ctypes, os, signal, socket, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def call(what, r):
    print(what, "refused" if r < 0 else "ALLOWED", flush=True)
for p, mode in [("/proc/1/mem", os.O_RDONLY), ("/proc/1/fd/1", os.O_WRONLY)]:
    try:
        os.close(os.open(p, mode)); print(p, "ALLOWED")
    except OSError as e:
        print(p, "refused")
call("ptrace attach 1", libc.ptrace(16, 1, 0, 0))
call("ptrace seize 1", libc.ptrace(0x4206, 1, 0, 0))
# ptrace of our own child: only the seccomp profile refuses it.
child = os.fork()
if child == 0:
    time.sleep(30); os._exit(0)
call("ptrace seize child", libc.ptrace(0x4206, child, 0, 0))
os.kill(child, signal.SIGKILL); os.waitpid(child, 0)
params = ctypes.create_string_buffer(120)
call("io_uring_setup", libc.syscall(425, 1, params))
call("unshare user", libc.unshare(0x10000000))
try:
    socket.socket(40, socket.SOCK_STREAM).close(); print("vsock ALLOWED")
except OSError as e:
    print("vsock refused")
t = threading.Thread(target=lambda: print("thread ran", flush=True)); t.start(); t.join()
try:
    os.kill(1, signal.SIGKILL); print("kill 1 ALLOWED", flush=True)
except OSError as e:
    print("kill 1 refused", flush=True)
time.sleep(0.5)
print("still here", flush=True)
raise SystemExit(3)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_cannot_forge_its_report_or_reach_the_supervisor() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("the_command_cannot_forge_its_report_or_reach_the_supervisor");
    for rt in RUNTIMES {
        let d = start(rt, 1);
        // A forged output and exit frame: the run's real outcome is reported.
        let r = d
            .exec(
                json!({"action_type": "python", "command": "python3", "args": ["-c", FORGE, "x"]}),
            )
            .await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(
            (&r.json["success"], &r.json["exit_code"], &r.json["outcome"]),
            (&json!(false), &json!(7), &json!("failed")),
            "{rt}: {}",
            r.text
        );
        assert_eq!(
            out(&r),
            "report channel refused 13\nreal output\n",
            "{rt}: {}",
            r.text
        );
        // A forged "egress unavailable" frame would have made the run a 503.
        let r = d
            .exec(
                json!({"action_type": "python", "command": "python3", "args": ["-c", FORGE, "u"]}),
            )
            .await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(r.json["exit_code"], 7, "{rt}: {}", r.text);

        // No trace, no memory, no descriptor, no signal: and the refused syscalls stay refused.
        let r = py(&d, PROBE_SUPERVISOR, json!({})).await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        let o = out(&r);
        for line in [
            "/proc/1/mem refused",
            "/proc/1/fd/1 refused",
            "ptrace attach 1 refused",
            "ptrace seize 1 refused",
            "ptrace seize child refused",
            "io_uring_setup refused",
            "unshare user refused",
            "vsock refused",
            "thread ran",
            "kill 1 refused",
            "still here",
        ] {
            assert!(o.lines().any(|l| l == line), "{rt}: no '{line}' in: {o}");
        }
        assert!(!o.contains("ALLOWED"), "{rt}: {o}");
        assert_eq!(r.json["exit_code"], 3, "{rt}: {}", r.text);
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_die_with_their_daemon() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("containers_die_with_their_daemon");
    for rt in RUNTIMES {
        let mut d = start(rt, 1);
        let instance = instance_of(&d);
        let label = format!("executor-arm.instance={instance}");
        let mut log = Vec::new();
        // One run within its timeout, one far from it: only the daemon's death can end the
        // second one in time.
        let mut runs = Vec::new();
        for (sleep, timeout) in [(60, 15), (250, 280)] {
            let (base, svc, cap) = (d.base.clone(), d.service_token(), d.cap_all());
            let code = format!("import time; time.sleep({sleep})");
            let body = json!({"action_type": "python", "command": "python3", "args": ["-c", code],
                              "timeout_seconds": timeout, "capability_token": cap});
            runs.push(tokio::spawn(async move {
                let _ = reqwest::Client::new()
                    .post(format!("{base}/execute"))
                    .bearer_auth(svc)
                    .json(&body)
                    .send()
                    .await;
            }));
        }
        let ids = wait_for_assigned(&d, &mut log, 2, common::wait::CLEANUP, |ids| {
            let running = running_containers(&label);
            ids.iter().all(|id| running.contains(id))
        });
        // Let the commands start, then kill -9 the daemon and never restart it.
        tokio::time::sleep(Duration::from_secs(2)).await;
        if let Some(mut child) = d.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for r in runs {
            r.abort();
        }
        wait_until(
            &format!("{rt}: the runs' containers {ids:?} and the idle one stopped"),
            Duration::from_secs(30),
            || running_containers(&label).is_empty(),
        );
        remove_all(&label);
        assert!(containers(&label).is_empty() && volumes(&label).is_empty());
        drop(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_limit_covers_workdir_and_tmp_together() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("the_disk_limit_covers_workdir_and_tmp_together");
    // The python profile's disk_mb is 100: 51 MiB fit in one place, not in both.
    let code = r#"
import os
block = b"x" * (1 << 20)
for path in ["/work/a", "/tmp/b"]:
    try:
        with open(path, "wb") as f:
            for _ in range(51):
                f.write(block)
        print(path, "written")
    except OSError as e:
        print(path, "refused", e.errno)
"#;
    for rt in RUNTIMES {
        let d = start(rt, 0);
        let r = py(&d, code, json!({})).await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(
            out(&r),
            "/work/a written\n/tmp/b refused 28\n",
            "{rt}: {}",
            r.text
        );
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_volumes_go_with_their_containers() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("disk_volumes_go_with_their_containers");
    for rt in RUNTIMES {
        let d = start_one_per_run(rt, 1);
        let label = format!("executor-arm.instance={}", instance_of(&d));
        for _ in 0..2 {
            let r = sh(&d, "echo", &["x"]).await;
            assert_eq!(out(&r), "x\n", "{rt}: {}", r.text);
        }
        // While the daemon runs: one container and one volume per idle pool container, nothing
        // of the runs.
        wait_until(
            &format!("{rt}: only the idle container and its volume left"),
            Duration::from_secs(60),
            || containers(&label).len() == 1 && volumes(&label).len() == 1,
        );
        finish(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_directories_of_a_dead_daemon_go_at_startup() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("egress_directories_of_a_dead_daemon_go_at_startup");
    let root = tempfile::tempdir().expect("tempdir");
    let ns: String = std::fs::read_link("/proc/self/ns/pid")
        .expect("pid ns")
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    let host: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    // A daemon that cannot be alive (4194304 is above any pid_max) and one that is: this test.
    let stat = std::fs::read_to_string("/proc/self/stat").expect("stat");
    let start_time = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19))
        .expect("start time");
    let dead = root.path().join(format!("docker.4194304.1.{ns}.{host}"));
    let live = root.path().join(format!(
        "gvisor.{}.{start_time}.{ns}.{host}",
        std::process::id()
    ));
    for dir in [&dead, &live] {
        std::fs::create_dir_all(dir.join("c1")).expect("plant");
    }
    let d = Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), "runc".into())],
        config: Some(format!(
            "{}egress_dir = \"{}\"\n",
            config(0, SOCKET),
            root.path().display()
        )),
        ..Default::default()
    });
    // Before any request.
    assert!(!dead.exists(), "the dead daemon's directory is still there");
    assert!(live.exists(), "a live daemon's directory was removed");
    finish(d);
}

/// A fork bomb, twenty times in a row: every answer is a contained run (200 or 408), never a
/// 5xx, and the daemon serves the next request.
async fn fork_bomb_twenty_times(rt: &str) {
    let d = start(rt, 1);
    let bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass";
    let mut seen = Vec::new();
    for i in 0..20 {
        let r = py(&d, bomb, json!({"timeout_seconds": 5})).await;
        assert!(
            r.status == 200 || r.status == 408,
            "{rt}: bomb {i}: {} {}",
            r.status,
            r.text
        );
        if r.status == 200 {
            assert_eq!(r.json["success"], false, "{rt}: bomb {i}: {}", r.text);
            assert!(
                r.json["killed_reason"].is_string(),
                "{rt}: bomb {i}: a contained run names what stopped it: {}",
                r.text
            );
        }
        seen.push(format!("{}:{}", r.status, r.json["killed_reason"]));
    }
    let r = sh(&d, "echo", &["after", "the", "bombs"]).await;
    assert_eq!(out(&r), "after the bombs\n", "{rt}: {}", r.text);
    let out = common::audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "{rt}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{rt}: fork bomb answers: {seen:?}");
    finish(d);
}

/// A burst far over a container backend's 8 slots waits in its queue instead of being refused.
/// The queue's wait limit is raised above the default 30 s: on a 2-vCPU machine gVisor drains
/// about 7 requests a second, so the last of 200 may wait that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_two_hundred_requests_is_absorbed_on_each_runtime() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_burst_of_two_hundred_requests_is_absorbed_on_each_runtime");
    for rt in RUNTIMES {
        let d = Daemon::start_with(Opts {
            env: vec![("SANDBOX_RUNTIME".into(), rt.into())],
            config: Some(format!(
                "{}[server.queue]\nmax_wait_ms = 240000\n",
                config(2, SOCKET)
            )),
            ..Default::default()
        });
        let backend = if rt == "runc" { "docker" } else { "gvisor" };
        let took = common::assert_burst_absorbed(&d, backend, 200).await;
        eprintln!("{rt}: 200 requests at once answered in {took:?}");
        finish(d);
    }
}

/// One test for both runtimes, one after the other: two bombs at once would only measure how
/// long a loaded dockerd takes to remove their containers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_twenty_times_is_contained_every_time() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_fork_bomb_twenty_times_is_contained_every_time");
    for rt in RUNTIMES {
        fork_bomb_twenty_times(rt).await;
    }
}

/// Starts `code` (python3 -c, the marker in its command line) as an async run; its exec_id.
async fn start_async(d: &Daemon, code: &str, marker: &str) -> String {
    let r = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", format!("{code}\n# {marker}")], "async": true}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    r.json["exec_id"].as_str().expect("exec_id").to_string()
}

async fn cancel_run(d: &Daemon, exec_id: &str, grace: u64) -> common::Resp {
    let svc = d.service_token();
    d.post(
        &format!("/v1/executions/{exec_id}/cancel"),
        &[("authorization", &format!("Bearer {svc}"))],
        json!({"grace_seconds": grace}).to_string(),
    )
    .await
}

/// Follows the run's stream until its stdout holds `want` (bounded): a run that printed it is
/// past that point of its script.
async fn wait_for_stdout(d: &Daemon, exec_id: &str, want: &str) {
    let resp = d
        .client
        .get(format!("{}/v1/executions/{exec_id}/stream", d.base))
        .header("authorization", format!("Bearer {}", d.service_token()))
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200, "the stream of {exec_id}");
    let mut events = common::SseReader {
        resp,
        buf: String::new(),
    };
    let mut out = String::new();
    let read = async {
        while let Some(e) = events.next().await {
            if e.event == "stdout" {
                out.push_str(e.data["data"].as_str().unwrap_or_default());
                if out.contains(want) {
                    return true;
                }
            }
        }
        false
    };
    let seen = tokio::time::timeout(common::wait::CLEANUP, read).await;
    assert!(
        seen == Ok(true),
        "{exec_id} never printed {want:?} (its stream ended, or {:?} passed): {out:?}",
        common::wait::CLEANUP
    );
}

/// Polls the run until it finished (bounded); its result.
async fn finished_result(d: &Daemon, exec_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = d.get_authorized(&format!("/v1/executions/{exec_id}")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.json["status"] == "finished" {
            return r.json["result"].clone();
        }
        assert!(Instant::now() < deadline, "{exec_id} still running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn container_running(id: &str) -> bool {
    docker(&["inspect", "--format", "{{.State.Running}}", id]).is_some_and(|s| s.trim() == "true")
}

/// A cancel reaches every process in the container through its supervisor: a command that
/// handles SIGTERM ends on its own terms within the grace; one that ignores it, with a
/// double-forked setsid child, is killed with everything when the grace is over. Both end
/// `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_terminates_then_kills_a_container_run() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_cancel_terminates_then_kills_a_container_run");
    for rt in RUNTIMES {
        let d = start(rt, 1);
        let mut log = Vec::new();

        // Handles SIGTERM: what it writes on the way out is in the result.
        let m = format!("cancel-{}", uuid::Uuid::new_v4().simple());
        let polite = "import signal, sys, time\n\
                      def bye(*_):\n    print('cleaned up', flush=True)\n    sys.exit(0)\n\
                      signal.signal(signal.SIGTERM, bye)\n\
                      print('ready', flush=True)\n\
                      while True: time.sleep(0.05)";
        let exec_id = start_async(&d, polite, &m).await;
        container_of(&d, &exec_id, &mut log);
        // Cancel only once the handler is installed.
        wait_for_stdout(&d, &exec_id, "ready\n").await;
        let r = cancel_run(&d, &exec_id, 30).await;
        assert_eq!(r.status, 202, "{rt}: {}", r.text);
        let result = finished_result(&d, &exec_id).await;
        assert_eq!(result["outcome"], "cancelled", "{rt}: {result}");
        assert_eq!(result["killed_reason"], "cancelled", "{rt}: {result}");
        assert_eq!(result["stdout"], "ready\ncleaned up\n", "{rt}: {result}");
        assert_eq!(result["exit_code"], 0, "{rt}: {result}");

        // Ignores SIGTERM, with a daemonised grandchild.
        let m = format!("cancel-{}", uuid::Uuid::new_v4().simple());
        let stubborn = "import os, signal, time\n\
                        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n\
                        if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True: time.sleep(1)\n    os._exit(0)\n\
                        os.wait()\n\
                        print('forked', flush=True)\n\
                        while True: time.sleep(1)";
        let exec_id = start_async(&d, stubborn, &m).await;
        let container = container_of(&d, &exec_id, &mut log);
        if rt == "runc" {
            let deadline = Instant::now() + Duration::from_secs(30);
            while host_processes(&m).len() < 2 {
                assert!(
                    Instant::now() < deadline,
                    "runc: the run's processes never showed up"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        } else {
            // The intermediate child has exited: the grandchild is up.
            wait_for_stdout(&d, &exec_id, "forked\n").await;
        }
        let grace = 2;
        let cancelled_at = Instant::now();
        let r = cancel_run(&d, &exec_id, grace).await;
        assert_eq!(r.status, 202, "{rt}: {}", r.text);
        // Gone after the grace, seen from the host: runc's processes are host processes; a
        // gVisor sandbox's are not, so its container must have stopped. A bound, not a timing
        // check: they ignore SIGTERM and would never end unkilled.
        let bound = common::wait::CLEANUP;
        while !host_processes(&m).is_empty() || container_running(&container) {
            assert!(
                cancelled_at.elapsed() < bound,
                "{rt}: still running {:?} after the cancel",
                cancelled_at.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            cancelled_at.elapsed() >= Duration::from_secs(grace),
            "{rt}: killed before its grace was over"
        );
        let result = finished_result(&d, &exec_id).await;
        assert_eq!(result["outcome"], "cancelled", "{rt}: {result}");
        assert_eq!(result["killed_reason"], "cancelled", "{rt}: {result}");
        finish(d);
    }
}

/// Each container runs as a host uid of its own (`sandbox.local.uid_first`/`uid_count`), so the
/// kernel's per-user counters are its own: run A opens inotify instances until the kernel
/// refuses one (under runc, `fs.inotify.max_user_instances` of its uid) and holds them; run B,
/// meanwhile, in another container, still gets one. Under gVisor the counters are the sentry's
/// own anyway; the uids are checked there all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_exhausting_its_inotify_instances_leaves_another_its_own() {
    let _serial = common::docker::one_at_a_time().await;
    require_docker("a_container_exhausting_its_inotify_instances_leaves_another_its_own");
    let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .expect("max_user_instances")
        .trim()
        .parse()
        .expect("a number");
    let hog = r#"
import ctypes, json, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        err = ctypes.get_errno()
        break
    fds.append(fd)
print(json.dumps({"count": len(fds), "errno": err, "uid": os.getuid()}), flush=True)
time.sleep(8)
"#;
    let other = r#"
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(json.dumps({"fd": fd, "errno": ctypes.get_errno() if fd < 0 else 0, "uid": os.getuid()}))
"#;
    for rt in RUNTIMES {
        // Two warm containers: A and B run side by side.
        let d = start(rt, 2);
        let mut a = common::open_stream(
            &d,
            json!({"action_type": "python", "command": "python3", "args": ["-c", hog], "timeout_seconds": 60}),
        )
        .await;
        // B starts only once A printed its count: A then holds every instance it could get.
        let mut seen = String::new();
        let printed = async {
            while let Some(e) = a.next().await {
                if e.event == "stdout" {
                    seen.push_str(e.data["data"].as_str().unwrap_or_default());
                    if seen.ends_with('\n') {
                        return true;
                    }
                }
            }
            false
        };
        let held = tokio::time::timeout(common::wait::CLEANUP, printed).await;
        assert_eq!(held, Ok(true), "{rt}: run A printed {seen:?}");
        let hog_result: Value = serde_json::from_str(seen.trim()).expect("A's JSON line");
        assert_eq!(
            hog_result["errno"],
            json!(libc::EMFILE),
            "{rt}: {hog_result}"
        );
        if rt == "runc" {
            // The kernel's per-uid limit stopped A, not its descriptor limit (nofile 256).
            assert_eq!(hog_result["count"], json!(limit), "{rt}: {hog_result}");
        }
        let b = py(&d, other, json!({})).await;
        assert_eq!(b.status, 200, "{rt}: {}", b.text);
        let b_result: Value = serde_json::from_str(out(&b).trim()).expect("B's JSON line");
        assert!(
            b_result["fd"].as_i64().is_some_and(|fd| fd >= 0),
            "{rt}: B's inotify_init1 failed while A held its instances: {b_result} (A: {hog_result})"
        );
        let (uid_a, uid_b) = (
            hog_result["uid"].as_u64().expect("uid of A"),
            b_result["uid"].as_u64().expect("uid of B"),
        );
        assert_ne!(uid_a, uid_b, "{rt}");
        for uid in [uid_a, uid_b] {
            assert!((200_000..265_536).contains(&uid), "{rt}: uid {uid}");
        }
        // A ends by itself once it has slept.
        let rest = tokio::time::timeout(common::wait::CLEANUP, a.rest()).await;
        assert!(rest.is_ok(), "{rt}: run A's stream did not end");
        finish(d);
    }
}

/// The file holding container `id`'s CPU quota: `cpu.cfs_quota_us` of cgroup v1's cpu controller,
/// or `cpu.max` on cgroup v2, found from its init's `/proc/PID/cgroup`.
fn cpu_quota_file(id: &str) -> std::path::PathBuf {
    let pid = docker(&["inspect", "--format", "{{.State.Pid}}", id]).expect("docker inspect");
    let cgroups = std::fs::read_to_string(format!("/proc/{}/cgroup", pid.trim())).expect("cgroup");
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next(), fields.next(), fields.next());
        let (Some(controllers), Some(path)) = (controllers, path) else {
            continue;
        };
        if controllers.split(',').any(|c| c == "cpu") {
            return format!("/sys/fs/cgroup/{controllers}{path}/cpu.cfs_quota_us").into();
        }
        if controllers.is_empty()
            && std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
        {
            return format!("/sys/fs/cgroup{path}/cpu.max").into();
        }
    }
    panic!("no CPU controller for container {id} in {cgroups}");
}

/// dockerd answers a removal of a container it is already removing with 409 "removal already in
/// progress" at once, while the first removal may still be killing the container's processes;
/// and the first removal itself fails with 500 "did not receive an exit event" when the processes
/// take longer than dockerd's 10 s to die (a few hundred busy ones under a 1% CPU quota do). The
/// engine's `remove` returns only once the container is gone: the daemon releases a container's
/// uid on that answer, and another sandbox must not get the uid while a process of this one can
/// still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_meeting_one_in_progress_returns_once_the_container_is_gone() {
    use executor_arm::sandbox::docker::engine::{BollardEngine, Engine};
    require_docker("a_removal_meeting_one_in_progress_returns_once_the_container_is_gone");
    let _serial = common::docker::one_at_a_time().await;
    let label = "executor-arm.test=removal-in-progress";
    let id = docker(&[
        "run",
        "-d",
        "--runtime=runc",
        "--network=none",
        "--cpus=1",
        "--pids-limit=4000",
        "--label",
        label,
        "--entrypoint",
        "sh",
        common::docker::IMAGE,
        "-c",
        "for i in $(seq 1 300); do (while :; do :; done) & done; wait",
    ])
    .expect("docker run")
    .trim()
    .to_string();
    /// Removes the container whatever the test's end.
    struct Remove(&'static str);
    impl Drop for Remove {
        fn drop(&mut self) {
            remove_all(self.0);
        }
    }
    let _remove = Remove(label);
    let engine = std::sync::Arc::new(BollardEngine::new(SOCKET));
    wait_until(
        "the container's 300 busy processes",
        Duration::from_secs(240),
        || docker(&["top", &id]).is_some_and(|top| top.lines().count() > 300),
    );
    // Started at one CPU so the processes come up quickly; squeezed to 1% so they die slower
    // than dockerd waits. 15 s into the removals, past dockerd's 10 s, the quota is lifted in the
    // container's cgroup (dockerd refuses `update` on a container marked for removal), so the
    // processes finish dying well inside the engine's own bound.
    docker(&["update", "--cpus=0.01", &id]).expect("docker update");
    let quota = cpu_quota_file(&id);
    let lift = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(15)).await;
        let unlimited = if quota.ends_with("cpu.max") {
            "max"
        } else {
            "-1"
        };
        std::fs::write(&quota, unlimited).expect("lift the CPU quota");
    });

    // Two removals 50 ms apart: dockerd answers the later one 409 while it kills the processes.
    // Each records whether the container still existed when its removal answered.
    let removal = |delay: Duration| {
        let (engine, id) = (engine.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let r = engine.remove(&id).await;
            let id2 = id.clone();
            let left = tokio::task::spawn_blocking(move || container_exists(&id2))
                .await
                .expect("docker inspect");
            (r, left)
        })
    };
    let (first, second) = (removal(Duration::ZERO), removal(Duration::from_millis(50)));
    let (first, second) = (first.await.expect("first"), second.await.expect("second"));
    lift.abort();
    assert!(
        first.0.is_ok() && second.0.is_ok(),
        "removals: first {:?}, second {:?}",
        first.0,
        second.0
    );
    assert!(
        !first.1 && !second.1,
        "a removal answered done while container {id} still existed (first: {}, second: {})",
        first.1,
        second.1
    );
}
