//! A run's status and its cancel, whichever front end asks (`/v1/executions/…` and a session's
//! `/execs/…` on the REST API, the `run_status` and `run_cancel` tools of `/mcp`). A run that is
//! not the caller's is answered exactly like one that does not exist: 404.
//!
//! Owns: finding a run for its owner (here, or the replica that runs it), its status body, the
//! cancel's grace and answer. Must not: read HTTP or call a replica (the front end hands the
//! call on when the run is elsewhere), or stop runs itself (the execution service does).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::AppState;
use super::error::ApiError;
use super::run::RunAnswer;
use crate::execution::Lookup;
use crate::execution::runs::CancelOutcome;
use crate::state::StoredResponse;

/// The longest grace a cancel may give a run between SIGTERM and SIGKILL.
pub const MAX_GRACE_SECONDS: u64 = 30;
/// The grace of a cancel that names none.
pub const DEFAULT_GRACE_SECONDS: u64 = 5;

/// Where a call for a run must be served.
pub enum Located {
    /// By this replica: the run is live here, finished, or unknown to the caller.
    Here(Lookup),
    /// By the replica at this address, which runs it.
    Elsewhere(String),
}

/// Finds `owner`'s run `exec_id`: here, or live on the replica the state store names (a call
/// another replica forwarded, `forwarded`, is never sent on again).
pub async fn locate(
    st: &AppState,
    exec_id: &str,
    owner: &str,
    forwarded: bool,
) -> Result<Located, ApiError> {
    let found = st
        .executions
        .lookup(owner, exec_id)
        .await
        .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?;
    Ok(match found {
        Lookup::Stored(record) if record.response.is_none() => match (&record.address, forwarded) {
            (Some(address), false)
                if record.instance != st.executions.instance()
                    && Some(address.as_str()) != st.executions.address() =>
            {
                Located::Elsewhere(address.clone())
            }
            _ => {
                return Err(ApiError::SandboxUnavailable(format!(
                    "execution {exec_id} runs on daemon instance {}, which this replica \
                         cannot hand the call to",
                    record.instance
                )));
            }
        },
        other => Located::Here(other),
    })
}

/// The status of `owner`'s run `exec_id`: `{"exec_id", "status": "running"}` while it lives;
/// once it finished, `"status": "finished"`, the `http_status` its synchronous call had (or
/// has) and, as `result`, exactly the body that call returns.
pub async fn status(st: &AppState, exec_id: &str, owner: &str) -> Result<String, ApiError> {
    let id = serde_json::to_string(exec_id).map_err(|e| ApiError::Internal(e.to_string()))?;
    let running = || format!(r#"{{"exec_id":{id},"status":"running"}}"#);
    match st
        .executions
        .lookup(owner, exec_id)
        .await
        .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?
    {
        // The stored body is spliced in as it was written: parsing and printing it again could
        // change a number the caller sent in its metadata.
        Lookup::Live(live) => Ok(match live.answered() {
            Some(r) => finished(&id, &r),
            None => running(),
        }),
        Lookup::Stored(record) => Ok(match record.response {
            Some(r) => finished(&id, &r),
            None => running(),
        }),
        Lookup::Unknown => Err(ApiError::ExecutionNotFound),
    }
}

/// The receipt of `owner`'s run `exec_id` (a DSSE envelope, as JSON): 409 while it runs, 404
/// when it ended without one. Read from the run's record, so any replica serves it.
pub async fn receipt(st: &AppState, exec_id: &str, owner: &str) -> Result<String, ApiError> {
    let answer = match st
        .executions
        .lookup(owner, exec_id)
        .await
        .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?
    {
        Lookup::Live(live) => live.answered().map(|a| (*a).clone()),
        Lookup::Stored(record) => record.response,
        Lookup::Unknown => return Err(ApiError::ExecutionNotFound),
    };
    answer
        .ok_or(ApiError::NotFinished)?
        .receipt
        .ok_or(ApiError::NoReceipt)
}

/// The answer of `GET` for a finished run; `id` is the exec_id as a JSON string.
fn finished(id: &str, r: &StoredResponse) -> String {
    format!(
        r#"{{"exec_id":{id},"status":"finished","http_status":{},"result":{}}}"#,
        r.status, r.body
    )
}

/// What a cancel answers.
pub enum Cancelled {
    /// 202: the run is stopping; the [`CancelAccepted`] body.
    Accepted(String),
    /// The run lives on the replica at this address: the call goes there.
    Elsewhere(String),
}

/// Cancels `owner`'s run `exec_id` (SIGTERM, SIGKILL after `grace`) for the request
/// `request_id`; a repeated call answers the first call's grace; 409 once it ended.
pub async fn cancel(
    st: &AppState,
    exec_id: &str,
    owner: &str,
    request_id: &str,
    grace: Duration,
    forwarded: bool,
) -> Result<Cancelled, ApiError> {
    let live = match locate(st, exec_id, owner, forwarded).await? {
        Located::Here(Lookup::Live(live)) => live,
        Located::Here(Lookup::Stored(_)) => return Err(ApiError::AlreadyFinished),
        Located::Here(Lookup::Unknown) => return Err(ApiError::ExecutionNotFound),
        Located::Elsewhere(address) => return Ok(Cancelled::Elsewhere(address)),
    };
    let grace = match st.executions.cancel(&live, grace, owner, request_id) {
        CancelOutcome::Stopping => grace,
        // A repeated call: the answer of the first.
        CancelOutcome::AlreadyStopping => live.stopping().map(|s| s.grace).unwrap_or(grace),
        CancelOutcome::Finished => return Err(ApiError::AlreadyFinished),
    };
    let body = CancelAccepted {
        exec_id: exec_id.to_string(),
        status: "cancelling",
        grace_seconds: grace.as_secs(),
    };
    serde_json::to_string(&body)
        .map(Cancelled::Accepted)
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// The body of a cancel (optional: an empty body is the default grace).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// Seconds between SIGTERM and SIGKILL: 0-30, default 5.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 30)]
    pub grace_seconds: Option<i64>,
}

/// The 202 of a cancel: the run is stopping.
#[derive(Debug, Serialize, ToSchema)]
pub struct CancelAccepted {
    pub exec_id: String,
    /// Always `cancelling`.
    #[schema(value_type = String, pattern = "^cancelling$")]
    pub status: &'static str,
    /// The grace the run was given (a repeated call: the first call's).
    pub grace_seconds: u64,
}

/// The body of `GET /v1/executions/{exec_id}`. The handler writes it around the stored result
/// as that was written (so a number the caller sent in its metadata is never re-printed); this
/// type describes it.
#[derive(Debug, ToSchema)]
#[allow(dead_code)]
pub struct RunStatus {
    pub exec_id: String,
    /// `running` or `finished`.
    #[schema(value_type = String, pattern = "^(running|finished)$")]
    pub status: &'static str,
    /// Once finished: the status the synchronous call answers with (200, 408 for a timeout, or
    /// an error's).
    #[schema(minimum = 100, maximum = 599)]
    pub http_status: Option<u16>,
    /// Once finished: exactly the body the synchronous call answers with.
    pub result: Option<RunAnswer>,
}

/// The grace a cancel asks for: none given (an empty body, or `null`) is the default.
pub fn grace_of(raw: &[u8]) -> Result<Duration, ApiError> {
    let asked: CancelRequest = if raw.iter().all(u8::is_ascii_whitespace) {
        CancelRequest::default()
    } else {
        serde_json::from_slice::<Option<CancelRequest>>(raw)
            .map_err(|e| ApiError::InvalidRequest(format!("invalid cancel request: {e}")))?
            .unwrap_or_default()
    };
    grace(asked.grace_seconds)
}

/// The grace `asked` (seconds, 0-30), or the default when none.
pub fn grace(asked: Option<i64>) -> Result<Duration, ApiError> {
    match asked {
        None => Ok(Duration::from_secs(DEFAULT_GRACE_SECONDS)),
        Some(g) if (0..=MAX_GRACE_SECONDS as i64).contains(&g) => Ok(Duration::from_secs(g as u64)),
        Some(g) => Err(ApiError::InvalidRequest(format!(
            "grace_seconds must be between 0 and {MAX_GRACE_SECONDS}, got {g}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document allows the cancel body to be absent or `null`: both give the default grace.
    #[test]
    fn cancel_bodies() {
        let default = Duration::from_secs(DEFAULT_GRACE_SECONDS);
        assert_eq!(grace_of(b"").unwrap(), default);
        assert_eq!(grace_of(b" \n").unwrap(), default);
        assert_eq!(grace_of(b"null").unwrap(), default);
        assert_eq!(grace_of(b"{}").unwrap(), default);
        assert_eq!(grace_of(br#"{"grace_seconds":0}"#).unwrap(), Duration::ZERO);
        assert!(grace_of(br#"{"grace_seconds":31}"#).is_err());
        assert!(grace_of(br#"{"grace":1}"#).is_err());
    }
}
