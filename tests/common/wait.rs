//! Bounded waits for what the daemon does after it answered (a reaper removing a run's cgroup,
//! a container going away, an audit line, a metric, a session's state): poll until it holds,
//! fail naming what was awaited and what was last seen. A bound, never a timing check: the
//! machines the tests run on are loaded, so bounds are generous.
use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// For cleanup the daemon does off the request path (cgroups, processes, temp dirs, audit
/// lines, metrics): seconds when idle, far longer on a saturated 2-vCPU machine.
pub const CLEANUP: Duration = Duration::from_secs(60);

const EVERY: Duration = Duration::from_millis(50);

/// Observes with `observe` until `done` holds for what it saw, and returns that. Panics after
/// `limit` with `what` and the last observation. Blocks its thread: inside an async test whose
/// other futures must progress meanwhile, use [`wait_for_async`].
pub fn wait_for<T: Debug>(
    what: &str,
    limit: Duration,
    mut observe: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let start = Instant::now();
    loop {
        let seen = observe();
        if done(&seen) {
            return seen;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}; last seen: {seen:#?}"
        );
        std::thread::sleep(EVERY);
    }
}

/// [`wait_for`] with an asynchronous observation (an HTTP call), sleeping without blocking the
/// runtime.
pub async fn wait_for_async<T: Debug, F: Future<Output = T>>(
    what: &str,
    limit: Duration,
    mut observe: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T {
    let start = Instant::now();
    loop {
        let seen = observe().await;
        if done(&seen) {
            return seen;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}; last seen: {seen:#?}"
        );
        tokio::time::sleep(EVERY).await;
    }
}

/// Polls `cond` until it holds; panics after `limit` naming `what`. For a condition with nothing
/// worth showing when it fails (use [`wait_for`] otherwise).
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    wait_for(what, limit, &mut cond, |held| *held);
}
