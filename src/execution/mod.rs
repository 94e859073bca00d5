//! The execution service: one execution, from a typed request to a recorded result, with no HTTP
//! around it.
//!
//! The path of one execution, top to bottom — [`ExecutionService::admit`], then
//! [`Execution::run`]:
//! 1. **decide**: the allowlist ([`Policy::decide`]) or a registered external executor
//!    ([`invoke::decide`]) turns the request into a [`Plan`]; a refusal gets its audit line.
//! 2. **admit**: the plan's backend and one of its run slots, then the claim of a single-use
//!    capability token, then the `execution_start` line. Everything that can refuse the request
//!    comes before the claim, so a refused request does not use the token up; the claim comes
//!    before the start line, so nothing runs on a replayed token.
//! 3. **run**: the plan's [`RunSpec`] on the backend, in a task of its own.
//! 4. **record**: the result and its provenance, the one end line, the metrics.
//!
//! The api layer parses and authenticates a request into an [`ExecutionRequest`] and maps
//! [`ExecutionError`] and [`Finished`] to HTTP. Between the two calls the caller holds an
//! [`Execution`]: its `exec_id` is known and its start line written before anything runs.
//!
//! Owns: that order, the backends and their run slots, the kill switch of running executions.
//! Must not: know HTTP, or any backend's mechanism (it sees only the `Sandbox` trait).

pub mod record;
pub mod result;
pub mod runs;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tracing::Instrument as _;

use self::record::{AdmittedRun, KnownRequest, RefusalKind};
use self::result::{
    ExecutionResult, Provenance, Render, Unanswered, b64_unless_utf8, outcome_name,
};
use self::runs::{CancelOutcome, LiveRun, NewRun, Runs};
use crate::auth::Verified;
use crate::config::{Config, TokenKind};
use crate::executors::Registry;
use crate::executors::invoke::{self, ExternalCall, ExternalInvocation};
use crate::metrics::Metrics;
use crate::policy::language::Language;
use crate::policy::profile::NetworkMode;
use crate::policy::{ActionType, Ask, Plan, Policy, PolicyError};
use crate::provenance::audit::{self, AuditLog, RunEnd};
use crate::provenance::{command_hash, invocation_hash, sha256_prefixed};
use crate::sandbox::files::Kept;
use crate::sandbox::{
    BackendKind, BackendStatus, ExecCode, KilledReason, OutputTap, RunOutcome, RunSpec, Sandbox,
    SandboxError, Stop,
};
use crate::state::{IdemKey, JtiClaim, StateError, StateStore, StoredExecution, StoredResponse};

/// One execution as asked for: parsed and its caller authenticated, not yet decided.
#[derive(Debug, Clone)]
pub struct ExecutionRequest {
    pub request_id: String,
    /// The calling service's subject, else the capability token's (for the audit log).
    pub subject: Option<String>,
    /// Whose run this is: the calling service's subject, `-` for a service token without one
    /// (see [`owner_of`]). Only the same service reads, streams or cancels the run; a capability
    /// token's subject never decides it, as the lookups know only the service token.
    pub owner: String,
    /// The verified capability token: what this execution may do.
    pub capability: Verified,
    /// What is asked: an allowlisted command, an external executor or a session's exec.
    pub action: Action,
    /// The command's name, the executor's, or the session language's interpreter.
    pub command: String,
    pub args: Vec<String>,
    /// Already within the wire's bounds; the policy clamps it further.
    pub timeout_seconds: Option<u64>,
    /// An async or streamed run: it may last up to the profile's `max_async_timeout_seconds`.
    pub long_run: bool,
    pub profile: Option<String>,
    pub env: BTreeMap<String, String>,
    pub stdin: Option<String>,
    /// Echoed into provenance and the end line, never interpreted.
    pub metadata: Option<Map<String, Value>>,
    /// The Idempotency-Key the execution holds, as the state store scopes it (its audit lines
    /// carry it, so a daemon that stops mid-run can release it at its next start).
    pub idempotency_key: Option<String>,
    /// Raised when whoever asked for the execution stops waiting for it. A request still
    /// queued for a run slot then gives its place back and runs nothing; a run that started is
    /// not touched by it.
    pub abandoned: Option<watch::Receiver<bool>>,
}

/// The kinds of run an execution may ask for. Each is decided its own way, in one place
/// ([`ExecutionService::plan`] and admission go through the same match).
#[derive(Debug, Clone)]
pub enum Action {
    /// A command of the allowlist, run as `action_type` (`external` has its own kind).
    Command { action_type: ActionType },
    /// A registered external executor (the request's `command`), with its envelope's parts.
    Executor(ExternalParts),
    /// An exec in a session: the language's interpreter runs its code in the session's
    /// workspace (the request's `command` and `args` are the interpreter and the code file's
    /// path).
    SessionExec(SessionExec),
}

impl Action {
    /// The action type the policy, the audit log and provenance know the run by.
    pub fn action_type(&self) -> ActionType {
        match self {
            Action::Command { action_type } => *action_type,
            Action::Executor(_) => ActionType::External,
            Action::SessionExec(s) => s.language.action_type,
        }
    }

    /// The session an exec runs in, for the other kinds None.
    pub fn session(&self) -> Option<&SessionExec> {
        match self {
            Action::SessionExec(s) => Some(s),
            Action::Command { .. } | Action::Executor(_) => None,
        }
    }
}

/// What an exec in a session adds to its request.
#[derive(Debug, Clone)]
pub struct SessionExec {
    pub session_id: String,
    pub language: Arc<Language>,
    /// Where the session's workspace is and how the exec's code gets there.
    pub place: SessionPlace,
    /// `sha256:<hex>` of the code.
    pub code_sha256: String,
    /// Where the code starts, inside [`WORKSPACE`].
    pub cwd: PathBuf,
    /// The session's limits, each no looser than its profile's (the tighter one applies).
    pub limits: SessionLimits,
    /// The exec's deadline to the millisecond (`timeout_ms`), within what the policy allows.
    pub timeout: Option<Duration>,
}

/// Where a session's exec runs.
#[derive(Debug, Clone)]
pub enum SessionPlace {
    /// Local: a fresh sandbox with the session's host `workspace` bound at [`WORKSPACE`] and the
    /// host `code_file` bound read-only at the language's code path.
    Host {
        workspace: PathBuf,
        code_file: PathBuf,
        /// The session's own host uid (see [`crate::sandbox::uids`]); None only while a
        /// session is being decided, before it has one.
        uid: Option<u32>,
    },
    /// Docker/gVisor: the session's kept sandbox, which writes `code` at the language's path.
    Kept {
        sandbox: Arc<dyn Kept>,
        code: Arc<[u8]>,
    },
}

/// Where a session's workspace appears inside its sandbox.
pub const WORKSPACE: &str = "/workspace";

/// Limits a session asked for at creation; None keeps the profile's.
#[derive(
    Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, utoipa::ToSchema,
)]
#[serde(deny_unknown_fields)]
pub struct SessionLimits {
    pub cpus: Option<f64>,
    pub memory_mb: Option<u64>,
    pub disk_mb: Option<u64>,
    pub pids: Option<u64>,
    pub output_bytes: Option<usize>,
}

impl SessionLimits {
    /// Tightens `limits` to these (never loosens them).
    pub fn apply(&self, limits: &mut crate::sandbox::Limits) {
        if let Some(c) = self.cpus {
            limits.cpus = limits.cpus.min(c);
        }
        if let Some(m) = self.memory_mb {
            limits.memory_bytes = limits.memory_bytes.min(m << 20);
        }
        if let Some(d) = self.disk_mb {
            limits.disk_bytes = limits.disk_bytes.min(d << 20);
        }
        if let Some(p) = self.pids {
            limits.pids = limits.pids.min(p);
        }
        if let Some(o) = self.output_bytes {
            limits.output_bytes = limits.output_bytes.min(o);
        }
    }
}

/// What an `external` request carries for the executor's envelope and runtime model.
#[derive(Debug, Clone, Default)]
pub struct ExternalParts {
    pub activity: Option<Value>,
    pub input: Option<Value>,
    pub skills: Option<Value>,
    pub memory: Option<Value>,
    pub job: Option<Value>,
    pub task: Option<Value>,
    pub model: Option<String>,
}

impl ExecutionRequest {
    /// The parts an external executor's invocation is built from.
    fn external_call<'a>(&'a self, x: &'a ExternalParts) -> ExternalCall<'a> {
        ExternalCall {
            args: &self.args,
            stdin: self.stdin.as_deref(),
            orbit: self.metadata.as_ref().and_then(|m| m.get("orbit")),
            activity: x.activity.as_ref(),
            input: x.input.as_ref(),
            skills: x.skills.as_ref(),
            memory: x.memory.as_ref(),
            job: x.job.as_ref(),
            task: x.task.as_ref(),
            model: x.model.as_deref(),
        }
    }

    /// The request as a refusal's audit line tells it.
    pub fn known(&self) -> KnownRequest {
        KnownRequest {
            request_id: self.request_id.clone(),
            subject: self.subject.clone(),
            token_id: self.capability.token_id.clone(),
            action_type: Some(self.action.action_type().as_str().to_string()),
            command: Some(self.command.clone()),
            args: self.args.clone(),
        }
    }
}

/// Why an execution did not reach an outcome. Refusals (`Unauthorized`, `Refused`) have been
/// audited by the time they are returned.
#[derive(Debug, thiserror::Error)]
pub enum ExecutionError {
    /// The request is malformed in a way only deciding it shows.
    #[error("{0}")]
    Invalid(String),
    /// A single-use capability token was replayed or cannot be vouched for.
    #[error("single-use capability token refused")]
    Unauthorized,
    /// The policy refused the request; `allowed_commands` when the allowlist did.
    #[error("{reason}")]
    Refused {
        reason: String,
        allowed_commands: Option<Vec<String>>,
    },
    /// Every run slot of the backend is taken and its queue is full, or the request waited in
    /// it for `server.queue.max_wait_ms`; the detail says which.
    #[error("too many executions in progress: {0}")]
    Overloaded(String),
    /// A backend, the audit log or the state store cannot serve the request.
    #[error("{0}")]
    Unavailable(String),
    /// The run failed inside the daemon; the detail is for the log only.
    #[error("{0}")]
    Internal(String),
}

impl ExecutionError {
    /// The error vocabulary of the wire and of `execution_error` lines.
    pub fn error_type(&self) -> &'static str {
        match self {
            ExecutionError::Invalid(_) => "InvalidRequest",
            ExecutionError::Unauthorized => RefusalKind::Unauthorized.error_type(),
            ExecutionError::Refused { .. } => RefusalKind::CapabilityViolation.error_type(),
            ExecutionError::Overloaded(_) => "Overloaded",
            ExecutionError::Unavailable(_) => "SandboxUnavailable",
            ExecutionError::Internal(_) => "InternalError",
        }
    }
}

/// An execution that ran to an outcome.
#[derive(Debug)]
pub struct Finished {
    pub result: ExecutionResult,
    /// The wall clock ended it: the result is also an error (`ExecutionTimeout`).
    pub timed_out: bool,
}

/// Why a single-use token could not be claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError {
    /// Replayed, or issued before the store's record begins, with the reason.
    Refused(String),
    /// The state store did not answer.
    Unavailable(String),
}

/// Uses up a single-use token's jti (a token that is not single-use passes). A replay, or a token
/// the store cannot vouch for (issued before its record began), is refused.
pub async fn claim_single_use(store: &dyn StateStore, token: &Verified) -> Result<(), ClaimError> {
    let Some(su) = &token.single_use else {
        return Ok(());
    };
    let kind = match su.kind {
        TokenKind::Service => "service token",
        TokenKind::Capability => "capability token",
    };
    match store.claim_jti(su).await {
        Ok(JtiClaim::Claimed) => Ok(()),
        Ok(JtiClaim::Replayed) => Err(ClaimError::Refused(format!(
            "{kind}: replayed single-use token"
        ))),
        Ok(JtiClaim::PredatesRecord { since }) => Err(ClaimError::Refused(format!(
            "{kind}: single-use token issued before {since} (unix), when this daemon's replay \
             record begins (its state store was created empty then)"
        ))),
        Err(e) => Err(ClaimError::Unavailable(e.to_string())),
    }
}

/// Resolves when the flag becomes true; never when its sender is gone with it still false.
async fn raised(flag: &mut watch::Receiver<bool>) {
    if flag.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The run slots of one backend, at most `size` of its executions at once, and the queue in
/// front of them.
struct RunSlots {
    /// Fair: waiters get slots first come, first served.
    free: Arc<Semaphore>,
    size: usize,
    /// Requests waiting for a slot now; never above [`QueueLimits::max_waiting`].
    waiting: AtomicUsize,
}

/// How many requests may wait for a run slot of one backend, and for how long.
#[derive(Debug, Clone, Copy)]
struct QueueLimits {
    max_waiting: usize,
    max_wait: Duration,
}

/// A request's place in a backend's queue: counted while it waits, given back however the wait
/// ends (a slot, the time limit, or the caller going away).
struct QueuePlace<'a> {
    waiting: &'a AtomicUsize,
    gauge: metrics::Gauge,
}

impl<'a> QueuePlace<'a> {
    /// A place, unless `max_waiting` requests already wait.
    fn take(waiting: &'a AtomicUsize, max_waiting: usize, gauge: metrics::Gauge) -> Option<Self> {
        waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max_waiting).then_some(n + 1)
            })
            .ok()?;
        gauge.increment(1.0);
        Some(QueuePlace { waiting, gauge })
    }
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.gauge.decrement(1.0);
    }
}

/// The caller's command as a span attribute is clipped to this many characters: a span waits in
/// the exporter's queue (up to 2048 of them while a collector is slow), and the caller must not
/// set its size.
const SPAN_COMMAND_CHARS: usize = 128;

/// Decides, admits, runs and records executions. Shared by every request of the daemon.
pub struct ExecutionService {
    policy: Policy,
    executors: Registry,
    backends: BTreeMap<BackendKind, Arc<dyn Sandbox>>,
    slots: BTreeMap<BackendKind, RunSlots>,
    queue: QueueLimits,
    store: Arc<dyn StateStore>,
    audit: Arc<AuditLog>,
    metrics: Arc<Metrics>,
    /// The image of container runs whose profile names none.
    default_image: String,
    /// Raised when the daemon starts shutting down: no request waits for a run slot any more.
    queue_closed: watch::Sender<bool>,
    /// The runs that have not finished.
    runs: Arc<Runs>,
    /// This daemon instance (run records name the replica that runs them).
    instance: String,
    /// How other replicas reach this one, once it listens (see `server.advertise_url`).
    address: std::sync::OnceLock<String>,
    /// How long a finished run's record is kept.
    retention: Duration,
    /// What a run's record keeps when it has no answer of its caller's (the api layer's).
    render: Render,
}

impl ExecutionService {
    /// The service over these parts; run slots per backend come from `server.concurrency`, the
    /// queue in front of them from `server.queue`. `render` answers the runs whose record it
    /// finishes without their caller's answer ([`Unanswered`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &Config,
        instance: &str,
        policy: Policy,
        executors: Registry,
        backends: BTreeMap<BackendKind, Arc<dyn Sandbox>>,
        store: Arc<dyn StateStore>,
        audit: Arc<AuditLog>,
        metrics: Arc<Metrics>,
        render: Render,
    ) -> Self {
        let slots = BackendKind::ALL
            .iter()
            .map(|b| {
                let size = config.server.concurrency.for_backend(*b);
                let free = Arc::new(Semaphore::new(size));
                let waiting = AtomicUsize::new(0);
                (
                    *b,
                    RunSlots {
                        free,
                        size,
                        waiting,
                    },
                )
            })
            .collect();
        let queue = QueueLimits {
            max_waiting: config.server.queue.max_waiting,
            max_wait: Duration::from_millis(config.server.queue.max_wait_ms),
        };
        ExecutionService {
            policy,
            executors,
            backends,
            slots,
            queue,
            store,
            audit,
            metrics,
            default_image: config.sandbox.docker.image.clone(),
            queue_closed: watch::channel(false).0,
            runs: Arc::new(Runs::default()),
            instance: instance.to_string(),
            address: std::sync::OnceLock::new(),
            retention: Duration::from_secs(config.executions.retention_seconds),
            render,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The plan `req` would run with, deciding it as an admission does (a refusal is audited),
    /// without admitting anything: a session checks its grant with it when it is made.
    pub fn plan(&self, req: &ExecutionRequest) -> Result<Plan, ExecutionError> {
        self.decide(req).map(|(plan, _)| plan)
    }

    /// The state store runs and sessions are recorded in.
    pub fn store(&self) -> &Arc<dyn StateStore> {
        &self.store
    }

    pub fn audit(&self) -> &Arc<AuditLog> {
        &self.audit
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn executors(&self) -> &Registry {
        &self.executors
    }

    pub fn backends(&self) -> &BTreeMap<BackendKind, Arc<dyn Sandbox>> {
        &self.backends
    }

    /// Every backend's readiness, checked now (all at once, in backend order) and recorded in
    /// `executor_backend_ready{backend}`: /readyz, /capabilities and each /metrics scrape ask here,
    /// so the gauge is as current as the last of them.
    pub async fn backend_statuses(&self) -> Vec<BackendStatus> {
        let statuses = futures::future::join_all(self.backends.values().map(|b| b.status())).await;
        for s in &statuses {
            self.metrics
                .backend_ready
                .with_label_values(&[s.backend.as_str()])
                .set(if s.ready { 1.0 } else { 0.0 });
        }
        statuses
    }

    /// Opens the sandbox a session keeps for its life on the backends that keep one (docker,
    /// gVisor: one container), shaped as the session's execs will run: `req` is an exec of the
    /// session, decided here (as [`Self::plan`]) but neither admitted nor run. `None` on the
    /// local backend, whose execs each get a fresh sandbox bound to the session's workspace.
    pub async fn keep(
        &self,
        req: &ExecutionRequest,
        session_id: &str,
    ) -> Result<Option<Arc<dyn Kept>>, ExecutionError> {
        let (plan, external) = self.decide(req)?;
        let backend = self.backends.get(&plan.backend).cloned().ok_or_else(|| {
            ExecutionError::Unavailable(format!(
                "backend {} is not configured on this daemon",
                plan.backend.as_str()
            ))
        })?;
        let (mut spec, _) = self.run_spec(session_id, &plan, req, external.as_ref());
        // A kept sandbox has its workspace inside and gets each exec's code with the exec.
        spec.fs.workspace = None;
        spec.fs.extra_files.clear();
        // Only sessions with their profile's own limits have their containers kept warm: limits
        // a caller picks must not make the daemon hold a pool for each choice.
        let warm = req
            .action
            .session()
            .is_none_or(|s| s.limits == SessionLimits::default());
        backend
            .keep(&spec, session_id, warm)
            .await
            .map_err(|e| match e {
                SandboxError::Unavailable(m) => ExecutionError::Unavailable(m),
                other => ExecutionError::Internal(format!("{session_id}: {other}")),
            })
    }

    /// Refuses (as unavailable) the requests waiting for a run slot and every request that comes for one
    /// from now on: a daemon that is shutting down starts nothing new, a queued request included
    /// (it would only be killed at the end of the grace, half done).
    pub fn close_queue(&self) {
        self.queue_closed.send_replace(true);
    }

    /// Kills every running execution (each ends with `killed_reason: signal`), and every one
    /// admitted from now on as soon as it starts; closes the queue ([`Self::close_queue`]). The
    /// same stop control as a cancel, with no grace.
    pub fn kill_running(&self) {
        self.close_queue();
        self.runs.stop_all(Stop {
            reason: KilledReason::Signal,
            grace: Duration::ZERO,
        });
    }

    /// Ends every backend before the daemon exits (see [`Sandbox::shutdown`]): called once runs
    /// and sessions are over, so nothing the backends made outlives the daemon.
    pub async fn shutdown_backends(&self) {
        futures::future::join_all(self.backends.values().map(|b| b.shutdown())).await;
    }

    /// The runs of this daemon that have not finished.
    pub fn runs(&self) -> &Runs {
        &self.runs
    }

    /// Records how other replicas reach this one (set once, when it listens).
    pub fn set_address(&self, url: String) {
        let _ = self.address.set(url);
    }

    /// How other replicas reach this one, if known.
    pub fn address(&self) -> Option<&str> {
        self.address.get().map(String::as_str)
    }

    /// This daemon instance's id.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Resolves when no execution holds a run slot and every started run's answer is stored.
    pub async fn wait_idle(&self) {
        while !self.runs.is_empty()
            || self
                .slots
                .values()
                .any(|s| s.free.available_permits() < s.size)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Admits one execution: decides it, takes a run slot, claims a single-use capability
    /// token and writes the start line, in that order (see the module's header). The returned
    /// [`Execution`] has not started.
    pub async fn admit(&self, req: ExecutionRequest) -> Result<Execution, ExecutionError> {
        let (plan, external) = self.decide(&req)?;
        let backend = self.backends.get(&plan.backend).cloned().ok_or_else(|| {
            ExecutionError::Unavailable(format!(
                "backend {} is not configured on this daemon",
                plan.backend.as_str()
            ))
        })?;
        let slot = self.take_slot(plan.backend, req.abandoned.as_ref()).await?;

        let exec_id = format!("exec-{}", uuid::Uuid::new_v4().simple());
        // The request's span (`http.request`) declares the field: from here on it names the run.
        tracing::Span::current().record("exec_id", exec_id.as_str());
        let (mut spec, invocation_hash) = self.run_spec(&exec_id, &plan, &req, external.as_ref());
        let (stop, stop_rx) = watch::channel(None);
        spec.stop = Some(stop_rx);
        let owner = req.owner.clone();
        let timestamp = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);

        // Single-use tokens are consumed only once the request is otherwise acceptable to run.
        match claim_single_use(&*self.store, &req.capability).await {
            Ok(()) => {}
            Err(ClaimError::Refused(reason)) => {
                self.refuse(&req, RefusalKind::Unauthorized, &reason);
                return Err(ExecutionError::Unauthorized);
            }
            Err(ClaimError::Unavailable(m)) => return Err(ExecutionError::Unavailable(m)),
        }
        let run = audit::Run {
            request_id: req.request_id.clone(),
            exec_id: exec_id.clone(),
            subject: req.subject.clone(),
            owner: Some(req.owner.clone()),
            token_id: req.capability.token_id.clone(),
            action_type: req.action.action_type().as_str().into(),
            command_hash: command_hash(&req.command, &req.args),
            command: req.command,
            args: req.args,
            invocation_hash,
            backend: plan.backend.as_str().into(),
            profile: plan.profile.name.clone(),
            timeout_seconds: plan.timeout_seconds,
            idempotency_key: req.idempotency_key,
        };
        // Nothing runs unaudited. A refused start bought no run: the token stays usable (and the
        // caller releases the idempotency key on any error).
        let admitted = match AdmittedRun::admit(&self.audit, &self.metrics, run) {
            Ok(a) => a,
            Err(e) => {
                if let Some(token) = &req.capability.single_use
                    && let Err(e) = self.store.release_jti(token).await
                {
                    tracing::error!(request_id = %req.request_id, error = %e, "single-use token not released");
                }
                return Err(ExecutionError::Unavailable(format!(
                    "audit log unavailable: {}",
                    e.cause()
                )));
            }
        };
        tracing::info!(request_id = %req.request_id, %exec_id, command = %plan.command, backend = plan.backend.as_str(), profile = %plan.profile.name, "execution start");
        Ok(Execution {
            plan,
            spec,
            stop,
            owner,
            backend,
            slot,
            executor_def_sha256: external.map(|x| x.def_sha256),
            session: req
                .action
                .session()
                .map(|s| (s.session_id.clone(), s.code_sha256.clone())),
            timestamp,
            metadata: req.metadata,
            admitted,
            metrics: self.metrics.clone(),
        })
    }

    /// A run slot of `backend`: a free one at once, else the first one freed after the requests
    /// queued before this one, within `server.queue.max_wait_ms`. Overloaded when the queue is
    /// full, the wait runs out or the caller raises `abandoned` meanwhile (its place is given
    /// back either way); Unavailable once the daemon is shutting down ([`Self::close_queue`]).
    async fn take_slot(
        &self,
        backend: BackendKind,
        abandoned: Option<&watch::Receiver<bool>>,
    ) -> Result<OwnedSemaphorePermit, ExecutionError> {
        let slots = self
            .slots
            .get(&backend)
            .ok_or_else(|| ExecutionError::Unavailable("no run slots".into()))?;
        let shutting_down = || ExecutionError::Unavailable("the daemon is shutting down".into());
        let mut closed = self.queue_closed.subscribe();
        if *closed.borrow_and_update() {
            return Err(shutting_down());
        }
        let label = [backend.as_str()];
        let waited = self.metrics.queue_wait.with_label_values(&label);
        if let Ok(slot) = slots.free.clone().try_acquire_owned() {
            waited.record(0.0);
            return Ok(slot);
        }
        let gauge = self.metrics.queue_waiting.with_label_values(&label);
        let Some(_place) = QueuePlace::take(&slots.waiting, self.queue.max_waiting, gauge) else {
            return Err(ExecutionError::Overloaded(format!(
                "all {} {} run slots are busy and their queue is full (server.queue.max_waiting = {})",
                slots.size,
                backend.as_str(),
                self.queue.max_waiting
            )));
        };
        let since = std::time::Instant::now();
        let mut abandoned = abandoned.cloned();
        let caller_left = async {
            match abandoned.as_mut() {
                Some(flag) => raised(flag).await,
                None => std::future::pending().await,
            }
        };
        let slot = tokio::select! {
            slot = tokio::time::timeout(self.queue.max_wait, slots.free.clone().acquire_owned()) => slot,
            _ = raised(&mut closed) => return Err(shutting_down()),
            _ = caller_left => {
                return Err(ExecutionError::Overloaded(format!(
                    "the caller went away while waiting for a {} run slot",
                    backend.as_str()
                )));
            }
        };
        waited.record(since.elapsed().as_secs_f64());
        match slot {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_closed)) => Err(ExecutionError::Unavailable("run slots closed".into())),
            Err(_elapsed) => Err(ExecutionError::Overloaded(format!(
                "no {} run slot came free within server.queue.max_wait_ms = {}",
                backend.as_str(),
                self.queue.max_wait.as_millis()
            ))),
        }
    }

    /// Admits and runs one execution to its result.
    pub async fn execute(&self, req: ExecutionRequest) -> Result<Finished, ExecutionError> {
        self.admit(req).await?.run().await
    }

    /// Starts an admitted execution on a task of its own and returns its live run at once. When
    /// it ends, `answer` turns its result into the answer its caller gets; the answer is stored
    /// as the run's record for `executions.retention_seconds` (any replica sharing the store
    /// reads it), then handed to whoever waits on the live run. A caller that goes away stops
    /// nothing.
    pub fn start(
        &self,
        execution: Execution,
        answer: impl FnOnce(Result<Finished, ExecutionError>) -> StoredResponse + Send + 'static,
    ) -> Arc<LiveRun> {
        let exec_id = execution.exec_id().to_string();
        let key = IdemKey {
            subject: execution.owner.clone(),
            key: exec_id.clone(),
        };
        let mut execution = execution;
        let live = self.runs.register(
            NewRun {
                exec_id: exec_id.clone(),
                owner: execution.owner.clone(),
                backend: execution.plan.backend.as_str(),
                profile: execution.plan.profile.name.clone(),
            },
            execution.stop.clone(),
        );
        let tapped = live.clone();
        execution.spec.output_tap = Some(OutputTap::new(move |stream, chunk| {
            tapped.push_output(stream, chunk)
        }));
        self.metrics.live_runs.set(self.runs.len() as f64);
        let (store, runs, metrics) = (self.store.clone(), self.runs.clone(), self.metrics.clone());
        let (instance, retention, render) = (self.instance.clone(), self.retention, self.render);
        let address = self.address.get().cloned();
        let ran_on = (
            execution.plan.backend.as_str().to_string(),
            execution.plan.profile.name.clone(),
        );
        // The record that says "running" reaches the store before anything can finish: it
        // lives at most the run's own time limit beyond the retention.
        let running_ttl = execution.spec.limits.timeout + retention;
        let task_live = live.clone();
        let task = async move {
            let record =
                |response: Option<StoredResponse>, cancelled_by: Option<String>| StoredExecution {
                    instance: instance.clone(),
                    address: address.clone(),
                    response,
                    cancelled_by,
                    backend: Some(ran_on.0.clone()),
                    profile: Some(ran_on.1.clone()),
                };
            log_store_error(
                &exec_id,
                store
                    .execution_put(&key, &record(None, None), running_ttl)
                    .await,
            );
            // The run on a task of its own: should it panic, the execution's drop still writes
            // its error line and frees its slot, and the run still gets an answer here instead of
            // staying live with its waiters waiting forever.
            let ran = match tokio::spawn(execution.run().in_current_span()).await {
                Ok(ran) => ran,
                Err(e) => Err(ExecutionError::Internal(format!(
                    "the run's task failed: {e}"
                ))),
            };
            task_live.mark_ended();
            let cancelled = matches!(&ran, Ok(f)
                if f.result.killed_reason == Some(KilledReason::Cancelled.as_str()));
            let response = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(ran)))
                .unwrap_or_else(|_| {
                    tracing::error!(%exec_id, "the run's answer could not be made");
                    render(&Unanswered::AnswerFailed)
                });
            let finished = record(
                Some(response.clone()),
                task_live.cancelled_by().filter(|_| cancelled),
            );
            let stored = put_final(&*store, &key, &finished, retention, &exec_id).await;
            task_live.set_answer(Arc::new(response));
            if stored {
                runs.remove(&exec_id);
            } else {
                // Other replicas see "running" until the record expires; this one answers.
                runs.keep_until(&exec_id, std::time::Instant::now() + retention);
            }
            metrics.live_runs.set(runs.len() as f64);
        };
        // Both tasks stay in the caller's span: the run's steps belong to the request that
        // started it, even when that request answered long before (async, streamed).
        tokio::spawn(task.in_current_span());
        live
    }

    /// Where run `exec_id` of `owner` stands: live on this daemon, or as the state store
    /// records it (finished, or running on another replica); None when `owner` has no such
    /// run (another subject's run included).
    pub async fn lookup(&self, owner: &str, exec_id: &str) -> Result<Lookup, StateError> {
        if let Some(live) = self.runs.find(owner, exec_id) {
            return Ok(Lookup::Live(live));
        }
        let key = IdemKey {
            subject: owner.to_string(),
            key: exec_id.to_string(),
        };
        Ok(match self.store.execution_get(&key).await? {
            // This daemon wrote "running" and no longer holds the run: its finished record
            // was refused by the store and the keeping ran out. The answer is lost; saying
            // "running" would keep a caller polling until the record expires.
            Some(r) if r.response.is_none() && r.instance == self.instance => {
                Lookup::Stored(StoredExecution {
                    response: Some((self.render)(&Unanswered::Lost)),
                    ..r
                })
            }
            Some(r) => Lookup::Stored(r),
            None => Lookup::Unknown,
        })
    }

    /// Stops a live run on behalf of `by` (audited with who asked): SIGTERM to every process of
    /// the run, SIGKILL after `grace`. A run asked before keeps its first request.
    pub fn cancel(
        &self,
        live: &LiveRun,
        grace: Duration,
        by: &str,
        request_id: &str,
    ) -> CancelOutcome {
        let stop = Stop {
            reason: KilledReason::Cancelled,
            grace,
        };
        let outcome = self.runs.cancel(live, stop, by);
        if outcome == CancelOutcome::Stopping {
            self.metrics.cancels.increment(1);
            let line = audit::AuditEvent::ExecutionCancel(audit::Cancel {
                request_id: request_id.to_string(),
                exec_id: live.exec_id().to_string(),
                subject: Some(by.to_string()),
                grace_seconds: grace.as_secs(),
            });
            if let Err(e) = self.audit.append(&line) {
                self.metrics
                    .audit_append_failures
                    .with_label_values(&["execution_cancel"])
                    .increment(1);
                tracing::error!(exec_id = live.exec_id(), by, error = %e, "audit append failed");
            }
        }
        outcome
    }

    /// The plan of an allowlisted command or of a registered external executor (with what its
    /// invocation adds); a refusal is audited here.
    #[tracing::instrument(
        name = "policy.decide",
        skip_all,
        fields(
            request_id = %req.request_id,
            action_type = req.action.action_type().as_str(),
            command = %crate::auth::clip(&req.command, SPAN_COMMAND_CHARS),
        )
    )]
    fn decide(
        &self,
        req: &ExecutionRequest,
    ) -> Result<(Plan, Option<ExternalInvocation>), ExecutionError> {
        let ask = Ask {
            action_type: Some(req.action.action_type()),
            command: &req.command,
            args: &req.args,
            timeout_seconds: req.timeout_seconds,
            long_run: req.long_run,
            profile: req.profile.as_deref(),
            env: &req.env,
        };
        let grant = &req.capability.grant;
        let decided = match &req.action {
            Action::Command { .. } => self.policy.decide(&ask, grant).map(|p| (p, None)),
            Action::Executor(parts) => invoke::decide(
                &self.executors,
                &self.policy,
                &ask,
                grant,
                &req.external_call(parts),
            ),
            Action::SessionExec(session) => self
                .policy
                .decide_language(&session.language, &ask, grant)
                .map(|mut plan| {
                    session.limits.apply(&mut plan.limits);
                    if let Some(t) = session.timeout {
                        plan.limits.timeout =
                            plan.limits.timeout.min(t.max(Duration::from_millis(1)));
                    }
                    (plan, None)
                }),
        };
        decided.map_err(|e| match e {
            PolicyError::Refused(r) => {
                self.refuse(req, RefusalKind::CapabilityViolation, &r.reason);
                ExecutionError::Refused {
                    allowed_commands: (r.rule == "allowlist").then(|| self.policy.allowed_names()),
                    reason: r.reason,
                }
            }
            PolicyError::Invalid(m) => ExecutionError::Invalid(m),
            PolicyError::Unavailable(m) => ExecutionError::Unavailable(m),
        })
    }

    /// What the backend runs, and the invocation hash over everything that decides it.
    fn run_spec(
        &self,
        exec_id: &str,
        plan: &Plan,
        req: &ExecutionRequest,
        external: Option<&ExternalInvocation>,
    ) -> (RunSpec, String) {
        let (argv_tail, stdin) = match external {
            Some(x) => (x.argv_tail.clone(), Some(x.stdin.clone())),
            None => (
                req.args.clone(),
                req.stdin.as_ref().map(|s| s.clone().into_bytes()),
            ),
        };
        let mut spec = plan.run_spec(exec_id, &argv_tail, stdin, &self.default_image);
        if let Some(x) = external {
            spec.fs.extra_files = x.extra_files.clone();
            spec.env.extend(x.env.clone());
        }
        if let Some(s) = req.action.session() {
            spec.fs.workdir = PathBuf::from(WORKSPACE);
            spec.fs.cwd = Some(s.cwd.clone());
            spec.env.insert("HOME".into(), WORKSPACE.into());
            match &s.place {
                // A fresh sandbox bound to the session's host workspace, the code bound in.
                SessionPlace::Host {
                    workspace,
                    code_file,
                    uid,
                } => {
                    if let Some(uid) = uid {
                        spec.uid = *uid;
                    }
                    spec.fs.workspace = Some(workspace.clone());
                    spec.fs.extra_files = vec![(code_file.clone(), s.language.code_path())];
                }
                // The session's own sandbox, which writes the code where the interpreter reads it.
                SessionPlace::Kept { sandbox, code } => {
                    spec.kept = Some(sandbox.clone());
                    spec.code = Some(ExecCode {
                        path: s.language.code_path(),
                        bytes: code.clone(),
                    });
                }
            }
        }
        let mut decides = json!({
            "action_type": req.action.action_type().as_str(),
            "command": plan.command,
            "path": plan.path,
            "args": argv_tail,
            "stdin_sha256": spec.stdin.as_deref().map(sha256_prefixed),
            "env": spec.env,
            "profile": plan.profile.name,
            "backend": plan.backend.as_str(),
            "image": spec.image,
            "executor_def_sha256": external.map(|x| &x.def_sha256),
            "limits": spec.limits,
        });
        // Only a session's exec has the key: every other request's hash stays as it was.
        if let Some(s) = req.action.session() {
            decides["session"] = json!({
                "id": s.session_id,
                "code_sha256": s.code_sha256,
                "cwd": s.cwd,
            });
        }
        (spec, invocation_hash(&decides))
    }

    fn refuse(&self, req: &ExecutionRequest, kind: RefusalKind, reason: &str) {
        record::refusal(&self.audit, &self.metrics, &req.known(), kind, reason);
    }
}

/// An admitted execution that has not run yet: its start line is written and it holds a run
/// slot of its backend. [`Execution::run`] runs it to its result; dropped instead, it ends with
/// an `execution_error` line and frees its slot. It owns everything it needs, so it may run on
/// any task.
pub struct Execution {
    plan: Plan,
    spec: RunSpec,
    /// The run's stop control (its backend watches `spec.stop`).
    stop: watch::Sender<Option<Stop>>,
    /// Who may see the run: the calling service's subject.
    owner: String,
    backend: Arc<dyn Sandbox>,
    slot: OwnedSemaphorePermit,
    /// Set for an external executor.
    executor_def_sha256: Option<String>,
    /// An exec in a session: the session's id and the code's digest.
    session: Option<(String, String)>,
    /// When it was admitted (provenance's `timestamp`).
    timestamp: String,
    metadata: Option<Map<String, Value>>,
    admitted: AdmittedRun,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("exec_id", &self.spec.exec_id)
            .field("command", &self.plan.command)
            .field("backend", &self.plan.backend)
            .field("profile", &self.plan.profile.name)
            .finish_non_exhaustive()
    }
}

impl Execution {
    pub fn exec_id(&self) -> &str {
        &self.spec.exec_id
    }

    /// Runs the execution, then records it: the result with its provenance, the end line, the
    /// metrics. Without an outcome (the backend failed) the end line is an `execution_error`
    /// with what the caller is told and why.
    pub async fn run(self) -> Result<Finished, ExecutionError> {
        let Execution {
            plan,
            spec,
            stop: _,
            owner: _,
            backend,
            slot,
            executor_def_sha256,
            session,
            timestamp,
            metadata,
            admitted,
            metrics,
        } = self;
        let exec_id = spec.exec_id.clone();
        let backend_label = plan.backend.as_str();
        metrics
            .inflight
            .with_label_values(&[backend_label])
            .increment(1.0);
        let span = tracing::info_span!(
            "sandbox.run",
            backend = backend_label,
            profile = %plan.profile.name,
            request_id = %admitted.run().request_id,
            exec_id = %exec_id,
        );
        // The run is its own task: a panic in a backend fails this execution, not the daemon.
        let task = tokio::spawn(
            async move {
                let r = backend.run(spec).await;
                drop(slot);
                r
            }
            .instrument(span),
        );
        let joined = task.await;
        metrics
            .inflight
            .with_label_values(&[backend_label])
            .decrement(1.0);
        let failed = match joined {
            Ok(Ok(o)) => Ok(o),
            Ok(Err(SandboxError::Unavailable(m))) => {
                Err((ExecutionError::Unavailable(m.clone()), m))
            }
            Ok(Err(e)) => Err((
                ExecutionError::Internal(format!("{exec_id}: {e}")),
                e.to_string(),
            )),
            Err(e) => Err((
                ExecutionError::Internal(format!("{exec_id}: run task failed: {e}")),
                format!("run task failed: {e}"),
            )),
        };
        let outcome = match failed {
            Ok(o) => o,
            Err((answer, error)) => {
                admitted.fail(answer.error_type(), &error);
                return Err(answer);
            }
        };

        let who = admitted.run().clone();
        let name = outcome_name(&outcome);
        let (error_code, error) = match executor_def_sha256 {
            Some(_) => invoke::error_fields(&outcome, name),
            None => (None, None),
        };
        let timed_out = outcome.timed_out();
        let capabilities_used: Vec<&'static str> =
            plan.capabilities_used.iter().map(|c| c.as_str()).collect();
        let stdout_sha256 = sha256_prefixed(&outcome.stdout);
        let stderr_sha256 = sha256_prefixed(&outcome.stderr);
        let network =
            (plan.profile.network.mode == NetworkMode::Egress).then(|| outcome.network.clone());
        let audit_seq = admitted.finish(RunEnd {
            capabilities_used: capabilities_used.clone(),
            outcome: name,
            exit_code: outcome.exit_code(),
            duration_ms: duration_ms(&outcome),
            killed_reason: outcome.killed_reason.map(KilledReason::as_str),
            oom: outcome.oom,
            peak_memory_kib: outcome.peak_memory_kib,
            stdout_sha256: stdout_sha256.clone(),
            stderr_sha256: stderr_sha256.clone(),
            stdout_truncated: outcome.stdout_truncated,
            stderr_truncated: outcome.stderr_truncated,
            executor_def_sha256: executor_def_sha256.clone(),
            error_code: executor_def_sha256.is_some().then_some(error_code),
            network: network.clone(),
            metadata: metadata.clone(),
        });
        record::run_metrics(&metrics, &plan, name, &outcome);

        let result = ExecutionResult {
            success: name == "success",
            stdout: String::from_utf8_lossy(&outcome.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&outcome.stderr).into_owned(),
            stdout_b64: b64_unless_utf8(&outcome.stdout),
            stderr_b64: b64_unless_utf8(&outcome.stderr),
            exit_code: outcome.exit_code(),
            duration_ms: duration_ms(&outcome),
            provenance: Provenance {
                arm_id: "executor",
                timestamp,
                action_type: plan.action_type.as_str(),
                command_hash: who.command_hash,
                capabilities_used,
                exec_id: exec_id.clone(),
                request_id: who.request_id,
                token_id: who.token_id,
                subject: who.subject,
                backend: backend_label,
                profile: plan.profile.name.clone(),
                invocation_hash: who.invocation_hash,
                stdout_sha256,
                stderr_sha256,
                executor_def_sha256,
                session_id: session.as_ref().map(|s| s.0.clone()),
                code_sha256: session.map(|s| s.1),
                audit_seq,
                metadata,
            },
            exec_id,
            outcome: name,
            backend: backend_label,
            profile: plan.profile.name.clone(),
            stdout_truncated: outcome.stdout_truncated,
            stderr_truncated: outcome.stderr_truncated,
            peak_memory_kib: outcome.peak_memory_kib,
            oom: outcome.oom,
            killed_reason: outcome.killed_reason.map(KilledReason::as_str),
            error_code,
            network,
            error: if timed_out {
                Some(format!(
                    "Command execution exceeded timeout of {} seconds",
                    plan.timeout_seconds
                ))
            } else {
                error
            },
            error_type: timed_out.then_some("ExecutionTimeout"),
            retryable: timed_out.then_some(false),
        };
        tracing::info!(request_id = %result.provenance.request_id, exec_id = %result.exec_id, outcome = result.outcome, exit_code = result.exit_code, duration_ms = result.duration_ms, "execution end");
        Ok(Finished { result, timed_out })
    }
}

/// Where a run stands, as [`ExecutionService::lookup`] finds it.
pub enum Lookup {
    /// Running on this daemon.
    Live(Arc<LiveRun>),
    /// As the state store records it: finished (with its answer), or running on another replica.
    Stored(StoredExecution),
    /// No run of this caller's has that id (or its record expired).
    Unknown,
}

/// The owner of a run started by a caller with this subject (one without is `-`, like the
/// scope of its Idempotency-Keys).
pub fn owner_of(subject: Option<&str>) -> String {
    subject.unwrap_or("-").to_string()
}

/// Stores a finished run's record, trying again over a few seconds when the store fails: a
/// record left "running" would hide the answer from every other replica. Returns whether it
/// was stored.
async fn put_final(
    store: &dyn StateStore,
    key: &IdemKey,
    record: &StoredExecution,
    retention: Duration,
    exec_id: &str,
) -> bool {
    const RETRIES: [Duration; 3] = [
        Duration::from_millis(200),
        Duration::from_secs(1),
        Duration::from_secs(3),
    ];
    for pause in std::iter::once(Duration::ZERO).chain(RETRIES) {
        tokio::time::sleep(pause).await;
        match store.execution_put(key, record, retention).await {
            Ok(()) => return true,
            Err(e) => tracing::warn!(exec_id, error = %e, "run record not stored"),
        }
    }
    tracing::error!(
        exec_id,
        "run record not stored; this daemon answers for the run until its retention ends"
    );
    false
}

fn log_store_error(exec_id: &str, r: Result<(), StateError>) {
    if let Err(e) = r {
        tracing::error!(exec_id, error = %e, "run record not stored");
    }
}

fn duration_ms(o: &RunOutcome) -> u64 {
    o.duration.as_millis() as u64
}

#[cfg(test)]
mod tests;
