//! Session languages: the interpreters a session may run code with.
//!
//! A language is an allowlisted interpreter (a bare name found on the search path at startup,
//! never the daemon's PATH) plus the action type and capability an exec of it needs and the
//! profile its sessions run under by default. The code of an exec is a file the interpreter gets
//! as its only argument: no shell command line is ever built from it.

use std::path::PathBuf;

use crate::vocabulary::{ActionType, Capability};

/// Where an exec's code file appears inside the sandbox.
pub const CODE_DIR: &str = "/run/session";

#[derive(Debug, Clone)]
pub struct Language {
    pub name: String,
    /// The interpreter's bare name, as the allowlist and provenance name it.
    pub interpreter: String,
    /// Its resolved absolute path.
    pub path: PathBuf,
    pub action_type: ActionType,
    pub capability: Capability,
    pub profile: String,
    /// The code file's name.
    pub file: String,
}

impl Language {
    /// The code file's path inside the sandbox: the interpreter's only argument.
    pub fn code_path(&self) -> PathBuf {
        PathBuf::from(CODE_DIR).join(&self.file)
    }

    /// A code file of its own for one run, `<key>-<file>` beside [`Language::code_path`]
    /// (`key`: ASCII letters, digits and `-`).
    pub fn code_path_for(&self, key: &str) -> PathBuf {
        PathBuf::from(CODE_DIR).join(format!("{key}-{}", self.file))
    }
}
