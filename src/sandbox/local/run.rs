//! The local backend's run, in order: admission (mechanisms present, a uid), the run's cgroup
//! (a prepared slot or a new one), the plan and the pipes, the start (a prepared shim's go
//! message or a new shim) and the egress proxy, the wait that the shared skeleton
//! ([`crate::sandbox::run`]) decides, the kill of everything left, the outcome, and the cgroup's
//! retirement (on the reaper's thread when there is one).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe as upipe;

use super::guard::CgroupGuard;
use super::plan::{self, PlanFds};
use super::slots::{RefillOnDrop, send_go};
use super::status::{pipe, read_pid, read_status, setup_error, setup_failure, status_pipe};
use super::{LocalSandbox, cgroup, child, egress, landlock, reaper};
use crate::sandbox::capture::OutputCapture;
use crate::sandbox::control::{Control, ControlReceiver, Input, ProcessSignal};
use crate::sandbox::run::{self as skeleton, Ending, Waited};
use crate::sandbox::{ExitKind, RunOutcome, RunSpec, SandboxError};

/// Bytes a run's controls may queue for its stdin while the command does not read; past them no
/// control is taken until it does (a caller's sender then waits).
const STDIN_QUEUE_BYTES: usize = 4 << 20;

/// How long a background run's network namespace is looked for after its start.
const NETNS_WAIT: Duration = Duration::from_secs(10);

/// Aborts its task when dropped (the run ended before its namespace was found).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Publishes in `slot` the network namespace of a process of the run whose `cgroup.procs` is
/// `procs`, and brings up its loopback: a pid read there is re-read after its namespace is
/// opened, so the namespace is the sandbox's even if the pid was recycled meanwhile.
async fn publish_netns(procs: std::path::PathBuf, slot: crate::sandbox::ports::NetnsSlot) {
    let until = Instant::now() + NETNS_WAIT;
    while Instant::now() < until {
        let p = procs.clone();
        let found = tokio::task::spawn_blocking(move || {
            let pids = |p: &std::path::Path| -> Vec<u32> {
                std::fs::read_to_string(p)
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect()
            };
            for pid in pids(&p) {
                if let Ok(Some(ns)) = crate::sandbox::ports::open_netns(pid)
                    && pids(&p).contains(&pid)
                {
                    return Some(ns);
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        if let Some(ns) = found {
            let ns = Arc::new(ns);
            if let Err(e) = crate::sandbox::ports::loopback_up_in(ns.clone()).await {
                tracing::warn!(error = %e, "the sandbox's loopback could not be brought up");
            }
            slot.set(ns);
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::warn!("no process of a background run was found to publish its network namespace");
}

/// Feeds a run with controls: its initial stdin bytes, then each control as it comes, while
/// what is queued for stdin is written as the command reads it. Signals come on a queue of their
/// own, taken whatever stdin holds: neither a write nor a full stdin queue holds one back. Stdin
/// closes at [`Control::CloseStdin`] once what came before is written, or when every sender is
/// gone; signals go to the command (pid 2 of the sandbox, see [`cgroup::signal_command`]) through
/// `procs`, the run's `cgroup.procs`. Returns whether a write found the pipe closed.
async fn serve_controls(
    w: OwnedFd,
    initial: Option<Vec<u8>>,
    controls: ControlReceiver,
    procs: Option<std::path::PathBuf>,
) -> bool {
    let Ok(mut stdin) = upipe::Sender::from_owned_fd(w).map(Some) else {
        return false;
    };
    let ControlReceiver {
        mut inputs,
        mut signals,
    } = controls;
    let signal = |sig: ProcessSignal| {
        let procs = procs.clone();
        async move {
            if let Some(p) = procs {
                let n = sig.number();
                let _ = tokio::task::spawn_blocking(move || cgroup::signal_command(&p, n)).await;
            }
        }
    };
    let mut queued: Vec<u8> = initial.unwrap_or_default();
    let (mut close_after, mut open_inputs, mut open_signals, mut broken) =
        (false, true, true, false);
    loop {
        if close_after && queued.is_empty() {
            stdin = None;
        }
        if !open_inputs && (queued.is_empty() || stdin.is_none()) {
            return broken;
        }
        let writing = stdin.is_some() && !queued.is_empty();
        let taking = open_inputs && queued.len() < STDIN_QUEUE_BYTES;
        tokio::select! {
            s = signals.recv(), if open_signals => match s {
                Some(sig) => signal(sig).await,
                None => open_signals = false,
            },
            c = inputs.recv(), if taking => match c.map(Input::into_control) {
                None => {
                    open_inputs = false;
                    close_after = true;
                }
                Some(Control::Stdin(data)) if stdin.is_some() && !close_after => {
                    queued.extend_from_slice(&data);
                }
                Some(Control::Stdin(_)) => {}
                Some(Control::CloseStdin) => close_after = true,
                Some(Control::Signal(sig)) => signal(sig).await,
            },
            r = async { stdin.as_mut().expect("writing").write(&queued).await }, if writing => {
                match r {
                    Ok(n) => {
                        queued.drain(..n);
                    }
                    Err(_) => {
                        broken = true;
                        stdin = None;
                        queued.clear();
                    }
                }
            }
        }
    }
}

impl LocalSandbox {
    /// One run, start to end: refuse what the host cannot confine, lease a uid, take a prepared
    /// slot or create the cgroup, lay out the plan, start the sandbox (and its egress proxy),
    /// wait for the end or a reason to kill, collect, and retire the cgroup.
    pub(super) async fn execute(&self, mut spec: RunSpec) -> Result<RunOutcome, SandboxError> {
        // Fail closed: refuse before anything starts when a mechanism is missing.
        let missing = self.probe.local_missing(spec.landlock_abi);
        if !missing.is_empty() {
            return Err(SandboxError::Unavailable(format!(
                "local sandbox lacks {}",
                missing.join(", ")
            )));
        }
        // A host uid of the run's own, held until the run is over (its processes are gone by
        // then: pid 1's exit killed the namespace). A session's exec comes with the uid the
        // session holds for its life, which owns its workspace.
        let _uid = match spec.fs.workspace {
            Some(_) => None,
            None => {
                let uids = self.uids.clone();
                let lease = tokio::task::spawn_blocking(move || uids.lease())
                    .await
                    .map_err(|e| SandboxError::Setup(format!("uid lease task: {e}")))??;
                spec.uid = lease.uid();
                Some(lease)
            }
        };
        let egress_settings = skeleton::egress_for(&spec.network, self.egress.as_ref())?.cloned();
        let driver = self
            .cgroups
            .as_ref()
            .ok_or_else(|| SandboxError::Unavailable("cgroups".into()))?;
        let limits = spec.limits.clone();
        // A slot whose shim is gone (it could not join its cgroup) is dropped, and the run
        // prepares its cgroup on demand. A run of a group makes its cgroup under the group's:
        // a prepared one cannot move there (v1 renames within a parent only, v2 not at all).
        let slot = self
            .warm
            .as_ref()
            .filter(|_| spec.group.is_none())
            .and_then(|w| w.take())
            .filter(|s| !s.exited.is_finished());
        // Replace the slot once this run's cgroup is gone, not now: a new slot's shim joins its
        // cgroup holding the kernel's cgroup mutex for a grace period, which would stall this
        // run's own cgroup work (rename, limits, removal) behind it. Declared before the guard,
        // so it acts after the guard's removal on every path.
        let refill = RefillOnDrop(self.warm.clone());
        // The child's ends of the run's pipes, declared before the guard so that on every early
        // return the run is killed before their numbers are freed: a shim started for the run
        // copies our fd table when it is cloned, on another thread.
        let mut child_ends_slot;
        let (mut guard, warm) = match slot {
            Some(mut slot) => {
                let cg = slot.guard.get_mut();
                cg.rename(&spec.exec_id);
                cg.apply_limits(&limits)?;
                (slot.guard, Some((slot.shim, slot.go, slot.exited)))
            }
            None => {
                let driver = driver.clone();
                let (id, l) = (spec.exec_id.clone(), limits.clone());
                let grouped = spec.group.clone().zip(self.groups.clone());
                let cg = tokio::task::spawn_blocking(move || match grouped {
                    Some((key, groups)) => groups.create_run(&key, &id, &l),
                    None => driver.create(&id, &l),
                })
                .await
                .map_err(|e| SandboxError::Setup(format!("cgroup task: {e}")))??;
                (CgroupGuard::new(cg), None)
            }
        };

        let layout = plan::layout(&self.root_dir, self.probe.landlock_abi, &spec)?;
        let landlock_fd = if self.probe.landlock_abi > 0 {
            // TCP is always handled: no rule at all without egress, connect to the proxy port and
            // the raw TCP rules' ports only with it.
            let ports = egress_settings
                .as_ref()
                .map(|e| egress::connect_ports(e, &spec.network))
                .unwrap_or_default();
            Some(landlock::ruleset(
                self.probe.landlock_abi,
                &ports,
                &layout.host_rules,
                spec.background,
            )?)
        } else {
            None
        };
        let (status_r, status_w) = status_pipe()?;
        // With egress: the go-signal pipe (blocking: pid 1 waits on it) and the hello pipe that
        // tells us the shim's pid once its namespaces exist.
        let (sync, hello) = match &egress_settings {
            Some(_) => (Some(pipe(libc::O_CLOEXEC)?), Some(pipe(libc::O_CLOEXEC)?)),
            None => (None, None),
        };
        let controls = spec.controls.as_ref().and_then(|c| c.take());
        let (stdin_child, stdin_ours) = match (&spec.stdin, &controls) {
            (Some(_), _) | (None, Some(_)) => {
                let (r, w) = pipe(libc::O_CLOEXEC)?;
                (r, Some(w))
            }
            (None, None) => (dev_null()?, None),
        };
        let (stdout_ours, stdout_child) = pipe(libc::O_CLOEXEC)?;
        let (stderr_ours, stderr_child) = pipe(libc::O_CLOEXEC)?;
        let extra_env = egress_settings
            .as_ref()
            .map(|e| crate::egress::proxy_env(e.port))
            .unwrap_or_default();
        let fds = PlanFds {
            status: status_w.as_raw_fd(),
            landlock: landlock_fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1),
            sync: sync.as_ref().map(|(r, _)| r.as_raw_fd()).unwrap_or(-1),
            hello: hello.as_ref().map(|(_, w)| w.as_raw_fd()).unwrap_or(-1),
            stdio: [
                stdin_child.as_raw_fd(),
                stdout_child.as_raw_fd(),
                stderr_child.as_raw_fd(),
            ],
        };
        let (join, stacks) = match &warm {
            Some((shim, _, _)) => (Vec::new(), shim.stacks().clone()),
            None => (guard.get().procs_files(), Arc::new(child::Stacks::new()?)),
        };
        let plan = Arc::new(plan::child_plan(
            &spec,
            layout,
            &join,
            stacks,
            fds,
            &extra_env,
            self.seccomp.as_deref(),
        )?);
        guard.keep(plan.clone());
        // The seccomp program the command installs lives in it until its execve.
        if let Some(s) = &self.seccomp {
            guard.keep(s.clone());
        }
        let (sync_r, sync_w) = sync.unzip();
        let (hello_r, hello_w) = hello.unzip();
        // The child's ends stay open until the shim is gone: the shim copies the fd table when it
        // is cloned, which happens on another thread (a prepared one gets them with its go byte).
        child_ends_slot = Some((
            status_w,
            landlock_fd,
            stdin_child,
            stdout_child,
            stderr_child,
            sync_r,
            hello_w,
        ));

        let start = Instant::now();
        let mut exited = match warm {
            Some((shim, go, exited)) => {
                shim.arm(&plan);
                send_go(&go, &plan.passed_fds)?;
                exited
            }
            None => tokio::task::spawn_blocking(move || {
                // SAFETY: the guard keeps the plan (and the stacks the children run on) alive
                // until the run's cgroup is empty.
                unsafe { plan.spawn_and_wait() }
            }),
        };
        // With egress: bind the proxy inside the sandbox's network namespace, then let the
        // command start. Dropping the pipe without the byte makes the sandbox give up.
        let egress_run = match (egress_settings, sync_w, hello_r) {
            (Some(settings), Some(sync_w), Some(hello_r)) => {
                let pid = tokio::select! {
                    pid = read_pid(hello_r) => pid.map_err(|e| {
                        SandboxError::Setup(format!("sandbox pid for egress setup: {e}"))
                    })?,
                    _ = &mut exited => {
                        return Err(setup_error(&status_r).unwrap_or_else(|| {
                            SandboxError::Setup("sandbox exited before egress setup".into())
                        }));
                    }
                };
                let run = egress::start(&settings, &spec.network, pid)
                    .map_err(|e| SandboxError::Setup(format!("egress proxy: {e}")))?;
                // SAFETY: write(2) of one byte from a static buffer to a pipe we own.
                if unsafe { libc::write(sync_w.as_raw_fd(), b"1".as_ptr().cast(), 1) } != 1 {
                    return Err(SandboxError::Setup(format!(
                        "egress go-signal: {}",
                        std::io::Error::last_os_error()
                    )));
                }
                Some(run)
            }
            _ => None,
        };

        let mut output = OutputCapture::start(
            upipe::Receiver::from_owned_fd(stdout_ours)?,
            upipe::Receiver::from_owned_fd(stderr_ours)?,
            limits.output_bytes,
            limits.on_overflow,
            spec.output_tap.clone(),
        );
        // A session's background process: its network namespace is published for the
        // session's ports proxy, from a process of its cgroup (so of its sandbox).
        let _netns_task =
            match (spec.background, &spec.controls) {
                (true, Some(c)) => guard.get().procs_files().into_iter().next().map(|procs| {
                    AbortOnDrop(tokio::spawn(publish_netns(procs, c.netns().clone())))
                }),
                _ => None,
            };
        let stdin_task = match (stdin_ours, spec.stdin.clone(), controls) {
            (Some(w), data, Some(controls)) => {
                let procs = guard.get().procs_files().into_iter().next();
                Some(tokio::spawn(serve_controls(w, data, controls, procs)))
            }
            (Some(w), Some(data), None) => Some(tokio::spawn(async move {
                let mut w = match upipe::Sender::from_owned_fd(w) {
                    Ok(w) => w,
                    Err(_) => return false,
                };
                let r = w.write_all(&data).await;
                drop(w);
                matches!(r, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
            })),
            _ => None,
        };

        let mut spawn_result = None;
        let terminate = || async {
            let cg = guard.get();
            let sent = tokio::task::block_in_place(|| cgroup::terminate_command(cg));
            tracing::debug!(exec_id = %spec.exec_id, processes = sent, "SIGTERM before the stop's grace");
        };
        let waited = skeleton::wait(
            &mut exited,
            limits.timeout,
            spec.stop.as_ref(),
            &mut output,
            terminate,
        )
        .await;
        let killed = match waited {
            Waited::Ended(r) => {
                spawn_result = Some(r);
                None
            }
            Waited::EndedOnStop(r, reason) => {
                spawn_result = Some(r);
                Some(reason)
            }
            Waited::Kill(reason) => Some(reason),
        };
        if spawn_result.is_none() {
            let cg = guard.get();
            // Kill every process of the run, setsid'd and double-forked ones included, and keep
            // at it until the shim is gone: a shim still on its way into the cgroup (a slow
            // join) is not there for the first kill.
            spawn_result = Some(loop {
                if let Err(e) = tokio::task::block_in_place(|| cg.kill_all()) {
                    tracing::error!(error = %e, "kill_all after limit");
                }
                tokio::select! {
                    r = &mut exited => break r,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            });
        }
        drop(child_ends_slot.take());
        match spawn_result {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(e))) => return Err(SandboxError::Setup(format!("clone: {e}"))),
            Some(Err(e)) => return Err(SandboxError::Setup(format!("spawning thread: {e}"))),
            // Every branch above has awaited the spawning thread.
            None => {}
        }
        let duration = start.elapsed();
        // The shim exits only after pid 1 of the sandbox did, which kills the whole namespace;
        // kill the cgroup anyway in case something escaped the namespace but not the cgroup.
        let cg = guard.get();
        if !cg.is_empty() {
            let _ = tokio::task::block_in_place(|| cg.kill_all());
        }

        let captured = output.drain().await;
        // A control task waits for its caller, not for the run: it ends with the run.
        let stdin_broken_pipe = match stdin_task {
            Some(t) if spec.controls.is_some() => {
                t.abort();
                matches!(t.await, Ok(true))
            }
            Some(t) => t.await.unwrap_or(false),
            None => false,
        };
        let network = skeleton::connections(egress_run).await;
        let record = read_status(&status_r);
        let stats = cg.stats();
        self.retire(guard, refill).await?;

        let exit = match record {
            Some([child::TAG_SETUP_ERROR, stage, _, _, a, b, c, d]) => {
                return Err(setup_failure(stage, [a, b, c, d]));
            }
            Some([child::TAG_EXITED, _, _, _, a, b, c, d]) => {
                ExitKind::Exited(i32::from_le_bytes([a, b, c, d]))
            }
            Some([child::TAG_SIGNALED, _, _, _, a, b, c, d]) => {
                ExitKind::Signaled(i32::from_le_bytes([a, b, c, d]))
            }
            _ => ExitKind::Killed,
        };
        let ending = Ending {
            exit,
            killed,
            oom: stats.oom_kills > 0,
            pids_max_hits: stats.pids_max_hits,
            peak_memory_kib: stats.peak_memory_kib,
            stdin_broken_pipe,
        };
        Ok(RunOutcome::assemble(ending, captured, duration, network))
    }

    /// Ends a finished run's life on the host: its cgroup is removed (which frees the memory its
    /// children ran on) and then the prepared slots are topped up. On the reaper's thread when
    /// it takes the work, so the caller's answer does not wait for it; here otherwise.
    async fn retire(&self, guard: CgroupGuard, refill: RefillOnDrop) -> Result<(), SandboxError> {
        let Some(reaper) = &self.reaper else {
            guard.finish().await?;
            drop(refill);
            return Ok(());
        };
        let runtime = tokio::runtime::Handle::current();
        // CgroupGuard's drop removes the cgroup (logging a failure) and releases the memory
        // only once it is gone; the refill needs the runtime to start its tasks.
        let teardown: reaper::Teardown = Box::new(move || {
            drop(guard);
            let _entered = runtime.enter();
            drop(refill);
        });
        if let Err(teardown) = reaper.submit(teardown) {
            tokio::task::spawn_blocking(teardown)
                .await
                .map_err(|e| SandboxError::Setup(format!("cgroup cleanup task: {e}")))?;
        }
        Ok(())
    }
}

fn dev_null() -> Result<OwnedFd, SandboxError> {
    Ok(std::fs::File::open("/dev/null")?.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::uids::UidRange;
    use crate::sandbox::{KilledReason, Sandbox};
    use std::path::PathBuf;

    fn sleep_spec(id: &str, timeout: Duration) -> RunSpec {
        let base = crate::sandbox::test_spec(&["/bin/sleep", "4"]);
        RunSpec {
            exec_id: id.into(),
            limits: crate::sandbox::Limits {
                cpus: 1.0,
                memory_bytes: 256 << 20,
                disk_bytes: 16 << 20,
                timeout,
                output_bytes: 1 << 16,
                ..base.limits.clone()
            },
            fs: crate::sandbox::FsRules {
                read_only: ["/usr", "/bin", "/lib", "/lib64", "/etc"]
                    .iter()
                    .map(PathBuf::from)
                    .collect(),
                ..base.fs.clone()
            },
            profile: "t".into(),
            ..base
        }
    }

    /// A wall clock that fires before a prepared shim has joined its cgroup (1 ms, freshly
    /// prepared slots) still kills the run: the kill is repeated until the shim is gone, so
    /// `sleep 4` never gets to exit 0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs root (namespaces, cgroups): scripts/test-all.sh runs it as root"]
    async fn a_wall_clock_that_fires_before_the_shim_joined_still_kills_the_run() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        let dir = tempfile::tempdir().unwrap();
        let uids = Arc::new(UidRange::new(300_000, 64, &dir.path().join("uids")).unwrap());
        let sb = LocalSandbox::new("executor-arm", 4, false, dir.path(), None, uids);
        assert!(sb.probe.local_missing(1).is_empty(), "{:?}", sb.probe);
        for i in 0..12 {
            let o = sb
                .run(sleep_spec(&format!("unit-{i}"), Duration::from_millis(1)))
                .await
                .expect("run");
            assert_ne!(
                o.exit,
                ExitKind::Exited(0),
                "run {i} escaped its wall clock"
            );
            assert_eq!(o.killed_reason, Some(KilledReason::Timeout), "run {i}");
        }
    }
}
