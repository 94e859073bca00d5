//! Per-run cgroups, v1 and v2 behind one small trait.
//!
//! Owns: creating a run's cgroup with memory (no swap beyond it), cpu quota and pids limits,
//! killing every process in it, reading peak memory / OOM / pids events, and removing it.
//! Must not: decide limits (the policy layer does) or spawn anything.
//!
//! Both drivers work on a root directory so the v2 logic is unit-tested against a fake tree.

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// Writes a cgroup interface file. `create` is harmless on cgroupfs (files exist or the open
/// fails) and lets the unit tests run the same code against a plain directory tree.
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

/// rmdir with a short retry: a cgroup is removable only once its last task is fully gone.
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

struct V2Run {
    dir: PathBuf,
}

impl CgroupDriver for V2Driver {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V2
    }

    fn create_empty(&self, name: &str) -> io::Result<Box<dyn RunCgroup>> {
        if !valid_run_name(name) {
            return Err(io::Error::other("invalid cgroup name"));
        }
        let dir = self.runs.join(name);
        fs::create_dir(&dir)?;
        Ok(Box::new(V2Run { dir }))
    }

    fn release(&self) {
        let _ = fs::remove_dir(&self.runs);
    }

    fn sweep_orphans(&self) -> usize {
        sweep_owners(&self.owners, |owner| {
            let n = sweep_dir(owner, |dir| {
                V2Run {
                    dir: dir.to_path_buf(),
                }
                .remove()
                .is_ok()
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
        procs_of(&self.dir)
    }

    fn apply_limits(&self, limits: &Limits) -> io::Result<()> {
        write_file(
            &self.dir.join("memory.max"),
            &limits.memory_bytes.to_string(),
        )?;
        // No swap beyond the memory limit.
        write_file(&self.dir.join("memory.swap.max"), "0")?;
        write_file(
            &self.dir.join("cpu.max"),
            &format!("{} 100000", cpu_quota(limits)),
        )?;
        write_file(&self.dir.join("pids.max"), &limits.pids.to_string())
    }

    fn rename(&mut self, _name: &str) {}

    fn kill_all(&self) -> io::Result<()> {
        let kill_file = self.dir.join("cgroup.kill");
        kill_until_empty(self, || {
            if kill_file.exists() {
                // cgroup.kill (5.14+) kills atomically, including tasks forking right now.
                let _ = write_file(&kill_file, "1");
            } else {
                kill_pids(&procs_of(&self.dir));
            }
        })
    }

    fn stats(&self) -> CgroupStats {
        CgroupStats {
            peak_memory_kib: read_trimmed(&self.dir.join("memory.peak"))
                .and_then(|s| s.parse::<u64>().ok())
                .map(|b| b / 1024),
            oom_kills: keyed_value(&self.dir.join("memory.events"), "oom_kill").unwrap_or(0),
            pids_max_hits: keyed_value(&self.dir.join("pids.events"), "max").unwrap_or(0),
        }
    }

    fn is_empty(&self) -> bool {
        procs_of(&self.dir).is_empty()
    }

    fn remove(&self) -> io::Result<()> {
        if !self.is_empty() {
            self.kill_all()?;
        }
        rmdir_retry(&self.dir)
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
        // Child memory cgroups must account hierarchically for limits to hold.
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

    fn dirs(&self, exec_id: &str) -> Vec<PathBuf> {
        let mut d = vec![
            self.memory.join(exec_id),
            self.cpu.join(exec_id),
            self.pids.join(exec_id),
        ];
        if let Some(f) = &self.freezer {
            d.push(f.join(exec_id));
        }
        d
    }
}

struct V1Run {
    memory: PathBuf,
    cpu: PathBuf,
    pids: PathBuf,
    freezer: Option<PathBuf>,
}

impl V1Run {
    fn all(&self) -> Vec<&PathBuf> {
        let mut v = vec![&self.memory, &self.cpu, &self.pids];
        if let Some(f) = &self.freezer {
            v.push(f);
        }
        v
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
        let dirs = self.dirs(name);
        for d in &dirs {
            if let Err(e) = fs::create_dir(d) {
                for made in &dirs {
                    let _ = fs::remove_dir(made);
                }
                return Err(e);
            }
        }
        Ok(Box::new(V1Run {
            memory: dirs[0].clone(),
            cpu: dirs[1].clone(),
            pids: dirs[2].clone(),
            freezer: dirs.get(3).cloned(),
        }))
    }

    fn release(&self) {
        let mut own = vec![&self.memory, &self.cpu, &self.pids];
        own.extend(self.freezer.as_ref());
        for d in own {
            let _ = fs::remove_dir(d);
        }
    }

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
        self.all()
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    fn pids(&self) -> Vec<i32> {
        procs_of(&self.pids)
    }

    fn apply_limits(&self, limits: &Limits) -> io::Result<()> {
        let bytes = limits.memory_bytes.to_string();
        write_file(&self.memory.join("memory.limit_in_bytes"), &bytes)?;
        // memsw = mem: no swap beyond the memory limit (present when swap accounting is on).
        let memsw = self.memory.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            write_file(&memsw, &bytes)?;
        }
        let _ = write_file(&self.memory.join("memory.swappiness"), "0");
        write_file(&self.cpu.join("cpu.cfs_period_us"), "100000")?;
        write_file(
            &self.cpu.join("cpu.cfs_quota_us"),
            &cpu_quota(limits).to_string(),
        )?;
        write_file(&self.pids.join("pids.max"), &limits.pids.to_string())
    }

    fn rename(&mut self, name: &str) {
        if !valid_run_name(name) {
            return;
        }
        let mut dirs = vec![&mut self.memory, &mut self.cpu, &mut self.pids];
        if let Some(f) = self.freezer.as_mut() {
            dirs.push(f);
        }
        for d in dirs {
            let to = d.with_file_name(name);
            match fs::rename(&*d, &to) {
                Ok(()) => *d = to,
                Err(e) => tracing::warn!(error = %e, dir = %d.display(), "cgroup rename"),
            }
        }
    }

    fn kill_all(&self) -> io::Result<()> {
        kill_until_empty(self, || {
            // Freeze first so nothing forks between reading cgroup.procs and the kill.
            let frozen = self
                .freezer
                .as_ref()
                .map(|f| write_file(&f.join("freezer.state"), "FROZEN").is_ok())
                .unwrap_or(false);
            kill_pids(&procs_of(&self.pids));
            if frozen && let Some(f) = &self.freezer {
                let _ = write_file(&f.join("freezer.state"), "THAWED");
            }
        })
    }

    fn stats(&self) -> CgroupStats {
        CgroupStats {
            peak_memory_kib: read_trimmed(&self.memory.join("memory.max_usage_in_bytes"))
                .and_then(|s| s.parse::<u64>().ok())
                .map(|b| b / 1024),
            oom_kills: keyed_value(&self.memory.join("memory.oom_control"), "oom_kill")
                .unwrap_or(0),
            pids_max_hits: keyed_value(&self.pids.join("pids.events"), "max").unwrap_or(0),
        }
    }

    fn is_empty(&self) -> bool {
        self.all().iter().all(|d| procs_of(d).is_empty())
    }

    fn remove(&self) -> io::Result<()> {
        if !self.is_empty() {
            self.kill_all()?;
        }
        let mut first_err = None;
        for d in self.all() {
            if let Err(e) = rmdir_retry(d) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
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
        let run = driver.create("exec-1", &limits()).unwrap();
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
        // The kernel provides cgroup.kill (5.14+); the fake gets an empty one.
        fs::write(t.path().join(format!("{own}/exec-1/cgroup.procs")), "").unwrap();
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
        driver.create("exec-live", &limits()).unwrap();
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
        fs::write(t.path().join("memory.peak"), "10485760\n").unwrap();
        fs::write(
            t.path().join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        fs::write(t.path().join("pids.events"), "max 7\n").unwrap();
        let run = V2Run {
            dir: t.path().to_path_buf(),
        };
        assert_eq!(
            run.stats(),
            CgroupStats {
                peak_memory_kib: Some(10240),
                oom_kills: 1,
                pids_max_hits: 7
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

    #[test]
    fn run_names_are_plain() {
        assert!(valid_run_name("exec-0a1b"));
        assert!(!valid_run_name("../x"));
        assert!(!valid_run_name(""));
    }
}
