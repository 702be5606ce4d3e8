// Shared by the fuzz targets (libFuzzer; dev/fuzz.sh builds and runs them): the input written to a
// file (the readers under test take paths, as the trainer's callers give them), and the rule that the only
// exception a reader may throw on bad input is the trainer's UserError: anything else escapes
// LLVMFuzzerTestOneInput and libFuzzer reports it as a crash, as it reports sanitizer findings.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/config.h"

namespace fuzz {

// The input with its runs expanded: the byte 0xF5 (never valid in UTF-8) followed by a count byte c and a
// byte b stands for b repeated 256 * c + c times (up to 65535). libFuzzer keeps inputs small (4 KB by
// default); this lets a few bytes become the 100,000-deep nesting or the long letter run that breaks a
// reader, which no small input reaches.
inline std::string expand(const uint8_t* data, size_t size) {
    std::string out;
    for (size_t i = 0; i < size; ++i) {
        if (data[i] == 0xF5 && i + 2 < size) {
            out.append(257u * data[i + 1], static_cast<char>(data[i + 2]));
            i += 2;
        } else {
            out += static_cast<char>(data[i]);
        }
    }
    return out;
}

// Every JSON document a reader accepts is later written somewhere (a checkpoint, a message, show-config):
// it must dump without an exception (nlohmann throws on a string that is not UTF-8) and without running
// out of stack (its dump recurses per level).
inline void check_dumps(const trainer::Json& doc) { (void)doc.dump(); }

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
inline std::string as_file(const std::string& data, const std::string& suffix) {
    return as_file(reinterpret_cast<const uint8_t*>(data.data()), data.size(), suffix);
}

// A byte-level tokenizer for the targets that tokenize text: each byte its own id (0-255).
inline std::vector<int32_t> byte_ids(const std::string& s) {
    std::vector<int32_t> ids;
    for (const char c : s) ids.push_back(static_cast<unsigned char>(c));
    return ids;
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
