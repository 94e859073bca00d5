use super::*;
use crate::provenance::audit::{AuditEvent, SessionClosed};
use std::os::unix::fs::PermissionsExt;

fn key(n: u8) -> SigningKey {
    SigningKey::from_bytes(&[n; 32])
}

fn keys(k: &SigningKey) -> KeySet {
    std::iter::once(k.verifying_key()).collect()
}

fn event(i: u64) -> AuditEvent {
    AuditEvent::SessionEnd(SessionClosed {
        session_id: format!("s-{i}"),
        owner: "orchestrator".into(),
        tenant: String::new(),
        reason: "deleted",
        execs: i,
    })
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

fn keep_lines(p: &Path, n: usize) {
    let ls = lines(p);
    std::fs::write(p, ls[..n].join("\n") + "\n").unwrap();
}

#[test]
fn the_signed_note_example_verifies_with_its_verifier_key() {
    // c2sp.org/signed-note, "Example": this vkey verifies this note.
    let vkey = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k";
    let note = "This is an example message.\n\n\u{2014} example.com/foo \
                Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n";
    let raw = STANDARD.decode(vkey.rsplit('+').next().unwrap()).unwrap();
    assert_eq!(raw[0], ED25519);
    let pk = VerifyingKey::from_bytes(&raw[1..].try_into().unwrap()).unwrap();
    assert_eq!(hex::encode(key_hash("example.com/foo", &pk)), "530d903a");
    assert_eq!(verifier_key("example.com/foo", &pk), vkey);
    let ks = std::iter::once(pk).collect();
    assert_eq!(
        verify_note(note.as_bytes(), &ks).unwrap(),
        "This is an example message.\n"
    );
    // One changed byte of the text: refused.
    let altered = note.replacen("example message", "example massage", 1);
    assert!(matches!(
        verify_note(altered.as_bytes(), &ks),
        Err(CheckpointError::BadSignature { .. })
    ));
}

#[test]
fn the_tlog_checkpoint_example_text_parses() {
    // c2sp.org/tlog-checkpoint: the example's note text.
    let cp = parse_text(
        "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",
    )
    .unwrap();
    assert_eq!(cp.origin, "example.com/behind-the-sofa");
    assert_eq!(cp.size, 20852163);
    assert_eq!(
        STANDARD.encode(cp.head),
        "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I="
    );
}

#[test]
fn a_checkpoint_round_trips_in_the_documented_format() {
    let k = key(1);
    let head = format!("sha256:{}", "ab".repeat(32));
    let cp = Checkpoint::new("executor-arm/host-1", 1000, &head).unwrap();
    let note = cp.sign(&k);
    let b64head = STANDARD.encode([0xabu8; 32]);
    let (text, sig) = note.split_once("\n\n").unwrap();
    assert_eq!(text, format!("executor-arm/host-1\n1000\n{b64head}"));
    let sig = sig.strip_prefix("\u{2014} executor-arm/host-1 ").unwrap();
    let raw = STANDARD.decode(sig.trim_end_matches('\n')).unwrap();
    assert_eq!(raw.len(), 4 + 64);
    assert_eq!(
        raw[..4],
        key_hash("executor-arm/host-1", &k.verifying_key())
    );
    let back = open(note.as_bytes(), &keys(&k)).unwrap();
    assert_eq!(back, cp);
    assert_eq!(back.entry_hash(), head);
    // Rotation: a set holding the old key and a new one verifies it.
    let both: KeySet = [key(2).verifying_key(), k.verifying_key()]
        .into_iter()
        .collect();
    assert_eq!(open(note.as_bytes(), &both).unwrap(), cp);
}

#[test]
fn a_forged_or_altered_checkpoint_is_refused() {
    let k = key(1);
    let ks = keys(&k);
    let head = format!("sha256:{}", "01".repeat(32));
    let note = Checkpoint::new("o", 1200, &head).unwrap().sign(&k);
    // A larger size under the same signature.
    let altered = note.replacen("\n1200\n", "\n1300\n", 1);
    assert_eq!(
        open(altered.as_bytes(), &ks),
        Err(CheckpointError::BadSignature {
            name: "o".into(),
            keyid: crate::provenance::keys::keyid(&k.verifying_key())
        })
    );
    // Each one-bit change of the signature.
    let (text, line) = note.split_once("\n\n").unwrap();
    let raw = STANDARD
        .decode(line.trim_start_matches("\u{2014} o ").trim_end())
        .unwrap();
    for i in 4..raw.len() {
        let mut r = raw.clone();
        r[i] ^= 1;
        let forged = format!("{text}\n\n\u{2014} o {}\n", STANDARD.encode(&r));
        assert!(
            matches!(
                open(forged.as_bytes(), &ks),
                Err(CheckpointError::BadSignature { .. })
            ),
            "byte {i}"
        );
    }
    // Signed by another key under the same name: not a known key.
    let other = Checkpoint::new("o", 1300, &head).unwrap().sign(&key(2));
    assert_eq!(
        open(other.as_bytes(), &ks),
        Err(CheckpointError::UnknownKey {
            names: vec!["o".into()]
        })
    );
    // A known signature that fails rejects the note even beside one that verifies.
    let good_line = line.to_string();
    let bad_line = format!(
        "\u{2014} o {}\n",
        STANDARD.encode({
            let mut r = raw.clone();
            r[10] ^= 1;
            r
        })
    );
    let two = format!("{text}\n\n{good_line}{bad_line}");
    assert!(matches!(
        open(two.as_bytes(), &ks),
        Err(CheckpointError::BadSignature { .. })
    ));
    // An unknown key's signature beside a good one is ignored.
    let (_, other_line) = other.split_once("\n\n").unwrap();
    let cosigned = format!("{note}{other_line}");
    assert_eq!(open(cosigned.as_bytes(), &ks).unwrap().size, 1200);
}

#[test]
fn malformed_notes_are_refused_with_a_reason() {
    let k = key(1);
    let ks = keys(&k);
    let sign_text = |text: &str| {
        let sig = k.sign(text.as_bytes());
        let mut raw = key_hash("o", &k.verifying_key()).to_vec();
        raw.extend_from_slice(&sig.to_bytes());
        format!("{text}\n\u{2014} o {}\n", STANDARD.encode(raw))
    };
    let head = STANDARD.encode([0u8; 32]);
    for (text, why) in [
        (format!("o\n010\n{head}\n"), "leading zero"),
        (format!("o\n-1\n{head}\n"), "negative"),
        (format!("o\n18446744073709551616\n{head}\n"), "past u64"),
        (
            format!("o\n1\n{}\n", STANDARD.encode([0u8; 31])),
            "short head",
        ),
        ("o\n1\n".to_string(), "two lines"),
        (format!("o\n1\n{head}\n\nx\n"), "empty line"),
    ] {
        let e = open(sign_text(&text).as_bytes(), &ks).unwrap_err();
        assert!(
            matches!(e, CheckpointError::Body(_) | CheckpointError::Malformed(_)),
            "{why}: {e}"
        );
    }
    let good = sign_text(&format!("o\n1\n{head}\n"));
    for (note, why) in [
        (good.trim_end().to_string(), "no final newline"),
        (good.replace("\n\n", "\n"), "no blank line"),
        (good.replace('\u{2014}', "-"), "no em dash"),
        (good.replacen("o\n", "o\r\n", 1), "control character"),
        (
            format!("{}\n\n", good.split_once("\n\n").unwrap().0),
            "no signature",
        ),
    ] {
        assert!(
            matches!(
                open(note.as_bytes(), &ks),
                Err(CheckpointError::Malformed(_))
            ),
            "{why}"
        );
    }
    assert_eq!(open(good.as_bytes(), &ks).unwrap().size, 1);
    assert!(Checkpoint::new("has space", 1, &format!("sha256:{}", "0".repeat(64))).is_err());
    assert!(Checkpoint::new("o", 1, "sha256:00").is_err());
}

#[test]
fn the_writer_writes_each_size_once_and_never_replaces_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cps = dir.path().join("cps");
    std::fs::create_dir(&cps).unwrap();
    // A temp file a killed writer left behind is removed at start.
    std::fs::write(cps.join(".checkpoint-5.1.00.tmp"), "partial").unwrap();
    let w = CheckpointWriter::new(&cps, "o", key(1)).unwrap();
    assert!(!cps.join(".checkpoint-5.1.00.tmp").exists());
    let h1 = format!("sha256:{}", "11".repeat(32));
    let h2 = format!("sha256:{}", "22".repeat(32));
    assert_eq!(
        w.checkpoint(0, GENESIS).unwrap(),
        None,
        "an empty log is not signed"
    );
    assert_eq!(
        w.checkpoint(5, &h1).unwrap(),
        Some(cps.join("checkpoint-5"))
    );
    assert_eq!(w.checkpoint(5, &h1).unwrap(), None, "the same size again");
    assert_eq!(w.last_size(), Some(5));
    let mode = std::fs::metadata(cps.join("checkpoint-5"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);
    // A new writer (a restart) finds the identical checkpoint there.
    let w2 = CheckpointWriter::new(&cps, "o", key(1)).unwrap();
    assert_eq!(w2.checkpoint(5, &h1).unwrap(), None);
    // A different head at a size already signed is kept beside it.
    assert_eq!(
        w2.checkpoint(6, &h1).unwrap(),
        Some(cps.join("checkpoint-6"))
    );
    assert_eq!(
        w2.checkpoint(5, &h2).unwrap(),
        Some(cps.join("checkpoint-5.1"))
    );
    let first = open(
        &std::fs::read(cps.join("checkpoint-5")).unwrap(),
        &keys(&key(1)),
    )
    .unwrap();
    assert_eq!(first.entry_hash(), h1);
    let mut names: Vec<_> = std::fs::read_dir(&cps)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["checkpoint-5", "checkpoint-5.1", "checkpoint-6"]);
}

/// A log of `n` lines with a checkpoint after every `every` lines and one at its end.
fn signed_log(dir: &Path, n: u64, every: u64) -> (PathBuf, PathBuf, KeySet) {
    let log_path = dir.join("audit.jsonl");
    let cps = default_dir(&log_path);
    assert_eq!(cps, dir.join("audit.jsonl.checkpoints"));
    let k = key(7);
    let ks = keys(&k);
    let w = CheckpointWriter::new(&cps, "executor-arm/test", k).unwrap();
    let log = AuditLog::open(&log_path, "i-1").unwrap();
    for i in 1..=n {
        log.append(&event(i)).unwrap();
        if i % every == 0 {
            assert!(w.checkpoint_log(&log).unwrap().is_some());
        }
    }
    w.checkpoint_log(&log).unwrap();
    (log_path, cps, ks)
}

#[test]
fn an_intact_log_matches_every_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (log, cps, ks) = signed_log(dir.path(), 25, 10);
    let c = check_logs(&[log], &cps, &ks).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    let sizes: Vec<u64> = c.matched.iter().map(|m| m.checkpoint.size).collect();
    assert_eq!(sizes, [10, 20, 25]);
    assert_eq!(c.chain.unwrap().last_seq, 25);
}

#[test]
fn a_log_cut_by_one_line_or_a_whole_interval_names_the_missing_lines() {
    let dir = tempfile::tempdir().unwrap();
    let (log, cps, ks) = signed_log(dir.path(), 25, 10);
    keep_lines(&log, 24);
    let c = check_logs(std::slice::from_ref(&log), &cps, &ks).unwrap();
    assert_eq!(
        c.problems,
        ["line 25 missing: checkpoint-25 signs 25 lines, the log has 24"]
    );
    keep_lines(&log, 15);
    let c = check_logs(std::slice::from_ref(&log), &cps, &ks).unwrap();
    assert_eq!(
        c.problems,
        [
            "lines 16-20 missing: checkpoint-20 signs 20 lines, the log has 15",
            "lines 16-25 missing: checkpoint-25 signs 25 lines, the log has 15",
        ]
    );
    assert_eq!(c.matched.len(), 1);
    // Cut to nothing.
    std::fs::write(&log, "").unwrap();
    let c = check_logs(&[log], &cps, &ks).unwrap();
    assert_eq!(c.problems.len(), 3);
    assert!(
        c.problems[0].starts_with("lines 1-10 missing"),
        "{:?}",
        c.problems
    );
}

#[test]
fn a_rewritten_and_rechained_log_fails_at_the_first_checkpoint_it_contradicts() {
    // Rewriting a line and recomputing the chain after it gives a log that verifies on its own;
    // the checkpoints signed before do not agree with it.
    let dir = tempfile::tempdir().unwrap();
    let (log, cps, ks) = signed_log(dir.path(), 25, 10);
    let forged_dir = tempfile::tempdir().unwrap();
    let forged = forged_dir.path().join("audit.jsonl");
    let l = AuditLog::open(&forged, "i-1").unwrap();
    for i in 1..=25 {
        l.append(&event(if i == 7 { 700 } else { i })).unwrap();
    }
    drop(l);
    audit::verify(&forged).unwrap();
    let c = check_logs(&[forged], &cps, &ks).unwrap();
    assert_eq!(c.problems.len(), 3, "{:?}", c.problems);
    assert!(
        c.problems[0].starts_with("line 10 was rewritten: checkpoint-10 signs entry_hash sha256:"),
        "{:?}",
        c.problems
    );
    // A line edited in place breaks the chain itself.
    let mut ls = lines(&log);
    ls[3] = ls[3].replace("s-4", "s-X");
    std::fs::write(&log, ls.join("\n") + "\n").unwrap();
    let e = check_logs(&[log], &cps, &ks).unwrap_err();
    assert!(e.to_string().contains("line 4"), "{e}");
}

#[test]
fn a_forged_checkpoint_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (log, cps, ks) = signed_log(dir.path(), 25, 10);
    // Someone without the key claims the log is shorter than it was.
    let text = std::fs::read_to_string(cps.join("checkpoint-20")).unwrap();
    std::fs::write(
        cps.join("checkpoint-20"),
        text.replacen("\n20\n", "\n15\n", 1),
    )
    .unwrap();
    let forged = Checkpoint::new("executor-arm/test", 30, GENESIS)
        .unwrap()
        .sign(&key(8));
    std::fs::write(cps.join("checkpoint-30"), forged).unwrap();
    std::fs::write(cps.join("checkpoint-31"), "garbage").unwrap();
    let c = check_logs(&[log], &cps, &ks).unwrap();
    assert_eq!(c.problems.len(), 3, "{:?}", c.problems);
    assert!(
        c.problems[0].starts_with("checkpoint-20: forged or altered"),
        "{:?}",
        c.problems
    );
    assert!(
        c.problems[1].starts_with("checkpoint-30: no signature by a known key"),
        "{:?}",
        c.problems
    );
    assert!(
        c.problems[2].starts_with("checkpoint-31: not a signed note"),
        "{:?}",
        c.problems
    );
    // An empty directory proves nothing: it is a problem too.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let c = check_logs(&[dir.path().join("audit.jsonl")], &empty, &ks).unwrap();
    assert_eq!(c.problems.len(), 1);
    assert!(c.problems[0].starts_with("no checkpoint in"));
}

#[test]
fn checkpoints_hold_across_a_new_segment_and_several_files() {
    let dir = tempfile::tempdir().unwrap();
    let (log, cps, ks) = signed_log(dir.path(), 10, 5);
    let old = dir.path().join("audit.jsonl.old");
    std::fs::copy(&log, &old).unwrap();
    // A torn last line: the next open moves the file aside and starts a segment after line 10.
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.extend_from_slice(b"{\"seq\":11,");
    std::fs::write(&log, bytes).unwrap();
    let w = CheckpointWriter::new(&cps, "executor-arm/test", key(7)).unwrap();
    let l = AuditLog::open(&log, "i-2").unwrap();
    assert!(l.recovered().is_some());
    for i in 0..4 {
        l.append(&event(100 + i)).unwrap();
    }
    w.checkpoint_log(&l).unwrap();
    drop(l);
    // Both files, oldest first: every checkpoint is checked.
    let c = check_logs(&[old.clone(), log.clone()], &cps, &ks).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    let sizes: Vec<u64> = c.matched.iter().map(|m| m.checkpoint.size).collect();
    assert_eq!(sizes, [5, 10, 15]);
    // The new segment alone: the checkpoint of its segment_start's line is checked through it,
    // the one before is an earlier file's.
    let c = check_logs(std::slice::from_ref(&log), &cps, &ks).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    assert_eq!(c.first_seq, 11);
    let sizes: Vec<u64> = c.matched.iter().map(|m| m.checkpoint.size).collect();
    assert_eq!(sizes, [10, 15]);
    assert_eq!(c.earlier.len(), 1);
    // Files out of order or unrelated are named.
    let c = check_logs(&[log.clone(), old.clone()], &cps, &ks).unwrap();
    assert!(
        c.problems.iter().any(|p| p.contains("does not continue")),
        "{:?}",
        c.problems
    );
    keep_lines(&log, 2);
    let c = check_logs(&[old, log], &cps, &ks).unwrap();
    assert_eq!(
        c.problems,
        ["lines 13-15 missing: checkpoint-15 signs 15 lines, the log has 12"]
    );
}

#[tokio::test]
async fn the_checkpointer_signs_every_n_lines_and_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("audit.jsonl");
    let cps = default_dir(&log_path);
    let log = Arc::new(AuditLog::open(&log_path, "i-1").unwrap());
    let writer = Arc::new(CheckpointWriter::new(&cps, "o", key(3)).unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let task = spawn_checkpointer(
        log.clone(),
        writer.clone(),
        5,
        Duration::from_secs(3600),
        stop.clone(),
    );
    for i in 1..=6 {
        log.append(&event(i)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while writer.last_size() != Some(6) {
        assert!(
            Instant::now() < deadline,
            "no checkpoint of 6 lines within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Fewer lines than the interval: nothing until shutdown, which signs them.
    log.append(&event(7)).unwrap();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the checkpointer stops at shutdown")
        .unwrap();
    assert_eq!(writer.last_size(), Some(7));
    let c = check_logs(&[log_path], &cps, &keys(&key(3))).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    let sizes: Vec<u64> = c.matched.iter().map(|m| m.checkpoint.size).collect();
    assert_eq!(sizes, [6, 7]);
}

#[test]
fn a_segment_alone_cut_below_a_checkpoint_says_where_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (log, cps, ks) = signed_log(dir.path(), 10, 5);
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.extend_from_slice(b"{\"seq\":11,");
    std::fs::write(&log, bytes).unwrap();
    let w = CheckpointWriter::new(&cps, "executor-arm/test", key(7)).unwrap();
    let l = AuditLog::open(&log, "i-2").unwrap();
    for i in 0..4 {
        l.append(&event(100 + i)).unwrap();
    }
    w.checkpoint_log(&l).unwrap();
    drop(l);
    keep_lines(&log, 2);
    let c = check_logs(&[log], &cps, &ks).unwrap();
    assert_eq!(
        c.problems,
        ["lines 13-15 missing: checkpoint-15 signs 15 lines, the log ends at seq 12"]
    );
}

#[test]
fn a_checkpoint_whose_origin_cannot_be_a_key_name_is_refused() {
    // Its origin is the key name it is signed under again (`Checkpoint::sign`): one holding a
    // space or '+' would sign into a note that no longer parses.
    let k = key(1);
    let head = STANDARD.encode([0u8; 32]);
    for origin in ["e+x", "a b", "a\u{a0}b"] {
        let note = sign_note(&format!("{origin}\n1\n{head}\n"), "o", &k);
        let e = open(note.as_bytes(), &keys(&k)).unwrap_err();
        assert!(matches!(e, CheckpointError::Body(_)), "{origin:?}: {e}");
    }
}
