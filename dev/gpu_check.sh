#!/usr/bin/env bash
# The checks a lent GPU runs, from the bundle dev/gpu_bundle.sh packs here (no build, no install, no .git there):
#
#   tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh queue --budget-s 480
#   tar xzf .gpu-bundle.tgz && bash .gpu-bundle/run.sh dev/gpu_check.sh STAGE... [--budget-s N]
#
# `queue` runs the stages the bundle's manifest marks stale (their covered files changed since their last `pass`
# in docs/gpu_runs.tsv), lowest priority number first, each only where its expected seconds fit what is left of
# --budget-s (default 480), and each under a limit that keeps the call within it; a stage that does not fit is
# left for the next call. Named stages run in the order given, stale or not (--budget-s default 570). The stages,
# their priorities, expected seconds and covered files are dev/gpu_stages.tsv; dev/gpu_ledger.py runs the queue.
#
# Every stage run writes a ledger row (date, commit, card, stage, result, seconds, covered hash, note with its
# figures) to $OUT/gpu_runs.rows.tsv (the device tool's output folder; else ./), the logs and the whole output to
# $OUT/gpu-check.tgz; what ran and what was left is printed last. Here, after the call:
# python3 dev/gpu_ledger.py append FILES_AT/gpu_runs.rows.tsv, then commit the rows with the figures they gave.
#
# A device session has 15 minutes of device time, start-up included, and calls of at most 10: a first call of
# `queue --budget-s 480` and a second of the issue's own checks fit.
#
# Stages (dev/gpu_stages.tsv has each one's covered files):
#   tests           gpu_tests (our flash attention's cases first, in a process of their own), compute-sanitizer
#                   memcheck over the kernel cases (cuDNN's apart), racecheck over the KV-cache case
#   hf              transformers' logits and 8 greedy tokens on the exports of the five PyTorch fixtures (two steps
#                   trained on the CPU, `trainer export`, scripts/check_hf_export.py --generate 8); TensorBoard's
#                   reader on the event file of a 2-rank run against its metrics file (scripts/check_tensorboard.py)
#   fp8_table       PyTorch's float8_e4m3fn and float8_e5m2 codes of every bf16 value (clamped: the saturating
#                   conversion), to $OUT/fp8_bf16_table.bin: commit it as tests/fixtures/fp8_bf16_table.bin
#   generate        a demo-shape model trained 300 steps on the GPU: greedy tokens on the GPU (fp32) equal to the
#                   CPU's; scripts/bench_generate.sh with --device cuda (the KV cache against recomputing); the
#                   trainer against transformers' generate on its export (scripts/bench_generate_hf.py)
#   bench_SHAPE     scripts/bench_gpu.sh --shapes SHAPE --no-fine-grained: tokens/s, MFU and memory of the trainer
#                   against PyTorch eager and torch.compile; its note carries ratio=trainer/compile, which the
#                   queue holds to within 3% of the last pass on the same card
#   torch_parity    scripts/bench_torch_gpu.py --check-parity: the PyTorch peer's fast model against tests/torch_ref.py
#                   at step 0 (fp32, no compile) on tiny.json and the OLMo-2 and Llama-shaped fixtures
#   fp8_speed       scripts/bench_gpu.sh --fp8 on OLMo-1B micro-batch 8 and OLMo-2 1B (4 x 4096): amp_fp8's tokens/s
#                   against the trainer's amp_bf16 and PyTorch's _scaled_mm FP8 peer (the note carries each
#                   shape's ratios)
#   fp8_kernels     bench-kernels on OLMo-1B micro-batch 8 in amp_bf16 and in amp_fp8: where each step's time goes
#                   (the blocks' Linear layers with their FP8 casts, attention, the head, ...; the note carries
#                   each precision's shares), so the ceiling FP8 sets on the step is known
#   lora_peft       LoRA (r 16 on every Linear of the blocks) on the Llama-1B shape, micro-batch 4: the trainer in
#                   amp_bf16 against transformers + PEFT (scripts/bench_peft_gpu.py: bf16 base, SDPA, autocast,
#                   fused AdamW), tokens/s and peak memory of each; then QLoRA (NF4, double-quantized) against our
#                   LoRA on the same shape (bitsandbytes is not on the GPU machine)
#   kernels         trainer bench-kernels on OLMo-1B (micro-batch 4) and GPT-2 124M (16): our flash attention,
#                   cuDNN's (writing the plan's calibration), and the one-read classifier
#   plan            trainer plan from the hardware file and from that calibration (made here when `kernels` did
#                   not run in this call) against a measured run: the calibrated prediction within 5%
#   async_save      2 CUDA ranks (one GPU, staged Gloo): the background save's shard files byte-identical to the
#                   synchronous save's; compute-sanitizer memcheck on a run that saves every step; GPT-2 124M
#                   (16 x 1024) 200 steps with a checkpoint every 50 (keep 1) in the background, synchronous and
#                   none, alternating: the median step past the first save within 5% of none's
#   ranks           gpu_tests [ranks] (every strategy on 2 and 4 ranks of the GPU over staged Gloo against one
#                   process) and the one-rank NCCL cases
#   ranks_sanitize  compute-sanitizer memcheck, racecheck and synccheck on each rank of a 2-rank FULL_SHARD run
#   race_attention  racecheck over the attention, RoPE, KV-cache and shared-head cases, one process a case
#   race_other      racecheck over every other kernel case
#   strategies      OLMo-1B micro-batch 4 in amp_bf16 under single, DDP and the three FSDP modes at world size 1
#                   (mixed precision's gathered Linear weights read as bf16 words by the GEMMs: FSDP against single)
# On demand (never queued): storage, memory, profile, comm, multigpu (comm and multigpu need 2 GPUs).
#
# TRAINER_BIN and GPU_TESTS_BIN default to the bundle's binaries.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/bench_common.sh
trainer=${TRAINER_BIN:-build-portable/bin/trainer}
gpu_tests=${GPU_TESTS_BIN:-build-portable/bin/gpu_tests}
# The two models and micro-batches the kernels, plan and profile stages measure.
model_shapes=("olmo_1b 4" "gpt2_124m 16")

# ---- One stage, in a process of its own (run by dev/gpu_ledger.py queue with GPU_STAGE_RESULT and GPU_CHECK_LOGS).
logs=${GPU_CHECK_LOGS:-}
failed=() skipped=() figures=() ran=0
# The call's output goes to the console and into the logs (gpu_check.sh's tee).
note() { echo "$*"; }
# A figure for the stage's ledger note (and the output).
figure() {
    figures+=("$*")
    note "  $*"
}
# A part of the stage that cannot run here, and why.
skip_part() {
    skipped+=("$*")
    note "  not run: $*"
}
have() { command -v "$1" >/dev/null 2>&1; }
have_python() { python3 -c "import $1" >/dev/null 2>&1; }
# Runs "$@" with a time limit, its output in $logs/$name.log; notes the exit status and the seconds; a non-zero
# status fails the stage.
step() {
    local name=$1 limit=$2
    shift 2
    local s=$SECONDS
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    ((ran += 1))
    ((rc == 0)) || failed+=("$name (exit $rc)")
    note "$name: exit $rc, $((SECONDS - s)) s"
    return $rc
}
# A check that is not an exit status: fails the stage with its message when $1 is not 0.
judge() {
    local ok=$1
    shift
    ((ok == 0)) || failed+=("$*")
}
# Catch2's closing line of a log: "All tests passed (N assertions in M test cases)" or the failure counts.
cases_line() { grep -E "^test cases|All tests passed" "$logs/$1.log" | tail -1; }
# compute-sanitizer's summary line of a log.
sanitizer_line() { grep -hE "(ERROR|RACECHECK|SYNCCHECK) SUMMARY" "$@" | tail -1 | sed 's/^========= //'; }
# The last metrics record of a run: tokens/s, MFU, mean step and the device pool's and host's peaks.
summarize() {
    python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = rows[-1]
peak = s.get("peak_memory_bytes", {})
gib = 2 ** 30
busy = f", busy {s['mean_device_busy_fraction']:.2f}" if "mean_device_busy_fraction" in s else ""
print(f"{s['tokens_per_second_per_device']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}%, step {s['mean_step_time_ms']:.1f} ms{busy}, "
      f"device pool {peak.get('device_pool', 0) / gib:.1f} GiB, activations {peak.get('activations', 0) / gib:.1f} GiB, "
      f"host {peak.get('host_total', 0) / gib:.1f} GiB")
PY
}
# bench-kernels' "where a step's time goes" in one line: the step's ops' milliseconds, then each part's share.
step_parts() {
    local total
    total=$(grep -oE "each timed alone: [0-9.]+ ms" "$1" | grep -oE "[0-9.]+ ms")
    echo "step's ops $total: $(grep -E '^\| [A-Za-z, ]+ \| [0-9.]+ \| [0-9.]+% \|$' "$1" |
        awk -F' [|] ' '{sub(/ [|]$/, "", $3); printf "%s%s %s", (n++ ? "; " : ""), substr($1, 3), $3}')"
}
# A short training run of a config on the bench tokens, no checkpoint: name, config, micro-batch, steps, extra flags
# (TRAIN_LIMIT: its time limit in seconds, default 300). Its summary becomes a figure.
train() {
    local name=$1 config=$2 micro=$3 steps=$4
    shift 4
    step "$name" "${TRAIN_LIMIT:-300}" "$trainer" --config "$config" --device cuda --data data/bench_tokens.bin \
        --max-duration "$steps" --set console_log_interval=1000000 --set save_folder=null --set save_interval=0 \
        --set device_train_microbatch_size="$micro" --set global_train_batch_size="$micro" \
        --metrics-file "$logs/$name.jsonl" "$@" && figure "$name: $(summarize "$logs/$name.jsonl")"
}
# Two ranks of a tiny FULL_SHARD by_block run sharing GPU 0 over staged Gloo, each under compute-sanitizer's tool $1
# (torchrun's environment, one sanitizer process a rank).
sanitize_ranks() {
    local tool=$1 port=$((29500 + RANDOM % 400)) pids=() r rc
    for r in 0 1; do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            TRAINER_STORE_SECRET=gpu-check-sanitized-ranks \
            timeout 280 compute-sanitizer --tool "$tool" --error-exitcode 99 "$trainer" --config configs/tiny.json \
            --data tests/fixtures/olmo_tiny_tokens.u16 --device cuda --strategy fsdp --wrapping-strategy by_block \
            --set distributed_backend=gloo --set device_train_microbatch_size=2 --max-duration 3 \
            >"$logs/sanitize_${tool}_rank$r.log" 2>&1 &
        pids+=($!)
    done
    for r in 0 1; do
        wait "${pids[$r]}"
        rc=$?
        ((ran += 1))
        ((rc == 0)) || failed+=("$tool rank $r (exit $rc)")
        figure "$tool rank $r: exit $rc, $(sanitizer_line "$logs/sanitize_${tool}_rank$r.log")"
    done
}
# Joins $2... with the separator $1.
join() {
    local sep=$1 out=
    shift
    for x in "$@"; do out+=${out:+$sep}$x; done
    printf '%s' "$out"
}
# The stage's ledger result and note, for dev/gpu_ledger.py.
finish() {
    local result=pass text reasons
    text=$(join '; ' "${figures[@]}")
    if ((${#failed[@]})); then
        result=fail
        text="failed: $(join ', ' "${failed[@]}")${text:+; $text}"
    elif ((${#skipped[@]})); then
        reasons=$(join '; ' "${skipped[@]}")
        if ((ran == 0)); then
            result="skipped: $reasons"
        else
            result=partial
            text="not run: $reasons${text:+; $text}"
        fi
    fi
    [[ -n ${GPU_STAGE_RESULT:-} ]] && printf '%s\t%s\n' "$result" "${text:--}" >"$GPU_STAGE_RESULT"
    note "$stage: $result"
}

run_stage() {
    stage=$1
    note "== $stage"
    case $stage in
        tests)
            # Our flash attention first, in a process of its own: a kernel that hangs there costs its own time limit,
            # not the other cases' results.
            step gpu_tests_flash 150 "$gpu_tests" --durations yes "*flash*"
            figure "gpu_tests, flash cases: $(cases_line gpu_tests_flash)"
            step gpu_tests 240 "$gpu_tests" --durations yes "~*flash*" "~[ranks]" "~[multigpu]"
            figure "gpu_tests, the others but [ranks] and [multigpu]: $(cases_line gpu_tests)"
            if have compute-sanitizer; then
                step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 99 "$gpu_tests" "gpu kernel:*" \
                    "~*cuDNN*"
                figure "memcheck over the kernel cases (cuDNN's apart): $(sanitizer_line "$logs/memcheck.log")"
                step racecheck_kv_cache 150 compute-sanitizer --tool racecheck --error-exitcode 99 "$gpu_tests" \
                    "*KV cache*"
                figure "racecheck, the KV-cache case: $(sanitizer_line "$logs/racecheck_kv_cache.log")"
            else
                skip_part "compute-sanitizer is not installed (memcheck, racecheck)"
            fi
            ;;
        hf)
            if have_python transformers; then
                for name in gpt2 olmo olmo2 llama olmo2mqa; do
                    fixture=tests/fixtures/${name}_tiny
                    step "hf_${name}_train" 60 "$trainer" --config "$fixture.json" \
                        --init-from "${fixture}_init.safetensors" --device cpu --max-duration 2 \
                        --save-folder "$logs/hf_${name}_ck" &&
                        step "hf_${name}_export" 60 "$trainer" export --checkpoint "$logs/hf_${name}_ck/step2" \
                            -o "$logs/hf_$name" &&
                        step "hf_${name}_check" 120 python3 scripts/check_hf_export.py --config "$fixture.json" \
                            --dir "$logs/hf_$name" --data "${fixture}_tokens.u16" --trainer "$trainer" --generate 8
                    figure "$name: $(python3 -c "
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().split('\n')[-1])
print(f\"{r.get('architecture')}: max logit difference {r.get('max_abs_logit_difference', float('nan')):.2e}, \"
      f\"greedy tokens equal {r.get('greedy_tokens_equal')}\")" "$logs/hf_${name}_check.log" 2>/dev/null || echo 'no result')"
                    rm -rf "$logs/hf_${name}_ck"
                    # LoRA's adapter as PEFT loads it: 2 steps of LoRA on every module of the fixture's LoRA targets
                    # from that export, exported with --adapter; peft's model on the export and the trainer's
                    # (lora.init_from the same adapter) give the same logits.
                    if [[ ($name == llama || $name == gpt2) && -d "$logs/hf_$name" ]] && have_python peft; then
                        targets=$(python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['targets']))" \
                            "${fixture}_lora_expected.json")
                        step "peft_${name}_train" 60 "$trainer" --config "$fixture.json" --init-from "$logs/hf_$name" \
                            --device cpu --max-duration 2 --set lora.enabled=true --set lora.r=4 --set lora.alpha=6 \
                            --set "lora.targets=$targets" --set optimizer.learning_rate=0.05 \
                            --save-folder "$logs/peft_${name}_ck" &&
                            step "peft_${name}_export" 60 "$trainer" export --checkpoint "$logs/peft_${name}_ck/step2" \
                                --adapter -o "$logs/peft_${name}_adapter" &&
                            step "peft_${name}_check" 120 python3 scripts/check_hf_export.py --config "$fixture.json" \
                                --dir "$logs/hf_$name" --adapter "$logs/peft_${name}_adapter" \
                                --data "${fixture}_tokens.u16" --trainer "$trainer"
                        figure "$name + PEFT adapter: $(python3 -c "
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().split('\n')[-1])
print(f\"{r.get('architecture')} with peft's adapter: max logit difference {r.get('max_abs_logit_difference', float('nan')):.2e}, \"
      f\"out of tolerance {r.get('logits_out_of_tolerance')}\")" "$logs/peft_${name}_check.log" 2>/dev/null || echo 'no result')"
                        rm -rf "$logs/peft_${name}_ck"
                    elif [[ $name == llama ]] && ! have_python peft; then
                        skip_part "peft is not installed (loading the exported LoRA adapters)"
                    fi
                done
            else
                skip_part "transformers is not installed (the exports' logits and greedy tokens)"
            fi
            # The same check as the CPU suite's, which skips there: Debian has no tensorboard package.
            if have_python tensorboard; then
                step hf_tensorboard 240 bash tests/tensorboard_check.sh "$trainer"
                figure "TensorBoard's reader on a 2-rank run: $(tail -1 "$logs/hf_tensorboard.log")"
            else
                skip_part "the tensorboard package is not installed (the event file's check)"
            fi
            ;;
        fp8_table)
            # PyTorch's own float8 conversions of every bf16 value, the reference tests/test_fp8.cpp holds kernels/element.h
            # to: written to the output folder, committed as tests/fixtures/fp8_bf16_table.bin.
            if have_python torch; then
                step fp8_table 120 python3 scripts/make_fp8_table.py -o "${OUT:-.}/fp8_bf16_table.bin" --device cuda &&
                    figure "$(tail -1 "$logs/fp8_table.log")"
            else
                skip_part "PyTorch is not installed (the fp8 conversion table)"
            fi
            ;;
        generate)
            # A model of the demo's shape trained on the GPU (the demo's text is not on the GPU machine: the bench
            # tokens are bytes of this repository, the demo's tokenizer is bytes too).
            ck=$logs/generate_ck
            demo=(--config configs/sotu_demo.json --set evaluators=[] --set eval_interval=0 --set eval_on_startup=false --set save_interval=0 --save-folder "$ck")
            if step generate_train 240 "$trainer" "${demo[@]}" --device cuda --data data/bench_tokens.bin \
                --max-duration 300 --set metrics_file=null --set console_log_interval=100; then
                figure "demo shape, 300 steps on the GPU:$(grep -E "^done:" "$logs/generate_train.log" | cut -d'|' -f2)"
                for device in cpu cuda; do
                    step "generate_greedy_$device" 120 "$trainer" generate "${demo[@]}" --load-path latest \
                        --device "$device" --precision fp32 --prompt "The state of the Union is " \
                        --max-new-tokens 96 --json
                done
                python3 - "$logs/generate_greedy_cpu.log" "$logs/generate_greedy_cuda.log" >"$logs/generate_greedy.txt" <<'PY'
import json, sys
ids = [[json.loads(l)["ids"] for l in open(p) if l.startswith("{") and '"ids"' in l] for p in sys.argv[1:]]
same = bool(ids[0]) and ids[0] == ids[1]
print(f"greedy tokens on the GPU equal to the CPU's: {same} ({len(ids[0][0]) if ids[0] else 0} tokens)")
sys.exit(0 if same else 1)
PY
                judge $? "the GPU's greedy tokens differ from the CPU's"
                figure "$(cat "$logs/generate_greedy.txt")"
                TRAINER_BIN=$trainer step generate_bench 240 bash scripts/bench_generate.sh --rounds 2 -- --device cuda
                figure "bench_generate.sh on the GPU (8 x 256 tokens): $(awk -F'|' '/^\| KV cache/ {k = $3} /^\| prefix/ {p = $3}
                    END {gsub(/ /, "", k); gsub(/ /, "", p); print "KV cache " k " tokens/s, prefix recomputed " p}' \
                    "$logs/generate_bench.log")"
                grep -q "the same tokens both ways: yes" "$logs/generate_bench.log"
                judge $? "bench_generate.sh: the KV cache and the recomputed prefix wrote different tokens"
                if have_python transformers; then
                    last=$(ls -d "$ck"/step* | sort -V | tail -1)
                    step generate_export 60 "$trainer" export --checkpoint "$last" -o "$logs/generate_hf" &&
                        step generate_hf 300 python3 scripts/bench_generate_hf.py --config configs/sotu_demo.json \
                            --dir "$logs/generate_hf" --data data/bench_tokens.bin --trainer "$trainer"
                    figure "against transformers: $(tail -1 "$logs/generate_hf.log" 2>/dev/null)"
                else
                    skip_part "transformers is not installed (its generate beside the trainer's)"
                fi
            fi
            rm -rf "$ck"
            ;;
        torch_parity)
            if have_python torch; then
                for config in configs/tiny.json tests/fixtures/olmo2_tiny.json tests/fixtures/llama_tiny.json; do
                    [[ -f $config ]] || continue
                    step "torch_parity_$(basename "$config" .json)" 60 python3 scripts/bench_torch_gpu.py \
                        --config "$config" --micro-batch 2 --check-parity &&
                        figure "$(basename "$config"): $(tail -1 "$logs/torch_parity_$(basename "$config" .json).log")"
                done
            else
                skip_part "PyTorch is not installed (the peer's parity)"
            fi
            ;;
        fp8_speed)
            TRAINER_BIN=$trainer step fp8_speed 480 bash scripts/bench_gpu.sh --shapes olmo_1b_mb8,olmo2_1b_mb4 \
                --no-fine-grained --fp8
            grep -E "^\|" "$logs/fp8_speed.log"
            while read -r line; do figure "$(echo "$line" | tr -s ' ')"; done < <(
                grep -E "^\| (olmo_1b_mb8|olmo2_1b_mb4) \| [0-9,]+ \| " "$logs/fp8_speed.log" | awk -F'|' 'NF == 8')
            ;;
        fp8_kernels)
            for precision in amp_bf16 amp_fp8; do
                step "kernels_olmo_1b_mb8_$precision" 200 "$trainer" bench-kernels --config configs/olmo_1b.json \
                    --device cuda --precision "$precision" --set device_train_microbatch_size=8 \
                    --set global_train_batch_size=8 || continue
                log=$logs/kernels_olmo_1b_mb8_$precision.log
                grep -E "^\| (matmul|attention|classifier)" "$log" | head -16
                figure "$precision: $(step_parts "$log")"
            done
            ;;
        bench_*)
            shape=${stage#bench_}
            TRAINER_BIN=$trainer step "$stage" 540 bash scripts/bench_gpu.sh --shapes "$shape" --no-fine-grained
            grep -E "^\|" "$logs/$stage.log"
            row=$(grep -E "^\| $shape \|" "$logs/$stage.log" | head -1)
            if [[ -n $row ]]; then
                IFS='|' read -r _ _ ours eager compile ratio mfu _ gib _ <<<"$row"
                figure "$(echo "tokens/s $ours, eager $eager, torch.compile $compile, MFU $mfu, $gib GiB" | tr -s ' ')"
                ratio=$(echo "$ratio" | tr -d ' ')
                [[ $ratio =~ ^[0-9.]+$ ]] && figures+=("ratio=$ratio (trainer / torch.compile)")
            fi
            ;;
        lora_peft)
            lora=(--precision amp_bf16 --set lora.enabled=true --set lora.r=16 --set lora.alpha=32 --set
                'lora.targets=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]')
            train lora_llama_1b configs/llama_1b.json 4 20 "${lora[@]}"
            if have_python peft && have_python transformers; then
                step peft_llama_1b 300 python3 scripts/bench_peft_gpu.py --config configs/llama_1b.json \
                    --micro-batch 4 --steps 10 --warmup 3 --r 16 --alpha 32 &&
                    figure "peft: $(tail -1 "$logs/peft_llama_1b.log")"
            else
                skip_part "peft or transformers is not installed"
            fi
            train qlora_llama_1b configs/llama_1b.json 4 20 "${lora[@]}" --set lora.quantize=nf4 \
                --set lora.double_quant=true
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
                    # The default also writes the ops' times for `trainer plan --calibration`.
                    [[ $variant == cudnn ]] && sets+=(--calibration-out "$logs/calibration_$model.json")
                    step "kernels_${model}_$variant" 120 "$trainer" bench-kernels --config "configs/$model.json" \
                        --device cuda --precision amp_bf16 --set device_train_microbatch_size="$micro" \
                        --set global_train_batch_size="$micro" "${sets[@]}"
                    while read -r line; do figure "$model $variant $(echo "$line" | tr -s ' ')"; done < <(
                        grep -E "^\| (attention|classifier)" "$logs/kernels_${model}_$variant.log")
                done
            done
            ;;
        plan)
            for shape in "${model_shapes[@]}"; do
                read -r model micro <<<"$shape"
                if [[ ! -f $logs/calibration_$model.json ]]; then
                    step "plan_${model}_calibrate" 120 "$trainer" bench-kernels --config "configs/$model.json" \
                        --device cuda --precision amp_bf16 --set device_train_microbatch_size="$micro" \
                        --set global_train_batch_size="$micro" --calibration-out "$logs/calibration_$model.json"
                fi
                for how in entry calibrated; do
                    extra=()
                    [[ $how == calibrated ]] && extra=(--calibration "$logs/calibration_$model.json")
                    step "plan_${model}_$how" 60 "$trainer" plan --config "configs/$model.json" --device cuda \
                        --set precision=amp_bf16 --set device_train_microbatch_size="$micro" \
                        --set global_train_batch_size="$micro" --json "${extra[@]}"
                done
                train "plan_${model}_measured" "configs/$model.json" "$micro" 10 --precision amp_bf16
                python3 - "$logs" "$model" >"$logs/plan_${model}.txt" <<'PY'
import json, sys
logs, model = sys.argv[1:]
def predicted(how):
    rows = [json.loads(l) for l in open(f"{logs}/plan_{model}_{how}.log") if l.startswith("{")]
    return next(r for r in rows if r.get("is_config"))["predicted_step_ms"]
measured = [json.loads(l) for l in open(f"{logs}/plan_{model}_measured.jsonl") if l.strip()][-1]["mean_step_time_ms"]
entry, calibrated = predicted("entry"), predicted("calibrated")
err = calibrated / measured - 1
print(f"{model}: predicted {entry:.1f} ms (hardware file), {calibrated:.1f} ms (calibrated), measured {measured:.1f} ms: "
      f"calibrated {100 * err:+.1f}%")
sys.exit(0 if abs(err) <= 0.05 else 1)
PY
                judge $? "$model: the calibrated plan is more than 5% from the measured step"
                figure "$(cat "$logs/plan_${model}.txt")"
            done
            ;;
        async_save)
            # The files of a background save from CUDA ranks (the pinned snapshot) against the synchronous save's.
            for mode in async sync; do
                step "async_save_files_$mode" 180 "$trainer" launch --nproc-per-node 2 -- --config configs/tiny.json \
                    --data tests/fixtures/olmo_tiny_tokens.u16 --device cuda --set distributed_backend=gloo \
                    --strategy fsdp --max-duration 8 --save-folder "$logs/ck_$mode" --set save_interval=2 \
                    --set "save_async=$([[ $mode == async ]] && echo true || echo false)" --set console_log_interval=100
            done
            python3 - "$logs/ck_async" "$logs/ck_sync" >"$logs/async_save_files.txt" <<'PY'
import json, os, sys
a, s = sys.argv[1:]
steps = sorted(d for d in os.listdir(s) if d.startswith("step") and d[4:].isdigit())
bad = []
for d in steps:
    for f in ("rank0.bin", "rank1.bin"):
        if open(f"{a}/{d}/{f}", "rb").read() != open(f"{s}/{d}/{f}", "rb").read():
            bad.append(f"{d}/{f}")
    ma, ms = (json.load(open(f"{x}/{d}/metadata.json")) for x in (a, s))
    if ma["files"] != ms["files"] or ma["units"] != ms["units"]:
        bad.append(f"{d}/metadata.json")
print(f"background save from CUDA ranks: {len(steps)} checkpoints, shard files byte-identical to the synchronous "
      f"save's: {not bad and bool(steps)}" + (f" (differ: {', '.join(bad)})" if bad else ""))
sys.exit(0 if steps and not bad else 1)
PY
            judge $? "the background save's files differ from the synchronous save's"
            figure "$(cat "$logs/async_save_files.txt")"
            rm -rf "$logs/ck_async" "$logs/ck_sync"
            if have compute-sanitizer; then
                step async_save_memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 99 "$trainer" \
                    --config configs/tiny.json --data tests/fixtures/olmo_tiny_tokens.u16 --device cuda \
                    --max-duration 4 --save-folder "$logs/ck_sanitize" --set save_interval=1 --set save_async=true
                figure "memcheck, a save every step: $(sanitizer_line "$logs/async_save_memcheck.log")"
                rm -rf "$logs/ck_sanitize"
            else
                skip_part "compute-sanitizer is not installed"
            fi
            # GPT-2 124M, 16 x 1024 (a 1.5 GB state): 200 steps with a checkpoint every 50, kept to one, in the
            # background and synchronously, against none; alternating, two rounds.
            for round in 1 2; do
                for mode in none async sync; do
                    sets=(--set save_folder=null --set save_interval=0)
                    [[ $mode != none ]] && sets=(--save-folder "$logs/ck_gpt2" --set save_interval=50
                        --set save_num_checkpoints_to_keep=1 --set save_overwrite=true
                        --set "save_async=$([[ $mode == async ]] && echo true || echo false)")
                    rm -rf "$logs/ck_gpt2"
                    step "async_save_gpt2_${mode}_$round" 150 "$trainer" --config configs/gpt2_124m.json --device cuda \
                        --precision amp_bf16 --data data/bench_tokens.bin --max-duration 200 \
                        --set console_log_interval=1000000 --set device_train_microbatch_size=16 \
                        --set global_train_batch_size=16 --metrics-file "$logs/async_save_gpt2_${mode}_$round.jsonl" \
                        "${sets[@]}"
                done
            done
            rm -rf "$logs/ck_gpt2"
            python3 - "$logs" >"$logs/async_save_gpt2.txt" <<'PY'
import glob, json, statistics, sys
logs = sys.argv[1]
def steps(mode):
    # Every step after the first save's (step 50), with what a save held it up.
    t = []
    for path in glob.glob(f"{logs}/async_save_gpt2_{mode}_*.jsonl"):
        for line in open(path):
            r = json.loads(line)
            if "event" not in r and "step_time_ms" in r and r["step"] > 50:
                t.append(r["step_time_ms"] + r.get("save_ms", 0.0))
    return t
none, bg, sync = steps("none"), steps("async"), steps("sync")
if not (none and bg and sync):
    sys.exit("GPT-2 124M: no step past the first save was recorded in every mode (the runs above failed)")
med = statistics.median
over = med(bg) / med(none) - 1
print(f"GPT-2 124M 16x1024, a checkpoint every 50 of 200 steps: median step past the first save {med(none):.1f} ms none, "
      f"{med(bg):.1f} background ({100 * over:+.1f}%), {med(sync):.1f} synchronous; means {statistics.mean(none):.1f}, "
      f"{statistics.mean(bg):.1f}, {statistics.mean(sync):.1f} ms")
sys.exit(0 if over <= 0.05 else 1)
PY
            judge $? "the background save's median step is more than 5% above none's"
            figure "$(cat "$logs/async_save_gpt2.txt")"
            ;;
        ranks)
            step gpu_tests_ranks 330 "$gpu_tests" --durations yes "[ranks]"
            figure "[ranks]: $(cases_line gpu_tests_ranks)"
            step gpu_tests_nccl_one_rank 150 "$gpu_tests" "*one-rank NCCL*,*cpu offload*"
            figure "one-rank NCCL and offload: $(cases_line gpu_tests_nccl_one_rank)"
            ;;
        ranks_sanitize)
            if have compute-sanitizer; then
                for tool in memcheck racecheck synccheck; do sanitize_ranks "$tool"; done
            else
                skip_part "compute-sanitizer is not installed"
            fi
            ;;
        race_attention)
            if have compute-sanitizer; then
                # One process a case: Catch2's alternatives and exclusions do not combine in one test spec.
                n=0
                for case in "gpu kernel: native attention*" "gpu kernel: rope at positions*" \
                    "gpu kernel: shared key/value heads*" "gpu kernel: rope_forward and rope_backward*" \
                    "gpu kernel: our flash attention forward and backward*" "gpu kernel: Hopper's wgmma*"; do
                    n=$((n + 1))
                    step "racecheck_attention_$n" 300 compute-sanitizer --tool racecheck --error-exitcode 99 \
                        "$gpu_tests" "$case"
                    figure "racecheck ${case#gpu kernel: }: $(sanitizer_line "$logs/racecheck_attention_$n.log")"
                done
            else
                skip_part "compute-sanitizer is not installed"
            fi
            ;;
        race_other)
            if have compute-sanitizer; then
                step racecheck_other 400 compute-sanitizer --tool racecheck --error-exitcode 99 "$gpu_tests" \
                    "gpu kernel:*" "~*attention*" "~*KV cache*" "~*key/value heads*" "~*rope*" "~*wgmma*"
                figure "racecheck over the other kernel cases: $(cases_line racecheck_other); $(sanitizer_line \
                    "$logs/racecheck_other.log")"
            else
                skip_part "compute-sanitizer is not installed"
            fi
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
            # the compute (the target: busy fraction at least 0.77); the plan's prediction of the same run first.
            offload7b=(--config configs/olmo_7b.json --set device_train_microbatch_size=2
                --set global_train_batch_size=128 --set precision=amp_bf16
                --set activation_checkpointing=whole_layer --set cpu_offload.optimizer_state=true)
            step plan_olmo7b_offload 120 "$trainer" plan "${offload7b[@]}" --device cuda --json &&
                figure "$(python3 -c "
import json
rows = [json.loads(l) for l in open('$logs/plan_olmo7b_offload.log') if l.startswith('{')]
r = next(r for r in rows if r.get('is_config'))
print(f\"OLMo-7B offload plan: step {r['predicted_step_ms']:.0f} ms (compute {r['predicted_compute_ms']:.0f}, optimizer \"
      f\"{r['predicted_optimizer_ms']:.0f}), busy {r['predicted_compute_ms'] / r['predicted_step_ms']:.2f}\")")"
            TRAIN_LIMIT=480 train olmo7b_whole_layer_offload configs/olmo_7b.json 2 3 --precision amp_bf16 \
                --set activation_checkpointing=whole_layer --set cpu_offload.optimizer_state=true \
                --set global_train_batch_size=128
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
                        "$logs/ncu_${model}_$kernel.log" | sed "s/^/  $model $kernel /"
                done
            done
            ;;
        comm | multigpu)
            gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
            if ((gpus < 2)); then
                skip_part "$gpus GPU here: NCCL takes one GPU a rank and this stage needs 2 or more"
            else
                if [[ $stage == multigpu ]]; then
                    step gpu_tests_multigpu 300 "$gpu_tests" --require-gpus 2 --durations yes "[multigpu]"
                    figure "[multigpu]: $(cases_line gpu_tests_multigpu)"
                    TRAINER_BIN=$trainer step strategies_nccl 540 bash scripts/bench_strategies.sh \
                        --config configs/olmo_1b.json --steps 10 --rounds 1 --global-batch $((4 * gpus)) --micro-batch 4 \
                        --nproc "$gpus" --png "$logs/strategies_nccl.png" -- --device cuda --precision amp_bf16
                    grep -E "^\|" "$logs/strategies_nccl.log"
                fi
                step bench_comm 240 "$trainer" launch --nproc-per-node "$gpus" -- bench-comm --config configs/olmo_1b.json \
                    --device cuda --calibration-out "$logs/links.json"
                while read -r line; do figure "$line"; done < <(
                    grep -E "^\[rank 0\] +intra [a-z_]+: " "$logs/bench_comm.log")
                for links in entry measured; do
                    extra=()
                    [[ $links == measured ]] && extra=(--comm-calibration "$logs/links.json")
                    step "plan_olmo1b_${gpus}gpus_$links" 120 "$trainer" plan --config configs/olmo_1b.json --device cuda \
                        --precision amp_bf16 --nproc-per-node "$gpus" --set device_train_microbatch_size=4 \
                        --set global_train_batch_size=$((16 * gpus)) "${extra[@]}" &&
                        figure "$links links: $(grep -E "^recommended" "$logs/plan_olmo1b_${gpus}gpus_$links.log")"
                done
            fi
            ;;
        *)
            failed+=("unknown stage $stage")
            ;;
    esac
    finish
}

if [[ ${1:-} == --run-stage ]]; then
    [[ -n $logs && -d $logs ]] || { echo "error: --run-stage is run by dev/gpu_ledger.py queue (GPU_CHECK_LOGS)" >&2; exit 2; }
    run_stage "$2"
    exit 0
fi

# ---- The call: parse, check the machine, and hand the stages to dev/gpu_ledger.py queue.
usage="usage: dev/gpu_check.sh queue [--budget-s N] | STAGE... [--budget-s N] (stages: dev/gpu_stages.tsv)"
queue=0 budget='' named=()
while (($#)); do
    case $1 in
        queue) queue=1; shift ;;
        --budget-s)
            [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "error: --budget-s ${2:-}: expected whole seconds" >&2; exit 2; }
            budget=$2
            shift 2
            ;;
        -h | --help) echo "$usage"; exit 0 ;;
        -*) echo "error: unknown option $1; $usage" >&2; exit 2 ;;
        *) named+=("$1"); shift ;;
    esac
done
if ((queue && ${#named[@]})) || ((!queue && !${#named[@]})); then
    echo "error: name stages or say queue, not both; $usage" >&2
    exit 2
fi
manifest=.gpu-bundle/manifest.json
[[ -f $manifest ]] || { echo "error: $manifest is missing: pack the bundle with dev/gpu_bundle.sh" >&2; exit 1; }
for bin in "$trainer" "$gpu_tests"; do
    [[ -x $bin ]] || { echo "error: $bin is not built (dev/gpu_bundle.sh, or set TRAINER_BIN / GPU_TESTS_BIN)" >&2; exit 1; }
done
have nvidia-smi && card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) && [[ -n $card ]] || {
    echo "error: no GPU here (nvidia-smi lists none): run this on the lent GPU machine" >&2
    exit 1
}
logs=$(mktemp -d)
export GPU_CHECK_LOGS=$logs
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$logs/output.txt"
bench_tokens "$trainer"
out=${OUT:-.}
args=(--manifest "$manifest" --card "$card" --rows "$out/gpu_runs.rows.tsv")
# The budget counts from this script's start: the token file and the checks above come out of it.
budget=$((${budget:-$((queue ? 480 : 570))} - SECONDS))
args+=(--budget-s "$budget")
((queue)) || args+=(--stages "$(IFS=,; echo "${named[*]}")")
python3 dev/gpu_ledger.py queue "${args[@]}" -- bash dev/gpu_check.sh --run-stage 2>&1 | tee -a "$logs/output.txt"
rc=${PIPESTATUS[0]}
tar czf "$out/gpu-check.tgz" -C "$logs" . && echo "logs: $out/gpu-check.tgz (output.txt: all of the above)"
rm -rf "$logs"
exit "$rc"
