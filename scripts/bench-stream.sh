#!/usr/bin/env bash
# Streaming benchmark: line latency over Server-Sent Events (against a plain pipe) and the cost of
# streaming `echo hi` (against the JSON call), for each runtime in RUNTIMES (default: local runc).
# Needs root (the local sandbox); runc needs scripts/setup-docker.sh and the sandbox image.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_stream
TARGET=${CARGO_TARGET_DIR:-target}
export EXECUTOR_ARM_BIN="${EXECUTOR_ARM_BIN:-$TARGET/release/executor-arm}"
for rt in ${RUNTIMES:-local runc}; do
    SANDBOX_RUNTIME=$rt "$TARGET/release/examples/bench_stream"
done
