//! Shared request state: single-use token ids and idempotency results.
//!
//! The embedded in-memory store is the default; with `state.redis_url` set, both live in Redis
//! so replicas share them. Must not: interpret the responses it stores.

pub mod memory;
pub mod redis_store;

use std::time::Duration;

/// A stored idempotent response.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    pub body: String,
}

/// What `idempotency_begin` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemBegin {
    /// The key is ours now: run, then `idempotency_complete` or `idempotency_abort`.
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
}

#[async_trait::async_trait]
pub trait StateStore: Send + Sync {
    /// Records a single-use jti until `exp`; false when it was seen before (a replay).
    async fn claim_jti(&self, jti: &str, exp_unix: u64) -> Result<bool, StateError>;
    /// Forgets a claimed jti whose request never ran (its start could not be audited), so the
    /// token stays usable.
    async fn release_jti(&self, jti: &str) -> Result<(), StateError>;
    /// Claims `key` for a request of `owner` (a daemon instance) when it is free. The claim is a
    /// lease: it lapses after `lease` unless renewed, so the key of a daemon that died mid-run
    /// frees itself.
    async fn idempotency_begin(
        &self,
        key: &str,
        body_hash: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<IdemBegin, StateError>;
    /// Extends `owner`'s claim on `key` to `lease` from now; false when `owner` holds no claim on
    /// it (finished, released, or lapsed and taken by another request).
    async fn idempotency_renew(
        &self,
        key: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<bool, StateError>;
    /// Stores the finished request's response for `ttl`.
    async fn idempotency_complete(
        &self,
        key: &str,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StateError>;
    /// Releases `owner`'s claim on `key` (a request that ended without a response to keep, or
    /// one of a daemon that stopped mid-run); a finished entry or another owner's claim stays.
    async fn idempotency_release(&self, key: &str, owner: &str) -> Result<(), StateError>;
    /// For /readyz.
    async fn healthy(&self) -> Result<(), StateError>;
    fn kind(&self) -> &'static str;
}
