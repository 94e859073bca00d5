#!/usr/bin/env bash
# Runs every cargo-fuzz target of executor-arm for a bounded time and prints, per target, the
# executions, the coverage reached and the crashes found. Exits 1 when any target crashes.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET=60] [TARGET...]
#   targets (fuzz/Cargo.toml; docs/security.md says what each checks): execute_request, token,
#   egress_http, executor_yaml, profile_toml, audit_roundtrip, argpolicy, supervisor_protocol,
#            checkpoint_note, receipt_envelope
#   FUZZ_JOBS [1]       targets fuzzed at once
#   FUZZ_SEED [random]  libFuzzer's -seed: with it, a run repeats the same inputs in the same order
#                       (the test command sets it, so a CI run explores what was explored before)
#   FUZZ_CORPUS [temp]  where each target's growing corpus is kept (default: a temp dir, removed
#                       at exit; fuzz/seeds/<target> is read, never written)
#
# Works with the stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its unstable flags, and
# `--sanitizer none` because a stable toolchain ships no sanitizer runtimes. Coverage guidance
# (SanitizerCoverage) works without a sanitizer; memory-safety bugs in unsafe code would need
# ASan, which this build does not have.
set -Eeuo pipefail
trap 'echo "fuzz: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

SECS=${1:-60}
[ $# -gt 0 ] && shift
JOBS=${FUZZ_JOBS:-1}
export RUSTC_BOOTSTRAP=1

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz"
  cargo install cargo-fuzz --locked --version 0.13.2
fi

cd fuzz
if [ $# -gt 0 ]; then targets=("$@"); else mapfile -t targets < <(cargo fuzz list); fi
# One build of every target.
cargo fuzz build --sanitizer none

WORK=${FUZZ_CORPUS:-}
if [ -z "$WORK" ]; then
  WORK=$(mktemp -d /tmp/executor-arm-fuzz.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK/logs"

run_one() {
  local t=$1
  rm -rf "artifacts/$t"
  mkdir -p "$WORK/corpus/$t" "artifacts/$t"
  cargo fuzz run --sanitizer none "$t" "$WORK/corpus/$t" "seeds/$t" -- \
    ${FUZZ_SEED:+-seed="$FUZZ_SEED"} -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="artifacts/$t/" >"$WORK/logs/$t.log" 2>&1
}

pids=()
status=0
for t in "${targets[@]}"; do
  run_one "$t" &
  pids+=("$!:$t")
  if [ ${#pids[@]} -ge "$JOBS" ]; then
    entry=${pids[0]}; pids=("${pids[@]:1}")
    wait "${entry%%:*}" || status=1
  fi
done
for entry in "${pids[@]}"; do wait "${entry%%:*}" || status=1; done

printf '%-20s %12s %8s %8s %8s\n' target executions exec/s cov crashes
for t in "${targets[@]}"; do
  log="$WORK/logs/$t.log"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  crashes=$(find "artifacts/$t" -type f | wc -l)
  printf '%-20s %12s %8s %8s %8s\n' "$t" "${execs:-?}" "${speed:-?}" "${cov:-?}" "$crashes"
  if [ "$crashes" -gt 0 ] || ! grep -q '^stat::number_of_executed_units' "$log"; then
    status=1
    echo "--- $t: $log" >&2
    tail -30 "$log" >&2
  fi
done
exit $status
