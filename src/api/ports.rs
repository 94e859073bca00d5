//! `/v1/sandbox/sessions/{id}/ports/{port}/{path…}`: HTTP to `127.0.0.1:{port}` inside the
//! session's sandbox, any method, bodies streamed both ways, a WebSocket (any `Upgrade`) relayed
//! both ways after the server's 101.
//!
//! The request goes on with the part of the path after `/ports/{port}` and the query; the
//! hop-by-hop headers and the caller's credentials for this daemon (`Authorization`,
//! `X-Capability-Token`, the tenant headers) are not passed in. The connection into the sandbox
//! is the sessions service's ([`crate::sessions`]); this file speaks HTTP over it with hyper's
//! client connection, kept for the next request to the same port once an answer has been read
//! (`port_pool.rs`).
//!
//! Owns: these routes' statuses, the headers that go in and come out. Must not: open the
//! connection itself or know how a sandbox is entered.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use utoipa::IntoParams;

use super::extract::Path;
use super::sessions::{SessionPath, TenantHeaders};
use crate::calls::AppState;
use crate::calls::caller::{CAPABILITY_TOKEN_HEADER, RequestId};
use crate::calls::error::{ApiError, ErrorBody};
use crate::calls::hop::{end_to_end, wants_upgrade};
use crate::calls::sessions::{Looked, Touch, look_up};
use crate::sessions::PortRefusal;

impl From<PortRefusal> for ApiError {
    fn from(e: PortRefusal) -> Self {
        match e {
            PortRefusal::NotAllowed { .. } => ApiError::InvalidRequest(e.to_string()),
            PortRefusal::Closed(m) => ApiError::PortClosed(m),
            PortRefusal::Unavailable(m) => ApiError::SandboxUnavailable(m),
        }
    }
}

/// The route's path parameters (the rest of the path is read from the URI as it came).
#[derive(Debug, Deserialize)]
pub struct PortParams {
    id: String,
    port: String,
}

/// The port in the route's path (OpenAPI only).
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct PortPath {
    /// A TCP port inside the sandbox, within `sessions.allowed_ports`
    port: u16,
    /// The path the server in the sandbox gets (after `/`), with the query as it came
    path: String,
}

/// The caller's credentials for this daemon, and the mark of a call another replica passed on,
/// never passed to the sandbox.
const CREDENTIALS: [&str; 5] = [
    "authorization",
    CAPABILITY_TOKEN_HEADER,
    "x-tenant-id",
    "x-koder-tenant",
    crate::calls::forward::FORWARDED_HEADER,
];

/// The path and query the server in the sandbox gets: what follows the port's segment
/// (`/v1/sandbox/sessions/{id}/ports/{port}`) in `uri`, as it came (the port's segment may be
/// percent-encoded: it is found by its place, not by its text).
fn inner_target(uri: &Uri) -> Result<Uri, ApiError> {
    let path = uri.path();
    // "", "v1", "sandbox", "sessions", id, "ports", then the port and the rest.
    let port_and_rest = path
        .splitn(7, '/')
        .nth(6)
        .ok_or_else(|| ApiError::Internal(format!("ports route without its port: {path}")))?;
    let rest = port_and_rest.find('/').map_or("/", |i| &port_and_rest[i..]);
    let target = match uri.query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_string(),
    };
    target
        .parse()
        .map_err(|e| ApiError::InvalidRequest(format!("invalid path for the sandbox: {e}")))
}

/// `headers` of a message whose body is framed by `Transfer-Encoding`: a `Content-Length`
/// beside it is not the body's (RFC 9112 §6.3: an intermediary removes it before forwarding;
/// passed on, it would cut the body that is re-framed by its length).
fn without_conflicting_length(mut headers: HeaderMap, framed: &HeaderMap) -> HeaderMap {
    if framed.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    headers
}

/// Any method on `…/ports/{port}/{path…}`.
#[utoipa::path(
    method(get, post, put, patch, delete, head, options),
    path = "/v1/sandbox/sessions/{id}/ports/{port}/{path}",
    operation_id = "session_port_proxy",
    tag = "sessions",
    params(SessionPath, PortPath, TenantHeaders),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "Passed to the server in the sandbox as it comes (streamed)"),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The server's answer, whatever its status, headers (without hop-by-hop ones) and body (streamed); `/ports/{port}` and `/ports/{port}/` reach its `/`", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 101, description = "Switching Protocols: the server accepted the upgrade (a WebSocket); bytes are relayed both ways until either side closes"),
        (status = 400, description = "InvalidRequest: the port is not a number or outside `sessions.allowed_ports`, a malformed tenant, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant", body = ErrorBody),
        (status = 409, description = "SessionPaused: the session is paused (a pause ends its processes: resume it and start the server again)", body = ErrorBody),
        (status = 502, description = "PortClosed: nothing listens on the port in the session's sandbox (connection refused, or no connection accepted within 10 s), the server closed the connection without an answer, or it answered 101 to a request that asked for no upgrade", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the session's sandbox cannot be entered, or the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn proxy(
    State(st): State<Arc<AppState>>,
    Path(params): Path<PortParams>,
    req: Request,
) -> Response {
    match proxy_inner(&st, params, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn proxy_inner(
    st: &AppState,
    params: PortParams,
    mut req: Request,
) -> Result<Response, ApiError> {
    let rid = RequestId::of(&req);
    // A paused session is not resumed for this: a pause ended its processes, so nothing would
    // listen on the port of the fresh sandbox.
    let session = match look_up(st, req.headers(), rid, &params.id, Touch::Read).await? {
        (Looked::Live(s), owner, ..) => {
            // A proxied request is a use of the session: its idle time starts again.
            st.sessions.use_session(&owner, &params.id).unwrap_or(s)
        }
        (Looked::Paused(_), ..) => {
            return Err(ApiError::SessionPaused(format!(
                "session {} is paused: nothing of it runs (resume it and start the server again)",
                params.id
            )));
        }
    };
    let port: u16 = params
        .port
        .parse()
        .map_err(|_| ApiError::InvalidRequest(format!("'{}' is not a port", params.port)))?;
    st.sessions.port_allowed(port)?;
    let target = inner_target(req.uri())?;
    let upgrade = wants_upgrade(req.headers());
    let closed = |e: hyper::Error| no_answer(port, e);

    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    // Only an exchange whose request has no body and whose answer's body is framed goes on a
    // kept connection: a server may answer before it reads a request's body, and what it then
    // reads of that body as a request of its own would answer the next caller (so no body, no
    // upgrade, no HEAD, whose answer's body a server may still write).
    let poolable = !upgrade
        && parts.method != axum::http::Method::HEAD
        && axum::body::HttpBody::is_end_stream(&body);
    // A bodiless GET or OPTIONS sent on a kept connection the server closed at the same moment
    // may go again on a new one: it changes nothing (RFC 9110 §9.2.2).
    let repeatable = matches!(
        parts.method,
        axum::http::Method::GET | axum::http::Method::OPTIONS
    );
    let mut headers = without_conflicting_length(
        end_to_end(&parts.headers, upgrade, &CREDENTIALS),
        &parts.headers,
    );
    headers.insert(
        header::HOST,
        HeaderValue::from_str(&format!("127.0.0.1:{port}"))
            .map_err(|e| ApiError::Internal(e.to_string()))?,
    );
    let mut inner = axum::http::Request::builder()
        .method(parts.method)
        .uri(target)
        .body(body)
        .map_err(|e| ApiError::InvalidRequest(format!("invalid request for the sandbox: {e}")))?;
    *inner.headers_mut() = headers;

    // A kept connection first. One the server closed meanwhile hands the request back unsent,
    // and it goes on a new one.
    let kept = poolable
        .then(|| st.port_pool.take(&params.id, port))
        .flatten();
    let again = repeatable.then(|| clone_bodiless(&inner)).flatten();
    let (sender, mut resp) = match kept {
        Some(mut sender) => match sender.try_send_request(inner).await {
            Ok(resp) => (sender, resp),
            Err(mut e) => match e.take_message().or(again) {
                Some(inner) => {
                    let mut sender = open(st, &session, port).await?;
                    let resp = sender.send_request(inner).await.map_err(closed)?;
                    (sender, resp)
                }
                None => return Err(closed(e.into_error())),
            },
        },
        None => {
            let mut sender = open(st, &session, port).await?;
            let resp = sender.send_request(inner).await.map_err(closed)?;
            (sender, resp)
        }
    };
    let switching = resp.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS;
    if switching && client_upgrade.is_none() {
        // A switch no upgrade asked for (RFC 9110 §15.2.2): passed on, the caller's connection
        // (or a proxy's in front of the daemon, shared with other callers) would end in a
        // protocol it did not choose.
        return Err(ApiError::PortClosed(format!(
            "the server on port {port} in the session's sandbox switched protocols when no upgrade was asked for"
        )));
    }
    if switching && let Some(client_upgrade) = client_upgrade {
        let server_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (client, server) = match tokio::join!(client_upgrade, server_upgrade) {
                (Ok(c), Ok(s)) => (c, s),
                _ => return,
            };
            let (mut client, mut server) = (TokioIo::new(client), TokioIo::new(server));
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        });
    }
    let (parts, incoming) = resp.into_parts();
    let mut out = Response::new(if switching {
        Body::empty()
    } else if !poolable {
        Body::new(incoming)
    } else {
        st.port_pool
            .body_returning(incoming, &params.id, port, sender)
    });
    *out.status_mut() = parts.status;
    *out.headers_mut() =
        without_conflicting_length(end_to_end(&parts.headers, switching, &[]), &parts.headers);
    if !switching {
        // The server's own header, if it sent one, is connection-specific too.
        out.headers_mut()
            .remove(HeaderName::from_static("proxy-connection"));
    }
    Ok(out)
}

/// 502: the server on `port` gave no answer on its connection.
fn no_answer(port: u16, e: hyper::Error) -> ApiError {
    ApiError::PortClosed(format!(
        "the server on port {port} in the session's sandbox gave no answer: {e}"
    ))
}

/// A copy of `req`, which has no body (a GET or OPTIONS to send again).
fn clone_bodiless(req: &axum::http::Request<Body>) -> Option<axum::http::Request<Body>> {
    if !axum::body::HttpBody::is_end_stream(req.body()) {
        return None;
    }
    let mut copy = axum::http::Request::builder()
        .method(req.method().clone())
        .uri(req.uri().clone())
        .body(Body::empty())
        .ok()?;
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

/// A new HTTP/1.1 connection to `port` in `session`'s sandbox.
async fn open(
    st: &AppState,
    session: &Arc<crate::sessions::Session>,
    port: u16,
) -> Result<SendRequest<Body>, ApiError> {
    let conn = st.sessions.connect_port(session, port).await?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(conn))
        .await
        .map_err(|e| no_answer(port, e))?;
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(error = %e, "a session port connection ended with an error");
        }
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_credentials_stay_out() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer x"),
            ("x-capability-token", "t"),
            ("x-tenant-id", "a"),
            ("x-koder-tenant", "a"),
            ("x-executor-arm-forwarded", "vm-1"),
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic y"),
            ("x-kept", "yes"),
            ("cookie", "a=b"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = end_to_end(&h, false, &CREDENTIALS);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-kept", "cookie"]);
        let up = end_to_end(&h, true, &CREDENTIALS);
        assert_eq!(up.get("upgrade").unwrap(), "websocket");
        assert_eq!(up.get("connection").unwrap(), "upgrade");
        assert!(up.get("authorization").is_none() && up.get("x-private").is_none());
    }

    #[test]
    fn the_sandbox_gets_the_rest_of_the_path_and_the_query() {
        let t = |u: &str| inner_target(&u.parse().unwrap()).unwrap().to_string();
        assert_eq!(t("/v1/sandbox/sessions/s/ports/8000"), "/");
        assert_eq!(t("/v1/sandbox/sessions/s/ports/8000/"), "/");
        assert_eq!(
            t("/v1/sandbox/sessions/s/ports/8000/a/b%20c?x=1"),
            "/a/b%20c?x=1"
        );
        assert_eq!(t("/v1/sandbox/sessions/s/ports/8000?q"), "/?q");
        // The port's segment as it came, encoded or not; a later `/ports/N` is the sandbox's.
        assert_eq!(t("/v1/sandbox/sessions/s/ports/%38000/a"), "/a");
        assert_eq!(
            t("/v1/sandbox/sessions/s/ports/8000/x/ports/8000/y"),
            "/x/ports/8000/y"
        );
    }

    #[test]
    fn a_length_beside_a_transfer_encoding_is_dropped() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        let out = without_conflicting_length(end_to_end(&h, false, &[]), &h);
        assert!(out.is_empty(), "{out:?}");
        h.remove(header::TRANSFER_ENCODING);
        let out = without_conflicting_length(end_to_end(&h, false, &[]), &h);
        assert_eq!(out.get(header::CONTENT_LENGTH).unwrap(), "5");
    }

    #[test]
    fn only_connection_upgrade_with_upgrade_is_an_upgrade() {
        let mut h = HeaderMap::new();
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!wants_upgrade(&h));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(wants_upgrade(&h));
    }
}
