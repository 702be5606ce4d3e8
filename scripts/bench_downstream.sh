#!/usr/bin/env bash
# Downstream evaluation at the rows' own length: one multiple-choice task of --examples short examples (token ids:
# contexts of 20-40 tokens, four continuations of 2-10) scored at startup (eval_on_startup) on cpu_bench (or
# --config), once as it is (the trainer builds a model for the rows' own length, 64 tokens) and once with one long
# example added, which makes the task as long as the model's instances (the whole task then scores at
# max_sequence_length). The same binary, the same weights; prints a markdown table of the evaluation times
# (eval_time_ms of the "eval" event) and accuracies.
#
# Usage: scripts/bench_downstream.sh [--examples N] [--config FILE] [--reps R]
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
examples=200 config=configs/cpu_bench.json reps=1
while (($#)); do
    case $1 in
        --examples) examples=$2; shift 2 ;;
        --config) config=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
python3 - "$tmp" "$examples" "$config" <<'PY'
import json, random, sys
tmp, n, config = sys.argv[1], int(sys.argv[2]), json.load(open(sys.argv[3]))
vocab, L = config["model"]["vocab_size"], config["model"]["max_sequence_length"]
rng = random.Random(7)
with open(f"{tmp}/own.jsonl", "w") as own, open(f"{tmp}/full.jsonl", "w") as full:
    for _ in range(n):
        ex = {"context": [rng.randrange(vocab) for _ in range(rng.randint(20, 40))],
              "continuations": [[rng.randrange(vocab) for _ in range(rng.randint(2, 10))] for _ in range(4)],
              "label": rng.randrange(4)}
        own.write(json.dumps(ex) + "\n")
        full.write(json.dumps(ex) + "\n")
    full.write(json.dumps({"context": [1] * L, "continuations": [[2], [3]], "label": 0}) + "\n")
PY
for ((rep = 0; rep < reps; rep++)); do
    for task in own full; do
        "$trainer" --config "$config" --data data/bench_tokens.bin --max-duration 1 --threads 2 \
            --set console_log_interval=1000000 --set optimizer.learning_rate=1e-12 --set eval_on_startup=true \
            --set "evaluators=[{\"label\": \"mc\", \"type\": \"downstream\", \"data\": {\"paths\": [\"$tmp/$task.jsonl\"]}}]" \
            --metrics-file "$tmp/$task.$rep.jsonl" >"$tmp/$task.log" 2>&1 || { cat "$tmp/$task.log" >&2; exit 1; }
        grep -h "^downstream:" "$tmp/$task.log" >"$tmp/$task.line"
    done
done
python3 - "$tmp" "$reps" <<'PY'
import json, statistics, sys
tmp, reps = sys.argv[1], int(sys.argv[2])
def evals(name):
    out = []
    for rep in range(reps):
        for line in open(f"{tmp}/{name}.{rep}.jsonl"):
            j = json.loads(line)
            if j.get("event") == "eval":
                out.append(j)
    return out
own, full = evals("own"), evals("full")
ms = {k: statistics.median(r["eval_time_ms"] for r in v) for k, v in (("own", own), ("full", full))}
print(f"| task | scored | examples | acc | eval time (median of {reps}) |")
print("|---|---|---|---|---|")
for k, r in (("own", own), ("full", full)):
    line = open(f"{tmp}/{k}.line").read().strip().split("scored ", 1)[-1]
    d = r[0]["downstream"]["mc"]
    print(f"| {k} | {line} | {d['examples']} | {d['acc']:.4f} | {ms[k] / 1e3:.1f} s |")
print(f"\nat the rows' own length: {ms['full'] / ms['own']:.2f}x faster")
PY
