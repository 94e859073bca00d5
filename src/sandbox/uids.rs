//! Host uids of sandboxes: each live run or session gets one of its own from a configured block.
//!
//! The kernel keeps several limits per user, not per sandbox: inotify instances and watches and
//! user namespaces per (user namespace, uid), pipe buffer pages per uid. Sandboxes that share a
//! uid share those counters, so one tenant's run could exhaust them for another's. A uid of its
//! own for each live sandbox bounds each to its own counters.
//!
//! A uid is taken by an exclusive `flock` on `<lock_dir>/<uid>`: the lock is the lease, held
//! while the [`UidLease`] lives and dropped with it (also when the daemon dies), so several
//! daemons on one host sharing the lock directory never hand out the same uid. The lock files
//! stay (empty, one per uid used): removing one while another daemon opens it would let two
//! locks on two files claim one uid.
//!
//! Owns: picking and holding uids. Must not: know what runs under them.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::SandboxError;

/// A block of host uids and the directory of their locks.
#[derive(Debug)]
pub struct UidRange {
    first: u32,
    count: u32,
    lock_dir: PathBuf,
    /// Where the next search starts: a uid just released is the last one tried again.
    next: AtomicU32,
    /// Unit tests: the temporary lock directory, removed with the range.
    #[cfg(test)]
    _dir: Option<tempfile::TempDir>,
}

/// One uid, held until dropped.
#[derive(Debug)]
pub struct UidLease {
    uid: u32,
    _lock: Flock<File>,
}

impl UidLease {
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl UidRange {
    /// `count` uids from `first`; refuses a block that reaches uid 0 or past the last uid.
    pub fn new(first: u32, count: u32, lock_dir: &Path) -> Result<UidRange, String> {
        if first == 0 || count == 0 || first.checked_add(count - 1).is_none_or(|l| l == u32::MAX) {
            return Err(format!(
                "uid block {first}+{count}: it must be non-empty, exclude uid 0 and end below {}",
                u32::MAX
            ));
        }
        Ok(UidRange {
            first,
            count,
            lock_dir: lock_dir.to_path_buf(),
            next: AtomicU32::new(0),
            #[cfg(test)]
            _dir: None,
        })
    }

    /// Unit tests: `count` uids from 300000 with a lock directory of their own.
    #[cfg(test)]
    pub(crate) fn for_tests(count: u32) -> std::sync::Arc<UidRange> {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = UidRange::new(300_000, count, &dir.path().join("uids")).expect("range");
        r._dir = Some(dir);
        std::sync::Arc::new(r)
    }

    pub fn first(&self) -> u32 {
        self.first
    }

    /// Refuses a block that holds a uid the host already uses: an account's in `passwd` (the
    /// text of /etc/passwd) or a subordinate range in `subuid` (/etc/subuid, `name:first:count`,
    /// what rootless containers and user namespaces of the host map). A sandbox sharing such a
    /// uid would share its processes' signals, files and kernel counters.
    pub fn check_host(&self, passwd: &str, subuid: &str) -> Result<(), String> {
        let (first, last) = (
            u64::from(self.first),
            u64::from(self.first) + u64::from(self.count) - 1,
        );
        let mut clashes = Vec::new();
        for line in passwd.lines() {
            let mut f = line.split(':');
            if let (Some(name), Some(uid)) = (f.next(), f.nth(1))
                && let Ok(uid) = uid.parse::<u64>()
                && (first..=last).contains(&uid)
            {
                clashes.push(format!("user {name} (uid {uid}, /etc/passwd)"));
            }
        }
        for line in subuid.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let mut f = line.trim().split(':');
            if let (Some(name), Some(start), Some(count)) = (f.next(), f.next(), f.next())
                && let (Ok(start), Ok(count)) = (start.parse::<u64>(), count.parse::<u64>())
                && count > 0
                && start <= last
                && start + count > first
            {
                clashes.push(format!(
                    "subordinate uids {start}..={} of {name} (/etc/subuid)",
                    start + count - 1
                ));
            }
        }
        if clashes.is_empty() {
            return Ok(());
        }
        Err(format!(
            "the sandbox uid block {first}..={last} (sandbox.local.uid_first, uid_count) holds uids the host uses: {}; move the block",
            clashes.join(", ")
        ))
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    /// A uid no other live sandbox of any daemon sharing the lock directory holds. Blocking
    /// (file system calls): call from a blocking context.
    pub fn lease(&self) -> Result<UidLease, SandboxError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.lock_dir)
            .map_err(|e| {
                SandboxError::Unavailable(format!(
                    "uid lock directory {}: {e}",
                    self.lock_dir.display()
                ))
            })?;
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..self.count {
            let uid = self.first + (start.wrapping_add(i) % self.count);
            let path = self.lock_dir.join(uid.to_string());
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .map_err(|e| {
                    SandboxError::Unavailable(format!("uid lock {}: {e}", path.display()))
                })?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => {
                    self.next.store(uid - self.first + 1, Ordering::Relaxed);
                    return Ok(UidLease { uid, _lock: lock });
                }
                Err((_, Errno::EWOULDBLOCK)) => continue,
                Err((_, e)) => {
                    return Err(SandboxError::Unavailable(format!(
                        "uid lock {}: {e}",
                        path.display()
                    )));
                }
            }
        }
        Err(SandboxError::Unavailable(format!(
            "every uid of {}..={} is held by a live sandbox (sandbox.local.uid_count)",
            self.first,
            self.first + (self.count - 1)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_distinct_until_dropped_and_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let r = UidRange::new(300_000, 3, dir.path()).unwrap();
        let a = r.lease().unwrap();
        let b = r.lease().unwrap();
        let c = r.lease().unwrap();
        let mut got = [a.uid(), b.uid(), c.uid()];
        got.sort();
        assert_eq!(got, [300_000, 300_001, 300_002]);
        assert!(matches!(r.lease(), Err(SandboxError::Unavailable(_))));
        let freed = b.uid();
        drop(b);
        assert_eq!(r.lease().unwrap().uid(), freed);
    }

    #[test]
    fn two_ranges_on_one_lock_directory_never_share_a_uid() {
        // Two daemons on one host: each has its own UidRange, the lock directory is the host's.
        let dir = tempfile::tempdir().unwrap();
        let one = UidRange::new(300_000, 4, dir.path()).unwrap();
        let two = UidRange::new(300_000, 4, dir.path()).unwrap();
        let held: Vec<UidLease> = (0..4)
            .map(|i| if i % 2 == 0 { &one } else { &two }.lease().unwrap())
            .collect();
        let mut uids: Vec<u32> = held.iter().map(UidLease::uid).collect();
        uids.sort();
        uids.dedup();
        assert_eq!(uids.len(), 4, "{uids:?}");
        assert!(two.lease().is_err());
    }

    #[test]
    fn a_block_holding_a_hosts_user_or_subordinate_range_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = UidRange::new(200_000, 65_536, dir.path()).unwrap();
        let passwd = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/:/usr/sbin/nologin\n";
        assert_eq!(r.check_host(passwd, ""), Ok(()));
        // A second rootless user's default range (165536 + 65536) reaches into the block.
        let subuid = "# comment\nalice:100000:65536\nbob:165536:65536\n";
        let err = r.check_host(passwd, subuid).unwrap_err();
        assert!(err.contains("bob") && !err.contains("alice"), "{err}");
        // Ranges that touch the block's ends without entering it.
        assert_eq!(
            r.check_host(passwd, "a:100000:100000\nb:265536:10\n"),
            Ok(())
        );
        assert!(r.check_host(passwd, "a:100000:100001\n").is_err());
        assert!(r.check_host(passwd, "b:265535:1\n").is_err());
        let err = r
            .check_host("svc:x:231000:231000::/:/bin/false\n", "")
            .unwrap_err();
        assert!(err.contains("user svc (uid 231000"), "{err}");
    }

    #[test]
    fn a_block_reaching_uid_0_or_the_top_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(UidRange::new(0, 10, dir.path()).is_err());
        assert!(UidRange::new(10, 0, dir.path()).is_err());
        assert!(UidRange::new(u32::MAX - 1, 2, dir.path()).is_err());
        assert!(UidRange::new(200_000, 65_536, dir.path()).is_ok());
    }
}
