use super::*;

fn run(exec_id: &str) -> audit::Run {
    audit::Run {
        request_id: "req-1".into(),
        exec_id: exec_id.into(),
        subject: None,
        token_id: Some("tok-1".into()),
        action_type: "shell",
        command: "echo".into(),
        args: vec!["hi".into()],
        command_hash: command_hash("echo", &["hi".into()]),
        invocation_hash: "sha256:i".into(),
        backend: "local",
        profile: "shell-readonly".into(),
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
    let log = AuditLog::open(&path, "i-1").unwrap();
    let metrics = Metrics::new();

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
