//! POST /execute: authenticate the caller, parse the request, hold its Idempotency-Key, hand it
//! to the execution service, answer.
//!
//! Owns: the wire request, the order of the checks that come before a request is an
//! [`ExecutionRequest`] (draining, service token, body, fields, capability token, idempotency),
//! and turning a finished execution into a status and body. Must not: decide, admit or run
//! anything itself (the execution service does).

use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::sync::watch;
use tracing::Instrument as _;
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::executions::RunAnswer;
use super::stream::{self, DISCONNECT_GRACE, Disconnect, Source, StreamPermit};
use super::{AppState, RequestId};
use crate::auth::Verified;
use crate::config::TokenKind;
use crate::execution::record::{self, KnownRequest, RefusalKind};
use crate::execution::result::ExecutionResult;
use crate::execution::runs::LiveRun;
use crate::execution::{
    ClaimError, ExecutionError, ExecutionRequest, ExternalParts, Finished, claim_single_use,
    owner_of,
};
use crate::metrics::Metrics;
use crate::policy::ActionType;
use crate::policy::profile::{MAX_ASYNC_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS};
use crate::provenance::sha256_prefixed;
use crate::state::{IdemBegin, IdemKey, StoredResponse};

/// The request body. Unknown fields are refused: a misspelt limit must not be silently ignored.
/// Every optional field may also be `null`, which is the same as leaving it out. An
/// Idempotency-Key's fingerprint covers it as parsed (see [`what_runs`]).
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteRequest {
    /// `shell`, `http`, `python` or `external`.
    #[schema(value_type = ActionType)]
    pub action_type: String,
    /// A bare allowlisted name (`ls`, `python3`) or, for `external`, a registered executor's
    /// name; never a path.
    pub command: String,
    /// Passed as argv, never through a shell.
    #[serde(default, deserialize_with = "super::null_as_default")]
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
    #[serde(default, deserialize_with = "super::null_as_default")]
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
    #[serde(default, rename = "async", deserialize_with = "super::null_as_default")]
    #[schema(nullable)]
    pub run_async: bool,
    /// Cancel the run when the caller goes away before its answer (by default it runs on).
    #[serde(default, deserialize_with = "super::null_as_default")]
    #[schema(nullable)]
    pub cancel_on_disconnect: bool,
}

/// The 202 of an async run (and the stored answer to a streamed one): where to read, stream and
/// cancel it.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunAccepted {
    pub exec_id: String,
    /// Always `running`.
    #[schema(value_type = String, pattern = "^running$")]
    pub status: &'static str,
    pub links: RunLinks,
}

/// A run's routes.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunLinks {
    /// Its status and result.
    #[serde(rename = "self")]
    pub this: String,
    /// Its output as Server-Sent Events.
    pub stream: String,
    /// Where to cancel it.
    pub cancel: String,
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
            action,
            command: self.command,
            args: self.args,
            timeout_seconds,
            long_run,
            profile: self.profile,
            env: self.env,
            stdin: self.stdin,
            metadata: self.metadata,
            external: ExternalParts {
                activity: self.activity,
                input: self.input,
                skills: self.skills,
                memory: self.memory,
                job: self.job,
                task: self.task,
                model: self.model,
            },
            idempotency_key: None,
            abandoned: None,
            session: None,
        }
    }
}

/// Where a caller may send the capability token instead of the body's `capability_token`.
pub const CAPABILITY_TOKEN_HEADER: &str = "x-capability-token";

/// The capability token a request carries, in its body or in [`CAPABILITY_TOKEN_HEADER`]: at
/// most one of the two, and the header at most once (a proxy in front may have checked the
/// other copy).
pub(super) fn capability_token<'a>(
    in_body: Option<&'a str>,
    headers: &'a HeaderMap,
) -> Result<Option<&'a str>, ApiError> {
    let mut header_tokens = headers.get_all(CAPABILITY_TOKEN_HEADER).iter();
    let header_token = header_tokens.next().map(|v| v.to_str().unwrap_or_default());
    if header_tokens.next().is_some() {
        return Err(ApiError::InvalidRequest(format!(
            "{CAPABILITY_TOKEN_HEADER} is given more than once"
        )));
    }
    match (in_body, header_token) {
        (Some(_), Some(_)) => Err(ApiError::InvalidRequest(format!(
            "the capability token is given twice: in the body and in {CAPABILITY_TOKEN_HEADER}"
        ))),
        (Some(t), None) | (None, Some(t)) => Ok(Some(t)),
        (None, None) => Ok(None),
    }
}

/// Counts and audits a 401 (see [`record::refusal`]); the answer is always the same body.
pub(super) fn unauthorized(st: &AppState, known: &KnownRequest, reason: &str) -> ApiError {
    record::refusal(
        &st.audit,
        &st.metrics,
        known,
        RefusalKind::Unauthorized,
        reason,
    );
    ApiError::Unauthorized
}

pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

/// The calling service, from its bearer token (a single-use one is used up here); a refusal is
/// a 401, audited with what `known` tells of the request.
pub(super) async fn calling_service(
    st: &AppState,
    headers: &HeaderMap,
    known: &mut KnownRequest,
) -> Result<Verified, ApiError> {
    let service = match bearer(headers) {
        Some(t) => st
            .auth
            .verify(t, TokenKind::Service)
            .map_err(|e| unauthorized(st, known, &format!("service token: {e}")))?,
        None => {
            return Err(unauthorized(
                st,
                known,
                "missing Authorization: Bearer service token",
            ));
        }
    };
    known.subject = service.subject.clone();
    claim_single_use(&*st.store, &service)
        .await
        .map_err(|e| match e {
            ClaimError::Refused(reason) => unauthorized(st, known, &reason),
            ClaimError::Unavailable(m) => ApiError::SandboxUnavailable(m),
        })?;
    Ok(service)
}

pub(super) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    deadline: Duration,
) -> Result<bytes::Bytes, ApiError> {
    // Refuse on the declared length before reading anything.
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    // Chunked bodies: stop reading at the first byte past the limit. The whole body must arrive
    // within the deadline, or a trickling client holds a connection and a task forever.
    let read = tokio::time::timeout(deadline, to_bytes(body, limit))
        .await
        .map_err(|_| ApiError::BodyTimeout(deadline))?;
    read.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            || e.to_string().contains("length limit");
        if too_large {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::InvalidRequest(format!("could not read the request body: {e}"))
        }
    })
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
    detached(st, move |st, on_disconnect| {
        execute_detached(st, req, on_disconnect)
    })
    .await
}

/// Serves a request that runs something on a task of its own: a client that disconnects
/// mid-run does not cancel the run's audit line, metrics, in-flight gauge or stored idempotent
/// result, only its reply (and the run itself only when the request asked for that).
pub(super) async fn detached<F, Fut>(st: Arc<AppState>, f: F) -> Response
where
    F: FnOnce(Arc<AppState>, Arc<DisconnectCancel>) -> Fut,
    Fut: std::future::Future<Output = Response> + Send + 'static,
{
    let on_disconnect = Arc::new(DisconnectCancel::default());
    let mut guard = CancelIfDropped {
        st: st.clone(),
        cancel: on_disconnect.clone(),
        armed: true,
    };
    // The task stays in the request's span: its steps are the request's.
    let resp = match tokio::spawn(f(st, on_disconnect).in_current_span()).await {
        Ok(resp) => resp,
        Err(e) => ApiError::Internal(format!("request task failed: {e}")).into_response(),
    };
    guard.armed = false;
    resp
}

/// Whether the caller of a request went away before its answer, and the run a synchronous
/// request that said `cancel_on_disconnect` waits for, once it started.
#[derive(Default)]
pub(super) struct DisconnectCancel {
    run: std::sync::Mutex<Option<Disconnect>>,
    /// Raised when the caller goes away: a request still waiting for a run slot gives up.
    gone: watch::Sender<bool>,
}

impl DisconnectCancel {
    /// Names the run to cancel if the caller goes away; cancels it at once if it already has.
    fn arm(&self, st: &AppState, d: Disconnect) {
        *self.run.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
        if *self.gone.borrow() {
            self.cancel_named(st);
        }
    }

    /// Cancels the named run unless it has answered; whoever takes the name first cancels it.
    fn cancel_named(&self, st: &AppState) {
        let named = self.run.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(d) = named
            && d.live.answered().is_none()
        {
            tracing::info!(
                exec_id = d.live.exec_id(),
                "client gone: cancelling its run"
            );
            st.executions
                .cancel(&d.live, DISCONNECT_GRACE, &d.owner, &d.request_id);
        }
    }
}

/// Dropped while armed (the client went away before the answer): the request gives up its
/// place in a queue, and the run it names is cancelled.
struct CancelIfDropped {
    st: Arc<AppState>,
    cancel: Arc<DisconnectCancel>,
    armed: bool,
}

impl Drop for CancelIfDropped {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Raised before the name is read: a run named after this sees the flag and cancels
        // itself (DisconnectCancel::arm).
        self.cancel.gone.send_replace(true);
        self.cancel.cancel_named(&self.st);
    }
}

/// How the caller waits for its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// For the answer, in this response.
    Sync,
    /// Not at all: 202 with the run's links.
    Async,
    /// As Server-Sent Events.
    Stream,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Async => "async",
            Mode::Stream => "stream",
        }
    }
}

/// What a started run answers now.
enum Answer {
    Stored(StoredResponse),
    Stream(Arc<LiveRun>),
}

async fn execute_detached(
    st: Arc<AppState>,
    req: Request,
    on_disconnect: Arc<DisconnectCancel>,
) -> Response {
    let rid = req
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let mut known = KnownRequest {
        request_id: rid,
        ..KnownRequest::default()
    };
    match handle(
        &st,
        &parts.headers,
        &parts.uri,
        body,
        &mut known,
        &on_disconnect,
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

/// The checks of one request, in order; `known` collects what a refusal's audit line tells.
async fn handle(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    body: Body,
    known: &mut KnownRequest,
    on_disconnect: &DisconnectCancel,
) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    // Who is calling: checked before the body is even read.
    let service = calling_service(st, headers, known).await?;
    let idem_key = idempotency_key(headers)?;
    let raw = read_body(
        body,
        headers,
        st.config.server.body_limit_bytes,
        Duration::from_secs(st.config.server.body_read_timeout_seconds),
    )
    .await?;
    let req = parse_request(&raw)?;
    known.action_type = Some(req.action_type.clone());
    known.command = Some(req.command.clone());
    known.args = req.args.clone();
    let action = ActionType::parse(&req.action_type).ok_or_else(|| {
        ApiError::InvalidRequest(format!(
            "unknown action_type '{}': expected shell, http, python or external",
            req.action_type.escape_debug()
        ))
    })?;
    let streaming = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"));
    let mode = match (req.run_async, streaming) {
        (true, true) => {
            return Err(ApiError::InvalidRequest(
                "async and Accept: text/event-stream exclude each other: stream an async run \
                 at its links.stream"
                    .into(),
            ));
        }
        (true, false) => Mode::Async,
        (false, true) => Mode::Stream,
        (false, false) => Mode::Sync,
    };
    let framing = stream::Framing::of(uri)?;
    // Synchronous runs keep the wire's 1-300 s; async and streamed ones may ask for more (the
    // profile's max_async_timeout_seconds clamps it).
    let max_timeout = if mode == Mode::Sync {
        MAX_TIMEOUT_SECONDS
    } else {
        MAX_ASYNC_TIMEOUT_SECONDS
    };
    let timeout = match req.timeout_seconds {
        None => None,
        Some(t) if (1..=max_timeout as i64).contains(&t) => Some(t as u64),
        Some(t) => {
            let mode = match mode {
                Mode::Async => "an async run",
                Mode::Stream => "a streamed run",
                Mode::Sync => "a synchronous run",
            };
            return Err(ApiError::InvalidRequest(format!(
                "timeout_seconds must be between 1 and {max_timeout} for {mode}, got {t}"
            )));
        }
    };
    if req.args.iter().any(|a| a.contains('\0')) || req.command.contains('\0') {
        return Err(ApiError::InvalidRequest(
            "command and args may not contain NUL bytes".into(),
        ));
    }

    // What this call may do.
    let Some(token) = capability_token(req.capability_token.as_deref(), headers)? else {
        return Err(unauthorized(st, known, "missing capability token"));
    };
    let cap = st
        .auth
        .verify(token, TokenKind::Capability)
        .map_err(|e| unauthorized(st, known, &format!("capability token: {e}")))?;
    known.token_id = cap.token_id.clone();
    if known.subject.is_none() {
        known.subject = cap.subject.clone();
    }

    // Idempotency: a retry of a finished request gets the stored answer without running again.
    // The fingerprint is what runs and for whom, never a credential: a caller that mints a
    // capability token per attempt retries with another token. That token must grant the
    // request as a first attempt's would (checked before the stored answer is given).
    let owner = owner_of(service.subject.as_deref());
    let idem = match idem_key {
        Some(k) => Some((
            k,
            fingerprint(&json!({"service": owner, "request": what_runs(&req)?}))?,
        )),
        None => None,
    };
    let cancel_on_disconnect = req.cancel_on_disconnect;
    let known = known.clone();
    let request = req.into_execution(&known, owner, cap, action, timeout, mode != Mode::Sync);
    let probe = request.clone();
    let checker = st.clone();
    let job = Job {
        service,
        idem,
        mode,
        framing,
        cancel_on_disconnect,
        timeout_status: StatusCode::REQUEST_TIMEOUT,
        links: "/v1/executions/".into(),
        replay_check: Some(Box::new(move || {
            Box::pin(async move { grants_replay(&checker, &probe).await })
        })),
        build: Box::new(move || {
            Box::pin(async move {
                Ok(Prepared {
                    request,
                    on_start: None,
                })
            })
        }),
    };
    serve(st, job, on_disconnect).await
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

/// A request body as an Idempotency-Key's fingerprint covers it: its fields less the
/// credential and how the caller waits (`capability_token`, `cancel_on_disconnect`).
pub(super) fn what_runs(body: &impl Serialize) -> Result<Value, ApiError> {
    let mut v =
        serde_json::to_value(body).map_err(|e| ApiError::Internal(format!("fingerprint: {e}")))?;
    if let Some(m) = v.as_object_mut() {
        m.remove("capability_token");
        m.remove("cancel_on_disconnect");
    }
    Ok(v)
}

/// An Idempotency-Key's fingerprint: the SHA-256 of `what` as canonical JSON (object keys
/// sorted, at every depth), so that the same request spelt in another key order matches.
pub(super) fn fingerprint(what: &Value) -> Result<String, ApiError> {
    fn canonical(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), canonical(&m[k])))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(canonical).collect()),
            other => other.clone(),
        }
    }
    let text = serde_json::to_string(&canonical(what))
        .map_err(|e| ApiError::Internal(format!("fingerprint: {e}")))?;
    Ok(sha256_prefixed(text.as_bytes()))
}

/// The `Idempotency-Key` a request carries: 1-255 visible ASCII characters, at most once. A
/// key that is not (bytes outside ASCII included) is a 400, never ignored: ignoring it would
/// run a retry again.
pub(super) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let invalid = || {
        ApiError::InvalidRequest("Idempotency-Key must be 1-255 visible ASCII characters".into())
    };
    let mut keys = headers.get_all("idempotency-key").iter();
    let Some(key) = keys.next() else {
        return Ok(None);
    };
    if keys.next().is_some() {
        return Err(ApiError::InvalidRequest(
            "Idempotency-Key is given more than once".into(),
        ));
    }
    let bytes = key.as_bytes();
    if bytes.is_empty() || bytes.len() > 255 || !bytes.iter().all(u8::is_ascii_graphic) {
        return Err(invalid());
    }
    String::from_utf8(bytes.to_vec())
        .map(Some)
        .map_err(|_| invalid())
}

/// What [`serve`] runs: the request as its route parsed it, and how its caller waits.
pub(super) struct Job {
    pub service: Verified,
    /// The Idempotency-Key as the caller sent it, and the fingerprint of what it asked.
    pub idem: Option<(String, String)>,
    pub mode: Mode,
    /// How a stream cuts output into events (`?framing=`).
    pub framing: stream::Framing,
    pub cancel_on_disconnect: bool,
    /// The status of a synchronous answer whose run the wall clock ended.
    pub timeout_status: StatusCode,
    /// Where the run is read, streamed and cancelled, less its exec_id: `/v1/executions/` for
    /// `/execute`, the session's `/execs/` for a session's exec (the 202's links).
    pub links: String,
    /// Checks that the caller may have a stored answer of its Idempotency-Key (its credentials
    /// are not in the fingerprint), before it is given; None: the fingerprint binds them.
    pub replay_check: Option<ReplayCheck>,
    /// Makes the execution request once the Idempotency-Key is held: a replay makes none.
    pub build: Box<dyn FnOnce() -> BoxFuture<'static, Result<Prepared, ApiError>> + Send>,
}

/// See [`Job::replay_check`].
pub(super) type ReplayCheck = Box<dyn FnOnce() -> BoxFuture<'static, Result<(), ApiError>> + Send>;

/// A run about to be admitted, and what to do once it started.
pub(super) struct Prepared {
    pub request: ExecutionRequest,
    pub on_start: Option<OnStart>,
}

/// Told the live run once it started (never, when admission failed).
pub(super) type OnStart = Box<dyn FnOnce(&Arc<LiveRun>) + Send>;

/// The part every run request shares, whatever route made it: the Idempotency-Key (a retry of
/// a finished request gets the stored answer without running again), the stream permit, the run
/// and the answer in the caller's mode.
pub(super) async fn serve(
    st: &Arc<AppState>,
    job: Job,
    on_disconnect: &DisconnectCancel,
) -> Result<Response, ApiError> {
    let Job {
        service,
        idem,
        mode,
        framing,
        cancel_on_disconnect,
        timeout_status,
        links,
        replay_check,
        build,
    } = job;
    let idem = match idem {
        Some((k, body_hash)) => {
            let scoped = IdemKey {
                subject: service.subject.clone().unwrap_or_else(|| "-".into()),
                key: k,
            };
            let lease = Duration::from_secs(st.config.state.idempotency_lease_seconds);
            match st
                .store
                .idempotency_begin(&scoped, &body_hash, &st.instance_id, lease)
                .await
                .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?
            {
                IdemBegin::Started => Some((LeaseRenewal::start(st, &scoped, lease), body_hash)),
                IdemBegin::InProgress { same_body: true } => {
                    return Err(ApiError::IdempotencyInProgress);
                }
                IdemBegin::InProgress { same_body: false }
                | IdemBegin::Done {
                    same_body: false, ..
                } => return Err(ApiError::IdempotencyConflict),
                IdemBegin::Done {
                    same_body: true,
                    response,
                } => {
                    if let Some(check) = replay_check {
                        check().await?;
                    }
                    return Ok(stored_response(&response, true));
                }
            }
        }
        None => None,
    };
    let release = |idem: Option<(LeaseRenewal, String)>| async move {
        if let Some((lease, _)) = idem {
            let key = lease.stop();
            if let Err(e) = st.store.idempotency_release(&key, &st.instance_id).await {
                tracing::error!(error = %e, "idempotency key not released");
            }
        }
    };
    // A stream's permit is taken before anything runs: a refused stream runs nothing, and gives
    // its Idempotency-Key back so that the retry its 429 invites is not refused as in progress.
    let permit = match mode {
        Mode::Stream => match StreamPermit::take(st) {
            Ok(p) => Some(p),
            Err(e) => {
                release(idem).await;
                return Err(e);
            }
        },
        Mode::Sync | Mode::Async => None,
    };
    let Prepared {
        mut request,
        on_start,
    } = match build().await {
        Ok(p) => p,
        Err(e) => {
            release(idem).await;
            return Err(e);
        }
    };
    request.idempotency_key = idem.as_ref().map(|(l, _)| l.key.scoped());
    request.abandoned = Some(on_disconnect.gone.subscribe());
    let owner = request.owner.clone();
    let request_id = request.request_id.clone();
    let how = How {
        mode,
        cancel_on_disconnect,
        timeout_status,
        links: links.clone(),
        on_start,
    };
    let answered = run_request(st, request, how, on_disconnect).await;
    if let Some((lease, body_hash)) = idem {
        let key = lease.stop();
        let ttl = Duration::from_secs(st.config.state.idempotency_ttl_seconds);
        // A retry of a streamed request gets the run's links, as an async one does. A run its
        // caller cancelled by going away answered nobody: its retry runs again.
        let cancelled_for_leaving = cancel_on_disconnect && *on_disconnect.gone.borrow();
        let stored = match &answered {
            Ok(Answer::Stored(_)) if cancelled_for_leaving => None,
            Ok(Answer::Stored(a)) if matches!(a.status, 200 | 202 | 408) => Some(a.clone()),
            Ok(Answer::Stream(live)) => Some(StoredResponse {
                status: StatusCode::ACCEPTED.as_u16(),
                body: accepted_body(&links, live.exec_id()),
            }),
            _ => None,
        };
        match stored {
            Some(stored) => {
                if let Err(e) = st
                    .store
                    .idempotency_complete(&key, &body_hash, &stored, ttl)
                    .await
                {
                    tracing::error!(error = %e, "idempotency result not stored");
                }
            }
            None => {
                if let Err(e) = st.store.idempotency_release(&key, &st.instance_id).await {
                    tracing::error!(error = %e, "idempotency key not released");
                }
            }
        }
    }
    match answered? {
        Answer::Stored(a) => Ok(stored_response(&a, false)),
        Answer::Stream(live) => {
            let cancel = cancel_on_disconnect.then(|| Disconnect {
                live: live.clone(),
                owner,
                request_id,
            });
            let permit =
                permit.ok_or_else(|| ApiError::Internal("stream without permit".into()))?;
            Ok(stream::follow(
                permit,
                Source::Live(live),
                framing,
                None,
                cancel,
            ))
        }
    }
}

/// How the caller of a run waits for it.
struct How {
    mode: Mode,
    cancel_on_disconnect: bool,
    timeout_status: StatusCode,
    /// See [`Job::links`].
    links: String,
    on_start: Option<OnStart>,
}

/// Admits the request and starts its run. Async: the 202 that names the run, at once. Stream:
/// the live run to follow. Otherwise: the run's answer once it has one (200, or 408 when the
/// wall clock ended it, with the result as body; or the error it ended with). Either way the run
/// goes on if the caller goes away (unless it asked otherwise), and its answer stays readable at
/// `/v1/executions/{exec_id}`.
async fn run_request(
    st: &AppState,
    request: ExecutionRequest,
    how: How,
    on_disconnect: &DisconnectCancel,
) -> Result<Answer, ApiError> {
    let How {
        mode,
        cancel_on_disconnect,
        timeout_status,
        links,
        on_start,
    } = how;
    let owner = request.owner.clone();
    let request_id = request.request_id.clone();
    let execution = st.executions.admit(request).await?;
    st.metrics
        .runs_started
        .with_label_values(&[mode.label()])
        .increment(1);
    let metrics = st.metrics.clone();
    let live = st
        .executions
        .start(execution, move |r| answer_of(&metrics, r, timeout_status));
    if let Some(f) = on_start {
        f(&live);
    }
    match mode {
        Mode::Async => {
            return Ok(Answer::Stored(StoredResponse {
                status: StatusCode::ACCEPTED.as_u16(),
                body: accepted_body(&links, live.exec_id()),
            }));
        }
        Mode::Stream => return Ok(Answer::Stream(live)),
        Mode::Sync => {}
    }
    if cancel_on_disconnect {
        on_disconnect.arm(
            st,
            Disconnect {
                live: live.clone(),
                owner,
                request_id,
            },
        );
    }
    let mut answer = live.answer();
    let answered = answer
        .wait_for(Option::is_some)
        .await
        .map_err(|_| ApiError::Internal("the run ended without an answer".into()))?
        .clone();
    answered
        .map(|a| Answer::Stored((*a).clone()))
        .ok_or_else(|| ApiError::Internal("the run ended without an answer".into()))
}

/// What the caller of a run gets once it ended: 200, or 408 when the wall clock ended it, with
/// the result as body; the error's status and body when it ended without an outcome.
fn answer_of(
    metrics: &Metrics,
    r: Result<Finished, ExecutionError>,
    timeout_status: StatusCode,
) -> StoredResponse {
    let error = match r {
        Ok(Finished { result, timed_out }) => match serde_json::to_string(&result) {
            Ok(body) => {
                let status = if timed_out {
                    timeout_status
                } else {
                    StatusCode::OK
                };
                return StoredResponse {
                    status: status.as_u16(),
                    body,
                };
            }
            Err(e) => ApiError::Internal(format!("result not serialisable: {e}")),
        },
        Err(e) => ApiError::from(e),
    };
    if let ApiError::SandboxUnavailable(_) = error {
        metrics
            .rejected
            .with_label_values(&["sandbox_unavailable"])
            .increment(1);
    }
    if let ApiError::Internal(detail) = &error {
        tracing::error!(detail = %detail, "internal error");
    }
    StoredResponse {
        status: error.status().as_u16(),
        body: error.body().to_string(),
    }
}

/// The 202 body of an async run: where to read, stream and cancel it (its routes are under
/// `links`, see [`Job::links`]).
pub(super) fn accepted_body(links: &str, exec_id: &str) -> String {
    let base = format!("{links}{exec_id}");
    let body = RunAccepted {
        exec_id: exec_id.to_string(),
        status: "running",
        links: RunLinks {
            stream: format!("{base}/stream"),
            cancel: format!("{base}/cancel"),
            this: base,
        },
    };
    serde_json::to_string(&body).unwrap_or_default()
}

/// Keeps this daemon's claim on an Idempotency-Key alive while its request runs: renews the lease
/// every third of it, until stopped or dropped.
struct LeaseRenewal {
    key: IdemKey,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseRenewal {
    fn start(st: &Arc<AppState>, key: &IdemKey, lease: Duration) -> LeaseRenewal {
        let st = st.clone();
        let k = key.clone();
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(lease / 3);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await; // the first tick is now: the claim is fresh
            loop {
                every.tick().await;
                match st.store.idempotency_renew(&k, &st.instance_id, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Lapsed (the daemon stalled past the lease) and maybe taken: a retry
                        // may run concurrently; nothing more to renew.
                        tracing::warn!(key = %k.scoped(), "idempotency key lease lost while its request runs");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(key = %k.scoped(), error = %e, "idempotency key lease not renewed")
                    }
                }
            }
        });
        LeaseRenewal {
            key: key.clone(),
            task,
        }
    }

    /// Stops renewing; returns the key.
    fn stop(self) -> IdemKey {
        self.task.abort();
        self.key.clone()
    }
}

impl Drop for LeaseRenewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An answer as HTTP: JSON, with `Retry-After` on 429 and 503 and, for a 202, the run's
/// `Location`; `replayed` marks the stored answer to an Idempotency-Key's retry.
pub(super) fn stored_response(r: &StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::OK);
    let mut resp = (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        r.body.clone(),
    )
        .into_response();
    let headers = resp.headers_mut();
    if replayed {
        headers.insert(
            header::HeaderName::from_static("idempotent-replayed"),
            HeaderValue::from_static("true"),
        );
    }
    let retry_after = match status {
        StatusCode::TOO_MANY_REQUESTS => Some(1u64),
        // A backend or the audit log is down: give it time to come back.
        StatusCode::SERVICE_UNAVAILABLE => Some(5),
        _ => None,
    };
    if let Some(secs) = retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if status == StatusCode::ACCEPTED
        && let Some(location) = serde_json::from_str::<Value>(&r.body)
            .ok()
            .and_then(|v| v["links"]["self"].as_str().map(str::to_string))
        && let Ok(v) = HeaderValue::from_str(&location)
    {
        headers.insert(header::LOCATION, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(bearer(&with("Bearer abc")), Some("abc"));
        assert_eq!(bearer(&with("bearer  abc ")), Some("abc"));
        assert_eq!(bearer(&with("Basic abc")), None);
        assert_eq!(bearer(&with("Bearer ")), None);
        assert_eq!(bearer(&with("Bearer")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }
}
