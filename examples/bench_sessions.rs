//! Benchmark: sessions on one backend (`BACKEND`: local, runc or gvisor; default local).
//!
//! 1. Exec latency: `print(1)` as an exec in a warm python session against `/execute` of
//!    `python3 -c 'print(1)'` (the same-run baseline), interleaved in blocks of 25 so load changes
//!    weigh on both.
//! 2. Session create: `POST /v1/sandbox/sessions` (each deleted again outside the timing), against
//!    the same `/execute` as a reference.
//!
//! On docker and gVisor every `/execute` and every create waits first until the warm pool is full
//! again (the "warm" figures: what a caller sees when requests do not outrun the refills); a
//! session's exec never takes a container (it runs in the session's own).
//!
//! 3. Pause and resume: a session whose workspace holds 1 MB, then one holding 100 MB, paused and
//!    resumed again and again (each timed on its own), against session create in the same run (a
//!    resume is a create plus the workspace's restore).
//!
//! 4. Terminal round trip: a keystroke typed into a session's terminal WebSocket until its echo
//!    comes back (bash's readline echoes it), against the same keystroke on a host pty running
//!    bash with no daemon between (the same-run baseline).
//!
//! 5. The ports proxy (local and runc): GETs of a server a background process runs in a session,
//!    through `…/ports/8000/x`, against GETs of it from inside the sandbox's network namespace
//!    (a thread of this process `setns(2)` into it: as root) on one kept connection (as the proxy
//!    keeps its connection into the sandbox between requests), and on a connection of its own per
//!    GET (for reference), interleaved in blocks of 25; and GETs of the daemon's `/livez` with
//!    the proxied GETs' client (the daemon's floor: what any request through it costs).
//!
//! Targets: a terminal round trip p50 at most 5 ms on local; a proxied GET p50 at most 1.5x the direct one; an exec p50 at most 1.2x the `/execute` p50; a create p50 at most 10 ms on local, at
//! most the warm `/execute` p50 on docker and gVisor; on local, a resume of 100 MB within 1 s
//! (p50).
//!
//! Run: `scripts/bench-sessions.sh [local|runc|gvisor]` (builds release and runs this as root).
//! Prints p50/p95/p99 and the ratios; `BENCH_JSON=<path>` also writes them as JSON, `BENCH_QUICK=1`
//! takes a tenth of the samples (see `scripts/bench.sh`).

use std::time::Instant;

use executor_arm::config::TokenKind;
use support::report::{Report, Series, Target, count};

mod support;
#[path = "support/terminal.rs"]
mod terminal;

/// Samples per series on the local backend; the container backends take half (each of their
/// `/execute` samples waits for a refill).
const N: usize = 200;
const BLOCK: usize = 25;
const WARMUP: usize = 10;
const CREATES: usize = 60;
/// Pause-and-resume cycles per workspace size.
const CYCLES: usize = 20;
/// The workspace sizes paused and resumed (bytes of one random file; the python profile's
/// workspace quota is 100 MiB).
const SIZES: [(&str, usize); 2] = [("1mb", 1_000_000), ("100mb", 100_000_000)];

/// Idle warm containers of the python profile, from `/metrics` (all keys: the `/execute` one
/// and the session one).
async fn pool_idle(client: &reqwest::Client, base: &str) -> u64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    text.lines()
        .filter(|l| {
            l.starts_with("executor_pool_idle_containers{") && l.contains("profile=\"python\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits until the python profile's pools hold `n` idle containers (at most 60 s).
async fn wait_pool(client: &reqwest::Client, base: &str, n: u64) {
    let until = Instant::now() + std::time::Duration::from_secs(60);
    while pool_idle(client, base).await < n && Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let backend = std::env::var("BACKEND").unwrap_or_else(|_| "local".into());
    let containers = backend != "local";
    let sessions_dir = tempfile::tempdir().expect("tempdir");
    let dir = sessions_dir.path().to_string_lossy().into_owned();
    let mut env = vec![("EXECUTOR_ARM_SESSIONS_DIR", dir.as_str())];
    if containers {
        env.push(("SANDBOX_RUNTIME", backend.as_str()));
    }
    let d = support::Daemon::start(&env);
    let n = count(if containers { N / 2 } else { N }, 2 * BLOCK);
    let (warmup, creates_n) = (count(WARMUP, 3), count(CREATES, 10));
    // Both pools (the /execute key and the session key) at the default pool_size of 2.
    let full = 4;
    let base = format!("http://{}", d.addr);
    let svc = format!("Bearer {}", d.mint(TokenKind::Service, &[]));
    let cap = d.mint(TokenKind::Capability, &["PythonExecute"]);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4)
        .build()
        .expect("client");
    let post = |path: String, body: serde_json::Value| {
        client
            .post(format!("{base}{path}"))
            .header("authorization", &svc)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let create = || async {
        let r = post(
            "/v1/sandbox/sessions".into(),
            serde_json::json!({"language": "python", "capability_token": cap}),
        )
        .await
        .expect("create");
        assert_eq!(r.status().as_u16(), 201);
        let v: serde_json::Value = r.json().await.expect("json");
        v["id"].as_str().expect("id").to_string()
    };
    let delete = |id: String| {
        let rb = client
            .delete(format!("{base}/v1/sandbox/sessions/{id}"))
            .header("authorization", &svc);
        async move {
            let r = rb.send().await.expect("delete");
            assert_eq!(r.status().as_u16(), 204);
        }
    };
    let session = create().await;
    let exec_path = format!("/v1/sandbox/sessions/{session}/exec");
    let exec_once = || async {
        let t = Instant::now();
        let r = post(exec_path.clone(), serde_json::json!({"code": "print(1)"}))
            .await
            .expect("exec");
        let text = r.text().await.expect("body");
        assert!(text.contains("\"stdout\":\"1\\n\""), "{text}");
        t.elapsed().as_secs_f64() * 1000.0
    };
    let execute_body = serde_json::json!({"action_type": "python", "command": "python3",
        "args": ["-c", "print(1)"], "capability_token": cap});
    let execute_once = || async {
        if containers {
            wait_pool(&client, &base, full).await;
        }
        let t = Instant::now();
        let r = post("/execute".into(), execute_body.clone())
            .await
            .expect("execute");
        let text = r.text().await.expect("body");
        assert!(text.contains("\"stdout\":\"1\\n\""), "{text}");
        t.elapsed().as_secs_f64() * 1000.0
    };
    for _ in 0..warmup {
        exec_once().await;
        execute_once().await;
    }
    let (mut in_session, mut execute) = (Vec::new(), Vec::new());
    for _ in 0..n / BLOCK {
        for _ in 0..BLOCK {
            in_session.push(exec_once().await);
        }
        for _ in 0..BLOCK {
            execute.push(execute_once().await);
        }
    }
    delete(session).await;
    let mut creates = Vec::new();
    for _ in 0..creates_n {
        if containers {
            wait_pool(&client, &base, full).await;
        }
        let t = Instant::now();
        let id = create().await;
        creates.push(t.elapsed().as_secs_f64() * 1000.0);
        delete(id).await;
    }

    // Terminal round trips, then the host pty's (the baseline), one after the other.
    let keystrokes = count(N, 20);
    if containers {
        wait_pool(&client, &base, full).await;
    }
    let term_session = create().await;
    let over_ws = terminal::over_websocket(&d.addr, &svc, &term_session, keystrokes).await;
    delete(term_session).await;
    let on_host = tokio::task::spawn_blocking(move || terminal::host_pty(keystrokes))
        .await
        .expect("host pty");

    // Pause and resume, for each workspace size.
    let cycles = count(CYCLES, 3);
    let mut paused: Vec<(&str, Vec<f64>, Vec<f64>)> = Vec::new();
    for (name, bytes) in SIZES {
        if containers {
            wait_pool(&client, &base, full).await;
        }
        let id = create().await;
        let fill = post(
            format!("/v1/sandbox/sessions/{id}/exec"),
            serde_json::json!({"code": format!("import os\nopen('blob','wb').write(os.urandom({bytes}))"),
                "timeout_ms": 120000}),
        )
        .await
        .expect("fill");
        assert_eq!(
            fill.status().as_u16(),
            200,
            "{}",
            fill.text().await.unwrap_or_default()
        );
        let (mut pauses, mut resumes) = (Vec::new(), Vec::new());
        for _ in 0..cycles {
            if containers {
                wait_pool(&client, &base, full).await;
            }
            for (what, samples) in [("pause", &mut pauses), ("resume", &mut resumes)] {
                let t = Instant::now();
                let r = post(
                    format!("/v1/sandbox/sessions/{id}/{what}"),
                    serde_json::json!({}),
                )
                .await
                .expect(what);
                let status = r.status().as_u16();
                let text = r.text().await.expect("body");
                assert_eq!(status, 200, "{what}: {text}");
                samples.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        delete(id).await;
        paused.push((name, pauses, resumes));
    }

    // The ports proxy: GETs through it against GETs from inside the sandbox's network namespace
    // (none on gVisor: its network stack is the sentry's, out of a host thread's reach).
    let ports = if backend == "gvisor" {
        None
    } else {
        if containers {
            wait_pool(&client, &base, full).await;
        }
        let id = create().await;
        let nonce = format!("bench-{}", std::process::id());
        let started = post(
            format!("/v1/sandbox/sessions/{id}/exec"),
            serde_json::json!({"code": support::ports::server(&nonce), "background": true}),
        )
        .await
        .expect("start the server");
        assert_eq!(started.status().as_u16(), 202);
        let url = format!(
            "{base}/v1/sandbox/sessions/{id}/ports/{}/x",
            support::ports::PORT
        );
        let proxied_once = || async {
            let t = Instant::now();
            let r = client
                .get(&url)
                .header("authorization", &svc)
                .send()
                .await
                .expect("proxied GET");
            let status = r.status().as_u16();
            let body = r.text().await.expect("body");
            (t.elapsed().as_secs_f64() * 1000.0, status, body)
        };
        let until = Instant::now() + std::time::Duration::from_secs(30);
        while proxied_once().await.1 != 200 {
            assert!(
                Instant::now() < until,
                "the in-sandbox server never answered"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let direct = support::ports::Direct::find(&nonce).expect("the sandbox's network namespace");
        use support::ports::How;
        for how in [How::Client, How::Socket, How::Fresh] {
            direct.run(warmup, how);
        }
        // The daemon's own floor: a GET it answers itself (/livez), same client and connection.
        let health = format!("{base}/livez");
        let floor_once = || async {
            let t = Instant::now();
            let r = client.get(&health).send().await.expect("GET /livez");
            let status = r.status().as_u16();
            r.bytes().await.expect("body");
            assert_eq!(status, 200);
            t.elapsed().as_secs_f64() * 1000.0
        };
        for _ in 0..warmup {
            proxied_once().await;
            floor_once().await;
        }
        let (mut through, mut straight, mut socket, mut fresh, mut floor) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n / BLOCK {
            for _ in 0..BLOCK {
                let (ms, status, body) = proxied_once().await;
                assert_eq!((status, body.as_str()), (200, nonce.as_str()));
                through.push(ms);
            }
            for _ in 0..BLOCK {
                floor.push(floor_once().await);
            }
            straight.extend(direct.run(BLOCK, How::Client));
            socket.extend(direct.run(BLOCK, How::Socket));
            fresh.extend(direct.run(BLOCK, How::Fresh));
        }
        delete(id).await;
        Some((through, straight, socket, fresh, floor))
    };

    println!(
        "backend {backend}, {n} each, interleaved in blocks of {BLOCK}{}",
        if containers {
            "; every /execute and create waits for a full warm pool"
        } else {
            ""
        }
    );
    let mut report = Report::new(&format!("sessions-{backend}"), 52);
    report.fact("backend", backend.as_str());
    report.fact("n", n);
    report.fact("block", BLOCK);
    report.fact("creates", creates_n);
    report.fact("waits_for_full_pool", containers);
    report.fact("pause_resume_cycles", cycles);
    let id = |what: &str| format!("sessions.{backend}.{what}");
    let (exec_id, execute_id, create_id) = (id("exec"), id("execute"), id("create"));
    let series = |id, label, baseline| Series {
        id,
        label,
        backend: &backend,
        baseline,
    };
    let a = report.series(
        series(
            &exec_id,
            "exec print(1) in a warm python session",
            Some(&execute_id),
        ),
        &in_session,
    );
    let b = report.series(
        series(
            &execute_id,
            "/execute python3 -c 'print(1)' (baseline)",
            None,
        ),
        &execute,
    );
    report.ratio(
        &id("exec_vs_execute"),
        &format!("p50 session exec / execute ({backend})"),
        a.p50 / b.p50,
        Some(Target::AtMost(1.2)),
    );
    let c = report.series(
        series(
            &create_id,
            "POST /v1/sandbox/sessions (python)",
            Some(&execute_id),
        ),
        &creates,
    );
    if containers {
        report.ratio(
            &id("create_vs_execute"),
            &format!("p50 session create / warm execute ({backend})"),
            c.p50 / b.p50,
            Some(Target::AtMost(1.0)),
        );
    } else {
        report.ratio(
            &id("create_vs_execute"),
            &format!("p50 session create / execute ({backend})"),
            c.p50 / b.p50,
            None,
        );
        report.target(
            &id("create.p50"),
            "session create p50 (local)",
            c.p50,
            "ms",
            Target::AtMost(10.0),
        );
    }
    let (term_id, pty_id) = (id("terminal"), id("host_pty"));
    let t = report.series(
        series(
            &term_id,
            "terminal keystroke -> echo over the WebSocket",
            Some(&pty_id),
        ),
        &over_ws,
    );
    let h = report.series(
        series(&pty_id, "host pty keystroke -> echo, bash (baseline)", None),
        &on_host,
    );
    report.ratio(
        &id("terminal_vs_host_pty"),
        &format!("p50 terminal / host pty ({backend})"),
        t.p50 / h.p50,
        None,
    );
    if !containers {
        report.target(
            &id("terminal.p50"),
            "terminal round trip p50 (local)",
            t.p50,
            "ms",
            Target::AtMost(5.0),
        );
    }
    for (name, pauses, resumes) in &paused {
        let (pause_id, resume_id) = (id(&format!("pause_{name}")), id(&format!("resume_{name}")));
        let (pause_label, resume_label) = (
            format!("POST …/pause, {name} workspace"),
            format!("POST …/resume, {name} workspace"),
        );
        report.series(
            Series {
                id: &pause_id,
                label: &pause_label,
                backend: &backend,
                baseline: Some(&create_id),
            },
            pauses,
        );
        let r = report.series(
            Series {
                id: &resume_id,
                label: &resume_label,
                backend: &backend,
                baseline: Some(&create_id),
            },
            resumes,
        );
        report.ratio(
            &id(&format!("resume_{name}_vs_create")),
            &format!("p50 resume ({name}) / session create ({backend})"),
            r.p50 / c.p50,
            None,
        );
        if !containers && *name == "100mb" {
            report.target(
                &id("resume_100mb.p50"),
                "resume of a 100 MB workspace p50 (local)",
                r.p50,
                "ms",
                Target::AtMost(1000.0),
            );
        }
    }
    if let Some((through, straight, socket, fresh, floor)) = &ports {
        let (port_id, direct_id) = (id("port_get"), id("port_direct"));
        let (socket_id, fresh_id) = (id("port_direct_socket"), id("port_direct_fresh"));
        let p = report.series(
            series(
                &port_id,
                "GET through …/ports/8000/ (kept connection to the daemon)",
                Some(&direct_id),
            ),
            through,
        );
        let q = report.series(
            series(
                &direct_id,
                "GET of the same server from its netns, same client, kept connection (baseline)",
                None,
            ),
            straight,
        );
        report.ratio(
            &id("port_vs_direct"),
            &format!("p50 proxied GET / direct GET ({backend})"),
            p.p50 / q.p50,
            Some(Target::AtMost(1.5)),
        );
        report.ratio(
            &id("port_vs_direct_p99"),
            &format!("p99 proxied GET / direct GET ({backend})"),
            p.p99 / q.p99,
            None,
        );
        // For reference: against direct GETs over a bare socket, kept and of their own.
        let k = report.series(
            series(
                &socket_id,
                "GET from its netns over a bare socket, kept connection",
                None,
            ),
            socket,
        );
        report.ratio(
            &id("port_vs_direct_socket"),
            &format!("p50 proxied GET / bare-socket direct GET ({backend})"),
            p.p50 / k.p50,
            None,
        );
        let f = report.series(
            series(&fresh_id, "GET from its netns, a connection per GET", None),
            fresh,
        );
        report.ratio(
            &id("port_vs_direct_fresh"),
            &format!("p50 proxied GET / direct GET on a new connection ({backend})"),
            p.p50 / f.p50,
            None,
        );
        // The daemon's floor: any request through it costs at least this, so a proxied GET is
        // at least floor + direct; what the proxy adds beyond both is the difference.
        let h = report.series(
            series(
                &id("daemon_floor"),
                "GET /livez of the daemon, same client, kept connection (the daemon's floor)",
                None,
            ),
            floor,
        );
        report.ratio(
            &id("floor_plus_direct_vs_direct"),
            &format!("p50 (daemon floor + direct GET) / direct GET ({backend}): the least any proxy through the daemon could reach"),
            (h.p50 + q.p50) / q.p50,
            None,
        );
        report.ratio(
            &id("port_vs_floor_plus_direct"),
            &format!("p50 proxied GET / (daemon floor + direct GET) ({backend})"),
            p.p50 / (h.p50 + q.p50),
            None,
        );
    }
    report.write();
}
