// `trainer plan`: every configuration worth comparing for a config and a world, each dry-run for its memory
// (core/plan/dry_run.h) and timed by the time model (core/plan/step_time.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "base/config.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

// `trainer plan`: the configurations worth comparing for a config on a world of nnodes x nproc_per_node
// ranks (the config's own, then every strategy and sharding mode with the by_block wraps, both grad_sync
// modes where a step has several micro-batches, activation checkpointing null and whole_layer, and CPU
// offload off, of the optimizer state, and of the parameters too where FSDP shards), each with the peak
// memory per rank by category from a dry run of one step, whether it fits the device memory, and the step
// time the time model (core/plan/step_time.h) predicts for it on the hardware entry, split into compute,
// exposed communication and optimizer, with tokens/s/device and MFU. Prints a table, or with `json` one
// object per line.
struct PlanOptions {
    int nnodes = 1, nproc_per_node = 1;
    double device_memory_gib = 0.0;  // 0: the hardware entry's (none for the CPU)
    // Host memory of one node: a row that offloads fits only where its host peak times the node's ranks fits
    // here too. 0: not checked.
    double host_memory_gib = 0.0;
    std::string hardware;          // empty: cpu on the CPU device, h100-sxm on CUDA
    std::string calibration;       // bench-kernels --calibration-out file (empty: the hardware's rooflines)
    std::string comm_calibration;  // bench-comm --calibration-out file (empty: the hardware's links)
    bool json = false;
    bool all = false;  // every row with its memory by category (default: one screen, core/plan/plan.cpp)
};
int run_plan(const TrainConfig& config, const PlanOptions& options);

// The plan's recommendation for the world of `env`: the fastest configuration that fits, or nullopt with the
// reason nothing does.
struct Recommendation {
    std::optional<TrainConfig> config;
    std::string hardware;     // the entry it was planned on
    double device_gib = 0.0;  // the device memory it had to fit (0: unknown)
    std::string description;  // the configuration in few words
    std::string reasons;      // why it, or why nothing fits
};
Recommendation recommend(const TrainConfig& config, const RankEnv& env, Device device, const PlanOptions& options);

}  // namespace trainer
