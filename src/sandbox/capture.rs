//! Bounded reading of a run's output streams.
//!
//! Each stream keeps at most `cap` bytes; the first byte past the cap flips `truncated`, and the
//! rest is read and discarded so the writer never blocks on a full pipe. Under
//! [`OnOverflow::Kill`] that first byte also fires the shared limit signal so the backend stops
//! the run. Memory per stream is bounded by the cap plus one read buffer, whatever the child
//! writes. [`OutputCapture`] is the one place a backend starts its readers and collects what they
//! read.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{OnOverflow, OutputTap, StreamKind};

/// How long the readers may take to reach EOF once the run is over (the sandbox is gone, or its
/// output stream has ended).
pub const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Captured bytes of one stream.
#[derive(Debug, Default)]
pub struct Captured {
    pub bytes: Vec<u8>,
    pub truncated: bool,
}

/// Reads `reader` to EOF keeping at most `cap` bytes, each kept chunk also handed to `tap` as
/// it arrives. On overflow it sends `true` on `overflow` and keeps draining (discarding) so the
/// writer is not blocked until the run ends or the backend kills it.
pub async fn read_capped<R: AsyncRead + Unpin>(
    mut reader: R,
    cap: usize,
    overflow: watch::Sender<bool>,
    tap: Option<(OutputTap, StreamKind)>,
) -> Captured {
    let mut out = Captured {
        bytes: Vec::with_capacity(cap.min(64 * 1024)),
        truncated: false,
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let room = cap.saturating_sub(out.bytes.len());
        let kept = n.min(room);
        if kept > 0
            && let Some((tap, stream)) = &tap
        {
            tap.send(*stream, &buf[..kept]);
        }
        if n <= room {
            out.bytes.extend_from_slice(&buf[..n]);
        } else {
            out.bytes.extend_from_slice(&buf[..room]);
            if !out.truncated {
                out.truncated = true;
                let _ = overflow.send(true);
            }
        }
    }
    out
}

/// The capped readers of one run's stdout and stderr, sharing one overflow signal.
pub struct OutputCapture {
    stdout: JoinHandle<Captured>,
    stderr: JoinHandle<Captured>,
    overflow: watch::Receiver<bool>,
    on_overflow: OnOverflow,
}

impl OutputCapture {
    /// Starts reading both streams on tasks of their own, each kept to `cap` bytes and handed
    /// to `tap` as it arrives.
    pub fn start<O, E>(
        stdout: O,
        stderr: E,
        cap: usize,
        on_overflow: OnOverflow,
        tap: Option<OutputTap>,
    ) -> Self
    where
        O: AsyncRead + Unpin + Send + 'static,
        E: AsyncRead + Unpin + Send + 'static,
    {
        let (tx, overflow) = watch::channel(false);
        let tap_of = |stream| tap.clone().map(|t| (t, stream));
        OutputCapture {
            stdout: tokio::spawn(read_capped(
                stdout,
                cap,
                tx.clone(),
                tap_of(StreamKind::Stdout),
            )),
            stderr: tokio::spawn(read_capped(stderr, cap, tx, tap_of(StreamKind::Stderr))),
            overflow,
            on_overflow,
        }
    }

    /// Resolves when a stream went past its cap and the run must be killed for it; never under
    /// [`OnOverflow::Truncate`], nor when both streams end within the cap.
    pub async fn overflowed(&mut self) {
        match self.on_overflow {
            OnOverflow::Kill => raised(&mut self.overflow).await,
            OnOverflow::Truncate => std::future::pending().await,
        }
    }

    /// What each stream captured. Waits at most [`DRAIN_GRACE`] for the readers to reach EOF: a
    /// stream still held open by something that outlived the run yields nothing rather than
    /// holding the run's answer.
    pub async fn drain(self) -> (Captured, Captured) {
        let collect = |t: JoinHandle<Captured>| async move {
            tokio::time::timeout(DRAIN_GRACE, t)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default()
        };
        tokio::join!(collect(self.stdout), collect(self.stderr))
    }
}

/// Resolves when the flag becomes true; never when its senders are gone with it still false
/// (the output readers drop theirs at EOF).
async fn raised(flag: &mut watch::Receiver<bool>) {
    if flag.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[tokio::test]
    async fn keeps_at_most_cap_and_flags_overflow() {
        let data = vec![b'x'; 200_000];
        let (tx, rx) = watch::channel(false);
        let tapped = Arc::new(Mutex::new(Vec::new()));
        let sink = tapped.clone();
        let tap = OutputTap::new(move |stream, b: &[u8]| {
            assert_eq!(stream, StreamKind::Stderr);
            sink.lock().unwrap().extend_from_slice(b);
        });
        let got = read_capped(&data[..], 1000, tx, Some((tap, StreamKind::Stderr))).await;
        assert_eq!(got.bytes.len(), 1000);
        assert!(got.truncated);
        // The tap sees exactly what is kept.
        assert_eq!(*tapped.lock().unwrap(), got.bytes);
        assert!(*rx.borrow());
    }

    #[tokio::test]
    async fn exact_cap_is_not_truncated() {
        let data = vec![b'y'; 1000];
        let (tx, rx) = watch::channel(false);
        let got = read_capped(&data[..], 1000, tx, None).await;
        assert_eq!(got.bytes.len(), 1000);
        assert!(!got.truncated);
        assert!(!*rx.borrow());
    }
}
