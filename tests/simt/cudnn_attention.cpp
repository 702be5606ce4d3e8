// The emulated build's CudnnAttention (in place of kernels/cuda/attention_cudnn.cu): cuDNN's fused attention is a
// library the emulator does not reproduce, so kernels.attention=cudnn is refused by name when the backend starts;
// our own kernels (native, flash) run emulated.
#include "base/common.h"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {

struct CudnnAttention::State {};

CudnnAttention::CudnnAttention() : s_(nullptr) {
    user_error(
        "kernels.attention \"cudnn\": cuDNN's fused attention does not run on the CPU emulator of tests/simt (an "
        "emulated build); use kernels.attention=native or flash");
}
CudnnAttention::~CudnnAttention() = default;

void CudnnAttention::forward(uint16_t*, float*, const uint16_t*, int, int, int, int, const Workspace&, cudaStream_t) {
    TRAINER_CHECK(false, "CudnnAttention is not emulated");
}
void CudnnAttention::backward(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, const float*, int, int, int,
                              int, const Workspace&, cudaStream_t) {
    TRAINER_CHECK(false, "CudnnAttention is not emulated");
}

}  // namespace trainer::cuda
