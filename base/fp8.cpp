// The OCP 8-bit floating point formats (see fp8.h).
#include "base/fp8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace trainer {
namespace {

constexpr int exponent_bits(const Fp8Spec& s) { return 7 - s.mantissa_bits; }

// |x| rounded to the format (round to nearest even on its grid, saturating), for finite non-negative a.
float round_magnitude(float a, const Fp8Spec& s) {
    if (a >= s.max_finite) return s.max_finite;
    const int min_normal_exp = 1 - s.bias;
    int e = 0;
    (void)std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): its binade is 2^(e-1)
    const int binade = a == 0.0f ? min_normal_exp : std::max(e - 1, min_normal_exp);
    // The spacing of the format's values in that binade (subnormals share the smallest normal binade's).
    const float quantum = std::ldexp(1.0f, binade - s.mantissa_bits);
    const float r = std::nearbyint(a / quantum) * quantum;  // a / quantum is exact: a power-of-two scaling
    return r > s.max_finite ? s.max_finite : r;
}

}  // namespace

const char* fp8_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

uint8_t fp8_encode(float x, Fp8Format f) {
    const Fp8Spec s = fp8_spec(f);
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return sign | s.nan;
    const float r = round_magnitude(std::isinf(x) ? s.max_finite : std::fabs(x), s);
    const int min_normal_exp = 1 - s.bias;
    if (r < std::ldexp(1.0f, min_normal_exp)) {  // subnormal (or zero): exponent field 0
        const int mantissa = static_cast<int>(r / std::ldexp(1.0f, min_normal_exp - s.mantissa_bits));
        return sign | static_cast<uint8_t>(mantissa);
    }
    int e = 0;
    (void)std::frexp(r, &e);
    const int binade = e - 1;
    const int mantissa = static_cast<int>(r / std::ldexp(1.0f, binade - s.mantissa_bits)) - (1 << s.mantissa_bits);
    return sign | static_cast<uint8_t>(((binade + s.bias) << s.mantissa_bits) | mantissa);
}

float fp8_decode(uint8_t code, Fp8Format f) {
    const Fp8Spec s = fp8_spec(f);
    const int m_bits = s.mantissa_bits, e_bits = exponent_bits(s);
    const int field = (code >> m_bits) & ((1 << e_bits) - 1);
    const int mantissa = code & ((1 << m_bits) - 1);
    const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
    const int all_ones = (1 << e_bits) - 1;
    if (f == Fp8Format::kE4M3 && field == all_ones && mantissa == (1 << m_bits) - 1) return std::nanf("");
    if (f == Fp8Format::kE5M2 && field == all_ones) return mantissa == 0 ? sign * INFINITY : std::nanf("");
    if (field == 0) return sign * std::ldexp(static_cast<float>(mantissa), 1 - s.bias - m_bits);
    return sign * std::ldexp(static_cast<float>((1 << m_bits) + mantissa), field - s.bias - m_bits);
}

float fp8_round(float x, Fp8Format f) {
    if (std::isnan(x)) return x;
    const float r = round_magnitude(std::isinf(x) ? fp8_spec(f).max_finite : std::fabs(x), fp8_spec(f));
    return std::copysign(r, x);
}

float fp8_scale(float amax, Fp8Format f) {
    if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
    const float scale = fp8_spec(f).max_finite / amax;
    return std::isfinite(scale) ? scale : FLT_MAX;  // an amax in the subnormals of fp32
}

float amax(const float* x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; ++i) {
        const float a = std::fabs(x[i]);
        if (std::isnan(a)) return a;
        m = a > m ? a : m;
    }
    return m;
}

void fp8_quantize_dequantize(float* out, const float* x, size_t n, float scale, Fp8Format f) {
    for (size_t i = 0; i < n; ++i) out[i] = fp8_round(x[i] * scale, f) / scale;
}

}  // namespace trainer
