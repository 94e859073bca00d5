//! Crashes and faults of the real daemon: `kill -9` mid-run on every backend and a restart on the
//! same files, idempotency keys of a run in flight at the crash. (dockerd restarting mid-run is in
//! tests/dockerd_restart.rs: nothing else may run while dockerd is down.)
//!
//! After a crash and a restart nothing of the old run may remain — checked from the host: no
//! process with the run's marker in its argv, no cgroup, mount, temp directory or container of the
//! old daemon — and the audit log verifies and records the crashed run: its `execution_start` line
//! gets exactly one `execution_error` end line, written by the restarted daemon.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::docker::{config, containers, instance_of, require_docker};
use common::wait::wait_until;
use common::{Daemon, Opts, Resp, assert_runs_paired, audit_verify, owner_dirs, pids_with_cmdline};
use serde_json::{Value, json};

/// A bound for things that happen at once on an idle machine, generous for a loaded one.
const BOUND: Duration = Duration::from_secs(60);

fn marker() -> String {
    format!("crash-{}", uuid::Uuid::new_v4().simple())
}

/// A python script that prints `started` and then waits until `flag` exists (forever when it
/// never does); `marker` makes its argv findable on the host.
fn waiting_script(marker: &str, flag: &Path) -> String {
    format!(
        "# {marker}\nimport os, time\nprint('started', flush=True)\nwhile not os.path.exists({:?}):\n    time.sleep(0.05)\nprint('released', flush=True)\n",
        flag.display().to_string()
    )
}

/// POSTs `body` to /execute in the background (the daemon is killed under it: the answer, if
/// any, is not looked at).
fn post_in_background(d: &Daemon, body: String, idempotency_key: Option<&str>) {
    let url = format!("{}/execute", d.base);
    let svc = d.service_token();
    let key = idempotency_key.map(str::to_string);
    tokio::spawn(async move {
        let mut rb = reqwest::Client::new()
            .post(url)
            .bearer_auth(svc)
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            rb = rb.header("idempotency-key", k);
        }
        let _ = rb.send().await;
    });
}

/// The body of a python run of [`waiting_script`].
fn waiting_body(d: &Daemon, marker: &str, flag: &Path) -> String {
    json!({"action_type": "python", "command": "python3", "args": ["-c", waiting_script(marker, flag)], "timeout_seconds": 300, "capability_token": d.cap_all()}).to_string()
}

/// Nothing is left of a killed daemon's (`old_pid`) cgroups once a daemon started after it:
/// neither its owner directories nor any run or group cgroup in them.
fn assert_cgroups_swept(owners: &[PathBuf], old_pid: i32) {
    for o in owners {
        assert!(!o.exists(), "cgroup directory {} left", o.display());
    }
    assert!(
        common::run_cgroups_of(old_pid).is_empty(),
        "{:?}",
        common::run_cgroups_of(old_pid)
    );
}

/// The exec_id of the one run the daemon has started (from its `execution_start` line).
fn started_exec_id(d: &Daemon) -> String {
    let mut id = None;
    wait_until("the run's execution_start line", BOUND, || {
        id = d
            .audit_lines()
            .into_iter()
            .find(|l| l["event"] == "execution_start")
            .and_then(|l| l["exec_id"].as_str().map(str::to_string));
        id.is_some()
    });
    id.unwrap_or_default()
}

/// The audit log verifies with `executor-arm audit verify`, every run is paired, and the crashed
/// run `exec_id` (started by `old_instance`) has exactly one end line: an `execution_error`
/// written by another instance that says the daemon stopped during the run.
fn assert_crash_recorded(d: &Daemon, exec_id: &str, old_instance: &str) {
    let out = audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "audit verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = d.audit_lines();
    assert_runs_paired(&lines);
    let of_run: Vec<&Value> = lines.iter().filter(|l| l["exec_id"] == exec_id).collect();
    assert_eq!(of_run.len(), 2, "start and one end line: {of_run:#?}");
    assert_eq!(of_run[0]["event"], "execution_start", "{of_run:#?}");
    assert_eq!(of_run[0]["instance"], old_instance, "{of_run:#?}");
    let end = of_run[1];
    assert_eq!(end["event"], "execution_error", "{end}");
    assert_eq!(end["error_type"], "DaemonStopped", "{end}");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("stopped during the run") && e.contains(old_instance)),
        "{end}"
    );
    assert_ne!(end["instance"], old_instance, "{end}");
    for k in [
        "request_id",
        "subject",
        "command",
        "args",
        "command_hash",
        "backend",
        "profile",
    ] {
        assert_eq!(
            end[k], of_run[0][k],
            "{k} of the end line is the start line's: {end}"
        );
    }
}

/// Host mounts that name `needle` (a run's exec_id or marker) or sit on the local backend's
/// sandbox root (each run mounts there inside its own mount namespace only).
fn host_mounts(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .filter(|l| l.contains(needle) || l.contains("/executor-arm/sandbox-root"))
        .map(str::to_string)
        .collect()
}

/// Entries (two levels deep) of the temp and runtime directories whose name contains `needle`.
fn temp_entries(needle: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for root in [std::env::temp_dir(), PathBuf::from("/run/executor-arm")] {
        let Ok(top) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in top.filter_map(Result::ok) {
            let p = e.path();
            if p.to_string_lossy().contains(needle) {
                out.push(p.clone());
            }
            if e.file_type().is_ok_and(|t| t.is_dir())
                && let Ok(sub) = std::fs::read_dir(&p)
            {
                out.extend(
                    sub.filter_map(Result::ok)
                        .map(|s| s.path())
                        .filter(|s| s.to_string_lossy().contains(needle)),
                );
            }
        }
    }
    out
}

/// A directory bound read-only into the sandbox of every `python3` run of a daemon started with
/// [`Gate::opts`]: a run of [`waiting_script`] waits until the test opens the gate.
struct Gate {
    dir: tempfile::TempDir,
    profiles: tempfile::TempDir,
}

impl Gate {
    fn new() -> Gate {
        use std::os::unix::fs::PermissionsExt;
        // Not under /tmp: the sandbox has a /tmp of its own over it.
        let dir = tempfile::Builder::new()
            .prefix("executor-arm-crash-")
            .tempdir_in("/var/tmp")
            .expect("tempdir in /var/tmp");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod gate");
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("sandbox-profiles");
        let profiles = tempfile::tempdir().expect("tempdir");
        for e in std::fs::read_dir(&shipped)
            .expect("sandbox-profiles")
            .filter_map(Result::ok)
        {
            std::fs::copy(e.path(), profiles.path().join(e.file_name())).expect("copy profile");
        }
        let mut gated: toml::Table = std::fs::read_to_string(shipped.join("python.toml"))
            .expect("python profile")
            .parse()
            .expect("python profile is TOML");
        gated["filesystem"]["read_only"]
            .as_array_mut()
            .expect("read_only")
            .push(dir.path().display().to_string().into());
        std::fs::write(profiles.path().join("gated.toml"), gated.to_string()).expect("profile");
        Gate { dir, profiles }
    }

    fn flag(&self) -> PathBuf {
        self.dir.path().join("open")
    }

    fn open(&self) {
        std::fs::write(self.flag(), "").expect("open the gate");
    }

    /// Options whose `python3` runs see the gate; `config` is more TOML.
    fn opts(&self, env: &[(&str, &str)], config: &str) -> Opts {
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.push((
            "EXECUTOR_ARM_PROFILES_DIR".into(),
            self.profiles.path().display().to_string(),
        ));
        Opts {
            env,
            config: Some(format!(
                "[commands.python3]\naction_types = [\"python\"]\ncapabilities = [\"PythonExecute\"]\nprofile = \"gated\"\n{config}"
            )),
            ..Default::default()
        }
    }
}

/// The Redis the test command starts (scripts/test-all.sh). Missing is a failure: these tests
/// never skip.
fn redis_url() -> String {
    std::env::var("EXECUTOR_ARM_TEST_REDIS_URL").unwrap_or_else(|_| {
        panic!(
            "EXECUTOR_ARM_TEST_REDIS_URL is not set: run scripts/test-all.sh, or start redis-server \
             --port 6390 and set it to redis://127.0.0.1:6390/0"
        )
    })
}

/// POST /execute with exactly `body` (the bytes an Idempotency-Key is bound to) and `key`.
async fn post_keyed(d: &Daemon, body: &str, key: &str) -> Resp {
    let svc = format!("Bearer {}", d.service_token());
    d.post(
        "/execute",
        &[("authorization", svc.as_str()), ("idempotency-key", key)],
        body.to_string(),
    )
    .await
}

async fn echo(d: &Daemon, word: &str) -> Resp {
    d.exec(json!({"action_type": "shell", "command": "echo", "args": [word]}))
        .await
}

// ---------------------------------------------------------------------------------------------
// kill -9 on the local backend
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_run_on_local_leaves_nothing_and_the_restart_records_the_run() {
    let mut d = Daemon::start();
    let old_instance = instance_of(&d);
    let m = marker();
    let never = d.dir.path().join("never-created");
    post_in_background(&d, waiting_body(&d, &m, &never), None);
    let exec_id = started_exec_id(&d);
    wait_until("the run's processes on the host", BOUND, || {
        !pids_with_cmdline(&m).is_empty()
    });
    // The daemon's run-cgroup directories, read while it lives (its /proc entry names them).
    let owners = owner_dirs(d.pid());
    let old_pid = d.kill9();

    // The run dies with the daemon: its shim and pid 1 have PR_SET_PDEATHSIG.
    wait_until("no process of the crashed run", BOUND, || {
        pids_with_cmdline(&m).is_empty()
    });
    // Its cgroups stay until a daemon starting on this host sweeps them (this restart, or any
    // other daemon's start: dead owners' cgroups are anyone's to sweep).
    let d = d.restart(Opts::default());
    assert_cgroups_swept(&owners, old_pid);
    assert!(pids_with_cmdline(&m).is_empty());
    for needle in [exec_id.as_str(), m.as_str()] {
        assert_eq!(
            host_mounts(needle),
            Vec::<String>::new(),
            "host mounts of the run"
        );
        assert_eq!(
            temp_entries(needle),
            Vec::<PathBuf>::new(),
            "temp entries of the run"
        );
    }
    assert_crash_recorded(&d, &exec_id, &old_instance);

    let r = echo(&d, "after").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["stdout"], "after\n", "{}", r.text);

    // Recorded once: a further (clean) restart adds no second end line.
    let d = d.restart(Opts::default());
    assert_crash_recorded(&d, &exec_id, &old_instance);
    let r = echo(&d, "again").await;
    assert_eq!(r.status, 200, "{}", r.text);
}

// ---------------------------------------------------------------------------------------------
// kill -9 on docker and gVisor
// ---------------------------------------------------------------------------------------------

/// A local session's runs live in a group cgroup of the session's (`group-N/<exec>`): a kill -9
/// leaves it nested, and the restart's sweep removes the runs and then the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_a_local_session_process_leaves_no_group_cgroup() {
    let mut d = Daemon::start();
    let c = common::sessions::koder(&d, Some("team-a"));
    let id = common::sessions::new_session(&c, "python").await;
    let r = c
        .exec(
            &id,
            json!({"code": "import time\nprint('up', flush=True)\ntime.sleep(600)", "background": true}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    wait_until("the session's group cgroup", BOUND, || {
        d.run_cgroups().iter().any(|g| g.starts_with("group-"))
    });
    let owners = owner_dirs(d.pid());
    let old_pid = d.kill9();
    let _d = d.restart(Opts::default());
    assert_cgroups_swept(&owners, old_pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_run_on_docker_and_gvisor_leaves_no_container_and_the_restart_records_the_run() {
    require_docker("kill_9_mid_run_on_docker_and_gvisor");
    for rt in ["runc", "gvisor"] {
        let opts = Opts {
            env: vec![("SANDBOX_RUNTIME".into(), rt.into())],
            config: Some(config(1, common::docker::SOCKET)),
            ..Default::default()
        };
        let mut d = Daemon::start_with(opts.clone());
        let old_instance = instance_of(&d);
        let m = marker();
        let never = d.dir.path().join("never-created");
        post_in_background(&d, waiting_body(&d, &m, &never), None);
        let exec_id = started_exec_id(&d);
        let mut seen = Vec::new();
        let container = common::docker::container_of(&d, &exec_id, &mut seen);
        d.kill9();

        let d = d.restart(opts);
        // The restarted daemon's startup sweep removes every container of the dead one (a bound,
        // not a timing check: gVisor can take long to act on a kill on a loaded machine).
        let label = format!("executor-arm.instance={old_instance}");
        wait_until(
            &format!("{rt}: no container labelled {label}"),
            BOUND,
            || containers(&label).is_empty(),
        );
        assert!(
            !common::docker::container_exists(&container),
            "{rt}: container {container} of the crashed run left"
        );
        assert!(pids_with_cmdline(&m).is_empty(), "{rt}: run processes left");
        assert_crash_recorded(&d, &exec_id, &old_instance);

        let r = echo(&d, "after").await;
        assert_eq!(r.status, 200, "{rt}: {}", r.text);
        assert_eq!(r.json["stdout"], "after\n", "{rt}: {}", r.text);
        assert_eq!(
            r.json["backend"],
            if rt == "runc" { "docker" } else { "gvisor" }
        );
        common::docker::finish(d);
    }
}

// ---------------------------------------------------------------------------------------------
// Idempotency-Keys of a run in flight at a crash
// ---------------------------------------------------------------------------------------------

/// A run holding an Idempotency-Key is killed with its daemon; after a restart on the same files a
/// retry with the same key and body runs (200, not 409 "in progress"), and is then stored.
async fn a_key_in_flight_at_a_crash_is_free_after_the_restart(env: &[(&str, &str)]) {
    let gate = Gate::new();
    let opts = gate.opts(env, "");
    let mut d = Daemon::start_with(opts.clone());
    let old_instance = instance_of(&d);
    let m = marker();
    let body = waiting_body(&d, &m, &gate.flag());
    let key = format!("crash-{}", uuid::Uuid::new_v4().simple());
    post_in_background(&d, body.clone(), Some(&key));
    let exec_id = started_exec_id(&d);
    // The test is about a key in progress: a retry now is refused as such.
    let r = post_keyed(&d, &body, &key).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json["error_type"], "IdempotencyInProgress", "{}", r.text);

    d.kill9();
    gate.open();
    let d = d.restart(opts);
    let r = post_keyed(&d, &body, &key).await;
    assert_eq!(r.status, 200, "the retry after the crash runs: {}", r.text);
    assert!(
        r.headers.get("idempotent-replayed").is_none(),
        "{:?}",
        r.headers
    );
    assert_eq!(r.json["stdout"], "started\nreleased\n", "{}", r.text);
    assert_ne!(r.json["exec_id"], exec_id.as_str());
    // Now finished: the next retry gets the stored answer without running.
    let again = post_keyed(&d, &body, &key).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(again.json["exec_id"], r.json["exec_id"]);
    assert_crash_recorded(&d, &exec_id, &old_instance);
    let recorded = d
        .audit_lines()
        .into_iter()
        .find(|l| l["exec_id"] == exec_id.as_str() && l["event"] == "execution_error")
        .expect("end line of the crashed run");
    assert_eq!(
        recorded["idempotency_key"],
        format!("12:orchestrator:{key}")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_a_key_in_flight_at_a_crash_is_free_after_the_restart() {
    a_key_in_flight_at_a_crash_is_free_after_the_restart(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_key_in_flight_at_a_crash_is_free_after_the_restart() {
    let url = redis_url();
    a_key_in_flight_at_a_crash_is_free_after_the_restart(&[("EXECUTOR_ARM_REDIS_URL", &url)]).await;
}

/// Milliseconds left on `key`'s claim in Redis (-2: no such key). The store key is the scoped
/// key: `<subject length>:<subject>:<key>`.
fn pttl(redis: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(format!("executor-arm:idem:12:orchestrator:{key}"))
        .query(redis)
        .expect("PTTL")
}

/// With Redis, a key in progress is a lease its daemon renews while the run lives; when the daemon
/// dies and is not restarted on its files, the lease lapses and a retry on another replica runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_dead_daemons_key_lapses_and_a_live_runs_key_is_renewed() {
    let url = redis_url();
    let mut redis = redis::Client::open(url.as_str())
        .and_then(|c| c.get_connection())
        .expect("connect to the test Redis");
    let gate = Gate::new();
    let opts = gate.opts(
        &[("EXECUTOR_ARM_REDIS_URL", &url)],
        "[state]\nidempotency_lease_seconds = 6\n",
    );
    let mut a = Daemon::start_with(opts.clone());
    let b = Daemon::start_with(opts);
    let m = marker();
    let body = waiting_body(&a, &m, &gate.flag());
    let key = format!("crash-{}", uuid::Uuid::new_v4().simple());
    post_in_background(&a, body.clone(), Some(&key));
    let exec_id = started_exec_id(&a);

    // Renewed while the run lives: the time left goes up again (it only falls otherwise).
    let mut lowest = i64::MAX;
    wait_until("the claim renewed", BOUND, || {
        let left = pttl(&mut redis, &key);
        assert!(left > 0, "the claim of a live run lapsed: PTTL {left}");
        lowest = lowest.min(left);
        left > lowest
    });
    let r = post_keyed(&b, &body, &key).await;
    assert_eq!(r.status, 409, "{}", r.text);

    a.kill9();
    gate.open();
    // No restart on A's files: the claim lapses on its own, and B runs the retry.
    let t = Instant::now();
    let r = loop {
        let r = post_keyed(&b, &body, &key).await;
        if r.status != 409 {
            break r;
        }
        assert!(
            t.elapsed() < BOUND,
            "the dead daemon's key still blocks retries: {}",
            r.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.headers.get("idempotent-replayed").is_none(),
        "{:?}",
        r.headers
    );
    assert_eq!(r.json["stdout"], "started\nreleased\n", "{}", r.text);
    assert_ne!(r.json["exec_id"], exec_id.as_str());
}

// ---------------------------------------------------------------------------------------------
// Run records of a run in flight at a crash
// ---------------------------------------------------------------------------------------------

/// An async run killed with its daemon is not "running" for ever after the restart: its record in
/// the shared store says it finished, with the error its audit line records, so a caller polling
/// `GET /v1/executions/{id}` learns it ended (instead of "running" until the record's TTL, and a
/// 503 for its stream and cancel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_async_run_in_flight_at_a_crash_is_finished_after_the_restart() {
    let url = redis_url();
    let opts = Opts {
        env: vec![("EXECUTOR_ARM_REDIS_URL".into(), url)],
        ..Default::default()
    };
    let mut d = Daemon::start_with(opts.clone());
    let m = marker();
    let mut body = json!({"action_type": "python", "command": "python3",
        "args": ["-c", format!("# {m}\nimport time\ntime.sleep(300)")],
        "timeout_seconds": 300, "async": true});
    body["capability_token"] = json!(d.cap_all());
    let r = d.exec(body).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    wait_until("the run's processes on the host", BOUND, || {
        !pids_with_cmdline(&m).is_empty()
    });
    d.kill9();
    let d = d.restart(opts);
    let r = d.get_authorized(&format!("/v1/executions/{exec_id}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["status"], "finished", "{}", r.text);
    assert_eq!(r.json["http_status"], 503, "{}", r.text);
    assert_eq!(
        r.json["result"]["error_type"], "DaemonStopped",
        "{}",
        r.text
    );
    assert_eq!(r.json["result"]["retryable"], true, "{}", r.text);
    // Its stream, served from the record, still names where it ran.
    let stream = d
        .client
        .get(format!("{}/v1/executions/{exec_id}/stream", d.base))
        .header("authorization", format!("Bearer {}", d.service_token()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let start: Value = stream
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .and_then(|l| serde_json::from_str(l).ok())
        .expect("a start event");
    assert_eq!(start["exec_id"], exec_id.as_str(), "{stream}");
    assert_eq!(start["backend"], "local", "{stream}");
    assert_eq!(start["profile"], "python", "{stream}");
    let cancel = d
        .post(
            &format!("/v1/executions/{exec_id}/cancel"),
            &[("authorization", &format!("Bearer {}", d.service_token()))],
            String::new(),
        )
        .await;
    assert_eq!(cancel.status, 409, "{}", cancel.text);
}
