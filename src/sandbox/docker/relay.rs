//! The relay every container run shares, a one-shot `/execute` as much as a session's exec
//! ([`super::kept`]): hands a request to the container's supervisor, pumps its frames into the
//! capped output readers, and waits, through the shared skeleton ([`super::super::run`]), for
//! the run's end, its timeout, an output cap or a stop.
//!
//! Owns: delivering the request, decoding the supervisor's stream, keeping its own stderr for
//! error messages, and writing a live run's controls to the supervisor as control frames while
//! the run lasts. Must not: decide how a run ends or kill anything (the caller kills a
//! container, or one exec in it).

use std::time::Instant;

use executor_arm_supervisor::protocol::ControlFrame;
use futures::StreamExt;
use tokio::io::{AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;

use super::engine::{EngineError, Output, OutputStream};
use super::supervisor::{Frame, FrameDecoder};
use super::{DockerSandbox, KILL_TIMEOUT};
use crate::sandbox::capture::{Captured, OutputCapture};
use crate::sandbox::control::{Control, ControlReceiver, ProcessSignal};
use crate::sandbox::run::{self, Waited};
use crate::sandbox::{KilledReason, RunSpec};

/// What reaches a run while it runs, besides its request.
#[derive(Default)]
pub(super) struct Live {
    /// The caller's controls ([`RunSpec::controls`], taken): forwarded as control frames until
    /// the run's last frame; every sender gone ends the command's stdin.
    pub(super) controls: Option<ControlReceiver>,
    /// The daemon's own (a background run's stop), forwarded the same way.
    pub(super) own: Option<mpsc::Receiver<Control>>,
    /// Where a stop's SIGTERM goes: through this channel as a TERM control (a background run,
    /// whose supervisor is no container's main process); None: to the container's main process.
    pub(super) terminate_via: Option<mpsc::Sender<Control>>,
}

/// The control frames of `c`.
pub(super) fn control_frames(c: Control) -> Vec<u8> {
    match c {
        Control::Stdin(b) => ControlFrame::Stdin(b),
        Control::CloseStdin => ControlFrame::CloseStdin,
        Control::Signal(s) => ControlFrame::Signal(s.number()),
    }
    .encode()
}

/// The next control of `rx`; never, once it is None.
async fn next_control(rx: &mut Option<mpsc::Receiver<Control>>) -> Option<Control> {
    match rx {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

/// The next control of the caller's `rx` (signals first); never, once it is None.
async fn next_caller_control(rx: &mut Option<ControlReceiver>) -> Option<Control> {
    match rx {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

/// Runs `pumping` (the supervisor's frames, to the run's last) while writing each control of
/// `controls` and `own` to `input` as control frames. A frame being written when the run ends is
/// written whole, so the stream stays in step for the next request; controls after the run's end
/// are dropped with the receivers.
async fn pump_with_controls(
    input: &mut std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    mut controls: Option<ControlReceiver>,
    mut own: Option<mpsc::Receiver<Control>>,
    pumping: impl std::future::Future<Output = PumpEnd>,
) -> PumpEnd {
    let mut pumping = std::pin::pin!(pumping);
    loop {
        let next = tokio::select! {
            end = &mut pumping => return end,
            c = next_caller_control(&mut controls) => c.unwrap_or_else(|| {
                // Every sender is gone: the command's stdin ends.
                controls = None;
                Control::CloseStdin
            }),
            c = next_control(&mut own) => match c {
                Some(c) => c,
                None => {
                    own = None;
                    continue;
                }
            },
        };
        let bytes = control_frames(next);
        let mut ended = None;
        {
            let mut write = std::pin::pin!(async {
                input.write_all(&bytes).await?;
                input.flush().await
            });
            loop {
                tokio::select! {
                    r = &mut write => {
                        if r.is_err() {
                            // The supervisor's end is gone: its last frame (or none) says how
                            // the run ended.
                            controls = None;
                            own = None;
                        }
                        break;
                    }
                    end = &mut pumping, if ended.is_none() => ended = Some(end),
                }
            }
        }
        if let Some(end) = ended {
            return end;
        }
    }
}

/// Supervisor stderr kept for error messages.
const SUPERVISOR_STDERR_CAP: usize = 4096;

/// A request handed to a container's supervisor: the relay of its frames into the capped
/// readers (still pending when the daemon decided to kill the run) and their capture.
pub(super) struct Relayed<'a> {
    pub(super) relay: std::pin::Pin<Box<dyn std::future::Future<Output = PumpEnd> + Send + 'a>>,
    output: OutputCapture,
    pub(super) start: Instant,
}

impl Relayed<'_> {
    /// The captured output, once the relay is dropped (which closes the readers' pipes).
    pub(super) async fn finish(self) -> (Captured, Captured) {
        let Relayed { relay, output, .. } = self;
        drop(relay);
        output.drain().await
    }
}

impl DockerSandbox {
    /// What every container run shares, a one-shot `/execute` or a session's exec: hands
    /// `request` to the supervisor, relays its frames into the capped readers and waits for the
    /// run's end, its timeout, an output cap or a stop (whose grace starts with SIGTERM through
    /// the engine, or through `live`'s channel), forwarding `live`'s controls meanwhile. Returns the run in flight, the daemon's reason to end it early, and the
    /// supervisor's end when it came; killing is the caller's (a container, or one exec in it).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn relay_and_wait<'a>(
        &'a self,
        id: &'a str,
        spec: &'a RunSpec,
        input: &'a mut std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
        output: &'a mut OutputStream,
        decoder: &'a mut FrameDecoder,
        request: &'a [u8],
        live: Live,
    ) -> (Relayed<'a>, Option<KilledReason>, Option<PumpEnd>) {
        let Live {
            controls,
            own,
            terminate_via,
        } = live;
        let (out_w, out_r) = tokio::io::duplex(64 * 1024);
        let (err_w, err_r) = tokio::io::duplex(64 * 1024);
        let mut capture = OutputCapture::start(
            out_r,
            err_r,
            spec.limits.output_bytes,
            spec.limits.on_overflow,
            spec.output_tap.clone(),
        );
        let start = Instant::now();
        let mut relay: std::pin::Pin<Box<dyn std::future::Future<Output = PumpEnd> + Send + 'a>> =
            Box::pin(async move {
                match deliver(input, request).await {
                    Ok(()) if controls.is_none() && own.is_none() => {
                        pump(output, decoder, out_w, err_w).await
                    }
                    Ok(()) => {
                        let pumping = pump(output, decoder, out_w, err_w);
                        pump_with_controls(input, controls, own, pumping).await
                    }
                    Err(e) => PumpEnd {
                        undelivered: true,
                        error: Some(e),
                        ..PumpEnd::default()
                    },
                }
            });
        let terminate = || async {
            if let Some(tx) = &terminate_via {
                let _ = tx.send(Control::Signal(ProcessSignal::Term)).await;
                return;
            }
            match tokio::time::timeout(KILL_TIMEOUT, self.engine().terminate(id)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(exec_id = %spec.exec_id, container = %id, error = %e, "SIGTERM before the stop's grace failed")
                }
                Err(_) => {
                    tracing::warn!(exec_id = %spec.exec_id, container = %id, "the engine did not confirm the SIGTERM in time")
                }
            }
        };
        let waited = run::wait(
            &mut relay,
            spec.limits.timeout,
            spec.stop.as_ref(),
            &mut capture,
            terminate,
        )
        .await;
        let (killed, end) = match waited {
            Waited::Ended(end) => (None, Some(end)),
            Waited::EndedOnStop(end, reason) => (Some(reason), Some(end)),
            Waited::Kill(reason) => (Some(reason), None),
        };
        let relayed = Relayed {
            relay,
            output: capture,
            start,
        };
        (relayed, killed, end)
    }
}

/// How relaying the supervisor's stream ended.
#[derive(Default)]
pub(super) struct PumpEnd {
    /// The final frame (`Exit` or `Failed`), if it arrived.
    pub(super) report: Option<Frame>,
    pub(super) supervisor_stderr: Vec<u8>,
    /// The stream broke or was corrupt.
    pub(super) error: Option<EngineError>,
    /// The request could not even be written: the command never started.
    pub(super) undelivered: bool,
}

/// Hands a request to the supervisor.
pub(super) async fn deliver(
    input: &mut std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    request: &[u8],
) -> Result<(), EngineError> {
    let written = async {
        input.write_all(request).await?;
        input.flush().await
    };
    written.await.map_err(|e| {
        EngineError::Unreachable(format!("could not hand the request to the sandbox: {e}"))
    })
}

/// Relays command output from the supervisor's stream into the capped readers until the final
/// frame. `decoder` keeps what follows that frame (nothing, from a supervisor that waits for its
/// next request).
async fn pump(
    output: &mut OutputStream,
    decoder: &mut FrameDecoder,
    mut out_w: DuplexStream,
    mut err_w: DuplexStream,
) -> PumpEnd {
    let mut end = PumpEnd::default();
    loop {
        loop {
            match decoder.next_frame() {
                Ok(None) => break,
                // A closed reader means its task is gone; keep draining so the run can end.
                Ok(Some(Frame::Stdout(b))) => {
                    let _ = out_w.write_all(&b).await;
                }
                Ok(Some(Frame::Stderr(b))) => {
                    let _ = err_w.write_all(&b).await;
                }
                Ok(Some(f)) => {
                    end.report = Some(f);
                    return end;
                }
                Err(e) => {
                    end.error = Some(EngineError::Api(format!("corrupt supervisor stream: {e}")));
                    return end;
                }
            }
        }
        match output.next().await {
            Some(Ok(Output::Stdout(chunk))) => decoder.push(&chunk),
            Some(Ok(Output::Stderr(chunk))) => {
                let room = SUPERVISOR_STDERR_CAP.saturating_sub(end.supervisor_stderr.len());
                end.supervisor_stderr
                    .extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Some(Err(e)) => {
                end.error = Some(e);
                return end;
            }
            None => return end,
        }
    }
}
