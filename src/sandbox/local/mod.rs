//! The `local` backend: each run is a process tree in fresh namespaces, a per-run cgroup, a
//! minimal read-only root, Landlock, seccomp, rlimits and an unprivileged uid.
//!
//! Owns: turning a [`RunSpec`] into a [`child::ChildPlan`], spawning it, feeding stdin, killing
//! the run's cgroup when the wall clock, an output cap or cancellation says so (the shared
//! skeleton, [`super::run`], decides when), and removing everything afterwards.
//! Must not: look at tokens, requests or the allowlist.

pub mod cgroup;
pub mod child;
pub mod dynmods;
pub mod egress;
pub mod landlock;
pub mod probe;
mod reaper;
pub mod seccomp;

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe as upipe;

use self::cgroup::{CgroupDriver, RunCgroup};
use self::child::{ChildPlan, LandlockRule, MountOp};
use self::landlock::AccessFs;
use self::probe::HostProbe;
use self::seccomp::SeccompProgram;
use super::capture::OutputCapture;
use super::run::{self, Ending, Waited};
use super::uids::UidRange;
use super::{BackendKind, BackendStatus, ExitKind, RunOutcome, RunSpec, Sandbox, SandboxError};

pub struct LocalSandbox {
    cgroups: Option<Arc<dyn CgroupDriver>>,
    /// Run slots prepared ahead (absent without cgroups or when configured to 0).
    warm: Option<Arc<WarmSlots>>,
    probe: HostProbe,
    /// Empty host directory the per-run root tmpfs is mounted on (inside each run's own mount
    /// namespace, so every run can use the same one).
    root_dir: PathBuf,
    /// None when it could not be built: the probe then reports seccomp missing and runs are
    /// refused.
    seccomp: Option<Arc<SeccompProgram>>,
    egress: Option<egress::EgressSettings>,
    /// Removes finished runs' cgroups off the request path (None: each run removes its own).
    reaper: Option<reaper::Reaper>,
    /// Holds the kernel's `favordynmods` mode while the backend lives (see [`dynmods`]).
    _dynmods: Option<dynmods::FavorDynMods>,
    /// Where each run's own host uid comes from (a session's execs come with the session's).
    uids: Arc<UidRange>,
}

impl LocalSandbox {
    /// Probes the host and prepares cgroups. Never fails: what is missing is reported by
    /// [`Sandbox::status`] and makes runs fail closed with `Unavailable`. Without `egress`,
    /// egress profiles are refused.
    pub fn new(
        cgroup_name: &str,
        warm_slots: usize,
        favor_dynmods: bool,
        runtime_dir: &Path,
        egress: Option<egress::EgressSettings>,
        uids: Arc<UidRange>,
    ) -> Self {
        let mut probe = HostProbe::detect();
        let cgroups = match cgroup::detect(Path::new("/sys/fs/cgroup"), cgroup_name) {
            Ok(d) => {
                let swept = d.sweep_orphans();
                if swept > 0 {
                    tracing::warn!(swept, "removed run cgroups left by an earlier daemon");
                }
                probe.cgroup = Some(format!("{:?}", d.version()).to_lowercase());
                Some(Arc::<dyn CgroupDriver>::from(d))
            }
            Err(e) => {
                probe.cgroup_error = Some(e.to_string());
                None
            }
        };
        // Before the first slot is prepared: its joins are what the mode makes cheap. Only where
        // the host already has cgroup v1 hierarchies: on a cgroup v2 host a v1 hierarchy would
        // add a line to every process's /proc/<pid>/cgroup, which tools read to tell the
        // versions apart.
        let v1 = cgroups
            .as_ref()
            .is_some_and(|d| d.version() == cgroup::CgroupVersion::V1);
        let dynmods = (favor_dynmods && v1)
            .then(|| match dynmods::FavorDynMods::hold() {
                Ok(h) => {
                    tracing::info!("cgroup favordynmods mode held: cgroup joins wait for no RCU grace period");
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot hold the cgroup favordynmods mode: each cgroup join may stall forks host-wide for an RCU grace period");
                    None
                }
            })
            .flatten();
        let root_dir = runtime_dir.join("sandbox-root");
        if let Err(e) = std::fs::create_dir_all(&root_dir) {
            probe
                .cgroup_error
                .get_or_insert(format!("cannot create {}: {e}", root_dir.display()));
        }
        // Orphaned sandbox inits come back to us, not to the host's init (see child::ShimState).
        if let Err(e) = child::become_subreaper() {
            probe
                .cgroup_error
                .get_or_insert(format!("cannot become a child subreaper: {e}"));
        }
        let seccomp = match SeccompProgram::deny_list() {
            Ok(p) => Some(Arc::new(p)),
            Err(e) => {
                tracing::error!(error = %e, "the seccomp filter could not be built");
                probe.seccomp = false;
                None
            }
        };
        let warm = match (&cgroups, warm_slots) {
            (Some(driver), n) if n > 0 && probe.local_missing(1).is_empty() => {
                let w = Arc::new(WarmSlots::new(driver.clone(), n));
                w.refill();
                Some(w)
            }
            _ => None,
        };
        LocalSandbox {
            cgroups,
            warm,
            probe,
            root_dir,
            seccomp,
            egress,
            reaper: reaper::Reaper::start()
                .inspect_err(|e| tracing::warn!(error = %e, "no teardown thread: runs remove their own cgroups"))
                .ok(),
            _dynmods: dynmods,
            uids,
        }
    }

    pub fn probe(&self) -> &HostProbe {
        &self.probe
    }

    /// The minimal root of a run: its mounts and Landlock rules.
    /// Ends a finished run's life on the host: its cgroup is removed (which frees the memory its
    /// children ran on) and then the prepared slots are topped up. On the reaper's thread when
    /// it takes the work, so the caller's answer does not wait for it; here otherwise.
    async fn retire(&self, guard: CgroupGuard, refill: RefillOnDrop) -> Result<(), SandboxError> {
        let Some(reaper) = &self.reaper else {
            guard.finish().await?;
            drop(refill);
            return Ok(());
        };
        let runtime = tokio::runtime::Handle::current();
        // CgroupGuard's drop removes the cgroup (logging a failure) and releases the memory
        // only once it is gone; the refill needs the runtime to start its tasks.
        let teardown: reaper::Teardown = Box::new(move || {
            drop(guard);
            let _entered = runtime.enter();
            drop(refill);
        });
        if let Err(teardown) = reaper.submit(teardown) {
            tokio::task::spawn_blocking(teardown)
                .await
                .map_err(|e| SandboxError::Setup(format!("cgroup cleanup task: {e}")))?;
        }
        Ok(())
    }

    fn layout(&self, spec: &RunSpec) -> Result<PlanBuilder, SandboxError> {
        let handled = landlock::handled_fs(self.probe.landlock_abi);
        let mut b = PlanBuilder::new(&self.root_dir, handled);
        for p in &spec.fs.read_only {
            b.read_only(p)?;
        }
        b.scratch(
            &spec.fs.workdir,
            spec.fs.workspace.as_deref(),
            spec.limits.disk_bytes,
            spec.uid,
            spec.gid,
        )?;
        // After the tmpfs mounts: a file under /tmp or the workdir would otherwise be hidden by them.
        for (src, dst) in &spec.fs.extra_files {
            b.extra_file(src, dst)?;
        }
        b.proc()?;
        b.dev()?;
        b.rules.push(LandlockRule {
            path: c"/".into(),
            access: (landlock::Fs::from(AccessFs::ReadDir) & handled).bits(),
        });
        Ok(b)
    }

    /// The child plan of a run laid out as `b`. `join` lists the `cgroup.procs` files the shim
    /// joins (none when a prepared shim is in the cgroup already); `stacks` are the children's
    /// stacks.
    fn plan(
        &self,
        spec: &RunSpec,
        b: PlanBuilder,
        join: &[PathBuf],
        stacks: Arc<child::Stacks>,
        fds: PlanFds,
        extra_env: &[(String, String)],
    ) -> Result<ChildPlan, SandboxError> {
        let argv: Vec<CString> = spec
            .argv
            .iter()
            .map(|a| cstr(a))
            .collect::<Result<_, _>>()?;
        let envp: Vec<CString> = spec
            .env
            .iter()
            .filter(|(k, _)| !extra_env.iter().any(|(e, _)| e == *k))
            .chain(extra_env.iter().map(|(k, v)| (k, v)))
            .map(|(k, v)| cstr(&format!("{k}={v}")))
            .collect::<Result<_, _>>()?;
        let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|c| c.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|c| c.as_ptr()).collect();
        envp_ptrs.push(std::ptr::null());
        let program = argv
            .first()
            .cloned()
            .ok_or_else(|| SandboxError::Setup("empty argv".into()))?;

        Ok(ChildPlan {
            cgroup_procs: join
                .iter()
                .map(|p| path_cstr(p))
                .collect::<Result<_, _>>()?,
            root: path_cstr(&self.root_dir)?,
            root_options: c"size=1m,nr_inodes=4096,mode=0755".into(),
            mounts: b.ops,
            landlock_fd: fds.landlock,
            landlock_rules: b.rules,
            hostname: c"sandbox".into(),
            workdir: path_cstr(spec.fs.cwd.as_deref().unwrap_or(&spec.fs.workdir))?,
            rlimits: vec![
                (libc::RLIMIT_CORE, 0),
                (libc::RLIMIT_NOFILE, spec.limits.nofile),
                // A session's workspace is a tmpfs of the disk limit: a file past it is ENOSPC
                // there, as the caller expects, not SIGXFSZ one byte before.
                (
                    libc::RLIMIT_FSIZE,
                    match spec.fs.workspace {
                        Some(_) => spec.limits.disk_bytes.saturating_add(1 << 20),
                        None => spec.limits.disk_bytes,
                    },
                ),
                // No RLIMIT_NPROC: it counts every process of the uid on the host, and a uid of
                // the block may be held by a process this run does not know (a leftover of a
                // killed daemon, another user of the range). The run's pids cgroup, joined before
                // anything forks, is the bound.
            ],
            uid: spec.uid,
            gid: spec.gid,
            seccomp: self
                .seccomp
                .as_ref()
                .ok_or_else(|| SandboxError::Unavailable("seccomp filter missing".into()))?
                .fprogs()
                .to_vec(),
            program,
            argv_ptrs,
            envp_ptrs,
            status_fd: fds.status,
            stdio: fds.stdio,
            hello_fd: fds.hello,
            stacks,
            shim_state: Default::default(),
            sync_fd: fds.sync,
            passed_fds: fds.passed(),
            keep_fds: {
                let mut k = fds.passed();
                k.sort_unstable();
                k
            },
            _argv: argv,
            _envp: envp,
        })
    }
}

fn cstr(s: &str) -> Result<CString, SandboxError> {
    CString::new(s).map_err(|_| SandboxError::Setup("NUL byte in argument or environment".into()))
}

fn path_cstr(p: &Path) -> Result<CString, SandboxError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| SandboxError::Setup("NUL byte in path".into()))
}

/// Builds the mount list and Landlock rules of the minimal root: `host_rules` for host inodes
/// the sandbox sees (added to the ruleset before the clone), `rules` for mounts made inside it
/// (added by the child).
struct PlanBuilder {
    root: PathBuf,
    handled: landlock::Fs,
    made: BTreeSet<PathBuf>,
    bound: Vec<PathBuf>,
    ops: Vec<MountOp>,
    host_rules: Vec<landlock::HostRule>,
    rules: Vec<LandlockRule>,
}

impl PlanBuilder {
    fn new(root: &Path, handled: landlock::Fs) -> Self {
        PlanBuilder {
            root: root.to_path_buf(),
            handled,
            made: BTreeSet::new(),
            bound: Vec::new(),
            ops: Vec::new(),
            host_rules: Vec::new(),
            rules: Vec::new(),
        }
    }

    /// `/a/b` inside the sandbox -> `<root>/a/b`; refuses relative paths and `..`.
    fn inside(&self, p: &Path) -> Result<PathBuf, SandboxError> {
        let mut out = self.root.clone();
        let mut comps = p.components();
        if comps.next() != Some(Component::RootDir) {
            return Err(SandboxError::Setup(format!(
                "sandbox path {} is not absolute",
                p.display()
            )));
        }
        for c in comps {
            match c {
                Component::Normal(n) => out.push(n),
                _ => {
                    return Err(SandboxError::Setup(format!(
                        "sandbox path {} is not normal",
                        p.display()
                    )));
                }
            }
        }
        Ok(out)
    }

    fn mkdirs(&mut self, p: &Path) -> Result<(), SandboxError> {
        let mut cur = PathBuf::from("/");
        for c in p.components().skip(1) {
            cur.push(c);
            if self.made.insert(cur.clone()) {
                let full = self.inside(&cur)?;
                self.ops.push(MountOp::Mkdir(path_cstr(&full)?));
            }
        }
        Ok(())
    }

    fn covered(&self, p: &Path) -> bool {
        self.bound.iter().any(|b| p.starts_with(b))
    }

    /// The part of `access` the ruleset handles (directory rights dropped for a file).
    fn handled(&self, access: landlock::Fs, is_file: bool) -> landlock::Fs {
        let mask = if is_file {
            landlock::file_rights()
        } else {
            landlock::Fs::all()
        };
        access & self.handled & mask
    }

    /// A rule for `host`, a host path the sandbox sees through a bind mount.
    fn host_rule(&mut self, host: &Path, access: landlock::Fs, is_file: bool) {
        let access = self.handled(access, is_file);
        if !access.is_empty() {
            self.host_rules.push(landlock::HostRule {
                path: host.to_path_buf(),
                access,
            });
        }
    }

    /// A rule for `p` inside the sandbox, a mount made there.
    fn rule(&mut self, p: &Path, access: landlock::Fs) -> Result<(), SandboxError> {
        let access = self.handled(access, false);
        if !access.is_empty() {
            self.rules.push(LandlockRule {
                path: path_cstr(p)?,
                access: access.bits(),
            });
        }
        Ok(())
    }

    fn read_only(&mut self, p: &Path) -> Result<(), SandboxError> {
        if self.covered(p) {
            return Ok(());
        }
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            return Ok(()); // a profile path this host does not have
        };
        if let Some(parent) = p.parent() {
            self.mkdirs(parent)?;
        }
        let dst = path_cstr(&self.inside(p)?)?;
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(p)?;
            self.made.insert(p.to_path_buf());
            self.ops.push(MountOp::Symlink {
                target: path_cstr(&target)?,
                link: dst,
            });
            return Ok(());
        }
        if meta.is_dir() {
            self.made.insert(p.to_path_buf());
            self.ops.push(MountOp::Mkdir(dst.clone()));
        } else {
            self.ops.push(MountOp::TouchFile(dst.clone()));
        }
        self.host_rule(p, landlock::read_only(), !meta.is_dir());
        self.ops.push(MountOp::BindReadOnly {
            src: path_cstr(p)?,
            dst,
        });
        self.bound.push(p.to_path_buf());
        Ok(())
    }

    fn extra_file(&mut self, src: &Path, dst: &Path) -> Result<(), SandboxError> {
        if self.covered(dst) {
            // Already visible through a read-only path of the profile.
            return Ok(());
        }
        if let Some(parent) = dst.parent() {
            self.mkdirs(parent)?;
        }
        let inside = path_cstr(&self.inside(dst)?)?;
        self.ops.push(MountOp::TouchFile(inside.clone()));
        self.ops.push(MountOp::BindReadOnly {
            src: path_cstr(src)?,
            dst: inside,
        });
        self.host_rule(src, AccessFs::ReadFile | AccessFs::Execute, true);
        Ok(())
    }

    /// The writable space of the run: ONE tmpfs of `disk` bytes whose `tmp` and `work` subdirs
    /// are bound at /tmp and the workdir, so the disk limit covers both together (two tmpfs of
    /// `disk` bytes each would let a run write twice its limit). The tmpfs is mounted at a staging
    /// directory of the new root and detached again once both binds hold it. A session's
    /// `workspace` (a host directory with a tmpfs of its own) is bound at the workdir instead.
    fn scratch(
        &mut self,
        workdir: &Path,
        workspace: Option<&Path>,
        disk: u64,
        uid: u32,
        gid: u32,
    ) -> Result<(), SandboxError> {
        let stage = self.root.join(".executor-arm-scratch");
        let stage_c = path_cstr(&stage)?;
        self.ops.push(MountOp::Mkdir(stage_c.clone()));
        let options = cstr(&format!("size={disk},nr_inodes=16384,mode=0700"))?;
        self.ops.push(MountOp::Tmpfs {
            dst: stage_c.clone(),
            options,
            noexec: true,
        });
        // /tmp first: a workdir below /tmp then gets its mount point inside the bound /tmp.
        let tmp = Path::new("/tmp");
        if workdir != tmp {
            self.bind_scratch(&stage.join("tmp"), tmp, 0o1777, 0, 0)?;
        }
        match workspace {
            Some(host) => {
                self.mkdirs(workdir)?;
                let dst = path_cstr(&self.inside(workdir)?)?;
                let src = path_cstr(host)?;
                self.ops.push(MountOp::BindWritable { src, dst });
                self.host_rule(host, landlock::Fs::all(), false);
            }
            None => self.bind_scratch(&stage.join("work"), workdir, 0o700, uid, gid)?,
        }
        self.ops.push(MountOp::Detach(stage_c));
        Ok(())
    }

    fn bind_scratch(
        &mut self,
        src: &Path,
        p: &Path,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<(), SandboxError> {
        let src = path_cstr(src)?;
        self.ops.push(MountOp::MkdirOwned {
            path: src.clone(),
            mode,
            uid,
            gid,
        });
        self.mkdirs(p)?;
        let dst = path_cstr(&self.inside(p)?)?;
        self.ops.push(MountOp::BindWritable { src, dst });
        self.rule(p, landlock::Fs::all())
    }

    fn proc(&mut self) -> Result<(), SandboxError> {
        let p = Path::new("/proc");
        self.mkdirs(p)?;
        self.ops.push(MountOp::Proc(path_cstr(&self.inside(p)?)?));
        self.rule(p, AccessFs::ReadFile | AccessFs::ReadDir)
    }

    fn dev(&mut self) -> Result<(), SandboxError> {
        self.mkdirs(Path::new("/dev"))?;
        for name in ["null", "zero", "random", "urandom"] {
            let p = PathBuf::from("/dev").join(name);
            let dst = path_cstr(&self.inside(&p)?)?;
            self.ops.push(MountOp::TouchFile(dst.clone()));
            self.ops.push(MountOp::BindDevice {
                src: path_cstr(&p)?,
                dst,
            });
            let rw =
                AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate | AccessFs::IoctlDev;
            self.host_rule(&p, rw, true);
        }
        for (name, target) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ] {
            let link = path_cstr(&self.inside(&Path::new("/dev").join(name))?)?;
            self.ops.push(MountOp::Symlink {
                target: cstr(target)?,
                link,
            });
        }
        Ok(())
    }
}

impl Drop for LocalSandbox {
    /// At exit (the runtime drops the daemon's state): remove this daemon's empty cgroup owner
    /// directories, so a clean shutdown leaves nothing for the next start to sweep.
    fn drop(&mut self) {
        // Finished runs' cgroups, then prepared slots: they live in the owner directories.
        if let Some(r) = &self.reaper {
            r.close();
        }
        if let Some(w) = &self.warm {
            w.drain();
        }
        if let Some(d) = &self.cgroups {
            d.release();
        }
    }
}

/// Kills and removes the run's cgroup however the run ends (including a dropped future), and
/// only then releases the plan: the sandbox's children run on the plan's stacks, in memory shared
/// with the daemon, until they are gone, and an empty cgroup is the proof that they are.
struct CgroupGuard {
    cg: Option<Box<dyn RunCgroup>>,
    keep: Pinned,
}

/// Memory the sandbox's children may use until they are gone (plan, stacks, prepared shim).
type Keepalive = Arc<dyn std::any::Any + Send + Sync>;

impl CgroupGuard {
    fn new(cg: Box<dyn RunCgroup>) -> Self {
        CgroupGuard {
            cg: Some(cg),
            keep: Pinned::default(),
        }
    }

    fn get(&self) -> &dyn RunCgroup {
        self.cg.as_deref().expect("cgroup present until finish")
    }

    fn get_mut(&mut self) -> &mut dyn RunCgroup {
        self.cg.as_deref_mut().expect("cgroup present until finish")
    }

    fn keep(&mut self, k: Keepalive) {
        self.keep.0.push(k);
    }

    async fn finish(mut self) -> Result<(), SandboxError> {
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

/// A run slot prepared ahead: a cgroup with a shim already in it, waiting for its plan.
struct Slot {
    guard: CgroupGuard,
    shim: Arc<child::WarmShim>,
    /// Our end of the go socket; dropping it unused makes the shim exit.
    go: OwnedFd,
    /// Resolves once the shim has exited.
    exited: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Keeps `target` slots prepared. Joining a cgroup (a `cgroup.procs` write) waits for an RCU
/// grace period after an idle spell, tens of milliseconds on some hosts; a prepared slot has paid
/// it before its run arrives, and creating the cgroup is off the request path too.
struct WarmSlots {
    driver: Arc<dyn CgroupDriver>,
    target: usize,
    ready: std::sync::Mutex<std::collections::VecDeque<Slot>>,
    /// Slots being prepared right now.
    pending: std::sync::atomic::AtomicUsize,
    seq: std::sync::atomic::AtomicU64,
    closed: std::sync::atomic::AtomicBool,
}

impl WarmSlots {
    fn new(driver: Arc<dyn CgroupDriver>, target: usize) -> Self {
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
    fn take(&self) -> Option<Slot> {
        self.ready.lock().ok()?.pop_front()
    }

    /// Starts preparing slots until `target` are ready or on their way (needs a runtime).
    fn refill(self: &Arc<Self>) {
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
    fn drain(&self) {
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
struct RefillOnDrop(Option<Arc<WarmSlots>>);

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

/// Descriptors the child inherits (-1: none).
struct PlanFds {
    status: i32,
    landlock: i32,
    sync: i32,
    hello: i32,
    stdio: [i32; 3],
}

impl PlanFds {
    fn passed(&self) -> Vec<i32> {
        child::passed_fds(
            self.status,
            self.stdio,
            self.landlock,
            self.sync,
            self.hello,
        )
    }
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
fn send_go(go: &OwnedFd, fds: &[i32]) -> Result<(), SandboxError> {
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

/// The status pipe: non-blocking, read once after the sandbox is gone.
fn status_pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    pipe(libc::O_CLOEXEC | libc::O_NONBLOCK)
}

fn dev_null() -> Result<OwnedFd, SandboxError> {
    Ok(std::fs::File::open("/dev/null")?.into())
}

/// Reads the shim's host pid from the hello pipe.
async fn read_pid(r: OwnedFd) -> std::io::Result<u32> {
    let mut r = tokio::net::unix::pipe::Receiver::from_owned_fd(r)?;
    let mut b = [0u8; 4];
    r.read_exact(&mut b).await?;
    Ok(u32::from_le_bytes(b))
}

fn pipe(flags: libc::c_int) -> Result<(OwnedFd, OwnedFd), SandboxError> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two fds into the array we pass.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), flags) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The record that decides the run: a setup error if any process wrote one, else the last record.
/// The command process reports its own setup failures (rlimits, setuid, Landlock, seccomp, exec)
/// and `_exit`s 126; init then reports that exit. Taking the last record would turn a sandbox
/// that failed to start into an ordinary command exiting 126.
fn read_status(fd: &OwnedFd) -> Option<[u8; child::RECORD_LEN]> {
    let mut buf = [0u8; 64];
    // SAFETY: read into a stack buffer of the given size (the fd is non-blocking).
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < child::RECORD_LEN as isize {
        return None;
    }
    pick_record(&buf[..n as usize])
}

/// The setup failure a sandbox process reported, if any.
fn setup_error(fd: &OwnedFd) -> Option<SandboxError> {
    match read_status(fd)? {
        [child::TAG_SETUP_ERROR, stage, _, _, a, b, c, d] => {
            Some(setup_failure(stage, [a, b, c, d]))
        }
        _ => None,
    }
}

fn setup_failure(stage: u8, errno: [u8; 4]) -> SandboxError {
    SandboxError::Setup(format!(
        "{}: {}",
        child::Stage::from_u8(stage),
        std::io::Error::from_raw_os_error(i32::from_le_bytes(errno))
    ))
}

fn pick_record(bytes: &[u8]) -> Option<[u8; child::RECORD_LEN]> {
    let records = bytes.chunks_exact(child::RECORD_LEN);
    let chosen = records
        .clone()
        .find(|r| r[0] == child::TAG_SETUP_ERROR)
        .or_else(|| records.last())?;
    let mut rec = [0u8; child::RECORD_LEN];
    rec.copy_from_slice(chosen);
    Some(rec)
}

#[async_trait::async_trait]
impl Sandbox for LocalSandbox {
    fn kind(&self) -> BackendKind {
        BackendKind::Local
    }

    fn supports_egress(&self) -> bool {
        self.egress.is_some()
    }

    async fn status(&self) -> BackendStatus {
        let missing = self.probe.local_missing(1);
        BackendStatus {
            backend: BackendKind::Local,
            ready: missing.is_empty(),
            detail: if missing.is_empty() {
                format!(
                    "cgroup {}, landlock abi {}, seccomp, namespaces",
                    self.probe.cgroup.as_deref().unwrap_or("?"),
                    self.probe.landlock_abi
                )
            } else {
                format!("missing: {}", missing.join(", "))
            },
        }
    }

    async fn run(&self, mut spec: RunSpec) -> Result<RunOutcome, SandboxError> {
        // Fail closed: refuse before anything starts when a mechanism is missing.
        let missing = self.probe.local_missing(spec.landlock_abi);
        if !missing.is_empty() {
            return Err(SandboxError::Unavailable(format!(
                "local sandbox lacks {}",
                missing.join(", ")
            )));
        }
        // A host uid of the run's own, held until the run is over (its processes are gone by
        // then: pid 1's exit killed the namespace). A session's exec comes with the uid the
        // session holds for its life, which owns its workspace.
        let _uid = match spec.fs.workspace {
            Some(_) => None,
            None => {
                let uids = self.uids.clone();
                let lease = tokio::task::spawn_blocking(move || uids.lease())
                    .await
                    .map_err(|e| SandboxError::Setup(format!("uid lease task: {e}")))??;
                spec.uid = lease.uid();
                Some(lease)
            }
        };
        let egress_settings = run::egress_for(&spec.network, self.egress.as_ref())?.cloned();
        let driver = self
            .cgroups
            .as_ref()
            .ok_or_else(|| SandboxError::Unavailable("cgroups".into()))?;
        let limits = spec.limits.clone();
        // A slot whose shim is gone (it could not join its cgroup) is dropped, and the run
        // prepares its cgroup on demand.
        let slot = self
            .warm
            .as_ref()
            .and_then(|w| w.take())
            .filter(|s| !s.exited.is_finished());
        // Replace the slot once this run's cgroup is gone, not now: a new slot's shim joins its
        // cgroup holding the kernel's cgroup mutex for a grace period, which would stall this
        // run's own cgroup work (rename, limits, removal) behind it. Declared before the guard,
        // so it acts after the guard's removal on every path.
        let refill = RefillOnDrop(self.warm.clone());
        // The child's ends of the run's pipes, declared before the guard so that on every early
        // return the run is killed before their numbers are freed: a shim started for the run
        // copies our fd table when it is cloned, on another thread.
        let mut child_ends_slot;
        let (mut guard, warm) = match slot {
            Some(mut slot) => {
                let cg = slot.guard.get_mut();
                cg.rename(&spec.exec_id);
                cg.apply_limits(&limits)?;
                (slot.guard, Some((slot.shim, slot.go, slot.exited)))
            }
            None => {
                let driver = driver.clone();
                let (id, l) = (spec.exec_id.clone(), limits.clone());
                let cg = tokio::task::spawn_blocking(move || driver.create(&id, &l))
                    .await
                    .map_err(|e| SandboxError::Setup(format!("cgroup task: {e}")))??;
                (CgroupGuard::new(cg), None)
            }
        };

        let layout = self.layout(&spec)?;
        let landlock_fd = if self.probe.landlock_abi > 0 {
            // TCP is always handled: no rule at all without egress, connect to the proxy port only
            // with it.
            let port = egress_settings.as_ref().map(|e| e.port);
            Some(landlock::ruleset(
                self.probe.landlock_abi,
                port,
                &layout.host_rules,
            )?)
        } else {
            None
        };
        let (status_r, status_w) = status_pipe()?;
        // With egress: the go-signal pipe (blocking: pid 1 waits on it) and the hello pipe that
        // tells us the shim's pid once its namespaces exist.
        let (sync, hello) = match &egress_settings {
            Some(_) => (Some(pipe(libc::O_CLOEXEC)?), Some(pipe(libc::O_CLOEXEC)?)),
            None => (None, None),
        };
        let (stdin_child, stdin_ours) = match &spec.stdin {
            Some(_) => {
                let (r, w) = pipe(libc::O_CLOEXEC)?;
                (r, Some(w))
            }
            None => (dev_null()?, None),
        };
        let (stdout_ours, stdout_child) = pipe(libc::O_CLOEXEC)?;
        let (stderr_ours, stderr_child) = pipe(libc::O_CLOEXEC)?;
        let extra_env = egress_settings
            .as_ref()
            .map(|e| crate::egress::proxy_env(e.port))
            .unwrap_or_default();
        let fds = PlanFds {
            status: status_w.as_raw_fd(),
            landlock: landlock_fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1),
            sync: sync.as_ref().map(|(r, _)| r.as_raw_fd()).unwrap_or(-1),
            hello: hello.as_ref().map(|(_, w)| w.as_raw_fd()).unwrap_or(-1),
            stdio: [
                stdin_child.as_raw_fd(),
                stdout_child.as_raw_fd(),
                stderr_child.as_raw_fd(),
            ],
        };
        let (join, stacks) = match &warm {
            Some((shim, _, _)) => (Vec::new(), shim.stacks().clone()),
            None => (guard.get().procs_files(), Arc::new(child::Stacks::new()?)),
        };
        let plan = Arc::new(self.plan(&spec, layout, &join, stacks, fds, &extra_env)?);
        guard.keep(plan.clone());
        // The seccomp program the command installs lives in it until its execve.
        if let Some(s) = &self.seccomp {
            guard.keep(s.clone());
        }
        let (sync_r, sync_w) = sync.unzip();
        let (hello_r, hello_w) = hello.unzip();
        // The child's ends stay open until the shim is gone: the shim copies the fd table when it
        // is cloned, which happens on another thread (a prepared one gets them with its go byte).
        child_ends_slot = Some((
            status_w,
            landlock_fd,
            stdin_child,
            stdout_child,
            stderr_child,
            sync_r,
            hello_w,
        ));

        let start = Instant::now();
        let mut exited = match warm {
            Some((shim, go, exited)) => {
                shim.arm(&plan);
                send_go(&go, &plan.passed_fds)?;
                exited
            }
            None => tokio::task::spawn_blocking(move || {
                // SAFETY: the guard keeps the plan (and the stacks the children run on) alive
                // until the run's cgroup is empty.
                unsafe { plan.spawn_and_wait() }
            }),
        };
        // With egress: bind the proxy inside the sandbox's network namespace, then let the
        // command start. Dropping the pipe without the byte makes the sandbox give up.
        let egress_run = match (egress_settings, sync_w, hello_r) {
            (Some(settings), Some(sync_w), Some(hello_r)) => {
                let pid = tokio::select! {
                    pid = read_pid(hello_r) => pid.map_err(|e| {
                        SandboxError::Setup(format!("sandbox pid for egress setup: {e}"))
                    })?,
                    _ = &mut exited => {
                        return Err(setup_error(&status_r).unwrap_or_else(|| {
                            SandboxError::Setup("sandbox exited before egress setup".into())
                        }));
                    }
                };
                let run = egress::start(&settings, &spec.network, pid)
                    .map_err(|e| SandboxError::Setup(format!("egress proxy: {e}")))?;
                // SAFETY: write(2) of one byte from a static buffer to a pipe we own.
                if unsafe { libc::write(sync_w.as_raw_fd(), b"1".as_ptr().cast(), 1) } != 1 {
                    return Err(SandboxError::Setup(format!(
                        "egress go-signal: {}",
                        std::io::Error::last_os_error()
                    )));
                }
                Some(run)
            }
            _ => None,
        };

        let mut output = OutputCapture::start(
            upipe::Receiver::from_owned_fd(stdout_ours)?,
            upipe::Receiver::from_owned_fd(stderr_ours)?,
            limits.output_bytes,
            limits.on_overflow,
            spec.output_tap.clone(),
        );
        let stdin_task = match (stdin_ours, spec.stdin.clone()) {
            (Some(w), Some(data)) => Some(tokio::spawn(async move {
                let mut w = match upipe::Sender::from_owned_fd(w) {
                    Ok(w) => w,
                    Err(_) => return false,
                };
                let r = w.write_all(&data).await;
                drop(w);
                matches!(r, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
            })),
            _ => None,
        };

        let mut spawn_result = None;
        let terminate = || async {
            let cg = guard.get();
            let sent = tokio::task::block_in_place(|| cgroup::terminate_command(cg));
            tracing::debug!(exec_id = %spec.exec_id, processes = sent, "SIGTERM before the stop's grace");
        };
        let waited = run::wait(
            &mut exited,
            limits.timeout,
            spec.stop.as_ref(),
            &mut output,
            terminate,
        )
        .await;
        let killed = match waited {
            Waited::Ended(r) => {
                spawn_result = Some(r);
                None
            }
            Waited::EndedOnStop(r, reason) => {
                spawn_result = Some(r);
                Some(reason)
            }
            Waited::Kill(reason) => Some(reason),
        };
        if spawn_result.is_none() {
            let cg = guard.get();
            // Kill every process of the run, setsid'd and double-forked ones included, and keep
            // at it until the shim is gone: a shim still on its way into the cgroup (a slow
            // join) is not there for the first kill.
            spawn_result = Some(loop {
                if let Err(e) = tokio::task::block_in_place(|| cg.kill_all()) {
                    tracing::error!(error = %e, "kill_all after limit");
                }
                tokio::select! {
                    r = &mut exited => break r,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            });
        }
        drop(child_ends_slot.take());
        match spawn_result {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(e))) => return Err(SandboxError::Setup(format!("clone: {e}"))),
            Some(Err(e)) => return Err(SandboxError::Setup(format!("spawning thread: {e}"))),
            // Every branch above has awaited the spawning thread.
            None => {}
        }
        let duration = start.elapsed();
        // The shim exits only after pid 1 of the sandbox did, which kills the whole namespace;
        // kill the cgroup anyway in case something escaped the namespace but not the cgroup.
        let cg = guard.get();
        if !cg.is_empty() {
            let _ = tokio::task::block_in_place(|| cg.kill_all());
        }

        let captured = output.drain().await;
        let stdin_broken_pipe = match stdin_task {
            Some(t) => t.await.unwrap_or(false),
            None => false,
        };
        let network = run::connections(egress_run).await;
        let record = read_status(&status_r);
        let stats = cg.stats();
        self.retire(guard, refill).await?;

        let exit = match record {
            Some([child::TAG_SETUP_ERROR, stage, _, _, a, b, c, d]) => {
                return Err(setup_failure(stage, [a, b, c, d]));
            }
            Some([child::TAG_EXITED, _, _, _, a, b, c, d]) => {
                ExitKind::Exited(i32::from_le_bytes([a, b, c, d]))
            }
            Some([child::TAG_SIGNALED, _, _, _, a, b, c, d]) => {
                ExitKind::Signaled(i32::from_le_bytes([a, b, c, d]))
            }
            _ => ExitKind::Killed,
        };
        let ending = Ending {
            exit,
            killed,
            oom: stats.oom_kills > 0,
            pids_max_hits: stats.pids_max_hits,
            peak_memory_kib: stats.peak_memory_kib,
            stdin_broken_pipe,
        };
        Ok(RunOutcome::assemble(ending, captured, duration, network))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::KilledReason;

    fn rec(tag: u8, stage: u8, v: i32) -> [u8; child::RECORD_LEN] {
        let b = v.to_le_bytes();
        [tag, stage, 0, 0, b[0], b[1], b[2], b[3]]
    }

    #[test]
    fn a_setup_error_wins_over_the_exit_it_caused() {
        let err = rec(
            child::TAG_SETUP_ERROR,
            child::Stage::Exec as u8,
            libc::EAGAIN,
        );
        let exit = rec(child::TAG_EXITED, 0, 126);
        assert_eq!(pick_record(&[err, exit].concat()), Some(err));
        assert_eq!(pick_record(&exit), Some(exit));
        let sig = rec(child::TAG_SIGNALED, 0, libc::SIGKILL);
        assert_eq!(pick_record(&[exit, sig].concat()), Some(sig));
        // A torn trailing record is ignored; nothing at all is None.
        assert_eq!(pick_record(&[&exit[..], &[1, 2, 3]].concat()), Some(exit));
        assert_eq!(pick_record(&[]), None);
    }

    fn sleep_spec(id: &str, timeout: Duration) -> RunSpec {
        let base = crate::sandbox::test_spec(&["/bin/sleep", "4"]);
        RunSpec {
            exec_id: id.into(),
            limits: crate::sandbox::Limits {
                cpus: 1.0,
                memory_bytes: 256 << 20,
                disk_bytes: 16 << 20,
                timeout,
                output_bytes: 1 << 16,
                ..base.limits.clone()
            },
            fs: crate::sandbox::FsRules {
                read_only: ["/usr", "/bin", "/lib", "/lib64", "/etc"]
                    .iter()
                    .map(PathBuf::from)
                    .collect(),
                ..base.fs.clone()
            },
            profile: "t".into(),
            ..base
        }
    }

    /// A wall clock that fires before a prepared shim has joined its cgroup (1 ms, freshly
    /// prepared slots) still kills the run: the kill is repeated until the shim is gone, so
    /// `sleep 4` never gets to exit 0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs root (namespaces, cgroups): scripts/test-all.sh runs it as root"]
    async fn a_wall_clock_that_fires_before_the_shim_joined_still_kills_the_run() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        let dir = tempfile::tempdir().unwrap();
        let uids = Arc::new(UidRange::new(300_000, 64, &dir.path().join("uids")).unwrap());
        let sb = LocalSandbox::new("executor-arm", 4, false, dir.path(), None, uids);
        assert!(sb.probe.local_missing(1).is_empty(), "{:?}", sb.probe);
        for i in 0..12 {
            let o = sb
                .run(sleep_spec(&format!("unit-{i}"), Duration::from_millis(1)))
                .await
                .expect("run");
            assert_ne!(
                o.exit,
                ExitKind::Exited(0),
                "run {i} escaped its wall clock"
            );
            assert_eq!(o.killed_reason, Some(KilledReason::Timeout), "run {i}");
        }
    }
}
