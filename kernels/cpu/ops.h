// CPU kernels: the reference every CUDA kernel is tested against, and the CPU backend's fast path.
//
// Every kernel is a template over the element type T (float for training, double for the
// finite-difference tests) and is explicitly instantiated for both in its .cpp file.
// One op family per file, same stem as the CUDA twin: embedding, layernorm, matmul, rope, attention,
// activation, residual, classifier, adamw, norm, cast.
//
// Shape legend: B batch, T sequence length, C model width (d_model), NH heads, HS head size (C/NH),
// H MLP hidden width (after the activation), V vocabulary rows (embedding_size), N = B*T rows,
// M/K generic GEMM sizes.
//
// Conventions (llm.c's): parameter gradients ACCUMULATE (+=) so micro-batches sum; activation
// gradients are OVERWRITTEN unless a kernel says otherwise. Pointers marked "nullable" may be null.
// Kernels are deterministic: the same inputs and thread count give bitwise the same outputs, and no
// result depends on floating-point atomics or on scheduling (reductions use fixed partitions).
#pragma once

#include <cstddef>
#include <cstdint>

namespace trainer::cpu {

// ---- matmul.cpp: GEMMs through OpenBLAS (cblas_sgemm / cblas_dgemm), row-major. ----
// C(M,N) = alpha * op(A) @ op(B) + beta * C, op = transpose when trans_*; lda/ldb/ldc row strides.
template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
          T* C, int ldc);
// PyTorch Linear: out(M,N) = inp(M,K) @ weight(N,K)^T + bias(N); bias nullable. out overwritten.
template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int M, int K, int N);
// dinp(M,K) = dout(M,N) @ weight(N,K)  (+= when accumulate_dinp); dinp nullable (skipped).
// dweight(N,K) += dout^T @ inp; dbias(N) += column sums of dout (nullable).
template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int M, int K, int N,
                     bool accumulate_dinp);

// ---- embedding.cpp ----
// out(N,C) = wte[tokens[n]] + wpe[n % T] (wpe nullable: RoPE models have no learned positions).
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int N, int T_, int C);
// dwte[tokens[n]] += dout[n]; dwpe[n % T] += dout[n] (nullable). Deterministic without atomics:
// work is partitioned over channels, each thread walks the rows in order.
template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int N, int T_, int C);

// ---- layernorm.cpp ----
// out(N,C) = (inp - mean) * rstd * weight + bias; weight and bias nullable (OLMo's non-parametric
// LayerNorm has neither; GPT-2's has both). mean(N), rstd(N) = 1/sqrt(var + eps) saved for backward;
// var is the biased variance, as torch.nn.functional.layer_norm.
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int N, int C, float eps);
// dinp(N,C) += (ACCUMULATES: the input is the residual stream, whose gradient also flows around the
// norm); dweight(C) += and dbias(C) += (both nullable, and null when weight/bias are).
template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                        const T* rstd, int N, int C);

// ---- rope.cpp: rotary embeddings, non-interleaved ("rotate_half"), as OLMo/HF Llama. ----
// qkv(B,T,3C) holds q | k | v, each (NH,HS). Rotates q and k in place at positions t = 0..T-1:
// inv_freq[i] = 1 / theta^(2i/HS), angle = t * inv_freq[i] (i < HS/2), for each head:
// y[i] = x[i] cos - x[i+HS/2] sin;  y[i+HS/2] = x[i+HS/2] cos + x[i] sin. v is untouched.
// For T = float the angles are computed in fp32 as OLMo does.
template <typename T>
void rope_forward(T* qkv, int B, int T_, int NH, int HS, float theta);
// The fp32 cos/sin tables, (T, HS/2) each, as rope_forward<float> uses them (shared with the CUDA kernels).
void rope_table_f32(float* cos_t, float* sin_t, int T_, int HS, float theta);
// In place on dqkv: applies the transpose (inverse) rotation to the dq and dk parts; dv untouched.
template <typename T>
void rope_backward(T* dqkv, int B, int T_, int NH, int HS, float theta);

// ---- attention.cpp: causal scaled-dot-product attention, scale 1/sqrt(HS). ----
// out(B,T,C) (heads concatenated, head h at channels [h*HS, (h+1)*HS)); lse(B,NH,T) the
// log-sum-exp of each query's scaled scores, saved so backward recomputes probabilities without a
// T x T matrix (flash-attention style; blocked over keys, nothing of size T x T is stored).
template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int T_, int NH, int HS);
// dqkv(B,T,3C) overwritten with d(q|k|v). Needs the forward's out and lse.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, int T_, int NH,
                        int HS);

// ---- activation.cpp ----
// out(n) = gelu(inp), exact erf form or tanh approximation (gelu_tanh). In-place (out == inp) allowed.
template <typename T>
void gelu_forward(T* out, const T* inp, size_t n, bool tanh_approx);
// dinp(n) = dout * gelu'(inp), overwritten; dinp == dout allowed.
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t n, bool tanh_approx);
// inp(N, 2H): columns [0,H) are x, [H,2H) the gate g (OLMo's ff_proj(x).chunk(2)); out(N,H) = silu(g) * x.
template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H);
// dinp(N,2H) overwritten from dout(N,H).
template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int N, int H);

// ---- residual.cpp ----
// out(n) = a + b (out may alias a or b).
template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t n);
// x(n) *= s.
template <typename T>
void scale_inplace(T* x, size_t n, T s);

// ---- classifier.cpp: fused softmax + cross-entropy + dlogits, one pass over each row. ----
// logits(N,V) in. losses(N) = logsumexp(row) - row[target] (natural log). When compute_grad, the
// row is overwritten in place with dlogits = (softmax(row) - onehot(target)) * dloss_scale, where
// dloss_scale is d(total loss)/d(loss of this row), e.g. 1/(tokens in the batch).
// A target < 0 is ignored: loss 0 and a zero gradient row. Softmax spans all V columns (OLMo computes
// cross-entropy over the padded embedding_size).
template <typename T>
void classifier_forward_backward(T* logits, T* losses, const int32_t* targets, int N, int V, T dloss_scale,
                                 bool compute_grad);

// ---- adamw.cpp ----
// One AdamW step over a flat range (PyTorch semantics, see element.h adamw_element) on grad * grad_scale
// (grad_scale carries the clipping coefficient). step is 1-based. param_bf16 (nullable) receives the
// updated parameters rounded to bf16 in the same pass (the copy a mixed-precision strategy gathers).
void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16 = nullptr);

// ---- norm.cpp ----
// sum of x[i]^2 accumulated in double over fixed partitions (deterministic for a thread count).
template <typename T>
double squared_norm(const T* x, size_t n);

// ---- cast.cpp ----
void cast_float_to_bf16(uint16_t* out, const float* in, size_t n);
void cast_bf16_to_float(float* out, const uint16_t* in, size_t n);

}  // namespace trainer::cpu
