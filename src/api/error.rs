//! An [`ApiError`] as an HTTP answer: its status, its JSON body, `Retry-After` on the statuses a
//! retry may clear.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::calls::error::ApiError;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(detail) = &self {
            tracing::error!(detail = %detail, "internal error");
        }
        let mut resp = (self.status(), axum::Json(self.error_body())).into_response();
        if let Some(secs) = self.retry_after_seconds() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        // The rest of a late body may still be on its way: the connection cannot be reused.
        if matches!(self, ApiError::BodyTimeout(_)) {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}
