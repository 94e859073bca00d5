//! Who is calling and what it sent: the request id, the calling service (its bearer token), the
//! capability token, the tenant, and the request body read within its limits.
//!
//! Owns: reading these from a request, and the 401 a refused credential is (counted and
//! audited). Must not: decide what a caller may run (the execution service does), or run
//! anything.

use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, header};

use super::error::ApiError;
use super::state::AppState;
use crate::auth::Verified;
use crate::config::TokenKind;
use crate::execution::record::{self, KnownRequest, RefusalKind};
use crate::execution::{ClaimError, claim_single_use, owner_of};
use crate::sessions::Owner;

// ---------------------------------------------------------------------------------------------
// The request id

/// The request id of this request (the caller's if valid, else a new UUID).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

impl RequestId {
    /// The caller's `X-Request-ID` when it is valid (1-128 of `[A-Za-z0-9._-]`), else a new
    /// UUID.
    pub fn assign(headers: &HeaderMap) -> RequestId {
        RequestId(
            headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .filter(|s| valid_request_id(s))
                .map(str::to_string)
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
        )
    }

    /// The id the router's middleware gave `req` ("" outside the router).
    pub fn of(req: &Request) -> String {
        req.extensions()
            .get::<RequestId>()
            .map(|r| r.0.clone())
            .unwrap_or_default()
    }
}

fn valid_request_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

// ---------------------------------------------------------------------------------------------
// The calling service

/// An authenticated calling service, and what a refusal of its request tells the audit log
/// (filled in as the route learns more of the request).
pub struct Caller {
    pub service: Verified,
    pub known: KnownRequest,
}

impl Caller {
    /// The calling service of the request `request_id`, from its bearer token (a single-use one
    /// is used up here); a refusal is an audited 401.
    pub async fn authenticate(
        st: &AppState,
        headers: &HeaderMap,
        request_id: String,
    ) -> Result<Caller, ApiError> {
        let mut known = KnownRequest {
            request_id,
            ..KnownRequest::default()
        };
        let service = calling_service(st, headers, &mut known).await?;
        Ok(Caller { service, known })
    }

    /// The owner of the runs this service starts.
    pub fn owner(&self) -> String {
        owner_of(self.service.subject.as_deref())
    }

    /// The owner of the sessions this service makes for the tenant `headers` name.
    pub fn session_owner(&self, headers: &HeaderMap) -> Result<Owner, ApiError> {
        Ok(Owner {
            subject: self.owner(),
            tenant: tenant(headers)?,
        })
    }

    /// The service token's own capabilities as the call's grant (a front end whose contract
    /// that is). A single-use service token was used up by this call's authentication: the same
    /// use grants the call, it is not claimed a second time (which would refuse it as replayed).
    pub fn service_grant(&self) -> Verified {
        Verified {
            single_use: None,
            ..self.service.clone()
        }
    }

    /// The capability token `token`, verified; a refusal is an audited 401.
    pub fn capability(&mut self, st: &AppState, token: &str) -> Result<Verified, ApiError> {
        let cap = st
            .auth
            .verify(token, TokenKind::Capability)
            .map_err(|e| unauthorized(st, &self.known, &format!("capability token: {e}")))?;
        self.known.token_id = cap.token_id.clone();
        Ok(cap)
    }
}

/// Counts and audits a 401 (see [`record::refusal`]); the answer is always the same body.
pub(crate) fn unauthorized(st: &AppState, known: &KnownRequest, reason: &str) -> ApiError {
    record::refusal(
        &st.audit,
        &st.metrics,
        known,
        RefusalKind::Unauthorized,
        reason,
    );
    ApiError::Unauthorized
}

/// The token of an `Authorization: Bearer` header.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

/// The service token of `headers` verified (signature, claims), without using up a single-use
/// one: what a front end that admits a connection before its calls checks (each call is then
/// authenticated whole, as [`Caller::authenticate`] does). A refusal is an audited 401.
pub fn service_token(
    st: &AppState,
    headers: &HeaderMap,
    known: &mut KnownRequest,
) -> Result<Verified, ApiError> {
    let service = match bearer(headers) {
        Some(t) => st
            .auth
            .verify(t, TokenKind::Service)
            .map_err(|e| unauthorized(st, known, &format!("service token: {e}")))?,
        None => {
            return Err(unauthorized(
                st,
                known,
                "missing Authorization: Bearer service token",
            ));
        }
    };
    known.subject = service.subject.clone();
    Ok(service)
}

/// The calling service, from its bearer token (a single-use one is used up here); a refusal is
/// a 401, audited with what `known` tells of the request.
async fn calling_service(
    st: &AppState,
    headers: &HeaderMap,
    known: &mut KnownRequest,
) -> Result<Verified, ApiError> {
    let service = service_token(st, headers, known)?;
    claim_single_use(&*st.store, &service)
        .await
        .map_err(|e| match e {
            ClaimError::Refused(reason) => unauthorized(st, known, &reason),
            ClaimError::Unavailable(m) => ApiError::SandboxUnavailable(m),
        })?;
    Ok(service)
}

// ---------------------------------------------------------------------------------------------
// The capability token and the tenant

/// Where a caller may send the capability token instead of the body's `capability_token`.
pub const CAPABILITY_TOKEN_HEADER: &str = "x-capability-token";

/// The capability token a request carries, in its body or in [`CAPABILITY_TOKEN_HEADER`]: at
/// most one of the two, and the header at most once (a proxy in front may have checked the
/// other copy).
pub(crate) fn capability_token<'a>(
    in_body: Option<&'a str>,
    headers: &'a HeaderMap,
) -> Result<Option<&'a str>, ApiError> {
    let mut header_tokens = headers.get_all(CAPABILITY_TOKEN_HEADER).iter();
    let header_token = header_tokens.next().map(|v| v.to_str().unwrap_or_default());
    if header_tokens.next().is_some() {
        return Err(ApiError::InvalidRequest(format!(
            "{CAPABILITY_TOKEN_HEADER} is given more than once"
        )));
    }
    match (in_body, header_token) {
        (Some(_), Some(_)) => Err(ApiError::InvalidRequest(format!(
            "the capability token is given twice: in the body and in {CAPABILITY_TOKEN_HEADER}"
        ))),
        (Some(t), None) | (None, Some(t)) => Ok(Some(t)),
        (None, None) => Ok(None),
    }
}

const TENANT_HEADERS: [&str; 2] = ["x-tenant-id", "x-koder-tenant"];

/// The tenant a call names (`X-Tenant-ID`, alias `X-Koder-Tenant`): "" without one; both
/// headers must agree.
pub(crate) fn tenant(headers: &HeaderMap) -> Result<String, ApiError> {
    let mut found: Option<String> = None;
    for name in TENANT_HEADERS {
        for v in headers.get_all(name) {
            let v = v
                .to_str()
                .ok()
                .filter(|v| v.len() <= 256 && v.bytes().all(|b| b.is_ascii_graphic()))
                .ok_or_else(|| {
                    ApiError::InvalidRequest(format!(
                        "{name} must be 0-256 visible ASCII characters"
                    ))
                })?;
            match &found {
                Some(f) if f != v => {
                    return Err(ApiError::InvalidRequest(
                        "X-Tenant-ID / X-Koder-Tenant name different tenants".into(),
                    ));
                }
                _ => found = Some(v.to_string()),
            }
        }
    }
    Ok(found.unwrap_or_default())
}

// ---------------------------------------------------------------------------------------------
// The body

/// How much of a body is read, and how long it may take to arrive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyLimit {
    pub bytes: usize,
    pub deadline: Duration,
}

impl BodyLimit {
    /// A JSON request's: `server.body_limit_bytes` within `server.body_read_timeout_seconds`.
    pub fn request(st: &AppState) -> BodyLimit {
        BodyLimit {
            bytes: st.config.server.body_limit_bytes,
            deadline: Duration::from_secs(st.config.server.body_read_timeout_seconds),
        }
    }

    /// A session file's: `sessions.max_file_bytes`, within at least a minute.
    pub fn file(st: &AppState) -> BodyLimit {
        BodyLimit {
            bytes: st.config.sessions.max_file_bytes,
            deadline: file_deadline(st),
        }
    }

    /// A session call handed to the replica that holds the session: a JSON request or a file.
    pub fn forwarded(st: &AppState) -> BodyLimit {
        BodyLimit {
            bytes: st
                .config
                .server
                .body_limit_bytes
                .max(st.config.sessions.max_file_bytes),
            deadline: file_deadline(st),
        }
    }
}

fn file_deadline(st: &AppState) -> Duration {
    Duration::from_secs(st.config.server.body_read_timeout_seconds.max(60))
}

/// The whole body, refused (413) past `limit.bytes` and (408) when it does not arrive within
/// `limit.deadline`.
pub(crate) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: BodyLimit,
) -> Result<bytes::Bytes, ApiError> {
    let BodyLimit {
        bytes: limit,
        deadline,
    } = limit;
    // Refuse on the declared length before reading anything.
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    // Chunked bodies: stop reading at the first byte past the limit. The whole body must arrive
    // within the deadline, or a trickling client holds a connection and a task forever.
    let read = tokio::time::timeout(deadline, to_bytes(body, limit))
        .await
        .map_err(|_| ApiError::BodyTimeout(deadline))?;
    read.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            || e.to_string().contains("length limit");
        if too_large {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::InvalidRequest(format!("could not read the request body: {e}"))
        }
    })
}

/// For an optional body field whose absence is a value (an empty list, `false`): `null` is the
/// same as leaving the field out, as for every `Option` field.
pub(crate) fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + Default,
{
    use serde::Deserialize as _;
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn request_ids() {
        assert!(valid_request_id("abc-123_x.y"));
        assert!(!valid_request_id(""));
        assert!(!valid_request_id("a b"));
        assert!(!valid_request_id(&"a".repeat(129)));
        assert!(!valid_request_id("x\r\nSet-Cookie: y"));
    }

    #[test]
    fn bearer_tokens() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(bearer(&with("Bearer abc")), Some("abc"));
        assert_eq!(bearer(&with("bearer  abc ")), Some("abc"));
        assert_eq!(bearer(&with("Basic abc")), None);
        assert_eq!(bearer(&with("Bearer ")), None);
        assert_eq!(bearer(&with("Bearer")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }
}
