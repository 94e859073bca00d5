//! Handing a call for a live run to the replica that runs it.
//!
//! Streams and cancels of a running run need its live handle, which only the replica running it
//! holds; the state store names that replica and its address. Another replica that gets such a
//! call passes it on unchanged (the caller's own credentials, so the owner checks them itself) and
//! relays the answer, a stream included, as it comes. A forwarded call is never forwarded again.
//! A session's ports proxy call is passed on as it came ([`forward_streamed`]): its end-to-end
//! headers, its body streamed, and an upgrade relayed both ways after the owner's 101.
//!
//! Owns: the peer HTTP call. Must not: decide who may see a run (the owner does, again).

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use crate::calls::ApiError;
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
    let (mut sender, connection, authority) = open(address).await?;
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
        Ok(r) => r.map_err(|e| unreachable(address, e.to_string()))?,
        Err(_) => {
            connection.abort();
            return Err(unreachable(
                address,
                format!("no answer within {} ms", answer_timeout.as_millis()),
            ));
        }
    };
    Ok(resp.map(Body::new))
}

/// The replica at `address` cannot be reached (503).
fn unreachable(address: &str, why: String) -> ApiError {
    ApiError::SandboxUnavailable(format!(
        "the replica running this execution ({address}) cannot be reached: {why}"
    ))
}

/// An HTTP/1 connection to the replica at `address` (`http://host:port`), one that may be
/// upgraded: its sender, the task that drives it, and the address's authority.
async fn open<B>(
    address: &str,
) -> Result<
    (
        hyper::client::conn::http1::SendRequest<B>,
        tokio::task::JoinHandle<()>,
        &str,
    ),
    ApiError,
>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let authority = peer_authority(address)
        .ok_or_else(|| unreachable(address, "not an http://host:port address".into()))?;
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(authority))
        .await
        .map_err(|_| unreachable(address, "connect timed out".into()))?
        .map_err(|e| unreachable(address, e.to_string()))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(address, e.to_string()))?;
    // The connection lives as long as the answer's body is read (a stream included), or the
    // upgraded connection is relayed.
    let connection = tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "forwarded call's connection ended with an error");
        }
    });
    Ok((sender, connection, authority))
}

/// Passes `req` on to the replica at `address` as it came, for a route whose request is not
/// this daemon's to read (a session's ports proxy): every end-to-end header (the caller's
/// credentials too: the owner checks them), the body streamed as it comes, the answer's body
/// streamed back, and an upgrade (`Connection: upgrade` answered 101) relayed both ways.
pub async fn forward_streamed(
    address: &str,
    from_instance: &str,
    mut req: Request<Body>,
    answer_timeout: Duration,
) -> Result<Response, ApiError> {
    let (mut sender, connection, authority) = open::<Body>(address).await?;
    let upgrade = super::hop::wants_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut headers = super::hop::end_to_end(&parts.headers, upgrade, &[]);
    headers.insert(
        header::HOST,
        HeaderValue::from_str(authority).map_err(|e| ApiError::Internal(e.to_string()))?,
    );
    headers.insert(
        FORWARDED_HEADER,
        HeaderValue::from_str(from_instance).unwrap_or(HeaderValue::from_static("-")),
    );
    crate::telemetry::inject_current(&mut headers);
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let mut out = Request::builder()
        .method(parts.method)
        .uri(path)
        .body(body)
        .map_err(|e| ApiError::Internal(format!("forwarded request: {e}")))?;
    *out.headers_mut() = headers;
    let mut resp = match tokio::time::timeout(answer_timeout, sender.send_request(out)).await {
        Ok(r) => r.map_err(|e| unreachable(address, e.to_string()))?,
        Err(_) => {
            connection.abort();
            return Err(unreachable(
                address,
                format!("no answer within {} ms", answer_timeout.as_millis()),
            ));
        }
    };
    let switching = resp.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS;
    if switching && let Some(client_upgrade) = client_upgrade {
        let peer_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (client, peer) = match tokio::join!(client_upgrade, peer_upgrade) {
                (Ok(c), Ok(p)) => (c, p),
                _ => return,
            };
            let (mut client, mut peer) = (TokioIo::new(client), TokioIo::new(peer));
            let _ = tokio::io::copy_bidirectional(&mut client, &mut peer).await;
        });
    }
    let (parts, incoming) = resp.into_parts();
    let mut answer = Response::new(if switching {
        Body::empty()
    } else {
        Body::new(incoming)
    });
    *answer.status_mut() = parts.status;
    *answer.headers_mut() = super::hop::end_to_end(&parts.headers, switching, &[]);
    Ok(answer)
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
