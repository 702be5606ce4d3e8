#!/usr/bin/env bash
# Activation checkpointing on the CPU: cpu_bench (or --config) with each policy under single, DDP (2 ranks)
# and FSDP FULL_SHARD by_block (2 ranks), the policies of one strategy run back to back. Prints one markdown
# table: whether the losses equal null's bit for bit, tokens/s, the step time against null's, and the peak
# activation memory (the planned arena) and accounted total of rank 0.
#
# Usage: scripts/bench_checkpointing.sh [--steps N] [--config FILE] [--policies LIST] [--strategies LIST]
#   LIST: comma-separated; policies default null,whole_layer,fine_grained,one_in_two;
#   strategies default single,ddp,fsdp
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
steps=6 config=configs/cpu_bench.json policies=null,whole_layer,fine_grained,one_in_two strategies=single,ddp,fsdp
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        --config) config=$2; shift 2 ;;
        --policies) policies=$2; shift 2 ;;
        --strategies) strategies=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
IFS=',' read -r -a pols <<<"$policies"
IFS=',' read -r -a strats <<<"$strategies"
micro=$(python3 -c "import json; print(json.load(open('$config'))['device_train_microbatch_size'])")
for s in "${strats[@]}"; do
    for p in "${pols[@]}"; do
        args=(--config "$config" --data data/bench_tokens.bin --max-duration "$steps" --set console_log_interval=1000000
              --set activation_checkpointing="$p" --metrics-file "$tmp/${s}_$p.jsonl")
        case $s in
            single) "$trainer" "${args[@]}" >"$tmp/${s}_$p.log" 2>&1 ;;
            ddp) "$trainer" launch --nproc-per-node 2 -- "${args[@]}" --strategy ddp \
                --set global_train_batch_size=$((2 * micro)) >"$tmp/${s}_$p.log" 2>&1 ;;
            fsdp) "$trainer" launch --nproc-per-node 2 -- "${args[@]}" --strategy fsdp --sharding-strategy FULL_SHARD \
                --wrapping-strategy by_block --set global_train_batch_size=$((2 * micro)) >"$tmp/${s}_$p.log" 2>&1 ;;
            *) echo "error: unknown strategy $s (expected single, ddp, fsdp)" >&2; exit 2 ;;
        esac || { cat "$tmp/${s}_$p.log" >&2; exit 1; }
    done
done
python3 - "$tmp" "$policies" "$strategies" "$config" "$steps" <<'PY'
import json, sys
tmp, pols, strats, config, steps = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4], sys.argv[5]
mib = 2**20
print(f"{config}, {steps} steps per run (the first untimed); single: 1 rank, ddp and fsdp (FULL_SHARD by_block): "
      f"2 ranks; memory of rank 0\n")
print("| strategy | policy | losses = null's | tokens/s/device | step time / null's | activations MiB | accounted MiB |")
print("|---|---|---|---|---|---|---|")
for s in strats:
    runs = {}
    for p in pols:
        rows = [json.loads(l) for l in open(f"{tmp}/{s}_{p}.jsonl") if l.strip()]
        runs[p] = ([r["loss"] for r in rows if "loss" in r], rows[-1])
    ref_losses, ref_sum = runs[pols[0]]
    for p in pols:
        losses, summ = runs[p]
        mem = summ["peak_memory_bytes"]
        print(f"| {s} | {p} | {'yes' if losses == ref_losses else 'NO'} | {summ['tokens_per_second_per_device']:.0f} | "
              f"{summ['mean_step_time_ms'] / ref_sum['mean_step_time_ms']:.2f} | {mem['activations'] / mib:.1f} | "
              f"{mem['total'] / mib:.1f} |")
PY
