// The CUDA CommStream (see cuda_comm_stream.h).
#include <chrono>
#include <thread>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/timeline.h"
#include "parallel/comm/cuda_comm_stream.h"

namespace trainer {
namespace {

struct CudaEvent final : StreamEvent {
    cudaEvent_t e = nullptr;
    CudaEvent() { TRAINER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
    ~CudaEvent() override { cudaEventDestroy(e); }
};

cudaEvent_t raw(const EventRef& e) { return static_cast<const CudaEvent&>(*e).e; }

int priority_high() {
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    return greatest;
}

}  // namespace

CudaCommStream::CudaCommStream(Backend* backend, std::string track)
    : device_(cuda::backend_device(backend)),
      compute_(cuda::backend_stream(backend)),
      timeline_(&cuda::backend_timeline(backend)),
      track_(std::move(track)) {
    TRAINER_CUDA_CHECK(cudaSetDevice(device_));
    TRAINER_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority_high()));
}

CudaCommStream::~CudaCommStream() {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
}

void CudaCommStream::bind_thread() {
    if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
}

EventRef CudaCommStream::mark_compute() {
    auto e = std::make_shared<CudaEvent>();
    TRAINER_CUDA_CHECK(cudaEventRecord(e->e, compute_));
    return e;
}

EventRef CudaCommStream::mark() {
    auto e = std::make_shared<CudaEvent>();
    TRAINER_CUDA_CHECK(cudaEventRecord(e->e, stream_));
    return e;
}

void CudaCommStream::wait_for(const EventRef& e) { TRAINER_CUDA_CHECK(cudaStreamWaitEvent(stream_, raw(e), 0)); }

void CudaCommStream::copy_to_host(void* host, const void* device, size_t bytes) {
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
}

void CudaCommStream::copy_to_device(void* device, const void* host, size_t bytes) {
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
}

bool CudaCommStream::done(const EventRef& e, std::string* error) {
    const cudaError_t q = cudaEventQuery(raw(e));
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) *error = cudaGetErrorString(q);
    return false;
}

void CudaCommStream::compute_waits_for(const EventRef& e) {
    // The compute stream's wait, timed as the step's communication wait (timeline.h).
    cudaEvent_t waited = timeline_->begin(compute_, cuda::Timeline::Kind::kWait);
    TRAINER_CUDA_CHECK(cudaStreamWaitEvent(compute_, raw(e), 0));
    timeline_->end(waited, compute_, cuda::Timeline::Kind::kWait);
}

bool CudaCommStream::is_host(const void* p) const { return cuda::is_host_pointer(p); }

void* CudaCommStream::alloc_pinned(size_t bytes) {
    void* p = nullptr;
    TRAINER_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
}

void CudaCommStream::free_pinned(void* p) { cudaFreeHost(p); }

cudaEvent_t CudaCommStream::comm_begin() { return timeline_->begin(stream_, cuda::Timeline::Kind::kComm); }

void CudaCommStream::comm_end(cudaEvent_t began, const char* name, int64_t bytes) {
    timeline_->end(began, stream_, cuda::Timeline::Kind::kComm, "comm", name, bytes, track_);
}

bool CudaCommStream::drain(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    cudaError_t q;
    while ((q = cudaStreamQuery(stream_)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return q != cudaErrorNotReady;
}

std::unique_ptr<CommStream> make_cuda_comm_stream(Backend* backend) {
    return std::make_unique<CudaCommStream>(backend, "staged gloo");
}

}  // namespace trainer
