// Pointwise MLP activations: GELU (GPT-2, erf or tanh form) and SwiGLU (OLMo). The per-element
// formulas live in kernels/element.h so the CUDA kernels compute exactly the same expressions.
// Gradients of activations are overwritten; GELU allows in-place use to save an (N, H) buffer.
#include <cstddef>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace trainer::cpu {

// No __restrict here: GELU documents in-place use, and each element reads only its own index.
template <typename T>
void gelu_forward(T* out, const T* inp, size_t n, bool tanh_approx) {
    const long count = static_cast<long>(n);
    if (tanh_approx) {
#pragma omp parallel for simd schedule(static)
        for (long i = 0; i < count; ++i) out[i] = gelu_tanh(inp[i]);
    } else {
#pragma omp parallel for simd schedule(static)
        for (long i = 0; i < count; ++i) out[i] = gelu_erf(inp[i]);
    }
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t n, bool tanh_approx) {
    const long count = static_cast<long>(n);
    if (tanh_approx) {
#pragma omp parallel for simd schedule(static)
        for (long i = 0; i < count; ++i) dinp[i] = dout[i] * gelu_tanh_grad(inp[i]);
    } else {
#pragma omp parallel for simd schedule(static)
        for (long i = 0; i < count; ++i) dinp[i] = dout[i] * gelu_erf_grad(inp[i]);
    }
}

template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const T* __restrict x = inp + static_cast<size_t>(n) * 2 * H;
        const T* __restrict gate = x + H;
        T* __restrict o = out + static_cast<size_t>(n) * H;
        for (int j = 0; j < H; ++j) o[j] = silu(gate[j]) * x[j];
    }
}

template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        const T* __restrict x = inp + static_cast<size_t>(n) * 2 * H;
        const T* __restrict gate = x + H;
        const T* __restrict g = dout + static_cast<size_t>(n) * H;
        T* __restrict dx = dinp + static_cast<size_t>(n) * 2 * H;
        T* __restrict dgate = dx + H;
        for (int j = 0; j < H; ++j) {
            dx[j] = g[j] * silu(gate[j]);
            dgate[j] = g[j] * x[j] * silu_grad(gate[j]);
        }
    }
}

template void gelu_forward<float>(float*, const float*, size_t, bool);
template void gelu_forward<double>(double*, const double*, size_t, bool);
template void gelu_backward<float>(float*, const float*, const float*, size_t, bool);
template void gelu_backward<double>(double*, const double*, const double*, size_t, bool);
template void swiglu_forward<float>(float*, const float*, int, int);
template void swiglu_forward<double>(double*, const double*, int, int);
template void swiglu_backward<float>(float*, const float*, const float*, int, int);
template void swiglu_backward<double>(double*, const double*, const double*, int, int);

}  // namespace trainer::cpu
