//! The syscall policy every sandbox enforces, as one table.
//!
//! Owns: which syscalls are refused, which `clone` flags and which socket families. The local
//! backend compiles it into classic BPF ([`super::local::seccomp`]); the container backends turn
//! it into Docker's seccomp profile ([`super::docker::seccomp`]). Must not: know how either
//! installs it.
//!
//! Default allow, with a deny list of syscalls that widen the kernel attack surface or escape the
//! namespaces: they fail with EPERM. `clone` with any namespace flag fails with EPERM; `clone3`
//! (whose flags live behind a pointer a filter cannot read) fails with ENOSYS so libc falls back
//! to `clone`. `socket` works only for the families the network namespace confines (unix, inet,
//! inet6, netlink); any other fails with EAFNOSUPPORT, the kernel's own answer for a missing
//! family. That shuts AF_VSOCK, which no namespace isolates: on a VM with a vsock device a "no
//! network" sandbox could otherwise talk to the hypervisor side.

/// One syscall: its name (as seccomp profiles spell it) and its number on this architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Syscall {
    /// `SYS_<name>`, as `libc` spells the constant (see [`Syscall::name`]).
    constant: &'static str,
    pub nr: i64,
}

impl Syscall {
    /// The kernel's name of the syscall (`ptrace`).
    pub fn name(&self) -> &'static str {
        self.constant.trim_start_matches("SYS_")
    }
}

/// One entry from its `libc` constant, so a name and its number cannot disagree.
macro_rules! syscall {
    ($constant:ident) => {
        Syscall {
            constant: stringify!($constant),
            nr: libc::$constant,
        }
    };
}

/// A table of [`syscall!`] entries; an entry may carry a `#[cfg]` (a syscall of one
/// architecture only).
macro_rules! syscalls {
    ($($(#[$attr:meta])* $constant:ident),* $(,)?) => {
        &[$($(#[$attr])* syscall!($constant)),*]
    };
}

/// Syscalls refused with EPERM.
pub const DENIED: &[Syscall] = syscalls![
    SYS_ptrace,
    SYS_process_vm_readv,
    SYS_process_vm_writev,
    SYS_mount,
    SYS_umount2,
    SYS_pivot_root,
    SYS_chroot,
    SYS_unshare,
    SYS_setns,
    SYS_bpf,
    SYS_perf_event_open,
    SYS_keyctl,
    SYS_add_key,
    SYS_request_key,
    SYS_kexec_load,
    SYS_kexec_file_load,
    SYS_init_module,
    SYS_finit_module,
    SYS_delete_module,
    SYS_io_uring_setup,
    SYS_io_uring_enter,
    SYS_io_uring_register,
    SYS_userfaultfd,
    SYS_open_by_handle_at,
    SYS_name_to_handle_at,
    SYS_reboot,
    SYS_swapon,
    SYS_swapoff,
    SYS_acct,
    #[cfg(target_arch = "x86_64")]
    SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    SYS_ioperm,
    // The new mount API is mount(2) by other names.
    SYS_fsopen,
    SYS_fsconfig,
    SYS_fsmount,
    SYS_fspick,
    SYS_move_mount,
    SYS_open_tree,
    SYS_mount_setattr,
    SYS_quotactl,
    SYS_lookup_dcookie,
    #[cfg(target_arch = "x86_64")]
    SYS_uselib,
    SYS_syslog,
    SYS_settimeofday,
    SYS_clock_settime,
    SYS_clock_adjtime,
    SYS_adjtimex,
    SYS_kcmp,
    SYS_pidfd_getfd,
    SYS_fanotify_init,
    SYS_personality,
    SYS_vhangup,
];

/// `clone`, refused (EPERM) when its flags (argument 0) carry any of [`NAMESPACE_FLAGS`].
pub const CLONE: Syscall = syscall!(SYS_clone);
/// `clone3`, refused with ENOSYS.
pub const CLONE3: Syscall = syscall!(SYS_clone3);
/// `socket`, refused (EAFNOSUPPORT) for a family (argument 0) not in [`SOCKET_FAMILIES`].
pub const SOCKET: Syscall = syscall!(SYS_socket);

/// The namespace flags of `clone`, each refused.
pub const NAMESPACE_FLAGS: &[u32] = &[
    libc::CLONE_NEWNS as u32,
    libc::CLONE_NEWCGROUP as u32,
    libc::CLONE_NEWUTS as u32,
    libc::CLONE_NEWIPC as u32,
    libc::CLONE_NEWUSER as u32,
    libc::CLONE_NEWPID as u32,
    libc::CLONE_NEWNET as u32,
];

/// Socket families `socket(2)` may create: the ones a new network namespace (and Landlock's TCP
/// rules) confine, plus netlink, which getaddrinfo uses and which is per network namespace too.
pub const SOCKET_FAMILIES: &[i32] = &[
    libc::AF_UNIX,
    libc::AF_INET,
    libc::AF_INET6,
    libc::AF_NETLINK,
];

/// All [`NAMESPACE_FLAGS`] together.
pub fn namespace_mask() -> u32 {
    NAMESPACE_FLAGS.iter().fold(0, |m, f| m | f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_constants() {
        assert_eq!(DENIED[0].name(), "ptrace");
        assert_eq!(DENIED[0].nr, libc::SYS_ptrace);
        assert_eq!(CLONE3.name(), "clone3");
        assert_eq!(SOCKET.nr, libc::SYS_socket);
        let mut names: Vec<&str> = DENIED.iter().map(Syscall::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), DENIED.len(), "no syscall listed twice");
        assert!(names.iter().all(|n| !n.is_empty() && !n.starts_with("SYS")));
        assert_eq!(
            namespace_mask(),
            (libc::CLONE_NEWNS
                | libc::CLONE_NEWCGROUP
                | libc::CLONE_NEWUTS
                | libc::CLONE_NEWIPC
                | libc::CLONE_NEWUSER
                | libc::CLONE_NEWPID
                | libc::CLONE_NEWNET) as u32
        );
    }
}
