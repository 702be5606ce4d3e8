// CPU LoRA: the adapter's two small GEMMs a pass through OpenBLAS (gemm in matmul.cpp), its dropout mask from the
// counter-based hash every backend shares (element.h), applied into the scratch, never stored.
#include <cstddef>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

// xd(M, K) = drop(inp): kept elements scaled by 1 / (1 - p), the others 0; in place where xd == inp.
template <typename T>
void apply_dropout(T* xd, const T* inp, int M, int K, float p, const uint64_t* row_keys, uint32_t adapter) {
    const uint32_t threshold = lora_dropout_threshold(p);
    const T keep_scale = T(1) / (T(1) - T(p));
#pragma omp parallel for schedule(static)
    for (int m = 0; m < M; ++m) {
        const uint64_t key = row_keys[m];
        const T* x = inp + static_cast<size_t>(m) * K;
        T* y = xd + static_cast<size_t>(m) * K;
        for (int k = 0; k < K; ++k) {
            y[k] = lora_dropout_keep(key, adapter, static_cast<uint32_t>(k), threshold) ? x[k] * keep_scale : T(0);
        }
    }
}

}  // namespace

template <typename T>
void lora_forward(T* out, int ld_out, const T* inp, const T* A, const T* B, int M, int K, int r, int n, T scale,
                  float p, const uint64_t* row_keys, uint32_t adapter, T* work) {
    const T* x = inp;
    T* h = work;
    if (p > 0.0f) {
        apply_dropout(work, inp, M, K, p, row_keys, adapter);
        x = work;
        h = work + static_cast<size_t>(M) * K;
    }
    gemm<T>(false, true, M, r, K, T(1), x, K, A, K, T(0), h, r);          // h = x A^T
    gemm<T>(false, true, M, n, r, scale, h, r, B, r, T(1), out, ld_out);  // out += scale h B^T
}

template <typename T>
void lora_backward(T* dinp, T* dA, T* dB, const T* dout, int ld_dout, const T* inp, const T* A, const T* B, int M,
                   int K, int r, int n, T scale, float p, const uint64_t* row_keys, uint32_t adapter, T* work) {
    const size_t MK = static_cast<size_t>(M) * K, Mr = static_cast<size_t>(M) * r;
    const T* x = inp;
    if (p > 0.0f) {
        apply_dropout(work, inp, M, K, p, row_keys, adapter);
        x = work;
    }
    T* h = work + MK;
    T* g = h + Mr;
    gemm<T>(false, true, M, r, K, T(1), x, K, A, K, T(0), h, r);             // h = x A^T
    gemm<T>(false, false, M, r, n, scale, dout, ld_dout, B, r, T(0), g, r);  // g = scale dout B
    gemm<T>(true, false, n, r, M, scale, dout, ld_dout, h, r, T(1), dB, r);  // dB += scale dout^T h
    gemm<T>(true, false, r, K, M, T(1), g, r, x, K, T(1), dA, K);            // dA += g^T x
    if (dinp == nullptr) return;
    if (p <= 0.0f) {
        gemm<T>(false, false, M, K, r, T(1), g, r, A, K, T(1), dinp, K);  // dinp += g A
        return;
    }
    gemm<T>(false, false, M, K, r, T(1), g, r, A, K, T(0), work, K);  // the dropped input's gradient
    apply_dropout(work, work, M, K, p, row_keys, adapter);
#pragma omp parallel for schedule(static)
    for (long long i = 0; i < static_cast<long long>(MK); ++i) dinp[i] += work[i];
}

template void lora_forward<float>(float*, int, const float*, const float*, const float*, int, int, int, int, float,
                                  float, const uint64_t*, uint32_t, float*);
template void lora_forward<double>(double*, int, const double*, const double*, const double*, int, int, int, int,
                                   double, float, const uint64_t*, uint32_t, double*);
template void lora_backward<float>(float*, float*, float*, const float*, int, const float*, const float*, const float*,
                                   int, int, int, int, float, float, const uint64_t*, uint32_t, float*);
template void lora_backward<double>(double*, double*, double*, const double*, int, const double*, const double*,
                                    const double*, int, int, int, int, double, float, const uint64_t*, uint32_t,
                                    double*);

}  // namespace trainer::cpu
