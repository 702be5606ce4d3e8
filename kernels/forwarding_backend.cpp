// The forwarding backend (see forwarding_backend.h): each device op's name and shape, and the call itself.
#include "kernels/forwarding_backend.h"

#include <fmt/format.h>

#include <initializer_list>

namespace trainer {

namespace {

OpCall row(const char* op, std::string shape, std::optional<GemmShape> gemm = {}) {
    return OpCall{op, std::move(shape), true, gemm};
}

// An op that is no row of bench-kernels' (copies, casts, scaling, sums, generation): forwarded, and recorded by the
// tests' graph recorder.
OpCall plain(const char* op) { return OpCall{op, {}, false, {}}; }

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

void ForwardingBackend::matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M,
                                       int K, int N) {
    dispatch(row("matmul_forward", gemm_shape(M, K, N, bias, {out, inp}), GemmShape{M, K, N, false}),
             [=](Backend& b) { b.matmul_forward(out, inp, weight, bias, M, K, N); });
}

void ForwardingBackend::matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout,
                                        GemmOperand inp, const float* weight, int M, int K, int N,
                                        bool accumulate_dinp) {
    const char* input_grad = dinp.p == nullptr ? ", no input gradient" : accumulate_dinp ? ", input gradient +=" : "";
    dispatch(
        row("matmul_backward", gemm_shape(M, K, N, dbias, {dinp, dout, inp}) + input_grad, GemmShape{M, K, N, true}),
        [=](Backend& b) { b.matmul_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp); });
}

void ForwardingBackend::matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                                const float* bias, int M, int K, int N, float* scratch) {
    dispatch(row("matmul_residual_forward", gemm_shape(M, K, N, bias, {inp})),
             [=](Backend& b) { b.matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); });
    fused_parts([&] { Backend::matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); });
}

void ForwardingBackend::matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight,
                                            const float* bias, int M, int K, int N, bool tanh_approx) {
    dispatch(
        row("matmul_gelu_forward", gemm_shape(M, K, N, bias, {pre, out, inp}) + (tanh_approx ? ", tanh" : ", erf")),
        [=](Backend& b) { b.matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); });
    fused_parts([&] { Backend::matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); });
}

void ForwardingBackend::matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias,
                                             GemmOperand dout, GemmOperand act, const float* weight, GemmOperand pre,
                                             int M, int K, int N, bool tanh_approx) {
    dispatch(row("matmul_gelu_backward",
                 gemm_shape(M, K, N, dbias, {dpre, dact, dout, act, pre}) + (tanh_approx ? ", tanh" : ", erf")),
             [=](Backend& b) {
                 b.matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
             });
    fused_parts([&] {
        Backend::matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
    });
}

void ForwardingBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N,
                                          int T, int C) {
    dispatch(row("embedding_forward", fmt::format("N {}, C {}{}", N, C, wpe != nullptr ? ", positions" : "")),
             [=](Backend& b) { b.embedding_forward(out, tokens, wte, wpe, N, T, C); });
}

void ForwardingBackend::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N,
                                           int T, int C) {
    dispatch(row("embedding_backward", fmt::format("N {}, C {}{}", N, C, dwpe != nullptr ? ", positions" : "")),
             [=](Backend& b) { b.embedding_backward(dwte, dwpe, dout, tokens, N, T, C); });
}

void ForwardingBackend::layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp,
                                          const float* weight, const float* bias, int N, int C, float eps,
                                          NormKind kind) {
    dispatch(row("layernorm_forward", rows_shape(N, C, weight, {out})),
             [=](Backend& b) { b.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, eps, kind); });
}

void ForwardingBackend::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                           const float* inp, const float* weight, const float* mean, const float* rstd,
                                           int N, int C, NormKind kind) {
    dispatch(row("layernorm_backward", rows_shape(N, C, weight, {})), [=](Backend& b) {
        b.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind);
    });
}

void ForwardingBackend::norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd,
                                                  int N, int C, NormKind kind) {
    dispatch(row("norm_backward_from_output", rows_shape(N, C, nullptr, {out})),
             [=](Backend& b) { b.norm_backward_from_output(dinp, dout, out, rstd, N, C, kind); });
}

void ForwardingBackend::norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                                              const float* weight, const float* bias, int N, int C, float eps,
                                              NormKind kind) {
    dispatch(row("norm_residual_forward", rows_shape(N, C, weight, {inp})),
             [=](Backend& b) { b.norm_residual_forward(out, resid, mean, rstd, inp, weight, bias, N, C, eps, kind); });
}

void ForwardingBackend::norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout,
                                               GemmOperand inp, const float* weight, const float* mean,
                                               const float* rstd, int N, int C, NormKind kind) {
    dispatch(row("norm_residual_backward", rows_shape(N, C, weight, {dinp, inp})), [=](Backend& b) {
        b.norm_residual_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind);
    });
}

void ForwardingBackend::qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd,
                                        const float* q_weight, const float* q_bias, const float* k_weight,
                                        const float* k_bias, int N, int C, int KV, float eps, NormKind kind) {
    dispatch(row("qk_norm_forward", rows_shape(N, C, q_weight, {qkv, qk}) + kv_width(C, KV)), [=](Backend& b) {
        b.qk_norm_forward(qkv, qk, mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, kind);
    });
}

void ForwardingBackend::qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight,
                                         float* dk_bias, GemmOperand qk, const float* q_weight, const float* k_weight,
                                         const float* mean, const float* rstd, int N, int C, int KV, NormKind kind) {
    dispatch(row("qk_norm_backward", rows_shape(N, C, q_weight, {dqkv, qk}) + kv_width(C, KV)), [=](Backend& b) {
        b.qk_norm_backward(dqkv, dq_weight, dq_bias, dk_weight, dk_bias, qk, q_weight, k_weight, mean, rstd, N, C, KV,
                           kind);
    });
}

void ForwardingBackend::kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) {
    dispatch(row("kv_heads_expand", shared_heads_shape(N, NH, KVH, HS, {out, inp})),
             [=](Backend& b) { b.kv_heads_expand(out, inp, N, NH, KVH, HS); });
}

void ForwardingBackend::kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) {
    dispatch(row("kv_heads_reduce", shared_heads_shape(N, NH, KVH, HS, {dinp, dout})),
             [=](Backend& b) { b.kv_heads_reduce(dinp, dout, N, NH, KVH, HS); });
}

void ForwardingBackend::rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) {
    dispatch(row("rope_forward", heads_shape(B, T, NH, HS, {qkv})),
             [=](Backend& b) { b.rope_forward(qkv, B, T, NH, HS, theta); });
}

void ForwardingBackend::rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) {
    dispatch(row("rope_backward", heads_shape(B, T, NH, HS, {dqkv})),
             [=](Backend& b) { b.rope_backward(dqkv, B, T, NH, HS, theta); });
}

void ForwardingBackend::attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) {
    dispatch(row("attention_forward", heads_shape(B, T, NH, HS, {out, qkv})),
             [=](Backend& b) { b.attention_forward(out, lse, qkv, B, T, NH, HS); });
}

void ForwardingBackend::attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out,
                                           const float* lse, int B, int T, int NH, int HS) {
    dispatch(row("attention_backward", heads_shape(B, T, NH, HS, {dqkv, dout, qkv, out})),
             [=](Backend& b) { b.attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS); });
}

void ForwardingBackend::gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) {
    dispatch(row("gelu_forward", fmt::format("n {}{}{}", n, tanh_approx ? ", tanh" : ", erf", storage({out, inp}))),
             [=](Backend& b) { b.gelu_forward(out, inp, n, tanh_approx); });
}

void ForwardingBackend::gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) {
    dispatch(
        row("gelu_backward", fmt::format("n {}{}{}", n, tanh_approx ? ", tanh" : ", erf", storage({dinp, inp, dout}))),
        [=](Backend& b) { b.gelu_backward(dinp, inp, dout, n, tanh_approx); });
}

void ForwardingBackend::swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) {
    dispatch(row("swiglu_forward", fmt::format("N {}, H {}{}", N, H, storage({out, inp}))),
             [=](Backend& b) { b.swiglu_forward(out, inp, N, H); });
}

void ForwardingBackend::swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) {
    dispatch(row("swiglu_backward", fmt::format("N {}, H {}{}", N, H, storage({dinp, inp, dout}))),
             [=](Backend& b) { b.swiglu_backward(dinp, inp, dout, N, H); });
}

void ForwardingBackend::residual_forward(float* out, const float* a, const float* b_, size_t n) {
    dispatch(row("residual_forward", fmt::format("n {}", n)), [=](Backend& b) { b.residual_forward(out, a, b_, n); });
}

void ForwardingBackend::classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N,
                                                    int V, float dloss_scale, bool compute_grad,
                                                    float z_loss_multiplier, float* z_losses) {
    dispatch(
        row("classifier_forward_backward", fmt::format("N {}, V {}{}{}{}", N, V, compute_grad ? "" : ", no gradient",
                                                       z_loss_multiplier > 0.0f ? ", z-loss" : "", storage({logits}))),
        [=](Backend& b) {
            b.classifier_forward_backward(logits, losses, targets, N, V, dloss_scale, compute_grad, z_loss_multiplier,
                                          z_losses);
        });
}

void ForwardingBackend::adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                                     float beta1, float beta2, float eps, float weight_decay, long step,
                                     float grad_scale, uint16_t* param_bf16) {
    dispatch(
        row("adamw_update", fmt::format("n {}{}", n, param_bf16 != nullptr ? ", bf16 copy" : "")), [=](Backend& b) {
            b.adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, param_bf16);
        });
}

void ForwardingBackend::adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2,
                                           float eps, long step, float grad_scale) {
    size_t n = 0;
    bool bf16 = false;
    for (const AdamwRange& r : ranges) n += r.n, bf16 = bf16 || r.param_bf16 != nullptr;
    dispatch(row("adamw_update_multi", fmt::format("{} ranges, n {}{}", ranges.size(), n, bf16 ? ", bf16 copies" : "")),
             [=](Backend& b) { b.adamw_update_multi(ranges, lr, beta1, beta2, eps, step, grad_scale); });
}

double ForwardingBackend::squared_norm(const float* x, size_t n) {
    double result = 0.0;
    dispatch(row("squared_norm", fmt::format("n {}", n)), [=, &result](Backend& b) { result = b.squared_norm(x, n); });
    return result;
}

double ForwardingBackend::squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) {
    size_t n = 0;
    for (const auto& r : ranges) n += r.second;
    double result = 0.0;
    dispatch(row("squared_norm_multi", fmt::format("{} ranges, n {}", ranges.size(), n)),
             [=, &result](Backend& b) { result = b.squared_norm_multi(ranges); });
    return result;
}

void ForwardingBackend::copy_device_to_device(void* dst, const void* src, size_t bytes) {
    dispatch(plain("copy_device_to_device"), [=](Backend& b) { b.copy_device_to_device(dst, src, bytes); });
}

void ForwardingBackend::fill_zero(void* ptr, size_t bytes) {
    dispatch(plain("fill_zero"), [=](Backend& b) { b.fill_zero(ptr, bytes); });
}

void ForwardingBackend::hold_weight(const float* w) {
    dispatch(plain("hold_weight"), [=](Backend& b) { b.hold_weight(w); });
}

void ForwardingBackend::rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS,
                                        float theta, int S) {
    dispatch(plain("rope_forward_at"),
             [=](Backend& b) { b.rope_forward_at(qkv, positions, N, NH, KVH, HS, theta, S); });
}

void ForwardingBackend::attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache,
                                             const int32_t* seqs, const int32_t* positions, int N, int NH, int KVH,
                                             int HS, int S) {
    dispatch(plain("attention_with_cache"),
             [=](Backend& b) { b.attention_with_cache(out, qkv, kcache, vcache, seqs, positions, N, NH, KVH, HS, S); });
}

void ForwardingBackend::scale_inplace(float* x, size_t n, float s) {
    dispatch(plain("scale_inplace"), [=](Backend& b) { b.scale_inplace(x, n, s); });
}

double ForwardingBackend::sum(const float* x, size_t n) {
    double result = 0.0;
    dispatch(plain("sum"), [=, &result](Backend& b) { result = b.sum(x, n); });
    return result;
}

void ForwardingBackend::cast_float_to_bf16(uint16_t* out, const float* in, size_t n) {
    dispatch(plain("cast_float_to_bf16"), [=](Backend& b) { b.cast_float_to_bf16(out, in, n); });
}

void ForwardingBackend::cast_bf16_to_float(float* out, const uint16_t* in, size_t n) {
    dispatch(plain("cast_bf16_to_float"), [=](Backend& b) { b.cast_bf16_to_float(out, in, n); });
}

void ForwardingBackend::round_to_bf16(float* out, const float* in, size_t n) {
    dispatch(plain("round_to_bf16"), [=](Backend& b) { b.round_to_bf16(out, in, n); });
}

}  // namespace trainer
