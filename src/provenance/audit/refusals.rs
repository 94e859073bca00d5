//! How many refusal lines a flood of refused requests may write.
//!
//! Every refused request is worth a line, until someone sends thousands a second: each line is
//! fsync'd under the log's lock, so an unauthenticated caller could slow every admitted run and
//! fill the disk. Each class of refusal has a token bucket (`per_second`, `burst`); a refusal
//! over its bucket writes no line and is counted instead. The counts are written as one
//! `refusals_suppressed` line by [`super::AuditLog::flush_suppressed`], which the daemon calls
//! every few seconds and at shutdown, so the log still accounts for every refusal, and nothing is
//! lost but the detail of the suppressed ones (and, if the daemon is killed, the counts of its
//! last few seconds).
//!
//! The classes are separate so that a flood from callers without a valid service token cannot
//! crowd out the refusals of authenticated callers (a 403, a replayed single-use capability
//! token), which name a subject and a command.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

/// The rate at which each class of refusal is written in full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RefusalRate {
    /// Lines per second each class may write once its burst is spent.
    pub per_second: f64,
    /// Lines each class may write at once.
    pub burst: u32,
}

impl Default for RefusalRate {
    fn default() -> Self {
        RefusalRate {
            per_second: 20.0,
            burst: 200,
        }
    }
}

/// The line that stands for refusals written as counts only.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RefusalsSuppressed {
    /// How many refusals this line stands for.
    pub count: u64,
    /// Those refusals by HTTP status.
    pub by_status: BTreeMap<u16, u64>,
    /// When the first and the last of them were refused (RFC 3339).
    pub first_at: String,
    pub last_at: String,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
}

impl Bucket {
    fn full(rate: RefusalRate, now: Instant) -> Bucket {
        Bucket {
            tokens: f64::from(rate.burst),
            refilled: now,
        }
    }

    fn take(&mut self, rate: RefusalRate, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate.per_second).min(f64::from(rate.burst));
        self.refilled = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The buckets and the counts not yet written.
#[derive(Debug)]
pub(super) struct RefusalBudget {
    rate: RefusalRate,
    unauthenticated: Bucket,
    authenticated: Bucket,
    pending: Option<RefusalsSuppressed>,
}

impl RefusalBudget {
    pub(super) fn new(rate: RefusalRate) -> RefusalBudget {
        let now = Instant::now();
        RefusalBudget {
            rate,
            unauthenticated: Bucket::full(rate, now),
            authenticated: Bucket::full(rate, now),
            pending: None,
        }
    }

    /// Whether a refusal with `status` gets its own line; when not, it is counted for the next
    /// `refusals_suppressed` line. `authenticated`: the caller's service token was verified.
    /// `now` and `at` are the same moment (monotonic, and as text).
    pub(super) fn admit(
        &mut self,
        status: u16,
        authenticated: bool,
        now: Instant,
        at: &str,
    ) -> bool {
        let rate = self.rate;
        let bucket = if authenticated {
            &mut self.authenticated
        } else {
            &mut self.unauthenticated
        };
        if bucket.take(rate, now) {
            return true;
        }
        let p = self.pending.get_or_insert_with(|| RefusalsSuppressed {
            count: 0,
            by_status: BTreeMap::new(),
            first_at: at.to_string(),
            last_at: String::new(),
        });
        p.count += 1;
        *p.by_status.entry(status).or_default() += 1;
        at.clone_into(&mut p.last_at);
        false
    }

    /// The counts not yet written.
    pub(super) fn pending(&self) -> Option<&RefusalsSuppressed> {
        self.pending.as_ref()
    }

    /// The counts not yet written, leaving none.
    pub(super) fn take_pending(&mut self) -> Option<RefusalsSuppressed> {
        self.pending.take()
    }

    /// Puts back counts whose line could not be written, merged with any counted since.
    pub(super) fn restore_pending(&mut self, old: RefusalsSuppressed) {
        match &mut self.pending {
            None => self.pending = Some(old),
            Some(newer) => {
                newer.count += old.count;
                for (status, n) in old.by_status {
                    *newer.by_status.entry(status).or_default() += n;
                }
                newer.first_at = old.first_at;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const RATE: RefusalRate = RefusalRate {
        per_second: 2.0,
        burst: 3,
    };

    #[test]
    fn a_burst_is_written_then_the_rest_is_counted_by_status() {
        let t0 = Instant::now();
        let mut b = RefusalBudget::new(RATE);
        let admitted: Vec<bool> = (0..5).map(|_| b.admit(401, false, t0, "t0")).collect();
        assert_eq!(admitted, [true, true, true, false, false]);
        let p = b.take_pending().expect("two suppressed");
        assert_eq!(p.count, 2);
        assert_eq!(p.by_status, BTreeMap::from([(401, 2)]));
        assert_eq!((p.first_at.as_str(), p.last_at.as_str()), ("t0", "t0"));
        assert!(b.take_pending().is_none(), "taken once");
    }

    #[test]
    fn a_flood_of_unauthenticated_refusals_does_not_crowd_out_authenticated_ones() {
        let t0 = Instant::now();
        let mut b = RefusalBudget::new(RATE);
        for _ in 0..100 {
            b.admit(401, false, t0, "t0");
        }
        assert!(
            b.admit(403, true, t0, "t0"),
            "the authenticated bucket is untouched"
        );
        assert!(
            b.admit(401, true, t0, "t0"),
            "an authenticated caller's 401 too"
        );
        assert_eq!(
            b.take_pending().unwrap().by_status,
            BTreeMap::from([(401, 97)])
        );
    }

    #[test]
    fn the_bucket_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = RefusalBudget::new(RATE);
        for _ in 0..3 {
            assert!(b.admit(403, true, t0, "t0"));
        }
        assert!(!b.admit(403, true, t0, "t0"));
        // Half a second at 2/s is one line.
        let t1 = t0 + Duration::from_millis(500);
        assert!(b.admit(403, true, t1, "t1"));
        assert!(!b.admit(403, true, t1, "t1"));
        // A long quiet spell refills to the burst, no further.
        let t2 = t1 + Duration::from_secs(3600);
        let admitted = (0..5).filter(|_| b.admit(403, true, t2, "t2")).count();
        assert_eq!(admitted, 3);
        let p = b.take_pending().unwrap();
        assert_eq!(p.count, 4);
        assert_eq!((p.first_at.as_str(), p.last_at.as_str()), ("t0", "t2"));
    }

    #[test]
    fn counts_that_could_not_be_written_are_kept_with_newer_ones() {
        let t0 = Instant::now();
        let mut b = RefusalBudget::new(RefusalRate {
            per_second: 0.0,
            burst: 0,
        });
        b.admit(401, false, t0, "t0");
        let old = b.take_pending().unwrap();
        b.admit(403, true, t0, "t1");
        b.restore_pending(old);
        let p = b.take_pending().unwrap();
        assert_eq!(p.count, 2);
        assert_eq!(p.by_status, BTreeMap::from([(401, 1), (403, 1)]));
        assert_eq!((p.first_at.as_str(), p.last_at.as_str()), ("t0", "t1"));
    }
}
