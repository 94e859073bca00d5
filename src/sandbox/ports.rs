//! A TCP connection to `127.0.0.1:{port}` inside a sandbox, for a session's ports proxy.
//!
//! Nothing is published on the host: the daemon makes the connection from inside the sandbox's
//! own network namespace (local and runc: a short-lived thread that `setns(CLONE_NEWNET)` into
//! it creates the socket, which stays in that namespace, and hands it to tokio), or, where the
//! sandbox has a network stack of its own (gVisor's netstack), through the container's
//! supervisor in `connect` mode, whose stdio is the connection.
//!
//! Owns: opening such a connection and the [`NetnsSlot`] a local run publishes its network
//! namespace in. Must not: decide which ports a caller may reach (the sessions layer and its
//! config do) or know HTTP.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream to a port inside a sandbox.
pub trait PortIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> PortIo for T {}

/// An open connection to a port inside a sandbox.
pub type PortConn = Box<dyn PortIo>;

/// Why no connection to a sandbox's port was made.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// Nothing listens there (connection refused), or nothing of the sandbox runs to listen.
    #[error("{0}")]
    Closed(String),
    /// The sandbox could not be entered (it is gone, the engine is unreachable).
    #[error("{0}")]
    Unavailable(String),
}

/// Where a run's network namespace is published once it started: an open `/proc/PID/ns/net` of
/// one of its processes (so a recycled pid cannot point elsewhere), cleared when it ended.
#[derive(Debug, Clone, Default)]
pub struct NetnsSlot(Arc<Mutex<Option<Arc<OwnedFd>>>>);

impl NetnsSlot {
    pub fn set(&self, ns: Arc<OwnedFd>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(ns);
    }

    pub fn get(&self) -> Option<Arc<OwnedFd>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The run ended: its namespace is no longer held open by the daemon.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// Brings up the loopback of the network namespace the calling thread is in (a sandbox's
/// namespace starts with it down, and a connection to 127.0.0.1 needs it).
pub(crate) fn loopback_up() -> std::io::Result<()> {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let sock = std::net::UdpSocket::bind("0.0.0.0:0")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: 0,
        _pad: [0; 22],
    };
    req.name[..2].copy_from_slice(b"lo");
    // SAFETY: SIOCGIFFLAGS / SIOCSIFFLAGS read and write an ifreq of the kernel's size.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if req.flags & libc::IFF_UP as libc::c_short == 0 {
            req.flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Runs `f` on a short-lived thread inside the network namespace `ns` (the thread's namespace
/// is its own: the daemon's other threads stay in theirs, and the thread ends after `f`).
async fn in_netns<T: Send + 'static>(
    ns: Arc<OwnedFd>,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("netns-connect".into())
        .spawn(move || {
            // SAFETY: setns(2) on an fd we hold; affects only this thread, which ends below.
            let r = if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                Err(std::io::Error::last_os_error())
            } else {
                f()
            };
            let _ = tx.send(r);
        })?;
    rx.await
        .map_err(|_| std::io::Error::other("the netns thread ended without an answer"))?
}

/// Brings up the loopback of the namespace `ns` (a background process's server may bind
/// 127.0.0.1 only once it is up).
pub async fn loopback_up_in(ns: Arc<OwnedFd>) -> std::io::Result<()> {
    in_netns(ns, loopback_up).await
}

/// How long a connection into a sandbox may take to be accepted. On loopback a refusal or an
/// accept comes at once, unless the listener's queue is full (a server that does not accept):
/// then the kernel drops the SYN and would retry for minutes.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `127.0.0.1:port` inside the network namespace `ns`: the socket is made there
/// (a socket stays in the namespace it was made in), the connect itself is tokio's, bounded by
/// [`CONNECT_TIMEOUT`], so no thread waits on a server that never accepts.
pub async fn connect_in_netns(
    ns: Arc<OwnedFd>,
    port: u16,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = in_netns(ns, move || {
        loopback_up()?;
        tokio::net::TcpSocket::new_v4()
    })
    .await?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(addr))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the listener accepted no connection within {}s",
                    CONNECT_TIMEOUT.as_secs()
                ),
            )
        })??;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// An open `/proc/{pid}/ns/net`, unless it is the daemon's own namespace (a process not yet in
/// its sandbox's namespace is never taken for it).
pub fn open_netns(pid: u32) -> std::io::Result<Option<OwnedFd>> {
    use std::os::unix::fs::MetadataExt as _;
    let f = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    let own = std::fs::metadata("/proc/self/ns/net")?;
    let theirs = f.metadata()?;
    if (theirs.dev(), theirs.ino()) == (own.dev(), own.ino()) {
        return Ok(None);
    }
    Ok(Some(OwnedFd::from(f)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_holds_a_namespace_until_cleared() {
        let slot = NetnsSlot::default();
        assert!(slot.get().is_none());
        let f = std::fs::File::open("/proc/self/ns/net").unwrap();
        slot.clone().set(Arc::new(OwnedFd::from(f)));
        assert!(slot.get().is_some());
        slot.clear();
        assert!(slot.get().is_none());
    }

    #[test]
    fn the_daemons_own_namespace_is_never_taken_for_a_sandboxs() {
        assert!(open_netns(std::process::id()).unwrap().is_none());
    }
}
