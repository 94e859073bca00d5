//! Operational endpoints: /health, /livez, /ready(z), /capabilities, /metrics, /v1/executors.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::calls::ApiError;
use crate::calls::AppState;
use crate::executors::ExecutorDef;
use crate::policy::profile::{LimitsSection, NetworkMode, OutputSection};
use crate::sandbox::local::probe::HostProbe;
use crate::sandbox::{BackendKind, BackendStatus};
use crate::vocabulary::{ActionType, Capability};

use crate::calls::VERSION;

/// The body of `/health` and `/livez`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// Always `healthy`.
    #[schema(value_type = String, pattern = "^healthy$")]
    pub status: &'static str,
    pub version: &'static str,
}

/// Liveness: the daemon answers.
#[utoipa::path(
    get,
    path = "/health",
    operation_id = "health",
    tag = "operations",
    responses((status = 200, description = "Alive", body = Health))
)]
pub async fn health() -> Json<Health> {
    Json(Health {
        status: "healthy",
        version: VERSION,
    })
}

/// Liveness: the daemon answers (as `/health`).
#[utoipa::path(
    get,
    path = "/livez",
    operation_id = "livez",
    tag = "operations",
    responses((status = 200, description = "Alive", body = Health))
)]
pub async fn livez() -> Json<Health> {
    health().await
}

/// The body of `/ready` and `/readyz`, 200 or 503.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ready` (200) or `not_ready` (503).
    #[schema(value_type = String, pattern = "^(ready|not_ready)$")]
    pub status: &'static str,
    /// Why the daemon is not ready (empty when it is).
    pub reasons: Vec<String>,
    pub backends: Vec<BackendStatus>,
    /// `embedded` or `redis`.
    #[schema(value_type = String)]
    pub state_store: &'static str,
}

/// Readiness: 200 only when the configured default backend can run work, the state store
/// answers, the audit log can be appended to and the daemon is not draining; 503 with the
/// reasons otherwise.
#[utoipa::path(
    get,
    path = "/ready",
    operation_id = "ready",
    tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Readiness),
        (status = 503, description = "Not ready, with the reasons", body = Readiness),
    )
)]
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
    let body = Readiness {
        status: if reasons.is_empty() {
            "ready"
        } else {
            "not_ready"
        },
        reasons,
        backends,
        state_store: st.store.kind(),
    };
    (status, Json(body)).into_response()
}

/// Readiness (as `/ready`).
#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Readiness),
        (status = 503, description = "Not ready, with the reasons", body = Readiness),
    )
)]
pub async fn readyz(st: State<Arc<AppState>>) -> Response {
    ready(st).await
}

/// The body of `/capabilities`: what this daemon can run and under which limits.
#[derive(Debug, Serialize, ToSchema)]
pub struct Capabilities {
    /// Feature names: `shell_execution`, `python_execution`, and `sessions`, `http_requests`,
    /// `external_execution` when configured.
    #[schema(value_type = Vec<String>)]
    pub capabilities: Vec<&'static str>,
    pub allowed_commands: Vec<String>,
    pub version: &'static str,
    pub commands: Vec<CommandInfo>,
    /// Commands added to the allowlist from the environment.
    pub commands_added_from_env: Vec<String>,
    pub disabled_commands: Vec<DisabledCommand>,
    pub default_backend: BackendKind,
    pub backends: Vec<BackendStatus>,
    pub profiles: Vec<ProfileInfo>,
    pub executors: Vec<ExecutorDef>,
    pub session_languages: Vec<LanguageInfo>,
    /// What the kernel offers the local backend (null when it is not configured).
    pub host: Option<HostProbe>,
    pub limits: DaemonLimits,
}

/// One allowlisted command.
#[derive(Debug, Serialize, ToSchema)]
pub struct CommandInfo {
    pub name: String,
    /// Its resolved absolute path.
    pub path: String,
    pub action_types: Vec<ActionType>,
    /// What a capability token must grant to run it.
    pub capabilities: Vec<Capability>,
    /// Its default sandbox profile.
    pub profile: String,
}

/// A configured command the daemon refused to allow, and why.
#[derive(Debug, Serialize, ToSchema)]
pub struct DisabledCommand {
    pub name: String,
    pub reason: String,
}

/// One sandbox profile.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProfileInfo {
    pub name: String,
    pub description: String,
    pub backend: BackendKind,
    pub network: NetworkMode,
    /// Whether this daemon can run it (an egress profile needs a backend with egress).
    pub available: bool,
    pub limits: LimitsSection,
    pub output: OutputSection,
}

/// One session language.
#[derive(Debug, Serialize, ToSchema)]
pub struct LanguageInfo {
    pub name: String,
    pub interpreter: String,
    pub path: String,
    pub capability: Capability,
    pub profile: String,
}

/// The daemon's own limits.
#[derive(Debug, Serialize, ToSchema)]
pub struct DaemonLimits {
    /// The longest synchronous run (seconds).
    pub timeout_seconds_max: u64,
    pub body_limit_bytes: usize,
    /// Run slots per backend.
    pub concurrency: Concurrency,
    pub queue: QueueLimits,
}

/// Run slots per backend.
#[derive(Debug, Serialize, ToSchema)]
pub struct Concurrency {
    pub local: usize,
    pub docker: usize,
    pub gvisor: usize,
}

/// How many requests may wait for a run slot, and for how long.
#[derive(Debug, Serialize, ToSchema)]
pub struct QueueLimits {
    pub max_waiting: usize,
    pub max_wait_ms: u64,
}

/// What this daemon can run: action types, allowed commands, backends, profiles, executors,
/// session languages, host sandbox features, limits.
#[utoipa::path(
    get,
    path = "/capabilities",
    operation_id = "capabilities",
    tag = "operations",
    responses((status = 200, description = "The daemon's capabilities", body = Capabilities))
)]
pub async fn capabilities(State(st): State<Arc<AppState>>) -> Json<Capabilities> {
    let backends = st.executions.backend_statuses().await;
    let policy = st.executions.policy();
    let commands = policy
        .commands
        .values()
        .map(|c| CommandInfo {
            name: c.name.clone(),
            path: c.path.display().to_string(),
            action_types: c.action_types.clone(),
            capabilities: c.capabilities.clone(),
            profile: c.profile.clone(),
        })
        .collect();
    let profiles = policy
        .profiles
        .values()
        .map(|p| ProfileInfo {
            name: p.name.clone(),
            description: p.description.clone(),
            backend: p.backend(policy.default_backend),
            network: p.network.mode,
            available: p.network.mode == NetworkMode::None
                || policy
                    .egress_backends
                    .contains(&p.backend(policy.default_backend)),
            limits: p.limits.clone(),
            output: p.output.clone(),
        })
        .collect();
    let languages: Vec<_> = policy
        .languages
        .values()
        .map(|l| LanguageInfo {
            name: l.name.clone(),
            interpreter: l.interpreter.clone(),
            path: l.path.display().to_string(),
            capability: l.capability,
            profile: l.profile.clone(),
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
    let server = &st.config.server;
    Json(Capabilities {
        capabilities: caps,
        allowed_commands: policy.allowed_names(),
        version: VERSION,
        commands,
        commands_added_from_env: policy.env_added.clone(),
        disabled_commands: policy
            .disabled
            .iter()
            .map(|(name, reason)| DisabledCommand {
                name: name.clone(),
                reason: reason.clone(),
            })
            .collect(),
        default_backend: policy.default_backend,
        backends,
        profiles,
        executors: st.executions.executors().list(),
        session_languages: languages,
        host: st.host_probe.clone(),
        limits: DaemonLimits {
            timeout_seconds_max: crate::policy::profile::MAX_TIMEOUT_SECONDS,
            body_limit_bytes: server.body_limit_bytes,
            concurrency: Concurrency {
                local: server.concurrency.local,
                docker: server.concurrency.docker,
                gvisor: server.concurrency.gvisor,
            },
            queue: QueueLimits {
                max_waiting: server.queue.max_waiting,
                max_wait_ms: server.queue.max_wait_ms,
            },
        },
    })
}

/// Prometheus metrics.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text format 0.0.4", body = String, content_type = "text/plain; version=0.0.4"))
)]
pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    // executor_backend_ready as of this scrape, not only as of the last readiness probe.
    st.executions.backend_statuses().await;
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

/// The body of `/v1/executors`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecutorList {
    /// Never their env values.
    pub executors: Vec<ExecutorDef>,
}

/// The registered external executors (never their env values).
#[utoipa::path(
    get,
    path = "/v1/executors",
    operation_id = "executors",
    tag = "operations",
    responses((status = 200, description = "The registered executors", body = ExecutorList))
)]
pub async fn executors(State(st): State<Arc<AppState>>) -> Json<ExecutorList> {
    Json(ExecutorList {
        executors: st.executions.executors().list(),
    })
}

pub async fn not_found() -> Response {
    let e = ApiError::InvalidRequest("no such endpoint".into());
    let mut body = e.body();
    body["retryable"] = serde_json::json!(crate::calls::error::retryable(StatusCode::NOT_FOUND));
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

pub async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}
