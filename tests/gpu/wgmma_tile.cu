// Hopper's wgmma on the two products of a flash forward tile: see wgmma_tile.h. Compiled for sm_90a alone
// (tests/CMakeLists.txt), and with g++ onto the emulator of tests/simt.
#include <cstddef>
#include <cstdint>

#include "base/common.h"

#ifndef TRAINER_SIMT_EMULATION
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/ptx.cuh"
#endif
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "wgmma_tile.h"

namespace trainer::cuda {
namespace {

using namespace sm90;
constexpr int kRows = 64;  // one warpgroup's rows

// A warpgroup's 64 x N accumulators (wgmma.cuh's layout) into out, row-major with N columns.
template <int N>
__device__ __forceinline__ void store(float* out, const float (&acc)[N / 8][4]) {
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * warp + lane / 4 + 8 * (e / 2), col = 8 * j + 2 * (lane % 4) + e % 2;
            out[row * N + col] = acc[j][e];
        }
    }
}

// rows x head bf16 (row-major in global memory) into a tile of wgmma.cuh's layout, by cp.async over the block.
template <int Head>
__device__ __forceinline__ void load(uint8_t* tile, const uint16_t* src, int rows) {
    for (int c = static_cast<int>(threadIdx.x); c < rows * Head / 8; c += static_cast<int>(blockDim.x)) {
        const int r = c / (Head / 8), col = (c % (Head / 8)) * 8;
        cp_async16(tile + tile_offset(rows, r, col), src + static_cast<size_t>(r) * Head + col, true);
    }
}

template <int Head, int Keys>
__global__ void __launch_bounds__(128)
    wgmma_tile_kernel(float* s_out, float* o_out, const uint16_t* q, const uint16_t* k, const uint16_t* v) {
    TRAINER_DYNAMIC_SHARED(smem_raw);
    uint8_t* sq = tile_base(smem_raw);
    uint8_t* sk = sq + kRows * Head * 2;
    uint8_t* sv = sk + Keys * Head * 2;
    load<Head>(sq, q, kRows);
    load<Head>(sk, k, Keys);
    load<Head>(sv, v, Keys);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's copies, visible to wgmma's reads
    __syncthreads();      // and every other thread's

    float s[Keys / 8][4] = {};
    wgmma_batch(
        [&] {
#pragma unroll
            for (int kk = 0; kk < Head / 16; ++kk) {
                wgmma_ss<Keys>(s, k_major(smem_addr(sq), kRows, kk), k_major(smem_addr(sk), Keys, kk), kk > 0);
            }
        },
        s);
    store<Keys>(s_out, s);
    // P = S in bf16 as the A operand, 16 keys a k-step: the accumulators of columns 16 kk .. + 7 and + 8 .. + 15.
    uint32_t p[Keys / 16][4];
#pragma unroll
    for (int kk = 0; kk < Keys / 16; ++kk) flash::pack_a(p[kk], s[2 * kk], s[2 * kk + 1]);
    float o[Head / 8][4] = {};
    wgmma_batch(
        [&] {
#pragma unroll
            for (int kk = 0; kk < Keys / 16; ++kk) wgmma_rs<Head>(o, p[kk], n_major(smem_addr(sv), Keys, kk), kk > 0);
        },
        o, p);
    store<Head>(o_out, o);
}

template <int Head, int Keys>
void run(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* s, float* o) {
    const size_t nq = static_cast<size_t>(kRows) * Head, nkv = static_cast<size_t>(Keys) * Head;
    const size_t ns = static_cast<size_t>(kRows) * Keys;
    uint16_t *dq = nullptr, *dk = nullptr, *dv = nullptr;
    float *ds = nullptr, *dout = nullptr;
    TRAINER_CUDA_CHECK(cudaMalloc(&dq, nq * 2));
    TRAINER_CUDA_CHECK(cudaMalloc(&dk, nkv * 2));
    TRAINER_CUDA_CHECK(cudaMalloc(&dv, nkv * 2));
    TRAINER_CUDA_CHECK(cudaMalloc(&ds, ns * 4));
    TRAINER_CUDA_CHECK(cudaMalloc(&dout, nq * 4));
    TRAINER_CUDA_CHECK(cudaMemcpy(dq, q, nq * 2, cudaMemcpyHostToDevice));
    TRAINER_CUDA_CHECK(cudaMemcpy(dk, k, nkv * 2, cudaMemcpyHostToDevice));
    TRAINER_CUDA_CHECK(cudaMemcpy(dv, v, nkv * 2, cudaMemcpyHostToDevice));
    const size_t smem = (nq + 2 * nkv) * 2 + 1024;
    auto* kernel = wgmma_tile_kernel<Head, Keys>;
    TRAINER_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    TRAINER_LAUNCH(kernel, 1, 128, smem, nullptr, ds, dout, dq, dk, dv);
    TRAINER_CUDA_CHECK(cudaGetLastError());
    TRAINER_CUDA_CHECK(cudaMemcpy(s, ds, ns * 4, cudaMemcpyDeviceToHost));
    TRAINER_CUDA_CHECK(cudaMemcpy(o, dout, nq * 4, cudaMemcpyDeviceToHost));
    for (void* p : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(ds),
                    static_cast<void*>(dout)}) {
        TRAINER_CUDA_CHECK(cudaFree(p));
    }
}

}  // namespace

void wgmma_tile_products(int head, int keys, const uint16_t* q, const uint16_t* k, const uint16_t* v, float* s,
                         float* o) {
    TRAINER_CHECK((head == 64 || head == 128) && (keys == 64 || keys == 128),
                  "wgmma tile products with heads of {} and {} keys (64 or 128 each)", head, keys);
    if (head == 64) return keys == 64 ? run<64, 64>(q, k, v, s, o) : run<64, 128>(q, k, v, s, o);
    keys == 64 ? run<128, 64>(q, k, v, s, o) : run<128, 128>(q, k, v, s, o);
}

}  // namespace trainer::cuda
