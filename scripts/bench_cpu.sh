#!/usr/bin/env bash
# CPU benchmark: this trainer against PyTorch's CPU backend (Debian's python3-torch over OpenBLAS), same
# model shapes, threads, optimizer (AdamW + clipping + schedule) and batch, alternating the two in one
# run so machine noise hits both alike. Prints one markdown table: tokens/s of each, the ratio, and MFU
# against the measured fp32 FMA peak (trainer peak-flops).
#
# Both run under the same environment. OpenBLAS picks its kernels by CPU detection unless OPENBLAS_CORETYPE
# pins them (some machines pin an AVX2 set on AVX-512 CPUs): the table has one block with OpenBLAS's own
# detection ("native") and, when the environment pins a core type, one with that pin, for both programs.
#
# Usage: scripts/bench_cpu.sh [--steps N] [--rounds R] [--threads T]
#   shapes: cpu_bench (OLMo style), cpu_bench_gpt2 (same shape, GPT-2 style), gpt2_124m (micro-batch 4, seq 64)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
steps=6 rounds=2 threads=$(nproc)
while (($#)); do
    case $1 in
        --steps) steps=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bash scripts/install_deps.sh --with-torch
# TRAINER_BIN when set (another build to compare), else this tree's build, made current.
if [[ -z ${TRAINER_BIN:-} ]]; then bash scripts/build.sh >/dev/null; fi
py=/usr/bin/python3
trainer=$(bench_trainer)
bench_tokens "$trainer"
blas_settings=(native)
if [[ -n "${OPENBLAS_CORETYPE:-}" ]]; then blas_settings+=("OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE"); fi
pinned=${OPENBLAS_CORETYPE:-}
peak=$("$trainer" peak-flops --threads "$threads" --seconds 3 | $py -c 'import json,sys; print(json.load(sys.stdin)["measured_fma_flops"])')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# name | config | trainer overrides | torch overrides
shapes=(
    "cpu_bench|configs/cpu_bench.json||--micro-batch 8 --seq-len 256"
    "cpu_bench_gpt2|configs/cpu_bench_gpt2.json||--micro-batch 8 --seq-len 256"
    "gpt2_124m|configs/gpt2_124m.json|--set model.max_sequence_length=64 --set device_train_microbatch_size=4 --set global_train_batch_size=4 --set data.paths=data/bench_tokens.bin|--micro-batch 4 --seq-len 64"
)
for ((r = 1; r <= rounds; r++)); do
    for blas in "${blas_settings[@]}"; do
        if [[ $blas == native ]]; then unset OPENBLAS_CORETYPE; else export OPENBLAS_CORETYPE=$pinned; fi
        for s in "${shapes[@]}"; do
            IFS='|' read -r name config ours theirs <<<"$s"
            # shellcheck disable=SC2086
            "$trainer" --config "$config" --threads "$threads" --max-duration "$steps" --set console_log_interval=1000000 \
                --set peak_flops_per_device="$peak" $ours \
                --metrics-file "$tmp/ours_${blas}_${name}_$r.jsonl" >/dev/null
            # shellcheck disable=SC2086
            OMP_NUM_THREADS=$threads $py scripts/bench_torch.py --config "$config" --steps $((steps - 1)) --warmup 1 \
                --threads "$threads" $theirs >"$tmp/torch_${blas}_${name}_$r.json"
        done
    done
done

$py - "$tmp" "$rounds" "$peak" "$threads" "$steps" "${blas_settings[@]}" <<'PY'
import json, statistics, sys
tmp, rounds, peak, threads, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
blas_settings = sys.argv[6:]
print(f"CPU benchmark: {threads} threads, {steps} steps per run (first untimed), {rounds} alternating rounds; "
      f"measured FMA peak {peak/1e9:.0f} GFLOP/s\n")
print("| OpenBLAS kernels | shape | trainer tokens/s | PyTorch tokens/s | ratio | trainer MFU | PyTorch MFU |")
print("|---|---|---|---|---|---|---|")
for blas in blas_settings:
    for name in ["cpu_bench", "cpu_bench_gpt2", "gpt2_124m"]:
        ours, theirs, mfu = [], [], []
        for r in range(1, rounds + 1):
            rows = [json.loads(l) for l in open(f"{tmp}/ours_{blas}_{name}_{r}.jsonl")]
            summary = rows[-1]
            ours.append(summary["tokens_per_second_per_device"])
            mfu.append(summary["mfu"])
            theirs.append(json.load(open(f"{tmp}/torch_{blas}_{name}_{r}.json"))["tokens_per_second"])
        o, t, m = statistics.median(ours), statistics.median(theirs), statistics.median(mfu)
        label = "native (OpenBLAS detection)" if blas == "native" else blas
        print(f"| {label} | {name} | {o:.0f} | {t:.0f} | {o/t:.2f}x | {100*m:.1f}% | {100*m*t/o:.1f}% |")
PY
