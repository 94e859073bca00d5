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

use tokio::sync::Semaphore;

use super::container::{LABEL_BACKEND, LABEL_INSTANCE, LABEL_MANAGED, LABEL_OWNER, Owner};
use super::engine::{Engine, EngineError, Listed};
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
    /// failed); taken whole by [`Janitor::close_launches`] at exit.
    launch_gate: tokio::sync::RwLock<()>,
    /// Set at exit: no launch starts any more.
    launches_closed: AtomicBool,
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
            launch_gate: tokio::sync::RwLock::new(()),
            launches_closed: AtomicBool::new(false),
        })
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
    pub async fn launch_permit(&self) -> Result<tokio::sync::RwLockReadGuard<'_, ()>, EngineError> {
        if self.launches_closed.load(Ordering::SeqCst) {
            return Err(EngineError::Closed);
        }
        let permit = self.launch_gate.read().await;
        // Closed while this one waited behind the exit's write lock.
        if self.launches_closed.load(Ordering::SeqCst) {
            return Err(EngineError::Closed);
        }
        Ok(permit)
    }

    /// Refuses every container launch from now on and waits, up to `within`, for those in
    /// flight (a pool refill, or a cold launch for a run or a session): once it returns true, no
    /// container of ours is created after a sweep. False: some were still launching.
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

/// Removes every container carrying all of `labels`, then their disk volumes, giving up after
/// `within`. Used when the daemon exits: nothing is in use any more, so nothing is spared. A
/// volume can only go once its container is gone (a background disposal may still be removing
/// one), so volumes are retried until then. Returns how many containers were removed, or `None`
/// when `within` ran out first.
pub async fn remove_labelled(
    engine: &dyn Engine,
    labels: &[String],
    within: Duration,
) -> Option<usize> {
    let work = async {
        let listed = engine.list(labels).await.unwrap_or_default();
        let removed = futures::future::join_all(listed.iter().map(|c| engine.remove(&c.id)))
            .await
            .iter()
            .filter(|r| r.is_ok())
            .count();
        loop {
            let volumes = engine.list_volumes(labels).await.unwrap_or_default();
            let results =
                futures::future::join_all(volumes.iter().map(|v| engine.remove_volume(&v.id)))
                    .await;
            if results.iter().all(Result::is_ok) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        removed
    };
    tokio::time::timeout(within, work).await.ok()
}

/// Start time (clock ticks after boot, field 22 of `/proc/<pid>/stat`) of a live process.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
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
}

#[cfg(test)]
mod engine_tests {
    use super::*;
    use crate::sandbox::docker::engine::Engine;
    use crate::sandbox::docker::engine::fake::FakeEngine;
    use bollard::models::ContainerCreateBody;
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    fn me() -> Owner {
        Owner {
            instance: "h-10".into(),
            host: "h".into(),
            pid_ns: "pid:[1]".into(),
            pid: 10,
            start_time: 100,
        }
    }

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
        let removed = remove_labelled(&*engine, &j.own_labels(), Duration::from_secs(5)).await;
        assert_eq!(removed, Some(1), "only the leased one of ours");
        let mut kept = vec![sibling.clone(), namesake.clone()];
        kept.sort();
        assert_eq!(engine.existing(), kept);
        assert_eq!(j.pending_count(), 0);
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
