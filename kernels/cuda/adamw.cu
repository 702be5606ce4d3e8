// AdamW over a flat shard on the GPU, fused in one pass (PyTorch's torch.optim.AdamW semantics, the
// per-element update of kernels/element.h shared with kernels/cpu/adamw.cpp): gradient scaling by the
// clip coefficient, decoupled weight decay, both moments and the parameter, with 128-bit accesses, and
// optionally the bf16 copy of the updated parameter (the copy-out a mixed-precision strategy gathers).
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

struct AdamWStep {
    float beta1, beta2, eps, decay_factor, step_size, bc2_sqrt, grad_scale;
    __device__ void operator()(float& p, float g, float& m, float& v) const {
        adamw_element(p, g * grad_scale, m, v, beta1, beta2, eps, decay_factor, step_size, bc2_sqrt);
    }
};

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, uint16_t* p16, size_t n, AdamWStep s,
                             bool vec) {
    grid_stride4(
        n, vec,
        [&](size_t k) {
            float4 p = reinterpret_cast<float4*>(param)[k];
            const float4 g = reinterpret_cast<const float4*>(grad)[k];
            float4 mm = reinterpret_cast<float4*>(m)[k];
            float4 vv = reinterpret_cast<float4*>(v)[k];
            s(p.x, g.x, mm.x, vv.x);
            s(p.y, g.y, mm.y, vv.y);
            s(p.z, g.z, mm.z, vv.z);
            s(p.w, g.w, mm.w, vv.w);
            reinterpret_cast<float4*>(param)[k] = p;
            reinterpret_cast<float4*>(m)[k] = mm;
            reinterpret_cast<float4*>(v)[k] = vv;
            if (p16 != nullptr) {  // 4 bf16 words: 8 bytes, aligned when the fp32 side is (checked at launch)
                ushort4 h;
                h.x = float_to_bf16(p.x), h.y = float_to_bf16(p.y), h.z = float_to_bf16(p.z), h.w = float_to_bf16(p.w);
                reinterpret_cast<ushort4*>(p16)[k] = h;
            }
        },
        [&](size_t i) {
            s(param[i], grad[i], m[i], v[i]);
            if (p16 != nullptr) p16[i] = float_to_bf16(param[i]);
        });
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16,
                  cudaStream_t stream) {
    if (n == 0) return;
    // The per-step constants, computed in double on the host exactly as the CPU backend does.
    const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
    AdamWStep s;
    s.beta1 = beta1, s.beta2 = beta2, s.eps = eps, s.grad_scale = grad_scale;
    s.decay_factor = static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
    s.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
    s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const bool vec =
        aligned16(param, grad, m, v) && (param_bf16 == nullptr || reinterpret_cast<uintptr_t>(param_bf16) % 8 == 0);
    adamw_kernel<<<grid_for(vec ? (n + 3) / 4 : n, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(
        param, grad, m, v, param_bf16, n, s, vec);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
