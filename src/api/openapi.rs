//! The API's OpenAPI 3.1 document, generated from the handlers' `#[utoipa::path]` annotations and
//! the request, response and error types they name; `GET /openapi.json` serves it and `GET /docs`
//! renders it as one self-contained HTML page (no script, no asset fetched from anywhere).
//!
//! Owns: the document's assembly (security schemes, the headers every answer carries) and its two
//! renderings. Must not: describe a route or a body by hand (the handlers and types do).

use std::fmt::Write as _;
use std::sync::OnceLock;

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{HeaderBuilder, ObjectBuilder, RefOr, Required, Type};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "executor-arm",
        description = "A hardened daemon that runs commands for other services: it authenticates the calling service (Bearer service token), checks a capability token and a command allowlist, runs the command or a registered external executor in a sandbox, enforces limits, and returns the result with SHA-256 provenance. Every error body is `{\"success\": false, \"error\", \"error_type\", \"retryable\"}`; 429 and 503 carry `Retry-After`; every answer carries `X-Request-ID`. `/mcp` (not described by this document) serves the same runs, sessions and files as Model Context Protocol tools over Streamable HTTP (JSON-RPC, the official SDK), with the same service token, capability grants, errors and audit lines; the README's MCP section lists its tools.",
    ),
    paths(
        super::execute::execute,
        super::executions::get,
        super::executions::stream,
        super::executions::cancel,
        super::receipts::execution_receipt,
        super::receipts::list_keys,
        super::sessions::create,
        super::sessions::get,
        super::sessions::delete,
        super::sessions::pause,
        super::sessions::resume,
        super::sessions::exec,
        super::sessions::exec_get,
        super::sessions::exec_stream,
        super::sessions::exec_cancel,
        super::receipts::session_exec_receipt,
        super::processes::exec_stdin,
        super::processes::list,
        super::processes::stream,
        super::processes::output,
        super::processes::stdin,
        super::processes::signal,
        super::terminal::terminal,
        super::ports::proxy,
        super::sessions::list_files,
        super::sessions::get_file,
        super::sessions::put_file,
        super::sessions::get_archive,
        super::sessions::put_archive,
        super::ops::capabilities,
        super::ops::health,
        super::ops::livez,
        super::ops::ready,
        super::ops::readyz,
        super::ops::metrics,
        super::ops::executors,
        serve_document,
        docs,
    ),
    modifiers(&Conventions),
    tags(
        (name = "execute", description = "Run one command or executor"),
        (name = "runs", description = "Read, stream and cancel a run"),
        (name = "sessions", description = "Sandboxes kept across execs, with their workspace"),
        (name = "operations", description = "Health, readiness, capabilities, metrics"),
        (name = "documents", description = "This document and its HTML rendering"),
    )
)]
struct ApiDoc;

/// What every operation shares and the annotations do not repeat: the security schemes, the
/// request id on every request and answer, `Retry-After` on every 429 and 503.
struct Conventions;

impl Modify for Conventions {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT or static token")
                    .description(Some(
                        "The calling service's token: a service JWT from a trusted issuer, or a \
                         static token whose SHA-256 is configured.",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "capability_token",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-Capability-Token",
                "What this call may do: a short-lived capability JWT, or a static `tok_…` token. \
                 It may be sent instead in the request body's `capability_token` field (not both).",
            ))),
        );
        for item in doc.paths.paths.values_mut() {
            // One handler for many methods (the ports proxy) is one operation per method, each
            // with an id of its own; handlers of their own on one path keep theirs.
            let ops = [
                ("get", &mut item.get),
                ("put", &mut item.put),
                ("post", &mut item.post),
                ("delete", &mut item.delete),
                ("head", &mut item.head),
                ("patch", &mut item.patch),
                ("options", &mut item.options),
            ];
            let ids: Vec<&str> = ops
                .iter()
                .filter_map(|(_, op)| op.as_ref()?.operation_id.as_deref())
                .collect();
            let shared: Vec<String> = ids
                .iter()
                .filter(|id| ids.iter().filter(|other| other == id).count() > 1)
                .map(|id| id.to_string())
                .collect();
            for (method, op) in ops {
                let Some(op) = op else { continue };
                if let Some(id) = op.operation_id.as_mut()
                    && shared.contains(id)
                {
                    *id = format!("{id}_{method}");
                }
                operation_conventions(op);
            }
        }
    }
}

/// The request id on an operation's request and answers, `Retry-After` on its 429 and 503.
fn operation_conventions(op: &mut utoipa::openapi::path::Operation) {
    op.parameters
        .get_or_insert_with(Vec::new)
        .push(request_id());
    for (status, response) in op.responses.responses.iter_mut() {
        let RefOr::T(response) = response else {
            continue;
        };
        response
            .headers
            .insert("X-Request-ID".into(), request_id_header());
        if status == "429" || status == "503" {
            response
                .headers
                .insert("Retry-After".into(), retry_after_header());
        }
    }
}

fn request_id() -> Parameter {
    ParameterBuilder::new()
        .name("X-Request-ID")
        .parameter_in(ParameterIn::Header)
        .required(Required::False)
        .description(Some(
            "Echoed in the answer's X-Request-ID when it is 1-128 characters of [A-Za-z0-9._-]; \
             otherwise a UUID is generated",
        ))
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .build()
}

fn request_id_header() -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(ObjectBuilder::new().schema_type(Type::String))
        .description(Some("The caller's request id, or a generated UUID"))
        .build()
}

fn retry_after_header() -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(0)),
        )
        .description(Some("Seconds to wait before retrying"))
        .build()
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The document as `/openapi.json` serves it and `openapi/executor-arm.json` holds it: pretty
/// JSON and a final newline.
pub fn document_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        let mut s = document()
            .to_pretty_json()
            .expect("the OpenAPI document serialises");
        s.push('\n');
        s
    })
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "openapi",
    tag = "documents",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object))
)]
pub async fn serve_document() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        document_json(),
    )
        .into_response()
}

/// This API's reference as one HTML page.
#[utoipa::path(
    get,
    path = "/docs",
    operation_id = "docs",
    tag = "documents",
    responses((status = 200, description = "The API reference, rendered from the document", body = String, content_type = "text/html; charset=utf-8"))
)]
pub async fn docs() -> Response {
    static HTML: OnceLock<String> = OnceLock::new();
    let html = HTML.get_or_init(|| {
        let doc: Value = serde_json::from_str(document_json()).unwrap_or(Value::Null);
        render_html(&doc)
    });
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            // The page is self-contained: nothing may be loaded from anywhere.
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'"),
            ),
        ],
        html.as_str(),
    )
        .into_response()
}

fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Text with `code` spans, escaped.
fn prose(s: &str) -> String {
    let mut out = String::new();
    for (i, part) in s.split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{}</code>", esc(part));
        } else {
            out.push_str(&esc(part));
        }
    }
    out
}

/// A schema's type as a short phrase, linking to named schemas.
fn type_of(schema: &Value) -> String {
    if let Some(r) = schema["$ref"].as_str() {
        let name = r.rsplit('/').next().unwrap_or(r);
        return format!("<a href=\"#schema-{0}\">{0}</a>", esc(name));
    }
    for key in ["oneOf", "anyOf", "allOf"] {
        if let Some(list) = schema[key].as_array() {
            let parts: Vec<String> = list.iter().map(type_of).collect();
            let sep = if key == "allOf" { " and " } else { " or " };
            return parts.join(sep);
        }
    }
    let mut base = match &schema["type"] {
        Value::String(t) => t.clone(),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" | "),
        _ => "any".to_string(),
    };
    if base.starts_with("array") {
        base = format!("array of {}", type_of(&schema["items"]));
        if schema["type"]
            .as_array()
            .is_some_and(|t| t.iter().any(|v| v == "null"))
        {
            base.push_str(" | null");
        }
    } else {
        base = esc(&base);
    }
    if let Some(values) = schema["enum"].as_array() {
        let values: Vec<String> = values
            .iter()
            .map(|v| format!("<code>{}</code>", esc(&v.to_string())))
            .collect();
        base = format!("one of {}", values.join(", "));
    }
    if let Some(p) = schema["pattern"].as_str() {
        let _ = write!(base, " matching <code>{}</code>", esc(p));
    }
    match (schema.get("minimum"), schema.get("maximum")) {
        (Some(lo), Some(hi)) => {
            let _ = write!(base, ", {lo}–{hi}");
        }
        (Some(lo), None) => {
            let _ = write!(base, ", ≥ {lo}");
        }
        (None, Some(hi)) => {
            let _ = write!(base, ", ≤ {hi}");
        }
        (None, None) => {}
    }
    base
}

/// The whole document as one page: operations by tag, then every schema.
fn render_html(doc: &Value) -> String {
    let mut h = String::new();
    let title = doc["info"]["title"].as_str().unwrap_or("API");
    let version = doc["info"]["version"].as_str().unwrap_or("");
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{t} {v} API</title>\n<style>{STYLE}</style>\n</head>\n<body>\n\
         <h1>{t} <small>{v}</small></h1>\n<p>{d}</p>\n\
         <p>The machine-readable document: <a href=\"openapi.json\">openapi.json</a> (OpenAPI {o}).</p>\n",
        t = esc(title),
        v = esc(version),
        d = prose(doc["info"]["description"].as_str().unwrap_or("")),
        o = esc(doc["openapi"].as_str().unwrap_or("")),
    );
    h.push_str("<h2>Authentication</h2>\n<dl>\n");
    if let Some(schemes) = doc["components"]["securitySchemes"].as_object() {
        for (name, s) in schemes {
            let how = match s["type"].as_str() {
                Some("http") => format!("HTTP {}", s["scheme"].as_str().unwrap_or("")),
                Some("apiKey") => format!(
                    "{} {}",
                    s["in"].as_str().unwrap_or(""),
                    s["name"].as_str().unwrap_or("")
                ),
                _ => String::new(),
            };
            let _ = writeln!(
                h,
                "<dt><code>{}</code> — {}</dt><dd>{}</dd>",
                esc(name),
                esc(&how),
                prose(s["description"].as_str().unwrap_or(""))
            );
        }
    }
    h.push_str("</dl>\n");

    let empty = serde_json::Map::new();
    let paths = doc["paths"].as_object().unwrap_or(&empty);
    let tags = doc["tags"].as_array().cloned().unwrap_or_default();
    for tag in &tags {
        let tag_name = tag["name"].as_str().unwrap_or("");
        let _ = writeln!(
            h,
            "<h2>{}</h2>\n<p>{}</p>",
            esc(tag_name),
            prose(tag["description"].as_str().unwrap_or(""))
        );
        for (path, item) in paths {
            for method in ["get", "put", "post", "delete", "head", "patch", "options"] {
                let op = &item[method];
                if !op.is_object()
                    || !op["tags"]
                        .as_array()
                        .is_some_and(|t| t.iter().any(|x| x == tag_name))
                {
                    continue;
                }
                render_operation(&mut h, method, path, op);
            }
        }
    }

    h.push_str("<h2>Schemas</h2>\n");
    if let Some(schemas) = doc["components"]["schemas"].as_object() {
        for (name, schema) in schemas {
            let _ = writeln!(
                h,
                "<section class=\"schema\" id=\"schema-{n}\">\n<h3>{n}</h3>",
                n = esc(name)
            );
            if let Some(d) = schema["description"].as_str() {
                let _ = writeln!(h, "<p>{}</p>", prose(d));
            }
            match schema["properties"].as_object() {
                Some(props) => {
                    let required: Vec<&str> = schema["required"]
                        .as_array()
                        .map(|r| r.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    h.push_str(
                        "<table><tr><th>field</th><th>type</th><th>required</th><th>description</th></tr>\n",
                    );
                    for (field, p) in props {
                        let _ = writeln!(
                            h,
                            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
                            esc(field),
                            type_of(p),
                            if required.contains(&field.as_str()) {
                                "yes"
                            } else {
                                "no"
                            },
                            prose(p["description"].as_str().unwrap_or(""))
                        );
                    }
                    h.push_str("</table>\n");
                }
                None => {
                    let _ = writeln!(h, "<p>{}</p>", type_of(schema));
                }
            }
            h.push_str("</section>\n");
        }
    }
    h.push_str("</body>\n</html>\n");
    h
}

fn render_operation(h: &mut String, method: &str, path: &str, op: &Value) {
    let _ = writeln!(
        h,
        "<section class=\"op\" id=\"op-{id}\">\n<h3><span class=\"m {m}\">{M}</span> <code>{p}</code></h3>",
        id = esc(op["operationId"].as_str().unwrap_or("")),
        m = method,
        M = method.to_ascii_uppercase(),
        p = esc(path)
    );
    for key in ["summary", "description"] {
        if let Some(t) = op[key].as_str() {
            let _ = writeln!(h, "<p>{}</p>", prose(t));
        }
    }
    if let Some(security) = op["security"].as_array() {
        let alternatives: Vec<String> = security
            .iter()
            .filter_map(Value::as_object)
            .map(|all| {
                all.keys()
                    .map(|k| format!("<code>{}</code>", esc(k)))
                    .collect::<Vec<_>>()
                    .join(" and ")
            })
            .collect();
        let _ = writeln!(h, "<p>Authentication: {}.</p>", alternatives.join(", or "));
    }
    if let Some(params) = op["parameters"].as_array() {
        h.push_str("<table><tr><th>parameter</th><th>in</th><th>type</th><th>required</th><th>description</th></tr>\n");
        for p in params {
            let _ = writeln!(
                h,
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(p["name"].as_str().unwrap_or("")),
                esc(p["in"].as_str().unwrap_or("")),
                type_of(&p["schema"]),
                if p["required"] == true { "yes" } else { "no" },
                prose(p["description"].as_str().unwrap_or(""))
            );
        }
        h.push_str("</table>\n");
    }
    if let Some(body) = op["requestBody"].as_object() {
        let _ = write!(h, "<p>Request body");
        if body.get("required") == Some(&Value::Bool(true)) {
            h.push_str(" (required)");
        }
        if let Some(d) = body.get("description").and_then(Value::as_str) {
            let _ = write!(h, " — {}", prose(d));
        }
        h.push_str(":</p>\n<ul>\n");
        if let Some(content) = body.get("content").and_then(Value::as_object) {
            for (ct, c) in content {
                let _ = writeln!(
                    h,
                    "<li><code>{}</code>: {}</li>",
                    esc(ct),
                    type_of(&c["schema"])
                );
            }
        }
        h.push_str("</ul>\n");
    }
    h.push_str(
        "<table><tr><th>status</th><th>description</th><th>body</th><th>headers</th></tr>\n",
    );
    if let Some(responses) = op["responses"].as_object() {
        for (status, r) in responses {
            let bodies: Vec<String> = r["content"]
                .as_object()
                .map(|c| {
                    c.iter()
                        .map(|(ct, c)| {
                            format!("<code>{}</code>: {}", esc(ct), type_of(&c["schema"]))
                        })
                        .collect()
                })
                .unwrap_or_default();
            let headers: Vec<String> = r["headers"]
                .as_object()
                .map(|hs| {
                    hs.keys()
                        .map(|k| format!("<code>{}</code>", esc(k)))
                        .collect()
                })
                .unwrap_or_default();
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(status),
                prose(r["description"].as_str().unwrap_or("")),
                bodies.join("<br>"),
                headers.join(", ")
            );
        }
    }
    h.push_str("</table>\n</section>\n");
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;color:#1a1a1a;line-height:1.45}\
h1 small{font-weight:normal;color:#666}\
h2{border-bottom:1px solid #ccc;padding-bottom:.2rem;margin-top:2.5rem}\
section{margin:1.2rem 0 2rem}\
table{border-collapse:collapse;width:100%;margin:.5rem 0;font-size:.92rem}\
th,td{border:1px solid #ddd;padding:.3rem .5rem;text-align:left;vertical-align:top}\
th{background:#f4f4f4}\
code{background:#f4f4f4;padding:0 .2rem;border-radius:3px}\
.m{display:inline-block;min-width:4.2rem;text-align:center;color:#fff;border-radius:3px;padding:.05rem .4rem;font-size:.85rem}\
.get{background:#2f6fb0}.post{background:#2e8b57}.put{background:#b8860b}.delete{background:#b22222}";
