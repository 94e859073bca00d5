//! cgroup v1: the daemon's owner directories under its own cgroup in each hierarchy (memory,
//! cpu, pids, freezer), and each run's cgroup as one directory per hierarchy.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cgroups_rs::cpu::CpuController;
use cgroups_rs::freezer::FreezerController;
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::{Cgroup, MaxValue};

use super::{
    CgroupDriver, CgroupStats, CgroupVersion, Dirs, RunCgroup, cg_err, cpu_ns_of_tree, cpu_quota,
    create_dirs, ctl, delete_retry, keyed_value, kill_pids, kill_until_empty, owner_name, pids_in,
    procs_of, read_u64, rmdir_retry, sweep_dir, sweep_owners, valid_run_name, valid_run_path,
    write_file,
};
use crate::sandbox::Limits;

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
        if !valid_run_path(name) {
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
                let n = sweep_dir(owner, &mut |dir| {
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

    /// `cpuacct.usage` is read from the cpu hierarchy when cpuacct is mounted with cpu; else
    /// the CPU time of the processes the memory hierarchy lists here and below.
    fn usage(&self) -> crate::sandbox::Usage {
        crate::sandbox::Usage {
            memory_bytes: read_u64(&self.dirs.memory.join("memory.usage_in_bytes")).unwrap_or(0),
            cache_bytes: keyed_value(&self.dirs.memory.join("memory.stat"), "total_cache")
                .unwrap_or(0),
            cpu_ns: read_u64(&self.dirs.cpu.join("cpuacct.usage"))
                .unwrap_or_else(|| cpu_ns_of_tree(&self.dirs.memory)),
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

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_never_adopts, limits};
    use super::super::{detect, read_trimmed};
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

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

    /// The sweep kills what a dead owner's runs list, a group's runs included, and removes them
    /// and then the group; it never follows a symlink out of the owner, nor enters or removes a
    /// directory whose name no run or group has.
    #[test]
    fn v1_sweep_kills_a_groups_runs_and_nothing_past_a_symlink_or_an_odd_name() {
        let (t, driver) = fake_v1();
        let mut inside = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let dead = t.path().join("pids/executor-arm/d0");
        let outside = t.path().join("outside");
        fs::create_dir_all(outside.join("exec-x")).unwrap();
        fs::create_dir_all(dead.join("group-1/exec-in")).unwrap();
        fs::write(
            dead.join("group-1/exec-in/cgroup.procs"),
            format!("{}\n", inside.id()),
        )
        .unwrap();
        fs::create_dir_all(dead.join("group-3/exec-gone")).unwrap();
        std::os::unix::fs::symlink(&outside, dead.join("group-2")).unwrap();
        fs::create_dir_all(dead.join("odd.name/exec-y")).unwrap();
        // group-3 and its run; group-1's run is killed but keeps its (fake) procs file.
        assert_eq!(driver.sweep_orphans(), 2);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while inside.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "a group's run was not killed"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!dead.join("group-3").exists());
        assert!(outside.join("exec-x").is_dir(), "swept through a symlink");
        assert!(dead.join("odd.name/exec-y").is_dir());
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

    #[test]
    fn v1_create_never_adopts_a_cgroup_made_concurrently() {
        let (t, driver) = fake_v1();
        let pids = t.path().join("pids/executor-arm").join(owner_name());
        assert_never_adopts(Arc::new(driver), |n| pids.join(n));
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
}
