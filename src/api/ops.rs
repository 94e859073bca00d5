//! Operational endpoints: /health, /livez, /ready(z), /capabilities, /metrics, /v1/executors.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::ApiError;
use super::{AppState, VERSION};
use crate::policy::profile::NetworkMode;

pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "healthy", "version": VERSION}))
}

/// 200 only when the configured default backend can run work, the state store answers, the audit
/// log can be appended to and the daemon is not draining; 503 with the reasons otherwise.
pub async fn ready(State(st): State<Arc<AppState>>) -> Response {
    let mut reasons = Vec::new();
    if st.is_draining() {
        reasons.push("shutting down".to_string());
    }
    let default_backend = st.executions.policy().default_backend;
    let backends = st.executions.backend_statuses().await;
    for s in &backends {
        if s.backend == default_backend && !s.ready {
            reasons.push(format!(
                "default backend {} not ready: {}",
                s.backend.as_str(),
                s.detail
            ));
        }
    }
    if !st.executions.backends().contains_key(&default_backend) {
        reasons.push(format!(
            "default backend {} is not configured",
            default_backend.as_str()
        ));
    }
    if let Err(e) = st.store.healthy().await {
        reasons.push(e.to_string());
    }
    if let Err(e) = st.audit.check_writable() {
        reasons.push(format!("audit log cannot be appended to: {e}"));
    }
    let status = if reasons.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if reasons.is_empty() { "ready" } else { "not_ready" },
        "reasons": reasons,
        "backends": backends,
        "state_store": st.store.kind(),
    });
    (status, Json(body)).into_response()
}

pub async fn capabilities(State(st): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let backends = st.executions.backend_statuses().await;
    let policy = st.executions.policy();
    let commands: Vec<_> = policy
        .commands
        .values()
        .map(|c| {
            json!({
                "name": c.name,
                "path": c.path,
                "action_types": c.action_types,
                "capabilities": c.capabilities,
                "profile": c.profile,
            })
        })
        .collect();
    let profiles: Vec<_> = policy
        .profiles
        .values()
        .map(|p| {
            json!({
                "name": p.name,
                "description": p.description,
                "backend": p.backend(policy.default_backend),
                "network": p.network.mode,
                "available": p.network.mode == NetworkMode::None || policy.egress_backends.contains(&p.backend(policy.default_backend)),
                "limits": p.limits,
                "output": p.output,
            })
        })
        .collect();
    let languages: Vec<_> = policy
        .languages
        .values()
        .map(|l| {
            json!({
                "name": l.name,
                "interpreter": l.interpreter,
                "path": l.path,
                "capability": l.capability,
                "profile": l.profile,
            })
        })
        .collect();
    let mut caps = vec!["shell_execution", "python_execution"];
    if !languages.is_empty() {
        caps.push("sessions");
    }
    if !policy.egress_backends.is_empty() {
        caps.push("http_requests");
    }
    if !st.executions.executors().list().is_empty() {
        caps.push("external_execution");
    }
    Json(json!({
        "capabilities": caps,
        "allowed_commands": policy.allowed_names(),
        "version": VERSION,
        "commands": commands,
        "commands_added_from_env": policy.env_added,
        "disabled_commands": policy.disabled.iter().map(|(n, why)| json!({"name": n, "reason": why})).collect::<Vec<_>>(),
        "default_backend": policy.default_backend,
        "backends": backends,
        "profiles": profiles,
        "executors": st.executions.executors().list(),
        "session_languages": languages,
        "host": st.host_probe,
        "limits": {
            "timeout_seconds_max": crate::policy::profile::MAX_TIMEOUT_SECONDS,
            "body_limit_bytes": st.config.server.body_limit_bytes,
            "concurrency": {
                "local": st.config.server.concurrency.local,
                "docker": st.config.server.concurrency.docker,
                "gvisor": st.config.server.concurrency.gvisor,
            },
            "queue": {
                "max_waiting": st.config.server.queue.max_waiting,
                "max_wait_ms": st.config.server.queue.max_wait_ms,
            },
        },
    }))
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    // executor_backend_ready as of this scrape, not only as of the last readiness probe.
    st.executions.backend_statuses().await;
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

pub async fn executors(State(st): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({ "executors": st.executions.executors().list() }))
}

pub async fn not_found() -> Response {
    let e = ApiError::InvalidRequest("no such endpoint".into());
    let mut body = e.body();
    body["retryable"] = serde_json::json!(super::error::retryable(StatusCode::NOT_FOUND));
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

pub async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}
