//! The MCP server one MCP session (or one stateless request) talks to: it lists the tools, sends
//! each call through `calls` (as the REST routes do) and renders its answer as the tool's result.
//!
//! Owns: the tool result (`structuredContent` is the REST answer's JSON body, the text content
//! the same JSON; an error status is `isError: true` with the REST error body), and the output
//! of a waited-for run as progress notifications. Must not: decide or run anything (`calls` and
//! the execution and sessions services do).

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode, header};
use base64::Engine as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorCode,
    Implementation, ListToolsResult, PaginatedRequestParams, ProgressNotificationParam,
    ProgressToken, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Map, Value, json};

use super::tools::{self, NoTwin, Render, Twin};
use crate::calls::caller::Caller;
use crate::calls::error::ApiError;
use crate::calls::execute::{ExecuteAsk, ExecuteRequest};
use crate::calls::executions::{self, Cancelled};
use crate::calls::forward::{Call, forward_within};
use crate::calls::processes::{self, ControlOf, OutputQuery, live_session};
use crate::calls::run::detach;
use crate::calls::run::{AskedTimeout, ClientLink, OpenStream, RunMode, Served, timeout_of};
use crate::calls::sessions::{
    self, CreateBody, ExecBody, FORWARDED_ANSWER_TIMEOUT, Touch, file_permit, held_elsewhere,
    session_exec, session_of,
};
use crate::calls::{AppState, RequestId, VERSION};
use crate::execution::runs::LiveRun;
use crate::sandbox::StreamKind;

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

/// How long a replica that runs a call's run may take to begin its answer to a cancel (a
/// session's calls wait as the REST routes do: [`FORWARDED_ANSWER_TIMEOUT`]).
const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The most output one progress notification carries.
const MAX_CHUNK: usize = 64 * 1024;

/// The server of one MCP session.
#[derive(Clone)]
pub(super) struct McpServer {
    /// The daemon's services: every call goes through `calls` to them.
    st: Arc<AppState>,
}

impl McpServer {
    pub fn new(st: Arc<AppState>) -> McpServer {
        McpServer { st }
    }

    /// `execute` (and `run_start`, `run_async`): `/execute`'s request for the caller of the
    /// `/mcp` request, with its checks and run through `calls` as the REST route's: the answer's
    /// status and body are the REST answer's. With a progress token a waited-for run's output is
    /// sent as progress notifications while it runs. A run waited for says
    /// `cancel_on_disconnect` unless the call said otherwise: a call the client gives up (the
    /// call's future dropped) cancels it with the default grace.
    async fn execute(
        &self,
        args: Map<String, Value>,
        run_async: bool,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let answered = self.execute_inner(args, run_async, ctx).await;
        if let Err(e) = &answered {
            crate::calls::execute::count_refusal(&self.st, e);
        }
        answered
    }

    /// `run_status` and `run_cancel`: a run's status or its cancel through `calls`, as the REST
    /// routes give them; a session exec's session is looked up first (the caller's, for its
    /// tenant), and one another replica holds has the call's REST twin handed to that replica.
    async fn run_tool(
        &self,
        tool: &str,
        args: Map<String, Value>,
        twin: &Twin,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let st = &self.st;
        let (parts, request_id) = call_of(ctx)?;
        let (exec_id, session_id, grace_seconds) = if tool == "run_cancel" {
            let a: tools::CancelArgs = tools::args_of(tool, args).map_err(no_twin)?;
            (a.exec_id, a.session_id, Some(a.grace_seconds))
        } else {
            let a: tools::RunArgs = tools::args_of(tool, args).map_err(no_twin)?;
            (a.exec_id, a.session_id, None)
        };
        let (owner, known) = match &session_id {
            None => {
                let caller = Caller::authenticate(st, &parts.headers, request_id).await?;
                (caller.owner(), caller.known)
            }
            Some(id) => {
                if let Some(address) = held_elsewhere(st, id, false).await? {
                    return self.forward_session(id, &address, twin, parts).await;
                }
                session_exec(st, &parts.headers, request_id, id, &exec_id).await?
            }
        };
        let Some(grace_seconds) = grace_seconds else {
            let body = executions::status(st, &exec_id, &owner).await?;
            return Ok((StatusCode::OK, body.into()));
        };
        let asked = grace_seconds.map(|g| i64::try_from(g).unwrap_or(i64::MAX));
        let grace = executions::grace(asked)?;
        match executions::cancel(st, &exec_id, &owner, &known.request_id, grace, false).await? {
            Cancelled::Accepted(body) => Ok((StatusCode::ACCEPTED, body.into())),
            Cancelled::Elsewhere(address) => {
                self.forward_twin(&address, twin, parts, FORWARD_TIMEOUT)
                    .await
            }
        }
    }

    /// The call's REST twin for the session `id`, handed to the replica at `address` that holds
    /// it (as the REST routes of a session are): a synchronous exec's answer may take as long as
    /// its run, and a replica that cannot be asked is answered exactly like an unknown session,
    /// whoever calls (where the session lives goes to the log only).
    async fn forward_session(
        &self,
        id: &str,
        address: &str,
        twin: &Twin,
        parts: &axum::http::request::Parts,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        match self
            .forward_twin(address, twin, parts, FORWARDED_ANSWER_TIMEOUT)
            .await
        {
            Err(ApiError::SandboxUnavailable(why)) => {
                tracing::warn!(session_id = %id, %address, %why, "session's replica cannot be reached: answered as unknown");
                Err(ApiError::SessionNotFound)
            }
            other => other,
        }
    }

    /// The call's REST twin handed to the replica at `address` (which holds its run or
    /// session), with the `/mcp` request's credentials, its answer begun within
    /// `answer_timeout`: its answer's status and body.
    async fn forward_twin(
        &self,
        address: &str,
        twin: &Twin,
        parts: &axum::http::request::Parts,
        answer_timeout: std::time::Duration,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let req = Self::request(twin, Some(parts))?;
        let (req_parts, body) = req.into_parts();
        let body = axum::body::to_bytes(body, usize::MAX)
            .await
            .map_err(|e| ApiError::Internal(format!("the call's body: {e}")))?;
        let call = Call {
            method: req_parts.method.clone(),
            path: &twin.uri,
            headers: &req_parts.headers,
            body,
        };
        let resp = forward_within(address, &self.st.instance_id, call, answer_timeout).await?;
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .map_err(|e| ApiError::Internal(format!("reading the replica's answer: {e}")))?;
        Ok((status, body))
    }

    /// The session and file tools: each through `calls` as its REST route (the caller's
    /// session, the same checks, answers and audit lines); a session another replica holds has
    /// the call's REST twin handed to that replica. The answer is the REST answer's status and
    /// body, with `twin`'s rendering.
    async fn session_tool(
        &self,
        tool: &str,
        args: Map<String, Value>,
        twin: &Twin,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let st = &self.st;
        let (parts, request_id) = call_of(ctx)?;
        let headers = &parts.headers;
        if let Some(id) = args.get("session_id").and_then(Value::as_str)
            && let Some(address) = held_elsewhere(st, id, false).await?
        {
            return self.forward_session(id, &address, twin, parts).await;
        }
        match tool {
            "session_create" => {
                if st.is_draining() {
                    return Err(ApiError::ShuttingDown);
                }
                let caller = Caller::authenticate(st, headers, request_id).await?;
                caller.session_owner(headers)?;
                let asked: CreateBody =
                    serde_json::from_value(Value::Object(args)).map_err(|e| {
                        ApiError::InvalidRequest(format!("invalid session request: {e}"))
                    })?;
                // Made whole even if the client gives the call up meanwhile.
                let (task_st, task_headers) = (st.clone(), headers.clone());
                let session = detach(async move {
                    sessions::create(&task_st, caller, &task_headers, asked, true).await
                })
                .await??;
                json_answer(StatusCode::CREATED, &session.describe())
            }
            "session_exec" => self.session_exec(args, ctx).await,
            "session_delete" => {
                let a: tools::SessionArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let (owner, ..) = sessions::caller(st, headers, request_id).await?;
                let task_st = st.clone();
                detach(async move { sessions::delete(&task_st, &owner, &a.session_id).await })
                    .await??;
                Ok((StatusCode::NO_CONTENT, bytes::Bytes::new()))
            }
            "files_write" => {
                let tools::Body::Bytes(bytes) = &twin.body else {
                    return Err(ApiError::Internal("files_write without bytes".into()));
                };
                let a: tools::WriteArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let (session, _, known) =
                    session_of(st, headers, request_id, &a.session_id, Touch::Use).await?;
                let permit = file_permit(st)?;
                let (task_st, bytes) = (st.clone(), bytes.clone());
                detach(async move {
                    let _held = permit;
                    sessions::upload(&task_st, &session, known.request_id, &a.path, bytes).await
                })
                .await??;
                Ok((StatusCode::NO_CONTENT, bytes::Bytes::new()))
            }
            "files_read" => {
                let a: tools::FileArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let (session, ..) =
                    session_of(st, headers, request_id, &a.session_id, Touch::Use).await?;
                let _permit = file_permit(st)?;
                let bytes = sessions::read_file(st, &session, &a.path).await?;
                Ok((StatusCode::OK, bytes.into()))
            }
            "files_list" => {
                let a: tools::ListArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let (session, ..) =
                    session_of(st, headers, request_id, &a.session_id, Touch::Use).await?;
                // A listing is held whole in memory like a file: it takes a transfer's place.
                let _permit = file_permit(st)?;
                let list = sessions::list(&session, a.path.unwrap_or_default()).await?;
                json_answer(StatusCode::OK, &list)
            }
            "session_pause" | "session_resume" => {
                let a: tools::SessionArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let (task_st, task_headers) = (st.clone(), headers.clone());
                let pause = tool == "session_pause";
                // On a task of its own: a pause or resume that began is finished even if the
                // client gives the call up.
                let info = detach(async move {
                    let id = &a.session_id;
                    if pause {
                        sessions::pause(&task_st, &task_headers, request_id, id).await
                    } else {
                        sessions::resume(&task_st, &task_headers, request_id, id).await
                    }
                })
                .await??;
                json_answer(StatusCode::OK, &info)
            }
            "process_list" => {
                let a: tools::SessionArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let list = processes::list(st, headers, request_id, &a.session_id).await?;
                json_answer(StatusCode::OK, &list)
            }
            "process_output" => {
                let a: tools::OutputArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let session =
                    live_session(st, headers, request_id, &a.session_id, ControlOf::Process)
                        .await?;
                let at = OutputQuery {
                    stdout_from: a.stdout_from.unwrap_or(0),
                    stderr_from: a.stderr_from.unwrap_or(0),
                };
                json_answer(
                    StatusCode::OK,
                    &processes::output(&session, &a.process_id, at)?,
                )
            }
            "process_stdin" => {
                let a: tools::StdinArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let bytes = a.bytes().map_err(no_twin)?;
                let session =
                    live_session(st, headers, request_id, &a.session_id, ControlOf::Process)
                        .await?;
                processes::send_stdin(
                    st,
                    &session,
                    &a.process_id,
                    ControlOf::Process,
                    bytes,
                    a.eof,
                )
                .await?;
                Ok((StatusCode::NO_CONTENT, bytes::Bytes::new()))
            }
            "process_signal" => {
                let a: tools::SignalArgs = tools::args_of(tool, args).map_err(no_twin)?;
                let session =
                    live_session(st, headers, request_id, &a.session_id, ControlOf::Process)
                        .await?;
                processes::signal(st, &session, &a.process_id, a.signal).await?;
                Ok((StatusCode::NO_CONTENT, bytes::Bytes::new()))
            }
            other => Err(ApiError::Internal(format!("no session tool named {other}"))),
        }
    }

    /// `session_exec`: the exec through `calls` as the REST route's; with a progress token a
    /// waited-for exec's output is sent as progress notifications; a waited-for exec says
    /// `cancel_on_disconnect` unless the call said otherwise.
    async fn session_exec(
        &self,
        mut args: Map<String, Value>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let st = &self.st;
        if st.is_draining() {
            return Err(ApiError::ShuttingDown);
        }
        let (parts, request_id) = call_of(ctx)?;
        let id = match args.remove("session_id") {
            Some(Value::String(id)) => id,
            _ => {
                return Err(ApiError::InvalidRequest(
                    "invalid session_exec arguments: session_id must be a string".into(),
                ));
            }
        };
        let (session, service, known) =
            session_of(st, &parts.headers, request_id, &id, Touch::Use).await?;
        tools::cancel_when_given_up(&mut args);
        let asked: ExecBody = serde_json::from_value(Value::Object(args))
            .map_err(|e| ApiError::InvalidRequest(format!("invalid exec request: {e}")))?;
        let progress = ctx
            .meta
            .get_progress_token()
            .filter(|_| !asked.run_async && !asked.background);
        let mode = mode_of(asked.run_async, progress.is_some());
        let timeout = timeout_of(mode, AskedTimeout::Millis(asked.timeout_ms))?;
        let job = sessions::exec_job(
            session,
            &service,
            &known,
            asked,
            sessions::ExecAsk {
                mode,
                timeout,
                idempotency_key: None,
                via: Some("mcp"),
            },
        )?;
        let served = detached(
            st,
            |st, client| async move { job.serve(&st, &client).await },
        )
        .await?;
        self.answer_served(served, progress, ctx).await
    }

    /// What `calls::run` served, as the call's answer: a stored answer, or a live run followed
    /// to its answer with its output as progress notifications.
    async fn answer_served(
        &self,
        served: Served,
        progress: Option<ProgressToken>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        match (served, progress) {
            (Served::Answer { answer, .. }, _) => Ok((
                StatusCode::from_u16(answer.status).unwrap_or(StatusCode::OK),
                answer.body.into(),
            )),
            (
                Served::Stream {
                    live,
                    permit,
                    cancel,
                },
                Some(token),
            ) => follow_live(live, OpenStream::new(permit, cancel), token, ctx).await,
            (Served::Stream { .. }, None) => Err(ApiError::Internal(
                "a streamed run without a progress token".into(),
            )),
        }
    }

    async fn execute_inner(
        &self,
        args: Map<String, Value>,
        run_async: bool,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(StatusCode, bytes::Bytes), ApiError> {
        let st = &self.st;
        if st.is_draining() {
            return Err(ApiError::ShuttingDown);
        }
        let (parts, request_id) = call_of(ctx)?;
        let mut caller = Caller::authenticate(st, &parts.headers, request_id).await?;
        let says_cancel = args.contains_key("cancel_on_disconnect");
        let mut req: ExecuteRequest = serde_json::from_value(Value::Object(args))
            .map_err(|e| ApiError::InvalidRequest(format!("invalid request: {e}")))?;
        req.run_async |= run_async;
        if !req.run_async && !says_cancel {
            req.cancel_on_disconnect = true;
        }
        let progress = ctx.meta.get_progress_token().filter(|_| !req.run_async);
        let mode = mode_of(req.run_async, progress.is_some());
        let timeout = timeout_of(mode, AskedTimeout::Seconds(req.timeout_seconds))?;
        let job = crate::calls::execute::job(
            &mut caller,
            st,
            req,
            ExecuteAsk {
                headers: &parts.headers,
                mode,
                timeout,
                service_grant: true,
                idempotency_key: None,
                via: Some("mcp"),
            },
        )?;
        let served = detached(
            st,
            |st, client| async move { job.serve(&st, &client).await },
        )
        .await?;
        self.answer_served(served, progress, ctx).await
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
        req.body(body)
            .map_err(|e| ApiError::InvalidRequest(format!("invalid tool call: {e}")))
    }
}

/// The `/mcp` HTTP request a tool call came in, and its request id (the caller's
/// `X-Request-ID`, or the one the daemon gave it).
fn call_of(
    ctx: &RequestContext<RoleServer>,
) -> Result<(&axum::http::request::Parts, String), ApiError> {
    let parts = ctx
        .extensions
        .get::<axum::http::request::Parts>()
        .ok_or_else(|| ApiError::Internal("the /mcp request is not known".into()))?;
    let request_id = parts
        .extensions
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    Ok((parts, request_id))
}

/// How a call's run is waited for: async when it asked, streamed as progress when the call
/// carries a progress token, else synchronously.
fn mode_of(run_async: bool, progress: bool) -> RunMode {
    match (run_async, progress) {
        (true, _) => RunMode::Async,
        (false, true) => RunMode::Stream,
        (false, false) => RunMode::Sync,
    }
}

/// What `serve` serves, on a task of its own for a client link: a call dropped meanwhile (the
/// client gave it up) cancels the run it waits for when that run says `cancel_on_disconnect`.
async fn detached<F, Fut>(st: &Arc<AppState>, serve: F) -> Result<Served, ApiError>
where
    F: FnOnce(Arc<AppState>, Arc<ClientLink>) -> Fut,
    Fut: std::future::Future<Output = Result<Served, ApiError>> + Send + 'static,
{
    let client = ClientLink::new();
    let task = serve(st.clone(), client.clone());
    client.serve(st, task).await?
}

/// `v` as an answer's JSON body.
fn json_answer<T: serde::Serialize>(
    status: StatusCode,
    v: &T,
) -> Result<(StatusCode, bytes::Bytes), ApiError> {
    serde_json::to_vec(v)
        .map(|b| (status, b.into()))
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// A call's malformed arguments: the REST 400 body.
fn no_twin(e: NoTwin) -> ApiError {
    match e {
        NoTwin::Invalid(m) | NoTwin::UnknownTool(m) => ApiError::InvalidRequest(m),
    }
}

/// A live run's output as progress notifications (progress: the output's bytes so far; the
/// message: the text, `[stderr] ` before stderr's) until its answer, which is the call's.
/// Dropped before the answer (the client gave the call up), `open` cancels the run when the
/// request asked for that.
async fn follow_live(
    live: Arc<LiveRun>,
    mut open: OpenStream,
    token: ProgressToken,
    ctx: &RequestContext<RoleServer>,
) -> Result<(StatusCode, bytes::Bytes), ApiError> {
    let mut changes = live.changes();
    let mut at = [0usize; 2];
    let mut sent: usize = 0;
    loop {
        // Read before the output: once the run has its answer all of its output is in.
        let answered = live.answered();
        for kind in [StreamKind::Stdout, StreamKind::Stderr] {
            loop {
                let (from, bytes) = live.output_from(kind, at[kind as usize], MAX_CHUNK);
                if bytes.is_empty() {
                    break;
                }
                at[kind as usize] = from + bytes.len();
                sent += bytes.len();
                let text = String::from_utf8_lossy(&bytes);
                let message = match kind {
                    StreamKind::Stderr => format!("[stderr] {text}"),
                    StreamKind::Stdout => text.into_owned(),
                };
                let mut param = ProgressNotificationParam::new(token.clone(), sent as f64);
                param.message = Some(message);
                // A client that went away misses its progress; the run's answer still comes.
                let _ = ctx.peer.notify_progress(param).await;
            }
        }
        if let Some(a) = answered {
            open.delivered();
            return Ok((
                StatusCode::from_u16(a.status).unwrap_or(StatusCode::OK),
                a.body.clone().into(),
            ));
        }
        if changes.changed().await.is_err() && live.answered().is_none() {
            return Err(ApiError::Internal("the run ended without an answer".into()));
        }
    }
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
        Render::Sent {
            session_id,
            process_id,
        } => json!({"session_id": session_id, "process_id": process_id, "sent": true}),
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
        let name: &str = request.name.as_ref();
        // Every tool but the two of `/execute` has a REST twin: the route a call goes to on the
        // replica that holds its session or run, and how its answer is rendered.
        let twin = match name {
            "execute" | "run_start" => None,
            _ => match tools::twin(name, args.clone()) {
                Ok(t) => Some(t),
                Err(NoTwin::UnknownTool(name)) => {
                    return Err(ErrorData::invalid_params(
                        format!("no tool named '{}'", name.escape_debug()),
                        None,
                    ));
                }
                Err(NoTwin::Invalid(m)) => {
                    return Ok(error_result(ApiError::InvalidRequest(m)).into());
                }
            },
        };
        let render_as = twin.as_ref().map_or(Render::Json, |t| t.render.clone());
        let call = async {
            match (name, &twin) {
                ("execute", _) => self.execute(args, false, &ctx).await,
                ("run_start", _) => self.execute(args, true, &ctx).await,
                ("run_status" | "run_cancel", Some(twin)) => {
                    self.run_tool(name, args, twin, &ctx).await
                }
                (_, Some(twin)) => self.session_tool(name, args, twin, &ctx).await,
                (other, None) => Err(ApiError::Internal(format!("no route for tool {other}"))),
            }
        };
        let answered = tokio::select! {
            answered = call => answered,
            // The client gave the call up (`notifications/cancelled`, or its stream closed):
            // the call's future is dropped, which cancels a run it waits for (a waited-for run
            // says `cancel_on_disconnect` unless the call said otherwise) with the default
            // grace. The client reads no answer to it.
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
