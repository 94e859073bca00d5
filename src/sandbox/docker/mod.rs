//! The `docker` (runc) and `gvisor` (runsc) backends: every execution runs in a container that
//! never ran anything else, normally taken from a warm pool of started ones.
//!
//! Owns: turning a [`RunSpec`] into a hardened container ([`container`]), getting one (warm pool,
//! [`pool`], or a fresh launch), handing the request to its supervisor ([`supervisor`]) and
//! relaying its output ([`relay`], shared with a session's kept container, [`kept`]), killing
//! the container when the wall clock, an output cap or cancellation says so (the shared
//! skeleton, [`super::run`], decides when), reading OOM from the engine, destroying the container
//! afterwards whatever happens ([`janitor`]), and the backend's exit ([`exit`]). Must not: look
//! at tokens, requests or the allowlist.
//!
//! Egress profiles keep `--network none`; their only way out is the daemon's proxy on a unix
//! socket bind-mounted into the container, relayed by the supervisor ([`egress`]).
//!
//! The engine is behind [`engine::Engine`]; the real one is dockerd over its unix socket.

pub mod container;
pub mod egress;
pub mod engine;
mod exit;
pub use self::exit::EXIT_LIMIT;
use self::exit::LAUNCH_WAIT;
pub mod janitor;
pub mod kept;
pub mod labels;
pub mod pool;
mod relay;
use self::relay::PumpEnd;
pub mod reuse;
pub mod seccomp;
pub mod supervisor;
mod tunnel;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use self::container::{ContainerPlan, runtime_of};
use self::egress::{EgressSettings, SocketDirs};
use self::engine::{BollardEngine, Engine, EngineError};
use self::janitor::Janitor;
use self::labels::Owner;
pub use self::pool::PoolMetrics;
use self::pool::{Pool, WarmContainer};
use self::supervisor::{ExitReport, Frame, FrameDecoder};
use super::capture::DRAIN_GRACE;
use super::run::{self, Ending};
use super::{
    BackendKind, BackendStatus, ContainerUse, ExitKind, KilledReason, NetworkPolicy, RunOutcome,
    RunSpec, Sandbox, SandboxError,
};
use crate::sandbox::uids::UidRange;
/// How long a kill may take the engine before the run goes on without its confirmation.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long readiness waits for dockerd.
const STATUS_TIMEOUT: Duration = Duration::from_secs(3);
/// How long an OOM verdict waits for the container to stop.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a vanished supervisor's container is re-read for an OOM flag set after its exit.
/// dockerd handles containerd's exit and OOM events apart: on a loaded host the OOM flag of a
/// gVisor sandbox that went down out of memory was seen to come more than 1.5 s after the exit.
/// Only a run whose sandbox vanished without a report and without an OOM flag waits this long.
const LATE_OOM_WAIT: Duration = Duration::from_secs(5);
/// How often the janitor and the pool check on the engine and on idle containers.
const MAINTENANCE_EVERY: Duration = Duration::from_secs(2);
/// How long a check of runsc's registered flags is trusted before runs look again.
const RUNTIME_CHECK_TTL: Duration = Duration::from_secs(10);

pub struct DockerSandbox {
    kind: BackendKind,
    default_image: String,
    janitor: Arc<Janitor>,
    pool: Arc<Pool>,
    /// One-shot runs' reused containers (None: one container per run).
    reuse: Option<Arc<reuse::Reuse>>,
    /// Egress settings when egress profiles can run here (their socket directories are the
    /// pool's, see [`Pool::egress_dirs`]).
    egress: Option<EgressSettings>,
    /// Socket for the instance-wide removal on drop (None: a fake engine in unit tests).
    shutdown_socket: Option<String>,
    /// Set once [`Sandbox::shutdown`] has removed everything: the drop then has nothing to do.
    shut_down: AtomicBool,
    /// The last check that the runtime enforces the containers' seccomp profile, and when.
    runtime_check: std::sync::Mutex<Option<(Instant, Result<(), String>)>>,
    /// The supervisor binary bind-mounted into every container, or why it cannot be (checked
    /// once, at start: every run is then refused with that reason).
    supervisor: Result<std::path::PathBuf, String>,
}

/// The `[sandbox.docker]` config table.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerConfig {
    pub socket: String,
    pub image: String,
    pub pool_size: usize,
    /// One-shot runs served again by a container of the same calling service and shape, after a
    /// scrub ([`reuse`]); runc only.
    pub pool_reuse: bool,
    /// Runs a reused container serves at most, and its age after which it serves none.
    pub pool_max_uses: u32,
    pub pool_max_age_seconds: u64,
    /// Host directory of the egress proxy's per-container sockets; dockerd bind-mounts from it,
    /// so it must see it at the same path.
    pub egress_dir: std::path::PathBuf,
    /// The in-container supervisor, a static executable bind-mounted read-only into every
    /// container (dockerd must see it at this path). Unset: `executor-arm-supervisor` beside
    /// the daemon's own executable.
    #[serde(default)]
    pub supervisor: Option<std::path::PathBuf>,
}

impl DockerSandbox {
    /// Never fails and never blocks on dockerd: what is missing shows in [`Sandbox::status`] and
    /// makes runs fail with `Unavailable`. Spawns the maintenance task (startup sweep first).
    /// Without `egress`, egress profiles are refused. Each container runs as a host uid of its
    /// own from `uids` (see [`pool`]).
    pub fn new(
        kind: BackendKind,
        config: &DockerConfig,
        instance_id: &str,
        metrics: Option<PoolMetrics>,
        egress: Option<EgressSettings>,
        uids: Arc<UidRange>,
    ) -> Self {
        let engine: Arc<dyn Engine> = Arc::new(BollardEngine::new(&config.socket));
        let owner = Owner {
            instance: instance_id.to_string(),
            host: nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_default(),
            pid_ns: janitor::pid_namespace(),
            pid: std::process::id(),
            start_time: labels::process_start_time(std::process::id()).unwrap_or(0),
        };
        let mut s = Self::with_engine(
            kind,
            engine,
            owner,
            &config.image,
            config.pool_size,
            metrics,
            egress,
            uids,
        );
        s.shutdown_socket = Some(config.socket.clone());
        // Under gVisor a run's SysV IPC objects and POSIX queues live in the sentry: runsc
        // ignores the sysctls that refuse them, and the container shows no /proc/sysvipc and no
        // mqueue mount to list them by, so no scrub could clear them (docs/security.md).
        if config.pool_reuse && kind == BackendKind::Docker && config.pool_max_uses > 1 {
            s.set_reuse(reuse::Settings {
                max_uses: config.pool_max_uses,
                max_age: Duration::from_secs(config.pool_max_age_seconds),
            });
        }
        let path = config
            .supervisor
            .clone()
            .unwrap_or_else(supervisor::default_path);
        s.supervisor = supervisor::check_binary(&path).map(|()| path);
        if let Err(why) = &s.supervisor {
            tracing::error!(
                backend = kind.as_str(),
                "{why}; this backend refuses every run"
            );
        }
        s
    }

    /// The backend over any engine (unit tests use a fake).
    #[allow(clippy::too_many_arguments)]
    pub fn with_engine(
        kind: BackendKind,
        engine: Arc<dyn Engine>,
        owner: Owner,
        image: &str,
        pool_size: usize,
        metrics: Option<PoolMetrics>,
        egress: Option<EgressSettings>,
        uids: Arc<UidRange>,
    ) -> Self {
        let dirs = egress.as_ref().map(|e| {
            let dirs = SocketDirs::new(&e.dir, &owner, kind);
            // Before the first request: what crashed daemons left goes now, not at the next
            // egress run.
            dirs.sweep_dead();
            Arc::new(dirs)
        });
        let janitor = Janitor::new(engine, owner, kind);
        let pool = Pool::new(pool_size, kind, janitor.clone(), uids, dirs, metrics);
        let weak = Arc::downgrade(&pool);
        let j = janitor.clone();
        tokio::spawn(async move {
            loop {
                if j.tick().await
                    && let Some(p) = weak.upgrade()
                {
                    p.flush();
                }
                match weak.upgrade() {
                    Some(p) => p.prune(),
                    None => break,
                }
                tokio::time::sleep(MAINTENANCE_EVERY).await;
            }
        });
        DockerSandbox {
            kind,
            default_image: image.to_string(),
            janitor,
            pool,
            reuse: None,
            egress,
            shutdown_socket: None,
            shut_down: AtomicBool::new(false),
            runtime_check: std::sync::Mutex::new(None),
            // A fake engine runs nothing; `new` puts the checked binary here.
            supervisor: Ok(supervisor::default_path()),
        }
    }

    /// Serves one-shot runs again in containers of their own scope (see [`reuse`]); the idle
    /// ones are pruned with the pool's maintenance.
    pub fn set_reuse(&mut self, settings: reuse::Settings) {
        let r = reuse::Reuse::new(settings);
        let weak = Arc::downgrade(&r);
        let janitor = self.janitor.clone();
        tokio::spawn(async move {
            let mut seen = janitor.engine_generation();
            loop {
                tokio::time::sleep(MAINTENANCE_EVERY).await;
                let Some(r) = weak.upgrade() else { break };
                // dockerd came back after an outage: its containers may be gone or stale.
                let now = janitor.engine_generation();
                if now != seen {
                    seen = now;
                    r.flush();
                }
                r.prune();
            }
        });
        self.reuse = Some(r);
    }

    /// The scope a run may share containers in, when it may: a one-shot run with a scope, no
    /// egress (its proxy is per container run) and no files of its own (an executor's are bound
    /// into its container).
    fn reuse_scope(&self, spec: &RunSpec) -> Option<String> {
        self.reuse.as_ref()?;
        let plain = spec.kept.is_none()
            && spec.code.is_none()
            && !spec.background
            && spec.network == NetworkPolicy::None
            && spec.fs.extra_files.is_empty()
            && spec.fs.workspace.is_none();
        plain.then(|| spec.reuse_scope.clone()).flatten()
    }

    /// A one-shot run in a container of its scope's that served earlier runs, else in a fresh
    /// kept-mode one, which may serve the scope's next runs after a scrub ([`reuse`]).
    async fn run_reused(
        &self,
        reuse: &Arc<reuse::Reuse>,
        scope: String,
        spec: RunSpec,
    ) -> Result<RunOutcome, SandboxError> {
        let plan = self.plan(&spec, true)?;
        if let Some(why) = self.runtime_refusal().await {
            return Err(SandboxError::Unavailable(why));
        }
        let key = (scope, plan.key.clone());
        let mut taken = reuse.take(&key).await;
        let exec_id = spec.exec_id.clone();
        // A run whose live controls (stdin, signals) are taken cannot be started twice.
        let once = spec.controls.is_some();
        let mut spec = Some(spec);
        loop {
            let reused = taken.is_some();
            let item = match taken.take() {
                Some(item) => {
                    self.pool.count("reused");
                    item
                }
                None => {
                    let name = format!("executor-arm-{}", exec_id);
                    let (container, pooled) =
                        self.container_for(&plan, &exec_id, &name, true).await?;
                    tracing::debug!(exec_id = %exec_id, pooled, "no reused container of this scope was idle");
                    reuse::Reusable {
                        kept: self.kept_container(&plan, container),
                        uses: 0,
                        born: Instant::now(),
                    }
                }
            };
            let item = reuse::Reusable {
                uses: item.uses + 1,
                ..item
            };
            tracing::info!(exec_id = %exec_id, container = %item.kept.id(), uses = item.uses, backend = self.kind.as_str(), "sandbox container assigned");
            // The kernel keeps one peak per cgroup, for the container's whole life: reset before
            // a run in a used container, it is this run's (a fresh container's is already).
            let peak = item.kept.memory_peak(item.uses > 1).await;
            let delivered = item.kept.delivered();
            let again = reused && !once;
            let this = if again { spec.clone() } else { spec.take() }
                .ok_or_else(|| SandboxError::Setup("a run was started twice".into()))?;
            let result = self.run_kept(&item.kept, this, None).await;
            if again
                && matches!(result, Err(SandboxError::Unavailable(_)))
                && item.kept.delivered() == delivered
            {
                // The idle container died before the run reached it (its end was not seen yet
                // when it was taken): nothing ran, so the run goes to a fresh container.
                tracing::info!(container = %short(item.kept.id()), "reused container gone before its run started; running it in a fresh one");
                reuse.settle(key.clone(), item, None);
                continue;
            }
            let peak_kib = match peak {
                Some(p) => tokio::task::spawn_blocking(move || p.kib())
                    .await
                    .ok()
                    .flatten(),
                None => None,
            };
            let container = ContainerUse {
                id: short(item.kept.id()).to_string(),
                uses: item.uses,
            };
            reuse.settle(key, item, result.as_ref().ok());
            return result.map(|mut o| {
                o.peak_memory_kib = o.peak_memory_kib.or(peak_kib);
                o.container = Some(container);
                o
            });
        }
    }

    /// The container plan of `spec` with the supervisor mounted; refused (503) when the
    /// supervisor binary is not usable.
    fn plan(&self, spec: &RunSpec, kept: bool) -> Result<ContainerPlan, SandboxError> {
        let binary = self
            .supervisor
            .as_ref()
            .map_err(|why| SandboxError::Unavailable(why.clone()))?;
        Ok(ContainerPlan::new(spec, self.kind, &self.default_image, kept)?.with_supervisor(binary))
    }

    /// With egress, the directories of the proxy's sockets exist: a host that cannot hold them
    /// cannot run egress profiles (503 before a container is touched).
    fn ensure_egress_dirs(&self, egress: Option<&EgressSettings>) -> Result<(), SandboxError> {
        if let (Some(e), Some(dirs)) = (egress, self.pool.egress_dirs()) {
            dirs.ensure().map_err(|err| {
                SandboxError::Unavailable(format!(
                    "egress socket directory {}: {err}",
                    e.dir.display()
                ))
            })?;
        }
        Ok(())
    }

    /// Why this backend's runtime would not enforce the containers' seccomp profile (runsc
    /// ignores it unless registered with `--oci-seccomp`), from `args`, its registered flags.
    fn seccomp_problem(&self, args: &[String]) -> Result<(), String> {
        if self.kind == BackendKind::Gvisor && !seccomp::runsc_applies_oci_seccomp(args) {
            return Err(
                "runsc is not registered with --oci-seccomp, so it would ignore the sandbox's \
                 seccomp profile (see docker/daemon.json)"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// [`Self::seccomp_problem`] as a run needs it: from a recent check, else asked now. An
    /// engine that does not answer is not this check's to report (the run fails on its own).
    async fn runtime_refusal(&self) -> Option<String> {
        if self.kind != BackendKind::Gvisor {
            return None;
        }
        if let Ok(c) = self.runtime_check.lock()
            && let Some((at, verdict)) = c.as_ref()
            && at.elapsed() < RUNTIME_CHECK_TTL
        {
            return verdict.clone().err();
        }
        let info = tokio::time::timeout(STATUS_TIMEOUT, self.engine().info()).await;
        let Ok(Ok(info)) = info else { return None };
        let args = info
            .runtime_args
            .get(runtime_of(self.kind))
            .cloned()
            .unwrap_or_default();
        let verdict = self.seccomp_problem(&args);
        if let Ok(mut c) = self.runtime_check.lock() {
            *c = Some((Instant::now(), verdict.clone()));
        }
        verdict.err()
    }

    fn engine(&self) -> &Arc<dyn Engine> {
        self.janitor.engine()
    }

    /// A container for this run: warm if the pool has one, else launched now, named `name`
    /// (which tells operators which execution or session holds it; it must be unused).
    /// `warm`: keep a pool of this shape (see [`Pool::take`]).
    async fn container_for(
        &self,
        plan: &ContainerPlan,
        exec_id: &str,
        name: &str,
        warm: bool,
    ) -> Result<(WarmContainer, bool), SandboxError> {
        if let Some(w) = self.pool.take(plan, warm) {
            // Labels are immutable; the name tells operators which execution holds it.
            let engine = self.engine().clone();
            let (id, name) = (w.guard.id().to_string(), name.to_string());
            tokio::spawn(async move {
                let _ = engine.rename(&id, &name).await;
            });
            return Ok((w, true));
        }
        let uid = self.pool.lease_uid().await?;
        let w = WarmContainer::launch(
            &self.janitor,
            plan,
            name,
            exec_id,
            uid,
            self.pool.egress_dirs(),
        )
        .await
        .map_err(|e| launch_error(plan, e))?;
        Ok((w, false))
    }

    /// Kills the container: SIGKILL through the engine and, at the same time, straight to its
    /// main host process when this daemon can see it, because a gVisor sandbox saturated by its
    /// guest (a fork bomb under its CPU quota) can take half a minute to act on the engine's.
    /// A kill the engine has not confirmed in time is not an error once the direct one landed.
    async fn stop(&self, id: &str, pid: Option<u32>) -> Result<(), EngineError> {
        let direct = pid.is_some_and(|pid| janitor::host_kill(id, pid));
        let api = tokio::time::timeout(KILL_TIMEOUT, self.engine().kill(id)).await;
        match api {
            Ok(r) => {
                self.janitor.observe(&r);
                if direct { Ok(()) } else { r }
            }
            Err(_) if direct => Ok(()),
            Err(_) => Err(EngineError::Api(format!(
                "the engine did not confirm the kill within {} s",
                KILL_TIMEOUT.as_secs()
            ))),
        }
    }

    /// The engine's OOM verdict, read once the container has stopped (bounded wait).
    async fn oom_verdict(&self, id: &str) -> Result<bool, EngineError> {
        let engine = self.engine();
        let mut waited = tokio::time::timeout(VERDICT_TIMEOUT, engine.wait_stopped(id)).await;
        if waited.is_err() {
            // Still running after its supervisor vanished (a gVisor sandbox busy dying on a
            // loaded host): stop it, so the engine's record is final before it is read.
            let _ = engine.kill(id).await;
            waited = tokio::time::timeout(VERDICT_TIMEOUT, engine.wait_stopped(id)).await;
        }
        if let Ok(r) = &waited {
            self.janitor.observe(r);
        }
        let state = engine.inspect(id).await;
        self.janitor.observe(&state);
        Ok(state?.oom_killed)
    }
}

impl DockerSandbox {
    /// dockerd can set a container's OOM flag a moment after it reported the container's exit:
    /// reads it again a few times (at most [`LATE_OOM_WAIT`]) before concluding there was none.
    async fn late_oom_verdict(&self, id: &str) -> bool {
        let engine = self.engine();
        let deadline = Instant::now() + LATE_OOM_WAIT;
        while Instant::now() < deadline {
            tokio::time::sleep(LATE_OOM_WAIT / 20).await;
            match engine.inspect(id).await {
                Ok(state) if state.oom_killed => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// What the run's end means: the supervisor's report (if any) and the OOM verdict, or the
    /// error the run ends with when there is neither a report nor a kill of ours to explain it.
    async fn settle(
        &self,
        id: &str,
        exec_id: &str,
        killed: Option<KilledReason>,
        end: PumpEnd,
    ) -> Result<(Option<ExitReport>, bool), SandboxError> {
        if killed.is_none() && end.undelivered {
            let reason = end.error.map(|e| e.to_string()).unwrap_or_default();
            return Err(SandboxError::Unavailable(format!(
                "sandbox container {} was gone before the run: {reason}",
                short(id)
            )));
        }
        let report = match end.report {
            Some(Frame::Failed(m)) if killed.is_none() => return Err(SandboxError::Setup(m)),
            Some(Frame::NoPids(m)) if killed.is_none() => {
                return Err(SandboxError::PidsExhausted(m));
            }
            Some(Frame::Unavailable(m)) if killed.is_none() => {
                return Err(SandboxError::Unavailable(m));
            }
            Some(Frame::Exit(r)) => Some(r),
            _ => None,
        };
        let mut oom = report.as_ref().and_then(|r| r.oom_kills).unwrap_or(0) > 0;
        // The engine decides OOM whenever something was SIGKILLed that we did not kill, or the
        // supervisor vanished (gVisor: an OOM takes the whole sandbox down).
        let suspicious = killed.is_none()
            && !oom
            && report
                .as_ref()
                .is_none_or(|r| r.exit == ExitKind::Signaled(libc::SIGKILL));
        if suspicious {
            match self.oom_verdict(id).await {
                Ok(v) => oom = v,
                Err(e) if report.is_none() => {
                    let why = end.error.map(|x| x.to_string());
                    return Err(SandboxError::Unavailable(format!(
                        "docker engine lost during the run ({}): {e}",
                        why.as_deref().unwrap_or("stream ended")
                    )));
                }
                Err(e) => {
                    tracing::warn!(%exec_id, error = %e, "no OOM verdict from the engine")
                }
            }
        }
        if suspicious && !oom && report.is_none() {
            oom = self.late_oom_verdict(id).await;
        }
        if report.is_none() && killed.is_none() && !oom {
            match end.error {
                Some(e) if e.is_unreachable() => {
                    return Err(SandboxError::Unavailable(format!(
                        "docker engine lost during the run: {e}"
                    )));
                }
                Some(e) => {
                    return Err(SandboxError::Setup(format!(
                        "{e}; supervisor stderr: {}",
                        String::from_utf8_lossy(&end.supervisor_stderr).trim()
                    )));
                }
                // The supervisor ended without a report and the engine is fine. The command
                // cannot reach it (another uid, not dumpable), so what ended it was the
                // sandbox itself going down under the run (a gVisor sandbox out of memory or
                // threads): that is the run's outcome, a kill, not a daemon error.
                None => tracing::warn!(
                    %exec_id,
                    supervisor_stderr = %String::from_utf8_lossy(&end.supervisor_stderr).trim(),
                    "the sandbox ended without its supervisor's report; the run counts as killed"
                ),
            }
        }
        Ok((report, oom))
    }
}

/// Engine failures while getting a container: an unreachable engine, a missing image or an
/// unregistered runtime mean the backend cannot serve this profile (503); anything else is a
/// setup failure of this run.
fn launch_error(plan: &ContainerPlan, e: EngineError) -> SandboxError {
    match e {
        EngineError::Unreachable(m) => {
            SandboxError::Unavailable(format!("docker engine unreachable: {m}"))
        }
        EngineError::Timeout => {
            SandboxError::Unavailable("docker engine did not answer in time".to_string())
        }
        EngineError::NotFound(m) => SandboxError::Unavailable(format!("image {}: {m}", plan.image)),
        EngineError::Closed => SandboxError::Unavailable(e.to_string()),
        EngineError::Api(m) if m.contains(supervisor::CONTAINER_PATH) => {
            SandboxError::Unavailable(format!(
                "image {} cannot run the sandbox supervisor ({}): {m}",
                plan.image,
                supervisor::CONTAINER_PATH
            ))
        }
        EngineError::Api(m) if m.to_ascii_lowercase().contains("runtime") => {
            SandboxError::Unavailable(format!("runtime {}: {m}", runtime_of(plan.kind)))
        }
        EngineError::Api(m) => {
            SandboxError::Setup(format!("could not start a sandbox container: {m}"))
        }
    }
}

#[async_trait::async_trait]
impl Sandbox for DockerSandbox {
    fn kind(&self) -> BackendKind {
        self.kind
    }

    fn supports_egress(&self) -> bool {
        self.egress.is_some()
    }

    /// Stops the pool and refuses container launches, waiting for those in flight (a pool refill,
    /// a cold launch for a run or a session), then removes every container and volume of this
    /// instance and backend: all of it within [`EXIT_LIMIT`].
    async fn shutdown(&self) {
        self.shutdown_by(tokio::time::Instant::now() + EXIT_LIMIT, LAUNCH_WAIT)
            .await;
    }

    async fn status(&self) -> BackendStatus {
        let runtime = runtime_of(self.kind);
        if let Err(why) = &self.supervisor {
            return BackendStatus {
                backend: self.kind,
                ready: false,
                detail: why.clone(),
            };
        }
        let (ready, detail) = match tokio::time::timeout(STATUS_TIMEOUT, self.engine().info()).await
        {
            Err(_) => (
                false,
                format!(
                    "docker engine did not answer within {} s",
                    STATUS_TIMEOUT.as_secs()
                ),
            ),
            Ok(Err(e)) => (false, e.to_string()),
            Ok(Ok(info)) if !info.runtimes.iter().any(|r| r == runtime) => (
                false,
                format!(
                    "runtime {runtime} is not registered in dockerd (it has: {})",
                    info.runtimes.join(", ")
                ),
            ),
            Ok(Ok(info)) => {
                let args = info.runtime_args.get(runtime).cloned().unwrap_or_default();
                let verdict = self.seccomp_problem(&args);
                if let Ok(mut c) = self.runtime_check.lock() {
                    *c = Some((Instant::now(), verdict.clone()));
                }
                if let Err(why) = verdict {
                    return BackendStatus {
                        backend: self.kind,
                        ready: false,
                        detail: why,
                    };
                }
                let mut detail = format!(
                    "docker {} (API {}), runtime {runtime}, image {}, warm pool {} per profile ({} idle)",
                    info.server_version,
                    info.api_version,
                    self.default_image,
                    self.pool.size(),
                    self.pool.idle()
                );
                // Egress runs would fail with 503 at their relay's first connect; say why here.
                if self.kind == BackendKind::Gvisor
                    && self.egress.is_some()
                    && !egress::runsc_allows_host_uds(&args)
                {
                    detail.push_str(
                        "; egress profiles unavailable: runsc is not registered with --host-uds=open",
                    );
                }
                (true, detail)
            }
        };
        BackendStatus {
            backend: self.kind,
            ready,
            detail,
        }
    }

    async fn keep(
        &self,
        spec: &RunSpec,
        session_id: &str,
        warm: bool,
    ) -> Result<Option<Arc<dyn super::files::Kept>>, SandboxError> {
        let _in_flight = self.pool.run_started();
        self.open_kept(spec, session_id, warm).await.map(Some)
    }

    async fn run(&self, mut spec: RunSpec) -> Result<RunOutcome, SandboxError> {
        // A session's background process may live for hours: refills do not wait for it.
        let _in_flight = (!spec.background).then(|| self.pool.run_started());
        // Everything that can be refused is refused before a container is touched.
        if spec.background && spec.kept.is_some() && !spec.network.tcp_rules().is_empty() {
            return Err(SandboxError::Setup(
                "background processes in container sessions cannot have raw TCP rules (network.tcp)".into(),
            ));
        }
        let egress = run::egress_for(&spec.network, self.egress.as_ref())?;
        if let Some(kept) = spec.kept.clone() {
            return self.run_kept(kept.as_ref(), spec, egress).await;
        }
        if let (Some(reuse), Some(scope)) = (&self.reuse, self.reuse_scope(&spec)) {
            return self.run_reused(&reuse.clone(), scope, spec).await;
        }
        let plan = self.plan(&spec, false)?;
        // Never a container whose runtime would drop its seccomp profile.
        if let Some(why) = self.runtime_refusal().await {
            return Err(SandboxError::Unavailable(why));
        }
        self.ensure_egress_dirs(egress)?;
        let relay = egress.map(|e| e.relay(&mut spec));
        let controls = spec.controls.as_ref().and_then(|c| c.take());
        let request = supervisor::encode_request(&spec, relay.as_ref(), None, controls.is_some())?;
        let name = format!("executor-arm-{}", spec.exec_id);
        let (warm, pooled) = self
            .container_for(&plan, &spec.exec_id, &name, true)
            .await?;
        let WarmContainer {
            attached:
                engine::Attached {
                    input: mut attached_in,
                    output: mut attached_out,
                },
            guard,
            pid,
            socket_dir,
            disk_source: _,
        } = warm;
        let id = guard.id().to_string();
        tracing::info!(exec_id = %spec.exec_id, container = %id, pooled, backend = self.kind.as_str(), "sandbox container assigned");
        // With egress the proxy listens on this container's socket before the supervisor gets
        // the request, so the command finds it; every early return below drops (stops) it.
        let proxy = egress
            .map(|e| e.serve(socket_dir.as_ref(), &spec.network))
            .transpose()?;

        let mut decoder = FrameDecoder::default();
        let (mut run, killed, end) = self
            .relay_and_wait(
                &id,
                &spec,
                &mut attached_in,
                &mut attached_out,
                &mut decoder,
                &request,
                relay::Live {
                    controls,
                    ..Default::default()
                },
            )
            .await;
        let relay = &mut run.relay;
        let start = run.start;
        let duration = start.elapsed();
        // The supervisor's own deadline ended it (this daemon's clock should have been first).
        let killed = killed.or(match end.as_ref().map(|e| &e.report) {
            Some(Some(Frame::Deadline(_))) => Some(KilledReason::Timeout),
            _ => None,
        });
        let end = match end {
            Some(end) => end,
            None => {
                // SIGKILL to PID 1 ends the whole container, double-forked children included.
                // Keep draining while the kill is in progress (dockerd finishes a kill only after
                // the container's output reached us: not reading would deadlock a flooding run),
                // then give output still in flight a short grace.
                let mut stop = std::pin::pin!(self.stop(&id, pid));
                let (k, drained) = tokio::select! {
                    end = &mut *relay => ((&mut stop).await, Some(end)),
                    k = &mut stop => (k, tokio::time::timeout(DRAIN_GRACE, &mut *relay).await.ok()),
                };
                if let Err(e) = k {
                    tracing::error!(exec_id = %spec.exec_id, container = %id, error = %e, "could not kill a sandbox container");
                    if e.is_unreachable() {
                        return Err(SandboxError::Unavailable(format!(
                            "docker engine lost while stopping the run: {e}"
                        )));
                    }
                }
                drained.unwrap_or_default()
            }
        };
        // Dropping the relay closes the capped readers' pipes.
        let captured = run.finish().await;

        // The command is over (or killed): what it still had open through the proxy is closed.
        let network = run::connections(proxy).await;
        drop(socket_dir);
        let (report, oom) = self.settle(&id, &spec.exec_id, killed, end).await?;
        drop(guard);

        let ending = Ending {
            exit: report.as_ref().map(|r| r.exit).unwrap_or(ExitKind::Killed),
            killed,
            oom,
            pids_max_hits: report.as_ref().and_then(|r| r.pids_max_hits).unwrap_or(0),
            peak_memory_kib: report.as_ref().and_then(|r| r.peak_memory_kib),
            stdin_broken_pipe: report.as_ref().is_some_and(|r| r.stdin_broken_pipe),
        };
        Ok(RunOutcome::assemble(ending, captured, duration, network))
    }
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sandbox::docker::engine::fake::FakeEngine;
    use std::sync::atomic::Ordering;

    fn owner() -> Owner {
        Owner {
            instance: "t-1".into(),
            host: "t".into(),
            pid_ns: "pid:[1]".into(),
            pid: 1,
            start_time: 1,
        }
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![kind];
        v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        v.extend_from_slice(payload);
        v
    }

    fn sandbox(reply: Vec<u8>) -> (Arc<FakeEngine>, DockerSandbox) {
        let engine = Arc::new(FakeEngine::default());
        *engine.reply.lock().unwrap() = reply;
        let s = DockerSandbox::with_engine(
            BackendKind::Docker,
            engine.clone(),
            owner(),
            "img",
            0,
            None,
            None,
            UidRange::for_tests(16),
        );
        (engine, s)
    }

    /// A backend with egress whose socket directories live in `dir`; resolves nothing.
    fn egress_sandbox(
        reply: Vec<u8>,
        dir: &std::path::Path,
        pool_size: usize,
    ) -> (Arc<FakeEngine>, DockerSandbox) {
        let engine = Arc::new(FakeEngine::default());
        *engine.reply.lock().unwrap() = reply;
        *engine.runsc_args.lock().unwrap() = vec!["--oci-seccomp".into()];
        let settings = EgressSettings {
            resolver: Arc::new(crate::egress::StaticHosts::new(None)),
            deny_addrs: vec![],
            port: 3128,
            dir: dir.to_path_buf(),
        };
        let s = DockerSandbox::with_engine(
            BackendKind::Gvisor,
            engine.clone(),
            owner(),
            "img",
            pool_size,
            None,
            Some(settings),
            UidRange::for_tests(16),
        );
        (engine, s)
    }

    /// Directories under the daemon's egress directory (one per container that still has one).
    fn socket_dirs(root: &std::path::Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(root)
            .unwrap()
            .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
            .map(|e| e.unwrap().path())
            .collect()
    }

    #[tokio::test]
    async fn egress_runs_reach_only_the_proxy_and_leave_no_socket_directory() {
        let root = tempfile::tempdir().unwrap();
        let (engine, s) = egress_sandbox(frame(b'x', b"exit 0 0 - 0 0"), root.path(), 1);
        assert!(s.supports_egress());
        let st = s.status().await;
        assert!(st.ready && st.detail.contains("--host-uds=open"), "{st:?}");
        *engine.runsc_args.lock().unwrap() = vec!["--oci-seccomp".into(), "--host-uds=open".into()];
        assert!(!s.status().await.detail.contains("unavailable"));
        *engine.egress_send.lock().unwrap() =
            Some(b"GET http://169.254.169.254/ HTTP/1.1\r\nHost: x\r\n\r\n".to_vec());
        // First run: a miss, launched for the run; second: from the pool. Both the same way.
        for _ in 0..2 {
            let o = s.run(container::tests::egress_spec()).await.unwrap();
            assert_eq!(o.exit, ExitKind::Exited(0));
            assert_eq!(o.network.len(), 1, "{:?}", o.network);
            assert!(!o.network[0].allowed);
            assert_eq!(o.network[0].status, Some(403));
            let answer = engine.egress_answers.lock().unwrap().pop().unwrap();
            assert!(answer.starts_with(b"HTTP/1.1 403 "), "{answer:?}");
            let req = engine.requests.lock().unwrap().pop().unwrap();
            let text = String::from_utf8_lossy(&req);
            assert!(
                text.contains("\0http_proxy=http://127.0.0.1:3128\0"),
                "{text}"
            );
            assert!(
                text.contains("\x003128\0/run/executor-arm/egress/proxy.sock"),
                "{text}"
            );
        }
        // Only the idle pool container still has a directory, and the daemon's goes with it.
        for _ in 0..200 {
            if socket_dirs(root.path()).len() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(socket_dirs(root.path()).len(), 1);
        drop(s);
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn egress_failures_leave_nothing_behind() {
        let root = tempfile::tempdir().unwrap();
        // The relay could not reach the proxy: unavailable, not a setup error.
        let (engine, s) = egress_sandbox(frame(b'u', b"egress relay cannot reach"), root.path(), 0);
        assert!(
            matches!(s.run(container::tests::egress_spec()).await, Err(SandboxError::Unavailable(m)) if m.contains("cannot reach"))
        );
        gone(&engine).await;
        assert!(socket_dirs(root.path()).is_empty());
        // Timeout with a connection still open through the proxy.
        let (engine, s) = egress_sandbox(Vec::new(), root.path(), 0);
        *engine.egress_send.lock().unwrap() = Some(b"GET http://allowed.test/ HTT".to_vec());
        let mut spec = container::tests::egress_spec();
        spec.limits.timeout = Duration::from_millis(300);
        let o = s.run(spec).await.unwrap();
        assert_eq!(o.killed_reason, Some(KilledReason::Timeout));
        gone(&engine).await;
        assert!(socket_dirs(root.path()).is_empty());
        // A dropped run.
        let (engine, s) = egress_sandbox(Vec::new(), root.path(), 0);
        let run = s.run(container::tests::egress_spec());
        let _ = tokio::time::timeout(Duration::from_millis(200), run).await;
        gone(&engine).await;
        assert!(socket_dirs(root.path()).is_empty());
    }

    async fn gone(engine: &FakeEngine) {
        for _ in 0..200 {
            if engine.existing().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("container left behind: {:?}", engine.existing());
    }

    #[tokio::test]
    async fn a_report_becomes_the_outcome_and_the_container_goes() {
        let mut reply = frame(b'o', b"out");
        reply.extend(frame(b'e', b"err"));
        reply.extend(frame(b'x', b"exit 3 1 2048 0 0"));
        let (engine, s) = sandbox(reply);
        let mut spec = container::tests::spec();
        spec.stdin = Some(b"in".to_vec());
        let o = s.run(spec.clone()).await.unwrap();
        assert_eq!(
            (o.exit, o.stdout.as_slice(), o.stderr.as_slice()),
            (ExitKind::Exited(3), &b"out"[..], &b"err"[..])
        );
        assert!(o.stdin_broken_pipe);
        assert_eq!(o.peak_memory_kib, Some(2048));
        assert_eq!((o.oom, o.killed_reason), (false, None));
        assert_eq!(
            engine.requests.lock().unwrap()[0],
            supervisor::encode_request(&spec, None, None, false).unwrap()
        );
        gone(&engine).await;
    }

    #[tokio::test]
    async fn oom_and_pids_come_from_the_cgroup_counters() {
        let (_, s) = sandbox(frame(b'x', b"signal 9 0 - 1 -"));
        let o = s.run(container::tests::spec()).await.unwrap();
        assert_eq!(
            (o.exit, o.oom, o.killed_reason),
            (ExitKind::Signaled(9), true, Some(KilledReason::Oom))
        );
        let (_, s) = sandbox(frame(b'x', b"exit 1 0 - 0 5"));
        let o = s.run(container::tests::spec()).await.unwrap();
        assert_eq!(o.killed_reason, Some(KilledReason::Pids));
    }

    /// Runs `spec` and, once its request arrived, makes the container's supervisor vanish
    /// without a report (as a sandbox that died under a memory or fork bomb does).
    async fn run_and_vanish(engine: &Arc<FakeEngine>, s: DockerSandbox) -> RunOutcome {
        let run = tokio::spawn(async move { s.run(container::tests::spec()).await });
        while engine.requests.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for id in engine.existing() {
            engine.crash(&id);
        }
        match run.await {
            Ok(Ok(o)) => o,
            other => panic!("a vanished supervisor must be the run's outcome, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_vanished_supervisor_is_the_runs_outcome_not_an_error() {
        let (engine, s) = sandbox(frame(b'o', b"partial"));
        let o = run_and_vanish(&engine, s).await;
        assert_eq!(
            (o.exit, o.oom, o.killed_reason),
            (ExitKind::Killed, false, Some(KilledReason::Signal))
        );
        assert_eq!(o.stdout, b"partial");
    }

    #[tokio::test]
    async fn a_vanished_supervisor_waits_for_a_late_oom_verdict() {
        let (engine, s) = sandbox(Vec::new());
        // The first inspect still says "no OOM"; a later one says it was.
        engine.oom_from_inspect.store(3, Ordering::SeqCst);
        let o = run_and_vanish(&engine, s).await;
        assert_eq!(
            (o.exit, o.oom, o.killed_reason),
            (ExitKind::Killed, true, Some(KilledReason::Oom))
        );
    }

    #[tokio::test]
    async fn timeout_kills_the_container() {
        let (engine, s) = sandbox(frame(b'o', b"partial"));
        let mut spec = container::tests::spec();
        spec.limits.timeout = Duration::from_millis(200);
        let o = s.run(spec).await.unwrap();
        assert_eq!(
            (o.exit, o.killed_reason),
            (ExitKind::Killed, Some(KilledReason::Timeout))
        );
        assert_eq!(o.stdout, b"partial");
        assert_eq!(engine.count("kill"), 1);
        gone(&engine).await;
    }

    #[tokio::test]
    async fn setup_failures_refusals_and_a_missing_engine() {
        let (engine, s) = sandbox(frame(b'f', b"cannot execute /x: No such file or directory"));
        assert!(
            matches!(s.run(container::tests::spec()).await, Err(SandboxError::Setup(m)) if m.contains("cannot execute"))
        );
        gone(&engine).await;

        let mut spec = container::tests::spec();
        spec.network = NetworkPolicy::Egress {
            allow_hosts: vec![],
            allow_ports: vec![443],
            allow_cidrs: vec![],
            bandwidth_bytes_per_sec: 0,
            byte_cap: 0,
            tcp: vec![],
        };
        let (engine, s) = sandbox(Vec::new());
        assert!(
            matches!(s.run(spec).await, Err(SandboxError::Unavailable(m)) if m == "egress not configured")
        );
        assert_eq!(
            engine.count("create"),
            0,
            "refused before touching the engine"
        );

        let (engine, s) = sandbox(Vec::new());
        engine.down.store(true, Ordering::SeqCst);
        assert!(
            matches!(s.run(container::tests::spec()).await, Err(SandboxError::Unavailable(m)) if m.contains("unreachable"))
        );
        let st = s.status().await;
        assert!(!st.ready && st.detail.contains("unreachable"), "{st:?}");

        let (engine, s) = sandbox(Vec::new());
        engine.fail_create.store(true, Ordering::SeqCst);
        assert!(
            matches!(s.run(container::tests::spec()).await, Err(SandboxError::Unavailable(m)) if m.contains("image img"))
        );
    }

    #[tokio::test]
    async fn the_supervisors_deadline_is_a_timeout() {
        let (engine, s) = sandbox(frame(b't', b"the run was still going"));
        let o = s.run(container::tests::spec()).await.unwrap();
        assert_eq!(
            (o.exit, o.killed_reason),
            (ExitKind::Killed, Some(KilledReason::Timeout))
        );
        gone(&engine).await;
        // The request carries the timeout the supervisor enforces (then no code, no cwd).
        let req = engine.requests.lock().unwrap().pop().unwrap();
        assert!(
            req.ends_with(b"\x0030000\x00\x00-1\x00"),
            "{:?}",
            String::from_utf8_lossy(&req)
        );
    }

    #[tokio::test]
    async fn gvisor_without_oci_seccomp_is_not_ready_and_runs_nothing() {
        let engine = Arc::new(FakeEngine::default());
        *engine.reply.lock().unwrap() = frame(b'x', b"exit 0 0 - 0 0");
        let s = DockerSandbox::with_engine(
            BackendKind::Gvisor,
            engine.clone(),
            owner(),
            "img",
            0,
            None,
            None,
            UidRange::for_tests(16),
        );
        *engine.runsc_args.lock().unwrap() = vec!["--platform=ptrace".into()];
        let st = s.status().await;
        assert!(!st.ready && st.detail.contains("--oci-seccomp"), "{st:?}");
        assert!(
            matches!(s.run(container::tests::spec()).await, Err(SandboxError::Unavailable(m)) if m.contains("--oci-seccomp"))
        );
        assert_eq!(engine.count("create"), 0, "no container without its filter");
        *engine.runsc_args.lock().unwrap() = vec!["--oci-seccomp".into()];
        assert!(s.status().await.ready);
        let o = s.run(container::tests::spec()).await.unwrap();
        assert_eq!(o.exit, ExitKind::Exited(0));
        // runc always applies it.
        let (_, runc) = sandbox(frame(b'x', b"exit 0 0 - 0 0"));
        assert!(runc.status().await.ready);
    }

    #[tokio::test]
    async fn a_run_removes_its_disk_volume_after_its_container() {
        let (engine, s) = sandbox(frame(b'x', b"exit 0 0 - 0 0"));
        s.run(container::tests::spec()).await.unwrap();
        gone(&engine).await;
        for _ in 0..200 {
            if engine.existing_volumes().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(engine.existing_volumes().is_empty());
        let calls = engine.calls.lock().unwrap().clone();
        let at = |p: &str| calls.iter().position(|c| c.starts_with(p)).unwrap();
        assert!(
            at("remove c") < at("remove_volume executor-arm-disk-"),
            "{calls:?}"
        );
    }

    /// Creates the engine finishes only after the exit stopped waiting for launches: one for a
    /// run still waiting for it, one for a run dropped meanwhile. Once both have landed, no
    /// container may exist, although the process would end now (and the waiting run with it).
    #[tokio::test]
    async fn a_create_landing_after_the_exit_leaves_no_container() {
        let (engine, s) = sandbox(Vec::new());
        let delay = Duration::from_millis(600);
        *engine.create_delay.lock().unwrap() = Some(delay);
        // Dropped while the engine creates its container.
        let dropped = s.run(container::tests::spec());
        assert!(
            tokio::time::timeout(Duration::from_millis(50), dropped)
                .await
                .is_err()
        );
        let waiting =
            tokio::time::timeout(Duration::from_secs(10), s.run(container::tests::spec()));
        let exit = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let t0 = tokio::time::Instant::now();
            s.shutdown_by(t0 + Duration::from_millis(300), Duration::from_millis(100))
                .await;
            // Both creates have landed (the engine made them whatever the daemon did).
            for _ in 0..500 {
                if engine.count("create") == 2 && t0.elapsed() > delay {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            for _ in 0..300 {
                if engine.existing().is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            engine.existing()
        };
        let (run, left) = tokio::join!(waiting, exit);
        assert!(
            left.is_empty(),
            "containers created after the exit: {left:?}"
        );
        assert!(
            matches!(run, Ok(Err(SandboxError::Unavailable(_)))),
            "the waiting run gets no container: {run:?}"
        );
        assert!(engine.existing_volumes().is_empty());
    }

    #[tokio::test]
    async fn a_dropped_run_still_removes_its_container() {
        let (engine, s) = sandbox(Vec::new());
        let run = s.run(container::tests::spec());
        let _ = tokio::time::timeout(Duration::from_millis(200), run).await;
        gone(&engine).await;
    }

    #[tokio::test]
    async fn an_unusable_supervisor_binary_refuses_every_run_and_says_why() {
        let (engine, mut s) = sandbox(frame(b'x', b"exit 0 0 - 0 0"));
        // What `new` makes of a dynamically linked binary.
        s.supervisor = Err(supervisor::check_binary(std::path::Path::new("/bin/sh")).unwrap_err());
        let Err(SandboxError::Unavailable(why)) = s.run(container::tests::spec()).await else {
            panic!("not refused")
        };
        assert!(why.contains("dynamically linked"), "{why}");
        assert!(why.contains("scripts/build-supervisor.sh"), "{why}");
        assert!(matches!(
            s.keep(&container::tests::spec(), "s-1", false).await,
            Err(SandboxError::Unavailable(_))
        ));
        assert!(engine.existing().is_empty(), "no container was made");
        let st = s.status().await;
        assert!(!st.ready);
        assert_eq!(st.detail, why);
    }

    #[tokio::test]
    async fn background_runs_with_raw_tcp_rules_are_refused_before_anything_runs() {
        let (engine, s) = sandbox(frame(b'x', b"exit 0 0 - 0 0"));
        let kept = s
            .keep(&container::tests::spec(), "s-1", false)
            .await
            .unwrap()
            .unwrap();
        let mut spec = container::tests::spec();
        spec.kept = Some(kept.clone());
        spec.background = true;
        spec.network = NetworkPolicy::Egress {
            allow_hosts: vec!["example.test".into()],
            allow_ports: vec![443],
            allow_cidrs: vec![],
            bandwidth_bytes_per_sec: 0,
            byte_cap: 0,
            tcp: vec!["10.0.0.0/8:5432".parse().unwrap()],
        };
        let Err(SandboxError::Setup(why)) = s.run(spec.clone()).await else {
            panic!("not refused")
        };
        assert_eq!(
            why,
            "background processes in container sessions cannot have raw TCP rules (network.tcp)"
        );
        assert_eq!(engine.count("exec"), 0, "nothing was started");
        // Without egress it goes to the engine as an exec (which the fake refuses).
        spec.network = NetworkPolicy::None;
        let Err(SandboxError::Setup(why)) = s.run(spec).await else {
            panic!("the fake engine runs no exec")
        };
        assert!(why.contains("cannot start a background run"), "{why}");
        assert_eq!(engine.count("exec"), 1);
        kept.close().await;
    }

    #[tokio::test]
    async fn containers_run_the_mounted_supervisor() {
        let (engine, s) = sandbox(frame(b'x', b"exit 0 0 - 0 0"));
        s.run(container::tests::spec()).await.unwrap();
        let body = engine.bodies.lock().unwrap()[0].clone();
        assert_eq!(body.entrypoint.unwrap()[0], supervisor::CONTAINER_PATH);
        let mounts = body.host_config.unwrap().mounts.unwrap();
        assert!(mounts.iter().any(|m| {
            m.target.as_deref() == Some(supervisor::CONTAINER_PATH)
                && m.source == Some(supervisor::default_path().to_string_lossy().into_owned())
                && m.read_only == Some(true)
        }));
        gone(&engine).await;
    }
}
