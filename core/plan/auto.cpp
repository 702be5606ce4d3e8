// distributed_strategy auto (see auto.h).
#include "core/plan/auto.h"

#include <algorithm>
#include <cstdio>
#include <optional>

#include "base/common.h"
#include "base/memory.h"
#include "core/plan/host_memory.h"
#include "core/plan/plan.h"
#include "kernels/backend.h"
#include "parallel/setup.h"

namespace trainer {

TrainConfig choose_configuration(const TrainConfig& config, const RankEnv& env, Device device) {
    PlanOptions o;
    o.nnodes = env.num_nodes(), o.nproc_per_node = env.local_world_size;
    o.hardware = config.plan.hardware.value_or("");
    o.calibration = config.plan.calibration.value_or("");
    o.comm_calibration = config.plan.comm_calibration.value_or("");
    o.device_memory_gib = config.plan.device_memory_gib.value_or(0.0);
    // The memory of the GPU this rank computes on, not its hardware entry's (an A100 40 GB planned as an entry of
    // 80 would be given a row that does not fit; an H200 as an H100, rows that shard for nothing).
    const int gpus = device == Device::kCuda ? cuda_device_count() : 0;
    if (const std::optional<CudaDeviceInfo> gpu = gpus > 0 ? cuda_device_info(env.local_rank % gpus) : std::nullopt;
        gpu && o.device_memory_gib <= 0.0) {
        o.device_memory_gib = static_cast<double>(gpu->memory_bytes) / kGiB;
    }
    // The host memory this node has (its capacity, alike on every rank: the run's own check then compares
    // what is available at its start), so the choice is never an offload the node cannot hold.
    o.host_memory_gib = config.plan.host_memory_gib.value_or(0.0);
    if (o.host_memory_gib <= 0.0) {
        const int64_t have = host_capacity_bytes();
        if (have >= 0) o.host_memory_gib = std::max<double>(static_cast<double>(have), 1.0) / kGiB;
    }
    const Recommendation r = recommend(config, env, device, o);
    if (!r.config) user_error("distributed_strategy auto: {}", r.reasons);
    const std::string memory = r.device_gib > 0.0 ? fmt::format(", {:.1f} GiB a device", r.device_gib) : "";
    std::printf("distributed_strategy auto (plan on %s%s): %s, because %s\n", r.hardware.c_str(), memory.c_str(),
                r.description.c_str(), r.reasons.c_str());
    std::fflush(stdout);
    return *r.config;
}

TrainConfig resolve_training_config(const TrainConfig& config) {
    if (config.distributed_strategy != DistributedStrategy::kAuto) return config;
    const RankEnv env = detect_rank_env();
    const Device device = resolve_compute(config).device;
    silence_stdout_unless_rank0(env);
    return choose_configuration(config, env, device);
}

}  // namespace trainer
