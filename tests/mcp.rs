//! `/mcp` driven by a real MCP client: the official MCP Python SDK (pinned in
//! scripts/mcp-client-venv.sh) runs tests/mcp/test_mcp.py against a daemon on the local backend:
//! the session era and the stateless revision, every tool, errors as the REST bodies, progress
//! notifications, 401 and 403 admission, and the audit lines of an MCP run against its REST
//! twin's.

mod common;

use std::path::Path;
use std::process::Command;

use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;

/// The venv's python, made (or found cached) by scripts/mcp-client-venv.sh.
fn python() -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(repo.join("scripts/mcp-client-venv.sh"))
        .output()
        .expect("run scripts/mcp-client-venv.sh");
    assert!(
        out.status.success(),
        "scripts/mcp-client-venv.sh failed (it installs the MCP Python SDK from PyPI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .last()
        .expect("the venv's python")
        .trim()
        .to_string()
}

#[test]
fn python_sdk_drives_mcp() {
    let python = python();
    let d = Daemon::start_with(Opts::default());
    // The service token's capabilities are the grant of calls without a capability token.
    let service = d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 600,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec![
            "ShellExecute".into(),
            "PythonExecute".into(),
            "FilesystemRead".into(),
            "FilesystemWrite".into(),
        ],
        ..Default::default()
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/test_mcp.py");
    let out = Command::new(&python)
        .arg(&script)
        .env("MCP_BASE", &d.base)
        .env("MCP_SERVICE_TOKEN", &service)
        .env("MCP_CAPABILITY_TOKEN", d.cap_all())
        .env("MCP_AUDIT_LOG", &d.audit)
        .output()
        .expect("run the MCP client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("mcp: OK"),
        "{} failed:\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
