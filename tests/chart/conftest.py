"""Helpers shared by the chart tests: render helm/executor-arm with the helm binary in $HELM."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "executor-arm"
CI = CHART / "ci"
MODES = ("local", "dind", "gvisor")
RELEASE = "ea"
NAMESPACE = "executor-arm"
KUBE_VERSION = "1.35.0"


def daemon_binary() -> str:
    """The executor-arm binary the live tests run: $EXECUTOR_ARM_BIN, else the release build in
    ${CARGO_TARGET_DIR:-target}/release (scripts/validate-chart.sh builds it when missing)."""
    given = os.environ.get("EXECUTOR_ARM_BIN")
    if given:
        if not os.access(given, os.X_OK):
            pytest.fail(f"EXECUTOR_ARM_BIN={given} is not an executable file")
        return given
    target = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    if not target.is_absolute():
        target = ROOT / target
    default = target / "release" / "executor-arm"
    if not os.access(default, os.X_OK):
        pytest.fail(f"no executor-arm binary at {default}: build it (cargo build --release --locked --bin "
                    "executor-arm), run scripts/validate-chart.sh (it builds it), or set EXECUTOR_ARM_BIN")
    return str(default)


def helm_binary() -> str:
    for candidate in (os.environ.get("HELM"), str(ROOT / ".tools" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("no helm binary: run scripts/validate-chart.sh (it fetches helm into .tools/) or set HELM")


class RenderError(Exception):
    pass


@functools.lru_cache(maxsize=None)
def _render(values: tuple[str, ...], sets: tuple[str, ...], api_versions: tuple[str, ...]) -> str:
    cmd = [helm_binary(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
           "--kube-version", KUBE_VERSION]
    for v in values:
        cmd += ["-f", str(CI / v) if not os.path.isabs(v) else v]
    for s in sets:
        cmd += ["--set", s]
    for a in api_versions:
        cmd += ["--api-versions", a]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip() or proc.stdout.strip())
    return proc.stdout


def render(*values: str, sets: tuple[str, ...] | list[str] = (), api_versions=()) -> list[dict]:
    """Render the chart and return its manifests (empty documents dropped)."""
    out = _render(tuple(values), tuple(sets), tuple(api_versions))
    return [d for d in yaml.safe_load_all(out) if d]


def render_error(*values: str, sets=(), api_versions=()) -> str:
    """Render the chart expecting failure; return helm's error text."""
    try:
        _render(tuple(values), tuple(sets), tuple(api_versions))
    except RenderError as e:
        return str(e)
    raise AssertionError(f"helm template succeeded but should have failed (values={values}, sets={sets})")


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def config_map(docs: list[dict]) -> dict:
    """The daemon's ConfigMap (executor-arm.toml, profiles, executors), not the dashboard's."""
    found = [d for d in of_kind(docs, "ConfigMap") if "executor-arm.toml" in d.get("data", {})]
    assert len(found) == 1, f"expected exactly one ConfigMap with executor-arm.toml, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def daemon(docs: list[dict]) -> dict:
    containers = [c for c in pod_spec(docs)["containers"] if c["name"] == "executor-arm"]
    assert len(containers) == 1
    return containers[0]


def all_containers(docs: list[dict]) -> list[dict]:
    spec = pod_spec(docs)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def mode_values(mode: str) -> str:
    return f"{mode}-values.yaml"


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture
def docs(mode) -> list[dict]:
    return render(mode_values(mode))
