// A CPU emulator of the CUDA execution model, so that the CPU suite runs our CUDA kernels (tests/gpu's checks and
// our flash attention: ldmatrix, mma.sync, cp.async, shuffles, __syncthreads; Hopper's wgmma.mma_async with its
// shared-memory descriptors; cuda_shim.h maps the CUDA names onto it). Each thread of a block is a fiber on
// the calling OS thread; a fiber runs until it reaches a point where threads wait for one another (a barrier, or
// a warp-collective instruction, which waits for the warp's 32 lanes and then gives each lane its share). The
// order in which threads resume is drawn from a seed, and so is each warp's speed between two barriers (a slow
// warp's collectives complete in some passes only), so warps drift apart as they do on an SM: a barrier the
// kernel leaves out lets one warp overwrite shared memory another still reads, as on a GPU, and the results
// show it. Blocks run one after another.
//
// What it checks beyond the arithmetic:
//   - shared memory: every ldmatrix and cp.async address lies inside the block's dynamic shared memory and is
//     16-byte aligned; the memory starts as bf16 NaNs (0xFFFF) on every block;
//   - cp.async: a copy lands at the latest moment the PTX allows (the cp.async.wait_group that retires its
//     group), and its destination reads as NaN from the issue until then, so a read before the wait, or before
//     the barrier that publishes other threads' copies, or a refill of a buffer that another warp still reads,
//     shows up in the results; a thread that ends with a copy outstanding is an error;
//   - warp collectives: all 32 lanes must arrive at the same kind of instruction; a block whose threads wait
//     on one another in a way that cannot resolve (a barrier some lanes skip) is reported as a deadlock;
//   - wgmma (sm_90a): the operands are read through the descriptors as PTX defines them (128-byte swizzle only),
//     at the latest moment the PTX allows (the wgmma.wait_group that retires the group), so a buffer refilled
//     before that wait shows up in the results; every address must lie inside the block's shared memory, the
//     descriptors must be the same on the warp's 32 lanes and their swizzle pattern 1024-byte aligned (base
//     offset 0); shared memory a cp.async wrote must have been made visible to the async proxy
//     (fence.proxy.async, by the thread whose copy it was) before a wgmma that reads it is issued; a thread that
//     ends with a wgmma outstanding is an error; the 128 threads of a warpgroup must issue the same wgmma.fence,
//     wgmma.mma_async (the same descriptors), commit_group and wait_group instructions in the same order (each warp
//     computes its 16 rows of the 64 on its own, so a warp that skips a wgmma would still give its rows right here;
//     on a GPU the .sync.aligned instructions would hang or compute garbage). Not checked: wgmma.fence around
//     register accesses, which is the compiler's schedule (dev/check_wgmma_ptx.py checks it on the PTX), and
//     plain stores to shared memory (only cp.async's writes are tracked for the proxy fence).
// Reports are exceptions thrown by launch() naming the block, thread and instruction.
//
// A fiber switch is a few instructions of our own on x86-64 (simt.cpp's simt_switch_stack) and glibc's swapcontext
// elsewhere. Under AddressSanitizer the switches are annotated (__sanitizer_start_switch_fiber).
//
// The arithmetic of mma.sync is fp32 fused multiply-adds in k order (the tensor cores' products of bf16 are
// exact in fp32; their order of accumulation is not specified), so results agree with a GPU's to rounding,
// not bitwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace simt {

// CUDA's dim3: a grid's or block's extent (unset dimensions 1), or an index.
struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr Dim3() = default;
    constexpr Dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Runs body() as every thread of a grid (x by y by z blocks) of blocks of `block.x` threads (1-D, a multiple of
// 32) with `smem` bytes of dynamic shared memory a block. Throws std::runtime_error on any of the faults above.
void launch(Dim3 grid, Dim3 block, size_t smem, const std::function<void()>& body);
// The seed of the order in which waiting threads resume (the default is 1).
void set_schedule_seed(uint64_t seed);

// Inside body(): the CUDA built-ins.
// (Read inline: a kernel reads them at every index computation.)
namespace detail {
extern const Dim3* current_thread;  // the running thread's index; null outside a kernel
extern Dim3 current_block, current_block_dim, current_grid_dim;
[[noreturn]] void outside_kernel();
}  // namespace detail
inline const Dim3& thread_idx() {
    if (detail::current_thread == nullptr) detail::outside_kernel();
    return *detail::current_thread;
}
inline const Dim3& block_idx() { return detail::current_block; }
inline const Dim3& block_dim() { return detail::current_block_dim; }
inline const Dim3& grid_dim() { return detail::current_grid_dim; }
uint8_t* dynamic_shared();
void syncthreads();
float shfl_xor(unsigned mask, float v, int lane_mask);
// vote.sync.all.pred: true where every lane's pred is.
bool all_sync(unsigned mask, bool pred);
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the rows of matrix i.
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans);
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b.
void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
// cp.async.cg.shared.global of 16 bytes (zero-filled when !valid), commit_group, wait_group n.
void cp_async16(void* dst, const void* src, bool valid);
void cp_async_commit();
void cp_async_wait(int n);

// The shared-memory address of p inside the block's dynamic shared memory (cvta.to.shared; the emulated window
// starts at 0, so offsets that are multiples of 1024 are 1024-byte aligned).
uint32_t shared_address(const void* p);
// fence.proxy.async.shared::cta: this thread's landed cp.async copies become visible to wgmma.
void fence_proxy_async();
// wgmma.fence.sync.aligned, wgmma.commit_group.sync.aligned, wgmma.wait_group.sync.aligned n.
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int n);
// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16, both descriptors with the 128-byte swizzle: the warpgroup's
// D (64 x n) = (accumulate ? D : 0) + A (64 x 16) B (16 x n), this lane's n / 2 accumulators at d. A is K-major in
// shared memory (desc_a) or, where a is given, the warp's registers (a[0..3] per lane, mma.sync's A fragment of
// the warp's 16 rows); B is K-major or, with trans_b, N-major.
void wgmma_m64k16(float* d, int n, uint64_t desc_a, const uint32_t* a, uint64_t desc_b, bool trans_b, bool accumulate);

}  // namespace simt
