// The norms over the last dimension: LayerNorm (affine as GPT-2, weight only, or non-parametric as OLMo)
// and RMSNorm (OLMo-2), as the pre-norm of a sublayer (layernorm_*), after a sublayer's output before the
// residual add (norm_residual_*: OLMo-2's norm_after) and on q and k inside qkv (qk_norm_*: QK-norm). All
// of them run one row kernel over rows that may lie apart (q and k rows are 3C apart in qkv).
// Forward saves mean (LayerNorm) and rstd per row so the backward reads inp and dout once each. RMSNorm is
// the same arithmetic with the mean fixed at 0 (x - 0 is x, bit for bit) and the mean of the gradient
// term dropped. dweight/dbias are reduced over rows through fixed chunks of rows, summed in chunk order,
// so the result does not depend on threads.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

// Rows per partial dweight/dbias sum: large enough that the partials (N/32 x 2C) stay small next to
// the activations, small enough that N = 2040 rows still give every thread work.
constexpr int kRowsPerChunk = 32;

// One row: o = (x - m) * rs * weight + bias (each nullable), plus r when r is not null (o may alias r).
template <typename T>
void norm_row_forward(T* o, const T* r, const T* __restrict x, const T* weight, const T* bias, int C, float eps,
                      bool rms, T* mean_out, T* rstd_out) {
    T m = T(0);
    if (!rms) {
        T sum = T(0);
#pragma omp simd reduction(+ : sum)
        for (int c = 0; c < C; ++c) sum += x[c];
        m = sum / T(C);
    }
    // Two passes over a row that sits in L1: the centred sum of squares avoids the cancellation
    // of E[x^2] - E[x]^2 when |mean| >> std (RMSNorm: m = 0, the mean of the squares).
    T sq = T(0);
#pragma omp simd reduction(+ : sq)
    for (int c = 0; c < C; ++c) {
        const T d = x[c] - m;
        sq += d * d;
    }
    const T rs = T(1) / std::sqrt(sq / T(C) + T(eps));
    if (mean_out != nullptr) *mean_out = m;
    *rstd_out = rs;
    if (r != nullptr) {  // the norm-after sublayer: resid + norm(x), o possibly r itself
        for (int c = 0; c < C; ++c) {
            T y = (x[c] - m) * rs;
            if (weight != nullptr) y *= weight[c];
            if (bias != nullptr) y += bias[c];
            o[c] = r[c] + y;
        }
        return;
    }
    T* __restrict out = o;
    if (weight != nullptr && bias != nullptr) {
#pragma omp simd
        for (int c = 0; c < C; ++c) out[c] = (x[c] - m) * rs * weight[c] + bias[c];
    } else if (weight != nullptr) {
#pragma omp simd
        for (int c = 0; c < C; ++c) out[c] = (x[c] - m) * rs * weight[c];
    } else if (bias != nullptr) {  // not a shape the model builds, but the contract allows it
#pragma omp simd
        for (int c = 0; c < C; ++c) out[c] = (x[c] - m) * rs + bias[c];
    } else {
#pragma omp simd
        for (int c = 0; c < C; ++c) out[c] = (x[c] - m) * rs;
    }
}

// One row's input gradient: dx (+)= rs * (dn - mean(dn) - norm * mean(dn * norm)), dn = g * weight, norm =
// (x - m) * rs (RMSNorm: no mean(dn) term); pw/pb (nullable) += g * norm and g, before dx is written.
template <typename T>
void norm_row_backward(T* __restrict dx, bool accumulate, T* __restrict pw, T* __restrict pb, const T* __restrict g,
                       const T* __restrict x, const T* weight, T m, T rs, int C, bool rms) {
    T sum_dn = T(0);
    T sum_dn_norm = T(0);
    if (weight != nullptr) {
#pragma omp simd reduction(+ : sum_dn, sum_dn_norm)
        for (int c = 0; c < C; ++c) {
            const T dn = g[c] * weight[c];
            sum_dn += dn;
            sum_dn_norm += dn * (x[c] - m) * rs;
        }
    } else {
#pragma omp simd reduction(+ : sum_dn, sum_dn_norm)
        for (int c = 0; c < C; ++c) {
            sum_dn += g[c];
            sum_dn_norm += g[c] * (x[c] - m) * rs;
        }
    }
    const T mean_dn = rms ? T(0) : sum_dn / T(C);
    const T mean_dn_norm = sum_dn_norm / T(C);
    if (pw != nullptr) {
#pragma omp simd
        for (int c = 0; c < C; ++c) {
            pw[c] += g[c] * (x[c] - m) * rs;
            pb[c] += g[c];
        }
    }
    if (weight != nullptr) {
        if (accumulate) {
#pragma omp simd
            for (int c = 0; c < C; ++c) dx[c] += rs * (g[c] * weight[c] - mean_dn - (x[c] - m) * rs * mean_dn_norm);
        } else {
#pragma omp simd
            for (int c = 0; c < C; ++c) dx[c] = rs * (g[c] * weight[c] - mean_dn - (x[c] - m) * rs * mean_dn_norm);
        }
    } else {
        if (accumulate) {
#pragma omp simd
            for (int c = 0; c < C; ++c) dx[c] += rs * (g[c] - mean_dn - (x[c] - m) * rs * mean_dn_norm);
        } else {
#pragma omp simd
            for (int c = 0; c < C; ++c) dx[c] = rs * (g[c] - mean_dn - (x[c] - m) * rs * mean_dn_norm);
        }
    }
}

// One row's input gradient from the output y = (x - m) * rs of a norm without weight or bias: dx += rs * (g -
// mean(g) - y * mean(g * y)) (RMSNorm: no mean(g) term), norm_row_backward's formula with y read, not
// recomputed.
template <typename T>
void norm_row_backward_from_output(T* __restrict dx, const T* __restrict g, const T* __restrict y, T rs, int C,
                                   bool rms) {
    T sum_g = T(0);
    T sum_gy = T(0);
#pragma omp simd reduction(+ : sum_g, sum_gy)
    for (int c = 0; c < C; ++c) {
        sum_g += g[c];
        sum_gy += g[c] * y[c];
    }
    const T mean_g = rms ? T(0) : sum_g / T(C);
    const T mean_gy = sum_gy / T(C);
#pragma omp simd
    for (int c = 0; c < C; ++c) dx[c] += rs * (g[c] - mean_g - y[c] * mean_gy);
}

// Rows n of inp (ld_in apart) normalised into out (ld_out apart), plus resid (rows ld_out apart) when not
// null; mean (nullable) and rstd per row.
template <typename T>
void norm_rows_forward(T* out, int ld_out, const T* resid, T* mean, T* rstd, const T* inp, int ld_in, const T* weight,
                       const T* bias, int N, int C, float eps, bool rms) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const size_t o = static_cast<size_t>(n) * ld_out;
        norm_row_forward(out + o, resid != nullptr ? resid + o : nullptr, inp + static_cast<size_t>(n) * ld_in, weight,
                         bias, C, eps, rms, mean != nullptr ? mean + n : nullptr, rstd + n);
    }
}

// The input gradients of rows (dinp rows ld_dinp apart, added to or overwritten) from dout (rows ld_dout
// apart; may be dinp itself, in place) and inp (rows ld_in apart); dweight/dbias (nullable) +=.
template <typename T>
void norm_rows_backward(T* dinp, int ld_dinp, bool accumulate, T* dweight, T* dbias, const T* dout, int ld_dout,
                        const T* inp, int ld_in, const T* weight, const T* mean, const T* rstd, int N, int C,
                        bool rms) {
    const bool params = dweight != nullptr || dbias != nullptr;
    const bool in_place = static_cast<const void*>(dinp) == static_cast<const void*>(dout);
    const int nchunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    std::vector<T> partial(params ? static_cast<size_t>(nchunks) * 2 * C : 0, T(0));
#pragma omp parallel
    {
        std::vector<T> row(in_place ? C : 0);  // the row of dout, read while dinp overwrites it
#pragma omp for schedule(static)
        for (int chunk = 0; chunk < nchunks; ++chunk) {
            T* pw = params ? partial.data() + static_cast<size_t>(chunk) * 2 * C : nullptr;
            T* pb = params ? pw + C : nullptr;
            const int n1 = std::min(N, (chunk + 1) * kRowsPerChunk);
            for (int n = chunk * kRowsPerChunk; n < n1; ++n) {
                const T* g = dout + static_cast<size_t>(n) * ld_dout;
                if (in_place) {
                    std::memcpy(row.data(), g, static_cast<size_t>(C) * sizeof(T));
                    g = row.data();
                }
                norm_row_backward(dinp + static_cast<size_t>(n) * ld_dinp, accumulate, pw, pb, g,
                                  inp + static_cast<size_t>(n) * ld_in, weight, rms ? T(0) : mean[n], rstd[n], C, rms);
            }
        }
    }
    if (!params) return;
#pragma omp parallel for schedule(static)
    for (int c = 0; c < C; ++c) {
        T sw = T(0);
        T sb = T(0);
        for (int chunk = 0; chunk < nchunks; ++chunk) {
            sw += partial[static_cast<size_t>(chunk) * 2 * C + c];
            sb += partial[static_cast<size_t>(chunk) * 2 * C + C + c];
        }
        if (dweight != nullptr) dweight[c] += sw;
        if (dbias != nullptr) dbias[c] += sb;
    }
}

}  // namespace

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int N, int C, float eps,
                       bool rms) {
    norm_rows_forward(out, C, static_cast<const T*>(nullptr), mean, rstd, inp, C, weight, bias, N, C, eps, rms);
}

template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                        const T* rstd, int N, int C, bool rms) {
    norm_rows_backward(dinp, C, true, dweight, dbias, dout, C, inp, C, weight, mean, rstd, N, C, rms);
}

template <typename T>
void norm_backward_from_output(T* dinp, const T* dout, const T* out, const T* rstd, int N, int C, bool rms) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const size_t o = static_cast<size_t>(n) * C;
        norm_row_backward_from_output(dinp + o, dout + o, out + o, rstd[n], C, rms);
    }
}

template <typename T>
void norm_residual_forward(T* out, const T* resid, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                           int N, int C, float eps, bool rms) {
    norm_rows_forward(out, C, resid, mean, rstd, inp, C, weight, bias, N, C, eps, rms);
}

template <typename T>
void norm_residual_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                            const T* rstd, int N, int C, bool rms) {
    norm_rows_backward(dinp, C, false, dweight, dbias, dout, C, inp, C, weight, mean, rstd, N, C, rms);
}

template <typename T>
void qk_norm_forward(T* qkv, T* qk, T* mean, T* rstd, const T* q_weight, const T* q_bias, const T* k_weight,
                     const T* k_bias, int N, int C, int KV, float eps, bool rms) {
    const int W = C + 2 * KV, Wqk = C + KV;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        std::memcpy(qk + static_cast<size_t>(n) * Wqk, qkv + static_cast<size_t>(n) * W,
                    static_cast<size_t>(Wqk) * sizeof(T));
    }
    const T* none = nullptr;
    norm_rows_forward(qkv, W, none, mean, rstd, qk, Wqk, q_weight, q_bias, N, C, eps, rms);
    norm_rows_forward(qkv + C, W, none, mean != nullptr ? mean + N : nullptr, rstd + N, qk + C, Wqk, k_weight, k_bias,
                      N, KV, eps, rms);
}

template <typename T>
void qk_norm_backward(T* dqkv, T* dq_weight, T* dq_bias, T* dk_weight, T* dk_bias, const T* qk, const T* q_weight,
                      const T* k_weight, const T* mean, const T* rstd, int N, int C, int KV, bool rms) {
    const int W = C + 2 * KV, Wqk = C + KV;
    norm_rows_backward(dqkv, W, false, dq_weight, dq_bias, dqkv, W, qk, Wqk, q_weight, mean, rstd, N, C, rms);
    norm_rows_backward(dqkv + C, W, false, dk_weight, dk_bias, dqkv + C, W, qk + C, Wqk, k_weight,
                       mean != nullptr ? mean + N : nullptr, rstd + N, N, KV, rms);
}

#define TRAINER_NORM_INSTANTIATE(T)                                                                                    \
    template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, float, bool);               \
    template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int, int, bool); \
    template void norm_backward_from_output<T>(T*, const T*, const T*, const T*, int, int, bool);                      \
    template void norm_residual_forward<T>(T*, const T*, T*, T*, const T*, const T*, const T*, int, int, float, bool); \
    template void norm_residual_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int, int,    \
                                            bool);                                                                     \
    template void qk_norm_forward<T>(T*, T*, T*, T*, const T*, const T*, const T*, const T*, int, int, int, float,     \
                                     bool);                                                                            \
    template void qk_norm_backward<T>(T*, T*, T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int, int,  \
                                      int, bool);
TRAINER_NORM_INSTANTIATE(float)
TRAINER_NORM_INSTANTIATE(double)
#undef TRAINER_NORM_INSTANTIATE

}  // namespace trainer::cpu
