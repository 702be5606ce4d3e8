// distributed_strategy auto: the configuration `trainer plan` recommends for the launched world, resolved
// before the training loop starts.
#pragma once

#include "base/config.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

// distributed_strategy auto: the plan's recommendation for the launched world (the fastest configuration
// that fits plan.device_memory_gib, or the hardware's memory, and plan.host_memory_gib, or this node's host
// memory: MemTotal or the memory cgroup's limit, the same on every rank), as a config, printed with its
// reasons.
// UserError when nothing fits.
TrainConfig choose_configuration(const TrainConfig& config, const RankEnv& env, Device device);

// The configuration a run trains, resolved before the training loop is built: `config` itself, or under
// distributed_strategy auto the plan's choice for the world this process was launched into (every rank plans
// alike, so every rank chooses the same; rank 0 prints the choice and why). The loop takes a configuration,
// never a planner.
TrainConfig resolve_training_config(const TrainConfig& config);

}  // namespace trainer
