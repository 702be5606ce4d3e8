#!/usr/bin/env bash
# Memory of each strategy, sharding mode and grad_sync mode on N CPU ranks (default 4) of cpu_bench
# (micro-batch 2, global batch 4 x N: two micro-batches a step), also with CPU offload: rank 0's peak by
# category, the host categories' total (offload), the accounted total, the pool's high-water mark, the
# measured peak resident set and what no category counts.
#
# Usage: scripts/bench_memory.sh [--ranks N] [--steps N] [--config FILE]
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
ranks=4 steps=3 config=configs/cpu_bench.json
while (($#)); do
    case $1 in
        --ranks) ranks=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --config) config=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
# name | flags
runs=(
    "DDP|--strategy ddp"
    "FULL_SHARD by_block|--strategy fsdp --sharding-strategy FULL_SHARD --wrapping-strategy by_block"
    "SHARD_GRAD_OP by_block|--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block"
    "FULL_SHARD by_block_and_size|--strategy fsdp --sharding-strategy FULL_SHARD --wrapping-strategy by_block_and_size"
    "NO_SHARD|--strategy fsdp --sharding-strategy NO_SHARD"
    "DDP, offload optimizer|--strategy ddp --set cpu_offload.optimizer_state=true"
    "FULL_SHARD by_block, offload both|--strategy fsdp --sharding-strategy FULL_SHARD --wrapping-strategy by_block --set cpu_offload.optimizer_state=true --set cpu_offload.parameters=true"
)
k=0
for run in "${runs[@]}"; do
    IFS='|' read -r name flags <<<"$run"
    for mode in batch micro_batch; do
        key=ddp.grad_sync_mode
        [[ $name == DDP* ]] || key=fsdp.grad_sync_mode
        # shellcheck disable=SC2086
        "$trainer" launch --nproc-per-node "$ranks" -- --config "$config" --data data/bench_tokens.bin \
            --max-duration "$steps" --set device_train_microbatch_size=2 \
            --set global_train_batch_size=$((4 * ranks)) $flags --set "$key=$mode" \
            --metrics-file "$tmp/$k.jsonl" >"$tmp/$k.log" 2>&1 || { cat "$tmp/$k.log" >&2; exit 1; }
        echo "$name|$mode|$tmp/$k.jsonl" >>"$tmp/index"
        k=$((k + 1))
    done
done
python3 - "$tmp/index" "$ranks" "$config" <<'PY'
import json, sys
index, ranks, config = sys.argv[1], sys.argv[2], sys.argv[3]
mib = 2**20
rows = [l.rstrip("\n").split("|") for l in open(index)]
print(f"{config} on {ranks} ranks (micro-batch 2, two micro-batches a step), fsdp.precision mixed; rank 0, MiB\n")
print("| strategy | grad_sync | parameters | gradients | optimizer | gathered | activations | communication | "
      "host | accounted | pool | resident | unaccounted | resident vs DDP |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
ddp_res = {}
for name, mode, path in rows:
    m = [json.loads(l) for l in open(path) if l.strip()][-1]["peak_memory_bytes_per_rank"][0]
    if name == "DDP":
        ddp_res[mode] = m["resident"]
    m["accounted"] = m["total"] + m["host_total"]
    cells = [m[k] / mib for k in ("parameters", "gradients", "optimizer_state", "gathered_units", "activations",
                                    "communication", "host_total", "accounted", "device_pool", "resident",
                                    "unaccounted")]
    ratio = m["resident"] / ddp_res[mode] if mode in ddp_res else float("nan")
    print(f"| {name} | {mode} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {ratio:.2f} |")
PY
