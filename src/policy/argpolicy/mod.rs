//! Per-command argument policies: the options that turn a read-only tool into a writer, an
//! executor or a file reader.
//!
//! Owns: judging an argv by what the tool's own parser makes of it. curl, wget, tar and nmap
//! have option tables taken from their binaries (see each module); the argv is normalised to
//! canonical options first — unique prefixes, `--opt=value`, separate and attached values,
//! bundles, tar's old-style keys, `--` — and an argument the table cannot resolve exactly
//! (unknown, ambiguous) is refused. git and python3 have parsers of their own here. Other
//! commands are judged by spelling rules (`plain_refusal`). Must not: run anything.
//!
//! The allowlist entry's `deny_args` add options: for a command with a table each is resolved
//! to the option it names (at startup; an unknown one stops startup), otherwise it is a
//! spelling. `deny_prefixes` refuse any argument starting with one (case-insensitive).

mod curl;
mod git;
pub mod grammar;
mod nmap;
mod python;
mod tar;
mod wget;

use self::grammar::{Grammar, Item};

/// A tool with an option table: the options it refuses (canonical `--long` or `-s`) and the
/// rules for values and operands.
pub struct Tool {
    pub grammar: &'static Grammar,
    pub denied: &'static [&'static str],
    pub judge: fn(&[Item<'_>]) -> Option<String>,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The table is long; its source names it.
        f.debug_struct("Tool")
            .field("grammar", &self.grammar.tool)
            .field("denied", &self.denied)
            .finish()
    }
}

fn no_extra_rule(_: &[Item<'_>]) -> Option<String> {
    None
}

fn file_read_refusal(option: &str, value: &str) -> String {
    format!("--{option} '{value}' would read a local file")
}

#[derive(Debug, Clone, Copy)]
enum Parser {
    Table(&'static Tool),
    Git,
    Python,
    /// Spelling rules only.
    Plain,
}

/// Rules for one command.
#[derive(Debug, Clone)]
pub struct ArgPolicy {
    parser: Parser,
    /// Canonical options refused on top of the tool's own (from `deny_args`).
    denied: Vec<String>,
    /// Refused spellings (commands without a table), see [`plain_refusal`].
    spellings: Vec<String>,
    /// Refused when an argument starts with one (case-insensitive).
    prefixes: Vec<String>,
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// The built-in policy for `command` (no rules for commands without known dangerous options).
pub fn builtin(command: &str) -> ArgPolicy {
    let (parser, spellings): (Parser, &[&str]) = match command {
        "curl" => (Parser::Table(&curl::TOOL), &[]),
        "wget" => (Parser::Table(&wget::TOOL), &[]),
        "tar" => (Parser::Table(&tar::TOOL), &[]),
        "nmap" => (Parser::Table(&nmap::TOOL), &[]),
        "git" => (Parser::Git, &[]),
        "python3" | "python" => (Parser::Python, &[]),
        // find's predicates are whole words; it has no abbreviations.
        "find" => (
            Parser::Plain,
            &[
                "-exec",
                "-execdir",
                "-ok",
                "-okdir",
                "-delete",
                "-fprint",
                "-fprint0",
                "-fprintf",
                "-fls",
                // Reads its starting points from a file (or stdin) and echoes them in errors.
                "-files0-from",
            ],
        ),
        "grep" | "egrep" | "fgrep" => (Parser::Plain, &["--pre", "--pre-glob"]),
        "rg" => (
            Parser::Plain,
            &["--pre", "--pre-glob", "-z", "--search-zip"],
        ),
        _ => (Parser::Plain, &[]),
    };
    ArgPolicy {
        parser,
        denied: Vec::new(),
        spellings: strings(spellings),
        prefixes: Vec::new(),
    }
}

/// `Some(reason)` when the built-in policy of `command` refuses `args`. A pure entry point
/// (e.g. for fuzzing: a denied option is refused in every spelling [`denied_spellings`] lists).
pub fn check(command: &str, args: &[String]) -> Option<String> {
    builtin(command).check(args)
}

impl ArgPolicy {
    /// The built-in policy of `command` plus an allowlist entry's `deny_args` and
    /// `deny_prefixes`; `Err` names a `deny_args` entry the command's table does not know.
    pub fn for_command(
        command: &str,
        deny_args: &[String],
        deny_prefixes: &[String],
    ) -> Result<ArgPolicy, String> {
        let mut p = builtin(command);
        for a in deny_args {
            match p.parser {
                Parser::Table(t) => {
                    let opt = t
                        .grammar
                        .resolve_spelling(a)
                        .map_err(|e| format!("deny_args: {}: {e}", t.grammar.tool))?;
                    p.denied.push(opt.canonical());
                }
                Parser::Git | Parser::Python | Parser::Plain => p.spellings.push(a.clone()),
            }
        }
        p.prefixes.extend(deny_prefixes.iter().cloned());
        Ok(p)
    }

    /// `Some(reason)` for the first refused argument.
    pub fn check(&self, args: &[String]) -> Option<String> {
        for arg in args {
            let lower = arg.to_ascii_lowercase();
            if let Some(p) = self
                .prefixes
                .iter()
                .find(|p| lower.starts_with(&p.to_ascii_lowercase()))
            {
                return Some(format!(
                    "argument '{arg}' is refused by the argument policy (prefix '{p}')"
                ));
            }
        }
        match self.parser {
            Parser::Table(t) => self.table_refusal(t, args),
            Parser::Git => plain_refusal(&self.spellings, args).or_else(|| git::check(args)),
            Parser::Python => plain_refusal(&self.spellings, args).or_else(|| python::check(args)),
            Parser::Plain => plain_refusal(&self.spellings, args),
        }
    }

    fn is_denied(&self, t: &Tool, canonical: &str) -> bool {
        t.denied.contains(&canonical) || self.denied.iter().any(|d| d == canonical)
    }

    fn table_refusal(&self, t: &Tool, args: &[String]) -> Option<String> {
        let tool = t.grammar.tool;
        let items = match t.grammar.parse(args) {
            Ok(items) => items,
            Err(e) => {
                return Some(format!(
                    "{tool}: argument {e}; the argument policy refuses what it cannot resolve"
                ));
            }
        };
        for item in &items {
            let Item::Opt(p) = item else { continue };
            let canonical = p.opt.canonical();
            if self.is_denied(t, &canonical) {
                return Some(if p.spelled == canonical {
                    format!("argument '{canonical}' is refused by the argument policy")
                } else {
                    format!(
                        "argument '{}' is {tool}'s {canonical}, refused by the argument policy",
                        p.spelled
                    )
                });
            }
            // A separate value that would itself be a refused option: were the table wrong
            // about this option taking a value, the tool would read it as that option.
            if let Some(v) = p
                .value
                .filter(|v| p.separate && v.len() > 1 && v.starts_with('-'))
                && let Ok(inner) = t.grammar.parse(&[v.to_string(), "x".to_string()])
                && inner
                    .iter()
                    .any(|i| matches!(i, Item::Opt(q) if self.is_denied(t, &q.opt.canonical())))
            {
                return Some(format!(
                    "argument '{v}' (the value of {canonical}) spells an option the argument policy refuses"
                ));
            }
        }
        (t.judge)(&items)
    }
}

/// Rules for commands without a table, fail-closed for getopt-style tools: a refused
/// `--long` refuses every prefix of it (getopt accepts unique abbreviations) with or without
/// `=value`; a refused `-x` refuses every bundle containing `x`; any other spelling (find's
/// `-exec`) is refused as written or with `=value`.
fn plain_refusal(spellings: &[String], args: &[String]) -> Option<String> {
    for arg in args {
        for s in spellings {
            let hit = if let Some(long) = s.strip_prefix("--").filter(|l| !l.is_empty()) {
                arg.strip_prefix("--")
                    .map(|b| b.split_once('=').map_or(b, |(n, _)| n))
                    .is_some_and(|name| !name.is_empty() && long.starts_with(name))
            } else if let Some(letter) = single_letter(s) {
                arg.len() > 1
                    && arg.starts_with('-')
                    && !arg.starts_with("--")
                    && arg[1..].contains(letter)
            } else {
                arg == s
                    || arg
                        .strip_prefix(s.as_str())
                        .is_some_and(|r| r.starts_with('='))
            };
            if hit {
                return Some(if arg == s {
                    format!("argument '{arg}' is refused by the argument policy")
                } else {
                    format!("argument '{arg}' may be read as '{s}', refused by the argument policy")
                });
            }
        }
    }
    None
}

/// `x` for `-x`.
fn single_letter(s: &str) -> Option<char> {
    let mut chars = s.strip_prefix('-')?.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) if c != '-' => Some(c),
        _ => None,
    }
}

/// For each option the built-in policy of `command` refuses, every argv that names it (see
/// [`Grammar::spellings`]), `value` standing for its value. The property the tests (and a
/// fuzz target) check: [`check`] refuses each of them.
pub fn denied_spellings(command: &str, value: &str) -> Vec<(String, Vec<Vec<String>>)> {
    match builtin(command).parser {
        Parser::Table(t) => t
            .denied
            .iter()
            .filter_map(|d| {
                let opt = t.grammar.opts.iter().find(|o| o.canonical() == *d)?;
                Some((d.to_string(), t.grammar.spellings(opt, value)))
            })
            .collect(),
        Parser::Git => {
            let mut out = vec![
                (
                    "git -c".to_string(),
                    vec![strings(&["-c", "core.pager=id", "log"])],
                ),
                (
                    "git --config-env".to_string(),
                    vec![
                        strings(&["--config-env=core.pager=HOME", "log"]),
                        strings(&["--config-env", "core.pager=HOME", "log"]),
                    ],
                ),
                (
                    "git --exec-path".to_string(),
                    vec![strings(&["--exec-path=/tmp", "version"])],
                ),
            ];
            for sub in git::subcommands() {
                let (long, short) = git::refused(sub);
                for name in long {
                    let spellings = (1..=name.len())
                        .flat_map(|k| {
                            let p = &name[..k];
                            [
                                strings(&[sub, &format!("--{p}={value}")]),
                                strings(&[sub, &format!("--{p}"), value]),
                            ]
                        })
                        .collect();
                    out.push((format!("git {sub} --{name}"), spellings));
                }
                for c in short.iter() {
                    out.push((
                        format!("git {sub} -{c}"),
                        vec![
                            strings(&[sub, &format!("-{c}"), value]),
                            strings(&[sub, &format!("-{c}{value}")]),
                            strings(&[sub, &format!("-q{c}"), value]),
                        ],
                    ));
                }
            }
            out
        }
        Parser::Python => vec![(
            "python3 -m pip".to_string(),
            [
                &["-m", "pip"][..],
                &["-mpip"],
                &["-Im", "pip"],
                &["-Impip"],
                &["-I", "-m", "pip"],
                &["-m", "pip.__main__"],
                &["-bBm", "ensurepip"],
            ]
            .iter()
            .map(|a| strings(a))
            .collect(),
        )],
        Parser::Plain => Vec::new(),
    }
}

/// The grammar of a command with an option table (for tests against the real binaries).
pub fn grammar(command: &str) -> Option<&'static Grammar> {
    match builtin(command).parser {
        Parser::Table(t) => Some(t.grammar),
        Parser::Git | Parser::Python | Parser::Plain => None,
    }
}

#[cfg(test)]
mod tests {
    use super::grammar::{Item, ParseError};
    use super::*;

    fn argv(args: &[&str]) -> Vec<String> {
        strings(args)
    }

    fn refused(cmd: &str, args: &[&str]) -> bool {
        check(cmd, &argv(args)).is_some()
    }

    fn assert_refused(cmd: &str, cases: &[&[&str]]) {
        for args in cases {
            assert!(refused(cmd, args), "{cmd} {args:?} should be refused");
        }
    }

    fn assert_allowed(cmd: &str, cases: &[&[&str]]) {
        for args in cases {
            assert_eq!(check(cmd, &argv(args)), None, "{cmd} {args:?}");
        }
    }

    /// `(canonical option or operand, value)` for each item, as the policy sees the argv.
    fn normalised(cmd: &str, args: &[&str]) -> Result<Vec<(String, Option<String>)>, ParseError> {
        let args = argv(args);
        let g = grammar(cmd).expect("a table");
        Ok(g.parse(&args)?
            .into_iter()
            .map(|i| match i {
                Item::Opt(p) => (
                    format!(
                        "{}{}",
                        if p.negated { "no:" } else { "" },
                        p.opt.canonical()
                    ),
                    p.value.map(String::from),
                ),
                Item::Operand(o) => (format!("operand:{o}"), None),
            })
            .collect())
    }

    fn pairs(items: &[(&str, Option<&str>)]) -> Vec<(String, Option<String>)> {
        items
            .iter()
            .map(|(n, v)| (n.to_string(), v.map(String::from)))
            .collect()
    }

    #[test]
    fn every_denied_option_is_in_its_table() {
        for cmd in ["curl", "wget", "tar", "nmap"] {
            let Parser::Table(t) = builtin(cmd).parser else {
                panic!("{cmd} has a table")
            };
            for d in t.denied {
                assert!(
                    t.grammar.opts.iter().any(|o| o.canonical() == *d),
                    "{cmd}: {d} is not in the table"
                );
            }
            // Each short letter belongs to one option.
            for o in t.grammar.opts {
                if let Some(c) = o.short {
                    let n = t.grammar.opts.iter().filter(|p| p.short == Some(c)).count();
                    assert_eq!(n, 1, "{cmd}: -{c}");
                }
            }
        }
    }

    /// The property: a denied option is refused in every spelling its tool's parser accepts.
    #[test]
    fn denied_options_are_refused_in_every_spelling() {
        for cmd in ["curl", "wget", "tar", "nmap", "git", "python3"] {
            let all = denied_spellings(cmd, "x");
            assert!(!all.is_empty(), "{cmd}");
            let mut n = 0;
            for (option, spellings) in all {
                assert!(!spellings.is_empty(), "{cmd} {option}");
                for s in spellings {
                    n += 1;
                    let reason = check(cmd, &s);
                    assert!(reason.is_some(), "{cmd} {s:?} ({option}) is not refused");
                    // Also after an operand: getopt permutes, curl reads options anywhere.
                    if matches!(cmd, "curl" | "wget" | "nmap") {
                        let mut after = vec!["http://a.test/".to_string()];
                        after.extend(s.iter().cloned());
                        assert!(check(cmd, &after).is_some(), "{cmd} {after:?}");
                    }
                }
            }
            assert!(n > 0, "{cmd}");
        }
    }

    #[test]
    fn spellings_resolve_to_the_option_they_were_made_for() {
        for cmd in ["curl", "wget", "tar", "nmap"] {
            let g = grammar(cmd).expect("table");
            for (option, spellings) in denied_spellings(cmd, "x") {
                for s in spellings {
                    let items = g.parse(&s).unwrap_or_else(|e| panic!("{cmd} {s:?}: {e}"));
                    assert!(
                        items
                            .iter()
                            .any(|i| matches!(i, Item::Opt(p) if p.opt.canonical() == option)),
                        "{cmd} {s:?} does not parse as {option}: {items:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn curl_normalises_like_tool_getparam() {
        // Unique prefixes, any case; exact names win over longer ones.
        assert_eq!(
            normalised("curl", &["--conf", "-", "--OUTPUT", "f", "--output-d", "d"]).unwrap(),
            pairs(&[
                ("--config", Some("-")),
                ("--output", Some("f")),
                ("--output-dir", Some("d"))
            ])
        );
        // Bundles: letters until one takes a value, attached or next.
        assert_eq!(
            normalised("curl", &["-sSfo", "f", "-XPOST", "u"]).unwrap(),
            pairs(&[
                ("--silent", None),
                ("--show-error", None),
                ("--fail", None),
                ("--output", Some("f")),
                ("--request", Some("POST")),
                ("operand:u", None),
            ])
        );
        // `--no-` only for booleans and only exact; `--` ends options.
        assert_eq!(
            normalised("curl", &["--no-buffer", "--", "-o"]).unwrap(),
            pairs(&[("no:--buffer", None), ("operand:-o", None)])
        );
        for (args, err) in [
            (&["--con", "x"][..], "ambiguous"),
            (&["--output=/x"], "not an option"),
            (&["--no-outp", "x"], "not an option"),
            (&["--no-output"], "not an option"),
            (&["-"], "not an option"),
            (&["-*", "x"], "not an option"),
            (&["--config"], "needs a value"),
        ] {
            let e = normalised("curl", args).unwrap_err().to_string();
            assert!(e.contains(err), "{args:?}: {e}");
        }
    }

    #[test]
    fn curl() {
        assert_refused(
            "curl",
            &[
                &["-o", "/tmp/x", "http://a"],
                &["-sO", "http://a"],
                &["-so/tmp/x", "http://a"],
                &["--outp", "/x", "http://a"],
                &["--output=/x", "http://a"],
                &["--conf", "-"],
                &["--CONFIG", "cfg"],
                &["-K-"],
                &["-qs", "http://a"],
                &["--unix-socket", "/var/run/docker.sock", "http://x/"],
                &["--unix", "/var/run/docker.sock", "http://x/"],
                &["--proto", "=file", "http://a"],
                &["--socks5", "h:1", "http://a"],
                &["-T", "/etc/passwd", "http://a"],
                &["--etag-comp", "/etc/passwd", "http://a"],
                // URLs: only http(s), however spelled.
                &["file:///etc/passwd"],
                &["FILE:///etc/passwd"],
                &["File:/etc/passwd"],
                &["{file}:///etc/passwd"],
                &["[f-f]ile:///etc/passwd"],
                &[" file:///etc/passwd"],
                &["gopher://x"],
                &["--url", "file:///etc/passwd"],
                &["--ur", "dict://x"],
                &["-*", "file:///etc/passwd"],
                &["--", "file:///etc/passwd"],
                &["@/etc/passwd"],
                // Values that read local files.
                &["-d", "@/etc/passwd", "http://a"],
                &["-d@/etc/passwd", "http://a"],
                &["--data-b", "@/etc/passwd", "http://a"],
                &["--data-urlencode", "x@/etc/passwd", "http://a"],
                &["--url-query", "+x@/etc/passwd", "http://a"],
                &["-F", "f=@/etc/passwd", "http://a"],
                &["-Ff=</etc/passwd", "http://a"],
                &["-H", "@/etc/passwd", "http://a"],
                &["-w", "@/etc/passwd", "http://a"],
                &["-sw@/etc/passwd", "http://a"],
                &["--json", "@/etc/passwd", "http://a"],
                &["-b", "/etc/passwd", "http://a"],
                // A value that spells a refused option is refused too.
                &["-H", "--output", "f", "http://a"],
            ],
        );
        assert_allowed(
            "curl",
            &[
                &["-s", "http://a"],
                &["-sS", "-H", "X: y", "https://a.test/"],
                &["-XPOST", "-d", "x=1", "https://a"],
                &["-H", "Accept: json", "http://a"],
                &["-sSL", "http://a"],
                &["-f", "-sS", "--noproxy", "*", "--max-time", "5", "http://a"],
                &[
                    "-sS",
                    "-w",
                    "\n%{size_download} %{speed_download}",
                    "http://a/x",
                ],
                &["--data-urlencode", "q=a@b", "http://a"],
                &["-F", "name=value", "http://a"],
                &["-b", "a=b", "http://a"],
                &["--no-buffer", "http://a"],
                &["example.test/x"],
                &["example.test:8080/x"],
                &["http://[::1]/", "HTTPS://A.TEST/{a,b}"],
            ],
        );
    }

    #[test]
    fn wget_normalises_like_getopt_long() {
        assert_eq!(
            normalised(
                "wget",
                &[
                    "--use-askpas=/usr/bin/id",
                    "u",
                    "--output-d",
                    "f",
                    "-qO-",
                    "--no-check-c"
                ]
            )
            .unwrap(),
            pairs(&[
                ("--use-askpass", Some("/usr/bin/id")),
                ("operand:u", None),
                ("--output-document", Some("f")),
                ("--quiet", None),
                ("--output-document", Some("-")),
                ("no:--check-certificate", None),
            ])
        );
        // Booleans take an optional attached value; `-nv` is `-n v`.
        assert_eq!(
            normalised("wget", &["--recursive=off", "-nv", "-"]).unwrap(),
            pairs(&[
                ("--recursive", Some("off")),
                ("--no", Some("v")),
                ("operand:-", None)
            ])
        );
        for (args, err) in [
            (&["--no-c"][..], "ambiguous"),
            (&["--o", "x"], "ambiguous"),
            (&["--q"], "ambiguous"),
            (&["--version=1"], "takes no value"),
            (&["--bogus"], "not an option"),
            (&["-g"], "not an option"),
            (&["-O"], "needs a value"),
        ] {
            let e = normalised("wget", args).unwrap_err().to_string();
            assert!(e.contains(err), "{args:?}: {e}");
        }
    }

    #[test]
    fn wget() {
        assert_refused(
            "wget",
            &[
                &["-O", "x", "http://a"],
                &["-qO-", "http://a"],
                &["--output-doc=-", "http://a"],
                &["--execute=robots=off", "http://a"],
                &["--exec", "robots=off", "http://a"],
                &["--use-askpass=/bin/sh", "http://a"],
                &["--use-askpas=/usr/bin/id", "http://allowed.test/"],
                &["--use", "/usr/bin/id", "http://a"],
                &["--conf=/etc/x", "http://a"],
                &["-r", "http://a"],
                &["--recursive=off", "http://a"],
                &["--no-recursive", "http://a"],
                &["http://a", "-i", "list"],
                &["file:///etc/passwd"],
                &["FTP://a/x"],
                &["--bogus", "http://a"],
            ],
        );
        assert_allowed(
            "wget",
            &[
                &["-q", "http://a"],
                &["-nv", "--header=X: y", "--timeout=5", "https://a.test/"],
                &["--no-check-certificate", "-S", "http://a"],
                &["--", "http://a"],
            ],
        );
    }

    #[test]
    fn tar_normalises_old_style_keys_bundles_and_prefixes() {
        assert_eq!(
            normalised("tar", &["xvzf", "a.tgz", "-C", "d", "m"]).unwrap(),
            pairs(&[
                ("--extract", None),
                ("--verbose", None),
                ("--gzip", None),
                ("--file", Some("a.tgz")),
                ("--directory", Some("d")),
                ("operand:m", None),
            ])
        );
        // Old-style keys take their values in order; the first argument only.
        assert_eq!(
            normalised("tar", &["cfb", "a.tar", "20", "x", "-tf", "b"]).unwrap(),
            pairs(&[
                ("--create", None),
                ("--file", Some("a.tar")),
                ("--blocking-factor", Some("20")),
                ("operand:x", None),
                ("--list", None),
                ("--file", Some("b")),
            ])
        );
        // Aliases of one option are not ambiguous with each other; prefixes of different options are.
        assert_eq!(
            normalised("tar", &["--new-vol=s", "--checkpoint-act=exec=id", "--ung"]).unwrap(),
            pairs(&[
                ("--info-script", Some("s")),
                ("--checkpoint-action", Some("exec=id")),
                ("--gzip", None),
            ])
        );
        for (args, err) in [
            (&["--check", "x"][..], "ambiguous"),
            (&["-tq"], "not an option"),
            (&["tq"], "not an option"),
            (&["xf"], "needs a value"),
            (&["--HANG"], "not an option"),
        ] {
            let e = normalised("tar", args).unwrap_err().to_string();
            assert!(e.contains(err), "{args:?}: {e}");
        }
    }

    #[test]
    fn tar() {
        assert_refused(
            "tar",
            &[
                &["--to-command=sh", "-xf", "a.tar"],
                &["-xIzstd", "-f", "a.tar"],
                &["xIf", "zstd", "a.tar"],
                &[
                    "-c",
                    "-f",
                    "a.tar",
                    "--checkpoint=1",
                    "--checkpoint-act=exec=id",
                    "x",
                ],
                &["-c", "--check=1", "-f", "a.tar", "x"],
                &["--use-comp=sh", "-xf", "a.tar"],
                &["-cML", "10", "-f", "a.tar", "x"],
                &["cMf", "a.tar", "x"],
                &["-c", "--tape-l=10", "-f", "a.tar", "x"],
                &["-tf", "host:a.tar"],
                &["tf", "h:/a.tar"],
                &["--rsh=x", "-tf", "a.tar"],
            ],
        );
        assert_allowed(
            "tar",
            &[
                &["-tf", "a.tar"],
                &["-tzf", "a.tgz"],
                &["xzf", "a.tgz"],
                &["-cf", "-", "/etc/hostname"],
                &["-c", "--checkpoint=10", "-f", "a.tar", "x"],
                &["--force-local", "-tf", "c:a.tar"],
                &["--version"],
            ],
        );
    }

    #[test]
    fn nmap_normalises_like_getopt_long_only() {
        assert_eq!(
            normalised(
                "nmap",
                &["-script", "x", "-oNf", "-sV", "-Pn", "-p", "80", "h"]
            )
            .unwrap(),
            pairs(&[
                ("--script", Some("x")),
                ("-o", Some("Nf")),
                ("-s", Some("V")),
                ("-P", Some("n")),
                ("-p", Some("80")),
                ("operand:h", None),
            ])
        );
        // `-i` alone is the short option; `-iL` the long one; `-iLx` falls back to `-i Lx`.
        assert_eq!(
            normalised("nmap", &["-i", "a", "-iL", "b", "-iLc"]).unwrap(),
            pairs(&[("-i", Some("a")), ("--iL", Some("b")), ("-i", Some("Lc")),])
        );
        // getopt_long_only: any two prefix matches are ambiguous, even `-scri`.
        for args in [&["--ver", "h"][..], &["-scri", "x"], &["-no", "x"]] {
            let e = normalised("nmap", args).unwrap_err().to_string();
            assert!(e.contains("ambiguous"), "{args:?}: {e}");
        }
    }

    #[test]
    fn nmap() {
        assert_refused(
            "nmap",
            &[
                &["--script=vuln", "h"],
                &["--scrip=vuln", "h"],
                &["-scri", "vuln", "h"],
                &["-script", "vuln", "h"],
                &["-oN", "out", "h"],
                &["-oNout", "h"],
                &["-o", "out", "h"],
                &["-i", "/etc/passwd"],
                &["-iL", "/etc/passwd"],
                &["--excludef", "/etc/passwd", "h"],
                &["--datad=/tmp", "h"],
                &["-res", "log"],
            ],
        );
        assert_allowed(
            "nmap",
            &[
                &["-sT", "-Pn", "-p", "80,443", "h"],
                &["-sV", "--open", "-T4", "h"],
                &["-v", "--reason", "h"],
            ],
        );
    }

    #[test]
    fn git() {
        assert_refused(
            "git",
            &[
                &["-c", "core.pager=sh", "log"],
                &["--exec-path=/tmp", "log"],
                &["--config-env=core.pager=X", "log"],
                &["ls-remote", "--upload-p=id >&2; false", "/tmp"],
                &["ls-remote", "--ex", "id", "/tmp"],
                &["ls-remote", "--u=id", "/tmp"],
                &["clone", "-u", "id", "/tmp/r", "d"],
                &["clone", "-qu", "id", "/tmp/r", "d"],
                &["clone", "--templ=/tmp", "/tmp/r", "d"],
                &["clone", "-c", "core.fsmonitor=id", "/tmp/r", "d"],
                &["clone", "ext::sh -c id", "d"],
                &["ls-remote", "fd::3"],
                &["archive", "--remote=ext::sh", "HEAD"],
                &["grep", "-O", "x"],
                &["grep", "--open-files=id", "x"],
                // Global options are exact; subcommands are an allow-list.
                &["--exec-pat=/tmp", "log"],
                &["--git-di=/tmp", "log"],
                &["difftool", "-x", "id"],
                &["config", "--edit"],
                &["help", "-w"],
                &["--help"],
                &["rebase", "--exec", "id"],
            ],
        );
        assert_allowed(
            "git",
            &[
                &["--version"],
                &["version"],
                &["-C", "/tmp", "log", "--oneline", "-n", "3"],
                &["--git-dir=/tmp/r", "--no-pager", "show", "HEAD"],
                &["ls-remote", "--tags", "https://example.test/r.git"],
                &["clone", "--depth", "1", "https://example.test/r.git", "d"],
                &["clone", "--no-upload-pack", "https://example.test/r.git"],
                &[],
            ],
        );
    }

    #[test]
    fn python() {
        assert_refused(
            "python3",
            &[
                &["-m", "pip", "install", "x"],
                &["-mpip"],
                &["-Im", "pip"],
                &["-Impip", "install", "x"],
                &["-W", "ignore", "-m", "ensurepip"],
                &["-m", "pip._internal"],
                &["--bogus"],
                &["-J"],
            ],
        );
        assert_allowed(
            "python3",
            &[
                &["-c", "print(1)"],
                &["-c", "import x", "-m", "pip"],
                &["-I", "script.py", "-m", "pip"],
                &["-m", "json.tool"],
                &["-", "-m", "pip"],
                &["-Wignore", "-X", "dev", "-c", "1"],
            ],
        );
    }

    #[test]
    fn others() {
        assert_refused(
            "find",
            &[
                &[".", "-exec", "id", ";"],
                &[".", "-fprintf", "x", "%p"],
                &["-files0-from", "/etc/passwd", "-maxdepth", "0"],
            ],
        );
        assert_allowed("find", &[&[".", "-name", "*.rs"], &[".", "-executable"]]);
        assert_refused("grep", &[&["--pre=sh", "x", "f"], &["--pr", "sh", "x"]]);
        assert_allowed("grep", &[&["-rn", "--include=*.rs", "x", "."]]);
        assert_refused("rg", &[&["--pre", "sh", "x"], &["-iz", "x"]]);
    }

    #[test]
    fn allowlist_deny_args_resolve_through_the_table() {
        let p = ArgPolicy::for_command("curl", &argv(&["--insec", "-L"]), &[]).expect("resolves");
        assert!(p.check(&argv(&["-k", "http://a"])).is_some());
        assert!(p.check(&argv(&["--insecure", "http://a"])).is_some());
        assert!(p.check(&argv(&["-sL", "http://a"])).is_some());
        assert!(p.check(&argv(&["-s", "http://a"])).is_none());
        for bad in ["--bogus", "--c", "--no-output"] {
            let e = ArgPolicy::for_command("curl", &argv(&[bad]), &[])
                .err()
                .unwrap_or_default();
            assert!(e.contains("curl 7.88.1"), "{e}");
        }
        // Without a table: `--long` in every prefix, `-x` in every bundle, words exactly.
        let p = ArgPolicy::for_command("ls", &argv(&["--recursive", "-R"]), &argv(&["/etc"]))
            .expect("spellings");
        for bad in [
            &["--recursive"][..],
            &["--recur"],
            &["--recursive=x"],
            &["-lR"],
            &["/ETC/passwd"],
        ] {
            assert!(p.check(&argv(bad)).is_some(), "{bad:?}");
        }
        for ok in [&["-la"][..], &["--color=auto"], &["/tmp"]] {
            assert_eq!(p.check(&argv(ok)), None, "{ok:?}");
        }
    }
}
