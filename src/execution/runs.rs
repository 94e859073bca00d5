//! The runs of this daemon that have not finished: each one's owner, its stop control and, once
//! it has one, its answer. A run is found here from the moment it starts until its answer is in
//! the state store, so between the two a reader never misses it.
//!
//! Owns: which runs are live, who may see them, and stopping them (one run at a caller's
//! request, or all of them at shutdown, through the same control). Must not: know HTTP or how a
//! backend stops a run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::sandbox::Stop;
use crate::state::StoredResponse;

/// One live run.
pub struct LiveRun {
    exec_id: String,
    /// The calling service's subject that started it: nobody else finds it.
    owner: String,
    stop: watch::Sender<Option<Stop>>,
    /// The subject that cancelled it, if one did.
    cancelled_by: Mutex<Option<String>>,
    answer: watch::Sender<Option<Arc<StoredResponse>>>,
}

impl LiveRun {
    pub fn exec_id(&self) -> &str {
        &self.exec_id
    }

    pub fn cancelled_by(&self) -> Option<String> {
        self.cancelled_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The stop the run was asked for, if any.
    pub fn stopping(&self) -> Option<Stop> {
        *self.stop.borrow()
    }

    /// Asks the run to stop; a run already asked keeps the first request (a repeated cancel
    /// changes nothing). Returns whether this call was the one that stopped it.
    fn request_stop(&self, stop: Stop) -> bool {
        self.stop.send_if_modified(|s| {
            if s.is_some() {
                return false;
            }
            *s = Some(stop);
            true
        })
    }

    /// Resolves with the run's answer once it has one.
    pub fn answer(&self) -> watch::Receiver<Option<Arc<StoredResponse>>> {
        self.answer.subscribe()
    }

    pub(super) fn set_answer(&self, answer: Arc<StoredResponse>) {
        self.answer.send_replace(Some(answer));
    }
}

/// What a cancel found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// This call asked the run to stop.
    Stopping,
    /// The run had been asked to stop already (by this or another call).
    AlreadyStopping,
}

#[derive(Default)]
struct Inner {
    live: HashMap<String, Arc<LiveRun>>,
    /// Set at shutdown: a run registered from now on is stopped as it starts.
    closing: Option<Stop>,
}

/// The live runs of this daemon.
#[derive(Default)]
pub struct Runs {
    inner: Mutex<Inner>,
}

impl Runs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a run about to start, with the stop control its backend watches. When the
    /// daemon is shutting down it is stopped at once.
    pub(super) fn register(
        &self,
        exec_id: &str,
        owner: &str,
        stop: watch::Sender<Option<Stop>>,
    ) -> Arc<LiveRun> {
        let run = Arc::new(LiveRun {
            exec_id: exec_id.to_string(),
            owner: owner.to_string(),
            stop,
            cancelled_by: Mutex::new(None),
            answer: watch::channel(None).0,
        });
        let mut inner = self.lock();
        if let Some(stop) = inner.closing {
            run.request_stop(stop);
        }
        inner.live.insert(exec_id.to_string(), run.clone());
        run
    }

    /// Forgets a run whose answer is stored.
    pub(super) fn remove(&self, exec_id: &str) {
        self.lock().live.remove(exec_id);
    }

    /// The live run `exec_id` of `owner`; None for a run of anyone else.
    pub fn find(&self, owner: &str, exec_id: &str) -> Option<Arc<LiveRun>> {
        self.lock()
            .live
            .get(exec_id)
            .filter(|r| r.owner == owner)
            .cloned()
    }

    /// Asks `run` to stop on behalf of `by`.
    pub fn cancel(&self, run: &LiveRun, stop: Stop, by: &str) -> CancelOutcome {
        if run.request_stop(stop) {
            *run.cancelled_by.lock().unwrap_or_else(|p| p.into_inner()) = Some(by.to_string());
            CancelOutcome::Stopping
        } else {
            CancelOutcome::AlreadyStopping
        }
    }

    /// Stops every live run, and every one registered from now on.
    pub fn stop_all(&self, stop: Stop) {
        let mut inner = self.lock();
        inner.closing = Some(stop);
        for run in inner.live.values() {
            run.request_stop(stop);
        }
    }

    /// How many runs are live.
    pub fn len(&self) -> usize {
        self.lock().live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sandbox::KilledReason;

    fn cancel(grace: u64) -> Stop {
        Stop {
            reason: KilledReason::Cancelled,
            grace: Duration::from_secs(grace),
        }
    }

    #[test]
    fn only_the_owner_finds_a_run_and_the_first_stop_wins() {
        let runs = Runs::default();
        let (tx, rx) = watch::channel(None);
        runs.register("exec-1", "orbit", tx);
        assert!(runs.find("koder", "exec-1").is_none());
        assert!(runs.find("orbit", "exec-2").is_none());
        let run = runs.find("orbit", "exec-1").expect("the owner finds it");
        assert_eq!(
            runs.cancel(&run, cancel(5), "orbit"),
            CancelOutcome::Stopping
        );
        assert_eq!(
            runs.cancel(&run, cancel(1), "orbit"),
            CancelOutcome::AlreadyStopping
        );
        assert_eq!(*rx.borrow(), Some(cancel(5)));
        assert_eq!(run.cancelled_by().as_deref(), Some("orbit"));
        runs.remove("exec-1");
        assert!(runs.is_empty());
    }

    #[test]
    fn a_shutdown_stops_live_runs_and_those_that_start_after_it() {
        let runs = Runs::default();
        let (tx, before) = watch::channel(None);
        runs.register("exec-1", "orbit", tx);
        let shutdown = Stop {
            reason: KilledReason::Signal,
            grace: Duration::ZERO,
        };
        runs.stop_all(shutdown);
        assert_eq!(*before.borrow(), Some(shutdown));
        let (tx, after) = watch::channel(None);
        let late = runs.register("exec-2", "orbit", tx);
        assert_eq!(*after.borrow(), Some(shutdown));
        // A shutdown is nobody's cancel.
        assert_eq!(late.cancelled_by(), None);
    }
}
