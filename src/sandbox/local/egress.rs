//! Egress for the local backend: the daemon's filtering proxy, listening inside the run's own
//! network namespace.
//!
//! The sandbox's network namespace has a loopback and nothing else: no interface, no route. The
//! daemon enters that namespace on a throwaway thread, brings `lo` up and binds the proxy's
//! listener on 127.0.0.1 there; the socket stays in the sandbox's namespace while the daemon
//! serves it from its own. The proxy is therefore the only way out, whatever the tool does with
//! proxy settings (a direct connect finds no route), and Landlock allows TCP connect to the
//! proxy port only.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use crate::egress::{ProxyRun, Resolver};
use crate::sandbox::NetworkPolicy;

/// Daemon-wide egress settings.
#[derive(Clone)]
pub struct EgressSettings {
    pub resolver: Arc<dyn Resolver>,
    /// The daemon's own addresses and ports, never reachable through the proxy.
    pub deny_addrs: Vec<SocketAddr>,
    /// Port of the proxy inside each sandbox.
    pub port: u16,
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Enters the network namespace of `pid`, brings `lo` up and binds `127.0.0.1:port` there.
/// Runs on its own short-lived thread: setns changes only the calling thread's namespace.
fn bind_in_netns(pid: u32, port: u16) -> std::io::Result<std::net::TcpListener> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::spawn(move || -> std::io::Result<std::net::TcpListener> {
        // SAFETY: setns(2) on an fd we own; affects only this thread, which ends below.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Any AF_INET socket of this namespace serves for the interface ioctls.
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
            req.flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        Ok(listener)
    })
    .join()
    .map_err(|_| std::io::Error::other("netns thread panicked"))?
}

/// Starts the proxy for the sandbox whose shim is `pid`: its listener on 127.0.0.1 inside the
/// sandbox's network namespace.
pub fn start(
    settings: &EgressSettings,
    network: &NetworkPolicy,
    pid: u32,
) -> std::io::Result<ProxyRun> {
    let policy = network
        .proxy_policy(&settings.deny_addrs)
        .ok_or_else(|| std::io::Error::other("not an egress run"))?;
    let listener = tokio::net::TcpListener::from_std(bind_in_netns(pid, settings.port)?)?;
    Ok(ProxyRun::start(policy, settings.resolver.clone(), listener))
}
