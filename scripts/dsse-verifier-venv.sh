#!/usr/bin/env bash
# The Python venv of the receipts tests' standard DSSE verifier (tests/receipts.rs runs
# tests/receipts/verify_dsse.py with it): securesystemslib with cryptography, pinned, in
# ${EXECUTOR_ARM_TOOLS_DIR:-.tools}/dsse-venv (cached: made again only when the pins change).
# PyPI is the only download. Prints the venv's python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
VENV="$TOOLS/dsse-venv"
PY_REQUIREMENTS=("securesystemslib[crypto]==1.6.0")

# shellcheck source=lib/pinned-venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/pinned-venv.sh"

mkdir -p "$TOOLS"
pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}" >&2
echo "$VENV/bin/python"
