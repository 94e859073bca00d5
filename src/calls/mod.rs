//! What every front end does with a call, whichever wire it came on (the REST API in `api`, the
//! Model Context Protocol in `mcp`): who is calling, the error a call ends with, and the services
//! and settings a call may use.
//!
//! Owns: the daemon's shared state ([`AppState`]), the calling service and its grant (service and
//! capability tokens, the tenant, the request id), the one error vocabulary of answers
//! ([`ApiError`]: status, `error_type`, body), and connections kept into sessions' sandboxes for
//! the ports proxy. It may use HTTP's types (a header map, a body) because the front ends all
//! speak HTTP underneath. Must not: serve a route or render an HTTP answer (the front ends do),
//! or decide, admit or run anything (the execution and sessions services do).
//!
//! # Files
//! - `state.rs`: [`AppState`], what every front end's handler may use.
//! - `caller.rs`: who is calling and what it sent: request id, service and capability tokens,
//!   tenant, a body read within its limits; the audited 401.
//! - `error.rs`: [`ApiError`], its statuses and bodies.
//! - `execute.rs`: `/execute`'s request and its checks, whichever front end carries it.
//! - `run.rs`: what every run request shares: run modes, idempotency, the client's disconnect,
//!   admission and start, the answer.
//! - `executions.rs`: a run's status and its cancel.
//! - `forward.rs`: handing a call to the replica that holds its run or session (a peer call).
//! - `hop.rs`: the hop-by-hop headers that a message passed on as it came leaves behind.
//! - `sessions.rs`: a session call's owner and the caller's session or exec; create, pause,
//!   resume, exec, delete, files.
//! - `processes.rs`: a session's background processes (list, output, stdin, signals) and a
//!   running exec's stdin.
//! - `terminal.rs`: a session's terminal, its admission and start.
//! - `receipts.rs`: the public keys that verify receipts (this replica's, configured ones,
//!   other replicas' through the store).
//! - `port_pool.rs`: connections into sessions' sandboxes kept between proxied requests.

pub mod caller;
pub mod error;
pub mod execute;
pub mod executions;
pub mod forward;
pub(crate) mod hop;
pub(crate) mod port_pool;
pub mod processes;
pub mod receipts;
pub mod run;
pub mod sessions;
pub mod state;
pub mod terminal;

pub use caller::RequestId;
pub use error::ApiError;
pub use state::AppState;

/// The daemon's version, as `/health`, `/capabilities` and the MCP server info give it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
