// Run setup on the parallel side: from the config and the rank environment to the run's World (the
// rendezvous store, the world communicator, HYBRID_SHARD's sub-communicators and the strategy over them),
// with every strategy and collectives check made before anything is allocated.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/rank_env.h"
#include "parallel/launch/tcp_store.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

// The collectives library a run uses: none for a lone process (kLocal), Gloo or NCCL among several ranks
// (NCCL also when distributed_backend forces it for one).
enum class Collectives { kLocal, kGloo, kNccl };
template <>
struct Choices<Collectives> {
    static constexpr const char* kNames[] = {"local", "gloo", "nccl"};
};

// Refuses, naming the key, what this build cannot run on these ranks and this device: "single" on several
// ranks, a bad wrap policy, HYBRID_SHARD replicas that do not divide the ranks, a global batch that is not
// micro-batch x accumulation x ranks, NCCL without a GPU.
void check_parallel_config(const TrainConfig& config, const RankEnv& env, Device device);
// The part of it on the collectives library: NCCL without a GPU.
void check_collectives_config(const TrainConfig& config, Device device);

// The GPU this rank computes on (0 on the CPU): LOCAL_RANK modulo the GPUs it sees. Several ranks share a GPU
// only over distributed_backend gloo (staged through host memory), which rank 0 notes once; refused for NCCL
// (one GPU a rank, ranks_on_gpu), and refused where no GPU is visible or the build has no CUDA.
int rank_device(const TrainConfig& config, const RankEnv& env, Device device);
// The ranks of this node on GPU `device_index` of `gpus` (those whose LOCAL_RANK % gpus is device_index), where
// every rank of the node sees the node's GPUs. 1 where CUDA_VISIBLE_DEVICES is set: a scheduler that binds GPUs
// to ranks gives each its own view, and which physical GPUs such ranks share is not known here (NCCL still
// refuses a shared one itself).
int ranks_on_gpu(const RankEnv& env, int gpus, int device_index);

// The run's ranks, connected, and the strategy over them. Members are destroyed bottom-up: the strategy
// before the communicators it uses, those before the store they met through.
struct World {
    RankEnv env;
    Collectives collectives = Collectives::kLocal;
    std::unique_ptr<TcpStoreServer> store_server;  // rank 0 hosts the rendezvous store
    std::unique_ptr<TcpStore> store;
    std::unique_ptr<Communicator> comm;                    // all ranks
    std::vector<std::unique_ptr<Communicator>> sub_comms;  // HYBRID_SHARD's shard and replica groups
    std::unique_ptr<Strategy> strategy;
    std::chrono::milliseconds timeout{0};  // distributed_timeout_seconds: connection and every collective
    std::string gloo_host;                 // Gloo: the address this rank's pairs listen on (parallel/bind_address.h)

    int rank() const { return env.rank; }
    int size() const { return env.world_size; }
    // Rank r's host name, from the store (every rank wrote its own when the ranks met), "?" when out of reach.
    std::string host_of(int r) const;
};

// Connects the ranks (rank 0's store at MASTER_ADDR:MASTER_PORT; Gloo on the address gloo_bind_host finds, or NCCL
// on the backend's GPU) and builds the strategy the config names over them. The config must have passed
// check_parallel_config.
World make_world(const TrainConfig& config, const RankEnv& env, Device device, Backend* backend,
                 const ParamLayout& layout);

// make_world's first half: the ranks connected (the store and the world communicator), no strategy yet.
World connect_world(const TrainConfig& config, const RankEnv& env, Device device, Backend* backend);
// A communicator over a group of the connected world's ranks: this rank is `rank` of `size`, the group's store
// keys start with `prefix` (every member passes the same). Gloo, NCCL or local as the world's.
std::unique_ptr<Communicator> connect_group(World& world, Backend* backend, const std::string& prefix, int rank,
                                            int size);

// The World of a dry run (core/plan/dry_run.h) for rank env.rank of env.world_size: communicators that move
// nothing (taking the Gloo communicator's buffers where the run would use Gloo) reporting each collective
// to `observer`, and the strategy the config names over them, built as make_world builds it.
World make_dry_world(const TrainConfig& config, const RankEnv& env, Device device, Backend* backend,
                     const ParamLayout& layout, const std::function<void(const CollectiveCall&)>& observer);

// ---- the config turned into the values the kernels take (kernels/ never sees the config) ----

// What a config computes on, resolved once: the device (auto made concrete) and its attention kernels
// (kernels.attention auto made the fast path for that device: cuDNN's in amp_bf16 on CUDA where cuDNN runs the
// shape, else the native kernels). What makes a backend takes this, not the config's autos.
struct ComputeTarget {
    Device device = Device::kCpu;
    AttentionKernel attention = AttentionKernel::kNative;
};

// The config's ComputeTarget, after checking that its backend runs what the config asks: amp_bf16 and cuDNN
// attention need the GPU, the attention kernels' head-size and sequence limits. UserError naming the key otherwise.
ComputeTarget resolve_compute(const TrainConfig& config);

// How the config asks the backend to compute (precision, the target's attention kernels), on GPU `device_index`
// (parallel/setup.h's rank_device).
BackendOptions backend_options(const TrainConfig& config, const ComputeTarget& target, int device_index);

// Whether the backend a config computes on with `device` (resolved) keeps GEMM operands in bf16: amp_bf16
// on CUDA with kernels.bf16_activations.
bool gemm_operands_bf16_for(const TrainConfig& config, Device device);
// Whether its GEMMs read a replica's bf16 weights from their words alone (Backend::gemms_read_aliases): amp_bf16 and
// amp_fp8 on CUDA.
bool gemms_read_aliases_for(const TrainConfig& config, Device device);

}  // namespace trainer
