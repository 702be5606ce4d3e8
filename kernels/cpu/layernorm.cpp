// LayerNorm over the last dimension, affine (GPT-2), affine without bias, or non-parametric (OLMo).
// Forward saves mean and rstd per row so the backward reads inp and dout once each. The backward adds
// into dinp (the residual stream's gradient already sits there) and reduces dweight/dbias over rows
// through fixed chunks of rows, summed in chunk order, so the result does not depend on threads.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

// Rows per partial dweight/dbias sum: large enough that the partials (N/32 x 2C) stay small next to
// the activations, small enough that N = 2040 rows still give every thread work.
constexpr int kRowsPerChunk = 32;

}  // namespace

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int N, int C,
                       float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const T* __restrict x = inp + static_cast<size_t>(n) * C;
        T* __restrict o = out + static_cast<size_t>(n) * C;
        T sum = T(0);
#pragma omp simd reduction(+ : sum)
        for (int c = 0; c < C; ++c) sum += x[c];
        const T m = sum / T(C);
        // Two passes over a row that sits in L1: the centred sum of squares avoids the cancellation
        // of E[x^2] - E[x]^2 when |mean| >> std.
        T sq = T(0);
#pragma omp simd reduction(+ : sq)
        for (int c = 0; c < C; ++c) {
            const T d = x[c] - m;
            sq += d * d;
        }
        const T rs = T(1) / std::sqrt(sq / T(C) + T(eps));
        mean[n] = m;
        rstd[n] = rs;
        if (weight != nullptr && bias != nullptr) {
#pragma omp simd
            for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * rs * weight[c] + bias[c];
        } else if (weight != nullptr) {
#pragma omp simd
            for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * rs * weight[c];
        } else if (bias != nullptr) {  // not a shape the model builds, but the contract allows it
#pragma omp simd
            for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * rs + bias[c];
        } else {
#pragma omp simd
            for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * rs;
        }
    }
}

template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                        const T* rstd, int N, int C) {
    const bool params = dweight != nullptr || dbias != nullptr;
    const int nchunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    std::vector<T> partial(params ? static_cast<size_t>(nchunks) * 2 * C : 0, T(0));
#pragma omp parallel for schedule(static)
    for (int chunk = 0; chunk < nchunks; ++chunk) {
        T* __restrict pw = params ? partial.data() + static_cast<size_t>(chunk) * 2 * C : nullptr;
        T* __restrict pb = params ? pw + C : nullptr;
        const int n1 = std::min(N, (chunk + 1) * kRowsPerChunk);
        for (int n = chunk * kRowsPerChunk; n < n1; ++n) {
            const T* __restrict x = inp + static_cast<size_t>(n) * C;
            const T* __restrict g = dout + static_cast<size_t>(n) * C;
            T* __restrict dx = dinp + static_cast<size_t>(n) * C;
            const T m = mean[n];
            const T rs = rstd[n];
            // dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dout * weight.
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
            const T mean_dn = sum_dn / T(C);
            const T mean_dn_norm = sum_dn_norm / T(C);
            if (weight != nullptr) {
#pragma omp simd
                for (int c = 0; c < C; ++c) {
                    const T norm = (x[c] - m) * rs;
                    dx[c] += rs * (g[c] * weight[c] - mean_dn - norm * mean_dn_norm);
                }
            } else {
#pragma omp simd
                for (int c = 0; c < C; ++c) {
                    const T norm = (x[c] - m) * rs;
                    dx[c] += rs * (g[c] - mean_dn - norm * mean_dn_norm);
                }
            }
            if (params) {
#pragma omp simd
                for (int c = 0; c < C; ++c) {
                    pw[c] += g[c] * (x[c] - m) * rs;
                    pb[c] += g[c];
                }
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

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*, const float*, int, int,
                                       float);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*, const double*, int,
                                        int, float);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*, const float*, const float*,
                                        const float*, int, int);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                         const double*, const double*, int, int);

}  // namespace trainer::cpu
