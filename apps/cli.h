// What the command line's files share (apps/trainer.cpp, apps/data_commands.cpp): a subcommand's type, the
// checks its flags use, and the subcommands declared outside trainer.cpp.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include "base/choices.h"
#include "base/common.h"

namespace trainer::cli {

// A positive number (CLI11's PositiveNumber states its bound as the 309 digits of the largest double).
inline const CLI::Validator kPositive(
    [](std::string& text) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !(x > 0) || !std::isfinite(x)) return "expected a positive number";
        return "";
    },
    "POSITIVE");

// A whole number >= 0 (CLI11's NonNegativeNumber states its bound as PositiveNumber does).
inline const CLI::Validator kNonNegativeInt(
    [](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long x = std::strtoll(text.c_str(), &end, 10);
        if (end == text.c_str() || *end != '\0' || errno != 0 || x < 0) return "expected a whole number >= 0";
        return "";
    },
    "NONNEGATIVE");

// A subcommand: its options are declared on its CLI::App when it is added, and `run` does its work once the
// command line is parsed.
using Run = std::function<int()>;

// A choice flag's value as its enum; CLI::IsMember over the same names has checked the spelling.
template <typename E>
E flag_choice(const std::string& name) {
    const std::optional<E> e = trainer::parse_choice<E>(name);
    TRAINER_CHECK(e.has_value(), "flag value {} is none of its enum's names", name);
    return *e;
}

// The BPE tokenizer's folder flag, shared by prepare-data, tokenize, detokenize and generate.
void add_tokenizer_dir(CLI::App* cmd, std::string& dir);

// prepare-data, tokenize and detokenize (apps/data_commands.cpp).
Run add_prepare_data(CLI::App& app);
Run add_tokenize(CLI::App& app);
Run add_detokenize(CLI::App& app);

}  // namespace trainer::cli
