//! Keeps the kernel's cgroup `favordynmods` mode on while the daemon runs.
//!
//! Owns: one detached mount of a named, controller-less cgroup v1 hierarchy created with the
//! `favordynmods` option. Must not: appear in any mount table.
//!
//! Why: every migration of a process into a cgroup (a write to `cgroup.procs`, which each run
//! slot's shim does once per hierarchy) takes the kernel's global threadgroup rwsem for writing.
//! Out of `favordynmods` mode that write first waits for an RCU grace period — 10–20 ms on this
//! project's hosts — and every `fork`/`clone` on the host, the next run's included, waits behind
//! it: measured with `strace -T`, the slowest `cgroup.procs` writes took 16–19 ms and the runs
//! started meanwhile took as long. In `favordynmods` mode the rwsem stays on its slow path for
//! readers (forks and exits cost a little more) and writers wait for no grace period.
//!
//! The mode belongs to a cgroup root but switches the one rwsem all hierarchies share, so any
//! root holding it is enough. The hierarchy is made with the new mount API (`fsopen`,
//! `fsconfig`, `fsmount`) and never attached anywhere: the daemon holds only the mount's file
//! descriptor, so no mount table shows it and no namespace keeps a copy of the host's mounts.
//! When the descriptor is closed — by [`Drop`] or by the kernel when the daemon dies however it
//! dies — the last reference goes, the kernel destroys the root and the mode returns to what it
//! was. Two daemons share the hierarchy (by its name) and the mode lasts until both are gone.
//!
//! A named hierarchy exists for every process on the host while it lives: it shows as a line
//! in each `/proc/<pid>/cgroup` (a sandbox sees it too; its files are root's, and a sandbox has
//! no cgroupfs mounted and may not mount one), and a user who may create user namespaces can
//! mount it by name and so keep it, and the mode, alive after the daemon exits. That prolongs the
//! mode and grants nothing else (no file of it is writable by that user).

use std::io;
use std::os::fd::OwnedFd;

use rustix::mount::{
    FsMountFlags, FsOpenFlags, MountAttrFlags, fsconfig_create, fsconfig_set_flag,
    fsconfig_set_string, fsmount, fsopen,
};

/// The named hierarchy's name.
pub const HIERARCHY: &str = "executor-arm-dynmods";

/// While alive, the host is in `favordynmods` mode (see the module docs).
pub struct FavorDynMods {
    _mount: OwnedFd,
}

impl FavorDynMods {
    /// Creates (or joins) the hierarchy; fails when the kernel refuses (no cgroup v1, no
    /// `favordynmods` before Linux 6.1, no new mount API before 5.2, no CAP_SYS_ADMIN).
    pub fn hold() -> io::Result<FavorDynMods> {
        Self::hold_named(HIERARCHY)
    }

    fn hold_named(name: &str) -> io::Result<FavorDynMods> {
        let fs = fsopen("cgroup", FsOpenFlags::FSOPEN_CLOEXEC)?;
        fsconfig_set_flag(&fs, "none")?;
        fsconfig_set_string(&fs, "name", name)?;
        fsconfig_set_flag(&fs, "favordynmods")?;
        fsconfig_create(&fs)?;
        let mount = fsmount(
            &fs,
            FsMountFlags::FSMOUNT_CLOEXEC,
            MountAttrFlags::MOUNT_ATTR_NOSUID
                | MountAttrFlags::MOUNT_ATTR_NODEV
                | MountAttrFlags::MOUNT_ATTR_NOEXEC,
        )?;
        Ok(FavorDynMods { _mount: mount })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hierarchy_listed(name: &str) -> bool {
        std::fs::read_to_string("/proc/self/cgroup")
            .unwrap()
            .lines()
            .any(|l| l.contains(&format!(":name={name}:")))
    }

    fn in_a_mount_table(name: &str) -> bool {
        ["/proc/self/mountinfo", "/proc/1/mountinfo"]
            .iter()
            .any(|p| std::fs::read_to_string(p).unwrap().contains(name))
    }

    #[test]
    #[ignore = "needs root (mounts a cgroup v1 hierarchy): scripts/test-all.sh runs it as root"]
    fn the_mode_is_held_by_a_descriptor_no_mount_table_shows() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        // A name of its own: a daemon on this host may hold the shared one meanwhile.
        let name = format!("{HIERARCHY}-test-{}", std::process::id());
        let held = FavorDynMods::hold_named(&name).expect("favordynmods on this kernel");
        assert!(hierarchy_listed(&name), "the hierarchy exists while held");
        assert!(!in_a_mount_table(&name), "and is mounted nowhere");
        drop(held);
        // The kernel destroys the root once the last reference is gone (asynchronously).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while hierarchy_listed(&name) {
            assert!(
                std::time::Instant::now() < deadline,
                "the hierarchy outlived its holder"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
