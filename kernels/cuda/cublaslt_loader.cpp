// cuBLASLt, loaded when first called. The library is no link-time dependency of the trainer: once loaded it
// holds about 140 MiB of host memory (some 60 MiB of code pages and an 84 MiB zero-initialised data segment
// it touches at load, measured in /proc/<pid>/smaps), which a run on the CPU of a CUDA build would carry for
// nothing. These definitions of the cuBLASLt functions the GEMMs call (matmul.cu) take the place of the
// library's at link time; each forwards to the library's own, found by dlopen/dlsym on its first call.
// A library that cannot be loaded is a UserError naming it.
#include <cublasLt.h>
#include <dlfcn.h>

#include <string>

#include "base/common.h"

namespace {

void* cublaslt_library() {
    static void* handle = [] {
        const std::string name = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
        void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (h == nullptr) {
            trainer::user_error(
                "cuBLASLt: cannot load {} ({}); install the CUDA toolkit's cuBLAS or put its library folder on "
                "LD_LIBRARY_PATH",
                name, dlerror());
        }
        return h;
    }();
    return handle;
}

template <typename F>
F cublaslt_symbol(const char* name) {
    void* p = dlsym(cublaslt_library(), name);
    TRAINER_CHECK(p != nullptr, "libcublasLt has no {}", name);
    return reinterpret_cast<F>(p);
}

}  // namespace

// `name` with the signature cublasLt.h declares, forwarding to the loaded library's (resolved once).
#define TRAINER_CUBLASLT_FORWARD(name, params, args)                         \
    cublasStatus_t CUBLASWINAPI name params {                                \
        static const auto forward = cublaslt_symbol<decltype(&name)>(#name); \
        return forward args;                                                 \
    }

extern "C" {
// The library's message for a status (TRAINER_CUDA_CHECK's): the one forwarder that returns text.
const char* CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t status) {
    static const auto forward = cublaslt_symbol<decltype(&cublasLtGetStatusString)>("cublasLtGetStatusString");
    return forward(status);
}
TRAINER_CUBLASLT_FORWARD(cublasLtCreate, (cublasLtHandle_t * handle), (handle))
TRAINER_CUBLASLT_FORWARD(cublasLtDestroy, (cublasLtHandle_t handle), (handle))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmul,
                         (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                          cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                          const void* C, cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                          const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream),
                         (handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
                          workspace_bytes, stream))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulAlgoGetHeuristic,
                         (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,
                          cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                          cublasLtMatmulPreference_t preference, int requested,
                          cublasLtMatmulHeuristicResult_t results[], int* returned),
                         (handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requested, results, returned))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulDescCreate,
                         (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
                         (desc, compute, scale))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulDescSetAttribute,
                         (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,
                          size_t bytes),
                         (desc, attr, buf, bytes))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))
TRAINER_CUBLASLT_FORWARD(cublasLtMatmulPreferenceSetAttribute,
                         (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                          size_t bytes),
                         (pref, attr, buf, bytes))
TRAINER_CUBLASLT_FORWARD(cublasLtMatrixLayoutCreate,
                         (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld),
                         (layout, type, rows, cols, ld))
TRAINER_CUBLASLT_FORWARD(cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout), (layout))
}
