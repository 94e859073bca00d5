//! `/v1/sandbox/sessions/{id}/processes`: a session's background processes on the wire: the list,
//! each one's output as Server-Sent Events, its stdin, its signals. A process is started by an
//! exec with `"background": true` (see [`super::sessions::exec`]); its id is its exec id, so its
//! result and cancel are also at the session's `/execs/{exec_id}`. Also the stdin of a
//! foreground exec that keeps it open (`stdin_open`), at `…/execs/{exec_id}/stdin`.
//!
//! Owns: these routes' bodies and statuses. Must not: run or signal anything itself (the sessions
//! service does).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::IntoParams;

use super::executions;
use super::extract::{Path, Query};
use super::sessions::{SessionPath, TenantHeaders};
use crate::calls::AppState;
use crate::calls::caller::{BodyLimit, RequestId, read_body};
use crate::calls::error::{ApiError, ErrorBody};
use crate::calls::processes::{
    self, ControlOf, OutputQuery, ProcessList, SignalBody, live_session,
};
use crate::calls::sessions::{Touch, session_of};
use crate::sessions::ProcessOutput;

/// `GET /v1/sandbox/sessions/{id}/processes`.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/processes",
    operation_id = "list_session_processes",
    tag = "sessions",
    params(SessionPath, TenantHeaders),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The session's background processes (none while it is paused: a pause ends them)", body = ProcessList),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn list(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    match processes::list(&st, req.headers(), RequestId::of(&req), &id).await {
        Ok(list) => json(list),
        Err(e) => e.into_response(),
    }
}

fn json(body: impl Serialize) -> Response {
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// A process's id in its routes' paths (OpenAPI only).
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct ProcessPath {
    /// The process's id (its exec id)
    process_id: String,
}

/// The process's output as Server-Sent Events, live or finished; `Last-Event-ID` resumes.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/processes/{process_id}/stream",
    operation_id = "stream_session_process",
    tag = "sessions",
    params(
        SessionPath,
        ProcessPath,
        TenantHeaders,
        super::stream::StreamQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event: `<stdout bytes>.<stderr bytes>`"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The process as Server-Sent Events (the events of a run: start, stdout, stderr, result)", body = String, content_type = "text/event-stream"),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, an unknown `framing`, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such process of it", body = ErrorBody),
        (status = 429, description = "Overloaded: `executions.max_open_streams` streams are open", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn stream(
    State(st): State<Arc<AppState>>,
    Path((id, process_id)): Path<(String, String)>,
    req: Request,
) -> Response {
    if let Err(e) = super::stream::Framing::of(req.uri()) {
        return e.into_response();
    }
    let rid = RequestId::of(&req);
    let (session, _, known) = match session_of(&st, req.headers(), rid, &id, Touch::Read).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    if !session.has_process(&process_id) {
        return ApiError::ProcessNotFound.into_response();
    }
    executions::stream_owned(st, process_id, req, (session.owner.runs(), known)).await
}

/// `GET …/processes/{process_id}/output`: what the process has written from the offsets asked
/// for (at most 256 KiB of each stream), with its state: for a caller that reads output by
/// polling instead of following the stream.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/processes/{process_id}/output",
    operation_id = "read_session_process_output",
    tag = "sessions",
    params(SessionPath, ProcessPath, TenantHeaders, OutputQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The process's state and its output from the offsets asked for (a ring keeps the last bytes of each stream: `from` says where the text begins)", body = ProcessOutput),
        (status = 400, description = "InvalidRequest: a malformed query or tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such process of it", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn output(
    State(st): State<Arc<AppState>>,
    Path((id, process_id)): Path<(String, String)>,
    Query(at): Query<OutputQuery>,
    req: Request,
) -> Response {
    let rid = RequestId::of(&req);
    let headers = req.headers().clone();
    let read = async {
        let session = live_session(&st, &headers, rid, &id, ControlOf::Process).await?;
        processes::output(&session, &process_id, at)
    };
    match read.await {
        Ok(out) => json(out),
        Err(e) => e.into_response(),
    }
}

/// `?eof=true`: close the process's stdin after the body's bytes.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StdinQuery {
    /// Close the process's stdin after this body's bytes.
    #[serde(default)]
    eof: bool,
}

/// `POST …/processes/{process_id}/stdin`: the raw body goes to the process's stdin, in order
/// with earlier calls; `?eof=true` closes it after them. 204 once the bytes are queued for it.
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/processes/{process_id}/stdin",
    operation_id = "write_session_process_stdin",
    tag = "sessions",
    params(SessionPath, ProcessPath, TenantHeaders, StdinQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "Bytes for the process's stdin (may be empty, e.g. with `eof=true`)"),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Queued for the process's stdin"),
        (status = 400, description = "InvalidRequest: a malformed query or tenant, a path parameter that is not UTF-8, a terminal's process (its input goes through the terminal)", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such process of it", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "AlreadyFinished: the process has ended, or its stdin was closed (`eof=true`) before these bytes", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn stdin(
    State(st): State<Arc<AppState>>,
    Path((id, process_id)): Path<(String, String)>,
    Query(q): Query<StdinQuery>,
    req: Request,
) -> Response {
    match stdin_inner(&st, &id, &process_id, ControlOf::Process, q, req).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn stdin_inner(
    st: &Arc<AppState>,
    id: &str,
    target: &str,
    of: ControlOf,
    q: StdinQuery,
    req: Request,
) -> Result<(), ApiError> {
    let rid = RequestId::of(&req);
    let (parts, body) = req.into_parts();
    let session = live_session(st, &parts.headers, rid, id, of).await?;
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    processes::send_stdin(st, &session, target, of, raw.to_vec(), q.eof).await
}

/// `POST /v1/sandbox/sessions/{id}/execs/{exec_id}/stdin`: as a process's stdin, for a running
/// exec started with `stdin_open` (async or streamed).
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/execs/{exec_id}/stdin",
    operation_id = "write_session_exec_stdin",
    tag = "sessions",
    params(
        SessionPath,
        ("exec_id" = String, Path, description = "The exec's `exec_id`"),
        TenantHeaders,
        StdinQuery,
    ),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "Bytes for the exec's stdin (may be empty, e.g. with `eof=true`)"),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Queued for the exec's stdin"),
        (status = 400, description = "InvalidRequest: a malformed query or tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such exec of it", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "AlreadyFinished: the exec has ended; or StdinClosed: it was not started with `stdin_open`", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn exec_stdin(
    State(st): State<Arc<AppState>>,
    Path((id, exec_id)): Path<(String, String)>,
    Query(q): Query<StdinQuery>,
    req: Request,
) -> Response {
    match stdin_inner(&st, &id, &exec_id, ControlOf::Exec, q, req).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST …/processes/{process_id}/signal`: 204 once the signal is sent.
#[utoipa::path(
    post,
    path = "/v1/sandbox/sessions/{id}/processes/{process_id}/signal",
    operation_id = "signal_session_process",
    tag = "sessions",
    params(SessionPath, ProcessPath, TenantHeaders),
    request_body = SignalBody,
    security(("bearer" = [])),
    responses(
        (status = 204, description = "The signal is on its way to the process"),
        (status = 400, description = "InvalidRequest: a malformed body or a signal not in the set, a malformed tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such process of it", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "AlreadyFinished: the process has ended", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn signal(
    State(st): State<Arc<AppState>>,
    Path((id, process_id)): Path<(String, String)>,
    req: Request,
) -> Response {
    match signal_inner(&st, &id, &process_id, req).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn signal_inner(
    st: &Arc<AppState>,
    id: &str,
    process_id: &str,
    req: Request,
) -> Result<(), ApiError> {
    let rid = RequestId::of(&req);
    let (parts, body) = req.into_parts();
    let session = live_session(st, &parts.headers, rid, id, ControlOf::Process).await?;
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    let asked: SignalBody = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::InvalidRequest(format!("invalid signal request: {e}")))?;
    processes::signal(st, &session, process_id, asked.signal).await
}
