//! An in-memory store: one process, entries expire, a restart forgets everything (Idempotency-Keys
//! in progress included). The daemon keeps its state in [`super::durable`] (or Redis); this one
//! serves the unit tests of the layers above, which need a store but no file.
//!
//! Two bounds keep it honest. Replay: it remembers nothing from before it started, so a
//! single-use token that may have been issued before then is refused (it may have been used on
//! the previous run). Idempotency: completed results are held within a byte budget; when a new
//! one does not fit, completed results are evicted oldest first from the subject holding the most
//! bytes, so one caller cannot push everyone else's results out. Running entries are never
//! evicted (they lapse when their owner stops renewing their lease); a result larger than the
//! whole budget is not stored.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::budget::{ResultBudget, result_bytes};
use super::{
    IdemBegin, IdemKey, JtiClaim, StateError, StateStore, StoredExecution, StoredResponse,
};
use crate::auth::SingleUse;

enum Slot {
    Running {
        body_hash: String,
        owner: String,
    },
    Done {
        body_hash: String,
        response: StoredResponse,
        /// Completion order, for oldest-first eviction.
        seq: u64,
        bytes: usize,
    },
}

struct Entry {
    subject: String,
    expires: Instant,
    slot: Slot,
}

/// What `IdemTable::complete` did with a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Completion {
    Stored,
    /// Larger than the whole budget: dropped, and the key released.
    TooLarge {
        bytes: usize,
    },
}

/// Idempotency entries keyed by [`IdemKey::scoped`], completed results within `max_bytes`.
struct IdemTable {
    entries: HashMap<String, Entry>,
    budget: ResultBudget,
}

impl IdemTable {
    fn new(max_bytes: usize) -> Self {
        IdemTable {
            entries: HashMap::new(),
            budget: ResultBudget::new(max_bytes),
        }
    }

    fn purge_expired(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| e.expires <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for k in expired {
            self.remove(&k);
        }
    }

    fn remove(&mut self, scoped: &str) {
        let Some(e) = self.entries.remove(scoped) else {
            return;
        };
        if let Slot::Done { seq, bytes, .. } = e.slot {
            self.budget.remove(&e.subject, seq, bytes);
        }
    }

    /// Evicts the oldest completed result of the subject holding the most bytes; false when
    /// there is none.
    fn evict_one(&mut self) -> bool {
        match self.budget.victim() {
            Some(k) => {
                self.remove(&k);
                true
            }
            None => false,
        }
    }

    /// Claims `key` for `owner` for `lease` when it is free (or its claim lapsed).
    fn begin(
        &mut self,
        key: &IdemKey,
        body_hash: &str,
        owner: &str,
        lease: Duration,
        now: Instant,
    ) -> IdemBegin {
        self.purge_expired(now);
        let scoped = key.scoped();
        match self.entries.get(&scoped).map(|e| &e.slot) {
            Some(Slot::Running { body_hash: h, .. }) => IdemBegin::InProgress {
                same_body: h == body_hash,
            },
            Some(Slot::Done {
                body_hash: h,
                response,
                ..
            }) => IdemBegin::Done {
                same_body: h == body_hash,
                response: response.clone(),
            },
            None => {
                self.entries.insert(
                    scoped,
                    Entry {
                        subject: key.subject.clone(),
                        expires: now + lease,
                        slot: Slot::Running {
                            body_hash: body_hash.to_string(),
                            owner: owner.to_string(),
                        },
                    },
                );
                IdemBegin::Started
            }
        }
    }

    /// Extends `owner`'s live claim on `key` to `lease` from `now`; false when it holds none.
    fn renew(&mut self, key: &IdemKey, owner: &str, lease: Duration, now: Instant) -> bool {
        match self.entries.get_mut(&key.scoped()) {
            Some(Entry {
                expires,
                slot: Slot::Running { owner: o, .. },
                ..
            }) if *expires > now && o == owner => {
                *expires = now + lease;
                true
            }
            _ => false,
        }
    }

    /// Forgets `owner`'s claim on `key`; a finished entry or another owner's claim stays.
    fn release(&mut self, key: &IdemKey, owner: &str) {
        let scoped = key.scoped();
        if matches!(
            self.entries.get(&scoped).map(|e| &e.slot),
            Some(Slot::Running { owner: o, .. }) if o == owner
        ) {
            self.remove(&scoped);
        }
    }

    /// The completed result stored under `key`, unless it expired.
    fn done(&mut self, key: &IdemKey, now: Instant) -> Option<StoredResponse> {
        self.purge_expired(now);
        match self.entries.get(&key.scoped()).map(|e| &e.slot) {
            Some(Slot::Done { response, .. }) => Some(response.clone()),
            _ => None,
        }
    }

    fn complete(
        &mut self,
        key: &IdemKey,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
        now: Instant,
    ) -> Completion {
        let scoped = key.scoped();
        self.remove(&scoped);
        let bytes = result_bytes(&scoped, &key.subject, body_hash, &response.body);
        if self.budget.too_large(bytes) {
            return Completion::TooLarge { bytes };
        }
        while self.budget.overfull_with(bytes) && self.evict_one() {}
        let seq = self.budget.add(&key.subject, &scoped, bytes);
        self.entries.insert(
            scoped,
            Entry {
                subject: key.subject.clone(),
                expires: now + ttl,
                slot: Slot::Done {
                    body_hash: body_hash.to_string(),
                    response: response.clone(),
                    seq,
                    bytes,
                },
            },
        );
        Completion::Stored
    }
}

pub struct MemoryStore {
    /// First unix second this store can vouch for: a token issued in the second the daemon
    /// started may predate it.
    horizon: u64,
    jtis: Mutex<HashMap<String, u64>>,
    idem: Mutex<IdemTable>,
    /// Run records, kept like completed idempotent results (same budget, same fair eviction),
    /// each as its JSON in a result's body.
    executions: Mutex<IdemTable>,
}

impl MemoryStore {
    /// `idempotency_max_bytes` bounds the completed results held. `leeway_seconds` is the clock
    /// leeway token verification allows: a token issued up to that far in the future is accepted,
    /// so one used just before a restart can carry an `iat` up to that much after it.
    pub fn new(idempotency_max_bytes: usize, leeway_seconds: u64) -> Self {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        MemoryStore {
            horizon: started.as_secs() + u64::from(started.subsec_nanos() > 0) + leeway_seconds,
            jtis: Mutex::new(HashMap::new()),
            idem: Mutex::new(IdemTable::new(idempotency_max_bytes)),
            executions: Mutex::new(IdemTable::new(idempotency_max_bytes)),
        }
    }
}

#[async_trait::async_trait]
impl StateStore for MemoryStore {
    async fn claim_jti(&self, token: &SingleUse) -> Result<JtiClaim, StateError> {
        if token.may_predate(self.horizon) {
            return Ok(JtiClaim::PredatesRecord {
                since: self.horizon,
            });
        }
        let now = crate::auth::now();
        let mut m = self.jtis.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 10_000 {
            m.retain(|_, exp| *exp + 60 >= now);
        }
        let key = token.replay_key();
        if m.contains_key(&key) {
            return Ok(JtiClaim::Replayed);
        }
        m.insert(key, token.exp);
        Ok(JtiClaim::Claimed)
    }

    async fn release_jti(&self, token: &SingleUse) -> Result<(), StateError> {
        self.jtis
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token.replay_key());
        Ok(())
    }

    async fn idempotency_begin(
        &self,
        key: &IdemKey,
        body_hash: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<IdemBegin, StateError> {
        let mut t = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        Ok(t.begin(key, body_hash, owner, lease, Instant::now()))
    }

    async fn idempotency_renew(
        &self,
        key: &IdemKey,
        owner: &str,
        lease: Duration,
    ) -> Result<bool, StateError> {
        let mut t = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        Ok(t.renew(key, owner, lease, Instant::now()))
    }

    async fn idempotency_complete(
        &self,
        key: &IdemKey,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let mut t = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        if let Completion::TooLarge { bytes } =
            t.complete(key, body_hash, response, ttl, Instant::now())
        {
            tracing::warn!(
                subject = %key.subject,
                bytes,
                max_bytes = t.budget.max_bytes(),
                "idempotent result larger than state.idempotency_max_bytes: not stored, a retry runs again"
            );
        }
        Ok(())
    }

    async fn idempotency_release(&self, key: &IdemKey, owner: &str) -> Result<(), StateError> {
        self.idem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .release(key, owner);
        Ok(())
    }

    async fn execution_put(
        &self,
        key: &IdemKey,
        record: &StoredExecution,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let body = serde_json::to_string(record)
            .map_err(|e| StateError::Unavailable(format!("run record: {e}")))?;
        let mut t = self.executions.lock().unwrap_or_else(|p| p.into_inner());
        let stored = StoredResponse { status: 0, body };
        if let Completion::TooLarge { bytes } = t.complete(key, "", &stored, ttl, Instant::now()) {
            tracing::warn!(
                subject = %key.subject,
                bytes,
                max_bytes = t.budget.max_bytes(),
                "run record larger than state.idempotency_max_bytes: not kept"
            );
        }
        Ok(())
    }

    async fn execution_get(&self, key: &IdemKey) -> Result<Option<StoredExecution>, StateError> {
        let mut t = self.executions.lock().unwrap_or_else(|p| p.into_inner());
        Ok(t.done(key, Instant::now())
            .and_then(|r| serde_json::from_str(&r.body).ok()))
    }

    async fn healthy(&self) -> Result<(), StateError> {
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests;
