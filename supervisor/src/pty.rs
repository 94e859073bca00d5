//! Mode `pty`: a session's terminal, run as an ordinary command of the sandbox (a background
//! process, with the sandbox user's identity and no capabilities).
//!
//! Usage: `executor-arm-supervisor pty SHELL...`: the first SHELL that exists and is executable
//! runs on a new pseudo-terminal of the sandbox's own devpts (`/dev/ptmx`), in a session of its
//! own with the terminal as its controlling terminal (setsid, TIOCSCTTY), argv `[SHELL]`, the
//! environment as given (`TERM` added when missing).
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
use std::time::{Duration, Instant};

use executor_arm_supervisor::protocol::{ControlDecoder, ControlFrame};
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
    // stderr is the run's stderr: the caller sees why the terminal did not start.
    let _ = nix::unistd::write(
        std::io::stderr().as_fd(),
        format!("pty: {msg}\n").as_bytes(),
    );
    super::exit_now(126)
}

/// Runs the terminal; never returns.
pub fn run(shells: &[String]) -> ! {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        die(&format!(
            "cannot make the supervisor non-dumpable: {}",
            e.desc()
        ));
    }
    let Some(shell) = shells.iter().find(|s| {
        s.starts_with('/')
            && nix::unistd::access(s.as_str(), nix::unistd::AccessFlags::X_OK).is_ok()
    }) else {
        die(&format!("no shell among {shells:?}"));
    };
    let master = open_master().unwrap_or_else(|e| die(&e));
    let slave_name = ptsname_r(&master).unwrap_or_else(|e| die(&format!("ptsname: {}", e.desc())));
    set_size(master.as_fd(), INITIAL);
    let shell_c = CString::new(shell.as_str()).unwrap_or_else(|_| die("NUL in the shell"));
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
    // SAFETY: single-threaded: the child only calls async-signal-safe functions (setsid, open,
    // ioctl, dup2, execve, _exit) on values prepared before the fork.
    let shell_pid = match unsafe { fork() } {
        Err(e) => die(&format!("fork: {}", e.desc())),
        Ok(ForkResult::Child) => child(&shell_c, slave.as_raw_fd(), &env),
        Ok(ForkResult::Parent { child }) => child,
    };
    drop(slave);
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
/// 0, 1 and 2, default signals, then execve. Never returns.
fn child(shell: &CString, fd: libc::c_int, env: &[CString]) -> ! {
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
        let argv = [shell.as_ptr(), std::ptr::null()];
        let mut envp: Vec<*const libc::c_char> = env.iter().map(|c| c.as_ptr()).collect();
        envp.push(std::ptr::null());
        libc::execve(shell.as_ptr(), argv.as_ptr(), envp.as_ptr());
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
