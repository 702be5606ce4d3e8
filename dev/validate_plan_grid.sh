#!/usr/bin/env bash
# The plan against runs across links: a grid of configurations on loopback (one node of 2 ranks) and on two
# network-lab links (scripts/netlab.sh: 2 nodes of 1 and of 2 ranks behind a rate-limited link), each planned
# from this machine's op times (bench-kernels) and the link as bench-comm measures it, then run. Prints one
# markdown table: predicted and measured step time and their error, the largest error over the memory categories,
# and for each link whether the plan's fastest row is the measured fastest (within the noise: 5%).
#
# Model: tiny.json at d_model 128, 4 blocks (1.1M parameters), one thread a rank, micro-batches of 4 x 64 tokens. The
# lab rows are planned for a node with half this machine's cores (its two nodes share them).
#
# Usage: sudo dev/validate_plan_grid.sh [--steps N] [--rates "RATE RATE"]   (TRAINER_BIN: the trainer)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
steps=4 rates="200mbit 40mbit"
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        --rates) rates=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[[ $(id -u) == 0 ]] || { echo "error: the network lab needs root (network namespaces)" >&2; exit 2; }
bench_setup  # $trainer, data/bench_tokens.bin (byte tokens: tiny.json's vocabulary), $tmp (removed on exit)
trainer=$(realpath "$trainer")
lab=tnl$$
trap 'bash scripts/netlab.sh down '"$lab"'; rm -rf "$tmp"' EXIT
model=(--config configs/tiny.json --set model.d_model=128 --set model.n_layers=4 --set threads=1
    --set device_train_microbatch_size=4)
# Op times measured by two ranks at once, as every row runs (two ranks, or two lab nodes, on this machine's two
# cores): an op alone runs faster than beside another rank on the next core (memory and cache are shared).
"$trainer" launch --nproc-per-node 2 -- bench-kernels "${model[@]}" --threads 1 --reps 5 \
    --calibration-out "$tmp/cal.json" >/dev/null
python3 - "$tmp/cpu_lab_node.json" "$(nproc)" <<'PY'
import json, sys
entry = json.load(open("configs/hardware/cpu.json"))
entry["name"], entry["cores"] = "cpu_lab_node", max(1, int(sys.argv[2]) // 2)  # two lab nodes on this machine
entry["description"] = "one of two network-lab nodes on this machine: half its cores"
json.dump(entry, open(sys.argv[1], "w"), indent=2)
PY

# name | flags (every row: global batch 4 x ranks x accumulation)
configs=(
    "ddp, batch|--strategy ddp"
    "ddp, micro_batch|--strategy ddp --set ddp.grad_sync_mode=micro_batch"
    "FULL_SHARD by_block, batch|--strategy fsdp --wrapping-strategy by_block --set fsdp.precision=fp32"
    "FULL_SHARD by_block, micro_batch|--strategy fsdp --wrapping-strategy by_block --set fsdp.precision=fp32 --set fsdp.grad_sync_mode=micro_batch"
    "FULL_SHARD wrap null mixed, micro_batch|--strategy fsdp --set fsdp.grad_sync_mode=micro_batch"
    "SHARD_GRAD_OP by_block_and_size mixed, batch|--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block_and_size"
    "NO_SHARD fp32|--strategy fsdp --sharding-strategy NO_SHARD --set fsdp.precision=fp32"
)
hybrid="HYBRID_SHARD by_block, batch|--strategy fsdp --sharding-strategy HYBRID_SHARD --wrapping-strategy by_block --set fsdp.precision=fp32"

k=0
# row LINK NODES NPROC ACCUMULATION NAME FLAGS: plans the configuration on the link, runs it, records both.
row() {
    local link=$1 nodes=$2 nproc=$3 accumulation=$4 name=$5 flags=$6 ranks=$(($2 * $3))
    local -a common=("${model[@]}" --set global_train_batch_size=$((4 * ranks * accumulation))
        --set "plan.calibration=$tmp/cal.json")
    [[ $link != loopback ]] && common+=(--set "plan.comm_calibration=$tmp/links_${link}_$nproc.json")
    [[ $link == loopback ]] && common+=(--set "plan.comm_calibration=$tmp/links_loopback.json")
    # The lab's nodes share this machine's cores: each has its share (the cpu entry with that many cores).
    local -a hardware=()
    [[ $link != loopback ]] && hardware=(--hardware "$tmp/cpu_lab_node.json")
    # shellcheck disable=SC2086
    "$trainer" plan "${common[@]}" $flags --nnodes "$nodes" --nproc-per-node "$nproc" "${hardware[@]}" --json \
        >"$tmp/$k.plan"
    local -a args=("${common[@]}" --data data/bench_tokens.bin --max-duration "$steps" --set save_folder=null
        --set console_log_interval=1000 --metrics-file "$tmp/$k.jsonl")
    # shellcheck disable=SC2086
    if [[ $link == loopback ]]; then
        "$trainer" launch --nproc-per-node "$nproc" --master-port $((29500 + k)) -- "${args[@]}" $flags \
            >"$tmp/$k.log" 2>&1 || { cat "$tmp/$k.log" >&2; exit 1; }
    else
        bash scripts/netlab.sh launch "$lab" "$nproc" "$trainer" -- "${args[@]}" $flags >"$tmp/$k.log" 2>&1 ||
            { cat "$tmp/$k.log" >&2; exit 1; }
    fi
    echo "$link|$nodes x $nproc, accumulation $accumulation: $name|$tmp/$k.plan|$tmp/$k.jsonl" >>"$tmp/index"
    echo "  $link $nodes x $nproc, accumulation $accumulation: $name" >&2
    k=$((k + 1))
}

echo "loopback: 1 node x 2 ranks" >&2
"$trainer" launch --nproc-per-node 2 -- bench-comm "${model[@]}" --max-size 16MiB \
    --calibration-out "$tmp/links_loopback.json" >/dev/null 2>&1
for c in "${configs[@]}"; do row loopback 1 2 4 "${c%%|*}" "${c#*|}"; done
for rate in $rates; do
    bash scripts/netlab.sh down "$lab"
    bash scripts/netlab.sh up "$lab" 2 "$rate"
    for nproc in 1 2; do
        echo "$rate: 2 nodes x $nproc" >&2
        # Twice at most: a fit that a busy moment spoiled is refused by bench-comm.
        for try in 1 2; do
            bash scripts/netlab.sh launch "$lab" "$nproc" "$trainer" -- bench-comm "${model[@]}" --max-size 8MiB \
                --seconds-per-size 0.5 --calibration-out "$tmp/links_${rate}_$nproc.json" >"$tmp/links.log" 2>&1 &&
                break
            grep -E "error" "$tmp/links.log" | head -3 >&2
            ((try == 1)) || exit 1
        done
    done
    for c in "${configs[@]}"; do row "$rate" 2 1 4 "${c%%|*}" "${c#*|}"; done
    # Fewer micro-batches a step: the per-micro-batch reductions' share falls.
    row "$rate" 2 1 1 "ddp, batch" "--strategy ddp"
    row "$rate" 2 1 1 "FULL_SHARD wrap null mixed, micro_batch" "--strategy fsdp --set fsdp.grad_sync_mode=micro_batch"
    for c in "${configs[0]}" "${configs[2]}" "$hybrid"; do row "$rate" 2 2 2 "${c%%|*}" "${c#*|}"; done
done
python3 - "$tmp/index" <<'PY'
import json, sys
cats = ["parameters", "gradients", "optimizer_state", "gathered_units", "activations", "communication"]
rows = []
for line in open(sys.argv[1]):
    link, name, plan_path, metrics_path = line.rstrip("\n").split("|")
    plan = next(p for p in (json.loads(l) for l in open(plan_path) if l.strip()) if p["is_config"])
    summary = [json.loads(l) for l in open(metrics_path) if l.strip()][-1]
    mem = summary["peak_memory_bytes_per_rank"][0]
    mem_err = max(abs(plan["predicted_peak_bytes"][c] - mem[c]) / mem[c] for c in cats if mem[c] > 0)
    rows.append(dict(link=link, name=name, pred=plan["predicted_step_ms"], meas=summary["mean_step_time_ms"],
                     mem_err=mem_err, pred_tps=plan["predicted_tokens_per_second_per_device"],
                     meas_tps=summary["tokens_per_second_per_device"]))
print("| link | configuration | predicted step ms | measured step ms | error | largest memory category error |")
print("|---|---|---|---|---|---|")
for r in rows:
    err = 100 * (r["pred"] - r["meas"]) / r["meas"]
    print(f"| {r['link']} | {r['name']} | {r['pred']:.0f} | {r['meas']:.0f} | {err:+.1f}% | {100 * r['mem_err']:.2f}% |")
errors = sorted(rows, key=lambda r: abs(r["pred"] - r["meas"]) / r["meas"])
within = sum(abs(r["pred"] - r["meas"]) / r["meas"] <= 0.15 for r in rows)
worst = errors[-1]
print(f"\n{len(rows)} rows; step time within 15% on {within} ({100 * within / len(rows):.0f}%); worst: {worst['link']} "
      f"{worst['name']} ({100 * (worst['pred'] - worst['meas']) / worst['meas']:+.1f}%); largest memory error "
      f"{100 * max(r['mem_err'] for r in rows):.2f}%")
# The fastest row of each link and layout (same ranks, same tokens a step), planned against measured.
groups = {}
for r in rows:
    groups.setdefault((r["link"], r["name"].split(":")[0]), []).append(r)
for (link, layout), g in groups.items():
    if len(g) < 2:
        continue
    planned = max(g, key=lambda r: r["pred_tps"])
    measured = max(g, key=lambda r: r["meas_tps"])
    ok = planned["meas_tps"] >= 0.95 * measured["meas_tps"]
    print(f"{link}, {layout}: plan's fastest {planned['name'].split(': ')[1]} ({planned['meas_tps']:.0f} tokens/s/device "
          f"measured), measured fastest {measured['name'].split(': ')[1]} ({measured['meas_tps']:.0f}): "
          f"{'right' if ok else 'WRONG'}")
PY
