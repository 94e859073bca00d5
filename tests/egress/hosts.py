#!/usr/bin/env python3
"""Test hosts for the egress tests, run inside the test's own network namespace.

Serves HTTP on each address given on the command line and a DNS server on the first one.
Every HTTP hit is appended to <logdir>/hits-<ip>.log, so a test can prove that a refused
address saw nothing.

  hosts.py LOGDIR DNS_IP ALLOWED_IP METADATA_IP PRIVATE_IP

Also a TCP echo server on ports 7001 and 7002 of each address (for raw TCP rules): it first
sends "echo <ip>:<port>\n", then echoes what it reads; each connection is appended to
<logdir>/tcp-<ip>.log.

Paths: /redirect-to-metadata (302 to the metadata host), /bytes/N (N bytes), /slow (answers
after 60 s: holds a connection open while a run times out or its client goes away), /simple/...,
/files/... and /npm/... (the package index and registry a test laid out in <logdir>/index with
package.py; a directory is its index.html, anything missing 404), anything else "hello from <ip>". Names: allowed.test,
index.test (the allowed address), metadata.test, private.test, loopback.test (127.0.0.1) and
rebind.test (first the allowed, then the metadata address).
"""
import os
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logdir, dns_ip, allowed_ip, metadata_ip, private_ip = sys.argv[1:6]
rebind_count = {"n": 0}
lock = threading.Lock()


def handler_for(ip):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            with lock, open(f"{logdir}/hits-{ip}.log", "a") as f:
                f.write(f"{self.command} {self.path} {self.headers.get('Host')}\n")
            if self.path == "/redirect-to-metadata":
                self.send_response(302)
                self.send_header("Location", f"http://{metadata_ip}/latest/meta-data/")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path.startswith(("/simple/", "/files/", "/npm/")):
                self.serve_index()
                return
            if self.path == "/slow":
                time.sleep(60)
            if self.path.startswith("/lines/"):
                # N lines, 200 ms apart, each stamped with the time it was sent; the body ends
                # when the connection closes (HTTP/1.0).
                self.send_response(200)
                self.end_headers()
                for i in range(int(self.path.split("/")[2])):
                    self.wfile.write(f"line {i} {time.time()}\n".encode())
                    self.wfile.flush()
                    time.sleep(0.2)
                return
            if self.path.startswith("/bytes/"):
                n = int(self.path.split("/")[2])
                self.send_response(200)
                self.send_header("Content-Length", str(n))
                self.end_headers()
                chunk = b"x" * 65536
                while n > 0:
                    k = min(n, len(chunk))
                    self.wfile.write(chunk[:k])
                    n -= k
                return
            body = f"hello from {ip}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def serve_index(self):
            rel = self.path.split("?")[0].lstrip("/")
            path = os.path.join(logdir, "index", rel)
            if rel.endswith("/") or os.path.isdir(path):
                path = os.path.join(path, "index.html")
            if ".." in rel.split("/") or not os.path.isfile(path):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with open(path, "rb") as f:
                body = f.read()
            self.send_response(200)
            if rel.startswith("npm/") and path.endswith(".html"):
                kind = "application/json"
            elif path.endswith(".html"):
                kind = "text/html"
            else:
                kind = "application/octet-stream"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return H


def dns_answer(name):
    if name in ("allowed.test", "index.test"):
        return allowed_ip
    if name == "metadata.test":
        return metadata_ip
    if name == "private.test":
        return private_ip
    if name == "loopback.test":
        return "127.0.0.1"
    if name == "rebind.test":
        # First an allowed address, then the metadata address.
        with lock:
            rebind_count["n"] += 1
            return allowed_ip if rebind_count["n"] == 1 else metadata_ip
    return None


def serve_dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((dns_ip, 53))
    while True:
        data, peer = s.recvfrom(512)
        try:
            qid, flags, qd = struct.unpack(">HHH", data[:6])
            i, labels = 12, []
            while data[i] != 0:
                n = data[i]
                labels.append(data[i + 1:i + 1 + n].decode())
                i += 1 + n
            qtype, qclass = struct.unpack(">HH", data[i + 1:i + 5])
            question = data[12:i + 5]
            name = ".".join(labels).lower().rstrip(".")
            ip = dns_answer(name) if qtype == 1 else None
            if qtype == 1 and ip is None and name not in ("allowed.test", "index.test", "metadata.test", "private.test", "rebind.test", "loopback.test"):
                rcode, answers = 3, b""
            else:
                rcode, answers = 0, b""
            an = 0
            if ip:
                answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 0, 4) + socket.inet_aton(ip)
                an = 1
            header = struct.pack(">HHHHHH", qid, 0x8180 | rcode, 1, an, 0, 0)
            s.sendto(header + question + answers, peer)
        except Exception:
            continue


def serve_echo(ip, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(16)

    def one(c):
        with c:
            with lock, open(f"{logdir}/tcp-{ip}.log", "a") as f:
                f.write(f"{port}\n")
            c.sendall(f"echo {ip}:{port}\n".encode())
            while True:
                data = c.recv(65536)
                if not data:
                    return
                c.sendall(data)

    while True:
        c, _ = s.accept()
        threading.Thread(target=one, args=(c,), daemon=True).start()


for ip in (allowed_ip, metadata_ip, private_ip):
    srv = ThreadingHTTPServer((ip, 80), handler_for(ip))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    for port in (7001, 7002):
        threading.Thread(target=serve_echo, args=(ip, port), daemon=True).start()
threading.Thread(target=serve_dns, daemon=True).start()
open(f"{logdir}/ready", "w").close()
threading.Event().wait()
