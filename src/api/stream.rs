//! A run as Server-Sent Events: `start`, then its output as it is written (`stdout` / `stderr`
//! events with the byte offset of each chunk in its stream), then `result` with exactly the body
//! its synchronous call returns plus `http_status`; comment heartbeats while it is quiet.
//!
//! An event's `id` is the position reached in both streams after it (`<stdout bytes>.<stderr
//! bytes>`), so `Last-Event-ID` resumes from there without loss or repetition, whether the run
//! is still live or finished (its output is then taken from its stored result). Output the run
//! wrote beyond its caps is in no event, as in no result.
//!
//! Owns: the events' wire format and following one run. Must not: start, stop or record runs.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::Stream;
use serde_json::{Value, json};

use super::AppState;
use super::error::ApiError;
use crate::execution::runs::LiveRun;
use crate::sandbox::StreamKind;
use crate::state::StoredResponse;

/// Heartbeat comments while a run writes nothing.
const HEARTBEAT: Duration = Duration::from_secs(15);
/// The most output one event carries.
const MAX_CHUNK: usize = 64 * 1024;
/// The grace a run gets when its caller goes away and asked for that to cancel it.
pub const DISCONNECT_GRACE: Duration = Duration::from_secs(5);

/// Where a stream's events come from.
pub enum Source {
    /// A run of this daemon that has not finished.
    Live(Arc<LiveRun>),
    /// A finished run, from its stored answer.
    Finished {
        exec_id: String,
        output: [Vec<u8>; 2],
        answer: Arc<StoredResponse>,
    },
}

impl Source {
    /// A finished run's source: its output is the result's `stdout` / `stderr` (their base64
    /// form when the bytes were not UTF-8).
    pub fn finished(exec_id: &str, answer: StoredResponse) -> Source {
        let result: Value = serde_json::from_str(&answer.body).unwrap_or(Value::Null);
        let stream = |text: &str, b64: &str| -> Vec<u8> {
            match result[b64].as_str() {
                Some(b) => base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .unwrap_or_default(),
                None => result[text]
                    .as_str()
                    .unwrap_or_default()
                    .as_bytes()
                    .to_vec(),
            }
        };
        Source::Finished {
            exec_id: exec_id.to_string(),
            output: [
                stream("stdout", "stdout_b64"),
                stream("stderr", "stderr_b64"),
            ],
            answer: Arc::new(answer),
        }
    }

    fn output_from(&self, stream: StreamKind, offset: usize) -> Vec<u8> {
        match self {
            Source::Live(live) => live.output_from(stream, offset, MAX_CHUNK),
            Source::Finished { output, .. } => output[stream as usize]
                .get(offset..)
                .map(|rest| rest[..rest.len().min(MAX_CHUNK)].to_vec())
                .unwrap_or_default(),
        }
    }

    /// The answer, once the run has one: all of its output is in by then.
    fn answered(&self) -> Option<Arc<StoredResponse>> {
        match self {
            Source::Live(live) => live.answered(),
            Source::Finished { answer, .. } => Some(answer.clone()),
        }
    }

    fn start_event(&self) -> Value {
        match self {
            Source::Live(live) => json!({
                "exec_id": live.exec_id(),
                "backend": live.backend(),
                "profile": live.profile(),
            }),
            Source::Finished {
                exec_id, answer, ..
            } => {
                let result: Value = serde_json::from_str(&answer.body).unwrap_or(Value::Null);
                json!({
                    "exec_id": exec_id,
                    "backend": result["backend"],
                    "profile": result["profile"],
                })
            }
        }
    }
}

/// Positions reached in stdout and stderr.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Position {
    pub stdout: usize,
    pub stderr: usize,
}

impl Position {
    /// A `Last-Event-ID` as this stream writes ids; None for anything else.
    pub fn parse(id: &str) -> Option<Position> {
        let (o, e) = id.split_once('.')?;
        Some(Position {
            stdout: o.parse().ok()?,
            stderr: e.parse().ok()?,
        })
    }

    fn id(&self) -> String {
        format!("{}.{}", self.stdout, self.stderr)
    }
}

/// What the next output event of `stream` says and how far it goes: text when the bytes are
/// UTF-8, base64 otherwise. A character cut at the end of what is there so far waits for its
/// other bytes unless the run is over (`complete`).
fn output_event(bytes: &[u8], complete: bool) -> Option<(Value, usize)> {
    if bytes.is_empty() {
        return None;
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => Some((json!({"data": text}), bytes.len())),
        Err(e) if e.error_len().is_none() && !complete => {
            let n = e.valid_up_to();
            (n > 0).then(|| {
                let text = std::str::from_utf8(&bytes[..n]).unwrap_or_default();
                (json!({"data": text}), n)
            })
        }
        Err(_) => Some((
            json!({"data_b64": base64::engine::general_purpose::STANDARD.encode(bytes)}),
            bytes.len(),
        )),
    }
}

/// The `result` event's data: the answer's body with `http_status` first, spliced so the body's
/// own bytes are unchanged.
fn result_data(answer: &StoredResponse) -> String {
    match answer.body.strip_prefix('{') {
        Some(rest) if rest.trim_start().starts_with('}') => {
            format!(r#"{{"http_status":{}}}"#, answer.status)
        }
        Some(rest) => format!(r#"{{"http_status":{},{rest}"#, answer.status),
        None => format!(
            r#"{{"http_status":{},"body":{}}}"#,
            answer.status,
            serde_json::to_string(&answer.body).unwrap_or_default()
        ),
    }
}

/// The stream's state between events.
struct Follow {
    source: Source,
    at: Position,
    started: bool,
    changes: Option<tokio::sync::watch::Receiver<u64>>,
    done: bool,
    _open: OpenStream,
}

/// One of the `executions.max_open_streams` streams this daemon keeps open at once.
pub struct StreamPermit {
    st: Arc<AppState>,
}

impl StreamPermit {
    /// A permit, unless every one is taken (429).
    pub fn take(st: &Arc<AppState>) -> Result<StreamPermit, ApiError> {
        let max = st.config.executions.max_open_streams;
        st.open_streams
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| {
                ApiError::Overloaded(format!(
                    "{max} streams are open (executions.max_open_streams)"
                ))
            })?;
        st.metrics.open_streams.increment(1.0);
        Ok(StreamPermit { st: st.clone() })
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        self.st.open_streams.fetch_sub(1, Ordering::SeqCst);
        self.st.metrics.open_streams.decrement(1.0);
    }
}

/// Holds a stream's permit, and cancels its run if the client goes away before the result when
/// the request asked for that.
struct OpenStream {
    permit: StreamPermit,
    cancel_on_disconnect: Option<Disconnect>,
    delivered: bool,
}

/// The run a stream's client asked to cancel if it goes away: the run, its owner, the request.
pub struct Disconnect {
    pub live: Arc<LiveRun>,
    pub owner: String,
    pub request_id: String,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        if !self.delivered
            && let Some(d) = &self.cancel_on_disconnect
            && d.live.answered().is_none()
        {
            tracing::info!(
                exec_id = d.live.exec_id(),
                "stream client gone: cancelling its run"
            );
            self.permit
                .st
                .executions
                .cancel(&d.live, DISCONNECT_GRACE, &d.owner, &d.request_id);
        }
    }
}

/// The events of `source` from `from` (None: from the start, `start` event included), holding
/// `permit` while open. With `cancel_on_disconnect` a client that goes away before the result
/// cancels the run.
pub fn follow(
    permit: StreamPermit,
    source: Source,
    from: Option<Position>,
    cancel_on_disconnect: Option<Disconnect>,
) -> Response {
    let changes = match &source {
        Source::Live(live) => Some(live.changes()),
        Source::Finished { .. } => None,
    };
    let state = Follow {
        source,
        at: from.unwrap_or_default(),
        started: from.is_some(),
        changes,
        done: false,
        _open: OpenStream {
            permit,
            cancel_on_disconnect,
            delivered: false,
        },
    };
    Sse::new(events(state))
        .keep_alive(KeepAlive::new().interval(HEARTBEAT))
        .into_response()
}

fn events(state: Follow) -> impl Stream<Item = Result<Event, Infallible>> {
    futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        loop {
            if !s.started {
                s.started = true;
                let ev = Event::default()
                    .event("start")
                    .id(s.at.id())
                    .data(s.source.start_event().to_string());
                return Some((Ok(ev), s));
            }
            // Mark what is there now as seen before reading it: a chunk pushed after this
            // wakes the next wait.
            if let Some(c) = s.changes.as_mut() {
                c.mark_unchanged();
            }
            let answer = s.source.answered();
            let complete = answer.is_some();
            for (kind, name) in [
                (StreamKind::Stdout, "stdout"),
                (StreamKind::Stderr, "stderr"),
            ] {
                let offset = match kind {
                    StreamKind::Stdout => s.at.stdout,
                    StreamKind::Stderr => s.at.stderr,
                };
                let bytes = s.source.output_from(kind, offset);
                if let Some((mut data, n)) = output_event(&bytes, complete) {
                    data["offset"] = json!(offset);
                    match kind {
                        StreamKind::Stdout => s.at.stdout += n,
                        StreamKind::Stderr => s.at.stderr += n,
                    }
                    let ev = Event::default()
                        .event(name)
                        .id(s.at.id())
                        .data(data.to_string());
                    return Some((Ok(ev), s));
                }
            }
            if let Some(answer) = answer {
                s.done = true;
                s._open.delivered = true;
                let ev = Event::default()
                    .event("result")
                    .id(s.at.id())
                    .data(result_data(&answer));
                return Some((Ok(ev), s));
            }
            match s.changes.as_mut() {
                Some(c) => {
                    if c.changed().await.is_err() {
                        // The run is gone without an answer: nothing more will come.
                        return None;
                    }
                }
                None => return None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip_and_refuse_other_ids() {
        let p = Position {
            stdout: 12,
            stderr: 3,
        };
        assert_eq!(Position::parse(&p.id()), Some(p));
        for bad in ["", "12", "a.b", "1.2.3", "-1.0", "end"] {
            assert_eq!(Position::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn output_is_text_or_base64_and_a_cut_character_waits_for_its_bytes() {
        let (v, n) = output_event(b"hello", false).unwrap();
        assert_eq!((v, n), (json!({"data": "hello"}), 5));
        // "é" is two bytes; the first alone waits while the run is live...
        let cut = "hé".as_bytes();
        let (v, n) = output_event(&cut[..2], false).unwrap();
        assert_eq!((v, n), (json!({"data": "h"}), 1));
        assert!(output_event(&cut[1..2], false).is_none());
        // ...and is sent as it is once the run is over.
        let (v, n) = output_event(&cut[1..2], true).unwrap();
        assert_eq!((v, n), (json!({"data_b64": "ww=="}), 1));
        let (v, _) = output_event(&[0xff, b'a'], false).unwrap();
        assert_eq!(v, json!({"data_b64": "/2E="}));
        assert!(output_event(b"", true).is_none());
    }

    #[test]
    fn the_result_keeps_the_body_bytes_and_adds_the_status() {
        let a = StoredResponse {
            status: 408,
            body: r#"{"x":1.0715660391465826e-75}"#.into(),
        };
        assert_eq!(
            result_data(&a),
            r#"{"http_status":408,"x":1.0715660391465826e-75}"#
        );
        let empty = StoredResponse {
            status: 200,
            body: "{}".into(),
        };
        assert_eq!(result_data(&empty), r#"{"http_status":200}"#);
    }
}
