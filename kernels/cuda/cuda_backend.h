// What the rest of the CUDA code (the NCCL communicator) needs from a CUDA backend: its compute stream,
// device and activity timeline (timeline.h). All refuse a backend that is not the CUDA one.
#pragma once

#include <cuda_runtime.h>

namespace trainer {
class Backend;
namespace cuda {

cudaStream_t backend_stream(Backend* backend);
int backend_device(Backend* backend);
class Timeline;
Timeline& backend_timeline(Backend* backend);

}  // namespace cuda
}  // namespace trainer
