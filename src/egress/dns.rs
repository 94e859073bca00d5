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
mod tests {
    //! The resolvers against a DNS server of the test's own on 127.0.0.1 (UDP and TCP on one port),
    //! and the proxy with a [`DnsResolver`]: whatever the server answers still meets the deny list.

    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use hickory_resolver::proto::op::{Message, OpCode, Query};
    use hickory_resolver::proto::rr::RecordType;
    use hickory_resolver::proto::rr::rdata::{A, AAAA, CNAME};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream, UdpSocket};
    use tokio::sync::oneshot;

    use super::*;
    use crate::egress::{ConnRecord, EgressPolicy, ProxyLimits, ProxySession};

    const T: Duration = Duration::from_secs(10);

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn name(s: &str) -> Name {
        Name::from_ascii(s).unwrap()
    }

    fn a(owner: &str, addr: &str) -> Record {
        Record::from_rdata(name(owner), 60, RData::A(A(addr.parse().unwrap())))
    }

    fn aaaa(owner: &str, addr: &str) -> Record {
        Record::from_rdata(name(owner), 60, RData::AAAA(AAAA(addr.parse().unwrap())))
    }

    fn cname(owner: &str, target: &str) -> Record {
        Record::from_rdata(name(owner), 60, RData::CNAME(CNAME(name(target))))
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Transport {
        Udp,
        Tcp,
    }

    /// What the test server sends back for one question.
    struct Reply {
        code: ResponseCode,
        answers: Vec<Record>,
        /// TC set (and no answers sent): the client must ask again over TCP.
        truncated: bool,
        /// Over UDP, first send a reply with the wrong id whose answer is 127.0.0.66.
        forged_first: bool,
    }

    impl Reply {
        fn answers(answers: Vec<Record>) -> Option<Reply> {
            Some(Reply {
                code: ResponseCode::NoError,
                answers,
                truncated: false,
                forged_first: false,
            })
        }

        fn code(code: ResponseCode) -> Option<Reply> {
            Some(Reply {
                code,
                answers: Vec::new(),
                truncated: false,
                forged_first: false,
            })
        }
    }

    /// The zone: the reply to a question, or `None` to stay silent.
    type Zone = dyn Fn(&Query, Transport) -> Option<Reply> + Send + Sync;

    struct TestDns {
        addr: SocketAddr,
        /// Every question received: transport, lower-cased name, type.
        seen: Arc<Mutex<Vec<(Transport, String, RecordType)>>>,
    }

    impl TestDns {
        fn seen(&self) -> Vec<(Transport, String, RecordType)> {
            self.seen.lock().unwrap().clone()
        }

        fn resolver(&self) -> DnsResolver {
            DnsResolver::new(self.addr, Duration::from_secs(3)).unwrap()
        }
    }

    fn respond(
        zone: &Zone,
        seen: &Mutex<Vec<(Transport, String, RecordType)>>,
        query: &[u8],
        transport: Transport,
    ) -> Vec<Vec<u8>> {
        let Ok(request) = Message::from_vec(query) else {
            return Vec::new();
        };
        let Some(q) = request.queries.first() else {
            return Vec::new();
        };
        seen.lock().unwrap().push((
            transport,
            q.name().to_lowercase().to_ascii(),
            q.query_type(),
        ));
        let Some(reply) = zone(q, transport) else {
            return Vec::new();
        };
        let mut m = Message::response(request.metadata.id, OpCode::Query);
        m.metadata.recursion_desired = request.metadata.recursion_desired;
        m.metadata.recursion_available = true;
        m.metadata.response_code = reply.code;
        m.add_query(q.clone());
        let mut out = Vec::new();
        if reply.forged_first && transport == Transport::Udp {
            let mut forged = m.clone();
            forged.metadata.id = request.metadata.id.wrapping_add(1);
            forged.add_answer(a(&q.name().to_ascii(), "127.0.0.66"));
            out.push(forged.to_vec().unwrap());
        }
        if reply.truncated {
            m.metadata.truncation = true;
        } else {
            m.add_answers(reply.answers);
        }
        out.push(m.to_vec().unwrap());
        out
    }

    /// A DNS server on 127.0.0.1: UDP and TCP (any number of questions per connection) on one port.
    async fn test_dns(
        zone: impl Fn(&Query, Transport) -> Option<Reply> + Send + Sync + 'static,
    ) -> TestDns {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let udp = UdpSocket::bind(addr).await.unwrap();
        let zone: Arc<Zone> = Arc::new(zone);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (z, s) = (zone.clone(), seen.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((n, from)) = udp.recv_from(&mut buf).await {
                for reply in respond(&*z, &s, &buf[..n], Transport::Udp) {
                    let _ = udp.send_to(&reply, from).await;
                }
            }
        });
        let (z, s) = (zone, seen.clone());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = tcp.accept().await {
                let (z, s) = (z.clone(), s.clone());
                tokio::spawn(async move {
                    while let Ok(len) = conn.read_u16().await {
                        let mut q = vec![0u8; usize::from(len)];
                        if conn.read_exact(&mut q).await.is_err() {
                            return;
                        }
                        for reply in respond(&*z, &s, &q, Transport::Tcp) {
                            let mut framed =
                                u16::try_from(reply.len()).unwrap().to_be_bytes().to_vec();
                            framed.extend_from_slice(&reply);
                            if conn.write_all(&framed).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        TestDns { addr, seen }
    }

    fn is(q: &Query, owner: &str, rtype: RecordType) -> bool {
        q.name() == &name(owner) && q.query_type() == rtype
    }

    #[tokio::test]
    async fn dns_resolver_follows_a_cname_chain_and_ignores_forged_and_off_chain_answers() {
        let dns = test_dns(|q, _| {
            if is(q, "www.example.test.", RecordType::A) {
                let mut r = Reply::answers(vec![
                    cname("www.example.test.", "edge.example.test."),
                    a("edge.example.test.", "93.184.216.34"),
                    // Not on the chain: ignored.
                    a("example.test.", "192.0.2.99"),
                ])?;
                r.forged_first = true;
                return Some(r);
            }
            Reply::answers(Vec::new())
        })
        .await;
        let r = dns.resolver();
        let got = r.resolve("WWW.example.test.").await.unwrap();
        assert_eq!(got, vec![ip("93.184.216.34")]);
        // Both questions, each once, over UDP, for exactly the name asked (no search list).
        let mut seen = dns.seen();
        seen.sort_by_key(|(_, _, t)| u16::from(*t));
        assert_eq!(
            seen,
            vec![
                (Transport::Udp, "www.example.test.".into(), RecordType::A),
                (Transport::Udp, "www.example.test.".into(), RecordType::AAAA),
            ]
        );
        // Literals are not sent to the server; malformed hosts are refused before it.
        assert_eq!(
            r.resolve("0x7f000001").await.unwrap(),
            vec![ip("127.0.0.1")]
        );
        assert_eq!(r.resolve("[::1]").await.unwrap(), vec![ip("::1")]);
        assert_eq!(
            r.resolve("bad host").await.unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(dns.seen().len(), 2);
    }

    /// The server answers only with the CNAME; the target is asked for in a second question.
    #[tokio::test]
    async fn dns_resolver_asks_for_a_cname_target_it_was_not_given() {
        let dns = test_dns(|q, _| {
            if is(q, "alias.test.", RecordType::A) {
                return Reply::answers(vec![cname("alias.test.", "target.test.")]);
            }
            if is(q, "target.test.", RecordType::A) {
                return Reply::answers(vec![a("target.test.", "192.0.2.7")]);
            }
            Reply::answers(Vec::new())
        })
        .await;
        let got = dns.resolver().resolve("alias.test").await.unwrap();
        assert_eq!(got, vec![ip("192.0.2.7")]);
    }

    /// A answers come first, then AAAA; one family failing leaves the other's answer standing.
    #[tokio::test]
    async fn dns_resolver_returns_both_families_a_first() {
        let dns = test_dns(|q, _| {
            if is(q, "dual.test.", RecordType::A) {
                return Reply::answers(vec![
                    a("dual.test.", "192.0.2.1"),
                    a("dual.test.", "192.0.2.1"),
                ]);
            }
            if is(q, "dual.test.", RecordType::AAAA) {
                return Reply::answers(vec![aaaa("dual.test.", "2001:db8::1")]);
            }
            if is(q, "half.test.", RecordType::AAAA) {
                return Reply::code(ResponseCode::ServFail);
            }
            if is(q, "half.test.", RecordType::A) {
                return Reply::answers(vec![a("half.test.", "192.0.2.2")]);
            }
            Reply::answers(Vec::new())
        })
        .await;
        let r = dns.resolver();
        assert_eq!(
            r.resolve("dual.test").await.unwrap(),
            vec![ip("192.0.2.1"), ip("2001:db8::1")]
        );
        assert_eq!(r.resolve("half.test").await.unwrap(), vec![ip("192.0.2.2")]);
    }

    /// UDP answers are truncated (TC); the full answer is on TCP at the same address.
    #[tokio::test]
    async fn dns_resolver_falls_back_to_tcp_on_truncation() {
        let dns = test_dns(|q, transport| {
            if transport == Transport::Udp {
                let mut r = Reply::answers(Vec::new())?;
                r.truncated = true;
                return Some(r);
            }
            if is(q, "big.test.", RecordType::AAAA) {
                return Reply::answers(vec![aaaa("big.test.", "2001:db8::5")]);
            }
            Reply::answers(Vec::new())
        })
        .await;
        let got = dns.resolver().resolve("big.test").await.unwrap();
        assert_eq!(got, vec![ip("2001:db8::5")]);
        let seen = dns.seen();
        for t in [RecordType::A, RecordType::AAAA] {
            for transport in [Transport::Udp, Transport::Tcp] {
                assert!(
                    seen.contains(&(transport, "big.test.".into(), t)),
                    "{transport:?} {t}: {seen:?}"
                );
            }
        }
    }

    #[tokio::test]
    async fn dns_resolver_reports_missing_names_and_server_failures() {
        let dns = test_dns(|q, _| {
            if q.name() == &name("nodata.test.") {
                return Reply::answers(Vec::new());
            }
            if q.name() == &name("broken.test.") {
                return Reply::code(ResponseCode::ServFail);
            }
            Reply::code(ResponseCode::NXDomain)
        })
        .await;
        let r = dns.resolver();
        let e = r.resolve("missing.test").await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        assert_eq!(e.to_string(), "no such host");
        let e = r.resolve("nodata.test").await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        assert_eq!(e.to_string(), "no addresses for host");
        let e = r.resolve("broken.test").await.unwrap_err();
        assert!(e.to_string().contains("Server Failure"), "{e}");
    }

    #[tokio::test]
    async fn dns_resolver_times_out_on_a_silent_server() {
        let dns = test_dns(|_, _| None).await;
        let r = DnsResolver::new(dns.addr, Duration::from_millis(300)).unwrap();
        let e = tokio::time::timeout(T, r.resolve("example.test"))
            .await
            .expect("bounded by the resolver's timeout")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        // Unanswered UDP questions are sent again within the timeout, never to another server.
        assert!(!dns.seen().is_empty());
    }

    /// Nothing is cached: every call asks the server, and sees its current answer.
    #[tokio::test]
    async fn dns_resolver_asks_the_server_every_time() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let dns = test_dns(move |q, _| {
            if is(q, "moving.test.", RecordType::A) {
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                return Reply::answers(vec![a("moving.test.", &format!("192.0.2.{n}"))]);
            }
            Reply::answers(Vec::new())
        })
        .await;
        let r = dns.resolver();
        for n in 1..=3 {
            assert_eq!(
                r.resolve("moving.test").await.unwrap(),
                vec![ip(&format!("192.0.2.{n}"))]
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn chain_addresses_follow_the_chain_only() {
        let q = name("a.test.");
        let answers = vec![
            a("other.test.", "192.0.2.9"),
            cname("A.Test.", "b.test."),
            cname("b.test.", "c.test."),
            a("b.test.", "192.0.2.8"),
            a("c.test.", "192.0.2.3"),
            aaaa("C.TEST.", "2001:db8::3"),
            a("c.test.", "192.0.2.3"),
        ];
        assert_eq!(
            chain_addresses(&q, &answers),
            vec![ip("192.0.2.3"), ip("2001:db8::3")]
        );
        // A CNAME loop ends after a bounded number of hops, with nothing found.
        let looped = vec![cname("a.test.", "b.test."), cname("b.test.", "a.test.")];
        assert!(chain_addresses(&q, &looped).is_empty());
    }

    #[tokio::test]
    async fn static_hosts_overlay() {
        let inner: Arc<dyn Resolver> =
            Arc::new(StaticHosts::new(None).with("b.test", vec![ip("192.0.2.2")]));
        let r = StaticHosts::new(Some(inner)).with("A.Test.", vec![ip("192.0.2.1")]);
        assert_eq!(r.resolve("a.test").await.unwrap(), vec![ip("192.0.2.1")]);
        assert_eq!(r.resolve("b.test").await.unwrap(), vec![ip("192.0.2.2")]);
        assert_eq!(
            r.resolve("c.test").await.unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    // ---------------------------------------------------------------------------------------------
    // The proxy with a DnsResolver: every answer meets the deny list before any connect. Every
    // address here is on loopback, so a failure of the deny list could not reach anything else.

    /// An origin on 127.0.0.1 that answers 200 and counts its connections.
    async fn origin() -> (u16, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                h.fetch_add(1, Ordering::SeqCst);
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    )
                    .await;
                let _ = s.shutdown().await;
            }
        });
        (port, hits)
    }

    /// Serves `session` on 127.0.0.1, sends one `GET http://{host}:{port}/` per host and returns
    /// the status lines and the session's records.
    async fn through_proxy(
        session: ProxySession,
        hosts: &[&str],
        port: u16,
    ) -> (Vec<String>, Vec<ConnRecord>) {
        let session = Arc::new(session);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let s = session.clone();
        let task = tokio::spawn(async move {
            s.serve(listener, async {
                let _ = stopped.await;
            })
            .await
        });
        let mut statuses = Vec::new();
        for host in hosts {
            let mut c = TcpStream::connect(proxy).await.unwrap();
            let req = format!("GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n");
            c.write_all(req.as_bytes()).await.unwrap();
            let mut out = Vec::new();
            tokio::time::timeout(T, c.read_to_end(&mut out))
                .await
                .expect("the proxy closes")
                .unwrap();
            let text = String::from_utf8_lossy(&out).into_owned();
            statuses.push(text.lines().next().unwrap_or_default().to_string());
        }
        let _ = stop.send(());
        tokio::time::timeout(T, task).await.unwrap().unwrap();
        (statuses, session.records())
    }

    fn policy(hosts: &[&str], port: u16) -> Arc<EgressPolicy> {
        Arc::new(EgressPolicy {
            allow_hosts: hosts.iter().map(|h| h.to_string()).collect(),
            allow_ports: vec![port],
            ..EgressPolicy::default()
        })
    }

    /// An allowed name whose DNS answers are loopback addresses is refused: no connection is made.
    #[tokio::test]
    async fn proxy_refuses_loopback_answers_of_the_dns_server() {
        let (port, hits) = origin().await;
        let dns = test_dns(|q, _| {
            if is(q, "inside.test.", RecordType::A) {
                return Reply::answers(vec![a("inside.test.", "127.0.0.1")]);
            }
            if is(q, "inside.test.", RecordType::AAAA) {
                return Reply::answers(vec![aaaa("inside.test.", "::1")]);
            }
            Reply::code(ResponseCode::NXDomain)
        })
        .await;
        let resolver: Arc<dyn Resolver> = Arc::new(dns.resolver());
        let session = ProxySession::with_limits(
            policy(&["inside.test"], port),
            resolver,
            ProxyLimits::default(),
        );
        let (statuses, records) = through_proxy(session, &["inside.test"], port).await;
        assert!(statuses[0].contains(" 403 "), "{statuses:?}");
        assert_eq!(records.len(), 1, "{records:?}");
        assert!(!records[0].allowed, "{records:?}");
        assert_eq!(records[0].addr, None, "{records:?}");
        assert_eq!(hits.load(Ordering::SeqCst), 0, "the origin was reached");
        // The refusal came from the answers: the server was asked.
        assert!(!dns.seen().is_empty());
    }

    /// A name that first resolves to an allowed address, then to a denied one: the first request
    /// goes through, the second is refused (each connection resolves afresh and checks the answer).
    #[tokio::test]
    async fn proxy_checks_every_fresh_dns_answer() {
        let (port, hits) = origin().await;
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let dns = test_dns(move |q, _| {
            if is(q, "rebind.test.", RecordType::A) {
                let first = c.fetch_add(1, Ordering::SeqCst) == 0;
                let addr = if first { "127.0.0.1" } else { "127.0.0.2" };
                return Reply::answers(vec![a("rebind.test.", addr)]);
            }
            Reply::answers(Vec::new())
        })
        .await;
        let resolver: Arc<dyn Resolver> = Arc::new(dns.resolver());
        // Loopback passes in this test session; 127.0.0.2 stands for a denied address.
        let mut p = (*policy(&["rebind.test"], port)).clone();
        p.deny_addrs = vec![SocketAddr::new(ip("127.0.0.2"), 0)];
        let session = ProxySession::new_allowing_loopback_for_test(
            Arc::new(p),
            resolver,
            ProxyLimits::default(),
        );
        let (statuses, records) =
            through_proxy(session, &["rebind.test", "rebind.test"], port).await;
        assert!(statuses[0].contains(" 200 "), "{statuses:?}");
        assert!(statuses[1].contains(" 403 "), "{statuses:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        let refused: Vec<_> = records.iter().filter(|r| !r.allowed).collect();
        assert_eq!(refused.len(), 1, "{records:?}");
        assert!(
            refused[0]
                .reason
                .as_deref()
                .unwrap_or_default()
                .contains("127.0.0.2"),
            "{records:?}"
        );
    }
}
