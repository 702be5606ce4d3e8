// The register-level pieces our two flash attention forwards share (attention_flash.cu on mma.sync,
// attention_flash_sm90a.cu on Hopper's wgmma): both hold a warp's 16-row m-tiles of S and O in mma.sync's
// accumulator layout (per 8 columns j: (row g, columns 8 j + 2 t, + 1) and (row g + 8, the same); g = lane / 4,
// t = lane % 4), so the online softmax, the P operand and the epilogue are the same code; and the launches' grid
// (flash_grid, head_block), which all five flash kernels share. Compiled by nvcc, and by g++ onto tests/simt's
// emulator (the CUDA names from its shim).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "base/common.h"

namespace trainer::cuda::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// log2(e) / sqrt(D): exp(x / sqrt(D)) = exp2(x * this), the same constant in the forwards and the backward.
inline float scale_log2e(int D) { return kLog2e / std::sqrt(static_cast<float>(D)); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragment (16 x 16, k-step kk) of a 16-row product from the accumulators of its two 8-column
// n-tiles (c0,c1 row g; c2,c3 row g + 8): FlashAttention-2's reuse of S / P / dS as an A operand.
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16(lo[0], lo[1]), a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]), a[3] = pack_bf16(hi[2], hi[3]);
}

// threadIdx.x, read where it is used: a volatile read that nvcc neither hoists out of a loop nor keeps live across
// one, so what a tile load derives from it costs a few instructions a tile instead of registers held through the
// kernel (hoisted, they made the wgmma forward spill 16 bytes at heads of 128, and the mma.sync backward 8 more).
__device__ __forceinline__ int thread_index() {
#ifdef TRAINER_SIMT_EMULATION
    return static_cast<int>(threadIdx.x);
#else
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return static_cast<int>(tid);
#endif
}

// Which head (b * NH + h) and which of its blocks a block of a launch computes, block 0 of a head being its longest
// (the query tile that sees every key, the key block every query sees). A launch's tail is set by the blocks
// dispatched last: in the order head by head, those are the last heads' longest blocks, and a causal head's blocks
// run from 1 to n tiles of work. Simulated with the scheduler taking blocks in order into free slots, that order
// finished 1.15-1.30x after the work's mean on OLMo-1B's shapes (1.09-1.18x on GPT-2's). So, as
// FlashAttention-3's and cuDNN's causal schedulers do: the heads in sections, and within a section every head's
// block 0, then every head's block 1, and so on, longest first (1.02-1.03x). A section has as many heads as keep
// the K and V (or Q and dO) they stream in L2, so the blocks running at once still share them there.
//
// The launch's grid says it (flash_grid): x the head within its section, y the block of the head, z the section;
// blocks are dispatched x fastest, then y, then z. The kernel reads its indices from the special registers and
// divides nothing (a head and block computed by division, held through the key loop, made the wgmma forward
// spill 24-48 bytes at heads of 128).
struct HeadBlock {
    int bh;     // b * NH + h
    int block;  // of the head's, 0 the longest
};
__device__ __forceinline__ HeadBlock head_block() {
    return {static_cast<int>(blockIdx.z * gridDim.x + blockIdx.x), static_cast<int>(blockIdx.y)};
}
// One head's rows, as every flash kernel addresses them: in the fused qkv (B, T, 3 NH, D) the q, k and v of head h
// of batch row b (bh = b NH + h), rows `stride` apart; in a (B, T, NH, D) tensor (the output, its gradient) the
// head starts `o_off` in, rows `ostride` apart.
template <typename Bf16>
struct HeadRows {
    int b, h;
    size_t stride, ostride, o_off;
    const Bf16 *q, *k, *v;
};
template <int D, typename Bf16>
__device__ __forceinline__ HeadRows<Bf16> head_rows(const Bf16* qkv, int bh, int T, int NH) {
    HeadRows<Bf16> r;
    r.b = bh / NH, r.h = bh % NH;
    r.stride = static_cast<size_t>(3) * NH * D, r.ostride = static_cast<size_t>(NH) * D;
    r.o_off = static_cast<size_t>(r.b) * T * r.ostride + static_cast<size_t>(r.h) * D;
    r.q = qkv + static_cast<size_t>(r.b) * T * r.stride + static_cast<size_t>(r.h) * D;
    r.k = r.q + static_cast<size_t>(NH) * D;
    r.v = r.k + static_cast<size_t>(NH) * D;
    return r;
}

// The dQ pass's row statistics of its kRows queries from q0, into shared memory: lse in base 2, and D =
// rowsum(dO * O). Rows past T: lse +inf makes their P zero (and they are not written). Published by the key-tile
// loop's first barrier.
template <int kRows>
__device__ __forceinline__ void load_row_stats(float* slse, float* sdsum, const float* lse, const float* dsum, int bh,
                                               int q0, int T) {
    if (threadIdx.x < kRows) {
        const int row = q0 + static_cast<int>(threadIdx.x);
        slse[threadIdx.x] = row < T ? lse[static_cast<size_t>(bh) * T + row] * kLog2e : INFINITY;
        sdsum[threadIdx.x] = row < T ? dsum[static_cast<size_t>(bh) * T + row] : 0.0f;
    }
}

// The L2 a section's streamed operands may fill: 32 MiB (an H100 has 50 MB, an A100 40 MB; the rest holds what else
// is in flight). The emulated build lets a test shrink it, so that a run of a few heads has several sections.
#ifdef TRAINER_SIMT_EMULATION
inline size_t section_l2_bytes = size_t{32} << 20;
#else
constexpr size_t section_l2_bytes = size_t{32} << 20;
#endif
// The grid of `BH` heads of `per_head` blocks, each head streaming two T x D bf16 operands: sections of the most
// heads that divide BH and whose operands fit in section_l2_bytes, at least one (one is the order head by head: a
// BH with no divisor under the fit, a prime above 32 on OLMo-1B's shape; B x NH has small factors in practice).
inline dim3 flash_grid(int BH, int per_head, int T, int D) {
    const size_t per_head_bytes = static_cast<size_t>(4) * static_cast<size_t>(T) * static_cast<size_t>(D);
    const size_t fit = section_l2_bytes / std::max<size_t>(per_head_bytes, 1);
    int section = 1;
    for (int s = 2; s <= BH && static_cast<size_t>(s) <= fit; ++s) {
        if (BH % s == 0) section = s;
    }
    // A grid's y and z hold at most 65,535 (x 2^31 - 1): more sections than that are one section (every head's
    // longest block first, across all heads).
    if (BH / section > 65535) section = BH;
    TRAINER_CHECK(per_head <= 65535, "flash attention with {} blocks a head (a sequence too long for one grid)",
                  per_head);
    return dim3(static_cast<unsigned>(section), static_cast<unsigned>(per_head), static_cast<unsigned>(BH / section));
}

// Rows first .. first + kRows - 1 of D bf16 channels (row stride `stride` elements; rows >= limit zero-filled)
// into a shared tile whose byte offset of (row, column) is offset(row, column), by cp.async over the block's
// kThreads threads: consecutive threads take consecutive 16-byte chunks of a row, and a thread's chunks lie
// kRowsAPass rows apart in one column. Both tile layouts swizzle by row % 8, so with kRowsAPass a multiple of 8 a
// thread's shared offset and global address each advance by a constant: one add and one compare a chunk, in a loop
// of compile-time count (nvcc had compiled `k = threadIdx.x; k < kChunks; k += kThreads` as a general loop, with a
// trip count and a signed division per chunk: the integer ALU was our wgmma forward's busiest pipe).
template <int D, int kRows, int kThreads, typename Bf16, typename Offset>
__device__ __forceinline__ void load_rows(uint8_t* tile, Offset offset, const Bf16* src, size_t stride, int first,
                                          int limit) {
    constexpr int kChunksARow = D / 8, kRowsAPass = kThreads / kChunksARow;
    static_assert(kThreads % kChunksARow == 0 && kRows % kRowsAPass == 0, "every thread loads as many chunks");
    static_assert(kRowsAPass % 8 == 0, "a thread's chunks share their row % 8, and so their swizzle");
    const int tid = thread_index();
    const int r0 = tid / kChunksARow, c = tid % kChunksARow * 8;
    uint8_t* dst = tile + offset(r0, c);
    const uint32_t dst_pass = offset(r0 + kRowsAPass, c) - offset(r0, c);
    int row = first + r0;
    const Bf16* g = src + static_cast<size_t>(row) * stride + c;
    const size_t pass = static_cast<size_t>(kRowsAPass) * stride;
    if (first + kRows <= limit) {  // every row of the tile exists (all but a sequence's last tile)
#pragma unroll
        for (int i = 0; i < kRows / kRowsAPass; ++i, g += pass, dst += dst_pass) cp_async16(dst, g, true);
        return;
    }
#pragma unroll
    for (int i = 0; i < kRows / kRowsAPass; ++i, row += kRowsAPass, g += pass, dst += dst_pass) {
        cp_async16(dst, row < limit ? g : src, row < limit);
    }
}

// 2^x on the special-function unit, a subnormal result flushed to zero: ex2.approx.ftz.f32 is one instruction,
// where exp2f is ex2.approx.f32 with a fix-up for subnormals around it (a compare and two multiplies: a third of a
// softmax score's instructions). A probability under 2^-126 next to a running maximum of 1 is 0 either way.
__device__ __forceinline__ float exp2_ftz(float x) {
#ifdef TRAINER_SIMT_EMULATION
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// body(std::true_type) where `masked`, else body(std::false_type): a warp-uniform flag turned into a compile-time one,
// so the tiles that need no causal mask carry none of its compares (if constexpr on decltype(arg)::value).
template <typename Body>
__device__ __forceinline__ void with_mask(bool masked, Body body) {
    if (masked) {
        body(std::true_type{});
    } else {
        body(std::false_type{});
    }
}

namespace detail {
template <bool kMask, int MT, int kK, int D>
__device__ __forceinline__ void online_softmax(float (&s)[MT][kK / 8][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][D / 8][4], int k0, int w0, float scale_log2, int g,
                                               int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int row_lo = w0 + mt * 16 + g;
        // The maximum of the raw scores (the scale is positive), masked ones -inf.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (kMask) {
                    const int key = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + (e >> 1) * 8;
                    if (key > row) s[mt][nt][e] = -INFINITY;
                }
                mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nt][e]);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        // m in base-2 units; every row's maximum is finite from the first tile on (its key 0), so neg_m is.
        float alpha[2], neg_m[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_new = fmaxf(m[mt][r], mx[r] * scale_log2);
            alpha[r] = exp2_ftz(m[mt][r] - m_new), m[mt][r] = m_new, neg_m[r] = -m_new;
        }
#pragma unroll
        for (int nt = 0; nt < kK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // One FFMA and one ex2 a score: exp2(S scale - m), a masked -inf giving 0.
                s[mt][nt][e] = exp2_ftz(fmaf(s[mt][nt][e], scale_log2, neg_m[e >> 1]));
                rs[e >> 1] += s[mt][nt][e];
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[mt][r] = l[mt][r] * alpha[r] + rs[r];  // quad-partial, reduced at the end
        // O's rescale (D / 2 multiplies a thread), skipped where no row of the warp has a new maximum: alpha is then
        // exactly 1 and the product the same bits. Past the first few key tiles most are so.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                o[mt][nt][0] *= alpha[0], o[mt][nt][1] *= alpha[0];
                o[mt][nt][2] *= alpha[1], o[mt][nt][3] *= alpha[1];
            }
        }
    }
}
}  // namespace detail

// One key tile's online softmax for a warp's MT m-tiles of raw scores S (kK keys from k0; the warp's first query
// w0): the causal mask where `diagonal` (a key of the tile may lie past one of the warp's queries; the same for
// the whole warp, so the branch costs nothing and the other tiles skip the mask's compares), the running maximum m
// (base 2) and (quad-partial) sum l, O rescaled; S becomes P = exp2(S scale_log2 - m).
template <int MT, int kK, int D>
__device__ __forceinline__ void online_softmax(float (&s)[MT][kK / 8][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][D / 8][4], int k0, int w0, bool diagonal,
                                               float scale_log2, int g, int t) {
    with_mask(diagonal, [&](auto masked) {
        detail::online_softmax<decltype(masked)::value, MT, kK, D>(s, m, l, o, k0, w0, scale_log2, g, t);
    });
}

// The epilogue: O normalised by the row sums, as bf16 into out (B, T, NH * D), and the natural-log lse of the
// scaled scores into lse (B, NH, T), for the warp's MT m-tiles of (batch b, head h) from query w0; rows >= T are
// not written.
template <int MT, int D, typename Bf16>
__device__ __forceinline__ void write_rows(Bf16* out, float* lse, const float (&o)[MT][D / 8][4],
                                           const float (&m)[MT][2], const float (&l)[MT][2], int b, int h, int T,
                                           int NH, int w0, int g, int t) {
    const size_t out_stride = static_cast<size_t>(NH) * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = w0 + mt * 16 + g + r * 8;
            if (row >= T) continue;
            const float inv = 1.0f / sum;
            Bf16* dst = out + (static_cast<size_t>(b) * T + row) * out_stride + static_cast<size_t>(h) * D;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                *reinterpret_cast<uint32_t*>(dst + nt * 8 + 2 * t) =
                    pack_bf16(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
            }
            if (t == 0) lse[(static_cast<size_t>(b) * NH + h) * T + row] = (m[mt][r] + log2f(sum)) * kLn2;
        }
    }
}

}  // namespace trainer::cuda::flash
