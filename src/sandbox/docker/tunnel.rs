//! A connection to a port inside a gVisor container, through `docker exec` of the supervisor in
//! `connect` mode: the supervisor connects to `127.0.0.1:PORT` in the container's own network
//! stack, says so with one byte [`CONNECTED`] on its stdout, then splices the socket with its
//! stdio. gVisor's netstack lives in the sentry, so no host namespace reaches it.
//!
//! Owns: making the exec's attach connection into one byte stream. Must not: choose the port.

use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::engine::{Attached, Output};
use crate::sandbox::ports::{PortConn, PortError};

/// The byte the supervisor writes once it is connected.
pub const CONNECTED: u8 = executor_arm_supervisor::protocol::PORT_CONNECTED;

/// Bytes buffered each way between the exec and the caller's end.
const BUFFER: usize = 64 * 1024;

/// The exec's stdio as a byte stream, once its supervisor said it connected; its refusal (what
/// it wrote on stderr) otherwise.
pub async fn open(attached: Attached, port: u16) -> Result<PortConn, PortError> {
    let Attached {
        mut input,
        mut output,
    } = attached;
    let mut why = Vec::new();
    // Up to the first stdout byte: the verdict.
    let first = loop {
        match output.next().await {
            Some(Ok(Output::Stdout(b))) if !b.is_empty() => break Some(b),
            Some(Ok(Output::Stdout(_))) => {}
            Some(Ok(Output::Stderr(b))) => why.extend_from_slice(&b[..b.len().min(1024)]),
            Some(Err(_)) | None => break None,
        }
    };
    let first = match first {
        Some(b) if b[0] == CONNECTED => b.slice(1..),
        _ => {
            let why = String::from_utf8_lossy(&why).trim().to_string();
            return Err(PortError::Closed(format!(
                "nothing listens on port {port} in the session's sandbox ({why})"
            )));
        }
    };
    let (ours, theirs) = tokio::io::duplex(BUFFER);
    let (mut rd, mut wr) = tokio::io::split(ours);
    // Sandbox → caller.
    tokio::spawn(async move {
        if !first.is_empty() && wr.write_all(&first).await.is_err() {
            return;
        }
        while let Some(item) = output.next().await {
            match item {
                Ok(Output::Stdout(b)) => {
                    if wr.write_all(&b).await.is_err() {
                        return;
                    }
                }
                Ok(Output::Stderr(_)) => {}
                Err(_) => break,
            }
        }
        let _ = wr.shutdown().await;
    });
    // Caller → sandbox; its end closes the exec's stdin, which ends the supervisor's write side.
    tokio::spawn(async move {
        let mut buf = vec![0u8; BUFFER];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if input.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = input.shutdown().await;
    });
    Ok(Box::new(theirs))
}
