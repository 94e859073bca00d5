//! POST /execute: authenticate the caller, parse the request, hand it as a [`RunJob`] to the
//! run plumbing every run route shares (see [`super::run`]).
//!
//! Owns: the wire request, the order of the checks that come before a request is an
//! [`ExecutionRequest`] (draining, service token, body, fields, capability token, idempotency),
//! and who may have a retry's stored answer. Must not: decide, admit or run anything itself
//! (the execution service does), or render a run's answer (`run` does).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use super::app_state::AppState;
use super::caller::{BodyLimit, Caller, RequestId, capability_token, read_body, unauthorized};
use super::error::{ApiError, ErrorBody};
use super::run::{
    AskedTimeout, ClientLink, IdemAsk, RunAccepted, RunAnswer, RunAsk, RunJob, RunMode, RunOptions,
    Work, fingerprint, idempotency_key, what_runs,
};
use super::stream;
use crate::auth::Verified;
use crate::execution::record::KnownRequest;
use crate::execution::result::ExecutionResult;
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
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
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
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
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
        deserialize_with = "super::caller::null_as_default"
    )]
    #[schema(nullable)]
    pub run_async: bool,
    /// Cancel the run when the caller goes away before its answer (by default it runs on).
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
    #[schema(nullable)]
    pub cancel_on_disconnect: bool,
}

impl ExecuteRequest {
    /// The typed request the execution service takes, once the caller is authenticated.
    fn into_execution(
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

/// Run one command or external executor.
///
/// Synchronous by default: the answer is the run's result (200; 408 when the wall clock ended
/// it). `"async": true` answers 202 at once with the run's links; `Accept: text/event-stream`
/// answers with the run as Server-Sent Events (`start`, `stdout`/`stderr` with `offset` and
/// `data` or `data_b64`, then `result` with the synchronous body plus `http_status`).
#[utoipa::path(
    post,
    path = "/execute",
    operation_id = "execute",
    tag = "execute",
    request_body = ExecuteRequest,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1-255 visible ASCII characters (any other byte is a 400), scoped to the calling service: a retry of the same request (the body's fields less `capability_token` and `cancel_on_disconnect`) gets the stored answer (header `Idempotent-Replayed: true`) and runs nothing again, once its own capability token is checked as a first attempt's would be (a token that may not run the request gets that 401 or 403, never the answer)"),
        stream::StreamQuery,
    ),
    security(("bearer" = [], "capability_token" = [])),
    responses(
        (status = 200, description = "The command ran to an exit (check `success`); with `Accept: text/event-stream`, the run as Server-Sent Events", content(
            (ExecutionResult = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 202, description = "`async`: the run started; `Location` names it", body = RunAccepted,
            headers(("Location" = String, description = "/v1/executions/{exec_id}"))),
        (status = 400, description = "InvalidRequest: malformed JSON, wrong types, unknown field or action_type, timeout out of range, NUL in argv, argv or env over execve's limits, the capability token given twice, async with a stream, a malformed Idempotency-Key, an unknown `framing`", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service or capability token is missing, malformed, invalid, expired or replayed", body = ErrorBody),
        (status = 403, description = "CapabilityViolation: the command is not allowlisted (adds `allowed_commands`), the token lacks a capability, an argument, profile or env name is refused", body = ErrorBody),
        (status = 408, description = "ExecutionTimeout: the wall clock ended the run (the result, with `error_type`); or RequestTimeout: the body did not arrive in time", body = RunAnswer),
        (status = 409, description = "IdempotencyInProgress: the first request with this Idempotency-Key is still running", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 422, description = "IdempotencyConflict: the Idempotency-Key was used with another request", body = ErrorBody),
        (status = 429, description = "Overloaded: no run slot came free (or too many streams are open)", body = ErrorBody),
        (status = 500, description = "InternalError: the sandbox failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the backend, a kernel feature, egress or the state store is missing or down, or the daemon is shutting down", body = ErrorBody),
    )
)]
pub async fn execute(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let client = ClientLink::new();
    client
        .serve(&st, answer(st.clone(), req, client.clone()))
        .await
}

/// The answer to one request, on the task [`ClientLink::serve`] gives it; a refusal is counted
/// in `rejected` by its kind.
async fn answer(st: Arc<AppState>, req: Request, client: Arc<ClientLink>) -> Response {
    let rid = RequestId::of(&req);
    let (parts, body) = req.into_parts();
    let service_grant = super::caller::service_grant(&parts.extensions);
    match handle(
        &st,
        &parts.headers,
        &parts.uri,
        body,
        rid,
        &client,
        service_grant,
    )
    .await
    {
        Ok(resp) => resp,
        Err(e) => {
            let label = match &e {
                ApiError::Overloaded(_) => Some("overloaded"),
                ApiError::PayloadTooLarge(_) => Some("payload_too_large"),
                ApiError::BodyTimeout(_) => Some("body_timeout"),
                ApiError::InvalidRequest(_) => Some("invalid_request"),
                ApiError::SandboxUnavailable(_) | ApiError::ShuttingDown => {
                    Some("sandbox_unavailable")
                }
                ApiError::IdempotencyConflict | ApiError::IdempotencyInProgress => {
                    Some("idempotency")
                }
                _ => None,
            };
            if let Some(l) = label {
                st.metrics.rejected.with_label_values(&[l]).increment(1);
            }
            e.into_response()
        }
    }
}

/// The checks of one request, in order; `caller.known` collects what a refusal's audit line
/// tells.
async fn handle(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    body: Body,
    request_id: String,
    client: &ClientLink,
    service_grant: bool,
) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    // Who is calling: checked before the body is even read.
    let mut caller = Caller::authenticate(st, headers, request_id).await?;
    let idem_key = idempotency_key(headers)?;
    let raw = read_body(body, headers, BodyLimit::request(st)).await?;
    let req = parse_request(&raw)?;
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
    let RunOptions {
        mode,
        framing,
        timeout,
    } = RunOptions::check(RunAsk {
        run_async: req.run_async,
        timeout: AskedTimeout::Seconds(req.timeout_seconds),
        headers,
        uri,
    })?;
    let timeout = timeout.map(|t| t.as_secs());
    if req.args.iter().any(|a| a.contains('\0')) || req.command.contains('\0') {
        return Err(ApiError::InvalidRequest(
            "command and args may not contain NUL bytes".into(),
        ));
    }

    // What this call may do.
    let cap = match capability_token(req.capability_token.as_deref(), headers)? {
        Some(token) => caller.capability(st, token)?,
        // A front end whose contract it is (MCP): the service token's own capabilities.
        None if service_grant => caller.service.clone(),
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
    let idempotency = match idem_key {
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
    let request = req.into_execution(
        &caller.known,
        owner,
        cap,
        action,
        timeout,
        mode != RunMode::Sync,
    );
    let job = RunJob {
        work: ExecuteWork(request),
        idempotency,
        mode,
        framing,
        cancel_on_disconnect,
        timeout_status: StatusCode::REQUEST_TIMEOUT,
        links: "/v1/executions/".into(),
        process_links: None,
    };
    job.serve(st, client).await
}

/// What `/execute` runs: its request as parsed, ready before its Idempotency-Key is held.
struct ExecuteWork(ExecutionRequest);

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
