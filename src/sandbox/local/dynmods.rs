//! Keeps the kernel's cgroup `favordynmods` mode on while the daemon runs.
//!
//! Owns: one parked thread with a private mount namespace in which a named cgroup v1 hierarchy
//! is mounted with the `favordynmods` option. Must not: touch any mount the host sees.
//!
//! Why: every migration of a process into a cgroup (a write to `cgroup.procs`, which each run
//! slot's shim does once per hierarchy) takes the kernel's global threadgroup rwsem for writing.
//! Out of `favordynmods` mode that write first waits for an RCU grace period — 10–20 ms on this
//! project's hosts — and every `fork`/`clone` on the host, the next run's included, waits behind
//! it: measured with `strace -T`, the slowest `cgroup.procs` writes took 16–19 ms and the runs
//! started meanwhile took as long. In `favordynmods` mode the rwsem stays on its slow path for
//! readers (forks and exits cost a little more) and writers wait for no grace period.
//!
//! The mode belongs to a cgroup root but switches the one rwsem all hierarchies share, so any
//! root holding it is enough. A named hierarchy without controllers changes nothing else. It is
//! mounted in a mount namespace only the parked thread uses, made private first so the mount
//! does not propagate to the host: when the thread ends, or the daemon dies however it dies, the
//! namespace goes, the hierarchy's last mount with it, the kernel destroys the root and the mode
//! returns to what it was. (cgroup v2 has the same option, but on its single root: setting it
//! there outlives the daemon, so it is left to the host's own mount options.)

use std::io;
use std::sync::mpsc;
use std::thread::JoinHandle;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};

/// The named hierarchy's name. Daemons on one host share the hierarchy; it lives while any of
/// them holds a mount of it.
const HIERARCHY: &str = "executor-arm-dynmods";

/// While alive, the host is in `favordynmods` mode (see the module docs). Dropping it ends the
/// thread and with it the mode (unless another holder keeps it).
pub struct FavorDynMods {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// The holding thread's id, for its `/proc/self/task/<tid>/mountinfo`.
    tid: libc::pid_t,
}

impl FavorDynMods {
    /// Starts the holding thread; fails when the kernel refuses (no cgroup v1, no
    /// `favordynmods` before Linux 6.1, no CAP_SYS_ADMIN), leaving nothing behind.
    pub fn hold() -> io::Result<FavorDynMods> {
        let (ready_tx, ready_rx) = mpsc::channel::<io::Result<libc::pid_t>>();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("cgroup-dynmods".into())
            .spawn(move || {
                let held = enter_and_mount();
                let ok = held.is_ok();
                let _ = ready_tx.send(held);
                if ok {
                    // Parked until the holder is dropped (or the daemon exits).
                    let _ = stop_rx.recv();
                }
            })?;
        match ready_rx.recv() {
            Ok(Ok(tid)) => Ok(FavorDynMods {
                stop: Some(stop_tx),
                thread: Some(thread),
                tid,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(io::Error::other("the cgroup-dynmods thread ended early"))
            }
        }
    }

    /// The holding thread's mount table (for checks).
    pub fn mountinfo(&self) -> io::Result<String> {
        std::fs::read_to_string(format!("/proc/self/task/{}/mountinfo", self.tid))
    }
}

impl Drop for FavorDynMods {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// On the calling thread: a private mount namespace of its own with the named hierarchy
/// mounted in it; returns the thread's id.
fn enter_and_mount() -> io::Result<libc::pid_t> {
    // A thread may take a mount namespace of its own (CLONE_NEWNS implies CLONE_FS, which is
    // per thread); the daemon's other threads keep the host's.
    unshare(CloneFlags::CLONE_NEWNS).map_err(io::Error::from)?;
    // Nothing mounted from here on propagates to the namespace it was copied from.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(io::Error::from)?;
    // Over `/` of this namespace: a directory that always exists, and nothing on this thread
    // looks at paths after this point.
    mount(
        Some("cgroup"),
        "/",
        Some("cgroup"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(format!("none,name={HIERARCHY},favordynmods").as_str()),
    )
    .map_err(io::Error::from)?;
    // SAFETY: gettid has no preconditions.
    Ok(unsafe { libc::gettid() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_mounts() -> String {
        std::fs::read_to_string("/proc/self/mountinfo").unwrap()
    }

    fn mounted(mountinfo: &str) -> Option<&str> {
        mountinfo
            .lines()
            .find(|l| l.contains(&format!("name={HIERARCHY}")))
    }

    #[test]
    fn the_mode_is_held_in_a_namespace_the_host_never_sees() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        let held = FavorDynMods::hold().expect("favordynmods on this kernel");
        let theirs = held.mountinfo().unwrap();
        let line = mounted(&theirs).expect("the holding thread has the hierarchy mounted");
        assert!(line.contains("favordynmods"), "{line}");
        assert!(
            mounted(&host_mounts()).is_none(),
            "the hierarchy must not show in the daemon's own mount table"
        );
        assert!(
            mounted(&std::fs::read_to_string("/proc/1/mountinfo").unwrap()).is_none(),
            "nor in the host's"
        );
        let tid = held.tid;
        drop(held);
        // Joined, the thread is gone; the kernel reaps its task (and frees the namespace) just
        // after.
        let task = format!("/proc/self/task/{tid}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::path::Path::new(&task).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the holding thread ends with its holder"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(mounted(&host_mounts()).is_none());
    }
}
