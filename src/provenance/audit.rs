//! The audit log: one typed event per line — refusals, each admitted execution's start and end,
//! segment starts — hash-chained and fsync'd.
//!
//! A line is `B` with `,"entry_hash":"sha256:<hex>"}` in place of its closing brace, where `B` is
//! the canonical JSON (sorted keys) of the event plus `seq`, `prev_hash`, `ts` and `instance`, and
//! `<hex>` is sha256 of exactly those bytes. `verify` hashes the bytes it reads, never a
//! re-serialisation, so no value a caller sends (a float that does not survive a parse/print round
//! trip, an integer past u64) can make a line fail to verify. It parses a line only to read `seq`,
//! `prev_hash` and, on a first line, the segment start. An edited line breaks its own hash, a
//! dropped or inserted line breaks `seq` and `prev_hash`, a reordered pair breaks both.
//!
//! Lines of the previous format (`entry_hash` among the sorted keys, hashed over the canonical
//! re-serialisation of the parsed line) still verify by that rule, up to the first line of this one.
//!
//! A log that does not verify at start is moved aside, never deleted nor extended; a new segment
//! starts with a `segment_start` line that records it and chains from its last good line.
//!
//! The walk that verifies the log at start also keeps the `execution_start` lines that have no end
//! line yet: runs a daemon started and never ended because it stopped (a crash, a kill). They are
//! handed to the caller ([`AuditLog::interrupted`]), which records how they ended.
//!
//! Owns: the line format, the chain and segments, `seq`/`prev_hash`/`entry_hash`/`ts`/`instance`.
//! Must not: decide what is audited (the execution service and the api layer build the events).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::{canonical_json, sha256_prefixed};
use crate::egress::ConnRecord;

mod refusals;
use refusals::RefusalBudget;
pub use refusals::{RefusalRate, RefusalsSuppressed};

pub const GENESIS: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

const ENTRY_HASH_KEY: &str = ",\"entry_hash\":\"sha256:";
/// `,"entry_hash":"sha256:` + 64 hex digits + `"}`.
const ENTRY_HASH_SUFFIX_LEN: usize = ENTRY_HASH_KEY.len() + 64 + 2;

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("audit log {path} line {line}: {message}")]
    Broken {
        path: PathBuf,
        line: u64,
        message: String,
    },
    #[error("audit log {path}: cannot encode a {event} event: {message}")]
    Encode {
        path: PathBuf,
        event: &'static str,
        message: String,
    },
}

impl AuditError {
    /// What failed, without the log's path (for answers to callers and /readyz).
    pub fn cause(&self) -> String {
        match self {
            AuditError::Io { source, .. } => source.to_string(),
            AuditError::Broken { line, message, .. } => format!("line {line}: {message}"),
            AuditError::Encode { message, .. } => message.clone(),
        }
    }
}

/// One audit event. The log adds `seq`, `prev_hash`, `entry_hash`, `ts` and `instance`.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum AuditEvent {
    /// A request refused with 401 or 403.
    Refusal(Refusal),
    /// An admitted execution, before it runs. Not fsync'd on its own: its end line's fsync is.
    ExecutionStart(Run),
    /// An execution that ran to an outcome.
    Execution {
        #[serde(flatten)]
        run: Run,
        #[serde(flatten)]
        end: Box<RunEnd>,
    },
    /// An admitted execution that ended without an outcome (backend unavailable, internal
    /// error, panic).
    ExecutionError {
        #[serde(flatten)]
        run: Run,
        error_type: &'static str,
        error: String,
    },
    /// The first line of a segment that replaces a log which did not verify.
    SegmentStart(SegmentStart),
    /// Refusals over their class's rate, counted instead of written one by one.
    RefusalsSuppressed(RefusalsSuppressed),
    /// A caller asked to stop a running execution (its end line follows when it has stopped).
    ExecutionCancel(Cancel),
    /// A session was made (its execs are `execution_start` / `execution` lines with its id).
    SessionCreate(SessionOpened),
    /// A session ended: deleted, expired, or the daemon stopped.
    SessionEnd(SessionClosed),
    /// A file was written into a session's workspace through the files API.
    SessionFile(SessionUpload),
    /// A session was paused: its workspace saved, its sandbox freed.
    SessionPause(SessionPaused),
    /// A paused session got a fresh sandbox with its saved workspace.
    SessionResume(SessionResumed),
    /// An archive was extracted into a session's workspace (written once it was checked and
    /// staged, before any of it entered the workspace).
    SessionArchive(SessionArchiveUpload),
    /// A session's terminal ended: when it started and ended, the bytes each way (never the
    /// bytes themselves). Its process is also an `execution` line (the supervisor's pty mode).
    SessionTerminal(SessionTerminal),
}

impl AuditEvent {
    /// The `event` field, a closed set (metric label).
    pub fn name(&self) -> &'static str {
        match self {
            AuditEvent::Refusal(_) => "refusal",
            AuditEvent::ExecutionStart(_) => "execution_start",
            AuditEvent::Execution { .. } => "execution",
            AuditEvent::ExecutionError { .. } => "execution_error",
            AuditEvent::SegmentStart(_) => "segment_start",
            AuditEvent::RefusalsSuppressed(_) => "refusals_suppressed",
            AuditEvent::ExecutionCancel(_) => "execution_cancel",
            AuditEvent::SessionCreate(_) => "session_create",
            AuditEvent::SessionEnd(_) => "session_end",
            AuditEvent::SessionFile(_) => "session_file",
            AuditEvent::SessionPause(_) => "session_pause",
            AuditEvent::SessionResume(_) => "session_resume",
            AuditEvent::SessionArchive(_) => "session_archive",
            AuditEvent::SessionTerminal(_) => "session_terminal",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Refusal {
    pub request_id: String,
    pub status: u16,
    pub error_type: &'static str,
    pub reason: String,
    pub subject: Option<String>,
    pub token_id: Option<String>,
    pub action_type: Option<String>,
    pub command: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command_hash: Option<String>,
}

/// Who asked to stop which execution, and the grace its processes get between SIGTERM and
/// SIGKILL.
#[derive(Debug, Clone, Serialize)]
pub struct Cancel {
    pub request_id: String,
    pub exec_id: String,
    /// The calling service's subject.
    pub subject: Option<String>,
    pub grace_seconds: u64,
}

/// A session as it was made.
#[derive(Debug, Clone, Serialize)]
pub struct SessionOpened {
    pub request_id: String,
    pub session_id: String,
    /// The calling service that owns it, and the tenant it belongs to ("" without one).
    pub owner: String,
    pub tenant: String,
    pub token_id: Option<String>,
    pub language: String,
    pub backend: &'static str,
    pub profile: String,
    pub expires_at: String,
}

/// A file a caller put into a session's workspace: what later execs may run besides their code.
#[derive(Debug, Clone, Serialize)]
pub struct SessionUpload {
    pub request_id: String,
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

/// A session paused, and the workspace it saved.
#[derive(Debug, Clone, Serialize)]
pub struct SessionPaused {
    pub request_id: String,
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    /// `sha256:<hex>` of the saved workspace (a tar).
    pub workspace_sha256: String,
    pub workspace_bytes: u64,
}

/// A session resumed, and the workspace it was given (checked against its digest first).
#[derive(Debug, Clone, Serialize)]
pub struct SessionResumed {
    pub request_id: String,
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    pub backend: &'static str,
    pub workspace_sha256: String,
    pub workspace_bytes: u64,
}

/// An archive uploaded into a session's workspace.
#[derive(Debug, Clone, Serialize)]
pub struct SessionArchiveUpload {
    pub request_id: String,
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    /// The workspace directory it went into ("" is the workspace).
    pub path: String,
    /// The tar's bytes and their digest.
    pub bytes: u64,
    pub sha256: String,
    /// Its members (files, directories, symlinks).
    pub members: u64,
}

/// A session's terminal, written once it ended.
#[derive(Debug, Clone, Serialize)]
pub struct SessionTerminal {
    pub request_id: String,
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    /// The terminal's process (its exec id: the `execution` line of its run has it too).
    pub process_id: String,
    /// RFC 3339, UTC, milliseconds.
    pub started_at: String,
    pub ended_at: String,
    /// `closed` (its caller closed the socket), `exited` (the shell, or the session, ended it),
    /// `refused` (a frame over `sessions.max_frame_bytes` or a malformed text frame).
    pub end: &'static str,
    /// Bytes typed into the terminal and bytes of its output sent to the caller.
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// Why a session ended.
#[derive(Debug, Clone, Serialize)]
pub struct SessionClosed {
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    /// `deleted`, `expired` (its TTL, or its time paused), `idle`, `shutdown`,
    /// `sandbox_gone`.
    pub reason: &'static str,
    pub execs: u64,
}

/// What every line of one admitted execution carries: its start, its end or its error. Read back
/// from a start line for a run that never ended (a field that line lacks reads as empty).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Run {
    pub request_id: String,
    pub exec_id: String,
    /// The calling service's subject, else the capability token's.
    pub subject: Option<String>,
    /// Whose run it is: the calling service's subject, `-` for a service token without one
    /// (lines written before this field existed lack it; their `subject` is the owner).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    pub token_id: Option<String>,
    pub action_type: Cow<'static, str>,
    pub command: String,
    pub args: Vec<String>,
    pub command_hash: String,
    pub invocation_hash: String,
    pub backend: Cow<'static, str>,
    pub profile: String,
    /// The wall-clock limit the run got.
    pub timeout_seconds: u64,
    /// The request's Idempotency-Key as the state store holds it, scoped by the calling service
    /// (`<subject length>:<subject>:<key>`, `IdemKey::scoped`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The front end the request came through when it was not the REST API (`mcp`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<Cow<'static, str>>,
}

/// A run whose `execution_start` line has no end line in the log as opened: the daemon that
/// started it stopped before the run ended.
#[derive(Debug, Clone)]
pub struct Interrupted {
    pub run: Run,
    /// The instance that wrote the start line (the daemon that stopped).
    pub instance: String,
    /// The start line's seq.
    pub seq: u64,
}

/// How an execution ended.
#[derive(Debug, Clone, Serialize)]
pub struct RunEnd {
    pub capabilities_used: Vec<&'static str>,
    pub outcome: &'static str,
    pub exit_code: i32,
    pub duration_ms: u64,
    pub killed_reason: Option<&'static str>,
    pub oom: bool,
    pub peak_memory_kib: Option<u64>,
    pub stdout_sha256: String,
    pub stderr_sha256: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub executor_def_sha256: Option<String>,
    /// External executions only (present there, null on success).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<Option<&'static str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Vec<ConnRecord>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    /// A reused container's id (12 hex digits) and how many runs it has served, this one
    /// included; absent for a run in a container (or sandbox) of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_uses: Option<u32>,
}

/// The segment a new one replaces: where it went, why, and the end of its good part.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentStart {
    /// File name the old segment was moved to, in the same directory.
    pub previous_file: String,
    pub previous_state: &'static str,
    pub previous_error: String,
    pub previous_verified_lines: u64,
    pub previous_last_seq: u64,
    pub previous_last_hash: String,
    /// sha256 of the whole old file, as moved.
    pub previous_sha256: String,
}

/// An intact chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub lines: u64,
    pub last_seq: u64,
    pub last_hash: String,
    /// For a segment that starts with `segment_start`: the previous segment's last seq and hash.
    pub continues: Option<(u64, String)>,
}

impl Verified {
    fn empty() -> Self {
        Verified {
            lines: 0,
            last_seq: 0,
            last_hash: GENESIS.to_string(),
            continues: None,
        }
    }
}

struct Tail {
    file: File,
    seq: u64,
    last_hash: String,
    /// Length of the file up to its last whole line.
    len: u64,
    /// A failed append may have left part of a line past `len` that could not be cut off yet.
    torn: bool,
}

/// Where an appended line ended, for [`AuditLog::commit`].
struct Written {
    seq: u64,
    end: u64,
    /// The line's `entry_hash`.
    hash: String,
    /// The line's `ts`.
    ts: String,
}

/// Where a line went in the log: its `seq` and its `entry_hash` (`sha256:<hex>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub entry_hash: String,
    /// The line's `ts` (RFC 3339 UTC, milliseconds).
    pub ts: String,
}

/// Failed `fdatasync` ranges remembered at most (oldest forgotten first); the appends waiting
/// on one are served long before this many more fail.
const FAILED_SYNCS: usize = 64;

/// What is known about the log on disk.
struct Synced {
    /// Every line ending at or before this offset is durable.
    len: u64,
    /// Byte ranges `(start, end]` whose `fdatasync` failed, oldest first. Their lines stay in
    /// the file (cutting them would drop runs' start lines already acknowledged, and hand their
    /// sequence numbers out twice) but are never reported durable: the kernel reports a
    /// writeback error once, so a later `fdatasync` can succeed without them being on disk.
    failed: std::collections::VecDeque<(u64, u64)>,
}

pub struct AuditLog {
    path: PathBuf,
    instance: String,
    tail: Mutex<Tail>,
    /// Group commit: one `fdatasync` makes every line written before it durable, so appenders
    /// waiting here find their line already covered by the one in progress. Locked before
    /// `tail`, never after.
    synced: Mutex<Synced>,
    /// The log's open file description again, synced without holding `tail`.
    sync_file: File,
    /// Why the last append failed, until an append or a probe succeeds (for /readyz).
    failing: Mutex<Option<String>>,
    recovered: Option<SegmentStart>,
    interrupted: Vec<Interrupted>,
    /// Which refusals get a line of their own (see `refusals`). Locked after `tail`, never before.
    refusals: Mutex<RefusalBudget>,
}

impl AuditLog {
    /// Opens (creating) the log and continues its chain; every line gets `instance`. A log that
    /// does not verify is moved aside and a new segment started (see [`AuditLog::recovered`]).
    pub fn open(path: &Path, instance: &str) -> Result<AuditLog, AuditError> {
        let io = |source| AuditError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let walked = match File::open(path) {
            Ok(f) => Some(walk(path, f, &mut |_, _| {})?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(e)),
        };
        // Runs left open in the good part of a broken log are interrupted too: the new segment
        // records them.
        let (chain, segment, open) = match walked {
            None => (Verified::empty(), None, OpenRuns::default()),
            Some(Walk::Intact(v, open)) => (v, None, open),
            Some(Walk::Broken { good, error, open }) => {
                let segment = move_aside(path, &good, &error)?;
                let chain = Verified {
                    lines: 0,
                    last_seq: good.last_seq,
                    last_hash: good.last_hash,
                    continues: None,
                };
                (chain, Some(segment), open)
            }
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
        }
        let len = file.metadata().map_err(io)?.len();
        let sync_file = file.try_clone().map_err(io)?;
        let log = AuditLog {
            path: path.to_path_buf(),
            instance: instance.to_string(),
            synced: Mutex::new(Synced {
                len,
                failed: Default::default(),
            }),
            sync_file,
            tail: Mutex::new(Tail {
                file,
                seq: chain.last_seq,
                last_hash: chain.last_hash,
                len,
                torn: false,
            }),
            failing: Mutex::new(None),
            recovered: segment.clone(),
            interrupted: open.into_interrupted(),
            refusals: Mutex::new(RefusalBudget::new(RefusalRate::default())),
        };
        if let Some(s) = segment {
            tracing::error!(
                target: "audit",
                previous_file = %s.previous_file,
                error = %s.previous_error,
                verified_lines = s.previous_verified_lines,
                "audit log did not verify: moved aside, a new segment starts"
            );
            log.append(&AuditEvent::SegmentStart(s))?;
            sync_dir(path).map_err(io)?;
        }
        Ok(log)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The last line written: its seq and entry hash (seq 0 and [`GENESIS`] before any).
    pub fn head(&self) -> (u64, String) {
        let tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        (tail.seq, tail.last_hash.clone())
    }

    /// [`AuditLog::head`] once every line up to it is on disk (an fsync when one is due): what a
    /// checkpoint may sign. Fails when that line's fsync failed.
    pub fn durable_head(&self) -> Result<(u64, String), AuditError> {
        let (seq, hash, end) = {
            let tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
            (tail.seq, tail.last_hash.clone(), tail.len)
        };
        self.commit(Written {
            seq,
            end,
            hash: hash.clone(),
            ts: String::new(),
        })?;
        Ok((seq, hash))
    }

    /// The segment this log replaced at open, when the previous one did not verify.
    pub fn recovered(&self) -> Option<&SegmentStart> {
        self.recovered.as_ref()
    }

    /// Runs started in the log as opened that have no end line, in start order. The caller
    /// records their end once (this list does not shrink when it does).
    pub fn interrupted(&self) -> &[Interrupted] {
        &self.interrupted
    }

    /// How many refusals of each class get a line of their own (default: [`RefusalRate::default`]).
    pub fn with_refusal_rate(self, rate: RefusalRate) -> AuditLog {
        *self.refusals.lock().unwrap_or_else(|p| p.into_inner()) = RefusalBudget::new(rate);
        self
    }

    /// Whether a refusal with HTTP `status` is to be appended as its own line; `authenticated`
    /// says whether the caller's service token was verified (its refusals draw from their own
    /// bucket). When it is not, it has been counted, and the count is written as a
    /// `refusals_suppressed` line at the next [`AuditLog::flush_suppressed`].
    pub fn admit_refusal(&self, status: u16, authenticated: bool) -> bool {
        let at = now_rfc3339();
        self.refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(status, authenticated, Instant::now(), &at)
    }

    /// The counts of suppressed refusals not yet written (for a log line when they cannot be).
    pub fn suppressed_pending(&self) -> Option<RefusalsSuppressed> {
        self.refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending()
            .cloned()
    }

    /// Writes the counts of suppressed refusals, if any, as one fsync'd line; returns its seq.
    /// The daemon calls it every few seconds and at shutdown: at most one such line per call, so
    /// a flood adds no more lines than the rate allows plus one per interval.
    pub fn flush_suppressed(&self) -> Result<Option<u64>, AuditError> {
        let mut tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.write_suppressed(&mut tail);
        drop(tail);
        let r = match r {
            // Not durable but in the file: the counts are not restored, or they would be
            // written twice.
            Ok(Some(w)) => self.commit(w).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        // Writing nothing proves nothing about the log: a failed append stays noted (/readyz
        // keeps probing) until a line is written.
        if !matches!(r, Ok(None)) {
            self.note(&r);
        }
        r
    }

    /// Appends one event; returns its sequence number. Every event but `execution_start` is
    /// durable when this returns Ok (an execution's end line covers its start line): appends
    /// that arrive together share one `fdatasync` (group commit). A failed append leaves no part
    /// of its line behind.
    pub fn append(&self, event: &AuditEvent) -> Result<u64, AuditError> {
        self.append_entry(event).map(|e| e.seq)
    }

    /// As [`AuditLog::append`], with the line's `entry_hash` and `ts` beside its seq. Every
    /// append goes through here, under its `audit.append` span.
    #[tracing::instrument(name = "audit.append", skip_all, fields(event = event.name()))]
    pub fn append_entry(&self, event: &AuditEvent) -> Result<Entry, AuditError> {
        let sync = !matches!(event, AuditEvent::ExecutionStart(_));
        let mut tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.append_locked(&mut tail, event);
        drop(tail);
        let r = match r {
            Ok(w) if sync => {
                let (hash, ts) = (w.hash.clone(), w.ts.clone());
                self.commit(w).map(|seq| Entry {
                    seq,
                    entry_hash: hash,
                    ts,
                })
            }
            Ok(w) => Ok(Entry {
                seq: w.seq,
                entry_hash: w.hash,
                ts: w.ts,
            }),
            Err(e) => Err(e),
        };
        self.note(&r);
        r
    }

    /// Returns once the line `w` is on disk: at once when an `fdatasync` that started after it
    /// was written has completed, else after one of its own, which covers every line written so
    /// far. A line an `fdatasync` failed for is never reported durable (see [`Synced::failed`]);
    /// it stays in the file, chained as written.
    fn commit(&self, w: Written) -> Result<u64, AuditError> {
        let mut synced = self.synced.lock().unwrap_or_else(|p| p.into_inner());
        if synced
            .failed
            .iter()
            .any(|&(start, end)| start < w.end && w.end <= end)
        {
            return Err(AuditError::Io {
                path: self.path.clone(),
                source: std::io::Error::other("the log could not be synced to disk"),
            });
        }
        if synced.len >= w.end {
            return Ok(w.seq);
        }
        let len = self.tail.lock().unwrap_or_else(|p| p.into_inner()).len;
        match self.sync_file.sync_data() {
            Ok(()) => {
                synced.len = len;
                Ok(w.seq)
            }
            Err(e) => {
                let start = synced.len;
                match synced.failed.back_mut() {
                    Some(last) if last.0 == start => last.1 = len,
                    _ => {
                        if synced.failed.len() == FAILED_SYNCS {
                            synced.failed.pop_front();
                        }
                        synced.failed.push_back((start, len));
                    }
                }
                Err(AuditError::Io {
                    path: self.path.clone(),
                    source: e,
                })
            }
        }
    }

    /// Remembers whether the last append failed and why (for /readyz).
    fn note<T>(&self, r: &Result<T, AuditError>) {
        *self.failing.lock().unwrap_or_else(|p| p.into_inner()) =
            r.as_ref().err().map(AuditError::cause);
    }

    /// Writes the pending `refusals_suppressed` line, if any; if it cannot be written the counts
    /// stay pending.
    fn write_suppressed(&self, tail: &mut Tail) -> Result<Option<Written>, AuditError> {
        let pending = self
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_pending();
        let Some(counts) = pending else {
            return Ok(None);
        };
        match self.append_locked(tail, &AuditEvent::RefusalsSuppressed(counts.clone())) {
            Ok(w) => Ok(Some(w)),
            Err(e) => {
                self.refusals
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .restore_pending(counts);
                Err(e)
            }
        }
    }

    /// Writes one line (not yet synced: see [`AuditLog::commit`]).
    fn append_locked(&self, tail: &mut Tail, event: &AuditEvent) -> Result<Written, AuditError> {
        let io = |source| AuditError::Io {
            path: self.path.clone(),
            source,
        };
        if tail.torn {
            tail.file.set_len(tail.len).map_err(io)?;
            tail.torn = false;
        }
        let seq = tail.seq + 1;
        let ts = now_rfc3339();
        let (line, hash) =
            encode(event, seq, &tail.last_hash, &ts, &self.instance).map_err(|message| {
                AuditError::Encode {
                    path: self.path.clone(),
                    event: event.name(),
                    message,
                }
            })?;
        if let Err(e) = tail.file.write_all(&line) {
            // A short write (a full disk) may have left part of the line: cut it off now, which
            // frees its space, or before the next append.
            tail.torn = tail.file.set_len(tail.len).is_err();
            return Err(io(e));
        }
        tail.len += line.len() as u64;
        tail.seq = seq;
        tail.last_hash = hash.clone();
        tracing::info!(target: "audit", "{}", String::from_utf8_lossy(&line).trim_end());
        Ok(Written {
            seq,
            end: tail.len,
            hash,
            ts,
        })
    }

    /// Ok while appends succeed. After a failed one, probes for room (a few KiB written and
    /// synced beside the log), so the daemon turns ready again by itself once space is freed.
    pub fn check_writable(&self) -> Result<(), String> {
        let failing = self
            .failing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(why) = failing else {
            return Ok(());
        };
        match self.probe() {
            Ok(()) => {
                *self.failing.lock().unwrap_or_else(|p| p.into_inner()) = None;
                Ok(())
            }
            Err(e) => Err(format!("{why} (probe: {e})")),
        }
    }

    fn probe(&self) -> std::io::Result<()> {
        {
            let mut tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
            if tail.torn {
                tail.file.set_len(tail.len)?;
                tail.torn = false;
            }
        }
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let probe = self.path.with_file_name(format!(".{name}.probe"));
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&probe)
            .and_then(|mut f| {
                f.write_all(&[0u8; 16 << 10])?;
                f.sync_data()
            });
        let _ = std::fs::remove_file(&probe);
        written
    }
}

/// The line for `event` (newline included) and its entry hash.
fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn encode(
    event: &AuditEvent,
    seq: u64,
    prev_hash: &str,
    ts: &str,
    instance: &str,
) -> Result<(Vec<u8>, String), String> {
    let Value::Object(mut m) = serde_json::to_value(event).map_err(|e| e.to_string())? else {
        return Err("not a JSON object".into());
    };
    m.insert("seq".into(), Value::from(seq));
    m.insert("prev_hash".into(), Value::from(prev_hash));
    m.insert("ts".into(), Value::from(ts));
    m.insert("instance".into(), Value::from(instance));
    let mut line = canonical_json(&Value::Object(m)).into_bytes();
    let hash = sha256_prefixed(&line);
    if line.pop() != Some(b'}') {
        return Err("canonical JSON does not end with '}'".into());
    }
    line.extend_from_slice(format!(",\"entry_hash\":\"{hash}\"}}\n").as_bytes());
    Ok((line, hash))
}

/// Moves a log that did not verify aside (never deleting it) and describes it.
fn move_aside(
    path: &Path,
    good: &Verified,
    error: &AuditError,
) -> Result<SegmentStart, AuditError> {
    let io = |source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    };
    let previous_sha256 = file_sha256(path).map_err(io)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "audit.jsonl".into());
    let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%S%.3fZ");
    let mut n = 0u32;
    let target = loop {
        let suffix = if n == 0 {
            String::new()
        } else {
            format!("-{n}")
        };
        let t = path.with_file_name(format!("{name}.{stamp}{suffix}.broken"));
        if !t.exists() {
            break t;
        }
        n += 1;
    };
    std::fs::rename(path, &target).map_err(io)?;
    Ok(SegmentStart {
        previous_file: target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        previous_state: "broken",
        previous_error: error.to_string(),
        previous_verified_lines: good.lines,
        previous_last_seq: good.last_seq,
        previous_last_hash: good.last_hash.clone(),
        previous_sha256,
    })
}

fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// fsyncs the directory of `path`, so a rename or a new file in it survives a crash.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(d) => d,
        None => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Verifies the chain of `path`.
pub fn verify(path: &Path) -> Result<Verified, AuditError> {
    verify_observing(path, &mut |_, _| {})
}

/// Verifies the chain of `path`, handing each line's seq and entry hash to `observe` as it goes
/// (a line is handed over only once it verified).
pub fn verify_observing(
    path: &Path,
    observe: &mut dyn FnMut(u64, &str),
) -> Result<Verified, AuditError> {
    let f = File::open(path).map_err(|source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match walk(path, f, observe)? {
        Walk::Intact(v, _) => Ok(v),
        Walk::Broken { error, .. } => Err(error),
    }
}

enum Walk {
    Intact(Verified, OpenRuns),
    /// `good`: the chain up to the line before the first bad one; `open`: runs open there.
    Broken {
        good: Verified,
        error: AuditError,
        open: OpenRuns,
    },
}

/// The `execution_start` lines seen so far without an end line (a handful at any point of a log:
/// the runs in flight when the line was written).
#[derive(Default)]
struct OpenRuns {
    by_exec_id: HashMap<String, u64>,
    /// Start lines by seq.
    lines: BTreeMap<u64, String>,
}

/// A start line read back: the run and the instance that wrote it.
#[derive(Deserialize)]
struct StartLine {
    #[serde(flatten)]
    run: Run,
    #[serde(default)]
    instance: String,
}

impl OpenRuns {
    fn observe(&mut self, link: &Link, line: &[u8]) {
        let Some(exec_id) = &link.exec_id else {
            return;
        };
        match link.event.as_str() {
            "execution_start" => {
                if let Some(earlier) = self.by_exec_id.insert(exec_id.clone(), link.seq) {
                    self.lines.remove(&earlier);
                }
                self.lines
                    .insert(link.seq, String::from_utf8_lossy(line).into_owned());
            }
            "execution" | "execution_error" => {
                if let Some(seq) = self.by_exec_id.remove(exec_id) {
                    self.lines.remove(&seq);
                }
            }
            _ => {}
        }
    }

    fn into_interrupted(self) -> Vec<Interrupted> {
        self.lines
            .into_iter()
            .filter_map(|(seq, line)| {
                // The line verified as JSON with an exec_id, so it parses.
                let s: StartLine = serde_json::from_str(&line).ok()?;
                Some(Interrupted {
                    run: s.run,
                    instance: s.instance,
                    seq,
                })
            })
            .collect()
    }
}

/// The fields of a line `verify` reads. `entry_hash` is read too so that a second one inside the
/// hashed bytes is a duplicate key, not a second opinion.
#[derive(Deserialize)]
struct Head {
    seq: u64,
    prev_hash: String,
    #[allow(dead_code)]
    entry_hash: String,
    event: String,
    #[serde(default)]
    exec_id: Option<String>,
    #[serde(default)]
    previous_last_seq: Option<u64>,
    #[serde(default)]
    previous_last_hash: Option<String>,
}

fn walk(path: &Path, f: File, observe: &mut dyn FnMut(u64, &str)) -> Result<Walk, AuditError> {
    let mut reader = BufReader::new(f);
    let mut good = Verified::empty();
    let mut open = OpenRuns::default();
    let mut current_format_seen = false;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|source| AuditError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        if n == 0 {
            return Ok(Walk::Intact(good, open));
        }
        let line = good.lines + 1;
        let checked = if buf.pop() != Some(b'\n') {
            Err("torn line: no newline at the end of the file (a write was cut short)".into())
        } else {
            check_line(&buf, &good, &mut current_format_seen)
        };
        match checked {
            Ok(link) => {
                open.observe(&link, &buf);
                observe(link.seq, &link.hash);
                good.lines = line;
                good.last_seq = link.seq;
                good.last_hash = link.hash;
                if link.continues.is_some() {
                    good.continues = link.continues;
                }
            }
            Err(message) => {
                return Ok(Walk::Broken {
                    good,
                    error: AuditError::Broken {
                        path: path.to_path_buf(),
                        line,
                        message,
                    },
                    open,
                });
            }
        }
    }
}

/// A line that verified: its seq, its hash, its event and exec_id (lines of the previous format:
/// empty, none) and, for a segment start, the previous segment's last seq and hash.
struct Link {
    seq: u64,
    hash: String,
    event: String,
    exec_id: Option<String>,
    continues: Option<(u64, String)>,
}

/// Checks one line (without its newline) against the chain so far.
fn check_line(
    bytes: &[u8],
    chain: &Verified,
    current_format_seen: &mut bool,
) -> Result<Link, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
    let Some((hashed, stated)) = split_entry_hash(text) else {
        if *current_format_seen {
            return Err("not a line of this format (entry_hash is not at its end)".into());
        }
        return check_legacy_line(text, chain);
    };
    *current_format_seen = true;
    let head: Head = serde_json::from_str(text)
        .map_err(|e| format!("not a JSON object with seq, prev_hash and event: {e}"))?;
    let continues = match (chain.lines, head.event.as_str()) {
        (0, "segment_start") => Some((
            head.previous_last_seq
                .ok_or("segment_start without previous_last_seq")?,
            head.previous_last_hash
                .clone()
                .ok_or("segment_start without previous_last_hash")?,
        )),
        _ => None,
    };
    let (last_seq, last_hash) = match &continues {
        Some((seq, hash)) => (*seq, hash.as_str()),
        None => (chain.last_seq, chain.last_hash.as_str()),
    };
    check_links(head.seq, &head.prev_hash, last_seq, last_hash)?;
    let mut h = Sha256::new();
    h.update(hashed.as_bytes());
    h.update(b"}");
    if format!("sha256:{}", hex::encode(h.finalize())) != stated {
        return Err("entry_hash does not match the line's bytes (edited)".into());
    }
    Ok(Link {
        seq: head.seq,
        hash: stated,
        event: head.event,
        exec_id: head.exec_id,
        continues,
    })
}

fn check_links(seq: u64, prev_hash: &str, last_seq: u64, last_hash: &str) -> Result<(), String> {
    if seq != last_seq + 1 {
        return Err(format!(
            "sequence number is not {} (a line was dropped, inserted or moved)",
            last_seq + 1
        ));
    }
    if prev_hash != last_hash {
        return Err("prev_hash does not match the previous line".into());
    }
    Ok(())
}

/// Splits a line of this format into the hashed bytes without their closing brace, and the stated
/// hash; None when the line does not end with `,"entry_hash":"sha256:<64 hex>"}`.
fn split_entry_hash(text: &str) -> Option<(&str, String)> {
    let cut = text.len().checked_sub(ENTRY_HASH_SUFFIX_LEN)?;
    let (hashed, suffix) = (text.get(..cut)?, text.get(cut..)?);
    let hex = suffix.strip_prefix(ENTRY_HASH_KEY)?.strip_suffix("\"}")?;
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then(|| (hashed, format!("sha256:{hex}")))
}

/// The previous format: `entry_hash` among the sorted keys, hashed over the canonical JSON of the
/// parsed line without it.
fn check_legacy_line(text: &str, chain: &Verified) -> Result<Link, String> {
    let mut entry: Map<String, Value> = match serde_json::from_str(text) {
        Ok(Value::Object(m)) => m,
        _ => return Err("not a JSON object".into()),
    };
    let Some(Value::String(stated)) = entry.remove("entry_hash") else {
        return Err("missing entry_hash".into());
    };
    let seq = entry.get("seq").and_then(Value::as_u64).unwrap_or(0);
    let prev = entry.get("prev_hash").and_then(Value::as_str).unwrap_or("");
    check_links(seq, prev, chain.last_seq, &chain.last_hash)?;
    if sha256_prefixed(canonical_json(&Value::Object(entry)).as_bytes()) != stated {
        return Err("entry_hash does not match the line's content (edited)".into());
    }
    Ok(Link {
        seq,
        hash: stated,
        event: String::new(),
        exec_id: None,
        continues: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(exec_id: &str) -> Run {
        Run {
            request_id: "req-1".into(),
            exec_id: exec_id.into(),
            subject: Some("orchestrator".into()),
            owner: Some("orchestrator".into()),
            token_id: None,
            action_type: "shell".into(),
            command: "echo".into(),
            args: vec!["hi".into()],
            command_hash: "sha256:c".into(),
            invocation_hash: "sha256:i".into(),
            backend: "local".into(),
            profile: "shell-readonly".into(),
            timeout_seconds: 30,
            idempotency_key: None,
            via: None,
        }
    }

    fn end(metadata: Option<Map<String, Value>>) -> Box<RunEnd> {
        Box::new(RunEnd {
            capabilities_used: vec!["ShellExecute"],
            outcome: "success",
            exit_code: 0,
            duration_ms: 3,
            killed_reason: None,
            oom: false,
            peak_memory_kib: Some(100),
            stdout_sha256: "sha256:o".into(),
            stderr_sha256: "sha256:e".into(),
            stdout_truncated: false,
            stderr_truncated: false,
            executor_def_sha256: None,
            error_code: None,
            network: None,
            metadata,
            container_id: None,
            container_uses: None,
        })
    }

    fn execution(i: u64) -> AuditEvent {
        let mut md = Map::new();
        md.insert("n".into(), Value::from(i));
        AuditEvent::Execution {
            run: run(&format!("exec-{i}")),
            end: end(Some(md)),
        }
    }

    fn lines(p: &Path) -> Vec<String> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    }

    fn broken_line(p: &Path) -> u64 {
        match verify(p) {
            Err(AuditError::Broken { line, .. }) => line,
            other => panic!("expected a broken chain, got {other:?}"),
        }
    }

    #[test]
    fn chain_detects_edit_drop_insert_reorder() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "i-1").unwrap();
        for i in 0..4 {
            assert_eq!(log.append(&execution(i)).unwrap(), i + 1);
        }
        drop(log);
        assert_eq!(verify(&p).unwrap().lines, 4);
        // Reopening continues the chain.
        AuditLog::open(&p, "i-1")
            .unwrap()
            .append(&execution(9))
            .unwrap();
        let v = verify(&p).unwrap();
        assert_eq!((v.lines, v.last_seq, v.continues), (5, 5, None));

        let lines = lines(&p);
        let check = |ls: Vec<String>, bad_line: u64| {
            let q = dir.path().join("b.jsonl");
            std::fs::write(&q, ls.join("\n") + "\n").unwrap();
            assert_eq!(broken_line(&q), bad_line, "{ls:#?}");
        };
        let mut edited = lines.clone();
        edited[1] = edited[1].replace("\"n\":1", "\"n\":7");
        assert_ne!(edited[1], lines[1]);
        check(edited, 2);
        // Whitespace is an edit too: the bytes are hashed, not their meaning.
        let mut spaced = lines.clone();
        spaced[1] = spaced[1].replacen("\"n\":1", "\"n\": 1", 1);
        check(spaced, 2);
        let mut dropped = lines.clone();
        dropped.remove(2);
        check(dropped, 3);
        let mut reordered = lines.clone();
        reordered.swap(1, 2);
        check(reordered, 2);
        let mut inserted = lines.clone();
        inserted.insert(1, lines[0].clone());
        check(inserted, 2);
        // A second entry_hash inside the hashed bytes is refused, not trusted.
        let mut doubled = lines.clone();
        doubled[0] = doubled[0].replacen('{', "{\"entry_hash\":\"x\",", 1);
        check(doubled, 1);
        // A torn last line (no newline: the write was cut short) is broken.
        let q = dir.path().join("torn.jsonl");
        std::fs::write(&q, lines.join("\n")).unwrap();
        assert_eq!(broken_line(&q), 5);
    }

    #[test]
    fn lines_are_sorted_json_with_the_entry_hash_last() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "host-7").unwrap();
        log.append(&AuditEvent::ExecutionStart(run("exec-1")))
            .unwrap();
        let line = &lines(&p)[0];
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["event"], "execution_start");
        assert_eq!(v["instance"], "host-7");
        assert_eq!(v["seq"], 1);
        assert_eq!(v["prev_hash"], GENESIS);
        assert_eq!(v["exec_id"], "exec-1");
        assert!(v["ts"].as_str().is_some_and(|t| t.ends_with('Z')));
        let cut = line.find(",\"entry_hash\"").unwrap();
        let hashed = format!("{}}}", &line[..cut]);
        assert_eq!(v["entry_hash"], sha256_prefixed(hashed.as_bytes()));
        // The hashed part is the canonical (sorted) form of itself.
        let reparsed: Value = serde_json::from_str(&hashed).unwrap();
        assert_eq!(canonical_json(&reparsed), hashed);
    }

    /// Values a caller controls (metadata, args) are written as serde_json prints them; the chain
    /// must verify whatever they are, including values that do not survive a parse/print round trip.
    #[test]
    fn every_caller_value_verifies_after_it_is_written() {
        let deep_text = format!("{}1{}", "[".repeat(120), "]".repeat(120));
        let cases: Vec<(&str, Value)> = [
            (
                "float that changes on a round trip",
                "1.0715660391465826e-75",
            ),
            ("short float", "0.1"),
            ("smallest subnormal", "5e-324"),
            ("largest float", "1.7976931348623157e308"),
            ("negative zero", "-0.0"),
            ("u64 max + 1", "18446744073709551616"),
            (
                "integer past any fixed width",
                "123456789012345678901234567890",
            ),
            ("i64 min - 1", "-9223372036854775809"),
            ("exponent without fraction", "1E+2"),
            (
                "escapes and non-ASCII",
                r#""\u00e9\ud83d\ude00\u2028\u2029\u0000\u001f\u007f\"\\/\n\t""#,
            ),
            ("duplicate keys (the last wins)", r#"{"a": 1, "a": 2}"#),
            ("deep nesting", &deep_text),
        ]
        .into_iter()
        .map(|(name, text)| (name, serde_json::from_str(text).unwrap()))
        .collect();
        // Deeper than serde_json parses: built directly, as a future event field could be.
        let mut deeper = Value::from(1);
        for _ in 0..1000 {
            deeper = Value::Array(vec![deeper]);
        }
        let cases = cases
            .into_iter()
            .chain([("nesting past the parser's limit", deeper)]);
        // A lone surrogate never becomes a value: the request is refused before anything is written.
        assert!(serde_json::from_str::<Value>(r#""\ud800""#).is_err());

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "i-1").unwrap();
        for (i, (name, v)) in cases.enumerate() {
            let mut md = Map::new();
            md.insert("v".into(), v.clone());
            let mut r = run("exec-x");
            r.args = vec![v.to_string()];
            log.append(&AuditEvent::Execution {
                run: r,
                end: end(Some(md)),
            })
            .unwrap();
            let checked = verify(&p);
            assert!(
                checked.as_ref().is_ok_and(|c| c.lines == i as u64 + 1),
                "{name}: {checked:?}"
            );
        }
        // And the log still opens (the daemon restarts).
        drop(log);
        assert!(AuditLog::open(&p, "i-1").unwrap().recovered().is_none());
    }

    /// A line as the previous format wrote it: entry_hash among the sorted keys, over the canonical
    /// JSON of the entry without it.
    fn legacy_line(seq: u64, prev: &str, extra: (&str, Value)) -> (String, String) {
        let mut m = Map::new();
        m.insert("event".into(), Value::from("execution"));
        m.insert("seq".into(), Value::from(seq));
        m.insert("prev_hash".into(), Value::from(prev));
        m.insert(extra.0.into(), extra.1);
        let hash = sha256_prefixed(canonical_json(&Value::Object(m.clone())).as_bytes());
        m.insert("entry_hash".into(), Value::from(hash.clone()));
        (canonical_json(&Value::Object(m)), hash)
    }

    #[test]
    fn lines_of_the_previous_format_still_verify_and_the_chain_continues_after_them() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let (l1, h1) = legacy_line(1, GENESIS, ("exit_code", Value::from(0)));
        let (l2, h2) = legacy_line(2, &h1, ("exit_code", Value::from(1)));
        std::fs::write(&p, format!("{l1}\n{l2}\n")).unwrap();
        let v = verify(&p).unwrap();
        assert_eq!(
            (v.lines, v.last_seq, v.last_hash.as_str()),
            (2, 2, h2.as_str())
        );

        let log = AuditLog::open(&p, "i-1").unwrap();
        assert!(log.recovered().is_none());
        assert_eq!(log.append(&execution(3)).unwrap(), 3);
        drop(log);
        assert_eq!(verify(&p).unwrap().lines, 3);

        // The old rule still catches an edit of an old line.
        let ls = lines(&p);
        let mut edited = ls.clone();
        edited[1] = edited[1].replace("\"exit_code\":1", "\"exit_code\":0");
        let q = dir.path().join("b.jsonl");
        std::fs::write(&q, edited.join("\n") + "\n").unwrap();
        assert_eq!(broken_line(&q), 2);
        // After a line of this format, the old rule is no longer accepted.
        let last: Value = serde_json::from_str(&ls[2]).unwrap();
        let (l4, _) = legacy_line(4, last["entry_hash"].as_str().unwrap(), ("x", Value::Null));
        std::fs::write(&q, format!("{}\n{l4}\n", ls.join("\n"))).unwrap();
        assert_eq!(broken_line(&q), 4);
    }

    #[test]
    fn a_log_that_does_not_verify_is_moved_aside_and_a_new_segment_chains_from_its_last_good_line()
    {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&p, "i-1").unwrap();
        for i in 0..3 {
            log.append(&execution(i)).unwrap();
        }
        drop(log);
        let good = lines(&p);
        let cases: Vec<(&str, Vec<u8>, u64)> = vec![
            (
                "edited",
                (good
                    .iter()
                    .enumerate()
                    .map(|(i, l)| {
                        if i == 1 {
                            l.replace("\"n\":1", "\"n\":2")
                        } else {
                            l.clone()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
                    + "\n")
                    .into_bytes(),
                1,
            ),
            (
                "torn",
                format!("{}\n{}", good.join("\n"), &good[0][..20]).into_bytes(),
                3,
            ),
            ("garbage", b"\xff\xfe\x00garbage\n".to_vec(), 0),
        ];
        for (case, bytes, verified) in cases {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("audit.jsonl");
            std::fs::write(&p, &bytes).unwrap();
            let log = AuditLog::open(&p, "i-2").unwrap();
            let s = log.recovered().expect("recovered").clone();
            assert_eq!(s.previous_state, "broken", "{case}");
            assert!(
                s.previous_error.contains(&format!("line {}", verified + 1)),
                "{case}: {s:?}"
            );
            assert_eq!(s.previous_verified_lines, verified, "{case}");
            assert_eq!(s.previous_last_seq, verified, "{case}");
            let last_good = match verified {
                0 => GENESIS.to_string(),
                n => serde_json::from_str::<Value>(&good[n as usize - 1]).unwrap()["entry_hash"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            };
            assert_eq!(s.previous_last_hash, last_good, "{case}");
            assert_eq!(s.previous_sha256, sha256_prefixed(&bytes), "{case}");
            let moved = dir.path().join(&s.previous_file);
            assert!(
                s.previous_file.starts_with("audit.jsonl.") && s.previous_file.ends_with(".broken"),
                "{case}: {}",
                s.previous_file
            );
            assert_eq!(
                std::fs::read(&moved).unwrap(),
                bytes,
                "{case}: kept as it was"
            );

            assert_eq!(log.append(&execution(7)).unwrap(), verified + 2, "{case}");
            drop(log);
            let v = verify(&p).unwrap();
            assert_eq!(v.lines, 2, "{case}");
            assert_eq!(v.continues, Some((verified, last_good.clone())), "{case}");
            let first: Value = serde_json::from_str(&lines(&p)[0]).unwrap();
            assert_eq!(first["event"], "segment_start", "{case}");
            assert_eq!(first["prev_hash"], Value::from(last_good), "{case}");
            // Reopening the new segment continues it; the old file is left alone.
            let log = AuditLog::open(&p, "i-2").unwrap();
            assert!(log.recovered().is_none(), "{case}");
            drop(log);
            assert_eq!(std::fs::read(&moved).unwrap(), bytes, "{case}");
            // A segment start is accepted only as a first line.
            let ls = lines(&p);
            let q = dir.path().join("other.jsonl");
            std::fs::write(&q, format!("{}\n{}\n", ls[1], ls[0])).unwrap();
            assert_eq!(broken_line(&q), 1, "{case}");
        }
    }

    #[test]
    fn an_execution_start_is_written_but_not_synced_on_its_own() {
        // The one fsync per request is the end line's; both lines are in the file either way.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "i-1").unwrap();
        log.append(&AuditEvent::ExecutionStart(run("exec-1")))
            .unwrap();
        log.append(&AuditEvent::ExecutionError {
            run: run("exec-1"),
            error_type: "InternalError",
            error: "boom".into(),
        })
        .unwrap();
        let ls = lines(&p);
        let end: Value = serde_json::from_str(&ls[1]).unwrap();
        assert_eq!(end["event"], "execution_error");
        assert_eq!(end["exec_id"], "exec-1");
        assert_eq!(end["error_type"], "InternalError");
        assert_eq!(end["args"], serde_json::json!(["hi"]));
        assert!(log.check_writable().is_ok());
    }

    fn start(exec_id: &str) -> AuditEvent {
        AuditEvent::ExecutionStart(run(exec_id))
    }

    fn error_end(exec_id: &str) -> AuditEvent {
        AuditEvent::ExecutionError {
            run: run(exec_id),
            error_type: "InternalError",
            error: "x".into(),
        }
    }

    /// Runs whose start line has no end line are handed over at open, in start order, read back
    /// whole; ended runs, refusals and lines of other events are not.
    #[test]
    fn runs_started_without_an_end_line_are_found_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "host-1").unwrap();
        assert!(log.interrupted().is_empty());
        let mut keyed = run("exec-b");
        keyed.idempotency_key = Some("orchestrator:k1".into());
        keyed.args = vec!["a b".into(), "\u{0}".into()];
        for e in [
            start("exec-a"),
            AuditEvent::ExecutionStart(keyed.clone()),
            start("exec-c"),
            execution(0), // exec-0: an end line without a start changes nothing
            error_end("exec-a"),
            start("exec-d"),
        ] {
            log.append(&e).unwrap();
        }
        log.append(&AuditEvent::Execution {
            run: run("exec-d"),
            end: end(None),
        })
        .unwrap();
        drop(log);

        let log = AuditLog::open(&p, "host-2").unwrap();
        let got: Vec<_> = log
            .interrupted()
            .iter()
            .map(|i| (i.run.exec_id.as_str(), i.instance.as_str(), i.seq))
            .collect();
        assert_eq!(got, [("exec-b", "host-1", 2), ("exec-c", "host-1", 3)]);
        let b = &log.interrupted()[0].run;
        assert_eq!(b.idempotency_key.as_deref(), Some("orchestrator:k1"));
        assert_eq!(b.args, keyed.args);
        assert_eq!(
            serde_json::to_value(b).unwrap(),
            serde_json::to_value(&keyed).unwrap()
        );

        // Once their end lines are written, the next open finds none.
        for i in log.interrupted() {
            log.append(&AuditEvent::ExecutionError {
                run: i.run.clone(),
                error_type: "DaemonStopped",
                error: "stopped".into(),
            })
            .unwrap();
        }
        drop(log);
        assert!(
            AuditLog::open(&p, "host-3")
                .unwrap()
                .interrupted()
                .is_empty()
        );
        assert_eq!(verify(&p).unwrap().lines, 9);
    }

    /// A broken log's good part may hold runs that never ended: the new segment is told about them.
    #[test]
    fn runs_open_in_the_good_part_of_a_broken_log_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "host-1").unwrap();
        log.append(&start("exec-a")).unwrap();
        log.append(&start("exec-b")).unwrap();
        drop(log);
        // A torn line after them (a write cut short).
        let mut text = std::fs::read_to_string(&p).unwrap();
        text.push_str("{\"seq\":3,");
        std::fs::write(&p, text).unwrap();

        let log = AuditLog::open(&p, "host-2").unwrap();
        assert!(log.recovered().is_some());
        let ids: Vec<_> = log
            .interrupted()
            .iter()
            .map(|i| i.run.exec_id.as_str())
            .collect();
        assert_eq!(ids, ["exec-a", "exec-b"]);
    }

    fn refusal(status: u16) -> AuditEvent {
        AuditEvent::Refusal(Refusal {
            request_id: "req-r".into(),
            status,
            error_type: "Unauthorized",
            reason: "bad token".into(),
            subject: None,
            token_id: None,
            action_type: None,
            command: None,
            command_hash: None,
        })
    }

    #[test]
    fn suppressed_refusals_are_written_as_one_line_at_a_flush_and_the_chain_holds() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "i-1")
            .unwrap()
            .with_refusal_rate(RefusalRate {
                per_second: 0.0,
                burst: 2,
            });
        for _ in 0..6 {
            if log.admit_refusal(401, false) {
                log.append(&refusal(401)).unwrap();
            }
        }
        assert_eq!(lines(&p).len(), 2, "only the burst is written");
        assert_eq!(log.suppressed_pending().unwrap().count, 4);
        assert_eq!(
            log.append(&execution(1)).unwrap(),
            3,
            "other lines do not carry the counts"
        );
        assert_eq!(log.flush_suppressed().unwrap(), Some(4));
        assert_eq!(
            log.flush_suppressed().unwrap(),
            None,
            "nothing left to flush"
        );
        let parsed: Vec<Value> = lines(&p)
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(parsed[2]["event"], "execution");
        assert_eq!(parsed[3]["event"], "refusals_suppressed");
        assert_eq!(parsed[3]["count"], 4);
        assert_eq!(parsed[3]["by_status"], serde_json::json!({"401": 4}));
        assert!(log.admit_refusal(403, true) && log.admit_refusal(403, true));
        assert!(!log.admit_refusal(403, true));
        assert_eq!(log.flush_suppressed().unwrap(), Some(5));
        assert_eq!(verify(&p).unwrap().lines, 5);
    }

    #[test]
    fn a_flush_with_nothing_pending_does_not_clear_a_failed_append() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p, "i-1").unwrap();
        log.append(&execution(1)).unwrap();
        // Appends fail from now on: the log's descriptor no longer accepts writes.
        log.tail.lock().unwrap().file = File::open(&p).unwrap();
        assert!(log.append(&execution(2)).is_err());
        assert!(
            log.failing.lock().unwrap().is_some(),
            "the failure is noted"
        );
        // The daemon's flusher runs every few seconds whether or not anything was suppressed.
        assert_eq!(log.flush_suppressed().unwrap(), None);
        assert!(
            log.failing.lock().unwrap().is_some(),
            "a flush that wrote nothing proves nothing about the log: /readyz must keep probing"
        );
    }

    #[test]
    fn appends_from_many_threads_share_fsyncs_and_keep_one_chain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = std::sync::Arc::new(AuditLog::open(&path, "i-1").unwrap());
        let threads: Vec<_> = (0..16)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    (0..25)
                        .map(|i| log.append(&execution(t * 100 + i)).unwrap())
                        .collect::<Vec<u64>>()
                })
            })
            .collect();
        let mut seqs: Vec<u64> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=400).collect::<Vec<u64>>());
        let v = verify(&path).unwrap();
        assert_eq!((v.lines, v.last_seq), (400, 400));
        // Every acknowledged line is covered by a completed fsync.
        let synced = log.synced.lock().unwrap();
        assert_eq!(synced.len, std::fs::metadata(&path).unwrap().len());
        assert!(synced.failed.is_empty());
    }

    #[test]
    fn a_failed_fsync_fails_the_lines_it_covered_keeps_them_and_the_chain_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut log = AuditLog::open(&path, "i-1").unwrap();
        log.append(&execution(1)).unwrap();
        // fdatasync(2) of a pipe fails with EINVAL: the next commit's sync fails.
        let (r, _w) = nix::unistd::pipe().unwrap();
        let real = std::mem::replace(&mut log.sync_file, File::from(r));
        assert_eq!(log.append(&start("exec-2")).unwrap(), 2);
        let e = log.append(&execution(3)).unwrap_err();
        assert!(matches!(e, AuditError::Io { .. }), "{e}");
        assert!(
            log.failing.lock().unwrap().is_some(),
            "/readyz sees the failure"
        );
        // The lines stay, chained: an acknowledged start line is not dropped and no sequence number
        // is handed out twice.
        assert_eq!(verify(&path).unwrap().last_seq, 3);
        log.sync_file = real;
        // A later successful fsync does not make the failed line durable after the fact.
        assert_eq!(log.append(&execution(4)).unwrap(), 4);
        let failed_end = log.synced.lock().unwrap().failed[0].1;
        assert!(
            log.commit(Written {
                seq: 3,
                end: failed_end,
                hash: String::new(),
                ts: String::new(),
            })
            .is_err()
        );
        // A line made durable before the failure stays durable.
        assert!(
            log.commit(Written {
                seq: 1,
                end: 1,
                hash: String::new(),
                ts: String::new(),
            })
            .is_ok()
        );
        let v = verify(&path).unwrap();
        assert_eq!((v.lines, v.last_seq), (4, 4));
    }
}
