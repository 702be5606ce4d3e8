// The OCP 8-bit floating point formats (OFP8, "OCP 8-bit Floating Point Specification" v1.0) that FP8 GEMMs read:
//   e4m3 (E4M3FN): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN is S.1111.111; the largest
//        finite value 448 (1.75 x 2^8), the smallest normal 2^-6, the smallest subnormal 2^-9. Forward operands.
//   e5m2: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs); the largest finite
//        57344 (1.75 x 2^15), the smallest normal 2^-14, the smallest subnormal 2^-16. Gradients.
// Conversion from fp32 rounds to nearest, ties to even, and saturates: a finite value beyond the largest finite one
// (and an infinity) becomes the largest finite value of its sign, as the GPUs' satfinite conversions and cuBLASLt's
// scaled casts do (PyTorch's plain .to(float8) gives NaN or infinity there instead). NaN stays NaN.
// A tensor is cast with a per-tensor scale from its current amax (fp8_scale): q = fp8(x * scale), x ~ q / scale.
#pragma once

#include <cstddef>
#include <cstdint>

namespace trainer {

enum class Fp8Format { kE4M3, kE5M2 };

// The format's parameters.
struct Fp8Spec {
    int mantissa_bits;
    int bias;
    float max_finite;
    uint8_t nan;  // the positive NaN code this code writes (0x7F: e4m3's only one; e5m2's quiet NaN with both
                  // mantissa bits set)
};
constexpr Fp8Spec fp8_spec(Fp8Format f) {
    return f == Fp8Format::kE4M3 ? Fp8Spec{3, 7, 448.0f, 0x7F} : Fp8Spec{2, 15, 57344.0f, 0x7F};
}
const char* fp8_name(Fp8Format f);  // "e4m3", "e5m2"

// The code of x in format f (round to nearest even, saturating, NaN kept with its sign).
uint8_t fp8_encode(float x, Fp8Format f);
// The value of a code (exact in fp32): e5m2's infinities and both formats' NaNs included.
float fp8_decode(uint8_t code, Fp8Format f);
// fp8_decode(fp8_encode(x, f), f): x rounded to the nearest value of the format.
float fp8_round(float x, Fp8Format f);

// The per-tensor scale that maps amax to the format's largest finite value (1 where amax is 0 or not finite).
float fp8_scale(float amax, Fp8Format f);
// max |x| over n values (NaN where one is NaN).
float amax(const float* x, size_t n);
// out[i] = fp8_round(x[i] * scale) / scale: the values an FP8 GEMM reads, dequantized, for the CPU's emulation of
// amp_fp8 (out may alias x).
void fp8_quantize_dequantize(float* out, const float* x, size_t n, float scale, Fp8Format f);

}  // namespace trainer
