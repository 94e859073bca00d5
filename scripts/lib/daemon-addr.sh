# shellcheck shell=bash
# daemon_addr LOG: prints the listen address a daemon started with `--listen 127.0.0.1:0` logs as
# JSON ("addr") to LOG, waiting up to 10 s; on timeout prints the log to stderr and returns 1.
daemon_addr() {
  local log=$1 addr=""
  for _ in $(seq 100); do
    # No line yet is not an error: grep finds nothing until the daemon has logged it.
    addr=$(grep -o '"addr":"[^"]*"' "$log" | head -1 | cut -d'"' -f4 || true)
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    sleep 0.1
  done
  cat "$log" >&2
  return 1
}
