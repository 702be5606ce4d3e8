// The run's console and memory reports (see report.h).
#include "core/run/report.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "base/common.h"
#include "base/config.h"
#include "base/layout.h"
#include "base/memory.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"

namespace trainer {

std::string human_count(double x) {
    if (x >= 1e9) return fmt::format("{:.2f}B", x / 1e9);
    if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
    if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
    return fmt::format("{:.0f}", x);
}

ProgressBar::ProgressBar(long total)
    : total_(total), enabled_(::isatty(fileno(stdout)) != 0 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) {}

void ProgressBar::clear() {
    if (enabled_ && drawn_) std::printf("\r\033[K");
    drawn_ = false;
}

void ProgressBar::draw(long step, double eta_s) {
    if (!enabled_) return;
    const int width = 30;
    const int filled = static_cast<int>(width * static_cast<double>(step) / static_cast<double>(total_));
    std::printf("\r[%.*s%*s] %ld/%ld  eta %.0fs", filled, "==============================", width - filled, "", step,
                total_, eta_s);
    std::fflush(stdout);
    drawn_ = true;
}

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

std::string peak_memory_text(const MemorySnapshot& mem) {
    const double mib = 1048576.0;
    auto peak = [&](MemCategory c) { return mem.peak[static_cast<int>(c)] / mib; };
    const std::string host =
        mem.host_peak > 0
            ? fmt::format(
                  ", host {:.1f} MiB (params {:.1f}, grads {:.1f}, optimizer {:.1f}, checkpoint snapshot {:.1f})",
                  mem.host_peak / mib, peak(MemCategory::kHostParameters), peak(MemCategory::kHostGradients),
                  peak(MemCategory::kHostOptimizerState), peak(MemCategory::kHostCheckpoint))
            : std::string();
    return fmt::format(
        "peak memory {:.1f} MiB (params {:.1f}{}, grads {:.1f}, optimizer {:.1f}, activations {:.1f}){}, resident "
        "{:.1f} MiB",
        mem.total_peak / mib, peak(MemCategory::kParameters),
        mem.peak[static_cast<int>(MemCategory::kFrozenParameters)] > 0
            ? fmt::format(", frozen {:.1f}", peak(MemCategory::kFrozenParameters))
            : std::string(),
        peak(MemCategory::kGradients), peak(MemCategory::kOptimizerState), peak(MemCategory::kActivations), host,
        process_peak_resident_bytes() / mib);
}

std::string trace_path(const std::string& path, int rank, int world) {
    if (world == 1) return path;
    const size_t slash = path.find_last_of('/'), dot = path.find_last_of('.');
    const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
    const std::string stem = has_ext ? path.substr(0, dot) : path, ext = has_ext ? path.substr(dot) : "";
    return fmt::format("{}.rank{}{}", stem, rank, ext);
}

RunHeader run_header(const TrainConfig& config, const ParamLayout& layout, const Backend& backend, Device device) {
    const ModelConfig& m = config.model;
    RunHeader h;
    h.run_name = config.run_name;
    h.parameters = layout.total_numel(), h.matmul_parameters = layout.matmul_numel();
    h.adapter_parameters = layout.has_adapters() ? layout.trainable_numel() : 0;
    h.units = layout.num_units(), h.layers = m.n_layers, h.d_model = m.d_model;
    h.device = backend.name(), h.compute = choice_name(config.precision);
    h.sequence = m.max_sequence_length, h.predicted = m.predicted_positions();
    h.global_batch = config.global_train_batch_size, h.micro_batch = config.device_train_microbatch_size;
    h.fp8_on_cpu = config.precision == Precision::kAmpFp8 && device == Device::kCpu;
    h.seed = config.seed;
    if (config.cpu_offload.optimizer_state)
        h.offload = config.cpu_offload.parameters ? "optimizer state and parameters" : "optimizer state";
    h.gemms = backend.library_description();
    return h;
}

void print_run_header(const RunHeader& h) {
    std::printf(
        "run %s: %s parameters (%s in matmuls) in %d units, strategy %s, device %s (%s), collectives %s, %d "
        "threads\n",
        h.run_name.c_str(), human_count(static_cast<double>(h.parameters)).c_str(),
        human_count(static_cast<double>(h.matmul_parameters)).c_str(), h.units, h.strategy.c_str(), h.device.c_str(),
        h.compute.c_str(), h.collectives.c_str(), h.threads);
    std::printf("data: %ld instances of %ld tokens; %ld steps of %ld instances (micro-batch %ld x %ld accumulation)\n",
                h.instances, h.sequence, h.steps, h.global_batch, h.micro_batch, h.accumulation);
    for (const std::string& note : h.notes) std::printf("%s\n", note.c_str());
    if (h.fp8_on_cpu) {
        std::printf(
            "amp_fp8 on the CPU: the emulation of the FP8 recipe, for its numerics and not its speed (slower than "
            "fp32): the blocks' Linear layers read their operands rounded to e4m3 (e5m2 gradients) with per-tensor "
            "scales, and accumulate in fp32\n");
    }
    const long T = h.predicted;
    if (h.adapter_parameters > 0) {
        std::printf(
            "FLOPs per token = 4F + 6A + 12*L*d*T = 4*%zu + 6*%zu + 12*%d*%d*%ld = %.4g (LoRA: F frozen matmul "
            "parameters, no weight gradient; A adapter parameters; T = %ld predicted positions)\n",
            h.matmul_parameters - h.adapter_parameters, h.adapter_parameters, h.layers, h.d_model, T, h.flops_per_token,
            T);
        if (h.lora_on_random_base) {
            // Allowed (tests and trials), and said: a forgotten --init-from fine-tunes a random model.
            std::printf(
                "note: lora.enabled without --init-from: the frozen base is the untrained initialisation of seed %llu, "
                "so the adapters fine-tune a random model (--init-from names the base's weights)\n",
                h.seed);
        }
    } else {
        std::printf(
            "FLOPs per token = 6N + 12*L*d*T = 6*%zu + 12*%d*%d*%ld = %.4g (N: matmul parameters, T = %ld predicted "
            "positions)\n",
            h.matmul_parameters, h.layers, h.d_model, T, h.flops_per_token, T);
    }
    std::printf("MFU peak: %.1f GFLOP/s = %s\n", h.peak_flops / 1e9, h.peak_how.c_str());
    if (!h.offload.empty()) {
        std::printf("cpu offload: %s in host memory, %.1f MiB per rank; AdamW on the host\n", h.offload.c_str(),
                    h.host_mib);
    }
    if (!h.gemms.empty()) std::printf("GEMMs: %s\n", h.gemms.c_str());
    std::fflush(stdout);
}

}  // namespace trainer
