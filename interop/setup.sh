#!/usr/bin/env bash
# Install and build what the interop clients need (idempotent):
#   rhea    node + `npm ci` in interop/js (rhea pinned in package.json / package-lock.json)
#   python  the project's .venv with python-qpid-proton (scripts/setup.sh)
#   cpp     g++, pkg-config, Debian's libqpid-proton-cpp12-dev, then interop/cpp/build.sh
# Then:  python3 interop/run.py
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
log() { echo "[interop setup] $*" >&2; }

apt_install() {
    local need=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
    [ ${#need[@]} -eq 0 ] && return 0
    if ! command -v apt-get >/dev/null; then
        log "missing packages ${need[*]} and no apt-get: install them by hand"; exit 1
    fi
    log "apt-get install ${need[*]}"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${need[@]}"
}

# python: the broker's own venv carries python-qpid-proton
if [ ! -x "$root/.venv/bin/python" ] || ! "$root/.venv/bin/python" -c "import proton" 2>/dev/null; then
    log "setting up .venv (scripts/setup.sh)"
    bash "$root/scripts/setup.sh"
fi

# rhea
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt_install nodejs npm
fi
pinned=$(cd "$here/js" && node -p "require('./package.json').dependencies.rhea")
installed=$(cd "$here/js" && node -p "try { require('./node_modules/rhea/package.json').version } catch (e) { '' }")
if [ "$pinned" != "$installed" ]; then
    log "npm ci (interop/js)"
    (cd "$here/js" && npm ci --no-audit --no-fund --loglevel=error)
fi

# C++
apt_install g++ pkg-config libqpid-proton-cpp12-dev
if [ ! -x "$here/cpp/build/interop-client" ] || [ "$here/cpp/client.cpp" -nt "$here/cpp/build/interop-client" ] \
   || [ "$here/cpp/json.hpp" -nt "$here/cpp/build/interop-client" ]; then
    bash "$here/cpp/build.sh"
fi
log "ready: python3 interop/run.py"
