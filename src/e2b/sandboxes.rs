//! What an E2B sandbox adds to the session it is: its template, `metadata` and `envVars`, the
//! access token of its data plane, and the pids its processes are known by.
//!
//! Owns: that record, per session id, in this process. Must not: hold the session itself (the
//! sessions service does), or decide who may call (the control plane checks the API key, the
//! data plane the access token, before either reads a record).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::pb::process::ProcessConfig;

/// A process the data plane started, as `process.Process` names it.
#[derive(Debug, Clone)]
pub struct Process {
    pub pid: u32,
    /// The session's background process (its `process_id`, the run's `exec_id`).
    pub exec_id: String,
    pub config: ProcessConfig,
    pub tag: Option<String>,
}

/// The E2B side of one sandbox.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub template_id: String,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    processes: Vec<Process>,
    next_pid: u32,
}

/// The first pid a sandbox's processes get (the low ones look like a system's own).
const FIRST_PID: u32 = 1000;
/// The processes a sandbox remembers (the oldest are forgotten past it).
const PROCESSES_KEPT: usize = 1024;

impl Sandbox {
    pub fn new(
        template_id: String,
        metadata: BTreeMap<String, String>,
        env_vars: BTreeMap<String, String>,
    ) -> Sandbox {
        Sandbox {
            template_id,
            metadata,
            env_vars,
            processes: Vec::new(),
            next_pid: FIRST_PID,
        }
    }
}

/// The sandboxes of this daemon's E2B API, and the key of their access tokens.
pub struct Sandboxes {
    /// HMAC-SHA256's own key size (its block); a fresh one per daemon process. A sandbox whose
    /// session outlives the process (paused) is given a new token when it is connected again.
    key: [u8; 64],
    records: Mutex<HashMap<String, Sandbox>>,
}

impl Default for Sandboxes {
    fn default() -> Self {
        Sandboxes {
            key: rand::random(),
            records: Mutex::new(HashMap::new()),
        }
    }
}

impl Sandboxes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sandbox>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mac(&self, id: &str) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new(&self.key.into());
        mac.update(b"e2b-envd-access\0");
        mac.update(id.as_bytes());
        mac
    }

    /// The access token of sandbox `id`'s data plane (`envdAccessToken`).
    pub fn access_token(&self, id: &str) -> String {
        hex::encode(self.mac(id).finalize().into_bytes())
    }

    /// Whether `token` is sandbox `id`'s access token (compared in constant time).
    pub fn token_opens(&self, id: &str, token: &str) -> bool {
        match hex::decode(token) {
            Ok(t) => self.mac(id).verify_slice(&t).is_ok(),
            Err(_) => false,
        }
    }

    /// The sandbox whose access token `token` is (each sandbox's is its own).
    pub fn opened_by(&self, token: &str) -> Option<String> {
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        ids.into_iter().find(|id| self.token_opens(id, token))
    }

    pub fn put(&self, id: &str, sandbox: Sandbox) {
        self.lock().insert(id.to_string(), sandbox);
    }

    /// Sandbox `id`'s record (a session made without the E2B API has none).
    pub fn get(&self, id: &str) -> Option<Sandbox> {
        self.lock().get(id).cloned()
    }

    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Records the process `exec_id` started in sandbox `id`, and gives it its pid.
    pub fn started(
        &self,
        id: &str,
        exec_id: String,
        config: ProcessConfig,
        tag: Option<String>,
    ) -> u32 {
        let mut all = self.lock();
        let sandbox = all
            .entry(id.to_string())
            .or_insert_with(|| Sandbox::new(String::new(), BTreeMap::new(), BTreeMap::new()));
        let pid = sandbox.next_pid;
        sandbox.next_pid = sandbox.next_pid.wrapping_add(1).max(FIRST_PID);
        if sandbox.processes.len() == PROCESSES_KEPT {
            sandbox.processes.remove(0);
        }
        sandbox.processes.push(Process {
            pid,
            exec_id,
            config,
            tag,
        });
        pid
    }

    /// The processes of sandbox `id`, oldest first.
    pub fn processes(&self, id: &str) -> Vec<Process> {
        self.lock()
            .get(id)
            .map(|s| s.processes.clone())
            .unwrap_or_default()
    }

    /// The process of sandbox `id` with `pid`.
    pub fn by_pid(&self, id: &str, pid: u32) -> Option<Process> {
        self.lock()
            .get(id)?
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .cloned()
    }

    /// The newest process of sandbox `id` tagged `tag`.
    pub fn by_tag(&self, id: &str, tag: &str) -> Option<Process> {
        self.lock()
            .get(id)?
            .processes
            .iter()
            .rev()
            .find(|p| p.tag.as_deref() == Some(tag))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_its_own_sandbox_only() {
        let s = Sandboxes::default();
        let t = s.access_token("ses_a");
        assert!(s.token_opens("ses_a", &t));
        assert!(!s.token_opens("ses_b", &t));
        assert!(!s.token_opens("ses_a", &t[..t.len() - 2]));
        assert!(!s.token_opens("ses_a", "not hex"));
        assert!(!s.token_opens("ses_a", ""));
        s.put(
            "ses_a",
            Sandbox::new("base".into(), Default::default(), Default::default()),
        );
        s.put(
            "ses_b",
            Sandbox::new("base".into(), Default::default(), Default::default()),
        );
        assert_eq!(s.opened_by(&t).as_deref(), Some("ses_a"));
        assert_eq!(s.opened_by(&s.access_token("ses_c")), None);
        let other = Sandboxes::default();
        assert!(!other.token_opens("ses_a", &t));
    }

    #[test]
    fn pids_are_per_sandbox_and_tags_find_the_newest() {
        let s = Sandboxes::default();
        let cfg = ProcessConfig::default();
        let a = s.started("x", "e1".into(), cfg.clone(), Some("web".into()));
        let b = s.started("x", "e2".into(), cfg.clone(), Some("web".into()));
        let c = s.started("y", "e3".into(), cfg, None);
        assert_eq!((a, b, c), (FIRST_PID, FIRST_PID + 1, FIRST_PID));
        assert_eq!(s.by_pid("x", b).unwrap().exec_id, "e2");
        assert!(s.by_pid("y", b).is_none());
        assert_eq!(s.by_tag("x", "web").unwrap().exec_id, "e2");
        assert!(s.by_tag("y", "web").is_none());
    }
}
