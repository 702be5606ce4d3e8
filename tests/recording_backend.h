// A Backend that records, as the CUDA backend does for kernels.cuda_graphs, on the CPU: the ops queued between
// begin_capture and end_capture are kept as closures over their arguments and run again, in order, by
// launch_graph, on the CPU backend it wraps; outside a recording every call goes straight through. What the
// CUDA backend refuses while recording (kernels/cuda/cuda_backend.cu: memory, host copies and values, the
// optimizer), this refuses too, and freeing memory while recordings exist drops them and raises graph_epoch().
// So the CPU suite checks what a recorded micro-batch relies on (kernels/graph.h): that its device work is the
// same every time, with its inputs on the device and no host code of its own that matters.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace test_util {

class RecordingBackend final : public trainer::Backend {
   public:
    using GemmOperand = trainer::GemmOperand;
    using NormKind = trainer::NormKind;

    explicit RecordingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

    long launches() const { return launches_; }
    long recorded_ops() const { return recorded_ops_; }

    std::string name() const override { return inner_->name(); }
    void* alloc(size_t bytes) override {
        no_capture("allocating device memory");
        return inner_->alloc(bytes);
    }
    void free(void* ptr) override {
        if (ptr == nullptr) return;
        if (capturing_) {
            fault_ = "freeing device memory";
            return;
        }
        if (!graphs_.empty()) graphs_.clear(), ++epoch_;
        inner_->free(ptr);
    }
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
        no_capture("a copy from host memory");
        inner_->copy_host_to_device(dst, src, bytes);
    }
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
        no_capture("a copy to host memory");
        inner_->copy_device_to_host(dst, src, bytes);
    }
    void copy_device_to_device(void* dst, const void* src, size_t bytes) override {
        queue([=] { inner_->copy_device_to_device(dst, src, bytes); });
    }
    void fill_zero(void* ptr, size_t bytes) override {
        queue([=] { inner_->fill_zero(ptr, bytes); });
    }
    void copy_any(void* dst, const void* src, size_t bytes) override {
        no_capture("a copy that may touch host memory");
        inner_->copy_any(dst, src, bytes);
    }
    void synchronize() override {
        no_capture("a synchronisation");
        inner_->synchronize();
    }
    void* alloc_host(size_t bytes) override {
        no_capture("allocating host memory");
        return inner_->alloc_host(bytes);
    }
    void free_host(void* ptr) override { inner_->free_host(ptr); }
    uint64_t copy_async(void* dst, const void* src, size_t bytes) override {
        no_capture("an offload copy");
        return inner_->copy_async(dst, src, bytes);
    }
    void host_wait(uint64_t ticket) override { inner_->host_wait(ticket); }
    // The CPU backend's copies are done when queued: nothing to wait for, recording or not (the CUDA backend
    // refuses a wait for a copy still running).
    void device_wait(uint64_t ticket) override { inner_->device_wait(ticket); }
    double peak_flops(bool bf16, std::string* how) const override { return inner_->peak_flops(bf16, how); }
    double peak_bandwidth(std::string* how) const override { return inner_->peak_bandwidth(how); }
    int64_t device_peak_bytes() const override { return inner_->device_peak_bytes(); }
    bool gemm_operands_bf16() const override { return inner_->gemm_operands_bf16(); }
    void begin_activity() override { inner_->begin_activity(); }
    Activity end_activity() override { return inner_->end_activity(); }

    bool can_capture() const override { return true; }
    void begin_capture() override {
        if (capturing_) throw std::logic_error("a graph is already being recorded");
        capturing_ = true;
        fault_.clear();
        tape_.clear();
    }
    int end_capture() override {
        capturing_ = false;
        if (!fault_.empty()) throw std::runtime_error(fault_ + " while recording");
        graphs_.push_back(std::move(tape_));
        tape_.clear();
        return static_cast<int>(graphs_.size()) - 1;
    }
    void abort_capture() override {
        capturing_ = false;
        tape_.clear();
    }
    void launch_graph(int id) override {
        no_capture("launching a graph");
        if (id < 0 || static_cast<size_t>(id) >= graphs_.size()) throw std::logic_error("no such graph");
        for (const auto& op : graphs_[static_cast<size_t>(id)]) op();
        ++launches_;
    }
    uint64_t graph_epoch() const override { return epoch_; }

    void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                        int N) override {
        queue([=] { inner_->matmul_forward(out, inp, weight, bias, M, K, N); });
    }
    void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp) override {
        queue([=] { inner_->matmul_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp); });
    }
    void matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                 const float* bias, int M, int K, int N, float* scratch) override {
        queue([=] { inner_->matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); });
    }
    void hold_weight(const float* w) override {
        queue([=] { inner_->hold_weight(w); });
    }
    void matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight, const float* bias,
                             int M, int K, int N, bool tanh_approx) override {
        queue([=] { inner_->matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); });
    }
    void matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias, GemmOperand dout,
                              GemmOperand act, const float* weight, GemmOperand pre, int M, int K, int N,
                              bool tanh_approx) override {
        queue([=] {
            inner_->matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
        });
    }
    void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T,
                           int C) override {
        queue([=] { inner_->embedding_forward(out, tokens, wte, wpe, N, T, C); });
    }
    void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T,
                            int C) override {
        queue([=] { inner_->embedding_backward(dwte, dwpe, dout, tokens, N, T, C); });
    }
    void layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp, const float* weight,
                           const float* bias, int N, int C, float eps, NormKind kind) override {
        queue([=] { inner_->layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, eps, kind); });
    }
    void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C,
                            NormKind kind) override {
        queue([=] { inner_->layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind); });
    }
    void norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd, int N, int C,
                                   NormKind kind) override {
        queue([=] { inner_->norm_backward_from_output(dinp, dout, out, rstd, N, C, kind); });
    }
    void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                               const float* weight, const float* bias, int N, int C, float eps,
                               NormKind kind) override {
        queue([=] { inner_->norm_residual_forward(out, resid, mean, rstd, inp, weight, bias, N, C, eps, kind); });
    }
    void norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout, GemmOperand inp,
                                const float* weight, const float* mean, const float* rstd, int N, int C,
                                NormKind kind) override {
        queue([=] { inner_->norm_residual_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind); });
    }
    void qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd, const float* q_weight,
                         const float* q_bias, const float* k_weight, const float* k_bias, int N, int C, int KV,
                         float eps, NormKind kind) override {
        queue([=] {
            inner_->qk_norm_forward(qkv, qk, mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, kind);
        });
    }
    void qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                          GemmOperand qk, const float* q_weight, const float* k_weight, const float* mean,
                          const float* rstd, int N, int C, int KV, NormKind kind) override {
        queue([=] {
            inner_->qk_norm_backward(dqkv, dq_weight, dq_bias, dk_weight, dk_bias, qk, q_weight, k_weight, mean, rstd,
                                     N, C, KV, kind);
        });
    }
    void kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) override {
        queue([=] { inner_->kv_heads_expand(out, inp, N, NH, KVH, HS); });
    }
    void kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) override {
        queue([=] { inner_->kv_heads_reduce(dinp, dout, N, NH, KVH, HS); });
    }
    void rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) override {
        queue([=] { inner_->rope_forward(qkv, B, T, NH, HS, theta); });
    }
    void rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) override {
        queue([=] { inner_->rope_backward(dqkv, B, T, NH, HS, theta); });
    }
    void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta,
                         int S) override {
        queue([=] { inner_->rope_forward_at(qkv, positions, N, NH, KVH, HS, theta, S); });
    }
    void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                              const int32_t* positions, int N, int NH, int KVH, int HS, int S) override {
        queue([=] { inner_->attention_with_cache(out, qkv, kcache, vcache, seqs, positions, N, NH, KVH, HS, S); });
    }
    void attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) override {
        queue([=] { inner_->attention_forward(out, lse, qkv, B, T, NH, HS); });
    }
    void attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out, const float* lse,
                            int B, int T, int NH, int HS) override {
        queue([=] { inner_->attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS); });
    }
    void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) override {
        queue([=] { inner_->gelu_forward(out, inp, n, tanh_approx); });
    }
    void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) override {
        queue([=] { inner_->gelu_backward(dinp, inp, dout, n, tanh_approx); });
    }
    void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) override {
        queue([=] { inner_->swiglu_forward(out, inp, N, H); });
    }
    void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) override {
        queue([=] { inner_->swiglu_backward(dinp, inp, dout, N, H); });
    }
    void residual_forward(float* out, const float* a, const float* b, size_t n) override {
        queue([=] { inner_->residual_forward(out, a, b, n); });
    }
    void scale_inplace(float* x, size_t n, float s) override {
        queue([=] { inner_->scale_inplace(x, n, s); });
    }
    void classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                     float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                     float* z_losses) override {
        queue([=] {
            inner_->classifier_forward_backward(logits, losses, targets, N, V, dloss_scale, compute_grad,
                                                z_loss_multiplier, z_losses);
        });
    }
    void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) override {
        no_capture("the optimizer step");
        inner_->adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, param_bf16);
    }
    void adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2, float eps,
                            long step, float grad_scale) override {
        no_capture("the optimizer step");
        inner_->adamw_update_multi(ranges, lr, beta1, beta2, eps, step, grad_scale);
    }
    double squared_norm(const float* x, size_t n) override {
        no_capture("a squared norm returned to the host");
        return inner_->squared_norm(x, n);
    }
    double squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) override {
        no_capture("a squared norm returned to the host");
        return inner_->squared_norm_multi(ranges);
    }
    double sum(const float* x, size_t n) override {
        no_capture("a sum returned to the host");
        return inner_->sum(x, n);
    }
    void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) override {
        queue([=] { inner_->cast_float_to_bf16(out, in, n); });
    }
    void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) override {
        queue([=] { inner_->cast_bf16_to_float(out, in, n); });
    }
    void round_to_bf16(float* out, const float* in, size_t n) override {
        queue([=] { inner_->round_to_bf16(out, in, n); });
    }

   private:
    void no_capture(const char* what) const {
        if (capturing_) throw std::runtime_error(std::string(what) + " while recording");
    }
    // Recorded while capturing (nothing runs), else run now.
    void queue(std::function<void()> op) {
        if (!capturing_) return op();
        tape_.push_back(std::move(op));
        ++recorded_ops_;
    }

    std::unique_ptr<Backend> inner_;
    bool capturing_ = false;
    std::string fault_;
    std::vector<std::function<void()>> tape_;
    std::vector<std::vector<std::function<void()>>> graphs_;
    uint64_t epoch_ = 0;
    long launches_ = 0, recorded_ops_ = 0;
};

}  // namespace test_util
