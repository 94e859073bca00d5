//! A session's archives: a tar of a workspace directory out, a tar into one, sent to where the
//! workspace lives (the host workspace, on blocking threads, or the session's kept sandbox).
//! The checks on every member, the staging and the merge are
//! `executor_arm_supervisor::archive`'s, the same code on both sides.
//!
//! Owns: the refusal while an exec runs, an upload's `session_archive` audit line (written once
//! the archive is checked and staged, before anything of it enters the workspace: its digest,
//! size and member count are known only then), and the primitives a saved workspace is restored
//! with ([`Session::export_archive`], [`Session::import_archive`] in [`ImportMode::Restore`]).
//! Must not: know HTTP.

use std::io::Read;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::SessionService;
use super::files::UploadError;
use super::session::{Place, Session};
use super::workspace::FileError;
use crate::provenance::audit::{AuditEvent, SessionArchiveUpload};
use crate::sandbox::files::{Approve, ByteStream, Staging};

pub use crate::sandbox::files::ImportMode;

/// Bytes the export of a host workspace may have produced and not yet sent (chunks of
/// [`CHUNK`]): a slow reader holds that much, not the workspace.
const CHUNKS_AHEAD: usize = 4;
const CHUNK: usize = 64 * 1024;
/// After an upload failed early, what is still read of its body (and dropped) so the client,
/// still sending, gets the answer; past this the connection is closed instead.
const DRAIN_AFTER_FAILURE: u64 = 64 << 20;

/// An archive that went into a workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveUploaded {
    pub members: u64,
    pub bytes: u64,
    pub sha256: String,
}

impl SessionService {
    /// Extracts the uploaded tar `body` into `session`'s workspace directory `path` ("" is the
    /// workspace). Its `session_archive` line is written once it is staged; an archive the audit
    /// log cannot record is dropped (nothing enters the workspace).
    pub async fn upload_archive(
        &self,
        session: &Arc<Session>,
        request_id: String,
        path: &str,
        body: ByteStream,
    ) -> Result<ArchiveUploaded, UploadError> {
        let Some(_open) = session.upload_gate().await else {
            return Err(UploadError::Ended);
        };
        // The session's one exec is held for the whole upload: no exec writes the workspace
        // while the archive is staged and merged (409 for one that tries).
        let _exec = self.claim_for_archive(session)?;
        let digest = Arc::new(Mutex::new((Sha256::new(), 0u64)));
        let hashed = {
            let digest = digest.clone();
            body.map(move |chunk| {
                if let Ok(b) = &chunk {
                    let mut d = digest.lock().unwrap_or_else(|p| p.into_inner());
                    d.0.update(b);
                    d.1 += b.len() as u64;
                }
                chunk
            })
            .boxed()
        };
        let (audit, metrics) = (self.executions.audit(), self.executions.metrics());
        let recorded = Arc::new(Mutex::new(None::<(bool, String, u64)>));
        let approve: Approve = {
            let (recorded, digest) = (recorded.clone(), digest.clone());
            let (audit, metrics) = (audit.clone(), metrics.clone());
            let (session_id, owner, tenant, path) = (
                session.id.clone(),
                session.owner.subject.clone(),
                session.owner.tenant.clone(),
                path.to_string(),
            );
            Box::new(move |staged: &Staging| {
                let (sha256, bytes) = {
                    let d = digest.lock().unwrap_or_else(|p| p.into_inner());
                    (
                        format!("sha256:{}", hex::encode(d.0.clone().finalize())),
                        d.1,
                    )
                };
                let line = AuditEvent::SessionArchive(SessionArchiveUpload {
                    request_id,
                    session_id,
                    owner,
                    tenant,
                    path,
                    bytes,
                    sha256: sha256.clone(),
                    members: staged.members,
                });
                let ok = crate::execution::record::record(&audit, &metrics, &line).is_some();
                *recorded.lock().unwrap_or_else(|p| p.into_inner()) = Some((ok, sha256, bytes));
                ok
            })
        };
        let result = session
            .import_archive(path, ImportMode::Upload, hashed, approve)
            .await;
        let recorded = recorded.lock().unwrap_or_else(|p| p.into_inner()).take();
        match (result, recorded) {
            (Ok(staged), Some((true, sha256, bytes))) => Ok(ArchiveUploaded {
                members: staged.members,
                bytes,
                sha256,
            }),
            (_, Some((false, ..))) => Err(UploadError::Unrecorded),
            (Err(e), _) => Err(e.into()),
            (Ok(_), None) => Err(FileError::Io("the archive was not recorded".into()).into()),
        }
    }
}

impl SessionService {
    /// A tar of `session`'s workspace directory `rel`, streamed; the session's one exec is held
    /// until the stream ends or is dropped, so no exec changes the workspace while it is read.
    pub async fn download_archive(
        &self,
        session: &Arc<Session>,
        rel: &str,
    ) -> Result<ByteStream, FileError> {
        let exec = self.claim_for_archive(session)?;
        let stream = session.export_archive(rel).await?;
        Ok(stream
            .map(move |chunk| {
                let _held = &exec;
                chunk
            })
            .boxed())
    }

    /// The session's one exec, for an archive call: 409 while an exec runs or another archive
    /// call holds it.
    fn claim_for_archive(&self, session: &Arc<Session>) -> Result<super::ExecClaim, FileError> {
        self.claim(session).map_err(|_| {
            FileError::Busy(
                "the session is running an exec or another archive call; its files can be reached when it ends"
                    .into(),
            )
        })
    }
}

/// The async body as the blocking extractor reads it.
struct BodyReader {
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    current: Bytes,
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(b)) => self.current = b,
                Some(Err(e)) => return Err(e),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// Feeds `body` to a [`BodyReader`]; once the reader is gone (the extraction ended), reads at most
/// [`DRAIN_AFTER_FAILURE`] more bytes and drops them.
fn pump(mut body: ByteStream) -> BodyReader {
    let (tx, rx) = tokio::sync::mpsc::channel(CHUNKS_AHEAD);
    tokio::spawn(async move {
        while let Some(chunk) = body.next().await {
            if tx.send(chunk).await.is_err() {
                let mut drained = 0u64;
                while let Some(Ok(b)) = body.next().await {
                    drained += b.len() as u64;
                    if drained > DRAIN_AFTER_FAILURE {
                        break;
                    }
                }
                return;
            }
        }
    });
    BodyReader {
        rx,
        current: Bytes::new(),
    }
}

/// What the blocking exporter writes, sent on in chunks of [`CHUNK`].
struct ChunkSender(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>);

impl std::io::Write for ChunkSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Session {
    /// Archive calls wait for the session's exec, on every backend: an exec writing the
    /// workspace meanwhile would race the staging and the merge.
    fn idle_for_archive(&self) -> Result<(), FileError> {
        match self.running() {
            Some(_) => Err(FileError::Busy(
                "the session is running an exec; its files can be reached when it ends".into(),
            )),
            None => Ok(()),
        }
    }

    /// A tar of the workspace directory `rel` ("" is the workspace), streamed as it is made:
    /// files, directories and symlinks (never followed). An error before the first byte is this
    /// call's; one later ends the stream with an error.
    pub async fn export_archive(&self, rel: &str) -> Result<ByteStream, FileError> {
        self.idle_for_archive()?;
        match &self.place {
            Place::Host(w) => {
                let (w, rel) = (w.clone(), rel.to_string());
                let dir = tokio::task::spawn_blocking(move || w.archive_dir(&rel))
                    .await
                    .map_err(|e| FileError::Io(e.to_string()))??;
                let (tx, mut rx) = tokio::sync::mpsc::channel(CHUNKS_AHEAD);
                tokio::task::spawn_blocking(move || {
                    let out = std::io::BufWriter::with_capacity(CHUNK, ChunkSender(tx.clone()));
                    if let Err(e) = executor_arm_supervisor::archive::export(
                        std::os::fd::AsFd::as_fd(&dir),
                        out,
                    ) {
                        let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                    }
                });
                Ok(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed())
            }
            Place::Kept(k) => k.export_archive(rel).await,
        }
    }

    /// Extracts the tar `body` into the workspace directory `rel` ("" is the workspace):
    /// checked and staged, then moved in if `approve` says so. [`ImportMode::Restore`] is for a
    /// workspace the sandbox itself made, into an empty directory.
    pub async fn import_archive(
        &self,
        rel: &str,
        mode: ImportMode,
        body: ByteStream,
        approve: Approve,
    ) -> Result<Staging, FileError> {
        self.idle_for_archive()?;
        match &self.place {
            Place::Host(w) => {
                let (w2, rel) = (w.clone(), rel.to_string());
                let reader = pump(body);
                let staged =
                    tokio::task::spawn_blocking(move || w2.stage_archive(&rel, reader, mode))
                        .await
                        .map_err(|e| FileError::Io(e.to_string()))??;
                let staging = Staging {
                    members: staged.members,
                };
                let keep = approve(&staging);
                tokio::task::spawn_blocking(move || {
                    if keep {
                        staged.commit().map_err(FileError::from)
                    } else {
                        drop(staged);
                        Err(FileError::Io("the archive was not let in".into()))
                    }
                })
                .await
                .map_err(|e| FileError::Io(e.to_string()))??;
                Ok(staging)
            }
            Place::Kept(k) => k.import_archive(rel, mode, body, approve).await,
        }
    }
}
