//! The audit log: one JSON line per execution and per refusal, fsync'd, hash-chained.
//!
//! Each line carries `seq`, `prev_hash` and `entry_hash = sha256(canonical JSON of the line
//! without entry_hash)`. `verify` walks the chain: an edited line breaks its own hash, a dropped
//! or inserted line breaks `seq` and `prev_hash`, a reordered pair breaks both.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::{Map, Value};

use super::{canonical_json, sha256_prefixed};

pub const GENESIS: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

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
        line: usize,
        message: String,
    },
}

struct Tail {
    file: File,
    seq: u64,
    last_hash: String,
}

pub struct AuditLog {
    path: PathBuf,
    tail: Mutex<Tail>,
}

/// Computes the hash of an entry (which must not contain `entry_hash`).
fn entry_hash(entry: &Map<String, Value>) -> String {
    sha256_prefixed(canonical_json(&Value::Object(entry.clone())).as_bytes())
}

impl AuditLog {
    /// Opens (creating) the log and continues its chain. A log whose chain is broken is refused:
    /// appending to it would hide the break.
    pub fn open(path: &Path) -> Result<AuditLog, AuditError> {
        let io = |source| AuditError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let (seq, last_hash) = if path.exists() {
            verify(path)?
        } else {
            (0, GENESIS.to_string())
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
        }
        Ok(AuditLog {
            path: path.to_path_buf(),
            tail: Mutex::new(Tail {
                file,
                seq,
                last_hash,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one entry and fsyncs it; returns its sequence number.
    pub fn append(&self, mut entry: Map<String, Value>) -> Result<u64, AuditError> {
        let mut tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        let seq = tail.seq + 1;
        entry.remove("entry_hash");
        entry.insert("seq".into(), Value::from(seq));
        entry.insert("prev_hash".into(), Value::from(tail.last_hash.clone()));
        let hash = entry_hash(&entry);
        entry.insert("entry_hash".into(), Value::from(hash.clone()));
        let mut line = canonical_json(&Value::Object(entry));
        line.push('\n');
        let io = |source| AuditError::Io {
            path: self.path.clone(),
            source,
        };
        tail.file.write_all(line.as_bytes()).map_err(io)?;
        tail.file.sync_data().map_err(io)?;
        tail.seq = seq;
        tail.last_hash = hash;
        tracing::info!(target: "audit", "{}", line.trim_end());
        Ok(seq)
    }
}

/// Verifies the chain of `path`; returns the entry count and the last hash.
pub fn verify(path: &Path) -> Result<(u64, String), AuditError> {
    let f = File::open(path).map_err(|source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let broken = |line: usize, message: String| AuditError::Broken {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut prev = GENESIS.to_string();
    let mut count = 0u64;
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|source| AuditError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut entry: Map<String, Value> = match serde_json::from_str(&line) {
            Ok(Value::Object(m)) => m,
            _ => return Err(broken(n, "not a JSON object".into())),
        };
        let Some(Value::String(stated)) = entry.remove("entry_hash") else {
            return Err(broken(n, "missing entry_hash".into()));
        };
        if entry.get("seq").and_then(Value::as_u64) != Some(count + 1) {
            return Err(broken(
                n,
                format!(
                    "sequence number is not {} (a line was dropped, inserted or moved)",
                    count + 1
                ),
            ));
        }
        if entry.get("prev_hash").and_then(Value::as_str) != Some(prev.as_str()) {
            return Err(broken(
                n,
                "prev_hash does not match the previous line".into(),
            ));
        }
        if entry_hash(&entry) != stated {
            return Err(broken(
                n,
                "entry_hash does not match the line's content (edited)".into(),
            ));
        }
        prev = stated;
        count += 1;
    }
    Ok((count, prev))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("event".into(), Value::from("execution"));
        m.insert("n".into(), Value::from(i));
        m
    }

    #[test]
    fn chain_detects_edit_drop_insert_reorder() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let log = AuditLog::open(&p).unwrap();
        for i in 0..4 {
            log.append(entry(i)).unwrap();
        }
        drop(log);
        assert_eq!(verify(&p).unwrap().0, 4);
        // Reopening continues the chain.
        AuditLog::open(&p).unwrap().append(entry(9)).unwrap();
        assert_eq!(verify(&p).unwrap().0, 5);

        let lines: Vec<String> = std::fs::read_to_string(&p)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        let check = |ls: Vec<String>, bad_line: usize| {
            let q = dir.path().join("b.jsonl");
            std::fs::write(&q, ls.join("\n") + "\n").unwrap();
            match verify(&q) {
                Err(AuditError::Broken { line, .. }) => assert_eq!(line, bad_line),
                other => panic!("expected broken chain, got {other:?}"),
            }
        };
        let mut edited = lines.clone();
        edited[1] = edited[1].replace("\"n\":1", "\"n\":7");
        check(edited, 2);
        let mut dropped = lines.clone();
        dropped.remove(2);
        check(dropped, 3);
        let mut reordered = lines.clone();
        reordered.swap(1, 2);
        check(reordered, 2);
        let mut inserted = lines.clone();
        inserted.insert(1, lines[0].clone());
        check(inserted, 2);
    }
}
