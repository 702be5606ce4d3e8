#!/usr/bin/env bash
# The main job: install and build, fetch real text, and train a small OLMo-style byte-level model on CPU
# for 150 steps on 2 ranks with FSDP (FULL_SHARD, one unit per block, bf16 parameters on the wire), about
# a minute on 2 cores, printing falling loss, validation loss and throughput; then the trained model continues a
# State of the Union prompt (`trainer generate`, sampled, with a KV cache).
# Extra arguments go to the trainer (e.g. --set max_duration=300; --device cuda for GPUs, since the
# config pins the CPU so the README's main job is the same run everywhere).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bash scripts/fetch_sotu.sh
build/bin/trainer launch --nproc-per-node 2 -- --config configs/sotu_demo.json --strategy fsdp \
    --sharding-strategy FULL_SHARD --wrapping-strategy by_block "$@"
echo
echo "the trained model continues a prompt (trainer generate):"
build/bin/trainer generate --config configs/sotu_demo.json --load-path latest "$@" \
    --prompt "Fellow-Citizens of the Senate and House of Representatives: " --max-new-tokens 64 \
    --temperature 0.7 --top-k 40
