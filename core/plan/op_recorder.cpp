// The op recorder (see op_recorder.h).
#include "core/plan/op_recorder.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "base/common.h"

namespace trainer {
namespace {

// ", bf16" where any of the operands is stored in bf16 (the costs differ: keys stay apart, and so do the rows).
std::string storage(std::initializer_list<GemmOperand> operands) {
    for (const GemmOperand& g : operands) {
        if (g.bf16) return ", bf16";
    }
    return "";
}

std::string gemm_shape(int M, int K, int N, const float* bias, std::initializer_list<GemmOperand> operands) {
    return fmt::format("M {}, K {}, N {}{}{}", M, K, N, bias != nullptr ? ", bias" : "", storage(operands));
}

std::string rows_shape(int N, int C, const float* weight, std::initializer_list<GemmOperand> operands) {
    return fmt::format("N {}, C {}{}{}", N, C, weight != nullptr ? ", weight" : "", storage(operands));
}

// The k width where grouped-query attention narrows it (the QK-norms).
std::string kv_width(int C, int KV) { return KV == C ? std::string() : fmt::format(", k {}", KV); }

std::string heads_shape(int B, int T, int NH, int HS, std::initializer_list<GemmOperand> operands) {
    return fmt::format("B {}, T {}, {} heads of {}{}", B, T, NH, HS, storage(operands));
}

// Grouped-query attention's rows: NH query heads on KVH shared key/value heads.
std::string shared_heads_shape(int N, int NH, int KVH, int HS, std::initializer_list<GemmOperand> operands) {
    return fmt::format("N {}, {} heads of {} on {} shared{}", N, NH, HS, KVH, storage(operands));
}

}  // namespace

std::string RecordedOp::cost_op() const {
    for (const std::string& op : cost_ops) {
        if (op != cost_ops.front()) return "";
    }
    return cost_ops.empty() ? "" : cost_ops.front();
}

std::string RecordedOp::key() const { return fmt::format("{}|{}|{}|{}", op, shape, flops, bytes); }

OpRecorder::OpRecorder(Backend& inner, OpTimer timer)
    : inner_(inner),
      timer_(std::move(timer)),
      costs_backend_(make_dry_backend([this](const OpCost& c) { costs_.push_back(c); }, inner.gemm_operands_bf16())) {}

OpRecorder::~OpRecorder() = default;

void OpRecorder::record(const char* op, std::string shape, const std::function<void(Backend&)>& run,
                        std::optional<RecordedOp::Gemm> gemm) {
    costs_.clear();
    run(*costs_backend_);
    RecordedOp r;
    r.op = op, r.shape = std::move(shape), r.gemm = gemm;
    for (const OpCost& c : costs_) r.flops += c.flops, r.bytes += c.bytes;
    for (const OpCost& c : costs_) r.cost_ops.emplace_back(c.op);
    const auto [at, added] = by_key_.emplace(r.key(), ops_.size());
    if (added) {
        if (timer_) {
            r.seconds = timer_([&] { run(inner_); });
            if (gemm) time_ceiling(r);
        }
        ops_.push_back(std::move(r));
    }
    if (in_parts_) return;
    ++ops_[at->second].calls;
    run(inner_);
}

void OpRecorder::record_parts(const std::function<void()>& run_parts) {
    in_parts_ = true;
    try {
        run_parts();
    } catch (...) {
        in_parts_ = false;
        throw;
    }
    in_parts_ = false;
}

// The peers' bf16 Linear at a GEMM's shape (Backend::linear_bf16_reference_*), on bf16 operands of its own that
// every shape shares: pseudo-random values in [0.001, 0.1) (zeros can run faster than data: a bf16 GEMM was seen
// 13% faster on zeros on an H200), one pattern uploaded, then tiled.
void OpRecorder::time_ceiling(RecordedOp& r) {
    if (!inner_.has_linear_bf16_reference()) return;
    const auto [M, K, N, backward] = *r.gemm;
    const size_t mk = size_t(M) * K, nk = size_t(N) * K, mn = size_t(M) * N;
    if (mk > ref_mk_ || nk > ref_nk_ || mn > ref_mn_) {
        ref_mk_ = std::max(ref_mk_, mk), ref_nk_ = std::max(ref_nk_, nk), ref_mn_ = std::max(ref_mn_, mn);
        std::vector<uint16_t> pattern(size_t{1} << 16);
        uint64_t lcg = 0x9E3779B97F4A7C15ull;
        for (uint16_t& v : pattern) {
            lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
            const float f = static_cast<float>(0.001 + 0.099 * static_cast<double>(lcg >> 11) * 0x1.0p-53);
            uint32_t bits = 0;
            std::memcpy(&bits, &f, sizeof bits);
            v = static_cast<uint16_t>(bits >> 16);
        }
        const size_t pattern_bytes = pattern.size() * sizeof(uint16_t);
        DeviceBuffer pattern_dev(&inner_, pattern_bytes, MemCategory::kOther);
        inner_.copy_host_to_device(pattern_dev.data(), pattern.data(), pattern_bytes);
        const auto filled = [&](size_t n) {
            DeviceBuffer b(&inner_, n * sizeof(uint16_t), MemCategory::kOther);
            for (size_t at = 0; at < b.bytes(); at += pattern_bytes) {
                inner_.copy_device_to_device(static_cast<char*>(b.data()) + at, pattern_dev.data(),
                                             std::min(pattern_bytes, b.bytes() - at));
            }
            return b;
        };
        ref_in_ = filled(ref_mk_), ref_w_ = filled(ref_nk_), ref_out_ = filled(ref_mn_);
        ref_dout_ = filled(ref_mn_), ref_din_ = filled(ref_mk_), ref_dw_ = filled(ref_nk_);
    }
    // The first call says whether the backend has a GEMM for the shape (it runs nothing where not).
    const auto run = [&, M = M, K = K, N = N, backward = backward] {
        if (backward) {
            return inner_.linear_bf16_reference_backward(ref_din_.bf16(), ref_dw_.bf16(), ref_dout_.bf16(),
                                                         ref_in_.bf16(), ref_w_.bf16(), M, K, N);
        }
        return inner_.linear_bf16_reference_forward(ref_out_.bf16(), ref_in_.bf16(), ref_w_.bf16(), M, K, N);
    };
    if (run()) r.ceiling_seconds = timer_([&] { run(); });
}

void OpRecorder::matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                                int N) {
    record(
        "matmul_forward", gemm_shape(M, K, N, bias, {out, inp}),
        [=](Backend& b) { b.matmul_forward(out, inp, weight, bias, M, K, N); }, RecordedOp::Gemm{M, K, N, false});
}

void OpRecorder::matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                                 const float* weight, int M, int K, int N, bool accumulate_dinp) {
    const char* input_grad = dinp.p == nullptr ? ", no input gradient" : accumulate_dinp ? ", input gradient +=" : "";
    record(
        "matmul_backward", gemm_shape(M, K, N, dbias, {dinp, dout, inp}) + input_grad,
        [=](Backend& b) { b.matmul_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp); },
        RecordedOp::Gemm{M, K, N, true});
}

void OpRecorder::matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                         const float* bias, int M, int K, int N, float* scratch) {
    record("matmul_residual_forward", gemm_shape(M, K, N, bias, {inp}),
           [=](Backend& b) { b.matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); });
    record_parts([&] { Backend::matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); });
}

void OpRecorder::matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight,
                                     const float* bias, int M, int K, int N, bool tanh_approx) {
    record("matmul_gelu_forward", gemm_shape(M, K, N, bias, {pre, out, inp}) + (tanh_approx ? ", tanh" : ", erf"),
           [=](Backend& b) { b.matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); });
    record_parts([&] { Backend::matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); });
}

void OpRecorder::matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias,
                                      GemmOperand dout, GemmOperand act, const float* weight, GemmOperand pre, int M,
                                      int K, int N, bool tanh_approx) {
    record("matmul_gelu_backward",
           gemm_shape(M, K, N, dbias, {dpre, dact, dout, act, pre}) + (tanh_approx ? ", tanh" : ", erf"),
           [=](Backend& b) {
               b.matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
           });
    record_parts([&] {
        Backend::matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
    });
}

void OpRecorder::embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T,
                                   int C) {
    record("embedding_forward", fmt::format("N {}, C {}{}", N, C, wpe != nullptr ? ", positions" : ""),
           [=](Backend& b) { b.embedding_forward(out, tokens, wte, wpe, N, T, C); });
}

void OpRecorder::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T,
                                    int C) {
    record("embedding_backward", fmt::format("N {}, C {}{}", N, C, dwpe != nullptr ? ", positions" : ""),
           [=](Backend& b) { b.embedding_backward(dwte, dwpe, dout, tokens, N, T, C); });
}

void OpRecorder::layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp, const float* weight,
                                   const float* bias, int N, int C, float eps, NormKind kind) {
    record("layernorm_forward", rows_shape(N, C, weight, {out}),
           [=](Backend& b) { b.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, eps, kind); });
}

void OpRecorder::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                    const float* weight, const float* mean, const float* rstd, int N, int C,
                                    NormKind kind) {
    record("layernorm_backward", rows_shape(N, C, weight, {}),
           [=](Backend& b) { b.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind); });
}

void OpRecorder::norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd, int N,
                                           int C, NormKind kind) {
    record("norm_backward_from_output", rows_shape(N, C, nullptr, {out}),
           [=](Backend& b) { b.norm_backward_from_output(dinp, dout, out, rstd, N, C, kind); });
}

void OpRecorder::norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                                       const float* weight, const float* bias, int N, int C, float eps, NormKind kind) {
    record("norm_residual_forward", rows_shape(N, C, weight, {inp}),
           [=](Backend& b) { b.norm_residual_forward(out, resid, mean, rstd, inp, weight, bias, N, C, eps, kind); });
}

void OpRecorder::norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout,
                                        GemmOperand inp, const float* weight, const float* mean, const float* rstd,
                                        int N, int C, NormKind kind) {
    record("norm_residual_backward", rows_shape(N, C, weight, {dinp, inp}), [=](Backend& b) {
        b.norm_residual_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind);
    });
}

void OpRecorder::qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd, const float* q_weight,
                                 const float* q_bias, const float* k_weight, const float* k_bias, int N, int C, int KV,
                                 float eps, NormKind kind) {
    record("qk_norm_forward", rows_shape(N, C, q_weight, {qkv, qk}) + kv_width(C, KV), [=](Backend& b) {
        b.qk_norm_forward(qkv, qk, mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, kind);
    });
}

void OpRecorder::qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                                  GemmOperand qk, const float* q_weight, const float* k_weight, const float* mean,
                                  const float* rstd, int N, int C, int KV, NormKind kind) {
    record("qk_norm_backward", rows_shape(N, C, q_weight, {dqkv, qk}) + kv_width(C, KV), [=](Backend& b) {
        b.qk_norm_backward(dqkv, dq_weight, dq_bias, dk_weight, dk_bias, qk, q_weight, k_weight, mean, rstd, N, C, KV,
                           kind);
    });
}

void OpRecorder::kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) {
    record("kv_heads_expand", shared_heads_shape(N, NH, KVH, HS, {out, inp}),
           [=](Backend& b) { b.kv_heads_expand(out, inp, N, NH, KVH, HS); });
}

void OpRecorder::kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) {
    record("kv_heads_reduce", shared_heads_shape(N, NH, KVH, HS, {dinp, dout}),
           [=](Backend& b) { b.kv_heads_reduce(dinp, dout, N, NH, KVH, HS); });
}

void OpRecorder::rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) {
    record("rope_forward", heads_shape(B, T, NH, HS, {qkv}),
           [=](Backend& b) { b.rope_forward(qkv, B, T, NH, HS, theta); });
}

void OpRecorder::rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) {
    record("rope_backward", heads_shape(B, T, NH, HS, {dqkv}),
           [=](Backend& b) { b.rope_backward(dqkv, B, T, NH, HS, theta); });
}

void OpRecorder::attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) {
    record("attention_forward", heads_shape(B, T, NH, HS, {out, qkv}),
           [=](Backend& b) { b.attention_forward(out, lse, qkv, B, T, NH, HS); });
}

void OpRecorder::attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out,
                                    const float* lse, int B, int T, int NH, int HS) {
    record("attention_backward", heads_shape(B, T, NH, HS, {dqkv, dout, qkv, out}),
           [=](Backend& b) { b.attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS); });
}

void OpRecorder::gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) {
    record("gelu_forward", fmt::format("n {}{}{}", n, tanh_approx ? ", tanh" : ", erf", storage({out, inp})),
           [=](Backend& b) { b.gelu_forward(out, inp, n, tanh_approx); });
}

void OpRecorder::gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) {
    record("gelu_backward", fmt::format("n {}{}{}", n, tanh_approx ? ", tanh" : ", erf", storage({dinp, inp, dout})),
           [=](Backend& b) { b.gelu_backward(dinp, inp, dout, n, tanh_approx); });
}

void OpRecorder::swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) {
    record("swiglu_forward", fmt::format("N {}, H {}{}", N, H, storage({out, inp})),
           [=](Backend& b) { b.swiglu_forward(out, inp, N, H); });
}

void OpRecorder::swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) {
    record("swiglu_backward", fmt::format("N {}, H {}{}", N, H, storage({dinp, inp, dout})),
           [=](Backend& b) { b.swiglu_backward(dinp, inp, dout, N, H); });
}

void OpRecorder::residual_forward(float* out, const float* a, const float* b_, size_t n) {
    record("residual_forward", fmt::format("n {}", n), [=](Backend& b) { b.residual_forward(out, a, b_, n); });
}

void OpRecorder::classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                             float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                             float* z_losses) {
    record("classifier_forward_backward",
           fmt::format("N {}, V {}{}{}{}", N, V, compute_grad ? "" : ", no gradient",
                       z_loss_multiplier > 0.0f ? ", z-loss" : "", storage({logits})),
           [=](Backend& b) {
               b.classifier_forward_backward(logits, losses, targets, N, V, dloss_scale, compute_grad,
                                             z_loss_multiplier, z_losses);
           });
}

void OpRecorder::adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1,
                              float beta2, float eps, float weight_decay, long step, float grad_scale,
                              uint16_t* param_bf16) {
    record("adamw_update", fmt::format("n {}{}", n, param_bf16 != nullptr ? ", bf16 copy" : ""), [=](Backend& b) {
        b.adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, param_bf16);
    });
}

void OpRecorder::adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2,
                                    float eps, long step, float grad_scale) {
    size_t n = 0;
    bool bf16 = false;
    for (const AdamwRange& r : ranges) n += r.n, bf16 = bf16 || r.param_bf16 != nullptr;
    record("adamw_update_multi", fmt::format("{} ranges, n {}{}", ranges.size(), n, bf16 ? ", bf16 copies" : ""),
           [=](Backend& b) { b.adamw_update_multi(ranges, lr, beta1, beta2, eps, step, grad_scale); });
}

double OpRecorder::squared_norm(const float* x, size_t n) {
    double result = 0.0;
    record("squared_norm", fmt::format("n {}", n), [=, &result](Backend& b) { result = b.squared_norm(x, n); });
    return result;
}

double OpRecorder::squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) {
    size_t n = 0;
    for (const auto& r : ranges) n += r.second;
    double result = 0.0;
    record("squared_norm_multi", fmt::format("{} ranges, n {}", ranges.size(), n),
           [=, &result](Backend& b) { result = b.squared_norm_multi(ranges); });
    return result;
}

}  // namespace trainer
