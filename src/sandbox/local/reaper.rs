//! Teardown off the request path.
//!
//! Owns: one low-priority thread that removes finished runs' cgroups (and then frees the memory
//! their children ran on, and tops the prepared slots up). Must not: decide a run's outcome —
//! everything a run's answer needs is read before its teardown is handed over.
//!
//! Why: removing a run's cgroups is four `rmdir`s on cgroup v1, each taking the kernel's cgroup
//! mutex, and the slot that replaces it is created right after; on the request path that was
//! time the caller waited for, and on a busy host it competed with the next run's setup. Here it
//! runs at a lower CPU priority, in the order runs finished. The queue is bounded: when it is
//! full the run tears down on its own as before, so a backlog cannot grow without limit.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

/// Teardowns waiting at most; past it a run removes its own cgroup.
const QUEUE: usize = 64;
/// The thread's nice value: below the runs' setup, which happens at the daemon's own priority.
const NICE: libc::c_int = 10;

pub type Teardown = Box<dyn FnOnce() + Send>;

pub struct Reaper {
    tx: Mutex<Option<SyncSender<Teardown>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Reaper {
    pub fn start() -> std::io::Result<Reaper> {
        let (tx, rx) = sync_channel::<Teardown>(QUEUE);
        let thread = std::thread::Builder::new()
            .name("run-reaper".into())
            .spawn(move || work(rx))?;
        Ok(Reaper {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `t`; gives it back when the queue is full or the reaper is closed (the caller
    /// then runs it itself).
    pub fn submit(&self, t: Teardown) -> Result<(), Teardown> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        match tx.as_ref() {
            Some(tx) => tx.try_send(t).map_err(|e| match e {
                TrySendError::Full(t) | TrySendError::Disconnected(t) => t,
            }),
            None => Err(t),
        }
    }

    /// Runs every queued teardown, then ends the thread (at exit).
    pub fn close(&self) {
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.close();
    }
}

fn work(rx: Receiver<Teardown>) {
    // SAFETY: gettid has no preconditions; setpriority(PRIO_PROCESS, tid) changes this thread's
    // nice value only (Linux threads have their own). Failing leaves the default priority.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, NICE);
    }
    while let Ok(t) = rx.recv() {
        t();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn teardowns_run_in_order_at_low_priority_and_close_runs_what_is_queued() {
        let r = Reaper::start().unwrap();
        let done = Arc::new(Mutex::new(Vec::new()));
        for i in 0..10 {
            let done = done.clone();
            let queued = r.submit(Box::new(move || {
                // SAFETY: gettid has no preconditions; getpriority reads this thread's nice.
                let nice =
                    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
                std::thread::sleep(std::time::Duration::from_millis(5));
                done.lock().unwrap().push((i, nice));
            }));
            assert!(queued.is_ok());
        }
        r.close();
        let done = done.lock().unwrap();
        assert_eq!(
            done.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        assert!(done.iter().all(|(_, nice)| *nice == NICE), "{done:?}");
        assert!(
            r.submit(Box::new(|| {})).is_err(),
            "closed: the caller runs it"
        );
    }

    #[test]
    fn a_full_queue_gives_the_teardown_back() {
        let r = Reaper::start().unwrap();
        let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
        let ran = Arc::new(AtomicUsize::new(0));
        r.submit(Box::new(move || {
            let _ = hold_rx.recv();
        }))
        .unwrap_or_else(|_| panic!("queued"));
        let mut refused = 0;
        for _ in 0..QUEUE + 2 {
            let ran = ran.clone();
            if let Err(t) = r.submit(Box::new(move || {
                ran.fetch_add(1, Ordering::SeqCst);
            })) {
                refused += 1;
                t();
            }
        }
        assert!(refused >= 1, "a full queue refuses");
        drop(hold_tx);
        r.close();
        assert_eq!(
            ran.load(Ordering::SeqCst),
            QUEUE + 2,
            "each ran exactly once"
        );
    }
}
