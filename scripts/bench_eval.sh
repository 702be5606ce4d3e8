#!/usr/bin/env bash
# Evaluation split across ranks: one evaluator of --batches batches of device_eval_batch_size instances over
# cpu_bench (or --config), on 1 rank and on 2 ranks under DDP and FSDP FULL_SHARD by_block, each rank with
# one thread (one core standing for one device). Each run does one training step with a learning rate of
# 1e-12, so every run evaluates the same weights; prints a markdown table of val_loss, its difference from
# one rank's, and the evaluation time (eval_time_ms of the metrics record) against one rank's.
#
# Usage: scripts/bench_eval.sh [--batches N] [--config FILE] [--reps R]
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
batches=4 config=configs/cpu_bench.json reps=3
while (($#)); do
    case $1 in
        --batches) batches=$2; shift 2 ;;
        --config) config=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
micro=$(python3 -c "import json; print(json.load(open('$config'))['device_train_microbatch_size'])")
evaluators="evaluators=[{\"label\": \"val\", \"data\": {\"paths\": [\"data/bench_tokens.bin\"]}, \"subset_num_batches\": $batches}]"
# The runs alternate, rep after rep, so a slower minute of this shared machine touches all of them.
for ((rep = 0; rep < reps; rep++)); do
    for s in one ddp fsdp; do
        args=(--config "$config" --data data/bench_tokens.bin --max-duration 1 --threads 1
              --set console_log_interval=1000000 --set eval_interval=1 --set optimizer.learning_rate=1e-12
              --set "$evaluators" --set global_train_batch_size=$((2 * micro)) --metrics-file "$tmp/$s.$rep.jsonl")
        case $s in
            one) "$trainer" "${args[@]}" >"$tmp/$s.log" 2>&1 ;;
            ddp) "$trainer" launch --nproc-per-node 2 -- "${args[@]}" --strategy ddp >"$tmp/$s.log" 2>&1 ;;
            fsdp) "$trainer" launch --nproc-per-node 2 -- "${args[@]}" --strategy fsdp --sharding-strategy FULL_SHARD \
                --wrapping-strategy by_block --set fsdp.precision=fp32 >"$tmp/$s.log" 2>&1 ;;
        esac || { cat "$tmp/$s.log" >&2; exit 1; }
    done
done
python3 - "$tmp" "$reps" <<'PY'
import json, statistics, sys
tmp, reps = sys.argv[1], int(sys.argv[2])
def rows(name):
    out = []
    for rep in range(reps):
        for line in open(f"{tmp}/{name}.{rep}.jsonl"):
            j = json.loads(line)
            if "val_loss" in j:
                out.append(j)
    return out
one = rows("one")
ref_loss = one[0]["val_loss"]
ref_ms = statistics.median(r["eval_time_ms"] for r in one)
print("| run | val_loss | relative difference from 1 rank | eval time (median of %d) | time / 1 rank's |" % reps)
print("|---|---|---|---|---|")
for name, label in (("one", "1 rank"), ("ddp", "2 ranks, DDP"), ("fsdp", "2 ranks, FSDP FULL_SHARD by_block")):
    r = rows(name)
    ms = statistics.median(x["eval_time_ms"] for x in r)
    loss = r[0]["val_loss"]
    print(f"| {label} | {loss:.9f} | {abs(loss - ref_loss) / abs(ref_loss):.1e} | {ms:.0f} ms | {ms / ref_ms:.2f} |")
PY
