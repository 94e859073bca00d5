//! The documentation names only commands the binary has: every `executor-arm <subcommand>` in
//! the README, docs/ and the Helm chart's README and notes is one `executor-arm --help` lists.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

/// The subcommands `executor-arm --help` lists.
fn subcommands() -> BTreeSet<String> {
    let out = std::process::Command::new(common::bin())
        .arg("--help")
        .output()
        .expect("run executor-arm --help");
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// `executor-arm <word>` where the text is a command: in backticks, or a line of a fenced code
/// block that starts with it (after an optional `$ ` or `sudo `).
fn mentioned(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let word = |rest: &str| -> Option<String> {
        let w: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '-')
            .collect();
        (!w.is_empty()).then_some(w)
    };
    for (i, _) in text.match_indices("`executor-arm ") {
        if let Some(w) = word(&text[i + "`executor-arm ".len()..]) {
            found.push(w);
        }
    }
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if !in_code {
            continue;
        }
        let l = line.trim_start();
        let l = l.strip_prefix("$ ").unwrap_or(l);
        let l = l.strip_prefix("sudo ").unwrap_or(l);
        if let Some(rest) = l.strip_prefix("executor-arm ")
            && let Some(w) = word(rest)
        {
            found.push(w);
        }
    }
    found
}

#[test]
fn every_documented_subcommand_exists() {
    let commands = subcommands();
    assert!(
        commands.contains("serve") && commands.contains("check-config"),
        "{commands:?}"
    );
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![repo.join("README.md")];
    for dir in ["docs", "helm/executor-arm", "helm/executor-arm/templates"] {
        for e in std::fs::read_dir(repo.join(dir)).expect(dir) {
            let p = e.expect("entry").path();
            if p.extension()
                .is_some_and(|x| x == "md" || x == "txt" || x == "tpl")
            {
                files.push(p);
            }
        }
    }
    let mut unknown = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read doc");
        for w in mentioned(&text) {
            if !commands.contains(&w) {
                unknown.push(format!("{}: executor-arm {w}", f.display()));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "documented subcommands the binary does not have: {unknown:#?}"
    );
}

#[test]
fn the_scanner_finds_commands_in_backticks_and_code_lines() {
    let text = "Run `executor-arm check` first.\nexecutor-arm runs things.\n```sh\n$ executor-arm audit verify f\nexecutor-arm's log\n```";
    assert_eq!(mentioned(text), ["check", "audit"]);
}
