//! Runs as things with an id, on the local backend through the real daemon: async runs polled to
//! their result, results read after the call that started them, cancellation with a grace, and
//! who may see a run. (The container backends' cancellation is in `docker_backend.rs`.)

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Resp, Sse, SseReader, open_stream, pids_with_cmdline, stream_bytes};
use executor_arm::auth::MintRequest;
use executor_arm::config::TokenKind;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

fn marker() -> String {
    format!("runs-{}", uuid::Uuid::new_v4().simple())
}

/// `python3 -c <code>` with the marker in its command line (a trailing comment).
fn py(code: &str, marker: &str) -> Value {
    json!({"action_type": "python", "command": "python3", "args": ["-c", format!("{code}\n# {marker}")]})
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A service token of another calling service.
fn other_service(d: &Daemon) -> String {
    d.mint(MintRequest {
        kind: Some(TokenKind::Service),
        ttl_seconds: 300,
        aud: "executor-arm".into(),
        sub: Some("another-service".into()),
        ..Default::default()
    })
}

async fn get(d: &Daemon, exec_id: &str, service: &str) -> Resp {
    let r = d
        .client
        .get(format!("{}/v1/executions/{exec_id}", d.base))
        .header("authorization", bearer(service))
        .send()
        .await
        .expect("request");
    read(r).await
}

async fn cancel(d: &Daemon, exec_id: &str, service: &str, body: &str) -> Resp {
    d.post(
        &format!("/v1/executions/{exec_id}/cancel"),
        &[("authorization", &bearer(service))],
        body.to_string(),
    )
    .await
}

async fn read(r: reqwest::Response) -> Resp {
    Daemon::read(r).await
}

/// Polls `GET /v1/executions/{exec_id}` until the run finished (bounded).
async fn finished(d: &Daemon, exec_id: &str) -> Resp {
    let svc = d.service_token();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = get(d, exec_id, &svc).await;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.json["status"] == "finished" {
            return r;
        }
        assert_eq!(r.json["status"], "running", "{}", r.text);
        assert!(Instant::now() < deadline, "{exec_id} still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts `body` as an async run; returns its exec_id after checking the 202.
async fn start_async(d: &Daemon, mut body: Value) -> String {
    body["async"] = json!(true);
    let r = d.exec(body).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let exec_id = r.json["exec_id"].as_str().expect("exec_id").to_string();
    let base = format!("/v1/executions/{exec_id}");
    assert_eq!(r.json["status"], "running");
    assert_eq!(r.json["links"]["self"], base.as_str());
    assert_eq!(r.json["links"]["stream"], format!("{base}/stream"));
    assert_eq!(r.json["links"]["cancel"], format!("{base}/cancel"));
    assert_eq!(r.headers.get("location").unwrap(), base.as_str());
    exec_id
}

fn sha256(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

fn audit_lines_of(d: &Daemon, exec_id: &str) -> Vec<Value> {
    d.audit_lines()
        .into_iter()
        .filter(|l| l["exec_id"] == exec_id)
        .collect()
}

/// A run's result read back equals the body its synchronous call returned, byte for byte; an
/// async run polls to a result with the same fields, its provenance verifies and its audit lines
/// are there.
#[tokio::test(flavor = "multi_thread")]
async fn an_async_run_polls_to_the_result_a_synchronous_call_returns() {
    let d = Daemon::start();
    let code = "import sys\nprint('out line')\nprint('err line', file=sys.stderr)";
    let mut sync_body = py(code, &marker());
    sync_body["metadata"] = json!({"score": 1.0715660391465826e-75, "job": "j-1"});
    let sync = d.exec(sync_body).await;
    assert_eq!(sync.status, 200, "{}", sync.text);
    let sync_id = sync.json["exec_id"].as_str().unwrap();
    let read_back = finished(&d, sync_id).await;
    assert_eq!(read_back.json["http_status"], 200);
    // Spliced in as written: the caller's float keeps its digits.
    assert!(
        read_back
            .text
            .contains(&format!(r#""result":{}"#, sync.text)),
        "{}",
        read_back.text
    );

    let exec_id = start_async(&d, py(code, &marker())).await;
    let polled = finished(&d, &exec_id).await;
    assert_eq!(polled.json["http_status"], 200, "{}", polled.text);
    let result = &polled.json["result"];
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(result), keys(&sync.json), "{}", polled.text);
    assert_eq!(result["exec_id"], exec_id.as_str());
    assert_eq!(result["success"], true);
    assert_eq!(result["stdout"], "out line\n");
    assert_eq!(result["stderr"], "err line\n");
    assert_eq!(
        result["provenance"]["stdout_sha256"],
        sha256(b"out line\n").as_str()
    );
    let lines = audit_lines_of(&d, &exec_id);
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["execution_start", "execution"]);
    assert_eq!(
        lines[1]["stdout_sha256"],
        result["provenance"]["stdout_sha256"]
    );
    assert_eq!(lines[1]["seq"], result["provenance"]["audit_seq"]);
    assert!(common::audit_verify(&d.audit).status.success());
    let m = d.get("/metrics").await.text;
    assert!(
        m.contains("executor_runs_started_total{mode=\"async\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("executor_runs_started_total{mode=\"sync\"} 1"),
        "{m}"
    );
    d.wait_for_metric("executor_runs_live 0").await;
}

/// An async run may ask for more than the synchronous 300 s; a synchronous one may not, and the
/// timeout an async run got is the one its start line records.
#[tokio::test(flavor = "multi_thread")]
async fn an_async_run_may_last_longer_than_a_synchronous_one() {
    let d = Daemon::start();
    let mut body = py("print('x')", &marker());
    body["timeout_seconds"] = json!(1200);
    let sync = d.exec(body.clone()).await;
    assert_eq!(sync.status, 400, "{}", sync.text);
    assert!(
        sync.json["error"]
            .as_str()
            .unwrap()
            .contains("between 1 and 300")
    );
    // Past the async bound, each mode's refusal names the mode the request asked for.
    let mut too_long = body.clone();
    too_long["timeout_seconds"] = json!(86_401);
    too_long["capability_token"] = json!(d.cap_all());
    let svc = bearer(&d.service_token());
    let streamed = d
        .post(
            "/execute",
            &[("authorization", &svc), ("accept", "text/event-stream")],
            too_long.to_string(),
        )
        .await;
    assert_eq!(streamed.status, 400, "{}", streamed.text);
    let error = streamed.json["error"].as_str().unwrap();
    assert!(error.ends_with("for a streamed run, got 86401"), "{error}");
    let exec_id = start_async(&d, body).await;
    let r = finished(&d, &exec_id).await;
    assert_eq!(r.json["result"]["success"], true, "{}", r.text);
    let start = &audit_lines_of(&d, &exec_id)[0];
    assert_eq!(start["event"], "execution_start");
    assert_eq!(start["timeout_seconds"], 1200, "{start}");
}

/// A caller that goes away before the answer stops nothing: the run ends and its result can be
/// read, and the retry of its Idempotency-Key gets that result. One that said
/// `cancel_on_disconnect` has its run cancelled, and its key released: the retry runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_leaves_a_result_that_can_be_fetched() {
    let d = Daemon::start();
    for cancel in [false, true] {
        let m = marker();
        let mut body = py("import time\ntime.sleep(2)\nprint('still ran')", &m);
        body["capability_token"] = json!(d.cap_all());
        body["cancel_on_disconnect"] = json!(cancel);
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        let key = format!("retry-{m}");
        let gone = impatient
            .post(format!("{}/execute", d.base))
            .header("authorization", bearer(&d.service_token()))
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(body.to_string())
            .send()
            .await;
        assert!(gone.is_err(), "the client gave up before the answer");
        // The caller never saw its exec_id; the audit log names it.
        let start = d.wait_for_audit_line("the run's execution_start", |l| {
            l["event"] == "execution_start" && l.to_string().contains(&m)
        });
        let exec_id = start["exec_id"].as_str().unwrap();
        let r = finished(&d, exec_id).await;
        if cancel {
            assert_eq!(r.json["result"]["outcome"], "cancelled", "{}", r.text);
        } else {
            assert_eq!(r.json["result"]["stdout"], "still ran\n", "{}", r.text);
            assert_eq!(r.json["result"]["success"], true);
        }
        // The retry, once the first request let go of its key.
        let deadline = Instant::now() + Duration::from_secs(30);
        let retry = loop {
            let svc = bearer(&d.service_token());
            let headers = [("authorization", svc.as_str()), ("idempotency-key", &key)];
            let r = d.post("/execute", &headers, body.to_string()).await;
            if r.status != 409 || Instant::now() > deadline {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(retry.status, 200, "{}", retry.text);
        assert_eq!(retry.json["stdout"], "still ran\n", "{}", retry.text);
        let replayed = retry.headers.get("idempotent-replayed").is_some();
        assert_eq!(
            replayed, !cancel,
            "only a result the caller did not cancel is replayed"
        );
        assert_eq!(retry.json["exec_id"] == exec_id, !cancel, "{}", retry.text);
    }
}

/// A caller that goes away while its request still waits for a run slot gives its place in the
/// queue back, and nothing runs for it: its Idempotency-Key is free again for a retry, and the
/// place is there for the next request.
#[tokio::test(flavor = "multi_thread")]
async fn a_caller_that_goes_away_while_queued_gives_its_place_back_and_runs_nothing() {
    let d = Daemon::start_with(common::Opts {
        config: Some(
            "[server]\nconcurrency = { local = 1, docker = 1, gvisor = 1 }\n\
             queue = { max_waiting = 1, max_wait_ms = 120000 }\n"
                .into(),
        ),
        ..Default::default()
    });
    let svc = d.service_token();
    // The one local slot is taken until the test cancels it.
    let blocker = start_async(&d, py("import time\ntime.sleep(120)", &marker())).await;
    let m = marker();
    let mut body = py("print('ran for a caller that left')", &m);
    body["capability_token"] = json!(d.cap_all());
    body["cancel_on_disconnect"] = json!(true);
    let send = {
        let (client, url, svc, body) = (
            d.client.clone(),
            format!("{}/execute", d.base),
            bearer(&svc),
            body.to_string(),
        );
        move || {
            client
                .post(&url)
                .header("authorization", &svc)
                .header("idempotency-key", "queued-then-gone")
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
        }
    };
    let gone = tokio::spawn(send());
    d.wait_for_metric("executor_queue_waiting{backend=\"local\"} 1")
        .await;
    // The caller goes away: its connection closes with the request unanswered.
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    d.wait_for_metric("executor_queue_waiting{backend=\"local\"} 0")
        .await;

    // Its key is not held by a request nobody waits for: the retry waits for the slot itself.
    let retry = tokio::spawn(send());
    d.wait_for_metric("executor_queue_waiting{backend=\"local\"} 1")
        .await;
    let r = cancel(&d, &blocker, &svc, r#"{"grace_seconds": 0}"#).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let retried = read(retry.await.unwrap().expect("retry")).await;
    assert_eq!(retried.status, 200, "{}", retried.text);
    assert_eq!(retried.json["stdout"], "ran for a caller that left\n");
    // Exactly one run of that request: the retry's.
    let starts = d
        .audit_lines()
        .into_iter()
        .filter(|l| l["event"] == "execution_start" && l.to_string().contains(&m))
        .count();
    assert_eq!(starts, 1, "a run started for the caller that left");
    d.wait_for_metric("executor_runs_live 0").await;
    assert!(common::audit_verify(&d.audit).status.success());
}

/// A run that ignores SIGTERM and leaves a double-forked setsid child: a cancel sends SIGTERM
/// to all of them, waits the grace, then kills everything, checked from the host; the outcome is
/// `cancelled`, the cancel is audited with who asked, a repeat gets the same answer and a cancel
/// after the end is 409.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_terminates_then_kills_every_process_of_the_run() {
    let d = Daemon::start();
    let svc = d.service_token();
    let m = marker();
    let code = "import os, signal, time\n\
                signal.signal(signal.SIGTERM, signal.SIG_IGN)\n\
                if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True: time.sleep(1)\n    os._exit(0)\n\
                while True: time.sleep(1)";
    let exec_id = start_async(&d, py(code, &m)).await;
    // Both the command and its daemonised grandchild are up (the intermediate child exited).
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids_with_cmdline(&m).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the run's processes never showed up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let grace = 2;
    let cancelled_at = Instant::now();
    let r = cancel(
        &d,
        &exec_id,
        &svc,
        &format!(r#"{{"grace_seconds": {grace}}}"#),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text);
    assert_eq!(r.json["status"], "cancelling");
    assert_eq!(r.json["grace_seconds"], grace);
    // A repeat while it stops: the same answer, the first grace.
    let again = cancel(&d, &exec_id, &svc, r#"{"grace_seconds": 0}"#).await;
    assert_eq!(again.status, 202, "{}", again.text);
    assert_eq!(again.json, r.json);
    // Every process is gone within the grace and a second, seen from the host.
    // A bound, not a timing check: the processes ignore SIGTERM and would never end unkilled.
    let bound = common::wait::CLEANUP;
    while !pids_with_cmdline(&m).is_empty() {
        assert!(
            cancelled_at.elapsed() < bound,
            "processes left {:?} after the grace: {:?}",
            cancelled_at.elapsed(),
            pids_with_cmdline(&m)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let done = finished(&d, &exec_id).await;
    let result = &done.json["result"];
    assert_eq!(result["outcome"], "cancelled", "{}", done.text);
    assert_eq!(result["killed_reason"], "cancelled");
    assert_eq!(result["success"], false);
    // SIGTERM was ignored: the run lasted the whole grace after the cancel.
    assert!(
        cancelled_at.elapsed() >= Duration::from_secs(grace),
        "killed before its grace was over"
    );
    d.wait_for_no_run_cgroups();
    let lines = audit_lines_of(&d, &exec_id);
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["execution_start", "execution_cancel", "execution"]);
    assert_eq!(lines[1]["subject"], "orchestrator");
    assert_eq!(lines[1]["grace_seconds"], grace);
    assert_eq!(lines[2]["killed_reason"], "cancelled");
    let late = cancel(&d, &exec_id, &svc, "").await;
    assert_eq!(late.status, 409, "{}", late.text);
    assert_eq!(late.json["error_type"], "AlreadyFinished");
    assert_eq!(late.json["retryable"], false);
    let m = d.get("/metrics").await.text;
    assert!(m.contains("executor_cancels_total 1"), "{m}");
}

/// A run that handles SIGTERM ends within its grace on its own terms: what it wrote on the way
/// out is in the result, and the outcome is still `cancelled`.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_that_handles_sigterm_ends_within_its_grace() {
    let d = Daemon::start();
    let svc = d.service_token();
    let m = marker();
    let code = "import signal, sys, time\n\
                def bye(*_):\n    print('cleaned up', flush=True)\n    sys.exit(0)\n\
                signal.signal(signal.SIGTERM, bye)\n\
                print('ready', flush=True)\n\
                while True: time.sleep(0.05)";
    let exec_id = start_async(&d, py(code, &m)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids_with_cmdline(&m).is_empty() {
        assert!(Instant::now() < deadline, "the run never showed up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Cancel only once the handler is installed, as the kernel shows it.
    let ready = Instant::now() + Duration::from_secs(30);
    loop {
        let status = std::fs::read_to_string(format!("/proc/{}/status", pids_with_cmdline(&m)[0]))
            .unwrap_or_default();
        // SigCgt holds SIGTERM (bit 14) once the handler is installed.
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
            .unwrap_or(0);
        if caught & (1 << 14) != 0 {
            break;
        }
        assert!(Instant::now() < ready, "the SIGTERM handler never showed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = cancel(&d, &exec_id, &svc, r#"{"grace_seconds": 30}"#).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let done = finished(&d, &exec_id).await;
    let result = &done.json["result"];
    assert_eq!(result["outcome"], "cancelled", "{}", done.text);
    assert_eq!(result["killed_reason"], "cancelled");
    assert_eq!(result["exit_code"], 0);
    assert_eq!(result["stdout"], "ready\ncleaned up\n");
    assert!(
        result["duration_ms"].as_u64().unwrap() < 30_000,
        "it ended on its own, not at the grace's end"
    );
}

/// Only the calling service that started a run may read or cancel it; anyone else gets the 404
/// of a run that does not exist.
#[tokio::test(flavor = "multi_thread")]
async fn another_service_gets_404_for_a_run_it_did_not_start() {
    let d = Daemon::start();
    let other = other_service(&d);
    let exec_id = start_async(&d, py("import time\ntime.sleep(1)", &marker())).await;
    let nobody = get(
        &d,
        "exec-00000000000000000000000000000000",
        &d.service_token(),
    )
    .await;
    assert_eq!(nobody.status, 404, "{}", nobody.text);
    assert_eq!(nobody.json["error_type"], "NotFound");
    for r in [
        get(&d, &exec_id, &other).await,
        cancel(&d, &exec_id, &other, "").await,
    ] {
        assert_eq!(r.status, 404, "{}", r.text);
        assert_eq!(r.json, nobody.json);
    }
    let done = finished(&d, &exec_id).await;
    assert_eq!(done.json["result"]["success"], true, "{}", done.text);
    assert_eq!(get(&d, &exec_id, &other).await.status, 404);
    // Without a service token: 401, as for /execute.
    let anon = d
        .client
        .get(format!("{}/v1/executions/{exec_id}", d.base))
        .send()
        .await
        .unwrap();
    assert_eq!(anon.status().as_u16(), 401);
    // A grace out of range is refused before anything is looked up.
    let bad = cancel(&d, &exec_id, &d.service_token(), r#"{"grace_seconds": 31}"#).await;
    assert_eq!(bad.status, 400, "{}", bad.text);
}

/// A run belongs to the calling service, never to the capability token's subject: the "ingest"
/// service starts a run whose capability token names "orchestrator", and only "ingest" reads or
/// cancels it; the "orchestrator" service gets 404. A service token without a subject names no
/// owner and is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_belongs_to_the_calling_service_not_to_the_capability_tokens_subject() {
    let d = Daemon::start();
    let service = |sub: Option<&str>| {
        d.mint(MintRequest {
            kind: Some(TokenKind::Service),
            ttl_seconds: 300,
            aud: "executor-arm".into(),
            sub: sub.map(str::to_string),
            ..Default::default()
        })
    };
    let anonymous = get(&d, "exec-0", &service(None)).await;
    assert_eq!(anonymous.status, 401, "{}", anonymous.text);
    let anonymous_service = || service(Some("ingest"));
    // Outlives the test's calls: the cancel at the end finds it running.
    let mut body = py("import time\ntime.sleep(300)", &marker());
    body["async"] = json!(true);
    body["capability_token"] = json!(d.cap_all());
    let started = d
        .post(
            "/execute",
            &[("authorization", &bearer(&anonymous_service()))],
            body.to_string(),
        )
        .await;
    assert_eq!(started.status, 202, "{}", started.text);
    let exec_id = started.json["exec_id"].as_str().unwrap().to_string();

    let by_cap_subject = get(&d, &exec_id, &d.service_token()).await;
    assert_eq!(by_cap_subject.status, 404, "{}", by_cap_subject.text);
    let refused = cancel(&d, &exec_id, &d.service_token(), "").await;
    assert_eq!(refused.status, 404, "{}", refused.text);

    let mine = get(&d, &exec_id, &anonymous_service()).await;
    assert_eq!(mine.status, 200, "{}", mine.text);
    let cancelled = cancel(&d, &exec_id, &anonymous_service(), "").await;
    assert_eq!(cancelled.status, 202, "{}", cancelled.text);
}

/// A daemon told to stop lets an async run finish within its grace and records its end.
#[tokio::test(flavor = "multi_thread")]
async fn shutdown_waits_for_async_runs() {
    let mut d = Daemon::start();
    let exec_id = start_async(
        &d,
        py("import time\ntime.sleep(1)\nprint('done')", &marker()),
    )
    .await;
    assert_eq!(d.stop(), Some(0));
    let lines = audit_lines_of(&d, &exec_id);
    assert_eq!(lines.last().unwrap()["event"], "execution", "{lines:?}");
    assert_eq!(lines.last().unwrap()["outcome"], "success");
}

async fn follow_stream(d: &Daemon, exec_id: &str, last_event_id: Option<&str>) -> SseReader {
    let mut req = d
        .client
        .get(format!("{}/v1/executions/{exec_id}/stream", d.base))
        .header("authorization", bearer(&d.service_token()));
    if let Some(id) = last_event_id {
        req = req.header("last-event-id", id);
    }
    let resp = req.send().await.expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    SseReader {
        resp,
        buf: String::new(),
    }
}

/// A script that prints a timestamped line every 200 ms is seen line by line while it runs,
/// then its result; the events' offsets cover the output exactly.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_shows_output_while_the_run_writes_it() {
    let d = Daemon::start();
    let code = "import time\nfor i in range(5):\n    print(i, time.time(), flush=True)\n    time.sleep(0.2)";
    let mut s = open_stream(&d, py(code, &marker())).await;
    let start = s.next().await.expect("start");
    assert_eq!(start.event, "start");
    assert_eq!(start.data["backend"], "local");
    assert_eq!(start.data["profile"], "python");
    let exec_id = start.data["exec_id"].as_str().unwrap().to_string();
    let events = s.rest().await;
    let result = events.last().expect("result");
    assert_eq!(result.event, "result", "{events:?}");
    assert_eq!(result.data["http_status"], 200);
    assert_eq!(result.data["exec_id"], exec_id.as_str());
    let out = stream_bytes(&events, "stdout", 0);
    assert_eq!(
        result.data["stdout"],
        String::from_utf8(out.clone()).unwrap()
    );
    let lines: Vec<&str> = std::str::from_utf8(&out).unwrap().lines().collect();
    assert_eq!(lines.len(), 5, "{lines:?}");
    // The first line reached the client before the script wrote its last one.
    let first_seen = events.iter().find(|e| e.event == "stdout").unwrap().read_at;
    let last_written: f64 = lines[4].split(' ').nth(1).unwrap().parse().unwrap();
    assert!(
        first_seen < last_written,
        "the first line arrived only after the last was written"
    );
    // The result read back equals the result event without its http_status.
    let polled = finished(&d, &exec_id).await;
    let mut from_event = result.data.clone();
    from_event.as_object_mut().unwrap().remove("http_status");
    assert_eq!(polled.json["result"], from_event);
}

/// Output that is not UTF-8 travels base64-encoded and decodes to exactly the bytes whose hash
/// the result carries.
#[tokio::test(flavor = "multi_thread")]
async fn binary_output_streams_intact() {
    let d = Daemon::start();
    let code = "import os\nos.write(1, bytes(range(256)) * 3)";
    let mut s = open_stream(&d, py(code, &marker())).await;
    let events = s.rest().await;
    let out = stream_bytes(&events, "stdout", 0);
    let want: Vec<u8> = (0..=255u8).cycle().take(768).collect();
    assert_eq!(out, want);
    let result = &events.last().unwrap().data;
    assert_eq!(
        result["provenance"]["stdout_sha256"],
        sha256(&want).as_str()
    );
}

/// A stream cut off mid-run and resumed from its last event id loses nothing; a stream of a
/// finished run replays it whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_stream_loses_nothing() {
    let d = Daemon::start();
    let code =
        "import time\nfor i in range(10):\n    print('line', i, flush=True)\n    time.sleep(0.1)";
    let exec_id = start_async(&d, py(code, &marker())).await;
    let mut first = follow_stream(&d, &exec_id, None).await;
    let mut seen = Vec::new();
    while seen.iter().filter(|e: &&Sse| e.event == "stdout").count() < 2 {
        seen.push(first.next().await.expect("events before the cut"));
    }
    drop(first);
    let last_id = seen.last().unwrap().id.clone();
    let mut resumed = follow_stream(&d, &exec_id, Some(&last_id)).await;
    let rest = resumed.rest().await;
    assert!(rest.iter().all(|e| e.event != "start"), "{rest:?}");
    let before = stream_bytes(&seen, "stdout", 0);
    let after = stream_bytes(&rest, "stdout", before.len());
    let all = [before, after].concat();
    let result = &rest.last().unwrap().data;
    assert_eq!(result["stdout"], String::from_utf8(all).unwrap());
    assert_eq!(result["stdout"].as_str().unwrap().lines().count(), 10);

    let mut replay = follow_stream(&d, &exec_id, None).await;
    let whole = replay.rest().await;
    assert_eq!(whole[0].event, "start");
    assert_eq!(whole[0].data["exec_id"], exec_id.as_str());
    assert_eq!(
        String::from_utf8(stream_bytes(&whole, "stdout", 0)).unwrap(),
        result["stdout"].as_str().unwrap()
    );
    assert_eq!(whole.last().unwrap().data, *result);
}

/// A `Last-Event-ID` past the output is clamped to it: the stream resumes at the end of what
/// the run wrote, and the result's id is the true end of the output, never the id the client
/// sent.
#[tokio::test(flavor = "multi_thread")]
async fn a_last_event_id_past_the_output_resumes_at_its_end() {
    let d = Daemon::start();
    let code = "import sys\nprint('out')\nprint('err', file=sys.stderr)";
    let exec_id = start_async(&d, py(code, &marker())).await;
    finished(&d, &exec_id).await;
    for past in ["999999.999999", "4.999999", "999999.4"] {
        let mut s = follow_stream(&d, &exec_id, Some(past)).await;
        let events = s.rest().await;
        assert_eq!(events.len(), 1, "{past}: {events:?}");
        assert_eq!(events[0].event, "result", "{past}: {events:?}");
        assert_eq!(events[0].id, "4.4", "{past}: {events:?}");
    }
    // Within the output, it resumes exactly there.
    let mut s = follow_stream(&d, &exec_id, Some("2.999")).await;
    let events = s.rest().await;
    assert_eq!(stream_bytes(&events, "stdout", 2), b"t\n");
    assert_eq!(stream_bytes(&events, "stderr", 4), b"");
    assert_eq!(events.last().unwrap().id, "4.4", "{events:?}");
}

/// `POST /execute` with `Accept: text/event-stream` at `path_and_query`.
async fn post_stream(d: &Daemon, path_and_query: &str, body: Value) -> reqwest::Response {
    let mut body = body;
    body["capability_token"] = json!(d.cap_all());
    d.client
        .post(format!("{}{path_and_query}", d.base))
        .header("authorization", bearer(&d.service_token()))
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(body.to_string())
        .send()
        .await
        .expect("request")
}

/// JSON lines written in pieces that cut lines and join several: three lines, then an
/// unfinished fourth.
const JSON_LINES: &str = "import os, time\n\
    os.write(1, b'{\"a\":1}\\n{\"a\":2}\\n{\"a\"')\n\
    time.sleep(0.3)\n\
    os.write(1, b':3}\\n{\"b\":')\n\
    os.write(2, b'warn\\n')\n\
    time.sleep(0.3)\n\
    os.write(1, b'4}')";

/// Lines framing: each output event is one complete line however the run's writes cut them; the
/// unfinished last line comes once the run is over, marked partial; offsets and ids stay byte
/// positions, so the events still add up to the output exactly.
#[tokio::test(flavor = "multi_thread")]
async fn lines_framing_sends_one_event_per_line() {
    let d = Daemon::start();
    let resp = post_stream(&d, "/execute?framing=lines", py(JSON_LINES, &marker())).await;
    assert_eq!(resp.status().as_u16(), 200);
    let events = SseReader {
        resp,
        buf: String::new(),
    }
    .rest()
    .await;
    let lines: Vec<(&str, bool)> = events
        .iter()
        .filter(|e| e.event == "stdout")
        .map(|e| {
            (
                e.data["data"].as_str().unwrap(),
                e.data["partial"] == json!(true),
            )
        })
        .collect();
    assert_eq!(
        lines,
        [
            ("{\"a\":1}\n", false),
            ("{\"a\":2}\n", false),
            ("{\"a\":3}\n", false),
            ("{\"b\":4}", true)
        ],
        "{events:?}"
    );
    for (line, _) in &lines {
        serde_json::from_str::<Value>(line).expect("each event is one JSON object");
    }
    let result = events.last().unwrap();
    assert_eq!(result.event, "result");
    let out = stream_bytes(&events, "stdout", 0);
    assert_eq!(result.data["stdout"], String::from_utf8(out).unwrap());
    assert_eq!(stream_bytes(&events, "stderr", 0), b"warn\n");
    let end = format!("{}.5", result.data["stdout"].as_str().unwrap().len());
    assert_eq!(result.id, end);
}

/// A lines-framed stream resumed from the id of any of its events goes on at the next line, in
/// either framing; a resume id taken mid-line (from bytes framing) goes on mid-line.
#[tokio::test(flavor = "multi_thread")]
async fn a_lines_framed_stream_resumes_exactly() {
    let d = Daemon::start();
    let exec_id = start_async(&d, py(JSON_LINES, &marker())).await;
    let whole = finished(&d, &exec_id).await;
    let stdout = whole.json["result"]["stdout"].as_str().unwrap().to_string();
    let open = |framing: &'static str, last: Option<String>| {
        let (d, exec_id) = (&d, exec_id.clone());
        async move {
            let mut req = d
                .client
                .get(format!(
                    "{}/v1/executions/{exec_id}/stream?framing={framing}",
                    d.base
                ))
                .header("authorization", bearer(&d.service_token()));
            if let Some(id) = last {
                req = req.header("last-event-id", id);
            }
            let resp = req.send().await.expect("request");
            assert_eq!(resp.status().as_u16(), 200);
            SseReader {
                resp,
                buf: String::new(),
            }
            .rest()
            .await
        }
    };
    let all = open("lines", None).await;
    let outputs: Vec<&Sse> = all.iter().filter(|e| e.event == "stdout").collect();
    assert_eq!(outputs.len(), 4, "{all:?}");
    for (i, cut) in outputs.iter().enumerate() {
        for framing in ["lines", "bytes"] {
            let rest = open(framing, Some(cut.id.clone())).await;
            assert!(rest.iter().all(|e| e.event != "start"), "{rest:?}");
            let before: usize = cut.id.split('.').next().unwrap().parse().unwrap();
            let after = stream_bytes(&rest, "stdout", before);
            assert_eq!(
                [&stdout.as_bytes()[..before], &after[..]].concat(),
                stdout.as_bytes(),
                "{framing} after event {i}"
            );
            if framing == "lines" {
                assert_eq!(
                    rest.iter().filter(|e| e.event == "stdout").count(),
                    3 - i,
                    "{rest:?}"
                );
            }
        }
    }
    let mid = open("lines", Some("3.0".into())).await;
    let first = mid.iter().find(|e| e.event == "stdout").unwrap();
    assert_eq!(first.data["offset"], 3);
    assert_eq!(first.data["data"], "\":1}\n");
}

/// A framing that is not `bytes` or `lines` is a 400 with the error body, on every stream
/// route, and nothing runs.
#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_framing_is_refused() {
    let d = Daemon::start();
    let m = marker();
    let refused = post_stream(&d, "/execute?framing=words", py("print(1)", &m)).await;
    let r = read(refused).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.json["error_type"], "InvalidRequest");
    assert_eq!(r.json["success"], false);
    assert!(
        r.json["error"].as_str().unwrap().contains("framing"),
        "{}",
        r.text
    );
    assert!(audit_lines_of_marker(&d, &m).is_empty(), "it ran");
    let exec_id = start_async(&d, py("print(1)", &marker())).await;
    for q in ["framing=", "framing=LINES", "framing=lines&framing=bytes"] {
        let r = d
            .client
            .get(format!("{}/v1/executions/{exec_id}/stream?{q}", d.base))
            .header("authorization", bearer(&d.service_token()))
            .send()
            .await
            .expect("request");
        let r = read(r).await;
        assert_eq!(r.status, 400, "{q}: {}", r.text);
        assert_eq!(r.json["error_type"], "InvalidRequest", "{q}");
    }
}

fn audit_lines_of_marker(d: &Daemon, marker: &str) -> Vec<Value> {
    d.audit_lines()
        .into_iter()
        .filter(|l| l.to_string().contains(marker))
        .collect()
}

/// A streamed run whose client goes away runs on unless it said `cancel_on_disconnect`.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_client_that_goes_away_cancels_only_when_asked() {
    let d = Daemon::start();
    let code = "import time\nprint('up', flush=True)\ntime.sleep(3)\nprint('done')";
    for cancel in [false, true] {
        let mut body = py(code, &marker());
        body["cancel_on_disconnect"] = json!(cancel);
        let mut s = open_stream(&d, body).await;
        let start = s.next().await.unwrap();
        let exec_id = start.data["exec_id"].as_str().unwrap().to_string();
        assert_eq!(s.next().await.unwrap().event, "stdout");
        drop(s);
        let r = finished(&d, &exec_id).await;
        let outcome = if cancel { "cancelled" } else { "success" };
        assert_eq!(r.json["result"]["outcome"], outcome, "{}", r.text);
    }
    d.wait_for_metric("executor_open_streams 0").await;
}

fn vm_rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// Fifty streams at once (more than the backend's slots: the rest wait in its queue) each get
/// exactly their own run's output and result, and the daemon's memory stays bounded.
#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_streams_stay_correct_and_memory_stays_bounded() {
    let d = Daemon::start();
    let rss_before = vm_rss_kib(d.pid());
    let code = |n: usize| {
        format!(
            "import time\nfor i in range(100):\n    print('{n:02}', i, 'x' * 1000, flush=True)\n    if i % 20 == 0: time.sleep(0.05)"
        )
    };
    let streams: Vec<_> = (0..50)
        .map(|n| {
            let body = py(&code(n), &marker());
            let cap = d.cap_all();
            let svc = d.service_token();
            let base = d.base.clone();
            tokio::spawn(async move {
                let mut body = body;
                body["capability_token"] = json!(cap);
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(300))
                    .build()
                    .unwrap();
                let resp = client
                    .post(format!("{base}/execute"))
                    .header("authorization", format!("Bearer {svc}"))
                    .header("content-type", "application/json")
                    .header("accept", "text/event-stream")
                    .body(body.to_string())
                    .send()
                    .await
                    .expect("request");
                assert_eq!(resp.status().as_u16(), 200);
                let mut s = SseReader {
                    resp,
                    buf: String::new(),
                };
                (n, s.rest().await)
            })
        })
        .collect();
    for t in streams {
        let (n, events) = t.await.unwrap();
        let last = events.last().expect("events");
        assert_eq!(last.event, "result", "stream {n}");
        assert_eq!(last.data["success"], true, "stream {n}");
        let text = String::from_utf8(stream_bytes(&events, "stdout", 0)).unwrap();
        assert_eq!(last.data["stdout"], text.as_str(), "stream {n}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 100, "stream {n}");
        for (i, l) in lines.iter().enumerate() {
            assert!(
                l.starts_with(&format!("{n:02} {i} ")),
                "stream {n} line {i}: {l:.20}"
            );
        }
    }
    let rss_after = vm_rss_kib(d.pid());
    // Fifty runs of 100 KB each, streamed: what the daemon holds is bounded by the runs' output
    // caps, and it is given back once they are done.
    assert!(
        rss_after < rss_before + 64 * 1024,
        "daemon RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    d.wait_for_metric("executor_open_streams 0").await;
    d.wait_for_metric("executor_runs_live 0").await;
}

/// Streams over `executions.max_open_streams` are refused with 429 before anything runs; a
/// stream that ends gives its place back.
#[tokio::test(flavor = "multi_thread")]
async fn streams_over_the_limit_are_refused_before_anything_runs() {
    let d = Daemon::start_with(common::Opts {
        config: Some("[executions]\nmax_open_streams = 1\n".into()),
        ..Default::default()
    });
    let m = marker();
    let mut first = open_stream(
        &d,
        // Runs until cancelled below: its stream holds the one place meanwhile.
        py("import time\nprint('up', flush=True)\ntime.sleep(300)", &m),
    )
    .await;
    let start = first.next().await.expect("start");
    let exec_id = start.data["exec_id"].as_str().unwrap().to_string();
    let refused_marker = marker();
    let mut body = py("print('never')", &refused_marker);
    body["capability_token"] = json!(d.cap_all());
    let refused = d
        .client
        .post(format!("{}/execute", d.base))
        .header("authorization", bearer(&d.service_token()))
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let follow = d
        .client
        .get(format!("{}/v1/executions/{exec_id}/stream", d.base))
        .header("authorization", bearer(&d.service_token()))
        .send()
        .await
        .unwrap();
    assert_eq!(follow.status().as_u16(), 429);
    assert!(
        !d.audit_lines()
            .iter()
            .any(|l| l.to_string().contains(&refused_marker)),
        "a refused stream ran nothing"
    );
    let svc = d.service_token();
    let r = cancel(&d, &exec_id, &svc, r#"{"grace_seconds": 0}"#).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let rest = first.rest().await;
    assert_eq!(rest.last().unwrap().event, "result");
    drop(first);
    d.wait_for_metric("executor_open_streams 0").await;
    let mut again = follow_stream(&d, &exec_id, None).await;
    assert_eq!(again.rest().await.last().unwrap().event, "result");
}

/// A run cancelled with a long grace is still killed when the daemon's own shutdown grace runs
/// out first: the shutdown's kill is not lost behind the cancel's grace, the run's end is
/// audited and nothing of it is left.
#[tokio::test(flavor = "multi_thread")]
async fn a_shutdown_kills_a_run_still_in_its_cancel_grace() {
    let mut d = Daemon::start_with(common::Opts {
        config: Some("[server]\nshutdown_grace_seconds = 1\n".into()),
        ..Default::default()
    });
    let svc = d.service_token();
    let m = marker();
    let code = "import signal, time\n\
                signal.signal(signal.SIGTERM, signal.SIG_IGN)\n\
                while True: time.sleep(0.05)";
    let exec_id = start_async(&d, py(code, &m)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    // Cancel only once SIGTERM is ignored, as the kernel shows it (SigIgn bit 14).
    loop {
        let ignored = pids_with_cmdline(&m).first().is_some_and(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("SigIgn:"))
                .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
                .is_some_and(|mask| mask & (1 << 14) != 0)
        });
        if ignored {
            break;
        }
        assert!(Instant::now() < deadline, "the run never ignored SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = cancel(&d, &exec_id, &svc, r#"{"grace_seconds": 30}"#).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let stopping = Instant::now();
    assert_eq!(d.stop(), Some(0));
    // A bound, not a timing check: well inside the cancel's 30 s grace, far above the
    // shutdown's 1 s.
    assert!(
        stopping.elapsed() < Duration::from_secs(20),
        "the daemon took {:?} to stop: the shutdown waited for the cancel's grace",
        stopping.elapsed()
    );
    let lines = audit_lines_of(&d, &exec_id);
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(
        events,
        ["execution_start", "execution_cancel", "execution"],
        "{lines:?}"
    );
    assert_eq!(lines[2]["killed_reason"], "cancelled");
    // They ignore SIGTERM: without the kill they would never end.
    common::wait_for_no_process(&m);
}

/// A stream refused for want of a place (429, Retry-After 1) gives its Idempotency-Key back: a
/// retry with the same key once a place is free streams the run instead of being told for the
/// key's whole lease that the refused request is still in progress.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_refused_over_the_limit_releases_its_idempotency_key() {
    let d = Daemon::start_with(common::Opts {
        config: Some("[executions]\nmax_open_streams = 1\n".into()),
        ..Default::default()
    });
    let mut first = open_stream(
        &d,
        py(
            "print('up', flush=True)\nimport time\ntime.sleep(0.5)",
            &marker(),
        ),
    )
    .await;
    first.next().await.expect("start");
    let mut body = py("print('retried')", &marker());
    body["capability_token"] = json!(d.cap_all());
    let key = uuid::Uuid::new_v4().to_string();
    let (svc, body) = (d.service_token(), body.to_string());
    let send = || {
        d.client
            .post(format!("{}/execute", d.base))
            .header("authorization", bearer(&svc))
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .header("idempotency-key", &key)
            .body(body.clone())
            .send()
    };
    let refused = send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    drop(refused);
    first.rest().await;
    drop(first);
    d.wait_for_metric("executor_open_streams 0").await;
    let retried = send().await.unwrap();
    let status = retried.status().as_u16();
    let text = if status == 200 {
        String::new()
    } else {
        retried.text().await.unwrap_or_default()
    };
    assert_eq!(status, 200, "the retry was refused: {text}");
}
