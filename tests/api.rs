//! The wire contract (README's API, authentication and audit sections) against the real daemon.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use base64::Engine;
use common::{Daemon, Opts, SECRET};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

fn b64(v: &Value) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
}

fn hs256(secret: &[u8], header: &Value, claims: &Value) -> String {
    use hmac_sign::sign;
    let signing_input = format!("{}.{}", b64(header), b64(claims));
    format!("{signing_input}.{}", sign(secret, signing_input.as_bytes()))
}

/// HMAC-SHA256 by hand (RFC 2104), so attack tokens do not depend on the library under test.
mod hmac_sign {
    use base64::Engine;
    use sha2::{Digest, Sha256};

    pub fn sign(key: &[u8], msg: &[u8]) -> String {
        let mut k = if key.len() > 64 {
            Sha256::digest(key).to_vec()
        } else {
            key.to_vec()
        };
        k.resize(64, 0);
        let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
        let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
        let inner = Sha256::digest([ipad.as_slice(), msg].concat());
        let outer = Sha256::digest([opad.as_slice(), &inner[..]].concat());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(outer)
    }
}

fn now() -> u64 {
    executor_arm::auth::now()
}

fn assert_error(r: &common::Resp, status: u16, error_type: &str) {
    assert_eq!(r.status, status, "body: {}", r.text);
    assert_eq!(r.json["success"], json!(false), "{}", r.text);
    assert_eq!(r.json["error_type"], json!(error_type), "{}", r.text);
    assert!(
        r.json["error"].as_str().is_some_and(|s| !s.is_empty()),
        "{}",
        r.text
    );
    // Whether to retry: 429, 503 and 5xx may succeed later, other 4xx will not.
    // A 409 for a key still running is retryable too: after it ends, the stored answer.
    let retryable = status == 429 || status >= 500 || error_type == "IdempotencyInProgress";
    assert_eq!(r.json["retryable"], json!(retryable), "{}", r.text);
    let retry_after = r
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if status == 429 || status == 503 || error_type == "IdempotencyInProgress" {
        assert!(
            retry_after.is_some_and(|s| s >= 1),
            "Retry-After on {status}"
        );
    } else {
        assert_eq!(retry_after, None, "no Retry-After on {status}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn seed_examples_and_every_documented_field() {
    let d = Daemon::start();
    // Example 1: ls -la /tmp
    let r = d.exec(json!({"action_type": "shell", "command": "ls", "args": ["-la", "/tmp"], "timeout_seconds": 10, "metadata": {"task_id": "task_123", "step_number": 3}})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let j = &r.json;
    assert_eq!(j["success"], json!(true));
    assert!(
        j["stdout"].as_str().unwrap().contains("total"),
        "{}",
        r.text
    );
    assert_eq!(j["stderr"], json!(""));
    assert_eq!(j["exit_code"], json!(0));
    assert!(j["duration_ms"].is_u64());
    let p = &j["provenance"];
    assert_eq!(p["arm_id"], json!("executor"));
    assert_eq!(p["action_type"], json!("shell"));
    assert!(chrono::DateTime::parse_from_rfc3339(p["timestamp"].as_str().unwrap()).is_ok());
    assert_eq!(
        p["capabilities_used"],
        json!(["ShellRead", "FilesystemRead"])
    );
    assert_eq!(p["metadata"]["task_id"], json!("task_123"));
    // The client recomputes the hash exactly.
    let expected = format!("sha256:{}", hex::encode(Sha256::digest(b"ls -la /tmp")));
    assert_eq!(p["command_hash"], json!(expected));
    for f in [
        "exec_id",
        "request_id",
        "invocation_hash",
        "stdout_sha256",
        "stderr_sha256",
    ] {
        assert!(
            p[f].as_str().is_some_and(|s| !s.is_empty()),
            "provenance.{f}: {}",
            r.text
        );
    }
    assert_eq!(
        p["stdout_sha256"],
        json!(format!(
            "sha256:{}",
            hex::encode(Sha256::digest(j["stdout"].as_str().unwrap().as_bytes()))
        ))
    );
    assert!(p["audit_seq"].is_u64());
    for (f, v) in [
        ("outcome", json!("success")),
        ("backend", json!("local")),
        ("profile", json!("shell-readonly")),
        ("oom", json!(false)),
        ("stdout_truncated", json!(false)),
        ("stderr_truncated", json!(false)),
        ("killed_reason", Value::Null),
    ] {
        assert_eq!(j[f], v, "{f}: {}", r.text);
    }
    assert!(j["peak_memory_kib"].is_u64());

    // Example 4: cat of a missing file -> 200, success false.
    let r = d.exec(json!({"action_type": "shell", "command": "cat", "args": ["/nonexistent/file.txt"], "timeout_seconds": 5})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json["success"], json!(false));
    assert_ne!(r.json["exit_code"], json!(0));
    assert!(
        r.json["stderr"].as_str().unwrap().contains("No such file"),
        "{}",
        r.text
    );
    assert_eq!(r.json["outcome"], json!("failed"));

    // Example 3: the python3 -c script.
    let script =
        "\nimport sys\nprint(\"Python version:\", sys.version)\nprint(\"2 + 2 =\", 2 + 2)\n";
    let r = d.exec(json!({"action_type": "python", "command": "python3", "args": ["-c", script], "timeout_seconds": 10})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.json["stdout"].as_str().unwrap().contains("2 + 2 = 4"),
        "{}",
        r.text
    );
    assert_eq!(
        r.json["provenance"]["capabilities_used"],
        json!(["PythonExecute"])
    );

    // No shell anywhere: $(id) comes back literally.
    let r = d.exec(json!({"action_type": "shell", "command": "echo", "args": ["$(id)", "`id`", "a;b", "|"]})).await;
    assert_eq!(r.json["stdout"], json!("$(id) `id` a;b |\n"));
    let expected = format!("sha256:{}", hex::encode(Sha256::digest(b"echo ")));
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo"}))
        .await;
    assert_eq!(
        r.json["provenance"]["command_hash"],
        json!(expected),
        "trailing space when args are empty"
    );

    // stdin and env (ext).
    let r = d.exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "import sys,os;print(sys.stdin.read().upper(), os.environ.get('TZ'))"], "stdin": "piped", "env": {"TZ": "UTC"}})).await;
    assert_eq!(r.json["stdout"], json!("PIPED UTC\n"), "{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn seed_error_bodies_403_408_401() {
    let d = Daemon::start();
    let r = d
        .exec(json!({"action_type": "shell", "command": "rm", "args": ["-rf", "/"]}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    assert_eq!(r.json["error"], json!("Command 'rm' not in allowlist"));
    let list: Vec<String> = serde_json::from_value(r.json["allowed_commands"].clone()).unwrap();
    for c in ["echo", "ls", "cat", "grep", "python3"] {
        assert!(list.contains(&c.to_string()), "{list:?}");
    }

    let r = d.exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "import time,sys\nprint('partial', flush=True)\ntime.sleep(30)"], "timeout_seconds": 1})).await;
    assert_error(&r, 408, "ExecutionTimeout");
    assert_eq!(
        r.json["error"],
        json!("Command execution exceeded timeout of 1 seconds")
    );
    assert!(r.json["duration_ms"].as_u64().unwrap() >= 1000);
    assert_eq!(r.json["stdout"], json!("partial\n"));
    assert_eq!(r.json["killed_reason"], json!("timeout"));
    assert_eq!(r.json["outcome"], json!("timeout"));
    assert!(r.json["provenance"]["command_hash"].is_string());

    let svc = d.service_token();
    let r = d
        .post(
            "/execute",
            &[("authorization", &format!("Bearer {svc}"))],
            json!({"action_type": "shell", "command": "ls", "capability_token": "tok_abc123xyz"})
                .to_string(),
        )
        .await;
    assert_error(&r, 401, "Unauthorized");
    assert_eq!(
        r.json["error"],
        json!("Invalid or expired capability token")
    );

    let m = d.get("/metrics").await.text;
    assert!(m.contains("executor_timeouts_total 1"), "{m}");
    assert!(m.contains("executor_capability_violations_total 1"), "{m}");
    assert!(
        m.contains("executor_executions_total{action_type=\"python\",success=\"false\"} 1"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn error_table_rows() {
    let d = Daemon::start_with(Opts {
        config: Some(
            "[server]\nconcurrency = { local = 1, docker = 1, gvisor = 1 }\n\
             queue = { max_waiting = 1, max_wait_ms = 3000 }\n"
                .into(),
        ),
        ..Default::default()
    });
    let svc = format!("Bearer {}", d.service_token());
    let auth = [("authorization", svc.as_str())];
    // 400: malformed JSON, wrong types, unknown action_type, timeout out of range, unknown field.
    for body in [
        "{not json".to_string(),
        "[]".to_string(),
        json!({"action_type": "shell", "command": 5, "capability_token": d.cap_all()}).to_string(),
        json!({"action_type": "shell", "command": "ls", "args": "-la", "capability_token": d.cap_all()}).to_string(),
        json!({"action_type": "teleport", "command": "ls", "capability_token": d.cap_all()}).to_string(),
        json!({"action_type": "shell", "command": "ls", "timeout_seconds": 0, "capability_token": d.cap_all()}).to_string(),
        json!({"action_type": "shell", "command": "ls", "timeout_seconds": 301, "capability_token": d.cap_all()}).to_string(),
        json!({"action_type": "shell", "command": "ls", "timeout": 5, "capability_token": d.cap_all()}).to_string(),
        json!({"action_type": "shell", "command": "ls", "capability_token": d.cap_all(), "args": ["a\u{0}b"]}).to_string(),
    ] {
        let r = d.post("/execute", &auth, body.clone()).await;
        assert_error(&r, 400, "InvalidRequest");
    }
    // 401: no bearer, malformed bearer, capability token missing.
    let r = d
        .post(
            "/execute",
            &[],
            json!({"action_type": "shell", "command": "ls", "capability_token": d.cap_all()})
                .to_string(),
        )
        .await;
    assert_error(&r, 401, "Unauthorized");
    let r = d
        .post(
            "/execute",
            &[("authorization", "Bearer not.a.jwt")],
            json!({"action_type": "shell", "command": "ls", "capability_token": d.cap_all()})
                .to_string(),
        )
        .await;
    assert_error(&r, 401, "Unauthorized");
    let r = d
        .post(
            "/execute",
            &auth,
            json!({"action_type": "shell", "command": "ls", "capability_token": ""}).to_string(),
        )
        .await;
    assert_error(&r, 401, "Unauthorized");
    // A capability token is not a service token, and vice versa.
    let r = d
        .post(
            "/execute",
            &[("authorization", &format!("Bearer {}", d.cap_all()))],
            json!({"action_type": "shell", "command": "ls", "capability_token": d.cap_all()})
                .to_string(),
        )
        .await;
    assert_error(&r, 401, "Unauthorized");
    let r = d
        .post(
            "/execute",
            &auth,
            json!({"action_type": "shell", "command": "ls", "capability_token": d.service_token()})
                .to_string(),
        )
        .await;
    assert_error(&r, 401, "Unauthorized");
    // 403: missing capability (named), argument policy, action type, profile and env not permitted.
    let r = d.exec(json!({"action_type": "shell", "command": "ls", "capability_token": d.cap(&["ShellRead"])})).await;
    assert_error(&r, 403, "CapabilityViolation");
    assert!(
        r.json["error"].as_str().unwrap().contains("FilesystemRead"),
        "{}",
        r.text
    );
    let r = d.exec(json!({"action_type": "python", "command": "python3", "args": ["-m", "pip", "install", "x"]})).await;
    assert_error(&r, 403, "CapabilityViolation");
    let r = d
        .exec(json!({"action_type": "python", "command": "ls"}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    let r = d
        .exec(json!({"action_type": "shell", "command": "ls", "profile": "python"}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    let r = d
        .exec(json!({"action_type": "shell", "command": "ls", "env": {"LD_PRELOAD": "/tmp/x.so"}}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    // Token narrowing claims.
    let narrowed = d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 60,
        aud: "executor-arm".into(),
        capabilities: vec![
            "ShellExecute".into(),
            "ShellRead".into(),
            "FilesystemRead".into(),
        ],
        commands: Some(vec!["echo".into()]),
        max_timeout_seconds: Some(1),
        ..Default::default()
    });
    let r = d
        .exec(json!({"action_type": "shell", "command": "ls", "capability_token": narrowed}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    // 413: over 1 MiB, refused on Content-Length.
    let big = "x".repeat((1 << 20) + 10);
    let r = d.post("/execute", &auth, json!({"action_type": "shell", "command": "echo", "args": [big], "capability_token": d.cap_all()}).to_string()).await;
    assert_error(&r, 413, "PayloadTooLarge");
    // 503: an egress profile on the docker backend with the Docker engine unreachable: never an
    // unconfined run. (Egress itself is routed on every backend; tests/egress.rs.)
    let no_docker = Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), "runc".into())],
        config: Some(format!(
            "[sandbox.docker]\nsocket = \"unix:///nonexistent/docker.sock\"\npool_size = 0\n\
             supervisor = \"{}\"\n",
            common::docker::supervisor()
        )),
        ..Default::default()
    });
    if no_docker.get("/capabilities").await.json["allowed_commands"]
        .as_array()
        .unwrap()
        .contains(&json!("curl"))
    {
        let r = no_docker
            .exec(
                json!({"action_type": "http", "command": "curl", "args": ["http://127.0.0.1:1/"]}),
            )
            .await;
        assert_error(&r, 503, "SandboxUnavailable");
        assert!(
            r.json["error"]
                .as_str()
                .unwrap()
                .contains("docker engine unreachable"),
            "{}",
            r.text
        );
    }
    let r = no_docker
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["x"]}))
        .await;
    assert_error(&r, 503, "SandboxUnavailable");
    assert_eq!(no_docker.get("/readyz").await.status, 503);
    // 429: the one local slot is busy and the one place in its queue is taken (at once), or the
    // wait for it ran out (after max_wait_ms).
    let echo = || d.exec(json!({"action_type": "shell", "command": "echo", "args": ["x"]}));
    // The slow run outlasts the wait, and the wait leaves the second request time to come.
    let slow = d.exec(json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(10)"]}));
    let probes = async {
        d.wait_for_metric("executor_runs_live 1").await;
        let waiting = echo();
        let full = async {
            d.wait_for_metric("executor_queue_waiting{backend=\"local\"} 1")
                .await;
            echo().await
        };
        tokio::join!(waiting, full)
    };
    let (slow, (waited, full)) = tokio::join!(slow, probes);
    assert_eq!(slow.status, 200, "{}", slow.text);
    for (busy, why) in [
        (&full, "queue is full (server.queue.max_waiting = 1)"),
        (&waited, "within server.queue.max_wait_ms = 3000"),
    ] {
        assert_error(busy, 429, "Overloaded");
        assert_eq!(busy.headers.get("retry-after").unwrap(), "1");
        assert!(
            busy.json["error"].as_str().unwrap().contains(why),
            "{}",
            busy.text
        );
    }
    // Unknown path.
    assert_eq!(d.get("/nope").await.status, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn token_attacks_are_401_and_audited() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("rsa.pem");
    let pubkey = dir.path().join("rsa.pub.pem");
    let ok = std::process::Command::new("openssl")
        .args(["genrsa", "-out"])
        .arg(&key)
        .arg("2048")
        .output()
        .unwrap();
    assert!(ok.status.success());
    let ok = std::process::Command::new("openssl")
        .args(["rsa", "-pubout", "-in"])
        .arg(&key)
        .arg("-out")
        .arg(&pubkey)
        .output()
        .unwrap();
    assert!(ok.status.success());
    let cfg = format!(
        "[auth]\nissuer = \"orchestrator\"\n[[auth.public_keys]]\nkid = \"rsa1\"\nalg = \"RS256\"\npem_file = \"{}\"\n",
        pubkey.display()
    );
    let d = Daemon::start_with(Opts {
        config: Some(cfg),
        ..Default::default()
    });
    let svc = format!(
        "Bearer {}",
        d.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 60,
            aud: "executor-arm".into(),
            iss: Some("orchestrator".into()),
            sub: Some("orchestrator".into()),
            ..Default::default()
        })
    );
    let base = || json!({"aud": "executor-arm", "iss": "orchestrator", "exp": now() + 60, "iat": now(), "capabilities": ["ShellExecute"], "token_use": "capability"});
    let hs = json!({"alg": "HS256", "typ": "JWT"});
    let good = hs256(SECRET.as_bytes(), &hs, &base());
    let run = |tok: String| {
        let svc = svc.clone();
        let d = &d;
        async move {
            d.post("/execute", &[("authorization", svc.as_str())], json!({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": tok}).to_string()).await
        }
    };
    assert_eq!(
        run(good.clone()).await.status,
        200,
        "the control token must pass"
    );

    let mut attacks: Vec<(&str, String)> = Vec::new();
    let parts: Vec<&str> = good.split('.').collect();
    attacks.push((
        "alg none",
        format!(
            "{}.{}.",
            b64(&json!({"alg": "none", "typ": "JWT"})),
            parts[1]
        ),
    ));
    attacks.push((
        "alg None",
        format!("{}.{}.", b64(&json!({"alg": "None"})), parts[1]),
    ));
    let pem = std::fs::read(&pubkey).unwrap();
    attacks.push((
        "HS/RS confusion",
        hs256(&pem, &json!({"alg": "HS256", "kid": "rsa1"}), &base()),
    ));
    attacks.push((
        "unknown kid",
        hs256(
            SECRET.as_bytes(),
            &json!({"alg": "HS256", "kid": "other"}),
            &base(),
        ),
    ));
    attacks.push((
        "bad signature",
        hs256(b"wrong-secret-wrong-secret-wrong-secret", &hs, &base()),
    ));
    let mut tampered = base();
    tampered["capabilities"] = json!(["ShellExecute", "NetworkAccess"]);
    attacks.push((
        "tampered payload",
        format!("{}.{}.{}", parts[0], b64(&tampered), parts[2]),
    ));
    let mut c = base();
    c.as_object_mut().unwrap().remove("exp");
    attacks.push(("missing exp", hs256(SECRET.as_bytes(), &hs, &c)));
    let mut c = base();
    c["exp"] = json!(now() - 120);
    c["iat"] = json!(now() - 180);
    attacks.push(("expired", hs256(SECRET.as_bytes(), &hs, &c)));
    let mut c = base();
    c["nbf"] = json!(now() + 600);
    attacks.push(("nbf in the future", hs256(SECRET.as_bytes(), &hs, &c)));
    let mut c = base();
    c["aud"] = json!("someone-else");
    attacks.push(("wrong aud", hs256(SECRET.as_bytes(), &hs, &c)));
    let mut c = base();
    c["iss"] = json!("mallory");
    attacks.push(("wrong iss", hs256(SECRET.as_bytes(), &hs, &c)));
    let mut c = base();
    c.as_object_mut().unwrap().remove("iss");
    attacks.push((
        "missing iss with auth.issuer set",
        hs256(SECRET.as_bytes(), &hs, &c),
    ));
    let mut c = base();
    c["exp"] = json!(now() + 86_400);
    attacks.push(("lifetime over max TTL", hs256(SECRET.as_bytes(), &hs, &c)));
    let mut c = base();
    c["token_use"] = json!("service");
    attacks.push((
        "service token as capability",
        hs256(SECRET.as_bytes(), &hs, &c),
    ));

    let before = d.audit_lines().len();
    for (name, tok) in &attacks {
        let r = run(tok.clone()).await;
        assert_eq!(r.status, 401, "{name}: {}", r.text);
        assert_eq!(
            r.json["error"],
            json!("Invalid or expired capability token"),
            "{name}"
        );
    }
    // Single-use: the second use is a replay.
    d.wait_until_tokens_postdate_start();
    let mut c = base();
    c["single_use"] = json!(true);
    c["jti"] = json!(uuid::Uuid::new_v4().to_string());
    let once = hs256(SECRET.as_bytes(), &hs, &c);
    assert_eq!(run(once.clone()).await.status, 200);
    assert_eq!(run(once).await.status, 401, "replayed single-use jti");

    let lines = d.audit_lines();
    let refusals = lines[before..]
        .iter()
        .filter(|l| l["event"] == json!("refusal") && l["status"] == json!(401))
        .count();
    assert_eq!(refusals, attacks.len() + 1, "every 401 has an audit line");
    // A properly signed RS256 token with the configured kid works.
    let rs = jsonwebtoken::encode(
        &{
            let mut h = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
            h.kid = Some("rsa1".into());
            h
        },
        &base(),
        &jsonwebtoken::EncodingKey::from_rsa_pem(&std::fs::read(&key).unwrap()).unwrap(),
    )
    .unwrap();
    assert_eq!(run(rs).await.status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn allowlist_bypasses_and_static_tokens() {
    let hash = executor_arm::auth::sha256_hex(b"tok_abc123xyz");
    let cfg = format!(
        "[[auth.static_tokens]]\nid = \"seed-client\"\nkind = \"capability\"\nsha256 = \"{hash}\"\ncapabilities = [\"ShellRead\", \"FilesystemRead\"]\n"
    );
    let d = Daemon::start_with(Opts {
        config: Some(cfg),
        ..Default::default()
    });
    for name in [
        "/bin/ls",
        "../ls",
        "ls;id",
        "ls ",
        " ls",
        "ls\u{0}",
        "l\u{0455}",
        "ｌｓ",
        "ls\n",
        "./ls",
        "LS",
        "ls|id",
        "$(ls)",
        "",
    ] {
        let r = d
            .exec(json!({"action_type": "shell", "command": name, "args": ["/"]}))
            .await;
        assert_eq!(
            r.status,
            if name.contains('\u{0}') { 400 } else { 403 },
            "{name:?}: {}",
            r.text
        );
    }
    // A static token works as the capability_token.
    let r = d.exec(json!({"action_type": "shell", "command": "ls", "args": ["-la", "/tmp"], "capability_token": "tok_abc123xyz"})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["provenance"]["subject"], json!("orchestrator"));
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_request_id_and_ops_endpoints() {
    let d = Daemon::start();
    let svc = format!("Bearer {}", d.service_token());
    let body = json!({"action_type": "python", "command": "python3", "args": ["-c", "import uuid; print(uuid.uuid4())"], "capability_token": d.cap_all()}).to_string();
    let h = [
        ("authorization", svc.as_str()),
        ("idempotency-key", "job-42-step-3"),
    ];
    let first = d.post("/execute", &h, body.clone()).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let executions = |d: &Daemon| {
        let lines = d.audit_lines();
        common::assert_runs_paired(&lines);
        lines
            .iter()
            .filter(|l| l["event"] == json!("execution"))
            .count()
    };
    let n = executions(&d);
    let again = d.post("/execute", &h, body.clone()).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json["exec_id"], first.json["exec_id"]);
    assert_eq!(
        again.json["stdout"], first.json["stdout"],
        "the stored result, not a second run"
    );
    assert_eq!(executions(&d), n, "not run again");
    let other = json!({"action_type": "shell", "command": "echo", "capability_token": d.cap_all()})
        .to_string();
    assert_eq!(
        d.post("/execute", &h, other).await.json["error_type"],
        json!("IdempotencyConflict")
    );
    // Concurrent duplicate -> 409.
    let slow = json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(5)"], "capability_token": d.cap_all()}).to_string();
    let h2 = [
        ("authorization", svc.as_str()),
        ("idempotency-key", "concurrent-1"),
    ];
    d.wait_for_metric("executor_runs_live 0").await;
    let (a, b) = tokio::join!(d.post("/execute", &h2, slow.clone()), async {
        // The first one holds the key from before its run starts.
        d.wait_for_metric("executor_runs_live 1").await;
        d.post("/execute", &h2, slow.clone()).await
    });
    assert_eq!(a.status, 200);
    assert_eq!(b.status, 409, "{}", b.text);

    // X-Request-ID echoed when valid, replaced when not.
    let r = d
        .post(
            "/execute",
            &[
                ("authorization", svc.as_str()),
                ("x-request-id", "req.abc-123_X"),
            ],
            json!({"action_type": "shell", "command": "echo", "capability_token": d.cap_all()})
                .to_string(),
        )
        .await;
    assert_eq!(r.headers.get("x-request-id").unwrap(), "req.abc-123_X");
    assert_eq!(r.json["provenance"]["request_id"], json!("req.abc-123_X"));
    let r = d
        .client
        .get(format!("{}/health", d.base))
        .header("x-request-id", "bad id with spaces")
        .send()
        .await
        .unwrap();
    let id = r
        .headers()
        .get("x-request-id")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");

    let h = d.get("/health").await;
    assert_eq!(
        h.json,
        json!({"status": "healthy", "version": env!("CARGO_PKG_VERSION")})
    );
    assert_eq!(d.get("/livez").await.status, 200);
    for p in ["/ready", "/readyz"] {
        let r = d.get(p).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let c = d.get("/capabilities").await.json;
    assert!(
        c["capabilities"]
            .as_array()
            .unwrap()
            .contains(&json!("shell_execution"))
    );
    assert!(
        c["allowed_commands"]
            .as_array()
            .unwrap()
            .contains(&json!("echo"))
    );
    assert!(c["host"]["landlock_abi"].as_u64().unwrap() > 0);
    assert!(
        c["profiles"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == json!("http-egress") && p["available"] == json!(true))
    );
    assert!(
        c["capabilities"]
            .as_array()
            .unwrap()
            .contains(&json!("http_requests"))
    );
    assert_eq!(d.get("/v1/executors").await.json, json!({"executors": []}));
    let m = d.get("/metrics").await;
    for name in [
        "executor_executions_total",
        "executor_execution_duration_seconds_bucket",
        "executor_capability_violations_total",
        "executor_timeouts_total",
        "executor_inflight_executions",
    ] {
        assert!(m.text.contains(name), "{name} missing");
    }
}

/// `executor_backend_ready{backend}` is what /readyz checks, as of each scrape: 1 for the ready
/// local backend, 0 for a docker backend whose engine cannot be reached.
#[tokio::test(flavor = "multi_thread")]
async fn backend_ready_gauge_follows_readiness() {
    let d = Daemon::start();
    assert_eq!(d.get("/readyz").await.status, 200);
    let m = d.get("/metrics").await.text;
    assert!(
        m.lines()
            .any(|l| l == "executor_backend_ready{backend=\"local\"} 1"),
        "{m}"
    );
    let no_docker = Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), "runc".into())],
        config: Some(format!(
            "[sandbox.docker]\nsocket = \"unix:///nonexistent/docker.sock\"\npool_size = 0\n\
             supervisor = \"{}\"\n",
            common::docker::supervisor()
        )),
        ..Default::default()
    });
    // Scraped before any readiness probe: the scrape itself checks.
    let m = no_docker.get("/metrics").await.text;
    for line in [
        "executor_backend_ready{backend=\"docker\"} 0",
        "executor_backend_ready{backend=\"gvisor\"} 0",
        "executor_backend_ready{backend=\"local\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} missing: {m}");
    }
    assert_eq!(no_docker.get("/readyz").await.status, 503);
}

/// A burst far over the local backend's 16 slots waits in its queue instead of being refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_two_hundred_requests_is_absorbed_by_the_queue() {
    let d = Daemon::start();
    let took = common::assert_burst_absorbed(&d, "local", 200).await;
    eprintln!("local: 200 requests at once answered in {took:?}");
    d.wait_for_no_run_cgroups();
}

#[tokio::test(flavor = "multi_thread")]
async fn audit_verify_cli_detects_tampering() {
    let d = Daemon::start();
    for i in 0..3 {
        d.exec(json!({"action_type": "shell", "command": "echo", "args": [i.to_string()]}))
            .await;
    }
    d.exec(json!({"action_type": "shell", "command": "rm"}))
        .await;
    let verify = |p: &std::path::Path| {
        std::process::Command::new(common::bin())
            .args(["audit", "verify"])
            .arg(p)
            .output()
            .unwrap()
    };
    let out = verify(&d.audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Three runs (a start and an end line each) and a refusal.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("7 entries"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let parsed = d.audit_lines();
    common::assert_runs_paired(&parsed);
    let events: Vec<&str> = parsed.iter().filter_map(|l| l["event"].as_str()).collect();
    assert_eq!(
        events,
        [
            "execution_start",
            "execution",
            "execution_start",
            "execution",
            "execution_start",
            "execution",
            "refusal"
        ]
    );
    let lines: Vec<String> = std::fs::read_to_string(&d.audit)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let check = |ls: Vec<String>, bad: usize| {
        let p = tmp.path().join("copy.jsonl");
        std::fs::write(&p, ls.join("\n") + "\n").unwrap();
        let out = verify(&p);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("line {bad}")), "{err}");
    };
    let mut edited = lines.clone();
    edited[1] = edited[1].replace("\"exit_code\":0", "\"exit_code\":1");
    check(edited, 2);
    let mut dropped = lines.clone();
    dropped.remove(1);
    check(dropped, 2);
    let mut reordered = lines.clone();
    reordered.swap(2, 3);
    check(reordered, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_header_client_is_cut_off_and_sigterm_drains() {
    let mut d = Daemon::start_with(Opts {
        config: Some(
            "[server]\nheader_read_timeout_ms = 500\nshutdown_grace_seconds = 10\n".into(),
        ),
        ..Default::default()
    });
    let mut s = std::net::TcpStream::connect(&d.addr).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    assert!(
        buf.is_empty() || text.contains("408"),
        "slow client must be cut off: {text}"
    );

    // A running execution finishes; readiness flips at once; exit code 0.
    let client = d.client.clone();
    let url = format!("{}/execute", d.base);
    let body = json!({"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(5); print('done')"], "capability_token": d.cap_all()}).to_string();
    let svc = format!("Bearer {}", d.service_token());
    let inflight = tokio::spawn(async move {
        client
            .post(url)
            .header("authorization", svc)
            .body(body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    d.wait_for_metric("executor_runs_live 1").await;
    // SAFETY: signal our own child.
    unsafe { libc::kill(d.pid(), libc::SIGTERM) };
    // The signal is handled asynchronously: readiness fails from then until the daemon is gone
    // (the run still in flight keeps it up).
    common::wait::wait_for_async(
        "readyz to fail while draining",
        common::wait::CLEANUP,
        || async {
            match d.client.get(format!("{}/readyz", d.base)).send().await {
                Ok(r) => Some(r.status().as_u16()),
                Err(_) => None,
            }
        },
        |status| *status != Some(200),
    )
    .await
    .inspect(|status| assert_eq!(*status, 503, "readyz must fail while draining"));
    let out = inflight.await.unwrap();
    assert!(out.contains("\"stdout\":\"done\\n\""), "{out}");
    assert_eq!(d.stop(), Some(0));
}

/// SIGTERM refuses (503) a request still waiting for a run slot: it does not start when the
/// running one ends within the grace (only to be killed at its end); the running one finishes,
/// and the audit log verifies.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_refuses_queued_requests_and_lets_the_running_one_finish() {
    let mut d = Daemon::start_with(Opts {
        config: Some(
            "[server]\nshutdown_grace_seconds = 120\n\
             concurrency = { local = 1, docker = 1, gvisor = 1 }\n\
             queue = { max_waiting = 4, max_wait_ms = 120000 }\n"
                .into(),
        ),
        ..Default::default()
    });
    let send = |code: &str| {
        let body = json!({"action_type": "python", "command": "python3", "args": ["-c", code], "capability_token": d.cap_all()});
        let req = d
            .client
            .post(format!("{}/execute", d.base))
            .header("authorization", format!("Bearer {}", d.service_token()))
            .header("content-type", "application/json")
            .body(body.to_string());
        tokio::spawn(async move { req.send().await.expect("request").text().await })
    };
    let running = send("import time; time.sleep(15); print('finished')");
    d.wait_for_metric("executor_runs_live 1").await;
    let queued = send("print('queued-run-started')");
    d.wait_for_metric("executor_queue_waiting{backend=\"local\"} 1")
        .await;
    // SAFETY: signal our own child.
    unsafe { libc::kill(d.pid(), libc::SIGTERM) };
    let queued: Value = serde_json::from_str(&queued.await.unwrap().unwrap()).unwrap();
    assert_eq!(queued["error_type"], "SandboxUnavailable", "{queued}");
    assert!(
        queued["error"].as_str().unwrap().contains("shutting down"),
        "{queued}"
    );
    let running = running.await.unwrap().unwrap();
    assert!(running.contains("\"stdout\":\"finished\\n\""), "{running}");
    assert_eq!(d.stop(), Some(0));
    let lines = d.audit_lines();
    common::assert_runs_paired(&lines);
    assert!(
        !lines
            .iter()
            .any(|l| l.to_string().contains("queued-run-started")),
        "the queued request started during the shutdown"
    );
    assert!(common::audit_verify(&d.audit).status.success());
}

#[test]
fn cli_mint_check_config_and_token_hash() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("s");
    std::fs::write(&secret, SECRET).unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["token", "mint", "--kind", "capability", "--secret-file"])
        .arg(&secret)
        .args([
            "--capabilities",
            "ShellRead,FilesystemRead",
            "--ttl",
            "60",
            "--single-use",
            "--commands",
            "ls,cat",
            "--max-timeout",
            "5",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let tok = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .to_string();
    let payload: Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(tok.split('.').nth(1).unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        payload["capabilities"],
        json!(["ShellRead", "FilesystemRead"])
    );
    assert_eq!(payload["single_use"], json!(true));
    assert_eq!(payload["commands"], json!(["ls", "cat"]));
    assert_eq!(payload["token_use"], json!("capability"));
    let out = std::process::Command::new(common::bin())
        .arg("check-config")
        .env(
            "EXECUTOR_ARM_PROFILES_DIR",
            concat!(env!("CARGO_MANIFEST_DIR"), "/sandbox-profiles"),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("shell-readonly") && text.contains("config ok"),
        "{text}"
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nlisten = 5\n").unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = std::process::Command::new(common::bin())
        .args(["token", "hash", "tok_abc123xyz"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        executor_arm::auth::sha256_hex(b"tok_abc123xyz")
    );
}

/// A client that hangs up mid-run cancels only its reply: the run still ends in one audit line
/// (with its exec_id and command hash), its metrics are recorded, and the in-flight gauge returns
/// to zero.
#[tokio::test]
async fn a_client_disconnect_mid_run_still_audits_and_records_the_run() {
    let d = Daemon::start();
    let marker = format!("disconnect-{}", uuid::Uuid::new_v4().simple());
    let body = json!({
        "action_type": "python",
        "command": "python3",
        "args": ["-c", format!("import time; time.sleep(1.5); print('{marker}')")],
        "capability_token": d.cap_all(),
    });
    let hung_up = reqwest::Client::builder()
        .timeout(Duration::from_millis(400))
        .build()
        .unwrap()
        .post(format!("{}/execute", d.base))
        .header("authorization", format!("Bearer {}", d.service_token()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    assert!(hung_up.is_err(), "the client was meant to give up first");

    let line = d.wait_for_audit_line("the abandoned run's execution line", |l| {
        l["event"] == json!("execution") && l["args"].to_string().contains(&marker)
    });
    assert_eq!(line["outcome"], json!("success"), "{line}");
    assert!(
        line["exec_id"]
            .as_str()
            .is_some_and(|s| s.starts_with("exec-")),
        "{line}"
    );
    // Metrics are recorded right after the audit line: poll (bounded) until they show the run.
    let recorded = |metrics: &str| {
        let inflight: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("executor_inflight_executions{"))
            .collect();
        !inflight.is_empty()
            && inflight.iter().all(|l| l.ends_with(" 0"))
            && metrics
                .lines()
                .any(|l| l.starts_with("executor_executions_total{") && !l.ends_with(" 0"))
    };
    common::wait::wait_for_async(
        "the abandoned run in the metrics, none in flight",
        common::wait::CLEANUP,
        || async { d.get("/metrics").await.text },
        |m| recorded(m),
    )
    .await;
    common::assert_runs_paired(&d.audit_lines());
    let out = std::process::Command::new(common::bin())
        .args(["audit", "verify"])
        .arg(&d.audit)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Caller-controlled JSON ends up in the audit line. Values that do not survive a parse/print
/// round trip (this float), integers past u64, -0.0, escapes, duplicate keys and deep nesting must
/// not make the chain fail to verify, and so must not stop the daemon from restarting.
#[tokio::test(flavor = "multi_thread")]
async fn caller_json_in_metadata_cannot_poison_the_audit_log() {
    let d = Daemon::start();
    let deep = format!("{}0{}", "[".repeat(100), "]".repeat(100));
    let metadata = format!(
        r#"{{"score": 1.0715660391465826e-75, "big": 123456789012345678901234567890, "neg_zero": -0.0, "text": "\u00e9\ud83d\ude00\u2028\u0000\"\\", "dup": 1, "dup": 2, "deep": {deep}}}"#
    );
    let body = format!(
        r#"{{"action_type": "shell", "command": "echo", "args": ["poison"], "capability_token": "{}", "metadata": {metadata}}}"#,
        d.cap_all()
    );
    let svc = format!("Bearer {}", d.service_token());
    let r = d.post("/execute", &[("authorization", &svc)], body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.json["provenance"]["metadata"]["dup"],
        json!(2),
        "{}",
        r.text
    );
    let out = common::audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "the log does not verify: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let d = d.restart(Opts::default());
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["after restart"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let out = common::audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A log that does not verify (an edited line, a line torn by a crash, garbage) never keeps the
/// daemon from starting: the old file is moved aside untouched, a new segment starts with a
/// `segment_start` line that records it and chains from its last good line, and it is alerted.
#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_audit_log_is_moved_aside_and_a_new_segment_starts() {
    type Corrupt = fn(&[String]) -> (Vec<u8>, usize);
    let cases: [(&str, Corrupt); 3] = [
        ("edited line", |lines| {
            let mut ls = lines.to_vec();
            ls[1] = ls[1].replace("\"exit_code\":0", "\"exit_code\":1");
            assert_ne!(ls[1], lines[1], "the edit changed nothing");
            ((ls.join("\n") + "\n").into_bytes(), 1)
        }),
        ("torn last line", |lines| {
            let last = &lines[lines.len() - 1];
            let torn = format!("{}\n{}", lines.join("\n"), &last[..last.len() / 2]);
            (torn.into_bytes(), lines.len())
        }),
        ("garbage", |_| {
            (b"\x00\xff not json\n{\"seq\":1}\n".to_vec(), 0)
        }),
    ];
    for (case, corrupt) in cases {
        let mut d = Daemon::start();
        for i in 0..2 {
            let r = d
                .exec(json!({"action_type": "shell", "command": "echo", "args": [i.to_string()]}))
                .await;
            assert_eq!(r.status, 200, "{case}: {}", r.text);
        }
        d.stop();
        let lines: Vec<String> = std::fs::read_to_string(&d.audit)
            .expect("audit log")
            .lines()
            .map(String::from)
            .collect();
        let (bytes, good) = corrupt(&lines);
        std::fs::write(&d.audit, &bytes).expect("corrupt the log");
        let (good_seq, good_hash) = match good {
            0 => (json!(0), json!(executor_arm::provenance::audit::GENESIS)),
            n => {
                let l: Value = serde_json::from_str(&lines[n - 1]).expect("line");
                (l["seq"].clone(), l["entry_hash"].clone())
            }
        };

        let d = d.restart(Opts::default());
        let moved: Vec<std::path::PathBuf> = std::fs::read_dir(d.dir.path())
            .expect("dir")
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                let n = p.file_name().unwrap_or_default().to_string_lossy();
                n.starts_with("audit.jsonl.") && n.ends_with(".broken")
            })
            .collect();
        assert_eq!(moved.len(), 1, "{case}: {moved:?}");
        assert_eq!(
            std::fs::read(&moved[0]).expect("moved log"),
            bytes,
            "{case}: the old segment is kept byte for byte"
        );
        let first = &d.audit_lines()[0];
        assert_eq!(first["event"], json!("segment_start"), "{case}: {first}");
        assert_eq!(
            first["previous_file"],
            json!(moved[0].file_name().unwrap().to_string_lossy()),
            "{case}: {first}"
        );
        assert_eq!(first["previous_state"], json!("broken"), "{case}: {first}");
        assert!(
            first["previous_error"]
                .as_str()
                .is_some_and(|e| e.contains(&format!("line {}", good + 1))),
            "{case}: {first}"
        );
        assert_eq!(
            first["previous_verified_lines"],
            json!(good),
            "{case}: {first}"
        );
        assert_eq!(first["previous_last_seq"], good_seq, "{case}: {first}");
        assert_eq!(first["previous_last_hash"], good_hash, "{case}: {first}");
        assert_eq!(
            first["prev_hash"], good_hash,
            "{case}: chains from the last good line"
        );
        assert_eq!(
            first["previous_sha256"],
            json!(format!("sha256:{}", hex::encode(Sha256::digest(&bytes)))),
            "{case}: {first}"
        );
        assert!(
            d.startup_log
                .iter()
                .any(|l| l.contains("\"ERROR\"") && l.contains("audit log")),
            "{case}: no ERROR line: {:#?}",
            d.startup_log
        );
        let metrics = d.get("/metrics").await.text;
        assert!(
            metrics
                .lines()
                .any(|l| l == "executor_audit_segments_recovered_total 1"),
            "{case}: {metrics}"
        );
        let r = d
            .exec(json!({"action_type": "shell", "command": "echo", "args": ["next"]}))
            .await;
        assert_eq!(r.status, 200, "{case}: {}", r.text);
        let out = common::audit_verify(&d.audit);
        assert!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A tmpfs mounted for one test; unmounted when dropped (lazily if something still holds it).
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(st.success(), "mount tmpfs on {}", dir.path().display());
        Tmpfs(dir)
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let umount = |lazy: bool| {
            let mut c = std::process::Command::new("umount");
            if lazy {
                c.arg("-l");
            }
            c.arg(self.0.path()).status().is_ok_and(|s| s.success())
        };
        if !umount(false) {
            umount(true);
        }
    }
}

/// Writes to `dir` until its filesystem is full; returns the filler's path.
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("filler");
    let mut f = std::fs::File::create(&p).expect("filler");
    let chunk = vec![0u8; 4096];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("fill {}: {e}", p.display()),
        }
    }
    p
}

fn executions_total(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("executor_executions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// With no room for the audit log, an admitted request is refused with 503 and nothing runs
/// unaudited; its single-use token and idempotency key stay usable. /readyz says why, and both
/// recover once space is freed.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_under_the_audit_log_refuses_with_503_and_runs_nothing() {
    let fs = Tmpfs::mount("1m");
    let log = fs.path().join("audit.jsonl");
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_AUDIT_LOG".into(), log.display().to_string())],
        ..Default::default()
    });
    let lines = || -> Vec<Value> {
        std::fs::read_to_string(&log)
            .expect("audit log")
            .lines()
            .map(|l| serde_json::from_str(l).expect("audit line is JSON"))
            .collect()
    };
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["before"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(d.get("/readyz").await.status, 200);

    let filler = fill(fs.path());
    let before_lines = lines().len();
    let before_len = std::fs::metadata(&log).expect("log").len();
    let before_runs = executions_total(&d.get("/metrics").await.text);
    // Longer than a page, so no tail of an allocated page can hold its line.
    let marker = format!("full-{}", "x".repeat(6000));
    d.wait_until_tokens_postdate_start();
    let cap = d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 120,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["ShellExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let svc = format!("Bearer {}", d.service_token());
    let h = [
        ("authorization", svc.as_str()),
        ("idempotency-key", "full-disk-1"),
    ];
    let body = json!({"action_type": "shell", "command": "echo", "args": [&marker], "capability_token": cap}).to_string();
    let r = d.post("/execute", &h, body.clone()).await;
    assert_error(&r, 503, "SandboxUnavailable");
    assert!(
        r.json["error"]
            .as_str()
            .is_some_and(|e| e.contains("audit log unavailable")),
        "{}",
        r.text
    );
    assert!(!r.text.contains("full-xxx"), "{}", r.text);
    // Nothing ran and nothing of it is in the log, not even a torn line.
    assert_eq!(lines().len(), before_lines);
    assert_eq!(std::fs::metadata(&log).expect("log").len(), before_len);
    let metrics = d.get("/metrics").await.text;
    assert_eq!(executions_total(&metrics), before_runs, "{metrics}");
    let ready = d.get("/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
    assert!(ready.text.contains("audit log"), "{}", ready.text);

    std::fs::remove_file(&filler).expect("free the space");
    let ready = d.get("/readyz").await;
    assert_eq!(ready.status, 200, "{}", ready.text);
    // The same token and key: neither was consumed by the refused request.
    let r = d.post("/execute", &h, body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.headers.get("idempotent-replayed").is_none());
    assert!(
        r.json["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains(&marker)
    );
    let exec_id = r.json["exec_id"].clone();
    let all = lines();
    let events: Vec<&Value> = all.iter().filter(|l| l["exec_id"] == exec_id).collect();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["event"], json!("execution_start"));
    assert_eq!(events[1]["event"], json!("execution"));
    let out = common::audit_verify(&log);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// With no room for the audit log, an upload into a session is refused with 503 and its file is
/// not written: no file lands in a workspace without its `session_file` line. Once space is
/// freed, the same upload lands with its line.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_under_the_audit_log_refuses_an_upload_and_writes_nothing() {
    let fs = Tmpfs::mount("1m");
    let log = fs.path().join("audit.jsonl");
    let d = Daemon::start_with(Opts {
        env: vec![("EXECUTOR_ARM_AUDIT_LOG".into(), log.display().to_string())],
        ..Default::default()
    });
    let lines = || -> Vec<Value> {
        std::fs::read_to_string(&log)
            .expect("audit log")
            .lines()
            .map(|l| serde_json::from_str(l).expect("audit line is JSON"))
            .collect()
    };
    let c = common::sessions::koder(&d, Some("tenant-1"));
    let id = common::sessions::new_session(&c, "bash").await;
    // A path (under the 4096-byte limit) that makes the line longer than a page, so no tail of
    // an allocated page can hold it.
    let dirs: Vec<String> = (0..16)
        .map(|i| format!("{i:02}{}", "d".repeat(240)))
        .collect();
    let file = format!(
        "/v1/sandbox/sessions/{id}/files/{}/upload.txt",
        dirs.join("/")
    );
    let filler = fill(fs.path());
    let before = lines().len();
    let r = c.call("PUT", &file, Some(b"unaudited".to_vec())).await;
    assert_error(&r, 503, "SandboxUnavailable");
    assert_eq!(lines().len(), before, "no line was written");
    let got = c.call("GET", &file, None).await;
    assert_eq!(got.status, 404, "the file was written: {}", got.text);

    std::fs::remove_file(&filler).expect("free the space");
    let r = c.call("PUT", &file, Some(b"audited".to_vec())).await;
    assert_eq!(r.status, 204, "{}", r.text);
    let got = c.call("GET", &file, None).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.bytes, b"audited");
    assert!(
        lines()
            .iter()
            .any(|l| l["event"] == "session_file" && l["session_id"] == id.as_str()),
        "the upload has its line"
    );
    assert!(
        common::audit_verify(&log).status.success(),
        "the audit log stays intact"
    );
}

/// execve refuses one argument over MAX_ARG_STRLEN (E2BIG): the request is refused as the
/// caller's error before anything runs.
#[tokio::test(flavor = "multi_thread")]
async fn an_argv_over_the_execve_limits_is_a_400_before_the_run() {
    let d = Daemon::start_with(Opts {
        config: Some("[server]\nbody_limit_bytes = 4194304\n".into()),
        ..Default::default()
    });
    let big = "a".repeat(900_000);
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": [big]}))
        .await;
    assert_error(&r, 400, "InvalidRequest");
    let e = r.json["error"].as_str().unwrap();
    assert!(e.contains("argument 1") && e.contains("131071"), "{e}");

    // Each argument fits, together they do not.
    let args: Vec<String> = (0..20).map(|_| "b".repeat(100_000)).collect();
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": args}))
        .await;
    assert_error(&r, 400, "InvalidRequest");
    assert!(r.text.contains("1048576"), "{}", r.text);

    // Just under the per-argument limit runs.
    let fits = "c".repeat(131_071);
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["-n", fits]}))
        .await;
    assert_eq!(r.status, 200, "{}", &r.text[..r.text.len().min(300)]);
    assert_eq!(r.json["stdout"].as_str().map(str::len), Some(131_071));
    assert_eq!(
        d.audit_lines()
            .iter()
            .filter(|l| l["event"] == json!("execution"))
            .count(),
        1,
        "only the fitting request ran"
    );
}

/// Reads from `s` until EOF, an error (a reset after the answer) or `bound`; returns what arrived
/// and whether the connection ended within the bound.
async fn read_until_closed(
    s: &mut tokio::net::tcp::OwnedReadHalf,
    bound: Duration,
) -> (String, bool) {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let ended = tokio::time::timeout(bound, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&got).into_owned(), ended)
}

/// Writes `bytes` one at a time, `every` apart, until they run out or the peer is gone.
fn trickle(
    mut w: tokio::net::tcp::OwnedWriteHalf,
    bytes: Vec<u8>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    use tokio::io::AsyncWriteExt;
    tokio::spawn(async move {
        for b in bytes {
            if w.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
    })
}

/// A client that trickles its body (or its headers, or sends nothing) is answered and cut off
/// by a deadline on the whole body, not an idle timer that each byte resets.
#[tokio::test(flavor = "multi_thread")]
async fn slow_bodies_and_headers_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let d = Daemon::start_with(Opts {
        config: Some(
            "[server]\nbody_read_timeout_seconds = 2\nheader_read_timeout_ms = 2000\n".into(),
        ),
        ..Default::default()
    });
    // Generous: the deadlines are 2 s; a loaded machine may be slow to answer, never 60 s slow.
    let bound = Duration::from_secs(60);

    // Body: Content-Length 1000, one byte every 300 ms (300 s to finish).
    let s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
    let (mut r, mut w) = s.into_split();
    let head = format!(
        "POST /execute HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
        d.service_token()
    );
    w.write_all(head.as_bytes()).await.unwrap();
    let writer = trickle(w, vec![b' '; 1000], Duration::from_millis(300));
    let (text, ended) = read_until_closed(&mut r, bound).await;
    writer.abort();
    assert!(ended, "the connection stayed open: {text}");
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    assert_eq!(v["success"], json!(false), "{text}");
    assert_eq!(v["error_type"], json!("RequestTimeout"), "{text}");
    assert!(
        v["error"].as_str().is_some_and(|e| e.contains("2 seconds")),
        "{text}"
    );

    // Headers: one byte every 300 ms, never finishing.
    let s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
    let (mut r, w) = s.into_split();
    let mut endless = b"GET /health HTTP/1.1\r\nHost: x\r\n".to_vec();
    endless.extend(std::iter::repeat_n(b'X', 1000));
    let writer = trickle(w, endless, Duration::from_millis(300));
    let (text, ended) = read_until_closed(&mut r, bound).await;
    writer.abort();
    assert!(ended, "a trickled header kept the connection: {text}");
    assert!(text.is_empty() || text.contains("408"), "{text}");

    // Nothing at all after connecting.
    let s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
    let (mut r, _w) = s.into_split();
    let (text, ended) = read_until_closed(&mut r, bound).await;
    assert!(ended, "a silent connection was kept: {text}");

    assert_eq!(
        d.get("/health").await.status,
        200,
        "the daemon still answers"
    );
}

/// The service side of authentication: with `auth.issuer` set, `iss` is required; a service JWT
/// must say `token_use: "service"`; a single-use service token authenticates one request.
#[tokio::test(flavor = "multi_thread")]
async fn service_token_claims_are_required_and_single_use_is_honoured() {
    let d = Daemon::start_with(Opts {
        config: Some("[auth]\nissuer = \"orchestrator\"\n".into()),
        ..Default::default()
    });
    d.wait_until_tokens_postdate_start();
    let hs = json!({"alg": "HS256", "typ": "JWT"});
    let svc_claims = || json!({"aud": "executor-arm", "iss": "orchestrator", "sub": "orchestrator", "exp": now() + 60, "iat": now(), "token_use": "service"});
    let cap_claims = || json!({"aud": "executor-arm", "iss": "orchestrator", "exp": now() + 60, "iat": now(), "capabilities": ["ShellExecute"]});
    let run = |svc: String, cap: String| {
        let d = &d;
        async move {
            d.post(
                "/execute",
                &[("authorization", format!("Bearer {svc}").as_str())],
                json!({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap}).to_string(),
            )
            .await
        }
    };
    let good_svc = hs256(SECRET.as_bytes(), &hs, &svc_claims());
    let good_cap = hs256(SECRET.as_bytes(), &hs, &cap_claims());
    let r = run(good_svc.clone(), good_cap.clone()).await;
    assert_eq!(
        r.status, 200,
        "control (a capability token without token_use is the common shape): {}",
        r.text
    );

    let mut attacks: Vec<(&str, String, String)> = Vec::new();
    let mut c = svc_claims();
    c.as_object_mut().unwrap().remove("iss");
    attacks.push((
        "service token without iss",
        hs256(SECRET.as_bytes(), &hs, &c),
        good_cap.clone(),
    ));
    let mut c = cap_claims();
    c.as_object_mut().unwrap().remove("iss");
    attacks.push((
        "capability token without iss",
        good_svc.clone(),
        hs256(SECRET.as_bytes(), &hs, &c),
    ));
    // The reported attack: aud, iss, exp and capabilities, and no token_use, as Bearer.
    let bare = json!({"aud": "executor-arm", "iss": "orchestrator", "exp": now() + 60, "capabilities": ["ShellExecute"]});
    attacks.push((
        "service token without token_use",
        hs256(SECRET.as_bytes(), &hs, &bare),
        good_cap.clone(),
    ));
    attacks.push((
        "capability token as Bearer",
        good_cap.clone(),
        good_cap.clone(),
    ));
    for (name, svc, cap) in attacks {
        let r = run(svc, cap).await;
        assert_error(&r, 401, "Unauthorized");
        assert_eq!(
            r.json["error"],
            json!("Invalid or expired capability token"),
            "{name}"
        );
    }

    // A single-use service token is used once; its jti is its own, apart from capability jtis.
    let jti = uuid::Uuid::new_v4().to_string();
    let mut c = svc_claims();
    c["single_use"] = json!(true);
    c["jti"] = json!(jti);
    let once_svc = hs256(SECRET.as_bytes(), &hs, &c);
    let mut c = cap_claims();
    c["single_use"] = json!(true);
    c["jti"] = json!(jti);
    let once_cap = hs256(SECRET.as_bytes(), &hs, &c);
    let r = run(once_svc.clone(), once_cap).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = run(once_svc, good_cap.clone()).await;
    assert_error(&r, 401, "Unauthorized");
    let refusal = d
        .audit_lines()
        .into_iter()
        .rev()
        .find(|l| l["event"] == json!("refusal"))
        .unwrap();
    assert!(
        refusal["reason"]
            .as_str()
            .unwrap()
            .contains("service token: replayed single-use token"),
        "{refusal}"
    );
    assert_eq!(
        run(good_svc, good_cap).await.status,
        200,
        "the daemon still serves"
    );
}

/// The embedded replay store keeps used token ids in its file: a single-use token used before a
/// restart is refused after it as a replay; a token minted right after the restart works once.
#[tokio::test(flavor = "multi_thread")]
async fn a_single_use_token_is_not_replayable_after_a_restart() {
    let d = Daemon::start();
    d.wait_until_tokens_postdate_start();
    let once = |d: &Daemon| {
        d.mint(MintRequest {
            kind: Some(TokenKind::Capability),
            ttl_seconds: 300,
            aud: "executor-arm".into(),
            capabilities: vec!["ShellExecute".into()],
            single_use: true,
            ..Default::default()
        })
    };
    let body = |tok: &str| json!({"action_type": "shell", "command": "echo", "args": ["once"], "capability_token": tok});
    let tok = once(&d);
    let r = d.exec(body(&tok)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_error(&d.exec(body(&tok)).await, 401, "Unauthorized");

    let d = d.restart(Opts::default());
    let r = d.exec(body(&tok)).await;
    assert_error(&r, 401, "Unauthorized");
    let refusal = d
        .audit_lines()
        .into_iter()
        .rev()
        .find(|l| l["event"] == json!("refusal"))
        .unwrap();
    assert!(
        refusal["reason"]
            .as_str()
            .unwrap()
            .contains("replayed single-use token"),
        "the refusal says why: {refusal}"
    );
    assert!(
        d.audit_lines()
            .iter()
            .filter(|l| l["event"] == json!("execution"))
            .count()
            == 1,
        "the replay ran nothing"
    );
    // Tokens issued after the restart, at once, are single-use as before.
    let fresh = once(&d);
    assert_eq!(d.exec(body(&fresh)).await.status, 200);
    assert_error(&d.exec(body(&fresh)).await, 401, "Unauthorized");
}

/// The embedded idempotency store holds completed results within a byte budget; a caller that
/// fills it evicts its own oldest results, not another caller's.
#[tokio::test(flavor = "multi_thread")]
async fn the_idempotency_store_is_bounded_and_fair_per_caller() {
    let d = Daemon::start_with(Opts {
        config: Some("[state]\nidempotency_max_bytes = 700000\n".into()),
        ..Default::default()
    });
    let svc = |sub: &str| {
        format!(
            "Bearer {}",
            d.mint(MintRequest {
                kind: Some(TokenKind::Service),
                ttl_seconds: 300,
                aud: "executor-arm".into(),
                sub: Some(sub.into()),
                ..Default::default()
            })
        )
    };
    let (greedy, quiet) = (svc("greedy"), svc("quiet"));
    let body = |n: usize| {
        json!({"action_type": "python", "command": "python3", "args": ["-c", format!("import uuid; print(uuid.uuid4()); print('x' * {n})")], "capability_token": d.cap_all()}).to_string()
    };
    let call = |auth: &str, key: &str, body: String| {
        let d = &d;
        let (auth, key) = (auth.to_string(), key.to_string());
        async move {
            d.post(
                "/execute",
                &[
                    ("authorization", auth.as_str()),
                    ("idempotency-key", key.as_str()),
                ],
                body,
            )
            .await
        }
    };
    let quiet_body = body(10);
    let q = call(&quiet, "q", quiet_body.clone()).await;
    assert_eq!(q.status, 200, "{}", q.text);
    // Three results of ~250 kB each from one caller: only two fit next to the quiet one.
    let greedy_bodies: Vec<String> = (0..3).map(|i| body(250_000 + i)).collect();
    let mut first = Vec::new();
    for (i, b) in greedy_bodies.iter().enumerate() {
        let r = call(&greedy, &format!("g{i}"), b.clone()).await;
        assert_eq!(r.status, 200, "{}", &r.text[..r.text.len().min(300)]);
        first.push(r.json["exec_id"].clone());
    }
    let again = call(&quiet, "q", quiet_body).await;
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true"),
        "the quiet caller's result is kept"
    );
    assert_eq!(again.json["exec_id"], q.json["exec_id"]);
    let last = call(&greedy, "g2", greedy_bodies[2].clone()).await;
    assert_eq!(last.json["exec_id"], first[2], "the newest result is kept");
    let oldest = call(&greedy, "g0", greedy_bodies[0].clone()).await;
    assert_eq!(oldest.status, 200);
    assert!(
        oldest.headers.get("idempotent-replayed").is_none(),
        "the oldest was evicted and runs again"
    );
    assert_ne!(oldest.json["exec_id"], first[0]);
}

/// Abbreviated and re-spelled options (issue #11): each request ran a program or read a file in
/// the sandbox while the argument policy matched exact spellings. The policy now judges what
/// the tool's own parser makes of the argument, so each is a 403 before anything runs.
#[tokio::test(flavor = "multi_thread")]
async fn abbreviated_options_are_judged_as_the_tool_parses_them() {
    let mut cfg = String::new();
    for name in ["curl", "wget", "tar", "git", "nmap", "python3"] {
        cfg.push_str(&format!(
            "[commands.{name}]\naction_types = [\"shell\"]\ncapabilities = [\"ShellExecute\"]\nprofile = \"shell-readonly\"\n"
        ));
    }
    let d = Daemon::start_with(Opts {
        config: Some(cfg),
        ..Default::default()
    });
    let attacks = [
        (
            json!({"command": "wget", "args": ["--use-askpas=/usr/bin/id", "http://allowed.test/"]}),
            "--use-askpass",
        ),
        (
            json!({"command": "curl", "args": ["--conf", "-"], "stdin": "url = \"file:///etc/passwd\"\n"}),
            "--config",
        ),
        (
            json!({"command": "tar", "args": ["-c", "-f", "/work/a.tar", "--checkpoint=1", "--checkpoint-act=exec=id", "/etc/passwd"]}),
            "--checkpoint-action",
        ),
        (
            json!({"command": "git", "args": ["ls-remote", "--upload-p=id >&2; false", "/tmp"]}),
            "--upload-pack",
        ),
        // Also found while building the tables: tar's multi-volume prompt runs a shell on
        // `!` read from stdin; nmap's deprecated `-i` reads a target list (echoed back in
        // its errors); python3 bundles `-I` and `-m`.
        (
            json!({"command": "tar", "args": ["-cL", "10", "-f", "/work/a.tar", "/usr/bin/tar"], "stdin": "!\nid\n"}),
            "--tape-length",
        ),
        (
            json!({"command": "nmap", "args": ["-sL", "-n", "-i", "/etc/passwd"]}),
            "-i",
        ),
        (
            json!({"command": "python3", "args": ["-Impip", "--version"]}),
            "module 'pip'",
        ),
    ];
    for (mut body, option) in attacks {
        body["action_type"] = json!("shell");
        let r = d.exec(body.clone()).await;
        assert_error(&r, 403, "CapabilityViolation");
        let msg = r.json["error"].as_str().unwrap_or_default();
        assert!(msg.contains(option), "{body}: {}", r.text);
        assert!(
            r.json.get("stdout").is_none_or(|s| s == ""),
            "{body}: {}",
            r.text
        );
    }
    // Ordinary use still runs.
    let r = d
        .exec(json!({"action_type": "shell", "command": "tar", "args": ["--version"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.json["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("GNU tar"),
        "{}",
        r.text
    );
}

#[tokio::test]
async fn a_refusal_flood_is_audited_at_its_rate_and_counted_in_full() {
    let d = Daemon::start_with(Opts {
        config: Some("[audit]\nrefusal_lines_per_second = 0.0\nrefusal_burst = 5\n".into()),
        ..Opts::default()
    });
    let svc = d.service_token();
    let body = json!({"action_type": "shell", "command": "echo", "args": ["x"],
                      "capability_token": d.cap_all()})
    .to_string();
    for _ in 0..40 {
        let r = d
            .post(
                "/execute",
                &[("authorization", "Bearer not-a-token")],
                body.clone(),
            )
            .await;
        assert_eq!(r.status, 401, "{}", r.text);
    }
    // Refusals of an authenticated caller draw from their own bucket: the 401 flood did not
    // spend it.
    for _ in 0..3 {
        let r = d
            .post(
                "/execute",
                &[("authorization", &format!("Bearer {svc}"))],
                json!({"action_type": "shell", "command": "rm", "capability_token": d.cap_all()})
                    .to_string(),
            )
            .await;
        assert_eq!(r.status, 403, "{}", r.text);
    }
    let ok = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["after"]}))
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text);

    // The counts are written at the daemon's next flush (every few seconds).
    let lines = common::wait::wait_for(
        "refusals_suppressed lines counting 35 refusals",
        common::wait::CLEANUP,
        || d.audit_lines(),
        |lines| {
            lines
                .iter()
                .filter(|l| l["event"] == json!("refusals_suppressed"))
                .map(|l| l["count"].as_u64().unwrap_or(0))
                .sum::<u64>()
                >= 35
        },
    );
    let count = |event: &str, status: u64| {
        lines
            .iter()
            .filter(|l| l["event"] == json!(event) && l["status"].as_u64().unwrap_or(0) == status)
            .count()
    };
    assert_eq!(count("refusal", 401), 5, "the burst of 401s: {lines:#?}");
    assert_eq!(
        count("refusal", 403),
        3,
        "the authenticated refusals: {lines:#?}"
    );
    assert_eq!(count("execution", 0), 1);
    let summaries: Vec<&Value> = lines
        .iter()
        .filter(|l| l["event"] == json!("refusals_suppressed"))
        .collect();
    let counted: u64 = summaries.iter().map(|l| l["count"].as_u64().unwrap()).sum();
    let by_401: u64 = summaries
        .iter()
        .map(|l| l["by_status"]["401"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!((counted, by_401), (35, 35), "{summaries:#?}");
    assert!(summaries.len() <= 2, "one per flush: {summaries:#?}");
    assert!(
        summaries[0]["first_at"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    );
    let out = common::audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = d.get("/metrics").await.text;
    assert!(
        metrics.contains("executor_audit_refusals_suppressed_total{status=\"401\"} 35"),
        "{metrics}"
    );
    // Every refused request is still counted as an authentication failure.
    assert!(
        metrics.contains("executor_auth_failures_total 40"),
        "{metrics}"
    );
}

#[tokio::test]
async fn suppressed_refusals_are_written_without_waiting_for_another_line() {
    let d = Daemon::start_with(Opts {
        config: Some("[audit]\nrefusal_lines_per_second = 0.0\nrefusal_burst = 1\n".into()),
        ..Opts::default()
    });
    for _ in 0..3 {
        let r = d
            .post("/execute", &[("authorization", "Bearer nope")], "{}".into())
            .await;
        assert_eq!(r.status, 401, "{}", r.text);
    }
    // No other request comes: the daemon's periodic flush writes the counts.
    let summary = d.wait_for_audit_line("refusals_suppressed", |l| {
        l["event"] == json!("refusals_suppressed")
    });
    assert_eq!(summary["count"], json!(2), "{summary}");
    let out = common::audit_verify(&d.audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_missing_capability_token_is_401_and_the_header_may_carry_it() {
    let d = Daemon::start();
    let svc = format!("Bearer {}", d.service_token());
    let echo = json!({"action_type": "shell", "command": "echo", "args": ["hi"]});
    let r = d
        .post("/execute", &[("authorization", &svc)], echo.to_string())
        .await;
    assert_error(&r, 401, "Unauthorized");
    assert_eq!(
        r.json["error"],
        json!("Invalid or expired capability token"),
        "{}",
        r.text
    );
    let refusal = d
        .audit_lines()
        .into_iter()
        .find(|l| l["event"] == json!("refusal"))
        .expect("the 401 is audited");
    assert_eq!(refusal["status"], json!(401));
    assert_eq!(refusal["reason"], json!("missing capability token"));

    let cap = d.cap_all();
    let r = d
        .post(
            "/execute",
            &[("authorization", &svc), ("x-capability-token", &cap)],
            echo.to_string(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["stdout"], json!("hi\n"));
    let mut both = echo.clone();
    both["capability_token"] = json!(cap);
    let r = d
        .post(
            "/execute",
            &[("authorization", &svc), ("x-capability-token", &cap)],
            both.to_string(),
        )
        .await;
    assert_error(&r, 400, "InvalidRequest");
    // Two header copies: refused, whichever is valid (a proxy may have checked the other).
    let r = d
        .post(
            "/execute",
            &[
                ("authorization", &svc),
                ("x-capability-token", &cap),
                ("x-capability-token", "x.y.z"),
            ],
            echo.to_string(),
        )
        .await;
    assert_error(&r, 400, "InvalidRequest");
}

#[tokio::test]
async fn every_error_body_says_whether_a_retry_can_help() {
    let d = Daemon::start();
    let svc = format!("Bearer {}", d.service_token());
    // 404 and 405 carry the error body too.
    let r = d.get("/no-such-endpoint").await;
    assert_error(&r, 404, "InvalidRequest");
    let r = d.get("/execute").await;
    assert_error(&r, 405, "MethodNotAllowed");
    let r = d
        .post("/execute", &[("authorization", &svc)], "{".into())
        .await;
    assert_error(&r, 400, "InvalidRequest");
    // An execution timeout is an error result that a retry does not cure.
    let r = d
        .exec(json!({"action_type": "python", "command": "python3",
                     "args": ["-c", "import time; time.sleep(30)"], "timeout_seconds": 1}))
        .await;
    assert_eq!(r.status, 408, "{}", r.text);
    assert_eq!(r.json["error_type"], json!("ExecutionTimeout"));
    assert_eq!(r.json["retryable"], json!(false), "{}", r.text);
    // A success says nothing about retrying.
    let ok = d
        .exec(json!({"action_type": "shell", "command": "echo"}))
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    assert!(ok.json.get("retryable").is_none(), "{}", ok.text);
}

#[tokio::test]
async fn output_that_is_not_utf8_comes_back_exactly_in_base64() {
    let d = Daemon::start();
    let r = d
        .exec(json!({"action_type": "python", "command": "python3", "args": ["-c",
            "import sys; sys.stdout.buffer.write(b'ok\\xff\\x00\\xfe'); print('fine', file=sys.stderr)"]}))
        .await;
    common::assert_binary_output(&r, b"ok\xff\x00\xfe", "local");
    // UTF-8 output has no base64 twin.
    let r = d
        .exec(json!({"action_type": "shell", "command": "echo", "args": ["h\u{e9}llo"]}))
        .await;
    assert_eq!(r.json["stdout"], json!("h\u{e9}llo\n"), "{}", r.text);
    assert!(r.json.get("stdout_b64").is_none(), "{}", r.text);
}

/// An Idempotency-Key replay must not hand a stored result to a capability token that may not
/// run the command: with the token in the header, the body (and its hash) no longer names it.
#[tokio::test(flavor = "multi_thread")]
async fn a_header_token_that_may_not_run_the_command_gets_no_replay_of_its_result() {
    let d = Daemon::start();
    let svc = format!("Bearer {}", d.service_token());
    let mint = |caps: &[&str], commands: &[&str]| {
        d.mint(MintRequest {
            kind: Some(TokenKind::Capability),
            ttl_seconds: 120,
            aud: "executor-arm".into(),
            sub: Some("orchestrator".into()),
            capabilities: caps.iter().map(|s| s.to_string()).collect(),
            commands: Some(commands.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        })
    };
    let may_ls = mint(&["ShellRead", "FilesystemRead"], &["ls"]);
    let only_echo = mint(&["ShellExecute"], &["echo"]);
    let body = json!({"action_type": "shell", "command": "ls", "args": ["/usr"]}).to_string();
    let first = d
        .post(
            "/execute",
            &[
                ("authorization", &svc),
                ("x-capability-token", &may_ls),
                ("idempotency-key", "k-ls"),
            ],
            body.clone(),
        )
        .await;
    assert_eq!(first.status, 200, "{}", first.text);
    // Without a key, the other token is refused.
    let r = d
        .post(
            "/execute",
            &[("authorization", &svc), ("x-capability-token", &only_echo)],
            body.clone(),
        )
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    // With the key it must be refused too, not served the stored output.
    let r = d
        .post(
            "/execute",
            &[
                ("authorization", &svc),
                ("x-capability-token", &only_echo),
                ("idempotency-key", "k-ls"),
            ],
            body,
        )
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    assert!(r.headers.get("idempotent-replayed").is_none());
}

/// A 401 of an authenticated service (its single-use capability token replayed) names a subject:
/// a flood of unauthenticated 401s must not reduce it to a count.
#[tokio::test(flavor = "multi_thread")]
async fn an_unauthenticated_flood_does_not_hide_an_authenticated_callers_401() {
    let d = Daemon::start_with(Opts {
        config: Some("[audit]\nrefusal_lines_per_second = 0.0\nrefusal_burst = 3\n".into()),
        ..Opts::default()
    });
    for _ in 0..10 {
        let r = d
            .post(
                "/execute",
                &[("authorization", "Bearer not-a-token")],
                "{}".into(),
            )
            .await;
        assert_eq!(r.status, 401, "{}", r.text);
    }
    d.wait_until_tokens_postdate_start();
    let cap = d.mint(MintRequest {
        kind: Some(TokenKind::Capability),
        ttl_seconds: 120,
        aud: "executor-arm".into(),
        sub: Some("orchestrator".into()),
        capabilities: vec!["ShellExecute".into()],
        single_use: true,
        ..Default::default()
    });
    let svc = format!("Bearer {}", d.service_token());
    let body = json!({"action_type": "shell", "command": "echo", "args": ["x"]}).to_string();
    let h = [
        ("authorization", svc.as_str()),
        ("x-capability-token", cap.as_str()),
    ];
    assert_eq!(d.post("/execute", &h, body.clone()).await.status, 200);
    assert_eq!(d.post("/execute", &h, body).await.status, 401);
    let replayed: Vec<Value> = d
        .audit_lines()
        .into_iter()
        .filter(|l| {
            l["event"] == json!("refusal")
                && l["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("replayed single-use token"))
        })
        .collect();
    assert_eq!(replayed.len(), 1, "{:#?}", d.audit_lines());
    assert_eq!(replayed[0]["subject"], json!("orchestrator"));
}

#[tokio::test]
async fn allowed_commands_adds_a_command_found_on_the_search_path() {
    let d = Daemon::start_with(Opts {
        env: vec![("ALLOWED_COMMANDS".into(), "echo,date".into())],
        ..Opts::default()
    });
    assert!(
        d.startup_log
            .iter()
            .any(|l| l.contains("ALLOWED_COMMANDS adds") && l.contains("date")),
        "{:#?}",
        d.startup_log
    );
    let caps = d.get("/capabilities").await.json;
    assert_eq!(caps["allowed_commands"], json!(["date", "echo"]), "{caps}");
    assert_eq!(caps["commands_added_from_env"], json!(["date"]), "{caps}");
    let r = d
        .exec(json!({"action_type": "shell", "command": "date", "args": ["-u", "+%Y"]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["profile"], json!("shell-readonly"), "{}", r.text);
    assert_eq!(
        r.json["provenance"]["capabilities_used"],
        json!(["ShellExecute"])
    );
    // It requires ShellExecute like any shell command added this way.
    let r = d
        .exec(json!({"action_type": "shell", "command": "date",
                     "capability_token": d.cap(&["ShellRead", "FilesystemRead"])}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");
    // What the configuration lists but the variable does not name is gone.
    let r = d
        .exec(json!({"action_type": "shell", "command": "ls"}))
        .await;
    assert_error(&r, 403, "CapabilityViolation");

    // A name found nowhere stops the daemon at startup with a clear error.
    let out = std::process::Command::new(common::bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("EXECUTOR_ARM_JWT_SECRET_FILE", &d.secret)
        .env(
            "EXECUTOR_ARM_AUDIT_LOG",
            d.dir.path().join("other-audit.jsonl"),
        )
        .env(
            "EXECUTOR_ARM_PROFILES_DIR",
            concat!(env!("CARGO_MANIFEST_DIR"), "/sandbox-profiles"),
        )
        .env("ALLOWED_COMMANDS", "echo,no-such-command-here")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no-such-command-here") && err.contains("not found"),
        "{err}"
    );
}

/// An orchestrator that mints a capability token per attempt retries with another token: the
/// retry gets the stored answer (the fingerprint is what runs and for whom, not the credential),
/// unless the new token could not run the request, which is refused as a first attempt would
/// be. Another request under the key is still 422, and a retry spelt in another key order or
/// with the token in the header instead of the body is the same request.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_with_a_fresh_capability_token_gets_the_stored_answer() {
    let d = Daemon::start();
    d.wait_until_tokens_postdate_start();
    let svc = format!("Bearer {}", d.service_token());
    let mint = |caps: &[&str], single_use: bool| {
        d.mint(MintRequest {
            kind: Some(TokenKind::Capability),
            ttl_seconds: 120,
            aud: "executor-arm".into(),
            sub: Some("orchestrator".into()),
            capabilities: caps.iter().map(|s| s.to_string()).collect(),
            single_use,
            ..Default::default()
        })
    };
    let py = ["PythonExecute"];
    let code = "import uuid; print(uuid.uuid4())";
    let key = [
        ("authorization", svc.as_str()),
        ("idempotency-key", "attempt-token"),
    ];
    let first = d
        .post(
            "/execute",
            &key,
            json!({"action_type": "python", "command": "python3", "args": ["-c", code], "capability_token": mint(&py, false)}).to_string(),
        )
        .await;
    assert_eq!(first.status, 200, "{}", first.text);
    let runs = |d: &Daemon| {
        d.audit_lines()
            .iter()
            .filter(|l| l["event"] == "execution_start")
            .count()
    };
    let ran = runs(&d);
    // A fresh token, in the body, the fields in another order.
    let retry = d
        .post(
            "/execute",
            &key,
            format!(
                r#"{{"capability_token": "{}", "args": ["-c", "{code}"], "command": "python3", "action_type": "python"}}"#,
                mint(&py, false)
            ),
        )
        .await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert_eq!(retry.headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(retry.json["exec_id"], first.json["exec_id"]);
    assert_eq!(retry.json["stdout"], first.json["stdout"]);
    // A fresh single-use token in the header: served, and used up by it.
    let once = mint(&py, true);
    let body =
        json!({"action_type": "python", "command": "python3", "args": ["-c", code]}).to_string();
    let with_header = [key[0], key[1], ("x-capability-token", once.as_str())];
    let retry = d.post("/execute", &with_header, body.clone()).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert_eq!(retry.json["exec_id"], first.json["exec_id"]);
    let replayed = d.post("/execute", &with_header, body.clone()).await;
    assert_error(&replayed, 401, "Unauthorized");
    // A token that does not grant the request gets the refusal, not the stored output.
    let shell_only = mint(&["ShellExecute"], false);
    let refused = d
        .post(
            "/execute",
            &[key[0], key[1], ("x-capability-token", shell_only.as_str())],
            body,
        )
        .await;
    assert_error(&refused, 403, "CapabilityViolation");
    assert!(refused.headers.get("idempotent-replayed").is_none());
    assert!(
        !refused
            .text
            .contains(first.json["stdout"].as_str().unwrap().trim())
    );
    // What runs changed: still a conflict.
    let other = d
        .post(
            "/execute",
            &key,
            json!({"action_type": "python", "command": "python3", "args": ["-c", "print(2)"], "capability_token": mint(&py, false)}).to_string(),
        )
        .await;
    assert_error(&other, 422, "IdempotencyConflict");
    let other = d
        .post(
            "/execute",
            &key,
            json!({"action_type": "python", "command": "python3", "args": ["-c", code], "env": {"LANG": "C"}, "capability_token": mint(&py, false)}).to_string(),
        )
        .await;
    assert_error(&other, 422, "IdempotencyConflict");
    // The key is the calling service's: another service runs its own request under it.
    let other_svc = format!(
        "Bearer {}",
        d.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 60,
            aud: "executor-arm".into(),
            sub: Some("another-service".into()),
            ..Default::default()
        })
    );
    let theirs = d
        .post(
            "/execute",
            &[("authorization", other_svc.as_str()), key[1]],
            json!({"action_type": "python", "command": "python3", "args": ["-c", code], "capability_token": mint(&py, false)}).to_string(),
        )
        .await;
    assert_eq!(theirs.status, 200, "{}", theirs.text);
    assert_ne!(theirs.json["exec_id"], first.json["exec_id"]);
    assert_eq!(
        runs(&d),
        ran + 1,
        "only the other service's request ran again"
    );
}

/// Every optional field of `/execute` (as the OpenAPI document lists them) may be `null`, the
/// same as leaving it out.
#[tokio::test(flavor = "multi_thread")]
async fn null_is_absent_for_every_optional_field_of_execute() {
    let d = Daemon::start();
    let doc = d.get("/openapi.json").await.json;
    let schema = &doc["components"]["schemas"]["ExecuteRequest"];
    let required: Vec<&str> = schema["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let optional: Vec<&String> = schema["properties"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| !required.contains(&k.as_str()) && k.as_str() != "capability_token")
        .collect();
    assert!(optional.len() >= 10, "{optional:?}");
    let mut body =
        json!({"action_type": "shell", "command": "echo", "capability_token": d.cap_all()});
    for field in &optional {
        let mut one = body.clone();
        one[field.as_str()] = Value::Null;
        let r = d.exec(one).await;
        assert_eq!(r.status, 200, "{field}: null: {}", r.text);
        body[field.as_str()] = Value::Null;
    }
    let r = d.exec(body).await;
    assert_eq!(r.status, 200, "all null: {}", r.text);
    assert_eq!(r.json["stdout"], "\n");
}

/// An Idempotency-Key that is not 1-255 visible ASCII characters (a byte above 0x7f included)
/// is a 400, never ignored: ignored, a retry would run the command again.
#[tokio::test(flavor = "multi_thread")]
async fn a_non_ascii_idempotency_key_is_400_and_runs_nothing() {
    let d = Daemon::start();
    let svc = format!("Bearer {}", d.service_token());
    let body = json!({"action_type": "shell", "command": "echo", "args": ["x"], "capability_token": d.cap_all()}).to_string();
    for key in [&b"\xfc"[..], b"job-\xc3\xbc", b"a b", b"", &[b'k'; 256][..]] {
        let r = d
            .client
            .post(format!("{}/execute", d.base))
            .header("authorization", &svc)
            .header("content-type", "application/json")
            .header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            )
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let r = Daemon::read(r).await;
        assert_error(&r, 400, "InvalidRequest");
        assert!(
            r.json["error"]
                .as_str()
                .unwrap()
                .contains("Idempotency-Key"),
            "{}",
            r.text
        );
    }
    let r = d
        .client
        .post(format!("{}/execute", d.base))
        .header("authorization", &svc)
        .header("idempotency-key", "one")
        .header("idempotency-key", "two")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_error(&Daemon::read(r).await, 400, "InvalidRequest");
    assert!(
        !d.audit_lines()
            .iter()
            .any(|l| l["event"] == "execution_start"),
        "nothing ran"
    );
}

/// RFC 7515 §4.1.11: a JWT whose header has `crit` is refused (401), as a service token and as
/// a capability token, though its signature and claims are good.
#[tokio::test(flavor = "multi_thread")]
async fn a_token_header_with_crit_is_refused() {
    let d = Daemon::start();
    let claims = |token_use: &str| {
        json!({"aud": "executor-arm", "sub": "orchestrator", "exp": now() + 60, "iat": now(),
            "capabilities": ["ShellExecute"], "token_use": token_use})
    };
    let plain = json!({"alg": "HS256", "typ": "JWT"});
    let crit = json!({"alg": "HS256", "typ": "JWT", "crit": ["exp"], "exp": now() + 60});
    let call = |svc: String, cap: String| {
        let d = &d;
        async move {
            d.post(
                "/execute",
                &[("authorization", &format!("Bearer {svc}"))],
                json!({"action_type": "shell", "command": "echo", "capability_token": cap})
                    .to_string(),
            )
            .await
        }
    };
    let svc = |h: &Value| hs256(SECRET.as_bytes(), h, &claims("service"));
    let cap = |h: &Value| hs256(SECRET.as_bytes(), h, &claims("capability"));
    assert_eq!(
        call(svc(&plain), cap(&plain)).await.status,
        200,
        "the control tokens"
    );
    assert_error(&call(svc(&crit), cap(&plain)).await, 401, "Unauthorized");
    assert_error(&call(svc(&plain), cap(&crit)).await, 401, "Unauthorized");
    let refusals: Vec<String> = d
        .audit_lines()
        .iter()
        .filter(|l| l["event"] == "refusal")
        .map(|l| l.to_string())
        .collect();
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert!(refusals.iter().all(|r| r.contains("crit")), "{refusals:?}");
}

/// A subject names an owner: a service token whose `sub` has a control character, is empty or
/// is missing is refused (401), and so is a capability token whose `sub` has one.
#[tokio::test(flavor = "multi_thread")]
async fn token_subjects_with_control_characters_or_none_are_refused() {
    let d = Daemon::start();
    let mint = |kind: TokenKind, sub: Option<&str>| {
        d.mint(MintRequest {
            kind: Some(kind),
            ttl_seconds: 60,
            aud: "executor-arm".into(),
            sub: sub.map(str::to_string),
            capabilities: vec!["ShellExecute".into()],
            ..Default::default()
        })
    };
    let call = |svc: String, cap: String| {
        let d = &d;
        async move {
            d.post(
                "/execute",
                &[("authorization", &format!("Bearer {svc}"))],
                json!({"action_type": "shell", "command": "echo", "capability_token": cap})
                    .to_string(),
            )
            .await
        }
    };
    let good_cap = || mint(TokenKind::Capability, Some("orchestrator"));
    assert_eq!(
        call(mint(TokenKind::Service, Some("svcA")), good_cap())
            .await
            .status,
        200
    );
    for sub in [Some("svcA\u{1}t1"), Some("svcA\r\nx"), Some(""), None] {
        let r = call(mint(TokenKind::Service, sub), good_cap()).await;
        assert_error(&r, 401, "Unauthorized");
    }
    let r = call(
        mint(TokenKind::Service, Some("svcA")),
        mint(TokenKind::Capability, Some("orch\u{1}x")),
    )
    .await;
    assert_error(&r, 401, "Unauthorized");
    // A capability token may still name no subject.
    let r = call(
        mint(TokenKind::Service, Some("svcA")),
        mint(TokenKind::Capability, None),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
}

/// Every route with a path parameter or a query answers a malformed one (a path segment not
/// UTF-8 once percent-decoded, a query that does not parse) with the documented JSON error
/// body, not axum's plain text.
#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_path_or_query_gets_the_json_error_body() {
    let d = Daemon::start();
    let svc = format!("Bearer {}", d.service_token());
    let doc = d.get("/openapi.json").await.json;
    let mut checked = 0;
    for (template, ops) in doc["paths"].as_object().unwrap() {
        for (method, op) in ops.as_object().unwrap() {
            let params: Vec<&Value> = op["parameters"]
                .as_array()
                .map(|a| a.iter().collect())
                .unwrap_or_default();
            let in_path = params.iter().any(|p| p["in"] == "path");
            let in_query: Vec<&str> = params
                .iter()
                .filter(|p| p["in"] == "query")
                .filter_map(|p| p["name"].as_str())
                .collect();
            let mut urls = Vec::new();
            if in_path {
                // Each parameter in turn is the bad one; the others are well formed.
                let names: Vec<&str> = params
                    .iter()
                    .filter(|p| p["in"] == "path")
                    .filter_map(|p| p["name"].as_str())
                    .collect();
                for bad in &names {
                    let mut url = template.clone();
                    for n in &names {
                        let v = if n == bad { "x%FFy" } else { "ses_00" };
                        url = url.replace(&format!("{{{n}}}"), v);
                    }
                    urls.push(url);
                }
            }
            for q in &in_query {
                let url = template.replace(['{', '}'], "");
                // A query that does not parse (a field given twice).
                urls.push(format!("{url}?{q}=a&{q}=b"));
            }
            for url in urls {
                let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
                let r = d
                    .client
                    .request(m, format!("{}{url}", d.base))
                    .header("authorization", &svc)
                    .header("content-type", "application/json")
                    .body("{}")
                    .send()
                    .await
                    .unwrap();
                let r = Daemon::read(r).await;
                assert_eq!(
                    r.headers.get("content-type").map(|v| v.to_str().unwrap()),
                    Some("application/json"),
                    "{method} {url}: {} {}",
                    r.status,
                    r.text
                );
                assert_eq!(r.status, 400, "{method} {url}: {}", r.text);
                // A HEAD answer has the headers of its GET and no body.
                if method != "head" {
                    assert_error(&r, 400, "InvalidRequest");
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "only {checked} calls");
}
