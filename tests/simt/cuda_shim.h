// The CUDA names a kernel source uses, for compiling it with g++ onto the emulator of simt.h: include this first,
// then the kernel source, which under TRAINER_SIMT_EMULATION leaves out its CUDA includes and PTX wrappers and
// takes these. Only what the emulated kernel files and tests/gpu's checks use is here. Device memory is host
// memory: cudaMalloc is an aligned allocation, and copies happen at the call.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/element.h"
#include "simt.h"

#define TRAINER_SIMT_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// A static local is one object for every thread of the block (blocks run one at a time), as __shared__ is.
#define __shared__ static
#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())
#define TRAINER_DYNAMIC_SHARED(name) uint8_t* name = ::simt::dynamic_shared()
#define TRAINER_LAUNCH(kernel, grid, block, smem, stream, ...) \
    ((void)(stream), ::simt::launch(grid, block, smem, [&] { kernel(__VA_ARGS__); }))
#define TRAINER_CUDA_CHECK(stmt) (void)(stmt)

using cudaStream_t = void*;
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
inline const char* cudaGetErrorString(cudaError_t) { return "an emulated CUDA call failed"; }
enum cudaDataType_t { CUDA_R_32F, CUDA_R_16BF };  // named in kernels/cuda/ops.h's GEMM declarations
using dim3 = ::simt::Dim3;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
template <class F>
inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int) {
    return 0;
}
// The emulated device's shared memory a block may opt in to: an H100's (227 KiB).
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin };
inline cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return 0;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
    *value = 232448;
    return 0;
}
inline cudaError_t cudaGetLastError() { return 0; }
inline cudaError_t cudaDeviceSynchronize() { return 0; }
template <class T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
    *p = static_cast<T*>(std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256));
    return *p ? 0 : 2;
}
inline cudaError_t cudaFree(void* p) {
    std::free(p);
    return 0;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
    std::memmove(dst, src, bytes);
    return 0;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
    std::memmove(dst, src, bytes);
    return 0;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return 0; }
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind, cudaStream_t) {
    for (size_t r = 0; r < height; ++r) {
        std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    }
    return 0;
}

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) ushort4 {
    unsigned short x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
// Round-to-nearest arithmetic that nvcc must not contract into an FMA: g++ in ISO mode contracts nothing.
inline float __fmul_rn(float a, float b) { return a * b; }

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
struct float2 {
    float x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return {{trainer::float_to_bf16(lo)}, {trainer::float_to_bf16(hi)}};
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    return {trainer::bf16_to_float(v.x.bits), trainer::bf16_to_float(v.y.bits)};
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
    std::memset(p, value, bytes);
    return 0;
}
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
// Threads are fibers that switch only where they wait for one another, so a read-modify-write is atomic here.
inline unsigned atomicMax(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = std::max(old, v);
    return old;
}
inline void __syncthreads() { ::simt::syncthreads(); }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) { return ::simt::shfl_xor(mask, v, lane_mask); }
inline int __all_sync(unsigned mask, int pred) { return ::simt::all_sync(mask, pred != 0) ? 1 : 0; }
using std::max;
using std::min;

// The kernels' PTX wrappers.
inline void cp_async16(void* dst, const void* src, bool valid) { ::simt::cp_async16(dst, src, valid); }
inline void cp_async_commit() { ::simt::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
    ::simt::cp_async_wait(N);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ::simt::ldmatrix_x4(r, p, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { ::simt::ldmatrix_x4(r, p, true); }
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    ::simt::mma_m16n8k16_bf16(d, a, b0, b1);
}
inline uint32_t smem_addr(const void* p) { return ::simt::shared_address(p); }
// kernels/cuda/wgmma.cuh's (sm_90a).
inline void fence_proxy_async() { ::simt::fence_proxy_async(); }
inline void wgmma_fence() { ::simt::wgmma_fence(); }
inline void wgmma_commit() { ::simt::wgmma_commit(); }
template <int N>
inline void wgmma_wait() {
    ::simt::wgmma_wait(N);
}
// Empty on the emulator: the kernel's statements run in the order written.
template <typename T, int M>
inline void fence_operands(T (&)[M][4]) {}
template <int N>
inline void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
    ::simt::wgmma_m64k16(&d[0][0], N, desc_a, nullptr, desc_b, false, accumulate);
}
template <int N>
inline void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    ::simt::wgmma_m64k16(&d[0][0], N, 0, a, desc_b, true, accumulate);
}
