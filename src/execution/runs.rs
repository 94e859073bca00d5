//! The runs of this daemon that have not finished: each one's owner, its stop control and, once
//! it has one, its answer. A run is found here from the moment it starts until its answer is in
//! the state store, so between the two a reader never misses it. Also a run's record in the
//! state store: where a run stands ([`Lookup`]), storing its final record, and the runs whose
//! record is finished without their caller's answer ([`Unanswered`], rendered by the api layer).
//!
//! Owns: which runs are live, who may see them (a run's owner, [`owner_of`]), and stopping them
//! (one run at a caller's request, or all of them at shutdown, through the same control). Must
//! not: know HTTP (a record's answer is made by the caller) or how a backend stops a run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use std::time::Duration;

use tokio::sync::watch;

use crate::sandbox::{Stop, StreamKind};
use crate::state::{IdemKey, StateError, StateStore, StoredExecution, StoredResponse};

/// One live run.
pub struct LiveRun {
    exec_id: String,
    /// The calling service's subject that started it: nobody else finds it.
    owner: String,
    backend: &'static str,
    profile: String,
    stop: watch::Sender<Option<Stop>>,
    /// Who cancelled it, and whether it ended: a cancel is taken only before the end.
    control: Mutex<Control>,
    /// What the run has written so far, for streams that follow it: all of it within its output
    /// caps, or (a background process) the last bytes of each stream.
    output: Mutex<[Output; 2]>,
    /// Bumped on every chunk of output and when the answer is set: wakes the streams.
    changed: watch::Sender<u64>,
    answer: watch::Sender<Option<Arc<StoredResponse>>>,
}

impl LiveRun {
    pub fn exec_id(&self) -> &str {
        &self.exec_id
    }

    pub fn backend(&self) -> &'static str {
        self.backend
    }

    pub fn profile(&self) -> &str {
        &self.profile
    }

    /// Appends a chunk the run wrote.
    pub fn push_output(&self, stream: StreamKind, chunk: &[u8]) {
        self.output.lock().unwrap_or_else(|p| p.into_inner())[stream as usize].push(chunk);
        self.changed.send_modify(|n| *n += 1);
    }

    /// At most `max` bytes of `stream` from `offset` on, or from the oldest byte still kept
    /// when `offset` is older, with the offset they begin at (empty when there are none yet).
    pub fn output_from(&self, stream: StreamKind, offset: usize, max: usize) -> (usize, Vec<u8>) {
        self.with_output(stream, |kept| {
            kept.from(offset)
                .map(|(at, rest)| (at, rest[..rest.len().min(max)].to_vec()))
                .unwrap_or((offset, Vec::new()))
        })
    }

    /// `f` of what is kept of `stream` so far (the output stays locked meanwhile: `f` only
    /// looks).
    pub fn with_output<R>(&self, stream: StreamKind, f: impl FnOnce(Kept<'_>) -> R) -> R {
        let out = self.output.lock().unwrap_or_else(|p| p.into_inner());
        f(out[stream as usize].kept())
    }

    /// Wakes when output arrives or the answer is set.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The run's answer, once it has one (all of its output is in by then).
    pub fn answered(&self) -> Option<Arc<StoredResponse>> {
        self.answer.borrow().clone()
    }

    /// The subject whose cancel was taken, if one was.
    pub fn cancelled_by(&self) -> Option<String> {
        self.control().cancelled_by.clone()
    }

    fn control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the run ended (its processes are gone): a cancel from now on finds it finished.
    pub(super) fn mark_ended(&self) {
        self.control().ended = true;
    }

    /// The stop the run was asked for, if any.
    pub fn stopping(&self) -> Option<Stop> {
        *self.stop.borrow()
    }

    /// Asks the run to stop; a run already asked keeps the first request (a repeated cancel
    /// changes nothing). Returns whether this call was the one that stopped it.
    fn request_stop(&self, stop: Stop) -> bool {
        self.stop.send_if_modified(|s| {
            if s.is_some() {
                return false;
            }
            *s = Some(stop);
            true
        })
    }

    /// Shortens the grace of a stop already requested to `grace` (its reason stays).
    fn shorten_stop(&self, grace: std::time::Duration) {
        self.stop.send_if_modified(|s| match s {
            Some(s) if s.grace > grace => {
                s.grace = grace;
                true
            }
            _ => false,
        });
    }

    /// Resolves with the run's answer once it has one.
    pub fn answer(&self) -> watch::Receiver<Option<Arc<StoredResponse>>> {
        self.answer.subscribe()
    }

    pub(super) fn set_answer(&self, answer: Arc<StoredResponse>) {
        self.answer.send_replace(Some(answer));
        self.changed.send_modify(|n| *n += 1);
    }
}

/// One stream of a live run's output: all of it, or with a ring size only the newest bytes.
///
/// A ring keeps between `ring` and twice `ring` bytes: it drops its oldest half at once when
/// full rather than moving every byte on every chunk.
struct Output {
    /// Bytes written before `bytes[0]` and no longer kept.
    dropped: usize,
    bytes: Vec<u8>,
    ring: Option<usize>,
}

impl Output {
    fn new(ring: Option<usize>) -> Self {
        Output {
            dropped: 0,
            bytes: Vec::new(),
            ring,
        }
    }

    fn push(&mut self, chunk: &[u8]) {
        let Some(ring) = self.ring else {
            self.bytes.extend_from_slice(chunk);
            return;
        };
        let ring = ring.max(1);
        if chunk.len() >= ring {
            // The chunk alone fills the ring: its last `ring` bytes are what is kept.
            self.dropped += self.bytes.len() + chunk.len() - ring;
            self.bytes.clear();
            self.bytes.extend_from_slice(&chunk[chunk.len() - ring..]);
            return;
        }
        if self.bytes.len() + chunk.len() > 2 * ring {
            let cut = self.bytes.len() + chunk.len() - ring;
            self.bytes.drain(..cut);
            self.dropped += cut;
        }
        self.bytes.extend_from_slice(chunk);
    }

    fn kept(&self) -> Kept<'_> {
        Kept {
            start: self.dropped,
            bytes: &self.bytes,
        }
    }
}

/// What is kept of one stream of a run: `bytes`, which begin at byte `start` of the stream
/// (0 unless older bytes were dropped from a background process's ring).
#[derive(Debug, Clone, Copy)]
pub struct Kept<'a> {
    pub start: usize,
    pub bytes: &'a [u8],
}

impl<'a> Kept<'a> {
    /// All of a stream, from its first byte.
    pub fn whole(bytes: &'a [u8]) -> Self {
        Kept { start: 0, bytes }
    }

    /// Where the stream has reached.
    pub fn end(&self) -> usize {
        self.start + self.bytes.len()
    }

    /// The kept bytes from `offset` on, with where they begin: `offset`, or the oldest kept
    /// byte when `offset` is older. None past the end.
    pub fn from(&self, offset: usize) -> Option<(usize, &'a [u8])> {
        let at = offset.max(self.start);
        self.bytes.get(at - self.start..).map(|rest| (at, rest))
    }
}

#[derive(Default)]
struct Control {
    cancelled_by: Option<String>,
    ended: bool,
}

/// Who a run about to start is.
pub struct NewRun {
    pub exec_id: String,
    pub owner: String,
    pub backend: &'static str,
    pub profile: String,
    /// A background process: keep only the last this many bytes of each stream for its readers
    /// (None: all of it, which its output cap bounds).
    pub ring: Option<usize>,
}

/// What a cancel found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// This call asked the run to stop.
    Stopping,
    /// The run had been asked to stop already (by this or another call).
    AlreadyStopping,
    /// The run had ended: nothing is stopped.
    Finished,
}

#[derive(Default)]
struct Inner {
    live: HashMap<String, Arc<LiveRun>>,
    /// Answered runs whose answer the state store did not take: this daemon keeps answering
    /// for them until the instant given (the retention their record would have had).
    kept: HashMap<String, (Arc<LiveRun>, Instant)>,
    /// Set at shutdown: a run registered from now on is stopped as it starts.
    closing: Option<Stop>,
}

/// The live runs of this daemon.
#[derive(Default)]
pub struct Runs {
    inner: Mutex<Inner>,
}

impl Runs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a run about to start, with the stop control its backend watches. When the
    /// daemon is shutting down it is stopped at once.
    pub(super) fn register(&self, new: NewRun, stop: watch::Sender<Option<Stop>>) -> Arc<LiveRun> {
        let exec_id = new.exec_id.clone();
        let run = Arc::new(LiveRun {
            exec_id: new.exec_id,
            owner: new.owner,
            backend: new.backend,
            profile: new.profile,
            stop,
            control: Mutex::new(Control::default()),
            output: Mutex::new([Output::new(new.ring), Output::new(new.ring)]),
            changed: watch::channel(0).0,
            answer: watch::channel(None).0,
        });
        let mut inner = self.lock();
        if let Some(stop) = inner.closing {
            run.request_stop(stop);
        }
        inner.live.insert(exec_id, run.clone());
        run
    }

    /// Forgets a run whose answer is stored.
    pub(super) fn remove(&self, exec_id: &str) {
        self.lock().live.remove(exec_id);
    }

    /// Moves an answered run whose answer could not be stored out of the live runs, keeping it
    /// findable (and its answer readable) until `until`.
    pub(super) fn keep_until(&self, exec_id: &str, until: Instant) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.kept.retain(|_, (_, expires)| *expires > now);
        if let Some(run) = inner.live.remove(exec_id) {
            inner.kept.insert(exec_id.to_string(), (run, until));
        }
    }

    /// The run `exec_id` of `owner`, live or kept; None for a run of anyone else.
    pub fn find(&self, owner: &str, exec_id: &str) -> Option<Arc<LiveRun>> {
        let inner = self.lock();
        let kept = inner
            .kept
            .get(exec_id)
            .filter(|(_, until)| *until > Instant::now())
            .map(|(run, _)| run);
        inner
            .live
            .get(exec_id)
            .or(kept)
            .filter(|r| r.owner == owner)
            .cloned()
    }

    /// Asks `run` to stop on behalf of `by`, unless it has ended.
    pub fn cancel(&self, run: &LiveRun, stop: Stop, by: &str) -> CancelOutcome {
        let mut control = run.control();
        if control.ended {
            CancelOutcome::Finished
        } else if run.request_stop(stop) {
            control.cancelled_by = Some(by.to_string());
            CancelOutcome::Stopping
        } else {
            CancelOutcome::AlreadyStopping
        }
    }

    /// Stops every live run, and every one registered from now on. A run already stopping
    /// with a longer grace (a caller's cancel) gets this one's: the shutdown's deadline holds.
    pub fn stop_all(&self, stop: Stop) {
        let mut inner = self.lock();
        inner.closing = Some(stop);
        for run in inner.live.values() {
            if !run.request_stop(stop) {
                run.shorten_stop(stop.grace);
            }
        }
    }

    /// How many runs are live.
    pub fn len(&self) -> usize {
        self.lock().live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A run whose record the execution layer finishes without the answer its caller made of its
/// result. The api layer says what each is answered with (see [`Render`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unanswered {
    /// Making the run's answer out of its result failed.
    AnswerFailed,
    /// The run finished, but its answer could not be stored and this daemon no longer keeps it.
    Lost,
    /// The daemon instance that ran it stopped during the run.
    DaemonStopped { instance: String },
}

/// Turns an [`Unanswered`] into the answer a run's record keeps: given by the api layer, which
/// alone knows what an answer looks like.
pub type Render = fn(&Unanswered) -> StoredResponse;

/// Where a run stands, as [`ExecutionService::lookup`](super::ExecutionService::lookup) finds
/// it.
pub enum Lookup {
    /// Running on this daemon.
    Live(Arc<LiveRun>),
    /// As the state store records it: finished (with its answer), or running on another replica.
    Stored(StoredExecution),
    /// No run of this caller's has that id (or its record expired).
    Unknown,
}

/// The owner of a run started by a caller with this subject (one without is `-`, like the
/// scope of its Idempotency-Keys).
pub fn owner_of(subject: Option<&str>) -> String {
    subject.unwrap_or(NO_OWNER).to_string()
}

/// The owner of a run whose service token has no subject.
pub const NO_OWNER: &str = "-";

/// Stores a finished run's record, trying again over a few seconds when the store fails: a
/// record left "running" would hide the answer from every other replica. Returns whether it
/// was stored.
pub(super) async fn put_final(
    store: &dyn StateStore,
    key: &IdemKey,
    record: &StoredExecution,
    retention: Duration,
    exec_id: &str,
) -> bool {
    const RETRIES: [Duration; 3] = [
        Duration::from_millis(200),
        Duration::from_secs(1),
        Duration::from_secs(3),
    ];
    for pause in std::iter::once(Duration::ZERO).chain(RETRIES) {
        tokio::time::sleep(pause).await;
        match store.execution_put(key, record, retention).await {
            Ok(()) => return true,
            Err(e) => tracing::warn!(exec_id, error = %e, "run record not stored"),
        }
    }
    tracing::error!(
        exec_id,
        "run record not stored; this daemon answers for the run until its retention ends"
    );
    false
}

pub(super) fn log_store_error(exec_id: &str, r: Result<(), StateError>) {
    if let Err(e) = r {
        tracing::error!(exec_id, error = %e, "run record not stored");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sandbox::KilledReason;

    fn new_run(exec_id: &str) -> NewRun {
        NewRun {
            exec_id: exec_id.into(),
            owner: "orbit".into(),
            backend: "local",
            profile: "python".into(),
            ring: None,
        }
    }

    fn cancel(grace: u64) -> Stop {
        Stop {
            reason: KilledReason::Cancelled,
            grace: Duration::from_secs(grace),
        }
    }

    #[test]
    fn only_the_owner_finds_a_run_and_the_first_stop_wins() {
        let runs = Runs::default();
        let (tx, rx) = watch::channel(None);
        runs.register(new_run("exec-1"), tx);
        assert!(runs.find("koder", "exec-1").is_none());
        assert!(runs.find("orbit", "exec-2").is_none());
        let run = runs.find("orbit", "exec-1").expect("the owner finds it");
        assert_eq!(
            runs.cancel(&run, cancel(5), "orbit"),
            CancelOutcome::Stopping
        );
        assert_eq!(
            runs.cancel(&run, cancel(1), "orbit"),
            CancelOutcome::AlreadyStopping
        );
        assert_eq!(*rx.borrow(), Some(cancel(5)));
        assert_eq!(run.cancelled_by().as_deref(), Some("orbit"));
        runs.remove("exec-1");
        assert!(runs.is_empty());
    }

    #[test]
    fn a_cancel_after_the_run_ended_is_refused_and_stops_nothing() {
        let runs = Runs::default();
        let (tx, rx) = watch::channel(None);
        let run = runs.register(new_run("exec-1"), tx);
        run.mark_ended();
        assert_eq!(
            runs.cancel(&run, cancel(5), "orbit"),
            CancelOutcome::Finished
        );
        assert_eq!(*rx.borrow(), None);
        assert_eq!(run.cancelled_by(), None);
    }

    #[test]
    fn a_kept_run_is_found_until_its_time_runs_out_and_is_not_live() {
        let runs = Runs::default();
        runs.register(new_run("exec-1"), watch::channel(None).0);
        runs.register(new_run("exec-2"), watch::channel(None).0);
        runs.keep_until("exec-1", Instant::now() + Duration::from_secs(60));
        runs.keep_until("exec-2", Instant::now());
        assert!(runs.is_empty(), "kept runs are not live");
        assert!(runs.find("orbit", "exec-1").is_some());
        assert!(runs.find("koder", "exec-1").is_none());
        assert!(runs.find("orbit", "exec-2").is_none(), "its time ran out");
    }

    #[test]
    fn output_is_read_from_any_offset_and_wakes_followers() {
        let runs = Runs::default();
        let run = runs.register(new_run("exec-1"), watch::channel(None).0);
        let mut changes = run.changes();
        run.push_output(StreamKind::Stdout, b"hello ");
        run.push_output(StreamKind::Stdout, b"world");
        run.push_output(StreamKind::Stderr, b"!");
        assert!(changes.has_changed().unwrap());
        let from = |stream, offset, max| run.output_from(stream, offset, max).1;
        assert_eq!(from(StreamKind::Stdout, 0, 100), b"hello world");
        assert_eq!(from(StreamKind::Stdout, 6, 3), b"wor");
        assert_eq!(from(StreamKind::Stdout, 11, 100), b"");
        assert_eq!(from(StreamKind::Stdout, 99, 100), b"");
        assert_eq!(from(StreamKind::Stderr, 0, 100), b"!");
        changes.mark_unchanged();
        run.set_answer(Arc::new(StoredResponse {
            status: 200,
            body: "{}".into(),
            receipt: None,
        }));
        assert!(changes.has_changed().unwrap());
        assert_eq!(run.answered().unwrap().status, 200);
    }

    #[test]
    fn a_background_process_keeps_the_newest_bytes_of_each_stream_within_twice_its_ring() {
        let runs = Runs::default();
        let run = runs.register(
            NewRun {
                ring: Some(8),
                ..new_run("exec-1")
            },
            watch::channel(None).0,
        );
        let mut written = Vec::new();
        for i in 0..100u8 {
            let chunk = [i; 3];
            run.push_output(StreamKind::Stdout, &chunk);
            written.extend_from_slice(&chunk);
            run.with_output(StreamKind::Stdout, |kept| {
                assert_eq!(
                    kept.end(),
                    written.len(),
                    "offsets stay those of the stream"
                );
                assert!(kept.bytes.len() <= 16, "{} bytes kept", kept.bytes.len());
                assert!(kept.bytes.len() >= 8.min(written.len()));
                assert_eq!(kept.bytes, &written[kept.start..]);
            });
        }
        // An offset older than what is kept reads from the oldest kept byte.
        let oldest = run.with_output(StreamKind::Stdout, |k| k.start);
        assert!(oldest > 0);
        assert_eq!(
            run.output_from(StreamKind::Stdout, 0, 4),
            (oldest, written[oldest..oldest + 4].to_vec())
        );
        assert_eq!(
            run.output_from(StreamKind::Stdout, 300, 4),
            (300, Vec::new())
        );
        // One chunk larger than the ring leaves its tail.
        run.push_output(StreamKind::Stderr, b"0123456789abcdef0123");
        run.with_output(StreamKind::Stderr, |kept| {
            assert_eq!((kept.start, kept.bytes), (12, &b"cdef0123"[..]));
        });
    }

    #[test]
    fn a_shutdown_stops_live_runs_and_those_that_start_after_it() {
        let runs = Runs::default();
        let (tx, before) = watch::channel(None);
        runs.register(new_run("exec-1"), tx);
        let shutdown = Stop {
            reason: KilledReason::Signal,
            grace: Duration::ZERO,
        };
        runs.stop_all(shutdown);
        assert_eq!(*before.borrow(), Some(shutdown));
        let (tx, after) = watch::channel(None);
        let late = runs.register(new_run("exec-2"), tx);
        assert_eq!(*after.borrow(), Some(shutdown));
        // A shutdown is nobody's cancel.
        assert_eq!(late.cancelled_by(), None);
    }
}
