//! The egress relay: `127.0.0.1:<port>` inside the container, every connection carried to the
//! daemon's proxy on a unix socket (the container has no other network; all policy lives in the
//! daemon's proxy). Runs in the supervisor's poll loop, non-blocking, bounded buffers.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// Connections at a time (two descriptors each; nofile is the profile's).
const RELAY_MAX: usize = 64;
/// Bytes buffered per direction.
const RELAY_BUF: usize = 65536;

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }

    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn shutdown_write(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Write),
            Stream::Unix(s) => s.shutdown(Shutdown::Write),
        };
    }
}

/// One side of a relayed connection: its peer's descriptor, bytes waiting to be written to it,
/// whether it sent EOF, whether we did.
struct Conn {
    stream: Stream,
    peer: RawFd,
    out: Vec<u8>,
    eof: bool,
    shut: bool,
}

pub struct Relay {
    listener: TcpListener,
    socket: String,
    conns: HashMap<RawFd, Conn>,
}

fn transient(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

impl Relay {
    /// Fails (the message of a `u` frame) before the command runs when the daemon's socket is
    /// out of reach (e.g. runsc without --host-uds=open). The proxy records nothing for a
    /// connection that sends nothing.
    pub fn open(port: u16, socket: &str) -> Result<Relay, String> {
        UnixStream::connect(socket).map_err(|e| {
            format!("egress relay cannot reach the daemon's proxy at {socket}: {e}")
        })?;
        // std sets SO_REUSEADDR on Unix listeners.
        let listener = TcpListener::bind(("127.0.0.1", port))
            .map_err(|e| format!("egress relay: cannot listen on 127.0.0.1:{port}: {e}"))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("egress relay: listen: {e}"))?;
        Ok(Relay {
            listener,
            socket: socket.to_string(),
            conns: HashMap::new(),
        })
    }

    /// What to poll: (descriptor, events).
    pub fn watch(&self) -> Vec<(RawFd, libc::c_short)> {
        let mut w = Vec::new();
        if self.conns.len() < 2 * RELAY_MAX {
            w.push((self.listener.as_raw_fd(), libc::POLLIN));
        }
        for (fd, c) in &self.conns {
            let peer_full = self
                .conns
                .get(&c.peer)
                .is_some_and(|p| p.out.len() >= RELAY_BUF);
            let mut ev = 0;
            if !c.eof && !peer_full {
                ev |= libc::POLLIN;
            }
            if !c.out.is_empty() {
                ev |= libc::POLLOUT;
            }
            if ev != 0 {
                w.push((*fd, ev));
            }
        }
        w
    }

    fn close(&mut self, fd: RawFd) {
        if let Some(c) = self.conns.remove(&fd) {
            self.conns.remove(&c.peer);
        }
    }

    /// One round after poll: `ready(fd, POLLIN|POLLOUT)` tells what poll reported.
    pub fn step(&mut self, ready: impl Fn(RawFd, libc::c_short) -> bool) {
        if ready(self.listener.as_raw_fd(), libc::POLLIN)
            && let Ok((t, _)) = self.listener.accept()
            && let Ok(u) = UnixStream::connect(&self.socket)
            && t.set_nonblocking(true).is_ok()
            && u.set_nonblocking(true).is_ok()
        {
            let (tf, uf) = (t.as_raw_fd(), u.as_raw_fd());
            let side = |stream, peer| Conn {
                stream,
                peer,
                out: Vec::new(),
                eof: false,
                shut: false,
            };
            self.conns.insert(tf, side(Stream::Tcp(t), uf));
            self.conns.insert(uf, side(Stream::Unix(u), tf));
        }
        // Descriptors are non-blocking: a readiness left over from a descriptor closed above
        // only yields EAGAIN.
        let mut buf = vec![0u8; RELAY_BUF];
        let fds: Vec<RawFd> = self.conns.keys().copied().collect();
        for fd in fds {
            let Some(c) = self.conns.get_mut(&fd) else {
                continue;
            };
            if ready(fd, libc::POLLIN) && !c.eof {
                match c.stream.read(&mut buf) {
                    Ok(0) => c.eof = true,
                    Ok(n) => {
                        let peer = c.peer;
                        if let Some(p) = self.conns.get_mut(&peer) {
                            p.out.extend_from_slice(&buf[..n]);
                        }
                    }
                    Err(e) if transient(&e) => {}
                    Err(_) => {
                        self.close(fd);
                        continue;
                    }
                }
            }
            let Some(c) = self.conns.get_mut(&fd) else {
                continue;
            };
            if ready(fd, libc::POLLOUT) && !c.out.is_empty() {
                match c.stream.write(&c.out) {
                    Ok(n) => {
                        c.out.drain(..n);
                    }
                    Err(e) if transient(&e) => {}
                    Err(_) => {
                        self.close(fd);
                        continue;
                    }
                }
            }
        }
        // An EOF is passed on once what came before it is delivered; a pair is done when both
        // directions are.
        let fds: Vec<RawFd> = self.conns.keys().copied().collect();
        for fd in fds {
            let Some(c) = self.conns.get(&fd) else {
                continue;
            };
            let (eof, shut, peer) = (c.eof, c.shut, c.peer);
            let Some(p) = self.conns.get_mut(&peer) else {
                continue;
            };
            if eof && !p.shut && p.out.is_empty() {
                p.stream.shutdown_write();
                p.shut = true;
            }
            if shut && p.shut {
                self.close(fd);
            }
        }
    }
}
