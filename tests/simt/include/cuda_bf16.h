// cuda_bf16.h in the emulated build: the bf16 types come with the emulator's CUDA names (tests/simt/cuda_shim.h).
#pragma once

#include "simt/cuda_shim.h"
