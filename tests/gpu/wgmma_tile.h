// Hopper's wgmma on the tiles of a flash attention forward (tests/gpu/wgmma_tile.cu): the layouts, descriptors and
// fragments of kernels/cuda/wgmma.cuh checked against the CPU, on the emulator (tests/test_wgmma_emulated.cpp)
// and on an sm_90 GPU (tests/gpu), before a kernel is built on them.
#pragma once

#include <cstdint>

namespace trainer::cuda {

// One warpgroup's two products of a flash forward tile, through wgmma: S (64 x keys, fp32) = Q K^T with Q (64 x
// head) and K (keys x head) K-major in shared memory, then O (64 x head, fp32) = P V with P = S rounded to bf16
// from registers and V (keys x head) N-major in shared memory. q, k, v: row-major bf16 words in host memory;
// s, o: host memory. head and keys: 64 or 128.
void wgmma_tile_products(int head, int keys, const uint16_t* q, const uint16_t* k, const uint16_t* v, float* s,
                         float* o);

}  // namespace trainer::cuda
