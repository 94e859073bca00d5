//! The supervisor binary as a plain process, without Docker: once mode (as root switching to
//! nobody, and as an unprivileged user), the egress relay, kept mode (in a pid namespace of its
//! own, where it is PID 1 as in a container) and its file calls.
//!
//! Tests that need root say so and fail without it (CI runs them as root); the unprivileged
//! ones drop to nobody for the supervisor itself.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use executor_arm_supervisor::protocol::{
    ExitReport, FileHeader, FileOp, RunHeader, Status, kind, parse_frame_header,
};

const SUPERVISOR: &str = env!("CARGO_BIN_EXE_executor-arm-supervisor");
const NOBODY: u32 = 65534;

#[derive(Debug, Clone, PartialEq, Eq)]
enum F {
    Out(Vec<u8>),
    Err(Vec<u8>),
    Exit(ExitReport),
    Failed(String),
    Unavailable(String),
    Deadline(String),
    Result(String),
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn need_root() {
    assert!(is_root(), "this test needs root (it switches uids)");
}

/// Decodes every complete frame of `buf`, leaving the rest.
fn decode(buf: &mut Vec<u8>) -> Vec<F> {
    let mut out = Vec::new();
    while let Some((k, len)) = parse_frame_header(buf).unwrap() {
        if buf.len() < 5 + len {
            break;
        }
        let p: Vec<u8> = buf.drain(..5 + len).skip(5).collect();
        let text = String::from_utf8_lossy(&p).into_owned();
        out.push(match k {
            kind::STDOUT => F::Out(p),
            kind::STDERR => F::Err(p),
            kind::EXIT => F::Exit(ExitReport::parse(&p).unwrap()),
            kind::FAILED => F::Failed(text),
            kind::UNAVAILABLE => F::Unavailable(text),
            kind::DEADLINE => F::Deadline(text),
            kind::RESULT => F::Result(text),
            _ => unreachable!(),
        });
    }
    out
}

/// A running supervisor: its stdin kept open (closing it ends the supervisor), its stdout read
/// frame by frame.
struct Sup {
    child: Child,
    stdin: Option<ChildStdin>,
    buf: Vec<u8>,
}

impl Sup {
    /// `args` after the binary; `as_nobody`: the supervisor itself runs unprivileged.
    fn start(args: &[&str], pidns: bool, as_nobody: bool) -> Sup {
        let mut cmd = if pidns {
            // PID 1 of a pid namespace of its own with its /proc, as in a container: kill(-1)
            // and the scan of a run's processes stay inside.
            let mut c = Command::new("unshare");
            c.args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                SUPERVISOR,
            ]);
            c
        } else {
            Command::new(SUPERVISOR)
        };
        cmd.args(args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if as_nobody {
            // std drops the supplementary groups when root switches uid.
            cmd.uid(NOBODY).gid(NOBODY);
        }
        let mut child = cmd.spawn().expect("supervisor");
        let stdin = child.stdin.take();
        Sup {
            child,
            stdin,
            buf: Vec::new(),
        }
    }

    fn once(workdir: &str) -> Sup {
        let id = NOBODY.to_string();
        Sup::start(&[&id, &id, workdir], false, false)
    }

    fn send(&mut self, bytes: &[u8]) {
        let s = self.stdin.as_mut().unwrap();
        s.write_all(bytes).unwrap();
        s.flush().unwrap();
    }

    /// Frames until one of `last` kinds (included), or the stream's end.
    fn until_last(&mut self) -> Vec<F> {
        let mut frames = Vec::new();
        let out = self.child.stdout.as_mut().unwrap();
        let mut chunk = [0u8; 65536];
        loop {
            for f in decode(&mut self.buf) {
                let last = !matches!(f, F::Out(_) | F::Err(_));
                frames.push(f);
                if last {
                    return frames;
                }
            }
            match out.read(&mut chunk).unwrap() {
                0 => return frames,
                n => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Closes stdin (the daemon going away) and waits for the exit.
    fn close(mut self) -> std::process::ExitStatus {
        drop(self.stdin.take());
        self.child.wait().unwrap()
    }
}

impl Drop for Sup {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn request(argv: &[&str], stdin: Option<&[u8]>) -> RunHeader {
    RunHeader {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec!["PATH=/usr/bin:/bin".into(), "X=a=b c".into()],
        stdin_len: stdin.map(|s| s.len() as u64),
        timeout_ms: 10_000,
        ..Default::default()
    }
}

fn encode(h: &RunHeader, stdin: Option<&[u8]>) -> Vec<u8> {
    h.encode(stdin.unwrap_or_default(), b"").unwrap()
}

/// One run in a fresh once-mode supervisor.
fn run_once(workdir: &str, argv: &[&str], stdin: Option<&[u8]>) -> Vec<F> {
    let mut s = Sup::once(workdir);
    s.send(&encode(&request(argv, stdin), stdin));
    let f = s.until_last();
    s.close();
    f
}

fn stdout_of(f: &[F]) -> Vec<u8> {
    f.iter()
        .filter_map(|f| match f {
            F::Out(b) => Some(b.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn exit_of(f: &[F]) -> ExitReport {
    match f.last() {
        Some(F::Exit(r)) => r.clone(),
        other => panic!("no exit frame: {other:?} in {f:?}"),
    }
}

/// Polls `cond` every 5 ms until it holds; fails after 10 s, naming `what`.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn status_line(pid: u32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn argv_env_and_stdin_pass_through_without_a_shell_as_the_run_identity() {
    need_root();
    let f = run_once("/tmp", &["/bin/echo", "$(id)", "a b", ""], None);
    assert_eq!(stdout_of(&f), b"$(id) a b \n");
    assert_eq!(exit_of(&f).status, Status::Exited(0));

    let f = run_once("/tmp", &["/usr/bin/env"], None);
    assert_eq!(
        stdout_of(&f),
        b"PATH=/usr/bin:/bin\nX=a=b c\n",
        "exactly the request's env"
    );

    let f = run_once("/tmp", &["/bin/cat"], Some(b"from stdin\0with nul"));
    assert_eq!(stdout_of(&f), b"from stdin\0with nul");
    assert!(!exit_of(&f).stdin_broken_pipe);

    // nobody, no supplementary group but its own gid, and no way to the supervisor: its stdout
    // (the report) cannot be opened through /proc, it cannot be signalled.
    let probe = "id -u; id -g; id -G; grep -E '^(Uid|Gid|Groups|CapEff):' /proc/self/status; \
                 ls /proc/$PPID/fd/ 2>/dev/null && echo listed; \
                 (echo forged > /proc/$PPID/fd/1) 2>/dev/null && echo opened; \
                 kill -0 $PPID 2>/dev/null && echo signalled; echo done";
    let f = run_once("/tmp", &["/bin/sh", "-c", probe], None);
    assert_eq!(exit_of(&f).status, Status::Exited(0), "{f:?}");
    let out = String::from_utf8(stdout_of(&f)).unwrap();
    assert_eq!(
        out,
        "65534\n65534\n65534\nUid:\t65534\t65534\t65534\t65534\nGid:\t65534\t65534\t65534\t65534\n\
         Groups:\t65534 \nCapEff:\t0000000000000000\ndone\n"
    );
}

#[test]
fn statuses_failures_and_broken_pipe_are_reported_exactly() {
    need_root();
    let f = run_once("/tmp", &["/bin/sh", "-c", "echo err >&2; exit 3"], None);
    assert!(f.contains(&F::Err(b"err\n".to_vec())), "{f:?}");
    assert_eq!(exit_of(&f).status, Status::Exited(3));

    let f = run_once("/tmp", &["/bin/sh", "-c", "kill -TERM $$"], None);
    assert_eq!(exit_of(&f).status, Status::Signaled(libc::SIGTERM));

    let f = run_once("/tmp", &["/nonexistent/program"], None);
    assert!(
        matches!(f.last(), Some(F::Failed(m)) if m == "cannot execute /nonexistent/program: No such file or directory"),
        "{f:?}"
    );

    let f = run_once("/nonexistent-workdir", &["/bin/true"], None);
    assert!(
        matches!(f.last(), Some(F::Failed(m)) if m.contains("chdir /nonexistent-workdir")),
        "{f:?}"
    );

    let big = vec![b'y'; 1 << 20];
    let f = run_once("/tmp", &["/bin/true"], Some(&big));
    assert!(exit_of(&f).stdin_broken_pipe);
}

#[test]
fn bad_requests_are_refused_with_a_setup_failure() {
    need_root();
    let cases: [(RunHeader, &str); 4] = [
        (request(&[], None), "empty argv"),
        (
            RunHeader {
                timeout_ms: 0,
                ..request(&["/bin/true"], None)
            },
            "no timeout in the request",
        ),
        (
            RunHeader {
                cwd: "/tmp/../etc".into(),
                ..request(&["/bin/true"], None)
            },
            "cwd /tmp/../etc is not inside /tmp",
        ),
        (
            RunHeader {
                code_path: "/run/session/c".into(),
                code_len: Some(1),
                ..request(&["/bin/true"], None)
            },
            "code files are for kept sandboxes",
        ),
    ];
    for (h, want) in cases {
        let mut s = Sup::once("/tmp");
        let code: &[u8] = if h.code_len.is_some() { b"x" } else { b"" };
        s.send(&h.encode(b"", code).unwrap());
        let f = s.until_last();
        assert_eq!(f, [F::Failed(want.into())]);
        assert!(s.close().success());
    }
    // Arguments that make no sense: the usage, and nothing runs.
    let mut s = Sup::start(&["0", "x", "/tmp"], false, false);
    assert_eq!(
        s.until_last(),
        [F::Failed(
            "usage: UID GID WORKDIR [once|kept|spawn [AS]] | UID GID WORKDIR connect PORT".into()
        )]
    );
    // An unknown magic ends the supervisor.
    let mut s = Sup::once("/tmp");
    s.send(b"NOPE");
    assert_eq!(s.child.wait().unwrap().code(), Some(2));
}

#[test]
fn the_commands_process_waits_with_the_run_identity_and_is_replaced_if_killed() {
    need_root();
    let mut s = Sup::once("/tmp");
    let sup = s.child.id();
    wait_for("the prepared process", || children_of(sup).len() == 1);
    let prepared = children_of(sup)[0];
    // Made while idle, already nobody, holding no request yet; the supervisor is not dumpable
    // (its /proc files belong to root whatever it runs).
    wait_for("the run's uid", || {
        status_line(prepared, "Uid:") == "65534 65534 65534 65534"
    });
    // The request runs in that very process (execve keeps the pid), with /dev/null as stdin.
    s.send(&encode(
        &request(
            &["/bin/sh", "-c", "echo $$; readlink /proc/self/fd/0"],
            None,
        ),
        None,
    ));
    let f = s.until_last();
    assert_eq!(
        String::from_utf8(stdout_of(&f)).unwrap(),
        format!("{prepared}\n/dev/null\n")
    );
    s.close();

    let mut s = Sup::once("/tmp");
    let sup = s.child.id();
    wait_for("the prepared process", || children_of(sup).len() == 1);
    let prepared = children_of(sup)[0];
    // SAFETY: kill(2) on the supervisor's own child, which stays a zombie until reaped.
    assert_eq!(unsafe { libc::kill(prepared as i32, libc::SIGKILL) }, 0);
    wait_for("the prepared process dead", || {
        std::fs::read_to_string(format!("/proc/{prepared}/stat")).is_ok_and(|s| s.contains(") Z "))
    });
    s.send(&encode(&request(&["/bin/echo", "ran"], None), None));
    let f = s.until_last();
    assert_eq!(stdout_of(&f), b"ran\n", "{f:?}");
    assert_eq!(exit_of(&f).status, Status::Exited(0));
}

#[test]
fn only_stdio_fds_reach_the_command_and_a_left_over_child_does_not_hold_the_report() {
    need_root();
    let f = run_once("/tmp", &["/bin/ls", "/proc/self/fd"], None);
    // 0, 1, 2 and ls's own directory descriptor: nothing of the supervisor's, nor what the
    // test harness leaves open to its children.
    assert_eq!(String::from_utf8(stdout_of(&f)).unwrap(), "0\n1\n2\n3\n");
    let mut s = Sup::once("/tmp");
    s.send(&encode(
        &request(&["/bin/sh", "-c", "sleep 30 & echo $!"], None),
        None,
    ));
    let f = s.until_last();
    assert_eq!(exit_of(&f).status, Status::Exited(0));
    s.close();
    // Not PID 1 here: the sleep outlives the supervisor; the test ends it.
    let pid: i32 = String::from_utf8(stdout_of(&f))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) on the pid our command printed.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn a_closed_stdin_ends_the_supervisor_mid_run() {
    need_root();
    let mut s = Sup::once("/tmp");
    s.send(&encode(
        &request(&["/bin/sh", "-c", "echo $$; exec sleep 60"], None),
        None,
    ));
    let mut frames = Vec::new();
    let out = s.child.stdout.as_mut().unwrap();
    let mut chunk = [0u8; 4096];
    while frames.is_empty() {
        let n = out.read(&mut chunk).unwrap();
        assert!(n > 0, "ended before the command printed");
        s.buf.extend_from_slice(&chunk[..n]);
        frames.extend(decode(&mut s.buf));
    }
    let pid: i32 = String::from_utf8(stdout_of(&frames))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    drop(s.stdin.take());
    let mut rest = Vec::new();
    s.child
        .stdout
        .as_mut()
        .unwrap()
        .read_to_end(&mut rest)
        .unwrap();
    assert!(s.child.wait().unwrap().success());
    s.buf.extend(rest);
    let after = decode(&mut s.buf);
    assert!(
        after.iter().all(|f| matches!(f, F::Out(_))),
        "no report once the daemon is gone: {after:?}"
    );
    // SAFETY: kill(2) on the pid our command printed (not PID 1 here: the test ends it).
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn the_supervisor_ends_a_run_past_its_deadline() {
    need_root();
    let mut s = Sup::once("/tmp");
    s.send(&encode(
        &RunHeader {
            timeout_ms: 1,
            ..request(&["/bin/sh", "-c", "echo $$; exec sleep 60"], None)
        },
        None,
    ));
    let f = s.until_last();
    assert_eq!(
        f.last(),
        Some(&F::Deadline(
            "the run was still going 5 s after its timeout".into()
        ))
    );
    let pid: i32 = String::from_utf8(stdout_of(&f))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn sigterm_reaches_every_process_of_the_command() {
    need_root();
    // In a pid namespace of its own: the helper's kill(-1) as nobody stays inside it.
    let id = NOBODY.to_string();
    let mut s = Sup::start(&[&id, &id, "/tmp"], true, false);
    // The command traps TERM and reports it; a setsid'd grandchild is reached too.
    let script = "trap 'echo term; exit 7' TERM; setsid sh -c 'trap \"exit 0\" TERM; sleep 60 & wait' & \
                  echo ready; while :; do sleep 0.05; done";
    s.send(&encode(&request(&["/bin/sh", "-c", script], None), None));
    let out = s.child.stdout.as_mut().unwrap();
    let mut chunk = [0u8; 4096];
    let mut frames = Vec::new();
    while !stdout_of(&frames).ends_with(b"ready\n") {
        let n = out.read(&mut chunk).unwrap();
        assert!(n > 0);
        s.buf.extend_from_slice(&chunk[..n]);
        frames.extend(decode(&mut s.buf));
    }
    let sup = children_of(s.child.id())[0];
    // SAFETY: kill(2) on the supervisor (PID 1 of the test's namespace).
    unsafe { libc::kill(sup as i32, libc::SIGTERM) };
    frames.extend(s.until_last());
    assert_eq!(exit_of(&frames).status, Status::Exited(7), "{frames:?}");
    assert!(stdout_of(&frames).ends_with(b"ready\nterm\n"));
    wait_for("the setsid'd process gone", || {
        Command::new("pgrep")
            .args(["-u", "65534", "-f", "trap \"exit 0\" TERM"])
            .output()
            .is_ok_and(|o| o.stdout.is_empty())
    });
}

#[test]
fn an_unprivileged_supervisor_runs_as_itself() {
    // The supervisor itself is nobody: no uid switch is possible or needed, the groups are
    // already only its gid, and root cannot be regained.
    if !is_root() {
        // Already unprivileged: run as we are.
        let (uid, gid) = (
            // SAFETY: getuid/getgid have no preconditions.
            unsafe { libc::getuid() }.to_string(),
            // SAFETY: as above.
            unsafe { libc::getgid() }.to_string(),
        );
        let mut s = Sup::start(&[&uid, &gid, "/tmp"], false, false);
        s.send(&encode(&request(&["/usr/bin/id", "-u"], None), None));
        let f = s.until_last();
        assert_eq!(stdout_of(&f), format!("{uid}\n").into_bytes(), "{f:?}");
        return;
    }
    let id = NOBODY.to_string();
    let mut s = Sup::start(&[&id, &id, "/tmp"], false, true);
    s.send(&encode(&request(&["/usr/bin/id"], None), None));
    let f = s.until_last();
    assert_eq!(
        String::from_utf8(stdout_of(&f)).unwrap(),
        "uid=65534(nobody) gid=65534(nogroup) groups=65534(nogroup)\n",
        "{f:?}"
    );
    // Asked for another identity, it cannot switch and says so before anything runs.
    let mut s = Sup::start(&["1000", "1000", "/tmp"], false, true);
    s.send(&encode(&request(&["/usr/bin/id"], None), None));
    let f = s.until_last();
    assert!(
        matches!(f.last(), Some(F::Failed(m)) if m == "cannot run as 1000:1000: setgid(1000): Operation not permitted"),
        "{f:?}"
    );
}

#[test]
fn the_address_space_limit_applies_to_the_command() {
    need_root();
    let id = NOBODY.to_string();
    let mut s = Sup::start(&[&id, &id, "/tmp", "once", "123456789"], false, false);
    s.send(&encode(
        &request(&["/bin/sh", "-c", "ulimit -v"], None),
        None,
    ));
    let f = s.until_last();
    assert_eq!(
        stdout_of(&f),
        format!("{}\n", 123456789 / 1024).into_bytes()
    );
}

/// A stand-in for the daemon's proxy on a unix socket: reads a connection to its end, then
/// answers "<bytes read> " followed by `reply_len` bytes of 'z', and closes.
fn socket_server(path: &Path, reply_len: usize) -> std::sync::mpsc::Receiver<usize> {
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The command: connect to 127.0.0.1:PORT, send SEND bytes, half-close, print what came back as
/// "<first word> <length of the rest>".
const CLIENT: &str = r#"import socket, sys
port, send = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"a" * send)
s.shutdown(socket.SHUT_WR)
data = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    data += b
n, _, rest = data.partition(b" ")
print(n.decode(), len(rest))
"#;

#[test]
fn the_egress_relay_carries_both_directions_and_half_closes() {
    need_root();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("proxy.sock");
    let served = socket_server(&socket, 3 << 20);
    let port = free_port();
    let argv = [
        "/usr/bin/python3",
        "-c",
        CLIENT,
        &port.to_string(),
        "300000",
    ];
    let mut s = Sup::once("/tmp");
    s.send(&encode(
        &RunHeader {
            relay_port: port,
            relay_socket: socket.to_string_lossy().into_owned(),
            ..request(&argv, None)
        },
        None,
    ));
    let f = s.until_last();
    assert_eq!(exit_of(&f).status, Status::Exited(0), "{f:?}");
    // 300 000 bytes up, 3 MiB down, through 64 KiB buffers, each EOF passed on.
    assert_eq!(
        String::from_utf8(stdout_of(&f)).unwrap(),
        format!("300000 {}\n", 3 << 20)
    );
    s.close();
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
    need_root();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let argv = ["/usr/bin/touch", marker.to_str().unwrap()];
    let mut s = Sup::once("/tmp");
    s.send(&encode(
        &RunHeader {
            relay_port: free_port(),
            relay_socket: dir
                .path()
                .join("missing.sock")
                .to_string_lossy()
                .into_owned(),
            ..request(&argv, None)
        },
        None,
    ));
    let f = s.until_last();
    assert!(
        matches!(f.last(), Some(F::Unavailable(m)) if m.contains("cannot reach the daemon's proxy")),
        "{f:?}"
    );
    assert!(!marker.exists(), "the command never started");
}

fn file(s: &mut Sup, op: FileOp, path: &str, n: u64, data: &[u8]) -> (Vec<u8>, String) {
    let h = FileHeader {
        op,
        path: path.into(),
        n,
    };
    s.send(&h.encode(data).unwrap());
    let f = s.until_last();
    let Some(F::Result(verdict)) = f.last().cloned() else {
        panic!("no verdict: {f:?}")
    };
    (stdout_of(&f), verdict)
}

/// A kept supervisor, PID 1 of its own pid namespace, serving `workdir` as nobody.
fn kept(workdir: &Path) -> Sup {
    let id = NOBODY.to_string();
    Sup::start(
        &[&id, &id, workdir.to_str().unwrap(), "kept", "0"],
        true,
        false,
    )
}

fn workspace() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ws = tempfile::tempdir_in(dir.path()).unwrap();
    std::os::unix::fs::chown(ws.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    std::mem::forget(dir);
    ws
}

#[test]
fn a_kept_supervisor_runs_execs_one_after_another_and_nothing_of_one_outlives_it() {
    need_root();
    let ws = workspace();
    let mut s = kept(ws.path());
    // A background process of the first exec is killed before its report.
    s.send(&encode(
        &request(&["/bin/sh", "-c", "sleep 60 & echo $!"], None),
        None,
    ));
    let f = s.until_last();
    let report = exit_of(&f);
    assert_eq!(report.status, Status::Exited(0));
    assert_eq!(
        report.peak_memory_kib, None,
        "a kept sandbox reports no peak"
    );
    let left = String::from_utf8(stdout_of(&f)).unwrap();
    let out = {
        s.send(&encode(
            &request(
                &[
                    "/bin/sh",
                    "-c",
                    &format!(
                        "kill -0 {} 2>/dev/null && echo alive || echo gone; echo $$",
                        left.trim()
                    ),
                ],
                None,
            ),
            None,
        ));
        s.until_last()
    };
    assert_eq!(exit_of(&out).status, Status::Exited(0));
    assert!(
        String::from_utf8(stdout_of(&out))
            .unwrap()
            .starts_with("gone\n"),
        "{out:?}"
    );
    // The workspace stays usable whatever an exec did to its mode.
    s.send(&encode(
        &request(&["/bin/chmod", "0", ws.path().to_str().unwrap()], None),
        None,
    ));
    assert_eq!(exit_of(&s.until_last()).status, Status::Exited(0));
    s.send(&encode(&request(&["/bin/ls"], None), None));
    assert_eq!(exit_of(&s.until_last()).status, Status::Exited(0));
    // A kill of the exec (SIGUSR1 to the supervisor) leaves the supervisor serving.
    s.send(&encode(
        &request(&["/bin/sh", "-c", "echo up; sleep 60"], None),
        None,
    ));
    let out = s.child.stdout.as_mut().unwrap();
    let mut chunk = [0u8; 4096];
    let mut frames = Vec::new();
    while stdout_of(&frames).is_empty() {
        let n = out.read(&mut chunk).unwrap();
        assert!(n > 0);
        s.buf.extend_from_slice(&chunk[..n]);
        frames.extend(decode(&mut s.buf));
    }
    let sup_pid = children_of(s.child.id())[0];
    // SAFETY: kill(2) on the supervisor (PID 1 of the test's namespace).
    unsafe { libc::kill(sup_pid as i32, libc::SIGUSR1) };
    frames.extend(s.until_last());
    assert_eq!(
        exit_of(&frames).status,
        Status::Signaled(libc::SIGKILL),
        "{frames:?}"
    );
    s.send(&encode(&request(&["/bin/echo", "next"], None), None));
    assert_eq!(stdout_of(&s.until_last()), b"next\n");
    // A past-deadline exec is killed and reported as such, and the supervisor serves on.
    s.send(&encode(
        &RunHeader {
            timeout_ms: 1,
            ..request(&["/bin/sleep", "60"], None)
        },
        None,
    ));
    assert!(matches!(s.until_last().last(), Some(F::Deadline(_))));
    s.send(&encode(&request(&["/bin/echo", "still"], None), None));
    assert_eq!(stdout_of(&s.until_last()), b"still\n");
    assert!(s.close().success());
}

#[test]
fn a_kept_supervisor_refuses_to_run_outside_a_pid_namespace_of_its_own() {
    need_root();
    let ws = workspace();
    let id = NOBODY.to_string();
    let mut s = Sup::start(
        &[&id, &id, ws.path().to_str().unwrap(), "kept"],
        false,
        false,
    );
    assert_eq!(
        s.until_last(),
        [F::Failed(
            "a kept sandbox's supervisor must be PID 1 of its own pid namespace".into()
        )]
    );
}

#[test]
fn kept_file_calls_work_as_the_user_and_never_follow_a_symlink() {
    need_root();
    let ws = workspace();
    let mut s = kept(ws.path());
    assert_eq!(
        file(&mut s, FileOp::Put, "a/b/c.txt", 5, b"hello"),
        (vec![], "ok".into())
    );
    let made = ws.path().join("a/b/c.txt");
    assert_eq!(std::fs::read(&made).unwrap(), b"hello");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(&made).unwrap().uid(),
        NOBODY,
        "written as the user"
    );
    assert_eq!(
        file(&mut s, FileOp::Get, "a/b/c.txt", 100, b""),
        (b"hello".to_vec(), "ok".into())
    );
    assert_eq!(
        file(&mut s, FileOp::Get, "a/b/c.txt", 3, b""),
        (vec![], "err toolarge 5 too large".into())
    );
    assert_eq!(
        file(&mut s, FileOp::List, "a/b", 0, b""),
        (b"f 5 c.txt\0".to_vec(), "ok".into())
    );
    assert_eq!(file(&mut s, FileOp::Dir, "a", 0, b"").1, "ok");
    assert!(
        file(&mut s, FileOp::Dir, "a/b/c.txt", 0, b"")
            .1
            .starts_with("err notfile 0 ")
    );
    assert!(
        file(&mut s, FileOp::Get, "nothing", 10, b"")
            .1
            .starts_with("err notfound 0 ")
    );
    assert_eq!(
        file(&mut s, FileOp::Get, "a/../x", 10, b"").1,
        "err invalid 0 bad path"
    );
    // A symlink the command planted, to a root-only file and out of the workspace: never
    // followed, neither as a directory nor as the file.
    std::os::unix::fs::symlink("/etc", ws.path().join("etc")).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", ws.path().join("shadow")).unwrap();
    assert!(
        file(&mut s, FileOp::Get, "etc/passwd", 1 << 20, b"")
            .1
            .starts_with("err notfile 0 ")
    );
    assert!(
        file(&mut s, FileOp::Get, "shadow", 1 << 20, b"")
            .1
            .starts_with("err notfile 0 ")
    );
    assert!(
        file(&mut s, FileOp::Put, "shadow", 1, b"x")
            .1
            .starts_with("err notfile 0 ")
    );
    let listed = file(&mut s, FileOp::List, "", 0, b"").0;
    // "T SIZE NAME" records; a directory's size depends on the file system.
    let mut names: Vec<String> = listed
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let e = String::from_utf8_lossy(e).into_owned();
            let mut it = e.splitn(3, ' ');
            let (t, size, name) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
            if t == "l" {
                format!("{t} {size} {name}")
            } else {
                format!("{t} {name}")
            }
        })
        .collect();
    names.sort();
    assert_eq!(names, ["d a", "l 11 shadow", "l 4 etc"]);
    // Exec code: refused outside the code directory.
    let h = RunHeader {
        code_path: "/tmp/code".into(),
        code_len: Some(1),
        ..request(&["/bin/true"], None)
    };
    s.send(&h.encode(b"", b"x").unwrap());
    assert_eq!(
        s.until_last(),
        [F::Failed(
            "code path /tmp/code is not a file of /run/session".into()
        )]
    );
    assert!(s.close().success());
}

/// The host pid of the kept supervisor `s` (PID 1 of its namespace).
fn pid1(s: &Sup) -> u32 {
    let mut found = Vec::new();
    wait_for("the supervisor's process", || {
        found = children_of(s.child.id());
        !found.is_empty()
    });
    found[0]
}

/// `argv` run in the pid and mount namespaces of the kept supervisor `pid1` (its /proc), as a
/// process the container's engine starts there (a docker exec).
fn inside(pid1: u32, argv: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.args(["--target", &pid1.to_string(), "--pid", "--mount", "--"])
        .args(argv);
    c
}

/// Whether the host process `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    let state = status_line(pid, "State:");
    !state.is_empty() && !state.starts_with('Z')
}

impl Sup {
    /// A spawn-mode supervisor in the namespaces of the kept supervisor `pid1`.
    fn spawn_in(pid1: u32, workdir: &Path) -> Sup {
        let id = NOBODY.to_string();
        let mut cmd = inside(
            pid1,
            &[
                SUPERVISOR,
                &id,
                &id,
                workdir.to_str().unwrap(),
                "spawn",
                "0",
            ],
        );
        cmd.env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn supervisor");
        let stdin = child.stdin.take();
        Sup {
            child,
            stdin,
            buf: Vec::new(),
        }
    }

    /// Frames until the stdout seen so far (in `frames` too) contains `want`.
    fn until_out(&mut self, frames: &mut Vec<F>, want: &str) {
        let out = self.child.stdout.as_mut().unwrap();
        let mut chunk = [0u8; 65536];
        while !String::from_utf8_lossy(&stdout_of(frames)).contains(want) {
            let n = out.read(&mut chunk).unwrap();
            assert!(n > 0, "the stream ended before {want:?}: {frames:?}");
            self.buf.extend_from_slice(&chunk[..n]);
            frames.extend(decode(&mut self.buf));
        }
    }
}

#[test]
fn a_kept_exec_ends_its_own_processes_only() {
    need_root();
    let ws = workspace();
    let mut s = kept(ws.path());
    let init = pid1(&s);
    // A process of the same uid in the container that no exec of this supervisor started (as a
    // background run's would be).
    let mut other = inside(
        init,
        &[
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "/bin/sleep",
            "60",
        ],
    )
    .spawn()
    .unwrap();
    let mut sleeper = Vec::new();
    wait_for("the other process", || {
        sleeper = children_of(other.id());
        sleeper.first().is_some_and(|p| alive(*p))
    });
    s.send(&encode(
        &request(&["/bin/sh", "-c", "setsid sleep 60 & echo $!"], None),
        None,
    ));
    let f = s.until_last();
    assert_eq!(exit_of(&f).status, Status::Exited(0));
    let left = String::from_utf8(stdout_of(&f)).unwrap();
    s.send(&encode(
        &request(
            &[
                "/bin/sh",
                "-c",
                &format!(
                    "kill -0 {} 2>/dev/null && echo alive || echo gone",
                    left.trim()
                ),
            ],
            None,
        ),
        None,
    ));
    assert_eq!(stdout_of(&s.until_last()), b"gone\n", "the exec's leftover");
    assert!(alive(sleeper[0]), "another run's process was killed");
    let _ = other.kill();
    let _ = other.wait();
    // Controls the daemon sent as the exec ended are dropped; the next request is served.
    {
        use executor_arm_supervisor::protocol::ControlFrame;
        s.send(&ControlFrame::Stdin(b"late".to_vec()).encode());
        s.send(&ControlFrame::Signal(libc::SIGTERM).encode());
        s.send(&encode(&request(&["/bin/echo", "after"], None), None));
        assert_eq!(stdout_of(&s.until_last()), b"after\n");
    }
    // An orphan PID 1 inherits between requests is reaped while it waits for the next one.
    let status = inside(init, &["/bin/sh", "-c", "sleep 0.2 & exit 0"])
        .status()
        .unwrap();
    assert!(status.success());
    wait_for("PID 1 to reap the orphan", || children_of(init).is_empty());
    assert!(s.close().success());
}

#[test]
fn a_spawned_run_streams_stdin_takes_signals_and_leaves_nothing_behind() {
    use executor_arm_supervisor::protocol::ControlFrame;
    need_root();
    let ws = workspace();
    let mut s = kept(ws.path());
    let init = pid1(&s);
    let streamed = |argv: &[&str]| RunHeader {
        stdin_stream: true,
        ..request(argv, None)
    };
    // Stdin streamed while a foreground exec comes and goes; the run's double-forked leftover
    // dies with it.
    let mut bg = Sup::spawn_in(init, ws.path());
    bg.send(&encode(
        &streamed(&["/bin/sh", "-c", "setsid sleep 60 & echo left $!; exec cat"]),
        None,
    ));
    let mut frames = Vec::new();
    bg.until_out(&mut frames, "\n");
    let left = String::from_utf8(stdout_of(&frames)).unwrap();
    let left = left.trim().strip_prefix("left ").unwrap().to_string();
    bg.send(&ControlFrame::Stdin(b"hello\n".to_vec()).encode());
    bg.until_out(&mut frames, "hello\n");
    s.send(&encode(
        &request(&["/bin/sh", "-c", "sleep 60 & echo fg"], None),
        None,
    ));
    assert_eq!(stdout_of(&s.until_last()), b"fg\n");
    bg.send(&ControlFrame::Stdin(b"again\n".to_vec()).encode());
    bg.until_out(&mut frames, "again\n");
    bg.send(&ControlFrame::CloseStdin.encode());
    frames.extend(bg.until_last());
    assert_eq!(exit_of(&frames).status, Status::Exited(0), "{frames:?}");
    assert!(bg.close().success());
    s.send(&encode(
        &request(
            &[
                "/bin/sh",
                "-c",
                &format!("kill -0 {left} 2>/dev/null && echo alive || echo gone"),
            ],
            None,
        ),
        None,
    ));
    assert_eq!(stdout_of(&s.until_last()), b"gone\n", "the run's leftover");

    // A signal goes to the command's process; only the offered ones are taken. The command is
    // not a shell that execs: `sh -c` catches SIGINT until its exec, so a SIGINT arriving just
    // before the exec would be taken by the shell's handler and lost. Python has its own handler
    // in place before it prints, and dies by SIGINT when its KeyboardInterrupt goes unhandled.
    let mut bg = Sup::spawn_in(init, ws.path());
    bg.send(&encode(
        &streamed(&[
            "/usr/bin/python3",
            "-c",
            "import time; print('up', flush=True); time.sleep(60)",
        ]),
        None,
    ));
    let mut frames = Vec::new();
    bg.until_out(&mut frames, "up\n");
    bg.send(&ControlFrame::Signal(libc::SIGSTOP).encode());
    bg.send(&ControlFrame::Signal(libc::SIGINT).encode());
    frames.extend(bg.until_last());
    assert_eq!(exit_of(&frames).status, Status::Signaled(libc::SIGINT));
    assert!(bg.close().success());

    // KILL ends every process of the run, and the daemon going away ends the run.
    for kill in [true, false] {
        let mut bg = Sup::spawn_in(init, ws.path());
        bg.send(&encode(
            &streamed(&["/bin/sh", "-c", "setsid sleep 60 & echo $!; sleep 60"]),
            None,
        ));
        let mut frames = Vec::new();
        bg.until_out(&mut frames, "\n");
        let left = String::from_utf8(stdout_of(&frames)).unwrap();
        if kill {
            bg.send(&ControlFrame::Signal(libc::SIGKILL).encode());
            frames.extend(bg.until_last());
            assert_eq!(exit_of(&frames).status, Status::Signaled(libc::SIGKILL));
        }
        assert!(bg.close().success());
        s.send(&encode(
            &request(
                &[
                    "/bin/sh",
                    "-c",
                    &format!(
                        "kill -0 {} 2>/dev/null && echo alive || echo gone",
                        left.trim()
                    ),
                ],
                None,
            ),
            None,
        ));
        assert_eq!(stdout_of(&s.until_last()), b"gone\n", "kill: {kill}");
    }
    assert!(s.close().success());
}

/// Connect mode: one byte says it connected, then stdin goes to the port and the port's bytes
/// come out on stdout until both ended; a closed port is a line on stderr and status 1.
#[test]
fn connect_mode_splices_stdio_with_the_port_or_refuses() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let id = NOBODY.to_string();
    let mut child = Command::new(SUPERVISOR)
        .args([&id, &id, "/tmp", "connect", &port])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut conn, _) = listener.accept().unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    out.read_exact(&mut first).unwrap();
    assert_eq!(first[0], executor_arm_supervisor::protocol::PORT_CONNECTED);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"ping").unwrap();
    drop(stdin);
    let mut got = Vec::new();
    conn.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"ping", "stdin reached the port, and its end too");
    conn.write_all(b"pong").unwrap();
    drop(conn);
    let mut back = Vec::new();
    out.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"pong");
    assert!(child.wait().unwrap().success());

    drop(listener);
    let out = Command::new(SUPERVISOR)
        .args([&id, &id, "/tmp", "connect", &port])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "{:?}", out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("connect 127.0.0.1:{port}")), "{err}");
}

/// The command gets every signal's default disposition and an empty signal mask, whatever the
/// supervisor inherited: a supervisor started with SIGINT and SIGQUIT ignored (as a shell's
/// background job is) or a signal blocked must not pass that on, or the caller's INT would never
/// reach the command.
#[test]
fn the_command_inherits_no_ignored_or_blocked_signal() {
    need_root();
    let id = NOBODY.to_string();
    let mut cmd = Command::new(SUPERVISOR);
    cmd.args([id.as_str(), id.as_str(), "/tmp"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // SAFETY: the closure runs in the forked child before exec and calls only signal(2),
    // sigemptyset(3), sigaddset(3) and sigprocmask(2) on a stack value, all async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            libc::signal(libc::SIGQUIT, libc::SIG_IGN);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("supervisor");
    let stdin = child.stdin.take();
    let mut s = Sup {
        child,
        stdin,
        buf: Vec::new(),
    };
    s.send(&encode(
        &request(
            &["/bin/grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"],
            None,
        ),
        None,
    ));
    let f = s.until_last();
    s.close();
    let out = String::from_utf8(stdout_of(&f)).unwrap();
    // The standard signals, 1 to 31: the bits of the masks below 0x80000000.
    let standard = |field: &str| {
        let line = out
            .lines()
            .find(|l| l.starts_with(field))
            .unwrap_or_else(|| panic!("no {field} in {out}"));
        u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap() & 0x7fff_ffff
    };
    assert_eq!(standard("SigIgn:"), 0, "{out}");
    assert_eq!(standard("SigBlk:"), 0, "{out}");
}
