//! `/execute`'s request, whichever front end carries it (the REST route, the MCP `execute` and
//! `run_start` tools): its body, the checks that come before it is an [`ExecutionRequest`] once
//! its caller is known (its fields, the capability token, the Idempotency-Key's fingerprint),
//! and who may have a retry's stored answer.
//!
//! Owns: the request body and its checks. Must not: read HTTP (the front end hands the body and
//! how the caller waits), decide, admit or run anything itself (the execution service does).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use super::AppState;
use super::caller::{Caller, capability_token, unauthorized};
use super::error::ApiError;
use super::run::{IdemAsk, RunJob, RunMode, Work, fingerprint, what_runs};
use crate::auth::Verified;
use crate::execution::record::KnownRequest;
use crate::execution::runs::LiveRun;
use crate::execution::{Action, ClaimError, ExecutionRequest, ExternalParts, claim_single_use};
use crate::policy::ActionType;
use crate::state::IdemKey;

/// The request body. Unknown fields are refused: a misspelt limit must not be silently ignored.
/// Every optional field may also be `null`, which is the same as leaving it out. An
/// Idempotency-Key's fingerprint covers it as parsed (see [`what_runs`]).
#[derive(Debug, Deserialize, Serialize, ToSchema, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteRequest {
    /// `shell`, `http`, `python` or `external`.
    #[schema(value_type = ActionType)]
    #[schemars(extend("enum" = ["shell", "http", "python", "external"]))]
    pub action_type: String,
    /// A bare allowlisted name (`ls`, `python3`) or, for `external`, a registered executor's
    /// name; never a path.
    pub command: String,
    /// Passed as argv, never through a shell.
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub args: Vec<String>,
    /// 1-300 for a synchronous run, up to 86400 for an async or streamed one; default from the
    /// profile; clamped by the profile and the token.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 86400)]
    pub timeout_seconds: Option<i64>,
    /// The capability token: a capability JWT or a static `tok_…` token. Absent here, it may
    /// come in the `X-Capability-Token` header (not both); absent in both → 401.
    #[serde(default)]
    pub capability_token: Option<String>,
    /// Echoed into provenance and the audit line, never interpreted.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    /// Written to the child's stdin, then closed.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Only names the profile's `env.allow` lists.
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub env: BTreeMap<String, String>,
    /// A sandbox profile the token permits (default: the command's).
    #[serde(default)]
    pub profile: Option<String>,
    /// For `external`: the envelope's `input`.
    #[serde(default)]
    pub input: Option<Value>,
    /// For `external`: the rest of the envelope.
    #[serde(default)]
    pub activity: Option<Value>,
    #[serde(default)]
    pub skills: Option<Value>,
    #[serde(default)]
    pub memory: Option<Value>,
    #[serde(default)]
    pub job: Option<Value>,
    #[serde(default)]
    pub task: Option<Value>,
    /// For `external`: the runtime model.
    #[serde(default)]
    pub model: Option<String>,
    /// Answer 202 with the run's `exec_id` at once instead of waiting for its result.
    #[serde(
        default,
        rename = "async",
        deserialize_with = "crate::calls::caller::null_as_default"
    )]
    #[schema(nullable)]
    pub run_async: bool,
    /// Cancel the run when the caller goes away before its answer (by default it runs on).
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub cancel_on_disconnect: bool,
    /// Put the run's signed receipt (a DSSE envelope) in its answer as `receipt` (and in a
    /// stream's `result` event). Every finished run has one at `/v1/executions/{exec_id}/receipt`
    /// either way.
    #[serde(
        default,
        deserialize_with = "crate::calls::caller::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    #[schema(nullable)]
    pub receipt: bool,
}

impl ExecuteRequest {
    /// The typed request the execution service takes, once the caller is authenticated.
    pub(crate) fn into_execution(
        self,
        known: &KnownRequest,
        owner: String,
        capability: Verified,
        action: ActionType,
        timeout_seconds: Option<u64>,
        long_run: bool,
    ) -> ExecutionRequest {
        ExecutionRequest {
            request_id: known.request_id.clone(),
            subject: known.subject.clone(),
            owner,
            capability,
            action: if action == ActionType::External {
                Action::Executor(ExternalParts {
                    activity: self.activity,
                    input: self.input,
                    skills: self.skills,
                    memory: self.memory,
                    job: self.job,
                    task: self.task,
                    model: self.model,
                })
            } else {
                Action::Command {
                    action_type: action,
                }
            },
            command: self.command,
            args: self.args,
            timeout_seconds,
            long_run,
            profile: self.profile,
            env: self.env,
            stdin: self.stdin,
            metadata: self.metadata,
            idempotency_key: None,
            abandoned: None,
            reuse_subject: None,
            via: None,
        }
    }
}

pub(crate) fn parse_request(body: &[u8]) -> Result<ExecuteRequest, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::InvalidRequest(format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::InvalidRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::InvalidRequest(format!("invalid request: {e}")))
}

/// Counts a refused `/execute` request in `rejected` by its kind (a refusal the caller could
/// fix or retry; a 401, a 403 or a 404 is counted where it is decided).
pub fn count_refusal(st: &AppState, e: &ApiError) {
    let label = match e {
        ApiError::Overloaded(_) | ApiError::PidsExhausted(_) => "overloaded",
        ApiError::PayloadTooLarge(_) => "payload_too_large",
        ApiError::BodyTimeout(_) => "body_timeout",
        ApiError::InvalidRequest(_) => "invalid_request",
        ApiError::SandboxUnavailable(_) | ApiError::ShuttingDown => "sandbox_unavailable",
        ApiError::IdempotencyConflict | ApiError::IdempotencyInProgress => "idempotency",
        _ => return,
    };
    st.metrics.rejected.with_label_values(&[label]).increment(1);
}

/// How the caller of an `/execute` request waits and what it holds besides the body.
pub struct ExecuteAsk<'a> {
    /// The call's headers: where an `X-Capability-Token` may be.
    pub headers: &'a HeaderMap,
    pub mode: RunMode,
    /// The timeout checked for the mode (see [`super::run::timeout_of`]); None: the profile's.
    pub timeout: Option<Duration>,
    /// Whether a call without a capability token has the service token's own capabilities as
    /// its grant (a front end whose contract that is: MCP).
    pub service_grant: bool,
    /// The Idempotency-Key the caller sent, if any.
    pub idempotency_key: Option<String>,
    /// The front end, when not the REST API (`mcp`): the run's audit lines name it.
    pub via: Option<&'static str>,
}

/// The run of `req` for `caller`, in this order: its action type, NUL bytes in argv, the
/// capability token (a refusal is the audited 401), the Idempotency-Key's fingerprint. The
/// caller's known request collects what a refusal's audit line tells.
pub fn job(
    caller: &mut Caller,
    st: &AppState,
    req: ExecuteRequest,
    ask: ExecuteAsk<'_>,
) -> Result<RunJob<ExecuteWork>, ApiError> {
    let known = &mut caller.known;
    known.action_type = Some(req.action_type.clone());
    known.command = Some(req.command.clone());
    known.args = req.args.clone();
    let action = ActionType::parse(&req.action_type).ok_or_else(|| {
        ApiError::InvalidRequest(format!(
            "unknown action_type '{}': expected shell, http, python or external",
            req.action_type.escape_debug()
        ))
    })?;
    if req.args.iter().any(|a| a.contains('\0')) || req.command.contains('\0') {
        return Err(ApiError::InvalidRequest(
            "command and args may not contain NUL bytes".into(),
        ));
    }

    // What this call may do.
    let (cap, own_token) = match capability_token(req.capability_token.as_deref(), ask.headers)? {
        Some(token) => (caller.capability(st, token)?, true),
        // A front end whose contract it is (MCP): the service token's own capabilities. They
        // name no one of the service's callers, so such runs never share a container.
        None if ask.service_grant => (caller.service_grant(), false),
        None => return Err(unauthorized(st, &caller.known, "missing capability token")),
    };
    if caller.known.subject.is_none() {
        caller.known.subject = cap.subject.clone();
    }

    // Idempotency: a retry of a finished request gets the stored answer without running again.
    // The fingerprint is what runs and for whom, never a credential: a caller that mints a
    // capability token per attempt retries with another token. That token must grant the
    // request as a first attempt's would (checked before the stored answer is given).
    let owner = caller.owner();
    let idempotency = match ask.idempotency_key {
        Some(key) => Some(IdemAsk {
            fingerprint: fingerprint(&json!({"service": owner, "request": what_runs(&req)?}))?,
            key: IdemKey {
                subject: owner.clone(),
                key,
            },
        }),
        None => None,
    };
    let cancel_on_disconnect = req.cancel_on_disconnect;
    let inline_receipt = req.receipt;
    let mode = ask.mode;
    let mut request = req.into_execution(
        &caller.known,
        owner,
        cap,
        action,
        ask.timeout.map(|t| t.as_secs()),
        mode != RunMode::Sync,
    );
    request.via = ask.via;
    request.reuse_subject = own_token
        .then(|| request.capability.subject.clone())
        .flatten();
    Ok(RunJob {
        work: ExecuteWork(request),
        idempotency,
        mode,
        cancel_on_disconnect,
        timeout_status: StatusCode::REQUEST_TIMEOUT,
        links: "/v1/executions/".into(),
        process_links: None,
        inline_receipt,
    })
}

/// What `/execute` runs: its request as parsed, ready before its Idempotency-Key is held.
pub struct ExecuteWork(ExecutionRequest);

impl Work for ExecuteWork {
    type Held = ();

    /// The retry's own capability token must grant the request (see [`grants_replay`]).
    async fn may_replay(&self, st: &AppState) -> Result<(), ApiError> {
        grants_replay(st, &self.0).await
    }

    async fn prepare(self, _: &AppState) -> Result<(ExecutionRequest, ()), ApiError> {
        Ok((self.0, ()))
    }

    fn started(_: (), _: &Arc<LiveRun>) {}
}

/// Whether the capability token of a retry may have the stored answer of its Idempotency-Key:
/// the request is decided as a first attempt's would be (a refusal is audited and is the
/// answer: 403), and a single-use token is used up by it (a replayed one is 401).
async fn grants_replay(st: &AppState, request: &ExecutionRequest) -> Result<(), ApiError> {
    st.executions.plan(request)?;
    match claim_single_use(&**st.executions.store(), &request.capability).await {
        Ok(()) => Ok(()),
        Err(ClaimError::Refused(reason)) => Err(unauthorized(st, &request.known(), &reason)),
        Err(ClaimError::Unavailable(m)) => Err(ApiError::SandboxUnavailable(m)),
    }
}
