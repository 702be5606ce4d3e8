// Element math shared by the CPU and CUDA backends: inline functions that are __host__ __device__
// under nvcc and plain inline functions under g++ (as tiny-cuda-nn's TCNN_HOST_DEVICE). A CUDA kernel
// and its CPU twin call the same function for the per-element arithmetic, so they agree by
// construction on the formula and differ only in how they schedule the work.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TRAINER_HD __host__ __device__ __forceinline__
#else
#define TRAINER_HD inline
#endif

namespace trainer {

// e^x written so that host loops over it vectorise: glibc's expf is an opaque scalar call that GCC
// vectorises only under -ffast-math, and it dominated the softmaxes and activations (~3 ns vs
// ~0.2 ns an element). Cody-Waite reduction to |r| <= ln2/2 and Cephes' expf polynomial: within
// 1 ulp of e^x on [-87.3, 88.3]; 0 below (e^x is subnormal there), +inf above (within a factor 1.5
// of FLT_MAX). The device keeps its own expf; double keeps std::exp (finite-difference tests).
TRAINER_HD float exp_simd(float x) {
#if defined(__CUDA_ARCH__)
    return expf(x);
#else
    // Adding 1.5 * 2^23 rounds x log2(e) to the nearest integer n and leaves n in the low mantissa
    // bits, so 2^n is built from bits without a float-to-int conversion (undefined for NaN). Out of
    // range inputs give garbage that the fix-up below replaces (no clamp first: GCC threads it into
    // branches).
    const float kn = x * 1.44269504088896341f + 12582912.0f;
    const float n = kn - 12582912.0f;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * (r * r) + r + 1.0f;
    uint32_t kbits;
    std::memcpy(&kbits, &kn, sizeof kbits);
    const uint32_t scale_bits = (kbits - 0x4B400000u + 127u) << 23;
    float scale;
    std::memcpy(&scale, &scale_bits, sizeof scale);
    const float v = y * scale;
    // The range fix-up is done on bits so that v is computed unconditionally: selecting between
    // floats lets GCC sink the whole evaluation into a branch, which it cannot if-convert (the
    // arithmetic might trap) and so cannot vectorise without AVX-512 masking.
    const uint32_t under = x < -87.3f ? ~0u : 0u;
    const uint32_t over = x > 88.3f ? ~0u : 0u;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits = (bits & ~(under | over)) | (over & 0x7F800000u);
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
#endif
}
TRAINER_HD double exp_simd(double x) { return std::exp(x); }

// erfc(x) in a form the host compiler can vectorise (glibc's erff/erfcf are opaque scalar calls):
// Numerical Recipes' Chebyshev fit erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2), z = |x|, whose
// relative error is below 1.2e-7 everywhere (the fp32 rounding of z^2 adds up to 4e-6 once z > 8,
// where erfc < 1e-29). Relative (not absolute) accuracy in the tail is what GELU needs for negative
// inputs, where 1 + erf is tiny. Device: erfcf.
TRAINER_HD float erfc_simd(float x) {
#if defined(__CUDA_ARCH__)
    return erfcf(x);
#else
    const float z = std::fabs(x);
    const float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    const float r = t * exp_simd(p - z * z);
    // erfc(-z) = 2 - erfc(z), written without a select between computed values (GCC would compute
    // 2 - r only under a branch and give up vectorising it).
    return std::copysign(r, x) + (std::signbit(x) ? 2.0f : 0.0f);
#endif
}
TRAINER_HD double erfc_simd(double x) { return std::erfc(x); }

// GELU, exact (erf) form: 0.5 x (1 + erf(x / sqrt 2)), evaluated as 0.5 x erfc(-x / sqrt 2), which
// keeps its relative accuracy where 1 + erf cancels (x << 0).
template <typename T>
TRAINER_HD T gelu_erf(T x) {
    return T(0.5) * x * erfc_simd(-x * T(0.70710678118654752440));
}
// d/dx of gelu_erf: Phi(x) + x phi(x).
template <typename T>
TRAINER_HD T gelu_erf_grad(T x) {
    const T cdf = T(0.5) * erfc_simd(-x * T(0.70710678118654752440));
    const T pdf = exp_simd(T(-0.5) * x * x) * T(0.39894228040143267794);
    return cdf + x * pdf;
}
// GELU, tanh approximation (GPT-2's "gelu_new"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
// evaluated as x * sigmoid(2u), the same function since 0.5 (1 + tanh(u)) = sigmoid(2u): it needs only
// exp, which vectorises (exp_simd), and it has no cancellation in 1 + tanh(u) for very negative x.
template <typename T>
TRAINER_HD T gelu_tanh(T x) {
    const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
    return x / (T(1) + exp_simd(T(-2) * u));
}
// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u' = s + 2 x s (1 - s) u', s = sigmoid(2u).
template <typename T>
TRAINER_HD T gelu_tanh_grad(T x) {
    const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
    const T s = T(1) / (T(1) + exp_simd(T(-2) * u));
    const T du = T(0.79788456080286535588) * (T(1) + T(3) * T(0.044715) * x * x);
    return s + T(2) * x * s * (T(1) - s) * du;
}
// SiLU(g) = g * sigmoid(g); SwiGLU(x, g) = silu(g) * x (OLMo: the first half of ff_proj is x, the second g).
template <typename T>
TRAINER_HD T sigmoid(T x) {
    return T(1) / (T(1) + exp_simd(-x));
}
template <typename T>
TRAINER_HD T silu(T x) {
    return x * sigmoid(x);
}
template <typename T>
TRAINER_HD T silu_grad(T x) {
    const T s = sigmoid(x);
    return s * (T(1) + x * (T(1) - s));
}

// AdamW update of one element with PyTorch's semantics (torch.optim.AdamW, single-tensor path):
// decoupled decay p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), with bc_i = 1 - b_i^step.
// `decay_factor` = 1 - lr*wd, `step_size` = lr/bc1 and `bc2_sqrt` = sqrt(bc2) are precomputed per step.
TRAINER_HD void adamw_element(float& p, float g, float& m, float& v, float beta1, float beta2, float eps,
                              float decay_factor, float step_size, float bc2_sqrt) {
#if defined(__CUDA_ARCH__)
    // Every product and sum rounded on its own (the _rn intrinsics are never fused into an FMA), so each
    // kernel that inlines this (the one-range and the multi-tensor AdamW) gives the same bits whatever
    // nvcc would contract in its context (it contracted them differently: the two disagreed in the last bit).
    p = __fmul_rn(p, decay_factor);
    m = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn(g, 1.0f - beta1));
    v = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(__fmul_rn(g, g), 1.0f - beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), eps);
    p = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
#else
    p = p * decay_factor;
    m = m * beta1 + g * (1.0f - beta1);
    v = v * beta2 + g * g * (1.0f - beta2);
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    p = p - step_size * (m / denom);
#endif
}

// bf16 <-> fp32. Round to nearest even, NaN kept quiet (as PyTorch's c10::BFloat16).
TRAINER_HD uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
    const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t((bits + rounding_bias) >> 16);
}
TRAINER_HD float bf16_to_float(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// ---- The OCP 8-bit floating point formats (OFP8 v1.0) that FP8 GEMMs read ----
//   e4m3 (E4M3FN): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN is S.1111.111; the largest
//        finite value 448 (1.75 x 2^8), the smallest normal 2^-6, the smallest subnormal 2^-9. Forward operands.
//   e5m2: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs); the largest finite
//        57344 (1.75 x 2^15), the smallest normal 2^-14, the smallest subnormal 2^-16. Gradients.
// From fp32: round to nearest, ties to even, saturating (a finite value beyond the largest finite one, and an
// infinity, becomes the largest finite value of its sign), as the GPUs' cvt.rn.satfinite and cuBLASLt's scaled
// casts do (PyTorch's plain .to(float8) gives NaN or infinity there instead); NaN stays NaN (0x7F with its sign). A
// tensor is cast with a per-tensor scale from its current amax (fp8_scale): q = fp8(x * scale), x ~ q / scale.
enum class Fp8Format { kE4M3, kE5M2 };

struct Fp8Spec {
    int mantissa_bits, bias;
    float max_finite;
    uint8_t max_code;  // the largest finite value's positive code
};
TRAINER_HD constexpr Fp8Spec fp8_spec(Fp8Format f) {
    return f == Fp8Format::kE4M3 ? Fp8Spec{3, 7, 448.0f, 0x7E} : Fp8Spec{2, 15, 57344.0f, 0x7B};
}
inline const char* fp8_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

// The code of x: the mantissa rounded on the bits (normals), or x counted in subnormal steps and rounded (rintf:
// to nearest even).
TRAINER_HD uint8_t fp8_encode(float x, Fp8Format f) {
    const Fp8Spec s = fp8_spec(f);
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
    const uint32_t a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7F;  // NaN
    float af;
    std::memcpy(&af, &a, sizeof af);
    if (af >= s.max_finite) return sign | s.max_code;  // saturate (infinities too)
    const int min_exp = 1 - s.bias;                    // the smallest normal's exponent
    const int e = static_cast<int>(a >> 23) - 127;
    if (e < min_exp) {  // a subnormal of the format (or zero): steps of 2^(min_exp - M); 2^M steps is the min normal
        const int steps = static_cast<int>(rintf(ldexpf(af, s.mantissa_bits - min_exp)));
        return sign | static_cast<uint8_t>(steps);
    }
    const int shift = 23 - s.mantissa_bits;
    uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);  // to nearest, ties to even
    r &= ~((1u << shift) - 1u);
    float rf;
    std::memcpy(&rf, &r, sizeof rf);
    if (rf > s.max_finite) return sign | s.max_code;  // rounded past the largest finite value
    const uint32_t exp_field = static_cast<uint32_t>(static_cast<int>(r >> 23) - 127 + s.bias);
    const uint32_t mantissa = (r >> shift) & ((1u << s.mantissa_bits) - 1u);
    return sign | static_cast<uint8_t>((exp_field << s.mantissa_bits) | mantissa);
}

// The value of a code (exact in fp32), e5m2's infinities and both formats' NaNs included.
TRAINER_HD float fp8_decode(uint8_t code, Fp8Format f) {
    const Fp8Spec s = fp8_spec(f);
    const int m_bits = s.mantissa_bits, e_bits = 7 - m_bits;
    const int field = (code >> m_bits) & ((1 << e_bits) - 1), mantissa = code & ((1 << m_bits) - 1);
    const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
    const int all_ones = (1 << e_bits) - 1;
    if (f == Fp8Format::kE4M3 && field == all_ones && mantissa == (1 << m_bits) - 1) return NAN;
    if (f == Fp8Format::kE5M2 && field == all_ones) return mantissa == 0 ? sign * INFINITY : NAN;
    if (field == 0) return sign * ldexpf(static_cast<float>(mantissa), 1 - s.bias - m_bits);
    return sign * ldexpf(static_cast<float>((1 << m_bits) + mantissa), field - s.bias - m_bits);
}

// x rounded to the nearest value of the format (fp8_decode of fp8_encode; NaN stays NaN).
TRAINER_HD float fp8_round(float x, Fp8Format f) { return x != x ? x : fp8_decode(fp8_encode(x, f), f); }

// The per-tensor scale that maps `amax` onto the format's largest finite value: 1 where amax is 0 or not finite,
// the largest float where the quotient overflows (an amax among fp32's subnormals).
TRAINER_HD float fp8_scale(float amax, Fp8Format f) {
    if (!(amax > 0.0f) || !(amax <= 3.402823466e38f)) return 1.0f;
    const float scale = fp8_spec(f).max_finite / amax;
    return scale <= 3.402823466e38f ? scale : 3.402823466e38f;
}

// ---- NF4: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023), in bitsandbytes' layout (PEFT's QLoRA stores a frozen
// weight so). 16 values: N(0, 1)'s quantiles scaled to [-1, 1], 8 above 0 and 7 below with an exact 0 between. A
// tensor is cut in blocks of kNf4Block values, each with its absmax (fp32); a value's code is that of x times the
// reciprocal of the block's absmax (fp32, as bitsandbytes computes it): the highest code whose midpoint with the one
// below it x exceeds (bitsandbytes' comparison tree: a value on a midpoint takes the lower code, NaN code 0); two
// codes a byte, the first value's in the high nibble. Dequantized: nf4_value(code) x absmax.
constexpr int kNf4Block = 64;

TRAINER_HD float nf4_value(int code) {
    const float v[16] = {-1.0f,
                         -0.6961928009986877f,
                         -0.5250730514526367f,
                         -0.39491748809814453f,
                         -0.28444138169288635f,
                         -0.18477343022823334f,
                         -0.09105003625154495f,
                         0.0f,
                         0.07958029955625534f,
                         0.16093020141124725f,
                         0.24611230194568634f,
                         0.33791524171829224f,
                         0.44070982933044434f,
                         0.5626170039176941f,
                         0.7229568362236023f,
                         1.0f};
    return v[code & 15];
}

// The midpoint between values k and k + 1 (k in 0..14): bitsandbytes' thresholds (its dQuantizeNF4), each the
// exact mean of the two values, which falls halfway between two floats, rounded to one of them.
TRAINER_HD float nf4_midpoint(int k) {
    const float mid[15] = {-0.8480964004993439f,  -0.6106329262256622f,  -0.4599952697753906f,   -0.33967943489551544f,
                           -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
                           0.1202552504837513f,   0.2035212516784668f,   0.2920137718319893f,    0.3893125355243683f,
                           0.5016634166240692f,   0.6427869200706482f,   0.8614784181118011f};
    return mid[k < 0 ? 0 : k > 14 ? 14 : k];
}

// The code of a value already divided by its block's absmax (in [-1, 1]; outside, the end codes).
TRAINER_HD uint8_t nf4_encode(float x) {
    uint8_t code = 0;
    for (int k = 0; k < 15; ++k) code += x > nf4_midpoint(k) ? 1 : 0;
    return code;
}

// ---- QLoRA's double quantization: each NF4 block's absmax stored in 8 bits (bitsandbytes' compress_statistics). ----
// The absmaxes of a tensor less their mean (the offset, fp32), in blocks of kDoubleQuantBlock, each block scaled by the
// reciprocal of its own absmax (fp32) and coded in bitsandbytes' dynamic 8-bit map (create_dynamic_map(signed=True):
// for each exponent 10^-6 .. 10^0 the midpoints of a linspace(0.1, 1) of 2^i + 1 points, both signs, then 0 and 1,
// sorted). Dequantized: value(code) x the block's absmax + the offset. The map is tests/fixtures/double_quant.bin's,
// written by PyTorch (tests/make_fixtures.py), and the test holds this table to it bit for bit.
constexpr int kDoubleQuantBlock = 256;

TRAINER_HD float dynamic_map_value(int code) {
    const float v[256] = {
        -0x1.fc6666p-1f,  -0x1.f53332p-1f,  -0x1.eep-1f,      -0x1.e6ccccp-1f,
        -0x1.df9998p-1f,  -0x1.d86666p-1f,  -0x1.d13334p-1f,  -0x1.cap-1f,
        -0x1.c2ccccp-1f,  -0x1.bb9998p-1f,  -0x1.b46666p-1f,  -0x1.ad3332p-1f,
        -0x1.a6p-1f,      -0x1.9eccccp-1f,  -0x1.979998p-1f,  -0x1.906666p-1f,
        -0x1.893334p-1f,  -0x1.82p-1f,      -0x1.7acccep-1f,  -0x1.73999ap-1f,
        -0x1.6c6668p-1f,  -0x1.653334p-1f,  -0x1.5ep-1f,      -0x1.56cccep-1f,
        -0x1.4f999ap-1f,  -0x1.486666p-1f,  -0x1.413334p-1f,  -0x1.3ap-1f,
        -0x1.32ccccp-1f,  -0x1.2b999ap-1f,  -0x1.246668p-1f,  -0x1.1d3334p-1f,
        -0x1.16p-1f,      -0x1.0eccccp-1f,  -0x1.07999ap-1f,  -0x1.006666p-1f,
        -0x1.f26668p-2f,  -0x1.e4p-2f,      -0x1.d59998p-2f,  -0x1.c73334p-2f,
        -0x1.b8ccccp-2f,  -0x1.aa6664p-2f,  -0x1.9cp-2f,      -0x1.8d9998p-2f,
        -0x1.7f3334p-2f,  -0x1.70ccccp-2f,  -0x1.626664p-2f,  -0x1.54p-2f,
        -0x1.459998p-2f,  -0x1.373334p-2f,  -0x1.28ccccp-2f,  -0x1.1a6668p-2f,
        -0x1.0cp-2f,      -0x1.fb3334p-3f,  -0x1.de6668p-3f,  -0x1.c1999ap-3f,
        -0x1.a4ccccp-3f,  -0x1.88p-3f,      -0x1.6b3332p-3f,  -0x1.4e6666p-3f,
        -0x1.31999ap-3f,  -0x1.14ccccp-3f,  -0x1.fp-4f,       -0x1.b66668p-4f,
        -0x1.93d70ap-4f,  -0x1.8851eap-4f,  -0x1.7ccccep-4f,  -0x1.7147aep-4f,
        -0x1.65c29p-4f,   -0x1.5a3d7p-4f,   -0x1.4eb85p-4f,   -0x1.433334p-4f,
        -0x1.37ae14p-4f,  -0x1.2c28f6p-4f,  -0x1.20a3d6p-4f,  -0x1.151ebap-4f,
        -0x1.09999ap-4f,  -0x1.fc28f4p-5f,  -0x1.e51ebap-5f,  -0x1.ce147ap-5f,
        -0x1.b70a3ep-5f,  -0x1.ap-5f,       -0x1.88f5c2p-5f,  -0x1.71eb86p-5f,
        -0x1.5ae146p-5f,  -0x1.43d70ap-5f,  -0x1.2ccccep-5f,  -0x1.15c28ep-5f,
        -0x1.fd70a4p-6f,  -0x1.cf5c26p-6f,  -0x1.a147aep-6f,  -0x1.733334p-6f,
        -0x1.451eb8p-6f,  -0x1.170a3ep-6f,  -0x1.d1eb86p-7f,  -0x1.75c29p-7f,
        -0x1.3e76c8p-7f,  -0x1.2c083p-7f,   -0x1.19999ap-7f,  -0x1.072b02p-7f,
        -0x1.e978d4p-8f,  -0x1.c49ba6p-8f,  -0x1.9fbe76p-8f,  -0x1.7ae148p-8f,
        -0x1.56041ap-8f,  -0x1.3126e8p-8f,  -0x1.0c49bap-8f,  -0x1.ced914p-9f,
        -0x1.851eb8p-9f,  -0x1.3b645ap-9f,  -0x1.e353f8p-10f, -0x1.4fdf3ap-10f,
        -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f,   -0x1.3dd982p-11f,
        -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
        -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f,
        -0x1.040bfep-17f, -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f,
        0x1.27476ep-21f,  0x1.b43528p-19f,  0x1.040bfep-17f,  0x1.64840cp-16f,
        0x1.6f0068p-15f,  0x1.15df66p-14f,  0x1.743e96p-14f,  0x1.47ae16p-13f,
        0x1.19ce0ap-12f,  0x1.8fc506p-12f,  0x1.02de02p-11f,  0x1.3dd982p-11f,
        0x1.78d5p-11f,    0x1.b3d07cp-11f,  0x1.eecbfep-11f,  0x1.4fdf3ap-10f,
        0x1.e353f8p-10f,  0x1.3b645ap-9f,   0x1.851eb8p-9f,   0x1.ced914p-9f,
        0x1.0c49bap-8f,   0x1.3126e8p-8f,   0x1.56041ap-8f,   0x1.7ae148p-8f,
        0x1.9fbe76p-8f,   0x1.c49ba6p-8f,   0x1.e978d4p-8f,   0x1.072b02p-7f,
        0x1.19999ap-7f,   0x1.2c083p-7f,    0x1.3e76c8p-7f,   0x1.75c29p-7f,
        0x1.d1eb86p-7f,   0x1.170a3ep-6f,   0x1.451eb8p-6f,   0x1.733334p-6f,
        0x1.a147aep-6f,   0x1.cf5c26p-6f,   0x1.fd70a4p-6f,   0x1.15c28ep-5f,
        0x1.2ccccep-5f,   0x1.43d70ap-5f,   0x1.5ae146p-5f,   0x1.71eb86p-5f,
        0x1.88f5c2p-5f,   0x1.ap-5f,        0x1.b70a3ep-5f,   0x1.ce147ap-5f,
        0x1.e51ebap-5f,   0x1.fc28f4p-5f,   0x1.09999ap-4f,   0x1.151ebap-4f,
        0x1.20a3d6p-4f,   0x1.2c28f6p-4f,   0x1.37ae14p-4f,   0x1.433334p-4f,
        0x1.4eb85p-4f,    0x1.5a3d7p-4f,    0x1.65c29p-4f,    0x1.7147aep-4f,
        0x1.7ccccep-4f,   0x1.8851eap-4f,   0x1.93d70ap-4f,   0x1.b66668p-4f,
        0x1.fp-4f,        0x1.14ccccp-3f,   0x1.31999ap-3f,   0x1.4e6666p-3f,
        0x1.6b3332p-3f,   0x1.88p-3f,       0x1.a4ccccp-3f,   0x1.c1999ap-3f,
        0x1.de6668p-3f,   0x1.fb3334p-3f,   0x1.0cp-2f,       0x1.1a6668p-2f,
        0x1.28ccccp-2f,   0x1.373334p-2f,   0x1.459998p-2f,   0x1.54p-2f,
        0x1.626664p-2f,   0x1.70ccccp-2f,   0x1.7f3334p-2f,   0x1.8d9998p-2f,
        0x1.9cp-2f,       0x1.aa6664p-2f,   0x1.b8ccccp-2f,   0x1.c73334p-2f,
        0x1.d59998p-2f,   0x1.e4p-2f,       0x1.f26668p-2f,   0x1.006666p-1f,
        0x1.07999ap-1f,   0x1.0eccccp-1f,   0x1.16p-1f,       0x1.1d3334p-1f,
        0x1.246668p-1f,   0x1.2b999ap-1f,   0x1.32ccccp-1f,   0x1.3ap-1f,
        0x1.413334p-1f,   0x1.486666p-1f,   0x1.4f999ap-1f,   0x1.56cccep-1f,
        0x1.5ep-1f,       0x1.653334p-1f,   0x1.6c6668p-1f,   0x1.73999ap-1f,
        0x1.7acccep-1f,   0x1.82p-1f,       0x1.893334p-1f,   0x1.906666p-1f,
        0x1.979998p-1f,   0x1.9eccccp-1f,   0x1.a6p-1f,       0x1.ad3332p-1f,
        0x1.b46666p-1f,   0x1.bb9998p-1f,   0x1.c2ccccp-1f,   0x1.cap-1f,
        0x1.d13334p-1f,   0x1.d86666p-1f,   0x1.df9998p-1f,   0x1.e6ccccp-1f,
        0x1.eep-1f,       0x1.f53332p-1f,   0x1.fc6666p-1f,   0x1.0p+0f,
    };
    return v[code & 255];
}

// A double-quantized absmax: value(code) x its block's absmax, rounded, + the offset, rounded (each on its own, as
// bitsandbytes computes it: never fused into one FMA, which the compilers would do in some contexts and not others).
TRAINER_HD float double_quant_absmax(uint8_t code, float block_absmax, float offset) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(__fmul_rn(dynamic_map_value(code), block_absmax), offset);
#else
    volatile float scaled = dynamic_map_value(code) * block_absmax;  // volatile: stored, so not fused with the sum
    return scaled + offset;
#endif
}

// The code of x (already scaled into [-1, 1]): bitsandbytes' dQuantize, a binary search over the sorted map from 127
// in steps of 64 .. 1, then the nearer of the last value and its neighbour by their fp32 midpoint.
TRAINER_HD uint8_t dynamic_map_encode(float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = -1.0f, upper = 1.0f, val = dynamic_map_value(pivot);
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) {
            lower_pivot = pivot, lower = val, pivot += i;
        } else {
            upper_pivot = pivot, upper = val, pivot -= i;
        }
        val = dynamic_map_value(pivot);
    }
    if (upper_pivot == 255) upper = dynamic_map_value(upper_pivot);
    if (lower_pivot == 0) lower = dynamic_map_value(lower_pivot);
    if (x > val) return static_cast<uint8_t>(x > (upper + val) * 0.5f ? upper_pivot : pivot);
    return static_cast<uint8_t>(x < (lower + val) * 0.5f ? lower_pivot : pivot);
}

// ---- LoRA's dropout masks (Backend::lora_forward): counter-based, so a mask depends on its key only. ----
// splitmix64's finaliser: a 64-bit mix in which every input bit reaches every output bit.
TRAINER_HD uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
// A row's key: the run's seed and step (step_key = mix64(seed) ^ mix64(step), lora_step_key), the instance's index
// in its dataset and the position in it.
TRAINER_HD uint64_t lora_step_key(uint64_t seed, uint64_t step) {
    return mix64(mix64(seed) ^ mix64(step + 0x51ed2701ull));
}
TRAINER_HD uint64_t lora_row_key(uint64_t step_key, uint64_t instance, uint32_t position) {
    return mix64(mix64(step_key ^ mix64(instance)) ^ position);
}
// The threshold of a drop probability p: a channel is dropped when its 32-bit draw is below it.
inline uint32_t lora_dropout_threshold(float p) {
    const double t = static_cast<double>(p) * 4294967296.0;
    return t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
}
// Whether channel k of a row's input to `adapter` is kept.
TRAINER_HD bool lora_dropout_keep(uint64_t row_key, uint32_t adapter, uint32_t k, uint32_t threshold) {
    const uint64_t h = mix64(row_key ^ ((static_cast<uint64_t>(adapter) << 32 | k) * 0xd1b54a32d192ed03ull));
    return static_cast<uint32_t>(h >> 32) >= threshold;
}

}  // namespace trainer
