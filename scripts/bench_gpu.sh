#!/usr/bin/env bash
# GPU benchmark: one-GPU training throughput and MFU of the gpt2_124m and OLMo-1B shapes, then every
# kernel of one step of each against the device's roofline (`trainer bench-kernels`).
#
# MFU = flops_per_token x tokens/s / peak, flops_per_token = 6N + 12 L d T (the trainer prints the
# terms), peak = the dense bf16 tensor-core peak in amp_bf16 (fp32 FMA peak in fp32): SMs x max clock x
# FLOP/clock/SM, printed by the trainer with the device's numbers (override: --set
# peak_flops_per_device=...). OLMo-core's published figure for OLMo-1B on H100s is 48% MFU.
#
# Usage: scripts/bench_gpu.sh [--steps N] [--precision amp_bf16|fp32] [--olmo-micro-batch B] [--attention native|cudnn]
# Needs a CUDA build and a GPU; the token file is this repository's own text (throughput only).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=12 precision=amp_bf16 olmo_micro=4 attention=native
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        --precision) precision=$2; shift 2 ;;
        --olmo-micro-batch) olmo_micro=$2; shift 2 ;;
        --attention) attention=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bash scripts/build.sh >/dev/null
trainer=build/bin/trainer
if ! ldd "$trainer" | grep -q libcudart; then
    echo "error: build/bin/trainer was built without CUDA (nvcc not found); install the CUDA toolkit" >&2
    exit 1
fi
mkdir -p data
if [[ ! -f data/bench_tokens.bin ]]; then
    git ls-files '*.cpp' '*.h' '*.cu' '*.md' '*.py' '*.sh' | xargs "$trainer" prepare-data --tokenizer bytes \
        --format llmc -o data/bench_tokens.bin >/dev/null
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# name | config | overrides (one micro-batch per step, no accumulation: the per-GPU work of a data-parallel run)
shapes=(
    "gpt2_124m|configs/gpt2_124m.json|--set device_train_microbatch_size=16 --set global_train_batch_size=16"
    "olmo_1b|configs/olmo_1b.json|--set device_train_microbatch_size=$olmo_micro --set global_train_batch_size=$olmo_micro"
)
echo "| shape | precision | tokens/s | MFU | step ms | peak device memory GiB |"
echo "|---|---|---|---|---|---|"
for s in "${shapes[@]}"; do
    IFS='|' read -r name config overrides <<<"$s"
    # shellcheck disable=SC2086
    "$trainer" --config "$config" --device cuda --precision "$precision" --data data/bench_tokens.bin \
        --max-duration "$steps" --set console_log_interval=1000000 --set kernels.attention="$attention" \
        $overrides --metrics-file "$tmp/$name.jsonl" >"$tmp/$name.log"
    grep -E "^FLOPs per token|^MFU peak" "$tmp/$name.log" | sed "s/^/[$name] /" >&2
    python3 - "$tmp/$name.jsonl" "$name" "$precision" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = rows[-1]
pool = s["peak_memory_bytes"].get("device_pool", 0) / 2**30
print(f"| {sys.argv[2]} | {sys.argv[3]} | {s['tokens_per_second_per_device']:.0f} | {100 * s['mfu']:.1f}% | "
      f"{s['mean_step_time_ms']:.1f} | {pool:.1f} |")
EOF
done
for s in "${shapes[@]}"; do
    IFS='|' read -r name config overrides <<<"$s"
    echo
    echo "### kernels of one $name step ($precision)"
    # shellcheck disable=SC2086
    "$trainer" bench-kernels --config "$config" --device cuda --precision "$precision" \
        --set kernels.attention="$attention" $overrides
done
