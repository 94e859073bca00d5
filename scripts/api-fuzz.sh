#!/usr/bin/env bash
# Fuzz the live daemon against its own OpenAPI document with Schemathesis:
#   1. a Python venv with pinned schemathesis and openapi-spec-validator in .tools/ (cached),
#   2. openapi/executor-arm.json validated as an OpenAPI 3.1 document,
#   3. `executor-arm serve --dev` on a free loopback port (its banner's minted service and
#      capability tokens are parsed and handed to scripts/api-fuzz/hooks.py, which puts them on
#      every request),
#   4. schemathesis run, bounded (API_FUZZ_MAX_EXAMPLES per operation, API_FUZZ_MAX_TIME seconds
#      in all), with the checks not_a_server_error, status_code_conformance,
#      content_type_conformance and response_schema_conformance,
#   5. the status coverage check (scripts/api-fuzz/status_coverage.py): every (operation, status)
#      the document lists was answered by the daemon to this run or to a test of tests/ (their
#      daemons' status logs: the directory given as $1, default
#      ${CARGO_TARGET_DIR:-target}/tmp/status-log, filled by `cargo test`).
# The daemon is stopped and its files removed on exit. Needs root (the local sandbox) and the
# binary ($EXECUTOR_ARM_BIN, else ${CARGO_TARGET_DIR:-target}/release/executor-arm, built here
# when missing). PyPI is the only download. Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
VENV="$TOOLS/api-fuzz-venv"
PY="$VENV/bin/python"
PY_REQUIREMENTS=("schemathesis==4.32.5" "openapi-spec-validator==0.9.0")
MAX_EXAMPLES="${API_FUZZ_MAX_EXAMPLES:-25}"
MAX_TIME="${API_FUZZ_MAX_TIME:-150}"
SEED="${API_FUZZ_SEED:-1}"
DOC="$ROOT/openapi/executor-arm.json"

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'api-fuzz: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/pinned-venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/pinned-venv.sh"

[[ $(id -u) -eq 0 ]] || die "must run as root (the daemon's local sandbox)"

step "python venv ($VENV)"
pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}"

step "validate $DOC (OpenAPI 3.1)"
"$PY" - "$DOC" <<'PYEOF'
import json, sys
from openapi_spec_validator import validate
from openapi_spec_validator.validation import OpenAPIV31SpecValidator
doc = json.load(open(sys.argv[1]))
assert doc["openapi"].startswith("3.1."), doc["openapi"]
validate(doc, cls=OpenAPIV31SpecValidator)
print(f"valid OpenAPI {doc['openapi']}: {len(doc['paths'])} paths, {len(doc['components']['schemas'])} schemas")
PYEOF

BIN="${EXECUTOR_ARM_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/executor-arm}"
if [[ ! -x "$BIN" ]]; then
  step "build $BIN"
  (cd "$ROOT" && cargo build --release --locked)
fi

WORK="$(mktemp -d)"
DAEMON_PID=""
cleanup() {
  if [[ -n "$DAEMON_PID" ]] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$DAEMON_PID" 2>/dev/null || true
    wait "$DAEMON_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

step "start the daemon (serve --dev)"
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mkdir -p "$WORK/sessions"
(
  cd "$WORK"
  export EXECUTOR_ARM_AUDIT_LOG="$WORK/audit.jsonl" EXECUTOR_ARM_SESSIONS_DIR="$WORK/sessions"
  export EXECUTOR_ARM_STATUS_LOG="$WORK/statuses.log" RUST_LOG=warn
  exec "$BIN" serve --dev --listen "127.0.0.1:$PORT"
) > "$WORK/daemon.out" 2> "$WORK/daemon.err" &
DAEMON_PID=$!
for _ in $(seq 1 100); do
  grep -q "^curl " "$WORK/daemon.out" 2>/dev/null && break
  kill -0 "$DAEMON_PID" 2>/dev/null || { cat "$WORK/daemon.err" >&2; die "the daemon exited"; }
  sleep 0.1
done
CURL_LINE="$(grep -m1 "^curl " "$WORK/daemon.out")" || die "no curl line in the dev banner"
SERVICE_TOKEN="$(sed -E "s/.*Authorization: Bearer ([^']+)'.*/\1/" <<<"$CURL_LINE")"
CAPABILITY_TOKEN="$(sed -E 's/.*"capability_token":"([^"]+)".*/\1/' <<<"$CURL_LINE")"
[[ "$SERVICE_TOKEN" == ey* && "$CAPABILITY_TOKEN" == ey* ]] || die "cannot parse the tokens of: $CURL_LINE"
curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null || die "the daemon is not ready"
echo "daemon pid $DAEMON_PID on 127.0.0.1:$PORT"

step "schemathesis (≤ $MAX_EXAMPLES examples per operation, ≤ $MAX_TIME s, seed $SEED)"
status=0
(
  cd "$WORK"
  export PYTHONPATH="$ROOT/scripts/api-fuzz" SCHEMATHESIS_HOOKS=hooks
  export EXECUTOR_ARM_FUZZ_SERVICE_TOKEN="$SERVICE_TOKEN" EXECUTOR_ARM_FUZZ_CAPABILITY_TOKEN="$CAPABILITY_TOKEN"
  "$VENV/bin/schemathesis" run "$DOC" --url "http://127.0.0.1:$PORT" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --max-examples "$MAX_EXAMPLES" --max-time "$MAX_TIME" --seed "$SEED" \
    --phases examples,coverage,fuzzing --workers 1 --request-timeout 30 \
    --no-color
) || status=$?

step "status coverage"
# The status logs of the integration tests' daemons: the directory given, else the default one.
TEST_LOGS="${1:-${CARGO_TARGET_DIR:-$ROOT/target}/tmp/status-log}"
if ! "$PY" "$ROOT/scripts/api-fuzz/status_coverage.py" "$DOC" "$WORK/statuses.log" "$TEST_LOGS"; then
  # A documented status no test answers fails the run. API_FUZZ_STRICT_COVERAGE=0 only reports
  # the gaps (this script run alone, without the integration tests' logs).
  [[ "${API_FUZZ_STRICT_COVERAGE:-1}" == 1 ]] && status=1
fi

if [[ $status -ne 0 ]]; then
  echo "--- daemon stderr (last 40 lines)"; tail -40 "$WORK/daemon.err" || true
  die "failed"
fi
echo
echo "api-fuzz: OK"
