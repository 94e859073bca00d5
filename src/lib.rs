//! executor-arm: a hardened daemon that runs allowlisted commands and registered external
//! executors in sandboxes, behind `POST /execute`.
//!
//! # Layout
//! A request goes down through these modules, never up:
//! - `api`: HTTP only: routes, authentication of the caller, request parsing, idempotency, errors
//!   to statuses and bodies; each route file (`api::execute`, `api::sessions`, ...) parses its
//!   request into an `ExecutionRequest`, `api::caller` reads who calls, `api::run` holds what
//!   every run route shares (modes, idempotency, disconnects, answers); see `api`'s own layout.
//! - `mcp`: the Model Context Protocol front end (`/mcp`, the official SDK), beside `api` and
//!   using it (never the other way): each tool call is handed in-process to the REST handler of
//!   its twin (`POST /execute`, the session and run routes), which hands it to the execution or
//!   sessions service, so it is the same run with the same checks, audit lines and metrics;
//!   `mcp` only translates the wire formats. `main.rs` mounts its route beside the REST API's.
//! - `execution`: the execution service, no HTTP: decide → admit → run → record (provenance, one
//!   typed audit event per line, metrics), the one path every execution takes. One file a step:
//!   `request` (the request and its kind of run, an `Action`), `plan` (deciding it: one match
//!   over the kinds), `admission` (run slots, their queue, single-use claims), `run` (an admitted
//!   execution run to its result), `result` (the result and the typed `ExecutionError`),
//!   `record` (audit lines, metrics), `runs` (live runs and their stored records), `session`
//!   (where a session's exec runs and under which limits: the vocabulary `sessions` hands
//!   down); `mod.rs` holds the service. The api renders every answer's status and body.
//! - `sessions`: sandboxes kept across execs, between `api` and `execution`: the lifecycle
//!   (owner, tenant, limits, lifetimes; `mod.rs`), one session's state (`session`), the exec
//!   plan of a session (`exec`: an exec turned into an `ExecutionRequest`), its file calls
//!   (`files`) and a local session's host workspace (`workspace`). Each exec is an execution of
//!   the execution service; the backend halves of kept sandboxes and file calls stay in
//!   `sandbox` (`sandbox::files`, `sandbox::docker::kept`).
//! - `auth`: service and capability tokens (JWT, static), verified into a grant.
//! - `policy`: allowlist, sandbox profiles, argument policies, limits → a resolved `Plan`.
//! - `executors`: operator-registered external executors (YAML) and their envelope.
//! - `sandbox`: the `Sandbox` trait and its backends (`local`, `docker` for runc and gVisor).
//! - `egress`: the outbound proxy and resolver a sandbox with network reaches the world through,
//!   and the judge and relay of its raw TCP rules.
//! - `provenance`: result hashes and the hash-chained audit log.
//! - `state`: replay and idempotency records (embedded, or Redis for several replicas).
//! - `config`, `vocabulary`, `metrics`: typed configuration, the shared words (action types,
//!   capabilities), Prometheus series.
//! - `telemetry`: the JSON log lines and, when configured, OTLP export of the request spans.
//! - `app`: builds the whole daemon from a config; `main.rs` is the command line around it.
//!
//! # Tests
//! - Unit tests sit at the end of the file they test, in `#[cfg(test)] mod tests { … }`. They
//!   need nothing of the host: they pass as an unprivileged user with no dockerd or Redis
//!   (`scripts/test-unit-unprivileged.sh` runs them as `nobody`). The few that need root say so
//!   in `#[ignore = "needs root …"]`; `scripts/test-all.sh` runs those as root.
//! - Integration tests (`tests/*.rs`) drive the built daemon over HTTP, with helpers in
//!   `tests/common/`. They need root, and dockerd or Redis where they use them; without one they
//!   fail naming what is missing, never skip.

pub mod api;
pub mod app;
pub mod auth;
pub mod config;
pub mod egress;
pub mod execution;
pub mod executors;
#[cfg(any(fuzzing, test))]
pub mod fuzzing;
pub mod mcp;
pub mod metrics;
pub mod policy;
pub mod provenance;
pub mod sandbox;
pub mod sessions;
pub mod state;
pub mod telemetry;
pub mod vocabulary;
