//! Redis-backed state so replicas share replay protection and idempotency results.
//! Every write is an atomic `SET NX` with a TTL; a Redis error is a 503, never a panic.

use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::ConnectionManager;

use super::{IdemBegin, IdemKey, JtiClaim, StateError, StateStore, StoredResponse};
use crate::auth::SingleUse;

pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
}

fn unavailable(e: redis::RedisError) -> StateError {
    StateError::Unavailable(format!("redis: {e}"))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Slot {
    body_hash: String,
    response: Option<StoredResponse>,
}

impl RedisStore {
    pub async fn connect(url: &str) -> Result<RedisStore, StateError> {
        let client = redis::Client::open(url).map_err(unavailable)?;
        let cfg = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_secs(2))
            .set_response_timeout(Duration::from_secs(2))
            .set_number_of_retries(1);
        let conn = ConnectionManager::new_with_config(client, cfg)
            .await
            .map_err(unavailable)?;
        Ok(RedisStore {
            conn,
            prefix: "executor-arm:".into(),
        })
    }
}

#[async_trait::async_trait]
impl StateStore for RedisStore {
    /// Redis outlives any one daemon, so it is the record for every token however old.
    async fn claim_jti(&self, token: &SingleUse) -> Result<JtiClaim, StateError> {
        let ttl = token.exp.saturating_sub(crate::auth::now()).max(1) + 60;
        let mut c = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(format!("{}jti:{}", self.prefix, token.replay_key()))
            .arg(1)
            .arg("NX")
            .arg("EX")
            .arg(ttl)
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(if set.is_some() {
            JtiClaim::Claimed
        } else {
            JtiClaim::Replayed
        })
    }

    async fn release_jti(&self, token: &SingleUse) -> Result<(), StateError> {
        let mut c = self.conn.clone();
        let _: () = c
            .del(format!("{}jti:{}", self.prefix, token.replay_key()))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn idempotency_begin(
        &self,
        key: &IdemKey,
        body_hash: &str,
        ttl: Duration,
    ) -> Result<IdemBegin, StateError> {
        let k = format!("{}idem:{}", self.prefix, key.scoped());
        let slot = serde_json::to_string(&Slot {
            body_hash: body_hash.to_string(),
            response: None,
        })
        .unwrap_or_default();
        let mut c = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(&k)
            .arg(&slot)
            .arg("NX")
            .arg("EX")
            .arg(ttl.as_secs().max(1))
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        if set.is_some() {
            return Ok(IdemBegin::Started);
        }
        let existing: Option<String> = c.get(&k).await.map_err(unavailable)?;
        let Some(existing) = existing.and_then(|s| serde_json::from_str::<Slot>(&s).ok()) else {
            // Expired between SET and GET: treat as running elsewhere; the client retries.
            return Ok(IdemBegin::InProgress { same_body: true });
        };
        let same_body = existing.body_hash == body_hash;
        Ok(match existing.response {
            Some(response) => IdemBegin::Done {
                same_body,
                response,
            },
            None => IdemBegin::InProgress { same_body },
        })
    }

    async fn idempotency_complete(
        &self,
        key: &IdemKey,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let k = format!("{}idem:{}", self.prefix, key.scoped());
        let slot = serde_json::to_string(&Slot {
            body_hash: body_hash.to_string(),
            response: Some(response.clone()),
        })
        .unwrap_or_default();
        let mut c = self.conn.clone();
        let _: () = c
            .set_ex(&k, slot, ttl.as_secs().max(1))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn idempotency_abort(&self, key: &IdemKey) -> Result<(), StateError> {
        let mut c = self.conn.clone();
        let _: () = c
            .del(format!("{}idem:{}", self.prefix, key.scoped()))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn healthy(&self) -> Result<(), StateError> {
        let mut c = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}
