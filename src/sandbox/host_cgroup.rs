//! What the host's cgroupfs says of a container's cgroup, found from one of its host processes:
//! what it uses now, whether its pids are all held, and its memory peak over one run of a
//! container that serves several.
//!
//! Owns: reading (and, for the peak, resetting) a container's cgroup files from the host. Must
//! not: create, move or remove cgroups (the engine owns a container's).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{Usage, stat_value};

/// What the cgroup of host process `pid` uses now (cgroup v2, or v1's memory and cpuacct
/// hierarchies), when its cgroup paths name `container` (a pid the container no longer has
/// names another's, or none). Blocking.
pub fn usage_of_pid(pid: u32, container: &str) -> Option<Usage> {
    let text = cgroups_of_pid(pid, container)?;
    let root = Path::new("/sys/fs/cgroup");
    let read = |p: PathBuf| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let (mut memory, mut cache, mut cpu) = (None, None, None);
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let ctl: Vec<&str> = controllers.split(',').collect();
        if ctl.contains(&"memory") {
            let dir = root.join("memory").join(path);
            memory = read(dir.join("memory.usage_in_bytes"));
            cache = stat_value(&dir.join("memory.stat"), "total_cache");
        }
        if ctl.contains(&"cpuacct") {
            cpu = read(root.join(controllers).join(path).join("cpuacct.usage"));
        }
        if controllers.is_empty() && memory.is_none() {
            // cgroup v2 (alone, or the unified hierarchy of a v2-only host).
            let dir = root.join(path);
            memory = read(dir.join("memory.current"));
            cache = stat_value(&dir.join("memory.stat"), "file");
            cpu = stat_value(&dir.join("cpu.stat"), "usage_usec").map(|us| us * 1000);
        }
    }
    Some(Usage {
        memory_bytes: memory?,
        cache_bytes: cache.unwrap_or(0),
        cpu_ns: cpu.unwrap_or(0),
    })
}

/// `/proc/<pid>/cgroup` of host process `pid`, when its paths name `container` and are this
/// daemon's to read (a path of another cgroup namespace, `/../…`, is not). Blocking.
fn cgroups_of_pid(pid: u32, container: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    (text.contains(container) && !text.contains("/..")).then_some(text)
}

/// The directory of `controller`'s cgroup of host process `pid`: its cgroup v1 hierarchy's when
/// one is mounted for it, else its cgroup v2 one. None when `pid`'s cgroup paths do not name
/// `container`. Blocking.
fn cgroup_dir_of_pid(pid: u32, container: &str, controller: &str) -> Option<PathBuf> {
    let text = cgroups_of_pid(pid, container)?;
    let root = Path::new("/sys/fs/cgroup");
    let mut dir = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == controller) {
            dir = Some(root.join(controllers).join(path));
        } else if controllers.is_empty() && dir.is_none() {
            dir = Some(root.join(path));
        }
    }
    dir
}

/// Whether the pids cgroup of host process `pid` (v1's pids hierarchy or v2) is at its limit:
/// every pid it may hold is held. None when that cannot be read, or the pid names no longer
/// `container`'s cgroup. Blocking.
pub fn pids_held_of_pid(pid: u32, container: &str) -> Option<bool> {
    let dir = cgroup_dir_of_pid(pid, container, "pids")?;
    let max = std::fs::read_to_string(dir.join("pids.max")).ok()?;
    let Ok(max) = max.trim().parse::<u64>() else {
        return Some(false);
    };
    let current: u64 = std::fs::read_to_string(dir.join("pids.current"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(current >= max)
}

/// The memory peak of a container's cgroup from now on: the peak is reset when this is made
/// (cgroup v1: `memory.max_usage_in_bytes`; v2: `memory.peak`, whose reset holds for the file
/// descriptor that wrote it, Linux 6.12 and later), so a container serving one run after
/// another reports each run's own peak. The kernel keeps no per-run peak, hence the reset.
pub struct MemoryPeak {
    file: std::fs::File,
}

impl MemoryPeak {
    /// The peak of the memory cgroup of host process `pid`, when it names `container`'s cgroup;
    /// with `reset`, reset first, when the daemon may (None otherwise: a v2 kernel before 6.12,
    /// a read-only cgroupfs). Without, the cgroup's peak over its whole life. Blocking.
    pub fn start(pid: u32, container: &str, reset: bool) -> Option<MemoryPeak> {
        let dir = cgroup_dir_of_pid(pid, container, "memory")?;
        let (name, reset_with): (&str, &[u8]) = if dir.starts_with("/sys/fs/cgroup/memory") {
            ("memory.max_usage_in_bytes", b"0")
        } else {
            ("memory.peak", b"reset\n")
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(reset)
            .open(dir.join(name))
            .ok()?;
        if reset {
            file.write_all(reset_with).ok()?;
        }
        Some(MemoryPeak { file })
    }

    /// The peak since [`Self::start`], in KiB. Blocking.
    pub fn kib(mut self) -> Option<u64> {
        self.file.seek(SeekFrom::Start(0)).ok()?;
        let mut text = String::new();
        self.file.read_to_string(&mut text).ok()?;
        text.trim().parse::<u64>().ok().map(|b| b / 1024)
    }
}
