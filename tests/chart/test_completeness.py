"""Chart completeness: one source for the sandbox profiles, config.extra, extra volumes, the `helm test`
pod, the values table of the chart's README and Chart.yaml's metadata."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import (CHART, MODES, ROOT, config_map, daemon, daemon_binary, helm_binary, mode_values, of_kind,
                      one, pod_spec, render)

SECRET = "auth.jwtSecret=test-secret-0123456789abcdef0123456789"
PROFILES = ROOT / "sandbox-profiles"


def shipped_profiles() -> dict[str, str]:
    files = {p.stem: p.read_text() for p in sorted(PROFILES.glob("*.toml"))}
    assert files, f"no profiles in {PROFILES}"
    return files


def configmap_profiles(docs) -> dict[str, str]:
    data = config_map(docs)["data"]
    return {k[len("profile."):-len(".toml")]: v for k, v in data.items() if k.startswith("profile.")}


def config_toml(docs) -> dict:
    return tomllib.loads(config_map(docs)["data"]["executor-arm.toml"])


def hook_pods(docs) -> list[dict]:
    return [d for d in of_kind(docs, "Pod") if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]


# ------------------------------------------------------------------ sandbox profiles: one source


def test_chart_reads_the_repository_profiles_through_one_link():
    link = CHART / "files" / "sandbox-profiles"
    assert link.is_symlink(), "files/sandbox-profiles must link to the repository's sandbox-profiles/"
    assert link.resolve() == PROFILES.resolve()
    assert os.readlink(link) == "../../../sandbox-profiles"
    # No second copy anywhere in the chart: values.yaml ships no profile text.
    assert yaml.safe_load((CHART / "values.yaml").read_text())["profiles"] == {}
    copies = [p for p in CHART.rglob("*.toml") if not p.resolve().is_relative_to(PROFILES.resolve())]
    assert copies == [], f"profile copies inside the chart: {copies}"


@pytest.mark.parametrize("m", MODES)
def test_rendered_profiles_equal_the_files(m):
    docs = render(mode_values(m))
    assert configmap_profiles(docs) == shipped_profiles()
    items = {i["key"]: i["path"] for v in pod_spec(docs)["volumes"] if v["name"] == "profiles"
             for i in v["configMap"]["items"]}
    assert items == {f"profile.{n}.toml": f"{n}.toml" for n in shipped_profiles()}


def test_packaged_chart_carries_the_profiles():
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([helm_binary(), "package", str(CHART), "-d", out], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        (tgz,) = Path(out).glob("executor-arm-*.tgz")
        with tarfile.open(tgz) as t:
            packaged = {Path(m.name).stem: t.extractfile(m).read().decode()
                        for m in t.getmembers() if m.name.startswith("executor-arm/files/sandbox-profiles/")}
            assert all(not m.issym() for m in t.getmembers()), "the package must hold contents, not links"
        assert packaged == shipped_profiles()
        # The packaged chart renders the same profiles as the checkout.
        proc = subprocess.run([helm_binary(), "template", "ea", str(tgz), "--set", SECRET], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        assert configmap_profiles(docs) == shipped_profiles()


def test_profiles_value_adds_replaces_and_removes(tmp_path):
    extra = 'description = "extra"\n[filesystem]\nread_only = ["/usr"]\n'
    python = shipped_profiles()["python"].replace("memory_mb = 512", "memory_mb = 256")
    values = tmp_path / "profiles.yaml"
    values.write_text(yaml.safe_dump({"profiles": {"http-egress": None, "extra": extra, "python": python},
                                      "commands": {"curl": None, "wget": None, "nmap": None}}))
    docs = render(str(values), sets=[SECRET])
    got = configmap_profiles(docs)
    assert set(got) == {"shell-readonly", "python", "python-packages", "node-packages", "extra"}
    assert got["extra"] == extra
    assert tomllib.loads(got["python"])["limits"]["memory_mb"] == 256
    assert got["shell-readonly"] == shipped_profiles()["shell-readonly"]


def test_a_command_needs_a_served_profile():
    from conftest import render_error
    assert "is not defined in profiles" in render_error(sets=[SECRET, "profiles.http-egress=null"])


# ------------------------------------------------------------------ config.extra


EXTRA = ["config.extra.sandbox.local.warm_slots=4", "config.extra.egress.dns_server=10.96.0.10:53",
         "config.extra.audit.refusal_burst=500", "config.extra.server.queue.max_waiting=12"]


def test_config_extra_is_deep_merged():
    cfg = config_toml(render(sets=[SECRET, *EXTRA]))
    # New nested keys land where they belong...
    assert cfg["sandbox"]["local"] == {"cgroup_name": "executor-arm", "warm_slots": 4,
                                       "uid_lock_dir": "/var/lib/executor-arm/uids"}
    assert cfg["egress"] == {"dns_server": "10.96.0.10:53"}
    assert cfg["audit"]["refusal_burst"] == 500 and cfg["audit"]["path"].startswith("/var/lib/executor-arm/")
    # ...a key the chart sets is overridden, its siblings kept.
    assert cfg["server"]["queue"] == {"max_waiting": 12, "max_wait_ms": 30000}
    # Integers stay integers (YAML numbers reach the templates as floats).
    assert isinstance(cfg["server"]["body_limit_bytes"], int)


def test_config_extra_from_a_values_file_keeps_types_and_lists(tmp_path):
    values = tmp_path / "extra.yaml"
    values.write_text(yaml.safe_dump({"auth": {"jwtSecret": "test-secret-0123456789abcdef0123456789"}, "config": {
        "extra": {"sessions": {"languages": {"python": {"interpreter": "python3", "action_type": "python",
                                                        "capability": "PythonExecute", "profile": "python",
                                                        "file": "main.py"}}},
                  "server": {"body_read_timeout_seconds": 20}}}}))
    cfg = config_toml(render(str(values)))
    assert cfg["server"]["body_read_timeout_seconds"] == 20
    assert cfg["sessions"]["languages"]["python"]["interpreter"] == "python3"
    assert cfg["sessions"]["max_total"] == 64


def _check_config(toml_text: str, tmp: Path) -> subprocess.CompletedProcess:
    """`executor-arm check-config` on a rendered executor-arm.toml, with the pod's paths pointed at the
    repository (as the chart's environment variables do in the pod)."""
    conf = tmp / "executor-arm.toml"
    conf.write_text(toml_text)
    secret = tmp / "jwt-secret"
    secret.write_text("0123456789abcdef" * 4)
    env = dict(os.environ, EXECUTOR_ARM_JWT_SECRET_FILE=str(secret), EXECUTOR_ARM_PROFILES_DIR=str(PROFILES),
               EXECUTOR_ARM_EXECUTORS_DIR=str(ROOT / "config" / "executors"),
               EXECUTOR_ARM_AUDIT_LOG=str(tmp / "audit.jsonl"), RUST_BACKTRACE="0")
    return subprocess.run([daemon_binary(), "check-config", "--config", str(conf)], capture_output=True, text=True,
                          env=env, cwd=tmp, timeout=60)


def test_daemon_accepts_the_rendered_config_with_extra_keys(tmp_path):
    text = config_map(render(sets=[SECRET, *EXTRA]))["data"]["executor-arm.toml"]
    proc = _check_config(text, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "config ok" in proc.stdout
    # The parser does check the keys: a misspelt one is refused.
    bad = text.replace("warm_slots = 4", "warm_slotz = 4")
    assert bad != text
    proc = _check_config(bad, tmp_path)
    assert proc.returncode != 0 and "warm_slotz" in proc.stderr


# ------------------------------------------------------------------ extra volumes


def test_extra_volumes_and_mounts(mode):
    docs = render(mode_values(mode), sets=["extraVolumes[0].name=ca", "extraVolumes[0].secret.secretName=ca-bundle",
                                           "extraVolumeMounts[0].name=ca",
                                           "extraVolumeMounts[0].mountPath=/etc/executor-arm/ca",
                                           "extraVolumeMounts[0].readOnly=true"])
    vols = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert vols["ca"] == {"name": "ca", "secret": {"secretName": "ca-bundle"}}
    mounts = {m["name"]: m for m in daemon(docs)["volumeMounts"]}
    assert mounts["ca"] == {"name": "ca", "mountPath": "/etc/executor-arm/ca", "readOnly": True}


def test_no_extra_volumes_by_default(docs):
    names = {v["name"] for v in pod_spec(docs)["volumes"]}
    assert names <= {"config", "profiles", "executors", "auth", "state", "tmp", "docker-socket", "docker-data",
                     "supervisor", "uid-locks"}


# ------------------------------------------------------------------ helm test pod


def test_helm_test_pod(docs, mode):
    (pod,) = hook_pods(docs)
    ann = pod["metadata"]["annotations"]
    assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    (c,) = spec["containers"]
    # The daemon image itself: its CLI mints the tokens.
    assert c["image"] == daemon(docs)["image"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(c["resources"]["limits"])
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["EXECUTOR_ARM_URL"] == "http://ea-executor-arm.executor-arm.svc:8003"
    script = c["args"][0]
    assert "/health" in script
    deployment = one(docs, "Deployment")
    # Outside the Deployment's selector: the Service never routes to it.
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items()
    # The NetworkPolicy admits it.
    np = one(docs, "NetworkPolicy")
    peers = [p for rule in np["spec"]["ingress"] for p in rule["from"]]
    assert any(p.get("podSelector", {}).get("matchLabels", {}).items() <= pod["metadata"]["labels"].items()
               and "namespaceSelector" not in p for p in peers)
    dep_auth = {v["name"]: v for v in pod_spec(docs)["volumes"]}["auth"]["secret"]
    if mode == "gvisor":
        # HS256 disabled: nothing to mint with, /health only, no secret mounted.
        assert "executor-arm token mint" not in script and "$url/execute" not in script
        assert "volumes" not in spec and "EXECUTOR_ARM_JWT_SECRET_FILE" not in env
    else:
        assert script.count("executor-arm token mint") == 1 and "--kind service" in script
        assert "--kind capability --capabilities ShellExecute --commands echo --single-use" in script
        assert '"command":"echo"' in script and "$url/execute" in script
        (vol,) = spec["volumes"]
        # The same Secret the Deployment mounts, only its HS256 key.
        assert vol["secret"]["secretName"] == dep_auth["secretName"]
        assert [i["key"] for i in vol["secret"]["items"]] == ["jwt-secret"]
        (m,) = c["volumeMounts"]
        assert m["readOnly"] and env["EXECUTOR_ARM_JWT_SECRET_FILE"] == f"{m['mountPath']}/jwt-secret"
        if mode == "local":
            assert "--iss 'orchestrator'" in script


def test_helm_test_pod_can_be_disabled():
    docs = render(sets=[SECRET, "tests.enabled=false"])
    assert hook_pods(docs) == []
    assert one(docs, "NetworkPolicy")["spec"]["ingress"] == []


# ------------------------------------------------------------------ README and Chart.yaml


def _values_table() -> str:
    text = (CHART / "README.md").read_text()
    section = text.split("\n## Values\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "no values table in helm/executor-arm/README.md"
    return "\n".join(rows)


# Keys whose children are Kubernetes objects or user entries, not chart options.
FREE_FORM = {"resources", "livenessProbe", "readinessProbe", "startupProbe", "commands", "profiles", "executors"}


def test_readme_values_table_covers_every_key():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    keys_in_table = set(re.findall(r"`([A-Za-z][A-Za-z0-9.]*)`", _values_table()))
    missing = []
    for key, value in values.items():
        if key not in keys_in_table and not any(k.startswith(key + ".") for k in keys_in_table):
            missing.append(key)
        if isinstance(value, dict) and key not in FREE_FORM:
            missing += [f"{key}.{sub}" for sub in value if f"{key}.{sub}" not in keys_in_table]
    assert missing == [], f"keys of values.yaml missing from the README's values table: {missing}"
    # And nothing in the table that values.yaml does not have.
    for k in keys_in_table:
        head, _, rest = k.partition(".")
        if head in values and rest and head not in FREE_FORM and isinstance(values[head], dict):
            assert rest.split(".")[0] in values[head], f"README names {k}, which values.yaml does not have"


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for key in ("description", "maintainers", "keywords", "annotations", "kubeVersion"):
        assert chart.get(key), f"Chart.yaml lacks {key}"
    assert chart["apiVersion"] == "v2" and chart["type"] == "application"
    assert all(m.get("name") for m in chart["maintainers"])
    images = yaml.safe_load(chart["annotations"]["artifacthub.io/images"])
    assert {i["image"] for i in images} >= {f"executor-arm:{chart['appVersion']}"}
