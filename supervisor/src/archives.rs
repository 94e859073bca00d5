//! Kept mode's archive calls: a tar of a workspace directory out (`tarout`), a tar into one
//! (`tarin`), done by a helper with the command's identity (as the file calls are, see
//! [`super::files`]) with `executor_arm_supervisor::archive`, the code the daemon uses on a
//! host workspace.
//!
//! The helper writes protocol frames to its pipe (`o` data, `r` verdicts); this process checks
//! each and relays it, so a helper that misbehaves cannot put anything else on the report
//! channel. A tarin's archive arrives in chunks on stdin and is passed to the helper through a
//! pipe; when the helper stops early (a refused member, a full workspace), its verdict goes out
//! at once and the rest of the chunks are read and dropped up to the empty one, which keeps the
//! channel in step. A staged archive waits for the daemon's decision (commit or drop), which the
//! daemon takes once its audit line is written.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};

use executor_arm_supervisor::archive::{self, ArchiveError, ImportMode};
use executor_arm_supervisor::protocol::{
    self, ARCHIVE_COMMIT, CHUNK, FileHeader, FileOp, MAX_ARCHIVE_CHUNK, STAGED, TARIN_RESTORE, kind,
};
use nix::errno::Errno;
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, Pid};

use super::{
    Abandoned, Config, become_user, cloexec_pipe, default_signals, exit_now, fail, fork_verdict,
    frame, own_workspace, rd, rd_u32,
};

/// The verdict `err CODE 0 MESSAGE` of a failed archive call.
fn verdict(e: &ArchiveError) -> Vec<u8> {
    let code = match e {
        ArchiveError::Refused(_) => "badarchive",
        ArchiveError::NoSpace => "nospace",
        ArchiveError::TooLarge(_) => "archivetoolarge",
        ArchiveError::NotFound(_) => "notfound",
        ArchiveError::Io(_) => "io",
    };
    format!("err {code} 0 {}", e.to_string().replace(['\r', '\n'], " ")).into_bytes()
}

/// Writes frames to the helper's pipe; a broken pipe ends the helper.
struct Frames(File);

impl Frames {
    fn send(&mut self, k: u8, payload: &[u8]) {
        if self
            .0
            .write_all(&protocol::encode_frame(k, payload))
            .is_err()
        {
            exit_now(0);
        }
    }
}

/// The tar as `o` frames of at most [`CHUNK`] bytes.
impl Write for Frames {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(CHUNK);
        self.0
            .write_all(&protocol::encode_frame(kind::STDOUT, &buf[..n]))?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// In the helper, as the command's user: the workspace's root.
fn workspace_root(cfg: &Config) -> Result<OwnedFd, ArchiveError> {
    own_workspace(cfg);
    nix::fcntl::open(
        cfg.workdir.as_str(),
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| ArchiveError::Io(format!("{}: {}", cfg.workdir, e.desc())))
}

/// Forks the helper: `Some(pid)` in this process; `None` in the helper, which then runs as the
/// command's user (non-dumpable) and must end with [`exit_now`]. Err: why no helper could be
/// forked (nothing is framed: the caller answers in step).
fn helper(cfg: &Config) -> Result<Option<Pid>, Errno> {
    // SAFETY: the supervisor is single-threaded; the helper exits without returning.
    match unsafe { nix::unistd::fork() } {
        Err(e) => Err(e),
        Ok(ForkResult::Child) => {
            default_signals();
            // On failure no verdict is written: the parent says the helper gave none.
            if become_user(cfg.uid, cfg.gid, None).is_err() {
                exit_now(1);
            }
            // Non-dumpable whatever fs.suid_dumpable says: nothing else of this uid may read
            // or trace us.
            let _ = nix::sys::prctl::set_dumpable(false);
            Ok(None)
        }
        Ok(ForkResult::Parent { child }) => Ok(Some(child)),
    }
}

/// Reads one frame the helper wrote; None at its end or on anything that is not a frame of
/// an archive call.
fn helper_frame(pipe: &mut File) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    pipe.read_exact(&mut head).ok()?;
    let (k, len) = protocol::parse_frame_header(&head).ok()??;
    if k != kind::STDOUT && k != kind::RESULT {
        return None;
    }
    let mut payload = vec![0u8; len];
    pipe.read_exact(&mut payload).ok()?;
    Some((k, payload))
}

const NO_ANSWER: &[u8] = b"err io 0 the archive helper gave no answer";

/// One archive request, its header decoded.
pub fn archive_request(cfg: &Config, h: &FileHeader) -> Result<(), Abandoned> {
    match h.op {
        FileOp::TarOut => tar_out(cfg, h),
        FileOp::TarIn => tar_in(cfg, h),
        _ => Err(fail("not an archive request")),
    }
}

fn tar_out(cfg: &Config, h: &FileHeader) -> Result<(), Abandoned> {
    let (r, w) = cloexec_pipe().map_err(|m| fail(&m))?;
    let Some(pid) = helper(cfg).map_err(fork_verdict)? else {
        drop(r);
        let mut out = Frames(File::from(w));
        let result = archive::workspace_path(&h.path).and_then(|rel| {
            let root = workspace_root(cfg)?;
            let dir = archive::open_dir(root.as_fd(), &rel)?;
            let mut buffered = std::io::BufWriter::with_capacity(CHUNK, &mut out);
            let n = archive::export(dir.as_fd(), &mut buffered);
            drop(buffered);
            n
        });
        match result {
            Ok(_) => out.send(kind::RESULT, b"ok"),
            Err(e) => out.send(kind::RESULT, &verdict(&e)),
        }
        exit_now(0)
    };
    drop(w);
    let mut pipe = File::from(r);
    let mut ended = false;
    while let Some((k, payload)) = helper_frame(&mut pipe) {
        frame(k, &payload);
        if k == kind::RESULT {
            ended = true;
            break;
        }
    }
    if !ended {
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        frame(kind::RESULT, NO_ANSWER);
    }
    drop(pipe);
    while let Err(Errno::EINTR) = waitpid(pid, None) {}
    Ok(())
}

/// The helper's verdict frame (`r`), relayed; false when it gave none.
fn relay_verdict(answers: &mut File) -> Option<Vec<u8>> {
    match helper_frame(answers) {
        Some((k, payload)) if k == kind::RESULT => {
            frame(kind::RESULT, &payload);
            Some(payload)
        }
        _ => {
            frame(kind::RESULT, NO_ANSWER);
            None
        }
    }
}

fn tar_in(cfg: &Config, h: &FileHeader) -> Result<(), Abandoned> {
    let import = if h.n == TARIN_RESTORE {
        ImportMode::Restore
    } else {
        ImportMode::Upload
    };
    // data: archive bytes in; answers: the helper's frames out; decision: commit or drop in.
    let (data_r, data_w) = cloexec_pipe().map_err(|m| fail(&m))?;
    let (ans_r, ans_w) = cloexec_pipe().map_err(|m| fail(&m))?;
    let (dec_r, dec_w) = cloexec_pipe().map_err(|m| fail(&m))?;
    let forked = match helper(cfg) {
        Ok(forked) => forked,
        Err(e) => {
            // The archive's chunks are read to their end first, so the next request is read
            // where it starts.
            loop {
                let len = rd_u32();
                if len == 0 {
                    break;
                }
                if len > MAX_ARCHIVE_CHUNK as u64 {
                    frame(kind::FAILED, b"archive chunk too large");
                    exit_now(2);
                }
                rd(len);
            }
            return Err(fork_verdict(e));
        }
    };
    let Some(pid) = forked else {
        drop((data_w, ans_r, dec_w));
        let mut out = Frames(File::from(ans_w));
        let staged = archive::workspace_path(&h.path).and_then(|rel| {
            let root = workspace_root(cfg)?;
            archive::stage(root.as_fd(), &rel, File::from(data_r), import, None)
        });
        let staged = match staged {
            Ok(s) => s,
            Err(e) => {
                out.send(kind::RESULT, &verdict(&e));
                exit_now(0)
            }
        };
        out.send(
            kind::RESULT,
            format!("{STAGED}{}", staged.members).as_bytes(),
        );
        let mut decision = [0u8; 4];
        let commit = File::from(dec_r).read_exact(&mut decision).is_ok()
            && u32::from_be_bytes(decision) == ARCHIVE_COMMIT;
        if !commit {
            drop(staged);
            out.send(kind::RESULT, b"err io 0 the archive was dropped");
            exit_now(0)
        }
        match staged.commit() {
            Ok(()) => out.send(kind::RESULT, b"ok"),
            Err(e) => out.send(kind::RESULT, &verdict(&e)),
        }
        exit_now(0)
    };
    drop((data_r, ans_w, dec_r));
    let mut feed = Some(File::from(data_w));
    let mut answers = File::from(ans_r);
    let mut early = false;
    // The archive's chunks, up to the empty one; once the helper stopped reading, its verdict
    // goes out and the rest is dropped.
    loop {
        let len = rd_u32();
        if len == 0 {
            break;
        }
        if len > MAX_ARCHIVE_CHUNK as u64 {
            // Out of step: nothing after this can be read as a request.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            frame(kind::FAILED, b"archive chunk too large");
            exit_now(2);
        }
        let chunk = rd(len);
        if let Some(f) = &mut feed
            && f.write_all(&chunk).is_err()
        {
            feed = None;
            relay_verdict(&mut answers);
            early = true;
        }
    }
    drop(feed);
    if !early
        && let Some(v) = relay_verdict(&mut answers)
        && v.starts_with(STAGED.as_bytes())
    {
        let decision = rd(4);
        let _ = File::from(dec_w).write_all(&decision);
        relay_verdict(&mut answers);
    }
    drop(answers);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    while let Err(Errno::EINTR) = waitpid(pid, None) {}
    Ok(())
}
