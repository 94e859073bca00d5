//! What a session's exec carries down to its run: where it runs ([`SessionPlace`]: a fresh
//! sandbox bound to the session's host workspace, or the session's kept sandbox), the limits the
//! session asked for, and how each of these shapes the plan and the [`RunSpec`].
//!
//! Owns: the generic "run in a given place" vocabulary the execution service needs for a
//! session's exec. Must not: know sessions themselves (their owners, lifetimes, workspaces):
//! the sessions module, above this layer, builds a [`SessionExec`] from a session and hands it
//! down.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::policy::language::Language;
use crate::sandbox::control::Controls;
use crate::sandbox::files::Kept;
use crate::sandbox::{ExecCode, RunSpec};

/// What an exec in a session adds to its request.
#[derive(Debug, Clone)]
pub struct SessionExec {
    pub session_id: String,
    /// The session's tenant ("" when it was made without one).
    pub tenant: String,
    pub language: Arc<Language>,
    /// Where the session's workspace is and how the exec's code gets there.
    pub place: SessionPlace,
    /// `sha256:<hex>` of the code.
    pub code_sha256: String,
    /// Where the code starts, inside [`WORKSPACE`].
    pub cwd: PathBuf,
    /// The session's limits, each no looser than its profile's (the tighter one applies).
    pub limits: SessionLimits,
    /// The exec's deadline to the millisecond (`timeout_ms`), within what the policy allows.
    pub timeout: Option<Duration>,
    /// A background process: it runs beside the session's other execs.
    pub background: Option<Background>,
    /// A foreground exec whose stdin stays open for these (`stdin_open`).
    pub stdin_controls: Option<Controls>,
    /// A terminal (a background process): the supervisor's `pty` mode runs the shell instead
    /// of the language's interpreter.
    pub terminal: Option<Terminal>,
}

/// What makes a session's background process its terminal.
#[derive(Debug, Clone)]
pub struct Terminal {
    /// The supervisor binary on the host, bound read-only into a local sandbox at
    /// [`TERMINAL_PROGRAM`] (containers have it there already).
    pub supervisor: PathBuf,
    /// What runs on the pseudo-terminal.
    pub command: TerminalCommand,
}

/// What a terminal runs on its pseudo-terminal, and how it starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TerminalCommand {
    /// A program and its arguments (a path, or a name the sandbox's `PATH` finds); none: the
    /// first of [`TERMINAL_SHELLS`] the sandbox has.
    pub argv: Option<Vec<String>>,
    /// The directory it starts in, any the sandbox's user may enter; none: the exec's cwd.
    pub cwd: Option<String>,
    /// Its first size, columns and rows (each 1..=4096); none: 80 by 24.
    pub size: Option<(u16, u16)>,
}

/// Where the terminal's program (the supervisor) is inside every sandbox.
pub const TERMINAL_PROGRAM: &str = crate::sandbox::docker::supervisor::CONTAINER_PATH;

/// The shells a terminal tries, in order: the first the sandbox has runs.
pub const TERMINAL_SHELLS: [&str; 2] = ["/bin/bash", "/bin/sh"];

/// The terminal's argv after its program: the supervisor's `pty` mode, its options, and the
/// shells or `--exec` and the command.
pub fn terminal_args(command: &TerminalCommand) -> Vec<String> {
    let mut args = vec!["pty".to_string()];
    if let Some((cols, rows)) = command.size {
        args.extend(["--cols".into(), cols.to_string()]);
        args.extend(["--rows".into(), rows.to_string()]);
    }
    if let Some(cwd) = &command.cwd {
        args.extend(["--cwd".into(), cwd.clone()]);
    }
    match &command.argv {
        Some(argv) => {
            args.push("--exec".into());
            args.extend(argv.iter().cloned());
        }
        None => args.extend(TERMINAL_SHELLS.map(String::from)),
    }
    args
}

/// What makes a session's exec a background process.
#[derive(Debug, Clone)]
pub struct Background {
    /// Its stdin stays open for these, and the caller may signal it.
    pub controls: Controls,
    /// Names its code file (ASCII letters and digits), unique among the session's processes.
    pub key: String,
    /// Its readers follow all of its output; the last this many bytes of each stream are kept
    /// for those that come late or resume (`sessions.process_output_ring_bytes`).
    pub ring_bytes: usize,
}

/// Where a session's exec runs.
#[derive(Debug, Clone)]
pub enum SessionPlace {
    /// Local: a fresh sandbox with the session's host `workspace` bound at [`WORKSPACE`] and the
    /// host `code_file` bound read-only at the language's code path.
    Host {
        workspace: PathBuf,
        code_file: PathBuf,
        /// The session's own host uid (see [`crate::sandbox::uids`]); None only while a
        /// session is being decided, before it has one.
        uid: Option<u32>,
    },
    /// Docker/gVisor: the session's kept sandbox, which writes `code` at the language's path.
    Kept {
        sandbox: Arc<dyn Kept>,
        code: Arc<[u8]>,
    },
}

/// Where a session's workspace appears inside its sandbox.
pub const WORKSPACE: &str = "/workspace";

/// Limits a session asked for at creation; None keeps the profile's.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    serde::Serialize,
    serde::Deserialize,
    PartialEq,
    utoipa::ToSchema,
    schemars::JsonSchema,
)]
#[serde(deny_unknown_fields)]
pub struct SessionLimits {
    pub cpus: Option<f64>,
    pub memory_mb: Option<u64>,
    pub disk_mb: Option<u64>,
    pub pids: Option<u64>,
    pub output_bytes: Option<usize>,
}

impl SessionLimits {
    /// Tightens `limits` to these (never loosens them).
    pub fn apply(&self, limits: &mut crate::sandbox::Limits) {
        if let Some(c) = self.cpus {
            limits.cpus = limits.cpus.min(c);
        }
        if let Some(m) = self.memory_mb {
            limits.memory_bytes = limits.memory_bytes.min(m << 20);
        }
        if let Some(d) = self.disk_mb {
            limits.disk_bytes = limits.disk_bytes.min(d << 20);
        }
        if let Some(p) = self.pids {
            limits.pids = limits.pids.min(p);
        }
        if let Some(o) = self.output_bytes {
            limits.output_bytes = limits.output_bytes.min(o);
        }
    }
}

impl SessionExec {
    /// Tightens a decided run's limits to the session's, and its deadline to the exec's own.
    pub(super) fn tighten(&self, limits: &mut crate::sandbox::Limits) {
        self.limits.apply(limits);
        if let Some(t) = self.timeout {
            limits.timeout = limits.timeout.min(t.max(Duration::from_millis(1)));
        }
    }

    /// Puts the run in the session's place: its workspace as workdir and home, the exec's cwd,
    /// and the code where the language's interpreter reads it. On the host, the session's runs
    /// form one group, held together by the session's limits.
    pub(super) fn shape(&self, spec: &mut RunSpec) {
        spec.fs.workdir = PathBuf::from(WORKSPACE);
        spec.fs.cwd = Some(self.cwd.clone());
        spec.env.insert("HOME".into(), WORKSPACE.into());
        if let Some(b) = &self.background {
            spec.controls = Some(b.controls.clone());
            spec.background = true;
        } else if let Some(c) = &self.stdin_controls {
            spec.controls = Some(c.clone());
        }
        if let Some(t) = &self.terminal {
            spec.argv = std::iter::once(TERMINAL_PROGRAM.to_string())
                .chain(terminal_args(&t.command))
                .collect();
            spec.fs.pty = true;
            match &self.place {
                SessionPlace::Host { workspace, uid, .. } => {
                    if let Some(uid) = uid {
                        spec.uid = *uid;
                    }
                    spec.group = Some(self.session_id.clone());
                    spec.fs.workspace = Some(workspace.clone());
                    spec.fs.extra_files =
                        vec![(t.supervisor.clone(), PathBuf::from(TERMINAL_PROGRAM))];
                }
                SessionPlace::Kept { sandbox, .. } => spec.kept = Some(sandbox.clone()),
            }
            return;
        }
        let code_path = self.code_path();
        match &self.place {
            // A fresh sandbox bound to the session's host workspace, the code bound in.
            SessionPlace::Host {
                workspace,
                code_file,
                uid,
            } => {
                if let Some(uid) = uid {
                    spec.uid = *uid;
                }
                spec.group = Some(self.session_id.clone());
                spec.fs.workspace = Some(workspace.clone());
                spec.fs.extra_files = vec![(code_file.clone(), code_path)];
            }
            // The session's own sandbox, which writes the code where the interpreter reads it.
            SessionPlace::Kept { sandbox, code } => {
                spec.kept = Some(sandbox.clone());
                spec.code = Some(ExecCode {
                    path: code_path,
                    bytes: code.clone(),
                });
            }
        }
    }

    /// Where the interpreter reads the exec's code: the language's file, or for a background
    /// process a file of its own beside it (a later exec writes the language's file while the
    /// process may still read its own, as bash does).
    pub fn code_path(&self) -> PathBuf {
        match &self.background {
            None => self.language.code_path(),
            Some(b) => self.language.code_path_for(&format!("bg-{}", b.key)),
        }
    }

    /// What the exec adds to the invocation hash (its `session` key).
    pub(super) fn decides(&self) -> Value {
        json!({
            "id": self.session_id,
            "code_sha256": self.code_sha256,
            "cwd": self.cwd,
        })
    }
}
