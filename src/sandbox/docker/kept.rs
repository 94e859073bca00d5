//! A session's container: taken from the warm pool (or launched) once, kept for the session's
//! life, and running each of its execs through its supervisor in `kept` mode.
//!
//! Owns: opening the kept container ([`DockerSandbox::keep`]), running one exec in it
//! ([`DockerSandbox::run_kept`]) or a background run beside the execs, the file calls its supervisor serves between execs, and
//! noticing that the container is gone. Must not: decide anything about sessions.
//!
//! One attach connection serves the container's whole life: a request is written to its stdin
//! and its frames read back to the final one, one request at a time (the connection's lock).
//! A request that did not end with its final frame (an error, a dropped future) leaves the
//! connection out of step; the container then counts as gone and is destroyed, never reused.
//!
//! Killing one exec does not kill the container: SIGUSR1 makes the supervisor kill every
//! process of the exec (those carrying the exec's marker group), and it does so after every exec
//! anyway, so nothing of one exec outlives it, and nothing of another run (a background one) is
//! touched. A container whose supervisor vanished (gVisor goes down whole when it runs out
//! of memory) is gone: the exec gets its outcome, later calls a clear error.
//!
//! A run's controls (stdin bytes, its end, a signal) go to the supervisor as control frames on
//! the same connection while the run lasts ([`super::relay`]). A background run
//! ([`RunSpec::background`]) does not take the connection: it runs through a `docker exec` of
//! the supervisor in spawn mode beside PID 1, with a marker group of its own, so foreground
//! execs run (and end, killing only their own processes) while it lives; its stop is a TERM
//! control then a KILL control, and it dies with the container. With egress it has a relay of
//! its own in its spawn supervisor, on a loopback port of its own above the proxy port (which
//! the foreground execs use), to a proxy socket of its own, so its connections are its own
//! record; raw TCP rules (one listener per destination port and container) are refused.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWrite;

use super::egress::{EgressSettings, SocketDir};
use super::engine::{Attached, OutputStream};
use super::pool::{ContainerGuard, WarmContainer};
use super::relay::{Live, deliver};
use super::supervisor::{self, FileOp, Frame, FrameDecoder};
use super::{DRAIN_GRACE, DockerSandbox, KILL_TIMEOUT, short};
use crate::sandbox::control::{Control, ProcessSignal};
use crate::sandbox::files::{Approve, ByteStream, Entry, FileError, ImportMode, Kept, Staging};
use crate::sandbox::host_cgroup::MemoryPeak;
use crate::sandbox::ports::{PortConn, PortError};
use crate::sandbox::run::{self, Ending};
use crate::sandbox::{ExitKind, KilledReason, RunOutcome, RunSpec, SandboxError, Stop};

/// How long one file call may take the supervisor (a 16 MiB file is well under a second).
const FILE_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of a listing the daemon takes: a session container's workspace holds at most
/// [`super::container::KEPT_INODES`] entries of at most 255-byte names (about 4.5 MB of records).
const MAX_LISTING: u64 = 8 << 20;

/// The attach connection of a kept container, and whether it is in step with the supervisor.
struct Channel {
    input: std::pin::Pin<Box<dyn AsyncWrite + Send>>,
    output: OutputStream,
    decoder: FrameDecoder,
    /// False from the start of a request until its final frame is read.
    in_step: bool,
}

/// A session's container.
pub struct KeptContainer {
    id: String,
    pid: Option<u32>,
    channel: tokio::sync::Mutex<Channel>,
    gone: Mutex<Option<String>>,
    /// Destroys the container (and its disk volume) when dropped: at [`Kept::close`], else
    /// with the last handle.
    guard: Mutex<Option<ContainerGuard>>,
    /// With egress: the container's socket directory, where each exec's proxy listens; removed
    /// with the container.
    socket_dir: Mutex<Option<SocketDir>>,
    /// The command of a background run: the supervisor in spawn mode, as this container's user
    /// (None: the container's uid is unknown, so no background run).
    spawn: Option<Vec<String>>,
    /// Set once the container is closed or found gone: its background runs end at once (the
    /// engine does not always end an exec's stream when its container goes).
    ended: tokio::sync::watch::Sender<bool>,
    /// How the session's ports are reached inside it.
    ports: PortWay,
    /// Foreground requests its supervisor was handed: a run whose count did not move never
    /// started.
    delivered: std::sync::atomic::AtomicU64,
    /// Loopback ports of the egress relays of its living background runs, and the offset the
    /// next lease starts looking at (round the range: a port just given back is the last taken
    /// again, in case its relay is still closing).
    background_ports: Mutex<(std::collections::BTreeSet<u16>, u16)>,
    /// The host directory of its disk volume, where the engine said it is: its workspace's use
    /// where its mount namespace does not show it (gVisor's sandbox has a root of its own).
    disk_source: Option<std::path::PathBuf>,
}

/// Background runs with egress a container serves at once at most: each holds a loopback port
/// of its own above the proxy port the foreground execs use.
const BACKGROUND_RELAYS: u16 = 256;

/// A loopback port of a container's, held by one background run's relay until dropped, with
/// the run's proxy socket (named after the port), removed before the port is free again.
struct PortLease {
    kept: Arc<KeptContainer>,
    port: u16,
    socket: Option<super::egress::RunSocket>,
    /// Set when the run's supervisor may still hold the port (it did not report after its
    /// kill): the port stays taken for the container's life.
    held_for_good: bool,
}

impl PortLease {
    /// A port above `base` (at most [`BACKGROUND_RELAYS`] above) no other background run of the
    /// container holds.
    fn take(kept: &Arc<KeptContainer>, base: u16) -> Result<PortLease, SandboxError> {
        let mut guard = kept
            .background_ports
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (held, next) = &mut *guard;
        let port = (0..BACKGROUND_RELAYS)
            .map(|i| (*next + i) % BACKGROUND_RELAYS + 1)
            .filter_map(|n| base.checked_add(n))
            .find(|p| !held.contains(p))
            .ok_or_else(|| {
                SandboxError::Setup(format!(
                    "no loopback port above {base} is free for a background run's egress relay \
                     (a container serves {BACKGROUND_RELAYS} at most)"
                ))
            })?;
        held.insert(port);
        *next = (port - base) % BACKGROUND_RELAYS;
        Ok(PortLease {
            kept: kept.clone(),
            port,
            socket: None,
            held_for_good: false,
        })
    }
}

impl Drop for PortLease {
    fn drop(&mut self) {
        drop(self.socket.take());
        if !self.held_for_good {
            self.kept
                .background_ports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .remove(&self.port);
        }
    }
}

/// How a kept container's ports are reached (never through a port published on the host).
enum PortWay {
    /// runc: from the container's network namespace, opened through its init's pid when the
    /// session got the container (a pid read again later could be another process's by then);
    /// None: it could not be opened.
    Netns(Option<Arc<std::os::fd::OwnedFd>>),
    /// gVisor: its network stack is the sentry's own, so through the engine, with this command
    /// (the supervisor in `connect` mode as the container's user, `PORT` appended) whose stdio
    /// is the connection. None: the container's uid is unknown.
    Exec(Arc<dyn super::engine::Engine>, Option<Vec<String>>),
}

/// The network namespace of container `id`'s init `pid`, opened now and held: only if `pid` is
/// still a process of that container (its cgroup names the container) once the namespace is
/// open, and the namespace is not the daemon's own.
fn container_netns(pid: u32, id: &str) -> Option<Arc<std::os::fd::OwnedFd>> {
    let ns = match crate::sandbox::ports::open_netns(pid) {
        Ok(Some(ns)) => ns,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(container = %short(id), error = %e, "the container's network namespace could not be opened");
            return None;
        }
    };
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    if !cgroup.contains(id) {
        tracing::warn!(container = %short(id), pid, "the container's init pid is no longer the container's");
        return None;
    }
    Some(Arc::new(ns))
}

impl KeptContainer {
    fn mark_gone(&self, why: &str) {
        let mut g = self.gone.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::warn!(container = %short(&self.id), why, "a session's container is gone");
            *g = Some(why.to_string());
        }
        self.ended.send_replace(true);
    }

    /// The connection for one request: none while an exec runs, or once the container is gone.
    fn take_channel(&self) -> Result<tokio::sync::MutexGuard<'_, Channel>, FileError> {
        if let Some(why) = self.gone() {
            return Err(FileError::Io(format!(
                "the session's sandbox is gone: {why}"
            )));
        }
        let ch = self.channel.try_lock().map_err(|_| {
            FileError::Busy(
                "the session is running an exec; its files can be reached when it ends".into(),
            )
        })?;
        if !ch.in_step {
            self.mark_gone("an earlier call to its supervisor did not finish");
            return Err(FileError::Io("the session's sandbox is gone".into()));
        }
        Ok(ch)
    }

    /// One file call: the request, then data frames up to the verdict.
    async fn file_call(
        self: Arc<Self>,
        path: String,
        op: FileOp<'_>,
    ) -> Result<Vec<u8>, FileError> {
        let request = supervisor::encode_file_request(&path, op)
            .map_err(|e| FileError::InvalidPath(e.to_string()))?;
        let limit = match op {
            FileOp::Get(max) => max.saturating_add(1),
            _ => MAX_LISTING,
        };
        let mut ch = self.take_channel()?;
        ch.in_step = false;
        let Channel {
            input,
            output,
            decoder,
            in_step,
        } = &mut *ch;
        let call = async {
            deliver(input, &request)
                .await
                .map_err(|e| FileError::Io(e.to_string()))?;
            let mut data = Vec::new();
            loop {
                match decoder.next_frame() {
                    Ok(Some(Frame::Stdout(b))) => {
                        if data.len() as u64 + b.len() as u64 > limit {
                            return Err(FileError::Io("the answer is larger than asked".into()));
                        }
                        data.extend_from_slice(&b);
                        continue;
                    }
                    Ok(Some(Frame::Result(verdict))) => return Ok((data, verdict)),
                    Ok(Some(Frame::Failed(m))) => return Err(FileError::Io(m)),
                    Ok(Some(other)) => {
                        return Err(FileError::Io(format!(
                            "unexpected supervisor frame {other:?}"
                        )));
                    }
                    Ok(None) => {}
                    Err(e) => return Err(FileError::Io(format!("corrupt supervisor stream: {e}"))),
                }
                use futures::StreamExt;
                match output.next().await {
                    Some(Ok(super::engine::Output::Stdout(chunk))) => decoder.push(&chunk),
                    Some(Ok(super::engine::Output::Stderr(_))) => {}
                    Some(Err(e)) => return Err(FileError::Io(e.to_string())),
                    None => return Err(FileError::Io("the sandbox ended".into())),
                }
            }
        };
        let (data, verdict) = match tokio::time::timeout(FILE_CALL_TIMEOUT, call).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                drop(ch);
                self.mark_gone(&e.to_string());
                return Err(e);
            }
            Err(_) => {
                drop(ch);
                self.mark_gone("its supervisor did not answer a file call in time");
                return Err(FileError::Io(
                    "the session's sandbox did not answer in time".into(),
                ));
            }
        };
        *in_step = true;
        drop(ch);
        verdict_of(&path, &verdict, op).map(|()| data)
    }

    /// A file call on a task of its own: a caller that goes away cannot leave the connection
    /// half way through an answer.
    async fn call(self: &Arc<Self>, path: &str, op: OwnedOp) -> Result<Vec<u8>, FileError> {
        let me = self.clone();
        let path = path.to_string();
        tokio::spawn(async move {
            match &op {
                OwnedOp::Put(b) => me.file_call(path, FileOp::Put(b)).await,
                OwnedOp::Get(max) => me.file_call(path, FileOp::Get(*max)).await,
                OwnedOp::List => me.file_call(path, FileOp::List).await,
                OwnedOp::Dir => me.file_call(path, FileOp::Dir).await,
            }
        })
        .await
        .map_err(|e| FileError::Io(e.to_string()))?
    }
}

/// [`FileOp`] with its bytes owned, to move onto a task.
enum OwnedOp {
    Put(Vec<u8>),
    Get(u64),
    List,
    Dir,
}

/// The supervisor's verdict `ok` | `err CODE SIZE MESSAGE` as the files API's error.
fn verdict_of(path: &str, verdict: &str, op: FileOp<'_>) -> Result<(), FileError> {
    if verdict == "ok" {
        return Ok(());
    }
    let mut it = verdict.splitn(4, ' ');
    let (_, code, size, msg) = (it.next(), it.next(), it.next(), it.next().unwrap_or(""));
    let p = if path.is_empty() { "." } else { path };
    Err(match code.unwrap_or("io") {
        "notfound" => FileError::NotFound(p.to_string()),
        "notfile" => FileError::NotAFile(format!(
            "{p}: a symbolic link, a non-directory on the way or not a regular file; it is not followed ({msg})"
        )),
        "toolarge" => FileError::TooLarge {
            path: p.to_string(),
            size: size.and_then(|s| s.parse().ok()).unwrap_or(0),
            max: match op {
                FileOp::Get(max) => max,
                _ => 0,
            },
        },
        "nospace" => FileError::NoSpace,
        "nopids" => FileError::NoPids(msg.to_string()),
        "badarchive" => FileError::BadArchive(msg.to_string()),
        "archivetoolarge" => FileError::ArchiveTooLarge(msg.to_string()),
        "invalid" => FileError::InvalidPath(format!("path '{}' {msg}", p.escape_debug())),
        _ => FileError::Io(format!("{p}: {msg}")),
    })
}

/// A listing's records `T SIZE NAME\0`, sorted by name.
fn entries(data: &[u8]) -> Result<Vec<Entry>, FileError> {
    let mut out = Vec::new();
    for rec in data.split(|b| *b == 0).filter(|r| !r.is_empty()) {
        let text = String::from_utf8_lossy(rec);
        let mut it = text.splitn(3, ' ');
        let (Some(t), Some(size), Some(name)) = (it.next(), it.next(), it.next()) else {
            return Err(FileError::Io("corrupt listing".into()));
        };
        out.push(Entry {
            name: name.to_string(),
            kind: match t {
                "f" => "file",
                "d" => "dir",
                "l" => "symlink",
                _ => "other",
            },
            size: size.parse().unwrap_or(0),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

impl KeptContainer {
    /// Whether the container's pids cgroup is at its limit (None: not readable from here).
    async fn pids_held(&self) -> Option<bool> {
        let (pid, id) = (self.pid?, self.id.clone());
        tokio::task::spawn_blocking(move || crate::sandbox::host_cgroup::pids_held_of_pid(pid, &id))
            .await
            .ok()
            .flatten()
    }
}

#[async_trait::async_trait]
impl Kept for Arc<KeptContainer> {
    fn name(&self) -> String {
        short(&self.id).to_string()
    }

    /// Read from the host: the cgroup of the container's main process, and the workspace as
    /// its mount namespace has it (`/proc/<pid>/root`).
    fn usage(&self, workspace: &std::path::Path) -> Option<(crate::sandbox::Usage, Option<u64>)> {
        if KeptContainer::gone(self).is_some() {
            return None;
        }
        let pid = self.pid?;
        let usage = crate::sandbox::host_cgroup::usage_of_pid(pid, &self.id)?;
        let inside = workspace.strip_prefix("/").unwrap_or(workspace);
        let disk = crate::sandbox::used_bytes(
            &std::path::Path::new(&format!("/proc/{pid}/root")).join(inside),
        )
        .or_else(|| {
            // Only the volume's own tmpfs: where dockerd's mounts are not this daemon's, the
            // directory is there without it, on a filesystem of the host's.
            let source = self.disk_source.as_deref()?;
            let fs = nix::sys::statfs::statfs(source).ok()?;
            (fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
                .then(|| crate::sandbox::used_bytes(source))
                .flatten()
        });
        // Read again: the pid was still the container's after the disk was.
        crate::sandbox::host_cgroup::usage_of_pid(pid, &self.id)?;
        Some((usage, disk))
    }

    fn gone(&self) -> Option<String> {
        if let Some(why) = KeptContainer::gone(self) {
            return Some(why);
        }
        // Between requests the supervisor writes nothing: an ended (or errored) stream means the
        // container went down, anything else on it means the connection is out of step. Busy
        // (a request in progress) is alive; so is a stream with nothing ready.
        let Ok(mut ch) = self.channel.try_lock() else {
            return None;
        };
        use futures::{FutureExt, StreamExt};
        let why = match ch.output.next().now_or_never() {
            None => return None,
            Some(None) => "its container stopped",
            Some(Some(Err(_))) => "the engine's connection to it broke",
            // Diagnostics of the supervisor's interpreter: not part of the protocol.
            Some(Some(Ok(super::engine::Output::Stderr(_)))) => return None,
            Some(Some(Ok(super::engine::Output::Stdout(_)))) => {
                "its supervisor wrote outside a request"
            }
        };
        ch.in_step = false;
        drop(ch);
        self.mark_gone(why);
        KeptContainer::gone(self)
    }

    async fn write_file(&self, rel: &str, bytes: Vec<u8>) -> Result<(), FileError> {
        self.call(rel, OwnedOp::Put(bytes)).await.map(drop)
    }

    async fn read_file(&self, rel: &str, max: u64) -> Result<Vec<u8>, FileError> {
        self.call(rel, OwnedOp::Get(max)).await
    }

    async fn list(&self, rel: &str) -> Result<Vec<Entry>, FileError> {
        entries(&self.call(rel, OwnedOp::List).await?)
    }

    async fn is_dir(&self, rel: &str) -> Result<(), FileError> {
        self.call(rel, OwnedOp::Dir).await.map(drop)
    }

    async fn export_archive(&self, rel: &str) -> Result<ByteStream, FileError> {
        let request = supervisor::encode_file_request(rel, FileOp::TarOut)
            .map_err(|e| FileError::InvalidPath(e.to_string()))?;
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        // On a task of its own: the answer is read to its verdict whoever still reads it, so
        // the connection stays in step.
        tokio::spawn(
            self.clone()
                .archive_out(rel.to_string(), request, first_tx, tx),
        );
        first_rx
            .await
            .map_err(|_| FileError::Io("the archive call ended".into()))??;
        use futures::StreamExt;
        Ok(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed())
    }

    async fn import_archive(
        &self,
        rel: &str,
        mode: ImportMode,
        body: ByteStream,
        approve: Approve,
    ) -> Result<Staging, FileError> {
        let request = supervisor::encode_file_request(rel, FileOp::TarIn(mode))
            .map_err(|e| FileError::InvalidPath(e.to_string()))?;
        let me = self.clone();
        let path = rel.to_string();
        // On a task of its own: a caller that goes away cannot leave the connection half way.
        tokio::spawn(async move { me.archive_in(path, mode, request, body, approve).await })
            .await
            .map_err(|e| FileError::Io(e.to_string()))?
    }

    async fn connect_port(&self, port: u16) -> Result<PortConn, PortError> {
        if let Some(why) = self.gone() {
            return Err(PortError::Unavailable(format!(
                "the session's sandbox is gone: {why}"
            )));
        }
        let closed = |e: std::io::Error| {
            PortError::Closed(format!(
                "nothing listens on port {port} in the session's sandbox ({e})"
            ))
        };
        match &self.ports {
            PortWay::Netns(ns) => {
                let ns = ns.clone().ok_or_else(|| {
                    PortError::Unavailable(
                        "the session container's network namespace could not be opened".into(),
                    )
                })?;
                let s = crate::sandbox::ports::connect_in_netns(ns, port)
                    .await
                    .map_err(closed)?;
                Ok(Box::new(s))
            }
            PortWay::Exec(engine, cmd) => {
                let mut cmd = cmd.clone().ok_or_else(|| {
                    PortError::Unavailable(
                        "the session's container has no user of its own to connect as".into(),
                    )
                })?;
                cmd.push(port.to_string());
                let attached = engine.exec_attached(&self.id, cmd).await.map_err(|e| {
                    PortError::Unavailable(format!("cannot enter the session's sandbox: {e}"))
                })?;
                super::tunnel::open(attached, port).await
            }
        }
    }

    async fn close(&self) {
        {
            let mut g = self.gone.lock().unwrap_or_else(|p| p.into_inner());
            g.get_or_insert_with(|| "the session was ended".to_string());
        }
        self.ended.send_replace(true);
        let guard = self.guard.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(guard);
        let socket_dir = self
            .socket_dir
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(socket_dir);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The next frame of an answer (the engine's stderr skipped), within [`FILE_CALL_TIMEOUT`].
async fn next_frame(
    decoder: &mut FrameDecoder,
    output: &mut super::engine::OutputStream,
) -> Result<Frame, FileError> {
    use futures::StreamExt;
    loop {
        match decoder.next_frame() {
            Ok(Some(f)) => return Ok(f),
            Ok(None) => {}
            Err(e) => return Err(FileError::Io(format!("corrupt supervisor stream: {e}"))),
        }
        match tokio::time::timeout(FILE_CALL_TIMEOUT, output.next()).await {
            Ok(Some(Ok(super::engine::Output::Stdout(chunk)))) => decoder.push(&chunk),
            Ok(Some(Ok(super::engine::Output::Stderr(_)))) => {}
            Ok(Some(Err(e))) => return Err(FileError::Io(e.to_string())),
            Ok(None) => return Err(FileError::Io("the sandbox ended".into())),
            Err(_) => {
                return Err(FileError::Io(
                    "its supervisor did not answer an archive call in time".into(),
                ));
            }
        }
    }
}

/// The next frame, which must be a verdict.
async fn next_verdict(
    decoder: &mut FrameDecoder,
    output: &mut super::engine::OutputStream,
) -> Result<String, FileError> {
    match next_frame(decoder, output).await? {
        Frame::Result(v) => Ok(v),
        other => Err(FileError::Io(format!(
            "unexpected supervisor frame {other:?}"
        ))),
    }
}

/// Writes to the supervisor within [`FILE_CALL_TIMEOUT`].
async fn send(
    input: &mut std::pin::Pin<Box<dyn AsyncWrite + Send>>,
    bytes: &[u8],
) -> Result<(), FileError> {
    match tokio::time::timeout(FILE_CALL_TIMEOUT, deliver(input, bytes)).await {
        Ok(r) => r.map_err(|e| FileError::Io(e.to_string())),
        Err(_) => Err(FileError::Io(
            "its supervisor did not take an archive in time".into(),
        )),
    }
}

impl KeptContainer {
    /// The container's id.
    pub(super) fn id(&self) -> &str {
        &self.id
    }

    /// Foreground requests handed to its supervisor so far.
    pub(super) fn delivered(&self) -> u64 {
        self.delivered.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The container's memory peak from now on (`reset`: reset first, so that the run about to
    /// start reports its own; see [`MemoryPeak`]); None when the host's cgroupfs does not allow
    /// it.
    pub(super) async fn memory_peak(&self, reset: bool) -> Option<MemoryPeak> {
        let (pid, id) = (self.pid?, self.id.clone());
        tokio::task::spawn_blocking(move || MemoryPeak::start(pid, &id, reset))
            .await
            .ok()
            .flatten()
    }

    /// The scrub between two one-shot runs of a reused container (see `reuse`): the supervisor
    /// kills every process, empties the run's places and checks itself; Err says why the
    /// container must not serve again (it is then gone: a scrub cut off half way leaves the
    /// connection out of step).
    pub(super) async fn scrub(&self) -> Result<(), String> {
        let mut ch = self.take_channel().map_err(|e| e.to_string())?;
        ch.in_step = false;
        let Channel {
            input,
            output,
            decoder,
            in_step,
        } = &mut *ch;
        let answer = async {
            send(input, executor_arm_supervisor::protocol::SCRUB_MAGIC).await?;
            next_frame(decoder, output).await
        };
        match tokio::time::timeout(FILE_CALL_TIMEOUT, answer).await {
            Ok(Ok(Frame::Result(v))) if v == "ok" => {
                *in_step = true;
                Ok(())
            }
            Ok(Ok(Frame::Failed(why))) => {
                *in_step = true;
                Err(why)
            }
            Ok(Ok(other)) => Err(format!("unexpected supervisor frame {other:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("its supervisor did not finish the scrub in time".into()),
        }
    }

    /// A tarout call: its first frame answers `first` (data: the stream starts; a verdict: why
    /// not), its data goes to `tx` until the verdict. A broken answer makes the container gone.
    async fn archive_out(
        self: Arc<Self>,
        path: String,
        request: Vec<u8>,
        first_tx: tokio::sync::oneshot::Sender<Result<(), FileError>>,
        tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
    ) {
        let mut first = Some(first_tx);
        let mut ch = match self.take_channel() {
            Ok(ch) => ch,
            Err(e) => {
                if let Some(f) = first.take() {
                    let _ = f.send(Err(e));
                }
                return;
            }
        };
        ch.in_step = false;
        let Channel {
            input,
            output,
            decoder,
            in_step,
        } = &mut *ch;
        let answer = async {
            send(input, &request).await?;
            loop {
                match next_frame(decoder, output).await? {
                    Frame::Stdout(b) => {
                        if let Some(f) = first.take() {
                            let _ = f.send(Ok(()));
                        }
                        // A reader that went away: the rest is read and dropped.
                        let _ = tx.send(Ok(b)).await;
                    }
                    Frame::Result(v) => return Ok(verdict_of(&path, &v, FileOp::TarOut)),
                    other => {
                        return Err(FileError::Io(format!(
                            "unexpected supervisor frame {other:?}"
                        )));
                    }
                }
            }
        };
        let verdict = match answer.await {
            Ok(v) => {
                *in_step = true;
                drop(ch);
                v
            }
            Err(e) => {
                drop(ch);
                self.mark_gone(&e.to_string());
                Err(e)
            }
        };
        match (first.take(), verdict) {
            (Some(f), v) => {
                let _ = f.send(v);
            }
            (None, Err(e)) => {
                let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
            }
            (None, Ok(())) => {}
        }
    }

    /// A tarin call: the request, the archive in chunks (cut short by an early verdict), the
    /// end chunk, then the staged verdict, `approve`'s decision and the final verdict. A broken
    /// exchange makes the container gone.
    async fn archive_in(
        self: Arc<Self>,
        path: String,
        mode: ImportMode,
        request: Vec<u8>,
        mut body: ByteStream,
        approve: Approve,
    ) -> Result<Staging, FileError> {
        use executor_arm_supervisor::protocol::{
            ARCHIVE_COMMIT, ARCHIVE_DROP, MAX_ARCHIVE_CHUNK, STAGED, archive_chunk,
        };
        use futures::StreamExt;
        let op = FileOp::TarIn(mode);
        let mut ch = self.take_channel()?;
        ch.in_step = false;
        let Channel {
            input,
            output,
            decoder,
            in_step,
        } = &mut *ch;
        // Err: the exchange broke; Ok(Err): the archive was refused, in step.
        let exchange = async {
            send(input, &request).await?;
            let (mut early, mut broken) = (None, None);
            loop {
                tokio::select! {
                    next = output.next() => {
                        match next {
                            Some(Ok(super::engine::Output::Stdout(c))) => decoder.push(&c),
                            Some(Ok(super::engine::Output::Stderr(_))) => {}
                            Some(Err(e)) => return Err(FileError::Io(e.to_string())),
                            None => return Err(FileError::Io("the sandbox ended".into())),
                        }
                        match decoder.next_frame() {
                            Ok(Some(Frame::Result(v))) => {
                                early = Some(v);
                                break;
                            }
                            Ok(None) => {}
                            Ok(Some(other)) => {
                                return Err(FileError::Io(format!(
                                    "unexpected supervisor frame {other:?}"
                                )));
                            }
                            Err(e) => {
                                return Err(FileError::Io(format!("corrupt supervisor stream: {e}")));
                            }
                        }
                    }
                    next = tokio::time::timeout(FILE_CALL_TIMEOUT, body.next()) => match next {
                        Ok(Some(Ok(b))) => {
                            for piece in b.chunks(MAX_ARCHIVE_CHUNK) {
                                send(input, &archive_chunk(piece)).await?;
                            }
                        }
                        Ok(Some(Err(e))) => {
                            broken = Some(e.to_string());
                            break;
                        }
                        Ok(None) => break,
                        Err(_) => {
                            broken = Some("no archive bytes arrived in time".to_string());
                            break;
                        }
                    },
                }
            }
            send(input, &archive_chunk(&[])).await?;
            let verdict = match early {
                Some(v) => v,
                None => next_verdict(decoder, output).await?,
            };
            let Some(members) = verdict.strip_prefix(STAGED) else {
                return Ok(match verdict_of(&path, &verdict, op) {
                    Err(e) => Err(e),
                    Ok(()) => Err(FileError::Io("the archive was not staged".into())),
                });
            };
            let staging = Staging {
                members: members.parse().unwrap_or(0),
            };
            let keep = broken.is_none() && approve(&staging);
            let decision = if keep { ARCHIVE_COMMIT } else { ARCHIVE_DROP };
            send(input, &decision.to_be_bytes()).await?;
            let last = next_verdict(decoder, output).await?;
            Ok(match (keep, broken) {
                (_, Some(why)) => Err(FileError::BadArchive(format!(
                    "the archive did not arrive whole: {why}"
                ))),
                (false, None) => Err(FileError::Io("the archive was not let in".into())),
                (true, None) => verdict_of(&path, &last, op).map(|()| staging),
            })
        };
        match exchange.await {
            Ok(r) => {
                *in_step = true;
                r
            }
            Err(e) => {
                drop(ch);
                self.mark_gone(&e.to_string());
                Err(e)
            }
        }
    }

    fn gone(&self) -> Option<String> {
        self.gone.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl DockerSandbox {
    /// A container for session `session_id`, from the warm pool when it has one of this shape.
    /// `warm`: keep a pool of containers of this shape (sessions with the profile's limits).
    pub(super) async fn open_kept(
        &self,
        spec: &RunSpec,
        session_id: &str,
        warm: bool,
    ) -> Result<Arc<dyn Kept>, SandboxError> {
        let egress = run::egress_for(&spec.network, self.egress.as_ref())?;
        let plan = self.plan(spec, true)?;
        if let Some(why) = self.runtime_refusal().await {
            return Err(SandboxError::Unavailable(why));
        }
        self.ensure_egress_dirs(egress)?;
        // A session's every sandbox has a name of its own: the one it had before a pause may
        // still be going away (its removal is the janitor's) when it resumes.
        let name = format!("executor-arm-{session_id}-{:08x}", rand::random::<u32>());
        let (container, pooled) = self.container_for(&plan, session_id, &name, warm).await?;
        let WarmContainer {
            attached: Attached { input, output },
            guard,
            pid,
            socket_dir,
            disk_source,
        } = container;
        if egress.is_some() && socket_dir.is_none() {
            return Err(SandboxError::Setup(
                "egress container without its socket directory".into(),
            ));
        }
        tracing::info!(session_id, container = %short(guard.id()), uid = guard.uid(), pooled, backend = self.kind.as_str(), "session container assigned");
        let kept = self.kept_container(
            &plan,
            WarmContainer {
                attached: Attached { input, output },
                guard,
                pid,
                socket_dir,
                disk_source,
            },
        );
        Ok(Arc::new(kept))
    }

    /// A started container of a kept `plan`, as a kept container: one attach connection for
    /// its life, its ports and background runs reached as its plan says.
    pub(super) fn kept_container(
        &self,
        plan: &super::container::ContainerPlan,
        container: WarmContainer,
    ) -> Arc<KeptContainer> {
        let WarmContainer {
            attached: Attached { input, output },
            guard,
            pid,
            socket_dir,
            disk_source,
        } = container;
        let spawn = guard.uid().map(|uid| plan.spawn_command(uid));
        let ports = match self.kind {
            crate::sandbox::BackendKind::Gvisor => PortWay::Exec(
                self.engine().clone(),
                guard.uid().map(|uid| plan.connect_command(uid)),
            ),
            _ => PortWay::Netns(pid.and_then(|pid| container_netns(pid, guard.id()))),
        };
        Arc::new(KeptContainer {
            id: guard.id().to_string(),
            ports,
            spawn,
            ended: tokio::sync::watch::channel(false).0,
            delivered: std::sync::atomic::AtomicU64::new(0),
            background_ports: Mutex::new((Default::default(), 0)),
            pid,
            channel: tokio::sync::Mutex::new(Channel {
                input,
                output,
                decoder: FrameDecoder::default(),
                in_step: true,
            }),
            gone: Mutex::new(None),
            guard: Mutex::new(Some(guard)),
            socket_dir: Mutex::new(socket_dir),
            disk_source,
        })
    }

    /// Runs one exec of a session in its kept container; with `egress` the exec has a proxy of
    /// its own, as a one-run container's execution has.
    pub(super) async fn run_kept(
        &self,
        kept: &dyn Kept,
        mut spec: RunSpec,
        egress: Option<&EgressSettings>,
    ) -> Result<RunOutcome, SandboxError> {
        let kept = kept
            .as_any()
            .downcast_ref::<Arc<KeptContainer>>()
            .ok_or_else(|| SandboxError::Setup("the session's sandbox is not a container".into()))?
            .clone();
        if let Some(why) = kept.gone() {
            return Err(SandboxError::Unavailable(format!(
                "the session's sandbox is gone: {why}"
            )));
        }
        if spec.background {
            return self.run_background(&kept, spec, egress).await;
        }
        let controls = spec.controls.as_ref().and_then(|c| c.take());
        let code = spec
            .code
            .as_ref()
            .map(|c| (c.path.to_string_lossy().into_owned(), c.bytes.clone()));
        let relay = egress.map(|e| e.relay(&mut spec));
        let request = supervisor::encode_request(
            &spec,
            relay.as_ref(),
            code.as_ref().map(|(p, b)| (p.as_str(), &b[..])),
            controls.is_some(),
        )?;
        drop(code);
        // One exec at a time is the session's rule; a file call in progress is waited for.
        let mut ch = tokio::time::timeout(FILE_CALL_TIMEOUT, kept.channel.lock())
            .await
            .map_err(|_| SandboxError::Setup("the session's sandbox stayed busy".into()))?;
        if !ch.in_step {
            kept.mark_gone("an earlier call to its supervisor did not finish");
            return Err(SandboxError::Unavailable(
                "the session's sandbox is gone".into(),
            ));
        }
        // The exec's proxy listens before its supervisor gets the request; an early return drops
        // (stops) it. Bound under the channel's lock: the previous exec's is finished by then.
        let proxy = match egress {
            None => None,
            Some(e) => {
                let dir = kept.socket_dir.lock().unwrap_or_else(|p| p.into_inner());
                Some(e.serve(dir.as_ref(), &spec.network)?)
            }
        };
        ch.in_step = false;
        let id = kept.id.clone();
        let Channel {
            input,
            output: attached_out,
            decoder,
            in_step,
        } = &mut *ch;

        let (mut run, mut killed, end) = self
            .relay_and_wait(
                &id,
                &spec,
                input,
                attached_out,
                decoder,
                &request,
                Live {
                    controls,
                    // PID 1 serves the session's next exec on this stream.
                    stream_outlives_run: true,
                    ..Default::default()
                },
            )
            .await;
        if !end.as_ref().is_some_and(|e| e.undelivered) {
            kept.delivered
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        let relay = &mut run.relay;
        let start = run.start;
        let duration = start.elapsed();
        let end = match end {
            Some(end) => end,
            None => {
                // Every process of the exec is killed by the supervisor, which then reports; the
                // container stays. One that does not report in time is killed whole.
                let signalled =
                    tokio::time::timeout(KILL_TIMEOUT, self.engine().kill_command(&id)).await;
                if !matches!(signalled, Ok(Ok(()))) {
                    tracing::warn!(exec_id = %spec.exec_id, container = %id, "the exec's kill signal was not confirmed");
                }
                match tokio::time::timeout(KILL_TIMEOUT, &mut *relay).await {
                    Ok(end) => end,
                    Err(_) => {
                        kept.mark_gone("its supervisor did not report after killing an exec");
                        let _ = self.stop(&id, kept.pid).await;
                        tokio::time::timeout(DRAIN_GRACE, &mut *relay)
                            .await
                            .unwrap_or_default()
                    }
                }
            }
        };
        let captured = run.finish().await;
        // The exec is over (its processes are killed): what it still had open through the proxy
        // is closed, and its connections are its own.
        let network = run::connections(proxy).await;
        let report = match end.report {
            Some(Frame::Exit(r)) => {
                *in_step = true;
                Some(r)
            }
            Some(Frame::Deadline(_)) => {
                *in_step = true;
                killed = killed.or(Some(KilledReason::Timeout));
                None
            }
            Some(Frame::Failed(m)) => {
                *in_step = true;
                if killed.is_none() {
                    return Err(SandboxError::Setup(m));
                }
                None
            }
            Some(Frame::NoPids(m)) => {
                *in_step = true;
                if killed.is_none() {
                    return Err(SandboxError::PidsExhausted(m));
                }
                None
            }
            // The relay could not reach the exec's proxy (runsc without host unix sockets): the
            // host lacks what egress needs; the supervisor serves the next request.
            Some(Frame::Unavailable(m)) => {
                *in_step = true;
                if killed.is_none() {
                    return Err(SandboxError::Unavailable(m));
                }
                None
            }
            Some(other) => {
                kept.mark_gone(&format!("unexpected supervisor frame {other:?}"));
                None
            }
            None => {
                if end.undelivered && killed.is_none() {
                    kept.mark_gone("its supervisor could not be reached");
                    return Err(SandboxError::Unavailable(format!(
                        "the session's sandbox container {} is gone: {}",
                        short(&id),
                        end.error.map(|e| e.to_string()).unwrap_or_default()
                    )));
                }
                // The supervisor vanished: the container went down under the exec (gVisor out of
                // memory, the engine killed it), or the engine itself is gone, which is no outcome
                // of the exec's (503, as for a one-shot run). Either way the sandbox is gone.
                let mut verdict = self.oom_verdict(&id).await;
                // An engine that does not answer is gone: no outcome of the command's, a 503 as
                // for a one-shot run. One that answers saw the container go down under the exec
                // (its out-of-memory verdict may come a little later).
                if killed.is_none()
                    && let Err(e) = &verdict
                    && e.is_unreachable()
                {
                    kept.mark_gone("the docker engine was lost during an exec");
                    let stream = end.error.map(|x| x.to_string());
                    return Err(SandboxError::Unavailable(format!(
                        "docker engine lost during the run ({}): {e}",
                        stream.as_deref().unwrap_or("stream ended")
                    )));
                }
                if killed.is_none()
                    && matches!(verdict, Ok(false))
                    && self.late_oom_verdict(&id).await
                {
                    verdict = Ok(true);
                }
                let why = match verdict {
                    Ok(true) => "it ran out of memory",
                    _ => "it stopped during an exec",
                };
                kept.mark_gone(why);
                None
            }
        };
        drop(ch);
        let gone_oom = report.is_none() && kept.gone().is_some_and(|w| w.contains("out of memory"));
        let ending = Ending {
            exit: report.as_ref().map(|r| r.exit).unwrap_or(ExitKind::Killed),
            killed,
            oom: gone_oom || report.as_ref().and_then(|r| r.oom_kills).unwrap_or(0) > 0,
            pids_max_hits: report.as_ref().and_then(|r| r.pids_max_hits).unwrap_or(0),
            peak_memory_kib: report.as_ref().and_then(|r| r.peak_memory_kib),
            stdin_broken_pipe: report.as_ref().is_some_and(|r| r.stdin_broken_pipe),
        };
        Ok(RunOutcome::assemble(ending, captured, duration, network))
    }
}

/// A task that ends with its owner (a run future dropped half way included).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl DockerSandbox {
    /// A session's background run in its kept container: not over the container's attach
    /// connection (the session's foreground execs keep it), but through a `docker exec` of the
    /// supervisor in spawn mode beside PID 1, which runs the request with a marker group of its
    /// own and kills every process of it when the run ends. The run's stop reaches it as a TERM
    /// control, then (after the grace, or at the timeout) a KILL control; a supervisor that does
    /// not report then has its connection closed, which makes it kill its run and exit. Closing
    /// the container ends it with the container.
    async fn run_background(
        &self,
        kept: &Arc<KeptContainer>,
        mut spec: RunSpec,
        egress: Option<&EgressSettings>,
    ) -> Result<RunOutcome, SandboxError> {
        // Raw TCP rules listen on their destinations' ports, one listener per container: the
        // session's foreground execs hold them.
        if !spec.network.tcp_rules().is_empty() {
            return Err(SandboxError::Setup(
                "background processes in container sessions cannot have raw TCP rules (network.tcp)".into(),
            ));
        }
        let Some(cmd) = kept.spawn.clone() else {
            return Err(SandboxError::Setup(
                "the session's container has no user of its own for a background run".into(),
            ));
        };
        // With egress: a relay of its own, on a loopback port of its own, to a proxy socket of
        // its own, so its connections are its record alone; all three end with the run.
        let (relay, proxy, mut lease) = match egress {
            None => (None, None, None),
            Some(e) => {
                let mut lease = PortLease::take(kept, e.port)?;
                let name = super::egress::background_socket_name(lease.port);
                let relay = e.background_relay(&mut spec, lease.port, &name);
                let (proxy, socket) = {
                    let dir = kept.socket_dir.lock().unwrap_or_else(|p| p.into_inner());
                    e.serve_background(dir.as_ref(), &spec.network, &name)?
                };
                lease.socket = Some(socket);
                (Some(relay), Some(proxy), Some(lease))
            }
        };
        let controls = spec.controls.as_ref().and_then(|c| c.take());
        let code = spec
            .code
            .as_ref()
            .map(|c| (c.path.to_string_lossy().into_owned(), c.bytes.clone()));
        let request = supervisor::encode_request(
            &spec,
            relay.as_ref(),
            code.as_ref().map(|(p, b)| (p.as_str(), &b[..])),
            controls.is_some(),
        )?;
        drop(code);
        let id = kept.id.clone();
        let attached = self.engine().exec_attached(&id, cmd).await.map_err(|e| {
            if let Some(why) = kept.gone() {
                return SandboxError::Unavailable(format!("the session's sandbox is gone: {why}"));
            }
            match e {
                super::engine::EngineError::Unreachable(m) => {
                    SandboxError::Unavailable(format!("docker engine unreachable: {m}"))
                }
                super::engine::EngineError::NotFound(_) => {
                    kept.mark_gone("its container is gone");
                    SandboxError::Unavailable("the session's sandbox is gone".into())
                }
                other => SandboxError::Setup(format!(
                    "cannot start a background run in container {}: {other}",
                    short(&id)
                )),
            }
        })?;
        let Attached {
            mut input,
            mut output,
        } = attached;
        // The run's stop, or the container's end (a stop without grace).
        let (stop_tx, stop_rx) =
            tokio::sync::watch::channel(spec.stop.as_ref().and_then(|s| *s.borrow()));
        let mut outer = spec.stop.replace(stop_rx);
        let mut ended = kept.ended.subscribe();
        let stops = AbortOnDrop(tokio::spawn(async move {
            loop {
                let changed = async {
                    match outer.as_mut() {
                        Some(o) => o.changed().await.map(|()| *o.borrow()),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    c = changed => match c {
                        Ok(Some(stop)) => {
                            stop_tx.send_replace(Some(stop));
                        }
                        Ok(None) => {}
                        Err(_) => outer = None,
                    },
                    _ = ended.wait_for(|e| *e) => {
                        stop_tx.send_replace(Some(Stop {
                            reason: KilledReason::Cancelled,
                            grace: Duration::ZERO,
                        }));
                        return;
                    }
                }
            }
        }));
        let mut decoder = FrameDecoder::default();
        let (own_tx, own_rx) = tokio::sync::mpsc::channel(4);
        let live = Live {
            controls,
            own: Some(own_rx),
            terminate_via: Some(own_tx.clone()),
            // A spawn supervisor exits after its report.
            stream_outlives_run: false,
        };
        let (mut run, killed, end) = self
            .relay_and_wait(
                &id,
                &spec,
                &mut input,
                &mut output,
                &mut decoder,
                &request,
                live,
            )
            .await;
        let relay = &mut run.relay;
        let duration = run.start.elapsed();
        let end = match end {
            Some(end) => end,
            None => {
                // Every process of the run is killed by its supervisor, which then reports. One
                // that does not report in time loses its connection: it kills its run and exits.
                let _ = own_tx.send(Control::Signal(ProcessSignal::Kill)).await;
                match tokio::time::timeout(KILL_TIMEOUT, &mut *relay).await {
                    Ok(end) => end,
                    Err(_) => {
                        tracing::warn!(exec_id = %spec.exec_id, container = %short(&id), "a background run's supervisor did not report after its kill");
                        // Its relay may still listen: no later run gets its port.
                        if let Some(lease) = lease.as_mut() {
                            lease.held_for_good = true;
                        }
                        Default::default()
                    }
                }
            }
        };
        drop(own_tx);
        drop(stops);
        // Dropping the relay closes the exec's connection: its supervisor is done or ends now.
        let captured = run.finish().await;
        // The run is over: what it still had open through its proxy is closed.
        let network = run::connections(proxy).await;
        let killed = killed.or(match &end.report {
            Some(Frame::Deadline(_)) => Some(KilledReason::Timeout),
            _ => None,
        });
        let report = match end.report {
            Some(Frame::Exit(r)) => Some(r),
            Some(Frame::Failed(m)) if killed.is_none() => return Err(SandboxError::Setup(m)),
            Some(Frame::NoPids(m)) if killed.is_none() => {
                return Err(SandboxError::PidsExhausted(m));
            }
            Some(Frame::Unavailable(m)) if killed.is_none() => {
                return Err(SandboxError::Unavailable(m));
            }
            None if end.undelivered && killed.is_none() => {
                return Err(SandboxError::Unavailable(format!(
                    "the background run could not be handed to the session's sandbox: {}",
                    end.error.map(|e| e.to_string()).unwrap_or_default()
                )));
            }
            // The runtime could not make the exec's process (its supervisor never spoke, not
            // one frame): when the container's pids are all held, that is why.
            None if killed.is_none()
                && end.frames == 0
                && KeptContainer::gone(kept).is_none()
                && kept.pids_held().await == Some(true) =>
            {
                return Err(SandboxError::PidsExhausted(format!(
                    "container {}'s pids are all held: the background run's process could not be made",
                    short(&id)
                )));
            }
            // No report: the container went (the session closed, or it went down whole) or the
            // supervisor was cut off after its kill; the run counts as killed.
            _ => None,
        };
        let gone_oom = report.is_none() && kept.gone().is_some_and(|w| w.contains("out of memory"));
        let ending = Ending {
            exit: report.as_ref().map(|r| r.exit).unwrap_or(ExitKind::Killed),
            killed,
            oom: gone_oom || report.as_ref().and_then(|r| r.oom_kills).unwrap_or(0) > 0,
            pids_max_hits: report.as_ref().and_then(|r| r.pids_max_hits).unwrap_or(0),
            peak_memory_kib: report.as_ref().and_then(|r| r.peak_memory_kib),
            stdin_broken_pipe: report.as_ref().is_some_and(|r| r.stdin_broken_pipe),
        };
        Ok(RunOutcome::assemble(ending, captured, duration, network))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_become_the_files_api_errors() {
        assert_eq!(verdict_of("a", "ok", FileOp::List), Ok(()));
        assert_eq!(
            verdict_of("a/b", "err notfound 0 b: No such file", FileOp::Get(9)),
            Err(FileError::NotFound("a/b".into()))
        );
        assert!(matches!(
            verdict_of("l", "err notfile 0 l: Too many levels of symbolic links", FileOp::Get(9)),
            Err(FileError::NotAFile(m)) if m.contains("not followed")
        ));
        assert_eq!(
            verdict_of("big", "err toolarge 12 too large", FileOp::Get(9)),
            Err(FileError::TooLarge {
                path: "big".into(),
                size: 12,
                max: 9
            })
        );
        assert_eq!(
            verdict_of("f", "err nospace 0 write: No space left", FileOp::List),
            Err(FileError::NoSpace)
        );
        assert!(matches!(
            verdict_of("f", "garbage", FileOp::List),
            Err(FileError::Io(_))
        ));
        let tarin = FileOp::TarIn(ImportMode::Upload);
        assert_eq!(
            verdict_of("", "err badarchive 0 member 'x' is a hard link", tarin),
            Err(FileError::BadArchive("member 'x' is a hard link".into()))
        );
        assert_eq!(
            verdict_of("", "err archivetoolarge 0 too large", tarin),
            Err(FileError::ArchiveTooLarge("too large".into()))
        );
        assert_eq!(
            verdict_of("d", "err notfound 0 no such directory: d", FileOp::TarOut),
            Err(FileError::NotFound("d".into()))
        );
    }

    #[test]
    fn listings_are_parsed_and_sorted() {
        let l = entries(b"f 3 b.txt\0d 4096 a dir\0l 11 link\0o 0 fifo\0").unwrap();
        let names: Vec<_> = l
            .iter()
            .map(|e| (e.name.as_str(), e.kind, e.size))
            .collect();
        assert_eq!(
            names,
            [
                ("a dir", "dir", 4096),
                ("b.txt", "file", 3),
                ("fifo", "other", 0),
                ("link", "symlink", 11)
            ]
        );
        assert!(entries(b"f\0").is_err());
    }
}
