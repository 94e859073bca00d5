//! `executor-arm receipt verify`, `receipt pubkey` and `audit verify --checkpoints`, run as the
//! built binary on files the test writes with the library (keys, receipts, a log and its
//! checkpoints). Needs nothing of the host.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use executor_arm::egress::ConnRecord;
use executor_arm::provenance::audit::{AuditEvent, AuditLog, SessionClosed};
use executor_arm::provenance::checkpoint::{CheckpointWriter, default_dir};
use executor_arm::provenance::keys::{self, SigningKey};
use executor_arm::provenance::receipt::{
    AuditPosition, Receipt, RunLimits, RunResult, Statement, Subject, What, When, Who, sign_receipt,
};

fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_executor-arm"));
    for a in args {
        c.arg(a);
    }
    // The checkpoint verifier key printed by `receipt pubkey` comes from the embedded config.
    c.env_remove("RUST_BACKTRACE").output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A signing key in `dir` (made as the daemon makes it) and its public key file.
fn key_pair(dir: &Path, name: &str) -> (SigningKey, PathBuf) {
    let (k, _) = keys::load_or_generate(&dir.join(format!("{name}.pem"))).unwrap();
    let public = dir.join(format!("{name}.pub.pem"));
    std::fs::write(&public, keys::public_key_pem(&k.verifying_key())).unwrap();
    (k, public)
}

fn statement() -> Statement {
    Statement::new(
        vec![
            Subject::sha256("command", &format!("sha256:{}", "a".repeat(64))),
            Subject::sha256("stdout", &format!("sha256:{}", "b".repeat(64))),
            Subject::sha256("stderr", &format!("sha256:{}", "c".repeat(64))),
        ],
        Receipt {
            who: Who {
                subject: Some("orchestrator".into()),
                token_id: Some("jti-7".into()),
                tenant: Some("t1".into()),
            },
            what: What {
                exec_id: "exec-42".into(),
                request_id: "req-42".into(),
                action_type: "shell".into(),
                command_hash: format!("sha256:{}", "a".repeat(64)),
                invocation_hash: format!("sha256:{}", "d".repeat(64)),
                profile: "shell-readonly".into(),
                backend: "local".into(),
                limits: RunLimits {
                    timeout_seconds: 30,
                    cpus: 1.0,
                    memory_bytes: 1 << 28,
                    disk_bytes: 1 << 26,
                    pids: 64,
                    output_bytes: 1 << 20,
                    on_overflow: "truncate".into(),
                    nofile: 256,
                },
                session_id: None,
                executor_def_sha256: None,
            },
            result: RunResult {
                outcome: "success".into(),
                exit_code: 0,
                killed_reason: None,
                duration_ms: 5,
                peak_memory_kib: Some(512),
                oom: false,
                stdout_truncated: false,
                stderr_truncated: false,
                error_code: None,
                network: vec![ConnRecord::default()],
            },
            when: When {
                started_at: "2026-01-01T00:00:00.000Z".into(),
                ended_at: "2026-01-01T00:00:00.005Z".into(),
            },
            audit: AuditPosition {
                audit_seq: 7,
                entry_hash: format!("sha256:{}", "e".repeat(64)),
            },
        },
    )
}

#[test]
fn receipt_verify_accepts_a_signed_receipt_and_names_what_is_wrong_with_an_altered_one() {
    let dir = tempfile::tempdir().unwrap();
    let (k, public) = key_pair(dir.path(), "signer");
    let (_, other) = key_pair(dir.path(), "other");
    let env = sign_receipt(&statement(), &k).unwrap();
    let good = dir.path().join("receipt.json");
    std::fs::write(&good, serde_json::to_vec(&env).unwrap()).unwrap();

    let out = run(&[&"receipt", &"verify", &good, &"--key", &public]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for want in [
        "exec_id: exec-42",
        "result: success exit_code 0",
        "audit: seq 7",
        "subject stdout: sha256:bbbb",
    ] {
        assert!(stdout.contains(want), "{want} in {stdout}");
    }
    // Rotation: the old key beside the current one.
    let out = run(&[
        &"receipt", &"verify", &good, &"--key", &other, &"--key", &public,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    let write = |name: &str, env: &executor_arm::provenance::dsse::Envelope| {
        let p = dir.path().join(name);
        std::fs::write(&p, serde_json::to_vec(env).unwrap()).unwrap();
        p
    };
    let mut payload = STANDARD.decode(&env.payload).unwrap();
    let at = payload.len() / 2;
    payload[at] ^= 0x01;
    let mut flipped_payload = env.clone();
    flipped_payload.payload = STANDARD.encode(&payload);
    let mut sig = STANDARD.decode(&env.signatures[0].sig).unwrap();
    sig[0] ^= 0x01;
    let mut flipped_sig = env.clone();
    flipped_sig.signatures[0].sig = STANDARD.encode(&sig);
    let mut flipped_keyid = env.clone();
    let mut id = flipped_keyid.signatures[0].keyid.clone().into_bytes();
    id[0] = if id[0] == b'0' { b'1' } else { b'0' };
    flipped_keyid.signatures[0].keyid = String::from_utf8(id).unwrap();
    let cases = [
        (write("payload.json", &flipped_payload), "does not verify"),
        (write("sig.json", &flipped_sig), "does not verify"),
        (
            write("keyid.json", &flipped_keyid),
            "no signature by a known key",
        ),
    ];
    for (file, why) in &cases {
        let out = run(&[&"receipt", &"verify", file, &"--key", &public]);
        assert!(!out.status.success(), "{} verified", file.display());
        let err = text(&out.stderr);
        assert!(err.contains(why), "{}: {err}", file.display());
    }
    // The right receipt under the wrong key.
    let out = run(&[&"receipt", &"verify", &good, &"--key", &other]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no signature by a known key"));
    // Not an envelope at all.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "{}").unwrap();
    let out = run(&[&"receipt", &"verify", &junk, &"--key", &public]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("not a DSSE envelope"));
}

#[test]
fn receipt_pubkey_prints_the_public_key_and_refuses_a_readable_key() {
    let dir = tempfile::tempdir().unwrap();
    let (k, public) = key_pair(dir.path(), "signer");
    let key_file = dir.path().join("signer.pem");
    let out = run(&[&"receipt", &"pubkey", &"--key-file", &key_file]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), std::fs::read_to_string(&public).unwrap());
    assert!(
        text(&out.stderr).contains(&keys::keyid(&k.verifying_key())),
        "{}",
        text(&out.stderr)
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(&[&"receipt", &"pubkey", &"--key-file", &key_file]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("mode 0644") && err.contains("signer.pem"),
        "{err}"
    );
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn audit_verify_with_checkpoints_catches_a_cut_a_rewrite_and_a_forgery() {
    let dir = tempfile::tempdir().unwrap();
    let (k, public) = key_pair(dir.path(), "signer");
    let log_path = dir.path().join("audit.jsonl");
    let cps = default_dir(&log_path);
    let writer = CheckpointWriter::new(&cps, "executor-arm/cli-test", k).unwrap();
    let log = AuditLog::open(&log_path, "i-1").unwrap();
    for i in 1..=30u64 {
        log.append(&AuditEvent::SessionEnd(SessionClosed {
            session_id: format!("s-{i}"),
            owner: "o".into(),
            tenant: String::new(),
            reason: "deleted",
            execs: i,
        }))
        .unwrap();
        if i % 10 == 0 {
            writer.checkpoint_log(&log).unwrap();
        }
    }
    for i in 31..=33u64 {
        log.append(&AuditEvent::SessionEnd(SessionClosed {
            session_id: format!("s-{i}"),
            owner: "o".into(),
            tenant: String::new(),
            reason: "deleted",
            execs: i,
        }))
        .unwrap();
    }
    drop(log);
    let intact = lines(&log_path);
    let verify = |extra: &[&dyn AsRef<std::ffi::OsStr>]| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
            vec![&"audit", &"verify", &log_path, &"--checkpoints", &cps];
        args.extend_from_slice(extra);
        run(&args)
    };

    let out = verify(&[&"--key", &public]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("ok: 33 entries"), "{stdout}");
    assert!(
        stdout.contains("checkpoints: 3 match the log (the latest signs 30 lines)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("lines 31-33 are after the latest checkpoint"),
        "{stdout}"
    );
    // Without --checkpoints: the chain alone, as before.
    let out = run(&[&"audit", &"verify", &log_path]);
    assert!(out.status.success());
    assert!(text(&out.stdout).starts_with("ok: 33 entries"));
    // --checkpoints without a key is refused.
    assert!(!verify(&[]).status.success());

    // Cut below the last checkpoint by one line, then by a whole interval.
    std::fs::write(&log_path, intact[..29].join("\n") + "\n").unwrap();
    let out = verify(&[&"--key", &public]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("line 30 missing: checkpoint-30 signs 30 lines, the log has 29"),
        "{err}"
    );
    std::fs::write(&log_path, intact[..15].join("\n") + "\n").unwrap();
    let out = verify(&[&"--key", &public]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("lines 16-20 missing: checkpoint-20 signs 20 lines, the log has 15"),
        "{err}"
    );
    assert!(
        err.contains("lines 16-30 missing: checkpoint-30 signs 30 lines, the log has 15"),
        "{err}"
    );

    // A line rewritten in place.
    let mut edited = intact.clone();
    edited[4] = edited[4].replace("s-5", "s-9");
    std::fs::write(&log_path, edited.join("\n") + "\n").unwrap();
    let out = verify(&[&"--key", &public]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("line 5"),
        "{}",
        text(&out.stderr)
    );

    // A checkpoint signed by another key, in the log's name.
    std::fs::write(&log_path, intact.join("\n") + "\n").unwrap();
    let (other_key, other_public) = key_pair(dir.path(), "other");
    let forged = executor_arm::provenance::checkpoint::Checkpoint::new(
        "executor-arm/cli-test",
        40,
        &format!("sha256:{}", "f".repeat(64)),
    )
    .unwrap()
    .sign(&other_key);
    std::fs::write(cps.join("checkpoint-40"), forged).unwrap();
    let out = verify(&[&"--key", &public]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("checkpoint-40: no signature by a known key"),
        "{err}"
    );
    // Trusting that key too (its signature now verifies) shows the cut it claims.
    let out = verify(&[&"--key", &public, &"--key", &other_public]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("lines 34-40 missing: checkpoint-40 signs 40 lines"),
        "{}",
        text(&out.stderr)
    );
}
