//! The embedded state store keeps what it acknowledged in a file under `state.dir`: a daemon
//! killed with `kill -9` and started again on the same files still knows the single-use tokens
//! it used up, the answers of Idempotency-Keys and the records of runs, and accepts a single-use
//! token minted the moment it is back. (The first start creates the file, whose record of used
//! tokens begins then: tokens used on that start are minted after it.)
mod common;

use common::{Daemon, Opts, Resp};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use serde_json::{Value, json};

fn single_use_cap(d: &Daemon) -> String {
    d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 300,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["ShellExecute".into()],
        single_use: true,
        ..Default::default()
    })
}

fn echo(tok: &str, word: &str) -> Value {
    json!({"action_type": "shell", "command": "echo", "args": [word], "capability_token": tok})
}

fn last_refusal(d: &Daemon) -> Value {
    d.audit_lines()
        .into_iter()
        .rev()
        .find(|l| l["event"] == json!("refusal"))
        .expect("a refusal line")
}

fn kill9_and_restart(mut d: Daemon) -> Daemon {
    d.kill9();
    d.restart(Opts::default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_use_token_minted_right_after_a_kill_9_restart_is_accepted() {
    let d = Daemon::start();
    d.wait_until_tokens_postdate_start();
    let r = d.exec(echo(&single_use_cap(&d), "before")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let d = kill9_and_restart(d);
    // Minted at once: its iat may be the very second the daemon started in.
    let tok = single_use_cap(&d);
    let r = d.exec(echo(&tok, "after")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["stdout"], "after\n", "{}", r.text);
    // Still single-use.
    let r = d.exec(echo(&tok, "again")).await;
    assert_eq!(r.status, 401, "{}", r.text);
    assert!(
        last_refusal(&d)["reason"]
            .as_str()
            .is_some_and(|s| s.contains("replayed")),
        "{}",
        last_refusal(&d)
    );
}

/// A new file (a new pod, a file moved aside) cannot know what an earlier one saw: a single-use
/// token that may predate it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_state_file_refuses_single_use_tokens_that_may_predate_it() {
    let d = Daemon::start();
    let r = d.exec(echo(&single_use_cap(&d), "early")).await;
    assert_eq!(r.status, 401, "{}", r.text);
    assert!(
        last_refusal(&d)["reason"]
            .as_str()
            .is_some_and(|s| s.contains("replay record begins")),
        "{}",
        last_refusal(&d)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_use_token_used_before_a_kill_9_is_refused_after_the_restart() {
    let d = Daemon::start();
    d.wait_until_tokens_postdate_start();
    let tok = single_use_cap(&d);
    let r = d.exec(echo(&tok, "once")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let d = kill9_and_restart(d);
    let r = d.exec(echo(&tok, "replay")).await;
    assert_eq!(r.status, 401, "{}", r.text);
    assert_eq!(r.json["error"], "Invalid or expired capability token");
    let refusal = last_refusal(&d);
    assert!(
        refusal["reason"]
            .as_str()
            .is_some_and(|s| s.contains("replayed single-use token")),
        "refused as a replay: {refusal}"
    );
    let runs = d
        .audit_lines()
        .iter()
        .filter(|l| l["event"] == json!("execution"))
        .count();
    assert_eq!(runs, 1, "the replay ran nothing");
}

async fn post_keyed(d: &Daemon, body: &Value, key: &str) -> Resp {
    let svc = format!("Bearer {}", d.service_token());
    d.post(
        "/execute",
        &[("authorization", svc.as_str()), ("idempotency-key", key)],
        body.to_string(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_answer_and_a_run_record_survive_a_kill_9_restart() {
    let d = Daemon::start();
    let body = json!({"action_type": "shell", "command": "echo", "args": ["kept"], "capability_token": d.cap_all()});
    let key = format!("durable-{}", uuid::Uuid::new_v4().simple());
    let first = post_keyed(&d, &body, &key).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let exec_id = first.json["exec_id"].as_str().expect("exec_id").to_string();

    let d = kill9_and_restart(d);
    let again = post_keyed(&d, &body, &key).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the stored answer, not a new run: {}",
        again.text
    );
    assert_eq!(again.json["exec_id"], exec_id.as_str());
    assert_eq!(again.json["stdout"], "kept\n");
    let runs = d
        .audit_lines()
        .iter()
        .filter(|l| l["event"] == json!("execution"))
        .count();
    assert_eq!(runs, 1, "the retry ran nothing");

    let rec = d.get_authorized(&format!("/v1/executions/{exec_id}")).await;
    assert_eq!(rec.status, 200, "the run's record is kept: {}", rec.text);
    assert_eq!(rec.json["status"], "finished", "{}", rec.text);
}
