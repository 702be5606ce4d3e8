#!/usr/bin/env bash
# The checks a session with a lent GPU runs, in one command that fits the device tool's 10-minute call, from
# the portable bundle (../shared/tools/gpu_bundle.sh, then dev/gpu_pack.sh, which gzips it to fit a call's
# 64 MiB) and without building or installing anything:
#
#   tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh [STAGE...]
#
# A session is lent the GPU for 15 minutes of device time, start-up included, and the machine goes back 30
# seconds after a call ends: put what belongs together into one call. On an H200 (2026-11-26) `first` took 1
# minute, `throughput tests` 3.5, `strategies plan` 1, `memory` 3.2.
#
# Stages (default: tests kernels bench):
#   first       gpu_tests (every case but [ranks] and [multigpu], no sanitizer; our flash attention's cases first, in a
#               process of their own),
#               then the kernels stage: what the code written without a GPU does there, and our flash attention
#               against cuDNN's
#   throughput  scripts/bench_gpu.sh on GPT-2 124M and OLMo-1B micro-batch 4: the trainer as configured and with
#               kernels.cuda_graphs, against PyTorch eager and torch.compile, alternating
#   tests     gpu_tests, then compute-sanitizer memcheck over the kernel cases (cuDNN's own kernels left out)
#   memcheck  that memcheck alone (after `first`, which ran gpu_tests)
#   race      compute-sanitizer racecheck over the kernel cases but the 1024-block flash case (over 7 minutes
#             under racecheck; the small flash case runs the same kernels)
#   kernels   trainer bench-kernels on OLMo-1B (micro-batch 4) and GPT-2 124M (16), our flash attention and
#             cuDNN's: each op against the roofline, the attention rows giving flash's speed against cuDNN's; then
#             once more with kernels.classifier_one_read=true, the classifier's two kernels side by side
#   bench     scripts/bench_gpu.sh: tokens/s, MFU and peak memory of the trainer against PyTorch eager and
#             torch.compile on the four shapes (GPT-2 124M, OLMo-1B at micro-batch 4 and 8, OLMo-2 1B), alternating
#   strategies  OLMo-1B micro-batch 4 under single, DDP and FSDP FULL_SHARD / SHARD_GRAD_OP / NO_SHARD at
#             world size 1, tokens/s against single's
#   storage   bf16 activation storage against fp32 (kernels.bf16_activations), OLMo-1B micro-batch 4 and
#             GPT-2 124M micro-batch 16, alternating: tokens/s and peak memory of each
#   memory    activation checkpointing and CPU offload on one GPU: OLMo-1B micro-batch 8 with null and
#             whole_layer; OLMo-7B micro-batch 2 with whole_layer and cpu_offload.optimizer_state (3 steps of
#             64 micro-batches: tokens/s, MFU, busy fraction, device and host peaks), after the plan's
#             prediction of that run
#   plan      trainer plan against a measured run of the same configuration, OLMo-1B (micro-batch 4) and GPT-2 124M
#             (16): from this GPU's hardware entry, and from the ops' times where `kernels` ran before it in the
#             same call (its bench-kernels --calibration-out, cuDNN attention)
#   hf        transformers' logits and 8 greedy tokens on the Hugging Face exports of the tiny GPT-2, OLMo, OLMo-2,
#             Llama (grouped-query) and one-key/value-head OLMo-2 fixtures (two steps trained on the CPU, `trainer
#             export`, scripts/check_hf_export.py --generate 8): the GPU machine is where transformers is installed;
#             nothing here needs the GPU (under a minute)
#   comm      on a node of 2 or more GPUs: trainer bench-comm over NCCL on all of them (the links, fitted per
#             collective), then OLMo-1B's plan for that world on the hardware entry's links and on the measured
#             ones; on one GPU it says so and runs nothing (NCCL takes one GPU a rank)
#   ranks     several ranks on this one GPU over staged Gloo (distributed_backend gloo): gpu_tests' [ranks] cases (every
#             strategy on 2 and 4 ranks against the single process, HYBRID_SHARD 2 x 2, amp_bf16 repeatability, prefetch,
#             offload, checkpoints across world sizes and devices, SIGTERM, a non-finite gradient, the refusals, the
#             trace's overlap), the one-rank NCCL cases (the CUDA communication code NCCL shares), then
#             compute-sanitizer memcheck, racecheck and synccheck over a 2-rank FULL_SHARD by_block run, each rank
#             under the tool
#   multigpu  on a node of 2 or more GPUs, NCCL with one GPU a rank: gpu_tests' [multigpu] parity cases, the comm
#             stage, and scripts/bench_strategies.sh at OLMo-1B on all the GPUs; on one GPU it says so and runs
#             nothing
#   profile   ncu of our flash forward and backward kernels (on an H100 the wgmma ones, attention_flash_sm90a.cu, the
#             backward's dK/dV and dQ launches each)
#             at OLMo-1B micro-batch 4 and GPT-2 micro-batch 16: speed of light, the pipes, occupancy and the
#             warps' stall reasons
#
# Each step has its own time limit; the logs go to $OUT/gpu-check.tgz (the device tool's output folder; else
# ./gpu-check.tgz), and a summary is printed last. TRAINER_BIN and GPU_TESTS_BIN default to the bundle's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/bench_common.sh
trainer=${TRAINER_BIN:-build-portable/bin/trainer}
gpu_tests=${GPU_TESTS_BIN:-build-portable/bin/gpu_tests}
for bin in "$trainer" "$gpu_tests"; do
    [[ -x $bin ]] || { echo "error: $bin is not built (bash ../shared/tools/gpu_bundle.sh, or set TRAINER_BIN / GPU_TESTS_BIN)" >&2; exit 1; }
done
stages=("$@")
((${#stages[@]})) || stages=(tests kernels bench)
for s in "${stages[@]}"; do
    case $s in first | throughput | tests | memcheck | race | kernels | bench | strategies | storage | memory | plan | hf | comm | ranks | multigpu | profile) ;;
        *) echo "error: unknown stage $s (see the header of $0)" >&2; exit 2 ;;
    esac
done
# The two models and micro-batches the kernels, plan and profile stages measure.
model_shapes=("olmo_1b 4" "gpt2_124m 16")
logs=$(mktemp -d)
summary=$logs/summary.txt
t0=$SECONDS
note() { echo "$*" | tee -a "$summary"; }
# Runs "$@" with a time limit, its output in $logs/$name.log; notes the exit status and the seconds.
step() {
    local name=$1 limit=$2
    shift 2
    local s=$SECONDS
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    note "$name: exit $rc, $((SECONDS - s)) s"
    return $rc
}
# The last metrics record of a run: tokens/s, MFU, mean step and the device pool's and host's peaks.
summarize() {
    python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = rows[-1]
peak = s.get("peak_memory_bytes", {})
gib = 2 ** 30
busy = f", busy {s['mean_device_busy_fraction']:.2f}" if "mean_device_busy_fraction" in s else ""
print(f"  {s['tokens_per_second_per_device']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}%, step {s['mean_step_time_ms']:.1f} ms{busy}, "
      f"device pool {peak.get('device_pool', 0) / gib:.1f} GiB, activations {peak.get('activations', 0) / gib:.1f} GiB, "
      f"host {peak.get('host_total', 0) / gib:.1f} GiB")
PY
}
# A short training run of a config on the bench tokens, no checkpoint: name, config, micro-batch, steps, extra flags
# (TRAIN_LIMIT: its time limit in seconds, default 300).
train() {
    local name=$1 config=$2 micro=$3 steps=$4
    shift 4
    step "$name" "${TRAIN_LIMIT:-300}" "$trainer" --config "$config" --device cuda --data data/bench_tokens.bin --max-duration "$steps" \
        --set console_log_interval=1000000 --set save_folder=null --set save_interval=0 \
        --set device_train_microbatch_size="$micro" --set global_train_batch_size="$micro" \
        --metrics-file "$logs/$name.jsonl" "$@" && summarize "$logs/$name.jsonl" | tee -a "$summary"
}
# Two ranks of a tiny FULL_SHARD by_block run sharing GPU 0 over staged Gloo, each under compute-sanitizer's tool $1
# (torchrun's environment, one sanitizer process a rank); notes each rank's summary line.
sanitize_ranks() {
    local tool=$1 port=$((29500 + RANDOM % 400)) pids=() r
    for r in 0 1; do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            timeout 280 compute-sanitizer --tool "$tool" "$trainer" --config configs/tiny.json \
            --data tests/fixtures/olmo_tiny_tokens.u16 --device cuda --strategy fsdp --wrapping-strategy by_block \
            --set distributed_backend=gloo --set device_train_microbatch_size=2 --max-duration 3 \
            >"$logs/sanitize_${tool}_rank$r.log" 2>&1 &
        pids+=($!)
    done
    for r in 0 1; do
        wait "${pids[$r]}"
        note "sanitize $tool rank $r: exit $? $(grep -E "(ERROR|RACECHECK) SUMMARY" "$logs/sanitize_${tool}_rank$r.log" | tail -1)"
    done
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee -a "$summary"
bench_tokens "$trainer"

# `first` is gpu_tests, then the kernels stage; `tests` is gpu_tests, then memcheck; `multigpu` runs comm too.
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
expanded=()
for s in "${stages[@]}"; do
    case $s in
        first) expanded+=(gpu_tests kernels) ;;
        tests) expanded+=(gpu_tests memcheck) ;;
        multigpu) if ((gpus < 2)); then expanded+=(multigpu); else expanded+=(multigpu comm strategies_nccl); fi ;;
        *) expanded+=("$s") ;;
    esac
done
for s in "${expanded[@]}"; do
    case $s in
        gpu_tests)
            # Our flash attention first, in a process of its own: its wgmma kernels have never run on a GPU, and a
            # kernel that hangs there costs its own time limit, not the other cases' results.
            step gpu_tests_flash 150 "$gpu_tests" --durations yes "*flash*"
            grep -E "^test cases|^assertions|All tests passed|FAILED" "$logs/gpu_tests_flash.log" | tail -4 |
                tee -a "$summary"
            step gpu_tests 200 "$gpu_tests" --durations yes "~*flash*" "~[ranks]" "~[multigpu]"
            grep -E "^test cases|^assertions|All tests passed|FAILED" "$logs/gpu_tests.log" | tail -4 | tee -a "$summary"
            ;;
        throughput)
            TRAINER_BIN=$trainer step bench_gpu 540 bash scripts/bench_gpu.sh --shapes gpt2_124m,olmo_1b_mb4 \
                --no-fine-grained --graphs
            grep -E "^\|" "$logs/bench_gpu.log" | tee -a "$summary"
            ;;
        memcheck)
            step memcheck 240 compute-sanitizer --tool memcheck "$gpu_tests" "gpu kernel:*" "~*cuDNN*"
            grep -E "ERROR SUMMARY" "$logs/memcheck.log" | tee -a "$summary"
            ;;
        race)
            step racecheck 540 compute-sanitizer --tool racecheck "$gpu_tests" "gpu kernel:*" "~*cuDNN*" "~*1024 blocks*"
            grep -E "RACECHECK SUMMARY|^test cases" "$logs/racecheck.log" | tee -a "$summary"
            ;;
        kernels)
            for shape in "${model_shapes[@]}"; do
                read -r model micro <<<"$shape"
                # Our flash attention; cuDNN's (the default); cuDNN's with the classifier's row held in shared
                # memory (kernels.classifier_one_read), whose classifier row stands against the one before it.
                for variant in flash cudnn one_read; do
                    attention=cudnn
                    [[ $variant == flash ]] && attention=flash
                    sets=(--set kernels.attention="$attention")
                    [[ $variant == one_read ]] && sets+=(--set kernels.classifier_one_read=true)
                    # The default also writes the ops' times for `trainer plan --calibration` (the plan stage uses
                    # it when it runs in the same call; it comes back in the logs).
                    [[ $variant == cudnn ]] && sets+=(--calibration-out "$logs/calibration_$model.json")
                    step "kernels_${model}_$variant" 90 "$trainer" bench-kernels --config "configs/$model.json" \
                        --device cuda --precision amp_bf16 --set device_train_microbatch_size="$micro" \
                        --set global_train_batch_size="$micro" "${sets[@]}"
                    grep -E "^\| (attention|classifier)" "$logs/kernels_${model}_$variant.log" |
                        sed "s/^/  $model $variant /" | tee -a "$summary"
                done
            done
            ;;
        bench)
            TRAINER_BIN=$trainer step bench_gpu 570 bash scripts/bench_gpu.sh
            grep -E "^\|" "$logs/bench_gpu.log" | tee -a "$summary"
            ;;
        strategies)
            train single configs/olmo_1b.json 4 10 --precision amp_bf16
            train fsdp_full_shard configs/olmo_1b.json 4 10 --precision amp_bf16 --strategy fsdp \
                --sharding-strategy FULL_SHARD --wrapping-strategy by_block
            train fsdp_shard_grad_op configs/olmo_1b.json 4 10 --precision amp_bf16 --strategy fsdp \
                --sharding-strategy SHARD_GRAD_OP --wrapping-strategy by_block_and_size
            train fsdp_no_shard configs/olmo_1b.json 4 10 --precision amp_bf16 --strategy fsdp --sharding-strategy NO_SHARD
            train ddp configs/olmo_1b.json 4 10 --precision amp_bf16 --strategy ddp
            ;;
        ranks)
            step gpu_tests_ranks 330 "$gpu_tests" --durations yes "[ranks]"
            grep -E "^test cases|^assertions|All tests passed|FAILED" "$logs/gpu_tests_ranks.log" | tail -4 | tee -a "$summary"
            grep -E " s: gpu ranks" "$logs/gpu_tests_ranks.log" | tee -a "$summary"
            step gpu_tests_nccl_one_rank 150 "$gpu_tests" "*one-rank NCCL*,*cpu offload*"
            grep -E "^test cases|^assertions|All tests passed|FAILED" "$logs/gpu_tests_nccl_one_rank.log" | tail -4 |
                tee -a "$summary"
            for tool in memcheck racecheck synccheck; do sanitize_ranks "$tool"; done
            ;;
        multigpu)
            if ((gpus < 2)); then
                note "multigpu: $gpus GPU here; NCCL takes one GPU a rank and the [multigpu] cases need 2: not run (the ranks stage runs several ranks on one GPU over staged Gloo)"
            else
                step gpu_tests_multigpu 300 "$gpu_tests" --require-gpus 2 --durations yes "[multigpu]"
                grep -E "^test cases|^assertions|All tests passed|FAILED" "$logs/gpu_tests_multigpu.log" | tail -4 |
                    tee -a "$summary"
            fi
            ;;
        strategies_nccl)
            TRAINER_BIN=$trainer step strategies_nccl 540 bash scripts/bench_strategies.sh --config configs/olmo_1b.json \
                --steps 10 --rounds 1 --global-batch $((4 * gpus)) --micro-batch 4 --nproc "$gpus" \
                --png "$logs/strategies_nccl.png" -- --device cuda --precision amp_bf16
            grep -E "^\|" "$logs/strategies_nccl.log" | tee -a "$summary"
            ;;
        comm)
            if ((gpus < 2)); then
                note "comm: $gpus GPU here; bench-comm over NCCL needs a GPU a rank and at least 2 ranks: not run"
            else
                step bench_comm 240 "$trainer" launch --nproc-per-node "$gpus" -- bench-comm --config configs/olmo_1b.json \
                    --device cuda --calibration-out "$logs/links.json"
                grep -E "^\[rank 0\] +intra [a-z_]+: " "$logs/bench_comm.log" | tee -a "$summary"
                for links in entry measured; do
                    extra=()
                    [[ $links == measured ]] && extra=(--comm-calibration "$logs/links.json")
                    step "plan_olmo1b_${gpus}gpus_$links" 120 "$trainer" plan --config configs/olmo_1b.json --device cuda \
                        --precision amp_bf16 --nproc-per-node "$gpus" --set device_train_microbatch_size=4 \
                        --set global_train_batch_size=$((16 * gpus)) "${extra[@]}"
                    grep -E "^recommended" "$logs/plan_olmo1b_${gpus}gpus_$links.log" | sed "s/^/$links links: /" |
                        tee -a "$summary"
                done
            fi
            ;;
        storage)
            for round in 1 2; do
                train "olmo1b_bf16_$round" configs/olmo_1b.json 4 10 --precision amp_bf16
                train "olmo1b_fp32_$round" configs/olmo_1b.json 4 10 --precision amp_bf16 \
                    --set kernels.bf16_activations=false
                train "gpt2_bf16_$round" configs/gpt2_124m.json 16 10 --precision amp_bf16
                train "gpt2_fp32_$round" configs/gpt2_124m.json 16 10 --precision amp_bf16 \
                    --set kernels.bf16_activations=false
            done
            ;;
        memory)
            train olmo1b_mb8 configs/olmo_1b.json 8 6 --precision amp_bf16
            train olmo1b_mb8_whole_layer configs/olmo_1b.json 8 6 --precision amp_bf16 \
                --set activation_checkpointing=whole_layer
            # OLMo-7B with its optimizer on the host: 64 micro-batches a step, so that the host's AdamW (about
            # 3.6 s over 6.9B parameters, the plan says, the copies hidden under it) keeps the step within 1.3x
            # the compute (the target: busy fraction at least 0.77); the plan's prediction of the same run
            # first, to compare.
            offload7b=(--config configs/olmo_7b.json --set device_train_microbatch_size=2
                --set global_train_batch_size=128 --set precision=amp_bf16
                --set activation_checkpointing=whole_layer --set cpu_offload.optimizer_state=true)
            step plan_olmo7b_offload 120 "$trainer" plan "${offload7b[@]}" --device cuda --json
            python3 -c "
import json
rows = [json.loads(l) for l in open('$logs/plan_olmo7b_offload.log') if l.startswith('{')]
r = next(r for r in rows if r.get('is_config'))
print(f\"  plan: step {r['predicted_step_ms']:.0f} ms (compute {r['predicted_compute_ms']:.0f}, optimizer \"
      f\"{r['predicted_optimizer_ms']:.0f}), busy {r['predicted_compute_ms'] / r['predicted_step_ms']:.2f}\")" |
                tee -a "$summary"
            TRAIN_LIMIT=480 train olmo7b_whole_layer_offload configs/olmo_7b.json 2 3 --precision amp_bf16 \
                --set activation_checkpointing=whole_layer --set cpu_offload.optimizer_state=true \
                --set global_train_batch_size=128
            ;;
        plan)
            # Each model's step as the plan predicts it from this GPU's hardware entry, and from the ops measured
            # here where the kernels stage ran first in the same call (calibration_<model>.json), then measured.
            for shape in "${model_shapes[@]}"; do
                read -r model micro <<<"$shape"
                for how in entry calibrated; do
                    extra=()
                    if [[ $how == calibrated ]]; then
                        [[ -f $logs/calibration_$model.json ]] || continue
                        extra=(--calibration "$logs/calibration_$model.json")
                    fi
                    step "plan_${model}_$how" 60 "$trainer" plan --config "configs/$model.json" --device cuda \
                        --set precision=amp_bf16 --set device_train_microbatch_size="$micro" \
                        --set global_train_batch_size="$micro" --json "${extra[@]}"
                    python3 -c "
import json
rows = [json.loads(l) for l in open('$logs/plan_${model}_$how.log') if l.startswith('{')]
row = next(r for r in rows if r.get('is_config'))
print(f\"  $model plan ($how): {row['predicted_step_ms']:.1f} ms a step predicted\")" | tee -a "$summary"
                done
                train "plan_${model}_measured" "configs/$model.json" "$micro" 10 --precision amp_bf16
            done
            ;;
        hf)
            for name in gpt2 olmo olmo2 llama olmo2mqa; do
                fixture=tests/fixtures/${name}_tiny
                step "hf_${name}_train" 60 "$trainer" --config "$fixture.json" --init-from "${fixture}_init.safetensors" \
                    --device cpu --max-duration 2 --save-folder "$logs/hf_${name}_ck" &&
                    step "hf_${name}_export" 60 "$trainer" export --checkpoint "$logs/hf_${name}_ck/step2" \
                        -o "$logs/hf_$name" &&
                    step "hf_${name}_check" 120 python3 scripts/check_hf_export.py --config "$fixture.json" \
                        --dir "$logs/hf_$name" --data "${fixture}_tokens.u16" --trainer "$trainer" --generate 8
                tail -1 "$logs/hf_${name}_check.log" 2>/dev/null | sed "s/^/  /" | tee -a "$summary"
                rm -rf "$logs/hf_${name}_ck"
            done
            ;;
        profile)
            for shape in "${model_shapes[@]}"; do
                read -r model micro <<<"$shape"
                # flash_forward_kernel / flash_backward_kernel (mma.sync), or on Hopper the wgmma forward and the
                # backward's two launches (dK/dV, then dQ); not the backward's first kernel (flash_backward_dot_kernel).
                kernels="flash_forward flash_backward"
                [[ $(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1) == 9.0 ]] &&
                    kernels+=" flash_backward_dq"
                for kernel in $kernels; do
                    case $kernel in
                        flash_forward) pattern="flash_forward_(sm90_)?kernel" ;;
                        flash_backward) pattern="flash_backward_(dkdv_sm90_)?kernel" ;;
                        flash_backward_dq) pattern="flash_backward_dq_sm90_kernel" ;;
                    esac
                    # The clocks as the device runs them (--clock-control none: ncu would otherwise lock them to base).
                    step "ncu_${model}_$kernel" 180 ncu --clock-control none --kernel-name "regex:$pattern" \
                        --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
                        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
                        --section WarpStateStats --section SchedulerStats --print-details all \
                        "$trainer" bench-kernels --config "configs/$model.json" --device cuda --precision amp_bf16 \
                        --set kernels.attention=flash --set device_train_microbatch_size="$micro" \
                        --set global_train_batch_size="$micro" --reps 1
                    grep -E "Duration|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Shared|Stall" \
                        "$logs/ncu_${model}_$kernel.log" | sed "s/^/  $model $kernel /" | tee -a "$summary"
                done
            done
            ;;
    esac
done
note "total: $((SECONDS - t0)) s"
out=${OUT:-.}
tar czf "$out/gpu-check.tgz" -C "$logs" . && echo "logs: $out/gpu-check.tgz"
echo
cat "$summary"
rm -rf "$logs"
