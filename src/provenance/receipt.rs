//! Execution receipts: an in-toto Statement v1 about one finished run, signed in a DSSE envelope.
//!
//! Subjects are the run's artefacts by SHA-256: `command` (`command_hash`), `code` (a session
//! exec's `code_sha256`), `stdout`, `stderr`. The predicate (`urn:executor-arm:receipt:v1`) says
//! who ran it, what ran and how it was confined, how it ended, when, and which audit line records
//! its end (`audit_seq`, that line's `entry_hash`). Field names are those of the run's result and
//! audit line.
//!
//! Owns: the statement's types, signing and verifying one. Must not: build a receipt from a run
//! (the execution service does: this module knows no request, plan or sandbox type).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::dsse::{self, Envelope, IN_TOTO_PAYLOAD_TYPE, VerifyError};
use super::keys::{KeySet, SigningKey};
use crate::egress::ConnRecord;

pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "urn:executor-arm:receipt:v1";

/// Subject names.
pub const SUBJECT_COMMAND: &str = "command";
pub const SUBJECT_CODE: &str = "code";
pub const SUBJECT_STDOUT: &str = "stdout";
pub const SUBJECT_STDERR: &str = "stderr";

/// An in-toto Statement v1 whose predicate is a receipt. Fields it does not know are ignored
/// (in-toto: consumers MUST).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Statement {
    #[serde(rename = "_type")]
    pub statement_type: String,
    pub subject: Vec<Subject>,
    #[serde(rename = "predicateType")]
    pub predicate_type: String,
    pub predicate: Receipt,
}

impl Statement {
    /// A statement of `receipt` about `subject`.
    pub fn new(subject: Vec<Subject>, receipt: Receipt) -> Statement {
        Statement {
            statement_type: STATEMENT_TYPE.to_string(),
            subject,
            predicate_type: PREDICATE_TYPE.to_string(),
            predicate: receipt,
        }
    }

    /// The subject called `name`'s SHA-256 (hex), if any.
    pub fn subject_sha256(&self, name: &str) -> Option<&str> {
        self.subject
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.digest.get("sha256"))
            .map(String::as_str)
    }
}

/// An in-toto ResourceDescriptor with a name and digests (`{"sha256": "<hex>"}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subject {
    pub name: String,
    pub digest: BTreeMap<String, String>,
}

impl Subject {
    /// `name` with a SHA-256 given as `sha256:<hex>` (how executor-arm writes hashes) or bare hex;
    /// in-toto digests are bare lowercase hex.
    pub fn sha256(name: &str, hash: &str) -> Subject {
        let hex = hash.strip_prefix("sha256:").unwrap_or(hash);
        Subject {
            name: name.to_string(),
            digest: BTreeMap::from([("sha256".to_string(), hex.to_ascii_lowercase())]),
        }
    }
}

/// The predicate: who, what, result, when, and the audit line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub who: Who,
    pub what: What,
    pub result: RunResult,
    pub when: When,
    pub audit: AuditPosition,
}

/// Who asked for the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Who {
    /// The calling service's subject.
    pub subject: Option<String>,
    /// The capability token's id (`jti`).
    pub token_id: Option<String>,
    /// The tenant (sessions), if any.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// What ran, where and under which limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct What {
    pub exec_id: String,
    pub request_id: String,
    /// `shell`, `python`, `external`, …
    pub action_type: String,
    pub command_hash: String,
    pub invocation_hash: String,
    pub profile: String,
    /// `local`, `docker`, `gvisor`.
    pub backend: String,
    pub limits: RunLimits,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_def_sha256: Option<String>,
}

/// The limits the run got (the tightest of profile, token and request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunLimits {
    pub timeout_seconds: u64,
    pub cpus: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    pub pids: u64,
    pub output_bytes: u64,
    /// `truncate` or `kill`.
    pub on_overflow: String,
    pub nofile: u64,
}

/// How the run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunResult {
    /// `success`, `failed`, `timeout`, `cancelled`, `oom`.
    pub outcome: String,
    pub exit_code: i32,
    pub killed_reason: Option<String>,
    pub duration_ms: u64,
    pub peak_memory_kib: Option<u64>,
    pub oom: bool,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// External executions: the executor's error code, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// Every connection through the egress proxy (empty without network).
    #[serde(default)]
    pub network: Vec<ConnRecord>,
}

/// RFC 3339 UTC times.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct When {
    pub started_at: String,
    pub ended_at: String,
}

/// The audit line that records the run's end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditPosition {
    pub audit_seq: u64,
    /// `sha256:<hex>`, as on the line.
    pub entry_hash: String,
}

/// Signs `statement` (its JSON is the payload) with `key`.
pub fn sign_receipt(
    statement: &Statement,
    key: &SigningKey,
) -> Result<Envelope, serde_json::Error> {
    let payload = serde_json::to_vec(statement)?;
    Ok(dsse::sign(IN_TOTO_PAYLOAD_TYPE, &payload, key))
}

/// Checks `env` (type, a signature by a key of `keys`) and reads the statement from the bytes
/// that were verified.
pub fn verify_receipt(env: &Envelope, keys: &KeySet) -> Result<Statement, VerifyError> {
    let v = dsse::verify(env, IN_TOTO_PAYLOAD_TYPE, keys)?;
    let st: Statement =
        serde_json::from_slice(&v.payload).map_err(|e| VerifyError::Statement(e.to_string()))?;
    if st.statement_type != STATEMENT_TYPE {
        return Err(VerifyError::Statement(format!(
            "_type is {:?}, not {STATEMENT_TYPE:?}",
            st.statement_type
        )));
    }
    if st.predicate_type != PREDICATE_TYPE {
        return Err(VerifyError::Statement(format!(
            "predicateType is {:?}, not {PREDICATE_TYPE:?}",
            st.predicate_type
        )));
    }
    Ok(st)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;

    pub(crate) fn statement() -> Statement {
        Statement::new(
            vec![
                Subject::sha256(SUBJECT_COMMAND, "sha256:AB01"),
                Subject::sha256(SUBJECT_STDOUT, "sha256:cd02"),
                Subject::sha256(SUBJECT_STDERR, "ef03"),
            ],
            Receipt {
                who: Who {
                    subject: Some("orchestrator".into()),
                    token_id: Some("jti-1".into()),
                    tenant: None,
                },
                what: What {
                    exec_id: "exec-1".into(),
                    request_id: "req-1".into(),
                    action_type: "shell".into(),
                    command_hash: "sha256:ab01".into(),
                    invocation_hash: "sha256:99".into(),
                    profile: "shell-readonly".into(),
                    backend: "local".into(),
                    limits: RunLimits {
                        timeout_seconds: 30,
                        cpus: 1.0,
                        memory_bytes: 256 << 20,
                        disk_bytes: 64 << 20,
                        pids: 64,
                        output_bytes: 1 << 20,
                        on_overflow: "truncate".into(),
                        nofile: 256,
                    },
                    session_id: None,
                    executor_def_sha256: None,
                },
                result: RunResult {
                    outcome: "success".into(),
                    exit_code: 0,
                    killed_reason: None,
                    duration_ms: 4,
                    peak_memory_kib: Some(768),
                    oom: false,
                    stdout_truncated: false,
                    stderr_truncated: false,
                    error_code: None,
                    network: vec![ConnRecord {
                        host: "example.org".into(),
                        port: 443,
                        method: "CONNECT".into(),
                        allowed: true,
                        status: Some(200),
                        ..Default::default()
                    }],
                },
                when: When {
                    started_at: "2026-01-01T00:00:00.000Z".into(),
                    ended_at: "2026-01-01T00:00:00.004Z".into(),
                },
                audit: AuditPosition {
                    audit_seq: 42,
                    entry_hash: format!("sha256:{}", "0".repeat(64)),
                },
            },
        )
    }

    #[test]
    fn a_signed_receipt_verifies_and_reads_back_the_same_statement() {
        let k = SigningKey::from_bytes(&[9u8; 32]);
        let st = statement();
        let env = sign_receipt(&st, &k).unwrap();
        assert_eq!(env.payload_type, "application/vnd.in-toto+json");
        let keys: KeySet = std::iter::once(k.verifying_key()).collect();
        assert_eq!(verify_receipt(&env, &keys).unwrap(), st);
        // The wire names in-toto and DSSE expect.
        let v: serde_json::Value =
            serde_json::from_slice(&STANDARD.decode(&env.payload).unwrap()).unwrap();
        assert_eq!(v["_type"], STATEMENT_TYPE);
        assert_eq!(v["predicateType"], PREDICATE_TYPE);
        assert_eq!(
            v["subject"][0],
            serde_json::json!({"name": "command", "digest": {"sha256": "ab01"}})
        );
        assert_eq!(v["predicate"]["audit"]["audit_seq"], 42);
        assert_eq!(
            v["predicate"]["result"]["network"][0]["host"],
            "example.org"
        );
        assert_eq!(st.subject_sha256(SUBJECT_STDOUT), Some("cd02"));
    }

    #[test]
    fn a_validly_signed_payload_that_is_not_a_receipt_is_refused() {
        let k = SigningKey::from_bytes(&[9u8; 32]);
        let keys: KeySet = std::iter::once(k.verifying_key()).collect();
        let mut other = serde_json::to_value(statement()).unwrap();
        other["predicateType"] = "https://slsa.dev/provenance/v1".into();
        let env = dsse::sign(IN_TOTO_PAYLOAD_TYPE, other.to_string().as_bytes(), &k);
        let e = verify_receipt(&env, &keys).unwrap_err();
        assert!(e.to_string().contains("predicateType"), "{e}");
        let env = dsse::sign(IN_TOTO_PAYLOAD_TYPE, b"[]", &k);
        assert!(matches!(
            verify_receipt(&env, &keys),
            Err(VerifyError::Statement(_))
        ));
        let env = dsse::sign("application/json", b"{}", &k);
        assert!(matches!(
            verify_receipt(&env, &keys),
            Err(VerifyError::PayloadType { .. })
        ));
    }
}
