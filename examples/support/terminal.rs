//! Terminal round trips for the sessions benchmark: a keystroke and its echo over a session's
//! terminal WebSocket, and the same-run baseline, a keystroke and its echo on a host pty with the
//! same shell (bash) and no daemon between.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::time::Instant;

use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// Keystrokes between two line clears (Ctrl-U), outside the timings.
const LINE: usize = 40;

/// `n` round trips (ms) over session `id`'s terminal at `addr`: `a` typed, until `a` comes back.
pub async fn over_websocket(addr: &str, svc: &str, id: &str, n: usize) -> Vec<f64> {
    let mut req = format!("ws://{addr}/v1/sandbox/sessions/{id}/terminal")
        .into_client_request()
        .expect("request");
    req.headers_mut()
        .insert("authorization", svc.parse().expect("header"));
    let (mut ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("terminal");
    // The prompt first: the shell reads keystrokes from then on.
    ws.send(Message::Binary(b"PS1='$ '\n".to_vec().into()))
        .await
        .expect("send");
    drain(&mut ws).await;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        if i % LINE == 0 {
            ws.send(Message::Binary(b"\x15".to_vec().into()))
                .await
                .expect("send");
            drain(&mut ws).await;
        }
        let t = Instant::now();
        ws.send(Message::Binary(b"a".to_vec().into()))
            .await
            .expect("send");
        loop {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) if b.contains(&b'a') => break,
                Some(Ok(_)) => {}
                other => panic!("terminal ended: {other:?}"),
            }
        }
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ws.close(None).await.expect("close");
    samples
}

/// Reads what the terminal shows for 200 ms (or until the socket ends: a terminal that could not
/// start fails the round trips that follow instead of spinning here).
async fn drain<S>(ws: &mut S)
where
    S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let until = tokio::time::Instant::now() + std::time::Duration::from_millis(200);
    while let Ok(Some(_)) = tokio::time::timeout_at(until, ws.next()).await {}
}

/// `n` round trips (ms) on a host pty running bash: `a` written to the master, until it echoes.
pub fn host_pty(n: usize) -> Vec<f64> {
    let (mut master, slave) = openpty();
    let fd = slave.as_raw_fd();
    let mut cmd = std::process::Command::new("/bin/bash");
    cmd.args(["--norc", "--noprofile", "-i"])
        .env("PS1", "$ ")
        .env("TERM", "xterm-256color");
    // SAFETY: setsid and ioctl are async-signal-safe; fd is the slave, open in the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 || libc::ioctl(fd, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let stdio = || std::process::Stdio::from(slave.try_clone().expect("dup"));
    let mut child = cmd
        .stdin(stdio())
        .stdout(stdio())
        .stderr(stdio())
        .spawn()
        .expect("bash");
    drop(slave);
    let mut buf = [0u8; 4096];
    let drain = |master: &mut std::fs::File, buf: &mut [u8]| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        set_nonblocking(master, true);
        while master.read(buf).is_ok_and(|n| n > 0) {}
        set_nonblocking(master, false);
    };
    drain(&mut master, &mut buf);
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        if i % LINE == 0 {
            master.write_all(b"\x15").expect("write");
            drain(&mut master, &mut buf);
        }
        let t = Instant::now();
        master.write_all(b"a").expect("write");
        loop {
            let got = master.read(&mut buf).expect("read");
            if buf[..got].contains(&b'a') {
                break;
            }
        }
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let _ = child.kill();
    let _ = child.wait();
    samples
}

fn openpty() -> (std::fs::File, OwnedFd) {
    let (mut m, mut s) = (-1, -1);
    // SAFETY: openpty writes two descriptors into the given ints; name, termios and winsize may
    // be null.
    let rc = unsafe {
        libc::openpty(
            &mut m,
            &mut s,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened by openpty and are owned by nothing else.
    unsafe { (std::fs::File::from_raw_fd(m), OwnedFd::from_raw_fd(s)) }
}

fn set_nonblocking(f: &std::fs::File, on: bool) {
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        libc::fcntl(fd, libc::F_SETFL, flags);
    }
}
