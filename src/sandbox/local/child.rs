//! What runs between fork and exec for a local sandbox.
//!
//! [`ChildPlan`] is built in the daemon (allocations, path strings, the Landlock ruleset fd, the
//! seccomp program); [`ChildPlan::enter`] runs in the forked child and uses only async-signal-safe
//! syscalls on that prepared memory. The process tree is:
//!
//! ```text
//! daemon ── shim (host pid ns, in the run's cgroup) ── init (pid 1 of the new pid ns) ── command
//! ```
//!
//! `init` builds the root and reaps orphans; when the command exits it reports the status on the
//! status pipe and exits, and the kernel then kills everything left in the pid namespace.

use std::ffi::CString;
use std::os::raw::c_char;

use super::landlock::{self, PathBeneathAttr};

/// Setup stages, reported with errno on the status pipe when one fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    JoinCgroup = 1,
    Unshare,
    Fork,
    MountPrivate,
    MountRoot,
    MountPlan,
    PivotRoot,
    RemountRoot,
    Landlock,
    SetHostname,
    Chdir,
    Rlimit,
    SetGroups,
    SetUid,
    NoNewPrivs,
    LandlockRestrict,
    Seccomp,
    Exec,
    WaitEgress,
}

impl Stage {
    pub fn from_u8(v: u8) -> &'static str {
        const NAMES: [&str; 20] = [
            "unknown",
            "join cgroup",
            "unshare namespaces",
            "fork",
            "make mounts private",
            "mount sandbox root",
            "mount sandbox paths",
            "pivot_root",
            "remount root read-only",
            "landlock rules",
            "sethostname",
            "chdir to workdir",
            "setrlimit",
            "setgroups",
            "setuid/setgid",
            "no_new_privs",
            "landlock restrict_self",
            "seccomp",
            "execve",
            "wait for the egress proxy",
        ];
        NAMES.get(v as usize).copied().unwrap_or("unknown")
    }
}

/// Status records on the pipe: tag, stage, two pad bytes, i32 value (errno / code / signal).
pub const TAG_SETUP_ERROR: u8 = b'E';
pub const TAG_EXITED: u8 = b'X';
pub const TAG_SIGNALED: u8 = b'S';
pub const RECORD_LEN: usize = 8;

/// One mount-namespace operation; every path already carries the new-root prefix.
pub enum MountOp {
    Mkdir(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    TouchFile(CString),
    BindReadOnly {
        src: CString,
        dst: CString,
    },
    BindDevice {
        src: CString,
        dst: CString,
    },
    Tmpfs {
        dst: CString,
        options: CString,
        noexec: bool,
    },
    /// mkdir, then chmod and chown (the mode is explicit: mkdir's is cut by the umask).
    MkdirOwned {
        path: CString,
        mode: u32,
        uid: u32,
        gid: u32,
    },
    /// A writable bind (of a directory of the scratch tmpfs), nosuid, nodev, noexec.
    BindWritable {
        src: CString,
        dst: CString,
    },
    /// Detach a staging mount and remove its (now empty) mount point.
    Detach(CString),
    Proc(CString),
}

/// A Landlock rule to add after the mounts, by path inside the new root.
pub struct LandlockRule {
    pub path: CString,
    pub access: u64,
}

/// Everything the child needs, prepared before fork.
pub struct ChildPlan {
    pub cgroup_procs: Vec<CString>,
    pub root: CString,
    pub root_options: CString,
    pub mounts: Vec<MountOp>,
    pub landlock_fd: i32,
    pub landlock_rules: Vec<LandlockRule>,
    pub hostname: CString,
    pub workdir: CString,
    pub rlimits: Vec<(libc::__rlimit_resource_t, u64)>,
    pub uid: u32,
    pub gid: u32,
    pub seccomp: libc::sock_fprog,
    pub program: CString,
    pub argv_ptrs: Vec<*const c_char>,
    pub envp_ptrs: Vec<*const c_char>,
    pub status_fd: i32,
    /// Read end of the go-signal pipe (-1: none). With egress, the daemon binds the proxy
    /// listener inside our network namespace and then writes one byte; the command starts after.
    pub sync_fd: i32,
    // Owners of the memory argv_ptrs / envp_ptrs point into.
    pub _argv: Vec<CString>,
    pub _envp: Vec<CString>,
}

// SAFETY: the raw pointers point into CStrings owned by the same struct; the plan is built on
// one thread and only read (after fork) by the child.
unsafe impl Send for ChildPlan {}
unsafe impl Sync for ChildPlan {}

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const AT_RECURSIVE: u32 = 0x8000;

/// Makes the bind at `dst` read-only, nosuid and nodev, submounts included: MS_REC copies the
/// host's mounts below a bound path (a volume under /usr, a file bind under /etc), and a
/// MS_REMOUNT reaches only the top one, leaving those writable. Kernels before 5.12 lack
/// mount_setattr (ENOSYS): there the top mount is remounted and Landlock's read-only rule, which
/// covers everything beneath the path, is what protects submounts. Async-signal-safe.
///
/// # Safety
/// `dst` is a live C string; called in the child only.
/// Binds `src` on `dst` (one mount, not recursive), then remounts the bind with `flags`.
/// Async-signal-safe: two mount(2) calls on prepared strings.
unsafe fn bind_remount(src: &CString, dst: &CString, flags: libc::c_ulong) -> bool {
    // SAFETY: mount(2) with NUL-terminated strings owned by the plan and null data.
    unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) == 0
            && libc::mount(
                std::ptr::null(),
                dst.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_BIND | flags,
                std::ptr::null(),
            ) == 0
    }
}

unsafe fn read_only_recursive(dst: &CString) -> bool {
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr(2) with a C string and a pointer to a live struct of the size given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            dst.as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r == 0 {
        return true;
    }
    if errno() != libc::ENOSYS {
        return false;
    }
    let flags =
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    // SAFETY: mount(2) with a C string and null pointers where the remount takes none.
    unsafe {
        libc::mount(
            std::ptr::null(),
            dst.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        ) == 0
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Writes one status record. Async-signal-safe.
fn report(fd: i32, tag: u8, stage: u8, value: i32) {
    let v = value.to_le_bytes();
    let rec: [u8; RECORD_LEN] = [tag, stage, 0, 0, v[0], v[1], v[2], v[3]];
    // SAFETY: write(2) from a stack buffer of the length given.
    unsafe { libc::write(fd, rec.as_ptr().cast(), RECORD_LEN) };
}

fn fail(fd: i32, stage: Stage) -> ! {
    report(fd, TAG_SETUP_ERROR, stage as u8, errno());
    // SAFETY: _exit is async-signal-safe and never returns.
    unsafe { libc::_exit(126) }
}

/// Closes every fd >= 3 except the listed ones (sorted ascending).
fn close_other_fds(keep: &[i32]) {
    let mut from = 3u32;
    for &k in keep {
        if k < 3 {
            continue;
        }
        let k = k as u32;
        if k > from {
            // SAFETY: close_range(2) on a numeric range; no memory involved.
            unsafe { libc::syscall(libc::SYS_close_range, from, k - 1, 0u32) };
        }
        from = k + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
}

impl ChildPlan {
    /// Runs in the forked child (the shim). Never returns: every branch execs or `_exit`s.
    ///
    /// The order is the security argument, so each step says why it sits where it does.
    ///
    /// # Safety
    /// Must be called only in a freshly forked child of the daemon, with the plan's memory intact.
    pub unsafe fn enter(&self) -> ! {
        let sfd = self.status_fd;
        // SAFETY (whole function): only async-signal-safe syscalls on memory prepared before fork.
        unsafe {
            // 1. Die with the daemon: no sandbox outlives it unattended (restart sweeps the rest).
            //    The daemon forks from one dedicated thread that lives as long as it does.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);

            // 2. Join the run's cgroup before anything else can fork, so every process of the run,
            //    however it detaches later (setsid, double fork), is in the cgroup we kill.
            for path in &self.cgroup_procs {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    fail(sfd, Stage::JoinCgroup);
                }
                libc::close(fd);
            }

            // 3. New mount, ipc, uts, net and cgroup namespaces for this process; a new pid
            //    namespace for its children. The net namespace has only a down loopback: no route.
            let flags = libc::CLONE_NEWNS
                | libc::CLONE_NEWPID
                | libc::CLONE_NEWNET
                | libc::CLONE_NEWIPC
                | libc::CLONE_NEWUTS
                | libc::CLONE_NEWCGROUP;
            if libc::unshare(flags) != 0 {
                fail(sfd, Stage::Unshare);
            }

            // 4. Fork pid 1 of the new pid namespace. The shim keeps nothing open (so pipes see EOF
            //    only from the sandbox) and waits; its exit tells the daemon the sandbox is gone.
            let init = libc::fork();
            if init < 0 {
                fail(sfd, Stage::Fork);
            }
            if init > 0 {
                libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32);
                let mut st = 0;
                while libc::waitpid(init, &mut st, 0) < 0 && errno() == libc::EINTR {}
                libc::_exit(0);
            }
            self.init_and_exec()
        }
    }

    /// pid 1 of the sandbox: builds the root, forks the command, reaps until it exits.
    unsafe fn init_and_exec(&self) -> ! {
        let sfd = self.status_fd;
        // SAFETY (whole function): async-signal-safe syscalls on prepared memory only.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);

            // 5. Nothing we mount may propagate back to the host.
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                fail(sfd, Stage::MountPrivate);
            }

            // 6. The new root is an empty tmpfs: only what the profile names appears in it.
            if libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                self.root_options.as_ptr().cast(),
            ) != 0
            {
                fail(sfd, Stage::MountRoot);
            }

            // 7. Read-only binds of the profile's paths; the workdir and /tmp, both bound from one
            //    private tmpfs sized to the disk limit (so the limit holds for the two together;
            //    its staging mount point is detached and removed again here); a fresh /proc (we
            //    are pid 1 of the new pid namespace, so it shows only the sandbox) and a /dev with
            //    null, zero, random, urandom.
            for op in &self.mounts {
                if !self.apply(op) {
                    fail(sfd, Stage::MountPlan);
                }
            }

            // 8. Swap roots and drop the old one entirely: host paths are no longer reachable.
            if libc::chdir(self.root.as_ptr()) != 0
                || libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0
                || libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0
                || libc::chdir(c"/".as_ptr()) != 0
            {
                fail(sfd, Stage::PivotRoot);
            }

            // 9. The root tmpfs itself becomes read-only now that its skeleton is built.
            if libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT
                    | libc::MS_BIND
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV,
                std::ptr::null(),
            ) != 0
            {
                fail(sfd, Stage::RemountRoot);
            }

            // 10. Landlock rules for paths as they exist in the new root (the fresh mounts have no
            //     host fd the daemon could have opened before fork). The ruleset itself, with its
            //     handled rights, was created before fork.
            if self.landlock_fd >= 0 {
                for rule in &self.landlock_rules {
                    let fd = libc::open(rule.path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
                    if fd < 0 {
                        fail(sfd, Stage::Landlock);
                    }
                    let attr = PathBeneathAttr {
                        allowed_access: rule.access,
                        parent_fd: fd,
                    };
                    if landlock::add_path_rule(self.landlock_fd, &attr) != 0 {
                        fail(sfd, Stage::Landlock);
                    }
                    libc::close(fd);
                }
            }

            if libc::sethostname(self.hostname.as_ptr(), self.hostname.as_bytes().len()) != 0 {
                fail(sfd, Stage::SetHostname);
            }

            // 11. Only the status pipe, the ruleset and the go-signal pipe survive; the command
            //     gets 0-2 only.
            let mut keep = [sfd, self.landlock_fd, self.sync_fd];
            keep.sort_unstable();
            close_other_fds(&keep);

            // 12. With egress, wait until the daemon's proxy listens in our network namespace:
            //     the command must never race it. EOF means the daemon gave up on this run.
            if self.sync_fd >= 0 {
                let mut b = 0u8;
                loop {
                    let n = libc::read(self.sync_fd, (&mut b as *mut u8).cast(), 1);
                    if n == 1 {
                        break;
                    }
                    if n < 0 && errno() == libc::EINTR {
                        continue;
                    }
                    fail(sfd, Stage::WaitEgress);
                }
                libc::close(self.sync_fd);
            }

            let cmd = libc::fork();
            if cmd < 0 {
                fail(sfd, Stage::Fork);
            }
            if cmd == 0 {
                self.command();
            }

            // 13. pid 1: drop our copies of the stdio pipes (EOF and EPIPE then depend only on the
            //     command), reap everything, report the command's own status, exit. Exiting kills
            //     whatever it left behind in the namespace.
            libc::close(0);
            libc::close(1);
            libc::close(2);
            if self.landlock_fd >= 0 {
                libc::close(self.landlock_fd);
            }
            loop {
                let mut st = 0;
                let pid = libc::waitpid(-1, &mut st, 0);
                if pid < 0 {
                    if errno() == libc::EINTR {
                        continue;
                    }
                    libc::_exit(125);
                }
                if pid == cmd {
                    if libc::WIFEXITED(st) {
                        report(sfd, TAG_EXITED, 0, libc::WEXITSTATUS(st));
                    } else if libc::WIFSIGNALED(st) {
                        report(sfd, TAG_SIGNALED, 0, libc::WTERMSIG(st));
                    }
                    libc::_exit(0);
                }
            }
        }
    }

    /// The command process: limits, identity, Landlock, seccomp, exec.
    unsafe fn command(&self) -> ! {
        let sfd = self.status_fd;
        // SAFETY (whole function): async-signal-safe syscalls on prepared memory only.
        unsafe {
            // 14. Own session: no controlling terminal, no signals from the daemon's group.
            libc::setsid();
            if libc::chdir(self.workdir.as_ptr()) != 0 {
                fail(sfd, Stage::Chdir);
            }
            // 15. rlimits while still privileged (raising hard limits needs CAP_SYS_RESOURCE).
            for &(res, val) in &self.rlimits {
                let rl = libc::rlimit {
                    rlim_cur: val,
                    rlim_max: val,
                };
                if libc::setrlimit(res, &rl) != 0 {
                    fail(sfd, Stage::Rlimit);
                }
            }
            // 16. Become the unprivileged user: groups first (needs CAP_SETGID), then gid, then uid
            //     (after which no capability is left).
            if libc::setgroups(0, std::ptr::null()) != 0 {
                fail(sfd, Stage::SetGroups);
            }
            if libc::setresgid(self.gid, self.gid, self.gid) != 0
                || libc::setresuid(self.uid, self.uid, self.uid) != 0
            {
                fail(sfd, Stage::SetUid);
            }
            // 17. no_new_privs: required for unprivileged Landlock and seccomp, and makes setuid
            //     binaries inert.
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                fail(sfd, Stage::NoNewPrivs);
            }
            // 18. Landlock: from here the filesystem (and TCP, and signals/abstract sockets on
            //     ABI >= 6) is limited to the rules above, whatever the mounts say.
            if self.landlock_fd >= 0 {
                if landlock::restrict_self(self.landlock_fd) != 0 {
                    fail(sfd, Stage::LandlockRestrict);
                }
                libc::close(self.landlock_fd);
            }
            // 19. seccomp last: the filter would refuse nothing we still need, but installing it
            //     after everything else keeps the setup itself free of surprises.
            if super::seccomp::install(&self.seccomp) != 0 {
                fail(sfd, Stage::Seccomp);
            }
            // 20. exec. The status pipe is O_CLOEXEC, so the program sees fds 0-2 only.
            libc::execve(
                self.program.as_ptr(),
                self.argv_ptrs.as_ptr(),
                self.envp_ptrs.as_ptr(),
            );
            fail(sfd, Stage::Exec);
        }
    }

    unsafe fn apply(&self, op: &MountOp) -> bool {
        // SAFETY: syscalls on CStrings owned by the plan.
        unsafe {
            match op {
                MountOp::Mkdir(p) => libc::mkdir(p.as_ptr(), 0o755) == 0 || errno() == libc::EEXIST,
                MountOp::Symlink { target, link } => {
                    libc::symlink(target.as_ptr(), link.as_ptr()) == 0
                }
                MountOp::TouchFile(p) => {
                    let fd = libc::open(
                        p.as_ptr(),
                        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                        0o644,
                    );
                    fd >= 0 && libc::close(fd) == 0
                }
                MountOp::BindReadOnly { src, dst } => {
                    libc::mount(
                        src.as_ptr(),
                        dst.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND | libc::MS_REC,
                        std::ptr::null(),
                    ) == 0
                        && read_only_recursive(dst)
                }
                MountOp::BindDevice { src, dst } => {
                    bind_remount(src, dst, libc::MS_NOSUID | libc::MS_NOEXEC)
                }
                MountOp::Tmpfs {
                    dst,
                    options,
                    noexec,
                } => {
                    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
                    if *noexec {
                        flags |= libc::MS_NOEXEC;
                    }
                    libc::mount(
                        c"tmpfs".as_ptr(),
                        dst.as_ptr(),
                        c"tmpfs".as_ptr(),
                        flags,
                        options.as_ptr().cast(),
                    ) == 0
                }
                MountOp::MkdirOwned {
                    path,
                    mode,
                    uid,
                    gid,
                } => {
                    libc::mkdir(path.as_ptr(), 0o700) == 0
                        && libc::chmod(path.as_ptr(), *mode) == 0
                        && libc::chown(path.as_ptr(), *uid, *gid) == 0
                }
                MountOp::BindWritable { src, dst } => {
                    bind_remount(src, dst, libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC)
                }
                MountOp::Detach(p) => {
                    libc::umount2(p.as_ptr(), libc::MNT_DETACH) == 0 && libc::rmdir(p.as_ptr()) == 0
                }
                MountOp::Proc(dst) => {
                    libc::mount(
                        c"proc".as_ptr(),
                        dst.as_ptr(),
                        c"proc".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                        std::ptr::null(),
                    ) == 0
                }
            }
        }
    }
}
