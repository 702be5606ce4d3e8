// tests/gpu's kernel checks (gpu_kernels.cu) run in the CPU suite, a case for each family of its list of our own
// kernels (gpu_kernels.cu): compiled with g++ under TRAINER_SIMT_EMULATION,
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

#ifdef TRAINER_SIMT_DEVICE
// The emulated build (TRAINER_CUDA=EMULATED): the trainer's own CUDA kernels are the emulated ones.
#include "gpu/gpu_kernels.cu"
#else
#define cuda simt_cuda
#include "gpu/gpu_kernels.cu"
#undef cuda
#endif

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

#define TRAINER_EMULATED_KERNEL_CASE(function, what, tags) \
    TEST_CASE("emulated kernel: " what, tags) { check(gpu_kernel_tests::function); }
TRAINER_OWN_KERNEL_FAMILIES(TRAINER_EMULATED_KERNEL_CASE)
#ifdef TRAINER_SIMT_DEVICE
// The emulated build: the kernel files that call cuBLASLt and CUB run too, against the emulator's stand-ins.
#define TRAINER_EMULATED_LIBRARY_CASE(function, what, tags) \
    TEST_CASE("emulated library: " what, tags) { check(gpu_kernel_tests::function); }
TRAINER_LIBRARY_KERNEL_FAMILIES(TRAINER_EMULATED_LIBRARY_CASE)
#endif
