#!/usr/bin/env bash
# Installs what is missing, then configures and builds a release `trainer` at build/bin/trainer.
# Usage: scripts/build.sh [extra cmake args...]     (BUILD_DIR=... to build elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
build_dir=${BUILD_DIR:-build}
# Ninja, as the presets (build/ is also the release preset's folder); one configured by Make is configured afresh.
if [[ -f $build_dir/CMakeCache.txt ]] && ! grep -qx 'CMAKE_GENERATOR:INTERNAL=Ninja' "$build_dir/CMakeCache.txt"; then
    rm -rf "$build_dir/CMakeCache.txt" "$build_dir/CMakeFiles"
fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >"$build_dir.configure.log" 2>&1 || {
    cat "$build_dir.configure.log"
    exit 1
}
cmake --build "$build_dir" -j "$(nproc)" --target trainer
