// The driver's management library (NVML), for the metrics' device counters: loaded with dlopen when first
// needed, so a machine without it (or a container without the driver's libraries) runs without the counters.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace trainer::cuda {

class Nvml {
   public:
    // For CUDA device `device` (matched by PCI bus id: NVML's numbering ignores CUDA_VISIBLE_DEVICES).
    explicit Nvml(int device);
    ~Nvml();
    Nvml(const Nvml&) = delete;
    Nvml& operator=(const Nvml&) = delete;

    // The counters readable now, by metrics name: "gpu_utilization_percent" (the share of the driver's
    // last sample period, 1/6 s to 1 s, in which a kernel ran), "gpu_memory_used_bytes" (every process's),
    // "sm_clock_mhz", "power_watts". Empty without NVML.
    std::vector<std::pair<std::string, double>> read() const;

   private:
    void* library_ = nullptr;
    void* device_ = nullptr;  // nvmlDevice_t
    struct Functions;
    std::unique_ptr<Functions> f_;  // null without NVML
};

}  // namespace trainer::cuda
