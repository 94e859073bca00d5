//! dockerd restarts while a docker run is in flight. The only test of this binary: cargo runs
//! test binaries one after another, so no other test of this crate runs while dockerd is down.
//!
//! dockerd is restarted exactly as scripts/setup-docker.sh starts it (same binary, argv,
//! environment, working directory, log file and cgroups, read from the running process), and a
//! drop guard starts it again when the test fails half-way. Other users of the machine's dockerd
//! see it restart: run this test alone, when no other test's containers are running.

mod common;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::docker::{config, container_of, containers, finish, instance_of, require_docker};
use common::wait::wait_until;
use common::{Daemon, Opts, assert_runs_paired, audit_verify, pids_with_cmdline};
use serde_json::json;

/// dockerd stops its containers (10 s of grace each, in parallel) and containerd before it
/// exits; starting, it restores its state. Bounds, not expectations.
const STOP_BOUND: Duration = Duration::from_secs(90);
const START_BOUND: Duration = Duration::from_secs(120);

/// How the running dockerd was started.
#[derive(Clone, Debug)]
struct Dockerd {
    pid: i32,
    exe: PathBuf,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    /// Its stdout/stderr (setup-docker.sh appends both to DOCKERD_LOG).
    log: PathBuf,
    /// `cgroup.procs` files of its cgroups that differ from ours (joined before exec).
    cgroups: Vec<PathBuf>,
}

fn comm(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim().to_string())
}

/// The pid of the running dockerd, if any.
fn dockerd_pid() -> Option<i32> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .find(|p| comm(*p).as_deref() == Some("dockerd"))
}

fn nul_list(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// `N:controllers:path` lines of /proc/<pid>/cgroup, by controllers.
fn cgroup_paths(pid: &str) -> Vec<(String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctrls, path) = (p.next()?, p.next()?, p.next()?);
            Some((ctrls.to_string(), path.to_string()))
        })
        .collect()
}

impl Dockerd {
    fn running() -> Dockerd {
        let pid = dockerd_pid().expect("dockerd is not running (scripts/setup-docker.sh)");
        let proc = |f: &str| format!("/proc/{pid}/{f}");
        let argv = nul_list(&std::fs::read(proc("cmdline")).expect("dockerd cmdline"));
        let env = nul_list(&std::fs::read(proc("environ")).expect("dockerd environ"))
            .into_iter()
            .filter_map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        let ours = cgroup_paths("self");
        let cgroups = cgroup_paths(&pid.to_string())
            .into_iter()
            .filter(|c| !ours.contains(c))
            .filter_map(|(ctrls, path)| {
                let hierarchy = match ctrls.as_str() {
                    "" => "unified".to_string(),
                    c => c
                        .split(',')
                        .next()
                        .map(|f| f.trim_start_matches("name=").to_string())?,
                };
                let procs = Path::new("/sys/fs/cgroup")
                    .join(hierarchy)
                    .join(path.trim_start_matches('/'))
                    .join("cgroup.procs");
                procs.exists().then_some(procs)
            })
            .collect();
        Dockerd {
            pid,
            exe: std::fs::read_link(proc("exe")).expect("dockerd exe"),
            argv,
            env,
            cwd: std::fs::read_link(proc("cwd")).expect("dockerd cwd"),
            log: std::fs::read_link(proc("fd/2")).expect("dockerd stderr"),
            cgroups,
        }
    }

    /// SIGTERM, then waits for it to exit (SIGKILL past the bound: a dockerd stuck in its
    /// shutdown must not keep the machine without one).
    fn stop(&self) -> RestartGuard {
        let guard = RestartGuard(Some(self.clone()));
        // SAFETY: kill(2) on the pid just read from /proc, checked to be dockerd.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        let t = Instant::now();
        while comm(self.pid).as_deref() == Some("dockerd") {
            if t.elapsed() > STOP_BOUND {
                eprintln!(
                    "dockerd {} still running {STOP_BOUND:?} after SIGTERM: SIGKILL",
                    self.pid
                );
                // SAFETY: as above.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        guard
    }

    /// Starts dockerd the way setup-docker.sh did: its own session (`setsid nohup … &`),
    /// stdin /dev/null, stdout and stderr appended to the log; then waits for runc and runsc.
    fn start(&self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("dockerd log");
        use std::io::Write;
        let _ = writeln!(
            &log,
            "\n==== restarted by executor-arm tests/dockerd_restart.rs ===="
        );
        let procs: Vec<CString> = self
            .cgroups
            .iter()
            .filter_map(|p| CString::new(p.as_os_str().as_bytes()).ok())
            .collect();
        let mut cmd = Command::new(&self.exe);
        if let Some((arg0, args)) = self.argv.split_first() {
            cmd.arg0(arg0).args(args);
        }
        cmd.env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.cwd)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log);
        // SAFETY: between fork and exec only async-signal-safe calls on memory prepared before
        // the fork: setsid(2), and open/write/close of the prepared cgroup.procs paths (joining
        // the old dockerd's cgroups, so containerd and containers land where they did).
        unsafe {
            cmd.pre_exec(move || {
                libc::setsid();
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd >= 0 {
                        libc::write(fd, b"0".as_ptr().cast(), 1);
                        libc::close(fd);
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start dockerd");
        // Not waited for: dockerd outlives this test, like setup-docker.sh's `disown`.
        drop(child);
        let t = Instant::now();
        while !has_runtimes() {
            assert!(
                t.elapsed() < START_BOUND,
                "dockerd did not list runc and runsc within {START_BOUND:?} (see {})",
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// Whether dockerd answers `docker info` and lists both runtimes.
fn has_runtimes() -> bool {
    let out = Command::new("timeout")
        .args([
            "10",
            "docker",
            "info",
            "--format",
            "{{range $k, $v := .Runtimes}}{{$k}} {{end}}",
        ])
        .output();
    out.is_ok_and(|o| {
        let rt = String::from_utf8_lossy(&o.stdout).into_owned();
        o.status.success()
            && rt.split_whitespace().any(|r| r == "runc")
            && rt.split_whitespace().any(|r| r == "runsc")
    })
}

/// Starts dockerd again unless it runs: whatever happens to the test, the machine keeps its
/// dockerd.
struct RestartGuard(Option<Dockerd>);

impl RestartGuard {
    fn start(mut self) {
        if let Some(d) = self.0.take() {
            d.start();
        }
    }
}

impl Drop for RestartGuard {
    fn drop(&mut self) {
        if let Some(d) = self.0.take()
            && dockerd_pid().is_none()
        {
            eprintln!("starting dockerd again after a failed test");
            d.start();
        }
    }
}

async fn ready_status(d: &Daemon) -> u16 {
    d.get("/readyz").await.status
}

async fn wait_ready(d: &Daemon, want: u16, bound: Duration) {
    let t = Instant::now();
    loop {
        let s = ready_status(d).await;
        if s == want {
            return;
        }
        assert!(
            t.elapsed() < bound,
            "/readyz still {s}, not {want}, after {bound:?}: {}",
            d.get("/readyz").await.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dockerd_restart_mid_run_is_a_503_or_a_result_and_the_daemon_recovers() {
    require_docker("a_dockerd_restart_mid_run_is_a_503_or_a_result_and_the_daemon_recovers");
    let dockerd = Dockerd::running();
    let d = Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), "runc".into())],
        config: Some(config(1, common::docker::SOCKET)),
        ..Default::default()
    });
    let instance = instance_of(&d);
    wait_ready(&d, 200, Duration::from_secs(60)).await;
    let echo = |word: &'static str| {
        d.exec(json!({"action_type": "shell", "command": "echo", "args": [word]}))
    };
    let r = echo("before").await;
    assert_eq!(r.status, 200, "{}", r.text);

    // A run in flight when dockerd goes.
    let marker = format!("dockerd-restart-{}", uuid::Uuid::new_v4().simple());
    let body = json!({"action_type": "python", "command": "python3", "args": ["-c", format!("# {marker}\nimport time\nprint('started', flush=True)\ntime.sleep(280)\n")], "timeout_seconds": 300, "capability_token": d.cap_all()});
    let svc = d.service_token();
    let url = format!("{}/execute", d.base);
    let inflight = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .bearer_auth(svc)
            .json(&body)
            .send()
            .await
            .expect("the in-flight request gets an answer");
        let status = r.status().as_u16();
        (status, r.text().await.unwrap_or_default())
    });
    let exec_id = {
        let mut id = None;
        wait_until(
            "the in-flight run's start line",
            Duration::from_secs(60),
            || {
                id = d
                    .audit_lines()
                    .into_iter()
                    .find(|l| l["event"] == "execution_start" && l["command"] == "python3")
                    .and_then(|l| l["exec_id"].as_str().map(str::to_string));
                id.is_some()
            },
        );
        id.unwrap_or_default()
    };
    let mut seen = Vec::new();
    let container = container_of(&d, &exec_id, &mut seen);

    let guard = tokio::task::block_in_place(|| dockerd.stop());

    // The run in flight answers: 503 (retryable) or its result, never a 500 and never a hang.
    let (status, text) = tokio::time::timeout(Duration::from_secs(120), inflight)
        .await
        .expect("the in-flight run answered")
        .expect("request task");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    match status {
        503 => assert_eq!(v["error_type"], "SandboxUnavailable", "{text}"),
        200 => assert!(v["outcome"].is_string(), "{text}"),
        _ => panic!("the run in flight answered {status}: {text}"),
    }
    // While dockerd is away: not ready, and a new docker run is a 503.
    wait_ready(&d, 503, Duration::from_secs(30)).await;
    let r = echo("away").await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json["error_type"], "SandboxUnavailable", "{}", r.text);

    tokio::task::block_in_place(|| guard.start());

    wait_ready(&d, 200, START_BOUND).await;
    let r = echo("after").await;
    assert_eq!(
        r.status, 200,
        "the first request after dockerd is back: {}",
        r.text
    );
    assert_eq!(r.json["stdout"], "after\n", "{}", r.text);

    // The audit log verifies; the run in flight has its one end line.
    let out = audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = d.audit_lines();
    assert_runs_paired(&lines);
    let end = lines
        .iter()
        .find(|l| {
            l["exec_id"] == exec_id.as_str()
                && (l["event"] == "execution" || l["event"] == "execution_error")
        })
        .expect("the in-flight run's end line");
    if status == 503 {
        assert_eq!(end["event"], "execution_error", "{end}");
        assert_eq!(end["error_type"], "SandboxUnavailable", "{end}");
    }

    // Nothing of the run in flight is left, nor of the daemon once it stops.
    wait_until(
        "the in-flight run's container removed",
        Duration::from_secs(60),
        || !common::docker::container_exists(&container),
    );
    assert!(pids_with_cmdline(&marker).is_empty());
    finish(d);
    assert!(containers(&format!("executor-arm.instance={instance}")).is_empty());
}
