//! Signed audit checkpoints: the log's length and head hash at a moment, as a C2SP
//! `tlog-checkpoint` in a `signed-note`, so a log cut back below a checkpoint, or rewritten, is
//! caught by anyone holding the public key.
//!
//! The note text is three lines: the origin (`audit.checkpoint_origin`), the size and the head.
//! The size is the `seq` of the last line signed: the number of lines of the chain up to it, which
//! goes on across segments (a `segment_start` line continues the seq of the segment it replaces),
//! so a checkpoint stays true of the chain whichever file holds that line. The head is the base64
//! of the 32 bytes of that line's `entry_hash` (which the log writes as `sha256:<hex>`). It is not
//! an RFC 6962 Merkle root: a checkpoint here proves the chain's head, and the chain proves each
//! line before it. The signature line is `— <origin> base64(key hash ‖ Ed25519 signature)`, with
//! the key hash `SHA-256(origin ‖ 0x0A ‖ 0x01 ‖ public key)[:4]`.
//!
//! A checkpoint is written as `checkpoint-<size>` in its directory: a temp file, fsync'd, linked
//! into place (a link never replaces a file), the directory fsync'd. A kill at any point leaves
//! the checkpoints written before it whole; a stale temp file (a dot file) is removed at the next
//! start. A different checkpoint of the same size (the chain was cut and grew again) does not
//! replace the first: it is written as `checkpoint-<size>.<n>`, and both are checked.
//!
//! Owns: the note format, signing, writing and reading checkpoints, checking logs against them.
//! Must not: append to the audit log.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signature, Signer};
use sha2::{Digest, Sha256};

use super::audit::{self, AuditError, AuditLog, GENESIS, Verified};
use super::keys::{KeySet, SigningKey, VerifyingKey};

/// File names of checkpoints start with this.
pub const FILE_PREFIX: &str = "checkpoint-";

/// The signed-note signature type of Ed25519.
const ED25519: u8 = 0x01;
/// A checkpoint is well under 1 KiB.
const MAX_NOTE_BYTES: usize = 64 << 10;
/// signed-note: verifiers MUST accept at least 16.
const MAX_SIGNATURES: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("not a signed note: {0}")]
    Malformed(String),
    #[error("not a checkpoint: {0}")]
    Body(String),
    #[error("no signature by a known key (signed as {names:?})")]
    UnknownKey { names: Vec<String> },
    #[error("forged or altered: the signature of {name} (keyid {keyid}) does not verify")]
    BadSignature { name: String, keyid: String },
}

/// What a checkpoint says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub origin: String,
    /// The seq of the last line it covers (the chain's length up to it).
    pub size: u64,
    /// That line's entry hash, raw.
    pub head: [u8; 32],
}

impl Checkpoint {
    /// A checkpoint of the chain up to the line `size` whose entry hash is `entry_hash`
    /// (`sha256:<hex>`, as the log writes it).
    pub fn new(origin: &str, size: u64, entry_hash: &str) -> Result<Checkpoint, CheckpointError> {
        check_origin(origin).map_err(CheckpointError::Body)?;
        let head = entry_hash
            .strip_prefix("sha256:")
            .and_then(|h| hex::decode(h).ok())
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| {
                CheckpointError::Body(format!("{entry_hash:?} is not sha256:<64 hex digits>"))
            })?;
        Ok(Checkpoint {
            origin: origin.to_string(),
            size,
            head,
        })
    }

    /// The head as the log writes entry hashes: `sha256:<hex>`.
    pub fn entry_hash(&self) -> String {
        format!("sha256:{}", hex::encode(self.head))
    }

    /// The note text: origin, size, base64 head, each ending in a newline.
    pub fn text(&self) -> String {
        format!(
            "{}\n{}\n{}\n",
            self.origin,
            self.size,
            STANDARD.encode(self.head)
        )
    }

    /// The signed note, signed with `key` under the origin as key name.
    pub fn sign(&self, key: &SigningKey) -> String {
        sign_note(&self.text(), &self.origin, key)
    }
}

/// A signed note of `text` (which ends in a newline) with one Ed25519 signature by `key` under
/// `name`.
pub fn sign_note(text: &str, name: &str, key: &SigningKey) -> String {
    let sig = key.sign(text.as_bytes());
    let mut raw = key_hash(name, &key.verifying_key()).to_vec();
    raw.extend_from_slice(&sig.to_bytes());
    format!("{text}\n\u{2014} {name} {}\n", STANDARD.encode(raw))
}

/// signed-note key ID of an Ed25519 key: `SHA-256(name ‖ 0x0A ‖ 0x01 ‖ key)[:4]`.
pub fn key_hash(name: &str, key: &VerifyingKey) -> [u8; 4] {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update([b'\n', ED25519]);
    h.update(key.as_bytes());
    let d = h.finalize();
    [d[0], d[1], d[2], d[3]]
}

/// The signed-note verifier key: `<name>+<hex key ID>+base64(0x01 ‖ key)` (what Go's
/// `golang.org/x/mod/sumdb/note` and other tlog tools take).
pub fn verifier_key(name: &str, key: &VerifyingKey) -> String {
    let mut raw = vec![ED25519];
    raw.extend_from_slice(key.as_bytes());
    format!(
        "{name}+{}+{}",
        hex::encode(key_hash(name, key)),
        STANDARD.encode(raw)
    )
}

/// An origin (and key name): non-empty, no spaces, no `+`, no control characters.
pub fn check_origin(origin: &str) -> Result<(), String> {
    if origin.is_empty()
        || origin
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '+')
    {
        return Err(format!(
            "origin {:?} must be non-empty, without spaces, '+' or control characters",
            origin
        ));
    }
    Ok(())
}

/// Reads a signed checkpoint and checks its signatures against `keys` (see [`verify_note`]).
pub fn open(note: &[u8], keys: &KeySet) -> Result<Checkpoint, CheckpointError> {
    parse_text(verify_note(note, keys)?)
}

/// Checks a signed note's signatures against `keys` and returns its text: every signature by a
/// key of `keys` (its name and key hash match) must verify, and there must be one. Signatures by
/// other keys are ignored (signed-note).
pub fn verify_note<'a>(note: &'a [u8], keys: &KeySet) -> Result<&'a str, CheckpointError> {
    let (text, sigs) = split_note(note)?;
    let mut names = Vec::new();
    let mut verified = false;
    for (name, raw) in sigs {
        names.push(name.to_string());
        for (keyid, key) in keys.iter() {
            if raw[..4] != key_hash(name, key) {
                continue;
            }
            let ok = Signature::from_slice(&raw[4..])
                .is_ok_and(|s| key.verify_strict(text.as_bytes(), &s).is_ok());
            if !ok {
                return Err(CheckpointError::BadSignature {
                    name: name.to_string(),
                    keyid: keyid.to_string(),
                });
            }
            verified = true;
        }
    }
    if !verified {
        return Err(CheckpointError::UnknownKey { names });
    }
    Ok(text)
}

/// A signature line of a note: the key name and the raw bytes (key hash ‖ signature, ≥ 5 bytes).
type NoteSignature<'a> = (&'a str, Vec<u8>);

/// The note's text (with its final newline) and its signatures.
fn split_note(note: &[u8]) -> Result<(&str, Vec<NoteSignature<'_>>), CheckpointError> {
    let bad = |m: &str| CheckpointError::Malformed(m.to_string());
    if note.len() > MAX_NOTE_BYTES {
        return Err(bad("larger than 64 KiB"));
    }
    let note = std::str::from_utf8(note).map_err(|_| bad("not UTF-8"))?;
    if note.chars().any(|c| c.is_ascii_control() && c != '\n') {
        return Err(bad("holds a control character other than newline"));
    }
    if !note.ends_with('\n') {
        return Err(bad("does not end with a newline"));
    }
    // The text is separated from the signatures by the last empty line.
    let cut = note
        .rfind("\n\n")
        .ok_or_else(|| bad("no blank line before the signatures"))?;
    let (text, block) = (&note[..cut + 1], &note[cut + 2..]);
    if block.is_empty() {
        return Err(bad("no signature"));
    }
    let mut sigs = Vec::new();
    for line in block.split_terminator('\n') {
        if sigs.len() == MAX_SIGNATURES {
            return Err(bad("too many signatures"));
        }
        let rest = line
            .strip_prefix("\u{2014} ")
            .ok_or_else(|| bad("a signature line does not start with an em dash and a space"))?;
        let (name, b64) = rest
            .split_once(' ')
            .ok_or_else(|| bad("a signature line has no key name"))?;
        if check_origin(name).is_err() {
            return Err(bad("a key name is empty or holds a space or '+'"));
        }
        let raw = STANDARD
            .decode(b64)
            .map_err(|_| bad("a signature is not base64"))?;
        if raw.len() < 5 {
            return Err(bad("a signature is shorter than its key ID"));
        }
        sigs.push((name, raw));
    }
    Ok((text, sigs))
}

/// Origin, size and head of a checkpoint's text; extension lines are allowed (they are signed)
/// and ignored. The origin must be a valid key name (tlog-checkpoint only says SHOULD): it is the
/// name a checkpoint is signed under, so every checkpoint read can be signed again.
fn parse_text(text: &str) -> Result<Checkpoint, CheckpointError> {
    let bad = |m: String| CheckpointError::Body(m);
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    if lines.len() < 3 || lines.iter().any(|l| l.is_empty()) {
        return Err(bad(
            "the text must be at least three non-empty lines: origin, size, head".into(),
        ));
    }
    check_origin(lines[0]).map_err(bad)?;
    let size = lines[1];
    let ok_digits =
        size.bytes().all(|b| b.is_ascii_digit()) && (size == "0" || !size.starts_with('0'));
    let size: u64 = ok_digits
        .then(|| size.parse().ok())
        .flatten()
        .ok_or_else(|| {
            bad(format!(
                "size {size:?} is not a decimal number without leading zeros"
            ))
        })?;
    let head = STANDARD
        .decode(lines[2])
        .ok()
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .ok_or_else(|| bad("the head is not the base64 of 32 bytes".into()))?;
    Ok(Checkpoint {
        origin: lines[0].to_string(),
        size,
        head,
    })
}

/// Where checkpoints go when `audit.checkpoint_dir` is not set: `<audit log>.checkpoints`.
pub fn default_dir(audit_log: &Path) -> PathBuf {
    let mut name = audit_log
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_else(|| "audit".into());
    name.push(".checkpoints");
    audit_log.with_file_name(name)
}

/// Signs checkpoints of one audit log into a directory.
pub struct CheckpointWriter {
    dir: PathBuf,
    origin: String,
    key: SigningKey,
    /// The size last written, so an idle log is not signed again.
    last: Mutex<Option<u64>>,
}

impl std::fmt::Debug for CheckpointWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointWriter")
            .field("dir", &self.dir)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl CheckpointWriter {
    /// Creates `dir` (mode 0755: checkpoints are public) if needed and removes temp files a
    /// killed writer left there.
    pub fn new(dir: &Path, origin: &str, key: SigningKey) -> std::io::Result<CheckpointWriter> {
        check_origin(origin)
            .map_err(|m| std::io::Error::new(std::io::ErrorKind::InvalidInput, m))?;
        let with_path = |e: std::io::Error| {
            std::io::Error::new(
                e.kind(),
                format!("checkpoint directory {}: {e}", dir.display()),
            )
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(with_path)?;
        for entry in std::fs::read_dir(dir).map_err(with_path)? {
            let name = entry.map_err(with_path)?.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(&format!(".{FILE_PREFIX}")) && name.ends_with(".tmp") {
                let _ = std::fs::remove_file(dir.join(&*name));
            }
        }
        Ok(CheckpointWriter {
            dir: dir.to_path_buf(),
            origin: origin.to_string(),
            key,
            last: Mutex::new(None),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The size of the last checkpoint this writer wrote (or found already written).
    pub fn last_size(&self) -> Option<u64> {
        *self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Signs and writes a checkpoint of `lines` lines whose last has entry hash `head`. Nothing
    /// is written for an empty log or for the size written last; returns the file written.
    pub fn checkpoint(&self, lines: u64, head: &str) -> std::io::Result<Option<PathBuf>> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if lines == 0 || *last == Some(lines) {
            return Ok(None);
        }
        let cp = Checkpoint::new(&self.origin, lines, head)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let note = cp.sign(&self.key);
        let written = self.write(lines, note.as_bytes())?;
        *last = Some(lines);
        Ok(written)
    }

    /// A checkpoint of `log` as it is on disk (its lines fsync'd first).
    pub fn checkpoint_log(&self, log: &AuditLog) -> Result<Option<PathBuf>, AuditError> {
        let (seq, head) = log.durable_head()?;
        self.checkpoint(seq, &head)
            .map_err(|source| AuditError::Io {
                path: self.dir.clone(),
                source,
            })
    }

    /// Writes `note` as `checkpoint-<size>` (or `.1`, `.2`, … beside a different one of that size).
    fn write(&self, size: u64, note: &[u8]) -> std::io::Result<Option<PathBuf>> {
        let ctx = |p: &Path, e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("checkpoint {}: {e}", p.display()))
        };
        let tmp = self.dir.join(format!(
            ".{FILE_PREFIX}{size}.{}.{:016x}.tmp",
            std::process::id(),
            rand::random::<u64>()
        ));
        let made = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(note)?;
                f.sync_all()
            });
        if let Err(e) = made {
            let _ = std::fs::remove_file(&tmp);
            return Err(ctx(&tmp, e));
        }
        let mut n = 0u32;
        let result = loop {
            let name = match n {
                0 => format!("{FILE_PREFIX}{size}"),
                n => format!("{FILE_PREFIX}{size}.{n}"),
            };
            let target = self.dir.join(name);
            match std::fs::hard_link(&tmp, &target) {
                Ok(()) => break Ok(Some(target)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // The same checkpoint already there (a restart on an idle log): done.
                    if std::fs::read(&target).is_ok_and(|b| b == note) {
                        break Ok(None);
                    }
                    n += 1;
                }
                Err(e) => break Err(ctx(&target, e)),
            }
        };
        let _ = std::fs::remove_file(&tmp);
        let written = result?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| ctx(&self.dir, e))?;
        Ok(written)
    }
}

/// Signs a checkpoint of `log` whenever `every_lines` lines were added since the last one, or
/// `every` passed and any line was, and once more when `shutdown` is cancelled (then returns).
/// The log is looked at every second (or `every`, if shorter). A failure is logged at ERROR and
/// tried again at the next look.
pub fn spawn_checkpointer(
    log: Arc<AuditLog>,
    writer: Arc<CheckpointWriter>,
    every_lines: u64,
    every: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let tick = every
        .min(Duration::from_secs(1))
        .max(Duration::from_millis(10));
    tokio::spawn(async move {
        let mut since = Instant::now();
        loop {
            let stopping = tokio::select! {
                _ = tokio::time::sleep(tick) => false,
                _ = shutdown.cancelled() => true,
            };
            let (seq, _) = log.head();
            let signed = writer.last_size().unwrap_or(0);
            let due = seq != signed
                && (stopping
                    || seq.saturating_sub(signed) >= every_lines.max(1)
                    || since.elapsed() >= every);
            if due {
                let (l, w) = (log.clone(), writer.clone());
                match tokio::task::spawn_blocking(move || w.checkpoint_log(&l)).await {
                    Ok(Ok(_)) => since = Instant::now(),
                    Ok(Err(e)) => {
                        tracing::error!(target: "audit", error = %e, "audit checkpoint not written")
                    }
                    Err(e) => {
                        tracing::error!(target: "audit", error = %e, "audit checkpoint task failed")
                    }
                }
            }
            if stopping {
                return;
            }
        }
    })
}

/// A checkpoint file read back.
#[derive(Debug, Clone)]
pub struct CheckpointFile {
    pub path: PathBuf,
    pub checkpoint: Checkpoint,
}

/// What checking logs against a checkpoint directory found.
#[derive(Debug, Clone, Default)]
pub struct LogCheck {
    /// The chain of the last file.
    pub chain: Option<Verified>,
    /// The seq of the first line of the first file.
    pub first_seq: u64,
    /// Checkpoints whose head matched the log.
    pub matched: Vec<CheckpointFile>,
    /// Checkpoints of lines before the first file (verify with the earlier files to check them).
    pub earlier: Vec<CheckpointFile>,
    /// What is wrong, one sentence each, naming the file.
    pub problems: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum LogCheckError {
    #[error(transparent)]
    Audit(#[from] AuditError),
    #[error("checkpoint directory {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Reads every checkpoint in `dir` (files named `checkpoint-*`): the ones whose signature
/// verifies with `keys`, and a problem for each that does not (naming the file).
pub fn read_dir(
    dir: &Path,
    keys: &KeySet,
) -> Result<(Vec<CheckpointFile>, Vec<String>), LogCheckError> {
    let io = |source| LogCheckError::Dir {
        path: dir.to_path_buf(),
        source,
    };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let name = entry
            .map_err(io)?
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.starts_with(FILE_PREFIX) {
            names.push(name);
        }
    }
    names.sort();
    let (mut good, mut problems) = (Vec::new(), Vec::new());
    for name in names {
        let path = dir.join(&name);
        let mut bytes = Vec::new();
        let read = File::open(&path)
            .and_then(|f| f.take(MAX_NOTE_BYTES as u64 + 1).read_to_end(&mut bytes));
        match read
            .map_err(|e| e.to_string())
            .and_then(|_| open(&bytes, keys).map_err(|e| e.to_string()))
        {
            Ok(checkpoint) => good.push(CheckpointFile { path, checkpoint }),
            Err(e) => problems.push(format!("{name}: {e}")),
        }
    }
    good.sort_by_key(|c| c.checkpoint.size);
    Ok((good, problems))
}

/// Verifies the chain of `logs` (oldest first: each after the first must continue the one before
/// it, through its `segment_start` line) and checks it against every checkpoint in `dir`: each
/// must be signed by a key of `keys`, and the line of its size must be in the logs with its head
/// hash. A checkpoint past the end of the logs means lines were cut; one whose line differs means
/// the chain was rewritten. A broken chain is an error, as for [`audit::verify`].
pub fn check_logs(logs: &[PathBuf], dir: &Path, keys: &KeySet) -> Result<LogCheck, LogCheckError> {
    let (checkpoints, mut problems) = read_dir(dir, keys)?;
    if checkpoints.is_empty() && problems.is_empty() {
        problems.push(format!(
            "no checkpoint in {}: nothing to check the log's length against",
            dir.display()
        ));
    }
    let wanted: BTreeSet<u64> = checkpoints.iter().map(|c| c.checkpoint.size).collect();
    let mut hashes: BTreeMap<u64, String> = BTreeMap::new();
    let mut check = LogCheck::default();
    let mut prev: Option<(&Path, Verified)> = None;
    for (i, path) in logs.iter().enumerate() {
        let v = audit::verify_observing(path, &mut |seq, hash| {
            if wanted.contains(&seq) {
                hashes.insert(seq, hash.to_string());
            }
        })?;
        if let Some((seq, hash)) = &v.continues
            && wanted.contains(seq)
        {
            hashes.entry(*seq).or_insert_with(|| hash.clone());
        }
        if i == 0 {
            check.first_seq = match &v.continues {
                Some((seq, _)) => seq + 1,
                None => 1,
            };
        }
        if let Some((p, pv)) = &prev
            && v.continues.as_ref() != Some(&(pv.last_seq, pv.last_hash.clone()))
        {
            problems.push(format!(
                "{} does not continue {}: its first line is not a segment_start after seq {} \
                 (entry_hash {})",
                path.display(),
                p.display(),
                pv.last_seq,
                pv.last_hash
            ));
        }
        prev = Some((path, v));
    }
    let (last_seq, chain) = match prev {
        Some((_, v)) => (v.last_seq, Some(v)),
        None => (0, None),
    };
    let holds = |n: u64| {
        if check.first_seq <= 1 {
            format!("the log has {n}")
        } else {
            format!("the log ends at seq {n}")
        }
    };
    for c in checkpoints {
        let size = c.checkpoint.size;
        let name = c
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if size == 0 {
            if c.checkpoint.entry_hash() == GENESIS {
                check.matched.push(c);
            } else {
                problems.push(format!(
                    "{name}: signs 0 lines with a head that is not the genesis hash"
                ));
            }
        } else if size > last_seq {
            let range = if size == last_seq + 1 {
                format!("line {size} missing")
            } else {
                format!("lines {}-{size} missing", last_seq + 1)
            };
            problems.push(format!(
                "{range}: {name} signs {size} lines, {}",
                holds(last_seq)
            ));
        } else if let Some(h) = hashes.get(&size) {
            if *h == c.checkpoint.entry_hash() {
                check.matched.push(c);
            } else {
                problems.push(format!(
                    "line {size} was rewritten: {name} signs entry_hash {}, the log's line {size} \
                     has {h}",
                    c.checkpoint.entry_hash()
                ));
            }
        } else {
            check.earlier.push(c);
        }
    }
    check.chain = chain;
    check.problems = problems;
    Ok(check)
}

#[cfg(test)]
#[path = "checkpoint_tests.rs"]
mod tests;
