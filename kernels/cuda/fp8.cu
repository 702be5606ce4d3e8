// FP8 operands on the GPU (precision amp_fp8's casts; kernels/element.h has the formats): a tensor's amax, and its
// cast to FP8 codes with the per-tensor scale of that amax, row-major and, in the same pass, transposed (cuBLASLt's
// FP8 GEMMs on Hopper take A transposed and B not, so a tensor read both ways is written both ways at once).
// Compute capability 8.9 and newer convert with the hardware's cvt.rn.satfinite; elsewhere (and on the emulator)
// with element.h's fp8_encode, the CPU's conversion, which the hardware's equals (tests/gpu: bitwise on a GPU).
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/element.h"

namespace trainer::cuda {
namespace {

constexpr unsigned kThreads = 256;
// A 32 x 32 tile a block of 256 threads: 8 rows of 32, each thread converting 4 of the tile's rows.
constexpr int kTile = 32, kTileRows = 8;

__device__ float block_max(float x) {
    __shared__ float part[kThreads];
    part[threadIdx.x] = x;
    __syncthreads();
    for (unsigned half = kThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) part[threadIdx.x] = max_keeping_nan(part[threadIdx.x], part[threadIdx.x + half]);
        __syncthreads();
    }
    return part[0];
}

__device__ float load(const float* p, size_t i) { return p[i]; }
__device__ float load(const uint16_t* p, size_t i) { return bf16_to_float(p[i]); }

template <typename In>
__global__ void partial_amax_kernel(float* partials, const In* x, size_t n) {
    float m = 0.0f;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        m = max_keeping_nan(m, fabsf(load(x, i)));
    }
    const float total = block_max(m);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void final_amax_kernel(float* amax, const float* partials, unsigned count) {
    float m = 0.0f;
    for (unsigned i = threadIdx.x; i < count; i += kThreads) m = max_keeping_nan(m, partials[i]);
    const float total = block_max(m);
    if (threadIdx.x == 0) *amax = total;
}

__device__ uint8_t to_fp8(float x, Fp8Format f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t pair;  // the low byte is the second source's conversion
    if (f == Fp8Format::kE4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
    }
    return static_cast<uint8_t>(pair & 0xFF);
#else
    return fp8_encode(x, f);
#endif
}

// The grid's tiles cover `covered` >= rows rows: those past `rows` are the transposed copy's padding, zero codes.
template <typename In>
__global__ void cast_transpose_kernel(uint8_t* out, uint8_t* out_t, const In* in, int rows, int cols, int covered,
                                      const float* amax, Fp8Format f, float* descale) {
    __shared__ uint8_t tile[kTile][kTile + 4];
    const float scale = fp8_scale(*amax, f);
    if (descale != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *descale = 1.0f / scale;
    const int tiles_x = (cols + kTile - 1) / kTile;
    const int r0 = static_cast<int>(blockIdx.x) / tiles_x * kTile, c0 = static_cast<int>(blockIdx.x) % tiles_x * kTile;
    const int tx = static_cast<int>(threadIdx.x) % kTile, ty = static_cast<int>(threadIdx.x) / kTile;
    for (int k = ty; k < kTile; k += kTileRows) {
        const int r = r0 + k, c = c0 + tx;
        if (r < rows && c < cols) {
            const size_t at = static_cast<size_t>(r) * cols + c;
            const uint8_t q = to_fp8(load(in, at) * scale, f);
            if (out != nullptr) out[at] = q;
            tile[k][tx] = q;
        }
    }
    if (out_t == nullptr) return;  // the same for every thread of the grid
    __syncthreads();
    for (int k = ty; k < kTile; k += kTileRows) {
        const int c = c0 + k, r = r0 + tx;
        if (c < cols && r < covered) out_t[static_cast<size_t>(c) * covered + r] = r < rows ? tile[tx][k] : 0;
    }
}

template <typename In>
void cast_transpose(uint8_t* out, uint8_t* out_t, const In* in, int rows, int cols, const float* amax, Fp8Format f,
                    float* descale, cudaStream_t stream, int ld_t) {
    if (rows <= 0 || cols <= 0) return;
    const int covered = out_t != nullptr ? std::max(rows, ld_t) : rows;
    const unsigned tiles = static_cast<unsigned>((cols + kTile - 1) / kTile) * ((covered + kTile - 1) / kTile);
    TRAINER_LAUNCH(cast_transpose_kernel<In>, tiles, kTile * kTileRows, 0, stream, out, out_t, in, rows, cols, covered,
                   amax, f, descale);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void amax_of(float* amax, const In* x, size_t n, float* scratch, cudaStream_t stream) {
    // Up to kNormBlocks blocks striding over x (fewer for a small x), then one over their partial maxima.
    const auto blocks =
        static_cast<unsigned>(std::min<size_t>(kNormBlocks, std::max<size_t>(1, (n + kThreads - 1) / kThreads)));
    TRAINER_LAUNCH(partial_amax_kernel<In>, blocks, kThreads, 0, stream, scratch, x, n);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    TRAINER_LAUNCH(final_amax_kernel, 1, kThreads, 0, stream, amax, scratch, blocks);
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void fp8_amax(float* amax, const float* x, size_t n, float* scratch, cudaStream_t stream) {
    amax_of(amax, x, n, scratch, stream);
}

void fp8_amax(float* amax, const uint16_t* x, size_t n, float* scratch, cudaStream_t stream) {
    amax_of(amax, x, n, scratch, stream);
}

void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, const float* in, int rows, int cols, const float* amax,
                        Fp8Format f, float* descale, cudaStream_t stream, int ld_t) {
    cast_transpose(out, out_t, in, rows, cols, amax, f, descale, stream, ld_t);
}

void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, const uint16_t* in, int rows, int cols, const float* amax,
                        Fp8Format f, float* descale, cudaStream_t stream, int ld_t) {
    cast_transpose(out, out_t, in, rows, cols, amax, f, descale, stream, ld_t);
}

}  // namespace trainer::cuda
