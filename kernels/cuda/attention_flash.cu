// Our flash attention on tensor cores (kernels.attention=flash): causal scaled-dot-product attention on
// bf16 qkv (B, T, 3C), bf16 out (B, T, C) and the fp32 lse (B, NH, T) of the scaled scores, the contract
// of the native kernels (attention.cu) and of cuDNN's (attention_cudnn.cu). FlashAttention-2's algorithm
// with mma.sync m16n8k16 (bf16 in, fp32 accumulate), ldmatrix from XOR-swizzled shared memory and
// cp.async double buffering; heads of 64 or 128 channels.
//
// Forward: a block owns 64 queries of one (batch, head), 16 per warp; key/value tiles of 64 stream
// through shared memory (the next one loading while this one computes), only those the causal mask keeps.
// S = Q K^T and the online softmax stay in registers; P is rounded to bf16 and fed to P V from registers.
// Blocks are numbered head by head (within a head, from the last query tile, the most keys, to the
// first), so the blocks running at once share a few heads' K and V in L2 (numbered tile by tile across
// all heads, they streamed every head's K and V from DRAM: an L2 hit rate of 16% in the backward on an
// H100).
//
// Backward, deterministic, after a first kernel's D = rowsum(dO * O): one launch of two kinds of tile,
// neither waiting on another block: dK and dV per key tile, dQ per query tile. A dK/dV tile owns 64 keys
// (16 per warp) and walks the query tiles of 32 that see them: it recomputes P^T = exp(K Q^T * scale -
// lse) and accumulates dV += P^T dO and dK += dS^T Q in registers (dS = P (dP - D), dP = dO V^T). A dQ
// tile has the forward's tiling (64 queries a block, key tiles of 64 up to the diagonal) and accumulates dQ +=
// dS K in registers. FlashAttention-2 computes dQ in the dK/dV kernel and adds the key tiles' shares with
// fp32 atomics (not reproducible); here every sum has one owner that adds in a fixed order, at the price
// of recomputing S and dP a second time (7 products per tile pair instead of 5).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "base/common.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kFwdRows = 64;  // queries per forward block (16 per warp)
constexpr int kFwdKeys = 64;  // keys per forward tile
constexpr int kBwdKeys = 64;  // keys per backward block (16 per warp)
constexpr int kBwdRows = 32;  // queries per backward tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- PTX wrappers (sm_80+) ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, asynchronously; zero-filled when !valid (rows past T).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
// d += a (16x16, row) * b (16x8, col), bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
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

// A tile of `rows` x D bf16 in shared memory, rows of D/8 chunks of 16 bytes, chunk c of row r stored at
// chunk c ^ (r % 8): the 8 rows an ldmatrix reads at one logical chunk land in 8 distinct bank groups.
template <int D>
__device__ __forceinline__ bf16* at(bf16* tile, int row, int col) {
    return tile + row * D + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// Loads `rows` rows of D channels starting at global row `first` (stride `stride` elements, rows >=
// `limit` zero-filled) into a swizzled tile, with cp.async over the block's threads.
template <int D, int kRows>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, size_t stride, int first, int limit) {
    constexpr int kChunks = kRows * D / 8;
#pragma unroll
    for (int k = threadIdx.x; k < kChunks; k += kThreads) {
        const int r = k / (D / 8), c = (k % (D / 8)) * 8;
        const bool valid = first + r < limit;
        const bf16* g = src + static_cast<size_t>(valid ? first + r : 0) * stride + c;
        cp_async16(at<D>(tile, r, c), g, valid);
    }
}

// The key/value tiles 0 .. n_tiles - 1 (64 keys each, of one head) through two shared-memory buffers each
// (the next tile loading while body(j, k_tile, v_tile) computes on this one); tile 0 must be queued (and
// committed) by the caller, with whatever else body's first call reads. Every warp finishes body before
// the buffer it read is refilled.
template <int D, typename Body>
__device__ __forceinline__ void for_each_key_tile(bf16* sk, bf16* sv, const bf16* kbase, const bf16* vbase,
                                                  size_t stride, int T, int n_tiles, Body body) {
    for (int j = 0; j < n_tiles; ++j) {
        if (j + 1 < n_tiles) {
            const int nb = (j + 1) & 1;
            load_tile<D, kFwdKeys>(sk + nb * kFwdKeys * D, kbase, stride, (j + 1) * kFwdKeys, T);
            load_tile<D, kFwdKeys>(sv + nb * kFwdKeys * D, vbase, stride, (j + 1) * kFwdKeys, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        body(j, sk + (j & 1) * kFwdKeys * D, sv + (j & 1) * kFwdKeys * D);
        __syncthreads();
    }
}

// acc (a warp's 16 rows x D) += A B, A the warp's 16 x kK accumulators of a product over a tile (P or dS,
// or their transposes; rounded to bf16 and fed from registers as the A operand, 16 a k-step) and B the
// tile's kK rows x D (V or K; dO or Q) through ldmatrix.trans.
template <int D, int kK = kFwdKeys>
__device__ __forceinline__ void accumulate_times_tile(float (&acc)[D / 8][4], const float (&a)[kK / 8][4], bf16* tile,
                                                      int lane) {
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        uint32_t af[4];
        pack_a(af, a[2 * kk], a[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, at<D>(tile, kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, np * 16 + (lane / 16) * 8));
            mma(acc[2 * np], af, b[0], b[1]);
            mma(acc[2 * np + 1], af, b[2], b[3]);
        }
    }
}

// x += A1 B1^T and y += A2 B2^T over D channels, for a warp: A1 and A2 its 16 rows (from row a0) of two
// shared tiles (ldmatrix), B1 and B2 the kN rows of two others (ldmatrix, as the col-major B operand). The
// backward's two products of every tile: S = Q K^T with dP = dO V^T, or their transposes.
template <int D, int kN>
__device__ __forceinline__ void two_products(float (&x)[kN / 8][4], float (&y)[kN / 8][4], bf16* a1, bf16* a2, int a0,
                                             bf16* b1, bf16* b2, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t fa1[4], fa2[4];
        ldmatrix_x4(fa1, at<D>(a1, a0 + (lane % 16), kk * 16 + (lane / 16) * 8));
        ldmatrix_x4(fa2, at<D>(a2, a0 + (lane % 16), kk * 16 + (lane / 16) * 8));
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) {
            const int r = np * 16 + (lane % 8) + (lane / 16) * 8, c = kk * 16 + ((lane / 8) % 2) * 8;
            uint32_t fb1[4], fb2[4];
            ldmatrix_x4(fb1, at<D>(b1, r, c));
            ldmatrix_x4(fb2, at<D>(b2, r, c));
            mma(x[2 * np], fa1, fb1[0], fb1[1]);
            mma(x[2 * np + 1], fa1, fb1[2], fb1[3]);
            mma(y[2 * np], fa2, fb2[0], fb2[1]);
            mma(y[2 * np + 1], fa2, fb2[2], fb2[3]);
        }
    }
}

// ---- forward ----
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale_log2) {
    extern __shared__ __align__(128) uint8_t smem_raw[];
    bf16* sq = reinterpret_cast<bf16*>(smem_raw);
    bf16* sk = sq + kFwdRows * D;  // two buffers of kFwdKeys x D
    bf16* sv = sk + 2 * kFwdKeys * D;
    const int n_qtiles = (T + kFwdRows - 1) / kFwdRows;
    const int bh = static_cast<int>(blockIdx.x / n_qtiles), b = bh / NH, h = bh % NH;
    const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.x % n_qtiles);  // the last query tile (most keys) first
    const int q0 = qt * kFwdRows;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t stride = static_cast<size_t>(3) * NH * D;
    const bf16* qbase = qkv + static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * D;
    const bf16* kbase = qbase + static_cast<size_t>(NH) * D;
    const bf16* vbase = kbase + static_cast<size_t>(NH) * D;

    load_tile<D, kFwdRows>(sq, qbase, stride, q0, T);
    load_tile<D, kFwdKeys>(sk, kbase, stride, 0, T);
    load_tile<D, kFwdKeys>(sv, vbase, stride, 0, T);
    cp_async_commit();

    float o[D / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of this warp
    uint32_t qf[D / 16][4];
    const int n_tiles = (q0 + kFwdRows - 1) / kFwdKeys + 1;  // key tiles up to the diagonal
    const int row_lo = q0 + warp * 16 + g;                   // this thread's first query
    for_each_key_tile<D>(sk, sv, kbase, vbase, stride, T, n_tiles, [&](int j, bf16* k_tile, bf16* v_tile) {
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(qf[kk], at<D>(sq, warp * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
        }
        // S = Q K^T for this warp's 16 rows and the tile's 64 keys.
        float s[kFwdKeys / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < kFwdKeys / 16; ++np) {
                uint32_t bk[4];
                ldmatrix_x4(bk, at<D>(k_tile, np * 16 + (lane % 8) + (lane / 16) * 8, kk * 16 + ((lane / 8) % 2) * 8));
                mma(s[2 * np], qf[kk], bk[0], bk[1]);
                mma(s[2 * np + 1], qf[kk], bk[2], bk[3]);
            }
        }
        // Scale (base 2), the causal mask on the diagonal tiles, and the online softmax.
        const int k0 = j * kFwdKeys;
        const bool diagonal = k0 + kFwdKeys - 1 > q0;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < kFwdKeys / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + (e >> 1) * 8;
                float x = s[nt][e] * scale_log2;
                if (diagonal && key > row) x = -INFINITY;
                s[nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        float alpha[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) alpha[r] = exp2f(m[r] - mx[r]), m[r] = mx[r];
#pragma unroll
        for (int nt = 0; nt < kFwdKeys / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - m[e >> 1]);
                rs[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + rs[r];  // quad-partial sums, reduced at the end
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
            o[nt][0] *= alpha[0], o[nt][1] *= alpha[0], o[nt][2] *= alpha[1], o[nt][3] *= alpha[1];
        // O += P V.
        accumulate_times_tile<D>(o, s, v_tile, lane);
    });
    // Normalise, write bf16 out and the natural-log lse of the scaled scores.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const size_t out_stride = static_cast<size_t>(NH) * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_lo + r * 8;
        if (row >= T) continue;
        const float inv = 1.0f / l[r];
        bf16* dst = out + (static_cast<size_t>(b) * T + row) * out_stride + static_cast<size_t>(h) * D;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            *reinterpret_cast<uint32_t*>(dst + nt * 8 + 2 * t) = pack_bf16(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
        }
        if (t == 0) lse[(static_cast<size_t>(b) * NH + h) * T + row] = (m[r] + log2f(l[r])) * kLn2;
    }
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

    const int b = bh / NH, h = bh % NH;
    const int k0 = kt * kBwdKeys;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t stride = static_cast<size_t>(3) * NH * D;
    const size_t head_off = static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * D;
    const bf16* qbase = qkv + head_off;
    const bf16* kbase = qbase + static_cast<size_t>(NH) * D;
    const bf16* vbase = kbase + static_cast<size_t>(NH) * D;
    const size_t ostride = static_cast<size_t>(NH) * D;
    const bf16* dobase = dout + static_cast<size_t>(b) * T * ostride + static_cast<size_t>(h) * D;
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

    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    const int key_lo = k0 + warp * 16 + g;  // this thread's first key (rows g and g + 8 of the warp)
    for (int qt = first_qt; qt < n_qtiles; ++qt) {
        const int buf = (qt - first_qt) & 1;
        if (qt + 1 < n_qtiles) {
            load_query_tile(qt + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        bf16* q_tile = sq + buf * kBwdRows * D;
        bf16* do_tile = sdo + buf * kBwdRows * D;
        const float* lse_t = slse + buf * kBwdRows;
        const float* dsum_t = sdsum + buf * kBwdRows;
        const int q0 = qt * kBwdRows;

        // S^T = K Q^T (16 keys x 32 queries) and dP^T = V dO^T.
        float s[kBwdRows / 8][4] = {}, dp[kBwdRows / 8][4] = {};
        two_products<D, kBwdRows>(s, dp, sk, sv, warp * 16, q_tile, do_tile, lane);
        // P^T = exp2(S^T * scale_log2 - lse_log2) with the causal mask (key > query: 0); dS^T = P^T (dP^T - D).
        const bool diagonal = q0 < k0 + kBwdKeys;  // some key of the block lies past a query of the tile
#pragma unroll
        for (int nt = 0; nt < kBwdRows / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qc = nt * 8 + 2 * t + (e & 1), key = key_lo + (e >> 1) * 8;
                float p = exp2f(s[nt][e] * scale_log2 - lse_t[qc]);
                if (diagonal && key > q0 + qc) p = 0.0f;
                s[nt][e] = p;
                dp[nt][e] = p * (dp[nt][e] - dsum_t[qc]);
            }
        }
        // dV += P^T dO and dK += dS^T Q (k = the tile's queries).
        accumulate_times_tile<D, kBwdRows>(dv, s, do_tile, lane);
        accumulate_times_tile<D, kBwdRows>(dk, dp, q_tile, lane);
        __syncthreads();  // every warp is done with this buffer before the next iteration refills it
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
                pack_bf16(dk[nt][2 * r] * scale, dk[nt][2 * r + 1] * scale);
            *reinterpret_cast<uint32_t*>(dvd + nt * 8 + 2 * t) = pack_bf16(dv[nt][2 * r], dv[nt][2 * r + 1]);
        }
    }
}

// dQ of 64 queries of one (batch, head), 16 per warp, the forward's tiling: key/value tiles of 64 stream
// through shared memory (double-buffered) up to the diagonal; per tile S = Q K^T and dP = dO V^T in
// registers, P = exp2(S * scale_log2 - lse_log2) masked, dS = P (dP - D), and dQ += dS K with dS from
// registers as the A operand and K through ldmatrix.trans. Each block sums its own rows over the key
// tiles in order: deterministic without atomics or any wait on another block.
template <int D>
__device__ __forceinline__ void backward_dq_tile(uint8_t* smem_raw, int bh, int qt, bf16* dqkv, const float* dsum,
                                                 const bf16* dout, const bf16* qkv, const float* lse, int T, int NH,
                                                 float scale, float scale_log2) {
    bf16* sq = reinterpret_cast<bf16*>(smem_raw);
    bf16* sdo = sq + kFwdRows * D;
    bf16* sk = sdo + kFwdRows * D;  // two buffers of kFwdKeys x D
    bf16* sv = sk + 2 * kFwdKeys * D;
    const int b = bh / NH, h = bh % NH;
    const int q0 = qt * kFwdRows;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t stride = static_cast<size_t>(3) * NH * D;
    const bf16* qbase = qkv + static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * D;
    const bf16* kbase = qbase + static_cast<size_t>(NH) * D;
    const bf16* vbase = kbase + static_cast<size_t>(NH) * D;
    const size_t ostride = static_cast<size_t>(NH) * D;
    const bf16* dobase = dout + static_cast<size_t>(b) * T * ostride + static_cast<size_t>(h) * D;

    load_tile<D, kFwdRows>(sq, qbase, stride, q0, T);
    load_tile<D, kFwdRows>(sdo, dobase, ostride, q0, T);
    load_tile<D, kFwdKeys>(sk, kbase, stride, 0, T);
    load_tile<D, kFwdKeys>(sv, vbase, stride, 0, T);
    cp_async_commit();

    const int row_lo = q0 + warp * 16 + g;  // this thread's first query (rows g and g + 8 of the warp)
    float lse_r[2], dsum_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_lo + r * 8;
        // Rows past T: lse +inf makes their P zero (and they are not written).
        lse_r[r] = row < T ? lse[static_cast<size_t>(bh) * T + row] * kLog2e : INFINITY;
        dsum_r[r] = row < T ? dsum[static_cast<size_t>(bh) * T + row] : 0.0f;
    }
    float dq[D / 8][4] = {};
    const int n_tiles = (q0 + kFwdRows - 1) / kFwdKeys + 1;  // key tiles up to the diagonal
    for_each_key_tile<D>(sk, sv, kbase, vbase, stride, T, n_tiles, [&](int j, bf16* k_tile, bf16* v_tile) {
        // S = Q K^T and dP = dO V^T for this warp's 16 rows and the tile's 64 keys.
        float s[kFwdKeys / 8][4] = {}, dp[kFwdKeys / 8][4] = {};
        two_products<D, kFwdKeys>(s, dp, sq, sdo, warp * 16, k_tile, v_tile, lane);
        const int k0 = j * kFwdKeys;
        const bool diagonal = k0 + kFwdKeys - 1 > q0;
#pragma unroll
        for (int nt = 0; nt < kFwdKeys / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + (e >> 1) * 8;
                float p = exp2f(s[nt][e] * scale_log2 - lse_r[e >> 1]);
                if (diagonal && key > row) p = 0.0f;
                dp[nt][e] = p * (dp[nt][e] - dsum_r[e >> 1]);
            }
        }
        // dQ += dS K.
        accumulate_times_tile<D>(dq, dp, k_tile, lane);
    });
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_lo + r * 8;
        if (row >= T) continue;
        bf16* dst = dqkv + (static_cast<size_t>(b) * T + row) * stride + static_cast<size_t>(h) * D;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            *reinterpret_cast<uint32_t*>(dst + nt * 8 + 2 * t) =
                pack_bf16(dq[nt][2 * r] * scale, dq[nt][2 * r + 1] * scale);
        }
    }
}

template <int D>
size_t forward_smem() {
    return static_cast<size_t>(kFwdRows + 4 * kFwdKeys) * D * sizeof(bf16);
}
// One launch for both kinds of tile, so neither kind's tail leaves SMs idle. Blocks go head by head (the
// blocks running at once share a few heads' Q, K, V and dO in L2); within a head, block i takes dK/dV
// tile i / 2 (even i) or dQ tile i / 2 (odd i), each kind ordered longest first (key tile 0 sees every
// query; the last query tile sees every key). kBwdKeys == kFwdRows: both kinds have T / 64 tiles a head.
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_kernel(bf16* dqkv, const float* dsum, const bf16* dout, const bf16* qkv, const float* lse, int T,
                          int NH, float scale, float scale_log2) {
    extern __shared__ __align__(128) uint8_t smem_raw[];
    const int n_tiles = (T + kFwdRows - 1) / kFwdRows;
    const int bh = static_cast<int>(blockIdx.x / (2 * n_tiles)), within = static_cast<int>(blockIdx.x % (2 * n_tiles));
    const int rank = within / 2;
    if (within % 2 == 0) {
        backward_dkdv_tile<D>(smem_raw, bh, rank, dqkv, dsum, dout, qkv, lse, T, NH, scale, scale_log2);
    } else {
        backward_dq_tile<D>(smem_raw, bh, n_tiles - 1 - rank, dqkv, dsum, dout, qkv, lse, T, NH, scale, scale_log2);
    }
}
static_assert(kBwdKeys == kFwdRows, "the merged backward pairs the two kinds of tile one for one");

template <int D>
size_t backward_dkdv_smem() {
    return static_cast<size_t>(2 * kBwdKeys + 4 * kBwdRows) * D * sizeof(bf16) + 4 * kBwdRows * sizeof(float);
}
template <int D>
size_t backward_dq_smem() {
    return static_cast<size_t>(2 * kFwdRows + 4 * kFwdKeys) * D * sizeof(bf16);
}

// log2(e) / sqrt(D): exp(x / sqrt(D)) = exp2(x * this), the same constant in the forward and the backward.
float scale_log2e(int D) { return kLog2e / std::sqrt(static_cast<float>(D)); }

template <int D>
void forward_launch(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, cudaStream_t stream) {
    const size_t smem = forward_smem<D>();
    // Per launch: the attribute belongs to the current device's context.
    TRAINER_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    const unsigned grid = static_cast<unsigned>((T + kFwdRows - 1) / kFwdRows) * static_cast<unsigned>(B * NH);
    flash_forward_kernel<D><<<grid, kThreads, smem, stream>>>(
        reinterpret_cast<bf16*>(out), lse, reinterpret_cast<const bf16*>(qkv), T, NH, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <int D>
void backward_launch(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out, const float* lse,
                     int B, int T, int NH, void* scratch, cudaStream_t stream) {
    const size_t smem = std::max(backward_dkdv_smem<D>(), backward_dq_smem<D>());
    TRAINER_CUDA_CHECK(cudaFuncSetAttribute(flash_backward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    const size_t rows = static_cast<size_t>(B) * NH * T;
    auto* dsum = static_cast<float*>(scratch);
    flash_backward_dot_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(
        dsum, reinterpret_cast<const bf16*>(dout), reinterpret_cast<const bf16*>(out), B, T, NH, D);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const auto* dout16 = reinterpret_cast<const bf16*>(dout);
    const auto* qkv16 = reinterpret_cast<const bf16*>(qkv);
    // dK/dV and dQ tiles, neither waiting on another block. Both recompute P (7 products per tile pair
    // instead of FlashAttention-2's 5) so that every sum has one owner and a fixed order; they write
    // disjoint parts of dqkv.
    const unsigned blocks = 2u * static_cast<unsigned>(B * NH) * static_cast<unsigned>((T + kBwdKeys - 1) / kBwdKeys);
    flash_backward_kernel<D><<<blocks, kThreads, smem, stream>>>(reinterpret_cast<bf16*>(dqkv), dsum, dout16, qkv16,
                                                                 lse, T, NH, scale, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool flash_attention_supported(int HS) { return HS == 64 || HS == 128; }

size_t flash_attention_backward_scratch_bytes(int B, int T, int NH, int HS) {
    (void)HS;
    return static_cast<size_t>(B) * NH * T * sizeof(float);  // D = rowsum(dO * O) per (batch, head, query)
}

void flash_attention_forward(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                             cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    if (B == 0 || T == 0) return;
    if (HS == 64) return forward_launch<64>(out, lse, qkv, B, T, NH, stream);
    forward_launch<128>(out, lse, qkv, B, T, NH, stream);
}

void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    if (B == 0 || T == 0) return;
    if (HS == 64) return backward_launch<64>(dqkv, dout, qkv, out, lse, B, T, NH, scratch, stream);
    backward_launch<128>(dqkv, dout, qkv, out, lse, B, T, NH, scratch, stream);
}

}  // namespace trainer::cuda
