// Memory accounting: every buffer the trainer allocates is counted under one category, so the step log
// and the run summary can say where each byte of a rank's memory went (parameters, gradients,
// optimizer state, gathered units, activations, communication buffers), measured, not guessed.
// Counters are process-wide and thread-safe; peaks are high-water marks of the live bytes. The host
// categories count what CPU offload keeps in host memory (pinned on a GPU); the device total leaves them
// out and the host total counts only them (on the CPU backend both live in the same memory).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace trainer {

enum class MemCategory : int {
    kParameters = 0,
    kGradients,
    kOptimizerState,
    kGatheredUnits,
    kActivations,
    kCommunication,
    kOther,
    kFrozenParameters,    // LoRA's base weights: never trained, so no gradient and no optimizer state beside them
    kHostParameters,      // cpu_offload: the fp32 master parameters (and their bf16 copy for the upload)
    kHostGradients,       // cpu_offload: two chunks of the gradients, streamed down to the host optimizer
    kHostOptimizerState,  // cpu_offload: the AdamW moments
    kHostCheckpoint,      // save_async: the snapshot of a rank's state that the background thread writes
    kCount
};
constexpr int kNumMemCategories = static_cast<int>(MemCategory::kCount);
// Bytes in a GiB, the unit memory is planned and reported in.
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// JSON/console name of a category ("parameters", "gradients", ..., "host_parameters", ...).
const char* mem_category_name(MemCategory c);
// Whether a category counts host memory (CPU offload) rather than the device's.
constexpr bool mem_category_is_host(MemCategory c) {
    return c == MemCategory::kHostParameters || c == MemCategory::kHostGradients ||
           c == MemCategory::kHostOptimizerState || c == MemCategory::kHostCheckpoint;
}

struct MemorySnapshot {
    std::array<int64_t, kNumMemCategories> current{};
    std::array<int64_t, kNumMemCategories> peak{};
    int64_t total_current = 0;
    int64_t total_peak = 0;  // high-water mark of the device categories' sum (not the sum of peaks)
    int64_t host_current = 0;
    int64_t host_peak = 0;  // the same for the host categories
};

void memory_record_alloc(MemCategory c, int64_t bytes);
void memory_record_free(MemCategory c, int64_t bytes);
MemorySnapshot memory_snapshot();
// Lowers every peak to the current value (a dry run measures its own peaks from here).
void memory_reset_peaks();
// Raises every peak back to at least `before`'s (after a dry run, the peaks of what ran before it).
void memory_restore_peaks(const MemorySnapshot& before);
// Peak resident set size of this process in bytes (VmHWM from /proc/self/status), 0 if unknown.
int64_t process_peak_resident_bytes();

}  // namespace trainer
