//! `/v1/sandbox/sessions`: sessions, their execs and their files, on the wire.
//!
//! Every route authenticates the calling service and reads the tenant (`X-Tenant-ID`, alias
//! `X-Koder-Tenant`; none is the empty tenant, never a wildcard). A session that is not the
//! caller's (another service or another tenant) is answered exactly like one that does not
//! exist: 404. An exec is a run like any `/execute` (Idempotency-Key, async, SSE, cancel).
//!
//! Owns: parsing and answering. Must not: manage sessions or touch their files itself (the
//! session service does).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::executions;
use super::extract::{Path, Query};
use super::run::{RunAsk, RunOptions, detach, idempotency_key, render_served, serve_client};
use crate::calls::AppState;
use crate::calls::caller::{BodyLimit, Caller, RequestId, bearer, read_body, unauthorized};
use crate::calls::error::{ApiError, ErrorBody};
use crate::calls::executions::{CancelAccepted, CancelRequest, RunStatus};
use crate::calls::run::{AskedTimeout, ClientLink, RunAccepted};
use crate::calls::sessions::{
    self, CreateBody, ExecBody, FORWARDED_ANSWER_TIMEOUT, FileList, Looked, Touch, caller,
    file_failure, file_permit, look_up, session_exec, session_of,
};
use crate::config::TokenKind;
use crate::execution::record::KnownRequest;
use crate::execution::result::ExecutionResult;
use crate::sessions::{SessionInfo, UploadError};

/// The session's id in the path of every route under one session (OpenAPI only: handlers take it
/// with `Path`).
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(super) struct SessionPath {
    /// The session's id (`ses_…`)
    id: String,
}

/// The tenant headers every session route reads (OpenAPI only: [`crate::calls::caller::tenant`] reads
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

fn json(status: StatusCode, body: impl Serialize) -> Response {
    (status, axum::Json(body)).into_response()
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
    let caller = Caller::authenticate(st, &parts.headers, rid).await?;
    // The tenant is read before the body: a malformed one is refused first.
    caller.session_owner(&parts.headers)?;
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    let asked: CreateBody = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::InvalidRequest(format!("invalid session request: {e}")))?;
    let session = sessions::create(st, caller, &parts.headers, asked, false).await?;
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
            sessions::delete(&st, &owner, &id).await?;
            Ok::<_, ApiError>(StatusCode::NO_CONTENT.into_response())
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
        match sessions::pause(&st, &headers, rid, &id).await {
            Ok(info) => json(StatusCode::OK, info),
            Err(e) => e.into_response(),
        }
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
        match sessions::resume(&st, &headers, rid, &id).await {
            Ok(info) => json(StatusCode::OK, info),
            Err(e) => e.into_response(),
        }
    })
    .await
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
        (status = 429, description = "Overloaded: no run slot came free, too many streams are open, the session runs `sessions.max_processes` processes, or its processes hold all of its pids (its pids limit)", body = ErrorBody),
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
    serve_client(&client, &st.clone(), async move {
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
    let asked: ExecBody = serde_json::from_slice(&raw)
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
    let job = sessions::exec_job(
        session,
        &service,
        &known,
        asked,
        sessions::ExecAsk {
            mode,
            timeout,
            idempotency_key: idem_key,
            via: None,
        },
    )?;
    let served = job.serve(st, client).await?;
    Ok(render_served(served, framing))
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
        (status = 429, description = "Overloaded: eight file transfers are in progress, or the session's processes hold all of its pids", body = ErrorBody),
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
        sessions::upload(st, &session, known.request_id, path, bytes.to_vec()).await?;
        Ok(StatusCode::NO_CONTENT.into_response())
    }
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
        (status = 429, description = "Overloaded: eight file transfers are in progress, or the session's processes hold all of its pids", body = ErrorBody),
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
        let bytes = sessions::read_file(&st, &session, &path).await?;
        // The permit goes with the bytes: a slow reader holds its place until it has them.
        let body = sessions::file_body(permit, bytes);
        Ok::<_, ApiError>(
            (
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                )],
                body,
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
        (status = 429, description = "Overloaded: eight file transfers are in progress, or the session's processes hold all of its pids", body = ErrorBody),
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
        Ok::<_, ApiError>(json(
            StatusCode::OK,
            sessions::list(&session, q.path).await?,
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
        (status = 429, description = "Overloaded: eight file transfers are in progress, or the session's processes hold all of its pids", body = ErrorBody),
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
        (status = 429, description = "Overloaded: eight file transfers are in progress, or the session's processes hold all of its pids", body = ErrorBody),
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
    if st.sessions.holds(&id) || crate::calls::forward::was_forwarded(req.headers()) {
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
    let address = match crate::calls::sessions::held_elsewhere(&st, &id, false).await {
        Ok(Some(address)) => address,
        Ok(None) => return next.run(req).await,
        Err(e) => return e.into_response(),
    };
    // A session's ports proxy: the request is the sandbox server's, passed on as it comes (its
    // headers, its body streamed, an upgrade relayed).
    let ports = req
        .uri()
        .path()
        .strip_prefix(&format!("/v1/sandbox/sessions/{id}/ports/"))
        .is_some();
    if ports {
        return match crate::calls::forward::forward_streamed(
            &address,
            &st.instance_id,
            req,
            FORWARDED_ANSWER_TIMEOUT,
        )
        .await
        {
            Ok(r) => r,
            Err(ApiError::SandboxUnavailable(why)) => {
                tracing::warn!(session_id = %id, %address, %why, "session's replica cannot be reached: answered as unknown");
                ApiError::SessionNotFound.into_response()
            }
            Err(e) => e.into_response(),
        };
    }
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
    let call = crate::calls::forward::Call {
        method: parts.method.clone(),
        path: &path,
        headers: &parts.headers,
        body,
    };
    match crate::calls::forward::forward_within(
        &address,
        &st.instance_id,
        call,
        FORWARDED_ANSWER_TIMEOUT,
    )
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
