// NF4 (QLoRA's 4-bit NormalFloat, kernels/element.h; kernels/cpu/nf4.cpp): the 16 values rebuilt from N(0, 1)'s
// quantiles as QLoRA builds them, the codes against the nearest value on a dense sweep, and the blockwise storage in
// bitsandbytes' layout.
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"
#include "test_util.h"

using namespace trainer;

namespace {

// N(0, 1)'s quantile function: Newton's method on 0.5 erfc(-x / sqrt 2), in double.
double normal_ppf(double p) {
    double x = 0.0;
    for (int i = 0; i < 100; ++i) {
        const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
        const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
        const double step = (cdf - p) / pdf;
        x -= step;
        if (std::fabs(step) < 1e-15) break;
    }
    return x;
}

// numpy's linspace(a, b, n).
std::vector<double> linspace(double a, double b, int n) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = a + (b - a) * i / (n - 1);
    return v;
}

}  // namespace

TEST_CASE("nf4: the 16 values are N(0 1)'s quantiles as QLoRA builds them and the codes pick the nearest") {
    // QLoRA's construction (bitsandbytes' create_normal_map, offset 0.9677083): 8 positive quantiles at
    // linspace(offset, 0.5, 9) without its last, 7 negative at linspace(offset, 0.5, 8) without its last, and 0;
    // sorted and divided by the largest.
    const double offset = 0.9677083;
    std::vector<double> v;
    const std::vector<double> pos = linspace(offset, 0.5, 9), neg = linspace(offset, 0.5, 8);
    for (size_t i = 0; i + 1 < pos.size(); ++i) v.push_back(normal_ppf(pos[i]));
    for (size_t i = 0; i + 1 < neg.size(); ++i) v.push_back(-normal_ppf(neg[i]));
    v.push_back(0.0);
    std::sort(v.begin(), v.end());
    const double top = v.back();
    REQUIRE(v.size() == 16);
    for (int c = 0; c < 16; ++c) {
        CAPTURE(c);
        CHECK(std::fabs(nf4_value(c) - v[static_cast<size_t>(c)] / top) <= 2e-7);
    }
    CHECK(nf4_value(7) == 0.0f);
    CHECK(nf4_value(0) == -1.0f);
    CHECK(nf4_value(15) == 1.0f);
    // Each threshold is the mean of its two values (halfway between two floats: within half an ulp of it); on it
    // the lower code, just above it the upper (bitsandbytes' "x > midpoint").
    for (int c = 0; c < 15; ++c) {
        CAPTURE(c);
        const double exact = (static_cast<double>(nf4_value(c)) + nf4_value(c + 1)) / 2.0;
        const float mid = nf4_midpoint(c);
        CHECK(std::fabs(mid - exact) <= 0.5 * (std::nextafter(mid, 2.0f) - mid) * (1 + 1e-9));
        CHECK(nf4_encode(mid) == c);
        CHECK(nf4_encode(std::nextafter(mid, 2.0f)) == c + 1);
    }
    // A dense sweep past both ends: the code is the nearest value's (the lower one on a tie); NaN is code 0.
    long wrong = 0;
    for (int i = -1'200'000; i <= 1'200'000; ++i) {
        const float x = static_cast<float>(i) * 1e-6f;
        int best = 0;
        for (int c = 1; c < 16; ++c) {
            if (std::fabs(static_cast<double>(x) - nf4_value(c)) < std::fabs(static_cast<double>(x) - nf4_value(best)))
                best = c;
        }
        wrong += nf4_encode(x) != best ? 1 : 0;
    }
    CHECK(wrong == 0);
    CHECK(nf4_encode(NAN) == 0);
}

TEST_CASE("nf4: blocks of 64 with their absmax and two codes a byte the first in the high nibble") {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    const size_t n = 1000;  // 15 whole blocks and one of 40
    std::vector<float> x(n);
    for (float& a : x) a = normal(rng);
    for (size_t i = 128; i < 192; ++i) x[i] = 0.0f;  // a block of zeros
    std::vector<uint8_t> codes((n + 1) / 2);
    std::vector<float> absmax(cpu::nf4_blocks(n)), back(n);
    REQUIRE(absmax.size() == 16);
    cpu::nf4_quantize(codes.data(), absmax.data(), x.data(), n);
    cpu::nf4_dequantize(back.data(), codes.data(), absmax.data(), n);
    for (size_t b = 0; b < absmax.size(); ++b) {
        float m = 0.0f;
        for (size_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) m = std::max(m, std::fabs(x[i]));
        CHECK(absmax[b] == m);
    }
    long mismatches = 0;
    for (size_t i = 0; i < n; ++i) {
        const float inv = 1.0f / absmax[i / 64];
        const int want = i / 64 == 2 ? nf4_encode(0.0f * inv) : nf4_encode(x[i] * inv);
        const int got = i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 15;
        mismatches += want != got ? 1 : 0;
        mismatches += back[i] != nf4_value(got) * absmax[i / 64] ? 1 : 0;
        // Within half the widest gap between neighbouring values (-1 to -0.696: 0.1519 of the absmax).
        mismatches += std::fabs(back[i] - x[i]) > 0.152f * absmax[i / 64] ? 1 : 0;
    }
    CHECK(mismatches == 0);
    for (size_t i = 128; i < 192; ++i) CHECK(back[i] == 0.0f);
    // 4 bits a value and an fp32 absmax a block of 64: 0.5625 bytes a parameter.
    CHECK(static_cast<double>(codes.size() + 4 * absmax.size()) / n <= 0.5625 + 4.0 / n);
}
