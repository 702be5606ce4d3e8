// Our flash attention on tensor cores (kernels.attention=flash): causal scaled-dot-product attention on
// bf16 qkv (B, T, 3C), bf16 out (B, T, C) and the fp32 lse (B, NH, T) of the scaled scores, the contract
// of the native kernels (attention.cu) and of cuDNN's (attention_cudnn.cu). FlashAttention-2's algorithm
// with mma.sync m16n8k16 (bf16 in, fp32 accumulate), ldmatrix from XOR-swizzled shared memory and
// cp.async double buffering; heads of 64 or 128 channels.
//
// Forward: a block owns 128 queries of one (batch, head), 32 per warp (two m-tiles of 16, FlashAttention-2's
// tiling on sm80 and sm90: each K and V fragment a warp loads from shared memory feeds twice the products it
// fed with 16 rows a warp, and a warp has twice the independent products in flight); key/value tiles of 64
// stream through shared memory (the next one loading while this one computes), only those the causal mask
// keeps, and a warp skips a tile whose keys all lie past its queries. S = Q K^T and the online softmax stay
// in registers; P is rounded to bf16 and fed to P V from registers. Every ldmatrix address is one XOR of a
// per-thread offset with a constant (lane_offsets): the swizzle's arithmetic per load made the integer ALU
// the forward's busiest pipe on an H100.
// Blocks go in flash_tile.cuh's head_block order: heads in sections whose K and V fit in L2, and within a
// section every head's last query tile (the most keys) first, then every head's next. Numbered tile by tile
// across all heads, the blocks streamed every head's K and V from DRAM (an L2 hit rate of 16% in the backward
// on an H100); numbered head by head, a launch ended on the last heads' longest tiles.
//
// Backward, deterministic, after a first kernel's D = rowsum(dO * O): one launch of two kinds of tile,
// neither waiting on another block: dK and dV per key tile, dQ per query tile. A dK/dV tile owns 64 keys
// (16 per warp) and walks the query tiles of 32 that see them: it recomputes P^T = exp(K Q^T * scale -
// lse) and accumulates dV += P^T dO and dK += dS^T Q in registers (dS = P (dP - D), dP = dO V^T). A dQ
// tile has 128 queries a block, 32 per warp (two m-tiles, as the forward: each K and V fragment feeds both,
// 0.42 ldmatrix a product where 16 rows a warp took 0.58), and key tiles of 32 up to the diagonal (the
// accumulators of S and dP for 32 rows fit beside dQ's), and accumulates dQ += dS K in registers. FlashAttention-2
// computes dQ in the dK/dV kernel and adds the key tiles' shares with fp32 atomics (not reproducible); here every sum
// has one owner that adds in a fixed order, at the price of recomputing S and dP a second time (7 products per tile
// pair instead of 5).
//
// The CPU suite compiles this file a second time with g++ (TRAINER_SIMT_EMULATION, tests/CMakeLists.txt): tests/simt's
// emulator of the CUDA execution model runs these kernels, and its shim supplies the PTX wrappers and the CUDA
// names.
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

namespace trainer::cuda {
namespace {

using namespace flash;

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kFwdTiles = 2;                       // 16-row m-tiles per warp in the forward
constexpr int kFwdRows = 16 * kFwdTiles * kWarps;  // queries per forward block (32 per warp)
constexpr int kKeys = 64;                          // keys per key/value tile of the forward
constexpr int kDqTiles = 2;                        // 16-row m-tiles per warp in a dQ block
constexpr int kDqRows = 16 * kDqTiles * kWarps;    // queries per dQ block (32 per warp)
constexpr int kDqKeys = 32;                        // keys per key/value tile of a dQ block
constexpr int kBwdKeys = 64;                       // keys per backward block (16 per warp)
constexpr int kBwdRows = 32;                       // queries per backward tile

// A tile of `rows` x D bf16 in shared memory, rows of D/8 chunks of 16 bytes, chunk c of row r stored at
// chunk c ^ (r % 8): the 8 rows an ldmatrix reads at one logical chunk land in 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int at_offset(int row, int col) {
    return row * D + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
}
template <int D>
__device__ __forceinline__ bf16* at(bf16* tile, int row, int col) {
    return tile + at_offset<D>(row, col);
}

// Per-thread offsets (elements) into a swizzled tile for the three ldmatrix.x4 patterns. The rows a lane
// addresses differ from its row within the 16-row group by multiples of 8 (the same swizzle row & 7), and
// its chunk is 2x + p for the step x (a k-step, or a pair of n-tiles) and a lane parity p, so the chunk's
// place is (2x + p) ^ (row & 7) = (p ^ (row & 7)) ^ 2x: the fragment of step x of the group at row r0 (a
// multiple of 8) lies at tile + r0 * D + (offset ^ (x << 4)) (frag), one XOR with a constant per load.
struct LaneOffsets {
    int a;   // an A operand from row-major rows (16 rows x 16 k: row lane % 16, chunk parity lane / 16)
    int b;   // a B operand from rows of n, k contiguous (two n-tiles of 8 x 16 k)
    int bt;  // a B operand through .trans from rows of k, n contiguous (16 k x two n-tiles of 8)
};
template <int D>
__device__ __forceinline__ int swizzled(int row, int parity) {
    return row * D + ((parity ^ (row & 7)) << 3);
}
template <int D>
__device__ __forceinline__ LaneOffsets lane_offsets(int lane) {
    static_assert(D >= 64, "the XOR of x << 4 stays within a row's chunks for D >= 64");
    return {swizzled<D>(lane % 16, lane / 16), swizzled<D>(lane % 8 + (lane / 16) * 8, (lane / 8) % 2),
            swizzled<D>(lane % 8 + ((lane / 8) % 2) * 8, lane / 16)};
}
template <int D>
__device__ __forceinline__ const bf16* frag(const bf16* tile, int r0, int offset, int x) {
    return tile + r0 * D + (offset ^ (x << 4));
}

// Loads kRows rows of D channels starting at global row `first` (stride `stride` elements, rows >= `limit`
// zero-filled) into a swizzled tile, with cp.async over the block's threads (flash_tile.cuh's load_rows).
template <int D, int kRows>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, size_t stride, int first, int limit) {
    const auto offset = [](int r, int c) { return static_cast<uint32_t>(at_offset<D>(r, c)) * 2u; };
    load_rows<D, kRows, kThreads>(reinterpret_cast<uint8_t*>(tile), offset, src, stride, first, limit);
}

// The key/value tiles 0 .. n_tiles - 1 (kK keys each, of one head) through two shared-memory buffers
// each (the next tile loading while body(j, k_tile, v_tile) computes on this one); tile 0 must be queued
// (and committed) by the caller, with whatever else body's first call reads. Every warp finishes body
// before the buffer it read is refilled.
template <int D, int kK, typename Body>
__device__ __forceinline__ void for_each_key_tile(bf16* sk, bf16* sv, const bf16* kbase, const bf16* vbase,
                                                  size_t stride, int T, int n_tiles, Body body) {
    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();  // tile j, the one group in flight
        // Every thread's copies landed; and every warp has finished body(j - 1), so tile j - 1's buffer can be
        // refilled: one barrier a tile.
        __syncthreads();
        if (j + 1 < n_tiles) {  // tile j + 1 lands while body computes on tile j
            const int nb = (j + 1) & 1;
            load_tile<D, kK>(sk + nb * kK * D, kbase, stride, (j + 1) * kK, T);
            load_tile<D, kK>(sv + nb * kK * D, vbase, stride, (j + 1) * kK, T);
            cp_async_commit();
        }
        body(j, sk + (j & 1) * kK * D, sv + (j & 1) * kK * D);
    }
}

// acc (a warp's MT m-tiles of 16 rows x D) += A B, A the warp's MT x 16 x kK accumulators of a product over a
// tile (P or dS, or their transposes; rounded to bf16 and fed from registers as the A operand, 16 a k-step)
// and B the tile's kK rows x D (V or K; dO or Q) through ldmatrix.trans, each B fragment feeding every
// m-tile.
template <int D, int kK, int MT>
__device__ __forceinline__ void accumulate_times_tile(float (&acc)[MT][D / 8][4], const float (&a)[MT][kK / 8][4],
                                                      const bf16* tile, int lane_bt) {
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        uint32_t af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) pack_a(af[mt], a[mt][2 * kk], a[mt][2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, frag<D>(tile, kk * 16, lane_bt, np));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma(acc[mt][2 * np], af[mt], b[0], b[1]);
                mma(acc[mt][2 * np + 1], af[mt], b[2], b[3]);
            }
        }
    }
}

// x += A B^T over D channels, for a warp: A its MT x 16 rows (from row a0, a multiple of 16) of a shared tile
// (ldmatrix), B the kN rows of another (ldmatrix, as the col-major B operand), each B fragment feeding every
// m-tile. The forward's S = Q K^T, and the backward's two products of every tile one after the other (so
// that only one product's fragments are live): S = Q K^T and dP = dO V^T, or their transposes.
template <int D, int kN, int MT>
__device__ __forceinline__ void product(float (&x)[MT][kN / 8][4], const bf16* a, int a0, const bf16* b,
                                        const LaneOffsets& lo) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t fa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(fa[mt], frag<D>(a, a0 + 16 * mt, lo.a, kk));
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) {
            uint32_t fb[4];
            ldmatrix_x4(fb, frag<D>(b, np * 16, lo.b, kk));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma(x[mt][2 * np], fa[mt], fb[0], fb[1]);
                mma(x[mt][2 * np + 1], fa[mt], fb[2], fb[3]);
            }
        }
    }
}

// ---- forward ----
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale_log2) {
    constexpr int MT = kFwdTiles;
    TRAINER_DYNAMIC_SHARED(smem_raw);
    bf16* sq = reinterpret_cast<bf16*>(smem_raw);
    bf16* sk = sq + kFwdRows * D;  // two buffers of kKeys x D
    bf16* sv = sk + 2 * kKeys * D;
    const int n_qtiles = (T + kFwdRows - 1) / kFwdRows;
    const HeadBlock hb = head_block();
    const HeadRows<bf16> hr = head_rows<D>(qkv, hb.bh, T, NH);
    const int b = hr.b, h = hr.h;
    const int qt = n_qtiles - 1 - hb.block;  // block 0: the last query tile, which sees every key
    const int q0 = qt * kFwdRows;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const LaneOffsets lo = lane_offsets<D>(lane);
    const size_t stride = hr.stride;
    const bf16 *qbase = hr.q, *kbase = hr.k, *vbase = hr.v;

    load_tile<D, kFwdRows>(sq, qbase, stride, q0, T);
    load_tile<D, kKeys>(sk, kbase, stride, 0, T);
    load_tile<D, kKeys>(sv, vbase, stride, 0, T);
    cp_async_commit();

    // Per m-tile mt: rows g and g + 8 of its 16 (flash_tile.cuh).
    float o[MT][D / 8][4] = {};
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
    const int w0 = q0 + warp * 16 * MT;  // this warp's first query
    // Key tiles up to the block's last query (none past T): tile 0 has a key every query sees, so every row's
    // running maximum is finite from the first tile on.
    const int n_tiles = min((q0 + kFwdRows - 1) / kKeys + 1, (T + kKeys - 1) / kKeys);
    for_each_key_tile<D, kKeys>(sk, sv, kbase, vbase, stride, T, n_tiles, [&](int j, bf16* k_tile, bf16* v_tile) {
        const int k0 = j * kKeys;
        if (k0 > w0 + 16 * MT - 1) return;  // every key of the tile lies past this warp's queries
        // S = Q K^T for this warp's 16 MT rows and the tile's keys; each K fragment feeds every m-tile.
        float s[MT][kKeys / 8][4] = {};
        product<D, kKeys, MT>(s, sq, warp * 16 * MT, k_tile, lo);
        // Scale (base 2), the causal mask where a key may lie past one of the warp's queries, and the online
        // softmax.
        online_softmax<MT, kKeys, D>(s, m, l, o, k0, w0, k0 + kKeys - 1 > w0, scale_log2, g, t);
        // O += P V.
        accumulate_times_tile<D, kKeys, MT>(o, s, v_tile, lo.bt);
    });
    // Normalise, write bf16 out and the natural-log lse of the scaled scores.
    write_rows<MT, D>(out, lse, o, m, l, b, h, T, NH, w0, g, t);
}

// ---- backward ----
// D_i = sum_c dout_ic out_ic per (batch, head, query), from bf16 in fp32; one warp per row.
__global__ void flash_backward_dot_kernel(float* dsum, const bf16* dout, const bf16* out, int B, int T, int NH, int D) {
    const size_t row = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= static_cast<size_t>(B) * T * NH) return;
    const bf16* o = out + row * D;  // rows (b, t, h) are consecutive heads of D channels
    const bf16* d = dout + row * D;
    float acc = 0.0f;
    for (int c = lane * 2; c < D; c += 64) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + c));
        const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + c));
        acc += x.x * y.x + x.y * y.y;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        const int h = static_cast<int>(row % NH);
        const size_t bt = row / NH;
        const int b = static_cast<int>(bt / T), tq = static_cast<int>(bt % T);
        dsum[(static_cast<size_t>(b) * NH + h) * T + tq] = acc;
    }
}

// dK and dV of key tile `kt` of head `bh`.
template <int D>
__device__ __forceinline__ void backward_dkdv_tile(uint8_t* smem_raw, int bh, int kt, bf16* dqkv, const float* dsum,
                                                   const bf16* dout, const bf16* qkv, const float* lse, int T, int NH,
                                                   float scale, float scale_log2) {
    bf16* sk = reinterpret_cast<bf16*>(smem_raw);                    // kBwdKeys x D
    bf16* sv = sk + kBwdKeys * D;                                    // kBwdKeys x D
    bf16* sq = sv + kBwdKeys * D;                                    // two buffers of kBwdRows x D
    bf16* sdo = sq + 2 * kBwdRows * D;                               // two buffers of kBwdRows x D
    float* slse = reinterpret_cast<float*>(sdo + 2 * kBwdRows * D);  // two buffers of kBwdRows
    float* sdsum = slse + 2 * kBwdRows;                              // two buffers of kBwdRows

    const HeadRows<bf16> hr = head_rows<D>(qkv, bh, T, NH);
    const int k0 = kt * kBwdKeys;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t stride = hr.stride, ostride = hr.ostride;
    const size_t head_off = static_cast<size_t>(hr.q - qkv);
    const bf16 *qbase = hr.q, *kbase = hr.k, *vbase = hr.v;
    const bf16* dobase = dout + hr.o_off;
    const float* lse_bh = lse + static_cast<size_t>(bh) * T;
    const float* dsum_bh = dsum + static_cast<size_t>(bh) * T;
    const int n_qtiles = (T + kBwdRows - 1) / kBwdRows;
    const int first_qt = k0 / kBwdRows;  // query tiles before it see none of these keys

    auto load_query_tile = [&](int qt, int buf) {
        load_tile<D, kBwdRows>(sq + buf * kBwdRows * D, qbase, stride, qt * kBwdRows, T);
        load_tile<D, kBwdRows>(sdo + buf * kBwdRows * D, dobase, ostride, qt * kBwdRows, T);
        if (threadIdx.x < kBwdRows) {
            const int q = qt * kBwdRows + threadIdx.x;
            // Queries past T: lse +inf makes their P zero.
            slse[buf * kBwdRows + threadIdx.x] = q < T ? lse_bh[q] * kLog2e : INFINITY;
            sdsum[buf * kBwdRows + threadIdx.x] = q < T ? dsum_bh[q] : 0.0f;
        }
    };
    load_tile<D, kBwdKeys>(sk, kbase, stride, k0, T);
    load_tile<D, kBwdKeys>(sv, vbase, stride, k0, T);
    load_query_tile(first_qt, 0);
    cp_async_commit();

    const LaneOffsets lo = lane_offsets<D>(lane);
    float dk[1][D / 8][4] = {}, dv[1][D / 8][4] = {};
    const int key_lo = k0 + warp * 16 + g;  // this thread's first key (rows g and g + 8 of the warp)
    for (int qt = first_qt; qt < n_qtiles; ++qt) {
        const int buf = (qt - first_qt) & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile qt landed, and tile qt - 1's buffers free (as for_each_key_tile)
        if (qt + 1 < n_qtiles) {
            load_query_tile(qt + 1, buf ^ 1);
            cp_async_commit();
        }
        bf16* q_tile = sq + buf * kBwdRows * D;
        bf16* do_tile = sdo + buf * kBwdRows * D;
        const float* lse_t = slse + buf * kBwdRows;
        const float* dsum_t = sdsum + buf * kBwdRows;
        const int q0 = qt * kBwdRows;

        // S^T = K Q^T (16 keys x 32 queries) and dP^T = V dO^T.
        float s[1][kBwdRows / 8][4] = {}, dp[1][kBwdRows / 8][4] = {};
        product<D, kBwdRows, 1>(s, sk, warp * 16, q_tile, lo);
        product<D, kBwdRows, 1>(dp, sv, warp * 16, do_tile, lo);
        // P^T = exp2(S^T * scale_log2 - lse_log2) with the causal mask (key > query: 0); dS^T = P^T (dP^T - D).
        const bool diagonal = q0 < k0 + kBwdKeys;  // some key of the block lies past a query of the tile
#pragma unroll
        for (int nt = 0; nt < kBwdRows / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qc = nt * 8 + 2 * t + (e & 1), key = key_lo + (e >> 1) * 8;
                float p = exp2_ftz(fmaf(s[0][nt][e], scale_log2, -lse_t[qc]));
                if (diagonal && key > q0 + qc) p = 0.0f;
                s[0][nt][e] = p;
                dp[0][nt][e] = p * (dp[0][nt][e] - dsum_t[qc]);
            }
        }
        // dV += P^T dO and dK += dS^T Q (k = the tile's queries).
        accumulate_times_tile<D, kBwdRows, 1>(dv, s, do_tile, lo.bt);
        accumulate_times_tile<D, kBwdRows, 1>(dk, dp, q_tile, lo.bt);
    }
    // dK (scaled) and dV of this warp's 16 keys, as bf16 into dqkv.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_lo + r * 8;
        if (key >= T) continue;
        bf16* dkd = dqkv + head_off + static_cast<size_t>(key) * stride + static_cast<size_t>(NH) * D;
        bf16* dvd = dkd + static_cast<size_t>(NH) * D;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            *reinterpret_cast<uint32_t*>(dkd + nt * 8 + 2 * t) =
                pack_bf16(dk[0][nt][2 * r] * scale, dk[0][nt][2 * r + 1] * scale);
            *reinterpret_cast<uint32_t*>(dvd + nt * 8 + 2 * t) = pack_bf16(dv[0][nt][2 * r], dv[0][nt][2 * r + 1]);
        }
    }
}

// dQ of kDqRows queries of one (batch, head), 32 per warp (two m-tiles): key/value tiles of kDqKeys stream
// through shared memory (double-buffered) up to the block's last query, and a warp skips a tile whose keys all
// lie past its own queries; per tile S = Q K^T and dP = dO V^T in registers (each K and V fragment feeding
// both m-tiles), P = exp2(S * scale_log2 - lse_log2) masked, dS = P (dP - D), and dQ += dS K with dS from
// registers as the A operand and K through ldmatrix.trans. Each block sums its own rows over the key tiles in
// order: deterministic without atomics or any wait on another block.
template <int D>
__device__ __forceinline__ void backward_dq_tile(uint8_t* smem_raw, int bh, int qt, bf16* dqkv, const float* dsum,
                                                 const bf16* dout, const bf16* qkv, const float* lse, int T, int NH,
                                                 float scale, float scale_log2) {
    constexpr int MT = kDqTiles;
    bf16* sq = reinterpret_cast<bf16*>(smem_raw);
    bf16* sdo = sq + kDqRows * D;
    bf16* sk = sdo + kDqRows * D;  // two buffers of kDqKeys x D
    bf16* sv = sk + 2 * kDqKeys * D;
    float* slse = reinterpret_cast<float*>(sv + 2 * kDqKeys * D);  // kDqRows
    float* sdsum = slse + kDqRows;                                 // kDqRows
    const HeadRows<bf16> hr = head_rows<D>(qkv, bh, T, NH);
    const int b = hr.b, h = hr.h;
    const int q0 = qt * kDqRows;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const LaneOffsets lo = lane_offsets<D>(lane);
    const size_t stride = hr.stride, ostride = hr.ostride;
    const bf16 *qbase = hr.q, *kbase = hr.k, *vbase = hr.v;
    const bf16* dobase = dout + hr.o_off;

    load_tile<D, kDqRows>(sq, qbase, stride, q0, T);
    load_tile<D, kDqRows>(sdo, dobase, ostride, q0, T);
    load_tile<D, kDqKeys>(sk, kbase, stride, 0, T);
    load_tile<D, kDqKeys>(sv, vbase, stride, 0, T);
    cp_async_commit();

    // The block's lse and D in shared memory, not in registers (dQ, S and dP take nearly all of them).
    load_row_stats<kDqRows>(slse, sdsum, lse, dsum, bh, q0, T);
    const int w0 = q0 + warp * 16 * MT;  // this warp's first query; per m-tile mt, rows g and g + 8 of its 16
    float dq[MT][D / 8][4] = {};
    // Key tiles up to the block's last query (none past T).
    const int n_tiles = min((q0 + kDqRows - 1) / kDqKeys + 1, (T + kDqKeys - 1) / kDqKeys);
    for_each_key_tile<D, kDqKeys>(sk, sv, kbase, vbase, stride, T, n_tiles, [&](int j, bf16* k_tile, bf16* v_tile) {
        const int k0 = j * kDqKeys;
        if (k0 > w0 + 16 * MT - 1) return;  // every key of the tile lies past this warp's queries
        // S = Q K^T and dP = dO V^T for this warp's 32 rows and the tile's keys.
        float s[MT][kDqKeys / 8][4] = {}, dp[MT][kDqKeys / 8][4] = {};
        product<D, kDqKeys, MT>(s, sq, warp * 16 * MT, k_tile, lo);
        product<D, kDqKeys, MT>(dp, sdo, warp * 16 * MT, v_tile, lo);
        const bool diagonal = k0 + kDqKeys - 1 > w0;  // some key of the tile lies past one of the warp's queries
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kDqKeys / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + nt * 8 + 2 * t + (e & 1), row = w0 + mt * 16 + g + (e >> 1) * 8;
                    float p = exp2_ftz(fmaf(s[mt][nt][e], scale_log2, -slse[row - q0]));
                    if (diagonal && key > row) p = 0.0f;
                    dp[mt][nt][e] = p * (dp[mt][nt][e] - sdsum[row - q0]);
                }
            }
        }
        // dQ += dS K.
        accumulate_times_tile<D, kDqKeys, MT>(dq, dp, k_tile, lo.bt);
    });
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + mt * 16 + g + r * 8;
            if (row >= T) continue;
            bf16* dst = dqkv + (static_cast<size_t>(b) * T + row) * stride + static_cast<size_t>(h) * D;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                *reinterpret_cast<uint32_t*>(dst + nt * 8 + 2 * t) =
                    pack_bf16(dq[mt][nt][2 * r] * scale, dq[mt][nt][2 * r + 1] * scale);
            }
        }
    }
}

template <int D>
size_t forward_smem() {
    return static_cast<size_t>(kFwdRows + 4 * kKeys) * D * sizeof(bf16);
}
// The backward's tiles of a head: dQ tiles of kDqRows queries and dK/dV tiles of kBwdKeys keys.
__host__ __device__ inline int dq_tiles(int T) { return (T + kDqRows - 1) / kDqRows; }
__host__ __device__ inline int dkdv_tiles(int T) { return (T + kBwdKeys - 1) / kBwdKeys; }

// One launch for both kinds of tile (both fit the same registers here), so neither kind's tail leaves SMs idle.
// Blocks in head_block's order (flash_tile.cuh), a head's dQ tiles before its dK/dV tiles (a dQ tile is the
// longest block: 128 queries, three products), each kind longest first (the last query tile sees every key; key
// tile 0 sees every query): the launch ends on short dK/dV tiles.
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_kernel(bf16* dqkv, const float* dsum, const bf16* dout, const bf16* qkv, const float* lse, int T,
                          int NH, float scale, float scale_log2) {
    TRAINER_DYNAMIC_SHARED(smem_raw);
    const int n_dq = dq_tiles(T);
    const HeadBlock hb = head_block();
    if (hb.block < n_dq) {
        backward_dq_tile<D>(smem_raw, hb.bh, n_dq - 1 - hb.block, dqkv, dsum, dout, qkv, lse, T, NH, scale, scale_log2);
    } else {
        backward_dkdv_tile<D>(smem_raw, hb.bh, hb.block - n_dq, dqkv, dsum, dout, qkv, lse, T, NH, scale, scale_log2);
    }
}

template <int D>
size_t backward_dkdv_smem() {
    return static_cast<size_t>(2 * kBwdKeys + 4 * kBwdRows) * D * sizeof(bf16) + 4 * kBwdRows * sizeof(float);
}
template <int D>
size_t backward_dq_smem() {
    return static_cast<size_t>(2 * kDqRows + 4 * kDqKeys) * D * sizeof(bf16) + 2 * kDqRows * sizeof(float);
}

template <int D>
void forward_launch(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, cudaStream_t stream) {
    const size_t smem = forward_smem<D>();
    // Per launch: the attribute belongs to the current device's context.
    TRAINER_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    const dim3 grid = flash_grid(B * NH, (T + kFwdRows - 1) / kFwdRows, T, D);
    TRAINER_LAUNCH(flash_forward_kernel<D>, grid, kThreads, smem, stream, reinterpret_cast<bf16*>(out), lse,
                   reinterpret_cast<const bf16*>(qkv), T, NH, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <int D>
void backward_launch(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const float* lse, int B, int T, int NH,
                     const float* dsum, cudaStream_t stream) {
    const size_t smem = std::max(backward_dkdv_smem<D>(), backward_dq_smem<D>());
    TRAINER_CUDA_CHECK(cudaFuncSetAttribute(flash_backward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const auto* dout16 = reinterpret_cast<const bf16*>(dout);
    const auto* qkv16 = reinterpret_cast<const bf16*>(qkv);
    // dK/dV and dQ tiles, neither waiting on another block. Both recompute P (7 products per tile pair
    // instead of FlashAttention-2's 5) so that every sum has one owner and a fixed order; they write
    // disjoint parts of dqkv.
    const dim3 blocks = flash_grid(B * NH, dq_tiles(T) + dkdv_tiles(T), T, D);
    TRAINER_LAUNCH(flash_backward_kernel<D>, blocks, kThreads, smem, stream, reinterpret_cast<bf16*>(dqkv), dsum,
                   dout16, qkv16, lse, T, NH, scale, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool flash_attention_supported(int HS) { return HS == 64 || HS == 128; }

size_t flash_attention_backward_scratch_bytes(int B, int T, int NH, int HS) {
    (void)HS;
    return static_cast<size_t>(B) * NH * T * sizeof(float);  // D = rowsum(dO * O) per (batch, head, query)
}

void flash_attention_forward_sm80(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                                  cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    if (B == 0 || T == 0) return;
    if (HS == 64) return forward_launch<64>(out, lse, qkv, B, T, NH, stream);
    forward_launch<128>(out, lse, qkv, B, T, NH, stream);
}

void flash_attention_forward(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                             cudaStream_t stream) {
    if (flash_attention_sm90_available()) return flash_attention_forward_sm90(out, lse, qkv, B, T, NH, HS, stream);
    flash_attention_forward_sm80(out, lse, qkv, B, T, NH, HS, stream);
}

float* flash_attention_backward_dsum(const uint16_t* dout, const uint16_t* out, int B, int T, int NH, int HS,
                                     void* scratch, cudaStream_t stream) {
    auto* dsum = static_cast<float*>(scratch);
    const size_t rows = static_cast<size_t>(B) * NH * T;
    TRAINER_LAUNCH(flash_backward_dot_kernel, static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream, dsum,
                   reinterpret_cast<const bf16*>(dout), reinterpret_cast<const bf16*>(out), B, T, NH, HS);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    return dsum;
}

void flash_attention_backward_sm80(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                                   const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    if (B == 0 || T == 0) return;
    const float* dsum = flash_attention_backward_dsum(dout, out, B, T, NH, HS, scratch, stream);
    if (HS == 64) return backward_launch<64>(dqkv, dout, qkv, lse, B, T, NH, dsum, stream);
    backward_launch<128>(dqkv, dout, qkv, lse, B, T, NH, dsum, stream);
}

void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream) {
    if (flash_attention_sm90_available()) {
        return flash_attention_backward_sm90(dqkv, dout, qkv, out, lse, B, T, NH, HS, scratch, stream);
    }
    flash_attention_backward_sm80(dqkv, dout, qkv, out, lse, B, T, NH, HS, scratch, stream);
}

}  // namespace trainer::cuda
