//! Workspace archives: a tar of a workspace directory out, a tar into one, with the same rules on
//! the host (the local backend's workspace, written by the daemon as root) and in a kept
//! container (written by the supervisor's helper as the sandbox user). Both sides call the
//! functions here with a descriptor of the workspace's root.
//!
//! An upload goes in two steps, so nothing of a refused archive is ever seen:
//! 1. [`stage`]: every member is checked as it streams in and made in a fresh staging directory at
//!    the workspace's root (the same filesystem, so its quota and inode limit count it), mirroring
//!    the workspace from its root; any refusal, a full workspace or a broken stream removes it.
//! 2. [`Staged::commit`]: first a check that no member's type conflicts with what is there (a file
//!    over a directory, a directory over a file or a symlink, anything in a restore's non-empty
//!    directory), then `rename(2)` only, which allocates nothing, so the merge cannot run out of
//!    space. Dropping a [`Staged`] instead removes it.
//!
//! Accepted members: regular files, directories and symlinks. A symlink of an upload must point
//! inside the workspace (relative, resolved from its own directory without leaving the workspace's
//! root); a restore ([`ImportMode::Restore`], a workspace the sandbox itself made, into an empty
//! directory) recreates symlinks as they are. Never followed either way: every path is opened one
//! component at a time with `O_NOFOLLOW`, so a member can go through no symlink, the archive's own
//! or one already in the workspace. Refused (nothing kept): hard links, devices, FIFOs, sockets,
//! GNU sparse members (header or PAX), setuid/setgid/sticky bits, absolute names, `..`, names
//! deeper than [`MAX_DEPTH`], a PAX `size` override, an archive that ends early or is not a tar.
//! Directories get at least `rwx` for their owner (a merge must be able to move into them).
//!
//! The `tar` crate parses and writes; its `unpack` is never used (it trusts names and follows
//! links): each member is made here. Entries are read raw, so long names and PAX headers are
//! read here with a bound instead of whole into memory.
//!
//! Must not: know HTTP, sessions, or which side calls it.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid, UnlinkatFlags};

/// Deepest member path accepted (components): every level of a merge holds a descriptor.
pub const MAX_DEPTH: usize = 128;
/// Longest GNU long name or long link name (a path is at most 4096 bytes, with its NUL).
const MAX_LONG_NAME: u64 = 4097;
/// Largest PAX header read.
const MAX_PAX: u64 = 64 * 1024;
/// Archive bytes accepted beyond the workspace filesystem's size (headers, padding).
pub const OVERHEAD: u64 = 64 << 20;
/// Name prefix of a staging directory at the workspace's root.
pub const STAGING_PREFIX: &str = ".executor-arm-archive-";

/// What an import may recreate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportMode {
    /// A caller's archive: symlinks must stay inside the workspace; merged into what is there.
    Upload,
    /// A workspace the sandbox made (saved earlier): symlinks recreated as they are, into an
    /// empty directory only.
    Restore,
}

/// Why an archive call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArchiveError {
    /// The archive (a member, its name, its type, its end) is not acceptable; nothing was kept.
    Refused(String),
    /// The workspace's disk quota or inode limit is reached; nothing was kept.
    NoSpace,
    /// The archive is larger than the workspace could hold.
    TooLarge(String),
    /// The directory asked for does not exist.
    NotFound(String),
    Io(String),
}

impl std::fmt::Display for ArchiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArchiveError::Refused(m) | ArchiveError::TooLarge(m) | ArchiveError::Io(m) => {
                f.write_str(m)
            }
            ArchiveError::NoSpace => f.write_str("the workspace is full"),
            ArchiveError::NotFound(p) => write!(f, "no such directory: {p}"),
        }
    }
}

impl std::error::Error for ArchiveError {}

fn refused(m: impl Into<String>) -> ArchiveError {
    ArchiveError::Refused(m.into())
}

/// `name` for a message.
fn shown(name: &[u8]) -> String {
    String::from_utf8_lossy(name).escape_debug().to_string()
}

/// A member's path as components, or why it is refused; `None` for the archive's root (`.`,
/// `./`). A leading `./` and trailing `/` are dropped.
pub fn member_path(name: &[u8]) -> Result<Option<Vec<Vec<u8>>>, String> {
    let bad = |why: &str| format!("member '{}' {why}", shown(name));
    if name.contains(&0) {
        return Err(bad("has a NUL byte in its name"));
    }
    if name.starts_with(b"/") {
        return Err(bad("has an absolute name"));
    }
    if name.len() > 4096 {
        return Err(bad("has a name longer than 4096 bytes"));
    }
    let mut rest = name;
    while let Some(r) = rest.strip_prefix(b"./") {
        rest = r;
    }
    while let Some(r) = rest.strip_suffix(b"/") {
        rest = r;
    }
    if rest.is_empty() || rest == b"." {
        return Ok(None);
    }
    let mut out = Vec::new();
    for part in rest.split(|b| *b == b'/') {
        match part {
            b"" | b"." => return Err(bad("has an empty or '.' component")),
            b".." => return Err(bad("has a '..' component")),
            p if p.len() > 255 => return Err(bad("has a component longer than 255 bytes")),
            p => out.push(p.to_vec()),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(bad(&format!("is deeper than {MAX_DEPTH} directories")));
    }
    Ok(Some(out))
}

/// Whether a symlink in directory `dir` (components from the workspace's root) with `target`
/// stays inside the workspace: relative, and resolved from `dir` component by component never
/// above the root.
pub fn link_inside(dir: &[Vec<u8>], target: &[u8]) -> Result<(), String> {
    let bad = |why: &str| format!("symlink target '{}' {why}", shown(target));
    if target.is_empty() {
        return Err(bad("is empty"));
    }
    if target.contains(&0) || target.len() > 4095 {
        return Err(bad("is not a valid path"));
    }
    if target.starts_with(b"/") {
        return Err(bad(
            "is absolute: a symlink must point inside the workspace",
        ));
    }
    let mut depth = dir.len();
    for part in target.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| bad("points outside the workspace"))?;
            }
            _ => depth += 1,
        }
    }
    Ok(())
}

/// What a member makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberKind {
    File { size: u64, mode: u32 },
    Dir { mode: u32 },
    Symlink { target: Vec<u8> },
}

/// A member that passed the checks: where it goes (components from the workspace's root) and
/// what it makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub path: Vec<Vec<u8>>,
    pub kind: MemberKind,
}

/// Checks one member (its header's type, mode and size, its name and link name, both after any
/// GNU long name or PAX path) to be extracted below `target` (components from the workspace's
/// root). `Ok(None)`: the archive's root directory entry, which makes nothing.
pub fn check_member(
    entry_type: u8,
    mode: u32,
    size: u64,
    name: &[u8],
    link: &[u8],
    target: &[Vec<u8>],
    import: ImportMode,
) -> Result<Option<Member>, String> {
    let what = |why: &str| format!("member '{}' {why}", shown(name));
    let kind = match entry_type {
        b'0' | b'\0' => "file",
        b'5' => "dir",
        b'2' => "symlink",
        b'1' => return Err(what("is a hard link; hard links are not accepted")),
        b'3' | b'4' => {
            return Err(what(
                "is a device; only files, directories and symlinks are accepted",
            ));
        }
        b'6' => {
            return Err(what(
                "is a FIFO; only files, directories and symlinks are accepted",
            ));
        }
        b'S' => {
            return Err(what(
                "is a GNU sparse file; sparse members are not accepted",
            ));
        }
        other => {
            return Err(what(&format!(
                "has type '{}'; only files, directories and symlinks are accepted",
                (other as char).escape_debug()
            )));
        }
    };
    if mode & 0o7000 != 0 {
        return Err(what(&format!(
            "has mode {mode:o}: setuid, setgid and sticky bits are not accepted"
        )));
    }
    let Some(rel) = member_path(name)? else {
        return match kind {
            "dir" => Ok(None),
            _ => Err(what("names the archive's root but is not a directory")),
        };
    };
    if kind != "file" && size != 0 {
        return Err(what("is a directory or symlink with data"));
    }
    if kind == "file" && name.ends_with(b"/") {
        return Err(what("is a file whose name ends with '/'"));
    }
    let mut path = target.to_vec();
    path.extend(rel);
    if path[0].starts_with(STAGING_PREFIX.as_bytes()) {
        return Err(what("has a name the daemon keeps for itself"));
    }
    if path.len() > MAX_DEPTH {
        return Err(what(&format!("is deeper than {MAX_DEPTH} directories")));
    }
    let kind = match kind {
        "file" => MemberKind::File {
            size,
            mode: mode & 0o777,
        },
        "dir" => MemberKind::Dir {
            mode: (mode & 0o777) | 0o700,
        },
        _ => {
            match import {
                ImportMode::Upload => {
                    link_inside(&path[..path.len() - 1], link).map_err(|e| what(&e))?
                }
                ImportMode::Restore if link.is_empty() || link.contains(&0) => {
                    return Err(what("is a symlink without a valid target"));
                }
                ImportMode::Restore => {}
            }
            MemberKind::Symlink {
                target: link.to_vec(),
            }
        }
    };
    Ok(Some(Member { path, kind }))
}

/// PAX keys of a member's header: `path` and `linkpath` apply; `size` and GNU sparse keys are
/// refused (raw entries do not apply them, so accepting one would misread the archive); the
/// rest (times, owners, charsets, xattrs) are ignored.
/// A PAX header's `path` and `linkpath`.
type PaxNames = (Option<Vec<u8>>, Option<Vec<u8>>);

fn pax_names(data: &[u8]) -> Result<PaxNames, String> {
    let (mut path, mut link) = (None, None);
    for ext in tar::PaxExtensions::new(data) {
        let ext = ext.map_err(|_| "a malformed PAX header".to_string())?;
        match ext.key_bytes() {
            b"path" => path = Some(ext.value_bytes().to_vec()),
            b"linkpath" => link = Some(ext.value_bytes().to_vec()),
            b"size" => return Err("a PAX size override is not accepted".into()),
            k if k.starts_with(b"GNU.sparse") => {
                return Err("a GNU sparse member (PAX) is not accepted".into());
            }
            _ => {}
        }
    }
    Ok((path, link))
}

/// The archive's bytes as they are read: counted against a cap; an error of the source itself
/// (a broken upload) is remembered apart from the tar's own.
struct Counted<R> {
    inner: R,
    read: u64,
    cap: u64,
    over: bool,
    source: Option<String>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf).inspect_err(|e| {
            self.source.get_or_insert_with(|| e.to_string());
        })?;
        self.read += n as u64;
        if self.read > self.cap {
            self.over = true;
            return Err(std::io::Error::other("the archive is too large"));
        }
        Ok(n)
    }
}

fn errno_of(e: &std::io::Error) -> Option<Errno> {
    e.raw_os_error().map(Errno::from_raw)
}

fn is_full(e: Errno) -> bool {
    matches!(e, Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG)
}

/// A failed write below the staging directory.
fn write_failed(what: &str, e: Errno) -> ArchiveError {
    if is_full(e) {
        ArchiveError::NoSpace
    } else {
        ArchiveError::Io(format!("{what}: {}", e.desc()))
    }
}

/// The directory `name` of `dir`, never through a symlink: opened without O_DIRECTORY (gVisor
/// follows a symlink opened with O_DIRECTORY|O_NOFOLLOW), non-blocking (a FIFO must not hang
/// us), then checked to be one.
fn subdir(dir: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
    let fd = nix::fcntl::openat(
        dir,
        OsStr::from_bytes(name),
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let st = nix::sys::stat::fstat(&fd)?;
    if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) != SFlag::S_IFDIR {
        return Err(Errno::ENOTDIR);
    }
    Ok(fd)
}

/// What `name` in `dir` is (not followed), or None.
fn kind_at(dir: BorrowedFd<'_>, name: &[u8]) -> Result<Option<SFlag>, Errno> {
    match nix::sys::stat::fstatat(dir, OsStr::from_bytes(name), AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(SFlag::from_bits_truncate(
            st.st_mode & SFlag::S_IFMT.bits(),
        ))),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Opens the workspace directory `rel` (components) below `root`, never through a symlink.
pub fn open_dir(root: BorrowedFd<'_>, rel: &[Vec<u8>]) -> Result<OwnedFd, ArchiveError> {
    let mut dir = subdir(root, b".").map_err(|e| ArchiveError::Io(e.desc().to_string()))?;
    for (i, c) in rel.iter().enumerate() {
        let p = || shown(&rel[..=i].join(&b'/'));
        dir = subdir(dir.as_fd(), c).map_err(|e| match e {
            Errno::ENOENT => ArchiveError::NotFound(p()),
            Errno::ELOOP | Errno::ENOTDIR => refused(format!(
                "{}: a symbolic link or a non-directory; it is not followed",
                p()
            )),
            e => ArchiveError::Io(format!("{}: {}", p(), e.desc())),
        })?;
    }
    Ok(dir)
}

/// Who owns what an import makes: `Some` when the caller is not the workspace's owner (the
/// daemon as root), `None` when it is (the supervisor's helper).
pub type Owner = Option<(u32, u32)>;

fn chown_at(dir: BorrowedFd<'_>, name: &[u8], owner: Owner) -> Result<(), ArchiveError> {
    if let Some((uid, gid)) = owner {
        nix::unistd::fchownat(
            dir,
            OsStr::from_bytes(name),
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| ArchiveError::Io(format!("chown {}: {}", shown(name), e.desc())))?;
    }
    Ok(())
}

/// Removes `name` of `dir` and everything below it, never through a symlink.
fn remove_tree(dir: BorrowedFd<'_>, name: &[u8]) {
    let os = OsStr::from_bytes(name);
    if let Ok(Some(SFlag::S_IFDIR)) = kind_at(dir, name) {
        if let Ok(sub) = subdir(dir, name) {
            for child in names(sub.as_fd()).unwrap_or_default() {
                remove_tree(sub.as_fd(), &child);
            }
        }
        let _ = nix::unistd::unlinkat(dir, os, UnlinkatFlags::RemoveDir);
    } else {
        let _ = nix::unistd::unlinkat(dir, os, UnlinkatFlags::NoRemoveDir);
    }
}

/// The names in directory `dir` (`.` and `..` left out), sorted.
fn names(dir: BorrowedFd<'_>) -> Result<Vec<Vec<u8>>, Errno> {
    let fd = nix::fcntl::openat(
        dir,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut d = nix::dir::Dir::from_fd(fd)?;
    let mut out = Vec::new();
    for e in d.iter() {
        let name = e?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            out.push(name);
        }
    }
    out.sort();
    Ok(out)
}

/// An archive extracted into its staging directory, not yet in the workspace. Dropped without
/// [`Staged::commit`]: removed.
#[derive(Debug)]
pub struct Staged {
    root: OwnedFd,
    name: Vec<u8>,
    target: Vec<Vec<u8>>,
    import: ImportMode,
    /// Members read (extension headers not counted).
    pub members: u64,
    /// Archive bytes read.
    pub bytes: u64,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.name.is_empty() {
            remove_tree(self.root.as_fd(), &self.name);
        }
    }
}

/// The size of the filesystem `fd` is on, in bytes.
fn fs_size(fd: BorrowedFd<'_>) -> u64 {
    nix::sys::statvfs::fstatvfs(fd)
        .map(|s| s.blocks().saturating_mul(s.fragment_size()))
        .unwrap_or(u64::MAX / 2)
}

/// Refuses a restore into a directory that is not empty (or not a directory).
fn check_empty(root: BorrowedFd<'_>, target: &[Vec<u8>]) -> Result<(), ArchiveError> {
    match open_dir(root, target) {
        Ok(d) => {
            let n = names(d.as_fd()).map_err(|e| ArchiveError::Io(e.desc().to_string()))?;
            if n.iter().any(|n| !n.starts_with(STAGING_PREFIX.as_bytes())) {
                return Err(refused("a restore goes into an empty directory"));
            }
            Ok(())
        }
        Err(ArchiveError::NotFound(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Step 1 of an import: reads the tar from `source` into a new staging directory at the
/// workspace's root `root`, each member checked on its way in (see the module's rules), its
/// files owned by `owner`. `target`: where the archive goes, components from the root.
pub fn stage(
    root: BorrowedFd<'_>,
    target: &[Vec<u8>],
    source: impl Read,
    import: ImportMode,
    owner: Owner,
) -> Result<Staged, ArchiveError> {
    if import == ImportMode::Restore {
        check_empty(root, target)?;
    }
    let root = nix::unistd::dup(root).map_err(|e| ArchiveError::Io(e.desc().to_string()))?;
    let cap = fs_size(root.as_fd()).saturating_add(OVERHEAD);
    let mut staged = Staged {
        root,
        name: Vec::new(),
        target: target.to_vec(),
        import,
        members: 0,
        bytes: 0,
    };
    // A name of its own (another upload may be staging beside it).
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    for attempt in 0..16u32 {
        let name = format!("{STAGING_PREFIX}{}-{nanos:x}-{attempt}", std::process::id());
        match nix::sys::stat::mkdirat(
            staged.root.as_fd(),
            name.as_str(),
            Mode::from_bits_truncate(0o700),
        ) {
            Ok(()) => {
                staged.name = name.into_bytes();
                break;
            }
            Err(Errno::EEXIST) => continue,
            Err(e) => return Err(write_failed("staging directory", e)),
        }
    }
    if staged.name.is_empty() {
        return Err(ArchiveError::Io(
            "no staging directory could be made".into(),
        ));
    }
    chown_at(staged.root.as_fd(), &staged.name.clone(), owner)?;
    let mut src = Counted {
        inner: source,
        read: 0,
        cap,
        over: false,
        source: None,
    };
    let result = extract(&mut staged, &mut src, owner);
    staged.bytes = src.read;
    // A failure of the stream itself (the upload broke, or went past the cap) says so,
    // whatever the tar reader made of it.
    if src.over {
        return Err(ArchiveError::TooLarge(format!(
            "the archive is larger than the workspace can hold ({} bytes and more)",
            src.cap
        )));
    }
    if let Some(e) = src.source.take() {
        return Err(refused(format!("the archive did not arrive whole: {e}")));
    }
    result?;
    // Conflicts are found now, before the caller records the archive; the commit checks again.
    staged.check()?;
    Ok(staged)
}

/// Reads every entry of the archive into `staged`'s directory.
fn extract<R: Read>(
    staged: &mut Staged,
    src: &mut Counted<R>,
    owner: Owner,
) -> Result<(), ArchiveError> {
    let broken = |e: std::io::Error| {
        refused(format!(
            "the archive is truncated or not a tar archive: {e}"
        ))
    };
    let staging = subdir(staged.root.as_fd(), &staged.name)
        .map_err(|e| ArchiveError::Io(e.desc().to_string()))?;
    let (mut long_name, mut long_link, mut pax): (Option<Vec<u8>>, Option<Vec<u8>>, _) =
        (None, None, (None, None));
    // Where the last entry's data ended: an archive must go on to its end-of-archive block.
    let mut end = 0u64;
    {
        let mut archive = tar::Archive::new(&mut *src);
        let entries = archive.entries().map_err(broken)?.raw(true);
        for entry in entries {
            let mut entry = entry.map_err(broken)?;
            let h = entry.header();
            let size = entry.size();
            end = entry.raw_file_position() + size.div_ceil(512) * 512;
            let ty = h.entry_type().as_byte();
            match ty {
                b'L' => {
                    let mut n = bounded(&mut entry, size, MAX_LONG_NAME, "GNU long name")?;
                    while n.last() == Some(&0) {
                        n.pop();
                    }
                    long_name = Some(n);
                    continue;
                }
                b'K' => {
                    let mut n = bounded(&mut entry, size, MAX_LONG_NAME, "GNU long link name")?;
                    while n.last() == Some(&0) {
                        n.pop();
                    }
                    long_link = Some(n);
                    continue;
                }
                b'x' => {
                    let data = bounded(&mut entry, size, MAX_PAX, "PAX header")?;
                    pax = pax_names(&data).map_err(refused)?;
                    continue;
                }
                // Global PAX headers apply to no member here: read and left.
                b'g' => {
                    bounded(&mut entry, size, MAX_PAX, "PAX global header")?;
                    continue;
                }
                _ => {}
            }
            staged.members += 1;
            let name = pax
                .0
                .take()
                .or(long_name.take())
                .unwrap_or_else(|| h.path_bytes().into_owned());
            let link = pax
                .1
                .take()
                .or(long_link.take())
                .or_else(|| h.link_name_bytes().map(|l| l.into_owned()))
                .unwrap_or_default();
            pax = (None, None);
            let mode = h
                .mode()
                .map_err(|_| refused(format!("member '{}' has a malformed mode", shown(&name))))?;
            let mtime = h.mtime().unwrap_or(0);
            let member = check_member(ty, mode, size, &name, &link, &staged.target, staged.import)
                .map_err(refused)?;
            if let Some(m) = member {
                make(staging.as_fd(), &m, &mut entry, mtime, owner)?;
            }
        }
    }
    if long_name.is_some() || long_link.is_some() || pax != (None, None) {
        return Err(refused("the archive ends with a header of no member"));
    }
    // The rest (the end-of-archive blocks and padding) is read too: a stream must arrive whole.
    std::io::copy(src, &mut std::io::sink()).map_err(broken)?;
    if src.read < end + 512 {
        return Err(refused(
            "the archive is truncated: it has no end-of-archive block",
        ));
    }
    Ok(())
}

/// An extension header's data, at most `max` bytes.
fn bounded(
    entry: &mut impl Read,
    size: u64,
    max: u64,
    what: &str,
) -> Result<Vec<u8>, ArchiveError> {
    if size > max {
        return Err(refused(format!("a {what} of {size} bytes (at most {max})")));
    }
    let mut data = Vec::with_capacity(size as usize);
    entry.read_to_end(&mut data).map_err(|e| {
        refused(format!(
            "the archive is truncated or not a tar archive: {e}"
        ))
    })?;
    Ok(data)
}

/// Makes member `m` below `staging` (its missing parents made as directories), reading a file's
/// data from `data`.
fn make(
    staging: BorrowedFd<'_>,
    m: &Member,
    data: &mut impl Read,
    mtime: u64,
    owner: Owner,
) -> Result<(), ArchiveError> {
    let p = || shown(&m.path.join(&b'/'));
    let Some((name, parents)) = m.path.split_last() else {
        return Ok(());
    };
    let mut dir = subdir(staging, b".").map_err(|e| ArchiveError::Io(e.desc().to_string()))?;
    for c in parents {
        dir = match subdir(dir.as_fd(), c) {
            Ok(d) => d,
            Err(Errno::ENOENT) => {
                nix::sys::stat::mkdirat(
                    dir.as_fd(),
                    OsStr::from_bytes(c),
                    Mode::from_bits_truncate(0o755),
                )
                .map_err(|e| write_failed(&p(), e))?;
                chown_at(dir.as_fd(), c, owner)?;
                subdir(dir.as_fd(), c)
                    .map_err(|e| ArchiveError::Io(format!("{}: {}", p(), e.desc())))?
            }
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                return Err(refused(format!(
                    "member '{}' goes through a symlink or a file of the archive",
                    p()
                )));
            }
            Err(e) => return Err(ArchiveError::Io(format!("{}: {}", p(), e.desc()))),
        };
    }
    let dir = dir.as_fd();
    let os = OsStr::from_bytes(name);
    let existing =
        kind_at(dir, name).map_err(|e| ArchiveError::Io(format!("{}: {}", p(), e.desc())))?;
    let is_dir = matches!(m.kind, MemberKind::Dir { .. });
    match existing {
        Some(SFlag::S_IFDIR) if !is_dir => {
            return Err(refused(format!(
                "member '{}' is not a directory but the archive has a directory there",
                p()
            )));
        }
        Some(SFlag::S_IFDIR) => {}
        Some(_) if is_dir => {
            return Err(refused(format!(
                "member '{}' is a directory but the archive has a file or symlink there",
                p()
            )));
        }
        // A later member of the same name replaces the earlier one, as tar does.
        Some(_) => {
            nix::unistd::unlinkat(dir, os, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| ArchiveError::Io(format!("{}: {}", p(), e.desc())))?;
        }
        None => {}
    }
    match &m.kind {
        MemberKind::Dir { mode } => {
            if existing.is_none() {
                nix::sys::stat::mkdirat(dir, os, Mode::from_bits_truncate(0o700))
                    .map_err(|e| write_failed(&p(), e))?;
                chown_at(dir, name, owner)?;
            }
            let d = subdir(dir, name)
                .map_err(|e| ArchiveError::Io(format!("{}: {}", p(), e.desc())))?;
            nix::sys::stat::fchmod(&d, Mode::from_bits_truncate(*mode))
                .map_err(|e| ArchiveError::Io(format!("{}: {}", p(), e.desc())))?;
        }
        MemberKind::Symlink { target } => {
            nix::unistd::symlinkat(OsStr::from_bytes(target), dir, os)
                .map_err(|e| write_failed(&p(), e))?;
            chown_at(dir, name, owner)?;
        }
        MemberKind::File { size, mode } => {
            let fd = nix::fcntl::openat(
                dir,
                os,
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o600),
            )
            .map_err(|e| write_failed(&p(), e))?;
            chown_at(dir, name, owner)?;
            let mut file = std::fs::File::from(fd);
            let mut buf = vec![0u8; 64 * 1024];
            let mut left = *size;
            while left > 0 {
                let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                let n = match data.read(&mut buf[..want]) {
                    Ok(0) => {
                        return Err(refused(format!(
                            "the archive is truncated inside member '{}'",
                            p()
                        )));
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        return Err(refused(format!(
                            "the archive is truncated or not a tar archive: {e}"
                        )));
                    }
                };
                file.write_all(&buf[..n]).map_err(|e| match errno_of(&e) {
                    Some(e) => write_failed(&p(), e),
                    None => ArchiveError::Io(format!("{}: {e}", p())),
                })?;
                left -= n as u64;
            }
            nix::sys::stat::fchmod(&file, Mode::from_bits_truncate(*mode))
                .map_err(|e| ArchiveError::Io(format!("{}: {}", p(), e.desc())))?;
            let t = nix::sys::time::TimeSpec::new(i64::try_from(mtime).unwrap_or(0), 0);
            let _ = nix::sys::stat::futimens(file.as_fd(), &t, &t);
        }
    }
    Ok(())
}

impl Staged {
    /// Whether every staged member can take its place (see [`check_merge`]); the staging
    /// directory and the workspace's root.
    fn check(&self) -> Result<(OwnedFd, OwnedFd), ArchiveError> {
        let io = |e: Errno| ArchiveError::Io(e.desc().to_string());
        let staging = subdir(self.root.as_fd(), &self.name).map_err(io)?;
        let root = subdir(self.root.as_fd(), b".").map_err(io)?;
        if self.import == ImportMode::Restore {
            check_empty(root.as_fd(), &self.target)?;
        }
        check_merge(staging.as_fd(), root.as_fd(), &self.name, &mut Vec::new())?;
        Ok((staging, root))
    }

    /// Step 2 of an import: moves the staged members into the workspace by rename only, after
    /// checking that none conflicts with what is there (nothing moved otherwise).
    pub fn commit(mut self) -> Result<(), ArchiveError> {
        let (staging, root) = self.check()?;
        merge(staging.as_fd(), root.as_fd(), &self.name, &mut Vec::new())?;
        // What is left of the staging directory (directories merged into existing ones) goes.
        let name = std::mem::take(&mut self.name);
        remove_tree(self.root.as_fd(), &name);
        Ok(())
    }
}

/// Checks that every entry of staged directory `src` can take its place in `dst`: a directory
/// over a directory (then its entries, in turn), or over nothing; anything else over a
/// non-directory or nothing. `staging`: the staging directory's name (left out at the root).
fn check_merge(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    staging: &[u8],
    at: &mut Vec<Vec<u8>>,
) -> Result<(), ArchiveError> {
    let io = |e: Errno| ArchiveError::Io(e.desc().to_string());
    for name in names(src).map_err(io)? {
        if at.is_empty() && name == staging {
            continue;
        }
        at.push(name.clone());
        let there = kind_at(dst, &name).map_err(io)?;
        let here = kind_at(src, &name).map_err(io)?;
        let conflict = |why: &str| {
            refused(format!(
                "member '{}' {why}; nothing was extracted",
                shown(&at.join(&b'/'))
            ))
        };
        match (here, there) {
            (_, None) => {}
            (Some(SFlag::S_IFDIR), Some(SFlag::S_IFDIR)) => {
                let s = subdir(src, &name).map_err(io)?;
                let d = subdir(dst, &name).map_err(io)?;
                check_merge(s.as_fd(), d.as_fd(), staging, at)?;
            }
            (Some(SFlag::S_IFDIR), Some(_)) => {
                return Err(conflict(
                    "is a directory, but the workspace has a file or symlink there",
                ));
            }
            (_, Some(SFlag::S_IFDIR)) => {
                return Err(conflict(
                    "is not a directory, but the workspace has one there",
                ));
            }
            _ => {}
        }
        at.pop();
    }
    Ok(())
}

/// Moves every entry of `src` into `dst` (checked by [`check_merge`]): rename only.
fn merge(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    staging: &[u8],
    at: &mut Vec<Vec<u8>>,
) -> Result<(), ArchiveError> {
    let io = |e: Errno| ArchiveError::Io(e.desc().to_string());
    for name in names(src).map_err(io)? {
        if at.is_empty() && name == staging {
            continue;
        }
        let os = OsStr::from_bytes(&name);
        let there = kind_at(dst, &name).map_err(io)?;
        let both_dirs = kind_at(src, &name).map_err(io)? == Some(SFlag::S_IFDIR)
            && there == Some(SFlag::S_IFDIR);
        if there.is_none() {
            // Nothing there when checked: never replace what appeared since.
            let moved = match nix::fcntl::renameat2(src, os, dst, os, RenameFlags::RENAME_NOREPLACE)
            {
                Err(Errno::EINVAL) => nix::fcntl::renameat(src, os, dst, os),
                other => other,
            };
            moved.map_err(|e| {
                ArchiveError::Io(format!(
                    "moving '{}' into place: {}",
                    shown(&name),
                    e.desc()
                ))
            })?;
        } else if both_dirs {
            let s = subdir(src, &name).map_err(io)?;
            let d = subdir(dst, &name).map_err(io)?;
            at.push(name.clone());
            merge(s.as_fd(), d.as_fd(), staging, at)?;
            at.pop();
        } else {
            nix::fcntl::renameat(src, os, dst, os).map_err(|e| {
                ArchiveError::Io(format!(
                    "moving '{}' into place: {}",
                    shown(&name),
                    e.desc()
                ))
            })?;
        }
    }
    Ok(())
}

/// A tar of the directory `dir` written to `out`: its files, directories and symlinks (as
/// symlinks, never followed), names relative to it, sorted; anything else (a FIFO, a socket)
/// is left out, as are staging directories of uploads in progress. Returns the members written.
pub fn export(dir: BorrowedFd<'_>, out: impl Write) -> Result<u64, ArchiveError> {
    let mut builder = tar::Builder::new(out);
    let mut members = 0;
    let mut path = Vec::new();
    walk(dir, &mut builder, &mut path, &mut members)?;
    builder
        .into_inner()
        .and_then(|mut w| w.flush())
        .map_err(|e| ArchiveError::Io(format!("writing the archive: {e}")))?;
    Ok(members)
}

fn walk<W: Write>(
    dir: BorrowedFd<'_>,
    builder: &mut tar::Builder<W>,
    path: &mut Vec<Vec<u8>>,
    members: &mut u64,
) -> Result<(), ArchiveError> {
    let io = |e: Errno| ArchiveError::Io(format!("reading the workspace: {}", e.desc()));
    let written = |e: std::io::Error| ArchiveError::Io(format!("writing the archive: {e}"));
    if path.len() >= MAX_DEPTH {
        return Err(ArchiveError::Io(format!(
            "'{}' is deeper than {MAX_DEPTH} directories",
            shown(&path.join(&b'/'))
        )));
    }
    for name in names(dir).map_err(io)? {
        if path.is_empty() && name.starts_with(STAGING_PREFIX.as_bytes()) {
            continue;
        }
        let Ok(st) =
            nix::sys::stat::fstatat(dir, OsStr::from_bytes(&name), AtFlags::AT_SYMLINK_NOFOLLOW)
        else {
            continue; // removed meanwhile
        };
        path.push(name.clone());
        let rel = std::path::PathBuf::from(OsStr::from_bytes(&path.join(&b'/')));
        let mut h = tar::Header::new_gnu();
        h.set_mode(st.st_mode & 0o777);
        h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
        h.set_uid(u64::from(st.st_uid));
        h.set_gid(u64::from(st.st_gid));
        match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
            SFlag::S_IFDIR => {
                let Ok(sub) = subdir(dir, &name) else {
                    path.pop();
                    continue;
                };
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                builder
                    .append_data(&mut h, &rel, std::io::empty())
                    .map_err(written)?;
                *members += 1;
                walk(sub.as_fd(), builder, path, members)?;
            }
            SFlag::S_IFREG => {
                let Ok(fd) = nix::fcntl::openat(
                    dir,
                    OsStr::from_bytes(&name),
                    OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
                    Mode::empty(),
                ) else {
                    path.pop();
                    continue;
                };
                let st = nix::sys::stat::fstat(&fd).map_err(io)?;
                if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) != SFlag::S_IFREG {
                    path.pop();
                    continue;
                }
                let size = st.st_size as u64;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(size);
                // Exactly `size` bytes whatever the file does meanwhile: cut, or padded.
                let data = std::fs::File::from(fd)
                    .take(size)
                    .chain(std::io::repeat(0))
                    .take(size);
                builder.append_data(&mut h, &rel, data).map_err(written)?;
                *members += 1;
            }
            SFlag::S_IFLNK => {
                let Ok(target) = nix::fcntl::readlinkat(dir, OsStr::from_bytes(&name)) else {
                    path.pop();
                    continue;
                };
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                builder
                    .append_link(&mut h, &rel, std::path::Path::new(&target))
                    .map_err(written)?;
                *members += 1;
            }
            _ => {}
        }
        path.pop();
    }
    Ok(())
}

/// The workspace path `rel` ("" is the workspace) as components, checked like a member's name.
pub fn workspace_path(rel: &str) -> Result<Vec<Vec<u8>>, ArchiveError> {
    if rel.is_empty() {
        return Ok(Vec::new());
    }
    if rel.starts_with('/') || rel.ends_with('/') {
        return Err(refused(format!(
            "path '{}' must be relative to the workspace, without a trailing '/'",
            rel.escape_debug()
        )));
    }
    match member_path(rel.as_bytes()) {
        Ok(Some(p)) if !rel.starts_with("./") => Ok(p),
        Ok(_) | Err(_) => Err(refused(format!(
            "path '{}' has an empty, '.' or '..' component or is too long",
            rel.escape_debug()
        ))),
    }
}

#[cfg(test)]
#[path = "archive_tests.rs"]
mod tests;
