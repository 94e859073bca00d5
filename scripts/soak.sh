#!/usr/bin/env bash
# Soak: mixed traffic against the real daemon on the local, docker (runc) and gvisor (runsc)
# backends at once, bombs and refusals included. Prints, per daemon, RSS, open descriptors, its
# sandbox cgroups and containers at the start and at the end (after the traffic drained), and the
# answers by status. Exits 1 on any 5xx, on a run left behind, or on an audit log that does not
# verify. Asserts nothing about timing.
#
# Usage: scripts/soak.sh [SECONDS=600] [CONCURRENCY=16]
#   BACKENDS ["local docker gvisor"]   one daemon per backend; the workers are spread over them
#   SAMPLE_SECONDS [60]                 how often each daemon's RSS is sampled during the traffic
# Needs: root, python3, and for docker/gvisor a running dockerd with runc + runsc and the
# sandbox image (scripts/setup-docker.sh, scripts/build-sandbox-image.sh).
set -Eeuo pipefail
trap 'echo "soak: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

SECS=${1:-600}
CONC=${2:-16}
BACKENDS=${BACKENDS:-"local docker gvisor"}
SAMPLE_SECONDS=${SAMPLE_SECONDS:-60}
IMAGE=executor-arm-sandbox:latest

cargo build --release --quiet
BIN="$(pwd)/${CARGO_TARGET_DIR:-target}/release/executor-arm"
# The static in-container supervisor, where the daemon looks for it (beside its executable).
scripts/build-supervisor.sh --release "${BIN}-supervisor" >/dev/null
WORK=$(mktemp -d /tmp/executor-arm-soak.XXXXXX)
declare -A PID ADDR
cleanup() {
  for b in "${!PID[@]}"; do kill "${PID[$b]}" 2>/dev/null || true; done
  for b in "${!PID[@]}"; do wait "${PID[$b]}" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/secret"

start_daemon() { # backend
  local b=$1 rt
  case $b in local) rt=local ;; docker) rt=runc ;; gvisor) rt=gvisor ;; esac
  mkdir -p "$WORK/$b"
  printf '[sandbox.docker]\nimage = "%s"\npool_size = 4\n[server.concurrency]\nlocal = 16\ndocker = 8\ngvisor = 8\n' \
    "$IMAGE" >"$WORK/$b/config.toml"
  SANDBOX_RUNTIME=$rt EXECUTOR_ARM_JWT_SECRET_FILE="$WORK/secret" EXECUTOR_ARM_AUDIT_LOG="$WORK/$b/audit.jsonl" \
    RUST_LOG=info "$BIN" serve --config "$WORK/$b/config.toml" --listen 127.0.0.1:0 2>"$WORK/$b/daemon.log" &
  PID[$b]=$!
  for _ in $(seq 300); do
    ADDR[$b]=$(grep -o '"addr":"[^"]*"' "$WORK/$b/daemon.log" | head -1 | cut -d'"' -f4) && [ -n "${ADDR[$b]}" ] && return
    sleep 0.1
  done
  cat "$WORK/$b/daemon.log" >&2
  return 1
}

# What a daemon holds: RSS KiB, open fds, its sandbox cgroups (local), its containers (docker).
snapshot() { # backend
  local b=$1 pid=${PID[$1]} rss fds cg=0 ct=0
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
  fds=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 | wc -l)
  if [ "$b" = local ]; then
    # Run cgroups (v1 pids hierarchy or v2 runs dir), idle prepared slots (warm-N) aside.
    local d
    for d in "/sys/fs/cgroup/pids/executor-arm/d$pid" "/sys/fs/cgroup/runs/d$pid"; do
      [ -d "$d" ] && cg=$((cg + $(find "$d" -mindepth 1 -maxdepth 1 -type d ! -name 'warm-*' | wc -l)))
    done
  else
    # Containers of runs (idle pool containers are labelled pool-<uuid>).
    ct=$(docker ps -a --filter "label=executor-arm.instance=$(hostname)-$pid" \
         --format '{{.Label "executor-arm.exec_id"}}' | awk '!/^pool-/' | wc -l)
  fi
  echo "$rss $fds $cg $ct"
}

for b in $BACKENDS; do start_daemon "$b"; done
SVC=$("$BIN" token mint --kind service --secret-file "$WORK/secret" --ttl 3600 --sub soak | tail -1)
CAP=$("$BIN" token mint --kind capability --secret-file "$WORK/secret" --ttl 3600 --sub soak \
      --capabilities ShellRead,ShellExecute,FilesystemRead,FilesystemWrite,PythonExecute | tail -1)

cat >"$WORK/traffic.py" <<'PY'
"""Workers send a weighted mix of requests until the deadline; one JSON line of status counts."""
import http.client, json, random, sys, threading, time
addrs, svc, cap, secs, conc = sys.argv[1].split(","), sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
PY_FORK = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
PY_MEM = "x = []\nwhile True: x.append(bytearray(16 << 20))"
PY_FLOOD = "import sys\nwhile True: sys.stdout.write('y' * 65536)"
MIX = [  # (weight, name, body overrides, expected statuses)
    (30, "echo", {"action_type": "shell", "command": "echo", "args": ["soak"]}, {200}),
    (10, "ls", {"action_type": "shell", "command": "ls", "args": ["-la", "/"]}, {200}),
    (10, "python", {"action_type": "python", "command": "python3", "args": ["-c", "print(sum(range(10**5)))"]}, {200}),
    (5, "stdin", {"action_type": "python", "command": "python3", "args": ["-c", "import sys; print(len(sys.stdin.read()))"],
                  "stdin": "z" * 200000}, {200}),
    (4, "timeout", {"action_type": "python", "command": "python3", "args": ["-c", "import time; time.sleep(30)"],
                    "timeout_seconds": 2}, {408}),
    (3, "fork_bomb", {"action_type": "python", "command": "python3", "args": ["-c", PY_FORK], "timeout_seconds": 5}, {200, 408}),
    (3, "memory_bomb", {"action_type": "python", "command": "python3", "args": ["-c", PY_MEM], "timeout_seconds": 10}, {200, 408}),
    (3, "flood", {"action_type": "python", "command": "python3", "args": ["-c", PY_FLOOD], "timeout_seconds": 3}, {200, 408}),
    (5, "forbidden", {"action_type": "shell", "command": "rm", "args": ["-rf", "/"]}, {403}),
    (3, "bad_token", {"action_type": "shell", "command": "echo", "capability_token": "x.y.z"}, {401}),
    (3, "bad_body", None, {400}),
]
weights = [m[0] for m in MIX]
deadline = time.time() + secs
lock = threading.Lock()
counts, unexpected = {}, []

def one(conn, name, over, expect):
    if over is None:
        body = b'{"action_type": "shell", "command": '
    else:
        req = {"capability_token": cap}
        req.update(over)
        body = json.dumps(req).encode()
    conn.request("POST", "/execute", body, {"Authorization": f"Bearer {svc}", "Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    with lock:
        key = f"{name}:{r.status}"
        counts[key] = counts.get(key, 0) + 1
        if r.status >= 500 or (r.status not in expect and r.status != 429):
            unexpected.append(key)
    if r.status == 429:
        time.sleep(float(r.getheader("Retry-After") or 1))

def worker(i):
    addr = addrs[i % len(addrs)]
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    rnd = random.Random(i)
    while time.time() < deadline:
        _, name, over, expect = rnd.choices(MIX, weights)[0]
        try:
            one(conn, name, over, expect)
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            with lock:
                unexpected.append(f"{name}:{type(e).__name__}")
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=120)

ts = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps({"counts": dict(sorted(counts.items())), "unexpected": unexpected[:50], "n_unexpected": len(unexpected)}))
PY

# Warm each daemon (first runs create pools and prepared slots), then take the start figures.
addrs=""
for b in $BACKENDS; do
  addrs="$addrs${addrs:+,}${ADDR[$b]}"
  code=$(curl -s -o "$WORK/$b/warm.json" -w '%{http_code}' "http://${ADDR[$b]}/execute" \
    -H "Authorization: Bearer $SVC" -H 'Content-Type: application/json' \
    -d "{\"action_type\":\"shell\",\"command\":\"echo\",\"args\":[\"warm\"],\"capability_token\":\"$CAP\"}")
  [ "$code" = 200 ] || { echo "soak: $b: warm-up answered $code: $(cat "$WORK/$b/warm.json")" >&2; exit 1; }
done
sleep 5
declare -A START
for b in $BACKENDS; do START[$b]=$(snapshot "$b"); done

echo "soak: ${SECS}s at concurrency $CONC over: $BACKENDS (load at start: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
# RSS over time, so growth that levels off can be told from growth that does not.
(
  t0=$SECONDS
  while sleep "$SAMPLE_SECONDS"; do
    line="t+$((SECONDS - t0))s"
    for b in $BACKENDS; do
      line="$line $b=$(awk '/^VmRSS/ {print $2}' "/proc/${PID[$b]}/status" 2>/dev/null)KiB"
    done
    echo "$line" >>"$WORK/rss.txt"
  done
) &
SAMPLER=$!
RESULT=$(python3 "$WORK/traffic.py" "$addrs" "$SVC" "$CAP" "$SECS" "$CONC")
kill "$SAMPLER"
# Let kills, container removals and slot replacements finish before the end figures.
sleep 20
status=0
printf '%-8s %-28s %-28s\n' backend "start rss_kib/fds/cgroups/ctrs" "end rss_kib/fds/cgroups/ctrs"
for b in $BACKENDS; do
  end=$(snapshot "$b")
  printf '%-8s %-28s %-28s\n' "$b" "${START[$b]}" "$end"
  read -r _ _ cg ct <<<"$end"
  if [ "$cg" -gt 0 ] || [ "$ct" -gt 0 ]; then echo "soak: $b left $cg cgroups, $ct run containers" >&2; status=1; fi
  if ! "$BIN" audit verify "$WORK/$b/audit.jsonl" >/dev/null; then echo "soak: $b audit log does not verify" >&2; status=1; fi
  if ! kill -0 "${PID[$b]}" 2>/dev/null; then echo "soak: $b daemon died" >&2; status=1; fi
done
echo "RSS during the traffic:"
if [ -f "$WORK/rss.txt" ]; then sed 's/^/  /' "$WORK/rss.txt"; fi
echo "$RESULT" | python3 -c 'import json,sys; r=json.load(sys.stdin); [print(f"  {k:>22} {v}") for k,v in r["counts"].items()]; print("unexpected:", r["n_unexpected"], r["unexpected"][:10])'
[ "$(echo "$RESULT" | python3 -c 'import json,sys; print(json.load(sys.stdin)["n_unexpected"])')" = 0 ] || status=1
if [ $status -ne 0 ]; then
  for b in $BACKENDS; do
    echo "--- $b: the daemon's WARN/ERROR lines (last 20)" >&2
    grep -E '"level":"(WARN|ERROR)"' "$WORK/$b/daemon.log" | tail -20 >&2
  done
fi
exit $status
