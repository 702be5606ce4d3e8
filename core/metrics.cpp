// FLOPs, peak detection and the metrics file (see metrics.h).
#include "core/metrics.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/common.h"

namespace trainer {

double flops_per_token(const ModelConfig& m, const ParamLayout& layout) {
    const double T = m.max_sequence_length - 1;
    return 6.0 * static_cast<double>(layout.matmul_numel()) + 12.0 * m.n_layers * m.d_model * T;
}

double measure_clock_hz() {
#if defined(__x86_64__)
    double best = 0.0;
    for (int trial = 0; trial < 5; ++trial) {
        const long iters = 2000000;
        uint64_t x = 0;
        const auto t0 = std::chrono::steady_clock::now();
        for (long i = 0; i < iters; ++i) {
            // 8 dependent adds: 8 cycles per iteration; the loop's own increment and branch run alongside.
            asm volatile(
                "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
                : "+r"(x));
        }
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, 8.0 * static_cast<double>(iters) / dt);
    }
    return best;
#else
    return 0.0;
#endif
}

PeakFlops cpu_peak_flops(int threads, const std::optional<double>& configured) {
    if (configured)
        return {*configured * threads,
                fmt::format("configured {:.1f} GFLOP/s per core x {} threads", *configured / 1e9, threads)};
    std::ifstream f("/proc/cpuinfo");
    std::string line, flags, vendor;
    double mhz = 0.0;
    int family = 0;
    while (std::getline(f, line)) {
        auto value = [&]() { return line.substr(line.find(':') + 1); };
        if (line.rfind("cpu MHz", 0) == 0)
            mhz = std::max(mhz, std::atof(value().c_str()));
        else if (line.rfind("flags", 0) == 0 && flags.empty())
            flags = value() + " ";
        else if (line.rfind("vendor_id", 0) == 0 && vendor.empty())
            vendor = value();
        else if (line.rfind("cpu family", 0) == 0 && family == 0)
            family = std::atoi(value().c_str());
    }
    auto has = [&](const char* flag) { return flags.find(std::string(" ") + flag + " ") != std::string::npos; };
    // FLOP per cycle per core = 2 (FMA) x FMA pipes x fp32 lanes. AVX-512 cores before AMD Zen 5 split
    // 512-bit FMAs into two 256-bit halves, so they count as two 256-bit pipes.
    int per_cycle = 8;
    std::string isa = "sse";
    const bool amd = vendor.find("AMD") != std::string::npos;
    if (has("avx512f") && (!amd || family >= 26))
        per_cycle = 64, isa = "avx512f, 2 FMA pipes";
    else if (has("avx2") && has("fma"))
        per_cycle = 32, isa = "avx2+fma, 2 FMA pipes";
    else if (has("avx"))
        per_cycle = 16, isa = "avx";
    // /proc/cpuinfo gives the nominal clock; cores boost above it, so the clock is also measured (a chain
    // of dependent integer adds retires one per cycle) and the larger of the two is used.
    const double measured_mhz = measure_clock_hz() / 1e6;
    const bool use_measured = measured_mhz > mhz;
    mhz = std::max(mhz, measured_mhz);
    if (mhz <= 0.0) mhz = 2000.0;
    const double peak = threads * mhz * 1e6 * per_cycle;
    return {peak, fmt::format("{} cores x {:.2f} GHz ({}) x {} FLOP/cycle ({}); override with peak_flops_per_device",
                              threads, mhz / 1000.0, use_measured ? "measured" : "/proc/cpuinfo", per_cycle, isa)};
}

double measure_fma_peak(int threads, double seconds) {
#if defined(__AVX512F__)
    constexpr int kLanes = 16;
#else
    constexpr int kLanes = 8;
#endif
    typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
    constexpr int kChains = 12;  // enough independent FMAs to cover latency x pipes
    double best = 0.0;
    for (int trial = 0; trial < 3; ++trial) {
        const long iters = 1 << 22;
        double total_flops = 0.0;
        const auto t0 = std::chrono::steady_clock::now();
        double sink = 0.0;
        long rounds = 0;
        do {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
            {
                vec acc[kChains];
                vec a, b;
                for (int l = 0; l < kLanes; ++l) a[l] = 1.0f + 1e-7f * l, b[l] = 0.999999f;
                for (int c = 0; c < kChains; ++c) acc[c] = a * static_cast<float>(c + 1) * 1e-3f;
                for (long i = 0; i < iters / kChains; ++i) {
                    for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * b + a;
                }
                float s = 0.0f;
                for (int c = 0; c < kChains; ++c) {
                    for (int l = 0; l < kLanes; ++l) s += acc[c][l];
                }
                sink += s;
            }
            total_flops += 2.0 * kLanes * (iters / kChains) * kChains * static_cast<double>(threads);
            ++rounds;
        } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds / 3);
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (sink == 42.0) std::puts("");  // keeps the chains alive
        best = std::max(best, total_flops / dt);
    }
    return best;
}

MetricsWriter::MetricsWriter(const std::optional<std::string>& path, bool append) : append_(append) {
    if (!path) return;
    path_ = *path;
    // Checked now, opened at the first record: a run that fails before its first step leaves an existing
    // metrics file as it was.
    const auto parent = std::filesystem::path(path_).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    const std::string dir = parent.empty() ? "." : parent.string();
    const bool exists = std::filesystem::exists(path_, ec);
    if (ec || (exists ? ::access(path_.c_str(), W_OK) : ::access(dir.c_str(), W_OK)) != 0) {
        user_error("metrics_file {}: cannot be written ({})", path_, std::strerror(errno ? errno : EACCES));
    }
}

MetricsWriter::~MetricsWriter() {
    if (f_) std::fclose(f_);
}

void MetricsWriter::write(const Json& record) {
    if (path_.empty()) return;
    if (!f_) {
        f_ = std::fopen(path_.c_str(), append_ ? "a" : "w");
        if (!f_) user_error("metrics_file {}: cannot be written ({})", path_, std::strerror(errno));
    }
    const std::string line = record.dump() + "\n";
    std::fwrite(line.data(), 1, line.size(), f_);
    std::fflush(f_);
}

}  // namespace trainer
