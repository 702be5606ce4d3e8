// Rotary position embeddings in place on the q and k parts of qkv (non-interleaved halves, as OLMo
// and HF Llama). The backward is the inverse rotation (the rotation matrix is orthogonal), so both
// directions share one routine with the sign of sin flipped.
// For float the table is built in fp32 exactly as OLMo builds it in PyTorch, so cos/sin agree with the
// reference to the last bit rather than to double rounding.
#include <cmath>
#include <cstddef>
#include <vector>

#include "base/common.h"
#include "kernels/cpu/ops.h"

namespace trainer::cpu {

float rope_inv_freq_f32(int i, int HS, float theta) {
    return 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(HS));
}

// cos/sin of t * inv_freq[i], (T, HS/2), in fp32 as OLMo builds them (the CUDA kernels use this table).
void rope_table_f32(float* cos_t, float* sin_t, int T_, int HS, float theta) {
    const int half = HS / 2;
    for (int i = 0; i < half; ++i) {
        const float inv_freq = rope_inv_freq_f32(i, HS, theta);
        for (int t = 0; t < T_; ++t) {
            const float angle = static_cast<float>(t) * inv_freq;
            cos_t[static_cast<size_t>(t) * half + i] = cosf(angle);
            sin_t[static_cast<size_t>(t) * half + i] = sinf(angle);
        }
    }
}

namespace {

void rope_table(std::vector<float>& cos_t, std::vector<float>& sin_t, int T_, int HS, float theta) {
    rope_table_f32(cos_t.data(), sin_t.data(), T_, HS, theta);
}

void rope_table(std::vector<double>& cos_t, std::vector<double>& sin_t, int T_, int HS, float theta) {
    const int half = HS / 2;
    for (int i = 0; i < half; ++i) {
        const double inv_freq = 1.0 / std::pow(static_cast<double>(theta), static_cast<double>(2 * i) / HS);
        for (int t = 0; t < T_; ++t) {
            const double angle = static_cast<double>(t) * inv_freq;
            cos_t[static_cast<size_t>(t) * half + i] = std::cos(angle);
            sin_t[static_cast<size_t>(t) * half + i] = std::sin(angle);
        }
    }
}

// sign = +1 rotates by +angle (forward), -1 by -angle (backward).
template <typename T>
void rope_apply(T* qkv, int B, int T_, int NH, int HS, float theta, T sign) {
    TRAINER_CHECK(HS % 2 == 0, "rope needs an even head size, got {}", HS);
    const int half = HS / 2;
    const int C = NH * HS;
    std::vector<T> cos_t(static_cast<size_t>(T_) * half);
    std::vector<T> sin_t(static_cast<size_t>(T_) * half);
    rope_table(cos_t, sin_t, T_, HS, theta);
    const int rows = B * T_;
#pragma omp parallel for schedule(static)
    for (int row = 0; row < rows; ++row) {
        const int t = row % T_;
        const T* __restrict cs = cos_t.data() + static_cast<size_t>(t) * half;
        const T* __restrict sn = sin_t.data() + static_cast<size_t>(t) * half;
        T* base = qkv + static_cast<size_t>(row) * 3 * C;
        // 2 * NH heads: the q heads then the k heads, contiguous in the row.
        for (int head = 0; head < 2 * NH; ++head) {
            T* __restrict lo = base + static_cast<size_t>(head) * HS;
            T* __restrict hi = lo + half;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const T s = sign * sn[i];
                const T x0 = lo[i];
                const T x1 = hi[i];
                lo[i] = x0 * cs[i] - x1 * s;
                hi[i] = x1 * cs[i] + x0 * s;
            }
        }
    }
}

}  // namespace

template <typename T>
void rope_forward(T* qkv, int B, int T_, int NH, int HS, float theta) {
    rope_apply<T>(qkv, B, T_, NH, HS, theta, T(1));
}

template <typename T>
void rope_backward(T* dqkv, int B, int T_, int NH, int HS, float theta) {
    rope_apply<T>(dqkv, B, T_, NH, HS, theta, T(-1));
}

template void rope_forward<float>(float*, int, int, int, int, float);
template void rope_forward<double>(double*, int, int, int, int, float);
template void rope_backward<float>(float*, int, int, int, int, float);
template void rope_backward<double>(double*, int, int, int, int, float);

}  // namespace trainer::cpu
