// Dry runs: one training step of a config, on one rank of a world of any size, through the real strategy,
// model and optimizer over a backend that computes and allocates nothing (make_dry_backend) and
// communicators that move nothing (make_dry_communicator). The memory accounting sees every buffer the step
// takes, when it takes it, so the peak memory by category is the real run's, from the same code that
// allocates (no second formula to drift); every op and collective is recorded in the order the rank issues
// them, the input of a time model.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/memory.h"
#include "parallel/rank_env.h"

namespace trainer {

// One op, collective issue or collective wait of the step, in the order the rank issues them.
struct StepEvent {
    // kIssue / kWait: a collective issued, waited for. kCopy / kCopyWait: an asynchronous copy between host
    // and device memory (CPU offload's gradients down, parameters up; Backend::copy_async) queued, waited
    // for (by the host or by the device's work). kSpanBegin / kSpanEnd: a trace span of the step
    // (base/trace.h), named in `label`.
    enum Kind { kOp, kIssue, kWait, kCopy, kCopyWait, kSpanBegin, kSpanEnd } kind = kOp;
    const char* what = "";            // the backend op, the collective's kind, or the span's category
    std::string label;                // spans: the name
    double flops = 0.0, bytes = 0.0;  // an op's work; a collective's bytes per rank; a copy's bytes
    bool on_host = false;             // an op of the host's (CPU offload's optimizer), not the device's
    int group_size = 1;               // collectives: the ranks of the group
    bool spans_nodes = false;         // collectives: the group has ranks on several nodes
    uint64_t id = 0;                  // collectives: the issue a wait is for; copies: the copy's ticket
    const void* channel = nullptr;    // collectives: the communicator (its collectives run in order)
};

struct DryRunStep {
    std::array<int64_t, kNumMemCategories> peak{};  // bytes per category
    int64_t total_peak = 0;                         // the device categories' high-water mark
    int64_t host_peak = 0;                          // the host categories' (CPU offload)
    std::vector<StepEvent> events;
    size_t optimizer_begin = 0;  // events from here on are the optimizer step's
};

// One optimizer step of `config` (after check_parallel_config) on rank env.rank of env.world_size ranks
// (env.local_world_size per node) computing on `device` (kCpu or kCuda: which collectives a run would use).
// Peaks are the step's own (what was allocated before the call does not count); the process's peaks are
// left as they were.
// With `timer`, the events go to it as they happen and `events` stays empty (a step of a thousand
// micro-batches has millions).
class StepTimer;
DryRunStep dry_run_step(const TrainConfig& config, const RankEnv& env, Device device, StepTimer* timer = nullptr);

// A memory cgroup's limit (a container's or a Slurm job's) and usage: the cgroup named in `proc_cgroup`
// (the format of /proc/self/cgroup), read under `sys_root` (/sys/fs/cgroup) from cgroup v2 (memory.max,
// memory.current) or v1 (memory/<path>/memory.limit_in_bytes, memory.usage_in_bytes); limit -1 where there
// is no limit or nothing to read.
struct CgroupMemory {
    int64_t limit = -1, usage = 0;
};
CgroupMemory cgroup_memory(const std::string& proc_cgroup, const std::string& sys_root);
// What the cgroup still allows: limit - usage (at least 0), or -1 where there is no limit.
int64_t cgroup_memory_left(const std::string& proc_cgroup, const std::string& sys_root);

// Refuses CPU offload whose host state times the node's ranks exceeds the host memory available now
// (MemAvailable, or what the memory cgroup's limit leaves where that is less; TRAINER_HOST_MEMORY_BYTES
// replaces it in tests), naming both. The host state is what the
// strategy allocates under the host categories, counted over a dry backend. Nothing to check without offload.
void check_offload_host_memory(const TrainConfig& config, const RankEnv& env, Device device);

// Refuses ranks that share a GPU (more ranks on this node than GPUs: distributed_backend gloo) whose planned
// peak device memory (dry_run_step's) times the ranks on GPU `device_index` exceeds that GPU's free memory as
// this rank finds it (TRAINER_DEVICE_FREE_BYTES replaces it in tests), naming both. Nothing to check for a rank
// alone on its GPU, where the run itself reports running out.
void check_shared_device_memory(const TrainConfig& config, const RankEnv& env, Device device, int device_index);

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
};
int run_plan(const TrainConfig& config, const PlanOptions& options);

// distributed_strategy auto: the plan's recommendation for the launched world (the fastest configuration
// that fits plan.device_memory_gib, or the hardware's memory, and plan.host_memory_gib, or this node's host
// memory: MemTotal or the memory cgroup's limit, the same on every rank), as a config, printed with its
// reasons.
// UserError when nothing fits.
TrainConfig choose_configuration(const TrainConfig& config, const RankEnv& env, Device device);

}  // namespace trainer
