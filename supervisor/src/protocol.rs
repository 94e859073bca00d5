//! The wire protocol between the daemon and the in-container supervisor, the one definition both
//! sides compile: the daemon encodes requests and decodes frames with it, the supervisor decodes
//! requests and encodes frames with it.
//!
//! Requests (daemon -> supervisor stdin):
//!
//! ```text
//! run:   "EAR1" u32be(len) NUL-joined(argc, argv.., envc, "K=V".., stdin_len|-1, relay_port|0,
//!        relay_socket, timeout_ms, code_path|"", code_len|-1, cwd|""[, tcp_rules, tcp_socket
//!        [, stream]])
//!        stdin-bytes code-bytes
//!        tcp_rules: comma-joined [`TcpRoute`]s, present only when there are any (or a stream)
//!        stream: "1" when the command's stdin stays open for control frames after stdin-bytes
//! control (during a run, after its request): `type(1) u32be(len) payload`, see [`control`]:
//!        `i` bytes for the command's stdin, `c` its end, `s` a signal's number (decimal),
//!        `w` a terminal's size ("COLS ROWS", decimal; only the supervisor's `pty` mode reads it)
//! file:  "EARF" u32be(len) NUL-joined(op, path, n)  [n bytes for put]
//!        op: put (n = length), get (n = most bytes), list, dir (is it a directory),
//!            tarout (a tar of the directory, as `o` frames), tarin (n = 0 upload, 1 restore)
//! tarin's archive follows its header in chunks: (u32be(len) bytes)* u32be(0); then, if the
//! supervisor answered `r staged MEMBERS`, u32be(COMMIT|DROP) and its final `r`. An `r err` may
//! come before the archive has all arrived: the daemon then ends it with u32be(0) at once.
//! ```
//!
//! Frames (supervisor stdout -> daemon): `type(1) u32be(len) payload`; see [`kind`].
//!
//! Raw TCP (supervisor -> daemon, on the run's `tcp_socket`): each relayed connection starts with
//! one line naming the destination the command asked for ([`tcp_preamble`]), then its bytes.
//!
//! Pure: no I/O, no allocation beyond what a decoded value holds, never panics on any input
//! (fuzzed by the daemon's `supervisor_protocol` target).

/// Magic of a run request.
pub const RUN_MAGIC: &[u8; 4] = b"EAR1";
/// The byte a supervisor in `connect` mode writes once it is connected to its port.
pub const PORT_CONNECTED: u8 = 0x06;
/// Magic of a file request (kept sandboxes only).
pub const FILE_MAGIC: &[u8; 4] = b"EARF";
/// Magic of a scrub request (a kept PID 1 between two one-shot runs of a reused container): the
/// request is the magic alone; the verdict is a `Result("ok")` or a `Failed` frame.
pub const SCRUB_MAGIC: &[u8; 4] = b"EARS";

/// Most payload bytes the supervisor puts in one output frame.
pub const CHUNK: usize = 64 * 1024;

/// Largest frame payload a decoder accepts; the supervisor writes at most [`CHUNK`] per frame,
/// so anything bigger is a corrupted stream (and must not make the reader buffer it).
pub const MAX_FRAME: usize = 256 * 1024;

/// Frame types.
pub mod kind {
    /// The command's stdout; to a file request: its data.
    pub const STDOUT: u8 = b'o';
    /// The command's stderr.
    pub const STDERR: u8 = b'e';
    /// The final report of a run: [`super::ExitReport`] (last frame).
    pub const EXIT: u8 = b'x';
    /// The request could not run (setup failure; last frame).
    pub const FAILED: u8 = b'f';
    /// The request could not run because no process could be forked for it: the sandbox's
    /// pids limit is reached, its other processes hold every pid (last frame).
    pub const NO_PIDS: u8 = b'p';
    /// The egress relay cannot reach the daemon's proxy (last frame).
    pub const UNAVAILABLE: u8 = b'u';
    /// The supervisor ended the run at its own deadline (last frame).
    pub const DEADLINE: u8 = b't';
    /// A file request's verdict: `ok` | `err CODE SIZE MESSAGE` (last frame).
    pub const RESULT: u8 = b'r';

    /// Every type a decoder accepts.
    pub const ALL: [u8; 8] = [
        STDOUT,
        STDERR,
        EXIT,
        FAILED,
        NO_PIDS,
        UNAVAILABLE,
        DEADLINE,
        RESULT,
    ];
}

/// Control frame types: what the daemon sends a running command, on the supervisor's stdin after
/// the run's request (any number of them, until the run's last frame). The supervisor acts on
/// them while the run lasts and drops any that arrive after it.
pub mod control {
    /// Bytes for the command's stdin (at most [`super::CHUNK`] each).
    pub const STDIN: u8 = b'i';
    /// The end of the command's stdin (no payload).
    pub const CLOSE_STDIN: u8 = b'c';
    /// A signal's number, in decimal: to the command's process; SIGKILL ends every process of
    /// the run.
    pub const SIGNAL: u8 = b's';
    /// A terminal's new size, `COLS ROWS` in decimal (each 1..=[`super::MAX_TERMINAL_SIDE`]):
    /// read by the supervisor's `pty` mode from its own stdin; a run's supervisor ignores it.
    pub const RESIZE: u8 = b'w';

    /// Every type a decoder accepts.
    pub const ALL: [u8; 4] = [STDIN, CLOSE_STDIN, SIGNAL, RESIZE];

    /// The signals a control may carry (TERM, KILL, INT, HUP); the supervisor ignores others.
    pub const SIGNALS: [i32; 4] = [15, 9, 2, 1];
}

/// Largest number of columns or rows a terminal may be given.
pub const MAX_TERMINAL_SIDE: u16 = 4096;

/// One control of a running command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlFrame {
    Stdin(Vec<u8>),
    CloseStdin,
    Signal(i32),
    /// A terminal's size (`pty` mode).
    Resize {
        cols: u16,
        rows: u16,
    },
}

impl ControlFrame {
    /// The frames of this control: stdin bytes are cut into [`CHUNK`]-sized frames.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ControlFrame::Stdin(b) if b.is_empty() => encode_frame(control::STDIN, &[]),
            ControlFrame::Stdin(b) => {
                let mut out = Vec::with_capacity(b.len() + 5 * (b.len() / CHUNK + 1));
                for piece in b.chunks(CHUNK) {
                    out.extend_from_slice(&encode_frame(control::STDIN, piece));
                }
                out
            }
            ControlFrame::CloseStdin => encode_frame(control::CLOSE_STDIN, &[]),
            ControlFrame::Signal(n) => encode_frame(control::SIGNAL, n.to_string().as_bytes()),
            ControlFrame::Resize { cols, rows } => {
                encode_frame(control::RESIZE, format!("{cols} {rows}").as_bytes())
            }
        }
    }
}

/// Incremental decoder of control frames (they may arrive split anywhere).
#[derive(Debug, Default)]
pub struct ControlDecoder {
    buf: Vec<u8>,
}

impl ControlDecoder {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// How many more bytes the frame begun in the buffer needs before the decoder knows more:
    /// 0 when the buffer holds only whole frames (a reader that stops at a run's end reads
    /// exactly these, so the stream stays in step).
    pub fn missing(&self) -> usize {
        match self.buf.len() {
            0 => 0,
            n if n < 5 => 5 - n,
            n => {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
                (5 + len as usize).saturating_sub(n)
            }
        }
    }

    /// The next complete control; `Err` on a corrupted stream (unknown type, a payload over
    /// [`CHUNK`], a malformed signal or close).
    pub fn next_control(&mut self) -> Result<Option<ControlFrame>, String> {
        let Some(h) = self.buf.get(..5) else {
            return Ok(None);
        };
        let kind = h[0];
        let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
        if !control::ALL.contains(&kind) {
            return Err(format!("unknown control frame type {kind:#x}"));
        }
        if len > CHUNK {
            return Err(format!("control frame of {len} bytes"));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let payload: Vec<u8> = self.buf.drain(..5 + len).skip(5).collect();
        match kind {
            control::STDIN => Ok(Some(ControlFrame::Stdin(payload))),
            control::CLOSE_STDIN if payload.is_empty() => Ok(Some(ControlFrame::CloseStdin)),
            control::SIGNAL => std::str::from_utf8(&payload)
                .ok()
                .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) && t.len() <= 3)
                .and_then(|t| t.parse().ok())
                .map(|n| Some(ControlFrame::Signal(n)))
                .ok_or_else(|| "malformed signal control".to_string()),
            control::RESIZE => parse_size(&payload)
                .map(|(cols, rows)| Some(ControlFrame::Resize { cols, rows }))
                .ok_or_else(|| "malformed resize control".to_string()),
            _ => Err("malformed close control".into()),
        }
    }
}

/// `COLS ROWS`: two decimal numbers of at most 4 digits, each in 1..=[`MAX_TERMINAL_SIDE`].
fn parse_size(payload: &[u8]) -> Option<(u16, u16)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (c, r) = text.split_once(' ')?;
    let side = |t: &str| {
        (!t.is_empty() && t.len() <= 4 && t.bytes().all(|b| b.is_ascii_digit()))
            .then(|| t.parse::<u16>().ok())
            .flatten()
            .filter(|n| (1..=MAX_TERMINAL_SIDE).contains(n))
    };
    Some((side(c)?, side(r)?))
}

/// The 5-byte header of a frame of `len` payload bytes.
pub fn frame_header(kind: u8, len: usize) -> [u8; 5] {
    let n = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    [kind, n[0], n[1], n[2], n[3]]
}

/// A whole frame.
pub fn encode_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.extend_from_slice(&frame_header(kind, payload.len()));
    out.extend_from_slice(payload);
    out
}

/// The type and payload length of the frame at the start of `buf`: `Ok(None)` until its header
/// is complete; `Err` on a corrupted stream (an unknown type, a payload over [`MAX_FRAME`]).
pub fn parse_frame_header(buf: &[u8]) -> Result<Option<(u8, usize)>, String> {
    let Some(h) = buf.get(..5) else {
        return Ok(None);
    };
    let kind = h[0];
    let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
    if len > MAX_FRAME {
        return Err(format!("supervisor frame of {len} bytes"));
    }
    if !kind::ALL.contains(&kind) {
        return Err(format!("unknown supervisor frame type {kind:#x}"));
    }
    Ok(Some((kind, len)))
}

/// How the command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

/// The final report of a run (an `x` frame): `exit|signal N broken peak_kib oom_kills pids_max`,
/// `-` for a number that is not visible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    pub status: Status,
    /// Stdin bytes were left when the command stopped reading.
    pub stdin_broken_pipe: bool,
    pub peak_memory_kib: Option<u64>,
    /// OOM kills the container's cgroup counted (None: not visible, e.g. under gVisor).
    pub oom_kills: Option<u64>,
    /// Times the pids limit refused a fork (None: not visible).
    pub pids_max_hits: Option<u64>,
}

impl ExitReport {
    pub fn to_payload(&self) -> String {
        let (how, n) = match self.status {
            Status::Exited(n) => ("exit", n),
            Status::Signaled(n) => ("signal", n),
        };
        let num = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        format!(
            "{how} {n} {} {} {} {}",
            u8::from(self.stdin_broken_pipe),
            num(self.peak_memory_kib),
            num(self.oom_kills),
            num(self.pids_max_hits)
        )
    }

    /// `None` unless `payload` starts with `exit N` or `signal N` and a broken-pipe flag.
    pub fn parse(payload: &[u8]) -> Option<ExitReport> {
        let text = std::str::from_utf8(payload).ok()?;
        let mut it = text.split(' ');
        let how = it.next()?;
        let n: i32 = it.next()?.parse().ok()?;
        let status = match how {
            "exit" => Status::Exited(n),
            "signal" => Status::Signaled(n),
            _ => return None,
        };
        let stdin_broken_pipe = it.next()? == "1";
        let num = |s: Option<&str>| s.and_then(|v| v.parse::<u64>().ok());
        Some(ExitReport {
            status,
            stdin_broken_pipe,
            peak_memory_kib: num(it.next()),
            oom_kills: num(it.next()),
            pids_max_hits: num(it.next()),
        })
    }
}

/// The header of a run request (what follows the magic and the length); the stdin and code
/// bytes follow it on the stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunHeader {
    /// argv[0] is executed as given (an absolute path), never through a shell.
    pub argv: Vec<String>,
    /// The command's whole environment, `K=V` each.
    pub env: Vec<String>,
    /// Bytes of stdin that follow the header (None: the command gets /dev/null).
    pub stdin_len: Option<u64>,
    /// Egress relay: loopback port inside the container (0: none) and the daemon's proxy socket.
    pub relay_port: u16,
    pub relay_socket: String,
    /// 0: missing (the supervisor refuses the request).
    pub timeout_ms: u64,
    /// Kept sandboxes: where the exec's code goes ("" when none), and its length, after stdin.
    pub code_path: String,
    pub code_len: Option<u64>,
    /// Where the command starts ("": the workdir).
    pub cwd: String,
    /// Raw TCP rules (none: no raw TCP): the supervisor makes their ranges local in the
    /// container's network namespace, listens on their ports and relays each connection to the
    /// daemon's socket `tcp_socket`.
    pub tcp_rules: Vec<TcpRoute>,
    pub tcp_socket: String,
    /// The command's stdin stays open after the request's stdin bytes: control frames follow
    /// the request while the run lasts (see [`control`]).
    pub stdin_stream: bool,
}

/// One raw TCP rule: every address of `addr/prefix`, port `port`. Written `10.20.0.0/16:5432`,
/// IPv6 in brackets `[2001:db8::/32]:22`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TcpRoute {
    pub addr: std::net::IpAddr,
    pub prefix: u8,
    pub port: u16,
}

impl TcpRoute {
    /// Strict: a CIDR with its prefix length and a port, IPv6 (and only IPv6) in brackets,
    /// addresses in their standard text form, no spaces, no leading `+`, port 1-65535. Host bits
    /// below the prefix are the daemon's to judge (its profiles refuse them).
    pub fn parse(s: &str) -> Result<TcpRoute, String> {
        let bad = |why: &str| format!("'{}' is not a tcp rule: {why}", s.escape_debug());
        let digits = |t: &str, max: usize| {
            !t.is_empty() && t.len() <= max && t.bytes().all(|b| b.is_ascii_digit())
        };
        let (cidr, port, bracketed) = match s.strip_prefix('[') {
            Some(rest) => {
                let (cidr, port) = rest
                    .split_once("]:")
                    .ok_or_else(|| bad("expected [ADDRESS/PREFIX]:PORT"))?;
                (cidr, port, true)
            }
            None => {
                let (cidr, port) = s
                    .rsplit_once(':')
                    .ok_or_else(|| bad("expected ADDRESS/PREFIX:PORT"))?;
                (cidr, port, false)
            }
        };
        let (addr, prefix) = cidr
            .split_once('/')
            .ok_or_else(|| bad("the range needs a prefix length (ADDRESS/PREFIX)"))?;
        let addr: std::net::IpAddr = addr.parse().map_err(|_| bad("not an IP address"))?;
        match (addr, bracketed) {
            (std::net::IpAddr::V4(_), true) => {
                return Err(bad("an IPv4 range is written without brackets"));
            }
            (std::net::IpAddr::V6(_), false) => {
                return Err(bad(
                    "an IPv6 range is written in brackets: [ADDRESS/PREFIX]:PORT",
                ));
            }
            _ => {}
        }
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if !digits(prefix, 3) {
            return Err(bad("the prefix length is not a number"));
        }
        let prefix: u8 = prefix
            .parse()
            .map_err(|_| bad("the prefix length is not a number"))?;
        if prefix > max {
            return Err(bad("the prefix length is too long"));
        }
        if !digits(port, 5) {
            return Err(bad("the port is not a number"));
        }
        let port: u16 = port.parse().map_err(|_| bad("the port is out of range"))?;
        if port == 0 {
            return Err(bad("port 0"));
        }
        Ok(TcpRoute { addr, prefix, port })
    }
}

impl std::fmt::Display for TcpRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            std::net::IpAddr::V4(a) => write!(f, "{a}/{}:{}", self.prefix, self.port),
            std::net::IpAddr::V6(a) => write!(f, "[{a}/{}]:{}", self.prefix, self.port),
        }
    }
}

/// Magic of a raw TCP connection's first line.
const TCP_MAGIC: &str = "EAT1 ";
/// The longest first line a reader accepts, newline included.
pub const TCP_PREAMBLE_MAX: usize = 64;

/// The first line of a relayed raw TCP connection: `EAT1 <destination>\n`.
pub fn tcp_preamble(dest: std::net::SocketAddr) -> Vec<u8> {
    format!("{TCP_MAGIC}{dest}\n").into_bytes()
}

/// The destination of [`tcp_preamble`]'s line (without its newline). Nothing in it is trusted:
/// the reader checks the destination as if it had never seen it.
pub fn parse_tcp_preamble(line: &[u8]) -> Result<std::net::SocketAddr, String> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|l| l.strip_prefix(TCP_MAGIC))
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| "malformed raw TCP preamble".to_string())
}

fn length_field(v: Option<u64>) -> String {
    v.map_or_else(|| "-1".to_string(), |n| n.to_string())
}

/// A field holding a length or -1 (missing: -1).
fn parse_length(field: Option<&str>, what: &str) -> Result<Option<u64>, String> {
    match field {
        None | Some("-1") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| format!("malformed request: {what} {s:?}")),
    }
}

fn parse_count(field: Option<&str>, what: &str) -> Result<usize, String> {
    match field {
        None | Some("") => Ok(0),
        Some(s) => s
            .parse()
            .map_err(|_| format!("malformed request: {what} {s:?}")),
    }
}

fn joined(fields: &[&str]) -> Result<String, String> {
    if fields.iter().any(|f| f.contains('\0')) {
        return Err("NUL byte in argument or environment".into());
    }
    Ok(fields.join("\0"))
}

fn with_magic(magic: &[u8; 4], header: &str, tail: &[&[u8]]) -> Result<Vec<u8>, String> {
    let len = u32::try_from(header.len()).map_err(|_| "request too large".to_string())?;
    let mut out =
        Vec::with_capacity(8 + header.len() + tail.iter().map(|t| t.len()).sum::<usize>());
    out.extend_from_slice(magic);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(header.as_bytes());
    for t in tail {
        out.extend_from_slice(t);
    }
    Ok(out)
}

impl RunHeader {
    /// The whole request: magic, length, header, then `stdin` and `code` (their lengths must be
    /// the header's).
    pub fn encode(&self, stdin: &[u8], code: &[u8]) -> Result<Vec<u8>, String> {
        if self.stdin_len.unwrap_or(0) != stdin.len() as u64
            || self.code_len.unwrap_or(0) != code.len() as u64
        {
            return Err("request lengths do not match its data".into());
        }
        let (argc, envc) = (self.argv.len().to_string(), self.env.len().to_string());
        let (stdin_len, code_len) = (length_field(self.stdin_len), length_field(self.code_len));
        let (port, timeout) = (self.relay_port.to_string(), self.timeout_ms.to_string());
        let mut fields: Vec<&str> = vec![&argc];
        fields.extend(self.argv.iter().map(String::as_str));
        fields.push(&envc);
        fields.extend(self.env.iter().map(String::as_str));
        fields.extend([
            stdin_len.as_str(),
            &port,
            &self.relay_socket,
            &timeout,
            &self.code_path,
            &code_len,
            &self.cwd,
        ]);
        let tcp = self
            .tcp_rules
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        if !self.tcp_rules.is_empty() || !self.tcp_socket.is_empty() || self.stdin_stream {
            fields.extend([tcp.as_str(), &self.tcp_socket]);
        }
        if self.stdin_stream {
            fields.push("1");
        }
        with_magic(RUN_MAGIC, &joined(&fields)?, &[stdin, code])
    }

    /// The header's bytes (after the magic and the length). Missing trailing fields take their
    /// "none" value (a missing timeout reads as 0, which the supervisor refuses).
    pub fn decode(header: &[u8]) -> Result<RunHeader, String> {
        let text =
            std::str::from_utf8(header).map_err(|_| "malformed request: not UTF-8".to_string())?;
        let mut f = text.split('\0');
        let argc = parse_count(f.next(), "argc")?;
        let argv: Vec<String> = f.by_ref().take(argc).map(str::to_string).collect();
        if argv.len() != argc {
            return Err("malformed request: argv shorter than argc".into());
        }
        let envc = parse_count(f.next(), "envc")?;
        let env: Vec<String> = f.by_ref().take(envc).map(str::to_string).collect();
        if env.len() != envc {
            return Err("malformed request: env shorter than envc".into());
        }
        let stdin_len = parse_length(f.next(), "stdin length")?;
        let relay_port = match f.next() {
            None | Some("") => 0,
            Some(s) => s
                .parse()
                .map_err(|_| format!("malformed request: relay port {s:?}"))?,
        };
        let relay_socket = f.next().unwrap_or_default().to_string();
        let timeout_ms = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let code_path = f.next().unwrap_or_default().to_string();
        let code_len = parse_length(f.next(), "code length")?;
        let cwd = f.next().unwrap_or_default().to_string();
        let tcp_rules = match f.next() {
            None | Some("") => Vec::new(),
            Some(list) => list
                .split(',')
                .map(TcpRoute::parse)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("malformed request: {e}"))?,
        };
        let tcp_socket = f.next().unwrap_or_default().to_string();
        let stdin_stream = match f.next() {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(s) => return Err(format!("malformed request: stdin stream {s:?}")),
        };
        if f.next().is_some() {
            return Err("malformed request: fields after the stdin stream".into());
        }
        Ok(RunHeader {
            argv,
            env,
            stdin_len,
            relay_port,
            relay_socket,
            timeout_ms,
            code_path,
            code_len,
            cwd,
            tcp_rules,
            tcp_socket,
            stdin_stream,
        })
    }
}

/// A file call's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp {
    /// Write the `n` bytes that follow (the file made or replaced, missing parents made).
    Put,
    /// Read the file, at most `n` bytes.
    Get,
    /// List the directory.
    List,
    /// Is it a directory.
    Dir,
    /// A tar of the directory, as `o` frames.
    TarOut,
    /// Extract the tar that follows in chunks (`n`: [`TARIN_UPLOAD`] or [`TARIN_RESTORE`]).
    TarIn,
}

impl FileOp {
    pub fn name(self) -> &'static str {
        match self {
            FileOp::Put => "put",
            FileOp::Get => "get",
            FileOp::List => "list",
            FileOp::Dir => "dir",
            FileOp::TarOut => "tarout",
            FileOp::TarIn => "tarin",
        }
    }
}

/// `n` of a tarin request: a caller's archive, merged into the directory.
pub const TARIN_UPLOAD: u64 = 0;
/// `n` of a tarin request: a workspace the sandbox made, into an empty directory.
pub const TARIN_RESTORE: u64 = 1;
/// The daemon's decision on a staged archive: move it into the workspace.
pub const ARCHIVE_COMMIT: u32 = 1;
/// The daemon's decision on a staged archive: remove it.
pub const ARCHIVE_DROP: u32 = 2;
/// Largest chunk of a tarin archive.
pub const MAX_ARCHIVE_CHUNK: usize = CHUNK;
/// The prefix of a tarin's intermediate verdict, followed by the member count.
pub const STAGED: &str = "staged ";

/// One chunk of a tarin archive: its length, then its bytes (at most [`MAX_ARCHIVE_CHUNK`]);
/// an empty one ends the archive.
pub fn archive_chunk(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + data.len());
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(0).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// The header of a file request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    pub op: FileOp,
    /// Relative to the workdir ("" for the workdir itself).
    pub path: String,
    pub n: u64,
}

impl FileHeader {
    /// The whole request; `data` (put only) must be `n` bytes.
    pub fn encode(&self, data: &[u8]) -> Result<Vec<u8>, String> {
        if self.op == FileOp::Put && self.n != data.len() as u64
            || self.op != FileOp::Put && !data.is_empty()
        {
            return Err("file request length does not match its data".into());
        }
        let n = self.n.to_string();
        with_magic(
            FILE_MAGIC,
            &joined(&[self.op.name(), &self.path, &n])?,
            &[data],
        )
    }

    pub fn decode(header: &[u8]) -> Result<FileHeader, String> {
        let bad = || "unknown file operation".to_string();
        let text = std::str::from_utf8(header).map_err(|_| bad())?;
        let mut f = text.split('\0');
        let op = match f.next() {
            Some("put") => FileOp::Put,
            Some("get") => FileOp::Get,
            Some("list") => FileOp::List,
            Some("dir") => FileOp::Dir,
            Some("tarout") => FileOp::TarOut,
            Some("tarin") => FileOp::TarIn,
            _ => return Err(bad()),
        };
        let path = f.next().ok_or_else(bad)?.to_string();
        let n = f.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        if f.next().is_some() {
            return Err(bad());
        }
        Ok(FileHeader { op, path, n })
    }
}

/// Splits a request's bytes into (magic, header) once both are complete: `Ok(None)` until then.
/// Used by the fuzz target and the tests; the supervisor reads the same layout from its stdin.
pub fn split_request(buf: &[u8]) -> Option<([u8; 4], &[u8], &[u8])> {
    let magic: [u8; 4] = buf.get(..4)?.try_into().ok()?;
    let len = u32::from_be_bytes(buf.get(4..8)?.try_into().ok()?) as usize;
    let header = buf.get(8..8usize.checked_add(len)?)?;
    Some((magic, header, &buf[8 + len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> RunHeader {
        RunHeader {
            argv: vec!["/bin/echo".into(), "a b".into(), String::new()],
            env: vec!["PATH=/bin".into(), "X=a=b".into()],
            stdin_len: Some(3),
            relay_port: 3128,
            relay_socket: "/run/executor-arm/egress/proxy.sock".into(),
            timeout_ms: 5000,
            code_path: "/run/session/c1".into(),
            code_len: Some(2),
            cwd: "/work/sub".into(),
            tcp_rules: vec![
                TcpRoute::parse("10.20.0.0/16:5432").unwrap(),
                TcpRoute::parse("[2001:db8::/32]:22").unwrap(),
            ],
            tcp_socket: "/run/executor-arm/egress/tcp.sock".into(),
            stdin_stream: true,
        }
    }

    #[test]
    fn tcp_rules_parse_strictly_and_print_as_written() {
        for (text, addr, prefix, port) in [
            ("10.20.0.0/16:5432", "10.20.0.0", 16, 5432),
            ("192.0.2.7/32:22", "192.0.2.7", 32, 22),
            ("0.0.0.0/0:80", "0.0.0.0", 0, 80),
            ("[2001:db8::/32]:22", "2001:db8::", 32, 22),
            ("[::/0]:443", "::", 0, 443),
        ] {
            let r = TcpRoute::parse(text).unwrap();
            assert_eq!(
                (r.addr, r.prefix, r.port),
                (addr.parse().unwrap(), prefix, port)
            );
            assert_eq!(r.to_string(), text);
        }
        for bad in [
            "",
            "10.20.0.0/16",
            "10.20.0.0:5432",
            "10.20.0.0/16:0",
            "10.20.0.0/16:65536",
            "10.20.0.0/16:+80",
            "10.20.0.0/33:80",
            "10.20.0.0/+8:80",
            "10.20.0.0/1234:80",
            " 10.20.0.0/16:80",
            "10.20.0.0/16:80 ",
            "010.20.0.0/16:80",
            "[10.20.0.0/16]:80",
            "2001:db8::/32:22",
            "[2001:db8::/129]:22",
            "[2001:db8::/32:22",
            "[2001:db8::/32]22",
            "[fe80::1%eth0/128]:22",
            "example.com/32:80",
            "10.20.0.0/16:5432,1",
        ] {
            assert!(TcpRoute::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tcp_preambles_round_trip_and_refuse_anything_else() {
        for dest in ["10.20.0.5:5432", "[2001:db8::1]:22"] {
            let dest: std::net::SocketAddr = dest.parse().unwrap();
            let line = tcp_preamble(dest);
            assert!(line.len() <= TCP_PREAMBLE_MAX && line.ends_with(b"\n"));
            assert_eq!(parse_tcp_preamble(&line[..line.len() - 1]).unwrap(), dest);
        }
        let longest = tcp_preamble(
            "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"
                .parse()
                .unwrap(),
        );
        assert!(longest.len() <= TCP_PREAMBLE_MAX);
        for bad in [
            &b""[..],
            b"EAT1 ",
            b"EAT1 10.0.0.1",
            b"EAT2 10.0.0.1:1",
            b"EAT1 host:80",
            b"\xff",
        ] {
            assert!(parse_tcp_preamble(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn run_requests_round_trip() {
        let h = header();
        let bytes = h.encode(b"abc", b"xy").unwrap();
        let (magic, raw, rest) = split_request(&bytes).unwrap();
        assert_eq!(&magic, RUN_MAGIC);
        assert_eq!(rest, b"abcxy");
        assert_eq!(RunHeader::decode(raw).unwrap(), h);

        let none = RunHeader {
            argv: vec!["/bin/true".into()],
            timeout_ms: 1,
            ..Default::default()
        };
        let bytes = none.encode(b"", b"").unwrap();
        let (_, raw, rest) = split_request(&bytes).unwrap();
        assert!(rest.is_empty());
        assert_eq!(RunHeader::decode(raw).unwrap(), none);

        // A socket without rules survives the round trip too.
        let socket_only = RunHeader {
            tcp_socket: "/t.sock".into(),
            ..none
        };
        let bytes = socket_only.encode(b"", b"").unwrap();
        let (_, raw, _) = split_request(&bytes).unwrap();
        assert_eq!(RunHeader::decode(raw).unwrap(), socket_only);

        // A streamed stdin without tcp rules, and one with nothing else after the cwd.
        for h in [
            RunHeader {
                stdin_stream: true,
                ..socket_only.clone()
            },
            RunHeader {
                argv: vec!["/bin/cat".into()],
                timeout_ms: 1,
                stdin_stream: true,
                ..Default::default()
            },
        ] {
            let bytes = h.encode(b"", b"").unwrap();
            let (_, raw, _) = split_request(&bytes).unwrap();
            assert_eq!(RunHeader::decode(raw).unwrap(), h);
        }
    }

    #[test]
    fn controls_round_trip_whatever_the_reads_split() {
        let big = vec![7u8; CHUNK + 10];
        let controls = [
            ControlFrame::Stdin(b"hello\n".to_vec()),
            ControlFrame::Stdin(Vec::new()),
            ControlFrame::Signal(2),
            ControlFrame::Stdin(big.clone()),
            ControlFrame::Signal(15),
            ControlFrame::Resize { cols: 80, rows: 24 },
            ControlFrame::CloseStdin,
        ];
        let bytes: Vec<u8> = controls.iter().flat_map(ControlFrame::encode).collect();
        // The big one is two frames; joined back they are the same bytes.
        let want: Vec<ControlFrame> = vec![
            ControlFrame::Stdin(b"hello\n".to_vec()),
            ControlFrame::Stdin(Vec::new()),
            ControlFrame::Signal(2),
            ControlFrame::Stdin(big[..CHUNK].to_vec()),
            ControlFrame::Stdin(big[CHUNK..].to_vec()),
            ControlFrame::Signal(15),
            ControlFrame::Resize { cols: 80, rows: 24 },
            ControlFrame::CloseStdin,
        ];
        for step in [1, 2, 3, 5, 7, 4096, bytes.len()] {
            let mut d = ControlDecoder::default();
            let mut got = Vec::new();
            for piece in bytes.chunks(step) {
                d.push(piece);
                while let Some(c) = d.next_control().unwrap() {
                    got.push(c);
                }
            }
            assert_eq!(got, want, "reads of {step} bytes");
            assert_eq!(d.missing(), 0);
        }
    }

    #[test]
    fn a_partial_control_says_how_much_it_misses_and_bad_ones_are_errors() {
        let f = ControlFrame::Signal(9).encode();
        let mut d = ControlDecoder::default();
        assert_eq!(d.missing(), 0);
        d.push(&f[..2]);
        assert_eq!(d.missing(), 3);
        d.push(&f[2..5]);
        assert_eq!(d.missing(), 1);
        assert_eq!(d.next_control().unwrap(), None);
        d.push(&f[5..]);
        assert_eq!(d.missing(), 0);
        assert_eq!(d.next_control().unwrap(), Some(ControlFrame::Signal(9)));
        for bad in [
            &b"z\0\0\0\0"[..],
            b"s\0\0\0\x02-1",
            b"s\0\0\0\0",
            b"s\0\0\0\x04 15 ",
            b"c\0\0\0\x01x",
            b"i\xff\xff\xff\xff",
            b"w\0\0\0\x040 24",
            b"w\0\0\0\x0480 0",
            b"w\0\0\0\x069999 1",
            b"w\0\0\0\x0280",
            b"w\0\0\0\x05+8 24",
        ] {
            let mut d = ControlDecoder::default();
            d.push(bad);
            assert!(d.next_control().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn run_requests_with_missing_trailing_fields_take_none_values() {
        let d = RunHeader::decode(b"1\0/bin/true\x000\0-1").unwrap();
        assert_eq!(d.argv, ["/bin/true"]);
        assert_eq!((d.timeout_ms, d.stdin_len, d.code_len), (0, None, None));
        assert_eq!(RunHeader::decode(b"").unwrap().argv, Vec::<String>::new());
    }

    #[test]
    fn malformed_run_requests_are_errors() {
        for bad in [
            &b"x"[..],
            b"3\0/a",
            b"1\0/a\x002\0A=1",
            b"1\0/a\x000\0seven",
            b"1\0/a\x000\0-1\x0070000",
            b"1\0/a\x000\0-1\x000\0\x001\0\0nope",
            b"1\0/a\x000\0-1\x000\0\x001\0\0-1\0/w\0extra",
            b"1\0/a\x000\0-1\x000\0\x001\0\0-1\0/w\x0010.0.0.0/8:1\0/t.sock\0extra",
            b"1\0/a\x000\0-1\x000\0\x001\0\0-1\0/w\0\0\x001\0extra",
            b"\xff",
        ] {
            assert!(RunHeader::decode(bad).is_err(), "{bad:?}");
        }
        let mut h = header();
        h.argv.push("a\0b".into());
        assert!(h.encode(b"abc", b"xy").is_err());
        assert!(header().encode(b"ab", b"xy").is_err(), "stdin length");
    }

    #[test]
    fn file_requests_round_trip_and_refuse_the_unknown() {
        let h = FileHeader {
            op: FileOp::Put,
            path: "a/b.txt".into(),
            n: 4,
        };
        let bytes = h.encode(b"data").unwrap();
        let (magic, raw, rest) = split_request(&bytes).unwrap();
        assert_eq!((&magic, rest), (FILE_MAGIC, &b"data"[..]));
        assert_eq!(FileHeader::decode(raw).unwrap(), h);
        for bad in [
            &b"del\0a\x000"[..],
            b"get\0a",
            b"get\0a\0x",
            b"list\0\x000\0",
        ] {
            assert!(FileHeader::decode(bad).is_err(), "{bad:?}");
        }
        let tarin = FileHeader {
            op: FileOp::TarIn,
            path: "sub".into(),
            n: TARIN_RESTORE,
        };
        let bytes = tarin.encode(b"").unwrap();
        assert_eq!(
            FileHeader::decode(split_request(&bytes).unwrap().1).unwrap(),
            tarin
        );
        assert!(tarin.encode(b"x").is_err(), "the archive follows in chunks");
        assert_eq!(archive_chunk(b"ab"), b"\0\0\0\x02ab");
        assert_eq!(archive_chunk(b""), b"\0\0\0\0");
        let get = FileHeader {
            op: FileOp::Get,
            path: String::new(),
            n: 9,
        };
        assert!(get.encode(b"x").is_err());
    }

    #[test]
    fn frames_and_reports_round_trip() {
        let f = encode_frame(kind::STDOUT, b"hi");
        assert_eq!(f, b"o\0\0\0\x02hi");
        assert_eq!(parse_frame_header(&f).unwrap(), Some((kind::STDOUT, 2)));
        assert_eq!(parse_frame_header(b"o\0\0").unwrap(), None);
        assert!(parse_frame_header(b"o\xff\xff\xff\xff").is_err());
        assert!(parse_frame_header(b"z\0\0\0\0").is_err());
        let r = ExitReport {
            status: Status::Signaled(9),
            stdin_broken_pipe: true,
            peak_memory_kib: Some(1024),
            oom_kills: None,
            pids_max_hits: Some(0),
        };
        assert_eq!(r.to_payload(), "signal 9 1 1024 - 0");
        assert_eq!(ExitReport::parse(r.to_payload().as_bytes()), Some(r));
        assert_eq!(ExitReport::parse(b"quit 0 0"), None);
        assert_eq!(ExitReport::parse(b"exit x 0"), None);
    }
}
