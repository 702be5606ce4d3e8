// fp32 <-> bf16 conversion of flat buffers (bf16 checkpoints, bf16 parity checks). The bit-level
// rounding (nearest even, quiet NaN) is element.h's, shared with the CUDA kernels.
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) {
    const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < count; ++i) out[i] = float_to_bf16(in[i]);
}

void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) {
    const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < count; ++i) out[i] = bf16_to_float(in[i]);
}

void round_to_bf16(float* out, const float* in, size_t n) {
    const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < count; ++i) out[i] = bf16_to_float(float_to_bf16(in[i]));
}

}  // namespace trainer::cpu
