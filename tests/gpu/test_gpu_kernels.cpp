// One Catch2 test case per GPU kernel family (gpu_kernels.cu), so a failure names the op; each failed
// check is reported with its shape and first mismatching element.
#include <catch2/catch.hpp>

#include "gpu_kernels.h"
#include "kernels/cuda/ops.h"

namespace {

void check(void (*family)()) {
    const std::vector<std::string> failures = gpu_kernel_tests::run(family);
    constexpr size_t kShown = 20;  // a kernel broken on every shape would otherwise flood the report
    for (size_t i = 0; i < failures.size() && i < kShown; ++i) FAIL_CHECK(failures[i]);
    if (failures.size() > kShown) FAIL_CHECK((failures.size() - kShown) << " more failed checks");
    CHECK(failures.empty());
}

}  // namespace

using namespace gpu_kernel_tests;

TEST_CASE("gpu kernel: the bf16 casts and round_to_bf16 are bitwise the CPU's") { check(test_cast); }
TEST_CASE("gpu kernel: residual_forward and scale_inplace match the CPU") { check(test_residual_and_scale); }
TEST_CASE("gpu kernel: gelu_forward and gelu_backward (erf and tanh; fp32 and bf16) match the CPU") {
    check(test_gelu);
}
TEST_CASE("gpu kernel: swiglu_forward and swiglu_backward (fp32 and bf16) match the CPU") { check(test_swiglu); }
TEST_CASE("gpu kernel: adamw_update and its bf16 copy-out match the CPU") { check(test_adamw); }
TEST_CASE("gpu kernel: squared_norm and sum match the CPU in double and repeat bitwise") { check(test_norms); }
TEST_CASE("gpu kernel: multi-tensor AdamW and squared norm over several ranges match the CPU") {
    check(test_multi_tensor);
}
TEST_CASE("gpu kernel: embedding_forward matches and embedding_backward is bitwise the CPU's") {
    check(test_embedding);
}
TEST_CASE(
    "gpu kernel: layernorm_forward and layernorm_backward from the input and from the output (LayerNorm and RMSNorm) "
    "match the CPU") {
    check(test_layernorm);
}
TEST_CASE("gpu kernel: norm_residual_forward and norm_residual_backward (norm_after; fp32 and bf16) match the CPU") {
    check(test_norm_residual);
}
TEST_CASE("gpu kernel: qk_norm_forward and its in-place backward (QK-norm; fp32 and bf16) match the CPU") {
    check(test_qk_norm);
}
TEST_CASE("gpu kernel: rope_forward and rope_backward (fp32 and bf16) match the CPU") { check(test_rope); }
TEST_CASE("gpu kernel: classifier_forward_backward (fp32 and bf16 logits; z-loss) matches the CPU") {
    check(test_classifier);
}
TEST_CASE("gpu kernel: native attention forward and backward match the CPU") { check(test_attention); }
TEST_CASE("gpu kernel: rope at positions and attention with a KV cache match the CPU") { check(test_kv_cache); }
TEST_CASE("gpu kernel: shared key/value heads expand and reduce as the CPU does") { check(test_kv_heads); }
TEST_CASE("gpu kernel: cuDNN attention forward and backward match the CPU at bf16 tolerance") {
    check(test_attention_cudnn);
}
TEST_CASE("gpu kernel: our flash attention forward and backward match the CPU at bf16 tolerance and repeat bitwise") {
    check(test_attention_flash);
}
TEST_CASE("gpu kernel: our flash attention on 1024 blocks matches the native kernels and repeats bitwise") {
    check(test_attention_flash_large);
}
TEST_CASE("gpu kernel: Hopper's wgmma on a flash forward tile matches the CPU (compute capability 9.0 only)") {
    if (!trainer::cuda::flash_attention_sm90_available()) {
        WARN("skipped: wgmma is sm_90a code, and this device is not compute capability 9.0");
        return;
    }
    check(test_wgmma_tiles);
}
TEST_CASE("gpu kernel: the bias gradient (fp32 and bf16 dout) matches the CPU and repeats bitwise") {
    check(test_bias_gradient);
}
TEST_CASE("gpu kernel: fp32 matmul_forward and matmul_backward match the CPU") { check(test_matmul); }
TEST_CASE("gpu kernel: matmul_forward with a bias at a 4-byte offset and with K = 0") {
    check(test_matmul_unaligned_bias_and_empty_k);
}
TEST_CASE("gpu kernel: matmul_gelu_forward (GELU epilogue and its fallback) matches the CPU") {
    check(test_matmul_gelu);
}
TEST_CASE("gpu kernel: the bf16 backward through the GELU (DGELU epilogue) matches the CPU") {
    check(test_matmul_gelu_backward);
}
TEST_CASE("gpu kernel: bf16 matmul_forward (+ residual) and matmul_backward match the CPU on rounded operands") {
    check(test_matmul_bf16);
}
