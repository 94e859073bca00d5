//! A finished run's receipt: the in-toto statement about it (its subjects and the
//! `urn:executor-arm:receipt:v1` predicate), signed into a DSSE envelope once its end line is in
//! the audit log.
//!
//! Owns: what a receipt says of a run, from the run's result, its plan's limits and its end
//! line. Must not: sign with anything but the key it is given, or store or serve receipts (the
//! run's record keeps it; the front ends serve it).

use crate::provenance::audit::Entry;
use crate::provenance::dsse::Envelope;
use crate::provenance::keys::SigningKey;
use crate::provenance::receipt::{
    AuditPosition, Receipt, RunLimits, RunResult, SUBJECT_CODE, SUBJECT_COMMAND, SUBJECT_STDERR,
    SUBJECT_STDOUT, Statement, Subject, What, When, Who, sign_receipt,
};
use crate::sandbox::{Limits, OnOverflow};

use super::result::ExecutionResult;

/// What a receipt needs beside the run's result.
pub struct Ran<'a> {
    pub result: &'a ExecutionResult,
    pub limits: &'a Limits,
    /// The session's tenant, for a session's exec.
    pub tenant: Option<&'a str>,
    /// The run's end line (its `ts` is when the run ended).
    pub entry: &'a Entry,
}

/// The statement about `ran`.
pub fn statement(ran: &Ran<'_>) -> Statement {
    let r = ran.result;
    let p = &r.provenance;
    let mut subject = vec![Subject::sha256(SUBJECT_COMMAND, &p.command_hash)];
    if let Some(code) = &p.code_sha256 {
        subject.push(Subject::sha256(SUBJECT_CODE, code));
    }
    subject.push(Subject::sha256(SUBJECT_STDOUT, &p.stdout_sha256));
    subject.push(Subject::sha256(SUBJECT_STDERR, &p.stderr_sha256));
    let l = ran.limits;
    Statement::new(
        subject,
        Receipt {
            who: Who {
                subject: p.subject.clone(),
                token_id: p.token_id.clone(),
                tenant: ran.tenant.map(str::to_string),
            },
            what: What {
                exec_id: r.exec_id.clone(),
                request_id: p.request_id.clone(),
                action_type: p.action_type.to_string(),
                command_hash: p.command_hash.clone(),
                invocation_hash: p.invocation_hash.clone(),
                profile: p.profile.clone(),
                backend: p.backend.to_string(),
                limits: RunLimits {
                    timeout_seconds: l.timeout.as_secs(),
                    cpus: l.cpus,
                    memory_bytes: l.memory_bytes,
                    disk_bytes: l.disk_bytes,
                    pids: l.pids,
                    output_bytes: l.output_bytes as u64,
                    on_overflow: match l.on_overflow {
                        OnOverflow::Truncate => "truncate",
                        OnOverflow::Kill => "kill",
                    }
                    .to_string(),
                    nofile: l.nofile,
                },
                session_id: p.session_id.clone(),
                executor_def_sha256: p.executor_def_sha256.clone(),
            },
            result: RunResult {
                outcome: r.outcome.to_string(),
                exit_code: r.exit_code,
                killed_reason: r.killed_reason.map(str::to_string),
                duration_ms: r.duration_ms,
                peak_memory_kib: r.peak_memory_kib,
                oom: r.oom,
                stdout_truncated: r.stdout_truncated,
                stderr_truncated: r.stderr_truncated,
                error_code: r.error_code.map(str::to_string),
                network: r.network.clone().unwrap_or_default(),
            },
            when: When {
                started_at: p.timestamp.clone(),
                ended_at: ran.entry.ts.clone(),
            },
            audit: AuditPosition {
                audit_seq: ran.entry.seq,
                entry_hash: ran.entry.entry_hash.clone(),
            },
        },
    )
}

/// `ran`'s receipt, signed with `key`.
pub fn sign(ran: &Ran<'_>, key: &SigningKey) -> Result<Envelope, serde_json::Error> {
    sign_receipt(&statement(ran), key)
}
