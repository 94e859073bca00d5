//! The warm pool: started sandbox containers whose supervisor waits for a request.
//!
//! Owns: per-key queues of idle containers (key = profile + everything in the create body, see
//! [`ContainerPlan`]), handing one out per execution, replacing it in the background, dropping
//! dead ones, and the pool metrics. A container leaves the pool exactly once and is destroyed
//! after its run: the pool never takes one back. Must not: run commands.
//!
//! Every container, a warm one too, gets a host uid of its own from the daemon's uid block when
//! it is launched ([`Pool::lease_uid`]); its [`ContainerGuard`] holds the lease, and the janitor
//! keeps it after the guard is dropped until the container is removed.
//!
//! Pools are created on first use of a key, then kept at `pool_size` idle containers.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::{CounterVec, GaugeVec};
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;

use super::container::{ContainerPlan, DISK_VOLUME_PREFIX};
use super::egress::{SocketDir, SocketDirs};
use super::engine::{Attached, EngineError};
use super::janitor::Janitor;
use crate::sandbox::uids::{UidLease, UidRange};
use crate::sandbox::{BackendKind, SandboxError};

/// Concurrent container launches for refills: each is a few hundred ms of dockerd and runtime
/// work; more at once only slows the runs that are executing.
const LAUNCH_SLOTS: usize = 2;
/// A refill waits until no run of the backend has been in flight for this long before it
/// launches: a launch is hundreds of milliseconds of dockerd, containerd and runtime CPU, which
/// would otherwise be taken from the runs in flight (those processes are not the daemon's to
/// renice, so the pool fills the gaps between runs instead).
const REFILL_QUIET: Duration = Duration::from_millis(100);
/// ... but no longer than this after it was asked for: under load that never pauses, the pool
/// still fills.
const REFILL_DEFER_MAX: Duration = Duration::from_secs(5);
/// How often a deferred refill looks whether the backend is quiet.
const REFILL_LOOK_EVERY: Duration = Duration::from_millis(20);
/// After failed refills (image missing, engine away) the key is left alone for this long,
/// doubling with each further failure up to [`REFILL_BACKOFF_MAX`].
const REFILL_BACKOFF: Duration = Duration::from_secs(5);
const REFILL_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Container shapes kept warm at most (each holds `pool_size` idle containers): profiles,
/// executors with files of their own, and sessions' containers. A shape past it is served by a
/// launch of its own.
const MAX_KEYS: usize = 32;

/// Handles into the daemon's metrics (`executor_pool_idle_containers`, `executor_pool_events_total`).
#[derive(Clone)]
pub struct PoolMetrics {
    pub size: GaugeVec,
    pub events: CounterVec,
}

/// A container we own, with its disk volume and the lease of the uid it runs as. Dropping the
/// guard destroys the container and the volume (in the background), so every path out of a run,
/// including a dropped future, removes them; the uid is released once the container is gone.
pub struct ContainerGuard {
    id: String,
    volume: Option<String>,
    uid: Option<UidLease>,
    janitor: Arc<Janitor>,
}

impl ContainerGuard {
    /// `volume` must already be leased (see [`WarmContainer::launch`]).
    pub fn new(id: String, volume: Option<String>, uid: UidLease, janitor: Arc<Janitor>) -> Self {
        janitor.lease(&id);
        ContainerGuard {
            id,
            volume,
            uid: Some(uid),
            janitor,
        }
    }

    /// The host uid the container's command runs as.
    pub fn uid(&self) -> Option<u32> {
        self.uid.as_ref().map(UidLease::uid)
    }

    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        if let Some(uid) = self.uid.take() {
            self.janitor.hold_uid(&self.id, uid);
        }
        self.janitor
            .dispose(std::mem::take(&mut self.id), self.volume.take());
    }
}

/// A started sandbox whose supervisor waits on the attached stdin.
pub struct WarmContainer {
    pub attached: Attached,
    pub guard: ContainerGuard,
    /// Host pid of its main process, read right after start: a kill must not need the engine
    /// to answer first (dockerd holds the container's lock while a slow kill is in progress).
    pub pid: Option<u32>,
    /// Its own egress socket directory (egress plans); removed when dropped.
    pub socket_dir: Option<SocketDir>,
    /// The host directory of its disk volume (its workdir and /tmp), as the engine reported it.
    pub disk_source: Option<std::path::PathBuf>,
}

impl WarmContainer {
    /// Creates, attaches (before start, so nothing is missed) and starts one container whose
    /// command runs as `uid`; an egress plan first gets its socket directory from `dirs`.
    pub async fn launch(
        janitor: &Arc<Janitor>,
        plan: &ContainerPlan,
        name: &str,
        exec_label: &str,
        uid: UidLease,
        dirs: Option<&SocketDirs>,
    ) -> Result<WarmContainer, EngineError> {
        let socket_dir = match (plan.egress, dirs) {
            (false, _) => None,
            (true, Some(d)) => Some(d.create().map_err(|e| {
                EngineError::Api(format!("cannot create an egress socket directory: {e}"))
            })?),
            (true, None) => {
                return Err(EngineError::Api(
                    "egress plan without egress socket directories".into(),
                ));
            }
        };
        let engine = janitor.engine().clone();
        // dockerd creates the disk volume with the container; leased first, so no sweep takes
        // it in between.
        let volume = format!("{DISK_VOLUME_PREFIX}{}", uuid::Uuid::new_v4().simple());
        janitor.lease(&volume);
        let body = plan.body(
            janitor.owner(),
            exec_label,
            &volume,
            uid.uid(),
            socket_dir.as_ref().map(SocketDir::path),
        );
        // The permit is held until the container is started: the daemon's exit waits for it.
        let (created, _launching) = match janitor.create(name, body, &volume).await {
            Ok(c) => c,
            // dockerd may have made the container without our hearing of it: removed by name,
            // and its uid is held until that removal went through.
            Err(e) if matches!(e, EngineError::Unreachable(_) | EngineError::Timeout) => {
                janitor.hold_uid(name, uid);
                janitor.dispose(name.to_string(), Some(volume));
                return Err(e);
            }
            Err(e) => {
                janitor.dispose_volume(volume);
                return Err(e);
            }
        };
        let guard = ContainerGuard::new(created, Some(volume.clone()), uid, janitor.clone());
        let attached = engine.attach(guard.id()).await;
        janitor.observe(&attached);
        let attached = attached?;
        let started = engine.start(guard.id()).await;
        janitor.observe(&started);
        started?;
        let state = engine.inspect(guard.id()).await.ok();
        let pid = state.as_ref().and_then(|st| st.pid);
        let disk_source = state.and_then(|mut st| st.volume_sources.remove(&volume));
        Ok(WarmContainer {
            attached,
            guard,
            pid,
            socket_dir,
            disk_source,
        })
    }

    /// An idle supervisor writes nothing; a finished stream or any output means it is gone.
    fn alive(&mut self) -> bool {
        self.attached.output.next().now_or_never().is_none()
    }
}

struct KeyPool {
    plan: Arc<ContainerPlan>,
    idle: VecDeque<WarmContainer>,
    filling: usize,
    retry_after: Option<Instant>,
    failures: u32,
}

pub struct Pool {
    size: usize,
    kind: BackendKind,
    janitor: Arc<Janitor>,
    /// The block every container's uid comes from (the daemon's, shared with the local backend).
    uids: Arc<UidRange>,
    /// Socket directories of egress containers (None: this backend has no egress).
    egress_dirs: Option<Arc<SocketDirs>>,
    metrics: Option<PoolMetrics>,
    keys: Mutex<HashMap<String, KeyPool>>,
    /// Bumped by [`Pool::flush`]: launches that started before it are discarded.
    generation: AtomicU64,
    /// Set by [`Pool::close`]: nothing is launched or handed out any more.
    closed: AtomicBool,
    launches: Arc<Semaphore>,
    busy: Arc<Busy>,
}

/// The backend's runs in flight, and when the last one ended.
#[derive(Default)]
struct Busy {
    runs: AtomicUsize,
    /// None: no run has ended yet.
    last_end: Mutex<Option<Instant>>,
}

/// A run in flight on the backend ([`Pool::run_started`]); its drop ends it.
pub struct RunInFlight(Arc<Busy>);

impl Drop for RunInFlight {
    fn drop(&mut self) {
        if let Ok(mut t) = self.0.last_end.lock() {
            *t = Some(Instant::now());
        }
        self.0.runs.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Pool {
    pub fn new(
        size: usize,
        kind: BackendKind,
        janitor: Arc<Janitor>,
        uids: Arc<UidRange>,
        egress_dirs: Option<Arc<SocketDirs>>,
        metrics: Option<PoolMetrics>,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            size,
            kind,
            janitor,
            uids,
            egress_dirs,
            metrics,
            keys: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            launches: Arc::new(Semaphore::new(LAUNCH_SLOTS)),
            busy: Arc::default(),
        })
    }

    /// Counts a run in flight until the guard is dropped: refills wait for the gaps between
    /// runs ([`REFILL_QUIET`]).
    pub fn run_started(&self) -> RunInFlight {
        self.busy.runs.fetch_add(1, Ordering::SeqCst);
        RunInFlight(self.busy.clone())
    }

    /// Waits until no run has been in flight for [`REFILL_QUIET`], or [`REFILL_DEFER_MAX`].
    async fn quiet(&self) {
        let asked = Instant::now();
        while asked.elapsed() < REFILL_DEFER_MAX && !self.closed.load(Ordering::SeqCst) {
            let ended = self.busy.last_end.lock().map(|t| *t).unwrap_or(None);
            if self.busy.runs.load(Ordering::SeqCst) == 0
                && ended.is_none_or(|t| t.elapsed() >= REFILL_QUIET)
            {
                return;
            }
            tokio::time::sleep(REFILL_LOOK_EVERY).await;
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn egress_dirs(&self) -> Option<&SocketDirs> {
        self.egress_dirs.as_deref()
    }

    /// A host uid for one container to be launched, held by it until it is removed. Every uid
    /// of the block held: `Unavailable` (503), never a uid shared with another sandbox.
    pub async fn lease_uid(&self) -> Result<UidLease, SandboxError> {
        let uids = self.uids.clone();
        tokio::task::spawn_blocking(move || uids.lease())
            .await
            .map_err(|e| SandboxError::Setup(format!("uid lease task: {e}")))?
    }

    /// Idle containers over all keys.
    pub fn idle(&self) -> usize {
        self.keys
            .lock()
            .map(|k| k.values().map(|p| p.idle.len()).sum())
            .unwrap_or(0)
    }

    /// Idle containers of `profile` over all its keys (executors with their own files share a
    /// profile but not a key).
    fn publish(&self, keys: &HashMap<String, KeyPool>, profile: &str) {
        if let Some(m) = &self.metrics {
            let n: usize = keys
                .values()
                .filter(|k| k.plan.profile == profile)
                .map(|k| k.idle.len())
                .sum();
            m.size
                .with_label_values(&[self.kind.as_str(), profile])
                .set(n as f64);
        }
    }

    /// Counts `event` in `executor_pool_events_total` (`hit`, `miss`, `reused`).
    pub(super) fn count(&self, event: &str) {
        if let Some(m) = &self.metrics {
            m.events
                .with_label_values(&[self.kind.as_str(), event])
                .increment(1);
        }
    }

    /// A live idle container for `plan`, or `None` (a miss: the caller launches its own). With
    /// `warm`, the key's pool is then topped up in the background (and made on first use);
    /// without, an existing one is used but none is made or refilled: shapes a caller chooses
    /// freely (a session's own limits) must not make the daemon keep containers for each.
    pub fn take(self: &Arc<Self>, plan: &ContainerPlan, warm: bool) -> Option<WarmContainer> {
        if self.size == 0 || self.closed.load(Ordering::SeqCst) {
            return None;
        }
        let mut dead = Vec::new();
        let got = {
            let Ok(mut keys) = self.keys.lock() else {
                return None;
            };
            if !keys.contains_key(&plan.key) && (!warm || keys.len() >= MAX_KEYS) {
                drop(keys);
                self.count("miss");
                return None;
            }
            let kp = keys.entry(plan.key.clone()).or_insert_with(|| KeyPool {
                plan: Arc::new(plan.clone()),
                idle: VecDeque::new(),
                filling: 0,
                retry_after: None,
                failures: 0,
            });
            let mut got = None;
            while let Some(mut w) = kp.idle.pop_front() {
                if w.alive() {
                    got = Some(w);
                    break;
                }
                dead.push(w);
            }
            self.publish(&keys, &plan.profile);
            got
        };
        if !dead.is_empty() {
            tracing::info!(
                dropped = dead.len(),
                "warm pool: idle containers had died; replacing them"
            );
        }
        drop(dead);
        self.count(if got.is_some() { "hit" } else { "miss" });
        if warm {
            self.refill(&plan.key);
        }
        got
    }

    /// Starts launches until the key has `size` idle or launching containers.
    fn refill(self: &Arc<Self>, key: &str) {
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        let (plan, n, generation) = {
            let Ok(mut keys) = self.keys.lock() else {
                return;
            };
            let Some(kp) = keys.get_mut(key) else { return };
            if kp.retry_after.is_some_and(|t| Instant::now() < t) {
                return;
            }
            let n = self.size.saturating_sub(kp.idle.len() + kp.filling);
            kp.filling += n;
            (kp.plan.clone(), n, self.generation.load(Ordering::SeqCst))
        };
        for _ in 0..n {
            let me = self.clone();
            let plan = plan.clone();
            tokio::spawn(async move { me.fill_one(plan, generation).await });
        }
    }

    async fn fill_one(self: Arc<Self>, plan: Arc<ContainerPlan>, generation: u64) {
        self.quiet().await;
        let launched = match self.launches.clone().acquire_owned().await {
            Ok(_) if self.closed.load(Ordering::SeqCst) => {
                Err(EngineError::Api("pool closed".into()))
            }
            Ok(_slot) => match self.lease_uid().await {
                Ok(uid) => {
                    let tag = uuid::Uuid::new_v4().simple().to_string();
                    WarmContainer::launch(
                        &self.janitor,
                        &plan,
                        &format!("executor-arm-pool-{tag}"),
                        &format!("pool-{tag}"),
                        uid,
                        self.egress_dirs(),
                    )
                    .await
                }
                Err(e) => Err(EngineError::Api(format!(
                    "no uid for a warm container: {e}"
                ))),
            },
            Err(_) => Err(EngineError::Api("pool closed".into())),
        };
        let mut discard = None;
        if let Ok(mut guard) = self.keys.lock() {
            let keys = &mut *guard;
            let Some(kp) = keys.get_mut(&plan.key) else {
                return;
            };
            kp.filling = kp.filling.saturating_sub(1);
            match launched {
                Ok(w)
                    if generation == self.generation.load(Ordering::SeqCst)
                        && !self.closed.load(Ordering::SeqCst) =>
                {
                    kp.idle.push_back(w);
                    kp.retry_after = None;
                    kp.failures = 0;
                }
                Ok(w) => discard = Some(w),
                Err(e) => {
                    let backoff = REFILL_BACKOFF
                        .saturating_mul(1 << kp.failures.min(10))
                        .min(REFILL_BACKOFF_MAX);
                    kp.failures = kp.failures.saturating_add(1);
                    kp.retry_after = Some(Instant::now() + backoff);
                    tracing::warn!(backend = self.kind.as_str(), profile = %plan.profile, error = %e, "warm pool: launching a container failed");
                }
            }
            self.publish(keys, &plan.profile);
        }
        drop(discard);
    }

    /// Closes the pool for good when the daemon exits: nothing is launched or handed out from
    /// now on, and the idle containers are dropped (their guards remove them). Launches in
    /// flight are the janitor's to wait for ([`Janitor::close_launches`]).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let mut dropped = Vec::new();
        if let Ok(mut keys) = self.keys.lock() {
            for kp in keys.values_mut() {
                dropped.extend(kp.idle.drain(..));
            }
            for profile in keys
                .values()
                .map(|k| k.plan.profile.clone())
                .collect::<Vec<_>>()
            {
                self.publish(&keys, &profile);
            }
        }
        drop(dropped);
    }

    /// Drops every idle container (dockerd restarted: they are dead or unreachable) and refills.
    pub fn flush(self: &Arc<Self>) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        let mut dropped = Vec::new();
        let keys: Vec<String> = match self.keys.lock() {
            Ok(mut keys) => {
                for kp in keys.values_mut() {
                    dropped.extend(kp.idle.drain(..));
                    kp.retry_after = None;
                }
                for profile in keys
                    .values()
                    .map(|k| k.plan.profile.clone())
                    .collect::<Vec<_>>()
                {
                    self.publish(&keys, &profile);
                }
                keys.keys().cloned().collect()
            }
            Err(_) => Vec::new(),
        };
        drop(dropped);
        for k in keys {
            self.refill(&k);
        }
    }

    /// Replaces idle containers whose supervisor has gone.
    pub fn prune(self: &Arc<Self>) {
        let mut dead = Vec::new();
        let mut refill = Vec::new();
        if let Ok(mut keys) = self.keys.lock() {
            for (key, kp) in keys.iter_mut() {
                let before = dead.len();
                let mut keep = VecDeque::with_capacity(kp.idle.len());
                for mut w in kp.idle.drain(..) {
                    if w.alive() {
                        keep.push_back(w)
                    } else {
                        dead.push(w)
                    }
                }
                kp.idle = keep;
                if dead.len() > before || kp.idle.len() + kp.filling < self.size {
                    refill.push(key.clone());
                }
            }
            for profile in keys
                .values()
                .map(|k| k.plan.profile.clone())
                .collect::<Vec<_>>()
            {
                self.publish(&keys, &profile);
            }
        }
        drop(dead);
        for k in refill {
            self.refill(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::sandbox::docker::engine::Engine;
    use crate::sandbox::docker::engine::fake::FakeEngine;
    use crate::sandbox::docker::labels::Owner;

    fn owner() -> Owner {
        Owner {
            instance: "test-1".into(),
            host: "test".into(),
            pid_ns: "pid:[1]".into(),
            pid: 1,
            start_time: 1,
        }
    }

    fn metrics() -> (Arc<Metrics>, PoolMetrics) {
        let m = Arc::new(Metrics::new());
        let pool = PoolMetrics {
            size: m.pool_size.clone(),
            events: m.pool_events.clone(),
        };
        (m, pool)
    }

    fn idle(m: &Metrics) -> f64 {
        let labels = [("backend", "docker"), ("profile", "shell-readonly")];
        m.sample("executor_pool_idle_containers", &labels)
            .unwrap_or(0.0)
    }

    fn event(m: &Metrics, event: &str) -> f64 {
        let labels = [("backend", "docker"), ("event", event)];
        m.sample("executor_pool_events_total", &labels)
            .unwrap_or(0.0)
    }

    fn plan() -> ContainerPlan {
        ContainerPlan::new(
            &crate::sandbox::docker::container::tests::spec(),
            BackendKind::Docker,
            "img",
            false,
        )
        .unwrap()
    }

    async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
        for _ in 0..200 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out: {what}");
    }

    fn setup(size: usize) -> (Arc<FakeEngine>, Arc<Pool>, Arc<Metrics>) {
        let engine = Arc::new(FakeEngine::default());
        let janitor = Janitor::new(
            engine.clone() as Arc<dyn Engine>,
            owner(),
            BackendKind::Docker,
        );
        let (m, pool_metrics) = metrics();
        (
            engine,
            Pool::new(
                size,
                BackendKind::Docker,
                janitor,
                UidRange::for_tests(16),
                None,
                Some(pool_metrics),
            ),
            m,
        )
    }

    #[tokio::test]
    async fn a_shape_not_kept_warm_makes_no_pool_and_the_shapes_are_bounded() {
        let (engine, pool, _m) = setup(2);
        let p = plan();
        assert!(pool.take(&p, false).is_none());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(pool.idle(), 0, "nothing launched for a shape not kept warm");
        assert!(engine.existing().is_empty());
        // Shapes past MAX_KEYS are misses without a pool of their own.
        for i in 0..MAX_KEYS + 3 {
            let mut q = p.clone();
            q.key = format!("shape-{i}");
            assert!(pool.take(&q, true).is_none());
        }
        assert_eq!(pool.keys.lock().unwrap().len(), MAX_KEYS);
    }

    #[tokio::test]
    async fn miss_fills_then_hits_and_a_taken_container_is_destroyed_not_returned() {
        let (engine, pool, m) = setup(2);
        let p = plan();
        assert!(pool.take(&p, true).is_none(), "first use is a miss");
        eventually("pool filled", || pool.idle() == 2).await;
        assert_eq!(idle(&m), 2.0);
        let w = pool.take(&p, true).expect("hit");
        let id = w.guard.id().to_string();
        assert_eq!(event(&m, "hit"), 1.0);
        assert_eq!(event(&m, "miss"), 1.0);
        eventually("replacement launched", || pool.idle() == 2).await;
        drop(w);
        eventually("used container removed", || {
            !engine.existing().contains(&id)
        })
        .await;
        assert_eq!(
            engine.count("create"),
            3,
            "two for the pool, one replacement"
        );
        assert!(
            engine
                .name_of(&engine.existing()[0])
                .unwrap()
                .starts_with("executor-arm-pool-")
        );
    }

    #[tokio::test]
    async fn dead_idle_containers_are_skipped_and_replaced() {
        let (engine, pool, _) = setup(2);
        let p = plan();
        let _ = pool.take(&p, true);
        eventually("pool filled", || pool.idle() == 2).await;
        let first = engine.existing()[0].clone();
        engine.crash(&first);
        let w = pool.take(&p, true).expect("the live one");
        assert_ne!(w.guard.id(), first);
        eventually("dead one removed", || !engine.existing().contains(&first)).await;
        engine.crash(w.guard.id());
        pool.prune();
        eventually("refilled", || pool.idle() == 2).await;
    }

    #[tokio::test]
    async fn flush_replaces_every_idle_container_and_pool_off_never_launches() {
        let (engine, pool, _) = setup(1);
        let p = plan();
        let _ = pool.take(&p, true);
        eventually("pool filled", || pool.idle() == 1).await;
        let old = engine.existing();
        pool.flush();
        eventually("old idle removed and replaced", || {
            pool.idle() == 1 && engine.existing().iter().all(|c| !old.contains(c))
        })
        .await;

        let (engine, pool, m) = setup(0);
        assert!(pool.take(&p, true).is_none());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(engine.count("create"), 0);
        assert_eq!(event(&m, "miss"), 0.0, "no pool, no misses");
    }

    #[tokio::test]
    async fn each_container_holds_a_uid_of_its_own_until_it_is_removed() {
        let engine = Arc::new(FakeEngine::default());
        let janitor = Janitor::new(
            engine.clone() as Arc<dyn Engine>,
            owner(),
            BackendKind::Docker,
        );
        let pool = Pool::new(
            1,
            BackendKind::Docker,
            janitor.clone(),
            UidRange::for_tests(2),
            None,
            None,
        );
        let p = plan();
        assert!(pool.take(&p, true).is_none());
        eventually("pool filled", || pool.idle() == 1).await;
        // The warm container holds one uid from its launch on; a run's launch takes the other.
        let uid = pool.lease_uid().await.unwrap();
        let cold = WarmContainer::launch(&janitor, &p, "executor-arm-x", "x", uid, None)
            .await
            .unwrap();
        let warm = pool.take(&p, false).expect("hit");
        let (a, b) = (warm.guard.uid().unwrap(), cold.guard.uid().unwrap());
        assert_ne!(a, b);
        assert!([a, b].iter().all(|u| (300_000..300_002).contains(u)));
        // Every uid held: the next container gets none (503), never a shared one.
        assert!(matches!(
            pool.lease_uid().await,
            Err(SandboxError::Unavailable(_))
        ));
        // Its removal fails while the engine is away: the uid stays held.
        engine.down.store(true, Ordering::SeqCst);
        let id = cold.guard.id().to_string();
        drop(cold);
        eventually("the removal failed and is pending", || {
            janitor.pending_count() > 0
        })
        .await;
        assert!(engine.existing().contains(&id));
        assert!(
            pool.lease_uid().await.is_err(),
            "released while its container may still exist"
        );
        // Once the container is removed, its uid is free again.
        engine.down.store(false, Ordering::SeqCst);
        janitor.tick().await;
        assert!(!engine.existing().contains(&id));
        assert_eq!(pool.lease_uid().await.unwrap().uid(), b);
        drop(warm);
    }

    #[tokio::test]
    async fn failed_launches_back_off() {
        let (engine, pool, _) = setup(2);
        engine
            .fail_create
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let p = plan();
        assert!(pool.take(&p, true).is_none());
        eventually("both launches tried", || engine.count("create") == 2).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(pool.take(&p, true).is_none());
        pool.prune();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(engine.count("create"), 2, "no retry inside the back-off");
    }
}
