#!/usr/bin/env bash
# Build the proton-cpp interop client into interop/cpp/build/ (git-ignored).
# Needs g++, pkg-config and Debian's libqpid-proton-cpp12-dev (interop/setup.sh installs them).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="$here/build"
mkdir -p "$build/pkgconfig"

# Debian bookworm's libqpid-proton-cpp.pc says `Requires: libqpid-proton-core,
# libqpid-proton-proactor`, but no package ships those two .pc files (the libraries are
# there, and libqpid-proton.so holds both). Shim them so `pkg-config libqpid-proton-cpp` works.
for part in core proactor; do
    if ! PKG_CONFIG_PATH= pkg-config --exists "libqpid-proton-$part" 2>/dev/null; then
        cat > "$build/pkgconfig/libqpid-proton-$part.pc" <<PC
Name: Proton ($part, shim)
Description: stands in for the missing libqpid-proton-$part.pc: libqpid-proton holds it
Version: $(pkg-config --modversion libqpid-proton 2>/dev/null || echo 0)
Requires: libqpid-proton
PC
    fi
done
export PKG_CONFIG_PATH="$build/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"

if ! pkg-config --exists libqpid-proton-cpp; then
    pkg-config --print-errors --exists libqpid-proton-cpp || true
    echo "build.sh: pkg-config cannot find libqpid-proton-cpp; install libqpid-proton-cpp12-dev (interop/setup.sh)" >&2
    exit 1
fi
# shellcheck disable=SC2046
g++ -std=c++17 -O2 -Wall -Wextra -Wno-unused-parameter -o "$build/interop-client.tmp" \
    "$here/client.cpp" $(pkg-config --cflags --libs libqpid-proton-cpp)
mv "$build/interop-client.tmp" "$build/interop-client"
echo "built $build/interop-client (proton-cpp $(pkg-config --modversion libqpid-proton-cpp))"
