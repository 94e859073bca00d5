//! The seccomp profile of every sandbox container, in Docker's JSON format.
//!
//! Owns: turning the shared policy ([`crate::sandbox::syscalls`], also the local backend's) into
//! the profile passed as `security_opt: ["seccomp=<json>"]`. Must not: keep a list of its own.
//!
//! runc installs it with libseccomp. runsc applies an OCI seccomp profile inside the sandbox only
//! when registered with `--oci-seccomp` (see [`runsc_applies_oci_seccomp`]), and runsc (Debian's
//! 0.0~20221219 and 0.0~20240729 alike) ignores `errnoRet`: every refused call fails with EPERM
//! there. An EPERM for `clone3` would stop glibc from falling back to `clone` (no thread could
//! start), so the gVisor profile leaves `clone3` out. runsc 20240729 implements `clone3`, so
//! under gVisor a command can make namespaces through it (the sentry's own, inside the
//! sandbox; docs/security.md, "Known gaps"); its `clone` and `unshare` are filtered like runc's.

use serde_json::{Value, json};

use crate::sandbox::BackendKind;
use crate::sandbox::syscalls::{CLONE, CLONE3, DENIED, NAMESPACE_FLAGS, SOCKET, SOCKET_FAMILIES};

/// libseccomp's name of the architecture we run on (containers run on the daemon's host).
#[cfg(target_arch = "x86_64")]
const NATIVE_ARCH: &str = "SCMP_ARCH_X86_64";
#[cfg(target_arch = "aarch64")]
const NATIVE_ARCH: &str = "SCMP_ARCH_AARCH64";

fn refuse(name: &str, errno: i32, args: Value) -> Value {
    let mut rule = json!({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno});
    if !args.is_null() {
        rule["args"] = args;
    }
    rule
}

/// The profile for `kind`'s containers.
pub fn profile(kind: BackendKind) -> Value {
    let mut rules = vec![json!({
        "names": DENIED.iter().map(|s| s.name()).collect::<Vec<_>>(),
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": libc::EPERM,
    })];
    // One rule per flag: the conditions of one rule are ANDed, rules are ORed.
    for flag in NAMESPACE_FLAGS {
        rules.push(refuse(
            CLONE.name(),
            libc::EPERM,
            json!([{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]),
        ));
    }
    if kind != BackendKind::Gvisor {
        rules.push(refuse(CLONE3.name(), libc::ENOSYS, Value::Null));
    }
    // Every family but the allowed ones: each smaller value on its own (one comparison per
    // argument and rule), then everything above the largest allowed one.
    let top = SOCKET_FAMILIES.iter().copied().max().unwrap_or(0);
    for family in (0..top).filter(|f| !SOCKET_FAMILIES.contains(f)) {
        rules.push(refuse(
            SOCKET.name(),
            libc::EAFNOSUPPORT,
            json!([{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}]),
        ));
    }
    rules.push(refuse(
        SOCKET.name(),
        libc::EAFNOSUPPORT,
        json!([{"index": 0, "value": top, "op": "SCMP_CMP_GT"}]),
    ));
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": [NATIVE_ARCH],
        "syscalls": rules,
    })
}

/// The `security_opt` entry carrying [`profile`].
pub fn security_opt(kind: BackendKind) -> String {
    format!("seccomp={}", profile(kind))
}

/// Whether runsc registered with `args` applies the container's seccomp profile
/// (`--oci-seccomp`, in any of Go's flag spellings).
pub fn runsc_applies_oci_seccomp(args: &[String]) -> bool {
    let mut on = false;
    for a in args.iter().map(|a| a.trim_start_matches('-')) {
        match a.split_once('=') {
            Some(("oci-seccomp", v)) => on = matches!(v, "true" | "1" | "t" | "T" | "TRUE"),
            None if a == "oci-seccomp" => on = true,
            _ => {}
        }
    }
    on
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules_for<'a>(p: &'a Value, name: &str) -> Vec<&'a Value> {
        p["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["names"].as_array().unwrap().iter().any(|n| n == name))
            .collect()
    }

    #[test]
    fn the_profile_is_the_shared_policy() {
        let p = profile(BackendKind::Docker);
        assert_eq!(p["defaultAction"], "SCMP_ACT_ALLOW");
        assert_eq!(p["architectures"], json!([NATIVE_ARCH]));
        for sc in DENIED {
            let r = rules_for(&p, sc.name());
            assert_eq!(r.len(), 1, "{}", sc.name());
            assert_eq!(r[0]["action"], "SCMP_ACT_ERRNO");
            assert_eq!(r[0]["errnoRet"], libc::EPERM);
            assert!(r[0].get("args").is_none());
        }
        let clone = rules_for(&p, "clone");
        assert_eq!(clone.len(), NAMESPACE_FLAGS.len());
        for (r, flag) in clone.iter().zip(NAMESPACE_FLAGS) {
            assert_eq!(
                r["args"],
                json!([{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}])
            );
        }
        let clone3 = rules_for(&p, "clone3");
        assert_eq!(clone3.len(), 1);
        assert_eq!(clone3[0]["errnoRet"], libc::ENOSYS);
        assert!(rules_for(&profile(BackendKind::Gvisor), "clone3").is_empty());

        // socket: refused exactly for the families outside the allowed set.
        let socket = rules_for(&p, "socket");
        let refused = |family: u64| {
            socket.iter().any(|r| {
                let a = &r["args"][0];
                let v = a["value"].as_u64().unwrap();
                match a["op"].as_str().unwrap() {
                    "SCMP_CMP_EQ" => family == v,
                    "SCMP_CMP_GT" => family > v,
                    op => panic!("unexpected op {op}"),
                }
            })
        };
        for family in 0..64u64 {
            assert_eq!(
                refused(family),
                !SOCKET_FAMILIES.contains(&(family as i32)),
                "family {family}"
            );
        }
        assert!(refused(libc::AF_VSOCK as u64) && refused(u64::MAX));
        assert!(socket.iter().all(|r| r["errnoRet"] == libc::EAFNOSUPPORT));
        assert!(security_opt(BackendKind::Docker).starts_with("seccomp={"));
    }

    #[test]
    fn oci_seccomp_flag_spellings() {
        let on = |a: &[&str]| {
            runsc_applies_oci_seccomp(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        assert!(on(&["--platform=ptrace", "--oci-seccomp"]));
        assert!(on(&["-oci-seccomp"]));
        assert!(on(&["--oci-seccomp=true"]));
        assert!(!on(&["--oci-seccomp=false"]));
        assert!(!on(&["--oci-seccomp", "--oci-seccomp=false"]));
        assert!(!on(&["--platform=ptrace", "--host-uds=open"]));
        assert!(!on(&[]));
    }
}
