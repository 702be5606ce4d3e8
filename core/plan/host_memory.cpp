// Host and device memory checked before a run (see host_memory.h).
#include "core/plan/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "base/common.h"
#include "base/memory.h"
#include "core/plan/dry_run.h"
#include "core/weights/async_save.h"
#include "kernels/backend.h"
#include "parallel/setup.h"

namespace trainer {

CgroupMemory cgroup_memory(const std::string& proc_cgroup, const std::string& sys_root) {
    std::ifstream cg(proc_cgroup);
    std::string line;
    while (std::getline(cg, line)) {
        const size_t a = line.find(':'), b = line.find(':', a + 1);
        if (a == std::string::npos || b == std::string::npos) continue;
        const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
        std::string dir, max_file, cur_file;
        if (controllers.empty() && line.compare(0, a, "0") == 0) {
            dir = sys_root + path, max_file = "memory.max", cur_file = "memory.current";
        } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
            dir = sys_root + "/memory" + path, max_file = "memory.limit_in_bytes", cur_file = "memory.usage_in_bytes";
        } else {
            continue;
        }
        std::ifstream max_f(dir + "/" + max_file), cur_f(dir + "/" + cur_file);
        std::string max_s;
        int64_t current = 0;
        if (!(max_f >> max_s) || !(cur_f >> current) || max_s == "max") continue;
        const int64_t limit = std::atoll(max_s.c_str());
        if (limit <= 0 || limit >= (int64_t(1) << 60)) continue;  // v1 writes "no limit" as ~2^63
        return {limit, current};
    }
    return {};
}

int64_t cgroup_memory_left(const std::string& proc_cgroup, const std::string& sys_root) {
    const CgroupMemory m = cgroup_memory(proc_cgroup, sys_root);
    return m.limit < 0 ? -1 : std::max<int64_t>(m.limit - m.usage, 0);
}

namespace {

// A /proc/meminfo figure in bytes (`key` as "MemAvailable:"), -1 when absent.
int64_t meminfo_bytes(const std::string& key) {
    std::ifstream f("/proc/meminfo");
    std::string k, unit;
    int64_t kb = 0;
    while (f >> k >> kb >> unit) {
        if (k == key) return kb * 1024;
    }
    return -1;
}

// The smaller of a figure and a cgroup's, either -1 when unknown.
int64_t smaller_known(int64_t a, int64_t b) { return a < 0 ? b : b < 0 ? a : std::min(a, b); }

// Host memory the kernel could hand out now: MemAvailable, or less where the memory cgroup leaves less;
// TRAINER_HOST_MEMORY_BYTES replaces it (tests). -1 when unknown.
int64_t available_host_bytes() {
    if (const char* v = std::getenv("TRAINER_HOST_MEMORY_BYTES")) return std::atoll(v);
    return smaller_known(meminfo_bytes("MemAvailable:"), cgroup_memory_left("/proc/self/cgroup", "/sys/fs/cgroup"));
}

}  // namespace

// Host memory this node has for a run: MemTotal, or the memory cgroup's limit where less;
// TRAINER_HOST_MEMORY_BYTES replaces it (tests). The same on every rank of a node at every moment, so ranks
// that plan alike still choose alike (what is available now differs between them). -1 when unknown.
int64_t host_capacity_bytes() {
    if (const char* v = std::getenv("TRAINER_HOST_MEMORY_BYTES")) return std::atoll(v);
    return smaller_known(meminfo_bytes("MemTotal:"), cgroup_memory("/proc/self/cgroup", "/sys/fs/cgroup").limit);
}

void check_host_memory(const TrainConfig& config, const RankEnv& env, Device device) {
    if (!config.cpu_offload.optimizer_state && !config.async_saves()) return;
    // The strategy's state and the checkpoint snapshot, allocated over the dry backend: their host categories
    // are what the run will hold.
    const MemorySnapshot before = memory_snapshot();
    int64_t per_rank = 0, snapshot = 0;
    {
        auto backend = make_dry_backend();
        const ParamLayout layout(config);
        const World world = make_dry_world(config, env, device, backend.get(), layout, {});
        const int64_t state = memory_snapshot().host_current;
        std::optional<CheckpointSnapshot> snap;
        if (config.async_saves()) snap.emplace(backend.get(), *world.strategy);
        snapshot = memory_snapshot().host_current - state;
        per_rank = memory_snapshot().host_current - before.host_current;
    }
    memory_restore_peaks(before);
    // Every rank of this node keeps its host state in the node's memory.
    const int64_t need = per_rank * env.local_world_size, have = available_host_bytes();
    if (have >= 0 && need > have) {
        std::string parts;
        if (per_rank > snapshot) parts = fmt::format("cpu_offload's state {:.2f} GiB", (per_rank - snapshot) / kGiB);
        if (snapshot > 0) {
            parts += fmt::format("{}save_async's checkpoint snapshot {:.2f} GiB", parts.empty() ? "" : " + ",
                                 snapshot / kGiB);
        }
        user_error(
            "host memory: this run needs {:.2f} GiB per rank ({}) x {} ranks on this node = {:.2f} GiB, but {:.2f} "
            "GiB is available (MemAvailable, or the memory cgroup's limit); {}",
            per_rank / kGiB, parts, env.local_world_size, need / kGiB, have / kGiB,
            snapshot > 0 ? "write checkpoints synchronously (save_async=false), shard the state over more ranks "
                           "(fsdp FULL_SHARD) or use more nodes"
                         : "shard it over more ranks (fsdp FULL_SHARD), use more nodes, or turn the offload off");
    }
}

void check_shared_device_memory(const TrainConfig& config, const RankEnv& env, Device device, int device_index) {
    if (device != Device::kCuda) return;
    const int sharing = ranks_on_gpu(env, cuda_device_count(), device_index);
    if (sharing < 2) return;
    int64_t free_bytes = -1;
    if (const char* forced = std::getenv("TRAINER_DEVICE_FREE_BYTES")) {
        free_bytes = std::atoll(forced);
    } else if (const auto f = cuda_free_memory(device_index)) {
        free_bytes = static_cast<int64_t>(*f);
    }
    if (free_bytes < 0) return;
    const int64_t per_rank = dry_run_step(config, env, device).total_peak, need = per_rank * sharing;
    if (need > free_bytes) {
        user_error(
            "{} ranks share GPU {}: each plans a peak of {:.2f} GiB of device memory (trainer plan's dry run of this "
            "configuration), {:.2f} GiB together, but the GPU has {:.2f} GiB free; start fewer ranks a node, use a "
            "smaller micro-batch or model, or shard more (fsdp FULL_SHARD, activation_checkpointing)",
            sharing, device_index, per_rank / kGiB, need / kGiB, free_bytes / kGiB);
    }
}

}  // namespace trainer
