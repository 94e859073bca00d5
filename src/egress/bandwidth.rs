//! The execution's bandwidth bucket and byte cap, shared by all its proxy connections and both
//! directions.
//!
//! The bucket is refilled by elapsed time and may go into debt: a caller reserves its bytes at
//! once and sleeps until the debt is paid. A late wake-up therefore does not lose rate (the time
//! overslept refills the bucket, up to the burst), and callers are served in reservation order.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

pub(crate) struct Bandwidth {
    /// Bytes per second; 0 means unlimited.
    rate: f64,
    burst: f64,
    bucket: Mutex<Bucket>,
    cap: u64,
    used: AtomicU64,
    /// Set once the byte cap is reached; every relay watches it and closes.
    exhausted: watch::Sender<bool>,
}

struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bandwidth {
    pub(crate) fn new(rate_bytes_per_sec: u64, burst_bytes: u64, cap: u64) -> Self {
        let burst = burst_bytes.max(1) as f64;
        Bandwidth {
            rate: rate_bytes_per_sec as f64,
            burst,
            bucket: Mutex::new(Bucket {
                tokens: burst,
                last: Instant::now(),
            }),
            cap,
            used: AtomicU64::new(0),
            exhausted: watch::Sender::new(cap == 0),
        }
    }

    /// Takes up to `n` bytes from the byte cap and waits until the rate allows them. Returns
    /// how many bytes may be sent: fewer than `n` (possibly 0) once the cap is reached.
    pub(crate) async fn take(&self, n: usize) -> usize {
        let granted = self.take_cap(n as u64);
        if granted == 0 {
            return 0;
        }
        if let Some(until) = self.reserve(granted as f64) {
            tokio::time::sleep_until(until).await;
        }
        granted as usize
    }

    fn take_cap(&self, n: u64) -> u64 {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let granted = n.min(self.cap.saturating_sub(used));
            if granted == 0 {
                self.exhausted.send_replace(true);
                return 0;
            }
            match self.used.compare_exchange_weak(
                used,
                used + granted,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    if used + granted >= self.cap {
                        self.exhausted.send_replace(true);
                    }
                    return granted;
                }
                Err(actual) => used = actual,
            }
        }
    }

    /// Books `n` bytes; returns when they may go, or `None` for now.
    fn reserve(&self, n: f64) -> Option<Instant> {
        if self.rate <= 0.0 {
            return None;
        }
        let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(b.last).as_secs_f64();
        b.last = now;
        b.tokens = (b.tokens + elapsed * self.rate).min(self.burst) - n;
        if b.tokens >= 0.0 {
            None
        } else {
            Some(now + Duration::from_secs_f64(-b.tokens / self.rate))
        }
    }

    /// Resolves once the byte cap is reached.
    pub(crate) async fn exhausted(&self) {
        let mut rx = self.exhausted.subscribe();
        // The sender lives as long as `self`, so this only returns when the flag is set.
        let _ = rx.wait_for(|done| *done).await;
    }

    pub(crate) fn is_exhausted(&self) -> bool {
        *self.exhausted.borrow()
    }

    /// Bytes granted so far (both directions, all connections).
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const RATE: u64 = 1_250_000;

    /// The only timing assertion in the module: the bucket itself, not the network, over ~1 s,
    /// with two tasks sharing it the way two connections (or two directions) do.
    #[tokio::test]
    async fn shared_bucket_rate_within_20_percent() {
        let bw = Arc::new(Bandwidth::new(RATE, 64 * 1024, u64::MAX));
        // Spend the initial burst so the measurement is the steady rate.
        bw.take(64 * 1024).await;
        let start = Instant::now();
        let run = |bw: Arc<Bandwidth>| async move {
            let mut total = 0u64;
            while start.elapsed() < Duration::from_secs(1) {
                total += bw.take(16 * 1024).await as u64;
            }
            total
        };
        let (a, b) = tokio::join!(run(bw.clone()), run(bw.clone()));
        let secs = start.elapsed().as_secs_f64();
        let measured = (a + b) as f64 / secs;
        let ratio = measured / RATE as f64;
        assert!(
            (0.8..=1.2).contains(&ratio),
            "measured {measured:.0} B/s over {secs:.3} s, ratio {ratio:.3}"
        );
        assert!(a > 0 && b > 0, "both sharers progress: {a} {b}");
    }

    #[tokio::test]
    async fn byte_cap_grants_the_remainder_then_nothing() {
        let bw = Bandwidth::new(0, 64 * 1024, 1000);
        assert!(!bw.is_exhausted());
        assert_eq!(bw.take(600).await, 600);
        assert_eq!(bw.take(600).await, 400);
        assert!(bw.is_exhausted());
        assert_eq!(bw.take(1).await, 0);
        assert_eq!(bw.used(), 1000);
        tokio::time::timeout(Duration::from_secs(1), bw.exhausted())
            .await
            .expect("exhausted resolves");
    }

    #[tokio::test]
    async fn zero_cap_is_exhausted_from_the_start() {
        let bw = Bandwidth::new(RATE, 1024, 0);
        assert!(bw.is_exhausted());
        assert_eq!(bw.take(10).await, 0);
    }

    #[tokio::test]
    async fn debt_is_paid_by_sleeping() {
        let bw = Bandwidth::new(10_000, 1000, u64::MAX);
        let t0 = Instant::now();
        assert_eq!(bw.take(1000).await, 1000); // the burst: no wait
        assert_eq!(bw.take(500).await, 500); // 50 ms of debt
        let e = t0.elapsed();
        // Lower bound only is exact; the upper one just says "slept, not stuck".
        assert!(
            e >= Duration::from_millis(45) && e < Duration::from_secs(2),
            "{e:?}"
        );
    }
}
