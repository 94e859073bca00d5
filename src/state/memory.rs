//! The embedded store: one process, in memory, entries expire. A restart forgets everything,
//! Idempotency-Keys in progress included.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{IdemBegin, StateError, StateStore, StoredResponse};

enum Slot {
    Running {
        body_hash: String,
        owner: String,
    },
    Done {
        body_hash: String,
        response: StoredResponse,
    },
}

#[derive(Default)]
pub struct MemoryStore {
    jtis: Mutex<HashMap<String, u64>>,
    idem: Mutex<HashMap<String, (Instant, Slot)>>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait::async_trait]
impl StateStore for MemoryStore {
    async fn claim_jti(&self, jti: &str, exp_unix: u64) -> Result<bool, StateError> {
        let now = crate::auth::now();
        let mut m = self.jtis.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 10_000 {
            m.retain(|_, exp| *exp + 60 >= now);
        }
        if m.contains_key(jti) {
            return Ok(false);
        }
        m.insert(jti.to_string(), exp_unix);
        Ok(true)
    }

    async fn release_jti(&self, jti: &str) -> Result<(), StateError> {
        self.jtis
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(jti);
        Ok(())
    }

    async fn idempotency_begin(
        &self,
        key: &str,
        body_hash: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<IdemBegin, StateError> {
        let now = Instant::now();
        let mut m = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, (until, _)| *until > now);
        match m.get(key) {
            Some((_, Slot::Running { body_hash: h, .. })) => Ok(IdemBegin::InProgress {
                same_body: h == body_hash,
            }),
            Some((
                _,
                Slot::Done {
                    body_hash: h,
                    response,
                },
            )) => Ok(IdemBegin::Done {
                same_body: h == body_hash,
                response: response.clone(),
            }),
            None => {
                m.insert(
                    key.to_string(),
                    (
                        now + lease,
                        Slot::Running {
                            body_hash: body_hash.to_string(),
                            owner: owner.to_string(),
                        },
                    ),
                );
                Ok(IdemBegin::Started)
            }
        }
    }

    async fn idempotency_renew(
        &self,
        key: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<bool, StateError> {
        let now = Instant::now();
        let mut m = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        match m.get_mut(key) {
            Some((until, Slot::Running { owner: o, .. })) if *until > now && o == owner => {
                *until = now + lease;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn idempotency_complete(
        &self,
        key: &str,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let mut m = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(
            key.to_string(),
            (
                Instant::now() + ttl,
                Slot::Done {
                    body_hash: body_hash.to_string(),
                    response: response.clone(),
                },
            ),
        );
        Ok(())
    }

    async fn idempotency_release(&self, key: &str, owner: &str) -> Result<(), StateError> {
        let mut m = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(m.get(key), Some((_, Slot::Running { owner: o, .. })) if o == owner) {
            m.remove(key);
        }
        Ok(())
    }

    async fn healthy(&self) -> Result<(), StateError> {
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jti_once_and_idempotency_states() {
        let s = MemoryStore::new();
        assert!(s.claim_jti("a", crate::auth::now() + 60).await.unwrap());
        assert!(!s.claim_jti("a", crate::auth::now() + 60).await.unwrap());
        s.release_jti("a").await.unwrap();
        assert!(s.claim_jti("a", crate::auth::now() + 60).await.unwrap());
        assert!(!s.claim_jti("a", crate::auth::now() + 60).await.unwrap());
        let ttl = Duration::from_secs(60);
        assert_eq!(
            s.idempotency_begin("k", "h1", "d1", ttl).await.unwrap(),
            IdemBegin::Started
        );
        assert_eq!(
            s.idempotency_begin("k", "h1", "d2", ttl).await.unwrap(),
            IdemBegin::InProgress { same_body: true }
        );
        // Only the owner's release frees a claim.
        s.idempotency_release("k", "d2").await.unwrap();
        assert_eq!(
            s.idempotency_begin("k", "h2", "d2", ttl).await.unwrap(),
            IdemBegin::InProgress { same_body: false }
        );
        assert!(s.idempotency_renew("k", "d1", ttl).await.unwrap());
        assert!(!s.idempotency_renew("k", "d2", ttl).await.unwrap());
        let r = StoredResponse {
            status: 200,
            body: "{}".into(),
        };
        s.idempotency_complete("k", "h1", &r, ttl).await.unwrap();
        // A finished entry is neither renewed nor released.
        assert!(!s.idempotency_renew("k", "d1", ttl).await.unwrap());
        s.idempotency_release("k", "d1").await.unwrap();
        assert_eq!(
            s.idempotency_begin("k", "h2", "d2", ttl).await.unwrap(),
            IdemBegin::Done {
                same_body: false,
                response: r
            }
        );
    }

    #[tokio::test]
    async fn a_lapsed_claim_frees_the_key_and_cannot_be_renewed() {
        let s = MemoryStore::new();
        assert_eq!(
            s.idempotency_begin("k", "h", "dead", Duration::ZERO)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        assert!(
            !s.idempotency_renew("k", "dead", Duration::from_secs(60))
                .await
                .unwrap()
        );
        assert_eq!(
            s.idempotency_begin("k", "h", "live", Duration::from_secs(60))
                .await
                .unwrap(),
            IdemBegin::Started
        );
        // The dead owner's late release leaves the new claim alone.
        s.idempotency_release("k", "dead").await.unwrap();
        assert_eq!(
            s.idempotency_begin("k", "h", "other", Duration::from_secs(60))
                .await
                .unwrap(),
            IdemBegin::InProgress { same_body: true }
        );
    }
}
