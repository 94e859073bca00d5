//! Handing a call for a live run to the replica that runs it.
//!
//! Streams and cancels of a running run need its live handle, which only the replica running it
//! holds; the state store names that replica and its address. Another replica that gets such a
//! call passes it on unchanged (the caller's own credentials, so the owner checks them itself) and
//! relays the answer, a stream included, as it comes. A forwarded call is never forwarded again.
//!
//! Owns: the peer HTTP call. Must not: decide who may see a run (the owner does, again).

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use super::error::ApiError;
use crate::config::peer_authority;

/// Marks a call one replica passed to another (its value: the sender's instance id).
pub const FORWARDED_HEADER: &str = "x-executor-arm-forwarded";

/// How long reaching the owning replica may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the owning replica may take to begin its answer (a stream's headers come at once;
/// its events may then take as long as the run).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The request headers a forwarded call keeps.
const KEPT: [HeaderName; 9] = [
    header::AUTHORIZATION,
    header::ACCEPT,
    header::CONTENT_TYPE,
    HeaderName::from_static("last-event-id"),
    HeaderName::from_static("x-request-id"),
    HeaderName::from_static("x-tenant-id"),
    HeaderName::from_static("x-koder-tenant"),
    HeaderName::from_static("idempotency-key"),
    HeaderName::from_static("x-capability-token"),
];

/// Whether this call was passed on by another replica.
pub fn was_forwarded(headers: &HeaderMap) -> bool {
    headers.contains_key(FORWARDED_HEADER)
}

/// Sends `method path` with `headers`' kept ones and `body` to the replica at `address`
/// (`http://host:port`) and returns its answer as it comes.
pub async fn forward(
    address: &str,
    from_instance: &str,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: bytes::Bytes,
) -> Result<Response, ApiError> {
    let call = Call {
        method,
        path,
        headers,
        body,
    };
    forward_within(address, from_instance, call, ANSWER_TIMEOUT).await
}

/// One call to pass on.
pub struct Call<'a> {
    pub method: Method,
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    pub body: bytes::Bytes,
}

/// [`forward`], waiting up to `answer_timeout` for the answer to begin (a synchronous exec's
/// answer begins when its run ends).
pub async fn forward_within(
    address: &str,
    from_instance: &str,
    call: Call<'_>,
    answer_timeout: Duration,
) -> Result<Response, ApiError> {
    let Call {
        method,
        path,
        headers,
        body,
    } = call;
    let unreachable = |why: String| {
        ApiError::SandboxUnavailable(format!(
            "the replica running this execution ({address}) cannot be reached: {why}"
        ))
    };
    let authority = peer_authority(address)
        .ok_or_else(|| unreachable("not an http://host:port address".into()))?;
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(authority))
        .await
        .map_err(|_| unreachable("connect timed out".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    // The connection lives as long as the answer's body is read (a stream included).
    let connection = tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "forwarded call's connection ended with an error");
        }
    });
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, authority)
        .header(
            FORWARDED_HEADER,
            HeaderValue::from_str(from_instance).unwrap_or(HeaderValue::from_static("-")),
        );
    for name in &KEPT {
        for v in headers.get_all(name) {
            req = req.header(name, v);
        }
    }
    // The owning replica's http.request continues this request's trace (when exporting).
    if let Some(h) = req.headers_mut() {
        crate::telemetry::inject_current(h);
    }
    let req = req
        .body(http_body_util::Full::new(body))
        .map_err(|e| ApiError::Internal(format!("forwarded request: {e}")))?;
    let resp = match tokio::time::timeout(answer_timeout, sender.send_request(req)).await {
        Ok(r) => r.map_err(|e| unreachable(e.to_string()))?,
        Err(_) => {
            connection.abort();
            return Err(unreachable(format!(
                "no answer within {} ms",
                answer_timeout.as_millis()
            )));
        }
    };
    Ok(resp.map(Body::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica that takes the connection but never answers fails the call with a 503 once
    /// the answer's time is up, instead of holding the caller forever.
    #[tokio::test]
    async fn a_replica_that_never_answers_fails_the_call() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", silent.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let (conn, _) = silent.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(conn);
        });
        let call = Call {
            method: Method::GET,
            path: "/v1/executions/exec-1/stream",
            headers: &HeaderMap::new(),
            body: bytes::Bytes::new(),
        };
        let failed = tokio::time::timeout(
            Duration::from_secs(10),
            forward_within(&address, "i-1", call, Duration::from_millis(200)),
        )
        .await
        .expect("the call was held");
        match failed {
            Err(ApiError::SandboxUnavailable(m)) => assert!(m.contains("no answer"), "{m}"),
            other => panic!("{:?}", other.map(|r| r.status())),
        }
        held.abort();
    }
}
