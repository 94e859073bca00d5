#!/usr/bin/env bash
# The whole executor-arm test suite, from a fresh machine: installs what the tests need (apt),
# checks the dependency tree (scripts/supply-chain.sh: cargo deny, cargo audit), sets up Docker +
# gVisor and the sandbox image, starts Redis, installs the MCP tests' clients (the official Python SDK
# from PyPI, the conformance suite from npm) and the E2B tests' official SDKs (Python from PyPI at
# two versions, JS from npm), then runs formatting, lints, unit and integration tests
# (local, docker, gvisor backends), Schemathesis against the OpenAPI document, the Python client's
# tests against a live daemon, the benchmark report generator's tests (fixture results), every fuzz
# target for a bounded time (FUZZ_SECONDS each, default 20), and the Helm chart validation.
set -Eeuo pipefail
trap 'echo "test-all: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "test-all: must run as root (the local sandbox builds namespaces, mounts and cgroups)" >&2
  exit 1
fi

step() { printf '\n== %s\n' "$*"; }

step "packages"
need=()
for pair in python3:python3 curl:curl wget:wget nmap:nmap tar:tar git:git openssl:openssl \
            redis-server:redis-server npm:npm ip:iproute2 bwrap:bubblewrap debootstrap:debootstrap strace:strace; do
  bin=${pair%%:*}; pkg=${pair##*:}
  command -v "$bin" >/dev/null 2>&1 || need+=("$pkg")
done
# The egress session tests run pip in local sandboxes, from the system's python3.
/usr/bin/python3 -c 'import pip' >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi

step "supply chain (cargo deny, cargo audit)"
scripts/supply-chain.sh

step "docker + gvisor"
scripts/setup-docker.sh
scripts/build-sandbox-image.sh

step "redis"
if ! redis-cli -p 6390 ping >/dev/null 2>&1; then
  redis-server --port 6390 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes
fi
export EXECUTOR_ARM_TEST_REDIS_URL=redis://127.0.0.1:6390/0

step "unit tests as an unprivileged user"
scripts/test-unit-unprivileged.sh

step "fmt + clippy"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# No file imports a file that imports it back, at any level of src/.
scripts/module-cycles.py .

step "MCP clients (tests/mcp.rs: the official Python SDK from PyPI, the conformance suite from npm)"
scripts/mcp-client-venv.sh >/dev/null
scripts/mcp-conformance.sh --install

step "E2B SDKs (tests/e2b.rs: the official Python SDK from PyPI at the two versions it names, the JS SDK from npm)"
scripts/e2b-sdk-venv.sh 2.63.0 >/dev/null
scripts/e2b-sdk-venv.sh 2.7.0 >/dev/null
scripts/e2b-npm-sdk.sh >/dev/null

step "tests"
cargo build --release --locked
# The static in-container supervisor beside the release daemon (its default place), for the
# scripts below that run it on docker/gvisor; the docker tests build their own.
scripts/build-supervisor.sh --release "${CARGO_TARGET_DIR:-target}/release/executor-arm-supervisor" >/dev/null
cargo test --locked -p executor-arm-supervisor --no-fail-fast
# The integration tests' daemons record every status they answer here (scripts/api-fuzz.sh reads it).
rm -rf "${CARGO_TARGET_DIR:-target}/tmp/status-log"
cargo test --locked --all-targets --no-fail-fast -- --test-threads=4
# The unit tests that need root (marked ignored, so the unprivileged run above lists them).
cargo test --locked --lib -- --ignored --test-threads=2

step "api fuzz (schemathesis against the OpenAPI document)"
scripts/api-fuzz.sh "${CARGO_TARGET_DIR:-target}/tmp/status-log"

step "python client"
scripts/test-python-client.sh

step "benchmark report generator (scripts/bench/report.py, fixture results)"
scripts/bench.sh test

step "fuzz (every target, bounded)"
FUZZ_JOBS=2 FUZZ_SEED="${FUZZ_SEED:-1}" scripts/fuzz.sh "${FUZZ_SECONDS:-20}"

step "daemon image"
scripts/test-daemon-image.sh

step "helm chart"
scripts/validate-chart.sh

echo
echo "test-all: OK"
