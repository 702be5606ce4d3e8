// The GPU tests' Catch2 main: CTest's skip code (77) where no GPU is usable, so a CPU machine reports the
// suite as skipped, not passed (Catch2 v2 has no SKIP).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>

#include "kernels/backend.h"

int main(int argc, char** argv) {
    if (trainer::cuda_device_count() == 0) {
        std::printf("no CUDA device: GPU tests skipped\n");
        return 77;
    }
    return Catch::Session().run(argc, argv);
}
