#!/usr/bin/env bash
# The Python venv of the E2B compatibility tests (tests/e2b.rs runs tests/e2b/test_e2b.py with it):
# the official E2B Python SDK (`e2b` on PyPI) at VERSION, with pytest, pinned, in
# ${EXECUTOR_ARM_TOOLS_DIR:-.tools}/e2b-sdk-venv-VERSION (cached: made again only when the pins
# change). `scripts/e2b-sdk-venv.sh VERSION`; the versions the tests drive are the ones tests/e2b.rs
# names (a current 2.x and one about a year older). PyPI is the only download. Prints the venv's
# python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"
VERSION="${1:?usage: $0 E2B_SDK_VERSION (e.g. 2.63.0)}"
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "e2b-sdk-venv: not a release version: $VERSION" >&2; exit 2; }
VENV="$TOOLS/e2b-sdk-venv-$VERSION"
PY_REQUIREMENTS=("e2b==$VERSION" "pytest==9.2.0" "pytest-timeout==2.4.0")
case "$VERSION" in
  # 2.7.0 asks for protobuf>=4.21 with no upper bound: keep the protobuf runtime of its day
  # rather than whatever major is newest.
  2.7.0) PY_REQUIREMENTS+=("protobuf==6.33.1") ;;
esac

# shellcheck source=lib/pinned-venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/pinned-venv.sh"

mkdir -p "$TOOLS"
pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}" >&2
echo "$VENV/bin/python"
