//! Session archives in tests: tars built member by member (hostile ones with raw headers), the
//! two archive calls, and a workspace's state as a GET archive shows it.

use std::io::{Read, Write};

use super::Resp;
use super::sessions::SandboxClient;

/// One member: a name written as given, a type byte, a mode, the data (files) or link target.
pub struct M<'a> {
    pub name: &'a str,
    pub ty: u8,
    pub mode: u32,
    pub data: &'a [u8],
}

pub fn file<'a>(name: &'a str, data: &'a [u8]) -> M<'a> {
    M {
        name,
        ty: b'0',
        mode: 0o644,
        data,
    }
}

pub fn dir(name: &str) -> M<'_> {
    M {
        name,
        ty: b'5',
        mode: 0o755,
        data: b"",
    }
}

pub fn link<'a>(name: &'a str, target: &'a str) -> M<'a> {
    M {
        name,
        ty: b'2',
        mode: 0o777,
        data: target.as_bytes(),
    }
}

/// A raw header for `m` (its name copied as is: absolute and `..` names included).
pub fn header(m: &M<'_>) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..m.name.len()].copy_from_slice(m.name.as_bytes());
    h.set_entry_type(tar::EntryType::new(m.ty));
    h.set_mode(m.mode);
    h.set_mtime(1_700_000_000);
    if matches!(m.ty, b'1' | b'2') {
        h.as_old_mut().linkname[..m.data.len()].copy_from_slice(m.data);
        h.set_size(0);
    } else {
        h.set_size(m.data.len() as u64);
    }
    h.set_cksum();
    h
}

/// A whole tar of `members`.
pub fn tar_of(members: &[M<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for m in members {
        let data: &[u8] = if matches!(m.ty, b'1' | b'2') {
            b""
        } else {
            m.data
        };
        b.append(&header(m), data).unwrap();
    }
    b.into_inner().unwrap()
}

/// A GNU sparse member (type `S`) of 10 GiB with one byte of data: 1.5 KiB on the wire.
pub fn sparse_10_gib() -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.set_path("sparse.img").unwrap();
    h.set_entry_type(tar::EntryType::GNUSparse);
    h.set_mode(0o644);
    h.set_size(1);
    // Base-256 (GNU) numbers: 10 GiB does not fit 11 octal digits.
    let octal = |field: &mut [u8], v: u64| {
        field.fill(0);
        field[0] = 0x80;
        let n = field.len();
        field[n - 8..].copy_from_slice(&v.to_be_bytes());
    };
    let gnu = h.as_gnu_mut().unwrap();
    octal(&mut gnu.realsize, 10 << 30);
    octal(&mut gnu.sparse[0].offset, (10 << 30) - 1);
    octal(&mut gnu.sparse[0].numbytes, 1);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(b"x");
    out.resize(out.len() + 511, 0);
    out.extend_from_slice(&[0u8; 1024]);
    out
}

fn url(c: &SandboxClient<'_>, id: &str, path: &str) -> String {
    format!(
        "{}/v1/sandbox/sessions/{id}/archive?path={}",
        c.d.base,
        path.replace('/', "%2F")
    )
}

pub async fn get_archive(c: &SandboxClient<'_>, id: &str, path: &str) -> Resp {
    let mut rb = c.d.client.get(url(c, id, path));
    for (k, v) in c.headers() {
        rb = rb.header(k, v);
    }
    super::Daemon::read(rb.send().await.expect("request")).await
}

pub async fn put_archive(c: &SandboxClient<'_>, id: &str, path: &str, tar: Vec<u8>) -> Resp {
    let mut rb =
        c.d.client
            .put(url(c, id, path))
            .header("content-type", "application/x-tar")
            .body(tar);
    for (k, v) in c.headers() {
        rb = rb.header(k, v);
    }
    super::Daemon::read(rb.send().await.expect("request")).await
}

/// Every member of a tar: (name, `file <bytes>` | `dir` | `-> target`).
pub fn members(tar: &[u8]) -> Vec<(String, String)> {
    let mut a = tar::Archive::new(tar);
    let mut out = Vec::new();
    for e in a.entries().expect("a tar") {
        let mut e = e.expect("an entry");
        let name = String::from_utf8_lossy(&e.path_bytes()).into_owned();
        let what = match e.header().entry_type() {
            tar::EntryType::Directory => "dir".to_string(),
            tar::EntryType::Symlink => format!(
                "-> {}",
                String::from_utf8_lossy(&e.link_name_bytes().unwrap_or_default())
            ),
            tar::EntryType::Regular => {
                let mut data = Vec::new();
                e.read_to_end(&mut data).unwrap();
                format!("file {}", String::from_utf8_lossy(&data))
            }
            other => format!("{other:?}"),
        };
        out.push((name, what));
    }
    out
}

/// The whole workspace as a GET archive shows it.
pub async fn workspace(c: &SandboxClient<'_>, id: &str) -> Vec<(String, String)> {
    let r = get_archive(c, id, "").await;
    assert_eq!(r.status, 200, "{}", r.text);
    members(&r.bytes)
}

/// PUTs an archive of `n` empty files made as it is sent (512 MiB for a million: never built
/// in memory), chunked over a raw connection, and returns the status line's code once the
/// daemon answers (it may answer before the body has all been sent).
pub fn put_generated(addr: &str, headers: &[(String, String)], id: &str, n: u64) -> u16 {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let mut head = format!(
        "PUT /v1/sandbox/sessions/{id}/archive HTTP/1.1\r\nhost: {}\r\ncontent-type: application/x-tar\r\ntransfer-encoding: chunked\r\nconnection: close\r\n",
        addr
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let mut reader = s.try_clone().unwrap();
    let answer = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => got.extend_from_slice(&buf[..k]),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    // 128 headers a chunk; a write the daemon no longer reads ends the sending.
    let mut batch = Vec::with_capacity(128 * 512);
    'send: for i in 0..n {
        let mut h = tar::Header::new_gnu();
        h.set_path(format!("many/{i}")).unwrap();
        h.set_mode(0o644);
        h.set_size(0);
        h.set_cksum();
        batch.extend_from_slice(h.as_bytes());
        if batch.len() == 128 * 512 || i + 1 == n {
            if i + 1 == n {
                batch.extend_from_slice(&[0u8; 1024]);
            }
            let chunk = [format!("{:x}\r\n", batch.len()).as_bytes(), &batch, b"\r\n"].concat();
            if s.write_all(&chunk).is_err() || answer.is_finished() {
                break 'send;
            }
            batch.clear();
        }
    }
    let _ = s.write_all(b"0\r\n\r\n");
    let status = answer.join().unwrap();
    status
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no answer: {status:?}"))
}
