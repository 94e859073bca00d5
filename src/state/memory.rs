//! The embedded store: one process, in memory, entries expire.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{IdemBegin, StateError, StateStore, StoredResponse};

enum Slot {
    Running {
        body_hash: String,
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
        ttl: Duration,
    ) -> Result<IdemBegin, StateError> {
        let now = Instant::now();
        let mut m = self.idem.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, (until, _)| *until > now);
        match m.get(key) {
            Some((_, Slot::Running { body_hash: h })) => Ok(IdemBegin::InProgress {
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
                        now + ttl,
                        Slot::Running {
                            body_hash: body_hash.to_string(),
                        },
                    ),
                );
                Ok(IdemBegin::Started)
            }
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

    async fn idempotency_abort(&self, key: &str) -> Result<(), StateError> {
        self.idem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
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
            s.idempotency_begin("k", "h1", ttl).await.unwrap(),
            IdemBegin::Started
        );
        assert_eq!(
            s.idempotency_begin("k", "h1", ttl).await.unwrap(),
            IdemBegin::InProgress { same_body: true }
        );
        let r = StoredResponse {
            status: 200,
            body: "{}".into(),
        };
        s.idempotency_complete("k", "h1", &r, ttl).await.unwrap();
        assert_eq!(
            s.idempotency_begin("k", "h2", ttl).await.unwrap(),
            IdemBegin::Done {
                same_body: false,
                response: r
            }
        );
    }
}
