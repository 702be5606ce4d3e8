// Our flash attention forward on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): what
// flash_attention_forward runs on compute capability 9.0 (kernels/cuda/ops.h), the contract of the mma.sync
// forward (attention_flash.cu) on bf16 qkv (B, T, 3C), bf16 out (B, T, C) and the fp32 lse (B, NH, T).
//
// A block is two warpgroups (256 threads, at most 128 registers each so that two blocks share an SM and one's
// softmax overlaps the other's products) and owns 128 queries of one (batch, head), 64 a warpgroup (16 a warp). Q
// and two buffers of K and V tiles of 64 keys sit in shared memory in kernels/cuda/wgmma.cuh's layout, loaded by
// cp.async (the next tile while this one computes). Per key tile a warpgroup that sees any of its keys issues
// S = Q K^T as head / 16 wgmma with both operands read from shared memory through descriptors (no ldmatrix: the
// mma.sync kernels spend their shared-memory bandwidth on fragments that wgmma reads once for the whole
// warpgroup), then the online softmax of flash_tile.cuh on S in registers, then O += P V as wgmma with P from
// registers and V read N-major. The blocks go head by head, the last query tile (most keys) first, as the mma.sync
// forward's.
//
// Not yet here (FlashAttention-3's further steps): TMA loads by a producer warpgroup, and the overlap of one
// warpgroup's softmax with the other's products.
//
// Compiled for sm_90a alone (CMakeLists.txt: code for sm_90a loads on compute capability 9.0 only), and with g++
// onto tests/simt's emulator.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "base/common.h"

#ifndef TRAINER_SIMT_EMULATION
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ptx.cuh"
#endif
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/wgmma.cuh"

namespace trainer::cuda {
namespace {

using bf16 = __nv_bfloat16;
using namespace flash;
using namespace sm90;

constexpr int kGroups = 2;  // warpgroups a block
constexpr int kThreads = 128 * kGroups;
constexpr int kRows = 64 * kGroups;  // queries a block: 64 a warpgroup, 16 a warp
constexpr int kKeys = 64;            // keys a tile (S's 32 accumulators a thread beside O's 32 or 64)

// `rows` rows of D channels from global row `first` (stride `stride` elements; rows >= `limit` zero-filled) into a
// tile of wgmma.cuh's layout, by cp.async over the block's threads: consecutive threads take consecutive 16-byte
// chunks of a row.
template <int D, int kTileRows>
__device__ __forceinline__ void load_tile(uint8_t* tile, const bf16* src, size_t stride, int first, int limit) {
    constexpr int kChunks = kTileRows * D / 8;
    static_assert(kChunks % kThreads == 0, "every thread loads the same number of chunks");
#pragma unroll
    for (int k = static_cast<int>(threadIdx.x); k < kChunks; k += kThreads) {
        const int r = k / (D / 8), c = (k % (D / 8)) * 8;
        const bool valid = first + r < limit;
        const bf16* g = src + static_cast<size_t>(valid ? first + r : 0) * stride + c;
        cp_async16(tile + tile_offset(kTileRows, r, c), g, valid);
    }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2)
    flash_forward_sm90_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale_log2) {
    constexpr int kK = kKeys;
    constexpr int kTileBytes = kK * D * 2;
    TRAINER_DYNAMIC_SHARED(smem_raw);
    // The tiles start on a 1024-byte boundary (the swizzle's period; the launch asks 1024 bytes more for it).
    uint8_t* sq = smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024;
    uint8_t* sk = sq + kRows * D * 2;  // two buffers of kK x D
    uint8_t* sv = sk + 2 * kTileBytes;
    const int n_qtiles = (T + kRows - 1) / kRows;
    const int bh = static_cast<int>(blockIdx.x / n_qtiles), b = bh / NH, h = bh % NH;
    const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.x % n_qtiles);  // the last query tile (most keys) first
    const int q0 = qt * kRows;
    const int group = static_cast<int>(threadIdx.x) / 128, warp = static_cast<int>(threadIdx.x) / 32;
    const int g = static_cast<int>(threadIdx.x) % 32 / 4, t = static_cast<int>(threadIdx.x) % 4;  // flash_tile.cuh
    const size_t stride = static_cast<size_t>(3) * NH * D;
    const bf16* qbase = qkv + static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * D;
    const bf16* kbase = qbase + static_cast<size_t>(NH) * D;
    const bf16* vbase = kbase + static_cast<size_t>(NH) * D;

    load_tile<D, kRows>(sq, qbase, stride, q0, T);
    load_tile<D, kK>(sk, kbase, stride, 0, T);
    load_tile<D, kK>(sv, vbase, stride, 0, T);
    cp_async_commit();

    float o[1][D / 8][4] = {};
    float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.0f, 0.0f}};
    const int g0 = q0 + 64 * group;                                                   // this warpgroup's first query
    const int w0 = q0 + 16 * warp;                                                    // this warp's first query
    const uint32_t q_rows = smem_addr(sq) + static_cast<uint32_t>(64 * group * 128);  // the warpgroup's 64 rows
    // Key tiles up to the block's last query (none past T): tile 0 has a key every query sees, so every row's
    // running maximum is finite from the first tile on.
    const int n_tiles = min((q0 + kRows - 1) / kK + 1, (T + kK - 1) / kK);
    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1;
        if (j + 1 < n_tiles) {
            load_tile<D, kK>(sk + (buf ^ 1) * kTileBytes, kbase, stride, (j + 1) * kK, T);
            load_tile<D, kK>(sv + (buf ^ 1) * kTileBytes, vbase, stride, (j + 1) * kK, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();  // this thread's landed copies, visible to wgmma
        __syncthreads();      // and every other thread's
        const int k0 = j * kK;
        if (k0 <= g0 + 63) {  // the warpgroup's queries see a key of the tile (the same for its four warps)
            const uint32_t k_tile = smem_addr(sk + buf * kTileBytes), v_tile = smem_addr(sv + buf * kTileBytes);
            float s[1][kK / 8][4] = {};
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                wgmma_ss<kK>(s[0], k_major(q_rows, kRows, kk), k_major(k_tile, kK, kk), kk > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            online_softmax<1, kK, D>(s, m, l, o, k0, w0, k0 + kK - 1 > w0, scale_log2, g, t);
            uint32_t p[kK / 16][4];
#pragma unroll
            for (int kk = 0; kk < kK / 16; ++kk) pack_a(p[kk], s[0][2 * kk], s[0][2 * kk + 1]);
            wgmma_fence();  // O was rescaled by the softmax
#pragma unroll
            for (int kk = 0; kk < kK / 16; ++kk) wgmma_rs<D>(o[0], p[kk], n_major(v_tile, kK, kk), true);
            wgmma_commit();
            wgmma_wait<0>();
        }
        __syncthreads();  // both warpgroups are done with this buffer before the next iteration refills it
    }
    write_rows<1, D>(out, lse, o, m, l, b, h, T, NH, w0, g, t);
}

template <int D>
void forward_launch(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, cudaStream_t stream) {
    const size_t smem = static_cast<size_t>(kRows + 4 * kKeys) * D * 2 + 1024;
    auto* kernel = flash_forward_sm90_kernel<D>;
    TRAINER_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const unsigned grid = static_cast<unsigned>((T + kRows - 1) / kRows) * static_cast<unsigned>(B * NH);
    TRAINER_LAUNCH(kernel, grid, kThreads, smem, stream, reinterpret_cast<bf16*>(out), lse,
                   reinterpret_cast<const bf16*>(qkv), T, NH, scale_log2e(D));
    TRAINER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool flash_attention_sm90_available() {
#ifdef TRAINER_SIMT_EMULATION
    return true;  // the emulator runs wgmma
#else
    int device = 0, major = 0, minor = 0;
    TRAINER_CUDA_CHECK(cudaGetDevice(&device));
    TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;
#endif
}

void flash_attention_forward_sm90(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                                  cudaStream_t stream) {
    TRAINER_CHECK(flash_attention_supported(HS), "flash attention with heads of {}", HS);
    TRAINER_CHECK(flash_attention_sm90_available(), "the wgmma flash forward on a device without sm_90a");
    if (B == 0 || T == 0) return;
    if (HS == 64) return forward_launch<64>(out, lse, qkv, B, T, NH, stream);
    forward_launch<128>(out, lse, qkv, B, T, NH, stream);
}

}  // namespace trainer::cuda
