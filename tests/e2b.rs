//! The E2B-compatible API (`[e2b]`) driven by the official E2B SDKs, unchanged, on the local
//! backend and on runc: the Python SDK (`e2b` on PyPI) at two pinned versions, a current 2.x and
//! one about a year older (scripts/e2b-sdk-venv.sh), runs tests/e2b/test_e2b.py with pytest, and
//! the JS SDK (`e2b` on npm, pinned by tests/e2b/js/package-lock.json, scripts/e2b-npm-sdk.sh)
//! runs tests/e2b/sdk.mjs. Each SDK points at the daemon with nothing but its own environment:
//! `E2B_API_URL=http://<server.listen>/e2b`, `E2B_SANDBOX_URL=http://<e2b.envd_listen>` and
//! `E2B_API_KEY=<a service token>`, the token's `capabilities` claim being the sandboxes' grant
//! and its subject their owner; a second service's token must find none of them.
//!
//! Both scripts cover the same flow: create; run a command (its stdout, a failing one's
//! CommandExitException and exit code); a background command re-attached by pid, read, and
//! killed; stdin; the files API (write, read, list, make_dir, rename, remove, exists); timeout,
//! info and list; pause and connect (a file written before the pause is there after); kill.

mod common;

use std::path::Path;
use std::time::Duration;

use common::backends::Backend;
use common::{Daemon, Opts};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;

/// The E2B Python SDK versions driven: the current 2.x and one about a year older that still
/// honours `E2B_API_URL` and `E2B_SANDBOX_URL` (it creates with `POST /sandboxes`, resumes with
/// `POST /sandboxes/{id}/connect`, and its `Sandbox.connect(id)` reaches envd without the
/// `E2b-Sandbox-Id` header, by its access token alone).
const PYTHON_SDK_CURRENT: &str = "2.63.0";
const PYTHON_SDK_OLDER: &str = "2.7.0";

/// The sandbox home, where the SDKs' relative paths resolve.
const WORKDIR: &str = "/workspace";

/// The bound of one SDK run (every wait inside it is bounded too: pytest-timeout, the SDKs'
/// request and stream timeouts, sdk.mjs's own limit).
const SDK_RUN: Duration = Duration::from_secs(900);

/// Runs a pinned-tool script at most one at a time: tests of this binary that run in parallel
/// would otherwise make the same venv or npm install together.
fn pinned(script: &str, args: &[&str]) -> String {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    common::pinned_tool(script, args)
}

/// A loopback port nothing listens on (for `e2b.envd_listen`).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("address")
        .port()
}

/// A daemon on `backend` with the E2B API on, its data plane on `envd` (`host:port`).
fn e2b_daemon(backend: Backend) -> (Daemon, String) {
    e2b_daemon_with(backend, "")
}

/// [`e2b_daemon`] with `extra` TOML (sections after the E2B one's).
fn e2b_daemon_with(backend: Backend, extra: &str) -> (Daemon, String) {
    let envd = format!("127.0.0.1:{}", free_port());
    let mut config = format!(
        "[e2b]\nenvd_listen = \"{envd}\"\n\n[e2b.templates.base]\nlanguage = \"bash\"\n\n{extra}\n"
    );
    if backend.is_container() {
        config.push_str(&common::docker::config(1, common::docker::SOCKET));
    }
    let d = Daemon::start_with(Opts {
        env: vec![("SANDBOX_RUNTIME".into(), backend.runtime().into())],
        config: Some(config),
        ..Default::default()
    });
    // The data plane's listener is up before any SDK call reaches it.
    common::wait::wait_until(
        &format!("the E2B data plane accepts connections on {envd}"),
        Duration::from_secs(30),
        || std::net::TcpStream::connect(&envd).is_ok(),
    );
    (d, envd)
}

/// A service token of `sub`: its capabilities are the grant of the sandboxes it creates.
fn api_key(d: &Daemon, sub: &str) -> String {
    d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 3600,
        aud: "executor-arm".into(),
        sub: Some(sub.into()),
        capabilities: vec![
            "ShellExecute".into(),
            "PythonExecute".into(),
            "FilesystemRead".into(),
            "FilesystemWrite".into(),
        ],
        ..Default::default()
    })
}

/// Which SDK a case drives.
#[derive(Debug, Clone, Copy)]
enum Sdk {
    Python(&'static str),
    Js,
}

/// Drives the daemon of `backend` with `sdk`, failing with the SDK's output unless every check
/// of its script passed.
async fn drive(backend: Backend, sdk: Sdk) {
    backend.require(&format!("e2b {sdk:?}"));
    // The container cases load dockerd: one at a time.
    let _one = if backend.is_container() {
        Some(common::docker::one_at_a_time().await)
    } else {
        None
    };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = match sdk {
        Sdk::Python(version) => {
            let python = pinned("e2b-sdk-venv.sh", &[version]);
            let mut c = tokio::process::Command::new(python);
            c.args(["-m", "pytest", "-v", "-x", "-p", "no:cacheprovider"])
                .args(["--timeout=300", "-o", "console_output_style=classic"])
                .arg(repo.join("tests/e2b/test_e2b.py"))
                .env("PYTHONDONTWRITEBYTECODE", "1");
            c
        }
        Sdk::Js => {
            let dir = pinned("e2b-npm-sdk.sh", &[]);
            let mut c = tokio::process::Command::new("node");
            c.arg(repo.join("tests/e2b/sdk.mjs")).env("E2B_JS_DIR", dir);
            c
        }
    };
    let (d, envd) = e2b_daemon(backend);
    cmd.current_dir(repo)
        .env("E2B_API_URL", format!("{}/e2b", d.base))
        .env("E2B_SANDBOX_URL", format!("http://{envd}"))
        .env("E2B_API_KEY", api_key(&d, "orchestrator"))
        .env("E2B_OTHER_API_KEY", api_key(&d, "intruder"))
        .env("E2B_WORKDIR", WORKDIR)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .kill_on_drop(true);
    // Nothing of the environment the tests run in steers the SDKs elsewhere.
    for var in [
        "E2B_DOMAIN",
        "E2B_DEBUG",
        "E2B_ACCESS_TOKEN",
        "E2B_HTTP_VERSION",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env_remove(var);
    }
    let out = tokio::time::timeout(SDK_RUN, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{sdk:?} on {backend:?} did not finish within {SDK_RUN:?}"))
        .expect("run the SDK");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    let passed = match sdk {
        Sdk::Python(_) => stdout.contains(" passed") && !stdout.contains(" failed"),
        Sdk::Js => stdout.contains("e2b js: OK"),
    };
    assert!(
        out.status.success() && passed,
        "the E2B {sdk:?} SDK on {backend:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn python_sdk_current() {
    drive(Backend::Local, Sdk::Python(PYTHON_SDK_CURRENT)).await;
}

#[tokio::test]
async fn python_sdk_older() {
    drive(Backend::Local, Sdk::Python(PYTHON_SDK_OLDER)).await;
}

#[tokio::test]
async fn js_sdk() {
    drive(Backend::Local, Sdk::Js).await;
}

/// The same flows with the sandboxes in runc containers.
#[tokio::test]
async fn python_sdk_current_on_runc() {
    drive(Backend::Docker, Sdk::Python(PYTHON_SDK_CURRENT)).await;
}

#[tokio::test]
async fn python_sdk_older_on_runc() {
    drive(Backend::Docker, Sdk::Python(PYTHON_SDK_OLDER)).await;
}

#[tokio::test]
async fn js_sdk_on_runc() {
    drive(Backend::Docker, Sdk::Js).await;
}

/// The current Python SDK's flow with the sandboxes in gVisor.
#[tokio::test]
async fn python_sdk_current_on_gvisor() {
    drive(Backend::Gvisor, Sdk::Python(PYTHON_SDK_CURRENT)).await;
}

// ---------------------------------------------------------------------------------------------
// Bad input and limits, over raw HTTP (what an SDK would never send)

/// `message` as one enveloped Connect message.
fn enveloped(message: &serde_json::Value) -> Vec<u8> {
    let json = message.to_string().into_bytes();
    let mut out = vec![0u8];
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// Creates a sandbox through the control plane: its id and access token.
async fn create(d: &Daemon, key: &str, timeout: u64) -> (String, String) {
    let r = d
        .client
        .post(format!("{}/e2b/v2/sandboxes", d.base))
        .header("x-api-key", key)
        .json(&serde_json::json!({"templateID": "base", "timeout": timeout}))
        .send()
        .await
        .expect("create");
    assert_eq!(r.status().as_u16(), 201);
    let v: serde_json::Value = r.json().await.expect("json");
    (
        v["sandboxID"].as_str().unwrap().to_string(),
        v["envdAccessToken"].as_str().unwrap().to_string(),
    )
}

/// A caller without a key or token is refused before its body is read: a body declared far
/// past every limit is answered 401 at once (not read, not 413), on both planes.
#[tokio::test]
async fn bodies_are_read_only_for_a_known_caller() {
    Backend::Local.require("e2b bodies");
    let (d, envd) = e2b_daemon(Backend::Local);
    for url in [
        format!("http://{envd}/filesystem.Filesystem/Stat"),
        format!("http://{envd}/process.Process/List"),
        format!("http://{envd}/files?path=x"),
        format!("{}/e2b/v2/sandboxes", d.base),
    ] {
        let mut s = tokio::net::TcpStream::connect(url.split('/').nth(2).unwrap())
            .await
            .expect("connect");
        let path = format!("/{}", url.splitn(4, '/').nth(3).unwrap());
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Access-Token: 00\r\nX-API-KEY: nope\r\nContent-Length: 1000000000\r\n\r\n{{"
        );
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(head.as_bytes()).await.expect("write");
        let mut answer = vec![0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{url}: no answer while the body is held back"))
            .expect("read");
        let text = String::from_utf8_lossy(&answer[..n]);
        assert!(text.starts_with("HTTP/1.1 401"), "{url}: {text}");
    }
}

/// The data plane's listener drops a client that never finishes its headers, as the daemon's
/// own listener does (`server.header_read_timeout_ms`).
#[tokio::test]
async fn the_data_plane_times_out_unfinished_headers() {
    Backend::Local.require("e2b headers");
    let (_d, envd) = e2b_daemon_with(Backend::Local, "[server]\nheader_read_timeout_ms = 1000\n");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(&envd)
        .await
        .expect("connect");
    s.write_all(b"POST /files HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let mut buf = vec![0u8; 512];
    // Closed (or answered 408) by the server, well before this bound.
    let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
        .await
        .expect("the data plane kept a connection with unfinished headers open")
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
}

/// `set_timeout` never carries a sandbox past `sessions.max_ttl_seconds` after its creation,
/// however often it is called; a zero timeout is refused.
#[tokio::test]
async fn timeouts_never_pass_the_sessions_life_cap() {
    Backend::Local.require("e2b timeouts");
    let (d, _envd) = e2b_daemon_with(Backend::Local, "[sessions]\nmax_ttl_seconds = 60\n");
    let key = api_key(&d, "orchestrator");
    let (id, _) = create(&d, &key, 30).await;
    let set = |t: u64| {
        d.client
            .post(format!("{}/e2b/sandboxes/{id}/timeout", d.base))
            .header("x-api-key", &key)
            .json(&serde_json::json!({ "timeout": t }))
            .send()
    };
    // A second passes, so "now + 60 s" would be past the cap.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(set(60).await.unwrap().status().as_u16(), 204);
    assert_eq!(set(0).await.unwrap().status().as_u16(), 400);
    let info: serde_json::Value = d
        .client
        .get(format!("{}/e2b/sandboxes/{id}", d.base))
        .header("x-api-key", &key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let at = |k: &str| {
        chrono::DateTime::parse_from_rfc3339(info[k].as_str().unwrap())
            .unwrap()
            .timestamp_millis()
    };
    let life = at("endAt") - at("startedAt");
    assert!(life <= 60_000, "the sandbox lives {life} ms: {info}");
}

/// Process streams count among `executions.max_open_streams`: one more is refused with
/// `resource_exhausted`, not served.
#[tokio::test]
async fn process_streams_take_a_stream_place() {
    Backend::Local.require("e2b streams");
    let (d, envd) = e2b_daemon_with(Backend::Local, "[executions]\nmax_open_streams = 1\n");
    let key = api_key(&d, "orchestrator");
    let (id, token) = create(&d, &key, 120).await;
    let start = |cmd: &str| {
        d.client
            .post(format!("http://{envd}/process.Process/Start"))
            .header("content-type", "application/connect+json")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(enveloped(&serde_json::json!({
                "process": {"cmd": "/bin/bash", "args": ["-c", cmd]}
            })))
            .send()
    };
    let held = start("sleep 60").await.expect("start");
    assert_eq!(held.status().as_u16(), 200);
    // Its first frame (the start event) is there: the stream is open.
    let mut held = held;
    let first = tokio::time::timeout(Duration::from_secs(30), held.chunk())
        .await
        .expect("the start event")
        .expect("chunk")
        .expect("a frame");
    assert_eq!(first[0], 0, "{first:?}");
    let refused = start("true").await.expect("start");
    let body = refused.bytes().await.expect("body");
    let end: serde_json::Value = serde_json::from_slice(&body[5..]).expect("end frame");
    assert_eq!(body[0], 2, "{end}");
    assert_eq!(end["error"]["code"], "resource_exhausted", "{end}");
}

/// A `StreamInput` call (a client stream) holds a stream place, so it ends without its caller:
/// when no whole message came for `server.body_read_timeout_seconds`, and when its process
/// ends, each answered with its Connect error.
#[tokio::test]
async fn a_stream_of_input_ends_without_its_caller() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    Backend::Local.require("e2b stream input");
    let (d, envd) = e2b_daemon_with(
        Backend::Local,
        "[server]\nbody_read_timeout_seconds = 2\n\n[executions]\nmax_open_streams = 4\n",
    );
    let key = api_key(&d, "orchestrator");
    let (id, token) = create(&d, &key, 120).await;
    let mut held = d
        .client
        .post(format!("http://{envd}/process.Process/Start"))
        .header("content-type", "application/connect+json")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .body(enveloped(&serde_json::json!({
            "process": {"cmd": "/bin/bash", "args": ["-c", "cat >/dev/null"]}, "stdin": true
        })))
        .send()
        .await
        .expect("start");
    let first = tokio::time::timeout(Duration::from_secs(30), held.chunk())
        .await
        .expect("the start event")
        .expect("chunk")
        .expect("a frame");
    let start: serde_json::Value = serde_json::from_slice(&first[5..]).expect("start event");
    let pid = start["event"]["start"]["pid"].as_u64().expect("pid");
    let chunk = |bytes: &[u8]| {
        let mut c = format!("{:x}\r\n", bytes.len()).into_bytes();
        c.extend_from_slice(bytes);
        c.extend_from_slice(b"\r\n");
        c
    };
    let open = || async {
        let mut s = tokio::net::TcpStream::connect(&envd)
            .await
            .expect("connect");
        let head = format!(
            "POST /process.Process/StreamInput HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\nE2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.expect("head");
        let hello = enveloped(&serde_json::json!({"start": {"process": {"pid": pid}}}));
        s.write_all(&chunk(&hello)).await.expect("start message");
        s
    };
    // The end-of-stream frame's error code, once the call answered (within a bound).
    let error_of = |text: String| {
        let at = text
            .find("{\"error\"")
            .unwrap_or_else(|| panic!("no error frame: {text}"));
        let end: serde_json::Value =
            serde_json::from_str(text[at..].split('\r').next().unwrap()).expect("end frame");
        end["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let answer = |mut s: tokio::net::TcpStream| async move {
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
            .await
            .expect("a StreamInput call that sends nothing more was never answered")
            .expect("read");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };

    // Nothing after the start message: ended at the read timeout.
    let idle = open().await;
    let text = answer(idle).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(error_of(text), "deadline_exceeded");

    // Keepalives, then the process is killed: ended with not_found.
    let mut alive = open().await;
    let keepalive = chunk(&enveloped(&serde_json::json!({"keepalive": {}})));
    for _ in 0..3 {
        alive.write_all(&keepalive).await.expect("keepalive");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let killed = d
        .client
        .post(format!("http://{envd}/process.Process/SendSignal"))
        .header("content-type", "application/json")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .json(&serde_json::json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}))
        .send()
        .await
        .expect("kill");
    assert_eq!(killed.status().as_u16(), 200);
    let text = answer(alive).await;
    assert_eq!(error_of(text), "not_found");

    // Input for the ended process, all sent at once: refused after its start message, yet the
    // rest is read, so the connection serves the caller's next request.
    let mut late = open().await;
    let data = enveloped(&serde_json::json!({"data": {"input": {"stdin": "bGF0ZQo="}}}));
    late.write_all(&chunk(&data)).await.expect("data");
    late.write_all(b"0\r\n\r\n").await.expect("end of the body");
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\r\n0\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(30), late.read(&mut buf))
            .await
            .expect("the late call's answer")
            .expect("read");
        assert!(
            n > 0,
            "closed before the answer: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(
        error_of(String::from_utf8_lossy(&seen).into_owned()),
        "not_found"
    );
    late.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("the next request");
    let next = answer(late).await;
    assert!(
        next.starts_with("HTTP/1.1 204"),
        "the connection was not kept: {next:?}"
    );
}

/// A raw HTTP/1.1 request to `addr`: the status line's code and the body, read to the end.
async fn raw(addr: &str, head: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(head.as_bytes()).await.expect("head");
    // The server may answer (and close) before it read everything.
    let _ = s.write_all(body).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

/// A multipart upload is bounded whole (framing included, not only its files' bytes) and
/// writes one file when `path` names one.
#[tokio::test]
async fn a_multipart_upload_is_bounded() {
    Backend::Local.require("e2b multipart");
    let (d, envd) = e2b_daemon(Backend::Local);
    let key = api_key(&d, "orchestrator");
    let (id, token) = create(&d, &key, 120).await;
    let part = |name: &str| {
        format!(
            "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\r\nhi\r\n"
        )
    };
    let send = |query: &str, body: Vec<u8>| {
        let head = format!(
            "POST /files{query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nE2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let envd = envd.clone();
        async move { raw(&envd, &head, &body).await }
    };
    // 40 MiB of preamble before the first boundary: past sessions.max_file_bytes (16 MiB) and
    // its framing's room, though no file holds a byte of it.
    let mut big = vec![b'x'; 40 << 20];
    big.extend_from_slice(format!("\r\n{}--B--\r\n", part("a.txt")).as_bytes());
    let (code, text) = send("", big).await;
    assert_eq!(code, 413, "{}", &text[..text.len().min(400)]);
    // `path` names one file: a second part is refused, and nothing is written.
    let two = format!("{}{}--B--\r\n", part("one.txt"), part("two.txt")).into_bytes();
    let (code, text) = send("?path=one.txt", two).await;
    assert_eq!(code, 400, "{text}");
    let one = format!("{}--B--\r\n", part("x")).into_bytes();
    let (code, text) = send("?path=one.txt", one).await;
    assert_eq!(code, 200, "{text}");
}

/// A download holds its place among the file transfers until its reader took the last bytes:
/// eight readers that stopped reading leave none for a ninth (429), so slow readers cannot
/// hold more files in memory than that.
#[tokio::test]
async fn a_reader_that_stops_keeps_its_file_transfer_place() {
    Backend::Local.require("e2b downloads");
    // A file larger than what the kernel's socket buffers take of it unread.
    let (d, envd) = e2b_daemon_with(Backend::Local, "[sessions]\nmax_file_bytes = 67108864\n");
    let key = api_key(&d, "orchestrator");
    let (id, token) = create(&d, &key, 120).await;
    let put = d
        .client
        .post(format!("http://{envd}/files?path=big.bin"))
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .header("content-type", "application/octet-stream")
        .body(vec![7u8; 60 << 20])
        .send()
        .await
        .expect("upload");
    assert_eq!(put.status().as_u16(), 200);
    use tokio::io::AsyncWriteExt;
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut s = tokio::net::TcpStream::connect(&envd)
            .await
            .expect("connect");
        let head = format!(
            "GET /files?path=big.bin HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.expect("request");
        // Its answer began (200): it holds a place now. Nothing more of it is read.
        use tokio::io::AsyncReadExt;
        let mut first = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(60), s.read_exact(&mut first))
            .await
            .expect("the download's answer")
            .expect("read");
        assert_eq!(
            &first,
            b"HTTP/1.1 200",
            "{}",
            String::from_utf8_lossy(&first)
        );
        held.push(s);
    }
    let ninth = || async {
        d.client
            .get(format!("http://{envd}/files?path=big.bin"))
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .send()
            .await
            .expect("download")
            .status()
            .as_u16()
    };
    // The eight are taken once their files are read (the daemon answers each in turn).
    let mut last = 0;
    for _ in 0..300 {
        last = ninth().await;
        if last == 429 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        last, 429,
        "a ninth download was served while eight readers held theirs"
    );
    drop(held);
    // Their places come back once they are gone.
    let mut back = 0;
    for _ in 0..300 {
        back = ninth().await;
        if back == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(back, 200);
}
