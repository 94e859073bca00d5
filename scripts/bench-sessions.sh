#!/usr/bin/env bash
# Sessions benchmark (local backend): an exec of print(1) in a warm python session against
# /execute of python3 -c 'print(1)' in the same run, and session creation. Needs root.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_sessions
target/release/examples/bench_sessions
