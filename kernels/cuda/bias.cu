// A Linear layer's bias gradient on the GPU, the twin of the column sums in cpu::matmul_backward: dbias(N) +=
// the column sums of dout(M, N), fp32 or bf16 (amp_bf16's GEMM gradients, as cuBLASLt's BGRAD epilogues
// would read them).
//
// Two passes, as the norms' parameter gradients (layernorm.cu): fixed chunks of kChunkRows rows give partial
// sums, then the partials of each column are added in chunk order. No atomics; the partition depends on M and
// N only, and each column's sum is taken in the same order whichever lanes own it, so the result is the same
// bits on every run, device and alignment. Both passes spread over the whole GPU: a block per chunk and 256
// columns (8 bf16 or 4 fp32 a lane with 16-byte loads where the rows allow), then a block per 32 columns whose
// 8 warps split the chunks. (One block per 32 columns walking all M rows, as before, put GPT-2's 768 columns
// on 24 of an H100's 132 SMs, each thread with one 2-byte load in flight: latency-bound at a fraction of the
// bandwidth, four times per block.)
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kChunkRows = 128;  // rows per partial sum
constexpr int kWarps = 8;        // a block's warps; warp w of a chunk adds its rows w, w + 8, ... in order
constexpr int kThreads = 32 * kWarps;

// grid (ceil(N / (32 V)), chunks): partial[chunk][c] = the sum of dout[r][c] over the chunk's rows, lane l of
// each warp owning columns 32 V blockIdx.x + V l .. + V - 1.
template <int V, typename T>
__global__ void bias_partials_kernel(float* partial, const T* dout, int M, int N) {
    __shared__ float part[kWarps][V * 32];  // [warp][k * 32 + lane]: column V lane + k of the block's
    const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
    const int c0 = (static_cast<int>(blockIdx.x) * 32 + lane) * V;
    const int chunks = (M + kChunkRows - 1) / kChunkRows;
    // Chunks stride over gridDim.y (capped at 65535); each chunk's sum is the same whatever the grid.
    for (int chunk = static_cast<int>(blockIdx.y); chunk < chunks; chunk += static_cast<int>(gridDim.y)) {
        float s[V];
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] = 0.0f;
        if (c0 < N) {  // V > 1 only where V divides N: a lane's columns are all in or all out
            const int r1 = min(M, (chunk + 1) * kChunkRows);
#pragma unroll 4
            for (int r = chunk * kChunkRows + warp; r < r1; r += kWarps) {
                float f[V];
                load_vec<V>(dout + static_cast<size_t>(r) * N + c0, f);
#pragma unroll
                for (int k = 0; k < V; ++k) s[k] += f[k];
            }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) part[warp][k * 32 + lane] = s[k];
        __syncthreads();
        // Thread t adds column V (t % 32) + t / 32 over the warps, in warp order.
        for (int t = static_cast<int>(threadIdx.x); t < V * 32; t += kThreads) {
            const int c = (static_cast<int>(blockIdx.x) * 32 + t % 32) * V + t / 32;
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) sum += part[w][t];
            if (c < N) partial[static_cast<size_t>(chunk) * N + c] = sum;
        }
        __syncthreads();  // part is written again for the next chunk
    }
}

// grid ceil(n / 32): dst[c] += the sum of partial[k * stride + c] over chunks k, in a fixed order: warp w adds
// chunks w, w + 8, ... of the block's 32 columns (one per lane), then the 8 warps' sums are added in warp order.
__global__ void partial_sums_kernel(float* dst, const float* partial, int chunks, int n, size_t stride) {
    __shared__ float part[kWarps][32];
    const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
    const int c = static_cast<int>(blockIdx.x) * 32 + lane;
    float s = 0.0f;
    if (c < n) {
#pragma unroll 4
        for (int k = warp; k < chunks; k += kWarps) s += partial[static_cast<size_t>(k) * stride + c];
    }
    part[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < n) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += part[w][lane];
        dst[c] += sum;
    }
}

template <typename T>
void bias_gradient_typed(float* dbias, const T* dout, int M, int N, float* scratch, cudaStream_t stream) {
    if (N <= 0 || M <= 0) return;
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    const bool vec = N % kVec == 0 && aligned16(dout);
    const int per_block = 32 * (vec ? kVec : 1);
    const int chunks = (M + kChunkRows - 1) / kChunkRows;
    const dim3 grid(static_cast<unsigned>((N + per_block - 1) / per_block),
                    static_cast<unsigned>(std::min(chunks, 65535)));
    const auto partials = vec ? bias_partials_kernel<kVec, T> : bias_partials_kernel<1, T>;
    TRAINER_LAUNCH(partials, grid, kThreads, 0, stream, scratch, dout, M, N);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    add_partial_sums(dbias, scratch, chunks, N, static_cast<size_t>(N), stream);
}

}  // namespace

void add_partial_sums(float* dst, const float* partial, int chunks, int n, size_t stride, cudaStream_t stream) {
    if (n <= 0) return;
    TRAINER_LAUNCH(partial_sums_kernel, static_cast<unsigned>((n + 31) / 32), kThreads, 0, stream, dst, partial, chunks,
                   n, stride);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

size_t bias_gradient_scratch_floats(int M, int N) {
    return static_cast<size_t>((std::max(M, 0) + kChunkRows - 1) / kChunkRows) * static_cast<size_t>(std::max(N, 0));
}

void bias_gradient(float* dbias, const float* dout, int M, int N, float* scratch, cudaStream_t stream) {
    bias_gradient_typed(dbias, dout, M, N, scratch, stream);
}

void bias_gradient(float* dbias, const uint16_t* dout, int M, int N, float* scratch, cudaStream_t stream) {
    bias_gradient_typed(dbias, dout, M, N, scratch, stream);
}

}  // namespace trainer::cuda
