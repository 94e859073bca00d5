//! The MCP server one MCP session (or one stateless request) talks to: it lists the tools, sends
//! each call to its REST twin in-process and renders the twin's answer as the tool's result.
//!
//! Owns: the tool result (`structuredContent` is the twin's JSON body, the text content the same
//! JSON; a twin's error status is `isError: true` with the REST error body), and the output of
//! a streamed run as progress notifications. Must not: authenticate, decide or run anything
//! (the twin's handler does, through the execution and sessions services).

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use base64::Engine as _;
use futures::StreamExt as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorCode,
    Implementation, ListToolsResult, PaginatedRequestParams, ProgressNotificationParam,
    ProgressToken, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Map, Value, json};
use tower::ServiceExt as _;

use super::tools::{self, NoTwin, Render, Twin};
use crate::api::caller::ServiceGrant;
use crate::api::error::ApiError;
use crate::api::{RequestId, VERSION};

/// Headers of the `/mcp` request that its tool calls' twins carry: who calls, for which tenant,
/// under which trace. The twin's request id is the `/mcp` request's (the caller's
/// `X-Request-ID`, or the one the daemon gave it).
const FORWARDED: [&str; 5] = [
    "authorization",
    "x-tenant-id",
    "x-koder-tenant",
    "traceparent",
    "tracestate",
];

/// The JSON-RPC code of a request its client cancelled (no MCP client reads it: a cancelled
/// request's answer is dropped).
const REQUEST_CANCELLED: i32 = -32800;

/// The server of one MCP session.
#[derive(Clone)]
pub(super) struct McpServer {
    /// The REST API's router: the twins' handlers.
    rest: Router,
}

impl McpServer {
    pub fn new(rest: Router) -> McpServer {
        McpServer { rest }
    }

    /// The call `twin` as the REST request it is twin of, for the caller of `headers`.
    fn request(
        twin: &Twin,
        outer: Option<&axum::http::request::Parts>,
    ) -> Result<Request<Body>, ApiError> {
        let mut req = Request::builder()
            .method(twin.method.clone())
            .uri(twin.uri.as_str());
        if let Some(outer) = outer {
            for name in FORWARDED {
                for v in outer.headers.get_all(name) {
                    req = req.header(name, v.clone());
                }
            }
            if let Some(RequestId(id)) = outer.extensions.get::<RequestId>()
                && let Ok(v) = HeaderValue::from_str(id)
            {
                req = req.header("x-request-id", v);
            }
        }
        let body = match &twin.body {
            tools::Body::None => Body::empty(),
            tools::Body::Json(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(v.to_string())
            }
            tools::Body::Bytes(b) => {
                req = req.header(header::CONTENT_TYPE, "application/octet-stream");
                Body::from(b.clone())
            }
        };
        let mut req = req
            .body(body)
            .map_err(|e| ApiError::InvalidRequest(format!("invalid tool call: {e}")))?;
        req.extensions_mut().insert(ServiceGrant);
        Ok(req)
    }

    /// The twin's answer, with the run's output sent as progress notifications when it was
    /// streamed: its status and body.
    async fn answer(
        &self,
        mut twin: Twin,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let parts = ctx.extensions.get::<axum::http::request::Parts>();
        let progress = ctx.meta.get_progress_token().filter(|_| twin.streams);
        twin.streams = progress.is_some();
        let mut req = Self::request(&twin, parts)?;
        if twin.streams {
            req.headers_mut().insert(
                header::ACCEPT,
                HeaderValue::from_static("text/event-stream"),
            );
        }
        let resp = match self.rest.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let is_stream = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        match progress {
            Some(token) if is_stream => follow(resp, token, ctx).await,
            _ => {
                let status = resp.status();
                let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
                    .await
                    .map_err(|e| ApiError::Internal(format!("reading the answer: {e}")))?;
                Ok((status, body))
            }
        }
    }
}

/// A streamed run's events: `stdout`/`stderr` chunks become progress notifications (progress:
/// the output's bytes so far), the `result` event is the answer (its `http_status` the status,
/// the rest the body the synchronous call answers).
async fn follow(
    resp: Response<Body>,
    token: ProgressToken,
    ctx: &RequestContext<RoleServer>,
) -> Result<(StatusCode, bytes::Bytes), ApiError> {
    let mut events = sse_stream::SseStream::new(resp.into_body());
    let mut sent: usize = 0;
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| ApiError::Internal(format!("reading the run: {e}")))?;
        let Some(data) = event.data else { continue };
        match event.event.as_deref() {
            Some(stream @ ("stdout" | "stderr")) => {
                let chunk: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                let text = match (chunk["data"].as_str(), chunk["data_b64"].as_str()) {
                    (Some(t), _) => t.to_string(),
                    (None, Some(b64)) => base64::engine::general_purpose::STANDARD
                        .decode(b64)
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default(),
                    (None, None) => continue,
                };
                sent += text.len();
                let message = if stream == "stderr" {
                    format!("[stderr] {text}")
                } else {
                    text
                };
                let mut param = ProgressNotificationParam::new(token.clone(), sent as f64);
                param.message = Some(message);
                // A client that went away misses its progress; the run's answer still comes.
                let _ = ctx.peer.notify_progress(param).await;
            }
            Some("result") => {
                let mut body: Map<String, Value> = serde_json::from_str(&data)
                    .map_err(|e| ApiError::Internal(format!("the run's result: {e}")))?;
                let status = body
                    .remove("http_status")
                    .and_then(|s| s.as_u64())
                    .and_then(|s| StatusCode::from_u16(s as u16).ok())
                    .unwrap_or(StatusCode::OK);
                let body = serde_json::to_vec(&body)
                    .map_err(|e| ApiError::Internal(format!("the run's result: {e}")))?;
                return Ok((status, body.into()));
            }
            _ => {}
        }
    }
    Err(ApiError::Internal(
        "the run's stream ended without a result".into(),
    ))
}

/// The tool result of a twin's answer.
pub(super) fn render(render: &Render, status: StatusCode, body: &[u8]) -> CallToolResult {
    if status.is_client_error() || status.is_server_error() {
        let v = serde_json::from_slice(body).unwrap_or_else(|_| {
            ApiError::Internal(format!("an unreadable {} answer", status.as_u16())).body()
        });
        return result(v, true);
    }
    let v = match render {
        Render::Json => serde_json::from_slice(body).unwrap_or_else(|_| json!({})),
        Render::Deleted { session_id } => json!({"session_id": session_id, "deleted": true}),
        Render::Written {
            session_id,
            path,
            size,
        } => json!({"session_id": session_id, "path": path, "size": size}),
        Render::File { session_id, path } => {
            let mut v = json!({"session_id": session_id, "path": path, "size": body.len()});
            match std::str::from_utf8(body) {
                Ok(text) => v["content"] = json!(text),
                Err(_) => {
                    v["content_b64"] = json!(base64::engine::general_purpose::STANDARD.encode(body))
                }
            }
            v
        }
    };
    result(v, false)
}

/// A tool result: `structured` as `structuredContent` and as its text.
fn result(structured: Value, is_error: bool) -> CallToolResult {
    let text = ContentBlock::text(structured.to_string());
    let mut r = if is_error {
        CallToolResult::error(vec![text])
    } else {
        CallToolResult::success(vec![text])
    };
    r.structured_content = Some(structured);
    r
}

/// The tool result of an error the call met before or around its twin.
fn error_result(e: ApiError) -> CallToolResult {
    if let ApiError::Internal(detail) = &e {
        tracing::error!(detail = %detail, "mcp tool call failed");
    }
    result(e.body(), true)
}

impl ServerHandler for McpServer {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build());
        info.server_info = Implementation::new("executor-arm", VERSION);
        info.instructions = Some(
            "Sandboxed command execution: `execute` runs an allowlisted command, sessions keep a \
             sandbox across execs, `run_*` start and follow runs. Results are the REST API's \
             bodies."
                .into(),
        );
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools::list()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let twin = match tools::twin(&request.name, args) {
            Ok(t) => t,
            Err(NoTwin::UnknownTool(name)) => {
                return Err(ErrorData::invalid_params(
                    format!("no tool named '{}'", name.escape_debug()),
                    None,
                ));
            }
            Err(NoTwin::Invalid(m)) => return Ok(error_result(ApiError::InvalidRequest(m)).into()),
        };
        let render_as = twin.render.clone();
        let answered = tokio::select! {
            answered = self.answer(twin, &ctx) => answered,
            // The client gave the call up (`notifications/cancelled`): the twin's request is
            // dropped, as a REST client that goes away, so its run is cancelled only when the
            // call said `cancel_on_disconnect`. The client reads no answer to it.
            () = ctx.ct.cancelled() => {
                return Err(ErrorData::new(
                    ErrorCode(REQUEST_CANCELLED),
                    "the client cancelled the call",
                    None,
                ));
            }
        };
        Ok(match answered {
            Ok((status, body)) => render(&render_as, status, &body),
            Err(e) => error_result(e),
        }
        .into())
    }
}
