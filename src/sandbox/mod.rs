//! The seam between policy and mechanism.
//!
//! The policy layer hands a fully resolved [`RunSpec`] to a [`Sandbox`] and gets a [`RunOutcome`]
//! back. A backend never sees tokens, requests or allowlists; the HTTP layer never sees cgroups,
//! Landlock or Docker. What every backend's run shares — egress admission, output capture, the
//! wait for an end or a reason to kill, the outcome's assembly — is [`run`] and [`capture`].

pub mod capture;
pub mod control;
pub mod docker;
pub mod files;
pub mod host_cgroup;
pub mod local;
pub mod ports;
pub mod run;
pub mod syscalls;
pub mod uids;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which mechanism runs a command.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Local,
    Docker,
    Gvisor,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] =
        [BackendKind::Local, BackendKind::Docker, BackendKind::Gvisor];

    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Local => "local",
            BackendKind::Docker => "docker",
            BackendKind::Gvisor => "gvisor",
        }
    }

    /// Parses `SANDBOX_RUNTIME` (`local` | `runc` | `gvisor`) and the config spelling (`docker`).
    pub fn from_runtime_name(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "local" => Some(BackendKind::Local),
            "runc" | "docker" => Some(BackendKind::Docker),
            "gvisor" | "runsc" => Some(BackendKind::Gvisor),
            _ => None,
        }
    }
}

/// Resource limits of one run, already the tightest of profile, token and request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Limits {
    pub cpus: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    pub timeout: Duration,
    pub pids: u64,
    pub output_bytes: usize,
    /// What a stream past `output_bytes` does to the run.
    pub on_overflow: OnOverflow,
    pub nofile: u64,
}

/// What happens when a stream goes past the output cap. Either way the stream keeps its first
/// `output_bytes` and is flagged truncated.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnOverflow {
    /// The rest is read and discarded (constant memory); the run goes on to its own end or its
    /// timeout.
    #[default]
    Truncate,
    /// The run is killed at once (`killed_reason: output_limit`).
    Kill,
}

/// Network policy of one run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum NetworkPolicy {
    None,
    Egress {
        allow_hosts: Vec<String>,
        allow_ports: Vec<u16>,
        allow_cidrs: Vec<String>,
        bandwidth_bytes_per_sec: u64,
        byte_cap: u64,
        /// Raw TCP by rule (`CIDR:port`), beside the proxy; see [`crate::egress::TcpRule`].
        tcp: Vec<crate::egress::TcpRule>,
    },
}

impl NetworkPolicy {
    /// The egress proxy's policy for this run (`None` without egress); `deny_addrs` are the
    /// daemon's own addresses and ports.
    pub fn proxy_policy(
        &self,
        deny_addrs: &[std::net::SocketAddr],
    ) -> Option<crate::egress::EgressPolicy> {
        let NetworkPolicy::Egress {
            allow_hosts,
            allow_ports,
            allow_cidrs,
            bandwidth_bytes_per_sec,
            byte_cap,
            ..
        } = self
        else {
            return None;
        };
        Some(crate::egress::EgressPolicy {
            allow_hosts: allow_hosts.clone(),
            allow_ports: allow_ports.clone(),
            // Profiles are validated at load: every entry parses.
            allow_cidrs: allow_cidrs
                .iter()
                .filter_map(|c| c.parse::<crate::egress::IpNet>().ok())
                .collect(),
            deny_addrs: deny_addrs.to_vec(),
            bandwidth_bytes_per_sec: *bandwidth_bytes_per_sec,
            byte_cap: *byte_cap,
        })
    }

    /// The raw TCP rules of this run (none without egress).
    pub fn tcp_rules(&self) -> &[crate::egress::TcpRule] {
        match self {
            NetworkPolicy::Egress { tcp, .. } => tcp,
            NetworkPolicy::None => &[],
        }
    }

    /// The raw TCP policy of this run (`None` without tcp rules); `deny_addrs` as for
    /// [`NetworkPolicy::proxy_policy`].
    pub fn tcp_policy(
        &self,
        deny_addrs: &[std::net::SocketAddr],
    ) -> Option<crate::egress::TcpPolicy> {
        let rules = self.tcp_rules();
        (!rules.is_empty())
            .then(|| crate::egress::TcpPolicy::new(rules.to_vec(), deny_addrs.to_vec()))
    }
}

/// Filesystem view of one run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FsRules {
    /// Host paths made visible read-only (local backend).
    pub read_only: Vec<PathBuf>,
    /// Extra host files bind-mounted read-only at a path of their own (an executor's script).
    pub extra_files: Vec<(PathBuf, PathBuf)>,
    /// The private writable working directory inside the sandbox.
    pub workdir: PathBuf,
    /// A session's workspace: this host directory is bound writable at `workdir` instead of a
    /// fresh scratch directory, so what one exec leaves there the next one finds (local
    /// backend; the directory is a tmpfs of the session's own, which bounds it).
    pub workspace: Option<PathBuf>,
    /// Where the command starts, inside `workdir`; `workdir` itself when None.
    pub cwd: Option<PathBuf>,
    /// The run opens a pseudo-terminal (a session's terminal): the local backend mounts a devpts
    /// instance of the run's own at /dev/pts, with /dev/ptmx pointing into it (containers have
    /// theirs already).
    pub pty: bool,
}

/// Everything a backend needs to run one command; nothing more.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub exec_id: String,
    /// argv\[0\] is the absolute path of the program inside the sandbox.
    pub argv: Vec<String>,
    pub stdin: Option<Vec<u8>>,
    pub env: BTreeMap<String, String>,
    pub limits: Limits,
    pub network: NetworkPolicy,
    pub fs: FsRules,
    pub uid: u32,
    pub gid: u32,
    /// Minimum Landlock ABI the profile demands (0: Landlock not required).
    pub landlock_abi: u32,
    /// Container image (docker / gvisor backends).
    pub image: Option<String>,
    pub profile: String,
    /// Becomes `Some` when the daemon stops the run before it ends on its own (a cancel, or
    /// the shutdown grace period is over).
    pub stop: Option<tokio::sync::watch::Receiver<Option<Stop>>>,
    /// Handed every chunk of output the run keeps, as it arrives (live streaming).
    pub output_tap: Option<OutputTap>,
    /// The session's kept sandbox this run goes into, instead of a fresh one (docker/gVisor
    /// sessions; see [`Sandbox::keep`]).
    pub kept: Option<std::sync::Arc<dyn files::Kept>>,
    /// A session exec's code, for a kept sandbox to write at its path before the run (the local
    /// backend binds a host file through `fs.extra_files` instead).
    pub code: Option<ExecCode>,
    /// Set: the run's stdin stays open after `stdin` for what the caller sends, and the caller
    /// may signal it ([`control`]).
    pub controls: Option<control::Controls>,
    /// A session's background process: in a kept sandbox it runs beside the session's other
    /// runs (it neither waits for nor ends them, and they do not end it).
    pub background: bool,
    /// Runs naming the same group count together in one set of pids, memory and CPU limits,
    /// those of the group's first live run (a session's runs on the local backend, which all
    /// carry the session's limits; a kept sandbox's runs share its container's already).
    pub group: Option<String>,
    /// A one-shot run's trust scope (its calling service): a container backend may run it in a
    /// container that served an earlier run of the same scope and container shape, scrubbed in
    /// between (see `docker::reuse`). None: a container that never ran anything else.
    pub reuse_scope: Option<String>,
}

/// Which container served a run and how many runs it has served, this one included (a
/// container backend's reused containers; None elsewhere).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContainerUse {
    /// The container's id (its first 12 hex digits, as `docker ps` shows it).
    pub id: String,
    pub uses: u32,
}

/// The code of a session's exec and where the interpreter finds it.
#[derive(Debug, Clone)]
pub struct ExecCode {
    pub path: PathBuf,
    pub bytes: std::sync::Arc<[u8]>,
}

/// One of a run's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Stdout,
    Stderr,
}

/// What an [`OutputTap`] calls.
type TapFn = dyn Fn(StreamKind, &[u8]) + Send + Sync;

/// Called with each chunk of a stream's kept output, in order, from the task reading it; or,
/// [`OutputTap::past_cap`], with every chunk the run writes, those past its output cap included
/// (a background process's readers follow all of it; what they keep is theirs to bound).
#[derive(Clone)]
pub struct OutputTap {
    f: std::sync::Arc<TapFn>,
    past_cap: bool,
}

impl OutputTap {
    pub fn new(f: impl Fn(StreamKind, &[u8]) + Send + Sync + 'static) -> Self {
        OutputTap {
            f: std::sync::Arc::new(f),
            past_cap: false,
        }
    }

    /// This tap, also handed what the run writes past its output cap.
    pub fn past_cap(self) -> Self {
        OutputTap {
            past_cap: true,
            ..self
        }
    }

    /// Whether the tap follows the output past its cap.
    pub fn follows_past_cap(&self) -> bool {
        self.past_cap
    }

    pub fn send(&self, stream: StreamKind, chunk: &[u8]) {
        (self.f)(stream, chunk)
    }
}

impl std::fmt::Debug for OutputTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OutputTap")
    }
}

/// A request to stop a run before it ends on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    /// What the result says ended the run: `Cancelled` (a caller asked) or `Signal` (the daemon
    /// is shutting down).
    pub reason: KilledReason,
    /// How long every process of the run has between SIGTERM and SIGKILL; zero kills at once.
    pub grace: Duration,
}

/// Why the daemon ended a run early.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KilledReason {
    Timeout,
    Oom,
    Pids,
    OutputLimit,
    Signal,
    /// A caller cancelled the run.
    Cancelled,
}

impl KilledReason {
    /// Why a run ended early: the daemon's own reason when it killed the run, else what the
    /// exit says (the memory limit, a signal, or a failure after hitting the pids limit).
    pub fn resolve(
        killed: Option<KilledReason>,
        exit: ExitKind,
        oom: bool,
        pids_max_hits: u64,
    ) -> Option<KilledReason> {
        killed.or(match exit {
            _ if oom => Some(KilledReason::Oom),
            ExitKind::Signaled(_) | ExitKind::Killed => Some(KilledReason::Signal),
            ExitKind::Exited(c) if c != 0 && pids_max_hits > 0 => Some(KilledReason::Pids),
            ExitKind::Exited(_) => None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KilledReason::Timeout => "timeout",
            KilledReason::Oom => "oom",
            KilledReason::Pids => "pids",
            KilledReason::OutputLimit => "output_limit",
            KilledReason::Signal => "signal",
            KilledReason::Cancelled => "cancelled",
        }
    }
}

/// How the main process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    Exited(i32),
    Signaled(i32),
    /// The daemon killed it before it reported a status (timeout, output limit).
    Killed,
}

/// What a backend reports after a run; the cgroup/container is gone by the time it is returned.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub exit: ExitKind,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub duration: Duration,
    pub peak_memory_kib: Option<u64>,
    pub oom: bool,
    pub killed_reason: Option<KilledReason>,
    /// The child exited without reading all of its stdin (broken pipe).
    pub stdin_broken_pipe: bool,
    /// Every outbound connection attempted through the egress proxy (empty without egress).
    pub network: Vec<crate::egress::ConnRecord>,
    /// The reused container that served the run, if it ran in one.
    pub container: Option<ContainerUse>,
}

impl RunOutcome {
    /// The exit code reported on the wire: the code, or 128 + signal like a shell.
    pub fn exit_code(&self) -> i32 {
        match self.exit {
            ExitKind::Exited(c) => c,
            ExitKind::Signaled(s) => 128 + s,
            ExitKind::Killed => 128 + libc::SIGKILL,
        }
    }

    pub fn timed_out(&self) -> bool {
        self.killed_reason == Some(KilledReason::Timeout)
    }
}

/// The longest single argv or envp string (`NAME=value`) Linux's execve accepts, NUL included
/// (MAX_ARG_STRLEN: 32 pages).
pub const MAX_ARG_STRLEN: usize = 32 * 4096;

/// What argv and envp may take together: every string with its NUL and its pointer. Linux's own
/// limit (ARG_MAX) is a quarter of the stack rlimit, 2 MiB with the usual 8 MiB stack; half of
/// that leaves room for what a backend adds and for smaller stacks.
pub const MAX_EXEC_BYTES: usize = 1 << 20;

/// Checks `argv` and `env` against execve's limits before anything runs, so an oversized request
/// is the caller's error (400) on every backend rather than a run that fails with E2BIG.
pub fn check_exec_size<'a>(
    argv: impl IntoIterator<Item = &'a str>,
    env: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), String> {
    let ptr = std::mem::size_of::<usize>();
    let mut total = 0usize;
    for (i, a) in argv.into_iter().enumerate() {
        let n = a.len() + 1;
        if n > MAX_ARG_STRLEN {
            return Err(format!(
                "argument {i} is {} bytes; each argument may be at most {} bytes (the execve limit MAX_ARG_STRLEN of {MAX_ARG_STRLEN} bytes includes its NUL)",
                a.len(),
                MAX_ARG_STRLEN - 1
            ));
        }
        total += n + ptr;
    }
    for (k, v) in env {
        let n = k.len() + 1 + v.len() + 1;
        if n > MAX_ARG_STRLEN {
            return Err(format!(
                "environment variable '{}' is {} bytes as NAME=value; each may be at most {} bytes (the execve limit MAX_ARG_STRLEN of {MAX_ARG_STRLEN} bytes includes its NUL)",
                k.escape_debug(),
                n - 1,
                MAX_ARG_STRLEN - 1
            ));
        }
        total += n + ptr;
    }
    if total > MAX_EXEC_BYTES {
        return Err(format!(
            "argv and environment take {total} bytes; together they may take at most {MAX_EXEC_BYTES} bytes (each string with its NUL and pointer)"
        ));
    }
    Ok(())
}

/// Errors of the sandbox layer; all of them mean "the command did not run to an outcome".
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// A mechanism the run needs is missing or not fully enforced on this host.
    #[error("sandbox unavailable: {0}")]
    Unavailable(String),
    /// Building the sandbox failed after the run was admitted.
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    /// No process could be made for the run: the sandbox's pids limit is reached (in a session,
    /// its other processes hold every pid). Retryable once some of them end.
    #[error("no process free for the run: {0}")]
    PidsExhausted(String),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Readiness of one backend, shown in /readyz and /capabilities.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct BackendStatus {
    pub backend: BackendKind,
    pub ready: bool,
    pub detail: String,
}

/// What a session's sandbox uses now: memory charged to it, and the CPU time its processes
/// have used (cumulative: two readings give a rate).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub memory_bytes: u64,
    /// Of `memory_bytes`, the page cache (files read or written, a tmpfs workspace's pages).
    pub cache_bytes: u64,
    pub cpu_ns: u64,
}

/// The bytes used on the filesystem that holds `path` (a workspace's own tmpfs). Blocking.
pub fn used_bytes(path: &std::path::Path) -> Option<u64> {
    let v = nix::sys::statvfs::statvfs(path).ok()?;
    let frag = v.fragment_size() as u64;
    Some((v.blocks() as u64).saturating_sub(v.blocks_free() as u64) * frag)
}

/// The value of `key` in a cgroup `key value` file (memory.stat, cpu.stat).
pub fn stat_value(path: &std::path::Path, key: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// One isolation mechanism.
#[async_trait::async_trait]
pub trait Sandbox: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// Whether runs of this backend reach the network only through the daemon's egress proxy.
    fn supports_egress(&self) -> bool {
        false
    }

    /// Whether this backend can run work right now, and why not.
    async fn status(&self) -> BackendStatus;

    /// Ends this backend before the daemon exits, once no run or session uses it: makes no
    /// sandbox from now on and removes those it kept ready. Nothing to do by default.
    async fn shutdown(&self) {}

    /// Runs `spec` to an outcome. Must leave nothing behind, whatever happens, including when the
    /// returned future is dropped.
    async fn run(&self, spec: RunSpec) -> Result<RunOutcome, SandboxError>;

    /// What the runs of session `session_id` use together now, on a backend whose session runs
    /// are fresh sandboxes (local: their group's cgroup). None: no run of it lives, or the
    /// session's kept sandbox answers instead ([`files::Kept::usage`]). Blocking (reads cgroup
    /// files).
    fn session_usage(&self, _session_id: &str) -> Option<Usage> {
        None
    }

    /// Opens a sandbox kept for session `session_id`, shaped like `spec`'s (profile, limits, user,
    /// workdir; its argv is not run): later runs whose [`RunSpec::kept`] is it run inside it.
    /// `warm`: sandboxes of this shape are worth keeping ready (the profile's own limits; a shape
    /// the caller chose freely is not). `None`: this backend keeps no sandbox (local: each exec
    /// gets a fresh sandbox bound to the session's host workspace).
    async fn keep(
        &self,
        _spec: &RunSpec,
        _session_id: &str,
        _warm: bool,
    ) -> Result<Option<std::sync::Arc<dyn files::Kept>>, SandboxError> {
        Ok(None)
    }
}

/// A run spec for unit tests of the backends: `argv` as given, the default profile's limits,
/// no network, no paths, uid/gid 65534. Tests override what they exercise.
#[cfg(test)]
pub(crate) fn test_spec(argv: &[&str]) -> RunSpec {
    RunSpec {
        exec_id: "exec-test".into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        stdin: None,
        env: BTreeMap::new(),
        limits: Limits {
            cpus: 0.5,
            memory_bytes: 512 << 20,
            disk_bytes: 100 << 20,
            timeout: Duration::from_secs(30),
            pids: 64,
            output_bytes: 1 << 20,
            on_overflow: OnOverflow::Truncate,
            nofile: 256,
        },
        network: NetworkPolicy::None,
        fs: FsRules {
            read_only: vec![],
            extra_files: vec![],
            workdir: PathBuf::from("/work"),
            workspace: None,
            cwd: None,
            pty: false,
        },
        uid: 65534,
        gid: 65534,
        landlock_abi: 0,
        image: None,
        profile: "test".into(),
        stop: None,
        output_tap: None,
        kept: None,
        code: None,
        controls: None,
        background: false,
        group: None,
        reuse_scope: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_size_follows_the_kernel_limits() {
        let env = |k: &'static str, v: &'static str| std::iter::once((k, v));
        let arg = |n: usize| "a".repeat(n);
        let fits = arg(MAX_ARG_STRLEN - 1);
        let over = arg(MAX_ARG_STRLEN);
        assert!(check_exec_size(["/bin/echo", fits.as_str()], env("A", "b")).is_ok());
        let e = check_exec_size(["/bin/echo", over.as_str()], env("A", "b")).unwrap_err();
        assert!(e.contains("argument 1") && e.contains("131071"), "{e}");
        // An env entry counts as NAME=value.
        let v = arg(MAX_ARG_STRLEN - 3);
        assert!(check_exec_size(["/bin/echo"], [("A", v.as_str())]).is_ok());
        let v = arg(MAX_ARG_STRLEN - 2);
        let e = check_exec_size(["/bin/echo"], [("A", v.as_str())]).unwrap_err();
        assert!(e.contains("'A'"), "{e}");
        // Many strings that each fit can still exceed the total.
        let many: Vec<String> = (0..9).map(|_| arg(120_000)).collect();
        let e = check_exec_size(many.iter().map(String::as_str), std::iter::empty()).unwrap_err();
        assert!(e.contains(&MAX_EXEC_BYTES.to_string()), "{e}");
        assert!(check_exec_size(many[..8].iter().map(String::as_str), std::iter::empty()).is_ok());
    }
}
