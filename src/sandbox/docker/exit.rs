//! A container backend's exit: after the daemon's drain, launches in flight are waited for and
//! every container and volume of this instance and backend is removed, within [`EXIT_LIMIT`];
//! the drop is the fallback when that exit never ran to its end.
//!
//! Owns: the exit's bounds and its log line. Must not: remove anything another daemon owns
//! (the sweep goes by this instance's labels, [`super::labels`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::DockerSandbox;
use super::engine::BollardEngine;
use super::janitor;
use crate::sandbox::BackendKind;

/// The whole of a container backend's exit (after the daemon's drain): launches in flight are
/// waited for (at most [`LAUNCH_WAIT`] of it), then this instance's containers and volumes are
/// removed, listing again until none is left. A gVisor sandbox saturated by its guest can take
/// seconds to act on a kill on 2 vCPUs, and a burst leaves hundreds of containers to remove.
/// docs/deployment.md and the chart's terminationGracePeriodSeconds count on this bound.
pub const EXIT_LIMIT: Duration = Duration::from_secs(30);
/// How long the exit waits for container launches in flight before it sweeps anyway (each then
/// removes its own container when its create returns, see [`janitor::Janitor::create`]).
pub(super) const LAUNCH_WAIT: Duration = Duration::from_secs(10);
/// How long the drop's fallback sweep (the exit never ran) may take.
const DROP_SWEEP_LIMIT: Duration = Duration::from_secs(10);

impl DockerSandbox {
    /// [`Sandbox::shutdown`] with its bounds: launches get `launch_wait`, everything `deadline`.
    /// Whatever it could not remove is logged at WARN (the next daemon's startup sweep removes
    /// it), and the drop's fallback then has nothing more to do.
    pub(super) async fn shutdown_by(&self, deadline: tokio::time::Instant, launch_wait: Duration) {
        self.pool.close();
        if let Some(r) = &self.reuse {
            r.close();
        }
        if !self.janitor.close_launches(launch_wait).await {
            tracing::warn!(
                backend = self.kind.as_str(),
                "container launches still in flight at exit; each removes its own container"
            );
        }
        let labels = self.janitor.own_labels();
        let swept = janitor::remove_labelled(self.engine().as_ref(), &labels, deadline).await;
        self.shut_down.store(true, Ordering::SeqCst);
        log_exit_sweep(self.kind, &swept, EXIT_LIMIT);
    }
}

/// The exit sweep's outcome in the log: a count at INFO, or at WARN what was left.
fn log_exit_sweep(kind: BackendKind, swept: &janitor::Swept, limit: Duration) {
    if !swept.left.is_empty() {
        tracing::warn!(
            backend = kind.as_str(),
            removed = swept.removed,
            left = ?swept.left,
            limit_seconds = limit.as_secs(),
            "sandbox containers or volumes still there when the exit's bound passed; the next \
             daemon's startup sweep removes them"
        );
    } else if swept.removed > 0 {
        tracing::info!(
            removed = swept.removed,
            backend = kind.as_str(),
            "removed this daemon's sandbox containers"
        );
    }
}

impl Drop for DockerSandbox {
    /// The fallback when [`Sandbox::shutdown`] did not run to its end: removes every container
    /// of this instance and backend (idle pool ones included). Runs on its own thread and
    /// runtime: we may be inside the daemon's runtime while it shuts down, where nothing can be
    /// awaited.
    fn drop(&mut self) {
        if self.shut_down.load(Ordering::SeqCst) {
            return;
        }
        let Some(socket) = self.shutdown_socket.take() else {
            return;
        };
        let labels = self.janitor.own_labels();
        let kind = self.kind;
        let worker = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return None;
            };
            rt.block_on(async move {
                let engine = BollardEngine::new(&socket);
                let deadline = tokio::time::Instant::now() + DROP_SWEEP_LIMIT;
                Some(janitor::remove_labelled(&engine, &labels, deadline).await)
            })
        });
        if let Ok(Some(swept)) = worker.join() {
            log_exit_sweep(kind, &swept, DROP_SWEEP_LIMIT);
        }
    }
}
