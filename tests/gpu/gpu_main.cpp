// The GPU tests' Catch2 main: CTest's skip code (77) where no GPU is usable, or fewer than `--require-gpus N`
// (the [multigpu] cases' entry), so a machine without them reports those cases as skipped, not passed (Catch2
// v2 has no SKIP). The processes the cases start form jobs whose rendezvous secret is TRAINER_STORE_SECRET, set here
// unless the caller set one (as tests/catch_main.cpp does).
#define CATCH_CONFIG_RUNNER
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/backend.h"

int main(int argc, char** argv) {
    int need = 1;
    bool listing = false;  // --list-tests and the like: what the build registers with CTest, GPU or not
    std::vector<char*> args;
    for (int i = 0; i < argc; ++i) {
        if (std::strcmp(argv[i], "--require-gpus") == 0 && i + 1 < argc) {
            need = std::max(1, std::atoi(argv[++i]));
            continue;
        }
        listing |= std::strncmp(argv[i], "--list", 6) == 0;
        args.push_back(argv[i]);
    }
    const int have = trainer::cuda_device_count();
    if (!listing && have < need) {
        std::printf("%d CUDA device(s), %d needed: GPU tests skipped\n", have, need);
        return 77;
    }
    ::setenv("TRAINER_STORE_SECRET", "gpu-tests-job-secret", 0);
    return Catch::Session().run(static_cast<int>(args.size()), args.data());
}
