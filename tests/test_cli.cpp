// The command line's own flags: trainer --version, and the help's list of a choice flag's values.
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

TEST_CASE("cli: trainer --version names the version and commit and build and each library built with and found") {
    const auto r = test_util::run_trainer({"--version"});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<std::string> lines;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
#if defined(TRAINER_HAVE_CUDA) && !defined(TRAINER_SIMT_DEVICE)
    REQUIRE(lines.size() == 7);
#else
    REQUIRE(lines.size() == 6);
#endif
    CHECK_THAT(lines[0], StartsWith("trainer 0."));
    CHECK_THAT(lines[1], StartsWith("commit: "));
    CHECK(lines[1].size() > 20);  // a hash of 40 digits, or why there is none
    CHECK_THAT(lines[2], StartsWith("build: ") && Contains("C++17"));
    CHECK_THAT(lines[3], StartsWith("OpenBLAS: 0."));
#if defined(TRAINER_SIMT_DEVICE)  // the emulated build (tests/simt)
    CHECK_THAT(lines[2], Contains("CUDA parts emulated on the CPU"));
    CHECK_THAT(lines[4], StartsWith("CUDA: none; an emulated build"));
    CHECK_THAT(lines[5], StartsWith("NCCL: none; an emulated build"));
#elif defined(TRAINER_HAVE_CUDA)
    CHECK_THAT(lines[2], Contains("CUDA parts built"));
    CHECK_THAT(lines[4], StartsWith("CUDA: built with ") && Contains("runtime") && Contains("driver"));
    CHECK_THAT(lines[5], StartsWith("cuDNN: built with ") && Contains("loaded"));
    CHECK_THAT(lines[6], StartsWith("NCCL: built with ") && Contains("loaded"));
#else
    CHECK_THAT(lines[2], Contains("CUDA parts not built"));
    CHECK_THAT(lines[4], StartsWith("CUDA: none"));
    CHECK_THAT(lines[5], StartsWith("NCCL: none"));
#endif
}

TEST_CASE("cli: a choice flag's help lists every value its config key takes") {
    const auto r = test_util::run_trainer({"--help"});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("fp32 | amp_bf16 | amp_fp8 (config: precision)"));
    CHECK_THAT(r.out, Contains("single | ddp | fsdp | auto; auto lets the plan choose (config: distributed_strategy)"));
    CHECK_THAT(r.out,
               Contains("FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD (config: fsdp.sharding_strategy)"));
    CHECK_THAT(r.out, Contains("auto | cpu | cuda (config: device)"));
}
