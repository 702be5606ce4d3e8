// GPU tests: each CUDA kernel against its CPU twin. A separate executable so a machine without a GPU
// reports the suite as skipped (CTest's SKIP_RETURN_CODE 77), not passed.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
    if (!ok) {
        std::printf("FAILED: %s\n", what);
        ++failures;
    }
}

// Casts on odd sizes, bitwise equal to the CPU backend (same element function).
void test_cast() {
    for (size_t n : {1u, 7u, 1000u, 100003u}) {
        std::vector<float> x(n);
        for (size_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * i) * std::pow(10.0f, float(i % 9) - 4.0f);
        if (n > 3) x[1] = INFINITY, x[2] = -0.0f, x[3] = NAN;
        std::vector<uint16_t> ref(n), got(n);
        trainer::cpu::cast_float_to_bf16(ref.data(), x.data(), n);
        float* dx = nullptr;
        uint16_t* dy = nullptr;
        cudaMalloc(&dx, n * sizeof(float));
        cudaMalloc(&dy, n * sizeof(uint16_t));
        cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
        trainer::cuda::cast_float_to_bf16(dy, dx, n, nullptr);
        cudaMemcpy(got.data(), dy, n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
        expect(std::memcmp(ref.data(), got.data(), n * sizeof(uint16_t)) == 0, "cast_float_to_bf16 matches the CPU");
        std::vector<float> back_ref(n), back(n);
        trainer::cpu::cast_bf16_to_float(back_ref.data(), ref.data(), n);
        trainer::cuda::cast_bf16_to_float(dx, dy, n, nullptr);
        cudaMemcpy(back.data(), dx, n * sizeof(float), cudaMemcpyDeviceToHost);
        expect(std::memcmp(back_ref.data(), back.data(), n * sizeof(float)) == 0, "cast_bf16_to_float matches the CPU");
        cudaFree(dx);
        cudaFree(dy);
    }
}

}  // namespace

int main() {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        std::printf("no CUDA device: GPU tests skipped\n");
        return 77;
    }
    test_cast();
    std::printf("%s\n", failures == 0 ? "all GPU tests passed" : "GPU tests FAILED");
    return failures == 0 ? 0 : 1;
}
