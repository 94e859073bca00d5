//! Paused sessions on disk: each one a directory under `sessions.store_dir` holding its
//! workspace as a tar and its record, written so that a crash at any point leaves either the
//! old state or the new one, never a mix.
//!
//! A directory `<store_dir>/<session id>/` holds, when the session is paused:
//! - `workspace-<sha256 hex>.tar`: the workspace, named by its digest;
//! - `session.json`: the [`PausedRecord`], naming that tar and its digest. Its presence is the
//!   commit: a pause is done once it has been renamed into place (and the directory synced).
//!
//! and transiently:
//! - `<name>+<instance>.part`: a file being written by the daemon `instance`;
//! - `claim+<instance>.json`: the record, renamed there by the daemon `instance` that is
//!   resuming or deleting the session. The rename is the claim: of several replicas sharing the
//!   directory, exactly one wins it. A resume that fails renames it back.
//!
//! Leftovers of a daemon that died mid-way (parts, claims) are recognised by their instance
//! name (`<host>-<pid>`) and their status-change time (ctime: set by the write of a part and by
//! the rename that makes a claim, whereas a claim's mtime is its pause's): this host's dead
//! processes' at once, and those of an earlier process of this very name (a daemon restarted in
//! a container is pid 1 again) once they are older than this process's store; another host's
//! once they are older than [`STALE_AFTER`] (no pause or resume takes that long).
//!
//! Owns: the layout, the atomic writes, the claims, the digest check. Must not: know what a
//! workspace holds (the tar comes and goes as bytes) or decide anything about sessions.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use super::ID_PREFIX;
use crate::execution::SessionLimits;
use crate::policy::Grant;
use crate::sandbox::BackendKind;

/// The committed record's name.
const RECORD: &str = "session.json";
/// Parts and claims of another host's daemon count as abandoned after this.
pub const STALE_AFTER: Duration = Duration::from_secs(3600);
/// How far a file's ctime may lag the clock it is compared with (the kernel stamps files with a
/// coarse clock); a restarted daemon takes longer than this to come back.
const CLOCK_SLACK: Duration = Duration::from_millis(50);
/// Version of [`PausedRecord`]'s layout.
const VERSION: u32 = 1;

/// What a paused session keeps: enough to give it a fresh sandbox under the same grant.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PausedRecord {
    pub version: u32,
    pub id: String,
    pub subject: String,
    pub tenant: String,
    pub language: String,
    pub profile: String,
    pub backend: BackendKind,
    pub limits: SessionLimits,
    pub token_id: Option<String>,
    pub grant: Grant,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub expires_at: chrono::DateTime<chrono::Utc>,
    pub paused_at: chrono::DateTime<chrono::Utc>,
    /// When it ends if nobody resumes it: its TTL, or `sessions.paused_ttl_seconds` after the
    /// pause, the earlier.
    pub paused_until: chrono::DateTime<chrono::Utc>,
    pub idle_timeout_seconds: u64,
    pub execs: u64,
    /// The exec ids it ran (its exec routes serve these after a resume).
    pub ran: Vec<String>,
    pub workspace: SavedWorkspace,
}

/// The saved workspace a record names.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct SavedWorkspace {
    /// `sha256:<hex>` of the tar.
    pub sha256: String,
    pub bytes: u64,
}

impl SavedWorkspace {
    fn file_name(&self) -> String {
        format!(
            "workspace-{}.tar",
            self.sha256.trim_start_matches("sha256:")
        )
    }
}

/// Why saving failed.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The store has no room (ENOSPC, EDQUOT), or the workspace's tar outgrew its bound.
    #[error("{0}")]
    Full(String),
    /// The store cannot be written (permissions, a missing mount, any other I/O error).
    #[error("{0}")]
    Unwritable(String),
}

impl SaveError {
    fn of(what: &str, e: io::Error) -> SaveError {
        let why = format!("sessions.store_dir: {what}: {e}");
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => SaveError::Full(why),
            _ => SaveError::Unwritable(why),
        }
    }
}

/// The directory of paused sessions.
#[derive(Clone)]
pub struct PausedStore {
    dir: PathBuf,
    /// This daemon's instance name (`<host>-<pid>`), which names its parts and claims.
    instance: String,
    /// When this process opened the store: a part or claim of its own name older than this is
    /// an earlier process's.
    opened: SystemTime,
}

/// One session's directory as found by [`PausedStore::scan`].
#[derive(Debug)]
pub enum Found {
    Paused(Box<PausedRecord>),
    /// A pause that never committed, or a claim, that its daemon abandoned.
    Abandoned(PathBuf),
    /// Work in progress by a live daemon, or something unreadable: left alone.
    Busy,
}

impl PausedStore {
    /// Opens (creating, mode 0700) the store.
    pub fn open(dir: &Path, instance: &str) -> io::Result<PausedStore> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        Ok(PausedStore {
            dir: dir.to_path_buf(),
            instance: instance.to_string(),
            opened: SystemTime::now(),
        })
    }

    fn session_dir(&self, id: &str) -> io::Result<PathBuf> {
        let plain = id.starts_with(ID_PREFIX)
            && id.len() <= 64
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !plain {
            return Err(io::Error::new(io::ErrorKind::NotFound, "not a session id"));
        }
        Ok(self.dir.join(id))
    }

    /// Starts saving session `id`'s workspace; at most `limit` bytes of tar are taken.
    pub fn begin(&self, id: &str, limit: u64) -> Result<Saving, SaveError> {
        let dir = self
            .session_dir(id)
            .map_err(|e| SaveError::Unwritable(e.to_string()))?;
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(SaveError::of("session directory", e)),
        }
        let part = dir.join(format!("workspace+{}.part", self.instance));
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&part)
            .map_err(|e| SaveError::of("workspace file", e))?;
        Ok(Saving {
            dir,
            part,
            file: Some(file),
            hasher: Sha256::new(),
            bytes: 0,
            limit,
            failed: None,
            committed: false,
        })
    }

    /// Commits a save: the tar is synced and named by its digest, then the record naming it
    /// replaces any earlier one in a single rename. Earlier tars are removed after.
    pub fn commit(
        &self,
        mut saving: Saving,
        record: &mut PausedRecord,
    ) -> Result<SavedWorkspace, SaveError> {
        if let Some(e) = saving.failed.take() {
            return Err(e);
        }
        let file = saving.file.take().expect("a save in progress has its file");
        file.sync_all()
            .map_err(|e| SaveError::of("workspace file", e))?;
        drop(file);
        let saved = SavedWorkspace {
            sha256: format!("sha256:{}", hex::encode(saving.hasher.clone().finalize())),
            bytes: saving.bytes,
        };
        fs::rename(&saving.part, saving.dir.join(saved.file_name()))
            .map_err(|e| SaveError::of("workspace file", e))?;
        record.version = VERSION;
        record.workspace = saved.clone();
        let json = serde_json::to_vec_pretty(record)
            .map_err(|e| SaveError::Unwritable(format!("session record: {e}")))?;
        let part = saving.dir.join(format!("{RECORD}+{}.part", self.instance));
        write_synced(&part, &json).map_err(|e| SaveError::of("session record", e))?;
        fs::rename(&part, saving.dir.join(RECORD))
            .map_err(|e| SaveError::of("session record", e))?;
        sync_dir(&saving.dir).map_err(|e| SaveError::of("session directory", e))?;
        // Committed. Earlier tars of the session are no longer named by anything.
        remove_other_tars(&saving.dir, &saved.file_name());
        saving.committed = true;
        Ok(saved)
    }

    /// The committed record of session `id`, if it is paused here (and not claimed).
    pub fn read(&self, id: &str) -> Option<PausedRecord> {
        let dir = self.session_dir(id).ok()?;
        read_record(&dir.join(RECORD)).ok()
    }

    /// Claims paused session `id` for this daemon: None when it is not paused here (any more:
    /// another daemon may have claimed it first).
    pub fn claim(&self, id: &str) -> Option<Claim> {
        let dir = self.session_dir(id).ok()?;
        let claimed = dir.join(format!("claim+{}.json", self.instance));
        fs::rename(dir.join(RECORD), &claimed).ok()?;
        match read_record(&claimed) {
            Ok(record) => Some(Claim {
                dir,
                claimed,
                record,
                done: false,
            }),
            Err(e) => {
                tracing::warn!(session_id = id, error = %e, "paused session's record is unreadable; left in place");
                let _ = fs::rename(&claimed, dir.join(RECORD));
                None
            }
        }
    }

    /// How many sessions of (`subject`, `tenant`) are paused in the store now.
    pub fn paused_of(&self, subject: &str, tenant: &str) -> usize {
        self.scan()
            .iter()
            .filter(|(_, f)| {
                matches!(f, Found::Paused(r) if r.subject == subject && r.tenant == tenant)
            })
            .count()
    }

    /// Every session directory of the store, as found now.
    pub fn scan(&self) -> Vec<(String, Found)> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(ID_PREFIX) || self.session_dir(&name).is_err() {
                continue;
            }
            let found = self.inspect(&entry.path());
            out.push((name, found));
        }
        out
    }

    fn inspect(&self, dir: &Path) -> Found {
        if let Ok(record) = read_record(&dir.join(RECORD)) {
            return Found::Paused(Box::new(record));
        }
        let Ok(entries) = fs::read_dir(dir) else {
            return Found::Busy;
        };
        let mut abandoned = true;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let instance = name
                .strip_suffix(".json")
                .or_else(|| name.strip_suffix(".part"))
                .and_then(|n| n.split_once('+'))
                .map(|(_, i)| i);
            if let Some(instance) = instance {
                // The status change, not the modification: a claim is a renamed record, whose
                // mtime is its pause's, however long ago.
                let changed = entry
                    .metadata()
                    .ok()
                    .and_then(|m| {
                        let secs = u64::try_from(m.ctime()).ok()?;
                        let nanos = u32::try_from(m.ctime_nsec()).ok()?;
                        Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos))
                    })
                    .unwrap_or_else(SystemTime::now);
                let mine_before = instance == self.instance && changed + CLOCK_SLACK < self.opened;
                let age = SystemTime::now()
                    .duration_since(changed)
                    .unwrap_or_default();
                if !mine_before && instance_alive(instance, &self.instance, age) {
                    abandoned = false;
                }
            }
        }
        if abandoned {
            Found::Abandoned(dir.to_path_buf())
        } else {
            Found::Busy
        }
    }

    /// Cleans up after daemons that died mid-way: a claim they held is given back (the session
    /// is paused again), a pause they never committed is removed.
    pub fn recover(&self, dir: &Path) {
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("claim+")
                    && name.ends_with(".json")
                    && fs::rename(entry.path(), dir.join(RECORD)).is_ok()
                {
                    tracing::info!(dir = %dir.display(), "an abandoned claim on a paused session given back");
                    return;
                }
            }
        }
        tracing::info!(dir = %dir.display(), "an uncommitted pause removed");
        let _ = fs::remove_dir_all(dir);
    }
}

/// Whether the daemon `instance` (`<host>-<pid>`) may still be working on a file `age` old.
fn instance_alive(instance: &str, me: &str, age: Duration) -> bool {
    if instance == me {
        return true;
    }
    let host = |i: &str| i.rsplit_once('-').map(|(h, _)| h.to_string());
    match (host(instance), host(me)) {
        (Some(h), Some(mine)) if h == mine => {
            let pid = instance
                .rsplit_once('-')
                .and_then(|(_, p)| p.parse::<i32>().ok());
            // A process of this host: alive if it exists (signal 0 delivers nothing).
            pid.is_some_and(|p| {
                p > 0 && nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), None).is_ok()
            })
        }
        _ => age < STALE_AFTER,
    }
}

/// A save in progress: the tar is written through it ([`Write`]), hashed and counted. Dropped
/// uncommitted, it removes its part (and the session's directory if nothing else is in it).
pub struct Saving {
    dir: PathBuf,
    part: PathBuf,
    file: Option<File>,
    hasher: Sha256,
    bytes: u64,
    limit: u64,
    /// The first failure, kept so that `commit` reports it (as Full or Unwritable) rather than
    /// the writer's caller turning it into an opaque I/O error.
    failed: Option<SaveError>,
    committed: bool,
}

impl Write for Saving {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.failed.is_some() {
            return Err(io::Error::other("the save failed"));
        }
        if self.bytes + buf.len() as u64 > self.limit {
            self.failed = Some(SaveError::Full(format!(
                "the saved workspace would exceed its bound of {} bytes (the disk quota and a tar header per entry)",
                self.limit
            )));
            return Err(io::Error::other("the saved workspace outgrew its bound"));
        }
        let file = self.file.as_mut().expect("a save in progress has its file");
        match file.write_all(buf) {
            Ok(()) => {
                self.hasher.update(buf);
                self.bytes += buf.len() as u64;
                Ok(buf.len())
            }
            Err(e) => {
                let kind = e.kind();
                self.failed = Some(SaveError::of("workspace file", e));
                Err(io::Error::new(kind, "writing the saved workspace failed"))
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Saving {
    /// Why the save failed, if it did (a writer's caller may only see an opaque error).
    pub fn failure(&mut self) -> Option<SaveError> {
        self.failed.take()
    }
}

impl Drop for Saving {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.part);
            // The directory goes only when nothing else is in it (an earlier pause's tar and
            // record stay: that pause is still the session's).
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

/// A paused session claimed by this daemon: resumed (`finish`) or given back (dropped).
pub struct Claim {
    dir: PathBuf,
    claimed: PathBuf,
    pub record: PausedRecord,
    done: bool,
}

impl Claim {
    /// The saved workspace, read through a digest check: [`Verified::check`] after the last
    /// byte says whether it is the one the record names.
    pub fn workspace(&self) -> io::Result<Verified> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.dir.join(self.record.workspace.file_name()))?;
        Ok(Verified {
            file,
            hasher: Sha256::new(),
            bytes: 0,
            expected: self.record.workspace.clone(),
        })
    }

    /// The session left the store (resumed, deleted or expired): its directory is removed.
    pub fn finish(mut self) {
        self.done = true;
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "paused session's directory not removed");
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.done {
            // Not resumed: paused again, as it was.
            if let Err(e) = fs::rename(&self.claimed, self.dir.join(RECORD)) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "claim on a paused session not given back");
            }
        }
    }
}

/// A saved workspace being read, hashed as it goes.
pub struct Verified {
    file: File,
    hasher: Sha256,
    bytes: u64,
    expected: SavedWorkspace,
}

impl Read for Verified {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

impl Verified {
    /// The file, to be read from its start (whose digest was checked by another reader).
    pub fn into_file(self) -> File {
        self.file
    }

    /// Reads what is left, then compares: Err names the mismatch.
    pub fn check(mut self) -> Result<(), String> {
        io::copy(&mut self, &mut io::sink()).map_err(|e| e.to_string())?;
        let got = SavedWorkspace {
            sha256: format!("sha256:{}", hex::encode(self.hasher.finalize())),
            bytes: self.bytes,
        };
        if got == self.expected {
            Ok(())
        } else {
            Err(format!(
                "the saved workspace does not match its record: {} ({} bytes) recorded, {} ({} bytes) found",
                self.expected.sha256, self.expected.bytes, got.sha256, got.bytes
            ))
        }
    }
}

fn read_record(path: &Path) -> io::Result<PausedRecord> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let mut buf = Vec::new();
    Read::by_ref(&mut f).take(1 << 20).read_to_end(&mut buf)?;
    let record: PausedRecord =
        serde_json::from_slice(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if record.version != VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "record version {} (this daemon reads {VERSION})",
                record.version
            ),
        ));
    }
    Ok(record)
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn remove_other_tars(dir: &Path, keep: &str) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("workspace-") && name.ends_with(".tar") && name != keep {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> PausedRecord {
        let now = chrono::Utc::now();
        PausedRecord {
            version: VERSION,
            id: id.into(),
            subject: "svc".into(),
            tenant: "t".into(),
            language: "python".into(),
            profile: "python".into(),
            backend: BackendKind::Local,
            limits: SessionLimits::default(),
            token_id: None,
            grant: Grant::default(),
            created_at: now,
            expires_at: now,
            paused_at: now,
            paused_until: now,
            idle_timeout_seconds: 60,
            execs: 0,
            ran: vec![],
            workspace: SavedWorkspace {
                sha256: String::new(),
                bytes: 0,
            },
        }
    }

    fn save(store: &PausedStore, id: &str, data: &[u8]) -> Result<SavedWorkspace, SaveError> {
        let mut s = store.begin(id, 1 << 20)?;
        s.write_all(data).ok();
        store.commit(s, &mut record(id))
    }

    #[test]
    fn a_committed_pause_reads_back_and_its_claim_is_exclusive() {
        let dir = tempfile::tempdir().unwrap();
        let store = PausedStore::open(dir.path(), "host-1").unwrap();
        let other = PausedStore::open(dir.path(), "host-2").unwrap();
        let saved = save(&store, "ses_a", b"first").unwrap();
        let saved2 = save(&store, "ses_a", b"second").unwrap();
        assert_ne!(saved, saved2);
        // Only the newest tar is left beside the record.
        let names: Vec<_> = fs::read_dir(dir.path().join("ses_a"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert_eq!(store.read("ses_a").unwrap().workspace, saved2);

        let claim = store.claim("ses_a").expect("claimed");
        assert!(other.claim("ses_a").is_none(), "a second claim loses");
        assert!(
            store.read("ses_a").is_none(),
            "a claimed session reads as not paused"
        );
        let mut w = claim.workspace().unwrap();
        let mut buf = Vec::new();
        w.read_to_end(&mut buf).unwrap();
        assert_eq!(buf, b"second");
        w.check().unwrap();
        drop(claim);
        assert!(
            store.read("ses_a").is_some(),
            "a dropped claim pauses it again"
        );
        store.claim("ses_a").unwrap().finish();
        assert!(!dir.path().join("ses_a").exists());
    }

    #[test]
    fn a_changed_tar_fails_its_digest_check() {
        let dir = tempfile::tempdir().unwrap();
        let store = PausedStore::open(dir.path(), "h-1").unwrap();
        let saved = save(&store, "ses_b", b"abc").unwrap();
        let tar = dir.path().join("ses_b").join(saved.file_name());
        fs::write(&tar, b"abd").unwrap();
        let claim = store.claim("ses_b").unwrap();
        let err = claim.workspace().unwrap().check().unwrap_err();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn a_save_past_its_bound_is_full_and_leaves_the_earlier_pause() {
        let dir = tempfile::tempdir().unwrap();
        let store = PausedStore::open(dir.path(), "h-1").unwrap();
        let first = save(&store, "ses_c", b"old").unwrap();
        let mut s = store.begin("ses_c", 4).unwrap();
        assert!(s.write_all(b"too long").is_err());
        let err = store.commit(s, &mut record("ses_c")).unwrap_err();
        assert!(matches!(err, SaveError::Full(_)), "{err}");
        assert_eq!(store.read("ses_c").unwrap().workspace, first);
        // An uncommitted first pause leaves nothing.
        let s = store.begin("ses_d", 4).unwrap();
        drop(s);
        assert!(!dir.path().join("ses_d").exists());
    }

    /// Sets `path`'s modification time `ago` in the past.
    fn age(path: &Path, ago: Duration) {
        let t = SystemTime::now() - ago;
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(t).unwrap();
    }

    #[test]
    fn another_hosts_live_claim_on_a_long_paused_session_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let a = PausedStore::open(dir.path(), "hosta-1").unwrap();
        let b = PausedStore::open(dir.path(), "hostb-1").unwrap();
        save(&a, "ses_h", b"x").unwrap();
        // Paused two hours ago: the record was written then.
        age(
            &dir.path().join("ses_h").join(RECORD),
            Duration::from_secs(7200),
        );
        // Host b claims it now to resume it; host a's scan runs meanwhile.
        let claim = b.claim("ses_h").expect("claimed");
        let found = a.scan();
        assert!(
            matches!(found[0].1, Found::Busy),
            "a claim taken just now is someone's work in progress: {found:?}"
        );
        drop(claim);
    }

    #[test]
    fn a_claim_left_by_an_earlier_process_of_the_same_name_is_recovered() {
        let dir = tempfile::tempdir().unwrap();
        // A daemon in a container is pid 1 on every start: its instance name does not change.
        let before = PausedStore::open(dir.path(), "box-1").unwrap();
        save(&before, "ses_i", b"x").unwrap();
        std::mem::forget(before.claim("ses_i").unwrap());
        let part = before.begin("ses_j", 10).unwrap();
        std::mem::forget(part);
        std::thread::sleep(CLOCK_SLACK * 4);
        // It died; the next one starts under the same name.
        let after = PausedStore::open(dir.path(), "box-1").unwrap();
        let mut found = after.scan();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        assert!(matches!(found[0].1, Found::Abandoned(_)), "{found:?}");
        assert!(matches!(found[1].1, Found::Abandoned(_)), "{found:?}");
    }

    #[test]
    fn leftovers_of_dead_daemons_are_recovered() {
        let dir = tempfile::tempdir().unwrap();
        let host = "thishost";
        let store =
            PausedStore::open(dir.path(), &format!("{host}-{}", std::process::id())).unwrap();
        // A claim by a dead process of this host, and a pause it never committed.
        let dead = format!("{host}-{}", i32::MAX);
        let gone = PausedStore::open(dir.path(), &dead).unwrap();
        save(&gone, "ses_e", b"x").unwrap();
        let claim = gone.claim("ses_e").unwrap();
        std::mem::forget(claim);
        let s = gone.begin("ses_f", 10).unwrap();
        std::mem::forget(s);
        // Another host's fresh part is left alone.
        let far = PausedStore::open(dir.path(), "farhost-7").unwrap();
        let s = far.begin("ses_g", 10).unwrap();
        std::mem::forget(s);

        let mut found = store.scan();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        assert!(matches!(found[0].1, Found::Abandoned(_)), "{found:?}");
        assert!(matches!(found[1].1, Found::Abandoned(_)), "{found:?}");
        assert!(matches!(found[2].1, Found::Busy), "{found:?}");
        for (_, f) in found {
            if let Found::Abandoned(d) = f {
                store.recover(&d);
            }
        }
        assert!(store.read("ses_e").is_some(), "the claim was given back");
        assert!(
            !dir.path().join("ses_f").exists(),
            "the uncommitted pause is gone"
        );
        assert!(dir.path().join("ses_g").exists());
    }
}
