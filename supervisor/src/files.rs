//! Kept mode's file calls: put, get, list, dir, in the workdir, done by a helper process with
//! the command's identity (non-dumpable after the switch) that opens every path component with
//! O_NOFOLLOW: a symlink the command planted is never followed.
//!
//! Answer of the helper on its pipe: the data, then "\n" and the verdict, `ok` or
//! `err CODE SIZE MESSAGE` (no newline in it). The supervisor relays the data as `o` frames and
//! the verdict as the last frame (`r`).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};

use executor_arm_supervisor::protocol::{CHUNK, FileHeader, FileOp, kind};
use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::wait::waitpid;
use nix::unistd::ForkResult;

use super::{
    Abandoned, Config, become_user, default_signals, exit_now, fail, fork_verdict, frame,
    own_workspace, rd, rd_u32,
};

/// Why a file call failed: a code, a size, a message.
type Failure = (&'static str, u64, String);

fn errno_code(e: &std::io::Error) -> &'static str {
    match e.raw_os_error().map(Errno::from_raw) {
        Some(Errno::ENOENT) => "notfound",
        Some(Errno::ELOOP | Errno::ENOTDIR | Errno::EISDIR | Errno::ENXIO) => "notfile",
        Some(Errno::ENOSPC | Errno::EDQUOT) => "nospace",
        _ => "io",
    }
}

fn failure(what: &str, e: &std::io::Error) -> Failure {
    (errno_code(e), 0, format!("{what}: {}", describe(e)))
}

/// The error's text without std's " (os error N)".
fn describe(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => Errno::from_raw(n).desc().to_string(),
        None => e.to_string(),
    }
}

/// A directory component: opened without O_DIRECTORY (gVisor follows a symlink opened with
/// O_DIRECTORY|O_NOFOLLOW), non-blocking (a FIFO must not hang us), then checked to be one.
fn subdir(name: &str) -> std::io::Result<File> {
    let d = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(name)?;
    if !d.metadata()?.is_dir() {
        return Err(std::io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    Ok(d)
}

/// The helper's work, below the workdir, as the command's user; data goes to `out`.
fn helper(cfg: &Config, h: &FileHeader, data: &[u8], out: &mut impl Write) -> Result<(), Failure> {
    let mut parts: Vec<&str> = if h.path.is_empty() {
        Vec::new()
    } else {
        h.path.split('/').collect()
    };
    if parts
        .iter()
        .any(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return Err(("invalid", 0, "bad path".into()));
    }
    let name = match h.op {
        FileOp::Put | FileOp::Get => match parts.pop() {
            Some(n) => Some(n),
            None => return Err(("invalid", 0, "the path names no file".into())),
        },
        FileOp::List | FileOp::Dir | FileOp::TarOut | FileOp::TarIn => None,
    };
    own_workspace(cfg);
    nix::unistd::chdir(cfg.workdir.as_str())
        .map_err(|e| ("io", 0, format!("chdir {}: {}", cfg.workdir, e.desc())))?;
    for c in parts {
        let d = match subdir(c) {
            Ok(d) => d,
            Err(e) if h.op == FileOp::Put && e.raw_os_error() == Some(libc::ENOENT) => {
                let made = std::fs::DirBuilder::new().mode(0o755).create(c);
                if let Err(e) = made
                    && e.raw_os_error() != Some(libc::EEXIST)
                {
                    return Err(failure(&format!("mkdir {c}"), &e));
                }
                subdir(c).map_err(|e| failure(c, &e))?
            }
            Err(e) => return Err(failure(c, &e)),
        };
        nix::unistd::fchdir(d.as_fd())
            .map_err(|e| ("io", 0, format!("fchdir {c}: {}", e.desc())))?;
    }
    let io = |e: std::io::Error| ("io", 0, format!("write: {}", describe(&e)));
    match (h.op, name) {
        (FileOp::Dir, _) => Ok(()),
        (FileOp::List, _) => {
            let entries = std::fs::read_dir(".").map_err(|e| failure("opendir", &e))?;
            for e in entries.flatten() {
                // Removed meanwhile: skipped.
                let Ok(m) = std::fs::symlink_metadata(e.file_name()) else {
                    continue;
                };
                let t = m.file_type();
                let k = if t.is_file() {
                    'f'
                } else if t.is_dir() {
                    'd'
                } else if t.is_symlink() {
                    'l'
                } else {
                    'o'
                };
                out.write_all(format!("{k} {} ", m.size()).as_bytes())
                    .map_err(io)?;
                out.write_all(std::os::unix::ffi::OsStrExt::as_bytes(
                    e.file_name().as_os_str(),
                ))
                .map_err(io)?;
                out.write_all(b"\0").map_err(io)?;
            }
            Ok(())
        }
        (FileOp::Get, Some(name)) => {
            let mut f = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(name)
                .map_err(|e| failure(name, &e))?;
            let m = f.metadata().map_err(|e| failure(name, &e))?;
            if !m.is_file() {
                return Err(("notfile", 0, format!("{name} is not a regular file")));
            }
            if m.size() > h.n {
                return Err(("toolarge", m.size(), "too large".into()));
            }
            let mut got = 0u64;
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = match f.read(&mut buf) {
                    Ok(0) => return Ok(()),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(("io", 0, format!("read: {}", describe(&e)))),
                };
                got += n as u64;
                if got > h.n {
                    return Err(("toolarge", got, "too large".into()));
                }
                out.write_all(&buf[..n]).map_err(io)?;
            }
        }
        (FileOp::Put, Some(name)) => put(name, data),
        (FileOp::TarOut | FileOp::TarIn, _) => Err(("invalid", 0, "not a file call".into())),
        _ => Err(("invalid", 0, "the path names no file".into())),
    }
}

/// put: whole under a name of its own, then renamed over the target (a write that fails half
/// way leaves the old file); what is there must be a regular file or nothing.
fn put(name: &str, data: &[u8]) -> Result<(), Failure> {
    match std::fs::symlink_metadata(name) {
        Ok(m) if !m.is_file() => {
            return Err(("notfile", 0, format!("{name} is not a regular file")));
        }
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) => return Err(failure(name, &e)),
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = format!(".upload-{}-{nanos}", std::process::id());
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| failure("create", &e))?;
    let written = f.write_all(data).and_then(|()| f.flush());
    drop(f);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(failure("write", &e));
    }
    if let Err(e) = std::fs::rename(&tmp, name) {
        let _ = std::fs::remove_file(&tmp);
        return Err(failure("rename", &e));
    }
    Ok(())
}

/// One file request, after its magic: a helper does it, this process relays its answer.
pub fn file_request(cfg: &Config) -> Result<(), Abandoned> {
    let len = rd_u32();
    let raw = rd(len);
    let h = FileHeader::decode(&raw).map_err(|e| fail(&e))?;
    if matches!(h.op, FileOp::TarOut | FileOp::TarIn) {
        return super::archives::archive_request(cfg, &h);
    }
    let data = if h.op == FileOp::Put {
        rd(h.n)
    } else {
        Vec::new()
    };
    let (r, w) = super::cloexec_pipe().map_err(|m| fail(&m))?;
    // SAFETY: the supervisor is single-threaded; the helper exits without returning.
    let helper_pid = match unsafe { nix::unistd::fork() } {
        Err(e) => return Err(fork_verdict(e)),
        Ok(ForkResult::Child) => {
            default_signals();
            drop(r);
            let mut out = std::io::BufWriter::with_capacity(CHUNK, File::from(w));
            let result = match become_user(cfg.uid, cfg.gid, None) {
                Err(why) => Err(("io", 0, why)),
                Ok(()) => {
                    // Non-dumpable whatever fs.suid_dumpable says (the switch set that value):
                    // nothing else of this uid may read or trace us.
                    let _ = nix::sys::prctl::set_dumpable(false);
                    helper(cfg, &h, &data, &mut out)
                }
            };
            // The verdict is the last line: a code, a size, a message (no newline in it).
            let verdict = match result {
                Ok(()) => "\nok".to_string(),
                Err((code, size, msg)) => {
                    format!("\nerr {code} {size} {}", msg.replace(['\r', '\n'], " "))
                }
            };
            let _ = out.write_all(verdict.as_bytes()).and_then(|()| out.flush());
            exit_now(0);
        }
        Ok(ForkResult::Parent { child }) => child,
    };
    drop(w);
    let cap = if h.op == FileOp::Get { h.n } else { 64 << 20 } + CHUNK as u64;
    let mut all = Vec::new();
    let mut pipe = File::from(r);
    let mut buf = vec![0u8; CHUNK];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        if all.len() as u64 > cap {
            let _ = nix::sys::signal::kill(helper_pid, Signal::SIGKILL);
            all = b"\nerr io 0 answer too large".to_vec();
            break;
        }
    }
    drop(pipe);
    while let Err(Errno::EINTR) = waitpid(helper_pid, None) {}
    let (body, verdict) = match all.iter().rposition(|b| *b == b'\n') {
        None => (&[][..], &b"err io 0 the helper gave no answer"[..]),
        Some(cut) => (&all[..cut], &all[cut + 1..]),
    };
    if verdict == b"ok" {
        for chunk in body.chunks(CHUNK) {
            frame(kind::STDOUT, chunk);
        }
    }
    frame(kind::RESULT, verdict);
    Ok(())
}
