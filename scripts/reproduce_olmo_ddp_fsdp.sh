#!/usr/bin/env bash
# OLMo's DDP-against-FSDP measurement reproduced on one machine: two nodes of one rank each (scripts/netlab.sh:
# network namespaces) behind a link slow enough that communication sits where it sat on OLMo's node, the three
# configurations OLMo measured, the plan's prediction of each from that link as bench-comm measures it, and what
# `--strategy auto` picks and trains.
#
# OLMo-1B on one 4-GPU node, global batch 256, micro-batch 2: DDP 8,034 tokens/s/device; FSDP wrap null, mixed,
# 1,747; FSDP SHARD_GRAD_OP by_block_and_size, mixed, 1,790; both FSDP rows reduce their gradients every micro-batch.
# What decides the gap is the ratio of an FSDP micro-batch's collectives (a bf16 all-gather and an fp32
# reduce-scatter of the whole model) over the link to its compute: F / (B x T) x (n-1)/n, for F the FLOP/s a rank
# computes, B the link's bytes/s and T a micro-batch's tokens (the model's size cancels). On OLMo's node, fitted by
# the plan to its rows (docs/plan.md: a 1.86 GB/s link, about 57 TFLOP/s a GPU, 4,096 tokens a micro-batch, 4
# ranks), that is about 5.6. Here: a model of 4.3M parameters (tiny.json at d_model 256, 4 blocks) at one thread a
# rank, micro-batches of 8 x 64 tokens, 16 a step, over the default 40 Mbit/s link, which this machine's one-thread
# ranks (about 29 GFLOP/s) put at about 5.6 too. The plan's compute and exposed communication per step are printed
# for each row, so the ratio on another machine can be read and the rate set to match (--rate).
#
# Usage: sudo scripts/reproduce_olmo_ddp_fsdp.sh [--rate RATE] [--steps N] [--chart FILE.png]
#   (TRAINER_BIN: the trainer, default build/bin/trainer; --chart needs matplotlib)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
rate=40mbit steps=3 chart=""
while (($#)); do
    case $1 in
        --rate) rate=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --chart) chart=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[[ $(id -u) == 0 ]] || { echo "error: the network lab needs root (network namespaces); run it as root" >&2; exit 2; }
py=/usr/bin/python3  # Debian's, with its python3-matplotlib (not a virtualenv's)
[[ -x $py ]] || py=python3
if [[ -n $chart ]] && ! "$py" -c "import matplotlib" 2>/dev/null; then
    echo "error: --chart needs matplotlib (scripts/install_deps.sh installs python3-matplotlib)" >&2
    exit 2
fi
bench_setup  # $trainer, data/bench_tokens.bin (byte tokens: tiny.json's vocabulary), $tmp (removed on exit)
trainer=$(realpath "$trainer")
lab=tnl$$
trap 'bash scripts/netlab.sh down '"$lab"'; rm -rf "$tmp"' EXIT
model=(--config configs/tiny.json --set model.d_model=256 --set model.n_layers=4 --set global_train_batch_size=256
    --set device_train_microbatch_size=8 --set threads=1)
echo "op times (bench-kernels, one thread)..." >&2
"$trainer" bench-kernels "${model[@]}" --threads 1 --reps 5 --calibration-out "$tmp/cal.json" >"$tmp/kernels.log"
bash scripts/netlab.sh up "$lab" 2 "$rate"

# `trainer launch` on both nodes of the lab (one rank each) running ARGS; the output in $tmp/$1.log.
on_nodes() {
    local name=$1
    shift
    bash scripts/netlab.sh launch "$lab" 1 "$trainer" -- "$@" >"$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log" >&2; exit 1; }
}

echo "the link (bench-comm over $rate)..." >&2
on_nodes links bench-comm "${model[@]}" --max-size 8MiB --seconds-per-size 0.5 --calibration-out "$tmp/links.json"
grep -E "node 0.*GB/s, " "$tmp/links.log" | sed 's/^.*\[rank 0\] *//' >&2

# name | flags
rows=(
    "DDP, grad_sync batch|--strategy ddp"
    "FSDP wrap null, mixed, reduce every micro-batch|--strategy fsdp --sharding-strategy FULL_SHARD --set fsdp.wrapping_strategy=null --set fsdp.precision=mixed --set fsdp.grad_sync_mode=micro_batch"
    "FSDP SHARD_GRAD_OP by_block_and_size, mixed, reduce every micro-batch|--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block_and_size --set fsdp.precision=mixed --set fsdp.grad_sync_mode=micro_batch"
    "--strategy auto|--strategy auto"
)
k=0
for row in "${rows[@]}"; do
    IFS='|' read -r name flags <<<"$row"
    echo "$name ($steps steps)..." >&2
    # shellcheck disable=SC2086
    "$trainer" plan "${model[@]}" $flags --nnodes 2 --nproc-per-node 1 --calibration "$tmp/cal.json" \
        --comm-calibration "$tmp/links.json" --json >"$tmp/$k.plan"
    # shellcheck disable=SC2086
    on_nodes "run$k" "${model[@]}" $flags --data data/bench_tokens.bin --max-duration "$steps" \
        --set save_folder=null --set console_log_interval=1000 --metrics-file "$tmp/$k.jsonl" \
        --set plan.calibration="$tmp/cal.json" --set plan.comm_calibration="$tmp/links.json"
    echo "$name|$tmp/$k.plan|$tmp/$k.jsonl|$tmp/run$k.log" >>"$tmp/index"
    k=$((k + 1))
done
"$py" - "$tmp/index" "$rate" "$chart" <<'PY'
import json, sys
index, rate, chart = sys.argv[1:4]
rows = []
for line in open(index):
    name, plan_path, metrics_path, log_path = line.rstrip("\n").split("|")
    for text in open(log_path):
        if "distributed_strategy auto" in text:  # what auto chose
            name += " -> " + text.split("): ", 1)[1].split(", because")[0]
    plans = [json.loads(l) for l in open(plan_path) if l.strip()]
    plan = next((p for p in plans if p["is_config"]), None) or next(p for p in plans if p["recommended"])
    summary = [json.loads(l) for l in open(metrics_path) if l.strip()][-1]
    rows.append(dict(name=name, measured=summary["tokens_per_second_per_device"],
                     step=summary["mean_step_time_ms"], predicted=plan["predicted_step_ms"],
                     predicted_tps=plan["predicted_tokens_per_second_per_device"],
                     compute=plan.get("predicted_compute_ms"), comm=plan.get("predicted_exposed_comm_ms")))
olmo = [8034, 1747, 1790]
print(f"2 nodes x 1 rank over a {rate} link (scripts/netlab.sh); OLMo: one node of 4 GPUs\n")
print("| configuration | tokens/s/device | step ms | predicted step ms | error | plan: compute / exposed comm ms | "
      "OLMo's tokens/s/device |")
print("|---|---|---|---|---|---|---|")
for i, r in enumerate(rows):
    err = 100 * (r["predicted"] - r["step"]) / r["step"]
    split = f"{r['compute']:.0f} / {r['comm']:.0f}" if r["compute"] is not None else "-"
    print(f"| {r['name']} | {r['measured']:,.0f} | {r['step']:,.0f} | {r['predicted']:,.0f} | {err:+.1f}% | {split} | "
          f"{f'{olmo[i]:,}' if i < 3 else '-'} |")
ddp, null, sgo = rows[0], rows[1], rows[2]
ratio, pred_ratio = ddp["measured"] / null["measured"], ddp["predicted_tps"] / null["predicted_tps"]
print(f"\nDDP / FSDP wrap null: {ratio:.2f}x measured, {pred_ratio:.2f}x predicted ({100 * (pred_ratio - ratio) / ratio:+.1f}%); "
      f"OLMo {8034 / 1747:.2f}x")
print(f"DDP / SHARD_GRAD_OP by_block_and_size: {ddp['measured'] / sgo['measured']:.2f}x measured, "
      f"{ddp['predicted_tps'] / sgo['predicted_tps']:.2f}x predicted; OLMo {8034 / 1790:.2f}x")
best = max(rows[:3], key=lambda r: r["measured"])
auto = rows[3]
print(f"--strategy auto: {auto['measured']:,.0f} tokens/s/device, {auto['measured'] / best['measured']:.3f}x the fastest "
      f"measured row ({best['name']})")
if chart:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["DDP", "FSDP wrap null", "SHARD_GRAD_OP", "auto"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["measured"] for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["predicted_tps"] for r in rows], 0.4, label="plan (bench-comm link)")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tokens/s/device")
    ax.set_title(f"2 nodes over a {rate} link: OLMo's three rows and auto")
    ax.legend()
    fig.tight_layout()
    fig.savefig(chart, dpi=110)
    print(f"chart: {chart}")
PY
