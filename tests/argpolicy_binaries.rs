//! The argument policy's option tables against the real binaries (curl, wget, tar, nmap, git,
//! python3 of this machine, the ones the sandbox runs): each table holds what the binary's own
//! help lists, every spelling the policy refuses for a denied option is one the binary parses
//! as an option (never "unknown" or "ambiguous"), and for a sample of options every spelling
//! really has that option's effect (a config file read, a file written, a command run).
//!
//! No network: URLs are file:// or a closed port on 127.0.0.1. Each probe runs in a temporary
//! directory of its own.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use executor_arm::policy::argpolicy::grammar::{Arity, Grammar};
use executor_arm::policy::argpolicy::{check, denied_spellings, grammar};

const PLACEHOLDER: &str = "\u{1}VALUE\u{1}";

/// The binary, or a failure saying it is missing (`scripts/test-all.sh` installs them).
fn require(tool: &str) -> PathBuf {
    ["/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{tool} is not installed; scripts/test-all.sh installs it"))
}

fn run(dir: &Path, program: &Path, args: &[String]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", dir)
        .env("LC_ALL", "C")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()))
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn script(dir: &Path, name: &str, body: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).expect("script");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    p.display().to_string()
}

/// Every spelling of every denied option of `cmd`, with `value_of(option)` for its value.
fn spellings_with(cmd: &str, value_of: impl Fn(&str) -> String) -> Vec<(String, Vec<Vec<String>>)> {
    denied_spellings(cmd, PLACEHOLDER)
        .into_iter()
        .map(|(opt, all)| {
            let v = value_of(&opt);
            let all = all
                .into_iter()
                .map(|s| s.into_iter().map(|a| a.replace(PLACEHOLDER, &v)).collect())
                .collect();
            (opt, all)
        })
        .collect()
}

/// Stands for the value in spellings made for the effect probes.
const V: &str = "{{V}}";

fn with_value(spelling: &[String], value: &str) -> Vec<String> {
    spelling.iter().map(|a| a.replace(V, value)).collect()
}

/// The spellings of one denied option.
fn spellings_of(cmd: &str, option: &str, value: &str) -> Vec<Vec<String>> {
    spellings_with(cmd, |_| value.to_string())
        .into_iter()
        .find(|(o, _)| o == option)
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("{cmd}: {option} is not denied"))
}

/// `(short, long names, arity)` of each option line of a GNU-style `--help`.
fn help_options(help: &str) -> Vec<(Option<char>, Vec<String>, Arity)> {
    let mut out = Vec::new();
    for line in help.lines() {
        let mut rest = line.trim_start();
        // Option lines are indented a little; deeper lines continue a description.
        let indent = line.len() - rest.len();
        if !rest.starts_with('-') || !(1..=8).contains(&indent) {
            continue;
        }
        let mut short = None;
        let b = rest.as_bytes();
        if b.len() >= 3 && b[0] == b'-' && b[1] != b'-' && b[2] == b',' {
            short = rest[1..].chars().next();
            rest = rest[3..].trim_start();
        } else if b.len() >= 2 && b[1] != b'-' && (b.len() == 2 || b[2] == b' ') {
            out.push((rest[1..].chars().next(), Vec::new(), Arity::None));
            continue;
        }
        let mut names = Vec::new();
        let mut arity = Arity::None;
        while let Some(body) = rest.strip_prefix("--") {
            let end = body.find([' ', ',']).unwrap_or(body.len());
            let word = &body[..end];
            let (name, a) = if let Some(i) = word.find("[=") {
                (&word[..i], Arity::Optional)
            } else if let Some(i) = word.find('=') {
                (&word[..i], Arity::Required)
            } else {
                (word, Arity::None)
            };
            names.push(name.to_string());
            if a != Arity::None {
                arity = a;
            }
            let after = &body[end..];
            // curl: `--name <arg>` or `--name [proto://]host`, one space after the name.
            if after.starts_with(" <") || after.starts_with(" [") {
                arity = Arity::Required;
            }
            rest = after.trim_start_matches(',').trim_start();
        }
        if !names.is_empty() {
            out.push((short, names, arity));
        }
    }
    out
}

fn find<'g>(
    g: &'g Grammar,
    name: &str,
) -> Option<&'g executor_arm::policy::argpolicy::grammar::Opt> {
    g.opts
        .iter()
        .find(|o| o.long == name || o.aliases.contains(&name))
}

#[test]
fn curl_table_is_curl_help_all() {
    let curl = require("curl");
    let dir = tempfile::tempdir().expect("tempdir");
    let help = run(dir.path(), &curl, &["--help".into(), "all".into()]);
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let g = grammar("curl").expect("curl table");
    let listed = help_options(&help);
    assert!(listed.len() > 200, "{help}");
    for (short, names, arity) in listed {
        let name = &names[0];
        let (opt, negated) = match find(g, name) {
            Some(o) => (o, false),
            None => (
                name.strip_prefix("no-")
                    .and_then(|n| find(g, n))
                    .filter(|o| o.negatable)
                    .unwrap_or_else(|| panic!("curl --{name} is not in the table ({})", g.tool)),
                true,
            ),
        };
        assert_eq!(opt.short, short, "curl --{name}");
        // `--help <category>`: curl peeks at the next argument and stops parsing.
        if !negated && name != "help" {
            assert_eq!(opt.arity, arity, "curl --{name}");
        }
    }
}

#[test]
fn wget_table_is_wget_help() {
    let wget = require("wget");
    let dir = tempfile::tempdir().expect("tempdir");
    let help = run(dir.path(), &wget, &["--help".into()]);
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let g = grammar("wget").expect("wget table");
    let listed = help_options(&help);
    assert!(listed.len() > 140, "{help}");
    for (short, names, arity) in listed {
        let Some(name) = names.first() else { continue };
        let opt = find(g, name)
            .or_else(|| {
                name.strip_prefix("no-")
                    .and_then(|n| find(g, n))
                    .filter(|o| o.negatable)
            })
            .unwrap_or_else(|| panic!("wget --{name} is not in the table ({})", g.tool));
        if short.is_some() {
            assert_eq!(opt.short, short, "wget --{name}");
        }
        // wget's help shows `=VALUE` for every option with a value (booleans never).
        if arity != Arity::None {
            assert!(opt.arity != Arity::None, "wget --{name} takes a value");
        }
    }
}

#[test]
fn tar_table_is_tar_help() {
    let tar = require("tar");
    let dir = tempfile::tempdir().expect("tempdir");
    let help = run(dir.path(), &tar, &["--help".into()]);
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let g = grammar("tar").expect("tar table");
    let mut seen = 0;
    for (short, names, arity) in help_options(&help) {
        let opt = match (names.first(), short) {
            (Some(n), _) => find(g, n),
            (None, Some(c)) => g.short(c),
            (None, None) => None,
        }
        .unwrap_or_else(|| panic!("tar {short:?} {names:?} is not in the table ({})", g.tool));
        seen += 1;
        assert_eq!(opt.short, short, "tar {names:?}");
        for n in &names {
            assert!(
                opt.long == n || opt.aliases.contains(&n.as_str()),
                "tar {names:?}"
            );
        }
        assert_eq!(
            opt.aliases.len() + usize::from(!opt.long.is_empty()),
            names.len(),
            "tar {names:?}"
        );
        assert_eq!(opt.arity, arity, "tar {names:?}");
    }
    assert!(
        seen >= g.opts.len(),
        "tar --help lists {seen} options, the table {}",
        g.opts.len()
    );
}

/// Every spelling the policy refuses for a denied option is refused, and the real binary
/// parses it as an option: each run ends in the tool's `--version`, which it reaches only if it
/// recognised everything before it (or it stops earlier with a complaint about that option's
/// use). curl and wget take all spellings of one option in one run; tar and nmap (which
/// refuse repeated options) one run per spelling.
#[test]
fn every_denied_spelling_is_an_option_to_the_real_binary() {
    type Probe = (&'static str, &'static str, fn(&str) -> String, bool);
    let probes: [Probe; 4] = [
        ("curl", "--version", curl_value, true),
        ("wget", "--version", wget_value, true),
        ("tar", "--version", tar_value, false),
        ("nmap", "-V", nmap_value, false),
    ];
    std::thread::scope(|s| {
        for (tool, version, value_of, batch) in probes {
            s.spawn(move || {
                let bin = require(tool);
                let dir = tempfile::tempdir().expect("tempdir");
                std::fs::write(dir.path().join("empty"), "").expect("empty");
                for (option, spellings) in spellings_with(tool, value_of) {
                    for s in &spellings {
                        assert!(check(tool, s).is_some(), "{tool} {s:?} is not refused");
                    }
                    // tar's old-style keys only count as the first argument.
                    let runs: Vec<Vec<String>> = if batch {
                        vec![spellings.concat()]
                    } else {
                        spellings
                    };
                    for mut argv in runs {
                        if tool == "curl" {
                            argv.insert(0, "-q".into());
                        }
                        argv.push(version.to_string());
                        let out = run(dir.path(), &bin, &argv);
                        let all = text(&out);
                        for bad in [
                            "is unknown",
                            "ambiguous",
                            "requires parameter",
                            "isn't a boolean",
                            "unrecognized option",
                            "invalid option",
                        ] {
                            assert!(!all.contains(bad), "{tool} {argv:?} ({option}):\n{all}");
                        }
                        let complaint = [
                            "Cannot use --resume with other options",
                            "HTML output is not directly supported",
                        ];
                        let recognised = (out.status.success()
                            && String::from_utf8_lossy(&out.stdout)
                                .to_lowercase()
                                .contains("version"))
                            || String::from_utf8_lossy(&out.stdout).starts_with("curl 7.")
                            || complaint.iter().any(|c| all.contains(c));
                        assert!(recognised, "{tool} {argv:?} ({option}):\n{all}");
                    }
                }
            });
        }
    });
}

fn curl_value(option: &str) -> String {
    match option {
        "--proto" | "--proto-redir" => "=https".into(),
        "--proto-default" => "https".into(),
        _ => "/dev/null".into(),
    }
}

fn wget_value(option: &str) -> String {
    match option {
        "--execute" => "tries=1".into(),
        // An empty regular file (wget refuses to read /dev/null as its config).
        "--config" => "empty".into(),
        "--use-askpass" => "/bin/true".into(),
        "--directory-prefix" => "d".into(),
        // Booleans: the attached value.
        "--recursive" | "--mirror" | "--force-directories" => "on".into(),
        _ => "/dev/null".into(),
    }
}

fn nmap_value(option: &str) -> String {
    match option {
        "--script-timeout" => "10s".into(),
        _ => "/dev/null".into(),
    }
}

fn tar_value(option: &str) -> String {
    match option {
        "--checkpoint-action" => "dot".into(),
        "--tape-length" => "10".into(),
        _ => "true".into(),
    }
}

/// Each spelling the policy refuses for a sample of denied options has that option's effect on
/// the real binary.
#[test]
fn sampled_denied_spellings_have_the_options_effect() {
    std::thread::scope(|s| {
        for (name, f) in [
            ("curl", curl_effects as fn()),
            ("wget", wget_effects),
            ("tar", tar_effects),
            ("nmap", nmap_effects),
            ("git", git_effects),
            ("python", python_effects),
        ] {
            std::thread::Builder::new()
                .name(format!("{name}-effects"))
                .spawn_scoped(s, f)
                .expect("thread");
        }
    });
}

fn curl_effects() {
    let curl = require("curl");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("data"), "data\n").expect("data");
    std::fs::write(d.join("cfg"), "write-out = \"PROBE-CONFIG\\n\"\n").expect("cfg");
    let url = format!("file://{}/data", d.display());
    let cfg = d.join("cfg").display().to_string();
    for s in spellings_of("curl", "--config", &cfg) {
        let mut argv = vec!["-q".to_string(), "-s".into()];
        argv.extend(s.clone());
        argv.push(url.clone());
        let out = run(d, &curl, &argv);
        assert!(
            text(&out).contains("PROBE-CONFIG"),
            "curl {argv:?}:\n{}",
            text(&out)
        );
    }
    for (i, s) in spellings_of("curl", "--output", V).into_iter().enumerate() {
        let target = d.join(format!("out{i}"));
        let s = with_value(&s, &target.display().to_string());
        let mut argv = vec!["-q".to_string()];
        argv.extend(s.clone());
        argv.push(url.clone());
        let out = run(d, &curl, &argv);
        assert!(target.exists(), "curl {argv:?}:\n{}", text(&out));
    }
    let src = d.join("data").display().to_string();
    for (i, s) in spellings_of("curl", "--upload-file", &src)
        .into_iter()
        .enumerate()
    {
        let mut argv = vec!["-q".to_string()];
        argv.extend(s.clone());
        let target = d.join(format!("up{i}"));
        argv.push(format!("file://{}", target.display()));
        let out = run(d, &curl, &argv);
        assert!(target.exists(), "curl {argv:?}:\n{}", text(&out));
    }
    // `--no-remote-name` is refused too but turns the option off: no effect to look for.
    let on = |s: &Vec<String>| !s[0].to_ascii_lowercase().starts_with("--no-");
    for (i, s) in spellings_of("curl", "--remote-name", "")
        .into_iter()
        .filter(on)
        .enumerate()
    {
        let cwd = d.join(format!("rn{i}"));
        std::fs::create_dir(&cwd).expect("dir");
        let mut argv = vec!["-q".to_string()];
        argv.extend(s.into_iter().filter(|a| !a.is_empty()));
        argv.push(url.clone());
        let out = run(&cwd, &curl, &argv);
        assert!(cwd.join("data").exists(), "curl {argv:?}:\n{}", text(&out));
    }
}

fn wget_effects() {
    let wget = require("wget");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // A closed port on loopback: wget fails to connect after acting on its options.
    let url = "http://127.0.0.1:9/".to_string();
    for (i, s) in spellings_of("wget", "--use-askpass", V)
        .into_iter()
        .enumerate()
    {
        let marker = d.join(format!("askpass{i}"));
        let ask = script(
            d,
            &format!("ask{i}.sh"),
            &format!("touch {}\necho x", marker.display()),
        );
        let mut argv = vec!["-q".to_string(), "--tries=1".into()];
        argv.extend(with_value(&s, &ask));
        argv.push(url.clone());
        let out = run(d, &wget, &argv);
        assert!(marker.exists(), "wget {argv:?}:\n{}", text(&out));
    }
    for (option, what) in [
        ("--output-document", "doc"),
        ("--output-file", "log"),
        ("--append-output", "alog"),
    ] {
        for (i, s) in spellings_of("wget", option, V).into_iter().enumerate() {
            let target = d.join(format!("{what}{i}"));
            let mut argv = vec!["--tries=1".to_string()];
            argv.extend(with_value(&s, &target.display().to_string()));
            argv.push(url.clone());
            let out = run(d, &wget, &argv);
            assert!(target.exists(), "wget {argv:?}:\n{}", text(&out));
        }
    }
    for (i, s) in spellings_of("wget", "--execute", V).into_iter().enumerate() {
        let target = d.join(format!("elog{i}"));
        let mut argv = vec!["--tries=1".to_string()];
        argv.extend(with_value(&s, &format!("logfile={}", target.display())));
        argv.push(url.clone());
        let out = run(d, &wget, &argv);
        assert!(target.exists(), "wget {argv:?}:\n{}", text(&out));
    }
}

/// `spelling` with its mode key (`-t`/`t` of the bundles, or none) turned into `mode`.
fn tar_mode(spelling: Vec<String>, mode: char) -> Vec<String> {
    let mut argv = spelling;
    let first = &argv[0];
    if let Some(rest) = first.strip_prefix("-t") {
        argv[0] = format!("-{mode}{rest}");
    } else if let Some(rest) = first.strip_prefix('t') {
        argv[0] = format!("{mode}{rest}");
    } else if first.starts_with('-') {
        argv.insert(0, format!("-{mode}"));
    } else {
        argv[0] = format!("{mode}{first}");
    }
    argv
}

fn tar_effects() {
    let tar = require("tar");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("f"), vec![7u8; 30_000]).expect("f");
    let status = run(d, &tar, &["-cf".into(), "base.tar".into(), "f".into()]);
    assert!(status.status.success(), "{}", text(&status));
    let marker = |name: &str, i: usize| d.join(format!("{name}{i}"));
    for (i, s) in spellings_of("tar", "--checkpoint-action", V)
        .into_iter()
        .enumerate()
    {
        let m = marker("cp", i);
        let mut argv = tar_mode(with_value(&s, &format!("exec=touch {}", m.display())), 'c');
        argv.extend([
            format!("--file=a{i}.tar"),
            "--checkpoint=1".into(),
            "f".into(),
        ]);
        let out = run(d, &tar, &argv);
        assert!(m.exists(), "tar {argv:?}:\n{}", text(&out));
    }
    for (i, s) in spellings_of("tar", "--to-command", V)
        .into_iter()
        .enumerate()
    {
        let m = marker("tc", i);
        let mut argv = tar_mode(with_value(&s, &format!("touch {}", m.display())), 'x');
        argv.extend(["--file=base.tar".into()]);
        let out = run(d, &tar, &argv);
        assert!(m.exists(), "tar {argv:?}:\n{}", text(&out));
    }
    for (option, key) in [("--use-compress-program", "uc"), ("--info-script", "is")] {
        for (i, s) in spellings_of("tar", option, V).into_iter().enumerate() {
            let m = marker(key, i);
            let prog = script(
                d,
                &format!("{key}{i}.sh"),
                &format!("touch {}\nexec cat", m.display()),
            );
            let mut argv = tar_mode(with_value(&s, &prog), 'c');
            if option == "--info-script" {
                // Three volumes of 10 KiB: the script runs at each change.
                argv.extend(["--multi-volume".into(), "--tape-length=10".into()]);
            }
            argv.extend([format!("--file={key}{i}.tar"), "f".into()]);
            let out = run(d, &tar, &argv);
            assert!(m.exists(), "tar {argv:?}:\n{}", text(&out));
        }
    }
}

fn nmap_effects() {
    let nmap = require("nmap");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("targets"), "10.9.8.7\n").expect("targets");
    // A list scan without DNS sends nothing.
    for option in ["--iL", "-i"] {
        for s in spellings_of("nmap", option, "targets") {
            let mut argv = vec!["-sL".to_string(), "-n".into()];
            argv.extend(s.clone());
            let out = run(d, &nmap, &argv);
            assert!(
                text(&out).contains("Nmap scan report for 10.9.8.7"),
                "nmap {argv:?}:\n{}",
                text(&out)
            );
        }
    }
    for option in ["--oN", "--oX", "-o"] {
        for (i, s) in spellings_of("nmap", option, V).into_iter().enumerate() {
            let target = d.join(format!("{}{i}", option.trim_start_matches('-')));
            let mut argv = vec!["-sL".to_string(), "-n".into()];
            argv.extend(with_value(&s, &target.display().to_string()));
            argv.push("10.9.8.7".into());
            let out = run(d, &nmap, &argv);
            assert!(target.exists(), "nmap {argv:?}:\n{}", text(&out));
        }
    }
}

fn git(dir: &Path, args: &[&str]) -> Output {
    let mut argv: Vec<String> = vec![
        "-c".into(),
        "user.name=t".into(),
        "-c".into(),
        "user.email=t@t".into(),
    ];
    argv.extend(args.iter().map(|s| s.to_string()));
    let out = run(dir, &require("git"), &argv);
    assert!(out.status.success(), "git {args:?}:\n{}", text(&out));
    out
}

/// A refused git spelling either has the option's effect or is one git itself rejects as an
/// ambiguous or unknown option; at least the full name and one abbreviation take effect.
fn git_effects() {
    let bin = require("git");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    git(d, &["init", "-q", "repo"]);
    std::fs::write(d.join("repo/f"), "needle\n").expect("f");
    git(d, &["-C", "repo", "add", "f"]);
    git(d, &["-C", "repo", "commit", "-q", "-m", "x"]);
    std::fs::create_dir_all(d.join("tmpl")).expect("tmpl");
    std::fs::write(d.join("tmpl/probe-template"), "x").expect("tmpl file");
    let repo = d.join("repo").display().to_string();
    let tmpl = d.join("tmpl").display().to_string();
    let mut n = 0;
    let cases: Vec<(&str, String)> = vec![
        ("git ls-remote --upload-pack", V.into()),
        ("git ls-remote --exec", V.into()),
        ("git clone --upload-pack", V.into()),
        ("git clone -u", V.into()),
        ("git fetch --upload-pack", V.into()),
        ("git archive --exec", V.into()),
        ("git grep --open-files-in-pager", V.into()),
        ("git grep -O", V.into()),
        ("git clone --template", tmpl.clone()),
        ("git init --template", tmpl.clone()),
        ("git clone --config", "probe.key=1".into()),
        ("git clone -c", "probe.key=1".into()),
    ];
    for (option, value) in cases {
        let mut effects = 0;
        // grep's -O/--open-files-in-pager takes its value attached only.
        let attached = |s: &Vec<String>| !option.starts_with("git grep") || s.len() == 2;
        for s in spellings_of("git", option, &value)
            .into_iter()
            .filter(attached)
        {
            n += 1;
            let work = d.join(format!("w{n}"));
            std::fs::create_dir(&work).expect("work");
            let marker = work.join("ran");
            let cmd = script(
                &work,
                "cmd.sh",
                &format!("touch {}\nexit 1", marker.display()),
            );
            let mut argv = with_value(&s, &cmd);
            let sub = argv[0].clone();
            match sub.as_str() {
                "ls-remote" => argv.push(repo.clone()),
                "clone" => argv.extend([repo.clone(), "dst".into()]),
                "init" => argv.push("dst".into()),
                "fetch" => argv.insert(1, repo.clone()),
                "archive" => {
                    argv.insert(1, format!("--remote={repo}"));
                    argv.push("HEAD".into());
                }
                "grep" => {
                    argv.insert(0, repo.clone());
                    argv.insert(0, "-C".into());
                    argv.push("needle".into());
                }
                other => panic!("{other}"),
            }
            if sub == "fetch" {
                // fetch runs in a repository.
                git(&work, &["init", "-q", "."]);
            }
            let out = run(&work, &bin, &argv);
            let all = text(&out);
            let took_effect = marker.exists()
                || work.join("dst/.git/probe-template").exists()
                || std::fs::read_to_string(work.join("dst/.git/config"))
                    .is_ok_and(|c| c.contains("[probe]"));
            // git archive passes options it does not know (abbreviations) to the archiver,
            // which reads `--e` as `--exec` and then refuses it without `--remote`.
            let rejected = all.contains("ambiguous option")
                || all.contains("unknown option")
                || all.contains("unknown switch")
                || all.contains("the option '--exec' requires '--remote'");
            assert!(took_effect || rejected, "git {argv:?} ({option}):\n{all}");
            assert!(check("git", &s).is_some(), "{s:?}");
            effects += usize::from(took_effect);
        }
        // A long option: at least its full name and one abbreviation.
        let least = if option.contains(" --") { 2 } else { 1 };
        assert!(
            effects >= least,
            "{option}: only {effects} spellings took effect"
        );
    }
    // Global options are exact: git rejects abbreviations of them.
    for argv in [
        ["--exec-pat=/tmp", "version"],
        ["--config-e=a=b", "version"],
        ["-cx=y", "version"],
    ] {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let out = run(d, &bin, &argv);
        assert!(
            text(&out).contains("unknown option"),
            "git {argv:?}:\n{}",
            text(&out)
        );
    }
}

/// python3 runs the module each refused spelling names. Probed with stdlib modules in place of
/// pip (the same parse; pip need not be installed): `this` for `pip`/`ensurepip`, `json.tool`
/// for the dotted `pip.__main__`.
fn python_effects() {
    let python = require("python3");
    let dir = tempfile::tempdir().expect("tempdir");
    let probe = |a: &String| {
        for (module, stand_in) in [
            ("pip.__main__", "json.tool"),
            ("ensurepip", "this"),
            ("pip", "this"),
        ] {
            if let Some(head) = a.strip_suffix(module) {
                return format!("{head}{stand_in}");
            }
        }
        a.clone()
    };
    for (_, spellings) in denied_spellings("python3", "x") {
        for argv in spellings {
            assert!(check("python3", &argv).is_some(), "{argv:?}");
            let mut argv: Vec<String> = argv.iter().map(probe).collect();
            argv.push("--help".into());
            let out = run(dir.path(), &python, &argv);
            let all = text(&out);
            assert!(
                all.contains("Zen of Python") || all.contains("json.tool"),
                "python3 {argv:?}:\n{all}"
            );
        }
    }
}
