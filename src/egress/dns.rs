//! Name resolution for the proxy: the [`Resolver`] seam, the system resolver, a DNS client
//! pointed at exactly one configured server (hickory-resolver: A and AAAA over UDP, TCP when an
//! answer is truncated) and a static overlay.
//!
//! Nothing here caches: every connection resolves afresh and connects to an address it has just
//! checked. Nothing here decides policy either: every address returned is checked against the
//! deny list by the proxy (`ProxySession`'s `destinations`) before anything connects to it.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hickory_resolver::TokioResolver;
use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ProtocolConfig, ResolveHosts,
    ResolverConfig, ResolverOpts, ServerOrderingStrategy,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError, NoRecords};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::{Name, RData, Record};

use super::EgressError;
use super::policy::{Host, parse_host};

/// Turns a host name into addresses. Implementations must not cache across calls.
#[async_trait]
pub trait Resolver: Send + Sync {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>>;
}

/// The host's resolver (`getaddrinfo` through `tokio::net::lookup_host`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

#[async_trait]
impl Resolver for SystemResolver {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        let mut out = Vec::new();
        for a in tokio::net::lookup_host((host, 0)).await? {
            if !out.contains(&a.ip()) {
                out.push(a.ip());
            }
        }
        Ok(out)
    }
}

/// Fixed answers for some names, then a fallback resolver (or "not found"). Answers are still
/// checked against the deny list like any other.
#[derive(Clone, Default)]
pub struct StaticHosts {
    hosts: HashMap<String, Vec<IpAddr>>,
    fallback: Option<Arc<dyn Resolver>>,
}

impl StaticHosts {
    pub fn new(fallback: Option<Arc<dyn Resolver>>) -> Self {
        StaticHosts {
            hosts: HashMap::new(),
            fallback,
        }
    }

    /// Adds (or replaces) the answer for `name` (case-insensitive, trailing dot ignored).
    pub fn with(mut self, name: &str, addrs: Vec<IpAddr>) -> Self {
        self.hosts.insert(normalise(name), addrs);
        self
    }
}

fn normalise(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    lower.strip_suffix('.').map(str::to_string).unwrap_or(lower)
}

#[async_trait]
impl Resolver for StaticHosts {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        if let Some(addrs) = self.hosts.get(&normalise(host)) {
            return Ok(addrs.clone());
        }
        match &self.fallback {
            Some(r) => r.resolve(host).await,
            None => Err(io::Error::new(io::ErrorKind::NotFound, "no such host")),
        }
    }
}

/// A stub resolver asking exactly one server: one A and one AAAA question (in parallel), UDP
/// first and TCP when the answer is truncated, CNAME chains followed, nothing cached, neither
/// `/etc/resolv.conf` nor `/etc/hosts` read. Only the addresses owned by the end of the question's
/// CNAME chain are returned.
#[derive(Debug, Clone)]
pub struct DnsResolver {
    timeout: Duration,
    inner: TokioResolver,
}

/// Most CNAME hops followed within the answers (hickory bounds its own follow-up queries too).
const MAX_CNAME_HOPS: usize = 8;

impl DnsResolver {
    /// `timeout` bounds one whole resolution: both questions, UDP resends and the TCP fallback.
    pub fn new(server: SocketAddr, timeout: Duration) -> Result<Self, EgressError> {
        let connection = |protocol| {
            let mut c = ConnectionConfig::new(protocol);
            c.port = server.port();
            c
        };
        // UDP first; TCP only for an answer that came back truncated.
        let name_server = NameServerConfig::new(
            server.ip(),
            true,
            vec![
                connection(ProtocolConfig::Udp),
                connection(ProtocolConfig::Tcp),
            ],
        );
        // No search domains: every name is asked as given, fully qualified.
        let config = ResolverConfig::from_parts(None, Vec::new(), vec![name_server]);

        let mut opts = ResolverOpts::default();
        // A cache of size 0 stores nothing: each call asks the server again.
        opts.cache_size = 0;
        opts.use_hosts_file = ResolveHosts::Never;
        // A before AAAA, as the proxy tries the addresses in order; one family failing while the
        // other answers still yields the other's addresses.
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        // One round within `timeout`, as the UDP layer itself resends an unanswered question
        // (from a fresh random port, at most three times); `resolve` also bounds the whole call,
        // TCP fallback included, by `timeout`.
        opts.timeout = timeout;
        opts.attempts = 0;
        opts.num_concurrent_reqs = 1;
        opts.server_ordering_strategy = ServerOrderingStrategy::UserProvidedOrder;
        // Keep the CNAME records in the answer, so `chain_addresses` can follow the chain.
        opts.preserve_intermediates = true;

        let inner = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
            .with_options(opts)
            .build()
            .map_err(|e| EgressError::Resolver(format!("DNS client for {server}: {e}")))?;
        Ok(DnsResolver { timeout, inner })
    }
}

#[async_trait]
impl Resolver for DnsResolver {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        let name = match parse_host(host) {
            Ok(Host::Name(n)) => n,
            Ok(Host::Ip(ip)) => return Ok(vec![ip]),
            Err(why) => return Err(io::Error::new(io::ErrorKind::InvalidInput, why)),
        };
        // Fully qualified, ASCII only (parse_host allows nothing else): exactly this name is asked.
        let qname = Name::from_ascii(format!("{name}."))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{name}: {e}")))?;
        let lookup = tokio::time::timeout(self.timeout, self.inner.lookup_ip(qname.clone()))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "DNS timeout"))?
            .map_err(lookup_error)?;
        let addrs = chain_addresses(&qname, lookup.as_lookup().answers());
        if addrs.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "no addresses for host",
            ));
        }
        Ok(addrs)
    }
}

/// The addresses owned by the end of `qname`'s CNAME chain, in answer order, without
/// duplicates. Records for other names (off the chain) are ignored.
fn chain_addresses(qname: &Name, answers: &[Record]) -> Vec<IpAddr> {
    let mut owner = qname;
    for _ in 0..MAX_CNAME_HOPS {
        let next = answers.iter().find_map(|r| match &r.data {
            RData::CNAME(target) if r.name == *owner => Some(&target.0),
            _ => None,
        });
        match next {
            Some(target) => owner = target,
            None => break,
        }
    }
    let mut out = Vec::new();
    for r in answers.iter().filter(|r| r.name == *owner) {
        if let Some(ip) = r.data.ip_addr()
            && !out.contains(&ip)
        {
            out.push(ip);
        }
    }
    out
}

/// The resolver's error as the proxy reports it (the kind decides nothing; the text is shown).
fn lookup_error(e: NetError) -> io::Error {
    match e {
        NetError::Timeout => io::Error::new(io::ErrorKind::TimedOut, "DNS timeout"),
        NetError::Dns(DnsError::NoRecordsFound(NoRecords {
            response_code: ResponseCode::NXDomain,
            ..
        })) => io::Error::new(io::ErrorKind::NotFound, "no such host"),
        NetError::Dns(DnsError::NoRecordsFound(NoRecords {
            response_code: ResponseCode::NoError,
            ..
        })) => io::Error::new(io::ErrorKind::NotFound, "no addresses for host"),
        NetError::Dns(
            DnsError::NoRecordsFound(NoRecords { response_code, .. })
            | DnsError::ResponseCode(response_code),
        ) => io::Error::other(format!("DNS server answered {response_code}")),
        NetError::Io(e) => io::Error::new(e.kind(), format!("DNS: {e}")),
        other => io::Error::other(format!("DNS: {other}")),
    }
}

#[cfg(test)]
mod tests;
