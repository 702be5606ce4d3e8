// tests/gpu's kernel checks (gpu_kernels.cu) run in the CPU suite: compiled with g++ under TRAINER_SIMT_EMULATION,
// their trainer::cuda calls reach the emulated build of our CUDA kernel files (trainer::simt_cuda, see
// tests/CMakeLists.txt), which tests/simt runs thread by thread on the CPU. So every family of our own kernels is
// checked against its CPU twin on every CPU run, with the same shapes and tolerances as on a GPU; the GPU adds
// the speed, the bits of its own arithmetic, and the kernels of CUDA's libraries.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "simt/cuda_shim.h"

#define cuda simt_cuda
#include "gpu/gpu_kernels.cu"
#undef cuda

namespace {

void check(void (*family)()) {
    simt::set_schedule_seed(1);
    const std::vector<std::string> failures = gpu_kernel_tests::run(family);
    constexpr size_t kShown = 20;
    for (size_t i = 0; i < failures.size() && i < kShown; ++i) FAIL_CHECK(failures[i]);
    if (failures.size() > kShown) FAIL_CHECK((failures.size() - kShown) << " more failed checks");
    CHECK(failures.empty());
}

}  // namespace

using namespace gpu_kernel_tests;

TEST_CASE("emulated kernel: the bf16 casts and round_to_bf16 are bitwise the CPU's") { check(test_cast); }
TEST_CASE("emulated kernel: residual_forward and scale_inplace match the CPU") { check(test_residual_and_scale); }
TEST_CASE("emulated kernel: gelu and swiglu forward and backward match the CPU") {
    check(test_gelu);
    check(test_swiglu);
}
TEST_CASE("emulated kernel: adamw_update and the multi-tensor AdamW and squared norm match the CPU") {
    check(test_adamw);
    check(test_multi_tensor);
    check(test_norms);
}
TEST_CASE("emulated kernel: layernorm and rmsnorm forward and backward and from the output match the CPU") {
    check(test_layernorm);
}
TEST_CASE("emulated kernel: the norm after a sublayer and QK-norm match the CPU") {
    check(test_norm_residual);
    check(test_qk_norm);
}
TEST_CASE("emulated kernel: rope and the classifier (with the z-loss) match the CPU") {
    check(test_rope);
    check(test_classifier);
}
TEST_CASE("emulated kernel: the native attention matches the CPU", "[heavy]") { check(test_attention); }
TEST_CASE("emulated kernel: rope at positions and attention with a KV cache match the CPU") { check(test_kv_cache); }
TEST_CASE("emulated kernel: shared key/value heads expand and reduce as the CPU does") { check(test_kv_heads); }
TEST_CASE("emulated kernel: Hopper's wgmma on a flash forward tile matches the CPU") { check(test_wgmma_tiles); }
TEST_CASE("emulated kernel: the bias gradient matches the CPU and repeats bitwise") { check(test_bias_gradient); }
