#!/usr/bin/env bash
# Supply-chain checks of executor-arm's dependency tree, with no network but crates.io:
#   1. cargo-deny and cargo-audit at pinned versions (cargo install --locked; skipped when that
#      version is already installed; cargo-audit only when there is an advisory database),
#   2. cargo fetch --locked, so the checks read the dependency graph offline,
#   3. cargo deny check (deny.toml): licenses, bans (duplicate versions), sources (crates.io only)
#      and advisories,
#   4. cargo audit: Cargo.lock against the same advisories, with deny.toml's ignore list.
# Exits non-zero when any check reports an error.
#
# Advisories come from an offline copy of the RustSec advisory database (scripts/refresh-advisory-db.sh
# makes and refreshes it): $EXECUTOR_ARM_ADVISORY_DB, else ../shared/advisory-db beside the
# repository. Neither tool fetches it. Without a copy the advisory checks cannot run: the script says
# so and runs the other checks, or fails when EXECUTOR_ARM_REQUIRE_ADVISORY_DB=1.
set -Eeuo pipefail
trap 'echo "supply-chain: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

DENY_VERSION=0.20.2
AUDIT_VERSION=0.22.2
DB="${EXECUTOR_ARM_ADVISORY_DB:-../shared/advisory-db}"
# cargo-deny opens its database at <db-path>/<last url segment>-<xxh64 of the lower-cased url>; this
# is that directory for its default url (deny.toml sets db-path, not db-urls). A cargo-deny that names
# it differently fails with "failed to load advisory database", never passes without it.
DENY_DB_DIR=advisory-db-3157b0e258782691

step() { printf '\n-- supply-chain: %s\n' "$*"; }

# ------------------------------------------------------------------ tools
install_tool() { # crate version subcommand
  local crate=$1 version=$2 sub=$3 have start
  have=$(cargo "$sub" --version 2>/dev/null | awk '{print $2}' || true)
  if [ "$have" = "$version" ]; then
    echo "$crate $version: installed"
    return
  fi
  echo "$crate: installing $version (found: ${have:-none})"
  start=$SECONDS
  # Built in cargo's own temporary directory, not the project's target dir.
  env -u CARGO_TARGET_DIR cargo install --locked --quiet "$crate" --version "$version"
  echo "$crate $version: installed in $((SECONDS - start))s"
}
step "tools"
install_tool cargo-deny "$DENY_VERSION" deny

# ------------------------------------------------------------------ crates
# cargo-deny reads the graph with `cargo metadata --offline`: every crate of Cargo.lock must be in
# cargo's cache first.
step "cargo fetch --locked"
cargo fetch --locked --quiet

# ------------------------------------------------------------------ advisory database
step "advisory database"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
have_db=false
if [ -d "$DB/crates" ] && [ -f "$DB/UPSTREAM" ]; then
  have_db=true
  db_commit=$(sed -n 's/^commit=//p' "$DB/UPSTREAM")
  db_date=$(sed -n 's/^date=//p' "$DB/UPSTREAM")
  age_days=$(( ($(date +%s) - $(date -d "$db_date" +%s)) / 86400 ))
  echo "$DB: RustSec commit $db_commit of $db_date ($age_days days old)"
  # cargo-deny needs its database to be a git clone (it reads the last fetch time from it), so the
  # copy goes into a throwaway repository dated with the upstream commit's date: deny.toml's
  # maximum-db-staleness then judges the database's real age.
  repo="$work/dbs/$DENY_DB_DIR"
  mkdir -p "$repo"
  cp -R "$DB/." "$repo/"
  git -C "$repo" init --quiet
  git -C "$repo" add --all
  GIT_AUTHOR_DATE="$db_date" GIT_COMMITTER_DATE="$db_date" \
    git -C "$repo" -c user.name=supply-chain -c user.email=supply-chain@localhost \
      -c commit.gpgsign=false commit --quiet --no-verify -m "RustSec advisory-db $db_commit"
  touch -d "$db_date" "$repo/.git/HEAD"
  export EXECUTOR_ARM_ADVISORY_DBS="$work/dbs"
elif [ "${EXECUTOR_ARM_REQUIRE_ADVISORY_DB:-0}" = 1 ]; then
  echo "supply-chain: no advisory database at $DB (make one with scripts/refresh-advisory-db.sh)" >&2
  exit 1
else
  echo "NOT CHECKED: advisories (cargo deny's and cargo audit's): no advisory database at $DB."
  echo "  Make one with scripts/refresh-advisory-db.sh (needs the upstream repository), or point"
  echo "  EXECUTOR_ARM_ADVISORY_DB at one. Licenses, bans and sources are still checked."
fi

# ------------------------------------------------------------------ cargo deny
if $have_db; then
  step "cargo deny --offline --locked check (advisories, bans, licenses, sources)"
  cargo deny --offline --locked check
else
  step "cargo deny --offline --locked check bans licenses sources"
  cargo deny --offline --locked check bans licenses sources
fi

# ------------------------------------------------------------------ cargo audit
if $have_db; then
  # Installed only when there is a database to read: cargo audit checks nothing else, and its
  # install (it builds aws-lc-sys) is the longest step of this script.
  step "tools: cargo-audit"
  install_tool cargo-audit "$AUDIT_VERSION" audit
  step "cargo audit --no-fetch"
  # The advisories deny.toml ignores, each with its reason there, are ignored here too.
  mapfile -t ignores < <(python3 -c '
import sys, tomllib
cfg = tomllib.load(open("deny.toml", "rb"))
for entry in cfg.get("advisories", {}).get("ignore", []):
    print(entry["id"] if isinstance(entry, dict) else entry)
')
  args=()
  for id in "${ignores[@]}"; do args+=(--ignore "$id"); done
  cargo audit --no-fetch --db "$DB" --file Cargo.lock "${args[@]}"
fi

echo
if $have_db; then
  echo "supply-chain: OK"
else
  echo "supply-chain: OK (advisories NOT CHECKED: no advisory database)"
fi
