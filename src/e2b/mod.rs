//! The E2B-compatible API: the official E2B SDKs drive executor-arm unchanged, with
//! `E2B_API_URL=http://<server.listen>/e2b`, `E2B_SANDBOX_URL=http://<e2b.envd_listen>` and a
//! service token as the API key. A front end beside the REST API and `/mcp`: an E2B sandbox is
//! a session, each command a background process of it, each call goes through `calls` to the
//! sessions and execution services.
//!
//! Owns: E2B's wire (its control plane's JSON and error body, the Connect protocol of envd's
//! data plane, envd's `/files`), the sandbox ↔ session mapping (template, metadata, envVars, the
//! data plane's access token, process pids). Must not: decide, admit, run, audit or count
//! anything itself; a command and a file operation are runs of the session, with the same
//! checks, audit lines and receipts as a REST exec.
//!
//! # Files
//! - `mod.rs` (this file): turning the API on, the two listeners' routes, the data plane's
//!   admission (a sandbox's id and access token), the caller its runs are made for, and the
//!   SDKs' paths as the sandbox sees them.
//! - `control.rs`: the control plane under `/e2b` (sandboxes: create, list, info, timeout,
//!   pause, connect, kill, metrics).
//! - `connect.rs`: the Connect protocol (JSON codec): unary and server-streaming calls.
//! - `process.rs`: `process.Process` (Start, Connect, List, SendInput, StreamInput, CloseStdin,
//!   SendSignal, Update).
//! - `pty.rs`: PTY processes: a session terminal each, kept until its run ends.
//! - `filesystem.rs`: `filesystem.Filesystem` (Stat, MakeDir, Move, ListDir, Remove) and
//!   `/files`.
//! - `sandboxes.rs`: what a sandbox adds to its session.
//! - `pb.rs`: the envd messages, generated from `proto/envd`.

mod connect;
mod control;
mod filesystem;
mod pb;
mod process;
mod pty;
mod sandboxes;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

use crate::calls::{AppState, RequestId};
use crate::sessions::Session;

use self::connect::{Code, RpcError};
use self::sandboxes::Sandboxes;

/// Where the control plane is mounted on the daemon's listener.
pub const PATH: &str = "/e2b";

/// The envd version the data plane reports: one the SDKs treat as current (stdin, signals and
/// the octet-stream upload are behind version checks).
pub const ENVD_VERSION: &str = "0.5.7";

/// The E2B API of one daemon: its state and the sandboxes it made.
pub struct E2b {
    st: Arc<AppState>,
    sandboxes: Sandboxes,
    /// Raised when the daemon drains: open process streams end.
    shutdown: CancellationToken,
    /// Metrics samples being taken (each reads cgroup files twice, 200 ms apart).
    metrics_calls: Arc<tokio::sync::Semaphore>,
}

/// Metrics samples taken at once; one more is 429.
const MAX_METRICS_CALLS: usize = 4;

/// What a multipart upload may add to its file's bytes: boundaries, part headers, paths.
const MULTIPART_FRAMING: usize = 1 << 20;

/// How often the records of sandboxes whose session is gone are forgotten.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

impl E2b {
    /// The E2B API, when `e2b.envd_listen` turns it on. Every template must name a session
    /// language whose interpreter is a POSIX shell: commands and file operations run as shell
    /// programs.
    pub fn new(
        st: &Arc<AppState>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Option<Arc<E2b>>> {
        if st.config.e2b.envd_listen.is_none() {
            return Ok(None);
        }
        for (name, t) in &st.config.e2b.templates {
            let interpreter = st
                .config
                .sessions
                .languages
                .get(&t.language)
                .map(|l| l.interpreter.clone())
                .ok_or_else(|| {
                    anyhow::anyhow!("e2b.templates.{name}: no session language '{}'", t.language)
                })?;
            let base = std::path::Path::new(&interpreter)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if !matches!(base.as_str(), "bash" | "sh" | "dash") {
                anyhow::bail!(
                    "e2b.templates.{name}: language '{}' runs {interpreter}, not a shell (bash or sh): E2B commands are shell programs",
                    t.language
                );
            }
        }
        let e2b = Arc::new(E2b {
            st: st.clone(),
            sandboxes: Sandboxes::default(),
            shutdown,
            metrics_calls: Arc::new(tokio::sync::Semaphore::new(MAX_METRICS_CALLS)),
        });
        let weak = Arc::downgrade(&e2b);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PRUNE_EVERY).await;
                let Some(e2b) = weak.upgrade() else { return };
                e2b.prune().await;
            }
        });
        Ok(Some(e2b))
    }

    /// Forgets the records of sandboxes whose session is gone (ended, expired, deleted through
    /// another front end, or paused past its keeping).
    async fn prune(&self) {
        let sessions = &self.st.sessions;
        // Held ones first: one paused while the store is read is then found in one or the other.
        let held: std::collections::HashSet<String> = self
            .sandboxes
            .ids()
            .into_iter()
            .filter(|id| sessions.holds(id))
            .collect();
        let st = self.st.clone();
        let Ok(paused) = tokio::task::spawn_blocking(move || st.sessions.paused_ids()).await else {
            return;
        };
        self.sandboxes
            .prune(|id| held.contains(id) || sessions.holds(id) || paused.contains(id));
    }

    /// The control plane's routes, to be merged into the daemon's router.
    pub fn control_routes(self: &Arc<Self>) -> Router<Arc<AppState>> {
        control::routes(self.clone())
    }

    /// The data plane's routes (for its own listener). Bodies are read by each route once its
    /// caller is known, within the daemon's limits.
    pub fn envd_routes(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/health", get(|| async { StatusCode::NO_CONTENT }))
            .route("/process.Process/{method}", post(process::call))
            .route("/filesystem.Filesystem/{method}", post(filesystem::call))
            .route("/files", get(filesystem::download).post(filesystem::upload))
            .fallback(|| async {
                RpcError::new(Code::NotFound, "no such route on the E2B data plane")
            })
            // What extractors that read a body themselves (a multipart upload's) may read: a
            // file and its framing. Every other route reads with `read_body`'s own limits.
            .layer(axum::extract::DefaultBodyLimit::max(
                self.st
                    .config
                    .sessions
                    .max_file_bytes
                    .max(self.st.config.server.body_limit_bytes)
                    .saturating_add(MULTIPART_FRAMING),
            ))
            .with_state(self.clone())
    }
}

/// Binds the data plane's listener (`e2b.envd_listen`).
pub async fn bind_envd(st: &AppState) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    let Some(listen) = &st.config.e2b.envd_listen else {
        return Ok(None);
    };
    let addr: SocketAddr = listen
        .parse()
        .map_err(|e| anyhow::anyhow!("e2b.envd_listen '{listen}': {e}"))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("bind e2b.envd_listen {addr}: {e}"))?;
    Ok(Some(listener))
}

/// Why a data plane call found no sandbox.
pub(crate) enum NoSandbox {
    /// No access token, or one that opens no sandbox (or not the one named): 401.
    Refused,
    /// The sandbox is not running (paused, ended, unknown): 502, as E2B's proxy answers it
    /// (the SDKs tell "not running" by it).
    NotRunning(String),
}

impl axum::response::IntoResponse for NoSandbox {
    fn into_response(self) -> axum::response::Response {
        match self {
            NoSandbox::Refused => RpcError::new(
                Code::Unauthenticated,
                "X-Access-Token must be a running sandbox's access token (and E2b-Sandbox-Id, when sent, its id)",
            )
            .into_response(),
            NoSandbox::NotRunning(id) => {
                let body = serde_json::json!({
                    "code": 502,
                    "message": format!("The sandbox {id} was not found (paused or ended: connect to a paused one to resume it)"),
                });
                (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
            }
        }
    }
}

/// A data plane call's sandbox: the running session whose access token `X-Access-Token` is
/// (and, when `E2b-Sandbox-Id` is sent, the one it names: older SDKs send only the token). Its
/// idle time starts again.
pub(crate) fn sandbox_of(e2b: &E2b, headers: &HeaderMap) -> Result<Arc<Session>, NoSandbox> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let token = header("x-access-token").ok_or(NoSandbox::Refused)?;
    let id = match header("e2b-sandbox-id") {
        Some(id) if e2b.sandboxes.token_opens(id, token) => id.to_string(),
        Some(_) => return Err(NoSandbox::Refused),
        None => e2b.sandboxes.opened_by(token).ok_or(NoSandbox::Refused)?,
    };
    let session = e2b
        .st
        .sessions
        .by_id(&id)
        .ok_or_else(|| NoSandbox::NotRunning(id.clone()))?;
    e2b.st
        .sessions
        .use_session(&session.owner, &id)
        .ok_or(NoSandbox::NotRunning(id))
}

/// A data plane call's sandbox and then its body (within `server.body_limit_bytes` and its
/// deadline), or the answer that refuses it.
pub(crate) async fn admit(
    e2b: &E2b,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<(Arc<Session>, axum::body::Bytes), axum::response::Response> {
    use axum::response::IntoResponse;
    let session = sandbox_of(e2b, headers).map_err(|no| no.into_response())?;
    let limit = crate::calls::caller::BodyLimit::request(&e2b.st);
    let body = crate::calls::caller::read_body(body, headers, limit)
        .await
        .map_err(|e| RpcError::from(e).into_response())?;
    Ok((session, body))
}

/// A path of the SDKs as the sandbox sees it: `/home/user` (the SDKs' home) is the workspace;
/// a relative path is under the workspace.
fn sandbox_path(path: &str) -> String {
    use crate::execution::WORKSPACE;
    let home = "/home/user";
    if path == home || path == "~" {
        return WORKSPACE.to_string();
    }
    if let Some(rest) = path.strip_prefix("/home/user/").or(path.strip_prefix("~/")) {
        return format!("{WORKSPACE}/{rest}");
    }
    if path.starts_with('/') {
        return path.to_string();
    }
    if path.is_empty() {
        return WORKSPACE.to_string();
    }
    format!("{WORKSPACE}/{path}")
}

/// The caller of a data plane run: the sandbox's owning service (the session's grant is what
/// the run is decided by).
fn caller_of(
    session: &Session,
    headers: &HeaderMap,
) -> (
    crate::auth::Verified,
    crate::execution::record::KnownRequest,
) {
    let service = crate::auth::Verified {
        subject: Some(session.owner.subject.clone()),
        token_id: None,
        single_use: None,
        grant: Default::default(),
    };
    let known = crate::execution::record::KnownRequest {
        request_id: request_id(headers),
        subject: Some(session.owner.subject.clone()),
        ..Default::default()
    };
    (service, known)
}

/// The request id of a data plane call (the daemon's listener assigns its own in a layer).
fn request_id(headers: &HeaderMap) -> String {
    RequestId::assign(headers).0
}
