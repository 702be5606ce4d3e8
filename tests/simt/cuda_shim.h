// The CUDA names a kernel header uses, for compiling it with g++ onto the emulator of simt.h: include this first,
// then the kernel header, which under TRAINER_SIMT_EMULATION leaves out its CUDA includes and PTX wrappers and
// takes these. Only what our flash attention's kernels use is here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/element.h"
#include "simt.h"

#define TRAINER_SIMT_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define TRAINER_DYNAMIC_SHARED(name) uint8_t* name = ::simt::dynamic_shared()
#define TRAINER_LAUNCH(kernel, grid, block, smem, stream, ...) \
    ((void)(stream), ::simt::launch(grid, block, smem, [&] { kernel(__VA_ARGS__); }))
#define TRAINER_CUDA_CHECK(stmt) (void)(stmt)

using cudaStream_t = void*;
using cudaError_t = int;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
template <class F>
inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int) {
    return 0;
}
inline cudaError_t cudaGetLastError() { return 0; }

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
inline void __syncthreads() { ::simt::syncthreads(); }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) { return ::simt::shfl_xor(mask, v, lane_mask); }
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
