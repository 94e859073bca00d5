# Sourced by the scripts that need Python tools: `pinned_venv VENV REQUIREMENT...` makes (or
# reuses) a venv at VENV with exactly these pinned requirements installed. The venv is cached: it
# is made again only when the list of requirements changes (kept in VENV/.requirements).
# Debian ships the venv module separately: as root with apt-get, python3-venv is installed when
# `python3 -m venv` fails.

pinned_venv() {
  local venv="$1"; shift
  local py="$venv/bin/python"
  local want
  want="$(printf '%s\n' "$@")"
  if [[ -x "$py" && -f "$venv/.requirements" && "$(cat "$venv/.requirements")" == "$want" ]]; then
    echo "cached: $*"
    return 0
  fi
  command -v python3 >/dev/null || { echo "pinned_venv: python3 is required" >&2; return 1; }
  rm -rf "$venv"
  if ! python3 -m venv "$venv"; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
      echo "python3 -m venv failed; installing python3-venv with apt-get"
      rm -rf "$venv"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
      python3 -m venv "$venv"
    else
      echo "pinned_venv: python3 -m venv failed: install the python3-venv package" >&2
      return 1
    fi
  fi
  "$py" -m pip install --quiet --disable-pip-version-check "$@"
  printf '%s' "$want" > "$venv/.requirements"
  echo "installed: $*"
}
