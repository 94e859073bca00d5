//! Egress through the daemon's filtering proxy, on the local backend.
//!
//! Every address these tests touch belongs to test hosts in a network namespace the test creates:
//! the daemon itself runs in a second namespace whose only route leads into the test-host
//! namespace, so even a failed block could not send a packet off this machine. The test process
//! reaches the daemon over a private veth pair.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{Daemon, Opts};
use serde_json::{Value, json};

const ALLOWED: &str = "203.0.113.10"; // "public-looking" (TEST-NET-3)
const METADATA: &str = "169.254.169.254";

fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect(args[0]);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces and three veth ends, removed on drop.
struct Net {
    daemon_ns: String,
    hosts_ns: String,
    ctl_root: String,
    daemon_ip: String,
    dns_ip: String,
    private_ip: String,
    logdir: tempfile::TempDir,
    hosts: Child,
}

impl Net {
    fn new() -> Net {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = (std::process::id() % 200) as u32 * 4 + N.fetch_add(1, Ordering::SeqCst);
        let (a, b) = (n / 250 + 1, n % 250 + 1);
        let tag = format!("{}x{}", std::process::id() % 100_000, n);
        let daemon_ns = format!("ead{tag}");
        let hosts_ns = format!("eah{tag}");
        let ctl_root = format!("eac{tag}");
        let ctl_ns = format!("ecd{tag}");
        let link_d = format!("eld{tag}");
        let link_h = format!("elh{tag}");
        let ctl_net = format!("10.{}.{}", 210 + a, b);
        let host_net = format!("10.{}.{}", 220 + a, b);
        sh(&["ip", "netns", "add", &daemon_ns]);
        sh(&["ip", "netns", "add", &hosts_ns]);
        // Control link: root <-> daemon namespace.
        sh(&[
            "ip", "link", "add", &ctl_root, "type", "veth", "peer", "name", &ctl_ns,
        ]);
        sh(&["ip", "link", "set", &ctl_ns, "netns", &daemon_ns]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{ctl_net}.1/30"),
            "dev",
            &ctl_root,
        ]);
        sh(&["ip", "link", "set", &ctl_root, "up"]);
        sh(&[
            "ip",
            "-n",
            &daemon_ns,
            "addr",
            "add",
            &format!("{ctl_net}.2/30"),
            "dev",
            &ctl_ns,
        ]);
        sh(&["ip", "-n", &daemon_ns, "link", "set", &ctl_ns, "up"]);
        sh(&["ip", "-n", &daemon_ns, "link", "set", "lo", "up"]);
        // Daemon namespace <-> test hosts; the daemon's default route leads only there.
        sh(&[
            "ip", "-n", &daemon_ns, "link", "add", &link_d, "type", "veth", "peer", "name", &link_h,
        ]);
        sh(&[
            "ip", "-n", &daemon_ns, "link", "set", &link_h, "netns", &hosts_ns,
        ]);
        sh(&[
            "ip",
            "-n",
            &daemon_ns,
            "addr",
            "add",
            &format!("{host_net}.1/24"),
            "dev",
            &link_d,
        ]);
        sh(&["ip", "-n", &daemon_ns, "link", "set", &link_d, "up"]);
        sh(&[
            "ip",
            "-n",
            &daemon_ns,
            "route",
            "add",
            "default",
            "via",
            &format!("{host_net}.2"),
        ]);
        for addr in [
            format!("{host_net}.2/24"),
            format!("{ALLOWED}/32"),
            format!("{METADATA}/32"),
        ] {
            sh(&["ip", "-n", &hosts_ns, "addr", "add", &addr, "dev", &link_h]);
        }
        sh(&["ip", "-n", &hosts_ns, "link", "set", &link_h, "up"]);
        sh(&["ip", "-n", &hosts_ns, "link", "set", "lo", "up"]);

        let logdir = tempfile::tempdir().unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/egress/hosts.py");
        let private_ip = format!("{host_net}.2");
        let hosts = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{hosts_ns}"))
            .arg("python3")
            .arg(&script)
            .args([
                logdir.path().to_str().unwrap(),
                &private_ip,
                ALLOWED,
                METADATA,
                &private_ip,
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("test hosts");
        for _ in 0..200 {
            if logdir.path().join("ready").exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        assert!(
            logdir.path().join("ready").exists(),
            "test hosts did not start"
        );
        Net {
            daemon_ns,
            hosts_ns,
            ctl_root,
            daemon_ip: format!("{ctl_net}.2"),
            dns_ip: private_ip.clone(),
            private_ip,
            logdir,
            hosts,
        }
    }

    fn hits(&self, ip: &str) -> String {
        std::fs::read_to_string(self.logdir.path().join(format!("hits-{ip}.log")))
            .unwrap_or_default()
    }

    /// A daemon in the daemon namespace with an egress profile for curl.
    fn daemon(&self, profile_network: &str) -> (Daemon, PathBuf) {
        let profiles = tempfile::tempdir().unwrap().keep();
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("sandbox-profiles");
        for e in std::fs::read_dir(&shipped).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), profiles.join(e.file_name())).unwrap();
        }
        let text = std::fs::read_to_string(shipped.join("http-egress.toml")).unwrap();
        let start = text.find("[network]").unwrap();
        let end = text[start..].find("\n[limits]").unwrap() + start;
        let text = format!(
            "{}[network]\n{profile_network}\n{}",
            &text[..start],
            &text[end..]
        );
        std::fs::write(profiles.join("http-egress.toml"), text).unwrap();
        let d = Daemon::start_with(Opts {
            env: vec![(
                "EXECUTOR_ARM_PROFILES_DIR".into(),
                profiles.display().to_string(),
            )],
            config: Some(format!(
                "[egress]\nproxy_port = 3128\ndns_server = \"{}:53\"\n",
                self.dns_ip
            )),
            wrapper: vec![
                "nsenter".into(),
                format!("--net=/run/netns/{}", self.daemon_ns),
            ],
            listen: Some(format!("{}:0", self.daemon_ip)),
        });
        (d, profiles)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = self.hosts.kill();
        let _ = self.hosts.wait();
        let _ = Command::new("ip")
            .args(["link", "del", &self.ctl_root])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.daemon_ns])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.hosts_ns])
            .output();
    }
}

/// curl with `-f`, so an HTTP error from the proxy (403) is a failed run.
async fn curl(d: &Daemon, args: &[&str]) -> common::Resp {
    let caps = d.cap(&["HttpRequest", "NetworkAccess"]);
    let mut argv = vec!["-f"];
    argv.extend_from_slice(args);
    d.exec(json!({"action_type": "http", "command": "curl", "args": argv, "timeout_seconds": 20, "capability_token": caps})).await
}

fn records(r: &common::Resp) -> Vec<Value> {
    r.json["network"].as_array().cloned().unwrap_or_default()
}

const NETWORK: &str = "mode = \"egress\"\nallow_hosts = [\"allowed.test\", \"rebind.test\", \"metadata.test\", \"*.allowed.test\"]\nallow_ports = [80]\nbandwidth_mbps = 10\nbyte_cap_mb = 50";

#[tokio::test(flavor = "multi_thread")]
async fn egress_is_allowlisted_and_ssrf_safe() {
    let net = Net::new();
    let (d, _profiles) = net.daemon(NETWORK);

    // Allowed host:port -> 200 with the body, recorded.
    let r = curl(&d, &["-sS", "http://allowed.test/"]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.json["stdout"],
        json!(format!("hello from {ALLOWED}\n")),
        "{}",
        r.text
    );
    let rec = records(&r);
    assert_eq!(rec.len(), 1, "{}", r.text);
    assert_eq!(rec[0]["allowed"], json!(true));
    assert_eq!(rec[0]["host"], json!("allowed.test"));
    assert_eq!(rec[0]["addr"], json!(format!("{ALLOWED}:80")));
    assert!(rec[0]["bytes_down"].as_u64().unwrap() > 0);
    let audit = d.audit_lines();
    assert!(
        audit.last().unwrap()["network"]
            .as_array()
            .is_some_and(|a| a.len() == 1),
        "audit line carries the connections"
    );

    // Not-allowed host and port -> refused.
    let r = curl(&d, &["-sS", "http://private.test/"]).await;
    assert_eq!(r.json["success"], json!(false), "{}", r.text);
    assert_eq!(records(&r)[0]["allowed"], json!(false));
    let r = curl(&d, &["-sS", "http://allowed.test:8080/"]).await;
    assert_eq!(records(&r)[0]["allowed"], json!(false), "{}", r.text);

    // The metadata address: by an allowed name, by literal and by decimal/hex/octal/mapped spellings.
    for url in [
        "http://metadata.test/latest/meta-data/",
        "http://169.254.169.254/latest/meta-data/",
        "http://2852039166/",
        "http://0xa9fea9fe/",
        "http://0251.0376.0251.0376/",
        "http://169.254.43518/",
        "http://[::ffff:169.254.169.254]/",
        "http://[::ffff:a9fe:a9fe]/",
    ] {
        let r = curl(&d, &["-sS", url]).await;
        assert_eq!(r.json["success"], json!(false), "{url}: {}", r.text);
        let rec = records(&r);
        assert!(
            !rec.is_empty() && rec.iter().all(|c| c["allowed"] == json!(false)),
            "{url}: {}",
            r.text
        );
    }

    // A redirect from the allowed host to the metadata host is refused at the hop.
    let r = curl(
        &d,
        &["-sS", "-L", "http://allowed.test/redirect-to-metadata"],
    )
    .await;
    let rec = records(&r);
    assert_eq!(rec.len(), 2, "{}", r.text);
    assert_eq!(rec[0]["allowed"], json!(true));
    assert_eq!(rec[1]["allowed"], json!(false));

    // A name that resolves first to an allowed, then to a denied address: never connected to the latter.
    let r1 = curl(&d, &["-sS", "http://rebind.test/"]).await;
    assert_eq!(records(&r1)[0]["allowed"], json!(true), "{}", r1.text);
    let r2 = curl(&d, &["-sS", "http://rebind.test/"]).await;
    assert_eq!(records(&r2)[0]["allowed"], json!(false), "{}", r2.text);

    // The daemon's own port and loopback through the proxy -> refused.
    let port = d.addr.rsplit(':').next().unwrap().to_string();
    for url in [
        format!("http://{}:{port}/health", net.daemon_ip),
        format!("http://127.0.0.1:{port}/health"),
    ] {
        let r = curl(&d, &["-sS", &url]).await;
        assert_eq!(r.json["success"], json!(false), "{url}: {}", r.text);
    }

    // A tool that ignores the proxy settings finds no route.
    let r = curl(
        &d,
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "5",
            &format!("http://{ALLOWED}/direct"),
        ],
    )
    .await;
    assert_eq!(r.json["success"], json!(false), "{}", r.text);
    let r = curl(
        &d,
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "5",
            &format!("http://{}/direct", net.private_ip),
        ],
    )
    .await;
    assert_eq!(r.json["success"], json!(false), "{}", r.text);

    // Host side: the metadata and private hosts saw nothing at all; the allowed host no direct hit.
    assert_eq!(
        net.hits(METADATA),
        "",
        "the metadata host must never be reached"
    );
    assert_eq!(
        net.hits(&net.private_ip),
        "",
        "the private host must never be reached"
    );
    assert!(!net.hits(ALLOWED).contains("/direct"));

    // Refusals are counted.
    let m = d.get("/metrics").await.text;
    assert!(
        m.contains("executor_egress_connections_total{verdict=\"refused\"}"),
        "{m}"
    );

    // Argument policy still applies before anything runs.
    for args in [
        &["file:///etc/passwd"][..],
        &["--unix-socket", "/var/run/docker.sock", "http://x/"],
        &["-o", "/tmp/x", "http://allowed.test/"],
        &["--proto", "=file", "http://allowed.test/"],
    ] {
        let r = curl(&d, args).await;
        assert_eq!(r.status, 403, "{args:?}: {}", r.text);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bandwidth_is_limited() {
    let net = Net::new();
    let (d, _profiles) = net.daemon(&NETWORK.replace("bandwidth_mbps = 10", "bandwidth_mbps = 8"));
    let bytes = 3_000_000u64;
    let r = curl(
        &d,
        &[
            "-sS",
            "-o",
            "/dev/null",
            &format!("http://allowed.test/bytes/{bytes}"),
        ],
    )
    .await;
    // `-o` is refused by the argument policy; write to stdout and let the output cap discard.
    assert_eq!(r.status, 403);
    let r = curl(
        &d,
        &[
            "-sS",
            "-w",
            "%{size_download} %{time_total}",
            &format!("http://allowed.test/bytes/{bytes}"),
        ],
    )
    .await;
    let rec = records(&r);
    assert_eq!(
        rec[0]["allowed"],
        json!(true),
        "{}",
        &r.text[..r.text.len().min(400)]
    );
    // The output cap (1 MiB) stops the run early; measure what crossed the proxy in that time.
    let down = rec[0]["bytes_down"].as_u64().unwrap();
    let secs = r.json["duration_ms"].as_u64().unwrap() as f64 / 1000.0;
    let rate = down as f64 / secs;
    eprintln!("egress rate: {down} bytes in {secs:.2}s = {rate:.0} B/s (limit 1000000 B/s)");
    // The limiter is a ceiling: the transfer may be slower on a loaded machine, never faster.
    assert!(
        rate <= 1_000_000.0 * 1.2,
        "rate {rate:.0} B/s exceeds the 8 Mbps limit"
    );
}
