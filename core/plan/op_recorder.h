// The compute ops of a real training step, as the step issues them: a backend that forwards every call to another
// and records each compute op it passes on, keyed by the op and its shape, with its FLOPs and bytes (the dry
// backend's cost model), how many times the step ran it and, where it is given a timer, how long one call takes on
// the backend it forwards to. bench-kernels times a step's ops this way, so its rows are the model's own sequence:
// a new op, or an op the model starts to call at another shape, has its row without anyone writing one.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/config.h"
#include "kernels/backend.h"

namespace trainer {

// One distinct op of a step: a Backend member at one shape.
struct RecordedOp {
    std::string op;     // the Backend member, e.g. "matmul_forward"
    std::string shape;  // its sizes, e.g. "M 8188, K 2048, N 6144"
    double flops = 0.0, bytes = 0.0;
    // The dry backend's name of each cost the call reports, in order (a fused op reports its parts').
    std::vector<std::string> cost_ops;
    // Their one name where they have one (a fused op has none): what `trainer plan` prices the op by in a
    // calibration file.
    std::string cost_op() const;
    long calls = 0;                 // calls in the step; 0: a part of a fused op the step runs, recorded for the plan
    double seconds = -1.0;          // one call, where the recorder had a timer
    double ceiling_seconds = -1.0;  // GEMMs on a backend with a bf16 Linear reference: the reference at this shape
    struct Gemm {
        int M = 0, K = 0, N = 0;
        bool backward = false;
    };
    std::optional<Gemm> gemm;
    std::string key() const;  // op, shape and costs: equal keys are the same work
};

// Runs one call again and again and returns the mean seconds of one (bench-kernels' timer).
using OpTimer = std::function<double(const std::function<void()>&)>;

class OpRecorder final : public Backend {
   public:
    // Forwards to `inner`; with `timer`, times each op (and each GEMM's bf16 Linear reference, where `inner` has
    // one) the first time it sees its key, on the buffers of that call, before running the call itself. The
    // repeated calls leave the step's values unlike a real step's: a timed step computes nothing to keep.
    explicit OpRecorder(Backend& inner, OpTimer timer = {});
    ~OpRecorder() override;
    // The step's ops in the order first called, each once.
    const std::vector<RecordedOp>& ops() const { return ops_; }

    std::string name() const override { return inner_.name(); }
    void* alloc(size_t bytes) override { return inner_.alloc(bytes); }
    void free(void* ptr) override { inner_.free(ptr); }
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
        inner_.copy_host_to_device(dst, src, bytes);
    }
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
        inner_.copy_device_to_host(dst, src, bytes);
    }
    void copy_device_to_device(void* dst, const void* src, size_t bytes) override {
        inner_.copy_device_to_device(dst, src, bytes);
    }
    void fill_zero(void* ptr, size_t bytes) override { inner_.fill_zero(ptr, bytes); }
    // Generation's ops are no part of a training step: forwarded, not recorded.
    void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta,
                         int S) override {
        inner_.rope_forward_at(qkv, positions, N, NH, KVH, HS, theta, S);
    }
    void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                              const int32_t* positions, int N, int NH, int KVH, int HS, int S) override {
        inner_.attention_with_cache(out, qkv, kcache, vcache, seqs, positions, N, NH, KVH, HS, S);
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
    // No CUDA graphs: a recorded graph would run its ops without passing here.
    bool can_capture() const override { return false; }
    void hold_weight(const float* w) override { inner_.hold_weight(w); }
    bool has_linear_bf16_reference() const override { return inner_.has_linear_bf16_reference(); }
    bool linear_bf16_reference_forward(uint16_t* out, const uint16_t* inp, const uint16_t* weight, int M, int K,
                                       int N) override {
        return inner_.linear_bf16_reference_forward(out, inp, weight, M, K, N);
    }
    bool linear_bf16_reference_backward(uint16_t* dinp, uint16_t* dweight, const uint16_t* dout, const uint16_t* inp,
                                        const uint16_t* weight, int M, int K, int N) override {
        return inner_.linear_bf16_reference_backward(dinp, dweight, dout, inp, weight, M, K, N);
    }
    // Work priced by its bytes, not timed as a row: forwarded only.
    void scale_inplace(float* x, size_t n, float s) override { inner_.scale_inplace(x, n, s); }
    double sum(const float* x, size_t n) override { return inner_.sum(x, n); }
    void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) override {
        inner_.cast_float_to_bf16(out, in, n);
    }
    void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) override {
        inner_.cast_bf16_to_float(out, in, n);
    }
    void round_to_bf16(float* out, const float* in, size_t n) override { inner_.round_to_bf16(out, in, n); }

    // The compute ops: recorded, then forwarded.
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
    void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) override;
    void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) override;
    void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) override;
    void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) override;
    void residual_forward(float* out, const float* a, const float* b, size_t n) override;
    void classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                     float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                     float* z_losses) override;
    void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) override;
    void adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2, float eps,
                            long step, float grad_scale) override;
    double squared_norm(const float* x, size_t n) override;
    double squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) override;

   private:
    // Records the op `run` calls (on the backend it is given) at `shape`, times it where this is the first call of
    // its key and there is a timer, and runs it on the inner backend, unless the call is a part of a fused op.
    void record(const char* op, std::string shape, const std::function<void(Backend&)>& run,
                std::optional<RecordedOp::Gemm> gemm = {});
    // Records the parts `run_parts` calls on this recorder (a fused op's default body: its separate ops) without
    // counting them as the step's calls; timed alone where new, for the plan, which prices a fused op by its parts.
    void record_parts(const std::function<void()>& run_parts);
    void time_ceiling(RecordedOp& r);

    Backend& inner_;
    OpTimer timer_;
    std::unique_ptr<Backend> costs_backend_;  // the dry backend: each call's costs
    std::vector<OpCost> costs_;
    std::vector<RecordedOp> ops_;
    std::map<std::string, size_t> by_key_;
    bool in_parts_ = false;
    DeviceBuffer ref_in_, ref_w_, ref_out_, ref_dout_, ref_din_, ref_dw_;  // the ceilings' bf16 operands
    size_t ref_mk_ = 0, ref_nk_ = 0, ref_mn_ = 0;
};

}  // namespace trainer
