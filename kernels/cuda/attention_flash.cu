// Our flash attention on tensor cores (kernels.attention=flash): causal scaled-dot-product attention on
// bf16 qkv (B, T, 3C), bf16 out (B, T, C) and the fp32 lse (B, NH, T) of the scaled scores, the contract
// of the native kernels (attention.cu) and of cuDNN's (attention_cudnn.cu). FlashAttention-2's algorithm
// with mma.sync m16n8k16 (bf16 in, fp32 accumulate), ldmatrix from XOR-swizzled shared memory and
// cp.async double buffering; heads of 64 or 128 channels.
//
// Forward: a block owns 64 queries of one (batch, head), 16 per warp; key/value tiles of 64 stream
// through shared memory (the next one loading while this one computes), only those the causal mask keeps.
// S = Q K^T and the online softmax stay in registers; P is rounded to bf16 and fed to P V from registers.
// Grid y walks the query tiles from the last (the most keys) to the first, so the long blocks start first.
//
// Backward, deterministic: a block owns 64 keys (16 per warp) and walks the query tiles of 32 that see
// them. It recomputes P^T = exp(K Q^T * scale - lse), accumulates dV += P^T dO and dK += dS^T Q in
// registers (dS = P (dO V^T - D), D = rowsum(dO * O) from a first kernel), and forms this block's
// share of dQ = dS K for the query tile. The shares of the key tiles are added into an fp32 dQ buffer in
// key-tile order, a per-(head, query tile) counter letting key tile j add only after j - 1 has: no
// atomics in the sums, so two runs are bitwise equal. Blocks take their (head, key tile) from a ticket in
// the order they start, key tile 0 of every head first, so a block only ever waits for blocks already
// running. A last kernel scales dQ and writes it as bf16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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

// ---- forward ----
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale_log2) {
    extern __shared__ __align__(128) uint8_t smem_raw[];
    bf16* sq = reinterpret_cast<bf16*>(smem_raw);
    bf16* sk = sq + kFwdRows * D;  // two buffers of kFwdKeys x D
    bf16* sv = sk + 2 * kFwdKeys * D;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int qt = gridDim.y - 1 - blockIdx.y;  // the last query tile (most keys) first
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
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(qf[kk], at<D>(sq, warp * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
        }
        bf16* k_tile = sk + (j & 1) * kFwdKeys * D;
        bf16* v_tile = sv + (j & 1) * kFwdKeys * D;
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
            // O += P V: P from registers as the A operand (16 keys a k-step), V through ldmatrix.trans.
#pragma unroll
        for (int kk = 0; kk < kFwdKeys / 16; ++kk) {
            uint32_t pa[4];
            pack_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                uint32_t bv[4];
                ldmatrix_x4_trans(
                    bv, at<D>(v_tile, kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, np * 16 + (lane / 16) * 8));
                mma(o[2 * np], pa, bv[0], bv[1]);
                mma(o[2 * np + 1], pa, bv[2], bv[3]);
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next iteration refills it
    }
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

template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_kernel(bf16* dqkv, float* dq_acc, int* turn, int* ticket, const float* dsum, const bf16* dout,
                          const bf16* qkv, const float* lse, int T, int NH, int BNH, float scale, float scale_log2) {
    extern __shared__ __align__(128) uint8_t smem_raw[];
    bf16* sk = reinterpret_cast<bf16*>(smem_raw);                        // kBwdKeys x D
    bf16* sv = sk + kBwdKeys * D;                                        // kBwdKeys x D
    bf16* sq = sv + kBwdKeys * D;                                        // two buffers of kBwdRows x D
    bf16* sdo = sq + 2 * kBwdRows * D;                                   // two buffers of kBwdRows x D
    constexpr int kDsStride = kBwdRows + 8;                              // padded rows: conflict-free ldmatrix.trans
    bf16* sds = sdo + 2 * kBwdRows * D;                                  // kBwdKeys x kDsStride: dS^T of this tile
    float* slse = reinterpret_cast<float*>(sds + kBwdKeys * kDsStride);  // two buffers of kBwdRows
    float* sdsum = slse + 2 * kBwdRows;                                  // two buffers of kBwdRows

    // Work in the order blocks start, not by blockIdx (CUDA does not promise to dispatch blocks in index
    // order): ticket t is key tile t / BNH of head t % BNH, so every key tile a block waits for (a lower one
    // of its head) belongs to a block that has already started.
    __shared__ int s_ticket;
    if (threadIdx.x == 0) s_ticket = atomicAdd(ticket, 1);
    __syncthreads();
    const int bh = s_ticket % BNH, b = bh / NH, h = bh % NH;
    const int kt = s_ticket / BNH, k0 = kt * kBwdKeys;
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

        // S^T = K Q^T (16 keys x 32 queries) and dP^T = V dO^T, A from K / V rows, B from Q / dO rows.
        float s[kBwdRows / 8][4] = {}, dp[kBwdRows / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t ka[4], va[4];
            ldmatrix_x4(ka, at<D>(sk, warp * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
            ldmatrix_x4(va, at<D>(sv, warp * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int np = 0; np < kBwdRows / 16; ++np) {
                uint32_t qb[4], db[4];
                const int r = np * 16 + (lane % 8) + (lane / 16) * 8, c = kk * 16 + ((lane / 8) % 2) * 8;
                ldmatrix_x4(qb, at<D>(q_tile, r, c));
                ldmatrix_x4(db, at<D>(do_tile, r, c));
                mma(s[2 * np], ka, qb[0], qb[1]);
                mma(s[2 * np + 1], ka, qb[2], qb[3]);
                mma(dp[2 * np], va, db[0], db[1]);
                mma(dp[2 * np + 1], va, db[2], db[3]);
            }
        }
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
        // dV += P^T dO and dK += dS^T Q: A from registers (k = queries), B through ldmatrix.trans.
#pragma unroll
        for (int kk = 0; kk < kBwdRows / 16; ++kk) {
            uint32_t pa[4];
            pack_a(pa, s[2 * kk], s[2 * kk + 1]);
            uint32_t da[4];
            pack_a(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                const int r = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, c = np * 16 + (lane / 16) * 8;
                uint32_t ob[4], qb[4];
                ldmatrix_x4_trans(ob, at<D>(do_tile, r, c));
                ldmatrix_x4_trans(qb, at<D>(q_tile, r, c));
                mma(dv[2 * np], pa, ob[0], ob[1]);
                mma(dv[2 * np + 1], pa, ob[2], ob[3]);
                mma(dk[2 * np], da, qb[0], qb[1]);
                mma(dk[2 * np + 1], da, qb[2], qb[3]);
            }
            // This warp's dS^T rows (its 16 keys) into shared memory for the dQ product.
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int qc = kk * 16 + half * 8 + 2 * t;
                *reinterpret_cast<uint32_t*>(sds + (warp * 16 + g) * kDsStride + qc) = da[2 * half];
                *reinterpret_cast<uint32_t*>(sds + (warp * 16 + g + 8) * kDsStride + qc) = da[2 * half + 1];
            }
        }
        __syncthreads();
        // dQ share = dS K (32 queries x D over the block's 64 keys): warp w takes queries (w % 2) * 16 and
        // channels (w / 2) * D/2; A = dS from dS^T through ldmatrix.trans, B = K through ldmatrix.trans.
        constexpr int kHalf = D / 2;
        float dq[kHalf / 8][4] = {};
        const int qrow = (warp % 2) * 16, cbase = (warp / 2) * kHalf;
#pragma unroll
        for (int kk = 0; kk < kBwdKeys / 16; ++kk) {
            uint32_t a[4];
            ldmatrix_x4_trans(a,
                              sds + (kk * 16 + (lane % 8) + (lane / 16) * 8) * kDsStride + qrow + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int np = 0; np < kHalf / 16; ++np) {
                uint32_t kb[4];
                ldmatrix_x4_trans(
                    kb, at<D>(sk, kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, cbase + np * 16 + (lane / 16) * 8));
                mma(dq[2 * np], a, kb[0], kb[1]);
                mma(dq[2 * np + 1], a, kb[2], kb[3]);
            }
        }
        // Add this key tile's share after the key tiles before it (fixed order: deterministic sums).
        int* my_turn = turn + static_cast<size_t>(bh) * n_qtiles + qt;
        const int order = kt;  // key tiles 0, 1, ... add their shares to this query tile in turn
        if (threadIdx.x == 0) {
            while (atomicAdd(my_turn, 0) != order) {
            }
            __threadfence();
        }
        __syncthreads();
        float* acc = dq_acc + (static_cast<size_t>(bh) * T) * D;
#pragma unroll
        for (int nt = 0; nt < kHalf / 8; ++nt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int q = q0 + qrow + g + r * 8;
                if (q >= T) continue;
                // Through L2 (ld/st .cg): another SM wrote these last, and L1 is not coherent.
                float2* p = reinterpret_cast<float2*>(acc + static_cast<size_t>(q) * D + cbase + nt * 8 + 2 * t);
                float2 v = __ldcg(p);
                v.x += dq[nt][2 * r], v.y += dq[nt][2 * r + 1];
                __stcg(p, v);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // release: every thread's additions are done (barrier) and visible (fence)
            __threadfence();
            atomicExch(my_turn, order + 1);
        }
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

// dq (B, T, q part of 3C) = scale * dq_acc (B, NH, T, D), as bf16.
__global__ void flash_backward_dq_kernel(bf16* dqkv, const float* dq_acc, int B, int T, int NH, int D, float scale) {
    const size_t n2 = static_cast<size_t>(B) * NH * T * D / 2;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n2;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t e = 2 * i;
        const int c = static_cast<int>(e % D);
        const size_t row = e / D;  // (b, h, t)
        const int tq = static_cast<int>(row % T), h = static_cast<int>((row / T) % NH),
                  b = static_cast<int>(row / T / NH);
        const float2 v = *reinterpret_cast<const float2*>(dq_acc + e);
        *reinterpret_cast<__nv_bfloat162*>(dqkv + (static_cast<size_t>(b) * T + tq) * 3 * NH * D +
                                           static_cast<size_t>(h) * D + c) =
            __floats2bfloat162_rn(v.x * scale, v.y * scale);
    }
}

template <int D>
size_t forward_smem() {
    return static_cast<size_t>(kFwdRows + 4 * kFwdKeys) * D * sizeof(bf16);
}
template <int D>
size_t backward_smem() {
    return static_cast<size_t>(2 * kBwdKeys + 4 * kBwdRows) * D * sizeof(bf16) +
           static_cast<size_t>(kBwdKeys) * (kBwdRows + 8) * sizeof(bf16) + 4 * kBwdRows * sizeof(float);
}

// log2(e) / sqrt(D): exp(x / sqrt(D)) = exp2(x * this), the same constant in the forward and the backward.
float scale_log2e(int D) { return kLog2e / std::sqrt(static_cast<float>(D)); }

template <int D>
void forward_launch(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, cudaStream_t stream) {
    const size_t smem = forward_smem<D>();
    // Per launch: the attribute belongs to the current device's context.
    TRAINER_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    const dim3 grid(B * NH, (T + kFwdRows - 1) / kFwdRows);
    flash_forward_kernel<D><<<grid, kThreads, smem, stream>>>(
        reinterpret_cast<bf16*>(out), lse, reinterpret_cast<const bf16*>(qkv), T, NH, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <int D>
void backward_launch(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out, const float* lse,
                     int B, int T, int NH, void* scratch, cudaStream_t stream) {
    const size_t smem = backward_smem<D>();
    TRAINER_CUDA_CHECK(cudaFuncSetAttribute(flash_backward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    const size_t rows = static_cast<size_t>(B) * NH * T;
    const int n_qtiles = (T + kBwdRows - 1) / kBwdRows, n_ktiles = (T + kBwdKeys - 1) / kBwdKeys;
    auto* dq_acc = static_cast<float*>(scratch);
    auto* dsum = dq_acc + rows * D;
    auto* ticket = reinterpret_cast<int*>(dsum + rows);  // then the turn counters
    int* turn = ticket + 1;
    TRAINER_CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, rows * D * sizeof(float), stream));
    TRAINER_CUDA_CHECK(cudaMemsetAsync(ticket, 0, (1 + static_cast<size_t>(B) * NH * n_qtiles) * sizeof(int), stream));
    flash_backward_dot_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(
        dsum, reinterpret_cast<const bf16*>(dout), reinterpret_cast<const bf16*>(out), B, T, NH, D);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    flash_backward_kernel<D><<<static_cast<unsigned>(B * NH * n_ktiles), kThreads, smem, stream>>>(
        reinterpret_cast<bf16*>(dqkv), dq_acc, turn, ticket, dsum, reinterpret_cast<const bf16*>(dout),
        reinterpret_cast<const bf16*>(qkv), lse, T, NH, B * NH, scale, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
    flash_backward_dq_kernel<<<grid_for(rows * D / 2, 256), 256, 0, stream>>>(reinterpret_cast<bf16*>(dqkv), dq_acc, B,
                                                                              T, NH, D, scale);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool flash_attention_supported(int HS) { return HS == 64 || HS == 128; }

size_t flash_attention_backward_scratch_bytes(int B, int T, int NH, int HS) {
    const size_t rows = static_cast<size_t>(B) * NH * T;
    const size_t n_qtiles = (static_cast<size_t>(T) + kBwdRows - 1) / kBwdRows;
    return rows * HS * sizeof(float) + rows * sizeof(float) +
           (1 + static_cast<size_t>(B) * NH * n_qtiles) * sizeof(int);
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
