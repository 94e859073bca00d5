//! Egress policy: which names and ports a sandbox may ask for, and which addresses are never
//! reachable whatever a name resolves to.
//!
//! Two separate questions, asked in this order by the proxy: [`EgressPolicy::check_host`] on the
//! name the client asked for, then [`EgressPolicy::check_addr`] on every address that name
//! resolves to. IP literals in a request are parsed here with `inet_aton` semantics (decimal,
//! hex, octal and short forms), so no spelling of an address reaches a resolver that might read
//! it differently.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::EgressError;

/// 10 Mbit/s, the default egress bandwidth.
pub const DEFAULT_BANDWIDTH_BYTES_PER_SEC: u64 = 1_250_000;
/// Per-execution byte cap when a profile names none.
pub const DEFAULT_BYTE_CAP: u64 = 100 * 1024 * 1024;

/// What one execution's sandbox may reach through the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPolicy {
    /// Exact names (`api.example.com`), `*.suffix` patterns (match `a.suffix` and `a.b.suffix`,
    /// not `suffix`), exact IP literals (`203.0.113.7`, `2001:db8::1`), or `*` for any host.
    /// Case-insensitive; one trailing dot ignored. Empty means no host at all (fail closed).
    pub allow_hosts: Vec<String>,
    /// Destination ports; default `[80, 443]`.
    pub allow_ports: Vec<u16>,
    /// Operator-opened ranges. They lift only the private part of the deny list (RFC 1918, CGNAT,
    /// ULA, …), never loopback, link-local, metadata, multicast or the daemon's own addresses.
    pub allow_cidrs: Vec<IpNet>,
    /// The daemon's own listen addresses, always refused. An unspecified IP (`0.0.0.0`, `::`)
    /// matches every address on that port; port 0 matches every port of that IP.
    pub deny_addrs: Vec<SocketAddr>,
    /// Shared by all connections of the execution, both directions together. 0 = unlimited
    /// (refused by [`EgressPolicy::validate`]).
    pub bandwidth_bytes_per_sec: u64,
    /// Total bytes of the execution, both directions; when reached, every connection is closed.
    pub byte_cap: u64,
}

impl Default for EgressPolicy {
    fn default() -> Self {
        EgressPolicy {
            allow_hosts: Vec::new(),
            allow_ports: vec![80, 443],
            allow_cidrs: Vec::new(),
            deny_addrs: Vec::new(),
            bandwidth_bytes_per_sec: DEFAULT_BANDWIDTH_BYTES_PER_SEC,
            byte_cap: DEFAULT_BYTE_CAP,
        }
    }
}

/// A reasoned decision: the reason goes into the 403 body, the record and the audit line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Deny(String),
}

impl Verdict {
    pub fn is_allow(&self) -> bool {
        matches!(self, Verdict::Allow)
    }
}

impl EgressPolicy {
    /// Rejects a policy that cannot mean what its author wanted: malformed host patterns, port 0,
    /// no ports, zero bandwidth or byte cap. Call it when loading a profile.
    pub fn validate(&self) -> Result<(), EgressError> {
        for pattern in &self.allow_hosts {
            if !pattern_is_valid(pattern) {
                return Err(EgressError::InvalidPolicy(format!(
                    "allow_hosts entry '{}' is not a name, '*.suffix', an IP literal or '*'",
                    printable(pattern, 80)
                )));
            }
        }
        if self.allow_ports.is_empty() {
            return Err(EgressError::InvalidPolicy("allow_ports is empty".into()));
        }
        if self.allow_ports.contains(&0) {
            return Err(EgressError::InvalidPolicy("allow_ports contains 0".into()));
        }
        if self.bandwidth_bytes_per_sec == 0 {
            return Err(EgressError::InvalidPolicy(
                "bandwidth_bytes_per_sec is 0".into(),
            ));
        }
        if self.byte_cap == 0 {
            return Err(EgressError::InvalidPolicy("byte_cap is 0".into()));
        }
        Ok(())
    }

    /// The name allowlist and the port allowlist. An IP literal passes only an allowlist entry
    /// naming that same address (or `*`): a name allowlist does not admit arbitrary addresses.
    pub fn check_host(&self, host: &str, port: u16) -> Verdict {
        if !self.allow_ports.contains(&port) {
            return Verdict::Deny(format!("port {port} is not an allowed egress port"));
        }
        let host = match parse_host(host) {
            Ok(h) => h,
            Err(why) => return Verdict::Deny(why),
        };
        if self.allow_hosts.iter().any(|p| pattern_matches(p, &host)) {
            Verdict::Allow
        } else {
            Verdict::Deny(format!("host {host} is not in the egress allowlist"))
        }
    }

    /// The address deny list (see [`classify`] for the ranges). Mapped, compatible and translated
    /// IPv6 forms of an IPv4 address are judged as that IPv4 address; NAT64, 6to4 and Teredo
    /// addresses inherit the class of the IPv4 address they embed.
    pub fn check_addr(&self, ip: IpAddr, port: u16) -> Verdict {
        self.check_addr_inner(ip, port, false)
    }

    /// `allow_loopback` exists only for the proxy's own loopback tests; production callers pass
    /// `false` through [`EgressPolicy::check_addr`].
    pub(crate) fn check_addr_inner(&self, ip: IpAddr, port: u16, allow_loopback: bool) -> Verdict {
        let ip = canonical_ip(ip);
        for d in &self.deny_addrs {
            let d_ip = canonical_ip(d.ip());
            let ip_matches = d_ip.is_unspecified() || d_ip == ip;
            let port_matches = d.port() == 0 || d.port() == port;
            if ip_matches && port_matches {
                return Verdict::Deny(format!(
                    "{} is a listen address of the daemon",
                    SocketAddr::new(ip, port)
                ));
            }
        }
        let (class, embedded) = classify(ip);
        match class {
            AddrClass::Public => Verdict::Allow,
            AddrClass::Hard(_) if allow_loopback && ip.is_loopback() => Verdict::Allow,
            AddrClass::Hard(why) => Verdict::Deny(format!("address {ip} is denied: {why}")),
            AddrClass::Liftable(why) => {
                let lifted = self.allow_cidrs.iter().any(|net| {
                    net.contains(ip) || embedded.is_some_and(|v4| net.contains(IpAddr::V4(v4)))
                });
                if lifted {
                    Verdict::Allow
                } else {
                    Verdict::Deny(format!(
                        "address {ip} is denied: {why}, not opened by allow_cidrs"
                    ))
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Addresses

/// Where an address falls in the deny list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AddrClass {
    Public,
    /// Private ranges an operator may open with `allow_cidrs`.
    Liftable(&'static str),
    /// Never reachable.
    Hard(&'static str),
}

/// Cloud instance-metadata endpoints outside (or inside a liftable part of) the link-local range:
/// never reachable even when an operator opens the range around them.
const METADATA_V4: [(Ipv4Addr, &str); 4] = [
    (
        Ipv4Addr::new(169, 254, 169, 254),
        "cloud metadata (169.254.169.254)",
    ),
    (
        Ipv4Addr::new(100, 100, 100, 200),
        "cloud metadata (Alibaba 100.100.100.200)",
    ),
    (
        Ipv4Addr::new(192, 0, 0, 192),
        "cloud metadata (Oracle 192.0.0.192)",
    ),
    (
        Ipv4Addr::new(168, 63, 129, 16),
        "cloud host endpoint (Azure 168.63.129.16)",
    ),
];
/// AWS IMDS over IPv6 sits inside the (liftable) ULA range.
const METADATA_V6: [(Ipv6Addr, &str); 1] = [(
    Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254),
    "cloud metadata (AWS fd00:ec2::254)",
)];

/// The IPv4 address an IPv6 address stands for when it is only another spelling of it:
/// mapped `::ffff:a.b.c.d`, compatible `::a.b.c.d` (not `::` or `::1`) and SIIT-translated
/// `::ffff:0:a.b.c.d`.
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else { return ip };
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    let mapped = s[..5] == [0; 5] && s[5] == 0xffff;
    let translated = s[..4] == [0; 4] && s[4] == 0xffff && s[5] == 0;
    let compat = s[..6] == [0; 6] && !v6.is_unspecified() && !v6.is_loopback();
    if mapped || translated || compat {
        IpAddr::V4(low)
    } else {
        ip
    }
}

/// Classifies an address already passed through [`canonical_ip`]; also returns the IPv4
/// address embedded in a NAT64, 6to4 or Teredo address.
pub(crate) fn classify(ip: IpAddr) -> (AddrClass, Option<Ipv4Addr>) {
    match ip {
        IpAddr::V4(v4) => (classify_v4(v4), None),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> AddrClass {
    if let Some((_, why)) = METADATA_V4.iter().find(|(a, _)| *a == ip) {
        return AddrClass::Hard(why);
    }
    match ip.octets() {
        [0, ..] => AddrClass::Hard("unspecified (0.0.0.0/8)"),
        [127, ..] => AddrClass::Hard("loopback (127.0.0.0/8)"),
        [169, 254, ..] => AddrClass::Hard("link-local (169.254.0.0/16)"),
        [224..=239, ..] => AddrClass::Hard("multicast (224.0.0.0/4)"),
        [255, 255, 255, 255] => AddrClass::Hard("broadcast (255.255.255.255)"),
        [240..=255, ..] => AddrClass::Hard("reserved (240.0.0.0/4)"),
        [10, ..] => AddrClass::Liftable("private (10.0.0.0/8)"),
        [172, 16..=31, ..] => AddrClass::Liftable("private (172.16.0.0/12)"),
        [192, 168, ..] => AddrClass::Liftable("private (192.168.0.0/16)"),
        [100, 64..=127, ..] => AddrClass::Liftable("shared address space (100.64.0.0/10)"),
        [192, 0, 0, _] => AddrClass::Liftable("IETF protocol assignments (192.0.0.0/24)"),
        [198, 18..=19, ..] => AddrClass::Liftable("benchmarking (198.18.0.0/15)"),
        _ => AddrClass::Public,
    }
}

fn v4_from(hi: u16, lo: u16) -> Ipv4Addr {
    Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo))
}

fn classify_v6(ip: Ipv6Addr) -> (AddrClass, Option<Ipv4Addr>) {
    if let Some((_, why)) = METADATA_V6.iter().find(|(a, _)| *a == ip) {
        return (AddrClass::Hard(why), None);
    }
    let s = ip.segments();
    if ip.is_unspecified() {
        return (AddrClass::Hard("unspecified (::)"), None);
    }
    if ip.is_loopback() {
        return (AddrClass::Hard("loopback (::1)"), None);
    }
    // Translation prefixes: the class of the IPv4 address behind them. A hard-denied IPv4
    // stays hard-denied; a private one is liftable (by a range naming either form).
    let embedded = if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4] {
        Some((v4_from(s[6], s[7]), "NAT64 (64:ff9b::/96) of"))
    } else if s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1 {
        Some((v4_from(s[6], s[7]), "local-use NAT64 (64:ff9b:1::/48) of"))
    } else if s[0] == 0x2002 {
        Some((v4_from(s[1], s[2]), "6to4 (2002::/16) of"))
    } else if s[0] == 0x2001 && s[1] == 0 {
        Some((v4_from(!s[6], !s[7]), "Teredo (2001::/32) of"))
    } else {
        None
    };
    if let Some((v4, _)) = embedded {
        let class = match classify_v4(v4) {
            // The local-use NAT64 prefix is a site's own: private even for a public IPv4.
            AddrClass::Public if s[2] == 1 && s[0] == 0x64 => {
                AddrClass::Liftable("local-use NAT64 (64:ff9b:1::/48)")
            }
            c => c,
        };
        return (class, Some(v4));
    }
    let class = if s[0] & 0xffc0 == 0xfe80 {
        AddrClass::Hard("link-local (fe80::/10)")
    } else if s[0] & 0xff00 == 0xff00 {
        AddrClass::Hard("multicast (ff00::/8)")
    } else if s[0] & 0xfe00 == 0xfc00 {
        AddrClass::Liftable("unique local (fc00::/7)")
    } else if s[0] & 0xffc0 == 0xfec0 {
        AddrClass::Liftable("site-local (fec0::/10)")
    } else {
        AddrClass::Public
    };
    (class, None)
}

/// An IPv4 or IPv6 network: address and prefix length, written `10.0.0.0/8` or `fc00::/7`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Refuses host bits below the prefix: `10.0.0.1/8` is more likely a typo than a range.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, EgressError> {
        let invalid = |reason| EgressError::InvalidCidr {
            input: format!("{addr}/{prefix}"),
            reason,
        };
        let ok = match addr {
            IpAddr::V4(a) => {
                if prefix > 32 {
                    return Err(invalid("prefix longer than 32"));
                }
                u32::from(a) & !mask32(prefix) == 0
            }
            IpAddr::V6(a) => {
                if prefix > 128 {
                    return Err(invalid("prefix longer than 128"));
                }
                u128::from(a) & !mask128(prefix) == 0
            }
        };
        if !ok {
            return Err(invalid("address has bits set below the prefix"));
        }
        Ok(IpNet { addr, prefix })
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Same family only: a v4 range does not contain a v6 address (callers canonicalise first).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                (u32::from(a) ^ u32::from(n)) & mask32(self.prefix) == 0
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                (u128::from(a) ^ u128::from(n)) & mask128(self.prefix) == 0
            }
            _ => false,
        }
    }
}

fn mask32(prefix: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
}

fn mask128(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

impl FromStr for IpNet {
    type Err = EgressError;

    /// `addr/prefix`, or a bare address as a single-address range. Addresses are strict here
    /// (dotted quad, RFC 4291 text): this is operator config, not attacker input.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason| EgressError::InvalidCidr {
            input: printable(s, 80),
            reason,
        };
        let (a, p) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let addr = IpAddr::from_str(a).map_err(|_| invalid("not an IP address"))?;
        let prefix = match p {
            None => match addr {
                IpAddr::V4(_) => 32,
                IpAddr::V6(_) => 128,
            },
            Some(p) if !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()) => p
                .parse::<u8>()
                .map_err(|_| invalid("prefix is not a number"))?,
            Some(_) => return Err(invalid("prefix is not a number")),
        };
        IpNet::new(addr, prefix)
    }
}

impl TryFrom<String> for IpNet {
    type Error = EgressError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<IpNet> for String {
    fn from(n: IpNet) -> String {
        n.to_string()
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

// ---------------------------------------------------------------------------------------------
// Host names

/// A request host after parsing: an address literal (in any spelling) or a normalised name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    Ip(IpAddr),
    /// Lower-case, no trailing dot, LDH/underscore labels.
    Name(String),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Ip(IpAddr::V6(a)) => write!(f, "[{a}]"),
            Host::Ip(IpAddr::V4(a)) => write!(f, "{a}"),
            Host::Name(n) => f.write_str(n),
        }
    }
}

/// Parses a request host: `[v6]` or bare v6, any `inet_aton` spelling of an IPv4 address
/// (`2852039166`, `0xa9fea9fe`, `0251.0376.0251.0376`, `169.254.43518`), or a DNS name.
/// A name whose last label is numeric but which is not a valid address is refused, as browsers
/// do: it is either an address typo or an attempt to be read differently by someone else.
pub fn parse_host(host: &str) -> Result<Host, String> {
    if let Some(inner) = host.strip_prefix('[') {
        return inner
            .strip_suffix(']')
            .and_then(|a| Ipv6Addr::from_str(a).ok())
            .map(|a| Host::Ip(IpAddr::V6(a)))
            .ok_or_else(|| format!("invalid IPv6 literal '{}'", printable(host, 80)));
    }
    if host.contains(':') {
        return Ipv6Addr::from_str(host)
            .map(|a| Host::Ip(IpAddr::V6(a)))
            .map_err(|_| format!("invalid host '{}'", printable(host, 80)));
    }
    let lower = host.to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if name.is_empty() {
        return Err("empty host".into());
    }
    if name.len() > 253
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return Err(format!("invalid host '{}'", printable(host, 80)));
    }
    if let Some(v4) = parse_ipv4_literal(name) {
        return Ok(Host::Ip(IpAddr::V4(v4)));
    }
    let last = name.rsplit('.').next().unwrap_or(name);
    if is_numeric_label(last) {
        return Err(format!(
            "host '{}' ends in a number but is not a valid IPv4 address",
            printable(host, 80)
        ));
    }
    if name.split('.').any(|l| l.is_empty() || l.len() > 63) {
        return Err(format!("invalid host '{}'", printable(host, 80)));
    }
    Ok(Host::Name(name.to_string()))
}

fn is_numeric_label(label: &str) -> bool {
    let hex = label
        .strip_prefix("0x")
        .or_else(|| label.strip_prefix("0X"));
    match hex {
        Some(h) => h.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// `inet_aton(3)`: one to four parts, each decimal, octal (leading `0`) or hex (`0x`); the last
/// part fills the remaining bytes. `None` for anything else, including overflow.
pub fn parse_ipv4_literal(s: &str) -> Option<Ipv4Addr> {
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    let mut parts = [0u64; 4];
    let mut n = 0;
    for p in s.split('.') {
        if n == 4 {
            return None;
        }
        parts[n] = parse_aton_part(p)?;
        n += 1;
    }
    let (head, last) = (&parts[..n - 1], parts[n - 1]);
    if head.iter().any(|&v| v > 255) {
        return None;
    }
    let last_max: u64 = match n {
        1 => 0xffff_ffff,
        2 => 0xff_ffff,
        3 => 0xffff,
        _ => 0xff,
    };
    if last > last_max {
        return None;
    }
    let mut addr = last as u32;
    for (i, &v) in head.iter().enumerate() {
        addr |= (v as u32) << (24 - 8 * i);
    }
    Some(Ipv4Addr::from(addr))
}

fn parse_aton_part(p: &str) -> Option<u64> {
    let (digits, radix) = if let Some(h) = p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
        (h, 16)
    } else if p.len() > 1 && p.starts_with('0') {
        (&p[1..], 8)
    } else {
        (p, 10)
    };
    if digits.is_empty() {
        // "0x" alone is 0 (as WHATWG reads it); "" is not a part.
        return (radix == 16).then_some(0);
    }
    // from_str_radix would accept a sign; only digits of the radix are allowed here.
    if digits.len() > 32 || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// Lower-case, one trailing dot dropped. `*.` is not a spelling of `*`: it becomes the empty
/// pattern, which matches nothing and fails validation.
fn normalise_pattern(p: &str) -> String {
    let lower = p.trim().to_ascii_lowercase();
    match lower.strip_suffix('.') {
        Some("*") => String::new(),
        Some(s) => s.to_string(),
        None => lower,
    }
}

fn pattern_is_valid(pattern: &str) -> bool {
    let p = normalise_pattern(pattern);
    if p == "*" {
        return true;
    }
    let name = p.strip_prefix("*.").unwrap_or(&p);
    match parse_host(name) {
        Ok(Host::Name(_)) => true,
        // Address entries must be written plainly; `*.` in front of one means nothing.
        Ok(Host::Ip(_)) => !p.starts_with("*.") && pattern_ip(&p).is_some(),
        Err(_) => false,
    }
}

/// An allowlist entry naming an address, in its plain spelling only.
fn pattern_ip(p: &str) -> Option<IpAddr> {
    let inner = p
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(p);
    IpAddr::from_str(inner).ok()
}

fn pattern_matches(pattern: &str, host: &Host) -> bool {
    let p = normalise_pattern(pattern);
    if p == "*" {
        return true;
    }
    match host {
        Host::Ip(ip) => pattern_ip(&p).is_some_and(|a| canonical_ip(a) == canonical_ip(*ip)),
        Host::Name(name) => match p.strip_prefix("*.") {
            Some(suffix) => {
                !suffix.is_empty()
                    && !suffix.contains('*')
                    && name.len() > suffix.len() + 1
                    && name.ends_with(suffix)
                    && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
            }
            None => !p.contains('*') && *name == p,
        },
    }
}

/// Attacker-supplied text for a message or record: printable ASCII, at most `max` characters.
pub(crate) fn printable(s: &str, max: usize) -> String {
    s.chars()
        .take(max)
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> IpAddr {
        IpAddr::V4(s.parse().unwrap())
    }

    fn v6(s: &str) -> IpAddr {
        IpAddr::V6(s.parse().unwrap())
    }

    fn open() -> EgressPolicy {
        EgressPolicy {
            allow_hosts: vec!["*".into()],
            ..EgressPolicy::default()
        }
    }

    fn denied(p: &EgressPolicy, ip: IpAddr) -> bool {
        !p.check_addr(ip, 443).is_allow()
    }

    #[test]
    fn hard_deny_list_v4() {
        let p = open();
        for a in [
            "127.0.0.1",
            "127.255.255.254",
            "169.254.169.254",
            "169.254.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "224.0.0.1",
            "239.255.255.250",
            "255.255.255.255",
            "240.0.0.1",
            "100.100.100.200",
            "192.0.0.192",
            "168.63.129.16",
        ] {
            assert!(denied(&p, v4(a)), "{a} must be denied");
        }
    }

    #[test]
    fn liftable_deny_list_v4_and_v6() {
        let p = open();
        for a in [
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "192.0.0.8",
            "198.18.0.1",
            "198.19.255.255",
        ] {
            assert!(denied(&p, v4(a)), "{a} must be denied");
        }
        for a in ["fc00::1", "fd12:3456::1", "fec0::1"] {
            assert!(denied(&p, v6(a)), "{a} must be denied");
        }
    }

    #[test]
    fn public_addresses_pass() {
        let p = open();
        for a in [
            "93.184.216.34",
            "8.8.8.8",
            "172.32.0.1",
            "172.15.255.255",
            "100.128.0.1",
            "198.20.0.1",
            "192.0.1.1",
            "11.0.0.1",
        ] {
            assert!(p.check_addr(v4(a), 443).is_allow(), "{a} must pass");
        }
        for a in [
            "2606:2800:220:1:248:1893:25c8:1946",
            "2001:4860:4860::8888",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            assert!(p.check_addr(v6(a), 443).is_allow(), "{a} must pass");
        }
    }

    #[test]
    fn hard_deny_list_v6() {
        let p = open();
        for a in [
            "::1",
            "::",
            "fe80::1",
            "febf::1",
            "ff02::1",
            "ff05::2",
            "fd00:ec2::254",
        ] {
            assert!(denied(&p, v6(a)), "{a} must be denied");
        }
    }

    #[test]
    fn mapped_compat_and_translated_v6_are_judged_as_v4() {
        let p = open();
        for a in [
            "::ffff:127.0.0.1",
            "::ffff:7f00:1",
            "::ffff:169.254.169.254",
            "::ffff:a9fe:a9fe",
            "::127.0.0.1",
            "::169.254.169.254",
            "::ffff:0:169.254.169.254",
            "::ffff:10.0.0.1",
            "::10.0.0.1",
            "::0.0.0.2",
        ] {
            assert!(denied(&p, v6(a)), "{a} must be denied");
        }
        assert!(p.check_addr(v6("::ffff:93.184.216.34"), 443).is_allow());
        let Verdict::Deny(why) = p.check_addr(v6("::ffff:169.254.169.254"), 80) else {
            panic!("must deny")
        };
        assert!(
            why.contains("169.254.169.254") && why.contains("metadata"),
            "{why}"
        );
    }

    #[test]
    fn translation_prefixes_inherit_the_embedded_v4_class() {
        let p = open();
        for a in [
            "64:ff9b::127.0.0.1",
            "64:ff9b::169.254.169.254",
            "64:ff9b::10.0.0.1",
            "64:ff9b:1::a9fe:a9fe",
            "2002:7f00:1::",
            "2002:a9fe:a9fe::1",
            "2002:c0a8:101::1",
            // Teredo: client address is the inverted last 32 bits (~127.0.0.1).
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
        ] {
            assert!(denied(&p, v6(a)), "{a} must be denied");
        }
        // A range naming either the embedded IPv4 or the IPv6 form lifts the private ones only.
        let lifted = EgressPolicy {
            allow_cidrs: vec![
                "10.0.0.0/8".parse().unwrap(),
                "::/0".parse().unwrap(),
                "0.0.0.0/0".parse().unwrap(),
            ],
            ..open()
        };
        assert!(lifted.check_addr(v6("64:ff9b::10.0.0.1"), 443).is_allow());
        assert!(lifted.check_addr(v6("2002:a00:1::"), 443).is_allow());
        assert!(denied(&lifted, v6("64:ff9b::127.0.0.1")));
        assert!(denied(&lifted, v6("2002:a9fe:a9fe::")));
    }

    #[test]
    fn allow_cidrs_lift_private_ranges_only() {
        let p = EgressPolicy {
            allow_cidrs: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            ..open()
        };
        assert!(p.check_addr(v4("10.1.2.3"), 443).is_allow());
        assert!(p.check_addr(v6("::ffff:10.1.2.3"), 443).is_allow());
        assert!(p.check_addr(v6("fd00::5"), 443).is_allow());
        assert!(denied(&p, v4("192.168.1.1")), "not opened");
        assert!(
            denied(&p, v6("fd00:ec2::254")),
            "AWS IPv6 metadata stays denied"
        );

        // Even "everything" never lifts loopback, link-local, metadata, multicast, reserved.
        let all = EgressPolicy {
            allow_cidrs: vec![
                "0.0.0.0/0".parse().unwrap(),
                "::/0".parse().unwrap(),
                "127.0.0.0/8".parse().unwrap(),
                "169.254.0.0/16".parse().unwrap(),
                "100.64.0.0/10".parse().unwrap(),
            ],
            ..open()
        };
        for a in [
            "127.0.0.1",
            "169.254.169.254",
            "169.254.1.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "100.100.100.200",
        ] {
            assert!(denied(&all, v4(a)), "{a} must stay denied");
        }
        for a in [
            "::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "ff02::1",
        ] {
            assert!(denied(&all, v6(a)), "{a} must stay denied");
        }
        assert!(all.check_addr(v4("192.168.0.1"), 443).is_allow());
        assert!(all.check_addr(v4("100.64.0.1"), 443).is_allow());
    }

    #[test]
    fn deny_addrs_are_always_refused() {
        let p = EgressPolicy {
            allow_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
            deny_addrs: vec![
                "10.0.0.5:8003".parse().unwrap(),
                "0.0.0.0:9100".parse().unwrap(),
                "203.0.113.9:0".parse().unwrap(),
            ],
            ..open()
        };
        assert!(!denied(&p, v4("10.0.0.5")));
        assert!(!p.check_addr(v4("10.0.0.5"), 8003).is_allow());
        assert!(!p.check_addr(v6("::ffff:10.0.0.5"), 8003).is_allow());
        assert!(!p.check_addr(v4("93.184.216.34"), 9100).is_allow());
        assert!(!p.check_addr(v4("203.0.113.9"), 80).is_allow());
        assert!(p.check_addr(v4("203.0.113.10"), 80).is_allow());
        assert!(
            !p.check_addr_inner(v4("127.0.0.1"), 9100, true).is_allow(),
            "test bypass keeps deny_addrs"
        );
    }

    #[test]
    fn test_bypass_lifts_loopback_only() {
        let p = open();
        assert!(p.check_addr_inner(v4("127.0.0.1"), 80, true).is_allow());
        assert!(p.check_addr_inner(v6("::1"), 80, true).is_allow());
        assert!(
            !p.check_addr_inner(v4("169.254.169.254"), 80, true)
                .is_allow()
        );
        assert!(!p.check_addr_inner(v4("0.0.0.0"), 80, true).is_allow());
        assert!(!p.check_addr(v4("127.0.0.1"), 80).is_allow());
    }

    #[test]
    fn inet_aton_spellings() {
        let meta = Ipv4Addr::new(169, 254, 169, 254);
        for s in [
            "2852039166",
            "0xa9fea9fe",
            "0XA9FEA9FE",
            "0251.0376.0251.0376",
            "169.254.43518",
            "169.16689662",
            "0xa9.0xfe.0xa9.0xfe",
            "0251.254.0xa9.254",
            "169.254.169.254",
        ] {
            assert_eq!(parse_ipv4_literal(s), Some(meta), "{s}");
        }
        assert_eq!(
            parse_ipv4_literal("127.1"),
            Some(Ipv4Addr::new(127, 0, 0, 1))
        );
        assert_eq!(parse_ipv4_literal("0"), Some(Ipv4Addr::new(0, 0, 0, 0)));
        assert_eq!(parse_ipv4_literal("0x"), Some(Ipv4Addr::new(0, 0, 0, 0)));
        assert_eq!(
            parse_ipv4_literal("017700000001"),
            Some(Ipv4Addr::new(127, 0, 0, 1))
        );
        for bad in [
            "",
            "4294967296",
            "1.2.3.4.5",
            "256.1.1.1",
            "1.2.3.256",
            "1.2.65536",
            "08",
            "1..2",
            "+1",
            "-1",
            "0x1g",
            "1.2.3.",
            " 1",
        ] {
            assert_eq!(parse_ipv4_literal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn request_hosts_in_any_spelling_are_addresses() {
        let meta = Host::Ip(v4("169.254.169.254"));
        for s in [
            "2852039166",
            "0xa9fea9fe",
            "0251.0376.0251.0376",
            "169.254.43518",
            "169.254.169.254.",
            "0XA9FEA9FE",
        ] {
            assert_eq!(parse_host(s), Ok(meta.clone()), "{s}");
        }
        assert_eq!(parse_host("[::1]"), Ok(Host::Ip(v6("::1"))));
        assert_eq!(
            parse_host("::ffff:169.254.169.254"),
            Ok(Host::Ip(v6("::ffff:169.254.169.254")))
        );
        assert_eq!(
            parse_host("Api.Example.COM."),
            Ok(Host::Name("api.example.com".into()))
        );
        for bad in [
            "4294967296",
            "1.2.3.4.5",
            "example.123",
            "example.0x1f",
            "[::1",
            "[fe80::1%eth0]",
            "a b",
            "a/b",
            "ex@mple.com",
            "",
            ".",
            "a..b",
            "%31%32%37.0.0.1",
            "ünï.com",
        ] {
            assert!(parse_host(bad).is_err(), "{bad:?} must be refused");
        }
        let p = open();
        for s in [
            "2852039166",
            "0xa9fea9fe",
            "0251.0376.0251.0376",
            "169.254.43518",
        ] {
            let Ok(Host::Ip(ip)) = parse_host(s) else {
                panic!("{s}")
            };
            assert!(!p.check_addr(ip, 80).is_allow(), "{s}");
        }
    }

    #[test]
    fn host_patterns() {
        let p = EgressPolicy {
            allow_hosts: vec![
                "*.example.com".into(),
                "API.Other.org.".into(),
                "203.0.113.7".into(),
                "[2001:db8::1]".into(),
            ],
            ..EgressPolicy::default()
        };
        for ok in [
            "a.example.com",
            "a.b.example.com",
            "A.EXAMPLE.COM.",
            "api.other.org",
            "api.other.org.",
            "203.0.113.7",
            "0xcb007107",
            "[2001:db8::1]",
            "::ffff:203.0.113.7",
        ] {
            assert!(p.check_host(ok, 443).is_allow(), "{ok}");
        }
        for bad in [
            "example.com",
            "badexample.com",
            "a.badexample.com",
            "example.com.evil.net",
            "other.org",
            "x.api.other.org",
            "203.0.113.8",
            "evil.com",
        ] {
            assert!(!p.check_host(bad, 443).is_allow(), "{bad}");
        }
        assert!(
            !p.check_host("a.example.com", 8080).is_allow(),
            "port allowlist"
        );
        assert!(
            !EgressPolicy::default()
                .check_host("a.example.com", 443)
                .is_allow(),
            "empty allowlist refuses"
        );
        assert!(open().check_host("anything.test", 80).is_allow());
        // Malformed patterns never match and are reported by validate().
        let weird = EgressPolicy {
            allow_hosts: vec!["*example.com".into(), "a.*.com".into(), "*.".into()],
            ..EgressPolicy::default()
        };
        assert!(!weird.check_host("xexample.com", 443).is_allow());
        assert!(!weird.check_host("a.b.com", 443).is_allow());
        assert!(weird.validate().is_err());
        assert!(p.validate().is_ok());
        assert!(
            EgressPolicy {
                allow_hosts: vec!["*.0xa9fea9fe".into()],
                ..EgressPolicy::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            EgressPolicy {
                allow_ports: vec![0],
                ..EgressPolicy::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            EgressPolicy {
                bandwidth_bytes_per_sec: 0,
                ..EgressPolicy::default()
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn ipnet_parse_and_contains() {
        let n: IpNet = "10.0.0.0/8".parse().unwrap();
        assert!(n.contains(v4("10.255.0.1")));
        assert!(!n.contains(v4("11.0.0.1")));
        assert!(!n.contains(v6("::ffff:10.0.0.1")), "same family only");
        assert_eq!(n.to_string(), "10.0.0.0/8");
        let z: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(z.contains(v4("1.2.3.4")));
        let h: IpNet = "192.0.2.1".parse().unwrap();
        assert_eq!(h.prefix(), 32);
        let u: IpNet = "fc00::/7".parse().unwrap();
        assert!(u.contains(v6("fdff::1")) && !u.contains(v6("fe00::1")));
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "10/8",
            "::/129",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "x/8",
            "0x0a000000/8",
        ] {
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
        let parsed: Vec<IpNet> = serde_json::from_str(r#"["10.0.0.0/8","fd00::/8"]"#).unwrap();
        assert_eq!(parsed.len(), 2);
        assert!(serde_json::from_str::<IpNet>(r#""10.0.0.1/8""#).is_err());
    }
}
