# shellcheck shell=bash
# Sourced by the benchmark scripts, from the project root.

# Writes data/bench_tokens.bin once with the trainer at $1: this repository's own sources as byte tokens (any
# real text does for throughput).
bench_tokens() {
    mkdir -p data
    [[ -f data/bench_tokens.bin ]] && return 0
    # The files as they are on disk (a copied tree's git index may be stale), in a fixed order.
    find apps base core kernels parallel scripts docs tests -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' \
        -o -name '*.md' -o -name '*.py' -o -name '*.sh' \) | LC_ALL=C sort | xargs "$1" prepare-data --tokenizer bytes \
        --format llmc -o data/bench_tokens.bin >/dev/null
}

# Prints the trainer to run: TRAINER_BIN when set, else build/bin/trainer (built by scripts/build.sh when
# absent).
bench_trainer() {
    local trainer=${TRAINER_BIN:-build/bin/trainer}
    if [[ ! -x $trainer ]]; then
        bash scripts/build.sh >/dev/null
        trainer=build/bin/trainer
    fi
    echo "$trainer"
}

# Sets $trainer (bench_trainer), writes the token file, and makes $tmp, a folder removed when the script exits.
bench_setup() {
    trainer=$(bench_trainer)
    bench_tokens "$trainer"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
}
