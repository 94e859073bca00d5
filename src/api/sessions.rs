//! `/v1/sandbox/sessions`: sessions, their execs and their files, on the wire.
//!
//! Every route authenticates the calling service and reads the tenant (`X-Tenant-ID`, alias
//! `X-Koder-Tenant`; none is the empty tenant, never a wildcard). A session that is not the
//! caller's (another service or another tenant) is answered exactly like one that does not
//! exist: 404. An exec is a run like any `/execute` (Idempotency-Key, async, SSE, cancel).
//!
//! Owns: parsing and answering. Must not: manage sessions or touch their files itself (the
//! session service does).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};

use super::app_state::AppState;
use super::caller::{
    BodyLimit, Caller, RequestId, bearer, capability_token, read_body, unauthorized,
};
use super::error::{ApiError, ErrorBody};
use super::executions::{self, CancelAccepted, CancelRequest, RunStatus};
use super::extract::{Path, Query};
use super::run::{
    AskedTimeout, ClientLink, IdemAsk, RunAccepted, RunAsk, RunJob, RunMode, RunOptions, Work,
    detach, fingerprint, idempotency_key, what_runs,
};
use crate::config::TokenKind;
use crate::execution::ExecutionRequest;
use crate::execution::record::KnownRequest;
use crate::execution::result::ExecutionResult;
use crate::execution::runs::LiveRun;
use crate::policy::profile::MAX_ASYNC_TIMEOUT_SECONDS;
use crate::sessions::{
    ExecParts, FileError, NewSession, Owner, PreparedExec, PreparedProcess, Session, SessionError,
    SessionInfo, SessionLimits, UploadError,
};
use crate::state::IdemKey;

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Invalid(m) => ApiError::InvalidRequest(m),
            SessionError::Busy(id) => ApiError::SessionBusy(id),
            SessionError::TooMany(m) => ApiError::SessionLimit(m),
            SessionError::NotFound => ApiError::SessionNotFound,
            SessionError::StoreFull(m) => ApiError::StoreFull(m),
            SessionError::Execution(e) => e.into(),
        }
    }
}

impl From<FileError> for ApiError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::InvalidPath(m) | FileError::NotAFile(m) => ApiError::InvalidRequest(m),
            FileError::NotFound(p) => ApiError::FileNotFound(p),
            FileError::TooLarge { .. } => ApiError::FileTooLarge(e.to_string()),
            FileError::NoSpace => ApiError::WorkspaceFull,
            FileError::Busy(m) => ApiError::InvalidRequest(m),
            FileError::BadArchive(m) => ApiError::InvalidRequest(m),
            FileError::ArchiveTooLarge(m) => ApiError::FileTooLarge(m),
            FileError::Io(m) => ApiError::Internal(m),
        }
    }
}

/// A failed file call of `session` as its answer: busy is the session's 409, and a call that failed
/// because the session's sandbox went away (it died, or the session ended meanwhile) says so
/// (404) instead of a retryable 500.
fn file_failure(session: &Session, e: FileError) -> ApiError {
    match e {
        FileError::Busy(_) => ApiError::SessionBusy(session.id.clone()),
        FileError::Io(_) if session.sandbox_gone().is_some() => ApiError::SessionGone(format!(
            "session {} is gone: {}",
            session.id,
            session.sandbox_gone().unwrap_or_default()
        )),
        other => other.into(),
    }
}

/// The session's id in the path of every route under one session (OpenAPI only: handlers take it
/// with `Path`).
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(super) struct SessionPath {
    /// The session's id (`ses_…`)
    id: String,
}

/// The tenant headers every session route reads (OpenAPI only: [`super::caller::tenant`] reads
/// them).
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
pub(super) struct TenantHeaders {
    /// The tenant (0-256 visible ASCII; none is the empty tenant)
    #[param(rename = "X-Tenant-ID")]
    x_tenant_id: Option<String>,
    /// Alias of X-Tenant-ID; both given must agree
    #[param(rename = "X-Koder-Tenant")]
    x_koder_tenant: Option<String>,
}

/// The calling service and its tenant, as a session's owner.
async fn caller(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
) -> Result<(Owner, crate::auth::Verified, KnownRequest), ApiError> {
    let caller = Caller::authenticate(st, headers, rid).await?;
    let owner = caller.session_owner(headers)?;
    Ok((owner, caller.service, caller.known))
}

/// How a call touches its session: reading it leaves its idle time running; an exec or a file
/// call starts it again.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Touch {
    Read,
    Use,
}

/// A session a call names, as the caller's own: running (with a sandbox), or paused.
pub(super) enum Looked {
    Live(Arc<Session>),
    Paused(Box<SessionInfo>),
}

/// The caller's session `id`, running or paused, or 404. A call that uses the session (an exec,
/// a file call) resumes a paused one.
pub(super) async fn look_up(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    touch: Touch,
) -> Result<(Looked, Owner, crate::auth::Verified, KnownRequest), ApiError> {
    let (owner, service, known) = caller(st, headers, rid.clone()).await?;
    let session = match touch {
        Touch::Read => st.sessions.get(&owner, id),
        Touch::Use => st.sessions.use_session(&owner, id),
    };
    if let Some(s) = &session
        && st.sessions.end_if_lost(s).await
    {
        return Err(ApiError::SessionGone(
            st.sessions.lost(&owner, id).unwrap_or_default(),
        ));
    }
    if let Some(s) = session {
        return Ok((Looked::Live(s), owner, service, known));
    }
    if let Some(info) = st.sessions.paused(&owner, id) {
        let looked = match touch {
            Touch::Read => Looked::Paused(Box::new(info)),
            Touch::Use => Looked::Live(st.sessions.resume(&owner, id, rid).await?),
        };
        return Ok((looked, owner, service, known));
    }
    // Resumed by another call meanwhile: open now.
    if let Some(s) = st.sessions.get(&owner, id) {
        return Ok((Looked::Live(s), owner, service, known));
    }
    Err(st
        .sessions
        .lost(&owner, id)
        .map_or(ApiError::SessionNotFound, ApiError::SessionGone))
}

/// The caller's session `id` with its sandbox (a paused one is resumed when `touch` uses it, and
/// is 404 to a call that only reads), or 404.
pub(super) async fn session_of(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    touch: Touch,
) -> Result<(Arc<Session>, crate::auth::Verified, KnownRequest), ApiError> {
    match look_up(st, headers, rid, id, touch).await? {
        (Looked::Live(s), _, service, known) => Ok((s, service, known)),
        (Looked::Paused(_), ..) => Err(ApiError::SessionNotFound),
    }
}

/// The caller's exec `exec_id` of its session `id`, as the run routes take it: the owner of the
/// session's runs and what refusals tell. An exec of another session is 404.
async fn session_exec(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    exec_id: &str,
) -> Result<(String, KnownRequest), ApiError> {
    let (looked, owner, _, known) = look_up(st, headers, rid, id, Touch::Read).await?;
    let ran = match looked {
        Looked::Live(s) => s.ran(exec_id),
        // A paused session's execs are served as a running one's.
        Looked::Paused(_) => st.sessions.paused_ran(&owner, id, exec_id),
    };
    if !ran {
        return Err(ApiError::ExecutionNotFound);
    }
    Ok((owner.runs(), known))
}

fn json(status: StatusCode, body: impl Serialize) -> Response {
    (status, axum::Json(body)).into_response()
}

/// The body of `POST /v1/sandbox/sessions`. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// A configured session language (`/capabilities` lists them as `session_languages`).
    language: String,
    /// A sandbox profile the grant permits (default: the language's).
    #[serde(default)]
    profile: Option<String>,
    /// The session's life, at most `sessions.max_ttl_seconds`.
    #[serde(default)]
    ttl_seconds: Option<u64>,
    /// How long the session may go without an exec or file call.
    #[serde(default)]
    idle_timeout_seconds: Option<u64>,
    /// Limits that may only tighten the profile's.
    #[serde(default)]
    limits: Option<SessionLimits>,
    /// The capability token (or the `X-Capability-Token` header; not both).
    #[serde(default)]
    capability_token: Option<String>,
}

/// `POST /v1/sandbox/sessions`: 201 with the session.
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions",
    operation_id = "create_session",
    tag = "sessions",
    request_body = CreateBody,
    params(
        TenantHeaders,
    ),
    security(("bearer" = [], "capability_token" = [])),
    responses(
        (status = 201, description = "The session", body = SessionInfo,
            headers(("Location" = String, description = "/v1/sandbox/sessions/{id}"))),
        (status = 400, description = "InvalidRequest: malformed body, unknown language, limits that loosen the profile's, a malformed tenant, the capability token given twice", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service or capability token is missing or invalid", body = ErrorBody),
        (status = 403, description = "CapabilityViolation: the grant does not allow the language's interpreter or the profile", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 429, description = "Overloaded: `sessions.max_total` or `sessions.max_per_tenant` sessions are open", body = ErrorBody),
        (status = 500, description = "InternalError: the sandbox failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the backend or the sessions directory is unavailable, or the daemon is shutting down", body = ErrorBody),
    )
)]
pub async fn create(State(st): State<Arc<AppState>>, req: Request) -> Response {
    // On a task of its own: a client that goes away mid-creation leaves no half-made session.
    detach(async move {
        let rid = RequestId::of(&req);
        match create_inner(&st, req, rid).await {
            Ok(r) => r,
            Err(e) => e.into_response(),
        }
    })
    .await
}

async fn create_inner(st: &AppState, req: Request, rid: String) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    let (parts, body) = req.into_parts();
    let mut caller = Caller::authenticate(st, &parts.headers, rid).await?;
    let owner = caller.session_owner(&parts.headers)?;
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    let asked: CreateBody = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::InvalidRequest(format!("invalid session request: {e}")))?;
    let token = capability_token(asked.capability_token.as_deref(), &parts.headers)?;
    let grant = match token {
        // A single-use token is used up by the session service once the session can be made.
        Some(t) => caller.capability(st, t)?,
        None if st.config.sessions.accept_service_capabilities
            || super::caller::service_grant(&parts.extensions) =>
        {
            caller.service
        }
        None => {
            return Err(unauthorized(
                st,
                &caller.known,
                "missing capability token (sessions.accept_service_capabilities is off)",
            ));
        }
    };
    let session = st
        .sessions
        .create(NewSession {
            request_id: caller.known.request_id.clone(),
            owner,
            language: asked.language,
            profile: asked.profile,
            ttl: asked.ttl_seconds.map(Duration::from_secs),
            idle_timeout: asked.idle_timeout_seconds.map(Duration::from_secs),
            limits: asked.limits.unwrap_or_default(),
            grant,
        })
        .await?;
    let mut resp = json(StatusCode::CREATED, session.describe());
    if let Ok(v) = HeaderValue::from_str(&format!("/v1/sandbox/sessions/{}", session.id)) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    Ok(resp)
}

/// `GET /v1/sandbox/sessions/{id}`.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}",
    operation_id = "get_session",
    tag = "sessions",
    params(
        SessionPath,
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The session", body = SessionInfo),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant, or its sandbox is gone", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn get(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    match look_up(&st, &headers, rid, &id, Touch::Read).await {
        Ok((Looked::Live(s), ..)) => json(StatusCode::OK, s.describe()),
        Ok((Looked::Paused(info), ..)) => json(StatusCode::OK, *info),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/sandbox/sessions/{id}`: kills a running exec, removes everything; 204.
#[utoipa::path(
    delete,
    path = "/v1/sandbox/sessions/{id}",
    operation_id = "delete_session",
    tag = "sessions",
    params(
        SessionPath,
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "The session ended"),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant, or its sandbox is gone", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn delete(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    // On a task of its own: a DELETE that arrived is carried out even if its client goes away.
    detach(async move {
        let result = async {
            let (owner, ..) = caller(&st, &headers, rid).await?;
            if st.sessions.delete(&owner, &id).await || st.sessions.delete_paused(&owner, &id) {
                Ok(StatusCode::NO_CONTENT.into_response())
            } else {
                Err(ApiError::SessionNotFound)
            }
        };
        result.await.unwrap_or_else(|e| e.into_response())
    })
    .await
}

/// `POST /v1/sandbox/sessions/{id}/pause`: saves the workspace, frees the sandbox; 200 with the
/// session, `state: "paused"` (a paused session is answered as it is).
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/pause",
    operation_id = "pause_session",
    tag = "sessions",
    params(
        SessionPath,
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The session, paused", body = SessionInfo),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant, or its sandbox is gone", body = ErrorBody),
        (status = 409, description = "SessionBusy: an exec or an archive call is running; wait for it or cancel it", body = ErrorBody),
        (status = 429, description = "Overloaded: this service and tenant keep `sessions.max_paused_per_tenant` paused sessions", body = ErrorBody),
        (status = 500, description = "InternalError: the workspace could not be read out of the sandbox", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: `sessions.store_dir` cannot be written, or the state store is unreachable; the session runs on", body = ErrorBody),
        (status = 507, description = "StoreFull: `sessions.store_dir` has no room for the workspace, or its files (hard links and sparse files saved whole) would not fit its quota once restored; the session runs on", body = ErrorBody),
    )
)]
pub async fn pause(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    // On a task of its own: a pause that began is finished even if its client goes away.
    detach(async move {
        let result = async {
            let (owner, ..) = caller(&st, &headers, rid.clone()).await?;
            if let Some(s) = st.sessions.get(&owner, &id)
                && st.sessions.end_if_lost(&s).await
            {
                return Err(ApiError::SessionGone(
                    st.sessions.lost(&owner, &id).unwrap_or_default(),
                ));
            }
            let info = st.sessions.pause(&owner, &id, rid).await?;
            Ok(json(StatusCode::OK, info))
        };
        result.await.unwrap_or_else(|e: ApiError| e.into_response())
    })
    .await
}

/// `POST /v1/sandbox/sessions/{id}/resume`: a fresh sandbox with the saved workspace; 200 with
/// the session, `state: "running"` (a running session is answered as it is).
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/resume",
    operation_id = "resume_session",
    tag = "sessions",
    params(
        SessionPath,
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The session, running", body = SessionInfo),
        (status = 400, description = "InvalidRequest: a tenant header is malformed, or the session's language is no longer offered", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 403, description = "CapabilityViolation: today's policy no longer allows the session's language or profile under its grant", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant (an expired one included)", body = ErrorBody),
        (status = 409, description = "SessionBusy: another call is resuming it right now", body = ErrorBody),
        (status = 429, description = "Overloaded: `sessions.max_total` or `sessions.max_per_tenant` sessions are open", body = ErrorBody),
        (status = 500, description = "InternalError: the saved workspace does not match its digest, or could not be restored", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the backend or `sessions.store_dir` is unavailable", body = ErrorBody),
    )
)]
pub async fn resume(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    detach(async move {
        match look_up(&st, &headers, rid, &id, Touch::Use).await {
            Ok((Looked::Live(s), ..)) => json(StatusCode::OK, s.describe()),
            Ok((Looked::Paused(info), ..)) => json(StatusCode::OK, *info),
            Err(e) => e.into_response(),
        }
    })
    .await
}

/// The body of `POST /v1/sandbox/sessions/{id}/exec`. Unknown fields are refused; every optional
/// field may be `null`, the same as leaving it out. An Idempotency-Key's fingerprint covers it
/// as parsed (see `execute::what_runs`), with the session, the calling service and the tenant.
#[derive(Debug, Deserialize, Serialize, ToSchema, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// The program, in the session's language; its interpreter runs it as a file.
    code: String,
    /// Written to the program's stdin, then closed.
    #[serde(default)]
    stdin: Option<String>,
    /// Only names the profile allows.
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
    #[schema(nullable)]
    env: BTreeMap<String, String>,
    /// A directory of the workspace (relative, or absolute under `/workspace`).
    #[serde(default)]
    cwd: Option<String>,
    /// The deadline in milliseconds, up to the profile's async maximum whether the exec is
    /// synchronous, async or streamed (a synchronous exec's connection stays open for it); 0 or
    /// none is the profile's default.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 86_400_000)]
    timeout_ms: Option<u64>,
    /// Answer 202 with the run's links at once.
    #[serde(
        default,
        rename = "async",
        deserialize_with = "super::caller::null_as_default"
    )]
    #[schema(nullable)]
    run_async: bool,
    /// Cancel the exec when the caller goes away before its answer.
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
    #[schema(nullable)]
    cancel_on_disconnect: bool,
    /// A background process: answer 202 with its `process_id` at once; it runs beside the
    /// session's other execs (up to `sessions.max_processes`) until it ends, is signalled, or
    /// the session ends. Its stdin stays open for `…/processes/{process_id}/stdin`; its deadline
    /// is `timeout_ms`, else the profile's async maximum.
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
    #[schema(nullable)]
    background: bool,
    /// Keep the exec's stdin open after `stdin` for `…/execs/{exec_id}/stdin` (an async or
    /// streamed exec; a background one always has it).
    #[serde(default, deserialize_with = "super::caller::null_as_default")]
    #[schema(nullable)]
    stdin_open: bool,
}

/// `POST /v1/sandbox/sessions/{id}/exec`: the session's language runs `code` in its workspace.
/// Sync: 200 with the result (a run the deadline ended included: its `killed_reason` says so);
/// `async`: 202 with the run's links; `Accept: text/event-stream`: the run as SSE.
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/exec",
    operation_id = "session_exec",
    tag = "sessions",
    request_body = ExecBody,
    params(
        SessionPath,
        TenantHeaders,
        ("Idempotency-Key" = Option<String>, Header, description = "As on /execute; the fingerprint includes the session, the calling service and the tenant"),
        super::stream::StreamQuery,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The exec's result (a run its deadline ended included: `outcome: timeout`); with `Accept: text/event-stream`, the exec as Server-Sent Events", content(
            (ExecutionResult = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 202, description = "`async`: the exec started", body = RunAccepted),
        (status = 400, description = "InvalidRequest: malformed body, timeout_ms out of range, NUL in the code, a cwd outside the workspace, a malformed tenant or Idempotency-Key, async with a stream, an unknown `framing`, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 403, description = "CapabilityViolation: an env name the profile refuses", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant, or its sandbox is gone", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "SessionBusy: the session runs another exec; or IdempotencyInProgress", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 422, description = "IdempotencyConflict: the Idempotency-Key was used with another body", body = ErrorBody),
        (status = 429, description = "Overloaded: no run slot came free (or too many streams are open)", body = ErrorBody),
        (status = 500, description = "InternalError: the sandbox failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the backend or the state store is down, or the daemon is shutting down", body = ErrorBody),
    )
)]
pub async fn exec(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let client = ClientLink::new();
    let served = client.clone();
    client
        .serve(&st.clone(), async move {
            let rid = RequestId::of(&req);
            match exec_inner(&st, &id, req, rid, &served).await {
                Ok(r) => r,
                Err(e) => e.into_response(),
            }
        })
        .await
}

async fn exec_inner(
    st: &Arc<AppState>,
    id: &str,
    req: Request,
    rid: String,
    client: &ClientLink,
) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    let (parts, body) = req.into_parts();
    // A malformed query is the request's fault whatever the session: 400 before the lookup.
    super::stream::Framing::of(&parts.uri)?;
    let (session, service, known) = session_of(st, &parts.headers, rid, id, Touch::Use).await?;
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    let mut asked: ExecBody = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::InvalidRequest(format!("invalid exec request: {e}")))?;
    let idem_key = idempotency_key(&parts.headers)?;
    // The framing is checked again, and passes: one check of how a run goes, for every route.
    let RunOptions {
        mode,
        framing,
        timeout,
    } = RunOptions::check(RunAsk {
        run_async: asked.run_async,
        timeout: AskedTimeout::Millis(asked.timeout_ms),
        headers: &parts.headers,
        uri: &parts.uri,
    })?;
    // As checked (0 is none): the Idempotency-Key's fingerprint covers it so.
    asked.timeout_ms = timeout.map(|t| t.as_millis() as u64);
    if asked.code.contains('\0') {
        return Err(ApiError::InvalidRequest(
            "code may not contain NUL bytes".into(),
        ));
    }
    // The fingerprint binds a replay to this session, its service and tenant, and what runs;
    // keys are scoped like the session's runs: by the calling service and the tenant.
    let idempotency = match idem_key {
        Some(key) => {
            let what = json!({
                "service": session.owner.subject,
                "tenant": session.owner.tenant,
                "session": session.id,
                "request": what_runs(&asked)?,
            });
            Some(IdemAsk {
                key: IdemKey {
                    subject: session.owner.runs(),
                    key,
                },
                fingerprint: fingerprint(&what)?,
            })
        }
        None => None,
    };
    let background = asked.background;
    if background && mode == RunMode::Stream {
        return Err(ApiError::InvalidRequest(
            "a background exec answers 202 with its links: follow its stream link instead of asking for a stream".into(),
        ));
    }
    if asked.stdin_open && !background && mode == RunMode::Sync {
        return Err(ApiError::InvalidRequest(
            "stdin_open needs an async or streamed exec: a synchronous one answers only once it ended".into(),
        ));
    }
    let parts = ExecParts {
        owner: session.owner.runs(),
        request_id: known.request_id.clone(),
        subject: service.subject.clone().or_else(|| Some("-".into())),
        code: asked.code,
        stdin: asked.stdin,
        env: asked.env,
        cwd: asked.cwd,
        timeout_ms: asked.timeout_ms,
        long_run: true,
        background: None,
        stdin_open: asked.stdin_open && !background,
    };
    let links = format!("/v1/sandbox/sessions/{id}/execs/");
    if background {
        let job = RunJob {
            work: SessionProcess { session, parts },
            idempotency,
            mode: RunMode::Async,
            framing,
            cancel_on_disconnect: false,
            timeout_status: StatusCode::OK,
            links,
            process_links: Some(format!("/v1/sandbox/sessions/{id}/processes/")),
        };
        return job.serve(st, client).await;
    }
    let job = RunJob {
        work: SessionExec { session, parts },
        idempotency,
        mode,
        framing,
        cancel_on_disconnect: asked.cancel_on_disconnect,
        timeout_status: StatusCode::OK,
        links,
        process_links: None,
    };
    job.serve(st, client).await
}

/// What a session's background process runs: a place among the session's processes is taken,
/// and its code written to a file of its own.
struct SessionProcess {
    session: Arc<Session>,
    parts: ExecParts,
}

impl Work for SessionProcess {
    /// The place, given back unless the process starts; the code file, kept until it ended.
    type Held = PreparedProcess;

    /// The grant is the session's, and the caller was found its owner before.
    async fn may_replay(&self, _: &AppState) -> Result<(), ApiError> {
        Ok(())
    }

    async fn prepare(self, st: &AppState) -> Result<(ExecutionRequest, Self::Held), ApiError> {
        Ok(st
            .sessions
            .prepare_process(&self.session, self.parts)
            .await?)
    }

    fn started(prepared: Self::Held, live: &Arc<LiveRun>) {
        prepared.started(live);
    }
}

/// What a session's exec runs, made once its Idempotency-Key is held: the session's one exec is
/// claimed, and its code written to a file of its own.
struct SessionExec {
    session: Arc<Session>,
    parts: ExecParts,
}

impl Work for SessionExec {
    /// The claim, given back unless the exec starts; the code file, kept until it answered.
    type Held = PreparedExec;

    /// The grant is the session's, and the caller was found its owner before.
    async fn may_replay(&self, _: &AppState) -> Result<(), ApiError> {
        Ok(())
    }

    async fn prepare(self, st: &AppState) -> Result<(ExecutionRequest, Self::Held), ApiError> {
        Ok(st.sessions.prepare_exec(&self.session, self.parts).await?)
    }

    fn started(prepared: Self::Held, live: &Arc<LiveRun>) {
        prepared.started(live);
    }
}

/// `GET /v1/sandbox/sessions/{id}/execs/{exec_id}` (and `/stream`, `/cancel`): the run routes,
/// for an exec of a session of the caller's (another exec id is 404).
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/execs/{exec_id}",
    operation_id = "get_session_exec",
    tag = "sessions",
    params(
        SessionPath,
        ("exec_id" = String, Path, description = "The exec's `exec_id`"),
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The exec: running, or finished with its result", body = RunStatus),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such exec of it", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn exec_get(
    State(st): State<Arc<AppState>>,
    Path((id, exec_id)): Path<(String, String)>,
    req: Request,
) -> Response {
    match session_exec(
        &st,
        &req.headers().clone(),
        RequestId::of(&req),
        &id,
        &exec_id,
    )
    .await
    {
        Ok((owner, _)) => executions::get_owned(&st, &exec_id, &owner)
            .await
            .unwrap_or_else(|e| e.into_response()),
        Err(e) => e.into_response(),
    }
}

/// The exec as Server-Sent Events, live or finished; `Last-Event-ID` resumes.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/execs/{exec_id}/stream",
    operation_id = "stream_session_exec",
    tag = "sessions",
    params(
        SessionPath,
        ("exec_id" = String, Path, description = "The exec's `exec_id`"),
        TenantHeaders,
        super::stream::StreamQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event: `<stdout bytes>.<stderr bytes>` (in either framing); a position past the output is clamped to its end"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The exec as Server-Sent Events", body = String, content_type = "text/event-stream"),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, an unknown `framing`, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such exec of it", body = ErrorBody),
        (status = 429, description = "Overloaded: `executions.max_open_streams` streams are open", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn exec_stream(
    State(st): State<Arc<AppState>>,
    Path((id, exec_id)): Path<(String, String)>,
    req: Request,
) -> Response {
    // A malformed query is the request's fault whatever the session: 400 before the lookup.
    if let Err(e) = super::stream::Framing::of(req.uri()) {
        return e.into_response();
    }
    match session_exec(
        &st,
        &req.headers().clone(),
        RequestId::of(&req),
        &id,
        &exec_id,
    )
    .await
    {
        Ok(who) => executions::stream_owned(st, exec_id, req, who).await,
        Err(e) => e.into_response(),
    }
}

/// Cancel the exec: SIGTERM, then SIGKILL after the grace.
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/execs/{exec_id}/cancel",
    operation_id = "cancel_session_exec",
    tag = "sessions",
    params(
        SessionPath,
        ("exec_id" = String, Path, description = "The exec's `exec_id`"),
        TenantHeaders,
    ),
    request_body(content = Option<CancelRequest>, description = "Optional: an empty body gives the default grace"),
    security(("bearer" = [])),
    responses(
        (status = 202, description = "The exec is stopping", body = CancelAccepted),
        (status = 400, description = "InvalidRequest: malformed body, grace_seconds out of 0-30, a malformed tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such exec of it", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "AlreadyFinished: the exec has finished", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn exec_cancel(
    State(st): State<Arc<AppState>>,
    Path((id, exec_id)): Path<(String, String)>,
    req: Request,
) -> Response {
    match session_exec(
        &st,
        &req.headers().clone(),
        RequestId::of(&req),
        &id,
        &exec_id,
    )
    .await
    {
        Ok(who) => executions::cancel_owned(&st, &exec_id, req, who).await,
        Err(e) => e.into_response(),
    }
}

/// `PUT /v1/sandbox/sessions/{id}/files/{path}`: the raw body becomes the file; 204.
#[utoipa::path(
    put,
    path = "/v1/sandbox/sessions/{id}/files/{path}",
    operation_id = "put_session_file",
    tag = "sessions",
    params(
        SessionPath,
        ("path" = String, Path, description = "A path relative to the workspace"),
        TenantHeaders,
    ),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes, at most `sessions.max_file_bytes`"),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "The file is written (missing parent directories are made)"),
        (status = 400, description = "InvalidRequest: an absolute path, `..`, `.` or empty components, a symlink or non-file on the way, a malformed tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant, or its sandbox is gone", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "SessionBusy: an exec runs in the session's container", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the file is over `sessions.max_file_bytes`", body = ErrorBody),
        (status = 429, description = "Overloaded: eight file transfers are in progress", body = ErrorBody),
        (status = 500, description = "InternalError: the write failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable, or the audit log cannot record the upload (nothing is written)", body = ErrorBody),
        (status = 507, description = "WorkspaceFull: the session's disk quota is used up", body = ErrorBody),
    )
)]
pub async fn put_file(
    State(st): State<Arc<AppState>>,
    Path((id, path)): Path<(String, String)>,
    req: Request,
) -> Response {
    // On a task of its own, the write and its audit line together: a client that goes away
    // once its bytes arrived cannot leave a written file unaudited.
    detach(async move {
        put_file_inner(&st, &id, &path, req)
            .await
            .unwrap_or_else(|e| e.into_response())
    })
    .await
}

async fn put_file_inner(
    st: &Arc<AppState>,
    id: &str,
    path: &str,
    req: Request,
) -> Result<Response, ApiError> {
    let rid = RequestId::of(&req);
    {
        let (parts, body): (_, Body) = req.into_parts();
        let (session, _, known) = session_of(st, &parts.headers, rid, id, Touch::Use).await?;
        let _permit = file_permit(st)?;
        let bytes = read_body(body, &parts.headers, BodyLimit::file(st)).await?;
        st.sessions
            .upload(&session, known.request_id, path, bytes.to_vec())
            .await
            .map_err(|e| match e {
                UploadError::Ended => ApiError::SessionNotFound,
                UploadError::Unrecorded => ApiError::SandboxUnavailable(e.to_string()),
                UploadError::File(e) => file_failure(&session, e),
            })?;
        Ok(StatusCode::NO_CONTENT.into_response())
    }
}

/// File calls that may hold a file's bytes in memory at once (each up to
/// `sessions.max_file_bytes`); one more is 429.
const MAX_FILE_CALLS: usize = 8;

/// A place among the file calls in progress, or 429.
fn file_permit(st: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    st.file_calls.clone().try_acquire_owned().map_err(|_| {
        ApiError::SessionLimit(format!(
            "{MAX_FILE_CALLS} file transfers are in progress on this daemon"
        ))
    })
}

/// The semaphore [`file_permit`] takes from.
pub fn file_calls() -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(MAX_FILE_CALLS))
}

/// `GET /v1/sandbox/sessions/{id}/files/{path}`: the file's bytes.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/files/{path}",
    operation_id = "get_session_file",
    tag = "sessions",
    params(
        SessionPath,
        ("path" = String, Path, description = "A path relative to the workspace"),
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The file's bytes", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 400, description = "InvalidRequest: an absolute path, `..`, `.` or empty components, a symlink or non-file on the way, a malformed tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such file", body = ErrorBody),
        (status = 409, description = "SessionBusy: an exec runs in the session's container", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the file is over `sessions.max_file_bytes`", body = ErrorBody),
        (status = 429, description = "Overloaded: eight file transfers are in progress", body = ErrorBody),
        (status = 500, description = "InternalError: the read failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn get_file(
    State(st): State<Arc<AppState>>,
    Path((id, path)): Path<(String, String)>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    let result = async {
        let (session, ..) = session_of(&st, &headers, rid, &id, Touch::Use).await?;
        let permit = file_permit(&st)?;
        let max = st.config.sessions.max_file_bytes as u64;
        let bytes = session
            .read_file(&path, max)
            .await
            .map_err(|e| file_failure(&session, e))?;
        // The permit goes with the bytes: a slow reader holds its place until it has them.
        let body = futures::stream::once(async move {
            let _held = permit;
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(bytes))
        });
        Ok::<_, ApiError>(
            (
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                )],
                Body::from_stream(body),
            )
                .into_response(),
        )
    };
    result.await.unwrap_or_else(|e| e.into_response())
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// A directory of the workspace, relative to it (empty: the workspace).
    #[serde(default)]
    path: String,
}

/// A directory's entries.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileList {
    /// The directory, as asked.
    pub path: String,
    pub entries: Vec<crate::sessions::Entry>,
}

/// `GET /v1/sandbox/sessions/{id}/files?path=dir`: a directory's entries (the workspace's
/// without `path`).
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/files",
    operation_id = "list_session_files",
    tag = "sessions",
    params(
        SessionPath,
        ListQuery,
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The directory's entries", body = FileList),
        (status = 400, description = "InvalidRequest: an absolute path, `..`, `.` or empty components, a symlink or non-directory on the way, a malformed tenant, a path parameter that is not UTF-8 or a query that does not parse", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such directory", body = ErrorBody),
        (status = 409, description = "SessionBusy: an exec runs in the session's container", body = ErrorBody),
        (status = 429, description = "Overloaded: eight file transfers are in progress", body = ErrorBody),
        (status = 500, description = "InternalError: the listing failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn list_files(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    let result = async {
        let (session, ..) = session_of(&st, &headers, rid, &id, Touch::Use).await?;
        // A listing is held whole in memory like a file: it takes a transfer's place.
        let _permit = file_permit(&st)?;
        let path = q.path.clone();
        let entries = session
            .list(&path)
            .await
            .map_err(|e| file_failure(&session, e))?;
        Ok::<_, ApiError>(json(
            StatusCode::OK,
            FileList {
                path: q.path,
                entries,
            },
        ))
    };
    result.await.unwrap_or_else(|e| e.into_response())
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ArchiveQuery {
    /// A directory of the workspace, relative to it (empty: the workspace).
    #[serde(default)]
    path: String,
}

/// An archive extracted into the workspace.
#[derive(Debug, Serialize, ToSchema)]
pub struct ArchiveUploaded {
    /// The directory it went into, as asked.
    pub path: String,
    /// Its members (files, directories, symlinks).
    pub members: u64,
    /// The tar's size and digest, as the `session_archive` audit line has them.
    pub bytes: u64,
    /// `sha256:<hex>`
    pub sha256: String,
}

/// How long an archive upload may go without a byte arriving.
const ARCHIVE_IDLE: Duration = Duration::from_secs(30);

/// A request body as the archive it carries, each chunk within [`ARCHIVE_IDLE`].
fn archive_body(body: Body) -> crate::sessions::ByteStream {
    use futures::StreamExt;
    futures::stream::unfold(Some(body.into_data_stream()), |s| async move {
        let mut s = s?;
        match tokio::time::timeout(ARCHIVE_IDLE, s.next()).await {
            Ok(Some(Ok(b))) => Some((Ok(b), Some(s))),
            Ok(Some(Err(e))) => Some((Err(std::io::Error::other(e.to_string())), None)),
            Ok(None) => None,
            Err(_) => Some((
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no byte arrived for {} s", ARCHIVE_IDLE.as_secs()),
                )),
                None,
            )),
        }
    })
    .boxed()
}

/// `GET /v1/sandbox/sessions/{id}/archive?path=dir`: a tar of a workspace directory.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/archive",
    operation_id = "get_session_archive",
    tag = "sessions",
    params(
        SessionPath,
        ArchiveQuery,
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "A tar of the directory, streamed as it is made: its regular files, directories and symlinks (as symlinks, never followed), names relative to it; FIFOs and sockets are left out. A failure once the stream started ends it early (the tar is then incomplete)", body = Vec<u8>, content_type = "application/x-tar"),
        (status = 400, description = "InvalidRequest: an absolute path, `..`, `.` or empty components, a symlink or non-directory on the way, a malformed tenant", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such directory", body = ErrorBody),
        (status = 409, description = "SessionBusy: an exec runs in the session", body = ErrorBody),
        (status = 429, description = "Overloaded: eight file transfers are in progress", body = ErrorBody),
        (status = 500, description = "InternalError: the archive could not be made", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn get_archive(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<ArchiveQuery>,
    headers: HeaderMap,
    rid: Option<axum::Extension<RequestId>>,
) -> Response {
    use futures::StreamExt;
    let rid = rid.map(|r| r.0.0).unwrap_or_default();
    let result = async {
        let (session, ..) = session_of(&st, &headers, rid, &id, Touch::Use).await?;
        let permit = file_permit(&st)?;
        let stream = st
            .sessions
            .download_archive(&session, &q.path)
            .await
            .map_err(|e| file_failure(&session, e))?;
        // The permit goes with the stream: a slow reader holds its place until the end.
        let stream = stream.map(move |chunk| {
            let _held = &permit;
            chunk
        });
        Ok::<_, ApiError>(
            (
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/x-tar"),
                )],
                Body::from_stream(stream),
            )
                .into_response(),
        )
    };
    result.await.unwrap_or_else(|e| e.into_response())
}

/// `PUT /v1/sandbox/sessions/{id}/archive?path=dir`: the raw body is a tar, extracted into the
/// directory.
#[utoipa::path(
    put,
    path = "/v1/sandbox/sessions/{id}/archive",
    operation_id = "put_session_archive",
    tag = "sessions",
    params(
        SessionPath,
        ArchiveQuery,
        TenantHeaders,
    ),
    request_body(content = Vec<u8>, content_type = "application/x-tar", description = "A tar (ustar, GNU or PAX): regular files, directories, and symlinks whose target stays inside the workspace (relative, resolved from the link's own directory). Streamed: at most the workspace's size plus 64 MiB"),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Extracted: its members are in the directory (made if missing; files of the same name replaced, directories merged)", body = ArchiveUploaded),
        (status = 400, description = "InvalidRequest: a refused archive, nothing of it kept: a hard link, a device, FIFO or socket, a GNU sparse member, a setuid/setgid/sticky mode, an absolute name, a `..` component, a member through a symlink, a symlink pointing outside the workspace, a member whose type conflicts with what the workspace has (a file over a directory, a directory over a file or symlink), a truncated or malformed tar; or a bad path or tenant", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant, or its sandbox is gone", body = ErrorBody),
        (status = 409, description = "SessionBusy: an exec runs in the session", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the archive is larger than the workspace could hold (its size plus 64 MiB); nothing of it kept", body = ErrorBody),
        (status = 429, description = "Overloaded: eight file transfers are in progress", body = ErrorBody),
        (status = 500, description = "InternalError: the extraction failed unexpectedly", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable, or the audit log cannot record the archive (nothing of it kept)", body = ErrorBody),
        (status = 507, description = "WorkspaceFull: the archive does not fit the session's disk quota or inode limit; nothing of it kept", body = ErrorBody),
    )
)]
pub async fn put_archive(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<ArchiveQuery>,
    req: Request,
) -> Response {
    // On a task of its own, the extraction and its audit line together.
    detach(async move {
        let rid = RequestId::of(&req);
        let result = async {
            let (parts, body): (_, Body) = req.into_parts();
            let (session, _, known) = session_of(&st, &parts.headers, rid, &id, Touch::Use).await?;
            let _permit = file_permit(&st)?;
            let done = st
                .sessions
                .upload_archive(&session, known.request_id, &q.path, archive_body(body))
                .await
                .map_err(|e| match e {
                    UploadError::Ended => ApiError::SessionNotFound,
                    UploadError::Unrecorded => ApiError::SandboxUnavailable(e.to_string()),
                    UploadError::File(e) => file_failure(&session, e),
                })?;
            Ok::<_, ApiError>(json(
                StatusCode::OK,
                ArchiveUploaded {
                    path: q.path,
                    members: done.members,
                    bytes: done.bytes,
                    sha256: done.sha256,
                },
            ))
        };
        result.await.unwrap_or_else(|e| e.into_response())
    })
    .await
}

/// The longest a forwarded session call may take to begin its answer: a synchronous exec's
/// begins when its run ends (at most the async limit, as for any session exec), plus room for
/// its queue and setup.
const FORWARDED_ANSWER_TIMEOUT: Duration = Duration::from_secs(MAX_ASYNC_TIMEOUT_SECONDS + 60);

/// In front of every route of one session: a session another replica holds (the state store
/// says which) is handed to it, the call unchanged, and its answer relayed; the owner checks
/// the caller itself. A session held nowhere, or here, is served here (404 when it is not the
/// caller's). A replica that holds it but does not answer is a 404 that says so.
pub async fn to_owner(
    State(st): State<Arc<AppState>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(id) = req
        .uri()
        .path()
        .strip_prefix("/v1/sandbox/sessions/")
        .map(|rest| rest.split('/').next().unwrap_or_default().to_string())
    else {
        return next.run(req).await;
    };
    if st.sessions.holds(&id) || super::forward::was_forwarded(req.headers()) {
        return next.run(req).await;
    }
    // Only a calling service learns where a session lives (its token is verified here and
    // used up, when single-use, by the replica that holds the session).
    let verified = bearer(req.headers())
        .ok_or_else(|| "missing Authorization: Bearer service token".to_string())
        .and_then(|t| {
            st.auth
                .verify(t, TokenKind::Service)
                .map_err(|e| format!("service token: {e}"))
        });
    if let Err(reason) = verified {
        let known = KnownRequest {
            request_id: RequestId::of(&req),
            ..KnownRequest::default()
        };
        return unauthorized(&st, &known, &reason).into_response();
    }
    let record = match st.store.session_get(&id).await {
        Ok(Some(r)) if r.instance != st.instance_id => r,
        Ok(_) => return next.run(req).await,
        Err(e) => return ApiError::SandboxUnavailable(e.to_string()).into_response(),
    };
    // The replica that holds the session is the only one that can tell whether the caller owns
    // it: one it cannot be asked is answered exactly like an unknown id, whoever calls (where the
    // session was goes to the log only).
    let Some(address) = record.address else {
        tracing::warn!(session_id = %id, instance = %record.instance, "session's replica did not record how to reach it: answered as unknown");
        return ApiError::SessionNotFound.into_response();
    };
    let (parts, body) = req.into_parts();
    let body = match read_body(body, &parts.headers, BodyLimit::forwarded(&st)).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let call = super::forward::Call {
        method: parts.method.clone(),
        path: &path,
        headers: &parts.headers,
        body,
    };
    match super::forward::forward_within(&address, &st.instance_id, call, FORWARDED_ANSWER_TIMEOUT)
        .await
    {
        Ok(r) => r,
        Err(ApiError::SandboxUnavailable(why)) => {
            tracing::warn!(session_id = %id, %address, %why, "session's replica cannot be reached: answered as unknown");
            ApiError::SessionNotFound.into_response()
        }
        Err(e) => e.into_response(),
    }
}
