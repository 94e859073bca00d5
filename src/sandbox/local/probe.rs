//! What the host kernel gives the local backend (Landlock ABI, seccomp, namespaces, cgroups, root),
//! probed once at startup and shown in /capabilities and /readyz.

use serde::Serialize;

use super::landlock;
use super::seccomp;

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HostProbe {
    pub landlock_abi: u32,
    pub seccomp: bool,
    pub namespaces: Vec<&'static str>,
    pub missing_namespaces: Vec<&'static str>,
    pub cgroup: Option<String>,
    pub cgroup_error: Option<String>,
    pub root: bool,
}

impl HostProbe {
    pub fn detect() -> Self {
        let mut present = Vec::new();
        let mut missing = Vec::new();
        for ns in ["mnt", "pid", "net", "ipc", "uts", "cgroup", "user"] {
            if std::path::Path::new(&format!("/proc/self/ns/{ns}")).exists() {
                present.push(ns);
            } else {
                missing.push(ns);
            }
        }
        HostProbe {
            landlock_abi: landlock::probe_abi(),
            seccomp: seccomp::probe(),
            namespaces: present,
            missing_namespaces: missing,
            cgroup: None,
            cgroup_error: None,
            // SAFETY: geteuid has no preconditions.
            root: unsafe { libc::geteuid() } == 0,
        }
    }

    /// The mechanisms the local backend needs that this host lacks (empty: all present).
    pub fn local_missing(&self, landlock_abi_required: u32) -> Vec<String> {
        let mut m = Vec::new();
        if !self.root {
            m.push("root privileges (namespaces, mounts and cgroups need them)".to_string());
        }
        for ns in &self.missing_namespaces {
            if *ns != "user" {
                m.push(format!("{ns} namespace"));
            }
        }
        if !self.seccomp {
            m.push("seccomp filters".to_string());
        }
        if let Some(e) = &self.cgroup_error {
            m.push(format!("cgroups ({e})"));
        }
        // What a run is confined by: a newer kernel is used at the newest ABI the sandbox
        // writes rules for, so a profile asking for more is refused rather than run with less.
        let enforced = self.landlock_abi.min(landlock::NEWEST);
        if landlock_abi_required > 0 && enforced < landlock_abi_required {
            m.push(format!(
                "Landlock ABI {landlock_abi_required} (host has {})",
                if self.landlock_abi == 0 {
                    "none".to_string()
                } else if enforced < self.landlock_abi {
                    format!("{}, enforced up to {enforced}", self.landlock_abi)
                } else {
                    self.landlock_abi.to_string()
                }
            ));
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(landlock_abi: u32) -> HostProbe {
        HostProbe {
            landlock_abi,
            seccomp: true,
            namespaces: vec!["mnt", "pid", "net", "ipc", "uts", "cgroup", "user"],
            missing_namespaces: Vec::new(),
            cgroup: Some("/sys/fs/cgroup/executor-arm".into()),
            cgroup_error: None,
            root: true,
        }
    }

    #[test]
    fn a_profile_needing_more_landlock_than_is_enforced_is_refused() {
        assert!(host(6).local_missing(6).is_empty());
        assert!(host(9).local_missing(landlock::NEWEST).is_empty());
        assert_eq!(host(3).local_missing(4).len(), 1);
        assert_eq!(host(0).local_missing(1).len(), 1);
        assert!(host(0).local_missing(0).is_empty());
        // A kernel newer than the rules the sandbox writes: its newer rights stay unhandled, so
        // a profile requiring them must not run as if they were enforced.
        let missing = host(9).local_missing(landlock::NEWEST + 1);
        assert_eq!(missing.len(), 1, "{missing:?}");
        assert!(missing[0].contains("enforced up to"), "{missing:?}");
    }
}
