//! Assembling the daemon from its configuration.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::sync::{Semaphore, watch};

use crate::api::AppState;
use crate::auth::Authenticator;
use crate::config::Config;
use crate::executors::Registry;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::provenance::audit::AuditLog;
use crate::sandbox::local::LocalSandbox;
use crate::sandbox::{BackendKind, Sandbox};
use crate::state::StateStore;
use crate::state::memory::MemoryStore;
use crate::state::redis_store::RedisStore;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("auth: {0}")]
    Keys(#[from] crate::auth::KeyError),
    #[error("no verification key configured: set auth.jwt_secret_file (EXECUTOR_ARM_JWT_SECRET_FILE), auth.public_keys, auth.jwks_file or auth.static_tokens")]
    NoKeys,
    #[error(transparent)]
    Audit(#[from] crate::provenance::audit::AuditError),
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyLoadError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
}

/// Directory for the daemon's runtime files (the empty mount point of sandbox roots).
pub fn runtime_dir() -> PathBuf {
    let run = PathBuf::from("/run/executor-arm");
    if std::fs::create_dir_all(&run).is_ok() {
        return run;
    }
    std::env::temp_dir().join("executor-arm-run")
}

pub async fn build(config: Config) -> Result<Arc<AppState>, BuildError> {
    let auth = Authenticator::new(&config.auth)?;
    if !auth.has_keys() {
        return Err(BuildError::NoKeys);
    }
    let audit = AuditLog::open(&config.audit.path)?;
    let policy = Policy::load(&config)?;
    let executors = Registry::load(&config.executors.dir);
    let store: Arc<dyn StateStore> = match &config.state.redis_url {
        Some(url) => Arc::new(RedisStore::connect(url).await?),
        None => Arc::new(MemoryStore::new()),
    };
    let mut backends: BTreeMap<BackendKind, Arc<dyn Sandbox>> = BTreeMap::new();
    let local = LocalSandbox::new(&config.sandbox.local.cgroup_name, &runtime_dir(), config.server.concurrency.local);
    let host_probe = Some(local.probe().clone());
    backends.insert(BackendKind::Local, Arc::new(local));
    let slots = BackendKind::ALL
        .iter()
        .map(|b| (*b, Arc::new(Semaphore::new(config.server.concurrency.for_backend(*b)))))
        .collect();
    let (kill_switch, _) = watch::channel(false);
    Ok(Arc::new(AppState {
        policy,
        executors,
        auth,
        audit,
        store,
        metrics: Metrics::new(),
        backends,
        slots,
        draining: AtomicBool::new(false),
        kill_switch,
        instance_id: format!("{}-{}", hostname(), std::process::id()),
        host_probe,
        config,
    }))
}

fn hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "executor-arm".into())
}
