//! The proxy serving one execution, from the moment its listener exists until the sandbox is
//! gone: a task that accepts on the listener the backend bound, and the records it leaves.
//!
//! Backend-neutral: the caller decides where the listener lives (a network namespace, a unix
//! socket bind-mounted into a container) and when the execution is over.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use super::dns::Resolver;
use super::policy::EgressPolicy;
use super::proxy::{ConnRecord, ProxyListener, ProxySession};
use super::tcp::{TcpListeners, TcpPolicy};

/// How long [`ProxyRun::finish`] lets connections still open wind down.
const FINISH_GRACE: Duration = Duration::from_secs(2);

/// One execution's proxy. Dropping it aborts the task (and with it every connection), so an
/// abandoned run leaves no listener or task behind.
pub struct ProxyRun {
    session: Arc<ProxySession>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// Raw TCP by rule, when the run has any ([`ProxyRun::serve_tcp`]).
    tcp: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
}

impl ProxyRun {
    /// Starts serving `listener` under `policy`. Must be called inside a tokio runtime.
    pub fn start(
        policy: EgressPolicy,
        resolver: Arc<dyn Resolver>,
        listener: impl Into<ProxyListener>,
    ) -> ProxyRun {
        let listener = listener.into();
        let session = Arc::new(ProxySession::new(Arc::new(policy), resolver));
        let (stop, stopped) = oneshot::channel::<()>();
        let s = session.clone();
        let task = tokio::spawn(async move {
            s.serve(listener, async {
                let _ = stopped.await;
            })
            .await;
        });
        ProxyRun {
            session,
            stop: Some(stop),
            task,
            tcp: None,
        }
    }

    /// Also serves the run's raw TCP `listeners` under `policy`, sharing the proxy's bandwidth,
    /// byte cap, connection limits and records. Must be called inside a tokio runtime.
    pub fn serve_tcp(&mut self, policy: TcpPolicy, listeners: TcpListeners) {
        let (stop, stopped) = watch::channel(false);
        let inner = self.session.inner().clone();
        let task = tokio::spawn(super::tcp::serve(
            inner,
            Arc::new(policy),
            listeners,
            stopped,
        ));
        if let Some((old, task)) = self.tcp.replace((stop, task)) {
            let _ = old.send(true);
            task.abort();
        }
    }

    /// The records filed so far (tests wait on them).
    #[cfg(test)]
    pub(crate) fn session_records(&self) -> Vec<ConnRecord> {
        self.session.records()
    }

    /// Stops accepting, closes what is still open (the sandbox is gone) and returns every
    /// connection's record.
    pub async fn finish(mut self) -> Vec<ConnRecord> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some((stop, _)) = &self.tcp {
            let _ = stop.send(true);
        }
        let _ = tokio::time::timeout(FINISH_GRACE, &mut self.task).await;
        self.task.abort();
        if let Some((_, task)) = self.tcp.as_mut() {
            let _ = tokio::time::timeout(FINISH_GRACE, &mut *task).await;
            task.abort();
        }
        self.session.records()
    }
}

impl Drop for ProxyRun {
    fn drop(&mut self) {
        self.task.abort();
        if let Some((_, task)) = &self.tcp {
            task.abort();
        }
    }
}

/// What a sandbox reaches without the proxy: its own loopback (a server the command or a session
/// started), which the proxy would refuse.
const NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// Proxy environment for a command whose proxy listens on `127.0.0.1:port`: every spelling curl,
/// wget, pip, npm and git read, and `NO_PROXY` for the sandbox's own loopback.
pub fn proxy_env(port: u16) -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{port}");
    let proxied = [
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "all_proxy",
    ]
    .iter()
    .map(|k| (k.to_string(), url.clone()));
    let direct = ["NO_PROXY", "no_proxy"]
        .iter()
        .map(|k| (k.to_string(), NO_PROXY.to_string()));
    proxied.chain(direct).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::StaticHosts;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn policy() -> EgressPolicy {
        EgressPolicy {
            allow_hosts: vec!["allowed.test".into()],
            allow_ports: vec![80],
            allow_cidrs: vec![],
            deny_addrs: vec![],
            bandwidth_bytes_per_sec: 1 << 20,
            byte_cap: 1 << 20,
        }
    }

    /// A client on the unix socket is served like a TCP one: checked, refused, recorded; the
    /// socket accepts nothing once the run is finished.
    #[tokio::test]
    async fn serves_a_unix_socket_and_records_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proxy.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let hosts = StaticHosts::new(None);
        let run = ProxyRun::start(policy(), Arc::new(hosts), listener);

        let mut c = tokio::net::UnixStream::connect(&path).await.unwrap();
        c.write_all(b"GET http://169.254.169.254/ HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 403 "), "{out}");

        let records = run.finish().await;
        assert_eq!(records.len(), 1, "{records:?}");
        assert!(!records[0].allowed);
        assert_eq!(records[0].host, "169.254.169.254");
        assert_eq!(records[0].status, Some(403));
        assert!(
            tokio::net::UnixStream::connect(&path).await.is_err(),
            "nothing listens after finish"
        );
    }

    #[test]
    fn proxy_env_names_every_spelling_and_leaves_loopback_direct() {
        let env: std::collections::BTreeMap<String, String> = proxy_env(3128).into_iter().collect();
        assert_eq!(env.len(), 8, "{env:?}");
        for k in [
            "http_proxy",
            "https_proxy",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "ALL_PROXY",
            "all_proxy",
        ] {
            assert_eq!(env[k], "http://127.0.0.1:3128", "{k}");
        }
        for k in ["NO_PROXY", "no_proxy"] {
            assert_eq!(env[k], "localhost,127.0.0.1,::1", "{k}");
        }
    }
}
