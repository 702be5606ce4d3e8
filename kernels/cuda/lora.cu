// LoRA's adapters on the GPU, the twin of kernels/cpu/lora.cpp: the rank-r products as three kernels of our own, each
// output summed in a fixed order (no atomics: deterministic), fp32 accumulation whatever the operands' storage, the
// dropout mask recomputed from element.h's hash wherever the input is read (never stored):
//   rows:   h(M, r) = scale * in(M, K) @ W^T     one block a row, the K products split over the threads
//   cols:   dW(r, K) += scale * h^T @ in          one block a tile of 32 columns, the M rows over 4 thread groups
//   expand: out(M, n) += scale * h @ W             one thread an output element, the r products in order
// The forward is rows (h = drop(x) A^T) then expand (out += scaling h B^T); the backward rows (h again), rows (g =
// scaling dout B), cols twice (dB += scaling dout^T h, dA += g^T drop(x)) and expand (dinp += drop'(g A)).
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 8;  // partial sums a thread keeps at once: the rank is walked in chunks of 8
constexpr int kColumns = 32;
constexpr int kGroups = kThreads / kColumns;

// The dropout of one input element: its value kept and scaled, or 0.
struct Drop {
    bool on = false;
    uint32_t threshold = 0, adapter = 0;
    float keep_scale = 1.0f;
    const uint64_t* keys = nullptr;
    __device__ float operator()(float v, int m, int k) const {
        if (!on) return v;
        return lora_dropout_keep(keys[m], adapter, static_cast<uint32_t>(k), threshold) ? v * keep_scale : 0.0f;
    }
};

// h[m, j] = scale * sum_k drop(in[m, k]) * W[j * sj + k * sk], for j < r.
template <typename T>
__global__ void lora_rows_kernel(float* h, const T* in, int ld, const float* W, int sj, int sk, int K, int r,
                                 float scale, Drop drop) {
    __shared__ float part[kChunk][kThreads];
    const int m = blockIdx.x, t = threadIdx.x;
    const T* row = in + static_cast<size_t>(m) * ld;
    for (int j0 = 0; j0 < r; j0 += kChunk) {
        float acc[kChunk] = {};
        for (int k = t; k < K; k += kThreads) {
            const float v = drop(load_as_float(row[k]), m, k);
            for (int c = 0; c < kChunk; ++c) {
                if (j0 + c < r) acc[c] += v * W[static_cast<size_t>(j0 + c) * sj + static_cast<size_t>(k) * sk];
            }
        }
        for (int c = 0; c < kChunk; ++c) part[c][t] = acc[c];
        __syncthreads();
        for (int half = kThreads / 2; half > 0; half /= 2) {
            if (t < half) {
                for (int c = 0; c < kChunk; ++c) part[c][t] += part[c][t + half];
            }
            __syncthreads();
        }
        if (t < kChunk && j0 + t < r) h[static_cast<size_t>(m) * r + j0 + t] = scale * part[t][0];
        __syncthreads();
    }
}

// dW[j * sj + k * sk] += scale * sum_m h[m, j] * drop(in[m, k]), for k < K, j < r: block b sums columns
// [32b, 32b + 32), thread t column 32b + t % 32 over the rows m = t / 32 (mod 4), the 4 groups added in order.
template <typename T>
__global__ void lora_cols_kernel(float* dW, int sj, int sk, const T* in, int ld, const float* h, int M, int K, int r,
                                 float scale, Drop drop) {
    __shared__ float part[kChunk][kThreads];
    const int t = threadIdx.x, lane = t % kColumns, group = t / kColumns;
    const int k = blockIdx.x * kColumns + lane;
    for (int j0 = 0; j0 < r; j0 += kChunk) {
        float acc[kChunk] = {};
        if (k < K) {
            for (int m = group; m < M; m += kGroups) {
                const float v = drop(load_as_float(in[static_cast<size_t>(m) * ld + k]), m, k);
                const float* hm = h + static_cast<size_t>(m) * r + j0;
                for (int c = 0; c < kChunk; ++c) {
                    if (j0 + c < r) acc[c] += hm[c] * v;
                }
            }
        }
        for (int c = 0; c < kChunk; ++c) part[c][t] = acc[c];
        __syncthreads();
        if (group == 0 && k < K) {
            for (int c = 0; c < kChunk && j0 + c < r; ++c) {
                float s = part[c][lane];
                for (int g = 1; g < kGroups; ++g) s += part[c][lane + g * kColumns];
                dW[static_cast<size_t>(j0 + c) * sj + static_cast<size_t>(k) * sk] += scale * s;
            }
        }
        __syncthreads();
    }
}

// out[m * ld + c] += drop(scale * sum_j h[m, j] * W[j * sj + c * sk]), for c < n (drop: the dropout's backward).
template <typename T>
__global__ void lora_expand_kernel(T* out, int ld, const float* h, const float* W, int sj, int sk, int M, int n, int r,
                                   float scale, Drop drop) {
    const size_t total = static_cast<size_t>(M) * n;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int m = static_cast<int>(i / n), c = static_cast<int>(i % n);
        const float* hm = h + static_cast<size_t>(m) * r;
        float s = 0.0f;
        for (int j = 0; j < r; ++j) s += hm[j] * W[static_cast<size_t>(j) * sj + static_cast<size_t>(c) * sk];
        T* p = out + static_cast<size_t>(m) * ld + c;
        store_as(p, load_as_float(*p) + drop(scale * s, m, c));
    }
}

Drop make_drop(const LoraDropoutArgs& d) {
    Drop drop;
    if (d.p <= 0.0f) return drop;
    drop.on = true;
    drop.threshold = lora_dropout_threshold(d.p);
    drop.keep_scale = 1.0f / (1.0f - d.p);
    drop.keys = d.row_keys;
    drop.adapter = d.adapter;
    return drop;
}

template <typename T>
void rows(float* h, const T* in, int ld, const float* W, int sj, int sk, int M, int K, int r, float scale,
          const Drop& drop, cudaStream_t stream) {
    TRAINER_LAUNCH(lora_rows_kernel<T>, static_cast<unsigned>(M), kThreads, 0, stream, h, in, ld, W, sj, sk, K, r,
                   scale, drop);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void cols(float* dW, int sj, int sk, const T* in, int ld, const float* h, int M, int K, int r, float scale,
          const Drop& drop, cudaStream_t stream) {
    const auto blocks = static_cast<unsigned>((K + kColumns - 1) / kColumns);
    TRAINER_LAUNCH(lora_cols_kernel<T>, blocks, kThreads, 0, stream, dW, sj, sk, in, ld, h, M, K, r, scale, drop);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void expand(T* out, int ld, const float* h, const float* W, int sj, int sk, int M, int n, int r, float scale,
            const Drop& drop, cudaStream_t stream) {
    TRAINER_LAUNCH(lora_expand_kernel<T>, grid_for(static_cast<size_t>(M) * n, 256), 256, 0, stream, out, ld, h, W, sj,
                   sk, M, n, r, scale, drop);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

// The operand as its type: `f(const float*)` or `f(const uint16_t*)`.
template <typename F>
void with_operand(const void* p, bool bf16, F&& f) {
    if (bf16) return f(static_cast<const uint16_t*>(p));
    f(static_cast<const float*>(p));
}

}  // namespace

void lora_forward(void* out, bool out_bf16, int ld_out, const void* inp, bool inp_bf16, const float* A, const float* B,
                  int M, int K, int r, int n, float scale, const LoraDropoutArgs& d, float* work, cudaStream_t stream) {
    if (M <= 0 || r <= 0) return;
    float* h = work;
    const Drop drop = make_drop(d), none;
    with_operand(inp, inp_bf16, [&](auto x) { rows(h, x, K, A, K, 1, M, K, r, 1.0f, drop, stream); });
    if (out_bf16) return expand(static_cast<uint16_t*>(out), ld_out, h, B, 1, r, M, n, r, scale, none, stream);
    expand(static_cast<float*>(out), ld_out, h, B, 1, r, M, n, r, scale, none, stream);
}

void lora_backward(void* dinp, bool dinp_bf16, float* dA, float* dB, const void* dout, bool dout_bf16, int ld_dout,
                   const void* inp, bool inp_bf16, const float* A, const float* B, int M, int K, int r, int n,
                   float scale, const LoraDropoutArgs& d, float* work, cudaStream_t stream) {
    if (M <= 0 || r <= 0) return;
    float* h = work;
    float* g = work + static_cast<size_t>(M) * r;
    const Drop drop = make_drop(d), none;
    with_operand(inp, inp_bf16, [&](auto x) { rows(h, x, K, A, K, 1, M, K, r, 1.0f, drop, stream); });
    with_operand(dout, dout_bf16, [&](auto y) {
        rows(g, y, ld_dout, B, 1, r, M, n, r, scale, none, stream);   // g = scale dout B
        cols(dB, 1, r, y, ld_dout, h, M, n, r, scale, none, stream);  // dB += scale dout^T h
    });
    with_operand(inp, inp_bf16, [&](auto x) { cols(dA, K, 1, x, K, g, M, K, r, 1.0f, drop, stream); });  // dA += g^T x
    if (dinp == nullptr) return;
    if (dinp_bf16) return expand(static_cast<uint16_t*>(dinp), K, g, A, K, 1, M, K, r, 1.0f, drop, stream);
    expand(static_cast<float*>(dinp), K, g, A, K, 1, M, K, r, 1.0f, drop, stream);  // dinp += drop'(g A)
}

}  // namespace trainer::cuda
