//! A run cgroup's guard: the cgroup is killed and removed however the run ends (a dropped
//! future included), and the memory the sandbox's children run on (plan, stacks, prepared shim)
//! is released only once the cgroup is confirmed empty and gone.

use std::sync::Arc;

use super::cgroup::RunCgroup;
use crate::sandbox::SandboxError;

/// Kills and removes the run's cgroup however the run ends (including a dropped future), and
/// only then releases the plan: the sandbox's children run on the plan's stacks, in memory shared
/// with the daemon, until they are gone, and an empty cgroup is the proof that they are.
pub(super) struct CgroupGuard {
    cg: Option<Box<dyn RunCgroup>>,
    keep: Pinned,
}

/// Memory the sandbox's children may use until they are gone (plan, stacks, prepared shim).
pub(super) type Keepalive = Arc<dyn std::any::Any + Send + Sync>;

impl CgroupGuard {
    pub(super) fn new(cg: Box<dyn RunCgroup>) -> Self {
        CgroupGuard {
            cg: Some(cg),
            keep: Pinned::default(),
        }
    }

    pub(super) fn get(&self) -> &dyn RunCgroup {
        self.cg.as_deref().expect("cgroup present until finish")
    }

    pub(super) fn get_mut(&mut self) -> &mut dyn RunCgroup {
        self.cg.as_deref_mut().expect("cgroup present until finish")
    }

    pub(super) fn keep(&mut self, k: Keepalive) {
        self.keep.0.push(k);
    }

    pub(super) async fn finish(mut self) -> Result<(), SandboxError> {
        let cg = self.cg.take();
        let keep = std::mem::take(&mut self.keep);
        // The memory is released by the task that saw the cgroup removed, so neither a dropped
        // future nor a task that never ran can free it early (an unreleased Pinned leaks).
        let removed = tokio::task::spawn_blocking(move || {
            let r = cg.map(|c| c.remove()).transpose();
            if r.is_ok() {
                keep.release();
            }
            r
        })
        .await
        .map_err(|e| SandboxError::Setup(format!("cgroup cleanup task: {e}")))?;
        removed?;
        Ok(())
    }
}

/// Memory the sandbox's children may use until they are gone. Freed only through
/// [`Pinned::release`], once the run's cgroup is confirmed empty and removed; dropped otherwise
/// (nothing proves the children are gone), it is leaked for the daemon's lifetime rather than
/// freed under a child that may still run on it.
#[derive(Default)]
struct Pinned(Vec<Keepalive>);

impl Pinned {
    fn release(mut self) {
        drop(std::mem::take(&mut self.0));
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        std::mem::forget(std::mem::take(&mut self.0));
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        let removed = match self.cg.take() {
            Some(cg) => match cg.remove() {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!(error = %e, "could not remove a run cgroup");
                    false
                }
            },
            None => true,
        };
        let keep = std::mem::take(&mut self.keep);
        if removed {
            keep.release();
        }
    }
}
