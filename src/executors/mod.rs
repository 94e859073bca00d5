//! External executors (External Executor Protocol v1): operator-registered programs, declared
//! by YAML in the executors directory and always run inside a sandbox.
//!
//! Owns: loading and validating defs, the registry readers see, reloading on SIGHUP.
//! Must not: spawn anything itself (the sandbox backends do).

use std::collections::BTreeMap;
pub mod invoke;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One registered executor.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ExecutorDef {
    pub name: String,
    pub command: String,
    pub args: Vec<String>,
    #[serde(skip)]
    pub env: BTreeMap<String, String>,
    pub model_flag: Option<String>,
    pub timeout_seconds: Option<u64>,
    pub profile: Option<String>,
    /// What the executor reads on stdin.
    pub stdin: StdinSource,
    /// The arguments a request may append, when the def takes any.
    pub request_args: Option<RequestArgs>,
    /// `sha256:` of the def file's bytes.
    pub def_sha256: String,
    #[serde(skip)]
    pub source: PathBuf,
}

/// What an executor reads on stdin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StdinSource {
    /// The protocol's JSON envelope (a request's `stdin` is refused).
    #[default]
    Envelope,
    /// The request's `stdin` (empty when it has none); no envelope is written.
    Request,
}

/// The most arguments a def may let a request append.
pub const MAX_REQUEST_ARGS: usize = 64;
/// The longest `request_args.pattern`.
const MAX_PATTERN_LEN: usize = 1024;

/// The arguments a request may append after the def's: at most `max`, each matching `pattern`
/// as a whole.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RequestArgs {
    pub max: usize,
    /// A regular expression (Rust `regex` syntax) every argument must match in full.
    pub pattern: String,
    #[serde(skip)]
    #[schema(ignore)]
    matcher: regex::Regex,
}

impl RequestArgs {
    fn new(max: usize, pattern: String) -> Result<RequestArgs, String> {
        if !(1..=MAX_REQUEST_ARGS).contains(&max) {
            return Err(format!(
                "spec.request_args.max must be between 1 and {MAX_REQUEST_ARGS}"
            ));
        }
        if pattern.is_empty() || pattern.len() > MAX_PATTERN_LEN {
            return Err(format!(
                "spec.request_args.pattern must be 1-{MAX_PATTERN_LEN} bytes"
            ));
        }
        // Anchored at both ends: an argument matches as a whole or not at all.
        let matcher = regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
            .size_limit(1 << 20)
            .build()
            .map_err(|e| format!("spec.request_args.pattern is not a valid regex: {e}"))?;
        Ok(RequestArgs {
            max,
            pattern,
            matcher,
        })
    }

    /// Whether `arg` is one the def takes.
    pub fn accepts(&self, arg: &str) -> bool {
        self.matcher.is_match(arg)
    }
}

impl ExecutorDef {
    /// Why the def's `timeout_seconds` will not be had in full by synchronous runs, when it
    /// asks for more than they may last.
    pub fn timeout_note(&self) -> Option<String> {
        let max = crate::policy::profile::MAX_TIMEOUT_SECONDS;
        self.timeout_seconds.filter(|t| *t > max).map(|t| {
            format!(
                "executor '{}': timeout_seconds {t} is above {max}: synchronous runs are cut at \
                 {max} s; async and streamed runs get it, up to the profile's \
                 max_async_timeout_seconds",
                self.name
            )
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DefFile {
    schema_version: u32,
    kind: String,
    metadata: Metadata,
    spec: Spec,
}

#[derive(Debug, Deserialize)]
struct Metadata {
    name: String,
}

/// Unknown spec fields are tolerated (additive evolution of the protocol).
#[derive(Debug, Deserialize)]
struct Spec {
    executor_type: String,
    #[serde(default)]
    command: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    model_flag: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<u64>,
    #[serde(default)]
    profile: Option<String>,
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    request_args: Option<RequestArgsSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestArgsSpec {
    max: usize,
    pattern: String,
}

/// Why a def file was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub file: PathBuf,
    pub reason: String,
}

/// Parses one def; `Err` carries the reason it is skipped.
pub fn parse_def(path: &Path, bytes: &[u8]) -> Result<ExecutorDef, String> {
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    let f: DefFile = serde_yaml_ng::from_slice(bytes).map_err(|e| format!("invalid YAML: {e}"))?;
    if f.schema_version != 2 {
        return Err(format!("schemaVersion {} is not 2", f.schema_version));
    }
    if f.kind != "Executor" {
        return Err(format!("kind '{}' is not Executor", f.kind));
    }
    if f.metadata.name != stem {
        return Err(format!(
            "metadata.name '{}' does not match the file name '{stem}'",
            f.metadata.name
        ));
    }
    if !crate::policy::is_bare_name(&f.metadata.name) {
        return Err("metadata.name must be a plain name".into());
    }
    if f.spec.executor_type != "external" {
        return Err(format!(
            "spec.executor_type '{}' is not external",
            f.spec.executor_type
        ));
    }
    let command = f
        .spec
        .command
        .filter(|c| !c.trim().is_empty())
        .ok_or("spec.command is required")?;
    if !command.starts_with('/') {
        return Err("spec.command must be an absolute path".into());
    }
    if f.spec.timeout_seconds == Some(0) {
        return Err("spec.timeout_seconds must be > 0".into());
    }
    let stdin = match f.spec.stdin.as_deref() {
        None | Some("envelope") => StdinSource::Envelope,
        Some("request") => StdinSource::Request,
        Some(other) => {
            return Err(format!("spec.stdin '{other}' is not envelope or request"));
        }
    };
    let request_args = f
        .spec
        .request_args
        .map(|r| RequestArgs::new(r.max, r.pattern))
        .transpose()?;
    Ok(ExecutorDef {
        name: f.metadata.name,
        command,
        args: f.spec.args,
        env: f.spec.env,
        model_flag: f.spec.model_flag,
        timeout_seconds: f.spec.timeout_seconds,
        profile: f.spec.profile,
        stdin,
        request_args,
        def_sha256: format!("sha256:{}", hex::encode(Sha256::digest(bytes))),
        source: path.to_path_buf(),
    })
}

/// Loads every `*.yaml` / `*.yml` of `dir` (the `*.example.yaml` templates are never loaded).
pub fn load_dir(dir: &Path) -> (BTreeMap<String, Arc<ExecutorDef>>, Vec<Skipped>) {
    let mut defs = BTreeMap::new();
    let mut skipped = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (defs, skipped);
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
    paths.sort();
    for path in paths {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if !is_yaml || name.contains(".example.") || !path.is_file() {
            continue;
        }
        let result = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| parse_def(&path, &b));
        match result {
            // `acme.yaml` and `acme.yml` both claim `acme`: the first (sorted) one is kept, so a
            // reload never swaps one for the other depending on directory order.
            Ok(def) if defs.contains_key(&def.name) => {
                let reason = format!("executor '{}' is already defined by another file", def.name);
                tracing::warn!(file = %path.display(), %reason, "executor def skipped");
                skipped.push(Skipped { file: path, reason });
            }
            Ok(def) => {
                if let Some(note) = def.timeout_note() {
                    tracing::warn!(file = %path.display(), "{note}");
                }
                defs.insert(def.name.clone(), Arc::new(def));
            }
            Err(reason) => {
                tracing::warn!(file = %path.display(), %reason, "executor def skipped");
                skipped.push(Skipped { file: path, reason });
            }
        }
    }
    (defs, skipped)
}

/// The live registry; readers get a snapshot, a reload swaps it (in-flight runs keep theirs).
pub struct Registry {
    dir: PathBuf,
    defs: RwLock<BTreeMap<String, Arc<ExecutorDef>>>,
}

impl Registry {
    pub fn load(dir: &Path) -> Self {
        let (defs, _) = load_dir(dir);
        Registry {
            dir: dir.to_path_buf(),
            defs: RwLock::new(defs),
        }
    }

    pub fn reload(&self) -> Vec<Skipped> {
        let (defs, skipped) = load_dir(&self.dir);
        tracing::info!(count = defs.len(), "executor defs reloaded");
        *self.defs.write().unwrap_or_else(|p| p.into_inner()) = defs;
        skipped
    }

    pub fn get(&self, name: &str) -> Option<Arc<ExecutorDef>> {
        self.defs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    pub fn list(&self) -> Vec<ExecutorDef> {
        self.defs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|d| (**d).clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "schemaVersion: 2\nkind: Executor\nmetadata:\n  name: acme\nspec:\n  executor_type: external\n  command: /opt/acme/run\n  args: [run, --json]\n  env: {A: b}\n  model_flag: --model\n  timeout_seconds: 10\n  future_field: 1\n";

    #[test]
    fn parses_and_tolerates_unknown_spec_fields() {
        let d = parse_def(Path::new("/x/acme.yaml"), GOOD.as_bytes()).unwrap();
        assert_eq!(d.command, "/opt/acme/run");
        assert_eq!(d.args, vec!["run", "--json"]);
        assert!(d.def_sha256.starts_with("sha256:"));
    }

    #[test]
    fn skips_bad_defs() {
        assert!(
            parse_def(Path::new("/x/other.yaml"), GOOD.as_bytes())
                .unwrap_err()
                .contains("does not match")
        );
        let no_cmd = GOOD.replace("  command: /opt/acme/run\n", "");
        assert!(
            parse_def(Path::new("/x/acme.yaml"), no_cmd.as_bytes())
                .unwrap_err()
                .contains("command")
        );
    }

    #[test]
    fn stdin_and_request_args_are_opted_into_and_checked_at_load() {
        let d = parse_def(Path::new("/x/acme.yaml"), GOOD.as_bytes()).unwrap();
        assert_eq!(d.stdin, StdinSource::Envelope);
        assert!(d.request_args.is_none());
        let opted = format!(
            "{GOOD}  stdin: request\n  request_args:\n    max: 2\n    pattern: '--resume|[0-9a-f]{{8}}'\n"
        );
        let d = parse_def(Path::new("/x/acme.yaml"), opted.as_bytes()).unwrap();
        assert_eq!(d.stdin, StdinSource::Request);
        let args = d.request_args.unwrap();
        assert_eq!(args.max, 2);
        assert!(args.accepts("--resume") && args.accepts("0123abcd"));
        // Anchored: a match inside the argument is not enough.
        for bad in ["x--resume", "--resume;rm", "0123abcd0", "", "--res"] {
            assert!(!args.accepts(bad), "{bad}");
        }
        for (bad, why) in [
            ("  stdin: file\n", "spec.stdin"),
            ("  request_args:\n    max: 0\n    pattern: x\n", "max"),
            ("  request_args:\n    max: 65\n    pattern: x\n", "max"),
            ("  request_args:\n    max: 1\n    pattern: '('\n", "regex"),
            ("  request_args:\n    max: 1\n    pattern: ''\n", "pattern"),
            ("  request_args:\n    max: 1\n", "pattern"),
        ] {
            let def = format!("{GOOD}{bad}");
            let err = parse_def(Path::new("/x/acme.yaml"), def.as_bytes()).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_duplicate_name_keeps_the_first_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("acme.yaml"), GOOD).unwrap();
        std::fs::write(
            dir.path().join("acme.yml"),
            GOOD.replace("/opt/acme/run", "/opt/other/run"),
        )
        .unwrap();
        let (defs, skipped) = load_dir(dir.path());
        assert_eq!(defs["acme"].command, "/opt/acme/run");
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].file.ends_with("acme.yml"));
    }
}
