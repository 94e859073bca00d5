//! What an execution leaves behind: its audit lines (refusals, start, end) and its metrics.
//!
//! Every line is one typed [`AuditEvent`]; nothing here builds a line by hand. An append that
//! fails is logged and counted, never returned: the caller's answer still goes out.
//!
//! Owns: which event a refusal or a run writes and when, and the counters that go with it.
//! Must not: know HTTP (statuses are the audit line's numbers, not a response).

use std::sync::Arc;

use super::runs::{Render, Unanswered};
use crate::metrics::Metrics;
use crate::policy::Plan;
use crate::provenance::audit::{self, AuditError, AuditEvent, AuditLog, RunEnd};
use crate::provenance::command_hash;
use crate::sandbox::RunOutcome;
use crate::state::{IdemKey, StateStore, StoredExecution};

/// Longest refusal reason an audit line carries, in characters.
const MAX_REASON_CHARS: usize = 512;

/// Everything known about a request when it is refused: who asked for what, as far as the request
/// had been read. A refusal's audit line carries it.
#[derive(Debug, Clone, Default)]
pub struct KnownRequest {
    pub request_id: String,
    pub subject: Option<String>,
    pub token_id: Option<String>,
    pub action_type: Option<String>,
    pub command: Option<String>,
    pub args: Vec<String>,
}

/// The two kinds of refusal that are audited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// 401: the caller or its capability token could not be verified (or was replayed).
    Unauthorized,
    /// 403: the request is outside what the token, the allowlist or a profile permits.
    CapabilityViolation,
}

impl RefusalKind {
    /// The status the line records (and the caller is answered with).
    pub fn status(self) -> u16 {
        match self {
            RefusalKind::Unauthorized => 401,
            RefusalKind::CapabilityViolation => 403,
        }
    }

    pub fn error_type(self) -> &'static str {
        match self {
            RefusalKind::Unauthorized => "Unauthorized",
            RefusalKind::CapabilityViolation => "CapabilityViolation",
        }
    }
}

/// Counts a refusal and appends its line, unless its class is over its rate: then it is only
/// counted (see `AuditLog::admit_refusal`). A 401 that got a line is logged too; a flood of them
/// is logged only as far as it is audited.
pub fn refusal(
    audit: &AuditLog,
    metrics: &Metrics,
    known: &KnownRequest,
    kind: RefusalKind,
    reason: &str,
) {
    match kind {
        RefusalKind::Unauthorized => metrics.auth_failures.increment(1),
        RefusalKind::CapabilityViolation => metrics.capability_violations.increment(1),
    }
    let status = kind.status();
    // A caller whose service token was verified draws from its own bucket: a flood from callers
    // without one cannot crowd its refusals out.
    let authenticated = known.subject.is_some() || known.token_id.is_some();
    if !audit.admit_refusal(status, authenticated) {
        metrics
            .audit_refusals_suppressed
            .with_label_values(&[&status.to_string()])
            .increment(1);
        return;
    }
    let event = AuditEvent::Refusal(audit::Refusal {
        request_id: known.request_id.clone(),
        status,
        error_type: kind.error_type(),
        // Reasons quote what the caller sent (a kid, an option): bounded, so a refusal line
        // stays small whatever arrives.
        reason: crate::auth::clip(reason, MAX_REASON_CHARS),
        subject: known.subject.clone(),
        token_id: known.token_id.clone(),
        action_type: known.action_type.clone(),
        command: known.command.clone(),
        command_hash: known.command.as_ref().map(|c| command_hash(c, &known.args)),
    });
    record(audit, metrics, &event);
    if kind == RefusalKind::Unauthorized {
        tracing::info!(request_id = %known.request_id, %reason, "401");
    }
}

/// An admitted execution: its `execution_start` line is written, and exactly one end line
/// follows whatever happens — `execution` ([`AdmittedRun::finish`]), `execution_error`
/// ([`AdmittedRun::fail`]), or, when it is dropped without either (a panic, a run handle
/// dropped before it ran), an `execution_error` written on drop.
pub struct AdmittedRun {
    audit: Arc<AuditLog>,
    metrics: Arc<Metrics>,
    run: audit::Run,
    ended: bool,
}

impl AdmittedRun {
    /// Writes the start line; when that fails nothing may run. The line is not fsync'd on its
    /// own: the end line's fsync covers it, one per execution.
    pub fn admit(
        audit: &Arc<AuditLog>,
        metrics: &Arc<Metrics>,
        run: audit::Run,
    ) -> Result<Self, AuditError> {
        let event = AuditEvent::ExecutionStart(run.clone());
        if let Err(e) = audit.append(&event) {
            count_failed_append(metrics, &event, &e);
            return Err(e);
        }
        Ok(AdmittedRun {
            audit: audit.clone(),
            metrics: metrics.clone(),
            run,
            ended: false,
        })
    }

    /// What every line of this run carries.
    pub fn run(&self) -> &audit::Run {
        &self.run
    }

    /// The run reached an outcome; returns where its end line went (none when it could not be
    /// written: counted and logged).
    pub fn finish(mut self, end: RunEnd) -> Option<audit::Entry> {
        self.ended = true;
        let event = AuditEvent::Execution {
            run: self.run.clone(),
            end: Box::new(end),
        };
        match self.audit.append_entry(&event) {
            Ok(entry) => Some(entry),
            Err(e) => {
                count_failed_append(&self.metrics, &event, &e);
                None
            }
        }
    }

    /// The run ended without an outcome.
    pub fn fail(mut self, error_type: &'static str, error: &str) -> Option<u64> {
        self.ended = true;
        self.write_error(error_type, error)
    }

    fn write_error(&self, error_type: &'static str, error: &str) -> Option<u64> {
        self.metrics
            .executions
            .with_label_values(&[self.run.action_type.as_ref(), "false"])
            .increment(1);
        self.metrics
            .executions_by_backend
            .with_label_values(&[self.run.backend.as_ref(), &self.run.profile, "error"])
            .increment(1);
        let event = AuditEvent::ExecutionError {
            run: self.run.clone(),
            error_type,
            error: error.to_string(),
        };
        record(&self.audit, &self.metrics, &event)
    }
}

impl Drop for AdmittedRun {
    fn drop(&mut self) {
        if !self.ended {
            self.write_error(
                "InternalError",
                "the request ended before its run's end line was written",
            );
        }
    }
}

/// Ends the runs an earlier daemon process started on this audit log and never ended (it
/// stopped mid-run: a crash, a kill): one `execution_error` line each, the run's record finished
/// with that error (kept `retention`; it said "running" until then), and the Idempotency-Key
/// such a run held is released so that a retry runs. Called once at start, before serving;
/// `render` says what such a run is answered with.
pub async fn record_interrupted(
    audit: &AuditLog,
    store: &dyn StateStore,
    metrics: &Metrics,
    retention: std::time::Duration,
    render: Render,
) {
    for i in audit.interrupted() {
        tracing::warn!(
            exec_id = %i.run.exec_id,
            instance = %i.instance,
            start_seq = i.seq,
            "a run of an earlier daemon process never ended: recording it"
        );
        let event = AuditEvent::ExecutionError {
            run: i.run.clone(),
            error_type: "DaemonStopped",
            error: format!(
                "the daemon (instance {}) stopped during the run",
                i.instance
            ),
        };
        record(audit, metrics, &event);
        metrics.interrupted_runs.increment(1);
        finish_record(store, i, retention, render).await;
        let Some(scoped) = &i.run.idempotency_key else {
            continue;
        };
        let Some(key) = IdemKey::from_scoped(scoped) else {
            tracing::error!(exec_id = %i.run.exec_id, idempotency_key = %scoped, "idempotency key of an interrupted run not released: not a scoped key");
            continue;
        };
        if let Err(e) = store.idempotency_release(&key, &i.instance).await {
            tracing::error!(exec_id = %i.run.exec_id, error = %e, "idempotency key of an interrupted run not released");
        }
    }
}

/// Marks the record of interrupted run `i` finished, answered as [`Unanswered::DaemonStopped`],
/// unless the store has its answer already.
async fn finish_record(
    store: &dyn StateStore,
    i: &audit::Interrupted,
    retention: std::time::Duration,
    render: Render,
) {
    let key = IdemKey {
        subject: i
            .run
            .owner
            .clone()
            .unwrap_or_else(|| super::runs::owner_of(i.run.subject.as_deref())),
        key: i.run.exec_id.clone(),
    };
    match store.execution_get(&key).await {
        Ok(Some(r)) if r.response.is_some() => return,
        Ok(_) => {}
        Err(e) => {
            tracing::error!(exec_id = %i.run.exec_id, error = %e, "record of an interrupted run not read");
            return;
        }
    }
    let finished = StoredExecution {
        instance: i.instance.clone(),
        address: None,
        response: Some(render(&Unanswered::DaemonStopped {
            instance: i.instance.clone(),
        })),
        cancelled_by: None,
        backend: Some(i.run.backend.to_string()),
        profile: Some(i.run.profile.clone()),
    };
    if let Err(e) = store.execution_put(&key, &finished, retention).await {
        tracing::error!(exec_id = %i.run.exec_id, error = %e, "record of an interrupted run not finished");
    }
}

/// Appends `event`. A failure is logged and counted, not returned: the answer still goes out.
pub fn record(audit: &AuditLog, metrics: &Metrics, event: &AuditEvent) -> Option<u64> {
    match audit.append(event) {
        Ok(seq) => Some(seq),
        Err(e) => {
            count_failed_append(metrics, event, &e);
            None
        }
    }
}

fn count_failed_append(metrics: &Metrics, event: &AuditEvent, e: &AuditError) {
    metrics
        .audit_append_failures
        .with_label_values(&[event.name()])
        .increment(1);
    tracing::error!(error = %e, event = event.name(), "audit append failed");
}

/// The series a run that reached an outcome moves.
pub fn run_metrics(m: &Metrics, plan: &Plan, outcome: &'static str, o: &RunOutcome) {
    let success = outcome == "success";
    m.executions
        .with_label_values(&[
            plan.action_type.as_str(),
            if success { "true" } else { "false" },
        ])
        .increment(1);
    m.executions_by_backend
        .with_label_values(&[plan.backend.as_str(), &plan.profile.name, outcome])
        .increment(1);
    m.duration.record(o.duration.as_secs_f64());
    m.duration_by_backend
        .with_label_values(&[plan.backend.as_str()])
        .record(o.duration.as_secs_f64());
    if o.timed_out() {
        m.timeouts.increment(1);
    }
    if o.oom {
        m.ooms.increment(1);
    }
    if o.stdout_truncated || o.stderr_truncated {
        m.output_truncations.increment(1);
    }
    for c in &o.network {
        let verdict = if c.allowed {
            "allowed"
        } else if c.is_refusal() {
            "refused"
        } else {
            "failed"
        };
        m.egress_connections
            .with_label_values(&[verdict])
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;

    use super::*;
    use crate::provenance::sha256_prefixed;

    fn run(exec_id: &str) -> audit::Run {
        audit::Run {
            request_id: "req-1".into(),
            exec_id: exec_id.into(),
            subject: None,
            owner: None,
            token_id: Some("tok-1".into()),
            action_type: "shell".into(),
            command: "echo".into(),
            args: vec!["hi".into()],
            command_hash: command_hash("echo", &["hi".into()]),
            invocation_hash: "sha256:i".into(),
            backend: "local".into(),
            profile: "shell-readonly".into(),
            timeout_seconds: 30,
            idempotency_key: None,
            via: None,
        }
    }

    fn end() -> RunEnd {
        RunEnd {
            capabilities_used: vec!["ShellExecute"],
            outcome: "success",
            exit_code: 0,
            duration_ms: 1,
            killed_reason: None,
            oom: false,
            peak_memory_kib: None,
            stdout_sha256: sha256_prefixed(b"hi\n"),
            stderr_sha256: sha256_prefixed(b""),
            stdout_truncated: false,
            stderr_truncated: false,
            executor_def_sha256: None,
            error_code: None,
            network: None,
            metadata: None,
            container_id: None,
            container_uses: None,
        }
    }

    /// Every admitted run ends in exactly one end line paired with its start by exec_id: an outcome,
    /// an error, or — when the request path panics between the two — an error written on drop.
    #[test]
    fn an_admitted_run_always_ends_in_exactly_one_end_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = Arc::new(AuditLog::open(&path, "i-1").unwrap());
        let metrics = Arc::new(Metrics::new());

        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _admitted = AdmittedRun::admit(&log, &metrics, run("exec-a")).unwrap();
            panic!("the request path panicked mid-run");
        }));
        assert!(panicked.is_err());
        let failed = AdmittedRun::admit(&log, &metrics, run("exec-b"))
            .unwrap()
            .fail("SandboxUnavailable", "docker engine unreachable");
        assert_eq!(failed, Some(4));
        let finished = AdmittedRun::admit(&log, &metrics, run("exec-c"))
            .unwrap()
            .finish(end());
        assert_eq!(finished.map(|e| e.seq), Some(6));

        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let events: Vec<(&str, &str, Option<&str>)> = lines
            .iter()
            .map(|l| {
                (
                    l["event"].as_str().unwrap(),
                    l["exec_id"].as_str().unwrap(),
                    l["error_type"].as_str(),
                )
            })
            .collect();
        assert_eq!(
            events,
            [
                ("execution_start", "exec-a", None),
                ("execution_error", "exec-a", Some("InternalError")),
                ("execution_start", "exec-b", None),
                ("execution_error", "exec-b", Some("SandboxUnavailable")),
                ("execution_start", "exec-c", None),
                ("execution", "exec-c", None),
            ]
        );
        // Every line of a run carries who asked for what.
        for l in &lines {
            assert_eq!(l["token_id"], "tok-1", "{l}");
            assert_eq!(
                l["command_hash"],
                command_hash("echo", &["hi".into()]),
                "{l}"
            );
        }
        assert_eq!(lines[5]["outcome"], "success");
        assert!(crate::provenance::audit::verify(&path).is_ok());
        let rendered = metrics.render();
        assert!(
            rendered.lines().any(|l| l
                == "executor_backend_executions_total{backend=\"local\",outcome=\"error\",profile=\"shell-readonly\"} 2"),
            "{rendered}"
        );
    }

    /// A run an earlier process left without an end line gets one `DaemonStopped` end line at the
    /// next start, and the Idempotency-Key it held is released (only that owner's claim).
    #[tokio::test]
    async fn interrupted_runs_are_ended_once_and_their_keys_released() {
        use crate::state::memory::MemoryStore;
        use crate::state::{IdemBegin, IdemKey, StateStore};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let store = MemoryStore::new(1 << 20, 0);
        let lease = Duration::from_secs(60);
        let key = |k: &str| IdemKey {
            subject: "orchestrator".into(),
            key: k.into(),
        };
        let mut keyed = run("exec-a");
        keyed.idempotency_key = Some(key("k").scoped());
        assert_eq!(
            store
                .idempotency_begin(&key("k"), "h", "old-1", lease)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        assert_eq!(
            store
                .idempotency_begin(&key("other"), "h", "someone-else", lease)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        {
            let log = Arc::new(AuditLog::open(&path, "old-1").unwrap());
            let metrics = Arc::new(Metrics::new());
            // A crash: the start lines are written, the runs never end.
            std::mem::forget(AdmittedRun::admit(&log, &metrics, keyed).unwrap());
            std::mem::forget(AdmittedRun::admit(&log, &metrics, run("exec-b")).unwrap());
            // Started by a service token without a subject, with a capability token that has one.
            let mut owned = run("exec-c");
            owned.subject = Some("orchestrator".into());
            owned.owner = Some("-".into());
            std::mem::forget(AdmittedRun::admit(&log, &metrics, owned).unwrap());
        }

        let log = AuditLog::open(&path, "new-2").unwrap();
        let metrics = Metrics::new();
        let render = |u: &Unanswered| crate::state::StoredResponse {
            status: 0,
            body: format!("{u:?}"),
            receipt: None,
        };
        record_interrupted(&log, &store, &metrics, Duration::from_secs(60), render).await;
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let ends: Vec<_> = lines
            .iter()
            .filter(|l| l["event"] == "execution_error")
            .map(|l| {
                (
                    l["exec_id"].as_str().unwrap(),
                    l["instance"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            ends,
            [
                ("exec-a", "new-2"),
                ("exec-b", "new-2"),
                ("exec-c", "new-2")
            ]
        );
        assert_eq!(lines[3]["error_type"], "DaemonStopped");
        assert_eq!(
            lines[3]["error"],
            "the daemon (instance old-1) stopped during the run"
        );
        assert_eq!(lines[3]["idempotency_key"], "12:orchestrator:k");
        assert!(crate::provenance::audit::verify(&path).is_ok());
        assert!(
            metrics
                .render()
                .contains("executor_interrupted_runs_total 3"),
            "{}",
            metrics.render()
        );
        // The crashed runs' records are finished with that error (a run without a subject is
        // owned by "-").
        let record = store
            .execution_get(&IdemKey {
                subject: "-".into(),
                key: "exec-b".into(),
            })
            .await
            .unwrap()
            .expect("the interrupted run's record");
        let answer = record.response.expect("finished");
        assert!(answer.body.starts_with("DaemonStopped"), "{}", answer.body);
        // A run's record is found under its owner, the calling service, not the capability token's
        // subject.
        let owned = IdemKey {
            subject: "-".into(),
            key: "exec-c".into(),
        };
        let record = store.execution_get(&owned).await.unwrap();
        assert!(
            record
                .and_then(|r| r.response)
                .is_some_and(|a| a.body.starts_with("DaemonStopped"))
        );
        // The crashed daemon's key is free; another owner's claim is not touched.
        assert_eq!(
            store
                .idempotency_begin(&key("k"), "h", "new-2", lease)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        assert_eq!(
            store
                .idempotency_begin(&key("other"), "h", "new-2", lease)
                .await
                .unwrap(),
            IdemBegin::InProgress { same_body: true }
        );
        // Recorded once.
        drop(log);
        let log = AuditLog::open(&path, "new-3").unwrap();
        assert!(log.interrupted().is_empty());
    }
}
