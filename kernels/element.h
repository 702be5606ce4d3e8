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

// GELU, exact (erf) form: 0.5 x (1 + erf(x / sqrt 2)).
template <typename T>
TRAINER_HD T gelu_erf(T x) {
    return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440)));
}
// d/dx of gelu_erf: Phi(x) + x phi(x).
template <typename T>
TRAINER_HD T gelu_erf_grad(T x) {
    const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
    const T pdf = std::exp(T(-0.5) * x * x) * T(0.39894228040143267794);
    return cdf + x * pdf;
}
// GELU, tanh approximation (GPT-2's "gelu_new"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T>
TRAINER_HD T gelu_tanh(T x) {
    const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
    return T(0.5) * x * (T(1) + std::tanh(u));
}
template <typename T>
TRAINER_HD T gelu_tanh_grad(T x) {
    const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
    const T th = std::tanh(u);
    const T du = T(0.79788456080286535588) * (T(1) + T(3) * T(0.044715) * x * x);
    return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
}
// SiLU(g) = g * sigmoid(g); SwiGLU(x, g) = silu(g) * x (OLMo: the first half of ff_proj is x, the second g).
template <typename T>
TRAINER_HD T sigmoid(T x) {
    return T(1) / (T(1) + std::exp(-x));
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
    p = p * decay_factor;
    m = m * beta1 + g * (1.0f - beta1);
    v = v * beta2 + g * g * (1.0f - beta2);
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    p = p - step_size * (m / denom);
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

}  // namespace trainer
