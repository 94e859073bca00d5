use std::time::Duration;

use serde_json::Value;

use super::*;
use crate::provenance::sha256_prefixed;

fn run(exec_id: &str) -> audit::Run {
    audit::Run {
        request_id: "req-1".into(),
        exec_id: exec_id.into(),
        subject: None,
        owner: None,
        token_id: Some("tok-1".into()),
        action_type: "shell".into(),
        command: "echo".into(),
        args: vec!["hi".into()],
        command_hash: command_hash("echo", &["hi".into()]),
        invocation_hash: "sha256:i".into(),
        backend: "local".into(),
        profile: "shell-readonly".into(),
        timeout_seconds: 30,
        idempotency_key: None,
    }
}

fn end() -> RunEnd {
    RunEnd {
        capabilities_used: vec!["ShellExecute"],
        outcome: "success",
        exit_code: 0,
        duration_ms: 1,
        killed_reason: None,
        oom: false,
        peak_memory_kib: None,
        stdout_sha256: sha256_prefixed(b"hi\n"),
        stderr_sha256: sha256_prefixed(b""),
        stdout_truncated: false,
        stderr_truncated: false,
        executor_def_sha256: None,
        error_code: None,
        network: None,
        metadata: None,
    }
}

/// Every admitted run ends in exactly one end line paired with its start by exec_id: an outcome,
/// an error, or — when the request path panics between the two — an error written on drop.
#[test]
fn an_admitted_run_always_ends_in_exactly_one_end_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let log = Arc::new(AuditLog::open(&path, "i-1").unwrap());
    let metrics = Arc::new(Metrics::new());

    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _admitted = AdmittedRun::admit(&log, &metrics, run("exec-a")).unwrap();
        panic!("the request path panicked mid-run");
    }));
    assert!(panicked.is_err());
    let failed = AdmittedRun::admit(&log, &metrics, run("exec-b"))
        .unwrap()
        .fail("SandboxUnavailable", "docker engine unreachable");
    assert_eq!(failed, Some(4));
    let finished = AdmittedRun::admit(&log, &metrics, run("exec-c"))
        .unwrap()
        .finish(end());
    assert_eq!(finished, Some(6));

    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let events: Vec<(&str, &str, Option<&str>)> = lines
        .iter()
        .map(|l| {
            (
                l["event"].as_str().unwrap(),
                l["exec_id"].as_str().unwrap(),
                l["error_type"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        events,
        [
            ("execution_start", "exec-a", None),
            ("execution_error", "exec-a", Some("InternalError")),
            ("execution_start", "exec-b", None),
            ("execution_error", "exec-b", Some("SandboxUnavailable")),
            ("execution_start", "exec-c", None),
            ("execution", "exec-c", None),
        ]
    );
    // Every line of a run carries who asked for what.
    for l in &lines {
        assert_eq!(l["token_id"], "tok-1", "{l}");
        assert_eq!(
            l["command_hash"],
            command_hash("echo", &["hi".into()]),
            "{l}"
        );
    }
    assert_eq!(lines[5]["outcome"], "success");
    assert!(crate::provenance::audit::verify(&path).is_ok());
    let rendered = metrics.render();
    assert!(
        rendered.lines().any(|l| l
            == "executor_backend_executions_total{backend=\"local\",outcome=\"error\",profile=\"shell-readonly\"} 2"),
        "{rendered}"
    );
}

/// A run an earlier process left without an end line gets one `DaemonStopped` end line at the
/// next start, and the Idempotency-Key it held is released (only that owner's claim).
#[tokio::test]
async fn interrupted_runs_are_ended_once_and_their_keys_released() {
    use crate::state::memory::MemoryStore;
    use crate::state::{IdemBegin, IdemKey, StateStore};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let store = MemoryStore::new(1 << 20, 0);
    let lease = Duration::from_secs(60);
    let key = |k: &str| IdemKey {
        subject: "orchestrator".into(),
        key: k.into(),
    };
    let mut keyed = run("exec-a");
    keyed.idempotency_key = Some(key("k").scoped());
    assert_eq!(
        store
            .idempotency_begin(&key("k"), "h", "old-1", lease)
            .await
            .unwrap(),
        IdemBegin::Started
    );
    assert_eq!(
        store
            .idempotency_begin(&key("other"), "h", "someone-else", lease)
            .await
            .unwrap(),
        IdemBegin::Started
    );
    {
        let log = Arc::new(AuditLog::open(&path, "old-1").unwrap());
        let metrics = Arc::new(Metrics::new());
        // A crash: the start lines are written, the runs never end.
        std::mem::forget(AdmittedRun::admit(&log, &metrics, keyed).unwrap());
        std::mem::forget(AdmittedRun::admit(&log, &metrics, run("exec-b")).unwrap());
        // Started by a service token without a subject, with a capability token that has one.
        let mut owned = run("exec-c");
        owned.subject = Some("orchestrator".into());
        owned.owner = Some("-".into());
        std::mem::forget(AdmittedRun::admit(&log, &metrics, owned).unwrap());
    }

    let log = AuditLog::open(&path, "new-2").unwrap();
    let metrics = Metrics::new();
    let render = |u: &Unanswered| crate::state::StoredResponse {
        status: 0,
        body: format!("{u:?}"),
    };
    record_interrupted(&log, &store, &metrics, Duration::from_secs(60), render).await;
    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ends: Vec<_> = lines
        .iter()
        .filter(|l| l["event"] == "execution_error")
        .map(|l| {
            (
                l["exec_id"].as_str().unwrap(),
                l["instance"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ends,
        [
            ("exec-a", "new-2"),
            ("exec-b", "new-2"),
            ("exec-c", "new-2")
        ]
    );
    assert_eq!(lines[3]["error_type"], "DaemonStopped");
    assert_eq!(
        lines[3]["error"],
        "the daemon (instance old-1) stopped during the run"
    );
    assert_eq!(lines[3]["idempotency_key"], "12:orchestrator:k");
    assert!(crate::provenance::audit::verify(&path).is_ok());
    assert!(
        metrics
            .render()
            .contains("executor_interrupted_runs_total 3"),
        "{}",
        metrics.render()
    );
    // The crashed runs' records are finished with that error (a run without a subject is
    // owned by "-").
    let record = store
        .execution_get(&IdemKey {
            subject: "-".into(),
            key: "exec-b".into(),
        })
        .await
        .unwrap()
        .expect("the interrupted run's record");
    let answer = record.response.expect("finished");
    assert!(answer.body.starts_with("DaemonStopped"), "{}", answer.body);
    // A run's record is found under its owner, the calling service, not the capability token's
    // subject.
    let owned = IdemKey {
        subject: "-".into(),
        key: "exec-c".into(),
    };
    let record = store.execution_get(&owned).await.unwrap();
    assert!(
        record
            .and_then(|r| r.response)
            .is_some_and(|a| a.body.starts_with("DaemonStopped"))
    );
    // The crashed daemon's key is free; another owner's claim is not touched.
    assert_eq!(
        store
            .idempotency_begin(&key("k"), "h", "new-2", lease)
            .await
            .unwrap(),
        IdemBegin::Started
    );
    assert_eq!(
        store
            .idempotency_begin(&key("other"), "h", "new-2", lease)
            .await
            .unwrap(),
        IdemBegin::InProgress { same_body: true }
    );
    // Recorded once.
    drop(log);
    let log = AuditLog::open(&path, "new-3").unwrap();
    assert!(log.interrupted().is_empty());
}
