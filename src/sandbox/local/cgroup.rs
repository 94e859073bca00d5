//! Per-run cgroups, v1 and v2 behind one small trait.
//!
//! Owns: creating a run's cgroup with memory (no swap beyond it), cpu quota and pids limits,
//! killing every process in it, reading peak memory / OOM / pids events, and removing it.
//! Must not: decide limits (the policy layer does) or spawn anything.
//!
//! Run cgroups are limited, listed, frozen, killed and removed through `cgroups-rs`,
//! on the directories [`detect`] chose (never the hierarchies the crate would find itself).
//! What stays written by hand says why above it: the daemon's own directories and the v2
//! delegation, creating a run's directories, the memory statistics, renaming a prepared cgroup,
//! and the orphan sweep; joining a cgroup from the vfork child is in `child.rs`. Both drivers
//! work on a root directory, so their logic is unit-tested against a fake tree.

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cgroups_rs::cpu::CpuController;
use cgroups_rs::freezer::FreezerController;
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::{Cgroup, ControllIdentifier, Controller, Hierarchy, MaxValue, Subsystem};

use crate::sandbox::Limits;

/// Statistics read from a run's cgroup after it ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupStats {
    pub peak_memory_kib: Option<u64>,
    pub oom_kills: u64,
    pub pids_max_hits: u64,
}

/// One run's cgroup (in every hierarchy it spans).
pub trait RunCgroup: Send + Sync {
    /// `cgroup.procs` files the child writes "0" into to join before it forks anything.
    fn procs_files(&self) -> Vec<PathBuf>;
    /// Kills every process in the cgroup and waits (bounded) until it is empty.
    fn kill_all(&self) -> io::Result<()>;
    /// Host pids of the processes in the cgroup now.
    fn pids(&self) -> Vec<i32>;
    fn stats(&self) -> CgroupStats;
    /// Whether any process is left.
    fn is_empty(&self) -> bool;
    /// Removes the cgroup directories; kills first if anything is left.
    fn remove(&self) -> io::Result<()>;
    /// Sets memory (no swap beyond it), cpu quota and pids limits.
    fn apply_limits(&self, limits: &Limits) -> io::Result<()>;
    /// Renames the cgroup (a prepared one, once it knows its run). cgroup v1 only: v2 has no
    /// rename, so there the name stays. Best effort: a hierarchy that refuses keeps its name.
    fn rename(&mut self, name: &str);
}

/// Creates run cgroups.
pub trait CgroupDriver: Send + Sync {
    fn version(&self) -> CgroupVersion;
    fn create(&self, exec_id: &str, limits: &Limits) -> io::Result<Box<dyn RunCgroup>> {
        let run = self.create_empty(exec_id)?;
        if let Err(e) = run.apply_limits(limits) {
            let _ = run.remove();
            return Err(e);
        }
        Ok(run)
    }
    /// Creates the cgroup without setting limits (a prepared slot; limits come with its run).
    fn create_empty(&self, name: &str) -> io::Result<Box<dyn RunCgroup>>;
    /// Removes run cgroups left behind by a crashed daemon.
    fn sweep_orphans(&self) -> usize;
    /// Removes this daemon's (empty) owner directories at exit; a run still present keeps them.
    fn release(&self);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    V1,
    V2,
}

/// Writes a cgroup interface file (the hand-written parts only). `create` is harmless on
/// cgroupfs (files exist or the open fails) and lets the unit tests run the same code against a
/// plain directory tree.
fn write_file(path: &Path, value: &str) -> io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    f.write_all(value.as_bytes())
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn keyed_value(path: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next()?.parse().ok())
            .flatten()
    })
}

/// Processes listed in `dir/cgroup.procs`. Read by hand for the orphan sweep and the daemon's
/// move into its leaf, which work on directories rather than on run cgroups.
fn procs_of(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

fn kill_pids(pids: &[i32]) {
    for &pid in pids {
        if pid > 0 {
            // SAFETY: kill(2) with a positive pid read from the run's own cgroup; no memory involved.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Sends SIGTERM to every process of the run's command: those in the cgroup that live in the
/// sandbox's pid namespace, except its init (which would ignore it anyway). The shim, in the
/// host's namespace, is left alone: its end is how the daemon learns that the sandbox is gone.
/// Returns how many processes were signalled.
pub fn terminate_command(cg: &dyn RunCgroup) -> usize {
    cg.pids()
        .into_iter()
        .filter(|&pid| pid > 0 && terminate_member(cg, pid))
        .count()
}

/// SIGTERM to `pid` if it is a process of the run's command. A pidfd fixes which process the
/// pid names before the checks: if that process exits and its pid is reused by a process outside
/// the run before the signal, the signal fails (ESRCH) instead of reaching the newcomer. Without
/// pidfds (Linux < 5.3) a plain kill(2) after the checks.
fn terminate_member(cg: &dyn RunCgroup, pid: i32) -> bool {
    // SAFETY: pidfd_open(2) takes a pid and flags and touches no memory of ours.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let member = || cg.pids().contains(&pid) && in_child_namespace_not_init(pid);
    if raw < 0 {
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS) || !member() {
            return false;
        }
        // SAFETY: kill(2) with a positive pid just read from the run's own cgroup.
        return unsafe { libc::kill(pid, libc::SIGTERM) } == 0;
    }
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    // Checked after the pidfd exists: a member now is the process the pidfd names, or that
    // process is gone and the signal below fails.
    if !member() {
        return false;
    }
    // SAFETY: pidfd_send_signal(2) on our own pidfd, with no siginfo (null) and no flags.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGTERM,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        ) == 0
    }
}

/// Whether `pid` lives in a pid namespace below ours and is not that namespace's init, from the
/// `NSpid` line of its status (one pid per namespace level, ours first).
fn in_child_namespace_not_init(pid: i32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|ids| {
            let ids: Vec<&str> = ids.split_whitespace().collect();
            ids.len() >= 2 && ids.last() != Some(&"1")
        })
        .unwrap_or(false)
}

/// Repeats `kill_once` until the cgroup is empty, for at most two seconds.
fn kill_until_empty(cg: &dyn RunCgroup, mut kill_once: impl FnMut()) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        kill_once();
        if cg.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::other("cgroup not empty after kill"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// rmdir with a short retry: a cgroup is removable only once its last task is fully gone. Used
/// by the orphan sweep of cgroup v1 (hand-written, see [`V1Driver::sweep_orphans`]).
fn rmdir_retry(dir: &Path) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    }
}

/// CFS quota in microseconds per 100 ms period (at least 1 ms).
fn cpu_quota(limits: &Limits) -> u64 {
    (limits.cpus * 100_000.0).round().max(1000.0) as u64
}

fn valid_run_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

// ---------------------------------------------------------------------------------------------
// cgroups-rs plumbing

/// The directories the crate works in: one per controller, as our drivers laid them out. The
/// crate's own hierarchies are not used: `V1` takes every mounted hierarchy from
/// /proc/self/mountinfo (a run would get a directory in each), `V2` is fixed to /sys/fs/cgroup,
/// and neither can run on a plain directory tree.
#[derive(Debug, Clone)]
struct Dirs {
    v2: bool,
    memory: PathBuf,
    cpu: PathBuf,
    pids: PathBuf,
    /// cgroup v1 only (v2 freezes through `cgroup.freeze`; we kill with `cgroup.kill`).
    freezer: Option<PathBuf>,
}

impl Dirs {
    fn unified(dir: &Path) -> Self {
        Dirs {
            v2: true,
            memory: dir.to_path_buf(),
            cpu: dir.to_path_buf(),
            pids: dir.to_path_buf(),
            freezer: None,
        }
    }
}

impl Hierarchy for Dirs {
    fn v2(&self) -> bool {
        self.v2
    }

    fn subsystems(&self) -> Vec<Subsystem> {
        let mut subs = vec![
            Subsystem::Mem(MemController::new(self.memory.clone(), self.v2)),
            Subsystem::Cpu(CpuController::new(self.cpu.clone(), self.v2)),
            Subsystem::Pid(PidController::new(self.pids.clone(), self.v2)),
        ];
        if let Some(f) = &self.freezer {
            subs.push(Subsystem::Freezer(FreezerController::new(
                f.clone(),
                self.v2,
            )));
        }
        subs
    }

    fn root(&self) -> PathBuf {
        self.memory.clone()
    }

    fn root_control_group(&self) -> Cgroup {
        Cgroup::load(Box::new(self.clone()), "")
    }

    fn parent_control_group(&self, path: &str) -> Cgroup {
        let parent = Path::new(path).parent().unwrap_or(Path::new(""));
        Cgroup::load(Box::new(self.clone()), parent)
    }
}

/// The OS error under one of the crate's errors, if any.
fn os_code(e: &cgroups_rs::error::Error) -> Option<i32> {
    std::error::Error::source(e)
        .and_then(|c| c.downcast_ref::<io::Error>())
        .and_then(io::Error::raw_os_error)
}

/// The crate's error as an `io::Error` of the OS error's kind, with the crate's message (it
/// names the file).
fn cg_err(e: cgroups_rs::error::Error) -> io::Error {
    let kind = os_code(&e).map_or(io::ErrorKind::Other, |c| {
        io::Error::from_raw_os_error(c).kind()
    });
    io::Error::new(kind, e.to_string())
}

/// One controller of a run's cgroup (all of ours are always there: [`Dirs::subsystems`]).
fn ctl<'a, T>(cg: &'a Cgroup) -> io::Result<&'a T>
where
    &'a T: From<&'a Subsystem>,
    T: Controller + ControllIdentifier,
{
    cg.controller_of::<T>()
        .ok_or_else(|| io::Error::other("cgroup controller missing"))
}

fn pids_in(c: &dyn Controller) -> Vec<i32> {
    c.procs()
        .into_iter()
        .filter_map(|p| i32::try_from(p.pid).ok())
        .filter(|&p| p > 0)
        .collect()
}

/// Creates a run's cgroup: one `mkdir` per directory (each hierarchy's on v1, the one on v2),
/// each failing if the directory exists, so a run never shares a cgroup someone else made, not
/// even one made between a check and the creation. Written by hand: the crate creates with
/// `create_dir_all` (v1, a failure only logged) or skips a directory that exists (v2). On a
/// failure, only the directories made here are removed.
fn create_dirs(cg: &Cgroup) -> io::Result<()> {
    let mut dirs: Vec<PathBuf> = cg
        .subsystems()
        .iter()
        .map(|s| s.to_controller().path().to_path_buf())
        .collect();
    dirs.sort();
    dirs.dedup();
    let mut made: Vec<&Path> = Vec::new();
    for d in &dirs {
        if let Err(e) = fs::create_dir(d) {
            for m in made.iter().rev() {
                let _ = fs::remove_dir(m);
            }
            return Err(e);
        }
        made.push(d);
    }
    Ok(())
}

/// Removes the cgroup through the crate, retrying for at most two seconds: a cgroup is
/// removable only once its last task is fully gone. Every directory is tried each round.
fn delete_retry(cg: &Cgroup) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let r = if cg.v2() {
            cg.delete()
        } else {
            // Each hierarchy's directory, even after one failed; the first error is reported.
            let mut first = Ok(());
            for s in cg.subsystems() {
                if let Err(e) = s.to_controller().delete()
                    && first.is_ok()
                {
                    first = Err(e);
                }
            }
            first
        };
        match r {
            Ok(()) => return Ok(()),
            Err(e) if os_code(&e) == Some(libc::ENOENT) => return Ok(()),
            Err(e) if Instant::now() < deadline && os_code(&e) == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(cg_err(e)),
        }
    }
}

/// A decimal number in a cgroup file, read by hand (see the callers for why).
fn read_u64(path: &Path) -> Option<u64> {
    read_trimmed(path).and_then(|s| s.parse().ok())
}

// ---------------------------------------------------------------------------------------------
// cgroup v2

/// cgroup v2: runs live in `<base>/runs/d<daemon pid>/<exec_id>`; the daemon itself is moved to
/// `<base>/daemon` so `<base>` may enable controllers for its children (the "no internal
/// processes" rule).
pub struct V2Driver {
    owners: PathBuf,
    runs: PathBuf,
}

impl V2Driver {
    /// Prepares the delegated subtree under `base` (the daemon's own cgroup directory).
    /// `move_self` is false only in unit tests.
    ///
    /// Written by hand: delegation. The crate has no notion of moving the daemon out of the
    /// cgroup it was given, and it enables controllers from the host's
    /// /sys/fs/cgroup/cgroup.controllers (one write each, on every create) instead of the three
    /// our subtree needs, once.
    pub fn prepare(base: &Path, move_self: bool) -> io::Result<Self> {
        let controllers = read_trimmed(&base.join("cgroup.controllers")).unwrap_or_default();
        for needed in ["memory", "cpu", "pids"] {
            if !controllers.split_whitespace().any(|c| c == needed) {
                return Err(io::Error::other(format!(
                    "cgroup v2 controller '{needed}' is not delegated to {}",
                    base.display()
                )));
            }
        }
        let owners = base.join("runs");
        let runs = owners.join(owner_name());
        if move_self {
            let leaf = base.join("daemon");
            fs::create_dir_all(&leaf)?;
            // Move every process of our cgroup (us, and anything the container started with us).
            for pid in procs_of(base) {
                let _ = write_file(&leaf.join("cgroup.procs"), &pid.to_string());
            }
        }
        write_file(&base.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
        fs::create_dir_all(&owners)?;
        write_file(&owners.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
        fs::create_dir_all(&runs)?;
        write_file(&runs.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
        Ok(V2Driver { owners, runs })
    }
}

/// One run's cgroup v2: `name` under its owner directory.
struct V2Run {
    cg: Cgroup,
    dir: PathBuf,
}

impl V2Run {
    fn load(owner: &Path, name: &str) -> Self {
        V2Run {
            cg: Cgroup::load(Box::new(Dirs::unified(owner)), name),
            dir: owner.join(name),
        }
    }
}

impl CgroupDriver for V2Driver {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V2
    }

    fn create_empty(&self, name: &str) -> io::Result<Box<dyn RunCgroup>> {
        if !valid_run_name(name) {
            return Err(io::Error::other("invalid cgroup name"));
        }
        let run = V2Run::load(&self.runs, name);
        // The owner directory has memory, cpu and pids enabled for its children already
        // (prepare), so creating is one mkdir.
        create_dirs(&run.cg)?;
        Ok(Box::new(run))
    }

    fn release(&self) {
        let _ = fs::remove_dir(&self.runs);
    }

    /// Written by hand: the orphan sweep. It walks other daemons' owner directories, which no
    /// crate knows about; each run found is removed through the crate.
    fn sweep_orphans(&self) -> usize {
        sweep_owners(&self.owners, |owner| {
            let n = sweep_dir(owner, |dir| {
                let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
                V2Run::load(owner, name).remove().is_ok()
            });
            let _ = fs::remove_dir(owner);
            n
        })
    }
}

impl RunCgroup for V2Run {
    fn procs_files(&self) -> Vec<PathBuf> {
        vec![self.dir.join("cgroup.procs")]
    }

    fn pids(&self) -> Vec<i32> {
        ctl::<PidController>(&self.cg)
            .map(|c| pids_in(c))
            .unwrap_or_default()
    }

    fn apply_limits(&self, limits: &Limits) -> io::Result<()> {
        let memory = ctl::<MemController>(&self.cg)?;
        memory
            .set_limit(limits.memory_bytes as i64)
            .map_err(cg_err)?;
        // No swap beyond the memory limit (memory.swap.max).
        memory.set_memswap_limit(0).map_err(cg_err)?;
        ctl::<CpuController>(&self.cg)?
            .set_cfs_quota_and_period(Some(cpu_quota(limits) as i64), Some(100_000))
            .map_err(cg_err)?;
        ctl::<PidController>(&self.cg)?
            .set_pid_max(MaxValue::Value(limits.pids as i64))
            .map_err(cg_err)
    }

    fn rename(&mut self, _name: &str) {}

    fn kill_all(&self) -> io::Result<()> {
        kill_until_empty(self, || {
            // cgroup.kill (5.14+) kills atomically, including tasks forking right now; the
            // crate refuses when the kernel has no cgroup.kill, and then each process is killed.
            if self.cg.kill().is_err() {
                kill_pids(&self.pids());
            }
        })
    }

    /// Peak memory and OOM kills are read by hand: the crate has no reader for memory.events,
    /// and it reads memory.peak only inside `memory_stat()`, which also reads the four limit
    /// files, memory.current, memory.swap.current and memory.stat (whose read flushes the
    /// kernel's statistics), and panics when a limit file cannot be read.
    fn stats(&self) -> CgroupStats {
        CgroupStats {
            peak_memory_kib: read_u64(&self.dir.join("memory.peak")).map(|b| b / 1024),
            oom_kills: keyed_value(&self.dir.join("memory.events"), "oom_kill").unwrap_or(0),
            pids_max_hits: ctl::<PidController>(&self.cg)
                .ok()
                .and_then(|c| c.get_pid_events().ok())
                .unwrap_or(0),
        }
    }

    fn is_empty(&self) -> bool {
        self.pids().is_empty()
    }

    fn remove(&self) -> io::Result<()> {
        if !self.is_empty() {
            self.kill_all()?;
        }
        delete_retry(&self.cg)
    }
}

// ---------------------------------------------------------------------------------------------
// cgroup v1

/// cgroup v1: one directory per hierarchy (memory, cpu, pids, freezer) under each hierarchy's
/// copy of the daemon's own cgroup path plus `cgroup_name/d<daemon pid>`.
pub struct V1Driver {
    owners: Vec<PathBuf>,
    memory: PathBuf,
    cpu: PathBuf,
    pids: PathBuf,
    freezer: Option<PathBuf>,
}

impl V1Driver {
    /// `mount_root` is normally `/sys/fs/cgroup`; `self_cgroup` is the text of /proc/self/cgroup.
    ///
    /// Written by hand: the daemon's own directories, once at start. They sit under the
    /// daemon's cgroup in each hierarchy (from /proc/self/cgroup, below `mount_root`); the
    /// crate would take its hierarchies from /proc/self/mountinfo instead, every mounted one.
    pub fn prepare(mount_root: &Path, self_cgroup: &str, name: &str) -> io::Result<Self> {
        let base_of = |controller: &str| -> io::Result<PathBuf> {
            let rel = self_cgroup
                .lines()
                .find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
                    ctrls
                        .split(',')
                        .any(|c| c == controller)
                        .then(|| path.to_string())
                })
                .unwrap_or_else(|| "/".to_string());
            let mount = mount_root.join(controller);
            if !mount.join("cgroup.procs").exists() {
                return Err(io::Error::other(format!(
                    "cgroup v1 controller '{controller}' is not mounted at {}",
                    mount.display()
                )));
            }
            let dir = mount.join(rel.trim_start_matches('/')).join(name);
            fs::create_dir_all(&dir)?;
            Ok(dir)
        };
        let own = |shared: PathBuf| -> io::Result<PathBuf> {
            let d = shared.join(owner_name());
            fs::create_dir_all(&d)?;
            Ok(d)
        };
        let shared_memory = base_of("memory")?;
        // Child memory cgroups must account hierarchically for limits to hold (the crate has
        // no setter for memory.use_hierarchy).
        let _ = write_file(&shared_memory.join("memory.use_hierarchy"), "1");
        let shared_cpu = base_of("cpu")?;
        let shared_pids = base_of("pids")?;
        let shared_freezer = base_of("freezer").ok();
        let mut owners = vec![
            shared_memory.clone(),
            shared_cpu.clone(),
            shared_pids.clone(),
        ];
        owners.extend(shared_freezer.clone());
        Ok(V1Driver {
            owners,
            memory: own(shared_memory)?,
            cpu: own(shared_cpu)?,
            pids: own(shared_pids)?,
            freezer: shared_freezer.map(own).transpose()?,
        })
    }

    fn dirs(&self, name: &str) -> Dirs {
        Dirs {
            v2: false,
            memory: self.memory.join(name),
            cpu: self.cpu.join(name),
            pids: self.pids.join(name),
            freezer: self.freezer.as_ref().map(|f| f.join(name)),
        }
    }
}

/// One run's cgroup v1: a directory in each hierarchy, handed to the crate as the roots of its
/// controllers (the names may differ: a rename is per hierarchy).
struct V1Run {
    cg: Cgroup,
    dirs: Dirs,
}

impl V1Run {
    fn load(dirs: Dirs) -> Self {
        V1Run {
            cg: Cgroup::load(Box::new(dirs.clone()), ""),
            dirs,
        }
    }
}

impl CgroupDriver for V1Driver {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V1
    }

    fn create_empty(&self, name: &str) -> io::Result<Box<dyn RunCgroup>> {
        if !valid_run_name(name) {
            return Err(io::Error::other("invalid cgroup name"));
        }
        let run = V1Run::load(self.dirs(name));
        create_dirs(&run.cg)?;
        Ok(Box::new(run))
    }

    fn release(&self) {
        let mut own = vec![&self.memory, &self.cpu, &self.pids];
        own.extend(self.freezer.as_ref());
        for d in own {
            let _ = fs::remove_dir(d);
        }
    }

    /// Written by hand: the orphan sweep. It walks other daemons' owner directories in every
    /// hierarchy, which no crate knows about, and a run may be left in some hierarchies only.
    fn sweep_orphans(&self) -> usize {
        let mut n = 0;
        // Every hierarchy holds every run task, so killing what each run dir lists is complete.
        for shared in &self.owners {
            n += sweep_owners(shared, |owner| {
                let n = sweep_dir(owner, |dir| {
                    kill_pids(&procs_of(dir));
                    rmdir_retry(dir).is_ok()
                });
                let _ = fs::remove_dir(owner);
                n
            });
        }
        n
    }
}

impl RunCgroup for V1Run {
    fn procs_files(&self) -> Vec<PathBuf> {
        self.cg
            .subsystems()
            .iter()
            .map(|s| s.to_controller().path().join("cgroup.procs"))
            .collect()
    }

    fn pids(&self) -> Vec<i32> {
        ctl::<PidController>(&self.cg)
            .map(|c| pids_in(c))
            .unwrap_or_default()
    }

    fn apply_limits(&self, limits: &Limits) -> io::Result<()> {
        let memory = ctl::<MemController>(&self.cg)?;
        let bytes = limits.memory_bytes as i64;
        memory.set_limit(bytes).map_err(cg_err)?;
        // memsw = mem: no swap beyond the memory limit (present when swap accounting is on).
        let memsw = self
            .dirs
            .memory
            .join("memory.memsw.limit_in_bytes")
            .exists();
        if memsw {
            memory.set_memswap_limit(bytes).map_err(cg_err)?;
        }
        // Without memsw, swappiness 0 is what keeps the run's pages out of swap past its limit:
        // then a refusal fails the run. With memsw it is best effort (some kernels refuse it
        // below a hierarchical parent).
        if let Err(e) = memory.set_swappiness(0)
            && !memsw
        {
            return Err(cg_err(e));
        }
        ctl::<CpuController>(&self.cg)?
            .set_cfs_quota_and_period(Some(cpu_quota(limits) as i64), Some(100_000))
            .map_err(cg_err)?;
        ctl::<PidController>(&self.cg)?
            .set_pid_max(MaxValue::Value(limits.pids as i64))
            .map_err(cg_err)
    }

    /// Written by hand: the crate cannot rename a cgroup.
    fn rename(&mut self, name: &str) {
        if !valid_run_name(name) {
            return;
        }
        let mut dirs = self.dirs.clone();
        let mut all = vec![&mut dirs.memory, &mut dirs.cpu, &mut dirs.pids];
        if let Some(f) = dirs.freezer.as_mut() {
            all.push(f);
        }
        for d in all {
            let to = d.with_file_name(name);
            match fs::rename(&*d, &to) {
                Ok(()) => *d = to,
                Err(e) => tracing::warn!(error = %e, dir = %d.display(), "cgroup rename"),
            }
        }
        *self = V1Run::load(dirs);
    }

    fn kill_all(&self) -> io::Result<()> {
        let freezer = self.cg.controller_of::<FreezerController>();
        kill_until_empty(self, || {
            // Freeze first so nothing forks between reading cgroup.procs and the kill.
            let frozen = freezer.map(|f| f.freeze().is_ok()).unwrap_or(false);
            kill_pids(&self.pids());
            if frozen && let Some(f) = freezer {
                let _ = f.thaw();
            }
        })
    }

    /// Peak memory and OOM kills are read by hand: the crate reads them only inside
    /// `memory_stat()`, eleven files including memory.stat and memory.numa_stat, measured at
    /// about 0.8 ms a call against 0.05 ms for the two files read here, once per run.
    fn stats(&self) -> CgroupStats {
        CgroupStats {
            peak_memory_kib: read_u64(&self.dirs.memory.join("memory.max_usage_in_bytes"))
                .map(|b| b / 1024),
            oom_kills: keyed_value(&self.dirs.memory.join("memory.oom_control"), "oom_kill")
                .unwrap_or(0),
            pids_max_hits: ctl::<PidController>(&self.cg)
                .ok()
                .and_then(|c| c.get_pid_events().ok())
                .unwrap_or(0),
        }
    }

    fn is_empty(&self) -> bool {
        // Every hierarchy: a task on its way in or out may be listed in one only.
        self.cg.procs().is_empty()
    }

    fn remove(&self) -> io::Result<()> {
        if !self.is_empty() {
            self.kill_all()?;
        }
        delete_retry(&self.cg)
    }
}

/// This daemon's directory name among the owners of run cgroups.
fn owner_name() -> String {
    format!("d{}", std::process::id())
}

/// Whether an owner directory belongs to a live executor-arm process (another instance on the
/// same host, or a test's daemon): its runs are not ours to reap.
fn owner_alive(name: &str) -> bool {
    let Some(pid) = name.strip_prefix('d').and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    if pid == std::process::id() {
        return true;
    }
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim() == "executor-arm")
        .unwrap_or(false)
}

/// Applies `sweep` to every owner directory under `shared` whose daemon is gone.
fn sweep_owners(shared: &Path, mut sweep: impl FnMut(&Path) -> usize) -> usize {
    let Ok(entries) = fs::read_dir(shared) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with('d') && !owner_alive(&name)
        })
        .map(|e| sweep(&e.path()))
        .sum()
}

fn sweep_dir(root: &Path, mut remove: impl FnMut(&Path) -> bool) -> usize {
    let Ok(entries) = fs::read_dir(root) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter(|e| valid_run_name(&e.file_name().to_string_lossy()))
        .filter(|e| remove(&e.path()))
        .count()
}

/// Detects the cgroup layout and prepares the matching driver.
pub fn detect(mount_root: &Path, name: &str) -> io::Result<Box<dyn CgroupDriver>> {
    let self_cgroup = fs::read_to_string("/proc/self/cgroup")?;
    // Unified-only host (or a v2 container): the top mount has cgroup.controllers.
    if mount_root.join("cgroup.controllers").exists() {
        let rel = self_cgroup
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap_or("/")
            .trim_start_matches('/')
            .to_string();
        let mut base = mount_root.join(rel);
        // Already moved into our leaf by an earlier start in this cgroup.
        if base.file_name().map(|n| n == "daemon").unwrap_or(false)
            && let Some(parent) = base.parent()
        {
            base = parent.to_path_buf();
        }
        return Ok(Box::new(V2Driver::prepare(&base, true)?));
    }
    Ok(Box::new(V1Driver::prepare(mount_root, &self_cgroup, name)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn limits() -> Limits {
        Limits {
            cpus: 0.5,
            memory_bytes: 64 << 20,
            disk_bytes: 1 << 20,
            timeout: Duration::from_secs(1),
            pids: 16,
            output_bytes: 1024,
            on_overflow: crate::sandbox::OnOverflow::Truncate,
            nofile: 64,
        }
    }

    /// A fake cgroup v2 tree: the kernel would create the interface files on mkdir; here the
    /// test creates the ones the driver reads or writes.
    fn fake_v2() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        fs::write(
            t.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        fs::write(t.path().join("cgroup.subtree_control"), "").unwrap();
        fs::write(t.path().join("cgroup.procs"), "").unwrap();
        t
    }

    #[test]
    fn v2_refuses_when_controllers_not_delegated() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("cgroup.controllers"), "cpu io\n").unwrap();
        let err = V2Driver::prepare(t.path(), false).err().unwrap();
        assert!(err.to_string().contains("memory"), "{err}");
    }

    /// The files the kernel creates in a new v2 cgroup that the driver reads before writing.
    fn fake_v2_run(dir: &Path) {
        fs::write(dir.join("cpu.max"), "max 100000\n").unwrap();
        fs::write(dir.join("cgroup.procs"), "").unwrap();
    }

    #[test]
    fn v2_enables_controllers_and_writes_every_limit() {
        let t = fake_v2();
        let driver = V2Driver::prepare(t.path(), false).unwrap();
        assert_eq!(driver.version(), CgroupVersion::V2);
        let st = |p: &str| fs::read_to_string(t.path().join(p)).unwrap();
        assert_eq!(st("cgroup.subtree_control"), "+memory +cpu +pids");
        assert_eq!(st("runs/cgroup.subtree_control"), "+memory +cpu +pids");
        let own = format!("runs/{}", owner_name());
        assert_eq!(
            st(&format!("{own}/cgroup.subtree_control")),
            "+memory +cpu +pids"
        );
        let run = driver.create_empty("exec-1").unwrap();
        // Creating writes no controller file (the owner enabled them once, in prepare).
        assert_eq!(
            st(&format!("{own}/cgroup.subtree_control")),
            "+memory +cpu +pids"
        );
        fake_v2_run(&t.path().join(format!("{own}/exec-1")));
        run.apply_limits(&limits()).unwrap();
        assert_eq!(
            st(&format!("{own}/exec-1/memory.max")),
            (64u64 << 20).to_string()
        );
        assert_eq!(st(&format!("{own}/exec-1/memory.swap.max")), "0");
        assert_eq!(st(&format!("{own}/exec-1/cpu.max")), "50000 100000");
        assert_eq!(st(&format!("{own}/exec-1/pids.max")), "16");
        assert_eq!(
            run.procs_files(),
            vec![t.path().join(format!("{own}/exec-1/cgroup.procs"))]
        );
        // A second run never shares the cgroup of the first.
        assert!(driver.create("exec-1", &limits()).is_err());
        assert!(driver.create_empty("exec-1").is_err());
        // The kernel provides cgroup.kill (5.14+); the fake gets an empty one.
        fs::write(t.path().join(format!("{own}/exec-1/cgroup.kill")), "").unwrap();
        run.kill_all().unwrap();
        assert_eq!(st(&format!("{own}/exec-1/cgroup.kill")), "1");
    }

    #[test]
    fn v2_sweeps_only_dead_owners() {
        let t = fake_v2();
        let driver = V2Driver::prepare(t.path(), false).unwrap();
        // pid 0 is never a live daemon; our own directory is never swept.
        fs::create_dir_all(t.path().join("runs/d0/exec-old")).unwrap();
        driver.create_empty("exec-live").unwrap();
        assert_eq!(driver.sweep_orphans(), 1);
        assert!(!t.path().join("runs/d0").exists());
        assert!(
            t.path()
                .join(format!("runs/{}/exec-live", owner_name()))
                .exists()
        );
    }

    #[test]
    fn v2_stats_read_peak_events_and_pids() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("exec-1");
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("memory.peak"), "10485760\n").unwrap();
        fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        fs::write(dir.join("pids.events"), "max 7\n").unwrap();
        let run = V2Run::load(t.path(), "exec-1");
        assert_eq!(
            run.stats(),
            CgroupStats {
                peak_memory_kib: Some(10240),
                oom_kills: 1,
                pids_max_hits: 7
            }
        );
    }

    /// A fake v1 mount root with the four hierarchies, and a driver on it.
    fn fake_v1() -> (tempfile::TempDir, V1Driver) {
        let t = tempfile::tempdir().unwrap();
        for c in ["memory", "cpu", "pids", "freezer"] {
            fs::create_dir_all(t.path().join(c)).unwrap();
            fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let self_cg = "4:memory:/\n1:cpu:/\n8:pids:/\n6:freezer:/\n";
        let d = V1Driver::prepare(t.path(), self_cg, "executor-arm").unwrap();
        (t, d)
    }

    #[test]
    fn v1_creates_in_each_hierarchy_and_writes_every_limit() {
        let (t, driver) = fake_v1();
        assert_eq!(driver.version(), CgroupVersion::V1);
        let own = |c: &str| t.path().join(c).join("executor-arm").join(owner_name());
        // Swap accounting on: the kernel would have created memsw on mkdir.
        let run = driver.create_empty("exec-1").unwrap();
        fs::write(own("memory").join("exec-1/memory.memsw.limit_in_bytes"), "").unwrap();
        run.apply_limits(&limits()).unwrap();
        let st = |c: &str, f: &str| fs::read_to_string(own(c).join("exec-1").join(f)).unwrap();
        let bytes = (64u64 << 20).to_string();
        assert_eq!(st("memory", "memory.limit_in_bytes"), bytes);
        assert_eq!(st("memory", "memory.memsw.limit_in_bytes"), bytes);
        assert_eq!(st("memory", "memory.swappiness"), "0");
        assert_eq!(st("cpu", "cpu.cfs_quota_us"), "50000");
        assert_eq!(st("cpu", "cpu.cfs_period_us"), "100000");
        assert_eq!(st("pids", "pids.max"), "16");
        // The crate only enters the directories the driver chose.
        let mut files = run.procs_files();
        files.sort();
        let mut want: Vec<PathBuf> = ["cpu", "freezer", "memory", "pids"]
            .iter()
            .map(|c| own(c).join("exec-1/cgroup.procs"))
            .collect();
        want.sort();
        assert_eq!(files, want);
        // A second run never shares the cgroup of the first.
        assert!(driver.create_empty("exec-1").is_err());
        // Without memsw (no swap accounting) the limits still apply.
        let run2 = driver.create("exec-2", &limits()).unwrap();
        assert!(
            !own("memory")
                .join("exec-2/memory.memsw.limit_in_bytes")
                .exists()
        );
        assert_eq!(
            fs::read_to_string(own("pids").join("exec-2/pids.max")).unwrap(),
            "16"
        );
        drop(run2);
    }

    #[test]
    fn v1_rename_moves_every_hierarchy_and_remove_deletes_them() {
        let (t, driver) = fake_v1();
        let own = |c: &str| t.path().join(c).join("executor-arm").join(owner_name());
        let mut run = driver.create_empty("warm-0").unwrap();
        run.rename("exec-9");
        for c in ["memory", "cpu", "pids", "freezer"] {
            assert!(!own(c).join("warm-0").exists(), "{c}");
            assert!(own(c).join("exec-9").is_dir(), "{c}");
            // A plain directory has no cgroup.procs; the kernel's cgroups always do.
            fs::write(own(c).join("exec-9/cgroup.procs"), "").unwrap();
        }
        assert!(
            run.procs_files()
                .contains(&own("pids").join("exec-9/cgroup.procs"))
        );
        assert!(run.is_empty());
        // Removing a directory with files in it fails on a plain tree; drop the fakes first.
        for c in ["memory", "cpu", "pids", "freezer"] {
            fs::remove_file(own(c).join("exec-9/cgroup.procs")).unwrap();
        }
        run.remove().unwrap();
        for c in ["memory", "cpu", "pids", "freezer"] {
            assert!(!own(c).join("exec-9").exists(), "{c}");
        }
    }

    #[test]
    fn v1_stats_read_peak_oom_and_pids() {
        let (t, driver) = fake_v1();
        let run = driver.create_empty("exec-1").unwrap();
        let own = |c: &str| {
            t.path()
                .join(c)
                .join("executor-arm")
                .join(owner_name())
                .join("exec-1")
        };
        fs::write(own("memory").join("memory.max_usage_in_bytes"), "2097152\n").unwrap();
        fs::write(
            own("memory").join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        )
        .unwrap();
        fs::write(own("pids").join("pids.events"), "max 5\n").unwrap();
        assert_eq!(
            run.stats(),
            CgroupStats {
                peak_memory_kib: Some(2048),
                oom_kills: 2,
                pids_max_hits: 5
            }
        );
    }

    #[test]
    fn v1_reads_self_cgroup_paths() {
        let t = tempfile::tempdir().unwrap();
        for c in ["memory", "cpu", "pids", "freezer"] {
            fs::create_dir_all(t.path().join(c).join("outer")).unwrap();
            fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let self_cg = "4:memory:/outer\n1:cpu:/\n8:pids:/\n6:freezer:/\n";
        let d = V1Driver::prepare(t.path(), self_cg, "executor-arm").unwrap();
        assert_eq!(
            d.memory,
            t.path()
                .join("memory/outer/executor-arm")
                .join(owner_name())
        );
        assert_eq!(d.cpu, t.path().join("cpu/executor-arm").join(owner_name()));
        assert!(d.memory.is_dir());
    }

    /// Someone else (another root process, or a writer of the delegated subtree) creates the
    /// run's directory while the driver creates it: exactly one of the two creations may
    /// succeed. A driver that checks for the directory and then creates it "if missing" adopts
    /// the other's cgroup, with whatever is in it, when the other's mkdir lands in between.
    fn assert_never_adopts(driver: Arc<dyn CgroupDriver>, dir_of: impl Fn(&str) -> PathBuf) {
        use std::sync::Barrier;
        let rounds = 3000;
        let barrier = Arc::new(Barrier::new(2));
        let names: Vec<String> = (0..rounds).map(|i| format!("race-{i}")).collect();
        let racer = {
            let barrier = barrier.clone();
            let dirs: Vec<PathBuf> = names.iter().map(|n| dir_of(n)).collect();
            std::thread::spawn(move || {
                dirs.iter()
                    .map(|d| {
                        barrier.wait();
                        fs::create_dir(d).is_ok()
                    })
                    .collect::<Vec<bool>>()
            })
        };
        let ours: Vec<bool> = names
            .iter()
            .map(|n| {
                barrier.wait();
                driver.create_empty(n).is_ok()
            })
            .collect();
        let theirs = racer.join().unwrap();
        let adopted = ours.iter().zip(&theirs).filter(|(o, t)| **o && **t).count();
        assert_eq!(adopted, 0, "run cgroups adopted from a concurrent creator");
    }

    #[test]
    fn v1_create_never_adopts_a_cgroup_made_concurrently() {
        let (t, driver) = fake_v1();
        let pids = t.path().join("pids/executor-arm").join(owner_name());
        assert_never_adopts(Arc::new(driver), |n| pids.join(n));
    }

    #[test]
    fn v2_create_never_adopts_a_cgroup_made_concurrently() {
        let t = fake_v2();
        let driver = V2Driver::prepare(t.path(), false).unwrap();
        let runs = t.path().join("runs").join(owner_name());
        assert_never_adopts(Arc::new(driver), |n| runs.join(n));
    }

    /// Without swap accounting (no memsw file) swappiness 0 is all that keeps a run's memory
    /// from spilling into swap past its limit: a failed write must fail the run.
    #[test]
    fn v1_without_memsw_a_refused_swappiness_fails_the_limits() {
        let (t, driver) = fake_v1();
        let run = driver.create_empty("exec-1").unwrap();
        let mem = t
            .path()
            .join("memory/executor-arm")
            .join(owner_name())
            .join("exec-1");
        // A file that cannot be opened for writing (the kernel's refusal, on a plain tree).
        fs::create_dir(mem.join("memory.swappiness")).unwrap();
        assert!(run.apply_limits(&limits()).is_err());
        // With memsw the swap is bounded by it; swappiness stays best effort.
        fs::write(mem.join("memory.memsw.limit_in_bytes"), "").unwrap();
        run.apply_limits(&limits()).unwrap();
    }

    /// On the host's own cgroup hierarchies, v1 (the v2 driver's kernel behaviour is covered by
    /// the local backend's integration tests on v2 hosts): the limits land in the kernel's
    /// files, and `kill_all` empties a cgroup whose processes fork as fast as they can and leave
    /// their session (setsid, double fork), after which removal leaves no directory behind.
    #[test]
    #[ignore = "needs root and the host's cgroups: scripts/test-all.sh runs it as root"]
    fn v1_host_limits_land_and_kill_all_stops_a_setsid_fork_storm() {
        // SAFETY: geteuid(2) takes no arguments and cannot fail.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        let mount = Path::new("/sys/fs/cgroup");
        if mount.join("cgroup.controllers").exists() || !mount.join("pids").is_dir() {
            eprintln!("not a cgroup v1 host: nothing of the v1 driver to check against a kernel");
            return;
        }
        let driver = detect(mount, "executor-arm-unit").unwrap();
        assert_eq!(driver.version(), CgroupVersion::V1);
        let name = format!("storm-{}", std::process::id());
        let mut l = limits();
        l.pids = 64;
        let run = driver.create(&name, &l).unwrap();
        let files = run.procs_files();
        let dir = |c: &str| {
            files
                .iter()
                .find(|f| f.starts_with(mount.join(c)))
                .and_then(|f| f.parent())
                .unwrap()
                .to_path_buf()
        };
        let rd = |c: &str, f: &str| read_trimmed(&dir(c).join(f)).unwrap();
        assert_eq!(
            rd("memory", "memory.limit_in_bytes"),
            (64u64 << 20).to_string()
        );
        if dir("memory").join("memory.memsw.limit_in_bytes").exists() {
            assert_eq!(
                rd("memory", "memory.memsw.limit_in_bytes"),
                (64u64 << 20).to_string()
            );
        }
        assert_eq!(rd("memory", "memory.swappiness"), "0");
        assert_eq!(rd("cpu", "cpu.cfs_quota_us"), "50000");
        assert_eq!(rd("cpu", "cpu.cfs_period_us"), "100000");
        assert_eq!(rd("pids", "pids.max"), "64");

        let joins: String = files
            .iter()
            .map(|f| format!("echo $$ > {}; ", f.display()))
            .collect();
        let storm = "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n            if os.fork() != 0:\n                os._exit(0)\n    except OSError:\n        pass\n";
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{joins}exec python3 -c \"$(printf '{storm}')\""))
            .spawn()
            .unwrap();
        let start = Instant::now();
        while run.pids().len() < 8 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(run.pids().len() >= 8, "the storm never started");
        run.kill_all().unwrap();
        assert!(run.is_empty());
        let _ = child.wait();
        run.remove().unwrap();
        for c in ["memory", "cpu", "pids", "freezer"] {
            assert!(!dir(c).exists(), "{c} left behind");
        }
        driver.release();
        // The shared directory named for this test (a daemon keeps its own).
        for c in ["memory", "cpu", "pids", "freezer"] {
            let _ = fs::remove_dir(dir(c).parent().and_then(Path::parent).unwrap());
        }
    }

    #[test]
    fn run_names_are_plain() {
        assert!(valid_run_name("exec-0a1b"));
        assert!(!valid_run_name("../x"));
        assert!(!valid_run_name(""));
    }
}
