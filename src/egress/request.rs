//! Proxy request heads: reading one with a size cap, parsing it strictly, and rewriting a
//! forward request for the origin.
//!
//! Strict on purpose: bare CR or LF, obs-fold, whitespace before a colon, control characters,
//! ambiguous body framing and userinfo in the target are refused with 400, so the head the
//! origin receives is one the proxy has understood completely.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

use super::policy::{Host, parse_host, printable};

/// Why a request head was refused (the text goes into the 400 body and the record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadRequest(pub String);

fn bad(msg: impl Into<String>) -> BadRequest {
    BadRequest(msg.into())
}

/// Where the client wants to go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Destination {
    /// As the client wrote it (brackets kept for IPv6): for the record and the Host header.
    pub raw_host: String,
    pub host: Host,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    Connect,
    /// `authority` is the target's `host[:port]` as written; `path` is origin-form.
    Forward {
        authority: String,
        path: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    pub method: String,
    pub minor_version: u8,
    pub dest: Destination,
    pub kind: Kind,
    pub headers: Vec<(String, String)>,
    /// How the request body ends (for forwarded requests).
    pub body: Framing,
}

/// Request body framing (RFC 9112 §6.3, request side: no length means no body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    None,
    Length(u64),
    Chunked,
}

#[derive(Debug)]
pub(crate) enum ReadHeadError {
    /// EOF before any byte: a probe or an aborted client, not worth a record.
    ClosedEmpty,
    ClosedPartial,
    TooLarge,
    Io(io::Error),
}

/// Reads until the blank line ending the head. Returns the head (terminator included) and any
/// bytes the client already sent after it (a request body, or a TLS ClientHello after CONNECT).
pub(crate) async fn read_head<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<(Vec<u8>, Vec<u8>), ReadHeadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = r.read(&mut chunk).await.map_err(ReadHeadError::Io)?;
        if n == 0 {
            return Err(if buf.is_empty() {
                ReadHeadError::ClosedEmpty
            } else {
                ReadHeadError::ClosedPartial
            });
        }
        let search_from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = find(&buf[search_from..], b"\r\n\r\n") {
            let end = search_from + i + 4;
            if end > max {
                return Err(ReadHeadError::TooLarge);
            }
            let rest = buf.split_off(end);
            return Ok((buf, rest));
        }
        if buf.len() >= max {
            return Err(ReadHeadError::TooLarge);
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn is_tchar(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

/// The most header lines a request head may have.
const MAX_HEADERS: usize = 128;

/// Parses a complete head as returned by [`read_head`]: httparse reads its structure; the
/// strictness on top (no bare CR or LF, no obs-fold, one space between the request line's parts,
/// tokens and values checked again, unambiguous framing) is ours.
pub(crate) fn parse_head(head: &[u8]) -> Result<RequestHead, BadRequest> {
    let text = std::str::from_utf8(head).map_err(|_| bad("request head is not UTF-8"))?;
    let body = text
        .strip_suffix("\r\n\r\n")
        .ok_or_else(|| bad("incomplete request head"))?;
    // Every CR is followed by LF and every LF preceded by CR: no bare line breaks to disagree on.
    let bytes = body.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        let ok = match b {
            b'\r' => bytes.get(i + 1) == Some(&b'\n'),
            b'\n' => i > 0 && bytes[i - 1] == b'\r',
            _ => true,
        };
        if !ok {
            return Err(bad("bare CR or LF in request head"));
        }
    }
    // Obsolete line folding: httparse would report it as a malformed header name; it has a
    // name of its own here.
    if body.contains("\r\n ") || body.contains("\r\n\t") {
        return Err(bad("obsolete header line folding"));
    }
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    match req.parse(head) {
        Ok(httparse::Status::Complete(n)) if n == head.len() => {}
        Ok(_) => return Err(bad("incomplete request head")),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(bad(format!("more than {MAX_HEADERS} header lines")));
        }
        Err(httparse::Error::Version) => return Err(bad("unsupported HTTP version")),
        Err(httparse::Error::Token) => return Err(bad("malformed method")),
        Err(httparse::Error::HeaderName) => return Err(bad("malformed header name")),
        Err(httparse::Error::HeaderValue) => {
            return Err(bad("control character in a header value"));
        }
        Err(httparse::Error::NewLine) => return Err(bad("bare CR or LF in request head")),
        Err(_) => return Err(bad("malformed request line")),
    }
    let (Some(method), Some(target), Some(minor_version)) = (req.method, req.path, req.version)
    else {
        return Err(bad("malformed request line"));
    };
    // Exactly `METHOD SP target SP HTTP/1.x`: httparse takes several spaces between the parts.
    let request_line = body.split("\r\n").next().unwrap_or_default();
    if request_line.len() != method.len() + target.len() + 10 {
        return Err(bad("malformed request line"));
    }
    if method.is_empty() || method.len() > 32 || !method.chars().all(is_tchar) {
        return Err(bad("malformed method"));
    }
    if target.is_empty() || target.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(bad("malformed request target"));
    }

    let mut headers = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        if h.name.is_empty() || !h.name.chars().all(is_tchar) {
            return Err(bad("malformed header name"));
        }
        let value = std::str::from_utf8(h.value)
            .map_err(|_| bad("request head is not UTF-8"))?
            .trim_matches([' ', '\t']);
        if value.chars().any(|c| c.is_control() && c != '\t') {
            return Err(bad("control character in a header value"));
        }
        headers.push((h.name.to_string(), value.to_string()));
    }
    let body = check_framing(&headers)?;

    let (dest, kind) = if method == "CONNECT" {
        let (dest, _) = parse_authority(target, 443)?;
        (dest, Kind::Connect)
    } else {
        parse_absolute(target)?
    };
    Ok(RequestHead {
        method: method.to_string(),
        minor_version,
        dest,
        kind,
        headers,
        body,
    })
}

/// The body is relayed as the client framed it, so the framing must be unambiguous.
fn check_framing(headers: &[(String, String)]) -> Result<Framing, BadRequest> {
    let mut content_length: Option<&str> = None;
    let mut codings: Vec<String> = Vec::new();
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("content-length") {
            if value.is_empty() || value.len() > 18 || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad("malformed Content-Length"));
            }
            if content_length.is_some_and(|v| v != value) {
                return Err(bad("conflicting Content-Length headers"));
            }
            content_length = Some(value);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            codings.extend(
                value
                    .split(',')
                    .map(|c| c.trim().to_ascii_lowercase())
                    .filter(|c| !c.is_empty()),
            );
        }
    }
    match (content_length, codings.is_empty()) {
        (Some(_), false) => Err(bad("both Content-Length and Transfer-Encoding")),
        (Some(n), true) => n
            .parse()
            .map(Framing::Length)
            .map_err(|_| bad("malformed Content-Length")),
        (None, true) => Ok(Framing::None),
        (None, false) => {
            let chunked_last = codings.last().is_some_and(|c| c == "chunked");
            let chunked_once = codings.iter().filter(|c| *c == "chunked").count() == 1;
            if chunked_last && chunked_once {
                Ok(Framing::Chunked)
            } else {
                Err(bad("Transfer-Encoding must end in a single chunked"))
            }
        }
    }
}

/// Finds where a request body ends in the byte stream, without changing a byte. Bytes after
/// the end (a pipelined or smuggled second request) are never relayed.
pub(crate) struct BodyScanner {
    state: Scan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    Remaining(u64),
    /// Reading a chunk-size line; `ext` once past the hex digits.
    Size {
        size: u64,
        digits: u8,
        ext: bool,
        line: usize,
    },
    SizeLf {
        size: u64,
    },
    Data(u64),
    DataCr,
    DataLf,
    /// Trailer section: `line` bytes into the current field line.
    Trailer {
        line: usize,
        total: usize,
    },
    TrailerLf {
        line: usize,
        total: usize,
    },
    Done,
}

const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILER: usize = 16 * 1024;

impl BodyScanner {
    pub(crate) fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::None | Framing::Length(0) => Scan::Done,
            Framing::Length(n) => Scan::Remaining(n),
            Framing::Chunked => Scan::Size {
                size: 0,
                digits: 0,
                ext: false,
                line: 0,
            },
        };
        BodyScanner { state }
    }

    pub(crate) fn done(&self) -> bool {
        self.state == Scan::Done
    }

    /// How many leading bytes of `data` belong to the body.
    pub(crate) fn scan(&mut self, data: &[u8]) -> Result<usize, &'static str> {
        let mut i = 0;
        while i < data.len() {
            let b = data[i];
            self.state = match self.state {
                Scan::Done => return Ok(i),
                Scan::Remaining(n) | Scan::Data(n) => {
                    let take = n.min((data.len() - i) as u64);
                    i += take as usize;
                    let left = n - take;
                    self.state = match (self.state, left) {
                        (Scan::Remaining(_), 0) => Scan::Done,
                        (Scan::Remaining(_), l) => Scan::Remaining(l),
                        (_, 0) => Scan::DataCr,
                        (_, l) => Scan::Data(l),
                    };
                    continue;
                }
                Scan::Size {
                    size,
                    digits,
                    ext,
                    line,
                } => {
                    if line >= MAX_CHUNK_LINE {
                        return Err("chunk-size line too long");
                    }
                    let line = line + 1;
                    match b {
                        b'\r' if digits > 0 => Scan::SizeLf { size },
                        _ if ext => {
                            if b.is_ascii_control() && b != b'\t' {
                                return Err("control character in a chunk extension");
                            }
                            Scan::Size {
                                size,
                                digits,
                                ext,
                                line,
                            }
                        }
                        b';' | b' ' | b'\t' if digits > 0 => Scan::Size {
                            size,
                            digits,
                            ext: true,
                            line,
                        },
                        _ if b.is_ascii_hexdigit() => {
                            if digits >= 15 {
                                return Err("chunk size too large");
                            }
                            let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                            Scan::Size {
                                size: size * 16 + d,
                                digits: digits + 1,
                                ext,
                                line,
                            }
                        }
                        _ => return Err("malformed chunk size"),
                    }
                }
                Scan::SizeLf { size } => match (b, size) {
                    (b'\n', 0) => Scan::Trailer { line: 0, total: 0 },
                    (b'\n', n) => Scan::Data(n),
                    _ => return Err("bare CR in a chunk-size line"),
                },
                Scan::DataCr if b == b'\r' => Scan::DataLf,
                Scan::DataLf if b == b'\n' => Scan::Size {
                    size: 0,
                    digits: 0,
                    ext: false,
                    line: 0,
                },
                Scan::DataCr | Scan::DataLf => return Err("chunk data not followed by CRLF"),
                Scan::Trailer { line, total } => {
                    if total >= MAX_TRAILER {
                        return Err("trailer section too large");
                    }
                    match b {
                        b'\r' => Scan::TrailerLf { line, total },
                        b'\n' => return Err("bare LF in the trailer section"),
                        _ => Scan::Trailer {
                            line: line + 1,
                            total: total + 1,
                        },
                    }
                }
                Scan::TrailerLf { line, total } => match (b, line) {
                    (b'\n', 0) => Scan::Done,
                    (b'\n', _) => Scan::Trailer {
                        line: 0,
                        total: total + 2,
                    },
                    _ => return Err("bare CR in the trailer section"),
                },
            };
            i += 1;
        }
        Ok(i)
    }
}

/// `host[:port]` or `[v6][:port]`. Returns the destination and the authority as written.
fn parse_authority(s: &str, default_port: u16) -> Result<(Destination, String), BadRequest> {
    if s.contains('@') {
        return Err(bad("userinfo in the request target is not allowed"));
    }
    let (host, port) = if s.starts_with('[') {
        let close = s
            .find(']')
            .ok_or_else(|| bad("unterminated IPv6 literal"))?;
        let rest = &s[close + 1..];
        let port = match rest {
            "" => None,
            r => Some(
                r.strip_prefix(':')
                    .ok_or_else(|| bad("junk after IPv6 literal"))?,
            ),
        };
        (&s[..=close], port)
    } else {
        match s.split_once(':') {
            Some((_, p)) if p.contains(':') => {
                return Err(bad("IPv6 literal must be in brackets"));
            }
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = match port {
        None | Some("") => default_port,
        Some(p) if p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) => {
            match p.parse::<u16>() {
                Ok(0) | Err(_) => return Err(bad(format!("invalid port '{}'", printable(p, 80)))),
                Ok(n) => n,
            }
        }
        Some(p) => return Err(bad(format!("invalid port '{}'", printable(p, 80)))),
    };
    let parsed = parse_host(host).map_err(BadRequest)?;
    Ok((
        Destination {
            raw_host: host.to_string(),
            host: parsed,
            port,
        },
        s.to_string(),
    ))
}

/// `http://authority[/path][?query][#fragment]`.
fn parse_absolute(target: &str) -> Result<(Destination, Kind), BadRequest> {
    let Some((scheme, rest)) = target.split_once("://") else {
        return Err(bad("a proxy request needs an absolute http:// target"));
    };
    if scheme.eq_ignore_ascii_case("https") {
        return Err(bad("https:// targets must use CONNECT"));
    }
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(bad(format!(
            "unsupported scheme '{}'",
            printable(scheme, 80)
        )));
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let tail = tail.split('#').next().unwrap_or_default();
    let path = if tail.starts_with('/') {
        tail.to_string()
    } else {
        format!("/{tail}")
    };
    let (dest, authority) = parse_authority(authority, 80)?;
    Ok((dest, Kind::Forward { authority, path }))
}

/// Headers that describe the client-proxy hop, never forwarded.
const HOP_BY_HOP: [&str; 5] = ["connection", "keep-alive", "te", "trailer", "upgrade"];

impl RequestHead {
    /// The head sent to the origin: origin-form target, `Host` from the target, no `Proxy-*`
    /// (nor httpoxy's `Proxy`) and no hop-by-hop headers, `Connection: close`. `Content-Length`
    /// and `Transfer-Encoding` stay: the body is relayed byte for byte, as the client framed it.
    /// `None` for CONNECT.
    pub(crate) fn origin_head(&self) -> Option<Vec<u8>> {
        let Kind::Forward { authority, path } = &self.kind else {
            return None;
        };
        let named_by_connection: Vec<String> = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("connection"))
            .flat_map(|(_, v)| v.split(','))
            .map(|t| t.trim().to_ascii_lowercase())
            .filter(|t| t != "content-length" && t != "transfer-encoding")
            .collect();
        let mut out = format!(
            "{} {} HTTP/1.{}\r\nHost: {}\r\n",
            self.method, path, self.minor_version, authority
        );
        for (name, value) in &self.headers {
            let lower = name.to_ascii_lowercase();
            let drop = lower == "host"
                || lower == "proxy"
                || lower.starts_with("proxy-")
                || HOP_BY_HOP.contains(&lower.as_str())
                || named_by_connection.contains(&lower);
            if !drop {
                out.push_str(name);
                out.push_str(": ");
                out.push_str(value);
                out.push_str("\r\n");
            }
        }
        out.push_str("Connection: close\r\n\r\n");
        Some(out.into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn parse(s: &str) -> Result<RequestHead, BadRequest> {
        parse_head(s.as_bytes())
    }

    fn ip(s: &str) -> Host {
        Host::Ip(s.parse::<IpAddr>().unwrap())
    }

    #[test]
    fn connect_targets() {
        let r = parse("CONNECT [::1]:443 HTTP/1.1\r\nHost: [::1]:443\r\n\r\n").unwrap();
        assert_eq!(r.kind, Kind::Connect);
        assert_eq!(
            r.dest,
            Destination {
                raw_host: "[::1]".into(),
                host: ip("::1"),
                port: 443
            }
        );
        let r = parse("CONNECT example.com HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(
            (r.dest.port, r.dest.host),
            (443, Host::Name("example.com".into()))
        );
        let r = parse("CONNECT Example.COM:8443 HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!(
            (r.dest.port, r.minor_version, r.dest.raw_host.as_str()),
            (8443, 0, "Example.COM")
        );
        let r = parse("CONNECT 0xa9fea9fe:80 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(r.dest.host, ip("169.254.169.254"));
        let r = parse("CONNECT [::ffff:127.0.0.1]:22 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(r.dest.host, ip("::ffff:127.0.0.1"));
        for bad in [
            "CONNECT ::1:443 HTTP/1.1\r\n\r\n",
            "CONNECT [::1:443 HTTP/1.1\r\n\r\n",
            "CONNECT [::1]x443 HTTP/1.1\r\n\r\n",
            "CONNECT host:0 HTTP/1.1\r\n\r\n",
            "CONNECT host:65536 HTTP/1.1\r\n\r\n",
            "CONNECT host:-1 HTTP/1.1\r\n\r\n",
            "CONNECT user@host:443 HTTP/1.1\r\n\r\n",
            "CONNECT :443 HTTP/1.1\r\n\r\n",
            "CONNECT 1.2.3.4.5:443 HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn absolute_form_targets() {
        let r = parse("GET http://Example.com/a/b?c=d#frag HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(r.dest.port, 80);
        assert_eq!(
            r.kind,
            Kind::Forward {
                authority: "Example.com".into(),
                path: "/a/b?c=d".into()
            }
        );
        let r = parse("POST HTTP://[2001:db8::1]:8080?q HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(
            (r.dest.port, r.dest.host.clone()),
            (8080, ip("2001:db8::1"))
        );
        assert_eq!(
            r.kind,
            Kind::Forward {
                authority: "[2001:db8::1]:8080".into(),
                path: "/?q".into()
            }
        );
        let r = parse("GET http://h.test HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(
            r.kind,
            Kind::Forward {
                authority: "h.test".into(),
                path: "/".into()
            }
        );
        let e = parse("GET https://example.com/ HTTP/1.1\r\n\r\n").unwrap_err();
        assert!(e.0.contains("CONNECT"), "{e:?}");
        for bad in [
            "GET /index.html HTTP/1.1\r\nHost: example.com\r\n\r\n",
            "GET ftp://example.com/ HTTP/1.1\r\n\r\n",
            "GET http://user:pw@example.com/ HTTP/1.1\r\n\r\n",
            "GET http://allowed.test@evil.test/ HTTP/1.1\r\n\r\n",
            "GET http:///path HTTP/1.1\r\n\r\n",
            "GET http://exa%6Dple.com/ HTTP/1.1\r\n\r\n",
            "OPTIONS * HTTP/1.1\r\n\r\n",
            "connect example.com:443 HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn garbage_and_smuggling_shapes_are_refused() {
        for bad in [
            "",
            "\r\n\r\n",
            "hello\r\n\r\n",
            "GET http://a.test/ HTTP/2.0\r\n\r\n",
            "GET http://a.test/ HTTP/1.1 extra\r\n\r\n",
            "GET  http://a.test/ HTTP/1.1\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\nHost: a\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\r\nHost: a\rX: b\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\r\nHost : a\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\r\nNoColon\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\r\nX: a\x00b\r\n\r\n",
            "POST http://a.test/ HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST http://a.test/ HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "POST http://a.test/ HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
            "GET http://a.test/ HTTP/1.1\r\n",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(parse_head(b"GET http://a.test/ HTTP/1.1\r\nX: \xff\r\n\r\n").is_err());
        let ok =
            parse("POST http://a.test/ HTTP/1.1\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n");
        assert!(ok.is_ok(), "identical duplicates are fine");
    }

    #[test]
    fn origin_head_rewrites_for_the_origin() {
        let r = parse(
            "GET http://Origin.test:8080/p?q=1 HTTP/1.1\r\n\
             Host: evil.test\r\n\
             User-Agent: curl/8\r\n\
             Proxy-Authorization: Basic eA==\r\n\
             Proxy-Connection: Keep-Alive\r\n\
             Proxy: http://evil.test\r\n\
             Connection: keep-alive, X-Secret, Content-Length\r\n\
             Keep-Alive: timeout=5\r\n\
             X-Secret: s\r\n\
             TE: trailers\r\n\
             Upgrade: websocket\r\n\
             Content-Length: 0\r\n\
             Accept: */*\r\n\r\n",
        )
        .unwrap();
        let head = String::from_utf8(r.origin_head().unwrap()).unwrap();
        assert_eq!(
            head,
            "GET /p?q=1 HTTP/1.1\r\nHost: Origin.test:8080\r\nUser-Agent: curl/8\r\n\
             Content-Length: 0\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        let c = parse("CONNECT a.test:443 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(c.origin_head(), None);
    }

    #[test]
    fn framing_from_headers() {
        let f =
            |h: &str| parse(&format!("POST http://a.test/ HTTP/1.1\r\n{h}\r\n")).map(|r| r.body);
        assert_eq!(f(""), Ok(Framing::None));
        assert_eq!(f("Content-Length: 12\r\n"), Ok(Framing::Length(12)));
        assert_eq!(f("Transfer-Encoding: chunked\r\n"), Ok(Framing::Chunked));
        assert_eq!(
            f("Transfer-Encoding: gzip, Chunked\r\n"),
            Ok(Framing::Chunked)
        );
        assert_eq!(
            f("Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n"),
            Ok(Framing::Chunked)
        );
        for bad in [
            "Transfer-Encoding: chunked, gzip\r\n",
            "Transfer-Encoding: chunked, chunked\r\n",
            "Transfer-Encoding: identity\r\n",
            "Content-Length: 99999999999999999999\r\n",
        ] {
            assert!(f(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn body_scanner_finds_the_end_of_the_body() {
        let mut s = BodyScanner::new(Framing::Length(5));
        assert_eq!(s.scan(b"abc"), Ok(3));
        assert_eq!(s.scan(b"deGET http://evil.test/"), Ok(2));
        assert!(s.done());
        assert!(BodyScanner::new(Framing::None).done());

        let body =
            b"4;ext=1\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nX-T: 1\r\n\r\n";
        let smuggled = b"GET http://evil.test/ HTTP/1.1\r\n\r\n";
        let stream = [&body[..], &smuggled[..]].concat();
        // Whole, and one byte at a time: the end is found at the same place.
        let mut s = BodyScanner::new(Framing::Chunked);
        assert_eq!(s.scan(&stream), Ok(body.len()));
        assert!(s.done());
        let mut s = BodyScanner::new(Framing::Chunked);
        let mut taken = 0;
        for b in &stream {
            taken += s.scan(std::slice::from_ref(b)).unwrap();
        }
        assert_eq!(taken, body.len());

        let mut s = BodyScanner::new(Framing::Chunked);
        assert_eq!(s.scan(b"0\r\n\r\nrest"), Ok(5));
        for bad in [
            &b"x\r\n"[..],
            b"\r\n",
            b"4\r\nWikiXX",
            b"4\nWiki",
            b"10000000000000000\r\n",
            b"0\r\nX: 1\n\n",
            b"-1\r\n",
        ] {
            let mut s = BodyScanner::new(Framing::Chunked);
            assert!(s.scan(bad).is_err(), "{bad:?}");
        }
        let mut s = BodyScanner::new(Framing::Chunked);
        assert!(s.scan(&[b'1'; 20]).is_err());
        let mut s = BodyScanner::new(Framing::Chunked);
        let long_ext = [&b"1;"[..], &[b'a'; 5000][..]].concat();
        assert!(s.scan(&long_ext).is_err());
    }

    #[tokio::test]
    async fn read_head_caps_size_and_keeps_leftover() {
        let mut input: &[u8] = b"CONNECT a.test:443 HTTP/1.1\r\n\r\n\x16\x03\x01hello";
        let (head, rest) = read_head(&mut input, 16 * 1024).await.ok().unwrap();
        assert!(head.ends_with(b"\r\n\r\n"));
        assert_eq!(rest, b"\x16\x03\x01hello");

        let big = format!(
            "GET http://a.test/ HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(20_000)
        );
        let mut input = big.as_bytes();
        assert!(matches!(
            read_head(&mut input, 16 * 1024).await,
            Err(ReadHeadError::TooLarge)
        ));
        let mut endless: &[u8] = &[b'a'; 40_000];
        assert!(matches!(
            read_head(&mut endless, 16 * 1024).await,
            Err(ReadHeadError::TooLarge)
        ));
        let mut empty: &[u8] = b"";
        assert!(matches!(
            read_head(&mut empty, 16 * 1024).await,
            Err(ReadHeadError::ClosedEmpty)
        ));
        let mut partial: &[u8] = b"GET http://a";
        assert!(matches!(
            read_head(&mut partial, 16 * 1024).await,
            Err(ReadHeadError::ClosedPartial)
        ));
    }
}
