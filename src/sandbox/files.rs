//! A kept sandbox's workspace as the files API sees it: paths, listings, errors, and the
//! [`Kept`] sandbox through which a session on a container backend reaches its files.
//!
//! Owns: which workspace paths are acceptable (relative, plain components), the errors of a file
//! call, and the kept sandbox's interface. Must not: know sessions or HTTP.

use std::path::{Component, Path, PathBuf};

pub use executor_arm_supervisor::archive::{ArchiveError, ImportMode};

/// Why a file call failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FileError {
    /// The path itself is not acceptable (400).
    #[error("{0}")]
    InvalidPath(String),
    #[error("no such file or directory: {0}")]
    NotFound(String),
    /// A symlink, a directory where a file was asked for, a FIFO... (400).
    #[error("{0}")]
    NotAFile(String),
    #[error("{path} is {size} bytes, above sessions.max_file_bytes ({max})")]
    TooLarge { path: String, size: u64, max: u64 },
    /// The workspace's quota is used up (507).
    #[error("the session's workspace is full (its disk quota or inode limit is reached)")]
    NoSpace,
    /// The sandbox is running an exec and its files cannot be reached meanwhile (409).
    #[error("{0}")]
    Busy(String),
    /// An uploaded archive is refused (a member, its name or type, its end); nothing of it was
    /// kept (400).
    #[error("{0}")]
    BadArchive(String),
    /// An uploaded archive is larger than the workspace could hold; nothing of it was kept (413).
    #[error("{0}")]
    ArchiveTooLarge(String),
    /// The sandbox's processes hold all of its pids: the call's helper could not be made (429).
    #[error("no process free for the file call: {0}")]
    NoPids(String),
    #[error("{0}")]
    Io(String),
}

impl From<ArchiveError> for FileError {
    fn from(e: ArchiveError) -> Self {
        match e {
            ArchiveError::Refused(m) => FileError::BadArchive(m),
            ArchiveError::NoSpace => FileError::NoSpace,
            ArchiveError::TooLarge(m) => FileError::ArchiveTooLarge(m),
            ArchiveError::NotFound(p) => FileError::NotFound(p),
            ArchiveError::Io(m) => FileError::Io(m),
        }
    }
}

/// Bytes as they arrive (an archive being uploaded) or leave (one being downloaded).
pub type ByteStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send>>;

/// An uploaded archive once checked and staged, before anything of it enters the workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staging {
    /// Members of the archive (files, directories, symlinks).
    pub members: u64,
}

/// Asked once an archive is staged: true lets it into the workspace, false drops it (nothing of
/// it is kept).
pub type Approve = Box<dyn FnOnce(&Staging) -> bool + Send>;

/// One entry of a directory listing.
#[derive(Debug, Clone, serde::Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = FileEntry)]
pub struct Entry {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^(file|dir|symlink|other)$")]
    pub kind: &'static str,
    pub size: u64,
}

/// Checks a workspace path: relative, at most 4096 bytes, no NUL, no empty, `.` or `..`
/// component, none longer than 255 bytes.
pub fn relative(rel: &str) -> Result<PathBuf, FileError> {
    let bad = |why: &str| FileError::InvalidPath(format!("path '{}' {why}", rel.escape_debug()));
    if rel.is_empty() {
        return Err(bad("is empty"));
    }
    if rel.len() > 4096 {
        return Err(bad("is longer than 4096 bytes"));
    }
    if rel.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    if rel.starts_with('/') {
        return Err(bad("is absolute: paths are relative to the workspace"));
    }
    let mut out = PathBuf::new();
    for part in rel.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(bad("has an empty, '.' or '..' component"));
        }
        if part.len() > 255 {
            return Err(bad("has a component longer than 255 bytes"));
        }
        out.push(part);
    }
    debug_assert!(out.components().all(|c| matches!(c, Component::Normal(_))));
    Ok(out)
}

/// An exec's `cwd` relative to the workspace: accepted as a path relative to it, or as an
/// absolute one inside `workspace_inside` (where the sandbox sees the workspace); "" is the
/// workspace itself.
pub fn cwd_relative(cwd: &str, workspace_inside: &Path) -> Result<PathBuf, FileError> {
    let rel = match Path::new(cwd).strip_prefix(workspace_inside) {
        Ok(rest) => rest.to_path_buf(),
        Err(_) if cwd.starts_with('/') => {
            return Err(FileError::InvalidPath(format!(
                "cwd must be inside {}",
                workspace_inside.display()
            )));
        }
        Err(_) => PathBuf::from(cwd),
    };
    if rel.as_os_str().is_empty() {
        return Ok(rel);
    }
    relative(&rel.to_string_lossy())
}

/// A sandbox kept for a session's life (docker/gVisor: one container that runs every exec of
/// the session), with its workspace inside it. Opened by [`super::Sandbox::keep`]; dropping the
/// last handle destroys it.
#[async_trait::async_trait]
pub trait Kept: Send + Sync {
    /// What the sandbox is (e.g. a container's short id), for logs and descriptions.
    fn name(&self) -> String;

    /// Why the sandbox can no longer run anything, once that is so (it died, or its
    /// supervisor stopped answering).
    fn gone(&self) -> Option<String>;

    /// What the sandbox uses now (memory, CPU time) and the bytes its workspace (at `workspace`
    /// inside it) holds, when they can be read. Blocking (reads the host's cgroup and mount
    /// files).
    fn usage(&self, _workspace: &std::path::Path) -> Option<(super::Usage, Option<u64>)> {
        None
    }

    /// Writes `bytes` to the file `rel` (made or replaced whole; missing parents made).
    async fn write_file(&self, rel: &str, bytes: Vec<u8>) -> Result<(), FileError>;

    /// The bytes of the regular file `rel`, at most `max`.
    async fn read_file(&self, rel: &str, max: u64) -> Result<Vec<u8>, FileError>;

    /// The entries of the directory `rel` ("" is the workspace), sorted by name.
    async fn list(&self, rel: &str) -> Result<Vec<Entry>, FileError>;

    /// Whether `rel` ("" is the workspace) is a directory of the workspace (reached through
    /// directories only, no symlink followed).
    async fn is_dir(&self, rel: &str) -> Result<(), FileError>;

    /// A tar of the workspace directory `rel` ("" is the workspace; see
    /// `executor_arm_supervisor::archive::export`), as it is read. Errors before the first byte
    /// (no such directory, a symlink on the way) are this call's; a failure later ends the
    /// stream with an error.
    async fn export_archive(&self, rel: &str) -> Result<ByteStream, FileError>;

    /// Extracts the tar `body` into the workspace directory `rel` ("" is the workspace), staged
    /// first and moved in only if `approve` says so (see `executor_arm_supervisor::archive`).
    /// Anything refused leaves the workspace as it was.
    async fn import_archive(
        &self,
        rel: &str,
        mode: ImportMode,
        body: ByteStream,
        approve: Approve,
    ) -> Result<Staging, FileError>;

    /// Ends the sandbox now (the session ended): nothing runs in it any more and it is
    /// destroyed, whoever still holds a handle.
    async fn close(&self);

    /// A connection to `127.0.0.1:port` inside the sandbox (see [`super::ports`]).
    async fn connect_port(
        &self,
        port: u16,
    ) -> Result<super::ports::PortConn, super::ports::PortError>;

    /// For the backend that made it.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl std::fmt::Debug for dyn Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kept({})", self.name())
    }
}
