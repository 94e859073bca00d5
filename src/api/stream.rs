//! A run as Server-Sent Events: `start`, then its output as it is written (`stdout` / `stderr`
//! events with the byte offset of each chunk in its stream), then `result` with exactly the body
//! its synchronous call returns plus `http_status`; comment heartbeats while it is quiet.
//!
//! Framing (`?framing=`): `bytes` (the default) sends output as it comes, in chunks of up to
//! 64 KiB; `lines` sends one event per complete line (its `\n` included), holds a line back
//! until it is complete, and sends what is left of an unfinished last line, marked
//! `"partial": true`, once the run is over. A line longer than 1 MiB is sent in 1 MiB pieces,
//! each but its last marked partial.
//!
//! An event's `id` is the position reached in both streams after it (`<stdout bytes>.<stderr
//! bytes>`), in either framing, so `Last-Event-ID` resumes from there without loss or repetition,
//! whether the run is still live or finished (its output is then taken from its stored result).
//! A position past what the run has written is clamped to it, stream by stream: the `result`'s
//! id is always the true end of the output. Output the run wrote beyond its caps is in no event,
//! as in no result.
//!
//! Owns: the events' wire format and following one run. Must not: start, stop or record runs.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Query;
use axum::http::Uri;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::calls::ApiError;
use crate::calls::run::{Disconnect, OpenStream, StreamPermit};
use crate::execution::runs::{Kept, LiveRun};
use crate::sandbox::StreamKind;
use crate::state::StoredResponse;

/// Heartbeat comments while a run writes nothing.
const HEARTBEAT: Duration = Duration::from_secs(15);
/// The most output one event carries (bytes framing).
const MAX_CHUNK: usize = 64 * 1024;
/// The longest line one event carries (lines framing); a longer one comes in pieces.
const MAX_LINE: usize = 1024 * 1024;

/// Where a stream's events come from.
pub enum Source {
    /// A run of this daemon that has not finished.
    Live(Arc<LiveRun>),
    /// A finished run, from its stored answer.
    Finished {
        exec_id: String,
        output: [Vec<u8>; 2],
        answer: Arc<StoredResponse>,
        /// The `start` event's data.
        start: Value,
    },
}

impl Source {
    /// A finished run's source: its output is the result's `stdout` / `stderr` (their base64
    /// form when the bytes were not UTF-8); its backend and profile those of the result, else
    /// `ran_on` (from the run's record: an answer that is an error does not name them).
    pub fn finished(
        exec_id: &str,
        answer: StoredResponse,
        ran_on: (Option<String>, Option<String>),
    ) -> Source {
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
        let named = |key: &str, recorded: Option<String>| match &result[key] {
            Value::String(s) => json!(s),
            _ => json!(recorded),
        };
        let start = json!({
            "exec_id": exec_id,
            "backend": named("backend", ran_on.0),
            "profile": named("profile", ran_on.1),
        });
        Source::Finished {
            exec_id: exec_id.to_string(),
            output: [
                stream("stdout", "stdout_b64"),
                stream("stderr", "stderr_b64"),
            ],
            answer: Arc::new(answer),
            start,
        }
    }

    /// `f` of what is kept of `stream` so far.
    fn with_output<R>(&self, stream: StreamKind, f: impl FnOnce(Kept<'_>) -> R) -> R {
        match self {
            Source::Live(live) => live.with_output(stream, f),
            Source::Finished { output, .. } => f(Kept::whole(&output[stream as usize])),
        }
    }

    /// How far `stream` goes so far.
    fn len(&self, stream: StreamKind) -> usize {
        self.with_output(stream, |kept| kept.end())
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
            Source::Finished { start, .. } => start.clone(),
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

    fn get(&self, stream: StreamKind) -> usize {
        match stream {
            StreamKind::Stdout => self.stdout,
            StreamKind::Stderr => self.stderr,
        }
    }

    fn get_mut(&mut self, stream: StreamKind) -> &mut usize {
        match stream {
            StreamKind::Stdout => &mut self.stdout,
            StreamKind::Stderr => &mut self.stderr,
        }
    }

    /// This position, no further in either stream than `end`.
    fn clamped(self, end: Position) -> Position {
        Position {
            stdout: self.stdout.min(end.stdout),
            stderr: self.stderr.min(end.stderr),
        }
    }
}

/// How a stream cuts output into events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Framing {
    /// Output as it comes, in chunks of up to 64 KiB (a line may span events, an event may
    /// hold several lines).
    #[default]
    Bytes,
    /// One event per complete line, `\n` included; an unfinished last line once the run is
    /// over, marked `"partial": true`; lines over 1 MiB in pieces, marked likewise.
    Lines,
}

/// The query every stream takes (`/v1/executions/{exec_id}/stream`, a session exec's
/// `/stream`, and `POST /execute` or a session exec with `Accept: text/event-stream`).
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// `bytes` (default) or `lines`; anything else is a 400. Event ids are byte positions in
    /// either framing, so a stream may resume in the other one.
    #[param(inline, value_type = Option<Framing>)]
    framing: Option<String>,
}

impl Framing {
    /// The framing a request's query asks for: `bytes` when it names none; a 400 for a value
    /// that is not a framing (other parameters are not this function's business).
    pub fn of(uri: &Uri) -> Result<Framing, ApiError> {
        let q = Query::<StreamQuery>::try_from_uri(uri)
            .map_err(|e| ApiError::InvalidRequest(format!("invalid query: {}", e.body_text())))?;
        match q.0.framing.as_deref() {
            None | Some("bytes") => Ok(Framing::Bytes),
            Some("lines") => Ok(Framing::Lines),
            Some(other) => Err(ApiError::InvalidRequest(format!(
                "unknown framing '{}': expected bytes or lines",
                other.escape_debug()
            ))),
        }
    }

    /// The query string that asks for this framing on a forwarded call (`""` for the default).
    pub fn query(self) -> &'static str {
        match self {
            Framing::Bytes => "",
            Framing::Lines => "?framing=lines",
        }
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

/// What the next output event of lines framing says and how far it goes, from `rest` (what
/// follows the position reached) of which the first `scanned` bytes are known to hold no `\n`:
/// a complete line; a piece of a line longer than [`MAX_LINE`]; once the run is over
/// (`complete`), what is left of an unfinished line. None while a line waits for its end; the
/// second value is how much of `rest` is now known to hold no `\n`.
fn line_event(rest: &[u8], scanned: usize, complete: bool) -> (Option<(Value, usize)>, usize) {
    let from = scanned.min(rest.len());
    let window = &rest[from..rest.len().min(MAX_LINE)];
    if let Some(i) = window.iter().position(|&b| b == b'\n') {
        return (output_event(&rest[..from + i + 1], true), 0);
    }
    let partial = |event: Option<(Value, usize)>| {
        event.map(|(mut v, n)| {
            v["partial"] = json!(true);
            (v, n)
        })
    };
    if rest.len() >= MAX_LINE {
        // A piece of an over-long line; a character cut at its end goes with the next piece.
        return (partial(output_event(&rest[..MAX_LINE], false)), 0);
    }
    if complete {
        return (partial(output_event(rest, true)), 0);
    }
    (None, rest.len())
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
    framing: Framing,
    at: Position,
    /// Lines framing: how many bytes after `at` are known to hold no `\n`, per stream.
    scanned: [usize; 2],
    started: bool,
    changes: Option<tokio::sync::watch::Receiver<u64>>,
    done: bool,
    _open: OpenStream,
}

/// The events of `source` in `framing` from `from` (None: from the start, `start` event
/// included; a position past the output so far: its end), holding `permit` while open. With
/// `cancel_on_disconnect` a client that goes away before the result cancels the run.
pub fn follow(
    permit: StreamPermit,
    source: Source,
    framing: Framing,
    from: Option<Position>,
    cancel_on_disconnect: Option<Disconnect>,
) -> Response {
    let changes = match &source {
        Source::Live(live) => Some(live.changes()),
        Source::Finished { .. } => None,
    };
    // Output only grows: a position past it now was never an id of this run's events.
    let end = Position {
        stdout: source.len(StreamKind::Stdout),
        stderr: source.len(StreamKind::Stderr),
    };
    let state = Follow {
        source,
        framing,
        at: from.unwrap_or_default().clamped(end),
        scanned: [0, 0],
        started: from.is_some(),
        changes,
        done: false,
        _open: OpenStream::new(permit, cancel_on_disconnect),
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
                let (framing, scanned) = (s.framing, s.scanned[kind as usize]);
                let wanted = s.at.get(kind);
                let (offset, next, scanned) = s.source.with_output(kind, |kept| {
                    // A background process's ring may have dropped bytes a slow reader had not
                    // read: it goes on from the oldest kept one (its offset says where).
                    let (offset, rest) = kept.from(wanted).unwrap_or((wanted, &[]));
                    let scanned = if offset == wanted { scanned } else { 0 };
                    let (next, scanned) = match framing {
                        Framing::Bytes => (
                            output_event(&rest[..rest.len().min(MAX_CHUNK)], complete),
                            0,
                        ),
                        Framing::Lines => line_event(rest, scanned, complete),
                    };
                    (offset, next, scanned)
                });
                s.scanned[kind as usize] = scanned;
                *s.at.get_mut(kind) = offset;
                if let Some((mut data, n)) = next {
                    data["offset"] = json!(offset);
                    *s.at.get_mut(kind) = offset + n;
                    let ev = Event::default()
                        .event(name)
                        .id(s.at.id())
                        .data(data.to_string());
                    return Some((Ok(ev), s));
                }
            }
            if let Some(answer) = answer {
                s.done = true;
                s._open.delivered();
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
    fn lines_wait_for_their_end_and_an_unfinished_one_comes_at_the_end() {
        let (e, scanned) = line_event(b"{\"a\":1}\n{\"a\"", 0, false);
        assert_eq!(e, Some((json!({"data": "{\"a\":1}\n"}), 8)));
        assert_eq!(scanned, 0);
        // The rest of the first write: no end yet, and now known to hold none.
        let (e, scanned) = line_event(b"{\"a\"", 0, false);
        assert_eq!((e, scanned), (None, 4));
        let (e, _) = line_event(b"{\"a\":2}\n", scanned, false);
        assert_eq!(e, Some((json!({"data": "{\"a\":2}\n"}), 8)));
        let (e, _) = line_event(b"{\"b\":", 0, true);
        assert_eq!(e, Some((json!({"data": "{\"b\":", "partial": true}), 5)));
        assert_eq!(line_event(b"", 0, true), (None, 0));
        // A line that is not UTF-8 is one base64 event.
        let (e, _) = line_event(&[0xff, b'\n', b'x'], 0, false);
        assert_eq!(e, Some((json!({"data_b64": "/wo="}), 2)));
    }

    #[test]
    fn an_over_long_line_comes_in_pieces_cut_between_characters() {
        let mut long = vec![b'x'; MAX_LINE - 1];
        long.extend("é\n".as_bytes());
        let (e, _) = line_event(&long, 0, false);
        let (v, n) = e.unwrap();
        assert_eq!((n, &v["partial"]), (MAX_LINE - 1, &json!(true)));
        let (e, _) = line_event(&long[n..], 0, false);
        assert_eq!(e, Some((json!({"data": "é\n"}), 3)));
    }

    #[test]
    fn a_position_past_the_output_is_clamped_to_its_end() {
        let end = Position {
            stdout: 4,
            stderr: 0,
        };
        let past = Position {
            stdout: 9,
            stderr: 2,
        };
        assert_eq!(past.clamped(end), end);
        let within = Position {
            stdout: 3,
            stderr: 0,
        };
        assert_eq!(within.clamped(end), within);
    }

    #[test]
    fn framing_comes_from_the_query_and_refuses_other_values() {
        let of = |q: &str| Framing::of(&q.parse::<Uri>().unwrap());
        assert_eq!(of("/x").unwrap(), Framing::Bytes);
        assert_eq!(of("/x?framing=bytes").unwrap(), Framing::Bytes);
        assert_eq!(of("/x?framing=lines&other=1").unwrap(), Framing::Lines);
        for bad in [
            "/x?framing=",
            "/x?framing=Lines",
            "/x?framing=lines&framing=lines",
        ] {
            assert!(matches!(of(bad), Err(ApiError::InvalidRequest(_))), "{bad}");
        }
    }

    #[test]
    fn the_result_keeps_the_body_bytes_and_adds_the_status() {
        let a = StoredResponse {
            status: 408,
            body: r#"{"x":1.0715660391465826e-75}"#.into(),
            receipt: None,
        };
        assert_eq!(
            result_data(&a),
            r#"{"http_status":408,"x":1.0715660391465826e-75}"#
        );
        let empty = StoredResponse {
            status: 200,
            body: "{}".into(),
            receipt: None,
        };
        assert_eq!(result_data(&empty), r#"{"http_status":200}"#);
    }
}
