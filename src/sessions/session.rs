//! One session: who owns it, where its workspace lives (a host workspace, or a sandbox the
//! backend keeps for it), what it does now, and the claim on its one exec.
//!
//! Owns: a session's state and how its API describes it. Must not: know HTTP, or decide which
//! sessions exist (the service in [`super`] does).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::workspace::Workspace;
use crate::auth::Verified;
use crate::execution::runs::LiveRun;
use crate::execution::{SessionLimits, WORKSPACE};
use crate::policy::language::Language;
use crate::sandbox::BackendKind;
use crate::sandbox::control::ControlSender;
use crate::sandbox::files::Kept;

/// Who a session belongs to: the calling service's subject and the tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    pub subject: String,
    /// "" when the call names none: a tenant of its own, never a wildcard.
    pub tenant: String,
}

impl Owner {
    /// The owner of the session's execs as runs: the calling service and the tenant together,
    /// so that `/v1/executions/{exec_id}` (which knows no tenant) and another tenant of the same
    /// service find none of them, and their Idempotency-Keys are the tenant's own. The subject's
    /// length comes first, so no (subject, tenant) pair spells another's; the leading U+0001
    /// keeps it apart from every service's own owner name (a subject with a control character
    /// is refused at authentication).
    pub fn runs(&self) -> String {
        format!(
            "\u{1}{}:{}:{}",
            self.subject.len(),
            self.subject,
            self.tenant
        )
    }
}

/// What a session does now.
pub(super) enum Activity {
    Idle,
    /// An exec is being admitted.
    Starting,
    /// With the sender of its stdin when it keeps stdin open (`stdin_open`).
    Running(Arc<LiveRun>, Option<ControlSender>),
}

pub struct Session {
    pub id: String,
    pub owner: Owner,
    pub language: Arc<Language>,
    pub backend: BackendKind,
    pub profile: String,
    /// Its profile has raw TCP rules (a container session's background processes cannot).
    pub(super) has_tcp_rules: bool,
    pub limits: SessionLimits,
    /// The workspace's disk quota in bytes (the tighter of the session's and its profile's).
    pub(super) disk_bytes: u64,
    /// The CPUs and memory (bytes) its execs may use together (as tightened as `disk_bytes`).
    pub(super) cpus: f64,
    pub(super) memory_bytes: u64,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub idle_timeout: Duration,
    /// When its TTL ends: as a wall-clock time and as the instant the reaper compares. Moved by
    /// [`SessionService::set_ttl`](super::SessionService::set_ttl).
    pub(super) lifetime: Mutex<Lifetime>,
    pub(super) grant: Verified,
    pub(super) place: Place,
    pub(super) last_used: Mutex<Instant>,
    pub(super) activity: Mutex<Activity>,
    pub(super) execs: std::sync::atomic::AtomicU64,
    /// The exec ids this session ran, newest last (at most [`EXECS_KEPT`]): its exec routes
    /// serve these only.
    pub(super) ran: Mutex<std::collections::VecDeque<String>>,
    /// True once the session ended. An upload holds it shared from its audit line to its last
    /// byte ([`Session::upload_gate`]); the end takes it whole first, so every upload lands and
    /// is recorded before the session's end, or is refused as one to no session.
    pub(super) ended: tokio::sync::RwLock<bool>,
    /// Its background processes.
    pub(super) processes: super::processes::Processes,
}

/// The end of a session's TTL.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lifetime {
    pub expires_at: chrono::DateTime<chrono::Utc>,
    pub deadline: Instant,
}

impl Lifetime {
    /// A TTL of `ttl` from now.
    pub fn from_now(ttl: Duration) -> Lifetime {
        Lifetime {
            expires_at: chrono::Utc::now() + chrono::Duration::from_std(ttl).unwrap_or_default(),
            deadline: Instant::now() + ttl,
        }
    }
}

/// Where a session's workspace lives.
pub(super) enum Place {
    /// Local: a tmpfs on the host, bound into each exec's fresh sandbox.
    Host(Arc<Workspace>),
    /// Docker/gVisor: inside the session's kept container.
    Kept(Arc<dyn Kept>),
}

/// How many exec ids a session remembers for its exec routes.
const EXECS_KEPT: usize = 1024;

impl Session {
    /// The CPUs, memory and disk (bytes) the session may use.
    pub fn size(&self) -> (f64, u64, u64) {
        (self.cpus, self.memory_bytes, self.disk_bytes)
    }

    /// When the session's TTL ends.
    pub fn expires_at(&self) -> chrono::DateTime<chrono::Utc> {
        self.lifetime().expires_at
    }

    pub(super) fn lifetime(&self) -> Lifetime {
        *self.lifetime.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn touch(&self) {
        *self.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// The exec running now, if one is.
    pub fn running(&self) -> Option<Arc<LiveRun>> {
        match &*self.activity.lock().unwrap_or_else(|p| p.into_inner()) {
            Activity::Running(live, _) if live.answered().is_none() => Some(live.clone()),
            _ => None,
        }
    }

    /// Whether this session ran exec `exec_id` (one of its last [`EXECS_KEPT`]).
    pub fn ran(&self, exec_id: &str) -> bool {
        self.ran
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|e| e == exec_id)
    }

    /// Records that this session ran `exec_id` (its exec routes serve the last [`EXECS_KEPT`]).
    pub(super) fn remember_exec(&self, exec_id: &str) {
        let mut ran = self.ran.lock().unwrap_or_else(|p| p.into_inner());
        if ran.len() == EXECS_KEPT {
            ran.pop_front();
        }
        ran.push_back(exec_id.to_string());
    }

    /// The session's background processes, oldest first.
    pub fn processes(&self) -> Vec<super::processes::ProcessInfo> {
        self.processes.list()
    }

    /// Whether `id` is one of this session's background processes (running or ended).
    pub fn has_process(&self, id: &str) -> bool {
        self.processes.get(id).is_some()
    }

    /// What background process `id` (running or ended) has written, from `stdout_from` and
    /// `stderr_from` on, at most `max` bytes of each; None when it is not one of this session's.
    pub fn process_output(
        &self,
        id: &str,
        stdout_from: usize,
        stderr_from: usize,
        max: usize,
    ) -> Option<super::processes::ProcessOutput> {
        self.processes
            .get(id)
            .map(|p| p.output(stdout_from, stderr_from, max))
    }

    /// Whether a background process runs (or is starting).
    pub(super) fn has_live_processes(&self) -> bool {
        self.processes.any_live()
    }

    /// The stdin of the running exec `exec_id`: Err(true) when that exec runs without an open
    /// stdin, Err(false) when it is not running (it ended, or is not this session's).
    pub fn stdin_of(&self, exec_id: &str) -> Result<ControlSender, bool> {
        match &*self.activity.lock().unwrap_or_else(|p| p.into_inner()) {
            Activity::Running(live, tx)
                if live.exec_id() == exec_id && live.answered().is_none() =>
            {
                tx.clone().ok_or(true)
            }
            _ => Err(false),
        }
    }

    /// Why the session's sandbox can no longer run anything (a kept container died).
    pub fn sandbox_gone(&self) -> Option<String> {
        match &self.place {
            Place::Host(_) => None,
            Place::Kept(k) => k.gone(),
        }
    }

    /// Held while an upload is recorded and written; None once the session ended (or is
    /// ending), whose workspace takes no more files.
    pub async fn upload_gate(&self) -> Option<tokio::sync::RwLockReadGuard<'_, bool>> {
        let gate = self.ended.read().await;
        (!*gate).then_some(gate)
    }

    /// The session as its API shows it.
    pub fn describe(&self) -> SessionInfo {
        SessionInfo {
            id: self.id.clone(),
            state: SessionState::Running,
            language: self.language.name.clone(),
            backend: self.backend,
            profile: self.profile.clone(),
            tenant: self.owner.tenant.clone(),
            created_at: self
                .created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            expires_at: self
                .expires_at()
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            paused_until: None,
            idle_timeout_seconds: self.idle_timeout.as_secs(),
            limits: self.limits,
            workspace: WORKSPACE,
            running_exec_id: self.running().map(|l| l.exec_id().to_string()),
            execs: self.execs.load(std::sync::atomic::Ordering::Relaxed),
        }
    }
}

/// Whether a session has a sandbox now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    Running,
    /// Its workspace is saved and it has no sandbox; an exec or file call resumes it.
    Paused,
}

/// A session as its calls describe it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct SessionInfo {
    /// `ses_…`
    pub id: String,
    pub state: SessionState,
    pub language: String,
    pub backend: BackendKind,
    pub profile: String,
    /// The tenant the session belongs to (empty: none was named).
    pub tenant: String,
    /// RFC 3339, UTC, milliseconds.
    pub created_at: String,
    /// RFC 3339, UTC, milliseconds: the end of the session's TTL.
    pub expires_at: String,
    /// RFC 3339, UTC, milliseconds: when a paused session ends unless it is resumed (its TTL
    /// or `sessions.paused_ttl_seconds` after the pause, the earlier); absent while running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_until: Option<String>,
    pub idle_timeout_seconds: u64,
    /// The limits the session asked for at creation (a null one is the profile's).
    pub limits: SessionLimits,
    /// Where the workspace appears inside the sandbox: `/workspace`.
    #[schema(value_type = String)]
    pub workspace: &'static str,
    /// The exec running now, if any.
    pub running_exec_id: Option<String>,
    /// Execs the session has run.
    pub execs: u64,
}

/// A claim on a session's one exec: given back when dropped unless an exec started.
pub struct ExecClaim {
    pub(super) session: Arc<Session>,
    pub(super) started: bool,
}

impl ExecClaim {
    /// The exec started: the session is busy until it answers. `stdin`: the sender of its stdin,
    /// when it keeps stdin open.
    pub fn started(mut self, live: &Arc<LiveRun>, stdin: Option<ControlSender>) {
        *self
            .session
            .activity
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Activity::Running(live.clone(), stdin);
        self.session
            .execs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.session.remember_exec(live.exec_id());
        self.started = true;
        let session = self.session.clone();
        let mut answer = live.answer();
        tokio::spawn(async move {
            let _ = answer.wait_for(Option::is_some).await;
            session.touch();
        });
    }
}

impl Drop for ExecClaim {
    fn drop(&mut self) {
        if !self.started {
            *self
                .session
                .activity
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Activity::Idle;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Owner;

    /// No (subject, tenant) pair spells another's owner key, and none spells a service's own
    /// owner name (a subject, which holds no control character).
    #[test]
    fn owner_keys_of_sessions_are_unambiguous() {
        let key = |s: &str, t: &str| {
            Owner {
                subject: s.into(),
                tenant: t.into(),
            }
            .runs()
        };
        assert_ne!(key("a", "b:c"), key("a:b", "c"));
        assert_ne!(key("a:1", ""), key("a", "1"));
        assert_ne!(key("", "x"), key("x", ""));
        for (s, t) in [("svcA", "t1"), ("", ""), ("a:b", "c")] {
            let k = key(s, t);
            assert!(k.starts_with('\u{1}'), "{k:?}");
            assert_ne!(k, format!("{s}\u{1}{t}"));
        }
    }
}
