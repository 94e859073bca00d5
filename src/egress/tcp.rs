//! Raw TCP egress by rule: a profile's `tcp = ["10.20.0.0/16:5432", "[2001:db8::/32]:22"]`.
//!
//! The sandbox's own network namespace makes each rule's range local on `lo` and has a listener on
//! each rule port ([`executor_arm_supervisor::routes`]): a connect to an address outside every
//! range finds no route, one inside reaches a listener (a port without one answers RST). The
//! backend hands this module each accepted connection with the destination the command asked for:
//! the accepted socket's local address (local backend: the listeners live in the sandbox's
//! namespace and the daemon serves them), or the first line the container's supervisor sends on
//! the run's unix socket (docker; see [`executor_arm_supervisor::protocol::tcp_preamble`]).
//!
//! Nothing about that destination is trusted: [`TcpPolicy::check`] judges it against the rules
//! and the address deny list (the proxy's, plus the host's own addresses) before the daemon
//! connects, from its own namespace, to exactly that address. A command that talks to the unix
//! socket itself and names another destination reaches only what the rules allow. Connections
//! share the execution's proxy session: its bandwidth bucket, byte cap, connection limits and
//! records ([`ConnRecord`] with `method` [`TCP_METHOD`], `host` the IP).
//!
//! Must not: create listeners or namespaces (the backend does), resolve names.

use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use executor_arm_supervisor::protocol::{TCP_PREAMBLE_MAX, TcpRoute, parse_tcp_preamble};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::EgressError;
use super::policy::{AddrClass, IpNet, Verdict, canonical_ip, classify};
use super::proxy::{Client, ConnLog, Inner, Mode, PumpEnd, TCP_METHOD, relay};

/// One rule: every address of `net`, port `port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TcpRule {
    net: IpNet,
    port: u16,
}

impl TcpRule {
    pub fn net(&self) -> IpNet {
        self.net
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The rule as the supervisor's request carries it.
    pub fn route(&self) -> TcpRoute {
        TcpRoute {
            addr: self.net.addr(),
            prefix: self.net.prefix(),
            port: self.port,
        }
    }
}

impl FromStr for TcpRule {
    type Err = EgressError;

    /// `ADDRESS/PREFIX:PORT`, IPv6 as `[ADDRESS/PREFIX]:PORT`; no host bits below the prefix. A
    /// range inside loopback is refused (the sandbox's loopback is its own: such a rule could
    /// never reach the host's), and so is one of IPv4-mapped IPv6 addresses (write the IPv4 form).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: String| EgressError::InvalidTcpRule(format!("tcp rule {reason}"));
        let route = TcpRoute::parse(s).map_err(EgressError::InvalidTcpRule)?;
        let net =
            IpNet::new(route.addr, route.prefix).map_err(|e| invalid(format!("'{s}': {e}")))?;
        let loopback = match net.addr() {
            IpAddr::V4(a) => a.is_loopback() && net.prefix() >= 8,
            IpAddr::V6(a) => a.is_loopback() && net.prefix() == 128,
        };
        if loopback {
            return Err(invalid(format!(
                "'{s}' is a loopback range: the sandbox's loopback is its own, and the host's is \
                 never reachable"
            )));
        }
        if let IpAddr::V6(a) = net.addr()
            && a.to_ipv4_mapped().is_some()
            && net.prefix() >= 96
        {
            return Err(invalid(format!(
                "'{s}' is an IPv4-mapped IPv6 range: write it in IPv4 form"
            )));
        }
        Ok(TcpRule {
            net,
            port: route.port,
        })
    }
}

impl std::fmt::Display for TcpRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.route().fmt(f)
    }
}

impl serde::Serialize for TcpRule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// What one execution may reach by raw TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpPolicy {
    pub rules: Vec<TcpRule>,
    /// The daemon's own listen addresses (as [`super::EgressPolicy::deny_addrs`]).
    pub deny_addrs: Vec<SocketAddr>,
    /// The addresses of the daemon's host (its network namespace), any port.
    pub host_addrs: Vec<IpAddr>,
}

/// How a rule must name a denied address for it to pass.
#[derive(Clone, Copy)]
enum Naming {
    /// A rule of exactly that one address.
    Exact,
    /// A rule whose whole range lies in the denied range of this class (a range that merely
    /// covers it, such as `0.0.0.0/0`, does not name it).
    Within(AddrClass),
}

impl TcpPolicy {
    /// The policy of `rules` with the deny list of this host: `deny_addrs` (the daemon's
    /// listen addresses) and every address of the daemon's network namespace.
    pub fn new(rules: Vec<TcpRule>, deny_addrs: Vec<SocketAddr>) -> TcpPolicy {
        let host_addrs = nix::ifaddrs::getifaddrs()
            .map(|addrs| {
                addrs
                    .filter_map(|a| {
                        let s = a.address?;
                        s.as_sockaddr_in()
                            .map(|v4| IpAddr::V4(v4.ip()))
                            .or_else(|| s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                    })
                    .map(canonical_ip)
                    .collect()
            })
            .unwrap_or_default();
        TcpPolicy {
            rules,
            deny_addrs,
            host_addrs,
        }
    }

    /// The (port, IPv6) pairs the sandbox needs a listener for.
    pub fn listeners(&self) -> Vec<(u16, bool)> {
        let mut out: Vec<(u16, bool)> = Vec::new();
        for r in &self.rules {
            let key = (r.port, r.net.addr().is_ipv6());
            if !out.contains(&key) {
                out.push(key);
            }
        }
        out
    }

    /// The rules, then the deny list: an address on it passes only a rule of this port that
    /// names it explicitly, i.e. whose whole range lies inside the denied range the address is
    /// in (a rule that merely covers it, such as `0.0.0.0/0`, does not). The daemon's own
    /// addresses and the host's need a rule of exactly that address.
    pub fn check(&self, dest: SocketAddr) -> Verdict {
        let ip = canonical_ip(dest.ip());
        let port = dest.port();
        let dest = SocketAddr::new(ip, port);
        let matching: Vec<&TcpRule> = self
            .rules
            .iter()
            .filter(|r| r.port == port && r.net.contains(ip))
            .collect();
        if matching.is_empty() {
            return Verdict::Deny(format!("{dest} is not allowed by any tcp rule"));
        }
        let daemon = self.deny_addrs.iter().any(|d| {
            let d_ip = canonical_ip(d.ip());
            (d_ip.is_unspecified() || d_ip == ip) && (d.port() == 0 || d.port() == port)
        });
        let denied = if daemon {
            Some((
                format!("{dest} is a listen address of the daemon"),
                Naming::Exact,
            ))
        } else if self.host_addrs.contains(&ip) {
            Some((
                format!("address {ip} is an address of the daemon's host"),
                Naming::Exact,
            ))
        } else {
            match classify(ip).0 {
                AddrClass::Public => None,
                c @ (AddrClass::Hard(why) | AddrClass::Liftable(why)) => {
                    Some((format!("address {ip} is denied: {why}"), Naming::Within(c)))
                }
            }
        };
        let Some((why, naming)) = denied else {
            return Verdict::Allow;
        };
        if matching.iter().any(|r| names(r.net, naming)) {
            Verdict::Allow
        } else {
            Verdict::Deny(format!("{why}, and no tcp rule names it explicitly"))
        }
    }
}

/// Whether `net` (which contains the address) names it the way `naming` asks.
fn names(net: IpNet, naming: Naming) -> bool {
    match naming {
        Naming::Exact => net.prefix() == if net.addr().is_ipv4() { 32 } else { 128 },
        // Every class is one contiguous range (single addresses inside one are classes of their
        // own), so a range whose first and last addresses are of the class lies within it.
        Naming::Within(class) => {
            let (first, last) = bounds(net);
            classify(canonical_ip(first)).0 == class && classify(canonical_ip(last)).0 == class
        }
    }
}

/// The first and last address of `net`.
fn bounds(net: IpNet) -> (IpAddr, IpAddr) {
    match net.addr() {
        IpAddr::V4(a) => {
            let host = u32::MAX.checked_shr(u32::from(net.prefix())).unwrap_or(0);
            (IpAddr::V4(a), IpAddr::V4((u32::from(a) | host).into()))
        }
        IpAddr::V6(a) => {
            let host = u128::MAX.checked_shr(u32::from(net.prefix())).unwrap_or(0);
            (
                IpAddr::V6(a),
                IpAddr::V6(Ipv6Addr::from(u128::from(a) | host)),
            )
        }
    }
}

/// Where one execution's raw TCP connections arrive.
pub enum TcpListeners {
    /// Bound in the sandbox's own network namespace (local backend): an accepted socket's local
    /// address is the destination.
    Tcp(Vec<TcpListener>),
    /// The run's socket in the container's egress directory (docker): each connection starts
    /// with the supervisor's line naming the destination.
    Unix(UnixListener),
}

/// Serves `listeners` until `stop` turns true, then aborts what is still open (its records are
/// filed as "closed when the execution ended").
pub(super) async fn serve(
    inner: Arc<Inner>,
    policy: Arc<TcpPolicy>,
    listeners: TcpListeners,
    stop: watch::Receiver<bool>,
) {
    let mut loops = JoinSet::new();
    match listeners {
        TcpListeners::Tcp(ls) => {
            for l in ls {
                let (inner, policy, stop) = (inner.clone(), policy.clone(), stop.clone());
                loops.spawn(accept_loop(inner, policy, Accept::Tcp(l), stop));
            }
        }
        TcpListeners::Unix(l) => {
            loops.spawn(accept_loop(inner, policy, Accept::Unix(l), stop));
        }
    }
    while loops.join_next().await.is_some() {}
}

enum Accept {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Accept {
    /// A client, and its destination when the socket itself tells it.
    async fn accept(&self) -> io::Result<(Client, Option<SocketAddr>)> {
        match self {
            Accept::Tcp(l) => {
                let (s, _) = l.accept().await?;
                let dest = s.local_addr()?;
                Ok((Client::Tcp(s), Some(dest)))
            }
            Accept::Unix(l) => l.accept().await.map(|(s, _)| (Client::Unix(s), None)),
        }
    }
}

async fn accept_loop(
    inner: Arc<Inner>,
    policy: Arc<TcpPolicy>,
    listener: Accept,
    mut stop: watch::Receiver<bool>,
) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            () = stopped(&mut stop) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((client, dest)) => match inner.slot() {
                    Ok(permit) => {
                        let (inner, policy) = (inner.clone(), policy.clone());
                        tasks.spawn(async move {
                            let _permit = permit;
                            handle(&inner, &policy, client, dest).await;
                        });
                    }
                    Err(why) => {
                        let mut log = ConnLog::new(&inner);
                        log.rec.method = TCP_METHOD.into();
                        if let Some(d) = dest {
                            log.rec.host = d.ip().to_string();
                            log.rec.port = d.port();
                        }
                        log.rec.reason = Some(why.to_string());
                        log.finished = true;
                        reset(client);
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "raw TCP egress accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(listener);
    tasks.shutdown().await;
}

/// Resolves once the run is over (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// Closes with a reset (TCP) so the command sees a refusal, not an orderly end.
fn reset(client: Client) {
    if let Client::Tcp(s) = &client {
        let _ = s.set_zero_linger();
    }
    drop(client);
}

/// The supervisor's first line, read a byte at a time so nothing after it is consumed. `None`:
/// closed without a byte (the supervisor's reachability probe; not a connection).
async fn read_preamble(client: &mut Client) -> Result<SocketAddr, Option<String>> {
    let mut line = Vec::with_capacity(TCP_PREAMBLE_MAX);
    loop {
        let mut b = [0u8; 1];
        match client.read(&mut b).await {
            Ok(0) if line.is_empty() => return Err(None),
            Ok(0) => return Err(Some("closed before naming its destination".into())),
            Ok(_) if b[0] == b'\n' => return parse_tcp_preamble(&line).map_err(Some),
            Ok(_) if line.len() + 1 >= TCP_PREAMBLE_MAX => {
                return Err(Some("malformed raw TCP preamble".into()));
            }
            Ok(_) => line.push(b[0]),
            Err(e) => return Err(Some(format!("reading the destination: {e}"))),
        }
    }
}

async fn handle(inner: &Inner, policy: &TcpPolicy, mut client: Client, dest: Option<SocketAddr>) {
    client.set_nodelay();
    let mut log = ConnLog::new(inner);
    log.rec.method = TCP_METHOD.into();
    let dest = match dest {
        Some(d) => d,
        None => {
            let read = tokio::time::timeout(inner.limits.head_timeout, read_preamble(&mut client));
            match read.await {
                Ok(Ok(d)) => d,
                Ok(Err(None)) => {
                    log.skip = true;
                    return;
                }
                Ok(Err(Some(why))) => {
                    log.rec.reason = Some(why);
                    log.finished = true;
                    return;
                }
                Err(_) => {
                    log.rec.reason = Some("timed out reading the destination".into());
                    log.finished = true;
                    return;
                }
            }
        }
    };
    let dest = SocketAddr::new(canonical_ip(dest.ip()), dest.port());
    log.rec.host = dest.ip().to_string();
    log.rec.port = dest.port();
    if let Verdict::Deny(why) = policy.check(dest) {
        log.rec.reason = Some(why);
        log.finished = true;
        return reset(client);
    }
    log.rec.allowed = true;
    let mut upstream =
        match tokio::time::timeout(inner.limits.connect_timeout, TcpStream::connect(dest)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                log.rec.reason = Some(format!("connect to {dest} failed: {e}"));
                log.finished = true;
                return reset(client);
            }
            Err(_) => {
                log.rec.reason = Some(format!("connect to {dest} timed out"));
                log.finished = true;
                return reset(client);
            }
        };
    log.rec.addr = Some(dest);
    let _ = upstream.set_nodelay(true);
    let end = relay(
        &mut client,
        &mut upstream,
        &inner.bandwidth,
        &log.up,
        &log.down,
        None,
        Mode::Tunnel,
    )
    .await;
    if let Some(PumpEnd::CapReached) = end {
        log.rec.reason = Some("egress byte cap reached; connection closed".into());
    }
    log.finished = true;
}

#[cfg(test)]
#[path = "tcp_tests.rs"]
mod tests;
