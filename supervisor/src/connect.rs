//! Mode "connect" (`UID GID WORKDIR connect PORT`): a connection to `127.0.0.1:PORT` inside the
//! container, for a session's ports proxy where the daemon cannot enter the container's network
//! stack itself (gVisor). Started by the daemon as a docker exec as root; becomes UID:GID (no
//! supplementary group, so no run's marker: it can signal nothing of a run and no run can be
//! told apart by it), connects, writes one byte [`PORT_CONNECTED`] on stdout, then copies stdin
//! to the socket and the socket to stdout until both directions ended. A refusal is a line on
//! stderr and exit status 1. Single-threaded: one poll(2) loop.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd};

use executor_arm_supervisor::protocol::PORT_CONNECTED;
use nix::unistd::{Gid, Uid};

/// Bytes moved per read.
const CHUNK: usize = 64 * 1024;

fn refuse(msg: &str) -> ! {
    let _ = std::io::stderr().write_all(format!("{msg}\n").as_bytes());
    super::exit_now(1)
}

/// Serves the connection; never returns.
pub fn serve(uid: Uid, gid: Gid, port: u16) -> ! {
    if let Err(e) = super::become_user(uid, gid, None) {
        refuse(&format!("cannot become the sandbox's user: {e}"));
    }
    let mut sock = match TcpStream::connect(("127.0.0.1", port)) {
        Ok(s) => s,
        Err(e) => refuse(&format!("connect 127.0.0.1:{port}: {e}")),
    };
    let _ = sock.set_nodelay(true);
    if super::write_all(super::stdout_fd(), &[PORT_CONNECTED]).is_err() {
        super::exit_now(3);
    }
    let mut buf = vec![0u8; CHUNK];
    let (mut from_stdin, mut from_sock) = (true, true);
    while from_sock {
        let mut fds = [
            libc::pollfd {
                fd: if from_stdin { 0 } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of 2 pollfd structs for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            super::exit_now(4);
        }
        if from_stdin && fds[0].revents != 0 {
            match nix::unistd::read(super::stdin_fd(), &mut buf) {
                Ok(0) | Err(_) => {
                    from_stdin = false;
                    let _ = sock.shutdown(Shutdown::Write);
                }
                Ok(k) => {
                    if sock.write_all(&buf[..k]).is_err() {
                        super::exit_now(0);
                    }
                }
            }
        }
        if fds[1].revents != 0 {
            match sock.read(&mut buf) {
                Ok(0) | Err(_) => from_sock = false,
                Ok(k) => {
                    if super::write_all(super::stdout_fd().as_fd(), &buf[..k]).is_err() {
                        super::exit_now(0);
                    }
                }
            }
        }
    }
    super::exit_now(0)
}
