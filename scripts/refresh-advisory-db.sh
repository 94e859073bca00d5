#!/usr/bin/env bash
# Refreshes the offline copy of the RustSec advisory database that scripts/supply-chain.sh reads.
# Needs git and network access to the database's repository; run it by hand, then keep the result
# where the checks find it.
#
# Usage: scripts/refresh-advisory-db.sh [DEST]
#   DEST                      where the copy goes (default: $EXECUTOR_ARM_ADVISORY_DB, else
#                             ../shared/advisory-db beside the repository); replaced whole
#   ADVISORY_DB_SOURCE [url]  the git repository to copy from (default: the upstream RustSec database)
#   ADVISORY_DB_REF [main]    the branch or tag to copy
#
# The copy holds only what cargo-deny and cargo-audit read: crates/ (one Markdown file per advisory),
# rust/ (advisories against the toolchain's own crates), the database's LICENSE.txt (CC0-1.0), and
# UPSTREAM + README.md recording the commit and its date. It is not a git repository: the checks make
# a throwaway one from it at run time.
set -Eeuo pipefail
trap 'echo "refresh-advisory-db: failed at line $LINENO" >&2' ERR

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-${EXECUTOR_ARM_ADVISORY_DB:-$ROOT/../shared/advisory-db}}"
UPSTREAM_URL=https://github.com/rustsec/advisory-db
SOURCE="${ADVISORY_DB_SOURCE:-$UPSTREAM_URL}"
REF="${ADVISORY_DB_REF:-main}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "refresh-advisory-db: cloning $SOURCE ($REF)"
git clone --quiet --no-checkout --depth 1 --branch "$REF" "$SOURCE" "$work/repo"
commit="$(git -C "$work/repo" rev-parse --verify 'HEAD^{commit}')"
date="$(git -C "$work/repo" show -s --format=%cI "$commit")"

mkdir -p "$work/out"
git -C "$work/repo" archive "$commit" crates rust LICENSE.txt | tar -x -C "$work/out"
count="$(find "$work/out/crates" -name 'RUSTSEC-*.md' | wc -l)"
[ "$count" -gt 0 ] || { echo "refresh-advisory-db: no advisories under crates/ at $commit" >&2; exit 1; }

# Read by scripts/supply-chain.sh (the database's age is judged by this date).
printf 'commit=%s\ndate=%s\n' "$commit" "$date" > "$work/out/UPSTREAM"
cat > "$work/out/README.md" <<EOF
# RustSec advisory database (offline copy)

The advisories that \`scripts/supply-chain.sh\` of executor-arm checks \`Cargo.lock\` against with
cargo-deny and cargo-audit, without network access.

- upstream: $UPSTREAM_URL$([ "$SOURCE" = "$UPSTREAM_URL" ] || printf ' (copied from a mirror of it)')
- commit: $commit
- commit date: $date
- advisories: $count
- copied: $(date -u +%Y-%m-%dT%H:%M:%SZ)

Only \`crates/\`, \`rust/\` and \`LICENSE.txt\` (CC0-1.0) are kept. Refresh with
\`scripts/refresh-advisory-db.sh\` from a machine that reaches the upstream repository.
EOF

# Replace the destination whole, so advisories removed upstream go too.
mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST.new"
mv "$work/out" "$DEST.new"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"
echo "refresh-advisory-db: $count advisories at $commit ($date) -> $DEST ($(du -sh "$DEST" | cut -f1))"
