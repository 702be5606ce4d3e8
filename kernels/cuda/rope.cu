// Rotary position embeddings on the GPU, in place on q and k (non-interleaved halves), the twin of
// kernels/cpu/rope.cpp. The cos/sin tables come from the host (cpu::rope_table_f32, fp32 as OLMo builds
// them), so both backends rotate by bitwise the same values. The backward rotates by -angle.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

// Rows (B x T) stride over blockIdx.y; a thread takes W consecutive i < HS/2 of one head of q or k (W = 8
// with 128-bit accesses where the halves are whole groups of 8, else 1); qkv fp32, or bf16 (rotated in
// fp32, rounded back).
template <int W, typename E>
__global__ void rope_kernel(E* qkv, const float* cos_t, const float* sin_t, int rows, int T, int NH, int HS,
                            float sign) {
    const int half = HS / 2, C = NH * HS, groups = 2 * NH * (half / W);
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const int t = row % T;
        const float* ct = cos_t + static_cast<size_t>(t) * half;
        const float* st = sin_t + static_cast<size_t>(t) * half;
        for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
            const int head = g / (half / W), i = (g % (half / W)) * W;
            E* lo = qkv + static_cast<size_t>(row) * 3 * C + static_cast<size_t>(head) * HS;
            float c[W], s[W], x0[W], x1[W], y0[W], y1[W];
            load_vec<W>(ct + i, c);
            load_vec<W>(st + i, s);
            load_vec<W>(lo + i, x0);
            load_vec<W>(lo + i + half, x1);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                const float sk = sign * s[k];
                y0[k] = x0[k] * c[k] - x1[k] * sk;
                y1[k] = x1[k] * c[k] + x0[k] * sk;
            }
            store_vec<W>(lo + i, y0);
            store_vec<W>(lo + i + half, y1);
        }
    }
}

template <typename E>
void rope_apply(E* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS, float sign,
                cudaStream_t stream) {
    const int rows = B * T, half = HS / 2;
    if (rows == 0 || half == 0) return;
    constexpr int kW = 8;
    const bool vec = half % kW == 0 && aligned16(qkv, cos_t, sin_t);
    const int groups = 2 * NH * (vec ? half / kW : half);
    const dim3 grid((static_cast<unsigned>(groups) + kPointwiseBlock - 1) / kPointwiseBlock,
                    static_cast<unsigned>(std::min(rows, 65535)));
    if (vec) {
        TRAINER_LAUNCH((rope_kernel<kW, E>), grid, kPointwiseBlock, 0, stream, qkv, cos_t, sin_t, rows, T, NH, HS,
                       sign);
    } else {
        TRAINER_LAUNCH((rope_kernel<1, E>), grid, kPointwiseBlock, 0, stream, qkv, cos_t, sin_t, rows, T, NH, HS, sign);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope_forward(float* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                  cudaStream_t stream) {
    rope_apply(qkv, cos_t, sin_t, B, T, NH, HS, 1.0f, stream);
}

void rope_forward(uint16_t* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                  cudaStream_t stream) {
    rope_apply(qkv, cos_t, sin_t, B, T, NH, HS, 1.0f, stream);
}

void rope_backward(float* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                   cudaStream_t stream) {
    rope_apply(dqkv, cos_t, sin_t, B, T, NH, HS, -1.0f, stream);
}

void rope_backward(uint16_t* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                   cudaStream_t stream) {
    rope_apply(dqkv, cos_t, sin_t, B, T, NH, HS, -1.0f, stream);
}

}  // namespace trainer::cuda
