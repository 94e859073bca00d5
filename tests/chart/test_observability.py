"""The chart's Grafana dashboard and PrometheusRule: their structure, and that every metric they query is
one a live daemon exposes on /metrics (the daemon binary runs here, in dev mode, and does real work
first so the labelled families appear)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import CHART, MODES, NAMESPACE, ROOT, daemon_binary, mode_values, of_kind, one, render, render_error

MONITORING = ("monitoring.coreos.com/v1",)
DASHBOARD_FILE = CHART / "files" / "dashboards" / "executor-arm.json"
ALERTS = {"ExecutorArmBackendNotReady", "ExecutorArmHighErrorRate", "ExecutorArmHighLatency",
          "ExecutorArmAuthFailureSpike", "ExecutorArmAuditAppendFailure"}

# ------------------------------------------------------------------ PromQL: metric names of an expression

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "Inf", "NaN"}


def _balanced(expr: str) -> bool:
    pairs, stack, in_str = {")": "(", "]": "[", "}": "{"}, [], False
    i = 0
    while i < len(expr):
        c = expr[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "([{":
            stack.append(c)
        elif c in ")]}":
            if not stack or stack.pop() != pairs[c]:
                return False
        i += 1
    return not stack and not in_str


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed). Fails on unbalanced
    brackets or quotes, or an expression that selects nothing."""
    assert _balanced(expr), f"unbalanced brackets or quotes: {expr}"
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                  # string literals
    e = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "", e)            # Grafana variables
    e = re.sub(r"\{[^{}]*\}", " ", e)                                # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)                                # range selectors
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"(?<![A-Za-z0-9_:])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", " ", e)  # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group() in KEYWORDS:
            continue  # a function, an aggregation or a keyword
        names.add(m.group())
    assert names, f"no metric in {expr}"
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.95, sum by (le, backend) (rate(a_bucket{x=~"$v", y!="z"}[5m])))') \
        == {"a_bucket"}
    assert metric_names("sum(rate(a_total[$__rate_interval])) / clamp_min(sum(rate(b_total[5m])), 1e-9) > 0.05") \
        == {"a_total", "b_total"}
    assert metric_names("min by (pod) (up{job=\"x\"}) == 0 and on (pod) c") == {"up", "c"}
    with pytest.raises(AssertionError):
        metric_names("sum(rate(a[5m])")


# ------------------------------------------------------------------ dashboard


def dashboard_doc(docs) -> dict:
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    return cm


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return exprs


def dashboard_variable_metrics(dashboard: dict) -> set[str]:
    names = set()
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            m = re.match(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", v["query"]["query"])
            assert m, v
            names.add(m.group(1))
    return names


def dashboard_metrics(dashboard: dict) -> set[str]:
    names = set().union(*(metric_names(e) for e in dashboard_exprs(dashboard)))
    return names | dashboard_variable_metrics(dashboard)


def test_dashboard_configmap(mode):
    cm = dashboard_doc(render(mode_values(mode)))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    (key,) = cm["data"]
    assert key.endswith(".json")
    dashboard = json.loads(cm["data"][key])
    assert dashboard == json.loads(DASHBOARD_FILE.read_text())
    assert dashboard["uid"] == "executor-arm" and dashboard["title"]


def test_dashboard_json_is_well_formed():
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    ids = []
    for p in dashboard["panels"]:
        ids.append(p["id"])
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                assert t["refId"] and t["expr"]
                # Every query is scoped by the dashboard's namespace and pod variables.
                assert 'namespace=~"$namespace"' in t["expr"] and 'pod=~"$pod"' in t["expr"], t["expr"]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= variables


def test_dashboard_covers_what_an_operator_needs():
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    exprs = dashboard_exprs(dashboard)
    names = dashboard_metrics(dashboard)
    for metric in ("executor_backend_executions_total", "executor_execution_duration_seconds_bucket",
                   "executor_inflight_executions", "executor_queue_waiting", "executor_queue_wait_seconds_bucket",
                   "executor_pool_idle_containers", "executor_pool_events_total", "executor_oom_kills_total",
                   "executor_capability_violations_total", "executor_auth_failures_total",
                   "executor_audit_append_failures_total", "executor_backend_ready"):
        assert metric in names, f"the dashboard does not show {metric}"
    # Executions by outcome and backend; latency percentiles.
    assert any("by (backend, outcome)" in e for e in exprs)
    for q in ("0.5", "0.95", "0.99"):
        assert any(f"histogram_quantile({q}," in e and "executor_execution_duration_seconds_bucket" in e for e in exprs)


def test_dashboard_labels_and_toggle():
    docs = render(mode_values("local"), sets=["metrics.dashboard.labels.grafana_dashboard=null",
                                              "metrics.dashboard.labels.dashboards=executor",
                                              "metrics.dashboard.annotations.grafana_folder=Sandboxes",
                                              "metrics.dashboard.namespace=monitoring"])
    cm = dashboard_doc(docs)
    assert cm["metadata"]["labels"]["dashboards"] == "executor"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Sandboxes"}
    assert cm["metadata"]["namespace"] == "monitoring"
    docs = render(mode_values("local"), sets=["metrics.dashboard.enabled=false"])
    assert [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")] == []


# ------------------------------------------------------------------ PrometheusRule


def rule_doc(mode: str, sets=()) -> dict:
    return one(render(mode_values(mode), sets=sets, api_versions=MONITORING), "PrometheusRule")


def alerts_of(rule: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


def test_prometheus_rule_only_with_the_api(docs):
    assert of_kind(docs, "PrometheusRule") == []


def test_prometheus_rule_structure(mode):
    rule = rule_doc(mode)
    assert rule["metadata"]["namespace"] == NAMESPACE
    alerts = alerts_of(rule)
    assert set(alerts) == ALERTS
    for name, a in alerts.items():
        assert re.fullmatch(r"\d+[smhdwy]", a["for"]), name
        assert a["labels"]["severity"] in ("warning", "critical")
        assert a["annotations"]["summary"] and a["annotations"]["description"]
        names = metric_names(a["expr"])
        assert all(n.startswith("executor_") for n in names), names
        # Scoped to this release's Service and namespace.
        assert f'job="ea-executor-arm", namespace="{NAMESPACE}"' in a["expr"], a["expr"]
    expect = {"ExecutorArmBackendNotReady": "executor_backend_ready",
              "ExecutorArmHighErrorRate": "executor_backend_executions_total",
              "ExecutorArmHighLatency": "executor_execution_duration_seconds_bucket",
              "ExecutorArmAuthFailureSpike": "executor_auth_failures_total",
              "ExecutorArmAuditAppendFailure": "executor_audit_append_failures_total"}
    for alert, metric in expect.items():
        assert metric in metric_names(alerts[alert]["expr"])
    assert 'outcome="error"' in alerts["ExecutorArmHighErrorRate"]["expr"]
    assert "histogram_quantile(0.95," in alerts["ExecutorArmHighLatency"]["expr"]
    backends = re.search(r'backend=~"([^"]+)"', alerts["ExecutorArmBackendNotReady"]["expr"]).group(1)
    # The backends this release runs work on, not every backend the daemon knows.
    assert backends == {"local": "local", "dind": "docker|gvisor", "gvisor": "local"}[mode]


def test_prometheus_rule_values(tmp_path):
    values = tmp_path / "rule.yaml"
    values.write_text(json.dumps({"metrics": {"prometheusRule": {
        "errorRate": {"threshold": 0.2}, "p95Latency": {"thresholdSeconds": 12}, "authFailures": {"perSecond": 3},
        "backendNotReady": {"backends": ["local", "docker"]}, "labels": {"release": "prom"},
        "additionalRules": [{"alert": "Extra", "expr": "up == 0"}]}}}))
    rule = one(render(mode_values("local"), str(values), api_versions=MONITORING), "PrometheusRule")
    alerts = alerts_of(rule)
    assert alerts["ExecutorArmHighErrorRate"]["expr"].rstrip().endswith("> 0.2")
    assert alerts["ExecutorArmHighLatency"]["expr"].rstrip().endswith("> 12")
    assert alerts["ExecutorArmAuthFailureSpike"]["expr"].rstrip().endswith("> 3")
    assert 'backend=~"local|docker"' in alerts["ExecutorArmBackendNotReady"]["expr"]
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert alerts["Extra"]["expr"] == "up == 0"
    assert of_kind(render(mode_values("local"), sets=["metrics.prometheusRule.enabled=false"],
                          api_versions=MONITORING), "PrometheusRule") == []
    assert "/metrics/prometheusRule/errorRate/window" in render_error(mode_values("local"), sets=[
        "metrics.prometheusRule.errorRate.window=soon"])


# ------------------------------------------------------------------ a live daemon's /metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _docker_ready() -> str | None:
    """Why a docker-backend run cannot happen here, or None."""
    if not shutil.which("docker"):
        return "no docker CLI"
    p = subprocess.run(["docker", "image", "inspect", "executor-arm-sandbox:latest"], capture_output=True, text=True,
                       timeout=30)
    if p.returncode != 0:
        return "docker is unreachable or has no executor-arm-sandbox:latest image: " + (p.stderr.strip() or "?")
    return None


class LiveDaemon:
    def __init__(self, binary: str):
        self.tmp = Path(tempfile.mkdtemp(prefix="executor-arm-chart-"))
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.binary = binary
        profiles = self.tmp / "profiles"
        profiles.mkdir()
        for p in (ROOT / "sandbox-profiles").glob("*.toml"):
            shutil.copy(p, profiles / p.name)
        # A profile on the docker backend, so the warm pool's families appear too.
        (profiles / "docker-probe.toml").write_text(
            'backend = "docker"\n' + (ROOT / "sandbox-profiles" / "shell-readonly.toml").read_text())
        self.stderr = open(self.tmp / "daemon.log", "w")
        env = dict(os.environ, EXECUTOR_ARM_PROFILES_DIR=str(profiles),
                   EXECUTOR_ARM_EXECUTORS_DIR=str(self.tmp / "executors"), RUST_LOG="warn",
                   EXECUTOR_ARM__SANDBOX__DOCKER__POOL_SIZE="1")
        (self.tmp / "executors").mkdir()
        self.proc = subprocess.Popen([binary, "serve", "--dev", "--listen", f"127.0.0.1:{self.port}"],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env, cwd=self.tmp,
                                     start_new_session=True)
        self.banner = self._read_banner(60)
        self.secret = re.search(r"secret (\S+) \(deleted on exit\)", self.banner).group(1)
        self.service = re.search(r"Authorization: Bearer ([A-Za-z0-9_.-]+)", self.banner).group(1)
        self.capability = re.search(r'"capability_token":"([A-Za-z0-9_.-]+)"', self.banner).group(1)
        self.audit = Path(re.search(r"^audit log: (\S+)$", self.banner, re.M).group(1))

    def instance(self) -> str:
        """This daemon's instance id (its containers carry it as label executor-arm.instance)."""
        for line in self.audit.read_text().splitlines():
            if '"instance"' in line:
                return json.loads(line)["instance"]
        raise AssertionError(f"no instance in {self.audit}")

    def _read_banner(self, timeout: float) -> str:
        lines: list[str] = []
        done = threading.Event()

        def read():
            for line in self.proc.stdout:
                lines.append(line)
                if line.startswith("curl "):
                    break
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout) or not lines or not lines[-1].startswith("curl "):
            self.stop()
            log = (self.tmp / "daemon.log").read_text()[-3000:] if (self.tmp / "daemon.log").exists() else ""
            pytest.fail(f"`{self.binary} serve --dev` printed no curl line within {timeout} s "
                        f"(it needs root for the local backend). stdout: {''.join(lines)!r}; log: {log}")
        return "".join(lines)

    def mint(self, kind: str, *args: str) -> str:
        p = subprocess.run([self.binary, "token", "mint", "--kind", kind, "--secret-file", self.secret, "--ttl", "300",
                            "--sub", "chart-test", *args], capture_output=True, text=True, timeout=30, check=True)
        return p.stdout.strip().splitlines()[-1]

    def request(self, method: str, path: str, body: dict | None = None, token: str | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def execute(self, command: str, args: list[str], capability: str, service: str | None = None, **extra):
        return self.request("POST", "/execute", {"action_type": "shell", "command": command, "args": args,
                                                 "capability_token": capability, **extra},
                            token=service or self.service)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.stderr.close()

    def cleanup(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def live_metrics() -> str:
    """/metrics of a dev-mode daemon after a success, a failed command, a capability violation, a bad service
    token and a run on the docker backend."""
    binary = daemon_binary()
    if os.geteuid() != 0:
        pytest.fail("the live-daemon tests run `executor-arm serve --dev`, whose local backend needs root")
    why = _docker_ready()
    if why:
        pytest.fail(f"the live-daemon tests make one run on the docker backend (for the warm pool's metrics), "
                    f"but {why}; scripts/setup-docker.sh and scripts/build-sandbox-image.sh set it up")
    d = LiveDaemon(binary)
    try:
        status, body = d.execute("echo", ["hello"], d.capability)
        assert status == 200 and json.loads(body)["stdout"] == "hello\n", body
        status, body = d.execute("ls", ["/nonexistent-path"], d.capability)
        assert status == 200 and json.loads(body)["success"] is False, body
        read_only = d.mint("capability", "--capabilities", "ShellRead")
        status, body = d.execute("echo", ["x"], read_only)
        assert status == 403 and json.loads(body)["error_type"] == "CapabilityViolation", body
        status, body = d.execute("echo", ["x"], d.capability, service="not-a-token")
        assert status == 401, body
        docker_cap = d.mint("capability", "--capabilities", "ShellExecute", "--profiles", "docker-probe")
        status, body = d.execute("echo", ["pooled"], docker_cap, profile="docker-probe")
        assert status == 200 and json.loads(body)["backend"] == "docker", body
        assert d.request("GET", "/readyz")[0] == 200
        status, metrics = d.request("GET", "/metrics")
        assert status == 200
        # The warm pool refills in the background: wait until its gauge is published.
        deadline = time.monotonic() + 60
        while "executor_pool_idle_containers{" not in metrics and time.monotonic() < deadline:
            time.sleep(0.5)
            metrics = d.request("GET", "/metrics")[1]
        instance = d.instance()
        yield metrics
    finally:
        d.stop()
        d.cleanup()
    # Nothing left behind: the daemon removed its containers on the way out.
    assert d.proc.returncode is not None
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=executor-arm.instance={instance}"],
                          capture_output=True, text=True, timeout=30).stdout.split()
    assert left == [], f"containers of the test daemon left behind: {left}"


def exposed(metrics_text: str) -> set[str]:
    """Every name /metrics exposes: sample names (with histograms' _bucket/_sum/_count series), plus a
    histogram's base name."""
    names, histograms = set(), set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            if kind in ("histogram", "summary"):
                histograms.add(name)
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group())
    for n in list(names):
        for suffix in ("_bucket", "_sum", "_count"):
            if n.endswith(suffix) and n[: -len(suffix)] in histograms:
                names.add(n[: -len(suffix)])
    return names


def _missing(wanted: set[str], have: set[str]) -> set[str]:
    missing = set()
    for name in wanted:
        if name in have:
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        # A histogram's series: the base must be exposed as a histogram with that series.
        if base != name and base in have and name in have:
            continue
        missing.add(name)
    return missing


def test_every_dashboard_metric_is_exposed(live_metrics):
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    missing = _missing(dashboard_metrics(dashboard), exposed(live_metrics))
    assert missing == set(), f"the dashboard queries metrics /metrics does not have: {sorted(missing)}"


@pytest.mark.parametrize("m", MODES)
def test_every_alert_metric_is_exposed(live_metrics, m):
    wanted = set().union(*(metric_names(a["expr"]) for a in alerts_of(rule_doc(m)).values()))
    missing = _missing(wanted, exposed(live_metrics))
    assert missing == set(), f"alerts query metrics /metrics does not have: {sorted(missing)}"


def test_live_backend_ready_gauge(live_metrics):
    assert 'executor_backend_ready{backend="local"} 1' in live_metrics.splitlines()
    assert 'executor_backend_ready{backend="docker"} 1' in live_metrics.splitlines()


def test_helm_test_script_passes_against_a_live_daemon():
    """The `helm test` pod's script, run here against a dev daemon (its URL and secret in place of the
    Service's and the Secret's)."""
    docs = render(mode_values("dind"), sets=["auth.issuer="])
    (pod,) = [d for d in of_kind(docs, "Pod")]
    (c,) = pod["spec"]["containers"]
    binary = daemon_binary()
    if os.geteuid() != 0:
        pytest.fail("the live-daemon tests need root")
    d = LiveDaemon(binary)
    try:
        # The script calls `executor-arm` from PATH, as in the image.
        bindir = d.tmp / "bin"
        bindir.mkdir()
        (bindir / "executor-arm").symlink_to(os.path.abspath(binary))
        env = dict(os.environ, EXECUTOR_ARM_URL=d.base, EXECUTOR_ARM_JWT_SECRET_FILE=d.secret,
                   PATH=f"{bindir}:{os.environ['PATH']}")
        # Run at once: the daemon refuses single-use tokens minted in its first seconds (before its
        # replay record begins), which the script waits out.
        p = subprocess.run(c["command"] + c["args"], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "OK: /health and /execute" in p.stdout
    finally:
        d.stop()
        d.cleanup()
