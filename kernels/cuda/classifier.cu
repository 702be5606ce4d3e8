// Fused softmax + cross-entropy + dlogits on the GPU, in place over (N, V) logits, the twin of
// kernels/cpu/classifier.cpp: one block per row; pass 1 keeps each thread's online (max, sum of
// exponentials) over its strided columns and merges them in a fixed tree (deterministic), giving the
// row's logsumexp; pass 2 overwrites the row with (softmax - onehot(target)) * dloss_scale. A row is
// read twice and written once; the full softmax never exists separately. Targets < 0 are ignored (loss
// 0, gradient 0); targets >= V are the caller's to refuse (the CPU backend checks them on the host). The
// z-loss scales pass 2's softmax term by 1 + 2 z lse, as the CPU twin does (exactly 1 without it).
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

constexpr unsigned kThreads = 512;

// Merges two online-softmax partials (max m, sum s of exp(x - m)).
__device__ void merge(float& m, float& s, float m2, float s2) {
    if (m2 > m) {
        s = s * expf(m - m2) + s2;
        m = m2;
    } else if (m2 > -FLT_MAX) {
        s += s2 * expf(m2 - m);
    }
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
        if (threadIdx.x == 0) {
            losses[n] = 0.0f;
            if (z_losses != nullptr) z_losses[n] = 0.0f;
        }
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
    const float lse = sm[0] + logf(ss[0]);
    if (threadIdx.x == 0) {
        losses[n] = lse - load_as_float(row[target]);
        if (z_losses != nullptr) z_losses[n] = z_loss_multiplier * lse * lse;
    }
    __syncthreads();  // thread 0 has read row[target] before pass 2 overwrites it
    if (!compute_grad) return;
    const float softmax_scale =
        z_loss_multiplier != 0.0f ? dloss_scale * (1.0f + 2.0f * z_loss_multiplier * lse) : dloss_scale;
    for (int c = threadIdx.x * W; c < V; c += kThreads * W) {
        float x[W];
        load_vec<W>(row + c, x);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            x[k] = expf(x[k] - lse) * softmax_scale - (c + k == target ? dloss_scale : 0.0f);
        }
        store_vec<W>(row + c, x);
    }
}

template <typename E>
void classifier_launch(E* logits, float* losses, const int32_t* targets, int N, int V, float dloss_scale,
                       bool compute_grad, float z_loss_multiplier, float* z_losses, cudaStream_t stream) {
    if (N == 0) return;
    constexpr int kW = static_cast<int>(16 / sizeof(E));  // one 16-byte word
    if (V % kW == 0 && aligned16(logits)) {
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
                                 bool compute_grad, float z_loss_multiplier, float* z_losses, cudaStream_t stream) {
    classifier_launch(logits, losses, targets, N, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses, stream);
}

void classifier_forward_backward_bf16(uint16_t* logits, float* losses, const int32_t* targets, int N, int V,
                                      float dloss_scale, bool compute_grad, float z_loss_multiplier, float* z_losses,
                                      cudaStream_t stream) {
    classifier_launch(logits, losses, targets, N, V, dloss_scale, compute_grad, z_loss_multiplier, z_losses, stream);
}

}  // namespace trainer::cuda
