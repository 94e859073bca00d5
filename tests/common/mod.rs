//! Test harness: starts the real `executor-arm` binary on a free loopback port with a private
//! secret, audit log, state directory and config, and speaks HTTP to it.
#![allow(dead_code)]

pub mod archives;
pub mod backends;
pub mod docker;
pub mod sessions;
pub mod wait;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use executor_arm::auth::{MintRequest, mint_hs256};
use executor_arm::config::TokenKind;
use serde_json::{Value, json};

pub const SECRET: &str = "test-secret-0123456789abcdef0123456789abcdef";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_executor-arm")
}

/// Runs `executor-arm serve` with a private secret, audit log and sessions directory plus `env`
/// until it exits by itself: for a start that must fail (its stderr says why).
pub fn run_until_exit(env: &[(&str, &str)]) -> std::process::Output {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("secret"), SECRET).expect("secret");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("EXECUTOR_ARM_JWT_SECRET_FILE", dir.path().join("secret"))
        .env("EXECUTOR_ARM_AUDIT_LOG", dir.path().join("audit.jsonl"))
        .env("EXECUTOR_ARM_SESSIONS_DIR", dir.path().join("sessions"))
        .env("EXECUTOR_ARM_STATE_DIR", dir.path().join("state"))
        .env("EXECUTOR_ARM_PROFILES_DIR", repo.join("sandbox-profiles"))
        .envs(env.iter().copied())
        .current_dir(repo)
        .output()
        .expect("run the daemon")
}

/// Options for one daemon.
#[derive(Default, Clone)]
pub struct Opts {
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// TOML merged over the embedded defaults.
    pub config: Option<String>,
    /// A command the daemon is started under (e.g. `nsenter --net=…`).
    pub wrapper: Vec<String>,
    /// Listen address (default 127.0.0.1:0).
    pub listen: Option<String>,
}

pub struct Daemon {
    pub child: Option<Child>,
    pub base: String,
    pub addr: String,
    pub dir: tempfile::TempDir,
    pub secret: PathBuf,
    pub audit: PathBuf,
    pub client: reqwest::Client,
    pub log: mpsc::Receiver<String>,
    /// What the daemon logged before it reported its address.
    pub startup_log: Vec<String>,
    /// The unix second in which the daemon reported it was listening (it started no later).
    pub listening_at: u64,
}

pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub json: Value,
    pub text: String,
    /// The body as received.
    pub bytes: Vec<u8>,
}

/// A fresh file under `$CARGO_TARGET_TMPDIR/status-log/` where a daemon of the tests records the
/// statuses it answered (`METHOD route status` lines): scripts/api-fuzz.sh checks that every
/// status the OpenAPI document lists was answered by some test.
pub fn status_log() -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-log");
    let _ = std::fs::create_dir_all(&dir);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!("{}-{n}.log", std::process::id()))
}

impl Daemon {
    pub fn start() -> Daemon {
        Self::start_with(Opts::default())
    }

    pub fn start_with(opts: Opts) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, opts)
    }

    /// Starts a daemon whose files live in `dir` (reused by restart tests).
    pub fn start_in(dir: tempfile::TempDir, opts: Opts) -> Daemon {
        require_root();
        let secret = dir.path().join("jwt-secret");
        if !secret.exists() {
            std::fs::write(&secret, SECRET).expect("secret");
        }
        let audit = dir.path().join("audit.jsonl");
        let mut cmd = match opts.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin());
                c
            }
            None => Command::new(bin()),
        };
        cmd.arg("serve")
            .arg("--listen")
            .arg(opts.listen.as_deref().unwrap_or("127.0.0.1:0"));
        if let Some(cfg) = &opts.config {
            let p = dir.path().join("config.toml");
            std::fs::write(&p, cfg).expect("config");
            cmd.arg("--config").arg(&p);
        }
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        cmd.current_dir(repo)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("RUST_LOG", "info")
            .env("EXECUTOR_ARM_JWT_SECRET_FILE", &secret)
            .env("EXECUTOR_ARM_AUDIT_LOG", &audit)
            .env("EXECUTOR_ARM_PROFILES_DIR", repo.join("sandbox-profiles"))
            .env("EXECUTOR_ARM_EXECUTORS_DIR", dir.path().join("executors"))
            .env("EXECUTOR_ARM_SESSIONS_DIR", dir.path().join("sessions"))
            .env("EXECUTOR_ARM_STATE_DIR", dir.path().join("state"))
            .env("EXECUTOR_ARM_STATUS_LOG", status_log())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn daemon");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut addr = None;
        let mut startup_log = Vec::new();
        let mut listening_at = 0;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while addr.is_none() && std::time::Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    if line.contains("\"listening\"")
                        && let Ok(v) = serde_json::from_str::<Value>(&line)
                    {
                        addr = v["fields"]["addr"].as_str().map(String::from);
                        listening_at = executor_arm::auth::now();
                    }
                    startup_log.push(line);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(st)) = child.try_wait() {
                        panic!("daemon exited during startup: {st}; it logged: {startup_log:#?}");
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("daemon exited during startup; it logged: {startup_log:#?}")
                }
            }
        }
        let addr = addr.expect("daemon did not report its address");
        Daemon {
            child: Some(child),
            base: format!("http://{addr}"),
            addr,
            dir,
            secret,
            audit,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("client"),
            log: rx,
            startup_log,
            listening_at,
        }
    }

    /// Waits until a token minted now has an `iat` past the daemon's start plus the default
    /// verification leeway (5 s). A state file created at this start refuses single-use tokens
    /// that may predate its creation, and a token whose `iat` is within the leeway of it may (a
    /// restart on the same directory keeps the file: no wait then). Waits on the clock, at most
    /// about six seconds.
    pub fn wait_until_tokens_postdate_start(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while executor_arm::auth::now() <= self.listening_at + 5 {
            assert!(
                std::time::Instant::now() < deadline,
                "the clock did not advance"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the daemon and starts a new one on the same directory (secret, audit log, state
    /// directory, config).
    pub fn restart(mut self, opts: Opts) -> Daemon {
        self.stop();
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
        Self::start_in(dir, opts)
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    pub fn mint(&self, req: MintRequest) -> String {
        mint_hs256(SECRET.as_bytes(), &req).expect("mint")
    }

    pub fn service_token(&self) -> String {
        self.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 300,
            aud: "executor-arm".into(),
            sub: Some("orchestrator".into()),
            ..Default::default()
        })
    }

    pub fn cap(&self, caps: &[&str]) -> String {
        self.mint(MintRequest {
            kind: Some(TokenKind::Capability),
            ttl_seconds: 120,
            aud: "executor-arm".into(),
            sub: Some("orchestrator".into()),
            capabilities: caps.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
    }

    /// A capability token with every capability.
    pub fn cap_all(&self) -> String {
        self.cap(&[
            "ShellRead",
            "ShellExecute",
            "FilesystemRead",
            "FilesystemWrite",
            "NetworkAccess",
            "HttpRequest",
            "PythonExecute",
            "ExternalExecute",
        ])
    }

    /// POST /execute with the default service token; `body` gets a capability_token with every
    /// capability unless it has one.
    pub async fn exec(&self, mut body: Value) -> Resp {
        if body.get("capability_token").is_none() {
            body["capability_token"] = Value::String(self.cap_all());
        }
        let svc = self.service_token();
        self.post(
            "/execute",
            &[("authorization", &format!("Bearer {svc}"))],
            body.to_string(),
        )
        .await
    }

    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: String) -> Resp {
        let mut rb = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        Self::read(rb.send().await.expect("request")).await
    }

    /// GET with the default service token.
    pub async fn get_authorized(&self, path: &str) -> Resp {
        let svc = self.service_token();
        Self::read(
            self.client
                .get(format!("{}{path}", self.base))
                .header("authorization", format!("Bearer {svc}"))
                .send()
                .await
                .expect("request"),
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Resp {
        Self::read(
            self.client
                .get(format!("{}{path}", self.base))
                .send()
                .await
                .expect("request"),
        )
        .await
    }

    pub async fn read(r: reqwest::Response) -> Resp {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let bytes = r.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Resp {
            status,
            headers,
            json,
            text,
            bytes,
        }
    }

    /// Lines of the audit log.
    pub fn audit_lines(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.audit)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("audit line is JSON"))
            .collect()
    }

    /// The `execution` line of `exec_id`, after checking that the run's lines pair up: one
    /// `execution_start` line, then exactly one end line.
    pub fn execution_line(&self, exec_id: &str) -> Value {
        let lines = self.audit_lines();
        assert_runs_paired(&lines);
        lines
            .into_iter()
            .find(|l| l["exec_id"] == exec_id && l["event"] == "execution")
            .unwrap_or_else(|| panic!("no execution line for {exec_id}"))
    }

    /// `kill -9`: the daemon dies at once, doing nothing more (a crash); reaped here. Returns
    /// its pid. A later [`Daemon::restart`] starts a new daemon on the same files.
    pub fn kill9(&mut self) -> i32 {
        let pid = self.pid();
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL the daemon");
            child.wait().expect("reap the daemon");
        }
        pid
    }

    /// Sends SIGTERM and waits for exit; returns the exit code (None also when it had to be
    /// SIGKILLed, see [`Daemon::terminate`]).
    pub fn stop(&mut self) -> Option<i32> {
        match self.terminate()? {
            Stopped::Exited(code) => code,
            Stopped::Killed => None,
        }
    }

    /// Sends SIGTERM, waits up to [`STOP_LIMIT`] for the daemon to exit, then SIGKILLs it.
    /// None: it was not running.
    pub fn terminate(&mut self) -> Option<Stopped> {
        let mut child = self.child.take()?;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        Some(wait_or_kill(&mut child))
    }
}

/// The daemons these tests start confine local runs with namespaces, cgroups and per-run uids,
/// which need root: without it a test fails here, naming what is missing, instead of failing
/// later in a way that hides why.
pub fn require_root() {
    // SAFETY: geteuid(2) takes no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this integration test needs root (the daemon it starts confines runs with namespaces, \
         cgroups and per-run uids); it runs as uid {euid}: run it as root, as scripts/test-all.sh does"
    );
}

/// How a daemon ended after SIGTERM.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    Exited(Option<i32>),
    /// Still running [`STOP_LIMIT`] after SIGTERM: SIGKILLed, its exit cut short.
    Killed,
}

/// How long a daemon may take to exit after SIGTERM before the tests SIGKILL it. A bound, not a
/// timing check, above the daemon's documented worst case (docs/deployment.md): the drain (the
/// tests' daemons keep the default 30 s `shutdown_grace_seconds` or less, + 5 s for killed runs),
/// then up to `EXIT_LIMIT` for each container backend to wait for its launches in flight and
/// remove its containers; plus 45 s for a saturated machine.
pub const STOP_LIMIT: Duration =
    Duration::from_secs(30 + 5 + executor_arm::sandbox::docker::EXIT_LIMIT.as_secs() + 45);

fn wait_or_kill(child: &mut Child) -> Stopped {
    let deadline = std::time::Instant::now() + STOP_LIMIT;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return Stopped::Exited(st.code());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    Stopped::Killed
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A failing test shows what the daemon logged above info level: CI keeps no other trace.
        if std::thread::panicking() {
            let lines: Vec<String> = self
                .log
                .try_iter()
                .filter(|l| l.contains("\"WARN\"") || l.contains("\"ERROR\""))
                .collect();
            for l in &lines[lines.len().saturating_sub(40)..] {
                eprintln!("daemon log: {l}");
            }
        }
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            wait_or_kill(&mut c);
        }
    }
}

/// Every admitted run in `lines` has its `execution_start` line followed by exactly one end line
/// (`execution` or `execution_error`) with the same exec_id, and every end line has its start.
pub fn assert_runs_paired(lines: &[Value]) {
    let mut open: Vec<&str> = Vec::new();
    for l in lines {
        let exec_id = l["exec_id"].as_str();
        match (l["event"].as_str(), exec_id) {
            (Some("execution_start"), Some(id)) => {
                assert!(!open.contains(&id), "{id} started twice: {lines:#?}");
                assert!(
                    !lines
                        .iter()
                        .take_while(|x| !std::ptr::eq(*x, l))
                        .any(|x| x["exec_id"] == id),
                    "a line of {id} before its start: {lines:#?}"
                );
                open.push(id);
            }
            (Some("execution" | "execution_error"), Some(id)) => {
                let i = open
                    .iter()
                    .position(|o| *o == id)
                    .unwrap_or_else(|| panic!("end line of {id} without its start: {lines:#?}"));
                open.remove(i);
            }
            (Some("execution_start" | "execution" | "execution_error"), None) => {
                panic!("execution line without exec_id: {l}")
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "runs without an end line: {open:?}");
}

/// `executor-arm audit verify FILE`.
pub fn audit_verify(file: &Path) -> std::process::Output {
    Command::new(bin())
        .args(["audit", "verify"])
        .arg(file)
        .output()
        .expect("run executor-arm audit verify")
}

/// PIDs of every process whose command line contains `needle` (checked from the host).
pub fn pids_with_cmdline(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.filter_map(Result::ok) {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let s = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if s.contains(needle) {
                out.push(pid);
            }
        }
    }
    out
}

/// Run cgroups a daemon (by pid) currently has (v1 pids hierarchy, or v2 runs dir).
pub fn run_cgroups_of(daemon_pid: i32) -> Vec<String> {
    let mut out = Vec::new();
    for root in ["/sys/fs/cgroup/pids/executor-arm", "/sys/fs/cgroup/runs"] {
        let dir = std::path::Path::new(root).join(format!("d{daemon_pid}"));
        if let Ok(entries) = std::fs::read_dir(dir) {
            out.extend(
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    // Idle prepared slots (a slot taken by a run is renamed to its exec_id on
                    // cgroup v1, which these tests run on).
                    .filter(|n| !n.starts_with("warm-")),
            );
        }
    }
    out
}

/// The run-cgroup owner directories of a daemon: `<controller>/<its cgroup>/executor-arm/d<pid>`
/// for every v1 hierarchy the driver uses, or `<its v2 base>/runs/d<pid>`.
pub fn owner_dirs(daemon_pid: i32) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{daemon_pid}/cgroup"))
        .expect("daemon's /proc/<pid>/cgroup");
    let owner = format!("d{daemon_pid}");
    let mut out = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if ctrls.is_empty() {
            let base = Path::new("/sys/fs/cgroup").join(rel);
            let base = if base.ends_with("daemon") {
                base.parent().map(Path::to_path_buf).unwrap_or(base)
            } else {
                base
            };
            out.push(base.join("runs").join(&owner));
        }
        for c in ctrls
            .split(',')
            .filter(|c| ["memory", "cpu", "pids", "freezer"].contains(c))
        {
            out.push(
                Path::new("/sys/fs/cgroup")
                    .join(c)
                    .join(rel)
                    .join("executor-arm")
                    .join(&owner),
            );
        }
    }
    out.retain(|p| p.is_dir());
    assert!(
        !out.is_empty(),
        "no run-cgroup directory of daemon {daemon_pid} found: the cleanup check would be vacuous"
    );
    out
}

impl Daemon {
    /// Run cgroups this daemon has now (empty when nothing runs).
    pub fn run_cgroups(&self) -> Vec<String> {
        run_cgroups_of(self.pid())
    }

    /// Waits (bounded) until this daemon has no run cgroup: its reaper removes a finished run's
    /// cgroups after the answer, at low priority.
    pub fn wait_for_no_run_cgroups(&self) {
        wait::wait_for(
            &format!("the run cgroups of daemon {} removed", self.pid()),
            wait::CLEANUP,
            || self.run_cgroups(),
            Vec::is_empty,
        );
    }

    /// Waits (bounded) until `/metrics` has exactly the line `line`: a gauge or counter moves
    /// just after the answer a test has already read. Returns the whole text.
    pub async fn wait_for_metric(&self, line: &str) -> String {
        wait::wait_for_async(
            &format!("/metrics to show {line}"),
            wait::CLEANUP,
            || async { self.get("/metrics").await.text },
            |m| m.lines().any(|l| l == line),
        )
        .await
    }

    /// Waits (bounded) until the audit log has a line for which `found` holds, and returns it:
    /// lines of a run the client no longer waits for are written when the run ends.
    pub fn wait_for_audit_line(&self, what: &str, found: impl Fn(&Value) -> bool) -> Value {
        wait::wait_for(
            &format!("an audit line: {what}"),
            wait::CLEANUP,
            || self.audit_lines(),
            |lines| lines.iter().any(&found),
        )
        .into_iter()
        .find(found)
        .expect("found above")
    }
}

/// Waits (bounded) until no process on the host has `needle` in its command line: a killed
/// run's processes are reaped by their parents after the kill.
pub fn wait_for_no_process(needle: &str) {
    wait::wait_for(
        &format!("no process with {needle} in its command line"),
        wait::CLEANUP,
        || pids_with_cmdline(needle),
        Vec::is_empty,
    );
}

/// Writes `yaml` to `<dir>/executors/<file>` (creating the directory) and returns its path. `dir` is
/// a daemon's directory: call it before [`Daemon::start_in`] to have the def loaded at startup, or
/// on a running daemon's `d.dir` followed by SIGHUP to have it reloaded.
pub fn write_executor_def(dir: &Path, file: &str, yaml: &str) -> PathBuf {
    let executors = dir.join("executors");
    std::fs::create_dir_all(&executors).expect("executors dir");
    let path = executors.join(file);
    std::fs::write(&path, yaml).expect("executor def");
    path
}

/// A result whose stdout is `want` (not UTF-8): `stdout_b64` holds exactly those bytes, their
/// sha256 is `stdout_sha256`, and `stderr` (UTF-8 here) has no `stderr_b64`.
pub fn assert_binary_output(r: &Resp, want: &[u8], what: &str) {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    assert_eq!(r.status, 200, "{what}: {}", r.text);
    let b64 = r.json["stdout_b64"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no stdout_b64: {}", r.text));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("standard base64");
    assert_eq!(bytes, want, "{what}: {}", r.text);
    assert_eq!(
        r.json["provenance"]["stdout_sha256"],
        Value::String(format!("sha256:{}", hex::encode(Sha256::digest(&bytes)))),
        "{what}: {}",
        r.text
    );
    assert_eq!(
        r.json["stdout"],
        Value::String(String::from_utf8_lossy(want).into_owned()),
        "{what}"
    );
    assert!(r.json.get("stderr_b64").is_none(), "{what}: {}", r.text);
}

/// Sends `n` `echo` requests to `d` at once, each on its own connection, and checks that the
/// queue absorbed the burst: every answer is 200 with its own output, nobody is left waiting on
/// `backend`, the daemon is healthy and answers the next request. Returns how long the burst
/// took.
pub async fn assert_burst_absorbed(d: &Daemon, backend: &str, n: usize) -> Duration {
    let svc = format!("Bearer {}", d.service_token());
    let cap = d.cap_all();
    // No per-request time limit below the queue's own: the last of the burst waits the longest.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("client");
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let send = client
                .post(format!("{}/execute", d.base))
                .header("authorization", &svc)
                .header("content-type", "application/json")
                .body(json!({"action_type": "shell", "command": "echo", "args": [format!("n{i}")], "capability_token": cap}).to_string())
                .send();
            tokio::spawn(async move { Daemon::read(send.await.expect("request")).await })
        })
        .collect();
    let mut refused = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.expect("task");
        if r.status != 200 {
            refused.push(format!("{i}: {} {}", r.status, r.text));
        } else {
            assert_eq!(
                r.json["stdout"],
                json!(format!("n{i}\n")),
                "{backend}: {}",
                r.text
            );
        }
    }
    let took = started.elapsed();
    assert!(
        refused.is_empty(),
        "{backend}: {} of {n} requests refused in {took:?}: {:?}",
        refused.len(),
        &refused[..refused.len().min(5)]
    );
    let m = d.get("/metrics").await.text;
    assert!(
        m.contains(&format!(
            "executor_queue_waiting{{backend=\"{backend}\"}} 0"
        )),
        "{backend}: {m}"
    );
    assert!(
        m.contains(&format!(
            "executor_queue_wait_seconds_count{{backend=\"{backend}\"}} {n}"
        )),
        "{backend}: every request of the burst timed its wait: {m}"
    );
    assert_eq!(d.get("/health").await.status, 200);
    let after = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["after"]}))
        .await;
    assert_eq!(
        after.json["stdout"],
        json!("after\n"),
        "{backend}: {}",
        after.text
    );
    took
}

/// A profiles directory: the shipped profiles plus `extra` (name, TOML text).
pub fn profiles_with(extra: &[(&str, String)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("sandbox-profiles");
    for e in std::fs::read_dir(&shipped)
        .expect("sandbox-profiles")
        .filter_map(Result::ok)
    {
        if e.path().extension().is_some_and(|x| x == "toml") {
            std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copy profile");
        }
    }
    for (name, text) in extra {
        std::fs::write(dir.path().join(format!("{name}.toml")), text).expect("write profile");
    }
    dir
}

/// The text of a shipped profile.
pub fn shipped_profile(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("sandbox-profiles")
            .join(format!("{name}.toml")),
    )
    .expect("profile")
}

/// One Server-Sent Event as the client read it, and when.
#[derive(Debug, Clone)]
pub struct Sse {
    pub event: String,
    pub id: String,
    pub data: Value,
    /// When the client read it, in unix seconds (comparable with stamps a run prints).
    pub read_at: f64,
}

/// Reads the events of an open SSE response.
pub struct SseReader {
    pub resp: reqwest::Response,
    pub buf: String,
}

impl SseReader {
    pub async fn next(&mut self) -> Option<Sse> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let (mut event, mut id, mut data) = (String::new(), String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        event = v.into();
                    } else if let Some(v) = line.strip_prefix("id: ") {
                        id = v.into();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                if event.is_empty() {
                    continue; // a heartbeat comment
                }
                return Some(Sse {
                    event,
                    id,
                    data: serde_json::from_str(&data).expect("event data is JSON"),
                    read_at: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .expect("clock after 1970")
                        .as_secs_f64(),
                });
            }
            match self.resp.chunk().await.expect("stream read") {
                Some(c) => self
                    .buf
                    .push_str(std::str::from_utf8(&c).expect("utf-8 stream")),
                None => return None,
            }
        }
    }

    pub async fn rest(&mut self) -> Vec<Sse> {
        let mut all = Vec::new();
        while let Some(e) = self.next().await {
            all.push(e);
        }
        all
    }
}

/// POST /execute with `Accept: text/event-stream`; `body` gets a capability token with every
/// capability unless it has one.
pub async fn open_stream(d: &Daemon, body: Value) -> SseReader {
    let mut body = body;
    if body.get("capability_token").is_none() {
        body["capability_token"] = json!(d.cap_all());
    }
    let resp = d
        .client
        .post(format!("{}/execute", d.base))
        .header("authorization", format!("Bearer {}", d.service_token()))
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(body.to_string())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    SseReader {
        resp,
        buf: String::new(),
    }
}

/// The bytes of `stream` ("stdout" / "stderr") the events carry, checking each event starts
/// where the previous one ended.
pub fn stream_bytes(events: &[Sse], stream: &str, mut at: usize) -> Vec<u8> {
    use base64::Engine;
    let mut out = Vec::new();
    for e in events.iter().filter(|e| e.event == stream) {
        assert_eq!(e.data["offset"], at, "{e:?}");
        let chunk = match e.data["data"].as_str() {
            Some(t) => t.as_bytes().to_vec(),
            None => base64::engine::general_purpose::STANDARD
                .decode(e.data["data_b64"].as_str().expect("data or data_b64"))
                .unwrap(),
        };
        at += chunk.len();
        out.extend(chunk);
    }
    out
}

/// The python of the pinned venv `script` (under scripts/) makes or finds cached; it prints that
/// python on its last line. PyPI is its only download.
pub fn venv_python(script: &str) -> String {
    pinned_tool(script, &[])
}

/// What the pinned-tool `script` (under scripts/) run with `args` prints on its last line, after
/// it made or found cached what it pins: a venv's python (scripts/e2b-sdk-venv.sh VERSION), an
/// npm install's directory (scripts/e2b-npm-sdk.sh). A package registry is its only download.
pub fn pinned_tool(script: &str, args: &[&str]) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(repo.join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} {args:?} failed (it installs pinned packages from a registry): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_else(|| panic!("scripts/{script} printed nothing"))
        .trim()
        .to_string()
}
