//! Sessions: a sandbox kept across several execs, with a workspace of its own.
//!
//! A session belongs to the calling service and a tenant; it keeps the grant it was made with
//! for its whole life. Each exec is an ordinary execution of the execution service (decided,
//! admitted, run and recorded like any other, async, streamed and cancelled through the same
//! run registry), with the session's language as its command and the session's workspace as its
//! workdir. One exec runs at a time. Sessions end when deleted, at their TTL, after their idle
//! time, or when the daemon stops; ending one kills its exec and removes its directory.
//!
//! The files:
//! - this file: the [`SessionService`], the sessions' lifecycle: creation (checks, limits on how
//!   many are open, the workspace or kept sandbox), lookups by owner, the claim on a session's
//!   one exec, the end of a session (deleted, expired, idle, its sandbox gone, shutdown).
//! - `session`: one session's state (owner, place, activity) and how it is described.
//! - `exec`: the exec plan of a session: an exec's parts (or a creation's probe) turned into an
//!   `ExecutionRequest` carrying a `SessionExec`, the claim and code file an exec holds until it
//!   started and answered ([`PreparedExec`]), the check of a session's limits against its
//!   profile.
//! - `files`: a session's file calls, sent to its host workspace or its kept sandbox, and an
//!   upload's audit line.
//! - `archive`: a session's archives (a tar of a workspace directory out, one into it), sent
//!   the same way, and an archive upload's audit line.
//! - `ports`: a connection to a port inside a session's sandbox, for its ports proxy.
//! - [`workspace`]: a local session's directory on the host (tmpfs, `openat2` file calls).
//! - `terminal`: a session's terminal, a background process running the supervisor's `pty`
//!   mode: its controls (bytes, resize, hang-up) and its `session_terminal` audit line.
//!
//! The backend halves live below, in `sandbox`, and stay there because the backends use them
//! and must not depend on this module: the `Kept` trait, the file-call errors and path checks
//! (`sandbox::files`), the docker/gVisor kept container and its supervisor's file protocol
//! (`sandbox::docker::kept`). What the execution layer needs to run an exec in a given place
//! (`SessionExec`, `SessionPlace`, `SessionLimits`) is its own vocabulary (`execution::session`).
//!
//! Owns: which sessions exist, whose they are, their limits and lifetimes, and what their execs
//! ask for. Must not: know HTTP, or run anything itself (the execution service does); the api
//! calls into this module, this module calls the execution service, never the other way round.

mod archive;
mod background;
mod exec;
mod files;
mod pause;
mod paused;
mod ports;
mod processes;
mod session;
mod terminal;
pub mod workspace;

pub use self::archive::{ArchiveUploaded, ImportMode};
pub use self::background::{ControlError, PreparedProcess};
pub use self::exec::{ExecParts, PreparedExec};
pub use self::files::UploadError;
pub use self::ports::PortRefusal;
pub use self::processes::{OutputSpan, ProcessInfo, ProcessOutput, ProcessState};
pub use self::session::{ExecClaim, Owner, Session, SessionInfo, SessionState};
pub use self::terminal::{PreparedTerminal, Terminal, TerminalEnd, TerminalEnded};
pub use self::workspace::{Entry, FileError};
pub use crate::execution::SessionLimits;
pub use crate::sandbox::files::ByteStream;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use self::session::{Activity, Lifetime, Place};
use self::workspace::Workspace;
use crate::auth::Verified;
use crate::config::SessionsConfig;
use crate::execution::{ExecutionError, ExecutionService};
use crate::provenance::audit::{self, AuditEvent};
use crate::sandbox::BackendKind;
use crate::sandbox::uids::UidRange;
use crate::state::SessionRecord;

/// Every session id starts with this (the startup reaper only touches such names).
pub const ID_PREFIX: &str = "ses_";

/// How long a stopping daemon spends pausing its sessions, all together.
const SHUTDOWN_PAUSES: Duration = Duration::from_secs(15);

/// How often lifetimes are checked.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// Why a session call failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Malformed (400).
    #[error("{0}")]
    Invalid(String),
    /// Another exec of the session is running (409).
    #[error("session {0} is running another exec; wait for it or cancel it")]
    Busy(String),
    /// `max_total` or `max_per_tenant` sessions are open (429).
    #[error("{0}")]
    TooMany(String),
    /// No such session of this owner, running or paused (404).
    #[error("no such session")]
    NotFound,
    /// The paused store has no room for the session's workspace (507).
    #[error("{0}")]
    StoreFull(String),
    /// Deciding or admitting an exec failed as an execution does.
    #[error(transparent)]
    Execution(#[from] ExecutionError),
}

/// What a caller asks for when it makes a session.
#[derive(Debug, Clone)]
pub struct NewSession {
    pub request_id: String,
    pub owner: Owner,
    pub language: String,
    pub profile: Option<String>,
    pub ttl: Option<Duration>,
    pub idle_timeout: Option<Duration>,
    pub limits: SessionLimits,
    /// The grant the session keeps (a single-use token was claimed already).
    pub grant: Verified,
}

pub struct SessionService {
    config: SessionsConfig,
    executions: Arc<ExecutionService>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// Places taken by creations in progress, per owner: counted with the open sessions against
    /// the limits, so a burst of creations launches no sandbox past them. Locked after
    /// `sessions` whenever both are held.
    reserved: Mutex<HashMap<Owner, usize>>,
    /// Raised at shutdown: no session is made any more.
    closed: watch::Sender<bool>,
    /// The lock on `sessions.dir` this daemon holds, or why it could not take it (sessions are
    /// then refused with 503).
    dir: Result<nix::fcntl::Flock<std::fs::File>, String>,
    /// Sessions ended because their sandbox died, newest last (at most [`LOST_KEPT`]): their
    /// owner is told why instead of a bare 404.
    lost: Mutex<std::collections::VecDeque<(String, Owner, String)>>,
    /// Each local session's own host uid comes from here (held by its workspace).
    uids: Arc<UidRange>,
    /// Where paused sessions are kept, or why it cannot be used (pauses and resumes are then
    /// refused with 503).
    paused: Result<paused::PausedStore, String>,
    /// The supervisor binary on the host: a local session's terminal binds it in.
    supervisor: std::path::PathBuf,
    /// Open terminals: shutdown waits (bounded) for each to write its audit line.
    terminals: tokio_util::task::TaskTracker,
}

/// How long shutdown waits for open terminals to record their ends.
const TERMINALS_AT_SHUTDOWN: Duration = Duration::from_secs(15);

/// How many sandbox deaths are remembered for their owners.
const LOST_KEPT: usize = 1024;

/// `session_end` reason of a session whose kept sandbox died.
const SANDBOX_GONE: &str = "sandbox_gone";

impl SessionService {
    /// The service; sessions a previous process left under `sessions.dir` are removed first.
    pub fn new(
        config: &SessionsConfig,
        store_dir: &std::path::Path,
        executions: Arc<ExecutionService>,
        uids: Arc<UidRange>,
        supervisor: std::path::PathBuf,
    ) -> Arc<Self> {
        let paused = paused::PausedStore::open(store_dir, executions.instance()).map_err(|e| {
            tracing::error!(dir = %store_dir.display(), error = %e, "sessions.store_dir unusable: pauses and resumes are refused");
            format!("{}: {e}", store_dir.display())
        });
        let dir = workspace::claim_dir(&config.dir);
        match &dir {
            Ok(_) => {
                let reaped = workspace::reap(&config.dir);
                if reaped > 0 {
                    tracing::warn!(reaped, dir = %config.dir.display(), "removed the sessions of a previous process");
                }
            }
            Err(e) => tracing::error!(error = %e, "sessions.dir unusable: sessions are refused"),
        }
        Arc::new(SessionService {
            config: config.clone(),
            executions,
            sessions: Mutex::new(HashMap::new()),
            reserved: Mutex::new(HashMap::new()),
            closed: watch::channel(false).0,
            dir,
            lost: Default::default(),
            uids,
            paused,
            supervisor,
            terminals: tokio_util::task::TaskTracker::new(),
        })
    }

    /// Ends sessions past their TTL or idle time, every second, until shutdown.
    pub fn spawn_reaper(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let mut closed = self.closed.subscribe();
        tokio::spawn(async move {
            // The paused store is looked through at once (what a previous process left), then
            // every [`pause::SCAN_EVERY`].
            let mut last_scan: Option<Instant> = None;
            loop {
                let Some(service) = weak.upgrade() else {
                    return;
                };
                if last_scan.is_none_or(|t| t.elapsed() >= pause::SCAN_EVERY) {
                    last_scan = Some(Instant::now());
                    let s = service.clone();
                    let _ = tokio::task::spawn_blocking(move || s.scan_paused()).await;
                }
                drop(service);
                tokio::select! {
                    _ = tokio::time::sleep(REAP_EVERY) => {}
                    _ = closed.wait_for(|c| *c) => return,
                }
                let Some(service) = weak.upgrade() else {
                    return;
                };
                service.reap_expired().await;
            }
        });
    }

    async fn reap_expired(self: &Arc<Self>) {
        let now = Instant::now();
        let due: Vec<(Arc<Session>, &'static str)> = self
            .lock()
            .values()
            .filter_map(|s| {
                if now >= s.lifetime().deadline {
                    return Some((s.clone(), "expired"));
                }
                if s.running().is_none() && s.sandbox_gone().is_some() {
                    return Some((s.clone(), SANDBOX_GONE));
                }
                let idle_since = *s.last_used.lock().unwrap_or_else(|p| p.into_inner());
                // A background process still running keeps the session from idling out (its
                // TTL still ends it).
                (s.running().is_none()
                    && !s.has_live_processes()
                    && !matches!(
                        *s.activity.lock().unwrap_or_else(|p| p.into_inner()),
                        Activity::Starting
                    )
                    && now.duration_since(idle_since) >= s.idle_timeout)
                    .then(|| (s.clone(), "idle"))
            })
            .collect();
        for (s, reason) in due {
            if reason == SANDBOX_GONE {
                self.remember_lost(&s);
            }
            self.end(&s.id, reason).await;
        }
    }

    fn remember_lost(&self, s: &Session) {
        let why = s.sandbox_gone().unwrap_or_default();
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        if lost.iter().any(|(id, ..)| id == &s.id) {
            return;
        }
        if lost.len() == LOST_KEPT {
            lost.pop_front();
        }
        lost.push_back((s.id.clone(), s.owner.clone(), why));
    }

    /// Why `owner`'s session `id` ended, when it ended because its sandbox died: its container
    /// went down (out of memory, killed) or stopped answering. None otherwise (and for anyone
    /// else's session).
    pub fn lost(&self, owner: &Owner, id: &str) -> Option<String> {
        self.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(i, o, _)| i == id && o == owner)
            .map(|(_, _, why)| {
                format!("session {id} ended: its sandbox is gone ({why}); create another session")
            })
    }

    /// Ends `session` now if its sandbox died (a call found it so); then [`Self::lost`] says why.
    pub async fn end_if_lost(self: &Arc<Self>, session: &Session) -> bool {
        if session.running().is_some() || session.sandbox_gone().is_none() {
            return false;
        }
        self.remember_lost(session);
        self.end(&session.id, SANDBOX_GONE).await;
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The languages sessions may use.
    pub fn languages(&self) -> Vec<String> {
        self.executions.policy().languages.keys().cloned().collect()
    }

    /// Makes a session: checks its language, profile, limits and grant (as an exec of it would
    /// be checked), then its directory. 429 when `max_total` or `max_per_tenant` are open.
    pub async fn create(&self, new: NewSession) -> Result<Arc<Session>, SessionError> {
        if *self.closed.borrow() {
            return Err(ExecutionError::Unavailable("the daemon is shutting down".into()).into());
        }
        if let Err(e) = &self.dir {
            return Err(ExecutionError::Unavailable(format!("sessions.dir: {e}")).into());
        }
        let policy = self.executions.policy();
        let language = policy
            .languages
            .get(&new.language)
            .cloned()
            .ok_or_else(|| {
                SessionError::Invalid(format!(
                    "unknown language '{}'; this daemon has: {}",
                    new.language.escape_debug(),
                    self.languages().join(", ")
                ))
            })?;
        let max_ttl = Duration::from_secs(self.config.max_ttl_seconds);
        let ttl = new.ttl.unwrap_or(max_ttl);
        if ttl.is_zero() || ttl > max_ttl {
            return Err(SessionError::Invalid(format!(
                "ttl_seconds must be between 1 and {} (sessions.max_ttl_seconds)",
                max_ttl.as_secs()
            )));
        }
        let max_idle = Duration::from_secs(self.config.idle_timeout_seconds);
        let idle_timeout = new.idle_timeout.unwrap_or(max_idle);
        if idle_timeout.is_zero() || idle_timeout > max_idle {
            return Err(SessionError::Invalid(format!(
                "idle_timeout_seconds must be between 1 and {} (sessions.idle_timeout_seconds)",
                max_idle.as_secs()
            )));
        }
        let id = format!("{ID_PREFIX}{}", uuid::Uuid::new_v4().simple());
        // Decided as an exec of it would be: the grant must cover the language's capability and
        // the profile (a refusal is audited).
        let probe = exec::probe(&id, &language, &new);
        let plan = self.executions.plan(&probe)?;
        exec::check_limits(&new.limits, &plan)?;
        // A place under the limits is taken before the sandbox is launched, and given back if
        // the session is not made.
        let place_taken = self.reserve(&new.owner)?;
        let place = self.launch(&id, &probe, &plan, &new.limits).await?;
        let now = chrono::Utc::now();
        let lifetime = Lifetime::from_now(ttl);
        let session = Arc::new(Session {
            id: id.clone(),
            owner: new.owner.clone(),
            language,
            backend: plan.backend,
            profile: plan.profile.name.clone(),
            has_tcp_rules: !plan.profile.network.tcp.is_empty(),
            limits: new.limits,
            disk_bytes: plan.limits.disk_bytes,
            cpus: plan.limits.cpus,
            memory_bytes: plan.limits.memory_bytes,
            created_at: now,
            idle_timeout,
            lifetime: Mutex::new(lifetime),
            grant: Verified {
                single_use: None,
                ..new.grant.clone()
            },
            place,
            last_used: Mutex::new(Instant::now()),
            activity: Mutex::new(Activity::Idle),
            execs: Default::default(),
            ran: Default::default(),
            ended: Default::default(),
            processes: Default::default(),
        });
        // The grant's single-use token is used up only now that the session can be made.
        match crate::execution::claim_single_use(&**self.executions.store(), &new.grant).await {
            Ok(()) => {}
            Err(crate::execution::ClaimError::Refused(reason)) => {
                let known = crate::execution::record::KnownRequest {
                    request_id: new.request_id.clone(),
                    subject: Some(new.owner.subject.clone()),
                    token_id: new.grant.token_id.clone(),
                    ..Default::default()
                };
                crate::execution::record::refusal(
                    self.executions.audit(),
                    self.executions.metrics(),
                    &known,
                    crate::execution::record::RefusalKind::Unauthorized,
                    &reason,
                );
                return Err(ExecutionError::Unauthorized.into());
            }
            Err(crate::execution::ClaimError::Unavailable(m)) => {
                return Err(ExecutionError::Unavailable(m).into());
            }
        }
        // The reserved place becomes the session's, under both locks.
        place_taken.fill(&mut self.lock(), session.clone());
        let metrics = self.executions.metrics();
        metrics
            .sessions_open
            .with_label_values(&[session.backend.as_str()])
            .increment(1.0);
        let line = AuditEvent::SessionCreate(audit::SessionOpened {
            request_id: new.request_id,
            session_id: id.clone(),
            owner: new.owner.subject,
            tenant: new.owner.tenant,
            token_id: new.grant.token_id,
            language: session.language.name.clone(),
            backend: session.backend.as_str(),
            profile: session.profile.clone(),
            expires_at: session.describe().expires_at,
        });
        crate::execution::record::record(self.executions.audit(), metrics, &line);
        self.record_holder(&id, ttl).await;
        Ok(session)
    }

    /// Records in the state store that this daemon holds session `id` for `ttl`: other replicas
    /// hand its calls to this one.
    async fn record_holder(&self, id: &str, ttl: Duration) {
        let record = SessionRecord {
            instance: self.executions.instance().to_string(),
            address: self.executions.address().map(str::to_string),
        };
        if let Err(e) = self.executions.store().session_put(id, &record, ttl).await {
            tracing::warn!(session_id = %id, error = %e, "session not recorded in the state store: other replicas will not find it");
        }
    }

    /// Gives session `id` the place its workspace lives in: a host workspace (local), or a
    /// sandbox the backend keeps for it (docker, gVisor).
    async fn launch(
        &self,
        id: &str,
        probe: &crate::execution::ExecutionRequest,
        plan: &crate::policy::Plan,
        limits: &SessionLimits,
    ) -> Result<Place, SessionError> {
        if plan.backend == BackendKind::Local {
            let (dir, session_id) = (self.config.dir.clone(), id.to_string());
            let disk = plan.limits.disk_bytes;
            let (uids, gid) = (self.uids.clone(), plan.profile.user.gid);
            let workspace = tokio::task::spawn_blocking(move || {
                let lease = uids.lease().map_err(|e| e.to_string())?;
                Workspace::create(&dir, &session_id, disk, lease, gid)
            })
            .await
            .map_err(|e| ExecutionError::Internal(e.to_string()))?
            .map_err(ExecutionError::Unavailable)?;
            return Ok(Place::Host(Arc::new(workspace)));
        }
        // The container every exec of the session runs in, from the warm pool.
        // Only sessions with their profile's own limits have their containers kept warm:
        // limits a caller picks must not make the daemon hold a pool for each choice.
        let warm = *limits == SessionLimits::default();
        match self.executions.keep(probe, id, warm).await? {
            Some(kept) => Ok(Place::Kept(kept)),
            None => Err(ExecutionError::Internal(format!(
                "backend {} kept no sandbox for the session",
                plan.backend.as_str()
            ))
            .into()),
        }
    }

    /// Takes a place for a session of `owner` if `max_total` and `max_per_tenant`, counting the
    /// open sessions and the places other creations hold, leave one; 429 otherwise.
    fn reserve(&self, owner: &Owner) -> Result<Reservation<'_>, SessionError> {
        let sessions = self.lock();
        let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let total = sessions.len() + reserved.values().sum::<usize>();
        if total >= self.config.max_total {
            return Err(SessionError::TooMany(format!(
                "{} sessions are open or being made (sessions.max_total)",
                self.config.max_total
            )));
        }
        let mine = sessions.values().filter(|s| &s.owner == owner).count()
            + reserved.get(owner).copied().unwrap_or(0);
        if mine >= self.config.max_per_tenant {
            return Err(SessionError::TooMany(format!(
                "this tenant has {mine} sessions open or being made (sessions.max_per_tenant)"
            )));
        }
        *reserved.entry(owner.clone()).or_default() += 1;
        Ok(Reservation {
            reserved: &self.reserved,
            owner: owner.clone(),
        })
    }

    /// Whether this daemon holds session `id` (whoever owns it).
    pub fn holds(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    /// The session `id` of `owner`; None for anyone else's (indistinguishable from none).
    /// Reading it is not using it: its idle time goes on.
    pub fn get(&self, owner: &Owner, id: &str) -> Option<Arc<Session>> {
        self.lock().get(id).filter(|s| &s.owner == owner).cloned()
    }

    /// The running session `id`, whoever owns it: for a front end that found its owner from
    /// something the session itself holds (the E2B data plane's per-sandbox access token).
    pub fn by_id(&self, id: &str) -> Option<Arc<Session>> {
        self.lock().get(id).cloned()
    }

    /// What `session`'s sandbox uses now (memory charged to it, its processes' CPU time so far)
    /// and the bytes its workspace holds: each as far as it can be read. A local session with no
    /// process running uses no memory or CPU. Blocking (reads cgroup and mount files).
    pub fn usage(&self, session: &Session) -> (crate::sandbox::Usage, Option<u64>) {
        match &session.place {
            Place::Host(w) => {
                let usage = self
                    .executions
                    .backends()
                    .get(&session.backend)
                    .and_then(|b| b.session_usage(&session.id))
                    .unwrap_or_default();
                (usage, w.used_bytes())
            }
            Place::Kept(k) => k
                .usage(std::path::Path::new(crate::execution::WORKSPACE))
                .unwrap_or_default(),
        }
    }

    /// `owner`'s sessions, running and paused, oldest first (ties by id). Reads the paused
    /// store: blocking.
    pub fn of_owner(&self, owner: &Owner) -> Vec<SessionInfo> {
        let mut all: Vec<SessionInfo> = self
            .lock()
            .values()
            .filter(|s| &s.owner == owner)
            .map(|s| s.describe())
            .collect();
        let running: std::collections::HashSet<String> = all.iter().map(|s| s.id.clone()).collect();
        all.extend(
            self.paused_of_owner(owner)
                .into_iter()
                .filter(|p| !running.contains(&p.id)),
        );
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        all
    }

    /// Gives `owner`'s running session `id` a TTL of `ttl` from now, but never past
    /// `sessions.max_ttl_seconds` after its creation (the cap of a session's whole life); 404
    /// for anyone else's, 400 for a zero TTL. The session as it is then.
    pub async fn set_ttl(
        &self,
        owner: &Owner,
        id: &str,
        ttl: Duration,
    ) -> Result<SessionInfo, SessionError> {
        if ttl.is_zero() {
            return Err(SessionError::Invalid(
                "a timeout must be at least 1 s".into(),
            ));
        }
        let session = self.get(owner, id).ok_or(SessionError::NotFound)?;
        let cap = i64::try_from(self.config.max_ttl_seconds)
            .ok()
            .and_then(chrono::TimeDelta::try_seconds)
            .and_then(|d| session.created_at.checked_add_signed(d));
        let ttl = match cap {
            Some(cap) => {
                let left = (cap - chrono::Utc::now()).to_std().unwrap_or_default();
                if left.is_zero() {
                    return Err(SessionError::Invalid(format!(
                        "session {id} has lived sessions.max_ttl_seconds ({} s): it cannot be given more time",
                        self.config.max_ttl_seconds
                    )));
                }
                ttl.min(left)
            }
            None => ttl,
        };
        *session.lifetime.lock().unwrap_or_else(|p| p.into_inner()) = Lifetime::from_now(ttl);
        self.record_holder(id, ttl).await;
        // Ended meanwhile: its holder record goes with it again.
        if !self.holds(id) {
            let _ = self.executions.store().session_remove(id).await;
            return Err(SessionError::NotFound);
        }
        Ok(session.describe())
    }

    /// The session `id` of `owner` for an exec or a file call: its idle time starts again.
    pub fn use_session(&self, owner: &Owner, id: &str) -> Option<Arc<Session>> {
        let session = self.get(owner, id)?;
        session.touch();
        Some(session)
    }

    /// Claims the session's one exec: 409 while another runs.
    pub fn claim(&self, session: &Arc<Session>) -> Result<ExecClaim, SessionError> {
        let mut activity = session.activity.lock().unwrap_or_else(|p| p.into_inner());
        let busy = match &*activity {
            Activity::Idle => false,
            Activity::Starting => true,
            Activity::Running(live, _) => live.answered().is_none(),
        };
        if busy {
            return Err(SessionError::Busy(session.id.clone()));
        }
        *activity = Activity::Starting;
        Ok(ExecClaim {
            session: session.clone(),
            started: false,
        })
    }

    /// Deletes `owner`'s session `id`: its exec is killed, its directory removed. False when
    /// there is no such session of theirs.
    pub async fn delete(self: &Arc<Self>, owner: &Owner, id: &str) -> bool {
        let mine = self.lock().get(id).is_some_and(|s| &s.owner == owner);
        mine && self.end(id, "deleted").await
    }

    /// Ends session `id` for `reason`: no exec starts in it any more, the running one is killed
    /// and waited for, then its directory is removed. The work runs on a task of its own: a
    /// caller that goes away (a client that disconnects mid-DELETE) cannot cut it short.
    async fn end(self: &Arc<Self>, id: &str, reason: &'static str) -> bool {
        let Some(session) = self.lock().remove(id) else {
            return false;
        };
        let this = self.clone();
        let id = id.to_string();
        tokio::spawn(async move { this.finish_end(session, &id, reason).await })
            .await
            .is_ok()
    }

    async fn finish_end(&self, session: Arc<Session>, id: &str, reason: &'static str) -> bool {
        // Uploads in progress finish (and are recorded) first; later ones are refused.
        *session.ended.write().await = true;
        // Its background processes end, then its exec.
        self.stop_processes(&session).await;
        // A claim being admitted now finds the session gone when it starts: wait for it too.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(live) = session.running() {
                self.executions
                    .cancel(&live, Duration::ZERO, &session.owner.subject, id);
                let mut answer = live.answer();
                let _ =
                    tokio::time::timeout(Duration::from_secs(10), answer.wait_for(Option::is_some))
                        .await;
            }
            let starting = matches!(
                *session.activity.lock().unwrap_or_else(|p| p.into_inner()),
                Activity::Starting
            );
            if !starting || Instant::now() >= until {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.free(&session).await;
        if let Err(e) = self.executions.store().session_remove(id).await {
            tracing::warn!(session_id = id, error = %e, "session record not removed (it expires with the session's TTL)");
        }
        let metrics = self.executions.metrics();
        metrics
            .sessions_open
            .with_label_values(&[session.backend.as_str()])
            .decrement(1.0);
        metrics
            .sessions_ended
            .with_label_values(&[reason])
            .increment(1);
        let line = AuditEvent::SessionEnd(audit::SessionClosed {
            session_id: id.to_string(),
            owner: session.owner.subject.clone(),
            tenant: session.owner.tenant.clone(),
            reason,
            execs: session.execs.load(std::sync::atomic::Ordering::Relaxed),
        });
        crate::execution::record::record(self.executions.audit(), metrics, &line);
        tracing::info!(session_id = id, reason, "session ended");
        true
    }

    /// The daemon is stopping: no session is made or resumed from now on. With
    /// `sessions.pause_on_shutdown`, every session is paused (within [`SHUTDOWN_PAUSES`]), so
    /// it survives the restart; the others, and those whose pause failed, end.
    pub async fn close_all(self: &Arc<Self>) {
        self.closed.send_replace(true);
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        let until = Instant::now() + SHUTDOWN_PAUSES;
        for id in ids {
            let session = self.lock().get(&id).cloned();
            if self.config.pause_on_shutdown
                && Instant::now() < until
                && let Some(s) = session
            {
                let pause = self.pause(&s.owner, &id, String::new());
                match tokio::time::timeout_at(until.into(), pause).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => {
                        tracing::warn!(session_id = %id, error = %e, "session not paused at shutdown: it ends");
                    }
                    Err(_) => {
                        tracing::warn!(session_id = %id, "no time left to pause the session at shutdown: it ends");
                    }
                }
            }
            self.end(&id, "shutdown").await;
        }
        // The sessions' ends ended their terminals' runs; each terminal's socket task then
        // writes its audit line.
        self.terminals.close();
        if tokio::time::timeout(TERMINALS_AT_SHUTDOWN, self.terminals.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                open = self.terminals.len(),
                "terminals still open at shutdown: their audit lines may be missing"
            );
        }
    }

    /// How many sessions are open.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A place under the session limits held by a creation in progress; given back when dropped
/// (the creation failed), or filled by the session it made.
struct Reservation<'a> {
    reserved: &'a Mutex<HashMap<Owner, usize>>,
    owner: Owner,
}

impl Reservation<'_> {
    /// Gives the place to `session`, put into `sessions` (locked by the caller, so no count
    /// sees the session both open and reserved, or neither).
    fn fill(self, sessions: &mut HashMap<String, Arc<Session>>, session: Arc<Session>) {
        sessions.insert(session.id.clone(), session);
        // Dropped here, under the caller's lock on `sessions`.
        drop(self);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = reserved.get_mut(&self.owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                reserved.remove(&self.owner);
            }
        }
    }
}
