// Rotary position embeddings on the GPU, in place on q and k (non-interleaved halves), the twin of
// kernels/cpu/rope.cpp. The cos/sin tables come from the host (cpu::rope_table_f32, fp32 as OLMo builds
// them), so both backends rotate by bitwise the same values. The backward rotates by -angle.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

// One thread per (row, head of q or k, i < HS/2); qkv fp32, or bf16 (rotated in fp32, rounded back).
template <typename E>
__global__ void rope_kernel(E* qkv, const float* cos_t, const float* sin_t, int rows, int T, int NH, int HS,
                            float sign) {
    const int half = HS / 2, C = NH * HS;
    const size_t total = static_cast<size_t>(rows) * 2 * NH * half;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t k = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total; k += stride) {
        const int i = static_cast<int>(k % half);
        const size_t rest = k / half;
        const int head = static_cast<int>(rest % (2 * NH));
        const size_t row = rest / (2 * NH);
        const int t = static_cast<int>(row % T);
        E* lo = qkv + row * 3 * C + static_cast<size_t>(head) * HS;
        const float c = cos_t[static_cast<size_t>(t) * half + i], s = sign * sin_t[static_cast<size_t>(t) * half + i];
        const float x0 = load_as_float(lo[i]), x1 = load_as_float(lo[i + half]);
        store_as(lo + i, x0 * c - x1 * s);
        store_as(lo + i + half, x1 * c + x0 * s);
    }
}

template <typename E>
void rope_apply(E* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS, float sign,
                cudaStream_t stream) {
    const size_t total = static_cast<size_t>(B) * T * 2 * NH * (HS / 2);
    if (total == 0) return;
    rope_kernel<E>
        <<<grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(qkv, cos_t, sin_t, B * T, T, NH, HS, sign);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope_forward(float* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                  cudaStream_t stream) {
    rope_apply(qkv, cos_t, sin_t, B, T, NH, HS, 1.0f, stream);
}

void rope_forward_bf16(uint16_t* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                       cudaStream_t stream) {
    rope_apply(qkv, cos_t, sin_t, B, T, NH, HS, 1.0f, stream);
}

void rope_backward(float* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                   cudaStream_t stream) {
    rope_apply(dqkv, cos_t, sin_t, B, T, NH, HS, -1.0f, stream);
}

void rope_backward_bf16(uint16_t* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                        cudaStream_t stream) {
    rope_apply(dqkv, cos_t, sin_t, B, T, NH, HS, -1.0f, stream);
}

}  // namespace trainer::cuda
