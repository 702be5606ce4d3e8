// The step loop (see train.h). A run goes preflight -> build -> steps -> summary. Step order
// (torchtitan's): zero grads -> forward/backward per micro-batch -> reduce grads -> global grad norm ->
// clip -> AdamW on the owned shard -> LR schedule (inside AdamW::step).
#include "core/train.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "base/common.h"
#include "base/layout.h"
#include "base/stop.h"
#include "base/trace.h"
#include "base/utf8.h"
#include "core/generate.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "core/optimizer.h"
#include "core/plan/host_memory.h"
#include "core/run/evaluate.h"
#include "core/run/exchange.h"
#include "core/run/outputs.h"
#include "core/run/report.h"
#include "core/run/run_data.h"
#include "core/run/saves.h"
#include "core/run/stats.h"
#include "core/run/step.h"
#include "core/weights/async_save.h"
#include "core/weights/checkpoint.h"
#include "core/weights/hf_names.h"
#include "core/weights/peft.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "kernels/element.h"
#include "parallel/launch/rank_env.h"
#include "parallel/setup.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

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
        if (config_.eval_on_startup) {
            if (const int sig = eval_on_startup()) return sig;
        }
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
        target_ = resolve_compute(config_);
        device_ = target_.device;
        silence_stdout_unless_rank0(env_);
        // distributed_strategy auto is resolved before the run is built (resolve_training_config).
        TRAINER_CHECK(config_.distributed_strategy != DistributedStrategy::kAuto,
                      "distributed_strategy auto reached the training loop unresolved");
        check_parallel_config(config_, env_, device_);
        if (config_.save_interval > 0 && !config_.save_folder) {  // a training question: logits and plan never save
            user_error("config save_interval: {} but save_folder is not set; set save_folder (--save-folder)",
                       config_.save_interval);
        }
        device_index_ = rank_device(config_, env_, device_);
        if (const char* nan = std::getenv("TRAINER_DEBUG_NAN_GRADIENT")) {
            // Test hook, "RANK:STEP": that rank's gradients at that step are NaN (before their reduction).
            long r = -1, s = -1;
            if (std::sscanf(nan, "%ld:%ld", &r, &s) == 2 && r == env_.rank) nan_gradient_step_ = s;
        }
        check_host_memory(config_, env_, device_);
        check_shared_device_memory(config_, env_, device_, device_index_);
        data_ = open_run_data(config_);
        total_steps_ = data_.total_steps;
        saves_ = std::make_unique<RunSaves>(config_, env_);
        // A checkpoint's weights supersede init_from, but for LoRA's, which holds the adapters only: its frozen base
        // comes from init_from (or the seed) again.
        use_init_from_ = config_.init_from && (!saves_->resume_path() || config_.lora.enabled);
        if (use_init_from_) {
            hf_family(m_, "--init-from " + *config_.init_from);
            init_tensors_ = read_hf_weights(config_, *config_.init_from);
        }
        outputs_ = std::make_unique<RunOutputs>(config_, env_, saves_->resume_path().has_value());
        if (config_.sample.interval > 0) sample_ = open_run_sample(config_);  // the prompt checked now
        threads_ = configure_threads(config_.threads);
        // threads: 0 on the CPU follows the cores other processes leave (kernels/cpu/machine.h), unless a
        // launcher or the user fixed the count with OMP_NUM_THREADS.
        if (config_.threads == 0 && device_ == Device::kCpu && std::getenv("OMP_NUM_THREADS") == nullptr)
            governor_ = std::make_unique<ThreadGovernor>(threads_max_ = threads_);
    }

    // Backend, layout, the connected ranks and their strategy, the parameters, the model and the optimizer.
    void build() {
        backend_ = make_backend(device_, backend_options(config_, target_, device_index_));
        layout_ = std::make_unique<ParamLayout>(config_);
        world_ = make_world(config_, env_, device_, backend_.get(), *layout_);
        Strategy& strategy = *world_.strategy;
        saves_->take_folder(strategy);
        load_initial_params(config_, *layout_, strategy, use_init_from_ ? &init_tensors_ : nullptr,
                            config_.init_from.value_or(""));
        if (config_.lora.enabled) {
            layout_->set_frozen_base(use_init_from_ ? "tensors of checksum " + tensors_checksum(init_tensors_)
                                                    : fmt::format("the initialisation of seed {}", config_.seed));
        }
        init_tensors_.clear();
        if (const std::optional<std::string>& resume = saves_->resume_path()) {
            const CheckpointInfo info = load_checkpoint(config_, *layout_, backend_.get(), strategy, *resume);
            start_step_ = info.step;
            std::printf("resumed from %s at step %ld%s\n", resume->c_str(), start_step_,
                        env_.restart_count > 0
                            ? fmt::format(" (restart {} of trainer launch --max-restarts)", env_.restart_count).c_str()
                            : "");
        }
        const long micro = config_.device_train_microbatch_size;
        model_ = std::make_unique<Model>(config_, *layout_, backend_.get(), &strategy,
                                         static_cast<int>(std::max(micro, config_.device_eval_batch_size)));
        evaluation_ = std::make_unique<RunEvaluation>(config_, data_.evals, data_.tasks, *layout_, backend_.get(),
                                                      strategy, *model_);
        // cpu_offload.optimizer_state: AdamW runs on the host, with the CPU backend's kernels (the device's own
        // backend when that is the CPU).
        Backend* host = nullptr;
        if (config_.cpu_offload.optimizer_state) {
            if (device_ != Device::kCpu) host_backend_ = make_cpu_backend();
            host = device_ == Device::kCpu ? backend_.get() : host_backend_.get();
        }
        optimizer_ = std::make_unique<AdamW>(config_, *layout_, backend_.get(), host);
        bar_ = std::make_unique<ProgressBar>(total_steps_);
        saves_->attach(*layout_, backend_.get(), strategy, bar_.get());
        batches_ = std::make_unique<StepBatches>(config_, data_);

        const long L = m_.max_sequence_length;
        flops_per_token_ = flops_per_token(m_, *layout_);
        StepRates rates;
        rates.tokens_per_step = static_cast<double>(config_.global_train_batch_size) * L;  // OLMo counts L each
        rates.flops_per_step = flops_per_token_ * config_.global_predicted_tokens();
        if (config_.peak_flops_per_device) {
            peak_flops_ = *config_.peak_flops_per_device;
            peak_how_ = fmt::format("configured {:.1f} TFLOP/s per device", peak_flops_ / 1e12);
        } else {
            peak_flops_ = backend_->peak_flops(bf16_mixed(config_.precision), &peak_how_);
        }
        rates.peak_flops = peak_flops_, rates.world = world_.size();
        stats_ = std::make_unique<RunStats>(start_step_, total_steps_, rates);
    }

    void print_header() const {
        RunHeader h = run_header(config_, *layout_, *backend_, device_);
        h.threads = threads_, h.strategy = world_.strategy->name(), h.collectives = choice_name(world_.collectives);
        if (device_ == Device::kCuda) h.compute += fmt::format(", attention {}", choice_name(target_.attention));
        if (config_.kernels_cuda_graphs) h.compute += ", micro-batches replayed as CUDA graphs";
        h.instances = static_cast<long>(data_.train->num_instances()), h.steps = total_steps_;
        h.accumulation = config_.accumulation_steps(world_.size());
        for (const std::string& note : {data_.warmup_note, evaluation_->describe()}) {
            if (!note.empty()) h.notes.push_back(note);
        }
        h.lora_on_random_base = layout_->has_adapters() && !use_init_from_;
        h.flops_per_token = flops_per_token_, h.peak_flops = peak_flops_, h.peak_how = peak_how_;
        if (config_.cpu_offload.optimizer_state) h.host_mib = memory_snapshot().host_current / 1048576.0;
        print_run_header(h);
    }

    // Forward and backward of this rank's micro-batches of global batch `step`, the gradient reduction
    // and the optimizer step.
    StepOutcome train_step(long step) {
        Strategy& strategy = *world_.strategy;
        const int world = world_.size();
        const long accumulation = config_.accumulation_steps(world);
        // Each rank's loss gradient is scaled so that the strategies' mean reduction yields the gradient of
        // the global-batch mean loss (world / global tokens): over every predicted token, or with label masks
        // over the global batch's tokens in the loss.
        batches_->begin(step, strategy.rank(), world);
        const double global_tokens = batches_->tokens_in_loss();
        float dloss_scale = global_tokens > 0.0 ? static_cast<float>(world / global_tokens) : 0.0f;
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
        StepPlan plan;
        plan.step = step, plan.total_steps = total_steps_, plan.accumulation = accumulation;
        plan.micro = static_cast<int>(config_.device_train_microbatch_size), plan.dloss_scale = dloss_scale;
        plan.label = trace::active() ? fmt::format("step {}", step) : std::string();
        plan.micro_batch = [&](long k) { return batches_->micro_batch(k); };
        // Beside the loss sums: the masked instances, the ranks' votes on a stop request, while a checkpoint is
        // written in the background their votes on it (core/weights/async_save.h) and, every console_log_interval
        // steps, each rank's compute time a step since the last such step (each rank fills its own slot).
        const bool exchange_compute =
            world > 1 && step % config_.console_log_interval == 0 && stats_->interval_steps() > 0;
        AsyncSaver* saver = saves_->saver();
        const bool save_votes = saver && saver->voting();
        StepSlots slots;
        RankExchange::Slot save_slot, compute_slot;
        plan.fill = [&](RankExchange& ex) {
            slots = reserve_step_slots(ex);
            ex.value(slots.masked) = batches_->masked();
            stop::vote(ex.at(slots.stop_votes));
            if (save_votes) saver->vote(ex.at(save_slot = ex.reserve("save_votes", AsyncSaver::kVotes)));
            if (exchange_compute) {
                compute_slot = ex.reserve("compute_per_rank", world);
                ex.at(compute_slot)[strategy.rank()] = stats_->interval_compute();
            }
        };
        r.tokens_in_loss = global_tokens;
        plan.after_exchange = [&](const RankExchange& ex) {
            // A global batch with no token in the loss (every target masked) has a loss of 0 and no gradient.
            r.loss = global_tokens > 0.0 ? ex.at(ex.slot("loss"))[0] / global_tokens : 0.0;
            r.z_loss = global_tokens > 0.0 ? ex.at(ex.slot("loss"))[1] / global_tokens : 0.0;
            if (!std::isfinite(r.loss) || !std::isfinite(r.z_loss)) {
                user_error("step {}: the {} is {} (diverged); {}", step, std::isfinite(r.loss) ? "z-loss" : "loss",
                           std::isfinite(r.loss) ? r.z_loss : r.loss, divergence_advice(config_.optimizer));
            }
        };
        r.opt = run_step(strategy, *model_, *optimizer_, *backend_, exchange_, plan);
        r.masked_instances = static_cast<long>(exchange_.value(slots.masked));
        r.stop_signal = stop::agreed(exchange_.at(slots.stop_votes));
        if (save_votes) saver->tally(exchange_.at(save_slot));
        if (exchange_compute) {
            const double* per_rank = exchange_.at(compute_slot);
            r.compute_per_rank.assign(per_rank, per_rank + world);
            r.compute_steps = stats_->interval_steps();
            stats_->reset_interval();
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
        Json record = stats_->add(step, r, config_.z_loss_multiplier > 0.0);
        // The device's counters, read only where the record is written.
        if (r.activity.measured && outputs_->writes_metrics()) {
            for (const auto& [name, value] : backend_->device_counters()) record[name] = value;
        }
        if (config_.data.instance_filter) record["masked_instances"] = r.masked_instances;
        if (batches_->has_label_masks()) record["tokens_in_loss"] = static_cast<long>(r.tokens_in_loss);
        if (data_.mixture) {  // the tokens each source gave the run so far
            Json by_source = Json::object();
            for (size_t k = 0; k < data_.mixture->sources().size(); ++k) {
                by_source[data_.mixture->sources()[k].name] =
                    data_.mixture->draws(k, step * config_.global_train_batch_size) * m_.max_sequence_length;
            }
            record["tokens_by_source"] = by_source;
        }
        if (!r.compute_per_rank.empty()) {
            const std::vector<std::string> lines = report_stragglers(
                step, r, config_.straggler_factor, [&](int k) { return world_.host_of(k); }, record);
            if (!lines.empty()) bar_->clear();
            for (const std::string& line : lines) std::printf("%s\n", line.c_str());
        }
        int eval_stop = 0;
        if (config_.eval_interval > 0 && (step % config_.eval_interval == 0 || step == total_steps_)) {
            eval_stop = evaluation_->run(step, record, *bar_);
        }
        if (config_.sample.interval > 0 && step % config_.sample.interval == 0) run_sample(step, record);
        // The metrics file's step records carry every rank's peak memory so far (one tiny all-gather).
        if (config_.metrics_file || config_.tensorboard_dir)
            record["peak_memory_bytes_per_rank"] = peak_memory_per_rank();
        if (step % config_.console_log_interval == 0 || step == total_steps_ || step == start_step_ + 1) {
            bar_->clear();
            std::printf("%s\n", stats_->console_line(step, r, config_.z_loss_multiplier > 0.0).c_str());
        }
        if (config_.save_folder &&
            ((config_.save_interval > 0 && step % config_.save_interval == 0) || step == total_steps_)) {
            record["save_ms"] = saves_->save(step, step == total_steps_) * 1e3;  // how long it held the step up
        }
        // A checkpoint written in the background and published since the last step: the step it holds (the
        // steps between are those a failure before its publication would also lose).
        if (const std::optional<long> published = saves_->take_published()) record["checkpoint_published"] = *published;
        outputs_->write_step(step, record);
        bar_->draw(step, stats_->eta_seconds(step));
        std::fflush(stdout);
        return eval_stop;
    }

    // eval_on_startup: the evaluators on the weights the run starts from, recorded at the step it starts from (an
    // "eval" event in the metrics file, scalars in TensorBoard). Returns 0, or the exit code of a stop agreed during it
    // (nothing was trained since the start, so there is nothing to save).
    int eval_on_startup() {
        Json record = {{"event", "eval"}, {"step", start_step_}};
        const int sig = evaluation_->run(start_step_, record, *bar_);
        outputs_->write_step(start_step_, record);
        if (sig == 0) return 0;
        std::printf("stopped by %s before step %ld: nothing trained since the start\n", stop::signal_name(sig),
                    start_step_ + 1);
        return stop::exit_code(sig);
    }

    void follow_free_cores() {
        const int n = governor_->poll();
        if (n == 0) return;
        bar_->clear();
        std::printf("threads: %d of %d: %s (threads: 0 follows the free cores; a number fixes the count)\n", n,
                    threads_max_, n < threads_ ? "other processes are using the cores" : "cores came free");
        threads_ = n;
    }

    // The ranks agreed to stop after `step` (a stop signal, base/stop.h): a checkpoint of it when
    // save_folder is set, a metrics record saying so, the summary of the steps run, and 128 + the signal.
    int stop_after(long step, int sig) {
        saves_->finish();
        if (config_.save_folder && saves_->saved_step() != step) saves_->save(step, false, /*now=*/true);
        bar_->clear();
        const std::string resume =
            config_.save_folder ? fmt::format("checkpoint {}; resume with --load-path latest", saves_->saved_path())
                                : std::string("no checkpoint (save_folder is not set)");
        std::printf("stopped by %s after step %ld of %ld: %s\n", stop::signal_name(sig), step, total_steps_,
                    resume.c_str());
        Json record = {{"event", "stopped"}, {"step", step}, {"signal", stop::signal_name(sig)}};
        if (config_.save_folder) record["checkpoint"] = saves_->saved_path();
        outputs_->write_event(record);
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
            generate_tokens(*model_, m_, {sample_.prompt}, config_.sample.max_new_tokens, o, -1, true);
        const std::string text = sample_.codec->decode(g.tokens[0]);
        record["sample"] = valid_utf8(text);
        bar_->clear();
        std::printf("step %ld | sample: %s%s\n", step, config_.sample.prompt.c_str(), text.c_str());
    }

    Json peak_memory_per_rank() const { return gather_peak_memory(*world_.comm, *backend_, device_ == Device::kCuda); }

    // The summary record of the steps up to `last_step` (every rank's peak memory by category, gathered to
    // every rank; rank 0 writes it) and the closing console line.
    void summary(long last_step) {
        const int world = world_.size();
        const MemorySnapshot mem = memory_snapshot();
        const Json per_rank = peak_memory_per_rank();
        Json summary = stats_->summary(last_step);
        summary["wall_time_s"] = seconds_since(run_t0_);
        summary["flops_per_token"] = flops_per_token_;
        summary["peak_flops_per_device"] = peak_flops_;
        summary["peak_memory_bytes"] = per_rank[world_.rank()];
        summary["peak_memory_bytes_per_rank"] = per_rank;
        if (saves_->saves() > 0) {  // the checkpoints' cost to the run: the time the steps waited for them
            summary["checkpoints"] = saves_->saves();
            summary["save_stall_s"] = saves_->stall_seconds();
            summary["save_async"] = saves_->saver() != nullptr;
        }
        // Every rank's mean compute time a step over the run (its step less its waits on collectives).
        summary["compute_ms_per_rank"] = stats_->compute_ms_per_rank(*world_.strategy, world_.rank(), world);
        // trainer launch --max-restarts: how often the job was started again after a failure before this round.
        if (env_.restart_count > 0) summary["restarts"] = env_.restart_count;
        if (model_->graphs().enabled()) {  // kernels.cuda_graphs: micro-batches recorded, and launched as graphs
            summary["cuda_graph_captures"] = model_->graphs().captures();
            summary["cuda_graph_launches"] = model_->graphs().launches();
        }
        outputs_->write_event(summary);
        outputs_->write_trace();
        if (last_step > start_step_) {
            std::printf("%s | %s\n", stats_->done_line(last_step).c_str(), peak_memory_text(mem).c_str());
        } else {
            std::printf("nothing to do: the checkpoint is already at step %ld of %ld\n", start_step_, total_steps_);
        }
    }

    TrainConfig config_;  // distributed_strategy auto resolved in preflight
    const ModelConfig& m_;
    // preflight
    RankEnv env_;
    ComputeTarget target_;          // the device and attention kernels, resolved once
    Device device_ = Device::kCpu;  // target_.device
    int device_index_ = 0;          // the GPU this rank computes on (rank_device)
    long nan_gradient_step_ = -1;   // TRAINER_DEBUG_NAN_GRADIENT's step for this rank, or -1
    RunData data_;
    long total_steps_ = 0, start_step_ = 0;
    bool use_init_from_ = false;
    std::map<std::string, Tensor> init_tensors_;
    std::unique_ptr<RunOutputs> outputs_;
    RunSample sample_;  // sample.interval
    int threads_ = 0, threads_max_ = 0;
    std::unique_ptr<ThreadGovernor> governor_;  // threads: 0 on the CPU
    // build
    std::unique_ptr<Backend> backend_;
    std::unique_ptr<ParamLayout> layout_;
    World world_;
    std::unique_ptr<Model> model_;
    std::unique_ptr<RunEvaluation> evaluation_;  // the evaluators, with the model downstream tasks are scored with
    std::unique_ptr<Backend> host_backend_;      // cpu_offload on a GPU: the host optimizer's kernels
    std::unique_ptr<AdamW> optimizer_;
    std::unique_ptr<RunSaves> saves_;  // made in preflight (the resume), attached in build (after the state)
    double flops_per_token_ = 0.0, peak_flops_ = 0.0;
    std::string peak_how_;
    std::unique_ptr<ProgressBar> bar_;
    std::unique_ptr<RunStats> stats_;
    std::unique_ptr<StepBatches> batches_;  // the micro-batches this rank reads of each step's global batch
    // the step loop
    RankExchange exchange_;  // the step's values summed over the ranks
    Clock::time_point run_t0_;
};

}  // namespace

int run_training(const TrainConfig& config) { return TrainingRun(config).run(); }

}  // namespace trainer
