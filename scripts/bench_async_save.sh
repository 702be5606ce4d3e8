#!/usr/bin/env bash
# What a checkpoint every step costs the step: cpu_bench (or --config) on 2 ranks of one thread each (one core
# standing for one device) under --strategy (fsdp FULL_SHARD by default: each rank writes half the state; ddp:
# rank 0 writes all of it), run three ways: without checkpoints, with save_async=false (every rank waits for
# the whole write) and with save_async=true (a snapshot to host memory, the write on a background thread).
# Each run trains --steps steps of --global instances of --seq-len tokens; a step's time is its step_time_ms
# plus the save_ms its save held it up (the metrics record's), averaged over the steps after the first (whose
# caches are cold) and before the last (whose checkpoint is written at once in every mode). The runs
# alternate, round after round, so a slower minute of this shared machine touches all of them.
#
# Usage: scripts/bench_async_save.sh [--config FILE] [--strategy fsdp|ddp] [--steps N] [--global N]
#                                     [--seq-len N] [--rounds R] [--folder DIR]
# The checkpoints go to --folder (default: a temporary folder on the disk of $TMPDIR; the page cache and the
# disk decide the write's speed) and are removed at the end. Runs TRAINER_BIN (default build/bin/trainer).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
config=configs/cpu_bench.json strategy=fsdp steps=8 global=4 seq_len=128 rounds=1 folder=""
while (($#)); do
    case $1 in
        --config) config=$2; shift 2 ;;
        --strategy) strategy=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --global) global=$2; shift 2 ;;
        --seq-len) seq_len=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --folder) folder=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
case $strategy in fsdp | ddp) ;; *) echo "error: --strategy $strategy: expected fsdp or ddp" >&2; exit 2 ;; esac
((steps >= 3)) || { echo "error: --steps $steps: expected at least 3 (the first and the last are not timed)" >&2; exit 2; }
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
[[ -n $folder ]] || folder=$tmp/ck
for ((round = 0; round < rounds; round++)); do
    for mode in none sync async; do
        rm -rf "$folder"
        args=(--config "$config" --data data/bench_tokens.bin --max-duration "$steps" --threads 1 --strategy "$strategy"
              --set "global_train_batch_size=$global" --set device_train_microbatch_size=$((global / 2))
              --set "model.max_sequence_length=$seq_len" --set console_log_interval=1000000
              --metrics-file "$tmp/$mode.$round.jsonl")
        case $mode in
            sync | async)
                args+=(--save-folder "$folder" --set save_interval=1 --set save_num_checkpoints_to_keep=2
                       --set "save_async=$([[ $mode == async ]] && echo true || echo false)") ;;
        esac
        "$trainer" launch --nproc-per-node 2 -- "${args[@]}" >"$tmp/$mode.log" 2>&1 || { cat "$tmp/$mode.log" >&2; exit 1; }
    done
done
du_bytes=$(du -sb "$folder/step$steps" | cut -f1)
rm -rf "$folder"
python3 - "$tmp" "$rounds" "$steps" "$du_bytes" "$strategy" <<'PY'
import json, statistics, sys
tmp, rounds, steps, ck_bytes, strategy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def load(mode):
    times, stalls, snapshot = [], [], 0
    for r in range(rounds):
        for line in open(f"{tmp}/{mode}.{r}.jsonl"):
            j = json.loads(line)
            if j.get("event") == "summary":
                snapshot = j["peak_memory_bytes"].get("host_checkpoint_snapshot", 0)
            elif "loss" in j and 1 < j["step"] < steps:
                times.append(j["step_time_ms"] + j.get("save_ms", 0.0))
                stalls.append(j.get("save_ms", 0.0))
    return statistics.mean(times), statistics.mean(stalls), snapshot
base = load("none")[0]
print(f"{strategy}, 2 ranks, a checkpoint of {ck_bytes / 2**20:.0f} MiB every step; "
      f"steps 2-{steps - 1} of {steps}, {rounds} round(s)")
print("| checkpoints | step ms (incl. save) | of which the save held it up | vs none | host snapshot a rank |")
print("|---|---|---|---|---|")
for mode, label in (("none", "none"), ("sync", "every step, save_async=false"), ("async", "every step, save_async=true")):
    t, stall, snap = load(mode)
    print(f"| {label} | {t:.0f} | {stall:.0f} | {t / base:.2f}x | {snap / 2**20:.0f} MiB |")
PY
