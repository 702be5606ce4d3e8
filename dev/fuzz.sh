#!/usr/bin/env bash
# Fuzzing (libFuzzer with address and undefined-behaviour sanitizers, Debian's clang): builds tests/fuzz
# into build-fuzz/ and runs each target for SECONDS (default 30), two at a time, from seed inputs:
#   config_json      the JSON config reader, --set and validation  seeds: configs/*.json, a deep nesting,
#                                                                      --set lines
#   config_yaml      OLMo's YAML configs                           seeds: tests/fixtures/olmo_1b_style.yaml,
#                                                                      aliases and interpolations that repeat
#   safetensors      the safetensors reader                        seeds: a small file written here
#   token_file       raw / .npy / llm.c token files                seeds: tests/fixtures/*_tokens.u16, small
#                                                                      .npy and llm.c files written here
#   checkpoint_meta  a checkpoint's metadata.json structure        seeds: a metadata.json, one deeply nested
#   bpe              the gpt2, cl100k and dolma2 tokenizers         seeds: tests/fixtures/tokenizer_stress.txt,
#                                                                      long runs
#   store            the rendezvous store's wire protocol, from a    seeds: each request, well formed, and
#                    stranger and from a client past the handshake     lengths past their bounds
#   downstream       a downstream task's JSONL, laid out and scored  seeds: text, ids and both, both forms,
#                                                                      unconditioned contexts, a long context
#   instruct         prepare-data's chat and Alpaca records, a chat  seeds: both record kinds, a template
#                    template file, the layouts one a row and packed   file with a long turn
#   calibration      the plan's op-time and link calibration files    seeds: one of each, as bench-kernels and
#                                                                      bench-comm write them
# The targets expand runs (tests/fuzz/fuzz_common.h: 0xF5, a count, a byte) so a mutated count reaches
# nesting 65,535 deep or a 65 KB run of one letter, and dump every document they accept (a string that is
# not UTF-8, or nesting deep enough to exhaust the stack, fails there). A crash, a sanitizer report, a
# timeout (10 s an input), more than 1 GiB of memory (-rss_limit_mb: the bound every reader must hold on
# any input), or an exception other than the trainer's UserError fails the target; its log and the input
# that did it (build-fuzz/crash-*) are printed. Exit status 1 if any failed.
# Usage: dev/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(config_json config_yaml safetensors token_file checkpoint_meta bpe store downstream instruct calibration)
bash scripts/install_deps.sh
bash scripts/fetch_tokenizers.sh
cmake -S tests/fuzz -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build build-fuzz -j "$(nproc)" >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Seed inputs, one folder per target (libFuzzer reads folders; it writes what it finds into the first).
for t in "${targets[@]}"; do mkdir -p "$tmp/seed_$t" "$tmp/work_$t"; done
[[ -d $tmp/seed_config_json ]] && cp configs/*.json "$tmp/seed_config_json/"
[[ -d $tmp/seed_config_yaml ]] && cp tests/fixtures/olmo_1b_style.yaml "$tmp/seed_config_yaml/"
[[ -d $tmp/seed_bpe ]] && cp tests/fixtures/tokenizer_stress.txt "$tmp/seed_bpe/"
[[ -d $tmp/seed_token_file ]] && cp tests/fixtures/*_tokens.u16 "$tmp/seed_token_file/"
python3 - "$tmp" <<'PY'
import json, os, struct, sys
tmp = sys.argv[1]
def put(target, name, data):
    if os.path.isdir(f"{tmp}/seed_{target}"):
        open(f"{tmp}/seed_{target}/{name}", "wb").write(data)
# safetensors: two small tensors, the header padded to 8 bytes as the reference writer pads it
header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
          "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}
h = json.dumps(header).encode()
h += b" " * ((8 - len(h) % 8) % 8)
put("safetensors", "small.safetensors", struct.pack("<Q", len(h)) + h + bytes(range(22)))
# token files: .npy (uint16 and uint32) and an llm.c shard
def npy(descr, values):
    d = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({len(values)},), }}"
    d += " " * ((64 - (10 + len(d) + 1) % 64) % 64) + "\n"
    fmt = "<" + ("H" if descr == "<u2" else "I") * len(values)
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(d)) + d.encode() + struct.pack(fmt, *values)
put("token_file", "u2.npy", npy("<u2", list(range(40))))
put("token_file", "u4.npy", npy("<u4", list(range(100000, 100040))))
put("token_file", "llmc.bin", struct.pack("<256i", 20240520, 1, 40, *([0] * 253)) + struct.pack("<40H", *range(40)))
# a checkpoint's metadata.json
config = json.load(open("configs/tiny.json"))
meta = {"format": "trainer-checkpoint", "version": 2, "step": 3, "world_size": 2,
        "units": [{"name": "wte", "numel": 8, "pieces": [[0, 0, 4, 0], [1, 4, 8, 0]]},
                  {"name": "blocks.0", "numel": 4, "pieces": [[0, 0, 4, 48]]}],
        "data": {"global_train_batch_size": 8, "instances_consumed": 24, "seed": 1, "shuffle": True},
        "rng": {"seed": 1}, "config": config,
        "files": {"rank0.bin": {"bytes": 96, "checksum": "0123456789abcdef"},
                  "rank1.bin": {"bytes": 48, "checksum": "fedcba9876543210"}}}
put("checkpoint_meta", "metadata.json", json.dumps(meta, indent=2).encode())
# Inputs that use the run expansion of tests/fuzz/fuzz_common.h (0xF5, count, byte: the byte 257 * count
# times), so that mutating a count reaches the deep nesting and long runs no small input holds.
def run(count, byte):
    return b"\xf5" + bytes([count]) + byte
put("config_json", "deep.json", b'{"run_name": ' + run(1, b"[") + run(1, b"]") + b"}")
put("config_json", "set.txt", b"--set run_name=fuzz\n--set data.paths=[\"a\", \"b\"]\n--set seed=3")
put("checkpoint_meta", "deep.json", json.dumps(meta).encode()[:-1] + b', "extra": ' + run(1, b"[") + run(1, b"]") + b"}")
put("config_yaml", "aliases.yaml", b"a0: &a0 [x, x, x]\na1: &a1 [*a0, *a0, *a0]\na2: &a2 [*a1, *a1, *a1]\n"
    b"b0: xx\nb1: ${b0}${b0}\nb2: ${b1}${b1}\n")
put("bpe", "run.txt", b"The " + run(4, b"a") + b" end " + run(2, b","))
# downstream tasks (core/data/downstream.h): the first byte odd gives the target a tokenizer for text
put("downstream", "text.jsonl", b'{"context": "The cat", "continuations": [" sat", " flew"], "label": 0, '
    b'"unconditioned_context": "Answer:"}\n{"contexts": ["a b", "c d"], "continuation": " e", "label": 1}\n')
put("downstream", "ids.jsonl", b'\n{"context": [1, 2], "continuations": [[3], {"ids": [4, 5], "text": " x"}], "label": 1, '
    b'"unconditioned_contexts": [[9], [8]]}\n')
put("downstream", "long.jsonl", b'{"context": "' + run(1, b"a") + b'", "continuations": ["' + run(0, b"b")
    + b'", "c"], "label": 0}\n')
# instruction records (core/data/instruct.h); the first byte odd: the first line is a chat template
put("instruct", "chat.jsonl", b'\n{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": '
    b'"Hi"}, {"role": "assistant", "content": "Hello"}]}\n{"instruction": "Add", "input": "1 2", "output": "3"}\n')
put("instruct", "template.jsonl", b'{"system": {"prefix": "S:", "suffix": "\\n"}, "user": {"prefix": "U:", "suffix": "\\n"}, '
    b'"assistant": {"prefix": "A:", "suffix": "\\n", "suffix_if_last": "", "eos": true}}\n'
    b'{"messages": [{"role": "user", "content": "' + run(1, b"q") + b'"}, {"role": "assistant", "content": "ok"}]}\n')
# calibrations (core/plan/calibration.h); the first byte odd ("{"): a comm calibration, else (" {") op times
put("calibration", "ops.json", b" " + json.dumps({"format": "trainer-calibration", "bandwidth": 1e10, "peak_flops": 1e12,
    "threads": 2, "ranks_per_node": 1, "cores": 2, "ops": [{"op": "matmul_forward", "flops": 1e9, "bytes": 1e6,
    "seconds": 0.001}]}).encode())
put("calibration", "links.json", json.dumps({"format": "trainer-comm-calibration", "world_size": 2,
    "nnodes": 1, "collectives": "gloo", "links": {"intra": {"all_reduce": {"bandwidth_gbs": 1.5, "latency_us": 30},
    "all_gather": {"bandwidth_gbs": 2, "latency_us": 20}}}}).encode())
# the store's requests (tcp_store.cpp's wire format); the first byte: odd, sent after the handshake
def s(b):
    return struct.pack("<I", len(b)) + b
put("store", "set_get.bin", b"\x01S" + s(b"k") + s(b"v") + b"G" + s(b"k") + struct.pack("<Q", 0))
put("store", "check_wait.bin", b"\x01C" + struct.pack("<I", 2) + s(b"k") + s(b"x") + b"W" + struct.pack("<I", 1) + s(b"k")
    + struct.pack("<Q", 10))
put("store", "huge.bin", b"\x01S" + struct.pack("<I", 0xFFFFFFFF))
put("store", "stranger.bin", b"\x00S" + s(b"k") + s(b"v"))
PY

failed=()
run() {
    local t=$1
    (cd build-fuzz && TRAINER_TOKENIZERS=$PWD/../data/tokenizers ./"fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -print_final_stats=1 \
        "$tmp/work_$t" "$tmp/seed_$t" >"$tmp/$t.log" 2>&1)
}
report() {
    local t=$1 rc=$2
    local runs
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$tmp/$t.log" | grep -o '[0-9]*$' || echo "?")
    if ((rc == 0)); then
        echo "fuzz_$t: $runs inputs in ${seconds} s, no finding"
    else
        echo "fuzz_$t: FAILED (exit $rc); the end of its log:"
        tail -n 40 "$tmp/$t.log"
        failed+=("$t")
    fi
}
# Two at a time (one core each).
for ((i = 0; i < ${#targets[@]}; i += 2)); do
    a=${targets[i]} b=${targets[i + 1]:-}
    run "$a" & pa=$!
    if [[ -n $b ]]; then run "$b" & pb=$!; fi
    rc=0; wait "$pa" || rc=$?; report "$a" "$rc"
    if [[ -n $b ]]; then rc=0; wait "$pb" || rc=$?; report "$b" "$rc"; fi
done
if ((${#failed[@]})); then
    echo "error: fuzz targets with findings: ${failed[*]}" >&2
    exit 1
fi
