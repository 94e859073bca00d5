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

/// What a stream has captured so far, shared between its reader and [`OutputCapture::drain`].
type Shared = std::sync::Arc<std::sync::Mutex<Capturing>>;

#[derive(Debug, Default)]
struct Capturing {
    captured: Captured,
    /// Set when the capture is handed over: an aborted reader may still be running on another
    /// thread, and must neither add to what was handed over nor tap a byte the result lacks.
    closed: bool,
}

/// Reads `reader` to EOF keeping at most `cap` bytes in `into`, each kept chunk (every chunk,
/// for a tap that follows past the cap) also handed to `tap` as it arrives. On overflow it sends `true` on `overflow` and keeps draining (discarding)
/// so the writer is not blocked until the run ends or the backend kills it.
async fn read_capped<R: AsyncRead + Unpin>(
    mut reader: R,
    cap: usize,
    overflow: watch::Sender<bool>,
    tap: Option<(OutputTap, StreamKind)>,
    into: Shared,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let mut shared = into.lock().unwrap_or_else(|p| p.into_inner());
        if shared.closed {
            return;
        }
        let out = &mut shared.captured;
        let room = cap.saturating_sub(out.bytes.len());
        let kept = n.min(room);
        if let Some((tap, stream)) = &tap {
            let tapped = if tap.follows_past_cap() { n } else { kept };
            if tapped > 0 {
                tap.send(*stream, &buf[..tapped]);
            }
        }
        out.bytes.extend_from_slice(&buf[..kept]);
        if n > room && !out.truncated {
            out.truncated = true;
            let _ = overflow.send(true);
        }
    }
}

/// Hands over what was captured; the reader adds nothing from now on.
fn close(shared: &Shared) -> Captured {
    let mut shared = shared.lock().unwrap_or_else(|p| p.into_inner());
    shared.closed = true;
    std::mem::take(&mut shared.captured)
}

/// One stream's reader and what it has read.
struct Reader {
    task: JoinHandle<()>,
    read: Shared,
}

impl Reader {
    fn start<R: AsyncRead + Unpin + Send + 'static>(
        reader: R,
        cap: usize,
        overflow: watch::Sender<bool>,
        tap: Option<(OutputTap, StreamKind)>,
    ) -> Reader {
        let read = Shared::default();
        read.lock()
            .unwrap_or_else(|p| p.into_inner())
            .captured
            .bytes = Vec::with_capacity(cap.min(64 * 1024));
        let task = tokio::spawn(read_capped(reader, cap, overflow, tap, read.clone()));
        Reader { task, read }
    }

    /// What was read, once the reader reached EOF or `grace` passed (the reader is then
    /// stopped: what it read until then is kept).
    async fn finish(mut self, grace: Duration) -> Captured {
        if tokio::time::timeout(grace, &mut self.task).await.is_err() {
            self.task.abort();
        }
        close(&self.read)
    }
}

/// The capped readers of one run's stdout and stderr, sharing one overflow signal.
pub struct OutputCapture {
    stdout: Reader,
    stderr: Reader,
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
            stdout: Reader::start(stdout, cap, tx.clone(), tap_of(StreamKind::Stdout)),
            stderr: Reader::start(stderr, cap, tx, tap_of(StreamKind::Stderr)),
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
    /// stream still held open by something that outlived the run (or a reader starved of CPU)
    /// yields what was read until then rather than holding the run's answer.
    pub async fn drain(self) -> (Captured, Captured) {
        tokio::join!(
            self.stdout.finish(DRAIN_GRACE),
            self.stderr.finish(DRAIN_GRACE)
        )
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
        let into = Shared::default();
        read_capped(
            &data[..],
            1000,
            tx,
            Some((tap, StreamKind::Stderr)),
            into.clone(),
        )
        .await;
        let got = close(&into);
        assert_eq!(got.bytes.len(), 1000);
        assert!(got.truncated);
        // The tap sees exactly what is kept.
        assert_eq!(*tapped.lock().unwrap(), got.bytes);
        assert!(*rx.borrow());
    }

    #[tokio::test]
    async fn a_tap_past_the_cap_sees_every_byte_and_the_capture_stays_capped() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (tx, rx) = watch::channel(false);
        let tapped = Arc::new(Mutex::new(Vec::new()));
        let sink = tapped.clone();
        let tap =
            OutputTap::new(move |_, b: &[u8]| sink.lock().unwrap().extend_from_slice(b)).past_cap();
        let into = Shared::default();
        read_capped(
            &data[..],
            1000,
            tx,
            Some((tap, StreamKind::Stdout)),
            into.clone(),
        )
        .await;
        let got = close(&into);
        assert_eq!(got.bytes, &data[..1000]);
        assert!(got.truncated);
        assert!(*rx.borrow());
        assert_eq!(*tapped.lock().unwrap(), data);
    }

    /// A stream held open past the run gives back what was read, not nothing.
    #[tokio::test]
    async fn a_stream_still_open_at_drain_keeps_what_was_read() {
        use tokio::io::AsyncWriteExt;
        let (mut out_w, out_r) = tokio::io::duplex(1024);
        let (_err_w, err_r) = tokio::io::duplex(1024);
        let capture = OutputCapture::start(out_r, err_r, 100, OnOverflow::Truncate, None);
        out_w.write_all(b"before the end").await.unwrap();
        // The writer stays open: drain waits its grace, then keeps what was read.
        let (stdout, stderr) = capture.drain().await;
        assert_eq!(stdout.bytes, b"before the end");
        assert!(stderr.bytes.is_empty());
        drop(out_w);
    }

    /// A reader still running after its capture was handed over (an abort lands at its next
    /// await) neither adds to it nor taps what it reads.
    #[tokio::test]
    async fn a_closed_capture_takes_and_taps_nothing_more() {
        let (tx, _rx) = watch::channel(false);
        let tapped = Arc::new(Mutex::new(Vec::new()));
        let sink = tapped.clone();
        let tap = OutputTap::new(move |_, b: &[u8]| sink.lock().unwrap().extend_from_slice(b));
        let into = Shared::default();
        let handed_over = close(&into);
        assert!(handed_over.bytes.is_empty());
        read_capped(
            &b"late bytes"[..],
            100,
            tx,
            Some((tap, StreamKind::Stdout)),
            into.clone(),
        )
        .await;
        assert!(tapped.lock().unwrap().is_empty());
        assert!(into.lock().unwrap().captured.bytes.is_empty());
    }

    #[tokio::test]
    async fn exact_cap_is_not_truncated() {
        let data = vec![b'y'; 1000];
        let (tx, rx) = watch::channel(false);
        let into = Shared::default();
        read_capped(&data[..], 1000, tx, None, into.clone()).await;
        let got = close(&into);
        assert_eq!(got.bytes.len(), 1000);
        assert!(!got.truncated);
        assert!(!*rx.borrow());
    }
}
