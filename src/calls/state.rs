//! What every request handler may use: the daemon's services and configuration, shared by all
//! routes.
//!
//! Owns: the handlers' shared state. Must not: serve a route.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::auth::Authenticator;
use crate::config::Config;
use crate::execution::ExecutionService;
use crate::metrics::Metrics;
use crate::provenance::audit::AuditLog;
use crate::state::StateStore;

/// Everything a request handler may use.
pub struct AppState {
    pub config: Config,
    pub auth: Authenticator,
    /// Decides, admits, runs and records executions; holds the policy, the executor registry and
    /// the backends.
    pub executions: Arc<ExecutionService>,
    /// Sessions: sandboxes kept across execs.
    pub sessions: Arc<crate::sessions::SessionService>,
    /// Session file transfers in progress (see `sessions::file_permit`).
    pub file_calls: Arc<tokio::sync::Semaphore>,
    /// The audit log, the state store and the metrics the execution service shares.
    pub audit: Arc<AuditLog>,
    pub store: Arc<dyn StateStore>,
    pub metrics: Arc<Metrics>,
    pub draining: AtomicBool,
    /// Server-Sent Event streams open now (at most `executions.max_open_streams`).
    pub open_streams: std::sync::atomic::AtomicUsize,
    pub instance_id: String,
    /// Connections into sessions' sandboxes kept for the ports proxy.
    pub(crate) port_pool: Arc<super::port_pool::PortPool>,
    /// The key that signs receipts and audit checkpoints, the public keys that verify them, and
    /// the writer of this log's checkpoints.
    pub signing: Arc<crate::provenance::Signing>,
    /// What the kernel offers the local backend (None when it is not configured).
    pub host_probe: Option<crate::sandbox::local::probe::HostProbe>,
}

impl AppState {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}
