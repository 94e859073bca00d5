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

use crate::execution::runs::{Kept, LiveRun};
use crate::sandbox::StreamKind;
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
    /// A terminal: its stdin is its own (see [`super::terminal`]).
    pub(super) terminal: bool,
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

/// What a background process has written, from the offsets a reader asked for.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ProcessOutput {
    /// The process as its session's list shows it.
    #[serde(flatten)]
    pub process: ProcessInfo,
    pub stdout: OutputSpan,
    pub stderr: OutputSpan,
}

/// Some of one stream's output.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OutputSpan {
    /// The byte offset `text` begins at: the one asked for, or the oldest byte still kept when
    /// the process has written more than its ring keeps since then.
    pub from: usize,
    /// The bytes as UTF-8 (invalid sequences replaced; a character cut by the size limit is
    /// left for the next read).
    pub text: String,
    /// Where the next read goes on from (`from` + the bytes of `text`).
    pub next: usize,
    /// Whether more is written beyond `next` already.
    pub more: bool,
}

impl OutputSpan {
    /// What `kept` holds from `offset` on, at most `max` bytes. A character cut at the span's
    /// end (by the size limit, or because the rest of it is not written yet while the process
    /// runs, `running`) is left for the next read, which begins with it whole.
    fn of(kept: Kept<'_>, offset: usize, max: usize, running: bool) -> OutputSpan {
        let Some((from, rest)) = kept.from(offset) else {
            return OutputSpan {
                from: offset,
                text: String::new(),
                next: offset,
                more: false,
            };
        };
        let mut bytes = &rest[..rest.len().min(max)];
        if bytes.len() < rest.len() || running {
            bytes = &bytes[..bytes.len() - cut_char(bytes)];
        }
        OutputSpan {
            from,
            text: String::from_utf8_lossy(bytes).into_owned(),
            next: from + bytes.len(),
            more: bytes.len() < rest.len(),
        }
    }
}

/// How many bytes at the end of `bytes` begin a UTF-8 character that is not whole there (0
/// when its last character is whole, or is no UTF-8 at all).
fn cut_char(bytes: &[u8]) -> usize {
    // The last lead byte among the last four: a character is at most four bytes long.
    for back in 1..=bytes.len().min(4) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte
        }
        let len = match b {
            0xC2..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF4 => 4,
            _ => return 0,
        };
        return if back < len { back } else { 0 };
    }
    0
}

impl Process {
    /// What it has written from `stdout_from` and `stderr_from` on, at most `max` bytes of each.
    pub(super) fn output(
        &self,
        stdout_from: usize,
        stderr_from: usize,
        max: usize,
    ) -> ProcessOutput {
        // Read first: once it has its answer, all of its output is in.
        let process = self.describe();
        let running = process.state == ProcessState::Running;
        ProcessOutput {
            stdout: self.live.with_output(StreamKind::Stdout, |k| {
                OutputSpan::of(k, stdout_from, max, running)
            }),
            stderr: self.live.with_output(StreamKind::Stderr, |k| {
                OutputSpan::of(k, stderr_from, max, running)
            }),
            process,
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

#[cfg(test)]
mod tests {
    use super::OutputSpan;
    use crate::execution::runs::Kept;

    /// A span begins where it was asked (or at the oldest kept byte), ends at the size limit
    /// without cutting a character, and says whether more is kept. While the process runs, a
    /// character whose end is not written yet waits for the next read.
    #[test]
    fn output_spans() {
        let kept = Kept {
            start: 10,
            bytes: "ab\u{e9}cd".as_bytes(),
        };
        let s = OutputSpan::of(kept, 0, 100, false);
        assert_eq!(
            (s.from, s.text.as_str(), s.next, s.more),
            (10, "abécd", 16, false)
        );
        // 3 bytes would cut "é" (2 bytes) in two: the span stops before it.
        let s = OutputSpan::of(kept, 10, 3, false);
        assert_eq!(
            (s.from, s.text.as_str(), s.next, s.more),
            (10, "ab", 12, true)
        );
        let s = OutputSpan::of(kept, 12, 3, false);
        assert_eq!((s.text.as_str(), s.next, s.more), ("éc", 15, true));
        // At the end, and past it: nothing, nothing more.
        let s = OutputSpan::of(kept, 16, 3, false);
        assert_eq!(
            (s.from, s.text.as_str(), s.next, s.more),
            (16, "", 16, false)
        );
        let s = OutputSpan::of(kept, 99, 3, false);
        assert_eq!((s.from, s.next, s.more), (99, 99, false));
        // Bytes that are not UTF-8 are replaced, not held back.
        let bad = Kept {
            start: 0,
            bytes: &[0xff, b'x'],
        };
        let s = OutputSpan::of(bad, 0, 1, false);
        assert_eq!((s.text.as_str(), s.next, s.more), ("\u{fffd}", 1, true));
        // The live edge: half of "é" written so far (after an invalid byte too).
        let half = Kept {
            start: 0,
            bytes: &[0xff, b'a', 0xC3],
        };
        let s = OutputSpan::of(half, 0, 100, true);
        assert_eq!((s.text.as_str(), s.next, s.more), ("\u{fffd}a", 2, true));
        // Ended: what is there is all there will be.
        let s = OutputSpan::of(half, 0, 100, false);
        assert_eq!((s.text.as_str(), s.next), ("\u{fffd}a\u{fffd}", 3));
        // A four-byte character cut after each of its first three bytes, and whole.
        let emoji = "\u{1F600}".as_bytes();
        for n in 1..4 {
            let k = Kept {
                start: 0,
                bytes: &emoji[..n],
            };
            assert_eq!(OutputSpan::of(k, 0, 100, true).next, 0, "{n} bytes");
        }
        let k = Kept::whole(emoji);
        assert_eq!(OutputSpan::of(k, 0, 100, true).text, "\u{1F600}");
    }
}
