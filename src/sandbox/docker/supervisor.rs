//! The in-container supervisor: PID 1 of every docker/gvisor sandbox, and the daemon's side of
//! its wire protocol.
//!
//! Owns: where the supervisor binary is and whether it can run in any image (a static
//! executable, checked once at start: [`check_binary`]), the container's entrypoint, encoding a
//! run or file request for it, and decoding the frames it writes back. Must not: talk to the
//! engine or decide outcomes. The wire format itself is ONE module both sides compile,
//! [`executor_arm_supervisor::protocol`]; the supervisor is that crate's binary
//! (`supervisor/src/main.rs`), built static with glibc (`scripts/build-supervisor.sh`) and
//! bind-mounted read-only into every container at [`CONTAINER_PATH`], so the image needs
//! nothing of ours (no interpreter, any libc or none).
//!
//! Why a supervisor: a pooled container is started long before its request exists, so its main
//! process must wait for the argv. It reads one request from stdin and `execve`s the argv as a
//! list (never a shell) in a child it forked while idle (forking is the costliest step of a hit
//! under gVisor, so the pool pays it; the child holds the command's identity and nothing of the
//! request until it arrives), relays the command's stdout/stderr as frames, reaps every orphan (it is
//! PID 1, so no separate init is needed), reports the exact wait status in a final frame the
//! moment the command exits (so no run waits for container teardown), then exits, which makes the
//! kernel kill anything the command left behind. The command's environment is exactly
//! `RunSpec::env`.
//!
//! With egress the supervisor also relays `127.0.0.1:<port>` inside the container to the daemon's
//! proxy socket ([`Relay`]; see [`super::egress`] for why).
//!
//! Trust: the supervisor's stdout is the run's report, so the command must not reach it. The
//! supervisor runs as root with only CAP_SETUID and CAP_SETGID (see [`super::container`]), makes
//! itself non-dumpable, and starts the command as the profile's uid/gid with no supplementary
//! groups (in a kept sandbox: only its run's marker, by which the run's processes are killed),
//! checking the switch took effect before `execve` (a failure is an `f` frame, never a
//! run as root). The command therefore cannot ptrace it, read its memory, open its descriptors
//! through `/proc/1/fd`, or signal it. Limits, isolation and OOM verdicts never depend on the
//! supervisor: they come from the engine.
//!
//! Lifetime: the supervisor keeps watching its stdin during the run; dockerd closes it when the
//! daemon's attach connection drops (the container has `StdinOnce`), and the supervisor then
//! exits, which ends the container. It also ends the run itself a few seconds after the
//! request's timeout (a `t` frame), in case the daemon cannot.

use std::path::{Path, PathBuf};

use bytes::{Buf, Bytes, BytesMut};
use executor_arm_supervisor::protocol::{self, FileHeader, RunHeader, kind};

use super::super::{ExitKind, RunSpec, SandboxError};
use crate::sandbox::files::ImportMode;

/// The binary's file name, next to the daemon's by default (`sandbox.docker.supervisor`).
pub const BINARY_NAME: &str = "executor-arm-supervisor";

/// Where every container sees the supervisor (a read-only bind mount of the host's binary).
pub const CONTAINER_PATH: &str = "/run/executor-arm/supervisor";

/// The egress relay the supervisor sets up before the command starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relay {
    /// Loopback port inside the container (the command's proxy settings name it).
    pub port: u16,
    /// The daemon's proxy socket, as the container sees it.
    pub socket: String,
    /// The daemon's socket for raw TCP connections, beside the proxy's, as the container sees
    /// it.
    pub tcp_socket: String,
}

/// The raw TCP fields of a run request: the spec's rules and the daemon's socket for them
/// beside the proxy's ([`Relay::tcp_socket`]). Rules need the egress relay's directory, so an
/// egress run only.
fn tcp_fields(
    spec: &RunSpec,
    relay: Option<&Relay>,
) -> Result<(Vec<protocol::TcpRoute>, String), SandboxError> {
    let rules = spec.network.tcp_rules();
    if rules.is_empty() {
        return Ok((Vec::new(), String::new()));
    }
    let Some(relay) = relay else {
        return Err(SandboxError::Setup(
            "tcp rules without the egress relay".into(),
        ));
    };
    Ok((
        rules.iter().map(|r| r.route()).collect(),
        relay.tcp_socket.clone(),
    ))
}

/// Where a kept sandbox's supervisor writes each exec's code (a root-owned tmpfs of the
/// container: the command reads its code but cannot change it).
pub const CODE_DIR: &str = "/run/session";

/// The supervisor binary when `sandbox.docker.supervisor` is not set: beside the daemon's own
/// executable (where the image and the release archive install both).
pub fn default_path() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(BINARY_NAME)))
        .unwrap_or_else(|| PathBuf::from("/usr/local/bin").join(BINARY_NAME))
}

/// Refuses a supervisor binary that could not run as PID 1 of any sandbox image: missing, not an
/// executable regular file, not an ELF executable of this machine, or dynamically linked (it
/// would need the image's loader and libc, which a musl or distroless image lacks).
pub fn check_binary(path: &Path) -> Result<(), String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let fix = "build it with scripts/build-supervisor.sh (a static executable) and set \
               sandbox.docker.supervisor to it, or install it beside the daemon";
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("sandbox supervisor {}: {e}; {fix}", path.display()))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(format!(
            "sandbox supervisor {} is not an executable file; {fix}",
            path.display()
        ));
    }
    let mut head = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(64 * 1024).read_to_end(&mut head))
        .map_err(|e| format!("sandbox supervisor {}: {e}; {fix}", path.display()))?;
    match elf_linkage(&head) {
        Ok(Linkage::Static) => Ok(()),
        Ok(Linkage::Dynamic) => Err(format!(
            "sandbox supervisor {} is dynamically linked (it would need the image's loader and \
             libc); {fix}",
            path.display()
        )),
        Err(why) => Err(format!(
            "sandbox supervisor {} {why}; {fix}",
            path.display()
        )),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Linkage {
    Static,
    Dynamic,
}

/// The ELF machine of the daemon's own architecture.
const fn own_machine() -> u16 {
    if cfg!(target_arch = "x86_64") {
        62
    } else if cfg!(target_arch = "aarch64") {
        183
    } else {
        0
    }
}

/// Whether the 64-bit little-endian ELF executable starting `head` (its first 64 KiB: the header
/// and program headers) asks for an interpreter (PT_INTERP: a dynamic loader). A static-pie has
/// PT_DYNAMIC for its own relocations but no interpreter, which is what matters here.
fn elf_linkage(head: &[u8]) -> Result<Linkage, String> {
    let u16_at = |o: usize| head.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        head.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        head.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if head.get(..4) != Some(b"\x7fELF") || head.get(4) != Some(&2) || head.get(5) != Some(&1) {
        return Err("is not a 64-bit little-endian ELF executable".into());
    }
    let e_type = u16_at(16).ok_or("has a truncated ELF header")?;
    if e_type != 2 && e_type != 3 {
        return Err("is not an ELF executable".into());
    }
    if u16_at(18) != Some(own_machine()) {
        return Err("is built for another machine than the daemon".into());
    }
    let phoff = u64_at(32).ok_or("has a truncated ELF header")?;
    let phentsize = u16_at(54).ok_or("has a truncated ELF header")? as usize;
    let phnum = u16_at(56).ok_or("has a truncated ELF header")? as usize;
    let phoff = usize::try_from(phoff).map_err(|_| "has a bad program header offset")?;
    if phentsize < 4 {
        return Err("has bad program headers".into());
    }
    for i in 0..phnum {
        let p_type = u32_at(phoff + i * phentsize).ok_or("has program headers past 64 KiB")?;
        if p_type == 3 {
            return Ok(Linkage::Dynamic);
        }
    }
    Ok(Linkage::Static)
}

/// The container's entrypoint: the supervisor, told who the command runs as, where, whether
/// it serves one request (`/execute`) or a session's requests one after another (`kept`), and
/// the address-space limit (RLIMIT_AS, bytes) each command process gets, if any.
pub fn entrypoint(
    uid: u32,
    gid: u32,
    workdir: &str,
    kept: bool,
    address_space: Option<u64>,
) -> Vec<String> {
    vec![
        CONTAINER_PATH.to_string(),
        uid.to_string(),
        gid.to_string(),
        workdir.to_string(),
        if kept { "kept" } else { "once" }.to_string(),
        address_space.unwrap_or(0).to_string(),
    ]
}

/// The command of a kept container's background run: the supervisor in `spawn` mode, for the
/// same user, workdir and address-space limit as the container's own ([`entrypoint`]), started
/// with `docker exec` beside PID 1.
pub fn spawn_command(uid: u32, gid: u32, workdir: &str, address_space: Option<u64>) -> Vec<String> {
    let mut cmd = entrypoint(uid, gid, workdir, true, address_space);
    cmd[4] = "spawn".to_string();
    cmd
}

/// The command that connects to a port of a kept container (gVisor): the supervisor in
/// `connect` mode as the container's user, the port to append ([`super::tunnel`]).
pub fn connect_command(uid: u32, gid: u32, workdir: &str) -> Vec<String> {
    let mut cmd = entrypoint(uid, gid, workdir, true, None);
    cmd.truncate(4);
    cmd.push("connect".to_string());
    cmd
}

/// A file call to a kept sandbox's supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp<'a> {
    /// Write these bytes to the file (made, or replaced; missing parents made).
    Put(&'a [u8]),
    /// Read the file, at most this many bytes.
    Get(u64),
    /// List the directory.
    List,
    /// Is it a directory.
    Dir,
    /// A tar of the directory, as data frames.
    TarOut,
    /// Extract the tar that follows in chunks ([`protocol::archive_chunk`]).
    TarIn(ImportMode),
}

/// The request of a file call on `path` (relative to the workdir, already checked: no empty,
/// `.` or `..` component, no NUL).
pub fn encode_file_request(path: &str, op: FileOp<'_>) -> Result<Vec<u8>, SandboxError> {
    if path.contains('\0') || path.starts_with('/') {
        return Err(SandboxError::Setup(format!(
            "invalid workspace path '{}'",
            path.escape_debug()
        )));
    }
    let (op, n, data): (protocol::FileOp, u64, &[u8]) = match op {
        FileOp::Put(b) => (protocol::FileOp::Put, b.len() as u64, b),
        FileOp::Get(max) => (protocol::FileOp::Get, max, &[]),
        FileOp::List => (protocol::FileOp::List, 0, &[]),
        FileOp::Dir => (protocol::FileOp::Dir, 0, &[]),
        FileOp::TarOut => (protocol::FileOp::TarOut, 0, &[]),
        FileOp::TarIn(ImportMode::Upload) => (protocol::FileOp::TarIn, protocol::TARIN_UPLOAD, &[]),
        FileOp::TarIn(ImportMode::Restore) => {
            (protocol::FileOp::TarIn, protocol::TARIN_RESTORE, &[])
        }
    };
    FileHeader {
        op,
        path: path.to_string(),
        n,
    }
    .encode(data)
    .map_err(SandboxError::Setup)
}

/// Serialises `spec`'s argv, env, stdin and timeout, the egress relay, and (kept sandboxes) the
/// exec's code file, into the request the supervisor reads. `stream`: the command's stdin stays
/// open after `spec.stdin` for control frames (the run has controls, forwarded by the caller).
pub fn encode_request(
    spec: &RunSpec,
    relay: Option<&Relay>,
    code: Option<(&str, &[u8])>,
    stream: bool,
) -> Result<Vec<u8>, SandboxError> {
    let first = spec
        .argv
        .first()
        .ok_or_else(|| SandboxError::Setup("empty argv".into()))?;
    if !first.starts_with('/') {
        return Err(SandboxError::Setup(format!(
            "argv[0] '{first}' is not an absolute path"
        )));
    }
    let mut env = Vec::with_capacity(spec.env.len());
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') {
            return Err(SandboxError::Setup(format!(
                "invalid environment name '{}'",
                k.escape_debug()
            )));
        }
        env.push(format!("{k}={v}"));
    }
    let (relay_port, relay_socket) = match relay {
        Some(r) if r.port != 0 && r.socket.starts_with('/') => (r.port, r.socket.clone()),
        Some(r) => {
            return Err(SandboxError::Setup(format!(
                "invalid egress relay {}:{}",
                r.port, r.socket
            )));
        }
        None => (0, String::new()),
    };
    let (code_path, code_bytes) = match code {
        Some((path, bytes)) => {
            let name = path
                .strip_prefix(CODE_DIR)
                .and_then(|p| p.strip_prefix('/'));
            if !name.is_some_and(|n| !n.is_empty() && !n.contains('/')) {
                return Err(SandboxError::Setup(format!(
                    "code path {path} is not a file of {CODE_DIR}"
                )));
            }
            (path.to_string(), Some(bytes))
        }
        None => (String::new(), None),
    };
    let (tcp_rules, tcp_socket) = tcp_fields(spec, relay)?;
    let header = RunHeader {
        argv: spec.argv.clone(),
        env,
        stdin_len: spec.stdin.as_ref().map(|s| s.len() as u64),
        relay_port,
        relay_socket,
        timeout_ms: u64::try_from(spec.limits.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1),
        code_path,
        code_len: code_bytes.map(|c| c.len() as u64),
        // Where the command starts ("": the workdir); the supervisor accepts only the workdir
        // or a path below it.
        cwd: spec
            .fs
            .cwd
            .as_ref()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default(),
        tcp_rules,
        tcp_socket,
        stdin_stream: stream,
    };
    header
        .encode(
            spec.stdin.as_deref().unwrap_or_default(),
            code_bytes.unwrap_or_default(),
        )
        .map_err(SandboxError::Setup)
}

/// The supervisor's final report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    pub exit: ExitKind,
    pub stdin_broken_pipe: bool,
    pub peak_memory_kib: Option<u64>,
    /// OOM kills the container's cgroup counted (None: not visible, e.g. under gVisor).
    pub oom_kills: Option<u64>,
    /// Times the pids limit refused a fork (None: not visible).
    pub pids_max_hits: Option<u64>,
}

impl ExitReport {
    fn parse(payload: &[u8]) -> Option<ExitReport> {
        let r = protocol::ExitReport::parse(payload)?;
        Some(ExitReport {
            exit: match r.status {
                protocol::Status::Exited(n) => ExitKind::Exited(n),
                protocol::Status::Signaled(n) => ExitKind::Signaled(n),
            },
            stdin_broken_pipe: r.stdin_broken_pipe,
            peak_memory_kib: r.peak_memory_kib,
            oom_kills: r.oom_kills,
            pids_max_hits: r.pids_max_hits,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Stdout(Bytes),
    Stderr(Bytes),
    Exit(ExitReport),
    /// The supervisor could not start the command (e.g. the program is missing in the image).
    Failed(String),
    /// The supervisor could not fork the command: the sandbox's processes hold all of its pids.
    NoPids(String),
    /// The egress relay cannot reach the daemon's proxy: the host lacks what egress needs.
    Unavailable(String),
    /// The supervisor ended the run at its own deadline (the daemon did not stop it in time).
    Deadline(String),
    /// A file call's verdict: `ok` or `err CODE SIZE MESSAGE` (after its data frames).
    Result(String),
}

/// Incremental decoder of the supervisor's stdout.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: BytesMut,
}

impl FrameDecoder {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete frame; `Err` on a corrupted stream.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, String> {
        let Some((k, len)) = protocol::parse_frame_header(&self.buf)? else {
            return Ok(None);
        };
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        let text = || String::from_utf8_lossy(&payload).into_owned();
        let frame = match k {
            kind::STDOUT => Frame::Stdout(payload),
            kind::STDERR => Frame::Stderr(payload),
            kind::EXIT => Frame::Exit(
                ExitReport::parse(&payload)
                    .ok_or_else(|| format!("bad exit report {:?}", text()))?,
            ),
            kind::FAILED => Frame::Failed(text()),
            kind::NO_PIDS => Frame::NoPids(text()),
            kind::UNAVAILABLE => Frame::Unavailable(text()),
            kind::DEADLINE => Frame::Deadline(text()),
            kind::RESULT => Frame::Result(text()),
            other => return Err(format!("unknown supervisor frame type {other:#x}")),
        };
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::Limits;
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn spec(argv: &[&str], stdin: Option<&[u8]>) -> RunSpec {
        let base = crate::sandbox::test_spec(argv);
        RunSpec {
            stdin: stdin.map(|s| s.to_vec()),
            env: BTreeMap::from([
                ("PATH".to_string(), "/usr/bin:/bin".to_string()),
                ("X".to_string(), "a=b c".to_string()),
            ]),
            limits: Limits {
                cpus: 1.0,
                disk_bytes: 1 << 20,
                timeout: Duration::from_millis(1500),
                ..base.limits.clone()
            },
            profile: "p".into(),
            ..base
        }
    }

    /// The request as the supervisor decodes it: header, then the bytes after it.
    fn decoded(req: &[u8]) -> (RunHeader, Vec<u8>) {
        let (magic, header, rest) = protocol::split_request(req).unwrap();
        assert_eq!(&magic, protocol::RUN_MAGIC);
        (RunHeader::decode(header).unwrap(), rest.to_vec())
    }

    #[test]
    fn a_run_request_carries_exactly_the_specs_argv_env_stdin_and_timeout() {
        let mut s = spec(&["/bin/echo", "$(id)", "a b", ""], Some(b"in\0put"));
        s.fs.cwd = Some("/work/sub".into());
        let relay = Relay {
            port: 3128,
            socket: "/run/executor-arm/egress/proxy.sock".into(),
            tcp_socket: "/run/executor-arm/egress/tcp.sock".into(),
        };
        let (h, rest) = decoded(&encode_request(&s, Some(&relay), None, false).unwrap());
        assert!(!h.stdin_stream);
        assert_eq!(h.argv, ["/bin/echo", "$(id)", "a b", ""]);
        assert_eq!(
            h.env,
            ["PATH=/usr/bin:/bin", "X=a=b c"],
            "exactly RunSpec::env"
        );
        assert_eq!(h.stdin_len, Some(6));
        assert_eq!(
            (h.relay_port, h.relay_socket.as_str()),
            (3128, relay.socket.as_str())
        );
        assert_eq!(h.timeout_ms, 1500);
        assert_eq!((h.code_path.as_str(), h.code_len), ("", None));
        assert_eq!(h.cwd, "/work/sub");
        assert_eq!(rest, b"in\0put");

        let code = encode_request(
            &spec(&["/usr/bin/python3", "/run/session/c1.py"], None),
            None,
            Some(("/run/session/c1.py", b"print(1)")),
            true,
        )
        .unwrap();
        let (h, rest) = decoded(&code);
        assert_eq!((h.stdin_len, h.relay_port, h.cwd.as_str()), (None, 0, ""));
        assert!(h.stdin_stream, "a run with controls streams its stdin");
        assert_eq!(
            (h.code_path.as_str(), h.code_len),
            ("/run/session/c1.py", Some(8))
        );
        assert_eq!(rest, b"print(1)");
    }

    /// Raw TCP rules travel with the relay, beside the proxy's socket; without the relay they
    /// are refused (they need the egress directory).
    #[test]
    fn a_run_request_carries_the_tcp_rules_and_their_socket() {
        let mut s = spec(&["/bin/true"], None);
        let tcp: Vec<crate::egress::TcpRule> = ["10.20.0.0/16:5432", "[2001:db8::/32]:22"]
            .iter()
            .map(|r| r.parse().unwrap())
            .collect();
        s.network = crate::sandbox::NetworkPolicy::Egress {
            allow_hosts: vec![],
            allow_ports: vec![80],
            allow_cidrs: vec![],
            bandwidth_bytes_per_sec: 1,
            byte_cap: 1,
            tcp: tcp.clone(),
        };
        let relay = Relay {
            port: 3128,
            socket: "/run/executor-arm/egress/proxy.sock".into(),
            tcp_socket: "/run/executor-arm/egress/tcp.sock".into(),
        };
        let (h, _) = decoded(&encode_request(&s, Some(&relay), None, false).unwrap());
        let routes: Vec<_> = tcp.iter().map(|r| r.route()).collect();
        assert_eq!(h.tcp_rules, routes);
        assert_eq!(h.tcp_socket, "/run/executor-arm/egress/tcp.sock");
        assert!(encode_request(&s, None, None, false).is_err());
        // Without rules the request has no tcp fields at all.
        let (h, _) = decoded(
            &encode_request(&spec(&["/bin/true"], None), Some(&relay), None, false).unwrap(),
        );
        assert!(h.tcp_rules.is_empty() && h.tcp_socket.is_empty());
    }

    #[test]
    fn requests_refuse_relative_programs_nul_and_bad_relays_or_code_paths() {
        assert!(encode_request(&spec(&["echo"], None), None, None, false).is_err());
        assert!(encode_request(&spec(&["/bin/echo", "a\0b"], None), None, None, false).is_err());
        assert!(encode_request(&spec(&[], None), None, None, false).is_err());
        let echo = spec(&["/bin/echo"], None);
        for bad in [(0, "/s"), (3128, "relative"), (3128, "/a\0b")] {
            let r = Relay {
                port: bad.0,
                socket: bad.1.into(),
                tcp_socket: "/run/executor-arm/egress/tcp.sock".into(),
            };
            assert!(
                encode_request(&echo, Some(&r), None, false).is_err(),
                "{bad:?}"
            );
        }
        for bad in ["/tmp/c", "/run/session/", "/run/session/a/b"] {
            assert!(
                encode_request(&echo, None, Some((bad, b"x")), false).is_err(),
                "{bad}"
            );
        }
        let mut env = spec(&["/bin/echo"], None);
        env.env.insert("A=B".into(), "x".into());
        assert!(encode_request(&env, None, None, false).is_err());
    }

    #[test]
    fn file_requests_encode_their_operation() {
        let put = encode_file_request("a/b", FileOp::Put(b"data")).unwrap();
        let (magic, header, rest) = protocol::split_request(&put).unwrap();
        assert_eq!((&magic, rest), (protocol::FILE_MAGIC, &b"data"[..]));
        let h = FileHeader::decode(header).unwrap();
        assert_eq!(
            (h.op, h.path.as_str(), h.n),
            (protocol::FileOp::Put, "a/b", 4)
        );
        let get = encode_file_request("", FileOp::Get(10)).unwrap();
        let h = FileHeader::decode(protocol::split_request(&get).unwrap().1).unwrap();
        assert_eq!((h.op, h.n), (protocol::FileOp::Get, 10));
        let tarin = encode_file_request("sub", FileOp::TarIn(ImportMode::Restore)).unwrap();
        let (_, header, rest) = protocol::split_request(&tarin).unwrap();
        let h = FileHeader::decode(header).unwrap();
        assert_eq!(
            (h.op, h.n, rest),
            (protocol::FileOp::TarIn, protocol::TARIN_RESTORE, &b""[..])
        );
        assert!(encode_file_request("/abs", FileOp::List).is_err());
        assert!(encode_file_request("a\0b", FileOp::Dir).is_err());
    }

    #[test]
    fn decoder_handles_split_and_corrupt_streams() {
        let mut d = FrameDecoder::default();
        d.push(b"o\0\0\0\x02h");
        assert_eq!(d.next_frame().unwrap(), None);
        d.push(b"ix\0\0\0\x0cexit 0 0 - 1");
        assert_eq!(
            d.next_frame().unwrap(),
            Some(Frame::Stdout(Bytes::from_static(b"hi")))
        );
        let Some(Frame::Exit(r)) = d.next_frame().unwrap() else {
            panic!()
        };
        assert_eq!(
            r,
            ExitReport {
                exit: ExitKind::Exited(0),
                stdin_broken_pipe: false,
                peak_memory_kib: None,
                oom_kills: Some(1),
                pids_max_hits: None
            }
        );
        let mut d = FrameDecoder::default();
        d.push(b"o\xff\xff\xff\xff");
        assert!(d.next_frame().is_err());
        let mut d = FrameDecoder::default();
        d.push(b"t\0\0\0\x04late");
        assert_eq!(
            d.next_frame().unwrap(),
            Some(Frame::Deadline("late".into()))
        );
        let mut d = FrameDecoder::default();
        d.push(b"z\0\0\0\0");
        assert!(d.next_frame().is_err());
        let mut d = FrameDecoder::default();
        d.push(b"x\0\0\0\x04quit");
        assert!(d.next_frame().is_err(), "a bad exit report");
    }

    #[test]
    fn the_entrypoint_is_the_mounted_supervisor_with_its_arguments() {
        assert_eq!(
            entrypoint(10001, 10002, "/work", true, Some(1 << 20)),
            [CONTAINER_PATH, "10001", "10002", "/work", "kept", "1048576"]
        );
        assert_eq!(&entrypoint(1, 2, "/w", false, None)[4..], ["once", "0"]);
    }

    /// A 64-bit little-endian ELF header of this machine with `types` as its program headers.
    fn elf(types: &[u32]) -> Vec<u8> {
        let mut b = vec![0u8; 64 + 56 * types.len()];
        b[..4].copy_from_slice(b"\x7fELF");
        (b[4], b[5]) = (2, 1);
        b[16..18].copy_from_slice(&3u16.to_le_bytes());
        b[18..20].copy_from_slice(&own_machine().to_le_bytes());
        b[32..40].copy_from_slice(&64u64.to_le_bytes());
        b[54..56].copy_from_slice(&56u16.to_le_bytes());
        b[56..58].copy_from_slice(&(types.len() as u16).to_le_bytes());
        for (i, t) in types.iter().enumerate() {
            b[64 + 56 * i..68 + 56 * i].copy_from_slice(&t.to_le_bytes());
        }
        b
    }

    #[test]
    fn only_a_static_executable_of_this_machine_is_a_usable_supervisor() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, bytes: &[u8], mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        };
        // A static-pie: PT_LOAD and PT_DYNAMIC, no PT_INTERP.
        assert_eq!(
            check_binary(&write("static", &elf(&[1, 2, 6]), 0o755)),
            Ok(())
        );
        let dynamic = check_binary(&write("dynamic", &elf(&[6, 3, 1, 2]), 0o755)).unwrap_err();
        assert!(dynamic.contains("dynamically linked"), "{dynamic}");
        assert!(dynamic.contains("scripts/build-supervisor.sh"), "{dynamic}");
        let missing = check_binary(&dir.path().join("none")).unwrap_err();
        assert!(missing.contains("scripts/build-supervisor.sh"), "{missing}");
        let not_exec = check_binary(&write("plain", &elf(&[1]), 0o644)).unwrap_err();
        assert!(not_exec.contains("not an executable file"), "{not_exec}");
        let script = check_binary(&write("script", b"#!/bin/sh\n", 0o755)).unwrap_err();
        assert!(script.contains("not a 64-bit"), "{script}");
        let mut other = elf(&[1]);
        other[18] = 0x28;
        let other = check_binary(&write("arm32", &other, 0o755)).unwrap_err();
        assert!(other.contains("another machine"), "{other}");
        assert!(check_binary(&write("short", &elf(&[1])[..40], 0o755)).is_err());
        // The host's own dynamically linked programs are refused.
        let sh = std::fs::read("/bin/sh").unwrap();
        assert_eq!(elf_linkage(&sh), Ok(Linkage::Dynamic));
    }
}
