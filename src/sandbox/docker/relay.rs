//! The relay every container run shares, a one-shot `/execute` as much as a session's exec
//! ([`super::kept`]): hands a request to the container's supervisor, pumps its frames into the
//! capped output readers, and waits, through the shared skeleton ([`super::super::run`]), for
//! the run's end, its timeout, an output cap or a stop.
//!
//! Owns: delivering the request, decoding the supervisor's stream, keeping its own stderr for
//! error messages, and writing a live run's controls to the supervisor as control frames while
//! the run lasts. Must not: decide how a run ends or kill anything (the caller kills a
//! container, or one exec in it).

use std::collections::VecDeque;
use std::time::Instant;

use executor_arm_supervisor::protocol::{CHUNK, ControlFrame};
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
    /// The supervisor reads its stream on after the run (a kept sandbox's PID 1): a control
    /// frame being written when the run ends is written whole. False for one that serves one
    /// run and reads nothing after its report (once and spawn modes).
    pub(super) stream_outlives_run: bool,
}

/// The control frames of `c`, one wire frame each: stdin bytes are cut into
/// [`executor_arm_supervisor::protocol::CHUNK`]-sized frames, so that a signal can go between
/// two of them.
pub(super) fn control_frames(c: Control) -> VecDeque<Vec<u8>> {
    match c {
        Control::Stdin(b) if !b.is_empty() => b
            .chunks(CHUNK)
            .map(|piece| ControlFrame::Stdin(piece.to_vec()).encode())
            .collect(),
        Control::Stdin(b) => VecDeque::from([ControlFrame::Stdin(b).encode()]),
        Control::CloseStdin => VecDeque::from([ControlFrame::CloseStdin.encode()]),
        Control::Signal(s) => VecDeque::from([ControlFrame::Signal(s.number()).encode()]),
    }
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

/// A signal waiting now, the daemon's own (a background run's stop or kill) first.
fn waiting_signal(
    controls: &mut Option<ControlReceiver>,
    own: &mut Option<mpsc::Receiver<Control>>,
) -> Option<Control> {
    if let Some(c) = own.as_mut().and_then(|r| r.try_recv().ok()) {
        return Some(c);
    }
    controls
        .as_mut()
        .and_then(|r| r.signals.try_recv().ok())
        .map(Control::Signal)
}

/// Runs `pumping` (the supervisor's frames, to the run's last) while writing each control of
/// `controls` and `own` to `input` as control frames, one wire frame at a time: a signal waiting
/// goes before the next stdin frame, so stdin bytes already on their way hold it back by one
/// frame at most. When the run ends the rest of a stdin control is dropped. The frame being
/// written then is written whole if `finish_frame` (a supervisor that reads its stream on after
/// the run drops the controls it finds there, and must find them whole to stay in step);
/// otherwise (a supervisor that serves one run and reads nothing after its report) it is
/// abandoned at once with the connection: waiting for it would wait for ever once the buffers
/// between here and the supervisor are full.
async fn pump_with_controls(
    input: &mut std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    mut controls: Option<ControlReceiver>,
    mut own: Option<mpsc::Receiver<Control>>,
    finish_frame: bool,
    pumping: impl std::future::Future<Output = PumpEnd>,
) -> PumpEnd {
    let mut pumping = std::pin::pin!(pumping);
    // The wire frames of the stdin control being written.
    let mut frames: VecDeque<Vec<u8>> = VecDeque::new();
    loop {
        let frame = match waiting_signal(&mut controls, &mut own) {
            Some(signal) => control_frames(signal).pop_front(),
            None => frames.pop_front(),
        };
        let frame = match frame {
            Some(f) => f,
            None => {
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
                frames = control_frames(next);
                continue;
            }
        };
        let mut ended = None;
        {
            let mut write = std::pin::pin!(async {
                input.write_all(&frame).await?;
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
                            frames.clear();
                        }
                        break;
                    }
                    end = &mut pumping, if ended.is_none() => {
                        if !finish_frame {
                            return end;
                        }
                        ended = Some(end);
                    }
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
            stream_outlives_run,
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
                        pump_with_controls(input, controls, own, stream_outlives_run, pumping).await
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
    /// Frames decoded from the supervisor's stream (0: it never spoke).
    pub(super) frames: u64,
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
            let next = decoder.next_frame();
            if matches!(next, Ok(Some(_))) {
                end.frames += 1;
            }
            match next {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use executor_arm_supervisor::protocol::ControlDecoder;
    use tokio::io::AsyncReadExt;
    use tokio::sync::oneshot;

    use super::*;
    use crate::sandbox::control::Controls;

    const BOUND: Duration = Duration::from_secs(10);

    /// The control frames in `bytes`, and whether they end on a frame's end.
    fn decode(bytes: &[u8]) -> (Vec<ControlFrame>, bool) {
        let mut d = ControlDecoder::default();
        d.push(bytes);
        let mut got = Vec::new();
        while let Some(c) = d.next_control().expect("well-formed control frames") {
            got.push(c);
        }
        (got, d.missing() == 0)
    }

    fn boxed(w: tokio::io::DuplexStream) -> std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>> {
        Box::pin(w)
    }

    /// A pump whose run ends when `end` fires.
    async fn run_until(end: oneshot::Receiver<()>) -> PumpEnd {
        let _ = end.await;
        PumpEnd::default()
    }

    /// Stdin bytes already on their way to a supervisor that takes them slowly hold a signal
    /// back by one frame at most: it is written between two of their frames.
    #[tokio::test]
    async fn a_signal_goes_between_the_frames_of_stdin_on_its_way() {
        let (tx, controls) = Controls::channel();
        let (w, mut r) = tokio::io::duplex(8 * 1024);
        let (end_tx, end_rx) = oneshot::channel();
        let pump = tokio::spawn(async move {
            let mut input = boxed(w);
            pump_with_controls(&mut input, controls.take(), None, false, run_until(end_rx)).await
        });
        tx.send(Control::Stdin(vec![b'x'; 1 << 20])).await.unwrap();
        // The pump is writing the stdin bytes (the pipe holds 8 KiB): the signal comes now.
        let mut seen = vec![0u8; 4096];
        r.read_exact(&mut seen).await.unwrap();
        tx.send(Control::Signal(ProcessSignal::Term)).await.unwrap();
        let mut stdin_before = 0;
        let signalled = tokio::time::timeout(BOUND, async {
            let mut d = ControlDecoder::default();
            d.push(&seen);
            let mut buf = vec![0u8; 4096];
            loop {
                while let Some(c) = d.next_control().unwrap() {
                    match c {
                        ControlFrame::Stdin(b) => stdin_before += b.len(),
                        ControlFrame::Signal(n) => return n,
                        other => panic!("unexpected {other:?}"),
                    }
                }
                let n = r.read(&mut buf).await.unwrap();
                assert!(n > 0, "the stream ended before the signal");
                d.push(&buf[..n]);
            }
        })
        .await
        .expect("the signal came");
        assert_eq!(signalled, libc::SIGTERM);
        assert!(
            stdin_before <= 2 * CHUNK,
            "{stdin_before} stdin bytes went before the signal"
        );
        let _ = end_tx.send(());
        tokio::time::timeout(BOUND, pump)
            .await
            .expect("the pump ended")
            .unwrap();
    }

    /// A supervisor that serves one run reads nothing after its report: the run's end is not
    /// held up by the stdin bytes still on their way to it.
    #[tokio::test]
    async fn the_runs_end_does_not_wait_for_stdin_nobody_reads() {
        let (tx, controls) = Controls::channel();
        // Nobody reads: the writes stop once the 8 KiB are full.
        let (w, _r) = tokio::io::duplex(8 * 1024);
        let (end_tx, end_rx) = oneshot::channel();
        let pump = tokio::spawn(async move {
            let mut input = boxed(w);
            pump_with_controls(&mut input, controls.take(), None, false, run_until(end_rx)).await
        });
        tx.send(Control::Stdin(vec![b'x'; 1 << 20])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = end_tx.send(());
        tokio::time::timeout(BOUND, pump)
            .await
            .expect("the pump ended with the run")
            .unwrap();
    }

    /// A supervisor that reads its stream on after the run (a kept sandbox's PID 1) finds whole
    /// control frames there: the frame being written at the run's end is finished, the rest of
    /// that stdin control dropped.
    #[tokio::test]
    async fn the_frame_in_flight_is_finished_for_a_stream_that_goes_on() {
        let (tx, controls) = Controls::channel();
        let (w, mut r) = tokio::io::duplex(8 * 1024);
        let (end_tx, end_rx) = oneshot::channel();
        let pump = tokio::spawn(async move {
            let mut input = boxed(w);
            pump_with_controls(&mut input, controls.take(), None, true, run_until(end_rx)).await;
            // The stream goes on after the run: the reader sees its end only now.
            drop(input);
        });
        tx.send(Control::Stdin(vec![b'x'; 1 << 20])).await.unwrap();
        // The run ends in the middle of the first frame.
        let mut got = vec![0u8; 10_000];
        r.read_exact(&mut got).await.unwrap();
        let _ = end_tx.send(());
        tokio::time::timeout(BOUND, r.read_to_end(&mut got))
            .await
            .expect("the pump ended")
            .unwrap();
        pump.await.unwrap();
        let (frames, whole) = decode(&got);
        assert!(whole, "a frame was cut short");
        let stdin: usize = frames
            .iter()
            .map(|f| match f {
                ControlFrame::Stdin(b) => b.len(),
                other => panic!("unexpected {other:?}"),
            })
            .sum();
        assert!(
            (10_000 - 5..1 << 20).contains(&stdin),
            "{stdin} stdin bytes"
        );
    }

    /// Each wire frame of a stdin control carries at most a chunk; together they carry it all.
    #[test]
    fn stdin_controls_are_cut_into_frames() {
        let data: Vec<u8> = (0..(CHUNK * 2 + 7)).map(|i| i as u8).collect();
        let frames = control_frames(Control::Stdin(data.clone()));
        assert_eq!(frames.len(), 3);
        let (decoded, whole) = decode(&frames.iter().flatten().copied().collect::<Vec<u8>>());
        assert!(whole);
        let joined: Vec<u8> = decoded
            .into_iter()
            .flat_map(|f| match f {
                ControlFrame::Stdin(b) => b,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(joined, data);
        assert_eq!(control_frames(Control::Stdin(Vec::new())).len(), 1);
    }
}
