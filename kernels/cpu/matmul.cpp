// CPU GEMMs: every matrix product of the model (Linear layers, the tied classifier) goes through
// OpenBLAS; only the bias column sums are hand-written, because a BLAS GEMV against a ones vector
// would sum in an order OpenBLAS chooses per thread count, and dbias must be bitwise repeatable.
// Row-major throughout; parameter gradients accumulate, dinp is overwritten unless asked to accumulate.
#include <cblas.h>

#include <algorithm>
#include <cstddef>

#include "kernels/cpu/ops.h"

namespace trainer::cpu {

namespace {

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha, const float* A, int lda,
               const float* B, int ldb, float beta, float* C, int ldc) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, double alpha, const double* A, int lda,
               const double* B, int ldb, double beta, double* C, int ldc) {
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Columns per dbias task: a whole 64-byte line or more per row for float, and enough tasks for the
// threads at C = 512. The sum of each column runs over the rows in order whatever the partition.
constexpr int kBiasColumns = 64;

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
          T* C, int ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        // BLAS rejects a zero leading dimension, and an empty product leaves beta * C.
#pragma omp parallel for schedule(static)
        for (int i = 0; i < M; ++i) {
            T* row = C + static_cast<size_t>(i) * ldc;
            for (int j = 0; j < N; ++j) row[j] = beta == T(0) ? T(0) : beta * row[j];
        }
        return;
    }
    blas_gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb,
              beta, C, ldc);
}

template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int M, int K, int N) {
    T beta = T(0);
    if (bias != nullptr) {
        // Seeding out with the bias and letting the GEMM add into it saves a second pass over out.
#pragma omp parallel for schedule(static)
        for (int i = 0; i < M; ++i) {
            T* __restrict row = out + static_cast<size_t>(i) * N;
#pragma omp simd
            for (int j = 0; j < N; ++j) row[j] = bias[j];
        }
        beta = T(1);
    }
    gemm<T>(false, true, M, N, K, T(1), inp, K, weight, K, beta, out, N);
}

template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int M, int K, int N,
                     bool accumulate_dinp) {
    if (dinp != nullptr) {
        gemm<T>(false, false, M, K, N, T(1), dout, N, weight, K, accumulate_dinp ? T(1) : T(0), dinp, K);
    }
    if (dweight != nullptr) {
        gemm<T>(true, false, N, K, M, T(1), dout, N, inp, K, T(1), dweight, K);
    }
    if (dbias != nullptr) {
        const int nblocks = (N + kBiasColumns - 1) / kBiasColumns;
#pragma omp parallel for schedule(static)
        for (int blk = 0; blk < nblocks; ++blk) {
            const int j0 = blk * kBiasColumns;
            const int nj = std::min(kBiasColumns, N - j0);
            T acc[kBiasColumns] = {};
            for (int i = 0; i < M; ++i) {
                const T* __restrict row = dout + static_cast<size_t>(i) * N + j0;
#pragma omp simd
                for (int j = 0; j < nj; ++j) acc[j] += row[j];
            }
            for (int j = 0; j < nj; ++j) dbias[j0 + j] += acc[j];
        }
    }
}

template void gemm<float>(bool, bool, int, int, int, float, const float*, int, const float*, int, float, float*, int);
template void gemm<double>(bool, bool, int, int, int, double, const double*, int, const double*, int, double, double*,
                           int);
template void matmul_forward<float>(float*, const float*, const float*, const float*, int, int, int);
template void matmul_forward<double>(double*, const double*, const double*, const double*, int, int, int);
template void matmul_backward<float>(float*, float*, float*, const float*, const float*, const float*, int, int, int,
                                     bool);
template void matmul_backward<double>(double*, double*, double*, const double*, const double*, const double*, int, int,
                                      int, bool);

}  // namespace trainer::cpu
