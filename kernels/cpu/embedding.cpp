// Token (+ learned position) embedding lookup and its scatter-add backward.
// The backward is the one place a row of dwte gathers from an unknown set of tokens; instead of
// atomics or per-thread copies of dwte (V x C), each thread owns a slice of channels and walks every
// row in order, so each dwte element sums its contributions in row order for any thread count.
#include <omp.h>

#include <algorithm>
#include <cstddef>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

// Channel slices are whole 64-byte lines so threads never share a cache line of dwte/dwpe.
constexpr int kChannelAlign = 16;

}  // namespace

template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int N, int T_, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        T* __restrict o = out + static_cast<size_t>(n) * C;
        const T* __restrict e = wte + static_cast<size_t>(tokens[n]) * C;
        if (wpe != nullptr) {
            const T* __restrict p = wpe + static_cast<size_t>(n % T_) * C;
#pragma omp simd
            for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
        } else {
#pragma omp simd
            for (int c = 0; c < C; ++c) o[c] = e[c];
        }
    }
}

template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int N, int T_, int C) {
#pragma omp parallel
    {
        const int nthreads = omp_get_num_threads();
        const int tid = omp_get_thread_num();
        const int units = (C + kChannelAlign - 1) / kChannelAlign;
        const int per = (units + nthreads - 1) / nthreads;
        const int c0 = std::min(C, tid * per * kChannelAlign);
        const int c1 = std::min(C, (tid + 1) * per * kChannelAlign);
        if (c0 < c1) {
            for (int n = 0; n < N; ++n) {
                const T* __restrict g = dout + static_cast<size_t>(n) * C;
                T* __restrict e = dwte + static_cast<size_t>(tokens[n]) * C;
#pragma omp simd
                for (int c = c0; c < c1; ++c) e[c] += g[c];
                if (dwpe != nullptr) {
                    T* __restrict p = dwpe + static_cast<size_t>(n % T_) * C;
#pragma omp simd
                    for (int c = c0; c < c1; ++c) p[c] += g[c];
                }
            }
        }
    }
}

template void embedding_forward<float>(float*, const int32_t*, const float*, const float*, int, int, int);
template void embedding_forward<double>(double*, const int32_t*, const double*, const double*, int, int, int);
template void embedding_backward<float>(float*, float*, const float*, const int32_t*, int, int, int);
template void embedding_backward<double>(double*, double*, const double*, const int32_t*, int, int, int);

}  // namespace trainer::cpu
