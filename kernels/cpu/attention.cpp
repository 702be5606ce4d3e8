// Causal multi-head attention, flash-attention style on the CPU: nothing of size T x T is stored.
// Forward: one task per (batch, head, block of kQueryBlock queries) computes the block's scores
// against the keys it can see into a per-thread buffer (kQueryBlock x T), softmaxes each row, and
// saves the row's log-sum-exp. Backward: one task per (batch, head), so the task alone owns that
// head's dK and dV and accumulates them in a fixed order (no atomics, bitwise repeatable); it walks
// the query blocks and recomputes the probabilities from the saved lse.
// The scores use keys packed transposed (HS x T), so the inner loop runs over kKeyBlock keys held in
// registers; the head size is a template constant for the common sizes so the HS-long accumulators
// of P @ V and of the gradients stay in registers too.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

constexpr int kQueryBlock = 16;
constexpr int kKeyBlock = 16;

int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Attention geometry and the scale shared by the per-task routines.
struct Geometry {
    int T_;
    int NH;
    int hs;
    int C;
    size_t C3;  // row stride of qkv
    int ldk;    // row stride of the transposed key/value packs and of the score buffers
};

// s[r * ldk + j] = qs[r] . kt[:, j] for every key block that holds a key j <= i0 + r (keys past the
// causal limit inside the last block are computed and never read).
template <typename T, int kHS>
void scores_block(T* s, const T* qs, const T* kt, int nrows, int i0, const Geometry& g) {
    const int hs = kHS > 0 ? kHS : g.hs;
    for (int r = 0; r < nrows; ++r) {
        const int nj = round_up(i0 + r + 1, kKeyBlock);
        const T* __restrict q = qs + static_cast<size_t>(r) * hs;
        for (int jb = 0; jb < nj; jb += kKeyBlock) {
            T acc[kKeyBlock] = {};
            for (int d = 0; d < hs; ++d) {
                const T qd = q[d];
                const T* __restrict kr = kt + static_cast<size_t>(d) * g.ldk + jb;
#pragma omp simd
                for (int jj = 0; jj < kKeyBlock; ++jj) acc[jj] += qd * kr[jj];
            }
            T* __restrict out = s + static_cast<size_t>(r) * g.ldk + jb;
#pragma omp simd
            for (int jj = 0; jj < kKeyBlock; ++jj) out[jj] = acc[jj];
        }
    }
}

// dst[d] (=, or += when accumulate) mult * sum_{j<n} coef[j * coef_stride] * rows[j * row_stride + d].
// scratch (hs) holds the partial sums when the head size is only known at run time.
template <typename T, int kHS>
void combine_rows(T* dst, const T* coef, size_t coef_stride, const T* rows, size_t row_stride, int n, T mult,
                  bool accumulate, int hs_rt, T* scratch) {
    constexpr int kAcc = kHS > 0 ? kHS : 1;
    T fixed[kAcc] = {};
    const int hs = kHS > 0 ? kHS : hs_rt;
    T* __restrict acc = kHS > 0 ? fixed : scratch;
    if constexpr (kHS == 0) std::fill(acc, acc + hs, T(0));
    for (int j = 0; j < n; ++j) {
        const T c = coef[j * coef_stride];
        const T* __restrict row = rows + j * row_stride;
#pragma omp simd
        for (int d = 0; d < hs; ++d) acc[d] += c * row[d];
    }
    if (accumulate) {
#pragma omp simd
        for (int d = 0; d < hs; ++d) dst[d] += mult * acc[d];
    } else {
#pragma omp simd
        for (int d = 0; d < hs; ++d) dst[d] = mult * acc[d];
    }
}

// kt[d * ldk + j] = src[j * C3 + d] for j < n, zero for n <= j < ldk.
template <typename T>
void pack_transposed(T* kt, const T* src, int n, const Geometry& g) {
    for (int j = 0; j < n; ++j) {
        const T* __restrict row = src + j * g.C3;
        for (int d = 0; d < g.hs; ++d) kt[static_cast<size_t>(d) * g.ldk + j] = row[d];
    }
    for (int d = 0; d < g.hs; ++d) {
        for (int j = n; j < g.ldk; ++j) kt[static_cast<size_t>(d) * g.ldk + j] = T(0);
    }
}

template <typename T, int kHS>
void forward_impl(T* out, T* lse, const T* qkv, int B, const Geometry& g0) {
    const int nqb = (g0.T_ + kQueryBlock - 1) / kQueryBlock;
    const int ntasks = B * g0.NH * nqb;
    const int hs = g0.hs;
    const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
    {
        Geometry g = g0;
        std::vector<T> qs(static_cast<size_t>(kQueryBlock) * hs);
        std::vector<T> kt(static_cast<size_t>(hs) * round_up(g.T_, kKeyBlock));
        std::vector<T> s(static_cast<size_t>(kQueryBlock) * round_up(g.T_, kKeyBlock));
        std::vector<T> scratch(static_cast<size_t>(hs));
#pragma omp for schedule(static)
        for (int task = 0; task < ntasks; ++task) {
            const int bh = task / nqb;
            const int b = bh / g.NH;
            const int h = bh % g.NH;
            const int i0 = (task % nqb) * kQueryBlock;
            const int nr = std::min(kQueryBlock, g.T_ - i0);
            const int i1 = i0 + nr;
            g.ldk = round_up(i1, kKeyBlock);
            const T* head = qkv + static_cast<size_t>(b) * g.T_ * g.C3 + static_cast<size_t>(h) * hs;
            for (int r = 0; r < nr; ++r) {
                const T* __restrict q = head + (i0 + r) * g.C3;
                for (int d = 0; d < hs; ++d) qs[static_cast<size_t>(r) * hs + d] = q[d] * scale;
            }
            pack_transposed(kt.data(), head + g.C, i1, g);
            scores_block<T, kHS>(s.data(), qs.data(), kt.data(), nr, i0, g);
            for (int r = 0; r < nr; ++r) {
                const int i = i0 + r;
                T* __restrict sr = s.data() + static_cast<size_t>(r) * g.ldk;
                T m = sr[0];
                for (int j = 1; j <= i; ++j) m = std::max(m, sr[j]);
                T sum = T(0);
                for (int j = 0; j <= i; ++j) {
                    const T p = std::exp(sr[j] - m);
                    sr[j] = p;
                    sum += p;
                }
                T* o = out + (static_cast<size_t>(b) * g.T_ + i) * g.C + static_cast<size_t>(h) * hs;
                combine_rows<T, kHS>(o, sr, 1, head + 2 * g.C, g.C3, i + 1, T(1) / sum, false, hs, scratch.data());
                lse[static_cast<size_t>(bh) * g.T_ + i] = m + std::log(sum);
            }
        }
    }
}

template <typename T, int kHS>
void backward_impl(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, const Geometry& g0) {
    const int hs = g0.hs;
    const int T_ = g0.T_;
    const T scale = T(1) / std::sqrt(T(hs));
    const int ntasks = B * g0.NH;
#pragma omp parallel
    {
        Geometry g = g0;
        g.ldk = round_up(T_, kKeyBlock);
        const size_t pack = static_cast<size_t>(hs) * g.ldk;
        const size_t block = static_cast<size_t>(kQueryBlock) * g.ldk;
        std::vector<T> kt(pack), vt(pack), s(block), dp(block);
        std::vector<T> qs(static_cast<size_t>(kQueryBlock) * hs), dos(static_cast<size_t>(kQueryBlock) * hs);
        std::vector<T> dk(static_cast<size_t>(T_) * hs), dv(static_cast<size_t>(T_) * hs);
        std::vector<T> delta(kQueryBlock), scratch(static_cast<size_t>(hs));
#pragma omp for schedule(static)
        for (int bh = 0; bh < ntasks; ++bh) {
            const int b = bh / g.NH;
            const int h = bh % g.NH;
            const size_t head_off = static_cast<size_t>(b) * T_ * g.C3 + static_cast<size_t>(h) * hs;
            const T* head = qkv + head_off;
            T* dhead = dqkv + head_off;
            const size_t orow0 = static_cast<size_t>(b) * T_ * g.C + static_cast<size_t>(h) * hs;
            const T* lse_bh = lse + static_cast<size_t>(bh) * T_;
            pack_transposed(kt.data(), head + g.C, T_, g);
            pack_transposed(vt.data(), head + 2 * g.C, T_, g);
            std::fill(dk.begin(), dk.end(), T(0));
            std::fill(dv.begin(), dv.end(), T(0));
            for (int i0 = 0; i0 < T_; i0 += kQueryBlock) {
                const int nr = std::min(kQueryBlock, T_ - i0);
                const int i1 = i0 + nr;
                for (int r = 0; r < nr; ++r) {
                    const T* __restrict q = head + (i0 + r) * g.C3;
                    const T* __restrict go = dout + orow0 + static_cast<size_t>(i0 + r) * g.C;
                    const T* __restrict o = out + orow0 + static_cast<size_t>(i0 + r) * g.C;
                    T dsum = T(0);
                    for (int d = 0; d < hs; ++d) {
                        qs[static_cast<size_t>(r) * hs + d] = q[d] * scale;
                        dos[static_cast<size_t>(r) * hs + d] = go[d];
                        dsum += go[d] * o[d];
                    }
                    delta[r] = dsum;
                }
                scores_block<T, kHS>(s.data(), qs.data(), kt.data(), nr, i0, g);
                scores_block<T, kHS>(dp.data(), dos.data(), vt.data(), nr, i0, g);
                // s becomes P, dp becomes dS = P * (dP - delta); dS already carries d/d(scaled score).
                for (int r = 0; r < nr; ++r) {
                    const int i = i0 + r;
                    const T l = lse_bh[i];
                    const T dr = delta[r];
                    T* __restrict sr = s.data() + static_cast<size_t>(r) * g.ldk;
                    T* __restrict dpr = dp.data() + static_cast<size_t>(r) * g.ldk;
                    for (int j = 0; j <= i; ++j) {
                        const T p = std::exp(sr[j] - l);
                        sr[j] = p;
                        dpr[j] = p * (dpr[j] - dr);
                    }
                    // dq = scale * dS @ K (the scores are scale * q . k).
                    combine_rows<T, kHS>(dhead + i * g.C3, dpr, 1, head + g.C, g.C3, i + 1, scale, false, hs, scratch.data());
                }
                // Key j sees the rows r with i0 + r >= j; qs is already scaled, so dK needs no scale.
                for (int j = 0; j < i1; ++j) {
                    const int r0 = std::max(0, j - i0);
                    const size_t off = static_cast<size_t>(r0) * g.ldk + j;
                    combine_rows<T, kHS>(dv.data() + static_cast<size_t>(j) * hs, s.data() + off, g.ldk,
                                         dos.data() + static_cast<size_t>(r0) * hs, hs, nr - r0, T(1), true, hs,
                                         scratch.data());
                    combine_rows<T, kHS>(dk.data() + static_cast<size_t>(j) * hs, dp.data() + off, g.ldk,
                                         qs.data() + static_cast<size_t>(r0) * hs, hs, nr - r0, T(1), true, hs,
                                         scratch.data());
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
    g.ldk = 0;
    return g;
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int T_, int NH, int HS) {
    const Geometry g = make_geometry(T_, NH, HS);
    switch (HS) {
        case 32: forward_impl<T, 32>(out, lse, qkv, B, g); break;
        case 64: forward_impl<T, 64>(out, lse, qkv, B, g); break;
        case 128: forward_impl<T, 128>(out, lse, qkv, B, g); break;
        default: forward_impl<T, 0>(out, lse, qkv, B, g); break;
    }
}

template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, int T_, int NH,
                        int HS) {
    const Geometry g = make_geometry(T_, NH, HS);
    switch (HS) {
        case 32: backward_impl<T, 32>(dqkv, dout, qkv, out, lse, B, g); break;
        case 64: backward_impl<T, 64>(dqkv, dout, qkv, out, lse, B, g); break;
        case 128: backward_impl<T, 128>(dqkv, dout, qkv, out, lse, B, g); break;
        default: backward_impl<T, 0>(dqkv, dout, qkv, out, lse, B, g); break;
    }
}

template void attention_forward<float>(float*, float*, const float*, int, int, int, int);
template void attention_forward<double>(double*, double*, const double*, int, int, int, int);
template void attention_backward<float>(float*, const float*, const float*, const float*, const float*, int, int, int,
                                        int);
template void attention_backward<double>(double*, const double*, const double*, const double*, const double*, int,
                                         int, int, int);

}  // namespace trainer::cpu
