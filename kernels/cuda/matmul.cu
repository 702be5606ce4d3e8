// GEMMs through cuBLASLt, the twin of kernels/cpu/matmul.cpp: PyTorch Linear forward (the bias added by
// cuBLASLt's BIAS epilogue, saving a pass) and backward (dinp, dweight accumulated; dbias is bias.cu's). fp32 with
// CUBLAS_COMPUTE_32F: TF32 stays off, for parity with the CPU. The algorithm for each shape is chosen once by
// cuBLASLt's heuristic and cached; the workspace is allocated once.
//
// Row-major to cuBLAS's column-major: C(M,N) row-major is C^T column-major, so C = op(A) op(B) is
// computed as C^T = op(B)^T op(A)^T, i.e. the column-major GEMM with A and B swapped and m = N, n = M.
#include <cublasLt.h>

#include <map>
#include <set>
#include <tuple>

#include "base/common.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {}  // namespace

// cuBLASLt's statuses for TRAINER_CUDA_CHECK (check.h).
inline bool succeeded(cublasStatus_t st) { return st == CUBLAS_STATUS_SUCCESS; }
inline std::string status_message(cublasStatus_t st) { return cublasLtGetStatusString(st); }

namespace {

// C(M, N) (leading dimension ldc) = beta C + bias(N) per row (beta 0: C is not read; bias nullable).
__global__ void scale_add_bias_kernel(float* C, int ldc, int M, int N, float beta, const float* bias) {
    const size_t total = static_cast<size_t>(M) * N;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(i / N), c = static_cast<int>(i % N);
        float& x = C[static_cast<size_t>(r) * ldc + c];
        x = (beta == 0.0f ? 0.0f : beta * x) + (bias != nullptr ? bias[c] : 0.0f);
    }
}

void scale_add_bias(float* C, int ldc, int M, int N, float beta, const float* bias, cudaStream_t stream) {
    constexpr unsigned kBlock = 256;
    TRAINER_LAUNCH(scale_add_bias_kernel, grid_for(static_cast<size_t>(M) * N, kBlock), kBlock, 0, stream, C, ldc, M, N,
                   beta, bias);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

// The largest power of two (up to 256) dividing the address.
uint32_t alignment_of(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    uint32_t align = 256;
    while (align > 1 && a % align != 0) align /= 2;
    return align;
}

}  // namespace

struct Gemm::State {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    // (transa, transb, m, n, k, lda, ldb, ldc, bias epilogue + 2 x input type) -> algorithm, column-major terms.
    // The key's last entry packs the epilogue, the input type and the operands' alignments.
    std::map<std::tuple<int, int, int, int, int, int, int, int, long long>, cublasLtMatmulAlgo_t> algos;
    std::set<std::tuple<int, int, int, int, int, int, int, int, long long>> no_algo;  // fused GELU unavailable
};

Gemm::Gemm(size_t workspace_bytes) : s_(new State) {
    TRAINER_CUDA_CHECK(cublasLtCreate(&s_->handle));
    s_->workspace_bytes = workspace_bytes;
    if (workspace_bytes == 0) return;
    const cudaError_t err = cudaMalloc(&s_->workspace, workspace_bytes);
    if (err == cudaErrorMemoryAllocation) {
        // The backend's first allocation: a GPU that other processes fill fails here, before any plan could say so.
        (void)cudaGetLastError();
        int device = 0;
        size_t free_b = 0, total_b = 0;
        cudaGetDevice(&device);
        cudaMemGetInfo(&free_b, &total_b);
        cublasLtDestroy(s_->handle);
        delete s_;
        user_error(
            "out of GPU memory on device {} allocating cuBLASLt's workspace of {:.1f} MiB ({:.1f} MiB free of {:.1f} "
            "MiB) before training starts: is another process using the GPU? (nvidia-smi; CUDA_VISIBLE_DEVICES picks "
            "another)",
            device, workspace_bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0);
    }
    TRAINER_CUDA_CHECK(err);
}

Gemm::~Gemm() {
    if (s_->workspace) cudaFree(s_->workspace);
    if (s_->handle) cublasLtDestroy(s_->handle);
    delete s_;
}

void Gemm::run(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc, const float* bias, cudaStream_t stream) {
    run_typed(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, CUDA_R_32F, beta, C, CUDA_R_32F, ldc, bias, nullptr,
              stream, nullptr);
}

void Gemm::run_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const uint16_t* A, int lda,
                    const uint16_t* B, int ldb, float beta, float* C, int ldc, const float* bias, cudaStream_t stream) {
    run_typed(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, CUDA_R_16BF, beta, C, CUDA_R_32F, ldc, bias, nullptr,
              stream, nullptr);
}

bool Gemm::run_bf16_out(bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A, int lda, const uint16_t* B,
                        int ldb, uint16_t* C, int ldc, const uint16_t* bias, cudaStream_t stream) {
    if (K == 0) return false;  // C = 0: the fp32 path's empty product
    return run_typed(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, CUDA_R_16BF, 0.0f, C, CUDA_R_16BF, ldc, bias,
                     nullptr, stream, nullptr);
}

bool Gemm::run_bf16_residual(int M, int N, int K, const uint16_t* A, const uint16_t* B, const float* resid, float* C,
                             const float* bias, cudaStream_t stream) {
    return run_typed(false, true, M, N, K, 1.0f, A, K, B, K, CUDA_R_16BF, 1.0f, C, CUDA_R_32F, N, bias, nullptr, stream,
                     resid);
}

bool Gemm::run_gelu_bf16(int M, int N, int K, const uint16_t* A, const uint16_t* B, uint16_t* out, uint16_t* pre,
                         const uint16_t* bias, cudaStream_t stream) {
    return run_typed(false, true, M, N, K, 1.0f, A, K, B, K, CUDA_R_16BF, 0.0f, out, CUDA_R_16BF, N, bias, pre, stream,
                     nullptr);
}

bool Gemm::gelu_fusable(int N, const void* out, const void* pre, const void* bias) {
    // cuBLASLt's GELU_AUX epilogue wants the auxiliary output's leading dimension a multiple of 8 and
    // vector-aligned outputs; a bias must go through the epilogue too (it precedes the GELU).
    return N % 8 == 0 && alignment_of(out) >= 16 && alignment_of(pre) >= 16 &&
           (bias == nullptr || alignment_of(bias) >= 16);
}

bool Gemm::run_gelu(int M, int N, int K, const void* A, const void* B, cudaDataType_t ab_type, float* out, float* pre,
                    const float* bias, cudaStream_t stream) {
    // out(M, N) = gelu_tanh(pre), pre = A(M, K) @ B(N, K)^T + bias: the Linear forward with the GELU fused.
    return run_typed(false, true, M, N, K, 1.0f, A, K, B, K, ab_type, 0.0f, out, CUDA_R_32F, N, bias, pre, stream,
                     nullptr);
}

bool Gemm::run_dgelu_bf16(bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A, int lda,
                          const uint16_t* B, int ldb, uint16_t* C, int ldc, const uint16_t* pre, cudaStream_t stream) {
    if (K == 0) return false;  // C = 0 times the GELU's slope: the two-op path
    return run_typed(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, CUDA_R_16BF, 0.0f, C, CUDA_R_16BF, ldc, nullptr,
                     const_cast<uint16_t*>(pre), stream, nullptr, true);
}

bool Gemm::run_fp8(int M, int N, int K, Fp8Matrix A, Fp8Matrix B, float beta, void* C, bool c_bf16, const void* bias,
                   const float* c_in, cudaStream_t stream) {
    // cuBLASLt's FP8 kernels take operands K-contiguous (its "TN" layout: the forward's), N and K (the leading
    // dimensions) multiples of 16, and not both operands e5m2; M is free.
    if (N % 16 != 0 || K % 16 != 0 || K == 0) return false;
    if (A.format == Fp8Format::kE5M2 && B.format == Fp8Format::kE5M2) return false;
    const auto type = [](Fp8Format f) { return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; };
    const Fp8Scales scales{type(B.format), A.descale, B.descale};
    return run_typed(false, true, M, N, K, 1.0f, A.codes, K, B.codes, K, type(A.format), beta, C,
                     c_bf16 ? CUDA_R_16BF : CUDA_R_32F, N, bias, nullptr, stream, c_in, false, &scales);
}

bool Gemm::run_typed(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, int lda,
                     const void* B, int ldb, cudaDataType_t ab_type, float beta, void* C, cudaDataType_t c_type,
                     int ldc, const void* bias, void* gelu_aux, cudaStream_t stream, const float* c_in, bool gelu_grad,
                     const Fp8Scales* fp8) {
    if (M == 0 || N == 0) return true;
    if (fp8 != nullptr && (K == 0 || gelu_aux != nullptr)) return false;  // FP8: a product, no GELU epilogue
    // B's element type: A's, or under FP8 its own.
    const cudaDataType_t b_type = fp8 != nullptr ? fp8->b_type : ab_type;
    if (gelu_grad && (gelu_aux == nullptr || bias != nullptr)) return false;  // DGELU: its input, and no bias
    // D = alpha op(A) op(B) + beta c_in (+ bias) into C where c_in is given (fp32 C only; K > 0), else in place.
    if (c_in != nullptr && (c_type != CUDA_R_32F || K == 0)) return false;
    // The bias epilogue reads the bias with vector loads; cuBLASLt has no alignment preference for it,
    // so an fp32 bias at a 4-byte offset of its unit is added by a separate pass instead. The bias has C's
    // type (cuBLASLt's rule for bf16 outputs); FP8 GEMMs take a bias in the epilogue only for a bf16 C.
    const bool fuse_bias = bias != nullptr && alignment_of(bias) >= 16 && (fp8 == nullptr || c_type != CUDA_R_32F);
    // A bf16 C: an aligned bias or none, K > 0 (the callers take the fp32 path for the rest); a GELU auxiliary
    // output has C's type too.
    if (c_type != CUDA_R_32F && ((bias != nullptr && !fuse_bias) || K == 0)) return false;
    if (K == 0) {  // an empty product: C = beta C (+ bias), which cuBLASLt's layouts cannot express
        if (gelu_aux != nullptr) return false;
        scale_add_bias(static_cast<float*>(C), ldc, M, N, beta, static_cast<const float*>(bias), stream);
        return true;
    }
    // Column-major: C^T(N, M) = op(B)^T (N, K) x op(A)^T (K, M).
    const cublasOperation_t ta = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // on B, the first operand
    const cublasOperation_t tb = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // on A, the second
    const int m = N, n = M, k = K;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    TRAINER_CUDA_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    TRAINER_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    TRAINER_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    // Epilogues: BIAS adds bias(m) to every column (bias(N) per row); GELU_AUX(_BIAS) also writes the
    // pre-activation to gelu_aux (leading dimension ldc) and gelu_tanh of it to C; DGELU multiplies the product by
    // gelu_tanh' of gelu_aux (read with leading dimension ldc).
    const cublasLtEpilogue_t epi =
        gelu_aux != nullptr ? (gelu_grad ? CUBLASLT_EPILOGUE_DGELU
                                         : (fuse_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX))
                            : (fuse_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
    if (epi != CUBLASLT_EPILOGUE_DEFAULT)
        TRAINER_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (fuse_bias)
        TRAINER_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    if (fp8 != nullptr) {
        // The descales multiply the product: cuBLASLt's A is our B (the operands are swapped, above).
        TRAINER_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &fp8->b_descale,
                                                          sizeof fp8->b_descale));
        TRAINER_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &fp8->a_descale,
                                                          sizeof fp8->a_descale));
    }
    if (gelu_aux != nullptr) {
        if (bias != nullptr && !fuse_bias) TRAINER_CUDA_FAIL("cublasLtMatmul", "GELU epilogue with an unaligned bias");
        const int64_t aux_ld = ldc;
        TRAINER_CUDA_CHECK(
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &gelu_aux, sizeof gelu_aux));
        TRAINER_CUDA_CHECK(
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld));
    }
    // Stored shapes (before op): the first operand is B (m x k, or k x m transposed), the second A.
    TRAINER_CUDA_CHECK(
        cublasLtMatrixLayoutCreate(&la, b_type, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, ldb));
    TRAINER_CUDA_CHECK(
        cublasLtMatrixLayoutCreate(&lb, ab_type, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, lda));
    TRAINER_CUDA_CHECK(cublasLtMatrixLayoutCreate(&lc, c_type, m, n, ldc));
    // cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise; parameters sit at
    // arbitrary 4-byte offsets of a unit's flat buffer and head chunks start mid-arena, so the real
    // alignments are passed (and are part of the cache key: an algorithm chosen for aligned operands may
    // not run on unaligned ones).
    // C is the matmul's input (c_in where given, else the output itself) and D its output: their alignments apart.
    const uint32_t align_first = alignment_of(B), align_second = alignment_of(A);
    const uint32_t align_c = alignment_of(c_in != nullptr ? static_cast<const void*>(c_in) : C),
                   align_d = alignment_of(C);
    // Epilogue (< 1024), input and output types (< 64 each) and the six alignments (A, B, C, the bias, the GELU
    // output and c_in, which the heuristic also reads from their pointers) as log2, 4 bits each: no overlap.
    long long extra = static_cast<long long>(epi) + 1024LL * static_cast<int>(ab_type) +
                      (1LL << 40) * static_cast<int>(c_type) + (1LL << 48) * static_cast<int>(b_type);
    int shift = 16;
    for (const void* p : {static_cast<const void*>(B), A, static_cast<const void*>(C),
                          static_cast<const void*>(fuse_bias ? bias : nullptr), static_cast<const void*>(gelu_aux),
                          static_cast<const void*>(c_in)}) {
        const uint32_t a = p != nullptr ? alignment_of(p) : 256;
        extra += static_cast<long long>(__builtin_ctz(a)) << shift;
        shift += 4;
    }
    const auto key = std::make_tuple(static_cast<int>(ta), static_cast<int>(tb), m, n, k, lda, ldb, ldc, extra);
    if (s_->no_algo.count(key) != 0) {
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatmulDescDestroy(op);
        return false;
    }
    auto it = s_->algos.find(key);
    if (it == s_->algos.end()) {
        cublasLtMatmulPreference_t pref = nullptr;
        TRAINER_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        TRAINER_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                &s_->workspace_bytes, sizeof s_->workspace_bytes));
        const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
            {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_first},
            {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_second},
            {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
            {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
        for (const auto& [attr, value] : aligns)
            TRAINER_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value));
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        const cublasStatus_t status =
            cublasLtMatmulAlgoGetHeuristic(s_->handle, op, la, lb, lc, lc, pref, 1, &result, &found);
        cublasLtMatmulPreferenceDestroy(pref);
        const bool optional = gelu_aux != nullptr || c_type != CUDA_R_32F || c_in != nullptr || fp8 != nullptr;
        if (status != CUBLAS_STATUS_SUCCESS && !optional) TRAINER_CUDA_CHECK(status);
        // No fused kernel (or no bf16 output, or no FP8) for this GPU or shape, or cuBLASLt refuses the
        // combination: the caller falls back to the fp32 (or bf16) GEMM.
        if (optional && (status != CUBLAS_STATUS_SUCCESS || found == 0)) {
            s_->no_algo.insert(key);
            cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatmulDescDestroy(op);
            return false;
        }
        if (found == 0) {
            TRAINER_CUDA_FAIL("cublasLtMatmulAlgoGetHeuristic",
                              std::string("no ") + (ab_type == CUDA_R_32F ? "fp32" : "bf16") + " algorithm for a " +
                                  std::to_string(M) + " x " + std::to_string(N) + " x " + std::to_string(K) + " GEMM");
        }
        it = s_->algos.emplace(key, result.algo).first;
    }
    // B and A swapped: the column-major product's first operand is B.
    TRAINER_CUDA_CHECK(cublasLtMatmul(s_->handle, op, &alpha, B, la, A, lb, &beta, c_in != nullptr ? c_in : C, lc, C,
                                      lc, &it->second, s_->workspace, s_->workspace_bytes, stream));
    if (bias != nullptr && !fuse_bias)
        scale_add_bias(static_cast<float*>(C), ldc, M, N, 1.0f, static_cast<const float*>(bias), stream);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(op);
    return true;
}

void matmul_forward(Gemm& gemm, float* out, const float* inp, const float* weight, const float* bias, int M, int K,
                    int N, cudaStream_t stream) {
    // out(M, N) = inp(M, K) @ weight(N, K)^T + bias(N)
    gemm.run(false, true, M, N, K, 1.0f, inp, K, weight, K, 0.0f, out, N, bias, stream);
}

void matmul_backward(Gemm& gemm, float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                     int M, int K, int N, bool accumulate_dinp, cudaStream_t stream) {
    // dinp(M, K) (+)= dout(M, N) @ weight(N, K)
    if (dinp != nullptr)
        gemm.run(false, false, M, K, N, 1.0f, dout, N, weight, K, accumulate_dinp ? 1.0f : 0.0f, dinp, K, nullptr,
                 stream);
    // dweight(N, K) += dout^T (N, M) @ inp(M, K)
    if (dweight != nullptr) gemm.run(true, false, N, K, M, 1.0f, dout, N, inp, K, 1.0f, dweight, K, nullptr, stream);
}

void matmul_gelu_forward(Gemm& gemm, float* pre, float* out, const float* inp, const float* weight, const float* bias,
                         int M, int K, int N, cudaStream_t stream) {
    if (K > 0 && M > 0 && Gemm::gelu_fusable(N, out, pre, bias) &&
        gemm.run_gelu(M, N, K, inp, weight, CUDA_R_32F, out, pre, bias, stream)) {
        return;
    }
    matmul_forward(gemm, pre, inp, weight, bias, M, K, N, stream);
    gelu_forward(out, pre, static_cast<size_t>(M) * N, true, stream);
}

void matmul_gelu_forward(Gemm& gemm, float* pre, float* out, const uint16_t* inp, const uint16_t* weight,
                         const float* bias, int M, int K, int N, cudaStream_t stream) {
    if (K > 0 && M > 0 && Gemm::gelu_fusable(N, out, pre, bias) &&
        gemm.run_gelu(M, N, K, inp, weight, CUDA_R_16BF, out, pre, bias, stream)) {
        return;
    }
    matmul_forward(gemm, pre, inp, weight, bias, M, K, N, stream);
    gelu_forward(out, pre, static_cast<size_t>(M) * N, true, stream);
}

void matmul_forward(Gemm& gemm, float* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int M,
                    int K, int N, cudaStream_t stream) {
    gemm.run_bf16(false, true, M, N, K, 1.0f, inp, K, weight, K, 0.0f, out, N, bias, stream);
}

bool matmul_residual_forward(Gemm& gemm, float* out, const float* resid, const uint16_t* inp, const uint16_t* weight,
                             const float* bias, int M, int K, int N, cudaStream_t stream) {
    return gemm.run_bf16_residual(M, N, K, inp, weight, resid, out, bias, stream);
}

bool matmul_gelu_forward(Gemm& gemm, uint16_t* pre, uint16_t* out, const uint16_t* inp, const uint16_t* weight,
                         const uint16_t* bias, int M, int K, int N, cudaStream_t stream) {
    if (K == 0 || M == 0 || !Gemm::gelu_fusable(N, out, pre, bias)) return false;
    return gemm.run_gelu_bf16(M, N, K, inp, weight, out, pre, bias, stream);
}

bool matmul_forward(Gemm& gemm, uint16_t* out, const uint16_t* inp, const uint16_t* weight, const uint16_t* bias, int M,
                    int K, int N, cudaStream_t stream) {
    return gemm.run_bf16_out(false, true, M, N, K, inp, K, weight, K, out, N, bias, stream);
}

bool matmul_backward_dgelu(Gemm& gemm, uint16_t* dpre, float* dweight, const uint16_t* dout16, const uint16_t* act16,
                           const uint16_t* weight16, const uint16_t* pre, int M, int K, int N, cudaStream_t stream) {
    // dpre(M, K) = dout(M, N) @ weight(N, K), times gelu_tanh'(pre): the input gradient as matmul_backward's.
    if (M == 0 || K == 0 || N == 0 || !Gemm::gelu_fusable(K, dpre, pre, nullptr)) return false;
    if (!gemm.run_dgelu_bf16(false, false, M, K, N, dout16, N, weight16, K, dpre, K, pre, stream)) return false;
    if (dweight != nullptr)
        gemm.run_bf16(true, false, N, K, M, 1.0f, dout16, N, act16, K, 1.0f, dweight, K, nullptr, stream);
    return true;
}

bool matmul_backward(Gemm& gemm, float* dinp, uint16_t* dinp16, float* dweight, const uint16_t* dout16,
                     const uint16_t* inp16, const uint16_t* weight16, int M, int K, int N, bool accumulate_dinp,
                     cudaStream_t stream) {
    // The bf16 dinp first: where cuBLASLt has no kernel for it, nothing has been queued when this returns.
    if (dinp16 != nullptr && (accumulate_dinp || !gemm.run_bf16_out(false, false, M, K, N, dout16, N, weight16, K,
                                                                    dinp16, K, nullptr, stream)))
        return false;
    if (dinp != nullptr)
        gemm.run_bf16(false, false, M, K, N, 1.0f, dout16, N, weight16, K, accumulate_dinp ? 1.0f : 0.0f, dinp, K,
                      nullptr, stream);
    if (dweight != nullptr)
        gemm.run_bf16(true, false, N, K, M, 1.0f, dout16, N, inp16, K, 1.0f, dweight, K, nullptr, stream);
    return true;
}

}  // namespace trainer::cuda
