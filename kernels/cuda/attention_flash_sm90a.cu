// Our flash attention on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): what flash_attention_forward and
// flash_attention_backward run on compute capability 9.0 (kernels/cuda/ops.h), the contract of the mma.sync pair
// (attention_flash.cu) on bf16 qkv (B, T, 3C), bf16 out (B, T, C), the fp32 lse (B, NH, T) and bf16 dout and dqkv.
// The backward is described where it starts, below.
//
// Forward: a block is two warpgroups (256 threads, at most 128 registers each so that two blocks share an SM and one's
// softmax overlaps the other's products) and owns 128 queries of one (batch, head), 64 a warpgroup (16 a warp). Q
// and two buffers of K and V tiles of 64 keys sit in shared memory in kernels/cuda/wgmma.cuh's layout, loaded by
// cp.async (the next tile while this one computes). Per key tile a warpgroup that sees any of its keys issues
// S = Q K^T as head / 16 wgmma with both operands read from shared memory through descriptors (no ldmatrix: the
// mma.sync kernels spend their shared-memory bandwidth on fragments that wgmma reads once for the whole
// warpgroup), then the online softmax of flash_tile.cuh on S in registers, then O += P V as wgmma with P from
// registers and V read N-major. The blocks go in flash_tile.cuh's head_block order, as the mma.sync forward's.
//
// Not yet here (FlashAttention-3's further steps): TMA loads by a producer warpgroup, and the overlap of one
// warpgroup's softmax with the other's products.
//
// Compiled for sm_90a alone (CMakeLists.txt: code for sm_90a loads on compute capability 9.0 only), and with g++
// onto tests/simt's emulator.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "base/common.h"

#ifndef TRAINER_SIMT_EMULATION
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/ptx.cuh"
#endif
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/wgmma.cuh"

namespace trainer::cuda {
namespace {

using bf16 = __nv_bfloat16;
using namespace flash;
using namespace sm90;

constexpr int kGroups = 2;  // warpgroups a block
constexpr int kThreads = 128 * kGroups;
constexpr int kRows = 64 * kGroups;  // queries a block: 64 a warpgroup, 16 a warp
constexpr int kKeys = 64;            // keys a tile (S's 32 accumulators a thread beside O's 32 or 64)

// kTileRows rows of D channels from global row `first` (stride `stride` elements; rows >= `limit` zero-filled) into
// a tile of wgmma.cuh's layout, by cp.async over the block's threads (flash_tile.cuh's load_rows).
template <int D, int kTileRows>
__device__ __forceinline__ void load_tile(uint8_t* tile, const bf16* src, size_t stride, int first, int limit) {
    const auto offset = [](int r, int c) { return tile_offset(kTileRows, r, c); };
    load_rows<D, kTileRows, kThreads>(tile, offset, src, stride, first, limit);
}

// The key/value tiles 0 .. n_tiles - 1 (kK keys of one head) through two shared-memory buffers each (the next tile
// loading while body(j, k_tile, v_tile) computes on this one, given their shared addresses); tile 0 must be queued
// and committed by the caller, with whatever else body's first call reads. Every thread's copies are made visible
// to wgmma before body, and every warp finishes body before the buffer it read is refilled.
template <int D, int kK, typename Body>
__device__ __forceinline__ void for_each_key_tile(uint8_t* sk, uint8_t* sv, const bf16* kbase, const bf16* vbase,
                                                  size_t stride, int T, int n_tiles, Body body) {
    constexpr int kTile = kK * D * 2;
    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1;
        cp_async_wait<0>();   // tile j, the one group in flight
        fence_proxy_async();  // this thread's landed copies, visible to wgmma
        // Every thread's too; and every warp has finished body(j - 1), so tile j - 1's buffer can be refilled:
        // one barrier a tile, the warpgroups held together once a tile rather than twice.
        __syncthreads();
        if (j + 1 < n_tiles) {  // tile j + 1 lands while body computes on tile j
            load_tile<D, kK>(sk + (buf ^ 1) * kTile, kbase, stride, (j + 1) * kK, T);
            load_tile<D, kK>(sv + (buf ^ 1) * kTile, vbase, stride, (j + 1) * kK, T);
            cp_async_commit();
        }
        body(j, smem_addr(sk + buf * kTile), smem_addr(sv + buf * kTile));
    }
}

// acc (the warpgroup's 64 x N) = A B^T over K columns, as K / 16 wgmma: A the 64 rows of a K-major tile of a_rows
// rows at shared address a, B the N rows of a K-major tile of b_rows rows at b. The first wgmma has scale-d 0, so
// it reads nothing of acc, and the callers leave acc unzeroed (as CUTLASS's ScaleOut::Zero does): zeroing S and dP
// cost 32 to 64 moves a thread a tile.
template <int N, int K>
__device__ __forceinline__ void issue_product(float (&acc)[N / 8][4], uint32_t a, int a_rows, uint32_t b, int b_rows) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) wgmma_ss<N>(acc, k_major(a, a_rows, kk), k_major(b, b_rows, kk), kk > 0);
}
// The 64 x K accumulators x (P, dS or their transposes) as bf16 A fragments, 16 columns each.
template <int K>
__device__ __forceinline__ void pack_rows(uint32_t (&frag)[K / 16][4], const float (&x)[K / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) pack_a(frag[kk], x[2 * kk], x[2 * kk + 1]);
}
// acc (64 x N) += A B over K, as K / 16 wgmma: A the fragments, B an N-major tile of K rows at shared address b.
template <int N, int K>
__device__ __forceinline__ void issue_accumulate(float (&acc)[N / 8][4], const uint32_t (&frag)[K / 16][4],
                                                 uint32_t b) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) wgmma_rs<N>(acc, frag[kk], n_major(b, K, kk), true);
}

// x[i] and x[i + 1] (i even, x 8-byte aligned) as one 8-byte shared load: the dK/dV block reads each query's lse and
// D this way, half the loads of two.
__device__ __forceinline__ float2 pair(const float* x, int i) { return *reinterpret_cast<const float2*>(x + i); }

template <int D>
__global__ void __launch_bounds__(kThreads, 2)
    flash_forward_sm90_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale_log2) {
    constexpr int kK = kKeys;
    constexpr int kTileBytes = kK * D * 2;
    TRAINER_DYNAMIC_SHARED(smem_raw);
    uint8_t* sq = tile_base(smem_raw);
    uint8_t* sk = sq + kRows * D * 2;  // two buffers of kK x D
    uint8_t* sv = sk + 2 * kTileBytes;
    const int n_qtiles = (T + kRows - 1) / kRows;
    const HeadBlock hb = head_block();
    const HeadRows<bf16> hr = head_rows<D>(qkv, hb.bh, T, NH);
    const int b = hr.b, h = hr.h;
    const int qt = n_qtiles - 1 - hb.block;  // block 0: the last query tile, which sees every key
    const int q0 = qt * kRows;
    const int group = static_cast<int>(threadIdx.x) / 128, warp = static_cast<int>(threadIdx.x) / 32;
    const int g = static_cast<int>(threadIdx.x) % 32 / 4, t = static_cast<int>(threadIdx.x) % 4;  // flash_tile.cuh
    const size_t stride = hr.stride;
    const bf16 *qbase = hr.q, *kbase = hr.k, *vbase = hr.v;

    load_tile<D, kRows>(sq, qbase, stride, q0, T);
    load_tile<D, kK>(sk, kbase, stride, 0, T);
    load_tile<D, kK>(sv, vbase, stride, 0, T);
    cp_async_commit();

    float o[1][D / 8][4] = {};
    float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.0f, 0.0f}};
    const int g0 = q0 + 64 * group;                                                   // this warpgroup's first query
    const int w0 = q0 + 16 * warp;                                                    // this warp's first query
    const uint32_t q_rows = smem_addr(sq) + static_cast<uint32_t>(64 * group * 128);  // the warpgroup's 64 rows
    // Key tiles up to the block's last query (none past T): tile 0 has a key every query sees, so every row's
    // running maximum is finite from the first tile on.
    const int n_tiles = min((q0 + kRows - 1) / kK + 1, (T + kK - 1) / kK);
    for_each_key_tile<D, kK>(sk, sv, kbase, vbase, stride, T, n_tiles, [&](int j, uint32_t k_tile, uint32_t v_tile) {
        const int k0 = j * kK;
        if (k0 > g0 + 63) return;  // no query of the warpgroup sees a key of the tile (the same for its four warps)
        float s[1][kK / 8][4];     // not zeroed (issue_product)
        wgmma_batch([&] { issue_product<kK, D>(s[0], q_rows, kRows, k_tile, kK); }, s[0]);
        online_softmax<1, kK, D>(s, m, l, o, k0, w0, k0 + kK - 1 > w0, scale_log2, g, t);
        uint32_t p[kK / 16][4];
        pack_rows<kK>(p, s[0]);
        wgmma_batch([&] { issue_accumulate<D, kK>(o[0], p, v_tile); }, o[0], p);  // O was rescaled by the softmax
    });
    write_rows<1, D>(out, lse, o, m, l, b, h, T, NH, w0, g, t);
}

template <int D>
void forward_launch(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, cudaStream_t stream) {
    const size_t smem = static_cast<size_t>(kRows + 4 * kKeys) * D * 2 + 1024;
    auto* kernel = flash_forward_sm90_kernel<D>;
    TRAINER_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const dim3 grid = flash_grid(B * NH, (T + kRows - 1) / kRows, T, D);
    TRAINER_LAUNCH(kernel, grid, kThreads, smem, stream, reinterpret_cast<bf16*>(out), lse,
                   reinterpret_cast<const bf16*>(qkv), T, NH, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

// ---- backward ----
// Two launches of one kind of block each, as the mma.sync backward's two kinds (attention_flash.cu): dK and dV of
// 128 keys (64 a warpgroup) over the query tiles of 64 that see them, and dQ of 128 queries (64 a warpgroup) over
// the key tiles up to the diagonal; every sum has one owner that adds in a fixed order, so the results repeat
// bitwise (S and dP are computed by both kinds: 7 products per tile pair instead of FlashAttention's 5 with
// atomics). Every product is one of the two forms the forward uses: both operands K-major from shared memory, or A
// from registers (P, dS or their transposes, packed from the accumulators as the forward packs P) and B N-major.
//
// Two launches, not one: registers are a kernel's, not a block's. A dK/dV block holds dK and dV (64 registers a
// thread each at heads of 128) beside S^T and dP^T and takes every register of an SM; a dQ block holds one
// accumulator of that size, so on its own it fits in half of them (its key tiles are 32 keys at heads of 128, S
// and dP 16 registers each) and two blocks share an SM. In one launch both kinds ran one block (two warpgroups)
// an SM, at 12% occupancy (ncu, H200, 2026-11-26).
constexpr int kBwdQueries = 64;  // queries a tile of a dK/dV block
constexpr int kBwdKeys = 128;    // keys a dK/dV block
constexpr int kDqRows = 128;     // queries a dQ block
// Keys a tile of a dQ block: S and dP take kDqKeys / 2 registers a thread each, beside dQ's D / 2.
template <int D>
constexpr int kDqKeys = D == 128 ? 32 : 64;

__host__ __device__ inline int dq_blocks(int T) { return (T + kDqRows - 1) / kDqRows; }
__host__ __device__ inline int dkdv_blocks(int T) { return (T + kBwdKeys - 1) / kBwdKeys; }
template <int D>
constexpr size_t dkdv_smem() {
    return static_cast<size_t>(2 * kBwdKeys + 4 * kBwdQueries) * D * 2 + 4 * kBwdQueries * sizeof(float);
}
template <int D>
constexpr size_t dq_smem() {
    return static_cast<size_t>(2 * kDqRows + 4 * kDqKeys<D>) * D * 2 + 2 * kDqRows * sizeof(float);
}

// dK (scaled) and dV of keys k0 .. k0 + 127 of head bh. Per query tile: S^T = K Q^T and dP^T = V dO^T (M = the
// warpgroup's 64 keys), P^T = exp2(S^T scale_log2 - lse) with the causal mask, dS^T = P^T (dP^T - D), then
// dV += P^T dO and dK += dS^T Q with dO and Q read N-major (K = the tile's queries).
template <int D>
__device__ __forceinline__ void backward_dkdv_block(uint8_t* smem, int bh, int kb, bf16* dqkv, const float* dsum,
                                                    const bf16* dout, const bf16* qkv, const float* lse, int T, int NH,
                                                    float scale, float scale_log2) {
    constexpr int kQ = kBwdQueries, kTile = kQ * D * 2;
    uint8_t* sk = smem;                                       // kBwdKeys x D
    uint8_t* sv = sk + kBwdKeys * D * 2;                      // kBwdKeys x D
    uint8_t* sq = sv + kBwdKeys * D * 2;                      // two buffers of kQ x D
    uint8_t* sdo = sq + 2 * kTile;                            // two buffers of kQ x D
    float* slse = reinterpret_cast<float*>(sdo + 2 * kTile);  // two buffers of kQ
    float* sdsum = slse + 2 * kQ;                             // two buffers of kQ

    const HeadRows<bf16> hr = head_rows<D>(qkv, bh, T, NH);
    const int k0 = kb * kBwdKeys;
    const int group = static_cast<int>(threadIdx.x) / 128, warp = static_cast<int>(threadIdx.x) / 32;
    const int g = static_cast<int>(threadIdx.x) % 32 / 4, t = static_cast<int>(threadIdx.x) % 4;
    const size_t stride = hr.stride, ostride = hr.ostride;
    const size_t head_off = static_cast<size_t>(hr.q - qkv);
    const bf16 *qbase = hr.q, *kbase = hr.k, *vbase = hr.v;
    const bf16* dobase = dout + hr.o_off;
    const float* lse_bh = lse + static_cast<size_t>(bh) * T;
    const float* dsum_bh = dsum + static_cast<size_t>(bh) * T;
    const int n_qtiles = (T + kQ - 1) / kQ, first_qt = k0 / kQ;  // query tiles before first_qt see none of the keys

    auto load_query_tile = [&](int qt, int buf) {
        load_tile<D, kQ>(sq + buf * kTile, qbase, stride, qt * kQ, T);
        load_tile<D, kQ>(sdo + buf * kTile, dobase, ostride, qt * kQ, T);
        if (threadIdx.x < kQ) {
            const int q = qt * kQ + static_cast<int>(threadIdx.x);
            // Queries past T: lse +inf makes their P zero.
            slse[buf * kQ + threadIdx.x] = q < T ? lse_bh[q] * kLog2e : INFINITY;
            sdsum[buf * kQ + threadIdx.x] = q < T ? dsum_bh[q] : 0.0f;
        }
    };
    load_tile<D, kBwdKeys>(sk, kbase, stride, k0, T);
    load_tile<D, kBwdKeys>(sv, vbase, stride, k0, T);
    load_query_tile(first_qt, 0);
    cp_async_commit();

    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    const int kw0 = k0 + 64 * group;        // this warpgroup's first key
    const int key_lo = k0 + 16 * warp + g;  // this thread's first key (rows g and g + 8 of the warp)
    const uint32_t k_rows = smem_addr(sk) + static_cast<uint32_t>(64 * group * 128);
    const uint32_t v_rows = smem_addr(sv) + static_cast<uint32_t>(64 * group * 128);
    for (int qt = first_qt; qt < n_qtiles; ++qt) {
        const int buf = (qt - first_qt) & 1;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // tile qt visible, and tile qt - 1's buffers free (as for_each_key_tile)
        if (qt + 1 < n_qtiles) {
            load_query_tile(qt + 1, buf ^ 1);
            cp_async_commit();
        }
        const int q0 = qt * kQ;
        if (q0 + kQ - 1 >= kw0) {  // a query of the tile sees a key of the warpgroup (the same for its four warps)
            const uint32_t q_tile = smem_addr(sq + buf * kTile), do_tile = smem_addr(sdo + buf * kTile);
            const float* lse_t = slse + buf * kQ;
            const float* dsum_t = sdsum + buf * kQ;
            // S^T and dP^T as two groups: P^T's exponentials run while the tensor cores compute dP^T.
            float st[kQ / 8][4], dpt[kQ / 8][4];  // not zeroed (issue_product)
            wgmma_issue([&] { issue_product<kQ, D>(st, k_rows, kBwdKeys, q_tile, kQ); }, st);
            wgmma_issue([&] { issue_product<kQ, D>(dpt, v_rows, kBwdKeys, do_tile, kQ); }, dpt);
            wgmma_retire<1>(st);
            // P^T, masked only where a key of the warp may lie past a query of the tile (the same for the warp).
            with_mask(key_lo - g + 15 > q0, [&](auto masked) {
#pragma unroll
                for (int j = 0; j < kQ / 8; ++j) {
                    const float2 lse2 = pair(lse_t, 8 * j + 2 * t);  // the thread's two queries: one load
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        st[j][e] = exp2_ftz(fmaf(st[j][e], scale_log2, -(e & 1 ? lse2.y : lse2.x)));
                        if constexpr (decltype(masked)::value) {
                            if (key_lo + (e >> 1) * 8 > q0 + 8 * j + 2 * t + (e & 1)) st[j][e] = 0.0f;
                        }
                    }
                }
            });
            // dV += P^T dO on the tensor cores while dS^T is computed (once dP^T is in), then dK += dS^T Q.
            uint32_t pf[kQ / 16][4], df[kQ / 16][4];
            pack_rows<kQ>(pf, st);
            wgmma_issue([&] { issue_accumulate<D, kQ>(dv, pf, do_tile); }, dv, pf);
            wgmma_retire<1>(dpt);  // dP^T's group retired; dV's may still run
#pragma unroll
            for (int j = 0; j < kQ / 8; ++j) {
                const float2 d2 = pair(dsum_t, 8 * j + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) dpt[j][e] = st[j][e] * (dpt[j][e] - (e & 1 ? d2.y : d2.x));
            }
            pack_rows<kQ>(df, dpt);
            wgmma_issue([&] { issue_accumulate<D, kQ>(dk, df, q_tile); }, dk, df);
            wgmma_retire<0>(dv, dk, pf, df);
        }
    }
    // dK (scaled) and dV of this thread's two keys, as bf16 into dqkv.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_lo + r * 8;
        if (key >= T) continue;
        bf16* dkd = dqkv + head_off + static_cast<size_t>(key) * stride + static_cast<size_t>(NH) * D;
        bf16* dvd = dkd + static_cast<size_t>(NH) * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            *reinterpret_cast<uint32_t*>(dkd + 8 * j + 2 * t) =
                pack_bf16(dk[j][2 * r] * scale, dk[j][2 * r + 1] * scale);
            *reinterpret_cast<uint32_t*>(dvd + 8 * j + 2 * t) = pack_bf16(dv[j][2 * r], dv[j][2 * r + 1]);
        }
    }
}

// dQ (scaled) of queries q0 .. q0 + 127 of head bh. Per key tile: S = Q K^T and dP = dO V^T (M = the warpgroup's
// 64 queries), P and dS = P (dP - D) in registers, then dQ += dS K with K read N-major (K = the tile's keys).
template <int D>
__device__ __forceinline__ void backward_dq_block(uint8_t* smem, int bh, int qb, bf16* dqkv, const float* dsum,
                                                  const bf16* dout, const bf16* qkv, const float* lse, int T, int NH,
                                                  float scale, float scale_log2) {
    constexpr int kK = kDqKeys<D>, kTile = kK * D * 2;
    uint8_t* sq = smem;                                      // kDqRows x D
    uint8_t* sdo = sq + kDqRows * D * 2;                     // kDqRows x D
    uint8_t* sk = sdo + kDqRows * D * 2;                     // two buffers of kK x D
    uint8_t* sv = sk + 2 * kTile;                            // two buffers of kK x D
    float* slse = reinterpret_cast<float*>(sv + 2 * kTile);  // kDqRows
    float* sdsum = slse + kDqRows;                           // kDqRows

    const HeadRows<bf16> hr = head_rows<D>(qkv, bh, T, NH);
    const int b = hr.b, h = hr.h, q0 = qb * kDqRows;
    const int group = static_cast<int>(threadIdx.x) / 128, warp = static_cast<int>(threadIdx.x) / 32;
    const int g = static_cast<int>(threadIdx.x) % 32 / 4, t = static_cast<int>(threadIdx.x) % 4;
    const size_t stride = hr.stride, ostride = hr.ostride;
    const bf16 *qbase = hr.q, *kbase = hr.k, *vbase = hr.v;
    const bf16* dobase = dout + hr.o_off;

    load_tile<D, kDqRows>(sq, qbase, stride, q0, T);
    load_tile<D, kDqRows>(sdo, dobase, ostride, q0, T);
    load_tile<D, kK>(sk, kbase, stride, 0, T);
    load_tile<D, kK>(sv, vbase, stride, 0, T);
    cp_async_commit();
    load_row_stats<kDqRows>(slse, sdsum, lse, dsum, bh, q0, T);
    float dq[D / 8][4] = {};
    const int g0 = q0 + 64 * group;  // this warpgroup's first query
    const int w0 = q0 + 16 * warp;   // this warp's first query
    const uint32_t q_rows = smem_addr(sq) + static_cast<uint32_t>(64 * group * 128);
    const uint32_t do_rows = smem_addr(sdo) + static_cast<uint32_t>(64 * group * 128);
    const int n_tiles = min((q0 + kDqRows - 1) / kK + 1, (T + kK - 1) / kK);  // up to the block's last query
    for_each_key_tile<D, kK>(sk, sv, kbase, vbase, stride, T, n_tiles, [&](int j, uint32_t k_tile, uint32_t v_tile) {
        const int k0 = j * kK;
        if (k0 > g0 + 63) return;  // no query of the warpgroup sees a key of the tile
        // S and dP as two groups: P's exponentials run while the tensor cores compute dP.
        float s[kK / 8][4], dp[kK / 8][4];  // not zeroed (issue_product)
        wgmma_issue([&] { issue_product<kK, D>(s, q_rows, kDqRows, k_tile, kK); }, s);
        wgmma_issue([&] { issue_product<kK, D>(dp, do_rows, kDqRows, v_tile, kK); }, dp);
        wgmma_retire<1>(s);
        // P, masked only where a key of the tile may lie past one of the warp's queries.
        with_mask(k0 + kK - 1 > w0, [&](auto masked) {
#pragma unroll
            for (int n = 0; n < kK / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = w0 + g + (e >> 1) * 8;
                    s[n][e] = exp2_ftz(fmaf(s[n][e], scale_log2, -slse[row - q0]));
                    if constexpr (decltype(masked)::value) {
                        if (k0 + 8 * n + 2 * t + (e & 1) > row) s[n][e] = 0.0f;
                    }
                }
            }
        });
        wgmma_retire<0>(dp);
        // dS = P (dP - D).
#pragma unroll
        for (int n = 0; n < kK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - sdsum[w0 + g + (e >> 1) * 8 - q0]);
        }
        uint32_t df[kK / 16][4];
        pack_rows<kK>(df, dp);
        wgmma_batch([&] { issue_accumulate<D, kK>(dq, df, k_tile); }, dq, df);
    });
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = w0 + g + r * 8;
        if (row >= T) continue;
        bf16* dst = dqkv + (static_cast<size_t>(b) * T + row) * stride + static_cast<size_t>(h) * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<uint32_t*>(dst + 8 * n + 2 * t) =
                pack_bf16(dq[n][2 * r] * scale, dq[n][2 * r + 1] * scale);
        }
    }
}

// Both launches take their blocks in head_block's order: the longest first (dQ of a head's last query block, dK and
// dV of its key block 0) across a section of heads.
template <int D>
__global__ void __launch_bounds__(kThreads, 2)
    flash_backward_dq_sm90_kernel(bf16* dqkv, const float* dsum, const bf16* dout, const bf16* qkv, const float* lse,
                                  int T, int NH, float scale, float scale_log2) {
    TRAINER_DYNAMIC_SHARED(smem_raw);
    const HeadBlock hb = head_block();
    backward_dq_block<D>(tile_base(smem_raw), hb.bh, dq_blocks(T) - 1 - hb.block, dqkv, dsum, dout, qkv, lse, T, NH,
                         scale, scale_log2);
}
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    flash_backward_dkdv_sm90_kernel(bf16* dqkv, const float* dsum, const bf16* dout, const bf16* qkv, const float* lse,
                                    int T, int NH, float scale, float scale_log2) {
    TRAINER_DYNAMIC_SHARED(smem_raw);
    const HeadBlock hb = head_block();
    backward_dkdv_block<D>(tile_base(smem_raw), hb.bh, hb.block, dqkv, dsum, dout, qkv, lse, T, NH, scale, scale_log2);
}

// One backward launch of `kernel` over `blocks_per_head` blocks a head, with `smem` bytes of tiles.
template <typename Kernel>
void backward_launch_one(Kernel* kernel, size_t smem, int blocks_per_head, uint16_t* dqkv, const uint16_t* dout,
                         const uint16_t* qkv, const float* lse, int B, int T, int NH, int HS, const float* dsum,
                         cudaStream_t stream) {
    smem += 1024;  // the 1024-byte alignment of the tiles
    TRAINER_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    TRAINER_LAUNCH(kernel, flash_grid(B * NH, blocks_per_head, T, HS), kThreads, smem, stream,
                   reinterpret_cast<bf16*>(dqkv), dsum, reinterpret_cast<const bf16*>(dout),
                   reinterpret_cast<const bf16*>(qkv), lse, T, NH, 1.0f / std::sqrt(static_cast<float>(HS)),
                   scale_log2e(HS));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}
// dK and dV, then dQ: they write disjoint parts of dqkv and read what the forward and the dot kernel wrote.
template <int D>
void backward_launch(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const float* lse, int B, int T, int NH,
                     const float* dsum, cudaStream_t stream) {
    backward_launch_one(flash_backward_dkdv_sm90_kernel<D>, dkdv_smem<D>(), dkdv_blocks(T), dqkv, dout, qkv, lse, B, T,
                        NH, D, dsum, stream);
    backward_launch_one(flash_backward_dq_sm90_kernel<D>, dq_smem<D>(), dq_blocks(T), dqkv, dout, qkv, lse, B, T, NH, D,
                        dsum, stream);
}

}  // namespace

bool flash_attention_sm90_available() {
#ifdef TRAINER_SIMT_EMULATION
    return true;  // the emulator runs wgmma
#else
    // Asked by every attention call, answered once per device.
    static OncePerDevice sm90;
    return sm90.get([](int device) -> size_t {
        int major = 0, minor = 0;
        TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        return major == 9 && minor == 0 ? 1 : 0;
    }) == 1;
#endif
}

void flash_attention_forward_sm90(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                                  cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    TRAINER_CHECK(flash_attention_sm90_available(), "the wgmma flash forward on a device without sm_90a");
    if (B == 0 || T == 0) return;
    if (HS == 64) return forward_launch<64>(out, lse, qkv, B, T, NH, stream);
    forward_launch<128>(out, lse, qkv, B, T, NH, stream);
}

void flash_attention_backward_sm90(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                                   const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    TRAINER_CHECK(flash_attention_sm90_available(), "the wgmma flash backward on a device without sm_90a");
    if (B == 0 || T == 0) return;
    const float* dsum = flash_attention_backward_dsum(dout, out, B, T, NH, HS, scratch, stream);
    if (HS == 64) return backward_launch<64>(dqkv, dout, qkv, lse, B, T, NH, dsum, stream);
    backward_launch<128>(dqkv, dout, qkv, lse, B, T, NH, dsum, stream);
}

}  // namespace trainer::cuda
