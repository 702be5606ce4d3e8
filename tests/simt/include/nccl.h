// NCCL in the emulated build: a communicator of one rank (world size 1), whose collectives are copies queued on
// the caller's stream. A communicator of more ranks is refused (ncclInvalidUsage, with the reason as NCCL's last
// error): ranks that share an emulated GPU run over staged Gloo, as ranks sharing a real one do.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 0

enum ncclResult_t {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
enum ncclDataType_t { ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };
enum ncclRedOp_t { ncclSum = 0 };
struct ncclUniqueId {
    char internal[128];
};
struct ncclConfig_t {
    int blocking;
};
#define NCCL_CONFIG_INITIALIZER \
    { 1 }
struct ncclComm {
    int nranks = 1;
};
using ncclComm_t = ncclComm*;

namespace simt::nccl {
inline const char*& last_error() {
    static const char* text = "";
    return text;
}
inline size_t bytes_of(ncclDataType_t t) { return t == ncclFloat64 ? 8 : t == ncclBfloat16 ? 2 : 4; }
inline ncclResult_t copy(const void* in, void* out, size_t bytes, ncclComm_t comm, cudaStream_t stream) {
    if (comm == nullptr) return ncclInvalidArgument;
    if (in == out || bytes == 0) return ncclSuccess;
    return cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream) == cudaSuccess ? ncclSuccess
                                                                                            : ncclUnhandledCudaError;
}
}  // namespace simt::nccl

inline ncclResult_t ncclGetVersion(int* version) {
    *version = NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH;
    return ncclSuccess;
}
inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    std::memset(id->internal, 0, sizeof id->internal);
    std::memcpy(id->internal, "simt-nccl", 9);
    return ncclSuccess;
}
inline ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int rank, ncclConfig_t*) {
    *comm = nullptr;
    if (nranks != 1 || rank != 0) {
        simt::nccl::last_error() = "the emulator's NCCL runs one rank; ranks that share an emulated GPU use gloo";
        return ncclInvalidUsage;
    }
    *comm = new ncclComm;
    return ncclSuccess;
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
    if (comm == nullptr) return ncclInvalidArgument;
    *state = ncclSuccess;
    return ncclSuccess;
}
inline ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm != nullptr ? ncclSuccess : ncclInvalidArgument; }
inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    delete comm;
    return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
    delete comm;
    return ncclSuccess;
}
inline const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
        case ncclSuccess:
            return "no error";
        case ncclInvalidArgument:
            return "invalid argument";
        case ncclInvalidUsage:
            return "invalid usage";
        case ncclInProgress:
            return "NCCL operation in progress";
        default:
            return "unhandled error";
    }
}
inline const char* ncclGetLastError(ncclComm_t) { return simt::nccl::last_error(); }
inline ncclResult_t ncclAllReduce(const void* in, void* out, size_t count, ncclDataType_t t, ncclRedOp_t,
                                  ncclComm_t comm, cudaStream_t stream) {
    return simt::nccl::copy(in, out, count * simt::nccl::bytes_of(t), comm, stream);
}
inline ncclResult_t ncclReduceScatter(const void* in, void* out, size_t count, ncclDataType_t t, ncclRedOp_t,
                                      ncclComm_t comm, cudaStream_t stream) {
    return simt::nccl::copy(in, out, count * simt::nccl::bytes_of(t), comm, stream);
}
inline ncclResult_t ncclAllGather(const void* in, void* out, size_t count, ncclDataType_t t, ncclComm_t comm,
                                  cudaStream_t stream) {
    return simt::nccl::copy(in, out, count * simt::nccl::bytes_of(t), comm, stream);
}
inline ncclResult_t ncclBroadcast(const void* in, void* out, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
    if (root != 0) return ncclInvalidArgument;
    return simt::nccl::copy(in, out, count * simt::nccl::bytes_of(t), comm, stream);
}
