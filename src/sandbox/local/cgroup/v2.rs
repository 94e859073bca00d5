//! cgroup v2: the delegated subtree the daemon prepares once (moving itself into a leaf so its
//! cgroup may enable controllers), and each run's cgroup as one directory of the unified tree.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cgroups_rs::cpu::CpuController;
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::{Cgroup, MaxValue};

use super::{
    CgroupDriver, CgroupStats, CgroupVersion, Dirs, RunCgroup, cg_err, cpu_quota, create_dirs, ctl,
    delete_retry, keyed_value, kill_pids, kill_until_empty, owner_name, pids_in, procs_of,
    read_trimmed, read_u64, sweep_dir, sweep_owners, valid_run_path, write_file,
};
use crate::sandbox::Limits;

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
        if !valid_run_path(name) {
            return Err(io::Error::other("invalid cgroup name"));
        }
        let run = V2Run::load(&self.runs, name);
        // The owner directory has memory, cpu and pids enabled for its children already
        // (prepare), so creating is one mkdir.
        create_dirs(&run.cg)?;
        Ok(Box::new(run))
    }

    /// A group's directory enables the three controllers for the runs made under it.
    fn create_group(&self, name: &str, limits: &Limits) -> io::Result<Box<dyn RunCgroup>> {
        let group = self.create(name, limits)?;
        if let Err(e) = write_file(
            &self.runs.join(name).join("cgroup.subtree_control"),
            "+memory +cpu +pids",
        ) {
            let _ = group.remove();
            return Err(e);
        }
        Ok(group)
    }

    fn release(&self) {
        let _ = fs::remove_dir(&self.runs);
    }

    /// Written by hand: the orphan sweep. It walks other daemons' owner directories, which no
    /// crate knows about; each run found is removed through the crate.
    fn sweep_orphans(&self) -> usize {
        sweep_owners(&self.owners, |owner| {
            let n = sweep_dir(owner, &mut |dir| {
                let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
                let parent = dir.parent().unwrap_or(owner);
                V2Run::load(parent, name).remove().is_ok()
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

    fn usage(&self) -> crate::sandbox::Usage {
        crate::sandbox::Usage {
            memory_bytes: read_u64(&self.dir.join("memory.current")).unwrap_or(0),
            cache_bytes: keyed_value(&self.dir.join("memory.stat"), "file").unwrap_or(0),
            cpu_ns: keyed_value(&self.dir.join("cpu.stat"), "usage_usec").unwrap_or(0) * 1000,
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

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_never_adopts, limits};
    use super::*;
    use std::sync::Arc;

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
        // A group's runs go before the group: a cgroup with children cannot be removed.
        fs::create_dir_all(t.path().join("runs/d0/group-3/exec-in")).unwrap();
        driver.create_empty("exec-live").unwrap();
        assert_eq!(driver.sweep_orphans(), 3);
        assert!(!t.path().join("runs/d0").exists());
        assert!(
            t.path()
                .join(format!("runs/{}/exec-live", owner_name()))
                .exists()
        );
    }

    /// The sweep's walk through a dead owner's groups stays inside it: a symlink is never
    /// followed (whatever it points at is left as it is), and a directory whose name no run or
    /// group has is neither entered nor removed.
    #[test]
    fn v2_sweep_follows_no_symlink_and_enters_no_odd_name() {
        let t = fake_v2();
        let driver = V2Driver::prepare(t.path(), false).unwrap();
        let outside = t.path().join("outside");
        fs::create_dir_all(outside.join("exec-x")).unwrap();
        fs::create_dir_all(t.path().join("runs/d0/group-1/exec-in")).unwrap();
        std::os::unix::fs::symlink(&outside, t.path().join("runs/d0/group-2")).unwrap();
        std::os::unix::fs::symlink(&outside, t.path().join("runs/d0/group-1/exec-link")).unwrap();
        fs::create_dir_all(t.path().join("runs/d0/odd.name/exec-y")).unwrap();
        // exec-in only: group-1 keeps the link, so it stays, and so does the owner.
        assert_eq!(driver.sweep_orphans(), 1);
        assert!(outside.join("exec-x").is_dir());
        assert!(t.path().join("runs/d0/odd.name/exec-y").is_dir());
        assert!(!t.path().join("runs/d0/group-1/exec-in").exists());
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

    #[test]
    fn v2_create_never_adopts_a_cgroup_made_concurrently() {
        let t = fake_v2();
        let driver = V2Driver::prepare(t.path(), false).unwrap();
        let runs = t.path().join("runs").join(owner_name());
        assert_never_adopts(Arc::new(driver), |n| runs.join(n));
    }
}
