#!/usr/bin/env bash
# GPU benchmark: one-GPU training throughput of the gpt2_124m, OLMo-1B and OLMo-2 1B shapes, this trainer against a
# PyTorch peer (scripts/bench_torch_gpu.py: the same model and batch, bf16 autocast, SDPA flash attention,
# fused AdamW, clipping; eager and torch.compile), alternating the three in each round so machine noise hits
# them alike; then (--kernels) every kernel of one step against the device's roofline (`trainer bench-kernels`).
#
# Each shape runs the trainer twice: as configured (activation_checkpointing null: every activation kept)
# and with activation_checkpointing=fine_grained (the norms and the MLP activation recomputed in the
# backward from what the GEMMs read, the cheap recompute torch.compile's partitioner chooses on its own);
# --no-fine-grained leaves the second out.
#
# Prints one markdown table: tokens/s of each, the trainer's ratio to torch.compile, MFU against the
# device's dense bf16 peak (the trainer's: the spec sheet's figure for known GPUs, e.g. H100 SXM 989.4
# TFLOP/s; SMs x max clock x FLOP/clock/SM otherwise) and peak device memory (the trainer's pool
# high-water mark; PyTorch's reserved peak, its allocated peak in brackets).
#
# Runs a given binary (TRAINER_BIN, default build/bin/trainer) and builds nothing, so it runs from the GPU
# bundle (dev/gpu_bundle.sh); writes no checkpoint (save_folder=null: an OLMo-1B checkpoint is
# 14 GB). The tokens are this repository's own text, made once with the trainer (throughput only).
#
# --graphs runs each shape once more with kernels.cuda_graphs=true (each micro-batch's forward and backward
# replayed as a CUDA graph: one launch instead of one per kernel) and prints it as its own row.
#
# The table's "busy" column is the trainer's mean device_busy_fraction (the share of a step the compute
# stream ran kernels, from a pair of CUDA events around each op). --utilization-cost runs each shape once
# more with utilization_interval=0 (no events) and prints what measuring costs.
#
# --fp8 runs each shape once more with --precision amp_fp8 (the blocks' Linear layers on cuBLASLt's FP8 GEMMs; a
# GPU of compute capability 8.9 or newer) and prints it as its own row, with its ratio to the trainer's bf16 row.
#
# Usage: scripts/bench_gpu.sh [--steps N] [--rounds R] [--attention native|cudnn|flash] [--shapes LIST]
#                             [--no-torch] [--no-fine-grained] [--utilization-cost] [--graphs] [--fp8] [--kernels]
#   LIST: comma-separated of gpt2_124m, olmo_1b_mb4, olmo_1b_mb8, olmo2_1b_mb4 (default: these four; OLMo-2 1B at
#         micro-batch 4 of its 4096 tokens: the 16K tokens a step of OLMo-1B at 8), and llama_1b_mb4 (grouped-query
#         attention, 4 x 4096)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
steps=12 rounds=1 attention=cudnn shapes=gpt2_124m,olmo_1b_mb4,olmo_1b_mb8,olmo2_1b_mb4 torch=1 kernels=0 fine_grained=1
util_cost=0 graphs=0 fp8=0
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --attention) attention=$2; shift 2 ;;
        --shapes) shapes=$2; shift 2 ;;
        --no-torch) torch=0; shift ;;
        --no-fine-grained) fine_grained=0; shift ;;
        --kernels) kernels=1; shift ;;
        --utilization-cost) util_cost=1; shift ;;
        --graphs) graphs=1; shift ;;
        --fp8) fp8=1; shift ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
trainer=${TRAINER_BIN:-build/bin/trainer}
if [[ ! -x $trainer ]]; then
    echo "error: $trainer is not an executable trainer; build one (scripts/build.sh) or set TRAINER_BIN" >&2
    exit 1
fi
py=${PYTHON:-python3}
bench_tokens "$trainer"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# name | config | micro-batch (one micro-batch per step, no accumulation: the per-GPU work of a data-parallel run)
declare -A spec=(
    [gpt2_124m]="configs/gpt2_124m.json|16"
    [olmo_1b_mb4]="configs/olmo_1b.json|4"
    [olmo_1b_mb8]="configs/olmo_1b.json|8"
    [olmo2_1b_mb4]="configs/olmo2_1b.json|4"
    [llama_1b_mb4]="configs/llama_1b.json|4"
)
IFS=',' read -r -a names <<<"$shapes"
for name in "${names[@]}"; do
    [[ -n ${spec[$name]:-} ]] || { echo "error: unknown shape $name (expected ${!spec[*]})" >&2; exit 2; }
done

for ((r = 1; r <= rounds; r++)); do
    for name in "${names[@]}"; do
        IFS='|' read -r config micro <<<"${spec[$name]}"
        variants=(null)
        ((fine_grained)) && variants+=(fine_grained)
        ((util_cost)) && variants+=(noutil)
        ((graphs)) && variants+=(graphs)
        ((fp8)) && variants+=(fp8)
        for variant in "${variants[@]}"; do
            run=$name ac=$variant interval=1 replay=false precision=amp_bf16
            [[ $variant == null ]] || run=${name}_$variant
            [[ $variant == noutil ]] && ac=null interval=0
            [[ $variant == graphs ]] && ac=null replay=true
            [[ $variant == fp8 ]] && ac=null precision=amp_fp8
            "$trainer" --config "$config" --device cuda --precision "$precision" --data data/bench_tokens.bin \
                --max-duration "$steps" --set console_log_interval=1000000 --set kernels.attention="$attention" \
                --set save_folder=null --set save_interval=0 --set device_train_microbatch_size="$micro" \
                --set global_train_batch_size="$micro" --set activation_checkpointing="$ac" \
                --set utilization_interval="$interval" --set kernels.cuda_graphs="$replay" \
                --metrics-file "$tmp/trainer_${run}_$r.jsonl" >"$tmp/trainer_${run}_$r.log" 2>&1 && continue
            # A failed graphs or fp8 run (not yet run on a GPU when written) costs its own row, not the table.
            if [[ $variant != graphs && $variant != fp8 ]]; then cat "$tmp/trainer_${run}_$r.log" >&2; exit 1; fi
            echo "warning: the trainer's $run run failed: $(tail -1 "$tmp/trainer_${run}_$r.log")" >&2
            rm -f "$tmp/trainer_${run}_$r.jsonl"
        done
        if ((torch && fp8)); then
            # The FP8 peer: torch.compile with the blocks' Linear layers on torch._scaled_mm.
            "$py" scripts/bench_torch_gpu.py --config "$config" --micro-batch "$micro" --mode compile --fp8 \
                --steps $((steps - 2)) --warmup 2 >"$tmp/torch_fp8_${name}_$r.json" 2>"$tmp/torch_fp8_${name}_$r.err" || {
                echo "warning: PyTorch's FP8 peer on $name failed: $(tail -1 "$tmp/torch_fp8_${name}_$r.err")" >&2
                rm -f "$tmp/torch_fp8_${name}_$r.json"
            }
        fi
        if ((torch)); then
            for mode in eager compile; do
                "$py" scripts/bench_torch_gpu.py --config "$config" --micro-batch "$micro" --mode "$mode" \
                    --steps $((steps - 2)) --warmup 2 >"$tmp/torch_${mode}_${name}_$r.json" \
                    2>"$tmp/torch_${mode}_${name}_$r.err" || {
                    echo "warning: PyTorch $mode on $name failed: $(tail -1 "$tmp/torch_${mode}_${name}_$r.err")" >&2
                    rm -f "$tmp/torch_${mode}_${name}_$r.json"
                }
            done
        fi
    done
done
grep -h "^MFU peak" "$tmp"/trainer_*_1.log | head -1 >&2

"$py" - "$tmp" "$rounds" "$attention" "$fine_grained" "$util_cost" "$graphs" "$fp8" "${names[@]}" <<'PY'
import json, os, statistics, sys
tmp, rounds, attention = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fine_grained, util_cost, graphs, fp8 = sys.argv[4] == "1", sys.argv[5] == "1", sys.argv[6] == "1", sys.argv[7] == "1"
names = sys.argv[8:]
gib = 2**30
def load(path):
    return json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else None
print(f"| shape | trainer tokens/s | eager tokens/s | compile tokens/s | trainer / compile | trainer MFU | "
      f"compile MFU | trainer GiB | eager GiB | compile GiB | busy |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
# Each shape's fine_grained, graphs and fp8 runs beside the same PyTorch figures.
extra = (["fine_grained"] if fine_grained else []) + (["graphs"] if graphs else []) + (["fp8"] if fp8 else [])
runs = [r for name in names for r in [(name, name)] + [(name, f"{name}_{v}") for v in extra]]
for name, run in runs:
    ours, ours_mfu, eager, comp, mem, busy = [], [], [], [], [], []
    teager = tcomp = None
    for r in range(1, rounds + 1):
        if not os.path.exists(f"{tmp}/trainer_{run}_{r}.jsonl"):
            continue  # the run failed (a warning said why)
        rows = [json.loads(l) for l in open(f"{tmp}/trainer_{run}_{r}.jsonl") if l.strip()]
        s = rows[-1]
        ours.append(s["tokens_per_second_per_device"])
        ours_mfu.append(100.0 * s["mfu"])
        fpt, peak = s["flops_per_token"], s["peak_flops_per_device"]
        mem.append(s["peak_memory_bytes"].get("device_pool", 0))
        if "mean_device_busy_fraction" in s: busy.append(100.0 * s["mean_device_busy_fraction"])
        e, c = load(f"{tmp}/torch_eager_{name}_{r}.json"), load(f"{tmp}/torch_compile_{name}_{r}.json")
        if e: eager.append(e["tokens_per_second"]); teager = e
        if c: comp.append(c["tokens_per_second"]); tcomp = c
    if not ours:
        print(f"| {run} | failed | " + " | ".join(["-"] * 9) + " |")
        continue
    med = statistics.median
    # PyTorch's MFU as the trainer counts its own: flops_per_token over the L-1 predicted tokens of each
    # instance of L (tokens/s counts L per instance, OLMo's count).
    def mfu(tps, L):
        return 100.0 * fpt * tps * (L - 1) / L / peak
    o = med(ours)
    fmt = lambda x: f"{x:,.0f}" if x else "-"
    row = [run, fmt(o), fmt(med(eager)) if eager else "-", fmt(med(comp)) if comp else "-",
           f"{o / med(comp):.2f}" if comp else "-", f"{med(ours_mfu):.1f}%",
           f"{mfu(med(comp), tcomp['seq_len']):.1f}%" if comp else "-",
           f"{max(mem) / gib:.1f}",
           f"{teager['peak_reserved_bytes'] / gib:.1f} ({teager['peak_allocated_bytes'] / gib:.1f})" if teager else "-",
           f"{tcomp['peak_reserved_bytes'] / gib:.1f} ({tcomp['peak_allocated_bytes'] / gib:.1f})" if tcomp else "-",
           f"{med(busy):.0f}%" if busy else "-"]
    print("| " + " | ".join(row) + " |")
print(f"\ntrainer: amp_bf16 (the _fp8 rows amp_fp8), kernels.attention={attention}; {rounds} round(s), medians; "
      f"MFU = flops_per_token x predicted tokens/s / the trainer's dense bf16 peak (amp_fp8's too)")
def median_tps(run):
    got = [json.loads([l for l in open(p) if l.strip()][-1])["tokens_per_second_per_device"]
           for p in (f"{tmp}/trainer_{run}_{r}.jsonl" for r in range(1, rounds + 1)) if os.path.exists(p)]
    return statistics.median(got) if got else None
if fp8:
    def peer_tps(name):
        got = [load(f"{tmp}/torch_fp8_{name}_{r}.json") for r in range(1, rounds + 1)]
        got = [g["tokens_per_second"] for g in got if g]
        return statistics.median(got) if got else None
    print("\n| shape | amp_bf16 tokens/s | amp_fp8 tokens/s | fp8 / bf16 | PyTorch _scaled_mm FP8 (compile) tokens/s | "
          "amp_fp8 / that |")
    print("|---|---|---|---|---|---|")
    for name in names:
        b, f, t = median_tps(name), median_tps(f"{name}_fp8"), peer_tps(name)
        cells = [f"{b:,.0f}", f"{f:,.0f}" if f else "failed", f"{f / b:.3f}" if f else "-",
                 f"{t:,.0f}" if t else "-", f"{f / t:.3f}" if f and t else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
if util_cost:
    def tps(run):
        return statistics.median(
            [json.loads([l for l in open(f"{tmp}/trainer_{run}_{r}.jsonl") if l.strip()][-1])["tokens_per_second_per_device"]
             for r in range(1, rounds + 1)])
    print("\n| shape | utilisation measured, tokens/s | not measured, tokens/s | measured / not |")
    print("|---|---|---|---|")
    for name in names:
        on, off = tps(name), tps(f"{name}_noutil")
        print(f"| {name} | {on:,.0f} | {off:,.0f} | {on / off:.3f} |")
PY

if ((kernels)); then
    for name in "${names[@]}"; do
        IFS='|' read -r config micro <<<"${spec[$name]}"
        echo
        echo "### kernels of one $name step (amp_bf16, attention $attention)"
        "$trainer" bench-kernels --config "$config" --device cuda --precision amp_bf16 \
            --set kernels.attention="$attention" --set device_train_microbatch_size="$micro" \
            --set global_train_batch_size="$micro"
    done
fi
