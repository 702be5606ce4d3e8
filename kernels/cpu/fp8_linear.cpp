// precision amp_fp8 on the CPU (see ops.h): a block Linear's GEMMs on the values its FP8 operands hold.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

float fp8_amax(const float* x, size_t n) {
    // The largest magnitude's bits: non-negative floats order as their bits do, and every NaN's lie above the
    // infinity's, so a NaN wins (as the CUDA kernels' atomic max on the bits has it) and the loop vectorizes.
    uint32_t m = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, x + i, sizeof bits);
        bits &= 0x7FFFFFFFu;
        m = bits > m ? bits : m;
    }
    float a;
    std::memcpy(&a, &m, sizeof a);
    return a;
}

namespace {

// fp8_round(x, F) (kernels/element.h) without a branch, so that a loop of it vectorizes: the emulation's casts took
// four fifths of a tiny.json step when each value went through fp8_encode and fp8_decode. A normal of the format
// rounds its mantissa on the bits, to nearest even; a subnormal of the format rounds in the FPU, by an fp32 sum
// whose last place is the format's subnormal step, 2^(min_exp - m) (to nearest even, as every fp32 sum rounds);
// magnitudes at or past the largest finite value saturate to it; a NaN stays itself. Tested equal to fp8_round.
template <Fp8Format F>
inline float round_to_fp8(float x) {
    constexpr Fp8Spec spec = fp8_spec(F);
    constexpr int m = spec.mantissa_bits, min_exp = 1 - spec.bias, shift = 23 - m;
    constexpr float max_finite = spec.max_finite;
    // 2^(min_exp - m + 23) (16384 for e4m3, 128 for e5m2): its last place is 2^(min_exp - m).
    constexpr float magic = static_cast<float>(1u << (min_exp - m + 23));
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = bits & 0x80000000u, a = bits & 0x7FFFFFFFu;
    float af;
    std::memcpy(&af, &a, sizeof af);
    const uint32_t normal = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) & ~((1u << shift) - 1u);
    const float sub_value = (af + magic) - magic;
    uint32_t sub, max_bits;
    std::memcpy(&sub, &sub_value, sizeof sub);
    std::memcpy(&max_bits, &max_finite, sizeof max_bits);
    uint32_t r = a < (static_cast<uint32_t>(min_exp + 127) << 23) ? sub : normal;
    r = af >= max_finite ? max_bits : r;
    r |= sign;
    float out;
    std::memcpy(&out, &r, sizeof out);
    return a > 0x7F800000u ? x : out;
}

template <Fp8Format F>
void quantize_dequantize(float* out, const float* x, size_t n, float scale) {
    for (size_t i = 0; i < n; ++i) out[i] = round_to_fp8<F>(x[i] * scale) / scale;
}

}  // namespace

void fp8_quantize_dequantize(float* out, const float* x, size_t n, float scale, Fp8Format f) {
    if (f == Fp8Format::kE4M3) {
        quantize_dequantize<Fp8Format::kE4M3>(out, x, n, scale);
    } else {
        quantize_dequantize<Fp8Format::kE5M2>(out, x, n, scale);
    }
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
