//! The session ports proxy's overhead: GETs of an in-sandbox server through
//! `/v1/sandbox/sessions/{id}/ports/{port}/…` against GETs of the same server made from inside
//! its network namespace (a thread of this process, which runs as root, `setns(2)` into it).
//! Both sides keep their connections (the caller's to the daemon, the proxy's into the sandbox,
//! the direct one to the server). The direct GETs are made with the caller's HTTP client
//! (reqwest, on a runtime of the thread inside the namespace), so the two series differ by the
//! proxy alone; a direct GET over a bare socket, on a kept connection and on one of its own, is
//! timed for reference.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::mpsc;
use std::time::Instant;

/// The port the server listens on in the sandbox.
pub const PORT: u16 = 8000;

/// A threaded HTTP/1.1 server on [`PORT`] answering every GET with `nonce` (keep-alive; no
/// Nagle delay between its header and body writes on a kept connection).
pub fn server(nonce: &str) -> String {
    format!(
        "import http.server\n\
         class H(http.server.BaseHTTPRequestHandler):\n    \
             protocol_version = 'HTTP/1.1'\n    \
             disable_nagle_algorithm = True\n    \
             def do_GET(self):\n        \
                 body = b'{nonce}'\n        \
                 self.send_response(200)\n        \
                 self.send_header('Content-Length', str(len(body)))\n        \
                 self.end_headers()\n        \
                 self.wfile.write(body)\n    \
             def log_message(self, *a):\n        \
                 pass\n\
         http.server.ThreadingHTTPServer(('0.0.0.0', {PORT}), H).serve_forever()\n"
    )
}

/// One GET of `/x` on `conn` (HTTP/1.1, kept open): the body.
fn get(conn: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    conn.write_all(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| std::io::Error::other("no content-length"))?;
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body)?;
    Ok(body)
}

/// How a direct GET is made.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// With reqwest, on its kept connection (the proxied GETs' client).
    Client,
    /// Over a bare socket, on the kept connection.
    Socket,
    /// Over a bare socket, on a connection of its own.
    Fresh,
}

/// A thread inside a sandbox's network namespace that times GETs of [`PORT`] there: send it a
/// count and whether each GET opens its own connection, get back that many timings (ms).
pub struct Direct {
    asks: mpsc::Sender<(usize, How)>,
    timings: mpsc::Receiver<Vec<f64>>,
}

impl Direct {
    /// The namespace of a process other than this one whose server on [`PORT`] answers `nonce`
    /// (several sandboxes may listen on that port: the nonce tells ours), with a thread in it.
    pub fn find(nonce: &str) -> Option<Direct> {
        let own = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
        let mut tried = std::collections::BTreeSet::from([own]);
        let listen = format!(":{PORT:04X} ");
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(ns) = std::fs::File::open(format!("/proc/{pid}/ns/net")) else {
                continue;
            };
            let Ok(ino) = ns.metadata().map(|m| m.ino()) else {
                continue;
            };
            if !tried.insert(ino) {
                continue;
            }
            // A listener (state 0A) on the port in that namespace.
            let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
            if !tcp
                .lines()
                .any(|l| l.contains(&listen) && l.split_whitespace().nth(3) == Some("0A"))
            {
                continue;
            }
            if let Some(d) = Direct::start(ns, nonce) {
                return Some(d);
            }
        }
        None
    }

    fn start(ns: std::fs::File, nonce: &str) -> Option<Direct> {
        let (asks, asked) = mpsc::channel::<(usize, How)>();
        let (answers, timings) = mpsc::channel::<Vec<f64>>();
        let (ready_tx, ready) = mpsc::channel::<bool>();
        let nonce = nonce.as_bytes().to_vec();
        std::thread::spawn(move || {
            // SAFETY: setns(2) on a namespace fd we hold; it moves only this thread.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                let _ = ready_tx.send(false);
                return;
            }
            let mut conn = match TcpStream::connect(("127.0.0.1", PORT)) {
                Ok(c) => c,
                Err(_) => {
                    let _ = ready_tx.send(false);
                    return;
                }
            };
            let _ = conn.set_nodelay(true);
            let ours = get(&mut conn).is_ok_and(|b| b == nonce);
            let _ = ready_tx.send(ours);
            if !ours {
                return;
            }
            // The client's sockets are made by this thread, so inside the namespace: its runtime
            // runs here, and the address is literal (no resolver thread).
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            let client = rt.block_on(async { reqwest::Client::new() });
            let url = format!("http://127.0.0.1:{PORT}/x");
            while let Ok((n, how)) = asked.recv() {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    let body = match how {
                        How::Client => rt.block_on(async {
                            let r = client
                                .get(&url)
                                .send()
                                .await
                                .map_err(std::io::Error::other)?;
                            r.bytes()
                                .await
                                .map(|b| b.to_vec())
                                .map_err(std::io::Error::other)
                        }),
                        How::Fresh => {
                            let mut c = TcpStream::connect(("127.0.0.1", PORT)).expect("connect");
                            let _ = c.set_nodelay(true);
                            get(&mut c)
                        }
                        How::Socket => get(&mut conn),
                    }
                    .expect("a direct GET");
                    out.push(t.elapsed().as_secs_f64() * 1000.0);
                    assert_eq!(body, nonce);
                }
                if answers.send(out).is_err() {
                    return;
                }
            }
        });
        ready
            .recv()
            .ok()
            .filter(|ok| *ok)
            .map(|_| Direct { asks, timings })
    }

    /// `n` timed GETs (ms), made as `how` says.
    pub fn run(&self, n: usize, how: How) -> Vec<f64> {
        self.asks.send((n, how)).expect("the direct thread");
        self.timings.recv().expect("the direct thread's timings")
    }
}
