//! Redis-backed state so replicas share replay protection and idempotency results.
//! Every claim is an atomic `SET NX` with a TTL; a Redis error is a 503, never a panic.
//!
//! An Idempotency-Key in progress is a JSON slot naming its owner (a daemon instance) whose TTL
//! is the lease; renewing and releasing check the owner and that no response is stored yet in
//! one server-side script, so neither can touch a finished entry or another owner's claim.

use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::ConnectionManager;

use super::{
    IdemBegin, IdemKey, JtiClaim, SessionRecord, StateError, StateStore, StoredExecution,
    StoredResponse,
};
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
    /// The daemon instance running the request (in-progress slots only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<String>,
}

/// KEYS[1] a slot, ARGV[1] an owner: 1 when the slot is in progress and owned by ARGV[1].
const OWNED_IN_PROGRESS: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local ok, s = pcall(cjson.decode, v)
if not ok or type(s) ~= 'table' or s.owner ~= ARGV[1] then return 0 end
if s.response ~= nil and s.response ~= cjson.null then return 0 end
"#;

/// Renews an owned claim: ARGV[2] is the lease in milliseconds.
fn renew_script() -> String {
    format!(
        "{OWNED_IN_PROGRESS}
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"
    )
}

/// Deletes an owned claim.
fn release_script() -> String {
    format!(
        "{OWNED_IN_PROGRESS}
redis.call('DEL', KEYS[1])
return 1
"
    )
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl RedisStore {
    /// Connects to `url`; `rediss://` speaks TLS, trusting the PEM bundle `ca_file` alone when
    /// given, else the system's roots.
    pub async fn connect(
        url: &str,
        ca_file: Option<&std::path::Path>,
    ) -> Result<RedisStore, StateError> {
        // rustls needs one process-wide crypto provider; an earlier install (a second store in
        // the same process) is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = match ca_file {
            Some(path) => {
                let root_cert = std::fs::read(path).map_err(|e| {
                    StateError::Unavailable(format!("state.redis_ca_file {}: {e}", path.display()))
                })?;
                redis::Client::build_with_tls(
                    url,
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(root_cert),
                    },
                )
            }
            None => redis::Client::open(url),
        }
        .map_err(unavailable)?;
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
        owner: &str,
        lease: Duration,
    ) -> Result<IdemBegin, StateError> {
        let k = format!("{}idem:{}", self.prefix, key.scoped());
        let slot = serde_json::to_string(&Slot {
            body_hash: body_hash.to_string(),
            response: None,
            owner: Some(owner.to_string()),
        })
        .unwrap_or_default();
        let mut c = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(&k)
            .arg(&slot)
            .arg("NX")
            .arg("PX")
            .arg(millis(lease))
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

    async fn idempotency_renew(
        &self,
        key: &IdemKey,
        owner: &str,
        lease: Duration,
    ) -> Result<bool, StateError> {
        let mut c = self.conn.clone();
        let renewed: i64 = redis::cmd("EVAL")
            .arg(renew_script())
            .arg(1)
            .arg(format!("{}idem:{}", self.prefix, key.scoped()))
            .arg(owner)
            .arg(millis(lease))
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(renewed == 1)
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
            owner: None,
        })
        .unwrap_or_default();
        let mut c = self.conn.clone();
        let _: () = c
            .set_ex(&k, slot, ttl.as_secs().max(1))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn idempotency_release(&self, key: &IdemKey, owner: &str) -> Result<(), StateError> {
        let mut c = self.conn.clone();
        let _: i64 = redis::cmd("EVAL")
            .arg(release_script())
            .arg(1)
            .arg(format!("{}idem:{}", self.prefix, key.scoped()))
            .arg(owner)
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn execution_put(
        &self,
        key: &IdemKey,
        record: &StoredExecution,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let v = serde_json::to_string(record)
            .map_err(|e| StateError::Unavailable(format!("run record: {e}")))?;
        let mut c = self.conn.clone();
        let _: () = redis::cmd("SET")
            .arg(format!("{}exec:{}", self.prefix, key.scoped()))
            .arg(v)
            .arg("PX")
            .arg(millis(ttl))
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn execution_get(&self, key: &IdemKey) -> Result<Option<StoredExecution>, StateError> {
        let mut c = self.conn.clone();
        let v: Option<String> = c
            .get(format!("{}exec:{}", self.prefix, key.scoped()))
            .await
            .map_err(unavailable)?;
        Ok(v.and_then(|s| serde_json::from_str(&s).ok()))
    }

    async fn session_put(
        &self,
        id: &str,
        record: &SessionRecord,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let v = serde_json::to_string(record)
            .map_err(|e| StateError::Unavailable(format!("session record: {e}")))?;
        let mut c = self.conn.clone();
        let _: () = redis::cmd("SET")
            .arg(format!("{}session:{id}", self.prefix))
            .arg(v)
            .arg("PX")
            .arg(millis(ttl))
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn session_get(&self, id: &str) -> Result<Option<SessionRecord>, StateError> {
        let mut c = self.conn.clone();
        let v: Option<String> = c
            .get(format!("{}session:{id}", self.prefix))
            .await
            .map_err(unavailable)?;
        Ok(v.and_then(|s| serde_json::from_str(&s).ok()))
    }

    async fn session_remove(&self, id: &str) -> Result<(), StateError> {
        let mut c = self.conn.clone();
        let _: () = c
            .del(format!("{}session:{id}", self.prefix))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn receipt_key_put(
        &self,
        keyid: &str,
        pem: &str,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let mut c = self.conn.clone();
        let _: () = redis::cmd("SET")
            .arg(format!("{}receipt-key:{keyid}", self.prefix))
            .arg(pem)
            .arg("PX")
            .arg(millis(ttl))
            .query_async(&mut c)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn receipt_keys(&self) -> Result<Vec<(String, String)>, StateError> {
        let mut c = self.conn.clone();
        let prefix = format!("{}receipt-key:", self.prefix);
        // One key per replica and rotation: few enough for a SCAN of their prefix.
        let mut names: Vec<String> = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(100)
                .query_async(&mut c)
                .await
                .map_err(unavailable)?;
            names.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        names.sort();
        names.dedup();
        let mut keys = Vec::with_capacity(names.len());
        for name in names {
            let pem: Option<String> = c.get(&name).await.map_err(unavailable)?;
            if let (Some(pem), Some(keyid)) = (pem, name.strip_prefix(&prefix)) {
                keys.push((keyid.to_string(), pem));
            }
        }
        Ok(keys)
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
