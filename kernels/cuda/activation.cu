// Pointwise MLP activations on the GPU: GELU (erf and tanh forms) and SwiGLU, forward and backward, with
// the per-element formulas of kernels/element.h that the CPU twin (kernels/cpu/activation.cpp) uses.
// Gradients are overwritten; GELU may run in place.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

struct GeluErf {
    __device__ float operator()(float x) const { return gelu_erf(x); }
};
struct GeluTanh {
    __device__ float operator()(float x) const { return gelu_tanh(x); }
};
struct GeluErfBackward {  // (inp, dout) -> dinp
    __device__ float operator()(float x, float g) const { return g * gelu_erf_grad(x); }
};
struct GeluTanhBackward {
    __device__ float operator()(float x, float g) const { return g * gelu_tanh_grad(x); }
};

// SwiGLU over rows of 2H inputs (value half, then gate half; fp32, or bf16 from a bf16 GEMM output) and H
// outputs; one thread per output element, consecutive threads on consecutive columns (coalesced in all
// three arrays).
template <typename In, typename Out>
__global__ void swiglu_forward_kernel(Out* out, const In* inp, int N, int H) {
    const size_t total = static_cast<size_t>(N) * H, stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        const size_t n = i / H, j = i % H;
        const In* x = inp + n * 2 * H;
        store_as(out + i, silu(load_as_float(x[H + j])) * load_as_float(x[j]));
    }
}

template <typename In>
__global__ void swiglu_backward_kernel(float* dinp, const In* inp, const float* dout, int N, int H) {
    const size_t total = static_cast<size_t>(N) * H, stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        const size_t n = i / H, j = i % H;
        const In* x = inp + n * 2 * H;
        float* dx = dinp + n * 2 * H;
        const float g = dout[i], gate = load_as_float(x[H + j]);
        dx[j] = g * silu(gate);
        dx[H + j] = g * load_as_float(x[j]) * silu_grad(gate);
    }
}

// out(n) = f(inp) rounded to bf16 (a GEMM operand).
template <typename F>
__global__ void map1_to_bf16_kernel(uint16_t* out, const float* inp, size_t n, F f) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = float_to_bf16(f(inp[i]));
    }
}

template <typename In, typename Out>
void swiglu_forward_launch(Out* out, const In* inp, int N, int H, cudaStream_t stream) {
    const size_t total = static_cast<size_t>(N) * H;
    if (total == 0) return;
    swiglu_forward_kernel<In, Out><<<grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(out, inp, N, H);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void swiglu_backward_launch(float* dinp, const In* inp, const float* dout, int N, int H, cudaStream_t stream) {
    const size_t total = static_cast<size_t>(N) * H;
    if (total == 0) return;
    swiglu_backward_kernel<In><<<grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(dinp, inp, dout, N, H);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void gelu_forward_bf16(uint16_t* out, const float* inp, size_t n, bool tanh_approx, cudaStream_t stream) {
    if (n == 0) return;
    if (tanh_approx) {
        map1_to_bf16_kernel<<<grid_for(n, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(out, inp, n, GeluTanh{});
    } else {
        map1_to_bf16_kernel<<<grid_for(n, kPointwiseBlock), kPointwiseBlock, 0, stream>>>(out, inp, n, GeluErf{});
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

void swiglu_forward_bf16(uint16_t* out, const float* inp, int N, int H, cudaStream_t stream) {
    swiglu_forward_launch(out, inp, N, H, stream);
}

void swiglu_forward_bf16_in(uint16_t* out, const uint16_t* inp, int N, int H, cudaStream_t stream) {
    swiglu_forward_launch(out, inp, N, H, stream);
}

void swiglu_backward_bf16_in(float* dinp, const uint16_t* inp, const float* dout, int N, int H, cudaStream_t stream) {
    swiglu_backward_launch(dinp, inp, dout, N, H, stream);
}

void gelu_forward(float* out, const float* inp, size_t n, bool tanh_approx, cudaStream_t stream) {
    if (tanh_approx) {
        map1(out, inp, n, GeluTanh{}, stream);
    } else {
        map1(out, inp, n, GeluErf{}, stream);
    }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n, bool tanh_approx, cudaStream_t stream) {
    if (tanh_approx) {
        map2(dinp, inp, dout, n, GeluTanhBackward{}, stream);
    } else {
        map2(dinp, inp, dout, n, GeluErfBackward{}, stream);
    }
}

void swiglu_forward(float* out, const float* inp, int N, int H, cudaStream_t stream) {
    swiglu_forward_launch(out, inp, N, H, stream);
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int N, int H, cudaStream_t stream) {
    swiglu_backward_launch(dinp, inp, dout, N, H, stream);
}

}  // namespace trainer::cuda
