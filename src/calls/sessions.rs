//! A session call, whichever front end carries it (the session routes of the REST API, the
//! session tools of `/mcp`): its caller as the session's owner (the calling service and the
//! tenant), the caller's session or exec (another's is 404, exactly like one that does not
//! exist), and the session service's errors as answers.
//!
//! Owns: finding the caller's session for a call. Must not: read HTTP beyond the headers that
//! carry the caller, or manage sessions itself (the session service does).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::AppState;
use super::caller::{Caller, capability_token, unauthorized};
use super::error::ApiError;
use super::run::{ClientLink, IdemAsk, RunJob, RunMode, Served, Work, fingerprint, what_runs};
use crate::auth::Verified;
use crate::execution::ExecutionRequest;
use crate::execution::record::KnownRequest;
use crate::execution::runs::LiveRun;
use crate::sessions::{
    ExecParts, FileError, NewSession, Owner, PreparedExec, PreparedProcess, Session, SessionError,
    SessionInfo, SessionLimits, UploadError,
};
use crate::state::IdemKey;

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Invalid(m) => ApiError::InvalidRequest(m),
            SessionError::Busy(id) => ApiError::SessionBusy(id),
            SessionError::TooMany(m) => ApiError::SessionLimit(m),
            SessionError::NotFound => ApiError::SessionNotFound,
            SessionError::StoreFull(m) => ApiError::StoreFull(m),
            SessionError::Execution(e) => e.into(),
        }
    }
}

impl From<FileError> for ApiError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::InvalidPath(m) | FileError::NotAFile(m) => ApiError::InvalidRequest(m),
            FileError::NotFound(p) => ApiError::FileNotFound(p),
            FileError::TooLarge { .. } => ApiError::FileTooLarge(e.to_string()),
            FileError::NoSpace => ApiError::WorkspaceFull,
            FileError::Busy(m) => ApiError::InvalidRequest(m),
            FileError::BadArchive(m) => ApiError::InvalidRequest(m),
            FileError::ArchiveTooLarge(m) => ApiError::FileTooLarge(m),
            FileError::NoPids(m) => ApiError::PidsExhausted(m),
            FileError::Io(m) => ApiError::Internal(m),
        }
    }
}

/// A failed file call of `session` as its answer: busy is the session's 409, and a call that failed
/// because the session's sandbox went away (it died, or the session ended meanwhile) says so
/// (404) instead of a retryable 500.
pub fn file_failure(session: &Session, e: FileError) -> ApiError {
    match e {
        FileError::Busy(_) => ApiError::SessionBusy(session.id.clone()),
        FileError::Io(_) if session.sandbox_gone().is_some() => ApiError::SessionGone(format!(
            "session {} is gone: {}",
            session.id,
            session.sandbox_gone().unwrap_or_default()
        )),
        other => other.into(),
    }
}

/// The calling service and its tenant, as a session's owner.
pub async fn caller(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
) -> Result<(Owner, crate::auth::Verified, KnownRequest), ApiError> {
    let caller = Caller::authenticate(st, headers, rid).await?;
    let owner = caller.session_owner(headers)?;
    Ok((owner, caller.service, caller.known))
}

/// How a call touches its session: reading it leaves its idle time running; an exec or a file
/// call starts it again.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    Read,
    Use,
}

/// A session a call names, as the caller's own: running (with a sandbox), or paused.
pub enum Looked {
    Live(Arc<Session>),
    Paused(Box<SessionInfo>),
}

/// The caller's session `id`, running or paused, or 404. A call that uses the session (an exec,
/// a file call) resumes a paused one.
pub async fn look_up(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    touch: Touch,
) -> Result<(Looked, Owner, crate::auth::Verified, KnownRequest), ApiError> {
    let (owner, service, known) = caller(st, headers, rid.clone()).await?;
    let looked = owned(st, &owner, rid, id, touch).await?;
    Ok((looked, owner, service, known))
}

/// `owner`'s session `id`, running or paused, or 404 (see [`look_up`]), for a front end that
/// found the owner itself.
pub async fn owned(
    st: &AppState,
    owner: &Owner,
    rid: String,
    id: &str,
    touch: Touch,
) -> Result<Looked, ApiError> {
    let session = match touch {
        Touch::Read => st.sessions.get(owner, id),
        Touch::Use => st.sessions.use_session(owner, id),
    };
    if let Some(s) = &session
        && st.sessions.end_if_lost(s).await
    {
        return Err(ApiError::SessionGone(
            st.sessions.lost(owner, id).unwrap_or_default(),
        ));
    }
    if let Some(s) = session {
        return Ok(Looked::Live(s));
    }
    if let Some(info) = st.sessions.paused(owner, id) {
        return Ok(match touch {
            Touch::Read => Looked::Paused(Box::new(info)),
            Touch::Use => Looked::Live(st.sessions.resume(owner, id, rid).await?),
        });
    }
    // Resumed by another call meanwhile: open now.
    if let Some(s) = st.sessions.get(owner, id) {
        return Ok(Looked::Live(s));
    }
    Err(st
        .sessions
        .lost(owner, id)
        .map_or(ApiError::SessionNotFound, ApiError::SessionGone))
}

/// The caller's session `id` with its sandbox (a paused one is resumed when `touch` uses it, and
/// is 404 to a call that only reads), or 404.
pub async fn session_of(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    touch: Touch,
) -> Result<(Arc<Session>, crate::auth::Verified, KnownRequest), ApiError> {
    match look_up(st, headers, rid, id, touch).await? {
        (Looked::Live(s), _, service, known) => Ok((s, service, known)),
        (Looked::Paused(_), ..) => Err(ApiError::SessionNotFound),
    }
}

/// The caller's exec `exec_id` of its session `id`, as the run routes take it: the owner of the
/// session's runs and what refusals tell. An exec of another session is 404.
pub async fn session_exec(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
    exec_id: &str,
) -> Result<(String, KnownRequest), ApiError> {
    let (looked, owner, _, known) = look_up(st, headers, rid, id, Touch::Read).await?;
    let ran = match looked {
        Looked::Live(s) => s.ran(exec_id),
        // A paused session's execs are served as a running one's.
        Looked::Paused(_) => st.sessions.paused_ran(&owner, id, exec_id),
    };
    if !ran {
        return Err(ApiError::ExecutionNotFound);
    }
    Ok((owner.runs(), known))
}

/// The longest a session call handed to the replica that holds the session may take to begin
/// its answer: a synchronous exec's begins when its run ends (at most the async limit, as for
/// any session exec), plus room for its queue and setup.
pub const FORWARDED_ANSWER_TIMEOUT: Duration =
    Duration::from_secs(crate::policy::profile::MAX_ASYNC_TIMEOUT_SECONDS + 60);

/// Where the session `id` lives when another replica holds it (the state store says which): its
/// address, for a call that came from a client (`forwarded` false). None: it is served here (held
/// here, held nowhere, or a call another replica handed on). A replica that holds it but
/// recorded no address is answered as an unknown session.
pub async fn held_elsewhere(
    st: &AppState,
    id: &str,
    forwarded: bool,
) -> Result<Option<String>, ApiError> {
    if forwarded || st.sessions.holds(id) {
        return Ok(None);
    }
    let record = match st.store.session_get(id).await {
        Ok(Some(r)) if r.instance != st.instance_id => r,
        Ok(_) => return Ok(None),
        Err(e) => return Err(ApiError::SandboxUnavailable(e.to_string())),
    };
    // The replica that holds the session is the only one that can tell whether the caller owns
    // it: one it cannot be asked is answered exactly like an unknown id, whoever calls (where the
    // session was goes to the log only).
    match record.address {
        Some(address) => Ok(Some(address)),
        None => {
            tracing::warn!(session_id = %id, instance = %record.instance, "session's replica did not record how to reach it: answered as unknown");
            Err(ApiError::SessionNotFound)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The calls

/// The body of `POST /v1/sandbox/sessions`. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// A configured session language (`/capabilities` lists them as `session_languages`).
    pub language: String,
    /// A sandbox profile the grant permits (default: the language's).
    #[serde(default)]
    pub profile: Option<String>,
    /// The session's life, at most `sessions.max_ttl_seconds`.
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    /// How long the session may go without an exec or file call.
    #[serde(default)]
    pub idle_timeout_seconds: Option<u64>,
    /// Limits that may only tighten the profile's.
    #[serde(default)]
    pub limits: Option<SessionLimits>,
    /// The capability token (or the `X-Capability-Token` header; not both).
    #[serde(default)]
    pub capability_token: Option<String>,
}

/// Makes a session for `caller` (as owner with the tenant `headers` name) from `asked`: the
/// grant is its capability token (body or `X-Capability-Token`), else the service token's own
/// capabilities when `sessions.accept_service_capabilities` or the front end's contract
/// (`service_grant`: MCP) allows it; else the audited 401.
pub async fn create(
    st: &AppState,
    mut caller: Caller,
    headers: &HeaderMap,
    asked: CreateBody,
    service_grant: bool,
) -> Result<Arc<Session>, ApiError> {
    let owner = caller.session_owner(headers)?;
    let token = capability_token(asked.capability_token.as_deref(), headers)?;
    let grant = match token {
        // A single-use token is used up by the session service once the session can be made.
        Some(t) => caller.capability(st, t)?,
        None if st.config.sessions.accept_service_capabilities || service_grant => {
            caller.service_grant()
        }
        None => {
            return Err(unauthorized(
                st,
                &caller.known,
                "missing capability token (sessions.accept_service_capabilities is off)",
            ));
        }
    };
    Ok(st
        .sessions
        .create(NewSession {
            request_id: caller.known.request_id.clone(),
            owner,
            language: asked.language,
            profile: asked.profile,
            ttl: asked.ttl_seconds.map(Duration::from_secs),
            idle_timeout: asked.idle_timeout_seconds.map(Duration::from_secs),
            limits: asked.limits.unwrap_or_default(),
            grant,
        })
        .await?)
}

/// Pauses the caller's session `id`: its workspace saved, its sandbox and processes ended; the
/// session as it is now. The caller should run this on a task of its own: a pause that began is
/// finished even if its client goes away.
pub async fn pause(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
) -> Result<SessionInfo, ApiError> {
    let (owner, ..) = caller(st, headers, rid.clone()).await?;
    pause_owned(st, &owner, rid, id).await
}

/// Pauses `owner`'s session `id` (see [`pause`]), for a front end that found the owner itself.
pub async fn pause_owned(
    st: &AppState,
    owner: &Owner,
    rid: String,
    id: &str,
) -> Result<SessionInfo, ApiError> {
    if let Some(s) = st.sessions.get(owner, id)
        && st.sessions.end_if_lost(&s).await
    {
        return Err(ApiError::SessionGone(
            st.sessions.lost(owner, id).unwrap_or_default(),
        ));
    }
    Ok(st.sessions.pause(owner, id, rid).await?)
}

/// Resumes the caller's session `id` (a fresh sandbox with the saved workspace); a running one
/// is answered as it is.
pub async fn resume(
    st: &AppState,
    headers: &HeaderMap,
    rid: String,
    id: &str,
) -> Result<SessionInfo, ApiError> {
    let (owner, ..) = caller(st, headers, rid.clone()).await?;
    resume_owned(st, &owner, rid, id).await
}

/// Resumes `owner`'s session `id` (see [`resume`]), for a front end that found the owner itself.
pub async fn resume_owned(
    st: &AppState,
    owner: &Owner,
    rid: String,
    id: &str,
) -> Result<SessionInfo, ApiError> {
    Ok(match owned(st, owner, rid, id, Touch::Use).await? {
        Looked::Live(s) => s.describe(),
        Looked::Paused(info) => *info,
    })
}

/// Ends `owner`'s session `id` (running or paused), or 404.
pub async fn delete(st: &AppState, owner: &Owner, id: &str) -> Result<(), ApiError> {
    if st.sessions.delete(owner, id).await || st.sessions.delete_paused(owner, id) {
        Ok(())
    } else {
        Err(ApiError::SessionNotFound)
    }
}

/// The body of `POST /v1/sandbox/sessions/{id}/exec`. Unknown fields are refused; every optional
/// field may be `null`, the same as leaving it out. An Idempotency-Key's fingerprint covers it
/// as parsed (see `execute::what_runs`), with the session, the calling service and the tenant.
#[derive(Debug, Deserialize, Serialize, ToSchema, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// The program, in the session's language; its interpreter runs it as a file.
    pub code: String,
    /// Written to the program's stdin, then closed.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Only names the profile allows.
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub env: BTreeMap<String, String>,
    /// A directory of the workspace (relative, or absolute under `/workspace`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// The deadline in milliseconds, up to the profile's async maximum whether the exec is
    /// synchronous, async or streamed (a synchronous exec's connection stays open for it); 0 or
    /// none is the profile's default.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 86_400_000)]
    pub timeout_ms: Option<u64>,
    /// Answer 202 with the run's links at once.
    #[serde(
        default,
        rename = "async",
        deserialize_with = "crate::calls::caller::null_as_default"
    )]
    #[schema(nullable)]
    pub run_async: bool,
    /// Cancel the exec when the caller goes away before its answer.
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub cancel_on_disconnect: bool,
    /// A background process: answer 202 with its `process_id` at once; it runs beside the
    /// session's other execs (up to `sessions.max_processes`) until it ends, is signalled, or
    /// the session ends. Its stdin stays open for `…/processes/{process_id}/stdin`; its deadline
    /// is `timeout_ms`, else the profile's async maximum.
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub background: bool,
    /// Keep the exec's stdin open after `stdin` for `…/execs/{exec_id}/stdin` (an async or
    /// streamed exec; a background one always has it).
    #[serde(default, deserialize_with = "crate::calls::caller::null_as_default")]
    #[schema(nullable)]
    pub stdin_open: bool,
    /// Put the exec's signed receipt in its answer as `receipt` (and in a stream's `result`
    /// event); every finished exec has one at its `/execs/{exec_id}/receipt` either way.
    #[serde(
        default,
        deserialize_with = "crate::calls::caller::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    #[schema(nullable)]
    pub receipt: bool,
}

/// How the caller of a session exec waits, and what it holds besides the body.
pub struct ExecAsk {
    pub mode: RunMode,
    /// The timeout checked for the mode (see [`super::run::timeout_of`]); None: the profile's.
    pub timeout: Option<Duration>,
    /// The Idempotency-Key the caller sent, if any.
    pub idempotency_key: Option<String>,
    /// The front end, when not the REST API (`mcp`): the exec's audit lines name it.
    pub via: Option<&'static str>,
}

/// A session exec's run: a foreground exec, or a background process.
pub enum ExecJob {
    Exec(RunJob<SessionExec>),
    Process(RunJob<SessionProcess>),
}

impl ExecJob {
    /// See [`RunJob::serve`].
    pub async fn serve(self, st: &Arc<AppState>, client: &ClientLink) -> Result<Served, ApiError> {
        match self {
            ExecJob::Exec(job) => job.serve(st, client).await,
            ExecJob::Process(job) => job.serve(st, client).await,
        }
    }
}

/// The run of `asked` in `session` for its caller (`service`, `known`), waited for as `mode`
/// with the checked `timeout`: its checks (NUL in the code, a background exec streamed, stdin
/// kept open for a synchronous one) and the Idempotency-Key's fingerprint, which binds a replay
/// to the session, its service and tenant, and what runs.
pub fn exec_job(
    session: Arc<Session>,
    service: &Verified,
    known: &KnownRequest,
    mut asked: ExecBody,
    how: ExecAsk,
) -> Result<ExecJob, ApiError> {
    let ExecAsk {
        mode,
        timeout,
        idempotency_key,
        via,
    } = how;
    // As checked (0 is none): the Idempotency-Key's fingerprint covers it so.
    asked.timeout_ms = timeout.map(|t| t.as_millis() as u64);
    let (inline_receipt, cancel_on_disconnect) = (asked.receipt, asked.cancel_on_disconnect);
    if asked.code.contains('\0') {
        return Err(ApiError::InvalidRequest(
            "code may not contain NUL bytes".into(),
        ));
    }
    // Keys are scoped like the session's runs: by the calling service and the tenant.
    let idempotency = match idempotency_key {
        Some(key) => {
            let what = json!({
                "service": session.owner.subject,
                "tenant": session.owner.tenant,
                "session": session.id,
                "request": what_runs(&asked)?,
            });
            Some(IdemAsk {
                key: IdemKey {
                    subject: session.owner.runs(),
                    key,
                },
                fingerprint: fingerprint(&what)?,
            })
        }
        None => None,
    };
    let background = asked.background;
    if background && mode == RunMode::Stream {
        return Err(ApiError::InvalidRequest(
            "a background exec answers 202 with its links: follow its stream link instead of asking for a stream".into(),
        ));
    }
    if asked.stdin_open && !background && mode == RunMode::Sync {
        return Err(ApiError::InvalidRequest(
            "stdin_open needs an async or streamed exec: a synchronous one answers only once it ended".into(),
        ));
    }
    let id = session.id.clone();
    let parts = ExecParts {
        owner: session.owner.runs(),
        request_id: known.request_id.clone(),
        subject: service.subject.clone().or_else(|| Some("-".into())),
        code: asked.code,
        stdin: asked.stdin,
        env: asked.env,
        cwd: asked.cwd,
        timeout_ms: asked.timeout_ms,
        long_run: true,
        background: None,
        stdin_open: asked.stdin_open && !background,
        terminal: None,
        via,
    };
    let links = format!("/v1/sandbox/sessions/{id}/execs/");
    if background {
        return Ok(ExecJob::Process(RunJob {
            work: SessionProcess { session, parts },
            idempotency,
            mode: RunMode::Async,
            cancel_on_disconnect: false,
            timeout_status: StatusCode::OK,
            links,
            process_links: Some(format!("/v1/sandbox/sessions/{id}/processes/")),
            inline_receipt,
        }));
    }
    Ok(ExecJob::Exec(RunJob {
        work: SessionExec { session, parts },
        idempotency,
        mode,
        cancel_on_disconnect,
        timeout_status: StatusCode::OK,
        links,
        process_links: None,
        inline_receipt,
    }))
}

/// What a session's background process runs: a place among the session's processes is taken,
/// and its code written to a file of its own.
pub struct SessionProcess {
    session: Arc<Session>,
    parts: ExecParts,
}

impl Work for SessionProcess {
    /// The place, given back unless the process starts; the code file, kept until it ended.
    type Held = PreparedProcess;

    /// The grant is the session's, and the caller was found its owner before.
    async fn may_replay(&self, _: &AppState) -> Result<(), ApiError> {
        Ok(())
    }

    async fn prepare(self, st: &AppState) -> Result<(ExecutionRequest, Self::Held), ApiError> {
        Ok(st
            .sessions
            .prepare_process(&self.session, self.parts)
            .await?)
    }

    fn started(prepared: Self::Held, live: &Arc<LiveRun>) {
        prepared.started(live);
    }
}

/// What a session's exec runs, made once its Idempotency-Key is held: the session's one exec is
/// claimed, and its code written to a file of its own.
pub struct SessionExec {
    session: Arc<Session>,
    parts: ExecParts,
}

impl Work for SessionExec {
    /// The claim, given back unless the exec starts; the code file, kept until it answered.
    type Held = PreparedExec;

    /// The grant is the session's, and the caller was found its owner before.
    async fn may_replay(&self, _: &AppState) -> Result<(), ApiError> {
        Ok(())
    }

    async fn prepare(self, st: &AppState) -> Result<(ExecutionRequest, Self::Held), ApiError> {
        Ok(st.sessions.prepare_exec(&self.session, self.parts).await?)
    }

    fn started(prepared: Self::Held, live: &Arc<LiveRun>) {
        prepared.started(live);
    }
}

/// File calls that may hold a file's bytes in memory at once (each up to
/// `sessions.max_file_bytes`); one more is 429.
const MAX_FILE_CALLS: usize = 8;

/// The semaphore [`file_permit`] takes from.
pub fn file_calls() -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(MAX_FILE_CALLS))
}

/// A place among the file calls in progress, or 429.
pub fn file_permit(st: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    st.file_calls.clone().try_acquire_owned().map_err(|_| {
        ApiError::SessionLimit(format!(
            "{MAX_FILE_CALLS} file transfers are in progress on this daemon"
        ))
    })
}

/// The most one chunk of a file's answer holds.
const FILE_CHUNK: usize = 64 * 1024;

/// A file's bytes as an answer's body that holds `permit` until its last chunk was taken: a
/// reader that stops reading keeps its place among the file transfers (the body is polled for
/// the next chunk only once the previous one was written), so slow readers cannot hold more
/// than [`MAX_FILE_CALLS`] files in memory.
pub fn file_body(permit: tokio::sync::OwnedSemaphorePermit, bytes: Vec<u8>) -> axum::body::Body {
    let bytes = bytes::Bytes::from(bytes);
    let chunks =
        futures::stream::unfold((bytes, Some(permit)), |(mut rest, mut permit)| async move {
            if rest.is_empty() {
                permit.take();
                return None;
            }
            let chunk = rest.split_to(rest.len().min(FILE_CHUNK));
            Some((Ok::<_, std::convert::Infallible>(chunk), (rest, permit)))
        });
    axum::body::Body::from_stream(chunks)
}

/// Writes `bytes` to `path` in `session`'s workspace for the request `request_id`: at most
/// `sessions.max_file_bytes` (413 past it, whichever front end read the bytes).
pub async fn upload(
    st: &AppState,
    session: &Session,
    request_id: String,
    path: &str,
    bytes: Vec<u8>,
) -> Result<(), ApiError> {
    let max = st.config.sessions.max_file_bytes;
    if bytes.len() > max {
        return Err(ApiError::PayloadTooLarge(max));
    }
    st.sessions
        .upload(session, request_id, path, bytes)
        .await
        .map_err(|e| match e {
            UploadError::Ended => ApiError::SessionNotFound,
            UploadError::Unrecorded => ApiError::SandboxUnavailable(e.to_string()),
            UploadError::File(e) => file_failure(session, e),
        })
}

/// The bytes of `path` in `session`'s workspace (at most `sessions.max_file_bytes`).
pub async fn read_file(st: &AppState, session: &Session, path: &str) -> Result<Vec<u8>, ApiError> {
    let max = st.config.sessions.max_file_bytes as u64;
    session
        .read_file(path, max)
        .await
        .map_err(|e| file_failure(session, e))
}

/// A directory's entries.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileList {
    /// The directory, as asked.
    pub path: String,
    pub entries: Vec<crate::sessions::Entry>,
}

/// The entries of the directory `path` of `session`'s workspace.
pub async fn list(session: &Session, path: String) -> Result<FileList, ApiError> {
    let entries = session
        .list(&path)
        .await
        .map_err(|e| file_failure(session, e))?;
    Ok(FileList { path, entries })
}
