//! The `local` backend: each run is a process tree in fresh namespaces, a per-run cgroup, a
//! minimal read-only root, Landlock, seccomp, rlimits and an unprivileged uid.
//!
//! Owns: turning a [`RunSpec`] into a [`child::ChildPlan`], spawning it, feeding stdin, killing
//! the run's cgroup when the wall clock, an output cap or cancellation says so (the shared
//! skeleton, [`super::run`], decides when), and removing everything afterwards.
//! Must not: look at tokens, requests or the allowlist.
//!
//! This file holds the backend (what it prepares at start, what it removes at exit) and its
//! [`Sandbox`] impl. The rest, one job per file:
//! - [`probe`]: what the host kernel gives (Landlock ABI, seccomp, namespaces, cgroups, root).
//! - `run`: one run from admission to the cgroup's retirement, in order.
//! - `plan`: a [`RunSpec`] turned into what the child needs (the minimal root's mounts and
//!   Landlock rules, argv, env, rlimits, identity, inherited descriptors).
//! - [`child`]: the sandbox's processes, after the clone (async-signal-safe).
//! - `status`: the status and hello pipes, daemon side (which record decides the run).
//! - `slots`: cgroups with a shim already in them, prepared ahead of their runs.
//! - `guard`: a run cgroup's removal however the run ends, and the memory pinned until then.
//! - `reaper`: finished runs' cgroups removed off the request path.
//! - [`cgroup`]: the per-run cgroups, v1 and v2; [`landlock`], [`seccomp`]: those mechanisms;
//!   [`egress`]: the egress proxy in a run's network namespace; [`dynmods`]: the kernel's
//!   `favordynmods` cgroup mode.

pub mod cgroup;
pub mod child;
pub mod dynmods;
pub mod egress;
mod guard;
pub mod landlock;
mod plan;
pub mod probe;
mod reaper;
mod run;
pub mod seccomp;
mod slots;
mod status;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use self::cgroup::CgroupDriver;
use self::probe::HostProbe;
use self::seccomp::SeccompProgram;
use self::slots::WarmSlots;
use super::uids::UidRange;
use super::{BackendKind, BackendStatus, RunOutcome, RunSpec, Sandbox, SandboxError};

pub struct LocalSandbox {
    cgroups: Option<Arc<dyn CgroupDriver>>,
    /// The live groups of runs that count together (a session's), on the same driver.
    groups: Option<Arc<cgroup::Groups>>,
    /// Run slots prepared ahead (absent without cgroups or when configured to 0).
    warm: Option<Arc<WarmSlots>>,
    probe: HostProbe,
    /// Empty host directory the per-run root tmpfs is mounted on (inside each run's own mount
    /// namespace, so every run can use the same one).
    root_dir: PathBuf,
    /// None when it could not be built: the probe then reports seccomp missing and runs are
    /// refused.
    seccomp: Option<Arc<SeccompProgram>>,
    egress: Option<egress::EgressSettings>,
    /// Removes finished runs' cgroups off the request path (None: each run removes its own).
    reaper: Option<reaper::Reaper>,
    /// Holds the kernel's `favordynmods` mode while the backend lives (see [`dynmods`]).
    _dynmods: Option<dynmods::FavorDynMods>,
    /// Where each run's own host uid comes from (a session's execs come with the session's).
    uids: Arc<UidRange>,
}

impl LocalSandbox {
    /// Probes the host and prepares cgroups. Never fails: what is missing is reported by
    /// [`Sandbox::status`] and makes runs fail closed with `Unavailable`. Without `egress`,
    /// egress profiles are refused.
    pub fn new(
        cgroup_name: &str,
        warm_slots: usize,
        favor_dynmods: bool,
        runtime_dir: &Path,
        egress: Option<egress::EgressSettings>,
        uids: Arc<UidRange>,
    ) -> Self {
        let mut probe = HostProbe::detect();
        let cgroups = match cgroup::detect(Path::new("/sys/fs/cgroup"), cgroup_name) {
            Ok(d) => {
                let swept = d.sweep_orphans();
                if swept > 0 {
                    tracing::warn!(swept, "removed run cgroups left by an earlier daemon");
                }
                probe.cgroup = Some(format!("{:?}", d.version()).to_lowercase());
                Some(Arc::<dyn CgroupDriver>::from(d))
            }
            Err(e) => {
                probe.cgroup_error = Some(e.to_string());
                None
            }
        };
        // Before the first slot is prepared: its joins are what the mode makes cheap. Only where
        // the host already has cgroup v1 hierarchies: on a cgroup v2 host a v1 hierarchy would
        // add a line to every process's /proc/<pid>/cgroup, which tools read to tell the
        // versions apart.
        let v1 = cgroups
            .as_ref()
            .is_some_and(|d| d.version() == cgroup::CgroupVersion::V1);
        let dynmods = (favor_dynmods && v1)
            .then(|| match dynmods::FavorDynMods::hold() {
                Ok(h) => {
                    tracing::info!("cgroup favordynmods mode held: cgroup joins wait for no RCU grace period");
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot hold the cgroup favordynmods mode: each cgroup join may stall forks host-wide for an RCU grace period");
                    None
                }
            })
            .flatten();
        let root_dir = runtime_dir.join("sandbox-root");
        if let Err(e) = std::fs::create_dir_all(&root_dir) {
            probe
                .cgroup_error
                .get_or_insert(format!("cannot create {}: {e}", root_dir.display()));
        }
        // Orphaned sandbox inits come back to us, not to the host's init (see child::ShimState).
        if let Err(e) = child::become_subreaper() {
            probe
                .cgroup_error
                .get_or_insert(format!("cannot become a child subreaper: {e}"));
        }
        let seccomp = match SeccompProgram::deny_list() {
            Ok(p) => Some(Arc::new(p)),
            Err(e) => {
                tracing::error!(error = %e, "the seccomp filter could not be built");
                probe.seccomp = false;
                None
            }
        };
        let warm = match (&cgroups, warm_slots) {
            (Some(driver), n) if n > 0 && probe.local_missing(1).is_empty() => {
                let w = Arc::new(WarmSlots::new(driver.clone(), n));
                w.refill();
                Some(w)
            }
            _ => None,
        };
        LocalSandbox {
            groups: cgroups.clone().map(|d| Arc::new(cgroup::Groups::new(d))),
            cgroups,
            warm,
            probe,
            root_dir,
            seccomp,
            egress,
            reaper: reaper::Reaper::start()
                .inspect_err(|e| tracing::warn!(error = %e, "no teardown thread: runs remove their own cgroups"))
                .ok(),
            _dynmods: dynmods,
            uids,
        }
    }

    pub fn probe(&self) -> &HostProbe {
        &self.probe
    }
}

impl Drop for LocalSandbox {
    /// At exit (the runtime drops the daemon's state): remove this daemon's empty cgroup owner
    /// directories, so a clean shutdown leaves nothing for the next start to sweep.
    fn drop(&mut self) {
        // Finished runs' cgroups, then prepared slots: they live in the owner directories.
        if let Some(r) = &self.reaper {
            r.close();
        }
        if let Some(w) = &self.warm {
            w.drain();
        }
        if let Some(d) = &self.cgroups {
            d.release();
        }
    }
}

#[async_trait::async_trait]
impl Sandbox for LocalSandbox {
    fn session_usage(&self, session_id: &str) -> Option<crate::sandbox::Usage> {
        self.groups.as_ref()?.usage(session_id)
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Local
    }

    fn supports_egress(&self) -> bool {
        self.egress.is_some()
    }

    async fn status(&self) -> BackendStatus {
        let missing = self.probe.local_missing(1);
        BackendStatus {
            backend: BackendKind::Local,
            ready: missing.is_empty(),
            detail: if missing.is_empty() {
                format!(
                    "cgroup {}, landlock abi {}, seccomp, namespaces",
                    self.probe.cgroup.as_deref().unwrap_or("?"),
                    self.probe.landlock_abi
                )
            } else {
                format!("missing: {}", missing.join(", "))
            },
        }
    }

    async fn run(&self, spec: RunSpec) -> Result<RunOutcome, SandboxError> {
        self.execute(spec).await
    }
}
