//! What runs between clone and exec for a local sandbox.
//!
//! [`ChildPlan`] is built in the daemon (allocations, path strings, the Landlock ruleset fd, the
//! seccomp program, the children's stacks); [`ChildPlan::spawn_and_wait`] starts the sandbox and
//! the code it starts uses only async-signal-safe syscalls on that prepared memory. The process
//! tree is:
//!
//! ```text
//! daemon ── shim (host pid ns, in the run's cgroup) ── init (pid 1 of the new pid ns) ── command
//! ```
//!
//! `init` builds the root and reaps orphans; when the command exits it reports the status on the
//! status pipe and exits, and the kernel then kills everything left in the pid namespace.
//!
//! Shim, init and the command (until its execve) are `CLONE_VM | CLONE_VFORK` children, the way
//! posix_spawn starts a program: none copies the daemon's page tables, and each parent is
//! suspended while its child uses the shared memory, so exactly one of spawning thread, shim,
//! init and pre-exec command runs at a time on that thread's TLS. The kernel never picks a vfork
//! child sharing its parent's memory as an OOM victim (`in_vfork`), so a memory bomb in the run's
//! cgroup cannot make the OOM killer take the daemon down with a shim. Consequences the code
//! honours: no glibc call that keeps process-wide state (setuid and friends go through raw
//! syscalls, since glibc's wrappers would signal the daemon's threads), every signal handler of
//! the daemon is reset before signals are unblocked, and the stacks outlive every child (the
//! daemon frees them only once the run's cgroup is empty).

use std::ffi::CString;
use std::os::raw::c_char;
use std::sync::Arc;
use std::sync::atomic::Ordering;

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
    Stdio,
    Hello,
}

impl Stage {
    pub fn from_u8(v: u8) -> &'static str {
        const NAMES: [&str; 22] = [
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
            "stdio",
            "report pid",
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
    /// A devpts instance of the sandbox's own (a terminal's): nosuid, noexec, never the host's
    /// ptys.
    Devpts(CString),
}

/// A Landlock rule to add after the mounts, by path inside the new root.
pub struct LandlockRule {
    pub path: CString,
    pub access: u64,
}

/// The three children's stacks: one anonymous mapping, a PROT_NONE guard page below each stack,
/// so an overflow faults in the child instead of writing into the daemon's memory.
pub struct Stacks {
    base: *mut libc::c_void,
    len: usize,
    page: usize,
}

const STACK_BYTES: usize = 256 * 1024;

impl Stacks {
    pub fn new() -> std::io::Result<Stacks> {
        // SAFETY: sysconf has no memory arguments.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let len = 3 * (STACK_BYTES + page);
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let stacks = Stacks { base, len, page };
        for i in 0..3 {
            // SAFETY: the guard page lies inside the mapping just made.
            if unsafe { libc::mprotect(stacks.region(i).cast(), page, libc::PROT_NONE) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(stacks)
    }

    fn region(&self, i: usize) -> *mut u8 {
        // SAFETY: i < 3, so the offset stays inside the mapping.
        unsafe { self.base.cast::<u8>().add(i * (STACK_BYTES + self.page)) }
    }

    /// Top of stack `i` (stacks grow down; glibc's clone aligns it).
    fn top(&self, i: usize) -> *mut libc::c_void {
        // SAFETY: the end of region i, still inside (or one past) the mapping.
        unsafe { self.region(i).add(self.page + STACK_BYTES).cast() }
    }
}

// SAFETY: the mapping is owned by the struct and only handed to children as stack memory.
unsafe impl Send for Stacks {}
// SAFETY: shared references only compute addresses inside the mapping; nothing writes through
// them in the daemon.
unsafe impl Sync for Stacks {}

impl Drop for Stacks {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping we made; the owner guarantees no child runs on it.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

const SHIM_STACK: usize = 0;
const INIT_STACK: usize = 1;
const COMMAND_STACK: usize = 2;

/// Everything the child needs, prepared before clone.
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
    /// The seccomp programs, installed in order (they point into the daemon's
    /// [`super::seccomp::SeccompProgram`], kept alive with the run).
    pub seccomp: Vec<libc::sock_fprog>,
    pub program: CString,
    pub argv_ptrs: Vec<*const c_char>,
    pub envp_ptrs: Vec<*const c_char>,
    pub status_fd: i32,
    /// The command's stdin, stdout and stderr (the child's ends).
    pub stdio: [i32; 3],
    /// Write end of the hello pipe (-1: none): the shim writes its host pid there once its
    /// namespaces exist, for a daemon that has to enter them (egress).
    pub hello_fd: i32,
    pub stacks: Arc<Stacks>,
    pub shim_state: ShimState,
    /// Read end of the go-signal pipe (-1: none). With egress, the daemon binds the proxy
    /// listener inside our network namespace and then writes one byte; the command starts after.
    pub sync_fd: i32,
    /// The descriptors above (status, stdio, and the ruleset, go-signal and hello ends where
    /// present), in the order a prepared shim receives them (see [`WarmShim`]).
    pub passed_fds: Vec<i32>,
    /// `passed_fds` sorted: what a shim keeps of the fd table it starts with.
    pub keep_fds: Vec<i32>,
    // Owners of the memory argv_ptrs / envp_ptrs point into.
    pub _argv: Vec<CString>,
    pub _envp: Vec<CString>,
}

// SAFETY: the raw pointers point into CStrings owned by the same struct; the plan is built on one
// thread and only read by the children it starts.
unsafe impl Send for ChildPlan {}
// SAFETY: as for Send: after it is built the plan is only read, never written.
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

/// Binds `src` on `dst` (one mount, not recursive), then remounts the bind with `flags`.
/// Async-signal-safe: two mount(2) calls on prepared strings.
///
/// # Safety
/// Called in the sandbox's child only, in its own mount namespace (it changes the mounts of the
/// calling process's namespace).
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

/// Makes the bind at `dst` read-only, nosuid and nodev, submounts included: MS_REC copies the
/// host's mounts below a bound path (a volume under /usr, a file bind under /etc), and a
/// MS_REMOUNT reaches only the top one, leaving those writable. Kernels before 5.12 lack
/// mount_setattr (ENOSYS): there the top mount is remounted and Landlock's read-only rule, which
/// covers everything beneath the path, is what protects submounts. Async-signal-safe.
///
/// # Safety
/// Called in the sandbox's child only, in its own mount namespace.
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

/// The most descriptors a run hands its shim: status, stdin, stdout, stderr, ruleset, go-signal,
/// hello.
pub const MAX_PASSED_FDS: usize = 7;

/// The descriptors a run hands its shim, in the order [`ChildPlan::passed_fds`] lists them (-1:
/// none, skipped).
pub fn passed_fds(status: i32, stdio: [i32; 3], landlock: i32, sync: i32, hello: i32) -> Vec<i32> {
    [status, stdio[0], stdio[1], stdio[2], landlock, sync, hello]
        .into_iter()
        .filter(|&fd| fd >= 0)
        .collect()
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

/// Namespaces a prepared shim makes before its run arrives (a network namespace is the dearest
/// part of starting a run), and the ones made at the start of the run: the mount namespace copies
/// the host's mounts as they are then, and the pid and cgroup namespaces are cheap.
const EARLY_NAMESPACES: libc::c_int = libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
const LATE_NAMESPACES: libc::c_int = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWCGROUP;

/// What a shim leaves for the thread that started it: its init's pid (written by the kernel,
/// `CLONE_PARENT_SETTID`, before init runs) and whether the shim reaped it.
///
/// The daemon is a child subreaper (see [`become_subreaper`]): if the shim dies before its init
/// (a kill reaching the shim first), init is re-parented to a daemon thread, not to the host's
/// init. Its parent then still shares its memory, so the kernel keeps treating it as a vfork
/// child that the OOM killer never picks; were it re-parented elsewhere, a memory-bomb OOM in the
/// run's cgroup could pick init and, with it, kill every process sharing its memory: the daemon.
/// The starting thread reaps such an init.
#[derive(Default)]
pub struct ShimState {
    init_pid: std::sync::atomic::AtomicI32,
    init_reaped: std::sync::atomic::AtomicBool,
}

/// Makes the daemon a child subreaper (see [`ShimState`]). Idempotent.
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl(2) with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `clone` entry points: `arg` is the plan, alive for as long as any child runs (see [`Stacks`]).
extern "C" fn shim_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: spawn_and_wait passes a pointer to a live plan.
    unsafe { (*(arg as *const ChildPlan)).enter() }
}

extern "C" fn init_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: as above; the shim passes the same pointer on.
    unsafe { (*(arg as *const ChildPlan)).init_and_exec() }
}

extern "C" fn command_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: as above.
    unsafe { (*(arg as *const ChildPlan)).command() }
}

extern "C" fn warm_shim_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: WarmShim::spawn_and_wait passes a pointer to a live WarmShim.
    unsafe { (*(arg as *const WarmShim)).enter() }
}

/// Starts a `CLONE_VM | CLONE_VFORK` child running `entry(arg)` on `stack_top`; returns once it
/// has exec'd or exited. Async-signal-safe.
///
/// # Safety
/// `arg` and the stack must outlive the child; `entry` must never return.
unsafe fn clone_vfork(
    entry: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *const libc::c_void,
    stack_top: *mut libc::c_void,
    extra_flags: libc::c_int,
    parent_tid: *mut libc::pid_t,
) -> libc::pid_t {
    // SAFETY: clone(2) through glibc's wrapper, running `entry` on a stack of our mapping;
    // parent_tid is only written with CLONE_PARENT_SETTID.
    unsafe {
        libc::clone(
            entry,
            stack_top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD | extra_flags,
            arg as *mut libc::c_void,
            parent_tid,
        )
    }
}

/// Starts a shim from the calling thread and returns once it has exited (the whole run). Meant
/// for a blocking thread of its own: the thread is suspended while the shim runs, and
/// PR_SET_PDEATHSIG ties the shim to this thread, which is alive exactly as long.
///
/// # Safety
/// `arg` and `stacks` must stay alive until the run's cgroup is empty, not only until this
/// returns: a killed shim releases us before its init has died.
unsafe fn run_shim(
    entry: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *const libc::c_void,
    stacks: &Stacks,
    extra_flags: libc::c_int,
    state: &ShimState,
) -> std::io::Result<()> {
    // SAFETY: signal-mask calls on stack sigsets; clone_vfork per the caller's guarantee; waitpid.
    unsafe {
        // Signals stay blocked in this thread until the shim has reset every handler the daemon
        // installed: a daemon handler must never run on the shim's side.
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = clone_vfork(
            entry,
            arg,
            stacks.top(SHIM_STACK),
            extra_flags,
            std::ptr::null_mut(),
        );
        let err = std::io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(err);
        }
        let mut st = 0;
        while libc::waitpid(pid, &mut st, 0) < 0 && errno() == libc::EINTR {}
        // An init the shim did not live to reap is ours now (we are its subreaper).
        let init = state.init_pid.load(Ordering::Acquire);
        if init > 0 && !state.init_reaped.load(Ordering::Acquire) {
            while libc::waitpid(init, &mut st, 0) < 0 && errno() == libc::EINTR {}
        }
        Ok(())
    }
}

/// First steps of every shim: default dispositions for every signal (the daemon's handlers live
/// in the memory we share), unblock, and die with the daemon (our parent is the daemon thread
/// blocked in [`run_shim`] for the whole run; a restart sweeps whatever a crash leaves).
/// Async-signal-safe.
///
/// # Safety
/// Called first thing in a shim, a `CLONE_VM` child of a daemon thread: it resets the signal
/// handlers of the memory it shares with the daemon, which the daemon itself must not do.
unsafe fn shim_prologue() {
    // SAFETY: signal(2), sigprocmask(2) and prctl(2) on stack values.
    unsafe {
        // glibc refuses its two internal signals; that is fine.
        for sig in 1..=64 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
    }
}

/// Joins a cgroup by writing "0" to each of its `cgroup.procs` files. Async-signal-safe.
///
/// # Safety
/// Called in a shim only (it moves the calling process, which must be the run's).
unsafe fn join_cgroup(procs: &[CString]) -> bool {
    // SAFETY: open/write/close on prepared C strings and a static buffer.
    unsafe {
        for path in procs {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return false;
            }
            let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            libc::close(fd);
            if !ok {
                return false;
            }
        }
        true
    }
}

/// A shim started before its run: it joins a prepared cgroup at once (joining is the slow part
/// of starting a run on cgroup v1, one RCU grace period after an idle spell) and then waits for
/// the plan of the run it will serve. It keeps nothing of the daemon's fd table but its go socket
/// and the cgroup files (its stdio is /dev/null): the daemon's listener, audit log and
/// connections never reach it. The run's descriptors, made later, come with the go byte
/// (SCM_RIGHTS) and are put at the numbers the plan names.
pub struct WarmShim {
    /// `cgroup.procs` of the slot's cgroup, opened by the daemon: the slot may be renamed for
    /// its run before a slow shim got to join it.
    cgroup_procs: Vec<std::os::fd::OwnedFd>,
    go_fd: i32,
    /// go_fd and the cgroup files, sorted: all the shim keeps of the table it is cloned with.
    keep_fds: Vec<i32>,
    /// The run's plan, set once before the go byte; holding it here keeps it alive as long as
    /// the shim's starting thread runs. Reading it is one atomic load (async-signal-safe).
    armed: std::sync::OnceLock<Arc<ChildPlan>>,
    stacks: Arc<Stacks>,
    state: ShimState,
}

impl WarmShim {
    /// `go_fd` is the shim's end of a `SOCK_SEQPACKET` pair; [`WarmShim::arm`]'s caller sends
    /// one byte with the run's [`ChildPlan::passed_fds`] on the other end, and EOF makes the shim
    /// exit unused. It must stay open until the shim is gone.
    pub fn new(
        cgroup_procs: Vec<std::os::fd::OwnedFd>,
        go_fd: i32,
        stacks: Arc<Stacks>,
    ) -> WarmShim {
        let mut keep_fds: Vec<i32> = cgroup_procs
            .iter()
            .map(std::os::fd::AsRawFd::as_raw_fd)
            .chain([go_fd])
            .collect();
        keep_fds.sort_unstable();
        WarmShim {
            cgroup_procs,
            go_fd,
            keep_fds,
            armed: std::sync::OnceLock::new(),
            stacks,
            state: ShimState::default(),
        }
    }

    pub fn stacks(&self) -> &Arc<Stacks> {
        &self.stacks
    }

    /// Hands the shim its run; the caller then sends the go byte. The plan must use this
    /// shim's stacks and outlive the run's cgroup like the shim itself.
    pub fn arm(&self, plan: &Arc<ChildPlan>) {
        let _ = self.armed.set(plan.clone());
    }

    /// Starts the shim and returns once it has exited. See [`ChildPlan::spawn_and_wait`].
    ///
    /// # Safety
    /// `self`, its stacks and the plan it is armed with must stay alive until the cgroup it
    /// joins is empty.
    pub unsafe fn spawn_and_wait(&self) -> std::io::Result<()> {
        // SAFETY: the caller keeps self and the stacks alive. The shim gets a copy of our fd
        // table and closes all of it but its own descriptors first thing.
        unsafe {
            run_shim(
                warm_shim_main,
                self as *const WarmShim as *const libc::c_void,
                &self.stacks,
                0,
                &self.state,
            )
        }
    }

    /// The waiting shim. Never returns.
    ///
    /// # Safety
    /// Runs only as the entry of the shim [`Self::spawn_and_wait`] clones, on its stack.
    unsafe fn enter(&self) -> ! {
        // SAFETY: (whole function) only async-signal-safe syscalls on memory prepared before
        // clone; the plan is read only after the go byte, which the daemon writes after arm().
        unsafe {
            shim_prologue();
            // Nothing of the daemon's table stays: stdio on /dev/null, every other descriptor
            // but ours closed, before anything else can block.
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if null < 0 {
                libc::_exit(0);
            }
            for target in 0..3 {
                libc::dup2(null, target);
            }
            close_other_fds(&self.keep_fds);
            let joined = self.cgroup_procs.iter().all(|fd| {
                libc::write(std::os::fd::AsRawFd::as_raw_fd(fd), b"0".as_ptr().cast(), 1) == 1
            });
            // A shim outside its cgroup must never serve a run: the daemon then finds the slot
            // finished and prepares its run on demand.
            if !joined {
                libc::_exit(0);
            }
            // After joining: nothing of the run may exist outside its cgroup.
            let unshared = libc::unshare(EARLY_NAMESPACES) == 0;
            let mut received = [-1i32; MAX_PASSED_FDS];
            // EOF or an error: the slot was discarded.
            let Some(n) = recv_go(self.go_fd, &mut received) else {
                libc::_exit(0);
            };
            let Some(plan) = self.armed.get() else {
                libc::_exit(0);
            };
            // The run's descriptors at the numbers the plan names (the daemon's): until then
            // there is no status pipe to report a failure on.
            if !install_passed(&received[..n], &plan.passed_fds) {
                libc::_exit(0);
            }
            if !unshared {
                fail(plan.status_fd, Stage::Unshare);
            }
            plan.start_sandbox(LATE_NAMESPACES, &self.state)
        }
    }
}

/// Receives a prepared shim's go message: one byte and up to [`MAX_PASSED_FDS`] descriptors
/// (close-on-exec) into `out`. Returns how many came, None on EOF or an error.
/// Async-signal-safe.
///
/// # Safety
/// `sock` is the shim's end of its go socket.
unsafe fn recv_go(sock: i32, out: &mut [i32; MAX_PASSED_FDS]) -> Option<usize> {
    // SAFETY: recvmsg(2) into stack buffers whose sizes the msghdr states; the CMSG_* helpers
    // only compute addresses inside the control buffer the kernel filled.
    unsafe {
        let mut byte = 0u8;
        let mut iov = libc::iovec {
            iov_base: (&mut byte as *mut u8).cast(),
            iov_len: 1,
        };
        // u64s: the control buffer must be aligned for cmsghdr.
        let mut control = [0u64; 16];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        let n = loop {
            let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            break n;
        };
        if n != 1 || msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return None;
        }
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Some(0);
        }
        if (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            return None;
        }
        let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
        let count = bytes / std::mem::size_of::<i32>();
        if count > MAX_PASSED_FDS {
            return None;
        }
        let data = libc::CMSG_DATA(cmsg).cast::<i32>();
        for (i, slot) in out.iter_mut().enumerate().take(count) {
            *slot = data.add(i).read_unaligned();
        }
        Some(count)
    }
}

/// Puts each of `received` at the number `targets` names (the same index), close-on-exec, and
/// closes the received copies. Targets are free in a prepared shim's table but for the received
/// descriptors themselves, which are first moved above every target. Async-signal-safe.
///
/// # Safety
/// Called in a prepared shim only, on its own fd table.
unsafe fn install_passed(received: &[i32], targets: &[i32]) -> bool {
    if received.len() != targets.len() || received.len() > MAX_PASSED_FDS {
        return false;
    }
    let above = targets.iter().copied().max().unwrap_or(2).saturating_add(1);
    let mut moved = [-1i32; MAX_PASSED_FDS];
    // SAFETY: fcntl/dup3/close on descriptor numbers; no memory involved.
    unsafe {
        for (m, &r) in moved.iter_mut().zip(received) {
            *m = libc::fcntl(r, libc::F_DUPFD_CLOEXEC, above);
            if *m < 0 {
                return false;
            }
        }
        for &r in received {
            libc::close(r);
        }
        for (&m, &t) in moved.iter().zip(targets) {
            if libc::dup3(m, t, libc::O_CLOEXEC) < 0 {
                return false;
            }
            libc::close(m);
        }
    }
    true
}

impl ChildPlan {
    /// Starts the sandbox from the calling thread (a shim that joins the plan's cgroup itself)
    /// and returns once the shim has exited (the whole run). Meant for a blocking thread of its
    /// own.
    ///
    /// # Safety
    /// The plan must stay alive until the run's cgroup is empty, not only until this returns: a
    /// killed shim releases us before its init has died.
    pub unsafe fn spawn_and_wait(&self) -> std::io::Result<()> {
        // SAFETY: per the caller's guarantee.
        unsafe {
            run_shim(
                shim_main,
                self as *const ChildPlan as *const libc::c_void,
                &self.stacks,
                0,
                &self.shim_state,
            )
        }
    }

    /// The shim started for this plan. Never returns.
    ///
    /// # Safety
    /// Runs only as the entry of the shim [`Self::spawn_and_wait`] clones, on its stack.
    unsafe fn enter(&self) -> ! {
        // SAFETY: (whole function) only async-signal-safe syscalls on memory prepared before clone.
        unsafe {
            shim_prologue();
            // Join the run's cgroup before anything else can fork, so every process of the run,
            // however it detaches later (setsid, double fork), is in the cgroup we kill.
            if !join_cgroup(&self.cgroup_procs) {
                fail(self.status_fd, Stage::JoinCgroup);
            }
            self.start_sandbox(EARLY_NAMESPACES | LATE_NAMESPACES, &self.shim_state)
        }
    }

    /// The rest of the shim, in the run's cgroup with signals reset (by [`ChildPlan::enter`] or
    /// [`WarmShim::enter`]), unsharing the `namespaces` it does not have yet. Never returns.
    ///
    /// The order is the security argument, so each step says why it sits where it does.
    ///
    /// # Safety
    /// Called by a shim only, in the run's cgroup, with the daemon's signal handlers reset.
    unsafe fn start_sandbox(&self, namespaces: libc::c_int, state: &ShimState) -> ! {
        let sfd = self.status_fd;
        // SAFETY: (whole function) only async-signal-safe syscalls on memory prepared before clone.
        unsafe {
            // 0. Nothing of the daemon's fd table but the run's own descriptors: the daemon's
            //    listener, connections and files never reach the sandbox, not even before init
            //    closes what it does not need (step 10).
            close_other_fds(&self.keep_fds);
            // 1. The command's stdio on 0-2.
            for (target, &fd) in self.stdio.iter().enumerate() {
                if libc::dup2(fd, target as i32) < 0 {
                    fail(sfd, Stage::Stdio);
                }
            }

            // 2. New mount, ipc, uts, net and cgroup namespaces for this process; a new pid
            //    namespace for its children. The net namespace has only a down loopback: no route.
            //    (A prepared shim made its net, ipc and uts namespaces while it waited.)
            if libc::unshare(namespaces) != 0 {
                fail(sfd, Stage::Unshare);
            }
            if self.hello_fd >= 0 {
                let pid = (libc::syscall(libc::SYS_getpid) as i32).to_le_bytes();
                if libc::write(self.hello_fd, pid.as_ptr().cast(), pid.len()) != pid.len() as isize
                {
                    fail(sfd, Stage::Hello);
                }
            }

            // 3. Start pid 1 of the new pid namespace, sharing our fd table so that what init
            //    closes the shim no longer holds either (pipes then see EOF only from the
            //    sandbox). We are suspended until init exits; its exit tells the daemon the
            //    sandbox is gone.
            let self_ptr = self as *const ChildPlan as *const libc::c_void;
            let init = clone_vfork(
                init_main,
                self_ptr,
                self.stacks.top(INIT_STACK),
                libc::CLONE_FILES | libc::CLONE_PARENT_SETTID,
                state.init_pid.as_ptr(),
            );
            if init < 0 {
                fail(sfd, Stage::Fork);
            }
            let mut st = 0;
            while libc::waitpid(init, &mut st, 0) < 0 && errno() == libc::EINTR {}
            state.init_reaped.store(true, Ordering::Release);
            libc::_exit(0);
        }
    }

    /// pid 1 of the sandbox: builds the root, forks the command, reaps until it exits.
    ///
    /// # Safety
    /// Runs only as the entry of the init [`Self::start_sandbox`] clones, in the new namespaces.
    unsafe fn init_and_exec(&self) -> ! {
        let sfd = self.status_fd;
        // SAFETY: (whole function) async-signal-safe syscalls on prepared memory only.
        unsafe {
            // Die with the shim (which dies with the daemon).
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            // A name of our own rather than the spawning daemon thread's. (Our command line is
            // the daemon's: we share its memory. The sandbox's /proc hides us, see MountOp::Proc.)
            libc::prctl(libc::PR_SET_NAME, c"init".as_ptr(), 0, 0, 0);

            // 4. Nothing we mount may propagate back to the host.
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

            // 5. The new root is an empty tmpfs: only what the profile names appears in it.
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

            // 6. Read-only binds of the profile's paths; the workdir and /tmp, both bound from one
            //    private tmpfs sized to the disk limit (so the limit holds for the two together;
            //    its staging mount point is detached and removed again here); a fresh /proc (we
            //    are pid 1 of the new pid namespace, so it shows only the sandbox) and a /dev with
            //    null, zero, random, urandom.
            for op in &self.mounts {
                if !self.apply(op) {
                    fail(sfd, Stage::MountPlan);
                }
            }

            // 7. Swap roots and drop the old one entirely: host paths are no longer reachable.
            if libc::chdir(self.root.as_ptr()) != 0
                || libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0
                || libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0
                || libc::chdir(c"/".as_ptr()) != 0
            {
                fail(sfd, Stage::PivotRoot);
            }

            // 8. The root tmpfs itself becomes read-only now that its skeleton is built.
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

            // 9. Landlock rules for the mounts made here (the new root, the scratch tmpfs,
            //     /proc): no fd for them existed before the clone. The ruleset itself, with its
            //     handled rights and the rules for every host inode bound in, was built before.
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

            // 10. Only the status pipe, the ruleset and the go-signal pipe survive; the command
            //     gets 0-2 only.
            let mut keep = [sfd, self.landlock_fd, self.sync_fd];
            keep.sort_unstable();
            close_other_fds(&keep);

            // 11. With egress, wait until the daemon's proxy listens in our network namespace:
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

            // The command runs on its own stack until execve gives it its own memory; we are
            // suspended until then.
            let cmd = clone_vfork(
                command_main,
                self as *const ChildPlan as *const libc::c_void,
                self.stacks.top(COMMAND_STACK),
                0,
                std::ptr::null_mut(),
            );
            if cmd < 0 {
                fail(sfd, Stage::Fork);
            }

            // 12. pid 1: drop our copies of the stdio pipes (EOF and EPIPE then depend only on the
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
    ///
    /// # Safety
    /// Runs only as the entry of the command process the sandbox's init clones.
    unsafe fn command(&self) -> ! {
        let sfd = self.status_fd;
        // SAFETY: (whole function) async-signal-safe syscalls on prepared memory only.
        unsafe {
            // 13. Own session: no controlling terminal, no signals from the daemon's group.
            libc::setsid();
            if libc::chdir(self.workdir.as_ptr()) != 0 {
                fail(sfd, Stage::Chdir);
            }
            // 14. rlimits while still privileged (raising hard limits needs CAP_SYS_RESOURCE).
            for &(res, val) in &self.rlimits {
                let rl = libc::rlimit {
                    rlim_cur: val,
                    rlim_max: val,
                };
                if libc::setrlimit(res, &rl) != 0 {
                    fail(sfd, Stage::Rlimit);
                }
            }
            // 15. Become the unprivileged user: groups first (needs CAP_SETGID), then gid, then uid
            //     (after which no capability is left).
            //     Raw syscalls: glibc's wrappers would apply the change to every thread they know
            //     of, and the thread list they would read is the daemon's.
            if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0 {
                fail(sfd, Stage::SetGroups);
            }
            if libc::syscall(libc::SYS_setresgid, self.gid, self.gid, self.gid) != 0
                || libc::syscall(libc::SYS_setresuid, self.uid, self.uid, self.uid) != 0
            {
                fail(sfd, Stage::SetUid);
            }
            // 16. no_new_privs: required for unprivileged Landlock and seccomp, and makes setuid
            //     binaries inert.
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                fail(sfd, Stage::NoNewPrivs);
            }
            // 17. Landlock: from here the filesystem (and TCP, and signals/abstract sockets on
            //     ABI >= 6) is limited to the rules above, whatever the mounts say.
            if self.landlock_fd >= 0 {
                if landlock::restrict_self(self.landlock_fd) != 0 {
                    fail(sfd, Stage::LandlockRestrict);
                }
                libc::close(self.landlock_fd);
            }
            // 18. seccomp last: the filter would refuse nothing we still need, but installing it
            //     after everything else keeps the setup itself free of surprises.
            for prog in &self.seccomp {
                if super::seccomp::install(prog) != 0 {
                    fail(sfd, Stage::Seccomp);
                }
            }
            // 19. exec. The status pipe is O_CLOEXEC, so the program sees fds 0-2 only.
            libc::execve(
                self.program.as_ptr(),
                self.argv_ptrs.as_ptr(),
                self.envp_ptrs.as_ptr(),
            );
            fail(sfd, Stage::Exec);
        }
    }

    /// Performs one step of building the sandbox's root. Async-signal-safe.
    ///
    /// # Safety
    /// Called by the sandbox's init only, in its own mount namespace.
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
                // hidepid=2 (invisible): the command sees only processes it may ptrace, its own.
                // Init (pid 1, root) shares the daemon's memory, so its /proc/1/cmdline would be
                // the daemon's argv (binary path, listen address) and /proc/1/exe its binary.
                MountOp::Devpts(dst) => {
                    // newinstance: the sandbox sees only the ptys opened inside it; ptmxmode
                    // lets the sandbox user open its ptmx (/dev/ptmx links to it). Not nodev:
                    // the ptys are its devices.
                    libc::mount(
                        c"devpts".as_ptr(),
                        dst.as_ptr(),
                        c"devpts".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NOEXEC,
                        c"newinstance,ptmxmode=0666,mode=0620".as_ptr().cast(),
                    ) == 0
                }
                MountOp::Proc(dst) => {
                    libc::mount(
                        c"proc".as_ptr(),
                        dst.as_ptr(),
                        c"proc".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                        c"hidepid=2".as_ptr().cast(),
                    ) == 0
                }
            }
        }
    }
}
