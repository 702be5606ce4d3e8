#!/usr/bin/env bash
# Builds what a lent GPU machine runs, here, in one file: .gpu-bundle.tgz, for the device tool to carry.
#
#   bash dev/gpu_bundle.sh                       (from anywhere in the checkout; 3 min on 2 cores from clean, 2026-11-28)
#   device tool: carry [".gpu-bundle.tgz"], command:
#       tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh queue --budget-s 480
#
# The GPU machine has the CUDA toolkit's libraries, cuDNN, NCCL, PyTorch and transformers, but none of the Debian
# packages the trainer links (OpenBLAS, Gloo, fmt, yaml-cpp, ...), no package registry and no .git. So:
# - build-portable/ is a Release build with the CUDA parts (TRAINER_CUDA=ON) and no -march=native (the GPU
#   machine's CPU is another), for sm_80 and sm_90 (sm_90a for the wgmma kernels): `trainer` and `gpu_tests`;
# - .gpu-bundle/lib/ holds every shared library they load except the C runtime and the CUDA libraries, which
#   the machine has in the versions its driver wants;
# - .gpu-bundle/run.sh finds the machine's cuDNN, NCCL, cuBLASLt and cudart, puts them and lib/ on
#   LD_LIBRARY_PATH, links the source path baked into gpu_tests (its fixtures' path) to the copy it runs in, and
#   runs its arguments from the copy's root;
# - .gpu-bundle/manifest.json is dev/gpu_ledger.py's: the commit the tree was packed from and, for each stage of
#   dev/gpu_stages.tsv, its covered files' hash and whether it is stale (no `pass` in docs/gpu_runs.tsv on these
#   files). The staleness is decided here, where git is, and travels with the bundle.
# The binaries and libraries are stripped (nothing a run reads; ncu names kernels from the CUDA fatbin) and the
# bundle gzipped: a device call carries 64 MiB of tree and carried paths together, and the bundle alone is about
# 63 MB before (OpenBLAS 37 MB), about 21 MB after.
#
# --manifest-only: remake the manifest inside an existing bundle and repack (after committing the ledger's rows of
# a first call, so that the second call's queue starts where the first stopped).
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
root=$PWD
bundle=.gpu-bundle build=build-portable
manifest_only=0
case ${1:-} in
    "") ;;
    --manifest-only) manifest_only=1 ;;
    *) echo "error: dev/gpu_bundle.sh: unknown argument $1 (expected --manifest-only or nothing)" >&2; exit 2 ;;
esac

if ((!manifest_only)); then
    bash scripts/install_deps.sh
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINER_NATIVE=OFF -DTRAINER_CUDA=ON \
        >"$build.configure.log" || { cat "$build.configure.log" >&2; exit 1; }
    cmake --build "$build" -j "$(nproc)" --target trainer gpu_tests

    rm -rf "$bundle" && mkdir -p "$bundle/bin" "$bundle/lib"
    cp "$build/bin/trainer" "$build/bin/gpu_tests" "$bundle/bin/"
    # The libraries the binaries load, less the C runtime (the machine's own must serve its kernel) and CUDA's.
    for bin in "$bundle"/bin/*; do ldd "$bin"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
        grep -v -E '/(ld-linux[^/]*|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so' |
        grep -v -E '/lib(cuda|cudart|cublas|cublasLt|cudnn[a-z_]*|nccl|nvrtc|nvidia-ml)\.so' |
        while read -r lib; do cp -L "$lib" "$bundle/lib/"; done
    strip "$bundle"/bin/* "$bundle"/lib/*

    cat >"$bundle/run.sh" <<RUN
#!/usr/bin/env bash
# Runs a command of this tree on the GPU machine with the bundle's libraries (made by dev/gpu_bundle.sh).
set -euo pipefail
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
top=\$(dirname "\$here")
# gpu_tests reads its fixtures under the source path it was built at.
baked=$root
if [[ \$top != "\$baked" && ! -e \$baked ]]; then mkdir -p "\$(dirname "\$baked")" && ln -s "\$top" "\$baked"; fi
mkdir -p "\$top/$build/bin" && cp -n "\$here"/bin/* "\$top/$build/bin/" 2>/dev/null || true
path=\$here/lib
for lib in libcudnn.so.9 libnccl.so.2 libcublasLt.so.13 libcudart.so.13; do
    found=\$(find / -xdev \\( -path /proc -o -path /sys -o -path "\$top" \\) -prune -o -name "\$lib" -print 2>/dev/null | head -1)
    if [[ -n \$found ]]; then path=\$path:\$(dirname "\$found"); else echo "run.sh: \$lib not found on this machine" >&2; fi
done
export LD_LIBRARY_PATH=\$path\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
cd "\$top"
exec "\$@"
RUN
    chmod +x "$bundle/run.sh"
fi

[[ -x $bundle/run.sh ]] || { echo "error: $bundle/ is not built (bash dev/gpu_bundle.sh)" >&2; exit 1; }
python3 dev/gpu_ledger.py manifest -o "$bundle/manifest.json"
tar czf .gpu-bundle.tgz "$bundle"
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null) | wc -c)
packed=$(stat -c %s .gpu-bundle.tgz)
echo "packed .gpu-bundle.tgz: $((packed >> 20)) MiB; with the tree $(((packed + tree) >> 20)) MiB of the 64 a call carries"
((packed + tree < 64 << 20)) || { echo "error: the bundle and the tree exceed the 64 MiB a device call carries" >&2; exit 1; }
echo "carry [\".gpu-bundle.tgz\"]; command: tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh queue --budget-s 480"
