// The CUDA CommStream (comm_stream.h): what NCCL and staged Gloo share on a GPU, the communication stream
// (high priority: the compute stream waits on collectives, not the other way round), events ordering it
// against the backend's compute stream, pinned staging memory, and the compute stream's waits counted in the
// step's wait time and traced (kernels/cuda/timeline.h). CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "parallel/comm/comm_stream.h"

namespace trainer {
namespace cuda {
class Timeline;
}

class CudaCommStream final : public CommStream {
   public:
    // `track`: the name of this communicator's collectives in a trace.
    CudaCommStream(Backend* backend, std::string track);
    ~CudaCommStream() override;

    EventRef mark_compute() override;
    void wait_for(const EventRef& e) override;
    void copy_to_host(void* host, const void* device, size_t bytes) override;
    void copy_to_device(void* device, const void* host, size_t bytes) override;
    EventRef mark() override;
    bool done(const EventRef& e, std::string* error) override;
    void compute_waits_for(const EventRef& e) override;
    bool is_host(const void* p) const override;
    void* alloc_pinned(size_t bytes) override;
    void free_pinned(void* p) override;
    void bind_thread() override;

    // For a library that queues its own work (NCCL): the stream, the device, and the trace of a collective
    // queued between comm_begin() and comm_end() on the caller's thread.
    cudaStream_t stream() const { return stream_; }
    int device() const { return device_; }
    cudaEvent_t comm_begin();
    void comm_end(cudaEvent_t began, const char* name, int64_t bytes);
    // Blocks until everything queued on the communication stream has run, at most `timeout`; whether it has.
    bool drain(std::chrono::milliseconds timeout);

   private:
    int device_;
    cudaStream_t compute_ = nullptr, stream_ = nullptr;
    cuda::Timeline* timeline_;
    std::string track_;
};

}  // namespace trainer
