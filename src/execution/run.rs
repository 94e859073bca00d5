//! Running an admitted execution and recording it: the run on its backend, in a task of its
//! own, then its result with its provenance, its one end line and its metrics.
//!
//! Owns: what an admitted execution holds until it runs, and how a run's outcome becomes its
//! result. Must not: know HTTP or any backend's mechanism.

use std::sync::Arc;

use serde_json::{Map, Value};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tracing::Instrument as _;

use super::receipt;
use super::record::{self, AdmittedRun};
use super::result::{
    ExecutionError, ExecutionResult, Finished, Provenance, b64_unless_utf8, outcome_name,
};
use crate::executors::invoke;
use crate::metrics::Metrics;
use crate::policy::Plan;
use crate::policy::profile::NetworkMode;
use crate::provenance::audit::RunEnd;
use crate::provenance::keys::SigningKey;
use crate::provenance::sha256_prefixed;
use crate::sandbox::{KilledReason, RunOutcome, RunSpec, Sandbox, SandboxError, Stop};

/// An admitted execution that has not run yet: its start line is written and it holds a run
/// slot of its backend. [`Execution::run`] runs it to its result; dropped instead, it ends with
/// an `execution_error` line and frees its slot. It owns everything it needs, so it may run on
/// any task.
pub struct Execution {
    pub(super) plan: Plan,
    pub(super) spec: RunSpec,
    /// The run's stop control (its backend watches `spec.stop`).
    pub(super) stop: watch::Sender<Option<Stop>>,
    /// Who may see the run: the calling service's subject.
    pub(super) owner: String,
    pub(super) backend: Arc<dyn Sandbox>,
    pub(super) slot: OwnedSemaphorePermit,
    /// Set for an external executor.
    pub(super) executor_def_sha256: Option<String>,
    /// An exec in a session.
    pub(super) session: Option<RunSession>,
    /// When it was admitted (provenance's `timestamp`).
    pub(super) timestamp: String,
    pub(super) metadata: Option<Map<String, Value>>,
    /// A background process's output ring ([`super::Background::ring_bytes`]).
    pub(super) ring: Option<usize>,
    pub(super) admitted: AdmittedRun,
    pub(super) metrics: Arc<Metrics>,
    /// Signs the run's receipt (none: it gets no receipt).
    pub(super) receipts: Option<Arc<SigningKey>>,
}

/// The session a run is an exec of.
#[derive(Debug, Clone)]
pub(super) struct RunSession {
    pub id: String,
    /// `sha256:<hex>` of the exec's code.
    pub code_sha256: String,
    /// The session's tenant ("" when it has none).
    pub tenant: String,
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
            ring: _,
            admitted,
            metrics,
            receipts,
        } = self;
        let limits = spec.limits.clone();
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
            Ok(Err(SandboxError::PidsExhausted(m))) => {
                Err((ExecutionError::PidsExhausted(m.clone()), m))
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
        let entry = admitted.finish(RunEnd {
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
            container_id: outcome.container.as_ref().map(|c| c.id.clone()),
            container_uses: outcome.container.as_ref().map(|c| c.uses),
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
                session_id: session.as_ref().map(|s| s.id.clone()),
                code_sha256: session.as_ref().map(|s| s.code_sha256.clone()),
                audit_seq: entry.as_ref().map(|e| e.seq),
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
            receipt: None,
        };
        let receipt = match (&entry, &receipts) {
            (Some(entry), Some(key)) => {
                let ran = receipt::Ran {
                    result: &result,
                    limits: &limits,
                    // A session made without a tenant has none, as an `/execute` run has none.
                    tenant: session
                        .as_ref()
                        .map(|s| s.tenant.as_str())
                        .filter(|t| !t.is_empty()),
                    entry,
                };
                match receipt::sign(&ran, key).and_then(|env| serde_json::to_string(&env)) {
                    Ok(json) => Some(json),
                    Err(e) => {
                        tracing::error!(exec_id = %result.exec_id, error = %e, "the run's receipt could not be made");
                        None
                    }
                }
            }
            _ => None,
        };
        tracing::info!(request_id = %result.provenance.request_id, exec_id = %result.exec_id, outcome = result.outcome, exit_code = result.exit_code, duration_ms = result.duration_ms, "execution end");
        Ok(Finished {
            result,
            timed_out,
            receipt,
        })
    }
}

fn duration_ms(o: &RunOutcome) -> u64 {
    o.duration.as_millis() as u64
}
