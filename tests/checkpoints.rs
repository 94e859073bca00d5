//! The daemon's own audit checkpoints: it makes its signing key at start, signs its log when it
//! stops, and `executor-arm audit verify --checkpoints` accepts the log it wrote and names the
//! lines cut from it.

mod common;

use std::process::Command;

use common::Daemon;
use serde_json::json;

fn verify(log: &std::path::Path, dir: &std::path::Path, key: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_executor-arm"))
        .args(["audit", "verify"])
        .arg(log)
        .arg("--checkpoints")
        .arg(dir)
        .arg("--key")
        .arg(key)
        .output()
        .expect("run audit verify");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_daemons_log_verifies_against_its_checkpoints_and_a_cut_is_named() {
    let mut d = Daemon::start();
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["signed"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(d.stop(), Some(0), "the daemon stops cleanly");

    // Its key was made at start, private to its owner.
    let key_file = d.dir.path().join("state/receipts-ed25519.pem");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&key_file)
            .expect("the signing key")
            .permissions(),
    );
    assert_eq!(mode & 0o077, 0, "key mode {mode:o}");
    let public = d.dir.path().join("signing.pub.pem");
    let out = Command::new(env!("CARGO_BIN_EXE_executor-arm"))
        .args(["receipt", "pubkey", "--key-file"])
        .arg(&key_file)
        .output()
        .expect("receipt pubkey");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&public, &out.stdout).unwrap();

    let dir = executor_arm::provenance::checkpoint::default_dir(&d.audit);
    let (ok, text) = verify(&d.audit, &dir, &public);
    assert!(ok, "the whole log verifies: {text}");

    // The last line cut off: the checkpoint made at the stop signs one more line than the log has.
    let log = std::fs::read_to_string(&d.audit).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let cut = lines[..lines.len() - 1].join("\n") + "\n";
    std::fs::write(&d.audit, cut).unwrap();
    let (ok, text) = verify(&d.audit, &dir, &public);
    assert!(!ok, "a cut log verifies: {text}");
    let n = lines.len();
    assert!(
        text.contains(&format!("line {n} missing")),
        "the cut is named: {text}"
    );
}
