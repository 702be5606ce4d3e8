// Device-neutral parts of the Backend seam (see backend.h): the backend factory, device resolution and
// DeviceBuffer, the counted owner of one allocation.
#include "kernels/backend.h"

#include "base/common.h"

namespace trainer {

BackendOptions backend_options(const TrainConfig& c, int device_index) {
    BackendOptions o;
    o.bf16_matmuls = c.precision == Precision::kAmpBf16;
    o.bf16_operands = o.bf16_matmuls && c.kernels_bf16_activations;
    o.attention = resolve_attention(c, resolve_device(c.device));
    o.device_index = device_index;
    o.classifier_one_read = c.kernels_classifier_one_read;
    return o;
}

bool gemm_operands_bf16_for(const TrainConfig& c, Device device) {
    return resolve_device(device) == Device::kCuda && c.precision == Precision::kAmpBf16 && c.kernels_bf16_activations;
}

AttentionKernel resolve_attention(const TrainConfig& c, Device device) {
    if (c.kernels_attention != AttentionKernel::kAuto) return c.kernels_attention;
    const int T = static_cast<int>(c.model.max_sequence_length - 1), HS = c.model.head_size();
    const bool fast = resolve_device(device) == Device::kCuda && c.precision == Precision::kAmpBf16 &&
                      cudnn_attention_unsupported(T, HS).empty();
    return fast ? AttentionKernel::kCudnn : AttentionKernel::kNative;
}

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

Device check_device_config(const TrainConfig& c) {
    const Device device = resolve_device(c.device);
    const bool cuda = device == Device::kCuda;
    const AttentionKernel attention = resolve_attention(c, device);
    if (c.precision == Precision::kAmpBf16 && !cuda) {
        user_error("precision \"amp_bf16\" needs the CUDA backend (device is {}); on CPU use --precision fp32",
                   choice_name(device));
    }
    const int T = static_cast<int>(c.model.max_sequence_length - 1), HS = c.model.head_size();
    if (!cuda && c.kernels_cuda_graphs) {
        user_error("kernels.cuda_graphs records CUDA work; the {} backend has none to record (use --device cuda)",
                   choice_name(device));
    }
    if (!cuda && attention != AttentionKernel::kNative) {
        user_error("kernels.attention \"{}\" is a CUDA kernel; the {} backend has native attention only",
                   choice_name(attention), choice_name(device));
    }
    if (cuda && attention == AttentionKernel::kNative && HS > kCudaNativeAttentionMaxHeadSize) {
        user_error(
            "the native CUDA attention takes heads of up to {} channels, this model's have {} (model.d_model / "
            "model.n_heads)",
            kCudaNativeAttentionMaxHeadSize, HS);
    }
    if (cuda && attention == AttentionKernel::kCudnn) {
        if (c.precision != Precision::kAmpBf16) {
            user_error(
                "kernels.attention \"cudnn\" computes attention in bf16; use it with --precision amp_bf16 (fp32 "
                "runs use the native kernels)");
        }
        const std::string why = cudnn_attention_unsupported(T, HS);
        if (!why.empty())
            user_error(
                "kernels.attention \"cudnn\": cuDNN's fused attention cannot run a {}; use kernels.attention=native",
                why);
    }
    if (cuda && attention == AttentionKernel::kFlash) {
        if (c.precision != Precision::kAmpBf16) {
            user_error(
                "kernels.attention \"flash\" computes attention in bf16; use it with --precision amp_bf16 (fp32 "
                "runs use the native kernels)");
        }
        const std::string why = flash_attention_unsupported(HS);
        if (!why.empty()) user_error("kernels.attention \"flash\" cannot run a {}; use kernels.attention=cudnn", why);
    }
    return device;
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

}  // namespace trainer
