//! Egress for the docker (runc) and gvisor (runsc) backends: the daemon's filtering proxy, reached
//! through a unix socket that only one container can see.
//!
//! Containers keep `--network none`: their network namespace (runc) or gVisor's own netstack
//! (runsc) has a loopback and nothing else, so a tool that ignores the proxy settings finds no
//! route. Each egress container gets its own host directory, bind-mounted read-only at
//! [`CONTAINER_DIR`]; for every execution the daemon binds the proxy's listener as
//! [`SOCKET_NAME`] in it before the supervisor receives the command, and the supervisor relays
//! `127.0.0.1:<egress.proxy_port>` inside the container to that socket. Every byte that leaves the
//! container therefore passes the same [`crate::egress::ProxySession`] as on the local backend:
//! name and port allowlist, address deny list, one resolution per connection, bandwidth, byte cap
//! and one record per connection, all in the daemon.
//!
//! Why a unix socket rather than the local backend's listener inside the sandbox's network
//! namespace: gVisor's netstack is not the host kernel's, so a socket bound in the container's
//! host namespace is invisible to the guest; a bind-mounted unix socket is reachable from both
//! runtimes (runsc needs `--host-uds=open`, see `docker/daemon.json`). One mechanism serves both,
//! and it needs neither `setns` nor the engine's pid namespace, so it also works when the daemon
//! is an unprivileged client of a dockerd sidecar. The supervisor (root without
//! CAP_DAC_OVERRIDE) connects through the directory's and the socket's permission bits, which
//! also let the command reach the socket itself: that grants nothing, because the socket leads
//! only to the proxy, which trusts nothing the client says. The mount is read-only, so the command
//! cannot create files or sockets on the host through it.
//!
//! Raw TCP rules (runc, one-run and session containers): for every execution the daemon also
//! binds [`TCP_SOCKET_NAME`] in the same directory; the supervisor makes the rules' ranges local
//! in the container's namespace (a session's container: on its first exec, for its life),
//! listens on their ports during the execution and relays each connection there after a line
//! naming its destination, which [`crate::egress::TcpPolicy`] judges like any other.
//!
//! Owns: the directories (one per daemon and backend, one per container inside it), binding the
//! listeners, the removal at startup of directories of dead daemons. Must not: decide egress
//! policy.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::egress::{EgressPolicy, ProxyRun, Resolver, TcpListeners, proxy_env};
use crate::sandbox::{BackendKind, NetworkPolicy, RunSpec, SandboxError};

use super::labels::Owner;
use super::supervisor::Relay;

/// Where a container sees its egress directory.
pub const CONTAINER_DIR: &str = "/run/executor-arm/egress";
/// The proxy's socket inside that directory.
pub const SOCKET_NAME: &str = "proxy.sock";
/// The raw TCP socket beside it (runs whose profile has tcp rules): the supervisor relays each
/// connection to a rule port here, after a line naming its destination.
pub const TCP_SOCKET_NAME: &str = "tcp.sock";

/// The longest path a unix socket may have (`sun_path` holds 108 bytes, the last a NUL).
const SOCKET_PATH_MAX: usize = 107;
/// A container's directory name: random hex digits (64 bits).
const CONTAINER_DIR_NAME_LEN: usize = 16;
/// The longest socket name in a container's directory (`b65535.sock`).
const SOCKET_NAME_MAX: usize = 11;

/// Daemon-wide egress settings of the container backends.
#[derive(Clone)]
pub struct EgressSettings {
    pub resolver: Arc<dyn Resolver>,
    /// The daemon's own addresses and ports, never reachable through the proxy.
    pub deny_addrs: Vec<SocketAddr>,
    /// The loopback port the supervisor listens on inside the container.
    pub port: u16,
    /// Host directory holding the per-container directories; dockerd must see it at the same
    /// path (it bind-mounts from there).
    pub dir: PathBuf,
}

impl EgressSettings {
    /// The proxy policy of one execution (`None` without egress).
    pub fn policy(&self, network: &NetworkPolicy) -> Option<EgressPolicy> {
        network.proxy_policy(&self.deny_addrs)
    }

    /// The relay the supervisor opens for one execution with egress; `spec`'s command gets the
    /// proxy environment that names it (ours win over anything of the same name, which a
    /// request could not set anyway).
    pub fn relay(&self, spec: &mut RunSpec) -> Relay {
        spec.env.extend(proxy_env(self.port));
        Relay {
            port: self.port,
            socket: format!("{CONTAINER_DIR}/{SOCKET_NAME}"),
            tcp_socket: format!("{CONTAINER_DIR}/{TCP_SOCKET_NAME}"),
        }
    }

    /// The relay of a session's background process: one of its own, on loopback `port` (the
    /// session's foreground execs hold [`EgressSettings::port`]) to the proxy socket `name` of
    /// the container's directory ([`EgressSettings::serve_background`]). Raw TCP rules are not
    /// offered there: their ports are the destinations', one listener each per container.
    pub fn background_relay(&self, spec: &mut RunSpec, port: u16, name: &str) -> Relay {
        spec.env.extend(proxy_env(port));
        Relay {
            port,
            socket: format!("{CONTAINER_DIR}/{name}"),
            tcp_socket: String::new(),
        }
    }

    /// The proxy of a session's background process, listening on the socket `name` of `dir`
    /// (removed with the returned guard): its connections are recorded as that run's alone.
    pub fn serve_background(
        &self,
        dir: Option<&SocketDir>,
        network: &NetworkPolicy,
        name: &str,
    ) -> Result<(ProxyRun, RunSocket), SandboxError> {
        let dir = dir.ok_or_else(|| {
            SandboxError::Setup("egress container without its socket directory".into())
        })?;
        let listener = dir.bind_named(name).map_err(|err| {
            SandboxError::Setup(format!(
                "egress proxy socket in {}: {err}",
                dir.path().display()
            ))
        })?;
        let socket = RunSocket(dir.path().join(name));
        let policy = self
            .policy(network)
            .ok_or_else(|| SandboxError::Setup("egress policy missing".into()))?;
        Ok((
            ProxyRun::start(policy, self.resolver.clone(), listener),
            socket,
        ))
    }

    /// The proxy of one execution with `network`, listening on the socket of `dir` (the
    /// container's own directory) before the supervisor gets the request, so the command finds
    /// it. Dropping the [`ProxyRun`] stops it.
    pub fn serve(
        &self,
        dir: Option<&SocketDir>,
        network: &NetworkPolicy,
    ) -> Result<ProxyRun, SandboxError> {
        let dir = dir.ok_or_else(|| {
            SandboxError::Setup("egress container without its socket directory".into())
        })?;
        let listener = dir.bind().map_err(|err| {
            SandboxError::Setup(format!(
                "egress proxy socket in {}: {err}",
                dir.path().display()
            ))
        })?;
        let policy = self
            .policy(network)
            .ok_or_else(|| SandboxError::Setup("egress policy missing".into()))?;
        let mut proxy = ProxyRun::start(policy, self.resolver.clone(), listener);
        serve_tcp(&mut proxy, self, dir, network)?;
        Ok(proxy)
    }
}

/// With raw TCP rules: binds the run's [`TCP_SOCKET_NAME`] in the container's directory and
/// serves it beside the proxy (before the supervisor gets the request, which names the socket).
/// The daemon judges every destination the supervisor names, as on the local backend.
pub fn serve_tcp(
    proxy: &mut ProxyRun,
    settings: &EgressSettings,
    dir: &SocketDir,
    network: &NetworkPolicy,
) -> Result<(), SandboxError> {
    let Some(policy) = network.tcp_policy(&settings.deny_addrs) else {
        return Ok(());
    };
    if policy.rules.iter().any(|r| r.port() == settings.port) {
        return Err(SandboxError::Setup(format!(
            "a tcp rule uses port {}, the egress proxy's port in the sandbox",
            settings.port
        )));
    }
    let listener = dir.bind_tcp().map_err(|err| {
        SandboxError::Setup(format!("raw TCP socket in {}: {err}", dir.path().display()))
    })?;
    proxy.serve_tcp(policy, TcpListeners::Unix(listener));
    Ok(())
}

/// Whether runsc registered with `args` may connect to host unix sockets, which gVisor egress
/// needs (`--host-uds=open` or `all`; the deprecated `--fsgofer-host-uds` means `all`).
pub fn runsc_allows_host_uds(args: &[String]) -> bool {
    let mut it = args.iter().map(|a| a.trim_start_matches('-'));
    while let Some(a) = it.next() {
        let value = match a.split_once('=') {
            Some(("host-uds", v)) => Some(v),
            None if a == "host-uds" => it.next(),
            None if a == "fsgofer-host-uds" => Some("all"),
            Some(("fsgofer-host-uds", v)) => Some(if v == "false" { "none" } else { "all" }),
            _ => None,
        };
        if let Some(v) = value {
            return matches!(v, "open" | "all");
        }
    }
    false
}

/// This daemon's directory for one backend: `<dir>/<backend>.<pid>.<start time>.<pid ns>.<host>`,
/// mode 0700 (like `<dir>` itself), so no other host user can reach a socket in it. Created on
/// first use (a daemon that never runs an egress container touches nothing), removed with
/// everything in it when dropped (the backend shuts down).
pub struct SocketDirs {
    root: PathBuf,
    base: PathBuf,
    owner: Owner,
    created: Mutex<bool>,
}

impl SocketDirs {
    pub fn new(dir: &Path, owner: &Owner, kind: BackendKind) -> SocketDirs {
        SocketDirs {
            root: dir.to_path_buf(),
            base: dir.join(dir_name(owner, kind)),
            owner: owner.clone(),
            created: Mutex::new(false),
        }
    }

    pub fn base(&self) -> &Path {
        &self.base
    }

    /// Removes the directories of daemons that are gone (called once at startup, so a crashed
    /// daemon's directories do not wait for the next egress run). Returns how many.
    pub fn sweep_dead(&self) -> usize {
        let swept = sweep(&self.root, &self.owner, super::labels::process_start_time);
        if swept > 0 {
            tracing::warn!(
                swept,
                dir = %self.root.display(),
                "removed egress socket directories left by an earlier daemon"
            );
        }
        swept
    }

    /// Creates the directories (once). Fails when a socket path under them would be longer
    /// than a unix socket's path may be.
    pub fn ensure(&self) -> std::io::Result<()> {
        let mut created = self.created.lock().unwrap_or_else(|e| e.into_inner());
        if *created {
            return Ok(());
        }
        let longest =
            self.base.as_os_str().len() + 1 + CONTAINER_DIR_NAME_LEN + 1 + SOCKET_NAME_MAX;
        if longest > SOCKET_PATH_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a proxy socket under it would have a path of {longest} bytes, over the \
                     {SOCKET_PATH_MAX} a unix socket allows: choose a shorter \
                     sandbox.docker.egress_dir"
                ),
            ));
        }
        create_private(&self.root)?;
        create_private(&self.base)?;
        *created = true;
        Ok(())
    }

    /// A fresh directory for one container.
    pub fn create(&self) -> std::io::Result<SocketDir> {
        self.ensure()?;
        let mut name = uuid::Uuid::new_v4().simple().to_string();
        name.truncate(CONTAINER_DIR_NAME_LEN);
        let path = self.base.join(name);
        std::fs::create_dir(&path)?;
        // Traversable by the sandbox's uid (runc connects as that uid); only the bind mount
        // exposes it, the 0700 parents keep everyone else out.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        Ok(SocketDir { path })
    }
}

impl Drop for SocketDirs {
    fn drop(&mut self) {
        if *self.created.get_mut().unwrap_or_else(|e| e.into_inner()) {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }
}

/// A background run's proxy socket file, removed when dropped (the directory outlives it).
pub struct RunSocket(PathBuf);

impl Drop for RunSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The proxy socket name of a session's background run whose relay listens on loopback `port`
/// in the container (short: a unix socket's host path must stay under 108 bytes).
pub fn background_socket_name(port: u16) -> String {
    format!("b{port}.sock")
}

/// One container's egress directory; removed (socket included) when dropped.
#[derive(Debug)]
pub struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Binds the proxy's listener for one execution. The container's mount is read-only, so
    /// whatever is at the socket's path was left by an earlier bind of ours.
    pub fn bind(&self) -> std::io::Result<tokio::net::UnixListener> {
        self.bind_named(SOCKET_NAME)
    }

    /// Binds the raw TCP listener for one execution (as [`SocketDir::bind`]).
    pub fn bind_tcp(&self) -> std::io::Result<tokio::net::UnixListener> {
        self.bind_named(TCP_SOCKET_NAME)
    }

    pub(super) fn bind_named(&self, name: &str) -> std::io::Result<tokio::net::UnixListener> {
        let socket = self.path.join(name);
        match std::fs::remove_file(&socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = tokio::net::UnixListener::bind(&socket)?;
        // runc: the command's uid connects; the directory is the access control.
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))?;
        Ok(listener)
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `dir` and its missing parents, the last one mode 0700.
fn create_private(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

fn dir_name(owner: &Owner, kind: BackendKind) -> String {
    format!(
        "{}.{}.{}.{}",
        kind.as_str(),
        owner.pid,
        owner.start_time,
        namespace_and_host(owner)
    )
}

/// Which daemons' pids are comparable with ours: a digest of the pid namespace's inode and the
/// host name (`h` and 12 hex digits), short, since every socket path under the directory must
/// stay within [`SOCKET_PATH_MAX`] whatever the host is called.
fn namespace_and_host(owner: &Owner) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(legacy_namespace_and_host(owner).as_bytes());
    format!("h{}", hex::encode(&digest[..6]))
}

/// `<pid ns inode>.<host>`, as directory names had it before [`namespace_and_host`]: the sweep
/// still knows them.
fn legacy_namespace_and_host(owner: &Owner) -> String {
    let ns: String = owner.pid_ns.chars().filter(char::is_ascii_digit).collect();
    let host: String = owner
        .host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{ns}.{host}")
}

/// Removes the directories of daemons on this host and pid namespace that are gone (the pid is
/// free or belongs to a process started at another time), like the container sweep. Returns how
/// many.
fn sweep(dir: &Path, me: &Owner, start_time_of: impl Fn(u32) -> Option<u64>) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mine = [namespace_and_host(me), legacy_namespace_and_host(me)];
    let mut removed = 0;
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let mut it = name.splitn(4, '.');
        let (Some(_kind), Some(pid), Some(start), Some(ns_host)) =
            (it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
            continue;
        };
        if !mine.iter().any(|m| *m == ns_host) || (pid == me.pid && start == me.start_time) {
            continue;
        }
        if start_time_of(pid) != Some(start) && std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    fn owner(pid: u32, start_time: u64) -> Owner {
        Owner {
            instance: "i".into(),
            host: "host-1".into(),
            pid_ns: "pid:[4026531836]".into(),
            pid,
            start_time,
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn directories_sockets_and_their_removal() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("egress");
        let dirs = SocketDirs::new(&dir, &owner(7, 70), BackendKind::Gvisor);
        assert!(!dir.exists(), "nothing is created before it is needed");
        dirs.ensure().unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(dirs.base()), 0o700);
        assert!(
            dirs.base()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("gvisor.7.70.h")
        );

        let one = dirs.create().unwrap();
        assert_eq!(mode(one.path()), 0o755);
        let listener = one.bind().unwrap();
        let socket = one.path().join(SOCKET_NAME);
        assert!(std::fs::metadata(&socket).unwrap().file_type().is_socket());
        assert_eq!(mode(&socket), 0o666);
        drop(listener);
        // A second execution would rebind over the stale socket file.
        let again = one.bind().unwrap();
        drop(again);

        let path = one.path().to_path_buf();
        drop(one);
        assert!(!path.exists(), "a container's directory goes with it");
        let _two = dirs.create().unwrap();
        let base = dirs.base().to_path_buf();
        drop(dirs);
        assert!(!base.exists(), "the daemon's directory goes at shutdown");
    }

    #[test]
    fn host_uds_flag_spellings() {
        let ok = |a: &[&str]| {
            runsc_allows_host_uds(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        assert!(ok(&[
            "--platform=ptrace",
            "--network=none",
            "--host-uds=open"
        ]));
        assert!(ok(&["-host-uds", "all"]));
        assert!(ok(&["--fsgofer-host-uds"]));
        assert!(!ok(&["--platform=ptrace", "--network=none"]));
        assert!(!ok(&["--host-uds=none"]));
        assert!(!ok(&["--host-uds=create"]));
        assert!(!ok(&["--fsgofer-host-uds=false"]));
    }

    #[test]
    fn socket_paths_fit_under_the_default_directory_whatever_the_host_is_called() {
        let long = Owner {
            host: "h".repeat(64),
            pid: 4_194_303,
            start_time: u64::MAX,
            ..owner(1, 1)
        };
        let dirs = SocketDirs::new(
            Path::new("/run/executor-arm/egress"),
            &long,
            BackendKind::Gvisor,
        );
        let path = dirs
            .base()
            .join("0123456789abcdef")
            .join(background_socket_name(65535));
        assert!(
            path.as_os_str().len() <= SOCKET_PATH_MAX,
            "{} is {} bytes",
            path.display(),
            path.as_os_str().len()
        );
        // A directory too deep for any socket under it is refused, saying why.
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("d".repeat(100));
        let err = SocketDirs::new(&deep, &long, BackendKind::Docker)
            .ensure()
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("shorter sandbox.docker.egress_dir"),
            "{err}"
        );
        assert!(!deep.exists());
    }

    #[test]
    fn sweep_removes_only_dead_daemons_of_this_host_and_namespace() {
        let root = tempfile::tempdir().unwrap();
        let me = owner(7, 70);
        let live = owner(8, 80);
        let dead = owner(9, 90);
        let reused = owner(10, 100);
        let other_host = Owner {
            host: "elsewhere".into(),
            ..owner(11, 110)
        };
        for (o, k) in [
            (&me, BackendKind::Docker),
            (&live, BackendKind::Gvisor),
            (&dead, BackendKind::Docker),
            (&reused, BackendKind::Gvisor),
            (&other_host, BackendKind::Docker),
        ] {
            std::fs::create_dir_all(root.path().join(dir_name(o, k)).join("c1")).unwrap();
        }
        std::fs::create_dir(root.path().join("unrelated")).unwrap();
        let start_of = |pid: u32| match pid {
            8 => Some(80),
            10 => Some(999),
            _ => None,
        };
        assert_eq!(sweep(root.path(), &me, start_of), 2);
        let mut left: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut expected = vec![
            dir_name(&me, BackendKind::Docker),
            dir_name(&other_host, BackendKind::Docker),
            dir_name(&live, BackendKind::Gvisor),
            "unrelated".to_string(),
        ];
        expected.sort();
        assert_eq!(left, expected);
    }
}
