// NVML through dlopen (see nvml.h). The few declarations below are NVML's C interface as its documentation
// gives it (nvmlReturn_t 0 is success; the structures' layouts are stable across driver versions).
#include "kernels/cuda/nvml.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <memory>
#include <utility>

namespace trainer::cuda {

namespace {
using nvmlReturn = int;
using nvmlDevice = void*;
struct NvmlUtilization {
    unsigned int gpu, memory;
};
struct NvmlMemory {
    unsigned long long total, free, used;
};
constexpr int kNvmlClockSm = 1;
}  // namespace

struct Nvml::Functions {
    nvmlReturn (*init)() = nullptr;
    nvmlReturn (*shutdown)() = nullptr;
    nvmlReturn (*by_pci)(const char*, nvmlDevice*) = nullptr;
    nvmlReturn (*utilization)(nvmlDevice, NvmlUtilization*) = nullptr;
    nvmlReturn (*memory)(nvmlDevice, NvmlMemory*) = nullptr;
    nvmlReturn (*clock)(nvmlDevice, int, unsigned int*) = nullptr;
    nvmlReturn (*power)(nvmlDevice, unsigned int*) = nullptr;
};

Nvml::Nvml(int device) {
    library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) return;
    auto f = std::make_unique<Functions>();
    const auto sym = [this](const char* name) { return dlsym(library_, name); };
    f->init = reinterpret_cast<decltype(f->init)>(sym("nvmlInit_v2"));
    f->shutdown = reinterpret_cast<decltype(f->shutdown)>(sym("nvmlShutdown"));
    f->by_pci = reinterpret_cast<decltype(f->by_pci)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
    f->utilization = reinterpret_cast<decltype(f->utilization)>(sym("nvmlDeviceGetUtilizationRates"));
    f->memory = reinterpret_cast<decltype(f->memory)>(sym("nvmlDeviceGetMemoryInfo"));
    f->clock = reinterpret_cast<decltype(f->clock)>(sym("nvmlDeviceGetClockInfo"));
    f->power = reinterpret_cast<decltype(f->power)>(sym("nvmlDeviceGetPowerUsage"));
    char bus_id[64] = {};
    nvmlDevice handle = nullptr;
    const bool loaded = f->init != nullptr && f->shutdown != nullptr && f->by_pci != nullptr && f->init() == 0;
    if (!loaded || cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device) != cudaSuccess ||
        f->by_pci(bus_id, &handle) != 0) {
        (void)cudaGetLastError();
        if (loaded) f->shutdown();
        dlclose(library_);
        library_ = nullptr;
        return;
    }
    f_ = std::move(f);
    device_ = handle;
}

Nvml::~Nvml() {
    if (f_ == nullptr) return;
    f_->shutdown();
    dlclose(library_);
}

std::vector<std::pair<std::string, double>> Nvml::read() const {
    std::vector<std::pair<std::string, double>> out;
    if (f_ == nullptr) return out;
    NvmlUtilization u{};
    if (f_->utilization != nullptr && f_->utilization(device_, &u) == 0)
        out.emplace_back("gpu_utilization_percent", u.gpu);
    NvmlMemory m{};
    if (f_->memory != nullptr && f_->memory(device_, &m) == 0)
        out.emplace_back("gpu_memory_used_bytes", static_cast<double>(m.used));
    unsigned int mhz = 0;
    if (f_->clock != nullptr && f_->clock(device_, kNvmlClockSm, &mhz) == 0) out.emplace_back("sm_clock_mhz", mhz);
    unsigned int milliwatts = 0;
    if (f_->power != nullptr && f_->power(device_, &milliwatts) == 0)
        out.emplace_back("power_watts", milliwatts / 1000.0);
    return out;
}

}  // namespace trainer::cuda
