// The step loop (see train.h). Step order (torchtitan's): zero grads -> forward/backward per micro-batch
// -> reduce grads -> global grad norm -> clip -> AdamW on the owned shard -> LR schedule (inside step()).
#include "core/train.h"

#include <cblas.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>

#include "base/common.h"
#include "base/layout.h"
#include "core/checkpoint.h"
#include "core/data.h"
#include "core/hf_names.h"
#include "core/metrics.h"
#include "core/model.h"
#include "core/optimizer.h"
#include "core/safetensors.h"
#include "kernels/backend.h"
#include "parallel/communicator.h"
#include "parallel/rank_env.h"
#include "parallel/strategy.h"
#include "parallel/tcp_store.h"
#include "parallel/wrap_policy.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string human_count(double x) {
    if (x >= 1e9) return fmt::format("{:.2f}B", x / 1e9);
    if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
    if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
    return fmt::format("{:.0f}", x);
}

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

// Which strategies this build runs, checked against the rank environment before anything is allocated.
void check_strategy_supported(const TrainConfig& c, const RankEnv& env) {
    const std::string& s = c.distributed_strategy;
    if (s == "single" && env.world_size > 1) {
        user_error(
            "distributed_strategy \"single\" runs one process, but {} started {} ranks; use --strategy ddp "
            "(or fsdp)",
            env.launcher, env.world_size);
    }
    if (s == "fsdp") {
        (void)fsdp_unit_groups(ParamLayout(c), c.fsdp);  // refuses a bad wrap policy
        if (c.fsdp.sharding_strategy == "HYBRID_SHARD") (void)hybrid_replicas(c, env);
    }
    const long per_step = c.device_train_microbatch_size * env.world_size;
    if (c.global_train_batch_size % per_step != 0) {
        user_error(
            "global_train_batch_size {} is not a multiple of device_train_microbatch_size {} x {} ranks (global = "
            "micro-batch x accumulation steps x ranks)",
            c.global_train_batch_size, c.device_train_microbatch_size, env.world_size);
    }
}

}  // namespace

std::string check_device_supported(const TrainConfig& c, int world_size) {
    const std::string device = resolve_device(c.device);
    if (c.precision == "amp_bf16" && device != "cuda") {
        user_error("precision \"amp_bf16\" needs the CUDA backend (device is {}); on CPU use --precision fp32", device);
    }
    const int T = static_cast<int>(c.model.max_sequence_length - 1), HS = c.model.head_size();
    if (device != "cuda" && c.kernels_attention != "native") {
        user_error("kernels.attention \"{}\" is a CUDA kernel; the {} backend has native attention only",
                   c.kernels_attention, device);
    }
    if (device == "cuda" && c.kernels_attention == "native" && HS > kCudaNativeAttentionMaxHeadSize) {
        user_error(
            "the native CUDA attention takes heads of up to {} channels, this model's have {} (model.d_model / "
            "model.n_heads)",
            kCudaNativeAttentionMaxHeadSize, HS);
    }
    if (c.kernels_attention == "cudnn" && device == "cuda") {
        if (c.precision != "amp_bf16") {
            user_error(
                "kernels.attention \"cudnn\" computes attention in bf16; use it with --precision amp_bf16 (fp32 "
                "runs use the native kernels)");
        }
        const std::string why = cudnn_attention_unsupported(T, HS);
        if (!why.empty())
            user_error(
                "kernels.attention \"cudnn\": cuDNN's fused attention cannot run a {}; use kernels.attention=native",
                why);
    }
    if (c.distributed_backend == "nccl" && device != "cuda") {
        user_error("distributed_backend \"nccl\" needs --device cuda (device is {}); use gloo or auto", device);
    }
    if (c.distributed_backend == "gloo" && device == "cuda" && world_size > 1) {
        user_error(
            "distributed_backend \"gloo\" carries host memory, but the device is cuda; use nccl (or auto) on GPUs");
    }
    return device;
}

BackendOptions backend_options(const TrainConfig& c, int local_rank) {
    BackendOptions o;
    o.bf16_matmuls = c.precision == "amp_bf16";
    o.attention = c.kernels_attention;
    o.device_index = local_rank;
    return o;
}

namespace {

// The collectives library for this run: nccl or gloo among several ranks (or nccl when forced), none for
// a lone process.
std::string comm_library(const TrainConfig& c, const std::string& device, int world) {
    if (c.distributed_backend == "nccl") return "nccl";
    if (world == 1) return "local";
    if (c.distributed_backend == "gloo") return "gloo";
    return device == "cuda" ? "nccl" : "gloo";
}

// Where this rank's Gloo pairs listen: TRAINER_GLOO_HOST when set, loopback on one node, else this
// machine's hostname (which the other nodes must resolve to a routable address).
std::string gloo_bind_host(const RankEnv& env) {
    if (const char* h = std::getenv("TRAINER_GLOO_HOST")) return h;
    if (env.num_nodes() == 1) return "127.0.0.1";
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) user_error("rank {}: gethostname failed", env.rank);
    return name;
}

// The strategy the config names, over `comm` (all ranks). HYBRID_SHARD's shard and replica groups are
// created by `make_group` (prefix, rank in the group, group size) and kept in *sub_comms, which must
// outlive the strategy.
using GroupFactory = std::function<std::unique_ptr<Communicator>(const std::string& prefix, int rank, int size)>;
std::unique_ptr<Strategy> make_strategy(const TrainConfig& config, const RankEnv& env, Backend* backend,
                                        const ParamLayout& layout, Communicator* comm, const GroupFactory& make_group,
                                        std::vector<std::unique_ptr<Communicator>>* sub_comms) {
    const FsdpConfig& fc = config.fsdp;
    const WirePrecision wire{fc.precision != "fp32", fc.precision == "pure"};
    if (config.distributed_strategy == "single") return make_single_strategy(backend, layout);
    if (config.distributed_strategy == "ddp") {
        return make_ddp_strategy(backend, layout, comm, config.ddp_grad_sync_mode == "micro_batch", "ddp");
    }
    if (fc.sharding_strategy == "NO_SHARD") {
        return make_ddp_strategy(backend, layout, comm, fc.grad_sync_mode == "micro_batch",
                                 "fsdp NO_SHARD " + fc.precision, wire);
    }
    FsdpOptions o;
    o.groups = fsdp_unit_groups(layout, fc);
    o.keep_params_for_step = fc.sharding_strategy == "SHARD_GRAD_OP";
    o.reduce_every_micro_batch = fc.grad_sync_mode == "micro_batch";
    o.precision = wire;
    o.forward_prefetch = fc.forward_prefetch;
    o.backward_prefetch = fc.backward_prefetch;
    o.limit_all_gathers = fc.limit_all_gathers;
    Communicator *group = comm, *replicas = nullptr;
    if (fc.sharding_strategy == "HYBRID_SHARD") {
        // Shard groups of consecutive ranks; replica groups join the ranks holding the same shard.
        const int n_replicas = hybrid_replicas(config, env), per = env.world_size / n_replicas, rank = env.rank;
        if (n_replicas > 1 && per > 1) {
            sub_comms->push_back(make_group(fmt::format("shard{}", rank / per), rank % per, per));
            sub_comms->push_back(make_group(fmt::format("replica{}", rank % per), rank / per, n_replicas));
            group = (*sub_comms)[0].get();
            replicas = (*sub_comms)[1].get();
        } else if (n_replicas > 1) {  // shard groups of one: every rank a full replica
            sub_comms->push_back(make_local_communicator(backend));
            group = (*sub_comms)[0].get();
            replicas = comm;
        }
    }
    return make_fsdp_strategy(backend, layout, comm, group, replicas, o,
                              fmt::format("fsdp {} {} {} {}", fc.sharding_strategy,
                                          fc.wrapping_strategy.value_or("null"), fc.precision, fc.grad_sync_mode));
}

// Mean loss of one evaluator over its batches (file order).
double evaluate(const TokenDataset& data, const EvaluatorConfig& ev, Model& model, long batch) {
    const long L = data.seq_len();
    long batches = (data.num_instances() + batch - 1) / batch;
    if (ev.subset_num_batches > 0) batches = std::min(batches, ev.subset_num_batches);
    std::vector<int32_t> tokens(static_cast<size_t>(batch) * L);
    double loss = 0.0;
    long predicted = 0;
    for (long b = 0; b < batches; ++b) {
        const long first = b * batch;
        const int n = static_cast<int>(std::min(batch, data.num_instances() - first));
        for (int i = 0; i < n; ++i) data.read_instance(first + i, tokens.data() + static_cast<size_t>(i) * L);
        loss += model.forward_loss(tokens.data(), n);
        predicted += static_cast<long>(n) * (L - 1);
    }
    return loss / static_cast<double>(predicted);
}

class ProgressBar {
   public:
    ProgressBar(long total) : total_(total), enabled_(::isatty(fileno(stdout)) != 0) {}
    void clear() {
        if (enabled_ && drawn_) std::printf("\r\033[K");
        drawn_ = false;
    }
    void draw(long step, double eta_s) {
        if (!enabled_) return;
        const int width = 30;
        const int filled = static_cast<int>(width * static_cast<double>(step) / static_cast<double>(total_));
        std::printf("\r[%.*s%*s] %ld/%ld  eta %.0fs", filled, "==============================", width - filled, "",
                    step, total_, eta_s);
        std::fflush(stdout);
        drawn_ = true;
    }

   private:
    long total_;
    bool enabled_;
    bool drawn_ = false;
};

// Every rank's peak memory so far by category, plus total and measured peak resident memory, gathered
// over `comm` (a collective: every rank calls it).
Json gather_peak_memory(Communicator& comm, int world, const Backend& backend) {
    const MemorySnapshot mem = memory_snapshot();
    constexpr int kMemFields = kNumMemCategories + 3;  // the categories, total, resident, device pool
    std::vector<double> mine(kMemFields), all(static_cast<size_t>(kMemFields) * world);
    for (int c = 0; c < kNumMemCategories; ++c) mine[c] = static_cast<double>(mem.peak[c]);
    mine[kNumMemCategories] = static_cast<double>(mem.total_peak);
    mine[kNumMemCategories + 1] = static_cast<double>(process_peak_resident_bytes());
    mine[kNumMemCategories + 2] = static_cast<double>(backend.device_peak_bytes());
    comm.all_gather(mine.data(), all.data(), kMemFields, CommDType::kFloat64).wait();
    Json per_rank = Json::array();
    for (int r = 0; r < world; ++r) {
        const double* v = all.data() + static_cast<size_t>(r) * kMemFields;
        Json m = Json::object();
        for (int c = 0; c < kNumMemCategories; ++c)
            m[mem_category_name(static_cast<MemCategory>(c))] = static_cast<int64_t>(v[c]);
        m["total"] = static_cast<int64_t>(v[kNumMemCategories]);
        m["resident"] = static_cast<int64_t>(v[kNumMemCategories + 1]);
        if (backend.name() != "cpu") m["device_pool"] = static_cast<int64_t>(v[kNumMemCategories + 2]);
        per_rank.push_back(m);
    }
    return per_rank;
}

}  // namespace

int configure_threads(int threads) {
    if (threads <= 0 && std::getenv("OMP_NUM_THREADS")) {
        threads = std::atoi(std::getenv("OMP_NUM_THREADS"));  // e.g. the launcher's share of the cores
    }
    if (threads <= 0) {
        cpu_set_t set;
        threads = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                              : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
        if (threads <= 0) threads = 1;
    }
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    return threads;
}

int run_training(const TrainConfig& config) {
    // ---- everything that can refuse the run, before any large allocation ----
    const RankEnv env = detect_rank_env();
    check_strategy_supported(config, env);
    const int world = env.world_size, rank = env.rank;
    if (rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) {
        user_error("rank {}: cannot silence stdout", rank);  // rank 0 alone logs; errors still reach stderr
    }
    const std::string device = check_device_supported(config, env.world_size);
    const std::string library = comm_library(config, device, world);
    const ModelConfig& m = config.model;
    const TokenDataset train_data(config.data.paths, parse_token_dtype(config.data.memmap_dtype), m.max_sequence_length,
                                  m.vocab_size);
    std::vector<std::unique_ptr<TokenDataset>> eval_data;
    for (size_t i = 0; i < config.evaluators.size(); ++i) {
        const auto& ev = config.evaluators[i];
        eval_data.push_back(std::make_unique<TokenDataset>(
            ev.paths, parse_token_dtype(ev.memmap_dtype, fmt::format("evaluators[{}].data.memmap_dtype", i)),
            m.max_sequence_length, m.vocab_size, fmt::format("evaluators[{}].data.paths", i)));
    }
    const InstanceOrder order(train_data.num_instances(), config.global_train_batch_size, config.data.seed,
                              config.data.shuffle);
    const long total_steps = config.total_steps(train_data.num_instances());
    std::optional<std::string> resume_path;
    if (config.load_path) resume_path = resolve_checkpoint(config, *config.load_path);
    if (config.save_folder && !resume_path && !config.save_overwrite) {
        if (auto last = latest_checkpoint_step(*config.save_folder)) {
            user_error(
                "save_folder {} already holds checkpoints (newest step{}); resume with --load-path latest, "
                "choose another folder, or set save_overwrite=true",
                *config.save_folder, *last);
        }
    }
    std::map<std::string, Tensor> init_tensors;
    const bool use_init_from = config.init_from && !resume_path;  // a checkpoint's weights supersede init_from
    if (use_init_from) {
        hf_family(m, "--init-from " + *config.init_from);
        init_tensors = read_safetensors(*config.init_from);
    }
    MetricsWriter metrics(rank == 0 ? config.metrics_file : std::nullopt, resume_path.has_value());
    const int threads = configure_threads(config.threads);
    const long micro = config.device_train_microbatch_size;
    const long accumulation = config.accumulation_steps(world);

    // ---- build ----
    auto backend = make_backend(device, backend_options(config, env.local_rank));
    const ParamLayout layout(config);
    // Ranks meet at rank 0's store; Gloo (loopback for one node) or NCCL connects them.
    std::unique_ptr<TcpStoreServer> store_server;
    std::unique_ptr<TcpStore> store;
    std::unique_ptr<Communicator> comm;
    const auto timeout = std::chrono::milliseconds(static_cast<long>(config.distributed_timeout_seconds * 1000));
    const GroupFactory make_group = [&](const std::string& prefix, int r, int n) -> std::unique_ptr<Communicator> {
        if (library == "nccl") return make_nccl_communicator(*store, prefix, r, n, timeout, backend.get());
        if (library == "gloo") return make_gloo_communicator(*store, prefix, r, n, timeout, gloo_bind_host(env));
        return make_local_communicator(backend.get());
    };
    if (library != "local") {
        if (rank == 0) store_server = std::make_unique<TcpStoreServer>(env.master_port);
        store = std::make_unique<TcpStore>(env.master_addr, env.master_port, timeout);
    }
    comm = make_group("world", rank, world);
    std::vector<std::unique_ptr<Communicator>> sub_comms;  // HYBRID_SHARD's groups, alive with the strategy
    const std::unique_ptr<Strategy> strategy =
        make_strategy(config, env, backend.get(), layout, comm.get(), make_group, &sub_comms);
    load_initial_params(config, layout, *strategy, use_init_from ? &init_tensors : nullptr,
                        config.init_from.value_or(""));
    init_tensors.clear();
    long start_step = 0;
    if (resume_path) {
        const CheckpointInfo info = load_checkpoint(config, layout, backend.get(), *strategy, *resume_path);
        start_step = info.step;
        std::printf("resumed from %s at step %ld\n", resume_path->c_str(), start_step);
    }
    const long eval_batch = config.device_eval_batch_size;
    Model model(config, layout, backend.get(), strategy.get(), static_cast<int>(std::max(micro, eval_batch)));
    AdamW optimizer(config, layout, backend.get());

    const long L = m.max_sequence_length;
    const double fpt = flops_per_token(m, layout);
    PeakFlops peak;
    if (device == "cuda") {
        const bool bf16 = config.precision == "amp_bf16";
        peak.flops = backend->peak_flops(bf16, &peak.how);
        if (config.peak_flops_per_device) {
            peak = {*config.peak_flops_per_device,
                    fmt::format("configured {:.1f} TFLOP/s per device", *config.peak_flops_per_device / 1e12)};
        }
    } else {
        peak = cpu_peak_flops(threads, config.peak_flops_per_device);
    }
    const double tokens_per_step =
        static_cast<double>(config.global_train_batch_size) * L;  // OLMo counts L per instance
    const double flops_per_step = fpt * static_cast<double>(config.global_train_batch_size) * (L - 1);
    std::printf(
        "run %s: %s parameters (%s in matmuls) in %d units, strategy %s, device %s (%s), collectives %s, %d "
        "threads\n",
        config.run_name.c_str(), human_count(static_cast<double>(layout.total_numel())).c_str(),
        human_count(static_cast<double>(layout.matmul_numel())).c_str(), layout.num_units(), strategy->name().c_str(),
        backend->name().c_str(), config.precision.c_str(), library.c_str(), threads);
    std::printf("data: %ld instances of %ld tokens; %ld steps of %ld instances (micro-batch %ld x %ld accumulation)\n",
                static_cast<long>(train_data.num_instances()), L, total_steps, config.global_train_batch_size, micro,
                accumulation);
    std::printf(
        "FLOPs per token = 6N + 12*L*d*T = 6*%zu + 12*%d*%d*%ld = %.4g (N: matmul parameters, T = %ld "
        "predicted positions)\n",
        layout.matmul_numel(), m.n_layers, m.d_model, L - 1, fpt, L - 1);
    std::printf("MFU peak: %.1f GFLOP/s = %s\n", peak.flops / 1e9, peak.how.c_str());
    if (backend->name() == "cpu") std::printf("GEMMs: %s\n", cpu_blas_description().c_str());
    std::fflush(stdout);

    ProgressBar bar(total_steps);
    std::vector<int64_t> global_batch, local;
    std::vector<int32_t> tokens(static_cast<size_t>(micro) * L);
    // Each rank's loss gradient is scaled so that the strategies' mean reduction yields the gradient of the
    // global-batch mean loss (world / global tokens).
    const float dloss_scale =
        static_cast<float>(world / (static_cast<double>(config.global_train_batch_size) * (L - 1)));
    double total_time = 0.0, last_loss = 0.0, total_comm_wait = 0.0;
    long timed_steps = 0;
    const auto run_t0 = Clock::now();

    auto run_evals = [&](long step, Json& record) {
        Json all = Json::object();
        for (size_t i = 0; i < eval_data.size(); ++i) {
            const double v = evaluate(*eval_data[i], config.evaluators[i], model, eval_batch);
            all[config.evaluators[i].label] = v;
            if (i == 0) record["val_loss"] = v;
            bar.clear();
            std::printf("step %ld | eval %s | loss %.4f\n", step, config.evaluators[i].label.c_str(), v);
        }
        if (eval_data.size() > 1) record["val_losses"] = all;
    };

    for (long step = start_step + 1; step <= total_steps; ++step) {
        const auto t0 = Clock::now();
        strategy->take_comm_wait_seconds();  // what evaluation and checkpoints waited is not the step's
        order.global_batch(step - 1, global_batch);
        InstanceOrder::rank_slice(global_batch, strategy->rank(), world, local);
        strategy->zero_grads();
        strategy->begin_step(static_cast<int>(accumulation));
        double loss_sum = 0.0;
        for (long k = 0; k < accumulation; ++k) {
            strategy->begin_micro_batch(static_cast<int>(k));
            for (long i = 0; i < micro; ++i) {
                train_data.read_instance(local[k * micro + i], tokens.data() + static_cast<size_t>(i) * L);
            }
            loss_sum += model.forward_backward(tokens.data(), static_cast<int>(micro), dloss_scale);
        }
        strategy->finish_backward();
        const double loss =
            strategy->all_reduce_sum(loss_sum) / (static_cast<double>(config.global_train_batch_size) * (L - 1));
        if (!std::isfinite(loss))
            user_error("step {}: the loss is {} (diverged); lower optimizer.learning_rate", step, loss);
        const OptimizerStepResult opt = optimizer.step(*strategy, step, total_steps);
        backend->synchronize();
        const double dt = seconds_since(t0);
        const double comm_wait = strategy->take_comm_wait_seconds();
        if (step > start_step + 1 || total_steps - start_step == 1) {  // the first step warms caches
            total_time += dt;
            total_comm_wait += comm_wait;
            ++timed_steps;
        }
        last_loss = loss;
        const double tps = tokens_per_step / world / dt;
        const double mfu = flops_per_step / world / dt / peak.flops;
        Json record = {{"step", step},
                       {"loss", loss},
                       {"lr", opt.lr},
                       {"grad_norm", opt.grad_norm},
                       {"tokens_per_second_per_device", tps},
                       {"mfu", mfu},
                       {"step_time_ms", dt * 1e3},
                       {"comm_wait_ms", comm_wait * 1e3}};
        if (config.eval_interval > 0 && (step % config.eval_interval == 0 || step == total_steps)) {
            run_evals(step, record);
        }
        // The metrics file's step records carry every rank's peak memory so far (one tiny all-gather).
        if (config.metrics_file) record["peak_memory_bytes_per_rank"] = gather_peak_memory(*comm, world, *backend);
        if (step % config.console_log_interval == 0 || step == total_steps || step == start_step + 1) {
            bar.clear();
            std::printf(
                "step %ld/%ld | loss %.4f | lr %.3e | grad_norm %.4f | tok/s/dev %.0f | mfu %.1f%% | step %.1f ms\n",
                step, total_steps, loss, opt.lr, opt.grad_norm, tps, 100.0 * mfu, dt * 1e3);
        }
        metrics.write(record);
        // A replicated strategy's state is the same on every rank: rank 0 alone writes it.
        // Every rank takes part (barriers); the strategy says which ranks write shard files.
        if (config.save_folder &&
            ((config.save_interval > 0 && step % config.save_interval == 0) || step == total_steps)) {
            const std::string path = save_checkpoint(config, layout, backend.get(), *strategy, step);
            bar.clear();
            std::printf("saved checkpoint %s\n", path.c_str());
        }
        bar.draw(step, (total_steps - step) * (total_time / std::max<long>(1, timed_steps)));
        std::fflush(stdout);
    }
    bar.clear();

    // Every rank's peak memory by category, gathered to every rank (rank 0 writes it).
    const MemorySnapshot mem = memory_snapshot();
    const Json per_rank = gather_peak_memory(*comm, world, *backend);
    const Json& peak_mem = per_rank[rank];
    const double mean_step = timed_steps > 0 ? total_time / timed_steps : 0.0;
    const double tps = mean_step > 0 ? tokens_per_step / world / mean_step : 0.0;
    const double mfu = mean_step > 0 ? flops_per_step / world / mean_step / peak.flops : 0.0;
    Json summary = {{"event", "summary"},
                    {"steps", total_steps - start_step},
                    {"final_step", total_steps},
                    {"final_loss", last_loss},
                    {"tokens_per_second_per_device", tps},
                    {"mfu", mfu},
                    {"mean_step_time_ms", mean_step * 1e3},
                    {"mean_comm_wait_ms", timed_steps > 0 ? total_comm_wait / timed_steps * 1e3 : 0.0},
                    {"wall_time_s", seconds_since(run_t0)},
                    {"flops_per_token", fpt},
                    {"peak_flops_per_device", peak.flops},
                    {"peak_memory_bytes", peak_mem},
                    {"peak_memory_bytes_per_rank", per_rank}};
    metrics.write(summary);
    if (total_steps > start_step) {
        std::printf(
            "done: %ld steps | final loss %.4f | %.0f tokens/s/device | MFU %.1f%% | mean step %.1f ms | peak "
            "memory %.1f MiB (params %.1f, grads %.1f, optimizer %.1f, activations %.1f), resident %.1f MiB\n",
            total_steps - start_step, last_loss, tps, 100.0 * mfu, mean_step * 1e3, mem.total_peak / 1048576.0,
            mem.peak[0] / 1048576.0, mem.peak[1] / 1048576.0, mem.peak[2] / 1048576.0, mem.peak[4] / 1048576.0,
            process_peak_resident_bytes() / 1048576.0);
    } else {
        std::printf("nothing to do: the checkpoint is already at step %ld of %ld\n", start_step, total_steps);
    }
    return 0;
}

}  // namespace trainer
