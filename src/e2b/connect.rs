//! The Connect protocol with its JSON codec, as envd's clients speak it: unary calls
//! (`application/json` both ways, an error as a JSON `{code, message}` body with the code's HTTP
//! status) and server-streaming calls (`application/connect+json`: the request is one enveloped
//! message; the answer is 200 with enveloped messages and always an end-of-stream envelope, which
//! carries the error if the call failed), client-streaming calls (the request is enveloped
//! messages read as they come, the answer a server stream of one message), `Connect-Timeout-Ms`.
//!
//! Hand-written: the envelope is five bytes (a flag byte and a big-endian length) before each
//! JSON message, and the Connect crates of the ecosystem bring their own message types and
//! servers, while these messages are prost types with pbjson's JSON mapping served by axum.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::calls::ApiError;

/// An envelope's flag: the message is the stream's last (end-of-stream) one.
const END_STREAM: u8 = 0x02;
/// An envelope's flag: the message is compressed (no compression is offered here).
const COMPRESSED: u8 = 0x01;

/// The media type of a unary call with the JSON codec.
const UNARY_JSON: &str = "application/json";
/// The media type of a streaming call with the JSON codec.
const STREAM_JSON: &str = "application/connect+json";

/// A Connect error code (the protocol's names, in its JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    /// The HTTP status a unary call's error answers with.
    fn status(self) -> StatusCode {
        match self {
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A failed call: its code and a message for the caller.
#[derive(Debug, Clone, Serialize)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
    /// The HTTP status of the answer it came from, for a route that answers with it rather
    /// than a Connect error (`/files`).
    #[serde(skip)]
    pub status: Option<StatusCode>,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
            status: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::NotFound, message)
    }
}

impl From<ApiError> for RpcError {
    /// An answer of the services as the Connect code of its HTTP status.
    fn from(e: ApiError) -> Self {
        // To envd, a process that ended is one it no longer has.
        if matches!(e, ApiError::ProcessEnded) {
            return RpcError {
                status: Some(StatusCode::NOT_FOUND),
                ..RpcError::not_found(e.message())
            };
        }
        let code = match e.status().as_u16() {
            400 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 | 410 => Code::NotFound,
            408 | 504 => Code::DeadlineExceeded,
            409 => Code::FailedPrecondition,
            413 | 429 | 507 => Code::ResourceExhausted,
            501 => Code::Unimplemented,
            503 => Code::Unavailable,
            _ => Code::Internal,
        };
        RpcError {
            status: Some(e.status()),
            ..RpcError::new(code, e.message())
        }
    }
}

impl IntoResponse for RpcError {
    /// A unary call's error.
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut resp = (self.code.status(), body).into_response();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON));
        resp
    }
}

/// The media type of `headers` without its parameters.
fn media_type(headers: &HeaderMap) -> &str {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::trim)
        .unwrap_or("")
}

/// The request of a unary call: a JSON message (an empty body is the empty message).
pub fn unary_request<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, RpcError> {
    if !media_type(headers).eq_ignore_ascii_case(UNARY_JSON) {
        return Err(RpcError::new(
            Code::Unimplemented,
            "only the JSON codec (application/json) is served",
        ));
    }
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| RpcError::invalid(format!("invalid message: {e}")))
}

/// A unary call's answer.
pub fn unary_answer<T: Serialize>(answer: Result<T, RpcError>) -> Response {
    match answer.and_then(|m| {
        serde_json::to_vec(&m).map_err(|e| RpcError::new(Code::Internal, e.to_string()))
    }) {
        Ok(body) => {
            let mut resp = (StatusCode::OK, body).into_response();
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON));
            resp
        }
        Err(e) => e.into_response(),
    }
}

/// Refuses a streaming call in any codec but JSON.
pub fn stream_codec(headers: &HeaderMap) -> Result<(), RpcError> {
    if !media_type(headers).eq_ignore_ascii_case(STREAM_JSON) {
        return Err(RpcError::new(
            Code::Unimplemented,
            "only the JSON codec (application/connect+json) is served",
        ));
    }
    Ok(())
}

/// The request of a server-streaming call: exactly one enveloped, uncompressed JSON message.
pub fn stream_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, RpcError> {
    stream_codec(headers)?;
    let (flags, message) = match body {
        [flags, a, b, c, d, rest @ ..] => {
            let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
            if rest.len() != len {
                return Err(RpcError::invalid(
                    "the request is not exactly one enveloped message",
                ));
            }
            (*flags, rest)
        }
        _ => return Err(RpcError::invalid("the request has no enveloped message")),
    };
    if flags & COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not accepted",
        ));
    }
    serde_json::from_slice(message).map_err(|e| RpcError::invalid(format!("invalid message: {e}")))
}

/// The messages of a client-streaming call, read from its body as they come: each an
/// uncompressed enveloped JSON message of at most `max` bytes.
pub struct Envelopes {
    body: axum::body::BodyDataStream,
    buf: bytes::BytesMut,
    max: usize,
}

impl Envelopes {
    pub fn new(body: Body, max: usize) -> Envelopes {
        Envelopes {
            body: body.into_data_stream(),
            buf: bytes::BytesMut::new(),
            max,
        }
    }

    /// Reads and drops what is left of the body, at most `max` more bytes for at most `within`:
    /// an answer given before a body ended leaves its connection to be closed, which a client
    /// that already sent the rest and reuses the connection sees as a broken next request.
    pub async fn drain(&mut self, max: usize, within: Duration) {
        self.buf.clear();
        let mut left = max;
        let _ = tokio::time::timeout(within, async {
            while let Some(Ok(chunk)) = self.body.next().await {
                left = left.saturating_sub(chunk.len());
                if left == 0 {
                    return;
                }
            }
        })
        .await;
    }

    /// The next message; None once the caller ended its stream between two messages.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, RpcError> {
        loop {
            if let [flags, a, b, c, d, ..] = self.buf[..] {
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if flags & COMPRESSED != 0 {
                    return Err(RpcError::new(
                        Code::Unimplemented,
                        "compressed messages are not accepted",
                    ));
                }
                if flags & END_STREAM != 0 {
                    return Err(RpcError::invalid(
                        "a request's stream ends with its body, not an end-of-stream message",
                    ));
                }
                if len > self.max {
                    return Err(RpcError::new(
                        Code::ResourceExhausted,
                        format!(
                            "a message is at most {} bytes (server.body_limit_bytes)",
                            self.max
                        ),
                    ));
                }
                if self.buf.len() >= 5 + len {
                    let message = self.buf.split_to(5 + len);
                    return serde_json::from_slice(&message[5..])
                        .map(Some)
                        .map_err(|e| RpcError::invalid(format!("invalid message: {e}")));
                }
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    return Err(RpcError::invalid(format!(
                        "the request's stream broke: {e}"
                    )));
                }
                None if self.buf.is_empty() => return Ok(None),
                None => {
                    return Err(RpcError::invalid(
                        "the request's stream ended inside a message",
                    ));
                }
            }
        }
    }
}

/// `payload` in an envelope with `flags`.
fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.into()
}

/// The end-of-stream message: `{}`, or the call's error.
fn end_of_stream(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        Some(e) => serde_json::json!({ "error": e }),
        None => serde_json::json!({}),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

/// A server-streaming call's answer: each message of `messages` enveloped, then the end of the
/// stream (with the error that ended it, if one did). A call refused before its first message
/// is the same 200 with only the end of the stream.
pub fn stream_answer<T, S>(messages: Result<S, RpcError>) -> Response
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, RpcError>> + Send + 'static,
{
    let frames: futures::stream::BoxStream<'static, Result<Bytes, std::convert::Infallible>> =
        match messages {
            Ok(messages) => messages
                .map(move |m| {
                    m.and_then(|m| {
                        serde_json::to_vec(&m)
                            .map_err(|e| RpcError::new(Code::Internal, e.to_string()))
                    })
                })
                .scan(false, move |ended, m| {
                    // The first error ends the stream.
                    if *ended {
                        return futures::future::ready(None);
                    }
                    let frame = match m {
                        Ok(json) => envelope(0, &json),
                        Err(e) => {
                            *ended = true;
                            end_of_stream(Some(&e))
                        }
                    };
                    futures::future::ready(Some((frame, *ended)))
                })
                .chain(futures::stream::once(async {
                    (end_of_stream(None), false)
                }))
                .scan(false, |done, (frame, last)| {
                    // After an error's end-of-stream frame, the closing `{}` is not sent.
                    if *done {
                        return futures::future::ready(None);
                    }
                    *done = last;
                    futures::future::ready(Some(frame))
                })
                .map(Ok)
                .boxed(),
            Err(e) => futures::stream::once(async move { Ok(end_of_stream(Some(&e))) }).boxed(),
        };
    let mut resp = Response::new(Body::from_stream(frames));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON));
    resp
}

/// The call's deadline from `Connect-Timeout-Ms` (at most 10 digits; a fraction, which some
/// clients send, is dropped), if it has one.
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, RpcError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let v = v.to_str().unwrap_or("");
    let whole = match v.split_once('.') {
        Some((w, frac)) if frac.bytes().all(|b| b.is_ascii_digit()) => w,
        Some(_) => "",
        None => v,
    };
    if whole.is_empty() || whole.len() > 10 || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RpcError::invalid("Connect-Timeout-Ms must be 1-10 digits"));
    }
    Ok(whole.parse::<u64>().ok().map(Duration::from_millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(ct: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        h
    }

    #[test]
    fn a_stream_request_is_exactly_one_uncompressed_envelope() {
        let h = headers("application/connect+json");
        let ok = envelope(0, br#"{"a":1}"#);
        let v: serde_json::Value = stream_request(&h, &ok).unwrap();
        assert_eq!(v["a"], 1);
        let mut long = ok.to_vec();
        long.push(b' ');
        assert_eq!(
            stream_request::<serde_json::Value>(&h, &long)
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
        assert_eq!(
            stream_request::<serde_json::Value>(&h, &ok[..3])
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
        let zipped = envelope(COMPRESSED, b"{}");
        assert_eq!(
            stream_request::<serde_json::Value>(&h, &zipped)
                .unwrap_err()
                .code,
            Code::Unimplemented
        );
        let proto = headers("application/connect+proto");
        assert_eq!(
            stream_request::<serde_json::Value>(&proto, &ok)
                .unwrap_err()
                .code,
            Code::Unimplemented
        );
    }

    #[test]
    fn timeouts_are_at_most_ten_digits() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout(&h).unwrap(), None);
        h.insert("connect-timeout-ms", HeaderValue::from_static("1500"));
        assert_eq!(timeout(&h).unwrap(), Some(Duration::from_millis(1500)));
        h.insert("connect-timeout-ms", HeaderValue::from_static("60000.0"));
        assert_eq!(timeout(&h).unwrap(), Some(Duration::from_millis(60000)));
        for bad in ["", "-1", "12345678901", "1.x", ".5"] {
            h.insert("connect-timeout-ms", HeaderValue::from_str(bad).unwrap());
            assert!(timeout(&h).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_stream_ends_with_its_end_frame_or_its_error() {
        async fn frames(resp: Response) -> Vec<(u8, serde_json::Value)> {
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            let mut out = Vec::new();
            let mut rest = &body[..];
            while !rest.is_empty() {
                let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
                out.push((rest[0], serde_json::from_slice(&rest[5..5 + len]).unwrap()));
                rest = &rest[5 + len..];
            }
            out
        }
        let ok = stream_answer(Ok(futures::stream::iter(vec![
            Ok::<_, RpcError>(serde_json::json!({"n": 1})),
            Ok(serde_json::json!({"n": 2})),
        ])));
        let f = frames(ok).await;
        assert_eq!(f.len(), 3);
        assert_eq!((f[0].0, f[1].0, f[2].0), (0, 0, END_STREAM));
        assert_eq!(f[2].1, serde_json::json!({}));
        let failed = stream_answer(Ok(futures::stream::iter(vec![
            Ok(serde_json::json!({"n": 1})),
            Err(RpcError::not_found("gone")),
            Ok(serde_json::json!({"n": 3})),
        ])));
        let f = frames(failed).await;
        assert_eq!(f.len(), 2);
        assert_eq!(f[1].0, END_STREAM);
        assert_eq!(f[1].1["error"]["code"], "not_found");
        assert_eq!(f[1].1["error"]["message"], "gone");
        let refused = stream_answer::<serde_json::Value, futures::stream::Empty<_>>(Err(
            RpcError::invalid("bad"),
        ));
        let f = frames(refused).await;
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].1["error"]["code"], "invalid_argument");
    }

    #[tokio::test]
    async fn a_client_stream_is_read_message_by_message() {
        fn body(chunks: Vec<Vec<u8>>) -> Body {
            Body::from_stream(futures::stream::iter(
                chunks
                    .into_iter()
                    .map(|c| Ok::<_, std::convert::Infallible>(Bytes::from(c))),
            ))
        }
        let one = envelope(0, br#"{"a":1}"#).to_vec();
        let two = envelope(0, br#"{"a":2}"#).to_vec();
        // Split anywhere, even inside an envelope's prefix.
        let mut all = one.clone();
        all.extend_from_slice(&two);
        let chunks = vec![all[..3].to_vec(), all[3..9].to_vec(), all[9..].to_vec()];
        let mut m = Envelopes::new(body(chunks), 64);
        let got: Vec<serde_json::Value> = vec![
            m.next().await.unwrap().unwrap(),
            m.next().await.unwrap().unwrap(),
        ];
        assert_eq!(
            got,
            [serde_json::json!({"a":1}), serde_json::json!({"a":2})]
        );
        assert!(m.next::<serde_json::Value>().await.unwrap().is_none());

        let refused = |chunks: Vec<Vec<u8>>, max: usize| async move {
            Envelopes::new(body(chunks), max)
                .next::<serde_json::Value>()
                .await
                .unwrap_err()
                .code
        };
        assert_eq!(refused(vec![one.clone()], 3).await, Code::ResourceExhausted);
        assert_eq!(
            refused(vec![envelope(COMPRESSED, b"{}").to_vec()], 64).await,
            Code::Unimplemented
        );
        assert_eq!(
            refused(vec![envelope(END_STREAM, b"{}").to_vec()], 64).await,
            Code::InvalidArgument
        );
        assert_eq!(
            refused(vec![one[..6].to_vec()], 64).await,
            Code::InvalidArgument
        );
        assert_eq!(
            refused(vec![envelope(0, b"{nope").to_vec()], 64).await,
            Code::InvalidArgument
        );
    }
}
