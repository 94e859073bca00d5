//! GNU tar: option table and the rule for archive names.
//!
//! Table: every option `tar --help` of GNU tar 1.34 (Debian 12) lists, with its aliases and
//! short letter; tar parses with argp (getopt_long underneath: unique prefixes, aliases of one
//! option never ambiguous) after exploding an old-style first argument (`tar xvf a.tar`).
//! Hidden options are left out, so they are refused. `tests/argpolicy_binaries.rs` checks the
//! table against `tar --help` and probes the binary.

use super::Tool;
use super::grammar::{Arity, Grammar, Item, Opt, Style};

#[derive(Clone, Copy)]
enum K {
    /// No value.
    N,
    /// Required value (`--name=v`, `--name v`, `-xv`, `-x v`).
    V,
    /// Optional attached value (`--name=v`), long only.
    O,
}
use K::*;

const fn o(
    long: &'static str,
    aliases: &'static [&'static str],
    short: Option<char>,
    kind: K,
) -> Opt {
    let arity = match kind {
        N => Arity::None,
        V => Arity::Required,
        O => Arity::Optional,
    };
    Opt {
        long,
        aliases,
        short,
        arity,
        short_arity: arity,
        negatable: false,
    }
}

static OPTS: &[Opt] = &[
    o("catenate", &["concatenate"], Some('A'), N),
    o("create", &[], Some('c'), N),
    o("delete", &[], None, N),
    o("diff", &["compare"], Some('d'), N),
    o("append", &[], Some('r'), N),
    o("test-label", &[], None, N),
    o("list", &[], Some('t'), N),
    o("update", &[], Some('u'), N),
    o("extract", &["get"], Some('x'), N),
    o("check-device", &[], None, N),
    o("listed-incremental", &[], Some('g'), V),
    o("incremental", &[], Some('G'), N),
    o("hole-detection", &[], None, V),
    o("ignore-failed-read", &[], None, N),
    o("level", &[], None, V),
    o("no-check-device", &[], None, N),
    o("no-seek", &[], None, N),
    o("seek", &[], Some('n'), N),
    o("occurrence", &[], None, O),
    o("sparse-version", &[], None, V),
    o("sparse", &[], Some('S'), N),
    o("add-file", &[], None, V),
    o("directory", &[], Some('C'), V),
    o("exclude", &[], None, V),
    o("exclude-backups", &[], None, N),
    o("exclude-caches", &[], None, N),
    o("exclude-caches-all", &[], None, N),
    o("exclude-caches-under", &[], None, N),
    o("exclude-ignore", &[], None, V),
    o("exclude-ignore-recursive", &[], None, V),
    o("exclude-tag", &[], None, V),
    o("exclude-tag-all", &[], None, V),
    o("exclude-tag-under", &[], None, V),
    o("exclude-vcs", &[], None, N),
    o("exclude-vcs-ignores", &[], None, N),
    o("no-null", &[], None, N),
    o("no-recursion", &[], None, N),
    o("no-unquote", &[], None, N),
    o("no-verbatim-files-from", &[], None, N),
    o("null", &[], None, N),
    o("verbatim-files-from", &[], None, N),
    o("recursion", &[], None, N),
    o("files-from", &[], Some('T'), V),
    o("unquote", &[], None, N),
    o("exclude-from", &[], Some('X'), V),
    o("anchored", &[], None, N),
    o("ignore-case", &[], None, N),
    o("no-anchored", &[], None, N),
    o("no-ignore-case", &[], None, N),
    o("no-wildcards", &[], None, N),
    o("no-wildcards-match-slash", &[], None, N),
    o("wildcards", &[], None, N),
    o("wildcards-match-slash", &[], None, N),
    o("keep-directory-symlink", &[], None, N),
    o("keep-newer-files", &[], None, N),
    o("keep-old-files", &[], Some('k'), N),
    o("no-overwrite-dir", &[], None, N),
    o("one-top-level", &[], None, O),
    o("overwrite", &[], None, N),
    o("overwrite-dir", &[], None, N),
    o("recursive-unlink", &[], None, N),
    o("remove-files", &[], None, N),
    o("skip-old-files", &[], None, N),
    o("unlink-first", &[], Some('U'), N),
    o("verify", &[], Some('W'), N),
    o("ignore-command-error", &[], None, N),
    o("no-ignore-command-error", &[], None, N),
    o("to-stdout", &[], Some('O'), N),
    o("to-command", &[], None, V),
    o("atime-preserve", &[], None, O),
    o("clamp-mtime", &[], None, N),
    o("delay-directory-restore", &[], None, N),
    o("group", &[], None, V),
    o("group-map", &[], None, V),
    o("mode", &[], None, V),
    o("mtime", &[], None, V),
    o("touch", &[], Some('m'), N),
    o("no-delay-directory-restore", &[], None, N),
    o("no-same-owner", &[], None, N),
    o("no-same-permissions", &[], None, N),
    o("numeric-owner", &[], None, N),
    o("owner", &[], None, V),
    o("owner-map", &[], None, V),
    o("preserve-permissions", &["same-permissions"], Some('p'), N),
    o("same-owner", &[], None, N),
    o("sort", &[], None, V),
    o("preserve-order", &["same-order"], Some('s'), N),
    o("acls", &[], None, N),
    o("no-acls", &[], None, N),
    o("no-selinux", &[], None, N),
    o("no-xattrs", &[], None, N),
    o("selinux", &[], None, N),
    o("xattrs", &[], None, N),
    o("xattrs-exclude", &[], None, V),
    o("xattrs-include", &[], None, V),
    o("force-local", &[], None, N),
    o("file", &[], Some('f'), V),
    o("info-script", &["new-volume-script"], Some('F'), V),
    o("tape-length", &[], Some('L'), V),
    o("multi-volume", &[], Some('M'), N),
    o("rmt-command", &[], None, V),
    o("rsh-command", &[], None, V),
    o("volno-file", &[], None, V),
    o("blocking-factor", &[], Some('b'), V),
    o("read-full-records", &[], Some('B'), N),
    o("ignore-zeros", &[], Some('i'), N),
    o("record-size", &[], None, V),
    o("format", &[], Some('H'), V),
    o("old-archive", &["portability"], None, N),
    o("pax-option", &[], None, V),
    o("posix", &[], None, N),
    o("label", &[], Some('V'), V),
    o("auto-compress", &[], Some('a'), N),
    o("use-compress-program", &[], Some('I'), V),
    o("bzip2", &[], Some('j'), N),
    o("xz", &[], Some('J'), N),
    o("lzip", &[], None, N),
    o("lzma", &[], None, N),
    o("lzop", &[], None, N),
    o("no-auto-compress", &[], None, N),
    o("zstd", &[], None, N),
    o("gzip", &["gunzip", "ungzip"], Some('z'), N),
    o("compress", &["uncompress"], Some('Z'), N),
    o("backup", &[], None, O),
    o("hard-dereference", &[], None, N),
    o("dereference", &[], Some('h'), N),
    o("starting-file", &[], Some('K'), V),
    o("newer-mtime", &[], None, V),
    o("newer", &["after-date"], Some('N'), V),
    o("one-file-system", &[], None, N),
    o("absolute-names", &[], Some('P'), N),
    o("suffix", &[], None, V),
    o("strip-components", &[], None, V),
    o("transform", &["xform"], None, V),
    o("checkpoint", &[], None, O),
    o("checkpoint-action", &[], None, V),
    o("full-time", &[], None, N),
    o("index-file", &[], None, V),
    o("check-links", &[], Some('l'), N),
    o("no-quote-chars", &[], None, V),
    o("quote-chars", &[], None, V),
    o("quoting-style", &[], None, V),
    o("block-number", &[], Some('R'), N),
    o("show-defaults", &[], None, N),
    o("show-omitted-dirs", &[], None, N),
    o("show-snapshot-field-ranges", &[], None, N),
    o("show-transformed-names", &["show-stored-names"], None, N),
    o("totals", &[], None, O),
    o("utc", &[], None, N),
    o("verbose", &[], Some('v'), N),
    o("warning", &[], None, V),
    o("interactive", &["confirmation"], Some('w'), N),
    o("", &[], Some('o'), N),
    o("help", &[], Some('?'), N),
    o("restrict", &[], None, N),
    o("usage", &[], None, N),
    o("version", &[], None, N),
];

pub static GRAMMAR: Grammar = Grammar {
    tool: "GNU tar 1.34",
    style: Style::Gnu,
    opts: OPTS,
    old_style_keys: true,
    bundle_with: 't',
};

/// Options that run programs: checkpoint actions, filters, remote shells, new-volume scripts,
/// and multi-volume mode, whose "prepare volume" prompt spawns a shell on `!` read from stdin.
pub static TOOL: Tool = Tool {
    grammar: &GRAMMAR,
    denied: &[
        "--checkpoint-action",
        "--to-command",
        "--use-compress-program",
        "--rsh-command",
        "--rmt-command",
        "--info-script",
        "--multi-volume",
        "--tape-length",
    ],
    judge,
};

/// An archive name with a ':' is `host:path` to tar, opened through a remote shell, unless
/// `--force-local` is given.
fn judge(items: &[Item<'_>]) -> Option<String> {
    let force_local = items
        .iter()
        .any(|i| matches!(i, Item::Opt(p) if p.opt.long == "force-local"));
    if force_local {
        return None;
    }
    items.iter().find_map(|i| match i {
        Item::Opt(p) if p.opt.long == "file" => p.value.filter(|v| v.contains(':')).map(|v| {
            format!("archive '{v}' names a remote host (host:path runs a remote shell); add --force-local for a local file")
        }),
        _ => None,
    })
}
