use super::*;

fn run(exec_id: &str) -> Run {
    Run {
        request_id: "req-1".into(),
        exec_id: exec_id.into(),
        subject: Some("orchestrator".into()),
        owner: Some("orchestrator".into()),
        token_id: None,
        action_type: "shell".into(),
        command: "echo".into(),
        args: vec!["hi".into()],
        command_hash: "sha256:c".into(),
        invocation_hash: "sha256:i".into(),
        backend: "local".into(),
        profile: "shell-readonly".into(),
        timeout_seconds: 30,
        idempotency_key: None,
    }
}

fn end(metadata: Option<Map<String, Value>>) -> Box<RunEnd> {
    Box::new(RunEnd {
        capabilities_used: vec!["ShellExecute"],
        outcome: "success",
        exit_code: 0,
        duration_ms: 3,
        killed_reason: None,
        oom: false,
        peak_memory_kib: Some(100),
        stdout_sha256: "sha256:o".into(),
        stderr_sha256: "sha256:e".into(),
        stdout_truncated: false,
        stderr_truncated: false,
        executor_def_sha256: None,
        error_code: None,
        network: None,
        metadata,
    })
}

fn execution(i: u64) -> AuditEvent {
    let mut md = Map::new();
    md.insert("n".into(), Value::from(i));
    AuditEvent::Execution {
        run: run(&format!("exec-{i}")),
        end: end(Some(md)),
    }
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

fn broken_line(p: &Path) -> u64 {
    match verify(p) {
        Err(AuditError::Broken { line, .. }) => line,
        other => panic!("expected a broken chain, got {other:?}"),
    }
}

#[test]
fn chain_detects_edit_drop_insert_reorder() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "i-1").unwrap();
    for i in 0..4 {
        assert_eq!(log.append(&execution(i)).unwrap(), i + 1);
    }
    drop(log);
    assert_eq!(verify(&p).unwrap().lines, 4);
    // Reopening continues the chain.
    AuditLog::open(&p, "i-1")
        .unwrap()
        .append(&execution(9))
        .unwrap();
    let v = verify(&p).unwrap();
    assert_eq!((v.lines, v.last_seq, v.continues), (5, 5, None));

    let lines = lines(&p);
    let check = |ls: Vec<String>, bad_line: u64| {
        let q = dir.path().join("b.jsonl");
        std::fs::write(&q, ls.join("\n") + "\n").unwrap();
        assert_eq!(broken_line(&q), bad_line, "{ls:#?}");
    };
    let mut edited = lines.clone();
    edited[1] = edited[1].replace("\"n\":1", "\"n\":7");
    assert_ne!(edited[1], lines[1]);
    check(edited, 2);
    // Whitespace is an edit too: the bytes are hashed, not their meaning.
    let mut spaced = lines.clone();
    spaced[1] = spaced[1].replacen("\"n\":1", "\"n\": 1", 1);
    check(spaced, 2);
    let mut dropped = lines.clone();
    dropped.remove(2);
    check(dropped, 3);
    let mut reordered = lines.clone();
    reordered.swap(1, 2);
    check(reordered, 2);
    let mut inserted = lines.clone();
    inserted.insert(1, lines[0].clone());
    check(inserted, 2);
    // A second entry_hash inside the hashed bytes is refused, not trusted.
    let mut doubled = lines.clone();
    doubled[0] = doubled[0].replacen('{', "{\"entry_hash\":\"x\",", 1);
    check(doubled, 1);
    // A torn last line (no newline: the write was cut short) is broken.
    let q = dir.path().join("torn.jsonl");
    std::fs::write(&q, lines.join("\n")).unwrap();
    assert_eq!(broken_line(&q), 5);
}

#[test]
fn lines_are_sorted_json_with_the_entry_hash_last() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "host-7").unwrap();
    log.append(&AuditEvent::ExecutionStart(run("exec-1")))
        .unwrap();
    let line = &lines(&p)[0];
    let v: Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["event"], "execution_start");
    assert_eq!(v["instance"], "host-7");
    assert_eq!(v["seq"], 1);
    assert_eq!(v["prev_hash"], GENESIS);
    assert_eq!(v["exec_id"], "exec-1");
    assert!(v["ts"].as_str().is_some_and(|t| t.ends_with('Z')));
    let cut = line.find(",\"entry_hash\"").unwrap();
    let hashed = format!("{}}}", &line[..cut]);
    assert_eq!(v["entry_hash"], sha256_prefixed(hashed.as_bytes()));
    // The hashed part is the canonical (sorted) form of itself.
    let reparsed: Value = serde_json::from_str(&hashed).unwrap();
    assert_eq!(canonical_json(&reparsed), hashed);
}

/// Values a caller controls (metadata, args) are written as serde_json prints them; the chain
/// must verify whatever they are, including values that do not survive a parse/print round trip.
#[test]
fn every_caller_value_verifies_after_it_is_written() {
    let deep_text = format!("{}1{}", "[".repeat(120), "]".repeat(120));
    let cases: Vec<(&str, Value)> = [
        (
            "float that changes on a round trip",
            "1.0715660391465826e-75",
        ),
        ("short float", "0.1"),
        ("smallest subnormal", "5e-324"),
        ("largest float", "1.7976931348623157e308"),
        ("negative zero", "-0.0"),
        ("u64 max + 1", "18446744073709551616"),
        (
            "integer past any fixed width",
            "123456789012345678901234567890",
        ),
        ("i64 min - 1", "-9223372036854775809"),
        ("exponent without fraction", "1E+2"),
        (
            "escapes and non-ASCII",
            r#""\u00e9\ud83d\ude00\u2028\u2029\u0000\u001f\u007f\"\\/\n\t""#,
        ),
        ("duplicate keys (the last wins)", r#"{"a": 1, "a": 2}"#),
        ("deep nesting", &deep_text),
    ]
    .into_iter()
    .map(|(name, text)| (name, serde_json::from_str(text).unwrap()))
    .collect();
    // Deeper than serde_json parses: built directly, as a future event field could be.
    let mut deeper = Value::from(1);
    for _ in 0..1000 {
        deeper = Value::Array(vec![deeper]);
    }
    let cases = cases
        .into_iter()
        .chain([("nesting past the parser's limit", deeper)]);
    // A lone surrogate never becomes a value: the request is refused before anything is written.
    assert!(serde_json::from_str::<Value>(r#""\ud800""#).is_err());

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "i-1").unwrap();
    for (i, (name, v)) in cases.enumerate() {
        let mut md = Map::new();
        md.insert("v".into(), v.clone());
        let mut r = run("exec-x");
        r.args = vec![v.to_string()];
        log.append(&AuditEvent::Execution {
            run: r,
            end: end(Some(md)),
        })
        .unwrap();
        let checked = verify(&p);
        assert!(
            checked.as_ref().is_ok_and(|c| c.lines == i as u64 + 1),
            "{name}: {checked:?}"
        );
    }
    // And the log still opens (the daemon restarts).
    drop(log);
    assert!(AuditLog::open(&p, "i-1").unwrap().recovered().is_none());
}

/// A line as the previous format wrote it: entry_hash among the sorted keys, over the canonical
/// JSON of the entry without it.
fn legacy_line(seq: u64, prev: &str, extra: (&str, Value)) -> (String, String) {
    let mut m = Map::new();
    m.insert("event".into(), Value::from("execution"));
    m.insert("seq".into(), Value::from(seq));
    m.insert("prev_hash".into(), Value::from(prev));
    m.insert(extra.0.into(), extra.1);
    let hash = sha256_prefixed(canonical_json(&Value::Object(m.clone())).as_bytes());
    m.insert("entry_hash".into(), Value::from(hash.clone()));
    (canonical_json(&Value::Object(m)), hash)
}

#[test]
fn lines_of_the_previous_format_still_verify_and_the_chain_continues_after_them() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let (l1, h1) = legacy_line(1, GENESIS, ("exit_code", Value::from(0)));
    let (l2, h2) = legacy_line(2, &h1, ("exit_code", Value::from(1)));
    std::fs::write(&p, format!("{l1}\n{l2}\n")).unwrap();
    let v = verify(&p).unwrap();
    assert_eq!(
        (v.lines, v.last_seq, v.last_hash.as_str()),
        (2, 2, h2.as_str())
    );

    let log = AuditLog::open(&p, "i-1").unwrap();
    assert!(log.recovered().is_none());
    assert_eq!(log.append(&execution(3)).unwrap(), 3);
    drop(log);
    assert_eq!(verify(&p).unwrap().lines, 3);

    // The old rule still catches an edit of an old line.
    let ls = lines(&p);
    let mut edited = ls.clone();
    edited[1] = edited[1].replace("\"exit_code\":1", "\"exit_code\":0");
    let q = dir.path().join("b.jsonl");
    std::fs::write(&q, edited.join("\n") + "\n").unwrap();
    assert_eq!(broken_line(&q), 2);
    // After a line of this format, the old rule is no longer accepted.
    let last: Value = serde_json::from_str(&ls[2]).unwrap();
    let (l4, _) = legacy_line(4, last["entry_hash"].as_str().unwrap(), ("x", Value::Null));
    std::fs::write(&q, format!("{}\n{l4}\n", ls.join("\n"))).unwrap();
    assert_eq!(broken_line(&q), 4);
}

#[test]
fn a_log_that_does_not_verify_is_moved_aside_and_a_new_segment_chains_from_its_last_good_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("audit.jsonl");
    let log = AuditLog::open(&p, "i-1").unwrap();
    for i in 0..3 {
        log.append(&execution(i)).unwrap();
    }
    drop(log);
    let good = lines(&p);
    let cases: Vec<(&str, Vec<u8>, u64)> = vec![
        (
            "edited",
            (good
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    if i == 1 {
                        l.replace("\"n\":1", "\"n\":2")
                    } else {
                        l.clone()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
                + "\n")
                .into_bytes(),
            1,
        ),
        (
            "torn",
            format!("{}\n{}", good.join("\n"), &good[0][..20]).into_bytes(),
            3,
        ),
        ("garbage", b"\xff\xfe\x00garbage\n".to_vec(), 0),
    ];
    for (case, bytes, verified) in cases {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        std::fs::write(&p, &bytes).unwrap();
        let log = AuditLog::open(&p, "i-2").unwrap();
        let s = log.recovered().expect("recovered").clone();
        assert_eq!(s.previous_state, "broken", "{case}");
        assert!(
            s.previous_error.contains(&format!("line {}", verified + 1)),
            "{case}: {s:?}"
        );
        assert_eq!(s.previous_verified_lines, verified, "{case}");
        assert_eq!(s.previous_last_seq, verified, "{case}");
        let last_good = match verified {
            0 => GENESIS.to_string(),
            n => serde_json::from_str::<Value>(&good[n as usize - 1]).unwrap()["entry_hash"]
                .as_str()
                .unwrap()
                .to_string(),
        };
        assert_eq!(s.previous_last_hash, last_good, "{case}");
        assert_eq!(s.previous_sha256, sha256_prefixed(&bytes), "{case}");
        let moved = dir.path().join(&s.previous_file);
        assert!(
            s.previous_file.starts_with("audit.jsonl.") && s.previous_file.ends_with(".broken"),
            "{case}: {}",
            s.previous_file
        );
        assert_eq!(
            std::fs::read(&moved).unwrap(),
            bytes,
            "{case}: kept as it was"
        );

        assert_eq!(log.append(&execution(7)).unwrap(), verified + 2, "{case}");
        drop(log);
        let v = verify(&p).unwrap();
        assert_eq!(v.lines, 2, "{case}");
        assert_eq!(v.continues, Some((verified, last_good.clone())), "{case}");
        let first: Value = serde_json::from_str(&lines(&p)[0]).unwrap();
        assert_eq!(first["event"], "segment_start", "{case}");
        assert_eq!(first["prev_hash"], Value::from(last_good), "{case}");
        // Reopening the new segment continues it; the old file is left alone.
        let log = AuditLog::open(&p, "i-2").unwrap();
        assert!(log.recovered().is_none(), "{case}");
        drop(log);
        assert_eq!(std::fs::read(&moved).unwrap(), bytes, "{case}");
        // A segment start is accepted only as a first line.
        let ls = lines(&p);
        let q = dir.path().join("other.jsonl");
        std::fs::write(&q, format!("{}\n{}\n", ls[1], ls[0])).unwrap();
        assert_eq!(broken_line(&q), 1, "{case}");
    }
}

#[test]
fn an_execution_start_is_written_but_not_synced_on_its_own() {
    // The one fsync per request is the end line's; both lines are in the file either way.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "i-1").unwrap();
    log.append(&AuditEvent::ExecutionStart(run("exec-1")))
        .unwrap();
    log.append(&AuditEvent::ExecutionError {
        run: run("exec-1"),
        error_type: "InternalError",
        error: "boom".into(),
    })
    .unwrap();
    let ls = lines(&p);
    let end: Value = serde_json::from_str(&ls[1]).unwrap();
    assert_eq!(end["event"], "execution_error");
    assert_eq!(end["exec_id"], "exec-1");
    assert_eq!(end["error_type"], "InternalError");
    assert_eq!(end["args"], serde_json::json!(["hi"]));
    assert!(log.check_writable().is_ok());
}

fn start(exec_id: &str) -> AuditEvent {
    AuditEvent::ExecutionStart(run(exec_id))
}

fn error_end(exec_id: &str) -> AuditEvent {
    AuditEvent::ExecutionError {
        run: run(exec_id),
        error_type: "InternalError",
        error: "x".into(),
    }
}

/// Runs whose start line has no end line are handed over at open, in start order, read back
/// whole; ended runs, refusals and lines of other events are not.
#[test]
fn runs_started_without_an_end_line_are_found_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "host-1").unwrap();
    assert!(log.interrupted().is_empty());
    let mut keyed = run("exec-b");
    keyed.idempotency_key = Some("orchestrator:k1".into());
    keyed.args = vec!["a b".into(), "\u{0}".into()];
    for e in [
        start("exec-a"),
        AuditEvent::ExecutionStart(keyed.clone()),
        start("exec-c"),
        execution(0), // exec-0: an end line without a start changes nothing
        error_end("exec-a"),
        start("exec-d"),
    ] {
        log.append(&e).unwrap();
    }
    log.append(&AuditEvent::Execution {
        run: run("exec-d"),
        end: end(None),
    })
    .unwrap();
    drop(log);

    let log = AuditLog::open(&p, "host-2").unwrap();
    let got: Vec<_> = log
        .interrupted()
        .iter()
        .map(|i| (i.run.exec_id.as_str(), i.instance.as_str(), i.seq))
        .collect();
    assert_eq!(got, [("exec-b", "host-1", 2), ("exec-c", "host-1", 3)]);
    let b = &log.interrupted()[0].run;
    assert_eq!(b.idempotency_key.as_deref(), Some("orchestrator:k1"));
    assert_eq!(b.args, keyed.args);
    assert_eq!(
        serde_json::to_value(b).unwrap(),
        serde_json::to_value(&keyed).unwrap()
    );

    // Once their end lines are written, the next open finds none.
    for i in log.interrupted() {
        log.append(&AuditEvent::ExecutionError {
            run: i.run.clone(),
            error_type: "DaemonStopped",
            error: "stopped".into(),
        })
        .unwrap();
    }
    drop(log);
    assert!(
        AuditLog::open(&p, "host-3")
            .unwrap()
            .interrupted()
            .is_empty()
    );
    assert_eq!(verify(&p).unwrap().lines, 9);
}

/// A broken log's good part may hold runs that never ended: the new segment is told about them.
#[test]
fn runs_open_in_the_good_part_of_a_broken_log_are_found() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "host-1").unwrap();
    log.append(&start("exec-a")).unwrap();
    log.append(&start("exec-b")).unwrap();
    drop(log);
    // A torn line after them (a write cut short).
    let mut text = std::fs::read_to_string(&p).unwrap();
    text.push_str("{\"seq\":3,");
    std::fs::write(&p, text).unwrap();

    let log = AuditLog::open(&p, "host-2").unwrap();
    assert!(log.recovered().is_some());
    let ids: Vec<_> = log
        .interrupted()
        .iter()
        .map(|i| i.run.exec_id.as_str())
        .collect();
    assert_eq!(ids, ["exec-a", "exec-b"]);
}

fn refusal(status: u16) -> AuditEvent {
    AuditEvent::Refusal(Refusal {
        request_id: "req-r".into(),
        status,
        error_type: "Unauthorized",
        reason: "bad token".into(),
        subject: None,
        token_id: None,
        action_type: None,
        command: None,
        command_hash: None,
    })
}

#[test]
fn suppressed_refusals_are_written_as_one_line_at_a_flush_and_the_chain_holds() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "i-1")
        .unwrap()
        .with_refusal_rate(RefusalRate {
            per_second: 0.0,
            burst: 2,
        });
    for _ in 0..6 {
        if log.admit_refusal(401, false) {
            log.append(&refusal(401)).unwrap();
        }
    }
    assert_eq!(lines(&p).len(), 2, "only the burst is written");
    assert_eq!(log.suppressed_pending().unwrap().count, 4);
    assert_eq!(
        log.append(&execution(1)).unwrap(),
        3,
        "other lines do not carry the counts"
    );
    assert_eq!(log.flush_suppressed().unwrap(), Some(4));
    assert_eq!(
        log.flush_suppressed().unwrap(),
        None,
        "nothing left to flush"
    );
    let parsed: Vec<Value> = lines(&p)
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(parsed[2]["event"], "execution");
    assert_eq!(parsed[3]["event"], "refusals_suppressed");
    assert_eq!(parsed[3]["count"], 4);
    assert_eq!(parsed[3]["by_status"], serde_json::json!({"401": 4}));
    assert!(log.admit_refusal(403, true) && log.admit_refusal(403, true));
    assert!(!log.admit_refusal(403, true));
    assert_eq!(log.flush_suppressed().unwrap(), Some(5));
    assert_eq!(verify(&p).unwrap().lines, 5);
}

#[test]
fn a_flush_with_nothing_pending_does_not_clear_a_failed_append() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.jsonl");
    let log = AuditLog::open(&p, "i-1").unwrap();
    log.append(&execution(1)).unwrap();
    // Appends fail from now on: the log's descriptor no longer accepts writes.
    log.tail.lock().unwrap().file = File::open(&p).unwrap();
    assert!(log.append(&execution(2)).is_err());
    assert!(
        log.failing.lock().unwrap().is_some(),
        "the failure is noted"
    );
    // The daemon's flusher runs every few seconds whether or not anything was suppressed.
    assert_eq!(log.flush_suppressed().unwrap(), None);
    assert!(
        log.failing.lock().unwrap().is_some(),
        "a flush that wrote nothing proves nothing about the log: /readyz must keep probing"
    );
}

#[test]
fn appends_from_many_threads_share_fsyncs_and_keep_one_chain() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let log = std::sync::Arc::new(AuditLog::open(&path, "i-1").unwrap());
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                (0..25)
                    .map(|i| log.append(&execution(t * 100 + i)).unwrap())
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let mut seqs: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=400).collect::<Vec<u64>>());
    let v = verify(&path).unwrap();
    assert_eq!((v.lines, v.last_seq), (400, 400));
    // Every acknowledged line is covered by a completed fsync.
    let synced = log.synced.lock().unwrap();
    assert_eq!(synced.len, std::fs::metadata(&path).unwrap().len());
    assert!(synced.failed.is_empty());
}

#[test]
fn a_failed_fsync_fails_the_lines_it_covered_keeps_them_and_the_chain_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let mut log = AuditLog::open(&path, "i-1").unwrap();
    log.append(&execution(1)).unwrap();
    // fdatasync(2) of a pipe fails with EINVAL: the next commit's sync fails.
    let (r, _w) = nix::unistd::pipe().unwrap();
    let real = std::mem::replace(&mut log.sync_file, File::from(r));
    assert_eq!(log.append(&start("exec-2")).unwrap(), 2);
    let e = log.append(&execution(3)).unwrap_err();
    assert!(matches!(e, AuditError::Io { .. }), "{e}");
    assert!(
        log.failing.lock().unwrap().is_some(),
        "/readyz sees the failure"
    );
    // The lines stay, chained: an acknowledged start line is not dropped and no sequence number
    // is handed out twice.
    assert_eq!(verify(&path).unwrap().last_seq, 3);
    log.sync_file = real;
    // A later successful fsync does not make the failed line durable after the fact.
    assert_eq!(log.append(&execution(4)).unwrap(), 4);
    let failed_end = log.synced.lock().unwrap().failed[0].1;
    assert!(
        log.commit(Written {
            seq: 3,
            end: failed_end
        })
        .is_err()
    );
    // A line made durable before the failure stays durable.
    assert!(log.commit(Written { seq: 1, end: 1 }).is_ok());
    let v = verify(&path).unwrap();
    assert_eq!((v.lines, v.last_seq), (4, 4));
}
