//! What a caller sends a run while it runs: bytes for its stdin, the end of its stdin, a signal.
//!
//! A run whose [`super::RunSpec::controls`] is set keeps its stdin open after the spec's initial
//! `stdin` bytes: each [`Control::Stdin`] is written to it in order, [`Control::CloseStdin`] (or
//! every sender gone) closes it. [`Control::Signal`] goes to the command's process; `KILL` ends
//! every process of the run. Backends: local writes the run's stdin pipe and signals its pid 1;
//! docker and gVisor pass them to the container's supervisor as frames of the run's request.
//!
//! Owns: the control channel's types. Must not: decide who may send them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::ports::NetnsSlot;

/// How many controls may wait for the run to take them; a sender past it waits.
pub const CONTROL_QUEUE: usize = 64;

/// How many stdin bytes may wait for the run to take them; a sender past it waits. The daemon
/// holds no more than this (and what the run itself buffers) for a command that does not read.
pub const STDIN_WAITING_BYTES: usize = 4 << 20;

/// One control of a live run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Bytes for the command's stdin.
    Stdin(Vec<u8>),
    /// The end of the command's stdin.
    CloseStdin,
    /// A signal for the command's process.
    Signal(ProcessSignal),
}

/// The signals a caller may send a live process.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
    schemars::JsonSchema,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum ProcessSignal {
    Term,
    Kill,
    Int,
    Hup,
}

impl ProcessSignal {
    /// The signal's number on Linux.
    pub fn number(self) -> i32 {
        match self {
            ProcessSignal::Term => libc::SIGTERM,
            ProcessSignal::Kill => libc::SIGKILL,
            ProcessSignal::Int => libc::SIGINT,
            ProcessSignal::Hup => libc::SIGHUP,
        }
    }

    /// The signal a number names, among those a caller may send.
    pub fn from_number(n: i32) -> Option<ProcessSignal> {
        [
            ProcessSignal::Term,
            ProcessSignal::Kill,
            ProcessSignal::Int,
            ProcessSignal::Hup,
        ]
        .into_iter()
        .find(|s| s.number() == n)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProcessSignal::Term => "TERM",
            ProcessSignal::Kill => "KILL",
            ProcessSignal::Int => "INT",
            ProcessSignal::Hup => "HUP",
        }
    }
}

/// How many signals may wait for the run to take them; a sender past it waits. Signals have a
/// queue of their own: bytes a command does not read never hold one back.
pub const SIGNAL_QUEUE: usize = 8;

/// The caller's end of a run's controls.
#[derive(Debug, Clone)]
pub struct ControlSender {
    inputs: mpsc::Sender<Input>,
    signals: mpsc::Sender<ProcessSignal>,
    /// Room for stdin bytes on their way to the run ([`STDIN_WAITING_BYTES`]).
    room: Arc<Semaphore>,
    /// Set once [`Control::CloseStdin`] was sent: later stdin bytes are refused.
    stdin_closed: Arc<AtomicBool>,
    /// Where the run publishes its network namespace (local runs), for its session's ports.
    netns: NetnsSlot,
}

/// A stdin control on its way to the run, with the room its bytes take until the run takes them.
#[derive(Debug)]
pub struct Input {
    control: Control,
    _room: Option<OwnedSemaphorePermit>,
}

impl Input {
    /// The control; the room its bytes took is given back.
    pub fn into_control(self) -> Control {
        self.control
    }
}

/// Why a control was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The run has taken no more controls since it ended.
    #[error("the run takes no more controls")]
    RunEnded,
    /// Stdin bytes after [`Control::CloseStdin`]: they would reach nothing.
    #[error("the command's stdin is closed")]
    StdinClosed,
}

impl ControlSender {
    /// The run's network namespace once a local run published it (see [`Controls::netns`]).
    pub fn netns(&self) -> &NetnsSlot {
        &self.netns
    }

    /// Queues `control` for the run: stdin bytes and its end in order with each other, a signal
    /// on its own queue. Waits while that queue is full (for stdin: [`CONTROL_QUEUE`] controls
    /// or [`STDIN_WAITING_BYTES`] bytes).
    pub async fn send(&self, control: Control) -> Result<(), Refused> {
        match control {
            Control::Signal(sig) => self.signals.send(sig).await.map_err(|_| Refused::RunEnded),
            Control::Stdin(_) if self.stdin_closed.load(Ordering::SeqCst) => {
                Err(Refused::StdinClosed)
            }
            Control::Stdin(data) => {
                // A run that ended drops what waited for it, which gives its room back.
                let n = data.len().min(STDIN_WAITING_BYTES) as u32;
                let room = self.room.clone().acquire_many_owned(n).await.ok();
                let input = Input {
                    control: Control::Stdin(data),
                    _room: room,
                };
                self.inputs.send(input).await.map_err(|_| Refused::RunEnded)
            }
            other => {
                if other == Control::CloseStdin {
                    self.stdin_closed.store(true, Ordering::SeqCst);
                }
                let input = Input {
                    control: other,
                    _room: None,
                };
                self.inputs.send(input).await.map_err(|_| Refused::RunEnded)
            }
        }
    }
}

/// What a run receives: its stdin's controls ([`Control::Stdin`], [`Control::CloseStdin`]) in
/// order, and signals apart, so that a command that reads nothing can still be signalled. Both
/// close when the [`ControlSender`] is gone.
#[derive(Debug)]
pub struct ControlReceiver {
    pub inputs: mpsc::Receiver<Input>,
    pub signals: mpsc::Receiver<ProcessSignal>,
}

impl ControlReceiver {
    /// The next control, signals first: one waiting is never held behind stdin. None once both
    /// queues are closed (the sender is gone) and empty.
    pub async fn recv(&mut self) -> Option<Control> {
        let mut signals_open = true;
        loop {
            tokio::select! {
                biased;
                s = self.signals.recv(), if signals_open => match s {
                    Some(s) => return Some(Control::Signal(s)),
                    None => signals_open = false,
                },
                i = self.inputs.recv() => {
                    return match i {
                        Some(i) => Some(i.into_control()),
                        // The inputs closed: what signals are left still come.
                        None if signals_open => self.signals.recv().await.map(Control::Signal),
                        None => None,
                    };
                }
            }
        }
    }
}

/// The receiving end of a run's controls. A [`super::RunSpec`] is cloned on its way to a
/// backend, so the receiver sits behind a shared slot; the one run that takes it owns it.
#[derive(Debug, Clone)]
pub struct Controls {
    rx: Arc<Mutex<Option<ControlReceiver>>>,
    netns: NetnsSlot,
}

impl Controls {
    /// A control channel: the sender for the caller, the receiving end for the run's spec.
    pub fn channel() -> (ControlSender, Controls) {
        let (inputs_tx, inputs) = mpsc::channel(CONTROL_QUEUE);
        let (signals_tx, signals) = mpsc::channel(SIGNAL_QUEUE);
        let netns = NetnsSlot::default();
        let tx = ControlSender {
            inputs: inputs_tx,
            signals: signals_tx,
            room: Arc::new(Semaphore::new(STDIN_WAITING_BYTES)),
            stdin_closed: Arc::new(AtomicBool::new(false)),
            netns: netns.clone(),
        };
        let rx = Arc::new(Mutex::new(Some(ControlReceiver { inputs, signals })));
        (tx, Controls { rx, netns })
    }

    /// The receiver, for the run that takes it (None once taken).
    pub fn take(&self) -> Option<ControlReceiver> {
        self.rx.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Where a local run publishes its network namespace once it started, so that its session
    /// reaches the ports its processes listen on (see [`super::ports`]).
    pub fn netns(&self) -> &NetnsSlot {
        &self.netns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_round_trip_and_only_the_offered_ones_exist() {
        for s in [
            ProcessSignal::Term,
            ProcessSignal::Kill,
            ProcessSignal::Int,
            ProcessSignal::Hup,
        ] {
            assert_eq!(ProcessSignal::from_number(s.number()), Some(s));
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
        }
        assert_eq!(ProcessSignal::from_number(libc::SIGSTOP), None);
        assert!(serde_json::from_str::<ProcessSignal>("\"STOP\"").is_err());
    }

    #[tokio::test]
    async fn the_receiver_is_taken_once() {
        let (tx, controls) = Controls::channel();
        let copy = controls.clone();
        let mut rx = copy.take().expect("first take");
        assert!(controls.take().is_none());
        tx.send(Control::CloseStdin).await.unwrap();
        let got = rx.inputs.recv().await.map(Input::into_control);
        assert_eq!(got, Some(Control::CloseStdin));
        let late = tx.send(Control::Stdin(b"late".to_vec())).await;
        assert_eq!(late, Err(Refused::StdinClosed));
    }

    /// A full stdin queue does not hold a signal back: it has a queue of its own.
    #[tokio::test]
    async fn signals_pass_a_full_stdin_queue() {
        let (tx, controls) = Controls::channel();
        let mut rx = controls.take().expect("receiver");
        for _ in 0..CONTROL_QUEUE {
            tx.send(Control::Stdin(vec![b'x'])).await.unwrap();
        }
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            tx.send(Control::Signal(ProcessSignal::Term)),
        )
        .await
        .expect("a signal waits behind no stdin")
        .unwrap();
        assert_eq!(rx.signals.recv().await, Some(ProcessSignal::Term));
        drop(tx);
        assert_eq!(rx.signals.recv().await, None);
        let got = rx.inputs.recv().await.map(Input::into_control);
        assert_eq!(got, Some(Control::Stdin(vec![b'x'])));
    }

    /// Stdin bytes the run has not taken are bounded in bytes: a sender past them waits until
    /// the run takes some, and a run that ended gives their room back.
    #[tokio::test]
    async fn waiting_stdin_is_bounded_in_bytes() {
        let (tx, controls) = Controls::channel();
        let mut rx = controls.take().expect("receiver");
        let mib = vec![b'x'; 1 << 20];
        for _ in 0..STDIN_WAITING_BYTES >> 20 {
            tx.send(Control::Stdin(mib.clone())).await.unwrap();
        }
        let short = std::time::Duration::from_millis(200);
        let more = tx.send(Control::Stdin(mib.clone()));
        assert!(tokio::time::timeout(short, more).await.is_err(), "no room");
        let got = rx.inputs.recv().await.map(Input::into_control);
        assert_eq!(got, Some(Control::Stdin(mib.clone())));
        tx.send(Control::Stdin(mib.clone())).await.unwrap();
        let waiting = {
            let tx = tx.clone();
            let mib = mib.clone();
            tokio::spawn(async move { tx.send(Control::Stdin(mib)).await })
        };
        drop(rx);
        let sent = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("a run that ended frees the waiting sender")
            .unwrap();
        assert_eq!(sent, Err(Refused::RunEnded));
    }
}
