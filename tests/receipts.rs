//! Receipts of real runs, through a real daemon on every backend: `/execute` (sync with
//! `"receipt": true`, async, streamed), a session's exec and a background process. Each receipt
//! verifies with `executor-arm receipt verify` against the key `/v1/receipts/keys` lists; its
//! subjects are the digests of what the answer returned; its audit position names the run's end
//! line. Each also verifies with a standard DSSE verifier (securesystemslib's, in the venv of
//! scripts/dsse-verifier-venv.sh: tests/receipts/verify_dsse.py). A changed byte of payload,
//! signature or keyid fails both.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use common::backends::Backend;
use common::docker::{SOCKET, one_at_a_time};
use common::sessions::{koder, new_session};
use common::wait::wait_for_async;
use common::{Daemon, Opts, open_stream};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

fn opts(backend: Backend) -> Opts {
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config: Some(common::docker::config(1, SOCKET)),
        ..Default::default()
    }
}

/// The statement an envelope carries.
fn statement(envelope: &Value) -> Value {
    let payload = STANDARD
        .decode(envelope["payload"].as_str().expect("payload"))
        .expect("payload is base64");
    serde_json::from_slice(&payload).expect("payload is JSON")
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn subject(st: &Value, name: &str) -> String {
    st["subject"]
        .as_array()
        .expect("subjects")
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no subject {name}: {st}"))["digest"]["sha256"]
        .as_str()
        .expect("sha256")
        .to_string()
}

/// The daemon's signing key, as `/v1/receipts/keys` lists it, in a file.
async fn public_key(d: &Daemon) -> PathBuf {
    let r = d.get_authorized("/v1/receipts/keys").await;
    assert_eq!(r.status, 200, "{}", r.text);
    let signing: Vec<&Value> = r.json["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .filter(|k| k["signing"] == true)
        .collect();
    assert_eq!(signing.len(), 1, "{}", r.text);
    assert_eq!(signing[0]["algorithm"], "ed25519");
    let path = d.dir.path().join("receipts.pub.pem");
    std::fs::write(&path, signing[0]["public_key_pem"].as_str().expect("pem")).unwrap();
    path
}

fn verify_cli(dir: &Path, envelope: &Value, key: &Path, name: &str) -> Output {
    let file = dir.join(format!("{name}.dsse.json"));
    std::fs::write(&file, envelope.to_string()).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_executor-arm"))
        .args(["receipt", "verify"])
        .arg(&file)
        .arg("--key")
        .arg(key)
        .output()
        .unwrap()
}

/// The python of the standard verifier's venv, made once for all the cases of this binary.
fn dsse_python() -> &'static str {
    static PYTHON: OnceLock<String> = OnceLock::new();
    PYTHON.get_or_init(|| common::venv_python("dsse-verifier-venv.sh"))
}

/// `envelope` checked with `key` by the standard DSSE verifier.
fn verify_standard(dir: &Path, envelope: &Value, key: &Path, name: &str) -> Output {
    let file = dir.join(format!("{name}.std.dsse.json"));
    std::fs::write(&file, envelope.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/receipts/verify_dsse.py");
    std::process::Command::new(dsse_python())
        .arg(script)
        .arg(&file)
        .arg(key)
        .output()
        .unwrap()
}

/// Verifies (with executor-arm's verifier and a standard one), and fails with both once any of
/// payload, signature and keyid has one byte changed.
fn assert_verifies(d: &Daemon, envelope: &Value, key: &Path, name: &str) {
    let out = verify_cli(d.dir.path(), envelope, key, name);
    assert!(
        out.status.success(),
        "{name}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let flip = |field: &str, sig: bool| {
        let mut e = envelope.clone();
        let slot = if sig {
            &mut e["signatures"][0][field]
        } else {
            &mut e[field]
        };
        let text = slot.as_str().unwrap().to_string();
        let mut bytes = text.into_bytes();
        // A base64 or hex character swapped for another of its alphabet.
        bytes[4] = if bytes[4] == b'A' { b'B' } else { b'A' };
        *slot = Value::String(String::from_utf8(bytes).unwrap());
        e
    };
    let out = verify_standard(d.dir.path(), envelope, key, name);
    assert!(
        out.status.success(),
        "{name}, standard verifier: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "urn:executor-arm:receipt:v1"
    );
    for (field, sig) in [("payload", false), ("sig", true), ("keyid", true)] {
        let changed = flip(field, sig);
        let label = format!("{name}-{field}");
        let out = verify_cli(d.dir.path(), &changed, key, &label);
        assert!(!out.status.success(), "{name}: a changed {field} verified");
        let out = verify_standard(d.dir.path(), &changed, key, &label);
        assert!(
            !out.status.success(),
            "{name}: a changed {field} verified with the standard verifier"
        );
    }
}

/// The audit line at the receipt's `audit_seq` is the run's end line, with that `entry_hash`.
fn assert_audit_position(d: &Daemon, st: &Value, exec_id: &str) {
    let pos = &st["predicate"]["audit"];
    let seq = pos["audit_seq"].as_u64().expect("audit_seq");
    let line = d
        .audit_lines()
        .into_iter()
        .find(|l| l["seq"] == seq)
        .unwrap_or_else(|| panic!("no audit line {seq}"));
    assert_eq!(line["event"], "execution", "{line}");
    assert_eq!(line["exec_id"], exec_id, "{line}");
    assert_eq!(line["entry_hash"], pos["entry_hash"], "{line}");
    assert_eq!(line["ts"], st["predicate"]["when"]["ended_at"], "{line}");
}

async fn receipt_of(d: &Daemon, path: &str) -> Value {
    let r = d.get_authorized(path).await;
    assert_eq!(r.status, 200, "{path}: {}", r.text);
    assert_eq!(r.headers["content-type"], "application/json");
    r.json
}

async fn execute_runs_have_receipts(backend: Backend) {
    let _serial = if backend.is_container() {
        Some(one_at_a_time().await)
    } else {
        None
    };
    let d = Daemon::start_with(opts(backend));
    let key = public_key(&d).await;

    // Sync, asked inline: the receipt is in the answer, and the same at its route.
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["receipted"], "receipt": true}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    let inline = r.json["receipt"].clone();
    assert_eq!(inline["payloadType"], "application/vnd.in-toto+json");
    let st = statement(&inline);
    assert_eq!(st["_type"], "https://in-toto.io/Statement/v1");
    assert_eq!(st["predicateType"], "urn:executor-arm:receipt:v1");
    assert_eq!(subject(&st, "stdout"), sha256_hex(b"receipted\n"));
    assert_eq!(subject(&st, "stderr"), sha256_hex(b""));
    assert_eq!(
        format!("sha256:{}", subject(&st, "command")),
        r.json["provenance"]["command_hash"].as_str().unwrap()
    );
    let p = &st["predicate"];
    assert_eq!(p["what"]["exec_id"], exec_id.as_str());
    assert_eq!(p["what"]["backend"], backend.name());
    assert_eq!(p["result"]["outcome"], "success");
    assert_eq!(p["result"]["exit_code"], 0);
    assert!(
        p["who"]["tenant"].is_null(),
        "an /execute run has no tenant: {p}"
    );
    assert_eq!(
        p["audit"]["audit_seq"], r.json["provenance"]["audit_seq"],
        "the receipt and the provenance name one line"
    );
    assert_audit_position(&d, &st, &exec_id);
    assert_verifies(&d, &inline, &key, "sync");
    let served = receipt_of(&d, &format!("/v1/executions/{exec_id}/receipt")).await;
    assert_eq!(served, inline);

    // Not asked: no receipt in the answer, one at the route all the same.
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["quiet"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.json.get("receipt").is_none(), "{}", r.text);
    let id = r.json["exec_id"].as_str().unwrap();
    let env = receipt_of(&d, &format!("/v1/executions/{id}/receipt")).await;
    assert_eq!(subject(&statement(&env), "stdout"), sha256_hex(b"quiet\n"));

    // Async: 409 while it runs (it would run 60 s), then, cancelled, its receipt, whose stdout
    // subject is the digest of the stdout its result returns.
    let r = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-u", "-c", "print('late'); import time; time.sleep(60)"], "async": true}))
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let id = r.json["exec_id"].as_str().unwrap().to_string();
    let path = format!("/v1/executions/{id}/receipt");
    let early = d.get_authorized(&path).await;
    assert_eq!(early.status, 409, "{}", early.text);
    assert_eq!(early.json["error_type"], "NotFinished");
    assert_eq!(early.json["retryable"], true);
    let svc = format!("Bearer {}", d.service_token());
    let cancel = d
        .post(
            &format!("/v1/executions/{id}/cancel"),
            &[("authorization", &svc)],
            json!({"grace_seconds": 0}).to_string(),
        )
        .await;
    assert_eq!(cancel.status, 202, "{}", cancel.text);
    let (_, late) = wait_for_async(
        "the cancelled run's receipt",
        Duration::from_secs(120),
        || async {
            let r = d.get_authorized(&path).await;
            (r.status, r.json)
        },
        |(status, _)| *status == 200,
    )
    .await;
    let result = d.get_authorized(&format!("/v1/executions/{id}")).await;
    assert_eq!(result.json["status"], "finished", "{}", result.text);
    let stdout = result.json["result"]["stdout"].as_str().unwrap();
    let st = statement(&late);
    assert_eq!(subject(&st, "stdout"), sha256_hex(stdout.as_bytes()));
    assert_eq!(st["predicate"]["result"]["outcome"], "cancelled");
    assert_audit_position(&d, &st, &id);
    assert_verifies(&d, &late, &key, "async");

    // Streamed: the result event carries it when asked.
    let mut s = open_stream(
        &d,
        json!({"action_type": "shell", "command": "echo", "args": ["streamed"], "receipt": true}),
    )
    .await;
    let events = s.rest().await;
    let result = events
        .iter()
        .find(|e| e.event == "result")
        .expect("a result event");
    let env = result.data["receipt"].clone();
    assert_eq!(
        subject(&statement(&env), "stdout"),
        sha256_hex(b"streamed\n")
    );
    assert_verifies(&d, &env, &key, "stream");

    // Another service, and an unknown run: 404, as for the run itself.
    let r = d.get_authorized("/v1/executions/no-such-run/receipt").await;
    assert_eq!(r.status, 404, "{}", r.text);
    let r = d.get(&format!("/v1/executions/{exec_id}/receipt")).await;
    assert_eq!(r.status, 401, "{}", r.text);
}

async fn session_execs_have_receipts(backend: Backend) {
    let _serial = if backend.is_container() {
        Some(one_at_a_time().await)
    } else {
        None
    };
    let d = Daemon::start_with(opts(backend));
    let key = public_key(&d).await;
    let c = koder(&d, Some("team-r"));
    let id = new_session(&c, "python").await;
    let code = "print('from the session')";
    let r = c.exec(&id, json!({"code": code, "receipt": true})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().unwrap().to_string();
    let inline = r.json["receipt"].clone();
    let st = statement(&inline);
    assert_eq!(subject(&st, "code"), sha256_hex(code.as_bytes()));
    assert_eq!(subject(&st, "stdout"), sha256_hex(b"from the session\n"));
    let p = &st["predicate"];
    assert_eq!(p["who"]["tenant"], "team-r");
    assert_eq!(p["what"]["session_id"], id.as_str());
    assert_audit_position(&d, &st, &exec_id);
    assert_verifies(&d, &inline, &key, "session");
    let path = format!("/v1/sandbox/sessions/{id}/execs/{exec_id}/receipt");
    let served = c.call("GET", &path, None).await;
    assert_eq!(served.status, 200, "{}", served.text);
    assert_eq!(served.json, inline);
    // Another tenant of the same service finds no such exec.
    let other = koder(&d, Some("team-s"));
    assert_eq!(other.call("GET", &path, None).await.status, 404);

    // A background process: 409 while it runs (until its stdin ends), then its receipt.
    let r = c
        .exec(
            &id,
            json!({"code": "import sys\nsys.stdin.read()\nprint('bg done')", "background": true}),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let pid = r.json["process_id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandbox/sessions/{id}/execs/{pid}/receipt");
    let early = c.call("GET", &path, None).await;
    assert_eq!(early.status, 409, "{}", early.text);
    let eof = format!("/v1/sandbox/sessions/{id}/processes/{pid}/stdin?eof=true");
    assert_eq!(c.call("POST", &eof, Some(Vec::new())).await.status, 204);
    let (_, done) = wait_for_async(
        "the background process's receipt",
        Duration::from_secs(120),
        || async {
            let r = c.call("GET", &path, None).await;
            (r.status, r.json)
        },
        |(status, _)| *status == 200,
    )
    .await;
    let st = statement(&done);
    assert_eq!(subject(&st, "stdout"), sha256_hex(b"bg done\n"));
    assert_audit_position(&d, &st, &pid);
    assert_verifies(&d, &done, &key, "background");
    assert_eq!(
        c.call("DELETE", &format!("/v1/sandbox/sessions/{id}"), None)
            .await
            .status,
        204
    );
}

on_every_backend!(multi_thread; execute_runs_have_receipts, session_execs_have_receipts);
