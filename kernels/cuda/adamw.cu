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
        adamw_element(p, __fmul_rn(g, grad_scale), m, v, beta1, beta2, eps, decay_factor, step_size, bc2_sqrt);
    }
};

// Elements 4k .. 4k + 3 with 16-byte accesses (the bf16 copy's 4 words: 8 bytes, aligned where the caller
// checked), and element i alone.
__device__ __forceinline__ void adamw4(const AdamWStep& s, size_t k, float* param, const float* grad, float* m,
                                       float* v, uint16_t* p16) {
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
    if (p16 != nullptr) {
        ushort4 h;
        h.x = float_to_bf16(p.x), h.y = float_to_bf16(p.y), h.z = float_to_bf16(p.z), h.w = float_to_bf16(p.w);
        reinterpret_cast<ushort4*>(p16)[k] = h;
    }
}
__device__ __forceinline__ void adamw1(const AdamWStep& s, size_t i, float* param, const float* grad, float* m,
                                       float* v, uint16_t* p16) {
    s(param[i], grad[i], m[i], v[i]);
    if (p16 != nullptr) p16[i] = float_to_bf16(param[i]);
}

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, uint16_t* p16, size_t n, AdamWStep s,
                             bool vec) {
    grid_stride4(
        n, vec, [&](size_t k) { adamw4(s, k, param, grad, m, v, p16); },
        [&](size_t i) { adamw1(s, i, param, grad, m, v, p16); });
}

// Multi-tensor AdamW: the ranges are cut into chunks of kAdamwChunk elements, numbered across all ranges;
// a block takes chunks in grid stride and finds each one's range by binary search over the first chunks.
// A chunk whose four fp32 arrays start 16-byte aligned (and its bf16 copy 8-byte aligned) is updated four
// elements at a time, as the one-range kernel does; others element by element (parameters sit at 4-byte
// offsets of their unit). Every element's arithmetic is the same either way.
constexpr size_t kChunk = kAdamwChunk;

__global__ void adamw_multi_kernel(const AdamwSegment* segs, int nsegs, size_t total_chunks, AdamWStep s) {
    for (size_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
        size_t begin = 0, end = 0;
        const AdamwSegment& g = chunk_segment(segs, nsegs, c, kChunk, &begin, &end);
        AdamWStep st = s;
        st.decay_factor = g.decay_factor;
        float* param = g.param + begin;
        const float* grad = g.grad + begin;
        float* m = g.m + begin;
        float* v = g.v + begin;
        uint16_t* p16 = g.p16 != nullptr ? g.p16 + begin : nullptr;
        const size_t n = end - begin;
        const bool vec = aligned16(param, grad, m, v) && (p16 == nullptr || reinterpret_cast<uintptr_t>(p16) % 8 == 0);
        size_t done = 0;
        if (vec) {
            for (size_t k = threadIdx.x; k < n / 4; k += blockDim.x) adamw4(st, k, param, grad, m, v, p16);
            done = n / 4 * 4;
        }
        for (size_t i = done + threadIdx.x; i < n; i += blockDim.x) adamw1(st, i, param, grad, m, v, p16);
    }
}

AdamWStep step_constants(float lr, float beta1, float beta2, float eps, float weight_decay, long step,
                         float grad_scale) {
    // The per-step constants, computed in double on the host exactly as the CPU backend does.
    const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
    AdamWStep s;
    s.beta1 = beta1, s.beta2 = beta2, s.eps = eps, s.grad_scale = grad_scale;
    s.decay_factor = adamw_decay_factor(lr, weight_decay);
    s.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
    s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    return s;
}

}  // namespace

void adamw_update_multi(const AdamwSegment* segs_device, int nsegs, size_t total_chunks, float lr, float beta1,
                        float beta2, float eps, long step, float grad_scale, cudaStream_t stream) {
    if (nsegs == 0 || total_chunks == 0) return;
    const AdamWStep s = step_constants(lr, beta1, beta2, eps, 0.0f, step, grad_scale);
    const unsigned blocks = static_cast<unsigned>(total_chunks < 65535 ? total_chunks : 65535);
    TRAINER_LAUNCH(adamw_multi_kernel, blocks, kPointwiseBlock, 0, stream, segs_device, nsegs, total_chunks, s);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16,
                  cudaStream_t stream) {
    if (n == 0) return;
    const AdamWStep s = step_constants(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    const bool vec =
        aligned16(param, grad, m, v) && (param_bf16 == nullptr || reinterpret_cast<uintptr_t>(param_bf16) % 8 == 0);
    TRAINER_LAUNCH(adamw_kernel, grid_for(vec ? (n + 3) / 4 : n, kPointwiseBlock), kPointwiseBlock, 0, stream, param,
                   grad, m, v, param_bf16, n, s, vec);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
