//! The daemon's own audit checkpoints: it makes its signing key at start, signs its log when it
//! stops, and `executor-arm audit verify --checkpoints` accepts the log it wrote and names the
//! lines cut from it.

mod common;

use std::process::Command;

use common::{Daemon, Opts};
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

/// A daemon killed (SIGKILL) at several moments while runs go on and their lines are
/// checkpointed (every line, at most once a second): each next daemon starts on the same files,
/// no checkpoint's temp file outlives the start, and the whole log verifies against every
/// checkpoint left.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_killed_while_it_checkpoints_leaves_a_log_the_next_start_verifies() {
    let opts = || Opts {
        config: Some("[audit]\ncheckpoint_every_lines = 1\ncheckpoint_every_seconds = 1\n".into()),
        ..Default::default()
    };
    let mut d = Daemon::start_with(opts());
    let client = reqwest::Client::new();
    for delay_ms in [150u64, 900, 1000, 1100, 1400, 2100] {
        let (base, svc, cap) = (d.base.clone(), d.service_token(), d.cap_all());
        // Two callers running echo back to back until the daemon is gone.
        let load: Vec<_> = (0..2)
            .map(|_| {
                let (client, base, svc) = (client.clone(), base.clone(), svc.clone());
                let body = json!({"action_type": "shell", "command": "echo", "args": ["load"],
                                  "capability_token": cap});
                tokio::spawn(async move {
                    while client
                        .post(format!("{base}/execute"))
                        .bearer_auth(&svc)
                        .json(&body)
                        .send()
                        .await
                        .is_ok()
                    {}
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
        d.kill9();
        for l in load {
            let _ = l.await;
        }
        d = d.restart(opts());
        let r = d
            .exec(json!({"action_type": "shell", "command": "echo", "args": ["after"]}))
            .await;
        assert_eq!(r.status, 200, "after a kill at {delay_ms} ms: {}", r.text);
    }
    let dir = executor_arm::provenance::checkpoint::default_dir(&d.audit);
    assert_eq!(d.stop(), Some(0), "the daemon stops cleanly");
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.ends_with(".tmp")),
        "temp files left: {names:?}"
    );
    assert!(names.len() >= 3, "checkpoints: {names:?}");
    let key_file = d.dir.path().join("state/receipts-ed25519.pem");
    let out = Command::new(env!("CARGO_BIN_EXE_executor-arm"))
        .args(["receipt", "pubkey", "--key-file"])
        .arg(&key_file)
        .output()
        .expect("receipt pubkey");
    assert!(out.status.success());
    let public = d.dir.path().join("signing.pub.pem");
    std::fs::write(&public, &out.stdout).unwrap();
    let (ok, text) = verify(&d.audit, &dir, &public);
    assert!(ok, "the log verifies after the kills: {text}");
}
