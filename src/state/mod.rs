//! Shared request state: single-use token ids, idempotency results and the records of runs (so
//! any replica can answer for a run, and find the one that runs it).
//!
//! The embedded store ([`durable`], a file under `state.dir`) is the default and survives
//! restarts; with `state.redis_url` set, everything lives in Redis so replicas share it. An
//! embedded store refuses single-use tokens that may predate its record
//! ([`JtiClaim::PredatesRecord`]): the file's begins when it is created, the in-memory store's
//! ([`memory`], for tests) at every start. Must not: interpret the responses it stores.

mod budget;
pub mod durable;
pub mod memory;
pub mod redis_store;

use std::time::Duration;

use crate::auth::SingleUse;

/// A key scoped to the calling service's subject: an Idempotency-Key as the caller sent it, or
/// an `exec_id` (only the subject that started a run finds its record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemKey {
    pub subject: String,
    pub key: String,
}

impl IdemKey {
    /// The store key. The subject's length comes first, so no (subject, key) pair can spell
    /// another's (`a` + `b:c` vs `a:b` + `c`).
    pub fn scoped(&self) -> String {
        format!("{}:{}:{}", self.subject.len(), self.subject, self.key)
    }

    /// Reads back a [`IdemKey::scoped`] string (as an audit line records it); None when `s` is
    /// not one.
    pub fn from_scoped(s: &str) -> Option<IdemKey> {
        let (digits, rest) = s.split_once(':')?;
        let len: usize = digits.parse().ok()?;
        if len.to_string() != digits {
            return None; // "+3", "03": not what `scoped` writes
        }
        let subject = rest.get(..len)?;
        let key = rest.get(len..)?.strip_prefix(':')?;
        Some(IdemKey {
            subject: subject.to_string(),
            key: key.to_string(),
        })
    }
}

/// What claiming a single-use token's jti found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JtiClaim {
    /// First use: the jti is recorded until the token expires.
    Claimed,
    /// Seen before: a replay.
    Replayed,
    /// The token may have been issued before this store's record begins (unix second `since`),
    /// so it may have been used before: refused, never recorded. The in-memory store's record
    /// begins at its start, the embedded file's when the file was created (not at a restart).
    PredatesRecord { since: u64 },
}

/// A stored idempotent response.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    pub body: String,
    /// A finished run's receipt (a DSSE envelope, as JSON), kept with its answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<String>,
}

/// A run as the store keeps it, for `retention` after it finished.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredExecution {
    /// The daemon instance that runs (or ran) it.
    pub instance: String,
    /// How other replicas reach that instance (`http://host:port`), when it is known.
    #[serde(default)]
    pub address: Option<String>,
    /// Its answer, once it finished.
    #[serde(default)]
    pub response: Option<StoredResponse>,
    /// The subject that asked to cancel it, if one did.
    #[serde(default)]
    pub cancelled_by: Option<String>,
    /// The backend and profile it ran on (a stream's `start` names them even when its answer
    /// is an error that does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

/// What `idempotency_begin` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemBegin {
    /// The key is ours now: run (renewing the lease), then `idempotency_complete` or
    /// `idempotency_release`.
    Started,
    /// Another request with this key is running.
    InProgress { same_body: bool },
    /// Finished earlier.
    Done {
        same_body: bool,
        response: StoredResponse,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state store unavailable: {0}")]
    Unavailable(String),
    /// The embedded store's file cannot be used as it is (at start).
    #[error("state file {path}: {reason}")]
    File {
        path: std::path::PathBuf,
        reason: String,
    },
}

/// Where a session lives: the replica that holds its workspace and runs its execs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct SessionRecord {
    pub instance: String,
    /// How other replicas reach it (`server.advertise_url`), when known.
    pub address: Option<String>,
}

#[async_trait::async_trait]
pub trait StateStore: Send + Sync {
    /// Records a single-use token's jti until it expires, unless it was seen before or may
    /// predate what the store remembers.
    async fn claim_jti(&self, token: &SingleUse) -> Result<JtiClaim, StateError>;
    /// Forgets a claimed jti whose request never ran (its start could not be audited), so the
    /// token stays usable.
    async fn release_jti(&self, token: &SingleUse) -> Result<(), StateError>;
    /// Claims `key` for a request of `owner` (a daemon instance) when it is free. The claim is a
    /// lease: it lapses after `lease` unless renewed, so the key of a daemon that died mid-run
    /// frees itself.
    async fn idempotency_begin(
        &self,
        key: &IdemKey,
        body_hash: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<IdemBegin, StateError>;
    /// Extends `owner`'s claim on `key` to `lease` from now; false when `owner` holds no claim on
    /// it (finished, released, or lapsed and taken by another request).
    async fn idempotency_renew(
        &self,
        key: &IdemKey,
        owner: &str,
        lease: Duration,
    ) -> Result<bool, StateError>;
    /// Stores the finished request's response for `ttl`. A store may drop it (too large for its
    /// budget); a retry then runs again, as after the TTL.
    async fn idempotency_complete(
        &self,
        key: &IdemKey,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StateError>;
    /// Releases `owner`'s claim on `key` (a request that ended without a response to keep, or
    /// one of a daemon that stopped mid-run); a finished entry or another owner's claim stays.
    async fn idempotency_release(&self, key: &IdemKey, owner: &str) -> Result<(), StateError>;
    /// Stores (or replaces) the record of the run `key` names for `ttl`. The embedded stores
    /// keep records within a byte budget and may drop the oldest.
    async fn execution_put(
        &self,
        key: &IdemKey,
        record: &StoredExecution,
        ttl: Duration,
    ) -> Result<(), StateError>;
    /// The record of the run `key` names, if it is kept.
    async fn execution_get(&self, key: &IdemKey) -> Result<Option<StoredExecution>, StateError>;
    /// Records which replica holds session `id`, for `ttl`. A store one daemon alone uses keeps
    /// nothing: its sessions are all its own.
    async fn session_put(
        &self,
        _id: &str,
        _record: &SessionRecord,
        _ttl: Duration,
    ) -> Result<(), StateError> {
        Ok(())
    }
    /// Which replica holds session `id`, if another one recorded it.
    async fn session_get(&self, _id: &str) -> Result<Option<SessionRecord>, StateError> {
        Ok(None)
    }
    /// Forgets session `id` (it ended).
    async fn session_remove(&self, _id: &str) -> Result<(), StateError> {
        Ok(())
    }
    /// Publishes a replica's receipts public key (`keyid`, PEM) for `ttl`, so that every replica
    /// lists it. A store one daemon alone uses keeps nothing: its key is its own.
    async fn receipt_key_put(
        &self,
        _keyid: &str,
        _pem: &str,
        _ttl: Duration,
    ) -> Result<(), StateError> {
        Ok(())
    }
    /// The receipts public keys replicas published: (keyid, PEM).
    async fn receipt_keys(&self) -> Result<Vec<(String, String)>, StateError> {
        Ok(Vec::new())
    }
    /// For /readyz.
    async fn healthy(&self) -> Result<(), StateError>;
    fn kind(&self) -> &'static str;
}

#[cfg(test)]
mod tests {
    use super::IdemKey;

    #[test]
    fn a_scoped_key_reads_back_as_the_pair_it_came_from() {
        for (subject, key) in [
            ("orch", "k"),
            ("a", "b:c"),
            ("a:b", "c"),
            ("-", ""),
            ("é", ":"),
        ] {
            let k = IdemKey {
                subject: subject.into(),
                key: key.into(),
            };
            assert_eq!(IdemKey::from_scoped(&k.scoped()), Some(k));
        }
        for bad in [
            "",
            "orch:k",
            "4:orch",
            "5:orch:k",
            "04:orch:k",
            "+4:orch:k",
            "1:\u{e9}:k",
        ] {
            assert_eq!(IdemKey::from_scoped(bad), None, "{bad}");
        }
    }
}
