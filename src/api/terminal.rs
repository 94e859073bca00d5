//! `GET /v1/sandbox/sessions/{id}/terminal`: a session's terminal over a WebSocket.
//!
//! Binary frames are bytes both ways (typed into the terminal; its output). A text frame
//! `{"resize": {"cols": C, "rows": R}}` resizes it (1..=4096 each). A frame or message over
//! `sessions.max_frame_bytes` closes the socket with 1009; a text frame that is not a resize
//! closes it with 1003. Closing the socket hangs the terminal up (its shell gets SIGHUP, then
//! every process of it is killed); the terminal ending on its own (the shell exits, or the
//! session ends: delete, expiry, pause, shutdown) closes the socket with 1000.
//!
//! Everything a session route checks comes before the upgrade, with the usual statuses: the
//! token (401), the session (404 for another service's, tenant's or none), a place among its
//! processes (429 past `sessions.max_processes`), a run slot (429).
//!
//! Owns: the WebSocket and its frames. Must not: run or signal anything itself (the sessions
//! service's [`Terminal`] does).

use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{FromRequestParts, Request, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::extract::Path;
use super::sessions::{SessionPath, TenantHeaders};
use crate::calls::AppState;
use crate::calls::caller::RequestId;
use crate::calls::error::{ApiError, ErrorBody};
use crate::calls::sessions::{Touch, session_of};
use crate::calls::terminal::{TerminalAsk, admit};
use crate::sandbox::StreamKind;
use crate::sessions::{Terminal, TerminalEnd};

/// A text frame of the terminal: its new size.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextFrame {
    resize: Size,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Size {
    cols: u16,
    rows: u16,
}

/// Most columns or rows a resize may ask for.
const MAX_SIDE: u16 = executor_arm_supervisor::protocol::MAX_TERMINAL_SIDE;

/// `GET /v1/sandbox/sessions/{id}/terminal`: the session's terminal, a WebSocket attached to its
/// shell on a pseudo-terminal in the sandbox.
#[utoipa::path(
    get,
    path = "/v1/sandbox/sessions/{id}/terminal",
    operation_id = "session_terminal",
    tag = "sessions",
    params(SessionPath, TenantHeaders),
    security(("bearer" = [])),
    responses(
        (status = 101, description = "A WebSocket attached to the session's shell on a pseudo-terminal: binary frames are bytes both ways; a text frame `{\"resize\": {\"cols\": C, \"rows\": R}}` resizes (1..=4096 each); a frame over `sessions.max_frame_bytes` closes it with 1009, any other text frame with 1003; closing it hangs the shell up and kills every process of the terminal; the terminal ending (the shell exits, the session ends) closes it with 1000"),
        (status = 400, description = "InvalidRequest: not a WebSocket upgrade, a tenant header is malformed or the two disagree, a path parameter that is not UTF-8", body = ErrorBody),
        (status = 401, description = "Unauthorized: the service token is missing or invalid", body = ErrorBody),
        (status = 404, description = "NotFound: no such session of this service and tenant", body = ErrorBody),
        (status = 429, description = "Overloaded: the session runs `sessions.max_processes` processes (a terminal is one), or no run slot came free", body = ErrorBody),
        (status = 503, description = "SandboxUnavailable: the backend or the state store is down, or the daemon is shutting down", body = ErrorBody),
    )
)]
pub async fn terminal(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    match open(&st, &id, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn open(st: &Arc<AppState>, id: &str, req: Request) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    let rid = RequestId::of(&req);
    let (mut parts, _) = req.into_parts();
    let (session, service, known) = session_of(st, &parts.headers, rid, id, Touch::Use).await?;
    let ws = WebSocketUpgrade::from_request_parts(&mut parts, &())
        .await
        .map_err(|e| {
            ApiError::InvalidRequest(format!("not a WebSocket upgrade: {}", e.body_text()))
        })?;
    let admitted = admit(st, &session, &service, &known, TerminalAsk::default()).await?;
    let max = st.sessions.max_frame_bytes();
    let st = st.clone();
    // The socket's own limits are above ours, so that a frame just over ours is read and
    // answered with 1009 (past these, the read fails and 1009 is sent all the same).
    let transport_limit = max.saturating_mul(2).max(1024);
    Ok(ws
        .max_frame_size(transport_limit)
        .max_message_size(transport_limit)
        .on_upgrade(move |socket| async move {
            let terminal = admitted.start(&st);
            let why = serve(socket, &terminal, max).await;
            terminal.close(why).await;
        }))
}

/// Relays between the socket and the terminal until one side ends; says how it ended.
async fn serve(mut socket: WebSocket, terminal: &Terminal, max: usize) -> TerminalEnd {
    let live = terminal.live().clone();
    let mut changes = live.changes();
    let mut sent = [0usize; 2];
    loop {
        // Output first: whatever the terminal wrote goes out before its end is told.
        let mut wrote = false;
        for (i, stream) in [StreamKind::Stdout, StreamKind::Stderr]
            .into_iter()
            .enumerate()
        {
            // A reader slower than the terminal's output ring goes on from its oldest byte.
            let (at, chunk) = live.output_from(stream, sent[i], max);
            if !chunk.is_empty() {
                sent[i] = at + chunk.len();
                terminal.sent(chunk.len());
                wrote = true;
                if socket.send(Message::Binary(chunk.into())).await.is_err() {
                    return TerminalEnd::Closed;
                }
            }
        }
        if wrote {
            continue;
        }
        if live.answered().is_some() {
            close(&mut socket, close_code::NORMAL, "the terminal ended").await;
            return TerminalEnd::Exited;
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    close(&mut socket, close_code::NORMAL, "the terminal ended").await;
                    return TerminalEnd::Exited;
                }
            }
            msg = socket.recv() => match msg {
                None | Some(Ok(Message::Close(_))) => return TerminalEnd::Closed,
                Some(Err(e)) => {
                    // The transport's own limit (a frame far over ours) is the same refusal.
                    // (tungstenite's capacity error, known by its text: axum boxes it).
                    let too_big = e.to_string().contains("Space limit exceeded");
                    if too_big {
                        close(&mut socket, close_code::SIZE, "frame over sessions.max_frame_bytes").await;
                        return TerminalEnd::Refused;
                    }
                    return TerminalEnd::Closed;
                }
                Some(Ok(Message::Binary(b))) => {
                    if b.len() > max {
                        close(&mut socket, close_code::SIZE, "frame over sessions.max_frame_bytes").await;
                        return TerminalEnd::Refused;
                    }
                    if terminal.input(&b).await.is_err() {
                        close(&mut socket, close_code::NORMAL, "the terminal ended").await;
                        return TerminalEnd::Exited;
                    }
                }
                Some(Ok(Message::Text(t))) => {
                    if t.len() > max {
                        close(&mut socket, close_code::SIZE, "frame over sessions.max_frame_bytes").await;
                        return TerminalEnd::Refused;
                    }
                    let Some(size) = resize_of(t.as_str()) else {
                        close(&mut socket, close_code::UNSUPPORTED, "a text frame must be {\"resize\": {\"cols\": C, \"rows\": R}}").await;
                        return TerminalEnd::Refused;
                    };
                    if terminal.resize(size.cols, size.rows).await.is_err() {
                        close(&mut socket, close_code::NORMAL, "the terminal ended").await;
                        return TerminalEnd::Exited;
                    }
                }
                // Pings are answered by the socket itself.
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            }
        }
    }
}

/// The size a text frame asks for; None for anything but a resize within bounds.
fn resize_of(text: &str) -> Option<Size> {
    serde_json::from_str::<TextFrame>(text)
        .ok()
        .map(|f| f.resize)
        .filter(|s| (1..=MAX_SIDE).contains(&s.cols) && (1..=MAX_SIDE).contains(&s.rows))
}

async fn close(socket: &mut WebSocket, code: u16, reason: &'static str) {
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: reason.into(),
        })))
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_resize_within_bounds_is_a_text_frame() {
        let s = resize_of(r#"{"resize": {"cols": 120, "rows": 40}}"#).unwrap();
        assert_eq!((s.cols, s.rows), (120, 40));
        for bad in [
            "",
            "resize",
            r#"{"resize": {"cols": 0, "rows": 40}}"#,
            r#"{"resize": {"cols": 80, "rows": 4097}}"#,
            r#"{"resize": {"cols": 80}}"#,
            r#"{"resize": {"cols": 80, "rows": 24, "x": 1}}"#,
            r#"{"resize": {"cols": 80, "rows": 24}, "more": true}"#,
            r#"{"resize": {"cols": -1, "rows": 24}}"#,
        ] {
            assert!(resize_of(bad).is_none(), "{bad}");
        }
    }
}
