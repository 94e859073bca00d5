//! What an E2B sandbox adds to the session it is: its template, `metadata` and `envVars`, the
//! access token of its data plane, and the pids its processes are known by.
//!
//! Owns: that record, per session id, in this process, bounded in size and forgotten once its
//! session is gone. Must not: hold the session itself (the sessions service does), or decide
//! who may call (the control plane checks the API key, the data plane the access token, before
//! either reads a record).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use subtle::ConstantTimeEq;

use super::pb::process::ProcessConfig;
use super::pty::PtyHandle;

/// A process the data plane started, as `process.Process` names it.
#[derive(Debug, Clone)]
pub struct Process {
    pub pid: u32,
    /// The session's background process (its `process_id`, the run's `exec_id`).
    pub exec_id: String,
    pub config: ProcessConfig,
    pub tag: Option<String>,
    /// A PTY's: how its input and resizes reach it.
    pub pty: Option<PtyHandle>,
}

/// The E2B side of one sandbox.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub template_id: String,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// The data plane's access token (`envdAccessToken`): random, the sandbox's own for its life
    /// in this process (an SDK keeps the one it was first given across pause and connect).
    token: String,
    processes: Vec<Process>,
    next_pid: u32,
}

/// The first pid a sandbox's processes get (the low ones look like a system's own).
const FIRST_PID: u32 = 1000;
/// The processes a sandbox remembers (the oldest ended ones are forgotten past it): more than a
/// session may run at once.
const PROCESSES_KEPT: usize = crate::config::MAX_SESSION_PROCESSES + 1;

/// The most `metadata` or `envVars` entries a sandbox keeps, and the longest key and value.
pub const MAX_ENTRIES: usize = 64;
pub const MAX_KEY_BYTES: usize = 256;
pub const MAX_VALUE_BYTES: usize = 4096;
/// The most bytes of a process's config (`cmd`, `args`, `envs`, `cwd`) and tag a sandbox keeps.
pub const MAX_CONFIG_BYTES: usize = 64 * 1024;
pub const MAX_TAG_BYTES: usize = 256;

/// Why a map of `what` is refused, if it is (entries, key and value sizes).
pub fn check_map(what: &str, map: &BTreeMap<String, String>) -> Result<(), String> {
    if map.len() > MAX_ENTRIES {
        return Err(format!("{what} has more than {MAX_ENTRIES} entries"));
    }
    for (k, v) in map {
        if k.len() > MAX_KEY_BYTES || v.len() > MAX_VALUE_BYTES {
            return Err(format!(
                "{what}: a key is at most {MAX_KEY_BYTES} bytes and a value {MAX_VALUE_BYTES}"
            ));
        }
    }
    Ok(())
}

/// The bytes a process's config takes.
pub fn config_bytes(c: &ProcessConfig) -> usize {
    c.cmd.len()
        + c.args.iter().map(String::len).sum::<usize>()
        + c.envs.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
        + c.cwd.as_ref().map_or(0, String::len)
}

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
            token: hex::encode(rand::random::<[u8; 32]>()),
            processes: Vec::new(),
            next_pid: FIRST_PID,
        }
    }
}

/// The sandboxes of this daemon's E2B API.
#[derive(Default)]
pub struct Sandboxes {
    inner: Mutex<Records>,
}

#[derive(Default)]
struct Records {
    by_id: HashMap<String, Sandbox>,
    /// Access token → sandbox id.
    by_token: HashMap<String, String>,
    /// Sandboxes the last prune found without a session: forgotten if the next one does too (a
    /// session being paused or resumed is in neither place for a moment).
    missing: std::collections::HashSet<String>,
}

impl Sandboxes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sandbox `id`'s record, made (with a fresh token and no template) if it has none: a
    /// session made through another front end, or one paused before this process started.
    fn entry<'a>(records: &'a mut Records, id: &str) -> &'a mut Sandbox {
        if !records.by_id.contains_key(id) {
            let s = Sandbox::new(String::new(), BTreeMap::new(), BTreeMap::new());
            records.by_token.insert(s.token.clone(), id.to_string());
            records.by_id.insert(id.to_string(), s);
        }
        records.by_id.get_mut(id).expect("just made")
    }

    /// The access token of sandbox `id`'s data plane (`envdAccessToken`).
    pub fn access_token(&self, id: &str) -> String {
        Self::entry(&mut self.lock(), id).token.clone()
    }

    /// Whether `token` is sandbox `id`'s access token (compared in constant time).
    pub fn token_opens(&self, id: &str, token: &str) -> bool {
        self.lock()
            .by_id
            .get(id)
            .is_some_and(|s| bool::from(s.token.as_bytes().ct_eq(token.as_bytes())))
    }

    /// The sandbox whose access token `token` is.
    pub fn opened_by(&self, token: &str) -> Option<String> {
        self.lock().by_token.get(token).cloned()
    }

    pub fn put(&self, id: &str, sandbox: Sandbox) {
        let mut r = self.lock();
        if let Some(old) = r.by_id.remove(id) {
            r.by_token.remove(&old.token);
        }
        r.by_token.insert(sandbox.token.clone(), id.to_string());
        r.by_id.insert(id.to_string(), sandbox);
    }

    /// Sandbox `id`'s record (a session made without the E2B API has none).
    pub fn get(&self, id: &str) -> Option<Sandbox> {
        self.lock().by_id.get(id).cloned()
    }

    pub fn forget(&self, id: &str) {
        let mut r = self.lock();
        if let Some(old) = r.by_id.remove(id) {
            r.by_token.remove(&old.token);
        }
    }

    /// The ids of every sandbox with a record.
    pub fn ids(&self) -> Vec<String> {
        self.lock().by_id.keys().cloned().collect()
    }

    /// Forgets every sandbox `exists` said was gone (its session neither runs nor is paused)
    /// both now and at the previous prune.
    pub fn prune(&self, exists: impl Fn(&str) -> bool) {
        let mut r = self.lock();
        let missing: std::collections::HashSet<String> =
            r.by_id.keys().filter(|id| !exists(id)).cloned().collect();
        let gone: Vec<String> = missing.intersection(&r.missing).cloned().collect();
        for id in &gone {
            if let Some(old) = r.by_id.remove(id) {
                r.by_token.remove(&old.token);
            }
        }
        r.missing = missing
            .into_iter()
            .filter(|id| !gone.contains(id))
            .collect();
    }

    /// Records the process `exec_id` started in sandbox `id`, and gives it its pid. Past
    /// [`PROCESSES_KEPT`], the oldest record of an ended process (as `ended` tells) is forgotten:
    /// a running one stays reachable (the oldest of all goes only when every one runs, which a
    /// session's `sessions.max_processes`, below it, never lets happen).
    pub fn started(
        &self,
        id: &str,
        exec_id: String,
        config: ProcessConfig,
        tag: Option<String>,
        pty: Option<PtyHandle>,
        ended: impl Fn(&Process) -> bool,
    ) -> u32 {
        let mut all = self.lock();
        let sandbox = Self::entry(&mut all, id);
        let pid = sandbox.next_pid;
        sandbox.next_pid = sandbox.next_pid.wrapping_add(1).max(FIRST_PID);
        if sandbox.processes.len() >= PROCESSES_KEPT {
            let gone = sandbox.processes.iter().position(ended).unwrap_or(0);
            sandbox.processes.remove(gone);
        }
        sandbox.processes.push(Process {
            pid,
            exec_id,
            config,
            tag,
            pty,
        });
        pid
    }

    /// The processes of sandbox `id` that `keep` keeps, oldest first.
    pub fn processes(&self, id: &str, keep: impl Fn(&Process) -> bool) -> Vec<Process> {
        self.lock()
            .by_id
            .get(id)
            .map(|s| s.processes.iter().filter(|p| keep(p)).cloned().collect())
            .unwrap_or_default()
    }

    /// The process of sandbox `id` with `pid`.
    pub fn by_pid(&self, id: &str, pid: u32) -> Option<Process> {
        self.lock()
            .by_id
            .get(id)?
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .cloned()
    }

    /// The newest process of sandbox `id` tagged `tag`.
    pub fn by_tag(&self, id: &str, tag: &str) -> Option<Process> {
        self.lock()
            .by_id
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

    fn sandbox() -> Sandbox {
        Sandbox::new("base".into(), Default::default(), Default::default())
    }

    #[test]
    fn a_token_opens_its_own_sandbox_only() {
        let s = Sandboxes::default();
        s.put("ses_a", sandbox());
        s.put("ses_b", sandbox());
        let t = s.access_token("ses_a");
        assert_eq!(t.len(), 64);
        assert!(s.token_opens("ses_a", &t));
        assert!(!s.token_opens("ses_b", &t));
        assert!(!s.token_opens("ses_a", &t[..t.len() - 2]));
        assert!(!s.token_opens("ses_a", ""));
        assert!(!s.token_opens("ses_c", &t));
        assert_eq!(s.opened_by(&t).as_deref(), Some("ses_a"));
        assert_eq!(
            s.opened_by(&s.access_token("ses_b")).as_deref(),
            Some("ses_b")
        );
        assert_eq!(s.opened_by("00"), None);
        // Stable for the sandbox's life here; gone with it.
        assert_eq!(s.access_token("ses_a"), t);
        s.forget("ses_a");
        assert!(!s.token_opens("ses_a", &t));
        assert_eq!(s.opened_by(&t), None);
    }

    #[test]
    fn records_of_ended_sessions_are_pruned() {
        let s = Sandboxes::default();
        s.put("live", sandbox());
        s.put("gone", sandbox());
        s.put("moving", sandbox());
        let t = s.access_token("gone");
        // Missing once (a pause or resume in progress) is not gone.
        s.prune(|id| id == "live");
        assert!(s.get("gone").is_some() && s.get("moving").is_some());
        s.prune(|id| id == "live" || id == "moving");
        assert!(s.get("live").is_some());
        assert!(s.get("moving").is_some());
        assert!(s.get("gone").is_none());
        assert_eq!(s.opened_by(&t), None);
        // Found again, then missing once: kept.
        s.prune(|id| id == "live");
        assert!(s.get("moving").is_some());
    }

    #[test]
    fn pids_are_per_sandbox_and_tags_find_the_newest() {
        let s = Sandboxes::default();
        let cfg = ProcessConfig::default();
        let a = s.started(
            "x",
            "e1".into(),
            cfg.clone(),
            Some("web".into()),
            None,
            |_| true,
        );
        let b = s.started(
            "x",
            "e2".into(),
            cfg.clone(),
            Some("web".into()),
            None,
            |_| true,
        );
        let c = s.started("y", "e3".into(), cfg.clone(), None, None, |_| true);
        assert_eq!((a, b, c), (FIRST_PID, FIRST_PID + 1, FIRST_PID));
        assert_eq!(s.by_pid("x", b).unwrap().exec_id, "e2");
        assert!(s.by_pid("y", b).is_none());
        assert_eq!(s.by_tag("x", "web").unwrap().exec_id, "e2");
        assert!(s.by_tag("y", "web").is_none());
        assert_eq!(s.processes("x", |p| p.pid != a).len(), 1);
    }

    #[test]
    fn a_running_process_is_never_forgotten_for_a_newer_one() {
        let s = Sandboxes::default();
        let cfg = ProcessConfig::default();
        // The first runs for good; every other one has ended.
        let running = s.started("x", "live".into(), cfg.clone(), None, None, |_| false);
        let ended = |p: &Process| p.exec_id != "live";
        for i in 0..(2 * PROCESSES_KEPT) {
            s.started("x", format!("e{i}"), cfg.clone(), None, None, ended);
        }
        assert_eq!(s.processes("x", |_| true).len(), PROCESSES_KEPT);
        assert_eq!(s.by_pid("x", running).unwrap().exec_id, "live");
        // The newest ended ones are the ones kept.
        let last = format!("e{}", 2 * PROCESSES_KEPT - 1);
        assert!(s.processes("x", |p| p.exec_id == last).len() == 1);
        assert!(s.processes("x", |p| p.exec_id == "e0").is_empty());
    }

    #[test]
    fn maps_are_bounded() {
        let mut m = BTreeMap::new();
        assert!(check_map("metadata", &m).is_ok());
        m.insert("k".repeat(MAX_KEY_BYTES + 1), "v".into());
        assert!(check_map("metadata", &m).is_err());
        let many: BTreeMap<String, String> = (0..=MAX_ENTRIES)
            .map(|i| (i.to_string(), String::new()))
            .collect();
        assert!(check_map("envVars", &many).is_err());
    }
}
