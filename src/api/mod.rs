//! The HTTP layer: routes, request ids, the accept loop with header-read timeout, graceful drain.
//!
//! Owns: parsing and answering HTTP: the routes, reading a request's headers, body and query,
//! rendering an answer (status, headers, JSON or Server-Sent Events). Must not: decide, admit or
//! run an execution (it hands a typed request through `calls` to the execution service), know
//! cgroups, Landlock or Docker, or decide policy. Who calls, idempotency and the error
//! vocabulary are `calls`'s, shared with the other front ends.
//!
//! # Files
//! Imports go down this list, never up (no file imports one that imports it back):
//! - `mod.rs` (this file): the router, the request-id middleware, the accept loop and the drain.
//! - Route files, each with its own wire types and handlers only:
//!   - `execute.rs`: `POST /execute`: the order of its checks, its request made into an
//!     `ExecutionRequest`.
//!   - `sessions.rs`: `/v1/sandbox/sessions`: sessions, their execs and their files.
//!   - `processes.rs`: a session's background processes (list, output, stream, stdin, signal).
//!   - `receipts.rs`: a run's receipt (and a session exec's), and the keys that verify them.
//!   - `terminal.rs`: a session's terminal, a WebSocket attached to its shell on a pty.
//!   - `ports.rs`: HTTP and WebSocket to a port inside a session's sandbox.
//!   - `executions.rs`: `/v1/executions/{exec_id}`: read, stream and cancel a run (session
//!     execs' run routes use it too).
//!   - `ops.rs`: health, readiness, capabilities, metrics, executors, 404 and 405.
//!   - `openapi.rs`: the OpenAPI document assembled from the routes' annotations, and `/docs`.
//! - `run.rs`: a run request's HTTP: the run mode, timeout and framing check, the
//!   Idempotency-Key header, and what `calls::run` serves rendered as HTTP.
//! - `stream.rs`: a run as Server-Sent Events.
//! - `extract.rs`: `Path` and `Query` whose rejections are the documented error body.
//! - `error.rs`: an `ApiError` (see `calls`) as an HTTP answer.
//!
//! Who is calling, the error vocabulary and the shared state are `calls`'s, shared with the
//! other front ends.

pub mod error;
pub mod execute;
pub mod executions;
pub mod extract;
pub mod openapi;
pub mod ops;
pub mod ports;
pub mod processes;
pub mod receipts;
pub mod run;
pub mod sessions;
pub mod stream;
pub mod terminal;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{any, get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::Instrument as _;

pub use crate::calls::{AppState, RequestId, VERSION};

async fn request_id(mut req: Request, next: Next) -> Response {
    let RequestId(id) = RequestId::assign(req.headers());
    req.extensions_mut().insert(RequestId(id.clone()));
    let template = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("-", |p| p.as_str())
        .to_string();
    // The request's span: every step it takes (auth, policy.decide, sandbox.run, audit.append)
    // is a child of it, on whatever task the step runs. `exec_id` is recorded once admitted.
    let span = tracing::info_span!(
        "http.request",
        otel.kind = "server",
        http.request.method = %req.method(),
        http.route = %template,
        request_id = %id,
        exec_id = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    crate::telemetry::set_remote_parent(&span, req.headers());
    let route = status_log().map(|_| (req.method().clone(), template));
    let mut resp = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", resp.status().as_u16());
    if let (Some(log), Some((method, template))) = (status_log(), route) {
        use std::io::Write as _;
        let line = format!("{method} {template} {}\n", resp.status().as_u16());
        let mut f = log.lock().unwrap_or_else(|p| p.into_inner());
        let _ = f.write_all(line.as_bytes());
    }
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Where every answer's `METHOD route status` is appended, when `EXECUTOR_ARM_STATUS_LOG` names
/// a file: the record of which documented statuses a test suite made the daemon answer.
fn status_log() -> Option<&'static std::sync::Mutex<std::fs::File>> {
    static LOG: std::sync::OnceLock<Option<std::sync::Mutex<std::fs::File>>> =
        std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let path = std::env::var_os("EXECUTOR_ARM_STATUS_LOG")?;
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            Ok(f) => Some(std::sync::Mutex::new(f)),
            Err(e) => {
                tracing::warn!(error = %e, "EXECUTOR_ARM_STATUS_LOG cannot be opened");
                None
            }
        }
    })
    .as_ref()
}

/// The routes of one session, behind the hand-off to the replica that holds it.
fn session_routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route(
            "/v1/sandbox/sessions/{id}",
            get(sessions::get).delete(sessions::delete),
        )
        .route("/v1/sandbox/sessions/{id}/exec", post(sessions::exec))
        .route("/v1/sandbox/sessions/{id}/pause", post(sessions::pause))
        .route("/v1/sandbox/sessions/{id}/resume", post(sessions::resume))
        .route(
            "/v1/sandbox/sessions/{id}/execs/{exec_id}",
            get(sessions::exec_get),
        )
        .route(
            "/v1/sandbox/sessions/{id}/execs/{exec_id}/receipt",
            get(receipts::session_exec_receipt),
        )
        .route(
            "/v1/sandbox/sessions/{id}/execs/{exec_id}/stream",
            get(sessions::exec_stream),
        )
        .route(
            "/v1/sandbox/sessions/{id}/execs/{exec_id}/cancel",
            post(sessions::exec_cancel),
        )
        .route(
            "/v1/sandbox/sessions/{id}/execs/{exec_id}/stdin",
            post(processes::exec_stdin),
        )
        .route("/v1/sandbox/sessions/{id}/processes", get(processes::list))
        .route(
            "/v1/sandbox/sessions/{id}/processes/{process_id}/stream",
            get(processes::stream),
        )
        .route(
            "/v1/sandbox/sessions/{id}/processes/{process_id}/output",
            get(processes::output),
        )
        .route(
            "/v1/sandbox/sessions/{id}/processes/{process_id}/stdin",
            post(processes::stdin),
        )
        .route(
            "/v1/sandbox/sessions/{id}/processes/{process_id}/signal",
            post(processes::signal),
        )
        .route(
            "/v1/sandbox/sessions/{id}/terminal",
            get(terminal::terminal),
        )
        .route("/v1/sandbox/sessions/{id}/ports/{port}", any(ports::proxy))
        .route("/v1/sandbox/sessions/{id}/ports/{port}/", any(ports::proxy))
        .route(
            "/v1/sandbox/sessions/{id}/ports/{port}/{*path}",
            any(ports::proxy),
        )
        .route("/v1/sandbox/sessions/{id}/files", get(sessions::list_files))
        .route(
            "/v1/sandbox/sessions/{id}/archive",
            get(sessions::get_archive).put(sessions::put_archive),
        )
        .route(
            "/v1/sandbox/sessions/{id}/files/{*path}",
            get(sessions::get_file).put(sessions::put_file),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state,
            sessions::to_owner,
        ))
}

pub fn router(state: Arc<AppState>) -> Router {
    router_with(state, Router::new())
}

/// The REST API's routes with `extra` routes of another front end (`/mcp`) beside them, under
/// the same request ids, 404 and 405.
pub fn router_with(state: Arc<AppState>, extra: Router<Arc<AppState>>) -> Router {
    Router::new()
        .route("/execute", post(execute::execute))
        .route("/v1/executions/{exec_id}", get(executions::get))
        .route("/v1/executions/{exec_id}/cancel", post(executions::cancel))
        .route("/v1/executions/{exec_id}/stream", get(executions::stream))
        .route(
            "/v1/executions/{exec_id}/receipt",
            get(receipts::execution_receipt),
        )
        .route("/v1/receipts/keys", get(receipts::list_keys))
        .route("/v1/sandbox/sessions", post(sessions::create))
        .merge(session_routes(state.clone()))
        .route("/capabilities", get(ops::capabilities))
        .route("/health", get(ops::health))
        .route("/livez", get(ops::livez))
        .route("/ready", get(ops::ready))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/executors", get(ops::executors))
        .route("/openapi.json", get(openapi::serve_document))
        .route("/docs", get(openapi::docs))
        .merge(extra)
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(axum::middleware::from_fn(request_id))
        .with_state(state)
}

/// Serves the REST API and the `extra` routes of other front ends (see [`router_with`]) until
/// `shutdown` resolves, then drains: /readyz turns 503 at once, the listener
/// closes, running executions (async ones included) get `shutdown_grace_seconds`, then are
/// killed; returns when every connection and every run is done.
pub async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    extra: Router<Arc<AppState>>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let app = router_with(state.clone(), extra);
    let header_timeout = Duration::from_millis(state.config.server.header_read_timeout_ms);
    // Graceful drain by hand (hyper-util's does not take upgradeable connections): each
    // connection holds a receiver; the drain tells them all, then waits until every one is gone.
    let (graceful, _) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    let flusher = tokio::spawn(flush_suppressed_refusals(state.clone()));
    // This replica's receipts key, for every replica to list.
    let key_publisher = tokio::spawn(crate::calls::receipts::publish_key(state.clone()));
    // Signed checkpoints of the audit log, and one more once the daemon has drained.
    let checkpoints_stop = tokio_util::sync::CancellationToken::new();
    let checkpointer = crate::provenance::checkpoint::spawn_checkpointer(
        state.audit.clone(),
        state.signing.checkpoints.clone(),
        state.config.audit.checkpoint_every_lines,
        Duration::from_secs(state.config.audit.checkpoint_every_seconds),
        checkpoints_stop.clone(),
    );
    state.sessions.spawn_reaper();
    loop {
        let stream = tokio::select! {
            s = accept(&listener) => s,
            _ = &mut shutdown => break,
        };
        serve_connection(stream, app.clone(), header_timeout, graceful.subscribe());
    }
    state.draining.store(true, Ordering::SeqCst);
    // Requests still waiting for a run slot are refused now: nothing new starts while draining.
    state.executions.close_queue();
    drop(listener);
    tracing::info!("shutdown: draining in-flight executions");
    let grace = Duration::from_secs(state.config.server.shutdown_grace_seconds);
    let st = state.clone();
    // Connections end with their answers; async runs have none to wait for, so they are waited
    // for on their own.
    let drained = async {
        let _ = graceful.send(());
        graceful.closed().await;
        st.executions.wait_idle().await;
    };
    tokio::select! {
        _ = drained => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace period over: killing running executions");
            st.executions.kill_running();
            // Give killed runs a moment to clean up and answer.
            let _ = tokio::time::timeout(Duration::from_secs(5), st.executions.wait_idle()).await;
        }
    }
    // Sessions are paused (or end) with the daemon: their execs were answered or killed above.
    state.sessions.close_all().await;
    state.executions.shutdown_backends().await;
    flusher.abort();
    key_publisher.abort();
    flush_suppressed(&state);
    checkpoints_stop.cancel();
    if let Err(e) = checkpointer.await {
        tracing::error!(target: "audit", error = %e, "the audit checkpointer failed");
    }
}

/// The next connection of `listener`; a failed accept (EMFILE and friends) backs off instead of
/// spinning.
async fn accept(listener: &TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => return stream,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves one accepted connection on a task of its own: HTTP/1.1 with keep-alive, the header
/// read timeout, and upgrades (a session's terminal is a WebSocket; the upgraded socket lives on
/// in the route's own task). A change on `drain` ends it gracefully (after its answer).
fn serve_connection(
    stream: tokio::net::TcpStream,
    app: Router,
    header_timeout: Duration,
    mut drain: tokio::sync::watch::Receiver<()>,
) {
    let _ = stream.set_nodelay(true);
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    let conn = builder
        .serve_connection(TokioIo::new(stream), svc)
        .with_upgrades();
    tokio::spawn(async move {
        let mut conn = std::pin::pin!(conn);
        let ended = tokio::select! {
            r = conn.as_mut() => r,
            _ = drain.changed() => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = ended {
            tracing::debug!(error = %e, "connection ended with an error");
        }
        drop(drain);
    });
}

/// Serves `app` on a listener of its own (a front end's, e.g. the E2B data plane) as the
/// daemon's listener is served (header read timeout, keep-alive, back-off on accept errors),
/// until `shutdown`; then its connections end after their answers, within `grace`.
pub async fn serve_listener(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    grace: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let (graceful, _) = tokio::sync::watch::channel(());
    loop {
        let stream = tokio::select! {
            s = accept(&listener) => s,
            _ = shutdown.cancelled() => break,
        };
        serve_connection(stream, app.clone(), header_timeout, graceful.subscribe());
    }
    drop(listener);
    let _ = graceful.send(());
    let _ = tokio::time::timeout(grace, graceful.closed()).await;
}

/// How often counts of suppressed refusals are written when no other line comes to carry them.
const SUPPRESSED_FLUSH_INTERVAL: Duration = Duration::from_secs(5);

async fn flush_suppressed_refusals(state: Arc<AppState>) {
    let mut every = tokio::time::interval(SUPPRESSED_FLUSH_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        flush_suppressed(&state);
    }
}

fn flush_suppressed(state: &AppState) {
    if let Err(e) = state.audit.flush_suppressed() {
        state
            .metrics
            .audit_append_failures
            .with_label_values(&["refusals_suppressed"])
            .increment(1);
        // The counts stay pending for the next flush; at shutdown this line is their only record.
        let pending = state
            .audit
            .suppressed_pending()
            .and_then(|p| serde_json::to_string(&p).ok())
            .unwrap_or_default();
        tracing::error!(error = %e, event = "refusals_suppressed", %pending, "audit append failed");
    }
}
