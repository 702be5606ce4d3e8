#!/usr/bin/env bash
# Installs the Debian packages the trainer needs to build and test, only those missing; quiet when all
# are there. Usage: scripts/install_deps.sh [--with-torch] [--with-npm]
#   --with-torch: PyTorch, for the reference fixtures and the PyTorch benchmark peer (the C++ build and
#                 tests never need it); --with-npm: npm, to fetch the demo's text (skipped when npm exists,
#                 e.g. from a Node.js distribution that bundles it)
set -euo pipefail

packages=(cmake ninja-build g++ make pkg-config libopenblas-openmp-dev libopenblas0-openmp libcli11-dev nlohmann-json3-dev
          libfmt-dev catch2 libgloo-dev clang-format openmpi-bin libpcre2-dev libyaml-cpp-dev
          python3-matplotlib pyflakes3 shellcheck clang libclang-rt-dev libomp-dev)
for arg in "$@"; do
    case $arg in
        --with-torch) packages+=(python3-torch) ;;
        --with-npm) command -v npm >/dev/null || packages+=(npm) ;;
        *) echo "error: install_deps.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if ((${#missing[@]} == 0)); then
    exit 0
fi

echo "installing: ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
