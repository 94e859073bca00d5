//! Bounded reading of a child's output streams.
//!
//! Each stream keeps at most `cap` bytes; the first byte past the cap flips `truncated` and fires
//! the shared limit signal so the backend stops the run. Memory per stream is bounded by the cap
//! plus one read buffer, whatever the child writes.

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::watch;

/// Captured bytes of one stream.
#[derive(Debug, Default)]
pub struct Captured {
    pub bytes: Vec<u8>,
    pub truncated: bool,
}

/// Reads `reader` to EOF keeping at most `cap` bytes. On overflow it sends `true` on `overflow`
/// and keeps draining (discarding) so the writer is not blocked until the backend kills it.
pub async fn read_capped<R: AsyncRead + Unpin>(
    mut reader: R,
    cap: usize,
    overflow: watch::Sender<bool>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn keeps_at_most_cap_and_flags_overflow() {
        let data = vec![b'x'; 200_000];
        let (tx, rx) = watch::channel(false);
        let got = read_capped(&data[..], 1000, tx).await;
        assert_eq!(got.bytes.len(), 1000);
        assert!(got.truncated);
        assert!(*rx.borrow());
    }

    #[tokio::test]
    async fn exact_cap_is_not_truncated() {
        let data = vec![b'y'; 1000];
        let (tx, rx) = watch::channel(false);
        let got = read_capped(&data[..], 1000, tx).await;
        assert_eq!(got.bytes.len(), 1000);
        assert!(!got.truncated);
        assert!(!*rx.borrow());
    }
}
