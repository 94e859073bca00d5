//! nmap: option table.
//!
//! Table: `long_options[]` and the short option string of nmap 7.93 (`nmap.cc`, the 7.93
//! release merge), the nmap Debian 12 ships. nmap parses with glibc `getopt_long_only`, so
//! `-script` and `--scri` are both `--script`, and `-oNfile` is `-o Nfile`. Short letters
//! without a long name are their own options (`-o`, `-i`: deprecated spellings of `-oN`, `-iL`).

use super::grammar::{Arity, Grammar, Opt, Style};
use super::{Tool, no_extra_rule};

#[derive(Clone, Copy)]
enum K {
    /// No value.
    N,
    /// Required value.
    V,
    /// Optional attached value.
    O,
}
use K::*;

const fn arity(k: K) -> Arity {
    match k {
        N => Arity::None,
        V => Arity::Required,
        O => Arity::Optional,
    }
}

/// `o(long, short, long value, short value)`; `long` is "" for a short-only option.
const fn o(long: &'static str, short: Option<char>, long_kind: K, short_kind: K) -> Opt {
    Opt {
        long,
        aliases: &[],
        short,
        arity: arity(long_kind),
        short_arity: arity(short_kind),
        negatable: false,
    }
}

static OPTS: &[Opt] = &[
    o("version", Some('V'), N, N),
    o("verbose", Some('v'), N, O),
    o("datadir", None, V, N),
    o("servicedb", None, V, N),
    o("versiondb", None, V, N),
    o("debug", Some('d'), O, O),
    o("help", Some('h'), N, N),
    o("iflist", None, N, N),
    o("release-memory", None, N, N),
    o("nogcc", None, N, N),
    o("max-os-tries", None, V, N),
    o("max-parallelism", Some('M'), V, V),
    o("min-parallelism", None, V, N),
    o("timing", Some('T'), V, V),
    o("max-rtt-timeout", None, V, N),
    o("min-rtt-timeout", None, V, N),
    o("initial-rtt-timeout", None, V, N),
    o("excludefile", None, V, N),
    o("exclude", None, V, N),
    o("max-hostgroup", None, V, N),
    o("min-hostgroup", None, V, N),
    o("open", None, N, N),
    o("scanflags", None, V, N),
    o("defeat-rst-ratelimit", None, N, N),
    o("defeat-icmp-ratelimit", None, N, N),
    o("host-timeout", None, V, N),
    o("scan-delay", None, V, N),
    o("max-scan-delay", None, V, N),
    o("max-retries", None, V, N),
    o("oA", None, V, N),
    o("oN", None, V, N),
    o("oM", None, V, N),
    o("oG", None, V, N),
    o("oS", None, V, N),
    o("oH", None, V, N),
    o("oX", None, V, N),
    o("iL", None, V, N),
    o("iR", None, V, N),
    o("sI", None, V, N),
    o("source-port", Some('g'), V, V),
    o("randomize-hosts", None, N, N),
    o("nsock-engine", None, V, N),
    o("proxies", None, V, N),
    o("proxy", None, V, N),
    o("discovery-ignore-rst", None, N, N),
    o("osscan-limit", None, N, N),
    o("osscan-guess", None, N, N),
    o("fuzzy", None, N, N),
    o("packet-trace", None, N, N),
    o("version-trace", None, N, N),
    o("data", None, V, N),
    o("data-string", None, V, N),
    o("data-length", None, V, N),
    o("send-eth", None, N, N),
    o("send-ip", None, N, N),
    o("stylesheet", None, V, N),
    o("no-stylesheet", None, N, N),
    o("webxml", None, N, N),
    o("rH", None, N, N),
    o("vv", None, N, N),
    o("ff", None, N, N),
    o("privileged", None, N, N),
    o("unprivileged", None, N, N),
    o("mtu", None, V, N),
    o("append-output", None, N, N),
    o("noninteractive", None, N, N),
    o("spoof-mac", None, V, N),
    o("thc", None, N, N),
    o("badsum", None, N, N),
    o("ttl", None, V, N),
    o("traceroute", None, N, N),
    o("reason", None, N, N),
    o("allports", None, N, N),
    o("version-intensity", None, V, N),
    o("version-light", None, N, N),
    o("version-all", None, N, N),
    o("system-dns", None, N, N),
    o("resolve-all", None, N, N),
    o("unique", None, N, N),
    o("log-errors", None, N, N),
    o("deprecated-xml-osclass", None, N, N),
    o("dns-servers", None, V, N),
    o("port-ratio", None, V, N),
    o("exclude-ports", None, V, N),
    o("top-ports", None, V, N),
    o("script", None, V, N),
    o("script-trace", None, N, N),
    o("script-updatedb", None, N, N),
    o("script-args", None, V, N),
    o("script-args-file", None, V, N),
    o("script-help", None, V, N),
    o("script-timeout", None, V, N),
    o("ip-options", None, V, N),
    o("min-rate", None, V, N),
    o("max-rate", None, V, N),
    o("adler32", None, N, N),
    o("stats-every", None, V, N),
    o("disable-arp-ping", None, N, N),
    o("route-dst", None, V, N),
    o("resume", None, V, N),
    // Spelled as an encoded string in nmap.cc.
    o("yoloscan", None, N, N),
    o("", Some('4'), N, N),
    o("", Some('6'), N, N),
    o("", Some('A'), N, N),
    o("", Some('b'), N, V),
    o("", Some('D'), N, V),
    o("", Some('e'), N, V),
    o("", Some('F'), N, N),
    o("", Some('f'), N, N),
    o("", Some('I'), N, N),
    o("", Some('i'), N, V),
    o("", Some('m'), N, V),
    o("", Some('n'), N, N),
    o("", Some('O'), N, O),
    o("", Some('o'), N, V),
    o("", Some('P'), N, O),
    o("", Some('p'), N, V),
    o("", Some('q'), N, N),
    o("", Some('R'), N, N),
    o("", Some('r'), N, N),
    o("", Some('S'), N, V),
    o("", Some('s'), N, O),
];

pub static GRAMMAR: Grammar = Grammar {
    tool: "nmap 7.93",
    style: Style::GnuLongOnly,
    opts: OPTS,
    old_style_keys: false,
    bundle_with: '4',
};

/// Options that write output files, read files (target lists, data files, resume logs) or
/// load NSE scripts (Lua code) and their arguments.
pub static TOOL: Tool = Tool {
    grammar: &GRAMMAR,
    denied: &[
        "--oA",
        "--oN",
        "--oM",
        "--oG",
        "--oS",
        "--oH",
        "--oX",
        "-o",
        "--iL",
        "-i",
        "--excludefile",
        "--resume",
        "--datadir",
        "--servicedb",
        "--versiondb",
        "--stylesheet",
        "--script",
        "--script-trace",
        "--script-updatedb",
        "--script-args",
        "--script-args-file",
        "--script-help",
        "--script-timeout",
    ],
    judge: no_extra_rule,
};
