//! From a [`RunSpec`] to the container that runs it: hardening, limits, mounts, labels.
//!
//! Owns: the exact `docker create` body of a sandbox and the pool key (everything in the body that
//! a request can change). Must not: talk to the engine. Pure, so unit-tested field by field.
//!
//! Identity: the container's main process is the supervisor, as root with only CAP_SETUID and
//! CAP_SETGID (for the switch to the command's uid/gid, which it does before `execve`) under
//! `no-new-privileges` and the shared seccomp profile ([`super::seccomp`]); the command itself
//! runs with no capability. See [`super::supervisor`] for why the two must differ. The command's
//! uid is the container's own host uid, leased when the container is made (see
//! [`crate::sandbox::uids`]), not the profile's: it is given to [`ContainerPlan::body`], so it is
//! no part of the plan or its pool key. The gid stays the profile's.
//!
//! Disk: the workdir and /tmp are ONE tmpfs of `disk` bytes, so the limit holds for the two
//! together. Docker's per-path tmpfs mounts cannot share a size, so each container gets a named
//! volume of the `local` driver with tmpfs options (`executor-arm-disk-<uuid>`), mounted at both
//! paths: they show the same files. dockerd creates it with the container (the mounts carry the
//! driver options, so it can only ever be a tmpfs of that size) and unmounts it when the
//! container stops, even when its daemon is gone; the janitor removes it after the container.
//! This needs nothing of the daemon but the engine API (no host mount, no shared mount
//! namespace), so it works for a daemon that is an unprivileged client of a dockerd sidecar.
//! Under gVisor the volume is a host bind mount, on which the sandbox does not enforce `noexec`.

use std::collections::HashMap;
use std::path::{Component, Path};

use super::egress::CONTAINER_DIR;

use bollard::models::{
    ContainerCreateBody, HostConfig, HostConfigLogConfig, Mount, MountType, MountVolumeOptions,
    MountVolumeOptionsDriverConfig, ResourcesUlimits,
};
use sha2::{Digest, Sha256};

use super::super::{BackendKind, NetworkPolicy, RunSpec, SandboxError};
use super::labels::{Owner, labels};
use super::{seccomp, supervisor};

/// Files and directories a session container's workspace may hold (its tmpfs's inode limit, as
/// on the local backend).
pub const KEPT_INODES: u64 = 16384;

/// Size of a session container's code tmpfs: the largest exec body the API takes, with room.
const CODE_TMPFS_BYTES: u64 = 16 << 20;

/// Name prefix of the per-container disk volumes.
pub const DISK_VOLUME_PREFIX: &str = "executor-arm-disk-";

/// The OCI runtime of a backend, as registered in dockerd.
pub fn runtime_of(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Gvisor => "runsc",
        BackendKind::Docker | BackendKind::Local => "runc",
    }
}

/// Everything that decides a sandbox container, minus its identity (name, exec_id label).
#[derive(Debug, Clone)]
pub struct ContainerPlan {
    pub kind: BackendKind,
    pub profile: String,
    pub image: String,
    /// Outbound network through the daemon's proxy: each container gets its own socket
    /// directory, bind-mounted read-only at [`CONTAINER_DIR`] (added by [`ContainerPlan::body`]).
    pub egress: bool,
    /// Without the entrypoint, which carries the container's own uid (see [`ContainerPlan::body`]).
    body: ContainerCreateBody,
    /// The supervisor's arguments other than the uid.
    gid: u32,
    workdir: String,
    kept: bool,
    address_space: Option<u64>,
    /// Size of the disk volume, in bytes.
    disk: u64,
    /// Where the disk volume is mounted: the workdir, and /tmp unless that is the workdir.
    disk_targets: Vec<String>,
    /// Hash of `profile`, `egress`, `body` and the disk volume with everything but the uid:
    /// equal keys are interchangeable warm containers (each gets its own uid when launched).
    pub key: String,
}

/// The `local` volume driver's options of a disk volume: a tmpfs of `disk` bytes owned by the
/// command's `uid`/`gid`. noexec: the workdir is for data; programs come from the read-only image.
fn disk_options(disk: u64, kept: bool, uid: u32, gid: u32) -> HashMap<String, String> {
    HashMap::from([
        ("type".to_string(), "tmpfs".to_string()),
        ("device".to_string(), "tmpfs".to_string()),
        (
            "o".to_string(),
            format!(
                "size={disk},{}uid={uid},gid={gid},mode=0700,noexec,nosuid,nodev",
                // A session's workspace lives long and is listed whole: bound its entries.
                if kept {
                    format!("nr_inodes={KEPT_INODES},")
                } else {
                    String::new()
                },
            ),
        ),
    ])
}

/// A sandbox path: absolute, no `..`, no `.`, valid in a mount spec.
fn sandbox_path(p: &Path, what: &str) -> Result<String, SandboxError> {
    let s = p
        .to_str()
        .ok_or_else(|| SandboxError::Setup(format!("{what} {} is not UTF-8", p.display())))?;
    let mut comps = p.components();
    let ok = comps.next() == Some(Component::RootDir)
        && comps.all(|c| matches!(c, Component::Normal(_)))
        && s != "/";
    if !ok || s.contains(',') || s.contains(':') {
        return Err(SandboxError::Setup(format!(
            "{what} {s} must be an absolute normal path without ',' or ':'"
        )));
    }
    Ok(s.to_string())
}

/// The supervisor's capabilities: the switch to the command's uid/gid; a kept container's also
/// to kill every process of an exec itself (the command, another uid, cannot stop it); with raw
/// TCP rules also CAP_NET_ADMIN to make the rules' ranges local in the container's own network
/// namespace, and CAP_SETPCAP to drop both from its bounding set right after, before any
/// command runs (see the supervisor's `tcp` module).
fn cap_add(kept: bool, tcp: bool) -> Vec<String> {
    let mut caps = vec!["SETUID", "SETGID"];
    if kept {
        caps.push("KILL");
    }
    if tcp {
        caps.extend(["NET_ADMIN", "SETPCAP"]);
    }
    caps.into_iter().map(str::to_string).collect()
}

impl ContainerPlan {
    /// Refuses what the container backends cannot honour. The network stays `none` with egress
    /// too: the only way out is the proxy's socket (see [`super::egress`]).
    ///
    /// `kept`: the container of a session, whose supervisor serves one exec after another and
    /// writes each exec's code to a root-owned tmpfs at [`supervisor::CODE_DIR`]; with egress it
    /// has its socket directory for its whole life, and each exec its own proxy listener there.
    pub fn new(
        spec: &RunSpec,
        kind: BackendKind,
        default_image: &str,
        kept: bool,
    ) -> Result<ContainerPlan, SandboxError> {
        let egress = matches!(spec.network, NetworkPolicy::Egress { .. });
        let tcp = !spec.network.tcp_rules().is_empty();
        if tcp && kind == BackendKind::Gvisor {
            // The policy refuses these before a backend is chosen; this is the backend's own
            // guard: gVisor's netstack is not the kernel's.
            return Err(SandboxError::Setup(
                "raw TCP rules are not offered on gvisor sandboxes".into(),
            ));
        }
        if spec.uid == 0 || spec.gid == 0 {
            return Err(SandboxError::Setup("a sandbox never runs as root".into()));
        }
        let l = &spec.limits;
        let workdir = sandbox_path(&spec.fs.workdir, "workdir")?;
        let image = spec
            .image
            .clone()
            .unwrap_or_else(|| default_image.to_string());
        let disk = l.disk_bytes.max(1 << 20);
        let memory = i64::try_from(l.memory_bytes)
            .map_err(|_| SandboxError::Setup("memory limit out of range".into()))?;
        let nofile = i64::try_from(l.nofile).unwrap_or(i64::MAX);
        let pids = i64::try_from(l.pids).unwrap_or(i64::MAX);
        let mut ulimits = vec![
            ResourcesUlimits {
                name: Some("nofile".into()),
                soft: Some(nofile),
                hard: Some(nofile),
            },
            ResourcesUlimits {
                name: Some("core".into()),
                soft: Some(0),
                hard: Some(0),
            },
        ];
        // runc: the container's pids cgroup is the limit. gVisor: that cgroup holds the sentry's
        // own host threads too (about 6 per guest task with the ptrace platform, and the sentry
        // dies when it cannot make one), so it is only a generous backstop there; the limit is
        // RLIMIT_NPROC, which the sentry enforces per sandbox (its own kernel: the uid has no
        // other tasks). Under runc RLIMIT_NPROC would count the uid's tasks on the whole host.
        let pids_cgroup = match kind {
            BackendKind::Gvisor => {
                // The command's uid only: the supervisor (root) is the limit's one other process,
                // as it is in the runc cgroup's.
                let nproc = pids.saturating_sub(1).max(1);
                ulimits.push(ResourcesUlimits {
                    name: Some("nproc".into()),
                    soft: Some(nproc),
                    hard: Some(nproc),
                });
                pids.saturating_mul(16).saturating_add(256)
            }
            BackendKind::Docker | BackendKind::Local => pids,
        };
        let mut disk_targets = vec![workdir.clone()];
        if workdir != "/tmp" {
            disk_targets.push("/tmp".to_string());
        }
        let mut mounts = Vec::new();
        for (src, dst) in &spec.fs.extra_files {
            if !src.is_absolute() {
                return Err(SandboxError::Setup(format!(
                    "extra file {} is not an absolute host path",
                    src.display()
                )));
            }
            mounts.push(Mount {
                source: Some(src.to_string_lossy().into_owned()),
                target: Some(sandbox_path(dst, "extra file target")?),
                typ: Some(MountType::BIND),
                read_only: Some(true),
                ..Default::default()
            });
        }
        let host_config = HostConfig {
            runtime: Some(runtime_of(kind).to_string()),
            network_mode: Some("none".to_string()),
            readonly_rootfs: Some(true),
            cap_drop: Some(vec!["ALL".to_string()]),
            // The supervisor's, for the switch to the command's uid/gid; a kept container's also
            // to kill every process of an exec itself (the command, another uid, cannot stop it).
            cap_add: Some(cap_add(kept, tcp)),
            security_opt: Some(vec![
                "no-new-privileges:true".to_string(),
                seccomp::security_opt(kind),
            ]),
            memory: Some(memory),
            // No swap beyond the memory limit: memory_swap is memory + swap.
            memory_swap: Some(memory),
            nano_cpus: Some((l.cpus * 1e9).round() as i64),
            pids_limit: Some(pids_cgroup),
            ulimits: Some(ulimits),
            mounts: if mounts.is_empty() {
                None
            } else {
                Some(mounts)
            },
            // The supervisor is PID 1 and reaps orphans itself; an init in front of it would
            // only add a process, and its exit would hide the supervisor's.
            init: Some(false),
            // A session's container runs one exec after another: no SysV IPC object or POSIX
            // message queue (state outside the workspace that killing an exec's processes leaves
            // behind) can be made in it. runsc accepts these and ignores them.
            sysctls: kept.then(|| {
                HashMap::from([
                    ("kernel.shmmni".to_string(), "0".to_string()),
                    ("kernel.msgmni".to_string(), "0".to_string()),
                    ("kernel.sem".to_string(), "0 0 0 0".to_string()),
                    ("fs.mqueue.queues_max".to_string(), "0".to_string()),
                ])
            }),
            // A session's code files: root's, read-only to the command, counted in its memory.
            tmpfs: kept.then(|| {
                HashMap::from([(
                    supervisor::CODE_DIR.to_string(),
                    format!("size={CODE_TMPFS_BYTES},mode=0755,noexec,nosuid,nodev"),
                )])
            }),
            // Private IPC namespace without /dev/shm, like the local backend's /dev.
            ipc_mode: Some("none".to_string()),
            // Output goes to the attach stream only; a log driver would copy every byte to disk.
            log_config: Some(HostConfigLogConfig {
                typ: Some("none".into()),
                config: None,
            }),
            auto_remove: Some(false),
            privileged: Some(false),
            ..Default::default()
        };
        let address_space = command_address_space(kind, l.memory_bytes, kept);
        let mut body = ContainerCreateBody {
            image: Some(image.clone()),
            // The supervisor; it runs the command as the container's uid and the profile's gid
            // in the workdir (the entrypoint, see [`ContainerPlan::body`]).
            user: Some("0:0".into()),
            working_dir: Some("/".into()),
            hostname: Some("sandbox".into()),
            entrypoint: None,
            cmd: None,
            // The supervisor needs none of it, and the command gets exactly RunSpec::env.
            env: None,
            // stdin stays open for the supervisor's request; StdinOnce closes it when our attach
            // connection goes away, so an idle container of a crashed daemon ends by itself.
            open_stdin: Some(true),
            stdin_once: Some(true),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            network_disabled: Some(true),
            host_config: Some(host_config),
            ..Default::default()
        };
        // The key: the body as every container of the plan gets it, with uid 0 standing for its
        // own (never a sandbox's uid).
        let mut h = Sha256::new();
        h.update(spec.profile.as_bytes());
        h.update([0, u8::from(egress)]);
        body.entrypoint = Some(supervisor::entrypoint(
            0,
            spec.gid,
            &workdir,
            kept,
            address_space,
        ));
        let value =
            serde_json::to_value((&body, &disk_targets, &disk_options(disk, kept, 0, spec.gid)))
                .map_err(|e| SandboxError::Setup(format!("container body: {e}")))?;
        canonical(&value, &mut h);
        let key = hex::encode(&h.finalize()[..12]);
        body.entrypoint = None;
        Ok(ContainerPlan {
            kind,
            profile: spec.profile.clone(),
            image,
            egress,
            body,
            // The profile's gid, kept with a uid of the container's own, as on the local
            // backend: the kernel counters a shared id exhausts (inotify, pipe buffers) are
            // counted per uid, and files the profile opens to its group (an executor's program,
            // mode 0750 root:<gid>) stay readable to it.
            gid: spec.gid,
            workdir,
            kept,
            address_space,
            disk,
            disk_targets,
            key,
        })
    }

    /// The plan with the supervisor binary at `host` (a static executable, see
    /// [`supervisor::check_binary`]) bind-mounted read-only at [`supervisor::CONTAINER_PATH`],
    /// the entrypoint. One daemon mounts the same file into all its containers, so it is not
    /// part of the pool key.
    pub fn with_supervisor(mut self, host: &Path) -> ContainerPlan {
        if let Some(hc) = self.body.host_config.as_mut() {
            hc.mounts.get_or_insert_with(Vec::new).push(Mount {
                source: Some(host.to_string_lossy().into_owned()),
                target: Some(supervisor::CONTAINER_PATH.to_string()),
                typ: Some(MountType::BIND),
                read_only: Some(true),
                ..Default::default()
            });
        }
        self
    }

    /// The command of a background run in a kept container of this plan running as `uid`
    /// ([`supervisor::spawn_command`]).
    pub fn spawn_command(&self, uid: u32) -> Vec<String> {
        supervisor::spawn_command(uid, self.gid, &self.workdir, self.address_space)
    }

    /// The command that connects to a port of a kept container of this plan running as `uid`
    /// ([`supervisor::connect_command`]).
    pub fn connect_command(&self, uid: u32) -> Vec<String> {
        supervisor::connect_command(uid, self.gid, &self.workdir)
    }

    /// The create body for one container of this plan: `uid` is its own host uid (a lease the
    /// container's life long, never 0), which the command runs as and owns the disk volume;
    /// `disk_volume` is its own disk volume (created by dockerd with the container),
    /// `egress_dir` its own socket directory (egress plans only).
    pub fn body(
        &self,
        owner: &Owner,
        exec_label: &str,
        disk_volume: &str,
        uid: u32,
        egress_dir: Option<&Path>,
    ) -> ContainerCreateBody {
        let mut body = self.body.clone();
        body.entrypoint = Some(supervisor::entrypoint(
            uid,
            self.gid,
            &self.workdir,
            self.kept,
            self.address_space,
        ));
        let disk_options = disk_options(self.disk, self.kept, uid, self.gid);
        let labels = labels(owner, exec_label, self.kind);
        if let Some(hc) = body.host_config.as_mut() {
            let mounts = hc.mounts.get_or_insert_with(Vec::new);
            for target in &self.disk_targets {
                mounts.push(Mount {
                    source: Some(disk_volume.to_string()),
                    target: Some(target.clone()),
                    typ: Some(MountType::VOLUME),
                    read_only: Some(false),
                    volume_options: Some(MountVolumeOptions {
                        // Nothing of the image's directory is copied in.
                        no_copy: Some(true),
                        labels: Some(labels.clone()),
                        driver_config: Some(MountVolumeOptionsDriverConfig {
                            name: Some("local".into()),
                            options: Some(disk_options.clone()),
                        }),
                        subpath: None,
                    }),
                    ..Default::default()
                });
            }
            if let (true, Some(dir)) = (self.egress, egress_dir) {
                // Read-only: the container connects to the socket but cannot create anything on
                // the host through this mount.
                mounts.push(Mount {
                    source: Some(dir.to_string_lossy().into_owned()),
                    target: Some(CONTAINER_DIR.to_string()),
                    typ: Some(MountType::BIND),
                    read_only: Some(true),
                    ..Default::default()
                });
            }
        }
        body.labels = Some(labels);
        body
    }
}

/// The RLIMIT_AS each command process of a session's container starts with. gVisor only: the
/// container's memory cgroup holds the sentry as well as the command, and a command that fills it
/// gets the sentry killed, which ends the whole sandbox and the session with it. Three quarters
/// of the memory limit leaves the sentry its headroom (measured under runsc at 512 MiB: a 2 GiB
/// `bytearray` is refused, filling memory 8 MiB at a time stops near 360 MiB with a 100 MiB file
/// in the workdir, and the sandbox lives on). A one-run container (`/execute`) gets none: its
/// sandbox ends with its run anyway, and the cgroup's OOM kill is what the run then reports
/// (`oom`, `killed_reason: oom`), where an allocation refused inside would look like any failure.
/// runc and local: the cgroup's OOM killer takes the command only, no limit needed. (runsc
/// enforces RLIMIT_AS on mmap and brk; it does not enforce RLIMIT_DATA.)
pub fn command_address_space(kind: BackendKind, memory_bytes: u64, kept: bool) -> Option<u64> {
    match kind {
        BackendKind::Gvisor if kept => Some((memory_bytes / 4).saturating_mul(3).max(16 << 20)),
        BackendKind::Gvisor | BackendKind::Docker | BackendKind::Local => None,
    }
}

/// Feeds `v` to the hasher with object keys sorted (maps in the body are `HashMap`s).
fn canonical(v: &serde_json::Value, h: &mut Sha256) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            h.update(b"{");
            for k in keys {
                h.update(serde_json::to_string(k).unwrap_or_default().as_bytes());
                h.update(b":");
                canonical(&m[k], h);
                h.update(b",");
            }
            h.update(b"}");
        }
        Value::Array(a) => {
            h.update(b"[");
            for x in a {
                canonical(x, h);
                h.update(b",");
            }
            h.update(b"]");
        }
        other => h.update(other.to_string().as_bytes()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sandbox::docker::labels::{LABEL_EXEC_ID, LABEL_MANAGED, LABEL_OWNER};
    use std::path::PathBuf;
    use std::time::Duration;

    pub(crate) fn spec() -> RunSpec {
        RunSpec {
            exec_id: "exec-1".into(),
            landlock_abi: 1,
            profile: "shell-readonly".into(),
            ..crate::sandbox::test_spec(&["/usr/bin/echo", "hi"])
        }
    }

    /// A container's own uid, as a lease from the uid block gives it.
    const UID: u32 = 200_123;

    fn owner() -> Owner {
        Owner {
            instance: "host-1".into(),
            host: "host".into(),
            pid_ns: "pid:[7]".into(),
            pid: 1,
            start_time: 42,
        }
    }

    #[test]
    fn hardening_and_limits_are_all_set() {
        let p = ContainerPlan::new(&spec(), BackendKind::Gvisor, "img:latest", false).unwrap();
        let b = p.body(&owner(), "exec-1", "executor-arm-disk-1", UID, None);
        let h = b.host_config.clone().unwrap();
        assert_eq!(b.image.as_deref(), Some("img:latest"));
        // The supervisor is root; the command gets the container's own uid and the profile's
        // gid from it.
        assert_eq!(b.user.as_deref(), Some("0:0"));
        assert_eq!(b.working_dir.as_deref(), Some("/"));
        let ep = b.entrypoint.clone().unwrap();
        assert_eq!(ep[0], supervisor::CONTAINER_PATH);
        // A one-run gVisor container: no address-space limit, its memory limit ends in the
        // cgroup's OOM kill, reported as such.
        assert_eq!(&ep[1..], ["200123", "65534", "/work", "once", "0"]);
        // A session's: the command's address space stays below the container's memory (the
        // sentry's headroom), so a memory bomb does not end the session.
        let kept = ContainerPlan::new(&spec(), BackendKind::Gvisor, "img:latest", true)
            .unwrap()
            .body(&owner(), "exec-1", "executor-arm-disk-1", UID, None);
        assert_eq!(
            &kept.entrypoint.unwrap()[1..],
            [
                "200123",
                "65534",
                "/work",
                "kept",
                &(384u64 << 20).to_string()
            ]
        );
        assert_eq!(h.runtime.as_deref(), Some("runsc"));
        assert_eq!(h.network_mode.as_deref(), Some("none"));
        assert_eq!(h.readonly_rootfs, Some(true));
        assert_eq!(h.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(
            h.cap_add,
            Some(vec!["SETUID".to_string(), "SETGID".to_string()])
        );
        assert_eq!(
            h.security_opt,
            Some(vec![
                "no-new-privileges:true".to_string(),
                seccomp::security_opt(BackendKind::Gvisor)
            ])
        );
        assert_eq!(h.memory, Some(512 << 20));
        assert_eq!(h.memory_swap, Some(512 << 20));
        assert_eq!(h.nano_cpus, Some(500_000_000));
        // gVisor: RLIMIT_NPROC is the limit, the cgroup a backstop for the sentry's threads.
        assert_eq!(h.pids_limit, Some(64 * 16 + 256));
        let nproc = h
            .ulimits
            .as_ref()
            .unwrap()
            .iter()
            .find(|u| u.name.as_deref() == Some("nproc"))
            .cloned()
            .unwrap();
        assert_eq!(
            (nproc.soft, nproc.hard),
            (Some(63), Some(63)),
            "the supervisor is root"
        );
        assert_eq!(h.privileged, Some(false));
        // One tmpfs volume of the disk limit at the workdir and /tmp, labelled like the container.
        assert!(h.tmpfs.is_none());
        let m = h.mounts.clone().unwrap();
        assert_eq!(m.len(), 2);
        for (mount, target) in m.iter().zip(["/work", "/tmp"]) {
            assert_eq!(mount.target.as_deref(), Some(target));
            assert_eq!(mount.source.as_deref(), Some("executor-arm-disk-1"));
            assert_eq!(mount.typ, Some(MountType::VOLUME));
            let v = mount.volume_options.clone().unwrap();
            assert_eq!(v.no_copy, Some(true));
            assert_eq!(v.labels.as_ref(), b.labels.as_ref());
            let d = v.driver_config.unwrap();
            assert_eq!(d.name.as_deref(), Some("local"));
            let o = d.options.unwrap();
            assert_eq!(
                (o["type"].as_str(), o["device"].as_str()),
                ("tmpfs", "tmpfs")
            );
            assert_eq!(
                o["o"],
                format!(
                    "size={},uid=200123,gid=65534,mode=0700,noexec,nosuid,nodev",
                    100 << 20
                )
            );
        }
        let labels = b.labels.unwrap();
        assert_eq!(labels[LABEL_MANAGED], "true");
        assert_eq!(labels[LABEL_EXEC_ID], "exec-1");
        assert_eq!(labels[LABEL_OWNER], "host/pid:[7]/1/42");
        let runc_body = ContainerPlan::new(&spec(), BackendKind::Docker, "i", false)
            .unwrap()
            .body(&owner(), "x", "v", UID, None);
        // runc: the cgroup's OOM killer takes the command alone; no address-space limit.
        assert_eq!(runc_body.entrypoint.as_ref().unwrap().last().unwrap(), "0");
        let runc = runc_body.host_config.unwrap();
        assert_eq!(runc.runtime.as_deref(), Some("runc"));
        assert_eq!(runc.pids_limit, Some(64));
        assert!(
            runc.ulimits
                .unwrap()
                .iter()
                .all(|u| u.name.as_deref() != Some("nproc")),
            "nproc is host-wide under runc"
        );
    }

    pub(crate) fn egress_spec() -> RunSpec {
        let mut s = spec();
        s.profile = "http-egress".into();
        s.network = NetworkPolicy::Egress {
            allow_hosts: vec!["allowed.test".into()],
            allow_ports: vec![80],
            allow_cidrs: vec![],
            bandwidth_bytes_per_sec: 1 << 20,
            byte_cap: 1 << 20,
            tcp: vec![],
        };
        s
    }

    #[test]
    fn egress_keeps_network_none_and_mounts_only_its_own_directory_read_only() {
        let p = ContainerPlan::new(&egress_spec(), BackendKind::Gvisor, "i", false).unwrap();
        assert!(p.egress);
        let b = p.body(&owner(), "e", "v", UID, Some(Path::new("/run/x/egress/c1")));
        assert_eq!(b.network_disabled, Some(true));
        let h = b.host_config.unwrap();
        assert_eq!(h.network_mode.as_deref(), Some("none"));
        let m = h.mounts.unwrap();
        assert_eq!(m.len(), 3, "the disk volume twice and the egress directory");
        assert_eq!(m[2].source.as_deref(), Some("/run/x/egress/c1"));
        assert_eq!(m[2].target.as_deref(), Some(CONTAINER_DIR));
        assert_eq!(
            (m[2].typ, m[2].read_only),
            (Some(MountType::BIND), Some(true))
        );
        // Without egress no directory is mounted, whatever the caller passes.
        let none = ContainerPlan::new(&spec(), BackendKind::Gvisor, "i", false).unwrap();
        assert!(!none.egress);
        let b = none.body(&owner(), "e", "v", UID, Some(Path::new("/run/x/egress/c1")));
        assert!(
            b.host_config
                .unwrap()
                .mounts
                .unwrap()
                .iter()
                .all(|m| m.typ == Some(MountType::VOLUME))
        );
        // Egress and plain containers are never interchangeable in the pool.
        let mut same_profile = spec();
        same_profile.profile = "http-egress".into();
        let plain = ContainerPlan::new(&same_profile, BackendKind::Gvisor, "i", false).unwrap();
        assert_ne!(plain.key, p.key);
    }

    /// Only a profile with raw TCP rules gives the supervisor CAP_NET_ADMIN (and CAP_SETPCAP to
    /// drop it), on one-run and session containers alike, and such containers pool apart;
    /// gVisor refuses rules.
    #[test]
    fn tcp_rules_add_the_routing_capabilities_on_runc_only() {
        let mut tcp = egress_spec();
        if let NetworkPolicy::Egress { tcp: rules, .. } = &mut tcp.network {
            rules.push("10.20.0.0/16:5432".parse().unwrap());
        }
        let caps = |s: &RunSpec, kept: bool| {
            let p = ContainerPlan::new(s, BackendKind::Docker, "i", kept).unwrap();
            let b = p.body(&owner(), "e", "v", UID, Some(Path::new("/run/x/egress/c1")));
            (p.key, b.host_config.unwrap().cap_add.unwrap())
        };
        let (tcp_key, with) = caps(&tcp, false);
        assert_eq!(with, ["SETUID", "SETGID", "NET_ADMIN", "SETPCAP"]);
        let (plain_key, without) = caps(&egress_spec(), false);
        assert_eq!(without, ["SETUID", "SETGID"]);
        assert_ne!(tcp_key, plain_key, "never interchangeable in the pool");
        let (_, kept) = caps(&tcp, true);
        assert_eq!(kept, ["SETUID", "SETGID", "KILL", "NET_ADMIN", "SETPCAP"]);
        for kept in [false, true] {
            let kind = BackendKind::Gvisor;
            let e = ContainerPlan::new(&tcp, kind, "i", kept)
                .unwrap_err()
                .to_string();
            assert!(e.contains("raw TCP rules are not offered"), "{e}");
        }
    }

    #[test]
    fn root_and_bad_paths_are_refused() {
        let mut s = spec();
        s.uid = 0;
        assert!(ContainerPlan::new(&s, BackendKind::Docker, "i", false).is_err());
        for bad in ["work", "/", "/a/../b", "/a,b", "/a:b"] {
            let mut s = spec();
            s.fs.workdir = PathBuf::from(bad);
            assert!(
                ContainerPlan::new(&s, BackendKind::Docker, "i", false).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn extra_files_are_read_only_binds_and_part_of_the_key() {
        let base = ContainerPlan::new(&spec(), BackendKind::Docker, "i", false).unwrap();
        let mut s = spec();
        s.fs.extra_files = vec![(
            PathBuf::from("/opt/x/run.py"),
            PathBuf::from("/opt/x/run.py"),
        )];
        let p = ContainerPlan::new(&s, BackendKind::Docker, "i", false).unwrap();
        let m = p
            .body(&owner(), "e", "v", UID, None)
            .host_config
            .unwrap()
            .mounts
            .unwrap();
        assert_eq!(m[0].target.as_deref(), Some("/opt/x/run.py"));
        assert_eq!(m[0].read_only, Some(true));
        assert_eq!(m[0].typ, Some(MountType::BIND));
        assert_ne!(p.key, base.key);
    }

    #[test]
    fn key_ignores_per_request_fields_only() {
        let a = ContainerPlan::new(&spec(), BackendKind::Docker, "i", false).unwrap();
        let mut s = spec();
        s.argv = vec!["/usr/bin/ls".into()];
        s.env.insert("LANG".into(), "C".into());
        s.stdin = Some(b"x".to_vec());
        s.limits.timeout = Duration::from_secs(1);
        s.exec_id = "exec-2".into();
        assert_eq!(
            ContainerPlan::new(&s, BackendKind::Docker, "i", false)
                .unwrap()
                .key,
            a.key
        );
        s.limits.disk_bytes = 50 << 20;
        assert_ne!(
            ContainerPlan::new(&s, BackendKind::Docker, "i", false)
                .unwrap()
                .key,
            a.key,
            "the disk volume's size is part of the key"
        );
        s.limits.memory_bytes = 256 << 20;
        assert_ne!(
            ContainerPlan::new(&s, BackendKind::Docker, "i", false)
                .unwrap()
                .key,
            a.key
        );
        assert_ne!(
            ContainerPlan::new(&spec(), BackendKind::Gvisor, "i", false)
                .unwrap()
                .key,
            a.key
        );
        let mut s = spec();
        s.profile = "other".into();
        assert_ne!(
            ContainerPlan::new(&s, BackendKind::Docker, "i", false)
                .unwrap()
                .key,
            a.key
        );
    }

    #[test]
    fn each_container_runs_as_its_own_uid_which_is_not_part_of_the_key() {
        for kept in [false, true] {
            let p = ContainerPlan::new(&spec(), BackendKind::Docker, "i", kept).unwrap();
            let (one, two) = (
                p.body(&owner(), "e", "v", 200_001, None),
                p.body(&owner(), "e", "v", 200_002, None),
            );
            for (b, uid) in [(&one, "200001"), (&two, "200002")] {
                // The supervisor switches to it; the profile's uid (65534) is not used.
                assert_eq!(b.entrypoint.as_ref().unwrap()[1..3], [uid, "65534"]);
                // It owns the disk volume at the workdir and /tmp.
                let mounts = b.host_config.clone().unwrap().mounts.unwrap();
                assert_eq!(mounts.len(), 2);
                for m in mounts {
                    let o = m
                        .volume_options
                        .unwrap()
                        .driver_config
                        .unwrap()
                        .options
                        .unwrap();
                    assert!(
                        o["o"].contains(&format!(",uid={uid},gid=65534,")),
                        "{}",
                        o["o"]
                    );
                }
            }
            // Only the uid differs between two containers of one plan, which share a pool key.
            let mut same = two.clone();
            same.entrypoint = one.entrypoint.clone();
            same.host_config.as_mut().unwrap().mounts =
                one.host_config.as_ref().unwrap().mounts.clone();
            assert_eq!(
                serde_json::to_value(&same).unwrap(),
                serde_json::to_value(&one).unwrap()
            );
            let mut s = spec();
            s.uid = 4242;
            assert_eq!(
                ContainerPlan::new(&s, BackendKind::Docker, "i", kept)
                    .unwrap()
                    .key,
                p.key,
                "the profile's uid decides nothing"
            );
            let mut s = spec();
            s.gid = 4242;
            assert_ne!(
                ContainerPlan::new(&s, BackendKind::Docker, "i", kept)
                    .unwrap()
                    .key,
                p.key,
                "the gid is the plan's"
            );
        }
    }

    #[test]
    fn owner_label_round_trips() {
        let o = owner();
        assert!(Owner::parse_label(&o.label()).unwrap().same_process(&o));
        let p = Owner::parse_label("a/b/ns/7/9").unwrap();
        assert_eq!(
            (p.host.as_str(), p.pid_ns.as_str(), p.pid, p.start_time),
            ("a/b", "ns", 7, 9)
        );
        assert!(Owner::parse_label("nope").is_none());
        assert!(Owner::parse_label("h/ns/x/9").is_none());
    }

    #[test]
    fn the_supervisor_binary_is_mounted_read_only_at_the_entrypoint() {
        let owner = Owner::parse_label("h/pid:[1]/1/1").unwrap();
        let host = Path::new("/opt/executor-arm/executor-arm-supervisor");
        for kept in [false, true] {
            let b = ContainerPlan::new(&spec(), BackendKind::Docker, "i", kept)
                .unwrap()
                .with_supervisor(host)
                .body(&owner, "e", "v", 200_001, None);
            assert_eq!(
                b.entrypoint.as_ref().unwrap()[0],
                supervisor::CONTAINER_PATH
            );
            assert_eq!(b.env, None, "nothing of ours in the environment");
            let mounts = b.host_config.unwrap().mounts.unwrap();
            let m: Vec<_> = mounts
                .iter()
                .filter(|m| m.target.as_deref() == Some(supervisor::CONTAINER_PATH))
                .collect();
            assert_eq!(m.len(), 1, "{mounts:?}");
            assert_eq!(m[0].source.as_deref(), host.to_str());
            assert_eq!(m[0].typ, Some(MountType::BIND));
            assert_eq!(m[0].read_only, Some(true));
        }
    }
}
