//! A session's directory on the host (local backend): its workspace, a tmpfs of the session's
//! disk quota (a full workspace is ENOSPC inside the sandbox and never a full host disk), and
//! the code files of its execs.
//!
//! The files API reads and writes the workspace from the daemon, as root, in a directory the
//! sandbox writes too. Every path is therefore resolved with `openat2` below the workspace with
//! no symlink followed, no mount crossed and no magic link, and only regular files are read or
//! written: a link the sandbox planted (`x -> /etc/shadow`) or a FIFO it made fails the call
//! instead of reaching the host.
//!
//! Owns: the directory's layout, its mount and its removal, path checks. Must not: know
//! sessions' owners or HTTP.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::mount::{MntFlags, MsFlags};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::{Gid, Uid};

use crate::sandbox::uids::UidLease;
use executor_arm_supervisor::archive::{self, ImportMode, Staged};

pub use crate::sandbox::files::{Entry, FileError, relative};

/// The workspace's mount point under a session's directory.
const WORKSPACE_DIR: &str = "workspace";
/// Where exec code files are kept, outside the workspace: a small tmpfs of its own, so the
/// mount table the sandbox reads shows a code file's bind as `/<file>` of that tmpfs and never
/// its host path (which would name `sessions.dir` and the session).
const CODE_DIR: &str = "code";
/// Code files the code tmpfs may hold at once (one per exec in flight).
const MAX_CODE_FILES: u64 = 1024;
/// Files and directories a workspace may hold (the tmpfs's inode limit).
pub(super) const MAX_INODES: u64 = 16384;

/// A session's directory: `<dir>/<session id>/{workspace,code}`.
#[derive(Debug)]
pub struct Workspace {
    root: PathBuf,
    uid: u32,
    gid: u32,
    /// The session's own host uid, held for the workspace's life (see [`crate::sandbox::uids`]).
    _lease: UidLease,
    /// The workspace tmpfs's root, opened once when it was mounted: every file call resolves
    /// from it, never from a path, so a call racing the session's end reaches the detached tmpfs
    /// (freed with this fd) and never the host directory under the mount point.
    fd: Option<OwnedFd>,
}

/// How every workspace path is resolved: below the start, no symlinks (magic ones included), no
/// mount crossed.
fn confined() -> ResolveFlag {
    ResolveFlag::RESOLVE_BENEATH
        | ResolveFlag::RESOLVE_NO_SYMLINKS
        | ResolveFlag::RESOLVE_NO_MAGICLINKS
        | ResolveFlag::RESOLVE_NO_XDEV
}

fn io(e: impl std::fmt::Display) -> FileError {
    FileError::Io(e.to_string())
}

impl Workspace {
    /// Makes `<dir>/<id>` with a tmpfs of `disk_bytes` at its workspace, owned by the session's
    /// uid (`lease`, held as long as the workspace) and `gid`. Anything made is removed again
    /// when a step fails.
    pub fn create(
        dir: &Path,
        id: &str,
        disk_bytes: u64,
        lease: UidLease,
        gid: u32,
    ) -> Result<Workspace, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let root = dir.join(id);
        let uid = lease.uid();
        let mut ws = Workspace {
            root,
            uid,
            gid,
            _lease: lease,
            fd: None,
        };
        let made = (|| {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&ws.root)
                .map_err(|e| format!("{}: {e}", ws.root.display()))?;
            for sub in [WORKSPACE_DIR, CODE_DIR] {
                std::fs::DirBuilder::new()
                    .mode(0o755)
                    .create(ws.root.join(sub))
                    .map_err(|e| format!("{sub}: {e}"))?;
            }
            nix::mount::mount(
                Some("tmpfs"),
                &ws.root.join(CODE_DIR),
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(format!("nr_inodes={MAX_CODE_FILES},mode=0755").as_str()),
            )
            .map_err(|e| format!("mounting the code tmpfs: {e}"))?;
            let options =
                format!("size={disk_bytes},nr_inodes={MAX_INODES},mode=0700,uid={uid},gid={gid}");
            nix::mount::mount(
                Some("tmpfs"),
                &ws.host_dir(),
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some(options.as_str()),
            )
            .map_err(|e| format!("mounting the workspace tmpfs: {e}"))?;
            nix::fcntl::open(
                &ws.host_dir(),
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| format!("opening the workspace: {e}"))
        })();
        match made {
            Ok(fd) => {
                ws.fd = Some(fd);
                Ok(ws)
            }
            Err(e) => {
                ws.destroy();
                Err(e)
            }
        }
    }

    /// The session's host uid: what its execs run as and what owns its files.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// The bytes the workspace's tmpfs holds, read through its own fd (never a path that a
    /// session's end could leave naming the host's directory). Blocking.
    pub fn used_bytes(&self) -> Option<u64> {
        let v = nix::sys::statvfs::fstatvfs(self.fd.as_ref()?).ok()?;
        Some((v.blocks() as u64).saturating_sub(v.blocks_free() as u64) * v.fragment_size() as u64)
    }

    /// The workspace on the host: what each exec gets bound at its workdir.
    pub fn host_dir(&self) -> PathBuf {
        self.root.join(WORKSPACE_DIR)
    }

    /// Writes an exec's code to a file of its own (readable by the sandbox, owned by root) and
    /// returns its host path.
    pub fn write_code(&self, exec_key: &str, code: &[u8]) -> Result<PathBuf, String> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.root.join(CODE_DIR).join(exec_key);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
            .map_err(|e| format!("writing the code file: {e}"))?;
        f.write_all(code)
            .map_err(|e| format!("writing the code file: {e}"))?;
        Ok(path)
    }

    /// Unmounts the workspace and removes the session's directory. Idempotent.
    pub fn destroy(&self) {
        remove_session_dir(&self.root);
    }

    fn open_root(&self) -> Result<OwnedFd, FileError> {
        self.fd
            .as_ref()
            .ok_or_else(|| FileError::Io("the workspace is not mounted".into()))?
            .try_clone()
            .map_err(io)
    }

    /// The directory `rel` (below the workspace; empty for the workspace itself) as an fd.
    fn open_dir(&self, rel: &Path, flags: OFlag) -> Result<OwnedFd, FileError> {
        let root = self.open_root()?;
        if rel.as_os_str().is_empty() {
            return nix::fcntl::openat(
                root.as_fd(),
                ".",
                flags | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(io);
        }
        let how = OpenHow::new()
            .flags(flags | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(confined());
        openat2(root.as_fd(), rel, how).map_err(|e| resolve_error(e, rel))
    }

    /// Checks that `cwd` names an existing directory of the workspace and returns it as the
    /// sandbox sees it. Accepted: a path relative to the workspace, or an absolute one inside
    /// `workspace_inside`.
    pub fn cwd(&self, cwd: &str, workspace_inside: &Path) -> Result<PathBuf, FileError> {
        let rel = crate::sandbox::files::cwd_relative(cwd, workspace_inside)?;
        self.open_dir(&rel, OFlag::O_PATH).map_err(|e| match e {
            FileError::NotFound(p) => FileError::InvalidPath(format!("cwd {p} does not exist")),
            other => other,
        })?;
        Ok(workspace_inside.join(rel))
    }

    /// Writes `bytes` to the file `rel` (made, or replaced), making its missing parent
    /// directories; both are owned by the sandbox's user.
    pub fn write_file(&self, rel: &str, bytes: &[u8]) -> Result<(), FileError> {
        let rel = relative(rel)?;
        let mut dir = self.open_root()?;
        let parents: Vec<_> = rel
            .parent()
            .into_iter()
            .flat_map(Path::components)
            .collect();
        for c in parents {
            let name = c.as_os_str();
            let how = || {
                OpenHow::new()
                    .flags(
                        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    )
                    .resolve(confined())
            };
            dir = match openat2(dir.as_fd(), name, how()) {
                Ok(d) => d,
                Err(Errno::ENOENT) => {
                    match nix::sys::stat::mkdirat(
                        dir.as_fd(),
                        name,
                        Mode::from_bits_truncate(0o755),
                    ) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(write_error(e, &rel)),
                    }
                    let made =
                        openat2(dir.as_fd(), name, how()).map_err(|e| resolve_error(e, &rel))?;
                    nix::unistd::fchownat(
                        made.as_fd(),
                        "",
                        Some(Uid::from_raw(self.uid)),
                        Some(Gid::from_raw(self.gid)),
                        nix::fcntl::AtFlags::AT_EMPTY_PATH,
                    )
                    .map_err(io)?;
                    made
                }
                Err(e) => return Err(resolve_error(e, &rel)),
            };
        }
        let name = rel
            .file_name()
            .ok_or_else(|| FileError::InvalidPath("the path names no file".into()))?;
        // What is there must be a regular file (or nothing): a directory, a symlink or a FIFO of
        // that name is not replaced.
        let existing = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(confined());
        match openat2(dir.as_fd(), name, existing) {
            Ok(fd) => {
                regular(&fd, &rel)?;
            }
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(resolve_error(e, &rel)),
        }
        // Written whole under a name of its own, then renamed over the target: a write that
        // fails half way (a full workspace) leaves the old file as it was.
        let temp = format!(".upload-{}", uuid::Uuid::new_v4().simple());
        let how = OpenHow::new()
            .flags(
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
            )
            .mode(Mode::from_bits_truncate(0o644))
            .resolve(confined());
        let fd = openat2(dir.as_fd(), temp.as_str(), how).map_err(|e| write_error(e, &rel))?;
        let written = (|| {
            nix::unistd::fchown(
                &fd,
                Some(Uid::from_raw(self.uid)),
                Some(Gid::from_raw(self.gid)),
            )
            .map_err(io)?;
            let mut file = std::fs::File::from(fd);
            file.write_all(bytes).map_err(|e| match e.raw_os_error() {
                Some(code) => write_error(Errno::from_raw(code), &rel),
                None => io(e),
            })?;
            nix::fcntl::renameat(dir.as_fd(), temp.as_str(), dir.as_fd(), name)
                .map_err(|e| write_error(e, &rel))
        })();
        if written.is_err() {
            let _ = nix::unistd::unlinkat(
                dir.as_fd(),
                temp.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
        written
    }

    /// The bytes of the regular file `rel`, at most `max` of them.
    pub fn read_file(&self, rel: &str, max: u64) -> Result<Vec<u8>, FileError> {
        let rel = relative(rel)?;
        let root = self.open_root()?;
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)
            .resolve(confined());
        let fd = openat2(root.as_fd(), &rel, how).map_err(|e| resolve_error(e, &rel))?;
        let st = regular(&fd, &rel)?;
        let size = st.st_size as u64;
        if size > max {
            return Err(FileError::TooLarge {
                path: rel.display().to_string(),
                size,
                max,
            });
        }
        let mut out = Vec::with_capacity(size as usize);
        // `take`: the sandbox may grow the file while it is read.
        std::fs::File::from(fd)
            .take(max + 1)
            .read_to_end(&mut out)
            .map_err(io)?;
        if out.len() as u64 > max {
            return Err(FileError::TooLarge {
                path: rel.display().to_string(),
                size: out.len() as u64,
                max,
            });
        }
        Ok(out)
    }

    /// Stages the tar `source` for the workspace directory `rel` ("" is the workspace), its
    /// members owned by the session's user; see `executor_arm_supervisor::archive`. Nothing is
    /// in the workspace until the result is committed.
    pub fn stage_archive(
        &self,
        rel: &str,
        source: impl Read,
        mode: ImportMode,
    ) -> Result<Staged, FileError> {
        let target = archive::workspace_path(rel)?;
        let root = self.open_root()?;
        Ok(archive::stage(
            root.as_fd(),
            &target,
            source,
            mode,
            Some((self.uid, self.gid)),
        )?)
    }

    /// The workspace directory `rel` ("" is the workspace), reached through directories only,
    /// to export as a tar.
    pub fn archive_dir(&self, rel: &str) -> Result<OwnedFd, FileError> {
        let target = archive::workspace_path(rel)?;
        let root = self.open_root()?;
        Ok(archive::open_dir(root.as_fd(), &target)?)
    }

    /// The entries of the directory `rel` (empty: the workspace), sorted by name; a symlink is
    /// listed as one, never followed.
    pub fn list(&self, rel: &str) -> Result<Vec<Entry>, FileError> {
        let rel = if rel.is_empty() {
            PathBuf::new()
        } else {
            relative(rel)?
        };
        let fd = self.open_dir(&rel, OFlag::O_RDONLY)?;
        let mut dir = nix::dir::Dir::from_fd(fd).map_err(io)?;
        let dirfd = nix::fcntl::openat(
            dir.as_fd(),
            ".",
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io)?;
        let mut entries = Vec::new();
        for e in dir.iter() {
            let e = e.map_err(io)?;
            let name = e.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            let Ok(st) = nix::sys::stat::fstatat(
                dirfd.as_fd(),
                name,
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ) else {
                continue; // removed meanwhile
            };
            let kind = match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
                SFlag::S_IFREG => "file",
                SFlag::S_IFDIR => "dir",
                SFlag::S_IFLNK => "symlink",
                _ => "other",
            };
            entries.push(Entry {
                name: name.to_string_lossy().into_owned(),
                kind,
                size: st.st_size as u64,
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }
}

impl Drop for Workspace {
    /// A workspace is never left mounted: whatever path drops it (a creation that failed half
    /// way, a session that ended) unmounts and removes it.
    fn drop(&mut self) {
        self.destroy();
    }
}

/// Unmounts `<root>/workspace` and `<root>/code` (lazily: a process still inside cannot keep
/// them) and removes the session directory `root`.
fn remove_session_dir(root: &Path) {
    for sub in [WORKSPACE_DIR, CODE_DIR] {
        let mp = root.join(sub);
        match nix::mount::umount2(&mp, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
            Err(e) => {
                tracing::warn!(path = %mp.display(), error = %e, "session mount not unmounted")
            }
        }
    }
    match std::fs::remove_dir_all(root) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %root.display(), error = %e, "session directory not removed")
        }
    }
}

/// Makes `dir` this daemon's: created if missing (mode 0700), required to be a real directory
/// (not a symlink) owned by this process's user and writable by nobody else, then locked
/// (`flock`) for the process's life, so two daemons never share it (each reaps what it finds
/// there at startup). The returned file holds the lock.
pub fn claim_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let shown = dir.display();
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("{shown}: {e}"))?;
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{shown}: {e}"))?;
    if !meta.is_dir() {
        return Err(format!(
            "{shown} is not a directory (a symlink is not followed)"
        ));
    }
    if meta.uid() != nix::unistd::geteuid().as_raw() || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{shown} must be owned by the daemon's user and writable by no one else"
        ));
    }
    let file = std::fs::File::open(dir).map_err(|e| format!("{shown}: {e}"))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| format!("{shown} is in use by another executor-arm ({e})"))
}

/// Removes every session directory under `dir` (a previous process's, at startup): real
/// directories only, never through a symlink. Returns how many there were.
pub fn reap(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let real_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if real_dir && name.to_string_lossy().starts_with(super::ID_PREFIX) {
            remove_session_dir(&e.path());
            n += 1;
        }
    }
    n
}

/// `rel` as a path below the workspace: relative, every component a plain name.
fn regular(fd: &OwnedFd, rel: &Path) -> Result<FileStat, FileError> {
    let st = nix::sys::stat::fstat(fd).map_err(io)?;
    if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) != SFlag::S_IFREG {
        return Err(FileError::NotAFile(format!(
            "{} is not a regular file",
            rel.display()
        )));
    }
    Ok(st)
}

fn resolve_error(e: Errno, rel: &Path) -> FileError {
    let p = rel.display().to_string();
    match e {
        Errno::ENOENT => FileError::NotFound(p),
        // A symlink on the way (RESOLVE_NO_SYMLINKS, O_NOFOLLOW), an escape, another mount.
        Errno::ELOOP | Errno::EXDEV => FileError::NotAFile(format!(
            "{p}: a symbolic link or another mount is on the way; it is not followed"
        )),
        Errno::ENOTDIR => FileError::NotAFile(format!("{p}: a component is not a directory")),
        Errno::EISDIR => FileError::NotAFile(format!("{p} is a directory")),
        Errno::ENXIO => FileError::NotAFile(format!("{p} is not a regular file")),
        Errno::ENOSPC | Errno::EDQUOT => FileError::NoSpace,
        other => FileError::Io(format!("{p}: {other}")),
    }
}

fn write_error(e: Errno, rel: &Path) -> FileError {
    match e {
        Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG => FileError::NoSpace,
        other => resolve_error(other, rel),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_relative_paths_are_accepted() {
        for ok in [
            "a",
            "a/b.txt",
            "dir/sub/x",
            "%2e%2e",
            "..a",
            "a..",
            ".hidden",
        ] {
            assert!(relative(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "..",
            "../x",
            "a/../b",
            "a/./b",
            "./a",
            "a//b",
            "a/",
            "a\0b",
        ] {
            assert!(
                matches!(relative(bad), Err(FileError::InvalidPath(_))),
                "{bad:?}"
            );
        }
        assert!(relative(&"x".repeat(256)).is_err());
    }
}
