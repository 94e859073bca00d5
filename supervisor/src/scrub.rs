//! The scrub of a reusable container between two one-shot runs (kept mode, [`SCRUB_MAGIC`]):
//! what one run left must not reach the next run of the same container.
//!
//! In order, each step failing the scrub (the daemon then discards the container):
//! 1. every process but this one (PID 1) is killed, `kill(-1, SIGKILL)` pass after pass, until
//!    `/proc` shows none (zombies reaped between passes);
//! 2. the run's writable places (the workdir and `/tmp`, one tmpfs volume mounted at both) are
//!    emptied by a helper with the command's identity (everything in them is the command's: no
//!    process of that uid is left to race it), and their own mode and extended attributes are put
//!    back as they were when the container started, with its group, times, inode flags, and no
//!    extended attribute or ACL the owner could set;
//! 3. the checks: no SysV IPC object exists (runc containers refuse them through the IPC
//!    sysctls; a runtime that ignores those leaves them, and the container is discarded), both
//!    places are empty with their first mode, and this process is still PID 1, root and
//!    non-dumpable.
//!
//! The verdict is one frame: `Result("ok")`, or `Failed(why)`.

use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use executor_arm_supervisor::protocol::kind;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, Pid};

use super::{Abandoned, Config, become_user, default_signals, exit_now, fail, fork_failed, frame};

/// How long the kill of every process may take before the scrub fails.
const KILL_LIMIT: Duration = Duration::from_secs(3);
/// Where a one-shot run may write besides its workdir.
const TMP: &str = "/tmp";

/// The first state of a writable place, read when the kept supervisor starts.
pub struct Place {
    path: String,
    mode: u32,
    gid: u32,
    atime: (i64, i64),
    mtime: (i64, i64),
}

/// The workdir's and `/tmp`'s modes, groups and times as the container started with them.
pub fn places(cfg: &Config) -> Vec<Place> {
    let mut paths = vec![cfg.workdir.clone()];
    if cfg.workdir != TMP {
        paths.push(TMP.to_string());
    }
    paths
        .into_iter()
        .filter_map(|path| {
            let m = std::fs::symlink_metadata(&path).ok()?;
            Some(Place {
                mode: m.mode() & 0o7777,
                gid: m.gid(),
                atime: (m.atime(), m.atime_nsec()),
                mtime: (m.mtime(), m.mtime_nsec()),
                path,
            })
        })
        .collect()
}

/// Serves one scrub request (its magic already read).
pub fn scrub_request(cfg: &Config, places: &[Place]) -> Result<(), Abandoned> {
    // Every place read at start, or nothing is scrubbed.
    let expected = if cfg.workdir == TMP { 1 } else { 2 };
    if places.len() != expected {
        return Err(fail(
            "scrub: the run's places could not be read when the container started",
        ));
    }
    kill_everything().map_err(|why| fail(&format!("scrub: {why}")))?;
    empty(cfg, places)?;
    check(places).map_err(|why| fail(&format!("scrub: {why}")))?;
    frame(kind::RESULT, b"ok");
    Ok(())
}

/// Pids of `/proc` other than this process's.
fn others() -> Result<Vec<i32>, String> {
    let me = std::process::id();
    let dir = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    Ok(dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| *pid != me)
        .filter_map(|pid| i32::try_from(pid).ok())
        .collect())
}

fn kill_everything() -> Result<(), String> {
    if std::process::id() != 1 {
        return Err("the supervisor is not PID 1".into());
    }
    let until = Instant::now() + KILL_LIMIT;
    loop {
        // From PID 1 with CAP_KILL: every process of the container's pid namespace but this one.
        let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
        super::reap(None);
        let left = others()?;
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(format!(
                "{} processes were still there after 3 s of kills",
                left.len()
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Empties the places as the command's user, and puts their modes back; a helper that fails
/// says why on its pipe.
fn empty(cfg: &Config, places: &[Place]) -> Result<(), Abandoned> {
    let (r, w) = super::cloexec_pipe().map_err(|m| fail(&m))?;
    // SAFETY: the supervisor is single-threaded; the helper exits without returning.
    let helper = match unsafe { nix::unistd::fork() } {
        Err(e) => return Err(fork_failed(e)),
        Ok(ForkResult::Child) => {
            default_signals();
            drop(r);
            let result = become_user(cfg.uid, cfg.gid, None).and_then(|()| {
                let _ = nix::sys::prctl::set_dumpable(false);
                places.iter().try_for_each(empty_place)
            });
            if let Err(why) = result {
                let _ = super::write_all(
                    std::os::fd::AsFd::as_fd(&w),
                    why.replace('\n', " ").as_bytes(),
                );
                exit_now(1);
            }
            exit_now(0);
        }
        Ok(ForkResult::Parent { child }) => child,
    };
    drop(w);
    let mut why = Vec::new();
    let mut buf = [0u8; 1024];
    while why.len() < 4096 {
        match nix::unistd::read(std::os::fd::AsFd::as_fd(&r), &mut buf) {
            Ok(0) => break,
            Ok(n) => why.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    let status = loop {
        match waitpid(helper, None) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other,
        }
    };
    match status {
        Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
        _ => Err(fail(&format!(
            "scrub: emptying the run's places failed: {}",
            String::from_utf8_lossy(&why)
        ))),
    }
}

/// As the command's user: everything in `place` removed (a directory it made unreadable is
/// made readable first: it is its own), then the place's own mode and its user extended
/// attributes put back as at the container's start.
fn empty_place(place: &Place) -> Result<(), String> {
    let root = Path::new(&place.path);
    let owned = std::fs::symlink_metadata(root)
        .map_err(|e| format!("{}: {e}", place.path))?
        .uid()
        == nix::unistd::getuid().as_raw();
    if owned {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", place.path))?;
    }
    remove_children(root)?;
    // Read back with the same identity (the supervisor itself may not read the place: it holds
    // no capability over other users' files).
    if std::fs::read_dir(root)
        .map_err(|e| format!("{}: {e}", place.path))?
        .next()
        .is_some()
    {
        return Err(format!("{} is not empty", place.path));
    }
    if owned {
        clear_xattrs(root)?;
        clear_flags(root)?;
        let err = |e: nix::errno::Errno| format!("{}: {}", place.path, e.desc());
        // Its group (the owner may have given it another of its own), then its mode, then its
        // times (a time the run set is a channel to the next run).
        if std::fs::symlink_metadata(root).map(|m| m.gid()).ok() != Some(place.gid) {
            nix::unistd::chown(root, None, Some(nix::unistd::Gid::from_raw(place.gid)))
                .map_err(err)?;
        }
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(place.mode))
            .map_err(|e| format!("{}: {e}", place.path))?;
        let at = |(s, ns): (i64, i64)| nix::sys::time::TimeSpec::new(s, ns);
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            root,
            &at(place.atime),
            &at(place.mtime),
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .map_err(err)?;
    }
    Ok(())
}

/// Clears the inode flags the owner may set on `path` (`chattr`: nodump, noatime...); a
/// filesystem without them has none to clear.
fn clear_flags(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // The kernel reads and writes an int for these ioctls.
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`, which outlives the call; the
    // descriptor is open.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if matches!(
            e.raw_os_error(),
            Some(libc::ENOTTY | libc::ENOTSUP | libc::EINVAL)
        ) {
            return Ok(());
        }
        return Err(format!("{}: reading its flags: {e}", path.display()));
    }
    if flags == 0 {
        return Ok(());
    }
    let none: libc::c_int = 0;
    // SAFETY: FS_IOC_SETFLAGS reads one long from `none`, which outlives the call.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::FS_IOC_SETFLAGS, &none) } != 0 {
        return Err(format!(
            "{}: clearing its flags: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn remove_children(dir: &Path) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = entry.path();
        let meta =
            std::fs::symlink_metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if meta.is_dir() {
            // Its own directory, whatever mode it gave it: searchable and writable again.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| format!("{}: {e}", path.display()))?;
            remove_children(&path)?;
            std::fs::remove_dir(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        } else {
            std::fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// Removes every extended attribute of `path` its owner may set: `user.*` and the POSIX ACLs
/// (`system.posix_acl_access`, `system.posix_acl_default`: a default ACL would give every file
/// later runs make there this run's permissions). Then none but `security.*` may be left.
fn clear_xattrs(path: &Path) -> Result<(), String> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: NUL in the path", path.display()))?;
    let mut names = vec![0u8; 64 * 1024];
    // SAFETY: llistxattr(2) writes at most `names.len()` bytes into `names`, a live buffer, and
    // reads the NUL-terminated `c`.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        // A filesystem without extended attributes has none to clear.
        if e.raw_os_error() == Some(libc::ENOTSUP) {
            return Ok(());
        }
        return Err(format!("{}: listing its attributes: {e}", path.display()));
    }
    names.truncate(n as usize);
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if name.starts_with(b"security.") {
            continue;
        }
        if !name.starts_with(b"user.") && !name.starts_with(b"system.posix_acl_") {
            return Err(format!(
                "{}: an attribute the scrub cannot clear: {}",
                path.display(),
                String::from_utf8_lossy(name)
            ));
        }
        let cname = std::ffi::CString::new(name).map_err(|_| "an attribute name with NUL")?;
        // SAFETY: lremovexattr(2) reads two NUL-terminated strings that outlive the call.
        if unsafe { libc::lremovexattr(c.as_ptr(), cname.as_ptr()) } != 0 {
            return Err(format!(
                "{}: removing an attribute: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// The scrub's own checks, after it ran.
fn check(places: &[Place]) -> Result<(), String> {
    for table in ["shm", "msg", "sem"] {
        let text = std::fs::read_to_string(format!("/proc/sysvipc/{table}"))
            .map_err(|e| format!("/proc/sysvipc/{table}: {e}"))?;
        // A header line, then one line per object.
        if text.lines().skip(1).any(|l| !l.trim().is_empty()) {
            return Err(format!("a SysV {table} object is left"));
        }
    }
    for place in places {
        let meta =
            std::fs::symlink_metadata(&place.path).map_err(|e| format!("{}: {e}", place.path))?;
        if !meta.is_dir() || meta.mode() & 0o7777 != place.mode {
            return Err(format!("{} is not as the container started", place.path));
        }
    }
    // Sockets of the container's network namespace outlive their processes a while (TIME_WAIT)
    // and show the next run what this one connected to: a container with any is not reused.
    for table in ["tcp", "tcp6", "udp", "udp6", "raw", "raw6", "unix"] {
        let text = match std::fs::read_to_string(format!("/proc/net/{table}")) {
            Ok(text) => text,
            // A family the kernel lacks (no IPv6) has no table.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("/proc/net/{table}: {e}")),
        };
        if text.lines().skip(1).any(|l| !l.trim().is_empty()) {
            return Err(format!("a {table} socket is left"));
        }
    }
    if !others()?.is_empty() {
        return Err("a process appeared during the scrub".into());
    }
    let uid = nix::unistd::getresuid().map_err(|e| e.desc().to_string())?;
    if std::process::id() != 1 || !uid.effective.is_root() {
        return Err("the supervisor is not PID 1 as root any more".into());
    }
    if !matches!(nix::sys::prctl::get_dumpable(), Ok(false)) {
        return Err("the supervisor became dumpable".into());
    }
    Ok(())
}
