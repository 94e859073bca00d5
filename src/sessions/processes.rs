//! A session's background processes: execs started with `"background": true`, which run beside
//! the session's other execs and outlive the call that started them.
//!
//! A background process is a run like any other (its exec id, its live output and answer, its
//! audit line when it ends); its process id is its exec id. What it adds: it does not take the
//! session's one-exec claim, its stdin stays open for the caller ([`Control::Stdin`]), the caller
//! may signal it, and it ends with the session (delete, expiry, pause, shutdown). At most
//! `sessions.max_processes` run at once per session (429 past it).
//!
//! Owns: a session's table of processes (this module), starting, controlling and stopping them
//! ([`super::background`]). Must not: run anything (the execution service does) or know HTTP.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::execution::runs::LiveRun;
use crate::sandbox::control::ControlSender;
use serde::Serialize;

/// Ended processes a session still lists (the newest).
const ENDED_KEPT: usize = 64;

/// One background process of a session.
pub struct Process {
    pub(super) live: Arc<LiveRun>,
    pub(super) code_sha256: String,
    pub(super) started_at: chrono::DateTime<chrono::Utc>,
    pub(super) controls: ControlSender,
}

/// Where a process stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    Running,
    Exited,
}

/// A process as its session's list shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ProcessInfo {
    /// The process's id: its exec id.
    pub process_id: String,
    pub exec_id: String,
    /// `sha256:<hex>` of its code.
    pub code_sha256: String,
    /// RFC 3339, UTC, milliseconds.
    pub started_at: String,
    pub state: ProcessState,
    /// Once it ended: its exit code (128 + the signal's number when a signal ended it; absent
    /// when it ended without a result).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
}

impl Process {
    pub(super) fn ended(&self) -> bool {
        self.live.answered().is_some()
    }

    fn describe(&self) -> ProcessInfo {
        let answer = self.live.answered();
        let exit_code = answer.as_ref().and_then(|a| {
            serde_json::from_str::<serde_json::Value>(&a.body)
                .ok()
                .and_then(|v| v.get("exit_code").and_then(serde_json::Value::as_i64))
        });
        ProcessInfo {
            process_id: self.live.exec_id().to_string(),
            exec_id: self.live.exec_id().to_string(),
            code_sha256: self.code_sha256.clone(),
            started_at: self
                .started_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            state: if answer.is_some() {
                ProcessState::Exited
            } else {
                ProcessState::Running
            },
            exit_code,
        }
    }
}

/// A session's processes: those starting, those running, the last ended ones.
#[derive(Default)]
pub struct Processes {
    inner: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Set when the session ends: no process starts from then on.
    closed: bool,
    /// Places taken by processes on their way to start.
    starting: usize,
    procs: VecDeque<Arc<Process>>,
}

impl Processes {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The processes, oldest first.
    pub fn list(&self) -> Vec<ProcessInfo> {
        self.table().procs.iter().map(|p| p.describe()).collect()
    }

    /// Process `id`.
    pub(super) fn get(&self, id: &str) -> Option<Arc<Process>> {
        self.table()
            .procs
            .iter()
            .find(|p| p.live.exec_id() == id)
            .cloned()
    }

    /// Every process, running or ended.
    pub(super) fn all(&self) -> Vec<Arc<Process>> {
        self.table().procs.iter().cloned().collect()
    }

    /// Whether one runs or is on its way to start.
    pub(super) fn any_live(&self) -> bool {
        let t = self.table();
        t.starting > 0 || t.procs.iter().any(|p| !p.ended())
    }

    /// Takes a place for a process on its way to start. Err(None): the table is closed (the
    /// session ends); Err(Some(max)): `max` run or start already.
    pub(super) fn reserve(&self, max: usize) -> Result<(), Option<usize>> {
        let mut t = self.table();
        if t.closed {
            return Err(None);
        }
        if t.procs.iter().filter(|p| !p.ended()).count() + t.starting >= max {
            return Err(Some(max));
        }
        t.starting += 1;
        Ok(())
    }

    /// Gives back a place taken by [`Processes::reserve`], for a process that did not start.
    pub(super) fn unreserve(&self) {
        self.table().starting -= 1;
    }

    /// A process that took its place started (listed even if the table closed meanwhile: the
    /// session's end waits for its starts, then stops what it lists).
    pub(super) fn add(&self, process: Arc<Process>) {
        let mut t = self.table();
        t.starting -= 1;
        t.procs.push_back(process);
        // Ended ones beyond what the list keeps go, oldest first.
        while t.procs.iter().filter(|p| p.ended()).count() > ENDED_KEPT {
            if let Some(i) = t.procs.iter().position(|p| p.ended()) {
                t.procs.remove(i);
            }
        }
    }

    /// No process starts from now on (`true`), or again (`false`).
    pub(super) fn set_closed(&self, closed: bool) {
        self.table().closed = closed;
    }

    /// Processes on their way to start.
    pub(super) fn starting(&self) -> usize {
        self.table().starting
    }
}
