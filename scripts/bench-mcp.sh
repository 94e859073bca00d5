#!/usr/bin/env bash
# MCP benchmark on the local backend: `execute` of `echo hi` through /mcp (the official Rust SDK's
# client, one MCP session kept) against POST /execute of the same command in the same run.
# Needs root (the local sandbox).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_mcp
TARGET=${CARGO_TARGET_DIR:-target}
export EXECUTOR_ARM_BIN="${EXECUTOR_ARM_BIN:-$TARGET/release/executor-arm}"
"$TARGET/release/examples/bench_mcp"
