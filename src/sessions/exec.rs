//! The exec plan of a session: what an exec in it (or the probe a creation decides) asks the
//! execution service for. The language's interpreter runs the exec's code, under the grant the
//! session keeps, in the session's place (its host workspace or its kept sandbox), with the
//! session's limits (which may only tighten its profile's).
//!
//! Owns: turning a session and an exec's parts into an [`ExecutionRequest`] with its
//! [`SessionExec`], the exec's code file on the host, the check of a session's limits against
//! its profile. Must not: decide, admit or run (the execution service does), or know HTTP.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::session::{ExecClaim, Place, Session};
use super::{NewSession, SessionError, SessionService};
use crate::auth::Verified;
use crate::execution::runs::LiveRun;
use crate::execution::{
    Action, Background, ExecutionError, ExecutionRequest, SessionExec, SessionLimits, SessionPlace,
    TERMINAL_PROGRAM, Terminal, TerminalCommand, WORKSPACE, terminal_args,
};
use crate::policy::language::Language;
use crate::sandbox::control::{ControlSender, Controls};

/// One exec's parts, as the caller sent them.
#[derive(Debug, Clone, Default)]
pub struct ExecParts {
    /// Whose run the exec is ([`Owner::runs`](super::Owner::runs)).
    pub owner: String,
    pub request_id: String,
    pub subject: Option<String>,
    pub code: String,
    pub stdin: Option<String>,
    pub env: std::collections::BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub timeout_ms: Option<u64>,
    /// Async or streamed: it may run up to the profile's async maximum.
    pub long_run: bool,
    /// A background process (see [`super::processes`]).
    pub background: Option<Background>,
    /// Keep the exec's stdin open for its caller (async and streamed execs).
    pub stdin_open: bool,
    /// The session's terminal (a background process): its command on a pseudo-terminal
    /// instead of the code (see [`super::terminal`]).
    pub terminal: Option<TerminalCommand>,
    /// The front end the exec came through when it was not the REST API (`mcp`).
    pub via: Option<&'static str>,
}

/// An exec of a session on its way to start: the claim on the session's one exec (given back
/// unless the exec starts) and the exec's code file (kept until the exec answered).
pub struct PreparedExec {
    claim: ExecClaim,
    code_file: CodeFile,
    /// The sender of its stdin, when it keeps stdin open.
    stdin: Option<ControlSender>,
}

impl PreparedExec {
    /// The exec started: the session is busy until it answers, and the code file goes once it
    /// answered (its sandbox binds it).
    pub fn started(self, live: &Arc<LiveRun>) {
        let PreparedExec {
            claim,
            code_file,
            stdin,
        } = self;
        claim.started(live, stdin);
        let mut answer = live.answer();
        tokio::spawn(async move {
            let _ = answer.wait_for(Option::is_some).await;
            drop(code_file);
        });
    }
}

impl SessionService {
    /// Claims `session`'s one exec (409 while another runs), then makes the exec's execution
    /// request (see [`Self::exec_request`]); the claim is given back if that fails.
    pub async fn prepare_exec(
        &self,
        session: &Arc<Session>,
        parts: ExecParts,
    ) -> Result<(ExecutionRequest, PreparedExec), SessionError> {
        let claim = self.claim(session)?;
        let (tx, controls) = match parts.stdin_open {
            true => {
                let (tx, c) = Controls::channel();
                (Some(tx), Some(c))
            }
            false => (None, None),
        };
        let (mut request, code_file) = self.exec_request(session, parts).await?;
        if let Action::SessionExec(e) = &mut request.action {
            e.stdin_controls = controls;
        }
        Ok((
            request,
            PreparedExec {
                claim,
                code_file,
                stdin: tx,
            },
        ))
    }

    /// The execution request of an exec in `session`: its code is written to a file of its own
    /// (removed once the exec answers), `cwd` checked inside the workspace.
    pub(super) async fn exec_request(
        &self,
        session: &Arc<Session>,
        parts: ExecParts,
    ) -> Result<(ExecutionRequest, CodeFile), SessionError> {
        let cwd = match parts.cwd.as_deref() {
            None | Some("") => PathBuf::from(WORKSPACE),
            Some(c) => session
                .cwd(c)
                .await
                .map_err(|e| SessionError::Invalid(e.to_string()))?,
        };
        let code_sha256 = format!(
            "sha256:{}",
            hex::encode(Sha256::digest(parts.code.as_bytes()))
        );
        let terminal = parts.terminal.clone().map(|command| Terminal {
            supervisor: self.supervisor.clone(),
            command,
        });
        let (place, code_file) = match &session.place {
            // A terminal has no code: its program is the supervisor, bound in on its own.
            Place::Host(w) if terminal.is_some() => (
                SessionPlace::Host {
                    workspace: w.host_dir(),
                    code_file: std::path::PathBuf::new(),
                    uid: Some(w.uid()),
                },
                CodeFile::none(),
            ),
            Place::Host(w) => {
                let key = uuid::Uuid::new_v4().simple().to_string();
                let code_file = w
                    .write_code(
                        &format!("{key}.{}", session.language.file),
                        parts.code.as_bytes(),
                    )
                    .map_err(ExecutionError::Unavailable)?;
                (
                    SessionPlace::Host {
                        workspace: w.host_dir(),
                        code_file: code_file.clone(),
                        uid: Some(w.uid()),
                    },
                    CodeFile(Some(code_file)),
                )
            }
            Place::Kept(k) => (
                SessionPlace::Kept {
                    sandbox: k.clone(),
                    code: Arc::from(parts.code.as_bytes()),
                },
                CodeFile::none(),
            ),
        };
        let binding = Binding {
            session_id: session.id.clone(),
            language: session.language.clone(),
            profile: Some(session.profile.clone()),
            limits: session.limits,
            grant: session.grant.clone(),
            tenant: session.owner.tenant.clone(),
            place,
            code_sha256,
            cwd,
        };
        let mut request = request(binding, parts);
        if let Action::SessionExec(e) = &mut request.action
            && terminal.is_some()
        {
            // What the run line records is what runs: the supervisor's pty mode.
            request.command = TERMINAL_PROGRAM.to_string();
            request.args = terminal_args(&terminal.as_ref().expect("a terminal").command);
            e.terminal = terminal;
        }
        Ok((request, code_file))
    }
}

/// What a session binds an exec to.
struct Binding {
    session_id: String,
    language: Arc<Language>,
    profile: Option<String>,
    limits: SessionLimits,
    grant: Verified,
    tenant: String,
    place: SessionPlace,
    code_sha256: String,
    cwd: PathBuf,
}

/// The exec a creation decides, as an exec of the session would be decided: the grant must
/// cover the language's capability and the profile. It has no code, and no workspace yet.
pub(super) fn probe(id: &str, language: &Arc<Language>, new: &NewSession) -> ExecutionRequest {
    request(
        Binding {
            session_id: id.to_string(),
            language: language.clone(),
            profile: new.profile.clone(),
            limits: new.limits,
            grant: new.grant.clone(),
            tenant: new.owner.tenant.clone(),
            place: SessionPlace::Host {
                workspace: PathBuf::new(),
                code_file: PathBuf::new(),
                uid: None,
            },
            code_sha256: String::new(),
            cwd: WORKSPACE.into(),
        },
        ExecParts {
            owner: new.owner.runs(),
            request_id: new.request_id.clone(),
            subject: Some(new.owner.subject.clone()),
            ..ExecParts::default()
        },
    )
}

/// The execution request of an exec: the language's interpreter with the code file as its only
/// argument, under the session's grant, in its workspace.
fn request(b: Binding, parts: ExecParts) -> ExecutionRequest {
    let exec = SessionExec {
        session_id: b.session_id,
        tenant: b.tenant,
        language: b.language,
        place: b.place,
        code_sha256: b.code_sha256,
        cwd: b.cwd,
        limits: b.limits,
        timeout: parts.timeout_ms.map(Duration::from_millis),
        background: parts.background,
        stdin_controls: None,
        terminal: None,
    };
    ExecutionRequest {
        request_id: parts.request_id,
        subject: parts.subject,
        owner: parts.owner,
        capability: b.grant,
        command: exec.language.interpreter.clone(),
        args: vec![exec.code_path().to_string_lossy().into_owned()],
        timeout_seconds: parts.timeout_ms.map(|ms| ms.div_ceil(1000).max(1)),
        long_run: parts.long_run,
        profile: b.profile,
        env: parts.env,
        stdin: parts.stdin,
        metadata: None,
        idempotency_key: None,
        abandoned: None,
        via: parts.via,
        reuse_subject: None,
        action: Action::SessionExec(exec),
    }
}

/// An exec's code file on the host (local sessions); removed when dropped (the exec has its own
/// bind of it by then, or never started).
pub(super) struct CodeFile(Option<PathBuf>);

impl CodeFile {
    /// No file (a kept sandbox writes the code itself).
    pub(super) fn none() -> CodeFile {
        CodeFile(None)
    }
}

impl Drop for CodeFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A session's limits may only tighten its profile's.
pub(super) fn check_limits(
    asked: &SessionLimits,
    plan: &crate::policy::Plan,
) -> Result<(), SessionError> {
    let l = &plan.profile.limits;
    let looser = [
        (
            "cpus",
            asked.cpus.is_some_and(|c| !(c > 0.0 && c <= l.cpus)),
        ),
        (
            "memory_mb",
            asked.memory_mb.is_some_and(|m| m < 16 || m > l.memory_mb),
        ),
        (
            "disk_mb",
            asked.disk_mb.is_some_and(|d| d == 0 || d > l.disk_mb),
        ),
        ("pids", asked.pids.is_some_and(|p| p < 4 || p > l.pids)),
        (
            "output_bytes",
            asked
                .output_bytes
                .is_some_and(|o| o == 0 || o > l.output_bytes),
        ),
    ];
    match looser.iter().find(|(_, bad)| *bad) {
        Some((name, _)) => Err(SessionError::Invalid(format!(
            "limits.{name} must be above its minimum and no looser than profile '{}' allows",
            plan.profile.name
        ))),
        None => Ok(()),
    }
}
