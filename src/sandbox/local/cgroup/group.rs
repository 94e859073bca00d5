//! Groups of runs that count together: a session's runs (foreground execs, background processes,
//! terminals) share its pids, memory and CPU limits. A group is a parent cgroup holding those
//! limits and no process; each run is a cgroup under it with its own limits too, so one run is
//! held as before and all of them are held together.
//!
//! A group lives exactly as long as a run of it does: every run holds it, and the last one to
//! go removes it. The next run of the same group (a session's next exec) makes a new one under
//! a new name, so a group still being removed is never reused or raced.
//!
//! What a group's limits also hold: memory the kernel charged to its runs and kept after them,
//! such as the pages of files a run wrote to the session's workspace (a tmpfs), stays charged to
//! the group while it lives, as a container's workspace stays charged to the container.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::{CgroupDriver, CgroupStats, RunCgroup};
use crate::sandbox::Limits;

/// The live groups of one driver, by the key their runs name (a session's id).
pub struct Groups {
    driver: Arc<dyn CgroupDriver>,
    live: Mutex<HashMap<String, Weak<Group>>>,
    /// Names this daemon's groups apart from an earlier daemon's that had the same pid (so the
    /// same owner directory, which its start does not sweep): a container's daemon is often
    /// pid 1 every time.
    start: String,
    seq: AtomicU64,
}

/// One group's cgroup, removed when its last run lets go of it.
struct Group {
    cg: Box<dyn RunCgroup>,
    /// Its directory's name under the driver's owner directory.
    name: String,
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Err(e) = self.cg.remove() {
            tracing::error!(error = %e, group = %self.name, "could not remove a run group's cgroup");
        }
    }
}

impl Groups {
    pub fn new(driver: Arc<dyn CgroupDriver>) -> Self {
        Groups {
            driver,
            live: Mutex::new(HashMap::new()),
            start: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
        }
    }

    /// Creates run `name`'s cgroup with `limits` inside group `key`, made with the same limits
    /// when no run of it lives. Blocking (cgroup directories are made here).
    pub fn create_run(
        &self,
        key: &str,
        name: &str,
        limits: &Limits,
    ) -> io::Result<Box<dyn RunCgroup>> {
        let group = {
            let mut live = self
                .live
                .lock()
                .map_err(|_| io::Error::other("run groups poisoned"))?;
            match live.get(key).and_then(Weak::upgrade) {
                Some(g) => g,
                None => {
                    let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                    let name = format!("group-{}-{seq}", self.start);
                    let cg = self.driver.create_group(&name, limits)?;
                    let g = Arc::new(Group { cg, name });
                    live.retain(|_, w| w.strong_count() > 0);
                    live.insert(key.to_string(), Arc::downgrade(&g));
                    g
                }
            }
        };
        // Made outside the lock: a run's limits are written here, and other groups' runs need
        // not wait for them. A failure drops `group`, which removes it if it was the last.
        let run = self
            .driver
            .create(&format!("{}/{name}", group.name), limits)?;
        Ok(Box::new(GroupRun { run, _group: group }))
    }
}

impl Groups {
    /// What group `key`'s runs use together now (None: no run of it lives).
    pub fn usage(&self, key: &str) -> Option<crate::sandbox::Usage> {
        let group = self.live.lock().ok()?.get(key).and_then(Weak::upgrade)?;
        Some(group.cg.usage())
    }
}

/// A run inside a group. Fields drop in order: the run's cgroup first, then the group's hold.
struct GroupRun {
    run: Box<dyn RunCgroup>,
    _group: Arc<Group>,
}

impl RunCgroup for GroupRun {
    fn procs_files(&self) -> Vec<PathBuf> {
        self.run.procs_files()
    }
    fn kill_all(&self) -> io::Result<()> {
        self.run.kill_all()
    }
    fn pids(&self) -> Vec<i32> {
        self.run.pids()
    }
    fn stats(&self) -> CgroupStats {
        self.run.stats()
    }
    fn usage(&self) -> crate::sandbox::Usage {
        self.run.usage()
    }

    fn is_empty(&self) -> bool {
        self.run.is_empty()
    }
    fn remove(&self) -> io::Result<()> {
        self.run.remove()
    }
    fn apply_limits(&self, limits: &Limits) -> io::Result<()> {
        self.run.apply_limits(limits)
    }
    /// A run of a group keeps the name it was made with (it is never a prepared slot).
    fn rename(&mut self, _name: &str) {}
}

#[cfg(test)]
mod tests {
    use super::super::tests::limits;
    use super::super::{V1Driver, owner_name};
    use super::*;
    use std::path::Path;

    /// A fake v1 mount root with the four hierarchies, and a driver on it.
    fn fake_v1() -> (tempfile::TempDir, Arc<dyn CgroupDriver>) {
        let t = tempfile::tempdir().unwrap();
        for c in ["memory", "cpu", "pids", "freezer"] {
            std::fs::create_dir_all(t.path().join(c)).unwrap();
            std::fs::write(t.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let self_cg = "4:memory:/\n1:cpu:/\n8:pids:/\n6:freezer:/\n";
        let d = V1Driver::prepare(t.path(), self_cg, "executor-arm").unwrap();
        (t, Arc::new(d))
    }

    /// The directories under `root`, as paths relative to it, sorted.
    fn dirs_under(root: &Path) -> Vec<String> {
        fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
                    walk(root, &p, out);
                }
            }
        }
        let mut out = vec![];
        walk(root, root, &mut out);
        out.sort();
        out
    }

    /// Runs of one key share one group directory, which holds the limits; runs of another key
    /// get their own; once the last run of a key lets go, its next run makes a new group under
    /// a new name (the old one may still be on its way out).
    #[test]
    fn runs_of_a_key_share_a_group_until_the_last_lets_go() {
        let (t, driver) = fake_v1();
        let groups = Groups::new(driver);
        let owner = t.path().join("pids/executor-arm").join(owner_name());
        let g = |n: u32| format!("group-{}-{n}", groups.start);
        let a = groups.create_run("s1", "exec-a", &limits()).unwrap();
        let b = groups.create_run("s1", "exec-b", &limits()).unwrap();
        let c = groups.create_run("s2", "exec-c", &limits()).unwrap();
        assert_eq!(
            dirs_under(&owner),
            [
                g(0),
                format!("{}/exec-a", g(0)),
                format!("{}/exec-b", g(0)),
                g(1),
                format!("{}/exec-c", g(1))
            ]
        );
        for dir in [g(0), format!("{}/exec-a", g(0))] {
            assert_eq!(
                std::fs::read_to_string(owner.join(&dir).join("pids.max")).unwrap(),
                "16",
                "{dir}"
            );
        }
        assert!(
            a.procs_files()
                .contains(&owner.join(g(0)).join("exec-a/cgroup.procs"))
        );
        drop(a);
        let d = groups.create_run("s1", "exec-d", &limits()).unwrap();
        assert!(
            owner.join(g(0)).join("exec-d").is_dir(),
            "b still holds the group"
        );
        drop((b, d));
        let e = groups.create_run("s1", "exec-e", &limits()).unwrap();
        assert!(
            owner.join(g(2)).join("exec-e").is_dir(),
            "a new group, never the old name"
        );
        drop((c, e));
    }

    /// A daemon that got an earlier one's pid (a container's pid 1) shares its owner directory,
    /// which its start does not sweep: a group the earlier one left there must not stop its own.
    #[test]
    fn a_group_left_by_a_daemon_with_the_same_pid_is_no_obstacle() {
        let (_t, driver) = fake_v1();
        let earlier = Groups::new(driver.clone());
        let left = earlier.create_run("s1", "exec-a", &limits()).unwrap();
        std::mem::forget(left);
        let now = Groups::new(driver);
        assert!(now.create_run("s1", "exec-b", &limits()).is_ok());
    }

    /// Run names are checked like every run's: nothing climbs out of its group.
    #[test]
    fn a_run_name_cannot_leave_its_group() {
        let (_t, driver) = fake_v1();
        let groups = Groups::new(driver);
        for bad in ["../x", "a/b", ""] {
            assert!(groups.create_run("s1", bad, &limits()).is_err(), "{bad}");
        }
    }
}
