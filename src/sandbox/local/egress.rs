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

use tokio::sync::oneshot;

use crate::egress::{ConnRecord, EgressPolicy, IpNet, ProxySession, Resolver};
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

/// The proxy serving one run.
pub struct EgressRun {
    session: Arc<ProxySession>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl EgressRun {
    /// Starts the proxy for the sandbox whose shim is `pid`.
    pub fn start(
        settings: &EgressSettings,
        network: &NetworkPolicy,
        pid: u32,
    ) -> std::io::Result<EgressRun> {
        let NetworkPolicy::Egress {
            allow_hosts,
            allow_ports,
            allow_cidrs,
            bandwidth_bytes_per_sec,
            byte_cap,
        } = network
        else {
            return Err(std::io::Error::other("not an egress run"));
        };
        let policy = EgressPolicy {
            allow_hosts: allow_hosts.clone(),
            allow_ports: allow_ports.clone(),
            allow_cidrs: allow_cidrs
                .iter()
                .filter_map(|c| c.parse::<IpNet>().ok())
                .collect(),
            deny_addrs: settings.deny_addrs.clone(),
            bandwidth_bytes_per_sec: *bandwidth_bytes_per_sec,
            byte_cap: *byte_cap,
        };
        let listener = tokio::net::TcpListener::from_std(bind_in_netns(pid, settings.port)?)?;
        let session = Arc::new(ProxySession::new(
            Arc::new(policy),
            settings.resolver.clone(),
        ));
        let (stop, stopped) = oneshot::channel::<()>();
        let s = session.clone();
        let task = tokio::spawn(async move {
            s.serve(listener, async {
                let _ = stopped.await;
            })
            .await;
        });
        Ok(EgressRun {
            session,
            stop: Some(stop),
            task,
        })
    }

    /// Stops the proxy (the sandbox is gone) and returns what it saw.
    pub async fn finish(mut self) -> Vec<ConnRecord> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), &mut self.task).await;
        self.task.abort();
        self.session.records()
    }
}

impl Drop for EgressRun {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Proxy environment for the command: every spelling curl and wget read.
pub fn proxy_env(port: u16) -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{port}");
    [
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "all_proxy",
    ]
    .iter()
    .map(|k| (k.to_string(), url.clone()))
    .collect()
}
