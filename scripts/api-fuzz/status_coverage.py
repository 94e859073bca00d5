"""Every status the OpenAPI document lists for an operation was answered by the daemon to some
test: to the Schemathesis run, or to an integration test of tests/ (their daemons record each
answer as `METHOD route status` in $CARGO_TARGET_TMPDIR/status-log/, see tests/common).

A documented status no test reaches must be listed, with the reason, in unreached.txt beside
this file; a listed status that some test did reach is reported so the list can shrink.

usage: status_coverage.py DOCUMENT LOG_OR_DIR...
"""

import json
import pathlib
import sys


def load_observed(paths):
    seen = set()
    files = 0
    for p in map(pathlib.Path, paths):
        for f in sorted(p.glob("*.log")) if p.is_dir() else [p] if p.exists() else []:
            files += 1
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split(" ")
                if len(parts) != 3 or parts[1] == "-":
                    continue
                method, route, status = parts
                seen.add((method.lower(), route.replace("{*", "{"), status))
    return seen, files


def main():
    doc = json.load(open(sys.argv[1]))
    observed, files = load_observed(sys.argv[2:])
    here = pathlib.Path(__file__).parent
    unreached = {}
    for line in (here / "unreached.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, why = line.partition(" -- ")
        method, route, status = key.split()
        unreached[(method.lower(), route, status)] = why.strip()

    documented = set()
    for route, item in doc["paths"].items():
        for method, op in item.items():
            for status in op["responses"]:
                documented.add((method, route, status))

    missing = sorted(documented - observed - set(unreached))
    stale = sorted(k for k in unreached if k in observed)
    unknown = sorted(k for k in unreached if k not in documented)
    reached = len(documented & observed)
    print(
        f"{len(documented)} documented (operation, status) pairs; {reached} answered to a test "
        f"({files} status logs), {len(documented) - reached - len(missing)} listed as unreached"
    )
    for k in stale:
        print(f"note: now reached, can leave unreached.txt: {k[0].upper()} {k[1]} {k[2]}")
    for k in unknown:
        print(f"error: unreached.txt lists what the document does not: {k[0].upper()} {k[1]} {k[2]}")
    for k in missing:
        print(f"error: no test reaches {k[0].upper()} {k[1]} {k[2]}")
    if missing or unknown:
        print(
            "Write a test that makes the daemon answer it (tests/), or, when none can, list it "
            "with the reason in scripts/api-fuzz/unreached.txt."
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
