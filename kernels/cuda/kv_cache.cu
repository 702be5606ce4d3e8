// Generation's ops on the GPU, the twin of kernels/cpu/kv_cache.cpp, in fp32: RoPE at each row's own position (the
// cos/sin table of cpu::rope_table_f32, as the training rope uses, so both rotate by bitwise the same values), and
// attention with a KV cache: the rows' k and v written into the caches, then one warp per (row, query head) streams
// its sequence's cached keys and values with an online softmax, each lane owning every 32nd channel of the head, the
// dot products completed by warp shuffles. Decoding reads each cached key and value once per token; nothing is
// tiled, since a decode step has one query a sequence. No atomics: each output is summed in a fixed order.
#include <algorithm>
#include <cmath>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxPerLane = kCudaNativeAttentionMaxHeadSize / kWarp;

__global__ void rope_at_kernel(float* qkv, const int32_t* positions, const float* cos_t, const float* sin_t, int N,
                               int NH, int KVH, int HS) {
    const int half = HS / 2, W = (NH + 2 * KVH) * HS, pairs = (NH + KVH) * half;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const float* ct = cos_t + static_cast<size_t>(positions[n]) * half;
        const float* st = sin_t + static_cast<size_t>(positions[n]) * half;
        for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < pairs; g += gridDim.x * blockDim.x) {
            const int head = g / half, i = g % half;
            float* lo = qkv + static_cast<size_t>(n) * W + static_cast<size_t>(head) * HS;
            const float x0 = lo[i], x1 = lo[i + half];
            lo[i] = x0 * ct[i] - x1 * st[i];
            lo[i + half] = x1 * ct[i] + x0 * st[i];
        }
    }
}

// Row n's k and v (KV = KVH * HS channels each) into the caches (sequences, KVH, S, HS) at its sequence and position.
__global__ void cache_write_kernel(float* kcache, float* vcache, const float* qkv, const int32_t* seqs,
                                   const int32_t* positions, int N, int NH, int KVH, int HS, int S) {
    const int C = NH * HS, KV = KVH * HS;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const float* row = qkv + static_cast<size_t>(n) * (C + 2 * KV);
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < KV; c += gridDim.x * blockDim.x) {
            const int h = c / HS, d = c % HS;
            const size_t at = ((static_cast<size_t>(seqs[n]) * KVH + h) * S + positions[n]) * HS + d;
            kcache[at] = row[C + c];
            vcache[at] = row[C + KV + c];
        }
    }
}

// One warp per (row, query head): blockIdx.x the row, the warp within the block its head, which reads the cache of
// its group's shared head.
__global__ void cached_attention_kernel(float* out, const float* qkv, const float* kcache, const float* vcache,
                                        const int32_t* seqs, const int32_t* positions, int NH, int KVH, int HS, int S,
                                        float scale) {
    const int n = blockIdx.x, lane = threadIdx.x % kWarp;
    const int h = blockIdx.y * (blockDim.x / kWarp) + threadIdx.x / kWarp;
    if (h >= NH) return;  // whole warps only: the shuffles below never miss a lane
    const int C = NH * HS, len = positions[n] + 1;
    const float* q = qkv + static_cast<size_t>(n) * (C + 2 * KVH * HS) + static_cast<size_t>(h) * HS;
    const size_t head0 = (static_cast<size_t>(seqs[n]) * KVH + h / (NH / KVH)) * S * HS;
    float qr[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + i * kWarp;
        qr[i] = d < HS ? q[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float max = -INFINITY, sum = 0.0f;
    for (int j = 0; j < len; ++j) {
        const float* k = kcache + head0 + static_cast<size_t>(j) * HS;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
            const int d = lane + i * kWarp;
            if (d < HS) s += qr[i] * k[d];
        }
#pragma unroll
        for (int off = kWarp / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        s *= scale;
        const float next = fmaxf(max, s), carry = expf(max - next), p = expf(s - next);
        sum = sum * carry + p;
        const float* v = vcache + head0 + static_cast<size_t>(j) * HS;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
            const int d = lane + i * kWarp;
            if (d < HS) acc[i] = acc[i] * carry + p * v[d];
        }
        max = next;
    }
    float* o = out + static_cast<size_t>(n) * C + static_cast<size_t>(h) * HS;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + i * kWarp;
        if (d < HS) o[d] = acc[i] / sum;
    }
}

}  // namespace

void rope_forward_at(float* qkv, const int32_t* positions, const float* cos_t, const float* sin_t, int N, int NH,
                     int KVH, int HS, cudaStream_t stream) {
    const int pairs = (NH + KVH) * (HS / 2);  // the q and k heads, HS / 2 pairs each
    if (N == 0 || pairs == 0) return;
    const dim3 grid(grid_for(static_cast<size_t>(pairs), kPointwiseBlock), static_cast<unsigned>(std::min(N, 65535)));
    TRAINER_LAUNCH(rope_at_kernel, grid, kPointwiseBlock, 0, stream, qkv, positions, cos_t, sin_t, N, NH, KVH, HS);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                          const int32_t* positions, int N, int NH, int KVH, int HS, int S, cudaStream_t stream) {
    TRAINER_CHECK(HS <= kCudaNativeAttentionMaxHeadSize, "cached attention: head size {} above {}", HS,
                  kCudaNativeAttentionMaxHeadSize);
    check_shared_heads(NH, KVH);
    if (N == 0) return;
    const int KV = KVH * HS;
    const dim3 write_grid(grid_for(static_cast<size_t>(KV), kPointwiseBlock),
                          static_cast<unsigned>(std::min(N, 65535)));
    TRAINER_LAUNCH(cache_write_kernel, write_grid, kPointwiseBlock, 0, stream, kcache, vcache, qkv, seqs, positions, N,
                   NH, KVH, HS, S);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    constexpr int kWarpsPerBlock = 4;
    const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((NH + kWarpsPerBlock - 1) / kWarpsPerBlock));
    TRAINER_LAUNCH(cached_attention_kernel, grid, kWarpsPerBlock * kWarp, 0, stream, out, qkv, kcache, vcache, seqs,
                   positions, NH, KVH, HS, S, 1.0f / sqrtf(static_cast<float>(HS)));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
