#!/usr/bin/env bash
# TensorBoard's own reader (Python's tensorboard package) on the event file of a 2-rank FULL_SHARD run: every scalar
# it finds is the metrics file's number of the same name and step, and every number of every step record is there
# (scripts/check_tensorboard.py). Exits 77 (CTest's skip) where the package is not installed: it is on the GPU
# machine, where dev/gpu_check.sh's hf stage runs this; Debian has no package of it.
# Usage: tests/tensorboard_check.sh TRAINER
set -euo pipefail
trainer=$(realpath "$1")
cd "$(dirname "$0")/.."
python3 -c 'import tensorboard' 2>/dev/null || {
    echo "skipped: Python's tensorboard package is not installed here"
    exit 77
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$trainer" launch --nproc-per-node 2 -- --config configs/tiny.json --data tests/fixtures/olmo_tiny_tokens.u16 \
    --device cpu --threads 1 --strategy fsdp --max-duration 6 --set save_folder=null --set save_interval=0 \
    --tensorboard-dir "$tmp/tb" --metrics-file "$tmp/metrics.jsonl" >"$tmp/run.log" 2>&1 || {
    cat "$tmp/run.log" >&2
    exit 1
}
python3 scripts/check_tensorboard.py --dir "$tmp/tb" --metrics "$tmp/metrics.jsonl"
