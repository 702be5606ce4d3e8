// Run setup on the parallel side (see setup.h).
#include "parallel/setup.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "parallel/comm/comm_stream.h"
#include "parallel/launch/bind_address.h"
#include "parallel/launch/store_secret.h"
#include "parallel/strategy/wrap_policy.h"

namespace trainer {
namespace {

// HYBRID_SHARD's number of model replicas: fsdp.hybrid_sharding_num_model_replicas, or one per node. The
// shard groups are consecutive ranks (a node's ranks, by default).
int hybrid_replicas(const TrainConfig& c, const RankEnv& env) {
    const int replicas = c.fsdp.hybrid_sharding_num_model_replicas.value_or(env.num_nodes());
    if (env.world_size % replicas != 0) {
        user_error(
            "fsdp.hybrid_sharding_num_model_replicas {} does not divide the {} ranks {} started (HYBRID_SHARD "
            "shards each replica over world / replicas consecutive ranks)",
            replicas, env.world_size, env.launcher);
    }
    return replicas;
}

Collectives collectives_for(const TrainConfig& c, Device device, int world) {
    if (c.distributed_backend == DistributedBackend::kNccl) return Collectives::kNccl;
    if (world == 1) return Collectives::kLocal;
    if (c.distributed_backend == DistributedBackend::kGloo) return Collectives::kGloo;
    return device == Device::kCuda ? Collectives::kNccl : Collectives::kGloo;
}

// A communicator over ranks [0, size) of a group whose store keys start with `prefix`.
using GroupFactory = std::function<std::unique_ptr<Communicator>(const std::string& prefix, int rank, int size)>;

// The strategy the config names over world.comm; HYBRID_SHARD's shard and replica groups are made by
// `make_group` and kept in world.sub_comms, alive as long as the strategy.
std::unique_ptr<Strategy> make_strategy(const TrainConfig& config, World& world, Backend* backend,
                                        const ParamLayout& layout, const GroupFactory& make_group) {
    const FsdpConfig& fc = config.fsdp;
    Communicator* comm = world.comm.get();
    const WirePrecision wire{fc.precision != FsdpPrecision::kFp32, fc.precision == FsdpPrecision::kPure};
    switch (config.distributed_strategy) {
        case DistributedStrategy::kSingle:
            return make_single_strategy(backend, layout, config.cpu_offload);
        case DistributedStrategy::kDdp:
            return make_ddp_strategy(backend, layout, comm, config.ddp_grad_sync_mode == GradSyncMode::kMicroBatch,
                                     "ddp", WirePrecision{}, config.cpu_offload);
        case DistributedStrategy::kFsdp:
            break;
        case DistributedStrategy::kAuto:
            TRAINER_CHECK(false, "distributed_strategy auto reached make_strategy unresolved");
    }
    const bool every_micro_batch = fc.grad_sync_mode == GradSyncMode::kMicroBatch;
    if (fc.sharding_strategy == ShardingStrategy::kNoShard) {
        return make_ddp_strategy(backend, layout, comm, every_micro_batch,
                                 fmt::format("fsdp NO_SHARD {}", choice_name(fc.precision)), wire, config.cpu_offload);
    }
    FsdpOptions o;
    o.groups = fsdp_unit_groups(layout, fc);
    o.keep_params_for_step = fc.sharding_strategy == ShardingStrategy::kShardGradOp;
    o.reduce_every_micro_batch = every_micro_batch;
    o.precision = wire;
    o.forward_prefetch = fc.forward_prefetch;
    o.backward_prefetch = fc.backward_prefetch;
    o.limit_all_gathers = fc.limit_all_gathers;
    o.offload = config.cpu_offload;
    Communicator *group = comm, *replicas = nullptr;
    if (fc.sharding_strategy == ShardingStrategy::kHybridShard) {
        // Shard groups of consecutive ranks; replica groups join the ranks holding the same shard.
        const int n_replicas = hybrid_replicas(config, world.env), per = world.size() / n_replicas;
        const int rank = world.rank();
        if (n_replicas > 1 && per > 1) {
            world.sub_comms.push_back(make_group(fmt::format("shard{}", rank / per), rank % per, per));
            world.sub_comms.push_back(make_group(fmt::format("replica{}", rank % per), rank / per, n_replicas));
            group = world.sub_comms[0].get();
            replicas = world.sub_comms[1].get();
        } else if (n_replicas > 1) {  // shard groups of one: every rank a full replica
            world.sub_comms.push_back(make_local_communicator(backend));
            group = world.sub_comms[0].get();
            replicas = comm;
        }
    }
    return make_fsdp_strategy(
        backend, layout, comm, group, replicas, o,
        fmt::format("fsdp {} {} {} {}", choice_name(fc.sharding_strategy), choice_name(fc.wrapping_strategy),
                    choice_name(fc.precision), choice_name(fc.grad_sync_mode)));
}

}  // namespace

void check_parallel_config(const TrainConfig& c, const RankEnv& env, Device device) {
    TRAINER_CHECK(c.distributed_strategy != DistributedStrategy::kAuto, "distributed_strategy auto is resolved first");
    if (c.distributed_strategy == DistributedStrategy::kSingle && env.world_size > 1) {
        user_error(
            "distributed_strategy \"single\" runs one process, but {} started {} ranks; use --strategy ddp "
            "(or fsdp)",
            env.launcher, env.world_size);
    }
    if (c.kernels_cuda_graphs && c.distributed_strategy != DistributedStrategy::kSingle) {
        // DDP's and FSDP's collectives, and FSDP's gathers, are issued and waited for by the host around each
        // unit, which a recorded micro-batch does not run again (kernels/graph.h).
        user_error(
            "kernels.cuda_graphs records one process's micro-batch; distributed_strategy \"{}\" runs collectives "
            "between its units, which it does not record yet: use --strategy single, or run without "
            "kernels.cuda_graphs",
            choice_name(c.distributed_strategy));
    }
    bool label_masks = !c.data.label_mask_paths.empty();
    for (const DataSource& s : c.data.sources) label_masks = label_masks || !s.label_mask_paths.empty();
    if (c.kernels_cuda_graphs && label_masks) {
        // A recording replays one loss scale, and label masks make it each step's own (1 / its tokens in the loss).
        user_error(
            "kernels.cuda_graphs with label masks (data.label_mask_paths): a recorded micro-batch replays one loss "
            "scale, and the masks change it every step; use one or the other");
    }
    if (c.kernels_cuda_graphs && (c.cpu_offload.optimizer_state || c.cpu_offload.parameters)) {
        user_error(
            "kernels.cuda_graphs with cpu_offload: the offloaded state's copies are ordered by the host around "
            "the micro-batches, which a recording does not run again; use one or the other");
    }
    if (c.distributed_strategy == DistributedStrategy::kFsdp) {
        (void)fsdp_unit_groups(ParamLayout(c), c.fsdp);  // refuses a bad wrap policy
        if (c.fsdp.sharding_strategy == ShardingStrategy::kHybridShard) (void)hybrid_replicas(c, env);
    }
    const long per_step = c.device_train_microbatch_size * env.world_size;
    if (c.global_train_batch_size % per_step != 0) {
        user_error(
            "global_train_batch_size {} is not a multiple of device_train_microbatch_size {} x {} ranks (global = "
            "micro-batch x accumulation steps x ranks)",
            c.global_train_batch_size, c.device_train_microbatch_size, env.world_size);
    }
    check_collectives_config(c, device);
}

void check_collectives_config(const TrainConfig& c, Device device) {
    if (c.distributed_backend == DistributedBackend::kNccl && device != Device::kCuda) {
        user_error("distributed_backend \"nccl\" needs --device cuda (device is {}); use gloo or auto",
                   choice_name(device));
    }
}

int rank_device(const TrainConfig& c, const RankEnv& env, Device device) {
    if (device != Device::kCuda) return 0;
    const int gpus = cuda_device_count();
    if (gpus == 0) {
#ifdef TRAINER_HAVE_CUDA
        const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
        user_error(
            "device \"cuda\": no usable GPU on this machine (rank {} sees none{}); use --device cpu, or --device auto "
            "to pick what is present",
            env.rank, visible != nullptr ? fmt::format(", CUDA_VISIBLE_DEVICES={}", visible) : std::string());
#else
        (void)c;
        user_error(
            "device \"cuda\": this build has no CUDA backend (nvcc was not found when it was configured); rebuild "
            "with the CUDA toolkit or use --device cpu");
#endif
    }
    // GPU 0 has the most ranks: every rank decides alike.
    const bool shared = ranks_on_gpu(env, gpus, 0) > 1;
    const Collectives lib = collectives_for(c, device, env.world_size);
    if (shared && lib == Collectives::kNccl) {
        user_error(
            "{} started {} ranks on this node, which has {} GPU{}: NCCL takes one GPU a rank (it refuses two ranks "
            "on one GPU); start at most {} rank{} a node, or set distributed_backend=gloo to share the GPUs (each "
            "collective staged through host memory: for tests and small runs, not for speed)",
            env.launcher, env.local_world_size, gpus, gpus == 1 ? "" : "s", gpus, gpus == 1 ? "" : "s");
    }
    if (shared && env.rank == 0) {
        std::printf(
            "note: %d ranks a node share %d GPU%s (each rank on GPU LOCAL_RANK %% %d), their collectives over Gloo "
            "staged through host memory\n",
            env.local_world_size, gpus, gpus == 1 ? "" : "s", gpus);
        std::fflush(stdout);
    }
    return env.local_rank % gpus;
}

int ranks_on_gpu(const RankEnv& env, int gpus, int device_index) {
    if (std::getenv("CUDA_VISIBLE_DEVICES") != nullptr || gpus < 1) return 1;
    return (env.local_world_size - 1 - device_index) / gpus + 1;
}

namespace {

// Before the communicators connect, the ranks check through the store that they agree on the world: a node
// launched with another --nproc-per-node (or --nnodes) computes other ranks and sizes, and would leave the
// others waiting out distributed_timeout_seconds for ranks that never come. Rank 0 publishes its sizes;
// every other rank compares and either says it is ready or records the disagreement, which rank 0 (polling)
// and this rank report at once. Rank 0 also names the ranks that never arrived when the timeout passes.
void check_world_agrees(TcpStore& store, const RankEnv& env, std::chrono::milliseconds timeout) {
    auto bytes = [](const std::string& s) { return std::vector<char>(s.begin(), s.end()); };
    const std::string mine = fmt::format("{} {}", env.world_size, env.local_world_size);
    const std::string mismatch_key = "trainer/world_mismatch";
    // Every rank's host as well, for messages that name a rank (World::host_of).
    store.set(fmt::format("trainer/host/{}", env.rank), bytes(host_name().empty() ? "?" : host_name()));
    if (env.rank != 0) {
        const std::vector<long> theirs = store.get_ints("trainer/world", 2, 1, 1L << 24);
        if (theirs[0] != env.world_size || theirs[1] != env.local_world_size) {
            const long w = theirs[0], l = theirs[1];
            const std::string text = fmt::format(
                "the ranks disagree on the world: rank 0 has WORLD_SIZE {} and LOCAL_WORLD_SIZE {}, rank {} on "
                "host {} has {} and {}; were the nodes launched with different --nproc-per-node or --nnodes?",
                w, l, env.rank, host_name().empty() ? "?" : host_name(), env.world_size, env.local_world_size);
            store.set(mismatch_key, bytes(text));
            user_error("rendezvous: {}", text);
        }
        store.set(fmt::format("trainer/ready/{}", env.rank), bytes("1"));
        return;
    }
    store.set("trainer/world", bytes(mine));
    std::vector<std::string> keys;
    for (int r = 1; r < env.world_size; ++r) keys.push_back(fmt::format("trainer/ready/{}", r));
    keys.push_back(mismatch_key);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const std::vector<bool> present = store.check(keys);
        if (present.back()) user_error("rendezvous: {}", store.get_text(mismatch_key, 1024));
        std::vector<int> missing;
        for (int r = 1; r < env.world_size; ++r)
            if (!present[static_cast<size_t>(r - 1)]) missing.push_back(r);
        if (missing.empty()) return;
        if (std::chrono::steady_clock::now() >= deadline) {
            user_error(
                "rendezvous: rank{} {} of {} did not arrive within {} s (distributed_timeout_seconds); are all "
                "{} node(s) launched, with the same MASTER_ADDR and MASTER_PORT?",
                missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), env.world_size, timeout.count() / 1000.0,
                env.num_nodes());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

}  // namespace

std::string World::host_of(int r) const {
    if (!store) return host_name().empty() ? "?" : host_name();
    try {
        return store->get_text(fmt::format("trainer/host/{}", r), 255);  // 255 bytes: the longest host name
    } catch (const UserError&) {
        return "?";  // the store is out of reach: the message goes out without the host
    }
}

World connect_world(const TrainConfig& config, const RankEnv& env, Device device, Backend* backend) {
    World world;
    world.env = env;
    world.collectives = collectives_for(config, device, env.world_size);
    world.timeout = std::chrono::milliseconds(static_cast<long>(config.distributed_timeout_seconds * 1000));
    // Ranks meet at rank 0's store; Gloo or NCCL connects them. Gloo's address is settled first: a setting that
    // names nothing here ends the run before it waits for anyone.
    if (world.collectives == Collectives::kGloo) {
        world.gloo_host = gloo_bind_host(env, [](const char* name) { return std::getenv(name); });
    }
    if (world.collectives != Collectives::kLocal) {
        // Under `trainer launch --max-restarts` the launcher of node 0 hosts the store for every round.
        // A lone process (a one-rank NCCL communicator) keeps a secret of its own; a job's ranks must share one.
        std::string secret = env.store_secret;
        if (secret.empty() && env.world_size == 1) secret = new_store_secret();
        if (secret.empty()) {
            user_error(
                "{} is not set: the {} ranks of this job (rank environment: {}) meet at rank 0's rendezvous store, "
                "which serves only "
                "processes that know the job's secret; export the same value on every process (for example "
                "`export {}=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')` before mpirun -x {} or srun), "
                "or a file holding it as {}; trainer launch sets it for its ranks on one node",
                kStoreSecretEnv, env.world_size, env.launcher, kStoreSecretEnv, kStoreSecretEnv, kStoreSecretFileEnv);
        }
        if (env.rank == 0 && !env.agent_store)
            world.store_server = std::make_unique<TcpStoreServer>(env.master_port, secret);
        world.store = std::make_unique<TcpStore>(env.master_addr, env.master_port, world.timeout, secret);
        world.store->set_key_prefix(env.store_prefix);
        try {
            check_world_agrees(*world.store, env, world.timeout);
        } catch (const UserError&) {
            // Rank 0's store stays up until the process exits: torn down while the error unwinds, it would
            // end the other local ranks first, and their launcher would stop this rank before it says why.
            (void)world.store_server.release();
            throw;
        }
    }
    world.comm = connect_group(world, backend, "world", env.rank, env.world_size);
    return world;
}

std::unique_ptr<Communicator> connect_group(World& world, Backend* backend, const std::string& prefix, int rank,
                                            int size) {
    switch (world.collectives) {
        case Collectives::kNccl:
            return make_nccl_communicator(*world.store, prefix, rank, size, world.timeout, backend);
        case Collectives::kGloo: {
            auto host = make_gloo_communicator(*world.store, prefix, rank, size, world.timeout, world.gloo_host);
            // On a GPU: each collective's device buffers staged through pinned host memory (comm_stream.h).
            if (backend != nullptr && backend->name() == "cuda")
                return make_staged_communicator(std::move(host), make_cuda_comm_stream(backend), "Gloo", world.timeout);
            return host;
        }
        case Collectives::kLocal:
            break;
    }
    return make_local_communicator(backend);
}

World make_world(const TrainConfig& config, const RankEnv& env, Device device, Backend* backend,
                 const ParamLayout& layout) {
    World world = connect_world(config, env, device, backend);
    const GroupFactory make_group = [&](const std::string& prefix, int r, int n) {
        return connect_group(world, backend, prefix, r, n);
    };
    world.strategy = make_strategy(config, world, backend, layout, make_group);
    return world;
}

World make_dry_world(const TrainConfig& config, const RankEnv& env, Device device, Backend* backend,
                     const ParamLayout& layout, const std::function<void(const CollectiveCall&)>& observer) {
    World world;
    world.env = env;
    world.collectives = collectives_for(config, device, env.world_size);
    // Gloo's reduce-scatter buffer is device memory on the CPU; staged on a GPU, it is host memory.
    const bool gloo = world.collectives == Collectives::kGloo && device != Device::kCuda;
    // make_strategy's groups: the world and HYBRID_SHARD's replica groups span the nodes when there are
    // several; a shard group of consecutive ranks does when it is larger than a node.
    const GroupFactory make_group = [&](const std::string& prefix, int r, int n) {
        const bool shard = prefix.rfind("shard", 0) == 0;
        const bool spans = env.num_nodes() > 1 && (!shard || n > env.local_world_size);
        // Its ranks spread evenly over the nodes: the node's ranks run local_world_size / (n / nodes) such
        // groups at once, each one flow across the node's links.
        const int flows = spans ? std::max(1, env.local_world_size / std::max(1, n / env.num_nodes())) : 1;
        return make_dry_communicator(r, n, gloo, spans, flows, observer);
    };
    world.comm = make_group("world", env.rank, env.world_size);
    world.strategy = make_strategy(config, world, backend, layout, make_group);
    return world;
}

BackendOptions backend_options(const TrainConfig& c, const ComputeTarget& target, int device_index) {
    BackendOptions o;
    // On the CPU amp_fp8 is fp32 with the blocks' Linear layers emulating FP8 (the CPU backend does it unasked).
    const bool cuda = target.device == Device::kCuda;
    o.bf16_matmuls = cuda && bf16_mixed(c.precision);
    o.fp8_linears = cuda && c.precision == Precision::kAmpFp8;
    o.bf16_operands = o.bf16_matmuls && c.kernels_bf16_activations;
    o.attention = target.attention;
    o.device_index = device_index;
    o.classifier_one_read = c.kernels_classifier_one_read;
    return o;
}

bool gemm_operands_bf16_for(const TrainConfig& c, Device device) {
    return resolve_device(device) == Device::kCuda && bf16_mixed(c.precision) && c.kernels_bf16_activations;
}

bool gemms_read_aliases_for(const TrainConfig& c, Device device) {
    return resolve_device(device) == Device::kCuda && bf16_mixed(c.precision);
}

namespace {

// kernels.attention on `device` (resolved), auto made the fast path or the native kernels.
AttentionKernel resolve_attention(const TrainConfig& c, Device device) {
    if (c.kernels_attention != AttentionKernel::kAuto) return c.kernels_attention;
    const int T = c.model.predicted_positions(), HS = c.model.head_size();
    const bool fast = device == Device::kCuda && bf16_mixed(c.precision) && kCudnnAttentionBuilt &&
                      cudnn_attention_unsupported(T, HS).empty();
    return fast ? AttentionKernel::kCudnn : AttentionKernel::kNative;
}

}  // namespace

ComputeTarget resolve_compute(const TrainConfig& c) {
    const Device device = resolve_device(c.device);
    const bool cuda = device == Device::kCuda;
    const AttentionKernel attention = resolve_attention(c, device);
    if (c.precision == Precision::kAmpBf16 && !cuda) {
        user_error("precision \"amp_bf16\" needs the CUDA backend (device is {}); on CPU use --precision fp32",
                   choice_name(device));
    }
    const int T = c.model.predicted_positions(), HS = c.model.head_size();
    if (!cuda && c.kernels_cuda_graphs) {
        user_error("kernels.cuda_graphs records CUDA work; the {} backend has none to record (use --device cuda)",
                   choice_name(device));
    }
    if (!cuda && attention != AttentionKernel::kNative) {
        user_error("kernels.attention \"{}\" is a CUDA kernel; the {} backend has native attention only",
                   choice_name(attention), choice_name(device));
    }
    if (cuda && attention == AttentionKernel::kNative && HS > kCudaNativeAttentionMaxHeadSize) {
        user_error(
            "the native CUDA attention takes heads of up to {} channels, this model's have {} (model.d_model / "
            "model.n_heads)",
            kCudaNativeAttentionMaxHeadSize, HS);
    }
    if (cuda && attention == AttentionKernel::kCudnn) {
        if (!bf16_mixed(c.precision)) {
            user_error(
                "kernels.attention \"cudnn\" computes attention in bf16; use it with --precision amp_bf16 or amp_fp8 "
                "(fp32 runs use the native kernels)");
        }
        if (!kCudnnAttentionBuilt) {
            user_error(
                "kernels.attention \"cudnn\": this build has no cuDNN (an emulated build: the CPU emulator of "
                "tests/simt runs our own kernels); use kernels.attention=native or flash");
        }
        const std::string why = cudnn_attention_unsupported(T, HS);
        if (!why.empty())
            user_error(
                "kernels.attention \"cudnn\": cuDNN's fused attention cannot run a {}; use kernels.attention=native",
                why);
    }
    if (cuda && attention == AttentionKernel::kFlash) {
        if (!bf16_mixed(c.precision)) {
            user_error(
                "kernels.attention \"flash\" computes attention in bf16; use it with --precision amp_bf16 or amp_fp8 "
                "(fp32 runs use the native kernels)");
        }
        const std::string why = flash_attention_unsupported(HS);
        if (!why.empty()) user_error("kernels.attention \"flash\" cannot run a {}; use kernels.attention=cudnn", why);
    }
    return ComputeTarget{device, attention};
}

}  // namespace trainer
