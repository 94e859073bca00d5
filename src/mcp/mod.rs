//! `/mcp`: the Model Context Protocol over Streamable HTTP, served by the official Rust SDK
//! (`rmcp`): a front end beside the REST API, over the same services.
//!
//! Owns: the MCP wire (JSON-RPC, MCP sessions, the tool list and its JSON Schemas), admitting an
//! HTTP request to `/mcp` (the service token: 401 with `WWW-Authenticate`; `Host` and `Origin`
//! against `mcp.allowed_hosts` / `mcp.allowed_origins`: 403), and translating each tool call
//! into its REST twin and the twin's answer back into a tool result. Must not: authenticate a
//! call's grant, decide, admit, run, audit or count anything itself. Each tool call is handed,
//! in-process (no socket), to the REST handler of its twin (`POST /execute`, the session
//! routes, the run routes), which authenticates it and hands it to the execution or sessions
//! service; so an MCP call is the same run as its REST twin: the same checks, policy verdicts,
//! audit lines, metrics and error bodies.
//!
//! # Files
//! - `mod.rs` (this file): the `/mcp` route, its admission, the SDK's HTTP configuration.
//! - `tools.rs`: the ten tools: their input schemas and each one's REST twin.
//! - `server.rs`: the MCP server: lists the tools, sends a call to its twin, renders the answer
//!   (and a streamed run's output as progress and log notifications).

mod server;
mod tools;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use crate::api::{AppState, RequestId};
use crate::config::Config;
use crate::execution::record::KnownRequest;

/// Where the MCP endpoint is mounted.
pub const PATH: &str = "/mcp";

/// The `/mcp` route (none when `mcp.enabled` is off), to be merged into the daemon's router.
/// `rest` is the REST API's router: the tools' twins are served by it. Cancelling `shutdown`
/// ends every MCP session and its open streams (a draining daemon must not wait for them).
pub fn routes(
    state: &Arc<AppState>,
    rest: Router,
    shutdown: CancellationToken,
) -> Router<Arc<AppState>> {
    if !state.config.mcp.enabled {
        return Router::new();
    }
    let factory_rest = rest.clone();
    let service = StreamableHttpService::new(
        move || Ok(server::McpServer::new(factory_rest.clone())),
        Arc::new(LocalSessionManager::default()),
        http_config(&state.config, shutdown),
    );
    Router::new()
        .route_service(PATH, service)
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), admit))
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
/// first tool call it makes, as by the first REST call.
async fn admit(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let mut known = KnownRequest {
        request_id: req
            .extensions()
            .get::<RequestId>()
            .map(|r| r.0.clone())
            .unwrap_or_default(),
        ..KnownRequest::default()
    };
    match crate::api::caller::service_token(&st, req.headers(), &mut known) {
        Ok(_) => next.run(req).await,
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
