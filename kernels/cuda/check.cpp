// The CUDA libraries' failures (see check.h).
#include "kernels/cuda/check.h"

#include "base/common.h"

namespace trainer::cuda {

void throw_library_error(const char* call, const char* file, int line, const std::string& message) {
    throw InternalError(fmt::format("CUDA library error at {}:{}: {}: {}", file, line, call, message));
}

}  // namespace trainer::cuda
