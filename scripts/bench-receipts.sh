#!/usr/bin/env bash
# Receipts benchmark: making and signing one receipt in process, and POST /execute of `echo hi`
# with "receipt": true against the same request without it, in the same run, on the local
# backend. Needs root (the local sandbox).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_receipts
TARGET=${CARGO_TARGET_DIR:-target}
export EXECUTOR_ARM_BIN="${EXECUTOR_ARM_BIN:-$TARGET/release/executor-arm}"
"$TARGET/release/examples/bench_receipts"
