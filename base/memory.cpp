// Process-wide memory counters (see memory.h).
#include "base/memory.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <mutex>
#include <sstream>

namespace trainer {
namespace {
std::mutex g_mutex;
MemorySnapshot g_state;
}  // namespace

const char* mem_category_name(MemCategory c) {
    switch (c) {
        case MemCategory::kParameters:
            return "parameters";
        case MemCategory::kGradients:
            return "gradients";
        case MemCategory::kOptimizerState:
            return "optimizer_state";
        case MemCategory::kGatheredUnits:
            return "gathered_units";
        case MemCategory::kActivations:
            return "activations";
        case MemCategory::kCommunication:
            return "communication";
        case MemCategory::kOther:
            return "other";
        case MemCategory::kFrozenParameters:
            return "frozen_parameters";
        case MemCategory::kHostParameters:
            return "host_parameters";
        case MemCategory::kHostGradients:
            return "host_gradients";
        case MemCategory::kHostOptimizerState:
            return "host_optimizer_state";
        case MemCategory::kHostCheckpoint:
            return "host_checkpoint_snapshot";
        case MemCategory::kCount:
            break;
    }
    return "unknown";
}

void memory_record_alloc(MemCategory c, int64_t bytes) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const int i = static_cast<int>(c);
    g_state.current[i] += bytes;
    if (g_state.current[i] > g_state.peak[i]) g_state.peak[i] = g_state.current[i];
    if (mem_category_is_host(c)) {
        g_state.host_current += bytes;
        if (g_state.host_current > g_state.host_peak) g_state.host_peak = g_state.host_current;
        return;
    }
    g_state.total_current += bytes;
    if (g_state.total_current > g_state.total_peak) g_state.total_peak = g_state.total_current;
}

void memory_record_free(MemCategory c, int64_t bytes) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_state.current[static_cast<int>(c)] -= bytes;
    (mem_category_is_host(c) ? g_state.host_current : g_state.total_current) -= bytes;
}

MemorySnapshot memory_snapshot() {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_state;
}

void memory_reset_peaks() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_state.peak = g_state.current;
    g_state.total_peak = g_state.total_current;
    g_state.host_peak = g_state.host_current;
}

void memory_restore_peaks(const MemorySnapshot& before) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (int c = 0; c < kNumMemCategories; ++c) g_state.peak[c] = std::max(before.peak[c], g_state.current[c]);
    g_state.total_peak = std::max(before.total_peak, g_state.total_current);
    g_state.host_peak = std::max(before.host_peak, g_state.host_current);
}

int64_t process_peak_resident_bytes() {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line)) {
        if (line.rfind("VmHWM:", 0) == 0) {
            std::istringstream is(line.substr(6));
            int64_t kb = 0;
            is >> kb;
            return kb * 1024;
        }
    }
    return 0;
}

}  // namespace trainer
