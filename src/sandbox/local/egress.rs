//! Egress for the local backend: the daemon's filtering proxy, listening inside the run's own
//! network namespace.
//!
//! The sandbox's network namespace has a loopback and nothing else: no interface, no route. The
//! daemon enters that namespace on a throwaway thread, brings `lo` up and binds the proxy's
//! listener on 127.0.0.1 there; the socket stays in the sandbox's namespace while the daemon
//! serves it from its own. The proxy is therefore the only way out, whatever the tool does with
//! proxy settings (a direct connect finds no route), and Landlock allows TCP connect to the
//! proxy port only.
//!
//! Raw TCP rules (`network.tcp`) add, in the same thread and before the command starts, a local
//! route on `lo` for each rule's range and a listener on each rule port (`0.0.0.0`, and `[::]`
//! for IPv6 rules): a connect to an address of a rule reaches such a listener, whose accepted
//! socket names the destination; the daemon judges and relays it
//! ([`crate::egress::TcpPolicy`]). Landlock allows connect to those ports too.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use crate::egress::{ProxyRun, Resolver, TcpListeners, TcpPolicy};
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

/// The TCP ports the command may connect to: the proxy's, and every raw TCP rule's.
pub fn connect_ports(settings: &EgressSettings, network: &NetworkPolicy) -> Vec<u16> {
    let mut ports = vec![settings.port];
    for r in network.tcp_rules() {
        if !ports.contains(&r.port()) {
            ports.push(r.port());
        }
    }
    ports
}

/// The listeners bound in a sandbox's namespace: the proxy's, and the raw TCP rules'.
struct Bound {
    proxy: std::net::TcpListener,
    tcp: Vec<std::net::TcpListener>,
}

/// A listener on every address of a rule port, non-blocking; an IPv6 one serves IPv6 only (the
/// IPv4 one of the same port, if any, serves IPv4).
fn bind_rule_port(port: u16, v6: bool) -> std::io::Result<std::net::TcpListener> {
    let (domain, addr) = if v6 {
        (
            socket2::Domain::IPV6,
            std::net::SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
        )
    } else {
        (
            socket2::Domain::IPV4,
            std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port)),
        )
    };
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    if v6 {
        s.set_only_v6(true)?;
    }
    s.bind(&addr.into())
        .map_err(|e| std::io::Error::new(e.kind(), format!("tcp rule port {addr}: {e}")))?;
    s.listen(128)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// Enters the network namespace of `pid`, brings `lo` up, binds `127.0.0.1:port` there and, for
/// raw TCP, makes the rules' ranges local and listens on their ports. Runs on its own
/// short-lived thread: setns changes only the calling thread's namespace (and a socket belongs
/// to the namespace of the thread that made it).
fn bind_in_netns(pid: u32, port: u16, tcp: Option<&TcpPolicy>) -> std::io::Result<Bound> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    let ranges: Vec<(std::net::IpAddr, u8)> = tcp
        .map(|t| {
            t.rules
                .iter()
                .map(|r| (r.net().addr(), r.net().prefix()))
                .collect()
        })
        .unwrap_or_default();
    let ports = tcp.map(TcpPolicy::listeners).unwrap_or_default();
    if ports.iter().any(|(p, _)| *p == port) {
        return Err(std::io::Error::other(format!(
            "a tcp rule uses port {port}, the egress proxy's port in the sandbox"
        )));
    }
    std::thread::spawn(move || -> std::io::Result<Bound> {
        // SAFETY: setns(2) on an fd we own; affects only this thread, which ends below.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        crate::sandbox::ports::loopback_up()?;
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        // Routes before listeners, both before the command starts (the caller sends the
        // go-signal only after this returns).
        executor_arm_supervisor::routes::add_local_routes(&ranges)
            .map_err(std::io::Error::other)?;
        let tcp = ports
            .iter()
            .map(|&(p, v6)| bind_rule_port(p, v6))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Bound {
            proxy: listener,
            tcp,
        })
    })
    .join()
    .map_err(|_| std::io::Error::other("netns thread panicked"))?
}

/// Starts the proxy for the sandbox whose shim is `pid`: its listener on 127.0.0.1 inside the
/// sandbox's network namespace, and the raw TCP rules' listeners beside it.
pub fn start(
    settings: &EgressSettings,
    network: &NetworkPolicy,
    pid: u32,
) -> std::io::Result<ProxyRun> {
    let policy = network
        .proxy_policy(&settings.deny_addrs)
        .ok_or_else(|| std::io::Error::other("not an egress run"))?;
    let tcp = network.tcp_policy(&settings.deny_addrs);
    let bound = bind_in_netns(pid, settings.port, tcp.as_ref())?;
    let listener = tokio::net::TcpListener::from_std(bound.proxy)?;
    let mut run = ProxyRun::start(policy, settings.resolver.clone(), listener);
    if let Some(tcp) = tcp {
        let listeners = bound
            .tcp
            .into_iter()
            .map(tokio::net::TcpListener::from_std)
            .collect::<std::io::Result<Vec<_>>>()?;
        run.serve_tcp(tcp, TcpListeners::Tcp(listeners));
    }
    Ok(run)
}
