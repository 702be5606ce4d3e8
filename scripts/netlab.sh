#!/usr/bin/env bash
# A network lab on one machine: N nodes, each a network namespace with its own stack and one address on a private
# test subnet, joined through a bridge by links limited to a given rate (tc's token bucket, tbf, each direction),
# so multi-node runs meet what separate hosts behind a slow link meet: their own addresses, and a link that
# decides. Everything a lab makes lives in namespaces it made (the bridge too, in a "switch" namespace): nothing
# is added to this machine's own stack, and no traffic leaves the lab. Needs root (ip netns).
#
# A lab is named tnl<PID>: PID owns it. Every `up` first removes the labs whose owner no longer runs (a killed run
# leaves its namespaces; the next start clears them by name), and `run` removes its own on any exit (a trap).
#
# Usage:
#   scripts/netlab.sh run [--nodes N] [--rate RATE] -- COMMAND [ARGS...]
#       makes a lab owned by this shell, runs COMMAND once in each node's namespace (node i's output prefixed
#       "[node i] "), waits for all, removes the lab; exits with the first failing node's status. Each node sees
#       NETLAB_NODE (its index), NETLAB_NODES, NETLAB_ADDR (its address) and NETLAB_MASTER (node 0's).
#   scripts/netlab.sh up LAB NODES [RATE]      make lab LAB (tnl<owner pid>) of NODES nodes; RATE as tc writes it
#                                              (100mbit, 1gbit, ...; "none": not limited; default none)
#   scripts/netlab.sh exec LAB NODE COMMAND... run COMMAND in node NODE's namespace
#   scripts/netlab.sh launch LAB NPROC TRAINER -- ARGS...
#                                              `TRAINER launch` on every node of LAB (NPROC ranks each, rank 0's store
#                                              on node 0; the job's TRAINER_STORE_SECRET made here unless set),
#                                              every rank running ARGS; output prefixed "[node i] ";
#                                              exits with the first failing node's status
#   scripts/netlab.sh link LAB NODE up|down    set node NODE's link up or down (a cable pulled, and put back)
#   scripts/netlab.sh addr NODE                node NODE's address (10.77.0.NODE+1)
#   scripts/netlab.sh down LAB                 remove lab LAB
#   scripts/netlab.sh clean                    remove every lab whose owner no longer runs
#   scripts/netlab.sh list                     the labs present, with their owners
#
# Latency: `tc netem` adds delay where the kernel has it (sch_netem); this kernel kind lacks it, so links have the
# bridge's own latency (tens of microseconds) and only the rate is set.
set -euo pipefail

subnet=10.77.0
max_nodes=200

die() {
    echo "netlab: $*" >&2
    exit 2
}

need_root() {
    [[ $(id -u) == 0 ]] || die "needs root (ip netns); run it as root or under sudo"
    command -v ip >/dev/null || die "needs iproute2's ip (apt-get install iproute2)"
    command -v tc >/dev/null || die "needs iproute2's tc (apt-get install iproute2)"
}

check_lab() {
    [[ $1 =~ ^tnl[0-9]+$ ]] || die "lab name \"$1\": expected tnl<owner pid>, e.g. tnl$$"
}

addr() { echo "$subnet.$(($1 + 1))"; }

# The labs present (each once), from their namespaces' names.
labs() { ip netns list 2>/dev/null | awk '{print $1}' | sed -n 's/^\(tnl[0-9]*\)-.*/\1/p' | sort -u; }

down() {
    local lab=$1 ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$lab-(n[0-9]+|sw)$" || true); do
        # What still runs in it (a killed run's nodes) goes with it: a namespace without its name lives on while
        # a process is inside.
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}

clean() {
    local lab pid
    for lab in $(labs); do
        pid=${lab#tnl}
        if [[ ! -d /proc/$pid ]]; then
            echo "netlab: removing lab $lab (its owner, pid $pid, no longer runs)" >&2
            down "$lab"
        fi
    done
}

# A rate as tc writes it, in bits per second: <number>[k|m|g]bit; "" where it is not one.
rate_bits() {
    [[ $1 =~ ^([0-9]+)(k|m|g|)bit$ ]] || return 0
    local n=${BASH_REMATCH[1]}
    case ${BASH_REMATCH[2]} in k) n=$((n * 1000)) ;; m) n=$((n * 1000000)) ;; g) n=$((n * 1000000000)) ;; esac
    echo "$n"
}

limit() {  # limit NAMESPACE DEVICE RATE: the device's egress at RATE
    [[ $3 == none ]] && return 0
    local bits burst
    bits=$(rate_bits "$3")
    [[ -n $bits ]] || die "rate \"$3\": expected <number>[k|m|g]bit (100mbit, 1gbit) or none"
    # Burst: 5 ms at the rate, at least a few full frames, so a message after an idle moment does not
    # pass at the wire's speed (the bucket's depth is what a short message sees); queue up to 50 ms.
    burst=$((bits / 8 / 200))
    ((burst >= 16384)) || burst=16384
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$3" burst "$burst" latency 50ms ||
        die "tc refused the rate \"$3\""
}

up() {
    local lab=$1 nodes=$2 rate=${3:-none} sw i ns
    check_lab "$lab"
    [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= max_nodes)) || die "nodes \"$nodes\": expected 1 to $max_nodes"
    clean
    [[ -z $(labs | grep -x "$lab" || true) ]] || die "lab $lab exists already (scripts/netlab.sh down $lab)"
    sw=$lab-sw
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for ((i = 0; i < nodes; i++)); do
        ns=$lab-n$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add eth0 netns "$ns" type veth peer name "p$i" netns "$sw"
        ip -n "$sw" link set "p$i" master br0
        ip -n "$sw" link set "p$i" up
        ip -n "$ns" addr add "$(addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        limit "$ns" eth0 "$rate"   # the node's upload
        limit "$sw" "p$i" "$rate"  # its download
    done
}

# Runs COMMAND in every node of lab $1 ($2 nodes) at once, an argument "{node}" replaced by the node's index, with
# NETLAB_NODE, NETLAB_NODES, NETLAB_ADDR and NETLAB_MASTER set and each output line prefixed "[node i] "; waits for
# all and returns the first failing node's status. The commands' pids are in `pids` (for a trap to stop them).
on_every_node() {
    local lab=$1 nodes=$2 i rc status=0
    shift 2
    pids=()
    for ((i = 0; i < nodes; i++)); do
        NETLAB_NODE=$i NETLAB_NODES=$nodes NETLAB_ADDR=$(addr "$i") NETLAB_MASTER=$(addr 0) \
            ip netns exec "$lab-n$i" "${@//\{node\}/$i}" > >(sed -u "s/^/[node $i] /") 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { rc=$?; ((status != 0)) || status=$rc; }
    done
    return "$status"
}

run() {
    local nodes=2 rate=none
    while (($#)); do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            --rate) rate=$2; shift 2 ;;
            --) shift; break ;;
            *) die "run: unknown argument $1 (see the header of $0)" ;;
        esac
    done
    (($#)) || die "run: no command after --"
    local lab=tnl$$
    pids=()
    # On any exit: the nodes' commands stopped (they would live on in namespaces without names), the lab removed.
    # shellcheck disable=SC2154  # p is the trap's own loop variable
    trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; down '"$lab" EXIT
    trap 'exit 130' INT TERM
    up "$lab" "$nodes" "$rate"
    on_every_node "$lab" "$nodes" "$@"
}

launch() {
    local lab=$1 nproc=$2 trainer=$3 nodes
    shift 3
    [[ ${1:-} == -- ]] || die "launch LAB NPROC TRAINER -- ARGS..."
    shift
    check_lab "$lab"
    nodes=$(ip netns list | awk '{print $1}' | grep -cE "^$lab-n[0-9]+$" || true)
    ((nodes > 0)) || die "no lab $lab (scripts/netlab.sh up $lab NODES RATE)"
    # The nodes are one job: without a secret of the caller's, one made for it (every node's launcher inherits it).
    if [[ -z ${TRAINER_STORE_SECRET:-} && -z ${TRAINER_STORE_SECRET_FILE:-} ]]; then
        TRAINER_STORE_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
        export TRAINER_STORE_SECRET
    fi
    on_every_node "$lab" "$nodes" "$trainer" launch --nnodes "$nodes" --node-rank "{node}" --nproc-per-node "$nproc" \
        --master-addr "$(addr 0)" --master-port 29500 -- "$@"
}

(($#)) || die "no command (see the header of $0)"
cmd=$1
shift
case $cmd in
    addr) (($# == 1)) || die "addr NODE"; addr "$1" ;;
    run) need_root; run "$@" ;;
    up) need_root; (($# >= 2)) || die "up LAB NODES [RATE]"; up "$@" ;;
    exec)
        need_root
        (($# >= 3)) || die "exec LAB NODE COMMAND..."
        lab=$1 node=$2
        shift 2
        check_lab "$lab"
        ip netns list | awk '{print $1}' | grep -qx "$lab-n$node" || die "lab $lab has no node $node"
        exec ip netns exec "$lab-n$node" "$@"
        ;;
    launch) need_root; (($# >= 4)) || die "launch LAB NPROC TRAINER -- ARGS..."; launch "$@" ;;
    link)
        need_root
        (($# == 3)) && [[ $3 == up || $3 == down ]] || die "link LAB NODE up|down"
        check_lab "$1"
        ip -n "$1-sw" link set "p$2" "$3" || die "lab $1 has no node $2"
        ;;
    down) need_root; (($# == 1)) || die "down LAB"; check_lab "$1"; down "$1" ;;
    clean) need_root; clean ;;
    list) for lab in $(labs); do echo "$lab (owner pid ${lab#tnl}$([[ -d /proc/${lab#tnl} ]] || echo ", gone"))"; done ;;
    *) die "unknown command \"$cmd\" (see the header of $0)" ;;
esac
