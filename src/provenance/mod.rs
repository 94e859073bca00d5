//! Provenance: the hashes that tie a result to what ran, the hash-chained audit log, and the
//! signatures that let others check both: receipts (`receipt`, a DSSE envelope from `dsse`) and
//! audit checkpoints (`checkpoint`), signed with the key `keys` reads.

pub mod audit;
pub mod checkpoint;
pub mod dsse;
pub mod keys;
pub mod receipt;

use sha2::{Digest, Sha256};

/// The command hash orchestrator clients recompute: `sha256(command + " " + " ".join(args))`, trailing space included when
/// there are no args, as `"sha256:<hex>"`.
pub fn command_hash(command: &str, args: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(command.as_bytes());
    h.update(b" ");
    h.update(args.join(" ").as_bytes());
    format!("sha256:{}", hex::encode(h.finalize()))
}

pub fn sha256_prefixed(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// sha256 of the canonical JSON (sorted keys, no whitespace) of everything that decides behaviour.
pub fn invocation_hash(v: &serde_json::Value) -> String {
    sha256_prefixed(canonical_json(v).as_bytes())
}

/// serde_json's default map is a BTreeMap, so serialising a `Value` sorts keys at every level.
pub fn canonical_json(v: &serde_json::Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// What signs receipts and checkpoints: the signing key, the public keys that verify (its own
/// and `receipts.public_key_files`) and the writer of this log's checkpoints.
pub struct Signing {
    pub key: keys::SigningKey,
    pub keys: keys::KeySet,
    pub checkpoints: std::sync::Arc<checkpoint::CheckpointWriter>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_hash_matches_the_seed_client() {
        // python: hashlib.sha256(f"{cmd} {' '.join(args)}".encode()).hexdigest()
        assert_eq!(
            command_hash("ls", &["-la".into(), "/tmp".into()]),
            format!("sha256:{}", hex::encode(Sha256::digest(b"ls -la /tmp")))
        );
        assert_eq!(
            command_hash("echo", &[]),
            format!("sha256:{}", hex::encode(Sha256::digest(b"echo ")))
        );
    }

    #[test]
    fn canonical_json_sorts_keys() {
        let v = serde_json::json!({"b": 1, "a": {"d": 2, "c": 3}});
        assert_eq!(canonical_json(&v), r#"{"a":{"c":3,"d":2},"b":1}"#);
    }
}
