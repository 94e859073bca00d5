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
mod tests;
