//! The daemon-owned egress proxy that sandboxed `curl`/`wget` reach through `HTTP(S)_PROXY`.
//!
//! It owns the egress decision for one execution: the name and port allowlist
//! ([`EgressPolicy::check_host`]), the address deny list that operators can only partly lift
//! ([`EgressPolicy::check_addr`]), one name resolution per connection followed by a connect to
//! exactly the checked address (so a DNS answer cannot change between check and use), a bandwidth
//! bucket and byte cap shared by all connections of the execution, and one [`ConnRecord`] per
//! connection for the result and the audit line. Raw TCP to a profile's `CIDR:port` rules
//! ([`TcpRule`], module `tcp`) shares that session: same bucket, cap, limits and records.
//!
//! It must not create listeners or network namespaces (the backend hands [`ProxySession::serve`]
//! or [`ProxyRun::start`] a listener only its sandbox can reach: TCP bound inside the sandbox's
//! own network namespace, or a unix socket bind-mounted into a container), follow redirects,
//! cache DNS answers, or look inside TLS.

mod bandwidth;
mod dns;
mod policy;
mod proxy;
mod request;
mod run;
mod tcp;

// The byte parsers a sandboxed command can feed, for the fuzz targets (src/fuzzing.rs).
#[cfg(any(fuzzing, test))]
pub(crate) use request::{BodyScanner, Framing, parse_head};

pub use dns::{DnsResolver, Resolver, StaticHosts, SystemResolver};
pub use policy::{
    DEFAULT_BANDWIDTH_BYTES_PER_SEC, DEFAULT_BYTE_CAP, EgressPolicy, Host, IpNet, Verdict,
    parse_host, parse_ipv4_literal,
};
pub use proxy::{ConnRecord, ProxyLimits, ProxyListener, ProxySession, TCP_METHOD};
pub use run::{ProxyRun, proxy_env};
pub use tcp::{TcpListeners, TcpPolicy, TcpRule};

/// Errors of this module's configuration surface (request-time problems become verdicts and
/// records, never errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressError {
    #[error("invalid CIDR '{input}': {reason}")]
    InvalidCidr { input: String, reason: &'static str },
    #[error("invalid egress policy: {0}")]
    InvalidPolicy(String),
    /// A raw TCP rule that does not parse or is refused; the message names it.
    #[error("{0}")]
    InvalidTcpRule(String),
    #[error("egress resolver: {0}")]
    Resolver(String),
}
