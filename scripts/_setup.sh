# Shared set-up for scripts/run and scripts/test (sourced, not executed).
#
# After `taskflow_setup`: the repository is the working directory, .venv holds every package in
# requirements.txt, $PY is its python, and $VAR_DIR exists.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
VAR_DIR="${TASKFLOW_VAR_DIR:-$REPO/var}"
PY="$VENV/bin/python"
MYSQL_BUILD_DEPS=(libmariadb-dev pkg-config)

if [ -t 1 ]; then
    say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
else
    say() { printf '==> %s\n' "$*"; }
fi
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# True when "$1" runs and is Python >= 3.12 (pyenv shims exist on PATH even when they cannot run).
python_ok() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

# Print the best Python >= 3.12: python3.13 on PATH, then pyenv's 3.13 and 3.12, then python3.12/python3.
find_python() {
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}" candidate minor
    local candidates=("$(command -v python3.13 || true)")
    for minor in 13 12; do
        while IFS= read -r candidate; do
            candidates+=("$candidate")
        done < <(ls -d "$pyenv_root"/versions/3."$minor"*/bin/python3."$minor" /root/.pyenv/versions/3."$minor"*/bin/python3."$minor" 2>/dev/null | sort -rV)
    done
    candidates+=("$(command -v python3.12 || true)" "$(command -v python3 || true)")
    for candidate in "${candidates[@]}"; do
        if python_ok "$candidate"; then
            printf '%s\n' "$candidate"
            return 0
        fi
    done
    return 1
}

# Install the given Debian packages that are missing (apt-get update runs once per shell).
ensure_apt_packages() {
    local missing=() pkg sudo=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "please install ${missing[*]} (needed to build mysqlclient)"
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    say "installing ${missing[*]} with apt-get"
    if [ -z "${_TASKFLOW_APT_UPDATED:-}" ]; then
        "${sudo[@]}" apt-get update -qq
        _TASKFLOW_APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Create .venv when missing (or broken) and install requirements.txt into it, quietly.
ensure_venv() {
    if ! python_ok "$PY"; then
        local base
        base="$(find_python)" || die "Python >= 3.12 not found: install python3.13 (or 3.12) and retry"
        say "creating .venv with $base"
        "$base" -m venv --clear "$VENV"
    fi
    # Reinstall only when requirements.txt changed since the last successful install.
    local stamp="$VENV/.requirements.sha256" wanted
    wanted="$(sha256sum "$REPO/requirements.txt" | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
        return 0
    fi
    if [[ "${DATABASE_URL:-}" == mysql* ]]; then
        ensure_apt_packages "${MYSQL_BUILD_DEPS[@]}"
    fi
    say "installing requirements.txt into .venv"
    local log="$VAR_DIR/pip-install.log"
    if ! "$PY" -m pip install -q -r "$REPO/requirements.txt" >"$log" 2>&1; then
        # The usual cause is mysqlclient, which builds against the MariaDB client library.
        ensure_apt_packages "${MYSQL_BUILD_DEPS[@]}"
        "$PY" -m pip install -q -r "$REPO/requirements.txt" >"$log" 2>&1 || {
            tail -n 30 "$log" >&2
            die "pip install failed (full log: $log)"
        }
    fi
    printf '%s\n' "$wanted" >"$stamp"
}

taskflow_setup() {
    cd "$REPO"
    mkdir -p "$VAR_DIR"
    ensure_venv
}
