//! What the host kernel gives us, probed once at startup and shown in /capabilities and /readyz.

use serde::Serialize;

use super::local::landlock;
use super::local::seccomp;

#[derive(Debug, Clone, Serialize)]
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
        if landlock_abi_required > 0 && self.landlock_abi < landlock_abi_required {
            m.push(format!(
                "Landlock ABI {landlock_abi_required} (host has {})",
                if self.landlock_abi == 0 {
                    "none".to_string()
                } else {
                    self.landlock_abi.to_string()
                }
            ));
        }
        m
    }
}
