#!/usr/bin/env bash
# Installs what is missing, then configures and builds a release `trainer` at build/bin/trainer.
# Usage: scripts/build.sh [extra cmake args...]     (BUILD_DIR=... to build elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "$@" >"$build_dir.configure.log" 2>&1 || {
    cat "$build_dir.configure.log"
    exit 1
}
cmake --build "$build_dir" -j "$(nproc)" --target trainer
