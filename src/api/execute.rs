//! POST /execute: authenticate, parse, authorise, admit, run, answer, audit.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::{AppState, RequestId};
use crate::auth::Verified;
use crate::config::TokenKind;
use crate::executors::invoke::ExternalCall;
use crate::metrics::Metrics;
use crate::policy::{ActionType, Ask, Plan, PolicyError};
use crate::provenance::audit::{self, AuditError, AuditEvent, AuditLog, Refusal, RunEnd};
use crate::provenance::{command_hash, invocation_hash, sha256_prefixed};
use crate::sandbox::{KilledReason, RunOutcome, SandboxError};
use crate::state::{IdemBegin, IdemKey, JtiClaim, StateStore, StoredResponse};

/// The request body. Unknown fields are refused: a misspelt limit must not be silently ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecuteRequest {
    pub action_type: String,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub timeout_seconds: Option<i64>,
    /// Absent here, it may come in the `X-Capability-Token` header; absent in both → 401.
    #[serde(default)]
    pub capability_token: Option<String>,
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub stdin: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub profile: Option<String>,
    // External executor envelope (docs/executors.md).
    #[serde(default)]
    pub input: Option<Value>,
    #[serde(default)]
    pub activity: Option<Value>,
    #[serde(default)]
    pub skills: Option<Value>,
    #[serde(default)]
    pub memory: Option<Value>,
    #[serde(default)]
    pub job: Option<Value>,
    #[serde(default)]
    pub task: Option<Value>,
    #[serde(default)]
    pub model: Option<String>,
}

impl ExecuteRequest {
    /// The parts of the request an external executor's invocation is built from.
    pub fn external_call(&self) -> ExternalCall<'_> {
        ExternalCall {
            has_args: !self.args.is_empty(),
            has_stdin: self.stdin.is_some(),
            activity: self.activity.as_ref(),
            input: self.input.as_ref(),
            skills: self.skills.as_ref(),
            memory: self.memory.as_ref(),
            job: self.job.as_ref(),
            task: self.task.as_ref(),
            model: self.model.as_deref(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Provenance {
    pub arm_id: &'static str,
    pub timestamp: String,
    pub action_type: &'static str,
    pub command_hash: String,
    pub capabilities_used: Vec<&'static str>,
    pub exec_id: String,
    pub request_id: String,
    pub token_id: Option<String>,
    pub subject: Option<String>,
    pub backend: &'static str,
    pub profile: String,
    pub invocation_hash: String,
    pub stdout_sha256: String,
    pub stderr_sha256: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub executor_def_sha256: Option<String>,
    pub audit_seq: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

#[derive(Debug, Serialize)]
pub struct ExecutionResult {
    pub success: bool,
    /// The stream as UTF-8, invalid sequences replaced (U+FFFD).
    pub stdout: String,
    pub stderr: String,
    /// The stream's exact bytes (standard base64), present only when they are not valid UTF-8:
    /// `stdout_sha256` is over these bytes, so a client can always check what it received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    pub exit_code: i32,
    pub duration_ms: u64,
    pub provenance: Provenance,
    pub exec_id: String,
    pub outcome: &'static str,
    pub backend: &'static str,
    pub profile: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub peak_memory_kib: Option<u64>,
    pub oom: bool,
    pub killed_reason: Option<&'static str>,
    pub error_code: Option<&'static str>,
    /// Outbound connections through the egress proxy (egress profiles only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Vec<crate::egress::ConnRecord>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_type: Option<&'static str>,
    /// On a result that is an error (an execution timeout): whether sending the same request
    /// again may succeed. Never for a timeout: the same command gets the same deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
}

/// Where a caller may send the capability token instead of the body's `capability_token`.
pub const CAPABILITY_TOKEN_HEADER: &str = "x-capability-token";

/// Longest refusal reason an audit line carries, in characters.
const MAX_REASON_CHARS: usize = 512;

/// Everything known about the request so far, for refusals' audit lines.
struct Ctx {
    request_id: String,
    subject: Option<String>,
    token_id: Option<String>,
    action_type: Option<String>,
    command: Option<String>,
    args: Vec<String>,
}

impl Ctx {
    /// Appends the refusal's line, unless its class is over its rate: then it is only counted
    /// (see `AuditLog::admit_refusal`). Returns whether it got a line.
    fn audit_refusal(
        &self,
        st: &AppState,
        status: StatusCode,
        error_type: &'static str,
        reason: &str,
    ) -> bool {
        let authenticated = self.subject.is_some() || self.token_id.is_some();
        if !st.audit.admit_refusal(status.as_u16(), authenticated) {
            st.metrics
                .audit_refusals_suppressed
                .with_label_values(&[status.as_str()])
                .inc();
            return false;
        }
        let event = AuditEvent::Refusal(Refusal {
            request_id: self.request_id.clone(),
            status: status.as_u16(),
            error_type,
            // Reasons quote what the caller sent (a kid, an option): bounded, so a refusal line
            // stays small whatever arrives.
            reason: crate::auth::clip(reason, MAX_REASON_CHARS),
            subject: self.subject.clone(),
            token_id: self.token_id.clone(),
            action_type: self.action_type.clone(),
            command: self.command.clone(),
            command_hash: self.command.as_ref().map(|c| command_hash(c, &self.args)),
        });
        record(&st.audit, &st.metrics, &event);
        true
    }

    fn unauthorized(&self, st: &AppState, reason: &str) -> ApiError {
        st.metrics.auth_failures.inc();
        // A flood of 401s is logged as far as it is audited: the rest are counted.
        if self.audit_refusal(st, StatusCode::UNAUTHORIZED, "Unauthorized", reason) {
            tracing::info!(request_id = %self.request_id, %reason, "401");
        }
        ApiError::Unauthorized
    }

    fn forbidden(&self, st: &AppState, reason: String, list: bool) -> ApiError {
        st.metrics.capability_violations.inc();
        self.audit_refusal(st, StatusCode::FORBIDDEN, "CapabilityViolation", &reason);
        ApiError::CapabilityViolation {
            message: reason,
            allowed_commands: list.then(|| st.policy.allowed_names()),
        }
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    deadline: Duration,
) -> Result<bytes::Bytes, ApiError> {
    // Refuse on the declared length before reading anything.
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    // Chunked bodies: stop reading at the first byte past the limit. The whole body must arrive
    // within the deadline, or a trickling client holds a connection and a task forever.
    let read = tokio::time::timeout(deadline, to_bytes(body, limit))
        .await
        .map_err(|_| ApiError::BodyTimeout(deadline))?;
    read.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            || e.to_string().contains("length limit");
        if too_large {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::InvalidRequest(format!("could not read the request body: {e}"))
        }
    })
}

pub(crate) fn parse_request(body: &[u8]) -> Result<ExecuteRequest, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::InvalidRequest(format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::InvalidRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::InvalidRequest(format!("invalid request: {e}")))
}

/// The wire outcome of a run.
fn outcome_name(o: &RunOutcome) -> &'static str {
    match o.killed_reason {
        Some(KilledReason::Timeout) => "timeout",
        Some(KilledReason::Oom) => "oom",
        _ if o.oom => "oom",
        Some(KilledReason::Signal) => "cancelled",
        Some(KilledReason::OutputLimit) | Some(KilledReason::Pids) => "failed",
        None if o.exit_code() == 0 && !o.stdin_broken_pipe => "success",
        None => "failed",
    }
}

pub async fn execute(State(st): State<Arc<AppState>>, req: Request) -> Response {
    // The whole request is its own task: a client that disconnects mid-run does not cancel the
    // run's audit line, metrics, in-flight gauge or stored idempotent result, only its reply.
    match tokio::spawn(execute_detached(st, req)).await {
        Ok(resp) => resp,
        Err(e) => ApiError::Internal(format!("request task failed: {e}")).into_response(),
    }
}

async fn execute_detached(st: Arc<AppState>, req: Request) -> Response {
    let rid = req
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    let idem_key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (parts, body) = req.into_parts();
    let mut ctx = Ctx {
        request_id: rid,
        subject: None,
        token_id: None,
        action_type: None,
        command: None,
        args: Vec::new(),
    };
    match handle(&st, &parts.headers, body, idem_key, &mut ctx).await {
        Ok(resp) => resp,
        Err(e) => {
            let label = match &e {
                ApiError::Overloaded => Some("overloaded"),
                ApiError::PayloadTooLarge(_) => Some("payload_too_large"),
                ApiError::BodyTimeout(_) => Some("body_timeout"),
                ApiError::InvalidRequest(_) => Some("invalid_request"),
                ApiError::SandboxUnavailable(_) | ApiError::ShuttingDown => {
                    Some("sandbox_unavailable")
                }
                ApiError::IdempotencyConflict | ApiError::IdempotencyInProgress => {
                    Some("idempotency")
                }
                _ => None,
            };
            if let Some(l) = label {
                st.metrics.rejected.with_label_values(&[l]).inc();
            }
            e.into_response()
        }
    }
}

async fn handle(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    idem_key: Option<String>,
    ctx: &mut Ctx,
) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    // Who is calling: checked before the body is even read.
    let service = match bearer(headers) {
        Some(t) => st
            .auth
            .verify(t, TokenKind::Service)
            .map_err(|e| ctx.unauthorized(st, &format!("service token: {e}")))?,
        None => return Err(ctx.unauthorized(st, "missing Authorization: Bearer service token")),
    };
    ctx.subject = service.subject.clone();
    claim_single_use(st, ctx, &service).await?;
    let raw = read_body(
        body,
        headers,
        st.config.server.body_limit_bytes,
        Duration::from_secs(st.config.server.body_read_timeout_seconds),
    )
    .await?;
    let req = parse_request(&raw)?;
    ctx.action_type = Some(req.action_type.clone());
    ctx.command = Some(req.command.clone());
    ctx.args = req.args.clone();
    let action = ActionType::parse(&req.action_type).ok_or_else(|| {
        ApiError::InvalidRequest(format!(
            "unknown action_type '{}': expected shell, http, python or external",
            req.action_type.escape_debug()
        ))
    })?;
    let timeout = match req.timeout_seconds {
        None => None,
        Some(t) if (1..=300).contains(&t) => Some(t as u64),
        Some(t) => {
            return Err(ApiError::InvalidRequest(format!(
                "timeout_seconds must be between 1 and 300, got {t}"
            )));
        }
    };
    if req.args.iter().any(|a| a.contains('\0')) || req.command.contains('\0') {
        return Err(ApiError::InvalidRequest(
            "command and args may not contain NUL bytes".into(),
        ));
    }

    // What this call may do.
    let mut header_tokens = headers.get_all(CAPABILITY_TOKEN_HEADER).iter();
    let header_token = header_tokens.next().map(|v| v.to_str().unwrap_or_default());
    if header_tokens.next().is_some() {
        // Two copies: a proxy in front may have checked the other one.
        return Err(ApiError::InvalidRequest(format!(
            "{CAPABILITY_TOKEN_HEADER} is given more than once"
        )));
    }
    let token = match (req.capability_token.as_deref(), header_token) {
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidRequest(format!(
                "the capability token is given twice: in the body and in {CAPABILITY_TOKEN_HEADER}"
            )));
        }
        (Some(t), None) | (None, Some(t)) => t,
        (None, None) => return Err(ctx.unauthorized(st, "missing capability token")),
    };
    let cap = st
        .auth
        .verify(token, TokenKind::Capability)
        .map_err(|e| ctx.unauthorized(st, &format!("capability token: {e}")))?;
    ctx.token_id = cap.token_id.clone();
    if ctx.subject.is_none() {
        ctx.subject = cap.subject.clone();
    }

    // Idempotency: a retry of a finished request gets the stored answer without running again.
    // The fingerprint covers the capability token as well as the body: a token in the header is
    // not in the body, and a replay must never hand a result to a token that could not have run
    // the request (another token with the same key and body gets 422).
    let body_hash = {
        let mut fingerprint = Vec::with_capacity(raw.len() + 1 + token.len());
        fingerprint.extend_from_slice(&raw);
        fingerprint.push(0);
        fingerprint.extend_from_slice(token.as_bytes());
        sha256_prefixed(&fingerprint)
    };
    let idem = match idem_key {
        Some(k) => {
            if k.is_empty() || k.len() > 255 || !k.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ApiError::InvalidRequest(
                    "Idempotency-Key must be 1-255 visible ASCII characters".into(),
                ));
            }
            let scoped = IdemKey {
                subject: service.subject.clone().unwrap_or_else(|| "-".into()),
                key: k,
            };
            let lease = Duration::from_secs(st.config.state.idempotency_lease_seconds);
            match st
                .store
                .idempotency_begin(&scoped, &body_hash, &st.instance_id, lease)
                .await
                .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?
            {
                IdemBegin::Started => Some(LeaseRenewal::start(st, &scoped, lease)),
                IdemBegin::InProgress { same_body: true } => {
                    return Err(ApiError::IdempotencyInProgress);
                }
                IdemBegin::InProgress { same_body: false }
                | IdemBegin::Done {
                    same_body: false, ..
                } => return Err(ApiError::IdempotencyConflict),
                IdemBegin::Done {
                    same_body: true,
                    response,
                } => return Ok(replay(response)),
            }
        }
        None => None,
    };
    let idem_key = idem.as_ref().map(|l| l.key.scoped());
    let result = run_admitted(st, req, action, timeout, &cap, ctx, idem_key).await;
    if let Some(lease) = idem {
        let key = lease.stop();
        let ttl = Duration::from_secs(st.config.state.idempotency_ttl_seconds);
        match &result {
            Ok((status, body)) if status.is_success() || *status == StatusCode::REQUEST_TIMEOUT => {
                let stored = StoredResponse {
                    status: status.as_u16(),
                    body: body.clone(),
                };
                if let Err(e) = st
                    .store
                    .idempotency_complete(&key, &body_hash, &stored, ttl)
                    .await
                {
                    tracing::error!(error = %e, "idempotency result not stored");
                }
            }
            _ => {
                if let Err(e) = st.store.idempotency_release(&key, &st.instance_id).await {
                    tracing::error!(error = %e, "idempotency key not released");
                }
            }
        }
    }
    let (status, body) = result?;
    Ok((
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response())
}

/// Keeps this daemon's claim on an Idempotency-Key alive while its request runs: renews the lease
/// every third of it, until stopped or dropped.
struct LeaseRenewal {
    key: IdemKey,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseRenewal {
    fn start(st: &Arc<AppState>, key: &IdemKey, lease: Duration) -> LeaseRenewal {
        let st = st.clone();
        let k = key.clone();
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(lease / 3);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await; // the first tick is now: the claim is fresh
            loop {
                every.tick().await;
                match st.store.idempotency_renew(&k, &st.instance_id, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Lapsed (the daemon stalled past the lease) and maybe taken: a retry
                        // may run concurrently; nothing more to renew.
                        tracing::warn!(key = %k.scoped(), "idempotency key lease lost while its request runs");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(key = %k.scoped(), error = %e, "idempotency key lease not renewed")
                    }
                }
            }
        });
        LeaseRenewal {
            key: key.clone(),
            task,
        }
    }

    /// Stops renewing; returns the key.
    fn stop(self) -> IdemKey {
        self.task.abort();
        self.key.clone()
    }
}

impl Drop for LeaseRenewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Uses up a single-use token's jti. A replay, or a token the store cannot vouch for (issued
/// before the embedded store's record began), is a 401.
async fn claim_single_use(st: &AppState, ctx: &Ctx, token: &Verified) -> Result<(), ApiError> {
    let Some(su) = &token.single_use else {
        return Ok(());
    };
    let kind = match su.kind {
        TokenKind::Service => "service token",
        TokenKind::Capability => "capability token",
    };
    let reason = match st.store.claim_jti(su).await {
        Ok(JtiClaim::Claimed) => return Ok(()),
        Ok(JtiClaim::Replayed) => format!("{kind}: replayed single-use token"),
        Ok(JtiClaim::PredatesRecord { since }) => format!(
            "{kind}: single-use token issued before {since} (unix), when this daemon's replay \
             record begins; the embedded store forgets used tokens on restart"
        ),
        Err(e) => return Err(ApiError::SandboxUnavailable(e.to_string())),
    };
    Err(ctx.unauthorized(st, &reason))
}

fn replay(r: StoredResponse) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::OK);
    (
        status,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::HeaderName::from_static("idempotent-replayed"),
                HeaderValue::from_static("true"),
            ),
        ],
        r.body,
    )
        .into_response()
}

/// From an authenticated, parsed request to a finished execution's status and JSON body.
///
/// The order matters: everything that can refuse the request (policy, backend, a run slot) comes
/// before the single-use token is claimed, and the claim before the `execution_start` line; from
/// that line on the request is admitted and ends in exactly one end line (see [`AdmittedRun`]).
async fn run_admitted(
    st: &Arc<AppState>,
    req: ExecuteRequest,
    action: ActionType,
    timeout: Option<u64>,
    cap: &Verified,
    ctx: &Ctx,
    idempotency_key: Option<String>,
) -> Result<(StatusCode, String), ApiError> {
    let ask = Ask {
        action_type: Some(action),
        command: &req.command,
        args: &req.args,
        timeout_seconds: timeout,
        profile: req.profile.as_deref(),
        env: &req.env,
    };
    let decided = if action == ActionType::External {
        crate::executors::invoke::decide(
            &st.executors,
            &st.policy,
            &ask,
            &cap.grant,
            &req.external_call(),
        )
    } else {
        st.policy.decide(&ask, &cap.grant).map(|p| (p, None))
    };
    let (plan, external) = match decided {
        Ok(p) => p,
        Err(PolicyError::Refused(r)) => {
            let list = r.rule == "allowlist";
            return Err(ctx.forbidden(st, r.reason, list));
        }
        Err(PolicyError::Invalid(m)) => return Err(ApiError::InvalidRequest(m)),
        Err(PolicyError::Unavailable(m)) => return Err(ApiError::SandboxUnavailable(m)),
    };
    let backend = st.backends.get(&plan.backend).cloned().ok_or_else(|| {
        ApiError::SandboxUnavailable(format!(
            "backend {} is not configured on this daemon",
            plan.backend.as_str()
        ))
    })?;
    let slots = st
        .slots
        .get(&plan.backend)
        .cloned()
        .ok_or_else(|| ApiError::SandboxUnavailable("no slots".into()))?;
    let permit = slots
        .try_acquire_owned()
        .map_err(|_| ApiError::Overloaded)?;

    let exec_id = format!("exec-{}", uuid::Uuid::new_v4().simple());
    let (argv_tail, stdin, extra_files, def_sha) = match &external {
        Some(x) => (
            x.argv_tail.clone(),
            Some(x.envelope.clone()),
            x.extra_files.clone(),
            Some(x.def_sha256.clone()),
        ),
        None => (
            req.args.clone(),
            req.stdin.as_ref().map(|s| s.clone().into_bytes()),
            Vec::new(),
            None,
        ),
    };
    let mut spec = plan.run_spec(&exec_id, &argv_tail, stdin, &st.config.sandbox.docker.image);
    spec.fs.extra_files = extra_files;
    if let Some(x) = &external {
        spec.env.extend(x.env.clone());
    }
    spec.cancel = Some(st.kill_switch.subscribe());
    let inv_hash = invocation_hash(&json!({
        "action_type": action.as_str(),
        "command": plan.command,
        "path": plan.path,
        "args": argv_tail,
        "stdin_sha256": spec.stdin.as_deref().map(sha256_prefixed),
        "env": spec.env,
        "profile": plan.profile.name,
        "backend": plan.backend.as_str(),
        "image": spec.image,
        "executor_def_sha256": def_sha,
        "limits": spec.limits,
    }));
    let cmd_hash = command_hash(&req.command, &req.args);
    let timestamp = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let backend_label = plan.backend.as_str();

    // Single-use tokens are consumed only once the request is otherwise acceptable to run.
    claim_single_use(st, ctx, cap).await?;
    let claimed = cap.single_use.as_ref();
    let run = audit::Run {
        request_id: ctx.request_id.clone(),
        exec_id: exec_id.clone(),
        subject: ctx.subject.clone(),
        token_id: cap.token_id.clone(),
        action_type: action.as_str().into(),
        command: req.command.clone(),
        args: req.args.clone(),
        command_hash: cmd_hash.clone(),
        invocation_hash: inv_hash.clone(),
        backend: backend_label.into(),
        profile: plan.profile.name.clone(),
        idempotency_key,
    };
    // Nothing runs unaudited. A refused start bought no run: the token stays usable (and the
    // caller releases the idempotency key on any error).
    let admitted = match AdmittedRun::admit(&st.audit, &st.metrics, run) {
        Ok(a) => a,
        Err(e) => {
            if let Some(token) = claimed
                && let Err(e) = st.store.release_jti(token).await
            {
                tracing::error!(request_id = %ctx.request_id, error = %e, "single-use token not released");
            }
            return Err(ApiError::SandboxUnavailable(format!(
                "audit log unavailable: {}",
                e.cause()
            )));
        }
    };
    tracing::info!(request_id = %ctx.request_id, %exec_id, command = %plan.command, backend = backend_label, profile = %plan.profile.name, "execution start");

    st.metrics
        .inflight
        .with_label_values(&[backend_label])
        .inc();
    // The run is its own task too: a panic in a backend fails this request, not the daemon.
    let task = tokio::spawn(async move {
        let r = backend.run(spec).await;
        drop(permit);
        r
    });
    let joined = task.await;
    st.metrics
        .inflight
        .with_label_values(&[backend_label])
        .dec();
    // No outcome: the end line is an execution_error with what the caller is told and why.
    let failed = match joined {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(SandboxError::Unavailable(m))) => Err((ApiError::SandboxUnavailable(m.clone()), m)),
        Ok(Err(e)) => Err((ApiError::Internal(format!("{exec_id}: {e}")), e.to_string())),
        Err(e) => Err((
            ApiError::Internal(format!("{exec_id}: run task failed: {e}")),
            format!("run task failed: {e}"),
        )),
    };
    let outcome = match failed {
        Ok(o) => o,
        Err((answer, error)) => {
            admitted.fail(answer.error_type(), &error);
            return Err(answer);
        }
    };

    let mut result = build_result(&plan, &outcome, external.is_some());
    result.exec_id = exec_id.clone();
    result.provenance = Provenance {
        arm_id: "executor",
        timestamp,
        action_type: action.as_str(),
        command_hash: cmd_hash,
        capabilities_used: plan.capabilities_used.iter().map(|c| c.as_str()).collect(),
        exec_id: exec_id.clone(),
        request_id: ctx.request_id.clone(),
        token_id: cap.token_id.clone(),
        subject: ctx.subject.clone(),
        backend: backend_label,
        profile: plan.profile.name.clone(),
        invocation_hash: inv_hash,
        stdout_sha256: sha256_prefixed(&outcome.stdout),
        stderr_sha256: sha256_prefixed(&outcome.stderr),
        executor_def_sha256: def_sha,
        audit_seq: None,
        metadata: req.metadata.clone(),
    };
    let timed_out = outcome.timed_out();
    if timed_out {
        result.error = Some(format!(
            "Command execution exceeded timeout of {} seconds",
            plan.timeout_seconds
        ));
        result.error_type = Some("ExecutionTimeout");
        result.retryable = Some(false);
    }
    result.provenance.audit_seq = admitted.finish(run_end(&result));
    record_metrics(st, &plan, &result, &outcome);
    tracing::info!(request_id = %ctx.request_id, %exec_id, outcome = result.outcome, exit_code = result.exit_code, duration_ms = result.duration_ms, "execution end");
    let status = if timed_out {
        StatusCode::REQUEST_TIMEOUT
    } else {
        StatusCode::OK
    };
    let body = serde_json::to_string(&result).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok((status, body))
}

/// An admitted execution: its `execution_start` line is written, and exactly one end line
/// follows whatever happens — `execution` ([`AdmittedRun::finish`]), `execution_error`
/// ([`AdmittedRun::fail`]), or, when it is dropped without either (a panic on the request
/// path), an `execution_error` written on drop.
struct AdmittedRun<'a> {
    audit: &'a AuditLog,
    metrics: &'a Metrics,
    run: audit::Run,
    ended: bool,
}

impl<'a> AdmittedRun<'a> {
    /// Writes the start line; when that fails nothing may run. The line is not fsync'd on its
    /// own: the end line's fsync covers it, one per request.
    fn admit(
        audit: &'a AuditLog,
        metrics: &'a Metrics,
        run: audit::Run,
    ) -> Result<Self, AuditError> {
        let event = AuditEvent::ExecutionStart(run.clone());
        if let Err(e) = audit.append(&event) {
            count_failed_append(metrics, &event, &e);
            return Err(e);
        }
        Ok(AdmittedRun {
            audit,
            metrics,
            run,
            ended: false,
        })
    }

    /// The run reached an outcome; returns the end line's seq.
    fn finish(mut self, end: RunEnd) -> Option<u64> {
        self.ended = true;
        let event = AuditEvent::Execution {
            run: self.run.clone(),
            end: Box::new(end),
        };
        record(self.audit, self.metrics, &event)
    }

    /// The run ended without an outcome.
    fn fail(mut self, error_type: &'static str, error: &str) -> Option<u64> {
        self.ended = true;
        self.write_error(error_type, error)
    }

    fn write_error(&self, error_type: &'static str, error: &str) -> Option<u64> {
        self.metrics
            .executions
            .with_label_values(&[self.run.action_type.as_ref(), "false"])
            .inc();
        self.metrics
            .executions_by_backend
            .with_label_values(&[self.run.backend.as_ref(), &self.run.profile, "error"])
            .inc();
        let event = AuditEvent::ExecutionError {
            run: self.run.clone(),
            error_type,
            error: error.to_string(),
        };
        record(self.audit, self.metrics, &event)
    }
}

impl Drop for AdmittedRun<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.write_error(
                "InternalError",
                "the request ended before its run's end line was written",
            );
        }
    }
}

/// Ends the runs an earlier daemon process started on this audit log and never ended (it
/// stopped mid-run: a crash, a kill): one `execution_error` line each, and the Idempotency-Key
/// such a run held is released so that a retry runs. Called once at start, before serving.
pub async fn record_interrupted(audit: &AuditLog, store: &dyn StateStore, metrics: &Metrics) {
    for i in audit.interrupted() {
        tracing::warn!(
            exec_id = %i.run.exec_id,
            instance = %i.instance,
            start_seq = i.seq,
            "a run of an earlier daemon process never ended: recording it"
        );
        let event = AuditEvent::ExecutionError {
            run: i.run.clone(),
            error_type: "DaemonStopped",
            error: format!(
                "the daemon (instance {}) stopped during the run",
                i.instance
            ),
        };
        record(audit, metrics, &event);
        metrics.interrupted_runs.inc();
        let Some(scoped) = &i.run.idempotency_key else {
            continue;
        };
        let Some(key) = IdemKey::from_scoped(scoped) else {
            tracing::error!(exec_id = %i.run.exec_id, idempotency_key = %scoped, "idempotency key of an interrupted run not released: not a scoped key");
            continue;
        };
        if let Err(e) = store.idempotency_release(&key, &i.instance).await {
            tracing::error!(exec_id = %i.run.exec_id, error = %e, "idempotency key of an interrupted run not released");
        }
    }
}

/// Appends `event`. A failure is logged and counted, not returned: the answer still goes out.
fn record(audit: &AuditLog, metrics: &Metrics, event: &AuditEvent) -> Option<u64> {
    match audit.append(event) {
        Ok(seq) => Some(seq),
        Err(e) => {
            count_failed_append(metrics, event, &e);
            None
        }
    }
}

fn count_failed_append(metrics: &Metrics, event: &AuditEvent, e: &AuditError) {
    metrics
        .audit_append_failures
        .with_label_values(&[event.name()])
        .inc();
    tracing::error!(error = %e, event = event.name(), "audit append failed");
}

/// The bytes as standard base64 when they are not valid UTF-8 (the text field then lost some).
fn b64_unless_utf8(bytes: &[u8]) -> Option<String> {
    use base64::Engine;
    std::str::from_utf8(bytes)
        .is_err()
        .then(|| base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn build_result(plan: &Plan, o: &RunOutcome, external: bool) -> ExecutionResult {
    let outcome = outcome_name(o);
    let success = outcome == "success";
    let (error_code, error) = if external {
        crate::executors::invoke::error_fields(o, outcome)
    } else {
        (None, None)
    };
    ExecutionResult {
        success,
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        stdout_b64: b64_unless_utf8(&o.stdout),
        stderr_b64: b64_unless_utf8(&o.stderr),
        exit_code: o.exit_code(),
        duration_ms: o.duration.as_millis() as u64,
        provenance: Provenance {
            arm_id: "executor",
            timestamp: String::new(),
            action_type: plan.action_type.as_str(),
            command_hash: String::new(),
            capabilities_used: Vec::new(),
            exec_id: String::new(),
            request_id: String::new(),
            token_id: None,
            subject: None,
            backend: plan.backend.as_str(),
            profile: String::new(),
            invocation_hash: String::new(),
            stdout_sha256: String::new(),
            stderr_sha256: String::new(),
            executor_def_sha256: None,
            audit_seq: None,
            metadata: None,
        },
        exec_id: String::new(),
        outcome,
        backend: plan.backend.as_str(),
        profile: plan.profile.name.clone(),
        stdout_truncated: o.stdout_truncated,
        stderr_truncated: o.stderr_truncated,
        peak_memory_kib: o.peak_memory_kib,
        oom: o.oom,
        killed_reason: o.killed_reason.map(KilledReason::as_str),
        error_code,
        network: (plan.profile.network.mode == crate::policy::profile::NetworkMode::Egress)
            .then(|| o.network.clone()),
        error,
        error_type: None,
        retryable: None,
    }
}

/// The audit end line's view of a result.
fn run_end(r: &ExecutionResult) -> RunEnd {
    RunEnd {
        capabilities_used: r.provenance.capabilities_used.clone(),
        outcome: r.outcome,
        exit_code: r.exit_code,
        duration_ms: r.duration_ms,
        killed_reason: r.killed_reason,
        oom: r.oom,
        peak_memory_kib: r.peak_memory_kib,
        stdout_sha256: r.provenance.stdout_sha256.clone(),
        stderr_sha256: r.provenance.stderr_sha256.clone(),
        stdout_truncated: r.stdout_truncated,
        stderr_truncated: r.stderr_truncated,
        executor_def_sha256: r.provenance.executor_def_sha256.clone(),
        error_code: r
            .provenance
            .executor_def_sha256
            .is_some()
            .then_some(r.error_code),
        network: r.network.clone(),
        metadata: r.provenance.metadata.clone(),
    }
}

fn record_metrics(st: &AppState, plan: &Plan, r: &ExecutionResult, o: &RunOutcome) {
    let m = &st.metrics;
    m.executions
        .with_label_values(&[
            plan.action_type.as_str(),
            if r.success { "true" } else { "false" },
        ])
        .inc();
    m.executions_by_backend
        .with_label_values(&[plan.backend.as_str(), &plan.profile.name, r.outcome])
        .inc();
    m.duration.observe(o.duration.as_secs_f64());
    m.duration_by_backend
        .with_label_values(&[plan.backend.as_str()])
        .observe(o.duration.as_secs_f64());
    if o.timed_out() {
        m.timeouts.inc();
    }
    if o.oom {
        m.ooms.inc();
    }
    if o.killed_reason == Some(KilledReason::OutputLimit) {
        m.output_truncations.inc();
    }
    for c in &o.network {
        let verdict = if c.allowed {
            "allowed"
        } else if c.is_refusal() {
            "refused"
        } else {
            "failed"
        };
        m.egress_connections.with_label_values(&[verdict]).inc();
    }
}

#[cfg(test)]
mod tests;
