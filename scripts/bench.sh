#!/usr/bin/env bash
# Local-backend benchmark: p50/p95/p99 of POST /execute `echo hi` beside fork/exec and bwrap,
# measured in the same run. Needs root (the local sandbox) and bubblewrap. EXECUTOR_ARM_BASELINE_BIN
# (another build of the daemon) adds its series to the same run, for an old-beside-new comparison.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
command -v bwrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap
cargo build --release --locked --bin executor-arm --example bench_local
exec target/release/examples/bench_local
