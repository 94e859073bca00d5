//! Deciding an execution: the one match over the kinds of run ([`Action`]) that turns a request
//! into a [`Plan`], and the [`RunSpec`] the backend runs for it with the invocation hash over
//! everything that decides it.
//!
//! Owns: which decider each kind of run goes to, and what each kind adds to its run. Must not:
//! take a run slot, claim a token or know HTTP.

use serde_json::json;

use super::ExecutionService;
use super::record::{self, RefusalKind};
use super::request::{Action, ExecutionRequest};
use super::result::ExecutionError;
use super::session::SessionExec;
use crate::executors::invoke::{self, ExternalInvocation};
use crate::policy::{Ask, Plan, PolicyError};
use crate::provenance::{invocation_hash, sha256_prefixed};
use crate::sandbox::RunSpec;

/// The caller's command as a span attribute is clipped to this many characters: a span waits in
/// the exporter's queue (up to 2048 of them while a collector is slow), and the caller must not
/// set its size.
const SPAN_COMMAND_CHARS: usize = 128;

/// A decided request: its plan, and what its kind of run adds to it.
pub(super) struct Decision<'r> {
    pub(super) plan: Plan,
    kind: Decided<'r>,
}

/// What each kind of run ([`Action`]) brings from its decision to its [`RunSpec`].
enum Decided<'r> {
    Command,
    /// The executor's invocation: its argv tail, envelope, files and environment.
    Executor(ExternalInvocation),
    SessionExec(&'r SessionExec),
}

impl Decision<'_> {
    /// The hash of the executor's def, for an external executor's run.
    pub(super) fn executor_def_sha256(&self) -> Option<&str> {
        match &self.kind {
            Decided::Executor(x) => Some(&x.def_sha256),
            Decided::Command | Decided::SessionExec(_) => None,
        }
    }
}

impl ExecutionService {
    /// The plan of an allowlisted command, of a registered external executor (with what its
    /// invocation adds) or of a session's exec; a refusal is audited here.
    #[tracing::instrument(
        name = "policy.decide",
        skip_all,
        fields(
            request_id = %req.request_id,
            action_type = req.action.action_type().as_str(),
            command = %crate::auth::clip(&req.command, SPAN_COMMAND_CHARS),
        )
    )]
    pub(super) fn decide<'r>(
        &self,
        req: &'r ExecutionRequest,
    ) -> Result<Decision<'r>, ExecutionError> {
        let ask = Ask {
            action_type: Some(req.action.action_type()),
            command: &req.command,
            args: &req.args,
            timeout_seconds: req.timeout_seconds,
            long_run: req.long_run,
            profile: req.profile.as_deref(),
            env: &req.env,
        };
        let grant = &req.capability.grant;
        let decided = match &req.action {
            Action::Command { .. } => self.policy.decide(&ask, grant).map(|plan| Decision {
                plan,
                kind: Decided::Command,
            }),
            Action::Executor(parts) => invoke::decide(
                &self.executors,
                &self.policy,
                &ask,
                grant,
                &req.external_call(parts),
            )
            .map(|(plan, invocation)| Decision {
                plan,
                kind: Decided::Executor(invocation),
            }),
            Action::SessionExec(session) => self
                .policy
                .decide_language(&session.language, &ask, grant)
                .map(|mut plan| {
                    session.tighten(&mut plan.limits);
                    Decision {
                        plan,
                        kind: Decided::SessionExec(session),
                    }
                }),
        };
        decided.map_err(|e| match e {
            PolicyError::Refused(r) => {
                self.refuse(req, RefusalKind::CapabilityViolation, &r.reason);
                ExecutionError::Refused {
                    allowed_commands: (r.rule == "allowlist").then(|| self.policy.allowed_names()),
                    reason: r.reason,
                }
            }
            PolicyError::Invalid(m) => ExecutionError::Invalid(m),
            PolicyError::Unavailable(m) => ExecutionError::Unavailable(m),
        })
    }

    /// What the backend runs for a decided request, and the invocation hash over everything
    /// that decides it.
    pub(super) fn run_spec(
        &self,
        exec_id: &str,
        decision: &Decision<'_>,
        req: &ExecutionRequest,
    ) -> (RunSpec, String) {
        let plan = &decision.plan;
        let request_stdin = || req.stdin.as_ref().map(|s| s.clone().into_bytes());
        let image = &self.default_image;
        let (spec, argv_tail) = match &decision.kind {
            Decided::Command => {
                let mut spec = plan.run_spec(exec_id, &req.args, request_stdin(), image);
                // A one-shot run's trust scope is its calling service and the subject its own
                // capability token was minted for (one service's agents or tenants, each with a
                // token of its own, never share); a service token's own capabilities (MCP) or a
                // capability token with no subject name no one, so such runs never share a
                // container. Length-prefixed: no two pairs meet.
                let cap = req.reuse_subject.as_deref().filter(|s| !s.is_empty());
                spec.reuse_scope = cap
                    .filter(|_| req.owner != super::runs::NO_OWNER)
                    .map(|cap| format!("{}:{}{cap}", req.owner.len(), req.owner));
                (spec, &req.args)
            }
            Decided::Executor(x) => {
                let mut spec = plan.run_spec(exec_id, &x.argv_tail, Some(x.stdin.clone()), image);
                spec.fs.extra_files = x.extra_files.clone();
                spec.env.extend(x.env.clone());
                (spec, &x.argv_tail)
            }
            Decided::SessionExec(s) => {
                let mut spec = plan.run_spec(exec_id, &req.args, request_stdin(), image);
                s.shape(&mut spec);
                (spec, &req.args)
            }
        };
        let mut decides = json!({
            "action_type": req.action.action_type().as_str(),
            "command": plan.command,
            "path": plan.path,
            "args": argv_tail,
            "stdin_sha256": spec.stdin.as_deref().map(sha256_prefixed),
            "env": spec.env,
            "profile": plan.profile.name,
            "backend": plan.backend.as_str(),
            "image": spec.image,
            "executor_def_sha256": decision.executor_def_sha256(),
            "limits": spec.limits,
        });
        // Only a session's exec has the key: every other request's hash stays as it was.
        if let Decided::SessionExec(s) = &decision.kind {
            decides["session"] = s.decides();
        }
        (spec, invocation_hash(&decides))
    }

    pub(super) fn refuse(&self, req: &ExecutionRequest, kind: RefusalKind, reason: &str) {
        record::refusal(&self.audit, &self.metrics, &req.known(), kind, reason);
    }
}
