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
        let stored = StoredResponse {
            status: 0,
            body,
            receipt: None,
        };
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
mod tests {
    use super::*;
    use crate::config::TokenKind;

    fn key(subject: &str, k: &str) -> IdemKey {
        IdemKey {
            subject: subject.into(),
            key: k.into(),
        }
    }

    fn response(len: usize) -> StoredResponse {
        StoredResponse {
            status: 200,
            body: "x".repeat(len),
            receipt: None,
        }
    }

    fn single_use(kind: TokenKind, jti: &str, iat: Option<u64>) -> SingleUse {
        SingleUse {
            kind,
            jti: jti.into(),
            iat,
            exp: crate::auth::now() + 60,
        }
    }

    const TTL: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn jti_once_and_idempotency_states() {
        let s = MemoryStore::new(1 << 20, 0);
        let fresh = single_use(TokenKind::Capability, "a", Some(s.horizon));
        assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Claimed);
        assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Replayed);
        // A released jti (its request never ran) can be claimed once more, and only once.
        s.release_jti(&fresh).await.unwrap();
        assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Claimed);
        assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Replayed);
        // The same jti on a service token is another token.
        let svc = single_use(TokenKind::Service, "a", Some(s.horizon));
        assert_eq!(s.claim_jti(&svc).await.unwrap(), JtiClaim::Claimed);
        assert_eq!(s.claim_jti(&svc).await.unwrap(), JtiClaim::Replayed);

        let k = key("orch", "k");
        assert_eq!(
            s.idempotency_begin(&k, "h1", "d1", TTL).await.unwrap(),
            IdemBegin::Started
        );
        assert_eq!(
            s.idempotency_begin(&k, "h1", "d2", TTL).await.unwrap(),
            IdemBegin::InProgress { same_body: true }
        );
        // Only the owner's release frees a claim.
        s.idempotency_release(&k, "d2").await.unwrap();
        assert_eq!(
            s.idempotency_begin(&k, "h2", "d2", TTL).await.unwrap(),
            IdemBegin::InProgress { same_body: false }
        );
        assert!(s.idempotency_renew(&k, "d1", TTL).await.unwrap());
        assert!(!s.idempotency_renew(&k, "d2", TTL).await.unwrap());
        let r = response(2);
        s.idempotency_complete(&k, "h1", &r, TTL).await.unwrap();
        // A finished entry is neither renewed nor released.
        assert!(!s.idempotency_renew(&k, "d1", TTL).await.unwrap());
        s.idempotency_release(&k, "d1").await.unwrap();
        assert_eq!(
            s.idempotency_begin(&k, "h2", "d2", TTL).await.unwrap(),
            IdemBegin::Done {
                same_body: false,
                response: r
            }
        );
        // Another subject's identical key is its own.
        assert_eq!(
            s.idempotency_begin(&key("other", "k"), "h1", "d1", TTL)
                .await
                .unwrap(),
            IdemBegin::Started
        );
    }

    #[tokio::test]
    async fn a_lapsed_claim_frees_the_key_and_cannot_be_renewed() {
        let s = MemoryStore::new(1 << 20, 0);
        let k = key("orch", "k");
        assert_eq!(
            s.idempotency_begin(&k, "h", "dead", Duration::ZERO)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        assert!(!s.idempotency_renew(&k, "dead", TTL).await.unwrap());
        assert_eq!(
            s.idempotency_begin(&k, "h", "live", TTL).await.unwrap(),
            IdemBegin::Started
        );
        // The dead owner's late release leaves the new claim alone.
        s.idempotency_release(&k, "dead").await.unwrap();
        assert_eq!(
            s.idempotency_begin(&k, "h", "other", TTL).await.unwrap(),
            IdemBegin::InProgress { same_body: true }
        );
    }

    #[tokio::test]
    async fn a_single_use_token_that_may_predate_the_store_is_refused_and_not_recorded() {
        let s = MemoryStore::new(1 << 20, 0);
        let since = s.horizon;
        assert!(since >= 1, "the horizon is a real time");
        for iat in [None, Some(since - 1), Some(0)] {
            let t = single_use(TokenKind::Capability, "old", iat);
            assert_eq!(
                s.claim_jti(&t).await.unwrap(),
                JtiClaim::PredatesRecord { since },
                "{iat:?}"
            );
        }
        let t = single_use(TokenKind::Service, "old-svc", None);
        assert_eq!(
            s.claim_jti(&t).await.unwrap(),
            JtiClaim::PredatesRecord { since }
        );
        // Nothing was recorded: the first token issued at the horizon is a first use.
        let t = single_use(TokenKind::Capability, "old", Some(since));
        assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Claimed);
    }

    #[test]
    fn the_horizon_is_the_first_whole_second_after_start() {
        let before = crate::auth::now();
        let s = MemoryStore::new(1, 0);
        let after = crate::auth::now();
        // A token with iat == the start second may have been issued just before the start.
        assert!(
            s.horizon >= before && s.horizon <= after + 1,
            "{before} {} {after}",
            s.horizon
        );
    }

    /// Bytes one stored result of `key` with a 1-byte body hash and `body` bytes costs.
    fn cost(k: &IdemKey, body: usize) -> usize {
        result_bytes(&k.scoped(), &k.subject, "h", &"x".repeat(body))
    }

    fn done(t: &IdemTable, k: &IdemKey, now: Instant) -> bool {
        t.entries
            .get(&k.scoped())
            .is_some_and(|e| e.expires > now && matches!(e.slot, Slot::Done { .. }))
    }

    #[test]
    fn eviction_takes_the_oldest_result_of_the_subject_holding_the_most_bytes() {
        let now = Instant::now();
        let body = 1000;
        let unit = cost(&key("greedy", "g0"), body);
        // Room for four results.
        let mut t = IdemTable::new(4 * unit + unit / 2);
        let quiet = key("quietx", "q0");
        assert_eq!(cost(&quiet, body), unit);
        assert_eq!(t.begin(&quiet, "h", "d", TTL, now), IdemBegin::Started);
        assert_eq!(
            t.complete(&quiet, "h", &response(body), TTL, now),
            Completion::Stored
        );
        // An in-progress entry of the greedy subject, never evicted.
        let running = key("greedy", "gr");
        assert_eq!(t.begin(&running, "h", "d", TTL, now), IdemBegin::Started);
        let greedy: Vec<IdemKey> = (0..10).map(|i| key("greedy", &format!("g{i}"))).collect();
        for (i, g) in greedy.iter().enumerate() {
            assert_eq!(t.begin(g, "h", "d", TTL, now), IdemBegin::Started);
            assert_eq!(
                t.complete(g, "h", &response(body), TTL, now),
                Completion::Stored
            );
            assert!(
                t.budget.bytes() <= t.budget.max_bytes(),
                "{i}: {}",
                t.budget.bytes()
            );
        }
        // The greedy subject evicted only its own oldest results.
        assert!(done(&t, &quiet, now), "the quiet subject's result survives");
        for g in &greedy[..7] {
            assert!(!done(&t, g, now), "{g:?} is evicted");
            assert_eq!(
                t.begin(g, "h", "d", TTL, now),
                IdemBegin::Started,
                "{g:?} runs again"
            );
            t.remove(&g.scoped());
        }
        for g in &greedy[7..] {
            assert!(done(&t, g, now), "{g:?} is kept");
        }
        assert_eq!(
            t.begin(&running, "h", "d", TTL, now),
            IdemBegin::InProgress { same_body: true },
            "an in-progress entry is never evicted"
        );
        assert_eq!(t.budget.bytes(), 4 * unit);

        // Now the quiet subject adds results: the greedy one still holds the most, so it pays.
        let q1 = key("quietx", "q1");
        t.begin(&q1, "h", "d", TTL, now);
        assert_eq!(
            t.complete(&q1, "h", &response(body), TTL, now),
            Completion::Stored
        );
        assert!(done(&t, &quiet, now) && done(&t, &q1, now));
        assert!(!done(&t, &greedy[7], now), "greedy's oldest went first");
        assert!(done(&t, &greedy[8], now) && done(&t, &greedy[9], now));
    }

    #[test]
    fn a_result_larger_than_the_budget_is_not_stored_and_the_key_is_released() {
        let now = Instant::now();
        let k = key("s", "big");
        let small = key("s", "small");
        let mut t = IdemTable::new(cost(&small, 10) * 2);
        t.begin(&small, "h", "d", TTL, now);
        assert_eq!(
            t.complete(&small, "h", &response(10), TTL, now),
            Completion::Stored
        );
        assert_eq!(t.begin(&k, "h", "d", TTL, now), IdemBegin::Started);
        let big = cost(&k, 10_000);
        assert_eq!(
            t.complete(&k, "h", &response(10_000), TTL, now),
            Completion::TooLarge { bytes: big }
        );
        assert_eq!(
            t.begin(&k, "h", "d", TTL, now),
            IdemBegin::Started,
            "a retry runs"
        );
        assert!(done(&t, &small, now), "nothing was evicted for it");
    }

    #[test]
    fn expired_results_give_their_bytes_back() {
        let now = Instant::now();
        let k = key("s", "k");
        let mut t = IdemTable::new(1 << 20);
        t.begin(&k, "h", "d", TTL, now);
        t.complete(&k, "h", &response(500), TTL, now);
        assert_eq!(t.budget.bytes(), cost(&k, 500));
        assert_eq!(
            t.begin(&key("s", "other"), "h", "d", TTL, now + TTL),
            IdemBegin::Started
        );
        assert_eq!(t.budget.bytes(), 0);
        assert!(t.budget.is_empty());
        assert_eq!(t.begin(&k, "h", "d", TTL, now + TTL), IdemBegin::Started);
    }

    #[test]
    fn scoped_keys_of_different_pairs_never_collide() {
        assert_ne!(key("a", "b:c").scoped(), key("a:b", "c").scoped());
    }

    /// Verification accepts an `iat` up to the leeway in the future: a token used just before a
    /// restart can carry an `iat` up to that much after the new start, so the horizon covers it.
    #[tokio::test]
    async fn the_horizon_covers_the_verification_leeway() {
        let before = crate::auth::now();
        let s = MemoryStore::new(1, 5);
        assert!(s.horizon >= before + 5, "{before} {}", s.horizon);
        let ahead = single_use(TokenKind::Capability, "ahead", Some(before + 4));
        assert!(matches!(
            s.claim_jti(&ahead).await.unwrap(),
            JtiClaim::PredatesRecord { .. }
        ));
        let after = single_use(TokenKind::Capability, "after", Some(s.horizon));
        assert_eq!(s.claim_jti(&after).await.unwrap(), JtiClaim::Claimed);
    }
}
