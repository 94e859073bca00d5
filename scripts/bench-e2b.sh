#!/usr/bin/env bash
# E2B benchmark: Sandbox.create + commands.run("echo hi") through the official E2B Python SDK
# against the same steps over the REST API, in the same run, on each backend (`BACKENDS`, default
# "local runc gvisor"). Needs root (the local sandbox) and, for runc and gvisor, dockerd with the
# sandbox image (scripts/setup-docker.sh, scripts/build-sandbox-image.sh).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin executor-arm --example bench_e2b
TARGET=${CARGO_TARGET_DIR:-target}
export EXECUTOR_ARM_BIN="${EXECUTOR_ARM_BIN:-$TARGET/release/executor-arm}"
scripts/build-supervisor.sh --release "${EXECUTOR_ARM_BIN}-supervisor" >/dev/null
for backend in ${BACKENDS:-local runc gvisor}; do
  echo "== $backend"
  BACKEND=$backend "$TARGET/release/examples/bench_e2b"
done
