// QLoRA's NF4 storage on the GPU, the twin of kernels/cpu/nf4.cpp (the format is element.h's): quantize in one
// block of kNf4Block threads per NF4 block (its absmax by a shared-memory reduction, each thread its value's code,
// the even thread writing the pair's byte), dequantize one value per thread into fp32 or bf16 (with
// double-quantized absmaxes too).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

__global__ void nf4_quantize_kernel(uint8_t* codes, float* absmax, const float* x, size_t n) {
    __shared__ float part[kNf4Block];
    __shared__ uint8_t code[kNf4Block];
    const size_t i = static_cast<size_t>(blockIdx.x) * kNf4Block + threadIdx.x;
    const float v = i < n ? x[i] : 0.0f;
    part[threadIdx.x] = fabsf(v);
    __syncthreads();
    for (unsigned half = kNf4Block / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + half]);
        __syncthreads();
    }
    const float m = part[0];
    if (threadIdx.x == 0) absmax[blockIdx.x] = m;
    code[threadIdx.x] = i < n ? nf4_encode(v * (1.0f / m)) : 0;  // the reciprocal, as bitsandbytes
    __syncthreads();
    if (threadIdx.x % 2 == 0 && i < n)
        codes[i / 2] = static_cast<uint8_t>(code[threadIdx.x] << 4 | code[threadIdx.x + 1]);
}

template <typename Out>
__global__ void nf4_dequantize_kernel(Out* out, const uint8_t* codes, const float* absmax, size_t n) {
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const uint8_t byte = codes[i / 2];
        store_as(out + i, nf4_value(i % 2 == 0 ? byte >> 4 : byte & 15) * absmax[i / kNf4Block]);
    }
}

// Double-quantized absmaxes: one block of kNf4Block threads a NF4 block; its first thread decodes the block's absmax
// (a lookup in the dynamic map) into shared memory for the others.
template <typename Out>
__global__ void nf4_dequantize_dq_kernel(Out* out, const uint8_t* codes, const uint8_t* absmax_codes,
                                         const float* absmax2, const float* offset, size_t n) {
    __shared__ float m;
    const size_t b = blockIdx.x, i = b * kNf4Block + threadIdx.x;
    if (threadIdx.x == 0) m = double_quant_absmax(absmax_codes[b], absmax2[b / kDoubleQuantBlock], *offset);
    __syncthreads();
    if (i >= n) return;
    const uint8_t byte = codes[i / 2];
    store_as(out + i, nf4_value(i % 2 == 0 ? byte >> 4 : byte & 15) * m);
}

template <typename Out>
void launch_dequantize_dq(Out* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                          const float* offset, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    const auto blocks = static_cast<unsigned>((n + kNf4Block - 1) / kNf4Block);
    TRAINER_LAUNCH(nf4_dequantize_dq_kernel<Out>, blocks, kNf4Block, 0, stream, out, codes, absmax_codes, absmax2,
                   offset, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void nf4_dequantize_dq(float* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                       const float* offset, size_t n, cudaStream_t stream) {
    launch_dequantize_dq(out, codes, absmax_codes, absmax2, offset, n, stream);
}

void nf4_dequantize_dq(uint16_t* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                       const float* offset, size_t n, cudaStream_t stream) {
    launch_dequantize_dq(out, codes, absmax_codes, absmax2, offset, n, stream);
}

void nf4_quantize(uint8_t* codes, float* absmax, const float* x, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    const auto blocks = static_cast<unsigned>((n + kNf4Block - 1) / kNf4Block);
    TRAINER_LAUNCH(nf4_quantize_kernel, blocks, kNf4Block, 0, stream, codes, absmax, x, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void nf4_dequantize(float* out, const uint8_t* codes, const float* absmax, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    TRAINER_LAUNCH(nf4_dequantize_kernel<float>, grid_for(n, 256), 256, 0, stream, out, codes, absmax, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void nf4_dequantize(uint16_t* out, const uint8_t* codes, const float* absmax, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    TRAINER_LAUNCH(nf4_dequantize_kernel<uint16_t>, grid_for(n, 256), 256, 0, stream, out, codes, absmax, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
