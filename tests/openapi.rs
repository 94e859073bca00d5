//! The OpenAPI document: what a live daemon serves at /openapi.json is byte for byte the
//! committed `openapi/executor-arm.json` (and what `executor-arm openapi` prints), it is an
//! OpenAPI 3.1 document describing every route the daemon answers, and /docs renders it as a
//! self-contained page that loads nothing from anywhere.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::Daemon;
use serde_json::Value;

const COMMITTED: &str = "openapi/executor-arm.json";
const FIX: &str = "cargo run --quiet -- openapi > openapi/executor-arm.json";

fn committed() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(COMMITTED);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}\nwrite it with: {FIX}", path.display()))
}

/// The first line where two texts differ, for a readable failure.
fn first_difference(a: &str, b: &str) -> String {
    for (i, (x, y)) in a.lines().zip(b.lines()).enumerate() {
        if x != y {
            return format!("line {}:\n  committed: {x}\n  served:    {y}", i + 1);
        }
    }
    format!(
        "one is a prefix of the other ({} and {} lines)",
        a.lines().count(),
        b.lines().count()
    )
}

#[tokio::test]
async fn served_document_is_the_committed_file() {
    let d = Daemon::start();
    let r = d.get("/openapi.json").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.headers["content-type"], "application/json",
        "content type of /openapi.json"
    );
    let want = committed();
    assert!(
        r.text == want,
        "{COMMITTED} differs from what the daemon serves at /openapi.json ({}).\n\
         Regenerate it with:\n    {FIX}\n",
        first_difference(&want, &r.text)
    );
    assert!(want.ends_with("}\n"), "pretty JSON with a final newline");

    // The subcommand prints the same bytes, without starting anything.
    let out = std::process::Command::new(common::bin())
        .arg("openapi")
        .output()
        .expect("run executor-arm openapi");
    assert!(out.status.success());
    assert!(
        out.stdout == want.as_bytes(),
        "`executor-arm openapi` differs from {COMMITTED}; run: {FIX}"
    );
}

/// Every `$ref` in the document, for the check that each resolves.
fn refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "$ref" {
                    out.extend(x.as_str().map(str::to_string));
                } else {
                    refs(x, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
        _ => {}
    }
}

#[test]
fn document_is_openapi_3_1_and_complete() {
    let doc: Value = serde_json::from_str(&committed()).expect("JSON");
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "openapi: {}",
        doc["openapi"]
    );
    assert_eq!(doc["info"]["title"], "executor-arm");
    assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));

    // Every route the router has, with its methods (src/api/mod.rs).
    let routes: &[(&str, &[&str])] = &[
        ("/execute", &["post"]),
        ("/v1/executions/{exec_id}", &["get"]),
        ("/v1/executions/{exec_id}/stream", &["get"]),
        ("/v1/executions/{exec_id}/cancel", &["post"]),
        ("/v1/executions/{exec_id}/receipt", &["get"]),
        ("/v1/receipts/keys", &["get"]),
        ("/v1/sandbox/sessions", &["post"]),
        ("/v1/sandbox/sessions/{id}", &["get", "delete"]),
        ("/v1/sandbox/sessions/{id}/exec", &["post"]),
        ("/v1/sandbox/sessions/{id}/execs/{exec_id}", &["get"]),
        ("/v1/sandbox/sessions/{id}/execs/{exec_id}/stream", &["get"]),
        (
            "/v1/sandbox/sessions/{id}/execs/{exec_id}/cancel",
            &["post"],
        ),
        (
            "/v1/sandbox/sessions/{id}/execs/{exec_id}/receipt",
            &["get"],
        ),
        ("/v1/sandbox/sessions/{id}/files", &["get"]),
        ("/v1/sandbox/sessions/{id}/files/{path}", &["get", "put"]),
        ("/v1/sandbox/sessions/{id}/archive", &["get", "put"]),
        ("/v1/sandbox/sessions/{id}/pause", &["post"]),
        ("/v1/sandbox/sessions/{id}/resume", &["post"]),
        ("/v1/sandbox/sessions/{id}/execs/{exec_id}/stdin", &["post"]),
        ("/v1/sandbox/sessions/{id}/processes", &["get"]),
        (
            "/v1/sandbox/sessions/{id}/processes/{process_id}/stream",
            &["get"],
        ),
        (
            "/v1/sandbox/sessions/{id}/processes/{process_id}/output",
            &["get"],
        ),
        (
            "/v1/sandbox/sessions/{id}/processes/{process_id}/stdin",
            &["post"],
        ),
        (
            "/v1/sandbox/sessions/{id}/processes/{process_id}/signal",
            &["post"],
        ),
        ("/v1/sandbox/sessions/{id}/terminal", &["get"]),
        (
            "/v1/sandbox/sessions/{id}/ports/{port}/{path}",
            &["get", "post", "put", "patch", "delete", "head", "options"],
        ),
        ("/capabilities", &["get"]),
        ("/health", &["get"]),
        ("/livez", &["get"]),
        ("/ready", &["get"]),
        ("/readyz", &["get"]),
        ("/metrics", &["get"]),
        ("/v1/executors", &["get"]),
        ("/openapi.json", &["get"]),
        ("/docs", &["get"]),
    ];
    let paths = doc["paths"].as_object().expect("paths");
    let documented: BTreeSet<&str> = paths.keys().map(String::as_str).collect();
    let routed: BTreeSet<&str> = routes.iter().map(|(p, _)| *p).collect();
    assert_eq!(documented, routed, "documented paths vs routes");
    // Two handlers on one path keep their own ids; only one handler for many methods (the ports
    // proxy) gets an id per method.
    for (path, method, id) in [
        ("/v1/sandbox/sessions/{id}", "get", "get_session"),
        ("/v1/sandbox/sessions/{id}", "delete", "delete_session"),
        (
            "/v1/sandbox/sessions/{id}/files/{path}",
            "get",
            "get_session_file",
        ),
        (
            "/v1/sandbox/sessions/{id}/files/{path}",
            "put",
            "put_session_file",
        ),
        (
            "/v1/sandbox/sessions/{id}/archive",
            "get",
            "get_session_archive",
        ),
        (
            "/v1/sandbox/sessions/{id}/archive",
            "put",
            "put_session_archive",
        ),
        (
            "/v1/sandbox/sessions/{id}/ports/{port}/{path}",
            "patch",
            "session_port_proxy_patch",
        ),
    ] {
        assert_eq!(paths[path][method]["operationId"], id, "{method} {path}");
    }
    let mut op_ids = BTreeSet::new();
    for (path, methods) in routes {
        let item = paths[*path].as_object().unwrap();
        let have: BTreeSet<&str> = item.keys().map(String::as_str).collect();
        let want: BTreeSet<&str> = methods.iter().copied().collect();
        assert_eq!(have, want, "methods of {path}");
        for m in *methods {
            let op = &item[*m];
            let id = op["operationId"].as_str().expect("operationId");
            assert!(op_ids.insert(id.to_string()), "operationId {id} twice");
            assert!(op["tags"].as_array().is_some_and(|t| !t.is_empty()));
            let responses = op["responses"].as_object().expect("responses");
            for (status, r) in responses {
                assert!(
                    status.len() == 3 && status.parse::<u16>().is_ok(),
                    "{status}"
                );
                assert!(r["description"].as_str().is_some_and(|d| !d.is_empty()));
                assert!(r["headers"]["X-Request-ID"].is_object(), "{path} {status}");
                if status == "429" || status == "503" {
                    assert!(r["headers"]["Retry-After"].is_object(), "{path} {status}");
                }
                // Every error answer is the error body (a 408 may be a timed-out result).
                let code: u16 = status.parse().unwrap();
                if code >= 400 && !path.starts_with("/ready") {
                    let schema = &r["content"]["application/json"]["schema"]["$ref"];
                    let want =
                        if code == 408 && !schema.as_str().unwrap_or("").ends_with("ErrorBody") {
                            "#/components/schemas/RunAnswer"
                        } else {
                            "#/components/schemas/ErrorBody"
                        };
                    assert_eq!(schema, want, "{path} {m} {status}");
                }
            }
            // Authenticated routes say so; the public ones do not.
            let public = [
                "/capabilities",
                "/health",
                "/livez",
                "/ready",
                "/readyz",
                "/metrics",
                "/v1/executors",
                "/openapi.json",
                "/docs",
            ]
            .contains(path);
            assert_eq!(op["security"].is_array(), !public, "security of {m} {path}");
            if !public {
                assert!(responses.contains_key("401"), "{m} {path} documents 401");
            }
        }
    }

    let schemes = &doc["components"]["securitySchemes"];
    assert_eq!(schemes["bearer"]["type"], "http");
    assert_eq!(schemes["bearer"]["scheme"], "bearer");
    assert_eq!(schemes["capability_token"]["type"], "apiKey");
    assert_eq!(schemes["capability_token"]["in"], "header");
    assert_eq!(schemes["capability_token"]["name"], "X-Capability-Token");
    let exec_req = &doc["components"]["schemas"]["ExecuteRequest"];
    assert!(exec_req["properties"]["capability_token"].is_object());
    assert_eq!(exec_req["additionalProperties"], false);

    let error = &doc["components"]["schemas"]["ErrorBody"];
    let required: BTreeSet<&str> = error["required"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        required,
        BTreeSet::from(["success", "error", "error_type", "retryable"])
    );

    let mut all = Vec::new();
    refs(&doc, &mut all);
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("a $ref outside the document: {r}"));
        assert!(
            doc["components"]["schemas"][name].is_object(),
            "$ref {r} resolves"
        );
    }
}

/// Every absolute `http(s)://` reference in a text.
fn absolute_urls(text: &str) -> Vec<String> {
    let lower = text.to_ascii_lowercase();
    let mut found = Vec::new();
    for scheme in ["http://", "https://", "//"] {
        let mut at = 0;
        while let Some(i) = lower[at..].find(scheme) {
            let start = at + i;
            // `//` alone counts only as a protocol-relative reference in an attribute or url().
            let before = lower[..start].chars().last();
            if scheme != "//" || matches!(before, Some('"' | '\'' | '(' | '=')) {
                found.push(text[start..(start + 60).min(text.len())].to_string());
            }
            at = start + scheme.len();
        }
    }
    found
}

#[tokio::test]
async fn docs_page_loads_nothing_from_elsewhere() {
    let d = Daemon::start();
    let r = d.get("/docs").await;
    assert_eq!(r.status, 200);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html"),
        "{:?}",
        r.headers["content-type"]
    );
    let csp = r.headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let html = &r.text;
    assert!(
        absolute_urls(html).is_empty(),
        "/docs references another host: {:?}",
        absolute_urls(html)
    );
    // Every asset it names is relative and served by the daemon itself.
    for attr in ["src=\"", "href=\""] {
        for piece in html.split(attr).skip(1) {
            let target = piece.split('"').next().unwrap();
            if target.starts_with('#') {
                continue;
            }
            assert!(!target.contains(':'), "{attr}{target}");
            let asset = d.get(&format!("/{target}")).await;
            assert_eq!(asset.status, 200, "/docs names {target}");
            assert!(absolute_urls(&asset.text).is_empty(), "{target}");
        }
    }
    assert!(!html.contains("<script"), "the page runs no script");
    // It shows every operation and every schema.
    let doc: Value = serde_json::from_str(&committed()).unwrap();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for op in item.as_object().unwrap().values() {
            let id = op["operationId"].as_str().unwrap();
            assert!(html.contains(&format!("id=\"op-{id}\"")), "{path}: {id}");
        }
    }
    for name in doc["components"]["schemas"].as_object().unwrap().keys() {
        assert!(html.contains(&format!("id=\"schema-{name}\"")), "{name}");
    }
}
