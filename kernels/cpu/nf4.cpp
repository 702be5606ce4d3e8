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

void double_quantize(uint8_t* codes, float* absmax2, float* offset, const float* absmax, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += absmax[i];
    const float mean = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
    *offset = mean;
    for (size_t b = 0; b < double_quant_blocks(n); ++b) {
        const size_t begin = b * kDoubleQuantBlock, end = std::min(n, begin + kDoubleQuantBlock);
        float m = 0.0f;
        for (size_t i = begin; i < end; ++i) m = std::max(m, std::fabs(absmax[i] - mean));
        absmax2[b] = m;
        const float inv = m > 0.0f ? 1.0f / m : 0.0f;
        for (size_t i = begin; i < end; ++i) codes[i] = dynamic_map_encode((absmax[i] - mean) * inv);
    }
}

void double_dequantize(float* absmax, const uint8_t* codes, const float* absmax2, float offset, size_t n) {
    for (size_t i = 0; i < n; ++i) absmax[i] = double_quant_absmax(codes[i], absmax2[i / kDoubleQuantBlock], offset);
}

void nf4_dequantize_dq(float* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                       const float* offset, size_t n) {
    const long long blocks = static_cast<long long>(nf4_blocks(n));
#pragma omp parallel for schedule(static)
    for (long long b = 0; b < blocks; ++b) {
        const float m = double_quant_absmax(absmax_codes[b], absmax2[b / kDoubleQuantBlock], *offset);
        const size_t end = std::min(n, static_cast<size_t>(b + 1) * kNf4Block);
        for (size_t i = static_cast<size_t>(b) * kNf4Block; i < end; ++i) {
            const uint8_t byte = codes[i / 2];
            out[i] = nf4_value(i % 2 == 0 ? byte >> 4 : byte & 15) * m;
        }
    }
}

}  // namespace trainer::cpu
