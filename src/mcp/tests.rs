use axum::http::{Method, StatusCode};
use serde_json::{Map, Value, json};

use super::server::render;
use super::tools::{self, Body, NoTwin, Render};

fn args(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("test arguments are objects"),
    }
}

/// The tools, each with an object schema; the REST bodies' schemas refuse unknown fields.
#[test]
fn tool_list() {
    let tools = tools::list();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "execute",
            "session_create",
            "session_exec",
            "session_delete",
            "files_read",
            "files_write",
            "files_list",
            "run_start",
            "run_status",
            "run_cancel",
            "session_pause",
            "session_resume",
            "process_list",
            "process_output",
            "process_stdin",
            "process_signal"
        ]
    );
    for t in &tools {
        assert_eq!(t.input_schema["type"], json!("object"), "{}", t.name);
        assert_eq!(
            t.input_schema["additionalProperties"],
            json!(false),
            "{}",
            t.name
        );
    }
    let execute = &tools[0].input_schema;
    assert_eq!(execute["required"], json!(["action_type", "command"]));
    assert!(execute["properties"]["capability_token"].is_object());
    let exec = &tools[2].input_schema;
    assert_eq!(exec["required"][0], json!("session_id"));
    assert!(exec["properties"]["code"].is_object());
    assert!(exec["properties"]["session_id"].is_object());
}

/// Each call's twin: its route (ids and paths encoded, never able to name another route) and body.
#[test]
fn twins() {
    let t = tools::twin(
        "session_exec",
        args(json!({"session_id": "ses_1", "code": "x"})),
    )
    .unwrap();
    assert_eq!(t.uri, "/v1/sandbox/sessions/ses_1/exec");
    // A run waited for is cancelled when the call is given up, unless the call says otherwise.
    assert_eq!(
        t.body,
        Body::Json(json!({"code": "x", "cancel_on_disconnect": true}))
    );
    let t = tools::twin(
        "session_exec",
        args(json!({"session_id": "ses_1", "code": "x", "cancel_on_disconnect": false, "background": true})),
    )
    .unwrap();
    assert_eq!(
        t.body,
        Body::Json(json!({"code": "x", "cancel_on_disconnect": false, "background": true}))
    );
    // Runs are not REST twins: they go through `calls` (see `McpServer::execute`).
    assert_eq!(
        tools::twin("execute", args(json!({"command": "echo"}))),
        Err(NoTwin::UnknownTool("execute".into()))
    );

    let t = tools::twin(
        "files_read",
        args(json!({"session_id": "../x?y", "path": "dir/a b#?.txt"})),
    )
    .unwrap();
    assert_eq!(t.method, Method::GET);
    assert_eq!(
        t.uri,
        "/v1/sandbox/sessions/..%2Fx%3Fy/files/dir/a%20b%23%3F.txt"
    );

    let t = tools::twin(
        "files_write",
        args(json!({"session_id": "ses_1", "path": "b.bin", "content_b64": "AP8="})),
    )
    .unwrap();
    assert_eq!((t.method, t.body), (Method::PUT, Body::Bytes(vec![0, 255])));

    let t = tools::twin(
        "files_list",
        args(json!({"session_id": "ses_1", "path": "a&b"})),
    )
    .unwrap();
    assert_eq!(t.uri, "/v1/sandbox/sessions/ses_1/files?path=a%26b");

    let t = tools::twin("run_status", args(json!({"exec_id": "e1"}))).unwrap();
    assert_eq!(t.uri, "/v1/executions/e1");
    let t = tools::twin(
        "run_cancel",
        args(json!({"exec_id": "e1", "session_id": "ses_1", "grace_seconds": 0})),
    )
    .unwrap();
    assert_eq!(t.uri, "/v1/sandbox/sessions/ses_1/execs/e1/cancel");
    assert_eq!(t.body, Body::Json(json!({"grace_seconds": 0})));

    // A session's pause and processes: their routes, ids encoded.
    let t = tools::twin("session_pause", args(json!({"session_id": "ses_1"}))).unwrap();
    assert_eq!(
        (t.method, t.uri.as_str()),
        (Method::POST, "/v1/sandbox/sessions/ses_1/pause")
    );
    let t = tools::twin("session_resume", args(json!({"session_id": "ses_1"}))).unwrap();
    assert_eq!(t.uri, "/v1/sandbox/sessions/ses_1/resume");
    let t = tools::twin("process_list", args(json!({"session_id": "ses_1"}))).unwrap();
    assert_eq!(
        (t.method, t.uri.as_str()),
        (Method::GET, "/v1/sandbox/sessions/ses_1/processes")
    );
    let t = tools::twin(
        "process_output",
        args(json!({"session_id": "ses_1", "process_id": "p/../1", "stdout_from": 7})),
    )
    .unwrap();
    assert_eq!(
        t.uri,
        "/v1/sandbox/sessions/ses_1/processes/p%2F..%2F1/output?stdout_from=7&stderr_from=0"
    );
    let t = tools::twin(
        "process_stdin",
        args(json!({"session_id": "ses_1", "process_id": "p1", "data": "hi\n", "eof": true})),
    )
    .unwrap();
    assert_eq!(
        (t.method, t.uri.as_str(), t.body),
        (
            Method::POST,
            "/v1/sandbox/sessions/ses_1/processes/p1/stdin?eof=true",
            Body::Bytes(b"hi\n".to_vec())
        )
    );
    let t = tools::twin(
        "process_signal",
        args(json!({"session_id": "ses_1", "process_id": "p1", "signal": "INT"})),
    )
    .unwrap();
    assert_eq!(t.uri, "/v1/sandbox/sessions/ses_1/processes/p1/signal");
    assert_eq!(t.body, Body::Json(json!({"signal": "INT"})));

    let t = tools::twin("session_delete", args(json!({"session_id": "ses_1"}))).unwrap();
    assert_eq!(
        (t.method, t.uri.as_str()),
        (Method::DELETE, "/v1/sandbox/sessions/ses_1")
    );
}

/// A call's own malformed arguments are the REST 400; an unknown tool has no twin.
#[test]
fn bad_calls() {
    let invalid = |tool: &str, v: Value| match tools::twin(tool, args(v)) {
        Err(NoTwin::Invalid(m)) => m,
        other => panic!("{tool}: {other:?}"),
    };
    assert!(invalid("session_exec", json!({"code": "x"})).contains("session_id"));
    assert!(
        invalid("files_write", json!({"session_id": "s", "path": "a"})).contains("exactly one")
    );
    assert!(
        invalid(
            "files_write",
            json!({"session_id": "s", "path": "a", "content": "", "content_b64": ""})
        )
        .contains("exactly one")
    );
    assert!(
        invalid(
            "files_write",
            json!({"session_id": "s", "path": "a", "content_b64": "!"})
        )
        .contains("content_b64")
    );
    assert!(invalid("run_status", json!({"exec_id": "e", "bogus": 1})).contains("bogus"));
    assert!(
        invalid(
            "process_output",
            json!({"session_id": "s", "process_id": ""})
        )
        .contains("process_id is empty")
    );
    assert!(invalid("files_list", json!({"session_id": ""})).contains("session_id is empty"));
    assert!(
        invalid(
            "process_stdin",
            json!({"session_id": "s", "process_id": "p", "data": "", "data_b64": ""})
        )
        .contains("at most one")
    );
    assert!(
        invalid(
            "process_signal",
            json!({"session_id": "s", "process_id": "p", "signal": "STOP"})
        )
        .contains("signal")
    );
    assert_eq!(
        tools::twin("rm", Map::new()),
        Err(NoTwin::UnknownTool("rm".into()))
    );
}

/// An error status is `isError` with the REST body; a file's bytes are text or base64.
#[test]
fn results() {
    let body = br#"{"success":false,"error":"no","error_type":"CapabilityViolation"}"#;
    let r = render(&Render::Json, StatusCode::FORBIDDEN, body);
    assert_eq!(r.is_error, Some(true));
    assert_eq!(
        r.structured_content.unwrap()["error_type"],
        json!("CapabilityViolation")
    );

    let file = |bytes: &[u8]| {
        render(
            &Render::File {
                session_id: "s".into(),
                path: "p".into(),
            },
            StatusCode::OK,
            bytes,
        )
        .structured_content
        .unwrap()
    };
    assert_eq!(file(b"hi")["content"], json!("hi"));
    let v = file(&[0xff]);
    assert_eq!(
        (v["content_b64"].clone(), v["size"].clone()),
        (json!("/w=="), json!(1))
    );
    assert!(v.get("content").is_none());

    let r = render(
        &Render::Deleted {
            session_id: "s".into(),
        },
        StatusCode::NO_CONTENT,
        b"",
    );
    assert_eq!(r.is_error, Some(false));
    assert_eq!(
        r.structured_content.unwrap(),
        json!({"session_id": "s", "deleted": true})
    );
}

/// The listen address's host is allowed beside the configured ones, unless it is a wildcard or
/// the list is empty (any host).
#[test]
fn allowed_hosts() {
    let mut c = crate::config::Config::load(None, &Default::default()).unwrap();
    c.server.listen = "10.1.2.3:8003".into();
    assert!(super::allowed_hosts(&c).contains(&"10.1.2.3".to_string()));
    c.server.listen = "0.0.0.0:8003".into();
    assert_eq!(super::allowed_hosts(&c), c.mcp.allowed_hosts);
    c.mcp.allowed_hosts.clear();
    c.server.listen = "10.1.2.3:8003".into();
    assert!(super::allowed_hosts(&c).is_empty());
}

/// An MCP session's id opens only for the service that opened the session; a changed id or tag
/// opens for no one.
#[test]
fn session_seal() {
    let seal = super::SessionSeal::new();
    let sealed = seal.seal("orchestrator", "5f0c-1.2");
    assert_eq!(seal.open("orchestrator", &sealed), Some("5f0c-1.2"));
    assert_eq!(seal.open("intruder", &sealed), None);
    assert_eq!(seal.open("-", &sealed), None);
    assert_eq!(seal.open("orchestrator", "5f0c-1.2"), None);
    assert_eq!(seal.open("orchestrator", &format!("{sealed}0")), None);
    let other = sealed.replacen("5f0c", "5f0d", 1);
    assert_eq!(seal.open("orchestrator", &other), None);
    // The owner and the id are not one string run together.
    let a = seal.seal("ab", "c");
    assert_eq!(seal.open("a", &a.replacen("c.", "bc.", 1)), None);
    // Another process's seal opens nothing of this one's.
    assert_eq!(
        super::SessionSeal::new().open("orchestrator", &sealed),
        None
    );
}
