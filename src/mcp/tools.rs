//! The tools `/mcp` offers: their input schemas and arguments, and each one's REST twin (the
//! route and body a replica that holds the call's session or run is handed) with how its answer
//! becomes the tool's result.
//!
//! Owns: the tool names, descriptions and schemas, and reading a call's own arguments (a
//! session id, a path, file content). Must not: check what `calls` checks (the request's fields,
//! limits, grants).

use std::sync::Arc;

use axum::http::Method;
use base64::Engine as _;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use rmcp::handler::server::common::schema_for_type;
use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::calls::execute::ExecuteRequest;
use crate::calls::sessions::{CreateBody, ExecBody};

/// A session of the caller's (its `ses_…` id).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SessionArgs {
    /// The session's id (`ses_…`), as `session_create` answered it.
    pub session_id: String,
}

/// A file of a session's workspace.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct FileArgs {
    /// The session's id (`ses_…`).
    pub session_id: String,
    /// A path relative to the workspace (`/workspace`).
    pub path: String,
}

/// A file to write into a session's workspace: exactly one of `content` (UTF-8 text) and
/// `content_b64` (any bytes, base64).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct WriteArgs {
    /// The session's id (`ses_…`).
    pub session_id: String,
    /// A path relative to the workspace; missing directories are made.
    pub path: String,
    /// The file's content as text.
    #[serde(default)]
    pub content: Option<String>,
    /// The file's content as base64 (standard alphabet, padded).
    #[serde(default)]
    pub content_b64: Option<String>,
}

/// A directory of a session's workspace.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ListArgs {
    /// The session's id (`ses_…`).
    pub session_id: String,
    /// A directory relative to the workspace (empty or absent: the workspace).
    #[serde(default)]
    pub path: Option<String>,
}

/// A run: an `execute` run (`run_start`), or an exec of a session.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RunArgs {
    /// The run's `exec_id`.
    pub exec_id: String,
    /// The session, for an exec of a session (absent: a run of `execute` / `run_start`).
    #[serde(default)]
    pub session_id: Option<String>,
}

/// A run to cancel: SIGTERM to its processes, SIGKILL after the grace.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CancelArgs {
    /// The run's `exec_id`.
    pub exec_id: String,
    /// The session, for an exec of a session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Seconds between SIGTERM and SIGKILL (0-30, default 5).
    #[serde(default)]
    pub grace_seconds: Option<u64>,
}

/// Where a read of a process's output begins.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct OutputArgs {
    /// The session's id (`ses_…`).
    pub session_id: String,
    /// The process's id.
    pub process_id: String,
    /// Read stdout from this byte on (the `stdout.next` of the previous read; default 0).
    #[serde(default)]
    pub stdout_from: Option<usize>,
    /// Read stderr from this byte on (the `stderr.next` of the previous read; default 0).
    #[serde(default)]
    pub stderr_from: Option<usize>,
}

/// Bytes for a process's stdin: at most one of `data` (UTF-8 text) and `data_b64` (any bytes,
/// base64); `eof` closes its stdin after them.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct StdinArgs {
    /// The session's id (`ses_…`).
    pub session_id: String,
    /// The process's id.
    pub process_id: String,
    /// Text for its stdin.
    #[serde(default)]
    pub data: Option<String>,
    /// Bytes for its stdin, as base64 (standard alphabet, padded).
    #[serde(default)]
    pub data_b64: Option<String>,
    /// Close its stdin after these bytes.
    #[serde(default)]
    pub eof: bool,
}

/// A signal for a process.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SignalArgs {
    /// The session's id (`ses_…`).
    pub session_id: String,
    /// The process's id.
    pub process_id: String,
    /// `TERM`, `KILL`, `INT` or `HUP`. `KILL` ends every process it started; the others go to
    /// the process itself.
    pub signal: crate::sandbox::control::ProcessSignal,
}

impl StdinArgs {
    /// The bytes the call sends.
    pub fn bytes(&self) -> Result<Vec<u8>, NoTwin> {
        match (&self.data, &self.data_b64) {
            (Some(text), None) => Ok(text.clone().into_bytes()),
            (None, Some(b64)) => base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| {
                    NoTwin::Invalid(format!("invalid process_stdin arguments: data_b64: {e}"))
                }),
            (None, None) => Ok(Vec::new()),
            (Some(_), Some(_)) => Err(NoTwin::Invalid(
                "invalid process_stdin arguments: give at most one of data and data_b64".into(),
            )),
        }
    }
}

/// The tools, as `tools/list` gives them.
pub(super) fn list() -> Vec<Tool> {
    let tool = |name: &'static str, description: &'static str, schema: Arc<JsonObject>| {
        Tool::new(name, description, schema)
    };
    let read_only = |t: Tool| t.annotate(ToolAnnotations::new().read_only(true));
    vec![
        tool(
            "execute",
            "Run one allowlisted command or registered executor in a sandbox and wait for its \
             result: the fields and answer of POST /execute. The grant is `capability_token` when \
             given, else the service token's capabilities. With a progress token, its output \
             comes as progress and log notifications while it runs.",
            schema_for_type::<ExecuteRequest>(),
        ),
        tool(
            "session_create",
            "Create a kept sandbox session (POST /v1/sandbox/sessions) for the tenant of \
             X-Tenant-ID; the grant is `capability_token` when given, else the service token's \
             capabilities.",
            schema_for_type::<CreateBody>(),
        ),
        tool(
            "session_exec",
            "Run code in a session's language in its workspace (POST \
             /v1/sandbox/sessions/{id}/exec) and wait for the result. With a progress token, its \
             output comes as progress and log notifications while it runs. With \
             `\"background\": true` it starts a background process that outlives the call \
             (a dev server, a watcher) and answers its `process_id` at once: see the process_* \
             tools.",
            session_exec_schema(),
        ),
        tool(
            "session_delete",
            "End a session: kill a running exec, remove its sandbox and workspace (DELETE \
             /v1/sandbox/sessions/{id}).",
            schema_for_type::<SessionArgs>(),
        ),
        read_only(tool(
            "files_read",
            "Read a file of a session's workspace: `content` when it is UTF-8, else \
             `content_b64`.",
            schema_for_type::<FileArgs>(),
        )),
        tool(
            "files_write",
            "Write a file into a session's workspace (PUT /v1/sandbox/sessions/{id}/files/{path}) \
             from `content` (text) or `content_b64` (bytes).",
            schema_for_type::<WriteArgs>(),
        ),
        read_only(tool(
            "files_list",
            "List a directory of a session's workspace (GET /v1/sandbox/sessions/{id}/files).",
            schema_for_type::<ListArgs>(),
        )),
        tool(
            "run_start",
            "Start a run of POST /execute without waiting (its `async`): answers its `exec_id` \
             at once; read it with run_status, stop it with run_cancel.",
            schema_for_type::<ExecuteRequest>(),
        ),
        read_only(tool(
            "run_status",
            "A run's status and, once finished, its result (GET /v1/executions/{exec_id}, or a \
             session exec's with `session_id`).",
            schema_for_type::<RunArgs>(),
        )),
        tool(
            "run_cancel",
            "Cancel a run: SIGTERM, the grace, SIGKILL (POST /v1/executions/{exec_id}/cancel, or \
             a session exec's with `session_id`).",
            schema_for_type::<CancelArgs>(),
        ),
        tool(
            "session_pause",
            "Pause a session (POST /v1/sandbox/sessions/{id}/pause): its workspace is saved and \
             its sandbox and background processes end; any later exec or file call, or \
             session_resume, resumes it.",
            schema_for_type::<SessionArgs>(),
        ),
        tool(
            "session_resume",
            "Resume a paused session (POST /v1/sandbox/sessions/{id}/resume): a fresh sandbox \
             with its saved workspace.",
            schema_for_type::<SessionArgs>(),
        ),
        read_only(tool(
            "process_list",
            "A session's background processes, running and recently ended (GET \
             /v1/sandbox/sessions/{id}/processes).",
            schema_for_type::<SessionArgs>(),
        )),
        read_only(tool(
            "process_output",
            "What a background process has written, from the offsets given (GET \
             /v1/sandbox/sessions/{id}/processes/{process_id}/output): its state, exit code \
             once it ended, and `stdout` / `stderr` spans whose `next` is where the next read \
             goes on.",
            schema_for_type::<OutputArgs>(),
        )),
        tool(
            "process_stdin",
            "Write to a background process's stdin (POST \
             /v1/sandbox/sessions/{id}/processes/{process_id}/stdin): `data` (text) or `data_b64` \
             (bytes); `eof` closes it after them.",
            schema_for_type::<StdinArgs>(),
        ),
        tool(
            "process_signal",
            "Send TERM, KILL, INT or HUP to a background process (POST \
             /v1/sandbox/sessions/{id}/processes/{process_id}/signal).",
            schema_for_type::<SignalArgs>(),
        ),
    ]
}

/// `session_exec`'s schema: the session id beside the REST exec body's fields (whose schema
/// refuses other properties).
fn session_exec_schema() -> Arc<JsonObject> {
    let mut schema = (*schema_for_type::<ExecBody>()).clone();
    if let Some(Value::Object(props)) = schema.get_mut("properties") {
        let mut with_id = Map::new();
        with_id.insert(
            "session_id".into(),
            json!({"type": "string", "description": "The session's id (`ses_…`)."}),
        );
        with_id.extend(std::mem::take(props));
        *props = with_id;
    }
    let required = schema
        .entry("required")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(r) = required {
        r.insert(0, json!("session_id"));
    }
    Arc::new(schema)
}

/// How the twin's answer becomes the tool's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Render {
    /// The twin's JSON body is the structured result.
    Json,
    /// A 204 of `DELETE` a session: `{"session_id", "deleted": true}`.
    Deleted { session_id: String },
    /// A 204 of `PUT` a file: `{"session_id", "path", "size"}`.
    Written {
        session_id: String,
        path: String,
        size: usize,
    },
    /// A 204 of a process's stdin or signal: `{"session_id", "process_id", "sent": true}`.
    Sent {
        session_id: String,
        process_id: String,
    },
    /// A file's bytes: `{"session_id", "path", "size", "content" | "content_b64"}`.
    File { session_id: String, path: String },
}

/// The body of a twin's request.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Body {
    None,
    Json(Value),
    Bytes(Vec<u8>),
}

/// A tool call's REST twin.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Twin {
    pub method: Method,
    /// Path and query, encoded.
    pub uri: String,
    pub body: Body,
    pub render: Render,
    /// A run whose output may be streamed (`execute`, `session_exec`, when not `async`).
    pub streams: bool,
}

/// Why a call has no twin.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NoTwin {
    /// No tool has this name: a protocol error.
    UnknownTool(String),
    /// The call's own arguments are malformed: the tool's result is the REST 400 body.
    Invalid(String),
}

/// A path segment as it goes into a URI: everything but unreserved characters encoded.
const SEGMENT: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'/')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'&')
    .add(b'+')
    .add(b'=')
    .add(b';')
    .add(b'\\')
    .add(b'^')
    .add(b'|')
    .add(b'[')
    .add(b']');

fn seg(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// A workspace path as the file routes take it: each segment encoded, `/` kept.
fn file_path(p: &str) -> String {
    p.split('/').map(seg).collect::<Vec<_>>().join("/")
}

pub(super) fn args_of<T: serde::de::DeserializeOwned>(
    tool: &str,
    args: Map<String, Value>,
) -> Result<T, NoTwin> {
    // An empty id names nothing: refused here, so that no twin's path has an empty segment
    // (which would be another route, or none).
    for id in ["session_id", "process_id", "exec_id"] {
        if args.get(id).and_then(Value::as_str) == Some("") {
            return Err(NoTwin::Invalid(format!(
                "invalid {tool} arguments: {id} is empty"
            )));
        }
    }
    serde_json::from_value(Value::Object(args))
        .map_err(|e| NoTwin::Invalid(format!("invalid {tool} arguments: {e}")))
}

fn session_uri(id: &str) -> String {
    format!("/v1/sandbox/sessions/{}", seg(id))
}

/// The route `what` of the session's background process `process_id`.
fn process_uri(session_id: &str, process_id: &str, what: &str) -> String {
    format!(
        "{}/processes/{}/{what}",
        session_uri(session_id),
        seg(process_id)
    )
}

/// The run routes of `exec_id`: `/v1/executions/…`, or the session's `/execs/…`.
fn run_uri(exec_id: &str, session_id: Option<&str>) -> String {
    match session_id {
        Some(s) => format!("{}/execs/{}", session_uri(s), seg(exec_id)),
        None => format!("/v1/executions/{}", seg(exec_id)),
    }
}

/// Whether a body asks for an async run (`"async": true`).
fn asks_async(body: &Map<String, Value>) -> bool {
    body.get("async") == Some(&Value::Bool(true))
}

/// A call the client gives up cancels its run (with the default grace): a run that is waited
/// for (not async, not a background process) says `cancel_on_disconnect` unless the call
/// said otherwise.
pub(super) fn cancel_when_given_up(body: &mut Map<String, Value>) {
    if !asks_async(body) && body.get("background") != Some(&Value::Bool(true)) {
        body.entry("cancel_on_disconnect")
            .or_insert(Value::Bool(true));
    }
}

/// The REST twin of the call of `tool` with `args`.
pub(super) fn twin(tool: &str, args: Map<String, Value>) -> Result<Twin, NoTwin> {
    let json = |method: Method, uri: String, body: Body, streams: bool| Twin {
        method,
        uri,
        body,
        render: Render::Json,
        streams,
    };
    Ok(match tool {
        "session_create" => json(
            Method::POST,
            "/v1/sandbox/sessions".into(),
            Body::Json(args.into()),
            false,
        ),
        "session_exec" => {
            let mut body = args;
            let id = match body.remove("session_id") {
                Some(Value::String(id)) if !id.is_empty() => id,
                _ => {
                    return Err(NoTwin::Invalid(
                        "invalid session_exec arguments: session_id must be a non-empty string"
                            .into(),
                    ));
                }
            };
            let streams = !asks_async(&body);
            cancel_when_given_up(&mut body);
            json(
                Method::POST,
                format!("{}/exec", session_uri(&id)),
                Body::Json(body.into()),
                streams,
            )
        }
        "session_delete" => {
            let a: SessionArgs = args_of(tool, args)?;
            Twin {
                method: Method::DELETE,
                uri: session_uri(&a.session_id),
                body: Body::None,
                render: Render::Deleted {
                    session_id: a.session_id,
                },
                streams: false,
            }
        }
        "files_read" => {
            let a: FileArgs = args_of(tool, args)?;
            Twin {
                method: Method::GET,
                uri: format!(
                    "{}/files/{}",
                    session_uri(&a.session_id),
                    file_path(&a.path)
                ),
                body: Body::None,
                render: Render::File {
                    session_id: a.session_id,
                    path: a.path,
                },
                streams: false,
            }
        }
        "files_write" => {
            let a: WriteArgs = args_of(tool, args)?;
            let bytes = match (a.content, a.content_b64) {
                (Some(text), None) => text.into_bytes(),
                (None, Some(b64)) => base64::engine::general_purpose::STANDARD
                    .decode(b64.as_bytes())
                    .map_err(|e| {
                        NoTwin::Invalid(format!("invalid files_write arguments: content_b64: {e}"))
                    })?,
                _ => {
                    return Err(NoTwin::Invalid(
                        "invalid files_write arguments: give exactly one of content and \
                         content_b64"
                            .into(),
                    ));
                }
            };
            Twin {
                method: Method::PUT,
                uri: format!(
                    "{}/files/{}",
                    session_uri(&a.session_id),
                    file_path(&a.path)
                ),
                render: Render::Written {
                    session_id: a.session_id,
                    path: a.path,
                    size: bytes.len(),
                },
                body: Body::Bytes(bytes),
                streams: false,
            }
        }
        "files_list" => {
            let a: ListArgs = args_of(tool, args)?;
            let mut uri = format!("{}/files", session_uri(&a.session_id));
            if let Some(p) = a.path.filter(|p| !p.is_empty()) {
                uri.push_str("?path=");
                uri.push_str(&seg(&p));
            }
            json(Method::GET, uri, Body::None, false)
        }
        "session_pause" | "session_resume" => {
            let a: SessionArgs = args_of(tool, args)?;
            let verb = tool.trim_start_matches("session_");
            json(
                Method::POST,
                format!("{}/{verb}", session_uri(&a.session_id)),
                Body::None,
                false,
            )
        }
        "process_list" => {
            let a: SessionArgs = args_of(tool, args)?;
            json(
                Method::GET,
                format!("{}/processes", session_uri(&a.session_id)),
                Body::None,
                false,
            )
        }
        "process_output" => {
            let a: OutputArgs = args_of(tool, args)?;
            json(
                Method::GET,
                format!(
                    "{}?stdout_from={}&stderr_from={}",
                    process_uri(&a.session_id, &a.process_id, "output"),
                    a.stdout_from.unwrap_or(0),
                    a.stderr_from.unwrap_or(0)
                ),
                Body::None,
                false,
            )
        }
        "process_stdin" => {
            let a: StdinArgs = args_of(tool, args)?;
            let bytes = a.bytes()?;
            let mut uri = process_uri(&a.session_id, &a.process_id, "stdin");
            if a.eof {
                uri.push_str("?eof=true");
            }
            Twin {
                method: Method::POST,
                uri,
                body: Body::Bytes(bytes),
                render: Render::Sent {
                    session_id: a.session_id,
                    process_id: a.process_id,
                },
                streams: false,
            }
        }
        "process_signal" => {
            let a: SignalArgs = args_of(tool, args)?;
            Twin {
                method: Method::POST,
                uri: process_uri(&a.session_id, &a.process_id, "signal"),
                body: Body::Json(json!({ "signal": a.signal })),
                render: Render::Sent {
                    session_id: a.session_id,
                    process_id: a.process_id,
                },
                streams: false,
            }
        }
        "run_status" => {
            let a: RunArgs = args_of(tool, args)?;
            json(
                Method::GET,
                run_uri(&a.exec_id, a.session_id.as_deref()),
                Body::None,
                false,
            )
        }
        "run_cancel" => {
            let a: CancelArgs = args_of(tool, args)?;
            let body = match a.grace_seconds {
                Some(g) => Body::Json(json!({ "grace_seconds": g })),
                None => Body::None,
            };
            json(
                Method::POST,
                format!("{}/cancel", run_uri(&a.exec_id, a.session_id.as_deref())),
                body,
                false,
            )
        }
        other => return Err(NoTwin::UnknownTool(other.to_string())),
    })
}
