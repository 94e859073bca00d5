//! Connections into sessions' sandboxes kept open between proxied requests, per (session, port).
//!
//! Opening a connection into a sandbox costs a namespace entry (local, runc) or an engine exec
//! (gVisor), and the server inside pays its own accept; a request that finds a kept connection
//! of the same session and port pays neither. A connection goes back once its answer's body has
//! been read to the end (HTTP/1.1 carries one exchange at a time); one whose body was dropped
//! early is not kept, nor one that carried an upgrade, a request body or a HEAD (see the route).
//! Kept connections are few per port, per session and in all, and closed after a short idle time
//! (a sweep looks every half of it), so a session's server holds no more open connections than it
//! would for a browser.
//!
//! Written by hand: hyper-util's pooled client picks its connection by URI authority and opens
//! it through a connector that is given a URI alone, while a connection here is opened by the
//! sessions service from the session the route has already checked the caller against.
//!
//! Owns: keeping, handing out and expiring those connections. Must not: open them, or decide
//! who may use a session's port (the route checks the caller before it asks here).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;

/// Kept connections per (session, port) at most.
const MAX_IDLE_PER_PORT: usize = 4;
/// Kept connections per session at most, all its ports together.
const MAX_IDLE_PER_SESSION: usize = 16;
/// Kept connections at most, every session together (each holds a descriptor of the daemon's,
/// and on gVisor an engine exec).
const MAX_IDLE: usize = 256;
/// A kept connection unused this long is closed: shorter than the idle timeouts common servers
/// keep (5 s), so the proxy seldom sends on a connection the server is closing.
const IDLE_FOR: Duration = Duration::from_secs(4);

type Key = (String, u16);

/// The kept connections of every session's ports.
#[derive(Default)]
pub struct PortPool {
    idle: Mutex<HashMap<Key, Vec<Idle>>>,
}

impl PortPool {
    /// A pool whose connections idle past [`IDLE_FOR`] are closed within half of it again,
    /// whether or not the port is asked for again (needs a runtime; the task ends with the pool).
    pub fn start() -> Arc<Self> {
        let pool = Arc::new(PortPool::default());
        let weak = Arc::downgrade(&pool);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(IDLE_FOR / 2);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(pool) = weak.upgrade() else {
                    return;
                };
                pool.sweep();
            }
        });
        pool
    }

    /// Closes every kept connection that expired or whose server closed it.
    fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.retain(|_, kept| {
            kept.retain(Idle::usable);
            !kept.is_empty()
        });
    }
}

struct Idle {
    sender: SendRequest<Body>,
    since: Instant,
}

impl Idle {
    fn usable(&self) -> bool {
        !self.sender.is_closed() && self.since.elapsed() < IDLE_FOR
    }
}

impl PortPool {
    /// A kept connection to `port` of `session` that can take a request now.
    pub fn take(&self, session: &str, port: u16) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let key = (session.to_string(), port);
        let kept = idle.get_mut(&key)?;
        kept.retain(Idle::usable);
        let found = kept
            .iter()
            .rposition(|i| i.sender.is_ready())
            .map(|at| kept.swap_remove(at).sender);
        if kept.is_empty() {
            idle.remove(&key);
        }
        found
    }

    /// Keeps `sender` for the next request to `port` of `session`, unless enough are kept.
    fn give_back(&self, session: String, port: u16, sender: SendRequest<Body>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let (mut all, mut of_session) = (0, 0);
        for ((s, _), kept) in idle.iter() {
            all += kept.len();
            if *s == session {
                of_session += kept.len();
            }
        }
        if all >= MAX_IDLE || of_session >= MAX_IDLE_PER_SESSION {
            return;
        }
        let kept = idle.entry((session, port)).or_default();
        kept.retain(Idle::usable);
        if kept.len() < MAX_IDLE_PER_PORT {
            kept.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    /// The answer's body, which gives `sender` back to the pool once it has been read to its
    /// end (dropped earlier, the connection is not kept).
    pub fn body_returning(
        self: &Arc<Self>,
        body: Incoming,
        session: &str,
        port: u16,
        sender: SendRequest<Body>,
    ) -> Body {
        // An empty answer (a HEAD's, a 204's) is never polled to its end: its connection is
        // free already.
        if body.is_end_stream() {
            self.give_back(session.to_string(), port, sender);
            return Body::new(body);
        }
        Body::new(Returning {
            body,
            back: Some((self.clone(), session.to_string(), port, sender)),
        })
    }
}

/// A proxied answer's body that gives its connection back at its end.
struct Returning {
    body: Incoming,
    back: Option<(Arc<PortPool>, String, u16, SendRequest<Body>)>,
}

impl Returning {
    fn give_back(&mut self) {
        if let Some((pool, session, port, sender)) = self.back.take() {
            pool.give_back(session, port, sender);
        }
    }
}

impl HttpBody for Returning {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        // The end: no more frames, or (a body of known length) its last byte, after which the
        // server that sends it on may never poll again.
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.body.is_end_stream(),
            _ => false,
        };
        if ended {
            self.give_back();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
