# shellcheck shell=bash
# Debian mirrors for what executor-arm's scripts install or bootstrap: the ones this host's apt
# already uses, so no script carries a mirror host of its own.

# First http(s) mirror the host's apt uses for SUITE ($1): deb822 *.sources, then one-line *.list,
# under APT_ETC_DIR (default /etc/apt).
host_apt_mirror() {
    local suite="$1" f uri
    for f in "${APT_ETC_DIR:-/etc/apt}"/sources.list.d/*.sources; do
        [[ -r ${f} ]] || continue
        uri="$(awk -v suite="${suite}" '
            BEGIN { RS = ""; FS = "\n" }
            {
                types = ""; uris = ""; suites = ""; enabled = "yes"
                for (i = 1; i <= NF; i++) {
                    line = $i
                    if (line ~ /^[ \t]*#/) continue
                    if (match(line, /^Types:[ \t]*/))   types   = substr(line, RLENGTH + 1)
                    if (match(line, /^URIs:[ \t]*/))    uris    = substr(line, RLENGTH + 1)
                    if (match(line, /^Suites:[ \t]*/))  suites  = substr(line, RLENGTH + 1)
                    if (match(line, /^Enabled:[ \t]*/)) enabled = substr(line, RLENGTH + 1)
                }
                if (enabled == "no") next
                if ((" " types " ") !~ / deb /) next
                if ((" " suites " ") !~ (" " suite " ")) next
                n = split(uris, u, /[ \t]+/)
                for (j = 1; j <= n; j++) if (u[j] ~ /^https?:\/\//) { print u[j]; exit }
            }' "${f}")"
        if [[ -n ${uri} ]]; then
            printf '%s\n' "${uri%/}"
            return 0
        fi
    done
    for f in "${APT_ETC_DIR:-/etc/apt}"/sources.list "${APT_ETC_DIR:-/etc/apt}"/sources.list.d/*.list; do
        [[ -r ${f} ]] || continue
        uri="$(awk -v suite="${suite}" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite && $i ~ /^https?:\/\//) { print $i; exit }
            }' "${f}")"
        if [[ -n ${uri} ]]; then
            printf '%s\n' "${uri%/}"
            return 0
        fi
    done
    return 1
}

# debian_mirror VAR SUITE: the value of the environment variable VAR when set, else the host's apt
# mirror for SUITE; fails with a message naming VAR when neither exists.
debian_mirror() {
    local var="$1" suite="$2" uri
    if [[ -n ${!var:-} ]]; then
        printf '%s\n' "${!var%/}"
        return 0
    fi
    if uri="$(host_apt_mirror "${suite}")"; then
        printf '%s\n' "${uri}"
        return 0
    fi
    printf 'no Debian mirror for %s: the host apt configuration (%s) lists none; set %s to the mirror URI\n' \
        "${suite}" "${APT_ETC_DIR:-/etc/apt}" "${var}" >&2
    return 1
}
