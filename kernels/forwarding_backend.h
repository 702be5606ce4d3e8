// A Backend that passes every call to another: the base of the decorators that watch a step's ops (the plan's op
// recorder, the tests' graph recorder), so that each overrides only what it intercepts and a new op is forwarded
// in one place. Every op that runs on the device's stream goes through one hook, dispatch(), with its name and,
// for the ops bench-kernels prints as rows, its shape; memory, host copies, queries and the values returned to the
// host are forwarded straight (each overridable).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace trainer {

// A GEMM's sizes: the Linear's M x K input against its N x K weight, forward or backward.
struct GemmShape {
    int M = 0, K = 0, N = 0;
    bool backward = false;
};

// One call of a device op, as dispatch() sees it.
struct OpCall {
    const char* op = "";  // the Backend member, e.g. "matmul_forward"
    // An op a training step is timed by (bench-kernels' rows): its sizes as they print ("M 8188, K 2048, N 6144").
    // Copies, casts, scaling, sums and generation's ops are not rows: empty.
    std::string shape;
    bool row = false;
    std::optional<GemmShape> gemm;  // the GEMMs' sizes
};

class ForwardingBackend : public Backend {
   public:
    explicit ForwardingBackend(Backend& inner) : inner_(inner) {}
    Backend& inner() const { return inner_; }

    // Every device op: `run` calls the op on the backend it is given. The default runs it on the inner backend.
    virtual void dispatch(const OpCall& call, const std::function<void(Backend&)>& run) {
        (void)call;
        run(inner_);
    }
    // A fused op's parts: `parts` runs Backend's default body of the op on this backend (its separate ops, each
    // through dispatch). Called after the fused op's dispatch; the default runs nothing.
    virtual void fused_parts(const std::function<void()>& parts) { (void)parts; }

    std::string name() const override { return inner_.name(); }
    void* alloc(size_t bytes) override { return inner_.alloc(bytes); }
    void free(void* ptr) override { inner_.free(ptr); }
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
        inner_.copy_host_to_device(dst, src, bytes);
    }
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
        inner_.copy_device_to_host(dst, src, bytes);
    }
    void copy_any(void* dst, const void* src, size_t bytes) override { inner_.copy_any(dst, src, bytes); }
    void synchronize() override { inner_.synchronize(); }
    void* alloc_host(size_t bytes) override { return inner_.alloc_host(bytes); }
    void free_host(void* ptr) override { inner_.free_host(ptr); }
    uint64_t copy_async(void* dst, const void* src, size_t bytes) override {
        return inner_.copy_async(dst, src, bytes);
    }
    void host_wait(uint64_t ticket) override { inner_.host_wait(ticket); }
    void device_wait(uint64_t ticket) override { inner_.device_wait(ticket); }
    double peak_flops(bool bf16, std::string* how) const override { return inner_.peak_flops(bf16, how); }
    double peak_bandwidth(std::string* how) const override { return inner_.peak_bandwidth(how); }
    int64_t device_peak_bytes() const override { return inner_.device_peak_bytes(); }
    std::string library_description() const override { return inner_.library_description(); }
    bool gemm_operands_bf16() const override { return inner_.gemm_operands_bf16(); }
    void begin_activity() override { inner_.begin_activity(); }
    Activity end_activity() override { return inner_.end_activity(); }
    std::vector<std::pair<std::string, double>> device_counters() override { return inner_.device_counters(); }
    // No CUDA graphs by default: a graph recorded on the inner backend would replay its ops without passing here.
    bool can_capture() const override { return false; }
    bool has_linear_bf16_reference() const override { return inner_.has_linear_bf16_reference(); }
    bool linear_bf16_reference_forward(uint16_t* out, const uint16_t* inp, const uint16_t* weight, int M, int K,
                                       int N) override {
        return inner_.linear_bf16_reference_forward(out, inp, weight, M, K, N);
    }
    bool linear_bf16_reference_backward(uint16_t* dinp, uint16_t* dweight, const uint16_t* dout, const uint16_t* inp,
                                        const uint16_t* weight, int M, int K, int N) override {
        return inner_.linear_bf16_reference_backward(dinp, dweight, dout, inp, weight, M, K, N);
    }

    // The device ops, each through dispatch().
    void copy_device_to_device(void* dst, const void* src, size_t bytes) override;
    void fill_zero(void* ptr, size_t bytes) override;
    void hold_weight(const float* w) override;
    void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                        int N) override;
    void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp) override;
    void matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                 const float* bias, int M, int K, int N, float* scratch) override;
    void matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight, const float* bias,
                             int M, int K, int N, bool tanh_approx) override;
    void matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias, GemmOperand dout,
                              GemmOperand act, const float* weight, GemmOperand pre, int M, int K, int N,
                              bool tanh_approx) override;
    void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T,
                           int C) override;
    void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T,
                            int C) override;
    void layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp, const float* weight,
                           const float* bias, int N, int C, float eps, NormKind kind) override;
    void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C,
                            NormKind kind) override;
    void norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd, int N, int C,
                                   NormKind kind) override;
    void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                               const float* weight, const float* bias, int N, int C, float eps, NormKind kind) override;
    void norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout, GemmOperand inp,
                                const float* weight, const float* mean, const float* rstd, int N, int C,
                                NormKind kind) override;
    void qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd, const float* q_weight,
                         const float* q_bias, const float* k_weight, const float* k_bias, int N, int C, int KV,
                         float eps, NormKind kind) override;
    void qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                          GemmOperand qk, const float* q_weight, const float* k_weight, const float* mean,
                          const float* rstd, int N, int C, int KV, NormKind kind) override;
    void kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) override;
    void kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) override;
    void rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) override;
    void rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) override;
    void attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) override;
    void attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out, const float* lse,
                            int B, int T, int NH, int HS) override;
    void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta,
                         int S) override;
    void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                              const int32_t* positions, int N, int NH, int KVH, int HS, int S) override;
    void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) override;
    void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) override;
    void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) override;
    void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) override;
    void residual_forward(float* out, const float* a, const float* b, size_t n) override;
    void scale_inplace(float* x, size_t n, float s) override;
    void classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                     float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                     float* z_losses) override;
    void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) override;
    void adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2, float eps,
                            long step, float grad_scale) override;
    double squared_norm(const float* x, size_t n) override;
    double squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) override;
    double sum(const float* x, size_t n) override;
    void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) override;
    void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) override;
    void round_to_bf16(float* out, const float* in, size_t n) override;

   private:
    Backend& inner_;
};

}  // namespace trainer
