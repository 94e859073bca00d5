//! Assembling the daemon from its configuration.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::auth::Authenticator;
use crate::calls::AppState;
use crate::config::Config;
use crate::execution::ExecutionService;
use crate::executors::Registry;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::provenance::audit::AuditLog;
use crate::sandbox::docker::{DockerSandbox, PoolMetrics};
use crate::sandbox::local::LocalSandbox;
use crate::sandbox::{BackendKind, Sandbox};
use crate::state::StateStore;
use crate::state::durable::DurableStore;
use crate::state::redis_store::RedisStore;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("auth: {0}")]
    Keys(#[from] crate::auth::KeyError),
    #[error(
        "no verification key configured: set auth.jwt_secret_file (EXECUTOR_ARM_JWT_SECRET_FILE), auth.public_keys, auth.jwks_file or auth.static_tokens"
    )]
    NoKeys,
    #[error(transparent)]
    Audit(#[from] crate::provenance::audit::AuditError),
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyLoadError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error(transparent)]
    Egress(#[from] crate::egress::EgressError),
    #[error("sandbox.local.uid_first / uid_count: {0}")]
    Uids(String),
    #[error("receipts: {0}")]
    Receipts(#[from] crate::provenance::keys::KeyError),
    #[error("audit checkpoints: {0}")]
    Checkpoints(std::io::Error),
}

/// Loads (or, when missing, makes and logs) the signing key, reads the other public keys and
/// prepares the checkpoint directory. A key file group or others may access stops startup.
pub fn signing(config: &Config) -> Result<crate::provenance::Signing, BuildError> {
    use crate::provenance::keys;
    let path = config.receipts.signing_key_file(&config.state);
    let (key, source) = keys::load_or_generate(&path)?;
    let keyid = keys::keyid(&key.verifying_key());
    match source {
        keys::KeySource::Generated => tracing::warn!(
            path = %path.display(), %keyid,
            "no receipts signing key: made one (publish its public key: executor-arm receipt pubkey)"
        ),
        keys::KeySource::Loaded => {
            tracing::info!(path = %path.display(), %keyid, "receipts signing key")
        }
    }
    let mut keys = keys::KeySet::from_files(&config.receipts.public_key_files)?;
    keys.insert(key.verifying_key());
    let checkpoints = crate::provenance::checkpoint::CheckpointWriter::new(
        &config.audit.checkpoint_dir(),
        &config.audit.checkpoint_origin(),
        key.clone(),
    )
    .map_err(BuildError::Checkpoints)?;
    Ok(crate::provenance::Signing {
        key,
        keys,
        checkpoints: Arc::new(checkpoints),
    })
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
    let signing = Arc::new(signing(&config)?);
    let instance_id = format!("{}-{}", hostname(), std::process::id());
    let metrics = Arc::new(Metrics::new());
    let audit = Arc::new(
        AuditLog::open(&config.audit.path, &instance_id)?
            .with_refusal_rate(config.audit.refusal_rate()),
    );
    if audit.recovered().is_some() {
        metrics.audit_segments_recovered.increment(1);
    }
    let mut policy = Policy::load(&config)?;
    let executors = Registry::load(&config.executors.dir);
    let store: Arc<dyn StateStore> = match &config.state.redis_url {
        Some(url) => {
            Arc::new(RedisStore::connect(url, config.state.redis_ca_file.as_deref()).await?)
        }
        None => {
            let (dir, max_bytes, leeway) = (
                config.state.dir.clone(),
                config.state.idempotency_max_bytes,
                config.auth.leeway_seconds,
            );
            // Opening checks the whole file: off the runtime's threads.
            let opened = tokio::task::spawn_blocking(move || {
                DurableStore::open(&dir, max_bytes, leeway, crate::state::durable::LOCK_WAIT)
            })
            .await
            .map_err(|e| crate::state::StateError::Unavailable(format!("state file: {e}")))??;
            Arc::new(opened)
        }
    };
    crate::execution::record::record_interrupted(
        &audit,
        &*store,
        &metrics,
        std::time::Duration::from_secs(config.executions.retention_seconds),
        crate::calls::error::unanswered,
    )
    .await;
    let mut backends: BTreeMap<BackendKind, Arc<dyn Sandbox>> = BTreeMap::new();
    let egress = egress_settings(&config)?;
    let l = &config.sandbox.local;
    let uids = crate::sandbox::uids::UidRange::new(l.uid_first, l.uid_count, &l.uid_lock_dir)
        .map_err(BuildError::Uids)?;
    // A host without one of these files has no such uids: a missing file reads as empty.
    let host_file = |p: &str| match std::fs::read_to_string(p) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        r => r.map_err(|e| BuildError::Uids(format!("{p}: {e}"))),
    };
    uids.check_host(&host_file("/etc/passwd")?, &host_file("/etc/subuid")?)
        .map_err(BuildError::Uids)?;
    let uids = Arc::new(uids);
    let local = LocalSandbox::new(
        &l.cgroup_name,
        l.warm_slots,
        l.cgroup_favor_dynmods,
        &runtime_dir(),
        Some(egress.clone()),
        uids.clone(),
    );
    let host_probe = Some(local.probe().clone());
    backends.insert(BackendKind::Local, Arc::new(local));
    for kind in [BackendKind::Docker, BackendKind::Gvisor] {
        let pool = PoolMetrics {
            size: metrics.pool_size.clone(),
            events: metrics.pool_events.clone(),
        };
        let docker_egress = crate::sandbox::docker::egress::EgressSettings {
            resolver: egress.resolver.clone(),
            deny_addrs: egress.deny_addrs.clone(),
            port: egress.port,
            dir: config.sandbox.docker.egress_dir.clone(),
        };
        let docker = DockerSandbox::new(
            kind,
            &config.sandbox.docker,
            &instance_id,
            Some(pool),
            Some(docker_egress),
            uids.clone(),
        );
        backends.insert(kind, Arc::new(docker));
    }
    policy.egress_backends = backends
        .iter()
        .filter(|(_, b)| b.supports_egress())
        .map(|(k, _)| *k)
        .collect();
    let executions = Arc::new(ExecutionService::new(
        &config,
        &instance_id,
        policy,
        executors,
        backends,
        store.clone(),
        audit.clone(),
        metrics.clone(),
        crate::calls::error::unanswered,
        Some(Arc::new(signing.key.clone())),
    ));
    let sessions = crate::sessions::SessionService::new(
        &config.sessions,
        &config.sessions.store_dir(&config.state),
        executions.clone(),
        uids,
        config
            .sandbox
            .docker
            .supervisor
            .clone()
            .unwrap_or_else(crate::sandbox::docker::supervisor::default_path),
    );
    Ok(Arc::new(AppState {
        auth,
        executions,
        sessions,
        file_calls: crate::calls::sessions::file_calls(),
        audit,
        store,
        metrics,
        draining: AtomicBool::new(false),
        open_streams: Default::default(),
        instance_id,
        port_pool: crate::calls::port_pool::PortPool::start(),
        host_probe,
        signing,
        config,
    }))
}

/// The proxy's resolver and the daemon's own addresses (never reachable through it).
fn egress_settings(
    config: &Config,
) -> Result<crate::sandbox::local::egress::EgressSettings, crate::egress::EgressError> {
    let resolver: Arc<dyn crate::egress::Resolver> = match config
        .egress
        .dns_server
        .as_deref()
        .and_then(|s| s.parse().ok())
    {
        Some(server) => Arc::new(crate::egress::DnsResolver::new(
            server,
            std::time::Duration::from_secs(3),
        )?),
        None => Arc::new(crate::egress::SystemResolver),
    };
    let mut deny_addrs = Vec::new();
    if let Ok(listen) = config.server.listen.parse::<std::net::SocketAddr>() {
        // The daemon's port on every address of this host (it may be reachable on all of them),
        // and its listen address itself.
        if let Ok(addrs) = nix::ifaddrs::getifaddrs() {
            for a in addrs {
                let ip = a.address.as_ref().and_then(|s| {
                    s.as_sockaddr_in()
                        .map(|v4| std::net::IpAddr::V4(v4.ip()))
                        .or_else(|| s.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
                });
                if let Some(ip) = ip {
                    deny_addrs.push(std::net::SocketAddr::new(ip, listen.port()));
                }
            }
        }
        deny_addrs.push(listen);
    }
    Ok(crate::sandbox::local::egress::EgressSettings {
        resolver,
        deny_addrs,
        port: config.egress.proxy_port,
    })
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "executor-arm".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EnvOverrides;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn signing_makes_a_missing_key_and_refuses_one_others_may_read() {
        let dir = tempfile::tempdir().unwrap();
        let env = EnvOverrides {
            state_dir: Some(dir.path().join("state").display().to_string()),
            audit_log: Some(dir.path().join("audit.jsonl").display().to_string()),
            ..Default::default()
        };
        let mut config = Config::load(None, &env).unwrap();
        let other = crate::provenance::keys::SigningKey::from_bytes(&[5u8; 32]);
        let other_pub = dir.path().join("old.pub.pem");
        std::fs::write(
            &other_pub,
            crate::provenance::keys::public_key_pem(&other.verifying_key()),
        )
        .unwrap();
        config.receipts.public_key_files = vec![other_pub];
        let s = signing(&config).unwrap();
        let key_file = dir.path().join("state/receipts-ed25519.pem");
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(s.keys.len(), 2, "its own key and the listed one");
        assert!(
            s.keys
                .get(&crate::provenance::keys::keyid(&s.key.verifying_key()))
                .is_some()
        );
        assert_eq!(
            s.checkpoints.dir(),
            dir.path().join("audit.jsonl.checkpoints")
        );
        // The same key at the next start.
        assert_eq!(signing(&config).unwrap().key.to_bytes(), s.key.to_bytes());

        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = signing(&config)
            .err()
            .expect("a group-readable key is refused")
            .to_string();
        assert!(
            e.contains("receipts-ed25519.pem") && e.contains("0640"),
            "{e}"
        );
    }
}
