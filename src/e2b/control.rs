//! The control plane under `/e2b`: sandboxes as the E2B SDKs make, list, describe, time out,
//! pause, connect to (resume) and kill them. The API key (`X-API-KEY`) is a service token: its
//! `capabilities` claim is the sandbox's grant, its subject the sandbox's owner, so another
//! service's key finds none of its sandboxes (404, as for an unknown id).
//!
//! Errors use E2B's body, `{"code": <HTTP status>, "message": …}`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::{E2b, ENVD_VERSION, PATH};
use crate::calls::caller::{BodyLimit, Caller, read_body};
use crate::calls::sessions::{self, CreateBody, Looked, Touch};
use crate::calls::{ApiError, AppState, RequestId};
use crate::sessions::{Owner, SessionInfo, SessionState};

/// The control plane's routes (mounted at [`PATH`]).
pub fn routes(e2b: Arc<E2b>) -> Router<Arc<AppState>> {
    let r = Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/templates", axum::routing::any(unsupported_templates))
        .route(
            "/templates/{*rest}",
            axum::routing::any(unsupported_templates),
        )
        .route("/volumes", axum::routing::any(unsupported_volumes))
        .route("/volumes/{*rest}", axum::routing::any(unsupported_volumes))
        .route("/snapshots", axum::routing::any(unsupported_snapshots))
        .route(
            "/snapshots/{*rest}",
            axum::routing::any(unsupported_snapshots),
        )
        .route("/{*rest}", axum::routing::any(unknown))
        .with_state(e2b);
    Router::new().nest_service(PATH, r)
}

/// An answer in E2B's error body.
struct E2bError(StatusCode, String);

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.0.as_u16(), "message": self.1 });
        (self.0, Json(body)).into_response()
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        let status = e.status();
        let mut resp = E2bError(status, e.message());
        if status == StatusCode::NOT_FOUND {
            resp.1 = "sandbox not found".into();
        }
        resp
    }
}

type Answer<T> = Result<T, E2bError>;

/// The calling service of an E2B request: its `X-API-KEY` is the service token (a refusal is
/// the REST API's audited 401). Read as the bearer token the REST API takes.
async fn caller(e2b: &E2b, headers: &HeaderMap) -> Result<(Caller, HeaderMap), E2bError> {
    let mut as_rest = HeaderMap::new();
    if let Some(key) = headers.get("x-api-key")
        && let Ok(key) = key.to_str()
        && let Ok(bearer) = HeaderValue::from_str(&format!("Bearer {}", key.trim()))
    {
        as_rest.insert(header::AUTHORIZATION, bearer);
    }
    for name in ["x-tenant-id", "x-koder-tenant"] {
        if let Some(tenant) = headers.get(name) {
            as_rest.insert(name, tenant.clone());
        }
    }
    let rid = RequestId::assign(headers).0;
    let caller = Caller::authenticate(&e2b.st, &as_rest, rid)
        .await
        .map_err(|_| E2bError(StatusCode::UNAUTHORIZED, "invalid API key".into()))?;
    Ok((caller, as_rest))
}

/// A request's JSON body, read once its caller is known (within `server.body_limit_bytes` and
/// its deadline); an empty one is `{}`.
async fn json_body<T: serde::de::DeserializeOwned>(
    e2b: &E2b,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, E2bError> {
    let bytes = read_body(body, headers, BodyLimit::request(&e2b.st)).await?;
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        &bytes[..]
    };
    serde_json::from_slice(bytes)
        .map_err(|e| E2bError(StatusCode::BAD_REQUEST, format!("invalid body: {e}")))
}

async fn owner(e2b: &E2b, headers: &HeaderMap) -> Result<(Owner, HeaderMap, String), E2bError> {
    let (caller, as_rest) = caller(e2b, headers).await?;
    let owner = caller.session_owner(&as_rest)?;
    Ok((owner, as_rest, caller.known.request_id))
}

/// The body of `POST /sandboxes`. Fields of newer SDKs that change nothing here are accepted and
/// ignored; ones that ask for what is not offered are refused by name.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    /// Seconds until the sandbox ends (its session's TTL); default 300.
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    auto_pause: Option<bool>,
    #[serde(default)]
    volume_mounts: Option<Vec<serde_json::Value>>,
}

/// A sandbox as create and connect answer it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Sandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    envd_version: &'static str,
    envd_access_token: String,
    domain: Option<String>,
}

/// A sandbox as info and list describe it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Detail {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    started_at: String,
    end_at: String,
    envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    domain: Option<String>,
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u64,
    metadata: BTreeMap<String, String>,
    state: &'static str,
}

/// The one client id every sandbox here has (E2B names the node that runs it).
const CLIENT_ID: &str = "executor-arm";
/// A sandbox's life when create names none (E2B's default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

async fn create(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    body: Body,
) -> Answer<(StatusCode, Json<Sandbox>)> {
    let (caller, as_rest) = caller(&e2b, &headers).await?;
    let asked: NewSandbox = json_body(&e2b, &headers, body).await?;
    for (what, map) in [("metadata", &asked.metadata), ("envVars", &asked.env_vars)] {
        if let Some(map) = map {
            super::sandboxes::check_map(what, map)
                .map_err(|m| E2bError(StatusCode::BAD_REQUEST, m))?;
        }
    }
    if asked.auto_pause == Some(true) {
        return Err(E2bError(
            StatusCode::BAD_REQUEST,
            "autoPause is not supported: a sandbox ends at its timeout (pause it before)".into(),
        ));
    }
    if asked.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(E2bError(
            StatusCode::BAD_REQUEST,
            "volumes are not supported by this E2B API".into(),
        ));
    }
    let template = e2b
        .st
        .config
        .e2b
        .templates
        .get(&asked.template_id)
        .ok_or_else(|| {
            E2bError(
                StatusCode::BAD_REQUEST,
                format!(
                    "template '{}' is not offered here (e2b.templates lists: {})",
                    asked.template_id,
                    e2b.st
                        .config
                        .e2b
                        .templates
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
    let ttl = asked.timeout.map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let body = CreateBody {
        language: template.language.clone(),
        profile: template.profile.clone(),
        ttl_seconds: Some(ttl.as_secs()),
        // A sandbox lives for its timeout, used or not.
        idle_timeout_seconds: Some(
            ttl.as_secs()
                .clamp(1, e2b.st.config.sessions.idle_timeout_seconds),
        ),
        limits: None,
        capability_token: None,
    };
    let session = sessions::create(&e2b.st, caller, &as_rest, body, true).await?;
    e2b.sandboxes.put(
        &session.id,
        super::sandboxes::Sandbox::new(
            asked.template_id.clone(),
            asked.metadata.unwrap_or_default(),
            asked.env_vars.unwrap_or_default(),
        ),
    );
    Ok((
        StatusCode::CREATED,
        Json(Sandbox {
            template_id: asked.template_id,
            envd_access_token: e2b.sandboxes.access_token(&session.id),
            sandbox_id: session.id.clone(),
            client_id: CLIENT_ID,
            envd_version: ENVD_VERSION,
            domain: None,
        }),
    ))
}

/// `info` as E2B describes it.
fn detail(e2b: &E2b, info: &SessionInfo, size: (f64, u64, u64), token: bool) -> Detail {
    let record = e2b.sandboxes.get(&info.id);
    let (cpus, memory, disk) = size;
    Detail {
        template_id: record
            .as_ref()
            .map(|r| r.template_id.clone())
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| info.language.clone()),
        sandbox_id: info.id.clone(),
        client_id: CLIENT_ID,
        started_at: info.created_at.clone(),
        end_at: info
            .paused_until
            .clone()
            .unwrap_or_else(|| info.expires_at.clone()),
        envd_version: ENVD_VERSION,
        envd_access_token: token.then(|| e2b.sandboxes.access_token(&info.id)),
        domain: None,
        cpu_count: cpus.ceil().max(1.0) as u32,
        memory_mb: memory >> 20,
        disk_size_mb: disk >> 20,
        metadata: record.map(|r| r.metadata).unwrap_or_default(),
        state: match info.state {
            SessionState::Running => "running",
            SessionState::Paused => "paused",
        },
    }
}

/// The size a sandbox is shown with: its session's, or (paused) its profile's as last known.
fn size_of(e2b: &E2b, info: &SessionInfo) -> (f64, u64, u64) {
    match e2b.st.sessions.by_id(&info.id) {
        Some(s) => s.size(),
        None => (
            info.limits.cpus.unwrap_or(1.0),
            info.limits.memory_mb.unwrap_or(0) << 20,
            info.limits.disk_mb.unwrap_or(0) << 20,
        ),
    }
}

async fn info(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Answer<Json<Detail>> {
    let (caller, as_rest) = caller(&e2b, &headers).await?;
    let rid = caller.known.request_id.clone();
    let info = match sessions::look_up(&e2b.st, &as_rest, rid, &id, Touch::Read).await? {
        (Looked::Live(s), ..) => s.describe(),
        (Looked::Paused(info), ..) => *info,
    };
    let size = size_of(&e2b, &info);
    Ok(Json(detail(&e2b, &info, size, true)))
}

/// The query of `GET /v2/sandboxes`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    /// `key=value&…`, URL-encoded: only sandboxes with all of these.
    #[serde(default)]
    metadata: Option<String>,
    /// `running`, `paused`, or both, comma-separated.
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    next_token: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

/// The most sandboxes one page lists.
const MAX_PAGE: usize = 1000;

async fn listed(
    e2b: &Arc<E2b>,
    headers: &HeaderMap,
    q: &ListQuery,
) -> Answer<(Vec<Detail>, Option<String>)> {
    let (owner, ..) = owner(e2b, headers).await?;
    let st = e2b.st.clone();
    let all = tokio::task::spawn_blocking(move || st.sessions.of_owner(&owner))
        .await
        .map_err(|e| E2bError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let wanted_meta: Vec<(String, String)> = match &q.metadata {
        Some(m) => form_urlencoded::parse(m.as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect(),
        None => Vec::new(),
    };
    let states: Option<Vec<String>> = q
        .state
        .as_ref()
        .map(|s| s.split(',').map(|x| x.trim().to_string()).collect());
    let limit = q.limit.unwrap_or(MAX_PAGE).clamp(1, MAX_PAGE);
    let mut page = Vec::new();
    let mut next = None;
    // Listed by creation, then id; a page's token is its last sandbox's place in that order.
    let after = q.next_token.as_deref().and_then(|t| t.split_once('|'));
    for info in all {
        if let Some((created, id)) = after
            && (info.created_at.as_str(), info.id.as_str()) <= (created, id)
        {
            continue;
        }
        let d = detail(e2b, &info, size_of(e2b, &info), false);
        if let Some(states) = &states
            && !states.iter().any(|s| s == d.state)
        {
            continue;
        }
        if !wanted_meta
            .iter()
            .all(|(k, v)| d.metadata.get(k) == Some(v))
        {
            continue;
        }
        if page.len() == limit {
            next = page
                .last()
                .map(|d: &Detail| format!("{}|{}", d.started_at, d.sandbox_id));
            break;
        }
        page.push(d);
    }
    Ok((page, next))
}

async fn list_v2(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Answer<Response> {
    let (page, next) = listed(&e2b, &headers, &q).await?;
    let mut resp = Json(page).into_response();
    if let Some(next) = next
        && let Ok(v) = HeaderValue::from_str(&next)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

async fn list_v1(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Answer<Response> {
    let q = ListQuery {
        state: Some("running".into()),
        limit: Some(MAX_PAGE),
        next_token: None,
        ..q
    };
    let (page, _) = listed(&e2b, &headers, &q).await?;
    Ok(Json(page).into_response())
}

async fn kill(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Answer<StatusCode> {
    let (owner, ..) = owner(&e2b, &headers).await?;
    sessions::delete(&e2b.st, &owner, &id).await?;
    e2b.sandboxes.forget(&id);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    /// Seconds from now.
    timeout: u64,
}

async fn set_timeout(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Answer<StatusCode> {
    let (owner, ..) = owner(&e2b, &headers).await?;
    let asked: TimeoutBody = json_body(&e2b, &headers, body).await?;
    e2b.st
        .sessions
        .set_ttl(&owner, &id, Duration::from_secs(asked.timeout))
        .await
        .map_err(ApiError::from)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/refreshes`: the SDK's keep-alive; a sandbox lives for its timeout.
async fn refresh(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Answer<StatusCode> {
    let (owner, ..) = owner(&e2b, &headers).await?;
    if e2b.st.sessions.get(&owner, &id).is_none() {
        return Err(ApiError::SessionNotFound.into());
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Answer<StatusCode> {
    let (owner, _, rid) = owner(&e2b, &headers).await?;
    if e2b.st.sessions.paused(&owner, &id).is_some() {
        return Err(E2bError(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    // A pause that began is finished even if its client goes away.
    let st = e2b.st.clone();
    tokio::spawn(async move { sessions::pause_owned(&st, &owner, rid, &id).await })
        .await
        .map_err(|e| E2bError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ConnectBody {
    /// Seconds from now the sandbox then lives.
    #[serde(default)]
    timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/connect` (and `/v2/…/connect`, `/resume`): a running sandbox is
/// answered as it is (200); a paused one is resumed (201). Either way its timeout is renewed
/// when the body names one.
async fn connect(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Answer<(StatusCode, Json<Sandbox>)> {
    let (owner, _, rid) = owner(&e2b, &headers).await?;
    let asked: ConnectBody = json_body(&e2b, &headers, body).await?;
    let was_paused = e2b.st.sessions.paused(&owner, &id).is_some();
    let st = e2b.st.clone();
    let (resumed_id, resumed_owner) = (id.clone(), owner.clone());
    tokio::spawn(
        async move { sessions::resume_owned(&st, &resumed_owner, rid, &resumed_id).await },
    )
    .await
    .map_err(|e| E2bError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    if let Some(t) = asked.timeout {
        e2b.st
            .sessions
            .set_ttl(&owner, &id, Duration::from_secs(t))
            .await
            .map_err(ApiError::from)?;
    }
    let template_id = e2b
        .sandboxes
        .get(&id)
        .map(|r| r.template_id)
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "base".into());
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(Sandbox {
            template_id,
            envd_access_token: e2b.sandboxes.access_token(&id),
            sandbox_id: id,
            client_id: CLIENT_ID,
            envd_version: ENVD_VERSION,
            domain: None,
        }),
    ))
}

/// One sample of a sandbox's use, as E2B reports it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Metric {
    timestamp: String,
    timestamp_unix: i64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

/// The time between the two readings a CPU share is measured over.
const CPU_SAMPLE: Duration = Duration::from_millis(200);

/// `GET /sandboxes/{id}/metrics`: one sample of the sandbox's use now, from its session's
/// cgroup (local: its runs' group; containers: the container's) and its workspace's
/// filesystem. A paused sandbox has none (`[]`).
async fn metrics(
    State(e2b): State<Arc<E2b>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Answer<Json<Vec<Metric>>> {
    let (owner, ..) = owner(&e2b, &headers).await?;
    let _sampling = e2b.metrics_calls.clone().try_acquire_owned().map_err(|_| {
        E2bError(
            StatusCode::TOO_MANY_REQUESTS,
            "metrics are being sampled for other calls: try again shortly".into(),
        )
    })?;
    let Some(session) = e2b.st.sessions.get(&owner, &id) else {
        if e2b.st.sessions.paused(&owner, &id).is_some() {
            return Ok(Json(vec![]));
        }
        return Err(ApiError::SessionNotFound.into());
    };
    let read = || {
        let (st, session) = (e2b.st.clone(), session.clone());
        async move {
            tokio::task::spawn_blocking(move || st.sessions.usage(&session))
                .await
                .map_err(|e| E2bError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
        }
    };
    let (first, t0) = (read().await?, std::time::Instant::now());
    tokio::time::sleep(CPU_SAMPLE).await;
    let ((usage, disk), wall) = (read().await?, t0.elapsed());
    let (cpus, memory, disk_total) = session.size();
    let used_ns = usage.cpu_ns.saturating_sub(first.0.cpu_ns) as f64;
    let pct = 100.0 * used_ns / (wall.as_nanos() as f64 * cpus.max(0.01));
    let now = chrono::Utc::now();
    Ok(Json(vec![Metric {
        timestamp: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        timestamp_unix: now.timestamp(),
        cpu_count: cpus.ceil().max(1.0) as u32,
        cpu_used_pct: (pct.clamp(0.0, 100.0) * 100.0).round() / 100.0,
        mem_used: usage.memory_bytes,
        mem_total: memory,
        mem_cache: usage.cache_bytes,
        disk_used: disk.unwrap_or(0),
        disk_total,
    }]))
}

async fn unsupported_templates() -> E2bError {
    E2bError(
        StatusCode::BAD_REQUEST,
        "templates are not supported by this E2B API: a templateID is one of e2b.templates".into(),
    )
}

async fn unsupported_volumes() -> E2bError {
    E2bError(
        StatusCode::BAD_REQUEST,
        "volumes are not supported by this E2B API".into(),
    )
}

async fn unsupported_snapshots() -> E2bError {
    E2bError(
        StatusCode::BAD_REQUEST,
        "snapshots are not supported by this E2B API (pause keeps a sandbox's files)".into(),
    )
}

async fn unknown() -> E2bError {
    E2bError(StatusCode::NOT_FOUND, "no such route in the E2B API".into())
}
