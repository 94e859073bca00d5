//! The words requests, tokens and config share: action types, capabilities, and what a command
//! name may look like. Owns only these definitions, so every layer can use them (config sits
//! below policy and must not depend on it). Must not: decide anything.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ActionType {
    Shell,
    Http,
    Python,
    External,
}

impl ActionType {
    pub fn as_str(self) -> &'static str {
        match self {
            ActionType::Shell => "shell",
            ActionType::Http => "http",
            ActionType::Python => "python",
            ActionType::External => "external",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "shell" => Some(ActionType::Shell),
            "http" => Some(ActionType::Http),
            "python" => Some(ActionType::Python),
            "external" => Some(ActionType::External),
            _ => None,
        }
    }
}

/// The capability vocabulary (seed + ours).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
pub enum Capability {
    ShellRead,
    ShellExecute,
    FilesystemRead,
    FilesystemWrite,
    NetworkAccess,
    HttpRequest,
    PythonExecute,
    ExternalExecute,
}

impl Capability {
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::ShellRead => "ShellRead",
            Capability::ShellExecute => "ShellExecute",
            Capability::FilesystemRead => "FilesystemRead",
            Capability::FilesystemWrite => "FilesystemWrite",
            Capability::NetworkAccess => "NetworkAccess",
            Capability::HttpRequest => "HttpRequest",
            Capability::PythonExecute => "PythonExecute",
            Capability::ExternalExecute => "ExternalExecute",
        }
    }
}

/// A bare command name: ASCII letters, digits, `._+-`, not starting with `.` or `-`, ≤ 64 bytes.
/// Paths, shell metacharacters, whitespace, NUL and look-alike Unicode all fail.
pub fn is_bare_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'+' | b'-'))
}
