// Pointwise MLP activations on the GPU: GELU (erf and tanh forms) and SwiGLU, forward and backward, with
// the per-element formulas of kernels/element.h that the CPU twin (kernels/cpu/activation.cpp) uses.
// Gradients are overwritten; GELU may run in place. Under amp_fp8 the SwiGLU kernels and the bf16-output GELU
// kernels also write their output's amax where given one (common.cuh's warp_amax), for the FP8 cast of the Linear
// that reads it.
#include <algorithm>

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
// outputs. Rows stride over blockIdx.y and columns over blockIdx.x, each thread on V consecutive columns
// (kSwigluVec with 128-bit accesses where the rows allow, else 1), consecutive threads on consecutive
// columns (coalesced in every array), with no per-element division.
constexpr int kSwigluVec = 8;

template <int V, typename In, typename Out>
__global__ void swiglu_forward_kernel(Out* out, const In* inp, int N, int H, float* amax) {
    float m = 0.0f;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const In* x = inp + static_cast<size_t>(n) * 2 * H;
        Out* y = out + static_cast<size_t>(n) * H;
        for (int j = (blockIdx.x * blockDim.x + threadIdx.x) * V; j < H; j += gridDim.x * blockDim.x * V) {
            float v[V], g[V], r[V];
            load_vec<V>(x + j, v);
            load_vec<V>(x + H + j, g);
#pragma unroll
            for (int k = 0; k < V; ++k) r[k] = silu(g[k]) * v[k];
            store_vec<V>(y + j, r);
            if (amax != nullptr) {
#pragma unroll
                for (int k = 0; k < V; ++k) m = max_keeping_nan(m, fabsf(r[k]));
            }
        }
    }
    if (amax != nullptr) warp_amax(amax, stored_amax<Out>(m));
}

// dinp (rows of 2H, overwritten) from dout (rows of H): fp32 gradients, or bf16 ones (fp32 math, rounded
// once).
template <int V, typename In, typename G>
__global__ void swiglu_backward_kernel(G* dinp, const In* inp, const G* dout, int N, int H, float* amax) {
    float m = 0.0f;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const In* x = inp + static_cast<size_t>(n) * 2 * H;
        const G* g_row = dout + static_cast<size_t>(n) * H;
        G* dx = dinp + static_cast<size_t>(n) * 2 * H;
        for (int j = (blockIdx.x * blockDim.x + threadIdx.x) * V; j < H; j += gridDim.x * blockDim.x * V) {
            float v[V], gate[V], g[V], dv[V], dgate[V];
            load_vec<V>(x + j, v);
            load_vec<V>(x + H + j, gate);
            load_vec<V>(g_row + j, g);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                dv[k] = g[k] * silu(gate[k]);
                dgate[k] = g[k] * v[k] * silu_grad(gate[k]);
            }
            store_vec<V>(dx + j, dv);
            store_vec<V>(dx + H + j, dgate);
            if (amax != nullptr) {
#pragma unroll
                for (int k = 0; k < V; ++k) m = max_keeping_nan(max_keeping_nan(m, fabsf(dv[k])), fabsf(dgate[k]));
            }
        }
    }
    if (amax != nullptr) warp_amax(amax, stored_amax<G>(m));
}

// The (columns, rows) grid of the SwiGLU kernels: every column of a row in one pass of a block row.
dim3 swiglu_grid(int N, int H, int vec) {
    const unsigned x = (static_cast<unsigned>((H + vec - 1) / vec) + kPointwiseBlock - 1) / kPointwiseBlock;
    const unsigned y = static_cast<unsigned>(std::min(N, 65535));
    return dim3(x, y);
}

template <typename In, typename Out>
void swiglu_forward_launch(Out* out, const In* inp, int N, int H, cudaStream_t stream, float* amax) {
    zero_amax(amax, stream);
    if (static_cast<size_t>(N) * H == 0) return;
    if (H % kSwigluVec == 0 && aligned16(out, inp)) {
        TRAINER_LAUNCH((swiglu_forward_kernel<kSwigluVec, In, Out>), swiglu_grid(N, H, kSwigluVec), kPointwiseBlock, 0,
                       stream, out, inp, N, H, amax);
    } else {
        TRAINER_LAUNCH((swiglu_forward_kernel<1, In, Out>), swiglu_grid(N, H, 1), kPointwiseBlock, 0, stream, out, inp,
                       N, H, amax);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename In, typename G>
void swiglu_backward_launch(G* dinp, const In* inp, const G* dout, int N, int H, cudaStream_t stream, float* amax) {
    zero_amax(amax, stream);
    if (static_cast<size_t>(N) * H == 0) return;
    if (H % kSwigluVec == 0 && aligned16(dinp, inp, dout)) {
        TRAINER_LAUNCH((swiglu_backward_kernel<kSwigluVec, In, G>), swiglu_grid(N, H, kSwigluVec), kPointwiseBlock, 0,
                       stream, dinp, inp, dout, N, H, amax);
    } else {
        TRAINER_LAUNCH((swiglu_backward_kernel<1, In, G>), swiglu_grid(N, H, 1), kPointwiseBlock, 0, stream, dinp, inp,
                       dout, N, H, amax);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

// out(n) = f(inp) rounded to bf16 (a GEMM operand), inp fp32 or bf16, V elements a thread (128-bit accesses
// where V > 1), then the tail one by one.
template <int V, typename In, typename F>
__global__ void map1_to_bf16_kernel(uint16_t* out, const In* inp, size_t n, F f, float* amax) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x, groups = n / V;
    float m = 0.0f;
    for (size_t i = tid; i < groups; i += stride) {
        float x[V];
        load_vec<V>(inp + i * V, x);
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = f(x[k]);
        store_vec<V>(out + i * V, x);
        if (amax != nullptr) {
#pragma unroll
            for (int k = 0; k < V; ++k) m = max_keeping_nan(m, fabsf(x[k]));
        }
    }
    for (size_t i = groups * V + tid; i < n; i += stride) {
        const float y = f(load_as_float(inp[i]));
        out[i] = float_to_bf16(y);
        m = max_keeping_nan(m, fabsf(y));
    }
    if (amax != nullptr) warp_amax(amax, stored_amax<uint16_t>(m));
}

// dinp(n) = f(inp, dout) on bf16 gradients and the pre-activation (fp32 or bf16), rounded once; in place
// allowed (each element reads and writes only its own index).
template <int V, typename In, typename F>
__global__ void map2_bf16_grad_kernel(uint16_t* dinp, const In* inp, const uint16_t* dout, size_t n, F f, float* amax) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x, groups = n / V;
    float m = 0.0f;
    for (size_t i = tid; i < groups; i += stride) {
        float x[V], g[V];
        load_vec<V>(inp + i * V, x);
        load_vec<V>(dout + i * V, g);
#pragma unroll
        for (int k = 0; k < V; ++k) g[k] = f(x[k], g[k]);
        store_vec<V>(dinp + i * V, g);
        if (amax != nullptr) {
#pragma unroll
            for (int k = 0; k < V; ++k) m = max_keeping_nan(m, fabsf(g[k]));
        }
    }
    for (size_t i = groups * V + tid; i < n; i += stride) {
        const float d = f(load_as_float(inp[i]), bf16_to_float(dout[i]));
        dinp[i] = float_to_bf16(d);
        m = max_keeping_nan(m, fabsf(d));
    }
    if (amax != nullptr) warp_amax(amax, stored_amax<uint16_t>(m));
}

constexpr int kMapVec = 8;

template <typename In, typename F>
void map1_to_bf16(uint16_t* out, const In* inp, size_t n, F f, cudaStream_t stream, float* amax) {
    zero_amax(amax, stream);
    if (n == 0) return;
    if (aligned16(out, inp)) {
        TRAINER_LAUNCH((map1_to_bf16_kernel<kMapVec, In>), grid_for((n + kMapVec - 1) / kMapVec, kPointwiseBlock),
                       kPointwiseBlock, 0, stream, out, inp, n, f, amax);
    } else {
        TRAINER_LAUNCH((map1_to_bf16_kernel<1, In>), grid_for(n, kPointwiseBlock), kPointwiseBlock, 0, stream, out, inp,
                       n, f, amax);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename In, typename F>
void map2_bf16_grad(uint16_t* dinp, const In* inp, const uint16_t* dout, size_t n, F f, cudaStream_t stream,
                    float* amax) {
    zero_amax(amax, stream);
    if (n == 0) return;
    if (aligned16(dinp, inp, dout)) {
        TRAINER_LAUNCH((map2_bf16_grad_kernel<kMapVec, In>), grid_for((n + kMapVec - 1) / kMapVec, kPointwiseBlock),
                       kPointwiseBlock, 0, stream, dinp, inp, dout, n, f, amax);
    } else {
        TRAINER_LAUNCH((map2_bf16_grad_kernel<1, In>), grid_for(n, kPointwiseBlock), kPointwiseBlock, 0, stream, dinp,
                       inp, dout, n, f, amax);
    }
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void gelu_forward(uint16_t* out, const float* inp, size_t n, bool tanh_approx, cudaStream_t stream, float* amax) {
    if (tanh_approx) {
        map1_to_bf16(out, inp, n, GeluTanh{}, stream, amax);
    } else {
        map1_to_bf16(out, inp, n, GeluErf{}, stream, amax);
    }
}

void gelu_forward(uint16_t* out, const uint16_t* inp, size_t n, bool tanh_approx, cudaStream_t stream, float* amax) {
    if (tanh_approx) {
        map1_to_bf16(out, inp, n, GeluTanh{}, stream, amax);
    } else {
        map1_to_bf16(out, inp, n, GeluErf{}, stream, amax);
    }
}

void gelu_backward(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, size_t n, bool tanh_approx,
                   cudaStream_t stream, float* amax) {
    if (tanh_approx) {
        map2_bf16_grad(dinp, inp, dout, n, GeluTanhBackward{}, stream, amax);
    } else {
        map2_bf16_grad(dinp, inp, dout, n, GeluErfBackward{}, stream, amax);
    }
}

void swiglu_forward(uint16_t* out, const float* inp, int N, int H, cudaStream_t stream, float* amax) {
    swiglu_forward_launch(out, inp, N, H, stream, amax);
}

void swiglu_forward(uint16_t* out, const uint16_t* inp, int N, int H, cudaStream_t stream, float* amax) {
    swiglu_forward_launch(out, inp, N, H, stream, amax);
}

void swiglu_backward(float* dinp, const uint16_t* inp, const float* dout, int N, int H, cudaStream_t stream,
                     float* amax) {
    swiglu_backward_launch(dinp, inp, dout, N, H, stream, amax);
}

void swiglu_backward(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, int N, int H, cudaStream_t stream,
                     float* amax) {
    swiglu_backward_launch(dinp, inp, dout, N, H, stream, amax);
}

void gelu_backward(uint16_t* dinp, const float* inp, const uint16_t* dout, size_t n, bool tanh_approx,
                   cudaStream_t stream, float* amax) {
    if (tanh_approx) {
        map2_bf16_grad(dinp, inp, dout, n, GeluTanhBackward{}, stream, amax);
    } else {
        map2_bf16_grad(dinp, inp, dout, n, GeluErfBackward{}, stream, amax);
    }
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

void swiglu_forward(float* out, const float* inp, int N, int H, cudaStream_t stream, float* amax) {
    swiglu_forward_launch(out, inp, N, H, stream, amax);
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int N, int H, cudaStream_t stream, float* amax) {
    swiglu_backward_launch(dinp, inp, dout, N, H, stream, amax);
}

}  // namespace trainer::cuda
