//! Extractors whose rejections are the documented error body.
//!
//! axum's own `Path` and `Query` answer a bad request (a segment that is not UTF-8 once decoded,
//! a query that does not parse) with plain text; every route takes these instead, so such a
//! request gets `{"success": false, "error", "error_type": "InvalidRequest", …}` like any other.
//!
//! Owns: turning extractor rejections into [`ApiError`]. Must not: validate what the values mean
//! (the handlers do).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::calls::ApiError;

/// A rejection as the error body: a 4xx is the caller's bad request, a 5xx (a route declared
/// without the parameters its handler reads) the daemon's own fault.
fn rejected(status: axum::http::StatusCode, text: String) -> ApiError {
    if status.is_server_error() {
        ApiError::Internal(text)
    } else {
        ApiError::InvalidRequest(text)
    }
}

/// The path's parameters, as `axum::extract::Path` reads them.
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| rejected(e.status(), format!("invalid path: {}", e.body_text())))
    }
}

/// The query string's parameters, as `axum::extract::Query` reads them.
#[derive(Debug)]
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Query(q.0))
            .map_err(|e| rejected(e.status(), format!("invalid query: {}", e.body_text())))
    }
}
