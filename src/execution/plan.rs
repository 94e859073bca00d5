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
use crate::executors::invoke::{self, ExternalInvocation};
use crate::policy::{Ask, Plan, PolicyError};
use crate::provenance::{invocation_hash, sha256_prefixed};
use crate::sandbox::RunSpec;

/// The caller's command as a span attribute is clipped to this many characters: a span waits in
/// the exporter's queue (up to 2048 of them while a collector is slow), and the caller must not
/// set its size.
const SPAN_COMMAND_CHARS: usize = 128;

impl ExecutionService {
    /// The plan of an allowlisted command or of a registered external executor (with what its
    /// invocation adds); a refusal is audited here.
    #[tracing::instrument(
        name = "policy.decide",
        skip_all,
        fields(
            request_id = %req.request_id,
            action_type = req.action.action_type().as_str(),
            command = %crate::auth::clip(&req.command, SPAN_COMMAND_CHARS),
        )
    )]
    pub(super) fn decide(
        &self,
        req: &ExecutionRequest,
    ) -> Result<(Plan, Option<ExternalInvocation>), ExecutionError> {
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
            Action::Command { .. } => self.policy.decide(&ask, grant).map(|p| (p, None)),
            Action::Executor(parts) => invoke::decide(
                &self.executors,
                &self.policy,
                &ask,
                grant,
                &req.external_call(parts),
            ),
            Action::SessionExec(session) => self
                .policy
                .decide_language(&session.language, &ask, grant)
                .map(|mut plan| {
                    session.tighten(&mut plan.limits);
                    (plan, None)
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

    /// What the backend runs, and the invocation hash over everything that decides it.
    pub(super) fn run_spec(
        &self,
        exec_id: &str,
        plan: &Plan,
        req: &ExecutionRequest,
        external: Option<&ExternalInvocation>,
    ) -> (RunSpec, String) {
        let (argv_tail, stdin) = match external {
            Some(x) => (x.argv_tail.clone(), Some(x.stdin.clone())),
            None => (
                req.args.clone(),
                req.stdin.as_ref().map(|s| s.clone().into_bytes()),
            ),
        };
        let mut spec = plan.run_spec(exec_id, &argv_tail, stdin, &self.default_image);
        if let Some(x) = external {
            spec.fs.extra_files = x.extra_files.clone();
            spec.env.extend(x.env.clone());
        }
        if let Some(s) = req.action.session() {
            s.shape(&mut spec);
        }
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
            "executor_def_sha256": external.map(|x| &x.def_sha256),
            "limits": spec.limits,
        });
        // Only a session's exec has the key: every other request's hash stays as it was.
        if let Some(s) = req.action.session() {
            decides["session"] = s.decides();
        }
        (spec, invocation_hash(&decides))
    }

    pub(super) fn refuse(&self, req: &ExecutionRequest, kind: RefusalKind, reason: &str) {
        record::refusal(&self.audit, &self.metrics, &req.known(), kind, reason);
    }
}
