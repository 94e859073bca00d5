//! The skeleton of a run that every backend shares; each backend keeps only its mechanism.
//!
//! A backend's `run` goes: refuse what it cannot serve ([`egress_for`]), set its sandbox up, start
//! the output readers ([`OutputCapture`]), wait for the run to end or for a reason to stop it
//! ([`wait`]: a stop with its grace, wall clock, output cap), kill it its own way, drain the output, close the
//! egress proxy ([`connections`]), read how it ended, and put the outcome together
//! ([`RunOutcome::assemble`]).
//!
//! Owns: the order of the limits' checks and what an outcome is made of. Must not: touch a
//! process, cgroup or container (the backend does).

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use super::capture::{Captured, OutputCapture};
use super::{ExitKind, KilledReason, NetworkPolicy, RunOutcome, SandboxError, Stop};
use crate::egress::{ConnRecord, ProxyRun};

/// The backend's egress settings for a run: none when the run has no network; an egress run on a
/// backend without egress is refused before anything starts (never given open network).
pub fn egress_for<'a, E>(
    network: &NetworkPolicy,
    settings: Option<&'a E>,
) -> Result<Option<&'a E>, SandboxError> {
    match (network, settings) {
        (NetworkPolicy::None, _) => Ok(None),
        (NetworkPolicy::Egress { .. }, Some(s)) => Ok(Some(s)),
        (NetworkPolicy::Egress { .. }, None) => {
            Err(SandboxError::Unavailable("egress not configured".into()))
        }
    }
}

/// What ended the wait for a run.
#[derive(Debug)]
pub enum Waited<T> {
    /// The run's own end, as the backend's mechanism reports it.
    Ended(T),
    /// The run was stopped, and ended within its grace after SIGTERM.
    EndedOnStop(T, KilledReason),
    /// The daemon must kill the run, for this reason.
    Kill(KilledReason),
}

/// Waits for `ended` (the backend's "the run is over") unless, first, the wall clock `timeout`
/// passes or a stream goes past its output cap under `on_overflow = "kill"` (kill), or `stop` is
/// raised. A stop with a grace calls `terminate` (the backend's SIGTERM to every process of the
/// run) and gives the run that long to end before it is killed, never past `timeout`: the wall
/// clock limit holds whatever grace a stop asks for.
pub async fn wait<F, T>(
    ended: &mut F,
    timeout: Duration,
    stop: Option<&watch::Receiver<Option<Stop>>>,
    output: &mut OutputCapture,
    terminate: impl FnOnce() -> T,
) -> Waited<F::Output>
where
    F: Future + Unpin,
    T: Future<Output = ()>,
{
    let timeout_at = tokio::time::Instant::now() + timeout;
    let mut stop_rx = stop.cloned();
    let stopped = async {
        match stop_rx.as_mut() {
            Some(flag) => requested(flag).await,
            None => std::future::pending().await,
        }
    };
    let stop = tokio::select! {
        r = &mut *ended => return Waited::Ended(r),
        s = stopped => s,
        _ = tokio::time::sleep_until(timeout_at) => return Waited::Kill(KilledReason::Timeout),
        _ = output.overflowed() => return Waited::Kill(KilledReason::OutputLimit),
    };
    if stop.grace.is_zero() {
        return Waited::Kill(stop.reason);
    }
    terminate().await;
    // A later stop with a shorter grace (the shutdown's kill of a run that a caller cancelled
    // with a long one) shortens what is left of it.
    let mut deadline = timeout_at.min(tokio::time::Instant::now() + stop.grace);
    let mut later = stop_rx;
    loop {
        let shortened = async {
            match later.as_mut() {
                Some(flag) => match flag.changed().await {
                    Ok(()) => *flag.borrow_and_update(),
                    Err(_) => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut *ended => return Waited::EndedOnStop(r, stop.reason),
            _ = tokio::time::sleep_until(deadline) => return Waited::Kill(stop.reason),
            s = shortened => {
                if let Some(s) = s {
                    deadline = deadline.min(tokio::time::Instant::now() + s.grace);
                }
            }
        }
    }
}

/// Resolves with the stop once one is requested; never when its sender is gone without one.
async fn requested(flag: &mut watch::Receiver<Option<Stop>>) -> Stop {
    let requested = flag.wait_for(Option::is_some).await.ok().and_then(|s| *s);
    match requested {
        Some(stop) => stop,
        None => std::future::pending().await,
    }
}

/// Every connection the run's egress proxy saw, once it is closed (none without egress).
pub async fn connections(proxy: Option<ProxyRun>) -> Vec<ConnRecord> {
    match proxy {
        Some(p) => p.finish().await,
        None => Vec::new(),
    }
}

/// How a run ended, as its backend read it.
#[derive(Debug, Clone, Copy)]
pub struct Ending {
    pub exit: ExitKind,
    /// Why the daemon killed the run, if it did.
    pub killed: Option<KilledReason>,
    pub oom: bool,
    /// How often the pids limit refused a fork.
    pub pids_max_hits: u64,
    pub peak_memory_kib: Option<u64>,
    pub stdin_broken_pipe: bool,
}

impl RunOutcome {
    /// The outcome of a run from how it ended, its drained output, its wall time and its egress
    /// connections.
    pub fn assemble(
        ending: Ending,
        (stdout, stderr): (Captured, Captured),
        duration: Duration,
        network: Vec<ConnRecord>,
    ) -> RunOutcome {
        RunOutcome {
            exit: ending.exit,
            stdout: stdout.bytes,
            stderr: stderr.bytes,
            stdout_truncated: stdout.truncated,
            stderr_truncated: stderr.truncated,
            duration,
            peak_memory_kib: ending.peak_memory_kib,
            oom: ending.oom,
            killed_reason: KilledReason::resolve(
                ending.killed,
                ending.exit,
                ending.oom,
                ending.pids_max_hits,
            ),
            stdin_broken_pipe: ending.stdin_broken_pipe,
            network,
            container: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::OnOverflow;

    /// Readers capped at 4 bytes that kill the run on overflow.
    fn capture() -> (
        OutputCapture,
        tokio::io::DuplexStream,
        tokio::io::DuplexStream,
    ) {
        capture_with(OnOverflow::Kill)
    }

    fn capture_with(
        on_overflow: OnOverflow,
    ) -> (
        OutputCapture,
        tokio::io::DuplexStream,
        tokio::io::DuplexStream,
    ) {
        let (out_w, out_r) = tokio::io::duplex(1024);
        let (err_w, err_r) = tokio::io::duplex(1024);
        (
            OutputCapture::start(out_r, err_r, 4, on_overflow, None),
            out_w,
            err_w,
        )
    }

    /// [`wait`] on `f`, with a terminate that does nothing.
    async fn wait_on<F: Future>(
        f: F,
        timeout: Duration,
        stop: Option<&watch::Receiver<Option<Stop>>>,
        output: &mut OutputCapture,
    ) -> Waited<F::Output> {
        let mut f = std::pin::pin!(f);
        wait(&mut f, timeout, stop, output, || async {}).await
    }

    fn stop(reason: KilledReason, grace: Duration) -> watch::Receiver<Option<Stop>> {
        watch::channel(Some(Stop { reason, grace })).1
    }

    #[tokio::test]
    async fn the_first_reason_to_stop_wins() {
        use tokio::io::AsyncWriteExt;
        let long = Duration::from_secs(3600);

        let (mut output, _o, _e) = capture();
        let w = wait_on(async { 7 }, long, None, &mut output).await;
        assert!(matches!(w, Waited::Ended(7)), "{w:?}");

        let (mut output, _o, _e) = capture();
        let rx = stop(KilledReason::Signal, Duration::ZERO);
        let w = wait_on(std::future::pending::<()>(), long, Some(&rx), &mut output).await;
        assert!(matches!(w, Waited::Kill(KilledReason::Signal)), "{w:?}");

        let (mut output, _o, _e) = capture();
        let w = wait_on(
            std::future::pending::<()>(),
            Duration::ZERO,
            None,
            &mut output,
        )
        .await;
        assert!(matches!(w, Waited::Kill(KilledReason::Timeout)), "{w:?}");

        let (mut output, _o, mut err_w) = capture();
        err_w.write_all(b"past the cap").await.unwrap();
        let w = wait_on(std::future::pending::<()>(), long, None, &mut output).await;
        assert!(
            matches!(w, Waited::Kill(KilledReason::OutputLimit)),
            "{w:?}"
        );
        drop(err_w);
        let (stdout, stderr) = output.drain().await;
        assert!(!stdout.truncated && stdout.bytes.is_empty());
        assert!(stderr.truncated);
        assert_eq!(stderr.bytes, b"past");
    }

    /// A stop with a grace terminates the run first: a run that ends within the grace ended on
    /// the stop; one that does not is killed when the grace is over.
    #[tokio::test]
    async fn a_stop_with_a_grace_terminates_then_kills() {
        let long = Duration::from_secs(3600);
        let grace = Duration::from_millis(100);
        let rx = stop(KilledReason::Cancelled, grace);

        // The run ends once it is told to.
        let (mut output, _o, _e) = capture();
        let (told_tx, told_rx) = tokio::sync::oneshot::channel::<()>();
        let mut ended = std::pin::pin!(async move { told_rx.await.map(|_| 15) });
        let w = wait(&mut ended, long, Some(&rx), &mut output, || async move {
            let _ = told_tx.send(());
        })
        .await;
        assert!(
            matches!(w, Waited::EndedOnStop(Ok(15), KilledReason::Cancelled)),
            "{w:?}"
        );

        // The run ignores it.
        let (mut output, _o, _e) = capture();
        let terminated = std::sync::atomic::AtomicBool::new(false);
        let mut ended = std::pin::pin!(std::future::pending::<()>());
        let w = wait(&mut ended, long, Some(&rx), &mut output, || async {
            terminated.store(true, std::sync::atomic::Ordering::SeqCst);
        })
        .await;
        assert!(matches!(w, Waited::Kill(KilledReason::Cancelled)), "{w:?}");
        assert!(terminated.load(std::sync::atomic::Ordering::SeqCst));
    }

    /// A stop with a shorter grace that comes while a run is in the grace of an earlier one (the
    /// shutdown's kill of a run cancelled with a long grace) ends it by the shorter deadline.
    #[tokio::test]
    async fn a_later_shorter_stop_cuts_the_grace_short() {
        let (tx, rx) = watch::channel(Some(Stop {
            reason: KilledReason::Cancelled,
            grace: Duration::from_secs(3600),
        }));
        let (mut output, _o, _e) = capture();
        let mut ended = std::pin::pin!(std::future::pending::<()>());
        let w = tokio::time::timeout(
            Duration::from_secs(10),
            wait(
                &mut ended,
                Duration::from_secs(3600),
                Some(&rx),
                &mut output,
                || async {
                    tx.send_modify(|s| s.as_mut().unwrap().grace = Duration::ZERO);
                },
            ),
        )
        .await
        .expect("the shorter grace was not honoured");
        assert!(matches!(w, Waited::Kill(KilledReason::Cancelled)), "{w:?}");
    }

    /// A stop's grace ends at the run's wall clock limit: a cancel just before the timeout does
    /// not lengthen the run by its grace.
    #[tokio::test]
    async fn a_grace_never_runs_past_the_timeout() {
        let rx = stop(KilledReason::Cancelled, Duration::from_secs(3600));
        let (mut output, _o, _e) = capture();
        let mut ended = std::pin::pin!(std::future::pending::<()>());
        let w = tokio::time::timeout(
            Duration::from_secs(10),
            wait(
                &mut ended,
                Duration::from_millis(200),
                Some(&rx),
                &mut output,
                || async {},
            ),
        )
        .await
        .expect("the grace ran past the timeout");
        assert!(matches!(w, Waited::Kill(KilledReason::Cancelled)), "{w:?}");
    }

    /// Under `truncate` a stream past its cap is cut and flagged, everything after the cap is
    /// read (the writer never blocks, however much it writes), and the run goes on to its end.
    #[tokio::test]
    async fn truncated_output_does_not_stop_the_run() {
        use tokio::io::AsyncWriteExt;
        let (mut output, mut out_w, err_w) = capture_with(OnOverflow::Truncate);
        let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
        let writer = tokio::spawn(async move {
            // Far more than the duplex buffer holds: only a reader that keeps draining lets
            // these writes finish.
            for _ in 0..256 {
                out_w.write_all(&[b'x'; 4096]).await.unwrap();
            }
            drop(out_w);
            drop(err_w);
            let _ = ended_tx.send(());
        });
        let w = wait_on(ended_rx, Duration::from_secs(3600), None, &mut output).await;
        assert!(matches!(w, Waited::Ended(Ok(()))), "{w:?}");
        writer.await.unwrap();
        let (stdout, stderr) = output.drain().await;
        assert_eq!(
            (stdout.bytes.as_slice(), stdout.truncated),
            (&b"xxxx"[..], true)
        );
        assert!(!stderr.truncated && stderr.bytes.is_empty());
    }

    #[tokio::test]
    async fn a_stop_flag_whose_sender_is_gone_never_fires() {
        let (mut output, _o, _e) = capture();
        let (tx, rx) = watch::channel(None);
        drop(tx);
        let w = wait_on(
            async { 1 },
            Duration::from_secs(3600),
            Some(&rx),
            &mut output,
        )
        .await;
        assert!(matches!(w, Waited::Ended(1)), "{w:?}");
    }

    #[test]
    fn egress_needs_the_backends_settings() {
        let egress = NetworkPolicy::Egress {
            allow_hosts: vec![],
            allow_ports: vec![443],
            allow_cidrs: vec![],
            bandwidth_bytes_per_sec: 0,
            byte_cap: 0,
            tcp: vec![],
        };
        assert!(matches!(
            egress_for(&NetworkPolicy::None, Some(&1)),
            Ok(None)
        ));
        assert!(matches!(
            egress_for::<u8>(&NetworkPolicy::None, None),
            Ok(None)
        ));
        assert!(matches!(egress_for(&egress, Some(&1)), Ok(Some(1))));
        assert!(matches!(
            egress_for::<u8>(&egress, None),
            Err(SandboxError::Unavailable(_))
        ));
    }

    #[test]
    fn the_outcome_resolves_why_the_run_ended() {
        let ending = Ending {
            exit: ExitKind::Exited(1),
            killed: None,
            oom: false,
            pids_max_hits: 3,
            peak_memory_kib: Some(10),
            stdin_broken_pipe: true,
        };
        let out = Captured {
            bytes: b"out".to_vec(),
            truncated: true,
        };
        let o = RunOutcome::assemble(
            ending,
            (out, Captured::default()),
            Duration::from_millis(5),
            vec![],
        );
        assert_eq!(o.killed_reason, Some(KilledReason::Pids));
        assert_eq!(
            (o.stdout.as_slice(), o.stdout_truncated),
            (&b"out"[..], true)
        );
        assert_eq!((o.stderr.len(), o.stderr_truncated), (0, false));
        assert!(o.stdin_broken_pipe);
        assert_eq!(o.peak_memory_kib, Some(10));
        let killed = RunOutcome::assemble(
            Ending {
                killed: Some(KilledReason::Timeout),
                ..ending
            },
            Default::default(),
            Duration::ZERO,
            vec![],
        );
        assert_eq!(killed.killed_reason, Some(KilledReason::Timeout));
    }
}
