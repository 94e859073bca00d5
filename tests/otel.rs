//! Tracing spans and their OTLP export (README, "Observability"), against the real daemon on the
//! local backend: an in-test OTLP/HTTP receiver collects what the daemon exports, and the span
//! tree of one request is checked against the `traceparent` it came with.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Daemon, Opts};
use http_body_util::BodyExt as _;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message as _;
use serde_json::{Value, json};

/// One request an OTLP receiver got: path, content type, body.
type Post = (String, String, Vec<u8>);

/// An OTLP/HTTP receiver on 127.0.0.1: every request it gets.
struct Receiver {
    port: u16,
    posts: Arc<Mutex<Vec<Post>>>,
    connections: Arc<std::sync::atomic::AtomicUsize>,
}

impl Receiver {
    async fn start() -> Receiver {
        Self::on(
            tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind"),
        )
        .await
    }

    async fn on(listener: tokio::net::TcpListener) -> Receiver {
        let port = listener.local_addr().expect("addr").port();
        let posts = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (p, c) = (posts.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let p = p.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let p = p.clone();
                            async move {
                                let path = req.uri().path().to_string();
                                let ctype = req
                                    .headers()
                                    .get("content-type")
                                    .and_then(|v| v.to_str().ok())
                                    .unwrap_or_default()
                                    .to_string();
                                let body = req
                                    .into_body()
                                    .collect()
                                    .await
                                    .map(|b| b.to_bytes().to_vec())
                                    .unwrap_or_default();
                                p.lock().unwrap().push((path, ctype, body));
                                // An empty ExportTraceServiceResponse: everything accepted.
                                hyper::Response::builder()
                                    .header("content-type", "application/x-protobuf")
                                    .body(http_body_util::Full::new(bytes::Bytes::new()))
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Receiver {
            port,
            posts,
            connections,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Every span received so far, with the resource's `service.name`.
    fn spans(&self) -> Vec<Span> {
        let mut out = Vec::new();
        for (path, ctype, body) in self.posts.lock().unwrap().iter() {
            assert_eq!(path, "/v1/traces");
            assert_eq!(ctype, "application/x-protobuf");
            let req = ExportTraceServiceRequest::decode(&body[..]).expect("OTLP protobuf");
            for rs in req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| attrs(&r.attributes).remove("service.name"))
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for s in ss.spans {
                        out.push(Span {
                            name: s.name,
                            trace_id: hex::encode(s.trace_id),
                            span_id: hex::encode(s.span_id),
                            parent: hex::encode(s.parent_span_id),
                            attrs: attrs(&s.attributes),
                            service: service.clone(),
                        });
                    }
                }
            }
        }
        out
    }
}

#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    attrs: HashMap<String, String>,
    service: String,
}

fn attrs(kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

/// A fresh W3C trace context: (traceparent, trace id, parent span id).
fn traceparent() -> (String, String, String) {
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let parent = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
    (format!("00-{trace_id}-{parent}-01"), trace_id, parent)
}

/// POST /execute with `traceparent` and `x-request-id`.
async fn execute(d: &Daemon, body: Value, traceparent: &str, request_id: &str) -> common::Resp {
    let mut body = body;
    body["capability_token"] = Value::String(d.cap_all());
    let svc = format!("Bearer {}", d.service_token());
    d.post(
        "/execute",
        &[
            ("authorization", &svc),
            ("traceparent", traceparent),
            ("x-request-id", request_id),
        ],
        body.to_string(),
    )
    .await
}

/// The span's ancestors' names, nearest first, within `spans`.
fn ancestors<'a>(spans: &'a [Span], span: &'a Span) -> Vec<&'a str> {
    let mut names = Vec::new();
    let mut cur = span;
    while let Some(p) = spans.iter().find(|s| s.span_id == cur.parent) {
        names.push(p.name.as_str());
        cur = p;
    }
    names
}

/// The request's spans (its trace): the `http.request` of `route` and everything under it.
fn trace_of(spans: &[Span], trace_id: &str) -> Vec<Span> {
    spans
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .cloned()
        .collect()
}

/// Log lines (JSON) that carry `message`.
fn log_lines(d: &Daemon, message: &str) -> Vec<Value> {
    d.log
        .try_iter()
        .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
        .filter(|v| v["fields"]["message"] == message)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn spans_of_a_request_reach_the_otlp_endpoint_under_its_traceparent() {
    let rx = Receiver::start().await;
    let mut d = Daemon::start_with(Opts {
        env: vec![("OTEL_EXPORTER_OTLP_ENDPOINT".into(), rx.endpoint())],
        ..Default::default()
    });

    // A synchronous run.
    let (tp, trace_id, parent) = traceparent();
    let r = execute(
        &d,
        json!({"action_type": "shell", "command": "echo", "args": ["traced"]}),
        &tp,
        "otel-sync-1",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().expect("exec_id").to_string();
    let backend = r.json["backend"].as_str().expect("backend").to_string();
    let profile = r.json["profile"].as_str().expect("profile").to_string();

    // An async run: its steps belong to the request that started it, answered long before.
    let (tp2, trace_id2, parent2) = traceparent();
    let r = execute(
        &d,
        json!({"action_type": "shell", "command": "echo", "args": ["later"], "async": true}),
        &tp2,
        "otel-async-1",
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id2 = r.json["exec_id"].as_str().expect("exec_id").to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = d
            .get_authorized(&format!("/v1/executions/{exec_id2}"))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.json["status"] == "finished" {
            break;
        }
        assert!(Instant::now() < deadline, "{exec_id2} still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A session's exec: the same steps as /execute, under its own route.
    let sessions = common::sessions::koder(&d, None);
    let session = common::sessions::new_session(&sessions, "bash").await;
    let (tp3, trace_id3, parent3) = traceparent();
    let svc = format!("Bearer {}", d.service_token());
    let r = d
        .post(
            &format!("/v1/sandbox/sessions/{session}/exec"),
            &[("authorization", &svc), ("traceparent", &tp3)],
            json!({"code": "echo in-session"}).to_string(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let exec_id3 = r.json["exec_id"].as_str().expect("exec_id").to_string();

    // A refused command of 100 000 characters: its span carries a clipped copy (a caller must
    // not set the size of what waits in the exporter's queue).
    let (tp4, trace_id4, _) = traceparent();
    let r = execute(
        &d,
        json!({"action_type": "shell", "command": "x".repeat(100_000)}),
        &tp4,
        "otel-long-1",
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text);

    // The log lines are what they were without export: their own fields, no span fields.
    let starts = log_lines(&d, "execution start");
    assert!(!starts.is_empty());
    for l in &starts {
        assert!(l.get("span").is_none() && l.get("spans").is_none(), "{l}");
    }

    // A graceful stop exports what is still queued (the batch delay is 5 s: nothing went yet).
    assert_eq!(d.stop(), Some(0));
    let spans = rx.spans();
    assert!(!spans.is_empty(), "nothing exported");
    assert!(spans.iter().all(|s| s.service == "executor-arm"));

    let long = trace_of(&spans, &trace_id4);
    let decide = long
        .iter()
        .find(|s| s.name == "policy.decide")
        .expect("policy.decide of the long command");
    let command = &decide.attrs["command"];
    assert!(
        command.starts_with("xxxx") && command.chars().count() <= 129,
        "{} characters exported",
        command.chars().count()
    );

    let trace = trace_of(&spans, &trace_id);
    let names: Vec<&str> = trace.iter().map(|s| s.name.as_str()).collect();
    for want in [
        "http.request",
        "auth",
        "policy.decide",
        "sandbox.run",
        "audit.append",
    ] {
        assert!(names.contains(&want), "no {want} span in {names:?}");
    }
    let roots: Vec<&Span> = trace.iter().filter(|s| s.name == "http.request").collect();
    assert_eq!(roots.len(), 1, "{roots:#?}");
    let root = roots[0];
    assert_eq!(
        root.parent, parent,
        "http.request's parent is the traceparent's"
    );
    assert_eq!(root.attrs["request_id"], "otel-sync-1");
    assert_eq!(root.attrs["exec_id"], exec_id);
    assert_eq!(root.attrs["http.route"], "/execute");
    assert_eq!(root.attrs["http.response.status_code"], "200");
    for s in trace.iter().filter(|s| s.name != "http.request") {
        assert_eq!(
            ancestors(&trace, s).last(),
            Some(&"http.request"),
            "{} is not under http.request: {trace:#?}",
            s.name
        );
    }
    let run = trace.iter().find(|s| s.name == "sandbox.run").unwrap();
    assert_eq!(run.attrs["backend"], backend);
    assert_eq!(run.attrs["profile"], profile);
    assert_eq!(run.attrs["exec_id"], exec_id);
    assert_eq!(run.attrs["request_id"], "otel-sync-1");
    let audited: Vec<&str> = trace
        .iter()
        .filter(|s| s.name == "audit.append")
        .map(|s| s.attrs["event"].as_str())
        .collect();
    assert!(
        audited.contains(&"execution_start") && audited.contains(&"execution"),
        "{audited:?}"
    );
    let auths: Vec<&str> = trace
        .iter()
        .filter(|s| s.name == "auth")
        .map(|s| s.attrs["token_kind"].as_str())
        .collect();
    assert_eq!(auths, ["Service", "Capability"]);

    // The async run: the same steps, under the /execute that started it.
    let trace = trace_of(&spans, &trace_id2);
    let root = trace
        .iter()
        .find(|s| s.name == "http.request")
        .expect("http.request of the async run");
    assert_eq!(root.parent, parent2);
    assert_eq!(root.attrs["exec_id"], exec_id2);
    assert_eq!(root.attrs["http.response.status_code"], "202");
    let run = trace
        .iter()
        .find(|s| s.name == "sandbox.run")
        .expect("sandbox.run of the async run");
    assert_eq!(run.attrs["exec_id"], exec_id2);
    assert_eq!(ancestors(&trace, run), ["http.request"]);
    let end = trace
        .iter()
        .find(|s| s.name == "audit.append" && s.attrs["event"] == "execution")
        .expect("the async run's end line");
    assert_eq!(ancestors(&trace, end), ["http.request"]);

    // The session's exec.
    let trace = trace_of(&spans, &trace_id3);
    let root = trace
        .iter()
        .find(|s| s.name == "http.request")
        .expect("http.request of the session's exec");
    assert_eq!(root.parent, parent3);
    assert_eq!(root.attrs["http.route"], "/v1/sandbox/sessions/{id}/exec");
    assert_eq!(root.attrs["exec_id"], exec_id3);
    for name in ["auth", "policy.decide", "sandbox.run", "audit.append"] {
        let s = trace
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} in the session's exec: {trace:#?}"));
        assert_eq!(ancestors(&trace, s), ["http.request"], "{name}");
    }

    // A request without traceparent starts a trace of its own (the polls of the async run).
    let polls: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "http.request" && s.attrs["http.route"] == "/v1/executions/{exec_id}")
        .collect();
    assert!(!polls.is_empty());
    assert!(
        polls
            .iter()
            .all(|s| s.parent.is_empty() && s.trace_id != trace_id && s.trace_id != trace_id2)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn without_an_otlp_endpoint_nothing_is_exported() {
    // Where the exporter would send by default (http://localhost:4318), when that port is free
    // here; else any port: either way nothing may arrive.
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:4318").await {
        Ok(l) => l,
        Err(_) => tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    };
    let rx = Receiver::on(listener).await;
    let mut d = Daemon::start_with(Opts {
        env: vec![("OTEL_SERVICE_NAME".into(), "not-exporting".into())],
        ..Default::default()
    });
    assert!(
        !d.startup_log.iter().any(|l| l.contains("OTLP")),
        "{:#?}",
        d.startup_log
    );
    let (tp, _, _) = traceparent();
    let r = execute(
        &d,
        json!({"action_type": "shell", "command": "echo", "args": ["quiet"]}),
        &tp,
        "otel-off-1",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(d.stop(), Some(0));
    assert_eq!(rx.connections(), 0);
}
