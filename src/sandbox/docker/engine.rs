//! The container engine operations the docker/gvisor backends use, behind a small trait.
//!
//! Owns: talking to dockerd (bollard, API version negotiated: Debian's dockerd speaks 1.41) and
//! classifying its failures: "unreachable" (socket gone, connection reset, timeout) is what makes
//! a run 503 and triggers reconnect clean-up; "not found" is success for removal. Must not: decide
//! anything about runs. Tests of the pool and janitor use a recording fake of [`Engine`].

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use bollard::models::ContainerCreateBody;
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, KillContainerOptionsBuilder,
    ListContainersOptionsBuilder, ListVolumesOptionsBuilder, RemoveContainerOptionsBuilder,
    RemoveVolumeOptionsBuilder, RenameContainerOptionsBuilder, WaitContainerOptionsBuilder,
};
use bollard::{API_DEFAULT_VERSION, Docker};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::io::AsyncWrite;

/// Seconds bollard allows one engine request.
const REQUEST_TIMEOUT_SECS: u64 = 30;
/// How long a removal waits for the container to go when dockerd answers "not yet".
const REMOVAL_WAIT: Duration = Duration::from_secs(30);
/// How often it looks.
const REMOVAL_POLL: Duration = Duration::from_millis(100);

/// Whether dockerd's answer to a forced removal means the container is still on its way out
/// (another removal in progress, or its processes slower to die than dockerd waits).
fn removal_not_yet_done(message: &str) -> bool {
    (message.starts_with("409") && message.contains("already in progress"))
        || (message.starts_with("500") && message.contains("did not receive an exit event"))
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("docker engine unreachable: {0}")]
    Unreachable(String),
    /// dockerd accepted the request but did not answer in time (busy, or a runtime stuck on a
    /// saturated sandbox): not a reason to think it went away.
    #[error("docker engine did not answer in time")]
    Timeout,
    #[error("not found: {0}")]
    NotFound(String),
    #[error("docker engine error: {0}")]
    Api(String),
    /// The daemon is exiting: no container is launched any more (see [`super::janitor::Janitor::close_launches`]).
    #[error("the daemon is shutting down")]
    Closed,
}

impl EngineError {
    pub fn is_unreachable(&self) -> bool {
        matches!(self, EngineError::Unreachable(_))
    }
}

impl From<bollard::errors::Error> for EngineError {
    fn from(e: bollard::errors::Error) -> Self {
        use bollard::errors::Error as B;
        match e {
            B::DockerResponseServerError {
                status_code: 404,
                message,
            } => EngineError::NotFound(message.trim().to_string()),
            B::DockerResponseServerError {
                status_code,
                message,
            } => EngineError::Api(format!("{status_code}: {}", message.trim())),
            B::SocketNotFoundError(p) => EngineError::Unreachable(format!("socket {p} not found")),
            B::RequestTimeoutError => EngineError::Timeout,
            e @ (B::IOError { .. } | B::HyperLegacyError { .. } | B::HyperResponseError { .. }) => {
                EngineError::Unreachable(e.to_string())
            }
            other => EngineError::Api(other.to_string()),
        }
    }
}

/// One chunk of a container's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Stdout(Bytes),
    Stderr(Bytes),
}

pub type OutputStream = Pin<Box<dyn Stream<Item = Result<Output, EngineError>> + Send>>;

/// An attach connection: the container's stdin and its demultiplexed stdout/stderr.
pub struct Attached {
    pub input: Pin<Box<dyn AsyncWrite + Send>>,
    pub output: OutputStream,
}

/// What `inspect` tells about a container's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerState {
    pub running: bool,
    /// Host pid of the container's main process (runc: its init; runsc: the sandbox/sentry).
    pub pid: Option<u32>,
    pub exit_code: Option<i64>,
    pub oom_killed: bool,
    pub error: Option<String>,
    /// The host directory of each volume it mounts, by volume name.
    pub volume_sources: HashMap<String, std::path::PathBuf>,
}

/// One container of a listing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listed {
    pub id: String,
    /// `created`, `running`, `exited`, `dead`, ...
    pub state: String,
    pub labels: HashMap<String, String>,
}

/// Engine identity for readiness.
#[derive(Debug, Clone, Default)]
pub struct EngineInfo {
    pub server_version: String,
    pub api_version: String,
    pub runtimes: Vec<String>,
    /// Extra arguments each runtime is registered with.
    pub runtime_args: HashMap<String, Vec<String>>,
}

#[async_trait::async_trait]
pub trait Engine: Send + Sync {
    async fn ping(&self) -> Result<(), EngineError>;
    async fn info(&self) -> Result<EngineInfo, EngineError>;
    /// Creates a container named `name`; returns its id.
    async fn create(&self, name: &str, body: ContainerCreateBody) -> Result<String, EngineError>;
    /// Attaches stdin, stdout and stderr (before start, so no output is missed).
    async fn attach(&self, id: &str) -> Result<Attached, EngineError>;
    async fn start(&self, id: &str) -> Result<(), EngineError>;
    /// SIGKILL; a container that is not running is not an error.
    async fn kill(&self, id: &str) -> Result<(), EngineError>;
    /// SIGTERM to the container's main process (the supervisor passes it on to the command's
    /// processes); a container that is not running is not an error.
    async fn terminate(&self, id: &str) -> Result<(), EngineError>;
    /// SIGUSR1 to the container's main process: a kept container's supervisor kills every
    /// process of its command and stays; a container that is not running is not an error.
    async fn kill_command(&self, id: &str) -> Result<(), EngineError>;
    /// Force-removes; a container that is already gone is not an error.
    async fn remove(&self, id: &str) -> Result<(), EngineError>;
    async fn rename(&self, id: &str, name: &str) -> Result<(), EngineError>;
    /// Returns once the container is not running.
    async fn wait_stopped(&self, id: &str) -> Result<(), EngineError>;
    async fn inspect(&self, id: &str) -> Result<ContainerState, EngineError>;
    /// Every container (any state) carrying all of `labels` (`key=value`).
    async fn list(&self, labels: &[String]) -> Result<Vec<Listed>, EngineError>;
    /// Removes a volume; one that is already gone is not an error, one still in use is.
    async fn remove_volume(&self, name: &str) -> Result<(), EngineError>;
    /// Every volume carrying all of `labels` (`Listed::id` is its name, `state` is empty).
    async fn list_volumes(&self, labels: &[String]) -> Result<Vec<Listed>, EngineError>;
    /// Runs `cmd` in the running container `id` as root (with the container's capabilities),
    /// attached: its stdin, stdout and stderr (a kept container's background run). Closing the
    /// returned connection closes the process's stdin; the process dies with the container.
    async fn exec_attached(&self, id: &str, cmd: Vec<String>) -> Result<Attached, EngineError>;
}

/// One item of an attached stream as the backend reads it (stdin echoes dropped).
fn output_item(
    item: Result<bollard::container::LogOutput, bollard::errors::Error>,
) -> Option<Result<Output, EngineError>> {
    match item {
        Ok(bollard::container::LogOutput::StdOut { message })
        | Ok(bollard::container::LogOutput::Console { message }) => {
            Some(Ok(Output::Stdout(message)))
        }
        Ok(bollard::container::LogOutput::StdErr { message }) => Some(Ok(Output::Stderr(message))),
        Ok(bollard::container::LogOutput::StdIn { .. }) => None,
        Err(e) => Some(Err(EngineError::from(e))),
    }
}

/// The real engine, over dockerd's unix socket.
pub struct BollardEngine {
    socket: String,
    /// Connected and version-negotiated client; dropped after a connection failure so the next
    /// call reconnects and renegotiates (dockerd may have been upgraded meanwhile).
    client: Mutex<Option<Docker>>,
}

impl BollardEngine {
    /// Sends `signal` to the container's main process; a container that is not running is not
    /// an error (409: the goal is reached).
    async fn signal(&self, id: &str, signal: &str) -> Result<(), EngineError> {
        let opts = KillContainerOptionsBuilder::new().signal(signal).build();
        match self
            .call(|d| async move { d.kill_container(id, Some(opts)).await })
            .await
        {
            Err(EngineError::Api(m)) if m.starts_with("409") => Ok(()),
            other => other,
        }
    }

    pub fn new(socket: &str) -> Self {
        BollardEngine {
            socket: socket.to_string(),
            client: Mutex::new(None),
        }
    }

    fn cached(&self) -> Option<Docker> {
        self.client.lock().ok().and_then(|c| c.clone())
    }

    fn forget(&self) {
        if let Ok(mut c) = self.client.lock() {
            *c = None;
        }
    }

    async fn docker(&self) -> Result<Docker, EngineError> {
        if let Some(d) = self.cached() {
            return Ok(d);
        }
        let path = self.socket.strip_prefix("unix://").unwrap_or(&self.socket);
        if !path.starts_with('/') {
            return Err(EngineError::Unreachable(format!(
                "sandbox.docker.socket '{}': only unix sockets are supported",
                self.socket
            )));
        }
        let d = Docker::connect_with_unix(path, REQUEST_TIMEOUT_SECS, API_DEFAULT_VERSION)?;
        let d = tokio::time::timeout(Duration::from_secs(10), d.negotiate_version())
            .await
            .map_err(|_| EngineError::Unreachable("version negotiation timed out".into()))??;
        if let Ok(mut c) = self.client.lock() {
            *c = Some(d.clone());
        }
        Ok(d)
    }

    /// Runs one call; a connection-level failure forgets the client.
    async fn call<T, F, Fut>(&self, f: F) -> Result<T, EngineError>
    where
        F: FnOnce(Docker) -> Fut,
        Fut: std::future::Future<Output = Result<T, bollard::errors::Error>>,
    {
        let d = self.docker().await?;
        let r = f(d).await.map_err(EngineError::from);
        if matches!(&r, Err(e) if e.is_unreachable()) {
            self.forget();
        }
        r
    }
}

#[async_trait::async_trait]
impl Engine for BollardEngine {
    async fn ping(&self) -> Result<(), EngineError> {
        self.call(|d| async move { d.ping().await.map(|_| ()) })
            .await
    }

    async fn info(&self) -> Result<EngineInfo, EngineError> {
        let (info, version) = self
            .call(|d| async move { Ok((d.info().await?, d.version().await?)) })
            .await?;
        let registered = info.runtimes.unwrap_or_default();
        let mut runtimes: Vec<String> = registered.keys().cloned().collect();
        runtimes.sort();
        let runtime_args = registered
            .into_iter()
            .map(|(name, r)| (name, r.runtime_args.unwrap_or_default()))
            .collect();
        Ok(EngineInfo {
            server_version: info.server_version.unwrap_or_default(),
            api_version: version.api_version.unwrap_or_default(),
            runtimes,
            runtime_args,
        })
    }

    async fn create(&self, name: &str, body: ContainerCreateBody) -> Result<String, EngineError> {
        let opts = CreateContainerOptionsBuilder::new().name(name).build();
        self.call(|d| async move { d.create_container(Some(opts), body).await.map(|r| r.id) })
            .await
    }

    async fn attach(&self, id: &str) -> Result<Attached, EngineError> {
        let opts = AttachContainerOptionsBuilder::new()
            .stream(true)
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .logs(false)
            .build();
        let r = self
            .call(|d| async move { d.attach_container(id, Some(opts)).await })
            .await?;
        let output = r.output.filter_map(|item| async move { output_item(item) });
        Ok(Attached {
            input: r.input,
            output: Box::pin(output),
        })
    }

    async fn start(&self, id: &str) -> Result<(), EngineError> {
        self.call(|d| async move { d.start_container(id, None).await })
            .await
    }

    async fn exec_attached(&self, id: &str, cmd: Vec<String>) -> Result<Attached, EngineError> {
        let config = bollard::models::ExecConfig {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            user: Some("0".into()),
            cmd: Some(cmd),
            ..Default::default()
        };
        let exec = self
            .call(|d| async move { d.create_exec(id, config).await })
            .await?
            .id;
        let opts = bollard::exec::StartExecOptions {
            detach: false,
            tty: false,
            output_capacity: Some(64 * 1024),
        };
        let started = self
            .call(|d| async move { d.start_exec(&exec, Some(opts)).await })
            .await?;
        let bollard::exec::StartExecResults::Attached { output, input } = started else {
            return Err(EngineError::Api("the exec started detached".into()));
        };
        Ok(Attached {
            input,
            output: Box::pin(output.filter_map(|item| async move { output_item(item) })),
        })
    }

    async fn kill(&self, id: &str) -> Result<(), EngineError> {
        self.signal(id, "SIGKILL").await
    }

    async fn terminate(&self, id: &str) -> Result<(), EngineError> {
        self.signal(id, "SIGTERM").await
    }

    async fn kill_command(&self, id: &str) -> Result<(), EngineError> {
        self.signal(id, "SIGUSR1").await
    }

    async fn remove(&self, id: &str) -> Result<(), EngineError> {
        // A removal is done only once the container is gone: callers release the container's
        // uid on it. Two answers mean "not yet" rather than "failed", and are asked again until
        // the container is gone, at most `REMOVAL_WAIT`:
        // - 409 "removal already in progress": someone else (a sweep, an earlier call that timed
        //   out) is on it, and dockerd may still be killing the container's processes; should
        //   that removal fail, the next ask starts a new one.
        // - 500 "did not receive an exit event": dockerd sent SIGKILL but gives up waiting after
        //   its own 10 s (hundreds of processes under a small CPU quota take longer to exit);
        //   the processes still die, and the next ask removes the container.
        let deadline = tokio::time::Instant::now() + REMOVAL_WAIT;
        loop {
            let opts = RemoveContainerOptionsBuilder::new()
                .force(true)
                .v(true)
                .build();
            match self
                .call(|d| async move { d.remove_container(id, Some(opts)).await })
                .await
            {
                Ok(()) | Err(EngineError::NotFound(_)) => return Ok(()),
                Err(EngineError::Api(m)) if removal_not_yet_done(&m) => {}
                Err(e) => return Err(e),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(EngineError::Timeout);
            }
            tokio::time::sleep(REMOVAL_POLL).await;
        }
    }

    async fn rename(&self, id: &str, name: &str) -> Result<(), EngineError> {
        let opts = RenameContainerOptionsBuilder::new().name(name).build();
        self.call(|d| async move { d.rename_container(id, opts).await })
            .await
    }

    async fn wait_stopped(&self, id: &str) -> Result<(), EngineError> {
        let opts = WaitContainerOptionsBuilder::new()
            .condition("not-running")
            .build();
        self.call(|d| async move {
            let mut s = Box::pin(d.wait_container(id, Some(opts)));
            match s.next().await {
                // A non-zero exit code comes back as this error: the container did stop.
                Some(Ok(_))
                | Some(Err(bollard::errors::Error::DockerContainerWaitError { .. }))
                | None => Ok(()),
                Some(Err(e)) => Err(e),
            }
        })
        .await
    }

    async fn inspect(&self, id: &str) -> Result<ContainerState, EngineError> {
        let r = self
            .call(|d| async move { d.inspect_container(id, None).await })
            .await?;
        let s = r.state.unwrap_or_default();
        let volume_sources = r
            .mounts
            .unwrap_or_default()
            .into_iter()
            .filter_map(|m| Some((m.name?, std::path::PathBuf::from(m.source?))))
            .collect();
        Ok(ContainerState {
            running: s.running.unwrap_or(false),
            pid: s.pid.and_then(|p| u32::try_from(p).ok()).filter(|p| *p > 0),
            exit_code: s.exit_code,
            oom_killed: s.oom_killed.unwrap_or(false),
            error: s.error.filter(|e| !e.is_empty()),
            volume_sources,
        })
    }

    async fn list(&self, labels: &[String]) -> Result<Vec<Listed>, EngineError> {
        let filters: HashMap<String, Vec<String>> =
            HashMap::from([("label".to_string(), labels.to_vec())]);
        let opts = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let r = self
            .call(|d| async move { d.list_containers(Some(opts)).await })
            .await?;
        Ok(r.into_iter()
            .filter_map(|c| {
                Some(Listed {
                    id: c.id?,
                    state: c.state.map(|s| s.to_string()).unwrap_or_default(),
                    labels: c.labels.unwrap_or_default(),
                })
            })
            .collect())
    }

    async fn remove_volume(&self, name: &str) -> Result<(), EngineError> {
        let opts = RemoveVolumeOptionsBuilder::new().force(false).build();
        match self
            .call(|d| async move { d.remove_volume(name, Some(opts)).await })
            .await
        {
            Err(EngineError::NotFound(_)) => Ok(()),
            other => other,
        }
    }

    async fn list_volumes(&self, labels: &[String]) -> Result<Vec<Listed>, EngineError> {
        let filters: HashMap<String, Vec<String>> =
            HashMap::from([("label".to_string(), labels.to_vec())]);
        let opts = ListVolumesOptionsBuilder::new().filters(&filters).build();
        let r = self
            .call(|d| async move { d.list_volumes(Some(opts)).await })
            .await?;
        Ok(r.volumes
            .unwrap_or_default()
            .into_iter()
            .map(|v| Listed {
                id: v.name,
                state: String::new(),
                labels: v.labels,
            })
            .collect())
    }
}

/// A recording in-memory engine for the pool and janitor tests. A "container" runs until it is
/// killed, removed or [`fake::FakeEngine::crash`]ed; its attach output ends then, like a real
/// supervisor's would.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use tokio::sync::mpsc;

    #[derive(Default)]
    struct FakeContainer {
        name: String,
        labels: HashMap<String, String>,
        /// Host directory bind-mounted at the egress directory, if any.
        egress_dir: Option<String>,
        /// Volumes its mounts use.
        volumes: Vec<String>,
        running: bool,
        /// Dropping it ends the attach output stream.
        output: Option<mpsc::UnboundedSender<Result<Output, EngineError>>>,
    }

    #[derive(Default)]
    pub struct FakeEngine {
        containers: Arc<Mutex<HashMap<String, FakeContainer>>>,
        /// Volumes (name → labels), created like dockerd does from a container's mounts.
        volumes: Arc<Mutex<HashMap<String, HashMap<String, String>>>>,
        /// How long a create takes. As in dockerd, the container is made even when the caller
        /// stops waiting for it.
        pub create_delay: Mutex<Option<Duration>>,
        /// This many of the next container removals fail (as dockerd's can: a sandbox that did
        /// not die in time, a file system it could not remove yet).
        pub failing_removals: AtomicUsize,
        pub calls: Mutex<Vec<String>>,
        pub down: AtomicBool,
        pub fail_create: AtomicBool,
        /// What a container's supervisor answers (raw frame bytes) once it got a request.
        pub reply: Mutex<Vec<u8>>,
        /// Requests containers received.
        pub requests: Arc<Mutex<Vec<Vec<u8>>>>,
        /// Create bodies, in order.
        pub bodies: Mutex<Vec<ContainerCreateBody>>,
        /// Bytes the "command" sends through the container's egress socket (as the relay would)
        /// after the request arrived and before the reply.
        pub egress_send: Mutex<Option<Vec<u8>>>,
        /// What came back on that socket.
        pub egress_answers: Arc<Mutex<Vec<Vec<u8>>>>,
        /// runsc's registered arguments.
        pub runsc_args: Mutex<Vec<String>>,
        /// From this many `inspect` calls on, containers report an OOM kill (0: never), as
        /// dockerd can flag an OOM a moment after the exit it already reported.
        pub oom_from_inspect: AtomicUsize,
        inspects: AtomicUsize,
        next: AtomicUsize,
    }

    impl FakeEngine {
        fn record(&self, call: String) -> Result<(), EngineError> {
            self.calls.lock().unwrap().push(call);
            if self.down.load(Ordering::SeqCst) {
                Err(EngineError::Unreachable("fake engine down".into()))
            } else {
                Ok(())
            }
        }

        /// Names of volumes that exist.
        pub fn existing_volumes(&self) -> Vec<String> {
            let mut v: Vec<String> = self.volumes.lock().unwrap().keys().cloned().collect();
            v.sort();
            v
        }

        /// Ids of containers that exist (any state).
        pub fn existing(&self) -> Vec<String> {
            let mut v: Vec<String> = self.containers.lock().unwrap().keys().cloned().collect();
            v.sort();
            v
        }

        pub fn name_of(&self, id: &str) -> Option<String> {
            self.containers
                .lock()
                .unwrap()
                .get(id)
                .map(|c| c.name.clone())
        }

        /// The container's main process dies on its own (as after a dockerd restart).
        pub fn crash(&self, id: &str) {
            if let Some(c) = self.containers.lock().unwrap().get_mut(id) {
                c.running = false;
                c.output = None;
            }
        }

        pub fn count(&self, prefix: &str) -> usize {
            self.calls
                .lock()
                .unwrap()
                .iter()
                .filter(|c| c.starts_with(prefix))
                .count()
        }
    }

    #[async_trait::async_trait]
    impl Engine for FakeEngine {
        async fn ping(&self) -> Result<(), EngineError> {
            self.record("ping".into())
        }

        async fn info(&self) -> Result<EngineInfo, EngineError> {
            self.record("info".into())?;
            Ok(EngineInfo {
                server_version: "fake".into(),
                api_version: "1.41".into(),
                runtimes: vec!["runc".into(), "runsc".into()],
                runtime_args: HashMap::from([(
                    "runsc".to_string(),
                    self.runsc_args.lock().unwrap().clone(),
                )]),
            })
        }

        async fn create(
            &self,
            name: &str,
            body: ContainerCreateBody,
        ) -> Result<String, EngineError> {
            self.record(format!("create {name}"))?;
            if self.fail_create.load(Ordering::SeqCst) {
                return Err(EngineError::NotFound("No such image".into()));
            }
            self.bodies.lock().unwrap().push(body.clone());
            let id = format!("c{:03}", self.next.fetch_add(1, Ordering::SeqCst));
            let egress_dir = body
                .host_config
                .as_ref()
                .and_then(|h| h.mounts.as_ref())
                .and_then(|m| {
                    m.iter().find(|m| {
                        m.target.as_deref() == Some(crate::sandbox::docker::egress::CONTAINER_DIR)
                    })
                })
                .and_then(|m| m.source.clone());
            let mounts: Vec<(String, HashMap<String, String>)> = body
                .host_config
                .as_ref()
                .and_then(|h| h.mounts.as_ref())
                .into_iter()
                .flatten()
                .filter(|m| m.typ == Some(bollard::models::MountType::VOLUME))
                .filter_map(|m| {
                    let labels = m.volume_options.as_ref()?.labels.clone();
                    Some((m.source.clone()?, labels.unwrap_or_default()))
                })
                .collect();
            let container = FakeContainer {
                name: name.into(),
                labels: body.labels.unwrap_or_default(),
                egress_dir,
                volumes: mounts.iter().map(|(v, _)| v.clone()).collect(),
                ..Default::default()
            };
            let delay = *self.create_delay.lock().unwrap();
            let (containers, volumes, made) =
                (self.containers.clone(), self.volumes.clone(), id.clone());
            let make = async move {
                if let Some(d) = delay {
                    tokio::time::sleep(d).await;
                }
                let mut vs = volumes.lock().unwrap();
                for (v, labels) in mounts {
                    vs.entry(v).or_insert(labels);
                }
                containers.lock().unwrap().insert(made, container);
            };
            // Dropping the returned future leaves the task running, as dockerd does.
            let _ = tokio::spawn(make).await;
            Ok(id)
        }

        async fn attach(&self, id: &str) -> Result<Attached, EngineError> {
            self.record(format!("attach {id}"))?;
            let (tx, rx) = mpsc::unbounded_channel();
            let mut cs = self.containers.lock().unwrap();
            let c = cs
                .get_mut(id)
                .ok_or_else(|| EngineError::NotFound(id.into()))?;
            c.output = Some(tx.clone());
            let egress = c
                .egress_dir
                .clone()
                .zip(self.egress_send.lock().unwrap().clone());
            let answers = self.egress_answers.clone();
            let output = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|item| (item, rx))
            });
            // The "supervisor": answers the first request with the scripted reply.
            let (input, mut theirs) = tokio::io::duplex(1 << 20);
            let reply = self.reply.lock().unwrap().clone();
            let requests = self.requests.clone();
            // Weak: only the container entry keeps the output open, so kill/crash ends it.
            let tx = tx.downgrade();
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = vec![0u8; 1 << 16];
                if let Ok(n) = theirs.read(&mut buf).await
                    && n > 0
                {
                    requests.lock().unwrap().push(buf[..n].to_vec());
                    if let Some((dir, send)) = egress {
                        use tokio::io::AsyncWriteExt;
                        let socket = std::path::Path::new(&dir)
                            .join(crate::sandbox::docker::egress::SOCKET_NAME);
                        let mut answer = Vec::new();
                        if let Ok(mut s) = tokio::net::UnixStream::connect(socket).await {
                            let _ = s.write_all(&send).await;
                            let _ = s.read_to_end(&mut answer).await;
                        }
                        answers.lock().unwrap().push(answer);
                    }
                    if !reply.is_empty()
                        && let Some(tx) = tx.upgrade()
                    {
                        let _ = tx.send(Ok(Output::Stdout(Bytes::from(reply))));
                    }
                }
                // Keep our end open while the container lives.
                let _ = theirs.read(&mut buf).await;
            });
            Ok(Attached {
                input: Box::pin(input),
                output: Box::pin(output),
            })
        }

        async fn start(&self, id: &str) -> Result<(), EngineError> {
            self.record(format!("start {id}"))?;
            let mut cs = self.containers.lock().unwrap();
            cs.get_mut(id)
                .ok_or_else(|| EngineError::NotFound(id.into()))?
                .running = true;
            Ok(())
        }

        async fn kill(&self, id: &str) -> Result<(), EngineError> {
            self.record(format!("kill {id}"))?;
            self.crash(id);
            Ok(())
        }

        async fn terminate(&self, id: &str) -> Result<(), EngineError> {
            self.record(format!("terminate {id}"))
        }

        async fn kill_command(&self, id: &str) -> Result<(), EngineError> {
            self.record(format!("kill_command {id}"))
        }

        /// The fake runs no process of its own: an exec is recorded and refused.
        async fn exec_attached(
            &self,
            id: &str,
            _cmd: Vec<String>,
        ) -> Result<Attached, EngineError> {
            self.record(format!("exec {id}"))?;
            Err(EngineError::Api(
                "the fake engine runs no process in a container".into(),
            ))
        }

        async fn remove(&self, id: &str) -> Result<(), EngineError> {
            self.record(format!("remove {id}"))?;
            let failing = &self.failing_removals;
            if failing
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(EngineError::Api(format!(
                    "500: cannot remove {id}: did not receive an exit event"
                )));
            }
            self.containers.lock().unwrap().remove(id);
            Ok(())
        }

        async fn rename(&self, id: &str, name: &str) -> Result<(), EngineError> {
            self.record(format!("rename {id} {name}"))?;
            match self.containers.lock().unwrap().get_mut(id) {
                Some(c) => {
                    c.name = name.into();
                    Ok(())
                }
                None => Err(EngineError::NotFound(id.into())),
            }
        }

        async fn wait_stopped(&self, id: &str) -> Result<(), EngineError> {
            self.record(format!("wait {id}"))
        }

        async fn inspect(&self, id: &str) -> Result<ContainerState, EngineError> {
            self.record(format!("inspect {id}"))?;
            let cs = self.containers.lock().unwrap();
            let c = cs.get(id).ok_or_else(|| EngineError::NotFound(id.into()))?;
            let n = self.inspects.fetch_add(1, Ordering::SeqCst) + 1;
            let from = self.oom_from_inspect.load(Ordering::SeqCst);
            Ok(ContainerState {
                running: c.running,
                oom_killed: from > 0 && n >= from,
                ..Default::default()
            })
        }

        async fn list(&self, labels: &[String]) -> Result<Vec<Listed>, EngineError> {
            self.record(format!("list {}", labels.join(",")))?;
            let cs = self.containers.lock().unwrap();
            Ok(cs
                .iter()
                .filter(|(_, c)| {
                    labels.iter().all(|l| {
                        l.split_once('=')
                            .is_some_and(|(k, v)| c.labels.get(k).map(String::as_str) == Some(v))
                    })
                })
                .map(|(id, c)| Listed {
                    id: id.clone(),
                    state: if c.running {
                        "running".into()
                    } else {
                        "exited".into()
                    },
                    labels: c.labels.clone(),
                })
                .collect())
        }

        async fn remove_volume(&self, name: &str) -> Result<(), EngineError> {
            self.record(format!("remove_volume {name}"))?;
            let in_use = self
                .containers
                .lock()
                .unwrap()
                .values()
                .any(|c| c.volumes.iter().any(|v| v == name));
            if in_use {
                return Err(EngineError::Api(format!(
                    "409: remove {name}: volume is in use"
                )));
            }
            self.volumes.lock().unwrap().remove(name);
            Ok(())
        }

        async fn list_volumes(&self, labels: &[String]) -> Result<Vec<Listed>, EngineError> {
            self.record(format!("list_volumes {}", labels.join(",")))?;
            let vs = self.volumes.lock().unwrap();
            Ok(vs
                .iter()
                .filter(|(_, l)| {
                    labels.iter().all(|want| {
                        want.split_once('=')
                            .is_some_and(|(k, v)| l.get(k).map(String::as_str) == Some(v))
                    })
                })
                .map(|(name, l)| Listed {
                    id: name.clone(),
                    state: String::new(),
                    labels: l.clone(),
                })
                .collect())
        }
    }
}
