//! External Executor Protocol v1 conformance: executor scripts run through the real daemon.
//!
//! Every case about how an executor runs (envelope, exit codes, undrained stdin, signals, timeout,
//! leftovers, env and argv, its file) runs on each backend — `local::<case>`, `docker::<case>`
//! (runc) and `gvisor::<case>` (runsc) — with the defs in the `python` profile and the daemon's
//! default backend chosen by `SANDBOX_RUNTIME`. The cases about registration (what loads, what a
//! SIGHUP reloads, what is refused before anything runs) do not depend on the backend and run once.
//!
//! The docker and gvisor cases need dockerd with the runc and runsc runtimes and the sandbox image
//! (`scripts/setup-docker.sh`, `scripts/build-sandbox-image.sh`). Without them they fail;
//! they never skip.

mod common;

use base64::Engine as _;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::backends::{Backend, Finish};
use common::docker::{container_exists, container_of};
use common::wait::wait_until;
use common::{Daemon, Opts, Resp, pids_with_cmdline, write_executor_def};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

on_every_backend!(
    success_echoes_the_envelope_with_provenance_and_audit,
    an_executor_under_tmp_is_visible_in_the_sandbox,
    a_non_zero_exit_is_a_failure_with_the_trimmed_stderr,
    exiting_without_draining_the_envelope_is_a_failure_whatever_the_exit_code,
    killed_by_a_signal_is_cancelled,
    over_its_timeout_is_408_agent_timeout_and_nothing_is_left,
    a_background_child_does_not_outlive_the_run,
    injected_env_argv_and_model_flag,
    the_executor_file_is_a_read_only_bind,
    stream_json_lines_reach_a_stream_as_they_are_written,
    a_budget_above_300_s_is_honoured_in_async_mode,
    an_opted_in_executor_takes_the_request_stdin_args_and_orbit_ids,
);

/// A def with `stdin: request` and `request_args` runs the way coding-agent CLIs are driven: the
/// prompt on stdin, `--resume <id>` appended after the def's args, Orbit's run, job and step in
/// the environment; the audit line names the appended args and the invocation hash covers stdin.
/// Arguments beyond `max` or outside the pattern, and malformed Orbit ids, are 400s that run
/// nothing.
async fn an_opted_in_executor_takes_the_request_stdin_args_and_orbit_ids(
    backend: Backend,
) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "agent-cli",
        r#"import json, os, sys
prompt = sys.stdin.read()
keys = ["ORBIT_RUN_ID", "ORBIT_JOB_ID", "ORBIT_STEP_ID", "ORBIT_AGENT_NAME"]
print(json.dumps({"argv": sys.argv[1:], "stdin": prompt, "env": {k: os.environ.get(k) for k in keys}}))
"#,
    );
    let def = def_yaml(
        "agent-cli",
        &script,
        "  args: [-p, --output-format=stream-json]
  model_flag: --model
  stdin: request
  request_args:
    max: 2
    pattern: '--resume|[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}'
",
    );
    let d = start(backend, &[("agent-cli.yaml", def)]);
    let session = "0123abcd-0000-4000-8000-0123456789ab";
    let call = |stdin: &str| {
        json!({
            "stdin": stdin,
            "args": ["--resume", session],
            "model": "model-x",
            "metadata": {"orbit": {"run_id": "run-1", "job_id": "job-2", "step_id": 3}},
        })
    };
    let r = d
        .run(
            "agent-cli",
            call(
                "fix the failing test
",
            ),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "success", "{}", r.text);
    let out: Value = serde_json::from_str(r.json["stdout"].as_str().unwrap()).unwrap();
    assert_eq!(
        out["argv"],
        json!([
            "-p",
            "--output-format=stream-json",
            "--model",
            "model-x",
            "--resume",
            session
        ])
    );
    assert_eq!(
        out["stdin"],
        "fix the failing test
"
    );
    assert_eq!(out["env"]["ORBIT_RUN_ID"], "run-1");
    assert_eq!(out["env"]["ORBIT_JOB_ID"], "job-2");
    assert_eq!(out["env"]["ORBIT_STEP_ID"], "3");
    assert_eq!(out["env"]["ORBIT_AGENT_NAME"], "agent-cli");
    // What ran is on record: the appended args in the audit line and the command hash, the
    // stdin in the invocation hash.
    let exec_id = r.json["exec_id"].as_str().unwrap();
    let line = audit_line(&d, exec_id);
    assert_eq!(line["args"], json!(["--resume", session]), "{line}");
    assert_eq!(
        r.json["provenance"]["command_hash"],
        sha256(format!("agent-cli --resume {session}").as_bytes())
    );
    let other = d
        .run(
            "agent-cli",
            call(
                "another prompt
",
            ),
        )
        .await;
    assert_eq!(other.status, 200, "{}", other.text);
    assert_ne!(
        other.json["provenance"]["invocation_hash"], r.json["provenance"]["invocation_hash"],
        "the invocation hash does not cover stdin"
    );
    // Without stdin the executor reads an empty one; without args none are appended.
    let r = d.run("agent-cli", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let out: Value = serde_json::from_str(r.json["stdout"].as_str().unwrap()).unwrap();
    assert_eq!(out["argv"], json!(["-p", "--output-format=stream-json"]));
    assert_eq!(out["stdin"], "");
    assert!(out["env"]["ORBIT_RUN_ID"].is_null());

    let before = d.audit_lines().len();
    for (extra, why) in [
        (
            json!({"args": ["--resume", session, "--resume"]}),
            "at most 2",
        ),
        (json!({"args": ["--resume;rm -rf /"]}), "does not match"),
        (json!({"args": [format!("x{session}")]}), "does not match"),
        (
            json!({"args": ["--dangerously-skip-permissions"]}),
            "does not match",
        ),
        (
            json!({"metadata": {"orbit": {"run_id": "run
1"}}}),
            "metadata.orbit.run_id",
        ),
        (
            json!({"metadata": {"orbit": {"job_id": "j".repeat(257)}}}),
            "metadata.orbit.job_id",
        ),
        (
            json!({"metadata": {"orbit": {"step_id": {"id": 1}}}}),
            "metadata.orbit.step_id",
        ),
        (json!({"metadata": {"orbit": "run-1"}}), "metadata.orbit"),
    ] {
        let r = d.run("agent-cli", extra.clone()).await;
        assert_eq!(r.status, 400, "{extra}: {}", r.text);
        assert_eq!(r.json["error_type"], "InvalidRequest", "{}", r.text);
        assert!(
            r.json["error"].as_str().unwrap().contains(why),
            "{extra}: {}",
            r.text
        );
    }
    let ran = d.audit_lines()[before..]
        .iter()
        .filter(|l| l["event"] == "execution_start")
        .count();
    assert_eq!(ran, 0, "a refused request ran");
    d
}

/// An executor that writes stream-json lines (one JSON object per line, flushed, the way coding
/// agents report progress) is followed line by line while it runs.
async fn stream_json_lines_reach_a_stream_as_they_are_written(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "stream-json",
        "import json, sys, time\n\
         envelope = json.load(sys.stdin)\n\
         for i in range(5):\n\
         \x20   print(json.dumps({'type': 'assistant', 'seq': i, 'ts': time.time()}), flush=True)\n\
         \x20   time.sleep(0.2)\n\
         print(json.dumps({'type': 'result', 'subtype': 'success'}), flush=True)\n",
    );
    let d = start(
        backend,
        &[("stream-json.yaml", def_yaml("stream-json", &script, ""))],
    );
    let body = json!({"action_type": "external", "command": "stream-json", "input": {"prompt": "go"}, "capability_token": d.cap(&["ExternalExecute"])});
    let mut s = common::open_stream(&d, body).await;
    let events = s.rest().await;
    let last = events.last().expect("events");
    assert_eq!(last.event, "result", "{events:?}");
    assert_eq!(last.data["success"], true, "{}", last.data);
    assert_eq!(last.data["backend"], backend.name());
    let text = String::from_utf8(common::stream_bytes(&events, "stdout", 0)).unwrap();
    assert_eq!(last.data["stdout"], text.as_str());
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is a JSON object"))
        .collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert_eq!(lines[5]["type"], "result");
    let first = events.iter().find(|e| e.event == "stdout").unwrap();
    let first_seen = first.read_at;
    assert!(
        first_seen < lines[4]["ts"].as_f64().unwrap(),
        "the first line arrived only after the last was written"
    );
    d
}

/// A def whose `timeout_seconds` is above the synchronous 300 s gets all of it in an async run
/// (the start line records the limit the run got), and 300 s in a synchronous one.
async fn a_budget_above_300_s_is_honoured_in_async_mode(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "long-job",
        "import sys, time\nsys.stdin.read()\ntime.sleep(1)\nprint('done')\n",
    );
    let d = start(
        backend,
        &[(
            "long-job.yaml",
            def_yaml("long-job", &script, "  timeout_seconds: 1200\n"),
        )],
    );
    let started = d.run("long-job", json!({"async": true})).await;
    assert_eq!(started.status, 202, "{}", started.text);
    let exec_id = started.json["exec_id"].as_str().unwrap().to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let result = loop {
        let r = d.get_authorized(&format!("/v1/executions/{exec_id}")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.json["status"] == "finished" {
            break r.json["result"].clone();
        }
        assert!(std::time::Instant::now() < deadline, "still running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(result["success"], true, "{result}");
    assert_eq!(result["stdout"], "done\n");
    let start_line = |id: &str| {
        d.audit_lines()
            .into_iter()
            .find(|l| l["event"] == "execution_start" && l["exec_id"] == id)
            .expect("start line")
    };
    assert_eq!(start_line(&exec_id)["timeout_seconds"], 1200);
    let sync = d.run("long-job", json!({})).await;
    assert_eq!(sync.status, 200, "{}", sync.text);
    assert_eq!(
        start_line(sync.json["exec_id"].as_str().unwrap())["timeout_seconds"],
        300
    );
    d
}

/// How long a container backend may take to remove a used container: that happens in the
/// background, after the response.
const REMOVAL_LIMIT: Duration = Duration::from_secs(30);

/// A private (0700) directory of executor scripts outside the profile's read-only paths: only each
/// script's own bind mount makes it visible in the sandbox, under fresh parent directories, so the
/// sandbox user (uid 65534) needs nothing but the script's own mode.
struct Scripts {
    dir: tempfile::TempDir,
}

impl Scripts {
    fn new() -> Scripts {
        Self::in_dir(Path::new("/var/tmp"))
    }

    fn in_dir(parent: &Path) -> Scripts {
        let dir = tempfile::Builder::new()
            .prefix("executor-arm-scripts-")
            .tempdir_in(parent)
            .expect("tempdir");
        Scripts { dir }
    }

    /// Writes a python3 executor script, mode 0755.
    fn python(&self, name: &str, body: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.py"));
        std::fs::write(&path, format!("#!/usr/bin/python3\n{body}")).expect("script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .expect("chmod script");
        path
    }
}

/// A def in the `python` profile; `extra_spec` lines are appended under `spec:`.
fn def_yaml(name: &str, command: &Path, extra_spec: &str) -> String {
    format!(
        "schemaVersion: 2\nkind: Executor\nmetadata:\n  name: {name}\nspec:\n  executor_type: external\n  command: {}\n  profile: python\n{extra_spec}",
        command.display()
    )
}

/// A daemon running the `python` profile on one backend.
struct Sandboxed {
    backend: Backend,
    d: Daemon,
    /// The daemon's log lines read so far (they name each run's container).
    log: Vec<String>,
}

impl std::ops::Deref for Sandboxed {
    type Target = Daemon;

    fn deref(&self) -> &Daemon {
        &self.d
    }
}

/// A daemon on `backend` whose executors directory holds `defs` (file name, YAML) when it starts.
fn start(backend: Backend, defs: &[(&str, String)]) -> Sandboxed {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("executors")).expect("executors dir");
    for (file, yaml) in defs {
        write_executor_def(dir.path(), file, yaml);
    }
    let config = match backend {
        Backend::Local => None,
        Backend::Docker | Backend::Gvisor => {
            Some(common::docker::config(1, common::docker::SOCKET))
        }
    };
    let opts = Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config,
        ..Default::default()
    };
    Sandboxed {
        backend,
        d: Daemon::start_in(dir, opts),
        log: Vec::new(),
    }
}

impl Sandboxed {
    /// POST /execute of `action_type: external` with a token holding only ExternalExecute;
    /// `extra`'s fields are merged into the body. A run that reached the sandbox must have run on
    /// this daemon's backend.
    async fn run(&self, command: &str, extra: Value) -> Resp {
        let mut body = json!({ "action_type": "external", "command": command, "capability_token": self.cap(&["ExternalExecute"]) });
        if let Value::Object(m) = extra {
            for (k, v) in m {
                body[k] = v;
            }
        }
        let r = self.exec(body).await;
        if matches!(r.status, 200 | 408) {
            assert_eq!(r.json["backend"], self.backend.name(), "{}", r.text);
        }
        r
    }

    /// Whether run `exec_id`'s container may serve another run: its audit line names the
    /// container and its use count, and the run was not killed.
    fn served_again(&self, exec_id: &str) -> bool {
        self.d.audit_lines().iter().any(|l| {
            l["exec_id"] == exec_id
                && l["event"] == "execution"
                && l["container_uses"].is_u64()
                && l["killed_reason"].is_null()
                && !l["oom"].as_bool().unwrap_or(false)
        })
    }

    /// Checks from the host that nothing of the run `r` is left: no process whose command line
    /// holds `marker`; on the local backend no run cgroup either (waiting for the low-priority
    /// reaper that removes it after the response);
    /// on the container backends neither the run's container nor a host process naming it (its
    /// shim, runsc's sandbox and gofer), waiting for the removal the backend does after responding.
    fn assert_nothing_left(&mut self, r: &Resp, marker: &str) {
        match self.backend {
            Backend::Local => {
                assert_eq!(
                    pids_with_cmdline(marker),
                    Vec::<i32>::new(),
                    "a process of the run survived it"
                );
                self.wait_for_no_run_cgroups();
            }
            Backend::Docker | Backend::Gvisor => {
                let exec_id = r.json["exec_id"].as_str().expect("exec_id");
                let id = container_of(&self.d, exec_id, &mut self.log);
                if self.served_again(exec_id) {
                    // A runc container that ended its run cleanly stays to serve the scope's
                    // next run (pool_reuse): the run's processes are gone, the container not.
                    wait_until(
                        &format!("{exec_id}: no host process holding {marker}"),
                        REMOVAL_LIMIT,
                        || pids_with_cmdline(marker).is_empty(),
                    );
                    return;
                }
                wait_until(
                    &format!("{exec_id}: container {id} removed"),
                    REMOVAL_LIMIT,
                    || !container_exists(&id),
                );
                wait_until(
                    &format!("{exec_id}: no host process holding {marker} or {id}"),
                    REMOVAL_LIMIT,
                    || pids_with_cmdline(marker).is_empty() && pids_with_cmdline(&id).is_empty(),
                );
            }
        }
    }
}

impl Finish for Sandboxed {
    /// Stops the daemon; on the container backends, checks that none of its containers is left.
    fn finish(self) {
        match self.backend {
            Backend::Local => drop(self.d),
            Backend::Docker | Backend::Gvisor => common::docker::finish(self.d),
        }
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn audit_line(d: &Daemon, exec_id: &str) -> Value {
    d.execution_line(exec_id)
}

fn executor_names(r: &Resp) -> Vec<String> {
    r.json["executors"]
        .as_array()
        .expect("executors array")
        .iter()
        .map(|e| e["name"].as_str().expect("name").to_string())
        .collect()
}

/// Polls /v1/executors until `done` holds for the listed names (a SIGHUP reload is asynchronous).
async fn wait_for_executors(d: &Daemon, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    common::wait::wait_for_async(
        "the listed executors to reach the expected state",
        common::wait::CLEANUP,
        || async { executor_names(&d.get("/v1/executors").await) },
        |names| done(names),
    )
    .await
}

/// Sends SIGHUP once the daemon catches it: its handler is installed by a task spawned after the
/// "listening" line, and an uncaught SIGHUP would terminate the daemon instead of reloading.
async fn sighup(d: &Daemon) {
    let caught = || {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|m| m & (1 << (libc::SIGHUP - 1)) != 0)
    };
    common::wait::wait_for_async(
        "the daemon to install its SIGHUP handler",
        common::wait::CLEANUP,
        || async { caught() },
        |caught| *caught,
    )
    .await;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(d.pid(), libc::SIGHUP) }, 0, "SIGHUP");
}

// ---------------------------------------------------------------------------------------------
// Execution: on every backend
// ---------------------------------------------------------------------------------------------

const ECHO_ENVELOPE: &str =
    "import json, sys\nenvelope = json.load(sys.stdin)\nsys.stdout.write(json.dumps(envelope))\n";

async fn success_echoes_the_envelope_with_provenance_and_audit(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python("echo", ECHO_ENVELOPE);
    let d = start(
        backend,
        &[("echo-envelope.yaml", def_yaml("echo-envelope", &script, ""))],
    );
    let def_bytes = std::fs::read(d.dir.path().join("executors/echo-envelope.yaml")).expect("def");

    let activity = json!({ "id": "act-1", "spec_type": "tool", "spec_config": { "k": "v" } });
    let job = json!({ "id": "job-9", "state": "running", "steps": [] });
    let task = json!({ "id": "task-3", "title": "t" });
    let r = d
        .run(
            "echo-envelope",
            json!({ "input": { "q": [1, 2] }, "activity": activity, "job": job, "task": task }),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["success"], true, "{}", r.text);
    assert_eq!(r.json["outcome"], "success");
    assert_eq!(r.json["exit_code"], 0);
    assert_eq!(r.json["profile"], "python");
    assert!(r.json["error_code"].is_null());
    assert!(r.json.get("error").is_none());

    let stdout = r.json["stdout"].as_str().expect("stdout");
    let envelope: Value = serde_json::from_str(stdout).expect("stdout is the envelope");
    assert_eq!(envelope["schemaVersion"], 1);
    assert_eq!(envelope["activity"], activity);
    assert_eq!(envelope["input"], json!({ "q": [1, 2] }));
    assert_eq!(envelope["skills"], json!([]));
    assert_eq!(envelope["memory"], json!({}));
    assert_eq!(envelope["job"], job);
    assert_eq!(envelope["task"], task);

    let p = &r.json["provenance"];
    assert_eq!(p["action_type"], "external");
    assert_eq!(p["capabilities_used"], json!(["ExternalExecute"]));
    assert_eq!(p["executor_def_sha256"], sha256(&def_bytes));
    assert_eq!(p["stdout_sha256"], sha256(stdout.as_bytes()));

    let line = audit_line(&d, r.json["exec_id"].as_str().expect("exec_id"));
    assert_eq!(line["event"], "execution");
    assert_eq!(line["outcome"], "success");
    assert_eq!(line["executor_def_sha256"], sha256(&def_bytes));
    assert!(line.get("error_code").is_some_and(Value::is_null), "{line}");

    // Its receipt names the executor's definition and digests what it wrote.
    let exec_id = r.json["exec_id"].as_str().expect("exec_id");
    let receipt = d
        .get_authorized(&format!("/v1/executions/{exec_id}/receipt"))
        .await;
    assert_eq!(receipt.status, 200, "{}", receipt.text);
    let payload = base64::engine::general_purpose::STANDARD
        .decode(receipt.json["payload"].as_str().expect("payload"))
        .expect("base64");
    let statement: Value = serde_json::from_slice(&payload).expect("statement");
    let what = &statement["predicate"]["what"];
    assert_eq!(what["action_type"], "external");
    assert_eq!(what["executor_def_sha256"], sha256(&def_bytes));
    let stdout_subject = statement["subject"]
        .as_array()
        .expect("subjects")
        .iter()
        .find(|s| s["name"] == "stdout")
        .expect("a stdout subject");
    assert_eq!(
        format!(
            "sha256:{}",
            stdout_subject["digest"]["sha256"].as_str().unwrap()
        ),
        sha256(stdout.as_bytes())
    );
    assert_eq!(
        statement["predicate"]["audit"]["entry_hash"],
        line["entry_hash"]
    );

    // Optional parts absent: job and task are left out, skills and memory keep their defaults.
    let r = d.run("echo-envelope", json!({ "input": "plain", "skills": [{ "id": "s1", "content_hash": "h", "content": "c" }] })).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let envelope: Value =
        serde_json::from_str(r.json["stdout"].as_str().expect("stdout")).expect("envelope");
    let keys: Vec<&str> = envelope
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        ["activity", "input", "memory", "schemaVersion", "skills"]
    );
    assert_eq!(envelope["input"], "plain");
    assert_eq!(envelope["activity"], json!({}));
    assert_eq!(
        envelope["skills"],
        json!([{ "id": "s1", "content_hash": "h", "content": "c" }])
    );
    d
}

async fn an_executor_under_tmp_is_visible_in_the_sandbox(backend: Backend) -> Sandboxed {
    // /tmp is a fresh tmpfs inside the sandbox; the executor's bind mount must not be hidden by it.
    let scripts = Scripts::in_dir(Path::new("/tmp"));
    let script = scripts.python("echo", ECHO_ENVELOPE);
    let d = start(backend, &[("in-tmp.yaml", def_yaml("in-tmp", &script, ""))]);
    let r = d.run("in-tmp", json!({ "input": 7 })).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "success", "{}", r.text);
    let envelope: Value =
        serde_json::from_str(r.json["stdout"].as_str().expect("stdout")).expect("envelope");
    assert_eq!(envelope["input"], 7);
    d
}

async fn a_non_zero_exit_is_a_failure_with_the_trimmed_stderr(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let violation = scripts.python(
        "violation",
        "import sys\nsys.stdin.read()\nsys.stderr.write('\\n  protocol violation: input.q is required  \\n\\n')\nsys.exit(3)\n",
    );
    let silent = scripts.python("silent", "import sys\nsys.stdin.read()\nsys.exit(5)\n");
    let d = start(
        backend,
        &[
            ("violation.yaml", def_yaml("violation", &violation, "")),
            ("silent.yaml", def_yaml("silent", &silent, "")),
        ],
    );
    let def_bytes = std::fs::read(d.dir.path().join("executors/violation.yaml")).expect("def");

    let r = d.run("violation", json!({ "input": {} })).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["success"], false);
    assert_eq!(r.json["outcome"], "failed");
    assert_eq!(r.json["exit_code"], 3);
    assert_eq!(r.json["error_code"], "AGENT_INVOCATION_FAILED");
    assert_eq!(r.json["error"], "protocol violation: input.q is required");
    let line = audit_line(&d, r.json["exec_id"].as_str().expect("exec_id"));
    assert_eq!(line["outcome"], "failed");
    assert_eq!(line["error_code"], "AGENT_INVOCATION_FAILED");
    assert_eq!(line["executor_def_sha256"], sha256(&def_bytes));

    // Nothing on stderr: the message falls back to the exit code.
    let r = d.run("silent", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "failed");
    assert_eq!(r.json["error_code"], "AGENT_INVOCATION_FAILED");
    assert_eq!(r.json["error"], "exit code 5");
    d
}

async fn exiting_without_draining_the_envelope_is_a_failure_whatever_the_exit_code(
    backend: Backend,
) -> Sandboxed {
    let scripts = Scripts::new();
    let zero = scripts.python("no-read-zero", "import sys\nsys.exit(0)\n");
    let seven = scripts.python(
        "no-read-seven",
        "import sys\nsys.stderr.write('bye')\nsys.exit(7)\n",
    );
    let d = start(
        backend,
        &[
            ("no-read-zero.yaml", def_yaml("no-read-zero", &zero, "")),
            ("no-read-seven.yaml", def_yaml("no-read-seven", &seven, "")),
        ],
    );
    // ~900 KB: far beyond a pipe's buffer, within the 1 MiB request body limit.
    let input = "x".repeat(900 * 1024);

    for (name, exit_code) in [("no-read-zero", 0), ("no-read-seven", 7)] {
        let r = d.run(name, json!({ "input": input })).await;
        assert_eq!(r.status, 200, "{name}: {}", r.text);
        assert_eq!(r.json["success"], false, "{name}");
        assert_eq!(r.json["outcome"], "failed", "{name}");
        assert_eq!(r.json["exit_code"], exit_code, "{name}");
        assert_eq!(r.json["error_code"], "AGENT_INVOCATION_FAILED", "{name}");
        let error = r.json["error"].as_str().expect("error");
        assert!(error.contains("broken pipe"), "{name}: {error}");
    }
    d
}

async fn killed_by_a_signal_is_cancelled(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "self-kill",
        "import os, signal, sys\nsys.stdin.read()\nos.kill(os.getpid(), signal.SIGKILL)\n",
    );
    let d = start(
        backend,
        &[("self-kill.yaml", def_yaml("self-kill", &script, ""))],
    );
    let r = d.run("self-kill", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["success"], false);
    assert_eq!(r.json["outcome"], "cancelled");
    assert_eq!(r.json["killed_reason"], "signal");
    assert_eq!(r.json["exit_code"], 128 + libc::SIGKILL);
    assert!(r.json["error_code"].is_null(), "{}", r.text);
    d
}

async fn over_its_timeout_is_408_agent_timeout_and_nothing_is_left(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "sleeper",
        "import sys, time\nsys.stdin.read()\ntime.sleep(120)\n",
    );
    let mut d = start(
        backend,
        &[(
            "sleeper.yaml",
            def_yaml("sleeper", &script, "  timeout_seconds: 1\n"),
        )],
    );
    let r = d.run("sleeper", json!({})).await;
    assert_eq!(r.status, 408, "{}", r.text);
    assert_eq!(r.json["success"], false);
    assert_eq!(r.json["outcome"], "timeout");
    assert_eq!(r.json["killed_reason"], "timeout");
    assert_eq!(r.json["error_code"], "AGENT_TIMEOUT");
    let line = audit_line(&d, r.json["exec_id"].as_str().expect("exec_id"));
    assert_eq!(line["error_code"], "AGENT_TIMEOUT");
    // The script's path is unique to this test.
    d.assert_nothing_left(&r, &script.display().to_string());
    d
}

async fn a_background_child_does_not_outlive_the_run(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    // Double fork + setsid + exec with the marker in argv; the script returns only once it has
    // seen the detached process running (from inside the sandbox).
    let script = scripts.python(
        "leaver",
        r#"import os, sys, time
sys.stdin.read()
marker = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/python3", ["/usr/bin/python3", "-c", "import time; time.sleep(300)", marker])
    os._exit(0)
os.wait()
def running():
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and int(pid) != os.getpid():
                    return True
        except (OSError, ValueError):
            pass
    return False
for _ in range(600):
    if running():
        print("background child running")
        sys.exit(0)
    time.sleep(0.05)
sys.exit("background child never started")
"#,
    );
    let marker = format!("executor-arm-leaver-{}", uuid::Uuid::new_v4().simple());
    let mut d = start(
        backend,
        &[(
            "leaver.yaml",
            def_yaml("leaver", &script, &format!("  args: [{marker}]\n")),
        )],
    );
    let r = d.run("leaver", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "success", "{}", r.text);
    assert_eq!(r.json["stdout"], "background child running\n");
    d.assert_nothing_left(&r, &marker);
    assert_eq!(
        d.get("/health").await.status,
        200,
        "the daemon still answers"
    );
    d
}

async fn injected_env_argv_and_model_flag(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "env-probe",
        r#"import json, os, sys
sys.stdin.read()
keys = ["ORBIT_AGENT_NAME", "ORBIT_AGENT_MODEL", "ORBIT_ACTIVITY_ID", "ORBIT_ACTIVITY_TOOLS",
        "ORBIT_PROC_ALLOWED_PROGRAMS", "ACME_PROFILE", "PATH", "HOME"]
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "all": sorted(os.environ)}))
"#,
    );
    let probe = def_yaml(
        "env-probe",
        &script,
        "  args: [run, --json]\n  model_flag: --model\n  env:\n    ACME_PROFILE: ci\n",
    );
    let override_def = def_yaml(
        "env-override",
        &script,
        "  model_flag: --model\n  env:\n    ORBIT_AGENT_NAME: operator-name\n    ORBIT_AGENT_MODEL: operator-model\n    ORBIT_ACTIVITY_ID: operator-activity\n",
    );
    let d = start(
        backend,
        &[
            ("env-probe.yaml", probe),
            ("env-override.yaml", override_def),
        ],
    );
    let stdout = |r: &Resp| -> Value {
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.json["outcome"], "success", "{}", r.text);
        serde_json::from_str(r.json["stdout"].as_str().expect("stdout")).expect("probe output")
    };

    let out = stdout(
        &d.run(
            "env-probe",
            json!({ "model": "model-x", "activity": { "id": "act-42" } }),
        )
        .await,
    );
    assert_eq!(out["argv"], json!(["run", "--json", "--model", "model-x"]));
    assert_eq!(out["env"]["ORBIT_AGENT_NAME"], "env-probe");
    assert_eq!(out["env"]["ORBIT_AGENT_MODEL"], "model-x");
    assert_eq!(out["env"]["ORBIT_ACTIVITY_ID"], "act-42");
    assert_eq!(out["env"]["ACME_PROFILE"], "ci");
    assert_eq!(out["env"]["PATH"], "/usr/local/bin:/usr/bin:/bin");
    assert_eq!(out["env"]["HOME"], "/work");
    // Nothing of the daemon's own environment reaches the executor.
    for name in out["all"].as_array().expect("names") {
        let name = name.as_str().expect("name");
        assert!(
            !name.starts_with("EXECUTOR_ARM_") && name != "RUST_LOG",
            "leaked {name}"
        );
    }

    // No model: neither the variable nor the flag; a numeric activity id is passed as text.
    let out = stdout(
        &d.run("env-probe", json!({ "activity": { "id": 17 } }))
            .await,
    );
    assert_eq!(out["argv"], json!(["run", "--json"]));
    assert!(out["env"]["ORBIT_AGENT_MODEL"].is_null());
    assert_eq!(out["env"]["ORBIT_ACTIVITY_ID"], "17");
    // Undeclared: no variable.
    assert!(out["env"]["ORBIT_ACTIVITY_TOOLS"].is_null());
    assert!(out["env"]["ORBIT_PROC_ALLOWED_PROGRAMS"].is_null());

    // Declared tools and allowed programs: names, comma-separated; an empty list is declared too.
    let out = stdout(
        &d.run(
            "env-probe",
            json!({ "activity": { "id": "a", "tools": ["read_file", {"name": "web_search"}],
                                  "allowed_programs": [] } }),
        )
        .await,
    );
    assert_eq!(out["env"]["ORBIT_ACTIVITY_TOOLS"], "read_file,web_search");
    assert_eq!(out["env"]["ORBIT_PROC_ALLOWED_PROGRAMS"], "");
    let out = stdout(
        &d.run(
            "env-probe",
            json!({ "activity": { "allowed_programs": ["git", "python3"] } }),
        )
        .await,
    );
    assert_eq!(out["env"]["ORBIT_PROC_ALLOWED_PROGRAMS"], "git,python3");
    // A list that cannot be passed as names is refused, not garbled.
    for bad in [json!("git"), json!(["a,b"]), json!([1]), json!([{"id": 1}])] {
        let r = d
            .run("env-probe", json!({ "activity": { "tools": bad } }))
            .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text);
        assert_eq!(r.json["error_type"], "InvalidRequest", "{}", r.text);
    }

    // The operator's env wins over the injected variables; the model flag still follows the request.
    let out = stdout(
        &d.run(
            "env-override",
            json!({ "model": "model-y", "activity": { "id": "act-7" } }),
        )
        .await,
    );
    assert_eq!(out["argv"], json!(["--model", "model-y"]));
    assert_eq!(out["env"]["ORBIT_AGENT_NAME"], "operator-name");
    assert_eq!(out["env"]["ORBIT_AGENT_MODEL"], "operator-model");
    assert_eq!(out["env"]["ORBIT_ACTIVITY_ID"], "operator-activity");
    d
}

async fn the_executor_file_is_a_read_only_bind(backend: Backend) -> Sandboxed {
    let scripts = Scripts::new();
    let script = scripts.python(
        "self-writer",
        r#"import errno, json, sys
envelope = json.load(sys.stdin)
try:
    with open(__file__, "a") as f:
        f.write("tampered")
    print("written")
except OSError as e:
    print("refused", errno.errorcode.get(e.errno, e.errno))
sys.exit(envelope["input"]["exit"])
"#,
    );
    // Writable by everyone on the host: only the sandbox's read-only bind keeps it unchanged.
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let before = std::fs::read(&script).expect("script");
    let d = start(
        backend,
        &[("self-writer.yaml", def_yaml("self-writer", &script, ""))],
    );
    // Twice, with a failure in between: each run gets the file as the def names it.
    for exit in [0, 3, 0] {
        let r = d
            .run("self-writer", json!({ "input": { "exit": exit } }))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.json["exit_code"], exit, "{}", r.text);
        assert_eq!(r.json["stdout"], "refused EROFS\n", "{}", r.text);
        assert_eq!(
            std::fs::read(&script).expect("script"),
            before,
            "the host file changed"
        );
    }
    d
}

// ---------------------------------------------------------------------------------------------
// Registration: backend-independent, once
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn registration_rules() {
    let scripts = Scripts::new();
    let script = scripts.python("ok", "import sys\nsys.stdin.read()\nprint('ok')\n");
    let no_command = "schemaVersion: 2\nkind: Executor\nmetadata:\n  name: no-command\nspec:\n  executor_type: external\n  args: [x]\n".to_string();
    let future = def_yaml(
        "future",
        &script,
        "  sandbox: strict\n  allow_fallback: false\n  some_later_field: { nested: [1, 2] }\n",
    );
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/executors/external.example.yaml"),
    )
    .expect("example");
    let d = start(
        Backend::Local,
        &[
            ("no-command.yaml", no_command),
            ("file-stem.yaml", def_yaml("metadata-name", &script, "")),
            ("future.yaml", future),
            ("external.example.yaml", example.clone()),
            ("acme-harness.example.yaml", example.clone()),
        ],
    );

    let names = executor_names(&d.get("/v1/executors").await);
    assert_eq!(names, ["future"]);
    // The template itself is a valid def once copied to its own name.
    executor_arm::executors::parse_def(Path::new("/x/acme-harness.yaml"), example.as_bytes())
        .expect("the example parses");

    for name in ["no-command", "file-stem", "metadata-name", "acme-harness"] {
        let r = d.run(name, json!({})).await;
        assert_eq!(r.status, 403, "{name}: {}", r.text);
        assert_eq!(r.json["error_type"], "CapabilityViolation", "{name}");
    }
    let r = d.run("future", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "success", "{}", r.text);
    assert_eq!(r.json["stdout"], "ok\n");

    // The token must carry ExternalExecute.
    let r = d.exec(json!({ "action_type": "external", "command": "future", "capability_token": d.cap(&["ShellExecute", "PythonExecute"]) })).await;
    assert_eq!(r.status, 403, "{}", r.text);
    assert!(
        r.json["error"]
            .as_str()
            .expect("error")
            .contains("ExternalExecute"),
        "{}",
        r.text
    );
    // The def fixes argv and stdin.
    let r = d.run("future", json!({ "args": ["--evil"] })).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let r = d
        .run("future", json!({ "stdin": "not the envelope" }))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
}

#[tokio::test]
async fn a_missing_command_file_is_503_not_a_sandbox_failure() {
    let scripts = Scripts::new();
    let d = start(
        Backend::Local,
        &[(
            "gone.yaml",
            def_yaml("gone", &scripts.dir.path().join("gone.py"), ""),
        )],
    );
    assert_eq!(executor_names(&d.get("/v1/executors").await), ["gone"]);
    let r = d.run("gone", json!({})).await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert!(
        r.json["error"]
            .as_str()
            .expect("error")
            .contains("not an executable file"),
        "{}",
        r.text
    );
}

#[tokio::test]
async fn sighup_reloads_defs_and_listings_never_show_env_values() {
    let scripts = Scripts::new();
    let script = scripts.python("ok", "import sys\nsys.stdin.read()\nprint('ok')\n");
    let secret = format!("env-value-{}", uuid::Uuid::new_v4().simple());
    let first = def_yaml(
        "first",
        &script,
        &format!("  env:\n    ACME_TOKEN: {secret}\n"),
    );
    let d = start(Backend::Local, &[("first.yaml", first)]);
    assert_eq!(executor_names(&d.get("/v1/executors").await), ["first"]);

    let second_path = write_executor_def(
        d.dir.path(),
        "second.yaml",
        &def_yaml("second", &script, &format!("  env:\n    OTHER: {secret}\n")),
    );
    sighup(&d).await;
    let names = wait_for_executors(&d, |n| n.iter().any(|x| x == "second")).await;
    assert_eq!(names, ["first", "second"]);
    let r = d.run("second", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["outcome"], "success", "{}", r.text);
    assert_eq!(
        r.json["provenance"]["executor_def_sha256"],
        sha256(&std::fs::read(&second_path).expect("def"))
    );

    for path in ["/v1/executors", "/capabilities"] {
        let r = d.get(path).await;
        assert_eq!(r.status, 200, "{path}");
        assert!(
            !r.text.contains(&secret),
            "{path} shows an env value: {}",
            r.text
        );
    }

    std::fs::remove_file(d.dir.path().join("executors/first.yaml")).expect("remove def");
    sighup(&d).await;
    let names = wait_for_executors(&d, |n| !n.iter().any(|x| x == "first")).await;
    assert_eq!(names, ["second"]);
    let r = d.run("first", json!({})).await;
    assert_eq!(r.status, 403, "{}", r.text);
}

#[test]
fn check_config_warns_of_a_def_timeout_above_the_synchronous_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let long = dir.path().join("long-job.yaml");
    std::fs::write(
        &long,
        "schemaVersion: 2\nkind: Executor\nmetadata:\n  name: long-job\nspec:\n  executor_type: external\n  command: /bin/true\n  timeout_seconds: 1800\n",
    )
    .expect("def");
    std::fs::write(
        dir.path().join("short-job.yaml"),
        "schemaVersion: 2\nkind: Executor\nmetadata:\n  name: short-job\nspec:\n  executor_type: external\n  command: /bin/true\n  timeout_seconds: 300\n",
    )
    .expect("def");
    let out = std::process::Command::new(common::bin())
        .arg("check-config")
        .env("EXECUTOR_ARM_EXECUTORS_DIR", dir.path())
        .env(
            "EXECUTOR_ARM_PROFILES_DIR",
            concat!(env!("CARGO_MANIFEST_DIR"), "/sandbox-profiles"),
        )
        .output()
        .expect("check-config");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("warning: executor"))
        .collect();
    assert_eq!(
        warnings,
        [
            "warning: executor 'long-job': timeout_seconds 1800 is above 300: synchronous runs are cut at 300 s; async and streamed runs get it, up to the profile's max_async_timeout_seconds"
        ],
        "{text}"
    );
}
