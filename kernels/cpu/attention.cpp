// Causal multi-head attention, flash-attention style on the CPU: nothing of size T x T is stored.
// Forward: one task per (batch, head, block of kQueryBlock queries) computes the block's scores
// against the keys it can see into a per-thread buffer (T x kQueryBlock), softmaxes them and saves
// each query's log-sum-exp. Backward: one task per (batch, head), so the task alone owns that head's
// dK and dV and accumulates them in a fixed order (no atomics, bitwise repeatable); it walks the
// query blocks and recomputes the probabilities from the saved lse.
// Scores are kept transposed (key-major, the block's queries contiguous): the score tiles then read
// K and V straight from qkv with no packing, the softmax runs across the queries in vector lanes,
// and each product is a register tile (a few keys or queries by a whole block or head) whose
// accumulators never leave registers. The head size is a template constant for common sizes.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

namespace {

// Queries per block: the lanes of the transposed score tiles (two AVX-512 vectors of floats).
constexpr int kQueryBlock = 32;

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
constexpr int kVectorRegs = 32;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
constexpr int kVectorRegs = 16;
#else
constexpr int kVectorBytes = 16;
constexpr int kVectorRegs = 16;
#endif

// Rows of a register tile `width` elements wide: as many as keep the accumulators within half the
// vector registers (the rest hold the streamed operand and the broadcasts), 1, 2 or 4.
template <typename T>
constexpr int tile_rows(int width) {
    const int budget = kVectorRegs / 2 * kVectorBytes / static_cast<int>(sizeof(T));
    const int rows = budget / width;
    return rows >= 4 ? 4 : (rows >= 2 ? 2 : 1);
}

int round_up(int x, int m) { return (x + m - 1) / m * m; }

// keep ? v : 0, selected on the bits: with a float select GCC evaluates v (an exp) only under a
// branch, which it cannot vectorise without AVX-512 masking.
inline float keep_or_zero(bool keep, float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits &= keep ? ~0u : 0u;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}
inline double keep_or_zero(bool keep, double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits &= keep ? ~uint64_t(0) : uint64_t(0);
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

// st[k * kQueryBlock + r] = keys[k] . qt[:, r] for k < round_up(nk, kKeys), r < kQueryBlock.
// Key k is the row at keys + k * ld; rows past nk reuse row nk - 1 (their scores are never used).
template <typename T, int kHS, int kKeys>
void scores_tile(T* st, const T* qt, const T* keys, size_t ld, int nk, int hs_rt) {
    const int hs = kHS > 0 ? kHS : hs_rt;
    for (int k0 = 0; k0 < nk; k0 += kKeys) {
        const T* kr[kKeys];
        for (int g = 0; g < kKeys; ++g) kr[g] = keys + static_cast<size_t>(std::min(k0 + g, nk - 1)) * ld;
        T acc[kKeys][kQueryBlock] = {};
        for (int d = 0; d < hs; ++d) {
            const T* __restrict q = qt + static_cast<size_t>(d) * kQueryBlock;
            for (int g = 0; g < kKeys; ++g) {
                const T kv = kr[g][d];
#pragma omp simd
                for (int r = 0; r < kQueryBlock; ++r) acc[g][r] += kv * q[r];
            }
        }
        for (int g = 0; g < kKeys; ++g) {
            T* __restrict out = st + static_cast<size_t>(k0 + g) * kQueryBlock;
#pragma omp simd
            for (int r = 0; r < kQueryBlock; ++r) out[r] = acc[g][r];
        }
    }
}

// For rows g < nstore: dst[g * ld_dst + d] (=, or += when accumulate) mult[g] (1 when null) *
// sum_{k<n} a[g * ag + k * ak] * b[k * ldb + d]. kRows rows are computed, so a must be readable for
// all of them; scratch (hs) serves run-time head sizes, computed one row at a time.
template <typename T, int kHS, int kRows>
void combine_tile(T* dst, size_t ld_dst, int nstore, const T* a, size_t ag, size_t ak, const T* b, size_t ldb, int n,
                  const T* mult, bool accumulate, int hs_rt, T* scratch) {
    if constexpr (kHS > 0) {
        T acc[kRows][kHS] = {};
        for (int k = 0; k < n; ++k) {
            const T* __restrict brow = b + k * ldb;
            for (int g = 0; g < kRows; ++g) {
                const T c = a[g * ag + k * ak];
#pragma omp simd
                for (int d = 0; d < kHS; ++d) acc[g][d] += c * brow[d];
            }
        }
        for (int g = 0; g < nstore; ++g) {
            T* __restrict o = dst + g * ld_dst;
            const T m = mult != nullptr ? mult[g] : T(1);
            if (accumulate) {
#pragma omp simd
                for (int d = 0; d < kHS; ++d) o[d] += m * acc[g][d];
            } else {
#pragma omp simd
                for (int d = 0; d < kHS; ++d) o[d] = m * acc[g][d];
            }
        }
    } else {
        T* __restrict acc = scratch;
        for (int g = 0; g < nstore; ++g) {
            std::fill(acc, acc + hs_rt, T(0));
            for (int k = 0; k < n; ++k) {
                const T c = a[g * ag + k * ak];
                const T* __restrict brow = b + k * ldb;
#pragma omp simd
                for (int d = 0; d < hs_rt; ++d) acc[d] += c * brow[d];
            }
            T* __restrict o = dst + g * ld_dst;
            const T m = mult != nullptr ? mult[g] : T(1);
            for (int d = 0; d < hs_rt; ++d) o[d] = (accumulate ? o[d] : T(0)) + m * acc[d];
        }
    }
}

// Attention geometry shared by the per-task routines.
struct Geometry {
    int T_;
    int NH;
    int hs;
    int C;
    size_t C3;  // row stride of qkv
};

template <typename T, int kHS>
void forward_impl(T* out, T* lse, const T* qkv, int B, const Geometry& g) {
    constexpr int kKeys = tile_rows<T>(kQueryBlock);
    constexpr int kRows = kHS > 0 ? std::min(tile_rows<T>(kHS), kKeys) : 1;
    const int nqb = (g.T_ + kQueryBlock - 1) / kQueryBlock;
    const int ntasks = B * g.NH * nqb;
    const int hs = g.hs;
    const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
    {
        std::vector<T> qt(static_cast<size_t>(hs) * kQueryBlock);
        std::vector<T> st(static_cast<size_t>(round_up(g.T_, kKeys)) * kQueryBlock);
        std::vector<T> scratch(static_cast<size_t>(hs));
        T m[kQueryBlock], sum[kQueryBlock], inv[kQueryBlock];
#pragma omp for schedule(static)
        for (int task = 0; task < ntasks; ++task) {
            const int bh = task / nqb;
            const int b = bh / g.NH;
            const int h = bh % g.NH;
            const int i0 = (task % nqb) * kQueryBlock;
            const int nr = std::min(kQueryBlock, g.T_ - i0);
            const int i1 = i0 + nr;
            const T* head = qkv + static_cast<size_t>(b) * g.T_ * g.C3 + static_cast<size_t>(h) * hs;
            // Queries transposed and pre-scaled; lanes past the sequence are zero.
            for (int r = 0; r < kQueryBlock; ++r) {
                if (r < nr) {
                    const T* q = head + (i0 + r) * g.C3;
                    for (int d = 0; d < hs; ++d) qt[static_cast<size_t>(d) * kQueryBlock + r] = q[d] * scale;
                } else {
                    for (int d = 0; d < hs; ++d) qt[static_cast<size_t>(d) * kQueryBlock + r] = T(0);
                }
            }
            scores_tile<T, kHS, kKeys>(st.data(), qt.data(), head + g.C, g.C3, i1, hs);
            const int nk = round_up(i1, kKeys);
            for (int r = 0; r < kQueryBlock; ++r) m[r] = -std::numeric_limits<T>::infinity();
            for (int k = 0; k < i1; ++k) {
                const T* __restrict sk = st.data() + static_cast<size_t>(k) * kQueryBlock;
#pragma omp simd
                for (int r = 0; r < kQueryBlock; ++r) m[r] = (k <= i0 + r && sk[r] > m[r]) ? sk[r] : m[r];
            }
            for (int r = 0; r < kQueryBlock; ++r) sum[r] = T(0);
            // Keys past a query's position (and the padding rows up to nk) become exact zeros, which
            // lets the P @ V tiles below run over whole rows of keys.
            for (int k = 0; k < nk; ++k) {
                T* __restrict sk = st.data() + static_cast<size_t>(k) * kQueryBlock;
#pragma omp simd
                for (int r = 0; r < kQueryBlock; ++r) {
                    const T p = keep_or_zero(k <= i0 + r, exp_simd(sk[r] - m[r]));
                    sk[r] = p;
                    sum[r] += p;
                }
            }
            for (int r = 0; r < kQueryBlock; ++r) inv[r] = r < nr ? T(1) / sum[r] : T(0);
            T* out_blk = out + (static_cast<size_t>(b) * g.T_ + i0) * g.C + static_cast<size_t>(h) * hs;
            for (int r0 = 0; r0 < nr; r0 += kRows) {
                const int n = std::min(i1, i0 + r0 + kRows);
                combine_tile<T, kHS, kRows>(out_blk + static_cast<size_t>(r0) * g.C, g.C, std::min(kRows, nr - r0),
                                            st.data() + r0, 1, kQueryBlock, head + 2 * g.C, g.C3, n, inv + r0, false,
                                            hs, scratch.data());
            }
            T* lse_blk = lse + static_cast<size_t>(bh) * g.T_ + i0;
            for (int r = 0; r < nr; ++r) lse_blk[r] = m[r] + std::log(sum[r]);
        }
    }
}

template <typename T, int kHS>
void backward_impl(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, const Geometry& g) {
    constexpr int kKeys = tile_rows<T>(kQueryBlock);
    constexpr int kRows = kHS > 0 ? std::min(tile_rows<T>(kHS), kKeys) : 1;
    const int hs = g.hs;
    const int T_ = g.T_;
    const T scale = T(1) / std::sqrt(T(hs));
    const int ntasks = B * g.NH;
#pragma omp parallel
    {
        const size_t lane_block = static_cast<size_t>(hs) * kQueryBlock;
        const size_t score_block = static_cast<size_t>(round_up(T_, kKeys)) * kQueryBlock;
        std::vector<T> qt(lane_block), dot(lane_block), qs(lane_block), dos(lane_block);
        std::vector<T> st(score_block), dpt(score_block);
        std::vector<T> dk(static_cast<size_t>(round_up(T_, kRows)) * hs), dv(dk.size());
        std::vector<T> scratch(static_cast<size_t>(hs));
        T lse_r[kQueryBlock], delta[kQueryBlock], scales[kQueryBlock];
        for (int r = 0; r < kQueryBlock; ++r) scales[r] = scale;
#pragma omp for schedule(static)
        for (int bh = 0; bh < ntasks; ++bh) {
            const int b = bh / g.NH;
            const int h = bh % g.NH;
            const size_t head_off = static_cast<size_t>(b) * T_ * g.C3 + static_cast<size_t>(h) * hs;
            const T* head = qkv + head_off;
            T* dhead = dqkv + head_off;
            const size_t orow0 = static_cast<size_t>(b) * T_ * g.C + static_cast<size_t>(h) * hs;
            std::fill(dk.begin(), dk.end(), T(0));
            std::fill(dv.begin(), dv.end(), T(0));
            for (int i0 = 0; i0 < T_; i0 += kQueryBlock) {
                const int nr = std::min(kQueryBlock, T_ - i0);
                const int i1 = i0 + nr;
                // Scaled queries and dout, both row-major (dK, dV) and transposed (score tiles);
                // delta_r = dout_r . out_r. Lanes past the sequence are zero.
                for (int r = 0; r < kQueryBlock; ++r) {
                    T dsum = T(0);
                    if (r < nr) {
                        const T* __restrict q = head + (i0 + r) * g.C3;
                        const T* __restrict go = dout + orow0 + static_cast<size_t>(i0 + r) * g.C;
                        const T* __restrict o = out + orow0 + static_cast<size_t>(i0 + r) * g.C;
                        for (int d = 0; d < hs; ++d) {
                            qs[static_cast<size_t>(r) * hs + d] = q[d] * scale;
                            dos[static_cast<size_t>(r) * hs + d] = go[d];
                            dsum += go[d] * o[d];
                        }
                        lse_r[r] = lse[static_cast<size_t>(bh) * T_ + i0 + r];
                    } else {
                        std::fill(qs.begin() + static_cast<size_t>(r) * hs,
                                  qs.begin() + static_cast<size_t>(r + 1) * hs, T(0));
                        std::fill(dos.begin() + static_cast<size_t>(r) * hs,
                                  dos.begin() + static_cast<size_t>(r + 1) * hs, T(0));
                        lse_r[r] = T(0);
                    }
                    delta[r] = dsum;
                    for (int d = 0; d < hs; ++d) {
                        qt[static_cast<size_t>(d) * kQueryBlock + r] = qs[static_cast<size_t>(r) * hs + d];
                        dot[static_cast<size_t>(d) * kQueryBlock + r] = dos[static_cast<size_t>(r) * hs + d];
                    }
                }
                scores_tile<T, kHS, kKeys>(st.data(), qt.data(), head + g.C, g.C3, i1, hs);
                scores_tile<T, kHS, kKeys>(dpt.data(), dot.data(), head + 2 * g.C, g.C3, i1, hs);
                // st becomes P and dpt dS = P (dP - delta), the gradient of the scaled score; both
                // are exact zeros where masked, so the tiles below can run over whole key groups.
                const int nk = round_up(i1, kKeys);
                for (int k = 0; k < nk; ++k) {
                    T* __restrict sk = st.data() + static_cast<size_t>(k) * kQueryBlock;
                    T* __restrict dsk = dpt.data() + static_cast<size_t>(k) * kQueryBlock;
#pragma omp simd
                    for (int r = 0; r < kQueryBlock; ++r) {
                        const T p = keep_or_zero(k <= i0 + r && r < nr, exp_simd(sk[r] - lse_r[r]));
                        sk[r] = p;
                        dsk[r] = p * (dsk[r] - delta[r]);
                    }
                }
                // dq = scale * dS @ K: the scores are scale * q . k.
                for (int r0 = 0; r0 < nr; r0 += kRows) {
                    const int n = std::min(i1, i0 + r0 + kRows);
                    combine_tile<T, kHS, kRows>(dhead + (i0 + r0) * g.C3, g.C3, std::min(kRows, nr - r0),
                                                dpt.data() + r0, 1, kQueryBlock, head + g.C, g.C3, n, scales, false, hs,
                                                scratch.data());
                }
                // Key j gathers from the queries r >= j - i0; qs is pre-scaled, so dK needs no scale.
                for (int j0 = 0; j0 < i1; j0 += kRows) {
                    const int r0 = std::max(0, j0 - i0);
                    const size_t a_off = static_cast<size_t>(j0) * kQueryBlock + r0;
                    combine_tile<T, kHS, kRows>(dv.data() + static_cast<size_t>(j0) * hs, hs, kRows, st.data() + a_off,
                                                kQueryBlock, 1, dos.data() + static_cast<size_t>(r0) * hs, hs, nr - r0,
                                                nullptr, true, hs, scratch.data());
                    combine_tile<T, kHS, kRows>(dk.data() + static_cast<size_t>(j0) * hs, hs, kRows, dpt.data() + a_off,
                                                kQueryBlock, 1, qs.data() + static_cast<size_t>(r0) * hs, hs, nr - r0,
                                                nullptr, true, hs, scratch.data());
                }
            }
            for (int j = 0; j < T_; ++j) {
                T* __restrict dkr = dhead + j * g.C3 + g.C;
                T* __restrict dvr = dhead + j * g.C3 + 2 * g.C;
                for (int d = 0; d < hs; ++d) {
                    dkr[d] = dk[static_cast<size_t>(j) * hs + d];
                    dvr[d] = dv[static_cast<size_t>(j) * hs + d];
                }
            }
        }
    }
}

Geometry make_geometry(int T_, int NH, int HS) {
    Geometry g;
    g.T_ = T_;
    g.NH = NH;
    g.hs = HS;
    g.C = NH * HS;
    g.C3 = static_cast<size_t>(3) * g.C;
    return g;
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int T_, int NH, int HS) {
    if (B <= 0 || T_ <= 0) return;
    const Geometry g = make_geometry(T_, NH, HS);
    switch (HS) {
        case 32:
            forward_impl<T, 32>(out, lse, qkv, B, g);
            break;
        case 64:
            forward_impl<T, 64>(out, lse, qkv, B, g);
            break;
        case 128:
            forward_impl<T, 128>(out, lse, qkv, B, g);
            break;
        default:
            forward_impl<T, 0>(out, lse, qkv, B, g);
            break;
    }
}

template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, int T_, int NH,
                        int HS) {
    if (B <= 0 || T_ <= 0) return;
    const Geometry g = make_geometry(T_, NH, HS);
    switch (HS) {
        case 32:
            backward_impl<T, 32>(dqkv, dout, qkv, out, lse, B, g);
            break;
        case 64:
            backward_impl<T, 64>(dqkv, dout, qkv, out, lse, B, g);
            break;
        case 128:
            backward_impl<T, 128>(dqkv, dout, qkv, out, lse, B, g);
            break;
        default:
            backward_impl<T, 0>(dqkv, dout, qkv, out, lse, B, g);
            break;
    }
}

template void attention_forward<float>(float*, float*, const float*, int, int, int, int);
template void attention_forward<double>(double*, double*, const double*, int, int, int, int);
template void attention_backward<float>(float*, const float*, const float*, const float*, const float*, int, int, int,
                                        int);
template void attention_backward<double>(double*, const double*, const double*, const double*, const double*, int, int,
                                         int, int);

}  // namespace trainer::cpu
