//! Name resolution for the proxy: the [`Resolver`] seam, the system resolver, a minimal DNS
//! client (A and AAAA over UDP, TCP on truncation) and a static overlay.
//!
//! Nothing here caches: every connection resolves afresh and connects to an address it has just
//! checked. Nothing here decides policy either: every address returned is checked by the proxy.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::Instant;

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

/// A minimal stub resolver: one A and one AAAA question to `server`, answers checked against a
/// random id and the question, CNAME chains followed within the response, TCP when truncated.
#[derive(Debug, Clone)]
pub struct DnsResolver {
    server: SocketAddr,
    timeout: Duration,
}

/// How often unanswered UDP questions are sent again within the timeout.
const RESEND_EVERY: Duration = Duration::from_secs(1);

impl DnsResolver {
    pub fn new(server: SocketAddr, timeout: Duration) -> Self {
        DnsResolver { server, timeout }
    }

    async fn query_tcp(
        &self,
        query: &Question,
        labels: &[Vec<u8>],
        deadline: Instant,
    ) -> io::Result<Vec<IpAddr>> {
        let exchange = async {
            let mut s = TcpStream::connect(self.server).await?;
            let len =
                u16::try_from(query.wire.len()).map_err(|_| io::Error::other("query too long"))?;
            let mut msg = len.to_be_bytes().to_vec();
            msg.extend_from_slice(&query.wire);
            s.write_all(&msg).await?;
            let len = s.read_u16().await? as usize;
            let mut buf = vec![0u8; len];
            s.read_exact(&mut buf).await?;
            match decode_reply(&buf, query.id, labels, query.qtype) {
                Ok(Reply::Addrs(a)) => Ok(a),
                Ok(Reply::NoSuchName) => Ok(Vec::new()),
                Ok(Reply::Truncated) => Err(io::Error::other("truncated DNS answer over TCP")),
                Err(e) => Err(io::Error::other(format!("DNS over TCP: {e:?}"))),
            }
        };
        tokio::time::timeout_at(deadline, exchange)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "DNS timeout")))
    }
}

struct Question {
    qtype: u16,
    id: u16,
    wire: Vec<u8>,
    answer: Option<io::Result<Vec<IpAddr>>>,
    no_such_name: bool,
}

#[async_trait]
impl Resolver for DnsResolver {
    async fn resolve(&self, host: &str) -> io::Result<Vec<IpAddr>> {
        let name = match parse_host(host) {
            Ok(Host::Name(n)) => n,
            Ok(Host::Ip(ip)) => return Ok(vec![ip]),
            Err(why) => return Err(io::Error::new(io::ErrorKind::InvalidInput, why)),
        };
        let labels = name_labels(&name);
        let deadline = Instant::now() + self.timeout;

        let bind: SocketAddr = match self.server {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let sock = UdpSocket::bind(bind).await?;
        // A connected socket drops datagrams from any other source.
        sock.connect(self.server).await?;

        let id_a: u16 = rand::random();
        let id_aaaa = id_a ^ (rand::random::<u16>() | 1);
        let mut questions = Vec::with_capacity(2);
        for (qtype, id) in [(TYPE_A, id_a), (TYPE_AAAA, id_aaaa)] {
            let wire = encode_query(id, &name, qtype)?;
            sock.send(&wire).await?;
            questions.push(Question {
                qtype,
                id,
                wire,
                answer: None,
                no_such_name: false,
            });
        }

        let mut buf = vec![0u8; 4096];
        let mut resend_at = Instant::now() + RESEND_EVERY;
        while questions.iter().any(|q| q.answer.is_none()) {
            let wake = resend_at.min(deadline);
            let n = match tokio::time::timeout_at(wake, sock.recv(&mut buf)).await {
                Ok(Ok(n)) => n,
                // ICMP port unreachable and the like: the server is not there.
                Ok(Err(e)) => return Err(e),
                Err(_) if Instant::now() >= deadline => break,
                Err(_) => {
                    for q in questions.iter().filter(|q| q.answer.is_none()) {
                        sock.send(&q.wire).await?;
                    }
                    resend_at += RESEND_EVERY;
                    continue;
                }
            };
            let msg = &buf[..n];
            for q in questions.iter_mut().filter(|q| q.answer.is_none()) {
                let answer = match decode_reply(msg, q.id, &labels, q.qtype) {
                    // Not an answer to this question (stale, spoofed, garbage): keep waiting.
                    Err(DecodeError::NotOurs | DecodeError::Malformed(_)) => continue,
                    Err(DecodeError::Rcode(rc)) => {
                        Err(io::Error::other(format!("DNS server answered rcode {rc}")))
                    }
                    Ok(Reply::Addrs(a)) => Ok(a),
                    Ok(Reply::NoSuchName) => {
                        q.no_such_name = true;
                        Ok(Vec::new())
                    }
                    Ok(Reply::Truncated) => self.query_tcp(q, &labels, deadline).await,
                };
                q.answer = Some(answer);
                break;
            }
        }

        let all_answered = questions.iter().all(|q| q.answer.is_some());
        let no_such_name = questions.iter().any(|q| q.no_such_name);
        let mut addrs: Vec<IpAddr> = Vec::new();
        let mut first_err = None;
        for q in &mut questions {
            match q.answer.take() {
                Some(Ok(found)) => {
                    for a in found {
                        if !addrs.contains(&a) {
                            addrs.push(a);
                        }
                    }
                }
                Some(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                None => {}
            }
        }
        if !addrs.is_empty() {
            // One family may time out or fail on a broken server; the other's answer stands.
            return Ok(addrs);
        }
        if no_such_name {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such host"));
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        if all_answered {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "no addresses for host",
            ));
        }
        Err(io::Error::new(io::ErrorKind::TimedOut, "DNS timeout"))
    }
}

// ---------------------------------------------------------------------------------------------
// Wire format (RFC 1035)

pub(crate) const TYPE_A: u16 = 1;
pub(crate) const TYPE_CNAME: u16 = 5;
pub(crate) const TYPE_AAAA: u16 = 28;
const TYPE_OPT: u16 = 41;
const CLASS_IN: u16 = 1;
/// EDNS0 payload size we advertise (the DNS flag day value): fewer truncated answers.
const EDNS_PAYLOAD: u16 = 1232;
const MAX_CNAME_HOPS: usize = 8;

/// A name as lower-cased labels: compared label by label, so a dot inside a label cannot fake
/// a different name.
type Labels = Vec<Vec<u8>>;

fn name_labels(name: &str) -> Labels {
    name.split('.')
        .filter(|l| !l.is_empty())
        .map(|l| l.as_bytes().to_ascii_lowercase())
        .collect()
}

/// A recursive query (RD) for `name`/`qtype`/IN with an EDNS0 OPT record.
pub(crate) fn encode_query(id: u16, name: &str, qtype: u16) -> io::Result<Vec<u8>> {
    let invalid = || io::Error::new(io::ErrorKind::InvalidInput, "invalid DNS name");
    let mut m = Vec::with_capacity(64);
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    m.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 1]); // QD=1 AN=0 NS=0 AR=1
    let mut name_len = 1;
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(invalid());
        }
        name_len += label.len() + 1;
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    if name_len > 255 {
        return Err(invalid());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&CLASS_IN.to_be_bytes());
    // OPT: root owner, type 41, class = payload size, ttl 0 (no DO), rdlen 0.
    m.push(0);
    m.extend_from_slice(&TYPE_OPT.to_be_bytes());
    m.extend_from_slice(&EDNS_PAYLOAD.to_be_bytes());
    m.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    Ok(m)
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The addresses of the queried type at the end of the CNAME chain (possibly none).
    Addrs(Vec<IpAddr>),
    NoSuchName,
    /// TC set: ask again over TCP.
    Truncated,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// Wrong id, not a response, or a different question.
    NotOurs,
    Malformed(&'static str),
    /// A server failure code other than NXDOMAIN.
    Rcode(u8),
}

fn be16(m: &[u8], at: usize) -> Result<u16, DecodeError> {
    m.get(at..at + 2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .ok_or(DecodeError::Malformed("short message"))
}

/// Reads a possibly compressed name at `at`; returns lower-cased labels and the offset after
/// the name as written at `at`. Pointers must point backwards, so a loop cannot be built.
fn read_name(m: &[u8], at: usize) -> Result<(Labels, usize), DecodeError> {
    let mut labels = Vec::new();
    let mut pos = at;
    let mut after = None;
    let mut total = 1;
    loop {
        let len = *m
            .get(pos)
            .ok_or(DecodeError::Malformed("name runs past the end"))? as usize;
        match len & 0xC0 {
            0x00 if len == 0 => {
                return Ok((labels, after.unwrap_or(pos + 1)));
            }
            0x00 => {
                let label = m
                    .get(pos + 1..pos + 1 + len)
                    .ok_or(DecodeError::Malformed("label runs past the end"))?;
                total += len + 1;
                if total > 255 {
                    return Err(DecodeError::Malformed("name longer than 255"));
                }
                labels.push(label.to_ascii_lowercase());
                pos += 1 + len;
            }
            0xC0 => {
                let low = *m
                    .get(pos + 1)
                    .ok_or(DecodeError::Malformed("short pointer"))?;
                let target = ((len & 0x3F) << 8) | usize::from(low);
                if target >= pos {
                    return Err(DecodeError::Malformed("forward compression pointer"));
                }
                after.get_or_insert(pos + 2);
                pos = target;
            }
            _ => return Err(DecodeError::Malformed("reserved label type")),
        }
    }
}

/// Checks that `m` answers exactly our question (`id`, name, `qtype`, IN) and extracts the
/// addresses of `qtype` owned by the end of the CNAME chain starting at the question name.
pub(crate) fn decode_reply(
    m: &[u8],
    id: u16,
    qname: &[Vec<u8>],
    qtype: u16,
) -> Result<Reply, DecodeError> {
    if m.len() < 12 {
        return Err(DecodeError::Malformed("shorter than a header"));
    }
    let flags = be16(m, 2)?;
    let is_response = flags & 0x8000 != 0;
    let opcode = (flags >> 11) & 0xF;
    if be16(m, 0)? != id || !is_response || opcode != 0 || be16(m, 4)? != 1 {
        return Err(DecodeError::NotOurs);
    }
    let ancount = be16(m, 6)?;
    let (name, mut pos) = read_name(m, 12)?;
    if name != qname || be16(m, pos)? != qtype || be16(m, pos + 2)? != CLASS_IN {
        return Err(DecodeError::NotOurs);
    }
    pos += 4;
    if flags & 0x0200 != 0 {
        return Ok(Reply::Truncated);
    }
    match (flags & 0xF) as u8 {
        0 => {}
        3 => return Ok(Reply::NoSuchName),
        rc => return Err(DecodeError::Rcode(rc)),
    }

    let mut cnames: Vec<(Labels, Labels)> = Vec::new();
    let mut addrs: Vec<(Labels, IpAddr)> = Vec::new();
    for _ in 0..ancount {
        let (owner, p) = read_name(m, pos)?;
        let rtype = be16(m, p)?;
        let rclass = be16(m, p + 2)?;
        let rdlen = be16(m, p + 8)? as usize;
        let rdata_at = p + 10;
        let rdata = m
            .get(rdata_at..rdata_at + rdlen)
            .ok_or(DecodeError::Malformed("record data runs past the end"))?;
        pos = rdata_at + rdlen;
        if rclass != CLASS_IN {
            continue;
        }
        match (rtype, rdata.len()) {
            (TYPE_A, 4) if qtype == TYPE_A => {
                addrs.push((
                    owner,
                    IpAddr::V4(Ipv4Addr::new(rdata[0], rdata[1], rdata[2], rdata[3])),
                ));
            }
            (TYPE_AAAA, 16) if qtype == TYPE_AAAA => {
                let mut o = [0u8; 16];
                o.copy_from_slice(rdata);
                addrs.push((owner, IpAddr::V6(Ipv6Addr::from(o))));
            }
            (TYPE_A, _) | (TYPE_AAAA, _) if rtype == qtype => {
                return Err(DecodeError::Malformed("address record of the wrong size"));
            }
            (TYPE_CNAME, _) => {
                let (target, _) = read_name(m, rdata_at)?;
                cnames.push((owner, target));
            }
            _ => {}
        }
    }

    let mut current: &[Vec<u8>] = qname;
    for _ in 0..MAX_CNAME_HOPS {
        match cnames.iter().find(|(owner, _)| owner == current) {
            Some((_, target)) => current = target,
            None => break,
        }
    }
    let found = addrs
        .into_iter()
        .filter(|(owner, _)| owner == current)
        .map(|(_, a)| a)
        .fold(Vec::new(), |mut v, a| {
            if !v.contains(&a) {
                v.push(a);
            }
            v
        });
    Ok(Reply::Addrs(found))
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;

    use super::*;

    fn labels(s: &str) -> Vec<Vec<u8>> {
        name_labels(s)
    }

    #[test]
    fn query_encoding_is_byte_exact() {
        let q = encode_query(0xBEEF, "www.Example.com", TYPE_AAAA).unwrap();
        let mut want = vec![0xBE, 0xEF, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1];
        want.extend_from_slice(b"\x03www\x07Example\x03com\x00");
        want.extend_from_slice(&[0, 28, 0, 1]);
        want.extend_from_slice(&[0, 0, 41, 0x04, 0xD0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(q, want);
        assert!(encode_query(1, "a..b", TYPE_A).is_err());
        assert!(encode_query(1, &"a".repeat(64), TYPE_A).is_err());
        assert!(encode_query(1, &["abcdefghi"; 30].join("."), TYPE_A).is_err());
    }

    /// Response to `www.example.com A`, id 0xBEEF, built by hand:
    /// www.example.com CNAME edge.example.com; edge.example.com A 93.184.216.34;
    /// example.com A 1.2.3.4 (off the chain: ignored).
    fn cname_response() -> Vec<u8> {
        let mut m = vec![0xBE, 0xEF, 0x81, 0x80, 0, 1, 0, 3, 0, 0, 0, 0];
        m.extend_from_slice(b"\x03www\x07example\x03com\x00"); // 12..29; "example" at 16
        m.extend_from_slice(&[0, 1, 0, 1]); // 29..33
        // 33: owner -> 12, CNAME, IN, ttl 60, rdlen 7, "edge" + pointer to 16
        m.extend_from_slice(&[0xC0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 7]);
        m.extend_from_slice(b"\x04edge\xC0\x10"); // rdata at 45..52
        // 52: owner -> 45 (edge.example.com), A, IN, ttl 60, rdlen 4
        m.extend_from_slice(&[0xC0, 45, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 93, 184, 216, 34]);
        // 68: owner -> 16 (example.com), A 1.2.3.4
        m.extend_from_slice(&[0xC0, 16, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 1, 2, 3, 4]);
        assert_eq!(m.len(), 84);
        m
    }

    #[test]
    fn decodes_a_cname_chain() {
        let m = cname_response();
        let got = decode_reply(&m, 0xBEEF, &labels("WWW.example.com"), TYPE_A).unwrap();
        assert_eq!(got, Reply::Addrs(vec!["93.184.216.34".parse().unwrap()]));
    }

    #[test]
    fn rejects_replies_to_other_questions() {
        let m = cname_response();
        assert_eq!(
            decode_reply(&m, 0xBEEE, &labels("www.example.com"), TYPE_A),
            Err(DecodeError::NotOurs)
        );
        assert_eq!(
            decode_reply(&m, 0xBEEF, &labels("www.example.org"), TYPE_A),
            Err(DecodeError::NotOurs)
        );
        assert_eq!(
            decode_reply(&m, 0xBEEF, &labels("www.example.com"), TYPE_AAAA),
            Err(DecodeError::NotOurs)
        );
        let mut query = m.clone();
        query[2] &= 0x7F; // a query, not a response
        assert_eq!(
            decode_reply(&query, 0xBEEF, &labels("www.example.com"), TYPE_A),
            Err(DecodeError::NotOurs)
        );
    }

    #[test]
    fn rcodes_and_truncation() {
        let base = cname_response();
        let mut nx = base.clone();
        nx[3] = 0x83;
        assert_eq!(
            decode_reply(&nx, 0xBEEF, &labels("www.example.com"), TYPE_A),
            Ok(Reply::NoSuchName)
        );
        let mut servfail = base.clone();
        servfail[3] = 0x82;
        assert_eq!(
            decode_reply(&servfail, 0xBEEF, &labels("www.example.com"), TYPE_A),
            Err(DecodeError::Rcode(2))
        );
        let mut tc = base.clone();
        tc[2] |= 0x02;
        assert_eq!(
            decode_reply(&tc, 0xBEEF, &labels("www.example.com"), TYPE_A),
            Ok(Reply::Truncated)
        );
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let m = cname_response();
        for cut in 0..m.len() {
            let r = decode_reply(&m[..cut], 0xBEEF, &labels("www.example.com"), TYPE_A);
            assert!(r.is_err(), "cut at {cut}: {r:?}");
        }
        // A pointer to itself (a loop) in the first answer's owner.
        let mut looped = m.clone();
        looped[33] = 0xC0;
        looped[34] = 33;
        assert!(matches!(
            decode_reply(&looped, 0xBEEF, &labels("www.example.com"), TYPE_A),
            Err(DecodeError::Malformed(_))
        ));
        // An A record with a 5-byte body.
        let mut bad_len = vec![0xBE, 0xEF, 0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0];
        bad_len.extend_from_slice(b"\x01a\x00\x00\x01\x00\x01");
        bad_len.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 5, 1, 2, 3, 4, 5]);
        assert!(decode_reply(&bad_len, 0xBEEF, &labels("a"), TYPE_A).is_err());
        // Random bytes never panic.
        let mut seed = 0x1234_5678u32;
        for _ in 0..2000 {
            let len = (seed % 200) as usize;
            let mut junk = Vec::with_capacity(len);
            for _ in 0..len {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                junk.push(seed as u8);
            }
            let _ = decode_reply(&junk, 0, &labels("a.b"), TYPE_A);
        }
    }

    #[test]
    fn aaaa_answers() {
        let mut m = vec![0x12, 0x34, 0x81, 0x80, 0, 1, 0, 2, 0, 0, 0, 0];
        m.extend_from_slice(b"\x01v\x04test\x00\x00\x1C\x00\x01");
        let mut rr = vec![0xC0, 12, 0, 28, 0, 1, 0, 0, 0, 1, 0, 16];
        rr.extend_from_slice(&"2001:db8::7".parse::<Ipv6Addr>().unwrap().octets());
        m.extend_from_slice(&rr);
        // A record in an AAAA answer: ignored.
        m.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 9, 9, 9, 9]);
        let got = decode_reply(&m, 0x1234, &labels("v.test"), TYPE_AAAA).unwrap();
        assert_eq!(got, Reply::Addrs(vec!["2001:db8::7".parse().unwrap()]));
    }

    /// Answers the A question of a query with the same id and question, after first sending a
    /// reply with the wrong id (which the client must ignore); AAAA gets an empty NOERROR.
    async fn fake_dns_server() -> SocketAddr {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                let q = &buf[..n];
                // Header + question (up to the OPT record, which is 11 bytes at the end).
                let question = &q[12..n - 11];
                let qtype = u16::from_be_bytes([
                    question[question.len() - 4],
                    question[question.len() - 3],
                ]);
                let mut reply = vec![q[0], q[1], 0x81, 0x80, 0, 1, 0, 0, 0, 0, 0, 0];
                reply.extend_from_slice(question);
                if qtype == TYPE_A {
                    reply[7] = 2;
                    // CNAME -> "edge" under the question's parent, then its A record.
                    let parent = 12 + 1 + question[0] as usize; // skip first label
                    let cname_rdata_at = reply.len() + 12;
                    reply.extend_from_slice(&[0xC0, 12, 0, 5, 0, 1, 0, 0, 0, 5, 0, 7]);
                    reply.extend_from_slice(&[4, b'e', b'd', b'g', b'e', 0xC0, parent as u8]);
                    reply.extend_from_slice(&[
                        0xC0,
                        cname_rdata_at as u8,
                        0,
                        1,
                        0,
                        1,
                        0,
                        0,
                        0,
                        5,
                        0,
                        4,
                        93,
                        184,
                        216,
                        34,
                    ]);
                    let mut spoof = reply.clone();
                    spoof[0] ^= 0xFF;
                    spoof[reply.len() - 1] = 127;
                    let _ = sock.send_to(&spoof, from).await;
                }
                let _ = sock.send_to(&reply, from).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn dns_resolver_against_a_local_server() {
        let server = fake_dns_server().await;
        let r = DnsResolver::new(server, Duration::from_secs(3));
        let got = r.resolve("WWW.example.test.").await.unwrap();
        assert_eq!(got, vec!["93.184.216.34".parse::<IpAddr>().unwrap()]);
        // Literals are not sent to the server.
        assert_eq!(
            r.resolve("0x7f000001").await.unwrap(),
            vec!["127.0.0.1".parse::<IpAddr>().unwrap()]
        );
        assert!(r.resolve("bad host").await.is_err());
    }

    /// UDP answers are truncated (TC); the full answer is on TCP at the same address.
    #[tokio::test]
    async fn dns_resolver_falls_back_to_tcp_on_truncation() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let udp = UdpSocket::bind(addr).await.unwrap();
        let answer = |q: &[u8], truncated: bool| {
            let question = &q[12..q.len() - 11];
            let qtype =
                u16::from_be_bytes([question[question.len() - 4], question[question.len() - 3]]);
            let flags = if truncated { 0x83 } else { 0x81 };
            let mut r = vec![q[0], q[1], flags, 0x80, 0, 1, 0, 0, 0, 0, 0, 0];
            r.extend_from_slice(question);
            if qtype == TYPE_AAAA && !truncated {
                r[7] = 1;
                r.extend_from_slice(&[0xC0, 12, 0, 28, 0, 1, 0, 0, 0, 5, 0, 16]);
                r.extend_from_slice(&"2001:db8::5".parse::<Ipv6Addr>().unwrap().octets());
            }
            r
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = udp.recv_from(&mut buf).await {
                let _ = udp.send_to(&answer(&buf[..n], true), from).await;
            }
        });
        tokio::spawn(async move {
            while let Ok((mut s, _)) = tcp.accept().await {
                let Ok(len) = s.read_u16().await else {
                    continue;
                };
                let mut q = vec![0u8; len as usize];
                if s.read_exact(&mut q).await.is_err() {
                    continue;
                }
                let r = answer(&q, false);
                let mut msg = (r.len() as u16).to_be_bytes().to_vec();
                msg.extend_from_slice(&r);
                let _ = s.write_all(&msg).await;
            }
        });
        let r = DnsResolver::new(addr, Duration::from_secs(3));
        let got = r.resolve("big.test").await.unwrap();
        assert_eq!(got, vec!["2001:db8::5".parse::<IpAddr>().unwrap()]);
    }

    #[tokio::test]
    async fn dns_resolver_times_out_on_a_silent_server() {
        let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let r = DnsResolver::new(silent.local_addr().unwrap(), Duration::from_millis(300));
        let e = r.resolve("example.test").await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn static_hosts_overlay() {
        let inner: Arc<dyn Resolver> =
            Arc::new(StaticHosts::new(None).with("b.test", vec!["192.0.2.2".parse().unwrap()]));
        let r = StaticHosts::new(Some(inner)).with("A.Test.", vec!["192.0.2.1".parse().unwrap()]);
        assert_eq!(
            r.resolve("a.test").await.unwrap(),
            vec!["192.0.2.1".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            r.resolve("b.test").await.unwrap(),
            vec!["192.0.2.2".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            r.resolve("c.test").await.unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }
}
