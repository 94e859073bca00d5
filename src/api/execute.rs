//! POST /execute on HTTP: the order of its checks (draining, service token, the Idempotency-Key
//! header, the body within its limits, how the caller waits), then the request's own checks and
//! its run through `calls` (see [`crate::calls::execute`]).
//!
//! Owns: reading the request's HTTP. Must not: check the request's fields or grant (`calls`
//! does), decide, admit or run anything itself (the execution service does).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::run::{RunAsk, RunOptions, idempotency_key, serve_client, serve_job};
use super::stream;
use crate::calls::AppState;
use crate::calls::caller::{BodyLimit, Caller, RequestId, read_body};
use crate::calls::error::{ApiError, ErrorBody};
use crate::calls::execute::{ExecuteAsk, ExecuteRequest, parse_request};
use crate::calls::run::{AskedTimeout, ClientLink, RunAccepted, RunAnswer};
use crate::execution::result::ExecutionResult;

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
    serve_client(&client, &st, answer(st.clone(), req, client.clone())).await
}

/// The answer to one request, on the task [`ClientLink::serve`] gives it; a refusal is counted
/// in `rejected` by its kind.
async fn answer(st: Arc<AppState>, req: Request, client: Arc<ClientLink>) -> Response {
    let rid = RequestId::of(&req);
    let (parts, body) = req.into_parts();
    match handle(&st, &parts.headers, &parts.uri, body, rid, &client).await {
        Ok(resp) => resp,
        Err(e) => {
            crate::calls::execute::count_refusal(&st, &e);
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
) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    // Who is calling: checked before the body is even read.
    let mut caller = Caller::authenticate(st, headers, request_id).await?;
    let idem_key = idempotency_key(headers)?;
    let raw = read_body(body, headers, BodyLimit::request(st)).await?;
    let req = parse_request(&raw)?;
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
    let job = crate::calls::execute::job(
        &mut caller,
        st,
        req,
        ExecuteAsk {
            headers,
            mode,
            timeout,
            // The REST API's grant is a capability token.
            service_grant: false,
            idempotency_key: idem_key,
            via: None,
        },
    )?;
    serve_job(job, framing, st, client).await
}
