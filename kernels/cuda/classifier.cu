// Fused softmax + cross-entropy + dlogits on the GPU, in place over (N, V) logits, the twin of
// kernels/cpu/classifier.cpp: one block per row; pass 1 keeps each thread's online (max, sum of
// exponentials) over its strided columns and merges them in a fixed tree (deterministic), giving the
// row's logsumexp; pass 2 overwrites the row with (softmax - onehot(target)) * dloss_scale. The full
// softmax never exists separately. Targets < 0 are ignored (loss 0, gradient 0); targets >= V are the
// caller's to refuse (the CPU backend checks them on the host). The z-loss scales pass 2's softmax term by
// 1 + 2 z lse, as the CPU twin does (exactly 1 without it).
//
// Pass 2 needs the row pass 1 read. With `one_read` (kernels.classifier_one_read) pass 1 copies
// the row into shared memory as it reads it and pass 2 reads it there: the logits cross device memory once
// each way. A GPT-2 chunk's bf16 row is 98 KiB, so two blocks fit an SM of a Hopper GPU. Without it (or
// where the row does not fit a block's shared memory, or its rows are not whole 16-byte words) pass 2 reads
// the row again from device memory: on an H100 4 blocks an SM keep 528 rows (52 MB) in flight, more than its
// 50 MB of L2, so that second read came from HBM too (bench-kernels: 437 us a 4,092-row chunk, the three
// passes' bytes at 2.8 TB/s). Both kernels merge the same values in the same order: the same bits.
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

constexpr unsigned kThreads = 512;

// Merges two online-softmax partials (max m, sum s of exp(x - m)). Whichever side has the smaller maximum is
// scaled by exp(lower - higher): one exponential, taken before the branch (both sides of it would otherwise each
// take theirs, predicated: two a logit in pass 1).
__device__ void merge(float& m, float& s, float m2, float s2) {
    const float e = expf(fminf(m, m2) - fmaxf(m, m2));
    if (m2 > m) {
        s = s * e + s2;
        m = m2;
    } else if (m2 > -FLT_MAX) {
        s += s2 * e;
    }
}

// Merges the block's kThreads partials in a fixed tree (deterministic) through sm and ss; returns the row's
// logsumexp to every thread.
__device__ float block_logsumexp(float m, float s, float* sm, float* ss) {
    sm[threadIdx.x] = m, ss[threadIdx.x] = s;
    __syncthreads();
    for (unsigned half = kThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            float a = sm[threadIdx.x], b = ss[threadIdx.x];
            merge(a, b, sm[threadIdx.x + half], ss[threadIdx.x + half]);
            sm[threadIdx.x] = a, ss[threadIdx.x] = b;
        }
        __syncthreads();
    }
    return sm[0] + logf(ss[0]);
}

// What a block writes for row n by thread 0 (`target_logit` its target's logit, or none where the target is
// ignored): the loss, and the z-loss where asked.
__device__ void write_losses(float* losses, float* z_losses, int n, float lse, float target_logit, bool ignored,
                             float z_loss_multiplier) {
    losses[n] = ignored ? 0.0f : lse - target_logit;
    if (z_losses != nullptr) z_losses[n] = ignored ? 0.0f : z_loss_multiplier * lse * lse;
}

// Pass 2 on W columns from column c: (softmax - onehot(target)) * dloss_scale, the softmax term scaled by
// `softmax_scale` (dloss_scale, times 1 + 2 z lse with the z-loss).
template <int W>
__device__ __forceinline__ void softmax_gradient(float (&x)[W], int c, int target, float lse, float softmax_scale,
                                                 float dloss_scale) {
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = expf(x[k] - lse) * softmax_scale - (c + k == target ? dloss_scale : 0.0f);
}

__device__ float softmax_scale_of(float lse, float dloss_scale, float z_loss_multiplier) {
    return z_loss_multiplier != 0.0f ? dloss_scale * (1.0f + 2.0f * z_loss_multiplier * lse) : dloss_scale;
}

// Logits of type E: fp32, or bf16 (read in fp32, the dlogits rounded back). Each thread takes W consecutive
// columns at a time (128-bit accesses where W > 1: rows of whole 16-byte words).
template <int W, typename E>
__global__ void classifier_kernel(E* logits, float* losses, const int32_t* targets, int V, float dloss_scale,
                                  bool compute_grad, float z_loss_multiplier, float* z_losses) {
    __shared__ float sm[kThreads], ss[kThreads];
    const int n = blockIdx.x;
    E* row = logits + static_cast<size_t>(n) * V;
    const int target = targets[n];
    if (target < 0) {
        if (threadIdx.x == 0) write_losses(losses, z_losses, n, 0.0f, 0.0f, true, z_loss_multiplier);
        if (compute_grad)
            for (int c = threadIdx.x; c < V; c += kThreads) store_as(row + c, 0.0f);
        return;
    }
    float m = -FLT_MAX, s = 0.0f;
    for (int c = threadIdx.x * W; c < V; c += kThreads * W) {
        float x[W];
        load_vec<W>(row + c, x);
#pragma unroll
        for (int k = 0; k < W; ++k) merge(m, s, x[k], 1.0f);
    }
    const float lse = block_logsumexp(m, s, sm, ss);
    if (threadIdx.x == 0) write_losses(losses, z_losses, n, lse, load_as_float(row[target]), false, z_loss_multiplier);
    __syncthreads();  // thread 0 has read row[target] before pass 2 overwrites it
    if (!compute_grad) return;
    const float softmax_scale = softmax_scale_of(lse, dloss_scale, z_loss_multiplier);
    for (int c = threadIdx.x * W; c < V; c += kThreads * W) {
        float x[W];
        load_vec<W>(row + c, x);
        softmax_gradient<W>(x, c, target, lse, softmax_scale, dloss_scale);
        store_vec<W>(row + c, x);
    }
}

// The one-read kernel: classifier_kernel<W, E> with the row of whole 16-byte words held in dynamic shared memory
// from pass 1 to pass 2. Pass 1 keeps kInFlight words a thread in flight (the row's read is all the block does
// before its reduction).
constexpr int kInFlight = 4;

template <int W, typename E>
__global__ void __launch_bounds__(kThreads)
    classifier_one_read_kernel(E* logits, float* losses, const int32_t* targets, int V, float dloss_scale,
                               bool compute_grad, float z_loss_multiplier, float* z_losses) {
    static_assert(W * sizeof(E) == 16, "one 16-byte word a step");
    constexpr int kT = static_cast<int>(kThreads);
    TRAINER_DYNAMIC_SHARED(stash_bytes);
    uint4* stash = reinterpret_cast<uint4*>(stash_bytes);
    __shared__ float sm[kThreads], ss[kThreads];
    const int n = blockIdx.x;
    E* row = logits + static_cast<size_t>(n) * V;
    uint4* words = reinterpret_cast<uint4*>(row);
    const int word_count = V / W;
    const int target = targets[n];
    if (target < 0) {
        if (threadIdx.x == 0) write_losses(losses, z_losses, n, 0.0f, 0.0f, true, z_loss_multiplier);
        if (compute_grad)
            for (int w = static_cast<int>(threadIdx.x); w < word_count; w += kT) words[w] = uint4{0, 0, 0, 0};
        return;
    }
    // The words w, w + kThreads, ... in order, as classifier_kernel<W> takes its columns: the same merges.
    float m = -FLT_MAX, s = 0.0f;
    auto take = [&](int w, const uint4& u) {
        stash[w] = u;
        float x[W];
        load_vec<W>(reinterpret_cast<const E*>(&u), x);
#pragma unroll
        for (int k = 0; k < W; ++k) merge(m, s, x[k], 1.0f);
    };
    int w = static_cast<int>(threadIdx.x);
    for (; w + (kInFlight - 1) * kT < word_count; w += kInFlight * kT) {
        uint4 u[kInFlight];
#pragma unroll
        for (int i = 0; i < kInFlight; ++i) u[i] = words[w + i * kT];
#pragma unroll
        for (int i = 0; i < kInFlight; ++i) take(w + i * kT, u[i]);
    }
    for (; w < word_count; w += kT) take(w, words[w]);
    const float lse = block_logsumexp(m, s, sm, ss);  // its barriers also publish the stash
    if (threadIdx.x == 0) {
        write_losses(losses, z_losses, n, lse, load_as_float(reinterpret_cast<const E*>(stash)[target]), false,
                     z_loss_multiplier);
    }
    if (!compute_grad) return;
    const float softmax_scale = softmax_scale_of(lse, dloss_scale, z_loss_multiplier);
    for (w = static_cast<int>(threadIdx.x); w < word_count; w += kT) {
        float x[W];
        load_vec<W>(reinterpret_cast<const E*>(&stash[w]), x);
        softmax_gradient<W>(x, w * W, target, lse, softmax_scale, dloss_scale);
        store_vec<W>(row + w * W, x);
    }
}

// The row bytes the one-read kernel for E may hold on the current device: the opt-in maximum of shared memory a
// block less the kernel's own, allowed once per device at its first launch. That is an eager one, so a CUDA
// graph's recording (kernels.cuda_graphs) meets no attribute call.
template <typename E>
size_t one_read_row_bytes_limit() {
    static OncePerDevice limit;
    return limit.get([](int device) {
        int optin = 0;
        TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        const size_t own = 2 * kThreads * sizeof(float);  // sm and ss
        const size_t bytes = static_cast<size_t>(optin) > own ? static_cast<size_t>(optin) - own : 0;
        TRAINER_CUDA_CHECK(cudaFuncSetAttribute(classifier_one_read_kernel<static_cast<int>(16 / sizeof(E)), E>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
        return bytes;
    });
}

template <typename E>
void classifier_launch(E* logits, float* losses, const int32_t* targets, int N, int V, float dloss_scale,
                       bool compute_grad, float z_loss_multiplier, float* z_losses, bool one_read,
                       cudaStream_t stream) {
    if (N == 0) return;
    constexpr int kW = static_cast<int>(16 / sizeof(E));  // one 16-byte word
    const bool words = V % kW == 0 && aligned16(logits);
    const size_t row_bytes = static_cast<size_t>(V) * sizeof(E);
    if (one_read && words && row_bytes <= one_read_row_bytes_limit<E>()) {
        TRAINER_LAUNCH((classifier_one_read_kernel<kW, E>), static_cast<unsigned>(N), kThreads, row_bytes, stream,
                       logits, losses, targets, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses);
    } else if (words) {
        TRAINER_LAUNCH((classifier_kernel<kW, E>), static_cast<unsigned>(N), kThreads, 0, stream, logits, losses,
                       targets, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses);
    } else {
        TRAINER_LAUNCH((classifier_kernel<1, E>), static_cast<unsigned>(N), kThreads, 0, stream, logits, losses,
                       targets, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void classifier_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, float dloss_scale,
                                 bool compute_grad, float z_loss_multiplier, float* z_losses, bool one_read,
                                 cudaStream_t stream) {
    classifier_launch(logits, losses, targets, N, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses, one_read,
                      stream);
}

void classifier_forward_backward(uint16_t* logits, float* losses, const int32_t* targets, int N, int V,
                                 float dloss_scale, bool compute_grad, float z_loss_multiplier, float* z_losses,
                                 bool one_read, cudaStream_t stream) {
    classifier_launch(logits, losses, targets, N, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses, one_read,
                      stream);
}

}  // namespace trainer::cuda
