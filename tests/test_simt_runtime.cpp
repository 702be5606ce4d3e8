// The emulated CUDA runtime (tests/simt/cuda_runtime_api.h) keeps the rules that decide whether host code is right
// on a GPU: queued work runs when something waits for it (so a result read without its wait is stale), an event
// orders another stream's work, copies to pageable memory return finished, stream capture records and replays with
// the arguments of the capture and refuses what needs the host, device memory is its exact size and comes poisoned,
// and a kernel handed host memory is a sticky fault. In the emulated build, also cuBLASLt's stand-in refusing what
// the library refuses, and the trainer naming an out-of-memory allocation on a small emulated GPU.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "simt/cuda_shim.h"
#include "test_util.h"

#ifdef TRAINER_SIMT_DEVICE
#include <cublasLt.h>
#endif

using Catch::Matchers::Contains;

namespace {

__global__ void fill_kernel(int* p, int value, int n) {
    const int i = static_cast<int>(threadIdx.x);
    if (i < n) p[i] = value;
}

__global__ void plus_one_kernel(int* dst, const int* src, int n) {
    const int i = static_cast<int>(threadIdx.x);
    if (i < n) dst[i] = src[i] + 1;
}

__global__ void add_kernel(int* p, int value, int n) {
    const int i = static_cast<int>(threadIdx.x);
    if (i < n) p[i] += value;
}

constexpr int kN = 4;
constexpr int kPoisoned = -1;  // four 0xFF bytes: fresh device and pinned memory

// Device memory for kN ints and a stream, released at the end of the case (after a device reset where one ran).
struct Setup {
    int* d = nullptr;
    cudaStream_t s = nullptr;
    Setup() {
        REQUIRE(cudaMalloc(&d, kN * sizeof(int)) == cudaSuccess);
        REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    }
    ~Setup() {
        cudaFree(d);
        cudaStreamDestroy(s);
    }
};

}  // namespace

TEST_CASE("simt runtime: a kernel's result is there once its stream is waited for and not before") {
    Setup g;
    int* pinned = nullptr;
    REQUIRE(cudaMallocHost(&pinned, kN * sizeof(int)) == cudaSuccess);
    CHECK(pinned[0] == kPoisoned);  // pinned memory comes uninitialised too
    TRAINER_LAUNCH(fill_kernel, 1, 32, 0, g.s, g.d, 42, kN);
    REQUIRE(cudaMemcpyAsync(pinned, g.d, kN * sizeof(int), cudaMemcpyDeviceToHost, g.s) == cudaSuccess);
    CHECK(pinned[0] == kPoisoned);  // queued: a read without the wait sees what was there
    REQUIRE(cudaStreamSynchronize(g.s) == cudaSuccess);
    CHECK(pinned[0] == 42);
    CHECK(pinned[kN - 1] == 42);
    // A copy into pageable memory returns finished (CUDA's rule), after the work queued before it.
    TRAINER_LAUNCH(fill_kernel, 1, 32, 0, g.s, g.d, 7, kN);
    std::vector<int> pageable(kN, 0);
    REQUIRE(cudaMemcpyAsync(pageable.data(), g.d, kN * sizeof(int), cudaMemcpyDeviceToHost, g.s) == cudaSuccess);
    CHECK(pageable == std::vector<int>(kN, 7));
    // A copy from pageable memory takes its source at the call: changed after it, the source does not matter.
    std::vector<int> src(kN, 5);
    REQUIRE(cudaMemcpyAsync(g.d, src.data(), kN * sizeof(int), cudaMemcpyHostToDevice, g.s) == cudaSuccess);
    src.assign(kN, 6);
    // cudaMemcpy is ordered on the legacy stream, which a non-blocking stream does not wait for: read before s ran.
    REQUIRE(cudaMemcpy(pageable.data(), g.d, kN * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(pageable == std::vector<int>(kN, 7));
    REQUIRE(cudaStreamSynchronize(g.s) == cudaSuccess);
    REQUIRE(cudaMemcpy(pageable.data(), g.d, kN * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(pageable == std::vector<int>(kN, 5));
    REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
}

TEST_CASE("simt runtime: an event orders another stream's work after it and without one the order is not kept") {
    Setup a;
    cudaStream_t other = nullptr;
    int* out = nullptr;
    cudaEvent_t written = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaMalloc(&out, kN * sizeof(int)) == cudaSuccess);
    REQUIRE(cudaEventCreateWithFlags(&written, cudaEventDisableTiming) == cudaSuccess);
    std::vector<int> got(kN);
    // With the event: `other` reads a's result.
    TRAINER_LAUNCH(fill_kernel, 1, 32, 0, a.s, a.d, 10, kN);
    REQUIRE(cudaEventRecord(written, a.s) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(other, written, 0) == cudaSuccess);
    TRAINER_LAUNCH(plus_one_kernel, 1, 32, 0, other, out, a.d, kN);
    REQUIRE(cudaStreamSynchronize(other) == cudaSuccess);
    REQUIRE(cudaMemcpy(got.data(), out, kN * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(got == std::vector<int>(kN, 11));
    // Without it: `other`'s kernel runs when `other` is waited for, before a's newer fill.
    TRAINER_LAUNCH(fill_kernel, 1, 32, 0, a.s, a.d, 20, kN);
    TRAINER_LAUNCH(plus_one_kernel, 1, 32, 0, other, out, a.d, kN);
    REQUIRE(cudaStreamSynchronize(other) == cudaSuccess);
    REQUIRE(cudaMemcpy(got.data(), out, kN * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(got == std::vector<int>(kN, 11));  // the stale 10, plus one
    REQUIRE(cudaStreamSynchronize(a.s) == cudaSuccess);
    cudaEventDestroy(written);
    cudaFree(out);
    cudaStreamDestroy(other);
}

TEST_CASE("simt runtime: capture replays a stream's work with its arguments and refuses what needs the host") {
    Setup g;
    // An allocation while capturing (thread-local mode) is refused and breaks the capture.
    REQUIRE(cudaStreamBeginCapture(g.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    TRAINER_LAUNCH(add_kernel, 1, 32, 0, g.s, g.d, 1, kN);
    void* p = nullptr;
    CHECK(cudaMalloc(&p, 16) == cudaErrorStreamCaptureUnsupported);
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(g.s, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);
    (void)cudaGetLastError();
    // A capture made right: replays run the kernel with the value it was captured with, not the variable's later one.
    REQUIRE(cudaMemset(g.d, 0, kN * sizeof(int)) == cudaSuccess);
    int step = 3;
    REQUIRE(cudaStreamBeginCapture(g.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    TRAINER_LAUNCH(add_kernel, 1, 32, 0, g.s, g.d, step, kN);
    REQUIRE(cudaStreamEndCapture(g.s, &graph) == cudaSuccess);
    step = 100;
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    std::vector<int> got(kN);
    REQUIRE(cudaMemcpy(got.data(), g.d, kN * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(got == std::vector<int>(kN, 0));  // recorded, not run
    for (int i = 0; i < 3; ++i) REQUIRE(cudaGraphLaunch(exec, g.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(g.s) == cudaSuccess);
    REQUIRE(cudaMemcpy(got.data(), g.d, kN * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(got == std::vector<int>(kN, 9));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

TEST_CASE("simt runtime: device memory is its exact size and comes poisoned and a free is checked") {
    char* d = nullptr;
    REQUIRE(cudaMalloc(&d, 8) == cudaSuccess);
    cudaPointerAttributes a{};
    REQUIRE(cudaPointerGetAttributes(&a, d + 7) == cudaSuccess);
    CHECK(a.type == cudaMemoryTypeDevice);
    std::vector<unsigned char> got(9, 0);
    REQUIRE(cudaMemcpy(got.data(), d, 8, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(got[0] == 0xFF);
    CHECK(got[7] == 0xFF);
    CHECK(cudaMemcpy(got.data(), d, 9, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);  // one byte past its end
    CHECK(cudaMemcpy(got.data(), d, 8, cudaMemcpyHostToDevice) == cudaErrorInvalidMemcpyDirection);
    std::vector<unsigned char> host(8);
    REQUIRE(cudaPointerGetAttributes(&a, host.data()) == cudaSuccess);
    CHECK(a.type == cudaMemoryTypeUnregistered);
    REQUIRE(cudaFree(d) == cudaSuccess);
    CHECK(cudaFree(d) == cudaErrorInvalidValue);  // twice
    size_t free_bytes = 0, total = 0;
    REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
    CHECK(cudaMalloc(&d, total + 1) == cudaErrorMemoryAllocation);
    (void)cudaGetLastError();
}

TEST_CASE("simt runtime: a kernel handed host memory is a sticky fault that names the argument") {
    std::vector<int> host(kN, 0);
    TRAINER_LAUNCH(fill_kernel, 1, 32, 0, nullptr, host.data(), 1, kN);
    const cudaError_t e = cudaDeviceSynchronize();
    CHECK(e == cudaErrorLaunchFailure);
    CHECK_THAT(cudaGetErrorString(e), Contains("fill_kernel") && Contains("pointer argument 1") &&
                                          Contains("not device memory, nor pinned host memory"));
    int* d = nullptr;
    CHECK(cudaMalloc(&d, 16) == cudaErrorLaunchFailure);  // sticky: every later call
    CHECK(host == std::vector<int>(kN, 0));               // never ran
    REQUIRE(cudaDeviceReset() == cudaSuccess);
    REQUIRE(cudaMalloc(&d, 16) == cudaSuccess);
    REQUIRE(cudaFree(d) == cudaSuccess);
}

#ifdef TRAINER_SIMT_DEVICE
TEST_CASE(
    "simt runtime: cuBLASLt's stand-in refuses FP8 outside the TN layout and an operand less aligned than its "
    "algorithm") {
    cublasLtHandle_t h = nullptr;
    REQUIRE(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS);
    const auto heuristic = [&](cudaDataType_t type, cublasOperation_t ta, cublasOperation_t tb, uint32_t align,
                               cublasLtMatmulHeuristicResult_t* result) {
        cublasLtMatmulDesc_t op = nullptr;
        cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
        cublasLtMatmulPreference_t pref = nullptr;
        REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
        REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ==
                CUBLAS_STATUS_SUCCESS);
        REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ==
                CUBLAS_STATUS_SUCCESS);
        REQUIRE(cublasLtMatrixLayoutCreate(&la, type, 16, 16, 16) == CUBLAS_STATUS_SUCCESS);
        REQUIRE(cublasLtMatrixLayoutCreate(&lb, type, 16, 16, 16) == CUBLAS_STATUS_SUCCESS);
        REQUIRE(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 16, 16, 16) == CUBLAS_STATUS_SUCCESS);
        REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
        for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
            REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align) == CUBLAS_STATUS_SUCCESS);
        }
        int found = 0;
        const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 1, result, &found);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatmulDescDestroy(op);
        return st == CUBLAS_STATUS_SUCCESS ? found : -1;
    };
    cublasLtMatmulHeuristicResult_t result{};
    CHECK(heuristic(CUDA_R_8F_E4M3, CUBLAS_OP_T, CUBLAS_OP_N, 256, &result) == 1);
    CHECK(heuristic(CUDA_R_8F_E4M3, CUBLAS_OP_N, CUBLAS_OP_N, 256, &result) == -1);  // FP8 in the NN layout
    CHECK(heuristic(CUDA_R_8F_E5M2, CUBLAS_OP_T, CUBLAS_OP_N, 256, &result) == -1);  // both e5m2
    CHECK(heuristic(CUDA_R_8F_E4M3, CUBLAS_OP_T, CUBLAS_OP_N, 8, &result) == -1);    // FP8 below 16-byte alignment
    // An fp32 algorithm chosen for 256-byte aligned operands, run on a C at a 4-byte offset: refused.
    REQUIRE(heuristic(CUDA_R_32F, CUBLAS_OP_N, CUBLAS_OP_N, 256, &result) == 1);
    float *a = nullptr, *c = nullptr;
    REQUIRE(cudaMalloc(&a, 16 * 16 * sizeof(float)) == cudaSuccess);
    REQUIRE(cudaMalloc(&c, (16 * 16 + 1) * sizeof(float)) == cudaSuccess);
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t l = nullptr;
    REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 16, 16, 16) == CUBLAS_STATUS_SUCCESS);
    const float one = 1.0f, zero = 0.0f;
    CHECK(cublasLtMatmul(h, op, &one, a, l, a, l, &zero, c, l, c, l, &result.algo, nullptr, 0, nullptr) ==
          CUBLAS_STATUS_SUCCESS);
    CHECK(cublasLtMatmul(h, op, &one, a, l, a, l, &zero, c + 1, l, c + 1, l, &result.algo, nullptr, 0, nullptr) ==
          CUBLAS_STATUS_INVALID_VALUE);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    cublasLtMatrixLayoutDestroy(l);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(h);
    cudaFree(a);
    cudaFree(c);
}

TEST_CASE("simt runtime: the trainer on a small emulated GPU names the allocation it runs out of memory on") {
    // configs/tiny.json needs cuBLASLt's 32 MiB workspace and a few MiB more: 2 MiB fails at the workspace, 33 MiB past
    // it. Both are the user's errors (exit 1), never an internal one.
    const auto run = [](const char* memory) {
        return test_util::run_trainer(
            {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration",
             "2", "--device", "cuda"},
            {"TRAINER_SIMT_GPUS=1", std::string("TRAINER_SIMT_GPU_MEMORY=") + memory});
    };
    const auto tiny = run("2M");
    INFO(tiny.out << tiny.err);
    CHECK(tiny.exit_code == 1);
    CHECK_THAT(tiny.err, Contains("out of GPU memory on device 0 allocating cuBLASLt's workspace of 32.0 MiB (2.0 "
                                  "MiB free of 2.0 MiB)"));
    const auto small = run("33M");
    INFO(small.out << small.err);
    CHECK(small.exit_code == 1);
    CHECK_THAT(small.err, Contains("out of GPU memory on device 0 allocating") &&
                              Contains("lower device_train_microbatch_size or shard the model"));
}
#endif
