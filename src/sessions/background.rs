//! Starting, controlling and stopping a session's background processes (see
//! [`super::processes`] for what they are).
//!
//! Owns: a process's way from an exec's parts to its run (its place, its controls, its code
//! file), the controls a caller sends it, ending them all when the session ends or pauses. Must
//! not: run anything (the execution service does) or know HTTP.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::exec::{CodeFile, ExecParts};
use super::processes::Process;
use super::session::Session;
use super::{SessionError, SessionService};
use crate::execution::runs::LiveRun;
use crate::execution::{Background, ExecutionRequest};
use crate::sandbox::control::{Control, ControlSender, Controls, ProcessSignal, Refused};

/// How long a session's end waits for its processes to start or to end.
const END_WAIT: Duration = Duration::from_secs(10);

/// A process on its way to start: its place among the session's processes (given back unless
/// it starts), its controls, its code file (kept until it ended).
pub struct PreparedProcess {
    session: Arc<Session>,
    controls: Option<ControlSender>,
    code_sha256: String,
    code_file: CodeFile,
    terminal: bool,
}

impl PreparedProcess {
    /// The sender of the process's controls (its stdin and signals).
    pub fn controls(&self) -> ControlSender {
        self.controls.clone().expect("controls until started")
    }

    /// The process started: it is listed (a session ending meanwhile waits for this, then stops
    /// it with the others), its exec routes serve it, and its code file goes once it ended.
    pub fn started(mut self, live: &Arc<LiveRun>) {
        let process = Arc::new(Process {
            live: live.clone(),
            code_sha256: std::mem::take(&mut self.code_sha256),
            started_at: chrono::Utc::now(),
            controls: self.controls.take().expect("controls until started"),
            terminal: self.terminal,
        });
        // One of the session's execs, counted as its foreground ones are.
        self.session
            .execs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.session.remember_exec(live.exec_id());
        self.session.processes.add(process.clone());
        let code_file = std::mem::replace(&mut self.code_file, CodeFile::none());
        let session = self.session.clone();
        let mut answer = live.answer();
        let netns = process.controls.netns().clone();
        tokio::spawn(async move {
            let _ = answer.wait_for(Option::is_some).await;
            // Its network namespace is no longer held open for the session's ports.
            netns.clear();
            drop(code_file);
            session.touch();
        });
    }
}

impl Drop for PreparedProcess {
    fn drop(&mut self) {
        if self.controls.is_some() {
            self.session.processes.unreserve();
        }
    }
}

/// Why a control could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No such process of this session (404).
    #[error("no such process of this session")]
    NotFound,
    /// The process has ended (409).
    #[error("the process has ended")]
    Ended,
    /// The exec runs without an open stdin (409).
    #[error("the exec was not started with stdin_open")]
    NotOpen,
    /// Stdin bytes after its end was sent (409).
    #[error("the process's stdin is closed")]
    StdinClosed,
    /// Stdin for a terminal, whose stdin carries its own frames: its input goes through the
    /// terminal (400).
    #[error("the process is a terminal")]
    Terminal,
}

impl SessionService {
    /// Takes a place among `session`'s processes (429 past `sessions.max_processes`), then makes
    /// the process's execution request: an exec of the session that runs beside its others.
    pub async fn prepare_process(
        &self,
        session: &Arc<Session>,
        mut parts: ExecParts,
    ) -> Result<(ExecutionRequest, PreparedProcess), SessionError> {
        // Raw TCP rules listen on their destinations' ports, one listener per container, which
        // the session's foreground execs hold.
        if session.backend != crate::sandbox::BackendKind::Local && session.has_tcp_rules {
            return Err(SessionError::Invalid(format!(
                "background processes in {} sessions cannot have raw TCP rules: this session's profile '{}' has network.tcp rules; use a local session or a profile without them",
                session.backend.as_str(),
                session.profile
            )));
        }
        match session.processes.reserve(self.config.max_processes) {
            Ok(()) => {}
            Err(None) => return Err(SessionError::NotFound),
            Err(Some(max)) => {
                return Err(SessionError::TooMany(format!(
                    "the session has {max} background processes running (sessions.max_processes)"
                )));
            }
        }
        let (tx, controls) = Controls::channel();
        let mut prepared = PreparedProcess {
            session: session.clone(),
            controls: Some(tx),
            code_sha256: String::new(),
            code_file: CodeFile::none(),
            terminal: parts.terminal.is_some(),
        };
        parts.long_run = true;
        parts.background = Some(Background {
            controls,
            key: uuid::Uuid::new_v4().simple().to_string(),
            ring_bytes: self.config.process_output_ring_bytes,
        });
        let (request, code_file) = self.exec_request(session, parts).await?;
        if let crate::execution::Action::SessionExec(e) = &request.action {
            prepared.code_sha256 = e.code_sha256.clone();
        }
        prepared.code_file = code_file;
        Ok((request, prepared))
    }

    /// Sends `control` to process `id` of `session`.
    pub async fn control_process(
        &self,
        session: &Session,
        id: &str,
        control: Control,
    ) -> Result<(), ControlError> {
        let p = session.processes.get(id).ok_or(ControlError::NotFound)?;
        if p.ended() {
            return Err(ControlError::Ended);
        }
        // A terminal's stdin carries the frames its own calls make (and count).
        if p.terminal && matches!(control, Control::Stdin(_) | Control::CloseStdin) {
            return Err(ControlError::Terminal);
        }
        // KILL also goes through the run's stop, which ends every process of the run whatever
        // the command does with its stdin.
        if control == Control::Signal(ProcessSignal::Kill) {
            self.executions
                .cancel(&p.live, Duration::ZERO, &session.owner.subject, &session.id);
            return Ok(());
        }
        p.controls.send(control).await.map_err(|e| match e {
            Refused::RunEnded => ControlError::Ended,
            Refused::StdinClosed => ControlError::StdinClosed,
        })
    }

    /// Sends `control` (stdin bytes or its end) to `session`'s running exec `exec_id`, which
    /// keeps its stdin open.
    pub async fn control_exec(
        &self,
        session: &Session,
        exec_id: &str,
        control: Control,
    ) -> Result<(), ControlError> {
        if !session.ran(exec_id) {
            return Err(ControlError::NotFound);
        }
        let tx = session
            .stdin_of(exec_id)
            .map_err(|not_open| match not_open {
                true => ControlError::NotOpen,
                false => ControlError::Ended,
            })?;
        tx.send(control).await.map_err(|e| match e {
            Refused::RunEnded => ControlError::Ended,
            Refused::StdinClosed => ControlError::StdinClosed,
        })
    }

    /// Ends `session`'s processes: none starts from now on, each running one is killed, and
    /// this waits (bounded) until they ended.
    pub(super) async fn stop_processes(&self, session: &Session) {
        let until = Instant::now() + END_WAIT;
        session.processes.set_closed(true);
        while session.processes.starting() > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let procs: Vec<Arc<Process>> = session.processes.all();
        for p in procs.iter().filter(|p| !p.ended()) {
            self.executions
                .cancel(&p.live, Duration::ZERO, &session.owner.subject, &session.id);
        }
        for p in procs {
            let mut answer = p.live.answer();
            let left = until.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, answer.wait_for(Option::is_some)).await;
        }
    }
}

/// Opens a session's processes again when dropped, unless disarmed: a pause that failed leaves
/// the session running, and new processes may start in it again.
pub(super) struct Reopen<'a>(Option<&'a Session>);

impl<'a> Reopen<'a> {
    pub(super) fn new(session: &'a Session) -> Reopen<'a> {
        Reopen(Some(session))
    }

    /// The session's processes stay closed (it paused or ended).
    pub(super) fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Reopen<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            s.processes.set_closed(false);
        }
    }
}
