// What the rest of the CUDA code (the NCCL communicator) needs from a CUDA backend: its compute stream
// and device. Both refuse a backend that is not the CUDA one.
#pragma once

#include <cuda_runtime.h>

namespace trainer {
class Backend;
namespace cuda {

cudaStream_t backend_stream(Backend* backend);
int backend_device(Backend* backend);

}  // namespace cuda
}  // namespace trainer
