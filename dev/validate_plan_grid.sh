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
# A shared machine's speed moves by a third or more within minutes (this one switches between two speeds, about
# 1.5x apart, for seconds to minutes at a time), so the grid runs in rounds, each with its own link calibrations and
# the rows in the other order from the round before, and measures the op times after every row: every row is
# planned from each op's median time over all of them (the machine as the whole grid saw it), with its round's
# link, and set against the median of its steps over the rounds (the predicted: the median over the rounds).
#
# Usage: sudo dev/validate_plan_grid.sh [--steps N] [--rounds N] [--rates "RATE RATE"] [--keep DIR]
# (TRAINER_BIN: the trainer; --keep copies the calibrations, plans and metrics there)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
steps=4 rounds=3 rates="200mbit 40mbit" keep=""
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --rates) rates=$2; shift 2 ;;
        --keep) keep=$2; shift 2 ;;
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
# row ROUND LINK NODES NPROC ACCUMULATION NAME FLAGS: runs the configuration on the link, measures this machine's op
# times just after, and keeps the arguments that plan it (planned when every round has run).
row() {
    local round=$1 link=$2 nodes=$3 nproc=$4 accumulation=$5 name=$6 flags=$7 ranks=$(($3 * $4))
    local -a common=("${model[@]}" --set global_train_batch_size=$((4 * ranks * accumulation)))
    local -a plan_args=("${common[@]}" --nnodes "$nodes" --nproc-per-node "$nproc")
    if [[ $link == loopback ]]; then
        cp "$tmp/links_loopback.json" "$tmp/links_$k.json"
    else
        cp "$tmp/links_${link}_$nproc.json" "$tmp/links_$k.json"
        # The lab's nodes share this machine's cores: each has its share (the cpu entry with that many cores).
        plan_args+=(--hardware "$tmp/cpu_lab_node.json")
    fi
    # shellcheck disable=SC2206
    plan_args+=(--set "plan.comm_calibration=$tmp/links_$k.json" $flags --json)
    printf '%s\0' "${plan_args[@]}" >"$tmp/$k.args"
    local -a args=("${common[@]}" --data data/bench_tokens.bin --max-duration "$steps" --set save_folder=null
        --set console_log_interval=1000 --metrics-file "$tmp/$k.jsonl")
    # shellcheck disable=SC2086
    if [[ $link == loopback ]]; then
        "$trainer" launch --nproc-per-node "$nproc" --master-port $((29500 + k % 100)) -- "${args[@]}" $flags \
            >"$tmp/$k.log" 2>&1 || { cat "$tmp/$k.log" >&2; exit 1; }
    else
        bash scripts/netlab.sh launch "$lab" "$nproc" "$trainer" -- "${args[@]}" $flags >"$tmp/$k.log" 2>&1 ||
            { cat "$tmp/$k.log" >&2; exit 1; }
    fi
    # Op times measured by two ranks at once, as every row runs (two ranks, or two lab nodes, on this machine's two
    # cores): an op alone runs faster than beside another rank on the next core (memory and cache are shared).
    "$trainer" launch --nproc-per-node 2 --master-port $((29400 + k % 100)) -- bench-kernels "${model[@]}" \
        --threads 1 --reps 20 --calibration-out "$tmp/cal_$k.json" >/dev/null
    echo "$round|$link|$nodes x $nproc, accumulation $accumulation: $name|$tmp/$k.plan|$tmp/$k.jsonl" >>"$tmp/index"
    echo "  round $round, $link $nodes x $nproc, accumulation $accumulation: $name" >&2
    k=$((k + 1))
}

# The rows of one link as "NODES|NPROC|ACCUMULATION|NAME|FLAGS".
rows_of() {
    local c
    if [[ $1 == loopback ]]; then
        for c in "${configs[@]}"; do echo "1|2|4|$c"; done
        return
    fi
    for c in "${configs[@]}"; do echo "2|1|4|$c"; done
    # Fewer micro-batches a step: the per-micro-batch reductions' share falls.
    echo "2|1|1|ddp, batch|--strategy ddp"
    echo "2|1|1|FULL_SHARD wrap null mixed, micro_batch|--strategy fsdp --set fsdp.grad_sync_mode=micro_batch"
    for c in "${configs[0]}" "${configs[2]}" "$hybrid"; do echo "2|2|2|$c"; done
}

# run_link ROUND LINK: the link's rows, in the other order on every other round.
run_link() {
    local round=$1 link=$2 order=cat nodes nproc accumulation name flags
    ((round % 2 == 0)) && order=tac
    while IFS='|' read -r nodes nproc accumulation name flags; do
        row "$round" "$link" "$nodes" "$nproc" "$accumulation" "$name" "$flags" </dev/null
    done < <(rows_of "$link" | $order)
}

for ((round = 1; round <= rounds; round++)); do
    echo "round $round of $rounds: loopback, 1 node x 2 ranks" >&2
    "$trainer" launch --nproc-per-node 2 -- bench-comm "${model[@]}" --max-size 16MiB \
        --calibration-out "$tmp/links_loopback.json" >/dev/null 2>&1
    run_link "$round" loopback
    for rate in $rates; do
        bash scripts/netlab.sh down "$lab"
        bash scripts/netlab.sh up "$lab" 2 "$rate"
        for nproc in 1 2; do
            echo "round $round of $rounds: $rate, 2 nodes x $nproc" >&2
            # Twice at most: a fit that a busy moment spoiled is refused by bench-comm.
            for try in 1 2; do
                bash scripts/netlab.sh launch "$lab" "$nproc" "$trainer" -- bench-comm "${model[@]}" \
                    --max-size 8MiB --seconds-per-size 0.5 --calibration-out "$tmp/links_${rate}_$nproc.json" \
                    >"$tmp/links.log" 2>&1 && break
                grep -E "error" "$tmp/links.log" | head -3 >&2
                ((try == 1)) || exit 1
            done
        done
        run_link "$round" "$rate"
    done
done
# This machine's op times: each op's median over the calibrations taken after every row of every round (the same
# statistic of the same stretch of time as the rows' measured medians), and every row planned from them with its
# own round's link calibration.
python3 - "$tmp/cal.json" "$tmp"/cal_*.json <<'PY'
import json, statistics, sys
cals = [json.load(open(p)) for p in sys.argv[2:]]
pooled = cals[0]
for i, op in enumerate(pooled["ops"]):
    same = [c["ops"][i] for c in cals]
    assert all((o["op"], o["flops"], o["bytes"]) == (op["op"], op["flops"], op["bytes"]) for o in same)
    op["seconds"] = statistics.median(o["seconds"] for o in same)
pooled["step_scale"] = statistics.median(c["step_scale"] for c in cals)
json.dump(pooled, open(sys.argv[1], "w"), indent=1)
PY
for ((i = 0; i < k; i++)); do
    mapfile -d '' plan_args <"$tmp/$i.args"
    "$trainer" plan "${plan_args[@]}" --set "plan.calibration=$tmp/cal.json" >"$tmp/$i.plan"
done
if [[ -n $keep ]]; then
    mkdir -p "$keep"
    cp "$tmp"/index "$tmp"/*.json "$tmp"/*.jsonl "$tmp"/*.plan "$keep"/
    sed -i "s|$tmp/|$keep/|g" "$keep/index"
fi
python3 - "$tmp/index" <<'PY'
import json, statistics, sys
cats = ["parameters", "gradients", "optimizer_state", "gathered_units", "activations", "communication"]
rows = {}  # (link, name) -> the row's runs, in round order
for line in open(sys.argv[1]):
    _, link, name, plan_path, metrics_path = line.rstrip("\n").split("|")
    plan = next(p for p in (json.loads(l) for l in open(plan_path) if l.strip()) if p["is_config"])
    summary = [json.loads(l) for l in open(metrics_path) if l.strip()][-1]
    mem = summary["peak_memory_bytes_per_rank"][0]
    mem_err = max(abs(plan["predicted_peak_bytes"][c] - mem[c]) / mem[c] for c in cats if mem[c] > 0)
    steps = [r["step_time_ms"] for r in (json.loads(l) for l in open(metrics_path) if l.strip()) if "step" in r]
    rows.setdefault((link, name), []).append(dict(pred=plan["predicted_step_ms"], steps=steps[1:], mem_err=mem_err))
table = []
for (link, name), runs in rows.items():
    for r in runs:
        r["meas"] = statistics.median(r["steps"])
    pred = statistics.median(r["pred"] for r in runs)
    # Every step after each run's first, over the rounds.
    meas = statistics.median(t for r in runs for t in r["steps"])
    table.append(dict(link=link, name=name, pred=pred, meas=meas, err=(pred - meas) / meas,
                      mem_err=max(r["mem_err"] for r in runs), runs=runs))
rounds = max(len(r["runs"]) for r in table)
print(f"{rounds} round(s): measured, the median of the steps after each run's first over the rounds; the median "
      "step of each round's run in the last column.\n")
print("| link | configuration | predicted step ms | measured step ms | error | largest memory category error "
      "| median step by round |")
print("|---|---|---|---|---|---|---|")
for r in table:
    by_round = ", ".join(f"{x['meas']:.0f}" for x in r["runs"])
    print(f"| {r['link']} | {r['name']} | {r['pred']:.0f} | {r['meas']:.0f} | {100 * r['err']:+.1f}% "
          f"| {100 * r['mem_err']:.2f}% | {by_round} |")
within = sum(abs(r["err"]) <= 0.15 for r in table)
worst = max(table, key=lambda r: abs(r["err"]))
print(f"\n{len(table)} rows; step time within 15% on {within} ({100 * within / len(table):.0f}%); worst: "
      f"{worst['link']} {worst['name']} ({100 * worst['err']:+.1f}%); largest memory error "
      f"{100 * max(r['mem_err'] for r in table):.2f}%")
# The fastest row of each link and layout (same ranks, same tokens a step), planned against measured: the step
# times compare as tokens/s do within a group.
groups = {}
for r in table:
    groups.setdefault((r["link"], r["name"].split(":")[0]), []).append(r)
for (link, layout), g in groups.items():
    if len(g) < 2:
        continue
    planned = min(g, key=lambda r: r["pred"])
    measured = min(g, key=lambda r: r["meas"])
    ok = planned["meas"] <= measured["meas"] / 0.95
    print(f"{link}, {layout}: plan's fastest {planned['name'].split(': ')[1]} ({planned['meas']:.0f} ms measured), "
          f"measured fastest {measured['name'].split(': ')[1]} ({measured['meas']:.0f} ms): "
          f"{'right' if ok else 'WRONG'}")
PY
