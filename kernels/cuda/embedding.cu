// Token (+ learned position) embedding on the GPU, the twin of kernels/cpu/embedding.cpp.
// Forward: one thread per output element (coalesced rows). Backward without float atomics and
// deterministic, as llm.c's encoder backward: the micro-batch's rows are grouped by token id once (a
// stable radix sort of (token, row) pairs, then the runs of equal tokens), and one block per distinct
// token adds that token's rows into its dwte row in row order, exactly as the CPU backend does, so the
// two agree bitwise. dwpe: a thread owns one channel of one position and walks that position's rows
// (n = t, t + T, ...) in order.
#include <cub/cub.cuh>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

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

__global__ void iota_kernel(int32_t* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = i;
}

// Block (r, y) adds the rows of run r (token unique[r], rows rows[offset[r] .. offset[r] + count[r]) in
// row order) into its slice of channels of dwte[token]; blocks past the number of runs return. Each thread
// owns W consecutive channels (W = 4: 16-byte loads) and loads four rows ahead before adding them in order,
// so a frequent token's long run streams at memory speed while its sums keep the CPU's order.
template <int W>
__global__ void embedding_backward_runs_kernel(float* dwte, const float* dout, const int32_t* unique,
                                               const int32_t* counts, const int32_t* offsets, const int32_t* rows,
                                               const int32_t* num_runs, int C) {
    const int r = blockIdx.x;
    if (r >= *num_runs) return;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * W;
    if (c >= C) return;
    using Vec = typename std::conditional<W == 4, float4, float>::type;
    const int32_t* run = rows + offsets[r];
    const int n = counts[r];
    Vec* dst = reinterpret_cast<Vec*>(dwte + static_cast<size_t>(unique[r]) * C + c);
    auto row = [&](int k) { return *reinterpret_cast<const Vec*>(dout + static_cast<size_t>(run[k]) * C + c); };
    auto add = [](Vec& a, const Vec& x) {
        if constexpr (W == 4) {
            a.x += x.x, a.y += x.y, a.z += x.z, a.w += x.w;
        } else {
            a += x;
        }
    };
    Vec acc = *dst;
    int k = 0;
    for (; k + 4 <= n; k += 4) {
        const Vec x0 = row(k), x1 = row(k + 1), x2 = row(k + 2), x3 = row(k + 3);
        add(acc, x0), add(acc, x1), add(acc, x2), add(acc, x3);
    }
    for (; k < n; ++k) add(acc, row(k));
    *dst = acc;
}

// The scratch of the grouping: int32 arrays of N (sorted tokens, rows in, rows sorted, unique tokens, run
// counts, run offsets), the run count, then CUB's temporary storage.
struct GroupScratch {
    int32_t *keys_out, *rows_in, *rows_out, *unique, *counts, *offsets, *num_runs;
    void* temp;
    size_t temp_bytes;
};

size_t cub_temp_bytes(int N) {
    size_t sort = 0, rle = 0, scan = 0;
    TRAINER_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, sort, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), N, 0, 31));
    TRAINER_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(
        nullptr, rle, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
        static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), N));
    TRAINER_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), N));
    return std::max(sort, std::max(rle, scan));
}

GroupScratch carve(void* scratch, int N) {
    auto* p = static_cast<int32_t*>(scratch);
    const size_t n = (static_cast<size_t>(N) + 63) / 64 * 64;  // 256-byte aligned arrays
    GroupScratch g;
    g.keys_out = p, g.rows_in = p + n, g.rows_out = p + 2 * n, g.unique = p + 3 * n, g.counts = p + 4 * n;
    g.offsets = p + 5 * n, g.num_runs = p + 6 * n;
    g.temp = p + 6 * n + 64;
    g.temp_bytes = cub_temp_bytes(N);
    return g;
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
    TRAINER_LAUNCH(embedding_forward_kernel, grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream, out, tokens,
                   wte, wpe, N, T, C);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

size_t embedding_backward_scratch_bytes(int N) {
    const size_t n = (static_cast<size_t>(N) + 63) / 64 * 64;
    return (6 * n + 64) * sizeof(int32_t) + cub_temp_bytes(N);
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T, int C,
                        void* scratch, cudaStream_t stream) {
    if (N == 0 || C == 0) return;
    const GroupScratch g = carve(scratch, N);
    TRAINER_LAUNCH(iota_kernel, grid_for(N, kPointwiseBlock), kPointwiseBlock, 0, stream, g.rows_in, N);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    size_t temp = g.temp_bytes;
    // Stable: the rows of one token stay in row order. Token ids are non-negative int32.
    TRAINER_CUDA_CHECK(
        cub::DeviceRadixSort::SortPairs(g.temp, temp, tokens, g.keys_out, g.rows_in, g.rows_out, N, 0, 31, stream));
    // The scan reads all N counts: those past the number of runs are zeroed, not left uninitialised.
    TRAINER_CUDA_CHECK(cudaMemsetAsync(g.counts, 0, static_cast<size_t>(N) * sizeof(int32_t), stream));
    temp = g.temp_bytes;
    TRAINER_CUDA_CHECK(
        cub::DeviceRunLengthEncode::Encode(g.temp, temp, g.keys_out, g.unique, g.counts, g.num_runs, N, stream));
    temp = g.temp_bytes;
    TRAINER_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(g.temp, temp, g.counts, g.offsets, N, stream));
    constexpr unsigned kRunBlock = 256;
    const bool vec = C % 4 == 0 && aligned16(dwte, dout);
    const unsigned per_block = kRunBlock * (vec ? 4 : 1);
    const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((C + per_block - 1) / per_block));
    if (vec) {
        TRAINER_LAUNCH(embedding_backward_runs_kernel<4>, grid, kRunBlock, 0, stream, dwte, dout, g.unique, g.counts,
                       g.offsets, g.rows_out, g.num_runs, C);
    } else {
        TRAINER_LAUNCH(embedding_backward_runs_kernel<1>, grid, kRunBlock, 0, stream, dwte, dout, g.unique, g.counts,
                       g.offsets, g.rows_out, g.num_runs, C);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
    if (dwpe != nullptr) {
        constexpr unsigned kBlock = 128;
        const unsigned cblocks = static_cast<unsigned>((C + kBlock - 1) / kBlock);
        TRAINER_LAUNCH(embedding_backward_wpe_kernel, dim3(cblocks, static_cast<unsigned>(T < 65535 ? T : 65535)),
                       kBlock, 0, stream, dwpe, dout, N, T, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
    }
}

}  // namespace trainer::cuda
