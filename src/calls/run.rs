//! What every front end that runs something shares (`POST /execute` and a session's exec on the
//! REST API, the run tools of `/mcp`), in the order a run request goes through it:
//!
//! 1. [`RunMode`] and [`timeout_of`]: how the caller waits (sync, async or stream) and the
//!    timeout it asks for: one rule for every run.
//! 2. [`ClientLink::serve`]: the request is served on a task of its own, so a client that goes
//!    away does not cut the run's records short; only a request that asked for it
//!    (`cancel_on_disconnect`) has its run cancelled then.
//! 3. [`RunJob::serve`], with the front end's [`Work`]: the Idempotency-Key is held
//!    ([`HeldKey`]) or its stored answer replayed; a stream's permit is taken; the work becomes
//!    an [`ExecutionRequest`]; the run is admitted and started ([`start`]); the answer a retry
//!    gets is stored under the key.
//! 4. The answer, [`Served`]: a stored answer (its status and JSON body, [`answer_of`]) or the
//!    live run to stream; the front end renders it on its wire.
//!
//! Owns: run modes, idempotency, the client's disconnect, a run's answer as status and body.
//! Must not: parse a front end's wire or render on it, authenticate its caller (the front end
//! and [`super::caller`] do), or decide, admit or run anything itself (the execution service
//! does).

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;
use tracing::Instrument as _;
use utoipa::ToSchema;

use super::AppState;
use super::error::{ApiError, ErrorBody};
use crate::execution::runs::LiveRun;
use crate::execution::{ExecutionError, ExecutionRequest, Finished};
use crate::metrics::Metrics;
use crate::policy::profile::{MAX_ASYNC_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS};
use crate::provenance::sha256_prefixed;
use crate::state::{IdemBegin, IdemKey, StoredResponse};

// ---------------------------------------------------------------------------------------------
// 1. How the caller waits

/// How the caller waits for its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    /// For the answer, in this response.
    Sync,
    /// Not at all: 202 with the run's links.
    Async,
    /// As Server-Sent Events.
    Stream,
}

impl RunMode {
    /// Its label on `runs_started`.
    pub fn label(self) -> &'static str {
        match self {
            RunMode::Sync => "sync",
            RunMode::Async => "async",
            RunMode::Stream => "stream",
        }
    }

    /// A run of this mode, in an error message.
    pub fn run_words(self) -> &'static str {
        match self {
            RunMode::Async => "an async run",
            RunMode::Stream => "a streamed run",
            RunMode::Sync => "a synchronous run",
        }
    }
}

/// The timeout a run request asks for, in its route's unit.
#[derive(Debug, Clone, Copy)]
pub enum AskedTimeout {
    /// `/execute`'s `timeout_seconds`: 1-300 for a synchronous run (the wire's limit), up to
    /// 86400 for an async or streamed one (the profile's `max_async_timeout_seconds` clamps it).
    Seconds(Option<i64>),
    /// A session exec's `timeout_ms`: up to 86400 s whatever the mode (a step runs synchronously
    /// with its own timeout, so a synchronous exec may last as long as an async one); 0 is the
    /// profile's default, as none is.
    Millis(Option<u64>),
}

/// The timeout `asked` for a run of `mode`, checked (None: the profile's default): seconds 1-300
/// for a synchronous run (the wire's limit) and up to the async limit otherwise; milliseconds up
/// to the async limit whatever the mode, 0 being none. A refusal is a 400.
pub fn timeout_of(mode: RunMode, asked: AskedTimeout) -> Result<Option<Duration>, ApiError> {
    Ok(match asked {
        AskedTimeout::Seconds(asked) => {
            let max = if mode == RunMode::Sync {
                MAX_TIMEOUT_SECONDS
            } else {
                MAX_ASYNC_TIMEOUT_SECONDS
            };
            match asked {
                None => None,
                Some(t) if (1..=max as i64).contains(&t) => Some(Duration::from_secs(t as u64)),
                Some(t) => {
                    return Err(ApiError::InvalidRequest(format!(
                        "timeout_seconds must be between 1 and {max} for {}, got {t}",
                        mode.run_words()
                    )));
                }
            }
        }
        AskedTimeout::Millis(asked) => {
            let max_ms = 1000 * MAX_ASYNC_TIMEOUT_SECONDS;
            match asked {
                None | Some(0) => None,
                Some(t) if t <= max_ms => Some(Duration::from_millis(t)),
                Some(t) => {
                    return Err(ApiError::InvalidRequest(format!(
                        "timeout_ms must be between 0 and {max_ms}, got {t}"
                    )));
                }
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// 2. The client

/// The client of a run request, as its run sees it: whether it went away before its answer, and
/// the run to cancel then (one a synchronous request that said `cancel_on_disconnect` waits
/// for, once it started).
#[derive(Default)]
pub struct ClientLink {
    run: Mutex<Option<Disconnect>>,
    /// Raised when the client goes away: a request still waiting for a run slot gives up.
    gone: watch::Sender<bool>,
}

impl ClientLink {
    pub fn new() -> Arc<ClientLink> {
        Arc::new(ClientLink::default())
    }

    /// Serves `answer` (a request made with this link) on a task of its own: a client that
    /// disconnects mid-run does not cancel the run's audit line, metrics, in-flight gauge or
    /// stored idempotent result, only its reply; this link is told, and cancels the run it
    /// names.
    pub async fn serve<F, T>(self: &Arc<Self>, st: &Arc<AppState>, answer: F) -> Result<T, ApiError>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let mut guard = CancelIfDropped {
            st: st.clone(),
            client: self.clone(),
            armed: true,
        };
        let resp = detach(answer).await;
        guard.armed = false;
        resp
    }

    /// Whether the client went away.
    pub fn went_away(&self) -> bool {
        *self.gone.borrow()
    }

    /// Names the run to cancel if the client goes away; cancels it at once if it already has.
    pub fn arm(&self, st: &AppState, d: Disconnect) {
        *self.run.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
        if self.went_away() {
            self.cancel_named(st);
        }
    }

    /// Cancels the named run unless it has answered; whoever takes the name first cancels it.
    fn cancel_named(&self, st: &AppState) {
        let named = self.run.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(d) = named {
            d.cancel_unanswered(st, "client gone: cancelling its run");
        }
    }
}

/// Dropped while armed (the client went away before the answer): the request gives up its
/// place in a queue, and the run it names is cancelled.
struct CancelIfDropped {
    st: Arc<AppState>,
    client: Arc<ClientLink>,
    armed: bool,
}

impl Drop for CancelIfDropped {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Raised before the name is read: a run named after this sees the flag and cancels
        // itself (ClientLink::arm).
        self.client.gone.send_replace(true);
        self.client.cancel_named(&self.st);
    }
}

/// Serves `answer` on a task of its own, in the request's span: a client that goes away does
/// not stop it halfway (a session made, deleted or written is made, deleted or written whole).
pub async fn detach<F, T>(answer: F) -> Result<T, ApiError>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    // The task stays in the request's span: its steps are the request's.
    tokio::spawn(answer.in_current_span())
        .await
        .map_err(|e| ApiError::Internal(format!("request task failed: {e}")))
}

// ---------------------------------------------------------------------------------------------
// 3. The run

/// What a route runs: made into an execution request only once its Idempotency-Key is held (a
/// replay makes none).
pub trait Work: Send + 'static {
    /// What the work keeps from [`Work::prepare`] until its run started (dropped unused when
    /// admission fails).
    type Held: Send + 'static;

    /// Whether the caller may have the stored answer of its Idempotency-Key (its credentials
    /// are not in the fingerprint), checked before the answer is given.
    fn may_replay(&self, st: &AppState) -> impl Future<Output = Result<(), ApiError>> + Send;

    /// The execution request.
    fn prepare(
        self,
        st: &AppState,
    ) -> impl Future<Output = Result<(ExecutionRequest, Self::Held), ApiError>> + Send;

    /// Told the live run once it started (never, when admission failed).
    fn started(held: Self::Held, live: &Arc<LiveRun>);
}

/// One run request as its route parsed it: what runs, and how its caller waits.
pub struct RunJob<W> {
    pub work: W,
    /// The Idempotency-Key the caller sent, if any.
    pub idempotency: Option<IdemAsk>,
    pub mode: RunMode,
    pub cancel_on_disconnect: bool,
    /// The status of a synchronous answer whose run the wall clock ended.
    pub timeout_status: StatusCode,
    /// Where the run is read, streamed and cancelled, less its exec_id: `/v1/executions/` for
    /// `/execute`, the session's `/execs/` for a session's exec (the 202's links).
    pub links: String,
    /// A session's background process: where it is controlled, less its id (the session's
    /// `/processes/`); its 202 names it and these links too.
    pub process_links: Option<String>,
    /// The answer carries the run's receipt (`"receipt": true`).
    pub inline_receipt: bool,
}

impl<W: Work> RunJob<W> {
    /// The run, from its Idempotency-Key to its answer in the caller's mode.
    pub async fn serve(self, st: &Arc<AppState>, client: &ClientLink) -> Result<Served, ApiError> {
        let RunJob {
            work,
            idempotency,
            mode,
            cancel_on_disconnect,
            timeout_status,
            links,
            process_links,
            inline_receipt,
        } = self;
        // A retry of a finished request gets the stored answer without running again.
        let key = match idempotency {
            None => None,
            Some(ask) => match HeldKey::begin(st, ask).await? {
                Begun::Held(key) => Some(key),
                Begun::Done(stored) => {
                    work.may_replay(st).await?;
                    return Ok(Served::Answer {
                        answer: stored,
                        replayed: true,
                    });
                }
            },
        };
        // A stream's permit is taken before anything runs: a refused stream runs nothing, and
        // gives its Idempotency-Key back so that the retry its 429 invites is not refused as in
        // progress.
        let permit = match mode {
            RunMode::Stream => match StreamPermit::take(st) {
                Ok(p) => Some(p),
                Err(e) => {
                    HeldKey::release(key, st).await;
                    return Err(e);
                }
            },
            RunMode::Sync | RunMode::Async => None,
        };
        let (mut request, held) = match work.prepare(st).await {
            Ok(p) => p,
            Err(e) => {
                HeldKey::release(key, st).await;
                return Err(e);
            }
        };
        request.idempotency_key = key.as_ref().map(|k| k.lease.key.scoped());
        request.abandoned = Some(client.gone.subscribe());
        let owner = request.owner.clone();
        let request_id = request.request_id.clone();
        let how = How {
            mode,
            cancel_on_disconnect,
            timeout_status,
            links: &links,
            process_links: process_links.as_deref(),
            inline_receipt,
        };
        let answered = start::<W>(st, request, held, how, client).await;
        if let Some(key) = key {
            // A retry of a streamed request gets the run's links, as an async one does. A run
            // its caller cancelled by going away answered nobody: its retry runs again.
            let cancelled_for_leaving = cancel_on_disconnect && client.went_away();
            let for_retry = match &answered {
                Ok(Answer::Stored(_)) if cancelled_for_leaving => None,
                Ok(Answer::Stored(a)) if matches!(a.status, 200 | 202 | 408) => Some(a.clone()),
                Ok(Answer::Stream(live)) => Some(StoredResponse {
                    status: StatusCode::ACCEPTED.as_u16(),
                    body: accepted_body(&links, process_links.as_deref(), live.exec_id()),
                    receipt: None,
                }),
                _ => None,
            };
            key.finish(st, for_retry).await;
        }
        match answered? {
            Answer::Stored(a) => Ok(Served::Answer {
                answer: a,
                replayed: false,
            }),
            Answer::Stream(live) => {
                let cancel = cancel_on_disconnect.then(|| Disconnect {
                    live: live.clone(),
                    owner,
                    request_id,
                });
                let permit =
                    permit.ok_or_else(|| ApiError::Internal("stream without permit".into()))?;
                Ok(Served::Stream {
                    live,
                    permit,
                    cancel,
                })
            }
        }
    }
}

/// What a served run request answers: a stored answer (a replay's included), or the live run
/// to stream.
pub enum Served {
    Answer {
        answer: StoredResponse,
        /// The stored answer of an Idempotency-Key's earlier request.
        replayed: bool,
    },
    Stream {
        live: Arc<LiveRun>,
        permit: StreamPermit,
        /// The run to cancel if the stream's client goes away before its result.
        cancel: Option<Disconnect>,
    },
}

/// How the caller of a run waits for it (see [`RunJob`]).
struct How<'a> {
    mode: RunMode,
    cancel_on_disconnect: bool,
    timeout_status: StatusCode,
    links: &'a str,
    process_links: Option<&'a str>,
    inline_receipt: bool,
}

/// What a started run answers now.
enum Answer {
    Stored(StoredResponse),
    Stream(Arc<LiveRun>),
}

/// Admits the request and starts its run. Async: the 202 that names the run, at once. Stream:
/// the live run to follow. Otherwise: the run's answer once it has one (200, or the timeout
/// status when the wall clock ended it, with the result as body; or the error it ended with).
/// Either way the run goes on if the caller goes away (unless it asked otherwise), and its
/// answer stays readable at its links.
async fn start<W: Work>(
    st: &AppState,
    request: ExecutionRequest,
    held: W::Held,
    how: How<'_>,
    client: &ClientLink,
) -> Result<Answer, ApiError> {
    let owner = request.owner.clone();
    let request_id = request.request_id.clone();
    let execution = st.executions.admit(request).await?;
    st.metrics
        .runs_started
        .with_label_values(&[how.mode.label()])
        .increment(1);
    let metrics = st.metrics.clone();
    let (timeout_status, inline_receipt) = (how.timeout_status, how.inline_receipt);
    let live = st.executions.start(execution, move |r| {
        answer_of(&metrics, r, timeout_status, inline_receipt)
    });
    W::started(held, &live);
    match how.mode {
        RunMode::Async => {
            return Ok(Answer::Stored(StoredResponse {
                status: StatusCode::ACCEPTED.as_u16(),
                body: accepted_body(how.links, how.process_links, live.exec_id()),
                receipt: None,
            }));
        }
        RunMode::Stream => return Ok(Answer::Stream(live)),
        RunMode::Sync => {}
    }
    if how.cancel_on_disconnect {
        client.arm(
            st,
            Disconnect {
                live: live.clone(),
                owner,
                request_id,
            },
        );
    }
    let mut answer = live.answer();
    let answered = answer
        .wait_for(Option::is_some)
        .await
        .map_err(|_| ApiError::Internal("the run ended without an answer".into()))?
        .clone();
    answered
        .map(|a| Answer::Stored((*a).clone()))
        .ok_or_else(|| ApiError::Internal("the run ended without an answer".into()))
}

// ---------------------------------------------------------------------------------------------
// Idempotency

/// A request body as an Idempotency-Key's fingerprint covers it: its fields less the
/// credential and how the caller waits (`capability_token`, `cancel_on_disconnect`).
pub fn what_runs(body: &impl Serialize) -> Result<Value, ApiError> {
    let mut v =
        serde_json::to_value(body).map_err(|e| ApiError::Internal(format!("fingerprint: {e}")))?;
    if let Some(m) = v.as_object_mut() {
        m.remove("capability_token");
        m.remove("cancel_on_disconnect");
    }
    Ok(v)
}

/// An Idempotency-Key's fingerprint: the SHA-256 of `what` as canonical JSON (object keys
/// sorted, at every depth), so that the same request spelt in another key order matches.
pub fn fingerprint(what: &Value) -> Result<String, ApiError> {
    fn canonical(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), canonical(&m[k])))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(canonical).collect()),
            other => other.clone(),
        }
    }
    let text = serde_json::to_string(&canonical(what))
        .map_err(|e| ApiError::Internal(format!("fingerprint: {e}")))?;
    Ok(sha256_prefixed(text.as_bytes()))
}

/// An Idempotency-Key as a run request asks for it.
pub struct IdemAsk {
    /// The key as the caller sent it, scoped to whom the run is for (another caller's same
    /// key is another key).
    pub key: IdemKey,
    /// The [`fingerprint`] of what the request asks.
    pub fingerprint: String,
}

/// What [`HeldKey::begin`] found.
enum Begun {
    /// The key is this request's now: it runs.
    Held(HeldKey),
    /// The key's request finished: its answer.
    Done(StoredResponse),
}

/// An Idempotency-Key this daemon holds while its request runs.
struct HeldKey {
    lease: LeaseRenewal,
    fingerprint: String,
}

impl HeldKey {
    /// Takes the key, or finds its request running (409), finished (its answer), or made with
    /// another request (422).
    async fn begin(st: &Arc<AppState>, ask: IdemAsk) -> Result<Begun, ApiError> {
        let IdemAsk { key, fingerprint } = ask;
        let lease = Duration::from_secs(st.config.state.idempotency_lease_seconds);
        match st
            .store
            .idempotency_begin(&key, &fingerprint, &st.instance_id, lease)
            .await
            .map_err(|e| ApiError::SandboxUnavailable(e.to_string()))?
        {
            IdemBegin::Started => Ok(Begun::Held(HeldKey {
                lease: LeaseRenewal::start(st, &key, lease),
                fingerprint,
            })),
            IdemBegin::InProgress { same_body: true } => Err(ApiError::IdempotencyInProgress),
            IdemBegin::InProgress { same_body: false }
            | IdemBegin::Done {
                same_body: false, ..
            } => Err(ApiError::IdempotencyConflict),
            IdemBegin::Done {
                same_body: true,
                response,
            } => Ok(Begun::Done(response)),
        }
    }

    /// Gives the key (if any) back: its request ran nothing, a retry may run.
    async fn release(key: Option<HeldKey>, st: &AppState) {
        if let Some(key) = key {
            key.finish(st, None).await;
        }
    }

    /// Stores `answer` as what a retry gets for `ttl`, or gives the key back without one.
    async fn finish(self, st: &AppState, answer: Option<StoredResponse>) {
        let key = self.lease.stop();
        match answer {
            Some(mut answer) => {
                // A retry gets the answer's body (a receipt asked for is in it); the receipt
                // itself is the run's record's: not kept twice, nor counted against the budget of
                // stored answers unseen.
                answer.receipt = None;
                let ttl = Duration::from_secs(st.config.state.idempotency_ttl_seconds);
                if let Err(e) = st
                    .store
                    .idempotency_complete(&key, &self.fingerprint, &answer, ttl)
                    .await
                {
                    tracing::error!(error = %e, "idempotency result not stored");
                }
            }
            None => {
                if let Err(e) = st.store.idempotency_release(&key, &st.instance_id).await {
                    tracing::error!(error = %e, "idempotency key not released");
                }
            }
        }
    }
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

// ---------------------------------------------------------------------------------------------
// 4. The answer

/// The 202 of an async run (and the stored answer to a streamed one): where to read, stream and
/// cancel it.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunAccepted {
    pub exec_id: String,
    /// A session's background process: its id (the same as `exec_id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process_id: Option<String>,
    /// Always `running`.
    #[schema(value_type = String, pattern = "^running$")]
    pub status: &'static str,
    pub links: RunLinks,
}

/// A run's routes.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunLinks {
    /// Its status and result.
    #[serde(rename = "self")]
    pub this: String,
    /// Its output as Server-Sent Events.
    pub stream: String,
    /// Where to cancel it.
    pub cancel: String,
    /// A background process: where to write its stdin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// A background process: where to signal it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
}

/// A finished run's answer: its result, or the error it ended with.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum RunAnswer {
    Result(Box<crate::execution::result::ExecutionResult>),
    Error(ErrorBody),
}

/// What the caller of a run gets once it ended: 200, or `timeout_status` when the wall clock
/// ended it, with the result as body (and its receipt as the body's `receipt` when the request
/// asked, `inline_receipt`); the error's status and body when it ended without an outcome. The
/// receipt is kept with the answer either way.
pub fn answer_of(
    metrics: &Metrics,
    r: Result<Finished, ExecutionError>,
    timeout_status: StatusCode,
    inline_receipt: bool,
) -> StoredResponse {
    let error = match r {
        Ok(Finished {
            mut result,
            timed_out,
            receipt,
        }) => {
            if inline_receipt {
                result.receipt = receipt
                    .as_deref()
                    .and_then(|e| serde_json::from_str(e).ok());
            }
            match serde_json::to_string(&result) {
                Ok(body) => {
                    let status = if timed_out {
                        timeout_status
                    } else {
                        StatusCode::OK
                    };
                    return StoredResponse {
                        status: status.as_u16(),
                        body,
                        receipt,
                    };
                }
                Err(e) => ApiError::Internal(format!("result not serialisable: {e}")),
            }
        }
        Err(e) => ApiError::from(e),
    };
    if let ApiError::SandboxUnavailable(_) = error {
        metrics
            .rejected
            .with_label_values(&["sandbox_unavailable"])
            .increment(1);
    }
    if let ApiError::Internal(detail) = &error {
        tracing::error!(detail = %detail, "internal error");
    }
    StoredResponse {
        status: error.status().as_u16(),
        body: error.body().to_string(),
        receipt: None,
    }
}

/// The 202 body of an async run: where to read, stream and cancel it (its routes are under
/// `links`, see [`RunJob::links`]).
pub fn accepted_body(links: &str, process_links: Option<&str>, exec_id: &str) -> String {
    let base = format!("{links}{exec_id}");
    let process = process_links.map(|p| format!("{p}{exec_id}"));
    let body = RunAccepted {
        exec_id: exec_id.to_string(),
        process_id: process.as_ref().map(|_| exec_id.to_string()),
        status: "running",
        links: RunLinks {
            stream: format!("{base}/stream"),
            cancel: format!("{base}/cancel"),
            this: base,
            stdin: process.as_ref().map(|p| format!("{p}/stdin")),
            signal: process.as_ref().map(|p| format!("{p}/signal")),
        },
    };
    serde_json::to_string(&body).unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Streams

/// The grace a run gets when its caller goes away and asked for that to cancel it.
pub const DISCONNECT_GRACE: Duration = Duration::from_secs(5);

/// One of the `executions.max_open_streams` streams this daemon keeps open at once.
pub struct StreamPermit {
    st: Arc<AppState>,
}

impl StreamPermit {
    /// A permit, unless every one is taken (429).
    pub fn take(st: &Arc<AppState>) -> Result<StreamPermit, ApiError> {
        let max = st.config.executions.max_open_streams;
        st.open_streams
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| {
                ApiError::Overloaded(format!(
                    "{max} streams are open (executions.max_open_streams)"
                ))
            })?;
        st.metrics.open_streams.increment(1.0);
        Ok(StreamPermit { st: st.clone() })
    }

    /// The services of the daemon the permit is of.
    pub fn services(&self) -> &AppState {
        &self.st
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        self.st.open_streams.fetch_sub(1, Ordering::SeqCst);
        self.st.metrics.open_streams.decrement(1.0);
    }
}

/// The run a stream's client asked to cancel if it goes away: the run, its owner, the request.
pub struct Disconnect {
    pub live: Arc<LiveRun>,
    pub owner: String,
    pub request_id: String,
}

impl Disconnect {
    /// Cancels the run with [`DISCONNECT_GRACE`] unless it has answered; `why` is logged.
    pub fn cancel_unanswered(&self, st: &AppState, why: &'static str) {
        if self.live.answered().is_none() {
            tracing::info!(exec_id = self.live.exec_id(), "{why}");
            st.executions
                .cancel(&self.live, DISCONNECT_GRACE, &self.owner, &self.request_id);
        }
    }
}

/// A stream being followed: holds its permit, and cancels its run if the stream is dropped (its
/// client went away) before the result was delivered, when the request asked for that.
pub struct OpenStream {
    permit: StreamPermit,
    cancel_on_disconnect: Option<Disconnect>,
    delivered: bool,
}

impl OpenStream {
    pub fn new(permit: StreamPermit, cancel_on_disconnect: Option<Disconnect>) -> OpenStream {
        OpenStream {
            permit,
            cancel_on_disconnect,
            delivered: false,
        }
    }

    /// The run's result reached the client: dropping the stream now cancels nothing.
    pub fn delivered(&mut self) {
        self.delivered = true;
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        if !self.delivered
            && let Some(d) = &self.cancel_on_disconnect
        {
            d.cancel_unanswered(
                self.permit.services(),
                "stream client gone: cancelling its run",
            );
        }
    }
}
