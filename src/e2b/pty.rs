//! PTY processes of the data plane: `Start` with a `pty` opens a terminal of the sandbox's
//! session (the same terminal as `GET /v1/sandbox/sessions/{id}/terminal`, running the command
//! the call names on the pseudo-terminal), `SendInput` types into it, `Update` resizes it.
//!
//! A PTY outlives the call that started it, as envd's do: a task holds the session's
//! [`Terminal`] until its run ends (its command exits, `SendSignal`, the sandbox's end), then
//! writes its `session_terminal` audit line.
//!
//! Owns: that task and the handle calls reach it by. Must not: run anything (the execution
//! service runs the terminal) or read HTTP.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::HeaderMap;
use tokio::sync::{mpsc, oneshot};

use super::E2b;
use super::connect::{Code, RpcError};
use super::pb::process as pb;
use crate::calls::terminal::{TerminalAsk, admit};
use crate::execution::TerminalCommand;
use crate::execution::runs::LiveRun;
use crate::sandbox::StreamKind;
use crate::sessions::{Session, Terminal, TerminalEnd, TerminalEnded};

/// The TERM a terminal gets when it is given none.
const DEFAULT_TERM: &str = "xterm-256color";

/// How long one call may wait for the PTY's command to take its bytes before it is dropped.
const CALL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Calls that may wait for the PTY's task at once; one more is refused.
const CALLS_WAITING: usize = 4;

/// Most columns or rows a PTY may have.
const MAX_SIDE: u32 = executor_arm_supervisor::protocol::MAX_TERMINAL_SIDE as u32;

/// What a call asks of a running PTY.
#[derive(Debug)]
enum Call {
    Input(Vec<u8>),
    Resize(u16, u16),
}

/// Why a call did not reach the PTY.
#[derive(Debug)]
enum Undelivered {
    /// Its run has ended.
    Ended,
    /// Its command has not read earlier input for [`CALL_WAIT`]: this call was dropped.
    NotReading,
}

type Reply = oneshot::Sender<Result<(), Undelivered>>;

/// How calls reach a PTY while it runs.
#[derive(Debug, Clone)]
pub struct PtyHandle(mpsc::Sender<(Call, Reply)>);

impl PtyHandle {
    /// Bytes typed into the PTY, in order with earlier ones.
    pub async fn input(&self, bytes: Vec<u8>) -> Result<(), RpcError> {
        self.call(Call::Input(bytes)).await
    }

    /// The PTY's new size (none: it keeps its size).
    pub async fn resize(&self, size: Option<pb::pty::Size>) -> Result<(), RpcError> {
        if size.is_none() {
            return Ok(());
        }
        let (cols, rows) = size_of(size)?;
        self.call(Call::Resize(cols, rows)).await
    }

    /// Hands `call` to the PTY's task: refused at once when [`CALLS_WAITING`] calls already
    /// wait for it. An error means the call was not delivered: the task drops a call that
    /// waited [`CALL_WAIT`] for the command to read, or whose caller gave up.
    async fn call(&self, call: Call) -> Result<(), RpcError> {
        let ended = || RpcError::not_found("the PTY has ended");
        let not_reading = || {
            RpcError::new(
                Code::DeadlineExceeded,
                "the PTY's command is not reading its input: these bytes were not typed",
            )
        };
        let (tx, rx) = oneshot::channel();
        self.0.try_send((call, tx)).map_err(|e| match e {
            mpsc::error::TrySendError::Closed(_) => ended(),
            mpsc::error::TrySendError::Full(_) => RpcError::new(
                Code::ResourceExhausted,
                "the PTY's command is not reading its input: earlier input still waits for it",
            ),
        })?;
        // The task answers every call within CALL_WAIT of taking it, and takes each within
        // CALL_WAIT of the one before: this bound is never what ends a call.
        let bound = CALL_WAIT * (CALLS_WAITING as u32 + 2);
        match tokio::time::timeout(bound, rx).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(Undelivered::NotReading))) | Err(_) => Err(not_reading()),
            Ok(Ok(Err(Undelivered::Ended))) | Ok(Err(_)) => Err(ended()),
        }
    }
}

/// A PTY's size as the call gives it (80 by 24 when it gives none), each side 1..=4096.
pub fn size_of(size: Option<pb::pty::Size>) -> Result<(u16, u16), RpcError> {
    let Some(size) = size else {
        return Ok((80, 24));
    };
    if !(1..=MAX_SIDE).contains(&size.cols) || !(1..=MAX_SIDE).contains(&size.rows) {
        return Err(RpcError::invalid(format!(
            "pty.size: cols and rows are each 1..={MAX_SIDE}"
        )));
    }
    Ok((size.cols as u16, size.rows as u16))
}

/// Opens a PTY in `session` running `config`'s command at `size`: its run, and the handle its
/// input and resizes go through.
pub async fn open(
    e2b: &E2b,
    session: &Arc<Session>,
    headers: &HeaderMap,
    config: &pb::ProcessConfig,
    mut env: BTreeMap<String, String>,
    size: (u16, u16),
    timeout: Option<std::time::Duration>,
) -> Result<(Arc<LiveRun>, PtyHandle), RpcError> {
    // The SDKs always send the TERM every terminal here gets anyway: left out, it is not
    // refused by a profile that does not let a run set TERM.
    if env.get("TERM").is_some_and(|t| t == DEFAULT_TERM) {
        env.remove("TERM");
    }
    if std::iter::once(&config.cmd)
        .chain(&config.args)
        .chain(&config.cwd)
        .any(|s| s.contains('\0'))
    {
        return Err(RpcError::invalid(
            "a PTY's cmd, args and cwd cannot hold a NUL byte",
        ));
    }
    let (service, known) = super::caller_of(session, headers);
    let argv = std::iter::once(config.cmd.clone())
        .chain(config.args.iter().cloned())
        .collect();
    let cwd = config
        .cwd
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(super::sandbox_path);
    let ask = TerminalAsk {
        via: Some("e2b"),
        env,
        timeout_ms: timeout.map(|t| t.as_millis().max(1) as u64),
        command: TerminalCommand {
            argv: Some(argv),
            cwd,
            size: Some(size),
        },
    };
    let terminal = admit(&e2b.st, session, &service, &known, ask)
        .await?
        .start(&e2b.st);
    let live = terminal.live().clone();
    Ok((live, keep(terminal)))
}

/// Holds `terminal` on a task of its own until its run ends, serving the calls its handle
/// brings meanwhile (each given at most [`CALL_WAIT`]: one the command does not take by then
/// is dropped, not typed later); then records its end.
fn keep(terminal: Terminal) -> PtyHandle {
    let (tx, mut rx) = mpsc::channel::<(Call, Reply)>(CALLS_WAITING);
    tokio::spawn(async move {
        let live = terminal.live().clone();
        let mut answer = live.answer();
        let mut open = true;
        loop {
            tokio::select! {
                call = rx.recv(), if open => match call {
                    // Its caller gave up: not delivered.
                    Some((_, reply)) if reply.is_closed() => {}
                    Some((call, reply)) => {
                        let sent = async {
                            match call {
                                Call::Input(bytes) => terminal.input(&bytes).await,
                                Call::Resize(cols, rows) => terminal.resize(cols, rows).await,
                            }
                        };
                        let done = match tokio::time::timeout(CALL_WAIT, sent).await {
                            Ok(Ok(())) => Ok(()),
                            Ok(Err(TerminalEnded)) => Err(Undelivered::Ended),
                            // The send is dropped before its bytes were queued.
                            Err(_) => Err(Undelivered::NotReading),
                        };
                        let _ = reply.send(done);
                    }
                    // No handle is left (the sandbox's record is gone): the run still ends
                    // with its session.
                    None => open = false,
                },
                _ = async { answer.wait_for(Option::is_some).await.map(|_| ()) } => break,
            }
        }
        // What the terminal wrote, whoever read it (its stderr is pty data here too).
        let written = [StreamKind::Stdout, StreamKind::Stderr]
            .map(|s| live.with_output(s, |k| k.end()))
            .iter()
            .sum();
        terminal.sent(written);
        terminal.close(TerminalEnd::Exited).await;
    });
    PtyHandle(tx)
}

/// The error of a call that only a PTY takes, made to another process.
pub fn not_a_pty(pid: u32) -> RpcError {
    RpcError::new(
        Code::FailedPrecondition,
        format!("process {pid} was not started with a PTY"),
    )
}
