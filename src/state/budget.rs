//! The byte budget of the completed results (idempotent answers, run records) an embedded store
//! holds. When a new result does not fit, the oldest result of the subject holding the most bytes
//! goes first, so one caller cannot push everyone else's results out. Must not: store the
//! results themselves (a store keeps them and tells the budget what it added and removed).

use std::collections::BTreeMap;

/// Bookkeeping bytes charged per stored result on top of its strings (map nodes, headers).
const ENTRY_OVERHEAD: usize = 128;

/// What a result stored under `scoped` for `subject` costs against the budget.
pub(super) fn result_bytes(scoped: &str, subject: &str, body_hash: &str, body: &str) -> usize {
    ENTRY_OVERHEAD + scoped.len() + subject.len() + body_hash.len() + body.len()
}

/// One subject's completed results, oldest first, and the bytes they hold.
#[derive(Default)]
struct SubjectResults {
    bytes: usize,
    by_age: BTreeMap<u64, String>,
}

pub(super) struct ResultBudget {
    results: BTreeMap<String, SubjectResults>,
    bytes: usize,
    max_bytes: usize,
    next_seq: u64,
}

impl ResultBudget {
    pub(super) fn new(max_bytes: usize) -> Self {
        ResultBudget {
            results: BTreeMap::new(),
            bytes: 0,
            max_bytes,
            next_seq: 0,
        }
    }

    pub(super) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Bytes the counted results hold.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// True when no result is counted.
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.results.is_empty()
    }

    /// True when a result of `bytes` could never fit.
    pub(super) fn too_large(&self, bytes: usize) -> bool {
        bytes > self.max_bytes
    }

    /// True when `bytes` more do not fit now.
    pub(super) fn overfull_with(&self, bytes: usize) -> bool {
        self.bytes + bytes > self.max_bytes
    }

    /// Counts a new result; returns its age (completion order).
    pub(super) fn add(&mut self, subject: &str, scoped: &str, bytes: usize) -> u64 {
        let seq = self.next_seq;
        self.restore(subject, scoped, seq, bytes);
        seq
    }

    /// Counts a result a store already holds, with the age it was given.
    pub(super) fn restore(&mut self, subject: &str, scoped: &str, seq: u64, bytes: usize) {
        let r = self.results.entry(subject.to_string()).or_default();
        r.bytes += bytes;
        r.by_age.insert(seq, scoped.to_string());
        self.bytes += bytes;
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// Stops counting the result of `subject` of age `seq`.
    pub(super) fn remove(&mut self, subject: &str, seq: u64, bytes: usize) {
        if let Some(r) = self.results.get_mut(subject)
            && r.by_age.remove(&seq).is_some()
        {
            r.bytes -= bytes;
            self.bytes -= bytes;
            if r.by_age.is_empty() {
                self.results.remove(subject);
            }
        }
    }

    /// The key of the result to evict first: the oldest of the subject holding the most bytes.
    pub(super) fn victim(&self) -> Option<String> {
        self.results
            .iter()
            .max_by_key(|(_, r)| r.bytes)
            .and_then(|(_, r)| r.by_age.values().next().cloned())
    }
}
