#!/usr/bin/env bash
# The plan against the runs: for each row, `trainer plan` predicts the step time and rank 0's peak memory by
# category of the configuration (the plan's row for the config as given), then the trainer runs it and
# the summary gives the measured ones. Rows: those of scripts/bench_strategies.sh on 2 ranks (cpu_bench,
# global batch 16, micro-batch 4) and DDP, FULL_SHARD by_block and SHARD_GRAD_OP by_block on 4 ranks
# (micro-batch 2). Op times come from `trainer bench-kernels --calibration-out` run first, with the threads
# each rank gets. Prints one markdown table: predicted and measured step time and their error, the largest
# error over the memory categories, and whether the predicted order of the rows by tokens/s matches the
# measured one where two rows differ by more than 10%. A last row runs --strategy auto on 2 ranks (the plan's
# recommendation, its prediction) and is compared with the fastest measured 2-rank row. Each row is planned
# twice: on the cpu entry's link, and on the links `trainer bench-comm` measures on 2 and 4 ranks first.
#
# Usage: dev/validate_plan.sh [--steps N]      (TRAINER_BIN: the trainer, default build/bin/trainer)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
steps=3
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
cores=$(nproc)
config=configs/cpu_bench.json
# Op times with the threads each rank of a 2-rank and a 4-rank run gets (the launcher's share, at least 1).
for ranks in 1 2 4; do
    threads=$((cores / ranks)); ((threads >= 1)) || threads=1
    [[ -f $tmp/cal_t$threads.json ]] && continue
    "$trainer" bench-kernels --config "$config" --set device_train_microbatch_size=4 --threads "$threads" --reps 5 \
        --calibration-out "$tmp/cal_t$threads.json" >/dev/null
done
# The links of a 2-rank and a 4-rank world, measured (trainer bench-comm): each row is also planned with them
# in place of the cpu entry's.
for ranks in 2 4; do
    "$trainer" launch --nproc-per-node "$ranks" -- bench-comm --config "$config" \
        --calibration-out "$tmp/links_$ranks.json" >"$tmp/links_$ranks.log" 2>&1 \
        || { cat "$tmp/links_$ranks.log" >&2; exit 1; }
    grep -E "^\[rank 0\] +intra [a-z_]+: " "$tmp/links_$ranks.log" | sed "s/^\[rank 0\] */$ranks ranks: /"
done
# name | ranks | micro-batch | flags
rows=(
    "single, 1 thread|1|4|--set threads=1"
    "ddp, grad_sync batch|2|4|--strategy ddp"
    "ddp, grad_sync micro_batch|2|4|--strategy ddp --set ddp.grad_sync_mode=micro_batch"
    "fsdp NO_SHARD fp32|2|4|--strategy fsdp --sharding-strategy NO_SHARD --set fsdp.precision=fp32"
    "fsdp FULL_SHARD by_block fp32, batch|2|4|--strategy fsdp --wrapping-strategy by_block --set fsdp.precision=fp32"
    "fsdp FULL_SHARD by_block fp32, micro_batch|2|4|--strategy fsdp --wrapping-strategy by_block --set fsdp.precision=fp32 --set fsdp.grad_sync_mode=micro_batch"
    "fsdp FULL_SHARD wrap null mixed, batch|2|4|--strategy fsdp"
    "fsdp FULL_SHARD wrap null mixed, micro_batch|2|4|--strategy fsdp --set fsdp.grad_sync_mode=micro_batch"
    "fsdp SHARD_GRAD_OP by_block_and_size mixed, batch|2|4|--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block_and_size"
    "fsdp SHARD_GRAD_OP by_block_and_size mixed, micro_batch|2|4|--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block_and_size --set fsdp.grad_sync_mode=micro_batch"
    "4 ranks: ddp|4|2|--strategy ddp"
    "4 ranks: fsdp FULL_SHARD by_block|4|2|--strategy fsdp --wrapping-strategy by_block"
    "4 ranks: fsdp SHARD_GRAD_OP by_block|4|2|--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block"
    "2 ranks: --strategy auto|2|4|--strategy auto"
)
k=0
for row in "${rows[@]}"; do
    IFS='|' read -r name ranks micro flags <<<"$row"
    threads=$((cores / ranks)); ((threads >= 1)) || threads=1
    [[ $flags == *threads=1* ]] && threads=1
    common=(--config "$config" --set global_train_batch_size=16 --set "device_train_microbatch_size=$micro")
    common+=(--set "plan.calibration=$tmp/cal_t$threads.json")
    # shellcheck disable=SC2086
    "$trainer" plan "${common[@]}" $flags --nproc-per-node "$ranks" --json >"$tmp/$k.plan"
    links=()
    ((ranks > 1)) && links=(--comm-calibration "$tmp/links_$ranks.json")
    # shellcheck disable=SC2086
    "$trainer" plan "${common[@]}" $flags --nproc-per-node "$ranks" "${links[@]}" --json >"$tmp/$k.plan_links"
    args=("${common[@]}" --data data/bench_tokens.bin --max-duration "$steps" --set console_log_interval=1000
        --metrics-file "$tmp/$k.jsonl")
    # shellcheck disable=SC2086
    if ((ranks == 1)); then
        "$trainer" "${args[@]}" $flags >"$tmp/$k.log" 2>&1 || { cat "$tmp/$k.log" >&2; exit 1; }
    else
        "$trainer" launch --nproc-per-node "$ranks" -- "${args[@]}" $flags >"$tmp/$k.log" 2>&1 \
            || { cat "$tmp/$k.log" >&2; exit 1; }
    fi
    echo "$name|$tmp/$k.plan|$tmp/$k.jsonl|$tmp/$k.log" >>"$tmp/index"
    k=$((k + 1))
done
python3 - "$tmp/index" <<'PY'
import json, sys
cats = ["parameters", "gradients", "optimizer_state", "gathered_units", "activations", "communication"]
rows = []
for line in open(sys.argv[1]):
    name, plan_path, metrics_path, log_path = line.rstrip("\n").split("|")
    for text in open(log_path):
        if "distributed_strategy auto" in text:  # what auto chose
            name += " -> " + text.split("): ", 1)[1].split(", because")[0]
    def row_of(path):
        plans = [json.loads(l) for l in open(path) if l.strip()]
        # The config as given, or for --strategy auto the row the plan recommends (what the run trains).
        return next((p for p in plans if p["is_config"]), None) or next(p for p in plans if p["recommended"])
    plan = row_of(plan_path)
    with_links = row_of(plan_path + "_links")["predicted_step_ms"]
    summary = [json.loads(l) for l in open(metrics_path) if l.strip()][-1]
    measured = summary["mean_step_time_ms"]
    mem = summary["peak_memory_bytes_per_rank"][0]
    pred_mem = plan["predicted_peak_bytes"]
    mem_err = max(abs(pred_mem[c] - mem[c]) / mem[c] for c in cats if mem[c] > 0)
    rows.append((name, plan["predicted_step_ms"], measured, mem_err, plan["predicted_tokens_per_second_per_device"],
                 summary["tokens_per_second_per_device"], with_links))
print("| configuration | predicted step ms | measured step ms | error | largest memory category error | "
      "predicted with the measured links | error |")
print("|---|---|---|---|---|---|---|")
for name, pred, meas, mem_err, _, _, links in rows:
    print(f"| {name} | {pred:.0f} | {meas:.0f} | {100 * (pred - meas) / meas:+.1f}% | {100 * mem_err:.2f}% | "
          f"{links:.0f} | {100 * (links - meas) / meas:+.1f}% |")
worst = max(abs(r[1] - r[2]) / r[2] for r in rows)
worst_links = max(abs(r[6] - r[2]) / r[2] for r in rows)
# Pairs measured more than 10% apart in tokens/s: is the predicted order the same?
pairs = wrong = 0
for i in range(len(rows)):
    for j in range(i + 1, len(rows)):
        mi, mj = rows[i][5], rows[j][5]
        if max(mi, mj) / min(mi, mj) <= 1.10:
            continue
        pairs += 1
        if (rows[i][4] > rows[j][4]) != (mi > mj):
            wrong += 1
            print(f"order differs: {rows[i][0]} vs {rows[j][0]}")
print(f"\nlargest step-time error {100 * worst:.1f}% ({100 * worst_links:.1f}% with the measured links); order: "
      f"{pairs - wrong} of {pairs} pairs more than 10% apart as measured")
auto = [r for r in rows if "--strategy auto" in r[0]]
two = [r for r in rows if not r[0].startswith(("4 ranks", "single", "2 ranks: --strategy auto"))]
if auto and two:
    best = max(two, key=lambda r: r[5])
    print(f"--strategy auto: {auto[0][5]:.0f} tokens/s/device measured, {auto[0][5] / best[5]:.3f}x the fastest "
          f"measured 2-rank row ({best[0]}, {best[5]:.0f})")
PY
