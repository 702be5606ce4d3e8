// precision amp_fp8 on the CPU (see ops.h): a block Linear's GEMMs on the values its FP8 operands hold.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

float fp8_amax(const float* x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; ++i) {
        const float a = std::fabs(x[i]);
        if (a != a) return a;
        m = a > m ? a : m;
    }
    return m;
}

void fp8_quantize_dequantize(float* out, const float* x, size_t n, float scale, Fp8Format f) {
    for (size_t i = 0; i < n; ++i) out[i] = fp8_round(x[i] * scale, f) / scale;
}

namespace {

constexpr size_t kChunk = size_t{1} << 14;

// out = x rounded to `format` with the per-tensor scale of x's current amax, dequantized; returns out's data.
const float* quantized(std::vector<float>& out, const float* x, size_t n, Fp8Format format) {
    out.resize(n);
    const long chunks = static_cast<long>((n + kChunk - 1) / kChunk);
    // Each chunk's amax, then theirs (an OpenMP max reduction would drop a NaN).
    std::vector<float> part(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static)
    for (long c = 0; c < chunks; ++c) {
        const size_t b = static_cast<size_t>(c) * kChunk;
        part[static_cast<size_t>(c)] = fp8_amax(x + b, std::min(kChunk, n - b));
    }
    const float scale = fp8_scale(fp8_amax(part.data(), part.size()), format);
#pragma omp parallel for schedule(static)
    for (long c = 0; c < chunks; ++c) {
        const size_t b = static_cast<size_t>(c) * kChunk;
        fp8_quantize_dequantize(out.data() + b, x + b, std::min(kChunk, n - b), scale, format);
    }
    return out.data();
}

}  // namespace

void fp8_linear_forward(float* out, const float* inp, const float* weight, const float* bias, int M, int K, int N,
                        Fp8Scratch& s) {
    const float* x = quantized(s.inp, inp, static_cast<size_t>(M) * K, Fp8Format::kE4M3);
    const float* w = quantized(s.weight, weight, static_cast<size_t>(N) * K, Fp8Format::kE4M3);
    matmul_forward(out, x, w, bias, M, K, N);
}

void fp8_linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp, Fp8Scratch& s) {
    // The bias gradient from the gradient as it came (a reduction, not a GEMM: no FP8 operand).
    if (dbias != nullptr) matmul_backward<float>(nullptr, nullptr, dbias, dout, inp, weight, M, K, N, false);
    const float* dy = quantized(s.dout, dout, static_cast<size_t>(M) * N, Fp8Format::kE5M2);
    const float* x = quantized(s.inp, inp, static_cast<size_t>(M) * K, Fp8Format::kE4M3);
    const float* w = quantized(s.weight, weight, static_cast<size_t>(N) * K, Fp8Format::kE4M3);
    matmul_backward<float>(dinp, dweight, nullptr, dy, x, w, M, K, N, accumulate_dinp);
}

}  // namespace trainer::cpu
