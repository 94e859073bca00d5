use super::*;
use crate::egress::{EgressPolicy, ProxyRun, StaticHosts};
use tokio::io::AsyncWriteExt;

fn rule(s: &str) -> TcpRule {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn policy(rules: &[&str]) -> TcpPolicy {
    TcpPolicy {
        rules: rules.iter().map(|r| rule(r)).collect(),
        deny_addrs: vec!["198.51.100.1:8003".parse().unwrap()],
        host_addrs: vec!["192.0.2.50".parse().unwrap()],
    }
}

fn allowed(p: &TcpPolicy, dest: &str) -> bool {
    p.check(dest.parse().unwrap()).is_allow()
}

#[test]
fn rules_parse_strictly() {
    let r = rule("10.20.0.0/16:5432");
    assert_eq!(
        (r.net().to_string(), r.port()),
        ("10.20.0.0/16".into(), 5432)
    );
    assert_eq!(r.to_string(), "10.20.0.0/16:5432");
    assert_eq!(rule("[2001:db8::/32]:22").to_string(), "[2001:db8::/32]:22");
    for bad in [
        "10.20.0.1/16:5432",
        "10.20.0.0/16",
        "10.20.0.0/16:0",
        "2001:db8::/32:22",
        "[10.0.0.0/8]:22",
        "example.com/32:22",
    ] {
        assert!(bad.parse::<TcpRule>().is_err(), "{bad}");
    }
}

#[test]
fn loopback_and_mapped_rules_are_refused_with_a_reason() {
    for bad in ["127.0.0.0/8:80", "127.0.0.1/32:5432", "[::1/128]:22"] {
        let e = bad.parse::<TcpRule>().unwrap_err().to_string();
        assert!(
            e.contains("loopback") && e.contains("its own"),
            "{bad}: {e}"
        );
    }
    let e = "[::ffff:10.0.0.0/104]:80"
        .parse::<TcpRule>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("IPv4 form"), "{e}");
    // Ranges that cover loopback among much else are accepted: loopback stays denied in them.
    assert!("0.0.0.0/0:80".parse::<TcpRule>().is_ok());
    assert!("[::/0]:80".parse::<TcpRule>().is_ok());
}

#[test]
fn only_rule_ports_and_ranges_pass() {
    let p = policy(&["203.0.113.0/24:5432", "[2001:db8::/32]:22"]);
    assert!(allowed(&p, "203.0.113.7:5432"));
    assert!(allowed(&p, "[2001:db8::5]:22"));
    assert!(!allowed(&p, "203.0.113.7:5433"), "another port");
    assert!(!allowed(&p, "203.0.114.7:5432"), "outside the range");
    assert!(!allowed(&p, "[2001:db8::5]:5432"), "the other rule's port");
    let Verdict::Deny(why) = p.check("203.0.114.7:5432".parse().unwrap()) else {
        panic!()
    };
    assert!(why.contains("not allowed by any tcp rule"), "{why}");
    assert_eq!(p.listeners(), vec![(5432, false), (22, true)]);
}

#[test]
fn a_covering_rule_does_not_lift_the_deny_list() {
    let p = policy(&["0.0.0.0/0:80", "[::/0]:80", "0.0.0.0/0:8003"]);
    assert!(allowed(&p, "93.184.216.34:80"));
    for denied in [
        "169.254.169.254:80",
        "169.254.1.1:80",
        "127.0.0.1:80",
        "10.0.0.1:80",
        "192.168.1.1:80",
        "0.0.0.0:80",
        "[fe80::1]:80",
        "[fd00:ec2::254]:80",
        "[::ffff:169.254.169.254]:80",
        "[64:ff9b::a9fe:a9fe]:80",
        "198.51.100.1:8003",
        "192.0.2.50:80",
    ] {
        let Verdict::Deny(why) = p.check(denied.parse().unwrap()) else {
            panic!("{denied} must be denied")
        };
        assert!(why.contains("names it explicitly"), "{denied}: {why}");
    }
}

#[test]
fn a_rule_naming_a_denied_address_lifts_it() {
    let p = policy(&[
        "169.254.169.254/32:80",
        "10.20.0.0/16:5432",
        "169.254.0.0/16:22",
        "198.51.100.1/32:8003",
        "192.0.2.50/32:80",
        "[fd00::/8]:22",
    ]);
    assert!(
        allowed(&p, "169.254.169.254:80"),
        "exactly the metadata address"
    );
    assert!(allowed(&p, "10.20.3.4:5432"), "a range inside private 10/8");
    assert!(allowed(&p, "169.254.1.1:22"), "the link-local range itself");
    assert!(
        !allowed(&p, "169.254.169.254:22"),
        "the metadata address inside a link-local rule is not named by it"
    );
    assert!(
        allowed(&p, "198.51.100.1:8003"),
        "the daemon's address, exactly"
    );
    assert!(allowed(&p, "192.0.2.50:80"), "a host address, exactly");
    assert!(allowed(&p, "[fd00::1]:22"));
    assert!(
        !allowed(&p, "[fd00:ec2::254]:22"),
        "AWS IPv6 metadata inside a ULA rule is not named by it"
    );
    // A range around a host address is not exact.
    let p = policy(&["192.0.2.0/24:80"]);
    assert!(!allowed(&p, "192.0.2.50:80"));
    assert!(allowed(&p, "192.0.2.51:80"));
}

/// A loopback echo server standing in for a remote one.
async fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Over the unix socket (the docker path): a client names its destination in the first line;
/// only what the rules allow is connected, whatever the line says, and every connection is
/// recorded with its bytes.
#[tokio::test]
async fn unix_clients_reach_only_allowed_destinations_and_are_recorded() {
    let echo = echo_server().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tcp.sock");
    let http = tokio::net::UnixListener::bind(dir.path().join("proxy.sock")).unwrap();
    let mut run = ProxyRun::start(
        EgressPolicy {
            allow_hosts: vec![],
            ..EgressPolicy::default()
        },
        Arc::new(StaticHosts::new(None)),
        http,
    );
    // The test's loopback server is named exactly, as only a test can (profiles refuse
    // loopback rules).
    let p = TcpPolicy {
        rules: vec![
            TcpRule {
                net: IpNet::new(echo.ip(), 32).unwrap(),
                port: echo.port(),
            },
            rule("0.0.0.0/0:80"),
        ],
        deny_addrs: vec![],
        host_addrs: vec![],
    };
    run.serve_tcp(p, TcpListeners::Unix(UnixListener::bind(&path).unwrap()));

    let mut c = tokio::net::UnixStream::connect(&path).await.unwrap();
    c.write_all(format!("EAT1 {echo}\nping").as_bytes())
        .await
        .unwrap();
    let mut got = [0u8; 4];
    c.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ping");
    drop(c);

    // A probe that sends nothing is no connection (the supervisor checks the socket so).
    drop(tokio::net::UnixStream::connect(&path).await.unwrap());
    for line in [
        format!("EAT1 127.0.0.1:{}\n", echo.port().wrapping_add(1).max(1)),
        "EAT1 169.254.169.254:80\n".to_string(),
        "GET / HTTP/1.1\n".to_string(),
    ] {
        let mut c = tokio::net::UnixStream::connect(&path).await.unwrap();
        c.write_all(line.as_bytes()).await.unwrap();
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{line:?}: nothing comes back");
    }

    let records = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            if run.session_records().len() == 4 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(records.is_ok(), "four records within 10 s");
    let records = run.finish().await;
    assert_eq!(records.len(), 4, "{records:?}");
    let ok = records.iter().find(|r| r.allowed).expect("the allowed one");
    assert_eq!(ok.method, TCP_METHOD);
    assert_eq!(ok.addr, Some(echo));
    assert_eq!((ok.host.as_str(), ok.port), ("127.0.0.1", echo.port()));
    assert_eq!((ok.bytes_up, ok.bytes_down), (4, 4));
    assert!(!ok.is_refusal());
    let refused: Vec<_> = records.iter().filter(|r| !r.allowed).collect();
    assert_eq!(refused.len(), 3, "{records:?}");
    assert!(refused.iter().all(|r| r.is_refusal() && r.addr.is_none()));
    assert!(
        refused.iter().any(|r| r.host == "169.254.169.254"
            && r.reason.as_deref().is_some_and(|w| w.contains("metadata"))),
        "{refused:?}"
    );
    assert!(
        refused
            .iter()
            .any(|r| r.reason.as_deref() == Some("malformed raw TCP preamble")),
        "{refused:?}"
    );
}
