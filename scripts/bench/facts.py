#!/usr/bin/env python3
"""Facts about the machine a benchmark run measures on, as one JSON document on stdout.

`facts.py` gathers all of them (written at the start of `scripts/bench.sh all`); `facts.py --end`
only the time and load average (written at the end). Standard library only: it runs before any
venv exists. A fact that cannot be read is null.
"""

import ctypes
import json
import os
import platform
import subprocess
import sys
import time


def run(argv, cwd=None):
    """First line of a command's stdout, or None when it fails or is missing."""
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()
    return line[0].strip() if line else None


def cgroup_layout(root="/sys/fs/cgroup"):
    """'v2 (unified)', 'v1 (hybrid: v1 controllers, v2 at <root>/unified)' or 'v1 (legacy)'."""
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return "v2 (unified)"
    if os.path.exists(os.path.join(root, "unified", "cgroup.controllers")):
        return f"v1 (hybrid: v1 controllers, v2 at {root}/unified)"
    if os.path.isdir(os.path.join(root, "memory")):
        return "v1 (legacy)"
    return None


def landlock_abi():
    """The kernel's Landlock ABI version (landlock_create_ruleset with the VERSION flag)."""
    numbers = {"x86_64": 444, "aarch64": 444}
    nr = numbers.get(platform.machine())
    if nr is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(nr, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return None
    return abi if abi > 0 else None


def runsc_platform(path="/etc/docker/daemon.json"):
    """The --platform runsc is registered with in dockerd's config."""
    try:
        with open(path, encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError):
        return None
    for name, rt in (conf.get("runtimes") or {}).items():
        if "runsc" not in name and "runsc" not in str(rt.get("path", "")):
            continue
        for arg in rt.get("runtimeArgs") or []:
            if arg.startswith("--platform="):
                return arg.split("=", 1)[1]
        return "systrap (runsc default)"
    return None


def now():
    return {
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def gather(repo):
    facts = now()
    runsc = run(["runsc", "--version"])
    nproc = run(["nproc"])
    status = run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    facts.update(
        {
            "nproc": int(nproc) if nproc else os.cpu_count(),
            "kernel": platform.release(),
            "cgroup": cgroup_layout(),
            "landlock_abi": landlock_abi(),
            "runsc_version": runsc.replace("runsc version ", "") if runsc else None,
            "runsc_platform": runsc_platform(),
            "docker_server_version": run(["docker", "version", "--format", "{{.Server.Version}}"]),
            "docker_client_version": run(["docker", "version", "--format", "{{.Client.Version}}"]),
            "git_commit": run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo),
            "git_dirty": bool(status),
        }
    )
    return facts


def main():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    facts = now() if "--end" in sys.argv[1:] else gather(repo)
    json.dump(facts, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
