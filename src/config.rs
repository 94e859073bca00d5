//! Typed configuration: embedded defaults → config file → environment.
//!
//! The embedded default is `config/executor-arm.toml`; a file given with `--config` is merged over
//! it table by table (a file that names `[commands]` replaces the whole allowlist). Unknown keys
//! are errors. Secrets are never held here, only paths to them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::sandbox::BackendKind;
pub use crate::sandbox::docker::DockerConfig;
use crate::vocabulary::{ActionType, Capability, is_bare_name};

pub const DEFAULT_CONFIG_TOML: &str = include_str!("../config/executor-arm.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("environment variable {name}: {message}")]
    Env { name: &'static str, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// The most background processes a session may be allowed (`sessions.max_processes`): the
/// records that name a session's processes (the E2B API's pids) keep one more than this.
pub const MAX_SESSION_PROCESSES: usize = 255;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub auth: AuthConfig,
    pub audit: AuditConfig,
    pub receipts: ReceiptsConfig,
    pub state: StateConfig,
    pub sandbox: SandboxConfig,
    pub executors: ExecutorsConfig,
    pub executions: ExecutionsConfig,
    pub sessions: SessionsConfig,
    pub egress: EgressConfig,
    pub mcp: McpConfig,
    pub e2b: E2bConfig,
    pub commands: BTreeMap<String, CommandEntry>,
    /// Names `ALLOWED_COMMANDS` added that the configured allowlist lacks (entries of
    /// [`env_command_entry`]); each must be found on the search path at startup.
    #[serde(skip)]
    pub env_added_commands: Vec<String>,
}

/// The profile a command added through `ALLOWED_COMMANDS` runs under: the most restrictive one
/// shipped (no network, read-only system, a private scratch workdir).
pub const ENV_COMMAND_PROFILE: &str = "shell-readonly";

/// The allowlist entry of a command added through `ALLOWED_COMMANDS`: shell only, requiring
/// `ShellExecute`, under [`ENV_COMMAND_PROFILE`].
pub fn env_command_entry() -> CommandEntry {
    CommandEntry {
        action_types: vec![ActionType::Shell],
        capabilities: vec![Capability::ShellExecute],
        profile: ENV_COMMAND_PROFILE.to_string(),
        deny_args: Vec::new(),
        deny_prefixes: Vec::new(),
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    pub proxy_port: u16,
    #[serde(default)]
    pub dns_server: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub listen: String,
    /// How other replicas reach this one (`http://host:port`), to hand it the streams and
    /// cancels of the runs it holds. Unset: `http://<the bound address>` when that is a specific
    /// address, else none (a replica then cannot hand this one a call for its runs).
    #[serde(default)]
    pub advertise_url: Option<String>,
    pub body_limit_bytes: usize,
    pub header_read_timeout_ms: u64,
    /// The whole request body must arrive within this time after the headers (408 otherwise).
    pub body_read_timeout_seconds: u64,
    pub shutdown_grace_seconds: u64,
    pub concurrency: ConcurrencyConfig,
    pub queue: QueueConfig,
}

/// The queue in front of each backend's run slots.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    /// Requests that may wait for a slot of one backend; one more is refused with 429.
    pub max_waiting: usize,
    /// How long a request may wait for a slot before it is refused with 429.
    pub max_wait_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyConfig {
    pub local: usize,
    pub docker: usize,
    pub gvisor: usize,
}

impl ConcurrencyConfig {
    pub fn for_backend(&self, b: BackendKind) -> usize {
        match b {
            BackendKind::Local => self.local,
            BackendKind::Docker => self.docker,
            BackendKind::Gvisor => self.gvisor,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    #[serde(default)]
    pub jwt_secret_file: Option<PathBuf>,
    pub audience: String,
    #[serde(default)]
    pub issuer: Option<String>,
    pub max_ttl_seconds: u64,
    pub leeway_seconds: u64,
    #[serde(default)]
    pub public_keys: Vec<PublicKeyConfig>,
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    #[serde(default)]
    pub static_tokens: Vec<StaticTokenConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublicKeyConfig {
    pub kid: String,
    pub alg: String,
    pub pem_file: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenKind {
    Service,
    Capability,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticTokenConfig {
    pub id: String,
    pub kind: TokenKind,
    pub sha256: String,
    #[serde(default)]
    pub capabilities: Vec<Capability>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    pub path: PathBuf,
    /// Refusal lines each class (unauthenticated 401s; refusals of authenticated callers) may
    /// write per second once its burst is spent; the rest are counted in `refusals_suppressed`
    /// lines.
    #[serde(default = "default_refusal_lines_per_second")]
    pub refusal_lines_per_second: f64,
    /// Refusal lines each class may write at once.
    #[serde(default = "default_refusal_burst")]
    pub refusal_burst: u32,
    /// A signed checkpoint of the log after this many new lines…
    #[serde(default = "default_checkpoint_every_lines")]
    pub checkpoint_every_lines: u64,
    /// …or this long after the last one, when a line was added (and at shutdown).
    #[serde(default = "default_checkpoint_every_seconds")]
    pub checkpoint_every_seconds: u64,
    /// Where checkpoints are written; unset: `<path>.checkpoints` beside the log.
    #[serde(default)]
    pub checkpoint_dir: Option<PathBuf>,
    /// The checkpoints' origin line and key name; unset: `executor-arm/<hostname>`. Each log
    /// (each replica) has its own.
    #[serde(default)]
    pub checkpoint_origin: Option<String>,
}

fn default_checkpoint_every_lines() -> u64 {
    1000
}

fn default_checkpoint_every_seconds() -> u64 {
    60
}

fn default_refusal_lines_per_second() -> f64 {
    crate::provenance::audit::RefusalRate::default().per_second
}

fn default_refusal_burst() -> u32 {
    crate::provenance::audit::RefusalRate::default().burst
}

impl AuditConfig {
    /// `checkpoint_dir`, or `<path>.checkpoints` beside the log.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir
            .clone()
            .unwrap_or_else(|| crate::provenance::checkpoint::default_dir(&self.path))
    }

    /// `checkpoint_origin`, or `executor-arm/<hostname>`.
    pub fn checkpoint_origin(&self) -> String {
        self.checkpoint_origin.clone().unwrap_or_else(|| {
            let host = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .filter(|h| crate::provenance::checkpoint::check_origin(h).is_ok())
                .unwrap_or_else(|| "localhost".into());
            format!("executor-arm/{host}")
        })
    }

    pub fn refusal_rate(&self) -> crate::provenance::audit::RefusalRate {
        crate::provenance::audit::RefusalRate {
            per_second: self.refusal_lines_per_second,
            burst: self.refusal_burst,
        }
    }
}

/// Signed execution receipts and audit checkpoints.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptsConfig {
    /// The Ed25519 signing key (PKCS#8 PEM, mode 0600; made at start when missing); unset:
    /// `receipts-ed25519.pem` under `state.dir`.
    #[serde(default)]
    pub signing_key_file: Option<PathBuf>,
    /// More public keys (PEM) that verify receipts and checkpoints: earlier keys after a
    /// rotation, other replicas' keys. The signing key's own public key is always one.
    #[serde(default)]
    pub public_key_files: Vec<PathBuf>,
}

impl ReceiptsConfig {
    /// `signing_key_file`, or `receipts-ed25519.pem` under the state directory.
    pub fn signing_key_file(&self, state: &StateConfig) -> PathBuf {
        self.signing_key_file.clone().unwrap_or_else(|| {
            state
                .dir
                .join(crate::provenance::keys::DEFAULT_KEY_FILE_NAME)
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// The embedded store's directory (created with mode 0700): it keeps `state.redb` there,
    /// which one daemon alone may open. Unused with `redis_url`.
    pub dir: PathBuf,
    #[serde(default)]
    pub redis_url: Option<String>,
    /// PEM CA bundle that alone is trusted for a `rediss://` server (default: the system's roots).
    #[serde(default)]
    pub redis_ca_file: Option<std::path::PathBuf>,
    pub idempotency_ttl_seconds: u64,
    /// How long an Idempotency-Key in progress stays claimed without a renewal: the running
    /// daemon renews it every third of this, so a key of a daemon that died is free this long
    /// after (or at once when the daemon restarts on its audit log).
    pub idempotency_lease_seconds: u64,
    /// Bytes of completed idempotent results the embedded store holds (Redis: its own maxmemory).
    pub idempotency_max_bytes: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    pub default_backend: BackendKind,
    pub profiles_dir: PathBuf,
    /// Per profile name, profile keys merged over that profile's file (e.g. the package index
    /// that `python-packages` may reach); checked like the file itself.
    #[serde(default)]
    pub profile_overrides: BTreeMap<String, toml::Table>,
    pub search_path: String,
    pub local: LocalConfig,
    pub docker: DockerConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalConfig {
    pub cgroup_name: String,
    /// Prepared run slots (a cgroup with a sandbox shim already in it) kept ready; 0 disables.
    #[serde(default = "default_warm_slots")]
    pub warm_slots: usize,
    /// Hold the kernel's cgroup `favordynmods` mode while the daemon runs, on cgroup v1 hosts (a
    /// detached cgroup v1 mount; see `sandbox::local::dynmods`): cgroup joins stall no fork.
    /// Off by default: containerd's cgroup v1 code fails on a hierarchy that is listed in
    /// `/proc/<pid>/cgroup` but mounted nowhere, and Docker then stops flagging OOM kills.
    #[serde(default)]
    pub cgroup_favor_dynmods: bool,
    /// The block of host uids each live run or session, and each docker or gvisor container
    /// (warm pool ones included), gets one of, its own, for its life (`uid_first` ..
    /// `uid_first + uid_count - 1`): the kernel counts inotify instances and watches and pipe
    /// buffers per uid, so sandboxes sharing one could exhaust them for each other.
    #[serde(default = "default_uid_first")]
    pub uid_first: u32,
    #[serde(default = "default_uid_count")]
    pub uid_count: u32,
    /// One lock file per uid in use (`flock`): every daemon of the host must name the same
    /// directory, so none hands out a uid another one holds.
    #[serde(default = "default_uid_lock_dir")]
    pub uid_lock_dir: PathBuf,
}

fn default_warm_slots() -> usize {
    2
}

fn default_uid_first() -> u32 {
    200_000
}

fn default_uid_count() -> u32 {
    65_536
}

fn default_uid_lock_dir() -> PathBuf {
    PathBuf::from("/run/executor-arm/uids")
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorsConfig {
    pub dir: PathBuf,
}

/// Runs as `GET /v1/executions/{id}` sees them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutionsConfig {
    /// How long a finished run's result stays readable (in the state store: Redis when
    /// configured, so any replica answers).
    pub retention_seconds: u64,
    /// Server-Sent Event streams this daemon keeps open at once; one more is refused with 429
    /// (a stream holds a copy of its run's output while its reader is slow).
    pub max_open_streams: usize,
}

/// `/mcp`: the Model Context Protocol front end (Streamable HTTP).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// Serve `/mcp` at all (off: it is a 404 like any unknown path).
    pub enabled: bool,
    /// `Host` header values `/mcp` answers (`host` matches any port, `host:port` that port); the
    /// host of `server.listen` is added when it is not a wildcard. Empty: any host (not for a
    /// daemon a browser could reach). Another host is 403.
    pub allowed_hosts: Vec<String>,
    /// Browser origins (`scheme://host:port`, `:*` any port) whose `Origin` header `/mcp`
    /// accepts (default: the loopback names, any port). A request without `Origin` (a service,
    /// not a browser) is always accepted; an `Origin` not listed is 403 (empty: every `Origin`
    /// is refused).
    pub allowed_origins: Vec<String>,
}

/// The E2B-compatible API: its control plane under `/e2b` on `server.listen`, its data plane
/// (envd's) on a listener of its own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bConfig {
    /// Where the data plane listens (`host:port`); setting it turns the E2B API on (control plane
    /// included). Unset: `/e2b` is a 404 like any unknown path.
    #[serde(default)]
    pub envd_listen: Option<String>,
    /// The `templateID`s a sandbox may be created from, each a session language and profile.
    #[serde(default)]
    pub templates: BTreeMap<String, E2bTemplate>,
}

/// What an E2B template is here: a session of `language` under `profile` (default: the
/// language's).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bTemplate {
    pub language: String,
    #[serde(default)]
    pub profile: Option<String>,
}

/// Sessions: sandboxes kept across several execs (`/v1/sandbox/sessions`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionsConfig {
    /// Where the local backend keeps each session's directory (its workspace tmpfs and the code
    /// of its execs); reaped at startup, so it belongs to this daemon alone.
    pub dir: PathBuf,
    pub max_total: usize,
    pub max_per_tenant: usize,
    pub max_ttl_seconds: u64,
    pub idle_timeout_seconds: u64,
    pub max_file_bytes: usize,
    /// Without a capability token at creation, the service token's `capabilities` are the grant.
    pub accept_service_capabilities: bool,
    /// Where paused sessions are kept (their workspace and record); unset: `sessions` under
    /// `state.dir`. Replicas that share Redis and this directory resume each other's sessions.
    #[serde(default)]
    pub store_dir: Option<PathBuf>,
    /// How long a session stays paused at most (its TTL keeps counting too; the earlier ends it).
    pub paused_ttl_seconds: u64,
    /// A stopping daemon pauses its sessions (they survive the restart) instead of ending them.
    pub pause_on_shutdown: bool,
    /// Paused sessions one (service, tenant) may keep in the store; a pause past it is 429.
    pub max_paused_per_tenant: usize,
    /// Background processes one session may have running; another is 429. At most
    /// [`MAX_SESSION_PROCESSES`].
    pub max_processes: usize,
    /// A background process's streams follow all of its output while it runs; the last this
    /// many bytes of each of its stdout and stderr are kept for readers that come late or
    /// resume (its record keeps its first `output_bytes`, as every run's does).
    pub process_output_ring_bytes: usize,
    /// The most bytes one WebSocket frame or message of a session's terminal may carry; a
    /// bigger one closes the socket with code 1009 (and hangs the terminal up).
    pub max_frame_bytes: usize,
    /// The ports of a session's sandbox its `…/ports/{port}/…` route reaches (`"N"` or `"N-M"`,
    /// inclusive); any other is 400.
    #[serde(default = "default_allowed_ports")]
    pub allowed_ports: PortRanges,
    pub languages: BTreeMap<String, LanguageEntry>,
}

impl SessionsConfig {
    /// The directory of paused sessions: `store_dir`, or `sessions` under the state directory.
    pub fn store_dir(&self, state: &StateConfig) -> PathBuf {
        self.store_dir
            .clone()
            .unwrap_or_else(|| state.dir.join("sessions"))
    }
}

fn default_allowed_ports() -> PortRanges {
    PortRanges(vec![(1024, 65535)])
}

/// Ranges of TCP ports, written `"8000"` or `"1024-65535"` (inclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRanges(Vec<(u16, u16)>);

impl PortRanges {
    /// Whether `port` is in one of the ranges.
    pub fn contains(&self, port: u16) -> bool {
        self.0.iter().any(|&(lo, hi)| (lo..=hi).contains(&port))
    }

    /// The ranges as written in the config, for messages.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|&(lo, hi)| {
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}-{hi}")
                }
            })
            .collect();
        parts.join(", ")
    }

    /// Parses one range (`"N"` or `"N-M"`, 1 ≤ N ≤ M ≤ 65535).
    fn parse_range(s: &str) -> Result<(u16, u16), String> {
        let port = |p: &str| {
            p.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("'{s}' is not a port or a range N-M of ports (1-65535)"))
        };
        let (lo, hi) = match s.split_once('-') {
            Some((a, b)) => (port(a)?, port(b)?),
            None => (port(s)?, port(s)?),
        };
        if lo > hi {
            return Err(format!("'{s}': the range's start is above its end"));
        }
        Ok((lo, hi))
    }
}

impl<'de> Deserialize<'de> for PortRanges {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let items = Vec::<String>::deserialize(d)?;
        items
            .iter()
            .map(|s| PortRanges::parse_range(s))
            .collect::<Result<Vec<_>, _>>()
            .map(PortRanges)
            .map_err(serde::de::Error::custom)
    }
}

/// One session language: an interpreter and what an exec of it needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LanguageEntry {
    /// A bare name, resolved against `sandbox.search_path` at startup.
    pub interpreter: String,
    pub action_type: ActionType,
    pub capability: Capability,
    /// The profile its sessions run under unless the creation names another.
    pub profile: String,
    /// The name of the file each exec's code is written to.
    pub file: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandEntry {
    pub action_types: Vec<ActionType>,
    pub capabilities: Vec<Capability>,
    pub profile: String,
    #[serde(default)]
    pub deny_args: Vec<String>,
    #[serde(default)]
    pub deny_prefixes: Vec<String>,
}

/// The `host:port` of an `http://host:port` URL (how replicas reach each other); None for
/// anything else (another scheme, a path, no port).
pub fn peer_authority(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("http://")?.trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':')?;
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '[' | ']' | ':');
    (!host.is_empty() && host.chars().all(plain) && port.parse::<u16>().is_ok_and(|p| p > 0))
        .then_some(rest)
}

/// Prefix of the environment variables that set any config key (`EXECUTOR_ARM__STATE__REDIS_URL`).
pub const ENV_PREFIX: &str = "EXECUTOR_ARM__";

/// The documented single-underscore variables (older names, kept as aliases; they win over the
/// `EXECUTOR_ARM__` form of the same key), read once (tests inject their own).
#[derive(Debug, Default, Clone)]
pub struct EnvOverrides {
    pub listen: Option<String>,
    pub jwt_secret_file: Option<String>,
    pub audit_log: Option<String>,
    pub executors_dir: Option<String>,
    pub profiles_dir: Option<String>,
    pub allowed_commands: Option<String>,
    pub sandbox_runtime: Option<String>,
    pub redis_url: Option<String>,
    pub advertise_url: Option<String>,
    pub sessions_dir: Option<String>,
    pub state_dir: Option<String>,
}

impl EnvOverrides {
    pub fn from_process() -> Self {
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        EnvOverrides {
            listen: get("EXECUTOR_ARM_LISTEN"),
            jwt_secret_file: get("EXECUTOR_ARM_JWT_SECRET_FILE"),
            audit_log: get("EXECUTOR_ARM_AUDIT_LOG"),
            executors_dir: get("EXECUTOR_ARM_EXECUTORS_DIR"),
            profiles_dir: get("EXECUTOR_ARM_PROFILES_DIR"),
            allowed_commands: get("ALLOWED_COMMANDS"),
            sandbox_runtime: get("SANDBOX_RUNTIME"),
            redis_url: get("EXECUTOR_ARM_REDIS_URL"),
            advertise_url: get("EXECUTOR_ARM_ADVERTISE_URL"),
            sessions_dir: get("EXECUTOR_ARM_SESSIONS_DIR"),
            state_dir: get("EXECUTOR_ARM_STATE_DIR"),
        }
    }
}

fn merge(base: &mut toml::Table, mut over: toml::Table) {
    // The allowlist is replaced, not merged: an operator's list is the whole list.
    if let Some(commands) = over.remove("commands") {
        base.insert("commands".into(), commands);
    }
    merge_tables(base, over);
}

/// `over` merged into `base` table by table: a value or an array of `over` replaces `base`'s.
pub(crate) fn merge_tables(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge_tables(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

impl Config {
    /// Embedded defaults, then `file` (if any), then `env`.
    pub fn load(file: Option<&Path>, env: &EnvOverrides) -> Result<Config, ConfigError> {
        let mut table: toml::Table =
            DEFAULT_CONFIG_TOML
                .parse()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    path: "<embedded default>".into(),
                    message: e.to_string(),
                })?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            let over: toml::Table =
                text.parse()
                    .map_err(|e: toml::de::Error| ConfigError::Parse {
                        path: path.display().to_string(),
                        message: e.to_string(),
                    })?;
            merge(&mut table, over);
        }
        // Every key can be set from the environment: `EXECUTOR_ARM__<SECTION>__<KEY>` (any depth,
        // `__` between levels, case-insensitive; values read as TOML scalars or arrays), over the
        // file. A name that is no key fails like an unknown key in the file.
        let figment = figment::Figment::from(figment::providers::Serialized::defaults(
            toml::Value::Table(table),
        ))
        .merge(figment::providers::Env::prefixed(ENV_PREFIX).split("__"));
        let mut cfg: Config = figment.extract().map_err(|e| ConfigError::Parse {
            path: match file {
                Some(p) => format!("{} and {ENV_PREFIX}* variables", p.display()),
                None => format!("<embedded default> and {ENV_PREFIX}* variables"),
            },
            message: e.to_string(),
        })?;
        cfg.apply_env(env)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn apply_env(&mut self, env: &EnvOverrides) -> Result<(), ConfigError> {
        if let Some(v) = &env.advertise_url {
            self.server.advertise_url = Some(v.clone());
        }
        if let Some(v) = &env.sessions_dir {
            self.sessions.dir = PathBuf::from(v);
        }
        if let Some(v) = &env.state_dir {
            self.state.dir = PathBuf::from(v);
        }
        if let Some(v) = &env.listen {
            self.server.listen = v.clone();
        }
        if let Some(v) = &env.jwt_secret_file {
            self.auth.jwt_secret_file = Some(PathBuf::from(v));
        }
        if let Some(v) = &env.audit_log {
            self.audit.path = PathBuf::from(v);
        }
        if let Some(v) = &env.executors_dir {
            self.executors.dir = PathBuf::from(v);
        }
        if let Some(v) = &env.profiles_dir {
            self.sandbox.profiles_dir = PathBuf::from(v);
        }
        if let Some(v) = &env.redis_url {
            self.state.redis_url = Some(v.clone());
        }
        if let Some(v) = &env.sandbox_runtime {
            self.sandbox.default_backend =
                BackendKind::from_runtime_name(v).ok_or_else(|| ConfigError::Env {
                    name: "SANDBOX_RUNTIME",
                    message: format!("'{v}' is not one of local, runc, gvisor"),
                })?;
        }
        if let Some(list) = &env.allowed_commands {
            let wanted: Vec<&str> = list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect();
            // Names the configuration lists are kept as configured; any other name is added with
            // a conservative entry (the policy checks it exists at startup).
            for w in &wanted {
                if !crate::vocabulary::is_bare_name(w) {
                    return Err(ConfigError::Env {
                        name: "ALLOWED_COMMANDS",
                        message: format!("'{}' is not a bare command name", w.escape_debug()),
                    });
                }
                if !self.commands.contains_key(*w) {
                    self.commands.insert(w.to_string(), env_command_entry());
                    self.env_added_commands.push(w.to_string());
                }
            }
            self.commands.retain(|k, _| wanted.contains(&k.as_str()));
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let r = self.audit.refusal_lines_per_second;
        if !(r.is_finite() && r >= 0.0) {
            return Err(ConfigError::Invalid(
                "audit.refusal_lines_per_second must be a number >= 0".into(),
            ));
        }
        if self.audit.checkpoint_every_lines == 0 || self.audit.checkpoint_every_seconds == 0 {
            return Err(ConfigError::Invalid(
                "audit.checkpoint_every_lines and audit.checkpoint_every_seconds must be >= 1"
                    .into(),
            ));
        }
        if let Some(o) = &self.audit.checkpoint_origin {
            crate::provenance::checkpoint::check_origin(o)
                .map_err(|m| ConfigError::Invalid(format!("audit.checkpoint_origin: {m}")))?;
        }
        if self.audit.refusal_burst == 0 {
            return Err(ConfigError::Invalid(
                "audit.refusal_burst must be >= 1 (0 would write no refusal line at all)".into(),
            ));
        }
        if self.server.body_limit_bytes == 0 {
            return Err(ConfigError::Invalid(
                "server.body_limit_bytes must be > 0".into(),
            ));
        }
        if self.server.body_read_timeout_seconds == 0 || self.server.header_read_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "server.body_read_timeout_seconds and server.header_read_timeout_ms must be > 0"
                    .into(),
            ));
        }
        if self.state.idempotency_max_bytes == 0 {
            return Err(ConfigError::Invalid(
                "state.idempotency_max_bytes must be > 0".into(),
            ));
        }
        if let Some(u) = &self.server.advertise_url
            && peer_authority(u).is_none()
        {
            return Err(ConfigError::Invalid(format!(
                "server.advertise_url must be http://host:port, got '{u}'"
            )));
        }
        if self.executions.retention_seconds == 0 {
            return Err(ConfigError::Invalid(
                "executions.retention_seconds must be > 0".into(),
            ));
        }
        let ses = &self.sessions;
        if ses.max_total == 0 || ses.max_per_tenant == 0 || ses.max_ttl_seconds == 0 {
            return Err(ConfigError::Invalid(
                "sessions.max_total, max_per_tenant and max_ttl_seconds must be > 0".into(),
            ));
        }
        if ses.max_processes > MAX_SESSION_PROCESSES {
            return Err(ConfigError::Invalid(format!(
                "sessions.max_processes must be at most {MAX_SESSION_PROCESSES}"
            )));
        }
        if ses.idle_timeout_seconds == 0 || ses.max_file_bytes == 0 || ses.paused_ttl_seconds == 0 {
            return Err(ConfigError::Invalid(
                "sessions.idle_timeout_seconds, max_file_bytes and paused_ttl_seconds must be > 0"
                    .into(),
            ));
        }
        // Everything under sessions.dir is removed when the daemon starts.
        let store = ses.store_dir(&self.state);
        if store.starts_with(&ses.dir) {
            return Err(ConfigError::Invalid(format!(
                "sessions.store_dir ({}) must not be inside sessions.dir ({}), which is emptied at every start",
                store.display(),
                ses.dir.display()
            )));
        }
        for (name, l) in &ses.languages {
            let file_ok = crate::vocabulary::is_bare_name(&l.file) && !l.file.starts_with('.');
            if !crate::vocabulary::is_bare_name(name)
                || !crate::vocabulary::is_bare_name(&l.interpreter)
                || !file_ok
            {
                return Err(ConfigError::Invalid(format!(
                    "sessions.languages.{}: the name, interpreter and file must be bare names",
                    name.escape_debug()
                )));
            }
            if l.action_type == ActionType::External {
                return Err(ConfigError::Invalid(format!(
                    "sessions.languages.{name}: action_type external is for registered executors"
                )));
            }
        }
        for b in BackendKind::ALL {
            if self.server.concurrency.for_backend(b) == 0 {
                return Err(ConfigError::Invalid(format!(
                    "server.concurrency.{} must be > 0",
                    b.as_str()
                )));
            }
        }
        for t in &self.auth.static_tokens {
            if t.sha256.len() != 64 || hex::decode(&t.sha256).is_err() {
                return Err(ConfigError::Invalid(format!(
                    "auth.static_tokens '{}': sha256 must be 64 hex digits",
                    t.id
                )));
            }
        }
        if let Some(d) = &self.egress.dns_server
            && d.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(ConfigError::Invalid(format!(
                "egress.dns_server '{d}' is not ip:port"
            )));
        }
        if self.state.idempotency_lease_seconds < 3 {
            return Err(ConfigError::Invalid(
                "state.idempotency_lease_seconds must be at least 3 (it is renewed every third)"
                    .into(),
            ));
        }
        if self.egress.proxy_port == 0 {
            return Err(ConfigError::Invalid("egress.proxy_port must be > 0".into()));
        }
        for (name, c) in &self.commands {
            if !is_bare_name(name) {
                return Err(ConfigError::Invalid(format!(
                    "commands.{name}: not a bare command name"
                )));
            }
            if c.action_types.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "commands.{name}: action_types is empty"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paused sessions default to the state directory, and a store inside `sessions.dir`
    /// (emptied at every start) is refused.
    #[test]
    fn the_paused_store_is_never_inside_the_sessions_dir() {
        let c = Config::load(None, &EnvOverrides::default()).unwrap();
        assert_eq!(
            c.sessions.store_dir(&c.state),
            PathBuf::from("executor-arm-state/sessions")
        );
        let env = EnvOverrides {
            sessions_dir: Some("/run/ea/sessions".into()),
            state_dir: Some("/run/ea/sessions/state".into()),
            ..Default::default()
        };
        let err = Config::load(None, &env).unwrap_err().to_string();
        assert!(err.contains("must not be inside sessions.dir"), "{err}");
    }

    #[test]
    fn allowed_ports_parse_ranges_and_single_ports() {
        let c = Config::load(None, &EnvOverrides::default()).unwrap();
        let ports = &c.sessions.allowed_ports;
        assert!(ports.contains(1024) && ports.contains(65535) && ports.contains(8000));
        assert!(!ports.contains(1023) && !ports.contains(22));
        assert_eq!(ports.describe(), "1024-65535");
        #[derive(Deserialize)]
        struct T {
            p: PortRanges,
        }
        let t: T = toml::from_str(r#"p = ["80", "8000-8099"]"#).unwrap();
        assert!(t.p.contains(80) && t.p.contains(8050) && !t.p.contains(8100));
        assert_eq!(t.p.describe(), "80, 8000-8099");
        for bad in [
            r#"p = ["0"]"#,
            r#"p = ["9-8"]"#,
            r#"p = ["x"]"#,
            r#"p = ["70000"]"#,
        ] {
            assert!(toml::from_str::<T>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn embedded_default_loads_with_seed_allowlist() {
        let c = Config::load(None, &EnvOverrides::default()).unwrap();
        let names: Vec<_> = c.commands.keys().cloned().collect();
        for n in [
            "echo", "ls", "cat", "grep", "curl", "wget", "python3", "nmap",
        ] {
            assert!(names.contains(&n.to_string()), "{n}");
        }
        assert_eq!(c.server.listen, "0.0.0.0:8003");
        assert_eq!(c.server.body_limit_bytes, 1 << 20);
        assert_eq!(c.server.body_read_timeout_seconds, 10);
        assert_eq!(c.state.idempotency_max_bytes, 64 << 20);
        assert_eq!(c.state.dir, PathBuf::from("executor-arm-state"));
        let env = EnvOverrides {
            state_dir: Some("/var/lib/x/state".into()),
            ..Default::default()
        };
        let c = Config::load(None, &env).unwrap();
        assert_eq!(c.state.dir, PathBuf::from("/var/lib/x/state"));
    }

    #[test]
    fn env_narrows_and_overrides() {
        let env = EnvOverrides {
            allowed_commands: Some("echo, ls".into()),
            sandbox_runtime: Some("runc".into()),
            listen: Some("127.0.0.1:0".into()),
            ..Default::default()
        };
        let c = Config::load(None, &env).unwrap();
        assert_eq!(c.commands.keys().collect::<Vec<_>>(), vec!["echo", "ls"]);
        assert!(c.env_added_commands.is_empty());
        assert_eq!(c.sandbox.default_backend, BackendKind::Docker);
        assert_eq!(c.server.listen, "127.0.0.1:0");
        // A name the configuration lacks is added, conservatively.
        let env = EnvOverrides {
            allowed_commands: Some("echo,date".into()),
            ..Default::default()
        };
        let c = Config::load(None, &env).unwrap();
        assert_eq!(c.commands.keys().collect::<Vec<_>>(), vec!["date", "echo"]);
        assert_eq!(c.env_added_commands, ["date"]);
        let date = &c.commands["date"];
        assert_eq!(date.capabilities, [Capability::ShellExecute]);
        assert_eq!(date.action_types, [ActionType::Shell]);
        assert_eq!(date.profile, ENV_COMMAND_PROFILE);
    }

    #[test]
    fn unknown_keys_and_bad_env_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[server]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
        let e = Config::load(Some(&f), &EnvOverrides::default()).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let env = EnvOverrides {
            sandbox_runtime: Some("kvm".into()),
            ..Default::default()
        };
        assert!(Config::load(None, &env).is_err());
        for bad in ["/bin/rm", "../rm", "r m"] {
            let env = EnvOverrides {
                allowed_commands: Some(bad.into()),
                ..Default::default()
            };
            assert!(Config::load(None, &env).is_err(), "{bad}");
        }
    }

    #[test]
    fn peer_urls_are_http_host_port() {
        assert_eq!(
            peer_authority("http://10.0.0.5:8003"),
            Some("10.0.0.5:8003")
        );
        assert_eq!(
            peer_authority("http://pod-1.svc:8003/"),
            Some("pod-1.svc:8003")
        );
        assert_eq!(
            peer_authority("http://[fd00::1]:8003"),
            Some("[fd00::1]:8003")
        );
        for bad in [
            "https://a:1",
            "http://a",
            "http://a:0",
            "http://:80",
            "http://a:80/x",
            "a:80",
            "http://a b:80",
        ] {
            assert_eq!(peer_authority(bad), None, "{bad}");
        }
    }

    #[test]
    fn file_merges_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[server]\nlisten = \"127.0.0.1:9\"\n[commands.echo]\naction_types=[\"shell\"]\ncapabilities=[]\nprofile=\"shell-readonly\"\n").unwrap();
        let c = Config::load(Some(&f), &EnvOverrides::default()).unwrap();
        assert_eq!(c.server.listen, "127.0.0.1:9");
        assert_eq!(c.server.body_limit_bytes, 1 << 20);
        assert_eq!(c.commands.len(), 1);
    }

    #[test]
    fn an_idempotency_lease_too_short_to_renew_is_refused() {
        let c = Config::load(None, &EnvOverrides::default()).unwrap();
        assert_eq!(c.state.idempotency_lease_seconds, 30);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[state]\nidempotency_lease_seconds = 2\n").unwrap();
        let e = Config::load(Some(&f), &EnvOverrides::default()).unwrap_err();
        assert!(e.to_string().contains("idempotency_lease_seconds"), "{e}");
    }

    #[test]
    fn a_refusal_rate_that_writes_nothing_or_is_not_a_number_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        for (toml, key) in [
            ("refusal_burst = 0", "refusal_burst"),
            (
                "refusal_lines_per_second = -1.0",
                "refusal_lines_per_second",
            ),
            ("refusal_lines_per_second = nan", "refusal_lines_per_second"),
            ("refusal_lines_per_second = inf", "refusal_lines_per_second"),
        ] {
            std::fs::write(&f, format!("[audit]\n{toml}\n")).unwrap();
            let e = Config::load(Some(&f), &EnvOverrides::default()).unwrap_err();
            assert!(e.to_string().contains(key), "{toml}: {e}");
        }
        std::fs::write(
            &f,
            "[audit]\nrefusal_burst = 1\nrefusal_lines_per_second = 0.0\n",
        )
        .unwrap();
        let c = Config::load(Some(&f), &EnvOverrides::default()).unwrap();
        assert_eq!(c.audit.refusal_burst, 1);
    }

    #[test]
    fn receipts_and_checkpoints_default_beside_the_state_and_the_log() {
        let c = Config::load(None, &EnvOverrides::default()).unwrap();
        assert_eq!(
            c.receipts.signing_key_file(&c.state),
            PathBuf::from("executor-arm-state/receipts-ed25519.pem")
        );
        assert!(c.receipts.public_key_files.is_empty());
        assert_eq!(
            (
                c.audit.checkpoint_every_lines,
                c.audit.checkpoint_every_seconds
            ),
            (1000, 60)
        );
        assert_eq!(
            c.audit.checkpoint_dir(),
            PathBuf::from("executor-arm-audit.jsonl.checkpoints")
        );
        let origin = c.audit.checkpoint_origin();
        assert!(origin.starts_with("executor-arm/"), "{origin}");
        crate::provenance::checkpoint::check_origin(&origin).unwrap();

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "[audit]\npath = \"/var/log/ea/audit.jsonl\"\ncheckpoint_every_lines = 10\n\
             checkpoint_origin = \"ea/r0\"\n[receipts]\nsigning_key_file = \"/k.pem\"\n\
             public_key_files = [\"/old.pem\"]\n",
        )
        .unwrap();
        let c = Config::load(Some(&f), &EnvOverrides::default()).unwrap();
        assert_eq!(
            c.receipts.signing_key_file(&c.state),
            PathBuf::from("/k.pem")
        );
        assert_eq!(c.receipts.public_key_files, [PathBuf::from("/old.pem")]);
        assert_eq!(c.audit.checkpoint_every_lines, 10);
        assert_eq!(c.audit.checkpoint_origin(), "ea/r0");
        assert_eq!(
            c.audit.checkpoint_dir(),
            PathBuf::from("/var/log/ea/audit.jsonl.checkpoints")
        );
        for (toml, key) in [
            (
                "[audit]\ncheckpoint_every_lines = 0",
                "checkpoint_every_lines",
            ),
            (
                "[audit]\ncheckpoint_every_seconds = 0",
                "checkpoint_every_seconds",
            ),
            ("[audit]\ncheckpoint_origin = \"a b\"", "checkpoint_origin"),
            ("[audit]\ncheckpoint_origin = \"a+b\"", "checkpoint_origin"),
            ("[receipts]\nsigning_key = \"/k\"", "signing_key"),
        ] {
            std::fs::write(&f, format!("{toml}\n")).unwrap();
            let e = Config::load(Some(&f), &EnvOverrides::default()).unwrap_err();
            assert!(e.to_string().contains(key), "{toml}: {e}");
        }
    }
}
