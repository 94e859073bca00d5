//! executor-arm's in-container supervisor: its wire protocol ([`protocol`]) and the local routes
//! of raw TCP rules ([`routes`]), shared by the daemon and the supervisor binary (`src/main.rs`,
//! PID 1 of every docker/gvisor sandbox).

pub mod archive;
pub mod protocol;
pub mod routes;
