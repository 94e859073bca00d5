//! One-shot runs served again (runc; never under gVisor): a run of the same calling
//! service and profile lands in the container an earlier run ended in, scrubbed, and sees nothing
//! that run left; another service's run never does; a killed run's container never serves again.

mod common;

use common::docker::SOCKET;
use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use serde_json::{Value, json};

fn opts(runtime: &str) -> Opts {
    opts_with(runtime, 32)
}

fn opts_with(runtime: &str, max_uses: u32) -> Opts {
    let mut config = common::docker::config(1, SOCKET);
    config.push_str(&format!("pool_reuse = true\npool_max_uses = {max_uses}\n"));
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), runtime.into())],
        config: Some(config),
        ..Default::default()
    }
}

/// Runs `script` with `/bin/sh` (through the python profile) as the service `service` (a service token of that subject).
async fn sh(d: &Daemon, service: &str, script: &str, timeout: u64) -> common::Resp {
    let svc = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some(service.into()),
        ..Default::default()
    });
    // The python profile's interpreter runs the script with /bin/sh inside the sandbox.
    let runner =
        "import subprocess, sys\nsys.exit(subprocess.run(sys.argv[1], shell=True).returncode)";
    let body = json!({
        "action_type": "python",
        "command": "python3",
        "args": ["-c", runner, script],
        "timeout_seconds": timeout,
        "capability_token": d.cap_all(),
    });
    d.post(
        "/execute",
        &[("authorization", &format!("Bearer {svc}"))],
        body.to_string(),
    )
    .await
}

/// The `execution` audit line of the run answered by `r`, once the scrub-free part is written.
fn line(d: &Daemon, r: &common::Resp) -> Value {
    let exec_id = r.json["provenance"]["exec_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no exec_id: {}", r.text))
        .to_string();
    d.execution_line(&exec_id)
}

/// Leaves something in every place a run can reach, then checks the next run of the same
/// service lands in the same container and sees none of it.
const LEAVE: &str = r#"
set -e
echo "mode: $(stat -c %a .)"
echo left > ./left-in-workdir
echo left > /tmp/left-in-tmp
echo left > "$HOME/left-in-home"
mkdir -p ./locked/deeper && echo x > ./locked/deeper/f && chmod 000 ./locked/deeper ./locked
chmod 750 .
setsid sh -c 'sleep 600' </dev/null >/dev/null 2>&1 &
python3 -c '
import socket, os, time, sys
s = socket.socket(socket.AF_UNIX)
s.bind("\0executor-arm-left")
s.listen(1)
if os.fork() == 0:
    os.setsid()
    time.sleep(600)
' </dev/null >/dev/null 2>&1 &
python3 -c '
import fcntl, os, time
f = open("/tmp/held.lock", "w")
fcntl.flock(f, fcntl.LOCK_EX)
if os.fork() == 0:
    time.sleep(600)
' </dev/null >/dev/null 2>&1 &
python3 -c '
import os, struct
os.setxattr(".", "user.left", b"1")
# A default ACL: files made here later would be r-x for their owner, nothing for the others.
acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF) for tag, perm in [(1, 5), (4, 0), (0x20, 0)])
os.setxattr(".", "system.posix_acl_default", acl)
os.utime(".", (4102444800, 4102444800))
'
export LEFT_BEHIND=1
sleep 0.3
echo done
"#;

/// SysV shared memory and a POSIX message queue: refused in runc containers (the IPC sysctls).
const LEAVE_IPC: &str = r#"
if ipcmk -M 4096 >/dev/null 2>&1; then echo shm-made; else echo shm-refused; fi
python3 -c '
import ctypes, ctypes.util, os
rt = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
fd = rt.mq_open(b"/executor-arm-left", os.O_CREAT | os.O_RDWR, 0o600, None)
print("mq-made" if fd >= 0 else "mq-refused")
'
echo done
"#;

const LOOK: &str = r#"
# grep exits 1 when it keeps no line: the clean case.
ls -A . /tmp "$HOME" | grep -v '^$' | grep -v ':$' || true
echo "procs: $(for p in /proc/[0-9]*; do tr '\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c 'slee[p]')"
# grep -c prints 0 and exits 1 when none is found: the clean case.
grep -c executor-arm-left /proc/net/unix || true
echo "shm: $(tail -n +2 /proc/sysvipc/shm | grep -c .)"
echo "env: ${LEFT_BEHIND:-unset}"
python3 -c '
import ctypes, ctypes.util, os
rt = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
print("mq: found" if rt.mq_open(b"/executor-arm-left", os.O_RDWR) >= 0 else "mq: none")
'
echo "mode: $(stat -c %a .)"
python3 -c '
import os, time
open("probe", "w").close()
print("xattrs:", sorted(os.listxattr(".")), "probe mode:", oct(os.stat("probe").st_mode & 0o777), "future:", os.stat(".").st_mtime > time.time() + 3600)
'
"#;

async fn a_scope_sees_nothing_of_its_last_run(runtime: &str) {
    let d = Daemon::start_with(opts(runtime));
    let first = sh(&d, "svc-a", &format!("{LEAVE}{LEAVE_IPC}"), 30).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let said = first.json["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(said.ends_with("done\n"), "{}", first.text);
    let mode = said.lines().next().unwrap_or_default().to_string();
    // What the runtime let the run leave: on runc no SysV segment and no POSIX queue can be made.
    eprintln!("the first run said: {said}");
    let a = line(&d, &first);
    assert_eq!(a["container_uses"], json!(1), "{a}");
    // The scrub runs after the answer: the next run waits for nothing, and takes the container
    // once it is back (bounded).
    let mut seen = None;
    for _ in 0..50 {
        let r = sh(&d, "svc-a", LOOK, 30).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let l = line(&d, &r);
        if l["container_id"] == a["container_id"] {
            seen = Some((r, l));
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (r, l) = seen.expect("the scope's next runs never landed in its container");
    assert_eq!(l["container_uses"], json!(2), "{l}");
    let out = r.json["stdout"].as_str().unwrap_or_default().to_string();
    // Nothing in the workdir, /tmp or home; no process the last run started.
    let mut lines = out.lines();
    let first_line = lines.next().unwrap_or_default();
    assert!(first_line.starts_with("procs: "), "files were left: {out}");
    assert_eq!(first_line, "procs: 0", "processes were left: {out}");
    assert_eq!(
        lines.next(),
        Some("0"),
        "an abstract socket was left: {out}"
    );
    assert_eq!(lines.next(), Some("shm: 0"), "{out}");
    assert_eq!(lines.next(), Some("env: unset"), "{out}");
    assert_eq!(lines.next(), Some("mq: none"), "{out}");
    assert_eq!(lines.next(), Some(mode.as_str()), "{out}");
    assert_eq!(
        lines.next(),
        Some("xattrs: [] probe mode: 0o644 future: False"),
        "{out}"
    );
    // Another service never lands in it.
    let other = sh(&d, "svc-b", "true", 30).await;
    assert_eq!(other.status, 200, "{}", other.text);
    let o = line(&d, &other);
    assert_ne!(o["container_id"], a["container_id"], "{o}");
    assert_eq!(o["container_uses"], json!(1), "{o}");
}

/// A run killed at its timeout, one OOM-killed and one killed at the output cap discard their
/// containers: the scope's next runs never land in them. (The python profile here kills at the
/// output cap instead of truncating.)
async fn a_killed_run_never_serves_again(runtime: &str) {
    let profile = format!(
        "{}\n[output]\non_overflow = \"kill\"\n",
        common::shipped_profile("python")
    );
    let profiles = common::profiles_with(&[("python", profile)]);
    let mut o = opts(runtime);
    o.env.push((
        "EXECUTOR_ARM_PROFILES_DIR".into(),
        profiles.path().display().to_string(),
    ));
    let d = Daemon::start_with(o);
    let kills = [
        ("timeout", "sleep 30", 1),
        (
            "oom",
            "python3 -c 'b = [bytearray(64 << 20) for _ in range(32)]'",
            60,
        ),
        ("output cap", "yes xxxxxxxxxxxxxxxx", 60),
    ];
    for (how, script, timeout) in kills {
        let killed = sh(&d, "svc-a", script, timeout).await;
        let k = line(&d, &killed);
        match how {
            "timeout" => assert_eq!(killed.status, 408, "{how}: {}", killed.text),
            "oom" => assert_eq!(k["oom"], json!(true), "{how}: {k}"),
            _ => assert_eq!(k["killed_reason"], "output_limit", "{how}: {k}"),
        }
        assert!(k["container_id"].is_string(), "{how}: {k}");
        for _ in 0..3 {
            let r = sh(&d, "svc-a", "true", 30).await;
            assert_eq!(r.status, 200, "{how}: {}", r.text);
            let l = line(&d, &r);
            assert_ne!(l["container_id"], k["container_id"], "{how}: {l}");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }
}

/// A container serving one run after another reports each run's own memory peak: the kernel's
/// peak is reset before each run (cgroup v1 max_usage_in_bytes, v2 memory.peak).
async fn each_run_reports_its_own_memory_peak() {
    let d = Daemon::start_with(opts("runc"));
    let big = sh(
        &d,
        "svc-a",
        "python3 -c 'b = bytearray(96 << 20); print(len(b))'",
        60,
    )
    .await;
    assert_eq!(big.status, 200, "{}", big.text);
    let b = line(&d, &big);
    let big_kib = big.json["peak_memory_kib"]
        .as_u64()
        .unwrap_or_else(|| panic!("no peak: {}", big.text));
    assert!(big_kib >= 96 * 1024, "{}", big.text);
    // The next runs of the scope: one lands in the same container (its scrub done first).
    let mut small = None;
    for _ in 0..20 {
        let r = sh(&d, "svc-a", "true", 30).await;
        assert_eq!(r.status, 200, "{}", r.text);
        if line(&d, &r)["container_id"] == b["container_id"] {
            small = Some(r);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let small = small.expect("a later run in the same container");
    let small_kib = small.json["peak_memory_kib"]
        .as_u64()
        .unwrap_or_else(|| panic!("no peak: {}", small.text));
    assert!(
        small_kib < big_kib / 2,
        "the second run's peak ({small_kib} KiB) is the first one's ({big_kib} KiB)"
    );
}

/// A container serves at most `pool_max_uses` runs.
async fn a_container_serves_at_most_its_max_uses() {
    let d = Daemon::start_with(opts_with("runc", 2));
    let mut seen: std::collections::HashMap<String, u64> = Default::default();
    // The scrub runs after each answer, so a run may come before its container is back: runs go
    // on (bounded) until a container has served twice and six runs were made.
    for n in 1..=60 {
        let r = sh(&d, "svc-a", "true", 30).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let l = line(&d, &r);
        let uses = l["container_uses"].as_u64().expect("container_uses");
        assert!(uses <= 2, "{l}");
        *seen
            .entry(l["container_id"].as_str().unwrap().to_string())
            .or_default() += 1;
        if n >= 6 && seen.values().any(|n| *n == 2) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(seen.values().all(|n| *n <= 2), "{seen:?}");
    assert!(
        seen.values().any(|n| *n == 2),
        "no container served twice: {seen:?}"
    );
}

/// An MCP call without a capability token runs on the service token's own capabilities, which
/// name none of the service's callers: such runs never share a container. The same calls with a
/// capability token of their own do.
async fn service_granted_mcp_runs_never_share() {
    use rmcp::ServiceExt;
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

    let d = Daemon::start_with(opts("runc"));
    let token = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["ShellExecute".into()],
        ..Default::default()
    });
    let client = ()
        .serve(StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", d.base))
                .auth_header(token),
        ))
        .await
        .expect("initialize the MCP session");
    let cap = d.cap_all();
    let mut reused = false;
    for (n, with_cap) in [false, false, false, true, true, true, true, true, true]
        .into_iter()
        .enumerate()
    {
        let mut args = json!({"action_type": "shell", "command": "echo", "args": ["hi"]});
        if with_cap {
            args["capability_token"] = json!(cap);
        }
        let Value::Object(args) = args else {
            unreachable!("an object")
        };
        let r = client
            .call_tool(CallToolRequestParams::new("execute").with_arguments(args))
            .await
            .unwrap_or_else(|e| panic!("execute: {e}"));
        let v = r.structured_content.clone().expect("structuredContent");
        assert_eq!(v["stdout"], "hi\n", "{v}");
        let l = d.execution_line(v["exec_id"].as_str().expect("exec_id"));
        if with_cap {
            assert!(l["container_id"].is_string(), "{l}");
            reused |= l["container_uses"].as_u64() > Some(1);
        } else {
            assert!(l.get("container_id").is_none(), "run {n}: {l}");
        }
        // Time for a scrub: a container that could serve again would be back by then.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    assert!(reused, "no run with a capability token was served again");
    let _ = client.cancel().await;
}

mod gvisor {
    /// Under gVisor every run keeps a container of its own, `pool_reuse` or not.
    #[tokio::test(flavor = "multi_thread")]
    async fn runs_never_share_a_container() {
        let d = super::Daemon::start_with(super::opts("gvisor"));
        for _ in 0..3 {
            let r = super::sh(&d, "svc-a", "true", 30).await;
            assert_eq!(r.status, 200, "{}", r.text);
            let l = super::line(&d, &r);
            assert!(l.get("container_id").is_none(), "{l}");
        }
    }
}

mod docker {
    #[tokio::test(flavor = "multi_thread")]
    async fn a_scope_sees_nothing_of_its_last_run() {
        super::a_scope_sees_nothing_of_its_last_run("runc").await;
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn a_killed_run_never_serves_again() {
        super::a_killed_run_never_serves_again("runc").await;
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn a_container_serves_at_most_its_max_uses() {
        super::a_container_serves_at_most_its_max_uses().await;
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn each_run_reports_its_own_memory_peak() {
        super::each_run_reports_its_own_memory_peak().await;
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn service_granted_mcp_runs_never_share() {
        super::service_granted_mcp_runs_never_share().await;
    }
}
