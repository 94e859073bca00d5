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
/// A run finding none of its key's containers idle while one is being scrubbed waits this long
/// at most for it: a scrub takes milliseconds, a container from the pool or a launch costs
/// dockerd and the runtime hundreds of milliseconds of CPU.
const SCRUB_WAIT: Duration = Duration::from_millis(100);

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

/// One key's containers between runs.
#[derive(Default)]
struct Slot {
    idle: Vec<Idle>,
    /// Being scrubbed: they may come back.
    scrubbing: usize,
    /// Runs waiting for one of those ([`SCRUB_WAIT`]): at most one per container scrubbed.
    waiting: usize,
}

impl Slot {
    fn unused(&self) -> bool {
        self.idle.is_empty() && self.scrubbing == 0 && self.waiting == 0
    }
}

/// The idle reused containers of one backend.
pub struct Reuse {
    settings: Settings,
    slots: Mutex<HashMap<Key, Slot>>,
    /// Notified when a scrub ends (its container back or discarded).
    scrubbed: tokio::sync::Notify,
    closed: AtomicBool,
}

/// What [`Reuse::try_take`] found.
enum Found {
    Taken(Reusable),
    /// None idle, but one is being scrubbed and no other run waits for it.
    Coming,
    Nothing,
}

/// A run waiting for a container of `key` being scrubbed; its drop ends the wait's count.
struct Waiting<'a> {
    reuse: &'a Reuse,
    key: &'a Key,
    counted: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut slots = self.reuse.lock();
        if let Some(slot) = slots.get_mut(self.key) {
            slot.waiting = slot.waiting.saturating_sub(1);
            if slot.unused() {
                slots.remove(self.key);
            }
        }
    }
}

/// A scrub in progress for `key`: ended by [`Scrubbing::end`], else by its drop (nothing back).
struct Scrubbing {
    reuse: Arc<Reuse>,
    key: Option<Key>,
}

impl Scrubbing {
    fn end(&mut self, item: Option<Reusable>) {
        if let Some(key) = self.key.take() {
            self.reuse.put(key, item);
            self.reuse.scrubbed.notify_waiters();
        }
    }
}

impl Drop for Scrubbing {
    fn drop(&mut self) {
        self.end(None);
    }
}

impl Reuse {
    pub fn new(settings: Settings) -> Arc<Reuse> {
        Arc::new(Reuse {
            settings,
            slots: Mutex::new(HashMap::new()),
            scrubbed: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `item` may serve one more run now: within its bounds, and alive (an idle
    /// supervisor writes nothing; a container that stopped meanwhile is found so here).
    fn serves(&self, item: &Reusable) -> bool {
        item.uses < self.settings.max_uses
            && item.born.elapsed() < self.settings.max_age
            && Kept::gone(&item.kept).is_none()
    }

    /// An idle container of `key` that may serve one more run (the last one back first: its
    /// caches are the warmest), or None. With none idle but one being scrubbed, waits for it
    /// ([`SCRUB_WAIT`] at most).
    pub async fn take(&self, key: &Key) -> Option<Reusable> {
        let deadline = tokio::time::Instant::now() + SCRUB_WAIT;
        // Counts this run among the waiting ones once it waits, until it returns or is dropped.
        let mut ticket = Waiting {
            reuse: self,
            key,
            counted: false,
        };
        loop {
            // Registered before looking, so a scrub ending in between is not missed.
            let notified = self.scrubbed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_take(key, &mut ticket.counted) {
                Found::Taken(item) => return Some(item),
                Found::Nothing => return None,
                Found::Coming => {}
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// One look at `key`'s containers; `waiting`: whether this run already counts among the
    /// waiting ones (set when it starts to).
    fn try_take(&self, key: &Key, waiting: &mut bool) -> Found {
        if self.closed.load(Ordering::SeqCst) {
            return Found::Nothing;
        }
        let mut dropped = Vec::new();
        let found = {
            let mut slots = self.lock();
            let Some(slot) = slots.get_mut(key) else {
                return Found::Nothing;
            };
            let mut found = Found::Nothing;
            while let Some(i) = slot.idle.pop() {
                if self.serves(&i.item) {
                    found = Found::Taken(i.item);
                    break;
                }
                dropped.push(i);
            }
            if matches!(found, Found::Nothing) {
                if *waiting {
                    if slot.scrubbing > 0 {
                        found = Found::Coming;
                    }
                } else if slot.scrubbing > slot.waiting {
                    slot.waiting += 1;
                    *waiting = true;
                    found = Found::Coming;
                }
            }
            if slot.unused() {
                slots.remove(key);
            }
            found
        };
        // Dropped outside the lock: a container's guard hands it to the janitor.
        drop(dropped);
        found
    }

    /// After a run in `item`'s container: whether it may serve again (no anomaly, within its
    /// bounds); then, on a task of its own, its scrub and its way back among the idle ones.
    /// Anything else drops it (its guard removes the container).
    pub fn settle(self: &Arc<Self>, key: Key, item: Reusable, outcome: Option<&RunOutcome>) {
        if let Some(why) = self.anomaly(&item, outcome) {
            tracing::info!(container = %super::short(item.kept.id()), uses = item.uses, why, "reused container discarded");
            return;
        }
        self.lock().entry(key.clone()).or_default().scrubbing += 1;
        // Ends the scrub's count however the task ends (a panic included).
        let mut ticket = Scrubbing {
            reuse: self.clone(),
            key: Some(key),
        };
        tokio::spawn(async move {
            let back = match item.kept.scrub().await {
                Ok(()) => Some(item),
                Err(why) => {
                    tracing::warn!(container = %super::short(item.kept.id()), uses = item.uses, why, "reused container discarded: its scrub failed");
                    None
                }
            };
            ticket.end(back);
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

    /// A scrub of `key`'s ended: `item` goes back among the idle ones when it may (None: the
    /// scrub failed).
    fn put(&self, key: Key, item: Option<Reusable>) {
        let mut slots = self.lock();
        let total: usize = slots.values().map(|s| s.idle.len()).sum();
        let slot = slots.entry(key.clone()).or_default();
        slot.scrubbing = slot.scrubbing.saturating_sub(1);
        let discard = match item {
            Some(item) if self.closed.load(Ordering::SeqCst) || !self.serves(&item) => Some(item),
            Some(item) if slot.idle.len() >= MAX_IDLE_PER_KEY || total >= MAX_IDLE => {
                tracing::info!(container = %super::short(item.kept.id()), "reused container discarded: enough are idle");
                Some(item)
            }
            Some(item) => {
                slot.idle.push(Idle {
                    item,
                    since: Instant::now(),
                });
                None
            }
            None => None,
        };
        if slot.unused() {
            slots.remove(&key);
        }
        drop(slots);
        drop(discard);
    }

    /// Discards the idle containers that may not serve again or were unused for [`IDLE_FOR`].
    pub fn prune(&self) {
        let mut dropped = Vec::new();
        {
            let mut slots = self.lock();
            for slot in slots.values_mut() {
                let (keep, gone): (Vec<Idle>, Vec<Idle>) = std::mem::take(&mut slot.idle)
                    .into_iter()
                    .partition(|i| self.serves(&i.item) && i.since.elapsed() < IDLE_FOR);
                slot.idle = keep;
                dropped.extend(gone);
            }
            slots.retain(|_, s| !s.unused());
        }
        drop(dropped);
    }

    /// Discards every idle container (the engine restarted: they may be gone or stale).
    pub fn flush(&self) {
        let all: Vec<Vec<Idle>> = self
            .lock()
            .values_mut()
            .map(|s| std::mem::take(&mut s.idle))
            .collect();
        drop(all);
    }

    /// The daemon stops: nothing goes back from now on; the idle ones are discarded.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.flush();
        self.scrubbed.notify_waiters();
    }

    /// Idle reused containers.
    pub fn idle(&self) -> usize {
        self.lock().values().map(|s| s.idle.len()).sum()
    }
}
