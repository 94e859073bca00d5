//! Landlock for the local sandbox.
//!
//! Owns: the ruleset a run is confined by. It is built in the daemon before the clone with the
//! `landlock` crate: the handled filesystem and TCP rights and scopes for the host's ABI (as a
//! hard requirement: anything the kernel cannot enforce fails the run), the TCP connect rule of
//! an egress run, and a path-beneath rule for every host inode the sandbox sees (read-only
//! paths, extra files, device nodes, a session's workspace). The child then adds rules only
//! for the mounts that exist nowhere before the clone and calls `landlock_restrict_self` on
//! the ready ruleset fd; both are single raw syscalls on memory prepared here.

use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

pub use landlock::AccessFs;
use landlock::{
    ABI, Access, AccessNet, BitFlags, CompatLevel, Compatible, NetPort, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
};

/// The newest ABI whose rights this sandbox hands out by rule. A newer kernel is used at this
/// ABI: rights it adds stay unhandled until the rules here are written (and tested) for them.
pub const NEWEST: u32 = 6;

/// Filesystem rights, as the crate names them.
pub type Fs = BitFlags<AccessFs>;

/// The kernel's Landlock ABI version, 0 when Landlock is unavailable.
///
/// A raw query: `/capabilities` reports the kernel's exact version, and the crate deliberately
/// exposes no runtime ABI number (its rulesets negotiate without one).
pub fn probe_abi() -> u32 {
    // SAFETY: the documented version query: NULL attr, size 0, VERSION flag; no memory is touched.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32, // LANDLOCK_CREATE_RULESET_VERSION
        )
    };
    if v < 0 { 0 } else { v as u32 }
}

/// The ABI the sandbox uses on a host of `abi`.
fn used(abi: u32) -> ABI {
    ABI::from(abi.min(NEWEST) as i32)
}

/// Every filesystem right handled (denied unless a rule allows it) at `abi`.
pub fn handled_fs(abi: u32) -> Fs {
    if abi == 0 {
        return Fs::empty();
    }
    AccessFs::from_all(used(abi))
}

/// The rights that apply to a non-directory (the kernel refuses directory rights on one).
pub fn file_rights() -> Fs {
    AccessFs::from_file(used(NEWEST))
}

/// Read, list and execute: a read-only path.
pub fn read_only() -> Fs {
    AccessFs::ReadFile | AccessFs::ReadDir | AccessFs::Execute
}

/// A rule for a host path, added before the clone.
#[derive(Debug, Clone)]
pub struct HostRule {
    pub path: PathBuf,
    pub access: Fs,
}

/// The ruleset of one run on a host of `abi` (> 0): every filesystem right and TCP bind/connect
/// handled, abstract unix sockets and signals scoped to the sandbox, `connect_ports` (the egress
/// proxy's, and the raw TCP rules' ports) the only TCP ports reachable, and `rules` added.
/// `may_listen` (a session's background process, a server its session's ports proxy reaches):
/// TCP bind is not handled, so it may listen, in its own network namespace, which nothing but
/// the daemon's proxy enters.
pub fn ruleset(
    abi: u32,
    connect_ports: &[u16],
    rules: &[HostRule],
    may_listen: bool,
) -> io::Result<OwnedFd> {
    let err =
        |what: &str, e: &dyn std::fmt::Display| io::Error::other(format!("landlock {what}: {e}"));
    let abi_used = used(abi);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(abi_used))
        .map_err(|e| err("filesystem rights", &e))?;
    if abi >= 4 {
        ruleset = ruleset
            .handle_access(if may_listen {
                BitFlags::from(AccessNet::ConnectTcp)
            } else {
                AccessNet::from_all(abi_used)
            })
            .map_err(|e| err("network rights", &e))?;
    }
    if abi >= 6 {
        ruleset = ruleset
            .scope(Scope::from_all(abi_used))
            .map_err(|e| err("scopes", &e))?;
    }
    let mut created = ruleset.create().map_err(|e| err("ruleset", &e))?;
    if abi >= 4 {
        for &port in connect_ports {
            created = created
                .add_rule(NetPort::new(port, AccessNet::ConnectTcp))
                .map_err(|e| err("connect rule", &e))?;
        }
    }
    for rule in rules {
        let fd = PathFd::new(&rule.path).map_err(|e| err("path", &e))?;
        created = created
            .add_rule(PathBeneath::new(fd, rule.access))
            .map_err(|e| err(&format!("rule for {}", rule.path.display()), &e))?;
    }
    Option::<OwnedFd>::from(created).ok_or_else(|| io::Error::other("landlock: no ruleset"))
}

/// `struct landlock_path_beneath_attr`, for the rules the child adds.
#[repr(C, packed)]
#[derive(Debug, Clone, Copy)]
pub struct PathBeneathAttr {
    pub allowed_access: u64,
    pub parent_fd: i32,
}

/// Adds a path-beneath rule from the child: the new root, its scratch tmpfs and /proc exist
/// only in the sandbox's namespaces, after the clone, so no fd for them exists while the
/// crate builds the ruleset. One syscall on caller-provided memory (async-signal-safe).
///
/// # Safety
/// `ruleset_fd` and `attr.parent_fd` must be open file descriptors.
pub unsafe fn add_path_rule(ruleset_fd: i32, attr: &PathBeneathAttr) -> libc::c_long {
    // SAFETY: attr is a live packed struct; the caller guarantees both fds are open.
    unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset_fd,
            1 as libc::c_int, // LANDLOCK_RULE_PATH_BENEATH
            attr as *const PathBeneathAttr,
            0u32,
        )
    }
}

/// Enforces the ruleset on the calling thread: the crate's `restrict_self` allocates and may
/// set no_new_privs itself, neither allowed after a vfork-style clone. One syscall.
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
    fn rights_grow_with_abi_and_stop_at_the_newest_known() {
        assert!(handled_fs(0).is_empty());
        assert_eq!(handled_fs(1).bits(), 0x1fff);
        assert!(handled_fs(2).contains(AccessFs::Refer));
        assert!(handled_fs(3).contains(AccessFs::Truncate));
        assert!(!handled_fs(4).contains(AccessFs::IoctlDev));
        assert!(handled_fs(5).contains(AccessFs::IoctlDev));
        assert_eq!(handled_fs(99), handled_fs(NEWEST));
        assert!(!file_rights().contains(AccessFs::ReadDir));
        assert_eq!(std::mem::size_of::<PathBeneathAttr>(), 12);
    }

    #[test]
    fn a_ruleset_with_host_rules_is_built_or_the_run_fails() {
        let abi = probe_abi();
        if abi == 0 {
            // Without Landlock the daemon never builds one (runs needing it are refused).
            return;
        }
        let ok = [HostRule {
            path: "/usr".into(),
            access: read_only(),
        }];
        assert!(ruleset(abi, &[3128, 5432], &ok, false).is_ok());
        let missing = [HostRule {
            path: "/nonexistent/executor-arm".into(),
            access: read_only(),
        }];
        assert!(ruleset(abi, &[], &missing, false).is_err());
        // A directory right on a file is refused, not silently dropped.
        let dir_right_on_file = [HostRule {
            path: "/etc/passwd".into(),
            access: AccessFs::ReadDir.into(),
        }];
        assert!(ruleset(abi, &[], &dir_right_on_file, true).is_err());
    }
}
