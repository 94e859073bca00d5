//! A run request on the REST API: how its caller waits, read from the HTTP request (`async`,
//! `Accept: text/event-stream`, `?framing=`, the Idempotency-Key header), and a served run as
//! the HTTP answer (JSON with `Location` and `Retry-After`, or Server-Sent Events). The run
//! itself goes through [`crate::calls::run`], which every front end shares.
//!
//! Owns: reading a run request's HTTP, rendering its answer. Must not: hold idempotency keys,
//! admit or start a run (`calls::run` and the execution service do).

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::stream::{self, Framing, Source};
use crate::calls::AppState;
use crate::calls::error::ApiError;
use crate::calls::run::{AskedTimeout, ClientLink, RunJob, RunMode, Served, Work, timeout_of};
use crate::state::StoredResponse;

// ---------------------------------------------------------------------------------------------
// How the caller waits

/// What a run request asks of how its run goes.
pub(super) struct RunAsk<'a> {
    /// The body's `async`.
    pub run_async: bool,
    pub timeout: AskedTimeout,
    /// Where `Accept: text/event-stream` asks for a stream.
    pub headers: &'a HeaderMap,
    /// Where `?framing=` is.
    pub uri: &'a Uri,
}

/// How a run request's run goes, checked.
#[derive(Debug)]
pub(super) struct RunOptions {
    pub mode: RunMode,
    /// How a stream cuts output into events.
    pub framing: Framing,
    /// None: the profile's default.
    pub timeout: Option<Duration>,
}

impl RunOptions {
    /// The one check of how a run goes, for every run route, in this order: the mode (`async`
    /// and `Accept: text/event-stream` exclude each other), the framing, the timeout; each
    /// refusal is a 400.
    pub fn check(ask: RunAsk<'_>) -> Result<RunOptions, ApiError> {
        let streaming = ask
            .headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| v.contains("text/event-stream"));
        let mode = match (ask.run_async, streaming) {
            (true, true) => {
                return Err(ApiError::InvalidRequest(
                    "async and Accept: text/event-stream exclude each other: stream an async run \
                     at its links.stream"
                        .into(),
                ));
            }
            (true, false) => RunMode::Async,
            (false, true) => RunMode::Stream,
            (false, false) => RunMode::Sync,
        };
        let framing = Framing::of(ask.uri)?;
        let timeout = timeout_of(mode, ask.timeout)?;
        Ok(RunOptions {
            mode,
            framing,
            timeout,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Idempotency

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

/// Serves `job` (see [`RunJob::serve`]) and renders what it serves: the stored answer as JSON,
/// or the live run as Server-Sent Events in `framing`.
pub(super) async fn serve_job<W: Work>(
    job: RunJob<W>,
    framing: Framing,
    st: &Arc<AppState>,
    client: &ClientLink,
) -> Result<Response, ApiError> {
    Ok(render_served(job.serve(st, client).await?, framing))
}

/// What [`crate::calls::run`] served, as HTTP: the stored answer as JSON, or the live run as
/// Server-Sent Events in `framing`.
pub(super) fn render_served(served: Served, framing: Framing) -> Response {
    match served {
        Served::Answer { answer, replayed } => stored_response(&answer, replayed),
        Served::Stream {
            live,
            permit,
            cancel,
        } => stream::follow(permit, Source::Live(live), framing, None, cancel),
    }
}

/// Serves `answer` on a task of its own for `client` (see [`ClientLink::serve`]).
pub(super) async fn serve_client<F>(
    client: &Arc<ClientLink>,
    st: &Arc<AppState>,
    answer: F,
) -> Response
where
    F: std::future::Future<Output = Response> + Send + 'static,
{
    client
        .serve(st, answer)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Serves `answer` on a task of its own (see [`crate::calls::run::detach`]).
pub(super) async fn detach<F>(answer: F) -> Response
where
    F: std::future::Future<Output = Response> + Send + 'static,
{
    crate::calls::run::detach(answer)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::profile::{MAX_ASYNC_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS};

    fn check(
        run_async: bool,
        accept: Option<&str>,
        uri: &str,
        timeout: AskedTimeout,
    ) -> Result<RunOptions, ApiError> {
        let mut headers = HeaderMap::new();
        if let Some(a) = accept {
            headers.insert(header::ACCEPT, HeaderValue::from_str(a).unwrap());
        }
        let uri: Uri = uri.parse().unwrap();
        RunOptions::check(RunAsk {
            run_async,
            timeout,
            headers: &headers,
            uri: &uri,
        })
    }

    /// The one rule both run routes take: the mode from `async` and `Accept`, then the framing,
    /// then the timeout in the route's unit and range.
    #[test]
    fn run_options() {
        let none = AskedTimeout::Seconds(None);
        let sse = Some("text/event-stream");
        assert_eq!(
            check(false, None, "/execute", none).unwrap().mode,
            RunMode::Sync
        );
        assert_eq!(
            check(true, None, "/execute", none).unwrap().mode,
            RunMode::Async
        );
        assert_eq!(
            check(false, sse, "/execute", none).unwrap().mode,
            RunMode::Stream
        );
        // Both: refused before the framing is read.
        let both = check(true, sse, "/execute?framing=nonsense", none).unwrap_err();
        assert!(
            matches!(&both, ApiError::InvalidRequest(m) if m.contains("exclude each other")),
            "{both:?}"
        );
        assert!(check(false, sse, "/execute?framing=nonsense", none).is_err());

        // Seconds: 1-300 synchronous, up to the async limit otherwise.
        let secs = |t| AskedTimeout::Seconds(Some(t));
        let max = MAX_TIMEOUT_SECONDS as i64;
        assert_eq!(
            check(false, None, "/execute", secs(max)).unwrap().timeout,
            Some(Duration::from_secs(max as u64))
        );
        assert!(check(false, None, "/execute", secs(max + 1)).is_err());
        assert!(check(false, None, "/execute", secs(0)).is_err());
        assert!(check(true, None, "/execute", secs(max + 1)).is_ok());
        let async_max = MAX_ASYNC_TIMEOUT_SECONDS as i64;
        assert!(check(true, None, "/execute", secs(async_max + 1)).is_err());

        // Milliseconds: 0 is none, up to the async limit whatever the mode.
        let ms = |t| AskedTimeout::Millis(Some(t));
        assert_eq!(check(false, None, "/x", ms(0)).unwrap().timeout, None);
        let max_ms = 1000 * MAX_ASYNC_TIMEOUT_SECONDS;
        assert_eq!(
            check(false, None, "/x", ms(max_ms)).unwrap().timeout,
            Some(Duration::from_millis(max_ms))
        );
        assert!(check(false, None, "/x", ms(max_ms + 1)).is_err());
    }
}
