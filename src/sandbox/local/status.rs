//! The pipes the sandbox's processes answer the daemon through, daemon side: the status pipe
//! (fixed-size records: a setup error with its stage and errno, or how the command ended; the
//! writers are in `child.rs`), and the hello pipe that tells the shim's host pid; with [`pipe`],
//! which makes every pipe of a run (these two, stdio and the egress go-signal).
//! Must not: decide the run's outcome beyond picking the record that tells it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::AsyncReadExt;

use super::child;
use crate::sandbox::SandboxError;

/// A new pipe (read end, write end) with `flags` (`O_CLOEXEC`, `O_NONBLOCK`).
pub(super) fn pipe(flags: libc::c_int) -> Result<(OwnedFd, OwnedFd), SandboxError> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two fds into the array we pass.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), flags) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The status pipe: non-blocking, read once after the sandbox is gone.
pub(super) fn status_pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    pipe(libc::O_CLOEXEC | libc::O_NONBLOCK)
}

/// Reads the shim's host pid from the hello pipe.
pub(super) async fn read_pid(r: OwnedFd) -> std::io::Result<u32> {
    let mut r = tokio::net::unix::pipe::Receiver::from_owned_fd(r)?;
    let mut b = [0u8; 4];
    r.read_exact(&mut b).await?;
    Ok(u32::from_le_bytes(b))
}

/// The record that decides the run: a setup error if any process wrote one, else the last record.
/// The command process reports its own setup failures (rlimits, setuid, Landlock, seccomp, exec)
/// and `_exit`s 126; init then reports that exit. Taking the last record would turn a sandbox
/// that failed to start into an ordinary command exiting 126.
pub(super) fn read_status(fd: &OwnedFd) -> Option<[u8; child::RECORD_LEN]> {
    let mut buf = [0u8; 64];
    // SAFETY: read into a stack buffer of the given size (the fd is non-blocking).
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < child::RECORD_LEN as isize {
        return None;
    }
    pick_record(&buf[..n as usize])
}

/// The setup failure a sandbox process reported, if any.
pub(super) fn setup_error(fd: &OwnedFd) -> Option<SandboxError> {
    match read_status(fd)? {
        [child::TAG_SETUP_ERROR, stage, _, _, a, b, c, d] => {
            Some(setup_failure(stage, [a, b, c, d]))
        }
        _ => None,
    }
}

pub(super) fn setup_failure(stage: u8, errno: [u8; 4]) -> SandboxError {
    let errno = i32::from_le_bytes(errno);
    let msg = format!(
        "{}: {}",
        child::Stage::from_u8(stage),
        std::io::Error::from_raw_os_error(errno)
    );
    // The run's process is forked inside the run's cgroup: EAGAIN there is its pids limit (in a
    // session, the session's other processes hold every pid).
    if stage == child::Stage::Fork as u8 && errno == libc::EAGAIN {
        return SandboxError::PidsExhausted(msg);
    }
    SandboxError::Setup(msg)
}

fn pick_record(bytes: &[u8]) -> Option<[u8; child::RECORD_LEN]> {
    let records = bytes.chunks_exact(child::RECORD_LEN);
    let chosen = records
        .clone()
        .find(|r| r[0] == child::TAG_SETUP_ERROR)
        .or_else(|| records.last())?;
    let mut rec = [0u8; child::RECORD_LEN];
    rec.copy_from_slice(chosen);
    Some(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tag: u8, stage: u8, v: i32) -> [u8; child::RECORD_LEN] {
        let b = v.to_le_bytes();
        [tag, stage, 0, 0, b[0], b[1], b[2], b[3]]
    }

    #[test]
    fn a_setup_error_wins_over_the_exit_it_caused() {
        let err = rec(
            child::TAG_SETUP_ERROR,
            child::Stage::Exec as u8,
            libc::EAGAIN,
        );
        let exit = rec(child::TAG_EXITED, 0, 126);
        assert_eq!(pick_record(&[err, exit].concat()), Some(err));
        assert_eq!(pick_record(&exit), Some(exit));
        let sig = rec(child::TAG_SIGNALED, 0, libc::SIGKILL);
        assert_eq!(pick_record(&[exit, sig].concat()), Some(sig));
        // A torn trailing record is ignored; nothing at all is None.
        assert_eq!(pick_record(&[&exit[..], &[1, 2, 3]].concat()), Some(exit));
        assert_eq!(pick_record(&[]), None);
    }
}
