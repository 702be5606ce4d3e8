// Errors and invariants shared by every part of the trainer.
//
// Two kinds of failure, kept apart on purpose:
//  * UserError: bad input from the person running the trainer (config, CLI flag, data file,
//    checkpoint). The message names the key, file or value and what is allowed; `main` prints it
//    as one `error: ...` line and exits non-zero, with no stack trace.
//  * TRAINER_CHECK: an internal invariant. Stays on in release builds and reports file:line, as
//    ggml's GGML_ASSERT; a failure is a bug in the trainer, not in the input.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace trainer {

// Bad input from the user: the message is complete and printed as `error: <message>`.
class UserError : public std::runtime_error {
   public:
    explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
};

// A violated internal invariant (a bug): the message carries file:line.
class InternalError : public std::logic_error {
   public:
    explicit InternalError(const std::string& msg) : std::logic_error(msg) {}
};

// Seconds elapsed on the monotonic clock since t0.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename... Args>
[[noreturn]] inline void user_error(fmt::format_string<Args...> f, Args&&... args) {
    throw UserError(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace trainer

#define TRAINER_CHECK(cond, ...)                                                                                   \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            throw ::trainer::InternalError(fmt::format("internal error at {}:{}: check `{}` failed: {}", __FILE__, \
                                                       __LINE__, #cond, fmt::format(__VA_ARGS__)));                \
        }                                                                                                          \
    } while (0)
