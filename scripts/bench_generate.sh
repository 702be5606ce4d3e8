#!/usr/bin/env bash
# What the KV cache buys `trainer generate`: a batch of 8 prompts (32 bytes of this repository's text each)
# continued greedily by --new tokens each, with the cache and with every sequence's prefix recomputed for each new
# token (--no-kv-cache, the same kernels), alternating round after round so a slower minute of this shared machine
# touches both. Prints tokens/s of each (the median over the rounds), their ratio, and whether both wrote the
# same tokens.
#
# Model: --config (default configs/sotu_demo.json, the demo's byte-level model) with max_sequence_length widened to
# hold a prompt and its new tokens, its initial weights (speed does not depend on them; a RoPE model's weights do
# not depend on the context). Extra arguments after -- go to the trainer (--device cuda, --threads N, ...).
#
# Usage: scripts/bench_generate.sh [--config FILE] [--new N] [--rounds R] [-- TRAINER ARGS]   (TRAINER_BIN)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
config=configs/sotu_demo.json new=256 rounds=3 extra=()
while (($#)); do
    case $1 in
        --config) config=$2; shift 2 ;;
        --new) new=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, data/bench_tokens.bin, and $tmp (removed on exit)
prompts=()
for i in 0 1 2 3 4 5 6 7; do prompts+=(--prompt "$(head -c $((1000 + i * 32)) README.md | tail -c 32)"); done
args=(generate --config "$config" --set "model.max_sequence_length=$((new + 33))" --max-new-tokens "$new"
      --no-stop-at-eos --json "${prompts[@]}" "${extra[@]}")
for ((round = 0; round < rounds; round++)); do
    "$trainer" "${args[@]}" >"$tmp/cache.$round.jsonl" 2>"$tmp/cache.log" || { cat "$tmp/cache.log" >&2; exit 1; }
    "$trainer" "${args[@]}" --no-kv-cache >"$tmp/none.$round.jsonl" 2>"$tmp/none.log" ||
        { cat "$tmp/none.log" >&2; exit 1; }
done
python3 - "$tmp" "$rounds" "$new" <<'PY'
import json, statistics, sys
tmp, rounds, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(mode, r):
    lines = [json.loads(l) for l in open(f"{tmp}/{mode}.{r}.jsonl")]
    return [l["ids"] for l in lines if "ids" in l], lines[-1]
rates = {m: statistics.median(load(m, r)[1]["tokens_per_second"] for r in range(rounds)) for m in ("cache", "none")}
same = all(load("cache", r)[0] == load("none", r)[0] for r in range(rounds))
device = load("cache", 0)[1]["device"]
print(f"8 prompts x {new} new tokens, greedy, {device}, median of {rounds} round(s)\n")
print("| decoding | tokens/s | vs no cache |")
print("|---|---|---|")
print(f"| KV cache | {rates['cache']:.0f} | {rates['cache'] / rates['none']:.1f}x |")
print(f"| prefix recomputed every token | {rates['none']:.0f} | 1.0x |")
print(f"\nthe same tokens both ways: {'yes' if same else 'NO'}")
PY
