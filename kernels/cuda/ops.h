// CUDA kernels' launchers: the same signatures as their CPU twins in kernels/cpu/ops.h, on device
// pointers, queued on `stream`. The CUDA backend (kernels/cuda/*) grows one op family per file with the
// same stem as the CPU file; each launch is checked.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace trainer::cuda {

// fp32 -> bf16 (round to nearest even) and back, elementwise (cast.cu).
void cast_float_to_bf16(uint16_t* out, const float* in, size_t n, cudaStream_t stream);
void cast_bf16_to_float(float* out, const uint16_t* in, size_t n, cudaStream_t stream);

}  // namespace trainer::cuda
