// `trainer plan` (see plan.h).
#include "core/plan/plan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/layout.h"
#include "base/trace.h"
#include "core/metrics.h"
#include "core/model/model.h"
#include "core/optimizer.h"
#include "core/plan/step_parts.h"
#include "core/plan/step_time.h"
#include "kernels/backend.h"
#include "parallel/setup.h"

namespace trainer {

namespace {

// One configuration to dry-run: the config as given, or the config with another way to run its step.
struct Candidate {
    std::optional<ExecutionChoice> choice;  // nullopt: the config as given
};

std::vector<Candidate> candidates(const TrainConfig& config, const RankEnv& env) {
    const int world = env.world_size;
    std::vector<ExecutionChoice> strategies;
    const auto add = [&](DistributedStrategy strategy, ShardingStrategy sharding, WrappingStrategy wrapping) {
        ExecutionChoice e;
        e.strategy = strategy, e.sharding = sharding, e.wrapping = wrapping;
        strategies.push_back(e);
    };
    const auto fsdp = [&](ShardingStrategy sharding, WrappingStrategy wrapping) {
        add(DistributedStrategy::kFsdp, sharding, wrapping);
    };
    if (world == 1) add(DistributedStrategy::kSingle, {}, {});
    if (world > 1) add(DistributedStrategy::kDdp, {}, {});
    fsdp(ShardingStrategy::kFullShard, WrappingStrategy::kByBlock);
    fsdp(ShardingStrategy::kFullShard, WrappingStrategy::kByBlockAndSize);
    fsdp(ShardingStrategy::kShardGradOp, WrappingStrategy::kByBlock);
    if (world > 1) fsdp(ShardingStrategy::kNoShard, WrappingStrategy::kNull);
    if (env.num_nodes() > 1) fsdp(ShardingStrategy::kHybridShard, WrappingStrategy::kByBlock);
    const bool accumulates = config.accumulation_steps(world) > 1;
    std::vector<Candidate> out;
    out.push_back({});
    for (const ExecutionChoice& s : strategies) {
        const bool sharded = s.strategy == DistributedStrategy::kFsdp && s.sharding != ShardingStrategy::kNoShard;
        for (const GradSyncMode sync : {GradSyncMode::kBatch, GradSyncMode::kMicroBatch}) {
            if (!accumulates && sync == GradSyncMode::kMicroBatch) continue;
            for (const ActivationCheckpointing ac :
                 {ActivationCheckpointing::kNull, ActivationCheckpointing::kWholeLayer}) {
                for (int offload = 0; offload <= (sharded ? 2 : 1); ++offload) {
                    ExecutionChoice e = s;
                    if (world > 1) e.grad_sync = sync;
                    e.checkpointing = ac;
                    e.offload_optimizer = offload >= 1, e.offload_parameters = offload >= 2;
                    // kernels.cuda_graphs as the config asks, where the row can replay its micro-batches.
                    e.cuda_graphs =
                        config.kernels_cuda_graphs && s.strategy == DistributedStrategy::kSingle && offload == 0;
                    out.push_back({e});
                }
            }
        }
    }
    return out;
}

// The configuration of a row in few words: strategy, sharding and wrap, grad_sync, checkpointing, offload.
std::string describe(const TrainConfig& c, int world) {
    std::string s = choice_name(c.distributed_strategy);
    if (c.distributed_strategy == DistributedStrategy::kFsdp) {
        s += fmt::format(" {}", choice_name(c.fsdp.sharding_strategy));
        if (c.fsdp.sharding_strategy != ShardingStrategy::kNoShard)
            s += fmt::format(" {}", choice_name(c.fsdp.wrapping_strategy));
        s += fmt::format(" {}", choice_name(c.fsdp.precision));
    }
    if (world > 1) {
        const GradSyncMode sync =
            c.distributed_strategy == DistributedStrategy::kFsdp ? c.fsdp.grad_sync_mode : c.ddp_grad_sync_mode;
        s += fmt::format(", sync {}", choice_name(sync));
    }
    if (c.activation_checkpointing != ActivationCheckpointing::kNull)
        s += fmt::format(", ac {}", choice_name(c.activation_checkpointing));
    if (c.cpu_offload.parameters) {
        s += ", offload params+optimizer";
    } else if (c.cpu_offload.optimizer_state) {
        s += ", offload optimizer";
    }
    if (c.kernels_cuda_graphs) s += ", cuda graphs";
    return s;
}

struct Row {
    TrainConfig config;
    bool is_config = false;
    DryRunStep dry;  // its peaks (its events went to the time model as they happened)
    StepTime time;
    double tokens_per_s = 0.0, mfu = 0.0;
    int64_t host_per_node = 0;  // CPU offload: every rank of a node keeps its host state in the node's memory
    bool fits_device = true, fits_host = true;  // the device memory; the node's host memory
    bool fits() const { return fits_device && fits_host; }
};

// Every candidate of the world, dry-run and timed; the recommendation is the fastest that fits.
struct Plan {
    std::vector<Row> rows;
    std::optional<Hardware> hw;  // the entry, with the config's link overrides
    std::optional<Calibration> calibration;
    std::optional<CommCalibration> comm;  // the measured links, where given
    double device_gib = 0.0;              // 0: unknown
    double host_gib = 0.0;                // host memory of a node, 0: unknown
    std::string config_refused, other_refused;
    int recommended = -1;  // a row, or -1 when none fits
    std::string reasons;
    double slowdown = 1.0;  // every op's factor (CPU ranks sharing cores)
    RankEnv env;
    Device device = Device::kCpu;
};

// The GPU this rank computes on (its local rank modulo the GPUs present), where the node has one.
std::optional<CudaDeviceInfo> local_gpu(const RankEnv& env) {
    const int n = cuda_device_count();
    return n > 0 ? cuda_device_info(env.local_rank % n) : std::nullopt;
}

// The entry a CUDA plan takes without --hardware (plan.hardware): the node's GPU's, or h100-sxm where the node has
// no GPU (a plan made elsewhere) or one without an entry (said on rank 0's stderr).
std::string default_cuda_hardware(const RankEnv& env) {
    const std::optional<CudaDeviceInfo> gpu = local_gpu(env);
    if (!gpu) return "h100-sxm";
    if (const Hardware* h = hardware_for_gpu(gpu->name)) return h->name;
    if (env.rank == 0) {
        std::fprintf(stderr,
                     "plan: no hardware entry for this node's %s: its step times are h100-sxm's (set --hardware or "
                     "plan.hardware: %s)\n",
                     gpu->name.c_str(), hardware_names().c_str());
    }
    return "h100-sxm";
}

// Says (rank 0, stderr) where measured links are used for another world than they were measured on: another
// collectives library, another number of ranks (a ring's bandwidth can change with its size: CPU ranks share
// the cores and the memory bus), or a group the file did not measure (it takes the entry's link).
void note_comm_calibration_world(const CommCalibration& c, const RankEnv& env, Device device) {
    if (env.rank != 0) return;
    const std::string runs = device == Device::kCuda ? "nccl" : "gloo";
    if (!c.collectives.empty() && c.collectives != runs) {
        std::fprintf(stderr, "plan: the links of %s were measured over %s; a %s run's collectives are %s's\n",
                     c.path.c_str(), c.collectives.c_str(), choice_name(device), runs.c_str());
    }
    const int per_node = c.nnodes > 0 ? c.world_size / c.nnodes : 0;
    if (per_node > 0 && (c.world_size != env.world_size || per_node != env.local_world_size)) {
        std::fprintf(stderr,
                     "plan: the links of %s were measured on %d node(s) x %d rank(s); this plan is for %d x %d (a "
                     "ring's bandwidth can differ with its size)\n",
                     c.path.c_str(), c.nnodes, per_node, env.num_nodes(), env.local_world_size);
    }
    if (env.num_nodes() > 1 && c.inter.empty()) {
        std::fprintf(stderr, "plan: %s has no link between nodes: the hardware entry's is used\n", c.path.c_str());
    }
    if (env.local_world_size > 1 && c.intra.empty()) {
        std::fprintf(stderr, "plan: %s has no link within a node: the hardware entry's is used\n", c.path.c_str());
    }
}

Plan make_plan(const TrainConfig& config, const RankEnv& env, Device device, const PlanOptions& o) {
    Plan plan;
    plan.env = env, plan.device = device;
    const int world = env.world_size;
    const std::string hw_name = !o.hardware.empty()       ? o.hardware
                                : device == Device::kCuda ? default_cuda_hardware(env)
                                                          : "cpu";
    const Hardware* entry = find_hardware(hw_name);
    if (entry == nullptr) {
        user_error("plan --hardware {}: unknown; expected one of {} (the files of {}), or the path of a hardware file",
                   hw_name, hardware_names(), hardware_dir());
    }
    plan.hw = *entry;
    // The links measured on the machine in place of the entry's, and the entry's attention share for the
    // model's heads.
    if (!o.comm_calibration.empty()) {
        plan.comm = read_comm_calibration(o.comm_calibration);
        apply_comm_calibration(*plan.hw, *plan.comm);
        note_comm_calibration_world(*plan.comm, env, device);
    }
    plan.hw->attention_efficiency = attention_efficiency_at(*plan.hw, config.model.head_size());
    const Hardware& hw = *plan.hw;
    if (!o.calibration.empty()) plan.calibration = read_calibration(o.calibration);
    if (hw.bf16_flops <= 0.0 && hw.fp32_flops <= 0.0 && !plan.calibration) {  // the CPU's entry: no peaks
        user_error(
            "plan --hardware {}: needs --calibration FILE (plan.calibration), the op times measured on this machine "
            "(trainer bench-kernels --config C --threads T{} --calibration-out FILE, T the threads each rank gets)",
            hw.name, config.precision == Precision::kAmpFp8 ? " --precision amp_fp8" : "");
    }
    const Calibration* cal = plan.calibration ? &*plan.calibration : nullptr;
    // CPU ranks share the node's cores: each op slows by the calibration's threads over the rank's, and again
    // where the node's ranks hold more threads than it has cores, less the sharing the calibration's times already
    // hold (bench-kernels run by several ranks at once).
    if (hw.cores > 0) {
        const int per_node = env.local_world_size;
        const int threads = config.threads > 0 ? config.threads : std::max(1, hw.cores / per_node);
        const int measured = cal != nullptr && cal->threads > 0 ? cal->threads : threads;
        const int measured_ranks = cal != nullptr ? cal->ranks_per_node : 1;
        // The calibration's sharing is of the cores it was measured on (the hardware entry may describe a node
        // with fewer: a network lab's node on this machine).
        const int measured_cores = cal != nullptr && cal->cores > 0 ? cal->cores : hw.cores;
        const auto oversubscribed = [](int ranks, int each, int cores) {
            return std::max(1.0, static_cast<double>(ranks) * each / cores);
        };
        plan.slowdown = static_cast<double>(measured) / threads * oversubscribed(per_node, threads, hw.cores) /
                        oversubscribed(measured_ranks, measured, measured_cores);
    }
    plan.device_gib = o.device_memory_gib > 0.0 ? o.device_memory_gib : hw.memory_gib;
    plan.host_gib = o.host_memory_gib;
    std::vector<std::string> seen;
    for (const Candidate& cand : candidates(config, env)) {
        const bool is_config = !cand.choice;
        TrainConfig c;
        try {
            if (is_config && config.distributed_strategy == DistributedStrategy::kAuto) {
                user_error("distributed_strategy auto: the plan chooses it");
            }
            c = is_config ? config : with_execution(config, *cand.choice);  // with_execution runs check_config
            check_parallel_config(c, env, device);
        } catch (const UserError& e) {
            // Not a configuration this world runs (e.g. a batch that does not split over the ranks).
            if (is_config) {
                plan.config_refused = e.what();
            } else if (plan.other_refused.empty()) {
                plan.other_refused = e.what();
            }
            continue;
        }
        const std::string name = describe(c, world);
        if (!is_config && std::find(seen.begin(), seen.end(), name) != seen.end()) continue;
        seen.push_back(name);
        const bool bf16 = bf16_mixed(c.precision);  // amp_fp8's MFU too against the bf16 peak
        StepTimer timer(hw, cal, bf16, plan.slowdown);
        Row row{c, is_config, dry_run_step(c, env, device, &timer), {}};
        row.time = timer.result();
        const double L = static_cast<double>(c.model.max_sequence_length);
        row.tokens_per_s = static_cast<double>(c.global_train_batch_size) * L / world / row.time.total;
        double peak = bf16 ? hw.bf16_flops : hw.fp32_flops;
        if (peak <= 0.0 && cal != nullptr) peak = cal->peak_flops;  // the CPU: the benchmark's peak
        if (peak > 0.0) {
            const ParamLayout layout(c);
            row.mfu = flops_per_token(c.model, layout) * c.global_predicted_tokens() / world / row.time.total / peak;
        }
        row.fits_device = plan.device_gib <= 0.0 || row.dry.total_peak <= plan.device_gib * kGiB;
        row.host_per_node = row.dry.host_peak * env.local_world_size;
        row.fits_host = plan.host_gib <= 0.0 || static_cast<double>(row.host_per_node) <= plan.host_gib * kGiB;
        plan.rows.push_back(std::move(row));
    }
    if (plan.rows.empty()) {
        user_error("plan: no configuration runs on {} rank(s): {} (the config as given); {} (the others)", world,
                   plan.config_refused, plan.other_refused);
    }
    // The recommendation: the fastest row that fits; the reasons: its speed, what is faster but does not fit,
    // and how it compares with the config as given.
    int fastest = 0;
    for (size_t i = 0; i < plan.rows.size(); ++i) {
        const Row& r = plan.rows[i];
        if (r.time.total < plan.rows[fastest].time.total) fastest = static_cast<int>(i);
        if (r.fits() && (plan.recommended < 0 || r.time.total < plan.rows[plan.recommended].time.total))
            plan.recommended = static_cast<int>(i);
    }
    // What a row needs that is not there: the device's memory first, else the node's host memory.
    const auto shortfall = [&](const Row& r) {
        if (!r.fits_device) return fmt::format("{:.1f} GiB > {:.1f} GiB", r.dry.total_peak / kGiB, plan.device_gib);
        return fmt::format("{:.1f} GiB of host memory on a node > {:.1f} GiB", r.host_per_node / kGiB, plan.host_gib);
    };
    if (plan.recommended < 0) {
        // The smallest on the device among the rows that fit it, else among all.
        const Row& s = *std::min_element(plan.rows.begin(), plan.rows.end(), [](const Row& a, const Row& b) {
            if (a.fits_device != b.fits_device) return a.fits_device;
            return a.dry.total_peak < b.dry.total_peak;
        });
        plan.reasons = fmt::format(
            "nothing fits in {:.1f} GiB{}: the smallest, {}, needs {}", plan.device_gib,
            plan.host_gib > 0.0 ? fmt::format(" and {:.1f} GiB of host memory a node", plan.host_gib) : std::string(),
            describe(s.config, world), shortfall(s));
        return plan;
    }
    const Row& best = plan.rows[plan.recommended];
    plan.reasons = fmt::format("the fastest predicted, {:.0f} tokens/s/device", best.tokens_per_s);
    if (fastest != plan.recommended) {
        const Row& f = plan.rows[fastest];
        plan.reasons += fmt::format("; {} would be {:.0f}% faster but needs {}", describe(f.config, world),
                                    100.0 * (best.time.total / f.time.total - 1.0), shortfall(f));
    }
    for (const Row& r : plan.rows) {
        if (r.is_config && &r != &best) {
            plan.reasons += fmt::format("; the config as given: {:.0f} tokens/s/device{}", r.tokens_per_s,
                                        r.fits() ? "" : fmt::format(", does not fit ({})", shortfall(r)));
        }
    }
    return plan;
}

}  // namespace

Recommendation recommend(const TrainConfig& config, const RankEnv& env, Device device, const PlanOptions& options) {
    const Plan plan = make_plan(config, env, device, options);
    Recommendation r;
    r.hardware = plan.hw->name;
    r.device_gib = plan.device_gib;
    r.reasons = plan.reasons;
    if (plan.recommended >= 0) {
        r.config = plan.rows[plan.recommended].config;
        r.description = describe(*r.config, env.world_size);
    }
    return r;
}

// --trace-file: the predicted step of the config as given (else of the recommendation) as a Chrome trace, its
// spans named as a measured trace's, so the two can be merged and laid side by side.
void write_predicted_trace(const Plan& plan, int world, const std::string& path, bool announce) {
    const Row* row = nullptr;
    for (const Row& r : plan.rows) {
        if (r.is_config) row = &r;
    }
    if (row == nullptr && plan.recommended >= 0) row = &plan.rows[plan.recommended];
    if (row == nullptr) user_error("plan --trace-file {}: no configuration to draw", path);
    const int pid = 1000;  // apart from the measured ranks' pids (their rank) when merged
    Json events = Json::array();
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"args", {{"name", "predicted rank 0: " + describe(row->config, world)}}}});
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", "compute"}}}});
    const bool bf16 = bf16_mixed(row->config.precision);
    StepTimer timer(*plan.hw, plan.calibration ? &*plan.calibration : nullptr, bf16, plan.slowdown, &events, pid);
    dry_run_step(row->config, plan.env, plan.device, &timer);
    const std::string text = Json{{"displayTimeUnit", "ms"}, {"traceEvents", events}}.dump();
    write_text_file(path, text, "plan --trace-file");
    if (announce) {
        std::printf("predicted trace of %s written to %s\n\n", describe(row->config, world).c_str(), path.c_str());
    }
}

namespace {

// `text` cut into lines of at most `width` columns at spaces, the ones after the first indented by `indent`.
std::string wrapped(const std::string& text, size_t width, const std::string& indent) {
    std::string out, line;
    size_t at = 0;
    while (at < text.size()) {
        size_t end = text.find(' ', at);
        if (end == std::string::npos) end = text.size();
        const std::string word = text.substr(at, end - at);
        if (!line.empty() && line.size() + 1 + word.size() > width) {
            out += line + "\n";
            line = indent;
        }
        line += (line.empty() || line == indent ? "" : " ") + word;
        at = end + 1;
    }
    return out + line + "\n";
}

// Where a row's predicted step goes: each part's share of the step (step_parts.h), and the rest, the compute clock
// waiting for collectives and copies (and on a CPU the collectives' cycles).
std::string predicted_parts(const Row& r, int world) {
    double ops = 0.0;
    for (const auto& [part, seconds] : r.time.parts) ops += seconds;
    const double rest = std::max(r.time.total - ops, 0.0);
    return fmt::format("where its predicted step goes ({}): {}{}", describe(r.config, world),
                       describe_step_parts(r.time.parts, r.time.total),
                       r.time.total > 0.0
                           ? fmt::format("; waiting on collectives and copies {:.1f}%", 100.0 * rest / r.time.total)
                           : std::string());
}

// The plan in one screen (at most 25 lines of 160 columns): the recommended row, the config as given and the two
// fastest rows that fit of each strategy (the smallest where none of it fits), with each one's device peak; how many
// rows were planned and how many do not fit. --all prints every row with its memory by category.
int print_plan_summary(const TrainConfig& config, const Plan& plan, const PlanOptions& o, int world, Device device,
                       bool know_memory) {
    const std::vector<Row>& rows = plan.rows;
    const auto family = [](const TrainConfig& c) {
        return c.distributed_strategy == DistributedStrategy::kFsdp
                   ? std::string("fsdp ") + choice_name(c.fsdp.sharding_strategy)
                   : std::string(choice_name(c.distributed_strategy));
    };
    std::vector<size_t> order(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return rows[a].tokens_per_s > rows[b].tokens_per_s; });
    std::vector<bool> shown(rows.size(), false);
    std::map<std::string, int> per_family;
    for (size_t i : order) {  // the two fastest that fit of each strategy
        if (!rows[i].fits()) continue;
        if (per_family[family(rows[i].config)]++ < 2) shown[i] = true;
    }
    for (size_t i = 0; i < rows.size(); ++i) {  // a strategy none of whose rows fits: its smallest
        if (per_family.count(family(rows[i].config)) > 0) continue;
        size_t s = i;
        for (size_t j = 0; j < rows.size(); ++j) {
            if (family(rows[j].config) == family(rows[i].config) && rows[j].dry.total_peak < rows[s].dry.total_peak)
                s = j;
        }
        shown[s] = true;
        per_family[family(rows[i].config)] = 0;
    }
    for (size_t i = 0; i < rows.size(); ++i) {
        if (rows[i].is_config || static_cast<int>(i) == plan.recommended) shown[i] = true;
    }
    size_t misfits = 0;
    for (const Row& r : rows) misfits += r.fits() ? 0 : 1;
    std::printf("plan for %s on %d node(s) x %d rank(s), device %s, hardware %s: %zu configurations dry-run%s\n",
                config.run_name.c_str(), o.nnodes, o.nproc_per_node, choice_name(device), plan.hw->name.c_str(),
                rows.size(),
                know_memory ? fmt::format(", {} do not fit in {:.1f} GiB", misfits, plan.device_gib).c_str() : "");
    std::printf("\n| configuration | step ms | exposed comm ms | tokens/s/device | MFU | device GiB |%s\n",
                know_memory ? " fits |" : "");
    std::printf("|---|---|---|---|---|---|%s\n", know_memory ? "---|" : "");
    for (size_t i : order) {
        if (!shown[i]) continue;
        const Row& r = rows[i];
        const char* mark = static_cast<int>(i) == plan.recommended ? "-> " : r.is_config ? "* " : "";
        std::printf("| %s%s | %.1f | %.1f | %.0f | %.1f%% | %.2f |%s\n", mark, describe(r.config, world).c_str(),
                    r.time.total * 1e3, r.time.exposed_comm * 1e3, r.tokens_per_s, 100.0 * r.mfu,
                    r.dry.total_peak / kGiB,
                    know_memory ? (r.fits()        ? " yes |"
                                   : r.fits_device ? " no (host) |"
                                                   : " no |")
                                : "");
    }
    std::printf("\n");
    if (!plan.config_refused.empty())
        std::printf("%s", wrapped("the config as given does not run here: " + plan.config_refused, 160, "  ").c_str());
    const std::string verdict =
        plan.recommended >= 0 ? "recommended: " + describe(rows[plan.recommended].config, world) + ": " + plan.reasons
                              : "no recommendation: " + plan.reasons;
    std::printf("%s", wrapped(verdict, 160, "  ").c_str());
    if (plan.recommended >= 0)
        std::printf("%s", wrapped(predicted_parts(rows[plan.recommended], world), 160, "  ").c_str());
    std::printf(
        "-> the recommendation, * the config as given; --all: every row, its memory by category and the links\n");
    return 0;
}

}  // namespace

int run_plan(const TrainConfig& config, const PlanOptions& options) {
    PlanOptions o = options;  // the flags, else the config's plan.* keys
    if (o.hardware.empty()) o.hardware = config.plan.hardware.value_or("");
    if (o.calibration.empty()) o.calibration = config.plan.calibration.value_or("");
    if (o.comm_calibration.empty()) o.comm_calibration = config.plan.comm_calibration.value_or("");
    if (o.device_memory_gib <= 0.0) o.device_memory_gib = config.plan.device_memory_gib.value_or(0.0);
    if (o.host_memory_gib <= 0.0) o.host_memory_gib = config.plan.host_memory_gib.value_or(0.0);
    if (o.nnodes < 1 || o.nproc_per_node < 1) {
        user_error("plan: --nnodes {} and --nproc-per-node {} must be at least 1", o.nnodes, o.nproc_per_node);
    }
    RankEnv env;
    env.world_size = o.nnodes * o.nproc_per_node;
    env.local_world_size = o.nproc_per_node;
    env.launcher = "--nnodes x --nproc-per-node";  // as the parallel checks name who started the ranks
    const Device device = resolve_device(config.device);
    const int world = env.world_size;
    const Plan plan = make_plan(config, env, device, o);
    const Hardware& hw = *plan.hw;
    if (config.trace_file) write_predicted_trace(plan, world, *config.trace_file, !o.json);
    const bool know_memory = plan.device_gib > 0.0 || plan.host_gib > 0.0;
    // LoRA's frozen base is a column of its own beside the trained parameters.
    std::vector<MemCategory> shown = {MemCategory::kParameters,     MemCategory::kGradients,
                                      MemCategory::kOptimizerState, MemCategory::kGatheredUnits,
                                      MemCategory::kActivations,    MemCategory::kCommunication};
    if (config.lora.enabled) shown.insert(shown.begin() + 1, MemCategory::kFrozenParameters);
    if (o.json) {
        for (size_t i = 0; i < plan.rows.size(); ++i) {
            const Row& r = plan.rows[i];
            const Json doc = config_json(r.config);
            Json keys = Json::object();
            keys["distributed_strategy"] = choice_name(r.config.distributed_strategy);
            if (r.config.distributed_strategy == DistributedStrategy::kFsdp) {
                keys["fsdp.sharding_strategy"] = choice_name(r.config.fsdp.sharding_strategy);
                keys["fsdp.wrapping_strategy"] = doc["fsdp"]["wrapping_strategy"];
                keys["fsdp.precision"] = choice_name(r.config.fsdp.precision);
                keys["fsdp.grad_sync_mode"] = choice_name(r.config.fsdp.grad_sync_mode);
            } else if (r.config.distributed_strategy == DistributedStrategy::kDdp) {
                keys["ddp.grad_sync_mode"] = choice_name(r.config.ddp_grad_sync_mode);
            }
            keys["activation_checkpointing"] = doc["activation_checkpointing"];
            keys["cpu_offload.optimizer_state"] = r.config.cpu_offload.optimizer_state;
            keys["cpu_offload.parameters"] = r.config.cpu_offload.parameters;
            keys["kernels.cuda_graphs"] = r.config.kernels_cuda_graphs;
            Json peak = Json::object();
            for (int m = 0; m < kNumMemCategories; ++m)
                peak[mem_category_name(static_cast<MemCategory>(m))] = r.dry.peak[m];
            peak["total"] = r.dry.total_peak;
            peak["host_total"] = r.dry.host_peak;
            Json parts_ms = Json::object();  // the ops' milliseconds by the part of the step (step_parts.h)
            for (const auto& [part, seconds] : r.time.parts) parts_ms[part] = seconds * 1e3;
            Json row = {{"config", keys},
                        {"is_config", r.is_config},
                        {"world_size", world},
                        {"hardware", hw.name},
                        {"predicted_step_ms", r.time.total * 1e3},
                        {"predicted_compute_ms", r.time.compute * 1e3},
                        {"predicted_exposed_comm_ms", r.time.exposed_comm * 1e3},
                        {"predicted_optimizer_ms", r.time.optimizer * 1e3},
                        {"predicted_parts_ms", parts_ms},
                        {"predicted_tokens_per_second_per_device", r.tokens_per_s},
                        {"predicted_mfu", r.mfu},
                        {"predicted_peak_bytes", peak},
                        {"fits", know_memory ? Json(r.fits()) : Json(nullptr)},
                        {"host_bytes_per_node", r.host_per_node},
                        {"recommended", static_cast<int>(i) == plan.recommended}};
            std::printf("%s\n", row.dump().c_str());
        }
        return 0;
    }
    if (!o.all) return print_plan_summary(config, plan, o, world, device, know_memory);
    // A link as the header shows it: the all-reduce's (the entry's one link), each other measured kind's
    // bandwidth, and where it comes from.
    const auto link = [&](const Link& l, const std::map<std::string, Link>& by_kind) {
        std::string s = fmt::format("{:.4g} GB/s, {:.4g} us", l.bandwidth / 1e9, l.latency * 1e6);
        for (const auto& [kind, k] : by_kind) {
            if (kind != "all_reduce") s += fmt::format(", {} {:.4g} GB/s", kind, k.bandwidth / 1e9);
        }
        if (!by_kind.empty()) s += fmt::format(" (measured: {})", plan.comm->path);
        return s;
    };
    // CPU offload's side of the entry, where it has one and a row offloads.
    bool offloads = false;
    for (const Row& r : plan.rows) offloads = offloads || r.config.cpu_offload.optimizer_state;
    std::string host_side;
    if (offloads) {
        host_side = "; CPU offload: ";
        if (hw.host_link.bandwidth > 0.0) {
            host_side += fmt::format("host link {:.4g} GB/s, host memory {:.4g} GB/s a rank, ",
                                     hw.host_link.bandwidth / 1e9, hw.host_bandwidth / 1e9);
        }
        host_side += plan.host_gib > 0.0 ? fmt::format("{:.4g} GiB of host memory a node", plan.host_gib)
                                         : "host memory a node not checked (--host-memory)";
    }
    std::printf(
        "plan for %s on %d node(s) x %d rank(s), device %s, hardware %s (%s; links within a node %s, between "
        "nodes %s%s)%s: a dry run of one step per configuration; times per step, memory per rank in GiB\n\n",
        config.run_name.c_str(), o.nnodes, o.nproc_per_node, choice_name(device), hw.name.c_str(),
        hw.description.c_str(), link(hw.intra, hw.intra_by_kind).c_str(), link(hw.inter, hw.inter_by_kind).c_str(),
        host_side.c_str(), plan.calibration ? fmt::format(", op times from {}", plan.calibration->path).c_str() : "");
    const char* frozen = config.lora.enabled ? " frozen |" : "";
    std::printf(
        "| configuration | step ms | compute | exposed comm | optimizer | tokens/s/device | MFU | parameters |%s "
        "gradients | optimizer state | gathered | activations | communication | device peak | host |%s\n",
        frozen, know_memory ? " fits |" : "");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|%s%s\n",
                config.lora.enabled ? "---|" : "", know_memory ? "---|" : "");
    for (size_t i = 0; i < plan.rows.size(); ++i) {
        const Row& r = plan.rows[i];
        const char* mark = static_cast<int>(i) == plan.recommended ? "-> " : r.is_config ? "* " : "";
        std::string line =
            fmt::format("| {}{} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.0f} | {:.1f}% |", mark,
                        describe(r.config, world), r.time.total * 1e3, r.time.compute * 1e3, r.time.exposed_comm * 1e3,
                        r.time.optimizer * 1e3, r.tokens_per_s, 100.0 * r.mfu);
        for (MemCategory c : shown) line += fmt::format(" {:.2f} |", r.dry.peak[static_cast<int>(c)] / kGiB);
        line += fmt::format(" {:.2f} | {:.2f} |", r.dry.total_peak / kGiB, r.dry.host_peak / kGiB);
        if (know_memory) line += r.fits() ? " yes |" : r.fits_device ? " no (host) |" : " no |";
        std::printf("%s\n", line.c_str());
    }
    if (!plan.config_refused.empty())
        std::printf("\nthe config as given does not run here: %s\n", plan.config_refused.c_str());
    if (plan.recommended >= 0) {
        std::printf("\nrecommended: %s: %s\n", describe(plan.rows[plan.recommended].config, world).c_str(),
                    plan.reasons.c_str());
        std::printf("%s\n", predicted_parts(plan.rows[plan.recommended], world).c_str());
    } else {
        std::printf("\nno recommendation: %s\n", plan.reasons.c_str());
    }
    std::printf(
        "\n-> the recommendation, * the config as given. Device peak: the high-water mark of the device categories "
        "together; on a GPU the backend's kernel scratch (bf16 operand copies, attention workspaces) comes on top. "
        "Step times: the ops at their calibrated or roofline times, the collectives on their links, overlapped "
        "where the strategy overlaps them.\n");
    return 0;
}

}  // namespace trainer
