//! The shell scripts a fresh machine runs: they carry no package mirror of their own, and say
//! what to set when the host's apt names none.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Hosts a script or the Dockerfile may name: loopback, and the upstream sources the project
/// pins by hash or version (the Rust toolchain installer, the advisory database, JSON Schema ids).
const ALLOWED_HOSTS: &[&str] = &[
    "127.0.0.1",
    "localhost",
    "static.rust-lang.org",
    "github.com",
    "json-schema.org",
];

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

#[test]
fn no_script_names_a_package_mirror_host() {
    let root = repo();
    let mut files = vec![root.join("Dockerfile")];
    for dir in ["scripts", "docker", ".ci", "helm"] {
        files_under(&root.join(dir), &mut files);
    }
    let mut found = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue; // not text
        };
        for (n, line) in text.lines().enumerate() {
            for scheme in ["http://", "https://"] {
                let mut rest = line;
                while let Some(i) = rest.find(scheme) {
                    let after = &rest[i + scheme.len()..];
                    let host: String = after
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || ".-".contains(*c))
                        .collect();
                    if !host.is_empty() && !ALLOWED_HOSTS.contains(&host.as_str()) {
                        found.push(format!("{}:{}: {host}", file.display(), n + 1));
                    }
                    rest = after;
                }
            }
        }
    }
    assert!(found.is_empty(), "host literals in scripts: {found:#?}");
}

fn debian_mirror(
    apt_dir: &Path,
    var: &str,
    value: Option<&str>,
    suite: &str,
) -> (bool, String, String) {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!(
            ". '{}'; debian_mirror {var} {suite}",
            repo().join("scripts/lib/apt-mirror.sh").display()
        ))
        .env("APT_ETC_DIR", apt_dir)
        .env_remove(var);
    if let Some(v) = value {
        cmd.env(var, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn with_no_apt_mirror_the_scripts_name_the_variable_to_set() {
    let apt = tempfile::tempdir().unwrap();
    std::fs::create_dir(apt.path().join("sources.list.d")).unwrap();
    let (ok, out, err) = debian_mirror(apt.path(), "DEBIAN_MIRROR", None, "bookworm");
    assert!(!ok, "succeeded with no mirror configured: {out}");
    assert!(out.is_empty(), "printed a mirror: {out}");
    assert!(err.contains("set DEBIAN_MIRROR"), "{err}");
}

#[test]
fn the_mirror_is_the_variable_else_the_hosts_apt_source_for_the_suite() {
    let apt = tempfile::tempdir().unwrap();
    let d = apt.path().join("sources.list.d");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(
        d.join("a.sources"),
        "Types: deb\nURIs: http://mirror.test/debian/\nSuites: bookworm bookworm-updates\n\
         Components: main\n\nTypes: deb\nURIs: http://security.test/debian-security\n\
         Suites: bookworm-security\nComponents: main\n",
    )
    .unwrap();
    std::fs::write(
        apt.path().join("sources.list"),
        "deb [arch=amd64] http://old.test/debian trixie main\n",
    )
    .unwrap();
    let m = |var, value, suite| debian_mirror(apt.path(), var, value, suite);
    assert_eq!(
        m("DEBIAN_MIRROR", None, "bookworm").1,
        "http://mirror.test/debian"
    );
    assert_eq!(
        m("DEBIAN_SECURITY_MIRROR", None, "bookworm-security").1,
        "http://security.test/debian-security"
    );
    assert_eq!(
        m("DEBIAN_MIRROR", None, "trixie").1,
        "http://old.test/debian"
    );
    assert_eq!(
        m("DEBIAN_MIRROR", Some("http://given.test/d/"), "bookworm").1,
        "http://given.test/d"
    );
}
