# executor-arm images.
#
#   sandbox           the image every docker/gvisor execution runs in (scripts/build-sandbox-image.sh)
#   daemon            the executor-arm daemon, built from this checkout in a builder stage (the last
#                     stage: `docker build .` from a clean checkout builds it)
#   daemon-prebuilt   the same image around target/release/executor-arm built on the host (what the
#                     tests use, to not build the release twice)
#
# Written for the classic builder as well as BuildKit: no `# syntax=` line (no frontend image can be
# pulled without a registry), no heredocs, no COPY --chmod, no RUN --mount.
#
# No base image is pulled: BASE_IMAGE is a local Debian bookworm image, normally the one
# scripts/build-sandbox-image.sh imports from debootstrap (debian:bookworm-slim works the same way).
# The base is pinned by content, not by a tag that can move: the repository's scripts pass the
# base's image ID (`--build-arg BASE_IMAGE=sha256:<id>`, which the builder resolves locally) and its
# tag as BASE_IMAGE_NAME; a base from a registry is pinned by its manifest digest
# (`BASE_IMAGE=debian:bookworm-slim@sha256:<digest>`). The tag below is the default for a plain
# `docker build .` on a machine where that image was built.
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
# sandbox: the allowlisted commands, pip (package installs in sessions with an egress profile),
# tini, an unprivileged user, no setuid/setgid files
# ----------------------------------------------------------------------------------------------
FROM os-base AS sandbox
ARG DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    apt-get update; \
    apt-get upgrade; \
    apt-get install coreutils grep curl wget python3 python3-pip nmap tini ca-certificates; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/log/apt \
        /var/log/dpkg.log /var/log/alternatives.log; \
    sh /usr/local/sbin/executor-arm-add-user sandbox 10001 /work; \
    rm -f /usr/local/sbin/executor-arm-add-user; \
    install -d -o 10001 -g 10001 -m 0755 /work; \
    find / -xdev -perm /6000 -type f -exec chmod a-s {} +; \
    test -z "$(find / -xdev -perm /6000 -type f)"
# No ENTRYPOINT, and no init in executor-arm's containers (HostConfig.Init = false): the daemon
# bind-mounts its own in-container supervisor (a static executable, so this image needs nothing
# of ours: no interpreter, any libc) and starts it as PID 1, which reaps orphans, forwards signals
# and reports the command's exit status (killed by signal N gives 128+N). tini is here for running
# the image by hand (`docker run --entrypoint /usr/bin/tini executor-arm-sandbox -- …`), which
# scripts/build-sandbox-image.sh smoke-tests under runc and runsc.
CMD ["/bin/sh"]
ENV HOME=/work
WORKDIR /work
USER 10001:10001
# Set by scripts/build-sandbox-image.sh: a hash of everything this stage is built from, so an
# unchanged image is not rebuilt. Declared last so a new value only changes the label layer.
ARG SANDBOX_INPUTS_HASH=unset
ARG BASE_IMAGE
ARG BASE_IMAGE_NAME=
LABEL org.opencontainers.image.title="executor-arm-sandbox" \
      org.opencontainers.image.description="Execution image for executor-arm's docker and gvisor backends" \
      org.opencontainers.image.base.name="${BASE_IMAGE_NAME:-${BASE_IMAGE}}" \
      org.executor-arm.base.ref="${BASE_IMAGE}" \
      org.executor-arm.component="sandbox" \
      org.executor-arm.sandbox.inputs-hash="${SANDBOX_INPUTS_HASH}"

# ----------------------------------------------------------------------------------------------
# daemon-runtime: everything of the daemon image but its binary
# ----------------------------------------------------------------------------------------------
FROM os-base AS daemon-runtime
ARG DEBIAN_FRONTEND=noninteractive
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
COPY config/executor-arm.toml /etc/executor-arm/executor-arm.toml
COPY sandbox-profiles/ /etc/executor-arm/sandbox-profiles/
COPY config/executors/ /etc/executor-arm/executors/
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
ARG BASE_IMAGE
ARG BASE_IMAGE_NAME=
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="executor-arm" \
      org.opencontainers.image.description="Hardened sandboxed command-execution daemon" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE_NAME:-${BASE_IMAGE}}" \
      org.executor-arm.base.ref="${BASE_IMAGE}" \
      org.executor-arm.component="daemon"

# ----------------------------------------------------------------------------------------------
# daemon-prebuilt: around a binary built on the host (`cargo build --release --locked`; it links
# only glibc/libgcc_s, and the host is Debian bookworm like BASE_IMAGE). Placed before the builder
# so that the classic builder, which builds every stage up to its target, does not build Rust.
# ----------------------------------------------------------------------------------------------
FROM daemon-runtime AS daemon-prebuilt
# The classic builder builds this stage on the way to `daemon` too, where there is no host binary:
# the glob may match nothing (COPY needs one source that exists, hence the small config file,
# removed again). The binary keeps its mode from the build context, 0755 from cargo; the classic
# builder has no COPY --chmod, and a chmod layer would store the binary twice. Beside it the
# static supervisor (`scripts/build-supervisor.sh --release target/release/executor-arm-supervisor`),
# where the daemon looks for it by default.
COPY docker/image/apt-minimal.conf target/release/executor-ar[m] target/release/executor-arm-superviso[r] /usr/local/bin/
RUN rm /usr/local/bin/apt-minimal.conf

# ----------------------------------------------------------------------------------------------
# builder: the release binary from this checkout, with a pinned Rust. rustup-init comes from the
# Rust project's release archive and is checked against its published SHA-256 before it runs.
# Behind a TLS-intercepting proxy, put its CA in docker/ca-certificates/ (see the README there).
# ----------------------------------------------------------------------------------------------
FROM os-base AS builder
ARG DEBIAN_FRONTEND=noninteractive
ARG RUSTUP_VERSION=1.28.2
ARG RUSTUP_INIT_SHA256_AMD64=20a06e644b0d9bd2fbdbfd52d42540bdde820ea7df86e92e533c073da0cdd43c
ARG RUSTUP_INIT_SHA256_ARM64=e3853c5a252fca15252d07cb23a1bdd9377a8c6f3efa01531109281ae47f841c
ARG RUST_TOOLCHAIN=1.95.0
COPY docker/ca-certificates/ /usr/local/share/ca-certificates/
RUN set -eux; \
    apt-get update; \
    apt-get install ca-certificates curl gcc libc6-dev; \
    /usr/sbin/update-ca-certificates; \
    case "$(dpkg --print-architecture)" in \
        amd64) triple=x86_64-unknown-linux-gnu; sum="${RUSTUP_INIT_SHA256_AMD64}" ;; \
        arm64) triple=aarch64-unknown-linux-gnu; sum="${RUSTUP_INIT_SHA256_ARM64}" ;; \
        *) echo "no Rust toolchain pinned for $(dpkg --print-architecture)" >&2; exit 1 ;; \
    esac; \
    curl --proto '=https' --tlsv1.2 -sSfLo /tmp/rustup-init \
        "https://static.rust-lang.org/rustup/archive/${RUSTUP_VERSION}/${triple}/rustup-init"; \
    echo "${sum}  /tmp/rustup-init" | sha256sum -c -; \
    chmod 0755 /tmp/rustup-init; \
    /tmp/rustup-init -y --no-modify-path --profile minimal --default-toolchain "${RUST_TOOLCHAIN}"; \
    rm -f /tmp/rustup-init; \
    rm -rf /var/lib/apt/lists/*
ENV PATH=/root/.cargo/bin:/usr/local/bin:/usr/bin:/bin
WORKDIR /build
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto/ proto/
COPY supervisor/ supervisor/
COPY src/ src/
COPY config/executor-arm.toml config/executor-arm.toml
COPY sandbox-profiles/ sandbox-profiles/
# The commit for executor_arm_build_info (the context has no .git): --build-arg REVISION=<sha>.
ARG REVISION=unknown
# The shipped binary is stripped of its DWARF, which goes to executor-arm.debug beside it (named in
# the binary's .gnu_debuglink, so gdb and perf find it): copy it out of this stage with
# `docker build --target builder -t executor-arm-builder . && docker create executor-arm-builder`
# then `docker cp <container>:/build/target/release-debug/executor-arm.debug .`.
# The in-container supervisor: static (glibc's libc.a from libc6-dev), in a target dir of its own
# (other flags), for the host's own target only; stripped (it is small and never debugged in
# place).
RUN set -eux; \
    EXECUTOR_ARM_GIT_SHA="${REVISION}" cargo build --profile release-debug --locked --bin executor-arm; \
    triple="$(rustc -vV | sed -n 's/^host: //p')"; \
    RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked \
        -p executor-arm-supervisor --bin executor-arm-supervisor --target "$triple" \
        --target-dir target/supervisor-static; \
    if readelf -lW "target/supervisor-static/$triple/release/executor-arm-supervisor" | grep -q INTERP; then \
        echo "executor-arm-supervisor is not static" >&2; exit 1; \
    fi; \
    cp "target/supervisor-static/$triple/release/executor-arm-supervisor" target/release-debug/; \
    cd target/release-debug; \
    objcopy --only-keep-debug --compress-debug-sections=zlib executor-arm executor-arm.debug; \
    objcopy --strip-debug --add-gnu-debuglink=executor-arm.debug executor-arm

# ----------------------------------------------------------------------------------------------
# daemon: the executor-arm daemon (the default target)
# ----------------------------------------------------------------------------------------------
FROM daemon-runtime AS daemon
COPY --from=builder /build/target/release-debug/executor-arm /build/target/release-debug/executor-arm-supervisor /usr/local/bin/
