//! The public keys that verify receipts and checkpoints, whichever front end asks: this
//! replica's signing key, `receipts.public_key_files`, and the keys other replicas published
//! through the shared state store (each replica has its own key).
//!
//! Owns: publishing this replica's key to the store and listing every key once. Must not: sign
//! anything (the execution service and the checkpointer do) or read HTTP.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::provenance::keys;

/// How long a published key stays listed after its replica last published it: long past any
/// run's retention, so receipts a stopped replica signed still find their key.
const PUBLISHED_FOR: Duration = Duration::from_secs(30 * 24 * 3600);
/// How often a replica publishes its key again while it runs.
const REPUBLISH_EVERY: Duration = Duration::from_secs(3600);

/// The public keys that verify this daemon's receipts and checkpoints.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReceiptKeys {
    /// This replica's signing key first, then `receipts.public_key_files`, then the keys other
    /// replicas published, each once.
    pub keys: Vec<ReceiptKey>,
}

/// One public key.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReceiptKey {
    /// SHA-256 (hex) of the raw public key: the `keyid` of the signatures it verifies.
    pub keyid: String,
    /// `ed25519`.
    pub algorithm: &'static str,
    /// The key as a PEM `PUBLIC KEY` (SubjectPublicKeyInfo), as `executor-arm receipt verify
    /// --key` reads it.
    pub public_key_pem: String,
    /// Whether this replica signs with it now.
    pub signing: bool,
    /// Where it is listed from: `this replica`, `receipts.public_key_files`, `another replica`.
    pub source: &'static str,
}

/// Every key once. Keys other replicas published are read from the store; a store that cannot
/// be read leaves them out (logged), since this replica's own keys are still right.
pub async fn list(st: &AppState) -> ReceiptKeys {
    let own = st.signing.key.verifying_key();
    let own_id = keys::keyid(&own);
    let mut seen = BTreeSet::from([own_id.clone()]);
    let mut listed = vec![ReceiptKey {
        keyid: own_id,
        algorithm: "ed25519",
        public_key_pem: keys::public_key_pem(&own),
        signing: true,
        source: "this replica",
    }];
    for (keyid, key) in st.signing.keys.iter() {
        if seen.insert(keyid.to_string()) {
            listed.push(ReceiptKey {
                keyid: keyid.to_string(),
                algorithm: "ed25519",
                public_key_pem: keys::public_key_pem(key),
                signing: false,
                source: "receipts.public_key_files",
            });
        }
    }
    match st.store.receipt_keys().await {
        Ok(published) => {
            for (name, pem) in published {
                // The keyid is the key's own digest, never the name it was stored under.
                let Ok(key) = keys::public_key_from_pem(&pem) else {
                    tracing::warn!(%name, "a published receipts key is not an Ed25519 public key: left out");
                    continue;
                };
                let keyid = keys::keyid(&key);
                if seen.insert(keyid.clone()) {
                    listed.push(ReceiptKey {
                        keyid,
                        algorithm: "ed25519",
                        public_key_pem: keys::public_key_pem(&key),
                        signing: false,
                        source: "another replica",
                    });
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "other replicas' receipts keys could not be read: listed without them")
        }
    }
    ReceiptKeys { keys: listed }
}

/// Publishes this replica's key to the store now and every hour, until the task is aborted. A
/// failure is logged and tried again at the next turn.
pub async fn publish_key(st: std::sync::Arc<AppState>) {
    let key = st.signing.key.verifying_key();
    let (keyid, pem) = (keys::keyid(&key), keys::public_key_pem(&key));
    loop {
        if let Err(e) = st.store.receipt_key_put(&keyid, &pem, PUBLISHED_FOR).await {
            tracing::warn!(error = %e, "the receipts key could not be published to the state store");
        }
        tokio::time::sleep(REPUBLISH_EVERY).await;
    }
}
