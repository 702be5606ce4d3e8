// Host and device memory checked before a run starts: the memory cgroup's limit, CPU offload's host state
// against the node's memory, and ranks sharing a GPU against its free memory (each from a dry run of the
// step, core/plan/dry_run.h).
#pragma once

#include <cstdint>
#include <string>

#include "base/config.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

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

// The host memory of this node: MemTotal, or the memory cgroup's limit where that is less; -1 when unknown.
int64_t host_capacity_bytes();

// Refuses a run whose host memory (CPU offload's state, save_async's checkpoint snapshot) times the node's ranks
// exceeds the host memory available now (MemAvailable, or what the memory cgroup's limit leaves where that is
// less; TRAINER_HOST_MEMORY_BYTES replaces it in tests), naming each part. Both are what the run allocates under
// the host categories, counted over a dry backend. Nothing to check without either.
void check_host_memory(const TrainConfig& config, const RankEnv& env, Device device);

// Refuses ranks that share a GPU (more ranks on this node than GPUs: distributed_backend gloo) whose planned
// peak device memory (dry_run_step's) times the ranks on GPU `device_index` exceeds that GPU's free memory as
// this rank finds it (TRAINER_DEVICE_FREE_BYTES replaces it in tests), naming both. Nothing to check for a rank
// alone on its GPU, where the run itself reports running out.
void check_shared_device_memory(const TrainConfig& config, const RankEnv& env, Device device, int device_index);

}  // namespace trainer
