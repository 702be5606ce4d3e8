// bf16 <-> fp32 casts on the GPU, sharing the per-element rounding with the CPU backend (element.h).
// Grid-stride loops, 4 elements per thread per iteration where the size allows (128-bit loads of fp32).
#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

#define TRAINER_CUDA_CHECK(stmt)                                                                  \
    do {                                                                                          \
        const cudaError_t err_ = (stmt);                                                          \
        if (err_ != cudaSuccess) {                                                                \
            throw std::runtime_error(std::string("CUDA error at " __FILE__ ": ") + #stmt + ": " + \
                                     cudaGetErrorString(err_));                                   \
        }                                                                                         \
    } while (0)

__global__ void cast_float_to_bf16_kernel(uint16_t* out, const float* in, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = float_to_bf16(in[i]);
    }
}

__global__ void cast_bf16_to_float_kernel(float* out, const uint16_t* in, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = bf16_to_float(in[i]);
    }
}

unsigned grid_for(size_t n, unsigned block) {
    const size_t blocks = (n + block - 1) / block;
    return static_cast<unsigned>(blocks < 65535 ? (blocks == 0 ? 1 : blocks) : 65535);
}

}  // namespace

void cast_float_to_bf16(uint16_t* out, const float* in, size_t n, cudaStream_t stream) {
    constexpr unsigned kBlock = 256;
    cast_float_to_bf16_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(out, in, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void cast_bf16_to_float(float* out, const uint16_t* in, size_t n, cudaStream_t stream) {
    constexpr unsigned kBlock = 256;
    cast_bf16_to_float_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(out, in, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
