#!/usr/bin/env bash
# The fine-tuning demo, on the CPU in a few minutes: LoRA teaches the main job's model (scripts/demo.sh: a byte-level
# OLMo-style model trained on the State of the Union addresses) a task it cannot do: writing a word in capitals,
# asked in the Tulu chat format ("<|user|>\ncapitals: htvhon\n<|assistant|>\n" -> "HTVHON"). The words are random
# strings of 4 to 7 letters, a different one every prompt, so the answer depends on the prompt and no answer is right
# for more than one. Steps:
#   1. the base: the main job's checkpoint (trained here first where runs/sotu_demo/latest does not exist), exported
#      with Hugging Face names;
#   2. 4,000 training and 400 held-out requests (scripts/make_task_data.py), the training ones made into a token file
#      and its label mask with `trainer prepare-data --instruct` (only the answers in the loss);
#   3. exact match on the 400 held-out requests, greedy (`trainer generate --json`, scored by scripts/score_task.py),
#      before and after LoRA (configs/finetune_demo.json: r 16 on every Linear of the blocks, 600 steps).
# Extra arguments go to the fine-tune. TRAINER_BIN: a trainer already built (else scripts/build.sh builds one).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TRAINER_BIN:-build/bin/trainer}
[[ -n ${TRAINER_BIN:-} ]] || bash scripts/build.sh
out=runs/finetune_demo
mkdir -p "$out"

if [[ ! -e runs/sotu_demo/latest ]]; then
    bash scripts/fetch_sotu.sh
    echo "the base: the main job's training (scripts/demo.sh)"
    "$bin" launch --nproc-per-node 2 -- --config configs/sotu_demo.json --strategy fsdp \
        --sharding-strategy FULL_SHARD --wrapping-strategy by_block
fi
"$bin" export --checkpoint runs/sotu_demo/latest -o "$out/base.safetensors"
python3 scripts/make_task_data.py "$out" --train 4000 --test 400 --seed 7
"$bin" prepare-data --instruct "$out/train.jsonl" -o "$out/train.bin" --seq-len 49 --overwrite

# The held-out prompts, each whole (its last newline kept), as generate's arguments.
mapfile -d '' -t prompts < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    print(json.loads(line)["prompt"], end="\0")' "$out/test.jsonl")
args=()
for p in "${prompts[@]}"; do args+=(--prompt "$p"); done
score() {  # $1: what is scored; the rest: generate's model arguments
    local name=$1
    shift
    "$bin" generate --config configs/finetune_demo.json "$@" --max-new-tokens 8 --json "${args[@]}" \
        >"$out/$name.jsonl"
    echo "$name: $(python3 scripts/score_task.py "$out/test.jsonl" "$out/$name.jsonl" | head -1)"
}
score before --set lora.enabled=false

"$bin" --config configs/finetune_demo.json "$@"
score after --load-path latest
python3 scripts/score_task.py "$out/test.jsonl" "$out/after.jsonl"
