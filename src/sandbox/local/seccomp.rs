//! The seccomp filter of the local sandbox, assembled as classic BPF before fork.
//!
//! Enforces the shared policy of [`crate::sandbox::syscalls`] (deny list, namespace `clone`
//! flags, `clone3`, socket families). A foreign architecture or the x32 ABI is killed.

use crate::sandbox::syscalls::{CLONE, CLONE3, DENIED, SOCKET, SOCKET_FAMILIES, namespace_mask};

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

// seccomp_data offsets.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0_LO: u32 = 16;

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
const JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

/// A finished BPF program; `as_fprog` is what seccomp(2) takes. Built before fork.
pub struct SeccompProgram {
    filter: Vec<libc::sock_filter>,
}

impl SeccompProgram {
    /// The deny-list program described in the module header.
    pub fn deny_list() -> Self {
        let mut f = Vec::with_capacity(DENIED.len() + SOCKET_FAMILIES.len() + 24);
        // Architecture check: anything but x86_64 is killed (a 32-bit int 0x80 entry would
        // otherwise bypass every syscall number below).
        f.push(stmt(LD_W_ABS, OFF_ARCH));
        f.push(jump(JEQ_K, AUDIT_ARCH_X86_64, 1, 0));
        f.push(stmt(RET_K, RET_KILL_PROCESS));
        f.push(stmt(LD_W_ABS, OFF_NR));
        // x32 syscalls carry the same arch but a high bit in the number.
        f.push(jump(JGE_K, X32_SYSCALL_BIT, 0, 1));
        f.push(stmt(RET_K, RET_KILL_PROCESS));
        // clone: deny when any namespace flag is set in the low 32 bits of arg0.
        f.push(jump(JEQ_K, CLONE.nr as u32, 0, 4));
        f.push(stmt(LD_W_ABS, OFF_ARG0_LO));
        f.push(jump(JSET_K, namespace_mask(), 0, 1));
        f.push(stmt(RET_K, RET_ERRNO | libc::EPERM as u32));
        f.push(stmt(RET_K, RET_ALLOW));
        f.push(jump(JEQ_K, CLONE3.nr as u32, 0, 1));
        f.push(stmt(RET_K, RET_ERRNO | libc::ENOSYS as u32));
        // socket: allow the listed families (the low 32 bits of arg0: the kernel takes an int),
        // refuse every other with EAFNOSUPPORT.
        let k = SOCKET_FAMILIES.len() as u8;
        f.push(jump(JEQ_K, SOCKET.nr as u32, 0, k + 3));
        f.push(stmt(LD_W_ABS, OFF_ARG0_LO));
        for (i, fam) in SOCKET_FAMILIES.iter().enumerate() {
            f.push(jump(JEQ_K, *fam as u32, k - i as u8, 0));
        }
        f.push(stmt(RET_K, RET_ERRNO | libc::EAFNOSUPPORT as u32));
        f.push(stmt(RET_K, RET_ALLOW));
        // The deny list: each match jumps to the EPERM return placed right after the list.
        let n = DENIED.len();
        for (i, sc) in DENIED.iter().enumerate() {
            let to_deny = (n - i) as u8; // distance to the EPERM return (after the allow)
            f.push(jump(JEQ_K, sc.nr as u32, to_deny, 0));
        }
        f.push(stmt(RET_K, RET_ALLOW));
        f.push(stmt(RET_K, RET_ERRNO | libc::EPERM as u32));
        SeccompProgram { filter: f }
    }

    pub fn as_fprog(&self) -> libc::sock_fprog {
        libc::sock_fprog {
            len: self.filter.len() as u16,
            filter: self.filter.as_ptr() as *mut libc::sock_filter,
        }
    }

    pub fn len(&self) -> usize {
        self.filter.len()
    }

    pub fn is_empty(&self) -> bool {
        self.filter.is_empty()
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

    /// A tiny BPF interpreter for the instructions this module emits, to check the program's
    /// decisions without installing it.
    fn run(prog: &SeccompProgram, arch: u32, nr: u32, arg0: u64) -> u32 {
        let mut pc = 0usize;
        let mut acc = 0u32;
        loop {
            let ins = prog.filter[pc];
            match ins.code {
                LD_W_ABS => {
                    acc = match ins.k {
                        OFF_NR => nr,
                        OFF_ARCH => arch,
                        OFF_ARG0_LO => arg0 as u32,
                        _ => panic!("unexpected load"),
                    };
                    pc += 1;
                }
                RET_K => return ins.k,
                JEQ_K | JGE_K | JSET_K => {
                    let t = match ins.code {
                        JEQ_K => acc == ins.k,
                        JGE_K => acc >= ins.k,
                        _ => acc & ins.k != 0,
                    };
                    pc += 1 + if t { ins.jt as usize } else { ins.jf as usize };
                }
                c => panic!("unexpected opcode {c}"),
            }
        }
    }

    #[test]
    fn decisions() {
        let p = SeccompProgram::deny_list();
        let eperm = RET_ERRNO | libc::EPERM as u32;
        assert_eq!(
            run(&p, AUDIT_ARCH_X86_64, libc::SYS_read as u32, 0),
            RET_ALLOW
        );
        assert_eq!(
            run(&p, AUDIT_ARCH_X86_64, libc::SYS_execve as u32, 0),
            RET_ALLOW
        );
        for sc in DENIED {
            assert_eq!(
                run(&p, AUDIT_ARCH_X86_64, sc.nr as u32, 0),
                eperm,
                "syscall {}",
                sc.name()
            );
        }
        let fork_flags =
            (libc::SIGCHLD | libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(
            run(&p, AUDIT_ARCH_X86_64, libc::SYS_clone as u32, fork_flags),
            RET_ALLOW
        );
        assert_eq!(
            run(
                &p,
                AUDIT_ARCH_X86_64,
                libc::SYS_clone as u32,
                libc::CLONE_NEWUSER as u64
            ),
            eperm
        );
        assert_eq!(
            run(&p, AUDIT_ARCH_X86_64, libc::SYS_clone3 as u32, 0),
            RET_ERRNO | libc::ENOSYS as u32
        );
        let socket = libc::SYS_socket as u32;
        for fam in [
            libc::AF_UNIX,
            libc::AF_INET,
            libc::AF_INET6,
            libc::AF_NETLINK,
        ] {
            assert_eq!(
                run(&p, AUDIT_ARCH_X86_64, socket, fam as u64),
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
                run(&p, AUDIT_ARCH_X86_64, socket, fam as u64),
                no_family,
                "family {fam}"
            );
        }
        // Only the low word is the family the kernel sees.
        assert_eq!(
            run(
                &p,
                AUDIT_ARCH_X86_64,
                socket,
                (1u64 << 32) | libc::AF_VSOCK as u64
            ),
            no_family
        );
        assert_eq!(
            run(
                &p,
                AUDIT_ARCH_X86_64,
                libc::SYS_socketpair as u32,
                libc::AF_UNIX as u64
            ),
            RET_ALLOW
        );
        assert_eq!(run(&p, 0x4000_0003, 1, 0), RET_KILL_PROCESS);
        assert_eq!(
            run(&p, AUDIT_ARCH_X86_64, X32_SYSCALL_BIT | 1, 0),
            RET_KILL_PROCESS
        );
    }
}
