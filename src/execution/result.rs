//! What an execution answers: the result of a run that reached an outcome (the JSON a caller
//! gets, with its provenance), and the typed errors of one that did not ([`ExecutionError`]).
//!
//! Owns: the result's fields, the error vocabulary, and what a [`RunOutcome`] means on the wire
//! (the outcome's name, an external executor's `error_code`). Must not: know HTTP (the status a
//! result or an error is answered with is the api layer's choice, from [`Finished::timed_out`]
//! and the error's kind).

use serde::Serialize;
use serde_json::{Map, Value};

use super::record::RefusalKind;
use crate::sandbox::{KilledReason, RunOutcome};

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Provenance {
    #[schema(value_type = String)]
    pub arm_id: &'static str,
    pub timestamp: String,
    #[schema(value_type = crate::vocabulary::ActionType)]
    pub action_type: &'static str,
    pub command_hash: String,
    #[schema(value_type = Vec<crate::vocabulary::Capability>)]
    pub capabilities_used: Vec<&'static str>,
    pub exec_id: String,
    pub request_id: String,
    pub token_id: Option<String>,
    pub subject: Option<String>,
    #[schema(value_type = crate::sandbox::BackendKind)]
    pub backend: &'static str,
    pub profile: String,
    pub invocation_hash: String,
    pub stdout_sha256: String,
    pub stderr_sha256: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub executor_def_sha256: Option<String>,
    /// An exec in a session: the session, and `sha256:<hex>` of the code it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code_sha256: Option<String>,
    pub audit_seq: Option<u64>,
    /// The request's `metadata`, echoed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ExecutionResult {
    pub success: bool,
    /// The stream as UTF-8, invalid sequences replaced (U+FFFD).
    pub stdout: String,
    pub stderr: String,
    /// The stream's exact bytes (standard base64), present only when they are not valid UTF-8:
    /// `stdout_sha256` is over these bytes, so a client can always check what it received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    pub exit_code: i32,
    pub duration_ms: u64,
    pub provenance: Provenance,
    pub exec_id: String,
    /// `success`, `failed`, `timeout`, `cancelled` or `oom`.
    #[schema(value_type = String, pattern = "^(success|failed|timeout|cancelled|oom)$")]
    pub outcome: &'static str,
    #[schema(value_type = crate::sandbox::BackendKind)]
    pub backend: &'static str,
    pub profile: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub peak_memory_kib: Option<u64>,
    pub oom: bool,
    /// What ended the run early, if anything.
    #[schema(value_type = Option<KilledReason>)]
    pub killed_reason: Option<&'static str>,
    /// An external executor's failure: `AGENT_INVOCATION_FAILED` or `AGENT_TIMEOUT`.
    #[schema(value_type = Option<String>)]
    pub error_code: Option<&'static str>,
    /// Outbound connections through the egress proxy (egress profiles only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Vec<crate::egress::ConnRecord>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// `ExecutionTimeout` on a result answered with 408.
    #[schema(value_type = Option<String>)]
    pub error_type: Option<&'static str>,
    /// On a result that is an error (an execution timeout): whether sending the same request
    /// again may succeed. Never for a timeout: the same command gets the same deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    /// The run's signed receipt (a DSSE envelope of an in-toto statement), when the request
    /// asked for it with `"receipt": true`; every finished run's is at its `/receipt` route.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub receipt: Option<Value>,
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
    /// No process could be made for the run: its sandbox's pids limit is reached (a session's
    /// other processes hold every pid). Retryable once some end.
    #[error("{0}")]
    PidsExhausted(String),
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
            ExecutionError::Overloaded(_) | ExecutionError::PidsExhausted(_) => "Overloaded",
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
    /// Its receipt (a DSSE envelope, as JSON), once its end line is in the audit log; none
    /// when that line could not be written or no key signs receipts.
    pub receipt: Option<String>,
}

/// The wire outcome of a run.
pub fn outcome_name(o: &RunOutcome) -> &'static str {
    match o.killed_reason {
        Some(KilledReason::Timeout) => "timeout",
        Some(KilledReason::Cancelled) => "cancelled",
        Some(KilledReason::Oom) => "oom",
        _ if o.oom => "oom",
        Some(KilledReason::Signal) => "cancelled",
        Some(KilledReason::OutputLimit) | Some(KilledReason::Pids) => "failed",
        None if o.exit_code() == 0 && !o.stdin_broken_pipe => "success",
        None => "failed",
    }
}

/// The bytes as standard base64 when they are not valid UTF-8 (the text field then lost some).
pub fn b64_unless_utf8(bytes: &[u8]) -> Option<String> {
    use base64::Engine;
    std::str::from_utf8(bytes)
        .is_err()
        .then(|| base64::engine::general_purpose::STANDARD.encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::ExitKind;
    use std::time::Duration;

    fn outcome(exit: ExitKind, killed: Option<KilledReason>, oom: bool) -> RunOutcome {
        RunOutcome {
            exit,
            stdout: Vec::new(),
            stderr: Vec::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            duration: Duration::ZERO,
            peak_memory_kib: None,
            oom,
            killed_reason: killed,
            stdin_broken_pipe: false,
            network: Vec::new(),
            container: None,
        }
    }

    #[test]
    fn outcome_names() {
        use ExitKind::*;
        use KilledReason as K;
        let name = |e, k, oom| outcome_name(&outcome(e, k, oom));
        assert_eq!(name(Exited(0), None, false), "success");
        assert_eq!(name(Exited(1), None, false), "failed");
        assert_eq!(name(Killed, Some(K::Timeout), false), "timeout");
        // A timeout is a timeout even when the memory limit was also hit.
        assert_eq!(name(Killed, Some(K::Timeout), true), "timeout");
        assert_eq!(name(Signaled(9), Some(K::Oom), true), "oom");
        assert_eq!(name(Signaled(9), Some(K::Signal), true), "oom");
        assert_eq!(name(Signaled(15), Some(K::Signal), false), "cancelled");
        assert_eq!(name(Killed, Some(K::OutputLimit), false), "failed");
        // A cancelled run is cancelled whatever its processes did on the way out.
        assert_eq!(name(Exited(0), Some(K::Cancelled), false), "cancelled");
        assert_eq!(name(Killed, Some(K::Cancelled), true), "cancelled");
        assert_eq!(name(Exited(1), Some(K::Pids), false), "failed");
        let mut broken = outcome(Exited(0), None, false);
        broken.stdin_broken_pipe = true;
        assert_eq!(outcome_name(&broken), "failed");
    }
}
