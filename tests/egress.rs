//! Egress through the daemon's filtering proxy, on every backend: local, docker (runc) and gvisor
//! (runsc). Each case runs once per backend, as `local::<case>`, `docker::<case>` and
//! `gvisor::<case>` (`on_every_backend!`, tests/common/backends.rs).
//!
//! Every address these tests touch belongs to test hosts in a network namespace the test creates:
//! the daemon itself runs in a second namespace whose only route leads into the test-host
//! namespace, so even a failed block could not send a packet off this machine. The test process
//! reaches the daemon over a private veth pair. The daemon's namespace also holds a loopback
//! listener that nothing may reach. Containers run with `--network none`; their only way out is
//! the proxy's unix socket. After each run its container, socket directory and proxy listener
//! must be gone (checked from the host: `docker ps`, the directory, the daemon's
//! `/proc/<pid>/net/unix`), after success, refusal, timeout and client disconnect alike; a
//! session's container keeps its directory, with no listener between execs, until the session
//! ends. The package index a session installs from is served by the same test hosts.
//!
//! The container backends need dockerd with runc and runsc and the sandbox image
//! (`scripts/setup-docker.sh`, `scripts/build-sandbox-image.sh`); without them those tests fail,
//! they never skip.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::backends::Backend;
use common::{Daemon, Opts};
use serde_json::{Value, json};

const ALLOWED: &str = "203.0.113.10"; // "public-looking" (TEST-NET-3)
const METADATA: &str = "169.254.169.254";
use common::docker::IMAGE;
use common::wait::{CLEANUP, wait_for, wait_until};
/// Warm pool size of the container backends: the first run launches its container, later ones
/// take a pooled one, so both paths carry egress.
const POOL: usize = 1;

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
    /// Listens on 127.0.0.1:80 in the daemon's namespace.
    loopback: Child,
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
        wait_until("test hosts to start", CLEANUP, || {
            logdir.path().join("ready").exists()
        });
        let loopback = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{daemon_ns}"))
            .arg("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/egress/loopback.py"))
            .args([logdir.path().to_str().unwrap(), "80"])
            .stdout(Stdio::null())
            .spawn()
            .expect("loopback listener");
        wait_until("loopback listener to start", CLEANUP, || {
            logdir.path().join("loopback-ready").exists()
        });
        Net {
            daemon_ns,
            hosts_ns,
            ctl_root,
            daemon_ip: format!("{ctl_net}.2"),
            dns_ip: private_ip.clone(),
            private_ip,
            logdir,
            hosts,
            loopback,
        }
    }

    fn hits(&self, ip: &str) -> String {
        std::fs::read_to_string(self.logdir.path().join(format!("hits-{ip}.log")))
            .unwrap_or_default()
    }

    /// A daemon in the daemon namespace with an egress profile for curl, running on `backend`.
    fn daemon(&self, profile_network: &str, backend: Backend) -> Setup {
        self.daemon_with_limits(profile_network, "", backend)
    }

    /// As [`Net::daemon`], with `limits` (TOML lines) replacing the profile's keys of the same names.
    fn daemon_with_limits(&self, profile_network: &str, limits: &str, backend: Backend) -> Setup {
        self.daemon_with_config(profile_network, limits, "", backend)
    }

    /// As [`Net::daemon_with_limits`], with `extra` (TOML) appended to the daemon's config.
    fn daemon_with_config(
        &self,
        profile_network: &str,
        limits: &str,
        extra: &str,
        backend: Backend,
    ) -> Setup {
        self.daemon_in(&["http-egress"], profile_network, limits, extra, backend)
    }

    /// As [`Net::daemon_with_limits`], for each of `names` (shipped profiles).
    fn daemon_with(
        &self,
        names: &[&str],
        profile_network: &str,
        limits: &str,
        backend: Backend,
    ) -> Setup {
        self.daemon_in(names, profile_network, limits, "", backend)
    }

    /// A daemon whose profiles `names` have `profile_network` and `limits`, with `extra`
    /// appended to its config.
    fn daemon_in(
        &self,
        names: &[&str],
        profile_network: &str,
        limits: &str,
        extra: &str,
        backend: Backend,
    ) -> Setup {
        let profiles_dir = tempfile::tempdir().unwrap();
        let profiles = profiles_dir.path();
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("sandbox-profiles");
        for e in std::fs::read_dir(&shipped).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), profiles.join(e.file_name())).unwrap();
        }
        for name in names {
            write_profile(profiles, &shipped, name, profile_network, limits);
        }
        let egress_dir = tempfile::tempdir().unwrap();
        let d = Daemon::start_with(Opts {
            env: vec![
                (
                    "EXECUTOR_ARM_PROFILES_DIR".into(),
                    profiles.display().to_string(),
                ),
                ("SANDBOX_RUNTIME".into(), backend.runtime().into()),
            ],
            config: Some(format!(
                "[egress]\nproxy_port = 3128\ndns_server = \"{}:53\"\n\
                 [sandbox.docker]\nimage = \"{IMAGE}\"\npool_size = {POOL}\negress_dir = \"{}\"\n\
                 supervisor = \"{}\"\n{extra}",
                self.dns_ip,
                egress_dir.path().display(),
                common::docker::supervisor()
            )),
            wrapper: vec![
                "nsenter".into(),
                format!("--net=/run/netns/{}", self.daemon_ns),
            ],
            listen: Some(format!("{}:0", self.daemon_ip)),
        });
        Setup {
            d,
            backend,
            egress_dir,
            _profiles: profiles_dir,
        }
    }
}

/// Writes shipped profile `name` into `profiles` with its `[network]` section replaced by
/// `network` and `limits` (TOML lines) replacing its keys of the same names.
fn write_profile(profiles: &Path, shipped: &Path, name: &str, network: &str, limits: &str) {
    let text = std::fs::read_to_string(shipped.join(format!("{name}.toml"))).unwrap();
    let start = text.find("[network]").unwrap();
    let end = text[start..].find("\n[limits]").unwrap() + start;
    let mut text = format!("{}[network]\n{network}\n{}", &text[..start], &text[end..]);
    for line in limits.lines() {
        let key = line.split('=').next().unwrap().trim();
        let from = text
            .find(&format!("\n{key} ="))
            .expect("limit key in the profile")
            + 1;
        let to = from + text[from..].find('\n').unwrap();
        text.replace_range(from..to, line);
    }
    std::fs::write(profiles.join(format!("{name}.toml")), text).unwrap();
}

/// A daemon under test and what it must clean up.
struct Setup {
    d: Daemon,
    backend: Backend,
    /// `sandbox.docker.egress_dir` of this daemon.
    egress_dir: tempfile::TempDir,
    _profiles: tempfile::TempDir,
}

impl Setup {
    /// Label value of this daemon's containers.
    fn instance(&self) -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), self.d.pid())
    }

    /// This daemon's containers, any state (checked from the host).
    fn containers(&self) -> Vec<String> {
        let out = Command::new("docker")
            .args(["ps", "-aq", "--no-trunc", "--filter"])
            .arg(format!("label=executor-arm.instance={}", self.instance()))
            .output()
            .expect("docker ps");
        assert!(out.status.success(), "docker ps failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Per-container socket directories that exist now, under every backend's directory.
    fn socket_dirs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for b in std::fs::read_dir(self.egress_dir.path()).unwrap() {
            let b = b.unwrap().path();
            if b.is_dir() {
                out.extend(std::fs::read_dir(&b).unwrap().map(|e| e.unwrap().path()));
            }
        }
        out
    }

    /// Unix sockets of the daemon's network namespace bound under the egress directory: the
    /// proxy's listeners and their connections, which exist only while a run does (an idle pool
    /// container has a directory but no listener).
    fn proxy_sockets(&self) -> Vec<String> {
        let dir = self.egress_dir.path().to_string_lossy().into_owned();
        std::fs::read_to_string(format!("/proc/{}/net/unix", self.d.pid()))
            .expect("the daemon's unix sockets")
            .lines()
            .filter(|l| l.contains(&dir))
            .map(str::to_string)
            .collect()
    }

    /// Waits until the container of the latest run (from the daemon's log, read since the last
    /// call) is gone, then checks that only the warm pool's containers and socket directories
    /// are left.
    fn wait_for_run_cleanup(&self, after: &str) {
        if !self.backend.is_container() {
            return;
        }
        let id = wait_for(
            &format!("after {after}: a container assigned in the daemon's log"),
            CLEANUP,
            // Only the lines logged since the last call: the latest run's assignment.
            || {
                common::docker::assigned_containers(&self.d, &mut Vec::new())
                    .into_iter()
                    .next()
            },
            Option::is_some,
        )
        .expect("found");
        wait_for(
            &format!("after {after}: the run's container {id} removed"),
            CLEANUP,
            || self.containers(),
            |c| !c.contains(&id),
        );
        self.wait_for_cleanup(after);
    }

    /// Waits until at most the warm pool's containers (and their socket directories) are left:
    /// every run's own are gone.
    fn wait_for_cleanup(&self, after: &str) {
        if !self.backend.is_container() {
            return;
        }
        wait_for(
            &format!(
                "after {after}: no more than the pool's containers and socket directories, no proxy socket (containers, socket directories, proxy sockets)"
            ),
            CLEANUP,
            || (self.containers(), self.socket_dirs(), self.proxy_sockets()),
            |(c, dirs, socks)| c.len() <= POOL && dirs.len() <= POOL && socks.is_empty(),
        );
    }

    /// Stops the daemon; nothing of its containers may remain on the host.
    fn finish(mut self) {
        let instance = self.instance();
        self.d.stop();
        if !self.backend.is_container() {
            return;
        }
        wait_for(
            &format!("no container of {instance} left"),
            CLEANUP,
            || self.containers(),
            Vec::is_empty,
        );
        let left: Vec<_> = std::fs::read_dir(self.egress_dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(left.is_empty(), "egress directories left: {left:?}");
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = self.hosts.kill();
        let _ = self.hosts.wait();
        let _ = self.loopback.kill();
        let _ = self.loopback.wait();
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

/// Checks from the host that container `id` runs with network `none` and that the network
/// namespace of its main host process (runc: the command's; runsc: the sandbox's, whose netstack
/// has no device either with `--network=none`) has no interface but `lo`.
fn assert_only_loopback(id: &str) {
    let out = Command::new("docker")
        .args([
            "inspect",
            "--format",
            "{{.HostConfig.NetworkMode}} {{.State.Pid}}",
            id,
        ])
        .output()
        .expect("docker inspect");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut it = text.split_whitespace();
    assert_eq!(it.next(), Some("none"), "{id}: {text}");
    let pid = it.next().unwrap_or("0");
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).expect("container netns");
    let ifaces: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, vec!["lo"], "{id}: {dev}");
}

/// curl with `-f`, so an HTTP error from the proxy (403) is a failed run.
async fn curl(d: &Daemon, args: &[&str]) -> common::Resp {
    d.exec(curl_body(d, args, 30)).await
}

fn curl_body(d: &Daemon, args: &[&str], timeout_seconds: u64) -> Value {
    let caps = d.cap(&["HttpRequest", "NetworkAccess"]);
    let mut argv = vec!["-f"];
    argv.extend_from_slice(args);
    json!({"action_type": "http", "command": "curl", "args": argv, "timeout_seconds": timeout_seconds, "capability_token": caps})
}

fn records(r: &common::Resp) -> Vec<Value> {
    r.json["network"].as_array().cloned().unwrap_or_default()
}

on_every_backend!(
    multi_thread;
    egress_is_allowlisted_and_ssrf_safe,
    a_stream_shows_egress_lines_as_they_arrive,
    bandwidth_is_limited,
    a_session_installs_a_package_from_its_index,
);

const NETWORK: &str = "mode = \"egress\"\nallow_hosts = [\"allowed.test\", \"rebind.test\", \"metadata.test\", \"loopback.test\", \"*.allowed.test\"]\nallow_ports = [80]\nbandwidth_mbps = 10\nbyte_cap_mb = 50";

async fn egress_is_allowlisted_and_ssrf_safe(backend: Backend) {
    let net = Net::new();
    let setup = net.daemon(NETWORK, backend);
    let d = &setup.d;

    // Readiness sees what egress needs (runsc registered with --host-uds=open).
    let ready = d.get("/readyz").await;
    let detail = ready.json["backends"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["backend"] == json!(backend.name())))
        .map(|b| b["detail"].to_string())
        .unwrap_or_default();
    assert!(
        !detail.is_empty() && !detail.contains("egress profiles unavailable"),
        "{}",
        ready.text
    );

    // Allowed host:port -> 200 with the body, recorded; on the backend under test.
    let r = curl(d, &["-sS", "http://allowed.test/"]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["backend"], json!(backend.name()), "{}", r.text);
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
    let line = d.execution_line(r.json["exec_id"].as_str().expect("exec_id"));
    assert!(
        line["network"].as_array().is_some_and(|a| a.len() == 1),
        "audit line carries the connections"
    );

    // Not-allowed host and port -> refused.
    let r = curl(d, &["-sS", "http://private.test/"]).await;
    assert_eq!(r.json["success"], json!(false), "{}", r.text);
    assert_eq!(records(&r)[0]["allowed"], json!(false));
    let r = curl(d, &["-sS", "http://allowed.test:8080/"]).await;
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
        let r = curl(d, &["-sS", url]).await;
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
        d,
        &["-sS", "-L", "http://allowed.test/redirect-to-metadata"],
    )
    .await;
    // Records are filed as connections end: the refused hop's may come first.
    let rec = records(&r);
    assert_eq!(rec.len(), 2, "{}", r.text);
    let first = rec.iter().find(|c| c["host"] == "allowed.test");
    assert_eq!(
        first.map(|c| &c["allowed"]),
        Some(&json!(true)),
        "{}",
        r.text
    );
    assert_eq!(first.map(|c| &c["status"]), Some(&json!(302)), "{}", r.text);
    let hop = rec.iter().find(|c| c["host"] != "allowed.test");
    assert_eq!(
        hop.map(|c| &c["allowed"]),
        Some(&json!(false)),
        "{}",
        r.text
    );

    // A name that resolves first to an allowed, then to a denied address: never connected to the latter.
    let r1 = curl(d, &["-sS", "http://rebind.test/"]).await;
    assert_eq!(records(&r1)[0]["allowed"], json!(true), "{}", r1.text);
    let r2 = curl(d, &["-sS", "http://rebind.test/"]).await;
    assert_eq!(records(&r2)[0]["allowed"], json!(false), "{}", r2.text);

    // The daemon's own port, and a listener on the daemon's loopback (port 80, which the
    // profile allows) by name, literal and other spellings, through the proxy -> refused.
    // `NO_PROXY` sends loopback names straight to the sandbox's own loopback; `--noproxy ""`
    // makes curl take the proxy for them anyway, as any command could.
    let port = d.addr.rsplit(':').next().unwrap().to_string();
    for url in [
        format!("http://{}:{port}/health", net.daemon_ip),
        format!("http://127.0.0.1:{port}/health"),
        "http://loopback.test/".to_string(),
        "http://127.0.0.1/".to_string(),
        "http://2130706433/".to_string(),
        "http://0x7f000001/".to_string(),
        "http://[::ffff:127.0.0.1]/".to_string(),
        "http://[::1]/".to_string(),
    ] {
        let r = curl(d, &["-sS", "--noproxy", "", &url]).await;
        assert_eq!(r.json["success"], json!(false), "{url}: {}", r.text);
        let rec = records(&r);
        assert!(
            !rec.is_empty() && rec.iter().all(|c| c["allowed"] == json!(false)),
            "{url}: {}",
            r.text
        );
    }

    // A tool that ignores the proxy settings finds no route. A container's network namespace
    // (runc) or the runsc sandbox's host one has nothing but a loopback, seen from the host.
    // Direct targets must stay on this machine even if that block failed: a container's packets
    // would leave through the host's own routes, so containers only try the daemon's control
    // address (routed into the daemon's namespace) and their own loopback; the local sandbox,
    // whose namespace could only lead into the test namespaces, also tries the test hosts.
    if backend.is_container() {
        // The idle pool container, refilled once the daemon has no run in flight: the next
        // run's.
        setup.wait_for_cleanup("the refusals");
        let pooled = wait_for(
            "the warm pool's idle container",
            CLEANUP,
            || common::docker::pool_containers(&setup.instance()),
            |c| !c.is_empty(),
        );
        for c in &pooled {
            assert_only_loopback(c);
        }
    }
    let mut direct = vec![
        format!("http://{}:{port}/health", net.daemon_ip),
        "http://127.0.0.1/direct".to_string(),
    ];
    if !backend.is_container() {
        direct.push(format!("http://{ALLOWED}/direct"));
        direct.push(format!("http://{}/direct", net.private_ip));
    }
    for url in &direct {
        let r = curl(d, &["-sS", "--noproxy", "*", "--max-time", "5", url]).await;
        assert_eq!(r.json["success"], json!(false), "{url}: {}", r.text);
        assert!(records(&r).is_empty(), "{url}: {}", r.text);
    }

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
    assert_eq!(
        std::fs::read_to_string(net.logdir.path().join("hits-loopback.log")).unwrap_or_default(),
        "",
        "the daemon's loopback listener must never be reached"
    );
    setup.wait_for_cleanup("the refusals");

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
        let r = curl(d, args).await;
        assert_eq!(r.status, 403, "{args:?}: {}", r.text);
    }

    // A run that times out with a connection open through the proxy: recorded, and its
    // container and socket directory go.
    let _ = d.log.try_iter().count();
    let r = d
        .exec(curl_body(d, &["-sS", "http://allowed.test/slow"], 3))
        .await;
    assert_eq!(r.status, 408, "{}", r.text);
    let rec = records(&r);
    assert_eq!(rec.len(), 1, "{}", r.text);
    assert_eq!(rec[0]["allowed"], json!(true));
    assert_eq!(
        rec[0]["reason"],
        json!("closed when the execution ended"),
        "{}",
        r.text
    );
    setup.wait_for_run_cleanup("a timeout");

    // A client that goes away mid-run: the run goes on in its own task to its timeout, then
    // leaves nothing either.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let sent = impatient
        .post(format!("{}/execute", d.base))
        .header("authorization", format!("Bearer {}", d.service_token()))
        .header("content-type", "application/json")
        .body(curl_body(d, &["-sS", "http://allowed.test/slow"], 3).to_string())
        .send()
        .await;
    assert!(sent.is_err(), "the client gave up before the run ended");
    setup.wait_for_run_cleanup("a client disconnect");
    let t = Instant::now();
    while net.hits(ALLOWED).matches(" /slow ").count() < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the abandoned run reached the host through the proxy: {}",
            net.hits(ALLOWED)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The daemon still answers, and once stopped leaves no container or socket directory.
    assert_eq!(d.get("/health").await.status, 200);
    setup.finish();
}

/// A run that receives a slow response through the egress proxy is streamed line by line as the
/// lines arrive, then its result.
async fn a_stream_shows_egress_lines_as_they_arrive(backend: Backend) {
    let net = Net::new();
    let setup = net.daemon(NETWORK, backend);
    let d = &setup.d;
    let mut s = common::open_stream(
        d,
        curl_body(d, &["-sS", "-N", "http://allowed.test/lines/5"], 30),
    )
    .await;
    let events = s.rest().await;
    let result = &events.last().expect("events").data;
    assert_eq!(events.last().unwrap().event, "result", "{events:?}");
    assert_eq!(result["success"], true, "{result}");
    assert_eq!(result["backend"], backend.name());
    let out = common::stream_bytes(&events, "stdout", 0);
    let text = String::from_utf8(out).unwrap();
    assert_eq!(result["stdout"], text.as_str());
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{text}");
    // The first line reached the client before the host sent the last one.
    let first = events.iter().find(|e| e.event == "stdout").unwrap();
    let first_seen = first.read_at;
    let last_sent: f64 = lines[4].split(' ').nth(2).unwrap().parse().unwrap();
    assert!(
        first_seen < last_sent,
        "{}: the first line arrived only after the last was sent",
        backend.name()
    );
    setup.finish();
}

async fn bandwidth_is_limited(backend: Backend) {
    let net = Net::new();
    // 8 Mbps = 1 000 000 B/s; the output cap is raised so the whole body reaches curl's stdout
    // (`-o` is refused) and curl can report its own transfer rate after it.
    let setup = net.daemon_with_limits(
        &NETWORK.replace("bandwidth_mbps = 10", "bandwidth_mbps = 8"),
        "output_bytes = 4194304",
        backend,
    );
    let d = &setup.d;
    let bytes = 3_000_000u64;
    let url = format!("http://allowed.test/bytes/{bytes}");
    let r = curl(d, &["-sS", "-o", "/dev/null", &url]).await;
    assert_eq!(r.status, 403, "-o is refused by the argument policy");
    let r = curl(
        d,
        &["-sS", "-w", "\n%{size_download} %{speed_download}", &url],
    )
    .await;
    let head = &r.text[..r.text.len().min(400)];
    assert_eq!(r.status, 200, "{head}");
    assert_eq!(r.json["success"], json!(true), "{head}");
    assert_eq!(r.json["backend"], json!(backend.name()), "{head}");
    let rec = records(&r);
    assert_eq!(rec.len(), 1, "{head}");
    assert_eq!(rec[0]["allowed"], json!(true), "{head}");
    assert!(rec[0]["bytes_down"].as_u64().unwrap() >= bytes, "{rec:?}");
    // curl's own figures, printed after the body: the rate the command saw.
    let stdout = r.json["stdout"].as_str().unwrap();
    let last = stdout.rsplit('\n').next().unwrap();
    let mut it = last.split(' ');
    let size: u64 = it.next().unwrap().parse().unwrap();
    let rate: f64 = it.next().unwrap().parse().unwrap();
    assert_eq!(size, bytes, "{last}");
    eprintln!(
        "egress rate on {}: {size} bytes at {rate:.0} B/s (limit 1000000 B/s)",
        backend.name()
    );
    assert!(
        (800_000.0..=1_200_000.0).contains(&rate),
        "rate {rate:.0} B/s is not within 20% of the 8 Mbps limit"
    );
    setup.finish();
}

/// The daemon's config pointing the shipped `python-packages` profile at the test's index (what an
/// operator writes for their index or mirror).
const INDEX_OVERRIDE: &str = "[sandbox.profile_overrides.python-packages.network]\n\
    allow_hosts = [\"index.test\"]\n\
    [sandbox.profile_overrides.python-packages.env.set]\n\
    PIP_INDEX_URL = \"http://index.test/simple/\"\n\
    PIP_TRUSTED_HOST = \"index.test\"\n";

/// `pip install ARGS` in a session exec: pip's output, and its exit code as the exec's.
fn pip_install(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "import subprocess, sys\n\
         r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--retries', '0', \
         '--timeout', '15', {}], capture_output=True, text=True)\n\
         print(r.stdout[-3000:]); print(r.stderr[-3000:], file=sys.stderr)\n\
         sys.exit(r.returncode)",
        args.join(", ")
    )
}

/// A session on the shipped `python-packages` profile, pointed at a package index in the test's
/// own namespace by the daemon's config: `pip install` there works through the proxy and the
/// next exec imports the package; an index the profile does not name is refused, and the refusal
/// is in that exec's `network` array and audit line. On docker and gVisor the session's one
/// container carries every exec's proxy through its socket directory, which no listener holds
/// between execs and which goes with the session.
async fn a_session_installs_a_package_from_its_index(backend: Backend) {
    let net = Net::new();
    let index = net.logdir.path().join("index");
    let built = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/egress/package.py"))
        .arg(&index)
        .args(["earmprobe", "1.0", "from-the-index"])
        .output()
        .expect("python3 package.py");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let setup = net.daemon_with_config(NETWORK, "", INDEX_OVERRIDE, backend);
    let d = &setup.d;
    let c = common::sessions::koder(d, Some("team-a"));
    let cap = d.mint(executor_arm::auth::MintRequest {
        kind: Some(executor_arm::config::TokenKind::Capability),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["PythonExecute".into(), "NetworkAccess".into()],
        profiles: Some(vec!["python-packages".into()]),
        ..Default::default()
    });
    let r = c
        .create(
            json!({"language": "python", "profile": "python-packages", "capability_token": cap}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.json["backend"], json!(backend.name()), "{}", r.text);
    assert_eq!(r.json["profile"], json!("python-packages"), "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let exec = |code: String| {
        let c = &c;
        let id = &id;
        async move {
            let r = c
                .exec(id, json!({"code": code, "timeout_ms": 120000}))
                .await;
            assert_eq!(r.status, 200, "{}", r.text);
            r
        }
    };

    // The container's socket directory, seen from the host: bind-mounted from the egress dir.
    let socket_dir = backend.is_container().then(|| {
        // The session's container is named after it (with a suffix of its own per launch).
        let ps = Command::new("docker")
            .args(["ps", "-q", "--filter", &format!("name=executor-arm-{id}")])
            .output()
            .expect("docker ps");
        let container = String::from_utf8_lossy(&ps.stdout).trim().to_string();
        assert!(!container.is_empty(), "no container of session {id}");
        let out = Command::new("docker")
            .args([
                "inspect",
                "--format",
                "{{range .Mounts}}{{.Source}}\n{{end}}",
                &container,
            ])
            .output()
            .expect("docker inspect");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let dir = text
            .lines()
            .find(|l| Path::new(l).starts_with(setup.egress_dir.path()))
            .unwrap_or_else(|| panic!("the session's container mounts no socket directory: {text}"))
            .to_string();
        PathBuf::from(dir)
    });

    // The sandbox's own loopback is reached directly; the proxy is named for everything else.
    let r = exec(
        "import os; print(os.environ['HTTP_PROXY'], os.environ['NO_PROXY'], os.environ['PIP_INDEX_URL'])"
            .into(),
    )
    .await;
    assert_eq!(
        r.json["stdout"],
        json!("http://127.0.0.1:3128 localhost,127.0.0.1,::1 http://index.test/simple/\n"),
        "{}",
        r.text
    );

    // pip finds the index the daemon's config names, through the proxy.
    let r = exec(pip_install(&["earmprobe"])).await;
    assert_eq!(r.json["exit_code"], json!(0), "{}", r.text);
    let rec = records(&r);
    assert!(!rec.is_empty(), "{}", r.text);
    for c in &rec {
        assert_eq!(c["allowed"], json!(true), "{}", r.text);
        assert_eq!(c["host"], json!("index.test"), "{}", r.text);
    }
    let exec_id = r.json["exec_id"].as_str().expect("exec_id");
    let line = d.execution_line(exec_id);
    assert_eq!(
        line["network"].as_array().map(Vec::len),
        Some(rec.len()),
        "the audit line carries the exec's connections: {line}"
    );
    let hits = net.hits(ALLOWED);
    assert!(hits.contains("GET /simple/earmprobe/ index.test"), "{hits}");
    assert!(
        hits.contains("GET /files/earmprobe-1.0-py3-none-any.whl index.test"),
        "{hits}"
    );
    // Between execs no proxy listens for the session.
    wait_for(
        "no proxy socket between the session's execs",
        CLEANUP,
        || setup.proxy_sockets(),
        Vec::is_empty,
    );

    // A background process has egress too, through a proxy of its own: on a container, its own
    // relay port beside the foreground execs' (which one runs meanwhile), and its connections
    // are its own record, as the foreground exec's are its.
    let fetch = "import os, urllib.request\nprint(os.environ['HTTP_PROXY'], flush=True)\nprint(urllib.request.urlopen('http://index.test/simple/earmprobe/').status, flush=True)\nimport time; time.sleep(1)";
    let r = c
        .exec(&id, json!({"code": fetch, "background": true}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let pid = r.json["process_id"]
        .as_str()
        .expect("process_id")
        .to_string();
    let fg = exec(fetch.to_string()).await;
    assert_eq!(
        fg.json["stdout"],
        json!("http://127.0.0.1:3128\n200\n"),
        "{}",
        fg.text
    );
    let fg_rec = records(&fg);
    assert_eq!(fg_rec.len(), 1, "{}", fg.text);
    let line = wait_for(
        "the background process's end in the audit log",
        CLEANUP,
        || {
            d.audit_lines()
                .into_iter()
                .find(|l| l["exec_id"] == pid.as_str() && l["event"] == "execution")
        },
        Option::is_some,
    )
    .unwrap_or_default();
    let bg_rec = line["network"].as_array().cloned().unwrap_or_default();
    assert_eq!(bg_rec.len(), 1, "{line}");
    assert_eq!(bg_rec[0]["host"], json!("index.test"), "{line}");
    assert_eq!(bg_rec[0]["allowed"], json!(true), "{line}");
    let stream = c
        .call(
            "GET",
            &format!("/v1/sandbox/sessions/{id}/processes/{pid}/stream"),
            None,
        )
        .await;
    let port = if backend.is_container() { 3129 } else { 3128 };
    assert!(
        stream.text.contains(&format!("http://127.0.0.1:{port}")) && stream.text.contains("200"),
        "{}",
        stream.text
    );
    if let Some(dir) = &socket_dir {
        wait_for(
            "the background process's proxy socket removed",
            CLEANUP,
            || {
                std::fs::read_dir(dir)
                    .map(|it| {
                        it.filter_map(Result::ok)
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| n.starts_with("proxy-"))
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default()
            },
            Vec::is_empty,
        );
    }
    wait_for(
        "no proxy socket once the background process ended",
        CLEANUP,
        || setup.proxy_sockets(),
        Vec::is_empty,
    );

    // The next exec imports what the previous one installed (the workspace is HOME).
    let r = exec("import earmprobe; print(earmprobe.VALUE)".into()).await;
    assert_eq!(r.json["stdout"], json!("from-the-index\n"), "{}", r.text);

    // An index the profile does not name: refused by the proxy, recorded, never reached.
    let r = exec(pip_install(&[
        "--index-url",
        "http://private.test/simple/",
        "--trusted-host",
        "private.test",
        "otherprobe",
    ]))
    .await;
    assert_ne!(r.json["exit_code"], json!(0), "{}", r.text);
    let rec = records(&r);
    let refused = rec.iter().find(|c| c["host"] == json!("private.test"));
    assert_eq!(
        refused.map(|c| &c["allowed"]),
        Some(&json!(false)),
        "{}",
        r.text
    );
    let exec_id = r.json["exec_id"].as_str().expect("exec_id");
    let line = d.execution_line(exec_id);
    assert!(
        line["network"].as_array().is_some_and(|a| a
            .iter()
            .any(|c| c["host"] == "private.test" && c["allowed"] == false)),
        "the audit line carries the refusal: {line}"
    );
    assert_eq!(
        net.hits(&net.private_ip),
        "",
        "the private host must never be reached"
    );

    // The session ends: its container and its socket directory go, no proxy listener is left.
    let r = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    if let Some(dir) = socket_dir {
        wait_for(
            "the session's container removed, its socket directory gone, no proxy socket",
            CLEANUP,
            || {
                let name = format!("name=executor-arm-{id}");
                let out = Command::new("docker")
                    .args(["ps", "-aq", "--filter", &name])
                    .output()
                    .expect("docker ps");
                (
                    String::from_utf8_lossy(&out.stdout).trim().to_string(),
                    dir.exists(),
                    setup.proxy_sockets(),
                )
            },
            |(container, exists, socks)| container.is_empty() && !exists && socks.is_empty(),
        );
    }
    setup.finish();
}

// ---------------------------------------------------------------------------------------------
// npm: local only. node and npm are the host's there; the shipped sandbox image has neither, so
// container sessions of the node language need an image of the operator's own.
mod npm_local {
    #[tokio::test(flavor = "multi_thread")]
    async fn a_node_session_installs_a_package_from_its_registry() {
        super::a_node_session_installs_a_package_from_its_registry(super::Backend::Local).await;
    }
}

const REGISTRY_OVERRIDE: &str = "[sandbox.profile_overrides.node-packages.network]\n\
    allow_hosts = [\"index.test\"]\n\
    [sandbox.profile_overrides.node-packages.env.set]\n\
    NPM_CONFIG_REGISTRY = \"http://index.test/npm/\"\n";

/// `npm install ARGS` in a node session exec (no retries): npm's output, and its exit code as
/// the exec's.
fn npm_install(args: &[&str]) -> String {
    format!(
        "const r = require('child_process').spawnSync('npm', ['install', '--fetch-retries=0', \
         '--no-package-lock', ...{}], {{encoding: 'utf8'}});\n\
         console.log(r.stdout.slice(-3000)); console.error(String(r.stderr).slice(-3000), r.error || '');\n\
         process.exit(r.status === null ? 99 : r.status);",
        serde_json::to_string(args).unwrap()
    )
}

/// A node session on the shipped `node-packages` profile, pointed at a registry in the test's own
/// namespace by the daemon's config: `npm install` there works through the proxy (npm reads the
/// proxy variables unchanged) and the next exec requires the package; a registry the profile does
/// not name is refused, and the refusal is in that exec's `network` array.
async fn a_node_session_installs_a_package_from_its_registry(backend: Backend) {
    let net = Net::new();
    let index = net.logdir.path().join("index");
    let built = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/egress/package.py"))
        .arg(&index)
        .args([
            "earmprobe",
            "1.0.0",
            "from-the-registry",
            "http://index.test/npm/",
        ])
        .output()
        .expect("python3 package.py");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let setup = net.daemon_with_config(NETWORK, "", REGISTRY_OVERRIDE, backend);
    let d = &setup.d;
    let c = common::sessions::koder(d, Some("team-a"));
    let cap = d.mint(executor_arm::auth::MintRequest {
        kind: Some(executor_arm::config::TokenKind::Capability),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["ShellExecute".into(), "NetworkAccess".into()],
        profiles: Some(vec!["node-packages".into()]),
        ..Default::default()
    });
    let r = c
        .create(json!({"language": "node", "profile": "node-packages", "capability_token": cap}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let exec = |code: String| {
        let c = &c;
        let id = &id;
        async move {
            let r = c
                .exec(id, json!({"code": code, "timeout_ms": 120000}))
                .await;
            assert_eq!(r.status, 200, "{}", r.text);
            r
        }
    };

    let r = exec(npm_install(&["earmprobe"])).await;
    assert_eq!(r.json["exit_code"], json!(0), "{}", r.text);
    let rec = records(&r);
    assert!(!rec.is_empty(), "{}", r.text);
    for c in &rec {
        assert_eq!(c["allowed"], json!(true), "{}", r.text);
        assert_eq!(c["host"], json!("index.test"), "{}", r.text);
    }
    let hits = net.hits(ALLOWED);
    assert!(hits.contains("GET /npm/earmprobe index.test"), "{hits}");
    assert!(
        hits.contains("GET /npm/earmprobe/-/earmprobe-1.0.0.tgz index.test"),
        "{hits}"
    );

    // The next exec requires what the previous one installed in the workspace.
    let r = exec(
        "const r = require('module').createRequire(process.cwd() + '/');\n\
         console.log(r('earmprobe').VALUE);"
            .into(),
    )
    .await;
    assert_eq!(r.json["stdout"], json!("from-the-registry\n"), "{}", r.text);

    // A registry the profile does not name: refused by the proxy, recorded, never reached.
    let r = exec(npm_install(&[
        "--registry",
        "http://private.test/npm/",
        "otherprobe",
    ]))
    .await;
    assert_ne!(r.json["exit_code"], json!(0), "{}", r.text);
    let refused = records(&r)
        .into_iter()
        .find(|c| c["host"] == json!("private.test"));
    assert_eq!(
        refused.as_ref().map(|c| &c["allowed"]),
        Some(&json!(false)),
        "{}",
        r.text
    );
    assert_eq!(
        net.hits(&net.private_ip),
        "",
        "the private host must never be reached"
    );
    let r = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    setup.finish();
}

// Raw TCP by rule (`network.tcp`): local and docker (runc); gVisor refuses such profiles.

mod raw_tcp_local {
    #[tokio::test(flavor = "multi_thread")]
    async fn raw_tcp_reaches_only_its_rules() {
        super::raw_tcp_reaches_only_its_rules(super::Backend::Local).await;
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn raw_tcp_covering_rules_keep_the_deny_list() {
        super::raw_tcp_covering_rules_keep_the_deny_list(super::Backend::Local).await;
    }
}

mod raw_tcp_docker {
    #[tokio::test(flavor = "multi_thread")]
    async fn raw_tcp_reaches_only_its_rules() {
        let backend = super::Backend::Docker;
        backend.require("raw_tcp_docker::raw_tcp_reaches_only_its_rules");
        super::raw_tcp_reaches_only_its_rules(backend).await;
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn raw_tcp_covering_rules_keep_the_deny_list() {
        let backend = super::Backend::Docker;
        backend.require("raw_tcp_docker::raw_tcp_covering_rules_keep_the_deny_list");
        super::raw_tcp_covering_rules_keep_the_deny_list(backend).await;
    }
}

mod raw_tcp_gvisor {
    #[tokio::test(flavor = "multi_thread")]
    async fn raw_tcp_profiles_are_refused_with_400() {
        let backend = super::Backend::Gvisor;
        backend.require("raw_tcp_gvisor::raw_tcp_profiles_are_refused_with_400");
        super::raw_tcp_profiles_are_refused_with_400(backend).await;
    }
}

/// Connects to each `ip:port` argument and prints one line per target: `<target> ok <what came
/// back>`, `<target> closed` (accepted, then closed without a byte) or `<target> err <errno>`.
/// Port 80 gets an HTTP request; the echo hosts send a banner line, then echo.
const TCP_CLIENT: &str = r#"
import errno, socket, sys
for t in sys.argv[1:]:
    ip, port = t.rsplit(":", 1)
    ip = ip.strip("[]")
    try:
        s = socket.create_connection((ip, int(port)), timeout=5)
        try:
            f = s.makefile("rb")
            if port == "80":
                s.sendall(b"GET /raw HTTP/1.0\r\nHost: raw\r\n\r\n")
                body = f.read().split(b"\r\n\r\n", 1)
                print(t, "ok" if len(body) == 2 else "closed", body[-1].decode().strip())
                continue
            banner = f.readline()
            if not banner:
                print(t, "closed")
                continue
            s.sendall(b"ping\n")
            print(t, "ok", banner.decode().strip(), f.readline().decode().strip())
        finally:
            s.close()
    except OSError as e:
        print(t, "err", errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__)
"#;

/// Runs [`TCP_CLIENT`] against `targets` in the sandbox; returns the response and its lines by
/// target.
async fn tcp_client(
    d: &Daemon,
    targets: &[String],
) -> (common::Resp, std::collections::BTreeMap<String, String>) {
    let mut args = vec!["-c".to_string(), TCP_CLIENT.to_string()];
    args.extend(targets.iter().cloned());
    let caps = d.cap(&["PythonExecute"]);
    let r = d
        .exec(json!({"action_type": "python", "command": "python3", "args": args, "timeout_seconds": 60, "capability_token": caps}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let out = r.json["stdout"].as_str().unwrap_or_default().to_string();
    let lines = out
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(t, rest)| (t.to_string(), rest.trim().to_string()))
        .collect();
    (r, lines)
}

fn tcp_network(rules: &[String]) -> String {
    let quoted: Vec<String> = rules.iter().map(|r| format!("\"{r}\"")).collect();
    format!("mode = \"egress\"\ntcp = [{}]", quoted.join(", "))
}

/// A rule of one address and port reaches exactly that: its bytes go both ways and are
/// recorded; another port of the address, an address outside every rule and a port without a
/// rule fail; a rule naming a denied address (the test's own metadata host) reaches it. nmap's
/// connect scan sees the allowed port open.
async fn raw_tcp_reaches_only_its_rules(backend: Backend) {
    let net = Net::new();
    // The IPv6 rule's range is routed nowhere beyond the daemon: its connections are accepted
    // in the sandbox and fail at the daemon's connect, which shows the IPv6 path end to end.
    let rules = [
        format!("{ALLOWED}/32:7001"),
        format!("{METADATA}/32:7002"),
        "[2001:db8::/32]:7001".to_string(),
    ];
    let setup = net.daemon_with(
        &["python", "http-egress"],
        &tcp_network(&rules),
        "",
        backend,
    );
    let d = &setup.d;
    let allowed = format!("{ALLOWED}:7001");
    let other_port = format!("{ALLOWED}:7002");
    let outside = format!("{}:7001", net.private_ip);
    let no_rule_port = format!("{ALLOWED}:7003");
    let named = format!("{METADATA}:7002");
    let v6 = "[2001:db8::5]:7001".to_string();
    let targets = [
        allowed.clone(),
        other_port.clone(),
        outside.clone(),
        no_rule_port.clone(),
        named.clone(),
        v6.clone(),
    ];
    let (r, got) = tcp_client(d, &targets).await;
    assert_eq!(r.json["backend"], json!(backend.name()), "{}", r.text);
    assert_eq!(
        got.get(&allowed).map(String::as_str),
        Some(format!("ok echo {allowed} ping").as_str()),
        "{}",
        r.text
    );
    assert_eq!(
        got.get(&named).map(String::as_str),
        Some(format!("ok echo {named} ping").as_str()),
        "{}",
        r.text
    );
    // Routed to the sandbox's listener of port 7002 (the other rule's), refused by the daemon.
    let refused = got.get(&other_port).cloned().unwrap_or_default();
    assert!(
        refused == "closed" || refused == "err ECONNRESET",
        "{other_port}: {}",
        r.text
    );
    assert_eq!(
        got.get(&outside).map(String::as_str),
        Some("err ENETUNREACH"),
        "{}",
        r.text
    );
    // A port of no rule: Landlock refuses the connect on the local backend; in a container
    // nothing listens there.
    let no_listener = if backend.is_container() {
        "err ECONNREFUSED"
    } else {
        "err EACCES"
    };
    assert_eq!(
        got.get(&no_rule_port).map(String::as_str),
        Some(no_listener),
        "{}",
        r.text
    );

    let v6_line = got.get(&v6).cloned().unwrap_or_default();
    assert!(
        v6_line == "closed" || v6_line == "err ECONNRESET",
        "{v6}: {}",
        r.text
    );

    // One record per connection that reached the daemon, as the proxy's are.
    let rec = records(&r);
    assert_eq!(rec.len(), 4, "{}", r.text);
    assert!(
        rec.iter().all(|c| c["method"] == json!("TCP")),
        "{}",
        r.text
    );
    let by = |t: &str| {
        rec.iter()
            .find(|c| format!("{}:{}", c["host"].as_str().unwrap_or(""), c["port"]) == t)
            .unwrap_or_else(|| panic!("no record of {t}: {}", r.text))
            .clone()
    };
    let ok = by(&allowed);
    assert_eq!(ok["allowed"], json!(true), "{ok}");
    assert_eq!(ok["addr"], json!(allowed), "{ok}");
    assert_eq!(ok["bytes_up"], json!(5), "{ok}");
    assert_eq!(
        ok["bytes_down"],
        json!(format!("echo {allowed}\nping\n").len()),
        "{ok}"
    );
    assert_eq!(by(&named)["allowed"], json!(true));
    let failed = rec
        .iter()
        .find(|c| c["host"] == json!("2001:db8::5"))
        .unwrap_or_else(|| panic!("no record of {v6}: {}", r.text));
    assert_eq!(failed["allowed"], json!(true), "{failed}");
    assert!(
        failed["reason"]
            .as_str()
            .is_some_and(|w| w.starts_with("connect to [2001:db8::5]:7001 failed")),
        "{failed}"
    );
    let no = by(&other_port);
    assert_eq!(no["allowed"], json!(false), "{no}");
    assert!(
        no["reason"]
            .as_str()
            .is_some_and(|w| w.contains("not allowed by any tcp rule")),
        "{no}"
    );
    let line = d.execution_line(r.json["exec_id"].as_str().expect("exec_id"));
    assert_eq!(
        line["network"], r.json["network"],
        "the audit line carries them"
    );

    // Host side: the private host saw nothing; the allowed host only its rule's port.
    assert_eq!(
        std::fs::read_to_string(
            net.logdir
                .path()
                .join(format!("tcp-{}.log", net.private_ip))
        )
        .unwrap_or_default(),
        ""
    );
    assert_eq!(
        std::fs::read_to_string(net.logdir.path().join(format!("tcp-{ALLOWED}.log")))
            .unwrap_or_default(),
        "7001\n"
    );

    // The routing privilege is gone before the command runs: in a container neither the
    // command nor pid 1 (the supervisor, which made the routes) holds CAP_NET_ADMIN or
    // CAP_SETPCAP in any set. (The local backend's routes are the daemon's own doing.)
    if backend.is_container() {
        check_no_routing_caps(d).await;
    }

    // A command that speaks to the daemon's raw TCP socket itself and names another
    // destination reaches only what the rules allow.
    if backend.is_container() {
        let liar = format!(
            "import socket\nfor dest in ('{}', '{allowed}'):\n    u = socket.socket(socket.AF_UNIX)\n    u.connect('/run/executor-arm/egress/tcp.sock')\n    u.sendall(b'EAT1 ' + dest.encode() + b'\\nping\\n')\n    try:\n        print(dest, u.makefile('rb').readline().decode().strip() or 'closed')\n    except OSError:\n        print(dest, 'closed')\n    u.close()",
            outside
        );
        let caps = d.cap(&["PythonExecute"]);
        let r = d
            .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", liar], "capability_token": caps}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let out = r.json["stdout"].as_str().unwrap_or_default();
        assert!(out.contains(&format!("{outside} closed")), "{}", r.text);
        assert!(
            out.contains(&format!("{allowed} echo {allowed}")),
            "{}",
            r.text
        );
        let rec = records(&r);
        assert!(
            rec.iter()
                .any(|c| c["host"] == json!(net.private_ip) && c["allowed"] == json!(false)),
            "{}",
            r.text
        );
        assert_eq!(
            std::fs::read_to_string(
                net.logdir
                    .path()
                    .join(format!("tcp-{}.log", net.private_ip))
            )
            .unwrap_or_default(),
            "",
            "the private host must never be reached"
        );
    }

    // nmap's connect scan (its default profile, http-egress, has the same rules here).
    let caps = d.cap(&["ShellExecute", "NetworkAccess"]);
    let r = d
        .exec(json!({"action_type": "shell", "command": "nmap", "args": ["-sT", "-Pn", "-n", "-p", "7001", ALLOWED], "timeout_seconds": 60, "capability_token": caps}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let out = r.json["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("7001/tcp open"), "{}", r.text);
    // Two profiles ran, so two warm pools: the stop checks that nothing is left.
    setup.finish();
}

/// Prints `CapEff CapPrm CapBnd` of the command (`self`) and of the container's pid 1.
const CAPS_SCRIPT: &str = "import re\nfor p in ('self', '1'):\n    s = open(f'/proc/{p}/status').read()\n    print(p, *[re.search(k + r':\\s*(\\w+)', s).group(1) for k in ('CapEff', 'CapPrm', 'CapBnd')])";

/// Neither the command nor the container's pid 1 holds CAP_NET_ADMIN or CAP_SETPCAP.
async fn check_no_routing_caps(d: &Daemon) {
    let caps = d.cap(&["PythonExecute"]);
    let r = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", CAPS_SCRIPT], "capability_token": caps}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_no_routing_caps(&r);
}

/// `r` ran [`CAPS_SCRIPT`]: no set of either process holds CAP_NET_ADMIN or CAP_SETPCAP.
fn assert_no_routing_caps(r: &common::Resp) {
    let out = r.json["stdout"].as_str().unwrap_or_default();
    assert_eq!(out.lines().count(), 2, "{}", r.text);
    let sets: Vec<&str> = out.split_whitespace().filter(|w| w.len() == 16).collect();
    assert_eq!(sets.len(), 6, "{}", r.text);
    for v in sets {
        let bits = u64::from_str_radix(v, 16).unwrap();
        assert_eq!(bits & ((1 << 12) | (1 << 8)), 0, "{}", r.text);
    }
}

/// A rule covering denied ranges without naming them (`0.0.0.0/0:80`) reaches public addresses
/// only: not the (test's own) metadata host, not the private host, not the daemon's own
/// addresses.
async fn raw_tcp_covering_rules_keep_the_deny_list(backend: Backend) {
    let net = Net::new();
    let setup = net.daemon_with(
        &["python"],
        &tcp_network(&["0.0.0.0/0:80".to_string()]),
        "",
        backend,
    );
    let d = &setup.d;
    let public = format!("{ALLOWED}:80");
    let denied = [
        format!("{METADATA}:80"),
        format!("{}:80", net.private_ip),
        format!("{}:80", net.daemon_ip),
    ];
    let mut targets = vec![public.clone()];
    targets.extend(denied.iter().cloned());
    let (r, got) = tcp_client(d, &targets).await;
    assert_eq!(
        got.get(&public).map(String::as_str),
        Some(format!("ok hello from {ALLOWED}").as_str()),
        "{}",
        r.text
    );
    let rec = records(&r);
    assert_eq!(rec.len(), 4, "{}", r.text);
    for t in &denied {
        let line = got.get(t).cloned().unwrap_or_default();
        assert!(
            line == "closed" || line == "err ECONNRESET",
            "{t}: {}",
            r.text
        );
        let c = rec
            .iter()
            .find(|c| format!("{}:{}", c["host"].as_str().unwrap_or(""), c["port"]) == *t)
            .unwrap_or_else(|| panic!("no record of {t}: {}", r.text));
        assert_eq!(c["allowed"], json!(false), "{c}");
        assert!(
            c["reason"]
                .as_str()
                .is_some_and(|w| w.contains("no tcp rule names it explicitly")),
            "{c}"
        );
    }
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
    assert!(
        net.hits(ALLOWED).contains("GET /raw "),
        "{}",
        net.hits(ALLOWED)
    );
    setup.wait_for_run_cleanup("the raw TCP run");

    raw_tcp_in_a_session(&setup, &net, backend).await;
    setup.finish();
}

/// A session has its profile's rules in every exec, on the local backend and in a runc session
/// container (whose supervisor makes the routes on the first exec and keeps them): an allowed
/// target is reached and recorded by each exec, a denied one refused and recorded; the routing
/// privilege is gone once the first exec ran; after a pause the resumed sandbox has them again.
async fn raw_tcp_in_a_session(setup: &Setup, net: &Net, backend: Backend) {
    let d = &setup.d;
    let c = common::sessions::koder(d, Some("team-a"));
    let r = c
        .create(json!({"language": "python", "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    let fetch = |path: &str, ip: &str| {
        format!(
            "import socket\ns = socket.create_connection(('{ip}', 80), timeout=5)\ns.sendall(b'GET /{path} HTTP/1.0\\r\\n\\r\\n')\nprint(s.makefile('rb').read().split(b'\\r\\n\\r\\n', 1)[-1].decode().strip() or 'closed')"
        )
    };
    for (round, path) in ["session-1", "session-2", "session-after-resume"]
        .iter()
        .enumerate()
    {
        if round == 2 {
            let r = c
                .call("POST", &format!("/v1/sandbox/sessions/{id}/pause"), None)
                .await;
            assert_eq!(r.status, 200, "{}", r.text);
            assert_eq!(r.json["state"], json!("paused"), "{}", r.text);
        }
        let r = c
            .exec(
                &id,
                json!({"code": fetch(path, ALLOWED), "timeout_ms": 30000}),
            )
            .await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        assert_eq!(
            r.json["stdout"].as_str().map(str::trim),
            Some(format!("hello from {ALLOWED}").as_str()),
            "{path}: {}",
            r.text
        );
        let rec = records(&r);
        assert!(
            rec.iter()
                .any(|c| c["method"] == json!("TCP") && c["allowed"] == json!(true)),
            "{path}: {}",
            r.text
        );
        assert!(
            net.hits(ALLOWED).contains(&format!("GET /{path} ")),
            "{}",
            net.hits(ALLOWED)
        );
    }
    // A denied address under the covering rule: refused by the daemon and recorded.
    let r = c
        .exec(
            &id,
            json!({"code": fetch("denied", METADATA), "timeout_ms": 30000}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let rec = records(&r);
    assert!(
        rec.iter().any(|c| c["host"] == json!(METADATA)
            && c["allowed"] == json!(false)
            && c["reason"]
                .as_str()
                .is_some_and(|w| w.contains("no tcp rule names it explicitly"))),
        "{}",
        r.text
    );
    assert_eq!(
        net.hits(METADATA),
        "",
        "the metadata host must never be reached"
    );
    // In a session container neither the command nor pid 1 (the supervisor, which made the
    // routes on the first exec) holds CAP_NET_ADMIN or CAP_SETPCAP any more.
    if backend.is_container() {
        let r = c
            .exec(&id, json!({"code": CAPS_SCRIPT, "timeout_ms": 30000}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_no_routing_caps(&r);
    }
    let r = c
        .call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
}

/// gVisor's netstack is the sandbox's own: a profile with tcp rules is a 400 before anything
/// runs, with the documented message, for a run and for a session (whose container would keep
/// the profile's rules).
async fn raw_tcp_profiles_are_refused_with_400(backend: Backend) {
    let net = Net::new();
    let setup = net.daemon_with(
        &["python"],
        &tcp_network(&[format!("{ALLOWED}/32:7001")]),
        "",
        backend,
    );
    let d = &setup.d;
    let caps = d.cap(&["PythonExecute"]);
    let r = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "print(1)"], "capability_token": caps}))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.text
            .contains("raw TCP rules (network.tcp), which the gvisor backend does not offer"),
        "{}",
        r.text
    );
    let c = common::sessions::koder(d, Some("team-a"));
    let r = c
        .create(json!({"language": "python", "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.text
            .contains("raw TCP rules (network.tcp), which the gvisor backend does not offer"),
        "{}",
        r.text
    );
    setup.finish();
}
