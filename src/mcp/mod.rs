//! `/mcp`: the Model Context Protocol over Streamable HTTP, served by the official Rust SDK
//! (`rmcp`): a front end beside the REST API, over the same services.
//!
//! Owns: the MCP wire (JSON-RPC, MCP sessions, the tool list and its JSON Schemas), admitting an
//! HTTP request to `/mcp` (the service token: 401 with `WWW-Authenticate`; `Host` and `Origin`
//! against `mcp.allowed_hosts` / `mcp.allowed_origins`: 403; an MCP session's id only from the
//! calling service that opened it: 404 for any other), and rendering each call's answer as a
//! tool result. Must not: decide, admit, run, audit or count anything itself. Every tool
//! goes through `calls`, as the REST routes do, to the execution and sessions services: the same
//! caller and grant checks, policy verdicts, audit lines, metrics and error bodies as its REST
//! twin. A call for a session or run that another replica holds is handed to that replica as its
//! REST twin (the peer call of `calls::forward`).
//!
//! # Files
//! - `mod.rs` (this file): the `/mcp` route, its admission, the SDK's HTTP configuration.
//! - `tools.rs`: the tools: their input schemas, their arguments, and each one's REST twin
//!   (the route a replica that holds its session or run is handed, and how its answer renders).
//! - `server.rs`: the MCP server: lists the tools, sends each call through `calls`, renders the
//!   answer (and a waited-for run's output as progress notifications).

mod server;
mod tools;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use sha2::Sha256;
use tokio_util::sync::CancellationToken;

use crate::calls::{AppState, RequestId};
use crate::config::Config;
use crate::execution::record::KnownRequest;

/// Where the MCP endpoint is mounted.
pub const PATH: &str = "/mcp";

/// The `/mcp` route (none when `mcp.enabled` is off), to be merged into the daemon's router.
/// Cancelling `shutdown` ends every MCP session and its open streams (a draining daemon must not
/// wait for them).
pub fn routes(state: &Arc<AppState>, shutdown: CancellationToken) -> Router<Arc<AppState>> {
    if !state.config.mcp.enabled {
        return Router::new();
    }
    let factory_st = state.clone();
    let service = StreamableHttpService::new(
        move || Ok(server::McpServer::new(factory_st.clone())),
        Arc::new(LocalSessionManager::default()),
        http_config(&state.config, shutdown),
    );
    Router::new()
        .route_service(PATH, service)
        .route_layer(axum::middleware::from_fn_with_state(
            (state.clone(), Arc::new(SessionSeal::new())),
            admit,
        ))
}

/// The header that carries an MCP session's id (2025 revisions).
const SESSION_ID: &str = "mcp-session-id";

/// Binds each MCP session to the calling service that opened it: the id a client is given is
/// the SDK's with a tag (HMAC-SHA256 of the service and the id, under a key of this process,
/// which holds the sessions) after a `.`. A request whose tag is not its own service's is
/// answered as one for an unknown session (404), so a service that learns another's session id
/// can neither end that session nor read or resume its streams (its calls' results).
struct SessionSeal {
    /// HMAC-SHA256's own key size (its block).
    key: [u8; 64],
}

impl SessionSeal {
    fn new() -> SessionSeal {
        SessionSeal {
            key: rand::random(),
        }
    }

    fn tag(&self, owner: &str, id: &str) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new(&self.key.into());
        // Lengths first: no (owner, id) pair hashes as another.
        mac.update(&(owner.len() as u64).to_be_bytes());
        mac.update(owner.as_bytes());
        mac.update(id.as_bytes());
        mac
    }

    /// The id the SDK gave a session `owner` opened, as its client is given it.
    fn seal(&self, owner: &str, id: &str) -> String {
        let tag = self.tag(owner, id).finalize().into_bytes();
        format!("{id}.{}", hex::encode(tag))
    }

    /// The SDK's id of the session `sealed` names, when `owner` opened it.
    fn open<'a>(&self, owner: &str, sealed: &'a str) -> Option<&'a str> {
        let (id, tag) = sealed.rsplit_once('.')?;
        let tag = hex::decode(tag).ok()?;
        self.tag(owner, id).verify_slice(&tag).ok()?;
        Some(id)
    }
}

/// The SDK's HTTP settings: stateful sessions for the clients of the 2025 revisions
/// (`Mcp-Session-Id`), stateless for the later ones; `Host` and `Origin` checks.
fn http_config(config: &Config, shutdown: CancellationToken) -> StreamableHttpServerConfig {
    let mut c = StreamableHttpServerConfig::default()
        .with_allowed_hosts(allowed_hosts(config))
        .with_allowed_origins(config.mcp.allowed_origins.clone())
        .enforce_origin_validation()
        .with_cancellation_token(shutdown)
        .with_max_request_body_bytes(config.server.body_limit_bytes);
    if config.mcp.allowed_hosts.is_empty() {
        c = c.disable_allowed_hosts();
    }
    c
}

/// `mcp.allowed_hosts`, with the host of `server.listen` when it is a specific address; empty
/// (any host) when the list is.
fn allowed_hosts(config: &Config) -> Vec<String> {
    let mut hosts = config.mcp.allowed_hosts.clone();
    if hosts.is_empty() {
        return hosts;
    }
    if let Ok(addr) = config.server.listen.parse::<std::net::SocketAddr>()
        && !addr.ip().is_unspecified()
    {
        let ip = addr.ip().to_string();
        if !hosts.contains(&ip) {
            hosts.push(ip);
        }
    }
    hosts
}

/// Admits a request to `/mcp`: its service token must verify (a refusal is the REST API's
/// audited 401, with `WWW-Authenticate: Bearer`). A single-use service token is used up by the
/// first tool call it makes, as by the first REST call. An MCP session's id is the calling
/// service's (see [`SessionSeal`]): another's is 404, as an unknown session is.
async fn admit(
    State((st, seal)): State<(Arc<AppState>, Arc<SessionSeal>)>,
    mut req: Request,
    next: Next,
) -> Response {
    let mut known = KnownRequest {
        request_id: req
            .extensions()
            .get::<RequestId>()
            .map(|r| r.0.clone())
            .unwrap_or_default(),
        ..KnownRequest::default()
    };
    match crate::calls::caller::service_token(&st, req.headers(), &mut known) {
        Ok(service) => {
            let owner = crate::execution::owner_of(service.subject.as_deref());
            if let Some(sealed) = req.headers().get(SESSION_ID) {
                let id = sealed
                    .to_str()
                    .ok()
                    .and_then(|s| seal.open(&owner, s))
                    .and_then(|id| HeaderValue::from_str(id).ok());
                match id {
                    Some(id) => {
                        req.headers_mut().insert(SESSION_ID, id);
                    }
                    None => {
                        return (StatusCode::NOT_FOUND, "Not Found: Session not found")
                            .into_response();
                    }
                }
            }
            let mut resp = next.run(req).await;
            let sealed = resp
                .headers()
                .get(SESSION_ID)
                .and_then(|id| id.to_str().ok())
                .and_then(|id| HeaderValue::from_str(&seal.seal(&owner, id)).ok());
            if let Some(sealed) = sealed {
                resp.headers_mut().insert(SESSION_ID, sealed);
            }
            resp
        }
        Err(e) => {
            let mut resp = e.into_response();
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(r#"Bearer realm="executor-arm""#),
            );
            resp
        }
    }
}

#[cfg(test)]
mod tests;
