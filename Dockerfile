# executor-arm images.
#
#   sandbox  the image every docker/gvisor execution runs in (scripts/build-sandbox-image.sh builds it)
#   daemon   the executor-arm daemon itself, around a binary built on the host
#
# Written for the classic builder as well as BuildKit: no `# syntax=` line (no frontend image can be
# pulled without a registry), no heredocs, no COPY --chmod, no RUN --mount.
#
# No base image is pulled: BASE_IMAGE is a local Debian bookworm image, normally the one
# scripts/build-sandbox-image.sh imports from debootstrap (debian:bookworm-slim works the same way).
ARG BASE_IMAGE=executor-arm-debian-base:bookworm

# ----------------------------------------------------------------------------------------------
# os-base: apt/dpkg policy shared by both images (no recommends, no docs/man/locales)
# ----------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS os-base
COPY docker/image/dpkg-nodoc.cfg /etc/dpkg/dpkg.cfg.d/90-executor-arm-nodoc
COPY docker/image/apt-minimal.conf /etc/apt/apt.conf.d/90-executor-arm-minimal
COPY docker/image/add-user.sh /usr/local/sbin/executor-arm-add-user
ENV LANG=C.UTF-8 \
    PATH=/usr/local/bin:/usr/bin:/bin

# ----------------------------------------------------------------------------------------------
# sandbox: the allowlisted commands, tini, an unprivileged user, no setuid/setgid files
# ----------------------------------------------------------------------------------------------
FROM os-base AS sandbox
ARG DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    apt-get update; \
    apt-get upgrade; \
    apt-get install coreutils grep curl wget python3 nmap tini ca-certificates; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/log/apt \
        /var/log/dpkg.log /var/log/alternatives.log; \
    sh /usr/local/sbin/executor-arm-add-user sandbox 10001 /work; \
    rm -f /usr/local/sbin/executor-arm-add-user; \
    install -d -o 10001 -g 10001 -m 0755 /work; \
    find / -xdev -perm /6000 -type f -exec chmod a-s {} +; \
    test -z "$(find / -xdev -perm /6000 -type f)"
# No ENTRYPOINT, and no init in executor-arm's containers (HostConfig.Init = false): the daemon
# starts its own in-container supervisor as PID 1, which reaps orphans, forwards signals and
# reports the command's exit status (killed by signal N gives 128+N). tini is here for running
# the image by hand (`docker run --entrypoint /usr/bin/tini executor-arm-sandbox -- …`), which
# scripts/build-sandbox-image.sh smoke-tests under runc and runsc.
CMD ["/bin/sh"]
ENV HOME=/work
WORKDIR /work
USER 10001:10001
# Set by scripts/build-sandbox-image.sh: a hash of everything this stage is built from, so an
# unchanged image is not rebuilt. Declared last so a new value only changes the label layer.
ARG SANDBOX_INPUTS_HASH=unset
LABEL org.opencontainers.image.title="executor-arm-sandbox" \
      org.opencontainers.image.description="Execution image for executor-arm's docker and gvisor backends" \
      org.executor-arm.component="sandbox" \
      org.executor-arm.sandbox.inputs-hash="${SANDBOX_INPUTS_HASH}"

# ----------------------------------------------------------------------------------------------
# daemon: the executor-arm daemon
# ----------------------------------------------------------------------------------------------
# The Rust toolchain cannot be pulled into an image here (no registry; Debian's rustc predates
# edition 2024), so this stage packages a binary built on the host (`cargo build --release`).
# The binary links only glibc/libgcc_s, and the host is Debian bookworm like BASE_IMAGE.
FROM os-base AS daemon
ARG DEBIAN_FRONTEND=noninteractive
ARG DAEMON_BINARY=target/release/executor-arm
# The `local` backend runs allowlisted binaries from this image's own filesystem, so the default
# allowlist's commands are installed here too; ca-certificates for curl/wget and outbound TLS.
RUN set -eux; \
    apt-get update; \
    apt-get upgrade; \
    apt-get install ca-certificates coreutils grep curl wget python3 nmap; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/log/apt \
        /var/log/dpkg.log /var/log/alternatives.log; \
    sh /usr/local/sbin/executor-arm-add-user executor 10000 /var/lib/executor-arm; \
    rm -f /usr/local/sbin/executor-arm-add-user; \
    install -d -o 10000 -g 10000 -m 0750 /var/lib/executor-arm; \
    install -d -m 0755 /etc/executor-arm /etc/executor-arm/sandbox-profiles /etc/executor-arm/executors; \
    find / -xdev -perm /6000 -type f -exec chmod a-s {} +; \
    test -z "$(find / -xdev -perm /6000 -type f)"
COPY ${DAEMON_BINARY} /usr/local/bin/executor-arm
COPY config/executor-arm.toml /etc/executor-arm/executor-arm.toml
COPY sandbox-profiles/ /etc/executor-arm/sandbox-profiles/
COPY config/executors/ /etc/executor-arm/executors/
# (The binary keeps its mode from the build context, 0755 from cargo; the classic builder has no
# COPY --chmod, and a chmod layer would store the binary twice.)
RUN chmod -R go-w,a+rX /etc/executor-arm
ENV EXECUTOR_ARM_LISTEN=0.0.0.0:8003 \
    EXECUTOR_ARM_PROFILES_DIR=/etc/executor-arm/sandbox-profiles \
    EXECUTOR_ARM_EXECUTORS_DIR=/etc/executor-arm/executors \
    EXECUTOR_ARM_AUDIT_LOG=/var/lib/executor-arm/audit.jsonl
# Runs as root by default: the `local` backend needs CAP_SYS_ADMIN (namespaces, mounts), CAP_SETUID/
# CAP_SETGID (dropping each run to the profile's uid) and write access to the cgroup tree to build
# every sandbox. With the docker or gvisor backend only (the daemon talks to a dockerd socket and
# builds nothing itself) run it unprivileged: `docker run --user 10000:10000 ...`, giving that uid
# access to the mounted docker socket. User `executor` (10000) owns /var/lib/executor-arm, where the
# audit log and relative paths land.
WORKDIR /var/lib/executor-arm
EXPOSE 8003
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["curl", "-fsS", "--max-time", "2", "-o", "/dev/null", "http://127.0.0.1:8003/health"]
ENTRYPOINT ["/usr/local/bin/executor-arm"]
CMD ["serve", "--config", "/etc/executor-arm/executor-arm.toml"]
LABEL org.opencontainers.image.title="executor-arm" \
      org.opencontainers.image.description="Hardened sandboxed command-execution daemon" \
      org.executor-arm.component="daemon"
