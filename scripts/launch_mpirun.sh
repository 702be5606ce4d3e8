#!/usr/bin/env bash
# Multi-node (or single-node) run under OpenMPI: one trainer process per rank, ranks read from
# OMPI_COMM_WORLD_*; rank 0's node hosts the rendezvous store at MASTER_ADDR:MASTER_PORT.
#
# Usage: scripts/launch_mpirun.sh HOSTFILE NPROC -- TRAINER_ARGS...
#   HOSTFILE: OpenMPI hostfile ("node1 slots=8" per line); NPROC: total ranks.
#   MASTER_ADDR defaults to the first host of the hostfile, MASTER_PORT to 29500. TRAINER_STORE_SECRET (the job's
#   rendezvous secret: only processes that know it are served by rank 0's store) is made here when unset and
#   exported to every rank; it never appears on a command line or in a log.
# Example: scripts/launch_mpirun.sh hosts 16 -- --config configs/olmo_1b.json --strategy fsdp ...
#
# Stopping with a checkpoint: send mpirun SIGUSR1 (`kill -USR1 <mpirun pid>`), which it forwards to every
# rank at once; each finishes its step, saves (with --save-folder) and exits 138. mpirun handles SIGTERM and
# Ctrl-C itself: the ranks get SIGTERM only odls_base_sigkill_timeout seconds later (1 by default; raise it
# with OMPI_MCA_odls_base_sigkill_timeout=N in the environment) and SIGKILL as long after.
set -euo pipefail
if (($# < 4)) || [[ $3 != "--" ]]; then
    echo "usage: $0 HOSTFILE NPROC -- TRAINER_ARGS..." >&2
    exit 2
fi
hostfile=$1 nproc=$2
shift 3
[[ -f $hostfile ]] || { echo "error: hostfile $hostfile not found" >&2; exit 2; }
master_addr=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$hostfile")}
master_port=${MASTER_PORT:-29500}
# The trainer beside this script: the source tree's build/bin/trainer, or an installed one
# (<prefix>/share/trainer/scripts/ -> <prefix>/bin/trainer); TRAINER overrides both.
here=$(cd "$(dirname "$0")" && pwd)
trainer=${TRAINER:-$here/../build/bin/trainer}
[[ -x $trainer ]] || trainer=$here/../../../bin/trainer
[[ -x $trainer ]] || { echo "error: no trainer binary at $here/../build/bin/trainer or $trainer (set TRAINER)" >&2; exit 2; }
if [[ -z ${TRAINER_STORE_SECRET:-} && -z ${TRAINER_STORE_SECRET_FILE:-} ]]; then
    TRAINER_STORE_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    export TRAINER_STORE_SECRET
fi
# --allow-run-as-root: containers often run as root; -x exports the rendezvous address and secret to every rank;
# --bind-to none lets each rank's OpenMP threads use its share of the cores.
secret_var=TRAINER_STORE_SECRET_FILE
[[ -n ${TRAINER_STORE_SECRET:-} ]] && secret_var=TRAINER_STORE_SECRET
exec mpirun --allow-run-as-root --hostfile "$hostfile" -np "$nproc" --bind-to none \
    -x MASTER_ADDR="$master_addr" -x MASTER_PORT="$master_port" -x OMP_NUM_THREADS -x "$secret_var" \
    "$trainer" "$@"
