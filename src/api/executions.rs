//! `/v1/executions/{exec_id}`: read a run, and cancel it.
//!
//! Owns: authenticating the caller, the visibility rule on the wire (a run that is not the
//! caller's is answered exactly like one that does not exist: 404) and the answers' shapes.
//! Must not: find or stop runs itself (the execution service does).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;

use super::extract::Path;
use super::stream::{Framing, Position, Source, StreamQuery, follow};
use crate::calls::AppState;
use crate::calls::caller::{BodyLimit, Caller, RequestId, read_body};
use crate::calls::error::{ApiError, ErrorBody};
use crate::calls::executions::{
    self as runs, CancelAccepted, CancelRequest, Cancelled, Located, RunStatus, grace_of, locate,
};
use crate::calls::forward::{forward, was_forwarded};
use crate::calls::run::StreamPermit;
use crate::execution::Lookup;
use crate::execution::record::KnownRequest;

/// The caller's subject as the owner of runs, from the request's service token.
async fn caller(
    st: &AppState,
    headers: &HeaderMap,
    request_id: String,
) -> Result<(String, KnownRequest), ApiError> {
    let caller = Caller::authenticate(st, headers, request_id).await?;
    Ok((caller.owner(), caller.known))
}

/// A JSON body already serialised, as the answer with `status`.
pub(super) fn json(status: StatusCode, body: String) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// `GET /v1/executions/{exec_id}`: `{"exec_id", "status": "running"}` while the run lives;
/// once it finished, `"status": "finished"`, the `http_status` its synchronous call had (or
/// has) and, as `result`, exactly the body that call returns.
#[utoipa::path(
    get,
    path = "/v1/executions/{exec_id}",
    operation_id = "get_execution",
    tag = "runs",
    params(("exec_id" = String, Path, description = "The run's `exec_id`")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The run: running, or finished with its result", body = RunStatus),
        (status = 400, description = "InvalidRequest: an exec_id that is not UTF-8 once percent-decoded", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no run with this id is visible to the calling service", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn get(
    State(st): State<Arc<AppState>>,
    Path(exec_id): Path<String>,
    req: Request,
) -> Response {
    let rid = RequestId::of(&req);
    match get_inner(&st, &exec_id, req.headers(), rid).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn get_inner(
    st: &AppState,
    exec_id: &str,
    headers: &HeaderMap,
    rid: String,
) -> Result<Response, ApiError> {
    let (owner, _) = caller(st, headers, rid).await?;
    get_owned(st, exec_id, &owner).await
}

/// `GET` of run `exec_id` for `owner`, already authenticated.
pub(super) async fn get_owned(
    st: &AppState,
    exec_id: &str,
    owner: &str,
) -> Result<Response, ApiError> {
    Ok(json(
        StatusCode::OK,
        crate::calls::executions::status(st, exec_id, owner).await?,
    ))
}

/// `GET /v1/executions/{exec_id}/stream`: the run as Server-Sent Events (see [`super::stream`]),
/// live or finished; `Last-Event-ID` resumes.
#[utoipa::path(
    get,
    path = "/v1/executions/{exec_id}/stream",
    operation_id = "stream_execution",
    tag = "runs",
    params(
        ("exec_id" = String, Path, description = "The run's `exec_id`"),
        StreamQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event: `<stdout bytes>.<stderr bytes>` (in either framing); a position past the output is clamped to its end"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The run as Server-Sent Events: `start`, `stdout`/`stderr`, `result`", body = String, content_type = "text/event-stream"),
        (status = 400, description = "InvalidRequest: an exec_id that is not UTF-8 once percent-decoded, an unknown `framing`", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no run with this id is visible to the calling service", body = ErrorBody),
        (status = 429, description = "Overloaded: `executions.max_open_streams` streams are open", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable, or the replica running the run cannot be reached", body = ErrorBody),
    )
)]
pub async fn stream(
    State(st): State<Arc<AppState>>,
    Path(exec_id): Path<String>,
    req: Request,
) -> Response {
    let rid = RequestId::of(&req);
    match caller(&st, req.headers(), rid).await {
        Ok(who) => stream_owned(st, exec_id, req, who).await,
        Err(e) => e.into_response(),
    }
}

/// The stream of run `exec_id` for a caller already authenticated (`who`: its owner string and
/// what its refusals tell).
pub(super) async fn stream_owned(
    st: Arc<AppState>,
    exec_id: String,
    req: Request,
    who: (String, KnownRequest),
) -> Response {
    let framing = match Framing::of(req.uri()) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let from = req
        .headers()
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(Position::parse);
    let headers = req.headers().clone();
    let path = format!("/v1/executions/{exec_id}/stream{}", framing.query());
    let permit = || StreamPermit::take(&st);
    let respond = |source: Source| match permit() {
        Ok(p) => follow(p, source, framing, from, None),
        Err(e) => e.into_response(),
    };
    match locate(&st, &exec_id, &who.0, was_forwarded(&headers)).await {
        Ok(Located::Here(Lookup::Live(live))) => respond(Source::Live(live)),
        Ok(Located::Here(Lookup::Stored(record))) => match record.response {
            Some(answer) => {
                let ran_on = (record.backend, record.profile);
                respond(Source::finished(&exec_id, answer, ran_on))
            }
            None => ApiError::ExecutionNotFound.into_response(),
        },
        Ok(Located::Here(Lookup::Unknown)) => ApiError::ExecutionNotFound.into_response(),
        Ok(Located::Elsewhere(address)) => {
            // A relayed stream holds a permit here too: it holds a connection each way.
            let permit = match permit() {
                Ok(p) => p,
                Err(e) => return e.into_response(),
            };
            match forward(
                &address,
                st.executions.instance(),
                Method::GET,
                &path,
                &headers,
                Bytes::new(),
            )
            .await
            {
                Ok(r) => r.map(|body| {
                    let relayed = body.into_data_stream().map(move |chunk| {
                        let _held = &permit;
                        chunk
                    });
                    axum::body::Body::from_stream(relayed)
                }),
                Err(e) => e.into_response(),
            }
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/executions/{exec_id}/cancel`, body `{"grace_seconds": n}` (optional, 0-30, default
/// 5): SIGTERM to every process of the run, SIGKILL after the grace. 202 with the grace the run
/// was given, the same for a repeated call while it stops; 409 `AlreadyFinished` once it ended.
#[utoipa::path(
    post,
    path = "/v1/executions/{exec_id}/cancel",
    operation_id = "cancel_execution",
    tag = "runs",
    params(("exec_id" = String, Path, description = "The run's `exec_id`")),
    request_body(content = Option<CancelRequest>, description = "Optional: an empty body gives the default grace"),
    security(("bearer" = [])),
    responses(
        (status = 202, description = "The run is stopping", body = CancelAccepted),
        (status = 400, description = "InvalidRequest: malformed body, grace_seconds out of 0-30, an exec_id that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no run with this id is visible to the calling service", body = ErrorBody),
        (status = 408, description = "RequestTimeout: the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "AlreadyFinished: the run has finished", body = ErrorBody),
        (status = 413, description = "PayloadTooLarge: the body is over `server.body_limit_bytes`", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable, or the replica running the run cannot be reached", body = ErrorBody),
    )
)]
pub async fn cancel(
    State(st): State<Arc<AppState>>,
    Path(exec_id): Path<String>,
    req: Request,
) -> Response {
    let rid = RequestId::of(&req);
    match caller(&st, req.headers(), rid).await {
        Ok(who) => cancel_owned(&st, &exec_id, req, who).await,
        Err(e) => e.into_response(),
    }
}

/// The cancel of run `exec_id` for a caller already authenticated.
pub(super) async fn cancel_owned(
    st: &AppState,
    exec_id: &str,
    req: Request,
    who: (String, KnownRequest),
) -> Response {
    match cancel_inner(st, exec_id, req, who).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn cancel_inner(
    st: &AppState,
    exec_id: &str,
    req: Request,
    (owner, known): (String, KnownRequest),
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    let grace = grace_of(&raw)?;
    let forwarded = was_forwarded(&parts.headers);
    match runs::cancel(st, exec_id, &owner, &known.request_id, grace, forwarded).await? {
        Cancelled::Accepted(body) => Ok(json(StatusCode::ACCEPTED, body)),
        Cancelled::Elsewhere(address) => {
            let path = format!("/v1/executions/{exec_id}/cancel");
            let instance = st.executions.instance();
            forward(&address, instance, Method::POST, &path, &parts.headers, raw).await
        }
    }
}
