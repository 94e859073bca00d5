//! git: global options, the subcommands that may run and the options each refuses.
//!
//! From git 2.47.3 (`git.c`, tag v2.47.3; the git installed here): `handle_options` reads global
//! options by exact spelling only and stops at the first argument without a dash, the
//! subcommand. Subcommands parse with parse-options, which accepts any unique prefix of a long
//! option (`--upload-p` is `--upload-pack`) and bundles short options. An abbreviation can only
//! name an option it is a prefix of, so refusing every prefix of a refused name refuses every
//! spelling git accepts without needing each subcommand's full table; an argument that only
//! looks like one (a value, a path after `--`) is refused too, which fails closed.
//!
//! Subcommands are an allow-list: many others run programs by design (`difftool`,
//! `bisect run`, `submodule foreach`, `rebase --exec`, `config --edit`, `help --web`, remote
//! helpers reached as `git remote-ext`).

/// Global options that take no value.
const GLOBAL_FLAGS: &[&str] = &[
    "--html-path",
    "--man-path",
    "--info-path",
    "-p",
    "--paginate",
    "-P",
    "--no-pager",
    "--no-lazy-fetch",
    "--no-replace-objects",
    "--bare",
    "--literal-pathspecs",
    "--no-literal-pathspecs",
    "--glob-pathspecs",
    "--noglob-pathspecs",
    "--icase-pathspecs",
    "--no-optional-locks",
    "--no-advice",
];

/// Global options whose value is the next argument (those with `=` also take `--opt=value`).
const GLOBAL_WITH_VALUE: &[(&str, bool)] = &[
    ("--git-dir", true),
    ("--namespace", true),
    ("--work-tree", true),
    ("--attr-source", true),
    ("--shallow-file", false),
    ("-C", false),
];

/// Subcommands that may run, each with the long options it refuses (in every prefix) and the
/// short letters it refuses (anywhere in a bundle).
const SUBCOMMANDS: &[(&str, &[&str], &[char])] = &[
    ("version", &[], &[]),
    ("init", &["template"], &[]),
    ("clone", &["upload-pack", "template", "config"], &['u', 'c']),
    ("ls-remote", &["upload-pack", "exec"], &[]),
    ("fetch", &["upload-pack"], &[]),
    ("archive", &["exec"], &[]),
    ("grep", &["open-files-in-pager"], &['O']),
    ("log", &[], &[]),
    ("show", &[], &[]),
    ("diff", &[], &[]),
    ("status", &[], &[]),
    ("rev-parse", &[], &[]),
    ("rev-list", &[], &[]),
    ("ls-files", &[], &[]),
    ("ls-tree", &[], &[]),
    ("cat-file", &[], &[]),
    ("blame", &[], &[]),
    ("describe", &[], &[]),
    ("shortlog", &[], &[]),
    ("show-ref", &[], &[]),
    ("for-each-ref", &[], &[]),
    ("count-objects", &[], &[]),
    ("name-rev", &[], &[]),
    ("merge-base", &[], &[]),
];

/// The long options and short letters `subcommand` refuses (for the spelling property tests).
pub fn refused(subcommand: &str) -> (&'static [&'static str], &'static [char]) {
    SUBCOMMANDS
        .iter()
        .find(|(n, _, _)| *n == subcommand)
        .map_or((&[], &[]), |(_, l, s)| (*l, *s))
}

/// The subcommands that may run.
pub fn subcommands() -> impl Iterator<Item = &'static str> {
    SUBCOMMANDS.iter().map(|(n, _, _)| *n)
}

/// `Some(reason)` when git would run something the policy refuses.
pub fn check(args: &[String]) -> Option<String> {
    let mut i = 0;
    let refused = |arg: &str, why: &str| Some(format!("argument '{arg}' is refused: {why}"));
    while let Some(arg) = args.get(i) {
        let arg = arg.as_str();
        if !arg.starts_with('-') || matches!(arg, "--help" | "-h" | "--version" | "-v") {
            break;
        }
        i += 1;
        if arg.starts_with("--exec-path") {
            return refused(
                arg,
                "git --exec-path runs git commands from another directory",
            );
        }
        if arg == "-c" || arg == "--config-env" || arg.starts_with("--config-env=") {
            return refused(
                arg,
                "git -c/--config-env set configuration that runs programs",
            );
        }
        if GLOBAL_FLAGS.contains(&arg) || arg.starts_with("--list-cmds=") {
            continue;
        }
        let attached = |(name, eq): &(&str, bool)| {
            *eq && arg.strip_prefix(name).is_some_and(|r| r.starts_with('='))
        };
        if GLOBAL_WITH_VALUE.iter().any(attached) {
            continue;
        }
        if GLOBAL_WITH_VALUE.iter().any(|(name, _)| *name == arg) {
            i += 1;
            continue;
        }
        return refused(
            arg,
            "git 2.47.3 knows no such global option (they cannot be abbreviated)",
        );
    }
    let sub = match args.get(i).map(String::as_str) {
        None => return None,
        Some("--version" | "-v") => "version",
        Some("--help" | "-h") => "help",
        Some(s) => s,
    };
    let Some((_, long, short)) = SUBCOMMANDS.iter().find(|(n, _, _)| *n == sub) else {
        return Some(format!(
            "git subcommand '{sub}' is not permitted (allowed: {})",
            subcommands().collect::<Vec<_>>().join(", ")
        ));
    };
    for arg in &args[i + 1..] {
        let arg = arg.as_str();
        if let Some(body) = arg.strip_prefix("--") {
            let name = body.split_once('=').map_or(body, |(n, _)| n);
            if let Some(full) = long
                .iter()
                .find(|l| !name.is_empty() && l.starts_with(name))
            {
                return refused(
                    arg,
                    &format!("git {sub} reads it as --{full} (any unique prefix is accepted)"),
                );
            }
        } else if let Some(body) = arg.strip_prefix('-')
            && let Some(c) = body.chars().find(|c| short.contains(c))
        {
            return refused(arg, &format!("git {sub} -{c} is refused"));
        }
        let value = arg
            .strip_prefix("--")
            .and_then(|b| b.split_once('='))
            .map_or(arg, |(_, v)| v);
        if let Some(r) = transport_refusal(value) {
            return Some(r);
        }
    }
    None
}

/// `transport::address` runs the remote helper `git-remote-<transport>` (`ext::` runs any
/// command); only the http(s) helpers are allowed.
fn transport_refusal(url: &str) -> Option<String> {
    let (transport, _) = url.split_once("::")?;
    let is_name = !transport.is_empty()
        && transport
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    let allowed = ["http", "https"].contains(&transport.to_ascii_lowercase().as_str());
    (is_name && !allowed).then(|| {
        format!("URL '{url}' is refused: the '{transport}::' remote helper may run programs")
    })
}
