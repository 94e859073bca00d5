#!/usr/bin/env bash
# Runs the library's unit tests as an unprivileged user (nobody), with no dockerd or Redis in
# reach: unit tests need nothing of the host. The few that need root are marked
# `#[ignore = "needs root ..."]` and run by scripts/test-all.sh as root.
#
# Usage: scripts/test-unit-unprivileged.sh   (as root: it builds, then drops to nobody to run)
set -euo pipefail
cd "$(dirname "$0")/.."
user="${UNPRIVILEGED_USER:-nobody}"
bin=$(cargo test --lib --locked --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "lib" in m["target"]["kind"]:
        print(m["executable"])')
[ -n "$bin" ] || { echo "test-unit-unprivileged: no unit test binary was built" >&2; exit 1; }
# A copy the user can run from a directory it owns: the build tree may not be readable to it.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$bin" "$work/unit-tests"
chown -R "$user" "$work"
chmod 0755 "$work" "$work/unit-tests"
cd "$work"
# No inherited Docker or Redis addresses: a unit test that reached for one would show here.
exec runuser -u "$user" -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$work" TMPDIR=/tmp \
  ./unit-tests --test-threads=2 "$@"
