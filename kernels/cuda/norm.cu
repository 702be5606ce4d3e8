// Sums and squared L2 norms on the GPU, accumulated in double and deterministic: a fixed grid of
// kNormBlocks blocks (independent of the device) strides over the input, each block reduces its
// threads' partials in a fixed shared-memory tree, and one block adds the kNormBlocks partials in the
// same fixed tree. The result is identical run to run and on every GPU; it is not bitwise equal to the
// CPU backend's (kernels/cpu/norm.cpp), whose chunking differs, only to within rounding.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {

constexpr unsigned kThreads = 256;

__device__ double block_sum(double x) {
    __shared__ double part[kThreads];
    part[threadIdx.x] = x;
    __syncthreads();
    for (unsigned half = kThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    return part[0];
}

__global__ void partial_sums_kernel(double* partials, const float* x, size_t n, bool square) {
    double acc = 0.0;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double v = static_cast<double>(x[i]);
        acc += square ? v * v : v;
    }
    const double total = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void final_sum_kernel(double* out, const double* partials) {
    double acc = 0.0;
    for (unsigned i = threadIdx.x; i < kNormBlocks; i += kThreads) acc += partials[i];
    const double total = block_sum(acc);
    if (threadIdx.x == 0) *out = total;
}

double finish(double* scratch, cudaStream_t stream) {
    TRAINER_LAUNCH(final_sum_kernel, 1, kThreads, 0, stream, scratch + kNormBlocks, scratch);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    double result = 0.0;
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(&result, scratch + kNormBlocks, sizeof(double), cudaMemcpyDeviceToHost, stream));
    TRAINER_CUDA_CHECK(cudaStreamSynchronize(stream));
    return result;
}

double reduce(const float* x, size_t n, bool square, double* scratch, cudaStream_t stream) {
    if (n == 0) return 0.0;
    TRAINER_LAUNCH(partial_sums_kernel, kNormBlocks, kThreads, 0, stream, scratch, x, n, square);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    return finish(scratch, stream);
}

// Chunks (numbered across the segments) in a fixed stride over the kNormBlocks blocks, and thread i of a
// block owning elements [16 i, 16 i + 16) of each chunk, added in order: the partition, and so the result,
// depends only on the segments. The 16 are read as four 16-byte loads where they are aligned (parameters
// sit at 4-byte offsets of their unit), as scalars otherwise, in the same order either way.
constexpr size_t kPerThread = 16;
static_assert(kAdamwChunk == kThreads * kPerThread, "a chunk is 16 elements per thread");

__global__ void partial_squares_multi_kernel(double* partials, const NormSegment* segs, int nsegs,
                                             size_t total_chunks) {
    double acc = 0.0;
    for (size_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
        size_t begin = 0, end = 0;
        const NormSegment& g = chunk_segment(segs, nsegs, c, kAdamwChunk, &begin, &end);
        const size_t first = begin + threadIdx.x * kPerThread;
        if (first >= end) continue;
        const float* x = g.x + first;
        if (first + kPerThread <= end && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
            float4 q[kPerThread / 4];
#pragma unroll
            for (size_t k = 0; k < kPerThread / 4; ++k) q[k] = reinterpret_cast<const float4*>(x)[k];
#pragma unroll
            for (size_t k = 0; k < kPerThread / 4; ++k) {
                const double a = q[k].x, b = q[k].y, d = q[k].z, e = q[k].w;
                acc += a * a;
                acc += b * b;
                acc += d * d;
                acc += e * e;
            }
        } else {
            const size_t count = end - first < kPerThread ? end - first : kPerThread;
            for (size_t k = 0; k < count; ++k) {
                const double v = static_cast<double>(x[k]);
                acc += v * v;
            }
        }
    }
    const double total = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

}  // namespace

double squared_norm_multi(const NormSegment* segs_device, int nsegs, size_t total_chunks, double* scratch,
                          cudaStream_t stream) {
    if (nsegs == 0 || total_chunks == 0) return 0.0;
    TRAINER_LAUNCH(partial_squares_multi_kernel, kNormBlocks, kThreads, 0, stream, scratch, segs_device, nsegs,
                   total_chunks);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    return finish(scratch, stream);
}

double squared_norm(const float* x, size_t n, double* scratch, cudaStream_t stream) {
    return reduce(x, n, true, scratch, stream);
}

double sum(const float* x, size_t n, double* scratch, cudaStream_t stream) {
    return reduce(x, n, false, scratch, stream);
}

}  // namespace trainer::cuda
