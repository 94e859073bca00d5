//! One-shot runs served again: a container that ended a one-shot run cleanly is scrubbed and
//! kept for the next one-shot run of the same trust scope (the calling service, named by the
//! execution service in [`RunSpec::reuse_scope`](crate::sandbox::RunSpec)) and the same container
//! shape (profile, image, limits: the plan's key). A container never serves two scopes.
//!
//! Such a container runs its supervisor in kept mode, as a session's does: every process of a
//! run carries the run's marker group and is killed when the run ends. Before it serves again
//! the supervisor scrubs it (`supervisor/src/scrub.rs`: every process killed, the workdir and
//! `/tmp` emptied and their modes put back, its self-check). A run that was killed (timeout,
//! output cap, cancel, signal), OOM-killed, or found its container gone, a failed scrub, and a
//! container past `pool_max_uses` runs or `pool_max_age_seconds` discard the container. The
//! scrub runs after the run's answer, off its path.
//!
//! Owns: the idle reused containers per (scope, shape), their bounds, the verdict whether a
//! finished run's container may serve again, and its scrub before it goes back. Must not: run
//! commands (the kept container does), or choose a run's scope.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::kept::KeptContainer;
use crate::sandbox::RunOutcome;
use crate::sandbox::files::Kept;

/// Idle reused containers per (scope, shape) at most: as many as runs of one scope commonly
/// overlap; a container finishing past it is discarded.
const MAX_IDLE_PER_KEY: usize = 8;
/// Idle reused containers at most, every scope together (each holds a supervisor, a tmpfs and a
/// uid of the daemon's block).
const MAX_IDLE: usize = 64;
/// An idle reused container unused this long is discarded (its scope's traffic stopped).
const IDLE_FOR: Duration = Duration::from_secs(60);

/// A reused container's bounds (`[sandbox.docker]` `pool_max_uses`, `pool_max_age_seconds`).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub max_uses: u32,
    pub max_age: Duration,
}

/// (scope, container shape).
pub type Key = (String, String);

/// A container that serves runs of one scope, with its count of runs served and its start.
pub struct Reusable {
    pub kept: Arc<KeptContainer>,
    pub uses: u32,
    pub born: Instant,
}

struct Idle {
    item: Reusable,
    since: Instant,
}

/// The idle reused containers of one backend.
pub struct Reuse {
    settings: Settings,
    idle: Mutex<HashMap<Key, Vec<Idle>>>,
    closed: AtomicBool,
}

impl Reuse {
    pub fn new(settings: Settings) -> Arc<Reuse> {
        Arc::new(Reuse {
            settings,
            idle: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Vec<Idle>>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `item` may serve one more run now: within its bounds, and alive (an idle
    /// supervisor writes nothing; a container that stopped meanwhile is found so here).
    fn serves(&self, item: &Reusable) -> bool {
        item.uses < self.settings.max_uses
            && item.born.elapsed() < self.settings.max_age
            && Kept::gone(&item.kept).is_none()
    }

    /// An idle container of `key` that may serve one more run (the last one back first: its
    /// caches are the warmest), or None.
    pub fn take(&self, key: &Key) -> Option<Reusable> {
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        let mut dropped = Vec::new();
        let got = {
            let mut idle = self.lock();
            let list = idle.get_mut(key)?;
            let mut got = None;
            while let Some(i) = list.pop() {
                if self.serves(&i.item) {
                    got = Some(i.item);
                    break;
                }
                dropped.push(i);
            }
            if list.is_empty() {
                idle.remove(key);
            }
            got
        };
        // Dropped outside the lock: a container's guard hands it to the janitor.
        drop(dropped);
        got
    }

    /// After a run in `item`'s container: whether it may serve again (no anomaly, within its
    /// bounds); then, on a task of its own, its scrub and its way back among the idle ones.
    /// Anything else drops it (its guard removes the container).
    pub fn settle(self: &Arc<Self>, key: Key, item: Reusable, outcome: Option<&RunOutcome>) {
        if let Some(why) = self.anomaly(&item, outcome) {
            tracing::info!(container = %super::short(item.kept.id()), uses = item.uses, why, "reused container discarded");
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(why) = item.kept.scrub().await {
                tracing::warn!(container = %super::short(item.kept.id()), uses = item.uses, why, "reused container discarded: its scrub failed");
                return;
            }
            me.put(key, item);
        });
    }

    /// Why a container must not serve again after a run that ended with `outcome` (None: the
    /// run failed in the daemon), or None.
    fn anomaly(&self, item: &Reusable, outcome: Option<&RunOutcome>) -> Option<&'static str> {
        let Some(o) = outcome else {
            return Some("the run failed");
        };
        if o.oom {
            return Some("the run ran out of memory");
        }
        if o.killed_reason.is_some() {
            return Some("the run was killed");
        }
        if self.closed.load(Ordering::SeqCst) {
            return Some("the daemon is stopping");
        }
        if !self.serves(item) {
            return Some("it reached its runs or its age");
        }
        None
    }

    fn put(&self, key: Key, item: Reusable) {
        if self.closed.load(Ordering::SeqCst) || !self.serves(&item) {
            return;
        }
        let mut idle = self.lock();
        let total: usize = idle.values().map(Vec::len).sum();
        let list = idle.entry(key).or_default();
        if list.len() >= MAX_IDLE_PER_KEY || total >= MAX_IDLE {
            drop(idle);
            tracing::info!(container = %super::short(item.kept.id()), "reused container discarded: enough are idle");
            return;
        }
        list.push(Idle {
            item,
            since: Instant::now(),
        });
    }

    /// Discards the idle containers that may not serve again or were unused for [`IDLE_FOR`].
    pub fn prune(&self) {
        let mut dropped = Vec::new();
        {
            let mut idle = self.lock();
            for list in idle.values_mut() {
                let (keep, gone): (Vec<Idle>, Vec<Idle>) = std::mem::take(list)
                    .into_iter()
                    .partition(|i| self.serves(&i.item) && i.since.elapsed() < IDLE_FOR);
                *list = keep;
                dropped.extend(gone);
            }
            idle.retain(|_, l| !l.is_empty());
        }
        drop(dropped);
    }

    /// Discards every idle container (the engine restarted: they may be gone or stale).
    pub fn flush(&self) {
        let all: Vec<Vec<Idle>> = self.lock().drain().map(|(_, l)| l).collect();
        drop(all);
    }

    /// The daemon stops: nothing goes back from now on; the idle ones are discarded.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.flush();
    }

    /// Idle reused containers.
    pub fn idle(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }
}
