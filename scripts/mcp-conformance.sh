#!/usr/bin/env bash
# The official MCP conformance suite (npm @modelcontextprotocol/conformance, pinned) against an MCP
# server: `scripts/mcp-conformance.sh --install` installs it (cached) into
# ${EXECUTOR_ARM_TOOLS_DIR:-.tools}/mcp-conformance; `scripts/mcp-conformance.sh URL SCENARIO...`
# installs it if needed and runs each server scenario against URL, failing on the first failure.
# The npm registry is the only download. tests/mcp.rs runs it against /mcp.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
DIR="$TOOLS/mcp-conformance"
# 0.1.13 and later need Node 22 (fs.globSync); 0.1.12 runs on Node 20.
PACKAGE="@modelcontextprotocol/conformance@0.1.12"

die() { printf 'mcp-conformance: %s\n' "$*" >&2; exit 1; }

install() {
  if [[ -x "$DIR/node_modules/.bin/conformance" && "$(cat "$DIR/.package" 2>/dev/null)" == "$PACKAGE" ]]; then
    return 0
  fi
  command -v npm >/dev/null || die "npm is required (apt-get install npm)"
  rm -rf "$DIR"
  mkdir -p "$DIR"
  (cd "$DIR" && npm init -y >/dev/null && npm install --no-audit --no-fund --save-exact "$PACKAGE" >&2)
  printf '%s' "$PACKAGE" > "$DIR/.package"
}

install
[[ "${1:-}" == "--install" ]] && exit 0
[[ $# -ge 2 ]] || die "usage: $0 --install | URL SCENARIO..."
url="$1"; shift
for scenario in "$@"; do
  echo "== $scenario"
  "$DIR/node_modules/.bin/conformance" server --url "$url" --scenario "$scenario"
done
