//! A session's file calls: uploads, downloads and listings of its workspace, and the check of
//! an exec's `cwd`, each sent to where the workspace lives: the host workspace
//! ([`super::workspace`]) or the session's kept sandbox (its backend half is
//! `crate::sandbox::docker::kept`, behind the `crate::sandbox::files::Kept` trait).
//!
//! Owns: which of the two serves a call, path checks before a kept sandbox is asked, the
//! refusal while an exec runs, and an upload's audit line before its first byte is written.
//! Must not: know HTTP.

use std::path::PathBuf;

use super::SessionService;
use super::session::{Place, Session};
use super::workspace::{Entry, FileError, relative};
use crate::execution::WORKSPACE;
use crate::provenance::audit::{AuditEvent, SessionUpload};
use crate::provenance::sha256_prefixed;

/// Why an upload was not written.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The session ended (or is ending) while the upload arrived: an upload to no session.
    #[error("the session ended")]
    Ended,
    /// The audit log could not record the upload: nothing was written.
    #[error("audit log unavailable: the upload was not written")]
    Unrecorded,
    #[error(transparent)]
    File(#[from] FileError),
}

impl SessionService {
    /// Writes an uploaded file into `session`'s workspace, its `session_file` audit line first.
    pub async fn upload(
        &self,
        session: &Session,
        request_id: String,
        path: &str,
        bytes: Vec<u8>,
    ) -> Result<(), UploadError> {
        let line = AuditEvent::SessionFile(SessionUpload {
            request_id,
            session_id: session.id.clone(),
            owner: session.owner.subject.clone(),
            tenant: session.owner.tenant.clone(),
            path: path.to_string(),
            bytes: bytes.len() as u64,
            sha256: sha256_prefixed(&bytes),
        });
        // The session may have ended while the body arrived: such an upload is refused as one
        // to no session. Held from here to the last byte, so the session's end waits for it.
        let Some(_open) = session.upload_gate().await else {
            return Err(UploadError::Ended);
        };
        // The line comes first, as a run's start line does: an upload the audit log cannot
        // record is refused before anything is written (a write that then fails is answered
        // with its error; its line stays as the record of the attempt).
        let (audit, metrics) = (self.executions.audit(), self.executions.metrics());
        if crate::execution::record::record(audit, metrics, &line).is_none() {
            return Err(UploadError::Unrecorded);
        }
        session.write_file(path, bytes).await?;
        Ok(())
    }
}

/// Runs a blocking file call off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FileError> + Send + 'static,
) -> Result<T, FileError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| FileError::Io(e.to_string()))?
}

impl Session {
    /// A kept container's files wait for its exec: refused while one runs. Its supervisor's
    /// channel is taken by the exec only once the exec's task gets to it, after the exec was
    /// answered as started (202), so the channel alone would let a file call in first.
    fn kept_idle(&self) -> Result<(), FileError> {
        match self.running() {
            Some(_) => Err(FileError::Busy(
                "the session is running an exec; its files can be reached when it ends".into(),
            )),
            None => Ok(()),
        }
    }

    /// Writes an uploaded file into the workspace (see [`Workspace::write_file`](super::workspace::Workspace::write_file)).
    pub async fn write_file(&self, rel: &str, bytes: Vec<u8>) -> Result<(), FileError> {
        match &self.place {
            Place::Host(w) => {
                let (w, rel) = (w.clone(), rel.to_string());
                blocking(move || w.write_file(&rel, &bytes)).await
            }
            Place::Kept(k) => {
                relative(rel)?;
                self.kept_idle()?;
                k.write_file(rel, bytes).await
            }
        }
    }

    /// The bytes of a workspace file, at most `max` (see [`Workspace::read_file`](super::workspace::Workspace::read_file)).
    pub async fn read_file(&self, rel: &str, max: u64) -> Result<Vec<u8>, FileError> {
        match &self.place {
            Place::Host(w) => {
                let (w, rel) = (w.clone(), rel.to_string());
                blocking(move || w.read_file(&rel, max)).await
            }
            Place::Kept(k) => {
                relative(rel)?;
                self.kept_idle()?;
                k.read_file(rel, max).await
            }
        }
    }

    /// A workspace directory's entries ("" is the workspace; see [`Workspace::list`](super::workspace::Workspace::list)).
    pub async fn list(&self, rel: &str) -> Result<Vec<Entry>, FileError> {
        match &self.place {
            Place::Host(w) => {
                let (w, rel) = (w.clone(), rel.to_string());
                blocking(move || w.list(&rel)).await
            }
            Place::Kept(k) => {
                if !rel.is_empty() {
                    relative(rel)?;
                }
                self.kept_idle()?;
                k.list(rel).await
            }
        }
    }

    /// An exec's `cwd` as its sandbox sees it: relative to the workspace, or absolute inside
    /// [`WORKSPACE`], naming an existing directory reached through directories only.
    pub(super) async fn cwd(&self, cwd: &str) -> Result<PathBuf, FileError> {
        let inside = std::path::Path::new(WORKSPACE);
        match &self.place {
            Place::Host(w) => {
                let (w, cwd) = (w.clone(), cwd.to_string());
                blocking(move || w.cwd(&cwd, std::path::Path::new(WORKSPACE))).await
            }
            Place::Kept(k) => {
                let rel = crate::sandbox::files::cwd_relative(cwd, inside)?;
                let rel_str = rel.to_string_lossy().into_owned();
                k.is_dir(&rel_str).await.map_err(|e| match e {
                    FileError::NotFound(p) => {
                        FileError::InvalidPath(format!("cwd {p} does not exist"))
                    }
                    other => other,
                })?;
                Ok(inside.join(rel))
            }
        }
    }
}
