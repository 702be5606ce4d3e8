// NF4 (QLoRA's 4-bit NormalFloat, kernels/element.h; kernels/cpu/nf4.cpp): the 16 values rebuilt from N(0, 1)'s
// quantiles as QLoRA builds them, the codes against the nearest value on a dense sweep, and the blockwise storage in
// bitsandbytes' layout.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
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

// QLoRA's double quantization against tests/fixtures/double_quant.bin (tests/make_fixtures.py, PyTorch: bitsandbytes'
// create_dynamic_map and its dQuantize, blocks of 256 of a tensor's absmaxes less their mean): the map, the offset,
// every code, every block's absmax and the dequantized absmaxes bit for bit; and NF4 dequantized with such absmaxes
// in one pass equal to the two passes.
TEST_CASE("nf4: double quantization of the absmaxes is bitwise PyTorch's reference of bitsandbytes' algorithm") {
    const std::string bytes = test_util::read_file(test_util::fixture("double_quant.bin"));
    size_t at = 0;
    const auto take = [&](void* out, size_t n) {
        REQUIRE(at + n <= bytes.size());
        std::memcpy(out, bytes.data() + at, n);
        at += n;
    };
    std::vector<float> map(256);
    take(map.data(), 1024);
    for (int i = 0; i < 256; ++i) {
        CAPTURE(i);
        CHECK(std::memcmp(&map[i], &static_cast<const float&>(dynamic_map_value(i)), 4) == 0);
        if (i > 0) CHECK(map[i] > map[i - 1]);
    }
    uint32_t n = 0;
    take(&n, 4);
    REQUIRE(n == 700);
    std::vector<float> absmax(n), absmax2(cpu::double_quant_blocks(n)), back(n);
    std::vector<uint8_t> codes(n);
    float offset = 0.0f;
    take(absmax.data(), 4 * n);
    take(&offset, 4);
    take(codes.data(), n);
    take(absmax2.data(), 4 * absmax2.size());
    take(back.data(), 4 * n);
    REQUIRE(at == bytes.size());

    std::vector<uint8_t> our_codes(n);
    std::vector<float> our_absmax2(absmax2.size()), our_back(n);
    float our_offset = 0.0f;
    cpu::double_quantize(our_codes.data(), our_absmax2.data(), &our_offset, absmax.data(), n);
    CHECK(our_offset == offset);
    CHECK(our_codes == codes);
    CHECK(std::memcmp(our_absmax2.data(), absmax2.data(), 4 * absmax2.size()) == 0);
    cpu::double_dequantize(our_back.data(), our_codes.data(), our_absmax2.data(), our_offset, n);
    CHECK(std::memcmp(our_back.data(), back.data(), 4 * n) == 0);
    for (size_t i = 0; i < n; ++i) CHECK(std::fabs(our_back[i] - absmax[i]) <= 0.01f * absmax2[i / 256] + 1e-7f);

    // NF4 of 700 blocks of values with those absmaxes: one pass with the codes equals dequantizing them first.
    const size_t values = static_cast<size_t>(n) * kNf4Block - 17;
    std::vector<uint8_t> nf4(values / 2 + 1);
    for (size_t i = 0; i < nf4.size(); ++i) nf4[i] = static_cast<uint8_t>(i * 37 + 11);
    std::vector<float> once(values), twice(values);
    cpu::nf4_dequantize_dq(once.data(), nf4.data(), our_codes.data(), our_absmax2.data(), &our_offset, values);
    cpu::nf4_dequantize(twice.data(), nf4.data(), our_back.data(), values);
    CHECK(std::memcmp(once.data(), twice.data(), 4 * values) == 0);
}
