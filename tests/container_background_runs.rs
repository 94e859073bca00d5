//! A session's background runs in its kept container, at the sandbox level (the docker backend
//! over the real engine, on runc and on gVisor): they run beside the session's foreground execs
//! (whose end never kills them), take stdin and signals through their controls, send their
//! output through the output tap, leave nothing behind when they end, and end with the
//! container.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::docker::{IMAGE, SOCKET, one_at_a_time, require_docker, supervisor};
use executor_arm::sandbox::control::{Control, ControlSender, Controls, ProcessSignal};
use executor_arm::sandbox::docker::{DockerConfig, DockerSandbox};
use executor_arm::sandbox::files::Kept;
use executor_arm::sandbox::uids::UidRange;
use executor_arm::sandbox::{
    BackendKind, ExitKind, FsRules, KilledReason, Limits, NetworkPolicy, OnOverflow, OutputTap,
    RunOutcome, RunSpec, Sandbox, SandboxError, Stop,
};
use tokio::task::JoinHandle;

/// The bound of every wait here; nothing is asserted about how long anything takes.
const BOUND: Duration = Duration::from_secs(60);

fn spec(argv: &[&str]) -> RunSpec {
    RunSpec {
        exec_id: format!("bg-test-{}", std::process::id()),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        stdin: None,
        env: BTreeMap::from([("PATH".to_string(), "/usr/bin:/bin".to_string())]),
        limits: Limits {
            cpus: 1.0,
            memory_bytes: 512 << 20,
            disk_bytes: 100 << 20,
            timeout: Duration::from_secs(120),
            pids: 128,
            output_bytes: 1 << 20,
            on_overflow: OnOverflow::Truncate,
            nofile: 256,
        },
        network: NetworkPolicy::None,
        fs: FsRules {
            read_only: vec![],
            extra_files: vec![],
            workdir: PathBuf::from("/work"),
            workspace: None,
            cwd: None,
            pty: false,
        },
        uid: 65534,
        gid: 65534,
        landlock_abi: 0,
        image: Some(IMAGE.to_string()),
        profile: "background-test".into(),
        group: None,
        stop: None,
        output_tap: None,
        kept: None,
        code: None,
        controls: None,
        background: false,
        reuse_scope: None,
    }
}

fn backend(kind: BackendKind, egress_dir: &std::path::Path) -> Arc<DockerSandbox> {
    let config = DockerConfig {
        socket: format!("unix://{SOCKET}"),
        image: IMAGE.to_string(),
        pool_size: 0,
        pool_reuse: false,
        pool_max_uses: 32,
        pool_max_age_seconds: 300,
        egress_dir: egress_dir.to_path_buf(),
        supervisor: Some(PathBuf::from(supervisor())),
    };
    // The host's shared uid block and its leases, as every daemon of this machine uses them.
    let uids = UidRange::new(
        200_000,
        65_536,
        std::path::Path::new("/run/executor-arm/uids"),
    )
    .expect("uid range");
    Arc::new(DockerSandbox::new(
        kind,
        &config,
        &format!("bgtest-{}-{}", kind.as_str(), std::process::id()),
        None,
        None,
        Arc::new(uids),
    ))
}

/// A live run of `argv` in `kept` (a background one unless said otherwise), with controls, a
/// stop, and its output gathered by the tap.
struct Background {
    controls: ControlSender,
    stop: tokio::sync::watch::Sender<Option<Stop>>,
    output: Arc<Mutex<Vec<u8>>>,
    run: JoinHandle<Result<RunOutcome, SandboxError>>,
}

impl Background {
    fn start(sb: &Arc<DockerSandbox>, kept: &Arc<dyn Kept>, argv: &[&str]) -> Background {
        Background::start_with(sb, kept, spec(argv), true)
    }

    fn start_with(
        sb: &Arc<DockerSandbox>,
        kept: &Arc<dyn Kept>,
        mut s: RunSpec,
        background: bool,
    ) -> Background {
        let (tx, controls) = Controls::channel();
        let (stop, stop_rx) = tokio::sync::watch::channel(None);
        let output = Arc::new(Mutex::new(Vec::new()));
        let seen = output.clone();
        s.kept = Some(kept.clone());
        s.background = background;
        s.stop = Some(stop_rx);
        s.controls = Some(controls);
        s.output_tap = Some(OutputTap::new(move |_, chunk| {
            seen.lock().unwrap().extend_from_slice(chunk)
        }));
        let sb = sb.clone();
        Background {
            controls: tx,
            stop,
            output,
            run: tokio::spawn(async move { sb.run(s).await }),
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Waits (bounded) until the output contains `want`.
    async fn wait_for(&self, want: &str) {
        let deadline = tokio::time::Instant::now() + BOUND;
        while !self.text().contains(want) {
            assert!(
                !self.run.is_finished(),
                "the run ended before {want:?}: {}",
                self.text()
            );
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {want:?} within {BOUND:?}: {}",
                self.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn send(&self, c: Control) {
        self.controls.send(c).await.expect("the run takes controls");
    }

    async fn outcome(self) -> RunOutcome {
        tokio::time::timeout(BOUND, self.run)
            .await
            .expect("the run ends")
            .expect("the run's task")
            .expect("the run's outcome")
    }
}

/// A foreground exec of the session.
async fn foreground(sb: &DockerSandbox, kept: &Arc<dyn Kept>, script: &str) -> RunOutcome {
    let mut s = spec(&["/bin/sh", "-c", script]);
    s.kept = Some(kept.clone());
    tokio::time::timeout(BOUND, sb.run(s))
        .await
        .expect("the exec ends")
        .expect("the exec's outcome")
}

fn stdout(o: &RunOutcome) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Whether process `pid` of the container is alive (not a zombie), seen from a foreground exec.
async fn alive(sb: &DockerSandbox, kept: &Arc<dyn Kept>, pid: &str) -> bool {
    let o = foreground(
        sb,
        kept,
        &format!(
            "grep -q '^State:.[^Z]' /proc/{pid}/status 2>/dev/null && echo alive || echo gone"
        ),
    )
    .await;
    match stdout(&o).as_str() {
        "alive\n" => true,
        "gone\n" => false,
        other => panic!("unexpected answer {other:?}: {o:?}"),
    }
}

async fn background_runs_on(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let sb = backend(kind, dir.path());
    let kept = sb
        .keep(
            &spec(&["/bin/true"]),
            &format!("bg-{}", kind.as_str()),
            false,
        )
        .await
        .expect("a kept container")
        .expect("the backend keeps one");

    // Stdin streamed through the controls, output through the tap, while foreground execs come
    // and go (their end does not kill it).
    let echo = Background::start(
        &sb,
        &kept,
        &[
            "/usr/bin/python3",
            "-c",
            "import sys\nprint('ready', flush=True)\nfor l in sys.stdin:\n    print('got', l.strip(), flush=True)\nprint('eof', flush=True)",
        ],
    );
    echo.wait_for("ready\n").await;
    echo.send(Control::Stdin(b"one\n".to_vec())).await;
    echo.wait_for("got one\n").await;
    let fg = foreground(&sb, &kept, "sleep 300 & echo fg $!").await;
    assert_eq!(fg.exit, ExitKind::Exited(0), "{fg:?}");
    let fg_left = stdout(&fg).trim().strip_prefix("fg ").unwrap().to_string();
    echo.send(Control::Stdin(b"two\n".to_vec())).await;
    echo.wait_for("got two\n").await;
    assert!(
        !alive(&sb, &kept, &fg_left).await,
        "a foreground exec's leftover outlived it"
    );
    echo.send(Control::CloseStdin).await;
    let o = echo.outcome().await;
    assert_eq!(o.exit, ExitKind::Exited(0), "{o:?}");
    assert!(stdout(&o).ends_with("got two\neof\n"), "{o:?}");

    // A signal reaches the command; its double-forked leftover dies with the run. The command
    // is python, not a shell that execs: `sh -c` catches SIGINT until its exec, so a SIGINT
    // landing just before the exec would be lost to the shell's handler.
    let sig = Background::start(
        &sb,
        &kept,
        &[
            "/usr/bin/python3",
            "-c",
            "import subprocess, time\n\
             p = subprocess.Popen(['setsid', 'sleep', '300'])\n\
             print('left', p.pid, flush=True)\n\
             time.sleep(300)",
        ],
    );
    sig.wait_for("\n").await;
    let left = sig.text().trim().strip_prefix("left ").unwrap().to_string();
    assert!(alive(&sb, &kept, &left).await);
    sig.send(Control::Signal(ProcessSignal::Int)).await;
    let o = sig.outcome().await;
    assert_eq!(o.exit, ExitKind::Signaled(libc::SIGINT), "{o:?}");
    assert!(
        !alive(&sb, &kept, &left).await,
        "the run's leftover outlived it"
    );

    // KILL ends every process of the run.
    let kill = Background::start(
        &sb,
        &kept,
        &[
            "/bin/sh",
            "-c",
            "setsid sleep 300 & echo left $!; sleep 300",
        ],
    );
    kill.wait_for("\n").await;
    let left = kill
        .text()
        .trim()
        .strip_prefix("left ")
        .unwrap()
        .to_string();
    kill.send(Control::Signal(ProcessSignal::Kill)).await;
    let o = kill.outcome().await;
    assert_eq!(o.exit, ExitKind::Signaled(libc::SIGKILL), "{o:?}");
    assert!(!alive(&sb, &kept, &left).await);

    // Orphans of background runs are reaped: no zombie is left in the container.
    let orphans = Background::start(
        &sb,
        &kept,
        &[
            "/bin/sh",
            "-c",
            "for i in 1 2 3 4 5 6 7 8; do (sleep 0.1 &); done; sleep 1; echo done",
        ],
    );
    let o = orphans.outcome().await;
    assert_eq!(o.exit, ExitKind::Exited(0), "{o:?}");
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let o = foreground(
            &sb,
            &kept,
            "grep -l '^State:.Z' /proc/[0-9]*/status 2>/dev/null | wc -l",
        )
        .await;
        if stdout(&o).trim() == "0" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "zombies stay: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A foreground exec takes controls too.
    let fg = Background::start_with(
        &sb,
        &kept,
        spec(&["/bin/sh", "-c", "echo ready; read a; echo got $a; exec cat"]),
        false,
    );
    fg.wait_for("ready\n").await;
    fg.send(Control::Stdin(b"first\n".to_vec())).await;
    fg.wait_for("got first\n").await;
    fg.send(Control::Stdin(b"rest".to_vec())).await;
    fg.send(Control::CloseStdin).await;
    let o = fg.outcome().await;
    assert_eq!(
        (o.exit, stdout(&o).as_str()),
        (ExitKind::Exited(0), "ready\ngot first\nrest"),
        "{o:?}"
    );

    // A stop: TERM to the command, which may end in its grace; then one without a grace.
    let term = Background::start(
        &sb,
        &kept,
        &[
            "/bin/sh",
            "-c",
            "trap 'echo term; exit 3' TERM; echo up; while :; do sleep 0.1; done",
        ],
    );
    term.wait_for("up\n").await;
    let grace = Stop {
        reason: KilledReason::Cancelled,
        grace: Duration::from_secs(30),
    };
    term.stop.send(Some(grace)).unwrap();
    let o = term.outcome().await;
    assert_eq!(o.exit, ExitKind::Exited(3), "{o:?}");
    assert_eq!(o.killed_reason, Some(KilledReason::Cancelled));
    assert!(stdout(&o).ends_with("term\n"), "{o:?}");
    let now = Background::start(&sb, &kept, &["/bin/sh", "-c", "echo up; exec sleep 300"]);
    now.wait_for("up\n").await;
    let at_once = Stop {
        reason: KilledReason::Cancelled,
        grace: Duration::ZERO,
    };
    now.stop.send(Some(at_once)).unwrap();
    let o = now.outcome().await;
    assert_eq!(o.killed_reason, Some(KilledReason::Cancelled), "{o:?}");
    assert_ne!(o.exit, ExitKind::Exited(0), "{o:?}");

    // The run's timeout.
    let mut late = spec(&["/bin/sleep", "300"]);
    late.limits.timeout = Duration::from_secs(2);
    let o = Background::start_with(&sb, &kept, late, true)
        .outcome()
        .await;
    assert_eq!(o.killed_reason, Some(KilledReason::Timeout), "{o:?}");

    // The session's execs still run.
    let fg = foreground(&sb, &kept, "echo still").await;
    assert_eq!(stdout(&fg), "still\n");

    // Closing the session's container ends its background run with it.
    let last = Background::start(&sb, &kept, &["/bin/sh", "-c", "echo up; exec sleep 300"]);
    last.wait_for("up\n").await;
    kept.close().await;
    let o = last.outcome().await;
    assert_ne!(o.exit, ExitKind::Exited(0), "{o:?}");
    sb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_runs_live_beside_foreground_execs_on_runc() {
    require_docker("background_runs_live_beside_foreground_execs_on_runc");
    let _one = one_at_a_time().await;
    background_runs_on(BackendKind::Docker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_runs_live_beside_foreground_execs_on_gvisor() {
    require_docker("background_runs_live_beside_foreground_execs_on_gvisor");
    let _one = one_at_a_time().await;
    background_runs_on(BackendKind::Gvisor).await;
}
