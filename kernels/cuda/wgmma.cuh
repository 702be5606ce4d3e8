// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a only) on bf16 tiles in shared memory: the layout our tiles take,
// the descriptors that point wgmma at them, and the PTX wrappers. Included by sources compiled for sm_90a alone
// (CMakeLists.txt); under TRAINER_SIMT_EMULATION the wrappers come from tests/simt/cuda_shim.h instead.
//
// The layout: a tile of R rows of C bf16 (C a multiple of 64) is C / 64 panels of R rows x 64 columns, one after
// the other; a panel's rows are 128 bytes apart, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) (PTX's
// 128-byte swizzle, whose pattern repeats every 8 rows = 1024 bytes: the tile must start on a 1024-byte boundary).
// Descriptors take shared addresses (kernels/cuda/ptx.cuh's smem_addr). One layout serves every operand of a flash
// attention tile:
//   - K-major (the rows are M or N, the columns K): Q as S = Q K^T's A, K as its B (rows = keys);
//     the descriptor of k-step kk (16 columns) starts at panel kk / 4, byte 32 (kk % 4) of its first row, and
//     steps 1,024 bytes (SBO) per 8 rows;
//   - N-major (the rows are K, the columns N): V as O = P V's B (rows = keys); the descriptor of k-step kk
//     starts at row 16 kk of the first panel, steps 1,024 bytes (SBO) per 8 rows of K and R x 128 bytes (LBO,
//     one panel) per 64 columns of N.
// The accumulators of an m64nNk16 are each warp's 16 rows of the 64 (warp w of the warpgroup: rows 16 w ..),
// laid out as mma.sync's m16n8 accumulators for each 8 columns: d[j][0..3] = (row g, columns 8 j + 2 t, + 1) and
// (row g + 8, the same), g = lane / 4, t = lane % 4. A from registers is mma.sync's A fragment of the warp's rows.
#pragma once

#include <cstdint>
#include <type_traits>

namespace trainer::cuda::sm90 {

// The byte offset of element (row, col) of a `rows`-row tile in the layout above.
__host__ __device__ constexpr uint32_t tile_offset(int rows, int row, int col) {
    return static_cast<uint32_t>((col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) << 4) +
                                 (col % 8) * 2);
}

// A shared-memory matrix descriptor with the 128-byte swizzle (PTX ISA, "Matrix Descriptor Format"): the start
// address and the two byte offsets, each encoded as (x & 0x3FFFF) >> 4; base offset 0.
__host__ __device__ constexpr uint64_t descriptor(uint32_t start, uint32_t lbo, uint32_t sbo) {
    return uint64_t{(start & 0x3FFFF) >> 4} | uint64_t{(lbo & 0x3FFFF) >> 4} << 16 |
           uint64_t{(sbo & 0x3FFFF) >> 4} << 32 | uint64_t{1} << 62;
}
// `desc` pointed `bytes` further (a multiple of 16): the start address is the low word's bits 0-13, and a shared
// address stays below 2^18 bytes, so the sum never carries out of that field and one 32-bit add does it, where
// descriptor() of the moved address would mask, shift and assemble the 64 bits again for every k-step.
__host__ __device__ constexpr uint64_t advance(uint64_t desc, uint32_t bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(desc) + (bytes >> 4));
}
// K-step kk of a K-major tile at shared address `tile` with `rows` rows.
__host__ __device__ constexpr uint64_t k_major(uint32_t tile, int rows, int kk) {
    return advance(descriptor(tile, 16, 1024), static_cast<uint32_t>((kk / 4) * rows * 128 + (kk % 4) * 32));
}
// K-step kk of an N-major tile at shared address `tile` with `rows` rows (of K).
__host__ __device__ constexpr uint64_t n_major(uint32_t tile, int rows, int kk) {
    return advance(descriptor(tile, static_cast<uint32_t>(rows * 128), 1024), static_cast<uint32_t>(kk * 16 * 128));
}
static_assert(k_major(0x1000, 64, 5) == descriptor(0x1000 + 64 * 128 + 32, 16, 1024), "advance() moves the start");
static_assert(n_major(0x8000, 64, 3) == descriptor(0x8000 + 3 * 16 * 128, 64 * 128, 1024), "advance() moves the start");

}  // namespace trainer::cuda::sm90

#ifndef TRAINER_SIMT_EMULATION
namespace trainer::cuda::sm90 {

// Orders this thread's earlier writes of shared memory (plain stores, cp.async) before later wgmma reads of it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// An empty asm statement that reads and writes every register of x (accumulators, or A fragments): the compiler
// moves no access of x across it (wgmma_issue below says why).
template <typename T, int M>
__device__ __forceinline__ void fence_operands(T (&x)[M][4]) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>, "wgmma's registers: float or uint32_t");
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if constexpr (std::is_same_v<T, float>) {
                asm volatile("" : "+f"(x[i][e])::"memory");
            } else {
                asm volatile("" : "+r"(x[i][e])::"memory");
            }
        }
    }
}

// D (64 x N) = (accumulate ? D : 0) + A B: A (64 x 16) and B (16 x N) both K-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate);
// D (64 x N) = (accumulate ? D : 0) + A B: A (64 x 16) from registers, B (16 x N) N-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                         bool accumulate);

template <>
__device__ __forceinline__ void wgmma_ss<32>(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, "
        "1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
        "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
        "%57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
          "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
          "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
          "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}
template <>
__device__ __forceinline__ void wgmma_rs<64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                             bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, "
        "%34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}
template <>
__device__ __forceinline__ void wgmma_rs<128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                              bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
        "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
        "%57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
          "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
          "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
          "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

}  // namespace trainer::cuda::sm90
#endif  // TRAINER_SIMT_EMULATION

namespace trainer::cuda::sm90 {

// Where a kernel's tiles start in its dynamic shared memory `raw`: the first 1024-byte boundary, the swizzle's
// period (its launch asks 1024 bytes more than the tiles take).
__device__ __forceinline__ uint8_t* tile_base(uint8_t* raw) { return raw + (1024 - smem_addr(raw) % 1024) % 1024; }

// A group of wgmma by the warpgroup: issue() queues the products, into accumulators among `regs` and from any A
// fragments among them (each an array of [M][4] registers), and the group is committed. wgmma reads and writes those
// registers asynchronously, from the instruction to the wait_group that retires its group, and the compiler cannot
// see that: its data flow ends at the wgmma asm statement, so it may schedule another access of them between
// wgmma.fence and the wait, which PTX forbids (nvcc put the zeroing of S's accumulators after wgmma.fence). The
// fences on the operands hold every write of them (zeroing, the softmax's rescale of O, packing P) before
// wgmma.fence here, and wgmma_retire's every read after the wait, as CUTLASS's warpgroup_fence_operand does.
// Between the two, the code must not touch them. dev/check_wgmma_ptx.py checks the compiled PTX for all of it.
template <typename Issue, typename... Regs>
__device__ __forceinline__ void wgmma_issue(Issue&& issue, Regs&... regs) {
    (fence_operands(regs), ...);
    wgmma_fence();
    issue();
    wgmma_commit();
}
// Waits until at most N groups are in flight, then fences `regs` (the operands of the groups retired).
template <int N, typename... Regs>
__device__ __forceinline__ void wgmma_retire(Regs&... regs) {
    wgmma_wait<N>();
    (fence_operands(regs), ...);
}
// One group, retired before it returns.
template <typename Issue, typename... Regs>
__device__ __forceinline__ void wgmma_batch(Issue&& issue, Regs&... regs) {
    wgmma_issue(issue, regs...);
    wgmma_retire<0>(regs...);
}

}  // namespace trainer::cuda::sm90
