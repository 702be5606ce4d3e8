// Threads, clock and fp32 peak of the CPU (see machine.h).
#include "kernels/cpu/machine.h"

#include <cblas.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "base/common.h"
#include "kernels/cpu/ops.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Independent FMA chains, enough to cover an FMA's latency times the pipes of any current core.
constexpr int kChains = 12;

// One round of kChains independent FMA chains, `iters` long, on vectors of `lanes` floats; the return value
// depends on every chain so none is optimised away. Each ISA's version is compiled for it whatever the
// build targets, and picked at run time (widest_lanes).
#if defined(__x86_64__)
__attribute__((target("avx512f"))) float fma_chains_512(long iters) {
    __m512 acc[kChains];
    const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.999999f);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1e-3f * static_cast<float>(c + 1));
    for (long i = 0; i < iters; ++i) {
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], b, a);
    }
    alignas(64) float lanes[16];  // (not _mm512_reduce_add_ps: GCC 12 warns inside it)
    float s = 0.0f;
    for (int c = 0; c < kChains; ++c) {
        _mm512_store_ps(lanes, acc[c]);
        for (float x : lanes) s += x;
    }
    return s;
}

__attribute__((target("avx2,fma"))) float fma_chains_256(long iters) {
    __m256 acc[kChains];
    const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.999999f);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(1e-3f * static_cast<float>(c + 1));
    for (long i = 0; i < iters; ++i) {
        for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], b, a);
    }
    alignas(32) float lanes[8];
    float s = 0.0f;
    for (int c = 0; c < kChains; ++c) {
        _mm256_store_ps(lanes, acc[c]);
        for (float x : lanes) s += x;
    }
    return s;
}
#endif

// The portable version: 4-lane multiply-adds (SSE on x86-64, NEON elsewhere, as the compiler sees fit).
float fma_chains_128(long iters) {
    typedef float vec __attribute__((vector_size(16)));
    vec acc[kChains];
    const vec a = {1.0f, 1.0f, 1.0f, 1.0f}, b = {0.999999f, 0.999999f, 0.999999f, 0.999999f};
    for (int c = 0; c < kChains; ++c) acc[c] = a * (1e-3f * static_cast<float>(c + 1));
    for (long i = 0; i < iters; ++i) {
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * b + a;
    }
    float s = 0.0f;
    for (int c = 0; c < kChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    return s;
}

// fp32 lanes of the widest vector FMA this CPU runs (16: AVX-512, 8: AVX2 + FMA, 4: otherwise).
int widest_lanes() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
#endif
    return 4;
}

float fma_chains(int lanes, long iters) {
#if defined(__x86_64__)
    if (lanes == 16) return fma_chains_512(iters);
    if (lanes == 8) return fma_chains_256(iters);
#endif
    return fma_chains_128(iters);
}

// Best FLOP/s of `threads` threads each running `iters` rounds, over `trials` timed repetitions of at least
// `min_seconds` each.
double best_fma_rate(int threads, int lanes, long iters, int trials, double min_seconds) {
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int trial = 0; trial < trials; ++trial) {
        double flops = 0.0;
        const auto t0 = Clock::now();
        do {
            float s = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : s)
            s += fma_chains(lanes, iters);
            sink = sink + s;
            flops += 2.0 * lanes * kChains * static_cast<double>(iters) * threads;
        } while (seconds_since(t0) < min_seconds);
        best = std::max(best, flops / seconds_since(t0));
    }
    return best;
}

}  // namespace

ThreadGovernor::ThreadGovernor(int max_threads) : max_threads_(max_threads), threads_(max_threads) {
    double own = 0.0, idle = 0.0;
    (void)sample(&own, &idle);  // the baseline
}

namespace {

double seconds_of(clockid_t clock) {
    timespec t{};
    ::clock_gettime(clock, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Idle seconds so far of the cores in this process's affinity mask (idle + iowait of their /proc/stat lines).
double idle_seconds_of_allowed_cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0.0;
    std::ifstream stat("/proc/stat");
    std::string line;
    double ticks = 0.0;
    while (std::getline(stat, line)) {
        if (line.compare(0, 3, "cpu") != 0 || line.size() < 4 || !std::isdigit(static_cast<unsigned char>(line[3])))
            continue;
        const int cpu = std::atoi(line.c_str() + 3);
        if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &set)) continue;
        // cpuN user nice system idle iowait ...
        unsigned long long v[5] = {};
        if (std::sscanf(line.c_str() + 3, "%*d %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4]) == 5)
            ticks += static_cast<double>(v[3] + v[4]);
    }
    return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace

bool ThreadGovernor::sample(double* own_cores, double* idle_cores) {
    const double wall = seconds_of(CLOCK_MONOTONIC);
    if (last_wall_ > 0.0 && wall - last_wall_ < 0.5) return false;
    const double cpu = seconds_of(CLOCK_PROCESS_CPUTIME_ID), idle = idle_seconds_of_allowed_cores();
    const bool have = last_wall_ > 0.0;
    if (have) {
        *own_cores = (cpu - last_cpu_) / (wall - last_wall_);
        *idle_cores = (idle - last_idle_) / (wall - last_wall_);
    }
    last_wall_ = wall, last_cpu_ = cpu, last_idle_ = idle;
    return have;
}

int ThreadGovernor::poll() {
    double own = 0.0, idle = 0.0;
    if (max_threads_ <= 1 || !sample(&own, &idle)) return 0;
    const int usable = std::clamp(static_cast<int>(std::floor(own + idle + 0.5)), 1, max_threads_);
    if (usable == threads_) {
        pending_ = 0;
        return 0;
    }
    if (pending_ != usable) {  // once more before acting: a single sample may catch a passing burst
        pending_ = usable;
        return 0;
    }
    pending_ = 0;
    threads_ = set_thread_count(usable);
    return threads_;
}

int set_thread_count(int threads) {
    threads = std::max(1, threads);
    omp_set_num_threads(threads);
    // OpenBLAS's own threads stay at one: the GEMMs run their tiles on OpenMP's (kernels/cpu/matmul.cpp). Its
    // OpenMP build follows the calling task's OpenMP count, which the tiles set to one; its pthreads build keeps
    // this count.
    if (openblas_get_parallel() != 2) openblas_set_num_threads(1);
    return threads;
}

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
    cpu::set_gemm_partition(threads);
    return set_thread_count(threads);
}

double measure_clock_hz() {
#if defined(__x86_64__)
    double best = 0.0;
    const uint64_t factor = 0x9E3779B97F4A7C15ull;  // a run-time value in a register: nothing to fold
    for (int trial = 0; trial < 5; ++trial) {
        const long iters = 400000;
        uint64_t x = 1;
        const auto t0 = Clock::now();
        for (long i = 0; i < iters; ++i) {
            // 8 dependent 64-bit multiplies, 3 cycles each: 24 cycles an iteration; the loop's own increment and
            // branch run alongside.
            asm volatile(
                "imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\t"
                "imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0"
                : "+r"(x)
                : "r"(factor));
        }
        best = std::max(best, 24.0 * static_cast<double>(iters) / seconds_since(t0));
    }
    return best;
#else
    return 0.0;
#endif
}

double measure_fma_peak(int threads, double seconds) {
    return best_fma_rate(threads, widest_lanes(), 1 << 18, 3, seconds / 3);
}

double cpuinfo_clock_hz() {
    std::ifstream f("/proc/cpuinfo");
    std::string line;
    double mhz = 0.0;
    while (std::getline(f, line)) {
        if (line.rfind("cpu MHz", 0) == 0) mhz = std::max(mhz, std::atof(line.substr(line.find(':') + 1).c_str()));
    }
    return mhz * 1e6;
}

CpuPeak cpu_peak_flops(int threads) {
    const double mhz = cpuinfo_clock_hz() / 1e6;
    // /proc/cpuinfo gives the nominal clock; cores boost above it, so the clock is also measured (a chain of
    // dependent integer multiplies, 3 cycles each) and the larger of the two is used.
    const double measured_hz = measure_clock_hz();
    const bool use_measured = measured_hz / 1e6 > mhz;
    const double hz = std::max(mhz * 1e6, measured_hz) > 0.0 ? std::max(mhz * 1e6, measured_hz) : 2e9;
    // FMA pipes per core: one core's measured FLOP per cycle over 2 x lanes, the nearer of 1 and 2 (their
    // geometric mean divides them), so a busy moment slows the measurement without halving the peak.
    const int lanes = widest_lanes();
    const double per_cycle_measured = best_fma_rate(1, lanes, 1 << 16, 5, 0.002) / hz;
    const int pipes = per_cycle_measured > 2.0 * lanes * std::sqrt(2.0) ? 2 : 1;
    const int per_cycle = 2 * lanes * pipes;
    const char* isa = lanes == 16 ? "avx512f" : lanes == 8 ? "avx2+fma" : "128-bit";
    return {threads * hz * per_cycle,
            fmt::format("{} cores x {:.2f} GHz ({}) x {} FLOP/cycle ({}, {} FMA pipe{} measured); override with "
                        "peak_flops_per_device",
                        threads, hz / 1e9, use_measured ? "measured" : "/proc/cpuinfo", per_cycle, isa, pipes,
                        pipes == 1 ? "" : "s")};
}

}  // namespace trainer
