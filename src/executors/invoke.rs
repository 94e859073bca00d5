//! Turning an `action_type: external` request into a plan plus the protocol's envelope, argv and
//! env; and mapping the run's outcome to the protocol's `error_code` / `error`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::{ExecutorDef, Registry, StdinSource};
use crate::policy::{ActionType, Ask, Capability, Grant, Plan, Policy, PolicyError, Refusal};
use crate::sandbox::{ExitKind, RunOutcome};

/// Profile used when a def names none.
pub const DEFAULT_PROFILE: &str = "shell-readonly";

/// What the sandbox needs beyond the plan to run an external executor.
#[derive(Debug, Clone)]
pub struct ExternalInvocation {
    pub argv_tail: Vec<String>,
    /// What the executor reads on stdin: the envelope, or the request's `stdin` for a def that
    /// says `stdin: request`.
    pub stdin: Vec<u8>,
    pub env: BTreeMap<String, String>,
    /// The executor's file, bound read-only at the same path inside the sandbox.
    pub extra_files: Vec<(PathBuf, PathBuf)>,
    pub def_sha256: String,
}

/// What an `external` request carries besides its ask: its args and stdin (which only a def
/// that opts in takes), the envelope's parts, the model and `metadata.orbit`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExternalCall<'a> {
    pub args: &'a [String],
    pub stdin: Option<&'a str>,
    /// `metadata.orbit`: the Orbit run, job and step the call belongs to.
    pub orbit: Option<&'a Value>,
    pub activity: Option<&'a Value>,
    pub input: Option<&'a Value>,
    pub skills: Option<&'a Value>,
    pub memory: Option<&'a Value>,
    pub job: Option<&'a Value>,
    pub task: Option<&'a Value>,
    pub model: Option<&'a str>,
}

/// `activity.<key>` as a comma-separated list of names, when the activity declares it: an array
/// of names, or of objects with a `name`. Anything else is refused rather than passed on garbled.
fn activity_names(activity: Option<&Value>, key: &str) -> Result<Option<String>, PolicyError> {
    let Some(declared) = activity.and_then(|a| a.get(key)) else {
        return Ok(None);
    };
    let invalid = || {
        PolicyError::Invalid(format!(
            "activity.{key} must be an array of names (strings without ',' or NUL, or objects \
             with such a \"name\")"
        ))
    };
    let items = declared.as_array().ok_or_else(invalid)?;
    let mut names = Vec::with_capacity(items.len());
    for item in items {
        let name = match item {
            Value::String(s) => s.as_str(),
            Value::Object(o) => o.get("name").and_then(Value::as_str).ok_or_else(invalid)?,
            _ => return Err(invalid()),
        };
        if name.is_empty() || name.contains([',', '\0']) {
            return Err(invalid());
        }
        names.push(name);
    }
    Ok(Some(names.join(",")))
}

/// The longest Orbit id (`metadata.orbit.run_id`, `job_id`, `step_id`) passed to an executor.
pub const MAX_ORBIT_ID_LEN: usize = 256;

/// The `ORBIT_RUN_ID`, `ORBIT_JOB_ID` and `ORBIT_STEP_ID` of `metadata.orbit`: each id given as a
/// string (or an integer) of 1-256 characters without control characters; anything else is
/// refused rather than passed on.
fn orbit_vars(orbit: Option<&Value>) -> Result<Vec<(&'static str, String)>, PolicyError> {
    let Some(orbit) = orbit else {
        return Ok(Vec::new());
    };
    let orbit = orbit.as_object().ok_or_else(|| {
        PolicyError::Invalid("metadata.orbit must be an object of run_id, job_id, step_id".into())
    })?;
    let mut vars = Vec::new();
    for (key, var) in [
        ("run_id", "ORBIT_RUN_ID"),
        ("job_id", "ORBIT_JOB_ID"),
        ("step_id", "ORBIT_STEP_ID"),
    ] {
        let id = match orbit.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => n.to_string(),
            Some(_) => String::new(),
        };
        let n = id.chars().count();
        if n == 0 || n > MAX_ORBIT_ID_LEN || id.chars().any(char::is_control) {
            return Err(PolicyError::Invalid(format!(
                "metadata.orbit.{key} must be a string (or an integer) of 1-{MAX_ORBIT_ID_LEN} \
                 characters without control characters"
            )));
        }
        vars.push((var, id));
    }
    Ok(vars)
}

/// The request's args, when the def takes them: at most `request_args.max`, each matching its
/// pattern in full.
fn request_args(def: &ExecutorDef, args: &[String]) -> Result<(), PolicyError> {
    if args.is_empty() {
        return Ok(());
    }
    let Some(allowed) = &def.request_args else {
        return Err(PolicyError::Invalid(format!(
            "args are not accepted by executor '{}': its def fixes them (no spec.request_args)",
            def.name
        )));
    };
    if args.len() > allowed.max {
        return Err(PolicyError::Invalid(format!(
            "executor '{}' takes at most {} request args, got {}",
            def.name,
            allowed.max,
            args.len()
        )));
    }
    if let Some((i, arg)) = args.iter().enumerate().find(|(_, a)| !allowed.accepts(a)) {
        return Err(PolicyError::Invalid(format!(
            "args[{i}] '{}' does not match the pattern executor '{}' allows for request args",
            crate::auth::clip(&arg.escape_debug().to_string(), 128),
            def.name
        )));
    }
    Ok(())
}

/// The schemaVersion-1 request envelope written to the executor's stdin.
pub fn envelope(req: &ExternalCall<'_>) -> Value {
    let mut m = Map::new();
    m.insert("schemaVersion".into(), json!(1));
    m.insert(
        "activity".into(),
        req.activity.cloned().unwrap_or_else(|| json!({})),
    );
    m.insert(
        "input".into(),
        req.input.cloned().unwrap_or_else(|| json!({})),
    );
    m.insert(
        "skills".into(),
        req.skills.cloned().unwrap_or_else(|| json!([])),
    );
    m.insert(
        "memory".into(),
        req.memory.cloned().unwrap_or_else(|| json!({})),
    );
    if let Some(j) = req.job {
        m.insert("job".into(), j.clone());
    }
    if let Some(t) = req.task {
        m.insert("task".into(), t.clone());
    }
    Value::Object(m)
}

/// The plan and the invocation of the registered executor `ask.command`, or why not.
pub fn decide(
    executors: &Registry,
    policy: &Policy,
    ask: &Ask<'_>,
    grant: &Grant,
    req: &ExternalCall<'_>,
) -> Result<(Plan, ExternalInvocation), PolicyError> {
    let Some(def) = executors.get(ask.command) else {
        return Err(PolicyError::Refused(Refusal {
            rule: "executors",
            reason: format!(
                "No external executor named '{}' is registered",
                ask.command.escape_debug()
            ),
        }));
    };
    request_args(&def, req.args)?;
    if req.stdin.is_some() && def.stdin == StdinSource::Envelope {
        return Err(PolicyError::Invalid(format!(
            "stdin is not accepted by executor '{}': the envelope is its stdin (no spec.stdin: \
             request)",
            def.name
        )));
    }
    let timeout = match (ask.timeout_seconds, def.timeout_seconds) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let ask = Ask {
        timeout_seconds: timeout,
        ..ask.clone()
    };
    let profile = def.profile.as_deref().unwrap_or(DEFAULT_PROFILE);
    let plan = policy.finish(
        &def.name,
        Path::new(&def.command),
        ActionType::External,
        &[Capability::ExternalExecute],
        profile,
        &ask,
        grant,
    )?;
    // Checked only once the caller is authorised: a missing or non-executable command is the
    // operator's error (503 naming it), not a sandbox setup failure (500).
    if !is_executable_file(Path::new(&def.command)) {
        return Err(PolicyError::Unavailable(format!(
            "executor '{}': {} is not an executable file",
            def.name, def.command
        )));
    }

    let mut argv_tail = def.args.clone();
    if let (Some(flag), Some(model)) = (&def.model_flag, req.model) {
        argv_tail.push(flag.clone());
        argv_tail.push(model.to_string());
    }
    // The request's own (checked above), last.
    argv_tail.extend(req.args.iter().cloned());
    let mut env = BTreeMap::new();
    env.insert("ORBIT_AGENT_NAME".to_string(), def.name.clone());
    if let Some(model) = req.model {
        env.insert("ORBIT_AGENT_MODEL".to_string(), model.to_string());
    }
    let activity_id = req
        .activity
        .and_then(|a| a.get("id"))
        .and_then(|id| match id {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        });
    if let Some(id) = activity_id {
        env.insert("ORBIT_ACTIVITY_ID".to_string(), id);
    }
    // What the activity declares it may use, for executors that enforce it themselves.
    for (key, var) in [
        ("tools", "ORBIT_ACTIVITY_TOOLS"),
        ("allowed_programs", "ORBIT_PROC_ALLOWED_PROGRAMS"),
    ] {
        if let Some(names) = activity_names(req.activity, key)? {
            env.insert(var.to_string(), names);
        }
    }
    // The Orbit run, job and step the call belongs to.
    for (var, id) in orbit_vars(req.orbit)? {
        env.insert(var.to_string(), id);
    }
    // The operator's env wins on conflict.
    env.extend(def.env.clone());
    if env
        .values()
        .chain(argv_tail.iter())
        .any(|v| v.contains('\0'))
    {
        return Err(PolicyError::Invalid(
            "model or env contains a NUL byte".into(),
        ));
    }
    let full_env: BTreeMap<&str, &str> = plan
        .env
        .iter()
        .chain(env.iter())
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    crate::sandbox::check_exec_size(
        std::iter::once(def.command.as_str()).chain(argv_tail.iter().map(String::as_str)),
        full_env,
    )
    .map_err(PolicyError::Invalid)?;
    let stdin = match def.stdin {
        StdinSource::Envelope => {
            serde_json::to_vec(&envelope(req)).map_err(|e| PolicyError::Invalid(e.to_string()))?
        }
        StdinSource::Request => req.stdin.unwrap_or_default().as_bytes().to_vec(),
    };
    let cmd = PathBuf::from(&def.command);
    Ok((
        plan,
        ExternalInvocation {
            argv_tail,
            stdin,
            env,
            extra_files: vec![(cmd.clone(), cmd)],
            def_sha256: def.def_sha256.clone(),
        },
    ))
}

fn is_executable_file(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The protocol's `error_code` and `error` for an outcome.
pub fn error_fields(o: &RunOutcome, outcome: &str) -> (Option<&'static str>, Option<String>) {
    match outcome {
        "success" => (None, None),
        "timeout" => (
            Some("AGENT_TIMEOUT"),
            Some("executor exceeded its timeout".into()),
        ),
        "cancelled" => (
            None,
            Some(match o.exit {
                ExitKind::Signaled(s) => format!("executor killed by signal {s}"),
                _ => "executor killed".into(),
            }),
        ),
        _ => {
            let stderr = String::from_utf8_lossy(&o.stderr).trim().to_string();
            let msg = if o.stdin_broken_pipe {
                "executor exited without draining stdin (broken pipe)".to_string()
            } else if !stderr.is_empty() {
                stderr
            } else {
                format!("exit code {}", o.exit_code())
            };
            (Some("AGENT_INVOCATION_FAILED"), Some(msg))
        }
    }
}
