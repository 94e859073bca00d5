//! Authentication: service tokens (who calls) and capability tokens (what this call may do).
//!
//! Owns: JWT verification with the algorithm pinned by the key (never read from the token),
//! static `tok_…` tokens stored as SHA-256 and compared in constant time, lifetime and claim
//! checks, and minting for development. Single-use replay is checked by the caller against the
//! state store after verification ([`SingleUse`]). Must not: know commands, profiles or sandboxes.

use std::collections::BTreeMap;
use std::path::Path;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AuthConfig, TokenKind};
use crate::policy::Grant;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// Any verification failure; the detail goes to the audit log, never to the caller.
    #[error("{0}")]
    Rejected(String),
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("key {kid}: {message}")]
    Bad { kid: String, message: String },
}

fn rejected(msg: impl Into<String>) -> AuthError {
    AuthError::Rejected(msg.into())
}

/// Claims of both token kinds (a service token simply carries no capabilities).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Claims {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<serde_json::Value>,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// `service` or `capability`: a token of one kind is never accepted as the other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_use: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commands: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiles: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_timeout_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub single_use: bool,
}

/// A verified token.
#[derive(Debug, Clone)]
pub struct Verified {
    pub subject: Option<String>,
    pub token_id: Option<String>,
    /// Set when the token is single-use: its jti must be claimed once in the replay store.
    pub single_use: Option<SingleUse>,
    pub grant: Grant,
}

/// A single-use token's identity, as the replay store needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SingleUse {
    pub kind: TokenKind,
    pub jti: String,
    /// When the token was issued (unix seconds); a store that cannot vouch for the time before it
    /// started refuses tokens without it.
    pub iat: Option<u64>,
    pub exp: u64,
}

impl SingleUse {
    /// The replay-store key: service and capability jtis live in separate namespaces, so one kind
    /// of token can never use up (or be refused because of) the other's jti.
    pub fn replay_key(&self) -> String {
        let ns = match self.kind {
            TokenKind::Service => "service",
            TokenKind::Capability => "capability",
        };
        format!("{ns}:{}", self.jti)
    }

    /// True when the token may have been issued before `horizon` (unix seconds), so a replay store
    /// whose record starts at `horizon` cannot tell whether it was used.
    pub fn may_predate(&self, horizon: u64) -> bool {
        self.iat.is_none_or(|iat| iat < horizon)
    }
}

struct VerifyKey {
    alg: Algorithm,
    key: DecodingKey,
}

struct StaticToken {
    id: String,
    kind: TokenKind,
    digest: [u8; 32],
    capabilities: Vec<String>,
}

/// Holds the verification keys. Secrets live only inside `DecodingKey`s.
pub struct Authenticator {
    hs: Option<VerifyKey>,
    by_kid: BTreeMap<String, VerifyKey>,
    statics: Vec<StaticToken>,
    audience: String,
    issuer: Option<String>,
    max_ttl: u64,
    leeway: u64,
}

fn parse_alg(kid: &str, s: &str) -> Result<Algorithm, KeyError> {
    match s {
        "RS256" => Ok(Algorithm::RS256),
        "ES256" => Ok(Algorithm::ES256),
        "EdDSA" => Ok(Algorithm::EdDSA),
        other => Err(KeyError::Bad {
            kid: kid.into(),
            message: format!("unsupported alg '{other}' (RS256, ES256, EdDSA)"),
        }),
    }
}

/// Reads a secret file; a trailing newline is not part of the secret.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, KeyError> {
    let mut s = std::fs::read(path).map_err(|source| KeyError::Read {
        path: path.display().to_string(),
        source,
    })?;
    while s.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        s.pop();
    }
    if s.len() < 32 {
        return Err(KeyError::Bad {
            kid: path.display().to_string(),
            message: "HS256 secret must be at least 32 bytes".into(),
        });
    }
    Ok(s)
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// At most `max` characters of `text` (then `…`), for a refusal reason that quotes what a caller
/// sent: an unauthenticated peer must not set the size of the audit line it causes.
pub fn clip(text: &str, max: usize) -> String {
    let mut out: String = text.chars().take(max).collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Static tokens are `tok_` + alphanumerics.
pub fn is_static_token(t: &str) -> bool {
    t.len() > 4
        && t.len() <= 256
        && t.starts_with("tok_")
        && t[4..].bytes().all(|b| b.is_ascii_alphanumeric())
}

impl Authenticator {
    pub fn new(cfg: &AuthConfig) -> Result<Self, KeyError> {
        let hs = match &cfg.jwt_secret_file {
            Some(p) => Some(VerifyKey {
                alg: Algorithm::HS256,
                key: DecodingKey::from_secret(&read_secret(p)?),
            }),
            None => None,
        };
        let mut by_kid = BTreeMap::new();
        for k in &cfg.public_keys {
            let alg = parse_alg(&k.kid, &k.alg)?;
            let pem = std::fs::read(&k.pem_file).map_err(|source| KeyError::Read {
                path: k.pem_file.display().to_string(),
                source,
            })?;
            let key = match alg {
                Algorithm::RS256 => DecodingKey::from_rsa_pem(&pem),
                Algorithm::ES256 => DecodingKey::from_ec_pem(&pem),
                _ => DecodingKey::from_ed_pem(&pem),
            }
            .map_err(|e| KeyError::Bad {
                kid: k.kid.clone(),
                message: e.to_string(),
            })?;
            by_kid.insert(k.kid.clone(), VerifyKey { alg, key });
        }
        if let Some(path) = &cfg.jwks_file {
            let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let set: jsonwebtoken::jwk::JwkSet =
                serde_json::from_str(&text).map_err(|e| KeyError::Bad {
                    kid: path.display().to_string(),
                    message: e.to_string(),
                })?;
            for jwk in &set.keys {
                let kid = jwk.common.key_id.clone().ok_or_else(|| KeyError::Bad {
                    kid: "?".into(),
                    message: "JWKS key without kid".into(),
                })?;
                let alg = match &jwk.algorithm {
                    jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
                    jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => Algorithm::ES256,
                    jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
                    _ => {
                        return Err(KeyError::Bad {
                            kid,
                            message: "symmetric keys are not accepted from JWKS".into(),
                        });
                    }
                };
                let key = DecodingKey::from_jwk(jwk).map_err(|e| KeyError::Bad {
                    kid: kid.clone(),
                    message: e.to_string(),
                })?;
                by_kid.insert(kid, VerifyKey { alg, key });
            }
        }
        let statics = cfg
            .static_tokens
            .iter()
            .map(|t| {
                let mut digest = [0u8; 32];
                hex::decode_to_slice(&t.sha256, &mut digest).map_err(|e| KeyError::Bad {
                    kid: t.id.clone(),
                    message: e.to_string(),
                })?;
                Ok(StaticToken {
                    id: t.id.clone(),
                    kind: t.kind,
                    digest,
                    capabilities: t
                        .capabilities
                        .iter()
                        .map(|c| c.as_str().to_string())
                        .collect(),
                })
            })
            .collect::<Result<_, KeyError>>()?;
        Ok(Authenticator {
            hs,
            by_kid,
            statics,
            audience: cfg.audience.clone(),
            issuer: cfg.issuer.clone(),
            max_ttl: cfg.max_ttl_seconds,
            leeway: cfg.leeway_seconds,
        })
    }

    pub fn has_keys(&self) -> bool {
        self.hs.is_some() || !self.by_kid.is_empty() || !self.statics.is_empty()
    }

    /// Verifies a token of `kind` (JWT or static).
    #[tracing::instrument(name = "auth", skip_all, fields(token_kind = ?kind))]
    pub fn verify(&self, token: &str, kind: TokenKind) -> Result<Verified, AuthError> {
        if token.is_empty() || token.len() > 8192 {
            return Err(rejected("token missing or oversized"));
        }
        if is_static_token(token) {
            return self.verify_static(token, kind);
        }
        self.verify_jwt(token, kind)
    }

    fn verify_static(&self, token: &str, kind: TokenKind) -> Result<Verified, AuthError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // Compare against every entry without early exit, so timing says nothing about which
        // (or whether any) entry matched.
        let mut found: Option<&StaticToken> = None;
        for s in &self.statics {
            let eq: bool = s.digest.ct_eq(&digest).into();
            if eq && s.kind == kind {
                found = Some(s);
            }
        }
        let s = found.ok_or_else(|| rejected("unknown static token"))?;
        check_subject(Some(&s.id), kind)?;
        Ok(Verified {
            subject: Some(s.id.clone()),
            token_id: Some(s.id.clone()),
            single_use: None,
            grant: Grant {
                capabilities: s.capabilities.clone(),
                ..Default::default()
            },
        })
    }

    fn verify_jwt(&self, token: &str, kind: TokenKind) -> Result<Verified, AuthError> {
        refuse_critical_extensions(token)?;
        // The header is read only to pick the key by kid; the algorithm comes from the key.
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| rejected(format!("malformed token header: {e}")))?;
        let vk = match &header.kid {
            Some(kid) => self.by_kid.get(kid).ok_or_else(|| {
                rejected(format!(
                    "unknown kid '{}'",
                    clip(&kid.escape_debug().to_string(), 64)
                ))
            })?,
            None => self
                .hs
                .as_ref()
                .ok_or_else(|| rejected("token has no kid and no HS256 secret is configured"))?,
        };
        if header.alg != vk.alg {
            return Err(rejected(format!(
                "token alg {:?} does not match the key's {:?}",
                header.alg, vk.alg
            )));
        }
        let mut v = Validation::new(vk.alg);
        v.leeway = self.leeway;
        v.validate_exp = true;
        v.validate_nbf = true;
        v.set_audience(&[&self.audience]);
        if let Some(iss) = &self.issuer {
            // A token without `iss` is not from the configured issuer.
            v.set_required_spec_claims(&["exp", "aud", "iss"]);
            v.set_issuer(&[iss]);
        } else {
            v.set_required_spec_claims(&["exp", "aud"]);
        }
        let data = jsonwebtoken::decode::<Claims>(token, &vk.key, &v)
            .map_err(|e| rejected(format!("token rejected: {e}")))?;
        let c = data.claims;
        let now = now();
        let remaining = c.exp.saturating_sub(now);
        let lifetime = c
            .iat
            .map(|iat| c.exp.saturating_sub(iat))
            .unwrap_or(remaining);
        if remaining > self.max_ttl + self.leeway || lifetime > self.max_ttl + self.leeway {
            return Err(rejected(format!(
                "token lifetime exceeds the maximum of {}s",
                self.max_ttl
            )));
        }
        if c.iat.is_some_and(|iat| iat > now + self.leeway) {
            return Err(rejected("token issued in the future"));
        }
        check_token_use(c.token_use.as_deref(), kind)?;
        check_subject(c.sub.as_deref(), kind)?;
        let single_use = if c.single_use {
            let jti = c
                .jti
                .clone()
                .filter(|j| !j.is_empty() && j.len() <= 256)
                .ok_or_else(|| rejected("single-use token without jti"))?;
            Some(SingleUse {
                kind,
                jti,
                iat: c.iat,
                exp: c.exp,
            })
        } else {
            None
        };
        Ok(Verified {
            subject: c.sub.clone(),
            token_id: c.jti.clone(),
            single_use,
            grant: Grant {
                capabilities: c.capabilities,
                commands: c.commands,
                profiles: c.profiles,
                max_timeout_seconds: c.max_timeout_seconds,
            },
        })
    }
}

/// RFC 7515 §4.1.11: a recipient must reject a JWS whose `crit` header names extensions it does
/// not understand, and this daemon understands none. The JOSE header is decoded here, as the JWT
/// library does not expose `crit`.
fn refuse_critical_extensions(token: &str) -> Result<(), AuthError> {
    use base64::Engine as _;
    let encoded = token.split('.').next().unwrap_or_default();
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded.trim_end_matches('='))
        .map_err(|e| rejected(format!("malformed token header: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&raw)
        .map_err(|e| rejected(format!("malformed token header: {e}")))?;
    if header.contains_key("crit") {
        return Err(rejected(
            "token header has \"crit\": no JWS extension is understood here (RFC 7515 §4.1.11)",
        ));
    }
    Ok(())
}

/// The token's subject names an owner (of runs, sessions, Idempotency-Keys): a service token
/// must have one, non-empty, and no token's subject may hold a control character (owner keys
/// are composed from it, and audit lines quote it).
fn check_subject(sub: Option<&str>, kind: TokenKind) -> Result<(), AuthError> {
    match sub {
        Some(s) if s.chars().any(char::is_control) => Err(rejected(format!(
            "token subject '{}' has a control character",
            clip(&s.escape_debug().to_string(), 64)
        ))),
        Some("") | None if kind == TokenKind::Service => {
            Err(rejected("a service token must name its subject (sub)"))
        }
        _ => Ok(()),
    }
}

/// A service JWT must say `token_use: "service"`: a token minted for anything else (a capability
/// token, which may carry no `token_use`) never authenticates a caller. A capability
/// JWT may omit the claim, but one that names another use is refused.
fn check_token_use(token_use: Option<&str>, kind: TokenKind) -> Result<(), AuthError> {
    match (kind, token_use) {
        (TokenKind::Service, Some("service")) => Ok(()),
        (TokenKind::Service, None) => {
            Err(rejected("a service token must carry token_use \"service\""))
        }
        (TokenKind::Capability, None | Some("capability")) => Ok(()),
        (_, Some(other)) => Err(rejected(format!(
            "a token with token_use '{}' is not a {} token",
            other.escape_debug(),
            match kind {
                TokenKind::Service => "service",
                TokenKind::Capability => "capability",
            }
        ))),
    }
}

/// What `token mint` puts into a token.
#[derive(Debug, Clone, Default)]
pub struct MintRequest {
    pub kind: Option<TokenKind>,
    pub capabilities: Vec<String>,
    pub ttl_seconds: u64,
    pub sub: Option<String>,
    pub aud: String,
    pub iss: Option<String>,
    pub single_use: bool,
    pub commands: Option<Vec<String>>,
    pub profiles: Option<Vec<String>>,
    pub max_timeout_seconds: Option<u64>,
}

/// Mints an HS256 token (development and tests).
pub fn mint_hs256(secret: &[u8], req: &MintRequest) -> Result<String, jsonwebtoken::errors::Error> {
    let now = now();
    let claims = Claims {
        iss: req.iss.clone(),
        sub: req.sub.clone(),
        aud: Some(serde_json::Value::String(req.aud.clone())),
        exp: now + req.ttl_seconds,
        nbf: Some(now),
        iat: Some(now),
        jti: Some(uuid::Uuid::new_v4().to_string()),
        token_use: req.kind.map(|k| match k {
            TokenKind::Service => "service".to_string(),
            TokenKind::Capability => "capability".to_string(),
        }),
        capabilities: req.capabilities.clone(),
        commands: req.commands.clone(),
        profiles: req.profiles.clone(),
        max_timeout_seconds: req.max_timeout_seconds,
        single_use: req.single_use,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-test";

    fn auth() -> Authenticator {
        auth_with_issuer(None)
    }

    fn auth_with_issuer(issuer: Option<&str>) -> Authenticator {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, SECRET).unwrap();
        let cfg = AuthConfig {
            jwt_secret_file: Some(f),
            audience: "executor-arm".into(),
            issuer: issuer.map(str::to_string),
            max_ttl_seconds: 3600,
            leeway_seconds: 5,
            public_keys: vec![],
            jwks_file: None,
            static_tokens: vec![crate::config::StaticTokenConfig {
                id: "orch".into(),
                kind: TokenKind::Capability,
                sha256: sha256_hex(b"tok_abc123xyz"),
                capabilities: vec![crate::policy::Capability::ShellRead],
            }],
        };
        Authenticator::new(&cfg).unwrap()
    }

    fn req() -> MintRequest {
        MintRequest {
            kind: Some(TokenKind::Capability),
            capabilities: vec!["ShellRead".into()],
            ttl_seconds: 60,
            aud: "executor-arm".into(),
            ..Default::default()
        }
    }

    fn b64(v: &serde_json::Value) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    }

    #[test]
    fn good_token_and_kind_separation() {
        let a = auth();
        let t = mint_hs256(SECRET, &req()).unwrap();
        assert_eq!(
            a.verify(&t, TokenKind::Capability)
                .unwrap()
                .grant
                .capabilities,
            vec!["ShellRead"]
        );
        assert!(a.verify(&t, TokenKind::Service).is_err());
    }

    #[test]
    fn an_unknown_kid_is_quoted_only_in_part() {
        let long = "A".repeat(5900);
        let header = b64(&serde_json::json!({"alg": "HS256", "kid": long}));
        let token = format!("{header}.e30.c2ln");
        let Err(e) = auth().verify(&token, TokenKind::Service) else {
            panic!("an unknown kid was accepted");
        };
        assert!(e.to_string().len() < 200, "{} bytes", e.to_string().len());
        assert_eq!(clip("abc", 2), "ab…");
        assert_eq!(clip("ab", 2), "ab");
    }

    #[test]
    fn attacks_fail() {
        let a = auth();
        let good = mint_hs256(SECRET, &req()).unwrap();
        let parts: Vec<&str> = good.split('.').collect();
        // alg none
        let none = format!(
            "{}.{}.",
            b64(&serde_json::json!({"alg":"none","typ":"JWT"})),
            parts[1]
        );
        assert!(a.verify(&none, TokenKind::Capability).is_err());
        // tampered payload
        let payload = b64(
            &serde_json::json!({"exp": now() + 60, "aud": "executor-arm", "capabilities": ["ShellExecute"]}),
        );
        assert!(
            a.verify(
                &format!("{}.{}.{}", parts[0], payload, parts[2]),
                TokenKind::Capability
            )
            .is_err()
        );
        // bad signature
        let other = mint_hs256(b"another-secret-another-secret-another", &req()).unwrap();
        assert!(a.verify(&other, TokenKind::Capability).is_err());
        // wrong aud, overlong ttl
        assert!(
            a.verify(
                &mint_hs256(
                    SECRET,
                    &MintRequest {
                        aud: "x".into(),
                        ..req()
                    }
                )
                .unwrap(),
                TokenKind::Capability
            )
            .is_err()
        );
        assert!(
            a.verify(
                &mint_hs256(
                    SECRET,
                    &MintRequest {
                        ttl_seconds: 7200,
                        ..req()
                    }
                )
                .unwrap(),
                TokenKind::Capability
            )
            .is_err()
        );
        // unknown kid
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("nope".into());
        let t = jsonwebtoken::encode(
            &h,
            &serde_json::json!({"exp": now() + 60, "aud": "executor-arm"}),
            &EncodingKey::from_secret(SECRET),
        )
        .unwrap();
        assert!(a.verify(&t, TokenKind::Capability).is_err());
        // missing exp, expired, nbf in future
        let enc = |c: serde_json::Value| {
            jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &c,
                &EncodingKey::from_secret(SECRET),
            )
            .unwrap()
        };
        assert!(
            a.verify(
                &enc(serde_json::json!({"aud": "executor-arm"})),
                TokenKind::Capability
            )
            .is_err()
        );
        assert!(
            a.verify(
                &enc(serde_json::json!({"aud": "executor-arm", "exp": now() - 100})),
                TokenKind::Capability
            )
            .is_err()
        );
        assert!(a.verify(&enc(serde_json::json!({"aud": "executor-arm", "exp": now() + 100, "nbf": now() + 60})), TokenKind::Capability).is_err());
        // single-use without jti
        assert!(a.verify(&enc(serde_json::json!({"aud": "executor-arm", "exp": now() + 100, "single_use": true})), TokenKind::Capability).is_err());
    }

    #[test]
    fn static_tokens() {
        let a = auth();
        assert_eq!(
            a.verify("tok_abc123xyz", TokenKind::Capability)
                .unwrap()
                .subject
                .as_deref(),
            Some("orch")
        );
        assert!(a.verify("tok_abc123xyy", TokenKind::Capability).is_err());
        assert!(a.verify("tok_abc123xyz", TokenKind::Service).is_err());
    }

    fn enc(c: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &c,
            &EncodingKey::from_secret(SECRET),
        )
        .unwrap()
    }

    #[test]
    fn configured_issuer_is_required_not_just_checked_when_present() {
        let a = auth_with_issuer(Some("orchestrator"));
        for kind in [TokenKind::Service, TokenKind::Capability] {
            let mut c = serde_json::json!({"aud": "executor-arm", "exp": now() + 60, "iat": now()});
            if kind == TokenKind::Service {
                c["token_use"] = serde_json::json!("service");
                c["sub"] = serde_json::json!("orchestrator");
            }
            let e = a.verify(&enc(c.clone()), kind).unwrap_err();
            assert!(e.to_string().contains("iss"), "{kind:?}: {e}");
            c["iss"] = serde_json::json!("orchestrator");
            assert!(a.verify(&enc(c), kind).is_ok(), "{kind:?}");
        }
        // Without a configured issuer, iss stays optional.
        assert!(
            auth()
                .verify(
                    &enc(serde_json::json!({"aud": "executor-arm", "exp": now() + 60})),
                    TokenKind::Capability
                )
                .is_ok()
        );
    }

    #[test]
    fn a_service_token_must_say_so_and_a_capability_token_need_not() {
        let a = auth();
        let bare = serde_json::json!({"aud": "executor-arm", "exp": now() + 60, "capabilities": ["ShellExecute"]});
        let e = a
            .verify(&enc(bare.clone()), TokenKind::Service)
            .unwrap_err();
        assert!(e.to_string().contains("token_use"), "{e}");
        assert!(a.verify(&enc(bare.clone()), TokenKind::Capability).is_ok());
        let mut other = bare.clone();
        other["token_use"] = serde_json::json!("refresh");
        assert!(a.verify(&enc(other.clone()), TokenKind::Service).is_err());
        assert!(a.verify(&enc(other), TokenKind::Capability).is_err());
        let mut svc = bare;
        svc["token_use"] = serde_json::json!("service");
        svc["sub"] = serde_json::json!("orchestrator");
        assert!(a.verify(&enc(svc.clone()), TokenKind::Service).is_ok());
        assert!(a.verify(&enc(svc), TokenKind::Capability).is_err());
        // What `token mint --kind service` emits passes.
        let minted = mint_hs256(
            SECRET,
            &MintRequest {
                kind: Some(TokenKind::Service),
                sub: Some("orchestrator".into()),
                ..req()
            },
        )
        .unwrap();
        assert!(a.verify(&minted, TokenKind::Service).is_ok());
    }

    #[test]
    fn single_use_is_honoured_on_both_kinds_in_separate_namespaces() {
        let a = auth();
        let c = serde_json::json!({"aud": "executor-arm", "exp": now() + 60, "iat": now(), "jti": "j1", "single_use": true, "token_use": "service", "sub": "orchestrator"});
        let svc = a.verify(&enc(c.clone()), TokenKind::Service).unwrap();
        let su = svc
            .single_use
            .expect("a single-use service token is single-use");
        assert_eq!(su.kind, TokenKind::Service);
        assert!(su.iat.is_some());
        let mut cap = c;
        cap["token_use"] = serde_json::json!("capability");
        let cap = a.verify(&enc(cap), TokenKind::Capability).unwrap();
        let cu = cap.single_use.unwrap();
        assert_eq!(cu.jti, su.jti);
        assert_ne!(cu.replay_key(), su.replay_key());
        // A service token that is single-use without a jti is refused like a capability token.
        let no_jti = serde_json::json!({"aud": "executor-arm", "exp": now() + 60, "single_use": true, "token_use": "service", "sub": "orchestrator"});
        assert!(a.verify(&enc(no_jti), TokenKind::Service).is_err());
    }

    #[test]
    fn a_token_issued_before_the_horizon_or_without_iat_may_predate_it() {
        let su = |iat| SingleUse {
            kind: TokenKind::Capability,
            jti: "j".into(),
            iat,
            exp: 2_000,
        };
        assert!(su(None).may_predate(1_000));
        assert!(su(Some(999)).may_predate(1_000));
        assert!(!su(Some(1_000)).may_predate(1_000));
        assert!(!su(Some(1_001)).may_predate(1_000));
    }

    /// An HS256 JWT with any header, signed by hand (HMAC-SHA256, RFC 2104): the library
    /// under test cannot write a `crit` header.
    fn signed(header: &serde_json::Value, claims: &serde_json::Value) -> String {
        let input = format!("{}.{}", b64(header), b64(claims));
        let mut k = SECRET.to_vec();
        k.resize(64, 0);
        let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
        let inner = Sha256::digest([pad(0x36).as_slice(), input.as_bytes()].concat());
        let outer = Sha256::digest([pad(0x5c).as_slice(), &inner[..]].concat());
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(outer);
        format!("{input}.{sig}")
    }

    /// RFC 7515 §4.1.11: a header with `crit` names extensions this daemon does not understand;
    /// the token is refused for either use, whatever `crit` lists, though its signature is good.
    #[test]
    fn a_header_with_crit_is_refused_for_both_kinds() {
        let a = auth();
        for kind in [TokenKind::Service, TokenKind::Capability] {
            let claims = serde_json::json!({"aud": "executor-arm", "exp": now() + 60, "iat": now(), "sub": "orchestrator", "token_use": match kind { TokenKind::Service => "service", TokenKind::Capability => "capability" }});
            let plain = signed(&serde_json::json!({"alg": "HS256", "typ": "JWT"}), &claims);
            assert!(
                a.verify(&plain, kind).is_ok(),
                "{kind:?}: the control token"
            );
            for crit in [
                serde_json::json!(["exp"]),
                serde_json::json!(["b64"]),
                serde_json::json!([]),
            ] {
                let header = serde_json::json!({"alg": "HS256", "typ": "JWT", "crit": crit, "b64": true, "exp": 1});
                let e = a.verify(&signed(&header, &claims), kind).unwrap_err();
                assert!(e.to_string().contains("crit"), "{kind:?}: {e}");
            }
        }
    }

    /// A subject is an owner's name: control characters in it are refused for both kinds, and a
    /// service token must have a non-empty one; a capability token may have none.
    #[test]
    fn subjects_with_control_characters_or_none_for_a_service_are_refused() {
        let a = auth();
        let claims = |kind: TokenKind, sub: Option<&str>| {
            let mut c = serde_json::json!({"aud": "executor-arm", "exp": now() + 60, "iat": now()});
            if kind == TokenKind::Service {
                c["token_use"] = serde_json::json!("service");
            }
            if let Some(s) = sub {
                c["sub"] = serde_json::json!(s);
            }
            enc(c)
        };
        for kind in [TokenKind::Service, TokenKind::Capability] {
            assert!(a.verify(&claims(kind, Some("svcA")), kind).is_ok());
            for bad in ["svcA\u{1}t1", "svcA\nt1", "\u{7f}", "a\u{85}b"] {
                let e = a.verify(&claims(kind, Some(bad)), kind).unwrap_err();
                assert!(e.to_string().contains("control"), "{kind:?} {bad:?}: {e}");
            }
        }
        assert!(
            a.verify(&claims(TokenKind::Service, None), TokenKind::Service)
                .is_err()
        );
        assert!(
            a.verify(&claims(TokenKind::Service, Some("")), TokenKind::Service)
                .is_err()
        );
        assert!(
            a.verify(&claims(TokenKind::Capability, None), TokenKind::Capability)
                .is_ok()
        );
    }
}
