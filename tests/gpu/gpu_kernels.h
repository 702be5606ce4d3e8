// The GPU kernel checks (gpu_kernels.cu): each family compares CUDA kernels with their CPU twins over odd
// shapes; run() returns its failures, each naming the op, the shape and the first mismatching element.
#pragma once

#include <string>
#include <vector>

namespace gpu_kernel_tests {

void test_cast();
void test_residual_and_scale();
void test_gelu();
void test_swiglu();
void test_adamw();
void test_norms();
void test_multi_tensor();
void test_embedding();
void test_layernorm();
void test_norm_residual();
void test_qk_norm();
void test_rope();
void test_classifier();
void test_attention();
void test_kv_cache();
void test_kv_heads();
void test_bias_gradient();
void test_wgmma_tiles();
void test_attention_cudnn();
void test_attention_flash();
void test_attention_flash_large();
void test_matmul();
void test_matmul_unaligned_bias_and_empty_k();
void test_matmul_gelu();
void test_matmul_gelu_backward();
void test_matmul_bf16();

// Runs one family; its failures (empty when every check passed), then any CUDA error it left behind.
std::vector<std::string> run(void (*family)());

}  // namespace gpu_kernel_tests
