#!/usr/bin/env bash
# Builds the daemon image around the host's release binary (Dockerfile target `daemon-prebuilt`;
# `daemon`, the default target, builds the same from source) and runs it:
# the container must answer /health, run POST /execute from outside, and exit 0 on SIGTERM.
# The local backend needs privileges to build sandboxes: the container gets exactly the
# capabilities it uses (SYS_ADMIN for namespaces and mounts, SETUID/SETGID/SETPCAP to drop each
# run's identity, KILL, DAC_OVERRIDE/FOWNER/CHOWN for the cgroup tree), no seccomp/AppArmor profile
# of its own (it installs a stricter one per run) and a writable cgroup tree. See
# docs/deployment.md for the modes where the daemon runs unprivileged.
set -Eeuo pipefail
trap 'echo "test-daemon-image: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

image=executor-arm:ci
name=executor-arm-ci-$$
work=$(mktemp -d)
cleanup() { docker rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

cargo build --release --locked --bin executor-arm
# The in-container supervisor beside it, static (the image's COPY takes both).
scripts/build-supervisor.sh --release target/release/executor-arm-supervisor >/dev/null
base=${BASE_IMAGE:-executor-arm-debian-base:bookworm}
# Built from the base's image ID, so a tag moved meanwhile cannot change what the image is built on.
base_id=$(docker image inspect -f '{{.Id}}' "$base")
DOCKER_BUILDKIT=0 docker build -q --target daemon-prebuilt --build-arg "BASE_IMAGE=$base_id" \
  --build-arg "BASE_IMAGE_NAME=$base" \
  --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)" -t "$image" . >/dev/null
echo "built $image ($(docker image inspect -f '{{.Size}}' "$image") bytes)"
# The shipped binary carries symbols but no DWARF (Cargo.toml's release profile).
docker create --name "$name" "$image" >/dev/null
docker cp "$name:/usr/local/bin/executor-arm" "$work/shipped-binary"
docker cp "$name:/usr/local/bin/executor-arm-supervisor" "$work/shipped-supervisor"
docker rm "$name" >/dev/null
# The supervisor must be static: it runs in sandbox images with any libc or none.
readelf -lW "$work/shipped-supervisor" > "$work/segments"
if grep -q 'INTERP' "$work/segments"; then
  echo "test-daemon-image: the image's executor-arm-supervisor is dynamically linked" >&2
  exit 1
fi
rm -f "$work/shipped-supervisor"
# readelf's own failure stops the script (set -e); grep -c prints 0 and exits 1 when no section
# matches, which is the case wanted here.
readelf -S --wide "$work/shipped-binary" > "$work/sections"
dwarf=$(grep -c '\.debug_' "$work/sections" || true)
[ "$dwarf" = 0 ] || { echo "test-daemon-image: the image's binary has $dwarf .debug_* sections" >&2; exit 1; }
rm -f "$work/shipped-binary"

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/jwt-secret"
chmod 0644 "$work/jwt-secret"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
docker run -d --name "$name" --cgroupns=host \
  --cap-drop ALL --cap-add SYS_ADMIN --cap-add SETUID --cap-add SETGID --cap-add SETPCAP \
  --cap-add KILL --cap-add DAC_OVERRIDE --cap-add FOWNER --cap-add CHOWN \
  --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
  -v /sys/fs/cgroup:/sys/fs/cgroup:rw \
  -p "127.0.0.1:$port:8003" \
  -v "$work:/run/executor-arm-secrets:ro" \
  -e EXECUTOR_ARM_JWT_SECRET_FILE=/run/executor-arm-secrets/jwt-secret \
  "$image" >/dev/null

for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.1
done
health=$(curl -fsS "http://127.0.0.1:$port/health")
echo "health: $health"
grep -q '"status":"healthy"' <<<"$health"

bin=target/release/executor-arm
svc=$($bin token mint --kind service --secret-file "$work/jwt-secret" --sub ci --ttl 120 | tail -n1)
cap=$($bin token mint --kind capability --secret-file "$work/jwt-secret" --capabilities ShellExecute --ttl 60 | tail -n1)
out=$(curl -sS "http://127.0.0.1:$port/execute" -H "Authorization: Bearer $svc" -H 'Content-Type: application/json' \
  -d "{\"action_type\":\"shell\",\"command\":\"echo\",\"args\":[\"hello from the container\"],\"capability_token\":\"$cap\"}")
echo "execute: ${out:0:200}"
grep -q '"stdout":"hello from the container\\n"' <<<"$out"
grep -q '"success":true' <<<"$out"
ready=$(curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/readyz")
[ "$ready" = 200 ]

docker stop -t 20 "$name" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
echo "exit code after SIGTERM: $code"
[ "$code" = 0 ]
echo "test-daemon-image: OK"
