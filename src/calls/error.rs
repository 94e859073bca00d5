//! The one API error type: maps itself to the status code and the documented error body.
//! Internals are logged, never returned.

use axum::http::StatusCode;
use serde::Serialize;
use serde_json::Value;

use crate::execution::ExecutionError;
use crate::execution::Unanswered;
use crate::state::StoredResponse;

#[derive(Debug)]
pub enum ApiError {
    InvalidRequest(String),
    /// The path exists, the method does not.
    MethodNotAllowed,
    Unauthorized,
    CapabilityViolation {
        message: String,
        allowed_commands: Option<Vec<String>>,
    },
    PayloadTooLarge(usize),
    /// The request body did not arrive within `server.body_read_timeout_seconds`.
    BodyTimeout(std::time::Duration),
    IdempotencyConflict,
    IdempotencyInProgress,
    /// No run with this id is visible to the caller (another caller's run included).
    ExecutionNotFound,
    /// The run to cancel has finished.
    AlreadyFinished,
    /// The run whose receipt was asked for has not finished.
    NotFinished,
    /// The run ended without an outcome (or its end line could not be written): no receipt.
    NoReceipt,
    /// No background process with this id in the session.
    ProcessNotFound,
    /// The background process to write to or signal has ended.
    ProcessEnded,
    /// The exec to write to was not started with `stdin_open`.
    StdinClosed,
    /// Bytes for a background process's stdin after its end was sent.
    ProcessStdinClosed,
    /// No session with this id is the caller's (another service's or tenant's included).
    SessionNotFound,
    /// The session runs another exec.
    SessionBusy(String),
    /// The session is paused: nothing of it runs (its ports proxy).
    SessionPaused(String),
    /// Nothing listens on a session's port (its ports proxy): the connection was refused.
    PortClosed(String),
    /// `sessions.max_total` or `max_per_tenant` sessions are open.
    SessionLimit(String),
    /// The replica that holds the session is gone: the session is lost with it.
    SessionGone(String),
    /// No such file in a session's workspace.
    FileNotFound(String),
    /// A session's workspace quota is used up.
    WorkspaceFull,
    /// The paused store (`sessions.store_dir`) has no room for a session's workspace.
    StoreFull(String),
    /// A file above `sessions.max_file_bytes`.
    FileTooLarge(String),
    /// The backend's run slots are busy and its queue is full, or the wait for one ran out.
    Overloaded(String),
    /// The sandbox's pids limit is reached: no process could be made for the run or call (a
    /// session's other processes, its background ones included, hold every pid).
    PidsExhausted(String),
    SandboxUnavailable(String),
    ShuttingDown,
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::CapabilityViolation { .. } => StatusCode::FORBIDDEN,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::IdempotencyConflict => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::IdempotencyInProgress
            | ApiError::AlreadyFinished
            | ApiError::ProcessEnded
            | ApiError::StdinClosed
            | ApiError::ProcessStdinClosed
            | ApiError::NotFinished => StatusCode::CONFLICT,
            ApiError::ExecutionNotFound
            | ApiError::NoReceipt
            | ApiError::ProcessNotFound
            | ApiError::SessionNotFound
            | ApiError::SessionGone(_)
            | ApiError::FileNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::SessionBusy(_) | ApiError::SessionPaused(_) => StatusCode::CONFLICT,
            ApiError::PortClosed(_) => StatusCode::BAD_GATEWAY,
            ApiError::SessionLimit(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::WorkspaceFull | ApiError::StoreFull(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::FileTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded(_) | ApiError::PidsExhausted(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::SandboxUnavailable(_) | ApiError::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest(_) => "InvalidRequest",
            ApiError::MethodNotAllowed => "MethodNotAllowed",
            ApiError::Unauthorized => "Unauthorized",
            ApiError::CapabilityViolation { .. } => "CapabilityViolation",
            ApiError::PayloadTooLarge(_) => "PayloadTooLarge",
            ApiError::BodyTimeout(_) => "RequestTimeout",
            ApiError::IdempotencyConflict => "IdempotencyConflict",
            ApiError::IdempotencyInProgress => "IdempotencyInProgress",
            ApiError::ExecutionNotFound | ApiError::ProcessNotFound | ApiError::NoReceipt => {
                "NotFound"
            }
            ApiError::NotFinished => "NotFinished",
            ApiError::AlreadyFinished | ApiError::ProcessEnded | ApiError::ProcessStdinClosed => {
                "AlreadyFinished"
            }
            ApiError::StdinClosed => "StdinClosed",
            ApiError::SessionNotFound | ApiError::SessionGone(_) | ApiError::FileNotFound(_) => {
                "NotFound"
            }
            ApiError::SessionBusy(_) => "SessionBusy",
            ApiError::SessionPaused(_) => "SessionPaused",
            ApiError::PortClosed(_) => "PortClosed",
            ApiError::SessionLimit(_) => "Overloaded",
            ApiError::WorkspaceFull => "WorkspaceFull",
            ApiError::StoreFull(_) => "StoreFull",
            ApiError::FileTooLarge(_) => "PayloadTooLarge",
            ApiError::Overloaded(_) | ApiError::PidsExhausted(_) => "Overloaded",
            ApiError::SandboxUnavailable(_) | ApiError::ShuttingDown => "SandboxUnavailable",
            ApiError::Internal(_) => "InternalError",
        }
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::InvalidRequest(m) => m.clone(),
            ApiError::MethodNotAllowed => "Method not allowed on this endpoint".into(),
            ApiError::Unauthorized => "Invalid or expired capability token".into(),
            ApiError::CapabilityViolation { message, .. } => message.clone(),
            ApiError::PayloadTooLarge(limit) => {
                format!("Request body exceeds the limit of {limit} bytes")
            }
            ApiError::BodyTimeout(d) => format!(
                "The request body was not received within {} seconds",
                d.as_secs()
            ),
            ApiError::IdempotencyConflict => {
                "Idempotency-Key was already used with a different request body".into()
            }
            ApiError::IdempotencyInProgress => {
                "A request with this Idempotency-Key is still running".into()
            }
            ApiError::ExecutionNotFound => "No such execution".into(),
            ApiError::AlreadyFinished => "The execution has already finished".into(),
            ApiError::NotFinished => {
                "The execution has not finished: its receipt is made when it ends".into()
            }
            ApiError::NoReceipt => {
                "The execution has no receipt: it ended without an outcome, or its end could not \
                 be recorded"
                    .into()
            }
            ApiError::ProcessNotFound => "No such process in this session".into(),
            ApiError::ProcessEnded => "The process has ended".into(),
            ApiError::StdinClosed => {
                "The exec's stdin is not open: start it with stdin_open (async or streamed)".into()
            }
            ApiError::ProcessStdinClosed => {
                "The process's stdin is closed (eof was sent): these bytes would reach nothing"
                    .into()
            }
            ApiError::SessionNotFound => "No such session".into(),
            ApiError::SessionPaused(m) | ApiError::PortClosed(m) => m.clone(),
            ApiError::SessionGone(m) => m.clone(),
            ApiError::SessionLimit(m) => format!("Too many sessions: {m}; retry later"),
            ApiError::FileTooLarge(m) => m.clone(),
            ApiError::SessionBusy(id) => {
                format!("Session {id} is running another exec; wait for it or cancel it")
            }
            ApiError::FileNotFound(p) => format!("No such file or directory: {p}"),
            ApiError::StoreFull(m) => {
                format!("The paused-session store has no room for this workspace: {m}")
            }
            ApiError::WorkspaceFull => {
                "The session's workspace is full (its disk quota is reached)".into()
            }
            ApiError::Overloaded(detail) => {
                format!("Too many executions in progress: {detail}; retry later")
            }
            ApiError::PidsExhausted(_) => "The sandbox's processes hold all of its pids (its \
                pids limit): nothing more can start in it until some end; signal a background \
                process or wait, then retry"
                .into(),
            ApiError::SandboxUnavailable(m) => format!("Sandbox unavailable: {m}"),
            ApiError::ShuttingDown => "Sandbox unavailable: the daemon is shutting down".into(),
            ApiError::Internal(_) => "Internal error; see the daemon log".into(),
        }
    }

    /// Whether the same request may succeed if sent again: 429, 503 and every 5xx are (the
    /// daemon was busy, draining or broken), and so is a 409 for an Idempotency-Key still
    /// running (a retry after it ends gets the stored answer) or for the receipt of a run still
    /// running; every other 4xx is terminal.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            ApiError::IdempotencyInProgress | ApiError::NotFinished
        ) || retryable(self.status())
    }

    /// Seconds a caller should wait before retrying, sent as `Retry-After` on 429, 503 and the
    /// retryable 409.
    pub fn retry_after_seconds(&self) -> Option<u64> {
        match self {
            ApiError::Overloaded(_)
            | ApiError::PidsExhausted(_)
            | ApiError::SessionLimit(_)
            | ApiError::ShuttingDown
            | ApiError::IdempotencyInProgress
            | ApiError::NotFinished => Some(1),
            // A backend or the audit log is down: give it time to come back.
            ApiError::SandboxUnavailable(_) => Some(5),
            _ => None,
        }
    }

    /// The error body every refusal and failure is answered with.
    pub fn error_body(&self) -> ErrorBody {
        let allowed_commands = match self {
            ApiError::CapabilityViolation {
                allowed_commands, ..
            } => allowed_commands.clone(),
            _ => None,
        };
        ErrorBody {
            success: false,
            error: self.message(),
            error_type: self.error_type().to_string(),
            retryable: self.retryable(),
            allowed_commands,
        }
    }

    pub fn body(&self) -> Value {
        serde_json::to_value(self.error_body()).unwrap_or(Value::Null)
    }
}

/// The body of every error answer: these fields and no others.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// Always false.
    pub success: bool,
    /// A human sentence; never internals.
    pub error: String,
    /// `InvalidRequest`, `MethodNotAllowed`, `Unauthorized`, `CapabilityViolation`,
    /// `PayloadTooLarge`, `RequestTimeout`, `IdempotencyConflict`, `IdempotencyInProgress`,
    /// `NotFound`, `AlreadyFinished`, `NotFinished`, `StdinClosed`, `SessionBusy`,
    /// `SessionPaused`, `Overloaded`, `WorkspaceFull`, `StoreFull`, `PortClosed`,
    /// `SandboxUnavailable` or `InternalError`.
    pub error_type: String,
    /// Whether the same request may succeed later: true for 429, 503, every 5xx, the 409 of an
    /// Idempotency-Key still running and of a receipt whose run still runs; false for every other
    /// 4xx.
    pub retryable: bool,
    /// A command outside the allowlist (403): the commands this daemon allows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_commands: Option<Vec<String>>,
}

/// The retry rule for any status: 429, 503 and 5xx may succeed later; other 4xx will not.
pub fn retryable(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
}

impl From<ExecutionError> for ApiError {
    fn from(e: ExecutionError) -> Self {
        match e {
            ExecutionError::Invalid(m) => ApiError::InvalidRequest(m),
            ExecutionError::Unauthorized => ApiError::Unauthorized,
            ExecutionError::Refused {
                reason,
                allowed_commands,
            } => ApiError::CapabilityViolation {
                message: reason,
                allowed_commands,
            },
            ExecutionError::Overloaded(m) => ApiError::Overloaded(m),
            ExecutionError::PidsExhausted(m) => ApiError::PidsExhausted(m),
            ExecutionError::Unavailable(m) => ApiError::SandboxUnavailable(m),
            ExecutionError::Internal(m) => ApiError::Internal(m),
        }
    }
}

/// What a run's record keeps when the execution service finishes it without the answer its
/// caller made (see [`Unanswered`]): a retryable error, in the body every error has.
pub fn unanswered(u: &Unanswered) -> StoredResponse {
    let (status, error, error_type) = match u {
        Unanswered::AnswerFailed => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error; see the daemon log".to_string(),
            "InternalError",
        ),
        Unanswered::Lost => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the run finished but its result could not be stored and is no longer kept".into(),
            "InternalError",
        ),
        Unanswered::DaemonStopped { instance } => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the daemon (instance {instance}) stopped during the run"),
            "DaemonStopped",
        ),
    };
    StoredResponse {
        status: status.as_u16(),
        body: serde_json::json!({
            "success": false,
            "error": error,
            "error_type": error_type,
            "retryable": true,
        })
        .to_string(),
        receipt: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An execution error keeps its `error_type` as an answer: the `execution_error` line and the
    /// caller's body name the same thing.
    #[test]
    fn execution_errors_keep_their_error_type() {
        let all = [
            ExecutionError::Invalid("x".into()),
            ExecutionError::Unauthorized,
            ExecutionError::Refused {
                reason: "x".into(),
                allowed_commands: None,
            },
            ExecutionError::Overloaded("x".into()),
            ExecutionError::PidsExhausted("x".into()),
            ExecutionError::Unavailable("x".into()),
            ExecutionError::Internal("x".into()),
        ];
        for e in all {
            let error_type = e.error_type();
            assert_eq!(ApiError::from(e).error_type(), error_type);
        }
    }

    /// A run the execution service ends without its caller's answer reads as a retryable error:
    /// 500 when its answer failed or was lost, 503 `DaemonStopped` when its daemon stopped.
    #[test]
    fn unanswered_runs_are_retryable_errors() {
        let cases = [
            (Unanswered::AnswerFailed, 500, "InternalError"),
            (Unanswered::Lost, 500, "InternalError"),
            (
                Unanswered::DaemonStopped {
                    instance: "i-1".into(),
                },
                503,
                "DaemonStopped",
            ),
        ];
        for (u, status, error_type) in cases {
            let answer = unanswered(&u);
            assert_eq!(answer.status, status, "{u:?}");
            let body: Value = serde_json::from_str(&answer.body).unwrap();
            assert_eq!(body["success"], false);
            assert_eq!(body["error_type"], error_type);
            assert_eq!(body["retryable"], true);
            assert!(body["error"].is_string());
        }
        let stopped = unanswered(&Unanswered::DaemonStopped {
            instance: "i-1".into(),
        });
        assert!(
            stopped
                .body
                .contains("the daemon (instance i-1) stopped during the run")
        );
    }
}
