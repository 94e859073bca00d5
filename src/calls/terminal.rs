//! A session's terminal, whichever front end opens it (the REST API's WebSocket, the E2B data
//! plane's PTY processes): its admission (a place among the session's processes, a run slot)
//! and its start.
//!
//! Owns: the exec parts of a terminal for its caller. Must not: carry its bytes (the front ends
//! relay them through the sessions service's [`Terminal`]) or run anything itself (the
//! execution service does).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::StatusCode;

use super::AppState;
use super::error::ApiError;
use crate::auth::Verified;
use crate::execution::record::KnownRequest;
use crate::execution::{Execution, TerminalCommand};
use crate::sessions::{ExecParts, PreparedTerminal, Session, Terminal};

/// What a caller asks of a terminal beyond its command.
#[derive(Debug, Default)]
pub struct TerminalAsk {
    /// The front end it came through when it was not the REST API.
    pub via: Option<&'static str>,
    /// Variables for the terminal's environment (the profile's filter decides, as for an exec).
    pub env: BTreeMap<String, String>,
    /// Its deadline; none: the profile's async maximum.
    pub timeout_ms: Option<u64>,
    pub command: TerminalCommand,
}

/// A terminal admitted to run: its place among its session's processes and its run slot are
/// held until [`AdmittedTerminal::start`] (or given back when it is dropped).
pub struct AdmittedTerminal {
    execution: Execution,
    prepared: PreparedTerminal,
}

/// Admits a terminal of `session` for `service` (429 past `sessions.max_processes` or without
/// a run slot; what the session's grant and profile refuse, as for an exec).
pub async fn admit(
    st: &AppState,
    session: &Arc<Session>,
    service: &Verified,
    known: &KnownRequest,
    ask: TerminalAsk,
) -> Result<AdmittedTerminal, ApiError> {
    let parts = ExecParts {
        via: ask.via,
        owner: session.owner.runs(),
        request_id: known.request_id.clone(),
        subject: service.subject.clone().or_else(|| Some("-".into())),
        env: ask.env,
        timeout_ms: ask.timeout_ms,
        long_run: true,
        ..ExecParts::default()
    };
    let (request, prepared) = st
        .sessions
        .prepare_terminal(session, parts, ask.command)
        .await?;
    let execution = st.executions.admit(request).await?;
    Ok(AdmittedTerminal {
        execution,
        prepared,
    })
}

impl AdmittedTerminal {
    /// Starts the terminal's run: from now on it is one of its session's processes.
    pub fn start(self, st: &AppState) -> Terminal {
        let metrics = st.metrics.clone();
        let live = st.executions.start(self.execution, move |r| {
            super::run::answer_of(&metrics, r, StatusCode::OK, false)
        });
        self.prepared.started(&live, st.executions.clone())
    }
}
