//! `/v1/executions/{exec_id}`: read a run, and cancel it.
//!
//! Owns: authenticating the caller, the visibility rule on the wire (a run that is not the
//! caller's is answered exactly like one that does not exist: 404) and the answers' shapes.
//! Must not: find or stop runs itself (the execution service does).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::app_state::AppState;
use super::caller::{BodyLimit, Caller, RequestId, read_body};
use super::error::{ApiError, ErrorBody};
use super::extract::Path;
use super::forward::{forward, was_forwarded};
use super::run::RunAnswer;
use super::stream::{Framing, Position, Source, StreamPermit, StreamQuery, follow};
use crate::execution::Lookup;
use crate::execution::record::KnownRequest;
use crate::execution::runs::CancelOutcome;
use crate::state::StoredResponse;

/// The longest grace a cancel may give a run between SIGTERM and SIGKILL.
pub const MAX_GRACE_SECONDS: u64 = 30;
/// The grace of a cancel that names none.
pub const DEFAULT_GRACE_SECONDS: u64 = 5;

/// The caller's subject as the owner of runs, from the request's service token.
async fn caller(
    st: &AppState,
    headers: &HeaderMap,
    request_id: String,
) -> Result<(String, KnownRequest), ApiError> {
    let caller = Caller::authenticate(st, headers, request_id).await?;
    Ok((caller.owner(), caller.known))
}

fn json(status: StatusCode, body: String) -> Response {
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
    let id = serde_json::to_string(exec_id).map_err(|e| ApiError::Internal(e.to_string()))?;
    let running = || {
        json(
            StatusCode::OK,
            format!(r#"{{"exec_id":{id},"status":"running"}}"#),
        )
    };
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
    match locate(&st, &exec_id, &headers, who).await {
        Ok((Located::Here(Lookup::Live(live)), _)) => respond(Source::Live(live)),
        Ok((Located::Here(Lookup::Stored(record)), _)) => match record.response {
            Some(answer) => {
                let ran_on = (record.backend, record.profile);
                respond(Source::finished(&exec_id, answer, ran_on))
            }
            None => ApiError::ExecutionNotFound.into_response(),
        },
        Ok((Located::Here(Lookup::Unknown), _)) => ApiError::ExecutionNotFound.into_response(),
        Ok((Located::Elsewhere(address), _)) => {
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

/// Where a call for a run must be served.
enum Located {
    /// By this replica: the run is live here, finished, or unknown to the caller.
    Here(Lookup),
    /// By the replica at this address, which runs it.
    Elsewhere(String),
}

/// Authenticates the caller and finds its run: here, or live on the replica the state store
/// names (a call another replica forwarded is never sent on again).
async fn locate(
    st: &AppState,
    exec_id: &str,
    headers: &HeaderMap,
    caller: (String, KnownRequest),
) -> Result<(Located, (String, KnownRequest)), ApiError> {
    let found = st
        .executions
        .lookup(&caller.0, exec_id)
        .await
        .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?;
    let located = match found {
        Lookup::Stored(record) if record.response.is_none() => {
            match (&record.address, was_forwarded(headers)) {
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
            }
        }
        other => Located::Here(other),
    };
    Ok((located, caller))
}

/// The answer of `GET` for a finished run; `id` is the exec_id as a JSON string.
fn finished(id: &str, r: &StoredResponse) -> Response {
    json(
        StatusCode::OK,
        format!(
            r#"{{"exec_id":{id},"status":"finished","http_status":{},"result":{}}}"#,
            r.status, r.body
        ),
    )
}

/// The body of a cancel (optional: an empty body is the default grace).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// Seconds between SIGTERM and SIGKILL: 0-30, default 5.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 30)]
    grace_seconds: Option<i64>,
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
    who: (String, KnownRequest),
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let raw = read_body(body, &parts.headers, BodyLimit::request(st)).await?;
    let grace = grace_of(&raw)?;
    let (located, (owner, known)) = locate(st, exec_id, &parts.headers, who).await?;
    let live = match located {
        Located::Here(Lookup::Live(live)) => live,
        Located::Here(Lookup::Stored(_)) => return Err(ApiError::AlreadyFinished),
        Located::Here(Lookup::Unknown) => return Err(ApiError::ExecutionNotFound),
        Located::Elsewhere(address) => {
            let path = format!("/v1/executions/{exec_id}/cancel");
            let instance = st.executions.instance();
            return forward(&address, instance, Method::POST, &path, &parts.headers, raw).await;
        }
    };
    let grace = match st
        .executions
        .cancel(&live, grace, &owner, &known.request_id)
    {
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
    let body = serde_json::to_string(&body).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(json(StatusCode::ACCEPTED, body))
}

/// The grace a cancel asks for: none given (an empty body, or `null`) is the default.
fn grace_of(raw: &[u8]) -> Result<Duration, ApiError> {
    let asked: CancelRequest = if raw.iter().all(u8::is_ascii_whitespace) {
        CancelRequest::default()
    } else {
        serde_json::from_slice::<Option<CancelRequest>>(raw)
            .map_err(|e| ApiError::InvalidRequest(format!("invalid cancel request: {e}")))?
            .unwrap_or_default()
    };
    match asked.grace_seconds {
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
