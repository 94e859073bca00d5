//! Mode `pty`: a session's terminal, run as an ordinary command of the sandbox (a background
//! process, with the sandbox user's identity and no capabilities).
//!
//! Usage: `executor-arm-supervisor pty [OPTION...] SHELL...`: the first SHELL that exists and is
//! executable runs on a new pseudo-terminal of the sandbox's own devpts (`/dev/ptmx`), in a
//! session of its own with the terminal as its controlling terminal (setsid, TIOCSCTTY), argv
//! `[SHELL]`, the environment as given (`TERM` added when missing). Options, before the shells:
//! `--cols N` and `--rows N` (the first size, each 1..=4096; 80 by 24 otherwise), `--cwd DIR`
//! (where it starts; the run's directory otherwise), and `--exec PROGRAM [ARG...]`, which ends
//! the options and runs PROGRAM (a path, or a name looked up in `PATH`) with argv
//! `[PROGRAM, ARG...]` instead of a shell.
//!
//! Relay: stdin carries control frames ([`executor_arm_supervisor::protocol::control`]): `i`
//! bytes go to the terminal's master, `w` resizes it (TIOCSWINSZ: the kernel sends SIGWINCH),
//! `s` signals the terminal's foreground process group, `c` (or stdin's end) hangs up. Whatever
//! the master gives is written raw to stdout. A hang-up sends SIGHUP (then SIGCONT) to the
//! shell's session, closes the master, waits a little for the shell, then kills its process
//! group; the run's own end (the daemon's) kills whatever else is left. Exit status: the
//! shell's (128 + signal).
//!
//! Single-threaded, non-dumpable, never a shell between argv and execve: the SHELL runs as a
//! list, with exactly 0, 1 and 2 (the slave).

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use executor_arm_supervisor::protocol::{ControlDecoder, ControlFrame, MAX_TERMINAL_SIDE};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::pty::{PtyMaster, Winsize, grantpt, posix_openpt, ptsname_r, unlockpt};
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, fork};

/// Most bytes for the master held while the shell does not read them; stdin is not read past
/// it (the daemon's queue then fills and its sender waits).
const MAX_PENDING: usize = 1 << 20;
/// How long a hung-up shell has to end before its process group is killed.
const HANGUP_GRACE: Duration = Duration::from_millis(500);
/// The size a terminal starts with until the first resize.
const INITIAL: Winsize = Winsize {
    ws_row: 24,
    ws_col: 80,
    ws_xpixel: 0,
    ws_ypixel: 0,
};

fn die(msg: &str) -> ! {
    die_with(126, msg)
}

/// Ends with `code`, saying why on stderr (the run's stderr: the caller sees why the terminal
/// did not start).
fn die_with(code: i32, msg: &str) -> ! {
    let _ = nix::unistd::write(
        std::io::stderr().as_fd(),
        format!("pty: {msg}\n").as_bytes(),
    );
    super::exit_now(code)
}

/// What the terminal runs, as its arguments say.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    size: (u16, u16),
    cwd: Option<String>,
    run: Program,
}

#[derive(Debug, PartialEq, Eq)]
enum Program {
    /// The first of these that exists and is executable, as `[SHELL]`.
    Shells(Vec<String>),
    /// This argv: its first item the program.
    Exec(Vec<String>),
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, String> {
        let (mut cols, mut rows) = (INITIAL.ws_col, INITIAL.ws_row);
        let mut cwd = None;
        let mut at = 0;
        let side = |v: Option<&String>, what: &str| -> Result<u16, String> {
            v.and_then(|v| v.parse::<u16>().ok())
                .filter(|n| (1..=MAX_TERMINAL_SIDE).contains(n))
                .ok_or_else(|| format!("{what} takes a number 1..={MAX_TERMINAL_SIDE}"))
        };
        while let Some(a) = args.get(at) {
            match a.as_str() {
                "--cols" => cols = side(args.get(at + 1), "--cols")?,
                "--rows" => rows = side(args.get(at + 1), "--rows")?,
                "--cwd" => {
                    let dir = args.get(at + 1).filter(|d| !d.is_empty());
                    cwd = Some(dir.ok_or("--cwd takes a directory")?.clone());
                }
                "--exec" => {
                    let argv = args[at + 1..].to_vec();
                    if argv.first().is_none_or(String::is_empty) {
                        return Err("--exec takes a program".into());
                    }
                    return Ok(Options {
                        size: (cols, rows),
                        cwd,
                        run: Program::Exec(argv),
                    });
                }
                s if s.starts_with("--") => return Err(format!("unknown option {s}")),
                _ => break,
            }
            at += 2;
        }
        Ok(Options {
            size: (cols, rows),
            cwd,
            run: Program::Shells(args[at..].to_vec()),
        })
    }
}

/// The program `name` names: itself when it holds a `/`, else the first executable file of that
/// name in `PATH` (the shells' own search, done here: the child may only call async-signal-safe
/// functions between fork and execve).
fn find_program(name: &str) -> Option<String> {
    let executable = |p: &str| nix::unistd::access(p, nix::unistd::AccessFlags::X_OK).is_ok();
    let file = |p: &str| std::fs::metadata(p).is_ok_and(|m| m.is_file());
    if name.contains('/') {
        return (executable(name) && file(name)).then(|| name.to_string());
    }
    let path = std::env::var("PATH")
        .unwrap_or_else(|_| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| format!("{d}/{name}"))
        .find(|p| executable(p) && file(p))
}

/// A SIGTERM came for this process: the relay passes it on to the command.
static TERM_ASKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    TERM_ASKED.store(true, Ordering::SeqCst);
}

/// Runs the terminal; never returns.
pub fn run(args: &[String]) -> ! {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        die(&format!(
            "cannot make the supervisor non-dumpable: {}",
            e.desc()
        ));
    }
    let options = Options::parse(args).unwrap_or_else(|e| die(&e));
    if let Some(dir) = &options.cwd {
        nix::unistd::chdir(dir.as_str()).unwrap_or_else(|e| die(&format!("{dir}: {}", e.desc())));
    }
    let (program, argv) = match &options.run {
        Program::Shells(shells) => {
            let Some(shell) = shells.iter().find(|s| {
                s.starts_with('/')
                    && nix::unistd::access(s.as_str(), nix::unistd::AccessFlags::X_OK).is_ok()
            }) else {
                die(&format!("no shell among {shells:?}"));
            };
            (shell.clone(), vec![shell.clone()])
        }
        Program::Exec(argv) => {
            let Some(program) = find_program(&argv[0]) else {
                die_with(127, &format!("{}: not found", argv[0]));
            };
            (program, argv.clone())
        }
    };
    let master = open_master().unwrap_or_else(|e| die(&e));
    let slave_name = ptsname_r(&master).unwrap_or_else(|e| die(&format!("ptsname: {}", e.desc())));
    set_size(
        master.as_fd(),
        Winsize {
            ws_col: options.size.0,
            ws_row: options.size.1,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    );
    let program_c = CString::new(program).unwrap_or_else(|_| die("NUL in the program"));
    let argv_c: Vec<CString> = argv
        .into_iter()
        .map(|a| CString::new(a).unwrap_or_else(|_| die("NUL in an argument")))
        .collect();
    // The slave is opened before the fork and the shell inherits it: the master never sees a
    // terminal whose slave was not opened yet (gVisor reports that as a hang-up).
    let slave = nix::fcntl::open(
        slave_name.as_str(),
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap_or_else(|e| die(&format!("{slave_name}: {}", e.desc())));
    let mut env: Vec<CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut kv = k.into_encoded_bytes();
            kv.push(b'=');
            kv.extend_from_slice(v.as_encoded_bytes());
            CString::new(kv).ok()
        })
        .collect();
    if std::env::var_os("TERM").is_none() {
        env.push(c"TERM=xterm-256color".into());
    }
    // The NULL-ended pointer arrays execve takes, made before the fork: the child allocates
    // nothing.
    let argv_p: Vec<*const libc::c_char> = argv_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const libc::c_char> = env
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    // SAFETY: single-threaded: the child only calls async-signal-safe functions (setsid, open,
    // ioctl, dup2, execve, _exit) on values prepared before the fork.
    let shell_pid = match unsafe { fork() } {
        Err(e) => die(&format!("fork: {}", e.desc())),
        Ok(ForkResult::Child) => child(&program_c, &argv_p, slave.as_raw_fd(), &envp),
        Ok(ForkResult::Parent { child }) => child,
    };
    drop(slave);
    // A SIGTERM for the terminal is its command's (an interactive shell ignores it, as it would
    // on any terminal); the hang-up and SIGKILL still end everything.
    super::set_handler(
        Signal::SIGTERM,
        nix::sys::signal::SigHandler::Handler(on_term),
    );
    relay(master, shell_pid)
}

fn open_master() -> Result<PtyMaster, String> {
    let m = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
        .map_err(|e| format!("/dev/ptmx: {}", e.desc()))?;
    grantpt(&m).map_err(|e| format!("grantpt: {}", e.desc()))?;
    unlockpt(&m).map_err(|e| format!("unlockpt: {}", e.desc()))?;
    Ok(m)
}

fn set_size(fd: BorrowedFd<'_>, size: Winsize) {
    // SAFETY: TIOCSWINSZ reads one `struct winsize` from a valid pointer; fd is the master.
    unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &raw const size) };
}

/// The shell's process: a session of its own, the slave (`fd`) as its controlling terminal and its
/// 0, 1 and 2, default signals, then execve of `program` with `argv` and `envp` (each a
/// NULL-ended array of pointers to strings that outlive the call). Never returns.
fn child(
    program: &CString,
    argv: &[*const libc::c_char],
    fd: libc::c_int,
    envp: &[*const libc::c_char],
) -> ! {
    super::default_signals();
    // SAFETY: async-signal-safe calls only (see the fork above); every pointer is a
    // NUL-terminated string or array prepared before the fork, and the process ends in execve or
    // _exit.
    unsafe {
        if libc::setsid() < 0 {
            libc::_exit(126);
        }
        if libc::ioctl(fd, libc::TIOCSCTTY, 0) < 0 {
            libc::_exit(126);
        }
        for target in 0..3 {
            if libc::dup2(fd, target) < 0 {
                libc::_exit(126);
            }
        }
        if fd > 2 {
            libc::close(fd);
        }
        libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
        libc::_exit(127)
    }
}

/// Stdin's frames to the master, the master's bytes to stdout, until the shell ends or the
/// terminal is hung up.
fn relay(master: PtyMaster, shell: Pid) -> ! {
    let fl = OFlag::from_bits_truncate(
        nix::fcntl::fcntl(&master, nix::fcntl::FcntlArg::F_GETFL).unwrap_or(0),
    );
    let _ = nix::fcntl::fcntl(
        &master,
        nix::fcntl::FcntlArg::F_SETFL(fl | OFlag::O_NONBLOCK),
    );
    let mut decoder = ControlDecoder::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut status: Option<i32> = None;
    loop {
        if status.is_none() {
            status = reaped(shell, WaitPidFlag::WNOHANG);
        }
        if TERM_ASKED.swap(false, Ordering::SeqCst) && status.is_none() {
            let _ = kill(shell, Signal::SIGTERM);
        }
        let stdin = super::stdin_fd();
        let mut fds = vec![PollFd::new(master.as_fd(), PollFlags::POLLIN)];
        if !pending.is_empty() {
            fds[0] = PollFd::new(master.as_fd(), PollFlags::POLLIN | PollFlags::POLLOUT);
        }
        let read_stdin = pending.len() < MAX_PENDING;
        if read_stdin {
            fds.push(PollFd::new(stdin, PollFlags::POLLIN));
        }
        // The shell's exit comes as SIGCHLD, which does not wake poll here: a bounded wait.
        match poll(&mut fds, PollTimeout::from(200u16)) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => die(&format!("poll: {}", e.desc())),
        }
        let m = fds[0].revents().unwrap_or(PollFlags::empty());
        let s = fds
            .get(1)
            .and_then(PollFd::revents)
            .unwrap_or(PollFlags::empty());
        drop(fds);
        if m.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
            match nix::unistd::read(&master, &mut buf) {
                Ok(0) | Err(Errno::EIO) => {
                    // Every holder of the slave is gone: the terminal is over.
                    hang_up(master, shell, status)
                }
                Ok(n) => {
                    if super::write_all(super::stdout_fd(), &buf[..n]).is_err() {
                        hang_up(master, shell, status)
                    }
                }
                Err(_) => {}
            }
        }
        if !pending.is_empty() && m.contains(PollFlags::POLLOUT) {
            match nix::unistd::write(&master, &pending) {
                Ok(n) => {
                    pending.drain(..n);
                }
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(_) => hang_up(master, shell, status),
            }
        }
        if read_stdin && s.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
            match nix::unistd::read(stdin, &mut buf) {
                Ok(0) => hang_up(master, shell, status),
                Ok(n) => decoder.push(&buf[..n]),
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(_) => hang_up(master, shell, status),
            }
            loop {
                match decoder.next_control() {
                    Ok(None) => break,
                    Ok(Some(ControlFrame::Stdin(b))) => pending.extend_from_slice(&b),
                    Ok(Some(ControlFrame::Resize { cols, rows })) => set_size(
                        master.as_fd(),
                        Winsize {
                            ws_row: rows,
                            ws_col: cols,
                            ws_xpixel: 0,
                            ws_ypixel: 0,
                        },
                    ),
                    Ok(Some(ControlFrame::Signal(n))) => {
                        if let Ok(sig) = Signal::try_from(n) {
                            let group = nix::unistd::tcgetpgrp(&master).unwrap_or(shell);
                            let _ = killpg(group, sig);
                        }
                    }
                    Ok(Some(ControlFrame::CloseStdin)) | Err(_) => hang_up(master, shell, status),
                }
            }
        }
        if let Some(code) = status {
            // The shell ended: what it wrote last is drained above (the master reads EIO once
            // nothing holds the slave); a child of it still holding the slave is hung up.
            if !m.contains(PollFlags::POLLIN) {
                hang_up(master, shell, Some(code))
            }
        }
    }
}

/// The shell's exit status once it ended.
fn reaped(shell: Pid, flags: WaitPidFlag) -> Option<i32> {
    match waitpid(shell, Some(flags)) {
        Ok(WaitStatus::Exited(_, c)) => Some(c),
        Ok(WaitStatus::Signaled(_, s, _)) => Some(128 + s as i32),
        Err(Errno::ECHILD) => Some(0),
        _ => None,
    }
}

/// Hangs the terminal up and ends with the shell's status: SIGHUP and SIGCONT to its session's
/// process group, the master closed (the kernel hangs up the slave: every process that has it
/// as controlling terminal gets SIGHUP), a short wait, SIGKILL to the group.
fn hang_up(master: PtyMaster, shell: Pid, status: Option<i32>) -> ! {
    if status.is_none() {
        let _ = killpg(shell, Signal::SIGHUP);
        let _ = killpg(shell, Signal::SIGCONT);
    }
    drop(master);
    let mut status = status;
    let until = Instant::now() + HANGUP_GRACE;
    while status.is_none() && Instant::now() < until {
        status = reaped(shell, WaitPidFlag::WNOHANG);
        if status.is_none() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _ = killpg(shell, Signal::SIGKILL);
    let _ = kill(shell, Signal::SIGKILL);
    let code = status
        .or_else(|| reaped(shell, WaitPidFlag::empty()))
        .unwrap_or(0);
    super::exit_now(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, String> {
        Options::parse(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn options_come_before_the_shells_or_the_program() {
        assert_eq!(
            parse(&["/bin/bash", "/bin/sh"]).unwrap(),
            Options {
                size: (80, 24),
                cwd: None,
                run: Program::Shells(vec!["/bin/bash".into(), "/bin/sh".into()]),
            }
        );
        assert_eq!(
            parse(&[
                "--cols", "120", "--rows", "40", "--cwd", "/tmp", "--exec", "bash", "-i", "--cols"
            ])
            .unwrap(),
            Options {
                size: (120, 40),
                cwd: Some("/tmp".into()),
                run: Program::Exec(vec!["bash".into(), "-i".into(), "--cols".into()]),
            }
        );
        for bad in [
            &["--cols", "0", "/bin/sh"][..],
            &["--rows", "4097", "/bin/sh"],
            &["--rows"],
            &["--cwd", "", "/bin/sh"],
            &["--exec"],
            &["--exec", ""],
            &["--size", "1"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_program_without_a_slash_is_found_in_path() {
        assert_eq!(find_program("/bin/sh").as_deref(), Some("/bin/sh"));
        assert!(find_program("sh").is_some_and(|p| p.ends_with("/sh")));
        assert_eq!(find_program("no-such-program-here"), None);
        assert_eq!(find_program("/no/such/program"), None);
        assert_eq!(find_program("/"), None);
    }
}
