// Shared by the fuzz targets (libFuzzer; scripts/fuzz.sh builds and runs them): the input written to a
// file (the readers under test take paths, as the trainer's callers give them), and the rule that the only
// exception a reader may throw on bad input is the trainer's UserError: anything else escapes
// LLVMFuzzerTestOneInput and libFuzzer reports it as a crash, as it reports sanitizer findings.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "base/common.h"

namespace fuzz {

// A per-process file holding `data` (rewritten every call), named with `suffix`.
inline std::string as_file(const uint8_t* data, size_t size, const std::string& suffix) {
    static const std::string dir = [] {
        const char* tmp = std::getenv("TMPDIR");
        return std::string(tmp && *tmp ? tmp : "/tmp");
    }();
    const std::string path = dir + "/trainer_fuzz_" + std::to_string(::getpid()) + suffix;
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) std::abort();
    if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
    return path;
}

// Runs fn; a UserError (the refusal of bad input, with its message) is the expected outcome.
template <typename F>
void expect_user_errors_only(F&& fn) {
    try {
        fn();
    } catch (const trainer::UserError&) {
    }
}

}  // namespace fuzz
