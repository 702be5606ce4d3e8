// The step loop (see train.h). A run goes preflight -> build -> steps -> summary. Step order
// (torchtitan's): zero grads -> forward/backward per micro-batch -> reduce grads -> global grad norm ->
// clip -> AdamW on the owned shard -> LR schedule (inside AdamW::step).
#include "core/train.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>

#include "base/common.h"
#include "base/layout.h"
#include "base/stop.h"
#include "base/trace.h"
#include "base/utf8.h"
#include "core/data/bpe.h"
#include "core/data/data.h"
#include "core/data/mixture.h"
#include "core/generate.h"
#include "core/metrics.h"
#include "core/model.h"
#include "core/optimizer.h"
#include "core/plan/host_memory.h"
#include "core/run/exchange.h"
#include "core/run/step.h"
#include "core/tensorboard.h"
#include "core/weights/async_save.h"
#include "core/weights/checkpoint.h"
#include "core/weights/hf_export.h"
#include "core/weights/hf_names.h"
#include "core/weights/safetensors.h"
#include "core/weights/save_folder.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/rank_env.h"
#include "parallel/setup.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

std::string human_count(double x) {
    if (x >= 1e9) return fmt::format("{:.2f}B", x / 1e9);
    if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
    if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
    return fmt::format("{:.0f}", x);
}

// Mean loss of one evaluator over its first batches (all of them, or subset_num_batches of `batch`
// instances), split across the ranks: rank r of W takes a contiguous 1/W of those instances in batches of
// up to `batch`, and the loss sums and predicted-token counts are summed over the ranks. Every rank runs
// the same number of forwards (FSDP gathers inside them): one past its share runs its first instance
// again and adds nothing. Before each forward the ranks vote on a stop signal (base/stop.h) in one small
// all-reduce, so a stop does not wait for a whole validation set: on an agreed stop, *stop_signal is set
// and the result is NaN.
double evaluate(const TokenDataset& data, const EvaluatorConfig& ev, Model& model, Strategy& strategy, long batch,
                int* stop_signal) {
    const long L = data.seq_len();
    long instances = data.num_instances();
    if (ev.subset_num_batches > 0) instances = std::min(instances, ev.subset_num_batches * batch);
    const long world = strategy.world_size(), rank = strategy.rank();
    const long begin = instances * rank / world, end = instances * (rank + 1) / world;
    const long most = (instances + world - 1) / world;  // the largest share
    const long forwards = (most + batch - 1) / batch;
    std::vector<int32_t> tokens(static_cast<size_t>(batch) * L);
    double sums[2] = {0.0, 0.0};  // loss, predicted tokens
    for (long b = 0; b < forwards; ++b) {
        double votes[stop::kVotes] = {};
        stop::vote(votes);
        strategy.all_reduce_sum(votes, stop::kVotes);
        if (const int sig = stop::agreed(votes)) {
            *stop_signal = sig;
            return std::numeric_limits<double>::quiet_NaN();
        }
        const long first = begin + b * batch;
        const int n = static_cast<int>(std::max(0L, std::min(batch, end - first)));
        if (n == 0) {
            data.read_instance(std::min(begin, instances - 1), tokens.data());
            (void)model.forward_loss(tokens.data(), 1);
            continue;
        }
        for (int i = 0; i < n; ++i) data.read_instance(first + i, tokens.data() + static_cast<size_t>(i) * L);
        sums[0] += model.forward_loss(tokens.data(), n);
        sums[1] += static_cast<double>(n) * (L - 1);
    }
    strategy.all_reduce_sum(sums, 2);
    return sums[0] / sums[1];
}

class ProgressBar {
   public:
    // Drawn on a terminal only; mpirun hands its ranks a pseudo-terminal whatever its own output is (often a
    // log file), so never under mpirun.
    ProgressBar(long total)
        : total_(total), enabled_(::isatty(fileno(stdout)) != 0 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) {}
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

// Every rank's peak memory so far by category, plus the accounted device total, the host total (CPU
// offload), the measured peak resident memory, the backend's pool high-water mark (device memory on GPUs,
// the host pool on the CPU), and what no category counts: the device pool beyond the device total on GPUs
// (`on_device`), resident memory beyond both totals on the CPU (where the host categories live in the same
// memory). Gathered over `comm` (a collective: every rank calls it).
Json gather_peak_memory(Communicator& comm, const Backend& backend, bool on_device) {
    const int world = comm.size();
    const MemorySnapshot mem = memory_snapshot();
    enum { kTotal = kNumMemCategories, kHost, kResident, kPool, kMemFields };
    std::vector<double> mine(kMemFields), all(static_cast<size_t>(kMemFields) * world);
    for (int c = 0; c < kNumMemCategories; ++c) mine[c] = static_cast<double>(mem.peak[c]);
    mine[kTotal] = static_cast<double>(mem.total_peak);
    mine[kHost] = static_cast<double>(mem.host_peak);
    mine[kResident] = static_cast<double>(process_peak_resident_bytes());
    mine[kPool] = static_cast<double>(backend.device_peak_bytes());
    comm.all_gather(mine.data(), all.data(), kMemFields, CommDType::kFloat64).wait();
    Json per_rank = Json::array();
    for (int r = 0; r < world; ++r) {
        const double* v = all.data() + static_cast<size_t>(r) * kMemFields;
        Json m = Json::object();
        for (int c = 0; c < kNumMemCategories; ++c)
            m[mem_category_name(static_cast<MemCategory>(c))] = static_cast<int64_t>(v[c]);
        m["total"] = static_cast<int64_t>(v[kTotal]);
        m["host_total"] = static_cast<int64_t>(v[kHost]);
        m["resident"] = static_cast<int64_t>(v[kResident]);
        m["device_pool"] = static_cast<int64_t>(v[kPool]);
        m["unaccounted"] = static_cast<int64_t>(on_device ? v[kPool] - v[kTotal] : v[kResident] - v[kTotal] - v[kHost]);
        per_rank.push_back(m);
    }
    return per_rank;
}

// Where rank `rank` of `world` writes its trace: `path` itself for one rank, else path with ".rank<r>"
// before its extension (trace.json -> trace.rank1.json), merged by scripts/merge_traces.py.
std::string trace_path(const std::string& path, int rank, int world) {
    if (world == 1) return path;
    const size_t slash = path.find_last_of('/'), dot = path.find_last_of('.');
    const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
    const std::string stem = has_ext ? path.substr(0, dot) : path, ext = has_ext ? path.substr(dot) : "";
    return fmt::format("{}.rank{}{}", stem, rank, ext);
}

// One optimizer step's results, as the log and the metrics file report them.
struct StepOutcome {
    double loss = 0.0;          // the cross-entropy, mean over the global batch's predicted tokens
    double z_loss = 0.0;        // the z-loss's mean (softmax_auxiliary_loss), 0 without one
    long masked_instances = 0;  // the global batch's instances the instance filter masked
    OptimizerStepResult opt;
    double seconds = 0.0, comm_wait = 0.0;
    Backend::Activity activity;  // the device's busy and wait time, when measured
    int stop_signal = 0;         // the ranks agreed to stop after this step (base/stop.h), 0: go on
    // Every console_log_interval steps on several ranks: each rank's mean compute time a step (the step less its
    // waits on collectives) over the `compute_steps` steps before this one, exchanged in the loss all-reduce.
    std::vector<double> compute_per_rank;
    long compute_steps = 0;
    bool recorded_graph = false;  // kernels.cuda_graphs: a micro-batch was recorded (a one-off cost)
};

// One training run, from preflight to summary. Members are declared in build order, so they are destroyed
// in reverse: the model and the strategy before the layout and the backend they use.
class TrainingRun {
   public:
    explicit TrainingRun(const TrainConfig& config) : config_(config), m_(config_.model) {}

    int run() {
        preflight();
        build();
        print_header();
        stop::install();
        run_t0_ = Clock::now();
        for (long step = start_step_ + 1; step <= total_steps_; ++step) {
            const StepOutcome r = train_step(step);
            const int eval_stop = after_step(step, r);
            if (governor_) follow_free_cores();
            const int sig = r.stop_signal != 0 ? r.stop_signal : eval_stop;
            if (sig != 0 && step < total_steps_) return stop_after(step, sig);
        }
        bar_->clear();
        summary(total_steps_);
        return 0;
    }

   private:
    // Everything that can refuse the run, checked before any large allocation.
    void preflight() {
        env_ = detect_rank_env();
        const Device device = check_device_config(config_);
        device_ = device;
        silence_stdout_unless_rank0(env_);
        // distributed_strategy auto is resolved before the run is built (resolve_training_config).
        TRAINER_CHECK(config_.distributed_strategy != DistributedStrategy::kAuto,
                      "distributed_strategy auto reached the training loop unresolved");
        check_parallel_config(config_, env_, device);
        if (config_.save_interval > 0 && !config_.save_folder) {  // a training question: logits and plan never save
            user_error("config save_interval: {} but save_folder is not set; set save_folder (--save-folder)",
                       config_.save_interval);
        }
        device_index_ = rank_device(config_, env_, device);
        if (const char* nan = std::getenv("TRAINER_DEBUG_NAN_GRADIENT")) {
            // Test hook, "RANK:STEP": that rank's gradients at that step are NaN (before their reduction).
            long r = -1, s = -1;
            if (std::sscanf(nan, "%ld:%ld", &r, &s) == 2 && r == env_.rank) nan_gradient_step_ = s;
        }
        check_host_memory(config_, env_, device);
        check_shared_device_memory(config_, env_, device, device_index_);
        const std::vector<DataSource>& sources = config_.data.sources;
        std::vector<std::string> paths = config_.data.paths;
        for (const DataSource& s : sources) paths.insert(paths.end(), s.paths.begin(), s.paths.end());
        train_data_ =
            std::make_unique<TokenDataset>(paths, parse_token_dtype(config_.data.memmap_dtype), m_.max_sequence_length,
                                           m_.vocab_size, sources.empty() ? "data.paths" : "data.sources[].paths");
        for (size_t i = 0; i < config_.evaluators.size(); ++i) {
            const auto& ev = config_.evaluators[i];
            eval_data_.push_back(std::make_unique<TokenDataset>(
                ev.paths, parse_token_dtype(ev.memmap_dtype, fmt::format("evaluators[{}].data.memmap_dtype", i)),
                m_.max_sequence_length, m_.vocab_size, fmt::format("evaluators[{}].data.paths", i)));
        }
        total_steps_ = config_.total_steps(train_data_->num_instances());  // epochs: data.paths alone
        if (sources.empty()) {
            order_ = std::make_unique<InstanceOrder>(train_data_->num_instances(), config_.global_train_batch_size,
                                                     config_.data.seed, config_.data.shuffle);
        } else {
            auto mixture = std::make_unique<MixtureOrder>(mixture_sources(config_.data, *train_data_),
                                                          config_.global_train_batch_size, config_.data.seed,
                                                          config_.data.shuffle);
            std::vector<double> max_repetition;
            for (const DataSource& s : sources) max_repetition.push_back(s.max_repetition_ratio);
            mixture->check_repetition(total_steps_, max_repetition);
            mixture_ = mixture.get();
            order_ = std::move(mixture);
        }
        const SchedulerConfig& sched = config_.scheduler;
        if (sched.name != SchedulerName::kConstant && !sched.t_max && sched.t_warmup >= 1 &&
            sched.t_warmup >= static_cast<double>(total_steps_)) {
            // Flagged in the run's header, not refused: a short trial of a long recipe is a fair use.
            warmup_note_ = fmt::format(
                "note: scheduler.t_warmup is {:g} steps in a run of {}: the learning rate never reaches "
                "optimizer.learning_rate (shorten the warmup or lengthen max_duration if that is not meant)",
                sched.t_warmup, total_steps_);
        }
        if (config_.try_load_latest_save && latest_checkpoint_step(*config_.save_folder)) {
            resume_path_ = resolve_checkpoint(config_, "latest");  // OLMo's meaning: over load_path
            resume_latest_ = true;
        } else if (config_.load_path) {
            resume_path_ = resolve_checkpoint(config_, *config_.load_path);
            resume_latest_ = *config_.load_path == "latest";
        }
        // A checkpoint already in save_folder is never replaced unless save_overwrite: a fresh run may not start
        // there, nor may one resuming an older checkpoint (a rollback after a loss spike would overwrite or
        // interleave with what it branched from): OLMo refuses both unless told.
        const std::optional<long> newest = config_.save_folder && !config_.save_overwrite
                                               ? latest_checkpoint_step(*config_.save_folder)
                                               : std::nullopt;
        if (newest && !resume_path_) {
            user_error(
                "save_folder {} already holds checkpoints (newest step{}); resume with --load-path latest, "
                "choose another folder, or set save_overwrite=true",
                *config_.save_folder, *newest);
        }
        if (newest && resume_path_) {
            const long from = checkpoint_step(*resume_path_);
            if (*newest > from) {
                user_error(
                    "save_folder {} holds checkpoints newer than the one resumed from ({}, step {}): the newest is "
                    "step{}, which this run would overwrite or interleave with; save the branch to another folder "
                    "(--save-folder), or set save_overwrite=true to replace them",
                    *config_.save_folder, *resume_path_, from, *newest);
            }
        }
        use_init_from_ = config_.init_from && !resume_path_;  // a checkpoint's weights supersede init_from
        if (use_init_from_) {
            hf_family(m_, "--init-from " + *config_.init_from);
            init_tensors_ = read_hf_weights(config_, *config_.init_from);
        }
        metrics_ = std::make_unique<MetricsWriter>(env_.rank == 0 ? config_.metrics_file : std::nullopt,
                                                   resume_path_.has_value());
        if (config_.sample.interval > 0) {  // the prompt checked now, not at the first sample
            sample_codec_ =
                std::make_unique<TextCodec>(config_.sample.tokenizer, default_tokenizer_dir(), m_.eos_token_id);
            sample_prompt_ = sample_codec_->encode(config_.sample.prompt, "config sample.prompt");
            if (sample_prompt_.empty()) sample_prompt_.push_back(static_cast<int32_t>(m_.eos_token_id));
            const long positions = static_cast<long>(sample_prompt_.size()) + config_.sample.max_new_tokens;
            if (positions > m_.max_sequence_length) {
                user_error(
                    "config sample.max_new_tokens: {} after a prompt of {} tokens is {} positions, above "
                    "model.max_sequence_length {}",
                    config_.sample.max_new_tokens, sample_prompt_.size(), positions, m_.max_sequence_length);
            }
        }
        if (env_.rank == 0 && config_.tensorboard_dir)
            tensorboard_ = std::make_unique<TensorBoardWriter>(*config_.tensorboard_dir);
        threads_ = configure_threads(config_.threads);
        // threads: 0 on the CPU follows the cores other processes leave (kernels/cpu/machine.h), unless a
        // launcher or the user fixed the count with OMP_NUM_THREADS.
        if (config_.threads == 0 && device_ == Device::kCpu && std::getenv("OMP_NUM_THREADS") == nullptr)
            governor_ = std::make_unique<ThreadGovernor>(threads_max_ = threads_);
        if (config_.trace_file) {
            // Refuse an unwritable path now, not after the run.
            trace_path_ = trace_path(*config_.trace_file, env_.rank, env_.world_size);
            const std::string probe = trace_path_ + ".tmp-" + std::to_string(::getpid());  // as trace::write
            std::FILE* f = std::fopen(probe.c_str(), "w");
            if (f == nullptr) user_error("trace_file {}: cannot be written ({})", trace_path_, std::strerror(errno));
            std::fclose(f);
            std::remove(probe.c_str());
            trace::start(env_.rank);
            trace::name_thread("compute");
        }
    }

    // Backend, layout, the connected ranks and their strategy, the parameters, the model and the optimizer.
    void build() {
        backend_ = make_backend(device_, backend_options(config_, device_index_));
        layout_ = std::make_unique<ParamLayout>(config_);
        world_ = make_world(config_, env_, device_, backend_.get(), *layout_);
        if (config_.save_folder) {
            take_save_folder();
            // What `latest` named before the lock may have been superseded by the run that held it.
            if (resume_latest_) resume_path_ = resolve_checkpoint(config_, "latest");
        }
        Strategy& strategy = *world_.strategy;
        load_initial_params(config_, *layout_, strategy, use_init_from_ ? &init_tensors_ : nullptr,
                            config_.init_from.value_or(""));
        init_tensors_.clear();
        if (resume_path_) {
            const CheckpointInfo info = load_checkpoint(config_, *layout_, backend_.get(), strategy, *resume_path_);
            start_step_ = info.step;
            std::printf("resumed from %s at step %ld%s\n", resume_path_->c_str(), start_step_,
                        env_.restart_count > 0
                            ? fmt::format(" (restart {} of trainer launch --max-restarts)", env_.restart_count).c_str()
                            : "");
        }
        const long micro = config_.device_train_microbatch_size;
        model_ = std::make_unique<Model>(config_, *layout_, backend_.get(), &strategy,
                                         static_cast<int>(std::max(micro, config_.device_eval_batch_size)));
        // cpu_offload.optimizer_state: AdamW runs on the host, with the CPU backend's kernels (the device's own
        // backend when that is the CPU).
        Backend* host = nullptr;
        if (config_.cpu_offload.optimizer_state) {
            if (device_ != Device::kCpu) host_backend_ = make_cpu_backend();
            host = device_ == Device::kCpu ? backend_.get() : host_backend_.get();
        }
        optimizer_ = std::make_unique<AdamW>(config_, *layout_, backend_.get(), host);
        if (config_.async_saves())
            saver_ = std::make_unique<AsyncSaver>(config_, *layout_, backend_.get(), strategy, run_tag_);
        tokens_.resize(static_cast<size_t>(micro) * m_.max_sequence_length);
        keep_.resize(static_cast<size_t>(micro));

        const long L = m_.max_sequence_length;
        flops_per_token_ = flops_per_token(m_, *layout_);
        tokens_per_step_ = static_cast<double>(config_.global_train_batch_size) * L;  // OLMo counts L per instance
        flops_per_step_ = flops_per_token_ * static_cast<double>(config_.global_train_batch_size) * (L - 1);
        if (config_.peak_flops_per_device) {
            peak_flops_ = *config_.peak_flops_per_device;
            peak_how_ = fmt::format("configured {:.1f} TFLOP/s per device", peak_flops_ / 1e12);
        } else {
            peak_flops_ = backend_->peak_flops(config_.precision == Precision::kAmpBf16, &peak_how_);
        }
        bar_ = std::make_unique<ProgressBar>(total_steps_);
    }

    void print_header() const {
        const long L = m_.max_sequence_length;
        // The precision, and on GPUs the attention kernels (kernels.attention auto resolved).
        std::string compute = choice_name(config_.precision);
        if (device_ == Device::kCuda)
            compute += fmt::format(", attention {}", choice_name(resolve_attention(config_, device_)));
        if (config_.kernels_cuda_graphs) compute += ", micro-batches replayed as CUDA graphs";
        std::printf(
            "run %s: %s parameters (%s in matmuls) in %d units, strategy %s, device %s (%s), collectives %s, %d "
            "threads\n",
            config_.run_name.c_str(), human_count(static_cast<double>(layout_->total_numel())).c_str(),
            human_count(static_cast<double>(layout_->matmul_numel())).c_str(), layout_->num_units(),
            world_.strategy->name().c_str(), backend_->name().c_str(), compute.c_str(), choice_name(world_.collectives),
            threads_);
        std::printf(
            "data: %ld instances of %ld tokens; %ld steps of %ld instances (micro-batch %ld x %ld accumulation)\n",
            static_cast<long>(train_data_->num_instances()), L, total_steps_, config_.global_train_batch_size,
            config_.device_train_microbatch_size, config_.accumulation_steps(world_.size()));
        if (!warmup_note_.empty()) std::printf("%s\n", warmup_note_.c_str());
        std::printf(
            "FLOPs per token = 6N + 12*L*d*T = 6*%zu + 12*%d*%d*%ld = %.4g (N: matmul parameters, T = %ld "
            "predicted positions)\n",
            layout_->matmul_numel(), m_.n_layers, m_.d_model, L - 1, flops_per_token_, L - 1);
        std::printf("MFU peak: %.1f GFLOP/s = %s\n", peak_flops_ / 1e9, peak_how_.c_str());
        if (config_.cpu_offload.optimizer_state) {
            std::printf("cpu offload: %s in host memory, %.1f MiB per rank; AdamW on the host\n",
                        config_.cpu_offload.parameters ? "optimizer state and parameters" : "optimizer state",
                        memory_snapshot().host_current / 1048576.0);
        }
        const std::string libraries = backend_->library_description();
        if (!libraries.empty()) std::printf("GEMMs: %s\n", libraries.c_str());
        std::fflush(stdout);
    }

    // Forward and backward of this rank's micro-batches of global batch `step`, the gradient reduction
    // and the optimizer step.
    StepOutcome train_step(long step) {
        Strategy& strategy = *world_.strategy;
        const int world = world_.size();
        const long L = m_.max_sequence_length, micro = config_.device_train_microbatch_size;
        const long accumulation = config_.accumulation_steps(world);
        // Each rank's loss gradient is scaled so that the strategies' mean reduction yields the gradient of
        // the global-batch mean loss (world / global tokens).
        const double global_tokens = static_cast<double>(config_.global_train_batch_size) * (L - 1);
        float dloss_scale = static_cast<float>(world / global_tokens);
        if (step == nan_gradient_step_) dloss_scale = std::numeric_limits<float>::quiet_NaN();
        // The device's busy and wait shares of the step, measured every utilization_interval steps (every
        // step while a trace is recorded: its device tracks come from the same window).
        const bool measure =
            trace::enabled() || (config_.utilization_interval > 0 && step % config_.utilization_interval == 0);
        const auto t0 = Clock::now();
        if (measure) backend_->begin_activity();
        StepOutcome r;
        const long captures_before = model_->graphs().captures();
        strategy.take_comm_wait_seconds();  // what evaluation and checkpoints waited is not the step's
        order_->global_batch(step - 1, global_batch_);
        InstanceOrder::rank_slice(global_batch_, strategy.rank(), world, local_);
        double masked = 0.0;  // instances the instance filter masked, this rank
        StepPlan plan;
        plan.step = step, plan.total_steps = total_steps_, plan.accumulation = accumulation;
        plan.micro = static_cast<int>(micro), plan.dloss_scale = dloss_scale;
        plan.label = trace::active() ? fmt::format("step {}", step) : std::string();
        plan.micro_batch = [&](long k) {
            const trace::Span data("data", "read micro-batch");
            const auto& filter = config_.data.instance_filter;
            for (long i = 0; i < micro; ++i) {
                int32_t* instance = tokens_.data() + static_cast<size_t>(i) * L;
                train_data_->read_instance(local_[k * micro + i], instance);
                keep_[i] = filter && repetitive_instance(instance, static_cast<int>(L), *filter) ? 0 : 1;
                masked += 1 - keep_[i];
            }
            return MicroBatchTokens(tokens_.data(), keep_.data());
        };
        // Beside the loss sums: the masked instances, the ranks' votes on a stop request, while a checkpoint is
        // written in the background their votes on it (core/weights/async_save.h) and, every console_log_interval
        // steps, each rank's compute time a step since the last such step (each rank fills its own slot).
        const bool exchange_compute = world > 1 && step % config_.console_log_interval == 0 && interval_steps_ > 0;
        const bool save_votes = saver_ && saver_->voting();
        plan.fill = [&](RankExchange& ex) {
            ex.value(ex.reserve("masked_instances")) = masked;
            stop::vote(ex.at(ex.reserve("stop_votes", stop::kVotes)));
            if (save_votes) saver_->vote(ex.at(ex.reserve("save_votes", AsyncSaver::kVotes)));
            if (exchange_compute)
                ex.at(ex.reserve("compute_per_rank", world))[strategy.rank()] = interval_compute_ / interval_steps_;
        };
        plan.after_exchange = [&](const RankExchange& ex) {
            r.loss = ex.at(ex.slot("loss"))[0] / global_tokens;
            r.z_loss = ex.at(ex.slot("loss"))[1] / global_tokens;
            if (!std::isfinite(r.loss) || !std::isfinite(r.z_loss)) {
                user_error("step {}: the {} is {} (diverged); {}", step, std::isfinite(r.loss) ? "z-loss" : "loss",
                           std::isfinite(r.loss) ? r.z_loss : r.loss, divergence_advice(config_.optimizer));
            }
        };
        r.opt = run_step(strategy, *model_, *optimizer_, *backend_, exchange_, plan);
        r.masked_instances = static_cast<long>(exchange_.value(exchange_.slot("masked_instances")));
        r.stop_signal = stop::agreed(exchange_.at(exchange_.slot("stop_votes")));
        if (save_votes) saver_->tally(exchange_.at(exchange_.slot("save_votes")));
        if (exchange_compute) {
            const double* per_rank = exchange_.at(exchange_.slot("compute_per_rank"));
            r.compute_per_rank.assign(per_rank, per_rank + world);
            r.compute_steps = interval_steps_;
            interval_compute_ = 0.0;
            interval_steps_ = 0;
        }
        r.seconds = seconds_since(t0);
        r.recorded_graph = model_->graphs().captures() != captures_before;
        r.comm_wait = strategy.take_comm_wait_seconds();
        if (measure) r.activity = backend_->end_activity();
        return r;
    }

    // Totals, the console line and the metrics record, evaluation and checkpoints after a step.
    // Returns the stop signal agreed during the step's evaluation, or 0.
    int after_step(long step, const StepOutcome& r) {
        const int world = world_.size();
        // The first step warms caches, and one that recorded a graph paid for it once: neither is timed
        // (unless it is the only step).
        const bool timed = (step > start_step_ + 1 && !r.recorded_graph) || total_steps_ - start_step_ == 1;
        if (timed) {
            total_time_ += r.seconds;
            total_comm_wait_ += r.comm_wait;
            ++timed_steps_;
        }
        const double compute = std::max(0.0, r.seconds - r.comm_wait);
        interval_compute_ += compute;
        ++interval_steps_;
        run_compute_ += compute;
        ++run_compute_steps_;
        last_loss_ = r.loss;
        const double tps = tokens_per_step_ / world / r.seconds;
        const double mfu = flops_per_step_ / world / r.seconds / peak_flops_;
        Json record = {{"step", step},
                       {"loss", r.loss},
                       {"lr", r.opt.lr},
                       {"grad_norm", r.opt.grad_norm},
                       {"tokens_per_second_per_device", tps},
                       {"mfu", mfu},
                       {"step_time_ms", r.seconds * 1e3},
                       {"comm_wait_ms", r.comm_wait * 1e3}};
        if (config_.z_loss_multiplier > 0.0) record["z_loss"] = r.z_loss;  // OLMo's train/ZLoss
        std::string busy_text;
        if (r.activity.measured) {
            // Shares of the step: the device ran kernels, waited for collectives (the CUDA stream's waits; on
            // the CPU the host's), or had nothing to run, waiting for the host.
            const double busy = std::min(1.0, r.activity.busy_s / r.seconds);
            const double wait =
                std::min(1.0 - busy, (r.activity.wait_s >= 0.0 ? r.activity.wait_s : r.comm_wait) / r.seconds);
            record["device_busy_fraction"] = busy;
            record["device_comm_wait_fraction"] = wait;
            record["device_host_wait_fraction"] = std::max(0.0, 1.0 - busy - wait);
            if (metrics_->writes()) {  // the device's counters, read only where the record is written
                for (const auto& [name, value] : backend_->device_counters()) record[name] = value;
            }
            busy_text = fmt::format(" | busy {:.0f}%", 100.0 * busy);
            if (timed) {
                total_busy_ += busy;
                ++busy_steps_;
            }
        }
        if (config_.data.instance_filter) record["masked_instances"] = r.masked_instances;
        if (mixture_) {  // the tokens each source gave the run so far
            Json by_source = Json::object();
            for (size_t k = 0; k < mixture_->sources().size(); ++k) {
                by_source[mixture_->sources()[k].name] =
                    mixture_->draws(k, step * config_.global_train_batch_size) * m_.max_sequence_length;
            }
            record["tokens_by_source"] = by_source;
        }
        if (!r.compute_per_rank.empty()) report_stragglers(step, r, record);
        int eval_stop = 0;
        if (config_.eval_interval > 0 && (step % config_.eval_interval == 0 || step == total_steps_)) {
            eval_stop = run_evals(step, record);
        }
        if (config_.sample.interval > 0 && step % config_.sample.interval == 0) run_sample(step, record);
        // The metrics file's step records carry every rank's peak memory so far (one tiny all-gather).
        if (config_.metrics_file || config_.tensorboard_dir)
            record["peak_memory_bytes_per_rank"] = peak_memory_per_rank();
        if (step % config_.console_log_interval == 0 || step == total_steps_ || step == start_step_ + 1) {
            bar_->clear();
            const std::string z = config_.z_loss_multiplier > 0.0 ? fmt::format(" | z_loss {:.3e}", r.z_loss) : "";
            std::printf(
                "step %ld/%ld | loss %.4f%s | lr %.3e | grad_norm %.4f | tok/s/dev %.0f | mfu %.1f%% | step %.1f "
                "ms%s\n",
                step, total_steps_, r.loss, z.c_str(), r.opt.lr, r.opt.grad_norm, tps, 100.0 * mfu, r.seconds * 1e3,
                busy_text.c_str());
        }
        if (config_.save_folder &&
            ((config_.save_interval > 0 && step % config_.save_interval == 0) || step == total_steps_)) {
            const auto t0 = Clock::now();
            save(step);
            record["save_ms"] = seconds_since(t0) * 1e3;  // how long the save held the step up
            save_stall_ += seconds_since(t0);
            ++saves_;
        }
        // A checkpoint written in the background and published since the last step: the step it holds (the
        // steps between are those a failure before its publication would also lose).
        report_published();
        if (published_step_) record["checkpoint_published"] = *published_step_;
        published_step_.reset();
        metrics_->write(record);
        if (tensorboard_) tensorboard_->write(step, scalars_of(record));
        bar_->draw(step, (total_steps_ - step) * (total_time_ / std::max<long>(1, timed_steps_)));
        std::fflush(stdout);
        return eval_stop;
    }

    // Names (rank 0, on the console and in the step's record) each rank whose compute time a step over the last
    // exchange's window exceeds straggler_factor times the median rank's, with its host and both times.
    void report_stragglers(long step, const StepOutcome& r, Json& record) {
        const std::vector<int> slow = find_stragglers(r.compute_per_rank, config_.straggler_factor);
        if (slow.empty()) return;
        const double median = lower_median(r.compute_per_rank);
        record["stragglers"] = slow;
        record["compute_ms_median"] = median * 1e3;
        bar_->clear();
        for (const int k : slow) {
            const std::string host = world_.host_of(k);
            std::printf(
                "straggler: rank %d on %s computed %.1f ms a step over steps %ld-%ld, %.2fx the median rank's %.1f "
                "ms (straggler_factor %g)\n",
                k, host.c_str(), r.compute_per_rank[k] * 1e3, step - r.compute_steps, step - 1,
                r.compute_per_rank[k] / median, median * 1e3, config_.straggler_factor);
        }
    }

    void follow_free_cores() {
        const int n = governor_->poll();
        if (n == 0) return;
        bar_->clear();
        std::printf("threads: %d of %d: %s (threads: 0 follows the free cores; a number fixes the count)\n", n,
                    threads_max_, n < threads_ ? "other processes are using the cores" : "cores came free");
        threads_ = n;
    }

    // Before step 1, with the ranks connected: rank 0 takes the save folder's lock (one run at a time,
    // core/weights/save_folder.h) and draws the run's tag; every rank that writes shard files probes the folder, so
    // a folder that cannot be written stops the run now, not after save_interval steps. The outcomes are
    // summed over the ranks, so every rank stops when one cannot go on.
    void take_save_folder() {
        Strategy& strategy = *world_.strategy;
        const std::string& folder = *config_.save_folder;
        auto agree = [&](const std::function<void()>& attempt, double* extra, const std::string& elsewhere) {
            std::exception_ptr failure;
            try {
                attempt();
            } catch (const UserError&) {
                failure = std::current_exception();
            }
            double v[2] = {failure ? 1.0 : 0.0, extra ? *extra : 0.0};
            strategy.all_reduce_sum(v, 2);
            if (failure) std::rethrow_exception(failure);
            if (v[0] > 0) user_error("save_folder {}: {} (its error says why)", folder, elsewhere);
            if (extra) *extra = v[1];
        };
        double tag = 0.0;  // rank 0's draw, the same on every rank after the sum
        agree(
            [&] {
                if (env_.rank != 0) return;
                tag = static_cast<double>(std::random_device{}() & 0xFFFFFFu) * 16777216.0 +
                      static_cast<double>(std::random_device{}() & 0xFFFFFFu);  // 48 bits: exact in a double
                save_lock_ = SaveFolderLock::acquire(folder, fmt::format("{:012x}", static_cast<uint64_t>(tag)));
            },
            &tag, "rank 0 could not take it");
        run_tag_ = fmt::format("{:012x}", static_cast<uint64_t>(tag));
        agree(
            [&] {
                if (strategy.checkpoint_file() >= 0)
                    probe_writable_folder(folder, fmt::format(".probe-{}-rank{}", run_tag_, env_.rank), "save_folder");
            },
            nullptr, "a rank that writes checkpoint shards cannot write it");
    }

    // Every rank takes part; the strategy says which ranks write shard files. save_interval checkpoints of a
    // save_async run are snapshot and written in the background (said once published: report_published); the
    // run's last checkpoint, and one that must be on disk before the run stops (`now`), is written now, once
    // the one in flight is.
    void save(long step, bool now = false) {
        const trace::Span span("checkpoint", "save checkpoint");
        if (saver_ && !now && step != total_steps_) {
            saver_->start(step);
            report_published();  // the one before it, published while start() waited for it
            // Every rank counts it saved: a stop waits for it to be published (finish_saves) before it asks.
            saved_step_ = step;
            saved_path_ = saver_->last_path();
            return;
        }
        finish_saves();
        saved_path_ = save_checkpoint(config_, *layout_, backend_.get(), *world_.strategy, step, run_tag_);
        saved_step_ = step;
        bar_->clear();
        std::printf("saved checkpoint %s\n", saved_path_.c_str());
    }

    // Waits for the checkpoint written in the background, if any (every rank at the same point).
    void finish_saves() {
        if (!saver_) return;
        saver_->wait();
        report_published();
    }

    // Rank 0: says the checkpoint the background thread published since the last step, if any (and keeps its
    // step for the step's record).
    void report_published() {
        if (!saver_) return;
        const std::optional<std::string> path = saver_->take_published();
        if (!path) return;
        bar_->clear();
        std::printf("saved checkpoint %s (written in the background)\n", path->c_str());
        published_step_ = checkpoint_step(*path);
    }

    // The ranks agreed to stop after `step` (a stop signal, base/stop.h): a checkpoint of it when
    // save_folder is set, a metrics record saying so, the summary of the steps run, and 128 + the signal.
    int stop_after(long step, int sig) {
        finish_saves();
        if (config_.save_folder && saved_step_ != step) save(step, /*now=*/true);
        bar_->clear();
        const std::string resume = config_.save_folder
                                       ? fmt::format("checkpoint {}; resume with --load-path latest", saved_path_)
                                       : std::string("no checkpoint (save_folder is not set)");
        std::printf("stopped by %s after step %ld of %ld: %s\n", stop::signal_name(sig), step, total_steps_,
                    resume.c_str());
        Json record = {{"event", "stopped"}, {"step", step}, {"signal", stop::signal_name(sig)}};
        if (config_.save_folder) record["checkpoint"] = saved_path_;
        metrics_->write(record);
        summary(step);
        return stop::exit_code(sig);
    }

    // The model continues sample.prompt: on every rank (a sharded strategy gathers each unit for it), for exactly
    // max_new_tokens tokens (no early stop at EOS, so every rank runs as many steps whatever it draws), with draws
    // seeded by the run's seed and the step; rank 0 prints it.
    void run_sample(long step, Json& record) {
        const trace::Span span("eval", "sample");
        SamplingOptions o;
        o.temperature = config_.sample.temperature, o.top_k = config_.sample.top_k;
        o.seed = config_.seed + static_cast<uint64_t>(step);
        const GenerationResult g =
            generate_tokens(*model_, m_, {sample_prompt_}, config_.sample.max_new_tokens, o, -1, true);
        const std::string text = sample_codec_->decode(g.tokens[0]);
        record["sample"] = valid_utf8(text);
        bar_->clear();
        std::printf("step %ld | sample: %s%s\n", step, config_.sample.prompt.c_str(), text.c_str());
    }

    // Returns the stop signal the ranks agreed on between evaluation batches, or 0.
    int run_evals(long step, Json& record) {
        const auto t0 = Clock::now();
        Json all = Json::object();
        for (size_t i = 0; i < eval_data_.size(); ++i) {
            const trace::Span span("eval", "eval " + config_.evaluators[i].label);
            int sig = 0;
            const double v = evaluate(*eval_data_[i], config_.evaluators[i], *model_, *world_.strategy,
                                      config_.device_eval_batch_size, &sig);
            if (sig != 0) {
                bar_->clear();
                std::printf("step %ld | eval %s interrupted by %s\n", step, config_.evaluators[i].label.c_str(),
                            stop::signal_name(sig));
                record["eval_interrupted_by"] = stop::signal_name(sig);
                return sig;
            }
            all[config_.evaluators[i].label] = v;
            if (i == 0) record["val_loss"] = v;
            bar_->clear();
            std::printf("step %ld | eval %s | loss %.4f\n", step, config_.evaluators[i].label.c_str(), v);
        }
        if (eval_data_.size() > 1) record["val_losses"] = all;
        record["eval_time_ms"] = seconds_since(t0) * 1e3;
        return 0;
    }

    Json peak_memory_per_rank() const { return gather_peak_memory(*world_.comm, *backend_, device_ == Device::kCuda); }

    // The summary record of the steps up to `last_step` (every rank's peak memory by category, gathered to
    // every rank; rank 0 writes it) and the closing console line.
    void summary(long last_step) {
        const int world = world_.size();
        const MemorySnapshot mem = memory_snapshot();
        const Json per_rank = peak_memory_per_rank();
        const double mean_step = timed_steps_ > 0 ? total_time_ / timed_steps_ : 0.0;
        const double tps = mean_step > 0 ? tokens_per_step_ / world / mean_step : 0.0;
        const double mfu = mean_step > 0 ? flops_per_step_ / world / mean_step / peak_flops_ : 0.0;
        Json summary = {{"event", "summary"},
                        {"steps", last_step - start_step_},
                        {"final_step", last_step},
                        {"final_loss", last_loss_},
                        {"tokens_per_second_per_device", tps},
                        {"mfu", mfu},
                        {"mean_step_time_ms", mean_step * 1e3},
                        {"mean_comm_wait_ms", timed_steps_ > 0 ? total_comm_wait_ / timed_steps_ * 1e3 : 0.0},
                        {"wall_time_s", seconds_since(run_t0_)},
                        {"flops_per_token", flops_per_token_},
                        {"peak_flops_per_device", peak_flops_},
                        {"peak_memory_bytes", per_rank[world_.rank()]},
                        {"peak_memory_bytes_per_rank", per_rank}};
        if (busy_steps_ > 0) summary["mean_device_busy_fraction"] = total_busy_ / busy_steps_;
        if (saves_ > 0) {  // the checkpoints' cost to the run: the time the steps waited for them
            summary["checkpoints"] = saves_;
            summary["save_stall_s"] = save_stall_;
            summary["save_async"] = saver_ != nullptr;
        }
        {
            // Every rank's mean compute time a step over the run (its step less its waits on collectives).
            std::vector<double> per_rank(world, 0.0);
            per_rank[world_.rank()] = run_compute_steps_ > 0 ? run_compute_ / run_compute_steps_ : 0.0;
            if (world > 1) world_.strategy->all_reduce_sum(per_rank.data(), world);
            Json ms = Json::array();
            for (const double c : per_rank) ms.push_back(c * 1e3);
            summary["compute_ms_per_rank"] = ms;
        }
        // trainer launch --max-restarts: how often the job was started again after a failure before this round.
        if (env_.restart_count > 0) summary["restarts"] = env_.restart_count;
        if (model_->graphs().enabled()) {  // kernels.cuda_graphs: micro-batches recorded, and launched as graphs
            summary["cuda_graph_captures"] = model_->graphs().captures();
            summary["cuda_graph_launches"] = model_->graphs().launches();
        }
        metrics_->write(summary);
        if (config_.trace_file) {
            trace::write(trace_path_);
            if (env_.rank == 0) std::printf("trace written to %s\n", trace_path_.c_str());
        }
        if (last_step > start_step_) {
            const double mib = 1048576.0;
            auto peak = [&](MemCategory c) { return mem.peak[static_cast<int>(c)] / mib; };
            const std::string host =
                mem.host_peak > 0
                    ? fmt::format(
                          ", host {:.1f} MiB (params {:.1f}, grads {:.1f}, optimizer {:.1f}, checkpoint snapshot "
                          "{:.1f})",
                          mem.host_peak / mib, peak(MemCategory::kHostParameters), peak(MemCategory::kHostGradients),
                          peak(MemCategory::kHostOptimizerState), peak(MemCategory::kHostCheckpoint))
                    : std::string();
            const std::string busy =
                busy_steps_ > 0 ? fmt::format(" (device busy {:.0f}%)", 100.0 * total_busy_ / busy_steps_) : "";
            std::printf(
                "done: %ld steps | final loss %.4f | %.0f tokens/s/device | MFU %.1f%% | mean step %.1f ms%s | peak "
                "memory %.1f MiB (params %.1f, grads %.1f, optimizer %.1f, activations %.1f)%s, resident %.1f MiB\n",
                last_step - start_step_, last_loss_, tps, 100.0 * mfu, mean_step * 1e3, busy.c_str(),
                mem.total_peak / mib, peak(MemCategory::kParameters), peak(MemCategory::kGradients),
                peak(MemCategory::kOptimizerState), peak(MemCategory::kActivations), host.c_str(),
                process_peak_resident_bytes() / mib);
        } else {
            std::printf("nothing to do: the checkpoint is already at step %ld of %ld\n", start_step_, total_steps_);
        }
    }

    TrainConfig config_;  // distributed_strategy auto resolved in preflight
    const ModelConfig& m_;
    // preflight
    RankEnv env_;
    Device device_ = Device::kCpu;
    int device_index_ = 0;         // the GPU this rank computes on (rank_device)
    long nan_gradient_step_ = -1;  // TRAINER_DEBUG_NAN_GRADIENT's step for this rank, or -1
    std::unique_ptr<TokenDataset> train_data_;
    std::vector<std::unique_ptr<TokenDataset>> eval_data_;
    std::unique_ptr<BatchOrder> order_;
    const MixtureOrder* mixture_ = nullptr;  // order_ when data.sources is a mixture
    long total_steps_ = 0, start_step_ = 0;
    std::optional<std::string> resume_path_;
    bool resume_latest_ = false;  // resume_path_ is what "latest" named
    std::string warmup_note_;     // a warmup no shorter than the run, said in the header
    bool use_init_from_ = false;
    std::map<std::string, Tensor> init_tensors_;
    std::string trace_path_;  // this rank's trace file (trace_file)
    std::unique_ptr<MetricsWriter> metrics_;
    std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 with tensorboard_dir
    std::unique_ptr<TextCodec> sample_codec_;         // sample.interval: the sample's tokenizer and prompt
    std::vector<int32_t> sample_prompt_;
    int threads_ = 0, threads_max_ = 0;
    std::unique_ptr<ThreadGovernor> governor_;  // threads: 0 on the CPU
    // build
    std::unique_ptr<Backend> backend_;
    std::unique_ptr<ParamLayout> layout_;
    World world_;
    std::unique_ptr<SaveFolderLock> save_lock_;  // rank 0, while save_folder is set
    std::string run_tag_;                        // names this run's temporary checkpoint folders
    std::unique_ptr<Model> model_;
    std::unique_ptr<Backend> host_backend_;  // cpu_offload on a GPU: the host optimizer's kernels
    std::unique_ptr<AdamW> optimizer_;
    std::unique_ptr<AsyncSaver> saver_;  // save_async: save_interval checkpoints written in the background
    double flops_per_token_ = 0.0, tokens_per_step_ = 0.0, flops_per_step_ = 0.0, peak_flops_ = 0.0;
    std::string peak_how_;
    std::unique_ptr<ProgressBar> bar_;
    // the step loop
    std::vector<int64_t> global_batch_, local_;
    std::vector<int32_t> tokens_;
    std::vector<uint8_t> keep_;  // per instance of a micro-batch: 0 where the instance filter masks it
    double total_time_ = 0.0, total_comm_wait_ = 0.0, last_loss_ = 0.0;
    double total_busy_ = 0.0;  // the measured steps' device_busy_fraction, summed over busy_steps_ of them
    long busy_steps_ = 0;
    long timed_steps_ = 0;
    // Stragglers: this rank's compute time (its steps less their waits on collectives) since the ranks last
    // exchanged theirs, and over the run; the loss all-reduce's buffer.
    double interval_compute_ = 0.0, run_compute_ = 0.0;
    long interval_steps_ = 0, run_compute_steps_ = 0;
    RankExchange exchange_;  // the step's values summed over the ranks
    Clock::time_point run_t0_;
    double save_stall_ = 0.0;  // seconds the steps' saves held the run up, over saves_ of them
    long saves_ = 0;
    std::optional<long> published_step_;  // a background checkpoint published since the last step's record
    long saved_step_ = -1;                // the newest checkpoint this run wrote, and its path
    std::string saved_path_;
};

}  // namespace

int run_training(const TrainConfig& config) { return TrainingRun(config).run(); }

}  // namespace trainer
