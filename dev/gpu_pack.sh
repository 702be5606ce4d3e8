#!/usr/bin/env bash
# Packs the GPU bundle (.gpu-bundle/, from ../shared/tools/gpu_bundle.sh) into one gzipped file for the device
# tool, whose call carries at most 64 MiB of working tree and carried paths together: the bundle alone is about
# 63 MB (OpenBLAS 37 MB, trainer and gpu_tests 21 MB), so with the tree it came within 1 MB of the limit after
# stripping and over it before (2026-11-26); gzipped it is about 21 MB. Strips the binaries and libraries first
# (their symbol tables: nothing a run reads; ncu names kernels from the CUDA fatbin, not from these).
#
#   bash ../shared/tools/gpu_bundle.sh && bash dev/gpu_pack.sh          (here)
#   device tool: carry [".gpu-bundle.tgz"], command:
#       tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh first throughput
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .gpu-bundle/run.sh ]] || {
    echo "error: .gpu-bundle/ is not built (bash ../shared/tools/gpu_bundle.sh)" >&2
    exit 1
}
strip .gpu-bundle/bin/* .gpu-bundle/lib/*
tar czf .gpu-bundle.tgz .gpu-bundle
tree=$(git ls-files -z | xargs -0 cat | wc -c)
packed=$(stat -c %s .gpu-bundle.tgz)
echo "packed: .gpu-bundle.tgz $((packed >> 20)) MiB; with the tracked tree $(((packed + tree) >> 20)) of the 64 MiB a call carries"
echo "carry [\".gpu-bundle.tgz\"]   command: tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh STAGE..."
