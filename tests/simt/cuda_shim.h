// The CUDA names a kernel source uses, for compiling it with g++ onto the emulator of simt.h: include this first,
// then the kernel source, which under TRAINER_SIMT_EMULATION leaves out its CUDA includes and PTX wrappers and
// takes these. The runtime's calls are those of the emulated runtime (cuda_runtime_api.h): device memory is host
// memory, and a launch queues the kernel on its stream, to run when the host or another stream waits for it.
// Two uses: the CPU suite's emulated kernels (tests/CMakeLists.txt, the token `cuda` renamed), where
// TRAINER_CUDA_CHECK is this file's; and the emulated build (TRAINER_CUDA=EMULATED, TRAINER_SIMT_DEVICE defined),
// where every CUDA source of the trainer is compiled onto it and kernels/cuda/check.h's is used, as with nvcc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/element.h"
#include "simt/cuda_runtime_api.h"
#include "simt/simt.h"

#define TRAINER_SIMT_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// A static local is one object for every thread of the block (blocks run one at a time), as __shared__ is.
#define __shared__ static
#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())
#define TRAINER_DYNAMIC_SHARED(name) uint8_t* name = ::simt::dynamic_shared()
// kernel<<<grid, block, smem, stream>>>(args...): the arguments evaluated now, the kernel queued on the stream.
#define TRAINER_LAUNCH(kernel, grid, block, smem, stream, ...)         \
    ::simt::rt::launch_kernel(                                         \
        #kernel, (stream), (grid), (block), static_cast<size_t>(smem), \
        [=](auto... simt_args_) { kernel(simt_args_...); }, __VA_ARGS__)
#ifndef TRAINER_SIMT_DEVICE
#define TRAINER_CUDA_CHECK(stmt) ::simt::rt::check_status((stmt), #stmt)
namespace simt::rt {
inline void check_status(cudaError_t e, const char* call) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}
}  // namespace simt::rt
#endif

using dim3 = ::simt::Dim3;

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
