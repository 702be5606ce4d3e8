// cuDNN in the emulated build: its version only. Its fused attention is not emulated: the emulated build's
// CudnnAttention (tests/simt/cudnn_attention.cpp) refuses kernels.attention=cudnn by name.
#pragma once

#include <cstddef>

#define CUDNN_MAJOR 0
#define CUDNN_MINOR 0
#define CUDNN_PATCHLEVEL 0

inline size_t cudnnGetVersion() { return 0; }
