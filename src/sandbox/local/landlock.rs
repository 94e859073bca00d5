//! Landlock through raw syscalls, so every call made after fork is a plain syscall on memory
//! prepared before it.
//!
//! Owns: probing the ABI, computing the handled access sets for an ABI, and the `#[repr(C)]`
//! attribute structs. The ruleset is created before fork; rules for paths that exist only inside
//! the new mount namespace (the fresh tmpfs, /proc, /dev nodes) are added by the child after it
//! mounted them, with pre-built attribute structs and path strings.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

pub const CREATE_RULESET_VERSION: u32 = 1;
pub const RULE_PATH_BENEATH: libc::c_int = 1;
pub const RULE_NET_PORT: libc::c_int = 2;

// Filesystem access rights (ABI 1 unless noted).
pub const FS_EXECUTE: u64 = 1 << 0;
pub const FS_WRITE_FILE: u64 = 1 << 1;
pub const FS_READ_FILE: u64 = 1 << 2;
pub const FS_READ_DIR: u64 = 1 << 3;
pub const FS_REMOVE_DIR: u64 = 1 << 4;
pub const FS_REMOVE_FILE: u64 = 1 << 5;
pub const FS_MAKE_CHAR: u64 = 1 << 6;
pub const FS_MAKE_DIR: u64 = 1 << 7;
pub const FS_MAKE_REG: u64 = 1 << 8;
pub const FS_MAKE_SOCK: u64 = 1 << 9;
pub const FS_MAKE_FIFO: u64 = 1 << 10;
pub const FS_MAKE_BLOCK: u64 = 1 << 11;
pub const FS_MAKE_SYM: u64 = 1 << 12;
pub const FS_REFER: u64 = 1 << 13; // ABI 2
pub const FS_TRUNCATE: u64 = 1 << 14; // ABI 3
pub const FS_IOCTL_DEV: u64 = 1 << 15; // ABI 5

// Network access rights (ABI 4).
pub const NET_BIND_TCP: u64 = 1 << 0;
pub const NET_CONNECT_TCP: u64 = 1 << 1;

// Scopes (ABI 6).
pub const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
pub const SCOPE_SIGNAL: u64 = 1 << 1;

/// Rights that apply to regular files (the kernel refuses directory rights on a file rule).
pub const FILE_RIGHTS: u64 = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RulesetAttr {
    pub handled_access_fs: u64,
    pub handled_access_net: u64,
    pub scoped: u64,
}

#[repr(C, packed)]
#[derive(Debug, Clone, Copy)]
pub struct PathBeneathAttr {
    pub allowed_access: u64,
    pub parent_fd: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetPortAttr {
    pub allowed_access: u64,
    pub port: u64,
}

/// Allows `access` (e.g. connect) to one TCP port. Called before fork, in the daemon.
pub fn add_net_rule(ruleset: &OwnedFd, port: u16, access: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let attr = NetPortAttr {
        allowed_access: access,
        port: u64::from(port),
    };
    // SAFETY: attr is a live struct of the kernel's layout; the fd is an open ruleset.
    let r = unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset.as_raw_fd(),
            RULE_NET_PORT,
            &attr as *const NetPortAttr,
            0u32,
        )
    };
    if r != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The kernel's Landlock ABI version, 0 when Landlock is unavailable.
pub fn probe_abi() -> u32 {
    // SAFETY: the documented version query: NULL attr, size 0, VERSION flag; no memory is touched.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    if v < 0 { 0 } else { v as u32 }
}

/// Every filesystem right the given ABI knows.
pub fn fs_rights(abi: u32) -> u64 {
    let mut r = (1u64 << 13) - 1;
    if abi >= 2 {
        r |= FS_REFER;
    }
    if abi >= 3 {
        r |= FS_TRUNCATE;
    }
    if abi >= 5 {
        r |= FS_IOCTL_DEV;
    }
    r
}

/// What the ruleset handles (denies unless a rule allows) at `abi`.
pub fn ruleset_attr(abi: u32, deny_tcp: bool) -> RulesetAttr {
    RulesetAttr {
        handled_access_fs: fs_rights(abi),
        handled_access_net: if abi >= 4 && deny_tcp {
            NET_BIND_TCP | NET_CONNECT_TCP
        } else {
            0
        },
        scoped: if abi >= 6 {
            SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        } else {
            0
        },
    }
}

/// Creates a ruleset handling `attr`. Done before fork: the fd is inherited by the child.
pub fn create_ruleset(attr: &RulesetAttr) -> io::Result<OwnedFd> {
    // SAFETY: attr points to a live, correctly laid out struct of the size passed; the kernel
    // accepts a larger struct than it knows as long as the unknown tail is zero.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Adds a path-beneath rule. Async-signal-safe: one syscall on caller-provided memory.
///
/// # Safety
/// `ruleset_fd` and `attr.parent_fd` must be open file descriptors.
pub unsafe fn add_path_rule(ruleset_fd: i32, attr: &PathBeneathAttr) -> libc::c_long {
    // SAFETY: attr is a live packed struct; the caller guarantees both fds are open.
    unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset_fd,
            RULE_PATH_BENEATH,
            attr as *const PathBeneathAttr,
            0u32,
        )
    }
}

/// Enforces the ruleset on the calling thread. Async-signal-safe: one syscall.
///
/// # Safety
/// `ruleset_fd` must be an open Landlock ruleset fd; no_new_privs must already be set.
pub unsafe fn restrict_self(ruleset_fd: i32) -> libc::c_long {
    // SAFETY: plain syscall with integer arguments.
    unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset_fd, 0u32) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rights_grow_with_abi() {
        assert_eq!(fs_rights(1), 0x1fff);
        assert_eq!(fs_rights(3) & FS_TRUNCATE, FS_TRUNCATE);
        assert_eq!(fs_rights(4) & FS_IOCTL_DEV, 0);
        assert_eq!(fs_rights(5) & FS_IOCTL_DEV, FS_IOCTL_DEV);
        assert_eq!(ruleset_attr(3, true).handled_access_net, 0);
        assert_eq!(ruleset_attr(4, true).handled_access_net, 3);
        assert_eq!(ruleset_attr(6, false).scoped, 3);
        assert_eq!(std::mem::size_of::<PathBeneathAttr>(), 12);
    }
}
