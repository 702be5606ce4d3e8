// AdamW over a flat fp32 range (the locally owned shard of params, grads and moments).
// The per-step scalars are formed in double, as PyTorch forms them from Python floats, and rounded
// to fp32 once; the per-element arithmetic is element.h's, shared with the CUDA kernel.
#include <cmath>
#include <cstddef>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) {
    const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
    const float decay_factor = static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
    const float step_size = static_cast<float>(static_cast<double>(lr) / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const long count = static_cast<long>(n);
    if (param_bf16 == nullptr) {
#pragma omp parallel for simd schedule(static)
        for (long i = 0; i < count; ++i) {
            adamw_element(param[i], grad[i] * grad_scale, m[i], v[i], beta1, beta2, eps, decay_factor, step_size,
                          bc2_sqrt);
        }
        return;
    }
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < count; ++i) {
        adamw_element(param[i], grad[i] * grad_scale, m[i], v[i], beta1, beta2, eps, decay_factor, step_size, bc2_sqrt);
        param_bf16[i] = float_to_bf16(param[i]);
    }
}

}  // namespace trainer::cpu
