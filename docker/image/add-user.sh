#!/bin/sh
# add-user.sh NAME ID HOME — create group NAME (gid ID) and user NAME (uid ID, that group, HOME,
# no login shell, locked). Written without shadow's useradd/groupadd: a debootstrap minbase root
# does not ship the `passwd` package, and installing it only for this would add setuid tools.
set -eu
name="$1" id="$2" home="$3"
case "${id}" in *[!0-9]* | '') echo "add-user: bad id '${id}'" >&2; exit 2 ;; esac
if getent group "${name}" >/dev/null || getent group "${id}" >/dev/null; then
    echo "add-user: group ${name} or gid ${id} already exists" >&2; exit 1
fi
if getent passwd "${name}" >/dev/null || getent passwd "${id}" >/dev/null; then
    echo "add-user: user ${name} or uid ${id} already exists" >&2; exit 1
fi
printf '%s:x:%s:\n' "${name}" "${id}" >>/etc/group
printf '%s:x:%s:%s:executor-arm %s:%s:/usr/sbin/nologin\n' "${name}" "${id}" "${id}" "${name}" "${home}" >>/etc/passwd
if [ -f /etc/gshadow ]; then printf '%s:!::\n' "${name}" >>/etc/gshadow; fi
if [ -f /etc/shadow ]; then printf '%s:!:%s:0:99999:7:::\n' "${name}" "$(( $(date +%s) / 86400 ))" >>/etc/shadow; fi
test "$(id -u "${name}"):$(id -g "${name}")" = "${id}:${id}"
