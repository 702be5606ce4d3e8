// CPU kernels: the reference every CUDA kernel is tested against, and the CPU backend's fast path.
//
// Every kernel is a template over the element type T (float for training, double for the
// finite-difference tests) and is explicitly instantiated for both in its .cpp file.
// One op family per file, same stem as the CUDA twin: embedding, layernorm, matmul, rope, attention,
// activation, residual, classifier, adamw, norm, cast, nf4, lora; fp8_linear's twin is the CUDA backend's FP8 GEMMs
// (cuBLASLt, with fp8.cu's casts).
//
// Each kernel implements the Backend op of the same name: its contract (shapes in the legend there, what
// accumulates, what is overwritten, what may be null) is written once, in kernels/backend.h. Here, only
// what is particular to the CPU twins: every reduction uses a partition fixed by its sizes (the GEMMs' by the
// partition set at the run's start too), not by the threads running it, so the same inputs give bitwise the same
// outputs on any thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/element.h"

namespace trainer::cpu {

// ---- matmul.cpp: GEMMs through OpenBLAS (cblas_sgemm / cblas_dgemm), row-major. ----
// C(M,N) = alpha * op(A) @ op(B) + beta * C, op = transpose when trans_*; lda/ldb/ldc row strides. The product is
// cut into at most gemm_partition() tiles, fixed by its shape, each one single-threaded BLAS call: the bits
// depend on the shape and the partition, not on how many threads run the tiles.
template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
          T* C, int ldc);
// The partition: configure_threads (kernels/cpu/machine.h) sets it to the run's starting thread count; the thread
// governor leaves it. 1 until set.
void set_gemm_partition(int ways);
int gemm_partition();
template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int M, int K, int N);
template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int M, int K, int N,
                     bool accumulate_dinp);

// ---- lora.cpp: Backend::lora_forward / lora_backward, dropout p with its row keys (nullable where p is 0) and
// adapter id; work: M * (K + 2r) elements. ----
template <typename T>
void lora_forward(T* out, int ld_out, const T* inp, const T* A, const T* B, int M, int K, int r, int n, T scale,
                  float p, const uint64_t* row_keys, uint32_t adapter, T* work);
template <typename T>
void lora_backward(T* dinp, T* dA, T* dB, const T* dout, int ld_dout, const T* inp, const T* A, const T* B, int M,
                   int K, int r, int n, T scale, float p, const uint64_t* row_keys, uint32_t adapter, T* work);

// ---- nf4.cpp: QLoRA's NF4 storage (element.h's format) of a frozen weight. ----
// x (n values) as NF4: codes ((n + 1) / 2 bytes, the first value of a pair in the high nibble) and one absmax a
// block of kNf4Block values (the last block may be partial); and back. A block whose absmax is 0 dequantizes to 0.
void nf4_quantize(uint8_t* codes, float* absmax, const float* x, size_t n);
void nf4_dequantize(float* out, const uint8_t* codes, const float* absmax, size_t n);
inline size_t nf4_blocks(size_t n) { return (n + kNf4Block - 1) / kNf4Block; }
// QLoRA's double quantization (element.h) of n absmaxes: *offset their mean (in double, rounded), codes one byte
// each, absmax2 one fp32 a block of kDoubleQuantBlock; and back.
void double_quantize(uint8_t* codes, float* absmax2, float* offset, const float* absmax, size_t n);
void double_dequantize(float* absmax, const uint8_t* codes, const float* absmax2, float offset, size_t n);
inline size_t double_quant_blocks(size_t n) { return (n + kDoubleQuantBlock - 1) / kDoubleQuantBlock; }
// NF4 with double-quantized absmaxes, dequantized at once: each block's absmax from its code (double_dequantize's
// value), times its values (nf4_dequantize's). offset: one fp32.
void nf4_dequantize_dq(float* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                       const float* offset, size_t n);

// ---- fp8_linear.cpp: precision amp_fp8 on the CPU, the emulation of the GPU's FP8 recipe. ----
// A block Linear's GEMMs read its operands rounded to the OCP formats (kernels/element.h) with per-tensor scales from
// their current amax, dequantized, and accumulate in fp32: e4m3 inputs and weights, e5m2 output gradients; the bias and
// its gradient stay fp32 (the bias gradient from the gradient as it came). The contracts are matmul_forward's and
// matmul_backward's. The rounded copies live in `Fp8Scratch`, reused from call to call.
struct Fp8Scratch {
    std::vector<float> inp, weight, dout;
};
// The largest |x| over n values (NaN where one is NaN).
float fp8_amax(const float* x, size_t n);
// out[i] = fp8_round(x[i] * scale, f) / scale: the values an FP8 GEMM reads, dequantized (out may alias x).
void fp8_quantize_dequantize(float* out, const float* x, size_t n, float scale, Fp8Format f);
void fp8_linear_forward(float* out, const float* inp, const float* weight, const float* bias, int M, int K, int N,
                        Fp8Scratch& s);
void fp8_linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp, Fp8Scratch& s);

// ---- embedding.cpp ----
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int N, int T_, int C);
// Deterministic without atomics: work is partitioned over channels, each thread walks the rows in order.
template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int N, int T_, int C);

// ---- layernorm.cpp: LayerNorm and RMSNorm (rms), as a pre-norm, after a sublayer, and on q and k. ----
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int N, int C, float eps,
                       bool rms);
template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                        const T* rstd, int N, int C, bool rms);
// The backward of a norm without weight or bias from its output (out = the normalised input) and rstd: dinp +=.
template <typename T>
void norm_backward_from_output(T* dinp, const T* dout, const T* out, const T* rstd, int N, int C, bool rms);
template <typename T>
void norm_residual_forward(T* out, const T* resid, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                           int N, int C, float eps, bool rms);
template <typename T>
void norm_residual_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                            const T* rstd, int N, int C, bool rms);
template <typename T>
void qk_norm_forward(T* qkv, T* qk, T* mean, T* rstd, const T* q_weight, const T* q_bias, const T* k_weight,
                     const T* k_bias, int N, int C, int KV, float eps, bool rms);
template <typename T>
void qk_norm_backward(T* dqkv, T* dq_weight, T* dq_bias, T* dk_weight, T* dk_bias, const T* qk, const T* q_weight,
                      const T* k_weight, const T* mean, const T* rstd, int N, int C, int KV, bool rms);

// ---- kv_heads.cpp: grouped-query attention's shared heads (Backend::kv_heads_expand, kv_heads_reduce). ----
template <typename T>
void kv_heads_expand(T* out, const T* inp, int N, int NH, int KVH, int HS);
template <typename T>
void kv_heads_reduce(T* dinp, const T* dout, int N, int NH, int KVH, int HS);

// ---- rope.cpp ----
// For T = float the angles are computed in fp32 as OLMo does.
template <typename T>
void rope_forward(T* qkv, int B, int T_, int NH, int HS, float theta);
// The fp32 inverse frequency of channel pair i, 1 / theta^(2i/HS), as OLMo computes it; position t turns by
// t * it.
float rope_inv_freq_f32(int i, int HS, float theta);
// The fp32 cos/sin tables, (T, HS/2) each, as rope_forward<float> uses them (shared with the CUDA kernels).
void rope_table_f32(float* cos_t, float* sin_t, int T_, int HS, float theta);
template <typename T>
void rope_backward(T* dqkv, int B, int T_, int NH, int HS, float theta);

// ---- attention.cpp: blocked over keys, flash-attention style. ----
template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int T_, int NH, int HS);
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, int T_, int NH,
                        int HS);

// ---- kv_cache.cpp: generation (Backend::rope_forward_at, Backend::attention_with_cache). ----
void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta, int S);
void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                          const int32_t* positions, int N, int NH, int KVH, int HS, int S);

// ---- activation.cpp ----
template <typename T>
void gelu_forward(T* out, const T* inp, size_t n, bool tanh_approx);
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t n, bool tanh_approx);
template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H);
template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int N, int H);

// ---- residual.cpp ----
template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t n);
template <typename T>
void scale_inplace(T* x, size_t n, T s);

// ---- classifier.cpp ----
template <typename T>
void classifier_forward_backward(T* logits, T* losses, const int32_t* targets, int N, int V, T dloss_scale,
                                 bool compute_grad, T z_loss_multiplier, T* z_losses);

// ---- adamw.cpp ----
void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16 = nullptr);

// ---- norm.cpp ----
template <typename T>
double squared_norm(const T* x, size_t n);

// ---- cast.cpp ----
void cast_float_to_bf16(uint16_t* out, const float* in, size_t n);
void cast_bf16_to_float(float* out, const uint16_t* in, size_t n);
void round_to_bf16(float* out, const float* in, size_t n);

}  // namespace trainer::cpu
