// One check for every call into a CUDA library (the runtime, cuBLASLt, cuDNN, NCCL): a status other than
// success throws InternalError naming the call, the file and line, and the library's own message. Each
// library's status type brings two overloads, declared where its header is included: succeeded(status) and
// status_message(status) (the runtime's in common.cuh, cuBLASLt's in matmul.cu, cuDNN's in attention_cudnn.cu,
// NCCL's in parallel/nccl_communicator.cu).
#pragma once

#include <string>

namespace trainer::cuda {

// Throws InternalError "CUDA library error at <file>:<line>: <call>: <message>".
[[noreturn]] void throw_library_error(const char* call, const char* file, int line, const std::string& message);

}  // namespace trainer::cuda

#define TRAINER_CUDA_CHECK(stmt)                                                                                       \
    do {                                                                                                               \
        const auto status_ = (stmt);                                                                                   \
        if (!::trainer::cuda::succeeded(status_)) {                                                                    \
            ::trainer::cuda::throw_library_error(#stmt, __FILE__, __LINE__, ::trainer::cuda::status_message(status_)); \
        }                                                                                                              \
    } while (0)

// A library failure that is not a status (no algorithm for a shape, a fault while recording a graph).
#define TRAINER_CUDA_FAIL(call, message) ::trainer::cuda::throw_library_error(call, __FILE__, __LINE__, message)
