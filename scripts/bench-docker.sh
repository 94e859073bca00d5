#!/usr/bin/env bash
# Latency and throughput of POST /execute `echo hi` on the docker (runc) and gvisor (runsc)
# backends with the daemon's DEFAULT config, beside `docker run --rm` with the same runtime and
# confinement measured in the same run. Prints p50/p95/p99, throughput, ratios and the targets;
# asserts nothing (timing belongs here, not in tests).
#
# Needs: root, a running dockerd with runc + runsc and the sandbox image (scripts/setup-docker.sh,
# scripts/build-sandbox-image.sh), python3, cargo (unless EXECUTOR_ARM_BIN is set).
#
# Series per runtime (ids <backend>.<series>; SERIES selects them):
#   base    `docker run --rm`, sequential (N_BASE)
#   b2b     N_B2B sequential requests back to back, no pause, right after the first request of a
#           fresh daemon (no waiting for a full pool)
#   warm    N_WARM sequential requests, each once the pool holds WARM_IDLE idle containers (hit
#           latency)
#   conc8   N_TPUT requests from CONC workers, right after the first request of a fresh daemon
#   base8   N_BASE8 `docker run --rm`, CONC at a time
#   noreuse_b2b, noreuse_conc8   b2b and conc8 with `sandbox.docker.pool_reuse = false` (one
#           container per run); runc only, since gVisor never serves a run in a used container
# Every series's client runs as one calling service with one capability subject: one trust
# scope, whose runc runs are served again by scrubbed containers (pool_reuse, on by default).
# With EXECUTOR_ARM_BASELINE_BIN (another build of the daemon, e.g. an older commit's), each daemon
# series is run again right after with that build (ids <backend>.before_<series>), and every
# target and ratio also gets its value for that build ("before" in the JSON): old beside new in
# one run.
#
# Environment (defaults in brackets):
#   SERIES ["base b2b noreuse_b2b warm conc8 noreuse_conc8 base8"]   RUNTIMES ["runc gvisor"]
#   N_BASE [30] N_B2B [200] N_WARM [100] N_TPUT [200] N_BASE8 [40] CONC [8] WARM_IDLE [2]
#   EXECUTOR_ARM_BIN   the daemon binary to measure (default: build this checkout's release, and
#                      its static supervisor beside it; a given binary needs its
#                      executor-arm-supervisor beside it, scripts/build-supervisor.sh --release DEST)
#   EXECUTOR_ARM_BASELINE_BIN   another build measured beside it [unset]
#   CARGO_TARGET_DIR [target]   where the release binary is built
#   BENCH_JSON         also write the results as JSON to this file
# The daemons run with the embedded default config (only the backend is chosen, by
# SANDBOX_RUNTIME) and log at info (the production default), to a file.
set -Eeuo pipefail
trap 'echo "bench-docker: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."
# shellcheck source=lib/daemon-addr.sh
source scripts/lib/daemon-addr.sh

SERIES=${SERIES:-"base b2b noreuse_b2b warm conc8 noreuse_conc8 base8"}
RUNTIMES=${RUNTIMES:-"runc gvisor"}
N_BASE=${N_BASE:-30}
N_B2B=${N_B2B:-200}
N_WARM=${N_WARM:-100}
N_TPUT=${N_TPUT:-200}
N_BASE8=${N_BASE8:-40}
CONC=${CONC:-8}
WARM_IDLE=${WARM_IDLE:-2}
IMAGE=executor-arm-sandbox:latest

docker info >/dev/null 2>&1 || { echo "bench-docker: dockerd is not reachable (scripts/setup-docker.sh)" >&2; exit 1; }
docker image inspect "$IMAGE" >/dev/null 2>&1 || { echo "bench-docker: $IMAGE missing (scripts/build-sandbox-image.sh)" >&2; exit 1; }

if [ -n "${EXECUTOR_ARM_BIN:-}" ]; then
  BIN=$EXECUTOR_ARM_BIN
else
  cargo build --release --locked --quiet
  BIN="${CARGO_TARGET_DIR:-target}/release/executor-arm"
  # The static in-container supervisor, where the daemon looks for it (beside its executable).
  scripts/build-supervisor.sh --release "${BIN}-supervisor" >/dev/null
fi
[ -x "$BIN" ] || { echo "bench-docker: no executable at $BIN" >&2; exit 1; }
BASELINE_BIN=${EXECUTOR_ARM_BASELINE_BIN:-}
[ -z "$BASELINE_BIN" ] || [ -x "$BASELINE_BIN" ] || { echo "bench-docker: no executable at $BASELINE_BIN" >&2; exit 1; }
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

addr, svc, cap, mode, n, conc, idle, backend = sys.argv[1:9]
n, conc, idle = int(n), int(conc), int(idle)
host, port = addr.rsplit(":", 1)
body = json.dumps({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap})
headers = {"Authorization": f"Bearer {svc}", "Content-Type": "application/json"}

def metric(name):
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

def wait_idle():
    # Warm series: start each request with `idle` idle containers, so it measures a hit.
    deadline = time.time() + 60
    while time.time() < deadline:
        if metric(f'executor_pool_idle_containers{{backend="{backend}"') >= idle:
            return
        time.sleep(0.02)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

conn = http.client.HTTPConnection(host, int(port), timeout=120)
one(conn)  # first use of the profile: makes its pool
hit = f'executor_pool_events_total{{backend="{backend}",event="hit"}}'
miss = f'executor_pool_events_total{{backend="{backend}",event="miss"}}'
reused = f'executor_pool_events_total{{backend="{backend}",event="reused"}}'
hits0, miss0, reused0 = metric(hit), metric(miss), metric(reused)
lat, errors = [], 0
if mode == "seq":
    for _ in range(n):
        if idle:
            wait_idle()
        dt, ok = one(conn)
        lat.append(dt)
        errors += not ok
    wall = None
else:
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
print(json.dumps({"n": len(lat), "errors": errors, "p50": pct(lat, 50), "p95": pct(lat, 95), "p99": pct(lat, 99),
                  "rps": (len(lat) / wall) if wall else None, "hits": metric(hit) - hits0,
                  "misses": metric(miss) - miss0, "reused": metric(reused) - reused0, "samples": lat}))
PY

cat >"$WORK/baseline.py" <<'PY'
"""`docker run --rm` of `echo hi` with one runtime, `conc` at a time; one JSON line."""
import json, subprocess, sys, threading, time
rt, n, conc, image = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# The same confinement the backend gives a run (see src/sandbox/docker/container.rs).
pids = ["--pids-limit", "1280", "--ulimit", "nproc=64:64"] if rt == "runsc" else ["--pids-limit", "64"]
cmd = ["docker", "run", "--rm", f"--runtime={rt}", "--network", "none", "--read-only", "--cap-drop", "ALL",
       "--security-opt", "no-new-privileges", "--user", "65534:65534", "--workdir", "/work",
       "--tmpfs", "/work:size=104857600,uid=65534,gid=65534,mode=0700,noexec,nosuid,nodev",
       "--tmpfs", "/tmp:size=104857600,mode=1777,noexec,nosuid,nodev", "--memory", "512m", "--memory-swap", "512m",
       "--cpus", "1", *pids, "--ulimit", "nofile=256:256", "--ulimit", "core=0:0", "--ipc", "none",
       "--log-driver", "none", "--hostname", "sandbox", image, "/usr/bin/echo", "hi"]
subprocess.run(cmd, check=True, capture_output=True)  # warm the image cache
lat, errors, lock, left = [], 0, threading.Lock(), [n]
def worker():
    global errors
    while True:
        with lock:
            if left[0] == 0:
                return
            left[0] -= 1
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True).stdout
        dt = (time.perf_counter() - t) * 1000
        with lock:
            lat.append(dt)
            errors += out != b"hi\n"
t0 = time.perf_counter()
ts = [threading.Thread(target=worker) for _ in range(conc)]
for t in ts: t.start()
for t in ts: t.join()
wall = time.perf_counter() - t0
s = sorted(lat)
p = lambda q: s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]
print(json.dumps({"n": n, "errors": errors, "p50": p(50), "p95": p(95), "p99": p(99),
                  "rps": n / wall if conc > 1 else None, "samples": lat}))
PY

start_daemon() { # runtime binary
  : >"$WORK/daemon.log"
  # Each daemon gets a fresh embedded store of its own, in the run's work directory.
  EXECUTOR_ARM__SANDBOX__DOCKER__POOL_REUSE="${POOL_REUSE:-true}" \
  SANDBOX_RUNTIME="$1" EXECUTOR_ARM_JWT_SECRET_FILE="$WORK/secret" EXECUTOR_ARM_AUDIT_LOG="$WORK/audit.jsonl" \
    EXECUTOR_ARM_STATE_DIR="$(mktemp -d "$WORK/state.XXXXXX")" RUST_LOG=info "$2" serve --listen 127.0.0.1:0 2>"$WORK/daemon.log" &
  DAEMON_PID=$!
  ADDR=$(daemon_addr "$WORK/daemon.log") || exit 1
}

stop_daemon() {
  kill "$DAEMON_PID"; wait "$DAEMON_PID" 2>/dev/null || true; DAEMON_PID=""
}

# A daemon's series: a fresh daemon each, so no series inherits another's pool or removals; with a
# baseline build, that build's fresh daemon runs the same series right after.
daemon_series() { # runtime backend id mode n conc idle
  echo "== $2.$3 ($5 requests, $4, concurrency $6)" >&2
  one_daemon_series "$BIN" "$@"
  if [ -n "$BASELINE_BIN" ]; then
    echo "== $2.before_$3 (the same, baseline build)" >&2
    one_daemon_series "$BASELINE_BIN" "$1" "$2" "before_$3" "${@:4}"
  fi
}

one_daemon_series() { # binary runtime backend id mode n conc idle
  start_daemon "$2" "$1"
  python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" "$5" "$6" "$7" "$8" "$3" >"$WORK/r/$3.$4"
  stop_daemon
}

has() { [[ " $SERIES " == *" $1 "* ]]; }

SVC=$("$BIN" token mint --kind service --secret-file "$WORK/secret" --ttl 3600 --sub bench | tail -1)
CAP=$("$BIN" token mint --kind capability --secret-file "$WORK/secret" --ttl 3600 --sub bench --capabilities ShellExecute | tail -1)

mkdir -p "$WORK/r"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
UTC_START=$(date -u +%FT%TZ)
for rt in $RUNTIMES; do
  backend=$([ "$rt" = runc ] && echo docker || echo gvisor)
  oci=$([ "$rt" = runc ] && echo runc || echo runsc)
  if has base; then
    echo "== $backend.base (docker run --rm, $N_BASE sequential)" >&2
    python3 "$WORK/baseline.py" "$oci" "$N_BASE" 1 "$IMAGE" >"$WORK/r/$backend.base"
  fi
  has b2b && daemon_series "$rt" "$backend" b2b seq "$N_B2B" 1 0
  has warm && daemon_series "$rt" "$backend" warm seq "$N_WARM" 1 "$WARM_IDLE"
  has conc8 && daemon_series "$rt" "$backend" conc8 conc "$N_TPUT" "$CONC" 0
  if [ "$rt" = runc ]; then
    has noreuse_b2b && POOL_REUSE=false daemon_series "$rt" "$backend" noreuse_b2b seq "$N_B2B" 1 0
    has noreuse_conc8 && POOL_REUSE=false daemon_series "$rt" "$backend" noreuse_conc8 conc "$N_TPUT" "$CONC" 0
  fi
  if has base8; then
    echo "== $backend.base8 (docker run --rm, $N_BASE8, $CONC at a time)" >&2
    python3 "$WORK/baseline.py" "$oci" "$N_BASE8" "$CONC" "$IMAGE" >"$WORK/r/$backend.base8"
  fi
done

RUNSC_VERSION=$(runsc --version 2>/dev/null | head -1 || true)
RUNSC_PLATFORM=$(docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -o -- '--platform=[a-z]*' | head -1 | cut -d= -f2 || true)
python3 - "$WORK/r" "$CONC" "$LOAD_START" "$(cut -d' ' -f1-3 /proc/loadavg)" "$(nproc)" "$UTC_START" \
  "$(date -u +%FT%TZ)" "$BIN" "$RUNSC_VERSION" "${RUNSC_PLATFORM:-unknown}" "${BENCH_JSON:-}" "$BASELINE_BIN" <<'PY'
import json, os, sys
d, conc, load0, load1, cpus, t0, t1, binary, runsc_version, runsc_platform, out, baseline_bin = sys.argv[1:13]
conc = int(conc)
r = {f: json.loads(open(os.path.join(d, f)).read()) for f in os.listdir(d)}
labels = {
    "base": "{b}: docker run --rm --runtime={rt}, sequential",
    "b2b": "{b} POST /execute back-to-back, defaults",
    "warm": "{b} POST /execute with a full pool (hit latency), defaults",
    "conc8": f"{{b}} POST /execute {conc} concurrent, defaults",
    "base8": f"{{b}}: docker run --rm --runtime={{rt}}, {conc} at a time",
    "noreuse_b2b": "{b} POST /execute back-to-back, pool_reuse = false",
    "noreuse_conc8": f"{{b}} POST /execute {conc} concurrent, pool_reuse = false",
}
for s in ("b2b", "warm", "conc8"):
    labels[f"before_{s}"] = labels[s] + ", baseline build"
series, ratios, targets, pool_events = [], [], [], {}
for b, rt in (("docker", "runc"), ("gvisor", "runsc")):
    for s in ("base", "b2b", "noreuse_b2b", "warm", "conc8", "noreuse_conc8", "base8", "before_b2b", "before_warm",
              "before_conc8"):
        x = r.get(f"{b}.{s}")
        if x is None:
            continue
        series.append({"id": f"{b}.{s}", "label": labels[s].format(b=b, rt=rt), "backend": b, "n": x["n"],
                       "errors": x.get("errors", 0), "p50_ms": round(x["p50"], 2), "p95_ms": round(x["p95"], 2),
                       "p99_ms": round(x["p99"], 2),
                       "throughput_per_s": round(x["rps"], 2) if x.get("rps") else None,
                       "samples_ms": [round(v, 2) for v in x["samples"]]})
        if "hits" in x:
            pool_events[f"{b}.{s}"] = f"{int(x['hits'])}/{int(x['misses'])}/{int(x.get('reused', 0))}"
S = {s["id"]: s for s in series}

def div(num, den):
    return None if num is None or den in (None, 0) else num / den

# `before`: the same figure of the baseline build (EXECUTOR_ARM_BASELINE_BIN), when it ran.
def ratio(id, label, v, target=None, ok=None, before=None):
    if v is None:
        return
    ratios.append({"id": id, "label": label, "value": round(v, 3), "target": target,
                   "met": None if ok is None else bool(ok(v)),
                   "before": None if before is None else round(before, 3)})

def target(id, label, value, limit, before=None, unit="ms"):
    if value is None:
        return
    targets.append({"id": id, "label": label, "value": round(value, 2), "unit": unit, "target": f"<= {limit}",
                    "met": value <= limit, "before": None if before is None else round(before, 2)})

def get(id, field):
    return S[id][field] if id in S else None

def ideal_ratio(id):
    # p50 under load / (conc / throughput): how far a request waits beyond its share of the work.
    tp = get(id, "throughput_per_s")
    return div(get(id, "p50_ms"), (conc / tp * 1000) if tp else None)

for b, tput_goal in (("docker", 3.0), ("gvisor", 1.5)):
    base8_tp = get(f"{b}.base8", "throughput_per_s")
    ratio(f"{b}.conc8.tput_vs_docker_run", f"{b} {conc}-concurrent throughput / docker run --rm {conc} at a time",
          div(get(f"{b}.conc8", "throughput_per_s"), base8_tp), f">= {tput_goal}",
          lambda v, g=tput_goal: v >= g, div(get(f"{b}.before_conc8", "throughput_per_s"), base8_tp))
    ratio(f"{b}.conc8.p50_vs_ideal", f"{b} {conc}-concurrent p50 / ({conc} / throughput)",
          ideal_ratio(f"{b}.conc8"), "<= 2.0" if b == "docker" else None,
          (lambda v: v <= 2.0) if b == "docker" else None, ideal_ratio(f"{b}.before_conc8"))
    base_p50 = get(f"{b}.base", "p50_ms")
    ratio(f"{b}.conc8.tput_vs_reuse_off", f"{b} {conc}-concurrent throughput / the same with pool_reuse = false",
          div(get(f"{b}.conc8", "throughput_per_s"), get(f"{b}.noreuse_conc8", "throughput_per_s")))
    ratio(f"{b}.b2b.p50_vs_reuse_off", f"{b} back-to-back p50 / the same with pool_reuse = false",
          div(get(f"{b}.b2b", "p50_ms"), get(f"{b}.noreuse_b2b", "p50_ms")))
    ratio(f"{b}.b2b.p50_vs_docker_run", f"{b} back-to-back p50 / docker run --rm p50",
          div(get(f"{b}.b2b", "p50_ms"), base_p50), before=div(get(f"{b}.before_b2b", "p50_ms"), base_p50))
    ratio(f"{b}.warm.p50_vs_docker_run", f"{b} warm p50 / docker run --rm p50",
          div(get(f"{b}.warm", "p50_ms"), base_p50), before=div(get(f"{b}.before_warm", "p50_ms"), base_p50))
for id, label, limit in (("docker.b2b.p50", "docker back-to-back p50", 25),
                         ("docker.b2b.p95", "docker back-to-back p95", 120),
                         ("docker.b2b.p99", "docker back-to-back p99", 200),
                         ("gvisor.b2b.p95", "gvisor back-to-back p95", 240),
                         ("gvisor.warm.p50", "gvisor warm p50", 20)):
    b, s, p = id.split(".")
    target(id, label, get(f"{b}.{s}", f"{p}_ms"), limit, get(f"{b}.before_{s}", f"{p}_ms"))

print(f"\nhost: {cpus} CPUs, load average {load0} at start, {load1} at end; {t0} .. {t1} UTC")
print(f"binary: {binary}; runsc: {runsc_version} (platform {runsc_platform})")
if baseline_bin:
    print(f"baseline build: {baseline_bin} (series before_*)")
print(f"executor-arm POST /execute 'echo hi' vs docker run --rm (ms; daemon defaults)")
print(f"{'series':20} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'exec/s':>7} {'hit/miss/reused':>15} {'err':>4}  label")
for s in series:
    tp = f"{s['throughput_per_s']:.1f}" if s["throughput_per_s"] else "-"
    hm = pool_events.get(s["id"], "-")
    print(f"{s['id']:20} {s['n']:>4} {s['p50_ms']:>8.1f} {s['p95_ms']:>8.1f} {s['p99_ms']:>8.1f} {tp:>7} {hm:>15} {s['errors']:>4}  {s['label']}")
if ratios:
    print("\nratios")
    for x in ratios:
        met = "" if x["met"] is None else ("  met" if x["met"] else "  MISSED")
        before = "" if x["before"] is None else f"  (baseline build {x['before']:.2f})"
        print(f"  {x['id']:34} {x['value']:>8.2f}  {x['target'] or '':8}{met}{before}")
if targets:
    print("\ntargets")
    for x in targets:
        before = "" if x["before"] is None else f"  (baseline build {x['before']:.1f} {x['unit']})"
        print(f"  {x['id']:34} {x['value']:>8.1f} {x['unit']}  {x['target']:8}  {'met' if x['met'] else 'MISSED'}{before}")
if out:
    with open(out, "w") as f:
        # Ratios without a target are for the table only.
        json.dump({"bench": "docker", "series": series, "ratios": [x for x in ratios if x["target"]],
                   "targets": targets,
                   "facts": {"runsc_version": runsc_version.removeprefix("runsc version ").strip(),
                             "runsc_platform": runsc_platform,
                             **({"baseline_bin": baseline_bin} if baseline_bin else {})}}, f)
    print(f"\nJSON: {out}")
PY
