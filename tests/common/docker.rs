//! Docker harness shared by the tests that run on the docker (runc) and gvisor (runsc) backends:
//! whether the engine is there, the daemon's config for it, and host-side checks of containers.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::wait::{CLEANUP, wait_for, wait_until};
use super::{Daemon, STOP_LIMIT, Stopped};

pub const SOCKET: &str = "/var/run/docker.sock";
pub const IMAGE: &str = "executor-arm-sandbox:latest";

pub fn docker(args: &[&str]) -> Option<String> {
    let out = Command::new("docker").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Held by a test for its whole run so the tests of one binary that load dockerd run one at a
/// time: on a 2-vCPU machine a gVisor burst or fork bomb next to another test only measures how
/// long a saturated dockerd takes, not the backend.
pub async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// Fails the test unless dockerd runs with the runc and runsc runtimes and the sandbox image
/// exists: the docker tests never skip (the test command sets all of it up).
pub fn require_docker(test: &str) {
    let problem = match docker(&[
        "info",
        "--format",
        "{{range $k, $v := .Runtimes}}{{$k}} {{end}}",
    ]) {
        None => Some("dockerd is not reachable".to_string()),
        Some(rt)
            if !(rt.split_whitespace().any(|r| r == "runc")
                && rt.split_whitespace().any(|r| r == "runsc")) =>
        {
            Some(format!(
                "dockerd lacks the runc or runsc runtime (has: {})",
                rt.trim()
            ))
        }
        Some(_) if docker(&["image", "inspect", IMAGE]).is_none() => {
            Some(format!("image {IMAGE} is missing"))
        }
        Some(_) => None,
    };
    if let Some(p) = problem {
        panic!("{test}: {p}. Run scripts/setup-docker.sh and scripts/build-sandbox-image.sh");
    }
}

/// The daemon's `[sandbox.docker]` config.
pub fn config(pool: usize, socket: &str) -> String {
    format!(
        "[sandbox.docker]\nsocket = \"unix://{socket}\"\nimage = \"{IMAGE}\"\npool_size = {pool}\nsupervisor = \"{}\"\n",
        supervisor()
    )
}

/// The static supervisor binary the docker tests' daemons mount into their containers, built
/// once per test binary by scripts/build-supervisor.sh (its own target dir: no wait on the
/// build that runs these tests).
pub fn supervisor() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let root = env!("CARGO_MANIFEST_DIR");
        let out = Command::new(format!("{root}/scripts/build-supervisor.sh"))
            .current_dir(root)
            .output()
            .expect("scripts/build-supervisor.sh");
        assert!(
            out.status.success(),
            "scripts/build-supervisor.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rel = String::from_utf8(out.stdout).unwrap().trim().to_string();
        format!("{root}/{rel}")
    })
}

/// The `executor-arm.instance` label value of a daemon's containers.
pub fn instance_of(d: &Daemon) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}-{}", host.trim(), d.pid())
}

/// Ids of the containers (any state) matching every filter; a failing `docker ps` fails the test
/// (an empty answer must mean "none", never "could not look").
pub fn docker_ps(filters: &[String]) -> Vec<String> {
    let mut args = vec!["ps", "-aq", "--no-trunc"];
    for f in filters {
        args.extend(["--filter", f.as_str()]);
    }
    docker(&args)
        .unwrap_or_else(|| panic!("docker {args:?} failed"))
        .lines()
        .map(str::to_string)
        .collect()
}

/// Idle (never used) pool containers of a daemon instance: one that serves a run is renamed.
pub fn pool_containers(instance: &str) -> Vec<String> {
    docker_ps(&[
        format!("label=executor-arm.instance={instance}"),
        "name=executor-arm-pool-".to_string(),
    ])
}

/// Containers (any state) carrying `label`.
pub fn containers(label: &str) -> Vec<String> {
    docker_ps(&[format!("label={label}")])
}

/// Running containers carrying `label`.
pub fn running_containers(label: &str) -> Vec<String> {
    let filter = format!("label={label}");
    docker(&["ps", "-q", "--no-trunc", "--filter", &filter])
        .unwrap_or_else(|| panic!("docker ps --filter {filter} failed"))
        .lines()
        .map(str::to_string)
        .collect()
}

/// Names of the volumes carrying `label` (the sandboxes' disk volumes).
pub fn volumes(label: &str) -> Vec<String> {
    let filter = format!("label={label}");
    docker(&["volume", "ls", "-q", "--filter", &filter])
        .unwrap_or_else(|| panic!("docker volume ls --filter {filter} failed"))
        .lines()
        .map(str::to_string)
        .collect()
}

/// Force-removes every container, then every volume, carrying `label` (what a killed daemon
/// left, once a test has checked it).
pub fn remove_all(label: &str) {
    for id in containers(label) {
        let _ = docker(&["rm", "-f", "-v", &id]);
    }
    for v in volumes(label) {
        let _ = docker(&["volume", "rm", "-f", &v]);
    }
}

/// Stops the daemon and checks from the host that none of its containers remain, nor a disk
/// volume in use.
///
/// A disk volume can only be removed once its container is gone, so a shutdown that cuts a slow
/// teardown short (a gVisor sandbox saturated by a fork bomb) leaves the unused volume for the
/// next daemon's startup sweep (dockerd unmounted its tmpfs with the container). Such a volume
/// must then be removable; a volume leak during normal operation is what
/// `disk_volumes_go_with_their_containers` checks.
///
/// A daemon that does not exit within [`STOP_LIMIT`] of SIGTERM fails the test as such: its
/// exit was cut short, so what it left says nothing about its clean-up (it is removed here).
pub fn finish(mut d: Daemon) {
    let instance = instance_of(&d);
    let stopped = d.terminate();
    let label = format!("executor-arm.instance={instance}");
    if stopped == Some(Stopped::Killed) {
        let left = containers(&label);
        remove_all(&label);
        panic!(
            "the daemon did not exit within {STOP_LIMIT:?} of SIGTERM and was SIGKILLed, cutting \
             its exit short; containers it left: {left:?}"
        );
    }
    // A bound, not a timing check: a gVisor sandbox saturated by its guest (a fork bomb under its
    // CPU quota) can take half a minute to act on a kill on this 2-vCPU machine, and minutes while
    // other tests load dockerd at the same time.
    assert_nothing_left(&label, Duration::from_secs(300));
}

/// Waits (up to `limit`) until no container carries `label`, then checks that every volume with
/// it is unused (and removes it).
pub fn assert_nothing_left(label: &str, limit: Duration) {
    wait_until(&format!("no container labelled {label}"), limit, || {
        containers(label).is_empty()
    });
    for v in volumes(label) {
        assert!(
            docker(&["volume", "rm", &v]).is_some(),
            "volume {v} of a stopped daemon is still in use"
        );
    }
}

/// The daemon's log line for a container taking a run: `(exec_id, container id)`.
fn assignment(line: &str) -> Option<(String, String)> {
    if !line.contains("sandbox container assigned") {
        return None;
    }
    let v = serde_json::from_str::<Value>(line).ok()?;
    let container = v["fields"]["container"].as_str()?.to_string();
    Some((
        v["fields"]["exec_id"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        container,
    ))
}

/// The containers the daemon assigned to runs, in the order its log shows them: every line read
/// so far is kept in `seen`, so successive calls see everything since the test began.
pub fn assigned_containers(d: &Daemon, seen: &mut Vec<String>) -> Vec<String> {
    seen.extend(d.log.try_iter());
    seen.iter()
        .filter_map(|l| assignment(l))
        .map(|(_, c)| c)
        .collect()
}

/// Waits (bounded by `limit`) until the daemon has assigned at least `n` containers and `ready`
/// holds for them; returns them.
pub fn wait_for_assigned(
    d: &Daemon,
    seen: &mut Vec<String>,
    n: usize,
    limit: Duration,
    ready: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    wait_for(
        &format!("the daemon to assign {n} container(s) to runs"),
        limit,
        || assigned_containers(d, seen),
        |ids| ids.len() >= n && ready(ids),
    )
}

/// The container the daemon assigned to `exec_id` (from its log).
pub fn container_of(d: &Daemon, exec_id: &str, seen: &mut Vec<String>) -> String {
    wait_for(
        &format!("the daemon to log the container of {exec_id}"),
        CLEANUP,
        || {
            seen.extend(d.log.try_iter());
            seen.iter()
                .filter_map(|l| assignment(l))
                .find(|(e, _)| e == exec_id)
                .map(|(_, c)| c)
        },
        Option::is_some,
    )
    .expect("found")
}

pub fn container_exists(id: &str) -> bool {
    let out = Command::new("docker")
        .args(["inspect", "--format", "{{.Id}}", id])
        .output()
        .expect("docker inspect");
    if out.status.success() {
        return true;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("No such"), "docker inspect {id} failed: {err}");
    false
}
