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
//!
//! This file holds the driver and run traits, [`detect`], and what both versions share (file
//! helpers, the kill loop, the crate's hierarchy over chosen directories, directory creation and
//! removal, owner directories and the orphan sweep); each version's driver is in its own file:
//! [`v1`] (one directory per hierarchy) and [`v2`] (the unified tree and its delegation).
//! [`group`] holds runs that count together (a session's) under a parent cgroup of their own.

mod group;
mod v1;
mod v2;

pub use self::group::Groups;
pub use self::v1::V1Driver;
pub use self::v2::V2Driver;

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cgroups_rs::cpu::CpuController;
use cgroups_rs::freezer::FreezerController;
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::{Cgroup, ControllIdentifier, Controller, Hierarchy, Subsystem};

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
    /// What its processes use now.
    fn usage(&self) -> crate::sandbox::Usage;
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
    /// `name` is a run's name, or `group/run` for a run inside a group (see
    /// [`CgroupDriver::create_group`]).
    fn create_empty(&self, name: &str) -> io::Result<Box<dyn RunCgroup>>;
    /// Creates a group's cgroup with `limits`: a parent that holds no process of its own, whose
    /// limits bound the runs made under it (`group/run`) together.
    fn create_group(&self, name: &str, limits: &Limits) -> io::Result<Box<dyn RunCgroup>> {
        self.create(name, limits)
    }
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

/// Sends `sig` to the run's command: the first process its init started, pid 2 of the sandbox's
/// pid namespace (the command's leftovers die with the namespace when it ends). `procs` is one of
/// the run's `cgroup.procs` files. A pidfd fixes the process before the check, as in
/// [`terminate_member`]. Returns whether the signal was sent.
pub fn signal_command(procs: &Path, sig: i32) -> bool {
    let members = || -> Vec<i32> {
        fs::read_to_string(procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter(|&p: &i32| p > 0)
            .collect()
    };
    let is_command = |pid: i32| {
        fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("NSpid:")).map(|ids| {
                    let ids: Vec<&str> = ids.split_whitespace().collect();
                    ids.len() >= 2 && ids.last() == Some(&"2")
                })
            })
            .unwrap_or(false)
    };
    for pid in members() {
        // SAFETY: pidfd_open(2) takes a pid and flags and touches no memory of ours.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if raw < 0 {
            continue;
        }
        // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        if !(members().contains(&pid) && is_command(pid)) {
            continue;
        }
        // SAFETY: pidfd_send_signal(2) on our own pidfd, with no siginfo (null) and no flags.
        return unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            ) == 0
        };
    }
    false
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

/// A run's name, or `group/run` (one level of groups, each part a plain name).
fn valid_run_path(name: &str) -> bool {
    match name.split_once('/') {
        Some((group, run)) => valid_run_name(group) && valid_run_name(run),
        None => valid_run_name(name),
    }
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

/// The CPU time the processes of `dir` and of the cgroups below it have used so far (their
/// `utime` + `stime` in `/proc/<pid>/stat`): for a cgroup v1 host whose cpuacct controller is
/// not mounted with cpu, where a run's cgroup has no CPU counter of its own.
fn cpu_ns_of_tree(dir: &Path) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut total = 0u64;
    let mut dirs = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = dirs.pop() {
        for pid in procs_of(&d) {
            let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // Fields after the command (which may hold spaces), from its closing parenthesis:
            // state is the 3rd field, utime the 14th and stime the 15th.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            total += (t(11) + t(12)) * (1_000_000_000 / ticks);
        }
        if depth < 4
            && let Ok(entries) = fs::read_dir(&d)
        {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push((e.path(), depth + 1));
                }
            }
        }
    }
    total
}

/// A decimal number in a cgroup file, read by hand (see the callers for why).
fn read_u64(path: &Path) -> Option<u64> {
    read_trimmed(path).and_then(|s| s.parse().ok())
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

/// Applies `remove` to every run directory under `root`, a group's runs before the group (a
/// cgroup with children cannot be removed); the number removed.
fn sweep_dir(root: &Path, remove: &mut impl FnMut(&Path) -> bool) -> usize {
    let Ok(entries) = fs::read_dir(root) else {
        return 0;
    };
    let dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter(|e| valid_run_name(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    dirs.iter()
        .map(|d| sweep_dir(d, remove) + usize::from(remove(d)))
        .sum()
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

    pub(super) fn limits() -> Limits {
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

    /// Someone else (another root process, or a writer of the delegated subtree) creates the
    /// run's directory while the driver creates it: exactly one of the two creations may
    /// succeed. A driver that checks for the directory and then creates it "if missing" adopts
    /// the other's cgroup, with whatever is in it, when the other's mkdir lands in between.
    pub(super) fn assert_never_adopts(
        driver: Arc<dyn CgroupDriver>,
        dir_of: impl Fn(&str) -> PathBuf,
    ) {
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
    fn run_names_are_plain() {
        assert!(valid_run_name("exec-0a1b"));
        assert!(!valid_run_name("../x"));
        assert!(!valid_run_name(""));
        assert!(valid_run_path("session-3/exec-0a1b"));
        assert!(valid_run_path("exec-0a1b"));
        for bad in ["a/b/c", "/a", "a/", "../a", "a/..", "a//b", ""] {
            assert!(!valid_run_path(bad), "{bad}");
        }
    }
}
