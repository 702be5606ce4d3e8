#!/usr/bin/env bash
# Strategy benchmark: the same model and global batch under each data-parallel strategy, on 2 (--nproc) ranks of
# `trainer launch` (one thread each), plus one process with one thread as the baseline. Rows:
#   single                       1 process, 1 thread
#   ddp                          both grad_sync modes
#   fsdp NO_SHARD fp32           must cost what DDP costs
#   fsdp FULL_SHARD by_block fp32, both grad_sync modes
#   OLMo's measured FSDP configurations (allenai/OLMo#762), both grad_sync modes:
#     fsdp FULL_SHARD wrap null, mixed     and     fsdp SHARD_GRAD_OP by_block_and_size, mixed
# Rounds alternate every configuration, so machine noise hits all alike; each row is the mean over rounds
# of the run's mean step (first step excluded). Prints one markdown table: tokens/s/device, ratio to DDP
# (batch), MFU, step time, time the compute thread waited on collectives, and rank 0's peak memory by
# category (MiB; every rank's is in the metrics files); then draws the same as a bar chart of tokens/s/device
# and memory per rank per strategy into --png (default strategies.png; scripts/plot_metrics.py, which needs
# Debian's python3-matplotlib).
#
# Usage: scripts/bench_strategies.sh [--config configs/cpu_bench.json] [--steps N] [--rounds R]
#                                    [--global-batch G] [--micro-batch M] [--nproc N] [--png FILE] [-- FLAGS...]
# --nproc: the ranks of the multi-rank rows (default 2); FLAGS go to every run (on GPUs: --device cuda
# --precision amp_bf16, one GPU a rank over NCCL).
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
config=configs/cpu_bench.json steps=4 rounds=2 global=16 micro=2 png=strategies.png nproc=2 extra=()
while (($#)); do
    case $1 in
        --config) config=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --global-batch) global=$2; shift 2 ;;
        --micro-batch) micro=$2; shift 2 ;;
        --nproc) nproc=$2; shift 2 ;;
        --png) png=$2; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer (TRAINER_BIN, default build/bin/trainer), data/bench_tokens.bin, and $tmp (removed on exit)

common=(--config "$config" --data data/bench_tokens.bin --max-duration "$steps" --set console_log_interval=1000
    --set "global_train_batch_size=$global" --set "device_train_microbatch_size=$micro" "${extra[@]}")
names=() knobs=()
add() { names+=("$1"); knobs+=("$2"); }
add single "1 process, 1 thread"
for mode in batch micro_batch; do add "ddp_$mode" "ddp, grad_sync $mode"; done
add noshard "fsdp NO_SHARD, fp32, grad_sync batch"
for mode in batch micro_batch; do add "fs_block_$mode" "fsdp FULL_SHARD, by_block, fp32, grad_sync $mode"; done
for mode in batch micro_batch; do add "fs_null_$mode" "fsdp FULL_SHARD, wrap null, mixed, grad_sync $mode"; done
for mode in batch micro_batch; do add "sgo_$mode" "fsdp SHARD_GRAD_OP, by_block_and_size, mixed, grad_sync $mode"; done

flags() {
    local mode=${1##*_}
    [[ $1 == *micro_batch ]] && mode=micro_batch
    case $1 in
        single) echo "--set threads=1" ;;
        ddp_*) echo "--strategy ddp --set ddp.grad_sync_mode=$mode" ;;
        noshard) echo "--strategy fsdp --sharding-strategy NO_SHARD --set fsdp.precision=fp32" ;;
        fs_block_*) echo "--strategy fsdp --sharding-strategy FULL_SHARD --wrapping-strategy by_block --set fsdp.precision=fp32 --set fsdp.grad_sync_mode=$mode" ;;
        fs_null_*) echo "--strategy fsdp --sharding-strategy FULL_SHARD --set fsdp.precision=mixed --set fsdp.grad_sync_mode=$mode" ;;
        sgo_*) echo "--strategy fsdp --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block_and_size --set fsdp.precision=mixed --set fsdp.grad_sync_mode=$mode" ;;
    esac
}

port=$((29700 + RANDOM % 200))
for ((r = 1; r <= rounds; r++)); do
    for name in "${names[@]}"; do
        out="$tmp/$name.$r.jsonl"
        # shellcheck disable=SC2046
        if [[ $name == single ]]; then
            "$trainer" "${common[@]}" $(flags "$name") --metrics-file "$out" >"$tmp/$name.$r.log" 2>&1
        else
            port=$((port + 1))
            "$trainer" launch --nproc-per-node "$nproc" --master-port "$port" -- "${common[@]}" $(flags "$name") \
                --metrics-file "$out" >"$tmp/$name.$r.log" 2>&1
        fi || { cat "$tmp/$name.$r.log" >&2; exit 1; }
        echo "round $r/$rounds: $name done" >&2
    done
done

printf '%s\n' "${names[@]}" >"$tmp/names"
printf '%s\n' "${knobs[@]}" >"$tmp/knobs"
python3 - "$tmp" "$rounds" "$config" "$global" "$micro" "$nproc" <<'EOF'
import json, sys
tmp, rounds, config, global_batch, micro, nproc = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
names = open(f"{tmp}/names").read().split("\n")[:-1]
knobs = open(f"{tmp}/knobs").read().split("\n")[:-1]
def summary(name, r):
    for line in open(f"{tmp}/{name}.{r}.jsonl"):
        j = json.loads(line)
        if j.get("event") == "summary":
            return j
rows = {}
for name in names:
    s = [summary(name, r) for r in range(1, rounds + 1)]
    mean = lambda k: sum(x[k] for x in s) / len(s)
    rows[name] = dict(tps=mean("tokens_per_second_per_device"), mfu=mean("mfu"), step=mean("mean_step_time_ms"),
                      wait=mean("mean_comm_wait_ms"), mem=s[-1]["peak_memory_bytes_per_rank"][0])
ddp = rows["ddp_batch"]["tps"]
mib = lambda b: f"{b / 2**20:.0f}"
print(f"{config}, global batch {global_batch}, micro-batch {micro}, {nproc} ranks x 1 thread (single: 1 process x 1 thread), "
      f"mean of {rounds} rounds\n")
print("| strategy | tokens/s/device | vs DDP | MFU | step ms | comm wait ms | params | grads | optimizer | gathered | "
      "activations | comm | total | resident |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for name, knob in zip(names, knobs):
    r, m = rows[name], rows[name]["mem"]
    print(f"| {knob} | {r['tps']:.0f} | {r['tps'] / ddp:.2f}x | {100 * r['mfu']:.1f}% | {r['step']:.0f} | "
          f"{r['wait']:.0f} | {mib(m['parameters'])} | {mib(m['gradients'])} | {mib(m['optimizer_state'])} | "
          f"{mib(m['gathered_units'])} | {mib(m['activations'])} | {mib(m['communication'])} | {mib(m['total'])} | "
          f"{mib(m['resident'])} |")
print(f"\nDDP vs single: {ddp / rows['single']['tps']:.2f}x; FULL_SHARD by_block (batch) vs DDP: "
      f"{rows['fs_block_batch']['tps'] / ddp:.2f}x; NO_SHARD vs DDP: {rows['noshard']['tps'] / ddp:.2f}x")
chart = [{"label": knob, "tokens_per_second_per_device": rows[name]["tps"],
          "peak_memory_bytes_per_rank": summary(name, rounds)["peak_memory_bytes_per_rank"]}
         for name, knob in zip(names, knobs)]
json.dump(chart, open(f"{tmp}/chart.json", "w"))
EOF
/usr/bin/python3 scripts/plot_metrics.py --strategies "$tmp/chart.json" -o "$png" >&2
