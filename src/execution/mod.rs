//! The execution service: one execution, from a typed request to a recorded result, with no HTTP
//! around it.
//!
//! The path of one execution, top to bottom — [`ExecutionService::admit`], then
//! [`Execution::run`]:
//! 1. **decide** ([`plan`]): one match over the kind of run asked for ([`Action`]) sends it to the
//!    allowlist ([`Policy::decide`]), a registered external executor ([`invoke::decide`]) or a
//!    session's language, which turns it into a [`Plan`]; a refusal gets its audit line.
//! 2. **admit** ([`admission`]): the plan's backend and one of its run slots, then the claim of a
//!    single-use capability token, then the `execution_start` line. Everything that can refuse
//!    the request comes before the claim, so a refused request does not use the token up; the
//!    claim comes before the start line, so nothing runs on a replayed token.
//! 3. **run** ([`run`]): the plan's [`RunSpec`] on the backend, in a task of its own.
//! 4. **record** ([`run`], [`record`], [`runs`]): the result and its provenance, the one end
//!    line, the metrics; for a started run, its record in the state store.
//!
//! The files, one step each:
//! - [`request`]: the request and the kinds of run ([`ExecutionRequest`], [`Action`]).
//! - [`session`]: what a session's exec carries down to its run: where it runs
//!   ([`SessionPlace`]), the session's limits, and how they shape its plan and `RunSpec`
//!   (sessions themselves live above this layer).
//! - [`plan`]: deciding a request, and the [`RunSpec`] and invocation hash of its plan.
//! - [`admission`]: run slots, the queue in front of them, single-use claims.
//! - [`run`]: an admitted [`Execution`], run to its result.
//! - [`result`]: what an execution answers: its result and its typed errors
//!   ([`ExecutionError`]).
//! - [`record`]: the audit lines and metrics an execution leaves.
//! - [`runs`]: the live runs, their owners, and their records in the state store (with the
//!   runs finished without their caller's answer, [`Unanswered`]).
//! - this file: the service, which holds the parts and goes through the steps in order.
//!
//! The api layer parses and authenticates a request into an [`ExecutionRequest`] and maps
//! [`ExecutionError`], [`Finished`] and [`Unanswered`] to HTTP. Between the two calls the
//! caller holds an [`Execution`]: its `exec_id` is known and its start line written before
//! anything runs.
//!
//! Owns: that order, the backends and their run slots, the kill switch of running executions.
//! Must not: know HTTP, or any backend's mechanism (it sees only the `Sandbox` trait).
//!
//! [`RunSpec`]: crate::sandbox::RunSpec
//! [`invoke::decide`]: crate::executors::invoke::decide

pub mod admission;
pub mod plan;
pub mod receipt;
pub mod record;
pub mod request;
pub mod result;
pub mod run;
pub mod runs;
pub mod session;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use tokio::sync::{Semaphore, watch};
use tracing::Instrument as _;

pub use self::admission::{ClaimError, claim_single_use};
use self::admission::{QueueLimits, RunSlots};
use self::record::{AdmittedRun, RefusalKind};
pub use self::request::{Action, ExecutionRequest, ExternalParts};
pub use self::result::{ExecutionError, Finished};
pub use self::run::Execution;
use self::runs::{CancelOutcome, LiveRun, NewRun, Runs, log_store_error, put_final};
pub use self::runs::{Lookup, Render, Unanswered, owner_of};
pub use self::session::{
    Background, SessionExec, SessionLimits, SessionPlace, TERMINAL_PROGRAM, Terminal,
    TerminalCommand, WORKSPACE, terminal_args,
};
use crate::config::Config;
use crate::executors::Registry;
use crate::metrics::Metrics;
use crate::policy::{Plan, Policy};
use crate::provenance::audit::{self, AuditLog};
use crate::provenance::command_hash;
use crate::sandbox::files::Kept;
use crate::sandbox::{
    BackendKind, BackendStatus, KilledReason, OutputTap, Sandbox, SandboxError, Stop,
};
use crate::state::{IdemKey, StateError, StateStore, StoredExecution, StoredResponse};

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
    /// Signs each finished run's receipt.
    receipts: Option<Arc<crate::provenance::keys::SigningKey>>,
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
        receipts: Option<Arc<crate::provenance::keys::SigningKey>>,
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
            receipts,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The plan `req` would run with, deciding it as an admission does (a refusal is audited),
    /// without admitting anything: a session checks its grant with it when it is made.
    pub fn plan(&self, req: &ExecutionRequest) -> Result<Plan, ExecutionError> {
        self.decide(req).map(|d| d.plan)
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
    /// `warm`: the sandbox may come from (and its backend keeps) a warm pool of such sandboxes.
    pub async fn keep(
        &self,
        req: &ExecutionRequest,
        session_id: &str,
        warm: bool,
    ) -> Result<Option<Arc<dyn Kept>>, ExecutionError> {
        let decision = self.decide(req)?;
        let plan = &decision.plan;
        let backend = self.backends.get(&plan.backend).cloned().ok_or_else(|| {
            ExecutionError::Unavailable(format!(
                "backend {} is not configured on this daemon",
                plan.backend.as_str()
            ))
        })?;
        let (mut spec, _) = self.run_spec(session_id, &decision, req);
        // A kept sandbox has its workspace inside and gets each exec's code with the exec.
        spec.fs.workspace = None;
        spec.fs.extra_files.clear();
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
        let decision = self.decide(&req)?;
        let backend = self
            .backends
            .get(&decision.plan.backend)
            .cloned()
            .ok_or_else(|| {
                ExecutionError::Unavailable(format!(
                    "backend {} is not configured on this daemon",
                    decision.plan.backend.as_str()
                ))
            })?;
        let slot = self
            .take_slot(decision.plan.backend, req.abandoned.as_ref())
            .await?;

        let exec_id = format!("exec-{}", uuid::Uuid::new_v4().simple());
        // The request's span (`http.request`) declares the field: from here on it names the run.
        tracing::Span::current().record("exec_id", exec_id.as_str());
        let (mut spec, invocation_hash) = self.run_spec(&exec_id, &decision, &req);
        let executor_def_sha256 = decision.executor_def_sha256().map(str::to_string);
        let plan = decision.plan;
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
            via: req.via.map(Into::into),
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
            executor_def_sha256,
            session: req.action.session().map(|s| run::RunSession {
                id: s.session_id.clone(),
                code_sha256: s.code_sha256.clone(),
                tenant: s.tenant.clone(),
            }),
            timestamp,
            ring: req
                .action
                .session()
                .and_then(|s| s.background.as_ref())
                .map(|b| b.ring_bytes),
            metadata: req.metadata,
            admitted,
            metrics: self.metrics.clone(),
            receipts: self.receipts.clone(),
        })
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
                ring: execution.ring,
            },
            execution.stop.clone(),
        );
        let tapped = live.clone();
        let tap = OutputTap::new(move |stream, chunk| tapped.push_output(stream, chunk));
        // A background process's readers follow all of its output through its ring; its record
        // keeps what its output cap keeps, as every run's does.
        execution.spec.output_tap = Some(match execution.ring {
            Some(_) => tap.past_cap(),
            None => tap,
        });
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
}

#[cfg(test)]
mod tests {
    //! The execution service on its own, with no HTTP around it: a recording fake backend stands in
    //! for the sandbox (the backends have their own tests against the real mechanisms).

    use std::path::Path;
    use std::sync::Mutex;

    use serde_json::{Map, Value, json};

    use super::*;
    use crate::auth::{SingleUse, Verified};
    use crate::config::{EnvOverrides, TokenKind};
    use crate::policy::{ActionType, Grant};
    use crate::provenance::sha256_prefixed;
    use crate::sandbox::{BackendStatus, ExitKind, RunOutcome, RunSpec};
    use crate::state::memory::MemoryStore;

    /// Records every spec it is handed and answers with `answer`.
    struct Recording {
        kind: BackendKind,
        specs: Arc<Mutex<Vec<RunSpec>>>,
        answer: fn() -> Result<RunOutcome, SandboxError>,
    }

    #[async_trait::async_trait]
    impl Sandbox for Recording {
        fn kind(&self) -> BackendKind {
            self.kind
        }

        async fn status(&self) -> BackendStatus {
            BackendStatus {
                backend: self.kind,
                ready: true,
                detail: "recording".into(),
            }
        }

        async fn run(&self, spec: RunSpec) -> Result<RunOutcome, SandboxError> {
            self.specs.lock().unwrap().push(spec);
            (self.answer)()
        }
    }

    fn said_hi() -> Result<RunOutcome, SandboxError> {
        Ok(RunOutcome {
            exit: ExitKind::Exited(0),
            stdout: b"hi\n".to_vec(),
            stderr: Vec::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            duration: Duration::from_millis(3),
            peak_memory_kib: Some(512),
            oom: false,
            killed_reason: None,
            stdin_broken_pipe: false,
            network: Vec::new(),
            container: None,
        })
    }

    fn engine_gone() -> Result<RunOutcome, SandboxError> {
        Err(SandboxError::Unavailable(
            "docker engine unreachable".into(),
        ))
    }

    struct Fixture {
        service: ExecutionService,
        specs: Arc<Mutex<Vec<RunSpec>>>,
        audit_path: std::path::PathBuf,
        _dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new(answer: fn() -> Result<RunOutcome, SandboxError>, local_slots: usize) -> Fixture {
            Fixture::with(answer, |c| c.server.concurrency.local = local_slots)
        }

        /// A fixture over the default configuration as `tweak` changes it.
        fn with(
            answer: fn() -> Result<RunOutcome, SandboxError>,
            tweak: impl FnOnce(&mut Config),
        ) -> Fixture {
            Fixture::with_store(answer, tweak, Arc::new(MemoryStore::new(1 << 20, 0)))
        }

        fn with_store(
            answer: fn() -> Result<RunOutcome, SandboxError>,
            tweak: impl FnOnce(&mut Config),
            store: Arc<dyn StateStore>,
        ) -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let mut config = Config::load(None, &EnvOverrides::default()).unwrap();
            tweak(&mut config);
            let policy = Policy::load(&config).unwrap();
            let executors = Registry::load(&dir.path().join("executors"));
            let specs = Arc::new(Mutex::new(Vec::new()));
            let backends = BackendKind::ALL
                .iter()
                .map(|k| {
                    let b: Arc<dyn Sandbox> = Arc::new(Recording {
                        kind: *k,
                        specs: specs.clone(),
                        answer,
                    });
                    (*k, b)
                })
                .collect();
            let audit_path = dir.path().join("audit.jsonl");
            let service = ExecutionService::new(
                &config,
                "i-1",
                policy,
                executors,
                backends,
                store,
                Arc::new(AuditLog::open(&audit_path, "i-1").unwrap()),
                Arc::new(Metrics::new()),
                render,
                Some(Arc::new(crate::provenance::keys::SigningKey::from_bytes(
                    &[7u8; 32],
                ))),
            );
            Fixture {
                service,
                specs,
                audit_path,
                _dir: dir,
            }
        }

        fn lines(&self) -> Vec<Value> {
            audit_lines(&self.audit_path)
        }
    }

    /// Renders what the service tells: the kind of run it finished without its caller's answer.
    fn render(u: &Unanswered) -> StoredResponse {
        StoredResponse {
            status: 0,
            body: format!("{u:?}"),
            receipt: None,
        }
    }

    fn audit_lines(path: &Path) -> Vec<Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn request(command: &str, single_use: Option<&str>) -> ExecutionRequest {
        ExecutionRequest {
            request_id: "req-1".into(),
            subject: Some("orchestrator".into()),
            owner: "orchestrator".into(),
            capability: Verified {
                subject: Some("orchestrator".into()),
                token_id: Some("tok-1".into()),
                single_use: single_use.map(|jti| SingleUse {
                    kind: TokenKind::Capability,
                    jti: jti.into(),
                    // Issued after the embedded store's record began (it starts on a whole second).
                    iat: Some(crate::auth::now() + 2),
                    exp: crate::auth::now() + 60,
                }),
                grant: Grant {
                    capabilities: vec!["ShellExecute".into()],
                    ..Default::default()
                },
            },
            action: Action::Command {
                action_type: ActionType::Shell,
            },
            command: command.into(),
            reuse_subject: None,
            args: vec!["hi".into()],
            timeout_seconds: Some(5),
            long_run: false,
            profile: None,
            env: BTreeMap::new(),
            stdin: None,
            metadata: Some(Map::from_iter([("job".to_string(), json!("j-7"))])),
            idempotency_key: None,
            abandoned: None,
            via: None,
        }
    }

    /// Admitted, an execution has its id and its start line before anything runs; run, it has one
    /// end line, a result whose provenance points at that line, and its slot back.
    #[tokio::test]
    async fn an_execution_is_admitted_then_run_and_recorded_once() {
        let f = Fixture::new(said_hi, 1);
        let execution = f.service.admit(request("echo", None)).await.unwrap();
        let exec_id = execution.exec_id().to_string();
        assert!(
            f.specs.lock().unwrap().is_empty(),
            "nothing runs at admission"
        );
        let lines = f.lines();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["event"], "execution_start");
        assert_eq!(lines[0]["exec_id"], exec_id.as_str());

        let Finished {
            result,
            timed_out,
            receipt,
        } = execution.run().await.unwrap();
        assert!(!timed_out);
        assert!(result.success);
        assert_eq!(result.outcome, "success");
        assert_eq!(result.exec_id, exec_id);
        assert_eq!(result.stdout, "hi\n");
        let p = &result.provenance;
        assert_eq!(p.exec_id, exec_id);
        assert_eq!(p.request_id, "req-1");
        assert_eq!(p.token_id.as_deref(), Some("tok-1"));
        assert_eq!(p.subject.as_deref(), Some("orchestrator"));
        assert_eq!(p.command_hash, command_hash("echo", &["hi".into()]));
        assert_eq!(p.capabilities_used, ["ShellExecute"]);
        assert_eq!(p.stdout_sha256, sha256_prefixed(b"hi\n"));
        assert_eq!(p.audit_seq, Some(2));
        assert_eq!(p.metadata.as_ref().unwrap()["job"], "j-7");

        let lines = f.lines();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["event"], "execution");
        assert_eq!(lines[1]["seq"], 2);
        assert_eq!(lines[1]["exec_id"], exec_id.as_str());
        assert_eq!(lines[1]["invocation_hash"], p.invocation_hash.as_str());
        assert_eq!(lines[1]["stdout_sha256"], p.stdout_sha256.as_str());

        // Its receipt: signed with the service's key, about what the result and the end line say.
        let envelope: crate::provenance::dsse::Envelope =
            serde_json::from_str(&receipt.expect("a receipt")).unwrap();
        let keys: crate::provenance::keys::KeySet =
            [crate::provenance::keys::SigningKey::from_bytes(&[7u8; 32]).verifying_key()]
                .into_iter()
                .collect();
        let st = crate::provenance::receipt::verify_receipt(&envelope, &keys).unwrap();
        assert_eq!(
            st.subject_sha256("stdout"),
            p.stdout_sha256.strip_prefix("sha256:")
        );
        assert_eq!(st.predicate.audit.audit_seq, 2);
        assert_eq!(st.predicate.audit.entry_hash, lines[1]["entry_hash"]);
        assert_eq!(st.predicate.what.exec_id, exec_id);
        assert_eq!(st.predicate.who.token_id.as_deref(), Some("tok-1"));
        assert_eq!(st.predicate.when.started_at, p.timestamp);

        let specs = f.specs.lock().unwrap().clone();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].exec_id, exec_id);
        assert_eq!(specs[0].argv[1..], ["hi"]);
        assert!(specs[0].stop.is_some(), "the stop control reaches the run");
        // The only slot is free again.
        f.service.admit(request("echo", None)).await.unwrap();
    }

    /// An execution holds its backend's slot from admission until it has run or is dropped; a
    /// dropped one still ends in an `execution_error` line.
    #[tokio::test]
    async fn an_admitted_execution_holds_its_slot_until_it_ends() {
        let f = Fixture::with(said_hi, |c| {
            c.server.concurrency.local = 1;
            c.server.queue.max_waiting = 0;
        });
        let first = f.service.admit(request("echo", None)).await.unwrap();
        let busy = f.service.admit(request("echo", None)).await;
        assert!(
            matches!(busy, Err(ExecutionError::Overloaded(_))),
            "{busy:?}"
        );
        drop(first);
        let lines = f.lines();
        assert_eq!(lines.last().unwrap()["event"], "execution_error");
        assert_eq!(lines.last().unwrap()["error_type"], "InternalError");
        tokio::time::timeout(Duration::from_secs(10), f.service.wait_idle())
            .await
            .expect("the slot was freed");
        f.service.admit(request("echo", None)).await.unwrap();
    }

    /// A started run is live until its answer is stored; then the store has it, for its owner only.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_started_run_is_found_live_then_in_the_store_by_its_owner_only() {
        let f = Fixture::new(said_hi, 1);
        let execution = f.service.admit(request("echo", None)).await.unwrap();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let live = f.service.start(execution, move |r| {
            let finished = r.expect("ran");
            // Hold the answer back (blocking this worker) until the test has looked at the live run.
            let _ = released.recv();
            StoredResponse {
                status: 200,
                body: serde_json::to_string(&finished.result).unwrap(),
                receipt: None,
            }
        });
        let exec_id = live.exec_id().to_string();
        assert!(matches!(
            f.service.lookup("orchestrator", &exec_id).await.unwrap(),
            Lookup::Live(_)
        ));
        release.send(()).unwrap();
        let answer = live
            .answer()
            .wait_for(Option::is_some)
            .await
            .unwrap()
            .clone()
            .unwrap();
        assert_eq!(answer.status, 200);
        tokio::time::timeout(Duration::from_secs(10), f.service.wait_idle())
            .await
            .expect("the run's answer was stored");
        let Lookup::Stored(record) = f.service.lookup("orchestrator", &exec_id).await.unwrap()
        else {
            panic!("the finished run is in the store")
        };
        assert_eq!(record.response.as_ref(), Some(&*answer));
        assert_eq!(record.instance, "i-1");
        assert_eq!(record.cancelled_by, None);
        assert!(matches!(
            f.service.lookup("someone-else", &exec_id).await.unwrap(),
            Lookup::Unknown
        ));
    }

    /// A run whose answer cannot be made (the closure panics) still ends: it is answered as
    /// [`Unanswered::AnswerFailed`], stored, and no longer live.
    #[tokio::test]
    async fn a_run_whose_answer_panics_still_ends_with_an_answer() {
        let f = Fixture::new(said_hi, 1);
        let execution = f.service.admit(request("echo", None)).await.unwrap();
        let live = f
            .service
            .start(execution, |_| panic!("the answer could not be made"));
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            live.answer().wait_for(Option::is_some),
        )
        .await
        .expect("answered")
        .unwrap()
        .clone()
        .unwrap();
        assert_eq!(answer.body, format!("{:?}", Unanswered::AnswerFailed));
        tokio::time::timeout(Duration::from_secs(10), f.service.wait_idle())
            .await
            .expect("no longer live");
    }

    /// A store that takes a run's "running" record but fails to store a finished one.
    struct RefusesAnswers(MemoryStore);

    #[async_trait::async_trait]
    impl StateStore for RefusesAnswers {
        async fn claim_jti(&self, t: &SingleUse) -> Result<crate::state::JtiClaim, StateError> {
            self.0.claim_jti(t).await
        }
        async fn release_jti(&self, t: &SingleUse) -> Result<(), StateError> {
            self.0.release_jti(t).await
        }
        async fn idempotency_begin(
            &self,
            k: &IdemKey,
            h: &str,
            o: &str,
            l: Duration,
        ) -> Result<crate::state::IdemBegin, StateError> {
            self.0.idempotency_begin(k, h, o, l).await
        }
        async fn idempotency_renew(
            &self,
            k: &IdemKey,
            o: &str,
            l: Duration,
        ) -> Result<bool, StateError> {
            self.0.idempotency_renew(k, o, l).await
        }
        async fn idempotency_complete(
            &self,
            k: &IdemKey,
            h: &str,
            r: &StoredResponse,
            t: Duration,
        ) -> Result<(), StateError> {
            self.0.idempotency_complete(k, h, r, t).await
        }
        async fn idempotency_release(&self, k: &IdemKey, o: &str) -> Result<(), StateError> {
            self.0.idempotency_release(k, o).await
        }
        async fn execution_put(
            &self,
            k: &IdemKey,
            r: &StoredExecution,
            t: Duration,
        ) -> Result<(), StateError> {
            match r.response {
                Some(_) => Err(StateError::Unavailable("connection refused".into())),
                None => self.0.execution_put(k, r, t).await,
            }
        }
        async fn execution_get(&self, k: &IdemKey) -> Result<Option<StoredExecution>, StateError> {
            self.0.execution_get(k).await
        }
        async fn healthy(&self) -> Result<(), StateError> {
            self.0.healthy().await
        }
        fn kind(&self) -> &'static str {
            "refuses-answers"
        }
    }

    /// When the store will not take a finished run's record, the daemon that ran it keeps
    /// answering for it through the retention (the run no longer counts as live), and after that
    /// its own leftover "running" record reads as an answer that was lost, never as running.
    #[tokio::test]
    async fn an_answer_the_store_refuses_is_kept_here_then_reads_as_lost() {
        let f = Fixture::with_store(
            said_hi,
            |c| c.executions.retention_seconds = 1,
            Arc::new(RefusesAnswers(MemoryStore::new(1 << 20, 0))),
        );
        // The "running" record lives the run's timeout past the retention: 30 s.
        let mut asked = request("echo", None);
        asked.timeout_seconds = Some(29);
        let execution = f.service.admit(asked).await.unwrap();
        let live = f.service.start(execution, |r| StoredResponse {
            status: 200,
            body: serde_json::to_string(&r.expect("ran").result).unwrap(),
            receipt: None,
        });
        let exec_id = live.exec_id().to_string();
        tokio::time::timeout(Duration::from_secs(20), f.service.wait_idle())
            .await
            .expect("no longer live once its record could not be stored");
        let Lookup::Live(kept) = f.service.lookup("orchestrator", &exec_id).await.unwrap() else {
            panic!("the daemon that ran it still answers for it")
        };
        assert_eq!(kept.answered().map(|a| a.status), Some(200));
        assert!(matches!(
            f.service.lookup("someone-else", &exec_id).await.unwrap(),
            Lookup::Unknown
        ));
        // Kept for the retention (1 s) from its answer; the "running" record outlives that.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let Lookup::Stored(record) = f.service.lookup("orchestrator", &exec_id).await.unwrap()
        else {
            panic!("the leftover record is read")
        };
        let lost = record.response.expect("reads as finished, not running");
        assert_eq!(lost.body, format!("{:?}", Unanswered::Lost));
    }

    /// How long a test lets a queued admission run to show it is still waiting.
    const STILL_WAITING: Duration = Duration::from_millis(50);

    /// Requests over the slots wait for one, first come first served; one more than the queue
    /// holds is refused at once; the queue's depth and waits are in the metrics.
    #[tokio::test]
    async fn requests_over_the_slots_wait_in_arrival_order_up_to_the_queue_size() {
        let f = Fixture::with(said_hi, |c| {
            c.server.concurrency.local = 1;
            c.server.queue.max_waiting = 2;
        });
        let first = f.service.admit(request("echo", None)).await.unwrap();
        let mut second = std::pin::pin!(f.service.admit(request("echo", None)));
        let mut third = std::pin::pin!(f.service.admit(request("echo", None)));
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut second)
                .await
                .is_err()
        );
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut third)
                .await
                .is_err()
        );
        let depth = || {
            f.service
                .metrics
                .sample("executor_queue_waiting", &[("backend", "local")])
                .unwrap_or(0.0)
        };
        assert_eq!(depth(), 2.0);
        let full = f.service.admit(request("echo", None)).await;
        let Err(ExecutionError::Overloaded(detail)) = &full else {
            panic!("{full:?}")
        };
        assert!(
            detail.contains("queue is full (server.queue.max_waiting = 2)"),
            "{detail}"
        );
        // Nothing but the first has started.
        assert_eq!(f.lines().len(), 1);

        drop(first);
        let second = second.await.unwrap();
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut third)
                .await
                .is_err()
        );
        assert_eq!(depth(), 1.0);
        second.run().await.unwrap();
        third.await.unwrap().run().await.unwrap();
        assert_eq!(depth(), 0.0);
        let waits = |part: &str| {
            let name = format!("executor_queue_wait_seconds_{part}");
            f.service.metrics.sample(&name, &[("backend", "local")])
        };
        assert_eq!(waits("count"), Some(3.0), "every admitted request is timed");
        assert!(waits("sum").unwrap() >= 2.0 * STILL_WAITING.as_secs_f64());
    }

    /// A wait that runs out is refused (429) and gives its place back, as does a caller that goes
    /// away; neither uses up a single-use token.
    #[tokio::test]
    async fn a_wait_that_runs_out_or_is_abandoned_gives_its_place_back() {
        let f = Fixture::with(said_hi, |c| {
            c.server.concurrency.local = 1;
            c.server.queue.max_waiting = 1;
            c.server.queue.max_wait_ms = 200;
        });
        let first = f.service.admit(request("echo", None)).await.unwrap();
        let waited = f.service.admit(request("echo", Some("j-late"))).await;
        let Err(ExecutionError::Overloaded(detail)) = &waited else {
            panic!("{waited:?}")
        };
        assert!(
            detail.contains("within server.queue.max_wait_ms = 200"),
            "{detail}"
        );
        // A caller that goes away while it waits.
        let gone =
            tokio::time::timeout(STILL_WAITING, f.service.admit(request("echo", None))).await;
        assert!(gone.is_err());
        assert_eq!(
            f.service
                .metrics
                .sample("executor_queue_waiting", &[("backend", "local")])
                .unwrap_or(0.0),
            0.0
        );
        // The place is free again: the next request waits, and gets the slot when it comes free.
        let mut next = std::pin::pin!(f.service.admit(request("echo", Some("j-late"))));
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut next)
                .await
                .is_err()
        );
        drop(first);
        next.await
            .expect("the token refused for the wait was not used up");
    }

    /// When the daemon starts killing its runs, requests still waiting for a slot are refused (503)
    /// instead of starting only to be killed.
    #[tokio::test]
    async fn waiting_requests_are_refused_when_runs_are_killed() {
        let f = Fixture::with(said_hi, |c| c.server.concurrency.local = 1);
        let _first = f.service.admit(request("echo", None)).await.unwrap();
        let mut waiting = std::pin::pin!(f.service.admit(request("echo", None)));
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut waiting)
                .await
                .is_err()
        );
        f.service.kill_running();
        let refused = waiting.await;
        assert!(
            matches!(refused, Err(ExecutionError::Unavailable(_))),
            "{refused:?}"
        );
        assert_eq!(f.lines().len(), 1, "the refused request never started");
    }

    /// A waiter whose caller raises `abandoned` gives its place back and starts nothing; once the
    /// queue is closed (shutdown), waiters and newcomers are refused even when a slot is free.
    #[tokio::test]
    async fn an_abandoned_waiter_leaves_and_a_closed_queue_admits_nothing() {
        let f = Fixture::with(said_hi, |c| {
            c.server.concurrency.local = 1;
            c.server.queue.max_waiting = 1;
        });
        let depth = || {
            f.service
                .metrics
                .sample("executor_queue_waiting", &[("backend", "local")])
                .unwrap_or(0.0)
        };
        let first = f.service.admit(request("echo", None)).await.unwrap();
        let (gone, abandoned) = watch::channel(false);
        let mut req = request("echo", Some("j-gone"));
        req.abandoned = Some(abandoned);
        let mut waiting = std::pin::pin!(f.service.admit(req));
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut waiting)
                .await
                .is_err()
        );
        assert_eq!(depth(), 1.0);
        gone.send_replace(true);
        let left = waiting.await;
        let Err(ExecutionError::Overloaded(detail)) = &left else {
            panic!("{left:?}")
        };
        assert!(detail.contains("the caller went away"), "{detail}");
        assert_eq!(depth(), 0.0);

        let mut queued = std::pin::pin!(f.service.admit(request("echo", Some("j-gone"))));
        assert!(
            tokio::time::timeout(STILL_WAITING, &mut queued)
                .await
                .is_err()
        );
        f.service.close_queue();
        let refused = queued.await;
        assert!(
            matches!(refused, Err(ExecutionError::Unavailable(_))),
            "{refused:?}"
        );
        drop(first);
        let late = f.service.admit(request("echo", Some("j-gone"))).await;
        assert!(
            matches!(late, Err(ExecutionError::Unavailable(_))),
            "{late:?}"
        );
        assert_eq!(depth(), 0.0);
        let starts = f
            .lines()
            .iter()
            .filter(|l| l["event"] == "execution_start")
            .count();
        assert_eq!(starts, 1, "only the first request started");
    }

    /// A request the policy refuses does not use its single-use token up; a replay of a used one is
    /// refused; both refusals are audited with who asked for what.
    #[tokio::test]
    async fn refusals_are_audited_and_leave_a_single_use_token_unused() {
        let f = Fixture::new(said_hi, 4);
        let refused = f.service.admit(request("no-such-tool", Some("j-1"))).await;
        let Err(ExecutionError::Refused {
            allowed_commands: Some(list),
            ..
        }) = &refused
        else {
            panic!("{refused:?}");
        };
        assert!(list.iter().any(|c| c == "echo"));
        f.service
            .execute(request("echo", Some("j-1")))
            .await
            .expect("the token was not used up by the refusal");
        let replayed = f.service.admit(request("echo", Some("j-1"))).await;
        assert!(
            matches!(replayed, Err(ExecutionError::Unauthorized)),
            "{replayed:?}"
        );
        let refusals: Vec<(u64, String)> = f
            .lines()
            .iter()
            .filter(|l| l["event"] == "refusal")
            .map(|l| {
                assert_eq!(l["token_id"], "tok-1", "{l}");
                assert_eq!(l["subject"], "orchestrator", "{l}");
                (
                    l["status"].as_u64().unwrap(),
                    l["command"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            refusals,
            [(403, "no-such-tool".to_string()), (401, "echo".to_string())]
        );
        assert_eq!(f.specs.lock().unwrap().len(), 1);
    }

    /// A backend that cannot serve ends the admitted execution with an `execution_error` line of the
    /// error the caller gets.
    #[tokio::test]
    async fn a_backend_failure_is_the_end_line_and_the_error() {
        let f = Fixture::new(engine_gone, 1);
        let failed = f.service.execute(request("echo", None)).await;
        let Err(e @ ExecutionError::Unavailable(_)) = &failed else {
            panic!("{failed:?}");
        };
        let lines = f.lines();
        let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
        assert_eq!(events, ["execution_start", "execution_error"]);
        assert_eq!(lines[1]["error_type"], e.error_type());
        assert_eq!(lines[1]["error"], "docker engine unreachable");
        f.service.admit(request("echo", None)).await.unwrap();
    }

    #[test]
    fn metrics_backend_labels_are_every_backend() {
        let names: Vec<&str> = BackendKind::ALL.iter().map(|b| b.as_str()).collect();
        assert_eq!(names, crate::metrics::BACKENDS);
    }
}
