//! curl: option table and the rules for values and URLs.
//!
//! Table: every entry of the `aliases[]` table of curl 7.88.1 (`src/tool_getparam.c`, tag
//! curl-7_88_1), the curl Debian 12 ships; `tests/argpolicy_binaries.rs` checks it against
//! `curl --help all` and probes the binary. Short letters are the single-letter entries; curl
//! would also read `-*` (url) and `-$`, which the table leaves out so they are refused.

use super::grammar::{Arity, Grammar, Item, Opt, Style};
use super::{Tool, file_read_refusal};

#[derive(Clone, Copy)]
enum K {
    /// Stand-alone, not negatable.
    N,
    /// Boolean: also `--no-NAME`.
    B,
    /// Takes the next argument as its value.
    V,
}
use K::*;

const fn o(long: &'static str, short: Option<char>, kind: K) -> Opt {
    let arity = match kind {
        V => Arity::Required,
        N | B => Arity::None,
    };
    Opt {
        long,
        aliases: &[],
        short,
        arity,
        short_arity: arity,
        negatable: matches!(kind, B),
    }
}

static OPTS: &[Opt] = &[
    o("abstract-unix-socket", None, V),
    o("alpn", None, B),
    o("alt-svc", None, V),
    o("anyauth", None, B),
    o("append", Some('a'), B),
    o("aws-sigv4", None, V),
    o("basic", None, B),
    o("buffer", Some('N'), B),
    o("cacert", None, V),
    o("capath", None, V),
    o("cert", Some('E'), V),
    o("cert-status", None, B),
    o("cert-type", None, V),
    o("ciphers", None, V),
    o("clobber", None, B),
    o("compressed", None, B),
    o("compressed-ssh", None, B),
    o("config", Some('K'), V),
    o("connect-timeout", None, V),
    o("connect-to", None, V),
    o("continue-at", Some('C'), V),
    o("cookie", Some('b'), V),
    o("cookie-jar", Some('c'), V),
    o("create-dirs", None, B),
    o("create-file-mode", None, V),
    o("crlf", None, B),
    o("crlfile", None, V),
    o("curves", None, V),
    o("data", Some('d'), V),
    o("data-ascii", None, V),
    o("data-binary", None, V),
    o("data-raw", None, V),
    o("data-urlencode", None, V),
    o("delegation", None, V),
    o("digest", None, B),
    o("disable", Some('q'), B),
    o("disable-eprt", None, B),
    o("disable-epsv", None, B),
    o("disallow-username-in-url", None, B),
    o("dns-interface", None, V),
    o("dns-ipv4-addr", None, V),
    o("dns-ipv6-addr", None, V),
    o("dns-servers", None, V),
    o("doh-cert-status", None, B),
    o("doh-insecure", None, B),
    o("doh-url", None, V),
    o("dump-header", Some('D'), V),
    o("egd-file", None, V),
    o("engine", None, V),
    o("eprt", None, B),
    o("epsv", None, B),
    o("etag-compare", None, V),
    o("etag-save", None, V),
    o("expect100-timeout", None, V),
    o("fail", Some('f'), B),
    o("fail-early", None, B),
    o("fail-with-body", None, B),
    o("false-start", None, B),
    o("form", Some('F'), V),
    o("form-escape", None, B),
    o("form-string", None, V),
    o("ftp-account", None, V),
    o("ftp-alternative-to-user", None, V),
    o("ftp-create-dirs", None, B),
    o("ftp-method", None, V),
    o("ftp-pasv", None, B),
    o("ftp-port", Some('P'), V),
    o("ftp-pret", None, B),
    o("ftp-skip-pasv-ip", None, B),
    o("ftp-ssl", None, B),
    o("ftp-ssl-ccc", None, B),
    o("ftp-ssl-ccc-mode", None, V),
    o("ftp-ssl-control", None, B),
    o("ftp-ssl-reqd", None, B),
    o("get", Some('G'), B),
    o("globoff", Some('g'), B),
    o("happy-eyeballs-timeout-ms", None, V),
    o("haproxy-protocol", None, B),
    o("head", Some('I'), B),
    o("header", Some('H'), V),
    o("help", Some('h'), B),
    o("hostpubmd5", None, V),
    o("hostpubsha256", None, V),
    o("hsts", None, V),
    o("http0.9", None, B),
    o("http1.0", Some('0'), N),
    o("http1.1", None, N),
    o("http2", None, N),
    o("http2-prior-knowledge", None, N),
    o("http3", None, N),
    o("http3-only", None, N),
    o("ignore-content-length", None, B),
    o("include", Some('i'), B),
    o("insecure", Some('k'), B),
    o("interface", None, V),
    o("ipv4", Some('4'), N),
    o("ipv6", Some('6'), N),
    o("json", None, V),
    o("junk-session-cookies", Some('j'), B),
    o("keepalive", None, B),
    o("keepalive-time", None, V),
    o("key", None, V),
    o("key-type", None, V),
    o("krb", None, V),
    o("krb4", None, V),
    o("libcurl", None, V),
    o("limit-rate", None, V),
    o("list-only", Some('l'), B),
    o("local-port", None, V),
    o("location", Some('L'), B),
    o("location-trusted", None, B),
    o("login-options", None, V),
    o("mail-auth", None, V),
    o("mail-from", None, V),
    o("mail-rcpt", None, V),
    o("mail-rcpt-allowfails", None, B),
    o("manual", Some('M'), B),
    o("max-filesize", None, V),
    o("max-redirs", None, V),
    o("max-time", Some('m'), V),
    o("metalink", None, B),
    o("negotiate", None, B),
    o("netrc", Some('n'), B),
    o("netrc-file", None, V),
    o("netrc-optional", None, B),
    o("next", Some(':'), N),
    o("noproxy", None, V),
    o("npn", None, B),
    o("ntlm", None, B),
    o("ntlm-wb", None, B),
    o("oauth2-bearer", None, V),
    o("output", Some('o'), V),
    o("output-dir", None, V),
    o("parallel", Some('Z'), B),
    o("parallel-immediate", None, B),
    o("parallel-max", None, V),
    o("pass", None, V),
    o("path-as-is", None, B),
    o("pinnedpubkey", None, V),
    o("post301", None, B),
    o("post302", None, B),
    o("post303", None, B),
    o("preproxy", None, V),
    o("progress-bar", Some('#'), B),
    o("progress-meter", None, B),
    o("proto", None, V),
    o("proto-default", None, V),
    o("proto-redir", None, V),
    o("proxy", Some('x'), V),
    o("proxy-anyauth", None, B),
    o("proxy-basic", None, B),
    o("proxy-cacert", None, V),
    o("proxy-capath", None, V),
    o("proxy-cert", None, V),
    o("proxy-cert-type", None, V),
    o("proxy-ciphers", None, V),
    o("proxy-crlfile", None, V),
    o("proxy-digest", None, B),
    o("proxy-header", None, V),
    o("proxy-insecure", None, B),
    o("proxy-key", None, V),
    o("proxy-key-type", None, V),
    o("proxy-negotiate", None, B),
    o("proxy-ntlm", None, B),
    o("proxy-pass", None, V),
    o("proxy-pinnedpubkey", None, V),
    o("proxy-service-name", None, V),
    o("proxy-ssl-allow-beast", None, B),
    o("proxy-ssl-auto-client-cert", None, B),
    o("proxy-tls13-ciphers", None, V),
    o("proxy-tlsauthtype", None, V),
    o("proxy-tlspassword", None, V),
    o("proxy-tlsuser", None, V),
    o("proxy-tlsv1", None, N),
    o("proxy-user", Some('U'), V),
    o("proxy1.0", None, V),
    o("proxytunnel", Some('p'), B),
    o("pubkey", None, V),
    o("quote", Some('Q'), V),
    o("random-file", None, V),
    o("range", Some('r'), V),
    o("rate", None, V),
    o("raw", None, B),
    o("referer", Some('e'), V),
    o("remote-header-name", Some('J'), B),
    o("remote-name", Some('O'), B),
    o("remote-name-all", None, B),
    o("remote-time", Some('R'), B),
    o("remove-on-error", None, B),
    o("request", Some('X'), V),
    o("request-target", None, V),
    o("resolve", None, V),
    o("retry", None, V),
    o("retry-all-errors", None, B),
    o("retry-connrefused", None, B),
    o("retry-delay", None, V),
    o("retry-max-time", None, V),
    o("sasl-authzid", None, V),
    o("sasl-ir", None, B),
    o("service-name", None, V),
    o("sessionid", None, B),
    o("show-error", Some('S'), B),
    o("silent", Some('s'), B),
    o("socks4", None, V),
    o("socks4a", None, V),
    o("socks5", None, V),
    o("socks5-basic", None, B),
    o("socks5-gssapi", None, B),
    o("socks5-gssapi-nec", None, B),
    o("socks5-gssapi-service", None, V),
    o("socks5-hostname", None, V),
    o("speed-limit", Some('Y'), V),
    o("speed-time", Some('y'), V),
    o("ssl", None, B),
    o("ssl-allow-beast", None, B),
    o("ssl-auto-client-cert", None, B),
    o("ssl-no-revoke", None, B),
    o("ssl-reqd", None, B),
    o("ssl-revoke-best-effort", None, B),
    o("sslv2", Some('2'), N),
    o("sslv3", Some('3'), N),
    o("stderr", None, V),
    o("styled-output", None, B),
    o("suppress-connect-headers", None, B),
    o("tcp-fastopen", None, B),
    o("tcp-nodelay", None, B),
    o("telnet-option", Some('t'), V),
    o("test-event", None, B),
    o("tftp-blksize", None, V),
    o("tftp-no-options", None, B),
    o("time-cond", Some('z'), V),
    o("tls-max", None, V),
    o("tls13-ciphers", None, V),
    o("tlsauthtype", None, V),
    o("tlspassword", None, V),
    o("tlsuser", None, V),
    o("tlsv1", Some('1'), N),
    o("tlsv1.0", None, N),
    o("tlsv1.1", None, N),
    o("tlsv1.2", None, N),
    o("tlsv1.3", None, N),
    o("tr-encoding", None, B),
    o("trace", None, V),
    o("trace-ascii", None, V),
    o("trace-time", None, B),
    o("unix-socket", None, V),
    o("upload-file", Some('T'), V),
    o("url", None, V),
    o("url-query", None, V),
    o("use-ascii", Some('B'), B),
    o("user", Some('u'), V),
    o("user-agent", Some('A'), V),
    o("verbose", Some('v'), B),
    o("version", Some('V'), B),
    o("wdebug", None, B),
    o("write-out", Some('w'), V),
    o("xattr", None, B),
];

pub static GRAMMAR: Grammar = Grammar {
    tool: "curl 7.88.1",
    style: Style::Curl,
    opts: OPTS,
    old_style_keys: false,
    bundle_with: 's',
};

/// Options that write files, read local files or config, or route around the egress proxy.
pub static TOOL: Tool = Tool {
    grammar: &GRAMMAR,
    denied: &[
        "--output",
        "--remote-name",
        "--remote-name-all",
        "--output-dir",
        "--create-dirs",
        "--config",
        "--disable",
        "--upload-file",
        "--unix-socket",
        "--abstract-unix-socket",
        "--proto",
        "--proto-redir",
        "--proto-default",
        "--proxy",
        "--proxy1.0",
        "--preproxy",
        "--socks4",
        "--socks4a",
        "--socks5",
        "--socks5-hostname",
        "--dump-header",
        "--cookie-jar",
        "--trace",
        "--trace-ascii",
        "--stderr",
        "--libcurl",
        "--engine",
        "--netrc-file",
        "--etag-save",
        "--etag-compare",
        "--hsts",
        "--alt-svc",
    ],
    judge,
};

/// Values and URLs: no `@file` / `<file` reads, only http(s) URLs.
fn judge(items: &[Item<'_>]) -> Option<String> {
    for item in items {
        let (name, value) = match item {
            Item::Operand(url) => {
                if let Some(r) = url_refusal(url) {
                    return Some(r);
                }
                continue;
            }
            Item::Opt(p) => match p.value {
                Some(v) => (p.opt.long, v),
                None => continue,
            },
        };
        let reads_file = match name {
            "url" => {
                if let Some(r) = url_refusal(value) {
                    return Some(r);
                }
                false
            }
            // `@file` (and `@-`) is read as the value.
            "data" | "data-ascii" | "data-binary" | "json" | "header" | "proxy-header"
            | "write-out" => value.starts_with('@'),
            // `name@file` or `@file`: the first of '@' and '=' decides.
            "data-urlencode" | "url-query" => value
                .find(['@', '='])
                .is_some_and(|i| value[i..].starts_with('@')),
            // `name=@file` uploads a file, `name=<file` sends its content.
            "form" => value.starts_with(['@', '<']) || value.contains("=@") || value.contains("=<"),
            // A value without '=' is a cookie file to read.
            "cookie" => !value.is_empty() && !value.contains('='),
            _ => false,
        };
        if reads_file {
            return Some(file_read_refusal(name, value));
        }
    }
    None
}

/// A URL curl would fetch from somewhere other than http(s): an explicit other scheme
/// (`file:/…`, any case), or a glob (`{file}://…`) or odd first character curl could turn
/// into one. Schemeless `host/path` is guessed as http.
fn url_refusal(url: &str) -> Option<String> {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return None;
    }
    let refused = |why: &str| Some(format!("URL '{url}' is refused: {why}"));
    if !lower.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return refused("it must start with http://, https:// or a host name");
    }
    if lower.contains(['{', '[']) {
        return refused("a glob before the scheme is parsed could make any scheme");
    }
    let scheme_len = lower
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .unwrap_or(lower.len());
    if lower[scheme_len..].starts_with(':')
        && !lower[scheme_len + 1..].starts_with(|c: char| c.is_ascii_digit())
    {
        return refused("only http and https URLs are allowed");
    }
    None
}
