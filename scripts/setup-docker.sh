#!/usr/bin/env bash
# Prepare this machine to run executor-arm's docker and gvisor backends:
#   1. install docker.io and jq when missing (apt, non-interactive), and runsc at exactly
#      RUNSC_VERSION from Debian trixie: bookworm's runsc (20221219) lacks statx, so coreutils'
#      `ls` fails under it. trixie's runsc is one static binary with no dependencies; an apt pin
#      lets runsc, and nothing else, come from trixie, at that version only;
#   2. pick gVisor's platform: `systrap` (far cheaper system calls than `ptrace`) when a probe
#      sandbox runs with it here, else `ptrace`; merge the runsc runtime (docker/daemon.json, with
#      that platform) into /etc/docker/daemon.json, keeping other keys;
#   3. start dockerd when it is not running (no systemd assumed), or reload/restart it when it runs
#      without runsc registered;
#   4. wait (bounded) until `docker info` lists both the runc and runsc runtimes, runsc with the
#      template's runtimeArgs (--host-uds=open for egress, --oci-seccomp so runsc applies the
#      sandbox's seccomp profile: executor-arm refuses gVisor runs without it).
# Idempotent: a second run changes nothing and only reports. Exits non-zero with a message on failure.
#
# Environment:
#   DOCKERD_CONFIG        daemon.json to manage          (default /etc/docker/daemon.json)
#   DOCKERD_LOG           dockerd log when started here  (default /var/log/dockerd.log)
#   DOCKERD_PIDFILE       dockerd pid file               (default /var/run/docker.pid)
#   DOCKERD_WAIT_SECONDS  how long to wait for dockerd   (default 60)
#   RUNSC_VERSION         the runsc package version      (default 0.0~20240729.0-4+b7)
#   RUNSC_PLATFORM        systrap | ptrace               (default: systrap if it works here)
#   DEBIAN_MIRROR         Debian mirror for the trixie source (default: the host apt mirror of
#                         its own release)
set -Eeuo pipefail
trap 'printf "[setup-docker] ERROR: line %s: \`%s\` failed (exit %s)\n" "${LINENO}" "${BASH_COMMAND}" "$?" >&2' ERR

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd -- "${SCRIPT_DIR}/.." && pwd)"
# shellcheck source=lib/apt-mirror.sh
. "${SCRIPT_DIR}/lib/apt-mirror.sh"
cd -- "${REPO_ROOT}"

DOCKERD_CONFIG="${DOCKERD_CONFIG:-/etc/docker/daemon.json}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
DOCKERD_PIDFILE="${DOCKERD_PIDFILE:-/var/run/docker.pid}"
DOCKERD_WAIT_SECONDS="${DOCKERD_WAIT_SECONDS:-60}"
RUNSC_VERSION="${RUNSC_VERSION:-0.0~20240729.0-4+b7}"
RUNSC_PLATFORM="${RUNSC_PLATFORM:-}"
APT_TRIXIE_SOURCE=/etc/apt/sources.list.d/executor-arm-trixie.sources
APT_RUNSC_PIN=/etc/apt/preferences.d/executor-arm-runsc
RUNTIME_TEMPLATE="${REPO_ROOT}/docker/daemon.json"

log() { printf '[setup-docker] %s\n' "$*"; }
die() {
    printf '[setup-docker] ERROR: %s\n' "$*" >&2
    exit 1
}

[[ ${EUID} -eq 0 ]] || die "must run as root (installs packages, writes ${DOCKERD_CONFIG}, starts dockerd)"
[[ -r ${RUNTIME_TEMPLATE} ]] || die "missing ${RUNTIME_TEMPLATE}"
[[ ${DOCKERD_WAIT_SECONDS} =~ ^[0-9]+$ ]] || die "DOCKERD_WAIT_SECONDS must be a whole number of seconds"

# ---------------------------------------------------------------------------------------------
# 1. Packages
# ---------------------------------------------------------------------------------------------
export DEBIAN_FRONTEND=noninteractive
missing=()
if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    missing+=(docker.io)
fi
command -v jq >/dev/null 2>&1 || missing+=(jq)
if ((${#missing[@]} > 0)); then
    log "installing: ${missing[*]}"
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    log "packages present: dockerd, docker, jq (nothing installed)"
fi

# runsc from trixie, pinned: every other trixie package is never a candidate (priority -1), runsc
# only at RUNSC_VERSION. Rewritten when different, so a changed version takes effect.
write_if_changed() { # path content
    if [[ ! -e $1 || "$(cat -- "$1")" != "$2" ]]; then
        printf '%s\n' "$2" >"$1"
        return 0
    fi
    return 1
}
# The mirror is the one the host's apt uses for its own release (or DEBIAN_MIRROR).
host_suite="$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")"
[[ -n ${host_suite} ]] || die "/etc/os-release names no VERSION_CODENAME: set DEBIAN_MIRROR"
debian_uri="$(debian_mirror DEBIAN_MIRROR "${host_suite}")" || exit 1
apt_changed=0
write_if_changed "${APT_TRIXIE_SOURCE}" "# executor-arm: runsc only (see ${APT_RUNSC_PIN})
Types: deb
URIs: ${debian_uri}
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" && apt_changed=1
write_if_changed "${APT_RUNSC_PIN}" "# executor-arm: nothing from trixie but runsc ${RUNSC_VERSION}.
Package: *
Pin: release n=trixie
Pin-Priority: -1

Package: runsc
Pin: version ${RUNSC_VERSION}
Pin-Priority: 1001" && apt_changed=1
# Installed means unpacked and configured ("ii"): a removed package keeps its version in dpkg's
# database.
installed_runsc=""
if v="$(dpkg-query -W -f='${db:Status-Abbrev}${Version}' runsc 2>/dev/null)" && [[ ${v} == "ii "* ]]; then
    installed_runsc=${v#ii }
fi
if [[ ${installed_runsc} != "${RUNSC_VERSION}" ]]; then
    log "installing runsc ${RUNSC_VERSION} from trixie (installed: ${installed_runsc:-none})"
    apt-get update -q
    apt-get install -y -q --no-install-recommends --allow-downgrades "runsc=${RUNSC_VERSION}"
elif ((apt_changed)); then
    log "apt source and pin for runsc written; runsc ${RUNSC_VERSION} already installed"
else
    log "runsc ${RUNSC_VERSION} present (nothing installed)"
fi

RUNSC_PATH="$(command -v runsc)"
runsc_version="$("${RUNSC_PATH}" --version 2>&1)"
log "runsc: ${RUNSC_PATH} (${runsc_version%%$'\n'*})"

# The platform: systrap when a probe sandbox runs with it, else ptrace.
probe_platform() { # platform
    timeout 60 "${RUNSC_PATH}" --platform="$1" --network=none "do" /bin/true >/dev/null 2>&1
}
if [[ -z ${RUNSC_PLATFORM} ]]; then
    if probe_platform systrap; then
        RUNSC_PLATFORM=systrap
    elif probe_platform ptrace; then
        RUNSC_PLATFORM=ptrace
        log "runsc: the systrap platform does not work here; using ptrace (slower system calls)"
    else
        die "runsc runs neither with --platform=systrap nor with --platform=ptrace (try: ${RUNSC_PATH} --platform=ptrace do /bin/true)"
    fi
fi
[[ ${RUNSC_PLATFORM} =~ ^(systrap|ptrace)$ ]] || die "RUNSC_PLATFORM must be systrap or ptrace, not '${RUNSC_PLATFORM}'"
log "runsc platform: ${RUNSC_PLATFORM}"
# The template's flags with the chosen platform in place of its own.
want_args="$(jq -c --arg p "--platform=${RUNSC_PLATFORM}" \
    '[$p] + [.runtimes.runsc.runtimeArgs[] | select(startswith("--platform=") | not)]' "${RUNTIME_TEMPLATE}")"

# ---------------------------------------------------------------------------------------------
# 2. daemon.json: merge the runsc runtime, keep every other key
# ---------------------------------------------------------------------------------------------
existing='{}'
if [[ -e ${DOCKERD_CONFIG} ]]; then
    if [[ -s ${DOCKERD_CONFIG} ]]; then
        jq -e 'type == "object"' "${DOCKERD_CONFIG}" >/dev/null 2>&1 \
            || die "${DOCKERD_CONFIG} is not a JSON object; fix or remove it first"
        existing="$(jq -S . "${DOCKERD_CONFIG}")"
    fi
fi

desired="$(
    jq -S --slurpfile tpl "${RUNTIME_TEMPLATE}" --arg runsc "${RUNSC_PATH}" --argjson args "${want_args}" '
        . as $cur
        | ($tpl[0].runtimes.runsc + {path: $runsc, runtimeArgs: $args}) as $rt
        | $cur + {runtimes: (($cur.runtimes // {}) + {runsc: $rt})}
    ' <<<"${existing}"
)"

config_changed=0
if [[ ${desired} == "${existing}" ]]; then
    log "${DOCKERD_CONFIG}: runsc runtime already registered (unchanged)"
else
    config_changed=1
    mkdir -p -- "$(dirname -- "${DOCKERD_CONFIG}")"
    if [[ -e ${DOCKERD_CONFIG} ]]; then
        backup="${DOCKERD_CONFIG}.bak.$(date +%Y%m%d%H%M%S)"
        cp -p -- "${DOCKERD_CONFIG}" "${backup}"
        log "${DOCKERD_CONFIG}: previous version saved as ${backup}"
    fi
    tmp="$(mktemp "${DOCKERD_CONFIG}.XXXXXX")"
    printf '%s\n' "${desired}" >"${tmp}"
    chmod 0644 "${tmp}"
    mv -f -- "${tmp}" "${DOCKERD_CONFIG}"
    log "${DOCKERD_CONFIG}: wrote runsc runtime (path ${RUNSC_PATH}, args $(jq -c '.runtimes.runsc.runtimeArgs' <<<"${desired}"))"
fi

# ---------------------------------------------------------------------------------------------
# 3. dockerd
# ---------------------------------------------------------------------------------------------
dockerd_pid() {
    local pid=""
    if [[ -r ${DOCKERD_PIDFILE} ]]; then
        pid="$(tr -dc '0-9' <"${DOCKERD_PIDFILE}")"
    fi
    if [[ -n ${pid} && -r /proc/${pid}/comm && "$(cat "/proc/${pid}/comm")" == dockerd ]]; then
        printf '%s\n' "${pid}"
        return 0
    fi
    # Started without our pid file (or by a service manager): look for the process by exact name.
    pid="$(pgrep -xo dockerd 2>/dev/null)" || return 1
    printf '%s\n' "${pid}"
}

# Prints the runtimes dockerd reports, one per line; fails when dockerd does not answer.
runtimes() {
    local out
    # shellcheck disable=SC2016 # a Go template, not shell
    out="$(timeout 10 docker info --format '{{range $name, $_ := .Runtimes}}{{println $name}}{{end}}' 2>/dev/null)" \
        || return 1
    sed '/^$/d' <<<"${out}"
}

has_runtimes() {
    local list
    list="$(runtimes)" || return 1
    grep -qx runc <<<"${list}" && grep -qx runsc <<<"${list}"
}

start_dockerd() {
    log "starting dockerd (log: ${DOCKERD_LOG})"
    mkdir -p -- "$(dirname -- "${DOCKERD_LOG}")"
    printf '\n==== %s: started by scripts/setup-docker.sh ====\n' "$(date -Is)" >>"${DOCKERD_LOG}"
    # setsid: own session, so the daemon outlives this script and its caller's process group.
    setsid nohup dockerd --config-file "${DOCKERD_CONFIG}" --pidfile "${DOCKERD_PIDFILE}" \
        </dev/null >>"${DOCKERD_LOG}" 2>&1 &
    disown
}

stop_dockerd() {
    local pid="$1" waited=0
    log "stopping dockerd (pid ${pid})"
    kill -TERM "${pid}"
    while kill -0 "${pid}" 2>/dev/null; do
        ((waited >= 30)) && die "dockerd (pid ${pid}) did not exit within 30 s of SIGTERM"
        sleep 1
        waited=$((waited + 1))
    done
}

wait_for_runtimes() {
    local deadline=$((SECONDS + $1))
    while ((SECONDS < deadline)); do
        has_runtimes && return 0
        sleep 1
    done
    has_runtimes
}

if pid="$(dockerd_pid)"; then
    if has_runtimes; then
        if ((config_changed)); then
            # runsc is there but its definition changed (e.g. runtimeArgs): reload to apply it.
            log "dockerd (pid ${pid}) running; config changed, reloading (SIGHUP)"
            kill -HUP "${pid}"
        else
            log "dockerd (pid ${pid}) already running with runc and runsc (left alone)"
        fi
    elif timeout 10 docker info >/dev/null 2>&1; then
        # Runtimes are reloadable options: try SIGHUP before a full restart.
        log "dockerd (pid ${pid}) running without runsc: reloading configuration (SIGHUP)"
        kill -HUP "${pid}"
        if ! wait_for_runtimes 10; then
            log "runsc still not registered after reload: restarting dockerd"
            stop_dockerd "${pid}"
            start_dockerd
        fi
    else
        log "dockerd (pid ${pid}) running but not answering yet; waiting for it"
    fi
else
    start_dockerd
fi

# ---------------------------------------------------------------------------------------------
# 4. Wait until both runtimes are listed
# ---------------------------------------------------------------------------------------------
log "waiting up to ${DOCKERD_WAIT_SECONDS} s for dockerd to list runc and runsc"
if ! wait_for_runtimes "${DOCKERD_WAIT_SECONDS}"; then
    if [[ -r ${DOCKERD_LOG} ]]; then
        printf '[setup-docker] last lines of %s:\n' "${DOCKERD_LOG}" >&2
        tail -n 30 -- "${DOCKERD_LOG}" >&2
    fi
    if listed="$(runtimes)"; then
        die "dockerd answers but lists runtimes [$(paste -sd ' ' - <<<"${listed}")], not both runc and runsc"
    fi
    die "dockerd did not answer within ${DOCKERD_WAIT_SECONDS} s"
fi

# A reload that did not take (or a dockerd started with other flags) leaves runsc without the
# flags the gvisor backend needs; it would then refuse every run.
has_args() {
    local got
    # shellcheck disable=SC2016 # a Go template, not shell
    got="$(timeout 10 docker info --format '{{json (index .Runtimes "runsc").Args}}' 2>/dev/null)" || return 1
    [[ "$(jq -c . <<<"${got}")" == "${want_args}" ]]
}
deadline=$((SECONDS + 10))
until has_args; do
    ((SECONDS < deadline)) || die "dockerd's runsc is not registered with ${want_args}; restart dockerd to apply ${DOCKERD_CONFIG}"
    sleep 1
done

server="$(timeout 10 docker version --format 'server {{.Server.Version}} (API {{.Server.APIVersion}}), client {{.Client.Version}}')"
log "ready: docker ${server}; runtimes: $(runtimes | paste -sd ' ' -)"
if init_path="$(command -v docker-init)"; then
    log "docker --init available: ${init_path} -> $(readlink -f -- "${init_path}")"
else
    log "docker-init not found on PATH: \`docker run --init\` will not work; use the image's tini"
fi
