// CPU GEMMs: every matrix product of the model (Linear layers, the tied classifier) goes through
// OpenBLAS; only the bias column sums are hand-written, because a BLAS GEMV against a ones vector
// would sum in an order OpenBLAS chooses per thread count, and dbias must be bitwise repeatable.
// Row-major throughout; parameter gradients accumulate, dinp is overwritten unless asked to accumulate.
//
// OpenBLAS's own threads are not used: how it splits a product over them changes the bits with the thread count
// on most of its x86 kernel sets (Haswell, Zen, Prescott, Nehalem and older; on 2026-12-02 only SkylakeX,
// Cooperlake and Sandybridge summed the same on 1 to 6 threads), because the column strips its kernels take in
// one sweep depend on each thread's share. Instead a product is cut into tiles fixed by its shape and the
// partition set with the run's starting thread count (set_gemm_partition), each tile one single-threaded BLAS
// call, the tiles shared out over however many threads run now: the thread governor's changes then change the
// speed, never a bit. Measured on 2026-12-02 against OpenBLAS's own threads (2 cores of an AMD EPYC, --threads 2,
// the mean step of 4, two rounds, on its Haswell and its Cooperlake kernels): the cpu_bench, cpu_bench_gpt2 and
// gpt2_124m configs' steps took from 2% longer to 11% less time; on 2 cores of an Intel Xeon (its SkylakeX kernels,
// gpt2_124m at batch 2), from 4% less to 2% more.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
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

std::atomic<int> g_partition{1};

// The tile grid of a product C(M,N) with inner size K: at most `ways` tiles, as many as fit at kMinTile rows and
// columns each, and among those the grid that packs the least (each tile packs its rows of A and its columns of
// B: K * (M * columns + N * rows)). Products below kMinWork multiply-adds are one tile (OpenBLAS's own threshold
// for using one thread is 2^18).
constexpr int kMinTile = 16;
constexpr double kMinWork = 262144.0;

struct Tiles {
    int rows = 1, cols = 1;  // tile size
    int row_tiles = 1, col_tiles = 1;
    int count() const { return row_tiles * col_tiles; }
};

Tiles gemm_tiles(int M, int N, int K, int ways) {
    Tiles t;
    t.rows = M;
    t.cols = N;
    if (ways <= 1 || static_cast<double>(M) * N * K < kMinWork) return t;
    const int max_r = std::max(1, M / kMinTile), max_c = std::max(1, N / kMinTile);
    int best_r = 1, best_c = 1;
    double best_cost = 0.0;
    for (int r = 1; r <= std::min(ways, max_r); ++r) {
        const int c = std::min(ways / r, max_c);
        const double cost = static_cast<double>(M) * c + static_cast<double>(N) * r;
        if (r * c > best_r * best_c || (r * c == best_r * best_c && cost < best_cost)) {
            best_r = r;
            best_c = c;
            best_cost = cost;
        }
    }
    // Tile edges on multiples of kMinTile where the size allows (the kernels' own blocking), the last tile short.
    auto size = [](int n, int parts) {
        const int even = (n + parts - 1) / parts;
        return parts == 1 ? n : std::min(n, (even + kMinTile - 1) / kMinTile * kMinTile);
    };
    t.rows = size(M, best_r);
    t.cols = size(N, best_c);
    t.row_tiles = (M + t.rows - 1) / t.rows;
    t.col_tiles = (N + t.cols - 1) / t.cols;
    return t;
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
    const Tiles t = gemm_tiles(M, N, K, g_partition.load(std::memory_order_relaxed));
    const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
#pragma omp parallel for schedule(dynamic, 1) if (t.count() > 1)
    for (int tile = 0; tile < t.count(); ++tile) {
        // This task's BLAS call on its own thread: OpenBLAS sizes its split by the calling task's thread count.
        omp_set_num_threads(1);
        const int i0 = tile / t.col_tiles * t.rows, j0 = tile % t.col_tiles * t.cols;
        const int m = std::min(t.rows, M - i0), n = std::min(t.cols, N - j0);
        // Rows i0.. of op(A) and columns j0.. of op(B), in their stored layouts.
        const T* a = trans_a ? A + i0 : A + static_cast<size_t>(i0) * lda;
        const T* b = trans_b ? B + static_cast<size_t>(j0) * ldb : B + j0;
        blas_gemm(ta, tb, m, n, K, alpha, a, lda, b, ldb, beta, C + static_cast<size_t>(i0) * ldc + j0, ldc);
    }
}

void set_gemm_partition(int ways) { g_partition.store(std::max(1, ways), std::memory_order_relaxed); }
int gemm_partition() { return g_partition.load(std::memory_order_relaxed); }

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
