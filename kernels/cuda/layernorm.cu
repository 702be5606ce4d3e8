// The norms over the last dimension on the GPU, the twins of kernels/cpu/layernorm.cpp: LayerNorm (affine,
// weight only, or non-parametric) and RMSNorm, as the pre-norm (layernorm_*), after a sublayer before the
// residual add (norm_residual_*: OLMo-2's norm_after) and on q and k inside qkv (qk_norm_*: QK-norm), with
// the same two-pass (centred) variance and the same backward formula; RMSNorm is the same code with the
// mean fixed at 0 and the mean of the gradient term dropped (kRms). One kernel per direction serves every
// use: rows may lie apart (ld_*, q and k rows are 3C apart in qkv), the input and output in fp32 or bf16.
// Forward and the dinp part of backward: one warp per row, lanes striding over the channels, warp-shuffle
// sums. dweight/dbias: fixed chunks of kRowsPerChunk rows give partial sums (a thread per channel walks
// the chunk's rows in order), then bias.cu's add_partial_sums adds each channel's partials in a fixed order:
// no atomics, the same result on every run. The backward may run in place (dinp == dout, QK-norm): every lane reads
// the dout of its own channels before it writes their dinp, and the partials are taken first.
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kRowsPerChunk = 32;
template <int V>
using Int = std::integral_constant<int, V>;
constexpr unsigned kWarpsPerBlock = 8;

__device__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// A lane's channels of one row, W consecutive channels at a time (lane l takes channels l W .., then 32 W further,
// and so on): with G > 0 (rows of up to 32 W G channels) held in registers, read once when made; with G = 0 (any
// row) read from `src` again at every pass (from L1 after the first, where the rows of the SM's warps fit). Each
// pass visits the groups in the same order either way, so the sums over them have the same bits.
template <int W, int G, typename T>
struct LaneRow {
    const T* src;
    int C, lane;
    float held[G > 0 ? G : 1][W];
    __device__ LaneRow(const T* src_, int C_, int lane_) : src(src_), C(C_), lane(lane_) {
        if constexpr (G > 0) {
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                if ((gi * 32 + lane) * W < C) load_vec<W>(src + (gi * 32 + lane) * W, held[gi]);
            }
        }
    }
    // f(c, v) for each group: c its first channel, v its W values.
    template <typename F>
    __device__ void each(F f) {
        if constexpr (G > 0) {
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                if ((gi * 32 + lane) * W < C) f((gi * 32 + lane) * W, held[gi]);
            }
        } else {
            for (int c = lane * W; c < C; c += 32 * W) {
                float v[W];
                load_vec<W>(src + c, v);
                f(c, v);
            }
        }
    }
};

// One warp per row; each lane takes W consecutive channels at a time (W = 8 with 128-bit accesses where
// the rows and the affine vectors allow, else 1). out = resid + y where resid is given (rows ld_out apart).
// The row is a LaneRow: with G > 0 read once, where with G = 0 the mean, the variance and the output each read it.
// amax (nullable): the largest |y| as stored, over the whole launch (common.cuh's warp_amax).
template <int W, int G, bool kRms, typename In, typename Out>
__global__ void norm_forward_kernel(Out* out, int ld_out, const float* resid, float* mean, float* rstd, const In* inp,
                                    int ld_in, const float* weight, const float* bias, int N, int C, float eps,
                                    float* amax) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (n >= N) return;
    const In* x = inp + static_cast<size_t>(n) * ld_in;
    Out* o = out + static_cast<size_t>(n) * ld_out;
    const float* r = resid != nullptr ? resid + static_cast<size_t>(n) * ld_out : nullptr;
    LaneRow<W, G, In> row(x, C, lane);
    float m = 0.0f;
    if (!kRms) {
        float s = 0.0f;
        row.each([&](int, const float(&v)[W]) {
#pragma unroll
            for (int k = 0; k < W; ++k) s += v[k];
        });
        m = warp_sum(s) / static_cast<float>(C);
    }
    float sq = 0.0f;
    row.each([&](int, const float(&v)[W]) {
#pragma unroll
        for (int k = 0; k < W; ++k) sq += (v[k] - m) * (v[k] - m);
    });
    const float rs = 1.0f / sqrtf(warp_sum(sq) / static_cast<float>(C) + eps);
    if (lane == 0) {
        if (mean != nullptr) mean[n] = m;
        rstd[n] = rs;
    }
    float ymax = 0.0f;
    row.each([&](int c, const float(&v)[W]) {
        float y[W], wt[W], b[W], rv[W];
        if (weight != nullptr) load_vec<W>(weight + c, wt);
        if (bias != nullptr) load_vec<W>(bias + c, b);
        if (r != nullptr) load_vec<W>(r + c, rv);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            y[k] = (v[k] - m) * rs;
            if (weight != nullptr) y[k] *= wt[k];
            if (bias != nullptr) y[k] += b[k];
            if (r != nullptr) y[k] = rv[k] + y[k];
            ymax = max_keeping_nan(ymax, fabsf(y[k]));
        }
        store_vec<W>(o + c, y);
    });
    if (amax != nullptr) warp_amax(amax, stored_amax<Out>(ymax));  // the whole warp holds row n
}

// One row's input gradient at the W channels from c: dx (+)= rstd * (dn - mean_dn - norm * mean_dn_norm), dn =
// dout * weight, norm = (x - m) * rstd; the element update both norm backwards share.
template <int W, typename In, typename G, typename D>
__device__ __forceinline__ void norm_dinp_update(D* dx, const G* g, const In* x, const float* weight, int c, float m,
                                                 float rs, float mean_dn, float mean_dn_norm, bool accumulate) {
    float gv[W], xv[W], wt[W], d[W] = {};
    load_vec<W>(g + c, gv);
    load_vec<W>(x + c, xv);
    if (accumulate) load_vec<W>(dx + c, d);
    if (weight != nullptr) load_vec<W>(weight + c, wt);
#pragma unroll
    for (int k = 0; k < W; ++k) {
        const float dn = weight != nullptr ? gv[k] * wt[k] : gv[k];
        const float norm = (xv[k] - m) * rs;
        d[k] += rs * (dn - mean_dn - norm * mean_dn_norm);
    }
    store_vec<W>(dx + c, d);
}

// dinp (+)= rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dout * weight (RMSNorm: no
// mean(dnorm) term); rows of dinp, dout and inp ld_dinp, ld_dout and ld_in apart.
template <int W, bool kRms, typename In, typename G, typename D>
__global__ void norm_backward_dinp_kernel(D* dinp, int ld_dinp, bool accumulate, const G* dout, int ld_dout,
                                          const In* inp, int ld_in, const float* weight, const float* mean,
                                          const float* rstd, int N, int C) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (n >= N) return;
    const In* x = inp + static_cast<size_t>(n) * ld_in;
    const G* g = dout + static_cast<size_t>(n) * ld_dout;
    D* dx = dinp + static_cast<size_t>(n) * ld_dinp;
    const float m = kRms ? 0.0f : mean[n], rs = rstd[n];
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
    const float mean_dn = kRms ? 0.0f : warp_sum(sum_dn) / static_cast<float>(C);
    const float mean_dn_norm = warp_sum(sum_dn_norm) / static_cast<float>(C);
    for (int c = lane * W; c < C; c += 32 * W) {
        norm_dinp_update<W>(dx, g, x, weight, c, m, rs, mean_dn, mean_dn_norm, accumulate);
    }
}

// dinp += rstd * (dout - mean(dout) - y * mean(dout * y)) from the output y of a norm without weight or bias
// (RMSNorm: no mean(dout) term): norm_backward_dinp_kernel's formula with y read (fp32 or bf16), not
// recomputed from the input and mean. One warp per row.
// dout is a LaneRow (G > 0: read once, not for each of the two passes); y is read in both.
template <int W, int G, bool kRms, typename Y>
__global__ void norm_backward_from_output_kernel(float* dinp, const float* dout, const Y* out, const float* rstd, int N,
                                                 int C) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (n >= N) return;
    const size_t row = static_cast<size_t>(n) * C;
    LaneRow<W, G, float> g(dout + row, C, lane);
    const Y* y = out + row;
    float* dx = dinp + row;
    const float rs = rstd[n];
    float sum_g = 0.0f, sum_gy = 0.0f;
    g.each([&](int c, const float(&gv)[W]) {
        float yv[W];
        load_vec<W>(y + c, yv);
#pragma unroll
        for (int k = 0; k < W; ++k) sum_g += gv[k], sum_gy += gv[k] * yv[k];
    });
    const float mean_g = kRms ? 0.0f : warp_sum(sum_g) / static_cast<float>(C);
    const float mean_gy = warp_sum(sum_gy) / static_cast<float>(C);
    g.each([&](int c, const float(&gv)[W]) {
        float yv[W], d[W];
        load_vec<W>(y + c, yv);
        load_vec<W>(dx + c, d);
#pragma unroll
        for (int k = 0; k < W; ++k) d[k] += rs * (gv[k] - mean_g - yv[k] * mean_gy);
        store_vec<W>(dx + c, d);
    });
}

// The vector width for rows of C channels: 8 where every row and vector is whole 16-byte words.
constexpr int kLnVec = 8;
template <typename... P>
bool norm_vec(int C, std::initializer_list<int> lds, const P*... p) {
    bool ok = C % kLnVec == 0 && ((p == nullptr || aligned16(p)) && ...);
    for (int ld : lds) ok = ok && ld % kLnVec == 0;
    return ok;
}

// run(Int<W>, Int<G>) with the LaneRow shape for rows of C channels: held in registers up to 32 x 8 x 8 = 2,048
// channels (GPT-2's 768 in 4 groups of 8 a lane, OLMo-1B's 2,048 in 8), read at each pass beyond or unvectorised.
template <typename Run>
void held_groups(bool vec, int C, Run run) {
    if (!vec) {
        run(Int<1>{}, Int<0>{});
    } else if (C <= 32 * kLnVec * 4) {
        run(Int<kLnVec>{}, Int<4>{});
    } else if (C <= 32 * kLnVec * 8) {
        run(Int<kLnVec>{}, Int<8>{});
    } else {
        run(Int<kLnVec>{}, Int<0>{});
    }
}

// The dinp part and the chunk partials of dweight/dbias in one pass over dout and inp (rows of up to
// 32 x W x G channels): block `chunk` owns the chunk's kRowsPerChunk rows, each warp kRowsPerChunk /
// kWarpsPerBlock of them in order; each lane sums its channels' terms over its warp's rows in registers,
// and the warps' sums are added in warp order through shared memory. Deterministic; the partials have the
// layout of norm_backward_partials_kernel's; without kBias dbias's half is left unwritten (8 groups of dweight's
// terms a lane fit the registers where 8 of both would not: OLMo-2's 2,048 channels, weight only).
template <int W, int Gr, bool kBias, bool kRms, typename In, typename G, typename D>
__global__ void norm_backward_fused_kernel(D* dinp, int ld_dinp, bool accumulate, float* partial, const G* dout,
                                           int ld_dout, const In* inp, int ld_in, const float* weight,
                                           const float* mean, const float* rstd, int N, int C) {
    constexpr int kRowsPerWarp = kRowsPerChunk / kWarpsPerBlock;
    __shared__ float red[kWarpsPerBlock][32 * W];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int chunk = blockIdx.x;
    float dw[Gr][W], db[kBias ? Gr : 1][W];
#pragma unroll
    for (int gi = 0; gi < Gr; ++gi) {
#pragma unroll
        for (int k = 0; k < W; ++k) {
            dw[gi][k] = 0.0f;
            if constexpr (kBias) db[gi][k] = 0.0f;
        }
    }
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int n = chunk * kRowsPerChunk + warp * kRowsPerWarp + r;
        if (n >= N) break;
        const In* x = inp + static_cast<size_t>(n) * ld_in;
        const G* g = dout + static_cast<size_t>(n) * ld_dout;
        D* dx = dinp + static_cast<size_t>(n) * ld_dinp;
        const float m = kRms ? 0.0f : mean[n], rs = rstd[n];
        float sum_dn = 0.0f, sum_dn_norm = 0.0f;
#pragma unroll
        for (int gi = 0; gi < Gr; ++gi) {
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
                if constexpr (kBias) db[gi][k] += gv[k];
            }
        }
        const float mean_dn = kRms ? 0.0f : warp_sum(sum_dn) / static_cast<float>(C);
        const float mean_dn_norm = warp_sum(sum_dn_norm) / static_cast<float>(C);
#pragma unroll
        for (int gi = 0; gi < Gr; ++gi) {
            const int c = (gi * 32 + lane) * W;
            if (c >= C) break;
            norm_dinp_update<W>(dx, g, x, weight, c, m, rs, mean_dn, mean_dn_norm, accumulate);
        }
    }
    // The warps' sums, added in warp order: group gi of dweight, then of dbias.
    for (int gi = 0; gi < Gr; ++gi) {
        for (int which = 0; which < (kBias ? 2 : 1); ++which) {
#pragma unroll
            for (int k = 0; k < W; ++k) red[warp][lane * W + k] = which == 0 ? dw[gi][k] : db[kBias ? gi : 0][k];
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
template <bool kRms, typename In, typename G>
__global__ void norm_backward_partials_kernel(float* partial, const G* dout, int ld_dout, const In* inp, int ld_in,
                                              const float* mean, const float* rstd, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    // Chunks stride over gridDim.y (capped at 65535); each chunk's sum is the same whatever the grid.
    for (int chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
        float dw = 0.0f, db = 0.0f;
        const int n1 = min(N, (chunk + 1) * kRowsPerChunk);
        for (int n = chunk * kRowsPerChunk; n < n1; ++n) {
            const float g = load_as_float(dout[static_cast<size_t>(n) * ld_dout + c]);
            const float m = kRms ? 0.0f : mean[n];
            dw += g * (load_as_float(inp[static_cast<size_t>(n) * ld_in + c]) - m) * rstd[n];
            db += g;
        }
        partial[static_cast<size_t>(chunk) * 2 * C + c] = dw;
        partial[static_cast<size_t>(chunk) * 2 * C + C + c] = db;
    }
}

// dweight += the chunks' partials of sum dout * norm, dbias += those of sum dout (partial rows of 2C: dweight's C,
// then dbias's), by bias.cu's second pass. Before, one thread per channel added all the chunks in turn (GPT-2: 6
// blocks, 512 dependent loads a thread from L2), the likely cause of LayerNorm's backward at 44% of its memory
// roofline on an H200 (bench-kernels, 2026-11-26; the two passes not timed apart).
void norm_backward_params(float* dweight, float* dbias, const float* partial, int chunks, int C, cudaStream_t stream) {
    const size_t stride = static_cast<size_t>(2) * C;
    if (dweight != nullptr) add_partial_sums(dweight, partial, chunks, C, stride, stream);
    if (dbias != nullptr) add_partial_sums(dbias, partial + C, chunks, C, stride, stream);
}

template <typename In, typename Out>
void norm_forward_launch(Out* out, int ld_out, const float* resid, float* mean, float* rstd, const In* inp, int ld_in,
                         const float* weight, const float* bias, int N, int C, float eps, bool rms, cudaStream_t stream,
                         float* amax = nullptr) {
    zero_amax(amax, stream);
    if (N == 0) return;
    const unsigned blocks = (static_cast<unsigned>(N) + kWarpsPerBlock - 1) / kWarpsPerBlock;
    const bool vec = norm_vec(C, {ld_out, ld_in}, inp, weight, bias, out, resid);
    const auto launch = [&](auto kernel) {
        TRAINER_LAUNCH(kernel, blocks, 32 * kWarpsPerBlock, 0, stream, out, ld_out, resid, mean, rstd, inp, ld_in,
                       weight, bias, N, C, eps, amax);
    };
    const auto run = [&](auto w, auto g) {
        constexpr int kW = decltype(w)::value, kG = decltype(g)::value;
        rms ? launch(norm_forward_kernel<kW, kG, true, In, Out>) : launch(norm_forward_kernel<kW, kG, false, In, Out>);
    };
    held_groups(vec, C, run);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <bool kRms, typename In, typename G, typename D>
void norm_backward_typed(D* dinp, int ld_dinp, bool accumulate, float* dweight, float* dbias, const G* dout,
                         int ld_dout, const In* inp, int ld_in, const float* weight, const float* mean,
                         const float* rstd, int N, int C, float* scratch, cudaStream_t stream) {
    const int chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    const bool vec = norm_vec(C, {ld_dinp, ld_dout, ld_in}, dinp, dout, inp, weight);
    constexpr unsigned kBlock = 128;
    const unsigned cblocks = static_cast<unsigned>((C + kBlock - 1) / kBlock);
    const bool params = dweight != nullptr || dbias != nullptr;
    // One pass for dinp and the partials (what a norm with parameters needs), then the partials added: rows of up
    // to 32 x 8 x 4 = 1,024 channels (GPT-2's 768), or 2,048 without a bias (OLMo-2's RMSNorm and QK-norm).
    const auto fused = [&](auto kernel) {
        TRAINER_LAUNCH(kernel, static_cast<unsigned>(chunks), 32 * kWarpsPerBlock, 0, stream, dinp, ld_dinp, accumulate,
                       scratch, dout, ld_dout, inp, ld_in, weight, mean, rstd, N, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
        norm_backward_params(dweight, dbias, scratch, chunks, C, stream);
    };
    if (params && vec && C <= 32 * kLnVec * 4) {
        return fused(norm_backward_fused_kernel<kLnVec, 4, true, kRms, In, G, D>);
    }
    if (params && vec && dbias == nullptr && C <= 32 * kLnVec * 8) {
        return fused(norm_backward_fused_kernel<kLnVec, 8, false, kRms, In, G, D>);
    }
    if (params) {  // first: in place, dinp overwrites the dout they read
        const auto partials = norm_backward_partials_kernel<kRms, In, G>;
        TRAINER_LAUNCH(partials, dim3(cblocks, static_cast<unsigned>(std::min(chunks, 65535))), kBlock, 0, stream,
                       scratch, dout, ld_dout, inp, ld_in, mean, rstd, N, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
        norm_backward_params(dweight, dbias, scratch, chunks, C, stream);
    }
    const unsigned blocks = (static_cast<unsigned>(N) + kWarpsPerBlock - 1) / kWarpsPerBlock;
    const auto dinp_kernel =
        vec ? norm_backward_dinp_kernel<kLnVec, kRms, In, G, D> : norm_backward_dinp_kernel<1, kRms, In, G, D>;
    TRAINER_LAUNCH(dinp_kernel, blocks, 32 * kWarpsPerBlock, 0, stream, dinp, ld_dinp, accumulate, dout, ld_dout, inp,
                   ld_in, weight, mean, rstd, N, C);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename In, typename G, typename D>
void norm_backward_launch(D* dinp, int ld_dinp, bool accumulate, float* dweight, float* dbias, const G* dout,
                          int ld_dout, const In* inp, int ld_in, const float* weight, const float* mean,
                          const float* rstd, int N, int C, bool rms, float* scratch, cudaStream_t stream) {
    if (N == 0) return;
    if (rms) {
        norm_backward_typed<true>(dinp, ld_dinp, accumulate, dweight, dbias, dout, ld_dout, inp, ld_in, weight, mean,
                                  rstd, N, C, scratch, stream);
    } else {
        norm_backward_typed<false>(dinp, ld_dinp, accumulate, dweight, dbias, dout, ld_dout, inp, ld_in, weight, mean,
                                   rstd, N, C, scratch, stream);
    }
}

template <typename Y>
void norm_backward_from_output_launch(float* dinp, const float* dout, const Y* out, const float* rstd, int N, int C,
                                      bool rms, cudaStream_t stream) {
    if (N == 0) return;
    const unsigned blocks = (static_cast<unsigned>(N) + kWarpsPerBlock - 1) / kWarpsPerBlock;
    const bool vec = norm_vec(C, {}, dinp, dout, out);
    const auto launch = [&](auto kernel) {
        TRAINER_LAUNCH(kernel, blocks, 32 * kWarpsPerBlock, 0, stream, dinp, dout, out, rstd, N, C);
        TRAINER_CUDA_CHECK(cudaGetLastError());
    };
    const auto run = [&](auto w, auto g) {
        constexpr int kW = decltype(w)::value, kG = decltype(g)::value;
        rms ? launch(norm_backward_from_output_kernel<kW, kG, true, Y>)
            : launch(norm_backward_from_output_kernel<kW, kG, false, Y>);
    };
    held_groups(vec, C, run);
}

// q and k of qkv (rows of C+2KV) copied aside into qk (rows of C+KV), then each normalised from there back into qkv.
template <typename T>
void qk_norm_forward_launch(T* qkv, T* qk, float* mean, float* rstd, const float* q_weight, const float* q_bias,
                            const float* k_weight, const float* k_bias, int N, int C, int KV, float eps, bool rms,
                            cudaStream_t stream) {
    if (N == 0) return;
    const int W = C + 2 * KV, Wqk = C + KV;
    TRAINER_CUDA_CHECK(cudaMemcpy2DAsync(qk, Wqk * sizeof(T), qkv, W * sizeof(T), Wqk * sizeof(T),
                                         static_cast<size_t>(N), cudaMemcpyDeviceToDevice, stream));
    norm_forward_launch(qkv, W, nullptr, mean, rstd, qk, Wqk, q_weight, q_bias, N, C, eps, rms, stream);
    norm_forward_launch(qkv + C, W, nullptr, mean != nullptr ? mean + N : nullptr, rstd + N, qk + C, Wqk, k_weight,
                        k_bias, N, KV, eps, rms, stream);
}

template <typename T>
void qk_norm_backward_launch(T* dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias, const T* qk,
                             const float* q_weight, const float* k_weight, const float* mean, const float* rstd, int N,
                             int C, int KV, bool rms, float* scratch, cudaStream_t stream) {
    const int W = C + 2 * KV, Wqk = C + KV;
    norm_backward_launch(dqkv, W, false, dq_weight, dq_bias, static_cast<const T*>(dqkv), W, qk, Wqk, q_weight, mean,
                         rstd, N, C, rms, scratch, stream);
    norm_backward_launch(dqkv + C, W, false, dk_weight, dk_bias, static_cast<const T*>(dqkv + C), W, qk + C, Wqk,
                         k_weight, mean != nullptr ? mean + N : nullptr, rstd + N, N, KV, rms, scratch, stream);
}

}  // namespace

size_t layernorm_backward_scratch_floats(int N, int C) {
    return static_cast<size_t>((N + kRowsPerChunk - 1) / kRowsPerChunk) * 2 * static_cast<size_t>(C);
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, float eps, bool rms, cudaStream_t stream, float* amax) {
    norm_forward_launch(out, C, nullptr, mean, rstd, inp, C, weight, bias, N, C, eps, rms, stream, amax);
}

void layernorm_forward(uint16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps, bool rms, cudaStream_t stream, float* amax) {
    norm_forward_launch(out, C, nullptr, mean, rstd, inp, C, weight, bias, N, C, eps, rms, stream, amax);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C, bool rms,
                        float* scratch, cudaStream_t stream) {
    norm_backward_launch(dinp, C, true, dweight, dbias, dout, C, inp, C, weight, mean, rstd, N, C, rms, scratch,
                         stream);
}

void norm_backward_from_output(float* dinp, const float* dout, const float* out, const float* rstd, int N, int C,
                               bool rms, cudaStream_t stream) {
    norm_backward_from_output_launch(dinp, dout, out, rstd, N, C, rms, stream);
}

void norm_backward_from_output(float* dinp, const float* dout, const uint16_t* out, const float* rstd, int N, int C,
                               bool rms, cudaStream_t stream) {
    norm_backward_from_output_launch(dinp, dout, out, rstd, N, C, rms, stream);
}

void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, const float* inp,
                           const float* weight, const float* bias, int N, int C, float eps, bool rms,
                           cudaStream_t stream) {
    norm_forward_launch(out, C, resid, mean, rstd, inp, C, weight, bias, N, C, eps, rms, stream);
}

void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, const uint16_t* inp,
                           const float* weight, const float* bias, int N, int C, float eps, bool rms,
                           cudaStream_t stream) {
    norm_forward_launch(out, C, resid, mean, rstd, inp, C, weight, bias, N, C, eps, rms, stream);
}

void norm_residual_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C, bool rms,
                            float* scratch, cudaStream_t stream) {
    norm_backward_launch(dinp, C, false, dweight, dbias, dout, C, inp, C, weight, mean, rstd, N, C, rms, scratch,
                         stream);
}

void norm_residual_backward(uint16_t* dinp, float* dweight, float* dbias, const float* dout, const uint16_t* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C, bool rms,
                            float* scratch, cudaStream_t stream) {
    norm_backward_launch(dinp, C, false, dweight, dbias, dout, C, inp, C, weight, mean, rstd, N, C, rms, scratch,
                         stream);
}

void qk_norm_forward(float* qkv, float* qk, float* mean, float* rstd, const float* q_weight, const float* q_bias,
                     const float* k_weight, const float* k_bias, int N, int C, int KV, float eps, bool rms,
                     cudaStream_t stream) {
    qk_norm_forward_launch(qkv, qk, mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, rms, stream);
}

void qk_norm_forward(uint16_t* qkv, uint16_t* qk, float* mean, float* rstd, const float* q_weight, const float* q_bias,
                     const float* k_weight, const float* k_bias, int N, int C, int KV, float eps, bool rms,
                     cudaStream_t stream) {
    qk_norm_forward_launch(qkv, qk, mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, rms, stream);
}

void qk_norm_backward(float* dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias, const float* qk,
                      const float* q_weight, const float* k_weight, const float* mean, const float* rstd, int N, int C,
                      int KV, bool rms, float* scratch, cudaStream_t stream) {
    qk_norm_backward_launch(dqkv, dq_weight, dq_bias, dk_weight, dk_bias, qk, q_weight, k_weight, mean, rstd, N, C, KV,
                            rms, scratch, stream);
}

void qk_norm_backward(uint16_t* dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                      const uint16_t* qk, const float* q_weight, const float* k_weight, const float* mean,
                      const float* rstd, int N, int C, int KV, bool rms, float* scratch, cudaStream_t stream) {
    qk_norm_backward_launch(dqkv, dq_weight, dq_bias, dk_weight, dk_bias, qk, q_weight, k_weight, mean, rstd, N, C, KV,
                            rms, scratch, stream);
}

}  // namespace trainer::cuda
