// Shared by the CUDA kernel files: launch checking and launch-shape helpers. Under TRAINER_SIMT_EMULATION (g++ onto
// the CPU emulator, tests/simt/cuda_shim.h) the launch syntax and the runtime are the emulator's; in the emulated
// build (TRAINER_SIMT_DEVICE) the checks are check.h's, as with nvcc.
#pragma once

#ifndef TRAINER_SIMT_EMULATION
#include <cuda_runtime.h>
#endif
#if !defined(TRAINER_SIMT_EMULATION) || defined(TRAINER_SIMT_DEVICE)
#include "kernels/cuda/check.h"
#define TRAINER_CUDA_RUNTIME_CHECKS 1
#endif

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/element.h"

namespace trainer::cuda {

#ifndef TRAINER_SIMT_EMULATION
// A kernel launch on a stream, and a kernel's dynamic shared memory: the two pieces of CUDA syntax the emulator
// (tests/simt) replaces.
#define TRAINER_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define TRAINER_DYNAMIC_SHARED(name) extern __shared__ __align__(128) uint8_t name[]
#endif  // TRAINER_SIMT_EMULATION

#ifdef TRAINER_CUDA_RUNTIME_CHECKS
// The runtime's statuses for TRAINER_CUDA_CHECK (check.h): a runtime call, or cudaGetLastError() after a launch.
inline bool succeeded(cudaError_t e) { return e == cudaSuccess; }
inline std::string status_message(cudaError_t e) { return cudaGetErrorString(e); }
#endif

// A value asked of the current device once: the first call on a device runs ask(device) and keeps its answer,
// later calls there return it (devices past the 64th ask every time). For answers a launch path needs on every
// call (a capability, a limit set once by cudaFuncSetAttribute).
class OncePerDevice {
   public:
    template <typename Ask>
    size_t get(Ask ask) {
        int device = 0;
        TRAINER_CUDA_CHECK(cudaGetDevice(&device));
        const bool kept = device >= 0 && device < kDevices;
        if (kept) {
            if (const size_t k = known_[static_cast<size_t>(device)].load(std::memory_order_relaxed)) return k - 1;
        }
        const size_t value = ask(device);
        if (kept) known_[static_cast<size_t>(device)].store(value + 1, std::memory_order_relaxed);
        return value;
    }

   private:
    static constexpr int kDevices = 64;
    std::array<std::atomic<size_t>, kDevices> known_{};  // the answer plus one; 0: not yet asked
};

// Blocks for a grid-stride loop over `work` items: enough to cover them, capped where a grid-stride loop
// already keeps every SM busy (the loops below stride over the remainder).
inline unsigned grid_for(size_t work, unsigned block) {
    const size_t blocks = (work + block - 1) / block;
    return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < 65535 ? blocks : 65535));
}

#ifdef TRAINER_CUDA_RUNTIME_CHECKS
// True for host memory (pageable or pinned), false for device or managed memory.
inline bool is_host_pointer(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return true;
    }
    return a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged;
}
#endif  // TRAINER_CUDA_RUNTIME_CHECKS

// An element read as fp32: itself, or a bf16 widened (exactly).
__device__ __forceinline__ float load_as_float(float x) { return x; }
__device__ __forceinline__ float load_as_float(uint16_t x) { return bf16_to_float(x); }
// An fp32 value stored as the output's type: itself, or rounded to bf16 (element.h's rounding).
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(uint16_t* p, float v) { *p = float_to_bf16(v); }

// V consecutive elements (fp32 or bf16) read as fp32 and written from fp32 (rounded as store_as rounds):
// V = 1 is a scalar access; otherwise V elements span whole 16-byte words (V x sizeof(T) a multiple of
// 16), read and written with 128-bit accesses, so `p` must be 16-byte aligned.
template <int V, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[V]) {
    if constexpr (V == 1) {
        f[0] = load_as_float(p[0]);
    } else {
        static_assert((V * sizeof(T)) % 16 == 0, "whole 16-byte words");
        constexpr int kWords = static_cast<int>(V * sizeof(T) / 16);
        uint4 u[kWords];
#pragma unroll
        for (int w = 0; w < kWords; ++w) u[w] = reinterpret_cast<const uint4*>(p)[w];
        const T* e = reinterpret_cast<const T*>(u);
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = load_as_float(e[k]);
    }
}
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[V]) {
    if constexpr (V == 1) {
        store_as(p, f[0]);
    } else {
        static_assert((V * sizeof(T)) % 16 == 0, "whole 16-byte words");
        constexpr int kWords = static_cast<int>(V * sizeof(T) / 16);
        uint4 u[kWords];
        T* e = reinterpret_cast<T*>(u);
#pragma unroll
        for (int k = 0; k < V; ++k) store_as(e + k, f[k]);
#pragma unroll
        for (int w = 0; w < kWords; ++w) reinterpret_cast<uint4*>(p)[w] = u[w];
    }
}

// The larger of m and a, where either is NaN NaN (a comparison with NaN is false, so a NaN once taken stays).
__device__ __forceinline__ float max_keeping_nan(float m, float a) { return (a > m || a != a) ? a : m; }

// amp_fp8's producer amax (Backend's GemmOperand::amax). A producing kernel keeps each thread's largest |value|
// (max_keeping_nan of fabsf over the values before they are stored), which stored_amax turns into the largest stored
// value (rounding is monotonic, so rounding the largest gives the largest rounded), and warp_amax puts the warp's into
// *amax: one atomicMax on the float's bits where it exceeds what *amax holds already (non-negative floats order as
// their bits, a NaN's above infinity's), so the result does not depend on the order. Every lane of the warp calls it;
// the launch function zeroes *amax on the stream first (zero_amax).
template <typename T>
__device__ __forceinline__ float stored_amax(float m) {
    if constexpr (std::is_same_v<T, uint16_t>) {
        return bf16_to_float(float_to_bf16(m));
    } else {
        return m;
    }
}
__device__ inline void warp_amax(float* amax, float m) {
    for (int o = 16; o > 0; o >>= 1) m = max_keeping_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0) {
        const unsigned bits = __float_as_uint(m);
        if (bits > *reinterpret_cast<volatile unsigned*>(amax)) atomicMax(reinterpret_cast<unsigned*>(amax), bits);
    }
}
inline void zero_amax(float* amax, cudaStream_t stream) {
    if (amax != nullptr) TRAINER_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
}

// True when every pointer is 16-byte aligned, so float4 (128-bit) loads and stores are legal.
template <typename... P>
__host__ __device__ inline bool aligned16(const P*... p) {
    return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

}  // namespace trainer::cuda

namespace trainer::cuda {

// A grid-stride loop over n elements: vec4(k) for every whole group of 4 elements k (elements 4k..4k+3)
// when `vec`, then one(i) for each element left (all of them when not `vec`).
template <typename Vec4, typename One>
__device__ void grid_stride4(size_t n, bool vec, Vec4 vec4, One one) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    size_t done = 0;
    if (vec) {
        const size_t n4 = n / 4;
        for (size_t k = tid; k < n4; k += stride) vec4(k);
        done = n4 * 4;
    }
    for (size_t i = done + tid; i < n; i += stride) one(i);
}

// out[i] = f(a[i]) and out[i] = f(a[i], b[i]) over n elements, with 128-bit loads and stores (float4)
// when `vec` (all pointers 16-byte aligned) and scalar ones for the tail. `out` may alias an input:
// every element reads and writes only its own index.
template <typename F>
__global__ void map1_kernel(float* out, const float* a, size_t n, F f, bool vec) {
    grid_stride4(
        n, vec,
        [&](size_t k) {
            float4 x = reinterpret_cast<const float4*>(a)[k];
            x.x = f(x.x), x.y = f(x.y), x.z = f(x.z), x.w = f(x.w);
            reinterpret_cast<float4*>(out)[k] = x;
        },
        [&](size_t i) { out[i] = f(a[i]); });
}

template <typename F>
__global__ void map2_kernel(float* out, const float* a, const float* b, size_t n, F f, bool vec) {
    grid_stride4(
        n, vec,
        [&](size_t k) {
            float4 x = reinterpret_cast<const float4*>(a)[k];
            const float4 y = reinterpret_cast<const float4*>(b)[k];
            x.x = f(x.x, y.x), x.y = f(x.y, y.y), x.z = f(x.z, y.z), x.w = f(x.w, y.w);
            reinterpret_cast<float4*>(out)[k] = x;
        },
        [&](size_t i) { out[i] = f(a[i], b[i]); });
}

constexpr unsigned kPointwiseBlock = 256;

// Multi-tensor kernels cut their ranges (segments with n elements and a first_chunk numbering the chunks
// across the segments, in order) into chunks of `chunk` elements: the segment of chunk c, found by binary
// search (the last one whose first_chunk <= c), and the chunk's element range [*begin, *end) in it.
template <typename Seg>
__device__ const Seg& chunk_segment(const Seg* segs, int nsegs, size_t c, size_t chunk, size_t* begin, size_t* end) {
    int lo = 0, hi = nsegs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (segs[mid].first_chunk <= c)
            lo = mid;
        else
            hi = mid - 1;
    }
    const Seg& g = segs[lo];
    *begin = (c - g.first_chunk) * chunk;
    *end = *begin + chunk < g.n ? *begin + chunk : g.n;
    return g;
}

template <typename F>
void map1(float* out, const float* a, size_t n, F f, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = aligned16(out, a);
    TRAINER_LAUNCH(map1_kernel, grid_for(vec ? (n + 3) / 4 : n, kPointwiseBlock), kPointwiseBlock, 0, stream, out, a, n,
                   f, vec);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename F>
void map2(float* out, const float* a, const float* b, size_t n, F f, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = aligned16(out, a, b);
    TRAINER_LAUNCH(map2_kernel, grid_for(vec ? (n + 3) / 4 : n, kPointwiseBlock), kPointwiseBlock, 0, stream, out, a, b,
                   n, f, vec);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
