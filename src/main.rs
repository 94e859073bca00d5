//! The `executor-arm` command line: parse, load config, install telemetry, call the library.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use executor_arm::auth::{MintRequest, mint_hs256, read_secret, sha256_hex};
use executor_arm::config::{Config, EnvOverrides, TokenKind};
use executor_arm::provenance::keys::{self, KeySet};
use executor_arm::provenance::{audit, checkpoint, dsse, receipt};

#[derive(Parser)]
#[command(
    name = "executor-arm",
    version,
    about = "Hardened sandboxed command-execution daemon"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon.
    Serve {
        /// TOML config file merged over the embedded defaults.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address (overrides EXECUTOR_ARM_LISTEN and the config).
        #[arg(long)]
        listen: Option<String>,
        /// Zero-setup development mode: ephemeral secret, audit log and state directory, embedded
        /// config, prints a ready curl.
        #[arg(long)]
        dev: bool,
    },
    /// Token utilities.
    Token {
        #[command(subcommand)]
        cmd: TokenCmd,
    },
    /// Audit log utilities.
    Audit {
        #[command(subcommand)]
        cmd: AuditCmd,
    },
    /// Execution receipt utilities.
    Receipt {
        #[command(subcommand)]
        cmd: ReceiptCmd,
    },
    /// Validate config, allowlist, profiles and executor defs; print what was resolved.
    CheckConfig {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print the API's OpenAPI 3.1 document (what GET /openapi.json serves) without starting
    /// anything.
    Openapi,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Service,
    Capability,
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Print an HS256 JWT (last line of stdout).
    Mint {
        #[arg(long, value_enum)]
        kind: Kind,
        #[arg(long)]
        secret_file: PathBuf,
        /// Comma-separated capabilities (ShellRead,ShellExecute,...).
        #[arg(long, value_delimiter = ',', default_value = "")]
        capabilities: Vec<String>,
        #[arg(long, default_value_t = 60)]
        ttl: u64,
        #[arg(long)]
        sub: Option<String>,
        #[arg(long, default_value = "executor-arm")]
        aud: String,
        #[arg(long)]
        iss: Option<String>,
        #[arg(long)]
        single_use: bool,
        #[arg(long, value_delimiter = ',')]
        commands: Option<Vec<String>>,
        #[arg(long, value_delimiter = ',')]
        profiles: Option<Vec<String>>,
        #[arg(long)]
        max_timeout: Option<u64>,
    },
    /// Print the SHA-256 of a static `tok_…` token, for auth.static_tokens.
    Hash { token: String },
}

#[derive(Subcommand)]
enum AuditCmd {
    /// Verify the hash chain of an audit log; with --checkpoints, also that no line was cut or
    /// rewritten since the signed checkpoints.
    Verify {
        /// The log. With --checkpoints, several files may be given, oldest first: each must
        /// continue the one before it (its first line a segment_start after that one's last).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Directory of the log's signed checkpoints (audit.checkpoint_dir).
        #[arg(long)]
        checkpoints: Option<PathBuf>,
        /// Public key (PEM) the checkpoints must be signed with; may be given several times.
        #[arg(long = "key", value_name = "PUB", requires = "checkpoints")]
        keys: Vec<PathBuf>,
    },
}

#[derive(Subcommand)]
enum ReceiptCmd {
    /// Verify a receipt (a DSSE envelope) offline: exit 0 and print what it says, or non-zero
    /// with the reason.
    Verify {
        receipt: PathBuf,
        /// Public key (PEM) it may be signed with; may be given several times.
        #[arg(long = "key", value_name = "PUB", required = true)]
        keys: Vec<PathBuf>,
    },
    /// Print the public key (PEM) of the signing key; its keyid and checkpoint verifier key go
    /// to stderr.
    Pubkey {
        /// The signing key file (default: receipts.signing_key_file of the configuration).
        #[arg(long)]
        key_file: Option<PathBuf>,
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

/// Opens /dev/null on any of fds 0-2 that is closed, so no descriptor the daemon opens later (a
/// run's pipe, a socket) can land on a standard stream number.
fn ensure_std_fds() {
    for fd in 0..3 {
        // SAFETY: fcntl(2) F_GETFD on a number; open(2) of a static C string.
        unsafe {
            if libc::fcntl(fd, libc::F_GETFD) == -1 {
                libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            }
        }
    }
}

/// Caps glibc's malloc arenas at two, unless the operator set the limit themselves
/// (`MALLOC_ARENA_MAX`, or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`).
///
/// glibc gives threads that allocate concurrently arenas of their own (up to eight per core) and
/// keeps what is freed in each. Under mixed traffic (`scripts/soak.sh`) that held the daemon's RSS
/// at 70 MB after bursts, never returned; with two arenas it stays near 20 MB at the same load. The
/// daemon's allocations are short request buffers, so two arenas cost no measurable contention.
fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none()
        && !std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.arena_max"))
    {
        // SAFETY: mallopt(3) only sets an allocator parameter; called first thing in main, before
        // any thread exists.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}

fn main() -> Result<()> {
    limit_malloc_arenas();
    ensure_std_fds();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve {
            config,
            listen,
            dev,
        } => serve(config, listen, dev),
        Cmd::Token {
            cmd:
                TokenCmd::Mint {
                    kind,
                    secret_file,
                    capabilities,
                    ttl,
                    sub,
                    aud,
                    iss,
                    single_use,
                    commands,
                    profiles,
                    max_timeout,
                },
        } => {
            let secret = read_secret(&secret_file)?;
            let req = MintRequest {
                kind: Some(match kind {
                    Kind::Service => TokenKind::Service,
                    Kind::Capability => TokenKind::Capability,
                }),
                capabilities: capabilities.into_iter().filter(|c| !c.is_empty()).collect(),
                ttl_seconds: ttl,
                sub,
                aud,
                iss,
                single_use,
                commands,
                profiles,
                max_timeout_seconds: max_timeout,
            };
            println!("{}", mint_hs256(&secret, &req)?);
            Ok(())
        }
        Cmd::Token {
            cmd: TokenCmd::Hash { token },
        } => {
            if !executor_arm::auth::is_static_token(&token) {
                bail!("static tokens look like tok_<letters and digits>");
            }
            println!("{}", sha256_hex(token.as_bytes()));
            Ok(())
        }
        Cmd::Audit {
            cmd:
                AuditCmd::Verify {
                    files,
                    checkpoints,
                    keys,
                },
        } => audit_verify(&files, checkpoints.as_deref(), &keys),
        Cmd::Receipt {
            cmd: ReceiptCmd::Verify { receipt, keys },
        } => receipt_verify(&receipt, &keys),
        Cmd::Receipt {
            cmd: ReceiptCmd::Pubkey { key_file, config },
        } => receipt_pubkey(key_file, config),
        Cmd::CheckConfig { config } => check_config(config),
        Cmd::Openapi => {
            print!("{}", executor_arm::api::openapi::document_json());
            Ok(())
        }
    }
}

/// `audit verify`: the chain of one log, or of several files and checkpoints.
fn audit_verify(files: &[PathBuf], checkpoints: Option<&Path>, keys: &[PathBuf]) -> Result<()> {
    let Some(dir) = checkpoints else {
        let [file] = files else {
            bail!("several files are checked together only with --checkpoints");
        };
        return match audit::verify(file) {
            Ok(v) => {
                print_chain(&v);
                Ok(())
            }
            Err(e) => {
                eprintln!("audit log broken: {e}");
                std::process::exit(1);
            }
        };
    };
    if keys.is_empty() {
        bail!("--checkpoints needs at least one --key PUB to check their signatures with");
    }
    let keys = KeySet::from_files(keys)?;
    let c = match checkpoint::check_logs(files, dir, &keys) {
        Ok(c) => c,
        Err(checkpoint::LogCheckError::Audit(e)) => {
            eprintln!("audit log broken: {e}");
            std::process::exit(1);
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(v) = &c.chain {
        print_chain(v);
    }
    let latest = c.matched.iter().map(|m| m.checkpoint.size).max();
    println!(
        "checkpoints: {} match the log{}",
        c.matched.len(),
        latest
            .map(|n| format!(" (the latest signs {n} lines)"))
            .unwrap_or_default()
    );
    if !c.earlier.is_empty() {
        println!(
            "checkpoints: {} sign lines before seq {} (give the earlier files, oldest first, to check them)",
            c.earlier.len(),
            c.first_seq
        );
    }
    if let (Some(v), Some(n)) = (&c.chain, latest)
        && v.last_seq > n
    {
        println!(
            "lines {}-{} are after the latest checkpoint (not signed yet)",
            n + 1,
            v.last_seq
        );
    }
    if c.problems.is_empty() {
        return Ok(());
    }
    for p in &c.problems {
        eprintln!("audit log check failed: {p}");
    }
    std::process::exit(1);
}

fn print_chain(v: &audit::Verified) {
    println!(
        "ok: {} entries, chain intact, last seq {}, last entry_hash {}",
        v.lines, v.last_seq, v.last_hash
    );
    if let Some((seq, hash)) = &v.continues {
        println!(
            "this segment continues a previous one (see its segment_start line) after seq {seq}, entry_hash {hash}"
        );
    }
}

/// `receipt verify`: the envelope's signature and statement, then a summary.
fn receipt_verify(path: &Path, keys: &[PathBuf]) -> Result<()> {
    let keys = KeySet::from_files(keys)?;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| {
            f.take(dsse::MAX_ENVELOPE_BYTES as u64 + 1)
                .read_to_end(&mut bytes)
        })
        .with_context(|| format!("read {}", path.display()))?;
    let verified = dsse::parse(&bytes).and_then(|env| receipt::verify_receipt(&env, &keys));
    let st = match verified {
        Ok(st) => st,
        Err(e) => {
            eprintln!("receipt {} does not verify: {e}", path.display());
            std::process::exit(1);
        }
    };
    let r = &st.predicate;
    println!(
        "ok: receipt signed by a given key ({})",
        receipt::PREDICATE_TYPE
    );
    println!(
        "exec_id: {}  request_id: {}",
        r.what.exec_id, r.what.request_id
    );
    println!(
        "who: subject {}  token_id {}  tenant {}",
        r.who.subject.as_deref().unwrap_or("-"),
        r.who.token_id.as_deref().unwrap_or("-"),
        r.who.tenant.as_deref().unwrap_or("-")
    );
    println!(
        "what: {} on {} under profile {}, invocation_hash {}",
        r.what.action_type, r.what.backend, r.what.profile, r.what.invocation_hash
    );
    println!(
        "result: {} exit_code {} in {} ms{}",
        r.result.outcome,
        r.result.exit_code,
        r.result.duration_ms,
        r.result
            .killed_reason
            .as_deref()
            .map(|k| format!(", killed: {k}"))
            .unwrap_or_default()
    );
    println!("when: {} .. {}", r.when.started_at, r.when.ended_at);
    println!(
        "audit: seq {} entry_hash {}",
        r.audit.audit_seq, r.audit.entry_hash
    );
    for s in &st.subject {
        let digest = s.digest.get("sha256").map(String::as_str).unwrap_or("-");
        println!("subject {}: sha256:{digest}", s.name);
    }
    Ok(())
}

/// `receipt pubkey`: the signing key's public half, never the key itself.
fn receipt_pubkey(key_file: Option<PathBuf>, config: Option<PathBuf>) -> Result<()> {
    let cfg = Config::load(config.as_deref(), &EnvOverrides::from_process())?;
    let path = key_file.unwrap_or_else(|| cfg.receipts.signing_key_file(&cfg.state));
    let key = keys::load_signing_key(&path)?.verifying_key();
    print!("{}", keys::public_key_pem(&key));
    eprintln!("keyid: {}", keys::keyid(&key));
    eprintln!(
        "checkpoint verifier key: {}",
        checkpoint::verifier_key(&cfg.audit.checkpoint_origin(), &key)
    );
    Ok(())
}

fn check_config(path: Option<PathBuf>) -> Result<()> {
    let cfg = Config::load(path.as_deref(), &EnvOverrides::from_process())?;
    let policy = executor_arm::policy::Policy::load(&cfg)?;
    println!("listen: {}", cfg.server.listen);
    println!("default backend: {}", cfg.sandbox.default_backend.as_str());
    println!("audit log: {}", cfg.audit.path.display());
    if cfg.state.redis_url.is_some() {
        println!("state store: redis");
    } else {
        println!(
            "state store: embedded ({})",
            cfg.state
                .dir
                .join(executor_arm::state::durable::FILE_NAME)
                .display()
        );
    }
    println!("profiles ({}):", cfg.sandbox.profiles_dir.display());
    for p in policy.profiles.values() {
        println!(
            "  {} backend={} network={:?} memory={}MB pids={} timeout={}/{}s",
            p.name,
            p.backend(cfg.sandbox.default_backend).as_str(),
            p.network.mode,
            p.limits.memory_mb,
            p.limits.pids,
            p.limits.timeout_default_seconds,
            p.limits.timeout_max_seconds
        );
    }
    println!("allowlist:");
    for c in policy.commands.values() {
        println!(
            "  {} -> {} profile={} capabilities={:?}",
            c.name,
            c.path.display(),
            c.profile,
            c.capabilities
                .iter()
                .map(|c| c.as_str())
                .collect::<Vec<_>>()
        );
    }
    for (n, why) in &policy.disabled {
        println!("  {n}: DISABLED ({why})");
    }
    for n in &policy.env_added {
        println!(
            "warning: ALLOWED_COMMANDS adds '{n}', which the configuration does not list: shell only, requires ShellExecute, profile {}",
            executor_arm::config::ENV_COMMAND_PROFILE
        );
    }
    let (defs, skipped) = executor_arm::executors::load_dir(&cfg.executors.dir);
    println!("executors ({}):", cfg.executors.dir.display());
    for d in defs.values() {
        println!(
            "  {} -> {} {:?} timeout={:?} profile={:?}",
            d.name, d.command, d.args, d.timeout_seconds, d.profile
        );
    }
    for s in skipped {
        println!("  SKIPPED {}: {}", s.file.display(), s.reason);
    }
    for note in defs.values().filter_map(|d| d.timeout_note()) {
        println!("warning: {note}");
    }
    let auth = executor_arm::auth::Authenticator::new(&cfg.auth)?;
    if !auth.has_keys() {
        println!("warning: no verification key configured; serve will refuse to start");
    }
    println!("config ok");
    Ok(())
}

/// A private temp dir with a fresh 256-bit secret for `serve --dev`.
fn dev_secret() -> Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::Builder::new()
        .prefix("executor-arm-dev-")
        .tempdir()?;
    let path = dir.path().join("jwt-secret");
    let secret: [u8; 32] = rand::random();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    f.write_all(hex::encode(secret).as_bytes())?;
    Ok((dir, path))
}

fn serve(config: Option<PathBuf>, listen: Option<String>, dev: bool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The span exporter, when there is one, runs on the daemon's runtime.
    let telemetry = {
        let _rt = rt.enter();
        executor_arm::telemetry::init()?
    };
    if telemetry.exporting() {
        tracing::info!("exporting spans over OTLP/HTTP");
    }
    let served = serve_on(&rt, config, listen, dev);
    // Once the daemon stopped, while the runtime still runs the exporter: the last spans go out.
    telemetry.shutdown();
    served
}

fn serve_on(
    rt: &tokio::runtime::Runtime,
    config: Option<PathBuf>,
    listen: Option<String>,
    dev: bool,
) -> Result<()> {
    let mut env = EnvOverrides::from_process();
    let mut dev_dir = None;
    if dev {
        let (dir, secret) = dev_secret()?;
        env.jwt_secret_file = Some(secret.display().to_string());
        if env.audit_log.is_none() {
            env.audit_log = Some(dir.path().join("audit.jsonl").display().to_string());
        }
        if env.state_dir.is_none() {
            env.state_dir = Some(dir.path().join("state").display().to_string());
        }
        if env.listen.is_none() && listen.is_none() {
            env.listen = Some("127.0.0.1:8003".into());
        }
        dev_dir = Some(dir);
    }
    let mut cfg = Config::load(config.as_deref(), &env).context("configuration")?;
    if let Some(l) = listen {
        cfg.server.listen = l;
    }
    let addr: SocketAddr = cfg
        .server
        .listen
        .parse()
        .with_context(|| format!("listen address '{}'", cfg.server.listen))?;
    rt.block_on(async move {
        let state = executor_arm::app::build(cfg).await?;
        // Before "listening": a SIGHUP must never find the default (terminating) disposition.
        spawn_sighup(state.clone())?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind {addr}"))?;
        let bound = listener.local_addr()?;
        match advertise_url(&state.config, bound) {
            Some(url) => state.executions.set_address(url),
            None if state.config.state.redis_url.is_some() => tracing::warn!(
                "server.advertise_url is not set and the listen address is a wildcard: other \
                 replicas cannot hand this one streams and cancels of its runs"
            ),
            None => {}
        }
        tracing::info!(addr = %bound, version = executor_arm::api::VERSION, "listening");
        if dev {
            print_dev_banner(&state, bound)?;
        }
        // MCP sessions end when the daemon starts draining: their open streams must not hold
        // the drain up.
        let mcp_shutdown = tokio_util::sync::CancellationToken::new();
        let mut front_ends = executor_arm::mcp::routes(&state, mcp_shutdown.clone());
        let mut envd_served = None;
        // The E2B API, when e2b.envd_listen turns it on: its control plane beside the REST
        // API, its data plane on its own listener (its process streams end at the drain).
        if let Some(e2b) = executor_arm::e2b::E2b::new(&state, mcp_shutdown.clone())? {
            let envd = executor_arm::e2b::bind_envd(&state)
                .await?
                .context("e2b.envd_listen")?;
            tracing::info!(addr = %envd.local_addr()?, "E2B data plane listening");
            front_ends = front_ends.merge(e2b.control_routes());
            envd_served = Some(tokio::spawn(executor_arm::api::serve_listener(
                envd,
                e2b.envd_routes(),
                std::time::Duration::from_millis(state.config.server.header_read_timeout_ms),
                std::time::Duration::from_secs(state.config.server.shutdown_grace_seconds),
                mcp_shutdown.clone(),
            )));
        }
        let shutdown = async move {
            shutdown_signal().await;
            mcp_shutdown.cancel();
        };
        executor_arm::api::run(listener, state, front_ends, shutdown).await;
        // The data plane's drain (bounded by the shutdown grace) ends before the daemon does.
        if let Some(served) = envd_served {
            let _ = served.await;
        }
        drop(dev_dir);
        tracing::info!("stopped");
        Ok(())
    })
}

/// How other replicas reach this one: `server.advertise_url`, else the bound address when it is
/// a specific one.
fn advertise_url(config: &Config, bound: SocketAddr) -> Option<String> {
    match &config.server.advertise_url {
        Some(u) => Some(u.trim_end_matches('/').to_string()),
        None if !bound.ip().is_unspecified() => Some(format!("http://{bound}")),
        None => None,
    }
}

fn print_dev_banner(state: &Arc<executor_arm::api::AppState>, addr: SocketAddr) -> Result<()> {
    let secret_file = state
        .config
        .auth
        .jwt_secret_file
        .clone()
        .context("dev secret")?;
    let secret = read_secret(&secret_file)?;
    let base = MintRequest {
        ttl_seconds: 3600,
        aud: state.config.auth.audience.clone(),
        sub: Some("dev".into()),
        ..Default::default()
    };
    let service = mint_hs256(
        &secret,
        &MintRequest {
            kind: Some(TokenKind::Service),
            ..base.clone()
        },
    )?;
    let caps = [
        "ShellRead",
        "ShellExecute",
        "FilesystemRead",
        "PythonExecute",
        "ExternalExecute",
    ];
    let capability = mint_hs256(
        &secret,
        &MintRequest {
            kind: Some(TokenKind::Capability),
            capabilities: caps.iter().map(|s| s.to_string()).collect(),
            ..base
        },
    )?;
    let port = addr.port();
    println!(
        "executor-arm dev mode: listening on {addr}; secret {} (deleted on exit); tokens valid 1 h",
        secret_file.display()
    );
    println!("audit log: {}", state.config.audit.path.display());
    println!("try:");
    println!(
        "curl -s http://127.0.0.1:{port}/execute -H 'Authorization: Bearer {service}' -H 'Content-Type: application/json' -d '{{\"action_type\":\"shell\",\"command\":\"echo\",\"args\":[\"hello\"],\"capability_token\":\"{capability}\"}}'"
    );
    std::io::stdout().flush()?;
    Ok(())
}

/// SIGHUP reloads external executor defs (the loader logs every skipped def).
fn spawn_sighup(state: Arc<executor_arm::api::AppState>) -> Result<()> {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("install SIGHUP handler")?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            let skipped = state.executions.executors().reload();
            tracing::info!(skipped = skipped.len(), "executor defs reloaded on SIGHUP");
        }
    });
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutdown signal received");
}
