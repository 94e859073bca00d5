//! Admission's parts: the run slots of each backend and the queue in front of them, and the
//! claim of a single-use token.
//!
//! Owns: how many runs a backend has at once, who waits for a slot and for how long, and that a
//! single-use token is used once. Must not: decide a request (see [`super::plan`]) or know HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::ExecutionService;
use super::result::ExecutionError;
use crate::auth::Verified;
use crate::config::TokenKind;
use crate::sandbox::BackendKind;
use crate::state::{JtiClaim, StateStore};

/// Why a single-use token could not be claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError {
    /// Replayed, or issued before the store's record begins, with the reason.
    Refused(String),
    /// The state store did not answer.
    Unavailable(String),
}

/// Uses up a single-use token's jti (a token that is not single-use passes). A replay, or a token
/// the store cannot vouch for (issued before its record began), is refused.
pub async fn claim_single_use(store: &dyn StateStore, token: &Verified) -> Result<(), ClaimError> {
    let Some(su) = &token.single_use else {
        return Ok(());
    };
    let kind = match su.kind {
        TokenKind::Service => "service token",
        TokenKind::Capability => "capability token",
    };
    match store.claim_jti(su).await {
        Ok(JtiClaim::Claimed) => Ok(()),
        Ok(JtiClaim::Replayed) => Err(ClaimError::Refused(format!(
            "{kind}: replayed single-use token"
        ))),
        Ok(JtiClaim::PredatesRecord { since }) => Err(ClaimError::Refused(format!(
            "{kind}: single-use token issued before {since} (unix), when this daemon's replay \
             record begins (its state store was created empty then)"
        ))),
        Err(e) => Err(ClaimError::Unavailable(e.to_string())),
    }
}

/// Resolves when the flag becomes true; never when its sender is gone with it still false.
pub(super) async fn raised(flag: &mut watch::Receiver<bool>) {
    if flag.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The run slots of one backend, at most `size` of its executions at once, and the queue in
/// front of them.
pub(super) struct RunSlots {
    /// Fair: waiters get slots first come, first served.
    pub(super) free: Arc<Semaphore>,
    pub(super) size: usize,
    /// Requests waiting for a slot now; never above [`QueueLimits::max_waiting`].
    pub(super) waiting: AtomicUsize,
}

/// How many requests may wait for a run slot of one backend, and for how long.
#[derive(Debug, Clone, Copy)]
pub(super) struct QueueLimits {
    pub(super) max_waiting: usize,
    pub(super) max_wait: Duration,
}

/// A request's place in a backend's queue: counted while it waits, given back however the wait
/// ends (a slot, the time limit, or the caller going away).
struct QueuePlace<'a> {
    waiting: &'a AtomicUsize,
    gauge: metrics::Gauge,
}

impl<'a> QueuePlace<'a> {
    /// A place, unless `max_waiting` requests already wait.
    fn take(waiting: &'a AtomicUsize, max_waiting: usize, gauge: metrics::Gauge) -> Option<Self> {
        waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max_waiting).then_some(n + 1)
            })
            .ok()?;
        gauge.increment(1.0);
        Some(QueuePlace { waiting, gauge })
    }
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.gauge.decrement(1.0);
    }
}

impl ExecutionService {
    /// A run slot of `backend`: a free one at once, else the first one freed after the requests
    /// queued before this one, within `server.queue.max_wait_ms`. Overloaded when the queue is
    /// full, the wait runs out or the caller raises `abandoned` meanwhile (its place is given
    /// back either way); Unavailable once the daemon is shutting down ([`Self::close_queue`]).
    pub(super) async fn take_slot(
        &self,
        backend: BackendKind,
        abandoned: Option<&watch::Receiver<bool>>,
    ) -> Result<OwnedSemaphorePermit, ExecutionError> {
        let slots = self
            .slots
            .get(&backend)
            .ok_or_else(|| ExecutionError::Unavailable("no run slots".into()))?;
        let shutting_down = || ExecutionError::Unavailable("the daemon is shutting down".into());
        let mut closed = self.queue_closed.subscribe();
        if *closed.borrow_and_update() {
            return Err(shutting_down());
        }
        let label = [backend.as_str()];
        let waited = self.metrics.queue_wait.with_label_values(&label);
        if let Ok(slot) = slots.free.clone().try_acquire_owned() {
            waited.record(0.0);
            return Ok(slot);
        }
        let gauge = self.metrics.queue_waiting.with_label_values(&label);
        let Some(_place) = QueuePlace::take(&slots.waiting, self.queue.max_waiting, gauge) else {
            return Err(ExecutionError::Overloaded(format!(
                "all {} {} run slots are busy and their queue is full (server.queue.max_waiting = {})",
                slots.size,
                backend.as_str(),
                self.queue.max_waiting
            )));
        };
        let since = std::time::Instant::now();
        let mut abandoned = abandoned.cloned();
        let caller_left = async {
            match abandoned.as_mut() {
                Some(flag) => raised(flag).await,
                None => std::future::pending().await,
            }
        };
        let slot = tokio::select! {
            slot = tokio::time::timeout(self.queue.max_wait, slots.free.clone().acquire_owned()) => slot,
            _ = raised(&mut closed) => return Err(shutting_down()),
            _ = caller_left => {
                return Err(ExecutionError::Overloaded(format!(
                    "the caller went away while waiting for a {} run slot",
                    backend.as_str()
                )));
            }
        };
        waited.record(since.elapsed().as_secs_f64());
        match slot {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_closed)) => Err(ExecutionError::Unavailable("run slots closed".into())),
            Err(_elapsed) => Err(ExecutionError::Overloaded(format!(
                "no {} run slot came free within server.queue.max_wait_ms = {}",
                backend.as_str(),
                self.queue.max_wait.as_millis()
            ))),
        }
    }
}
