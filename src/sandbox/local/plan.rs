//! A run's plan: everything the sandbox's processes need, resolved from a [`RunSpec`] before
//! anything is cloned — the minimal root (its mounts, and the Landlock rules for host paths and
//! for mounts made inside), argv and environment, rlimits, identity, the seccomp program and the
//! descriptors the child inherits, gathered in a [`ChildPlan`] that `child.rs` carries out.
//! Must not: change anything on the host (it only reads what the profile's paths are).

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use super::child::{self, ChildPlan, LandlockRule, MountOp};
use super::landlock::{self, AccessFs};
use super::seccomp::SeccompProgram;
use crate::sandbox::{RunSpec, SandboxError};

/// The minimal root of a run: its mounts and Landlock rules, under `root_dir` (the empty host
/// directory the run's root tmpfs is mounted on).
pub(super) fn layout(
    root_dir: &Path,
    landlock_abi: u32,
    spec: &RunSpec,
) -> Result<PlanBuilder, SandboxError> {
    let handled = landlock::handled_fs(landlock_abi);
    let mut b = PlanBuilder::new(root_dir, handled);
    for p in &spec.fs.read_only {
        b.read_only(p)?;
    }
    b.scratch(
        &spec.fs.workdir,
        spec.fs.workspace.as_deref(),
        spec.limits.disk_bytes,
        spec.uid,
        spec.gid,
    )?;
    // After the tmpfs mounts: a file under /tmp or the workdir would otherwise be hidden by them.
    for (src, dst) in &spec.fs.extra_files {
        b.extra_file(src, dst)?;
    }
    b.proc()?;
    b.dev(spec.fs.pty)?;
    b.rules.push(LandlockRule {
        path: c"/".into(),
        access: (landlock::Fs::from(AccessFs::ReadDir) & handled).bits(),
    });
    Ok(b)
}

/// The child plan of a run laid out as `b`; `seccomp` is the filter its command installs. `join` lists the `cgroup.procs` files the shim
/// joins (none when a prepared shim is in the cgroup already); `stacks` are the children's
/// stacks.
pub(super) fn child_plan(
    spec: &RunSpec,
    b: PlanBuilder,
    join: &[PathBuf],
    stacks: Arc<child::Stacks>,
    fds: PlanFds,
    extra_env: &[(String, String)],
    seccomp: Option<&SeccompProgram>,
) -> Result<ChildPlan, SandboxError> {
    let argv: Vec<CString> = spec
        .argv
        .iter()
        .map(|a| cstr(a))
        .collect::<Result<_, _>>()?;
    let envp: Vec<CString> = spec
        .env
        .iter()
        .filter(|(k, _)| !extra_env.iter().any(|(e, _)| e == *k))
        .chain(extra_env.iter().map(|(k, v)| (k, v)))
        .map(|(k, v)| cstr(&format!("{k}={v}")))
        .collect::<Result<_, _>>()?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|c| c.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|c| c.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let program = argv
        .first()
        .cloned()
        .ok_or_else(|| SandboxError::Setup("empty argv".into()))?;

    Ok(ChildPlan {
        cgroup_procs: join
            .iter()
            .map(|p| path_cstr(p))
            .collect::<Result<_, _>>()?,
        root: path_cstr(&b.root)?,
        root_options: c"size=1m,nr_inodes=4096,mode=0755".into(),
        mounts: b.ops,
        landlock_fd: fds.landlock,
        landlock_rules: b.rules,
        hostname: c"sandbox".into(),
        workdir: path_cstr(spec.fs.cwd.as_deref().unwrap_or(&spec.fs.workdir))?,
        rlimits: vec![
            (libc::RLIMIT_CORE, 0),
            (libc::RLIMIT_NOFILE, spec.limits.nofile),
            // A session's workspace is a tmpfs of the disk limit: a file past it is ENOSPC
            // there, as the caller expects, not SIGXFSZ one byte before.
            (
                libc::RLIMIT_FSIZE,
                match spec.fs.workspace {
                    Some(_) => spec.limits.disk_bytes.saturating_add(1 << 20),
                    None => spec.limits.disk_bytes,
                },
            ),
            // No RLIMIT_NPROC: it counts every process of the uid on the host, and a uid of
            // the block may be held by a process this run does not know (a leftover of a
            // killed daemon, another user of the range). The run's pids cgroup, joined before
            // anything forks, is the bound.
        ],
        uid: spec.uid,
        gid: spec.gid,
        seccomp: seccomp
            .ok_or_else(|| SandboxError::Unavailable("seccomp filter missing".into()))?
            .fprogs()
            .to_vec(),
        program,
        argv_ptrs,
        envp_ptrs,
        status_fd: fds.status,
        stdio: fds.stdio,
        hello_fd: fds.hello,
        stacks,
        shim_state: Default::default(),
        sync_fd: fds.sync,
        passed_fds: fds.passed(),
        keep_fds: {
            let mut k = fds.passed();
            k.sort_unstable();
            k
        },
        _argv: argv,
        _envp: envp,
    })
}

fn cstr(s: &str) -> Result<CString, SandboxError> {
    CString::new(s).map_err(|_| SandboxError::Setup("NUL byte in argument or environment".into()))
}

fn path_cstr(p: &Path) -> Result<CString, SandboxError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| SandboxError::Setup("NUL byte in path".into()))
}

/// Builds the mount list and Landlock rules of the minimal root: `host_rules` for host inodes
/// the sandbox sees (added to the ruleset before the clone), `rules` for mounts made inside it
/// (added by the child).
pub(super) struct PlanBuilder {
    root: PathBuf,
    handled: landlock::Fs,
    made: BTreeSet<PathBuf>,
    bound: Vec<PathBuf>,
    ops: Vec<MountOp>,
    pub(super) host_rules: Vec<landlock::HostRule>,
    rules: Vec<LandlockRule>,
}

impl PlanBuilder {
    fn new(root: &Path, handled: landlock::Fs) -> Self {
        PlanBuilder {
            root: root.to_path_buf(),
            handled,
            made: BTreeSet::new(),
            bound: Vec::new(),
            ops: Vec::new(),
            host_rules: Vec::new(),
            rules: Vec::new(),
        }
    }

    /// `/a/b` inside the sandbox -> `<root>/a/b`; refuses relative paths and `..`.
    fn inside(&self, p: &Path) -> Result<PathBuf, SandboxError> {
        let mut out = self.root.clone();
        let mut comps = p.components();
        if comps.next() != Some(Component::RootDir) {
            return Err(SandboxError::Setup(format!(
                "sandbox path {} is not absolute",
                p.display()
            )));
        }
        for c in comps {
            match c {
                Component::Normal(n) => out.push(n),
                _ => {
                    return Err(SandboxError::Setup(format!(
                        "sandbox path {} is not normal",
                        p.display()
                    )));
                }
            }
        }
        Ok(out)
    }

    fn mkdirs(&mut self, p: &Path) -> Result<(), SandboxError> {
        let mut cur = PathBuf::from("/");
        for c in p.components().skip(1) {
            cur.push(c);
            if self.made.insert(cur.clone()) {
                let full = self.inside(&cur)?;
                self.ops.push(MountOp::Mkdir(path_cstr(&full)?));
            }
        }
        Ok(())
    }

    fn covered(&self, p: &Path) -> bool {
        self.bound.iter().any(|b| p.starts_with(b))
    }

    /// The part of `access` the ruleset handles (directory rights dropped for a file).
    fn handled(&self, access: landlock::Fs, is_file: bool) -> landlock::Fs {
        let mask = if is_file {
            landlock::file_rights()
        } else {
            landlock::Fs::all()
        };
        access & self.handled & mask
    }

    /// A rule for `host`, a host path the sandbox sees through a bind mount.
    fn host_rule(&mut self, host: &Path, access: landlock::Fs, is_file: bool) {
        let access = self.handled(access, is_file);
        if !access.is_empty() {
            self.host_rules.push(landlock::HostRule {
                path: host.to_path_buf(),
                access,
            });
        }
    }

    /// A rule for `p` inside the sandbox, a mount made there.
    fn rule(&mut self, p: &Path, access: landlock::Fs) -> Result<(), SandboxError> {
        let access = self.handled(access, false);
        if !access.is_empty() {
            self.rules.push(LandlockRule {
                path: path_cstr(p)?,
                access: access.bits(),
            });
        }
        Ok(())
    }

    fn read_only(&mut self, p: &Path) -> Result<(), SandboxError> {
        if self.covered(p) {
            return Ok(());
        }
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            return Ok(()); // a profile path this host does not have
        };
        if let Some(parent) = p.parent() {
            self.mkdirs(parent)?;
        }
        let dst = path_cstr(&self.inside(p)?)?;
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(p)?;
            self.made.insert(p.to_path_buf());
            self.ops.push(MountOp::Symlink {
                target: path_cstr(&target)?,
                link: dst,
            });
            return Ok(());
        }
        if meta.is_dir() {
            self.made.insert(p.to_path_buf());
            self.ops.push(MountOp::Mkdir(dst.clone()));
        } else {
            self.ops.push(MountOp::TouchFile(dst.clone()));
        }
        self.host_rule(p, landlock::read_only(), !meta.is_dir());
        self.ops.push(MountOp::BindReadOnly {
            src: path_cstr(p)?,
            dst,
        });
        self.bound.push(p.to_path_buf());
        Ok(())
    }

    fn extra_file(&mut self, src: &Path, dst: &Path) -> Result<(), SandboxError> {
        if self.covered(dst) {
            // Already visible through a read-only path of the profile.
            return Ok(());
        }
        if let Some(parent) = dst.parent() {
            self.mkdirs(parent)?;
        }
        let inside = path_cstr(&self.inside(dst)?)?;
        self.ops.push(MountOp::TouchFile(inside.clone()));
        self.ops.push(MountOp::BindReadOnly {
            src: path_cstr(src)?,
            dst: inside,
        });
        self.host_rule(src, AccessFs::ReadFile | AccessFs::Execute, true);
        Ok(())
    }

    /// The writable space of the run: ONE tmpfs of `disk` bytes whose `tmp` and `work` subdirs
    /// are bound at /tmp and the workdir, so the disk limit covers both together (two tmpfs of
    /// `disk` bytes each would let a run write twice its limit). The tmpfs is mounted at a staging
    /// directory of the new root and detached again once both binds hold it. A session's
    /// `workspace` (a host directory with a tmpfs of its own) is bound at the workdir instead.
    fn scratch(
        &mut self,
        workdir: &Path,
        workspace: Option<&Path>,
        disk: u64,
        uid: u32,
        gid: u32,
    ) -> Result<(), SandboxError> {
        let stage = self.root.join(".executor-arm-scratch");
        let stage_c = path_cstr(&stage)?;
        self.ops.push(MountOp::Mkdir(stage_c.clone()));
        let options = cstr(&format!("size={disk},nr_inodes=16384,mode=0700"))?;
        self.ops.push(MountOp::Tmpfs {
            dst: stage_c.clone(),
            options,
            noexec: true,
        });
        // /tmp first: a workdir below /tmp then gets its mount point inside the bound /tmp.
        let tmp = Path::new("/tmp");
        if workdir != tmp {
            self.bind_scratch(&stage.join("tmp"), tmp, 0o1777, 0, 0)?;
        }
        match workspace {
            Some(host) => {
                self.mkdirs(workdir)?;
                let dst = path_cstr(&self.inside(workdir)?)?;
                let src = path_cstr(host)?;
                self.ops.push(MountOp::BindWritable { src, dst });
                self.host_rule(host, landlock::Fs::all(), false);
            }
            None => self.bind_scratch(&stage.join("work"), workdir, 0o700, uid, gid)?,
        }
        self.ops.push(MountOp::Detach(stage_c));
        Ok(())
    }

    fn bind_scratch(
        &mut self,
        src: &Path,
        p: &Path,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<(), SandboxError> {
        let src = path_cstr(src)?;
        self.ops.push(MountOp::MkdirOwned {
            path: src.clone(),
            mode,
            uid,
            gid,
        });
        self.mkdirs(p)?;
        let dst = path_cstr(&self.inside(p)?)?;
        self.ops.push(MountOp::BindWritable { src, dst });
        self.rule(p, landlock::Fs::all())
    }

    fn proc(&mut self) -> Result<(), SandboxError> {
        let p = Path::new("/proc");
        self.mkdirs(p)?;
        self.ops.push(MountOp::Proc(path_cstr(&self.inside(p)?)?));
        self.rule(p, AccessFs::ReadFile | AccessFs::ReadDir)
    }

    /// /dev: the harmless host devices bound in, the descriptor links, and for a terminal
    /// (`pty`) a devpts instance of the run's own with /dev/ptmx pointing into it, which
    /// Landlock lets the run read, write and ioctl (nothing else of /dev is writable).
    fn dev(&mut self, pty: bool) -> Result<(), SandboxError> {
        self.mkdirs(Path::new("/dev"))?;
        for name in ["null", "zero", "random", "urandom"] {
            let p = PathBuf::from("/dev").join(name);
            let dst = path_cstr(&self.inside(&p)?)?;
            self.ops.push(MountOp::TouchFile(dst.clone()));
            self.ops.push(MountOp::BindDevice {
                src: path_cstr(&p)?,
                dst,
            });
            let rw =
                AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate | AccessFs::IoctlDev;
            self.host_rule(&p, rw, true);
        }
        for (name, target) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ] {
            let link = path_cstr(&self.inside(&Path::new("/dev").join(name))?)?;
            self.ops.push(MountOp::Symlink {
                target: cstr(target)?,
                link,
            });
        }
        if pty {
            let pts = Path::new("/dev/pts");
            self.mkdirs(pts)?;
            self.ops
                .push(MountOp::Devpts(path_cstr(&self.inside(pts)?)?));
            self.ops.push(MountOp::Symlink {
                target: c"pts/ptmx".into(),
                link: path_cstr(&self.inside(Path::new("/dev/ptmx"))?)?,
            });
            self.rule(
                pts,
                AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::IoctlDev | AccessFs::ReadDir,
            )?;
        }
        Ok(())
    }
}

/// Descriptors the child inherits (-1: none).
pub(super) struct PlanFds {
    pub(super) status: i32,
    pub(super) landlock: i32,
    pub(super) sync: i32,
    pub(super) hello: i32,
    pub(super) stdio: [i32; 3],
}

impl PlanFds {
    fn passed(&self) -> Vec<i32> {
        child::passed_fds(
            self.status,
            self.stdio,
            self.landlock,
            self.sync,
            self.hello,
        )
    }
}
