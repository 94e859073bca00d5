//! A call to a session's background processes, or to the stdin of a running exec, whichever
//! front end carries it (the `/processes` and `/execs/{exec_id}/stdin` routes of the REST API,
//! the `process_*` tools of `/mcp`): the list, what a process wrote, its stdin, its signals.
//!
//! Owns: finding the caller's running session for such a call (a paused one has no processes:
//! a pause ends them), and the session service's control errors as answers. Must not: read
//! HTTP beyond the headers that carry the caller, or run or signal anything itself (the sessions
//! service does).

use std::sync::Arc;

use axum::http::HeaderMap;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::AppState;
use super::error::ApiError;
use super::sessions::{Looked, Touch, look_up};
use crate::sandbox::control::{Control, ProcessSignal};
use crate::sessions::{ControlError, ProcessInfo, ProcessOutput, Session};

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::NotFound => ApiError::ProcessNotFound,
            ControlError::Ended => ApiError::ProcessEnded,
            ControlError::NotOpen => ApiError::StdinClosed,
            ControlError::StdinClosed => ApiError::ProcessStdinClosed,
            ControlError::Terminal => ApiError::InvalidRequest(
                "the process is a terminal: its input goes through the terminal (its WebSocket, or an E2B PTY's SendInput)".into(),
            ),
        }
    }
}

/// A session's background processes.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProcessList {
    /// Running ones and the last ended ones, oldest first.
    pub processes: Vec<ProcessInfo>,
}

/// The caller's session `id`'s background processes (none while it is paused: a pause ends
/// them).
pub async fn list(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
) -> Result<ProcessList, ApiError> {
    Ok(match look_up(st, headers, rid, id, Touch::Read).await? {
        (Looked::Live(s), ..) => ProcessList {
            processes: s.processes(),
        },
        (Looked::Paused(_), ..) => ProcessList { processes: vec![] },
    })
}

/// Whose controls a call sends: a background process's, or a running foreground exec's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlOf {
    Process,
    Exec,
}

/// The caller's session `id` for a call to one of its processes (or running execs): a paused
/// one has none (a pause ends them), so it is not resumed for this.
pub async fn live_session(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    of: ControlOf,
) -> Result<Arc<Session>, ApiError> {
    match look_up(st, headers, rid, id, Touch::Read).await? {
        (Looked::Live(s), ..) => Ok(s),
        (Looked::Paused(_), ..) => Err(match of {
            ControlOf::Process => ApiError::ProcessNotFound,
            ControlOf::Exec => ApiError::ProcessEnded,
        }),
    }
}

/// `bytes` for the stdin of `target` (a process, or a running exec, of `session`), in order with
/// earlier calls; `eof` closes it after them. An empty call still answers 404 for an unknown
/// target and 409 for an ended one.
pub async fn send_stdin(
    st: &AppState,
    session: &Session,
    target: &str,
    of: ControlOf,
    bytes: Vec<u8>,
    eof: bool,
) -> Result<(), ApiError> {
    let mut controls = Vec::new();
    if !bytes.is_empty() {
        controls.push(Control::Stdin(bytes));
    }
    if eof {
        controls.push(Control::CloseStdin);
    }
    if controls.is_empty() {
        controls.push(Control::Stdin(Vec::new()));
    }
    for c in controls {
        match of {
            ControlOf::Process => st.sessions.control_process(session, target, c).await?,
            ControlOf::Exec => st.sessions.control_exec(session, target, c).await?,
        }
    }
    Ok(())
}

/// The body of `POST …/processes/{process_id}/signal`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    /// `TERM`, `KILL`, `INT` or `HUP`. `KILL` ends every process the background process
    /// started; the others go to the process itself.
    pub signal: ProcessSignal,
}

/// `signal` to `session`'s background process `process_id`.
pub async fn signal(
    st: &AppState,
    session: &Session,
    process_id: &str,
    signal: ProcessSignal,
) -> Result<(), ApiError> {
    Ok(st
        .sessions
        .control_process(session, process_id, Control::Signal(signal))
        .await?)
}

/// The most of each stream one read of a process's output gives.
pub const MAX_OUTPUT_READ: usize = 256 * 1024;

/// Where a read of a process's output begins (byte offsets of each stream, default 0).
#[derive(Debug, Default, Clone, Copy, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// Read stdout from this byte on (the `next` of the previous read).
    #[serde(default)]
    pub stdout_from: usize,
    /// Read stderr from this byte on.
    #[serde(default)]
    pub stderr_from: usize,
}

/// What `session`'s background process `process_id` has written from `at` on (at most
/// [`MAX_OUTPUT_READ`] bytes of each stream), with its state.
pub fn output(
    session: &Session,
    process_id: &str,
    at: OutputQuery,
) -> Result<ProcessOutput, ApiError> {
    session
        .process_output(process_id, at.stdout_from, at.stderr_from, MAX_OUTPUT_READ)
        .ok_or(ApiError::ProcessNotFound)
}
