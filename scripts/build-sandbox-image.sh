#!/usr/bin/env bash
# Build executor-arm's sandbox image on a machine with no image registry, and prove it runs under
# both runc and gVisor (runsc).
#
#   1. Base image (BASE_IMAGE): used when present; else `docker pull` of PULL_IMAGE (bounded by
#      PULL_TIMEOUT) tagged as BASE_IMAGE; else debootstrap (minbase, bookworm, from the host's own
#      apt mirror) + `docker import`.
#   2. `docker build --target sandbox` of the top-level Dockerfile, skipped when the image already
#      carries the hash of its inputs (Dockerfile, .dockerignore, docker/image/*, base image id).
#   3. Smoke tests: base image under runsc; sandbox image under runc and runsc (python3, user,
#      no setuid files, and proof that the runsc run really is gVisor).
# Idempotent; exits non-zero on any failure. Needs a running dockerd with the runsc runtime
# (scripts/setup-docker.sh).
#
# Environment:
#   BASE_IMAGE      local Debian bookworm base   (default executor-arm-debian-base:bookworm)
#   SANDBOX_IMAGE   image to build               (default executor-arm-sandbox:latest)
#   PULL_IMAGE      registry fallback for a base (default debian:bookworm-slim)
#   PULL_TIMEOUT    seconds allowed for the pull (default 15)
#   DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR   debootstrap/apt mirrors (default: read from host apt)
#   BUILD_NETWORK   `docker build --network`     (default: docker's default bridge)
#   FORCE_REBUILD=1 rebuild even when the input hash matches
set -Eeuo pipefail
trap 'printf "[build-sandbox] ERROR: line %s: \`%s\` failed (exit %s)\n" "${LINENO}" "${BASH_COMMAND}" "$?" >&2' ERR

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd -- "${SCRIPT_DIR}/.." && pwd)"
cd -- "${REPO_ROOT}"
# shellcheck source=lib/apt-mirror.sh
. "${SCRIPT_DIR}/lib/apt-mirror.sh"

BASE_IMAGE="${BASE_IMAGE:-executor-arm-debian-base:bookworm}"
SANDBOX_IMAGE="${SANDBOX_IMAGE:-executor-arm-sandbox:latest}"
PULL_IMAGE="${PULL_IMAGE:-debian:bookworm-slim}"
PULL_TIMEOUT="${PULL_TIMEOUT:-15}"
BUILD_NETWORK="${BUILD_NETWORK:-}"
FORCE_REBUILD="${FORCE_REBUILD:-0}"
SUITE=bookworm
HASH_LABEL=org.executor-arm.sandbox.inputs-hash
COMPONENT_LABEL=org.executor-arm.component

log() { printf '[build-sandbox] %s\n' "$*"; }
die() {
    printf '[build-sandbox] ERROR: %s\n' "$*" >&2
    exit 1
}

step_start=${SECONDS}
step() {
    log "-- $* (t+$((SECONDS - step_start))s)"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }
image_size_mb() { docker image inspect -f '{{.Size}}' "$1" | awk '{ printf "%.1f MB", $1 / 1000000 }'; }

# One builder at a time on this machine.
exec 9>"/var/lock/executor-arm-build-sandbox.lock"
flock -w 900 9 || die "another build-sandbox-image.sh run holds /var/lock/executor-arm-build-sandbox.lock"

# ---------------------------------------------------------------------------------------------
# 0. Docker must be up, with runsc
# ---------------------------------------------------------------------------------------------
command -v docker >/dev/null 2>&1 || die "docker CLI not found; run scripts/setup-docker.sh"
timeout 20 docker info >/dev/null 2>&1 || die "dockerd is not answering; run scripts/setup-docker.sh"
# shellcheck disable=SC2016 # a Go template, not shell
runtimes="$(timeout 20 docker info --format '{{range $name, $_ := .Runtimes}}{{println $name}}{{end}}')"
grep -qx runsc <<<"${runtimes}" || die "dockerd has no runsc runtime; run scripts/setup-docker.sh"

# ---------------------------------------------------------------------------------------------
# 1. Base image
# ---------------------------------------------------------------------------------------------
rootfs=""
cleanup_rootfs() {
    [[ -n ${rootfs} && -d ${rootfs} ]] || return 0
    local mnt
    # debootstrap mounts /proc and /sys inside the target; never delete through a live mount.
    while read -r mnt; do
        [[ -n ${mnt} ]] || continue
        umount -l -- "${mnt}"
    done < <(findmnt -rn -o TARGET | awk -v p="${rootfs}/" 'index($0, p) == 1' | sort -r)
    rm -rf --one-file-system -- "${rootfs}"
}
trap cleanup_rootfs EXIT

debootstrap_base() {
    local mirror security_mirror bootstrap_log
    mirror="$(debian_mirror DEBIAN_MIRROR "${SUITE}")" || exit 1
    security_mirror="$(debian_mirror DEBIAN_SECURITY_MIRROR "${SUITE}-security")" || exit 1

    if ! command -v debootstrap >/dev/null 2>&1; then
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
    fi

    rootfs="$(mktemp -d /var/tmp/executor-arm-rootfs.XXXXXX)"
    bootstrap_log="${rootfs}.log"
    log "debootstrap --variant=minbase ${SUITE} from ${mirror} into ${rootfs} (log: ${bootstrap_log})"
    if ! debootstrap --variant=minbase --components=main "${SUITE}" "${rootfs}" "${mirror}" \
        >"${bootstrap_log}" 2>&1; then
        tail -n 30 -- "${bootstrap_log}" >&2
        die "debootstrap failed (full log: ${bootstrap_log})"
    fi

    # apt inside the image: the same mirrors as the host, with updates and security.
    rm -f -- "${rootfs}/etc/apt/sources.list"
    cat >"${rootfs}/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${mirror}
Suites: ${SUITE} ${SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${security_mirror}
Suites: ${SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # The images' dpkg policy (no docs/man/locales) applies to the base too; drop what debootstrap
    # already unpacked under those paths (copyright files stay).
    install -m 0644 docker/image/dpkg-nodoc.cfg "${rootfs}/etc/dpkg/dpkg.cfg.d/90-executor-arm-nodoc"
    find "${rootfs}/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
    find "${rootfs}/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf -- "${rootfs}/usr/share/man/"* "${rootfs}/usr/share/info/"* "${rootfs}/usr/share/lintian" \
        "${rootfs}/usr/share/linda"
    find "${rootfs}/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf -- {} +
    # Host leftovers and caches: docker provides resolv.conf/hostname/hosts at run time.
    rm -rf -- "${rootfs}/var/lib/apt/lists/"* "${rootfs}/var/cache/apt/"*.bin \
        "${rootfs}/var/cache/apt/archives/"*.deb "${rootfs}/etc/resolv.conf" "${rootfs}/etc/hostname" \
        "${rootfs}/var/log/bootstrap.log"

    log "importing ${rootfs} as ${BASE_IMAGE}"
    tar --numeric-owner --xattrs -C "${rootfs}" -c . \
        | docker import \
            --change 'ENV LANG=C.UTF-8' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["/bin/bash"]' \
            --change "LABEL org.executor-arm.component=base org.executor-arm.base.mirror=${mirror}" \
            --message "debootstrap --variant=minbase ${SUITE} ${mirror}" \
            - "${BASE_IMAGE}" >/dev/null
    cleanup_rootfs
    rm -f -- "${bootstrap_log}"
    rootfs=""
}

step "base image ${BASE_IMAGE}"
if image_exists "${BASE_IMAGE}"; then
    log "base image ${BASE_IMAGE} present: using it"
else
    log "base image ${BASE_IMAGE} missing: trying docker pull ${PULL_IMAGE} (at most ${PULL_TIMEOUT} s)"
    if timeout "${PULL_TIMEOUT}" docker pull -q "${PULL_IMAGE}"; then
        docker tag "${PULL_IMAGE}" "${BASE_IMAGE}"
        log "pulled ${PULL_IMAGE}, tagged as ${BASE_IMAGE}"
    else
        log "pull failed or timed out (no registry reachable): building the base with debootstrap"
        debootstrap_base
    fi
    image_exists "${BASE_IMAGE}" || die "base image ${BASE_IMAGE} still missing"
    log "base image ${BASE_IMAGE} ready ($(image_size_mb "${BASE_IMAGE}"))"
fi
base_id="$(docker image inspect -f '{{.Id}}' "${BASE_IMAGE}")"

# ---------------------------------------------------------------------------------------------
# 2. Sandbox image
# ---------------------------------------------------------------------------------------------
inputs_hash() {
    local f
    {
        printf 'target=sandbox\nbase=%s %s\n' "${BASE_IMAGE}" "${base_id}"
        while IFS= read -r -d '' f; do
            printf '%s  %s\n' "$(sha256sum <"${f}" | cut -d' ' -f1)" "${f}"
        done < <(find Dockerfile .dockerignore docker/image -type f -print0 | LC_ALL=C sort -z)
    } | sha256sum | cut -d' ' -f1
}

step "sandbox image ${SANDBOX_IMAGE}"
want_hash="$(inputs_hash)"
have_hash=""
if image_exists "${SANDBOX_IMAGE}"; then
    have_hash="$(docker image inspect -f "{{index .Config.Labels \"${HASH_LABEL}\"}}" "${SANDBOX_IMAGE}")"
fi

if [[ ${have_hash} == "${want_hash}" && ${FORCE_REBUILD} != 1 ]]; then
    log "${SANDBOX_IMAGE} is up to date (inputs ${want_hash:0:12}): not rebuilding"
else
    if [[ -z ${have_hash} ]]; then
        log "${SANDBOX_IMAGE} missing or unlabelled: building"
    elif [[ ${have_hash} != "${want_hash}" ]]; then
        log "inputs changed (${have_hash:0:12} -> ${want_hash:0:12}): rebuilding"
    else
        log "FORCE_REBUILD=1: rebuilding"
    fi
    build_args=(
        --target sandbox
        --tag "${SANDBOX_IMAGE}"
        --build-arg "BASE_IMAGE=${base_id}"
        --build-arg "BASE_IMAGE_NAME=${BASE_IMAGE}"
        --build-arg "SANDBOX_INPUTS_HASH=${want_hash}"
        --force-rm
        --file Dockerfile
    )
    if [[ -n ${BUILD_NETWORK} ]]; then
        build_args+=(--network "${BUILD_NETWORK}")
    fi
    # The classic builder: it needs no buildx plugin and resolves FROM against local images only.
    DOCKER_BUILDKIT=0 docker build "${build_args[@]}" .
    got_hash="$(docker image inspect -f "{{index .Config.Labels \"${HASH_LABEL}\"}}" "${SANDBOX_IMAGE}")"
    [[ ${got_hash} == "${want_hash}" ]] || die "built image carries hash '${got_hash}', expected ${want_hash}"
fi
# Untagged sandbox-stage images: earlier builds, and the stage a `--target daemon` build passes through.
docker image prune -f --filter "label=${COMPONENT_LABEL}=sandbox" >/dev/null
log "${SANDBOX_IMAGE}: $(image_size_mb "${SANDBOX_IMAGE}")"

# ---------------------------------------------------------------------------------------------
# 3. Smoke tests
# ---------------------------------------------------------------------------------------------
# The backend's hardening, so the image is proven under the conditions it will really run in.
hardened=(--rm --network none --read-only --cap-drop ALL --security-opt no-new-privileges)

expect_eq() { # what, got, want
    [[ $2 == "$3" ]] || die "$1: got '$2', expected '$3'"
    log "ok: $1 = '$2'"
}

step "smoke: ${BASE_IMAGE} /bin/true under runsc"
docker run --rm --runtime=runsc --network none "${BASE_IMAGE}" /bin/true
log "ok: base image runs under gVisor"

host_kernel="$(uname -r)"
for runtime in runc runsc; do
    step "smoke: ${SANDBOX_IMAGE} under ${runtime}"
    got="$(docker run "${hardened[@]}" --runtime="${runtime}" "${SANDBOX_IMAGE}" python3 -c 'print(1)')"
    expect_eq "${runtime}: python3 -c 'print(1)'" "${got}" 1
    got="$(docker run "${hardened[@]}" --runtime="${runtime}" "${SANDBOX_IMAGE}" id -u)"
    expect_eq "${runtime}: uid" "${got}" 10001
    # root with only CAP_DAC_READ_SEARCH, so find can read every directory.
    got="$(docker run "${hardened[@]}" --runtime="${runtime}" --user 0:0 --cap-add DAC_READ_SEARCH \
        --workdir / "${SANDBOX_IMAGE}" find / -xdev -perm /6000 -type f)"
    expect_eq "${runtime}: setuid/setgid files" "${got}" ""
    # As the backend runs it: the profile's uid (65534), size-limited tmpfs workdir owned by that uid
    # (under runc the tmpfs keeps the image directory's mode, so uid/gid must be given), cgroup limits.
    got="$(docker run "${hardened[@]}" --runtime="${runtime}" --init --user 65534:65534 \
        --tmpfs /work:rw,nosuid,nodev,size=100m,uid=65534,gid=65534,mode=0700 \
        --memory 512m --memory-swap 512m --pids-limit 64 --cpus 1 "${SANDBOX_IMAGE}" \
        python3 -c 'import os; open("f", "w").write("ok"); print(open("f").read(), os.getuid(), os.getcwd())')"
    expect_eq "${runtime}: profile-like run (uid 65534, tmpfs /work, limits)" "${got}" "ok 65534 /work"
    # Both ways of getting an init (see the Dockerfile): PID 1 is the init, and stderr stays clean.
    got="$(docker run "${hardened[@]}" --runtime="${runtime}" --init "${SANDBOX_IMAGE}" \
        cat /proc/1/comm 2>&1)"
    expect_eq "${runtime}: --init: PID 1 (and stderr)" "${got}" docker-init
    got="$(docker run "${hardened[@]}" --runtime="${runtime}" --entrypoint /usr/bin/tini "${SANDBOX_IMAGE}" \
        -- cat /proc/1/comm 2>&1)"
    expect_eq "${runtime}: tini entrypoint: PID 1 (and stderr)" "${got}" tini
    kernel="$(docker run "${hardened[@]}" --runtime="${runtime}" "${SANDBOX_IMAGE}" uname -r)"
    if [[ ${runtime} == runc ]]; then
        expect_eq "runc: kernel release (host's)" "${kernel}" "${host_kernel}"
    else
        [[ ${kernel} != "${host_kernel}" ]] \
            || die "runsc: container reports the host kernel ${kernel}: not running under gVisor"
        # Only asks gVisor's kernel who it is. runsc applies the container's seccomp profile
        # (--oci-seccomp), and Docker's default profile refuses syslog(2), which dmesg needs.
        kmsg="$(docker run "${hardened[@]}" --security-opt seccomp=unconfined --runtime=runsc \
            "${SANDBOX_IMAGE}" dmesg)"
        grep -q gVisor <<<"${kmsg}" || die "runsc: dmesg does not mention gVisor: ${kmsg}"
        log "ok: runsc: gVisor kernel ${kernel} (host ${host_kernel}); dmesg: $(head -n 1 <<<"${kmsg}")"
    fi
done

step "done"
log "images: ${BASE_IMAGE} ($(image_size_mb "${BASE_IMAGE}")), ${SANDBOX_IMAGE} ($(image_size_mb "${SANDBOX_IMAGE}"))"
