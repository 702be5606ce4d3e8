// The CUDA backend: the Backend interface's ops over the kernels of kernels/cuda, each queued on the compute stream
// of its runtime (cuda_runtime.cuh: device, memory, copies, graphs). How the ops read their operands (bf16 aliases,
// the held weight, casts, widenings and FP8 casts) is cuda_operands.cuh's. Scratch buffers grow on demand and are then
// reused (the LayerNorm and attention partials, the bf16 operand copies of amp_bf16, the norm partials).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_operands.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/timeline.h"

namespace trainer {
namespace cuda {
namespace {

class CudaBackend final : public CudaOperands {
   public:
    explicit CudaBackend(const BackendOptions& options) : CudaOperands(options) {
        if (options.fp8_linears) {
            int major = 0, minor = 0;
            TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
            TRAINER_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_));
            if (major * 10 + minor < 89) {
                cudaDeviceProp prop{};
                TRAINER_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
                user_error(
                    "precision \"amp_fp8\" needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                    "Blackwell); GPU {} ({}) has compute capability {}.{}: use --precision amp_bf16",
                    device_, prop.name, major, minor);
            }
        }
        gemm_ = std::make_unique<Gemm>();
        if (options.attention == AttentionKernel::kCudnn) cudnn_attention_ = std::make_unique<CudnnAttention>();
        norm_scratch_ = static_cast<double*>(alloc(kNormScratchDoubles * sizeof(double)));
    }
    ~CudaBackend() override {
        for (auto& [key, t] : rope_tables_) free(t.first), free(t.second);
        for (Scratch* s : {&ln_scratch_, &att_scratch_, &emb_scratch_, &cudnn_ws_, &bias_scratch_, &segments_,
                           &norm_segments_, &a16_, &c16_, &att16_[0], &att16_[1], &att16_[2], &att16_[3], &wide_[0],
                           &wide_[1], &wide_[2], &wide_[3]}) {
            release(*s);
        }
        cudnn_attention_.reset();
        free(norm_scratch_);
        gemm_.reset();
    }

    // amp_bf16 with kernels.bf16_activations: the model stores GEMM operands (GemmOperand) in bf16, read here
    // without a cast.
    bool gemm_operands_bf16() const override { return options_.bf16_operands; }
    void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                        int N) override {
        const OpMark mark(*timeline_, "matmul_forward");
        TRAINER_CHECK(!out.bf16 || options_.bf16_matmuls, "a bf16 GEMM output without amp_bf16");
        if (linear_ == LinearPrecision::kFp8 && fp8_forward(out, inp, weight, bias, M, K, N, nullptr)) return;
        if (!options_.bf16_matmuls) {
            return cuda::matmul_forward(*gemm_, out.f32(), operand_f32(wide_[0], inp, size_t(M) * K), weight, bias, M,
                                        K, N, stream_);
        }
        const uint16_t* inp16 = operand_bf16(a16_, inp, size_t(M) * K);
        const uint16_t* w16 = weight_bf16(weight, size_t(N) * K);
        if (out.bf16) {
            // Rounded once by cuBLASLt's epilogue, a bias rounded to bf16 first (as autocast's Linear does);
            // where cuBLASLt has no such kernel, the fp32 product (fp32 bias) rounded by a cast.
            const uint16_t* bias16 = bias != nullptr ? to_bf16(bias16_, bias, N) : nullptr;
            if (cuda::matmul_forward(*gemm_, out.b16(), inp16, w16, bias16, M, K, N, stream_)) return;
            auto* wide = static_cast<float*>(grow(wide_[1], size_t(M) * N * sizeof(float)));
            cuda::matmul_forward(*gemm_, wide, inp16, w16, bias, M, K, N, stream_);
            return cuda::cast_float_to_bf16(out.b16(), wide, size_t(M) * N, stream_);
        }
        cuda::matmul_forward(*gemm_, out.f32(), inp16, w16, bias, M, K, N, stream_);
    }
    void matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                 const float* bias, int M, int K, int N, float* scratch) override {
        const OpMark mark(*timeline_, "matmul_residual_forward");
        if (linear_ == LinearPrecision::kFp8 && fp8_forward(out, inp, weight, bias, M, K, N, resid)) return;
        if (options_.bf16_matmuls && linear_ != LinearPrecision::kFp8) {
            const uint16_t* inp16 = operand_bf16(a16_, inp, size_t(M) * K);
            const uint16_t* w16 = weight_bf16(weight, size_t(N) * K);
            if (cuda::matmul_residual_forward(*gemm_, out, resid, inp16, w16, bias, M, K, N, stream_)) return;
        }
        Backend::matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch);
    }
    void matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight, const float* bias,
                             int M, int K, int N, bool tanh_approx) override {
        const OpMark mark(*timeline_, "matmul_gelu_forward");
        // amp_fp8: the FP8 GEMM (matmul_forward) and one pass for the GELU (cuBLASLt's FP8 GEMMs have no GELU_AUX),
        // which writes out's amax where asked (cuBLASLt's epilogues would not).
        if (linear_ == LinearPrecision::kFp8 || out.amax != nullptr)
            return Backend::matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx);
        if (tanh_approx && options_.bf16_matmuls && pre.bf16 && out.bf16) {
            // amp_bf16: pre and out in bf16 from cuBLASLt's GELU_AUX(_BIAS) epilogue (the bias rounded to bf16
            // as the bf16-output GEMMs add it); else the bf16-output GEMM and one pass (below).
            const uint16_t* inp16 = operand_bf16(a16_, inp, size_t(M) * K);
            const uint16_t* w16 = weight_bf16(weight, size_t(N) * K);
            const uint16_t* bias16 = bias != nullptr ? to_bf16(bias16_, bias, N) : nullptr;
            if (cuda::matmul_gelu_forward(*gemm_, pre.b16(), out.b16(), inp16, w16, bias16, M, K, N, stream_)) return;
        }
        // A bf16 pre or out otherwise: the GEMM writes pre and one pass writes gelu(pre).
        if (!tanh_approx || out.bf16 || pre.bf16)
            return Backend::matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx);
        if (!options_.bf16_matmuls) {
            return cuda::matmul_gelu_forward(*gemm_, pre.f32(), out.f32(), operand_f32(wide_[0], inp, size_t(M) * K),
                                             weight, bias, M, K, N, stream_);
        }
        const uint16_t* inp16 = operand_bf16(a16_, inp, size_t(M) * K);
        const uint16_t* w16 = weight_bf16(weight, size_t(N) * K);
        cuda::matmul_gelu_forward(*gemm_, pre.f32(), out.f32(), inp16, w16, bias, M, K, N, stream_);
    }
    void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp) override {
        const OpMark mark(*timeline_, "matmul_backward");
        TRAINER_CHECK(!(dinp.bf16 && accumulate_dinp), "a bf16 GEMM gradient cannot accumulate");
        bias_gradient(dbias, dout, M, N);
        if (linear_ == LinearPrecision::kFp8 &&
            fp8_backward(dinp, dweight, dout, inp, weight, M, K, N, accumulate_dinp))
            return;
        if (!options_.bf16_matmuls) {
            TRAINER_CHECK(!dinp.bf16 && !dout.bf16, "a bf16 GEMM gradient without amp_bf16");
            const float* in = dweight != nullptr ? operand_f32(wide_[0], inp, size_t(M) * K) : nullptr;
            return cuda::matmul_backward(*gemm_, dinp.f32(), dweight, dout.f32(), in, weight, M, K, N, accumulate_dinp,
                                         stream_);
        }
        const uint16_t* dout16 = operand_bf16(c16_, dout, size_t(M) * N);  // an fp32 dout cast once
        const uint16_t* inp16 = dweight != nullptr ? operand_bf16(a16_, inp, size_t(M) * K) : nullptr;
        const uint16_t* w16 = dinp.p != nullptr ? weight_bf16(weight, size_t(N) * K) : nullptr;
        if (!dinp.bf16) {
            cuda::matmul_backward(*gemm_, dinp.f32(), nullptr, dweight, dout16, inp16, w16, M, K, N, accumulate_dinp,
                                  stream_);
            return;
        }
        // A bf16 dinp rounded once by cuBLASLt; where it has no such kernel, the fp32 product rounded by a cast.
        if (cuda::matmul_backward(*gemm_, nullptr, dinp.b16(), dweight, dout16, inp16, w16, M, K, N, false, stream_))
            return;
        auto* wide = static_cast<float*>(grow(wide_[1], size_t(M) * K * sizeof(float)));
        cuda::matmul_backward(*gemm_, wide, nullptr, dweight, dout16, inp16, w16, M, K, N, false, stream_);
        cuda::cast_float_to_bf16(dinp.b16(), wide, size_t(M) * K, stream_);
    }
    void matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias, GemmOperand dout,
                              GemmOperand act, const float* weight, GemmOperand pre, int M, int K, int N,
                              bool tanh_approx) override {
        if (linear_ != LinearPrecision::kFp8 && dpre.amax == nullptr && tanh_approx && options_.bf16_matmuls &&
            dpre.bf16 && pre.bf16 && cuda::Gemm::gelu_fusable(K, dpre.p, pre.p, nullptr)) {
            // amp_bf16: cuBLASLt's DGELU epilogue, the pair to the forward's GELU_AUX (matmul_gelu_forward).
            const OpMark mark(*timeline_, "matmul_gelu_backward");
            const uint16_t* dout16 = operand_bf16(c16_, dout, size_t(M) * N);
            const uint16_t* act16 = dweight != nullptr ? operand_bf16(a16_, act, size_t(M) * K) : nullptr;
            const uint16_t* w16 = weight_bf16(weight, size_t(N) * K);
            if (cuda::matmul_backward_dgelu(*gemm_, dpre.b16(), dweight, dout16, act16, w16, pre.b16(), M, K, N,
                                            stream_)) {
                bias_gradient(dbias, dout, M, N);
                return;
            }
        }
        Backend::matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
    }
    bool has_lora() const override { return true; }
    bool has_nf4() const override { return true; }
    void nf4_dequantize(GemmOperand out, const uint8_t* codes, const float* absmax, size_t n) override {
        const OpMark mark(*timeline_, "nf4_dequantize");
        if (out.bf16) return cuda::nf4_dequantize(out.b16(), codes, absmax, n, stream_);
        cuda::nf4_dequantize(out.f32(), codes, absmax, n, stream_);
    }
    void nf4_dequantize_dq(GemmOperand out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                           const float* offset, size_t n) override {
        const OpMark mark(*timeline_, "nf4_dequantize_dq");
        if (out.bf16) return cuda::nf4_dequantize_dq(out.b16(), codes, absmax_codes, absmax2, offset, n, stream_);
        cuda::nf4_dequantize_dq(out.f32(), codes, absmax_codes, absmax2, offset, n, stream_);
    }
    void lora_forward(GemmOperand out, int ld_out, GemmOperand inp, const float* A, const float* B, int M, int K, int r,
                      int n, float scale, const LoraDropout& drop, float* work) override {
        const OpMark mark(*timeline_, "lora_forward");
        cuda::lora_forward(out.p, out.bf16, ld_out, inp.p, inp.bf16, A, B, M, K, r, n, scale,
                           {drop.p, drop.row_keys, drop.adapter}, work, stream_);
    }
    void lora_backward(GemmOperand dinp, float* dA, float* dB, GemmOperand dout, int ld_dout, GemmOperand inp,
                       const float* A, const float* B, int M, int K, int r, int n, float scale, const LoraDropout& drop,
                       float* work) override {
        const OpMark mark(*timeline_, "lora_backward");
        cuda::lora_backward(dinp.p, dinp.bf16, dA, dB, dout.p, dout.bf16, ld_dout, inp.p, inp.bf16, A, B, M, K, r, n,
                            scale, {drop.p, drop.row_keys, drop.adapter}, work, stream_);
    }
    bool has_linear_bf16_reference() const override { return true; }
    bool linear_bf16_reference_forward(uint16_t* out, const uint16_t* inp, const uint16_t* weight, int M, int K,
                                       int N) override {
        const OpMark mark(*timeline_, "linear_bf16_reference_forward");
        return gemm_->run_bf16_out(false, true, M, N, K, inp, K, weight, K, out, N, nullptr, stream_);
    }
    bool linear_bf16_reference_backward(uint16_t* dinp, uint16_t* dweight, const uint16_t* dout, const uint16_t* inp,
                                        const uint16_t* weight, int M, int K, int N) override {
        const OpMark mark(*timeline_, "linear_bf16_reference_backward");
        return gemm_->run_bf16_out(false, false, M, K, N, dout, N, weight, K, dinp, K, nullptr, stream_) &&
               gemm_->run_bf16_out(true, false, N, K, M, dout, N, inp, K, dweight, K, nullptr, stream_);
    }
    void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T,
                           int C) override {
        const OpMark mark(*timeline_, "embedding_forward");
        cuda::embedding_forward(out, tokens, wte, wpe, N, T, C, stream_);
    }
    void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T,
                            int C) override {
        const OpMark mark(*timeline_, "embedding_backward");
        void* scratch = grow(emb_scratch_, cuda::embedding_backward_scratch_bytes(N));
        cuda::embedding_backward(dwte, dwpe, dout, tokens, N, T, C, scratch, stream_);
    }
    void layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp, const float* weight,
                           const float* bias, int N, int C, float eps, NormKind kind) override {
        const OpMark mark(*timeline_, "layernorm_forward");
        const bool rms = kind == NormKind::kRms;
        if (out.bf16) {
            return cuda::layernorm_forward(out.b16(), mean, rstd, inp, weight, bias, N, C, eps, rms, stream_, out.amax);
        }
        cuda::layernorm_forward(out.f32(), mean, rstd, inp, weight, bias, N, C, eps, rms, stream_, out.amax);
    }
    void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C,
                            NormKind kind) override {
        const OpMark mark(*timeline_, "layernorm_backward");
        cuda::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind == NormKind::kRms,
                                 norm_scratch(N, C), stream_);
    }
    void norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd, int N, int C,
                                   NormKind kind) override {
        const OpMark mark(*timeline_, "norm_backward_from_output");
        const bool rms = kind == NormKind::kRms;
        if (out.bf16) return cuda::norm_backward_from_output(dinp, dout, out.b16(), rstd, N, C, rms, stream_);
        cuda::norm_backward_from_output(dinp, dout, out.f32(), rstd, N, C, rms, stream_);
    }
    void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                               const float* weight, const float* bias, int N, int C, float eps,
                               NormKind kind) override {
        const OpMark mark(*timeline_, "norm_residual_forward");
        const bool rms = kind == NormKind::kRms;
        if (inp.bf16) {
            return cuda::norm_residual_forward(out, resid, mean, rstd, static_cast<const uint16_t*>(inp.b16()), weight,
                                               bias, N, C, eps, rms, stream_);
        }
        cuda::norm_residual_forward(out, resid, mean, rstd, static_cast<const float*>(inp.f32()), weight, bias, N, C,
                                    eps, rms, stream_);
    }
    void norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout, GemmOperand inp,
                                const float* weight, const float* mean, const float* rstd, int N, int C,
                                NormKind kind) override {
        const OpMark mark(*timeline_, "norm_residual_backward");
        TRAINER_CHECK(dinp.bf16 == inp.bf16, "norm_residual_backward: dinp and inp in one storage type");
        const bool rms = kind == NormKind::kRms;
        if (inp.bf16) {
            return cuda::norm_residual_backward(dinp.b16(), dweight, dbias, dout,
                                                static_cast<const uint16_t*>(inp.b16()), weight, mean, rstd, N, C, rms,
                                                norm_scratch(N, C), stream_);
        }
        cuda::norm_residual_backward(dinp.f32(), dweight, dbias, dout, static_cast<const float*>(inp.f32()), weight,
                                     mean, rstd, N, C, rms, norm_scratch(N, C), stream_);
    }
    void qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd, const float* q_weight,
                         const float* q_bias, const float* k_weight, const float* k_bias, int N, int C, int KV,
                         float eps, NormKind kind) override {
        const OpMark mark(*timeline_, "qk_norm_forward");
        TRAINER_CHECK(qkv.bf16 == qk.bf16, "qk_norm_forward: qkv and qk in one storage type");
        const bool rms = kind == NormKind::kRms;
        if (qkv.bf16) {
            return cuda::qk_norm_forward(qkv.b16(), qk.b16(), mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV,
                                         eps, rms, stream_);
        }
        cuda::qk_norm_forward(qkv.f32(), qk.f32(), mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, rms,
                              stream_);
    }
    void qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                          GemmOperand qk, const float* q_weight, const float* k_weight, const float* mean,
                          const float* rstd, int N, int C, int KV, NormKind kind) override {
        const OpMark mark(*timeline_, "qk_norm_backward");
        TRAINER_CHECK(dqkv.bf16 == qk.bf16, "qk_norm_backward: dqkv and qk in one storage type");
        const bool rms = kind == NormKind::kRms;
        if (qk.bf16) {
            return cuda::qk_norm_backward(dqkv.b16(), dq_weight, dq_bias, dk_weight, dk_bias,
                                          static_cast<const uint16_t*>(qk.b16()), q_weight, k_weight, mean, rstd, N, C,
                                          KV, rms, norm_scratch(N, C), stream_);
        }
        cuda::qk_norm_backward(dqkv.f32(), dq_weight, dq_bias, dk_weight, dk_bias, static_cast<const float*>(qk.f32()),
                               q_weight, k_weight, mean, rstd, N, C, KV, rms, norm_scratch(N, C), stream_);
    }
    void kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) override {
        const OpMark mark(*timeline_, "kv_heads_expand");
        TRAINER_CHECK(out.bf16 == inp.bf16, "kv_heads_expand: out and inp in one storage type");
        if (out.bf16) return cuda::kv_heads_expand(out.b16(), inp.b16(), N, NH, KVH, HS, stream_);
        cuda::kv_heads_expand(out.f32(), inp.f32(), N, NH, KVH, HS, stream_);
    }
    void kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) override {
        const OpMark mark(*timeline_, "kv_heads_reduce");
        TRAINER_CHECK(dinp.bf16 == dout.bf16, "kv_heads_reduce: dinp and dout in one storage type");
        if (dinp.bf16) return cuda::kv_heads_reduce(dinp.b16(), dout.b16(), N, NH, KVH, HS, stream_);
        cuda::kv_heads_reduce(dinp.f32(), dout.f32(), N, NH, KVH, HS, stream_);
    }
    void rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) override {
        const OpMark mark(*timeline_, "rope_forward");
        const auto& [cos_t, sin_t] = rope_table(T, HS, theta);
        if (qkv.bf16) return cuda::rope_forward(qkv.b16(), cos_t, sin_t, B, T, NH, HS, stream_);
        cuda::rope_forward(qkv.f32(), cos_t, sin_t, B, T, NH, HS, stream_);
    }
    void rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) override {
        const OpMark mark(*timeline_, "rope_backward");
        const auto& [cos_t, sin_t] = rope_table(T, HS, theta);
        if (dqkv.bf16) return cuda::rope_backward(dqkv.b16(), cos_t, sin_t, B, T, NH, HS, stream_);
        cuda::rope_backward(dqkv.f32(), cos_t, sin_t, B, T, NH, HS, stream_);
    }
    void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta,
                         int S) override {
        const OpMark mark(*timeline_, "rope_forward_at");
        const auto& [cos_t, sin_t] = rope_table(S, HS, theta);
        cuda::rope_forward_at(qkv, positions, cos_t, sin_t, N, NH, KVH, HS, stream_);
    }
    void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                              const int32_t* positions, int N, int NH, int KVH, int HS, int S) override {
        const OpMark mark(*timeline_, "attention_with_cache");
        cuda::attention_with_cache(out, qkv, kcache, vcache, seqs, positions, N, NH, KVH, HS, S, stream_);
    }
    void attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) override {
        const OpMark mark(*timeline_, "attention_forward");
        const size_t NC = static_cast<size_t>(B) * T * NH * HS;
        if (options_.attention == AttentionKernel::kNative) {  // fp32 kernels: bf16 operands widened
            const float* q = operand_f32(wide_[0], qkv, 3 * NC);
            if (!out.bf16) return cuda::attention_forward(out.f32(), lse, q, B, T, NH, HS, stream_);
            auto* wide = static_cast<float*>(grow(wide_[1], NC * sizeof(float)));
            cuda::attention_forward(wide, lse, q, B, T, NH, HS, stream_);
            return cuda::cast_float_to_bf16(out.b16(), wide, NC, stream_);
        }
        // cuDNN or ours: bf16 qkv read where it lies, the bf16 output straight into a bf16 operand (else
        // widened back, exactly, into the fp32 one).
        const uint16_t* qkv16 = operand_bf16(att16_[0], qkv, 3 * NC);
        auto* out16 = out.bf16 ? out.b16() : static_cast<uint16_t*>(grow(att16_[1], NC * sizeof(uint16_t)));
        if (cudnn_attention_) {
            cudnn_attention_->forward(out16, lse, qkv16, B, T, NH, HS, workspace(), stream_);
        } else {
            cuda::flash_attention_forward(out16, lse, qkv16, B, T, NH, HS, stream_);
        }
        if (!out.bf16) cuda::cast_bf16_to_float(out.f32(), out16, NC, stream_);
    }
    void attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out, const float* lse,
                            int B, int T, int NH, int HS) override {
        const OpMark mark(*timeline_, "attention_backward");
        const size_t NC = static_cast<size_t>(B) * T * NH * HS;
        if (options_.attention == AttentionKernel::kNative) {  // fp32 kernels: bf16 operands widened, and narrowed
            float* scratch = static_cast<float*>(
                grow(att_scratch_, cuda::attention_backward_scratch_floats(B, T, NH) * sizeof(float)));
            float* d32 = dqkv.bf16 ? static_cast<float*>(grow(wide_[3], 3 * NC * sizeof(float))) : dqkv.f32();
            cuda::attention_backward(d32, operand_f32(wide_[2], dout, NC), operand_f32(wide_[0], qkv, 3 * NC),
                                     operand_f32(wide_[1], out, NC), lse, B, T, NH, HS, scratch, stream_);
            if (dqkv.bf16) cuda::cast_float_to_bf16(dqkv.b16(), d32, 3 * NC, stream_);
            return;
        }
        // cuDNN or ours, on bf16: bf16 operands and gradients read and written where they lie.
        const uint16_t* qkv16 = operand_bf16(att16_[0], qkv, 3 * NC);
        const uint16_t* out16 = operand_bf16(att16_[1], out, NC);  // fp32 out holds bf16 values: forward's bits
        const uint16_t* dout16 = operand_bf16(att16_[2], dout, NC);
        auto* dqkv16 = dqkv.bf16 ? dqkv.b16() : static_cast<uint16_t*>(grow(att16_[3], 3 * NC * sizeof(uint16_t)));
        if (cudnn_attention_) {
            cudnn_attention_->backward(dqkv16, dout16, qkv16, out16, lse, B, T, NH, HS, workspace(), stream_);
        } else {
            void* scratch = grow(att_scratch_, cuda::flash_attention_backward_scratch_bytes(B, T, NH, HS));
            cuda::flash_attention_backward(dqkv16, dout16, qkv16, out16, lse, B, T, NH, HS, scratch, stream_);
        }
        if (!dqkv.bf16) cuda::cast_bf16_to_float(dqkv.f32(), dqkv16, 3 * NC, stream_);
    }
    void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) override {
        const OpMark mark(*timeline_, "gelu_forward");
        if (inp.bf16 && out.bf16) return cuda::gelu_forward(out.b16(), inp.b16(), n, tanh_approx, stream_, out.amax);
        const float* x = operand_f32(wide_[0], inp, n);
        if (out.bf16) return cuda::gelu_forward(out.b16(), x, n, tanh_approx, stream_, out.amax);
        cuda::gelu_forward(out.f32(), x, n, tanh_approx, stream_);
        producer_amax(out, n);  // the fp32 GELU's kernel is the shared map's, without one
    }
    void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) override {
        const OpMark mark(*timeline_, "gelu_backward");
        if (dinp.bf16) {
            const uint16_t* g16 = operand_bf16(c16_, dout, n);
            if (inp.bf16) return cuda::gelu_backward(dinp.b16(), inp.b16(), g16, n, tanh_approx, stream_, dinp.amax);
            return cuda::gelu_backward(dinp.b16(), inp.f32(), g16, n, tanh_approx, stream_, dinp.amax);
        }
        cuda::gelu_backward(dinp.f32(), operand_f32(wide_[1], inp, n), operand_f32(wide_[0], dout, n), n, tanh_approx,
                            stream_);
        producer_amax(dinp, n);
    }
    void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) override {
        const OpMark mark(*timeline_, "swiglu_forward");
        if (inp.bf16) {
            const size_t NH = static_cast<size_t>(N) * H;
            if (out.bf16) return cuda::swiglu_forward(out.b16(), inp.b16(), N, H, stream_, out.amax);
            return cuda::swiglu_forward(out.f32(), operand_f32(wide_[0], inp, 2 * NH), N, H, stream_, out.amax);
        }
        if (out.bf16) return cuda::swiglu_forward(out.b16(), inp.f32(), N, H, stream_, out.amax);
        cuda::swiglu_forward(out.f32(), inp.f32(), N, H, stream_, out.amax);
    }
    void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) override {
        const OpMark mark(*timeline_, "swiglu_backward");
        const size_t NH = static_cast<size_t>(N) * H;
        if (dinp.bf16 && inp.bf16) {  // amp_bf16's (and amp_fp8's): all three bf16
            return cuda::swiglu_backward(dinp.b16(), inp.b16(), operand_bf16(c16_, dout, NH), N, H, stream_, dinp.amax);
        }
        // Else fp32 gradients (a bf16 dinp from an fp32 input: computed in fp32 and rounded once).
        float* d32 = dinp.bf16 ? static_cast<float*>(grow(wide_[1], 2 * NH * sizeof(float))) : dinp.f32();
        const float* g32 = operand_f32(wide_[2], dout, NH);
        float* amax = dinp.bf16 ? nullptr : dinp.amax;  // a bf16 dinp's amax is of the rounded values
        if (inp.bf16) {
            cuda::swiglu_backward(d32, inp.b16(), g32, N, H, stream_, amax);
        } else {
            cuda::swiglu_backward(d32, inp.f32(), g32, N, H, stream_, amax);
        }
        if (dinp.bf16) {
            cuda::cast_float_to_bf16(dinp.b16(), d32, 2 * NH, stream_);
            producer_amax(dinp, 2 * NH);
        }
    }
    void residual_forward(float* out, const float* a, const float* b, size_t n) override {
        const OpMark mark(*timeline_, "residual_forward");
        cuda::residual_forward(out, a, b, n, stream_);
    }
    void scale_inplace(float* x, size_t n, float s) override {
        const OpMark mark(*timeline_, "scale_inplace");
        cuda::scale_inplace(x, n, s, stream_);
    }
    void classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                     float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                     float* z_losses) override {
        const OpMark mark(*timeline_, "classifier_forward_backward");
        if (logits.bf16) {
            return cuda::classifier_forward_backward(logits.b16(), losses, targets, N, V, dloss_scale, compute_grad,
                                                     z_loss_multiplier, z_losses, options_.classifier_one_read,
                                                     stream_);
        }
        cuda::classifier_forward_backward(logits.f32(), losses, targets, N, V, dloss_scale, compute_grad,
                                          z_loss_multiplier, z_losses, options_.classifier_one_read, stream_);
    }
    void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) override {
        const OpMark mark(*timeline_, "adamw_update");
        cuda::adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, param_bf16,
                           stream_);
    }
    double squared_norm(const float* x, size_t n) override {
        no_capture("a squared norm returned to the host");
        const OpMark mark(*timeline_, "squared_norm");
        return cuda::squared_norm(x, n, norm_scratch_, stream_);
    }
    void adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2, float eps,
                            long step, float grad_scale) override {
        no_capture("the optimizer step (its descriptors are uploaded from the host)");
        const OpMark mark(*timeline_, "adamw_update_multi");
        std::vector<cuda::AdamwSegment> segs;
        size_t chunks = 0;
        for (const AdamwRange& r : ranges) {
            if (r.n == 0) continue;
            segs.push_back(
                {r.param, r.grad, r.m, r.v, r.param_bf16, r.n, chunks, cuda::adamw_decay_factor(lr, r.weight_decay)});
            chunks += (r.n + cuda::kAdamwChunk - 1) / cuda::kAdamwChunk;
        }
        if (segs.empty()) return;
        const size_t bytes = segs.size() * sizeof(cuda::AdamwSegment);
        void* dev = grow(segments_, bytes);
        copy_host_to_device(dev, segs.data(), bytes);
        cuda::adamw_update_multi(static_cast<const cuda::AdamwSegment*>(dev), static_cast<int>(segs.size()), chunks, lr,
                                 beta1, beta2, eps, step, grad_scale, stream_);
    }
    double squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) override {
        no_capture("a squared norm returned to the host");
        const OpMark mark(*timeline_, "squared_norm_multi");
        std::vector<cuda::NormSegment> segs;
        size_t chunks = 0;
        for (const auto& [x, n] : ranges) {
            if (n == 0) continue;
            segs.push_back({x, n, chunks});
            chunks += (n + cuda::kAdamwChunk - 1) / cuda::kAdamwChunk;
        }
        if (segs.empty()) return 0.0;
        const size_t bytes = segs.size() * sizeof(cuda::NormSegment);
        void* dev = grow(norm_segments_, bytes);
        copy_host_to_device(dev, segs.data(), bytes);
        return cuda::squared_norm_multi(static_cast<const cuda::NormSegment*>(dev), static_cast<int>(segs.size()),
                                        chunks, norm_scratch_, stream_);
    }
    double sum(const float* x, size_t n) override {
        no_capture("a sum returned to the host");
        const OpMark mark(*timeline_, "sum");
        return cuda::sum(x, n, norm_scratch_, stream_);
    }
    void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) override {
        const OpMark mark(*timeline_, "cast_float_to_bf16");
        cuda::cast_float_to_bf16(out, in, n, stream_);
    }
    void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) override {
        const OpMark mark(*timeline_, "cast_bf16_to_float");
        cuda::cast_bf16_to_float(out, in, n, stream_);
    }
    void round_to_bf16(float* out, const float* in, size_t n) override {
        const OpMark mark(*timeline_, "round_to_bf16");
        cuda::round_to_bf16(out, in, n, stream_);
    }

   private:
    // cuDNN's attention workspace, from the backend's memory like every scratch.
    CudnnAttention::Workspace workspace() {
        return [this](size_t bytes) { return grow(cudnn_ws_, bytes); };
    }
    // dbias(N) += the column sums of dout(M, N) as it lies: fp32, or bf16 (a bf16 gradient, as cuBLASLt's BGRAD
    // epilogues would read it); nothing for a null dbias.
    void bias_gradient(float* dbias, GemmOperand dout, int M, int N) {
        if (dbias == nullptr || M <= 0 || N <= 0) return;
        float* scratch =
            static_cast<float*>(grow(bias_scratch_, cuda::bias_gradient_scratch_floats(M, N) * sizeof(float)));
        if (dout.bf16) {
            cuda::bias_gradient(dbias, dout.b16(), M, N, scratch, stream_);
        } else {
            cuda::bias_gradient(dbias, dout.f32(), M, N, scratch, stream_);
        }
    }
    // The norms' backward partials of dweight/dbias (layernorm.cu) for N rows of C channels.
    float* norm_scratch(int N, int C) {
        return static_cast<float*>(grow(ln_scratch_, cuda::layernorm_backward_scratch_floats(N, C) * sizeof(float)));
    }
    // A Linear that cuBLASLt has no FP8 kernel for runs in bf16, said once a shape; false.
    bool fp8_fallback(const char* what, int M, int N, int K, const char* why) {
        if (fp8_fallbacks_.insert(std::make_tuple(M, N, K)).second) {
            std::fprintf(stderr, "warning: amp_fp8: the Linear %s of %d x %d x %d runs in bf16: %s\n", what, M, N, K,
                         why);
        }
        return false;
    }
    // cuBLASLt's FP8 GEMMs take the Linear's K and N as fp8_linear_shape says (kernels/backend.h).
    bool fp8_runs(const char* what, int M, int N, int K) {
        return fp8_linear_shape(K, N) ||
               fp8_fallback(what, M, N, K, "cuBLASLt's FP8 GEMMs take K and N that are multiples of 16");
    }
    // out = inp weight^T + bias (with resid: fp32 out = resid + that) on e4m3 codes of inp and weight, fp32
    // accumulation, the scales applied by cuBLASLt. False, with no product queued, where it has no FP8 kernel.
    bool fp8_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K, int N,
                     const float* resid) {
        if (!fp8_runs("forward", M, N, K)) return false;
        const Gemm::Fp8Matrix x = to_fp8(kFp8Input, inp, M, K, Fp8Format::kE4M3, true, false).rows;
        const Gemm::Fp8Matrix w =
            to_fp8(kFp8Weight, weight_operand(weight, size_t(N) * K), N, K, Fp8Format::kE4M3, true, false).rows;
        const void* b = out.bf16 && bias != nullptr ? static_cast<const void*>(to_bf16(bias16_, bias, N)) : bias;
        return gemm_->run_fp8(M, N, K, x, w, resid != nullptr ? 1.0f : 0.0f, out.p, out.bf16, b, resid, stream_) ||
               fp8_fallback("forward", M, N, K, "cuBLASLt has no FP8 kernel for it on this GPU");
    }
    // dinp (+)= dout weight and dweight += dout^T inp on an e5m2 dout and e4m3 inp and weight: dout's codes
    // row-major and transposed from one pass, weight's and inp's transposed (cuBLASLt's FP8 layout reads both
    // operands along the summed dimension).
    bool fp8_backward(GemmOperand dinp, float* dweight, GemmOperand dout, GemmOperand inp, const float* weight, int M,
                      int K, int N, bool accumulate_dinp) {
        if (!fp8_runs("backward", M, N, K)) return false;
        const Fp8Cast dy = to_fp8(kFp8Gradient, dout, M, N, Fp8Format::kE5M2, dinp.p != nullptr, dweight != nullptr);
        if (dinp.p != nullptr) {
            // dinp(M, K) = dy(M, N) @ (weight^T (K, N))^T
            const Gemm::Fp8Matrix wt =
                to_fp8(kFp8Weight, weight_operand(weight, size_t(N) * K), N, K, Fp8Format::kE4M3, false, true).cols;
            if (!gemm_->run_fp8(M, K, N, dy.rows, wt, accumulate_dinp ? 1.0f : 0.0f, dinp.p, dinp.bf16, nullptr,
                                nullptr, stream_))
                return fp8_fallback("backward", M, N, K, "cuBLASLt has no FP8 kernel for it on this GPU");
        }
        if (dweight != nullptr) {
            // dweight(N, K) += dy^T (N, M) @ (inp^T (K, M))^T, M padded with zero codes in both
            const Gemm::Fp8Matrix xt = to_fp8(kFp8Input, inp, M, K, Fp8Format::kE4M3, false, true).cols;
            const bool ran =
                gemm_->run_fp8(N, K, fp8_padded(M), dy.cols, xt, 1.0f, dweight, false, nullptr, nullptr, stream_);
            if (!ran && dinp.p == nullptr)
                return fp8_fallback("backward", M, N, K, "cuBLASLt has no FP8 kernel for it on this GPU");
            if (!ran)
                TRAINER_CUDA_FAIL("cublasLtMatmul", "no FP8 kernel for the weight gradient of a " + std::to_string(M) +
                                                        " x " + std::to_string(N) + " x " + std::to_string(K) +
                                                        " Linear whose input gradient had one");
        }
        return true;
    }

    // The (T, HS/2) cos and sin tables of cpu::rope_table_f32, uploaded once per (T, HS, theta).
    const std::pair<float*, float*>& rope_table(int T, int HS, float theta) {
        const auto key = std::make_tuple(T, HS, theta);
        auto it = rope_tables_.find(key);
        if (it == rope_tables_.end()) {
            const size_t n = static_cast<size_t>(T) * (HS / 2);
            std::vector<float> c(n), s(n);
            cpu::rope_table_f32(c.data(), s.data(), T, HS, theta);
            auto* dc = static_cast<float*>(alloc(n * sizeof(float)));
            auto* ds = static_cast<float*>(alloc(n * sizeof(float)));
            copy_host_to_device(dc, c.data(), n * sizeof(float));
            copy_host_to_device(ds, s.data(), n * sizeof(float));
            it = rope_tables_.emplace(key, std::make_pair(dc, ds)).first;
        }
        return it->second;
    }

    std::unique_ptr<Gemm> gemm_;
    double* norm_scratch_ = nullptr;
    Scratch ln_scratch_, att_scratch_, emb_scratch_, a16_, c16_, cudnn_ws_, bias_scratch_;
    Scratch bias16_;                                     // a bias rounded to bf16 for a bf16-output GEMM's epilogue
    Scratch segments_, norm_segments_;                   // the multi-tensor AdamW and norm descriptors
    std::set<std::tuple<int, int, int>> fp8_fallbacks_;  // the shapes said to run in bf16
    Scratch att16_[4];                                   // the bf16 attentions' qkv, out, dout and dqkv
    Scratch wide_[4];  // bf16 operands widened for fp32 kernels (the native attention), and fp32 products
    std::unique_ptr<CudnnAttention> cudnn_attention_;
    std::map<std::tuple<int, int, float>, std::pair<float*, float*>> rope_tables_;
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        user_error(
            "device \"cuda\": no usable GPU on this machine ({}); use --device cpu, or --device auto to pick "
            "what is present",
            err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device found");
    }
    BackendOptions o = options;
    o.device_index = options.device_index % n;
    return std::make_unique<cuda::CudaBackend>(o);
}

}  // namespace trainer
