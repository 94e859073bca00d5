//! The in-container supervisor: PID 1 of every docker/gvisor sandbox, and its wire protocol.
//!
//! Owns: the supervisor program (`supervisor.pl`, run by the image's `/usr/bin/perl`, which every
//! Debian-based image has: perl-base is Essential), encoding a run request for it, and decoding the
//! frames it writes back. Must not: talk to the engine or decide outcomes.
//!
//! Why a supervisor: a pooled container is started long before its request exists, so its main
//! process must wait for the argv. It reads one request from stdin and `execve`s the argv as a
//! list (never a shell) in a child it forked while idle (forking is the costliest step of a hit
//! under gVisor, so the pool pays it; the child holds the command's identity and nothing of the
//! request until it arrives), relays the command's stdout/stderr as frames, reaps every orphan (it is
//! PID 1, so no separate init is needed), reports the exact wait status in a final frame the
//! moment the command exits (so no run waits for container teardown), then exits, which makes the
//! kernel kill anything the command left behind.
//!
//! With egress the supervisor also relays `127.0.0.1:<port>` inside the container to the daemon's
//! proxy socket ([`Relay`]; see [`super::egress`] for why).
//!
//! Trust: the supervisor's stdout is the run's report, so the command must not reach it. The
//! supervisor runs as root with only CAP_SETUID and CAP_SETGID (see [`super::container`]), makes
//! itself non-dumpable, and starts the command as the profile's uid/gid with no supplementary
//! groups, checking the switch took effect before `execve` (a failure is an `f` frame, never a
//! run as root). The command therefore cannot ptrace it, read its memory, open its descriptors
//! through `/proc/1/fd`, or signal it. Limits, isolation and OOM verdicts never depend on the
//! supervisor: they come from the engine.
//!
//! Lifetime: the supervisor keeps watching its stdin during the run; dockerd closes it when the
//! daemon's attach connection drops (the container has `StdinOnce`), and the supervisor then
//! exits, which ends the container. It also ends the run itself a few seconds after the
//! request's timeout (a `t` frame), in case the daemon cannot.

use bytes::{Buf, Bytes, BytesMut};

use super::super::{ExitKind, RunSpec, SandboxError};

/// The program; passed as `perl -e` so the image needs nothing of ours.
pub const SCRIPT: &str = include_str!("supervisor.pl");

/// Where the interpreter lives in the image.
pub const PERL: &str = "/usr/bin/perl";

/// Environment of the supervisor process itself (the command gets exactly `RunSpec::env`):
/// neutralise whatever the image sets that would make perl load code or change its I/O layers
/// (an empty PERL_UNICODE would mean -CSDL, hence 0).
pub const SUPERVISOR_ENV: [&str; 5] = [
    "PERL5OPT=",
    "PERL5LIB=",
    "PERLLIB=",
    "PERL5DB=",
    "PERL_UNICODE=0",
];

const MAGIC: &[u8; 4] = b"EAR1";
const FILE_MAGIC: &[u8; 4] = b"EARF";

/// Largest frame payload we accept; the supervisor writes at most 64 KiB per frame, so anything
/// bigger is a corrupted stream (and must not make us buffer it).
const MAX_FRAME: usize = 256 * 1024;

/// The egress relay the supervisor sets up before the command starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relay {
    /// Loopback port inside the container (the command's proxy settings name it).
    pub port: u16,
    /// The daemon's proxy socket, as the container sees it.
    pub socket: String,
}

/// Where a kept sandbox's supervisor writes each exec's code (a root-owned tmpfs of the
/// container: the command reads its code but cannot change it).
pub const CODE_DIR: &str = "/run/session";

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
        PERL.to_string(),
        "-e".to_string(),
        SCRIPT.to_string(),
        uid.to_string(),
        gid.to_string(),
        workdir.to_string(),
        if kept { "kept" } else { "once" }.to_string(),
        address_space.unwrap_or(0).to_string(),
    ]
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
    let (name, n, data): (&str, u64, &[u8]) = match op {
        FileOp::Put(b) => ("put", b.len() as u64, b),
        FileOp::Get(max) => ("get", max, &[]),
        FileOp::List => ("list", 0, &[]),
        FileOp::Dir => ("dir", 0, &[]),
    };
    let header = format!("{name}\0{path}\0{n}");
    let header_len =
        u32::try_from(header.len()).map_err(|_| SandboxError::Setup("path too long".into()))?;
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend_from_slice(FILE_MAGIC);
    out.extend_from_slice(&header_len.to_be_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    Ok(out)
}

/// Serialises `spec`'s argv, env, stdin and timeout, the egress relay, and (kept sandboxes) the
/// exec's code file, into the request the supervisor reads.
pub fn encode_request(
    spec: &RunSpec,
    relay: Option<&Relay>,
    code: Option<(&str, &[u8])>,
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
    let mut fields: Vec<String> = Vec::with_capacity(spec.argv.len() + spec.env.len() + 6);
    fields.push(spec.argv.len().to_string());
    fields.extend(spec.argv.iter().cloned());
    fields.push(spec.env.len().to_string());
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') {
            return Err(SandboxError::Setup(format!(
                "invalid environment name '{}'",
                k.escape_debug()
            )));
        }
        fields.push(format!("{k}={v}"));
    }
    fields.push(
        spec.stdin
            .as_ref()
            .map(|s| s.len() as i64)
            .unwrap_or(-1)
            .to_string(),
    );
    match relay {
        Some(r) if r.port != 0 && r.socket.starts_with('/') => {
            fields.push(r.port.to_string());
            fields.push(r.socket.clone());
        }
        Some(r) => {
            return Err(SandboxError::Setup(format!(
                "invalid egress relay {}:{}",
                r.port, r.socket
            )));
        }
        None => {
            fields.push("0".into());
            fields.push(String::new());
        }
    }
    fields.push(spec.limits.timeout.as_millis().max(1).to_string());
    match code {
        Some((path, bytes)) => {
            let name = path
                .strip_prefix(CODE_DIR)
                .and_then(|p| p.strip_prefix('/'));
            if !name.is_some_and(|n| !n.is_empty() && !n.contains('/')) {
                return Err(SandboxError::Setup(format!(
                    "code path {path} is not a file of {CODE_DIR}"
                )));
            }
            fields.push(path.to_string());
            fields.push(bytes.len().to_string());
        }
        None => {
            fields.push(String::new());
            fields.push("-1".into());
        }
    }
    // Where the command starts ("": the workdir); the supervisor accepts only the workdir or a
    // path below it.
    fields.push(
        spec.fs
            .cwd
            .as_ref()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    if fields.iter().any(|f| f.contains('\0')) {
        return Err(SandboxError::Setup(
            "NUL byte in argument or environment".into(),
        ));
    }
    let header = fields.join("\0");
    let header_len =
        u32::try_from(header.len()).map_err(|_| SandboxError::Setup("request too large".into()))?;
    let stdin = spec.stdin.as_deref().unwrap_or_default();
    let code = code.map(|c| c.1).unwrap_or_default();
    let mut out = Vec::with_capacity(8 + header.len() + stdin.len() + code.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&header_len.to_be_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(stdin);
    out.extend_from_slice(code);
    Ok(out)
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
        let text = std::str::from_utf8(payload).ok()?;
        let mut it = text.split(' ');
        let how = it.next()?;
        let n: i32 = it.next()?.parse().ok()?;
        let exit = match how {
            "exit" => ExitKind::Exited(n),
            "signal" => ExitKind::Signaled(n),
            _ => return None,
        };
        let stdin_broken_pipe = it.next()? == "1";
        let num = |s: Option<&str>| s.and_then(|v| v.parse::<u64>().ok());
        Some(ExitReport {
            exit,
            stdin_broken_pipe,
            peak_memory_kib: num(it.next()),
            oom_kills: num(it.next()),
            pids_max_hits: num(it.next()),
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
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let kind = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_FRAME {
            return Err(format!("supervisor frame of {len} bytes"));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        let frame = match kind {
            b'o' => Frame::Stdout(payload),
            b'e' => Frame::Stderr(payload),
            b'x' => Frame::Exit(ExitReport::parse(&payload).ok_or_else(|| {
                format!("bad exit report {:?}", String::from_utf8_lossy(&payload))
            })?),
            b'f' => Frame::Failed(String::from_utf8_lossy(&payload).into_owned()),
            b'u' => Frame::Unavailable(String::from_utf8_lossy(&payload).into_owned()),
            b't' => Frame::Deadline(String::from_utf8_lossy(&payload).into_owned()),
            b'r' => Frame::Result(String::from_utf8_lossy(&payload).into_owned()),
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
    use std::io::Write;
    use std::process::{Command, Stdio};
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
                timeout: Duration::from_secs(5),
                ..base.limits.clone()
            },
            profile: "p".into(),
            ..base
        }
    }

    /// Who the command runs as in these tests: nobody when we are root (as in CI, so the switch
    /// itself is exercised), else ourselves (the supervisor only checks the ids took effect).
    fn identity() -> (u32, u32) {
        // SAFETY: getuid/getgid/geteuid have no preconditions.
        unsafe {
            if libc::geteuid() == 0 {
                (65534, 65534)
            } else {
                (libc::getuid(), libc::getgid())
            }
        }
    }

    /// The supervisor (host perl, not PID 1) with the request written and stdin kept open.
    fn start(
        spec: &RunSpec,
        relay: Option<&Relay>,
    ) -> (std::process::Child, std::process::ChildStdin) {
        let (mut child, mut stdin) = idle_supervisor();
        let req = encode_request(spec, relay, None).unwrap();
        stdin.write_all(&req).unwrap();
        (child.take(), stdin)
    }

    /// A started supervisor that has no request yet, as in the warm pool.
    fn idle_supervisor() -> (ChildSlot, std::process::ChildStdin) {
        // The container's environment: the image's (LANG=C.UTF-8) plus SUPERVISOR_ENV.
        let mut cmd = Command::new(PERL);
        cmd.env_clear().env("LANG", "C.UTF-8");
        for kv in SUPERVISOR_ENV {
            let (k, v) = kv.split_once('=').unwrap();
            cmd.env(k, v);
        }
        let (uid, gid) = identity();
        let mut child = cmd
            .args(&entrypoint(uid, gid, "/", false, None)[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("perl");
        let stdin = child.stdin.take().unwrap();
        (ChildSlot(Some(child)), stdin)
    }

    /// Kills the supervisor when a test fails before taking it.
    struct ChildSlot(Option<std::process::Child>);

    impl ChildSlot {
        fn take(&mut self) -> std::process::Child {
            self.0.take().expect("taken once")
        }
    }

    impl Drop for ChildSlot {
        fn drop(&mut self) {
            if let Some(c) = self.0.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Polls `cond` every 5 ms until it holds; fails the test after 5 s, naming `what`.
    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(
                std::time::Instant::now() < deadline,
                "not within 5 s: {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The process an idle supervisor prepared for the command: its one child.
    fn prepared_process(slot: &ChildSlot) -> u32 {
        let supervisor = slot.0.as_ref().unwrap().id();
        let children = || {
            std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        };
        wait_for("a child of the idle supervisor", || !children().is_empty());
        let kids = children();
        assert_eq!(kids.len(), 1, "one prepared process: {kids:?}");
        kids[0]
    }

    /// The real and effective uid of `pid` (the `Uid:` line of its status).
    fn uids_of(pid: u32) -> String {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        line.split_whitespace()
            .skip(1)
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Reads frames until the supervisor closes its stdout.
    fn frames_of(child: &mut std::process::Child) -> Vec<Frame> {
        use std::io::Read;
        let mut out = Vec::new();
        child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
        child.wait().unwrap();
        let mut d = FrameDecoder::default();
        d.push(&out);
        let mut frames = Vec::new();
        while let Some(f) = d.next_frame().unwrap() {
            frames.push(f);
        }
        frames
    }

    /// Runs the real supervisor and decodes its reply.
    fn supervise(spec: &RunSpec) -> Vec<Frame> {
        supervise_with(spec, None)
    }

    /// As [`supervise`], with an egress relay.
    fn supervise_with(spec: &RunSpec, relay: Option<&Relay>) -> Vec<Frame> {
        let (mut child, stdin) = start(spec, relay);
        let frames = frames_of(&mut child);
        drop(stdin);
        frames
    }

    fn stdout_of(frames: &[Frame]) -> Vec<u8> {
        frames
            .iter()
            .filter_map(|f| {
                if let Frame::Stdout(b) = f {
                    Some(b.to_vec())
                } else {
                    None
                }
            })
            .flatten()
            .collect()
    }

    fn exit_of(frames: &[Frame]) -> ExitReport {
        match frames.last() {
            Some(Frame::Exit(r)) => r.clone(),
            other => panic!("no exit frame: {other:?}"),
        }
    }

    #[test]
    fn argv_env_and_stdin_pass_through_without_a_shell() {
        let f = supervise(&spec(&["/bin/echo", "$(id)", "a b", ""], None));
        assert_eq!(stdout_of(&f), b"$(id) a b \n");
        assert_eq!(exit_of(&f).exit, ExitKind::Exited(0));

        let f = supervise(&spec(&["/usr/bin/env"], None));
        let out = String::from_utf8(stdout_of(&f)).unwrap();
        assert_eq!(
            out, "PATH=/usr/bin:/bin\nX=a=b c\n",
            "exactly the spec's env"
        );

        let f = supervise(&spec(&["/bin/cat"], Some(b"from stdin\0with nul")));
        assert_eq!(stdout_of(&f), b"from stdin\0with nul");
        assert!(!exit_of(&f).stdin_broken_pipe);
    }

    #[test]
    fn the_commands_process_waits_with_the_run_identity_before_the_request() {
        let (mut slot, mut stdin) = idle_supervisor();
        // Made while idle: one child, already the command's uid, holding no request yet.
        let prepared = prepared_process(&slot);
        let (uid, _) = identity();
        // It takes the identity right after the fork, without waiting for anything.
        wait_for("the run's uid", || {
            uids_of(prepared) == format!("{uid} {uid}")
        });
        // The request runs in that very process (execve keeps the pid), with /dev/null as stdin
        // when the request has none.
        let req = encode_request(
            &spec(
                &["/bin/sh", "-c", "echo $$; readlink /proc/self/fd/0"],
                None,
            ),
            None,
            None,
        )
        .unwrap();
        stdin.write_all(&req).unwrap();
        let f = frames_of(&mut slot.take());
        drop(stdin);
        assert_eq!(exit_of(&f).exit, ExitKind::Exited(0), "{f:?}");
        assert_eq!(
            String::from_utf8(stdout_of(&f)).unwrap(),
            format!("{prepared}\n/dev/null\n")
        );
    }

    #[test]
    fn a_prepared_process_killed_while_idle_is_replaced_for_the_request() {
        let (mut slot, mut stdin) = idle_supervisor();
        let prepared = prepared_process(&slot);
        // SAFETY: kill has no memory preconditions; the pid is the supervisor's child, which
        // stays a zombie (so the pid is not reused) until the supervisor reaps it.
        assert_eq!(unsafe { libc::kill(prepared as i32, libc::SIGKILL) }, 0);
        // Dead (a zombie) before the request comes, as after an idle spell.
        let stat = format!("/proc/{prepared}/stat");
        wait_for("the prepared process dead", || {
            std::fs::read_to_string(&stat).is_ok_and(|s| s.contains(") Z "))
        });
        let req = encode_request(&spec(&["/bin/echo", "ran"], None), None, None).unwrap();
        stdin.write_all(&req).unwrap();
        let f = frames_of(&mut slot.take());
        drop(stdin);
        assert_eq!(stdout_of(&f), b"ran\n", "{f:?}");
        assert_eq!(exit_of(&f).exit, ExitKind::Exited(0));
    }

    #[test]
    fn statuses_failures_and_broken_pipe_are_reported() {
        let f = supervise(&spec(&["/bin/sh", "-c", "echo err >&2; exit 3"], None));
        assert!(f.contains(&Frame::Stderr(Bytes::from_static(b"err\n"))));
        assert_eq!(exit_of(&f).exit, ExitKind::Exited(3));

        let f = supervise(&spec(&["/bin/sh", "-c", "kill -TERM $$"], None));
        assert_eq!(exit_of(&f).exit, ExitKind::Signaled(libc::SIGTERM));

        let f = supervise(&spec(&["/nonexistent/program"], None));
        assert!(
            matches!(f.last(), Some(Frame::Failed(m)) if m.contains("No such file")),
            "{f:?}"
        );

        let big = vec![b'y'; 1 << 20];
        let f = supervise(&spec(&["/bin/true"], Some(&big)));
        assert!(exit_of(&f).stdin_broken_pipe);
    }

    #[test]
    fn only_stdio_fds_and_a_left_over_child_does_not_hold_the_report() {
        // The same listing as ls started directly by this process: the supervisor adds no fd (in
        // a container its own are only 0, 1 and 2; here it also inherits the test harness's).
        let direct = Command::new("/bin/ls")
            .arg("/proc/self/fd")
            .stdin(Stdio::null())
            .output()
            .unwrap()
            .stdout;
        let f = supervise(&spec(&["/bin/ls", "/proc/self/fd"], None));
        assert_eq!(
            String::from_utf8(stdout_of(&f)).unwrap(),
            String::from_utf8(direct).unwrap()
        );

        let t = std::time::Instant::now();
        let f = supervise(&spec(&["/bin/sh", "-c", "sleep 3 & echo started"], None));
        assert_eq!(stdout_of(&f), b"started\n");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "waited for the background child"
        );
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
    }

    /// A free loopback port (a small race with other processes is acceptable in a test).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A stand-in for the daemon's proxy on a unix socket: reads a connection to its end, then
    /// answers "<bytes read> " followed by `reply_len` bytes of 'z', and closes.
    fn socket_server(path: &std::path::Path, reply_len: usize) -> std::sync::mpsc::Receiver<usize> {
        use std::io::Read;
        let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut c) = conn else { return };
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    let _ = c.read_to_end(&mut got);
                    let _ = tx.send(got.len());
                    let mut reply = format!("{} ", got.len()).into_bytes();
                    reply.resize(reply.len() + reply_len, b'z');
                    let _ = c.write_all(&reply);
                });
            }
        });
        rx
    }

    /// The command: connect to 127.0.0.1:PORT, send SEND bytes, half-close, print what came back
    /// as "<first word> <length of the rest>".
    const CLIENT: &str = r#"use Socket; my ($port, $send) = @ARGV;
        socket(my $s, PF_INET, SOCK_STREAM, 0) or die "socket: $!";
        connect($s, pack_sockaddr_in($port, inet_aton("127.0.0.1"))) or die "connect: $!";
        my $data = "a" x $send; while (length $data) { my $w = syswrite($s, $data) // die "write: $!"; substr($data, 0, $w, "") }
        shutdown($s, 1); my $in = ""; while (sysread($s, $in, 65536, length $in)) {}
        my ($n, $rest) = split / /, $in, 2; print "$n ", length($rest // ""), "\n";"#;

    #[test]
    fn the_egress_relay_carries_both_directions_and_half_closes() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("proxy.sock");
        let served = socket_server(&socket, 3 << 20);
        let port = free_port();
        let relay = Relay {
            port,
            socket: socket.to_string_lossy().into_owned(),
        };
        let argv = ["/usr/bin/perl", "-e", CLIENT, &port.to_string(), "300000"];
        let f = supervise_with(&spec(&argv, None), Some(&relay));
        assert_eq!(exit_of(&f).exit, ExitKind::Exited(0), "{f:?}");
        // 300 000 bytes up, 3 MiB down, through 64 KiB buffers, each EOF passed on.
        assert_eq!(
            String::from_utf8(stdout_of(&f)).unwrap(),
            format!("300000 {}\n", 3 << 20)
        );
        // The set-up probe (nothing sent) and the command's connection.
        let mut seen: Vec<usize> = served.try_iter().collect();
        seen.sort();
        assert_eq!(seen, vec![0, 300_000]);
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "the relay's listener ends with the supervisor"
        );
    }

    #[test]
    fn an_unreachable_proxy_socket_stops_the_run_before_the_command() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        let relay = Relay {
            port: free_port(),
            socket: dir
                .path()
                .join("missing.sock")
                .to_string_lossy()
                .into_owned(),
        };
        let argv = ["/usr/bin/touch", marker.to_str().unwrap()];
        let f = supervise_with(&spec(&argv, None), Some(&relay));
        assert!(
            matches!(f.last(), Some(Frame::Unavailable(m)) if m.contains("cannot reach the daemon's proxy")),
            "{f:?}"
        );
        assert!(!marker.exists(), "the command never started");
    }

    /// The pid a command printed first (`echo $$`), and SIGKILL for it: the supervisor is not
    /// PID 1 here, so what it leaves running is the test's to end.
    fn kill_printed_pid(frames: &[Frame]) -> i32 {
        let out = String::from_utf8(stdout_of(frames)).unwrap();
        let pid: i32 = out.lines().next().unwrap().trim().parse().unwrap();
        // SAFETY: kill(2) on a pid our own command printed; no memory effects.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        pid
    }

    #[test]
    #[ignore = "needs root (switches uid): scripts/test-all.sh runs it as root"]
    fn the_command_gets_the_run_identity_and_not_the_supervisor_as_root() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        let probe = r#"my @r; push @r, join(",", $<, $>, $(, $)), (open(my $f, ">", "/proc/" . getppid() . "/fd/1") ? "opened" : "refused"), (kill(0, getppid()) ? "signalled" : "refused"); print "@r\n""#;
        let f = supervise(&spec(&["/usr/bin/perl", "-e", probe], None));
        assert_eq!(exit_of(&f).exit, ExitKind::Exited(0), "{f:?}");
        assert_eq!(
            String::from_utf8(stdout_of(&f)).unwrap(),
            "65534,65534,65534 65534,65534 65534 refused refused\n"
        );
    }

    #[test]
    fn a_closed_stdin_ends_the_supervisor_mid_run() {
        let (mut child, mut stdin) = start(
            &spec(&["/bin/sh", "-c", "echo $$; exec sleep 60"], None),
            None,
        );
        // Wait for the command to run, then go away like a crashed daemon.
        let mut stdout = child.stdout.take().unwrap();
        let mut first = [0u8; 5];
        std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
        assert_eq!(first[0], b'o');
        stdin.flush().unwrap();
        drop(stdin);
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut stdout, &mut rest).unwrap();
        child.wait().unwrap();
        let mut all = first.to_vec();
        all.extend(rest);
        let mut d = FrameDecoder::default();
        d.push(&all);
        let mut f = Vec::new();
        while let Some(x) = d.next_frame().unwrap() {
            f.push(x);
        }
        assert!(
            f.iter().all(|x| matches!(x, Frame::Stdout(_))),
            "no report once the daemon is gone: {f:?}"
        );
        kill_printed_pid(&f);
    }

    #[test]
    fn the_supervisor_ends_a_run_past_its_deadline() {
        let mut s = spec(&["/bin/sh", "-c", "echo $$; exec sleep 60"], None);
        s.limits.timeout = Duration::from_millis(1);
        let t = std::time::Instant::now();
        let f = supervise(&s);
        assert!(
            matches!(f.last(), Some(Frame::Deadline(m)) if m.contains("after its timeout")),
            "{f:?}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(50),
            "ended by the deadline"
        );
        kill_printed_pid(&f);
    }

    #[test]
    fn a_request_without_a_timeout_is_refused() {
        let mut req = encode_request(&spec(&["/bin/true"], None), None, None).unwrap();
        // Drop the timeout and the fields after it (code path, code length, cwd) and fix the
        // length.
        let len = u32::from_be_bytes(req[4..8].try_into().unwrap()) as usize;
        let header = String::from_utf8(req[8..8 + len].to_vec()).unwrap();
        let cut = header.rsplitn(5, '\0').last().unwrap().to_string();
        req.truncate(4);
        req.extend_from_slice(&(cut.len() as u32).to_be_bytes());
        req.extend_from_slice(cut.as_bytes());
        let (uid, gid) = identity();
        let mut child = Command::new(PERL)
            .args(&entrypoint(uid, gid, "/", false, None)[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&req).unwrap();
        let f = frames_of(&mut child);
        assert!(
            matches!(f.last(), Some(Frame::Failed(m)) if m.contains("no timeout")),
            "{f:?}"
        );
    }

    #[test]
    fn requests_refuse_relative_programs_and_nul() {
        assert!(encode_request(&spec(&["echo"], None), None, None).is_err());
        assert!(encode_request(&spec(&["/bin/echo", "a\0b"], None), None, None).is_err());
        assert!(encode_request(&spec(&[], None), None, None).is_err());
        let echo = spec(&["/bin/echo"], None);
        for bad in [(0, "/s"), (3128, "relative"), (3128, "/a\0b")] {
            let r = Relay {
                port: bad.0,
                socket: bad.1.into(),
            };
            assert!(encode_request(&echo, Some(&r), None).is_err(), "{bad:?}");
        }
    }
}
