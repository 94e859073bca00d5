#!/usr/bin/env bash
# Streaming benchmark: line latency over Server-Sent Events (against a plain pipe) and the cost of
# streaming `echo hi` (against the JSON call), for each runtime in RUNTIMES (default: local runc).
# Needs root (the local sandbox); runc needs scripts/setup-docker.sh and the sandbox image.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_stream
for rt in ${RUNTIMES:-local runc}; do
    SANDBOX_RUNTIME=$rt target/release/examples/bench_stream
done
