use super::*;
use crate::config::TokenKind;

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

fn single_use(kind: TokenKind, jti: &str, iat: Option<u64>) -> SingleUse {
    SingleUse {
        kind,
        jti: jti.into(),
        iat,
        exp: crate::auth::now() + 60,
    }
}

const TTL: Duration = Duration::from_secs(60);

#[tokio::test]
async fn jti_once_and_idempotency_states() {
    let s = MemoryStore::new(1 << 20, 0);
    let fresh = single_use(TokenKind::Capability, "a", Some(s.horizon));
    assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Claimed);
    assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Replayed);
    // A released jti (its request never ran) can be claimed once more, and only once.
    s.release_jti(&fresh).await.unwrap();
    assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Claimed);
    assert_eq!(s.claim_jti(&fresh).await.unwrap(), JtiClaim::Replayed);
    // The same jti on a service token is another token.
    let svc = single_use(TokenKind::Service, "a", Some(s.horizon));
    assert_eq!(s.claim_jti(&svc).await.unwrap(), JtiClaim::Claimed);
    assert_eq!(s.claim_jti(&svc).await.unwrap(), JtiClaim::Replayed);

    let k = key("orch", "k");
    assert_eq!(
        s.idempotency_begin(&k, "h1", "d1", TTL).await.unwrap(),
        IdemBegin::Started
    );
    assert_eq!(
        s.idempotency_begin(&k, "h1", "d2", TTL).await.unwrap(),
        IdemBegin::InProgress { same_body: true }
    );
    // Only the owner's release frees a claim.
    s.idempotency_release(&k, "d2").await.unwrap();
    assert_eq!(
        s.idempotency_begin(&k, "h2", "d2", TTL).await.unwrap(),
        IdemBegin::InProgress { same_body: false }
    );
    assert!(s.idempotency_renew(&k, "d1", TTL).await.unwrap());
    assert!(!s.idempotency_renew(&k, "d2", TTL).await.unwrap());
    let r = response(2);
    s.idempotency_complete(&k, "h1", &r, TTL).await.unwrap();
    // A finished entry is neither renewed nor released.
    assert!(!s.idempotency_renew(&k, "d1", TTL).await.unwrap());
    s.idempotency_release(&k, "d1").await.unwrap();
    assert_eq!(
        s.idempotency_begin(&k, "h2", "d2", TTL).await.unwrap(),
        IdemBegin::Done {
            same_body: false,
            response: r
        }
    );
    // Another subject's identical key is its own.
    assert_eq!(
        s.idempotency_begin(&key("other", "k"), "h1", "d1", TTL)
            .await
            .unwrap(),
        IdemBegin::Started
    );
}

#[tokio::test]
async fn a_lapsed_claim_frees_the_key_and_cannot_be_renewed() {
    let s = MemoryStore::new(1 << 20, 0);
    let k = key("orch", "k");
    assert_eq!(
        s.idempotency_begin(&k, "h", "dead", Duration::ZERO)
            .await
            .unwrap(),
        IdemBegin::Started
    );
    assert!(!s.idempotency_renew(&k, "dead", TTL).await.unwrap());
    assert_eq!(
        s.idempotency_begin(&k, "h", "live", TTL).await.unwrap(),
        IdemBegin::Started
    );
    // The dead owner's late release leaves the new claim alone.
    s.idempotency_release(&k, "dead").await.unwrap();
    assert_eq!(
        s.idempotency_begin(&k, "h", "other", TTL).await.unwrap(),
        IdemBegin::InProgress { same_body: true }
    );
}

#[tokio::test]
async fn a_single_use_token_that_may_predate_the_store_is_refused_and_not_recorded() {
    let s = MemoryStore::new(1 << 20, 0);
    let since = s.horizon;
    assert!(since >= 1, "the horizon is a real time");
    for iat in [None, Some(since - 1), Some(0)] {
        let t = single_use(TokenKind::Capability, "old", iat);
        assert_eq!(
            s.claim_jti(&t).await.unwrap(),
            JtiClaim::PredatesRecord { since },
            "{iat:?}"
        );
    }
    let t = single_use(TokenKind::Service, "old-svc", None);
    assert_eq!(
        s.claim_jti(&t).await.unwrap(),
        JtiClaim::PredatesRecord { since }
    );
    // Nothing was recorded: the first token issued at the horizon is a first use.
    let t = single_use(TokenKind::Capability, "old", Some(since));
    assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Claimed);
}

#[test]
fn the_horizon_is_the_first_whole_second_after_start() {
    let before = crate::auth::now();
    let s = MemoryStore::new(1, 0);
    let after = crate::auth::now();
    // A token with iat == the start second may have been issued just before the start.
    assert!(
        s.horizon >= before && s.horizon <= after + 1,
        "{before} {} {after}",
        s.horizon
    );
}

/// Bytes one stored result of `key` with a 1-byte body hash and `body` bytes costs.
fn cost(k: &IdemKey, body: usize) -> usize {
    result_bytes(&k.scoped(), &k.subject, "h", &"x".repeat(body))
}

fn done(t: &IdemTable, k: &IdemKey, now: Instant) -> bool {
    t.entries
        .get(&k.scoped())
        .is_some_and(|e| e.expires > now && matches!(e.slot, Slot::Done { .. }))
}

#[test]
fn eviction_takes_the_oldest_result_of_the_subject_holding_the_most_bytes() {
    let now = Instant::now();
    let body = 1000;
    let unit = cost(&key("greedy", "g0"), body);
    // Room for four results.
    let mut t = IdemTable::new(4 * unit + unit / 2);
    let quiet = key("quietx", "q0");
    assert_eq!(cost(&quiet, body), unit);
    assert_eq!(t.begin(&quiet, "h", "d", TTL, now), IdemBegin::Started);
    assert_eq!(
        t.complete(&quiet, "h", &response(body), TTL, now),
        Completion::Stored
    );
    // An in-progress entry of the greedy subject, never evicted.
    let running = key("greedy", "gr");
    assert_eq!(t.begin(&running, "h", "d", TTL, now), IdemBegin::Started);
    let greedy: Vec<IdemKey> = (0..10).map(|i| key("greedy", &format!("g{i}"))).collect();
    for (i, g) in greedy.iter().enumerate() {
        assert_eq!(t.begin(g, "h", "d", TTL, now), IdemBegin::Started);
        assert_eq!(
            t.complete(g, "h", &response(body), TTL, now),
            Completion::Stored
        );
        assert!(
            t.budget.bytes() <= t.budget.max_bytes(),
            "{i}: {}",
            t.budget.bytes()
        );
    }
    // The greedy subject evicted only its own oldest results.
    assert!(done(&t, &quiet, now), "the quiet subject's result survives");
    for g in &greedy[..7] {
        assert!(!done(&t, g, now), "{g:?} is evicted");
        assert_eq!(
            t.begin(g, "h", "d", TTL, now),
            IdemBegin::Started,
            "{g:?} runs again"
        );
        t.remove(&g.scoped());
    }
    for g in &greedy[7..] {
        assert!(done(&t, g, now), "{g:?} is kept");
    }
    assert_eq!(
        t.begin(&running, "h", "d", TTL, now),
        IdemBegin::InProgress { same_body: true },
        "an in-progress entry is never evicted"
    );
    assert_eq!(t.budget.bytes(), 4 * unit);

    // Now the quiet subject adds results: the greedy one still holds the most, so it pays.
    let q1 = key("quietx", "q1");
    t.begin(&q1, "h", "d", TTL, now);
    assert_eq!(
        t.complete(&q1, "h", &response(body), TTL, now),
        Completion::Stored
    );
    assert!(done(&t, &quiet, now) && done(&t, &q1, now));
    assert!(!done(&t, &greedy[7], now), "greedy's oldest went first");
    assert!(done(&t, &greedy[8], now) && done(&t, &greedy[9], now));
}

#[test]
fn a_result_larger_than_the_budget_is_not_stored_and_the_key_is_released() {
    let now = Instant::now();
    let k = key("s", "big");
    let small = key("s", "small");
    let mut t = IdemTable::new(cost(&small, 10) * 2);
    t.begin(&small, "h", "d", TTL, now);
    assert_eq!(
        t.complete(&small, "h", &response(10), TTL, now),
        Completion::Stored
    );
    assert_eq!(t.begin(&k, "h", "d", TTL, now), IdemBegin::Started);
    let big = cost(&k, 10_000);
    assert_eq!(
        t.complete(&k, "h", &response(10_000), TTL, now),
        Completion::TooLarge { bytes: big }
    );
    assert_eq!(
        t.begin(&k, "h", "d", TTL, now),
        IdemBegin::Started,
        "a retry runs"
    );
    assert!(done(&t, &small, now), "nothing was evicted for it");
}

#[test]
fn expired_results_give_their_bytes_back() {
    let now = Instant::now();
    let k = key("s", "k");
    let mut t = IdemTable::new(1 << 20);
    t.begin(&k, "h", "d", TTL, now);
    t.complete(&k, "h", &response(500), TTL, now);
    assert_eq!(t.budget.bytes(), cost(&k, 500));
    assert_eq!(
        t.begin(&key("s", "other"), "h", "d", TTL, now + TTL),
        IdemBegin::Started
    );
    assert_eq!(t.budget.bytes(), 0);
    assert!(t.budget.is_empty());
    assert_eq!(t.begin(&k, "h", "d", TTL, now + TTL), IdemBegin::Started);
}

#[test]
fn scoped_keys_of_different_pairs_never_collide() {
    assert_ne!(key("a", "b:c").scoped(), key("a:b", "c").scoped());
}

/// Verification accepts an `iat` up to the leeway in the future: a token used just before a
/// restart can carry an `iat` up to that much after the new start, so the horizon covers it.
#[tokio::test]
async fn the_horizon_covers_the_verification_leeway() {
    let before = crate::auth::now();
    let s = MemoryStore::new(1, 5);
    assert!(s.horizon >= before + 5, "{before} {}", s.horizon);
    let ahead = single_use(TokenKind::Capability, "ahead", Some(before + 4));
    assert!(matches!(
        s.claim_jti(&ahead).await.unwrap(),
        JtiClaim::PredatesRecord { .. }
    ));
    let after = single_use(TokenKind::Capability, "after", Some(s.horizon));
    assert_eq!(s.claim_jti(&after).await.unwrap(), JtiClaim::Claimed);
}
