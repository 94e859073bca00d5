//! DSSE (Dead Simple Signing Envelope, v1.0.2): the signature a receipt travels in.
//!
//! The signature is Ed25519 over `PAE(payloadType, payload)`, the pre-authentication encoding
//! `"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body` (ASCII decimal byte lengths), never over
//! the JSON. The envelope is `{"payload", "payloadType", "signatures": [{"keyid", "sig"}]}` with
//! standard base64; standard and URL-safe base64, padded or not, are read.
//!
//! `keyid` is only a hint that narrows which key to try (DSSE: it is not authenticated): a
//! signature with a keyid is tried with that key alone, one without with every key.
//!
//! Owns: PAE, the envelope's JSON, signing and checking signatures. Must not: interpret the payload.

use base64::Engine;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig, general_purpose};
use ed25519_dalek::{Signature, Signer};
use serde::{Deserialize, Serialize};

use super::keys::{KeySet, SigningKey, keyid};

/// The payload type of an in-toto statement.
pub const IN_TOTO_PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";

/// Envelopes larger than this are not read (a receipt is a few KiB).
pub const MAX_ENVELOPE_BYTES: usize = 4 << 20;

/// `PAE(type, body)` of DSSE v1.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload_type.len() + payload.len() + 32);
    out.extend_from_slice(b"DSSEv1 ");
    out.extend_from_slice(payload_type.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload_type.as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload);
    out
}

/// A DSSE JSON envelope. Fields it does not know are ignored (DSSE: consumers MUST).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// base64 of the payload.
    pub payload: String,
    #[serde(rename = "payloadType")]
    pub payload_type: String,
    pub signatures: Vec<EnvelopeSignature>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeSignature {
    /// Unset reads as empty (DSSE).
    #[serde(default)]
    pub keyid: String,
    /// base64 of the signature.
    pub sig: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("not a DSSE envelope: {0}")]
    Malformed(String),
    #[error("payloadType is {found:?}, not {expected:?}")]
    PayloadType { found: String, expected: String },
    #[error("the envelope has no signature")]
    NoSignature,
    #[error(
        "no signature by a known key: the envelope is signed by keyid(s) {found:?}, the \
         verification keys are {known:?}"
    )]
    UnknownKey {
        found: Vec<String>,
        known: Vec<String>,
    },
    /// `keyid` is empty for a signature that names no key (every key was tried).
    #[error("{}", bad_signature(keyid))]
    BadSignature { keyid: String },
    #[error("the payload is not a receipt: {0}")]
    Statement(String),
}

fn bad_signature(keyid: &str) -> String {
    if keyid.is_empty() {
        "no verification key verifies the signature, which names no keyid: the payload or the \
         signature was altered, or another key signed it"
            .into()
    } else {
        format!(
            "the signature of key {keyid} does not verify: the payload or the signature was altered"
        )
    }
}

/// Signs `payload` as `payload_type` with `key`.
pub fn sign(payload_type: &str, payload: &[u8], key: &SigningKey) -> Envelope {
    let sig = key.sign(&pae(payload_type, payload));
    Envelope {
        payload: general_purpose::STANDARD.encode(payload),
        payload_type: payload_type.to_string(),
        signatures: vec![EnvelopeSignature {
            keyid: keyid(&key.verifying_key()),
            sig: general_purpose::STANDARD.encode(sig.to_bytes()),
        }],
    }
}

/// Parses an envelope's JSON.
pub fn parse(bytes: &[u8]) -> Result<Envelope, VerifyError> {
    if bytes.len() > MAX_ENVELOPE_BYTES {
        return Err(VerifyError::Malformed(format!(
            "{} bytes, more than {MAX_ENVELOPE_BYTES}",
            bytes.len()
        )));
    }
    serde_json::from_slice(bytes).map_err(|e| VerifyError::Malformed(e.to_string()))
}

/// What a verified envelope holds: the payload bytes that were checked (never re-read from the
/// envelope) and the keyid whose signature verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub payload: Vec<u8>,
    pub keyid: String,
}

/// Checks that `env` is of `payload_type` and that at least one signature verifies over its PAE
/// with a key of `keys`.
pub fn verify(env: &Envelope, payload_type: &str, keys: &KeySet) -> Result<Verified, VerifyError> {
    if env.payload_type != payload_type {
        return Err(VerifyError::PayloadType {
            found: env.payload_type.clone(),
            expected: payload_type.to_string(),
        });
    }
    let payload = decode_b64(&env.payload)
        .ok_or_else(|| VerifyError::Malformed("payload is not base64".into()))?;
    if env.signatures.is_empty() {
        return Err(VerifyError::NoSignature);
    }
    let message = pae(&env.payload_type, &payload);
    let mut failed = None;
    for s in &env.signatures {
        let candidates: Vec<(&str, _)> = if s.keyid.is_empty() {
            keys.iter().collect()
        } else {
            keys.get(&s.keyid)
                .map(|k| (s.keyid.as_str(), k))
                .into_iter()
                .collect()
        };
        for (id, key) in candidates {
            let ok = decode_b64(&s.sig)
                .and_then(|b| Signature::from_slice(&b).ok())
                .is_some_and(|sig| key.verify_strict(&message, &sig).is_ok());
            if ok {
                return Ok(Verified {
                    payload,
                    keyid: id.to_string(),
                });
            }
            failed.get_or_insert_with(|| s.keyid.clone());
        }
    }
    match failed {
        Some(keyid) => Err(VerifyError::BadSignature { keyid }),
        None => Err(VerifyError::UnknownKey {
            found: env.signatures.iter().map(|s| s.keyid.clone()).collect(),
            known: keys.keyids().into_iter().map(String::from).collect(),
        }),
    }
}

/// Standard or URL-safe base64, padded or not (DSSE: verifiers MUST accept either).
pub(crate) fn decode_b64(s: &str) -> Option<Vec<u8>> {
    const CONFIG: GeneralPurposeConfig =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    const STANDARD: GeneralPurpose = GeneralPurpose::new(&base64::alphabet::STANDARD, CONFIG);
    const URL_SAFE: GeneralPurpose = GeneralPurpose::new(&base64::alphabet::URL_SAFE, CONFIG);
    STANDARD.decode(s).or_else(|_| URL_SAFE.decode(s)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pae_matches_the_spec_test_vector() {
        // DSSE protocol.md "Test Vectors" and implementation/signing_spec.py:
        // PAE('http://example.com/HelloWorld', b'hello world')
        //   == b'DSSEv1 29 http://example.com/HelloWorld 11 hello world'
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
        );
    }

    #[test]
    fn pae_lengths_are_byte_counts_in_decimal_without_leading_zeros() {
        assert_eq!(pae("", b""), b"DSSEv1 0  0 ");
        // Multi-byte UTF-8 counts bytes, not characters; a body holding spaces and digits cannot
        // shift the boundary.
        assert_eq!(pae("é", b"1 2"), "DSSEv1 2 é 3 1 2".as_bytes());
        let body = vec![b'x'; 1234];
        let p = pae("t", &body);
        assert!(p.starts_with(b"DSSEv1 1 t 1234 xx"));
        assert_eq!(p.len(), "DSSEv1 1 t 1234 ".len() + 1234);
    }

    #[test]
    fn the_spec_example_envelope_parses_and_its_payload_decodes() {
        // DSSE protocol.md "Result": its signature is ECDSA P-256 (not ours), so only the
        // envelope's shape and base64 are checked here.
        let e = parse(br#"{"payload": "aGVsbG8gd29ybGQ=",
 "payloadType": "http://example.com/HelloWorld",
 "signatures": [{"sig": "A3JqsQGtVsJ2O2xqrI5IcnXip5GToJ3F+FnZ+O88SjtR6rDAajabZKciJTfUiHqJPcIAriEGAHTVeCUjW2JIZA=="}]}"#).unwrap();
        assert_eq!(decode_b64(&e.payload).unwrap(), b"hello world");
        assert_eq!(e.signatures[0].keyid, "");
        assert_eq!(decode_b64(&e.signatures[0].sig).unwrap().len(), 64);
    }

    #[test]
    fn an_envelope_is_what_an_independent_dsse_signer_makes() {
        // Computed with Python `cryptography` (Ed25519PrivateKey.from_private_bytes(bytes([1]*32)))
        // signing the DSSE reference implementation's PAE (implementation/signing_spec.py):
        //   sig = k.sign(b'DSSEv1 %d %b %d %b' % (28, b'application/vnd.in-toto+json', 7, b'{"a":1}'))
        //   keyid = sha256(raw public key).hexdigest()
        let env = sign(
            IN_TOTO_PAYLOAD_TYPE,
            br#"{"a":1}"#,
            &SigningKey::from_bytes(&[1u8; 32]),
        );
        assert_eq!(
            env,
            Envelope {
                payload: "eyJhIjoxfQ==".into(),
                payload_type: IN_TOTO_PAYLOAD_TYPE.into(),
                signatures: vec![EnvelopeSignature {
                    keyid: "34750f98bd59fcfc946da45aaabe933be154a4b5094e1c4abf42866505f3c97e"
                        .into(),
                    sig: "hnRWfVwgwUEyaqmeDERer317/PZ4tLcnJETrpxDg6FowIHVyXUXrQyvvL5GH98aq27DAcIy6Y7pk9ZPb3430DA=="
                        .into(),
                }],
            }
        );
    }

    fn keys(k: &SigningKey) -> KeySet {
        std::iter::once(k.verifying_key()).collect()
    }

    #[test]
    fn sign_then_verify_round_trips_and_reads_either_base64() {
        let k = SigningKey::from_bytes(&[1u8; 32]);
        let env = sign(IN_TOTO_PAYLOAD_TYPE, b"{\"a\":1}", &k);
        let v = verify(&env, IN_TOTO_PAYLOAD_TYPE, &keys(&k)).unwrap();
        assert_eq!(v.payload, b"{\"a\":1}");
        assert_eq!(v.keyid, keyid(&k.verifying_key()));
        // The same envelope in URL-safe base64 without padding, and with no keyid.
        let url = GeneralPurpose::new(
            &base64::alphabet::URL_SAFE,
            base64::engine::general_purpose::NO_PAD,
        );
        let mut e2 = env.clone();
        e2.payload = url.encode(b"{\"a\":1}");
        e2.signatures[0].sig = url.encode(decode_b64(&env.signatures[0].sig).unwrap());
        e2.signatures[0].keyid.clear();
        assert_eq!(
            verify(&e2, IN_TOTO_PAYLOAD_TYPE, &keys(&k))
                .unwrap()
                .payload,
            b"{\"a\":1}"
        );
        // Unknown fields are ignored, a missing keyid reads as empty.
        let json = format!(
            r#"{{"payload":"{}","payloadType":"{IN_TOTO_PAYLOAD_TYPE}","signatures":[{{"sig":"{}","x":1}}],"extra":true}}"#,
            env.payload, env.signatures[0].sig
        );
        let e3 = parse(json.as_bytes()).unwrap();
        assert!(verify(&e3, IN_TOTO_PAYLOAD_TYPE, &keys(&k)).is_ok());
    }

    #[test]
    fn every_one_byte_change_of_payload_or_signature_fails() {
        let k = SigningKey::from_bytes(&[2u8; 32]);
        let ks = keys(&k);
        let payload = b"{\"predicate\":{\"exit_code\":0}}".to_vec();
        let env = sign(IN_TOTO_PAYLOAD_TYPE, &payload, &k);
        for i in 0..payload.len() {
            let mut p = payload.clone();
            p[i] ^= 0x01;
            let mut e = env.clone();
            e.payload = general_purpose::STANDARD.encode(&p);
            assert_eq!(
                verify(&e, IN_TOTO_PAYLOAD_TYPE, &ks),
                Err(VerifyError::BadSignature {
                    keyid: env.signatures[0].keyid.clone()
                }),
                "payload byte {i}"
            );
        }
        let sig = decode_b64(&env.signatures[0].sig).unwrap();
        for i in 0..sig.len() {
            let mut s = sig.clone();
            s[i] ^= 0x01;
            let mut e = env.clone();
            e.signatures[0].sig = general_purpose::STANDARD.encode(&s);
            let err = verify(&e, IN_TOTO_PAYLOAD_TYPE, &ks).unwrap_err();
            assert!(
                matches!(err, VerifyError::BadSignature { .. }),
                "sig byte {i}: {err}"
            );
        }
        // The type is signed too.
        let mut e = env.clone();
        e.payload_type = "application/vnd.in-toto+jsoN".into();
        assert!(verify(&e, &e.payload_type.clone(), &ks).is_err());
        assert!(matches!(
            verify(&e, IN_TOTO_PAYLOAD_TYPE, &ks),
            Err(VerifyError::PayloadType { .. })
        ));
    }

    #[test]
    fn a_changed_keyid_or_an_unknown_key_fails_naming_the_keyids() {
        let k = SigningKey::from_bytes(&[3u8; 32]);
        let env = sign(IN_TOTO_PAYLOAD_TYPE, b"x", &k);
        let id = env.signatures[0].keyid.clone();
        for i in 0..id.len() {
            let mut b = id.clone().into_bytes();
            b[i] = if b[i] == b'0' { b'1' } else { b'0' };
            let mut e = env.clone();
            e.signatures[0].keyid = String::from_utf8(b).unwrap();
            let err = verify(&e, IN_TOTO_PAYLOAD_TYPE, &keys(&k)).unwrap_err();
            assert!(
                matches!(err, VerifyError::UnknownKey { .. }),
                "keyid char {i}: {err}"
            );
            assert!(err.to_string().contains(&id), "{err}");
        }
        // Signed by a key that is not in the set: refused, even without a keyid hint.
        let other = keys(&SigningKey::from_bytes(&[4u8; 32]));
        assert!(matches!(
            verify(&env, IN_TOTO_PAYLOAD_TYPE, &other),
            Err(VerifyError::UnknownKey { .. })
        ));
        let mut e = env.clone();
        e.signatures[0].keyid.clear();
        let err = verify(&e, IN_TOTO_PAYLOAD_TYPE, &other).unwrap_err();
        assert_eq!(
            err,
            VerifyError::BadSignature {
                keyid: String::new()
            }
        );
        assert!(err.to_string().contains("names no keyid"), "{err}");
        // With several keys (a rotation), the one that signed is found.
        let both: KeySet = [
            SigningKey::from_bytes(&[4u8; 32]).verifying_key(),
            k.verifying_key(),
        ]
        .into_iter()
        .collect();
        assert_eq!(verify(&env, IN_TOTO_PAYLOAD_TYPE, &both).unwrap().keyid, id);
        let mut none = env.clone();
        none.signatures.clear();
        assert_eq!(
            verify(&none, IN_TOTO_PAYLOAD_TYPE, &both),
            Err(VerifyError::NoSignature)
        );
    }
}
