// The CUDA backend's runtime half: its device, compute stream, memory, copies, CUDA graphs and peak figures
// (cuda_runtime.cu). The operand layer derives from it (CudaOperands, cuda_operands.cuh) and the ops from that
// (CudaBackend, cuda_backend.cu), so that a new op is one member there.
// The CUDA backend is the Backend interface over the kernels of kernels/cuda, queued in order on one compute stream.
//
// Memory comes from the device's stream-ordered pool (cudaMallocAsync on the compute stream, its release
// threshold raised so freed blocks stay cached): gathered FSDP units and communication buffers that come
// and go every step reuse cached blocks without a device synchronisation, and a block freed on the
// compute stream is reused only after the work queued before the free. The model's activations are one
// arena (core/model.cpp) sized before the first step. Scratch that kernels need (LayerNorm and attention
// partials, the bf16 operand copies of amp_bf16, the norm partials) grows on demand and is then reused.
//
// Host synchronisation happens only where the interface returns a host value (sum, squared_norm: the loss
// and the gradient norm, both logged), copies from device to host memory or large ones from host memory
// (checkpoints), and synchronize(); a micro-batch's token upload is staged through pinned memory.
//
// kernels.cuda_graphs (kernels/graph.h): begin_capture .. end_capture records what is queued on the compute stream
// as a CUDA graph (stream capture, thread-local mode), launched as one by launch_graph. The timeline records no
// events while capturing (a launched graph is one op of its window). What needs the host while capturing is
// refused with its name (allocating or freeing, copies from or to host memory, sums returned to the host);
// freeing memory while graphs exist destroys them (one may have used the block) and raises graph_epoch().
//
// CPU offload's copies (copy_async) run on a second stream, the copy stream: each waits for the compute
// work queued before it and records an event, its ticket; tickets complete in order (one stream), so the
// events of finished copies are recycled from the front of a queue and a wait on an older ticket is free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/nvml.h"
#include "kernels/cuda/timeline.h"

namespace trainer::cuda {

class CudaRuntime : public Backend {
   public:
    explicit CudaRuntime(const BackendOptions& options);
    ~CudaRuntime() override;

    std::string name() const override { return "cuda"; }
    cudaStream_t stream() const { return stream_; }
    int device() const { return device_; }
    Timeline& timeline() { return *timeline_; }

    void begin_activity() override { timeline_->begin_window(); }
    Activity end_activity() override;
    std::vector<std::pair<std::string, double>> device_counters() override;

    bool can_capture() const override { return true; }
    void begin_capture() override;
    int end_capture() override;
    void abort_capture() override;
    void launch_graph(int id) override;
    uint64_t graph_epoch() const override { return graph_epoch_; }

    void* alloc(size_t bytes) override;
    void free(void* ptr) override;
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override;
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override;
    void copy_device_to_device(void* dst, const void* src, size_t bytes) override;
    void copy_any(void* dst, const void* src, size_t bytes) override;
    void fill_zero(void* ptr, size_t bytes) override;
    void synchronize() override;

    void* alloc_host(size_t bytes) override;
    void free_host(void* ptr) override;
    uint64_t copy_async(void* dst, const void* src, size_t bytes) override;
    void host_wait(uint64_t ticket) override;
    void device_wait(uint64_t ticket) override;

    double peak_flops(bool bf16, std::string* how) const override;
    double peak_bandwidth(std::string* how) const override;
    int64_t device_peak_bytes() const override;

   protected:
    // What needs the host is refused while recording a graph: the error names it.
    void no_capture(const char* what) const;

    // A buffer the ops reuse, grown on demand.
    struct Scratch {
        void* ptr = nullptr;
        size_t bytes = 0;
    };
    // A scratch of at least `bytes`; growing frees the old block in stream order (work already queued on
    // it runs first) and counts the new size as activation memory.
    void* grow(Scratch& s, size_t bytes);
    // Frees a scratch (the ops' destructor).
    void release(Scratch& s);

    const BackendOptions options_;
    int device_ = 0;
    cudaStream_t stream_ = nullptr;
    std::unique_ptr<Timeline> timeline_;

   private:
    // Ends the recording on the compute stream: the graph it made (nullptr if none), the call's status in err.
    cudaGraph_t stop_capture(cudaError_t* err);
    // Destroys the recordings (a launched one still runs to its end) and tells their owners (graph_epoch).
    void drop_graphs();
    // The event of copy `ticket` while it may still run; null once it is known to be done.
    cudaEvent_t pending_copy(uint64_t ticket) const;

    cudaMemPool_t pool_ = nullptr;
    std::unique_ptr<Nvml> nvml_;  // made at the first device_counters()
    static constexpr size_t kStagingBytes = size_t(8) << 20;
    void* staging_ = nullptr;  // pinned host memory for small uploads
    cudaEvent_t staging_done_ = nullptr;
    // copy_async: the copy stream, the mark of the compute work each copy follows, the events of the copies
    // that may still run (ticket first_live_ticket_ onwards) and finished events for reuse.
    cudaStream_t copy_stream_ = nullptr;
    cudaEvent_t compute_mark_ = nullptr;
    std::deque<std::pair<uint64_t, cudaEvent_t>> copies_;
    std::vector<cudaEvent_t> spare_events_;
    uint64_t first_live_ticket_ = 1, next_ticket_ = 1;
    // kernels.cuda_graphs: the recordings, whether one is being made (and what it was refused), the epoch.
    std::vector<cudaGraphExec_t> graphs_;
    bool capturing_ = false;
    std::string capture_fault_;
    uint64_t graph_epoch_ = 0;
};

}  // namespace trainer::cuda
