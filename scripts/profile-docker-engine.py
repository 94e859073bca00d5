#!/usr/bin/env python3
"""Where a sandbox container's life spends its time, call by call against dockerd's API.

    scripts/profile-docker-engine.py RUNTIME N CONC          # lifecycle: one line per engine call
    scripts/profile-docker-engine.py RUNTIME N hit COMMAND   # first byte after stdin, started container

Lifecycle: create, attach, start, inspect, run (stdin -> exit), remove (force, v), remove volume,
N containers, CONC at a time (p50 / p95 in ms). The create body is close to executor-arm's
(src/sandbox/docker/container.rs): a tmpfs named volume at /work and /tmp, read-only root, cap-drop
ALL, no-new-privileges, 512m, network none, log driver none, a StdinOnce attach.
Hit: a started container runs `sh -c COMMAND`; the time from writing its stdin to its first output
byte is what a pool hit pays inside the sandbox (e.g. 'read x; /usr/bin/echo hi; sleep 3').
Needs root (dockerd's socket) and executor-arm-sandbox:latest. Leaves nothing behind but what an
interrupted run was holding (labelled bench=prof)."""
import json, socket, sys, time, uuid, threading, statistics

SOCK = "/var/run/docker.sock"
API = "/v1.41"

def req(method, path, body=None, hijack=False):
    s = socket.socket(socket.AF_UNIX); s.connect(SOCK)
    data = json.dumps(body).encode() if body is not None else b""
    hdr = f"{method} {API}{path} HTTP/1.1\r\nHost: docker\r\nContent-Length: {len(data)}\r\n"
    if body is not None: hdr += "Content-Type: application/json\r\n"
    if hijack: hdr += "Connection: Upgrade\r\nUpgrade: tcp\r\n"
    s.sendall(hdr.encode() + b"\r\n" + data)
    f = s.makefile("rb")
    status = int(f.readline().split()[1])
    headers = {}
    while True:
        l = f.readline().strip()
        if not l: break
        k, v = l.decode().split(":", 1); headers[k.lower()] = v.strip()
    if hijack:
        return status, s, f
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            n = int(f.readline().strip(), 16)
            if n == 0: f.readline(); break
            out += f.read(n); f.readline()
    else:
        out = f.read(int(headers.get("content-length", 0)))
    s.close()
    return status, out

def body(rt, vol):
    opts = {"type": "tmpfs", "device": "tmpfs", "o": "size=104857600,uid=65534,gid=65534,mode=0700"}
    mounts = [{"Type": "volume", "Source": vol, "Target": t, "VolumeOptions": {"NoCopy": True,
               "Labels": {"bench": "prof"}, "DriverConfig": {"Name": "local", "Options": opts}}} for t in ("/work", "/tmp")]
    return {"Image": "executor-arm-sandbox:latest", "Entrypoint": ["/bin/sh", "-c", "read x; echo hi"],
            "OpenStdin": True, "StdinOnce": True, "AttachStdin": True, "AttachStdout": True, "AttachStderr": True,
            "NetworkDisabled": True, "Labels": {"bench": "prof"},
            "HostConfig": {"Runtime": rt, "ReadonlyRootfs": True, "CapDrop": ["ALL"], "SecurityOpt": ["no-new-privileges"],
                           "Memory": 512 << 20, "MemorySwap": 512 << 20, "NanoCpus": 10**9, "PidsLimit": 64,
                           "NetworkMode": "none", "IpcMode": "none", "LogConfig": {"Type": "none"}, "Mounts": mounts}}

def life(rt, out):
    t = {}
    vol = "prof-disk-" + uuid.uuid4().hex
    name = "prof-" + uuid.uuid4().hex[:12]
    a = time.perf_counter()
    st, r = req("POST", f"/containers/create?name={name}", body(rt, vol)); assert st == 201, r
    cid = json.loads(r)["Id"]; b = time.perf_counter(); t["create"] = b - a
    st, s, f = req("POST", f"/containers/{cid}/attach?stream=1&stdin=1&stdout=1&stderr=1", hijack=True)
    c = time.perf_counter(); t["attach"] = c - b
    st, r = req("POST", f"/containers/{cid}/start"); assert st == 204, r
    d = time.perf_counter(); t["start"] = d - c
    st, r = req("GET", f"/containers/{cid}/json"); e = time.perf_counter(); t["inspect"] = e - d
    s.sendall(b"go\n")
    buf = b""
    while True:
        x = s.recv(4096)
        if not x: break
        buf += x
    g = time.perf_counter(); t["run_to_exit"] = g - e
    s.close()
    st, r = req("DELETE", f"/containers/{cid}?force=1&v=1"); h = time.perf_counter(); t["remove"] = h - g
    st, r = req("DELETE", f"/volumes/{vol}"); i = time.perf_counter(); t["remove_volume"] = i - h
    t["total"] = i - a
    out.append(t)

def hit(rt, n, entry):
    out = []
    for _ in range(n):
        vol = "prof-disk-" + uuid.uuid4().hex
        b = body(rt, vol)
        b["Entrypoint"] = ["/bin/sh", "-c", entry]
        st, r = req("POST", f"/containers/create?name=prof-{uuid.uuid4().hex[:12]}", b)
        assert st == 201, r
        cid = json.loads(r)["Id"]
        st, s, f = req("POST", f"/containers/{cid}/attach?stream=1&stdin=1&stdout=1&stderr=1", hijack=True)
        req("POST", f"/containers/{cid}/start")
        time.sleep(0.5)
        t = time.perf_counter()
        s.sendall(b"go\n")
        s.recv(100)
        out.append((time.perf_counter() - t) * 1000)
        s.close()
        req("DELETE", f"/containers/{cid}?force=1&v=1")
        req("DELETE", f"/volumes/{vol}")
    out.sort()
    print(f"{rt} {entry!r}: first byte ms p50 {statistics.median(out):.1f} min {out[0]:.1f} max {out[-1]:.1f}")

def main():
    if sys.argv[3] == "hit":
        return hit(sys.argv[1], int(sys.argv[2]), sys.argv[4])
    rt, n, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    life(rt, [])  # warm
    out = []
    if conc == 1:
        for _ in range(n): life(rt, out)
    else:
        left = [n]; lock = threading.Lock()
        def w():
            while True:
                with lock:
                    if not left[0]: return
                    left[0] -= 1
                life(rt, out)
        t0 = time.perf_counter()
        ts = [threading.Thread(target=w) for _ in range(conc)]
        [x.start() for x in ts]; [x.join() for x in ts]
        print(f"{rt} conc {conc}: {n / (time.perf_counter() - t0):.1f} lives/s")
    keys = ["create", "attach", "start", "inspect", "run_to_exit", "remove", "remove_volume", "total"]
    print(f"{rt} n={n} conc={conc} (ms p50 / p95)")
    for k in keys:
        xs = sorted(x[k] * 1000 for x in out)
        print(f"  {k:14} {statistics.median(xs):7.1f} / {xs[int(0.95 * (len(xs) - 1))]:7.1f}")

if __name__ == "__main__":
    main()
