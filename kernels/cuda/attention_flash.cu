// Our flash attention (kernels.attention=flash): the kernels are in attention_flash.cuh; the CPU suite compiles
// this file onto its emulator too (tests/test_flash_emulated.cpp).
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {

bool flash_attention_supported(int HS) { return flash_supported(HS); }

size_t flash_attention_backward_scratch_bytes(int B, int T, int NH, int HS) {
    (void)HS;
    return flash_backward_scratch_bytes(B, T, NH);
}

void flash_attention_forward(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                             cudaStream_t stream) {
    flash_forward(out, lse, qkv, B, T, NH, HS, stream);
}

void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream) {
    flash_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS, scratch, stream);
}

}  // namespace trainer::cuda
