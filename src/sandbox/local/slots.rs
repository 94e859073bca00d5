//! Run slots prepared ahead: a cgroup with a shim already in it, waiting for its plan. Kept
//! topped up off the request path, handed to a run with its go message (the byte and the run's
//! descriptors), and removed at exit.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use super::cgroup::CgroupDriver;
use super::child;
use super::guard::CgroupGuard;
use crate::sandbox::SandboxError;

/// A run slot prepared ahead: a cgroup with a shim already in it, waiting for its plan.
pub(super) struct Slot {
    pub(super) guard: CgroupGuard,
    pub(super) shim: Arc<child::WarmShim>,
    /// Our end of the go socket; dropping it unused makes the shim exit.
    pub(super) go: OwnedFd,
    /// Resolves once the shim has exited.
    pub(super) exited: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Keeps `target` slots prepared. Joining a cgroup (a `cgroup.procs` write) waits for an RCU
/// grace period after an idle spell, tens of milliseconds on some hosts; a prepared slot has paid
/// it before its run arrives, and creating the cgroup is off the request path too.
pub(super) struct WarmSlots {
    driver: Arc<dyn CgroupDriver>,
    target: usize,
    ready: std::sync::Mutex<std::collections::VecDeque<Slot>>,
    /// Slots being prepared right now.
    pending: std::sync::atomic::AtomicUsize,
    seq: std::sync::atomic::AtomicU64,
    closed: std::sync::atomic::AtomicBool,
}

impl WarmSlots {
    pub(super) fn new(driver: Arc<dyn CgroupDriver>, target: usize) -> Self {
        WarmSlots {
            driver,
            target,
            ready: std::sync::Mutex::new(Default::default()),
            pending: Default::default(),
            seq: Default::default(),
            closed: Default::default(),
        }
    }

    /// The oldest prepared slot: the likeliest to have joined its cgroup already.
    pub(super) fn take(&self) -> Option<Slot> {
        self.ready.lock().ok()?.pop_front()
    }

    /// Starts preparing slots until `target` are ready or on their way (needs a runtime).
    pub(super) fn refill(self: &Arc<Self>) {
        use std::sync::atomic::Ordering::SeqCst;
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let have = self.ready.lock().map(|r| r.len()).unwrap_or(self.target);
        let want = self.target.saturating_sub(have + self.pending.load(SeqCst));
        for _ in 0..want {
            self.pending.fetch_add(1, SeqCst);
            let this = self.clone();
            handle.spawn(async move {
                let seq = this.seq.fetch_add(1, SeqCst);
                let driver = this.driver.clone();
                let made = tokio::task::spawn_blocking(move || prepare_slot(&*driver, seq)).await;
                this.pending.fetch_sub(1, SeqCst);
                match made {
                    Ok(Ok(slot)) if !this.closed.load(SeqCst) => {
                        if let Ok(mut r) = this.ready.lock() {
                            r.push_back(slot);
                        }
                    }
                    Ok(Ok(_)) => {} // shutting down: dropping the slot removes it
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not prepare a run slot"),
                    Err(e) => tracing::warn!(error = %e, "run slot task"),
                }
            });
        }
    }

    /// Removes every prepared slot (at exit).
    pub(super) fn drain(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        let slots = self
            .ready
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default();
        drop(slots);
    }
}

/// Tops the prepared slots up when dropped.
pub(super) struct RefillOnDrop(pub(super) Option<Arc<WarmSlots>>);

impl Drop for RefillOnDrop {
    fn drop(&mut self) {
        if let Some(w) = &self.0 {
            w.refill();
        }
    }
}

/// Creates a slot's cgroup and starts its shim on a blocking thread of its own. Runs on a
/// blocking thread (cgroup directories are created here) inside the runtime.
fn prepare_slot(driver: &dyn CgroupDriver, seq: u64) -> Result<Slot, SandboxError> {
    let mut guard = CgroupGuard::new(driver.create_empty(&format!("warm-{seq}"))?);
    let procs = guard
        .get()
        .procs_files()
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .map(OwnedFd::from)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let stacks = Arc::new(child::Stacks::new()?);
    let (go_w, go_r) = go_socket()?;
    let shim = Arc::new(child::WarmShim::new(procs, go_r.as_raw_fd(), stacks));
    guard.keep(shim.clone());
    let runner = shim.clone();
    let exited = tokio::task::spawn_blocking(move || {
        // SAFETY: the slot's guard keeps the shim, its stacks and (once armed) its plan alive
        // until the cgroup is empty; go_r stays open until the shim is gone.
        let r = unsafe { runner.spawn_and_wait() };
        drop(go_r);
        r
    });
    Ok(Slot {
        guard,
        shim,
        go: go_w,
        exited,
    })
}

/// A prepared shim's go channel (ours, the shim's): the go byte travels with the run's
/// descriptors, which the shim, holding none of the daemon's, could not reach otherwise.
fn go_socket() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| SandboxError::Setup(format!("go socket of a run slot: {e}")))
}

/// Tells a prepared shim to go, handing it `fds` (the plan's passed descriptors, in order).
pub(super) fn send_go(go: &OwnedFd, fds: &[i32]) -> Result<(), SandboxError> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let iov = [std::io::IoSlice::new(b"1")];
    let cmsgs = [ControlMessage::ScmRights(fds)];
    match sendmsg::<()>(go.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
        Ok(1) => Ok(()),
        Ok(n) => Err(SandboxError::Setup(format!(
            "go message of a run slot: {n} bytes sent"
        ))),
        Err(e) => Err(SandboxError::Setup(format!(
            "go message of a run slot: {e}"
        ))),
    }
}
