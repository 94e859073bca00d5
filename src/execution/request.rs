//! What an execution asks for: the typed request the api layer builds, and the kinds of run it
//! may ask for ([`Action`]: an allowlisted command, an external executor, a session's exec; what
//! a session's exec carries is in [`super::session`]).
//!
//! Owns: the request's fields and what each kind of run carries. Must not: decide anything (the
//! policy does, see [`super::plan`]) or know HTTP.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use tokio::sync::watch;

use super::record::KnownRequest;
use super::session::SessionExec;
use crate::auth::Verified;
use crate::executors::invoke::ExternalCall;
use crate::policy::ActionType;

/// One execution as asked for: parsed and its caller authenticated, not yet decided.
#[derive(Debug, Clone)]
pub struct ExecutionRequest {
    pub request_id: String,
    /// The calling service's subject, else the capability token's (for the audit log).
    pub subject: Option<String>,
    /// Whose run this is: the calling service's subject, `-` for a service token without one
    /// (see [`owner_of`](super::owner_of)). Only the same service reads, streams or cancels the
    /// run; a capability token's subject never decides it, as the lookups know only the service
    /// token.
    pub owner: String,
    /// The verified capability token: what this execution may do.
    pub capability: Verified,
    /// What is asked: an allowlisted command, an external executor or a session's exec.
    pub action: Action,
    /// The command's name, the executor's, or the session language's interpreter.
    pub command: String,
    pub args: Vec<String>,
    /// Already within the wire's bounds; the policy clamps it further.
    pub timeout_seconds: Option<u64>,
    /// An async or streamed run: it may last up to the profile's `max_async_timeout_seconds`.
    pub long_run: bool,
    pub profile: Option<String>,
    pub env: BTreeMap<String, String>,
    pub stdin: Option<String>,
    /// Echoed into provenance and the end line, never interpreted.
    pub metadata: Option<Map<String, Value>>,
    /// The Idempotency-Key the execution holds, as the state store scopes it (its audit lines
    /// carry it, so a daemon that stops mid-run can release it at its next start).
    pub idempotency_key: Option<String>,
    /// Raised when whoever asked for the execution stops waiting for it. A request still
    /// queued for a run slot then gives its place back and runs nothing; a run that started is
    /// not touched by it.
    pub abandoned: Option<watch::Receiver<bool>>,
    /// The front end the request came through when it was not the REST API (`mcp`): its
    /// audit lines say so.
    pub via: Option<&'static str>,
    /// Whom the call's capability token was minted for, when a capability token of the
    /// caller's own granted it: with the owner, the trust scope whose one-shot runs may share a
    /// container. None (a service token's own capabilities, as MCP grants them; sessions): the
    /// run never shares one.
    pub reuse_subject: Option<String>,
}

/// The kinds of run an execution may ask for. Each is decided its own way, in one place
/// ([`ExecutionService::plan`](super::ExecutionService::plan) and admission go through the same
/// match, in [`super::plan`]).
#[derive(Debug, Clone)]
pub enum Action {
    /// A command of the allowlist, run as `action_type` (`external` has its own kind).
    Command { action_type: ActionType },
    /// A registered external executor (the request's `command`), with its envelope's parts.
    Executor(ExternalParts),
    /// An exec in a session: the language's interpreter runs its code in the session's
    /// workspace (the request's `command` and `args` are the interpreter and the code file's
    /// path).
    SessionExec(SessionExec),
}

impl Action {
    /// The action type the policy, the audit log and provenance know the run by.
    pub fn action_type(&self) -> ActionType {
        match self {
            Action::Command { action_type } => *action_type,
            Action::Executor(_) => ActionType::External,
            Action::SessionExec(s) => s.language.action_type,
        }
    }

    /// The session an exec runs in, for the other kinds None.
    pub fn session(&self) -> Option<&SessionExec> {
        match self {
            Action::SessionExec(s) => Some(s),
            Action::Command { .. } | Action::Executor(_) => None,
        }
    }
}

/// What an `external` request carries for the executor's envelope and runtime model.
#[derive(Debug, Clone, Default)]
pub struct ExternalParts {
    pub activity: Option<Value>,
    pub input: Option<Value>,
    pub skills: Option<Value>,
    pub memory: Option<Value>,
    pub job: Option<Value>,
    pub task: Option<Value>,
    pub model: Option<String>,
}

impl ExecutionRequest {
    /// The parts an external executor's invocation is built from.
    pub(super) fn external_call<'a>(&'a self, x: &'a ExternalParts) -> ExternalCall<'a> {
        ExternalCall {
            args: &self.args,
            stdin: self.stdin.as_deref(),
            orbit: self.metadata.as_ref().and_then(|m| m.get("orbit")),
            activity: x.activity.as_ref(),
            input: x.input.as_ref(),
            skills: x.skills.as_ref(),
            memory: x.memory.as_ref(),
            job: x.job.as_ref(),
            task: x.task.as_ref(),
            model: x.model.as_deref(),
        }
    }

    /// The request as a refusal's audit line tells it.
    pub fn known(&self) -> KnownRequest {
        KnownRequest {
            request_id: self.request_id.clone(),
            subject: self.subject.clone(),
            token_id: self.capability.token_id.clone(),
            action_type: Some(self.action.action_type().as_str().to_string()),
            command: Some(self.command.clone()),
            args: self.args.clone(),
        }
    }
}
