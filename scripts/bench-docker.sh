#!/usr/bin/env bash
# Latency and throughput of POST /execute `echo hi` on the docker (runc) and gvisor (runsc)
# backends, warm pool on and off, beside `docker run --rm` with the same runtime measured in the
# same run. Prints p50/p95/p99 and ratios; asserts nothing (timing belongs here, not in tests).
#
# Needs: root, a running dockerd with runc + runsc and the sandbox image (scripts/setup-docker.sh,
# scripts/build-sandbox-image.sh), python3, cargo.
#
# Environment (defaults in brackets):
#   N_WARM [100]   sequential requests per warm-pool series (each waits until the pool is full)
#   N_COLD [30]    sequential requests per pool-off series
#   N_BASE [30]    `docker run --rm` samples per runtime
#   N_TPUT [200]   requests of the concurrency series
#   CONC [8]       concurrency of the throughput series
#   POOL [8]       sandbox.docker.pool_size for the pool-on daemons
#   RUNTIMES ["runc gvisor"]
#   CARGO_TARGET_DIR [target]   where the release binary is built
# The daemon logs at info (its production default), to a file.
set -Eeuo pipefail
trap 'echo "bench-docker: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

N_WARM=${N_WARM:-100}
N_COLD=${N_COLD:-30}
N_BASE=${N_BASE:-30}
N_TPUT=${N_TPUT:-200}
CONC=${CONC:-8}
POOL=${POOL:-8}
RUNTIMES=${RUNTIMES:-"runc gvisor"}
IMAGE=executor-arm-sandbox:latest

docker info >/dev/null 2>&1 || { echo "bench-docker: dockerd is not reachable (scripts/setup-docker.sh)" >&2; exit 1; }
docker image inspect "$IMAGE" >/dev/null 2>&1 || { echo "bench-docker: $IMAGE missing (scripts/build-sandbox-image.sh)" >&2; exit 1; }

cargo build --release --quiet
BIN="${CARGO_TARGET_DIR:-target}/release/executor-arm"
WORK=$(mktemp -d /tmp/bench-docker.XXXXXX)
DAEMON_PID=""
cleanup() {
  if [ -n "$DAEMON_PID" ]; then kill "$DAEMON_PID" 2>/dev/null || true; wait "$DAEMON_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/secret"

cat >"$WORK/client.py" <<'PY'
"""Sequential / concurrent POST /execute client; prints one JSON line of results."""
import http.client, json, sys, threading, time

addr, svc, cap, mode, n, conc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
pool = int(sys.argv[7]) if len(sys.argv) > 7 else 0
host, port = addr.rsplit(":", 1)
body = json.dumps({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap})
headers = {"Authorization": f"Bearer {svc}", "Content-Type": "application/json"}

def metric(_conn, name):
    # A fresh connection: the daemon closes keep-alive connections idle past its header timeout.
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))

def one(conn):
    t = time.perf_counter()
    conn.request("POST", "/execute", body, headers)
    r = conn.getresponse()
    data = r.read()
    dt = (time.perf_counter() - t) * 1000
    ok = r.status == 200 and json.loads(data).get("stdout") == "hi\n"
    return dt, ok

def wait_full(conn, backend):
    # Warm series: start each request with a full pool, so it measures a hit, not refill speed.
    deadline = time.time() + 60
    while time.time() < deadline:
        if metric(conn, f'executor_pool_idle_containers{{backend="{backend}"') >= pool:
            return
        time.sleep(0.02)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

conn = http.client.HTTPConnection(host, int(port), timeout=120)
backend = sys.argv[8] if len(sys.argv) > 8 else "docker"
one(conn)  # first use of the profile: creates its pool (or warms the daemon)
hits0 = metric(conn, f'executor_pool_events_total{{backend="{backend}",event="hit"}}')
miss0 = metric(conn, f'executor_pool_events_total{{backend="{backend}",event="miss"}}')
lat, errors = [], 0
t0 = time.perf_counter()
if mode == "seq":
    for _ in range(n):
        if pool:
            wait_full(conn, backend)
        dt, ok = one(conn)
        lat.append(dt)
        errors += not ok
    wall = None
else:
    if pool:
        wait_full(conn, backend)
    lock = threading.Lock()
    left = [n]
    def worker():
        global errors
        c = http.client.HTTPConnection(host, int(port), timeout=120)
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            dt, ok = one(c)
            with lock:
                lat.append(dt)
                errors += not ok
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ts: t.start()
    for t in ts: t.join()
    wall = time.perf_counter() - t0
hits = metric(conn, f'executor_pool_events_total{{backend="{backend}",event="hit"}}') - hits0
miss = metric(conn, f'executor_pool_events_total{{backend="{backend}",event="miss"}}') - miss0
print(json.dumps({"n": len(lat), "errors": errors, "p50": pct(lat, 50), "p95": pct(lat, 95), "p99": pct(lat, 99),
                  "rps": (len(lat) / wall) if wall else None, "hits": hits, "misses": miss}))
PY

cat >"$WORK/baseline.py" <<'PY'
"""`docker run --rm` latency of `echo hi` with one runtime; one JSON line."""
import json, subprocess, sys, time
rt, n, image = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# The same confinement the backend gives a run (see src/sandbox/docker/container.rs).
pids = ["--pids-limit", "1280", "--ulimit", "nproc=64:64"] if rt == "runsc" else ["--pids-limit", "64"]
cmd = ["docker", "run", "--rm", f"--runtime={rt}", "--network", "none", "--read-only", "--cap-drop", "ALL",
       "--security-opt", "no-new-privileges", "--user", "65534:65534", "--workdir", "/work",
       "--tmpfs", "/work:size=104857600,uid=65534,gid=65534,mode=0700,noexec,nosuid,nodev",
       "--tmpfs", "/tmp:size=104857600,mode=1777,noexec,nosuid,nodev", "--memory", "512m", "--memory-swap", "512m",
       "--cpus", "1", *pids, "--ulimit", "nofile=256:256", "--ulimit", "core=0:0", "--ipc", "none",
       "--log-driver", "none", "--hostname", "sandbox", image, "/usr/bin/echo", "hi"]
subprocess.run(cmd, check=True, capture_output=True)  # warm the image cache
lat = []
for _ in range(n):
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True).stdout
    lat.append((time.perf_counter() - t) * 1000)
    assert out == b"hi\n", out
lat.sort()
p = lambda q: lat[min(len(lat) - 1, int(round(q / 100 * (len(lat) - 1))))]
print(json.dumps({"n": n, "p50": p(50), "p95": p(95), "p99": p(99)}))
PY

start_daemon() { # runtime pool
  local cfg="$WORK/config.toml"
  printf '[sandbox.docker]\nimage = "%s"\npool_size = %s\n[server.concurrency]\nlocal = 16\ndocker = %s\ngvisor = %s\n' \
    "$IMAGE" "$2" "$CONC" "$CONC" >"$cfg"
  : >"$WORK/daemon.log"
  SANDBOX_RUNTIME="$1" EXECUTOR_ARM_JWT_SECRET_FILE="$WORK/secret" EXECUTOR_ARM_AUDIT_LOG="$WORK/audit.jsonl" \
    RUST_LOG=info "$BIN" serve --config "$cfg" --listen 127.0.0.1:0 2>"$WORK/daemon.log" &
  DAEMON_PID=$!
  ADDR=""
  for _ in $(seq 100); do
    ADDR=$(grep -o '"addr":"[^"]*"' "$WORK/daemon.log" | head -1 | cut -d'"' -f4 || true)
    [ -n "$ADDR" ] && break
    sleep 0.1
  done
  [ -n "$ADDR" ] || { cat "$WORK/daemon.log" >&2; exit 1; }
}

stop_daemon() {
  kill "$DAEMON_PID"; wait "$DAEMON_PID" 2>/dev/null || true; DAEMON_PID=""
}

SVC=$("$BIN" token mint --kind service --secret-file "$WORK/secret" --ttl 3600 --sub bench | tail -1)
CAP=$("$BIN" token mint --kind capability --secret-file "$WORK/secret" --ttl 3600 --sub bench --capabilities ShellExecute | tail -1)

mkdir -p "$WORK/r"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for rt in $RUNTIMES; do
  backend=$([ "$rt" = runc ] && echo docker || echo gvisor)
  oci=$([ "$rt" = runc ] && echo runc || echo runsc)
  echo "== $backend: docker run --rm baseline ($N_BASE)" >&2
  R_base=$(python3 "$WORK/baseline.py" "$oci" "$N_BASE" "$IMAGE")
  echo "$R_base" >"$WORK/r/$backend,base"
  echo "== $backend: pool on ($POOL), sequential ($N_WARM, each with a full pool)" >&2
  start_daemon "$rt" "$POOL"
  R_warm=$(python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" seq "$N_WARM" 1 "$POOL" "$backend")
  echo "$R_warm" >"$WORK/r/$backend,warm"
  echo "== $backend: pool on ($POOL), concurrency $CONC ($N_TPUT)" >&2
  R_tput=$(python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" conc "$N_TPUT" "$CONC" "$POOL" "$backend")
  echo "$R_tput" >"$WORK/r/$backend,tput"
  stop_daemon
  echo "== $backend: pool off, sequential ($N_COLD)" >&2
  start_daemon "$rt" 0
  R_cold=$(python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" seq "$N_COLD" 1 0 "$backend")
  echo "$R_cold" >"$WORK/r/$backend,cold"
  echo "== $backend: pool off, concurrency $CONC ($N_COLD)" >&2
  R_coldtput=$(python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" conc "$N_COLD" "$CONC" 0 "$backend")
  echo "$R_coldtput" >"$WORK/r/$backend,coldtput"
  stop_daemon
done

python3 - "$WORK/r" "$POOL" "$CONC" "$LOAD_START" "$(cut -d' ' -f1-3 /proc/loadavg)" "$(nproc)" <<'PY'
import json, os, sys
d, pool, conc, load0, load1, cpus = sys.argv[1:7]
print(f"\nhost: {cpus} CPUs, load average {load0} at start, {load1} at end")
r = {f: json.loads(open(os.path.join(d, f)).read()) for f in os.listdir(d)}
print(f"executor-arm POST /execute 'echo hi' vs docker run --rm  (ms; pool_size={pool}, concurrency={conc})")
print(f"{'series':44} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'req/s':>7} {'hit/miss':>9} {'err':>4}")
for b in ("docker", "gvisor"):
    if f"{b},base" not in r:
        continue
    rows = [("docker run --rm (same runtime)", r[f"{b},base"]),
            ("pool on, sequential (hit latency)", r[f"{b},warm"]),
            (f"pool on, concurrency {conc}", r[f"{b},tput"]),
            ("pool off, sequential", r[f"{b},cold"]),
            (f"pool off, concurrency {conc}", r[f"{b},coldtput"])]
    for name, x in rows:
        rps = f"{x['rps']:.1f}" if x.get("rps") else "-"
        hm = f"{int(x['hits'])}/{int(x['misses'])}" if "hits" in x else "-"
        print(f"{b + ': ' + name:44} {x['n']:>4} {x['p50']:>8.1f} {x['p95']:>8.1f} {x['p99']:>8.1f} {rps:>7} {hm:>9} {x.get('errors', 0):>4}")
    base = r[f"{b},base"]["p50"]
    print(f"{b}: pool off p50 is {100 * (1 - r[f'{b},cold']['p50'] / base):.0f}% below docker run --rm; "
          f"warm p50 {r[f'{b},warm']['p50']:.1f} ms ({base / r[f'{b},warm']['p50']:.0f}x faster)\n")
PY
