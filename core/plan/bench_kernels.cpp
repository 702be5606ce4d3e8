// `trainer bench-kernels`: every op of one training step, as the model issues it, timed on the configured device
// and set against the roofline of that device (see bench_kernels.h).
#include "core/plan/bench_kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/layout.h"
#include "core/metrics.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "core/optimizer.h"
#include "core/plan/dry_run.h"
#include "core/plan/op_recorder.h"
#include "core/plan/step_time.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/launch/rank_env.h"
#include "parallel/setup.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Mean seconds per call of `f` over `reps` calls after two warm-up calls, the device drained around them.
double time_op(Backend& backend, const std::function<void()>& f, int reps) {
    f();
    f();
    backend.synchronize();
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) f();
    backend.synchronize();
    return seconds_since(t0) / reps;
}

// One optimizer step of one micro-batch in a single process, set up as training sets it up: the strategy, the
// parameters (initialised as training initialises them, unless `initialise` is false: a dry backend has nowhere to
// put them), the model and the optimizer.
class OneStep {
   public:
    OneStep(const TrainConfig& config, Backend& backend, bool initialise)
        : config_(config), layout_(config), strategy_(make_single_strategy(&backend, layout_)) {
        if (initialise) load_initial_params(config, layout_, *strategy_, nullptr, "");
        model_ = std::make_unique<Model>(config, layout_, &backend, strategy_.get(), micro());
        optimizer_ = std::make_unique<AdamW>(config, layout_, &backend);
    }
    // `tokens`: micro-batch rows of max_sequence_length.
    void run(const std::vector<int32_t>& tokens) {
        const float scale = 1.0f / static_cast<float>(micro() * config_.model.predicted_positions());
        accumulate_gradients(*strategy_, *model_, 1, micro(), scale, [&](long) { return tokens.data(); });
        optimizer_->step(*strategy_, 1, 1);
    }

   private:
    int micro() const { return static_cast<int>(config_.device_train_microbatch_size); }
    const TrainConfig& config_;
    const ParamLayout layout_;
    std::unique_ptr<Strategy> strategy_;
    std::unique_ptr<Model> model_;
    std::unique_ptr<AdamW> optimizer_;
};

// One process, one micro-batch a step.
TrainConfig single_micro_batch(const TrainConfig& config) {
    TrainConfig one = config;
    one.global_train_batch_size = config.device_train_microbatch_size;
    one.distributed_strategy = DistributedStrategy::kSingle;
    return one;
}

// The step bench-kernels times: the model cut to its first two blocks. Every block runs the same ops at the same
// shapes, and two hold the first block's and the last's, each layer pattern of activation checkpointing's both
// kinds of block; the vocabulary, the head's chunks and the micro-batch are the model's. The state of a model many
// times a GPU's memory then fits (OLMo-7B's is 112 GB).
constexpr int kTimedBlocks = 2;
TrainConfig timed_step_config(const TrainConfig& config) {
    TrainConfig timed = single_micro_batch(config);
    timed.model.n_layers = std::min(config.model.n_layers, kTimedBlocks);
    return timed;
}

// A micro-batch of tokens drawn log-uniformly over the vocabulary (P(k) ~ 1/(k+1), Zipf's law of text: the most
// frequent id takes ln 2 / ln V of the positions, 6% at V = 50304), so the embedding backward's groups of equal
// tokens are as long as in training rather than one group of every row.
std::vector<int32_t> zipf_tokens(const TrainConfig& config) {
    const ModelConfig& m = config.model;
    std::vector<int32_t> tokens(static_cast<size_t>(config.device_train_microbatch_size) * m.max_sequence_length);
    uint64_t lcg = 0x9E3779B97F4A7C15ull;
    for (int32_t& id : tokens) {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        const double unit = static_cast<double>(lcg >> 11) * 0x1.0p-53;
        const double r = std::exp(unit * std::log(static_cast<double>(m.vocab_size) + 1.0)) - 1.0;
        id = static_cast<int32_t>(std::min<double>(r, m.vocab_size - 1));
    }
    return tokens;
}

// Ops whose one call covers the whole model (every unit's range): the cut step's call times fewer ranges of the
// same kernel, and its time is scaled by the bytes.
bool scales_with_model(const std::string& op) { return op == "adamw_update_multi" || op == "squared_norm_multi"; }

// The ops of one step of `config` on `device` (a dry run of the whole model: each op and shape once, with its calls
// a step), each with the time the cut step measured for the same op and shape (`timed`, from an OpRecorder with a
// timer; without one, every time stays unknown). An op of the whole model that the cut step did not run is an
// internal error naming it.
std::vector<RecordedOp> step_rows(const TrainConfig& config, Device device, const std::vector<RecordedOp>& timed) {
    const TrainConfig one = single_micro_batch(config);
    auto dry = make_dry_backend({}, gemm_operands_bf16_for(config, device), gemms_read_aliases_for(config, device));
    OpRecorder recorder(*dry);
    {
        OneStep step(one, recorder, false);
        step.run(std::vector<int32_t>(
            static_cast<size_t>(one.device_train_microbatch_size) * one.model.max_sequence_length, 0));
    }
    std::map<std::string, const RecordedOp*> by_key;
    std::map<std::string, const RecordedOp*> by_op;
    for (const RecordedOp& r : timed) by_key[r.key()] = &r, by_op[r.op] = &r;
    std::vector<RecordedOp> rows = recorder.ops();
    std::vector<std::string> missing;
    for (RecordedOp& r : rows) {
        if (const auto at = by_key.find(r.key()); at != by_key.end()) {
            r.seconds = at->second->seconds, r.ceiling_seconds = at->second->ceiling_seconds;
        } else if (const auto op = by_op.find(r.op); scales_with_model(r.op) && op != by_op.end()) {
            const double scale = r.bytes / op->second->bytes;
            r.seconds = op->second->seconds * scale;
        } else {
            missing.push_back(fmt::format("{} ({})", r.op, r.shape));
        }
    }
    TRAINER_CHECK(missing.empty(),
                  "bench-kernels' step of {} blocks did not run {}, which a step of the whole model runs", kTimedBlocks,
                  fmt::join(missing, ", "));
    return rows;
}

}  // namespace

std::vector<RecordedOp> bench_kernel_rows(const TrainConfig& config, Device device) {
    const TrainConfig timed = timed_step_config(config);
    auto dry = make_dry_backend({}, gemm_operands_bf16_for(config, device), gemms_read_aliases_for(config, device));
    OpRecorder recorder(*dry);
    {
        OneStep step(timed, recorder, false);
        step.run(zipf_tokens(timed));
    }
    return step_rows(config, device, recorder.ops());
}

namespace {

// The device's rooflines, printed: its peak as training's MFU counts it (the backend's, or
// peak_flops_per_device); bandwidth stated by the backend where it knows it, and measured by a device-to-device
// copy as well.
struct Roofs {
    double flops = 0.0, bandwidth = 0.0;
    double fp8_flops = 0.0;  // amp_fp8's GEMMs: the tensor cores' FP8 rate, twice their bf16 one (8.9 and newer)
};
Roofs rooflines(const TrainConfig& config, Backend& be) {
    const bool bf16 = bf16_mixed(config.precision);  // amp_fp8's MFU too counts against the bf16 peak
    std::string flops_how, bw_how;
    Roofs roofs;
    roofs.flops = be.peak_flops(bf16, &flops_how);
    if (config.peak_flops_per_device) {
        roofs.flops = *config.peak_flops_per_device, flops_how = "configured peak_flops_per_device";
    }
    if (roofs.flops <= 0.0) {
        user_error("bench-kernels: the peak FLOP/s of this device is unknown ({}); set peak_flops_per_device",
                   flops_how);
    }
    // (The CPU's amp_fp8 emulates FP8 in fp32: its GEMMs' roof is the fp32 one.)
    if (config.precision == Precision::kAmpFp8 && be.name() == "cuda") roofs.fp8_flops = 2.0 * roofs.flops;
    roofs.bandwidth = be.peak_bandwidth(&bw_how);
    const size_t bytes = size_t(256) << 20;
    DeviceBuffer a(&be, bytes, MemCategory::kOther), b(&be, bytes, MemCategory::kOther);
    be.fill_zero(a.data(), bytes);
    const double t = time_op(
        be, [&] { be.copy_device_to_device(b.data(), a.data(), bytes); }, 5);
    const double copy_bw = 2.0 * bytes / t;
    if (roofs.bandwidth <= 0.0) roofs.bandwidth = copy_bw, bw_how = "measured copy";
    std::printf("device %s (%s): FLOP roof %.1f TFLOP/s (%s); bandwidth roof %.0f GB/s (%s); copy measured %.0f GB/s\n",
                be.name().c_str(), choice_name(config.precision), roofs.flops / 1e12, flops_how.c_str(),
                roofs.bandwidth / 1e9, bw_how.c_str(), copy_bw / 1e9);
    if (roofs.fp8_flops > 0.0) {
        std::printf(
            "FP8 GEMMs (matmul_fp8_*): FLOP roof %.1f TFLOP/s, twice the bf16 roof (the tensor cores' FP8 rate)\n",
            roofs.fp8_flops / 1e12);
    }
    return roofs;
}

void print_row(const std::string& op, const std::string& shape, const std::string& calls, double seconds, double flops,
               double bytes, const Roofs& roofs) {
    const bool fp8 = roofs.fp8_flops > 0.0 && op.rfind("matmul_fp8", 0) == 0;
    const double t_flops = flops / (fp8 ? roofs.fp8_flops : roofs.flops), t_bytes = bytes / roofs.bandwidth,
                 roof = std::max(t_flops, t_bytes);
    std::printf("| %s | %s | %s | %.1f | %.2f | %.0f | %s | %.1f | %.0f%% |\n", op.c_str(), shape.c_str(),
                calls.c_str(), seconds * 1e6, flops / seconds / 1e12, bytes / seconds / 1e9,
                t_flops > t_bytes ? "compute" : "memory", roof * 1e6, 100.0 * roof / seconds);
}

// The table of a step's ops against the rooflines; returns the step's ops' time, each op timed alone (calls times
// time, the parts of fused ops and the ceilings left out).
double print_rows(const std::vector<RecordedOp>& rows, const Roofs& roofs) {
    std::printf(
        "roofline time = max(FLOPs / FLOP roof, bytes / bandwidth roof); bytes = each input read and output "
        "written once, at fp32 (bf16 operands at 2 bytes); above 100%%: the op's working set stays in cache, "
        "faster than the memory roof. Calls: a step's; \"part\": a part of a fused op the step runs, timed alone "
        "for trainer plan (which prices a fused op by its parts)\n\n");
    std::printf(
        "| op | shape | calls | time us | TFLOP/s | GB/s | bound | roofline us | %% of roofline |\n"
        "|---|---|---|---|---|---|---|---|---|\n");
    double step = 0.0;
    for (const RecordedOp& r : rows) {
        print_row(r.op, r.shape, r.calls > 0 ? std::to_string(r.calls) : "part", r.seconds, r.flops, r.bytes, roofs);
        step += static_cast<double>(r.calls) * r.seconds;
        if (r.ceiling_seconds > 0.0) {
            // The peers' bf16 Linear at the same shape: bf16 in and out, no epilogue (its own FLOPs and bytes).
            const double m = r.gemm->M, k = r.gemm->K, n = r.gemm->N, products = r.gemm->backward ? 2.0 : 1.0;
            print_row(r.op + ", bf16 Linear (ceiling)", r.shape, "", r.ceiling_seconds, 2.0 * products * m * k * n,
                      2.0 * (m * k + n * k + m * n) * products, roofs);
        }
    }
    return step;
}

// Where a step's time goes: the rows' time (calls times the time of one) summed by the part of the step that calls
// them (step_part), with the ceiling the blocks' Linear layers set on what faster GEMMs can give (Amdahl's law).
void print_parts(const std::vector<RecordedOp>& rows, double step) {
    std::map<std::string, double> seconds;
    for (const RecordedOp& r : rows) {
        for (const auto& [part, calls] : r.part_calls) seconds[part] += static_cast<double>(calls) * r.seconds;
    }
    if (step <= 0.0) return;
    std::printf(
        "\nwhere a step's time goes (the rows above by the part of the step that calls them; Linear layers: the "
        "blocks' GEMMs, with an FP8 GEMM's operand casts):\n\n| part | ms | share |\n|---|---|---|\n");
    for (const std::string& part : step_part_order()) {
        if (const auto at = seconds.find(part); at != seconds.end()) {
            std::printf("| %s | %.2f | %.1f%% |\n", part.c_str(), at->second * 1e3, 100.0 * at->second / step);
        }
    }
    const auto linears = seconds.find("Linear layers");
    const double share = linears != seconds.end() ? linears->second / step : 0.0;
    if (share > 0.0 && share < 1.0) {
        std::printf(
            "\nthe blocks' Linear layers take %.1f%% of it: at twice their speed (FP8's tensor-core rate against "
            "bf16's) the step would run %.2fx as fast, and %.2fx were they free\n",
            100.0 * share, 1.0 / (1.0 - share / 2.0), 1.0 / (1.0 - share));
    }
}

// `trainer plan --calibration`'s file: each op's measured time at its FLOPs and bytes, and the factor a real step
// of the timed model runs slower than its ops alone (caches shared with the rest of the step, the allocator, the
// hooks): one optimizer step of one micro-batch, timed, against the same step predicted from the ops just measured.
void write_calibration(const TrainConfig& config, Device device, Backend& be, const std::vector<RecordedOp>& rows,
                       const Roofs& roofs, int threads, const RankEnv& env, const std::string& path,
                       const std::function<void()>& together) {
    Calibration measured;
    measured.bandwidth = roofs.bandwidth;
    for (const RecordedOp& r : rows) {
        if (!r.cost_op().empty()) {
            measured.entries.push_back({r.cost_op(), r.flops, r.bytes, r.seconds});
        } else if (r.cost_ops.size() == 2 && r.cost_ops[1] == "fp8_cast") {
            // An FP8 GEMM runs its operands' casts inside itself; the plan prices them as an op of their own, one
            // the file has not (at the copy bandwidth): the GEMM's entry is the row's time less theirs at that rate.
            const double cast_seconds = r.cost_bytes[1] / roofs.bandwidth;
            measured.entries.push_back({r.cost_ops[0], r.flops, r.bytes - r.cost_bytes[1],
                                        std::max(r.seconds - cast_seconds, 0.1 * r.seconds)});
        }
    }
    const TrainConfig timed = timed_step_config(config);
    Hardware none;  // no links (one process), no rooflines: every op has an entry or the copy bandwidth
    const double predicted = predict_step_time(dry_run_step(timed, RankEnv{}, device), none, &measured, false).total;
    double step_seconds = 0.0;
    {
        OneStep step(timed, be, true);
        const std::vector<int32_t> tokens = zipf_tokens(timed);
        together();
        step_seconds = time_op(
            be, [&] { step.run(tokens); }, 2);
    }
    const double step_scale = step_seconds / predicted;
    Json ops = Json::array();
    for (const Calibration::Entry& e : measured.entries) {
        ops.push_back({{"op", e.op}, {"flops", e.flops}, {"bytes", e.bytes}, {"seconds", e.seconds}});
    }
    fmt::print(
        "\none optimizer step of one micro-batch ({} blocks): {:.1f} ms measured, {:.1f} ms from the ops alone "
        "(x{:.3f})\n",
        timed.model.n_layers, step_seconds * 1e3, predicted * 1e3, step_scale);
    const Json file = {{"format", "trainer-calibration"},
                       {"step_scale", step_scale},
                       {"device", be.name()},
                       {"precision", choice_name(config.precision)},
                       {"threads", threads},
                       {"ranks_per_node", env.local_world_size},
                       {"cores", static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))},
                       {"peak_flops", roofs.flops},
                       {"bandwidth", roofs.bandwidth},
                       {"ops", ops}};
    if (env.rank == 0) {
        write_text_file(path, file.dump(1), "--calibration-out");
        std::printf("\ncalibration written to %s (trainer plan --calibration)\n", path.c_str());
    }
}

}  // namespace

int run_kernel_bench(const TrainConfig& config, int reps, const std::string& calibration_out) {
    const ComputeTarget target = resolve_compute(config);
    const Device device = target.device;
    // Under a launcher every rank runs the same benchmark at the same time, each on its own GPU or its share of
    // the cores, so the op times hold what the ranks of a node do to one another (CPU ranks sharing the cores
    // and the memory bus); rank 0 alone prints and writes, with its node's rank count in the calibration.
    const RankEnv env = detect_rank_env();
    silence_stdout_unless_rank0(env);
    const int threads = configure_threads(config.threads);
    auto backend_ptr = make_backend(device, backend_options(config, target, env.local_rank));
    Backend& be = *backend_ptr;
    // The ranks begin each timed phase together (a barrier over the launch's ranks) and leave together: a rank
    // that started late, or finished early, would leave the others timing ops alone for a while.
    std::optional<World> world;
    if (env.world_size > 1) world.emplace(connect_world(config, env, device, &be));
    const std::function<void()> together = [&] {
        if (world) world->comm->barrier().wait();
    };
    const Roofs roofs = rooflines(config, be);
    const ModelConfig& m = config.model;
    const long B = config.device_train_microbatch_size;
    fmt::print(
        "shape: micro-batch {} x T {}, d_model {}, {} heads of {}, ff {} -> {}, vocab {} (head chunk {} rows), {} "
        "blocks; "
        "timed on a step of the first {}\n",
        B, m.predicted_positions(), m.d_model, m.n_heads, m.head_size(), m.ff_proj_size(), m.ff_hidden_size(),
        m.embedding_size, Model::head_chunk_rows(m, static_cast<int>(B), be.gemm_operands_bf16()), m.n_layers,
        std::min(m.n_layers, kTimedBlocks));
    // The ops of a real step of the cut model, each timed the first time it comes (on that call's buffers), then
    // set against the whole model's step.
    std::vector<RecordedOp> timed_ops;
    {
        const TrainConfig timed = timed_step_config(config);
        OpRecorder recorder(be, [&](const std::function<void()>& f) { return time_op(be, f, reps); });
        OneStep step(timed, recorder, true);
        const std::vector<int32_t> tokens = zipf_tokens(timed);
        together();
        step.run(tokens);
        timed_ops = recorder.ops();
    }
    const std::vector<RecordedOp> rows = step_rows(config, device, timed_ops);
    const double step = print_rows(rows, roofs);
    std::printf("\na step's ops, each timed alone: %.1f ms (the calls times the times)\n", step * 1e3);
    print_parts(rows, step);
    if (!calibration_out.empty())
        write_calibration(config, device, be, rows, roofs, threads, env, calibration_out, together);
    together();
    return 0;
}

}  // namespace trainer
