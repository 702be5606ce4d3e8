// Device-neutral parts of the Backend seam (see backend.h): the backend factory, device resolution and
// DeviceBuffer, the counted owner of one allocation.
#include "kernels/backend.h"

#include <cblas.h>

#include "base/common.h"

namespace trainer {

std::unique_ptr<Backend> make_backend(Device device, const BackendOptions& options) {
    switch (resolve_device(device)) {
        case Device::kCuda:
#ifdef TRAINER_HAVE_CUDA
            return make_cuda_backend(options);
#else
            (void)options;
            user_error(
                "device \"cuda\": this build has no CUDA backend (nvcc was not found when it was configured); "
                "rebuild with the CUDA toolkit or use --device cpu");
#endif
        default:
            return make_cpu_backend();
    }
}

Device resolve_device(Device device) {
    if (device != Device::kAuto) return device;
    return cuda_device_count() > 0 ? Device::kCuda : Device::kCpu;
}

#ifdef TRAINER_HAVE_CUDA
std::vector<std::string> cuda_library_versions();  // kernels/cuda/cuda_runtime.cu
#endif

std::vector<std::string> library_versions() {
    std::string blas = openblas_get_config();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ... Cooperlake MAX_THREADS=64"
    if (blas.rfind("OpenBLAS ", 0) == 0) blas = blas.substr(9);
    std::vector<std::string> v = {"OpenBLAS: " + blas};
#ifdef TRAINER_HAVE_CUDA
    for (std::string& line : cuda_library_versions()) v.push_back(std::move(line));
#else
    v.push_back("CUDA: none (built without CUDA, so without cuDNN)");
#endif
    return v;
}

#ifndef TRAINER_HAVE_CUDA
int cuda_device_count() { return 0; }
std::optional<uint64_t> cuda_free_memory(int) { return std::nullopt; }
std::optional<CudaDeviceInfo> cuda_device_info(int) { return std::nullopt; }
#endif

void Backend::begin_capture() { throw InternalError(fmt::format("the {} backend records no graphs", name())); }
int Backend::end_capture() { throw InternalError(fmt::format("the {} backend records no graphs", name())); }
void Backend::launch_graph(int id) { throw InternalError(fmt::format("the {} backend has no graph {}", name(), id)); }
bool Backend::linear_bf16_reference_forward(uint16_t*, const uint16_t*, const uint16_t*, int, int, int) {
    return false;
}
bool Backend::linear_bf16_reference_backward(uint16_t*, uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*,
                                             int, int, int) {
    return false;
}

DeviceBuffer::DeviceBuffer(Backend* backend, size_t bytes, MemCategory category)
    : backend_(backend),
      ptr_(mem_category_is_host(category) ? backend->alloc_host(bytes) : backend->alloc(bytes)),
      bytes_(bytes),
      category_(category) {
    memory_record_alloc(category_, static_cast<int64_t>(bytes_));
}

DeviceBuffer::~DeviceBuffer() { reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : backend_(o.backend_), ptr_(o.ptr_), bytes_(o.bytes_), category_(o.category_) {
    o.backend_ = nullptr;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
        reset();
        backend_ = o.backend_;
        ptr_ = o.ptr_;
        bytes_ = o.bytes_;
        category_ = o.category_;
        o.backend_ = nullptr;
        o.ptr_ = nullptr;
        o.bytes_ = 0;
    }
    return *this;
}

void DeviceBuffer::recategorize(MemCategory category) {
    TRAINER_CHECK(mem_category_is_host(category) == mem_category_is_host(category_),
                  "a buffer cannot move between host and device memory by recategorizing it");
    if (ptr_) {
        memory_record_free(category_, static_cast<int64_t>(bytes_));
        memory_record_alloc(category, static_cast<int64_t>(bytes_));
    }
    category_ = category;
}

void DeviceBuffer::reset() {
    if (ptr_) {
        if (mem_category_is_host(category_)) {
            backend_->free_host(ptr_);
        } else {
            backend_->free(ptr_);
        }
        memory_record_free(category_, static_cast<int64_t>(bytes_));
    }
    backend_ = nullptr;
    ptr_ = nullptr;
    bytes_ = 0;
}

void check_shared_heads(int NH, int KVH) {
    TRAINER_CHECK(KVH >= 1 && NH % KVH == 0, "{} query heads do not share {} key/value heads evenly", NH, KVH);
}

void Backend::lora_forward(GemmOperand, int, GemmOperand, const float*, const float*, int, int, int, int, float,
                           const LoraDropout&, float*) {
    throw InternalError(fmt::format("the {} backend has no LoRA ops (the config refuses LoRA there first)", name()));
}
void Backend::lora_backward(GemmOperand, float*, float*, GemmOperand, int, GemmOperand, const float*, const float*, int,
                            int, int, int, float, const LoraDropout&, float*) {
    throw InternalError(fmt::format("the {} backend has no LoRA ops (the config refuses LoRA there first)", name()));
}

void Backend::nf4_dequantize(GemmOperand, const uint8_t*, const float*, size_t) {
    throw InternalError(fmt::format("the {} backend has no NF4 kernels", name()));
}

void Backend::nf4_dequantize_dq(GemmOperand, const uint8_t*, const uint8_t*, const float*, const float*, size_t) {
    throw InternalError(fmt::format("the {} backend has no NF4 kernels", name()));
}

void Backend::set_linear_precision(LinearPrecision p) {
    TRAINER_CHECK(p == LinearPrecision::kDefault, "precision amp_fp8 reached a backend without FP8 GEMMs");
}

}  // namespace trainer
