#!/usr/bin/env bash
# Sessions benchmark on one backend (local [default], runc or gvisor): an exec of print(1) in a
# warm python session against /execute of python3 -c 'print(1)' in the same run, and session
# creation. Needs root; runc and gvisor need dockerd and the sandbox image
# (scripts/setup-docker.sh, scripts/build-sandbox-image.sh).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_sessions
TARGET=${CARGO_TARGET_DIR:-target}
export EXECUTOR_ARM_BIN="${EXECUTOR_ARM_BIN:-$TARGET/release/executor-arm}"
# The in-container supervisor of this build, beside the daemon (where it looks for it).
scripts/build-supervisor.sh --release "${EXECUTOR_ARM_BIN}-supervisor" >/dev/null
BACKEND="${1:-local}" "$TARGET/release/examples/bench_sessions"
