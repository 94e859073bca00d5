//! Sandbox profiles: `sandbox-profiles/*.toml`, the one place isolation policy lives.
//!
//! A profile is data: backend, image, read-only paths, network, limits, user, env names. Loading
//! refuses unknown keys and unsafe values, naming the file and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox::{BackendKind, OnOverflow};

/// The default limits and the hard caps no profile or request may exceed.
pub const MAX_TIMEOUT_SECONDS: u64 = 300;

/// The most raw TCP rules a profile may have (each is a route and maybe a listener per run).
pub const MAX_TCP_RULES: usize = 64;

/// The longest an async or streamed run may last under any profile (a day).
pub const MAX_ASYNC_TIMEOUT_SECONDS: u64 = 86_400;

fn default_max_async_timeout() -> u64 {
    3600
}

/// Embedded copies of the shipped profiles, used when the profiles directory does not exist
/// (e.g. `serve --dev` from another working directory).
pub const EMBEDDED: &[(&str, &str)] = &[
    (
        "shell-readonly",
        include_str!("../../sandbox-profiles/shell-readonly.toml"),
    ),
    ("python", include_str!("../../sandbox-profiles/python.toml")),
    (
        "python-packages",
        include_str!("../../sandbox-profiles/python-packages.toml"),
    ),
    (
        "node-packages",
        include_str!("../../sandbox-profiles/node-packages.toml"),
    ),
    (
        "http-egress",
        include_str!("../../sandbox-profiles/http-egress.toml"),
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("{file}: {message}")]
    Invalid { file: String, message: String },
    #[error("cannot read profiles directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    #[serde(skip_deserializing)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub backend: Option<BackendKind>,
    #[serde(default)]
    pub image: Option<String>,
    pub filesystem: FilesystemSection,
    pub network: NetworkSection,
    pub limits: LimitsSection,
    pub user: UserSection,
    #[serde(default)]
    pub env: EnvSection,
    #[serde(default)]
    pub output: OutputSection,
    #[serde(default)]
    pub requires: RequiresSection,
}

/// What the run's output streams may do past `limits.output_bytes`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// `truncate` (default): the stream is cut at the cap and the run goes on; `kill`: the run
    /// is stopped.
    #[serde(default)]
    pub on_overflow: OnOverflow,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FilesystemSection {
    pub read_only: Vec<PathBuf>,
    pub workdir: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    None,
    Egress,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    pub mode: NetworkMode,
    #[serde(default)]
    pub allow_hosts: Vec<String>,
    #[serde(default = "default_ports")]
    pub allow_ports: Vec<u16>,
    /// Ranges an operator opens on purpose (lifts only the private part of the deny list).
    #[serde(default)]
    pub allow_cidrs: Vec<String>,
    /// Per-execution bandwidth through the egress proxy, both directions (seed: 10 Mbps).
    #[serde(default = "default_bandwidth")]
    pub bandwidth_mbps: f64,
    /// Per-execution byte cap through the egress proxy.
    #[serde(default = "default_byte_cap")]
    pub byte_cap_mb: u64,
    /// Raw TCP by rule, beside the proxy: `"10.20.0.0/16:5432"`, `"[2001:db8::/32]:22"`
    /// (see [`crate::egress::TcpRule`]). Egress mode only; not on gVisor.
    #[serde(default)]
    pub tcp: Vec<String>,
}

fn default_bandwidth() -> f64 {
    10.0
}

fn default_byte_cap() -> u64 {
    100
}

fn default_ports() -> Vec<u16> {
    vec![80, 443]
}

#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    pub cpus: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub timeout_default_seconds: u64,
    pub timeout_max_seconds: u64,
    /// The longest an async or streamed run under this profile may last (synchronous runs stop
    /// at `timeout_max_seconds`).
    #[serde(default = "default_max_async_timeout")]
    pub max_async_timeout_seconds: u64,
    pub pids: u64,
    pub output_bytes: usize,
    pub nofile: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UserSection {
    pub uid: u32,
    pub gid: u32,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub set: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RequiresSection {
    /// Minimum Landlock ABI the local backend must enforce (0: the profile runs without
    /// Landlock, e.g. under gVisor which does not implement it).
    #[serde(default = "default_landlock_abi")]
    pub landlock_abi: u32,
}

impl Default for RequiresSection {
    fn default() -> Self {
        RequiresSection {
            landlock_abi: default_landlock_abi(),
        }
    }
}

fn default_landlock_abi() -> u32 {
    1
}

/// Environment names no profile can let a request set: they change what runs or how.
pub fn env_name_always_refused(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONINSPECT",
        "PYTHONBREAKPOINT",
        "PYTHONUSERBASE",
        "PYTHONEXECUTABLE",
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "IFS",
        "PROMPT_COMMAND",
        "CDPATH",
        "GLOBIGNORE",
        "PERL5LIB",
        "PERL5OPT",
        "PERLLIB",
        "RUBYOPT",
        "RUBYLIB",
        "NODE_OPTIONS",
        "NODE_PATH",
        "GCONV_PATH",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "RES_OPTIONS",
        "GLIBC_TUNABLES",
        "TMPDIR",
        "HOME",
        "SHELL",
        "CURL_HOME",
        "WGETRC",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "no_proxy",
        "all_proxy",
        "EDITOR",
        "VISUAL",
        "PAGER",
        "MANPAGER",
        "LESSOPEN",
        "LESSCLOSE",
        // Config files and arguments the allowlisted tools read from the environment: curl
        // and git read $XDG_CONFIG_HOME, wget $SYSTEM_WGETRC, tar $TAR_OPTIONS (options) and
        // $TAPE (the archive, host:path runs a remote shell), nmap $NMAP_ARGS and $NMAPDIR
        // (scripts); git runs $SSH_ASKPASS. POSIXLY_CORRECT changes how getopt reads an argv.
        "XDG_CONFIG_HOME",
        "SYSTEM_WGETRC",
        "TAR_OPTIONS",
        "TAPE",
        "NMAP_ARGS",
        "NMAPDIR",
        "SSH_ASKPASS",
        "POSIXLY_CORRECT",
    ];
    name.starts_with("LD_")
        || name.starts_with("MALLOC_")
        || name.starts_with("BASH_FUNC_")
        || name.starts_with("ORBIT_")
        // git reads configuration (GIT_CONFIG_*, GIT_CONFIG_PARAMETERS), programs to run
        // (GIT_SSH_COMMAND, GIT_ASKPASS, GIT_PROXY_COMMAND, GIT_EXTERNAL_DIFF, GIT_PAGER,
        // GIT_EDITOR, GIT_EXEC_PATH) and files to write (GIT_TRACE*) from GIT_*.
        || name.starts_with("GIT_")
        || EXACT.contains(&name)
}

pub fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 128
}

/// The daemon config's override of one profile (`sandbox.profile_overrides.<name>`): profile
/// keys merged over the profile's file, table by table (a value or an array replaces the file's).
pub type ProfileOverride = toml::Table;

impl Profile {
    pub fn parse(name: &str, file: &str, text: &str) -> Result<Profile, ProfileError> {
        Self::parse_with(name, file, text, None)
    }

    /// Parses `text` with `over` merged over it, then checks the result as any profile is
    /// checked: an override can point a profile elsewhere, never make it unsafe.
    pub fn parse_with(
        name: &str,
        file: &str,
        text: &str,
        over: Option<&ProfileOverride>,
    ) -> Result<Profile, ProfileError> {
        let file = match over {
            Some(_) => format!("{file} with sandbox.profile_overrides.{name}"),
            None => file.to_string(),
        };
        let invalid = |message: String| ProfileError::Invalid {
            file: file.clone(),
            message,
        };
        let tidy = |e: toml::de::Error| invalid(e.to_string().trim().replace('\n', " "));
        let mut table: toml::Table = toml::from_str(text).map_err(tidy)?;
        if let Some(over) = over {
            crate::config::merge_tables(&mut table, over.clone());
        }
        let mut p: Profile = table.try_into().map_err(tidy)?;
        p.name = name.to_string();
        p.validate().map_err(invalid)?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), String> {
        if self.user.uid == 0 || self.user.gid == 0 {
            return Err("user.uid / user.gid: a sandbox never runs as root (0)".into());
        }
        let l = &self.limits;
        if !(l.cpus > 0.0 && l.cpus <= 64.0) {
            return Err("limits.cpus must be in (0, 64]".into());
        }
        if l.memory_mb < 16 || l.disk_mb == 0 || l.pids < 4 || l.output_bytes == 0 || l.nofile < 16
        {
            return Err(
                "limits: memory_mb >= 16, disk_mb > 0, pids >= 4, output_bytes > 0, nofile >= 16"
                    .into(),
            );
        }
        if l.timeout_default_seconds == 0
            || l.timeout_default_seconds > l.timeout_max_seconds
            || l.timeout_max_seconds > MAX_TIMEOUT_SECONDS
        {
            return Err(format!(
                "limits: 0 < timeout_default_seconds <= timeout_max_seconds <= {MAX_TIMEOUT_SECONDS}"
            ));
        }
        if l.max_async_timeout_seconds < l.timeout_max_seconds
            || l.max_async_timeout_seconds > MAX_ASYNC_TIMEOUT_SECONDS
        {
            return Err(format!(
                "limits: timeout_max_seconds <= max_async_timeout_seconds <= {MAX_ASYNC_TIMEOUT_SECONDS}"
            ));
        }
        let wd = &self.filesystem.workdir;
        if !wd.is_absolute()
            || wd == Path::new("/")
            || wd
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err("filesystem.workdir must be an absolute path below /".into());
        }
        for p in &self.filesystem.read_only {
            if !p.is_absolute()
                || p == Path::new("/")
                || p.components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(format!(
                    "filesystem.read_only: '{}' must be an absolute path below / without '..'",
                    p.display()
                ));
            }
            if p.starts_with("/proc")
                || p.starts_with("/sys")
                || p.starts_with("/dev")
                || wd.starts_with(p)
            {
                return Err(format!(
                    "filesystem.read_only: '{}' may not be exposed",
                    p.display()
                ));
            }
        }
        for n in self.env.allow.iter().chain(self.env.set.keys()) {
            if !valid_env_name(n) {
                return Err(format!("env: '{n}' is not a valid variable name"));
            }
        }
        if let Some(n) = self.env.allow.iter().find(|n| env_name_always_refused(n)) {
            return Err(format!("env.allow: '{n}' can never be set by a request"));
        }
        if self.network.mode == NetworkMode::Egress && self.network.allow_ports.is_empty() {
            return Err("network.allow_ports is empty".into());
        }
        if !(self.network.bandwidth_mbps > 0.0 && self.network.bandwidth_mbps <= 10_000.0)
            || self.network.byte_cap_mb == 0
        {
            return Err("network: bandwidth_mbps must be in (0, 10000] and byte_cap_mb > 0".into());
        }
        if !self.network.tcp.is_empty() && self.network.mode != NetworkMode::Egress {
            return Err("network.tcp: raw TCP rules need mode = \"egress\"".into());
        }
        if self.network.tcp.len() > MAX_TCP_RULES {
            return Err(format!("network.tcp: at most {MAX_TCP_RULES} rules"));
        }
        for r in &self.network.tcp {
            if let Err(e) = r.parse::<crate::egress::TcpRule>() {
                return Err(format!("network.tcp: {e}"));
            }
        }
        // A profile pinned to gVisor can never run its rules; one without a backend is judged
        // per request (the daemon's default backend may change).
        if let Some(why) = self.backend.and_then(|b| self.tcp_refusal(b)) {
            return Err(why);
        }
        for c in &self.network.allow_cidrs {
            if c.parse::<crate::egress::IpNet>().is_err() {
                return Err(format!("network.allow_cidrs: '{c}' is not a CIDR range"));
            }
        }
        for h in &self.network.allow_hosts {
            let bare = h.strip_prefix("*.").unwrap_or(h);
            if bare.is_empty()
                || !bare
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
            {
                return Err(format!(
                    "network.allow_hosts: '{h}' is not a host name or *.suffix pattern"
                ));
            }
        }
        Ok(())
    }

    pub fn backend(&self, default: BackendKind) -> BackendKind {
        self.backend.unwrap_or(default)
    }

    /// A raw TCP rule of this profile on `port`, if any (the egress proxy's port in the sandbox
    /// cannot also be a rule's).
    pub fn tcp_rule_on_port(&self, port: u16) -> Option<&str> {
        self.network
            .tcp
            .iter()
            .find(|r| {
                r.parse::<crate::egress::TcpRule>()
                    .is_ok_and(|t| t.port() == port)
            })
            .map(String::as_str)
    }

    /// Why this profile's raw TCP rules cannot run on `backend`, if they cannot: gVisor's
    /// netstack is the sandbox's own, so the local routes and listeners the rules need would
    /// not be the host kernel's (a decision-time 400, never a run without them).
    pub fn tcp_refusal(&self, backend: BackendKind) -> Option<String> {
        (backend == BackendKind::Gvisor && !self.network.tcp.is_empty()).then(|| {
            format!(
                "profile '{}' has raw TCP rules (network.tcp), which the gvisor backend does not offer: gVisor's network stack is the sandbox's own; use the local or docker backend",
                self.name
            )
        })
    }
}

/// Loads every `*.toml` of `dir` (or the embedded set when `dir` does not exist), each with its
/// override from `overrides` merged over it; an override of a profile that does not exist is an
/// error.
pub fn load_dir(
    dir: &Path,
    overrides: &BTreeMap<String, ProfileOverride>,
) -> Result<BTreeMap<String, Profile>, ProfileError> {
    let mut out = BTreeMap::new();
    if !dir.exists() {
        for (name, text) in EMBEDDED {
            out.insert(
                name.to_string(),
                Profile::parse_with(
                    name,
                    &format!("<embedded>/{name}.toml"),
                    text,
                    overrides.get(*name),
                )?,
            );
        }
    } else {
        let entries = std::fs::read_dir(dir).map_err(|source| ProfileError::Dir {
            dir: dir.to_path_buf(),
            source,
        })?;
        for e in entries {
            let e = e.map_err(|source| ProfileError::Dir {
                dir: dir.to_path_buf(),
                source,
            })?;
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("toml") {
                continue;
            }
            let file = path.display().to_string();
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            if !crate::policy::is_bare_name(&name) {
                return Err(ProfileError::Invalid {
                    file,
                    message: "profile file name must be a plain name".into(),
                });
            }
            let text = std::fs::read_to_string(&path).map_err(|e| ProfileError::Invalid {
                file: file.clone(),
                message: e.to_string(),
            })?;
            let profile = Profile::parse_with(&name, &file, &text, overrides.get(&name))?;
            out.insert(name, profile);
        }
    }
    if let Some(name) = overrides.keys().find(|n| !out.contains_key(*n)) {
        return Err(ProfileError::Invalid {
            file: format!("sandbox.profile_overrides.{name}"),
            message: format!("there is no profile '{name}' to override"),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profiles_parse() {
        for (name, text) in EMBEDDED {
            let p = Profile::parse(name, name, text).unwrap();
            assert_eq!(p.limits.memory_mb, 512);
            assert_eq!(p.limits.pids, 64);
            assert_eq!(p.limits.output_bytes, 1 << 20);
            assert_eq!(p.output.on_overflow, OnOverflow::Truncate);
        }
    }

    #[test]
    fn on_overflow_is_truncate_or_kill() {
        let with = |v: &str| {
            let text = format!("{}\n[output]\non_overflow = \"{v}\"\n", EMBEDDED[0].1);
            Profile::parse("x", "x.toml", &text).map(|p| p.output.on_overflow)
        };
        assert_eq!(with("kill").unwrap(), OnOverflow::Kill);
        assert_eq!(with("truncate").unwrap(), OnOverflow::Truncate);
        let e = with("ignore").unwrap_err().to_string();
        assert!(e.contains("x.toml") && e.contains("ignore"), "{e}");
    }

    /// `network.tcp` of the http-egress profile set to `rules` (TOML array items), plus `extra`
    /// top-level lines.
    fn with_tcp(rules: &str, extra: &str) -> Result<Profile, ProfileError> {
        let text = EMBEDDED
            .iter()
            .find(|(n, _)| *n == "http-egress")
            .unwrap()
            .1
            .replace("[network]\n", &format!("[network]\ntcp = [{rules}]\n"));
        Profile::parse("x", "x.toml", &format!("{extra}{text}"))
    }

    #[test]
    fn tcp_rules_are_validated_at_load() {
        let p = with_tcp(
            r#""10.20.0.0/16:5432", "192.0.2.7/32:22", "[2001:db8::/32]:22""#,
            "",
        )
        .unwrap();
        assert_eq!(p.network.tcp.len(), 3);
        for (bad, says) in [
            (r#""127.0.0.1/32:5432""#, "loopback"),
            (r#""127.0.0.0/8:80""#, "loopback"),
            (r#""[::1/128]:22""#, "loopback"),
            (r#""10.20.0.1/16:5432""#, "below the prefix"),
            (r#""10.20.0.0/16""#, "ADDRESS/PREFIX:PORT"),
            (r#""2001:db8::/32:22""#, "brackets"),
            (r#""10.0.0.0/8:0""#, "port 0"),
        ] {
            let e = with_tcp(bad, "").unwrap_err().to_string();
            assert!(
                e.contains("x.toml") && e.contains("network.tcp") && e.contains(says),
                "{bad}: {e}"
            );
        }
        // Raw TCP is egress: a profile without network cannot have rules.
        let text = EMBEDDED[0]
            .1
            .replace("[network]\n", "[network]\ntcp = [\"10.0.0.0/8:22\"]\n");
        let e = Profile::parse("x", "x.toml", &text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mode = \"egress\""), "{e}");
        // A profile pinned to gVisor can never run them.
        let e = with_tcp(r#""10.0.0.0/8:22""#, "backend = \"gvisor\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gvisor") && e.contains("network.tcp"), "{e}");
        let p = with_tcp(r#""10.0.0.0/8:22""#, "").unwrap();
        assert_eq!(p.tcp_rule_on_port(22), Some("10.0.0.0/8:22"));
        assert_eq!(p.tcp_rule_on_port(3128), None);
        assert!(p.tcp_refusal(BackendKind::Gvisor).is_some());
        assert!(p.tcp_refusal(BackendKind::Docker).is_none());
        assert!(p.tcp_refusal(BackendKind::Local).is_none());
    }

    #[test]
    fn unknown_key_is_named() {
        let text = EMBEDDED[0].1.replace("[limits]", "[limits]\nswap_mb = 3");
        let e = Profile::parse("x", "x.toml", &text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.toml") && e.contains("swap_mb"), "{e}");
    }

    #[test]
    fn root_and_proc_are_refused() {
        let text = EMBEDDED[0].1.replace("uid = 65534", "uid = 0");
        assert!(Profile::parse("x", "x.toml", &text).is_err());
        let text = EMBEDDED[0].1.replace("\"/usr\",", "\"/proc\",");
        assert!(Profile::parse("x", "x.toml", &text).is_err());
        let text = EMBEDDED[0]
            .1
            .replace("allow = [\"LANG\"", "allow = [\"LD_PRELOAD\"");
        assert!(Profile::parse("x", "x.toml", &text).is_err());
    }

    fn over(text: &str) -> ProfileOverride {
        toml::from_str(text).unwrap()
    }

    /// The operator's index reaches the shipped packages profile through the daemon's config:
    /// arrays are replaced, tables merged key by key, everything else kept from the file.
    #[test]
    fn an_override_points_a_profile_at_an_index() {
        let text = EMBEDDED
            .iter()
            .find(|(n, _)| *n == "python-packages")
            .unwrap()
            .1;
        let shipped = Profile::parse("python-packages", "p.toml", text).unwrap();
        assert_eq!(shipped.network.mode, NetworkMode::Egress);
        assert!(
            shipped.network.allow_hosts.is_empty(),
            "ships reaching nothing"
        );
        assert!(!shipped.env.set.contains_key("PIP_INDEX_URL"));
        let o = over(
            "[network]\nallow_hosts = [\"pypi.internal.example\"]\n\
             [env.set]\nPIP_INDEX_URL = \"https://pypi.internal.example/simple/\"\n",
        );
        let p = Profile::parse_with("python-packages", "p.toml", text, Some(&o)).unwrap();
        assert_eq!(p.network.allow_hosts, ["pypi.internal.example"]);
        assert_eq!(p.network.allow_ports, shipped.network.allow_ports);
        assert_eq!(
            p.env.set["PIP_INDEX_URL"],
            "https://pypi.internal.example/simple/"
        );
        assert_eq!(p.env.set["PATH"], shipped.env.set["PATH"]);
        assert_eq!(p.env.set.len(), shipped.env.set.len() + 1);
    }

    /// An override is checked as the file is: it cannot make a profile unsafe, and it names
    /// itself in the error; one for a profile that does not exist stops startup too.
    #[test]
    fn an_override_is_checked_and_must_name_a_profile() {
        let text = EMBEDDED[0].1;
        for bad in [
            "[user]\nuid = 0\n",
            "[network]\nallow_hosts = [\"a/b\"]\n",
            "[env]\nallow = [\"LD_PRELOAD\"]\n",
            "[limits]\nswap_mb = 3\n",
        ] {
            let e = Profile::parse_with("x", "x.toml", text, Some(&over(bad)))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("x.toml with sandbox.profile_overrides.x"),
                "{bad}: {e}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x.toml"), text).unwrap();
        let mut overrides = BTreeMap::new();
        overrides.insert("x".to_string(), over("[limits]\npids = 32\n"));
        let loaded = load_dir(dir.path(), &overrides).unwrap();
        assert_eq!(loaded["x"].limits.pids, 32);
        overrides.insert("nope".to_string(), over("[limits]\npids = 32\n"));
        let e = load_dir(dir.path(), &overrides).unwrap_err().to_string();
        assert!(e.contains("sandbox.profile_overrides.nope"), "{e}");
    }

    /// Variables through which curl, wget, git, tar and nmap read configuration, options or
    /// programs to run can never be allowed by a profile.
    #[test]
    fn tool_configuration_variables_are_always_refused() {
        for name in [
            "CURL_HOME",
            "XDG_CONFIG_HOME",
            "WGETRC",
            "SYSTEM_WGETRC",
            "GIT_CONFIG_COUNT",
            "GIT_CONFIG_KEY_0",
            "GIT_CONFIG_VALUE_0",
            "GIT_CONFIG_PARAMETERS",
            "GIT_CONFIG_GLOBAL",
            "GIT_SSH_COMMAND",
            "GIT_ASKPASS",
            "GIT_PROXY_COMMAND",
            "GIT_EXTERNAL_DIFF",
            "SSH_ASKPASS",
            "TAR_OPTIONS",
            "TAPE",
            "NMAP_ARGS",
            "NMAPDIR",
            "POSIXLY_CORRECT",
        ] {
            assert!(env_name_always_refused(name), "{name}");
        }
        for name in ["LANG", "TZ", "TERM", "LC_ALL"] {
            assert!(!env_name_always_refused(name), "{name}");
        }
    }
}
