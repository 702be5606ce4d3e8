#!/usr/bin/env bash
# The trainer on a CPU node that another process is also using: the speed of a run with the default threads
# setting (threads: 0) on the idle node, then beside one CPU-bound process per competing core (`yes`), and
# the share of the idle speed it keeps; the same for threads fixed at every core, for comparison. The
# default follows the cores other processes leave (kernels/cpu/machine.h ThreadGovernor); a fixed count
# does not. Prints a markdown table (medians of R runs of the tiny config, 300 steps each) and exits 1 when
# the default keeps less than half its idle speed.
#
# Usage: scripts/bench_shared_cpu.sh [--reps R] [--competitors N]   (N default 1)
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
reps=3 competitors=1
while (($#)); do
    case $1 in
        --reps) reps=$2; shift 2 ;;
        --competitors) competitors=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, and $tmp (removed on exit)
pids=()
stop_competitors() {
    if ((${#pids[@]})); then
        kill "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
    pids=()
}
trap 'stop_competitors; rm -rf "$tmp"' EXIT

# Median tokens/s/device of R runs of the tiny config (OMP_NUM_THREADS unset: it would fix the count).
speed() {
    local all=()
    for ((r = 0; r < reps; r++)); do
        env -u OMP_NUM_THREADS "$trainer" --config configs/tiny.json --data tests/fixtures/olmo_tiny_tokens.u16 \
            --max-duration 300 --set console_log_interval=100000 --metrics-file "$tmp/m.jsonl" "$@" >/dev/null
        all+=("$(python3 -c "import json,sys; print([json.loads(l) for l in open('$tmp/m.jsonl')][-1]['tokens_per_second_per_device'])")")
    done
    python3 -c "import statistics,sys; print(f'{statistics.median(map(float, sys.argv[1:])):.0f}')" "${all[@]}"
}

cores=$(nproc)
echo "| threads | idle node, tokens/s | beside $competitors busy process(es), tokens/s | kept |"
echo "|---|---|---|---|"
status=0
for setting in 0 "$cores"; do
    idle=$(speed --threads "$setting")
    for ((c = 0; c < competitors; c++)); do yes >/dev/null & pids+=($!); done
    busy=$(speed --threads "$setting")
    stop_competitors
    kept=$(python3 -c "print(f'{$busy / $idle:.2f}')")
    label=$([[ $setting == 0 ]] && echo "0 (default, follows free cores)" || echo "$setting (fixed)")
    echo "| $label | $idle | $busy | $kept |"
    if [[ $setting == 0 ]] && python3 -c "import sys; sys.exit(0 if $busy / $idle < 0.5 else 1)"; then status=1; fi
done
exit $status
