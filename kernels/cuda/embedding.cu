// Token (+ learned position) embedding on the GPU, the twin of kernels/cpu/embedding.cpp.
// Forward: one thread per output element (coalesced rows). Backward without float atomics and
// deterministic: a thread owns one channel of one token bucket (token % kBuckets) and walks every row
// in order, adding only the rows of its bucket; every dwte element thus sums its contributions in row
// order, exactly as the CPU backend does, so the two agree bitwise. dwpe likewise: a thread owns one
// channel of one position and walks that position's rows (n = t, t + T, ...) in order.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kBuckets = 32;

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N,
                                         int T, int C) {
    const size_t total = static_cast<size_t>(N) * C, stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        const size_t n = i / C, c = i % C;
        float v = wte[static_cast<size_t>(tokens[n]) * C + c];
        if (wpe != nullptr) v += wpe[(n % T) * C + c];
        out[i] = v;
    }
}

// grid (ceil(C / blockDim.x), kBuckets): thread (c, bucket).
__global__ void embedding_backward_wte_kernel(float* dwte, const float* dout, const int32_t* tokens, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int bucket = blockIdx.y;
    if (c >= C) return;
    for (int n = 0; n < N; ++n) {
        const int tok = tokens[n];  // the same address across the warp: one broadcast load
        if (tok % kBuckets != bucket) continue;
        dwte[static_cast<size_t>(tok) * C + c] += dout[static_cast<size_t>(n) * C + c];
    }
}

// grid (ceil(C / blockDim.x), min(T, 65535)): thread (c, t) for t striding over gridDim.y.
__global__ void embedding_backward_wpe_kernel(float* dwpe, const float* dout, int N, int T, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        float acc = dwpe[static_cast<size_t>(t) * C + c];
        for (int n = t; n < N; n += T) acc += dout[static_cast<size_t>(n) * C + c];
        dwpe[static_cast<size_t>(t) * C + c] = acc;
    }
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T, int C,
                       cudaStream_t stream) {
    const size_t total = static_cast<size_t>(N) * C;
    if (total == 0) return;
    embedding_forward_kernel<<<grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(out, tokens, wte, wpe, N,
                                                                                               T, C);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T, int C,
                        cudaStream_t stream) {
    if (N == 0 || C == 0) return;
    constexpr unsigned kBlock = 128;
    const unsigned cblocks = static_cast<unsigned>((C + kBlock - 1) / kBlock);
    embedding_backward_wte_kernel<<<dim3(cblocks, kBuckets), kBlock, 0, stream>>>(dwte, dout, tokens, N, C);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    if (dwpe != nullptr) {
        embedding_backward_wpe_kernel<<<dim3(cblocks, static_cast<unsigned>(T < 65535 ? T : 65535)), kBlock, 0,
                                        stream>>>(dwpe, dout, N, T, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
    }
}

}  // namespace trainer::cuda
