#!/usr/bin/env bash
# Benchmarks of executor-arm. Needs root (the local sandbox) and bubblewrap (installed with apt-get
# when missing).
#
#   scripts/bench.sh        local backend: p50/p95/p99 of POST /execute `echo hi` beside fork/exec
#                           and bwrap measured in the same run, sporadic requests, and throughput at
#                           16 in flight against bwrap 16 at a time (examples/bench_local.rs).
#   scripts/bench.sh all    every benchmark in one run, then docs/benchmarks.md and
#                           docs/benchmarks.png written from its results (scripts/bench/report.py):
#                           local; sessions on local; streaming on local; MCP, receipts and the
#                           E2B SDK on local; and, when dockerd answers and the sandbox image
#                           exists, sessions and the E2B SDK on runc (and gvisor when runsc is
#                           registered), streaming on runc and scripts/bench-docker.sh. Each
#                           benchmark writes JSON into the results directory; one that fails or is
#                           left out is reported as not run, with the reason.
#   scripts/bench.sh test   the report generator's tests, on fixture results.
#
# Environment (defaults in brackets):
#   BENCH_QUICK=1               a tenth of the samples in every benchmark (N_WARM, N_COLD, N_BASE,
#                               N_TPUT of bench-docker.sh too): checks that the run works; the
#                               figures are not a measurement [unset]
#   BENCH_DOCKER=0              `all` leaves out every docker and gvisor run [1]
#   BENCH_RESULTS=DIR           the results directory of `all`
#                               [$CARGO_TARGET_DIR/bench-results/<UTC start time>]
#   BENCH_DOCS=DIR              where `all` writes benchmarks.md and benchmarks.png [docs]
#   EXECUTOR_ARM_BASELINE_BIN   another build of the daemon: bench_local adds its series to the same
#                               run, for an old-beside-new comparison [unset]
#   CARGO_TARGET_DIR            where the release build goes [target]
#   EXECUTOR_ARM_TOOLS_DIR      where the report's Python venv (pinned matplotlib) is kept [.tools]
set -Eeuo pipefail
trap 'echo "bench: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."
ROOT=$PWD
TARGET=${CARGO_TARGET_DIR:-target}
EXAMPLES="$TARGET/release/examples"
export EXECUTOR_ARM_BIN="${EXECUTOR_ARM_BIN:-$TARGET/release/executor-arm}"
VENV="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}/bench-venv"
PY_REQUIREMENTS=("matplotlib==3.11.2")
IMAGE=executor-arm-sandbox:latest
# No __pycache__ beside scripts/bench/*.py.
export PYTHONDONTWRITEBYTECODE=1

# shellcheck source=lib/pinned-venv.sh
source "$ROOT/scripts/lib/pinned-venv.sh"

need_root_and_bwrap() {
  [[ $(id -u) -eq 0 ]] || { echo "bench: must run as root (the local sandbox)" >&2; exit 1; }
  command -v bwrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap
}

report_tests() {
  pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}"
  (cd "$ROOT/scripts/bench" && "$VENV/bin/python" -m unittest -v test_report)
}

# run_bench NAME COMMAND...: runs one benchmark with BENCH_JSON=$RESULTS/NAME.json, its output
# shown and kept in NAME.log, and its outcome recorded in runs.tsv.
run_bench() {
  local name=$1 rc=0
  shift
  printf '\n== %s\n' "$name"
  BENCH_JSON="$RESULTS/$name.json" "$@" 2>&1 | tee "$RESULTS/$name.log" || rc=$?
  if [[ $rc -eq 0 ]]; then
    printf '%s\t%s\tok\n' "$name" "$name.json" >>"$RESULTS/runs.tsv"
  else
    echo "bench: $name failed (exit $rc); the report says so" >&2
    printf '%s\t%s\tfailed (exit %s)\n' "$name" "$name.json" "$rc" >>"$RESULTS/runs.tsv"
  fi
}

skip_bench() {
  printf '\n== %s: skipped (%s)\n' "$1" "$2"
  printf '%s\t%s\tskipped: %s\n' "$1" "$1.json" "$2" >>"$RESULTS/runs.tsv"
}

# The command line as it was given, with the knobs that change what is measured (taken before
# BENCH_QUICK sets bench-docker.sh's sample counts).
command_line() {
  local words=() v
  for v in BENCH_QUICK BENCH_DOCKER EXECUTOR_ARM_BASELINE_BIN N_WARM N_COLD N_BASE N_TPUT CONC POOL; do
    [[ -n "${!v:-}" ]] && words+=("$v=${!v}")
  done
  words+=("scripts/bench.sh" "all")
  echo "${words[*]}"
}

bench_all() {
  need_root_and_bwrap
  local stamp docs runtimes cmdline quick_flag=() docker_reason="" gvisor_reason=""
  cmdline=$(command_line)
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  RESULTS=${BENCH_RESULTS:-$TARGET/bench-results/$stamp}
  docs=${BENCH_DOCS:-docs}
  mkdir -p "$RESULTS" "$docs"
  : >"$RESULTS/runs.tsv"
  echo "bench: results in $RESULTS"
  python3 scripts/bench/facts.py >"$RESULTS/facts-start.json"

  cargo build --release --locked --bin executor-arm \
    --example bench_local --example bench_sessions --example bench_stream \
    --example bench_mcp --example bench_receipts --example bench_e2b
  # The in-container supervisor of this build, where the daemon looks for it (beside its
  # executable): the container benchmarks must not run an older one.
  scripts/build-supervisor.sh --release "${EXECUTOR_ARM_BIN}-supervisor" >/dev/null

  if [[ -n "${BENCH_QUICK:-}" && "${BENCH_QUICK}" != 0 ]]; then
    quick_flag=(--quick)
    export N_WARM=${N_WARM:-10} N_COLD=${N_COLD:-5} N_BASE=${N_BASE:-5} N_TPUT=${N_TPUT:-24}
  fi
  if [[ "${BENCH_DOCKER:-1}" == 0 ]]; then
    docker_reason="BENCH_DOCKER=0"
  elif ! docker info >/dev/null 2>&1; then
    docker_reason="dockerd not reachable"
  elif ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    docker_reason="no $IMAGE image (scripts/build-sandbox-image.sh)"
  fi
  gvisor_reason=$docker_reason
  if [[ -z "$gvisor_reason" && "$(docker info --format '{{json .Runtimes}}')" != *runsc* ]]; then
    gvisor_reason="runsc not registered with dockerd (scripts/setup-docker.sh)"
  fi

  run_bench local "$EXAMPLES/bench_local"
  run_bench sessions-local env BACKEND=local "$EXAMPLES/bench_sessions"
  if [[ -z "$docker_reason" ]]; then
    run_bench sessions-runc env BACKEND=runc "$EXAMPLES/bench_sessions"
  else
    skip_bench sessions-runc "$docker_reason"
  fi
  if [[ -z "$gvisor_reason" ]]; then
    run_bench sessions-gvisor env BACKEND=gvisor "$EXAMPLES/bench_sessions"
  else
    skip_bench sessions-gvisor "$gvisor_reason"
  fi
  run_bench stream-local env SANDBOX_RUNTIME=local "$EXAMPLES/bench_stream"
  run_bench mcp-local "$EXAMPLES/bench_mcp"
  run_bench receipts-local "$EXAMPLES/bench_receipts"
  run_bench e2b-local env BACKEND=local "$EXAMPLES/bench_e2b"
  if [[ -z "$docker_reason" ]]; then
    run_bench e2b-runc env BACKEND=runc "$EXAMPLES/bench_e2b"
  else
    skip_bench e2b-runc "$docker_reason"
  fi
  if [[ -z "$gvisor_reason" ]]; then
    run_bench e2b-gvisor env BACKEND=gvisor "$EXAMPLES/bench_e2b"
  else
    skip_bench e2b-gvisor "$gvisor_reason"
  fi
  if [[ -z "$docker_reason" ]]; then
    run_bench stream-runc env SANDBOX_RUNTIME=runc "$EXAMPLES/bench_stream"
    runtimes="runc gvisor"
    if [[ -n "$gvisor_reason" ]]; then runtimes=runc; fi
    run_bench docker env RUNTIMES="$runtimes" scripts/bench-docker.sh
  else
    skip_bench stream-runc "$docker_reason"
    skip_bench docker "$docker_reason"
  fi

  python3 scripts/bench/facts.py --end >"$RESULTS/facts-end.json"
  printf '\n== report\n'
  pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}"
  "$VENV/bin/python" scripts/bench/report.py --results "$RESULTS" \
    --out "$docs/benchmarks.md" --png "$docs/benchmarks.png" \
    --command "$cmdline" "${quick_flag[@]}"
  printf '\nbench: runs\n'
  cat "$RESULTS/runs.tsv"
}

case "${1:-}" in
  "")
    need_root_and_bwrap
    cargo build --release --locked --bin executor-arm --example bench_local
    exec "$EXAMPLES/bench_local"
    ;;
  all) bench_all ;;
  test) report_tests ;;
  *)
    echo "usage: scripts/bench.sh [all|test]" >&2
    exit 2
    ;;
esac
