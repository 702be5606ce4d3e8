// The CUDA backend's runtime half (cuda_runtime.cuh): its streams, memory, copies, graphs and peak figures, and the
// device queries and accessors of kernels/cuda/cuda_backend.h.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nvtx3/nvToolsExt.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/trace.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_runtime.cuh"

namespace trainer {

std::vector<std::string> cuda_library_versions() {
#ifdef TRAINER_SIMT_DEVICE
    return {
        "CUDA: none; an emulated build (the CPU emulator of tests/simt stands in for the runtime, cuBLASLt, CUB "
        "and NCCL; no cuDNN)"};
#endif
    const auto dotted = [](int v, int major_div) {  // 13000 -> 13.0, 90800 -> 9.8.0 (cuDNN 9's)
        return major_div == 1000 ? fmt::format("{}.{}", v / 1000, v % 1000 / 10)
                                 : fmt::format("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100);
    };
    int runtime = 0, driver = 0;
    const bool have_runtime = cudaRuntimeGetVersion(&runtime) == cudaSuccess;
    const bool have_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0;
    std::vector<std::string> v;
    v.push_back(fmt::format("CUDA: built with {}; runtime {}; driver {}", dotted(CUDART_VERSION, 1000),
                            have_runtime ? dotted(runtime, 1000) : "not found",
                            have_driver ? "supports " + dotted(driver, 1000) : std::string("none (no GPU driver)")));
    v.push_back(fmt::format("cuDNN: built with {}.{}.{}; loaded {}", CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL,
                            dotted(static_cast<int>(cudnnGetVersion()), 10000)));
    return v;
}

int cuda_device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();  // no driver or no device: clear the sticky-free error, report none
        return 0;
    }
    return n;
}

std::optional<CudaDeviceInfo> cuda_device_info(int index) {
    if (index < 0 || index >= cuda_device_count()) return std::nullopt;
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, index) != cudaSuccess) {
        (void)cudaGetLastError();
        return std::nullopt;
    }
    return CudaDeviceInfo{p.name, static_cast<uint64_t>(p.totalGlobalMem)};
}

std::optional<uint64_t> cuda_free_memory(int index) {
    if (index < 0 || index >= cuda_device_count()) return std::nullopt;
    size_t free_bytes = 0, total = 0;
    if (cudaSetDevice(index) != cudaSuccess || cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return std::nullopt;
    }
    return static_cast<uint64_t>(free_bytes);
}

namespace cuda {
namespace {

// Dense FLOP per clock per SM by compute capability: bf16 tensor-core FMA with fp32 accumulation, and
// fp32 FMA on the CUDA cores (2 FLOP per FMA). 0 where this table does not know the architecture.
double flop_per_clock_per_sm(int major, int minor, bool bf16) {
    const int cc = major * 10 + minor;
    if (bf16) {
        switch (cc) {
            case 80:
                return 2048;  // A100
            case 86:
                return 512;  // GA10x (fp32 accumulation runs at half rate)
            case 87:
                return 1024;  // Orin
            case 89:
                return 1024;  // L40S, RTX 40
            case 90:
                return 4096;  // H100, H200
            case 100:
                return 8192;  // B200
            default:
                return 0;
        }
    }
    switch (cc) {
        case 80:
            return 128;
        case 86:
        case 87:
        case 89:
        case 90:
        case 100:
            return 256;
        default:
            return 0;
    }
}

// Dense peaks from the vendor's spec sheets (no sparsity), the figures MFU is quoted against (OLMo-core,
// torchtitan, llm.c): the measured-clock formula reads above them on GPUs that boost past the spec clock.
struct DenseSpec {
    const char* match;  // all space-separated words must appear in the device name
    const char* model;
    double bf16, fp32;
};
constexpr DenseSpec kDenseSpecs[] = {
    {"H100 HBM3", "H100 SXM", 989.4e12, 66.9e12}, {"H100 SXM", "H100 SXM", 989.4e12, 66.9e12},
    {"H100 NVL", "H100 NVL", 835.0e12, 60.0e12},  {"H100 PCIe", "H100 PCIe", 756.0e12, 51.2e12},
    {"H200", "H200", 989.4e12, 66.9e12},          {"A100", "A100", 312.0e12, 19.5e12},
};

const DenseSpec* dense_spec(const std::string& name) {
    for (const DenseSpec& s : kDenseSpecs) {
        std::string words = s.match;
        bool all = true;
        for (size_t start = 0; start <= words.size();) {
            const size_t end = std::min(words.find(' ', start), words.size());
            all &= name.find(words.substr(start, end - start)) != std::string::npos;
            start = end + 1;
        }
        if (all) return &s;
    }
    return nullptr;
}
}  // namespace

CudaRuntime::CudaRuntime(const BackendOptions& options) : options_(options) {
    // The trace's spans (every unit's forward, backward and recompute, collectives, the optimizer) as NVTX
    // ranges, for Nsight Systems; no-ops unless a tool is attached.
    trace::set_range_hooks({[](const char* name) { nvtxRangePushA(name); }, [] { nvtxRangePop(); }});
    TRAINER_CUDA_CHECK(cudaSetDevice(options.device_index));
    device_ = options.device_index;
    TRAINER_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    timeline_ = std::make_unique<Timeline>(stream_);
    // Keep freed blocks cached in the pool instead of returning them to the driver at every sync.
    TRAINER_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool_, device_));
    uint64_t threshold = UINT64_MAX;
    TRAINER_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
    // A recorded trace's spans, mirrored on the compute stream (timeline.h); last, so that a constructor
    // that throws leaves no hooks to a destroyed timeline.
    trace::set_device_hooks(
        {timeline_.get(),
         [](void* ctx) -> void* {
             auto* t = static_cast<Timeline*>(ctx);
             return t->begin(t->compute_stream(), Timeline::Kind::kSpan);
         },
         [](void* ctx, void* token, const char* category, const std::string& name, int64_t bytes) {
             auto* t = static_cast<Timeline*>(ctx);
             try {  // called from a span's destructor; a CUDA error is sticky and reported by the next op
                 t->end(static_cast<cudaEvent_t>(token), t->compute_stream(), Timeline::Kind::kSpan, category, name,
                        bytes);
             } catch (...) {
             }
         }});
}

CudaRuntime::~CudaRuntime() {
    drop_graphs();
    cudaStreamSynchronize(stream_);
    trace::clear_device_hooks(timeline_.get());
    timeline_.reset();
    if (staging_ != nullptr) cudaFreeHost(staging_), cudaEventDestroy(staging_done_);
    if (copy_stream_ != nullptr) {
        cudaStreamSynchronize(copy_stream_);
        for (auto& [ticket, event] : copies_) cudaEventDestroy(event);
        for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
        cudaEventDestroy(compute_mark_);
        cudaStreamDestroy(copy_stream_);
    }
    cudaStreamDestroy(stream_);
}

Backend::Activity CudaRuntime::end_activity() {
    const Timeline::Totals t = timeline_->end_window();
    Activity a;
    a.measured = true;
    a.busy_s = t.busy_s;
    a.wait_s = t.wait_s;
    return a;
}

std::vector<std::pair<std::string, double>> CudaRuntime::device_counters() {
    if (!nvml_) nvml_ = std::make_unique<Nvml>(device_);
    return nvml_->read();
}

void CudaRuntime::begin_capture() {
    TRAINER_CHECK(!capturing_, "a graph is already being recorded");
    // Thread-local: the calls that are unsafe while capturing are refused on this thread only (NCCL's
    // and the data loader's threads go on).
    TRAINER_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    capture_fault_.clear();
    timeline_->suspend(true);
}

int CudaRuntime::end_capture() {
    TRAINER_CHECK(capturing_, "no graph is being recorded");
    cudaError_t err = cudaSuccess;
    cudaGraph_t graph = stop_capture(&err);
    if (err != cudaSuccess || !capture_fault_.empty()) {
        if (graph != nullptr) cudaGraphDestroy(graph);
        (void)cudaGetLastError();
        TRAINER_CUDA_FAIL("cudaStreamEndCapture",
                          capture_fault_.empty() ? status_message(err) : capture_fault_ + " while recording");
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    TRAINER_CUDA_CHECK(inst);
    graphs_.push_back(exec);
    return static_cast<int>(graphs_.size()) - 1;
}

void CudaRuntime::abort_capture() {
    if (!capturing_) return;
    cudaError_t err = cudaSuccess;  // the capture invalidated by the failed call, or a partial recording
    if (cudaGraph_t graph = stop_capture(&err)) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
}

void CudaRuntime::launch_graph(int id) {
    no_capture("launching a graph");
    TRAINER_CHECK(id >= 0 && static_cast<size_t>(id) < graphs_.size(), "no graph {}", id);
    const OpMark mark(*timeline_, "cuda_graph");
    TRAINER_CUDA_CHECK(cudaGraphLaunch(graphs_[static_cast<size_t>(id)], stream_));
}

void* CudaRuntime::alloc(size_t bytes) {
    no_capture("allocating device memory (a scratch buffer grew after the eager run)");
    void* p = nullptr;
    const size_t rounded = (bytes + 255) / 256 * 256;
    const cudaError_t err = cudaMallocAsync(&p, rounded == 0 ? 256 : rounded, stream_);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        user_error(
            "out of GPU memory on device {} allocating {:.1f} MiB ({:.1f} MiB free of {:.1f} MiB); lower "
            "device_train_microbatch_size or shard the model with --strategy fsdp",
            device_, bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0);
    }
    TRAINER_CUDA_CHECK(err);
    return p;
}

void CudaRuntime::free(void* ptr) {
    if (ptr == nullptr) return;  // no throw: called from destructors
    if (capturing_) {            // end_capture refuses the recording
        capture_fault_ = "freeing device memory";
        return;
    }
    drop_graphs();
    cudaFreeAsync(ptr, stream_);
}

void CudaRuntime::copy_host_to_device(void* dst, const void* src, size_t bytes) {
    no_capture("a copy from host memory");
    const OpMark mark(*timeline_, "copy_host_to_device");
    if (bytes == 0) return;
    if (bytes <= kStagingBytes) {
        // Small uploads (a micro-batch's tokens) go through a pinned staging buffer: the caller may reuse
        // `src` at once and the host does not wait for the device. Only the staging buffer's previous
        // upload is waited for, long finished when the next micro-batch arrives.
        if (staging_ == nullptr) {
            TRAINER_CUDA_CHECK(cudaMallocHost(&staging_, kStagingBytes));
            TRAINER_CUDA_CHECK(cudaEventCreateWithFlags(&staging_done_, cudaEventDisableTiming));
        } else {
            TRAINER_CUDA_CHECK(cudaEventSynchronize(staging_done_));
        }
        std::memcpy(staging_, src, bytes);
        TRAINER_CUDA_CHECK(cudaMemcpyAsync(dst, staging_, bytes, cudaMemcpyHostToDevice, stream_));
        TRAINER_CUDA_CHECK(cudaEventRecord(staging_done_, stream_));
        return;
    }
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    TRAINER_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the caller may reuse `src` on return
}

void CudaRuntime::copy_device_to_host(void* dst, const void* src, size_t bytes) {
    no_capture("a copy to host memory");
    const OpMark mark(*timeline_, "copy_device_to_host");
    if (bytes == 0) return;
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    TRAINER_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaRuntime::copy_device_to_device(void* dst, const void* src, size_t bytes) {
    const OpMark mark(*timeline_, "copy_device_to_device");
    if (bytes > 0) TRAINER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaRuntime::copy_any(void* dst, const void* src, size_t bytes) {
    no_capture("a copy that may touch host memory");
    const OpMark mark(*timeline_, "copy_any");
    if (bytes == 0) return;
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    if (cuda::is_host_pointer(dst) || cuda::is_host_pointer(src)) TRAINER_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaRuntime::fill_zero(void* ptr, size_t bytes) {
    const OpMark mark(*timeline_, "fill_zero");
    if (bytes > 0) TRAINER_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_));
}

void CudaRuntime::synchronize() {
    no_capture("a synchronisation");
    TRAINER_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void* CudaRuntime::alloc_host(size_t bytes) {
    void* p = nullptr;
    const cudaError_t err = cudaMallocHost(&p, bytes == 0 ? 64 : bytes);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        user_error(
            "out of pinned host memory allocating {:.1f} MiB ({}); CPU offload's state and save_async's "
            "checkpoint snapshot live in host memory: use fewer ranks per node or more nodes, or "
            "save_async=false",
            bytes / 1048576.0, cudaGetErrorString(err));
    }
    std::memset(p, 0, bytes);
    return p;
}

void CudaRuntime::free_host(void* ptr) {
    if (ptr != nullptr) cudaFreeHost(ptr);  // no throw: called from destructors
}

uint64_t CudaRuntime::copy_async(void* dst, const void* src, size_t bytes) {
    no_capture("an offload copy");
    if (copy_stream_ == nullptr) {
        TRAINER_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
        TRAINER_CUDA_CHECK(cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
    }
    // Recycle the events of finished copies (they finish in ticket order).
    while (!copies_.empty() && cudaEventQuery(copies_.front().second) == cudaSuccess) {
        spare_events_.push_back(copies_.front().second);
        copies_.pop_front();
        ++first_live_ticket_;
    }
    (void)cudaGetLastError();  // cudaEventQuery's cudaErrorNotReady is not an error
    cudaEvent_t done = nullptr;
    if (spare_events_.empty()) {
        TRAINER_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    } else {
        done = spare_events_.back();
        spare_events_.pop_back();
    }
    TRAINER_CUDA_CHECK(cudaEventRecord(compute_mark_, stream_));
    TRAINER_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, compute_mark_, 0));
    if (bytes > 0) TRAINER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, copy_stream_));
    TRAINER_CUDA_CHECK(cudaEventRecord(done, copy_stream_));
    copies_.emplace_back(next_ticket_, done);
    return next_ticket_++;
}

void CudaRuntime::host_wait(uint64_t ticket) {
    if (cudaEvent_t e = pending_copy(ticket)) TRAINER_CUDA_CHECK(cudaEventSynchronize(e));
}

void CudaRuntime::device_wait(uint64_t ticket) {
    if (cudaEvent_t e = pending_copy(ticket)) {
        no_capture("a wait for an offload copy");
        cudaEvent_t first = timeline_->begin(stream_, Timeline::Kind::kWait);
        TRAINER_CUDA_CHECK(cudaStreamWaitEvent(stream_, e, 0));
        timeline_->end(first, stream_, Timeline::Kind::kWait);
    }
}

double CudaRuntime::peak_flops(bool bf16, std::string* how) const {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, device_);
    if (const DenseSpec* spec = dense_spec(prop.name)) {
        const double peak = bf16 ? spec->bf16 : spec->fp32;
        if (how != nullptr) {
            *how = fmt::format(
                "{}: {:.1f} TFLOP/s dense {} (the {} spec sheet); override with "
                "peak_flops_per_device",
                prop.name, peak / 1e12, bf16 ? "bf16 tensor cores" : "fp32", spec->model);
        }
        return peak;
    }
    int sms = 0, clock_khz = 0, major = 0, minor = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_);
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device_);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_);
    const double per_clock = flop_per_clock_per_sm(major, minor, bf16);
    const double peak = sms * (clock_khz * 1e3) * per_clock;
    if (how != nullptr) {
        *how = per_clock > 0 ? fmt::format(
                                   "{}: {} SMs x {:.3f} GHz (max clock) x {:.0f} FLOP/clock/SM ({} dense, sm_{}{}); "
                                   "override with peak_flops_per_device",
                                   prop.name, sms, clock_khz / 1e6, per_clock, bf16 ? "bf16 tensor cores" : "fp32 FMA",
                                   major, minor)
                             : fmt::format("{} (sm_{}{}): peak unknown to this build; set peak_flops_per_device",
                                           prop.name, major, minor);
    }
    return peak;
}

double CudaRuntime::peak_bandwidth(std::string* how) const {
    int mem_khz = 0, bus_bits = 0;
    cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device_);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device_);
    const double bw = 2.0 * mem_khz * 1e3 * bus_bits / 8.0;  // double data rate
    if (how != nullptr) *how = fmt::format("2 (DDR) x {:.3f} GHz memory clock x {} bits / 8", mem_khz / 1e6, bus_bits);
    return bw;
}

int64_t CudaRuntime::device_peak_bytes() const {
    uint64_t high = 0;
    cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &high);
    return static_cast<int64_t>(high);
}

cudaGraph_t CudaRuntime::stop_capture(cudaError_t* err) {
    capturing_ = false;
    timeline_->suspend(false);
    cudaGraph_t graph = nullptr;
    *err = cudaStreamEndCapture(stream_, &graph);
    return graph;
}

void CudaRuntime::no_capture(const char* what) const {
    if (capturing_) TRAINER_CUDA_FAIL(what, "refused while recording a CUDA graph");
}

void CudaRuntime::drop_graphs() {
    if (graphs_.empty()) return;
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    graphs_.clear();
    ++graph_epoch_;
}

void* CudaRuntime::grow(Scratch& s, size_t bytes) {
    if (bytes <= s.bytes) return s.ptr;
    free(s.ptr);
    memory_record_free(MemCategory::kActivations, static_cast<int64_t>(s.bytes));
    s.ptr = alloc(bytes);
    s.bytes = bytes;
    memory_record_alloc(MemCategory::kActivations, static_cast<int64_t>(bytes));
    return s.ptr;
}

void CudaRuntime::release(Scratch& s) {
    free(s.ptr);
    s = Scratch{};
}

cudaEvent_t CudaRuntime::pending_copy(uint64_t ticket) const {
    if (ticket < first_live_ticket_ || ticket >= next_ticket_) return nullptr;
    return copies_[static_cast<size_t>(ticket - first_live_ticket_)].second;
}

namespace {
CudaRuntime& as_cuda(Backend* backend) {
    auto* cb = dynamic_cast<CudaRuntime*>(backend);
    TRAINER_CHECK(cb != nullptr, "backend {} is not the CUDA backend", backend->name());
    return *cb;
}
}  // namespace

cudaStream_t backend_stream(Backend* backend) { return as_cuda(backend).stream(); }
Timeline& backend_timeline(Backend* backend) { return as_cuda(backend).timeline(); }
int backend_device(Backend* backend) { return as_cuda(backend).device(); }

}  // namespace cuda

}  // namespace trainer
