// bf16 <-> fp32 casts on the GPU, sharing the per-element rounding with the CPU backend (element.h).
// Grid-stride loops, four elements per thread per iteration (16-byte fp32 and 8-byte bf16 accesses) where
// the pointers allow it, one otherwise: amp_bf16 casts every GEMM operand, so these run at memory speed.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

__global__ void cast_float_to_bf16_kernel(uint16_t* out, const float* in, size_t n, bool vec) {
    grid_stride4(
        n, vec,
        [&](size_t k) {
            const float4 x = reinterpret_cast<const float4*>(in)[k];
            ushort4 h;
            h.x = float_to_bf16(x.x), h.y = float_to_bf16(x.y), h.z = float_to_bf16(x.z), h.w = float_to_bf16(x.w);
            reinterpret_cast<ushort4*>(out)[k] = h;
        },
        [&](size_t i) { out[i] = float_to_bf16(in[i]); });
}

__global__ void cast_bf16_to_float_kernel(float* out, const uint16_t* in, size_t n, bool vec) {
    grid_stride4(
        n, vec,
        [&](size_t k) {
            const ushort4 h = reinterpret_cast<const ushort4*>(in)[k];
            reinterpret_cast<float4*>(out)[k] =
                make_float4(bf16_to_float(h.x), bf16_to_float(h.y), bf16_to_float(h.z), bf16_to_float(h.w));
        },
        [&](size_t i) { out[i] = bf16_to_float(in[i]); });
}

struct RoundBf16 {
    __device__ float operator()(float x) const { return bf16_to_float(float_to_bf16(x)); }
};

// 16-byte fp32 side and 8-byte bf16 side.
bool vectorizable(const float* f, const uint16_t* h) {
    return reinterpret_cast<uintptr_t>(f) % 16 == 0 && reinterpret_cast<uintptr_t>(h) % 8 == 0;
}

}  // namespace

void cast_float_to_bf16(uint16_t* out, const float* in, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = vectorizable(in, out);
    TRAINER_LAUNCH(cast_float_to_bf16_kernel, grid_for(vec ? (n + 3) / 4 : n, kPointwiseBlock), kPointwiseBlock, 0,
                   stream, out, in, n, vec);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void cast_bf16_to_float(float* out, const uint16_t* in, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = vectorizable(out, in);
    TRAINER_LAUNCH(cast_bf16_to_float_kernel, grid_for(vec ? (n + 3) / 4 : n, kPointwiseBlock), kPointwiseBlock, 0,
                   stream, out, in, n, vec);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void round_to_bf16(float* out, const float* in, size_t n, cudaStream_t stream) {
    map1(out, in, n, RoundBf16{}, stream);
}

}  // namespace trainer::cuda
