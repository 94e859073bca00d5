//! Raw TCP by rule inside a runc container: the rules' ranges made local on `lo`,
//! a listener on each rule port, and every accepted connection relayed to the daemon's raw TCP
//! socket after one line naming its destination (the accepted socket's local address).
//!
//! The daemon trusts nothing in that line: it judges the destination against the rules and its
//! deny list and connects from its own namespace (a command that reaches the socket itself and
//! lies reaches only what the rules allow). This side only makes the container's network
//! namespace deliver rule destinations here; an address outside every range has no route.
//!
//! Privilege: adding routes needs CAP_NET_ADMIN, which the container has only for profiles with
//! rules (with CAP_SETPCAP to give it up). [`TcpRelay::open`] adds the routes, then drops both
//! capabilities from this process's bounding, effective, permitted and inheritable sets, before
//! the command gets its order. A session's (kept) container does this on its first exec with
//! rules and keeps the routes for its life (its network namespace is its own); every later exec
//! carries the same rules and only listens ([`Routes`]). The command's process, forked earlier, drops them from its own
//! bounding set before it switches to the command's uid ([`drop_route_privileges`]), which
//! clears the rest.
//!
//! Non-blocking throughout, in the supervisor's poll loop: a unix connect that the daemon's
//! backlog defers is retried each round until [`CONNECT_TIMEOUT`], then the TCP side is reset.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use executor_arm_supervisor::protocol::{TcpRoute, tcp_preamble};
use executor_arm_supervisor::routes::add_local_routes;
use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrIn6, UnixAddr, bind, connect, listen,
    setsockopt, socket, sockopt,
};

/// Connections at a time (two descriptors each; nofile is the profile's).
const MAX_CONNS: usize = 64;
/// Bytes buffered per direction.
const BUF: usize = 65536;
/// How long an accepted connection may wait for the daemon's socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

const CAP_SETPCAP: u32 = 8;
const CAP_NET_ADMIN: u32 = 12;

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// The capability set `key` (`CapEff:`, `CapPrm:`, `CapBnd:`) of this (single-threaded) process.
fn caps(key: &str) -> Result<u64, String> {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .ok_or_else(|| format!("cannot read {key} of /proc/self/status"))
}

/// Drops CAP_NET_ADMIN and CAP_SETPCAP from the effective, permitted and inheritable sets and,
/// when CAP_SETPCAP is held (a container with raw TCP rules: the only place either is in the
/// bounding set, see the daemon's container plan), from the bounding set first; then checks that
/// they are gone. CAP_SETPCAP is dropped last: the other drops need it.
pub fn drop_route_privileges() -> Result<(), String> {
    let both: u64 = (1 << CAP_NET_ADMIN) | (1 << CAP_SETPCAP);
    let bounding_too = caps("CapEff:")? & (1 << CAP_SETPCAP) != 0;
    if bounding_too {
        for cap in [CAP_NET_ADMIN, CAP_SETPCAP] {
            // SAFETY: prctl(2) with integer arguments only.
            let held = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
            if held == 1
                // SAFETY: as above.
                && unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0
            {
                return Err(format!(
                    "dropping capability {cap} from the bounding set: {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
    }
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget(2) writes two cap_user_data structs (version 3) into `data`.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(format!("capget: {}", std::io::Error::last_os_error()));
    }
    let mask = !(both as u32);
    for set in [
        &mut data[0].effective,
        &mut data[0].permitted,
        &mut data[0].inheritable,
    ] {
        *set &= mask;
    }
    // SAFETY: capset(2) reads the two structs it was given; it only lowers the sets.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } != 0 {
        return Err(format!("capset: {}", std::io::Error::last_os_error()));
    }
    let mut check = vec!["CapEff:", "CapPrm:"];
    if bounding_too {
        check.push("CapBnd:");
    }
    for key in check {
        if caps(key)? & both != 0 {
            return Err(format!("{key} still holds CAP_NET_ADMIN or CAP_SETPCAP"));
        }
    }
    Ok(())
}

/// Why [`TcpRelay::open`] failed.
pub enum OpenError {
    /// The daemon's socket is out of reach (the `u` frame).
    Unreachable(String),
    /// Anything else (the `f` frame).
    Setup(String),
}

/// A listener on every address of `port`: IPv4, or IPv6 only (the IPv4 one serves IPv4).
fn listen_on(port: u16, v6: bool) -> Result<TcpListener, String> {
    let what = |e: Errno| {
        format!(
            "raw TCP: cannot listen on {}:{port}: {}",
            if v6 { "[::]" } else { "0.0.0.0" },
            e.desc()
        )
    };
    if !v6 {
        let l = TcpListener::bind(("0.0.0.0", port))
            .map_err(|e| format!("raw TCP: cannot listen on 0.0.0.0:{port}: {e}"))?;
        l.set_nonblocking(true)
            .map_err(|e| format!("raw TCP: listen: {e}"))?;
        return Ok(l);
    }
    let fd: OwnedFd = socket(
        AddressFamily::Inet6,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(what)?;
    setsockopt(&fd, sockopt::Ipv6V6Only, &true).map_err(what)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(what)?;
    let addr = SockaddrIn6::from(std::net::SocketAddrV6::new(
        std::net::Ipv6Addr::UNSPECIFIED,
        port,
        0,
        0,
    ));
    bind(fd.as_raw_fd(), &addr).map_err(what)?;
    listen(&fd, Backlog::new(128).map_err(what)?).map_err(what)?;
    Ok(TcpListener::from(fd))
}

/// A non-blocking connect to the daemon's socket: `Ok(None)` while its backlog defers it.
fn connect_unix(path: &str) -> Result<Option<UnixStream>, Errno> {
    let fd: OwnedFd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) => Ok(Some(UnixStream::from(fd))),
        Err(Errno::EAGAIN) | Err(Errno::EINTR) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Closes with a reset, so the command sees a refusal rather than an orderly end.
fn reset(t: TcpStream) {
    let _ = setsockopt(
        &t,
        sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
}

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
/// whether it sent EOF, whether we passed an EOF on to it.
struct Side {
    stream: Stream,
    peer: RawFd,
    out: Vec<u8>,
    eof: bool,
    shut: bool,
}

/// An accepted connection whose unix side is not connected yet.
struct Pending {
    tcp: TcpStream,
    dest: SocketAddr,
    until: Instant,
}

/// The ranges this container's namespace has made local, once it has (a kept container's first
/// exec with rules); the privilege to make more is gone from then on.
#[derive(Default)]
pub struct Routes(Option<Vec<(IpAddr, u8)>>);

impl Routes {
    /// Makes `ranges` local and drops the privilege, the first time; later, checks that the
    /// ranges are the same (a session's profile, and so its rules, never change).
    fn make(&mut self, ranges: Vec<(IpAddr, u8)>) -> Result<(), String> {
        match &self.0 {
            None => {
                let routed = add_local_routes(&ranges);
                // Whatever the routes did, the privilege goes before anything else happens.
                drop_route_privileges()?;
                routed?;
                self.0 = Some(ranges);
                Ok(())
            }
            Some(made) if *made == ranges => Ok(()),
            Some(_) => {
                Err("raw TCP rules differ from the ones this sandbox's routes were made for".into())
            }
        }
    }
}

pub struct TcpRelay {
    listeners: Vec<TcpListener>,
    socket: String,
    sides: HashMap<RawFd, Side>,
    pending: Vec<Pending>,
}

fn transient(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

impl TcpRelay {
    /// Checks that the daemon's socket answers, adds the local routes and gives up the privilege
    /// to add more (unless `routes` were made already), and listens on the rule ports, all
    /// before the command starts. `proxy_port` is the HTTP relay's loopback port, which no rule
    /// may take.
    pub fn open(
        rules: &[TcpRoute],
        socket: &str,
        proxy_port: u16,
        routes: &mut Routes,
    ) -> Result<TcpRelay, OpenError> {
        UnixStream::connect(socket).map_err(|e| {
            OpenError::Unreachable(format!(
                "raw TCP relay cannot reach the daemon's socket at {socket}: {e}"
            ))
        })?;
        if rules.iter().any(|r| r.port == proxy_port) {
            return Err(OpenError::Setup(format!(
                "a tcp rule uses port {proxy_port}, the egress proxy's port"
            )));
        }
        routes
            .make(rules.iter().map(|r| (r.addr, r.prefix)).collect())
            .map_err(OpenError::Setup)?;
        let mut ports: Vec<(u16, bool)> = Vec::new();
        for r in rules {
            let key = (r.port, r.addr.is_ipv6());
            if !ports.contains(&key) {
                ports.push(key);
            }
        }
        let listeners = ports
            .iter()
            .map(|&(p, v6)| listen_on(p, v6))
            .collect::<Result<Vec<_>, _>>()
            .map_err(OpenError::Setup)?;
        Ok(TcpRelay {
            listeners,
            socket: socket.to_string(),
            sides: HashMap::new(),
            pending: Vec::new(),
        })
    }

    fn open_conns(&self) -> usize {
        self.sides.len() / 2 + self.pending.len()
    }

    /// What to poll: (descriptor, events).
    pub fn watch(&self) -> Vec<(RawFd, libc::c_short)> {
        let mut w = Vec::new();
        if self.open_conns() < MAX_CONNS {
            w.extend(self.listeners.iter().map(|l| (l.as_raw_fd(), libc::POLLIN)));
        }
        for (fd, c) in &self.sides {
            let peer_full = self.sides.get(&c.peer).is_some_and(|p| p.out.len() >= BUF);
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
        if let Some(c) = self.sides.remove(&fd) {
            self.sides.remove(&c.peer);
        }
    }

    fn pair(&mut self, tcp: TcpStream, unix: UnixStream, dest: SocketAddr) {
        let (tf, uf) = (tcp.as_raw_fd(), unix.as_raw_fd());
        let side = |stream, peer, out| Side {
            stream,
            peer,
            out,
            eof: false,
            shut: false,
        };
        self.sides
            .insert(tf, side(Stream::Tcp(tcp), uf, Vec::new()));
        // The destination goes first; the daemon reads nothing else before it.
        self.sides
            .insert(uf, side(Stream::Unix(unix), tf, tcp_preamble(dest)));
    }

    /// Connects `tcp` to the daemon's socket, now or in a later round.
    fn connect(&mut self, tcp: TcpStream, dest: SocketAddr, until: Instant) {
        match connect_unix(&self.socket) {
            Ok(Some(u)) => self.pair(tcp, u, dest),
            Ok(None) if Instant::now() < until => self.pending.push(Pending { tcp, dest, until }),
            Ok(None) | Err(_) => reset(tcp),
        }
    }

    /// One round after poll: `ready(fd, POLLIN|POLLOUT)` tells what poll reported.
    pub fn step(&mut self, ready: impl Fn(RawFd, libc::c_short) -> bool) {
        for p in std::mem::take(&mut self.pending) {
            self.connect(p.tcp, p.dest, p.until);
        }
        let mut accepted = Vec::new();
        for l in &self.listeners {
            if ready(l.as_raw_fd(), libc::POLLIN)
                && let Ok((t, _)) = l.accept()
            {
                accepted.push(t);
            }
        }
        for t in accepted {
            match (t.local_addr(), t.set_nonblocking(true)) {
                (Ok(dest), Ok(())) => self.connect(t, dest, Instant::now() + CONNECT_TIMEOUT),
                _ => reset(t),
            }
        }
        // Descriptors are non-blocking: a readiness left over from a descriptor closed above
        // only yields EAGAIN.
        let mut buf = vec![0u8; BUF];
        let fds: Vec<RawFd> = self.sides.keys().copied().collect();
        for fd in fds {
            let Some(c) = self.sides.get_mut(&fd) else {
                continue;
            };
            if ready(fd, libc::POLLIN) && !c.eof {
                match c.stream.read(&mut buf) {
                    Ok(0) => c.eof = true,
                    Ok(n) => {
                        let peer = c.peer;
                        if let Some(p) = self.sides.get_mut(&peer) {
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
            let Some(c) = self.sides.get_mut(&fd) else {
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
        let fds: Vec<RawFd> = self.sides.keys().copied().collect();
        for fd in fds {
            let Some(c) = self.sides.get(&fd) else {
                continue;
            };
            let (eof, shut, peer) = (c.eof, c.shut, c.peer);
            let Some(p) = self.sides.get_mut(&peer) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Once a kept container's routes are made, an exec with the same ranges only listens, and
    /// one with other ranges is refused (no route is touched: the privilege is gone by then).
    #[test]
    fn routes_are_made_once_and_never_changed() {
        let made = vec![("10.20.0.0".parse().unwrap(), 16)];
        let mut routes = Routes(Some(made.clone()));
        assert!(routes.make(made.clone()).is_ok());
        let other = vec![("10.30.0.0".parse().unwrap(), 16)];
        let e = routes.make(other).unwrap_err();
        assert!(e.contains("differ"), "{e}");
        assert_eq!(routes.0, Some(made));
    }
}
