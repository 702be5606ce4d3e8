// Grouped-query attention's shared key/value heads on the GPU, the twin of kernels/cpu/kv_heads.cpp: every query
// head's own k and v copied from its group's shared head before the attention kernels run (native, cuDNN and flash
// then see NH heads of their own), and the copies' gradients summed back, each group in head order in fp32 and
// rounded once, so the sums are the CPU's. One thread an output element: pure bandwidth, a few MB a layer.
#include <algorithm>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

template <typename T>
__global__ void kv_heads_expand_kernel(T* out, const T* inp, size_t total, int NH, int KVH, int HS) {
    const int C = NH * HS, KV = KVH * HS, group = NH / KVH;
    for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t n = e / (3 * static_cast<size_t>(C));
        const int c = static_cast<int>(e % (3 * static_cast<size_t>(C)));
        const T* row = inp + n * (C + 2 * KV);
        if (c < C) {
            out[e] = row[c];
        } else {
            const int part = (c - C) / C, rem = (c - C) % C;  // part 0: k, 1: v
            out[e] = row[C + part * KV + (rem / HS) / group * HS + rem % HS];
        }
    }
}

template <typename T>
__global__ void kv_heads_reduce_kernel(T* dinp, const T* dout, size_t total, int NH, int KVH, int HS) {
    const int C = NH * HS, KV = KVH * HS, W = C + 2 * KV, group = NH / KVH;
    for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t n = e / W;
        const int c = static_cast<int>(e % W);
        const T* row = dout + n * 3 * C;
        if (c < C) {
            dinp[e] = row[c];
        } else {
            const int part = (c - C) / KV, rem = (c - C) % KV, j = rem / HS, d = rem % HS;
            float sum = 0.0f;
            for (int g = 0; g < group; ++g) sum += load_as_float(row[C + part * C + (j * group + g) * HS + d]);
            store_as(dinp + e, sum);
        }
    }
}

template <typename T>
void expand_launch(T* out, const T* inp, int N, int NH, int KVH, int HS, cudaStream_t stream) {
    check_shared_heads(NH, KVH);
    const size_t total = static_cast<size_t>(N) * 3 * NH * HS;
    if (total == 0) return;
    TRAINER_LAUNCH(kv_heads_expand_kernel<T>, grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream, out, inp,
                   total, NH, KVH, HS);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void reduce_launch(T* dinp, const T* dout, int N, int NH, int KVH, int HS, cudaStream_t stream) {
    check_shared_heads(NH, KVH);
    const size_t total = static_cast<size_t>(N) * (NH + 2 * KVH) * HS;
    if (total == 0) return;
    TRAINER_LAUNCH(kv_heads_reduce_kernel<T>, grid_for(total, kPointwiseBlock), kPointwiseBlock, 0, stream, dinp, dout,
                   total, NH, KVH, HS);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void kv_heads_expand(float* out, const float* inp, int N, int NH, int KVH, int HS, cudaStream_t stream) {
    expand_launch(out, inp, N, NH, KVH, HS, stream);
}
void kv_heads_expand(uint16_t* out, const uint16_t* inp, int N, int NH, int KVH, int HS, cudaStream_t stream) {
    expand_launch(out, inp, N, NH, KVH, HS, stream);
}
void kv_heads_reduce(float* dinp, const float* dout, int N, int NH, int KVH, int HS, cudaStream_t stream) {
    reduce_launch(dinp, dout, N, NH, KVH, HS, stream);
}
void kv_heads_reduce(uint16_t* dinp, const uint16_t* dout, int N, int NH, int KVH, int HS, cudaStream_t stream) {
    reduce_launch(dinp, dout, N, NH, KVH, HS, stream);
}

}  // namespace trainer::cuda
