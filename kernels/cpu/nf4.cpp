// QLoRA's NF4 storage on the CPU (see ops.h; the format is element.h's).
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

void nf4_quantize(uint8_t* codes, float* absmax, const float* x, size_t n) {
    const long blocks = static_cast<long>(nf4_blocks(n));
#pragma omp parallel for schedule(static)
    for (long b = 0; b < blocks; ++b) {
        const size_t begin = static_cast<size_t>(b) * kNf4Block, end = std::min(n, begin + kNf4Block);
        float m = 0.0f;
        for (size_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x[i]));
        absmax[b] = m;
        const float inv = 1.0f / m;  // bitsandbytes multiplies by the reciprocal (inf for a block of zeros)
        // A block starts on an even index (kNf4Block is even): its values pair within it.
        for (size_t i = begin; i < end; i += 2) {
            const uint8_t hi = nf4_encode(x[i] * inv);
            const uint8_t lo = i + 1 < end ? nf4_encode(x[i + 1] * inv) : 0;
            codes[i / 2] = static_cast<uint8_t>(hi << 4 | lo);
        }
    }
}

void nf4_dequantize(float* out, const uint8_t* codes, const float* absmax, size_t n) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < static_cast<long>(n); ++i) {
        const uint8_t byte = codes[i / 2];
        const int code = i % 2 == 0 ? byte >> 4 : byte & 15;
        out[i] = nf4_value(code) * absmax[i / kNf4Block];
    }
}

}  // namespace trainer::cpu
