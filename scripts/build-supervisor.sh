#!/usr/bin/env bash
# Builds executor-arm-supervisor, the in-container supervisor (PID 1 of every docker/gvisor
# sandbox), as a STATIC executable (glibc linked in: `-C target-feature=+crt-static`), so it runs
# in any sandbox image (musl, distroless, no libc at all), and prints its path. The daemon refuses
# a dynamically linked one (sandbox.docker.supervisor; default: beside the daemon's executable).
#
# Usage: scripts/build-supervisor.sh [--release] [DEST]
#   --release   optimised (what ships); default: the dev profile (tests)
#   DEST        also install it there (mode 0755), e.g. target/release/executor-arm-supervisor
# Environment: SUPERVISOR_TARGET_DIR [target/supervisor-static], its own target dir: the flags
# differ from the workspace's, and a build here never waits on (or invalidates) the main one.
#
# `--target <host triple>` keeps RUSTFLAGS off build scripts and proc macros (which must stay
# dynamic); only the host's own target is needed, no other Rust target.
set -Eeuo pipefail
trap 'echo "build-supervisor: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

profile=debug
args=()
if [ "${1:-}" = "--release" ]; then
  profile=release
  args+=(--release)
  shift
fi
triple=$(rustc -vV | sed -n 's/^host: //p')
dir=${SUPERVISOR_TARGET_DIR:-target/supervisor-static}
RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$dir" \
  cargo build --locked --quiet -p executor-arm-supervisor --bin executor-arm-supervisor \
  --target "$triple" "${args[@]}"
bin="$dir/$triple/$profile/executor-arm-supervisor"
# A static executable asks for no program interpreter (a static-pie still has PT_DYNAMIC).
if readelf -lW "$bin" | grep -q 'INTERP'; then
  echo "build-supervisor: $bin is dynamically linked" >&2
  exit 1
fi
if [ $# -gt 0 ]; then
  install -m 0755 "$bin" "$1"
  echo "$1"
else
  echo "$bin"
fi
