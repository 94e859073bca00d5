//! `process.Process` on the data plane: each command a background process of the sandbox's
//! session (a run of the execution service, audited and with a receipt like a REST exec), its
//! output and end as envd's process events.
//!
//! A command is what the SDK sends (`cmd` and `args`, `/bin/bash -l -c …` for
//! `commands.run`), run by the session's shell language as `exec cmd args…`; `envs` (over the
//! sandbox's `envVars`) pass through the profile's environment filter, `cwd` is a directory of
//! the workspace (`/home/user` is the workspace too: the SDKs' idea of the user's home).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use tokio_util::sync::CancellationToken;

use super::connect::{self, Code, RpcError};
use super::pb::process as pb;
use super::pb::process::process_event::{self, Event};
use super::sandboxes::Process;
use super::{E2b, caller_of, sandbox_path};
use crate::calls::processes::{ControlOf, send_stdin};
use crate::calls::run::{ClientLink, RunMode, Served, StreamPermit};
use crate::calls::sessions::{ExecAsk, ExecBody, exec_job};
use crate::execution::runs::LiveRun;
use crate::sandbox::StreamKind;
use crate::sandbox::control::ProcessSignal;
use crate::sessions::Session;

/// `POST /process.Process/{method}`: the caller's sandbox first, then its body (within
/// `server.body_limit_bytes` and its deadline).
pub async fn call(
    State(e2b): State<Arc<E2b>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if method == "StreamInput" {
        // A client stream: its body is read message by message, as the caller sends them.
        let session = match super::sandbox_of(&e2b, &headers) {
            Ok(session) => session,
            Err(no) => return no.into_response(),
        };
        let answer = stream_input(&e2b, &headers, body, session)
            .await
            .map(|done| futures::stream::once(async move { Ok(done) }));
        return connect::stream_answer(answer);
    }
    let (session, body) = match super::admit(&e2b, &headers, body).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    let (e2b, h, b, s) = (&e2b, &headers, &body[..], session);
    match method.as_str() {
        "Start" => connect::stream_answer(start(e2b, h, b, s).await),
        "Connect" => connect::stream_answer(reconnect(e2b, h, b, s).await),
        "List" => connect::unary_answer(list(e2b, h, b, s)),
        "SendInput" => connect::unary_answer(send_input(e2b, h, b, s).await),
        "CloseStdin" => connect::unary_answer(close_stdin(e2b, h, b, s).await),
        "SendSignal" => connect::unary_answer(send_signal(e2b, h, b, s).await),
        "Update" => connect::unary_answer(update(e2b, h, b, s).await),
        _ => RpcError::new(
            Code::Unimplemented,
            format!("no method process.Process/{method}"),
        )
        .into_response(),
    }
}

/// `'s'` for a POSIX shell, whatever `s` holds.
pub(super) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// An answer that is not a run's 202 as the call's error.
fn refused(status: u16, body: &str) -> RpcError {
    let message = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v["error"]
                .as_str()
                .or(v["message"].as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| body.to_string());
    let code = match status {
        400 | 422 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        413 | 429 | 507 => Code::ResourceExhausted,
        503 => Code::Unavailable,
        _ => Code::Internal,
    };
    RpcError::new(code, message)
}

/// Starts `code` as a background process of `session` (deadline `timeout`, none: the profile's
/// async maximum): its run, once it started.
pub(super) async fn run_in(
    e2b: &E2b,
    session: &Arc<Session>,
    headers: &HeaderMap,
    code: String,
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    timeout: Option<Duration>,
) -> Result<Arc<LiveRun>, RpcError> {
    let (service, known) = caller_of(session, headers);
    let asked = ExecBody {
        code,
        stdin: None,
        env,
        cwd,
        timeout_ms: timeout.map(|t| t.as_millis().max(1) as u64),
        run_async: true,
        cancel_on_disconnect: false,
        background: true,
        stdin_open: false,
        receipt: false,
    };
    let timeout = crate::calls::run::timeout_of(
        RunMode::Async,
        crate::calls::run::AskedTimeout::Millis(asked.timeout_ms),
    )?;
    let job = exec_job(
        session.clone(),
        &service,
        &known,
        asked,
        ExecAsk {
            mode: RunMode::Async,
            timeout,
            idempotency_key: None,
            via: Some("e2b"),
        },
    )?;
    let st = e2b.st.clone();
    let client = ClientLink::new();
    let task = {
        let (st, client) = (st.clone(), client.clone());
        async move { job.serve(&st, &client).await }
    };
    let served = client.serve(&st, task).await??;
    let Served::Answer { answer, .. } = served else {
        return Err(RpcError::new(
            Code::Internal,
            "a background process was streamed",
        ));
    };
    if answer.status != 202 {
        return Err(refused(answer.status, &answer.body));
    }
    let exec_id = serde_json::from_str::<serde_json::Value>(&answer.body)
        .ok()
        .and_then(|v| v["exec_id"].as_str().map(str::to_string))
        .ok_or_else(|| RpcError::new(Code::Internal, "a started process without its id"))?;
    st.executions
        .runs()
        .find(&session.owner.runs(), &exec_id)
        .ok_or_else(|| {
            RpcError::not_found(format!("process {exec_id} ended before it was followed"))
        })
}

/// `exec cmd args…` for the session's shell, in `cwd` first when the config names one (any
/// directory the sandbox's user can enter: `cd` runs inside the sandbox).
fn command_line(config: &pb::ProcessConfig) -> String {
    let mut line = String::new();
    if let Some(cwd) = config.cwd.as_deref().filter(|c| !c.is_empty()) {
        line.push_str("cd -- ");
        line.push_str(&quote(&sandbox_path(cwd)));
        line.push_str(" || exit 1\n");
    }
    line.push_str("exec ");
    line.push_str(&quote(&config.cmd));
    for a in &config.args {
        line.push(' ');
        line.push_str(&quote(a));
    }
    line.push('\n');
    line
}

/// The shortest keepalive interval a stream is given, whatever it asks for.
const MIN_KEEPALIVE_SECONDS: u64 = 5;

/// How often a process stream says it is alive when nothing else comes.
fn keepalive(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.clamp(MIN_KEEPALIVE_SECONDS, 3600)))
        .unwrap_or(Duration::from_secs(30))
}

async fn start(
    e2b: &Arc<E2b>,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<impl Stream<Item = Result<pb::StartResponse, RpcError>> + use<>, RpcError> {
    let req: pb::StartRequest = connect::stream_request(headers, body)?;
    let pty = req
        .pty
        .as_ref()
        .map(|p| super::pty::size_of(p.size))
        .transpose()?;
    let config = req
        .process
        .ok_or_else(|| RpcError::invalid("process is required"))?;
    if config.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is required"));
    }
    if super::sandboxes::config_bytes(&config) > super::sandboxes::MAX_CONFIG_BYTES
        || req
            .tag
            .as_ref()
            .is_some_and(|t| t.len() > super::sandboxes::MAX_TAG_BYTES)
    {
        return Err(RpcError::invalid(format!(
            "a process's cmd, args, envs and cwd are at most {} bytes together, its tag {}",
            super::sandboxes::MAX_CONFIG_BYTES,
            super::sandboxes::MAX_TAG_BYTES
        )));
    }
    let permit = StreamPermit::take(&e2b.st)?;
    let mut env = e2b
        .sandboxes
        .get(&session.id)
        .map(|s| s.env_vars)
        .unwrap_or_default();
    env.extend(config.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    let timeout = connect::timeout(headers)?;
    // Started on a task of its own: a client that goes away meanwhile still leaves a process
    // the sandbox lists and can signal, with its stdin as asked.
    let started = {
        let (e2b, session, headers) = (e2b.clone(), session.clone(), headers.clone());
        tokio::spawn(async move {
            let (live, handle) = match pty {
                Some(size) => {
                    let (live, handle) =
                        super::pty::open(&e2b, &session, &headers, &config, env, size, timeout)
                            .await?;
                    (live, Some(handle))
                }
                None => {
                    let code = command_line(&config);
                    let live = run_in(&e2b, &session, &headers, code, env, None, timeout).await?;
                    if req.stdin != Some(true) {
                        // Asked without stdin: it reads end-of-file, as from /dev/null.
                        let _ = send_stdin(
                            &e2b.st,
                            &session,
                            live.exec_id(),
                            ControlOf::Process,
                            vec![],
                            true,
                        )
                        .await;
                    }
                    (live, None)
                }
            };
            let pid = e2b.sandboxes.started(
                &session.id,
                live.exec_id().to_string(),
                config,
                req.tag,
                handle,
                ended_in(&e2b, &session),
            );
            Ok::<_, RpcError>((live, pid))
        })
    };
    let (live, pid) = started
        .await
        .map_err(|e| RpcError::new(Code::Internal, e.to_string()))??;
    Ok(follow(
        live,
        pid,
        pty.is_some(),
        keepalive(headers),
        None,
        Following {
            shutdown: e2b.shutdown.clone(),
            _permit: permit,
        },
        |event| pb::StartResponse { event: Some(event) },
    ))
}

/// The process a selector names in the caller's sandbox.
fn selected(
    e2b: &E2b,
    session: &Session,
    selector: Option<pb::ProcessSelector>,
) -> Result<Process, RpcError> {
    use pb::process_selector::Selector;
    let found = match selector.and_then(|s| s.selector) {
        Some(Selector::Pid(pid)) => e2b.sandboxes.by_pid(&session.id, pid),
        Some(Selector::Tag(tag)) => e2b.sandboxes.by_tag(&session.id, &tag),
        None => return Err(RpcError::invalid("process: a pid or a tag is required")),
    };
    found.ok_or_else(|| RpcError::not_found("no such process in this sandbox"))
}

/// Whether a process of `session` has ended (its run answered, or is no longer known).
fn ended_in<'a>(e2b: &'a E2b, session: &'a Session) -> impl Fn(&Process) -> bool + 'a {
    let runs = session.owner.runs();
    move |p| {
        e2b.st
            .executions
            .runs()
            .find(&runs, &p.exec_id)
            .is_none_or(|l| l.answered().is_some())
    }
}

/// The selected process's run while it is known (a finished one is kept for a while).
fn live_of(e2b: &E2b, session: &Session, p: &Process) -> Result<Arc<LiveRun>, RpcError> {
    e2b.st
        .executions
        .runs()
        .find(&session.owner.runs(), &p.exec_id)
        .ok_or_else(|| RpcError::not_found(format!("process {} has ended", p.pid)))
}

async fn reconnect(
    e2b: &Arc<E2b>,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<impl Stream<Item = Result<pb::ConnectResponse, RpcError>> + use<>, RpcError> {
    let req: pb::ConnectRequest = connect::stream_request(headers, body)?;
    let p = selected(e2b, &session, req.process)?;
    let live = live_of(e2b, &session, &p)?;
    let deadline = connect::timeout(headers)?;
    let permit = StreamPermit::take(&e2b.st)?;
    Ok(follow(
        live,
        p.pid,
        p.pty.is_some(),
        keepalive(headers),
        deadline,
        Following {
            shutdown: e2b.shutdown.clone(),
            _permit: permit,
        },
        |event| pb::ConnectResponse { event: Some(event) },
    ))
}

fn list(
    e2b: &E2b,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<pb::ListResponse, RpcError> {
    let _: pb::ListRequest = connect::unary_request(headers, body)?;
    let ended = ended_in(e2b, &session);
    let processes = e2b
        .sandboxes
        .processes(&session.id, |p| !ended(p))
        .into_iter()
        .map(|p| pb::ProcessInfo {
            config: Some(p.config),
            pid: p.pid,
            tag: p.tag,
        })
        .collect();
    Ok(pb::ListResponse { processes })
}

async fn send_input(
    e2b: &E2b,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<pb::SendInputResponse, RpcError> {
    let req: pb::SendInputRequest = connect::unary_request(headers, body)?;
    let p = selected(e2b, &session, req.process)?;
    deliver(e2b, &session, &p, req.input.and_then(|i| i.input)).await?;
    Ok(pb::SendInputResponse {})
}

/// `input` for process `p`, in order with earlier input: typed into a PTY (whichever kind it
/// is), or to a command's stdin.
async fn deliver(
    e2b: &E2b,
    session: &Session,
    p: &Process,
    input: Option<pb::process_input::Input>,
) -> Result<(), RpcError> {
    if let Some(pty) = &p.pty {
        let bytes = match input {
            Some(pb::process_input::Input::Stdin(b) | pb::process_input::Input::Pty(b)) => b,
            None => Vec::new(),
        };
        return pty.input(bytes).await;
    }
    let bytes = match input {
        Some(pb::process_input::Input::Stdin(b)) => b,
        Some(pb::process_input::Input::Pty(_)) => return Err(super::pty::not_a_pty(p.pid)),
        None => Vec::new(),
    };
    send_stdin(
        &e2b.st,
        session,
        &p.exec_id,
        ControlOf::Process,
        bytes,
        false,
    )
    .await?;
    Ok(())
}

/// `StreamInput`: input for one process as a client stream. Its first message names the
/// process; each next one's bytes go to it as they come, in order (as `SendInput`'s would);
/// keepalives are read and dropped. The answer comes once the caller ends its stream; a message
/// that cannot be delivered ends the call with its error. The call holds one of
/// `executions.max_open_streams`, so it ends without its caller too: when the process ends
/// (`not_found`), when no whole message came for `server.body_read_timeout_seconds`
/// (`deadline_exceeded`; keepalives count), at its deadline (`Connect-Timeout-Ms`) and at the
/// daemon's drain.
async fn stream_input(
    e2b: &E2b,
    headers: &HeaderMap,
    body: Body,
    session: Arc<Session>,
) -> Result<pb::StreamInputResponse, RpcError> {
    use pb::stream_input_request::Event as In;
    connect::stream_codec(headers)?;
    let deadline = connect::timeout(headers)?;
    let _permit = StreamPermit::take(&e2b.st)?;
    let mut messages = connect::Envelopes::new(body, e2b.st.config.server.body_limit_bytes);
    let idle = Duration::from_secs(e2b.st.config.server.body_read_timeout_seconds);
    let relay = async {
        let mut next = async || -> Result<Option<pb::StreamInputRequest>, RpcError> {
            tokio::time::timeout(idle, messages.next())
                .await
                .map_err(|_| {
                    RpcError::new(
                        Code::DeadlineExceeded,
                        format!(
                            "no whole message came for {}s (server.body_read_timeout_seconds): send keepalives",
                            idle.as_secs()
                        ),
                    )
                })?
        };
        let Some(In::Start(start)) = next().await?.and_then(|m| m.event) else {
            return Err(RpcError::invalid(
                "a StreamInput call begins with its start message (the process)",
            ));
        };
        let p = selected(e2b, &session, start.process)?;
        let live = live_of(e2b, &session, &p)?;
        let mut answer = live.answer();
        loop {
            let m = tokio::select! {
                m = next() => m?,
                _ = async { answer.wait_for(Option::is_some).await.map(|_| ()) } => {
                    return Err(RpcError::not_found(format!("process {} has ended", p.pid)));
                }
            };
            let Some(m) = m else { break };
            match m.event {
                Some(In::Data(data)) => {
                    deliver(e2b, &session, &p, data.input.and_then(|i| i.input)).await?;
                }
                Some(In::Keepalive(_)) | None => {}
                Some(In::Start(_)) => {
                    return Err(RpcError::invalid(
                        "a StreamInput call has one start message, its first",
                    ));
                }
            }
        }
        Ok(pb::StreamInputResponse {})
    };
    let done = tokio::select! {
        done = relay => done,
        _ = passed(deadline.map(|d| tokio::time::Instant::now() + d)) => return Err(RpcError::new(Code::DeadlineExceeded, "the call's deadline passed")),
        _ = e2b.shutdown.cancelled() => return Err(RpcError::new(Code::Unavailable, "the daemon is shutting down")),
    };
    if done.is_err() {
        // Refused before its end: what the caller already sent is read first, so that its
        // connection stays usable for its next call.
        messages
            .drain(e2b.st.config.server.body_limit_bytes, DRAIN_WAIT)
            .await;
    }
    done
}

/// Ready once `deadline` passed; never without one.
async fn passed(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// How long a refused `StreamInput` call reads what its caller already sent.
const DRAIN_WAIT: Duration = Duration::from_secs(1);

async fn close_stdin(
    e2b: &E2b,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<pb::CloseStdinResponse, RpcError> {
    let req: pb::CloseStdinRequest = connect::unary_request(headers, body)?;
    let p = selected(e2b, &session, req.process)?;
    if p.pty.is_some() {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!(
                "process {} is a PTY: its input has no end to close (type EOT, 0x04, to end a shell)",
                p.pid
            ),
        ));
    }
    send_stdin(
        &e2b.st,
        &session,
        &p.exec_id,
        ControlOf::Process,
        vec![],
        true,
    )
    .await?;
    Ok(pb::CloseStdinResponse {})
}

async fn send_signal(
    e2b: &E2b,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<pb::SendSignalResponse, RpcError> {
    let req: pb::SendSignalRequest = connect::unary_request(headers, body)?;
    let p = selected(e2b, &session, req.process)?;
    let signal = match pb::Signal::try_from(req.signal) {
        Ok(pb::Signal::Sigterm) => ProcessSignal::Term,
        Ok(pb::Signal::Sigkill) => ProcessSignal::Kill,
        _ => {
            return Err(RpcError::invalid(
                "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL",
            ));
        }
    };
    crate::calls::processes::signal(&e2b.st, &session, &p.exec_id, signal).await?;
    Ok(pb::SendSignalResponse {})
}

/// `Update`: a PTY's new size.
async fn update(
    e2b: &E2b,
    headers: &HeaderMap,
    body: &[u8],
    session: Arc<Session>,
) -> Result<pb::UpdateResponse, RpcError> {
    let req: pb::UpdateRequest = connect::unary_request(headers, body)?;
    let p = selected(e2b, &session, req.process)?;
    let Some(pty) = &p.pty else {
        return Err(super::pty::not_a_pty(p.pid));
    };
    if let Some(asked) = req.pty {
        pty.resize(asked.size).await?;
    }
    Ok(pb::UpdateResponse {})
}

/// The most of one stream a data event carries.
const CHUNK: usize = 64 * 1024;

/// What an open process stream holds: one of `executions.max_open_streams`, and the daemon's
/// drain, which ends it.
struct Following {
    shutdown: CancellationToken,
    _permit: StreamPermit,
}

struct Follow<F> {
    live: Arc<LiveRun>,
    pid: u32,
    /// A PTY's: all it writes is the terminal's output.
    pty: bool,
    at: [usize; 2],
    started: bool,
    done: bool,
    changes: tokio::sync::watch::Receiver<u64>,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
    open: Following,
    wrap: F,
}

/// The process events of `live` (known as `pid`) from its start: start, its output as it
/// comes, keepalives while none does, and its end. `deadline` ends the stream (not the
/// process) with `deadline_exceeded`; the daemon's drain ends it with `unavailable`.
fn follow<T, F>(
    live: Arc<LiveRun>,
    pid: u32,
    pty: bool,
    keepalive: Duration,
    deadline: Option<Duration>,
    open: Following,
    wrap: F,
) -> impl Stream<Item = Result<T, RpcError>> + use<T, F>
where
    F: Fn(pb::ProcessEvent) -> T + Send + 'static,
    T: Send + 'static,
{
    let state = Follow {
        changes: live.changes(),
        live,
        pid,
        pty,
        at: [0, 0],
        started: false,
        done: false,
        keepalive,
        deadline: deadline.map(|d| tokio::time::Instant::now() + d),
        open,
        wrap,
    };
    futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        let event = |s: &Follow<F>, e: Event| (s.wrap)(pb::ProcessEvent { event: Some(e) });
        if !s.started {
            s.started = true;
            let ev = event(&s, Event::Start(process_event::StartEvent { pid: s.pid }));
            return Some((Ok(ev), s));
        }
        loop {
            s.changes.mark_unchanged();
            let answer = s.live.answered();
            for (i, kind) in [StreamKind::Stdout, StreamKind::Stderr]
                .into_iter()
                .enumerate()
            {
                let (offset, bytes) = s.live.output_from(kind, s.at[i], CHUNK);
                if !bytes.is_empty() {
                    s.at[i] = offset + bytes.len();
                    let output = match kind {
                        // A PTY's stderr is its supervisor's word on why it could not start.
                        _ if s.pty => process_event::data_event::Output::Pty(bytes),
                        StreamKind::Stdout => process_event::data_event::Output::Stdout(bytes),
                        StreamKind::Stderr => process_event::data_event::Output::Stderr(bytes),
                    };
                    let ev = event(
                        &s,
                        Event::Data(process_event::DataEvent {
                            output: Some(output),
                        }),
                    );
                    return Some((Ok(ev), s));
                }
            }
            if let Some(answer) = answer {
                s.done = true;
                let ev = event(&s, Event::End(end_of(&answer.status, &answer.body)));
                return Some((Ok(ev), s));
            }
            let until_deadline = passed(s.deadline);
            tokio::select! {
                changed = s.changes.changed() => {
                    if changed.is_err() {
                        s.done = true;
                        return Some((Err(RpcError::new(Code::Internal, "the process's run went away without an end")), s));
                    }
                }
                _ = tokio::time::sleep(s.keepalive) => {
                    let ev = event(&s, Event::Keepalive(process_event::KeepAlive {}));
                    return Some((Ok(ev), s));
                }
                _ = until_deadline => {
                    s.done = true;
                    return Some((Err(RpcError::new(Code::DeadlineExceeded, "the call's deadline passed (the process goes on)")), s));
                }
                _ = s.open.shutdown.cancelled() => {
                    s.done = true;
                    return Some((Err(RpcError::new(Code::Unavailable, "the daemon is shutting down")), s));
                }
            }
        }
    })
}

/// A finished run's answer as envd's end event.
fn end_of(status: &u16, body: &str) -> process_event::EndEvent {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let Some(exit_code) = v["exit_code"].as_i64() else {
        let message = v["error"]
            .as_str()
            .or(v["message"].as_str())
            .unwrap_or("the process did not run")
            .to_string();
        return process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: format!("error {status}"),
            error: Some(message),
        };
    };
    let killed = v["killed_reason"].as_str();
    let outcome = v["outcome"].as_str().unwrap_or("");
    match killed {
        None if matches!(outcome, "success" | "failed") => process_event::EndEvent {
            exit_code: exit_code as i32,
            exited: true,
            status: format!("exit status {exit_code}"),
            error: None,
        },
        _ => process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: Some(format!(
                "the process was ended: {}",
                killed.unwrap_or(outcome)
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_quoted_whole() {
        let c = pb::ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), "echo 'hi' $HOME".into()],
            ..Default::default()
        };
        assert_eq!(
            command_line(&c),
            "exec '/bin/bash' '-l' '-c' 'echo '\\''hi'\\'' $HOME'\n"
        );
        let here = pb::ProcessConfig {
            cmd: "ls".into(),
            cwd: Some("/home/user/src".into()),
            ..Default::default()
        };
        assert_eq!(
            command_line(&here),
            "cd -- '/workspace/src' || exit 1\nexec 'ls'\n"
        );
    }

    #[test]
    fn sdk_paths_land_in_the_workspace() {
        assert_eq!(sandbox_path("a/b"), "/workspace/a/b");
        assert_eq!(sandbox_path("/home/user"), "/workspace");
        assert_eq!(sandbox_path("/home/user/x"), "/workspace/x");
        assert_eq!(sandbox_path("/home/userx"), "/home/userx");
        assert_eq!(sandbox_path("/etc/hosts"), "/etc/hosts");
        assert_eq!(sandbox_path(""), "/workspace");
    }

    #[test]
    fn ends_say_how_the_process_ended() {
        let e = end_of(&200, r#"{"exit_code":3,"outcome":"failed"}"#);
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (3, true, "exit status 3")
        );
        assert!(e.error.is_none());
        let k = end_of(
            &200,
            r#"{"exit_code":137,"outcome":"cancelled","killed_reason":"cancelled"}"#,
        );
        assert!(!k.exited);
        assert_eq!(k.exit_code, -1);
        let err = end_of(&503, r#"{"error":"no sandbox"}"#);
        assert_eq!(err.error.as_deref(), Some("no sandbox"));
    }
}
