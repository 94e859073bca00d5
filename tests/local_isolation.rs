//! Attacks on the local backend that must fail, run against the real daemon (root, real cgroups,
//! Landlock, seccomp, namespaces). Each attack is asserted inside the sandbox (the syscall fails,
//! and how) and from the host (the file is unchanged, the listener saw nothing, no process or
//! cgroup of the run is left, the daemon still answers).
//!
//! `python3 -c` is the attack vehicle: every script starts with a unique marker comment, so its
//! argv, and that of every process it forks, can be found (or not) on the host afterwards.

mod common;

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::wait::{CLEANUP, wait_for};
use common::{
    Daemon, Opts, Resp, SECRET, bin, owner_dirs, pids_with_cmdline, profiles_with, shipped_profile,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Shared by every script: `t(name, f)` records whether `f` raised and with which errno;
/// `done()` prints the record as one `RESULT {json}` line.
const PRELUDE: &str = r#"
import ctypes, errno, json, os, signal, socket, sys, time
R = {}
def t(name, f):
    try:
        v = f()
        R[name] = {"ok": True, "value": repr(v)[:300]}
    except OSError as e:
        R[name] = {"ok": False, "errno": e.errno, "value": str(e)[:300]}
    except Exception as e:
        R[name] = {"ok": False, "errno": None, "value": repr(e)[:300]}
libc = ctypes.CDLL(None, use_errno=True)
def call(fn, *a):
    ctypes.set_errno(0)
    r = fn(*a)
    if r == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r
def sc(nr, *a):
    return call(libc.syscall, ctypes.c_long(nr), *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
def done():
    print("RESULT " + json.dumps(R), flush=True)
"#;

fn marker() -> String {
    format!("li-{}", uuid::Uuid::new_v4().simple())
}

/// The script as sent: marker comment, prelude, body.
fn script(marker: &str, body: &str) -> String {
    format!("# {marker}\n{PRELUDE}\n{body}\n")
}

async fn py(d: &Daemon, marker: &str, body: &str, timeout: u64) -> Resp {
    d.exec(json!({"action_type": "python", "command": "python3", "args": ["-c", script(marker, body)], "timeout_seconds": timeout}))
        .await
}

fn stdout(r: &Resp) -> &str {
    r.json["stdout"].as_str().unwrap_or_default()
}

/// The `RESULT` record of a script that ran to `done()`.
fn results(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.text);
    let line = stdout(r)
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line: {}", r.text));
    serde_json::from_str(line).expect("RESULT is JSON")
}

/// Asserts the attempt `name` failed inside the sandbox; returns its errno (-1 when none).
fn refused(res: &Value, name: &str) -> i64 {
    let e = &res[name];
    assert!(e.is_object(), "no result for {name}: {res}");
    assert_eq!(
        e["ok"],
        json!(false),
        "{name} succeeded inside the sandbox: {e}"
    );
    e["errno"].as_i64().unwrap_or(-1)
}

fn refused_with(res: &Value, name: &str, errnos: &[i32]) {
    let got = refused(res, name);
    assert!(
        errnos.iter().any(|e| i64::from(*e) == got),
        "{name}: errno {got}, expected one of {errnos:?}: {}",
        res[name]
    );
}

fn allowed(res: &Value, name: &str) {
    assert_eq!(
        res[name]["ok"],
        json!(true),
        "{name} should work inside the sandbox: {}",
        res[name]
    );
}

fn sha256_file(p: &Path) -> String {
    hex::encode(Sha256::digest(
        std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display())),
    ))
}

/// After a request: nothing of the run is left. No run cgroup of this daemon (requests within a
/// test are sequential, so "none at all" is exact; a slot taken by a run is renamed to its exec_id,
/// and idle prepared slots never exceed the configured two), none named after the exec_id, no
/// process with the run's marker in its argv.
fn assert_run_left_nothing(d: &Daemon, r: &Resp, marker: &str) {
    // A run's cgroup is removed just after its answer, off the request path, by a low-priority
    // thread: on a loaded machine that can take a while.
    wait_for(
        &format!("the run cgroups of daemon {} removed", d.pid()),
        CLEANUP,
        || {
            owner_dirs(d.pid())
                .iter()
                .flat_map(|dir| std::fs::read_dir(dir).into_iter().flatten())
                .filter_map(Result::ok)
                .filter(|e| e.path().is_dir())
                .map(|e| e.path())
                .filter(|p| {
                    !p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("warm-"))
                })
                .collect::<Vec<_>>()
        },
        Vec::is_empty,
    );
    for dir in owner_dirs(d.pid()) {
        let (warm, left): (Vec<_>, Vec<_>) = std::fs::read_dir(&dir)
            .expect("owner dir")
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .partition(|n| n.starts_with("warm-"));
        assert!(
            left.is_empty(),
            "run cgroups left in {}: {left:?}",
            dir.display()
        );
        assert!(
            warm.len() <= 2,
            "more prepared slots than configured in {}: {warm:?}",
            dir.display()
        );
        if let Some(id) = r.json["exec_id"].as_str().filter(|s| !s.is_empty()) {
            assert!(
                !dir.join(id).exists(),
                "cgroup {} left",
                dir.join(id).display()
            );
        }
    }
    assert!(d.run_cgroups().is_empty(), "{:?}", d.run_cgroups());
    let left = pids_with_cmdline(marker);
    assert!(
        left.is_empty(),
        "processes of run {marker} left on the host: {left:?}"
    );
}

async fn assert_healthy(d: &Daemon) {
    let h = d.get("/health").await;
    assert_eq!(h.status, 200, "{}", h.text);
    assert_eq!(h.json["status"], json!("healthy"), "{}", h.text);
    // SAFETY: kill(2) with signal 0 only checks that our own child exists.
    let alive = unsafe { libc::kill(d.pid(), 0) };
    assert_eq!(alive, 0, "daemon process is gone");
}

fn vm_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

// -------------------------------------------------------------------------------------------------
// Secrets and the daemon's own files

#[tokio::test(flavor = "multi_thread")]
async fn jwt_secret_audit_log_and_daemon_environ_are_unreadable() {
    let d = Daemon::start();
    // One run first, so the audit log exists and holds a line the attack could leak.
    let warm = marker();
    let r0 = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": [&warm]}))
        .await;
    assert_eq!(r0.status, 200, "{}", r0.text);
    assert_run_left_nothing(&d, &r0, &warm);
    let first_exec = r0.json["exec_id"].as_str().expect("exec_id").to_string();
    assert!(
        std::fs::read_to_string(&d.audit)
            .expect("audit log")
            .contains(&first_exec)
    );
    let secret_before = sha256_file(&d.secret);

    let m = marker();
    let body = r#"
S, A, D = @SECRET@, @AUDIT@, @DPID@
t("read secret", lambda: open(S).read())
t("read audit", lambda: open(A).read())
t("list secret dir", lambda: os.listdir(os.path.dirname(S)))
t("daemon environ", lambda: open(f"/proc/{D}/environ", "rb").read())
t("daemon mem", lambda: open(f"/proc/{D}/mem", "rb").read(1))
# pid 1 of the sandbox is a fork of the daemon: its memory holds what the daemon's held.
t("init environ", lambda: open("/proc/1/environ", "rb").read())
t("init mem", lambda: open("/proc/1/mem", "rb").read(1))
t("init maps", lambda: open("/proc/1/maps").read())
t("init root secret", lambda: open("/proc/1/root" + S).read())
t("init cwd", lambda: os.listdir("/proc/1/cwd"))
t("init fds", lambda: os.listdir("/proc/1/fd"))
t("init fd 3", lambda: os.readlink("/proc/1/fd/3"))
t("process_vm_readv init", lambda: sc(310, 1, 0, 0, 0, 0, 0))
t("own environ", lambda: open("/proc/self/environ", "rb").read())
done()
"#
    .replace("@SECRET@", &format!("{:?}", d.secret.display().to_string()))
    .replace("@AUDIT@", &format!("{:?}", d.audit.display().to_string()))
    .replace("@DPID@", &d.pid().to_string());
    let r = py(&d, &m, &body, 20).await;
    let res = results(&r);
    refused_with(&res, "read secret", &[libc::ENOENT]);
    refused_with(&res, "read audit", &[libc::ENOENT]);
    refused_with(&res, "list secret dir", &[libc::ENOENT]);
    refused_with(&res, "daemon environ", &[libc::ENOENT]);
    refused_with(&res, "daemon mem", &[libc::ENOENT]);
    // pid 1 (root) is not even visible to the command (its /proc is hidepid=2).
    for name in [
        "init environ",
        "init mem",
        "init maps",
        "init root secret",
        "init cwd",
        "init fds",
        "init fd 3",
    ] {
        refused_with(&res, name, &[libc::ENOENT]);
    }
    refused_with(&res, "process_vm_readv init", &[libc::EPERM]);
    // The command's own environment is the profile's, nothing of the daemon's.
    allowed(&res, "own environ");
    let env = res["own environ"]["value"].as_str().unwrap_or_default();
    assert!(
        !env.contains("EXECUTOR_ARM") && !env.contains("RUST_LOG"),
        "{env}"
    );

    // From the host: nothing of the secret, the audit log or the daemon's environment came out,
    // and the secret file is as it was.
    let out = &r.text;
    assert!(!out.contains(SECRET), "secret leaked: {out}");
    assert!(
        !out.contains(&first_exec) && !out.contains("prev_hash"),
        "audit log leaked: {out}"
    );
    assert!(
        !out.contains("EXECUTOR_ARM_JWT_SECRET_FILE"),
        "daemon environment leaked: {out}"
    );
    assert_eq!(sha256_file(&d.secret), secret_before);
    assert_run_left_nothing(&d, &r, &m);
    assert_healthy(&d).await;
}

// -------------------------------------------------------------------------------------------------
// Writes outside the workdir

#[tokio::test(flavor = "multi_thread")]
async fn writes_outside_the_workdir_never_reach_the_host() {
    let d = Daemon::start();
    let m = marker();
    // A host file next to the daemon's secret, and a host /tmp path that must not appear.
    let canary = d.dir.path().join("canary.txt");
    std::fs::write(&canary, "canary: original content\n").expect("canary");
    std::fs::set_permissions(&canary, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let canary_before = sha256_file(&canary);
    let planted = std::env::temp_dir().join(format!("{m}-planted"));
    let daemon_bin = PathBuf::from(bin()).canonicalize().expect("daemon binary");
    let bin_before = sha256_file(&daemon_bin);
    let passwd_before = sha256_file(Path::new("/etc/passwd"));
    let etc_new = PathBuf::from(format!("/etc/{m}"));
    let usr_new = PathBuf::from(format!("/usr/bin/{m}"));

    let body = r#"
CANARY, PLANTED, BIN, NAME = @CANARY@, @PLANTED@, @BIN@, @NAME@
t("create in /etc", lambda: open("/etc/" + NAME, "w").write("x"))
t("create in /usr/bin", lambda: open("/usr/bin/" + NAME, "w").write("x"))
t("create in /", lambda: open("/" + NAME, "w").write("x"))
t("append /etc/passwd", lambda: open("/etc/passwd", "a").write("x"))
t("truncate /etc/passwd", lambda: os.truncate("/etc/passwd", 0))
t("rename over /etc/passwd", lambda: os.rename("/etc/group", "/etc/passwd"))
t("unlink /etc/passwd", lambda: os.unlink("/etc/passwd"))
t("chmod /usr/bin/python3", lambda: os.chmod("/usr/bin/python3", 0o777))
t("open canary for write", lambda: open(CANARY, "r+").write("pwned"))
t("truncate canary", lambda: os.truncate(CANARY, 0))
t("open daemon binary for write", lambda: open(BIN, "r+b").write(b"pwned"))
# Inside the sandbox /tmp and the workdir are private tmpfs: recreating the host paths there
# may work, but must stay there.
t("write host /tmp path", lambda: open(PLANTED, "w").write("pwned"))
def rebuild(p):
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w") as f:
        f.write("pwned")
t("recreate canary path", lambda: rebuild(CANARY))
t("recreate daemon binary path", lambda: rebuild(BIN))
done()
"#
    .replace("@CANARY@", &format!("{:?}", canary.display().to_string()))
    .replace("@PLANTED@", &format!("{:?}", planted.display().to_string()))
    .replace("@BIN@", &format!("{:?}", daemon_bin.display().to_string()))
    .replace("@NAME@", &format!("{m:?}"));
    let r = py(&d, &m, &body, 20).await;
    let res = results(&r);
    let no_write = [libc::EROFS, libc::EACCES, libc::EPERM];
    refused_with(&res, "create in /etc", &no_write);
    refused_with(&res, "create in /usr/bin", &no_write);
    refused_with(&res, "create in /", &no_write);
    refused_with(&res, "append /etc/passwd", &no_write);
    refused_with(&res, "truncate /etc/passwd", &no_write);
    refused_with(
        &res,
        "rename over /etc/passwd",
        &[
            libc::EROFS,
            libc::EACCES,
            libc::EPERM,
            libc::EBUSY,
            libc::EXDEV,
        ],
    );
    refused_with(
        &res,
        "unlink /etc/passwd",
        &[libc::EROFS, libc::EACCES, libc::EPERM, libc::EBUSY],
    );
    refused_with(&res, "chmod /usr/bin/python3", &no_write);
    refused_with(&res, "open canary for write", &[libc::ENOENT]);
    refused_with(&res, "truncate canary", &[libc::ENOENT]);
    refused_with(&res, "open daemon binary for write", &[libc::ENOENT]);

    // From the host: nothing appeared, nothing changed.
    assert!(
        !planted.exists(),
        "{} appeared on the host",
        planted.display()
    );
    assert!(!etc_new.exists() && !usr_new.exists() && !Path::new("/").join(&m).exists());
    assert_eq!(sha256_file(&canary), canary_before, "canary changed");
    assert_eq!(
        sha256_file(&daemon_bin),
        bin_before,
        "daemon binary changed"
    );
    assert_eq!(
        sha256_file(Path::new("/etc/passwd")),
        passwd_before,
        "/etc/passwd changed"
    );
    assert_run_left_nothing(&d, &r, &m);
    assert_healthy(&d).await;
}

/// A daemon whose python3 runs under the python profile plus `dir` as a read-only path.
fn daemon_exposing(dir: &Path) -> (Daemon, tempfile::TempDir) {
    let mut profile: toml::Table = shipped_profile("python").parse().expect("python profile");
    profile["filesystem"]["read_only"]
        .as_array_mut()
        .expect("read_only")
        .push(dir.display().to_string().into());
    let profiles = profiles_with(&[("canary", profile.to_string())]);
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_PROFILES_DIR".into(), profiles.path().display().to_string())],
        config: Some("[commands.python3]\naction_types = [\"python\"]\ncapabilities = [\"PythonExecute\"]\nprofile = \"canary\"\n".into()),
        ..Default::default()
    });
    (d, profiles)
}

/// A world-writable canary (0666, owned by 65534) in a world-writable directory: only the
/// read-only bind and Landlock stand between a run and the file.
fn world_writable_canary(dir: &Path) -> PathBuf {
    let canary = dir.join("canary.txt");
    std::fs::write(&canary, "canary: original content\n").expect("canary");
    for (p, mode) in [(&canary, 0o666), (&dir.to_path_buf(), 0o777)] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).expect("chown");
    }
    canary
}

fn snapshot(p: &Path) -> (String, u64, u32, u32, i64, i64, u64) {
    let md = std::fs::symlink_metadata(p).expect("stat");
    let hash = if md.is_file() {
        sha256_file(p)
    } else {
        String::new()
    };
    (
        hash,
        md.len(),
        md.mode(),
        md.uid(),
        md.mtime(),
        md.mtime_nsec(),
        md.ino(),
    )
}

/// A host directory bound read-only into the sandbox whose file and directory are writable by
/// the sandbox user (0666 / 0777, owned by 65534): only the read-only bind and Landlock stand
/// between the run and the host file.
#[tokio::test(flavor = "multi_thread")]
async fn a_visible_world_writable_host_file_cannot_be_truncated_or_replaced() {
    let exposed = tempfile::Builder::new()
        .prefix("executor-arm-li-")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp");
    let canary = world_writable_canary(exposed.path());
    let (canary_meta, dir_meta) = (snapshot(&canary), snapshot(exposed.path()));

    let (d, _profiles) = daemon_exposing(exposed.path());

    let m = marker();
    let body = r#"
DIR = @DIR@
C = DIR + "/canary.txt"
t("read", lambda: open(C).read())
t("stat uid", lambda: os.stat(C).st_uid)
t("open w (truncate)", lambda: open(C, "w"))
t("open r+", lambda: open(C, "r+").write("pwned"))
t("append", lambda: open(C, "a").write("pwned"))
t("truncate", lambda: os.truncate(C, 0))
t("open O_WRONLY|O_TRUNC", lambda: os.open(C, os.O_WRONLY | os.O_TRUNC))
t("unlink", lambda: os.unlink(C))
t("rename away", lambda: os.rename(C, DIR + "/moved"))
t("rename in from workdir", lambda: (open("/work/evil", "w").write("pwned"), os.rename("/work/evil", C)))
t("chmod", lambda: os.chmod(C, 0o777))
t("utime", lambda: os.utime(C, (0, 0)))
t("symlink in dir", lambda: os.symlink("/etc/passwd", DIR + "/link"))
t("hardlink in dir", lambda: os.link(C, DIR + "/hard"))
t("mkdir in dir", lambda: os.mkdir(DIR + "/sub"))
t("create in dir", lambda: open(DIR + "/new", "w"))
done()
"#
    .replace("@DIR@", &format!("{:?}", exposed.path().display().to_string()));
    let r = py(&d, &m, &body, 20).await;
    let res = results(&r);
    // The file is really there, and really the sandbox user's: the refusals below are the
    // read-only bind and Landlock, not a missing path or plain permissions.
    allowed(&res, "read");
    assert!(
        res["read"]["value"]
            .as_str()
            .unwrap_or_default()
            .contains("original content"),
        "{res}"
    );
    assert_eq!(res["stat uid"]["value"], json!("65534"), "{res}");
    let no_write = [libc::EROFS, libc::EACCES, libc::EPERM, libc::EXDEV];
    for name in [
        "open w (truncate)",
        "open r+",
        "append",
        "truncate",
        "open O_WRONLY|O_TRUNC",
        "unlink",
        "rename away",
        "rename in from workdir",
        "chmod",
        "utime",
        "symlink in dir",
        "hardlink in dir",
        "mkdir in dir",
        "create in dir",
    ] {
        refused_with(&res, name, &no_write);
    }

    assert_eq!(snapshot(&canary), canary_meta, "canary changed");
    assert_eq!(
        snapshot(exposed.path()),
        dir_meta,
        "exposed directory changed"
    );
    let names: Vec<_> = std::fs::read_dir(exposed.path())
        .expect("readdir")
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("canary.txt")]);
    assert_run_left_nothing(&d, &r, &m);
}

/// Unmounts (lazily) a host mount the test made, however the test ends.
struct HostMount(PathBuf);

impl Drop for HostMount {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: umount2(2) on a NUL-terminated path we mounted ourselves.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// A read-only path of the profile with a writable mount below it on the host (a volume under
/// /usr, a bind under /etc ...): every mount of the subtree must be read-only, nosuid and nodev
/// inside the sandbox, not only the top one; Landlock is the second layer, not the only one.
#[tokio::test(flavor = "multi_thread")]
async fn submounts_of_read_only_paths_are_read_only_too() {
    let exposed = tempfile::Builder::new()
        .prefix("executor-arm-li-")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp");
    let sub = exposed.path().join("volume");
    std::fs::create_dir(&sub).expect("mkdir");
    let src = std::ffi::CString::new(sub.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: mount(2) of a fresh tmpfs on a directory this test created, with C strings.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            src.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            c"size=1m,mode=0777".as_ptr().cast(),
        )
    };
    assert_eq!(rc, 0, "mount tmpfs: {}", std::io::Error::last_os_error());
    let _unmount = HostMount(sub.clone());
    let canary = world_writable_canary(&sub);
    let before = snapshot(&canary);

    let (d, _profiles) = daemon_exposing(exposed.path());
    let m = marker();
    let body = r#"
DIR = @DIR@
R["mounts"] = {"ok": True, "list": [(l.split()[4], l.split()[5]) for l in open("/proc/self/mountinfo") if l.split()[4].startswith(DIR)]}
C = DIR + "/volume/canary.txt"
t("read", lambda: open(C).read())
t("open r+", lambda: open(C, "r+").write("pwned"))
t("truncate", lambda: os.truncate(C, 0))
t("create", lambda: open(DIR + "/volume/new", "w"))
done()
"#
    .replace("@DIR@", &format!("{:?}", exposed.path().display().to_string()));
    let r = py(&d, &m, &body, 20).await;
    let res = results(&r);
    allowed(&res, "read");
    let mounts = res["mounts"]["list"].as_array().expect("mounts");
    assert_eq!(mounts.len(), 2, "the bound path and its submount: {res}");
    for mnt in mounts {
        let opts: Vec<&str> = mnt[1].as_str().unwrap_or_default().split(',').collect();
        for want in ["ro", "nosuid", "nodev"] {
            assert!(
                opts.contains(&want),
                "{} is not {want} inside the sandbox: {mnt}",
                mnt[0]
            );
        }
    }
    for name in ["open r+", "truncate", "create"] {
        refused_with(&res, name, &[libc::EROFS, libc::EACCES]);
    }
    assert_eq!(snapshot(&canary), before, "canary on the submount changed");
    assert_eq!(std::fs::read_dir(&sub).expect("readdir").count(), 1);
    assert_run_left_nothing(&d, &r, &m);
}

#[tokio::test(flavor = "multi_thread")]
async fn symlinks_planted_in_the_workdir_never_reach_a_host_file() {
    let d = Daemon::start();
    let canary = d.dir.path().join("canary.txt");
    std::fs::write(&canary, "canary: original content\n").expect("canary");
    let before = sha256_file(&canary);
    let m = marker();
    let body = r#"
CANARY = @CANARY@
NAMES = ["stdout", "stderr", "output", "output.txt", "out.json", "result.json", "script.py", "main.py",
         "__main__.py", "run.sh", "input.json", "envelope.json", ".bashrc", ".profile", "audit.jsonl"]
for n in NAMES:
    t("plant " + n, lambda n=n: os.symlink(CANARY, "/work/" + n))
    t("write through " + n, lambda n=n: open("/work/" + n, "w").write("pwned"))
t("dir symlink", lambda: os.symlink(os.path.dirname(CANARY), "/work/hostdir"))
t("write through dir symlink", lambda: open("/work/hostdir/canary.txt", "w").write("pwned"))
t("proc root symlink", lambda: os.symlink("/proc/1/root" + CANARY, "/work/via-init"))
t("write through proc root", lambda: open("/work/via-init", "w").write("pwned"))
print("planted", sorted(os.listdir("/work")))
done()
"#
    .replace("@CANARY@", &format!("{:?}", canary.display().to_string()));
    let r = py(&d, &m, &body, 20).await;
    let res = results(&r);
    // The links can be planted; writing through them finds no host file (/tmp inside is the
    // sandbox's own, so the canary's directory does not exist there).
    let names = res
        .as_object()
        .expect("record")
        .keys()
        .filter_map(|k| k.strip_prefix("plant "))
        .map(str::to_string)
        .collect::<Vec<_>>();
    assert_eq!(names.len(), 15, "{res}");
    for n in names {
        allowed(&res, &format!("plant {n}"));
        refused_with(&res, &format!("write through {n}"), &[libc::ENOENT]);
    }
    refused_with(&res, "write through dir symlink", &[libc::ENOENT]);
    refused_with(&res, "write through proc root", &[libc::ENOENT]);
    assert_eq!(sha256_file(&canary), before, "canary changed");
    assert_run_left_nothing(&d, &r, &m);

    // The next run starts from an empty workdir: nothing planted survives a run.
    let m2 = marker();
    let r2 = py(&d, &m2, r#"t("workdir", lambda: sorted(os.listdir("/work"))); t("tmp", lambda: sorted(os.listdir("/tmp"))); done()"#, 20).await;
    let res2 = results(&r2);
    assert_eq!(res2["workdir"]["value"], json!("[]"), "{res2}");
    assert_eq!(res2["tmp"]["value"], json!("[]"), "{res2}");
    assert_eq!(sha256_file(&canary), before, "canary changed");
    assert_run_left_nothing(&d, &r2, &m2);
}

// -------------------------------------------------------------------------------------------------
// The daemon as a target: signals, ptrace, its port

#[tokio::test(flavor = "multi_thread")]
async fn signals_and_ptrace_cannot_reach_the_daemon() {
    let d = Daemon::start();
    let pid_before = d.pid();
    let m = marker();
    let body = r#"
D = @DPID@
t("kill daemon SIGKILL", lambda: os.kill(D, signal.SIGKILL))
t("kill daemon SIGTERM", lambda: os.kill(D, signal.SIGTERM))
t("kill daemon 0", lambda: os.kill(D, 0))
t("kill -1 SIGKILL", lambda: os.kill(-1, signal.SIGKILL))
t("kill init", lambda: os.kill(1, signal.SIGKILL))
t("kill daemon pgrp", lambda: os.killpg(D, signal.SIGKILL))
t("ptrace attach init", lambda: call(libc.ptrace, ctypes.c_long(16), ctypes.c_long(1), None, None))
t("ptrace seize daemon", lambda: call(libc.ptrace, ctypes.c_long(0x4206), ctypes.c_long(D), None, None))
t("ptrace traceme", lambda: call(libc.ptrace, ctypes.c_long(0), ctypes.c_long(0), None, None))
t("process_vm_readv daemon", lambda: sc(310, D, 0, 0, 0, 0, 0))
t("pidfd_open daemon", lambda: sc(434, D, 0))
def pidfd_kill_init():
    fd = sc(434, 1, 0)
    return sc(424, fd, signal.SIGKILL, 0, 0)
t("pidfd_send_signal init", pidfd_kill_init)
t("pidfd_getfd init", lambda: sc(438, sc(434, 1, 0), 0, 0))
done()
"#
    .replace("@DPID@", &d.pid().to_string());
    let r = py(&d, &m, &body, 20).await;
    let res = results(&r);
    // The daemon is not in the sandbox's pid namespace; pid 1 is root and outside the Landlock
    // signal scope.
    refused_with(&res, "kill daemon SIGKILL", &[libc::ESRCH]);
    refused_with(&res, "kill daemon SIGTERM", &[libc::ESRCH]);
    refused_with(&res, "kill daemon 0", &[libc::ESRCH]);
    refused_with(&res, "kill -1 SIGKILL", &[libc::ESRCH]);
    refused_with(&res, "kill init", &[libc::EPERM]);
    refused_with(&res, "kill daemon pgrp", &[libc::ESRCH]);
    refused_with(&res, "ptrace attach init", &[libc::EPERM]);
    refused_with(&res, "ptrace seize daemon", &[libc::EPERM]);
    refused_with(&res, "ptrace traceme", &[libc::EPERM]);
    refused_with(&res, "process_vm_readv daemon", &[libc::EPERM]);
    refused_with(&res, "pidfd_open daemon", &[libc::ESRCH]);
    refused_with(&res, "pidfd_send_signal init", &[libc::EPERM]);
    refused_with(&res, "pidfd_getfd init", &[libc::EPERM]);

    assert_eq!(d.pid(), pid_before);
    assert_healthy(&d).await;
    assert_run_left_nothing(&d, &r, &m);
    // And it still runs work.
    let m2 = marker();
    let r2 = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": [&m2]}))
        .await;
    assert_eq!(r2.status, 200, "{}", r2.text);
    assert_eq!(stdout(&r2).trim(), m2);
    assert_run_left_nothing(&d, &r2, &m2);
}

/// Accepts nothing within a short grace: the run is over when this is called, so a connection it
/// made would already be queued.
fn assert_no_connection(l: &std::net::TcpListener, what: &str) {
    l.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        match l.accept() {
            Ok((_, peer)) => panic!("{what} accepted a connection from {peer}"),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => panic!("{what}: accept: {e}"),
        }
        if Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The host's address on its default route, if it has one (a packetless UDP connect).
fn host_ip() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[tokio::test(flavor = "multi_thread")]
async fn network_to_the_daemon_host_listeners_and_dns_fails() {
    let d = Daemon::start();
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let tcp_port = tcp.local_addr().expect("addr").port();
    let host = host_ip();
    let tcp_host =
        host.map(|ip| std::net::TcpListener::bind((ip, 0)).expect("listener on host address"));
    let host_target = match (&host, &tcp_host) {
        (Some(ip), Some(l)) => format!(
            "({:?}, {})",
            ip.to_string(),
            l.local_addr().expect("addr").port()
        ),
        _ => "None".to_string(),
    };
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    udp.set_nonblocking(true).expect("nonblocking");
    let udp_port = udp.local_addr().expect("addr").port();
    let abstract_name = format!("executor-arm-{}", marker());
    let unix = {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .expect("abstract addr");
        std::os::unix::net::UnixListener::bind_addr(&addr).expect("abstract listener")
    };
    unix.set_nonblocking(true).expect("nonblocking");
    let daemon_port: u16 = d
        .addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("daemon port");

    let m = marker();
    let body = r#"
DPORT, TPORT, UPORT, HOST, ABSTRACT = @DPORT@, @TPORT@, @UPORT@, @HOST@, @ABSTRACT@
def connect(addr, fam=socket.AF_INET):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(addr)
    return s.recv(16)
t("tcp daemon port", lambda: connect(("127.0.0.1", DPORT)))
t("tcp daemon port v6", lambda: connect(("::1", DPORT), socket.AF_INET6))
t("tcp host listener", lambda: connect(("127.0.0.1", TPORT)))
if HOST:
    t("tcp host address", lambda: connect(HOST))
t("tcp bind", lambda: socket.socket().bind(("127.0.0.1", 0)))
def udp(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return s.sendto(b"ping", addr)
t("udp host listener", lambda: udp(("127.0.0.1", UPORT)))
t("udp dns stub", lambda: udp(("127.0.0.53", 53)))
t("udp dns public", lambda: udp(("8.8.8.8", 53)))
t("resolve", lambda: socket.getaddrinfo("example.com", 443))
def unix_abstract():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + ABSTRACT)
t("abstract unix", unix_abstract)
t("interfaces", lambda: [n for _, n in socket.if_nameindex()])
done()
"#
    .replace("@DPORT@", &daemon_port.to_string())
    .replace("@TPORT@", &tcp_port.to_string())
    .replace("@UPORT@", &udp_port.to_string())
    .replace("@HOST@", &host_target)
    .replace("@ABSTRACT@", &format!("{abstract_name:?}"));
    let r = py(&d, &m, &body, 30).await;
    let res = results(&r);
    // Landlock refuses TCP connect/bind outright (EACCES); below it the new network namespace
    // has only a down loopback (ENETUNREACH).
    let no_net = [
        libc::EACCES,
        libc::ENETUNREACH,
        libc::EHOSTUNREACH,
        libc::EADDRNOTAVAIL,
        libc::ECONNREFUSED,
    ];
    refused_with(&res, "tcp daemon port", &no_net);
    refused_with(&res, "tcp daemon port v6", &no_net);
    refused_with(&res, "tcp host listener", &no_net);
    if host.is_some() {
        refused_with(&res, "tcp host address", &no_net);
    }
    refused_with(&res, "tcp bind", &[libc::EACCES]);
    refused_with(&res, "udp host listener", &[libc::ENETUNREACH]);
    refused_with(&res, "udp dns stub", &[libc::ENETUNREACH]);
    refused_with(&res, "udp dns public", &[libc::ENETUNREACH]);
    refused(&res, "resolve");
    refused_with(&res, "abstract unix", &[libc::ECONNREFUSED, libc::EPERM]);
    assert_eq!(res["interfaces"]["value"], json!("['lo']"), "{res}");

    // From the host: no listener saw anything, the daemon is unaffected.
    assert_no_connection(&tcp, "loopback listener");
    if let Some(l) = &tcp_host {
        assert_no_connection(l, "host-address listener");
    }
    let mut buf = [0u8; 64];
    match udp.recv_from(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("UDP listener received {other:?}"),
    }
    match unix.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok(_) => panic!("abstract unix listener accepted a connection"),
        Err(e) => panic!("abstract accept: {e}"),
    }
    assert_healthy(&d).await;
    assert_run_left_nothing(&d, &r, &m);
}

/// Socket families no namespace confines are refused by seccomp: AF_VSOCK in particular reaches
/// the hypervisor side of a VM (this host has /dev/vsock) whatever the network namespace says.
#[tokio::test(flavor = "multi_thread")]
async fn socket_families_outside_the_network_namespace_are_refused() {
    let d = Daemon::start();
    let m = marker();
    let body = r#"
FAMS = {"vsock": 40, "packet": 17, "alg": 38, "bluetooth": 31, "xdp": 44, "tipc": 30, "rds": 21, "key": 15,
        "can": 29, "appletalk": 5, "x25": 9, "ax25": 3, "pppox": 24, "kcm": 41, "qipcrtr": 42, "smc": 43, "mctp": 45}
for name, fam in FAMS.items():
    for typ in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET, socket.SOCK_RAW):
        t(f"{name} {typ}", lambda fam=fam, typ=typ: socket.socket(fam, typ).close())
t("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())
t("inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close())
t("inet6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close())
t("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close())
t("socketpair", lambda: [s.close() for s in socket.socketpair()])
done()
"#;
    let r = py(&d, &m, body, 20).await;
    let res = results(&r);
    for (name, _) in res.as_object().expect("record") {
        if ["unix", "inet", "inet6", "netlink", "socketpair"].contains(&name.as_str()) {
            allowed(&res, name);
        } else {
            refused_with(&res, name, &[libc::EAFNOSUPPORT]);
        }
    }
    assert!(res["vsock 1"].is_object(), "{res}");
    assert_healthy(&d).await;
    assert_run_left_nothing(&d, &r, &m);
}

// -------------------------------------------------------------------------------------------------
// Privileges, kernel surface, what the sandbox sees

#[tokio::test(flavor = "multi_thread")]
async fn no_privileges_no_new_privs_seccomp_and_only_stdio_fds() {
    let d = Daemon::start();
    let m = marker();
    let body = r#"
t("setuid 0", lambda: os.setuid(0))
t("setgid 0", lambda: os.setgid(0))
t("setresuid 0", lambda: os.setresuid(0, 0, 0))
t("setgroups", lambda: os.setgroups([0]))
t("ids", lambda: (os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()))
R["status"] = {"ok": True, "text": open("/proc/self/status").read()}
R["fds"] = {"ok": True, "fds": sorted(int(n) for n in os.listdir("/proc/self/fd"))}
# The one extra fd of the listing was listdir's own directory fd: it is gone once listdir returns.
t("fd 3 after listing", lambda: os.readlink("/proc/self/fd/3"))
t("stdio", lambda: [os.readlink(f"/proc/self/fd/{i}") for i in range(3)])
t("setuid binary", lambda: [p for p in ("/usr/bin/su", "/usr/bin/passwd", "/usr/bin/mount") if os.path.exists(p) and os.stat(p).st_mode & 0o4000])
t("mounts", lambda: [l.split()[4] if "nosuid" in l.split()[5].split(",") else "missing" for l in open("/proc/self/mountinfo")])
import subprocess
su = subprocess.Popen(["/usr/bin/su", "-c", "id -u"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
uids = set()
while su.poll() is None:
    try:
        uids.update(l.strip("\n") for l in open(f"/proc/{su.pid}/status") if l.startswith("Uid:"))
    except OSError:
        pass
    time.sleep(0.005)
su.stdin.close()
R["su"] = {"ok": True, "rc": su.wait(), "out": su.stdout.read().decode(), "uids": sorted(uids)}
done()
"#;
    let r = py(&d, &m, body, 20).await;
    let res = results(&r);
    refused_with(&res, "setuid 0", &[libc::EPERM]);
    refused_with(&res, "setgid 0", &[libc::EPERM]);
    refused_with(&res, "setresuid 0", &[libc::EPERM]);
    refused_with(&res, "setgroups", &[libc::EPERM]);
    // The run's own uid from the configured block (default 200000 + 65536), the profile's gid.
    let ids = res["ids"]["value"].as_str().unwrap_or_default();
    let uid: u32 = ids
        .trim_start_matches('(')
        .split(',')
        .next()
        .and_then(|u| u.trim().parse().ok())
        .unwrap_or_else(|| panic!("ids: {res}"));
    assert!((200_000..265_536).contains(&uid), "{res}");
    assert_eq!(ids, format!("({uid}, {uid}, 65534, 65534, [])"), "{res}");
    let status = res["status"]["text"].as_str().unwrap_or_default();
    for want in [
        "NoNewPrivs:\t1\n",
        "Seccomp:\t2\n",
        "CapEff:\t0000000000000000\n",
        "CapPrm:\t0000000000000000\n",
        "CapAmb:\t0000000000000000\n",
    ] {
        assert!(status.contains(want), "{want} missing from {status}");
    }
    // Only 0, 1, 2 and the lister's own directory fd.
    let fds: BTreeSet<i64> = res["fds"]["fds"]
        .as_array()
        .expect("fds")
        .iter()
        .filter_map(Value::as_i64)
        .collect();
    assert_eq!(fds, BTreeSet::from([0, 1, 2, 3]), "{res}");
    refused_with(&res, "fd 3 after listing", &[libc::ENOENT]);
    // stdin is /dev/null (no stdin in the request), stdout and stderr the daemon's pipes.
    let stdio = res["stdio"]["value"].as_str().unwrap_or_default();
    assert!(
        stdio.starts_with("['/dev/null', 'pipe:[") && stdio.matches("pipe:[").count() == 2,
        "{stdio}"
    );
    // Setuid binaries on the read-only system paths exist, but nosuid + no_new_privs make them inert.
    // Setuid-root binaries exist on the read-only system paths, but every mount is nosuid and
    // no_new_privs is set: they run as 65534 and gain nothing.
    assert_ne!(
        res["setuid binary"]["value"],
        json!("[]"),
        "no setuid binary visible to try: {res}"
    );
    let mounts = res["mounts"]["value"].as_str().unwrap_or_default();
    assert!(
        !mounts.is_empty() && !mounts.contains("'missing'"),
        "mount without nosuid: {mounts}"
    );
    let su_res = &res["su"];
    assert_eq!(su_res["ok"], json!(true), "{res}");
    assert_ne!(su_res["rc"], json!(0), "su succeeded: {su_res}");
    assert!(
        !su_res["out"].as_str().unwrap_or_default().contains('0'),
        "su ran id -u: {su_res}"
    );
    for line in su_res["uids"].as_array().expect("uids") {
        assert_eq!(
            line,
            &json!(format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}")),
            "setuid took effect: {su_res}"
        );
    }
    assert_run_left_nothing(&d, &r, &m);
}

#[tokio::test(flavor = "multi_thread")]
async fn namespace_mount_ptrace_bpf_and_friends_fail_with_eperm() {
    let d = Daemon::start();
    let m = marker();
    let body = r#"
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x00020000, 0x40000000, 0x20000000
t("mount tmpfs", lambda: call(libc.mount, b"none", b"/work", b"tmpfs", ctypes.c_ulong(0), None))
t("mount bind", lambda: call(libc.mount, b"/usr", b"/work", None, ctypes.c_ulong(0x1000), None))
t("umount2 /proc", lambda: call(libc.umount2, b"/proc", 2))
t("unshare user", lambda: call(libc.unshare, CLONE_NEWUSER))
t("unshare mnt", lambda: call(libc.unshare, CLONE_NEWNS))
t("unshare net", lambda: call(libc.unshare, CLONE_NEWNET))
t("setns", lambda: call(libc.setns, os.open("/proc/self/ns/mnt", os.O_RDONLY), 0))
t("clone newuser", lambda: sc(56, CLONE_NEWUSER | 17, 0, 0, 0, 0))
t("clone newpid", lambda: sc(56, CLONE_NEWPID | 17, 0, 0, 0, 0))
t("clone3", lambda: sc(435, 0, 0))
t("ptrace traceme", lambda: call(libc.ptrace, ctypes.c_long(0), ctypes.c_long(0), None, None))
t("bpf map create", lambda: sc(321, 0, 0, 0))
t("bpf prog load", lambda: sc(321, 5, 0, 0))
t("perf_event_open", lambda: sc(298, 0, 0, -1, -1, 0))
t("pivot_root", lambda: sc(155, b"/work", b"/work"))
t("chroot", lambda: sc(161, b"/work"))
t("keyctl", lambda: sc(250, 0, 0, 0, 0, 0))
t("add_key", lambda: sc(248, b"user", b"k", b"v", 1, -2))
t("io_uring_setup", lambda: sc(425, 8, 0))
t("userfaultfd", lambda: sc(323, 0))
t("open_by_handle_at", lambda: sc(304, -100, 0, 0))
t("init_module", lambda: sc(175, 0, 0, b""))
t("finit_module", lambda: sc(313, 0, b"", 0))
t("kexec_load", lambda: sc(246, 0, 0, 0, 0))
t("fsopen", lambda: sc(430, b"tmpfs", 0))
t("open_tree", lambda: sc(428, -100, b"/usr", 1))
t("move_mount", lambda: sc(429, -1, b"", -100, b"/work", 0))
t("personality", lambda: sc(135, 0x0040000))
t("reboot", lambda: sc(169, 0xfee1dead, 0x28121969, 0x4321fedc, 0))
t("mknod char device", lambda: os.mknod("/work/mem", 0o20666, os.makedev(1, 1)))
pid = os.fork()
if pid == 0:
    os._exit(7)
R["fork still works"] = {"ok": os.waitpid(pid, 0)[1] >> 8 == 7}
done()
"#;
    let r = py(&d, &m, body, 20).await;
    let res = results(&r);
    for name in [
        "mount tmpfs",
        "mount bind",
        "umount2 /proc",
        "unshare user",
        "unshare mnt",
        "unshare net",
        "setns",
        "clone newuser",
        "clone newpid",
        "ptrace traceme",
        "bpf map create",
        "bpf prog load",
        "perf_event_open",
        "pivot_root",
        "chroot",
        "keyctl",
        "add_key",
        "io_uring_setup",
        "userfaultfd",
        "open_by_handle_at",
        "init_module",
        "finit_module",
        "kexec_load",
        "fsopen",
        "open_tree",
        "move_mount",
        "personality",
        "reboot",
        "mknod char device",
    ] {
        refused_with(&res, name, &[libc::EPERM]);
    }
    // clone3 carries its flags behind a pointer: refused with ENOSYS so libc falls back to clone.
    refused_with(&res, "clone3", &[libc::ENOSYS]);
    assert_eq!(res["fork still works"]["ok"], json!(true), "{res}");
    assert_run_left_nothing(&d, &r, &m);
}

/// The filter checks the architecture: the 32-bit `int 0x80` entry and x32 syscall numbers would
/// otherwise bypass every number in the deny list. The process is killed by SIGSYS.
#[tokio::test(flavor = "multi_thread")]
async fn foreign_syscall_abis_kill_the_process() {
    let d = Daemon::start();
    let x32 = r#"
print("before", flush=True)
libc.syscall(ctypes.c_long(0x40000000 + 39))
print("survived x32", flush=True)
"#;
    let int80 = r#"
import mmap
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(bytes([0xb8, 0x14, 0, 0, 0, 0xcd, 0x80, 0xc3]))  # mov eax, 20 (getpid); int 0x80; ret
fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
print("before", flush=True)
fn()
print("survived int80", flush=True)
"#;
    for body in [x32, int80] {
        let m = marker();
        let r = py(&d, &m, body, 20).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert!(stdout(&r).contains("before"), "{}", r.text);
        assert!(!stdout(&r).contains("survived"), "{}", r.text);
        assert_eq!(r.json["exit_code"], json!(128 + libc::SIGSYS), "{}", r.text);
        assert_eq!(r.json["success"], json!(false), "{}", r.text);
        assert_run_left_nothing(&d, &r, &m);
    }
    assert_healthy(&d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn proc_shows_only_the_sandbox_and_the_hostname_is_sandbox() {
    let d = Daemon::start();
    let host_name_before = hostname();
    let m = marker();
    let body = r#"
t("pids", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
t("self", lambda: os.getpid())
t("ppid", lambda: os.getppid())
t("hostname", lambda: socket.gethostname())
t("uname", lambda: os.uname().nodename)
t("proc hostname", lambda: open("/proc/sys/kernel/hostname").read().strip())
t("sethostname", lambda: call(libc.sethostname, b"pwned", 5))
t("cgroup", lambda: open("/proc/self/cgroup").read())
t("cgroup paths", lambda: sorted({l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines()}))
t("root", lambda: sorted(os.listdir("/")))
t("sys", lambda: os.listdir("/sys"))
t("dev", lambda: sorted(os.listdir("/dev")))
done()
"#;
    let r = py(&d, &m, body, 20).await;
    let res = results(&r);
    // pid 2 is the command; pid 1, the sandbox's init (root, sharing the daemon's memory), is
    // hidden from it like every process it may not trace; no host process is visible.
    assert_eq!(res["pids"]["value"], json!("[2]"), "{res}");
    assert_eq!(res["self"]["value"], json!("2"), "{res}");
    assert_eq!(res["ppid"]["value"], json!("1"), "{res}");
    for k in ["hostname", "uname", "proc hostname"] {
        assert_eq!(res[k]["value"], json!("'sandbox'"), "{k}: {res}");
    }
    refused_with(&res, "sethostname", &[libc::EPERM]);
    // The cgroup namespace shows the run's cgroup as the root, in every hierarchy.
    let cg = res["cgroup"]["value"].as_str().unwrap_or_default();
    assert!(!cg.contains("exec-"), "{cg}");
    assert_eq!(res["cgroup paths"]["value"], json!("['/']"), "{res}");
    refused_with(&res, "sys", &[libc::ENOENT]);
    assert_eq!(
        res["dev"]["value"],
        json!("['fd', 'null', 'random', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']"),
        "{res}"
    );
    // The host's hostname is untouched.
    assert_eq!(hostname(), host_name_before);
    assert_ne!(host_name_before, "sandbox");
    assert_run_left_nothing(&d, &r, &m);
}

/// Each live run has a host uid of its own, so the kernel's per-user counters are its own: run A
/// opens inotify instances until the kernel refuses one (`fs.inotify.max_user_instances`) and
/// holds them; run B, meanwhile, still gets one.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_exhausting_its_inotify_instances_leaves_another_run_its_own() {
    let d = Daemon::start();
    let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .expect("max_user_instances")
        .trim()
        .parse()
        .expect("a number");
    let (ma, mb) = (marker(), marker());
    let hog = r#"
fds = []
while True:
    try:
        fds.append(call(libc.inotify_init1, 0))
    except OSError as e:
        R["hog"] = {"ok": True, "count": len(fds), "errno": e.errno, "uid": os.getuid()}
        break
sys.stdout.flush()
time.sleep(6)
done()
"#;
    let other = r#"
t("inotify", lambda: call(libc.inotify_init1, 0))
t("uid", lambda: os.getuid())
done()
"#;
    let held = async {
        // B starts only once A holds every instance its uid may have.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut most = 0;
        while Instant::now() < deadline {
            for p in pids_with_cmdline(&ma) {
                let n = fd_links(p)
                    .iter()
                    .filter(|l| l.as_str() == "anon_inode:inotify")
                    .count();
                most = most.max(n);
            }
            if most >= limit {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            most >= limit,
            "run A held {most} of {limit} inotify instances"
        );
        py(&d, &mb, other, 20).await
    };
    let (a, b) = tokio::join!(py(&d, &ma, hog, 30), held);
    let (a, b) = (results(&a), results(&b));
    assert_eq!(a["hog"]["errno"], json!(libc::EMFILE), "{a}");
    allowed(&b, "inotify");
    let uid_a = a["hog"]["uid"].as_u64().expect("uid of A");
    let uid_b: u64 = b["uid"]["value"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .expect("uid of B");
    assert_ne!(uid_a, uid_b, "{a} {b}");
    for uid in [uid_a, uid_b] {
        assert!((200_000..265_536).contains(&uid), "uid {uid}");
    }
}

/// The inode of the TCP socket listening on `addr` ("ip:port") in the network namespace of `pid`.
fn listener_inode(pid: i32, addr: &str) -> String {
    let port = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .expect("port");
    let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).expect("net/tcp");
    tcp.lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 9 && f[3] == "0A" && f[1].ends_with(&format!(":{port:04X}")))
        .map(|f| f[9].to_string())
        .unwrap_or_else(|| panic!("no listener on {addr} in {tcp}"))
}

/// Every descendant of `pid`, from the parent field of each process's stat.
fn descendants(pid: i32) -> Vec<i32> {
    let mut parent = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // The parent is the second field after the ")" that ends the command name.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if let Some(pp) = rest
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<i32>().ok())
        {
            parent.insert(p, pp);
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for (&c, &pp) in &parent {
            if pp == p && !out.contains(&c) {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

/// The targets of a process's descriptors (empty once it is gone).
fn fd_links(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

/// No descriptor of the daemon reaches a sandbox process but the run's own: not a prepared slot
/// waiting for its run (it holds /dev/null, its go socket and its cgroup's files), not the
/// processes of a running sandbox, not the command (0-2 only). Above all not the daemon's
/// listening socket, which a process holding it would keep bound past the daemon's exit, nor its
/// audit log or secret.
#[tokio::test(flavor = "multi_thread")]
async fn no_descriptor_of_the_daemon_reaches_a_slot_or_a_sandbox() {
    let d = Daemon::start();
    let listener = format!("socket:[{}]", listener_inode(d.pid(), &d.addr));
    let private = d.dir.path().to_string_lossy().into_owned();
    let forbidden = |links: &[String]| -> Vec<String> {
        links
            .iter()
            .filter(|l| **l == listener || l.starts_with(&private))
            .cloned()
            .collect()
    };
    // The prepared slots' shims, waiting for their runs.
    let deadline = Instant::now() + Duration::from_secs(20);
    let slots = loop {
        let s = descendants(d.pid());
        if s.len() >= 2 || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!slots.is_empty(), "no prepared slot appeared within 20 s");
    // A process seen in its first moments (cloned, not yet past closing what it was born
    // with) holds the daemon's descriptors for that moment: each is read again until it has
    // settled, bounded, and judged on what it holds then.
    let settled = |p: i32| -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let links = fd_links(p);
            if forbidden(&links).is_empty() || Instant::now() > deadline {
                return links;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    for &p in &slots {
        let links = settled(p);
        assert!(forbidden(&links).is_empty(), "slot {p} holds {links:?}");
        let sockets = links.iter().filter(|l| l.starts_with("socket:")).count();
        assert!(
            sockets <= 1,
            "slot {p} holds more than its go socket: {links:?}"
        );
        for l in &links {
            assert!(
                l == "/dev/null" || l.starts_with("socket:") || l.ends_with("cgroup.procs"),
                "slot {p} holds {l} of the daemon: {links:?}"
            );
        }
    }
    // A running sandbox: its processes seen from the host while the command sleeps, and the
    // command's own view.
    let m = marker();
    let body = r#"
R["fds"] = {"ok": True, "links": sorted(os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}"))}
print("READY", flush=True)
time.sleep(3)
done()
"#;
    let watch = async {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            for p in descendants(d.pid()) {
                let links = settled(p);
                assert!(
                    forbidden(&links).is_empty(),
                    "sandbox process {p} holds {links:?}"
                );
                if pids_with_cmdline(&m).contains(&p) {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    let (r, seen_command) = tokio::join!(py(&d, &m, body, 20), watch);
    assert!(seen_command, "the command never appeared on the host");
    let res = results(&r);
    let links: Vec<String> = serde_json::from_value(res["fds"]["links"].clone()).expect("links");
    assert!(
        !links.iter().any(|l| l.starts_with("socket:")),
        "the command holds a socket: {links:?}"
    );
    assert_run_left_nothing(&d, &r, &m);
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(r, 0);
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

// -------------------------------------------------------------------------------------------------
// Resource limits

const TMPFS_MAGIC: i64 = 0x0102_1994;

/// statfs(2) of a host path: (f_type, total bytes).
fn statfs(p: &Path) -> (i64, u64) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: an all-zero statfs is a valid value for the kernel to overwrite.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs(2) with a NUL-terminated path and a pointer to our struct.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    assert_eq!(
        r,
        0,
        "statfs {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
    (st.f_type as i64, st.f_blocks as u64 * st.f_bsize as u64)
}

#[tokio::test(flavor = "multi_thread")]
async fn disk_fill_stops_at_the_limit_and_lives_in_the_runs_own_tmpfs() {
    let d = Daemon::start();
    let m = marker();
    let limit: u64 = 100 << 20;
    // Fill the workdir, then /tmp, then hold until the host has looked (it creates /work/.release).
    let body = r#"
def fill(d):
    n, i, chunk = 0, 0, b"x" * (1 << 20)
    while True:
        fd = os.open(f"{d}/fill{i}", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for _ in range(8):
                w = os.write(fd, chunk)
                n += w
                if w < len(chunk):
                    os.write(fd, chunk[w:])
        except OSError as e:
            return {"bytes": n, "errno": e.errno}
        finally:
            os.close(fd)
        i += 1
work = fill("/work")
tmp = fill("/tmp")
open("/work/.full", "w").close()
while not os.path.exists("/work/.release"):
    time.sleep(0.05)
print("RESULT " + json.dumps({"work": work, "tmp": tmp}), flush=True)
"#;
    let host_root_dev = std::fs::metadata("/").expect("stat /").dev();
    let host_tmp_dev = std::fs::metadata(std::env::temp_dir())
        .expect("stat tmp")
        .dev();
    let inspect = async {
        // Find the command on the host and look at its filesystems from outside.
        let deadline = Instant::now() + Duration::from_secs(50);
        loop {
            for pid in pids_with_cmdline(&m) {
                let root = PathBuf::from(format!("/proc/{pid}/root"));
                if root.join("work/.full").exists() {
                    let work = statfs(&root.join("work"));
                    let tmp = statfs(&root.join("tmp"));
                    let work_dev = std::fs::metadata(root.join("work/fill0"))
                        .expect("stat fill0")
                        .dev();
                    let tmp_dev = std::fs::metadata(root.join("tmp")).expect("stat tmp").dev();
                    std::fs::write(root.join("work/.release"), "").expect("release");
                    return Some((work, tmp, work_dev, tmp_dev));
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (r, seen) = tokio::join!(py(&d, &m, body, 60), inspect);
    let res = results(&r);
    let (work, tmp, work_dev, tmp_dev) = seen.expect("the host never saw the filled sandbox");
    // Host side: the data lives in one tmpfs of exactly the limit, shared by /work and /tmp, on
    // no host filesystem.
    assert_eq!(work, (TMPFS_MAGIC, limit));
    assert_eq!(tmp, (TMPFS_MAGIC, limit));
    assert_eq!(
        work_dev, tmp_dev,
        "/work and /tmp must share one disk budget"
    );
    assert_ne!(work_dev, host_root_dev);
    assert_ne!(work_dev, host_tmp_dev);
    // Sandbox side: writing stopped with ENOSPC at the limit, for both directories together.
    let (wb, tb) = (
        res["work"]["bytes"].as_u64().expect("work bytes"),
        res["tmp"]["bytes"].as_u64().expect("tmp bytes"),
    );
    assert_eq!(res["work"]["errno"], json!(libc::ENOSPC), "{res}");
    assert_eq!(res["tmp"]["errno"], json!(libc::ENOSPC), "{res}");
    assert!(
        wb >= limit * 9 / 10,
        "workdir filled only {wb} bytes: {res}"
    );
    assert!(
        wb + tb <= limit,
        "wrote {} bytes over a {limit}-byte limit: {res}",
        wb + tb
    );
    assert_run_left_nothing(&d, &r, &m);
    assert_healthy(&d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_bombs_are_stopped_by_the_pids_limit() {
    let d = Daemon::start();
    // 1. Fork until refused: the pids limit (64 for the run: shim, init, the command and its
    //    children) answers EAGAIN; exiting non-zero then is reported as killed_reason "pids".
    let m = marker();
    let body = r#"
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
        n += 1
except OSError as e:
    print("RESULT " + json.dumps({"forked": n, "errno": e.errno}), flush=True)
sys.exit(3)
"#;
    let r = py(&d, &m, body, 30).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let res = results(&r);
    assert_eq!(res["errno"], json!(libc::EAGAIN), "{res}");
    let forked = res["forked"].as_u64().expect("forked");
    assert!(forked > 0 && forked < 64, "{res}");
    assert_eq!(r.json["exit_code"], json!(3), "{}", r.text);
    assert_eq!(r.json["killed_reason"], json!("pids"), "{}", r.text);
    assert_run_left_nothing(&d, &r, &m);

    // 2. The classic bomb: every process forks forever. It spins at the limit until the wall
    //    clock kills the whole cgroup.
    let m2 = marker();
    let bomb = r#"
while True:
    try:
        os.fork()
    except OSError:
        pass
"#;
    let r2 = py(&d, &m2, bomb, 3).await;
    assert_eq!(r2.status, 408, "{}", r2.text);
    assert_eq!(r2.json["killed_reason"], json!("timeout"), "{}", r2.text);
    assert_run_left_nothing(&d, &r2, &m2);

    // 3. The daemon still runs work.
    let m3 = marker();
    let r3 = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": [&m3]}))
        .await;
    assert_eq!(r3.status, 200, "{}", r3.text);
    assert_eq!(stdout(&r3).trim(), m3);
    assert_run_left_nothing(&d, &r3, &m3);
}

/// Runs of every daemon on a host draw their uids from one block (and 65534 is shared with the
/// host's other nobody processes). Runs that hold their full pids allowance must not make
/// another daemon's run fail: the per-run cgroup is the bound, and a
/// per-uid count across the host (RLIMIT_NPROC, sized by the *other* daemon's concurrency of 1)
/// would couple unrelated runs.
#[tokio::test(flavor = "multi_thread")]
async fn runs_at_their_pids_limit_do_not_starve_another_daemons_runs() {
    let hog_daemon = Daemon::start();
    let small = Daemon::start_with(Opts {
        config: Some("[server]\nconcurrency = { local = 1, docker = 1, gvisor = 1 }\n".into()),
        ..Default::default()
    });
    let hogs = [marker(), marker()];
    let body = r#"
n = 0
try:
    while True:
        if os.fork() == 0:
            while not os.path.exists("/work/.release"):
                time.sleep(0.05)
            os._exit(0)
        n += 1
except OSError:
    pass
open("/work/.full", "w").close()
while not os.path.exists("/work/.release"):
    time.sleep(0.05)
print("RESULT " + json.dumps({"forked": n}), flush=True)
"#;
    let full = |m: &str| {
        pids_with_cmdline(m)
            .into_iter()
            .map(|pid| PathBuf::from(format!("/proc/{pid}/root")))
            .find(|root| root.join("work/.full").exists())
    };
    let probe = async {
        // Once both hogs hold their processes, run something on the other daemon, then release.
        let deadline = Instant::now() + Duration::from_secs(50);
        let roots = loop {
            if let (Some(a), Some(b)) = (full(&hogs[0]), full(&hogs[1])) {
                break [a, b];
            }
            assert!(
                Instant::now() < deadline,
                "the hogs never filled their pids allowance"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let held = pids_with_cmdline(&hogs[0]).len() + pids_with_cmdline(&hogs[1]).len();
        let m = marker();
        let r = small
            .exec(json!({"action_type": "shell", "command": "echo", "args": [&m]}))
            .await;
        for root in roots {
            std::fs::write(root.join("work/.release"), "").expect("release");
        }
        (held, m, r)
    };
    let (a, b, (held, m, r)) = tokio::join!(
        py(&hog_daemon, &hogs[0], body, 60),
        py(&hog_daemon, &hogs[1], body, 60),
        probe
    );
    assert!(held >= 120, "the hogs held only {held} processes");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["exit_code"], json!(0), "{}", r.text);
    assert_eq!(stdout(&r).trim(), m, "{}", r.text);
    assert_run_left_nothing(&small, &r, &m);
    for (hog_r, hog) in [(a, &hogs[0]), (b, &hogs[1])] {
        let res = results(&hog_r);
        assert!(res["forked"].as_u64().is_some_and(|n| n >= 58), "{res}");
        // Both hogs have answered: "no run cgroup at all" is exact for this daemon too.
        assert_run_left_nothing(&hog_daemon, &hog_r, hog);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_bomb_is_oom_killed_and_reported() {
    let d = Daemon::start();
    let m = marker();
    let body = r#"
print("start", flush=True)
hog = []
while True:
    hog.append(b"x" * (16 << 20))
"#;
    let r = py(&d, &m, body, 60).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["oom"], json!(true), "{}", r.text);
    assert_eq!(r.json["killed_reason"], json!("oom"), "{}", r.text);
    assert_eq!(r.json["outcome"], json!("oom"), "{}", r.text);
    assert_eq!(r.json["success"], json!(false), "{}", r.text);
    let peak = r.json["peak_memory_kib"].as_u64().expect("peak_memory_kib");
    assert!(
        peak <= 512 * 1024 + 1024,
        "peak {peak} KiB above the 512 MiB limit"
    );
    assert_run_left_nothing(&d, &r, &m);

    let m2 = marker();
    let r2 = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": [&m2]}))
        .await;
    assert_eq!(r2.status, 200, "{}", r2.text);
    assert_run_left_nothing(&d, &r2, &m2);
    assert_healthy(&d).await;
}

/// Floods stdout (and, with `both`, stderr from a child) with 64 KiB writes for two seconds; the
/// parent then writes "flood over" to stderr and exits 0.
fn flood_then_exit(both: bool) -> String {
    format!(
        r#"
end = time.monotonic() + 2
b = b"y" * 65536
fd = 2 if {both} and os.fork() == 0 else 1
while time.monotonic() < end:
    os.write(fd, b)
if fd == 1:
    if {both}:
        os.wait()
    os.write(2, b"\nflood over\n")
"#,
        both = if both { "True" } else { "False" }
    )
}

/// Past the cap a stream is cut and flagged, the rest is drained with constant memory, and the
/// run goes on: to its own end (success), or to its timeout (408 with the capped output).
#[tokio::test(flavor = "multi_thread")]
async fn output_past_the_cap_is_truncated_and_the_run_goes_on() {
    let d = Daemon::start();
    let cap = 1usize << 20;
    let rss_before = vm_rss_kib(d.pid());
    for (i, both) in [false, true, false, true].into_iter().enumerate() {
        let m = marker();
        let r = py(&d, &m, &flood_then_exit(both), 60).await;
        let brief = r.text.chars().take(300).collect::<String>();
        assert_eq!(r.status, 200, "run {i}: {brief}");
        assert_eq!(r.json["success"], json!(true), "run {i}: {brief}");
        assert_eq!(r.json["exit_code"], json!(0), "run {i}: {brief}");
        assert_eq!(r.json["killed_reason"], Value::Null, "run {i}: {brief}");
        assert_eq!(r.json["stdout_truncated"], json!(true), "run {i}");
        assert_eq!(stdout(&r).len(), cap, "run {i}");
        let err = r.json["stderr"].as_str().unwrap_or_default();
        assert!(err.len() <= cap, "run {i}: {} stderr bytes", err.len());
        if both {
            assert_eq!(r.json["stderr_truncated"], json!(true), "run {i}");
        } else {
            assert_eq!(
                err, "\nflood over\n",
                "run {i}: the run went on past the cap"
            );
        }
        assert_run_left_nothing(&d, &r, &m);
    }
    // A flood that never ends runs to its timeout and keeps the capped output.
    let m = marker();
    let r = py(
        &d,
        &m,
        "b = b'z' * 65536\nwhile True:\n    os.write(1, b)",
        2,
    )
    .await;
    assert_eq!(
        r.status,
        408,
        "{}",
        r.text.chars().take(300).collect::<String>()
    );
    assert_eq!(r.json["killed_reason"], json!("timeout"));
    assert_eq!(r.json["stdout_truncated"], json!(true));
    assert_eq!(stdout(&r).len(), cap);
    assert_run_left_nothing(&d, &r, &m);

    let rss_after = vm_rss_kib(d.pid());
    // Floods of output several times the cap: the daemon keeps at most the capped bytes per run.
    assert!(
        rss_after < rss_before + 64 * 1024,
        "daemon RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    let m = d.get("/metrics").await.text;
    assert!(m.contains("executor_output_truncations_total 5"), "{m}");
    assert_healthy(&d).await;
}

/// Under `[output] on_overflow = "kill"` the first byte past the cap stops the run.
#[tokio::test(flavor = "multi_thread")]
async fn a_kill_on_overflow_profile_stops_the_run_at_the_cap() {
    let profile = format!(
        "{}\n[output]\non_overflow = \"kill\"\n",
        shipped_profile("python")
    );
    let profiles = profiles_with(&[("python-kill", profile)]);
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_PROFILES_DIR".into(), profiles.path().display().to_string())],
        config: Some("[commands.python3]\naction_types = [\"python\"]\ncapabilities = [\"PythonExecute\"]\nprofile = \"python-kill\"\n".into()),
        ..Default::default()
    });
    let cap = 1usize << 20;
    for (i, both) in [false, true].into_iter().enumerate() {
        let m = marker();
        let r = py(&d, &m, &flood_then_exit(both), 60).await;
        let brief = r.text.chars().take(300).collect::<String>();
        assert_eq!(r.status, 200, "run {i}: {brief}");
        assert_eq!(
            r.json["killed_reason"],
            json!("output_limit"),
            "run {i}: {brief}"
        );
        assert_eq!(r.json["success"], json!(false), "run {i}");
        assert!(
            r.json["stdout_truncated"] == json!(true) || r.json["stderr_truncated"] == json!(true),
            "run {i}"
        );
        assert!(stdout(&r).len() <= cap, "run {i}");
        assert!(
            !r.json["stderr"]
                .as_str()
                .unwrap_or_default()
                .contains("flood over"),
            "run {i}: stopped at the cap, not at its end"
        );
        assert_run_left_nothing(&d, &r, &m);
    }
    assert_healthy(&d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn timeout_kills_a_sigterm_ignoring_process_and_its_setsid_grandchild() {
    let d = Daemon::start();
    let m = marker();
    let body = r#"
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print("grandchild-up", flush=True)
        os.write(w, b"x")
        while True:
            time.sleep(1)
    os._exit(0)
os.read(r, 1)
print("partial-output", flush=True)
while True:
    time.sleep(1)
"#;
    let r = py(&d, &m, body, 2).await;
    assert_eq!(r.status, 408, "{}", r.text);
    assert_eq!(
        r.json["error_type"],
        json!("ExecutionTimeout"),
        "{}",
        r.text
    );
    assert_eq!(r.json["killed_reason"], json!("timeout"), "{}", r.text);
    assert_eq!(r.json["outcome"], json!("timeout"), "{}", r.text);
    let out = stdout(&r);
    assert!(
        out.contains("grandchild-up") && out.contains("partial-output"),
        "partial stdout missing: {}",
        r.text
    );
    // From the host: neither the parent nor the detached grandchild survived, nor the cgroup.
    assert_run_left_nothing(&d, &r, &m);
    assert_healthy(&d).await;
}

// -------------------------------------------------------------------------------------------------
// Fail closed, and cleanup after every kind of run

#[tokio::test(flavor = "multi_thread")]
async fn a_profile_requiring_an_absent_mechanism_is_503_sandbox_unavailable() {
    let needs = format!(
        "{}\n[requires]\nlandlock_abi = 99\n",
        shipped_profile("shell-readonly")
    );
    let profiles = profiles_with(&[("needs-abi-99", needs)]);
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_PROFILES_DIR".into(), profiles.path().display().to_string())],
        config: Some("[commands.echo]\naction_types = [\"shell\"]\ncapabilities = [\"ShellExecute\"]\nprofile = \"needs-abi-99\"\n".into()),
        ..Default::default()
    });
    let m = marker();
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": [&m]}))
        .await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json["success"], json!(false), "{}", r.text);
    assert_eq!(
        r.json["error_type"],
        json!("SandboxUnavailable"),
        "{}",
        r.text
    );
    let err = r.json["error"].as_str().unwrap_or_default();
    assert!(err.contains("Landlock") && err.contains("99"), "{err}");
    // Nothing ran: no output, no process, no cgroup.
    assert!(!r.text.contains(&format!("{m}\\n")), "{}", r.text);
    assert_run_left_nothing(&d, &r, &m);
    // It was admitted, so it is audited: a start line and its error line, paired by exec_id,
    // and counted.
    let lines = d.audit_lines();
    let start = lines
        .iter()
        .find(|l| l["event"] == json!("execution_start") && l["args"] == json!([&m]))
        .unwrap_or_else(|| panic!("no execution_start line: {lines:?}"));
    let ends: Vec<&Value> = lines
        .iter()
        .filter(|l| l["exec_id"] == start["exec_id"] && l["event"] != json!("execution_start"))
        .collect();
    assert_eq!(ends.len(), 1, "{lines:?}");
    assert_eq!(ends[0]["event"], json!("execution_error"), "{lines:?}");
    assert_eq!(
        ends[0]["error_type"],
        json!("SandboxUnavailable"),
        "{lines:?}"
    );
    assert!(
        ends[0]["error"].as_str().is_some_and(|e| e.contains("99")),
        "{lines:?}"
    );
    let metrics = d.get("/metrics").await.text;
    assert!(
        metrics.lines().any(|l| l
            == "executor_backend_executions_total{backend=\"local\",outcome=\"error\",profile=\"needs-abi-99\"} 1"),
        "{metrics}"
    );
    let out = common::audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_healthy(&d).await;
}

/// Every way a run can end leaves no cgroup and no process behind, checked after each request.
#[tokio::test(flavor = "multi_thread")]
async fn every_run_leaves_no_cgroup_and_no_process() {
    let d = Daemon::start();
    let runs: Vec<(&str, Value)> = vec![
        (
            "echo",
            json!({"action_type": "shell", "command": "echo", "args": ["@M@"]}),
        ),
        (
            "cat of a missing file",
            json!({"action_type": "shell", "command": "cat", "args": ["/nonexistent/@M@"]}),
        ),
        (
            "grep on stdin",
            json!({"action_type": "shell", "command": "grep", "args": ["-c", "x", "-", "@M@"], "stdin": "x\ny\nx\n"}),
        ),
        (
            "python exit 1",
            json!({"action_type": "python", "command": "python3", "args": ["-c", "# @M@\nimport sys; sys.exit(1)"]}),
        ),
        (
            "python leaves a detached child running at exit",
            json!({"action_type": "python", "command": "python3", "args": ["-c", "# @M@\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\nprint('parent done')"]}),
        ),
        (
            "python aborts (SIGABRT)",
            json!({"action_type": "python", "command": "python3", "args": ["-c", "# @M@\nimport os; os.abort()"]}),
        ),
        (
            "python ignores stdin (broken pipe)",
            json!({"action_type": "python", "command": "python3", "args": ["-c", "# @M@\nimport os; os.close(0)"], "stdin": "x".repeat(256 << 10)}),
        ),
        (
            "python sleeps past the timeout",
            json!({"action_type": "python", "command": "python3", "args": ["-c", "# @M@\nimport time; time.sleep(60)"], "timeout_seconds": 1}),
        ),
    ];
    for (what, mut body) in runs {
        let m = marker();
        body["args"] =
            serde_json::from_str(&body["args"].to_string().replace("@M@", &m)).expect("args");
        let r = d.exec(body).await;
        assert!(r.status == 200 || r.status == 408, "{what}: {}", r.text);
        assert!(
            r.json["exec_id"]
                .as_str()
                .is_some_and(|s| s.starts_with("exec-")),
            "{what}: {}",
            r.text
        );
        assert_run_left_nothing(&d, &r, &m);
    }
    assert_healthy(&d).await;
}

/// The `warm-*` slot directories (cgroup + waiting shim) of a daemon, per hierarchy.
fn warm_slots(daemon_pid: i32) -> Vec<PathBuf> {
    owner_dirs(daemon_pid)
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten())
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("warm-"))
        })
        .collect()
}

/// Prepared run slots and on-demand run cgroups both leave nothing: with `warm_slots = 2` the
/// daemon keeps two slots, each holding one waiting process; with `0` it keeps none and runs
/// still work. A clean stop removes the slots, their processes and the owner directories.
#[tokio::test(flavor = "multi_thread")]
async fn prepared_slots_and_on_demand_runs_leave_nothing_at_exit() {
    for slots in [2usize, 0] {
        let mut d = Daemon::start_with(Opts {
            config: Some(format!("[sandbox.local]\nwarm_slots = {slots}\n")),
            ..Default::default()
        });
        let m = marker();
        let r = d
            .exec(json!({"action_type": "shell", "command": "echo", "args": [&m]}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(stdout(&r), format!("{m}\n"));
        assert_run_left_nothing(&d, &r, &m);
        let dirs = owner_dirs(d.pid());
        let hierarchies = dirs.len();
        // Slots are prepared in the background: wait (bounded) until they are all there, each
        // with its process joined (a slot's cgroup exists a moment before its process is in it).
        let joined = |w: &PathBuf| {
            std::fs::read_to_string(w.join("cgroup.procs")).is_ok_and(|p| !p.trim().is_empty())
        };
        let warm = wait_for(
            &format!("{slots} prepared slots in each of {hierarchies} hierarchies, each joined"),
            CLEANUP,
            || warm_slots(d.pid()),
            |warm| warm.len() == slots * hierarchies && warm.iter().all(joined),
        );
        let mut waiting = BTreeSet::new();
        for w in &warm {
            let procs = std::fs::read_to_string(w.join("cgroup.procs")).expect("procs");
            let pids: Vec<i32> = procs.lines().filter_map(|l| l.parse().ok()).collect();
            assert_eq!(
                pids.len(),
                1,
                "one waiting process per slot: {w:?} {pids:?}"
            );
            waiting.extend(pids);
        }
        assert_eq!(waiting.len(), slots, "{waiting:?}");
        assert_eq!(d.stop(), Some(0));
        for dir in &dirs {
            assert!(!dir.exists(), "{} left after exit", dir.display());
        }
        // Killed by the daemon on its way out; a zombie it did not live to reap is reaped by
        // init in its own time. A slot's process otherwise waits forever.
        wait_for(
            "the slot processes gone with the daemon",
            CLEANUP,
            || {
                waiting
                    .iter()
                    .filter(|pid| Path::new(&format!("/proc/{pid}")).exists())
                    .collect::<Vec<_>>()
            },
            Vec::is_empty,
        );
    }
}
