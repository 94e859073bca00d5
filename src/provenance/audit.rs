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

/// Why a session ended.
#[derive(Debug, Clone, Serialize)]
pub struct SessionClosed {
    pub session_id: String,
    pub owner: String,
    pub tenant: String,
    /// `deleted`, `expired` (its TTL), `idle`, `shutdown`.
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
            Ok(f) => Some(walk(path, f)?),
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
    #[tracing::instrument(name = "audit.append", skip_all, fields(event = event.name()))]
    pub fn append(&self, event: &AuditEvent) -> Result<u64, AuditError> {
        let sync = !matches!(event, AuditEvent::ExecutionStart(_));
        let mut tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.append_locked(&mut tail, event);
        drop(tail);
        let r = match r {
            Ok(w) if sync => self.commit(w),
            Ok(w) => Ok(w.seq),
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
        tail.last_hash = hash;
        tracing::info!(target: "audit", "{}", String::from_utf8_lossy(&line).trim_end());
        Ok(Written { seq, end: tail.len })
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
    let f = File::open(path).map_err(|source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match walk(path, f)? {
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

fn walk(path: &Path, f: File) -> Result<Walk, AuditError> {
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
mod tests;
