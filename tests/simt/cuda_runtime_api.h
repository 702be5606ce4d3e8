// The CUDA runtime's interface as the trainer's CUDA code calls it, emulated on the CPU (cuda_runtime.cpp): devices,
// memory, streams, events and CUDA graphs, with the semantics a GPU gives them where they decide whether host code
// is right, so that the CUDA backend's host code runs unchanged in the CPU suite (the emulated build,
// TRAINER_CUDA=EMULATED, docs in tests/simt/README.md):
//   - device memory is host memory the size asked (no rounding: AddressSanitizer sees every byte past its end, as
//     compute-sanitizer's memcheck does), counted against the device's capacity; pinned host memory is registered
//     as such; a pointer's kind (cudaPointerGetAttributes) comes from those records;
//   - work queued on a stream (kernels, copies, library calls) runs later, in stream order, when the host waits
//     for it (a synchronisation, a query, a blocking copy) or another stream's work waits on it through an event,
//     so host code that reads a result before waiting for it reads what was there before, as on a GPU. A copy
//     from pageable host memory takes the source at the call; a copy to pageable host memory returns finished
//     (CUDA's rules for pageable memory);
//   - a kernel's pointer arguments must point into device memory or pinned host memory (or be null);
//   - a fault inside a kernel (the emulator's checks, simt.h) is printed and becomes a sticky error that every
//     later call returns, as a GPU's context stays broken after an illegal access;
//   - stream capture records what is queued on the capturing stream into a graph that cudaGraphLaunch replays;
//     calls that are unsafe while capturing (allocation, blocking copies, synchronisation) are refused on the
//     capturing thread and invalidate the capture.
// The number of devices cudaGetDeviceCount reports is TRAINER_SIMT_GPUS (default 0, so a run is a CPU run unless
// asked); device 0 takes calls whatever it says, for the emulator's own kernel tests. Each emulated device has
// compute capability TRAINER_SIMT_CC (default 90: Hopper, whose sm_90a kernels the emulator runs) and
// TRAINER_SIMT_GPU_MEMORY bytes (default 80 GiB; the suffixes K, M, G are accepted).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simt/simt.h"

#define CUDART_VERSION 13000

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureWrongThread = 908,
};
using cudaError = cudaError_t;

// CUDA's data types, as library_types.h numbers them (cuBLASLt's layouts take them).
enum cudaDataType_t {
    CUDA_R_32F = 0,
    CUDA_R_16BF = 14,
    CUDA_R_8F_E4M3 = 28,
    CUDA_R_8F_E5M2 = 29,
};
using cudaDataType = cudaDataType_t;

struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;
struct CUmemPoolHandle_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;
using cudaMemPool_t = CUmemPoolHandle_st*;

constexpr unsigned cudaStreamDefault = 0x0;
constexpr unsigned cudaStreamNonBlocking = 0x1;
constexpr unsigned cudaEventDefault = 0x0;
constexpr unsigned cudaEventDisableTiming = 0x2;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3,
};
struct cudaPointerAttributes {
    cudaMemoryType type;
    int device;
    void* devicePointer;
    void* hostPointer;
};
enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
};
enum cudaDeviceAttr {
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrClockRate = 13,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMemoryClockRate = 36,
    cudaDevAttrGlobalMemoryBusWidth = 37,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaMemPoolAttr {
    cudaMemPoolAttrReleaseThreshold = 4,
    cudaMemPoolAttrReservedMemCurrent = 5,
    cudaMemPoolAttrReservedMemHigh = 6,
    cudaMemPoolAttrUsedMemCurrent = 7,
    cudaMemPoolAttrUsedMemHigh = 8,
};
struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int multiProcessorCount;
    int major, minor;
    int pciBusID, pciDeviceID, pciDomainID;
};

// The runtime (cuda_runtime.cpp).
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device);
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
const char* cudaGetErrorName(cudaError_t error);
cudaError_t cudaDeviceSynchronize();
// Ends the current device's queued work unrun and frees its memory, streams' queues and sticky error, as CUDA's
// does (the emulator's own tests start afresh with it after a fault).
cudaError_t cudaDeviceReset();
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);

cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocHost(void** ptr, size_t bytes);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr);
template <class T>
inline cudaError_t cudaMalloc(T** ptr, size_t bytes) {
    return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
template <class T>
inline cudaError_t cudaMallocHost(T** ptr, size_t bytes) {
    return cudaMallocHost(reinterpret_cast<void**>(ptr), bytes);
}
template <class T>
inline cudaError_t cudaMallocAsync(T** ptr, size_t bytes, cudaStream_t stream) {
    return cudaMallocAsync(reinterpret_cast<void**>(ptr), bytes, stream);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* ptr, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned flags, int priority);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

cudaError_t simt_func_set_attribute(cudaFuncAttribute attr, int value);
template <class F>
inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute attr, int value) {
    return simt_func_set_attribute(attr, value);
}

namespace simt::rt {

// Queues `work` on `stream` (nullptr: the device's legacy default stream), to run in stream order; `what` names
// it in reports. The CUDA libraries' emulators (cuBLASLt, CUB, NCCL) queue their calls through it.
cudaError_t enqueue(cudaStream_t stream, const char* what, std::function<void()> work);
// A launch of `body` over grid x block threads with smem bytes of dynamic shared memory on `stream`; `pointers`
// are the kernel's pointer arguments, each checked to point into device or pinned host memory (or be null).
// A bad configuration is the launch's error (cudaGetLastError), as a GPU reports it.
void launch(const char* kernel, cudaStream_t stream, Dim3 grid, Dim3 block, size_t smem,
            std::vector<const void*> pointers, std::function<void()> body);
// Whether [p, p + bytes) lies in one allocation of device memory or of pinned host memory.
bool device_accessible(const void* p, size_t bytes);
// The sticky error of a fault inside queued work: `what` happened in `where` (printed once, on stderr).
void fail(const std::string& where, const std::string& what);

template <class T>
void collect_pointer(std::vector<const void*>& out, const T& arg) {
    if constexpr (std::is_pointer_v<T>) out.push_back(static_cast<const void*>(arg));
}

// The launch behind TRAINER_LAUNCH: the arguments are evaluated and copied at the call, as a launch copies its
// parameters, and the kernel runs when the stream reaches it (a graph's replay runs it again with the same ones).
template <class Kernel, class... Args>
void launch_kernel(const char* name, cudaStream_t stream, Dim3 grid, Dim3 block, size_t smem, Kernel kernel,
                   Args&&... args) {
    auto params = std::make_tuple(std::decay_t<Args>(std::forward<Args>(args))...);
    std::vector<const void*> pointers;
    std::apply([&](const auto&... a) { (collect_pointer(pointers, a), ...); }, params);
    launch(name, stream, grid, block, smem, std::move(pointers),
           [kernel, params]() mutable { std::apply(kernel, params); });
}

}  // namespace simt::rt
