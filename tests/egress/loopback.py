#!/usr/bin/env python3
"""A loopback listener next to the daemon, in the daemon's network namespace.

Nothing may ever reach it through the egress proxy. Every accepted connection (even one that
sends nothing) and what it sent is appended to <logdir>/hits-loopback.log.

  loopback.py LOGDIR PORT
"""
import socket
import sys
import threading

logdir, port = sys.argv[1], int(sys.argv[2])
lock = threading.Lock()


def serve(conn):
    with conn:
        conn.settimeout(2)
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        with lock, open(f"{logdir}/hits-loopback.log", "a") as f:
            f.write(f"connection: {data[:200]!r}\n")
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nloopback\n")
        except OSError:
            pass


s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(16)
open(f"{logdir}/loopback-ready", "w").close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
