//! executor-arm: a hardened daemon that runs allowlisted commands and registered external
//! executors in sandboxes, behind `POST /execute`.
//!
//! # Layout
//! A request goes down through these modules, never up:
//! - `api`: HTTP only: routes, reading each request's headers, body and query, rendering every
//!   answer's status, headers and body; each route file (`api::execute`, `api::sessions`, ...)
//!   parses its request into an `ExecutionRequest`, `api::run` reads how a run's caller waits
//!   and renders what `calls::run` serves; see `api`'s own layout.
//! - `calls`: what every front end does with a call, below `api` and `mcp` and above the
//!   services: the shared state (`AppState`), who is calling (`calls::caller`), the error
//!   vocabulary of answers (`ApiError`), and what every run request shares (`calls::run`: run
//!   modes, idempotency, the client's disconnect, admission and start, the answer as status and
//!   body). Front ends render its answers on their own wire.
//! - `mcp`: the Model Context Protocol front end (`/mcp`, the official SDK), a sibling of `api`:
//!   every tool goes through `calls` to the execution and sessions services as the REST routes
//!   do, so a call is the same run as its REST twin, with the same checks, audit lines and
//!   metrics. `main.rs` mounts its route beside the REST API's.
//! - `e2b`: the E2B-compatible API (the official E2B SDKs), a sibling of `api` and `mcp`: its
//!   control plane under `/e2b`, its data plane (envd's Connect services and `/files`) on a
//!   listener of its own. A sandbox is a session; each command and file operation goes through
//!   `calls` as a background process of it.
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
pub mod calls;
pub mod config;
pub mod e2b;
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
