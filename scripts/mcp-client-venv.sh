#!/usr/bin/env bash
# The Python venv of the MCP tests (tests/mcp.rs runs tests/mcp/test_mcp.py with it): the official
# MCP Python SDK, pinned, in ${EXECUTOR_ARM_TOOLS_DIR:-.tools}/mcp-venv (cached: made again only
# when the pins change). PyPI is the only download. Prints the venv's python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
VENV="$TOOLS/mcp-venv"
# httpx2 is the SDK's HTTP client; the test also speaks raw HTTP with it (401, 403).
PY_REQUIREMENTS=("mcp==2.3.0" "httpx2==2.16.2")

# shellcheck source=lib/pinned-venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/pinned-venv.sh"

mkdir -p "$TOOLS"
pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}" >&2
echo "$VENV/bin/python"
