//! A session's terminal: a background process of the session (one of its
//! `sessions.max_processes`) whose command is the supervisor's `pty` mode running the session's
//! shell on a pseudo-terminal inside the sandbox.
//!
//! Its stdin carries the supervisor's control frames (bytes for the terminal, a resize, the
//! hang-up); its stdout is the terminal's output. It ends as every process of the session does
//! (delete, expiry, pause, shutdown), or when its caller hangs up: SIGHUP to the shell's
//! session, then the run's stop kills every process of it. One `session_terminal` audit line
//! records it when it ends: when it started and ended, and how many bytes went each way (never
//! the bytes themselves).
//!
//! Owns: the terminal's controls and its audit line. Must not: know HTTP or WebSockets (the api
//! turns frames into these calls) or run anything (the execution service does).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use executor_arm_supervisor::protocol::ControlFrame;

use super::background::PreparedProcess;
use super::exec::ExecParts;
use super::session::Session;
use super::{SessionError, SessionService};
use crate::execution::runs::LiveRun;
use crate::execution::{ExecutionRequest, ExecutionService, TerminalCommand};
use crate::provenance::audit::{AuditEvent, SessionTerminal};
use crate::sandbox::control::{Control, ControlSender};

/// How long a hung-up shell has to end before the run's stop kills what is left.
const HANG_UP_WAIT: Duration = Duration::from_secs(2);
/// How long the stop itself may take before the terminal's end is recorded anyway.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// A terminal on its way to start: its place among the session's processes (given back unless
/// it starts).
pub struct PreparedTerminal {
    process: PreparedProcess,
    controls: ControlSender,
    session: Arc<Session>,
    request_id: String,
    open: tokio_util::task::task_tracker::TaskTrackerToken,
}

/// A running terminal. Dropped without [`Terminal::close`], its run goes on until the session
/// ends it; the api always closes it.
pub struct Terminal {
    session: Arc<Session>,
    live: Arc<LiveRun>,
    controls: ControlSender,
    executions: Arc<ExecutionService>,
    request_id: String,
    started_at: chrono::DateTime<chrono::Utc>,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Held until its audit line is written: shutdown waits for it.
    _open: tokio_util::task::task_tracker::TaskTrackerToken,
}

/// The terminal's run has ended: it takes nothing more.
#[derive(Debug, thiserror::Error)]
#[error("the terminal has ended")]
pub struct TerminalEnded;

/// Why a terminal ended, as its audit line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminalEnd {
    /// Its caller closed the socket (or went away).
    Closed,
    /// The shell ended (or the session ended it: delete, expiry, pause, shutdown).
    Exited,
    /// Its caller broke the protocol (a frame over `sessions.max_frame_bytes`, a malformed
    /// text frame).
    Refused,
}

impl TerminalEnd {
    fn as_str(self) -> &'static str {
        match self {
            TerminalEnd::Closed => "closed",
            TerminalEnd::Exited => "exited",
            TerminalEnd::Refused => "refused",
        }
    }
}

impl SessionService {
    /// Takes a place among `session`'s processes (429 past `sessions.max_processes`) and makes
    /// the execution request of a terminal running `command`.
    pub async fn prepare_terminal(
        &self,
        session: &Arc<Session>,
        mut parts: ExecParts,
        command: TerminalCommand,
    ) -> Result<(ExecutionRequest, PreparedTerminal), SessionError> {
        parts.terminal = Some(command);
        parts.code = String::new();
        parts.stdin = None;
        let request_id = parts.request_id.clone();
        let (request, process) = self.prepare_process(session, parts).await?;
        let controls = process.controls();
        Ok((
            request,
            PreparedTerminal {
                process,
                controls,
                session: session.clone(),
                request_id,
                open: self.terminals.token(),
            },
        ))
    }

    /// The most bytes one WebSocket frame (or message) of a terminal may carry.
    pub fn max_frame_bytes(&self) -> usize {
        self.config.max_frame_bytes
    }
}

impl PreparedTerminal {
    /// The terminal's run started: it is one of the session's processes from now on.
    pub fn started(self, live: &Arc<LiveRun>, executions: Arc<ExecutionService>) -> Terminal {
        self.process.started(live);
        Terminal {
            session: self.session,
            live: live.clone(),
            controls: self.controls,
            executions,
            request_id: self.request_id,
            started_at: chrono::Utc::now(),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            _open: self.open,
        }
    }
}

impl Terminal {
    /// The terminal's run: its stdout is what the terminal shows.
    pub fn live(&self) -> &Arc<LiveRun> {
        &self.live
    }

    /// Its process id (its exec id).
    pub fn process_id(&self) -> &str {
        self.live.exec_id()
    }

    /// Bytes typed into the terminal.
    pub async fn input(&self, bytes: &[u8]) -> Result<(), TerminalEnded> {
        self.session.touch();
        self.send(ControlFrame::Stdin(bytes.to_vec())).await?;
        self.bytes_in
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The terminal's new size.
    pub async fn resize(&self, cols: u16, rows: u16) -> Result<(), TerminalEnded> {
        self.session.touch();
        self.send(ControlFrame::Resize { cols, rows }).await
    }

    /// `n` bytes of the terminal's output reached its caller.
    pub fn sent(&self, n: usize) {
        self.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
        self.session.touch();
    }

    async fn send(&self, frame: ControlFrame) -> Result<(), TerminalEnded> {
        self.controls
            .send(Control::Stdin(frame.encode()))
            .await
            .map_err(|_| TerminalEnded)
    }

    /// Hangs the terminal up and waits (bounded) until its run ended: the shell gets SIGHUP
    /// (the supervisor's hang-up), then the run's stop kills every process of it. Writes the
    /// terminal's audit line.
    pub async fn close(self, why: TerminalEnd) {
        let mut answer = self.live.answer();
        if self.live.answered().is_none() {
            let _ = self.controls.send(Control::CloseStdin).await;
            let _ = tokio::time::timeout(HANG_UP_WAIT, answer.wait_for(Option::is_some)).await;
        }
        // Whatever the shell left (a process that ignored the hang-up) goes with the run.
        if self.live.answered().is_none() {
            self.executions.cancel(
                &self.live,
                Duration::ZERO,
                &self.session.owner.subject,
                &self.request_id,
            );
            let _ = tokio::time::timeout(STOP_WAIT, answer.wait_for(Option::is_some)).await;
        }
        self.session.touch();
        let line = AuditEvent::SessionTerminal(SessionTerminal {
            request_id: self.request_id.clone(),
            session_id: self.session.id.clone(),
            owner: self.session.owner.subject.clone(),
            tenant: self.session.owner.tenant.clone(),
            process_id: self.live.exec_id().to_string(),
            started_at: self
                .started_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ended_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            end: why.as_str(),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
        });
        crate::execution::record::record(self.executions.audit(), self.executions.metrics(), &line);
    }
}
