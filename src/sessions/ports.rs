//! A connection to `127.0.0.1:{port}` inside a session's sandbox, for its ports proxy
//! (`/v1/sandbox/sessions/{id}/ports/{port}/…`).
//!
//! Local sessions have no sandbox of their own between execs: each run, and each background
//! process, has its own network namespace, so a port is looked for in each running background
//! process's namespace in turn (the one published when it started, see
//! [`crate::sandbox::ports::NetnsSlot`]). Docker and gVisor sessions have one container, which
//! its kept sandbox connects into.
//!
//! Owns: which ports a session's proxy may reach (`sessions.allowed_ports`) and where a port is
//! looked for. Must not: know HTTP or open anything on the host's side.

use std::sync::Arc;
use std::time::Duration;

use super::SessionService;
use super::session::{Place, Session};
use crate::sandbox::ports::{CONNECT_TIMEOUT, PortConn, PortError};

/// Why a session's port was not reached.
#[derive(Debug, thiserror::Error)]
pub enum PortRefusal {
    /// The port is outside `sessions.allowed_ports` (400).
    #[error("port {port} is not one a session's proxy reaches (sessions.allowed_ports: {allowed})")]
    NotAllowed { port: u16, allowed: String },
    /// Nothing listens on it (502).
    #[error("{0}")]
    Closed(String),
    /// The sandbox could not be entered (503).
    #[error("{0}")]
    Unavailable(String),
}

impl From<PortError> for PortRefusal {
    fn from(e: PortError) -> Self {
        match e {
            PortError::Closed(m) => PortRefusal::Closed(m),
            PortError::Unavailable(m) => PortRefusal::Unavailable(m),
        }
    }
}

impl SessionService {
    /// Whether `port` is one the ports proxy may reach.
    pub fn port_allowed(&self, port: u16) -> Result<(), PortRefusal> {
        if self.config.allowed_ports.contains(port) {
            return Ok(());
        }
        Err(PortRefusal::NotAllowed {
            port,
            allowed: self.config.allowed_ports.describe(),
        })
    }

    /// A connection to `127.0.0.1:port` inside `session`'s sandbox.
    pub async fn connect_port(
        &self,
        session: &Arc<Session>,
        port: u16,
    ) -> Result<PortConn, PortRefusal> {
        self.port_allowed(port)?;
        match &session.place {
            // Bounded: a listener that never accepts holds no caller (gVisor's connect runs
            // in the container, where the daemon's own timeout cannot reach).
            Place::Kept(kept) => match tokio::time::timeout(
                CONNECT_TIMEOUT + Duration::from_secs(5),
                kept.connect_port(port),
            )
            .await
            {
                Ok(r) => Ok(r?),
                Err(_) => Err(PortRefusal::Closed(format!(
                    "port {port} in the session's sandbox accepted no connection within {}s",
                    CONNECT_TIMEOUT.as_secs()
                ))),
            },
            Place::Host(_) => {
                let mut last = None;
                for p in session.processes.all().iter().filter(|p| !p.ended()) {
                    let Some(ns) = p.controls.netns().get() else {
                        continue;
                    };
                    match crate::sandbox::ports::connect_in_netns(ns, port).await {
                        Ok(s) => return Ok(Box::new(s)),
                        Err(e) => last = Some(e),
                    }
                }
                Err(PortRefusal::Closed(match last {
                    Some(e) => {
                        format!("nothing listens on port {port} in the session's sandbox ({e})")
                    }
                    None => format!(
                        "nothing listens on port {port} in the session's sandbox: no background process of it is running"
                    ),
                }))
            }
        }
    }
}
