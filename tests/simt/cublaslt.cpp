// cuBLASLt emulated on the CPU, for the emulated build: the matmuls kernels/cuda/matmul.cu asks for, computed in
// fp32 on the stream's queue, with the rules of the library's documentation checked where a GPU would
// refuse or misbehave:
//   - operand types fp32, bf16 and FP8 (e4m3, e5m2; not both e5m2), compute type 32F, C's type that of D;
//   - FP8 only in the "TN" layout (A transposed, B not), m, k and both leading dimensions multiples of 16, and
//     without GELU epilogues; the scales (device pointers) multiply the product;
//   - epilogues DEFAULT, BIAS, GELU_AUX(_BIAS) (the auxiliary output's leading dimension a multiple of 8 and at
//     least m) and DGELU; a bias of D's type (bf16 for FP8 with an fp32 D, the documented exception);
//   - the algorithm of cublasLtMatmulAlgoGetHeuristic runs only the configuration it was chosen for, on operands
//     at least as aligned as the preference declared (or, for the bias and auxiliary pointers, as they were);
//   - every operand lies in device memory over its whole extent.
// A refused combination is CUBLAS_STATUS_NOT_SUPPORTED from the heuristic (the caller falls back, as on a GPU);
// a misuse is CUBLAS_STATUS_INVALID_VALUE, with the reason on stderr.
#include <cublasLt.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/element.h"

struct cublasLtContext {
    uint64_t magic = 0x6c74;
};
struct cublasLtMatmulDescOpaque_t {
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = CUDA_R_32F;
    int32_t pointer_mode = 0;
    int32_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void* bias = nullptr;
    void* aux = nullptr;
    int64_t aux_ld = 0;
    const void* a_scale = nullptr;
    const void* b_scale = nullptr;
    const void* d_scale = nullptr;
    void* amax_d = nullptr;
    int32_t bias_type = -1;
    int8_t fast_accum = 0;
};
struct cublasLtMatrixLayoutOpaque_t {
    cudaDataType_t type = CUDA_R_32F;
    uint64_t rows = 0, cols = 0;
    int64_t ld = 0;
};
struct cublasLtMatmulPreferenceOpaque_t {
    uint64_t workspace = 0;
    uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};

namespace {

constexpr uint64_t kAlgoMagic = 0x73696d74616c676fULL;  // "simtalgo"

bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
size_t element_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : t == CUDA_R_16BF ? 2 : 1; }
bool known_type(cudaDataType_t t) { return t == CUDA_R_32F || t == CUDA_R_16BF || is_fp8(t); }

// The OCP 8-bit formats' values (written here from the formats' definitions, not taken from the trainer's casts).
float fp8_value(uint8_t code, cudaDataType_t t) {
    const bool e4m3 = t == CUDA_R_8F_E4M3;
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const int exp = (code & 0x7f) >> mbits, man = code & ((1 << mbits) - 1);
    const float sign = (code & 0x80) ? -1.0f : 1.0f;
    if (e4m3 && (code & 0x7f) == 0x7f) return std::nanf("");
    if (!e4m3 && exp == 31) return man == 0 ? sign * INFINITY : std::nanf("");
    if (exp == 0) return sign * std::ldexp(static_cast<float>(man), 1 - bias - mbits);
    return sign * std::ldexp(1.0f + static_cast<float>(man) / static_cast<float>(1 << mbits), exp - bias);
}

float load(const void* p, cudaDataType_t t, size_t i) {
    switch (t) {
        case CUDA_R_32F:
            return static_cast<const float*>(p)[i];
        case CUDA_R_16BF:
            return trainer::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
        default:
            return fp8_value(static_cast<const uint8_t*>(p)[i], t);
    }
}
void store(void* p, cudaDataType_t t, size_t i, float v) {
    if (t == CUDA_R_32F) {
        static_cast<float*>(p)[i] = v;
    } else {
        static_cast<uint16_t*>(p)[i] = trainer::float_to_bf16(v);
    }
}

float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}
float gelu_tanh_slope(float x) {
    const float k = 0.7978845608028654f;
    const float t = std::tanh(k * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

// acc (n columns of m, column-major) = ra (m rows of k) times rb (n rows of k) transposed, in fp32 with eight running
// sums a dot product (the order of a GPU's accumulation is not specified; this one vectorises). Host vectors of
// exactly those sizes, so the sanitizers' instrumentation is left out here: it made this loop most of an emulated
// training step (31% of the cpu-offload GPU case) and checked nothing the sizes do not; the device reads before it
// and the epilogue's after it keep theirs.
__attribute__((no_sanitize("address", "undefined"))) void product(const float* ra, const float* rb, float* acc,
                                                                  uint64_t m, uint64_t n, uint64_t k) {
    for (uint64_t j = 0; j < n; ++j) {
        const float* y = rb + j * k;
        for (uint64_t i = 0; i < m; ++i) {
            const float* x = ra + i * k;
            float part[8] = {};
            uint64_t kk = 0;
            for (; kk + 8 <= k; kk += 8) {
                for (int l = 0; l < 8; ++l) part[l] += x[kk + l] * y[kk + l];
            }
            for (; kk < k; ++kk) part[kk % 8] += x[kk] * y[kk];
            float sum = 0.0f;
            for (float v : part) sum += v;
            acc[i + j * m] = sum;
        }
    }
}

uint32_t alignment_of(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    uint32_t align = 256;
    while (align > 1 && a % align != 0) align /= 2;
    return align;
}

// The problem a descriptor and four layouts pose: its sizes, or why the library refuses it.
struct Problem {
    uint64_t m = 0, n = 0, k = 0;
    bool fp8 = false;
    cudaDataType_t bias_type = CUDA_R_32F;
};

// CUBLAS_STATUS_NOT_SUPPORTED (with why) for what the library has no kernel for, CUBLAS_STATUS_INVALID_VALUE for
// what contradicts itself; success with the problem's sizes.
cublasStatus_t pose(const cublasLtMatmulDescOpaque_t& d, const cublasLtMatrixLayoutOpaque_t& A,
                    const cublasLtMatrixLayoutOpaque_t& B, const cublasLtMatrixLayoutOpaque_t& C,
                    const cublasLtMatrixLayoutOpaque_t& D, Problem* pr, std::string* why) {
    if (d.compute != CUBLAS_COMPUTE_32F || d.scale != CUDA_R_32F) {
        *why = "only CUBLAS_COMPUTE_32F with fp32 scales is emulated";
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d.pointer_mode != 0) {
        *why = "alpha and beta must be host pointers";
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    for (const auto* l : {&A, &B, &C, &D}) {
        if (!known_type(l->type)) {
            *why = fmt::format("matrix type {}", static_cast<int>(l->type));
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        if (l->ld < static_cast<int64_t>(std::max<uint64_t>(l->rows, 1))) {
            *why = fmt::format("a leading dimension of {} for {} rows", l->ld, l->rows);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    pr->fp8 = is_fp8(A.type) || is_fp8(B.type);
    if (pr->fp8) {
        if (!is_fp8(A.type) || !is_fp8(B.type) || (A.type == CUDA_R_8F_E5M2 && B.type == CUDA_R_8F_E5M2)) {
            *why = "FP8 needs both operands in FP8, not both e5m2";
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
        if (d.ta != CUBLAS_OP_T || d.tb != CUBLAS_OP_N) {
            *why = "FP8 needs the TN layout (A transposed, B not)";
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
    } else if (A.type != B.type) {
        *why = "A and B of different types";
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (C.type != D.type || is_fp8(D.type)) {
        *why = "C of D's type, D in fp32 or bf16";
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (A.type == CUDA_R_32F && D.type != CUDA_R_32F) {
        *why = "fp32 operands with a bf16 output";
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const uint64_t m = d.ta == CUBLAS_OP_N ? A.rows : A.cols, k = d.ta == CUBLAS_OP_N ? A.cols : A.rows;
    const uint64_t kb = d.tb == CUBLAS_OP_N ? B.rows : B.cols, n = d.tb == CUBLAS_OP_N ? B.cols : B.rows;
    if (k != kb || D.rows != m || D.cols != n || C.rows != m || C.cols != n) {
        *why = fmt::format("op(A) {}x{}, op(B) {}x{}, C {}x{}, D {}x{}", m, k, kb, n, C.rows, C.cols, D.rows, D.cols);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (pr->fp8 && (m % 16 != 0 || k % 16 != 0 || A.ld % 16 != 0 || B.ld % 16 != 0)) {
        *why =
            fmt::format("FP8 with m {} and k {} (leading dimensions {}, {}): multiples of 16 needed", m, k, A.ld, B.ld);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const uint32_t epi = d.epilogue;
    const bool bias = epi == CUBLASLT_EPILOGUE_BIAS || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool aux =
        epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || epi == CUBLASLT_EPILOGUE_DGELU;
    if (epi != CUBLASLT_EPILOGUE_DEFAULT && !bias && !aux) {
        *why = fmt::format("epilogue {}", epi);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (pr->fp8 && aux) {
        *why = "FP8 with a GELU epilogue";
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (bias && d.bias == nullptr) {
        *why = "a bias epilogue without CUBLASLT_MATMUL_DESC_BIAS_POINTER";
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    pr->bias_type = d.bias_type >= 0                  ? static_cast<cudaDataType_t>(d.bias_type)
                    : pr->fp8 && D.type == CUDA_R_32F ? CUDA_R_16BF
                                                      : D.type;
    if (aux && (d.aux == nullptr || d.aux_ld % 8 != 0 || d.aux_ld < static_cast<int64_t>(m))) {
        *why = fmt::format(
            "a GELU epilogue's auxiliary matrix at {} with leading dimension {} (a multiple of 8, at "
            "least m = {})",
            d.aux, d.aux_ld, m);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    pr->m = m, pr->n = n, pr->k = k;
    return CUBLAS_STATUS_SUCCESS;
}

// A hash of everything an algorithm is chosen for.
uint64_t signature(const cublasLtMatmulDescOpaque_t& d, const cublasLtMatrixLayoutOpaque_t* layouts[4]) {
    uint64_t h = 1469598103934665603ULL;
    auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
    mix(d.compute), mix(d.ta), mix(d.tb), mix(d.epilogue), mix(static_cast<uint64_t>(d.aux_ld));
    mix(d.bias != nullptr), mix(d.a_scale != nullptr), mix(d.b_scale != nullptr),
        mix(static_cast<uint64_t>(d.bias_type));
    for (int i = 0; i < 4; ++i) {
        mix(layouts[i]->type), mix(layouts[i]->rows), mix(layouts[i]->cols), mix(static_cast<uint64_t>(layouts[i]->ld));
    }
    return h;
}

size_t extent_bytes(const cublasLtMatrixLayoutOpaque_t& l) {
    if (l.rows == 0 || l.cols == 0) return 0;
    return (static_cast<size_t>(l.ld) * (l.cols - 1) + l.rows) * element_bytes(l.type);
}

cublasStatus_t invalid(const std::string& why) {
    std::fprintf(stderr, "simt: cublasLtMatmul: %s\n", why.c_str());
    return CUBLAS_STATUS_INVALID_VALUE;
}

}  // namespace

const char* cublasLtGetStatusString(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS:
            return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED:
            return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED:
            return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE:
            return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_EXECUTION_FAILED:
            return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_INTERNAL_ERROR:
            return "CUBLAS_STATUS_INTERNAL_ERROR";
        case CUBLAS_STATUS_NOT_SUPPORTED:
            return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = new cublasLtContext;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    if (handle == nullptr || handle->magic != 0x6c74) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->magic = 0;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
    if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *desc = new cublasLtMatmulDescOpaque_t;
    (*desc)->compute = compute;
    (*desc)->scale = scale;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    delete desc;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
    if (desc == nullptr || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    auto take = [&](auto& field) {
        if (bytes != sizeof field)
            return invalid(fmt::format("attribute {} of {} bytes, not {}", attr, bytes, sizeof field));
        std::memcpy(&field, buf, bytes);
        return CUBLAS_STATUS_SUCCESS;
    };
    switch (attr) {
        case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
            return take(desc->compute);
        case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
            return take(desc->scale);
        case CUBLASLT_MATMUL_DESC_POINTER_MODE:
            return take(desc->pointer_mode);
        case CUBLASLT_MATMUL_DESC_TRANSA:
            return take(desc->ta);
        case CUBLASLT_MATMUL_DESC_TRANSB:
            return take(desc->tb);
        case CUBLASLT_MATMUL_DESC_EPILOGUE:
            return take(desc->epilogue);
        case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
            return take(desc->bias);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
            return take(desc->aux);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
            return take(desc->aux_ld);
        case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
            return take(desc->a_scale);
        case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
            return take(desc->b_scale);
        case CUBLASLT_MATMUL_DESC_D_SCALE_POINTER:
            return take(desc->d_scale);
        case CUBLASLT_MATMUL_DESC_AMAX_D_POINTER:
            return take(desc->amax_d);
        case CUBLASLT_MATMUL_DESC_FAST_ACCUM:
            return take(desc->fast_accum);
        case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
            return take(desc->bias_type);
    }
    return invalid(fmt::format("matmul descriptor attribute {} is not emulated", attr));
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (layout == nullptr || !known_type(type)) return CUBLAS_STATUS_INVALID_VALUE;
    *layout = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    delete layout;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = new cublasLtMatmulPreferenceOpaque_t;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    delete pref;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
    if (pref == nullptr || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (bytes != sizeof pref->workspace) return invalid("MAX_WORKSPACE_BYTES is a uint64_t");
        std::memcpy(&pref->workspace, buf, bytes);
        return CUBLAS_STATUS_SUCCESS;
    }
    const int i = static_cast<int>(attr) - static_cast<int>(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
    if (i < 0 || i > 3) return invalid(fmt::format("preference attribute {} is not emulated", attr));
    if (bytes != sizeof(uint32_t)) return invalid("a MIN_ALIGNMENT preference is a uint32_t");
    std::memcpy(&pref->align[i], buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
    if (handle == nullptr || desc == nullptr || !Adesc || !Bdesc || !Cdesc || !Ddesc || preference == nullptr ||
        requested < 1 || results == nullptr || returned == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *returned = 0;
    Problem pr;
    std::string why;
    const cublasStatus_t st = pose(*desc, *Adesc, *Bdesc, *Cdesc, *Ddesc, &pr, &why);
    if (st == CUBLAS_STATUS_INVALID_VALUE) return invalid(why);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    // FP8 operands 16-byte aligned (the tensor cores' loads).
    if (pr.fp8 && (preference->align[0] < 16 || preference->align[1] < 16)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const cublasLtMatrixLayoutOpaque_t* layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
    cublasLtMatmulHeuristicResult_t r{};
    r.algo.data[0] = kAlgoMagic;
    r.algo.data[1] = signature(*desc, layouts);
    for (int i = 0; i < 4; ++i) r.algo.data[2 + i] = preference->align[i];
    r.algo.data[6] = alignment_of(desc->bias) | static_cast<uint64_t>(alignment_of(desc->aux)) << 16;
    r.workspaceSize = 0;
    r.state = CUBLAS_STATUS_SUCCESS;
    r.wavesCount = 1.0f;
    results[0] = r;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void*, size_t,
                              cudaStream_t stream) {
    if (handle == nullptr || handle->magic != 0x6c74) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (desc == nullptr || !Adesc || !Bdesc || !Cdesc || !Ddesc || alpha == nullptr || beta == nullptr)
        return CUBLAS_STATUS_INVALID_VALUE;
    Problem pr;
    std::string why;
    if (pose(*desc, *Adesc, *Bdesc, *Cdesc, *Ddesc, &pr, &why) != CUBLAS_STATUS_SUCCESS) return invalid(why);
    const cublasLtMatrixLayoutOpaque_t* layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
    if (algo != nullptr) {
        if (algo->data[0] != kAlgoMagic || algo->data[1] != signature(*desc, layouts))
            return invalid("an algorithm chosen for another configuration");
        const void* ptrs[4] = {A, B, C, D};
        for (int i = 0; i < 4; ++i) {
            if (alignment_of(ptrs[i]) < algo->data[2 + i]) {
                return invalid(fmt::format("operand {} at {} is {}-byte aligned; the algorithm was chosen for {}",
                                           "ABCD"[i], ptrs[i], alignment_of(ptrs[i]), algo -> data[2 + i]));
            }
        }
        if (alignment_of(desc->bias) < (algo->data[6] & 0xffff) ||
            alignment_of(desc->aux) < (algo->data[6] >> 16 & 0xffff))
            return invalid("a bias or GELU pointer less aligned than when the algorithm was chosen");
    }
    const cublasLtMatrixLayoutOpaque_t a = *Adesc, b = *Bdesc, c = *Cdesc, d = *Ddesc;
    const cublasLtMatmulDescOpaque_t op = *desc;
    for (auto [p, l, name] : {std::make_tuple(A, a, 'A'), std::make_tuple(B, b, 'B'), std::make_tuple(C, c, 'C'),
                              std::make_tuple(static_cast<const void*>(D), d, 'D')}) {
        if (!simt::rt::device_accessible(p, extent_bytes(l)))
            return invalid(fmt::format("operand {} at {} ({} bytes) is not inside one device allocation", name, p,
                                       extent_bytes(l)));
    }
    const uint32_t epi = op.epilogue;
    const bool has_bias = epi == CUBLASLT_EPILOGUE_BIAS || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool gelu = epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool dgelu = epi == CUBLASLT_EPILOGUE_DGELU;
    const size_t aux_bytes =
        (gelu || dgelu) ? (static_cast<size_t>(op.aux_ld) * (pr.n - 1) + pr.m) * element_bytes(d.type) : 0;
    if (has_bias && !simt::rt::device_accessible(op.bias, pr.m * element_bytes(pr.bias_type)))
        return invalid(fmt::format("the bias at {} ({} elements) is not inside one device allocation", op.bias, pr.m));
    if ((gelu || dgelu) && !simt::rt::device_accessible(op.aux, aux_bytes))
        return invalid(fmt::format("the GELU matrix at {} is not inside one device allocation", op.aux));
    for (const void* s : {op.a_scale, op.b_scale}) {
        if (s != nullptr && !simt::rt::device_accessible(s, sizeof(float)))
            return invalid(fmt::format("a scale at {} is not a float of device memory", s));
    }
    float al = 0.0f, be = 0.0f;  // host scalars: read at the call
    std::memcpy(&al, alpha, sizeof al);
    std::memcpy(&be, beta, sizeof be);
    const Problem p = pr;
    const cudaError_t e = simt::rt::enqueue(stream, "cublasLtMatmul", [=] {
        const uint64_t m = p.m, n = p.n, k = p.k;
        // op(A) as m rows of k, op(B) as n rows of k, widened to fp32 (exactly).
        std::vector<float> ra(m * k), rb(n * k);
        for (uint64_t i = 0; i < m; ++i) {
            for (uint64_t kk = 0; kk < k; ++kk) {
                const size_t idx = op.ta == CUBLAS_OP_N ? i + kk * a.ld : kk + i * a.ld;
                ra[i * k + kk] = load(A, a.type, idx);
            }
        }
        for (uint64_t j = 0; j < n; ++j) {
            for (uint64_t kk = 0; kk < k; ++kk) {
                const size_t idx = op.tb == CUBLAS_OP_N ? kk + j * b.ld : j + kk * b.ld;
                rb[j * k + kk] = load(B, b.type, idx);
            }
        }
        float scale = al;
        if (op.a_scale != nullptr) scale *= *static_cast<const float*>(op.a_scale);
        if (op.b_scale != nullptr) scale *= *static_cast<const float*>(op.b_scale);
        std::vector<float> acc(m * n);
        product(ra.data(), rb.data(), acc.data(), m, n, k);
        for (uint64_t j = 0; j < n; ++j) {
            for (uint64_t i = 0; i < m; ++i) {
                float v = scale * acc[i + j * m];
                if (be != 0.0f) v += be * load(C, c.type, i + j * c.ld);
                if (has_bias) v += load(op.bias, p.bias_type, i);
                const size_t aux_at = i + j * static_cast<size_t>(op.aux_ld);
                if (gelu) {
                    store(op.aux, d.type, aux_at, v);
                    v = gelu_tanh(v);
                } else if (dgelu) {
                    v *= gelu_tanh_slope(load(op.aux, d.type, aux_at));
                }
                store(D, d.type, i + j * d.ld, v);
            }
        }
    });
    return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
