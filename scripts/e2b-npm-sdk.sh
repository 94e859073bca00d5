#!/usr/bin/env bash
# The official E2B JS SDK (`e2b` on npm) for the E2B compatibility tests (tests/e2b.rs runs
# tests/e2b/sdk.mjs with it), installed with `npm ci` from the committed tests/e2b/js/package.json
# and package-lock.json (exact versions and integrity hashes) into
# ${EXECUTOR_ARM_TOOLS_DIR:-.tools}/e2b-npm-sdk (cached: installed again only when the lockfile
# changes). The npm registry is the only download. Needs Node >=20.18.1 (the SDK's engines).
# Prints the install directory on its last line (sdk.mjs loads `e2b` from its node_modules).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
DIR="$TOOLS/e2b-npm-sdk"
SRC="$ROOT/tests/e2b/js"

die() { printf 'e2b-npm-sdk: %s\n' "$*" >&2; exit 1; }

want="$(sha256sum "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -d' ' -f1)"
if [[ -f "$DIR/node_modules/e2b/package.json" && "$(cat "$DIR/.lock-sha256" 2>/dev/null)" == "$want" ]]; then
  echo "cached: $(cd "$SRC" && node -p 'require("./package.json").dependencies.e2b' 2>/dev/null || echo e2b)" >&2
else
  command -v npm >/dev/null || die "npm is required (apt-get install npm)"
  rm -rf "$DIR"
  mkdir -p "$DIR"
  cp "$SRC/package.json" "$SRC/package-lock.json" "$DIR/"
  (cd "$DIR" && npm ci --no-audit --no-fund --ignore-scripts >&2)
  printf '%s' "$want" > "$DIR/.lock-sha256"
fi
echo "$DIR"
