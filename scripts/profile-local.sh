#!/usr/bin/env bash
# Where a local-backend request spends blocking time: N back-to-back POST /execute `echo hi` on one
# keep-alive connection against a daemon binary, printing p50/p95/p99/max; with SYSCALLS set
# (strace's -e trace= list, e.g. "write,fdatasync,rmdir"), the daemon is traced meanwhile
# (strace -f -y -T) and each syscall's blocking time is summarised per file it acted on.
# Asserts nothing. Needs root, python3 and, for SYSCALLS, strace.
#
#   scripts/profile-local.sh [BINARY] [N]     BINARY defaults to target/release/executor-arm, N to 300
set -Eeuo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/daemon-addr.sh
source scripts/lib/daemon-addr.sh
BIN=${1:-target/release/executor-arm}
N=${2:-300}
WORK=$(mktemp -d /tmp/profile-local.XXXXXX)
PID="" STRACE=""
cleanup() {
  [ -n "$STRACE" ] && kill -INT "$STRACE" 2>/dev/null && wait "$STRACE" 2>/dev/null
  [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/secret"
EXECUTOR_ARM_JWT_SECRET_FILE="$WORK/secret" EXECUTOR_ARM_AUDIT_LOG="$WORK/audit.jsonl" \
  EXECUTOR_ARM_SESSIONS_DIR="$WORK/sessions" EXECUTOR_ARM__SANDBOX__LOCAL__CGROUP_NAME=executor-arm-profile \
  RUST_LOG=info "$BIN" serve --listen 127.0.0.1:0 2>"$WORK/daemon.log" &
PID=$!
ADDR=$(daemon_addr "$WORK/daemon.log") || exit 1
SVC=$("$BIN" token mint --kind service --secret-file "$WORK/secret" --ttl 3600 --sub profile | tail -1)
CAP=$("$BIN" token mint --kind capability --secret-file "$WORK/secret" --ttl 3600 --sub profile --capabilities ShellExecute | tail -1)
cat >"$WORK/client.py" <<'PY'
import http.client, json, sys, time
addr, svc, cap, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
host, port = addr.rsplit(":", 1)
body = json.dumps({"action_type": "shell", "command": "echo", "args": ["hi"], "capability_token": cap})
headers = {"Authorization": f"Bearer {svc}", "Content-Type": "application/json"}
conn = http.client.HTTPConnection(host, int(port), timeout=30)
lat = []
for _ in range(n):
    t = time.perf_counter()
    conn.request("POST", "/execute", body, headers)
    r = conn.getresponse()
    data = r.read()
    lat.append((time.perf_counter() - t) * 1000)
    assert r.status == 200, data
lat.sort()
p = lambda q: lat[min(len(lat) - 1, int(round(q / 100 * (len(lat) - 1))))]
print(f"POST /execute echo hi  n={n} p50={p(50):.2f} p95={p(95):.2f} p99={p(99):.2f} max={lat[-1]:.2f} ms")
PY
python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" 30 >/dev/null  # warm-up
if [ -n "${SYSCALLS:-}" ]; then
  strace -f -y -T -p "$PID" -o "$WORK/strace.out" -e trace="$SYSCALLS" 2>/dev/null &
  STRACE=$!
  sleep 1
fi
python3 "$WORK/client.py" "$ADDR" "$SVC" "$CAP" "$N"
if [ -n "$STRACE" ]; then
  # strace ends once its tracee does (detaching from a busy multi-threaded tracee can hang).
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
  wait "$STRACE" 2>/dev/null || true; STRACE=""
  python3 - "$WORK/strace.out" <<'PY'
"""Blocking time per syscall and file (strace -y shows the path of each descriptor)."""
import collections, re, sys
times, pending = collections.defaultdict(list), {}
for line in open(sys.argv[1]):
    m = re.match(r"(\d+)\s+(.*)$", line.rstrip())
    if not m:
        continue
    pid, rest = m.groups()
    resumed = re.match(r"<\.\.\. (\w+) resumed>.*<([\d.]+)>$", rest)
    if resumed:
        name, args, t = resumed.group(1), pending.pop(pid, ""), float(resumed.group(2))
    else:
        call = re.match(r"(\w+)\((.*)$", rest)
        if not call:
            continue
        if rest.endswith("<unfinished ...>"):
            pending[pid] = call.group(2)
            continue
        took = re.search(r"<([\d.]+)>$", rest)
        if not took:
            continue
        name, args, t = call.group(1), call.group(2), float(took.group(1))
    fd = re.match(r"\d+<([^>]*)>", args)
    key = name + (":" + fd.group(1).rsplit("/", 1)[-1] if fd else "")
    times[key].append(t * 1000)
for key, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:20]:
    v.sort()
    print(f"{key:40} n={len(v):5} total={sum(v):8.1f} ms p50={v[len(v) // 2]:.3f} "
          f"p99={v[int(len(v) * 0.99)]:.3f} max={v[-1]:.2f}")
PY
fi
