//! The policy layer: allowlist, argument policy, profiles and limits.
//!
//! Owns: deciding whether a request may run and turning it into a fully resolved [`Plan`]; a
//! refusal carries the rule that matched and why. Must not: touch the OS (except resolving
//! allowlisted names against the search path at startup) or know any backend's mechanism.

pub mod argpolicy;
pub mod language;
pub mod profile;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use self::argpolicy::ArgPolicy;
use self::language::Language;
use self::profile::{NetworkMode, Profile};
use crate::config::{CommandEntry, Config};
use crate::sandbox::{BackendKind, FsRules, Limits, NetworkPolicy, RunSpec, check_exec_size};

pub use crate::vocabulary::{ActionType, Capability, is_bare_name};

/// What a verified capability token grants.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Grant {
    pub capabilities: Vec<String>,
    pub commands: Option<Vec<String>>,
    pub profiles: Option<Vec<String>>,
    pub max_timeout_seconds: Option<u64>,
}

/// Why a request may not run; goes into the 403 body and the audit line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub rule: &'static str,
    pub reason: String,
}

/// Policy errors other than a refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyError {
    /// 403 CapabilityViolation.
    Refused(Refusal),
    /// 400 InvalidRequest.
    Invalid(String),
    /// 503 SandboxUnavailable (e.g. egress not configured).
    Unavailable(String),
}

fn refuse(rule: &'static str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Refused(Refusal {
        rule,
        reason: reason.into(),
    })
}

/// One allowlist entry, resolved at startup.
#[derive(Debug, Clone)]
pub struct AllowedCommand {
    pub name: String,
    pub path: PathBuf,
    pub action_types: Vec<ActionType>,
    pub capabilities: Vec<Capability>,
    pub profile: String,
    pub args: ArgPolicy,
}

/// The request fields the policy decides on.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    pub action_type: Option<ActionType>,
    pub command: &'a str,
    pub args: &'a [String],
    pub timeout_seconds: Option<u64>,
    /// An async or streamed run: its timeout may go up to the profile's
    /// `max_async_timeout_seconds` instead of `timeout_max_seconds`.
    pub long_run: bool,
    pub profile: Option<&'a str>,
    pub env: &'a BTreeMap<String, String>,
}

/// A fully resolved decision: what runs, where, with which limits.
#[derive(Debug, Clone)]
pub struct Plan {
    pub command: String,
    pub path: PathBuf,
    pub action_type: ActionType,
    pub backend: BackendKind,
    pub profile: Arc<Profile>,
    pub capabilities_used: Vec<Capability>,
    pub limits: Limits,
    pub env: BTreeMap<String, String>,
    pub timeout_seconds: u64,
}

impl Plan {
    /// The backend's view of the plan.
    pub fn run_spec(
        &self,
        exec_id: &str,
        argv_tail: &[String],
        stdin: Option<Vec<u8>>,
        default_image: &str,
    ) -> RunSpec {
        let p = &self.profile;
        let mut argv = vec![self.path.to_string_lossy().into_owned()];
        argv.extend(argv_tail.iter().cloned());
        RunSpec {
            exec_id: exec_id.to_string(),
            argv,
            stdin,
            env: self.env.clone(),
            limits: self.limits.clone(),
            network: match p.network.mode {
                NetworkMode::None => NetworkPolicy::None,
                NetworkMode::Egress => NetworkPolicy::Egress {
                    allow_hosts: p.network.allow_hosts.clone(),
                    allow_ports: p.network.allow_ports.clone(),
                    allow_cidrs: p.network.allow_cidrs.clone(),
                    bandwidth_bytes_per_sec: (p.network.bandwidth_mbps * 1_000_000.0 / 8.0) as u64,
                    byte_cap: p.network.byte_cap_mb << 20,
                    // Validated at load: every rule parses.
                    tcp: p
                        .network
                        .tcp
                        .iter()
                        .filter_map(|r| r.parse().ok())
                        .collect(),
                },
            },
            fs: FsRules {
                read_only: p.filesystem.read_only.clone(),
                extra_files: Vec::new(),
                workdir: p.filesystem.workdir.clone(),
                workspace: None,
                cwd: None,
                pty: false,
            },
            uid: p.user.uid,
            gid: p.user.gid,
            landlock_abi: p.requires.landlock_abi,
            image: Some(p.image.clone().unwrap_or_else(|| default_image.to_string())),
            profile: p.name.clone(),
            stop: None,
            output_tap: None,
            kept: None,
            code: None,
            controls: None,
            background: false,
            group: None,
            reuse_scope: None,
        }
    }
}

pub struct Policy {
    pub commands: BTreeMap<String, AllowedCommand>,
    pub disabled: Vec<(String, String)>,
    /// Commands `ALLOWED_COMMANDS` added to the configured allowlist (shell only, `ShellExecute`,
    /// the most restrictive profile).
    pub env_added: Vec<String>,
    pub profiles: BTreeMap<String, Arc<Profile>>,
    pub default_backend: BackendKind,
    /// Backends that route egress through the daemon's filtering proxy; an egress profile on any
    /// other backend is refused (503), never given open network.
    pub egress_backends: Vec<BackendKind>,
    /// Session languages whose interpreter was found.
    pub languages: BTreeMap<String, Arc<Language>>,
}

/// Finds `name` in the fixed search path (never the daemon's PATH).
pub fn resolve_in(search_path: &str, name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    search_path
        .split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(name))
        .find(|p| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyLoadError {
    #[error(transparent)]
    Profile(#[from] profile::ProfileError),
    #[error("commands.{command}: profile '{profile}' does not exist")]
    UnknownProfile { command: String, profile: String },
    #[error("commands.{command}: {message}")]
    ArgPolicy { command: String, message: String },
    #[error(
        "profile '{profile}': network.tcp rule '{rule}' uses port {port}, the egress proxy's port in every sandbox (egress.proxy_port)"
    )]
    TcpRuleOnProxyPort {
        profile: String,
        rule: String,
        port: u16,
    },
    #[error("sessions.languages.{language}: profile '{profile}' does not exist")]
    UnknownLanguageProfile { language: String, profile: String },
    #[error(
        "ALLOWED_COMMANDS names '{command}', which is not configured and not found in {search_path}"
    )]
    EnvCommandNotFound {
        command: String,
        search_path: String,
    },
}

impl Policy {
    pub fn load(cfg: &Config) -> Result<Policy, PolicyLoadError> {
        let profiles: BTreeMap<String, Arc<Profile>> =
            profile::load_dir(&cfg.sandbox.profiles_dir, &cfg.sandbox.profile_overrides)?
                .into_iter()
                .map(|(k, v)| (k, Arc::new(v)))
                .collect();
        for p in profiles.values() {
            if let Some(rule) = p.tcp_rule_on_port(cfg.egress.proxy_port) {
                return Err(PolicyLoadError::TcpRuleOnProxyPort {
                    profile: p.name.clone(),
                    rule: rule.to_string(),
                    port: cfg.egress.proxy_port,
                });
            }
        }
        let mut commands = BTreeMap::new();
        let mut disabled = Vec::new();
        for (name, entry) in &cfg.commands {
            if !profiles.contains_key(&entry.profile) {
                return Err(PolicyLoadError::UnknownProfile {
                    command: name.clone(),
                    profile: entry.profile.clone(),
                });
            }
            match resolve_in(&cfg.sandbox.search_path, name) {
                Some(path) => {
                    commands.insert(name.clone(), Self::allowed(name, path, entry)?);
                }
                None if cfg.env_added_commands.contains(name) => {
                    return Err(PolicyLoadError::EnvCommandNotFound {
                        command: name.clone(),
                        search_path: cfg.sandbox.search_path.clone(),
                    });
                }
                None => {
                    tracing::warn!(command = %name, search_path = %cfg.sandbox.search_path, "allowlisted command not found; disabled");
                    disabled.push((
                        name.clone(),
                        format!("not found in {}", cfg.sandbox.search_path),
                    ));
                }
            }
        }
        for name in &cfg.env_added_commands {
            tracing::warn!(
                command = %name,
                profile = crate::config::ENV_COMMAND_PROFILE,
                "ALLOWED_COMMANDS adds a command the configuration does not list: shell only, requires ShellExecute"
            );
        }
        let mut languages = BTreeMap::new();
        for (name, l) in &cfg.sessions.languages {
            if !profiles.contains_key(&l.profile) {
                return Err(PolicyLoadError::UnknownLanguageProfile {
                    language: name.clone(),
                    profile: l.profile.clone(),
                });
            }
            let Some(path) = resolve_in(&cfg.sandbox.search_path, &l.interpreter) else {
                tracing::warn!(language = %name, interpreter = %l.interpreter, search_path = %cfg.sandbox.search_path, "session language's interpreter not found; disabled");
                continue;
            };
            let language = Language {
                name: name.clone(),
                interpreter: l.interpreter.clone(),
                path,
                action_type: l.action_type,
                capability: l.capability,
                profile: l.profile.clone(),
                file: l.file.clone(),
            };
            languages.insert(name.clone(), Arc::new(language));
        }
        Ok(Policy {
            commands,
            disabled,
            env_added: cfg.env_added_commands.clone(),
            profiles,
            default_backend: cfg.sandbox.default_backend,
            egress_backends: Vec::new(),
            languages,
        })
    }

    /// Decides an exec of a session's language: its interpreter with the code file as its only
    /// argument, under the token's grant like any allowlisted command.
    pub fn decide_language(
        &self,
        language: &Language,
        ask: &Ask<'_>,
        grant: &Grant,
    ) -> Result<Plan, PolicyError> {
        self.finish(
            &language.interpreter,
            &language.path,
            language.action_type,
            &[language.capability],
            &language.profile,
            ask,
            grant,
        )
    }

    fn allowed(
        name: &str,
        path: PathBuf,
        entry: &CommandEntry,
    ) -> Result<AllowedCommand, PolicyLoadError> {
        let args = ArgPolicy::for_command(name, &entry.deny_args, &entry.deny_prefixes).map_err(
            |message| PolicyLoadError::ArgPolicy {
                command: name.to_string(),
                message,
            },
        )?;
        Ok(AllowedCommand {
            name: name.to_string(),
            path,
            action_types: entry.action_types.clone(),
            capabilities: entry.capabilities.clone(),
            profile: entry.profile.clone(),
            args,
        })
    }

    pub fn allowed_names(&self) -> Vec<String> {
        self.commands.keys().cloned().collect()
    }

    /// Decides an allowlisted command request (not `external`, which the executor registry owns).
    pub fn decide(&self, ask: &Ask<'_>, grant: &Grant) -> Result<Plan, PolicyError> {
        if !is_bare_name(ask.command) {
            return Err(refuse(
                "allowlist",
                format!("Command '{}' not in allowlist", ask.command.escape_debug()),
            ));
        }
        let Some(cmd) = self.commands.get(ask.command) else {
            return Err(refuse(
                "allowlist",
                format!("Command '{}' not in allowlist", ask.command),
            ));
        };
        let action = ask
            .action_type
            .ok_or_else(|| PolicyError::Invalid("action_type is required".into()))?;
        if !cmd.action_types.contains(&action) {
            return Err(refuse(
                "action_type",
                format!(
                    "Command '{}' does not serve action_type '{}'",
                    cmd.name,
                    action.as_str()
                ),
            ));
        }
        if let Some(reason) = cmd.args.check(ask.args) {
            return Err(refuse(
                "argument_policy",
                format!("Command '{}': {reason}", cmd.name),
            ));
        }
        self.finish(
            &cmd.name,
            &cmd.path,
            action,
            &cmd.capabilities,
            &cmd.profile,
            ask,
            grant,
        )
    }

    /// The part shared with external executors: token narrowing, capabilities, profile, env, limits.
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &self,
        name: &str,
        path: &Path,
        action: ActionType,
        required: &[Capability],
        default_profile: &str,
        ask: &Ask<'_>,
        grant: &Grant,
    ) -> Result<Plan, PolicyError> {
        if let Some(allowed) = &grant.commands
            && !allowed.iter().any(|c| c == name)
        {
            return Err(refuse(
                "token_commands",
                format!("capability token does not permit command '{name}'"),
            ));
        }
        if let Some(missing) = required
            .iter()
            .find(|c| !grant.capabilities.iter().any(|g| g == c.as_str()))
        {
            return Err(refuse(
                "capabilities",
                format!(
                    "capability token lacks required capability '{}' for '{name}'",
                    missing.as_str()
                ),
            ));
        }
        let profile_name = ask.profile.unwrap_or(default_profile);
        let Some(profile) = self.profiles.get(profile_name) else {
            return Err(refuse(
                "profile",
                format!("profile '{profile_name}' does not exist"),
            ));
        };
        match &grant.profiles {
            Some(allowed) if !allowed.iter().any(|p| p == profile_name) => {
                return Err(refuse(
                    "token_profiles",
                    format!("capability token does not permit profile '{profile_name}'"),
                ));
            }
            None if profile_name != default_profile => {
                return Err(refuse(
                    "token_profiles",
                    format!("capability token does not permit profile '{profile_name}'"),
                ));
            }
            _ => {}
        }
        let backend = profile.backend(self.default_backend);
        if profile.network.mode == NetworkMode::Egress && !self.egress_backends.contains(&backend) {
            return Err(PolicyError::Unavailable(format!(
                "egress not configured: profile '{profile_name}' needs outbound network and the {} backend has no egress filter",
                backend.as_str()
            )));
        }
        if let Some(why) = profile.tcp_refusal(backend) {
            return Err(PolicyError::Invalid(why));
        }
        let mut env = profile.env.set.clone();
        for (k, v) in ask.env {
            if !profile::valid_env_name(k)
                || profile::env_name_always_refused(k)
                || !profile.env.allow.iter().any(|a| a == k)
            {
                return Err(refuse(
                    "env",
                    format!(
                        "environment variable '{}' is not permitted by profile '{profile_name}'",
                        k.escape_debug()
                    ),
                ));
            }
            if v.contains('\0') {
                return Err(PolicyError::Invalid(format!(
                    "environment variable '{k}' contains a NUL byte"
                )));
            }
            env.insert(k.clone(), v.clone());
        }
        // Checked here, before any backend: execve would refuse it (E2BIG) after admission.
        let program = path.to_string_lossy();
        let argv = std::iter::once(program.as_ref()).chain(ask.args.iter().map(String::as_str));
        check_exec_size(argv, env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map_err(PolicyError::Invalid)?;
        let l = &profile.limits;
        let max = if ask.long_run {
            l.max_async_timeout_seconds
        } else {
            l.timeout_max_seconds
        };
        let mut timeout = ask
            .timeout_seconds
            .unwrap_or(l.timeout_default_seconds)
            .min(max);
        if let Some(t) = grant.max_timeout_seconds {
            timeout = timeout.min(t.max(1));
        }
        Ok(Plan {
            command: name.to_string(),
            path: path.to_path_buf(),
            action_type: action,
            backend,
            profile: profile.clone(),
            capabilities_used: required.to_vec(),
            limits: Limits {
                cpus: l.cpus,
                memory_bytes: l.memory_mb << 20,
                disk_bytes: l.disk_mb << 20,
                timeout: Duration::from_secs(timeout),
                pids: l.pids,
                output_bytes: l.output_bytes,
                on_overflow: profile.output.on_overflow,
                nofile: l.nofile,
            },
            env,
            timeout_seconds: timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EnvOverrides;

    fn policy() -> Policy {
        let cfg = Config::load(None, &EnvOverrides::default()).unwrap();
        Policy::load(&cfg).unwrap()
    }

    /// A raw TCP rule on the proxy's port could never listen beside the proxy: startup fails
    /// naming the profile, the rule and the key.
    #[test]
    fn a_tcp_rule_on_the_proxy_port_fails_the_load() {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in profile::EMBEDDED {
            let text = if *name == "http-egress" {
                text.replace("[network]\n", "[network]\ntcp = [\"10.0.0.0/8:3128\"]\n")
            } else {
                text.to_string()
            };
            std::fs::write(dir.path().join(format!("{name}.toml")), text).unwrap();
        }
        let mut cfg = Config::load(None, &EnvOverrides::default()).unwrap();
        cfg.sandbox.profiles_dir = dir.path().to_path_buf();
        cfg.egress.proxy_port = 3128;
        let e = Policy::load(&cfg).err().expect("refused").to_string();
        assert!(
            e.contains("http-egress")
                && e.contains("10.0.0.0/8:3128")
                && e.contains("egress.proxy_port"),
            "{e}"
        );
        cfg.egress.proxy_port = 3129;
        assert!(Policy::load(&cfg).is_ok());
    }

    fn grant(caps: &[&str]) -> Grant {
        Grant {
            capabilities: caps.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn bare_names() {
        for bad in [
            "/bin/ls",
            "../ls",
            "ls;id",
            "ls ",
            " ls",
            "ls\0",
            "l\u{0455}",
            "ｌｓ",
            "",
            ".",
            "..",
            "-ls",
            "ls|x",
            "$(id)",
        ] {
            assert!(!is_bare_name(bad), "{bad:?}");
        }
        for ok in ["ls", "python3", "g++", "x-y_z.1"] {
            assert!(is_bare_name(ok));
        }
    }

    #[test]
    fn decide_resolves_limits_and_refuses_with_reasons() {
        let p = policy();
        let env = BTreeMap::new();
        let ask = Ask {
            action_type: Some(ActionType::Shell),
            command: "echo",
            args: &[],
            timeout_seconds: Some(500),
            long_run: false,
            profile: None,
            env: &env,
        };
        let plan = p.decide(&ask, &grant(&["ShellExecute"])).unwrap();
        assert_eq!(plan.timeout_seconds, 300);
        assert!(plan.path.is_absolute());
        // An async or streamed run may go up to the profile's max_async_timeout_seconds.
        let long = Ask {
            long_run: true,
            timeout_seconds: Some(5000),
            ..ask.clone()
        };
        let plan = p.decide(&long, &grant(&["ShellExecute"])).unwrap();
        assert_eq!(plan.timeout_seconds, 3600);
        assert_eq!(plan.limits.timeout, Duration::from_secs(3600));
        let g = Grant {
            max_timeout_seconds: Some(5),
            ..grant(&["ShellExecute"])
        };
        assert_eq!(p.decide(&ask, &g).unwrap().timeout_seconds, 5);
        match p.decide(&ask, &grant(&["ShellRead"])) {
            Err(PolicyError::Refused(r)) => assert!(r.reason.contains("ShellExecute"), "{r:?}"),
            other => panic!("{other:?}"),
        }
        let rm = Ask {
            command: "rm",
            ..ask.clone()
        };
        assert!(matches!(
            p.decide(&rm, &grant(&["ShellExecute"])),
            Err(PolicyError::Refused(_))
        ));
        let other_profile = Ask {
            profile: Some("python"),
            ..ask.clone()
        };
        assert!(matches!(
            p.decide(&other_profile, &grant(&["ShellExecute"])),
            Err(PolicyError::Refused(_))
        ));
        let g = Grant {
            profiles: Some(vec!["python".into()]),
            ..grant(&["ShellExecute"])
        };
        assert_eq!(p.decide(&other_profile, &g).unwrap().profile.name, "python");
        let narrowed = Grant {
            commands: Some(vec!["ls".into()]),
            ..grant(&["ShellExecute"])
        };
        assert!(matches!(
            p.decide(&ask, &narrowed),
            Err(PolicyError::Refused(_))
        ));
    }

    #[test]
    fn env_rules() {
        let p = policy();
        let mut env = BTreeMap::new();
        env.insert("LD_PRELOAD".to_string(), "/x.so".to_string());
        let ask = Ask {
            action_type: Some(ActionType::Shell),
            command: "echo",
            args: &[],
            timeout_seconds: None,
            long_run: false,
            profile: None,
            env: &env,
        };
        assert!(matches!(
            p.decide(&ask, &grant(&["ShellExecute"])),
            Err(PolicyError::Refused(_))
        ));
        let mut env = BTreeMap::new();
        env.insert("TZ".to_string(), "UTC".to_string());
        let ask = Ask { env: &env, ..ask };
        assert_eq!(
            p.decide(&ask, &grant(&["ShellExecute"]))
                .unwrap()
                .env
                .get("TZ")
                .unwrap(),
            "UTC"
        );
    }

    #[test]
    fn egress_profiles_are_unavailable_without_a_filter() {
        let p = policy();
        let env = BTreeMap::new();
        let args = vec!["http://example.test/".to_string()];
        let ask = Ask {
            action_type: Some(ActionType::Http),
            command: "curl",
            args: &args,
            timeout_seconds: None,
            long_run: false,
            profile: None,
            env: &env,
        };
        if p.commands.contains_key("curl") {
            assert!(matches!(
                p.decide(&ask, &grant(&["HttpRequest", "NetworkAccess"])),
                Err(PolicyError::Unavailable(_))
            ));
        }
    }
}
