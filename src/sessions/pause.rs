//! Pause and resume: a session's workspace saved to the paused store and its sandbox freed;
//! later a fresh sandbox with that workspace, on this daemon or on any replica that shares the
//! store.
//!
//! A paused session is not in memory: the store ([`super::paused`]) is its only record, so a
//! restarted daemon, or another replica, finds it there. Its owner, grant, language, profile,
//! limits and lifetimes come back with it; its processes do not (a filesystem pause).
//!
//! Owns: the order of a pause (no exec or upload meanwhile; saved and committed before the
//! sandbox is freed) and of a resume (claimed, re-decided under today's policy, a place under the
//! session limits, restored and checked against its digest before it is used), their audit
//! lines and metrics, and the end of paused sessions (deleted, expired). Must not: know HTTP or
//! the store's layout.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::io::Write as _;

use futures::StreamExt as _;
use tokio::io::AsyncReadExt as _;

use super::paused::{Claim, Found, PausedRecord, PausedStore, SaveError, SavedWorkspace, Saving};
use super::session::{Activity, Lifetime, Place, Session, SessionInfo, SessionState};
use super::{NewSession, Owner, SessionError, SessionService, exec};
use crate::auth::Verified;
use crate::execution::{ExecutionError, WORKSPACE};
use crate::provenance::audit::{self, AuditEvent};
use crate::sandbox::files::{ByteStream, ImportMode};

/// How often the paused store is looked through for expired sessions and leftovers.
pub(super) const SCAN_EVERY: Duration = Duration::from_secs(15);

/// Bytes a saved workspace may take beyond the session's disk quota: a tar header (and a long
/// name's extra header) for every entry the workspace can hold, and the end of the archive.
fn tar_overhead() -> u64 {
    super::workspace::MAX_INODES * 1536 + (1 << 20)
}

impl SessionService {
    /// The paused store, or why it is unusable (503).
    fn store(&self) -> Result<&PausedStore, SessionError> {
        self.paused
            .as_ref()
            .map_err(|e| ExecutionError::Unavailable(format!("sessions.store_dir: {e}")).into())
    }

    /// `owner`'s paused session `id`, if there is one.
    pub fn paused(&self, owner: &Owner, id: &str) -> Option<SessionInfo> {
        let record = self.paused.as_ref().ok()?.read(id)?;
        (record.subject == owner.subject && record.tenant == owner.tenant)
            .then(|| describe(&record))
    }

    /// `owner`'s paused sessions (read from the store: blocking).
    pub fn paused_of_owner(&self, owner: &Owner) -> Vec<SessionInfo> {
        let Ok(store) = &self.paused else {
            return Vec::new();
        };
        store
            .scan()
            .into_iter()
            .filter_map(|(_, found)| match found {
                Found::Paused(r) if r.subject == owner.subject && r.tenant == owner.tenant => {
                    Some(describe(&r))
                }
                _ => None,
            })
            .collect()
    }

    /// The ids of every paused session (read from the store: blocking).
    pub fn paused_ids(&self) -> std::collections::HashSet<String> {
        let Ok(store) = &self.paused else {
            return Default::default();
        };
        store
            .scan()
            .into_iter()
            .filter(|(_, found)| matches!(found, Found::Paused(_)))
            .map(|(id, _)| id)
            .collect()
    }

    /// Whether `owner`'s paused session `id` ran exec `exec_id` (one of its last execs).
    pub fn paused_ran(&self, owner: &Owner, id: &str, exec_id: &str) -> bool {
        let Some(record) = self.paused.as_ref().ok().and_then(|s| s.read(id)) else {
            return false;
        };
        record.subject == owner.subject
            && record.tenant == owner.tenant
            && record.ran.iter().any(|e| e == exec_id)
    }

    /// Pauses `owner`'s session `id`: its workspace is saved and the save committed, then its
    /// sandbox is freed. A paused session is answered as it is. 409 while an exec runs; 507 when
    /// the store has no room, 503 when it cannot be written (the session then runs on, as it was).
    pub async fn pause(
        self: &Arc<Self>,
        owner: &Owner,
        id: &str,
        request_id: String,
    ) -> Result<SessionInfo, SessionError> {
        let store = self.store()?;
        let Some(session) = self.get(owner, id) else {
            return self.paused(owner, id).ok_or(SessionError::NotFound);
        };
        // No exec starts meanwhile (409 for one that tries), and none is running.
        let claim = self.claim(&session)?;
        let kept = {
            let (store, owner) = (store.clone(), owner.clone());
            tokio::task::spawn_blocking(move || store.paused_of(&owner.subject, &owner.tenant))
                .await
                .map_err(|e| ExecutionError::Internal(e.to_string()))?
        };
        if kept >= self.config.max_paused_per_tenant {
            return Err(SessionError::TooMany(format!(
                "this tenant has {kept} paused sessions (sessions.max_paused_per_tenant); resume or delete one"
            )));
        }
        // Its background processes end first: the workspace saved is one nothing writes to. A
        // pause that fails leaves the session running, without them.
        self.stop_processes(&session).await;
        let reopen = super::background::Reopen::new(&session);
        // Uploads in progress land first; later ones wait for the outcome.
        let mut ended = session.ended.write().await;
        if *ended {
            return Err(SessionError::NotFound);
        }
        let limit = session.disk_bytes.saturating_add(tar_overhead());
        let saving = store.begin(id, limit).map_err(saved_error)?;
        let saving = save_workspace(&session, saving, session.disk_bytes).await?;
        // Out of the open sessions before the commit, so that nothing else (its end at its TTL,
        // a DELETE) can end it once it is paused: if one already took it, the pause is void.
        let Some(taken) = self.take(id, &session) else {
            return Err(SessionError::NotFound);
        };
        let now = chrono::Utc::now();
        let mut record = record_of(&session, now, self.config.paused_ttl_seconds);
        let committed = {
            let store = store.clone();
            tokio::task::spawn_blocking(move || {
                store.commit(saving, &mut record).map(|w| (w, record))
            })
            .await
            .map_err(|e| ExecutionError::Internal(e.to_string()))?
        };
        let (saved, record) = match committed {
            Ok(c) => c,
            Err(e) => {
                // Not paused: the session is open again, as it was.
                self.lock().insert(id.to_string(), taken);
                return Err(saved_error(e));
            }
        };
        *ended = true;
        reopen.disarm();
        drop(ended);
        drop(claim);
        self.free(&session).await;
        if let Err(e) = self.executions.store().session_remove(id).await {
            tracing::warn!(session_id = id, error = %e, "paused session's replica record not removed (it expires with the session's TTL)");
        }
        let metrics = self.executions.metrics();
        metrics
            .sessions_open
            .with_label_values(&[session.backend.as_str()])
            .decrement(1.0);
        metrics.sessions_paused.increment(1.0);
        let line = AuditEvent::SessionPause(audit::SessionPaused {
            request_id,
            session_id: id.to_string(),
            owner: owner.subject.clone(),
            tenant: owner.tenant.clone(),
            workspace_sha256: saved.sha256,
            workspace_bytes: saved.bytes,
        });
        crate::execution::record::record(self.executions.audit(), metrics, &line);
        tracing::info!(session_id = id, bytes = saved.bytes, "session paused");
        Ok(describe(&record))
    }

    /// Resumes `owner`'s session `id` if it is paused (one that runs is answered as it is): a
    /// fresh sandbox under the session's grant, decided again under today's policy, with its
    /// saved workspace. None when `owner` has no such session, paused or running.
    pub async fn resume(
        self: &Arc<Self>,
        owner: &Owner,
        id: &str,
        request_id: String,
    ) -> Result<Arc<Session>, SessionError> {
        if let Some(s) = self.get(owner, id) {
            return Ok(s);
        }
        if *self.closed.borrow() {
            return Err(ExecutionError::Unavailable("the daemon is shutting down".into()).into());
        }
        let store = self.store()?;
        let mine = |r: &PausedRecord| r.subject == owner.subject && r.tenant == owner.tenant;
        match store.read(id) {
            Some(r) if mine(&r) => {}
            // Anyone else's, or none at all, is unknown; one another call has just resumed is
            // open now.
            _ => return self.get(owner, id).ok_or(SessionError::NotFound),
        }
        let Some(claim) = store.claim(id) else {
            return Err(SessionError::Busy(id.to_string()));
        };
        if !mine(&claim.record) {
            return Err(SessionError::NotFound);
        }
        if claim.record.paused_until <= chrono::Utc::now() {
            self.end_paused(claim, "expired");
            return Err(SessionError::NotFound);
        }
        let record = claim.record.clone();
        let policy = self.executions.policy();
        let language = policy
            .languages
            .get(&record.language)
            .cloned()
            .ok_or_else(|| {
                SessionError::Invalid(format!(
                    "the session's language '{}' is no longer offered by this daemon",
                    record.language
                ))
            })?;
        let remaining = (record.expires_at - chrono::Utc::now())
            .to_std()
            .unwrap_or_default();
        let new = NewSession {
            request_id: request_id.clone(),
            owner: owner.clone(),
            language: record.language.clone(),
            profile: Some(record.profile.clone()),
            ttl: Some(remaining),
            idle_timeout: Some(Duration::from_secs(record.idle_timeout_seconds)),
            limits: record.limits,
            grant: Verified {
                subject: Some(record.subject.clone()),
                token_id: record.token_id.clone(),
                single_use: None,
                grant: record.grant.clone(),
            },
        };
        // Decided again: a grant or profile that no longer allows it is refused (and audited).
        let probe = exec::probe(id, &language, &new);
        let plan = self.executions.plan(&probe)?;
        exec::check_limits(&new.limits, &plan)?;
        let place_taken = self.reserve(owner)?;
        let place = self.launch(id, &probe, &plan, &new.limits).await?;
        let session = Arc::new(Session {
            id: id.to_string(),
            owner: owner.clone(),
            language,
            backend: plan.backend,
            profile: plan.profile.name.clone(),
            has_tcp_rules: !plan.profile.network.tcp.is_empty(),
            limits: new.limits,
            disk_bytes: plan.limits.disk_bytes,
            cpus: plan.limits.cpus,
            memory_bytes: plan.limits.memory_bytes,
            created_at: record.created_at,
            idle_timeout: Duration::from_secs(record.idle_timeout_seconds),
            lifetime: Mutex::new(Lifetime {
                expires_at: record.expires_at,
                deadline: Instant::now() + remaining,
            }),
            grant: new.grant,
            place,
            last_used: Mutex::new(Instant::now()),
            activity: Mutex::new(Activity::Idle),
            execs: record.execs.into(),
            ran: Mutex::new(record.ran.iter().cloned().collect()),
            ended: Default::default(),
            processes: Default::default(),
        });
        if let Err(e) = restore_workspace(&session, &claim).await {
            // Still paused, as it was (the claim is given back when dropped).
            self.free(&session).await;
            return Err(e);
        }
        place_taken.fill(&mut self.lock(), session.clone());
        claim.finish();
        let metrics = self.executions.metrics();
        metrics
            .sessions_open
            .with_label_values(&[session.backend.as_str()])
            .increment(1.0);
        metrics.sessions_paused.decrement(1.0);
        self.record_holder(id, remaining).await;
        let line = AuditEvent::SessionResume(audit::SessionResumed {
            request_id,
            session_id: id.to_string(),
            owner: owner.subject.clone(),
            tenant: owner.tenant.clone(),
            backend: session.backend.as_str(),
            workspace_sha256: record.workspace.sha256,
            workspace_bytes: record.workspace.bytes,
        });
        crate::execution::record::record(self.executions.audit(), metrics, &line);
        tracing::info!(session_id = id, "session resumed");
        Ok(session)
    }

    /// Deletes `owner`'s paused session `id`; false when there is none of theirs.
    pub fn delete_paused(&self, owner: &Owner, id: &str) -> bool {
        let Ok(store) = self.paused.as_ref() else {
            return false;
        };
        match store.read(id) {
            Some(r) if r.subject == owner.subject && r.tenant == owner.tenant => {}
            _ => return false,
        }
        match store.claim(id) {
            Some(claim) => {
                self.end_paused(claim, "deleted");
                true
            }
            None => false,
        }
    }

    /// Ends a claimed paused session for `reason`: its saved workspace is removed.
    fn end_paused(&self, claim: Claim, reason: &'static str) {
        let line = AuditEvent::SessionEnd(audit::SessionClosed {
            session_id: claim.record.id.clone(),
            owner: claim.record.subject.clone(),
            tenant: claim.record.tenant.clone(),
            reason,
            execs: claim.record.execs,
        });
        claim.finish();
        let metrics = self.executions.metrics();
        metrics.sessions_paused.decrement(1.0);
        metrics
            .sessions_ended
            .with_label_values(&[reason])
            .increment(1);
        crate::execution::record::record(self.executions.audit(), metrics, &line);
    }

    /// Looks through the paused store: ends the sessions whose time ran out, cleans up after
    /// daemons that died mid-pause or mid-resume, and counts what is paused.
    pub(super) fn scan_paused(&self) {
        let Ok(store) = self.paused.as_ref() else {
            return;
        };
        let now = chrono::Utc::now();
        let mut paused = 0u64;
        for (id, found) in store.scan() {
            match found {
                Found::Paused(r) if r.paused_until <= now => {
                    if let Some(claim) = store.claim(&id) {
                        self.end_paused(claim, "expired");
                        tracing::info!(session_id = id, "paused session expired");
                    }
                }
                Found::Paused(_) => paused += 1,
                Found::Abandoned(dir) => store.recover(&dir),
                Found::Busy => {}
            }
        }
        self.executions.metrics().sessions_paused.set(paused as f64);
    }

    /// Takes session `id` out of the open ones if it is still `session`.
    fn take(&self, id: &str, session: &Arc<Session>) -> Option<Arc<Session>> {
        let mut sessions = self.lock();
        match sessions.get(id) {
            Some(s) if Arc::ptr_eq(s, session) => sessions.remove(id),
            _ => None,
        }
    }

    /// Frees the session's sandbox (its workspace goes with it).
    pub(super) async fn free(&self, session: &Session) {
        match &session.place {
            Place::Host(w) => {
                let w = w.clone();
                let _ = tokio::task::spawn_blocking(move || w.destroy()).await;
            }
            Place::Kept(k) => k.close().await,
        }
    }
}

/// What a paused session keeps of `session`, paused at `now`.
fn record_of(
    session: &Session,
    now: chrono::DateTime<chrono::Utc>,
    paused_ttl: u64,
) -> PausedRecord {
    let cap = now + chrono::Duration::seconds(paused_ttl.min(i64::MAX as u64) as i64);
    PausedRecord {
        version: 0,
        id: session.id.clone(),
        subject: session.owner.subject.clone(),
        tenant: session.owner.tenant.clone(),
        language: session.language.name.clone(),
        profile: session.profile.clone(),
        backend: session.backend,
        limits: session.limits,
        token_id: session.grant.token_id.clone(),
        grant: session.grant.grant.clone(),
        created_at: session.created_at,
        expires_at: session.expires_at(),
        paused_at: now,
        paused_until: cap.min(session.expires_at()),
        idle_timeout_seconds: session.idle_timeout.as_secs(),
        execs: session.execs.load(std::sync::atomic::Ordering::Relaxed),
        ran: session
            .ran
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect(),
        workspace: SavedWorkspace {
            sha256: String::new(),
            bytes: 0,
        },
    }
}

/// A paused session as its API shows it.
fn describe(r: &PausedRecord) -> SessionInfo {
    let time =
        |t: &chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    SessionInfo {
        id: r.id.clone(),
        state: SessionState::Paused,
        language: r.language.clone(),
        backend: r.backend,
        profile: r.profile.clone(),
        tenant: r.tenant.clone(),
        created_at: time(&r.created_at),
        expires_at: time(&r.expires_at),
        paused_until: Some(time(&r.paused_until)),
        idle_timeout_seconds: r.idle_timeout_seconds,
        limits: r.limits,
        workspace: WORKSPACE,
        running_exec_id: None,
        execs: r.execs,
    }
}

fn saved_error(e: SaveError) -> SessionError {
    match e {
        SaveError::Full(m) => SessionError::StoreFull(m),
        SaveError::Unwritable(m) => ExecutionError::Unavailable(m).into(),
    }
}

/// What the files of a saved workspace take once restored, counted as its tar streams by: each
/// regular member's size rounded up to a page. A workspace holds less than its tar restores
/// when files are hard links of one another (each link's data is in the tar again) or sparse.
#[derive(Default)]
struct RestoredSize {
    /// Bytes of the current header block read so far.
    header: Vec<u8>,
    /// Bytes of the current member's data still to pass (padded to blocks).
    skip: u64,
    pub bytes: u64,
    ended: bool,
}

impl RestoredSize {
    const PAGE: u64 = 4096;

    fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() && !self.ended {
            if self.skip > 0 {
                let n = chunk
                    .len()
                    .min(usize::try_from(self.skip).unwrap_or(usize::MAX));
                self.skip -= n as u64;
                chunk = &chunk[n..];
                continue;
            }
            let n = chunk.len().min(512 - self.header.len());
            self.header.extend_from_slice(&chunk[..n]);
            chunk = &chunk[n..];
            if self.header.len() < 512 {
                continue;
            }
            let block = std::mem::take(&mut self.header);
            if block.iter().all(|b| *b == 0) {
                self.ended = true;
                continue;
            }
            let h = tar::Header::from_byte_slice(&block);
            let size = h.entry_size().unwrap_or(0);
            if h.entry_type().is_file() {
                self.bytes = self
                    .bytes
                    .saturating_add(size.div_ceil(Self::PAGE) * Self::PAGE);
            }
            self.skip = size.div_ceil(512) * 512;
        }
    }
}

/// Writes `session`'s workspace as a tar into `saving` (on a blocking thread: file writes).
/// Refused (507) when its files would not fit the workspace's quota of `disk_bytes` once
/// restored: such a pause could never be resumed.
async fn save_workspace(
    session: &Session,
    saving: Saving,
    disk_bytes: u64,
) -> Result<Saving, SessionError> {
    let mut stream = session
        .export_archive("")
        .await
        .map_err(|e| ExecutionError::Internal(format!("reading the workspace: {e}")))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let writer = tokio::task::spawn_blocking(move || {
        let mut saving = saving;
        while let Some(chunk) = rx.blocking_recv() {
            if saving.write_all(&chunk).is_err() {
                break;
            }
        }
        saving
    });
    let mut read_error = None;
    let mut restored = RestoredSize::default();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => {
                restored.feed(&c);
                if restored.bytes > disk_bytes {
                    break;
                }
                if tx.send(c).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                read_error = Some(e.to_string());
                break;
            }
        }
    }
    drop(tx);
    let mut saving = writer
        .await
        .map_err(|e| ExecutionError::Internal(e.to_string()))?;
    if let Some(e) = saving.failure() {
        return Err(saved_error(e));
    }
    if restored.bytes > disk_bytes {
        return Err(SessionError::StoreFull(format!(
            "the workspace's files would take more than its quota of {disk_bytes} bytes once \
             restored (hard links and sparse files are saved whole): it is not paused"
        )));
    }
    if let Some(e) = read_error {
        return Err(ExecutionError::Internal(format!("reading the workspace: {e}")).into());
    }
    Ok(saving)
}

/// Restores the claimed session's saved workspace into `session`'s fresh sandbox: the tar is
/// checked against its recorded digest first, then extracted as the sandbox's own workspace.
async fn restore_workspace(session: &Session, claim: &Claim) -> Result<(), SessionError> {
    let check = claim
        .workspace()
        .map_err(|e| ExecutionError::Internal(format!("the saved workspace: {e}")))?;
    tokio::task::spawn_blocking(move || check.check())
        .await
        .map_err(|e| ExecutionError::Internal(e.to_string()))?
        .map_err(ExecutionError::Internal)?;
    let file = claim
        .workspace()
        .map_err(|e| ExecutionError::Internal(format!("the saved workspace: {e}")))?
        .into_file();
    session
        .import_archive(
            "",
            ImportMode::Restore,
            file_stream(file),
            Box::new(|_| true),
        )
        .await
        .map_err(|e| ExecutionError::Internal(format!("restoring the workspace: {e}")))?;
    Ok(())
}

/// A file as a stream of chunks, ending at its end or at its first read error.
fn file_stream(file: std::fs::File) -> ByteStream {
    let file = tokio::fs::File::from_std(file);
    futures::stream::unfold(Some(file), |state| async move {
        let mut f = state?;
        let mut buf = vec![0u8; 256 << 10];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), Some(f)))
            }
            Err(e) => Some((Err(e), None)),
        }
    })
    .boxed()
}
