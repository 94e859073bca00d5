"""The Python example of the repository's README runs against the daemon as written (its URL
and the two tokens from the dev banner are the only things substituted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, Daemon


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_example_runs(daemon: Daemon) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Python client", 1)[1].split("\n## ", 1)[0]
    (example,) = _python_blocks(section)
    assert len(example.strip().splitlines()) == 5
    assert "http://127.0.0.1:8003" in example
    code = example.replace("http://127.0.0.1:8003", daemon.url)
    env = dict(os.environ, SVC=daemon.service_token, CAP=daemon.capability_token)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hello\n"), done.stdout


def test_client_readme_examples_run(daemon: Daemon) -> None:
    readme = (REPO / "clients" / "python" / "README.md").read_text()
    blocks = _python_blocks(readme)
    assert blocks
    env = dict(
        os.environ,
        SVC=daemon.service_token,
        CAP=daemon.capability_token,
        EXECUTOR_ARM_SECRET_FILE=str(daemon.secret_file),
    )
    for block in blocks:
        code = block.replace("http://127.0.0.1:8003", daemon.url)
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{block}\n--- stderr\n{done.stderr}"
