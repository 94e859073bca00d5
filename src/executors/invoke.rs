//! Turning an `action_type: external` request into a plan plus the protocol's envelope, argv and
//! env; and mapping the run's outcome to the protocol's `error_code` / `error`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::Registry;
use crate::policy::{ActionType, Ask, Capability, Grant, Plan, Policy, PolicyError, Refusal};
use crate::sandbox::{ExitKind, RunOutcome};

/// Profile used when a def names none.
pub const DEFAULT_PROFILE: &str = "shell-readonly";

/// What the sandbox needs beyond the plan to run an external executor.
#[derive(Debug, Clone)]
pub struct ExternalInvocation {
    pub argv_tail: Vec<String>,
    pub envelope: Vec<u8>,
    pub env: BTreeMap<String, String>,
    /// The executor's file, bound read-only at the same path inside the sandbox.
    pub extra_files: Vec<(PathBuf, PathBuf)>,
    pub def_sha256: String,
}

/// What an `external` request carries besides its ask: the envelope's parts and the model, and
/// whether it also sent what an executor does not take (args, stdin).
#[derive(Debug, Clone, Copy, Default)]
pub struct ExternalCall<'a> {
    pub has_args: bool,
    pub has_stdin: bool,
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
) -> Result<(Plan, Option<ExternalInvocation>), PolicyError> {
    let Some(def) = executors.get(ask.command) else {
        return Err(PolicyError::Refused(Refusal {
            rule: "executors",
            reason: format!(
                "No external executor named '{}' is registered",
                ask.command.escape_debug()
            ),
        }));
    };
    if req.has_args {
        return Err(PolicyError::Invalid(
            "args are not accepted for external executors: the def fixes them".into(),
        ));
    }
    if req.has_stdin {
        return Err(PolicyError::Invalid(
            "stdin is not accepted for external executors: the envelope is their stdin".into(),
        ));
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
    let envelope =
        serde_json::to_vec(&envelope(req)).map_err(|e| PolicyError::Invalid(e.to_string()))?;
    let cmd = PathBuf::from(&def.command);
    Ok((
        plan,
        Some(ExternalInvocation {
            argv_tail,
            envelope,
            env,
            extra_files: vec![(cmd.clone(), cmd)],
            def_sha256: def.def_sha256.clone(),
        }),
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
