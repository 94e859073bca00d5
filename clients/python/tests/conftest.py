"""A real ``executor-arm serve --dev`` daemon on a free loopback port for the whole test run.

The binary is ``$EXECUTOR_ARM_BIN``, else ``target/release/executor-arm`` of the repository.
Its banner's curl line gives the minted service and capability tokens, and its first line the
HS256 secret file (for the token-minting tests). ``sleep`` is added to the allowlist
(``ALLOWED_COMMANDS``) for the cancel tests.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from executor_arm_client import Client, RetryPolicy

REPO = Path(__file__).resolve().parents[3]
OPENAPI = REPO / "openapi" / "executor-arm.json"
ALLOWED = "cat,echo,grep,ls,python3,sleep"


@dataclass(frozen=True)
class Daemon:
    url: str
    service_token: str
    capability_token: str
    secret_file: Path
    workdir: Path

    def client(self, **kwargs: object) -> Client:
        options: dict[str, object] = {
            "service_token": self.service_token,
            "capability_token": self.capability_token,
            "retry": RetryPolicy(max_attempts=3, initial_backoff=0.2),
        }
        options.update(kwargs)
        return Client(self.url, **options)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary() -> Path:
    given = os.environ.get("EXECUTOR_ARM_BIN")
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    path = Path(given) if given else target / "release" / "executor-arm"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RuntimeError(f"no executor-arm binary at {path} (build it or set EXECUTOR_ARM_BIN)")
    return path


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        raise RuntimeError("the daemon's local sandbox needs root")
    work = Path(tempfile.mkdtemp(prefix="executor-arm-pyclient-"))
    (work / "sessions").mkdir(mode=0o700)
    port = _free_port()
    env = dict(os.environ)
    env.update(
        EXECUTOR_ARM_AUDIT_LOG=str(work / "audit.jsonl"),
        EXECUTOR_ARM_SESSIONS_DIR=str(work / "sessions"),
        ALLOWED_COMMANDS=ALLOWED,
        RUST_LOG="warn",
    )
    out = open(work / "daemon.out", "wb")
    err = open(work / "daemon.err", "wb")
    proc = subprocess.Popen(
        [str(_binary()), "serve", "--dev", "--listen", f"127.0.0.1:{port}"],
        cwd=work,
        env=env,
        stdout=out,
        stderr=err,
    )
    try:
        banner = ""
        deadline = time.monotonic() + 60
        while "\ncurl " not in banner:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the daemon exited ({proc.returncode}): "
                    + (work / "daemon.err").read_text()[-2000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError("no dev banner within 60 s")
            time.sleep(0.1)
            banner = (work / "daemon.out").read_text()
        curl = next(line for line in banner.splitlines() if line.startswith("curl "))
        service = re.search(r"Authorization: Bearer ([^']+)'", curl)
        capability = re.search(r'"capability_token":"([^"]+)"', curl)
        secret = re.search(r"; secret (\S+) \(deleted on exit\)", banner)
        assert service and capability and secret, f"cannot parse the dev banner:\n{banner}"
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/readyz", timeout=10) as r:
            assert r.status == 200
        yield Daemon(url, service.group(1), capability.group(1), Path(secret.group(1)), work)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as c:
        yield c
