//! Entry points of the fuzz targets (`fuzz/fuzz_targets/*.rs`), compiled under `--cfg fuzzing`
//! (which cargo-fuzz sets) and in unit tests, which run every entry point over its seed corpus
//! so the targets keep compiling and their properties hold on the seeds.
//!
//! Owns: feeding untrusted bytes to every parser that reads them (request bodies, tokens, the
//! egress proxy's HTTP parser, operator YAML and TOML) and checking the properties that
//! must hold for any input. A property violation panics, which the fuzzer reports as a crash.
//! Must not: touch the host (no files beyond one private secret, no network, no processes).

use std::path::Path;
use std::sync::OnceLock;

use crate::auth::Authenticator;
use crate::config::{AuthConfig, TokenKind};

/// `POST /execute` body parsing: never panics, whatever the bytes.
pub fn execute_request(data: &[u8]) {
    let _ = crate::calls::execute::parse_request(data);
}

const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-32";
const AUDIENCE: &str = "executor-arm";
const ISSUER: &str = "fuzz-issuer";

fn authenticator() -> &'static Authenticator {
    static AUTH: OnceLock<Authenticator> = OnceLock::new();
    AUTH.get_or_init(|| {
        // The secret lives in a private file for the life of the process, as in production.
        let dir = std::env::temp_dir().join(format!("executor-arm-fuzz-{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_err() {
            panic!("cannot create {}", dir.display());
        }
        let secret = dir.join("secret");
        if std::fs::write(&secret, SECRET).is_err() {
            panic!("cannot write {}", secret.display());
        }
        let cfg = AuthConfig {
            jwt_secret_file: Some(secret),
            audience: AUDIENCE.into(),
            issuer: Some(ISSUER.into()),
            max_ttl_seconds: 3600,
            leeway_seconds: 5,
            public_keys: Vec::new(),
            jwks_file: None,
            static_tokens: Vec::new(),
        };
        match Authenticator::new(&cfg) {
            Ok(a) => a,
            Err(e) => panic!("authenticator: {e}"),
        }
    })
}

fn b64(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

/// Token verification, header and claims.
///
/// The input is `header JSON 0xFF claims JSON 0xFF mode`: the token is built from the two JSON
/// texts and signed with the daemon's secret, so the fuzzer reaches claim validation instead of
/// stopping at the signature. Properties: verification never panics; a token whose signature is
/// not the daemon's is never accepted; a token whose header names any algorithm but HS256 is
/// never accepted (the algorithm comes from the key, never from the token). `hmac_sha256(key,
/// message)` comes from the fuzz target, so the daemon needs no HMAC crate of its own.
pub fn token(data: &[u8], hmac_sha256: fn(&[u8], &[u8]) -> [u8; 32]) {
    let auth = authenticator();
    // The raw bytes as a token, too: the parser of the compact form itself.
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = auth.verify(s, TokenKind::Service);
        let _ = auth.verify(s, TokenKind::Capability);
    }
    let mut parts = data.splitn(3, |b| *b == 0xFF);
    let (Some(header), Some(claims)) = (parts.next(), parts.next()) else {
        return;
    };
    let mode = parts.next().and_then(|m| m.first()).copied().unwrap_or(0);
    let signing_input = format!("{}.{}", b64(header), b64(claims));
    let good_sig = b64(&hmac_sha256(SECRET, signing_input.as_bytes()));
    let header_alg = serde_json::from_slice::<serde_json::Value>(header)
        .ok()
        .and_then(|h| h.get("alg").and_then(|a| a.as_str()).map(str::to_string));
    let kind = if mode & 1 == 0 {
        TokenKind::Service
    } else {
        TokenKind::Capability
    };
    let signed = format!("{signing_input}.{good_sig}");
    if auth.verify(&signed, kind).is_ok() {
        assert_eq!(
            header_alg.as_deref(),
            Some("HS256"),
            "a token was accepted with header alg {header_alg:?}"
        );
    }
    // Any other signature (flip one byte of the right one, or none at all) is refused.
    let mut bad = good_sig.into_bytes();
    let i = usize::from(mode) % bad.len().max(1);
    if let Some(b) = bad.get_mut(i) {
        *b = if *b == b'A' { b'B' } else { b'A' };
    }
    let forged = format!("{signing_input}.{}", String::from_utf8_lossy(&bad));
    assert!(
        auth.verify(&forged, kind).is_err(),
        "a token with a wrong signature was accepted"
    );
    assert!(
        auth.verify(&format!("{signing_input}."), kind).is_err(),
        "an unsigned token was accepted"
    );
}

/// The egress proxy's request head parser and body scanner.
///
/// Properties: neither panics; a parsed head yields an origin head that parses again to the same
/// destination; the scanner finds the same body end whether the bytes arrive at once or split at
/// any point, and never claims more bytes than it was given.
pub fn egress_http(data: &[u8]) {
    use crate::egress::{BodyScanner, Framing, parse_head};
    if let Ok(head) = parse_head(data)
        && let Some(origin) = head.origin_head()
        && let Ok(again) = parse_head(&origin)
    {
        assert_eq!(
            again.body, head.body,
            "origin head changed the body framing"
        );
    }
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let framing = match sel % 3 {
        0 => Framing::Chunked,
        1 => Framing::Length(u64::from(sel)),
        _ => Framing::None,
    };
    let split = usize::from(sel).min(rest.len());
    let mut whole = BodyScanner::new(framing);
    let whole_result = whole.scan(rest);
    let mut pieces = BodyScanner::new(framing);
    let pieces_result = match pieces.scan(&rest[..split]) {
        Ok(n) if n < split || pieces.done() => Ok(n),
        Ok(n) => pieces.scan(&rest[split..]).map(|m| n + m),
        Err(e) => Err(e),
    };
    match (whole_result, pieces_result) {
        (Ok(a), Ok(b)) => {
            assert!(
                a <= rest.len(),
                "scanner claimed {a} of {} bytes",
                rest.len()
            );
            assert_eq!(a, b, "body end depends on how the bytes arrived");
            assert_eq!(whole.done(), pieces.done());
        }
        (Err(_), Err(_)) => {}
        (a, b) => panic!("whole {a:?} but split {b:?}"),
    }
}

/// An operator's executor definition (YAML).
pub fn executor_yaml(data: &[u8]) {
    let _ = crate::executors::parse_def(Path::new("/etc/executor-arm/executors/fuzz.yaml"), data);
}

/// A sandbox profile (TOML).
pub fn profile_toml(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::policy::profile::Profile::parse("fuzz", "fuzz.toml", text);
    }
}

/// The audit log's write → verify round trip: whatever JSON a caller puts in `metadata`, and
/// whatever text it puts in a refused request's fields, the line written verifies, chained to
/// the one before it. The input is parsed as JSON when it is JSON (numbers of any size and
/// precision, escapes, duplicate keys), and used as text otherwise.
pub fn audit_roundtrip(data: &[u8]) {
    use crate::provenance::audit::{AuditEvent, AuditLog, Refusal, Run, RunEnd, verify};
    use serde_json::{Map, Value};

    let text = String::from_utf8_lossy(data).into_owned();
    let value =
        serde_json::from_slice::<Value>(data).unwrap_or_else(|_| Value::String(text.clone()));
    let mut metadata = Map::new();
    metadata.insert(text.clone(), value);
    let run = Run {
        request_id: text.clone(),
        exec_id: "exec-fuzz".into(),
        subject: Some(text.clone()),
        owner: Some(text.clone()),
        token_id: None,
        action_type: "shell".into(),
        command: text.clone(),
        args: vec![text.clone()],
        command_hash: crate::provenance::command_hash(&text, &[]),
        invocation_hash: String::new(),
        backend: "local".into(),
        profile: "fuzz".into(),
        timeout_seconds: 30,
        idempotency_key: Some(text.clone()),
        via: None,
    };
    let end = RunEnd {
        capabilities_used: Vec::new(),
        outcome: "success",
        exit_code: 0,
        duration_ms: 0,
        killed_reason: None,
        oom: false,
        peak_memory_kib: None,
        stdout_sha256: String::new(),
        stderr_sha256: String::new(),
        stdout_truncated: false,
        stderr_truncated: false,
        executor_def_sha256: None,
        error_code: None,
        network: None,
        metadata: Some(metadata),
        container_id: None,
        container_uses: None,
    };
    let events = [
        AuditEvent::Refusal(Refusal {
            request_id: text.clone(),
            status: 403,
            error_type: "CapabilityViolation",
            reason: text.clone(),
            subject: None,
            token_id: None,
            action_type: Some(text.clone()),
            command: Some(text),
            command_hash: None,
        }),
        AuditEvent::ExecutionStart(run.clone()),
        AuditEvent::Execution {
            run,
            end: Box::new(end),
        },
    ];
    // A fresh log per input, on a memory-backed directory when there is one (fsync is cheap).
    let base = if Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = match tempfile::tempdir_in(base) {
        Ok(d) => d,
        Err(e) => panic!("tempdir: {e}"),
    };
    let path = dir.path().join("audit.jsonl");
    let log = match AuditLog::open(&path, "fuzz") {
        Ok(l) => l,
        Err(e) => panic!("open: {e}"),
    };
    for e in &events {
        if let Err(err) = log.append(e) {
            panic!("append: {err}");
        }
    }
    match verify(&path) {
        Ok(v) => assert_eq!(v.lines, events.len() as u64, "lines lost"),
        Err(e) => panic!("a line the daemon wrote does not verify: {e}"),
    }
}

/// The commands with a built-in argument policy.
const POLICED: &[&str] = &["curl", "wget", "tar", "git", "nmap", "python3", "find"];

/// The argument policy. The input is `command spelling spelling args…`: a byte choosing the
/// command, two choosing one spelling of one of its denied options, then NUL-separated args.
///
/// Properties: judging any argv never panics; and a denied option is refused in every spelling
/// that names it (prefixes, `=value`, bundles, old-style keys), whatever arguments follow it and
/// whatever its value.
pub fn argpolicy(data: &[u8]) {
    use crate::policy::argpolicy::{check, denied_spellings};
    let [sel, s0, s1, rest @ ..] = data else {
        return;
    };
    let command = POLICED[usize::from(*sel) % POLICED.len()];
    let mut args: Vec<String> = rest
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let _ = check(command, &args);
    // The first argument is the denied option's value; the rest follow the spelling.
    let value = if args.is_empty() {
        "v".to_string()
    } else {
        args.remove(0)
    };
    if value.is_empty() || value.starts_with('-') {
        // An option's value that looks like an option is another question (a tool may read it
        // as the next option); the property is about the option itself.
        return;
    }
    // Every spelling of every denied option, built once per command around a placeholder value.
    const PLACEHOLDER: &str = "\u{1}value\u{1}";
    /// Per command: (denied option, one argv spelling it).
    type Spellings = Vec<Vec<(String, Vec<String>)>>;
    static SPELLINGS: OnceLock<Spellings> = OnceLock::new();
    let all = SPELLINGS.get_or_init(|| {
        POLICED
            .iter()
            .map(|c| {
                denied_spellings(c, PLACEHOLDER)
                    .into_iter()
                    .flat_map(|(o, ss)| ss.into_iter().map(move |s| (o.clone(), s)))
                    .collect()
            })
            .collect()
    });
    let spellings = &all[usize::from(*sel) % POLICED.len()];
    if spellings.is_empty() {
        return;
    }
    let (option, argv) = &spellings[usize::from(u16::from_be_bytes([*s0, *s1])) % spellings.len()];
    // nmap parses with getopt_long_only: `-i<value>` is first read as a long option when it
    // prefixes one (`-if` is `--iflist`), so an attached value spells the short option only when
    // it names no long option. The spellings do not model that; attached nmap values stay plain.
    let attached = |a: &String| !a.starts_with("--") && a.len() > PLACEHOLDER.len() + 1;
    let value = if command == "nmap" && argv.iter().any(|a| a.contains(PLACEHOLDER) && attached(a))
    {
        "v".to_string()
    } else {
        value
    };
    let argv: Vec<String> = argv
        .iter()
        .map(|a| a.replace(PLACEHOLDER, &value))
        .collect();
    let mut full = argv.clone();
    full.extend(args);
    assert!(
        check(command, &full).is_some(),
        "{command}: {option} spelt {argv:?} was not refused in {full:?}"
    );
}

/// The supervisor protocol, both directions: the daemon's frame decoder never panics and never
/// buffers past a corrupt header; a request header the supervisor decodes encodes back to the
/// same header; an exit report survives a round trip.
pub fn supervisor_protocol(data: &[u8]) {
    use crate::sandbox::docker::supervisor::FrameDecoder;
    use executor_arm_supervisor::protocol::{ExitReport, FileHeader, FileOp, RunHeader};

    let mut d = FrameDecoder::default();
    let (a, b) = data.split_at(data.len() / 2);
    d.push(a);
    let mut first = Vec::new();
    while let Ok(Some(f)) = d.next_frame() {
        first.push(f);
    }
    d.push(b);
    while let Ok(Some(_)) = d.next_frame() {}
    // The same bytes in one piece give the same first frames.
    let mut whole = FrameDecoder::default();
    whole.push(data);
    for f in first {
        assert_eq!(whole.next_frame(), Ok(Some(f)), "split decoding differs");
    }

    // Control frames (daemon -> supervisor during a run): never a panic, and split reads decode
    // as the whole does.
    let controls = |pieces: &mut dyn Iterator<Item = &[u8]>| {
        let mut d = executor_arm_supervisor::protocol::ControlDecoder::default();
        let mut got = Vec::new();
        for p in pieces {
            d.push(p);
            loop {
                match d.next_control() {
                    Ok(Some(c)) => got.push(c),
                    Ok(None) => break,
                    Err(_) => return got,
                }
            }
        }
        got
    };
    let whole_controls = controls(&mut std::iter::once(data));
    let split_controls = controls(&mut data.chunks(3));
    assert_eq!(
        whole_controls, split_controls,
        "split control decoding differs"
    );

    if let Some((_, header, _)) = executor_arm_supervisor::protocol::split_request(data) {
        if let Ok(h) = RunHeader::decode(header) {
            // Without its data: the lengths say "none" or 0.
            let h = RunHeader {
                stdin_len: h.stdin_len.map(|_| 0),
                code_len: h.code_len.map(|_| 0),
                ..h
            };
            let bytes = h.encode(&[], &[]).expect("a decoded header encodes");
            let (_, again, rest) =
                executor_arm_supervisor::protocol::split_request(&bytes).expect("complete");
            assert!(rest.is_empty());
            assert_eq!(
                RunHeader::decode(again).as_ref(),
                Ok(&h),
                "run header round trip"
            );
        }
        if let Ok(h) = FileHeader::decode(header) {
            let h = FileHeader {
                n: if h.op == FileOp::Put { 0 } else { h.n },
                ..h
            };
            let bytes = h.encode(&[]).expect("a decoded file header encodes");
            let (_, again, _) =
                executor_arm_supervisor::protocol::split_request(&bytes).expect("complete");
            assert_eq!(
                FileHeader::decode(again).as_ref(),
                Ok(&h),
                "file header round trip"
            );
        }
    }
    // The first line of a raw TCP connection, which a command can write itself.
    if let Ok(dest) = executor_arm_supervisor::protocol::parse_tcp_preamble(data) {
        let line = executor_arm_supervisor::protocol::tcp_preamble(dest);
        assert_eq!(
            executor_arm_supervisor::protocol::parse_tcp_preamble(&line[..line.len() - 1]),
            Ok(dest),
            "raw TCP preamble round trip"
        );
    }
    if let Some(r) = ExitReport::parse(data) {
        assert_eq!(
            ExitReport::parse(r.to_payload().as_bytes()),
            Some(r),
            "exit report round trip"
        );
    }
}

/// The key the checkpoint and receipt targets sign with.
fn signing_key() -> crate::provenance::keys::SigningKey {
    crate::provenance::keys::SigningKey::from_bytes(&[0x42; 32])
}

/// Checkpoint notes (`audit verify --checkpoints` reads them from a directory anyone may write
/// to): never a panic, whatever the bytes; and any text that opens as a checkpoint once signed
/// signs again to a note that opens to the same checkpoint.
pub fn checkpoint_note(data: &[u8]) {
    use crate::provenance::checkpoint::{open, sign_note};
    let key = signing_key();
    let keys: crate::provenance::keys::KeySet = std::iter::once(key.verifying_key()).collect();
    let _ = open(data, &keys);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let signed = sign_note(text, "fuzz/origin", &key);
    if let Ok(cp) = open(signed.as_bytes(), &keys) {
        assert_eq!(
            open(cp.sign(&key).as_bytes(), &keys).as_ref(),
            Ok(&cp),
            "checkpoint round trip"
        );
    }
}

/// DSSE envelopes (`receipt verify` reads them from anyone): never a panic, whatever the bytes;
/// bytes signed as a payload verify back to exactly those bytes.
pub fn receipt_envelope(data: &[u8]) {
    use crate::provenance::{dsse, receipt};
    let key = signing_key();
    let keys: crate::provenance::keys::KeySet = std::iter::once(key.verifying_key()).collect();
    if let Ok(env) = dsse::parse(data) {
        let _ = receipt::verify_receipt(&env, &keys);
    }
    let env = dsse::sign(dsse::IN_TOTO_PAYLOAD_TYPE, data, &key);
    let v =
        dsse::verify(&env, dsse::IN_TOTO_PAYLOAD_TYPE, &keys).expect("a signed payload verifies");
    assert_eq!(v.payload, data, "payload round trip");
    let json = serde_json::to_vec(&env).expect("an envelope encodes");
    assert_eq!(dsse::parse(&json).as_ref(), Ok(&env), "envelope round trip");
    let _ = receipt::verify_receipt(&env, &keys);
}

#[cfg(test)]
mod tests {
    /// Every target's entry point over its seed corpus (`fuzz/seeds/<target>`).
    #[test]
    fn every_entry_point_holds_on_its_seeds() {
        fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
            use sha2::{Digest, Sha256};
            // RFC 2104, for this test only (the fuzz target uses the hmac crate).
            let mut k = [0u8; 64];
            if key.len() > 64 {
                k[..32].copy_from_slice(&Sha256::digest(key));
            } else {
                k[..key.len()].copy_from_slice(key);
            }
            let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
            let inner = Sha256::new()
                .chain_update(pad(0x36))
                .chain_update(message)
                .finalize();
            Sha256::new()
                .chain_update(pad(0x5c))
                .chain_update(inner)
                .finalize()
                .into()
        }
        type Target<'a> = (&'a str, &'a dyn Fn(&[u8]));
        let targets: [Target; 10] = [
            ("execute_request", &super::execute_request),
            ("token", &|d| super::token(d, hmac_sha256)),
            ("egress_http", &super::egress_http),
            ("executor_yaml", &super::executor_yaml),
            ("profile_toml", &super::profile_toml),
            ("audit_roundtrip", &super::audit_roundtrip),
            ("argpolicy", &super::argpolicy),
            ("supervisor_protocol", &super::supervisor_protocol),
            ("checkpoint_note", &super::checkpoint_note),
            ("receipt_envelope", &super::receipt_envelope),
        ];
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
        for (name, run) in targets {
            let dir = root.join(name);
            let seeds: Vec<_> = std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|e| e.unwrap().path())
                .collect();
            assert!(!seeds.is_empty(), "{name} has no seeds");
            for seed in seeds {
                run(&std::fs::read(&seed).unwrap());
            }
        }
    }
}
