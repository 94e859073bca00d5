//! Making sure no container of ours outlives its use.
//!
//! Owns: disposing of containers and their disk volumes (kill + force-remove, then the volume, in
//! the background so no response waits for teardown), retrying removals that failed because
//! dockerd was away, the startup sweep of containers and volumes left by crashed daemons, and the
//! clean-up when dockerd comes back. Must not: run commands.
//!
//! Sweep policy (see [`sweep_verdict`]): a managed container whose owner label names a daemon on
//! this host, in our pid namespace, whose pid is gone or now belongs to another process (start
//! time differs) is removed, whatever its state. A container of a daemon we cannot judge (another
//! host sharing the engine) is removed only once it has stopped: none of ours is ever reused after
//! it stops. Containers of live daemons are left to their owners, who may still be reading the
//! state of one that just stopped. Volumes follow the same owner rule, as if stopped: dockerd
//! refuses to remove one a container still uses.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::models::ContainerCreateBody;
use tokio::sync::Semaphore;

use super::engine::{Engine, EngineError, Listed};
use super::labels::{
    LABEL_BACKEND, LABEL_INSTANCE, LABEL_MANAGED, LABEL_OWNER, Owner, process_start_time,
};
use crate::sandbox::BackendKind;
use crate::sandbox::uids::UidLease;

/// Concurrent background removals (each is a few hundred ms of dockerd work on 2 cores).
const REMOVAL_SLOTS: usize = 4;

/// Something of ours in the engine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Leftover {
    Container(String),
    Volume(String),
}

/// A share of the launch gate (see [`Janitor::create`]): the daemon's exit waits until every
/// one is dropped.
pub struct LaunchPermit {
    _gate: tokio::sync::OwnedRwLockReadGuard<()>,
}

pub struct Janitor {
    engine: Arc<dyn Engine>,
    owner: Owner,
    /// Our backend: the docker and gvisor backends of one daemon share an instance label.
    backend: BackendKind,
    /// Removals that failed; retried by [`Janitor::tick`].
    pending: Mutex<HashSet<Leftover>>,
    /// Containers (ids) and their disk volumes (names) in use right now: never swept while a
    /// run or the pool holds them.
    leased: Mutex<HashSet<String>>,
    /// The host uids of disposed containers (by id or name), each released once its container
    /// is removed: a uid goes back to the block only when nothing can run as it any more.
    uids: Mutex<HashMap<String, UidLease>>,
    /// Set by any "unreachable" failure; cleared (with clean-up) once dockerd answers again.
    engine_down: AtomicBool,
    startup_swept: AtomicBool,
    removals: Arc<Semaphore>,
    /// Held shared by every container launch, from before its create until it is started (or
    /// failed), and by a create the engine is still working on whatever became of its launch;
    /// taken whole by [`Janitor::close_launches`] at exit.
    launch_gate: Arc<tokio::sync::RwLock<()>>,
    /// Set at exit: no launch starts any more.
    launches_closed: AtomicBool,
    /// Times dockerd was found reachable again after an outage.
    comebacks: std::sync::atomic::AtomicU64,
}

impl Janitor {
    pub fn new(engine: Arc<dyn Engine>, owner: Owner, backend: BackendKind) -> Arc<Janitor> {
        Arc::new(Janitor {
            engine,
            owner,
            backend,
            pending: Mutex::new(HashSet::new()),
            leased: Mutex::new(HashSet::new()),
            uids: Mutex::new(HashMap::new()),
            engine_down: AtomicBool::new(false),
            startup_swept: AtomicBool::new(false),
            removals: Arc::new(Semaphore::new(REMOVAL_SLOTS)),
            launch_gate: Arc::new(tokio::sync::RwLock::new(())),
            launches_closed: AtomicBool::new(false),
            comebacks: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Bumped each time dockerd is reachable again after an outage: whoever keeps containers
    /// across it sees them as stale.
    pub fn engine_generation(&self) -> u64 {
        self.comebacks.load(Ordering::SeqCst)
    }

    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Label filters matching exactly the containers of this daemon's backend. The owner label
    /// (host, pid namespace, pid, start time) is part of it: two daemons can share an instance
    /// id (each pid 1 of its own pid namespace, with one hostname), never an owner.
    pub fn own_labels(&self) -> Vec<String> {
        vec![
            format!("{LABEL_INSTANCE}={}", self.owner.instance),
            format!("{LABEL_OWNER}={}", self.owner.label()),
            format!("{LABEL_BACKEND}={}", self.backend.as_str()),
        ]
    }

    pub fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }

    /// Records the outcome of an engine call (an "unreachable" error arms reconnect clean-up).
    pub fn observe<T>(&self, r: &Result<T, EngineError>) {
        if matches!(r, Err(e) if e.is_unreachable())
            && !self.engine_down.swap(true, Ordering::SeqCst)
        {
            tracing::warn!(
                "docker engine unreachable; containers will be cleaned up when it is back"
            );
        }
    }

    pub fn engine_down(&self) -> bool {
        self.engine_down.load(Ordering::SeqCst)
    }

    /// A permit for one container launch, held until the container is started: refused once
    /// the daemon exits ([`Janitor::close_launches`]).
    async fn launch_permit(&self) -> Result<LaunchPermit, EngineError> {
        if self.launches_closed() {
            return Err(EngineError::Closed);
        }
        let permit = self.launch_gate.clone().read_owned().await;
        // Closed while this one waited behind the exit's write lock.
        if self.launches_closed() {
            return Err(EngineError::Closed);
        }
        Ok(LaunchPermit { _gate: permit })
    }

    fn launches_closed(&self) -> bool {
        self.launches_closed.load(Ordering::SeqCst)
    }

    /// Creates container `name` (its disk volume `volume`, leased by the caller, comes with it)
    /// for a launch, under a launch permit that the caller holds until the container is started.
    ///
    /// dockerd finishes a create whose client went away, so the create is not the caller's to
    /// cancel: it runs on its own task, which keeps the permit (the daemon's exit waits for it)
    /// and removes the container itself, with its volume, when nobody takes it any more: the
    /// launch was dropped meanwhile, or launches closed while the engine was creating it (the
    /// exit gave up waiting and may have swept already).
    pub async fn create(
        self: &Arc<Self>,
        name: &str,
        body: ContainerCreateBody,
        volume: &str,
    ) -> Result<(String, LaunchPermit), EngineError> {
        let permit = self.launch_permit().await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (me, name, volume) = (self.clone(), name.to_string(), volume.to_string());
        tokio::spawn(async move {
            let created = me.engine.create(&name, body).await;
            me.observe(&created);
            let id = match created {
                Ok(id) => id,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            if me.launches_closed() {
                // Under the permit: an exit still waiting waits for this removal too.
                me.remove_unwanted(id, volume).await;
                drop(permit);
                let _ = tx.send(Err(EngineError::Closed));
            } else if let Err(Ok((id, permit))) = tx.send(Ok((id, permit))) {
                // The launch was dropped while the engine created its container.
                me.remove_unwanted(id, volume).await;
                drop(permit);
            }
        });
        match rx.await {
            Ok(r) => r,
            // The create's task ended without an answer: only a runtime shutting down does that.
            Err(_) => Err(EngineError::Closed),
        }
    }

    /// Removes a container nobody took (see [`Janitor::create`]) and then its volume, now;
    /// what fails stays pending (and the exit sweep, or the next daemon's startup sweep, gets it).
    async fn remove_unwanted(&self, id: String, volume: String) {
        tracing::info!(container = %id, "removing a container created after its launch ended");
        let container = Leftover::Container(id);
        if self.remove(&container).await.is_err() {
            self.add_pending(container);
            self.add_pending(Leftover::Volume(volume));
            return;
        }
        self.unlease(&volume);
        let volume = Leftover::Volume(volume);
        if self.remove(&volume).await.is_err() {
            self.add_pending(volume);
        }
    }

    /// Refuses every container launch from now on and waits, up to `within`, for those in
    /// flight (a pool refill, a cold launch for a run or a session) and for creates the engine
    /// is still working on. True: no container of ours is created after this returns. False:
    /// some were still launching; each removes its own container once its create returns (see
    /// [`Janitor::create`]).
    pub async fn close_launches(&self, within: Duration) -> bool {
        self.launches_closed.store(true, Ordering::SeqCst);
        tokio::time::timeout(within, self.launch_gate.write())
            .await
            .is_ok()
    }

    /// Marks a container id or volume name as in use.
    pub fn lease(&self, id: &str) {
        if let Ok(mut l) = self.leased.lock() {
            l.insert(id.to_string());
        }
    }

    fn unlease(&self, id: &str) {
        if let Ok(mut l) = self.leased.lock() {
            l.remove(id);
        }
    }

    /// Holds `lease`, the uid container `id` (an id or a name) runs as, until a removal of
    /// `id` succeeds ([`Janitor::dispose`] or a retry of it); at the daemon's exit, until the
    /// process ends (the lock goes with it).
    pub fn hold_uid(&self, id: &str, lease: UidLease) {
        if let Ok(mut u) = self.uids.lock() {
            u.insert(id.to_string(), lease);
        }
    }

    fn leased(&self) -> HashSet<String> {
        self.leased.lock().map(|l| l.clone()).unwrap_or_default()
    }

    fn add_pending(&self, what: Leftover) {
        if let Ok(mut p) = self.pending.lock() {
            p.insert(what);
        }
    }

    pub fn pending_count(&self) -> usize {
        self.pending.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Kills and removes container `id`, then its disk volume, in the background; what fails
    /// stays pending and is retried.
    pub fn dispose(self: &Arc<Self>, id: String, volume: Option<String>) {
        self.unlease(&id);
        if let Some(v) = &volume {
            self.unlease(v);
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime (shutdown): the instance-wide clean-up on drop covers it.
            self.add_pending(Leftover::Container(id));
            if let Some(v) = volume {
                self.add_pending(Leftover::Volume(v));
            }
            return;
        };
        let me = self.clone();
        rt.spawn(async move {
            let _slot = me.removals.clone().acquire_owned().await;
            let left = [Some(Leftover::Container(id)), volume.map(Leftover::Volume)];
            let mut failed = false;
            for what in left.into_iter().flatten() {
                // A volume stays in use until its container is gone.
                if failed || me.remove(&what).await.is_err() {
                    failed = true;
                    me.add_pending(what);
                }
            }
        });
    }

    /// Removes a volume that never got its container (a failed create), in the background.
    pub fn dispose_volume(self: &Arc<Self>, name: String) {
        self.unlease(&name);
        let me = self.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let what = Leftover::Volume(name);
                if me.remove(&what).await.is_err() {
                    me.add_pending(what);
                }
            });
        }
    }

    /// One removal, logged when it fails.
    async fn remove(&self, what: &Leftover) -> Result<(), EngineError> {
        let r = match what {
            Leftover::Container(id) => self.engine.remove(id).await,
            Leftover::Volume(name) => self.engine.remove_volume(name).await,
        };
        self.observe(&r);
        if let Err(e) = &r {
            tracing::warn!(what = ?what, error = %e, "sandbox removal failed; will retry");
        }
        if let (Ok(()), Leftover::Container(id)) = (&r, what) {
            let lease = self.uids.lock().ok().and_then(|mut u| u.remove(id));
            drop(lease);
        }
        r
    }

    /// Removes what a crashed daemon left behind (see the module docs): containers, then disk
    /// volumes. Returns how many.
    pub async fn sweep_orphans(&self) -> Result<usize, EngineError> {
        let managed = [format!("{LABEL_MANAGED}=true")];
        let r = self.engine.list(&managed).await;
        self.observe(&r);
        let mut removed = 0;
        for c in r? {
            if sweep_verdict(&c, &self.owner, process_start_time) {
                let r = self.engine.remove(&c.id).await;
                self.observe(&r);
                match r {
                    Ok(()) => removed += 1,
                    Err(e) => {
                        tracing::warn!(container = %c.id, error = %e, "orphan removal failed")
                    }
                }
            }
        }
        let r = self.engine.list_volumes(&managed).await;
        self.observe(&r);
        for v in r? {
            if owner_gone(&v.labels, true, &self.owner, process_start_time)
                && self.engine.remove_volume(&v.id).await.is_ok()
            {
                removed += 1;
            }
        }
        self.startup_swept.store(true, Ordering::SeqCst);
        if removed > 0 {
            tracing::warn!(
                removed,
                "removed sandbox containers and volumes left by an earlier daemon"
            );
        }
        Ok(removed)
    }

    /// After dockerd came back: our containers and volumes that nothing holds are stale (a
    /// restarted dockerd killed the containers, and their attach connections are gone).
    async fn sweep_own(&self) -> Result<usize, EngineError> {
        let listed = self.engine.list(&self.own_labels()).await?;
        let leased = self.leased();
        let mut removed = 0;
        for c in listed.into_iter().filter(|c| !leased.contains(&c.id)) {
            if self.engine.remove(&c.id).await.is_ok() {
                removed += 1;
            }
        }
        let volumes = self.engine.list_volumes(&self.own_labels()).await?;
        for v in volumes.into_iter().filter(|v| !leased.contains(&v.id)) {
            if self.engine.remove_volume(&v.id).await.is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Periodic work: when dockerd was away, check it; once it answers, run the clean-up that
    /// was owed (startup sweep, own stale containers, pending removals). Returns true when the
    /// engine came back during this tick (the pool must then drop its idle containers).
    pub async fn tick(&self) -> bool {
        let owed = self.engine_down()
            || self.pending_count() > 0
            || !self.startup_swept.load(Ordering::SeqCst);
        if !owed {
            return false;
        }
        let ping = self.engine.ping().await;
        self.observe(&ping);
        if ping.is_err() {
            return false;
        }
        let came_back = self.engine_down.swap(false, Ordering::SeqCst);
        if came_back {
            self.comebacks.fetch_add(1, Ordering::SeqCst);
        }
        if !self.startup_swept.load(Ordering::SeqCst) {
            let _ = self.sweep_orphans().await;
        }
        if came_back {
            match self.sweep_own().await {
                Ok(n) => tracing::info!(
                    removed = n,
                    "docker engine reachable again; stale containers removed"
                ),
                Err(e) => tracing::warn!(error = %e, "clean-up after reconnect failed"),
            }
        }
        let mut pending: Vec<Leftover> = self
            .pending
            .lock()
            .map(|mut p| p.drain().collect())
            .unwrap_or_default();
        // Containers first: a volume cannot go while its container exists.
        pending.sort_by_key(|l| matches!(l, Leftover::Volume(_)));
        for what in pending {
            if self.remove(&what).await.is_err() {
                self.add_pending(what);
            }
        }
        came_back
    }
}

/// What [`remove_labelled`] did: how many containers it removed, and what it saw last of what
/// it could not remove before its deadline (container ids, then volume names; empty: nothing of
/// those labels is left).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub removed: usize,
    pub left: Vec<String>,
}

/// Pause between two rounds of [`remove_labelled`].
const SWEEP_ROUND_PAUSE: Duration = Duration::from_millis(200);

/// Removes every container carrying all of `labels`, then their disk volumes, until a listing
/// finds none of either or `deadline` passes. Used when the daemon exits: nothing is in use any
/// more, so nothing is spared. Each round lists again, so a container whose removal failed (a
/// gVisor sandbox slow to die), or that a create still in flight made after an earlier round,
/// is taken by a later one; a volume can only go once its container is gone. A removal still
/// running at the deadline is not cancelled in the engine (dockerd finishes a removal whose
/// client went away), only no longer waited for.
pub async fn remove_labelled(
    engine: &dyn Engine,
    labels: &[String],
    deadline: tokio::time::Instant,
) -> Swept {
    let removed = Mutex::new(HashSet::new());
    // What the last listing showed (containers, then volumes); unknown until one answered.
    let last_seen = Mutex::new(vec!["(the engine did not answer a listing)".to_string()]);
    // Ok(true): nothing is left. Ok(false): the engine is not there (no socket, connection
    // refused), so nothing can be removed and nothing new can appear; waiting for it would only
    // hold the exit for the whole bound.
    let rounds = async {
        loop {
            match sweep_round(engine, labels, &removed).await {
                Ok(seen) if seen.is_empty() => return true,
                Ok(seen) => *last_seen.lock().unwrap_or_else(|e| e.into_inner()) = seen,
                Err(e) if e.is_unreachable() => {
                    *last_seen.lock().unwrap_or_else(|e| e.into_inner()) = vec![format!("({e})")];
                    return false;
                }
                Err(e) => tracing::debug!(error = %e, "exit sweep: the engine failed a listing"),
            }
            tokio::time::sleep(SWEEP_ROUND_PAUSE).await;
        }
    };
    let finished = tokio::time::timeout_at(deadline, rounds)
        .await
        .unwrap_or(false);
    let removed = removed.into_inner().map(|r| r.len()).unwrap_or(0);
    let left = match finished {
        true => Vec::new(),
        false => last_seen.into_inner().unwrap_or_else(|e| e.into_inner()),
    };
    Swept { removed, left }
}

/// One round of [`remove_labelled`]: lists containers and removes them all, or, when there are
/// none, lists volumes and removes those. Returns what the listing showed.
async fn sweep_round(
    engine: &dyn Engine,
    labels: &[String],
    removed: &Mutex<HashSet<String>>,
) -> Result<Vec<String>, EngineError> {
    let containers = engine.list(labels).await?;
    if !containers.is_empty() {
        let ids: Vec<String> = containers.into_iter().map(|c| c.id).collect();
        let results = futures::future::join_all(ids.iter().map(|id| engine.remove(id))).await;
        for (id, r) in ids.iter().zip(results) {
            match r {
                Ok(()) => {
                    if let Ok(mut done) = removed.lock() {
                        done.insert(id.clone());
                    }
                }
                Err(e) => {
                    tracing::debug!(container = %id, error = %e, "exit sweep: removal failed")
                }
            }
        }
        return Ok(ids);
    }
    let volumes: Vec<String> = engine
        .list_volumes(labels)
        .await?
        .into_iter()
        .map(|v| v.id)
        .collect();
    futures::future::join_all(volumes.iter().map(|v| engine.remove_volume(v))).await;
    Ok(volumes)
}

/// SIGKILLs host process `pid` if it is the main process of container `id`: its cgroup path names
/// the container, which also fails (and kills nothing) when this daemon does not share the
/// engine's pid namespace or the pid was reused. Returns whether the signal was sent.
pub fn host_kill(id: &str, pid: u32) -> bool {
    if id.len() < 12 || pid <= 1 {
        return false;
    }
    let Ok(cgroup) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return false;
    };
    if !cgroup.lines().any(|l| l.contains(id)) {
        return false;
    }
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) has no memory effects; the target was just checked to be the container's
    // main process (a reuse of the pid between the check and the call is the usual, tiny, kill(2)
    // race, and would need a process in that container's cgroup anyway).
    unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
}

/// Our pid namespace, so pids in owner labels are only compared within the same namespace.
pub fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Whether the startup sweep removes `c` (see the module docs). `start_time_of(pid)` is the start
/// time of the live process with that pid, if any.
pub fn sweep_verdict(c: &Listed, me: &Owner, start_time_of: impl Fn(u32) -> Option<u64>) -> bool {
    let stopped = matches!(c.state.as_str(), "exited" | "dead");
    owner_gone(&c.labels, stopped, me, start_time_of)
}

/// Whether something labelled `labels` (stopped or not) may be removed: managed, and its owner
/// is a daemon of this host and pid namespace that is gone, or one we cannot judge and it has
/// stopped.
fn owner_gone(
    labels: &std::collections::HashMap<String, String>,
    stopped: bool,
    me: &Owner,
    start_time_of: impl Fn(u32) -> Option<u64>,
) -> bool {
    if labels.get(LABEL_MANAGED).map(String::as_str) != Some("true") {
        return false;
    }
    let Some(owner) = labels.get(LABEL_OWNER).and_then(|l| Owner::parse_label(l)) else {
        return stopped;
    };
    if owner.same_process(me) {
        return false; // ours: the reconnect clean-up handles our own
    }
    if owner.host == me.host && owner.pid_ns == me.pid_ns {
        return start_time_of(owner.pid) != Some(owner.start_time);
    }
    stopped
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn me() -> Owner {
        Owner {
            instance: "h-10".into(),
            host: "h".into(),
            pid_ns: "pid:[1]".into(),
            pid: 10,
            start_time: 100,
        }
    }

    fn listed(state: &str, owner: Option<&str>) -> Listed {
        let mut labels = HashMap::from([(LABEL_MANAGED.to_string(), "true".to_string())]);
        if let Some(o) = owner {
            labels.insert(LABEL_OWNER.to_string(), o.to_string());
        }
        Listed {
            id: "c".into(),
            state: state.into(),
            labels,
        }
    }

    #[test]
    fn verdicts() {
        let alive = |pid: u32| if pid == 20 { Some(200) } else { None };
        // Stopped containers of daemons we cannot judge are garbage.
        assert!(sweep_verdict(
            &listed("exited", Some("other/pid:[9]/5/5")),
            &me(),
            alive
        ));
        assert!(sweep_verdict(
            &listed("exited", Some("h/pid:[2]/5/5")),
            &me(),
            alive
        ));
        assert!(sweep_verdict(&listed("dead", None), &me(), alive));
        // A live owner on this host may still be reading the state of its stopped container.
        assert!(!sweep_verdict(
            &listed("exited", Some("h/pid:[1]/20/200")),
            &me(),
            alive
        ));
        assert!(sweep_verdict(
            &listed("exited", Some("h/pid:[1]/30/300")),
            &me(),
            alive
        ));
        // Running: only when the owner is on this host, same pid ns, and gone.
        assert!(sweep_verdict(
            &listed("running", Some("h/pid:[1]/30/300")),
            &me(),
            alive
        ));
        assert!(
            sweep_verdict(&listed("running", Some("h/pid:[1]/20/999")), &me(), alive),
            "pid reused"
        );
        assert!(
            !sweep_verdict(&listed("running", Some("h/pid:[1]/20/200")), &me(), alive),
            "owner alive"
        );
        assert!(
            !sweep_verdict(
                &listed("running", Some("other/pid:[1]/30/300")),
                &me(),
                alive
            ),
            "other host"
        );
        assert!(
            !sweep_verdict(&listed("running", Some("h/pid:[2]/30/300")), &me(), alive),
            "other pid ns"
        );
        assert!(
            !sweep_verdict(&listed("running", Some("h/pid:[1]/10/100")), &me(), alive),
            "ours"
        );
        assert!(
            !sweep_verdict(&listed("exited", Some("h/pid:[1]/10/100")), &me(), alive),
            "ours"
        );
        assert!(!sweep_verdict(&listed("running", None), &me(), alive));
        let mut unmanaged = listed("exited", None);
        unmanaged.labels.clear();
        assert!(!sweep_verdict(&unmanaged, &me(), alive));
    }

    #[test]
    fn host_kill_refuses_processes_of_other_cgroups() {
        // Our own process is in no container whose id we make up: nothing is signalled.
        assert!(!host_kill(&"f".repeat(64), std::process::id()));
        assert!(!host_kill("short", std::process::id()));
        assert!(!host_kill(&"f".repeat(64), 1));
    }

    #[test]
    fn own_start_time_is_readable() {
        assert!(process_start_time(std::process::id()).is_some());
        assert!(pid_namespace().starts_with("pid:"));
    }

    /// The janitor against an engine (the fake one).
    mod engine {
        use super::*;
        use crate::sandbox::docker::engine::Engine;
        use crate::sandbox::docker::engine::fake::FakeEngine;
        use bollard::models::ContainerCreateBody;
        use std::collections::HashMap;
        use std::sync::atomic::Ordering;
        use std::time::Duration;

        async fn create(engine: &FakeEngine, labels: &[(&str, &str)]) -> String {
            let labels: HashMap<String, String> = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let id = engine
                .create(
                    "x",
                    ContainerCreateBody {
                        labels: Some(labels),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            engine.start(&id).await.unwrap();
            id
        }

        #[tokio::test]
        async fn removals_survive_an_engine_outage_and_reconnect_cleans_up() {
            let engine = Arc::new(FakeEngine::default());
            let j = Janitor::new(engine.clone() as Arc<dyn Engine>, me(), BackendKind::Docker);
            let owner = me().label();
            let ours = [
                (LABEL_MANAGED, "true"),
                (LABEL_INSTANCE, "h-10"),
                (LABEL_OWNER, owner.as_str()),
                (LABEL_BACKEND, "docker"),
            ];
            // Another daemon with the same instance id (pid 1 of another pid namespace, same
            // hostname): never ours to remove.
            let namesake = create(
                &engine,
                &[
                    (LABEL_MANAGED, "true"),
                    (LABEL_INSTANCE, "h-10"),
                    (LABEL_OWNER, "h/pid:[2]/10/100"),
                    (LABEL_BACKEND, "docker"),
                ],
            )
            .await;
            let sibling = create(
                &engine,
                &[
                    (LABEL_MANAGED, "true"),
                    (LABEL_INSTANCE, "h-10"),
                    (LABEL_BACKEND, "gvisor"),
                ],
            )
            .await;
            let leased = create(&engine, &ours).await;
            let stale = create(&engine, &ours).await;
            let disposed = create(&engine, &ours).await;
            j.lease(&leased);
            assert!(
                !j.tick().await,
                "startup sweep, engine up: nothing came back"
            );

            engine.down.store(true, Ordering::SeqCst);
            j.dispose(disposed.clone(), None);
            for _ in 0..100 {
                if j.pending_count() == 1 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(j.pending_count(), 1, "failed removal kept for retry");
            assert!(j.engine_down());
            assert!(!j.tick().await, "still down");

            engine.down.store(false, Ordering::SeqCst);
            assert!(j.tick().await, "came back");
            let mut kept = vec![leased.clone(), sibling.clone(), namesake.clone()];
            kept.sort();
            assert_eq!(
                engine.existing(),
                kept,
                "stale {stale} and pending removed; the leased one, the gvisor backend's and the \
                 namesake daemon's kept"
            );
            // The removal at exit spares the namesake too.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            let swept = remove_labelled(&*engine, &j.own_labels(), deadline).await;
            assert_eq!(
                swept,
                Swept {
                    removed: 1,
                    left: vec![]
                },
                "only the leased one of ours"
            );
            let mut kept = vec![sibling.clone(), namesake.clone()];
            kept.sort();
            assert_eq!(engine.existing(), kept);
            assert_eq!(j.pending_count(), 0);
        }

        /// The exit sweep lists again after a round: a container whose removal failed, or that
        /// appeared after the first listing, is removed by a later round; what is still there at
        /// the deadline is named.
        #[tokio::test]
        async fn the_exit_sweep_lists_again_until_nothing_is_left() {
            let engine = Arc::new(FakeEngine::default());
            let j = Janitor::new(engine.clone() as Arc<dyn Engine>, me(), BackendKind::Docker);
            let owner = me().label();
            let ours = [
                (LABEL_MANAGED, "true"),
                (LABEL_INSTANCE, "h-10"),
                (LABEL_OWNER, owner.as_str()),
                (LABEL_BACKEND, "docker"),
            ];
            create_with_volume(&engine, "v-1", &ours).await;
            create(&engine, &ours).await;
            engine.failing_removals.store(1, Ordering::SeqCst);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let swept = remove_labelled(&*engine, &j.own_labels(), deadline).await;
            assert_eq!((swept.removed, swept.left), (2, vec![]));
            assert!(engine.existing().is_empty(), "{:?}", engine.existing());
            assert!(engine.existing_volumes().is_empty());

            // One that never goes: named when the deadline passes.
            let stuck = create(&engine, &ours).await;
            engine.failing_removals.store(usize::MAX, Ordering::SeqCst);
            let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
            let swept = remove_labelled(&*engine, &j.own_labels(), deadline).await;
            assert_eq!((swept.removed, swept.left), (0, vec![stuck]));
        }

        /// An engine that is not there (a daemon configured for containers on a host without
        /// dockerd) does not hold the exit for the whole bound: the sweep ends at the first
        /// listing that finds no engine, and says so. (Tokio's clock is paused: a sweep that
        /// waited would advance it to the deadline.)
        #[tokio::test(start_paused = true)]
        async fn the_exit_sweep_does_not_wait_for_an_engine_that_is_not_there() {
            let engine = Arc::new(FakeEngine::default());
            let j = Janitor::new(engine.clone() as Arc<dyn Engine>, me(), BackendKind::Docker);
            engine.down.store(true, Ordering::SeqCst);
            let started = tokio::time::Instant::now();
            let deadline = started + Duration::from_secs(30);
            let swept = remove_labelled(&*engine, &j.own_labels(), deadline).await;
            assert!(
                tokio::time::Instant::now() < deadline,
                "the sweep waited until its deadline for an absent engine"
            );
            assert_eq!(swept.removed, 0);
            assert!(
                matches!(swept.left.as_slice(), [why] if why.contains("unreachable")),
                "{:?}",
                swept.left
            );
        }

        #[tokio::test]
        async fn startup_sweep_removes_only_what_crashed_daemons_left() {
            let engine = Arc::new(FakeEngine::default());
            let dead_owner = format!("h/{}/4194304/1", pid_namespace());
            let me = Owner {
                pid_ns: pid_namespace(),
                pid: std::process::id(),
                start_time: process_start_time(std::process::id()).unwrap(),
                ..me()
            };
            let live_owner = me.label();
            let other_host = "elsewhere/pid:[9]/1/1".to_string();
            let orphan = create(
                &engine,
                &[(LABEL_MANAGED, "true"), (LABEL_OWNER, &dead_owner)],
            )
            .await;
            let mine = create(
                &engine,
                &[(LABEL_MANAGED, "true"), (LABEL_OWNER, &live_owner)],
            )
            .await;
            let foreign = create(
                &engine,
                &[(LABEL_MANAGED, "true"), (LABEL_OWNER, &other_host)],
            )
            .await;
            let unmanaged = create(&engine, &[(LABEL_OWNER, &dead_owner)]).await;
            let j = Janitor::new(engine.clone() as Arc<dyn Engine>, me, BackendKind::Docker);
            assert_eq!(j.sweep_orphans().await.unwrap(), 1);
            let left = engine.existing();
            assert!(!left.contains(&orphan));
            assert!(left.contains(&mine) && left.contains(&foreign) && left.contains(&unmanaged));
        }

        /// A container using volume `volume`, both labelled `labels`.
        async fn create_with_volume(
            engine: &FakeEngine,
            volume: &str,
            labels: &[(&str, &str)],
        ) -> String {
            use bollard::models::{HostConfig, Mount, MountType, MountVolumeOptions};
            let labels: HashMap<String, String> = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let mount = Mount {
                source: Some(volume.into()),
                target: Some("/work".into()),
                typ: Some(MountType::VOLUME),
                volume_options: Some(MountVolumeOptions {
                    labels: Some(labels.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let id = engine
                .create(
                    "x",
                    ContainerCreateBody {
                        labels: Some(labels),
                        host_config: Some(HostConfig {
                            mounts: Some(vec![mount]),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            engine.start(&id).await.unwrap();
            id
        }

        #[tokio::test]
        async fn disk_volumes_go_after_their_containers_and_with_dead_owners() {
            let engine = Arc::new(FakeEngine::default());
            let me = Owner {
                pid_ns: pid_namespace(),
                pid: std::process::id(),
                start_time: process_start_time(std::process::id()).unwrap(),
                ..me()
            };
            let dead = format!("h/{}/4194304/1", pid_namespace());
            let live = me.label();
            let orphan = create_with_volume(
                &engine,
                "v-dead",
                &[(LABEL_MANAGED, "true"), (LABEL_OWNER, &dead)],
            )
            .await;
            create_with_volume(
                &engine,
                "v-live",
                &[(LABEL_MANAGED, "true"), (LABEL_OWNER, &live)],
            )
            .await;
            let foreign = create_with_volume(
                &engine,
                "v-foreign",
                &[
                    (LABEL_MANAGED, "true"),
                    (LABEL_OWNER, "elsewhere/pid:[9]/1/1"),
                ],
            )
            .await;
            let j = Janitor::new(engine.clone() as Arc<dyn Engine>, me, BackendKind::Docker);
            // The dead owner's container and then its volume; a running foreign container keeps its
            // volume in use, and the live owner's stays.
            assert_eq!(j.sweep_orphans().await.unwrap(), 2);
            assert!(!engine.existing().contains(&orphan));
            assert_eq!(engine.existing_volumes(), ["v-foreign", "v-live"]);
            // Disposal: the container, then its volume.
            j.dispose(foreign.clone(), Some("v-foreign".into()));
            for _ in 0..200 {
                if !engine.existing_volumes().contains(&"v-foreign".to_string()) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(engine.existing_volumes(), ["v-live"]);
            assert!(!engine.existing().contains(&foreign));
        }
    }
}
