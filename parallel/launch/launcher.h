// `trainer launch`: a torchrun-like launcher. Starts the local ranks of one node as child processes of
// the trainer binary with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
// one thread per core share (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS); prefixes every output line with
// `[rank N]`; forwards SIGTERM, SIGINT and SIGUSR1 (every rank then finishes its step, saves and exits
// with 128 + the signal, which the launcher returns; a second signal over 2 s later kills the ranks); and
// when any rank fails (exits non-zero otherwise), stops the others and exits 1 naming the rank and its
// exit status.
//
// With max_restarts N > 0 (torchrun's --max-restarts), a failure instead restarts every rank of the job, up to
// N times: node 0's launcher hosts the store (the ranks meet there too, each restart round under its own key
// prefix), every launcher joins each round there, and a failure on one node, reported there, stops and
// restarts the ranks of every node. The ranks of a restarted round get `restart_args` (the trainer's
// try_load_latest_save), so they resume from the newest complete checkpoint.
#pragma once

#include <string>
#include <vector>

namespace trainer {

struct LaunchOptions {
    int nproc_per_node = 1;
    int nnodes = 1;
    int node_rank = 0;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
    double stop_grace_seconds = 5.0;        // after a rank failed: SIGTERM, then SIGKILL after this long
    std::vector<std::string> args;          // the trainer's own arguments for every rank
    int max_restarts = 0;                   // restarts of the whole job after a failure (0: a failure ends it)
    double join_timeout_seconds = 600.0;    // with restarts: how long a round waits for every node's launcher
    std::vector<std::string> restart_args;  // appended to `args` in restarted rounds
};

// Runs the ranks to completion; returns the launcher's exit code (0 when every rank exited 0, 128 + the
// signal when they stopped on a forwarded one, 1 when a rank failed and no restart was left).
int launch(const LaunchOptions& options);

}  // namespace trainer
