#!/usr/bin/env bash
# Goodput under failure: a multi-rank CPU run under `trainer launch --max-restarts` with ranks SIGKILLed at random
# steps (one of them during a checkpoint write), a SIGTERM to the launcher (then a requeue with
# try_load_latest_save) and a rank slowed to half speed, against an uninterrupted run of the same steps. Prints the
# failures, the restarts, the steps each failure lost, goodput, whether every checkpoint left loads, and whether the
# final parameters equal the uninterrupted run's bit for bit (scripts/chaos.py says how each is measured).
#
# With --nodes N (root) the ranks run on N nodes of a network lab (scripts/netlab.sh), each node its own network
# stack, and one failure is a node's link down for 3 s.
#
# Usage: scripts/chaos.sh [--ranks N] [--nodes M] [--steps S] [--failures K] [--save-interval I] [--seed X]
#                         [--data FILE]
#        (defaults 2 ranks on 1 node, 200 steps, 6 failures, a checkpoint every 10 steps, tiny.json on this
#        repository's sources as byte tokens; TRAINER_BIN: the trainer)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh
trainer=$(bench_trainer)
[[ " $* " == *" --data "* ]] || bench_tokens "$trainer"
exec python3 scripts/chaos.py --trainer "$trainer" "$@"
