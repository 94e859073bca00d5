//! The seccomp filter of the local sandbox, compiled with `seccompiler` before fork.
//!
//! Enforces the shared policy of [`crate::sandbox::syscalls`] (deny list, namespace `clone`
//! flags, `clone3`, socket families) as a stack of filters, one per answer (seccompiler gives a
//! filter one action for all its matches): the kernel runs every filter of the stack and takes
//! the strictest answer, and for any one syscall at most one of ours answers anything but
//! "allow". Every filter kills a foreign architecture; on x86_64 a hand-written one also kills the
//! x32 ABI. Installing the ready programs after vfork is one raw seccomp(2) call each.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::sandbox::syscalls::{CLONE, CLONE3, DENIED, NAMESPACE_FLAGS, SOCKET, SOCKET_FAMILIES};

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("the local sandbox's seccomp filter is built for x86_64 and aarch64 only");

/// The finished programs, installed in order; built before fork.
pub struct SeccompProgram {
    filters: Vec<BpfProgram>,
    /// What seccomp(2) takes, pointing into `filters` (which never change after build).
    fprogs: Vec<libc::sock_fprog>,
}

// SAFETY: the fprogs' pointers point into `filters`, owned by the same struct and never changed
// after it is built; the struct is only read afterwards.
unsafe impl Send for SeccompProgram {}
// SAFETY: as for Send.
unsafe impl Sync for SeccompProgram {}

/// One filter: `rules` answered with `action`, every other syscall allowed.
fn filter(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
) -> Result<BpfProgram, String> {
    SeccompFilter::new(rules, SeccompAction::Allow, action, ARCH)
        .and_then(BpfProgram::try_from)
        .map_err(|e| format!("seccomp filter: {e}"))
}

/// One condition on argument 0's low 32 bits (`clone` flags and `socket` families are ints to
/// the kernel).
fn arg0(op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(0, SeccompCmpArgLen::Dword, op, value).map_err(|e| e.to_string())
}

/// x32 syscalls carry x86_64's audit architecture and a syscall number with bit 30 set; they
/// would bypass every rule keyed on the x86_64 numbers. Hand-written: seccompiler checks the
/// architecture only, and its rules match exact syscall numbers, so "any number from bit 30 up"
/// cannot be said with it.
#[cfg(target_arch = "x86_64")]
fn x32_filter() -> BpfProgram {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let ins = |code, jt, jf, k| seccompiler::sock_filter { code, jt, jf, k };
    vec![
        // seccomp_data.arch (offset 4): anything but x86_64 is killed.
        ins(LD_W_ABS, 0, 0, 4),
        ins(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        // seccomp_data.nr (offset 0).
        ins(LD_W_ABS, 0, 0, 0),
        ins(JGE_K, 0, 1, X32_SYSCALL_BIT),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

impl SeccompProgram {
    /// The programs described in the module header.
    pub fn deny_list() -> Result<Self, String> {
        let mut filters = Vec::new();
        #[cfg(target_arch = "x86_64")]
        filters.push(x32_filter());
        filters.push(filter(
            DENIED.iter().map(|sc| (sc.nr, Vec::new())).collect(),
            SeccompAction::Errno(libc::EPERM as u32),
        )?);
        // clone with any namespace flag: one rule per flag (rules of a syscall are alternatives).
        let mut per_flag = Vec::new();
        for flag in NAMESPACE_FLAGS {
            let c = arg0(SeccompCmpOp::MaskedEq(u64::from(*flag)), u64::from(*flag))?;
            per_flag.push(SeccompRule::new(vec![c]).map_err(|e| e.to_string())?);
        }
        filters.push(filter(
            BTreeMap::from([(CLONE.nr, per_flag)]),
            SeccompAction::Errno(libc::EPERM as u32),
        )?);
        // clone3's flags are behind a pointer a filter cannot read: ENOSYS, so libc falls back to
        // clone.
        filters.push(filter(
            BTreeMap::from([(CLONE3.nr, Vec::new())]),
            SeccompAction::Errno(libc::ENOSYS as u32),
        )?);
        // socket of a family not listed (conditions of a rule must all hold).
        let mut not_listed = Vec::new();
        for fam in SOCKET_FAMILIES {
            not_listed.push(arg0(SeccompCmpOp::Ne, *fam as u64)?);
        }
        filters.push(filter(
            BTreeMap::from([(
                SOCKET.nr,
                vec![SeccompRule::new(not_listed).map_err(|e| e.to_string())?],
            )]),
            SeccompAction::Errno(libc::EAFNOSUPPORT as u32),
        )?);
        let fprogs = filters
            .iter()
            .map(|f| libc::sock_fprog {
                len: f.len() as u16,
                // seccompiler's sock_filter is the kernel's struct, as libc's is (both repr(C):
                // u16, u8, u8, u32).
                filter: f.as_ptr() as *mut libc::sock_filter,
            })
            .collect();
        Ok(SeccompProgram { filters, fprogs })
    }

    /// The programs as seccomp(2) takes them, in installation order.
    pub fn fprogs(&self) -> &[libc::sock_fprog] {
        &self.fprogs
    }

    /// Instructions over all programs.
    pub fn len(&self) -> usize {
        self.filters.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Installs a program on the calling thread. Async-signal-safe: one syscall.
///
/// # Safety
/// `prog` must point to a live program; no_new_privs must be set (we have no CAP_SYS_ADMIN).
pub unsafe fn install(prog: &libc::sock_fprog) -> libc::c_long {
    // SAFETY: SECCOMP_SET_MODE_FILTER with a pointer to a valid sock_fprog.
    unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0u32,
            prog as *const libc::sock_fprog,
        )
    }
}

/// Whether the kernel offers seccomp filters (for the startup probe).
pub fn probe() -> bool {
    // SAFETY: prctl query with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) };
    r >= 0 && std::path::Path::new("/proc/sys/kernel/seccomp/actions_avail").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RET_ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const RET_KILL_PROCESS: u32 = libc::SECCOMP_RET_KILL_PROCESS;
    const RET_ERRNO: u32 = libc::SECCOMP_RET_ERRNO;
    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xc000_003e;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xc000_00b7;

    /// A classic-BPF interpreter for what the programs use (absolute word loads of seccomp_data,
    /// AND, jumps, returns), to check the decisions without installing anything.
    fn run(prog: &[seccompiler::sock_filter], arch: u32, nr: u32, arg0: u64) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        data[16..24].copy_from_slice(&arg0.to_ne_bytes());
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &prog[pc];
            let class = i.code & 0x07;
            match class {
                0x00 => {
                    let k = i.k as usize;
                    acc = u32::from_ne_bytes(data[k..k + 4].try_into().unwrap());
                    pc += 1;
                }
                0x04 if i.code & 0xf0 == 0x50 => {
                    acc &= i.k;
                    pc += 1;
                }
                0x05 => {
                    let op = i.code & 0xf0;
                    if op == 0x00 {
                        pc += 1 + i.k as usize;
                        continue;
                    }
                    let t = match op {
                        0x10 => acc == i.k,
                        0x20 => acc > i.k,
                        0x30 => acc >= i.k,
                        0x40 => acc & i.k != 0,
                        _ => panic!("unexpected jump {:#x}", i.code),
                    };
                    pc += 1 + if t { i.jt as usize } else { i.jf as usize };
                }
                0x06 => return i.k,
                _ => panic!("unexpected opcode {:#x}", i.code),
            }
        }
    }

    /// The stack's answer: the kernel takes the strictest (lowest as a signed action).
    fn decide(p: &SeccompProgram, arch: u32, nr: i64, arg0: u64) -> u32 {
        p.filters
            .iter()
            .map(|f| run(f, arch, nr as u32, arg0))
            .min_by_key(|r| (r & 0xffff_0000) as i32)
            .unwrap()
    }

    #[test]
    fn decisions() {
        let p = SeccompProgram::deny_list().unwrap();
        let eperm = RET_ERRNO | libc::EPERM as u32;
        assert_eq!(decide(&p, AUDIT_ARCH, libc::SYS_read, 0), RET_ALLOW);
        assert_eq!(decide(&p, AUDIT_ARCH, libc::SYS_execve, 0), RET_ALLOW);
        for sc in DENIED {
            assert_eq!(
                decide(&p, AUDIT_ARCH, sc.nr, 0),
                eperm,
                "syscall {}",
                sc.name()
            );
        }
        let fork_flags =
            (libc::SIGCHLD | libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(
            decide(&p, AUDIT_ARCH, libc::SYS_clone, fork_flags),
            RET_ALLOW
        );
        for flag in NAMESPACE_FLAGS {
            assert_eq!(
                decide(
                    &p,
                    AUDIT_ARCH,
                    libc::SYS_clone,
                    fork_flags | u64::from(*flag)
                ),
                eperm,
                "flag {flag:#x}"
            );
        }
        assert_eq!(
            decide(&p, AUDIT_ARCH, libc::SYS_clone3, 0),
            RET_ERRNO | libc::ENOSYS as u32
        );
        for fam in [
            libc::AF_UNIX,
            libc::AF_INET,
            libc::AF_INET6,
            libc::AF_NETLINK,
        ] {
            assert_eq!(
                decide(&p, AUDIT_ARCH, libc::SYS_socket, fam as u64),
                RET_ALLOW,
                "family {fam}"
            );
        }
        let no_family = RET_ERRNO | libc::EAFNOSUPPORT as u32;
        for fam in [
            libc::AF_VSOCK,
            libc::AF_PACKET,
            libc::AF_ALG,
            libc::AF_BLUETOOTH,
            libc::AF_XDP,
        ] {
            assert_eq!(
                decide(&p, AUDIT_ARCH, libc::SYS_socket, fam as u64),
                no_family,
                "family {fam}"
            );
        }
        // Only the low word is the family the kernel sees.
        assert_eq!(
            decide(
                &p,
                AUDIT_ARCH,
                libc::SYS_socket,
                (1u64 << 32) | libc::AF_VSOCK as u64
            ),
            no_family
        );
        assert_eq!(
            decide(&p, AUDIT_ARCH, libc::SYS_socketpair, libc::AF_UNIX as u64),
            RET_ALLOW
        );
        // A foreign architecture is killed, whatever the syscall.
        assert_eq!(decide(&p, 0x4000_0003, 1, 0), RET_KILL_PROCESS);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(decide(&p, AUDIT_ARCH, 0x4000_0001, 0), RET_KILL_PROCESS);
    }
}
