// Our flash attention's CUDA kernels (kernels/cuda/attention_flash.cu), compiled with g++ into trainer::simt_cuda
// (tests/CMakeLists.txt) and run on the CPU by the emulator of tests/simt, against the CPU backend's attention:
// the kernels' indexing, swizzle, causal skipping, online softmax, tile loops and cp.async / barrier discipline
// are checked on every CPU run, not only where a GPU is lent (tests/gpu runs the same kernels on one, at speed,
// and checks their bits repeat). Plus the emulator's own checks: its fragments against PTX's layouts, and the
// faults it must catch.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/element.h"
#include "simt/cuda_shim.h"
// After the shim (TRAINER_SIMT_EMULATION): the layout and descriptor helpers of Hopper's wgmma.
#include "kernels/cuda/wgmma.cuh"

// The emulated kernels' declarations: kernels/cuda/ops.h read with the token `cuda` renamed; and the flash
// kernels' grid (flash_tile.cuh), whose L2 budget a test shrinks. In the emulated build (TRAINER_CUDA=EMULATED)
// the trainer's own trainer::cuda is the emulated code.
#ifdef TRAINER_SIMT_DEVICE
#define simt_cuda cuda
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ops.h"
#else
#define cuda simt_cuda
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ops.h"
#undef cuda
#endif

namespace {

std::vector<float> wave(size_t n, float scale, float phase) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = scale * std::sin(0.731f * static_cast<float>(i) + phase);
    return x;
}
// x rounded to bf16: the words and their fp32 values.
std::pair<std::vector<uint16_t>, std::vector<float>> bf16_rounded(const std::vector<float>& x) {
    std::vector<uint16_t> h(x.size());
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = trainer::float_to_bf16(x[i]), r[i] = trainer::bf16_to_float(h[i]);
    return {h, r};
}
std::vector<float> widened(const std::vector<uint16_t>& h) {
    std::vector<float> r(h.size());
    for (size_t i = 0; i < h.size(); ++i) r[i] = trainer::bf16_to_float(h[i]);
    return r;
}
// The first element outside abs + rel |ref|, or "" (NaN never passes).
std::string mismatch(const std::vector<float>& ref, const std::vector<float>& got, double abs_tol, double rel_tol) {
    if (ref.size() != got.size()) return fmt::format("{} elements, expected {}", got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!(std::fabs(static_cast<double>(ref[i]) - got[i]) <= abs_tol + rel_tol * std::fabs(ref[i]))) {
            return fmt::format("first mismatch at {} of {}: ref {:.9g} got {:.9g}", i, ref.size(), ref[i], got[i]);
        }
    }
    return "";
}

struct FlashRun {
    std::vector<uint16_t> out, dqkv;
    std::vector<float> lse;
};
// A copy of host data in (emulated) device memory, read back by get(): the kernels' queued work runs when the copy
// back waits for it.
template <typename T>
struct DeviceCopy {
    T* p = nullptr;
    size_t n;
    explicit DeviceCopy(const std::vector<T>& h) : n(h.size()) {
        REQUIRE(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess);
        REQUIRE(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    }
    ~DeviceCopy() { cudaFree(p); }
    std::vector<T> get() const {
        std::vector<T> h(n);
        REQUIRE(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
        return h;
    }
};

// Forward and backward on wgmma (attention_flash_sm90a.cu) or on mma.sync (attention_flash.cu).
FlashRun run_flash(const std::vector<uint16_t>& qkv, const std::vector<uint16_t>& dout, int B, int T, int NH, int HS,
                   bool wgmma) {
    DeviceCopy<uint16_t> d_qkv(qkv), d_dout(dout), out(std::vector<uint16_t>(dout.size(), 0)),
        dqkv(std::vector<uint16_t>(qkv.size(), 0));
    DeviceCopy<float> lse(std::vector<float>(static_cast<size_t>(B) * NH * T, 0.0f));
    DeviceCopy<uint8_t> scratch(
        std::vector<uint8_t>(trainer::simt_cuda::flash_attention_backward_scratch_bytes(B, T, NH, HS)));
    if (wgmma) {
        trainer::simt_cuda::flash_attention_forward_sm90(out.p, lse.p, d_qkv.p, B, T, NH, HS, nullptr);
        trainer::simt_cuda::flash_attention_backward_sm90(dqkv.p, d_dout.p, d_qkv.p, out.p, lse.p, B, T, NH, HS,
                                                          scratch.p, nullptr);
    } else {
        trainer::simt_cuda::flash_attention_forward_sm80(out.p, lse.p, d_qkv.p, B, T, NH, HS, nullptr);
        trainer::simt_cuda::flash_attention_backward_sm80(dqkv.p, d_dout.p, d_qkv.p, out.p, lse.p, B, T, NH, HS,
                                                          scratch.p, nullptr);
    }
    return {out.get(), dqkv.get(), lse.get()};
}

}  // namespace

// The shapes of tests/gpu's flash case that fit a CPU run: T spans partial and whole tiles of 32, 64 and 128
// queries and keys (1 to 3 forward blocks, 1 to 5 key tiles), two heads and two sequences, heads of 64 and 128;
// both kernel pairs (wgmma, what an H100 runs, and mma.sync).
TEST_CASE("flash attention kernels emulated on the CPU match the CPU attention forward and backward") {
    simt::set_schedule_seed(1);
    const int NH = 2;
    for (const auto& [B, T] : std::vector<std::pair<int, int>>{{1, 2}, {2, 37}, {1, 64}, {1, 130}, {1, 300}}) {
        for (int HS : {64, 128}) {
            for (bool wgmma : {true, false}) {
                INFO(fmt::format("B={} T={} NH={} HS={} on {}", B, T, NH, HS, wgmma ? "wgmma" : "mma.sync"));
                const int C = NH * HS;
                const auto [qkv16, qkv] = bf16_rounded(wave(static_cast<size_t>(B) * T * 3 * C, 1.0f, 0.2f));
                const auto [dout16, dout] = bf16_rounded(wave(static_cast<size_t>(B) * T * C, 1.0f, 0.8f));
                std::vector<float> out(dout.size()), lse(static_cast<size_t>(B) * NH * T), dqkv(qkv.size());
                trainer::cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
                const FlashRun got = run_flash(qkv16, dout16, B, T, NH, HS, wgmma);
                const auto got_out = widened(got.out);
                // the bf16 tolerance (docs/gpus.md) for bf16 outputs (P is rounded to bf16 before P V); lse is
                // fp32.
                CHECK(mismatch(out, got_out, 1e-2, 1.6e-2) == "");
                CHECK(mismatch(lse, got.lse, 1e-4, 1e-4) == "");
                // The backward from the kernel's own bf16 output, as the backend passes it.
                trainer::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), got_out.data(), lse.data(), B, T,
                                                 NH, HS);
                CHECK(mismatch(dqkv, widened(got.dqkv), 1e-2, 1.6e-2) == "");
            }
        }
    }
}

// Every sum has one owner that adds in a fixed order, so no interleaving of the threads changes a bit (the GPU
// case checks two runs repeat; here the order in which waiting threads resume is drawn anew).
TEST_CASE("flash attention kernels emulated under other thread schedules give the same bits") {
    const int B = 1, T = 130, NH = 2;
    for (int HS : {64, 128}) {
        const auto qkv16 = bf16_rounded(wave(static_cast<size_t>(B) * T * 3 * NH * HS, 1.0f, 0.4f)).first;
        const auto dout16 = bf16_rounded(wave(static_cast<size_t>(B) * T * NH * HS, 1.0f, 1.3f)).first;
        for (bool wgmma : {true, false}) {
            simt::set_schedule_seed(11);
            const FlashRun a = run_flash(qkv16, dout16, B, T, NH, HS, wgmma);
            simt::set_schedule_seed(12);
            const FlashRun b = run_flash(qkv16, dout16, B, T, NH, HS, wgmma);
            CHECK(a.out == b.out);
            CHECK(a.lse == b.lse);
            CHECK(a.dqkv == b.dqkv);
        }
    }
    simt::set_schedule_seed(1);
}

// The grid of flash_grid (flash_tile.cuh): heads in sections whose streamed K and V fit the L2 budget and divide
// B x NH, the blocks of a section longest first across its heads.
TEST_CASE("flash attention's grid puts the heads in sections that fit L2 and divide the heads") {
    namespace flash = trainer::simt_cuda::flash;
    const auto extent = [](const dim3& d) { return std::vector<unsigned>{d.x, d.y, d.z}; };
    // OLMo-1B at micro-batch 4: 64 heads of 2048 x 128 (1 MiB of K and V each), 16 query tiles of 128.
    CHECK(extent(flash::flash_grid(64, 16, 2048, 128)) == std::vector<unsigned>{32, 16, 2});
    // GPT-2 at micro-batch 16: 192 heads of 1024 x 64 (256 KiB each) fit 128 to a section; 96 divides 192.
    CHECK(extent(flash::flash_grid(192, 8, 1024, 64)) == std::vector<unsigned>{96, 8, 2});
    // All heads in one section where they fit; one head a section where none divides under the fit.
    CHECK(extent(flash::flash_grid(6, 3, 130, 64)) == std::vector<unsigned>{6, 3, 1});
    CHECK(extent(flash::flash_grid(67, 16, 2048, 128)) == std::vector<unsigned>{1, 16, 67});
    CHECK(extent(flash::flash_grid(3, 2, 1 << 20, 128)) == std::vector<unsigned>{1, 2, 3});
    // More sections than a grid's z holds: one section of every head.
    CHECK(extent(flash::flash_grid(65537, 16, 2048, 128)) == std::vector<unsigned>{65537, 16, 1});
}

// The order of the blocks changes no bit: with the L2 budget shrunk to two heads (three sections of B x NH = 6)
// and to none (one head a section), both kernel pairs give what one section gives, so every block is computed once
// with its own head and tile.
TEST_CASE("flash attention kernels emulated give the same bits with the heads in several sections") {
    namespace flash = trainer::simt_cuda::flash;
    simt::set_schedule_seed(1);
    const int B = 3, T = 70, NH = 2;
    for (int HS : {64, 128}) {
        const auto qkv16 = bf16_rounded(wave(static_cast<size_t>(B) * T * 3 * NH * HS, 1.0f, 0.3f)).first;
        const auto dout16 = bf16_rounded(wave(static_cast<size_t>(B) * T * NH * HS, 1.0f, 0.9f)).first;
        const size_t per_head = static_cast<size_t>(4) * T * HS;
        for (bool wgmma : {true, false}) {
            INFO(fmt::format("HS={} on {}", HS, wgmma ? "wgmma" : "mma.sync"));
            const FlashRun one = run_flash(qkv16, dout16, B, T, NH, HS, wgmma);
            for (size_t budget : {2 * per_head, size_t{0}}) {
                struct Restore {
                    size_t saved = flash::section_l2_bytes;
                    ~Restore() { flash::section_l2_bytes = saved; }
                } restore;
                flash::section_l2_bytes = budget;
                INFO(fmt::format("sections of {} heads", flash::flash_grid(B * NH, 1, T, HS).x));
                const FlashRun sectioned = run_flash(qkv16, dout16, B, T, NH, HS, wgmma);
                CHECK(sectioned.out == one.out);
                CHECK(sectioned.lse == one.lse);
                CHECK(sectioned.dqkv == one.dqkv);
            }
        }
    }
}

// The emulator's fragments against PTX's definitions (the "Matrix Fragments for mma.m16n8k16" and ldmatrix
// sections of the PTX ISA): D = A B + C of a 16 x 16 A (row-major) and a 16 x 8 B held as rows of n (k
// contiguous), both through ldmatrix.x4 from shared memory as the kernels load them, and B again through
// ldmatrix.x4.trans from rows of k.
TEST_CASE("simt emulator: ldmatrix and mma.sync follow PTX's fragment layouts") {
    float a[16][16], bt[8][16], c[16][8];
    for (int i = 0; i < 16; ++i) {
        for (int k = 0; k < 16; ++k)
            a[i][k] = trainer::bf16_to_float(trainer::float_to_bf16(0.1f * (i - k) + 0.03f * i * k));
    }
    for (int n = 0; n < 8; ++n) {
        for (int k = 0; k < 16; ++k) bt[n][k] = trainer::bf16_to_float(trainer::float_to_bf16(0.2f * n - 0.05f * k));
    }
    for (int i = 0; i < 16; ++i) {
        for (int n = 0; n < 8; ++n) c[i][n] = 0.5f * i - n;
    }
    for (bool trans : {false, true}) {
        INFO((trans ? "B through ldmatrix.x4.trans" : "B through ldmatrix.x4"));
        float d[16][8] = {};
        simt::launch(1, 32, 2 * 16 * 16 * 2 + 16 * 16 * 2, [&] {
            auto* sa = reinterpret_cast<uint16_t*>(simt::dynamic_shared());  // A: 16 rows of 16
            uint16_t* sb = sa + 256;  // B^T: 8 rows of n (k contiguous), padded to 16
            uint16_t* sk = sb + 256;  // B: 16 rows of k (n contiguous), padded to 16
            const unsigned lane = threadIdx.x;
            if (lane == 0) {
                for (int i = 0; i < 16; ++i) {
                    for (int k = 0; k < 16; ++k) sa[i * 16 + k] = trainer::float_to_bf16(a[i][k]);
                }
                for (int n = 0; n < 8; ++n) {
                    for (int k = 0; k < 16; ++k) {
                        sb[n * 16 + k] = trainer::float_to_bf16(bt[n][k]);
                        sk[k * 16 + n] = trainer::float_to_bf16(bt[n][k]);
                    }
                }
            }
            __syncthreads();
            // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
            uint32_t fa[4], fb[4];
            ldmatrix_x4(fa, sa + (lane % 16) * 16 + (lane / 16) * 8);
            if (!trans) {
                // B: matrices (n 0-7, k 0-7), (n 0-7, k 8-15): registers 0 and 1 (2 and 3 repeat them).
                ldmatrix_x4(fb, sb + (lane % 8) * 16 + ((lane / 8) % 2) * 8);
            } else {
                // B^T of rows of k: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), transposed.
                ldmatrix_x4_trans(fb, sk + (lane % 16) * 16);
            }
            const unsigned g = lane / 4, t = lane % 4;
            float acc[4] = {c[g][2 * t], c[g][2 * t + 1], c[g + 8][2 * t], c[g + 8][2 * t + 1]};
            mma(acc, fa, fb[0], fb[1]);
            d[g][2 * t] = acc[0], d[g][2 * t + 1] = acc[1], d[g + 8][2 * t] = acc[2], d[g + 8][2 * t + 1] = acc[3];
        });
        for (int i = 0; i < 16; ++i) {
            for (int n = 0; n < 8; ++n) {
                double ref = c[i][n];
                for (int k = 0; k < 16; ++k) ref += static_cast<double>(a[i][k]) * bt[n][k];
                REQUIRE(std::fabs(d[i][n] - ref) <= 1e-5 * (1 + std::fabs(ref)));
            }
        }
    }
}

TEST_CASE("simt emulator: a cp.async read before the barrier that publishes it reads NaN") {
    // Each thread copies one 16-byte chunk of the input into shared memory, waits for its own copy, then reads its
    // neighbour's chunk: right only with __syncthreads between.
    std::vector<float> in(32 * 4);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i);
    for (bool barrier : {true, false}) {
        std::vector<float> seen(32 * 4, 0.0f);
        simt::launch(1, 32, in.size() * sizeof(float), [&] {
            auto* s = reinterpret_cast<float*>(simt::dynamic_shared());
            const unsigned t = threadIdx.x;
            cp_async16(s + 4 * t, in.data() + 4 * t, true);
            cp_async_commit();
            cp_async_wait<0>();
            if (barrier) __syncthreads();
            const unsigned next = (t + 1) % 32;
            std::memcpy(&seen[4 * t], s + 4 * next, 4 * sizeof(float));
        });
        bool all_right = true;
        for (unsigned t = 0; t < 32; ++t) {
            for (unsigned e = 0; e < 4; ++e) all_right &= seen[4 * t + e] == in[4 * ((t + 1) % 32) + e];
        }
        CHECK(all_right == barrier);
    }
}

TEST_CASE("simt emulator: __all_sync is true only where every lane of the warp votes true") {
    // Two warps: in warp 0 every lane votes true; in warp 1 lane 37 (its sixth) votes false. Each lane records the
    // result, which must be its warp's alone.
    std::vector<int> seen(64, -1);
    simt::launch(1, 64, 0, [&] { seen[threadIdx.x] = __all_sync(0xffffffffu, threadIdx.x != 37); });
    for (unsigned t = 0; t < 64; ++t) CHECK(seen[t] == (t < 32 ? 1 : 0));
    const auto partial = [] { simt::launch(1, 32, 0, [] { (void)__all_sync(0xffffu, 1); }); };
    CHECK_THROWS_WITH(partial(), Catch::Contains("__all_sync with mask 0xffff"));
}

TEST_CASE("simt emulator: reports a divergent barrier a shared address out of range and an unwaited copy") {
    // Lane 0 waits at a barrier while its warp's other lanes wait in a shuffle: neither can go on.
    const auto divergent = [] {
        simt::launch(1, 32, 0, [] {
            if (threadIdx.x == 0) {
                __syncthreads();
            } else {
                (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
            }
        });
    };
    CHECK_THROWS_WITH(divergent(), Catch::Contains("deadlocks") && Catch::Contains("31 in a warp collective"));
    const auto out_of_range = [] {
        simt::launch(2, 32, 256, [] {
            uint32_t r[4];
            ldmatrix_x4(r, simt::dynamic_shared() + 16 * threadIdx.x);  // lanes 16-31 past the 256 bytes
        });
    };
    CHECK_THROWS_WITH(out_of_range(), Catch::Contains("block 0 thread") &&
                                          Catch::Contains("ldmatrix.x4 row at shared offset") &&
                                          Catch::Contains("of 256 bytes"));
    std::vector<uint8_t> src(64 * 16);
    const auto unwaited = [&] {
        simt::launch(1, 64, 64 * 16, [&] {
            cp_async16(simt::dynamic_shared() + 16 * threadIdx.x, src.data() + 16 * threadIdx.x, true);
            cp_async_commit();
        });
    };
    CHECK_THROWS_WITH(unwaited(), Catch::Contains("cp.async copies it never waited for"));
}

TEST_CASE("simt emulator: wgmma flags a missing fence a misaligned descriptor an unwaited group and divergent warps") {
    using namespace trainer::cuda::sm90;
    // One warpgroup: S (64 x 64) = Q K^T over one k-step, Q and K loaded by cp.async at shared offset `at`.
    // `diverge`: 1, warp 2 skips the batch (its rows are not written); 2, warp 3 reads B at the next k-step.
    std::vector<uint16_t> src(64 * 64, trainer::float_to_bf16(0.5f));
    const auto run = [&](uint32_t at, bool fence, bool wait, int diverge = 0) {
        simt::launch(1, 128, 64 * 64 * 2 * 2 + 1024, [&] {
            uint8_t* sq = simt::dynamic_shared() + at;
            uint8_t* sk = sq + 64 * 64 * 2;
            for (int c = static_cast<int>(threadIdx.x); c < 64 * 8; c += 128) {
                cp_async16(sq + tile_offset(64, c / 8, (c % 8) * 8), src.data() + c * 8, true);
                cp_async16(sk + tile_offset(64, c / 8, (c % 8) * 8), src.data() + c * 8, true);
            }
            cp_async_commit();
            cp_async_wait<0>();
            if (fence) fence_proxy_async();
            __syncthreads();
            const int warp = static_cast<int>(threadIdx.x) / 32;
            if (diverge == 1 && warp == 2) return;
            float s[8][4] = {};
            wgmma_fence();
            wgmma_ss<64>(s, k_major(smem_addr(sq), 64, 0), k_major(smem_addr(sk), 64, diverge == 2 && warp == 3),
                         false);
            wgmma_commit();
            if (wait) wgmma_wait<0>();
            if (wait && s[0][0] != 16 * 0.25f) throw std::runtime_error(fmt::format("S[0][0] = {}", s[0][0]));
        });
    };
    CHECK_NOTHROW(run(0, true, true));
    CHECK_THROWS_WITH(run(0, false, true), Catch::Contains("with no fence.proxy.async since"));
    CHECK_THROWS_WITH(run(512, true, true), Catch::Contains("must start on a 1024-byte boundary"));
    CHECK_THROWS_WITH(run(0, true, false), Catch::Contains("wgmma.mma_async operations it never waited for"));
    CHECK_THROWS_WITH(run(0, true, true, 1),
                      Catch::Contains("thread 64 (warp 2) issued nothing as its warpgroup instruction 0, where "
                                      "thread 0 (warp 0) issued wgmma.fence"));
    CHECK_THROWS_WITH(run(0, true, true, 2), Catch::Contains("(warp 3) issued wgmma.mma_async n64") &&
                                                 Catch::Contains("the warpgroup's 128 threads must issue the same"));
}
