//! What the benchmarks share: a release daemon on a loopback port with a throwaway secret and
//! audit log, and tokens for it; and the recording of results ([`report`]).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use executor_arm::auth::{MintRequest, mint_hs256};
use executor_arm::config::TokenKind;

// Each benchmark uses the part of it that it needs.
#[allow(dead_code)]
pub mod ports;
#[allow(dead_code)]
pub mod report;

const SECRET: &str = "bench-secret-0123456789abcdef0123456789abcdef";

/// A daemon under benchmark; stopped (SIGTERM) when dropped.
pub struct Daemon {
    child: Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts `EXECUTOR_ARM_BIN` (default the release build) with `env` added, logging at info
    /// like production (every execution is logged too: the cost is part of the figures).
    pub fn start(env: &[(&str, &str)]) -> Daemon {
        let bin = std::env::var("EXECUTOR_ARM_BIN")
            .unwrap_or_else(|_| "target/release/executor-arm".into());
        Self::start_bin(&bin, env)
    }

    /// [`Daemon::start`] of the binary `bin`.
    pub fn start_bin(bin: &str, env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("secret"), SECRET).expect("secret");
        let sessions = dir.path().join("sessions");
        let mut child = Command::new(bin)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("EXECUTOR_ARM_JWT_SECRET_FILE", dir.path().join("secret"))
            .env("EXECUTOR_ARM_AUDIT_LOG", dir.path().join("audit.jsonl"))
            .env("RUST_LOG", "info")
            .env("EXECUTOR_ARM_SESSIONS_DIR", &sessions)
            // Its own embedded store: two daemons of one run (a build and its baseline) never
            // share one, and nothing is written where the benchmark was started.
            .env("EXECUTOR_ARM_STATE_DIR", dir.path().join("state"))
            .envs(env.iter().copied())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start daemon");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        // Keep draining the daemon's log so it never blocks on a full pipe; its warnings and
        // errors go to the benchmark's own output, which says why a request failed.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("\"level\":\"WARN\"") || line.contains("\"level\":\"ERROR\"") {
                    eprintln!("daemon: {line}");
                }
                if line.contains("\"listening\"")
                    && let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                {
                    let _ = tx.send(v["fields"]["addr"].as_str().unwrap_or_default().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("daemon address");
        Daemon {
            child,
            addr,
            _dir: dir,
        }
    }

    /// A token of `kind` for the subject `bench`, with `caps`.
    pub fn mint(&self, kind: TokenKind, caps: &[&str]) -> String {
        mint_hs256(
            SECRET.as_bytes(),
            &MintRequest {
                kind: Some(kind),
                capabilities: caps.iter().map(|s| s.to_string()).collect(),
                ttl_seconds: 3000,
                aud: "executor-arm".into(),
                sub: Some("bench".into()),
                ..Default::default()
            },
        )
        .expect("mint")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}
