// Device-neutral parts of the Backend seam (see backend.h): the backend factory, device resolution and
// DeviceBuffer, the counted owner of one allocation.
#include "kernels/backend.h"

#include "base/common.h"

namespace trainer {

std::unique_ptr<Backend> make_backend(const std::string& device, const BackendOptions& options) {
    if (device == "cpu") return make_cpu_backend();
    if (device == "cuda") {
#ifdef TRAINER_HAVE_CUDA
        return make_cuda_backend(options);
#else
        (void)options;
        user_error(
            "device \"cuda\": this build has no CUDA backend (nvcc was not found when it was configured); "
            "rebuild with the CUDA toolkit or use --device cpu");
#endif
    }
    user_error("device \"{}\": expected cpu, cuda or auto", device);
}

std::string resolve_device(const std::string& device) {
    if (device != "auto") return device;
    return cuda_device_count() > 0 ? "cuda" : "cpu";
}

#ifndef TRAINER_HAVE_CUDA
int cuda_device_count() { return 0; }
#endif

DeviceBuffer::DeviceBuffer(Backend* backend, size_t bytes, MemCategory category)
    : backend_(backend), ptr_(backend->alloc(bytes)), bytes_(bytes), category_(category) {
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
    if (ptr_) {
        memory_record_free(category_, static_cast<int64_t>(bytes_));
        memory_record_alloc(category, static_cast<int64_t>(bytes_));
    }
    category_ = category;
}

void DeviceBuffer::reset() {
    if (ptr_) {
        backend_->free(ptr_);
        memory_record_free(category_, static_cast<int64_t>(bytes_));
    }
    backend_ = nullptr;
    ptr_ = nullptr;
    bytes_ = 0;
}

}  // namespace trainer
