// CUDA kernels' launchers: the same signatures as their CPU twins in kernels/cpu/ops.h, on device
// pointers, queued on `stream`; each op's contract is the Backend's (kernels/backend.h). The CUDA backend
// (kernels/cuda/*) grows one op family per file with the same stem as the CPU file; each launch is checked.
// An op has one name whatever its storage: its overloads differ by the type of each buffer, float* for fp32 and
// uint16_t* for bf16 bits (so `gelu_forward(uint16_t* out, const float* inp, ...)` rounds its output to bf16, and
// `matmul_forward(Gemm&, float* out, const uint16_t* inp, ...)` reads bf16 operands), never by a suffix.
#pragma once

#ifndef TRAINER_SIMT_EMULATION  // the CPU suite compiles the kernels onto an emulator (tests/simt/cuda_shim.h)
#include <cuda_runtime.h>
#endif

#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/element.h"

namespace trainer::cuda {

// fp32 GEMMs through cuBLASLt (TF32 off): a handle, a preallocated workspace and the heuristic's
// algorithm cached per shape (matmul.cu). Row-major: C(M,N) = alpha op(A) op(B) + beta C, plus an
// optional bias(N) added to every row by the epilogue.
class Gemm {
   public:
    explicit Gemm(size_t workspace_bytes = size_t(32) << 20);
    ~Gemm();
    Gemm(const Gemm&) = delete;
    Gemm& operator=(const Gemm&) = delete;
    void run(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
             int ldb, float beta, float* C, int ldc, const float* bias, cudaStream_t stream);
    // C(M, N) = A(M, K) @ B(N, K)^T in bf16 (fp32 accumulation, rounded once): the Linear forward writing a
    // bf16 activation. False (nothing queued) where cuBLASLt has no such kernel or K is 0: the caller takes the
    // fp32 output and rounds it.
    // Any layout (trans_a / trans_b and leading dimensions as run()), beta 0; bias(N) (nullable) in bf16, as
    // cuBLASLt's epilogue adds it to a bf16 output (autocast's Linear rounds its bias to bf16 alike), 16-byte
    // aligned (else false).
    bool run_bf16_out(bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A, int lda, const uint16_t* B,
                      int ldb, uint16_t* C, int ldc, const uint16_t* bias, cudaStream_t stream);
    // The same with bf16 A and B, fp32 accumulation and an fp32 C (amp_bf16).
    void run_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const uint16_t* A, int lda,
                  const uint16_t* B, int ldb, float beta, float* C, int ldc, const float* bias, cudaStream_t stream);

    // C(M, N) = resid + A(M, K) @ B(N, K)^T + bias (nullable) from bf16 A and B, in fp32 (the epilogue adds
    // resid, beta 1; C may alias resid). False, nothing queued, where cuBLASLt has no such kernel or K is 0.
    bool run_bf16_residual(int M, int N, int K, const uint16_t* A, const uint16_t* B, const float* resid, float* C,
                           const float* bias, cudaStream_t stream);
    // out(M, N) = gelu_tanh(pre), pre = A(M, K) @ B(N, K)^T + bias, through cuBLASLt's GELU_AUX(_BIAS)
    // epilogue (A and B of ab_type: CUDA_R_32F or CUDA_R_16BF); only where gelu_fusable holds.
    static bool gelu_fusable(int N, const void* out, const void* pre, const void* bias);
    // False (nothing queued) where cuBLASLt has no fused kernel for it: the caller runs the two ops.
    // run_gelu_bf16: bf16 A, B, out, pre and bias (the bf16 forms of all five).
    bool run_gelu_bf16(int M, int N, int K, const uint16_t* A, const uint16_t* B, uint16_t* out, uint16_t* pre,
                       const uint16_t* bias, cudaStream_t stream);
    bool run_gelu(int M, int N, int K, const void* A, const void* B, cudaDataType_t ab_type, float* out, float* pre,
                  const float* bias, cudaStream_t stream);
    // C(M, N) = (op(A) @ op(B)) * gelu_tanh'(pre) in bf16 (fp32 accumulation, rounded once), layouts as run(), beta
    // 0, through cuBLASLt's DGELU epilogue: a Linear's input gradient carried through the GELU before it, `pre` the
    // GELU's input (M x N bf16, leading dimension ldc, as GELU_AUX writes it). Only where gelu_fusable(N, C, pre,
    // nullptr) holds; false (nothing queued) where cuBLASLt has no such kernel or K is 0.
    bool run_dgelu_bf16(bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A, int lda, const uint16_t* B,
                        int ldb, uint16_t* C, int ldc, const uint16_t* pre, cudaStream_t stream);

    // amp_fp8: C(M, N) = (A(M, K) @ B(N, K)^T) x *A.descale x *B.descale, + beta C (or + c_in: beta 1 from c_in
    // into C, fp32 C only), + bias(N) (nullable), from FP8 codes in cuBLASLt's FP8 layout (both operands
    // K-contiguous, not both e5m2), fp32 accumulation. C fp32 (c_bf16 false; an fp32 bias, added by a pass of its
    // own) or bf16 (beta 0; a bf16 bias, 16-byte aligned, from the epilogue). False, nothing queued, where cuBLASLt
    // has no FP8 kernel for it: a GPU below compute capability 8.9, N or K not a multiple of 16, ...
    struct Fp8Matrix {
        const uint8_t* codes;
        Fp8Format format;
        const float* descale;  // device
    };
    bool run_fp8(int M, int N, int K, Fp8Matrix A, Fp8Matrix B, float beta, void* C, bool c_bf16, const void* bias,
                 const float* c_in, cudaStream_t stream);

   private:
    // FP8 operands: B's element type (A's is run_typed's ab_type) and both descales (device).
    struct Fp8Scales {
        cudaDataType_t b_type;
        const float* a_descale;
        const float* b_descale;
    };
    // gelu_aux: GELU_AUX(_BIAS)'s output (the pre-activation), or with gelu_grad DGELU's input.
    bool run_typed(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, int lda, const void* B,
                   int ldb, cudaDataType_t ab_type, float beta, void* C, cudaDataType_t c_type, int ldc,
                   const void* bias, void* gelu_aux, cudaStream_t stream, const float* c_in, bool gelu_grad = false,
                   const Fp8Scales* fp8 = nullptr);
    struct State;
    State* s_;
};
// PyTorch Linear, as cpu::matmul_forward / matmul_backward: out = inp @ weight^T + bias; dinp (+)=
// dout @ weight, dweight += dout^T @ inp (each nullable); the bias gradient is bias_gradient's.
void matmul_forward(Gemm& gemm, float* out, const float* inp, const float* weight, const float* bias, int M, int K,
                    int N, cudaStream_t stream);
void matmul_backward(Gemm& gemm, float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                     int M, int K, int N, bool accumulate_dinp, cudaStream_t stream);
// A Linear layer's bias gradient (bias.cu): dbias(N) += the column sums of dout(M, N), fp32 or bf16, with
// `scratch` of bias_gradient_scratch_floats(M, N); deterministic, the same bits on every device.
size_t bias_gradient_scratch_floats(int M, int N);
void bias_gradient(float* dbias, const float* dout, int M, int N, float* scratch, cudaStream_t stream);
void bias_gradient(float* dbias, const uint16_t* dout, int M, int N, float* scratch, cudaStream_t stream);
// dst[c] += the sum over k < chunks of partial[k * stride + c], c < n, in a fixed order (bias.cu): the second pass
// of the bias's and the norms' parameter gradients, spread over ceil(n / 32) blocks of 8 warps that split the chunks.
void add_partial_sums(float* dst, const float* partial, int chunks, int n, size_t stride, cudaStream_t stream);
// The Linear forward and the tanh GELU after it: pre = inp @ weight^T + bias, out = gelu_tanh(pre), in one
// GEMM with cuBLASLt's GELU epilogue where its constraints hold (N a multiple of 8, aligned outputs and
// bias), else the GEMM and then the GELU kernel; fp32 and bf16-operand forms.
void matmul_gelu_forward(Gemm& gemm, float* pre, float* out, const float* inp, const float* weight, const float* bias,
                         int M, int K, int N, cudaStream_t stream);
// The bf16 form of it: out = gelu_tanh(pre) with pre and out in bf16 (each rounded once from fp32) and the
// bias rounded to bf16 (as the bf16-output GEMMs add it); false, nothing queued, where the epilogue cannot
// (the caller runs the bf16-output GEMM and gelu_forward).
bool matmul_gelu_forward(Gemm& gemm, uint16_t* pre, uint16_t* out, const uint16_t* inp, const uint16_t* weight,
                         const uint16_t* bias, int M, int K, int N, cudaStream_t stream);
void matmul_gelu_forward(Gemm& gemm, float* pre, float* out, const uint16_t* inp, const uint16_t* weight,
                         const float* bias, int M, int K, int N, cudaStream_t stream);
// The same products from bf16 copies of the operands (amp_bf16): fp32 accumulation and fp32 results.
// The Linear forward writing a bf16 out, its bias (nullable) in bf16 (Gemm::run_bf16_out); false where
// cuBLASLt has no such kernel: the caller takes the fp32 path and rounds.
// out = resid + inp @ weight^T + bias in one GEMM (Gemm::run_bf16_residual): a sublayer's output added to
// the residual stream without its own pass; false where cuBLASLt cannot, the caller running the two ops.
bool matmul_residual_forward(Gemm& gemm, float* out, const float* resid, const uint16_t* inp, const uint16_t* weight,
                             const float* bias, int M, int K, int N, cudaStream_t stream);
bool matmul_forward(Gemm& gemm, uint16_t* out, const uint16_t* inp, const uint16_t* weight, const uint16_t* bias, int M,
                    int K, int N, cudaStream_t stream);
void matmul_forward(Gemm& gemm, float* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int M,
                    int K, int N, cudaStream_t stream);
// The backward from bf16 operands: dout16 is dout in bf16. dinp is written in fp32 (dinp) or rounded once to
// bf16 (dinp16, overwritten: not with accumulate_dinp), at most one of them set. False, with nothing queued,
// where cuBLASLt has no bf16-output kernel for dinp16 (or it would accumulate): the caller computes dinp in
// fp32 and rounds it.
bool matmul_backward(Gemm& gemm, float* dinp, uint16_t* dinp16, float* dweight, const uint16_t* dout16,
                     const uint16_t* inp16, const uint16_t* weight16, int M, int K, int N, bool accumulate_dinp,
                     cudaStream_t stream);
// The backward of a Linear whose input is gelu_tanh(pre) (GPT-2's ff_out), from bf16 operands: dpre(M, K) =
// (dout16 @ weight16) * gelu_tanh'(pre) in one GEMM (Gemm::run_dgelu_bf16: the input gradient of the Linear is
// never stored), then dweight += dout16^T @ act16 (nullable). False, with nothing queued, where the epilogue
// cannot: the caller runs matmul_backward and the GELU's backward.
bool matmul_backward_dgelu(Gemm& gemm, uint16_t* dpre, float* dweight, const uint16_t* dout16, const uint16_t* act16,
                           const uint16_t* weight16, const uint16_t* pre, int M, int K, int N, cudaStream_t stream);

// Token (+ learned position, nullable) embedding; the backward adds into dwte/dwpe in row order, with
// no atomics (embedding.cu), rows grouped by token with `scratch` of embedding_backward_scratch_bytes(N).
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T, int C,
                       cudaStream_t stream);
size_t embedding_backward_scratch_bytes(int N);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T, int C,
                        void* scratch, cudaStream_t stream);

// The norms (layernorm.cu): LayerNorm, or RMSNorm with `rms` (mean nullable then). The pre-norm's forward
// (weight/bias nullable) saves mean and rstd; its backward ADDS into dinp, dweight and dbias (nullable).
// Every backward takes `scratch` of layernorm_backward_scratch_floats(N, C) floats. The pre-norm's forward writes
// the output's amax as stored where given one (nullable; amp_fp8's GemmOperand::amax).
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, float eps, bool rms, cudaStream_t stream, float* amax = nullptr);
// The same with the output rounded to bf16 (a GEMM operand; the statistics stay fp32).
void layernorm_forward(uint16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps, bool rms, cudaStream_t stream,
                       float* amax = nullptr);
size_t layernorm_backward_scratch_floats(int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C, bool rms,
                        float* scratch, cudaStream_t stream);
// The backward of a norm without weight or bias from its output (fp32 or bf16) and rstd: dinp +=.
void norm_backward_from_output(float* dinp, const float* dout, const float* out, const float* rstd, int N, int C,
                               bool rms, cudaStream_t stream);
void norm_backward_from_output(float* dinp, const float* dout, const uint16_t* out, const float* rstd, int N, int C,
                               bool rms, cudaStream_t stream);
// The norm after a sublayer (norm_after): out = resid + norm(inp) (out may alias resid), inp in fp32 or bf16;
// the backward OVERWRITES dinp (in inp's type) from the fp32 dout.
void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, const float* inp,
                           const float* weight, const float* bias, int N, int C, float eps, bool rms,
                           cudaStream_t stream);
void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, const uint16_t* inp,
                           const float* weight, const float* bias, int N, int C, float eps, bool rms,
                           cudaStream_t stream);
void norm_residual_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C, bool rms,
                            float* scratch, cudaStream_t stream);
void norm_residual_backward(uint16_t* dinp, float* dweight, float* dbias, const float* dout, const uint16_t* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C, bool rms,
                            float* scratch, cudaStream_t stream);
// QK-norm on q (C) and k (KV) of qkv(N, C+2KV) in place, their inputs saved in qk(N, C+KV) (a strided copy, then
// the norm from there); mean/rstd (2N each). The backward runs in place on dqkv. fp32 or bf16 throughout.
void qk_norm_forward(float* qkv, float* qk, float* mean, float* rstd, const float* q_weight, const float* q_bias,
                     const float* k_weight, const float* k_bias, int N, int C, int KV, float eps, bool rms,
                     cudaStream_t stream);
void qk_norm_forward(uint16_t* qkv, uint16_t* qk, float* mean, float* rstd, const float* q_weight, const float* q_bias,
                     const float* k_weight, const float* k_bias, int N, int C, int KV, float eps, bool rms,
                     cudaStream_t stream);
void qk_norm_backward(float* dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias, const float* qk,
                      const float* q_weight, const float* k_weight, const float* mean, const float* rstd, int N, int C,
                      int KV, bool rms, float* scratch, cudaStream_t stream);
void qk_norm_backward(uint16_t* dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                      const uint16_t* qk, const float* q_weight, const float* k_weight, const float* mean,
                      const float* rstd, int N, int C, int KV, bool rms, float* scratch, cudaStream_t stream);

// RoPE in place on q and k of qkv (B, T, 3C), with the (T, HS/2) cos/sin tables of cpu::rope_table_f32 on
// the device; the backward rotates back (rope.cu).
void rope_forward(float* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                  cudaStream_t stream);
void rope_backward(float* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                   cudaStream_t stream);
// The forward on a bf16 qkv (the att_proj GEMM's bf16 output) and the backward on a bf16 dqkv (the bf16
// attentions' output): rotated in fp32, rounded back to bf16.
void rope_forward(uint16_t* qkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                  cudaStream_t stream);
void rope_backward(uint16_t* dqkv, const float* cos_t, const float* sin_t, int B, int T, int NH, int HS,
                   cudaStream_t stream);

// Generation (kv_cache.cu): RoPE of fp32 rows at positions[n] with the (S, HS/2) tables above, and attention
// with a KV cache (Backend::attention_with_cache's contract; heads up to 256 channels).
void rope_forward_at(float* qkv, const int32_t* positions, const float* cos_t, const float* sin_t, int N, int NH,
                     int KVH, int HS, cudaStream_t stream);
void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                          const int32_t* positions, int N, int NH, int KVH, int HS, int S, cudaStream_t stream);

// Grouped-query attention's shared heads (kv_heads.cu): Backend::kv_heads_expand and kv_heads_reduce, fp32 or bf16
// (the reduce sums a group in fp32 and rounds once).
void kv_heads_expand(float* out, const float* inp, int N, int NH, int KVH, int HS, cudaStream_t stream);
void kv_heads_expand(uint16_t* out, const uint16_t* inp, int N, int NH, int KVH, int HS, cudaStream_t stream);
void kv_heads_reduce(float* dinp, const float* dout, int N, int NH, int KVH, int HS, cudaStream_t stream);
void kv_heads_reduce(uint16_t* dinp, const uint16_t* dout, int N, int NH, int KVH, int HS, cudaStream_t stream);

// Residual add (out may alias a or b) and in-place scaling (residual.cu).
void residual_forward(float* out, const float* a, const float* b, size_t n, cudaStream_t stream);
void scale_inplace(float* x, size_t n, float s, cudaStream_t stream);

// GELU (erf or tanh form; may run in place) and SwiGLU over rows of 2H (value, gate) -> H, forward and
// backward; gradients are overwritten (activation.cu). `amax` (nullable; amp_fp8's GemmOperand::amax): the
// largest |value| of the output as stored, written beside it (every SwiGLU form, and GELU's with a bf16 output).
void gelu_forward(float* out, const float* inp, size_t n, bool tanh_approx, cudaStream_t stream);
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n, bool tanh_approx, cudaStream_t stream);
void swiglu_forward(float* out, const float* inp, int N, int H, cudaStream_t stream, float* amax = nullptr);
// GELU and SwiGLU forward with the output rounded to bf16 (a GEMM operand; not in place).
void gelu_forward(uint16_t* out, const float* inp, size_t n, bool tanh_approx, cudaStream_t stream,
                  float* amax = nullptr);
void swiglu_forward(uint16_t* out, const float* inp, int N, int H, cudaStream_t stream, float* amax = nullptr);
// SwiGLU forward and backward from a bf16 input (the ff_proj GEMM's bf16 output).
void swiglu_forward(uint16_t* out, const uint16_t* inp, int N, int H, cudaStream_t stream, float* amax = nullptr);
void swiglu_backward(float* dinp, const uint16_t* inp, const float* dout, int N, int H, cudaStream_t stream,
                     float* amax = nullptr);
void swiglu_backward(float* dinp, const float* inp, const float* dout, int N, int H, cudaStream_t stream,
                     float* amax = nullptr);
// The backwards on bf16 gradients (amp_bf16: dout the ff_out GEMM's bf16 dinp, dinp the ff_proj GEMM's bf16
// dout), fp32 math, dinp rounded once; GELU's fp32 pre-activation, SwiGLU's bf16 ff_proj output. GELU may
// run in place (dinp == dout).
void gelu_backward(uint16_t* dinp, const float* inp, const uint16_t* dout, size_t n, bool tanh_approx,
                   cudaStream_t stream, float* amax = nullptr);
void swiglu_backward(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, int N, int H, cudaStream_t stream,
                     float* amax = nullptr);
// GELU on a bf16 pre-activation (the ff_proj GEMM's bf16 output): forward to bf16, backward on bf16
// gradients; fp32 math, rounded once.
void gelu_forward(uint16_t* out, const uint16_t* inp, size_t n, bool tanh_approx, cudaStream_t stream,
                  float* amax = nullptr);
void gelu_backward(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, size_t n, bool tanh_approx,
                   cudaStream_t stream, float* amax = nullptr);

// Causal attention over qkv (B, T, 3C): out (B, T, C), lse (B, NH, T) of the scaled scores; backward
// overwrites dqkv, with `scratch` of attention_backward_scratch_floats(B, T, NH) floats. The native
// (reference) kernels: heads up to 256 channels (attention.cu).
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int HS, cudaStream_t stream);
size_t attention_backward_scratch_floats(int B, int T, int NH);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int NH, int HS, float* scratch, cudaStream_t stream);

// cuDNN's fused causal attention (flash) on bf16 operands, the fast path of kernels.attention=cudnn
// (attention_cudnn.cu): the same contract as attention_forward/backward above on bf16 qkv (B, T, 3C),
// out (B, T, C) and dqkv (B, T, 3C, overwritten), with the fp32 lse; fp32 softmax statistics and
// accumulation. One execution plan per shape, built on first use and cached.
class CudnnAttention {
   public:
    CudnnAttention();
    ~CudnnAttention();
    CudnnAttention(const CudnnAttention&) = delete;
    CudnnAttention& operator=(const CudnnAttention&) = delete;
    // Device memory of at least the bytes asked, in stream order (the caller's scratch: it may move between
    // calls, never during one).
    using Workspace = std::function<void*(size_t bytes)>;
    void forward(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                 const Workspace& workspace, cudaStream_t stream);
    void backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out, const float* lse,
                  int B, int T, int NH, int HS, const Workspace& workspace, cudaStream_t stream);

   private:
    struct State;
    State* s_;
};

// Our flash attention on tensor cores (attention_flash.cu): the contract of CudnnAttention on bf16 qkv,
// out, dout and dqkv with the fp32 lse, heads of 64 or 128 channels, deterministic. The backward needs
// `scratch` of flash_attention_backward_scratch_bytes(B, T, NH, HS) bytes.
// Forward and backward run on Hopper's wgmma where the device has it (attention_flash_sm90a.cu, compute capability
// 9.0), else on mma.sync (attention_flash.cu); each kernel is callable on its own (the tests check both).
bool flash_attention_supported(int HS);
size_t flash_attention_backward_scratch_bytes(int B, int T, int NH, int HS);
void flash_attention_forward(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                             cudaStream_t stream);
void flash_attention_forward_sm80(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                                  cudaStream_t stream);
bool flash_attention_sm90_available();  // the current device runs sm_90a code
void flash_attention_forward_sm90(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                                  cudaStream_t stream);
void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream);
void flash_attention_backward_sm80(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                                   const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream);
void flash_attention_backward_sm90(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                                   const float* lse, int B, int T, int NH, int HS, void* scratch, cudaStream_t stream);
// Both backwards' first step: D = rowsum(dO * O) per (batch, head, query) into the scratch; returns it.
float* flash_attention_backward_dsum(const uint16_t* dout, const uint16_t* out, int B, int T, int NH, int HS,
                                     void* scratch, cudaStream_t stream);

// Fused softmax + cross-entropy + dlogits in place over (N, V) logits: losses(N) = logsumexp - logit of
// the target; with compute_grad the row becomes (softmax - onehot) * dloss_scale, plus the z-loss's
// gradient where z_loss_multiplier > 0 (z_losses(N) = z logsumexp^2 then). Targets < 0 are ignored;
// targets must be < V (classifier.cu). one_read (kernels.classifier_one_read): a row that fits a block's
// shared memory is read from device memory once, not twice; the same bits either way.
void classifier_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, float dloss_scale,
                                 bool compute_grad, float z_loss_multiplier, float* z_losses, bool one_read,
                                 cudaStream_t stream);
// The same over bf16 logits (the LM head GEMM's bf16 output): fp32 math, fp32 losses, the dlogits rounded to
// bf16 in place.
void classifier_forward_backward(uint16_t* logits, float* losses, const int32_t* targets, int N, int V,
                                 float dloss_scale, bool compute_grad, float z_loss_multiplier, float* z_losses,
                                 bool one_read, cudaStream_t stream);

// Fused AdamW over a flat shard, PyTorch's semantics; grad_scale is the clip coefficient (adamw.cu).
// param_bf16 (nullable) receives the updated parameters rounded to bf16 in the same pass.
void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16,
                  cudaStream_t stream);

// Multi-tensor AdamW (adamw.cu): one launch over many flat ranges, each described on the device by an
// AdamwSegment (the same update as adamw_update, element for element). A range of n elements is
// ceil(n / kAdamwChunk) chunks; first_chunk numbers them across the ranges, in order.
constexpr size_t kAdamwChunk = 4096;
struct AdamwSegment {
    float* param;
    const float* grad;
    float* m;
    float* v;
    uint16_t* p16;  // nullable: the bf16 copy-out
    size_t n, first_chunk;
    float decay_factor;  // adamw_decay_factor(lr, the range's weight decay)
};
inline float adamw_decay_factor(float lr, float weight_decay) {
    return static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
}
void adamw_update_multi(const AdamwSegment* segs_device, int nsegs, size_t total_chunks, float lr, float beta1,
                        float beta2, float eps, long step, float grad_scale, cudaStream_t stream);

// Deterministic double-precision squared L2 norm of many ranges together (norm.cu), one host round trip;
// the ranges are described on the device as (pointer, n, first_chunk) like AdamW's, chunks of kAdamwChunk.
struct NormSegment {
    const float* x;
    size_t n, first_chunk;
};
double squared_norm_multi(const NormSegment* segs_device, int nsegs, size_t total_chunks, double* scratch,
                          cudaStream_t stream);

// Deterministic double-precision sum and squared L2 norm, returned to the host (synchronises `stream`).
// `scratch`: device memory for kNormScratchDoubles doubles (norm.cu).
constexpr unsigned kNormBlocks = 512;
constexpr size_t kNormScratchDoubles = kNormBlocks + 1;
double squared_norm(const float* x, size_t n, double* scratch, cudaStream_t stream);
double sum(const float* x, size_t n, double* scratch, cudaStream_t stream);

// fp32 -> bf16 (round to nearest even) and back, elementwise (cast.cu).
void cast_float_to_bf16(uint16_t* out, const float* in, size_t n, cudaStream_t stream);
void cast_bf16_to_float(float* out, const uint16_t* in, size_t n, cudaStream_t stream);
void round_to_bf16(float* out, const float* in, size_t n, cudaStream_t stream);

// FP8 operands (fp8.cu; the formats are kernels/element.h's). *amax (device) = max |x| over n (fp32, or bf16 bits),
// NaN where one is; `scratch`: device memory for kNormBlocks floats. fp8_cast_transpose: out (rows x cols,
// row-major) = the codes of in * fp8_scale(*amax, f), and out_t (cols x rows) the same codes transposed, in one pass
// over `in` (fp32, or bf16 bits); either may be null (not both); amax in device memory; *descale (device, nullable) =
// 1 / the scale, what a GEMM multiplies the codes' values by. out_t's rows are ld_t >= rows long (0: rows), the
// codes past `rows` zero: a GEMM summing over the rows reads them as a multiple of 16 (cuBLASLt's FP8 kernels).
// LoRA (lora.cu; Backend::lora_forward / lora_backward, their contracts): each operand fp32 or bf16 as flagged, the
// adapters and their gradients fp32; dropout p (0: none) with its M row keys (device) and adapter id; work: M * 2r
// floats of device scratch.
struct LoraDropoutArgs {
    float p = 0.0f;
    const uint64_t* row_keys = nullptr;
    uint32_t adapter = 0;
};
void lora_forward(void* out, bool out_bf16, int ld_out, const void* inp, bool inp_bf16, const float* A, const float* B,
                  int M, int K, int r, int n, float scale, const LoraDropoutArgs& drop, float* work,
                  cudaStream_t stream);
void lora_backward(void* dinp, bool dinp_bf16, float* dA, float* dB, const void* dout, bool dout_bf16, int ld_dout,
                   const void* inp, bool inp_bf16, const float* A, const float* B, int M, int K, int r, int n,
                   float scale, const LoraDropoutArgs& drop, float* work, cudaStream_t stream);

// NF4 storage (nf4.cu; kernels/cpu/ops.h's nf4_quantize and nf4_dequantize, bitwise): codes (n + 1) / 2 bytes,
// one absmax a block of kNf4Block; dequantized into fp32 or bf16 (the fp32 value rounded once).
void nf4_quantize(uint8_t* codes, float* absmax, const float* x, size_t n, cudaStream_t stream);
void nf4_dequantize(float* out, const uint8_t* codes, const float* absmax, size_t n, cudaStream_t stream);
void nf4_dequantize(uint16_t* out, const uint8_t* codes, const float* absmax, size_t n, cudaStream_t stream);
// The same with double-quantized absmaxes (kernels/cpu/ops.h's nf4_dequantize_dq, bitwise; in bf16 rounded once).
void nf4_dequantize_dq(float* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                       const float* offset, size_t n, cudaStream_t stream);
void nf4_dequantize_dq(uint16_t* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                       const float* offset, size_t n, cudaStream_t stream);

void fp8_amax(float* amax, const float* x, size_t n, float* scratch, cudaStream_t stream);
void fp8_amax(float* amax, const uint16_t* x, size_t n, float* scratch, cudaStream_t stream);
void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, const float* in, int rows, int cols, const float* amax,
                        Fp8Format f, float* descale, cudaStream_t stream, int ld_t = 0);
void fp8_cast_transpose(uint8_t* out, uint8_t* out_t, const uint16_t* in, int rows, int cols, const float* amax,
                        Fp8Format f, float* descale, cudaStream_t stream, int ld_t = 0);

}  // namespace trainer::cuda
