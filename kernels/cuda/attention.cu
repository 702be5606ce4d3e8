// Causal scaled-dot-product attention on the GPU: the native reference and fallback path (the fast path is
// cuDNN's fused attention, attention_cudnn.cu), the twin of kernels/cpu/attention.cpp, in fp32.
//
// Flash-attention style and tiled. A block owns a tile of rows (queries in the forward and dq, keys in
// dk/dv) of one (batch, head); the other side streams through shared memory in tiles of kTile rows, and
// only the tiles the causal mask keeps are visited. Each row is handled by TPR consecutive lanes of a
// warp, each owning every TPR-th channel of the head (so lanes read consecutive shared-memory words: no
// bank conflicts), with dot products completed by warp shuffles. The forward keeps an online softmax (running
// max, sum, weighted values) in registers and saves lse(B, NH, T); nothing of size T x T exists.
// The backward recomputes probabilities from lse: D_i = dout_i . out_i; dq_i = scale sum_{j<=i} P_ij
// (dP_ij - D_i) k_j per query; dk_j, dv_j per key over i >= j. No atomics: each output is summed in a
// fixed order, so results are identical run to run (not bitwise equal to the CPU, whose blocking differs).
#include <cmath>
#include <type_traits>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr int kMaxHS = kCudaNativeAttentionMaxHeadSize;
constexpr int kMaxPerLane = 32;  // channels per lane: TPR lanes cover a head of up to 32 x TPR channels
constexpr int kThreads = 128;

struct Dims {
    int B, T, NH, HS;
    __device__ size_t row(int b, int t) const { return (static_cast<size_t>(b) * T + t) * 3 * NH * HS; }
    __device__ size_t q(int b, int t, int h) const { return row(b, t) + static_cast<size_t>(h) * HS; }
    __device__ size_t k(int b, int t, int h) const { return q(b, t, h) + static_cast<size_t>(NH) * HS; }
    __device__ size_t v(int b, int t, int h) const { return q(b, t, h) + 2 * static_cast<size_t>(NH) * HS; }
    __device__ size_t out(int b, int t, int h) const { return (static_cast<size_t>(b) * T + t) * NH * HS + h * HS; }
    __device__ size_t lse(int b, int t, int h) const { return (static_cast<size_t>(b) * NH + h) * T + t; }
};

// Sum over the TPR lanes of a row (consecutive, TPR-aligned lanes); every lane of the warp takes part.
template <int TPR>
__device__ float row_sum(float x) {
#pragma unroll
    for (int off = TPR / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// This lane's channels of a head vector into registers: element i is channel part + i * TPR.
template <int TPR>
__device__ void load_lane(float (&r)[kMaxPerLane], const float* src, int part, int HS) {
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int c = part + i * TPR;
        r[i] = c < HS ? src[c] : 0.0f;
    }
}

// Partial dot product of this lane's channels with row `j` of a shared tile (rows of HS floats).
template <int TPR>
__device__ float lane_dot(const float (&r)[kMaxPerLane], const float* tile_row, int part, int HS) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int c = part + i * TPR;
        if (c < HS) s += r[i] * tile_row[c];
    }
    return s;
}

// Copies rows [r0, r0 + n) of head vectors at global offsets off(t) into a shared tile, coalesced per row.
template <typename Offset>
__device__ void load_tile(float* tile, const float* src, int r0, int n, int HS, Offset off) {
    for (int idx = threadIdx.x; idx < n * HS; idx += blockDim.x) {
        const int r = idx / HS, c = idx % HS;
        tile[r * HS + c] = src[off(r0 + r) + c];
    }
}

// This thread's place in a row block: batch b, head h, the block's first row r0 (a query, or a key for
// dk/dv), its own row, its part of the row's channels, and whether the row exists (rows past T still take
// part in barriers and shuffles).
template <int TPR>
struct Slot {
    static constexpr int kRows = kThreads / TPR;
    int b, h, r0, row, part;
    bool active;
    __device__ explicit Slot(const Dims& d)
        : b(blockIdx.z),
          h(blockIdx.y),
          r0(static_cast<int>(blockIdx.x) * kRows),
          row(r0 + static_cast<int>(threadIdx.x) / TPR),
          part(static_cast<int>(threadIdx.x) % TPR),
          active(row < d.T) {}
    __device__ int clamped() const { return active ? row : 0; }  // a valid row to load for inactive threads
};

// Streams the keys a block of query rows [q0, q0 + rows) can see (0 up to its last query) through the
// shared K and V tiles and calls visit(j, k_row, v_row) for each, in order. Every thread of the block
// calls it (it holds the barriers).
template <typename Visit>
__device__ void for_each_visible_key(float* ks, float* vs, const float* qkv, const Dims& d, int b, int h, int q0,
                                     int rows, int tile, Visit visit) {
    const int last = min(d.T, q0 + rows) - 1;
    for (int j0 = 0; j0 <= last; j0 += tile) {
        const int n = min(tile, last + 1 - j0);
        __syncthreads();
        load_tile(ks, qkv, j0, n, d.HS, [&](int j) { return d.k(b, j, h); });
        load_tile(vs, qkv, j0, n, d.HS, [&](int j) { return d.v(b, j, h); });
        __syncthreads();
        for (int jj = 0; jj < n; ++jj) visit(j0 + jj, ks + jj * d.HS, vs + jj * d.HS);
    }
}

// grid (ceil(T / rows), NH, B), rows = kThreads / TPR queries per block; dynamic shared memory: K and V
// tiles of kTile x HS floats.
template <int TPR>
__global__ void forward_kernel(float* out, float* lse, const float* qkv, Dims d, float scale, int tile) {
    TRAINER_DYNAMIC_SHARED(smem_bytes);
    float* smem = reinterpret_cast<float*>(smem_bytes);
    float *ks = smem, *vs = smem + tile * d.HS;
    const Slot<TPR> my(d);
    const int b = my.b, h = my.h, t = my.row, part = my.part;
    const bool active = my.active;
    float q[kMaxPerLane], acc[kMaxPerLane];
    load_lane<TPR>(q, qkv + d.q(b, my.clamped(), h), part, d.HS);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for_each_visible_key(ks, vs, qkv, d, b, h, my.r0, my.kRows, tile, [&](int j, const float* krow, const float* vrow) {
        const float s = row_sum<TPR>(lane_dot<TPR>(q, krow, part, d.HS)) * scale;
        if (!active || j > t) return;  // causal: key after the query
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
            const int c = part + i * TPR;
            if (c < d.HS) acc[i] = acc[i] * corr + p * vrow[c];
        }
        m = m_new;
    });
    if (!active) return;
    float* o = out + d.out(b, t, h);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int c = part + i * TPR;
        if (c < d.HS) o[c] = acc[i] / l;
    }
    if (part == 0) lse[d.lse(b, t, h)] = m + logf(l);
}

// D_i = dout_i . out_i, one thread per (b, h, t).
__global__ void delta_kernel(float* delta, const float* dout, const float* out, Dims d) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
    if (t >= d.T) return;
    const float* g = dout + d.out(b, t, h);
    const float* o = out + d.out(b, t, h);
    float s = 0.0f;
    for (int c = 0; c < d.HS; ++c) s += g[c] * o[c];
    delta[d.lse(b, t, h)] = s;
}

// dq_i = scale sum_{j <= i} P_ij (dP_ij - D_i) k_j, dP_ij = dout_i . v_j. Blocks of query rows; K and V
// tiles in shared memory.
template <int TPR>
__global__ void dq_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* delta,
                          Dims d, float scale, int tile) {
    TRAINER_DYNAMIC_SHARED(smem_bytes);
    float* smem = reinterpret_cast<float*>(smem_bytes);
    float *ks = smem, *vs = smem + tile * d.HS;
    const Slot<TPR> my(d);
    const int b = my.b, h = my.h, t = my.row, part = my.part, tc = my.clamped();
    const bool active = my.active;
    float q[kMaxPerLane], g[kMaxPerLane], acc[kMaxPerLane];
    load_lane<TPR>(q, qkv + d.q(b, tc, h), part, d.HS);
    load_lane<TPR>(g, dout + d.out(b, tc, h), part, d.HS);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) acc[i] = 0.0f;
    const float L = lse[d.lse(b, tc, h)], D = delta[d.lse(b, tc, h)];
    for_each_visible_key(ks, vs, qkv, d, b, h, my.r0, my.kRows, tile, [&](int j, const float* krow, const float* vrow) {
        const float s = row_sum<TPR>(lane_dot<TPR>(q, krow, part, d.HS));
        const float dp = row_sum<TPR>(lane_dot<TPR>(g, vrow, part, d.HS));
        if (!active || j > t) return;  // causal: key after the query
        const float ds = expf(s * scale - L) * (dp - D);
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
            const int c = part + i * TPR;
            if (c < d.HS) acc[i] += ds * krow[c];
        }
    });
    if (!active) return;
    float* dq = dqkv + d.q(b, t, h);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int c = part + i * TPR;
        if (c < d.HS) dq[c] = acc[i] * scale;
    }
}

// dk_j = scale sum_{i >= j} P_ij (dP_ij - D_i) q_i; dv_j = sum_{i >= j} P_ij dout_i. Blocks of key rows; Q
// and dout tiles (with their lse and D) in shared memory.
template <int TPR>
__global__ void dkv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* delta,
                           Dims d, float scale, int tile) {
    TRAINER_DYNAMIC_SHARED(smem_bytes);
    float* smem = reinterpret_cast<float*>(smem_bytes);
    float* qs = smem;
    float* gs = smem + tile * d.HS;
    float* ls = gs + tile * d.HS;  // lse of the tile's queries
    float* ds_ = ls + tile;        // D of the tile's queries
    const Slot<TPR> my(d);
    const int b = my.b, h = my.h, k0 = my.r0, j = my.row, part = my.part, jc = my.clamped();
    const bool active = my.active;
    float k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane], dv[kMaxPerLane];
    load_lane<TPR>(k, qkv + d.k(b, jc, h), part, d.HS);
    load_lane<TPR>(v, qkv + d.v(b, jc, h), part, d.HS);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) dk[i] = 0.0f, dv[i] = 0.0f;
    // Queries before the block's first key see none of its keys.
    for (int i0 = k0 - k0 % tile; i0 < d.T; i0 += tile) {
        const int n = min(tile, d.T - i0);
        __syncthreads();
        load_tile(qs, qkv, i0, n, d.HS, [&](int i) { return d.q(b, i, h); });
        load_tile(gs, dout, i0, n, d.HS, [&](int i) { return d.out(b, i, h); });
        for (int r = threadIdx.x; r < n; r += blockDim.x) {
            ls[r] = lse[d.lse(b, i0 + r, h)];
            ds_[r] = delta[d.lse(b, i0 + r, h)];
        }
        __syncthreads();
        for (int ii = 0; ii < n; ++ii) {
            const float* qrow = qs + ii * d.HS;
            const float* grow = gs + ii * d.HS;
            const float s = row_sum<TPR>(lane_dot<TPR>(k, qrow, part, d.HS));
            const float dp = row_sum<TPR>(lane_dot<TPR>(v, grow, part, d.HS));
            if (!active || i0 + ii < j) continue;  // causal: query before the key
            const float p = expf(s * scale - ls[ii]);
            const float dsv = p * (dp - ds_[ii]);
#pragma unroll
            for (int i = 0; i < kMaxPerLane; ++i) {
                const int c = part + i * TPR;
                if (c < d.HS) dk[i] += dsv * qrow[c], dv[i] += p * grow[c];
            }
        }
    }
    if (!active) return;
    float* dkp = dqkv + d.k(b, j, h);
    float* dvp = dqkv + d.v(b, j, h);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int c = part + i * TPR;
        if (c < d.HS) dkp[c] = dk[i] * scale, dvp[c] = dv[i];
    }
}

// Lanes per row: the fewest that keep a lane at 32 channels or fewer.
int lanes_per_row(int HS) {
    TRAINER_CHECK(HS <= kMaxHS, "native CUDA attention supports head sizes up to {}, got {}", kMaxHS, HS);
    return HS <= 32 ? 1 : HS <= 64 ? 2 : HS <= 128 ? 4 : 8;
}

// Rows of the streamed side per shared tile: two tiles (plus two floats per row) stay within 32 KiB.
int tile_rows(int HS) { return HS <= 128 ? 32 : 16; }

dim3 grid(int rows_per_block, int B, int T, int NH) {
    return dim3(static_cast<unsigned>((T + rows_per_block - 1) / rows_per_block), static_cast<unsigned>(NH),
                static_cast<unsigned>(B));
}

// Calls f(std::integral_constant<int, TPR>) for the lanes-per-row this head size needs.
template <typename F>
void with_lanes(int HS, F f) {
    switch (lanes_per_row(HS)) {
        case 1:
            f(std::integral_constant<int, 1>{});
            break;
        case 2:
            f(std::integral_constant<int, 2>{});
            break;
        case 4:
            f(std::integral_constant<int, 4>{});
            break;
        default:
            f(std::integral_constant<int, 8>{});
            break;
    }
}

}  // namespace

size_t attention_backward_scratch_floats(int B, int T, int NH) { return static_cast<size_t>(B) * NH * T; }

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int HS, cudaStream_t stream) {
    const int tile = tile_rows(HS);
    with_lanes(HS, [&](auto lanes) {
        constexpr int TPR = decltype(lanes)::value;
        if (B * T * NH == 0) return;
        const size_t smem = 2 * static_cast<size_t>(tile) * HS * sizeof(float);
        const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
        TRAINER_LAUNCH(forward_kernel<TPR>, grid(kThreads / TPR, B, T, NH), kThreads, smem, stream, out, lse, qkv,
                       Dims{B, T, NH, HS}, scale, tile);
        TRAINER_CUDA_CHECK(cudaGetLastError());
    });
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int NH, int HS, float* scratch, cudaStream_t stream) {
    const int tile = tile_rows(HS);
    with_lanes(HS, [&](auto lanes) {
        constexpr int TPR = decltype(lanes)::value;
        if (B * T * NH == 0) return;
        const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
        const Dims d{B, T, NH, HS};
        TRAINER_LAUNCH(delta_kernel, grid(kThreads, B, T, NH), kThreads, 0, stream, scratch, dout, out, d);
        TRAINER_CUDA_CHECK(cudaGetLastError());
        const size_t smem = 2 * static_cast<size_t>(tile) * HS * sizeof(float);
        TRAINER_LAUNCH(dq_kernel<TPR>, grid(kThreads / TPR, B, T, NH), kThreads, smem, stream, dqkv, dout, qkv, lse,
                       scratch, d, scale, tile);
        TRAINER_CUDA_CHECK(cudaGetLastError());
        TRAINER_LAUNCH(dkv_kernel<TPR>, grid(kThreads / TPR, B, T, NH), kThreads, smem + 2 * tile * sizeof(float),
                       stream, dqkv, dout, qkv, lse, scratch, d, scale, tile);
        TRAINER_CUDA_CHECK(cudaGetLastError());
    });
}

}  // namespace trainer::cuda
