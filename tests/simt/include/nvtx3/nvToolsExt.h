// NVTX in the emulated build: no tool attaches to the emulator, so its ranges are no-ops (as NVTX's are without one).
#pragma once

inline int nvtxRangePushA(const char*) { return 0; }
inline int nvtxRangePop() { return 0; }
