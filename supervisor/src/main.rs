//! executor-arm's container supervisor: PID 1 of every docker/gvisor sandbox.
//!
//! Usage: `executor-arm-supervisor UID GID WORKDIR [once|kept|spawn [AS]]` (or `... connect PORT`,
//! see [`connect`], or `executor-arm-supervisor pty SHELL...`, a session's terminal: see [`pty`]):
//! who the command runs
//! as, where, whether the container serves one request, a session's requests one after another,
//! or (spawn) one background run of a session beside them, and the RLIMIT_AS in bytes each
//! command process starts with (0: none). The wire protocol is
//! [`executor_arm_supervisor::protocol`].
//!
//! Mode "once" (every /execute container): waits (idle, possibly for a long time in the warm pool)
//! for ONE request on stdin, runs it, reports, exits. Exiting as PID 1 makes the kernel kill
//! whatever the command left behind. The command's process is forked while it waits (see
//! [`spawn`]), already with the command's identity, and only receives its argv when the request
//! comes. Mode "kept" (a session's container): serves requests one after another for the
//! session's life. Each run's command carries a marker group of its own ([`MARKER_BASE`]) that
//! every process it starts inherits and cannot shed; after each run every process carrying it is
//! killed before the report, so nothing of one exec outlives it, and nothing of another run (a
//! background one) is touched. Between runs it serves file calls in the workdir (in a helper with
//! the command's identity, see [`files`]) and reaps the orphans it inherits. Mode "spawn" (a
//! session's background run, started by the daemon as a docker exec as root, not PID 1): reads
//! one run request as once mode does, runs it with its own marker, reaps its run's orphans (a
//! child subreaper), and at the run's end (or its stdin's) kills every process of its marker and
//! reports. Never a shell: argv goes to execve as a list.
//!
//! Controls: a request whose stdin is streamed keeps the command's stdin open after its bytes;
//! while the run lasts the supervisor reads control frames from its own stdin (bytes for the
//! command's stdin, its end, a signal: TERM, INT and HUP go to the command's process, KILL to
//! every process of the run). Controls arriving after the run are dropped.
//!
//! Signals: SIGTERM is passed on to every process of the command (the daemon's grace before a
//! kill); SIGUSR1 kills every process of the command (kept mode's kill of one exec, which leaves
//! the container running). In kept mode the supervisor signals them itself (CAP_KILL), finding
//! them by their marker in /proc: the command's uid cannot signal root, so no process of an exec
//! can stop its own kill.
//!
//! Trust: the supervisor runs as root with only CAP_SETUID and CAP_SETGID (kept mode: and
//! CAP_KILL; raw TCP rules: CAP_NET_ADMIN and CAP_SETPCAP until the routes are made; no-new-
//! privileges, the container's seccomp profile) and makes itself non-dumpable
//! before anything else; the command runs as UID:GID with no supplementary groups (kept and spawn
//! modes: its run's marker only) and no capabilities (the switch is checked before execve), so it cannot ptrace this process, read its
//! memory, open its descriptors through /proc (its stdout is the report channel) or signal it.
//! Every descriptor of ours is close-on-exec: the command gets exactly 0, 1 and 2.
//!
//! Lifetime: the supervisor keeps reading stdin, which dockerd closes when the daemon's attach
//! connection goes (the container has StdinOnce), and it ends the run itself a little after the
//! request's timeout, in case the daemon can no longer do it.
//!
//! Egress relay (relay_port > 0): before the command starts, listen on 127.0.0.1:relay_port and
//! relay every connection to the daemon's proxy on the unix socket relay_socket ([`relay`]). The
//! relay runs in this process (PID 1), which the command cannot kill. It lives for one request: in
//! kept mode it closes with the exec (after the sweep), and the next exec's request opens it again
//! on the socket the daemon bound for that exec.
//! Raw TCP rules (runc): before the command starts, make the rules' ranges local and give up
//! CAP_NET_ADMIN (kept mode: on the first exec with rules; the routes stay for the container's
//! life), listen on the rule ports and relay each connection to the daemon's tcp_socket for
//! that request ([`tcp`]).
//!
//! Single-threaded on purpose: it forks, and the children use the heap before execve.

mod archives;
mod connect;
mod files;
mod pty;
mod relay;
mod scrub;
mod tcp;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use executor_arm_supervisor::protocol::{
    ControlDecoder, ControlFrame, ExitReport, FILE_MAGIC, RUN_MAGIC, RunHeader, SCRUB_MAGIC,
    Status, control, encode_frame, kind,
};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::resource::{Resource, UsageWho, getrusage, setrlimit};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, kill, sigaction};
use nix::sys::stat::{Mode, umask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Pid, Uid, fork, pipe2};

/// Where a kept sandbox's exec code goes: a tmpfs of the container owned by root (this process),
/// so the command can read its code but neither change it nor plant the next exec's.
const CODE_DIR: &str = "/run/session";
/// Seconds the supervisor's own deadline leaves the daemon to end a timed-out run first.
const DEADLINE_GRACE: u64 = 5;
/// The capability's bit in /proc/self/status's CapEff (linux/capability.h).
const CAP_KILL: u32 = 5;
/// Run markers: the command of a run in a kept sandbox gets one extra supplementary group,
/// `MARKER_BASE` + the pid of the supervisor process serving the run (1: the kept PID 1's
/// foreground run; a `spawn` process's own pid: its background run), unique among the runs
/// alive in the container. Pids stay below 2^22 (the kernel's PID_MAX_LIMIT), so markers lie
/// in `MARKER_BASE + 1 ..= MARKER_BASE + 2^22`, far above any id a sandbox image or the
/// daemon's uid range gives out: no file is owned by one, so the group grants nothing. Without
/// CAP_SETGID a process cannot drop or change its supplementary groups (and no-new-privileges
/// keeps setgid binaries from granting it), so the marker follows every descendant,
/// double-forked and setsid'd ones included, and the run's kill finds them all by it. A command
/// may give its own files the marker as their group; that grants nothing, since every run of a
/// container has the same uid.
pub const MARKER_BASE: u32 = 2_000_000_000;
/// How long the kill of a run's processes may take before the supervisor gives up on it.
const SWEEP_LIMIT: Duration = Duration::from_secs(3);
/// Most stdin bytes of control frames held for a command that does not read them; past it
/// they are dropped and the run reports a broken stdin.
const MAX_PENDING_STDIN: usize = 4 << 20;

/// Who the command runs as, where, and how.
pub struct Config {
    pub uid: Uid,
    pub gid: Gid,
    pub workdir: String,
    pub kept: bool,
    /// Mode "spawn": a kept sandbox's background run, in a process of its own beside PID 1
    /// (`kept` is set too: it marks, kills and reports as kept mode does).
    pub spawn: bool,
    /// RLIMIT_AS of each command process (0: none).
    pub address_space: u64,
    /// The marker group of this process's runs (kept and spawn modes), see [`MARKER_BASE`]:
    /// fixed at start, from this process's own pid.
    pub marker: Option<Gid>,
    /// Mode "connect": the port of 127.0.0.1 this process connects its stdio to ([`connect`]).
    pub connect: Option<u16>,
}

/// The write end of the self-pipe: a signal between waitpid and poll must still wake poll.
static WAKE: AtomicI32 = AtomicI32::new(-1);
/// SIGTERM / SIGUSR1 seen (1), acted on (2).
static TERM: AtomicU8 = AtomicU8::new(0);
static KILL: AtomicU8 = AtomicU8::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    let byte: u8 = match sig {
        libc::SIGCHLD => b'c',
        libc::SIGTERM => {
            TERM.store(1, Ordering::SeqCst);
            b't'
        }
        libc::SIGUSR1 => {
            KILL.store(1, Ordering::SeqCst);
            b'k'
        }
        _ => return,
    };
    // SAFETY: write(2) and errno access are async-signal-safe; the pipe is non-blocking and the
    // buffer is one byte of this frame. errno is restored for the interrupted code.
    unsafe {
        let saved = *libc::__errno_location();
        libc::write(
            WAKE.load(Ordering::SeqCst),
            (&raw const byte).cast::<libc::c_void>(),
            1,
        );
        *libc::__errno_location() = saved;
    }
}

fn set_handler(sig: Signal, handler: SigHandler) {
    let action = SigAction::new(handler, SaFlags::SA_RESTART, SigSet::empty());
    // SAFETY: the handler only touches atomics and calls write(2), both async-signal-safe; the
    // process is single-threaded.
    let _ = unsafe { sigaction(sig, &action) };
}

/// The marker group of the run this process serves (kept and spawn modes; once mode has none:
/// its end as PID 1 kills everything).
fn marker(cfg: &Config) -> Option<Gid> {
    cfg.marker
}

/// In a child before execve or a helper: every signal's default disposition and none blocked.
/// Ignored signals and the signal mask stay across execve: the command must get neither our
/// handlers (they must not run in another identity) nor what our own parent ignored or blocked
/// (a daemon started as a shell's background job has SIGINT ignored, and the caller's INT would
/// never reach the command).
fn default_signals() {
    for s in Signal::iterator() {
        if s != Signal::SIGKILL && s != Signal::SIGSTOP {
            set_handler(s, SigHandler::SigDfl);
        }
    }
    let _ = SigSet::empty().thread_set_mask();
}

fn exit_now(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; nothing of ours needs flushing (frames are written
    // with write(2) directly).
    unsafe { libc::_exit(code) }
}

fn stdin_fd() -> BorrowedFd<'static> {
    // SAFETY: fd 0 stays open for the life of the process (the daemon's end of the request).
    unsafe { BorrowedFd::borrow_raw(0) }
}

fn stdout_fd() -> BorrowedFd<'static> {
    // SAFETY: fd 1 stays open for the life of the process (the report channel).
    unsafe { BorrowedFd::borrow_raw(1) }
}

/// Writes all of `buf` to `fd`, retrying on EINTR/EAGAIN-free descriptors.
fn write_all(fd: BorrowedFd<'_>, mut buf: &[u8]) -> Result<(), Errno> {
    while !buf.is_empty() {
        match nix::unistd::write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One frame of the report; a report channel that fails ends the container.
fn frame(kind: u8, payload: &[u8]) {
    if write_all(stdout_fd(), &encode_frame(kind, payload)).is_err() {
        exit_now(3);
    }
}

/// Exactly `n` bytes of the request; EOF (the daemon went away while we were idle) ends the
/// sandbox.
fn rd(n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    while (out.len() as u64) < n {
        let want = usize::try_from(n - out.len() as u64).map_or(buf.len(), |w| w.min(buf.len()));
        match nix::unistd::read(stdin_fd(), &mut buf[..want]) {
            Ok(0) => exit_now(0),
            Ok(got) => out.extend_from_slice(&buf[..got]),
            Err(Errno::EINTR) => {}
            Err(_) => exit_now(0),
        }
    }
    out
}

fn rd_u32() -> u64 {
    let b = rd(4);
    u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// A request that cannot run ends with its report: in once mode so does the sandbox, in kept
/// mode the next request is awaited.
pub struct Abandoned;

fn fail(msg: &str) -> Abandoned {
    frame(kind::FAILED, msg.as_bytes());
    Abandoned
}

/// A file or archive call whose helper could not be forked: EAGAIN (the sandbox's pids limit)
/// is the call's verdict, `err nopids`, which leaves the connection in step; anything else is a
/// setup failure.
fn fork_verdict(e: nix::errno::Errno) -> Abandoned {
    if e == nix::errno::Errno::EAGAIN {
        frame(
            kind::RESULT,
            format!("err nopids 0 fork: {}", e.desc()).as_bytes(),
        );
        return Abandoned;
    }
    fail(&format!("fork: {}", e.desc()))
}

/// A fork that failed: EAGAIN is the sandbox's pids limit (its processes hold every pid), which
/// the daemon tells its caller as retryable; anything else is a setup failure.
fn fork_failed(e: nix::errno::Errno) -> Abandoned {
    let msg = format!("fork: {}", e.desc());
    if e == nix::errno::Errno::EAGAIN {
        frame(kind::NO_PIDS, msg.as_bytes());
        return Abandoned;
    }
    fail(&msg)
}

fn unavailable(msg: &str) -> Abandoned {
    frame(kind::UNAVAILABLE, msg.as_bytes());
    Abandoned
}

/// The command's identity: its supplementary groups (none, or the run's marker), then the gid,
/// then the uid (each step needs the privilege the next one drops), checked before anything of
/// the request runs.
pub fn become_user(uid: Uid, gid: Gid, marker: Option<Gid>) -> Result<(), String> {
    let wanted: Vec<Gid> = std::iter::once(gid).chain(marker).collect();
    if let Err(e) = nix::unistd::setgroups(&wanted) {
        // Unprivileged (tests): acceptable only without a marker and when the groups already
        // are at most gid.
        let held = nix::unistd::getgroups().unwrap_or_default();
        if e != Errno::EPERM || marker.is_some() || held.iter().any(|g| *g != gid) {
            return Err(format!("setgroups({wanted:?}): {}", e.desc()));
        }
    }
    nix::unistd::setgid(gid).map_err(|e| format!("setgid({gid}): {}", e.desc()))?;
    nix::unistd::setuid(uid).map_err(|e| format!("setuid({uid}): {}", e.desc()))?;
    let (ru, rg, groups) = match (
        nix::unistd::getresuid(),
        nix::unistd::getresgid(),
        nix::unistd::getgroups(),
    ) {
        (Ok(u), Ok(g), Ok(gs)) => (u, g, gs),
        _ => return Err("cannot read the identity back".into()),
    };
    let uids_ok = ru.real == uid && ru.effective == uid && ru.saved == uid;
    let gids_ok = rg.real == gid && rg.effective == gid && rg.saved == gid;
    let marked = marker.is_none_or(|m| groups.contains(&m));
    if !uids_ok || !gids_ok || !marked || groups.iter().any(|g| !wanted.contains(g)) {
        return Err(format!(
            "identity not in effect (uid {} {} {}, gid {} {} {}, groups {groups:?})",
            ru.real, ru.effective, ru.saved, rg.real, rg.effective, rg.saved
        ));
    }
    if !uid.is_root() && nix::unistd::setuid(Uid::from_raw(0)).is_ok() {
        return Err("root could be regained".into());
    }
    Ok(())
}

/// Kept mode, as the command's user: the workspace stays usable to it whatever an earlier exec
/// did to its mode (a chmod 0 would otherwise fail every later exec and file call).
pub fn own_workspace(cfg: &Config) {
    if !cfg.kept {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(&cfg.workdir) {
        let mode = m.permissions().mode() & 0o7777;
        if mode & 0o700 != 0o700 {
            let _ = std::fs::set_permissions(
                &cfg.workdir,
                std::fs::Permissions::from_mode(mode | 0o700),
            );
        }
    }
}

/// The command's process, parent's side: its pid and the parent's ends of its pipes.
struct Prepared {
    pid: Pid,
    order: OwnedFd,
    out: OwnedFd,
    err: OwnedFd,
    exec: OwnedFd,
    input: OwnedFd,
}

fn cloexec_pipe() -> Result<(OwnedFd, OwnedFd), String> {
    pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {}", e.desc()))
}

/// The command's process, forked before its order and waiting for it: once mode makes it while
/// the container idles in the pool, because under gVisor forking is the costliest step of a run
/// (the sentry copies the address space); kept mode makes it per request. The child takes its
/// descriptors (stdin from a pipe, stdout and stderr into the report's pipes) and the command's
/// identity at once, then reads its order: whether stdin has bytes, the working directory, argv
/// and the environment, which it only ever receives from this process. A failure before execve
/// is written to the exec pipe. Err: why it could not fork (nothing is framed here, the request
/// reports it).
fn spawn(cfg: &Config) -> Result<Prepared, SpawnError> {
    let (out, ow) = cloexec_pipe().map_err(SpawnError::Setup)?;
    let (err, ew) = cloexec_pipe().map_err(SpawnError::Setup)?;
    let (exec, xw) = cloexec_pipe().map_err(SpawnError::Setup)?;
    let (ir, input) = cloexec_pipe().map_err(SpawnError::Setup)?;
    let (cr, order) = cloexec_pipe().map_err(SpawnError::Setup)?;
    // SAFETY: this process is single-threaded, so the child may do anything (including
    // allocating) before execve or _exit.
    match unsafe { fork() } {
        Err(e) => Err(SpawnError::Fork(e)),
        Ok(ForkResult::Child) => {
            drop((out, err, exec, input, order));
            child(cfg, ir, ow, ew, xw, cr)
        }
        Ok(ForkResult::Parent { child }) => Ok(Prepared {
            pid: child,
            order,
            out,
            err,
            exec,
            input,
        }),
    }
}

/// Why [`spawn`] made no process.
enum SpawnError {
    Setup(String),
    Fork(nix::errno::Errno),
}

impl SpawnError {
    /// Frames it as the request's report.
    fn report(self) -> Abandoned {
        match self {
            SpawnError::Setup(m) => fail(&m),
            SpawnError::Fork(e) => fork_failed(e),
        }
    }
}

/// The command's process until execve (see [`spawn`]).
fn child(cfg: &Config, ir: OwnedFd, ow: OwnedFd, ew: OwnedFd, xw: OwnedFd, cr: OwnedFd) -> ! {
    default_signals();
    let die = |msg: String| -> ! {
        let _ = write_all(xw.as_fd(), msg.as_bytes());
        exit_now(127)
    };
    // dup2 clears close-on-exec on 0, 1 and 2 only: nothing else of ours (the attach streams,
    // the relay's sockets, the order pipe) reaches the command.
    if nix::unistd::dup2_stdin(&ir).is_err()
        || nix::unistd::dup2_stdout(&ow).is_err()
        || nix::unistd::dup2_stderr(&ew).is_err()
    {
        die("cannot set up the command's standard streams".into());
    }
    drop((ir, ow, ew));
    // A container with raw TCP rules gives its supervisor CAP_NET_ADMIN (and CAP_SETPCAP to drop
    // it); the command's process gives them up first (the uid switch below clears the other
    // sets, this the bounding set).
    if let Err(why) = tcp::drop_route_privileges() {
        die(format!("cannot drop the routing capabilities: {why}"));
    }
    let (uid, gid) = (cfg.uid, cfg.gid);
    if let Err(why) = become_user(uid, gid, marker(cfg)) {
        die(format!("cannot run as {uid}:{gid}: {why}"));
    }
    // gVisor: the container's memory cgroup holds the sentry too, and a command that fills it
    // takes the whole sandbox down with it. Below it, an allocation past this limit fails in
    // the command (ENOMEM) and the sentry keeps its headroom.
    if cfg.address_space > 0 {
        let a = cfg.address_space;
        if let Err(e) = setrlimit(Resource::RLIMIT_AS, a, a) {
            die(format!(
                "cannot limit the address space to {a} bytes: {}",
                e.desc()
            ));
        }
    }
    let mut order = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match nix::unistd::read(cr.as_fd(), &mut buf) {
            Ok(0) | Err(Errno::EBADF) => break,
            Ok(n) => order.extend_from_slice(&buf[..n]),
            Err(Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    drop(cr);
    let fields: Vec<&[u8]> = order.split(|b| *b == 0).collect();
    let argc: usize = fields
        .get(2)
        .and_then(|f| std::str::from_utf8(f).ok())
        .and_then(|f| f.parse().ok())
        .unwrap_or(0);
    // No order (the request was abandoned): nothing runs.
    if argc == 0 || fields.len() < 3 + argc {
        die("the order of the command's process was incomplete".into());
    }
    let (has_in, cwd) = (fields[0] == b"1", fields[1]);
    let cstrings = |f: &[&[u8]]| -> Vec<CString> {
        f.iter()
            .map(|s| CString::new(*s).unwrap_or_default())
            .collect()
    };
    let argv = cstrings(&fields[3..3 + argc]);
    let env = cstrings(&fields[3 + argc..]);
    if !has_in {
        match nix::fcntl::open(
            "/dev/null",
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(null) => {
                if nix::unistd::dup2_stdin(&null).is_err() {
                    die("cannot open /dev/null for stdin: dup2".into());
                }
            }
            Err(e) => die(format!("cannot open /dev/null for stdin: {}", e.desc())),
        }
    }
    own_workspace(cfg);
    let cwd_text = String::from_utf8_lossy(cwd);
    if let Err(e) = nix::unistd::chdir(cwd) {
        die(format!(
            "cannot run as {uid}:{gid}: chdir {cwd_text}: {}",
            e.desc()
        ));
    }
    let e = match nix::unistd::execve(&argv[0], &argv, &env) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    die(format!(
        "cannot execute {}: {}",
        argv[0].to_string_lossy(),
        e.desc()
    ))
}

/// Sends `sig` to every process of the command. Once mode: from a helper with the command's
/// identity (this process keeps no CAP_KILL there): kill(-1) reaches every process that uid may
/// signal except PID 1 and the helper itself, i.e. the command and everything it started,
/// setsid'd or double-forked ones included. Kept and spawn modes: from this process, which holds
/// CAP_KILL there, to every process carrying the run's marker ([`signal_marked`]), so nothing
/// the command does (it runs as another uid) can stop it and no other run is touched.
fn signal_all(cfg: &Config, sig: Signal) {
    if let Some(m) = marker(cfg) {
        signal_marked(m, sig);
        return;
    }
    // SAFETY: fork(2) in a single-threaded process: the child owns a copy of every lock and
    // allocation state, so what it calls before exiting (no thread was holding anything) is sound.
    if let Ok(ForkResult::Child) = unsafe { fork() } {
        default_signals();
        // The helper needs no descriptor. It runs as the command's uid, which may stop it, so it
        // holds none of this process's: not the report channel (fds 0 and 1), not the relay
        // sockets, not the command's stdin pipe.
        // SAFETY: close_range(2) on every descriptor of this forked child; nothing in it uses one
        // afterwards (it only switches identity, signals and exits).
        unsafe { libc::close_range(0, libc::c_uint::MAX, 0) };
        if become_user(cfg.uid, cfg.gid, None).is_err() {
            exit_now(1);
        }
        // Non-dumpable whatever fs.suid_dumpable says: no process of the command's uid may read
        // or trace the helper.
        let _ = nix::sys::prctl::set_dumpable(false);
        let _ = kill(Pid::from_raw(-1), sig);
        exit_now(0);
    }
}

/// Every child that has exited, reaped; the status of `pid` if it was among them.
fn reap(pid: Option<Pid>) -> Option<WaitStatus> {
    let mut found = None;
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return found,
            Ok(ws) => {
                if ws.pid() == pid
                    && matches!(ws, WaitStatus::Exited(..) | WaitStatus::Signaled(..))
                {
                    found = Some(ws);
                }
            }
        }
    }
}

/// Whether a /proc/PID/status text is of a process carrying `marker` among its supplementary
/// groups, and whether it is still alive (not a zombie).
fn marked(status: &str, marker: Gid) -> (bool, bool) {
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_default()
    };
    let carries = field("Groups:")
        .split_whitespace()
        .any(|g| g.parse::<u32>().ok() == Some(marker.as_raw()));
    let dead = matches!(field("State:").trim_start().chars().next(), Some('Z' | 'X'));
    (carries, carries && !dead)
}

/// Sends `sig` to every process carrying `marker` (found in /proc); how many of them were
/// alive. Never this process or PID 1 (neither carries a marker).
fn signal_marked(marker: Gid, sig: Signal) -> usize {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut alive = 0;
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me || pid == 1 {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let (carries, live) = marked(&status, marker);
        // A zombie is signalled too: a thread-group leader that exited before its threads
        // shows as one.
        if carries && let Ok(pid) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(pid), sig);
            alive += usize::from(live);
        }
    }
    alive
}

/// Kept and spawn modes, at the end of each run: every process of the run (its marker) is
/// killed, pass after pass, until a scan finds none alive (zombies are reaped between passes).
/// Nothing of an exec may outlive it; processes of other runs are never touched. If some are
/// still there after [`SWEEP_LIMIT`], the kept PID 1 exits, which ends the whole container (the
/// daemon finds it gone); a spawn process says so and reports.
fn sweep(cfg: &Config) {
    let Some(m) = marker(cfg) else {
        return;
    };
    let until = Instant::now() + SWEEP_LIMIT;
    loop {
        let alive = signal_marked(m, Signal::SIGKILL);
        reap(None);
        if alive == 0 {
            return;
        }
        if Instant::now() > until {
            // The daemon logs this with the container's end (the exec then counts as killed).
            eprintln!(
                "executor-arm supervisor: processes of the run were still there after 3 s of kills"
            );
            if !cfg.spawn {
                exit_now(0);
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn first_num(paths: &[&str]) -> Option<u64> {
    paths.iter().find_map(|p| {
        let text = std::fs::read_to_string(p).ok()?;
        let digits: String = text
            .lines()
            .next()?
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    })
}

/// The number after `key ` in the first of `paths` that has one (None: not visible).
fn keyed(key: &str, paths: &[&str]) -> Option<u64> {
    paths.iter().find_map(|p| {
        let text = std::fs::read_to_string(p).ok()?;
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(' ')?;
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
    })
}

fn oom_kills() -> Option<u64> {
    keyed(
        "oom_kill",
        &[
            "/sys/fs/cgroup/memory/memory.oom_control",
            "/sys/fs/cgroup/memory.events",
        ],
    )
}

fn pids_max_hits() -> Option<u64> {
    keyed(
        "max",
        &[
            "/sys/fs/cgroup/pids/pids.events",
            "/sys/fs/cgroup/pids.events",
        ],
    )
}

/// What a counter grew by during one run of a kept sandbox (None when it is not visible).
fn grew(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after?.saturating_sub(before?))
}

fn is_code_path(p: &str) -> bool {
    let Some(name) = p.strip_prefix(CODE_DIR).and_then(|n| n.strip_prefix('/')) else {
        return false;
    };
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

fn write_code(path: &str, code: &[u8]) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("cannot write the code to {path}: {e}"))?;
    f.write_all(code)
        .map_err(|e| format!("cannot write the code to {path}: {e}"))
}

/// The raw wait status of `ws` (as wait(2) reports it).
fn raw_status(ws: WaitStatus) -> i32 {
    match ws {
        WaitStatus::Exited(_, code) => (code & 0xff) << 8,
        WaitStatus::Signaled(_, sig, core) => sig as i32 | if core { 0x80 } else { 0 },
        _ => -1,
    }
}

/// The raw TCP relay of a request with tcp rules (none without).
fn open_tcp(h: &RunHeader, routes: &mut tcp::Routes) -> Result<Option<tcp::TcpRelay>, Abandoned> {
    if h.tcp_rules.is_empty() {
        return Ok(None);
    }
    if h.relay_port == 0 {
        return Err(fail("raw TCP rules without the egress relay"));
    }
    match tcp::TcpRelay::open(&h.tcp_rules, &h.tcp_socket, h.relay_port, routes) {
        Ok(r) => Ok(Some(r)),
        Err(tcp::OpenError::Unreachable(m)) => Err(unavailable(&m)),
        Err(tcp::OpenError::Setup(m)) => Err(fail(&m)),
    }
}

/// One run request, after its magic: reads it, runs it, reports.
fn run_request(
    cfg: &Config,
    prepared: &mut Option<Result<Prepared, SpawnError>>,
    wake: &OwnedFd,
    routes: &mut tcp::Routes,
) -> Result<(), Abandoned> {
    let len = rd_u32();
    let raw = rd(len);
    let header = RunHeader::decode(&raw);
    // Whatever the header says, its data is read, so a kept sandbox's stream stays in step.
    let (input, code) = match &header {
        Ok(h) => (h.stdin_len.map(rd), h.code_len.map(rd)),
        Err(_) => (None, None),
    };
    let h = header.map_err(|e| fail(&e))?;
    if h.argv.is_empty() {
        return Err(fail("empty argv"));
    }
    if h.timeout_ms == 0 {
        return Err(fail("no timeout in the request"));
    }
    let cwd = if h.cwd.is_empty() {
        cfg.workdir.clone()
    } else {
        h.cwd.clone()
    };
    let inside = cwd == cfg.workdir || cwd.starts_with(&format!("{}/", cfg.workdir));
    if !inside || cwd.split('/').any(|c| c == "..") {
        return Err(fail(&format!("cwd {cwd} is not inside {}", cfg.workdir)));
    }
    let deadline =
        Instant::now() + Duration::from_secs(h.timeout_ms.div_ceil(1000) + DEADLINE_GRACE);
    TERM.store(0, Ordering::SeqCst);
    KILL.store(0, Ordering::SeqCst);
    let mut relay = if h.relay_port != 0 {
        Some(relay::Relay::open(h.relay_port, &h.relay_socket).map_err(|m| unavailable(&m))?)
    } else {
        None
    };
    let mut tcp_relay = open_tcp(&h, routes)?;
    if let Some(code) = &code {
        if !cfg.kept {
            return Err(fail("code files are for kept sandboxes"));
        }
        if !is_code_path(&h.code_path) {
            return Err(fail(&format!(
                "code path {} is not a file of {CODE_DIR}",
                h.code_path
            )));
        }
        write_code(&h.code_path, code).map_err(|m| fail(&m))?;
    }
    let code_path = code.as_ref().map(|_| h.code_path.clone());
    let remove_code = || {
        if let Some(p) = &code_path {
            let _ = std::fs::remove_file(p);
        }
    };
    let (oom0, pmax0) = if cfg.kept {
        (oom_kills(), pids_max_hits())
    } else {
        (None, None)
    };

    // The order: whether stdin has bytes, the working directory, then argv and the environment.
    let has_input = input.is_some() || h.stdin_stream;
    let mut order0: Vec<&str> = vec![if has_input { "1" } else { "0" }, &cwd];
    let argc = h.argv.len().to_string();
    order0.push(&argc);
    order0.extend(h.argv.iter().map(String::as_str));
    order0.extend(h.env.iter().map(String::as_str));
    let order0 = order0.join("\0");
    let mut why = String::new();
    let mut p = None;
    for _try in 0..2 {
        let next = match prepared.take() {
            Some(Ok(p)) => p,
            _ => spawn(cfg).map_err(|e| {
                remove_code();
                e.report()
            })?,
        };
        // A child that already ended reads none of the order; the failed write is only EPIPE
        // (SIGPIPE is ignored here).
        let delivered = write_all(next.order.as_fd(), order0.as_bytes()).is_ok();
        let Prepared {
            pid,
            order,
            out,
            err,
            exec,
            input: in_w,
        } = next;
        drop(order);
        // EOF on the exec pipe: execve succeeded (close-on-exec); anything else: why the
        // command could not start.
        let mut x = Vec::new();
        let mut buf = [0u8; 4096];
        while x.len() < 4096 {
            match nix::unistd::read(exec.as_fd(), &mut buf[..4096 - x.len()]) {
                Ok(0) => break,
                Ok(n) => x.extend_from_slice(&buf[..n]),
                Err(Errno::EINTR) => {}
                Err(_) => break,
            }
        }
        drop(exec);
        why = String::from_utf8_lossy(&x).into_owned();
        if !why.is_empty() || delivered {
            p = Some((pid, out, err, in_w));
            break;
        }
        // It ended before taking its whole order and said nothing (killed while the container
        // idled): nothing of the request ran, so a fresh process gets it, once.
        let status = loop {
            match waitpid(pid, None) {
                Err(Errno::EINTR) => {}
                Ok(ws) => break raw_status(ws),
                Err(_) => break -1,
            }
        };
        why = format!(
            "the command's process ended before it received its request (wait status {status})"
        );
    }
    let Some((pid, out, err, in_w)) = p else {
        remove_code();
        return Err(fail(&why));
    };
    if !why.is_empty() {
        let _ = waitpid(pid, None);
        remove_code();
        return Err(fail(&why));
    }
    let mut input_w = has_input.then_some(in_w);
    // Stdin bytes not yet taken by the command: the request's, then those of control frames
    // (streamed stdin); the pipe closes once they are written and no more can come.
    let mut pending: Vec<u8> = input.unwrap_or_default();
    let mut stdin_open = h.stdin_stream;
    let mut controls = ControlDecoder::default();
    if let Some(w) = &input_w {
        let _ = nix::fcntl::fcntl(w, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
    }
    let mut outputs: BTreeMap<RawFd, (OwnedFd, u8)> = BTreeMap::new();
    outputs.insert(out.as_raw_fd(), (out, kind::STDOUT));
    outputs.insert(err.as_raw_fd(), (err, kind::STDERR));
    // swept: kept mode killed whatever the command left once it exited.
    let (mut status, mut drain, mut broken, mut swept, mut late) =
        (None, 0u32, false, false, false);
    let mut buf = vec![0u8; 65536];
    loop {
        if !late && Instant::now() >= deadline {
            // Once mode: exiting as PID 1 ends everything. Kept mode: everything of the
            // command is killed, then the report says why.
            if !cfg.kept {
                frame(kind::DEADLINE, late_message().as_bytes());
                exit_now(0);
            }
            late = true;
            KILL.store(1, Ordering::SeqCst);
        }
        // PID 1 reaps every orphan; only the command's status is reported.
        if let Some(ws) = reap(Some(pid)) {
            status = Some(ws);
        }
        if status.is_some() && cfg.kept && !swept {
            // Nothing of an exec outlives it: its leftovers are killed before the report.
            sweep(cfg);
            swept = true;
        }
        let drained = |drain: &mut u32, most: u32| {
            let d = *drain;
            *drain += 1;
            d > most
        };
        if cfg.kept {
            // Every writer of the pipes is gone once the sweep is done: read them to their end.
            if swept && (outputs.is_empty() || drained(&mut drain, 256)) {
                break;
            }
        } else if status.is_some() && (outputs.is_empty() || drained(&mut drain, 64)) {
            // After the command exits, forward what is already buffered (bounded: a leftover
            // child may keep writing), then stop.
            break;
        }
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut watch = |fd: RawFd, events: libc::c_short| {
            fds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            })
        };
        for fd in outputs.keys() {
            watch(*fd, libc::POLLIN);
        }
        watch(wake.as_raw_fd(), libc::POLLIN);
        // The daemon's end: EOF means it is gone.
        watch(0, libc::POLLIN);
        if !stdin_open && pending.is_empty() {
            input_w = None;
        }
        if let (Some(w), None, false) = (&input_w, &status, pending.is_empty()) {
            watch(w.as_raw_fd(), libc::POLLOUT);
        }
        if let Some(r) = &relay {
            for (fd, ev) in r.watch() {
                watch(fd, ev);
            }
        }
        if let Some(r) = &tcp_relay {
            for (fd, ev) in r.watch() {
                watch(fd, ev);
            }
        }
        let timeout = if status.is_some() && !cfg.kept {
            0
        } else {
            200
        };
        // SAFETY: `fds` is a valid array of fds.len() pollfd structs for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            continue;
        }
        if n == 0 && status.is_some() && !cfg.kept {
            break;
        }
        let ready = |fd: RawFd, mask: libc::c_short| {
            fds.iter()
                .any(|p| p.fd == fd && p.revents & (mask | libc::POLLHUP | libc::POLLERR) != 0)
        };
        if ready(wake.as_raw_fd(), libc::POLLIN) {
            let _ = nix::unistd::read(wake.as_fd(), &mut buf[..64]);
        }
        if TERM
            .compare_exchange(1, 2, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            signal_all(cfg, Signal::SIGTERM);
        }
        if KILL
            .compare_exchange(1, 2, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            signal_all(cfg, Signal::SIGKILL);
        }
        if ready(0, libc::POLLIN) {
            match nix::unistd::read(stdin_fd(), &mut buf) {
                // The daemon is gone. Exiting as PID 1 kills the command and everything it
                // started; a spawn process kills its run's first.
                Ok(0) | Err(Errno::EBADF | Errno::EIO) => abandon(cfg),
                Ok(got) => {
                    controls.push(&buf[..got]);
                    loop {
                        let c = match controls.next_control() {
                            Ok(Some(c)) => c,
                            Ok(None) => break,
                            // Out of step with the daemon: nothing more can be trusted.
                            Err(_) => abandon(cfg),
                        };
                        let live = status.is_none();
                        match c {
                            ControlFrame::Stdin(b) if stdin_open && input_w.is_some() => {
                                if pending.len() + b.len() > MAX_PENDING_STDIN {
                                    broken = true;
                                } else {
                                    pending.extend_from_slice(&b);
                                }
                            }
                            ControlFrame::Stdin(_) => {}
                            ControlFrame::CloseStdin => stdin_open = false,
                            ControlFrame::Signal(n) if live && control::SIGNALS.contains(&n) => {
                                if n == libc::SIGKILL {
                                    signal_all(cfg, Signal::SIGKILL);
                                } else if let Ok(sig) = Signal::try_from(n) {
                                    let _ = kill(pid, sig);
                                }
                            }
                            ControlFrame::Signal(_) | ControlFrame::Resize { .. } => {}
                        }
                    }
                }
                Err(_) => {}
            }
        }
        let readable: Vec<RawFd> = outputs
            .keys()
            .copied()
            .filter(|fd| ready(*fd, libc::POLLIN))
            .collect();
        for fd in readable {
            let Some((h, k)) = outputs.get(&fd) else {
                continue;
            };
            match nix::unistd::read(h.as_fd(), &mut buf) {
                Ok(0) => {
                    outputs.remove(&fd);
                }
                Ok(got) => frame(*k, &buf[..got]),
                Err(Errno::EINTR) | Err(Errno::EAGAIN) => {}
                Err(_) => {
                    outputs.remove(&fd);
                }
            }
        }
        if let Some(w) = &input_w
            && ready(w.as_raw_fd(), libc::POLLOUT)
        {
            match nix::unistd::write(w, &pending) {
                Ok(n) => {
                    pending.drain(..n);
                }
                Err(Errno::EAGAIN) | Err(Errno::EINTR) => {}
                Err(_) => {
                    // The command closed its stdin: nothing more reaches it.
                    broken = true;
                    pending.clear();
                    stdin_open = false;
                    input_w = None;
                }
            }
        }
        if let Some(r) = relay.as_mut() {
            r.step(ready);
        }
        if let Some(r) = tcp_relay.as_mut() {
            r.step(ready);
        }
    }
    if input_w.is_some() && !pending.is_empty() {
        broken = true;
    }
    // A control frame half read when the run ended is read to its end (the daemon writes each
    // whole), so the next request starts in step; controls after the run are dropped.
    while controls.missing() > 0 {
        controls.push(&rd(controls.missing() as u64));
        while let Ok(Some(_)) = controls.next_control() {}
    }
    drop(relay);
    drop(tcp_relay);
    remove_code();
    if late {
        frame(kind::DEADLINE, late_message().as_bytes());
        return Ok(());
    }
    let Some(ws) = status else {
        return Err(fail("the command's status was lost"));
    };

    // Peak memory: the container's cgroup when it is visible (runc), else the largest reaped
    // process's peak RSS from getrusage(RUSAGE_CHILDREN) (gVisor has no cgroupfs inside the
    // sandbox). Both cover the container's whole life, so a kept sandbox reports none.
    let peak = if cfg.kept {
        None
    } else {
        first_num(&[
            "/sys/fs/cgroup/memory/memory.max_usage_in_bytes",
            "/sys/fs/cgroup/memory.peak",
        ])
        .map(|b| b / 1024)
        .or_else(|| {
            getrusage(UsageWho::RUSAGE_CHILDREN)
                .ok()
                .and_then(|r| u64::try_from(r.max_rss()).ok())
        })
    };
    let (mut oom, mut pmax) = (oom_kills(), pids_max_hits());
    if cfg.kept {
        (oom, pmax) = (grew(oom0, oom), grew(pmax0, pmax));
    }
    let status = match ws {
        WaitStatus::Signaled(_, sig, _) => Status::Signaled(sig as i32),
        WaitStatus::Exited(_, code) => Status::Exited(code),
        _ => return Err(fail("the command's status was lost")),
    };
    let report = ExitReport {
        status,
        stdin_broken_pipe: broken,
        peak_memory_kib: peak,
        oom_kills: oom,
        pids_max_hits: pmax,
    };
    frame(kind::EXIT, report.to_payload().as_bytes());
    Ok(())
}

/// The daemon's end of the stream closed (or went out of step): nothing can report any more.
/// PID 1 exits, which kills every process of the container; a spawn process kills its run's
/// processes first.
fn abandon(cfg: &Config) -> ! {
    if cfg.spawn {
        sweep(cfg);
    }
    exit_now(0)
}

fn late_message() -> String {
    format!("the run was still going {DEADLINE_GRACE} s after its timeout")
}

fn parse_args(args: &[String]) -> Option<Config> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let [uid, gid, workdir, rest @ ..] = args else {
        return None;
    };
    let mode = rest.first().map_or("once", String::as_str);
    if mode == "connect" {
        let [_, port] = rest else { return None };
        let port: u16 = port.parse().ok().filter(|p| *p > 0 && digits(port))?;
        if !digits(uid) || !digits(gid) {
            return None;
        }
        return Some(Config {
            uid: Uid::from_raw(uid.parse().ok()?),
            gid: Gid::from_raw(gid.parse().ok()?),
            workdir: workdir.clone(),
            kept: false,
            spawn: false,
            marker: None,
            address_space: 0,
            connect: Some(port),
        });
    }
    let address_space = rest.get(1).map_or("0", String::as_str);
    if rest.len() > 2
        || !digits(uid)
        || !digits(gid)
        || !digits(address_space)
        || !matches!(mode, "once" | "kept" | "spawn")
    {
        return None;
    }
    Some(Config {
        uid: Uid::from_raw(uid.parse().ok()?),
        gid: Gid::from_raw(gid.parse().ok()?),
        workdir: workdir.clone(),
        kept: mode != "once",
        spawn: mode == "spawn",
        marker: (mode != "once").then(|| Gid::from_raw(MARKER_BASE + std::process::id())),
        address_space: address_space.parse().ok()?,
        connect: None,
    })
}

/// Whether bit 5 (CAP_KILL) is in this process's effective capabilities.
fn holds_cap_kill() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|eff| eff & (1 << CAP_KILL) != 0)
}

/// Kept mode between requests: waits for the next one, reaping the orphans the container's
/// other processes (a background run's) leave to PID 1 meanwhile, so zombies never pile up
/// against the pids limit.
fn idle(wake: &OwnedFd) {
    let mut buf = [0u8; 64];
    loop {
        reap(None);
        let mut fds = [
            libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of 2 pollfd structs for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n > 0 && fds[1].revents != 0 {
            let _ = nix::unistd::read(wake.as_fd(), &mut buf);
        }
        if n > 0 && fds[0].revents != 0 {
            reap(None);
            return;
        }
    }
}

fn main() {
    // Bytes in, bytes out: frames go straight to fd 1 with write(2), never through std's
    // buffered stdout.
    set_handler(Signal::SIGPIPE, SigHandler::SigIgn);
    // Whatever descriptor was inherited beyond 0, 1 and 2 (none in a container) is closed, so
    // nothing but the command's pipes ever reaches it.
    // SAFETY: close_range(2) on descriptors this process does not use; no Rust object owns them.
    unsafe { libc::close_range(3, libc::c_uint::MAX, 0) };
    let args: Vec<String> = std::env::args().skip(1).collect();
    // A session's terminal: an ordinary command of the sandbox, not its PID 1 ([`pty`]).
    if args.first().map(String::as_str) == Some("pty") {
        pty::run(&args[1..]);
    }
    let Some(cfg) = parse_args(&args) else {
        frame(
            kind::FAILED,
            b"usage: UID GID WORKDIR [once|kept|spawn [AS]] | UID GID WORKDIR connect PORT",
        );
        exit_now(0);
    };
    // Before anything else: nothing in this container may trace us or read us through /proc.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        let msg = format!("cannot make the supervisor non-dumpable: {}", e.desc());
        frame(kind::FAILED, msg.as_bytes());
        exit_now(0);
    }
    umask(Mode::from_bits_truncate(0o022));
    if let Some(port) = cfg.connect {
        connect::serve(cfg.uid, cfg.gid, port);
    }
    if cfg.kept {
        // Kept mode kills the command's processes itself, with kill(-1): it must hold CAP_KILL
        // and be PID 1 of its own pid namespace (the container's), or kill(-1) would reach
        // processes outside the sandbox.
        if !holds_cap_kill() {
            frame(
                kind::FAILED,
                b"a kept sandbox needs CAP_KILL for its supervisor",
            );
            exit_now(0);
        }
        // It finds a run's processes in /proc: that must be its own pid namespace's.
        let own_proc = std::fs::read_link("/proc/self")
            .ok()
            .and_then(|p| p.to_str().and_then(|p| p.parse::<u32>().ok()));
        if own_proc != Some(std::process::id()) {
            frame(
                kind::FAILED,
                b"a kept sandbox's supervisor needs the /proc of its own pid namespace",
            );
            exit_now(0);
        }
        if !cfg.spawn && std::process::id() != 1 {
            frame(
                kind::FAILED,
                b"a kept sandbox's supervisor must be PID 1 of its own pid namespace",
            );
            exit_now(0);
        }
    }
    let (wake_r, wake_w) = match pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK) {
        Ok(p) => p,
        Err(e) => {
            frame(kind::FAILED, format!("pipe: {}", e.desc()).as_bytes());
            exit_now(0);
        }
    };
    WAKE.store(wake_w.as_raw_fd(), Ordering::SeqCst);
    for s in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGUSR1] {
        set_handler(s, SigHandler::Handler(on_signal));
    }
    // Once mode: the command's process is made now; if that failed, the request tries again and
    // reports why it could not.
    let mut prepared = (!cfg.kept).then(|| spawn(&cfg));
    let mut routes = tcp::Routes::default();
    if cfg.spawn {
        // Spawn mode: the run's orphans are this process's to reap (and kill), not PID 1's.
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes plain integers and touches no memory.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let magic = rd(4);
        if magic[..] == RUN_MAGIC[..] {
            let _ = run_request(&cfg, &mut prepared, &wake_r, &mut routes);
        } else {
            frame(kind::FAILED, b"a spawn supervisor serves one run request");
        }
        exit_now(0);
    }
    // Kept PID 1: the first state of the places a scrub empties.
    let places = if cfg.kept {
        scrub::places(&cfg)
    } else {
        Vec::new()
    };
    loop {
        if cfg.kept {
            idle(&wake_r);
        }
        let first = rd(1);
        if control::ALL.contains(&first[0]) {
            // A control the daemon sent as the previous run ended: dropped.
            let len = rd_u32();
            if len > executor_arm_supervisor::protocol::CHUNK as u64 {
                exit_now(2);
            }
            rd(len);
            continue;
        }
        let mut magic = first;
        magic.extend_from_slice(&rd(3));
        // An abandoned request has already reported why (its last frame).
        let _ = if magic[..] == RUN_MAGIC[..] {
            run_request(&cfg, &mut prepared, &wake_r, &mut routes)
        } else if cfg.kept && magic[..] == FILE_MAGIC[..] {
            files::file_request(&cfg)
        } else if cfg.kept && magic[..] == SCRUB_MAGIC[..] {
            scrub::scrub_request(&cfg, &places)
        } else {
            exit_now(2)
        };
        if !cfg.kept {
            exit_now(0);
        }
    }
}
