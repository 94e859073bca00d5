//! A sessions client written from the two calls of the sessions contract alone, shared by the
//! local and the container sessions tests.

use serde_json::{Value, json};

use super::{Daemon, Resp};

/// A client written from the two calls of the sessions contract alone, in the shape of a
/// workflow engine's HTTP sandbox client: service-account bearer, tenant header, JSON bodies.
pub struct SandboxClient<'a> {
    pub d: &'a Daemon,
    pub service: String,
    pub tenant: Option<&'a str>,
}

impl SandboxClient<'_> {
    pub fn headers(&self) -> Vec<(String, String)> {
        let mut h = vec![("authorization".into(), format!("Bearer {}", self.service))];
        if let Some(t) = self.tenant {
            h.push(("x-koder-tenant".into(), t.into()));
        }
        h
    }

    pub async fn call(&self, method: &str, path: &str, body: Option<Vec<u8>>) -> Resp {
        let url = format!("{}{path}", self.d.base);
        let mut rb = match method {
            "GET" => self.d.client.get(url),
            "PUT" => self.d.client.put(url),
            "DELETE" => self.d.client.delete(url),
            _ => self.d.client.post(url),
        };
        for (k, v) in self.headers() {
            rb = rb.header(k, v);
        }
        if let Some(b) = body {
            rb = rb.header("content-type", "application/json").body(b);
        }
        Daemon::read(rb.send().await.expect("request")).await
    }

    pub async fn create(&self, body: Value) -> Resp {
        self.call(
            "POST",
            "/v1/sandbox/sessions",
            Some(body.to_string().into_bytes()),
        )
        .await
    }

    pub async fn exec(&self, id: &str, body: Value) -> Resp {
        let path = format!("/v1/sandbox/sessions/{id}/exec");
        self.call("POST", &path, Some(body.to_string().into_bytes()))
            .await
    }
}

/// Sessions with the capability token travelling in the creation body.
pub fn koder<'a>(d: &'a Daemon, tenant: Option<&'a str>) -> SandboxClient<'a> {
    SandboxClient {
        d,
        service: d.service_token(),
        tenant,
    }
}

pub async fn new_session(c: &SandboxClient<'_>, language: &str) -> String {
    let r = c
        .create(json!({"language": language, "capability_token": c.d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.json["language"], language);
    r.json["id"].as_str().expect("id").to_string()
}
