//! executor-arm: a hardened daemon that runs allowlisted commands and registered external
//! executors in sandboxes, behind `POST /execute`.

pub mod api;
pub mod app;
pub mod auth;
pub mod config;
pub mod egress;
pub mod executors;
#[cfg(fuzzing)]
pub mod fuzzing;
pub mod metrics;
pub mod policy;
pub mod provenance;
pub mod sandbox;
pub mod state;
