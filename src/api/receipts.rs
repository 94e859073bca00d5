//! A run's receipt on the wire: `GET /v1/executions/{exec_id}/receipt`, its session twin
//! `GET /v1/sandbox/sessions/{id}/execs/{exec_id}/receipt`, and the public keys that verify
//! receipts and checkpoints, `GET /v1/receipts/keys`.
//!
//! Owns: these routes' answers. Must not: make or sign receipts (the execution service signs
//! each run's as it ends) or find runs itself (`calls::executions` does).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use utoipa::ToSchema;

use super::executions::json;
use super::extract::Path;
use super::sessions::{SessionPath, TenantHeaders};
use crate::calls::AppState;
use crate::calls::caller::{Caller, RequestId};
use crate::calls::error::ErrorBody;
use crate::calls::receipts::{self, ReceiptKeys};
use crate::calls::sessions::session_exec;

/// A DSSE envelope (`payloadType: application/vnd.in-toto+json`) whose payload is an in-toto
/// Statement v1 about one run (OpenAPI only: the body is the envelope as it was signed).
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ReceiptEnvelope {
    /// Base64 of the statement's JSON.
    payload: String,
    #[schema(rename = "payloadType", example = "application/vnd.in-toto+json")]
    payload_type: String,
    signatures: Vec<ReceiptSignature>,
}

/// One signature of an envelope.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ReceiptSignature {
    /// SHA-256 (hex) of the signing key's raw Ed25519 public key.
    keyid: String,
    /// Base64 of the Ed25519 signature over the DSSE pre-authentication encoding.
    sig: String,
}

/// `GET /v1/executions/{exec_id}/receipt`.
#[utoipa::path(
    get,
    path = "/v1/executions/{exec_id}/receipt",
    operation_id = "get_execution_receipt",
    tag = "runs",
    params(("exec_id" = String, Path, description = "The run's `exec_id`")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The run's receipt: a DSSE envelope of an in-toto statement, signed with Ed25519", body = ReceiptEnvelope),
        (status = 400, description = "InvalidRequest: an exec_id that is not UTF-8 once percent-decoded", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no run with this id is visible to the calling service, or it ended without an outcome (no receipt)", body = ErrorBody),
        (status = 409, description = "NotFinished: the run has not ended yet", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn execution_receipt(
    State(st): State<Arc<AppState>>,
    Path(exec_id): Path<String>,
    req: Request,
) -> Response {
    let rid = RequestId::of(&req);
    let headers = req.headers().clone();
    let found = async {
        let caller = Caller::authenticate(&st, &headers, rid).await?;
        crate::calls::executions::receipt(&st, &exec_id, &caller.owner()).await
    };
    match found.await {
        Ok(body) => json(StatusCode::OK, body),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/sandbox/sessions/{id}/execs/{exec_id}/receipt`: a session exec's receipt (a
/// background process's once it ended).
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/execs/{exec_id}/receipt",
    operation_id = "get_session_exec_receipt",
    tag = "sessions",
    params(
        SessionPath,
        ("exec_id" = String, Path, description = "The exec's `exec_id` (a background process's id)"),
        TenantHeaders,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The exec's receipt", body = ReceiptEnvelope),
        (status = 400, description = "InvalidRequest: a tenant header is malformed or the two disagree, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session, or no such exec of it, or it ended without an outcome (no receipt)", body = ErrorBody),
        (status = 409, description = "NotFinished: the exec has not ended yet", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the state store is unreachable", body = ErrorBody),
    )
)]
pub async fn session_exec_receipt(
    State(st): State<Arc<AppState>>,
    Path((id, exec_id)): Path<(String, String)>,
    req: Request,
) -> Response {
    let rid = RequestId::of(&req);
    let headers = req.headers().clone();
    let found = async {
        let (owner, _) = session_exec(&st, &headers, rid, &id, &exec_id).await?;
        crate::calls::executions::receipt(&st, &exec_id, &owner).await
    };
    match found.await {
        Ok(body) => json(StatusCode::OK, body),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/receipts/keys`.
#[utoipa::path(
    get,
    path = "/v1/receipts/keys",
    operation_id = "list_receipt_keys",
    tag = "runs",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The public keys that verify receipts and checkpoints: this replica's, `receipts.public_key_files`, and those other replicas published through the state store", body = ReceiptKeys),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
    )
)]
pub async fn list_keys(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let rid = RequestId::of(&req);
    if let Err(e) = Caller::authenticate(&st, req.headers(), rid).await {
        return e.into_response();
    }
    (StatusCode::OK, axum::Json(receipts::list(&st).await)).into_response()
}
