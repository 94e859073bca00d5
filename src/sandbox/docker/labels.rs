//! What marks a container as ours: its labels and the daemon process that owns it.
//!
//! Every container and volume the docker backend creates carries these labels; the janitor's
//! sweeps select by them and tell a live owner from a crashed one by the owner label, and the
//! egress socket directories are named after the same owner.
//!
//! Owns: label names and values, the owner's identity. Must not: talk to the engine.

use std::collections::HashMap;

use crate::sandbox::BackendKind;

/// Label every container of ours carries; the startup sweep only ever touches these.
pub const LABEL_MANAGED: &str = "executor-arm.managed";
/// The daemon instance (`AppState::instance_id`) that created the container.
pub const LABEL_INSTANCE: &str = "executor-arm.instance";
/// The execution; `pool-<uuid>` while a warm container waits for one (labels are immutable, so a
/// pooled container is renamed `executor-arm-<exec_id>` when it is taken).
pub const LABEL_EXEC_ID: &str = "executor-arm.exec_id";
/// `<hostname>/<pid namespace>/<pid>/<pid start time>` of the creating daemon: lets a later daemon
/// on the same host tell a live owner from a crashed one (pids are reused; start times are not).
pub const LABEL_OWNER: &str = "executor-arm.owner";
/// `docker` | `gvisor`.
pub const LABEL_BACKEND: &str = "executor-arm.backend";
/// Who we are, written on every container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub instance: String,
    pub host: String,
    /// `pid:[inode]` of our pid namespace: pids are only comparable within one.
    pub pid_ns: String,
    pub pid: u32,
    pub start_time: u64,
}

impl Owner {
    pub fn label(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            self.host, self.pid_ns, self.pid, self.start_time
        )
    }

    /// Parses an owner label back; `None` when it is not one of ours.
    pub fn parse_label(s: &str) -> Option<Owner> {
        let mut it = s.rsplitn(4, '/');
        let start_time = it.next()?.parse().ok()?;
        let pid = it.next()?.parse().ok()?;
        let pid_ns = it.next()?.to_string();
        let host = it.next()?.to_string();
        Some(Owner {
            instance: String::new(),
            host,
            pid_ns,
            pid,
            start_time,
        })
    }

    /// Same daemon process (the instance name is not part of the label).
    pub fn same_process(&self, other: &Owner) -> bool {
        self.host == other.host
            && self.pid_ns == other.pid_ns
            && self.pid == other.pid
            && self.start_time == other.start_time
    }
}

/// The labels of one container and of its disk volume.
pub fn labels(owner: &Owner, exec_label: &str, kind: BackendKind) -> HashMap<String, String> {
    HashMap::from([
        (LABEL_MANAGED.to_string(), "true".to_string()),
        (LABEL_INSTANCE.to_string(), owner.instance.clone()),
        (LABEL_EXEC_ID.to_string(), exec_label.to_string()),
        (LABEL_OWNER.to_string(), owner.label()),
        (LABEL_BACKEND.to_string(), kind.as_str().to_string()),
    ])
}

/// Start time (clock ticks after boot, field 22 of `/proc/<pid>/stat`) of a live process.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}
