use super::*;
use crate::config::TokenKind;
use redb::ReadableTableMetadata;

const MAX: usize = 1 << 20;
const TTL: Duration = Duration::from_secs(60);

fn key(subject: &str, k: &str) -> IdemKey {
    IdemKey {
        subject: subject.into(),
        key: k.into(),
    }
}

fn response(len: usize) -> StoredResponse {
    StoredResponse {
        status: 200,
        body: "x".repeat(len),
    }
}

fn single_use(jti: &str, exp: u64) -> SingleUse {
    SingleUse {
        kind: TokenKind::Capability,
        jti: jti.into(),
        // After the file's record began (its creation plus the leeway).
        iat: Some(crate::auth::now() + 60),
        exp,
    }
}

fn open(dir: &Path) -> DurableStore {
    DurableStore::open(dir, MAX, 5, Duration::ZERO).expect("open the state file")
}

fn open_err(dir: &Path) -> String {
    match DurableStore::open(dir, MAX, 5, Duration::ZERO) {
        Ok(_) => panic!("the state file in {} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn run(instance: &str, done: bool) -> StoredExecution {
    StoredExecution {
        instance: instance.into(),
        address: Some("http://127.0.0.1:1".into()),
        response: done.then(|| StoredResponse {
            status: 200,
            body: "{\"ok\":true}".into(),
        }),
        cancelled_by: None,
        backend: Some("local".into()),
        profile: Some("python".into()),
    }
}

/// Rows of `def`, read from the file.
fn rows(s: &DurableStore, def: TableDefinition<&str, &[u8]>) -> usize {
    let txn = s.shared.db.begin_read().unwrap();
    txn.open_table(def).unwrap().len().unwrap() as usize
}

#[tokio::test]
async fn a_claimed_jti_is_a_replay_after_a_reopen_and_any_old_token_is_claimable() {
    let dir = tempfile::tempdir().unwrap();
    let exp = crate::auth::now() + 300;
    let s = open(dir.path());
    let t = single_use("j1", exp);
    assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Claimed);
    assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Replayed);
    let released = single_use("j2", exp);
    assert_eq!(s.claim_jti(&released).await.unwrap(), JtiClaim::Claimed);
    s.release_jti(&released).await.unwrap();
    drop(s);

    let s = open(dir.path());
    assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Replayed);
    assert_eq!(
        s.claim_jti(&released).await.unwrap(),
        JtiClaim::Claimed,
        "a released id stays usable"
    );
    // Service and capability ids live apart.
    let svc = SingleUse {
        kind: TokenKind::Service,
        ..single_use("j1", exp)
    };
    assert_eq!(s.claim_jti(&svc).await.unwrap(), JtiClaim::Claimed);
    assert_eq!(s.kind(), "embedded");
    s.healthy().await.unwrap();
}

#[tokio::test]
async fn a_new_file_refuses_tokens_that_may_predate_it_and_a_reopen_keeps_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let before = crate::auth::now();
    let s = open(dir.path());
    let since = s.shared.since;
    assert!(
        since > before + 5,
        "the leeway is covered: {before} {since}"
    );
    let early = SingleUse {
        iat: Some(since - 1),
        ..single_use("early", before + 300)
    };
    let no_iat = SingleUse {
        iat: None,
        ..single_use("no-iat", before + 300)
    };
    for t in [&early, &no_iat] {
        assert_eq!(
            s.claim_jti(t).await.unwrap(),
            JtiClaim::PredatesRecord { since }
        );
    }
    assert_eq!(
        s.claim_jti(&SingleUse {
            iat: Some(since),
            ..single_use("on-time", before + 300)
        })
        .await
        .unwrap(),
        JtiClaim::Claimed
    );
    drop(s);
    std::thread::sleep(Duration::from_millis(1100));
    let s = open(dir.path());
    assert_eq!(s.shared.since, since, "a reopen does not move the start");
    assert_eq!(rows_jtis(&s), 1, "refused tokens were not recorded");
}

fn rows_jtis(s: &DurableStore) -> usize {
    let txn = s.shared.db.begin_read().unwrap();
    txn.open_table(JTIS).unwrap().len().unwrap() as usize
}

#[tokio::test]
async fn idempotency_claims_and_answers_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let (running, done, released) = (key("svc", "run"), key("svc", "done"), key("svc", "rel"));
    for k in [&running, &done, &released] {
        assert_eq!(
            s.idempotency_begin(k, "h", "old", TTL).await.unwrap(),
            IdemBegin::Started
        );
    }
    assert!(s.idempotency_renew(&running, "old", TTL).await.unwrap());
    assert!(!s.idempotency_renew(&running, "other", TTL).await.unwrap());
    s.idempotency_complete(&done, "h", &response(10), TTL)
        .await
        .unwrap();
    s.idempotency_release(&released, "old").await.unwrap();
    drop(s);

    let s = open(dir.path());
    assert_eq!(
        s.idempotency_begin(&running, "h2", "new", TTL)
            .await
            .unwrap(),
        IdemBegin::InProgress { same_body: false }
    );
    assert_eq!(
        s.idempotency_begin(&done, "h", "new", TTL).await.unwrap(),
        IdemBegin::Done {
            same_body: true,
            response: response(10)
        }
    );
    assert_eq!(
        s.idempotency_begin(&released, "h", "new", TTL)
            .await
            .unwrap(),
        IdemBegin::Started
    );
    // The old owner's claim: renewable by it, not by another; a release by another leaves it,
    // a finished entry stays whoever releases.
    assert!(s.idempotency_renew(&running, "old", TTL).await.unwrap());
    assert!(!s.idempotency_renew(&done, "old", TTL).await.unwrap());
    s.idempotency_release(&running, "new").await.unwrap();
    s.idempotency_release(&done, "old").await.unwrap();
    assert!(matches!(
        s.idempotency_begin(&running, "h", "new", TTL)
            .await
            .unwrap(),
        IdemBegin::InProgress { .. }
    ));
    assert!(matches!(
        s.idempotency_begin(&done, "h", "new", TTL).await.unwrap(),
        IdemBegin::Done { .. }
    ));
    s.idempotency_release(&running, "old").await.unwrap();
    assert_eq!(
        s.idempotency_begin(&running, "h", "new", TTL)
            .await
            .unwrap(),
        IdemBegin::Started
    );
}

#[tokio::test]
async fn a_lapsed_lease_frees_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let k = key("svc", "k");
    let short = Duration::from_millis(1);
    assert_eq!(
        s.idempotency_begin(&k, "h", "a", short).await.unwrap(),
        IdemBegin::Started
    );
    std::thread::sleep(Duration::from_millis(5));
    assert!(!s.idempotency_renew(&k, "a", TTL).await.unwrap());
    assert_eq!(
        s.idempotency_begin(&k, "h", "b", TTL).await.unwrap(),
        IdemBegin::Started
    );
}

#[tokio::test]
async fn run_records_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let (a, b) = (key("svc", "exec-a"), key("svc", "exec-b"));
    s.execution_put(&a, &run("i1", false), TTL).await.unwrap();
    s.execution_put(&a, &run("i1", true), TTL).await.unwrap();
    s.execution_put(&b, &run("i1", false), TTL).await.unwrap();
    drop(s);

    let s = open(dir.path());
    assert_eq!(s.execution_get(&a).await.unwrap(), Some(run("i1", true)));
    assert_eq!(s.execution_get(&b).await.unwrap(), Some(run("i1", false)));
    assert_eq!(
        s.execution_get(&key("other", "exec-a")).await.unwrap(),
        None,
        "another subject's run is not found"
    );
    assert_eq!(rows(&s, EXECS), 2);
}

#[tokio::test]
async fn expired_records_are_ignored_and_swept_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let short = Duration::from_millis(1);
    for i in 0..10 {
        let k = key("svc", &format!("k{i}"));
        s.idempotency_begin(&k, "h", "a", TTL).await.unwrap();
        s.idempotency_complete(&k, "h", &response(100), short)
            .await
            .unwrap();
        s.execution_put(&key("svc", &format!("e{i}")), &run("i", true), short)
            .await
            .unwrap();
    }
    // A token that expired long ago (past the leeway and the minute kept after it).
    let old = SingleUse {
        iat: Some(s.shared.since),
        ..single_use("old", crate::auth::now() - 120)
    };
    assert_eq!(s.claim_jti(&old).await.unwrap(), JtiClaim::Claimed);
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(s.execution_get(&key("svc", "e0")).await.unwrap(), None);
    assert_eq!(
        s.idempotency_begin(&key("svc", "k0"), "h", "a", TTL)
            .await
            .unwrap(),
        IdemBegin::Started,
        "an expired answer is gone"
    );
    drop(s);

    // Reopening sweeps everything that expired.
    let s = open(dir.path());
    assert_eq!(rows(&s, EXECS), 0);
    assert_eq!(rows(&s, IDEM), 1, "only the running k0 is left");
    let txn = s.shared.db.begin_read().unwrap();
    assert_eq!(rows_jtis(&s), 0);
    assert_eq!(txn.open_table(EXPIRY).unwrap().len().unwrap(), 1);
    let budgets = s.shared.budgets.lock().unwrap();
    assert_eq!((budgets.idem.bytes(), budgets.execs.bytes()), (0, 0));
}

#[tokio::test]
async fn writes_sweep_expired_records_as_they_go() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let short = Duration::from_millis(1);
    for i in 0..(SWEEP_BATCH * 2) {
        s.execution_put(&key("svc", &format!("e{i}")), &run("i", true), short)
            .await
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(5));
    let live = key("svc", "live");
    s.execution_put(&live, &run("i", true), TTL).await.unwrap();
    s.execution_put(&live, &run("i", true), TTL).await.unwrap();
    s.execution_put(&live, &run("i", true), TTL).await.unwrap();
    assert_eq!(rows(&s, EXECS), 1, "each write swept a batch");
}

#[tokio::test]
async fn the_budget_evicts_the_biggest_subjects_oldest_result_and_holds_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let body = 1000;
    let unit = result_bytes(
        &key("greedy", "g0").scoped(),
        "greedy",
        "h",
        &"x".repeat(body),
    );
    let max = 4 * unit + unit / 2;
    let s = DurableStore::open(dir.path(), max, 5, Duration::ZERO).unwrap();
    let quiet = key("quietx", "q0");
    s.idempotency_begin(&quiet, "h", "d", TTL).await.unwrap();
    s.idempotency_complete(&quiet, "h", &response(body), TTL)
        .await
        .unwrap();
    let running = key("greedy", "gr");
    s.idempotency_begin(&running, "h", "d", TTL).await.unwrap();
    let greedy: Vec<IdemKey> = (0..10).map(|i| key("greedy", &format!("g{i}"))).collect();
    for g in &greedy {
        s.idempotency_begin(g, "h", "d", TTL).await.unwrap();
        s.idempotency_complete(g, "h", &response(body), TTL)
            .await
            .unwrap();
    }
    drop(s);

    let s = DurableStore::open(dir.path(), max, 5, Duration::ZERO).unwrap();
    let done = |b: &IdemBegin| matches!(b, IdemBegin::Done { .. });
    assert!(done(
        &s.idempotency_begin(&quiet, "h", "d", TTL).await.unwrap()
    ));
    for g in &greedy[..7] {
        let b = s.idempotency_begin(g, "h", "d", TTL).await.unwrap();
        assert_eq!(b, IdemBegin::Started, "{g:?} was evicted");
        s.idempotency_release(g, "d").await.unwrap();
    }
    for g in &greedy[7..] {
        assert!(done(&s.idempotency_begin(g, "h", "d", TTL).await.unwrap()));
    }
    assert_eq!(
        s.idempotency_begin(&running, "h", "d", TTL).await.unwrap(),
        IdemBegin::InProgress { same_body: true },
        "a running entry is never evicted"
    );
    assert_eq!(s.shared.budgets.lock().unwrap().idem.bytes(), 4 * unit);
    // The count was rebuilt from the file: the quiet subject's next result evicts greedy's oldest.
    let q1 = key("quietx", "q1");
    s.idempotency_begin(&q1, "h", "d", TTL).await.unwrap();
    s.idempotency_complete(&q1, "h", &response(body), TTL)
        .await
        .unwrap();
    assert!(done(
        &s.idempotency_begin(&quiet, "h", "d", TTL).await.unwrap()
    ));
    assert_eq!(
        s.idempotency_begin(&greedy[7], "h", "d", TTL)
            .await
            .unwrap(),
        IdemBegin::Started
    );
    // A result larger than the whole budget is not stored and frees its key.
    let big = key("s", "big");
    s.idempotency_begin(&big, "h", "d", TTL).await.unwrap();
    s.idempotency_complete(&big, "h", &response(max), TTL)
        .await
        .unwrap();
    assert_eq!(
        s.idempotency_begin(&big, "h", "d", TTL).await.unwrap(),
        IdemBegin::Started
    );
    drop(s);
    // A lower budget holds from the start on.
    let s = DurableStore::open(dir.path(), unit, 5, Duration::ZERO).unwrap();
    assert!(s.shared.budgets.lock().unwrap().idem.bytes() <= unit);
}

#[test]
fn a_second_opener_of_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = open(dir.path());
    let e = open_err(dir.path());
    assert!(e.contains(FILE_NAME) && e.contains("in use"), "{e}");
    assert!(
        e.contains(&format!("pid {}", std::process::id())),
        "names the holder: {e}"
    );
}

#[test]
fn an_opener_waits_for_a_holder_that_lets_go_within_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path());
    let letting_go = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(first);
    });
    let second = DurableStore::open(dir.path(), MAX, 5, Duration::from_secs(30));
    letting_go.join().unwrap();
    assert!(second.is_ok(), "{:?}", second.err());
}

#[test]
fn a_corrupt_file_is_an_error_naming_it_and_is_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    {
        let s = open(dir.path());
        rt.block_on(async {
            for i in 0..50 {
                s.execution_put(&key("svc", &format!("e{i}")), &run("i", true), TTL)
                    .await
                    .unwrap();
            }
        });
    }
    let path = dir.path().join(FILE_NAME);
    let mut bytes = std::fs::read(&path).unwrap();
    // Damage every page after the header: the committed trees no longer match their checksums.
    for b in bytes.iter_mut().skip(4096) {
        *b ^= 0x5a;
    }
    std::fs::write(&path, &bytes).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains(&path.display().to_string()) && e.contains("move the file aside"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "the file is not reset"
    );

    // Not a redb file at all.
    std::fs::write(&path, b"not a database, but not empty either").unwrap();
    let e = open_err(dir.path());
    assert!(e.contains("corrupt or unreadable"), "{e}");
}

#[test]
fn a_file_of_another_schema_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path()));
    {
        let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(SCHEMA_KEY, SCHEMA_VERSION + 1)
            .unwrap();
        txn.commit().unwrap();
    }
    let e = open_err(dir.path());
    assert!(
        e.contains(&format!("schema version {}", SCHEMA_VERSION + 1)),
        "{e}"
    );
    // A redb file that executor-arm did not write.
    let other = tempfile::tempdir().unwrap();
    {
        let db = Database::create(other.path().join(FILE_NAME)).unwrap();
        let txn = db.begin_write().unwrap();
        let t: TableDefinition<&str, u64> = TableDefinition::new("something");
        txn.open_table(t).unwrap().insert("a", 1).unwrap();
        txn.commit().unwrap();
    }
    let e = open_err(other.path());
    assert!(
        e.contains("no schema version") || e.contains("without a schema"),
        "{e}"
    );
}

#[test]
fn the_directory_and_file_are_the_daemons_alone() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("a/state");
    drop(open(&dir));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(FILE_NAME)), 0o600);
}

#[test]
fn tagged_keys_read_back() {
    for kind in [Kind::Jti, Kind::Idem, Kind::Exec] {
        let t = kind.tagged("3:svc:k:x");
        assert_eq!(Kind::untag(&t), Some((kind, "3:svc:k:x")));
    }
    assert_eq!(Kind::untag("x:k"), None);
    assert_eq!(Kind::untag(""), None);
}
