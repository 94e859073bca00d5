"""Security- and contract-relevant properties of the rendered executor-arm chart, per mode.

Every ci/<mode>-values.yaml is rendered with the real helm binary and the manifests are checked; further
renders with --set check the guards (fail() messages), the optional resources and the config format.
"""

from __future__ import annotations

import hashlib
import re
import tomllib

import pytest
import yaml

from conftest import (CHART, MODES, NAMESPACE, ROOT, all_containers, config_map, daemon, mode_values, of_kind,
                      one, pod_spec, render, render_error)

API_MAX_TIMEOUT = 300
SECRET = "auth.jwtSecret=test-secret-0123456789"


def config_toml(docs) -> dict:
    cm = config_map(docs)
    return tomllib.loads(cm["data"]["executor-arm.toml"])


def env_of(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def mounts_of(container) -> dict:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def volumes_of(docs) -> dict:
    return {v["name"]: v for v in pod_spec(docs).get("volumes", [])}


def selector_labels(docs) -> dict:
    return one(docs, "Deployment")["spec"]["selector"]["matchLabels"]


# ------------------------------------------------------------------ every mode


def test_ci_values_files_exist_for_every_mode():
    for m in MODES:
        assert (CHART / "ci" / mode_values(m)).is_file()
        assert yaml.safe_load((CHART / "ci" / mode_values(m)).read_text())["mode"] == m


def test_expected_resources(docs, mode):
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("ConfigMap", "Deployment", "NetworkPolicy", "Service", "ServiceAccount"):
        assert kind in kinds
    for d in docs:
        assert d["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        hook = d["metadata"].get("annotations", {}).get("helm.sh/hook")
        # The `helm test` pod is named apart so the Deployment's selector does not match it.
        name = "executor-arm-test" if hook == "test" else "executor-arm"
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == name


def test_liveness_readiness_startup_probes(docs):
    c = daemon(docs)
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "startupProbe" in c and c["startupProbe"]["httpGet"]["path"] == "/livez"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8003}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", 8003)


def test_daemon_command_and_config_path(docs):
    c = daemon(docs)
    assert c["command"] == ["/usr/local/bin/executor-arm"]
    assert c["args"] == ["serve", "--config", "/etc/executor-arm/executor-arm.toml"]
    m = mounts_of(c)["/etc/executor-arm/executor-arm.toml"]
    assert m["subPath"] == "executor-arm.toml" and m["readOnly"] is True
    assert c["image"] == "executor-arm:0.1.0"


def test_resources_requests_and_limits_on_every_container(docs):
    for c in all_containers(docs):
        res = c["resources"]
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[part]), f"{c['name']} lacks {part}"


def test_common_pod_hardening(docs, mode):
    spec = pod_spec(docs)
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key, False)
    for v in spec["volumes"]:
        # The one node directory: local mode's uid locks, which every daemon on the node must
        # share (that mode's daemon is privileged already; it gains nothing it could not mount).
        if mode == "local" and v["name"] == "uid-locks":
            continue
        assert "hostPath" not in v, f"volume {v['name']} is a hostPath"
    c = daemon(docs)
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    mounts = mounts_of(c)
    for path in ("/tmp", "/var/lib/executor-arm"):
        vol = volumes_of(docs)[mounts[path]["name"]]
        assert "emptyDir" in vol and vol["emptyDir"].get("sizeLimit")
    for path, m in mounts.items():
        if path.startswith("/etc/executor-arm"):
            assert m.get("readOnly") is True, f"{path} must be mounted read-only"


def test_service_account_token_not_mounted(docs):
    sa = one(docs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    assert pod_spec(docs)["serviceAccountName"] == sa["metadata"]["name"]


def test_termination_grace_above_max_timeout(docs):
    cfg = config_toml(docs)
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    pre_stop = daemon(docs).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert grace > API_MAX_TIMEOUT
    assert grace > API_MAX_TIMEOUT + cfg["server"]["shutdown_grace_seconds"] + pre_stop


def test_checksum_annotation_matches_configmap(docs):
    ann = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", ann["checksum/config"])


def test_service(docs):
    svc = one(docs, "Service")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8003, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == selector_labels(docs)


def test_network_policy_default_deny(docs, mode):
    np = one(docs, "NetworkPolicy")
    spec = np["spec"]
    assert spec["podSelector"]["matchLabels"] == selector_labels(docs)
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    # Ingress: only from listed peers, only to the daemon port.
    for rule in spec["ingress"]:
        assert rule["from"], "an ingress rule without peers would admit everyone"
        assert rule["ports"] == [{"protocol": "TCP", "port": 8003}]
    # Egress: DNS first, then Redis (dind, gvisor configure it), then the explicit extras only.
    egress = spec["egress"]
    dns = egress[0]
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert dns["to"], "DNS egress must be limited to the cluster DNS"
    ports = [tuple(sorted((p["protocol"], p["port"]) for p in r["ports"])) for r in egress[1:]]
    if mode == "local":
        assert ports == []
    if mode == "dind":
        assert ports == [(("TCP", 6380),), (("TCP", 443),)]
        assert egress[1]["to"]
    if mode == "gvisor":
        assert ports == [(("TCP", 6379),)]


def test_no_service_monitor_without_the_api(docs):
    assert of_kind(docs, "ServiceMonitor") == []


def test_config_toml_parses_and_listens_on_8003(docs, mode):
    cfg = config_toml(docs)
    assert cfg["server"]["listen"] == "0.0.0.0:8003"
    assert cfg["server"]["listen"].rsplit(":", 1)[1] == "8003"
    assert cfg["sandbox"]["profiles_dir"] == "/etc/executor-arm/sandbox-profiles"
    assert cfg["executors"]["dir"] == "/etc/executor-arm/executors"
    assert cfg["audit"]["path"].startswith("/var/lib/executor-arm/")
    env = env_of(daemon(docs))
    assert env["EXECUTOR_ARM_LISTEN"] == cfg["server"]["listen"]
    # Other replicas reach this pod at its own address, on the port it listens on.
    assert env["EXECUTOR_ARM_ADVERTISE_URL"] == "http://$(POD_IP):8003"
    assert cfg["executions"]["retention_seconds"] == 3600
    assert cfg["server"]["queue"] == {"max_waiting": 256, "max_wait_ms": 30000}
    assert env["EXECUTOR_ARM_AUDIT_LOG"] == cfg["audit"]["path"]
    assert env["EXECUTOR_ARM_PROFILES_DIR"] == cfg["sandbox"]["profiles_dir"]
    assert env["EXECUTOR_ARM_EXECUTORS_DIR"] == cfg["executors"]["dir"]
    runtime = {"local": "local", "docker": "runc", "gvisor": "gvisor"}[cfg["sandbox"]["default_backend"]]
    assert env["SANDBOX_RUNTIME"] == runtime
    if "jwt_secret_file" in cfg["auth"]:
        assert env["EXECUTOR_ARM_JWT_SECRET_FILE"] == cfg["auth"]["jwt_secret_file"]
        assert cfg["auth"]["jwt_secret_file"].startswith("/etc/executor-arm/secrets/")


def test_paths_the_daemon_writes_are_on_writable_volumes(docs, mode):
    # The root file system is read-only in every mode: the audit log, the state file and the
    # locks of the sandbox uids must each be under a volume the daemon mounts read-write.
    cfg = config_toml(docs)
    writable = [p for p, m in mounts_of(daemon(docs)).items() if not m.get("readOnly")]
    for path in (cfg["audit"]["path"], cfg["state"]["dir"], cfg["sandbox"]["local"]["uid_lock_dir"]):
        assert any(path.startswith(w.rstrip("/") + "/") for w in writable), (path, writable)


def test_profiles_and_executors_each_their_own_key_and_mount(docs):
    cm = config_map(docs)
    cfg = config_toml(docs)
    profile_keys = {k for k in cm["data"] if k.startswith("profile.")}
    assert profile_keys, "no sandbox profile rendered"
    for key in profile_keys:
        tomllib.loads(cm["data"][key])
    names = {k[len("profile."):-len(".toml")] for k in profile_keys}
    for cmd in cfg["commands"].values():
        assert cmd["profile"] in names
    vols = volumes_of(docs)
    mounts = mounts_of(daemon(docs))
    prof = vols[mounts["/etc/executor-arm/sandbox-profiles"]["name"]]["configMap"]
    assert {(i["key"], i["path"]) for i in prof["items"]} == {(f"profile.{n}.toml", f"{n}.toml") for n in names}
    execs = vols[mounts["/etc/executor-arm/executors"]["name"]]
    executor_keys = {k for k in cm["data"] if k.startswith("executor.")}
    if executor_keys:
        items = {(i["key"], i["path"]) for i in execs["configMap"]["items"]}
        for key in executor_keys:
            name = key[len("executor."):-len(".yaml")]
            assert (key, f"{name}.yaml") in items
            definition = yaml.safe_load(cm["data"][key])
            assert definition["metadata"]["name"] == name
            assert definition["kind"] == "Executor" and definition["schemaVersion"] == 2
    else:
        assert "emptyDir" in execs


def test_auth_secret_mounted_read_only_with_only_needed_keys(docs, mode):
    spec = pod_spec(docs)
    vols = volumes_of(docs)
    m = mounts_of(daemon(docs))["/etc/executor-arm/secrets"]
    assert m["readOnly"] is True
    secret = vols[m["name"]]["secret"]
    assert secret["defaultMode"] == 0o440
    keys = [i["key"] for i in secret["items"]]
    assert keys, "the auth secret must project explicit keys"
    if mode == "dind":
        # Chart-created from auth.jwtSecret; the pod restarts when it changes.
        created = one(docs, "Secret")
        assert secret["secretName"] == created["metadata"]["name"]
        assert set(created["data"]) == {"jwt-secret"}
        assert "checksum/secret" in one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    else:
        assert of_kind(docs, "Secret") == [], "existingSecret: the chart must not create a Secret"
        assert secret["secretName"] == "executor-arm-auth"
    assert spec.get("securityContext") is not None


# ------------------------------------------------------------------ per mode


def test_local_mode_shape():
    docs = render(mode_values("local"))
    spec = pod_spec(docs)
    assert "initContainers" not in spec and len(spec["containers"]) == 1
    assert "runtimeClassName" not in spec
    sc = daemon(docs)["securityContext"]
    # The local backend needs to unshare, mount and write cgroups: privileged, said out loud.
    assert sc["privileged"] is True
    assert sc["runAsUser"] == 0
    assert sc["seccompProfile"]["type"] == "Unconfined"
    assert sc["appArmorProfile"]["type"] == "Unconfined"
    assert sc["readOnlyRootFilesystem"] is True
    cfg = config_toml(docs)
    assert cfg["sandbox"]["default_backend"] == "local"
    assert env_of(daemon(docs))["ALLOWED_COMMANDS"] == "echo,ls,cat,python3"
    assert cfg["auth"]["issuer"] == "orchestrator"
    assert cfg["auth"]["static_tokens"][0]["id"] == "ci-orchestrator"
    assert of_kind(docs, "PodDisruptionBudget") == []
    assert of_kind(docs, "HorizontalPodAutoscaler") == []
    assert one(docs, "Deployment")["spec"]["replicas"] == 1


def test_dind_mode_daemon_unprivileged_sidecar_privileged():
    docs = render(mode_values("dind"))
    spec = pod_spec(docs)
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10000
    c = daemon(docs)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10000
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")
    assert sc.get("privileged", False) is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    # dockerd: a native sidecar, the only privileged container, after the supervisor's copy.
    (supervisor, dockerd) = spec["initContainers"]
    assert dockerd["name"] == "dockerd"
    assert dockerd["restartPolicy"] == "Always"
    assert dockerd["securityContext"]["privileged"] is True
    assert "startupProbe" in dockerd
    privileged = [x["name"] for x in all_containers(docs) if x.get("securityContext", {}).get("privileged")]
    assert privileged == ["dockerd"]
    # The socket is shared through an emptyDir mounted in both containers, and the group is the daemon's.
    sock_dir = "/run/executor-arm-docker"
    assert mounts_of(dockerd)[sock_dir]["name"] == mounts_of(c)[sock_dir]["name"]
    assert "emptyDir" in volumes_of(docs)[mounts_of(c)[sock_dir]["name"]]
    assert f"--host=unix://{sock_dir}/docker.sock" in dockerd["args"]
    assert f"--group={sc['runAsGroup']}" in dockerd["args"]
    assert not any(a.startswith("--host=tcp") for a in dockerd["args"])
    assert {"name": "DOCKER_TLS_CERTDIR", "value": ""} in dockerd["env"]
    cfg = config_toml(docs)
    assert cfg["sandbox"]["docker"]["socket"] == f"unix://{sock_dir}/docker.sock"
    assert cfg["sandbox"]["default_backend"] == "docker"
    assert cfg["state"]["redis_url"].startswith("redis://")
    daemon_json = yaml.safe_load(config_map(docs)["data"]["dind-daemon.json"])
    assert daemon_json["runtimes"]["runsc"]["path"] == "/usr/local/bin/runsc"
    # Egress: the proxy sockets live on the volume dockerd shares, and runsc may connect to them.
    assert cfg["sandbox"]["docker"]["egress_dir"] == f"{sock_dir}/egress"
    # The static in-container supervisor: copied from the daemon image by an unprivileged init
    # container to a volume the daemon and dockerd see read-only at the same path.
    sup_dir = "/run/executor-arm-supervisor"
    assert cfg["sandbox"]["docker"]["supervisor"] == f"{sup_dir}/executor-arm-supervisor"
    assert supervisor["name"] == "supervisor" and "restartPolicy" not in supervisor
    assert supervisor["image"] == c["image"]
    assert supervisor["command"] == [
        "/bin/cp",
        "/usr/local/bin/executor-arm-supervisor",
        f"{sup_dir}/executor-arm-supervisor",
    ]
    assert supervisor["securityContext"] == sc
    assert not mounts_of(supervisor)[sup_dir].get("readOnly")
    for x in (c, dockerd):
        assert mounts_of(x)[sup_dir]["readOnly"] is True
        assert mounts_of(x)[sup_dir]["name"] == mounts_of(supervisor)[sup_dir]["name"]
    assert "emptyDir" in volumes_of(docs)[mounts_of(c)[sup_dir]["name"]]
    assert daemon_json["runtimes"]["runsc"]["runtimeArgs"] == [
        "--platform=systrap",
        "--host-uds=open",
        "--oci-seccomp",
    ]
    # Two replicas with shared state: PDB on.
    assert one(docs, "Deployment")["spec"]["replicas"] == 2
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    tsc = spec["topologySpreadConstraints"][0]
    assert tsc["labelSelector"]["matchLabels"] == selector_labels(docs)


def test_gvisor_mode_runtime_class_and_no_privileged_container():
    docs = render(mode_values("gvisor"))
    spec = pod_spec(docs)
    assert spec["runtimeClassName"] == "gvisor"
    assert "initContainers" not in spec
    for c in all_containers(docs):
        assert not c.get("securityContext", {}).get("privileged", False)
    sc = daemon(docs)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "ALL" not in sc["capabilities"].get("add", [])
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"]["type"] != "Unconfined"
    assert "appArmorProfile" not in sc
    cfg = config_toml(docs)
    assert cfg["sandbox"]["default_backend"] == "local"
    assert "jwt_secret_file" not in cfg["auth"]
    assert cfg["auth"]["public_keys"] == [
        {"kid": "orchestrator-2026", "alg": "EdDSA", "pem_file": "/etc/executor-arm/secrets/orchestrator.pem"}]
    env = env_of(daemon(docs))
    assert "EXECUTOR_ARM_JWT_SECRET_FILE" not in env
    assert env["EXECUTOR_ARM_REDIS_URL"] == {"secretKeyRef": {"name": "executor-arm-redis", "key": "redis-url"}}
    # Autoscaled: HPA autoscaling/v2, no fixed replicas, PDB on (minReplicas 2).
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert "replicas" not in one(docs, "Deployment")["spec"]
    assert of_kind(docs, "PodDisruptionBudget")


def test_gvisor_runtime_class_defaults_to_gvisor():
    docs = render(mode_values("gvisor"), sets=["runtimeClassName="])
    assert pod_spec(docs)["runtimeClassName"] == "gvisor"


# ------------------------------------------------------------------ ServiceMonitor


def test_service_monitor_rendered_only_with_the_api():
    docs = render(mode_values("local"), api_versions=["monitoring.coreos.com/v1"])
    sm = one(docs, "ServiceMonitor")
    svc = one(docs, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    # Structural check in place of a schema (kubernetes-validate has none for this CRD).
    assert set(sm["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    assert re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"])
    assert of_kind(render(mode_values("local"), api_versions=["monitoring.coreos.com/v1"],
                          sets=["metrics.serviceMonitor.enabled=false"]), "ServiceMonitor") == []


# ------------------------------------------------------------------ defaults and toggles


def test_default_values_render_with_a_secret():
    docs = render(sets=[SECRET])
    assert config_toml(docs)["sandbox"]["default_backend"] == "local"
    assert daemon(docs)["securityContext"]["privileged"] is True
    np = one(docs, "NetworkPolicy")["spec"]
    # No ingress peers configured: all ingress denied but the release's `helm test` pod's.
    assert [p for rule in np["ingress"] for p in rule["from"]] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "executor-arm-test", "app.kubernetes.io/instance": "ea"}}}]
    assert one(render(sets=[SECRET, "tests.enabled=false"]), "NetworkPolicy")["spec"]["ingress"] == []
    assert len(np["egress"]) == 1 and np["egress"][0]["ports"][0]["port"] == 53
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 300 + 30 + 5 + 50


def test_development_install_generates_a_secret():
    docs = render(sets=["production=false"])
    secret = one(docs, "Secret")
    assert len(secret["data"]["jwt-secret"]) > 0
    assert "generated" in secret["metadata"]["annotations"]["executor-arm/generated"]


def test_checksum_changes_with_the_config():
    a = one(render(sets=[SECRET]), "Deployment")["spec"]["template"]["metadata"]["annotations"]
    b = one(render(sets=[SECRET, "config.server.shutdownGraceSeconds=20"]),
            "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert a["checksum/config"] != b["checksum/config"]


def test_checksum_is_sha256_of_the_rendered_configmap():
    from conftest import _render
    out = _render((), (SECRET,), ())
    chunks = out.split("---\n")
    cm_src = next(c for c in chunks if c.startswith("# Source: executor-arm/templates/configmap.yaml"))
    cm_body = cm_src.split("\n", 1)[1]
    ann = one(render(sets=[SECRET]), "Deployment")["spec"]["template"]["metadata"]["annotations"]
    # helm hashes the template output, which starts with a newline and lacks the Source comment.
    candidates = {hashlib.sha256(s.encode()).hexdigest() for s in (cm_body, "\n" + cm_body, cm_body.rstrip("\n"),
                                                                    "\n" + cm_body.rstrip("\n"))}
    assert ann["checksum/config"] in candidates


def test_pdb_follows_replicas():
    assert of_kind(render(sets=[SECRET]), "PodDisruptionBudget") == []
    docs = render(sets=[SECRET, "replicaCount=3", "state.redisUrl=redis://redis:6379/0"])
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector_labels(docs)
    assert of_kind(render(sets=[SECRET, "replicaCount=3", "state.redisUrl=redis://redis:6379/0",
                                "podDisruptionBudget.enabled=false"]), "PodDisruptionBudget") == []


def test_hpa_off_by_default():
    docs = render(sets=[SECRET])
    assert of_kind(docs, "HorizontalPodAutoscaler") == []
    assert one(docs, "Deployment")["spec"]["replicas"] == 1


def test_explicit_termination_grace_is_kept():
    docs = render(sets=[SECRET, "terminationGracePeriodSeconds=400"])
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 400


def test_redis_egress_port_from_url():
    docs = render(sets=[SECRET, "state.redisUrl=redis://cache.example:7000/1"])
    egress = one(docs, "NetworkPolicy")["spec"]["egress"]
    assert egress[1]["ports"] == [{"protocol": "TCP", "port": 7000}]
    assert env_of(daemon(docs))["EXECUTOR_ARM_REDIS_URL"] == "redis://cache.example:7000/1"


def test_network_policy_can_be_disabled():
    assert of_kind(render(sets=[SECRET, "networkPolicy.enabled=false"]), "NetworkPolicy") == []


# ------------------------------------------------------------------ guards


@pytest.mark.parametrize("sets, message", [
    (["mode=bogus"], "mode"),
    (["unknownKey=1"], "unknownKey"),
    (["image.bogus=1"], "bogus"),
    (["service.type=ExternalName"], "type"),
    ([], "production mode needs a JWT verification secret"),
    ([SECRET, "auth.existingSecret=mine"], "both set"),
    ([SECRET, "replicaCount=2"], "shared state"),
    ([SECRET, "autoscaling.enabled=true"], "shared state"),
    ([SECRET, "terminationGracePeriodSeconds=330"], "must be above"),
    ([SECRET, "terminationGracePeriodSeconds=100"], "must be above"),
    ([SECRET, "profiles.long=timeout_max_seconds = 900"], "above the API's maximum"),
    ([SECRET, "commands.foo.actionTypes={shell}", "commands.foo.capabilities={ShellExecute}",
      "commands.foo.profile=missing"], "not defined in profiles"),
    ([SECRET, "allowedCommands={rm}"], "not in commands"),
    ([SECRET, "state.redisUrl=redis://user:pw@redis:6379/0"], "carries credentials"),
    ([SECRET, "mode=dind", "securityContext.dind.runAsUser=0"], "non-root"),
    ([SECRET, "mode=gvisor", "securityContext.gvisor.privileged=true"], "privileged"),
    ([SECRET, "mode=local", "config.sandbox.defaultBackend=docker"], "needs mode dind"),
    ([SECRET, "mode=dind", "config.sandbox.defaultBackend=local"], "must be docker or gvisor"),
    ([SECRET, "auth.publicKeys[0].secretKey=k.pem"], "set auth.existingSecret"),
    ([SECRET, "executors.foo.metadata.name=bar"], "metadata.name must equal"),
])
def test_guards(sets, message):
    assert message in render_error(sets=sets)


# ------------------------------------------------------------------ conformance with the daemon's formats


def _documented_config() -> dict:
    """config/executor-arm.toml with its commented-out example keys enabled."""
    text = (ROOT / "config" / "executor-arm.toml").read_text()
    line = re.compile(r"^#\s?(\s*(\[\[?[a-z_.]+\]\]?|[a-z_0-9]+\s*=.*))$")
    return tomllib.loads("\n".join(m.group(1) if (m := line.match(ln)) else ln for ln in text.splitlines()))


def _check_shape(rendered, documented, path):
    for key, value in rendered.items():
        where = f"{path}.{key}" if path else key
        if path == "commands":
            # Command tables: any name; keys as documented, plus the argument-policy keys.
            allowed = set().union(*(set(c) for c in documented.values())) | {"deny_args", "deny_prefixes"}
            assert set(value) <= allowed, f"{where}: unknown keys {set(value) - allowed}"
            continue
        assert key in documented, f"{where} is not a key of config/executor-arm.toml"
        ref = documented[key]
        if isinstance(value, dict):
            assert isinstance(ref, dict), where
            _check_shape(value, ref, where)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            assert isinstance(ref, list) and ref and isinstance(ref[0], dict), where
            allowed = set().union(*(set(r) for r in ref))
            for item in value:
                assert set(item) <= allowed, f"{where}: unknown keys {set(item) - allowed}"
        else:
            assert type(value) is type(ref), f"{where}: {type(value).__name__} vs {type(ref).__name__}"


@pytest.mark.parametrize("m", MODES)
def test_rendered_config_uses_the_daemon_format(m):
    _check_shape(config_toml(render(mode_values(m))), _documented_config(), "")


def test_default_allowlist_matches_the_repository_config():
    documented = tomllib.loads((ROOT / "config" / "executor-arm.toml").read_text())
    rendered = config_toml(render(sets=[SECRET]))
    assert rendered["commands"] == documented["commands"]
    for key in ("body_limit_bytes", "header_read_timeout_ms", "shutdown_grace_seconds", "concurrency"):
        assert rendered["server"][key] == documented["server"][key]


# ------------------------------------------------------------------ NOTES.txt


@pytest.mark.parametrize("m", MODES)
def test_notes_explain_tokens_and_execute(m):
    import subprocess
    from conftest import CI, helm_binary
    proc = subprocess.run([helm_binary(), "install", "ea", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                           "-f", str(CI / mode_values(m))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"mode {m}" in notes
    assert "port-forward svc/ea-executor-arm 8003:8003" in notes
    assert "POST /execute" in notes and "http://127.0.0.1:8003/execute" in notes
    assert '"capability_token"' in notes and "Authorization: Bearer" in notes
    if m == "gvisor":
        assert "HS256 is disabled" in notes
    else:
        assert "get secret" in notes and "jwt.encode" in notes


def test_default_map_entries_can_be_removed_with_null():
    docs = render(sets=[SECRET, "commands.nmap=null", "commands.curl=null", "commands.wget=null",
                        "profiles.http-egress=null"])
    cfg = config_toml(docs)
    assert set(cfg["commands"]) == {"cat", "echo", "grep", "ls", "python3"}
    assert "profile.http-egress.toml" not in config_map(docs)["data"]


def test_local_mode_shares_the_uid_locks_with_every_daemon_on_the_node(mode):
    # Sandbox uids are host uids: two daemon pods on one node that kept their locks apart could
    # hand the same uid (and its kernel counters) to two sandboxes. In local mode the lock
    # directory is a node directory; other modes mount nothing of the node.
    docs = render(mode_values(mode))
    cfg = config_toml(docs)
    vols = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    host = {n: v for n, v in vols.items() if "hostPath" in v}
    if mode != "local":
        assert host == {}, host
        return
    assert list(host) == ["uid-locks"], host
    assert host["uid-locks"]["hostPath"] == {"path": "/var/lib/executor-arm/uids", "type": "DirectoryOrCreate"}
    mounts = mounts_of(daemon(docs))
    assert mounts[cfg["sandbox"]["local"]["uid_lock_dir"]]["name"] == "uid-locks", mounts
    # Off: the locks stay on the pod's state volume.
    docs = render(mode_values(mode), sets=["config.sandbox.local.uidLockHostPath="])
    assert not any("hostPath" in v for v in pod_spec(docs)["volumes"])


def test_paused_sessions_stay_in_the_state_dir_unless_a_claim_is_named():
    plain = render(mode_values("local"))
    assert "EXECUTOR_ARM__SESSIONS__STORE_DIR" not in env_of(daemon(plain))
    assert "paused-sessions" not in volumes_of(plain)

    docs = render(mode_values("local"), sets=["state.pausedSessionsClaim=paused-sessions"])
    env = env_of(daemon(docs))
    assert env["EXECUTOR_ARM__SESSIONS__STORE_DIR"] == "/var/lib/executor-arm/paused-sessions"
    mount = mounts_of(daemon(docs))["/var/lib/executor-arm/paused-sessions"]
    claim = volumes_of(docs)[mount["name"]]["persistentVolumeClaim"]
    assert claim == {"claimName": "paused-sessions"}
    err = render_error(mode_values("local"), sets=["state.pausedSessionsClaim=Not_A_Name"])
    assert "pausedSessionsClaim" in err, err
