// The CUDA runtime's header in the emulated build: the emulated runtime (tests/simt/cuda_runtime_api.h).
#pragma once

#include "simt/cuda_runtime_api.h"
