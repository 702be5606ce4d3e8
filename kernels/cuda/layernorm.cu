// LayerNorm over the last dimension on the GPU (affine, weight only, or non-parametric), the twin of
// kernels/cpu/layernorm.cpp, with the same two-pass (centred) variance and the same backward formula.
// Forward and the dinp part of backward: one warp per row, lanes striding over the channels, warp-shuffle
// sums. dweight/dbias: fixed chunks of kRowsPerChunk rows give partial sums (a thread per channel walks
// the chunk's rows in order), then one thread per channel adds the partials in chunk order: no atomics,
// the same result on every run.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kRowsPerChunk = 32;
constexpr unsigned kWarpsPerBlock = 8;

__device__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// One warp per row; each lane takes W consecutive channels at a time (W = 8 with 128-bit accesses where
// the rows and the affine vectors allow, else 1).
template <int W, typename Out>
__global__ void layernorm_forward_kernel(Out* out, float* mean, float* rstd, const float* inp, const float* weight,
                                         const float* bias, int N, int C, float eps) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (n >= N) return;
    const float* x = inp + static_cast<size_t>(n) * C;
    Out* o = out + static_cast<size_t>(n) * C;
    float s = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        float v[W];
        load_vec<W>(x + c, v);
#pragma unroll
        for (int k = 0; k < W; ++k) s += v[k];
    }
    const float m = warp_sum(s) / static_cast<float>(C);
    float sq = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        float v[W];
        load_vec<W>(x + c, v);
#pragma unroll
        for (int k = 0; k < W; ++k) sq += (v[k] - m) * (v[k] - m);
    }
    const float rs = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(C) + eps);
    if (lane == 0) mean[n] = m, rstd[n] = rs;
    for (int c = lane * W; c < C; c += 32 * W) {
        float v[W], wt[W], b[W];
        load_vec<W>(x + c, v);
        if (weight != nullptr) load_vec<W>(weight + c, wt);
        if (bias != nullptr) load_vec<W>(bias + c, b);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            v[k] = (v[k] - m) * rs;
            if (weight != nullptr) v[k] *= wt[k];
            if (bias != nullptr) v[k] += b[k];
        }
        store_vec<W>(o + c, v);
    }
}

template <int W>
__global__ void layernorm_backward_dinp_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                               const float* mean, const float* rstd, int N, int C) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (n >= N) return;
    const float* x = inp + static_cast<size_t>(n) * C;
    const float* g = dout + static_cast<size_t>(n) * C;
    float* dx = dinp + static_cast<size_t>(n) * C;
    const float m = mean[n], rs = rstd[n];
    // dx += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dout * weight.
    float sum_dn = 0.0f, sum_dn_norm = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        float gv[W], xv[W], wt[W];
        load_vec<W>(g + c, gv);
        load_vec<W>(x + c, xv);
        if (weight != nullptr) load_vec<W>(weight + c, wt);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float dn = weight != nullptr ? gv[k] * wt[k] : gv[k];
            sum_dn += dn;
            sum_dn_norm += dn * (xv[k] - m) * rs;
        }
    }
    const float mean_dn = warp_sum(sum_dn) / static_cast<float>(C);
    const float mean_dn_norm = warp_sum(sum_dn_norm) / static_cast<float>(C);
    for (int c = lane * W; c < C; c += 32 * W) {
        float gv[W], xv[W], wt[W], d[W];
        load_vec<W>(g + c, gv);
        load_vec<W>(x + c, xv);
        load_vec<W>(dx + c, d);
        if (weight != nullptr) load_vec<W>(weight + c, wt);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float dn = weight != nullptr ? gv[k] * wt[k] : gv[k];
            const float norm = (xv[k] - m) * rs;
            d[k] += rs * (dn - mean_dn - norm * mean_dn_norm);
        }
        store_vec<W>(dx + c, d);
    }
}

// The vector width for rows of C channels: 8 where every row and vector is whole 16-byte words.
constexpr int kLnVec = 8;
template <typename... P>
bool layernorm_vec(int C, const P*... p) {
    return C % kLnVec == 0 && ((p == nullptr || aligned16(p)) && ...);
}

// The dinp part and the chunk partials of dweight/dbias in one pass over dout and inp (rows of up to
// 32 x W x G channels): block `chunk` owns the chunk's kRowsPerChunk rows, each warp kRowsPerChunk /
// kWarpsPerBlock of them in order; each lane sums its channels' terms over its warp's rows in registers,
// and the warps' sums are added in warp order through shared memory. Deterministic; the partials have the
// layout of layernorm_backward_partials_kernel's.
template <int W, int G>
__global__ void layernorm_backward_fused_kernel(float* dinp, float* partial, const float* dout, const float* inp,
                                                const float* weight, const float* mean, const float* rstd, int N,
                                                int C) {
    constexpr int kRowsPerWarp = kRowsPerChunk / kWarpsPerBlock;
    __shared__ float red[kWarpsPerBlock][32 * W];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int chunk = blockIdx.x;
    float dw[G][W], db[G][W];
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
#pragma unroll
        for (int k = 0; k < W; ++k) dw[gi][k] = 0.0f, db[gi][k] = 0.0f;
    }
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int n = chunk * kRowsPerChunk + warp * kRowsPerWarp + r;
        if (n >= N) break;
        const float* x = inp + static_cast<size_t>(n) * C;
        const float* g = dout + static_cast<size_t>(n) * C;
        float* dx = dinp + static_cast<size_t>(n) * C;
        const float m = mean[n], rs = rstd[n];
        float sum_dn = 0.0f, sum_dn_norm = 0.0f;
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            const int c = (gi * 32 + lane) * W;
            if (c >= C) break;
            float gv[W], xv[W], wt[W];
            load_vec<W>(g + c, gv);
            load_vec<W>(x + c, xv);
            if (weight != nullptr) load_vec<W>(weight + c, wt);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                const float norm = (xv[k] - m) * rs;
                const float dn = weight != nullptr ? gv[k] * wt[k] : gv[k];
                sum_dn += dn;
                sum_dn_norm += dn * norm;
                dw[gi][k] += gv[k] * norm;
                db[gi][k] += gv[k];
            }
        }
        const float mean_dn = warp_sum(sum_dn) / static_cast<float>(C);
        const float mean_dn_norm = warp_sum(sum_dn_norm) / static_cast<float>(C);
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            const int c = (gi * 32 + lane) * W;
            if (c >= C) break;
            float gv[W], xv[W], wt[W], d[W];
            load_vec<W>(g + c, gv);
            load_vec<W>(x + c, xv);
            load_vec<W>(dx + c, d);
            if (weight != nullptr) load_vec<W>(weight + c, wt);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                const float dn = weight != nullptr ? gv[k] * wt[k] : gv[k];
                d[k] += rs * (dn - mean_dn - (xv[k] - m) * rs * mean_dn_norm);
            }
            store_vec<W>(dx + c, d);
        }
    }
    // The warps' sums, added in warp order: group gi of dweight, then of dbias.
    for (int gi = 0; gi < G; ++gi) {
        for (int which = 0; which < 2; ++which) {
#pragma unroll
            for (int k = 0; k < W; ++k) red[warp][lane * W + k] = which == 0 ? dw[gi][k] : db[gi][k];
            __syncthreads();
            const int t = static_cast<int>(threadIdx.x), c = gi * 32 * W + t;
            if (t < 32 * W && c < C) {
                float sum = 0.0f;
                for (int w = 0; w < static_cast<int>(kWarpsPerBlock); ++w) sum += red[w][t];
                partial[static_cast<size_t>(chunk) * 2 * C + static_cast<size_t>(which) * C + c] = sum;
            }
            __syncthreads();
        }
    }
}

// grid (ceil(C / blockDim.x), chunks): partial[chunk] = (sum dout * norm, sum dout) over the chunk's rows.
__global__ void layernorm_backward_partials_kernel(float* partial, const float* dout, const float* inp,
                                                   const float* mean, const float* rstd, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    // Chunks stride over gridDim.y (capped at 65535); each chunk's sum is the same whatever the grid.
    for (int chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
        float dw = 0.0f, db = 0.0f;
        const int n1 = min(N, (chunk + 1) * kRowsPerChunk);
        for (int n = chunk * kRowsPerChunk; n < n1; ++n) {
            const float g = dout[static_cast<size_t>(n) * C + c];
            dw += g * (inp[static_cast<size_t>(n) * C + c] - mean[n]) * rstd[n];
            db += g;
        }
        partial[static_cast<size_t>(chunk) * 2 * C + c] = dw;
        partial[static_cast<size_t>(chunk) * 2 * C + C + c] = db;
    }
}

__global__ void layernorm_backward_params_kernel(float* dweight, float* dbias, const float* partial, int chunks,
                                                 int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (int k = 0; k < chunks; ++k) {
        dw += partial[static_cast<size_t>(k) * 2 * C + c];
        db += partial[static_cast<size_t>(k) * 2 * C + C + c];
    }
    if (dweight != nullptr) dweight[c] += dw;
    if (dbias != nullptr) dbias[c] += db;
}

}  // namespace

size_t layernorm_backward_scratch_floats(int N, int C) {
    return static_cast<size_t>((N + kRowsPerChunk - 1) / kRowsPerChunk) * 2 * static_cast<size_t>(C);
}

template <typename Out>
void layernorm_forward_launch(Out* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, float eps, cudaStream_t stream) {
    if (N == 0) return;
    const unsigned blocks = (static_cast<unsigned>(N) + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (layernorm_vec(C, inp, weight, bias, out)) {
        layernorm_forward_kernel<kLnVec, Out>
            <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C, eps);
    } else {
        layernorm_forward_kernel<1, Out>
            <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C, eps);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, float eps, cudaStream_t stream) {
    layernorm_forward_launch(out, mean, rstd, inp, weight, bias, N, C, eps, stream);
}

void layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                            const float* bias, int N, int C, float eps, cudaStream_t stream) {
    layernorm_forward_launch(out, mean, rstd, inp, weight, bias, N, C, eps, stream);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        cudaStream_t stream) {
    if (N == 0) return;
    const int chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    constexpr int kFusedGroups = 4;  // rows of up to 32 x 8 x 4 = 1024 channels (GPT-2's 768)
    if ((dweight != nullptr || dbias != nullptr) && C <= 32 * kLnVec * kFusedGroups &&
        layernorm_vec(C, dinp, dout, inp, weight)) {
        // One pass for dinp and the partials (what an affine LayerNorm needs), then the partials added.
        layernorm_backward_fused_kernel<kLnVec, kFusedGroups>
            <<<static_cast<unsigned>(chunks), 32 * kWarpsPerBlock, 0, stream>>>(dinp, scratch, dout, inp, weight, mean,
                                                                                rstd, N, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
        constexpr unsigned kBlock = 128;
        const unsigned cblocks = static_cast<unsigned>((C + kBlock - 1) / kBlock);
        layernorm_backward_params_kernel<<<cblocks, kBlock, 0, stream>>>(dweight, dbias, scratch, chunks, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
        return;
    }
    const unsigned blocks = (static_cast<unsigned>(N) + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (layernorm_vec(C, dinp, dout, inp, weight)) {
        layernorm_backward_dinp_kernel<kLnVec>
            <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    } else {
        layernorm_backward_dinp_kernel<1>
            <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
    if (dweight == nullptr && dbias == nullptr) return;
    constexpr unsigned kBlock = 128;
    const unsigned cblocks = static_cast<unsigned>((C + kBlock - 1) / kBlock);
    layernorm_backward_partials_kernel<<<dim3(cblocks, static_cast<unsigned>(std::min(chunks, 65535))), kBlock, 0,
                                         stream>>>(scratch, dout, inp, mean, rstd, N, C);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    layernorm_backward_params_kernel<<<cblocks, kBlock, 0, stream>>>(dweight, dbias, scratch, chunks, C);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
