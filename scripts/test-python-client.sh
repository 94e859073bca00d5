#!/usr/bin/env bash
# Tests of the Python client (clients/python) against the real daemon:
#   1. a Python venv in .tools/ (cached) with pinned httpx, pytest, mypy, setuptools, websockets
#      (the terminal extra) and securesystemslib (the receipts extra), and the client installed
#      from clients/python (reinstalled on every run: the tests use the tree's code),
#   2. mypy --strict on the package and its tests (the package ships py.typed),
#   3. pytest on clients/python/tests: its fixture starts `executor-arm serve --dev` on a free
#      loopback port and takes the banner's minted tokens, as scripts/api-fuzz.sh does.
# Needs root (the daemon's local sandbox) and the binary ($EXECUTOR_ARM_BIN, else
# ${CARGO_TARGET_DIR:-target}/release/executor-arm, built here when missing). PyPI is the only
# download. Extra arguments go to pytest. Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
VENV="$TOOLS/python-client-venv"
PY="$VENV/bin/python"
PY_REQUIREMENTS=("httpx==0.28.1" "pytest==9.2.0" "setuptools==84.2.1" "mypy==2.4.1" "websockets==17.4"
  "securesystemslib[crypto]==1.6.0")

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'test-python-client: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/pinned-venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/pinned-venv.sh"

[[ $(id -u) -eq 0 ]] || die "must run as root (the daemon's local sandbox)"

step "python venv ($VENV)"
pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}"

step "install clients/python"
# Built with the venv's pinned setuptools (no isolated build env to download), then installed
# without touching the pinned dependencies.
"$PY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps \
  --force-reinstall "$ROOT/clients/python"
"$PY" -m pip check --disable-pip-version-check
"$PY" -c 'import executor_arm_client as c; print("executor-arm-client", c.__version__, "from", c.__file__)'

BIN="${EXECUTOR_ARM_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/executor-arm}"
if [[ ! -x "$BIN" ]]; then
  step "build $BIN"
  (cd "$ROOT" && cargo build --release --locked)
fi
export EXECUTOR_ARM_BIN="$BIN"

cd "$ROOT/clients/python"
step "mypy --strict (clients/python: src, tests)"
"$VENV/bin/mypy" --strict --cache-dir=/dev/null src/executor_arm_client tests

step "pytest clients/python/tests (daemon: $BIN)"
# The package has a src/ layout: the tests import the installed copy, not the tree's.
"$PY" -m pytest tests -p no:cacheprovider -q -rA "$@"
echo
echo "test-python-client: OK"
