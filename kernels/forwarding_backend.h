// A Backend that passes every call to another: the base of the decorators that watch a step's ops (the plan's op
// recorder, the tests' graph recorder), so that each overrides only what it intercepts and a new op is forwarded
// in one place. Every op that runs on the device's stream goes through one hook, dispatch(), with its name and,
// for the ops bench-kernels prints as rows, its shape; memory, host copies, queries and the values returned to the
// host are forwarded straight (each overridable). Header-only, so that a new op is forwarded, named and shaped in this
// one file.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/element.h"

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
    // What the call costs, counted as the dry backend counts (make_dry_backend): FLOPs as the kernels' arithmetic (a
    // multiply-add is 2), bytes as each operand read once and each result written once (parameter gradients, which
    // accumulate, read and written), at each operand's storage size. One entry an op; a multi-tensor op has one
    // for each of its ranges, named for the single op; a fused op has none (its parts are counted).
    std::vector<OpCost> costs;

    OpCall cost(double flops, double bytes) && {
        costs.push_back(OpCost{op, flops, bytes});
        return std::move(*this);
    }
    // A cost of a part the op runs inside itself, priced as an op of its own (amp_fp8's casts in its GEMMs).
    OpCall cost_of(const char* part, double flops, double bytes) && {
        costs.push_back(OpCost{part, flops, bytes});
        return std::move(*this);
    }
};

class ForwardingBackend : public Backend {
   public:
    explicit ForwardingBackend(Backend& inner) : inner_(&inner) {}
    Backend& inner() const {
        TRAINER_CHECK(inner_ != nullptr, "a forwarding backend without an inner backend must override this member");
        return *inner_;
    }

    // Every device op: `run` calls the op on the backend it is given. The default runs it on the inner backend.
    virtual void dispatch(const OpCall& call, const std::function<void(Backend&)>& run) {
        (void)call;
        run(inner());
    }
    // A fused op's parts: `parts` runs Backend's default body of the op on this backend (its separate ops, each
    // through dispatch). Called after the fused op's dispatch; the default runs nothing.
    virtual void fused_parts(const std::function<void()>& parts) { (void)parts; }

    std::string name() const override { return inner().name(); }
    void* alloc(size_t bytes) override { return inner().alloc(bytes); }
    void free(void* ptr) override { inner().free(ptr); }
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
        inner().copy_host_to_device(dst, src, bytes);
    }
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
        inner().copy_device_to_host(dst, src, bytes);
    }
    void copy_any(void* dst, const void* src, size_t bytes) override { inner().copy_any(dst, src, bytes); }
    void synchronize() override { inner().synchronize(); }
    void* alloc_host(size_t bytes) override { return inner().alloc_host(bytes); }
    void free_host(void* ptr) override { inner().free_host(ptr); }
    uint64_t copy_async(void* dst, const void* src, size_t bytes) override {
        return inner().copy_async(dst, src, bytes);
    }
    void host_wait(uint64_t ticket) override { inner().host_wait(ticket); }
    void device_wait(uint64_t ticket) override { inner().device_wait(ticket); }
    double peak_flops(bool bf16, std::string* how) const override { return inner().peak_flops(bf16, how); }
    double peak_bandwidth(std::string* how) const override { return inner().peak_bandwidth(how); }
    int64_t device_peak_bytes() const override { return inner().device_peak_bytes(); }
    std::string library_description() const override { return inner().library_description(); }
    bool gemm_operands_bf16() const override { return inner().gemm_operands_bf16(); }
    bool gemms_read_aliases() const override { return inner().gemms_read_aliases(); }
    void begin_activity() override { inner().begin_activity(); }
    Activity end_activity() override { return inner().end_activity(); }
    std::vector<std::pair<std::string, double>> device_counters() override { return inner().device_counters(); }
    // No CUDA graphs by default: a graph recorded on the inner backend would replay its ops without passing here.
    bool can_capture() const override { return false; }
    bool has_linear_bf16_reference() const override { return inner().has_linear_bf16_reference(); }
    bool has_lora() const override { return inner().has_lora(); }
    bool has_nf4() const override { return inner().has_nf4(); }
    void nf4_dequantize(GemmOperand out, const uint8_t* codes, const float* absmax, size_t n) override;
    void nf4_dequantize_dq(GemmOperand out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                           const float* offset, size_t n) override;
    bool linear_bf16_reference_forward(uint16_t* out, const uint16_t* inp, const uint16_t* weight, int M, int K,
                                       int N) override {
        return inner().linear_bf16_reference_forward(out, inp, weight, M, K, N);
    }
    bool linear_bf16_reference_backward(uint16_t* dinp, uint16_t* dweight, const uint16_t* dout, const uint16_t* inp,
                                        const uint16_t* weight, int M, int K, int N) override {
        return inner().linear_bf16_reference_backward(dinp, dweight, dout, inp, weight, M, K, N);
    }

    // The device ops, each through dispatch().
    void copy_device_to_device(void* dst, const void* src, size_t bytes) override;
    void fill_zero(void* ptr, size_t bytes) override;
    void hold_weight(const float* w) override;
    void alias_bf16(const float* w, const uint16_t* bf16, size_t n) override;
    void set_linear_precision(LinearPrecision p) override;
    void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                        int N) override;
    void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp) override;
    void matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                 const float* bias, int M, int K, int N, float* scratch) override;
    void lora_forward(GemmOperand out, int ld_out, GemmOperand inp, const float* A, const float* B, int M, int K, int r,
                      int n, float scale, const LoraDropout& drop, float* work) override;
    void lora_backward(GemmOperand dinp, float* dA, float* dB, GemmOperand dout, int ld_dout, GemmOperand inp,
                       const float* A, const float* B, int M, int K, int r, int n, float scale, const LoraDropout& drop,
                       float* work) override;
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

   protected:
    // A backend that runs no op (the dry backend): it overrides every member that would reach the inner backend.
    ForwardingBackend() = default;

   private:
    // amp_fp8: the Linear layers' precision as set_linear_precision last set it. A GEMM called under kFp8 is its FP8
    // op ("matmul_fp8_forward", "matmul_fp8_backward": the GEMMs at the FP8 peak, their operands' amax and casts
    // as "fp8_cast") where its shape has FP8 GEMMs (fp8_linear_shape), else its plain op; its call sets the
    // precision on the backend it runs on (fp8_call), so that a recorded call run again (bench-kernels' timer, the
    // recorder's cost model) runs as it ran in the step.
    LinearPrecision linear_ = LinearPrecision::kDefault;
    std::function<void(Backend&)> fp8_call(std::function<void(Backend&)> run) const {
        if (linear_ != LinearPrecision::kFp8) return run;
        return [run = std::move(run)](Backend& b) {
            const BlockLinears fp8(&b, true);
            run(b);
        };
    }
    Backend* inner_ = nullptr;
};

// Each device op's name, shape and cost (the definitions below).
namespace op_shapes {

inline OpCall row(const char* op, std::string shape, std::optional<GemmShape> gemm = {}) {
    return OpCall{op, std::move(shape), true, gemm, {}};
}

// An op that is no row of bench-kernels' (copies, casts, scaling, sums, generation): forwarded, and recorded by the
// tests' graph recorder.
inline OpCall plain(const char* op) { return OpCall{op, {}, false, {}, {}}; }

// The bytes an element of an operand takes.
inline double bytes_of(GemmOperand x) { return x.bf16 ? 2.0 : 4.0; }

// ", bf16" where any of the operands is stored in bf16 (the costs differ: keys stay apart, and so do the rows).
inline std::string storage(std::initializer_list<GemmOperand> operands) {
    for (const GemmOperand& g : operands) {
        if (g.bf16) return ", bf16";
    }
    return "";
}

inline std::string gemm_shape(int M, int K, int N, const float* bias, std::initializer_list<GemmOperand> operands) {
    return fmt::format("M {}, K {}, N {}{}{}", M, K, N, bias != nullptr ? ", bias" : "", storage(operands));
}

inline std::string rows_shape(int N, int C, const float* weight, std::initializer_list<GemmOperand> operands) {
    return fmt::format("N {}, C {}{}{}", N, C, weight != nullptr ? ", weight" : "", storage(operands));
}

// The k width where grouped-query attention narrows it (the QK-norms).
inline std::string kv_width(int C, int KV) { return KV == C ? std::string() : fmt::format(", k {}", KV); }

inline std::string heads_shape(int B, int T, int NH, int HS, std::initializer_list<GemmOperand> operands) {
    return fmt::format("B {}, T {}, {} heads of {}{}", B, T, NH, HS, storage(operands));
}

// Grouped-query attention's rows: NH query heads on KVH shared key/value heads.
inline std::string shared_heads_shape(int N, int NH, int KVH, int HS, std::initializer_list<GemmOperand> operands) {
    return fmt::format("N {}, {} heads of {} on {} shared{}", N, NH, HS, KVH, storage(operands));
}

}  // namespace op_shapes

inline void ForwardingBackend::matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias,
                                              int M, int K, int N) {
    if (linear_ == LinearPrecision::kFp8 && fp8_linear_shape(K, N)) {
        // e4m3 codes of inp and weight (each an amax pass, unless its producer wrote inp's, and a cast pass), one
        // byte an element in the GEMM.
        const double mk = double(M) * K, nk = double(N) * K;
        const double inp_reads = inp.amax != nullptr ? 1.0 : 2.0;
        dispatch(op_shapes::row("matmul_fp8_forward",
                                op_shapes::gemm_shape(M, K, N, bias, {out, inp}) + ", fp8" +
                                    (inp.amax != nullptr ? ", input amax given" : ""),
                                GemmShape{M, K, N, false})
                     .cost(2.0 * M * K * N, mk + nk + op_shapes::bytes_of(out) * M * N + 4.0 * (bias ? N : 0))
                     .cost_of("fp8_cast", 0.0, inp_reads * op_shapes::bytes_of(inp) * mk + mk + 8.0 * nk + nk),
                 fp8_call([=](Backend& b) { b.matmul_forward(out, inp, weight, bias, M, K, N); }));
        return;
    }
    dispatch(
        op_shapes::row("matmul_forward", op_shapes::gemm_shape(M, K, N, bias, {out, inp}), GemmShape{M, K, N, false})
            .cost(2.0 * M * K * N, op_shapes::bytes_of(inp) * M * K + op_shapes::bytes_of(out) * M * N +
                                       4.0 * (double(N) * K + (bias ? N : 0))),
        fp8_call([=](Backend& b) { b.matmul_forward(out, inp, weight, bias, M, K, N); }));
}

inline void ForwardingBackend::matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout,
                                               GemmOperand inp, const float* weight, int M, int K, int N,
                                               bool accumulate_dinp) {
    const std::string input_grad = std::string(dinp.p == nullptr ? ", no input gradient"
                                               : accumulate_dinp ? ", input gradient +="
                                                                 : "") +
                                   (dweight == nullptr ? ", frozen weight" : "");
    if (linear_ == LinearPrecision::kFp8 && fp8_linear_shape(K, N)) {
        // e5m2 codes of dout (row-major for the input gradient, transposed for the weight's, from one pass), e4m3
        // of weight transposed (the input gradient) and of inp transposed (the weight gradient); an operand whose
        // producer wrote its amax is read once, not twice.
        const double mk = double(M) * K, nk = double(N) * K, mn = double(M) * N;
        const double dinp_bytes = dinp.p ? op_shapes::bytes_of(dinp) * mk * (accumulate_dinp ? 2 : 1) : 0.0;
        const double gemm_bytes = (dinp.p ? mn + nk + dinp_bytes : 0.0) + (dweight ? mn + mk + 8.0 * nk : 0.0);
        const double dout_reads = dout.amax != nullptr ? 1.0 : 2.0, inp_reads = inp.amax != nullptr ? 1.0 : 2.0;
        const double casts = dout_reads * op_shapes::bytes_of(dout) * mn + mn * ((dinp.p ? 1 : 0) + (dweight ? 1 : 0)) +
                             (dinp.p ? 9.0 * nk : 0.0) +
                             (dweight ? inp_reads * op_shapes::bytes_of(inp) * mk + mk : 0.0);
        const std::string given = dout.amax != nullptr && inp.amax != nullptr ? ", output gradient and input amax given"
                                  : dout.amax != nullptr                      ? ", output gradient amax given"
                                  : inp.amax != nullptr                       ? ", input amax given"
                                                                              : "";
        dispatch(op_shapes::row("matmul_fp8_backward",
                                op_shapes::gemm_shape(M, K, N, dbias, {dinp, dout, inp}) + input_grad + ", fp8" + given,
                                GemmShape{M, K, N, true})
                     .cost(2.0 * M * K * N * ((dinp.p ? 1 : 0) + (dweight ? 1 : 0)) + (dbias ? mn : 0),
                           gemm_bytes + (dbias ? op_shapes::bytes_of(dout) * mn + 8.0 * N : 0.0))
                     .cost_of("fp8_cast", 0.0, casts),
                 fp8_call([=](Backend& b) {
                     b.matmul_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp);
                 }));
        return;
    }
    dispatch(op_shapes::row("matmul_backward", op_shapes::gemm_shape(M, K, N, dbias, {dinp, dout, inp}) + input_grad,
                            GemmShape{M, K, N, true})
                 .cost(2.0 * M * K * N * ((dinp.p ? 1 : 0) + (dweight ? 1 : 0)) + (dbias ? double(M) * N : 0),
                       (dweight ? op_shapes::bytes_of(inp) * M * K : 0) + op_shapes::bytes_of(dout) * M * N +
                           (dinp.p ? op_shapes::bytes_of(dinp) * M * K : 0) +
                           4.0 * ((dweight ? 3.0 : 1.0) * N * K + (dbias ? 2 * N : 0))),
             fp8_call([=](Backend& b) {
                 b.matmul_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp);
             }));
}

// QLoRA's unpacking: codes, absmaxes and the values (fp32, or bf16 words), a pass over each. Not a row of
// bench-kernels' (storage, not a step's compute).
inline void ForwardingBackend::nf4_dequantize(GemmOperand out, const uint8_t* codes, const float* absmax, size_t n) {
    const double bytes = double(n) * (0.5 + op_shapes::bytes_of(out)) + 4.0 * double(n) / kNf4Block;
    dispatch(op_shapes::plain("nf4_dequantize").cost(2.0 * double(n), bytes),
             [=](Backend& b) { b.nf4_dequantize(out, codes, absmax, n); });
}

inline void ForwardingBackend::nf4_dequantize_dq(GemmOperand out, const uint8_t* codes, const uint8_t* absmax_codes,
                                                 const float* absmax2, const float* offset, size_t n) {
    const double bytes = double(n) * (0.5 + op_shapes::bytes_of(out)) + double(n) / kNf4Block;
    dispatch(op_shapes::plain("nf4_dequantize_dq").cost(2.0 * double(n), bytes),
             [=](Backend& b) { b.nf4_dequantize_dq(out, codes, absmax_codes, absmax2, offset, n); });
}

// LoRA: two rank-r GEMMs forward; backward recomputes the first and runs four (three without the input gradient),
// the dropout a pass over the input each time it is applied.
inline void ForwardingBackend::lora_forward(GemmOperand out, int ld_out, GemmOperand inp, const float* A,
                                            const float* B, int M, int K, int r, int n, float scale,
                                            const LoraDropout& drop, float* work) {
    const double mk = double(M) * K, drop_bytes = drop.p > 0.0f ? op_shapes::bytes_of(inp) * mk + 4.0 * mk : 0.0;
    dispatch(op_shapes::row("lora_forward", fmt::format("M {}, K {}, r {}, N {}{}{}", M, K, r, n,
                                                        drop.p > 0.0f ? ", dropout" : "", op_shapes::storage({inp})))
                 .cost(2.0 * M * r * (double(K) + n), op_shapes::bytes_of(inp) * mk + drop_bytes +
                                                          2.0 * op_shapes::bytes_of(out) * M * n +
                                                          4.0 * r * (double(K) + n)),
             [=](Backend& b) { b.lora_forward(out, ld_out, inp, A, B, M, K, r, n, scale, drop, work); });
}

inline void ForwardingBackend::lora_backward(GemmOperand dinp, float* dA, float* dB, GemmOperand dout, int ld_dout,
                                             GemmOperand inp, const float* A, const float* B, int M, int K, int r,
                                             int n, float scale, const LoraDropout& drop, float* work) {
    const double mk = double(M) * K, mn = double(M) * n;
    const double passes = drop.p > 0.0f ? (dinp.p ? 2.0 : 1.0) : 0.0;
    dispatch(
        op_shapes::row("lora_backward",
                       fmt::format("M {}, K {}, r {}, N {}{}{}{}", M, K, r, n, drop.p > 0.0f ? ", dropout" : "",
                                   dinp.p ? "" : ", no input gradient", op_shapes::storage({inp, dout})))
            .cost(2.0 * M * r * (2.0 * K + 2.0 * n + (dinp.p ? K : 0)),
                  op_shapes::bytes_of(inp) * mk * 2.0 + 2.0 * op_shapes::bytes_of(dout) * mn +
                      (dinp.p ? 2.0 * op_shapes::bytes_of(dinp) * mk : 0.0) + passes * 8.0 * mk +
                      12.0 * r * (double(K) + n)),
        [=](Backend& b) { b.lora_backward(dinp, dA, dB, dout, ld_dout, inp, A, B, M, K, r, n, scale, drop, work); });
}

inline void ForwardingBackend::matmul_residual_forward(float* out, const float* resid, GemmOperand inp,
                                                       const float* weight, const float* bias, int M, int K, int N,
                                                       float* scratch) {
    const char* fp8 = linear_ == LinearPrecision::kFp8 ? ", fp8" : "";
    dispatch(op_shapes::row("matmul_residual_forward", op_shapes::gemm_shape(M, K, N, bias, {inp}) + fp8),
             fp8_call([=](Backend& b) { b.matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); }));
    fused_parts([&] { Backend::matmul_residual_forward(out, resid, inp, weight, bias, M, K, N, scratch); });
}

inline void ForwardingBackend::matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp,
                                                   const float* weight, const float* bias, int M, int K, int N,
                                                   bool tanh_approx) {
    const char* fp8 = linear_ == LinearPrecision::kFp8 ? ", fp8" : "";
    dispatch(op_shapes::row("matmul_gelu_forward", op_shapes::gemm_shape(M, K, N, bias, {pre, out, inp}) +
                                                       (tanh_approx ? ", tanh" : ", erf") + fp8),
             fp8_call([=](Backend& b) { b.matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); }));
    fused_parts([&] { Backend::matmul_gelu_forward(pre, out, inp, weight, bias, M, K, N, tanh_approx); });
}

inline void ForwardingBackend::matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias,
                                                    GemmOperand dout, GemmOperand act, const float* weight,
                                                    GemmOperand pre, int M, int K, int N, bool tanh_approx) {
    const char* fp8 = linear_ == LinearPrecision::kFp8 ? ", fp8" : "";
    dispatch(
        op_shapes::row("matmul_gelu_backward", op_shapes::gemm_shape(M, K, N, dbias, {dpre, dact, dout, act, pre}) +
                                                   (tanh_approx ? ", tanh" : ", erf") + fp8),
        fp8_call([=](Backend& b) {
            b.matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
        }));
    fused_parts([&] {
        Backend::matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, weight, pre, M, K, N, tanh_approx);
    });
}

inline void ForwardingBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                                                 int N, int T, int C) {
    dispatch(op_shapes::row("embedding_forward", fmt::format("N {}, C {}{}", N, C, wpe != nullptr ? ", positions" : ""))
                 .cost((wpe ? 1.0 : 0.0) * N * C, 4.0 * N * C * (wpe ? 3 : 2) + 4.0 * N),
             [=](Backend& b) { b.embedding_forward(out, tokens, wte, wpe, N, T, C); });
}

inline void ForwardingBackend::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                                  int N, int T, int C) {
    dispatch(
        op_shapes::row("embedding_backward", fmt::format("N {}, C {}{}", N, C, dwpe != nullptr ? ", positions" : ""))
            .cost((dwpe ? 2.0 : 1.0) * N * C, 4.0 * N * C * (dwpe ? 5 : 3) + 4.0 * N),
        [=](Backend& b) { b.embedding_backward(dwte, dwpe, dout, tokens, N, T, C); });
}

inline void ForwardingBackend::layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp,
                                                 const float* weight, const float* bias, int N, int C, float eps,
                                                 NormKind kind) {
    dispatch(op_shapes::row("layernorm_forward", op_shapes::rows_shape(N, C, weight, {out}))
                 .cost(8.0 * N * C, (4 + op_shapes::bytes_of(out)) * N * C + 8.0 * N),
             [=](Backend& b) { b.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, eps, kind); });
}

inline void ForwardingBackend::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                                  const float* inp, const float* weight, const float* mean,
                                                  const float* rstd, int N, int C, NormKind kind) {
    dispatch(
        op_shapes::row("layernorm_backward", op_shapes::rows_shape(N, C, weight, {}))
            .cost(12.0 * N * C, 4 * (4.0 * N * C + 2.0 * N)),
        [=](Backend& b) { b.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind); });
}

inline void ForwardingBackend::norm_backward_from_output(float* dinp, const float* dout, GemmOperand out,
                                                         const float* rstd, int N, int C, NormKind kind) {
    dispatch(op_shapes::row("norm_backward_from_output", op_shapes::rows_shape(N, C, nullptr, {out}))
                 .cost(9.0 * N * C, (12 + op_shapes::bytes_of(out)) * N * C + 4.0 * N),
             [=](Backend& b) { b.norm_backward_from_output(dinp, dout, out, rstd, N, C, kind); });
}

inline void ForwardingBackend::norm_residual_forward(float* out, const float* resid, float* mean, float* rstd,
                                                     GemmOperand inp, const float* weight, const float* bias, int N,
                                                     int C, float eps, NormKind kind) {
    dispatch(op_shapes::row("norm_residual_forward", op_shapes::rows_shape(N, C, weight, {inp}))
                 .cost(9.0 * N * C, (op_shapes::bytes_of(inp) + 8) * N * C + 8.0 * N),
             [=](Backend& b) { b.norm_residual_forward(out, resid, mean, rstd, inp, weight, bias, N, C, eps, kind); });
}

inline void ForwardingBackend::norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout,
                                                      GemmOperand inp, const float* weight, const float* mean,
                                                      const float* rstd, int N, int C, NormKind kind) {
    dispatch(
        op_shapes::row("norm_residual_backward", op_shapes::rows_shape(N, C, weight, {dinp, inp}))
            .cost(12.0 * N * C, (op_shapes::bytes_of(dinp) + op_shapes::bytes_of(inp) + 4) * N * C + 8.0 * N),
        [=](Backend& b) { b.norm_residual_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind); });
}

inline void ForwardingBackend::qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd,
                                               const float* q_weight, const float* q_bias, const float* k_weight,
                                               const float* k_bias, int N, int C, int KV, float eps, NormKind kind) {
    dispatch(
        op_shapes::row("qk_norm_forward", op_shapes::rows_shape(N, C, q_weight, {qkv, qk}) + op_shapes::kv_width(C, KV))
            .cost(8.0 * N * (C + KV),
                  (2 * op_shapes::bytes_of(qkv) + op_shapes::bytes_of(qk)) * N * (C + KV) + 16.0 * N),
        [=](Backend& b) {
            b.qk_norm_forward(qkv, qk, mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps, kind);
        });
}

inline void ForwardingBackend::qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight,
                                                float* dk_bias, GemmOperand qk, const float* q_weight,
                                                const float* k_weight, const float* mean, const float* rstd, int N,
                                                int C, int KV, NormKind kind) {
    dispatch(op_shapes::row("qk_norm_backward",
                            op_shapes::rows_shape(N, C, q_weight, {dqkv, qk}) + op_shapes::kv_width(C, KV))
                 .cost(12.0 * N * (C + KV),
                       (2 * op_shapes::bytes_of(dqkv) + op_shapes::bytes_of(qk)) * N * (C + KV) + 16.0 * N),
             [=](Backend& b) {
                 b.qk_norm_backward(dqkv, dq_weight, dq_bias, dk_weight, dk_bias, qk, q_weight, k_weight, mean, rstd, N,
                                    C, KV, kind);
             });
}

inline void ForwardingBackend::kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) {
    dispatch(op_shapes::row("kv_heads_expand", op_shapes::shared_heads_shape(N, NH, KVH, HS, {out, inp}))
                 .cost(0.0, (op_shapes::bytes_of(inp) * (NH + 2 * KVH) + op_shapes::bytes_of(out) * 3 * NH) * N * HS),
             [=](Backend& b) { b.kv_heads_expand(out, inp, N, NH, KVH, HS); });
}

inline void ForwardingBackend::kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) {
    dispatch(op_shapes::row("kv_heads_reduce", op_shapes::shared_heads_shape(N, NH, KVH, HS, {dinp, dout}))
                 .cost(2.0 * N * HS * NH,
                       (op_shapes::bytes_of(dout) * 3 * NH + op_shapes::bytes_of(dinp) * (NH + 2 * KVH)) * N * HS),
             [=](Backend& b) { b.kv_heads_reduce(dinp, dout, N, NH, KVH, HS); });
}

inline void ForwardingBackend::rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) {
    dispatch(op_shapes::row("rope_forward", op_shapes::heads_shape(B, T, NH, HS, {qkv}))
                 .cost(3.0 * B * T * 2 * NH * HS, 2 * op_shapes::bytes_of(qkv) * B * T * 2 * NH * HS),
             [=](Backend& b) { b.rope_forward(qkv, B, T, NH, HS, theta); });
}

inline void ForwardingBackend::rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) {
    dispatch(op_shapes::row("rope_backward", op_shapes::heads_shape(B, T, NH, HS, {dqkv}))
                 .cost(3.0 * B * T * 2 * NH * HS, 2 * op_shapes::bytes_of(dqkv) * B * T * 2 * NH * HS),
             [=](Backend& b) { b.rope_backward(dqkv, B, T, NH, HS, theta); });
}

inline void ForwardingBackend::attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH,
                                                 int HS) {
    dispatch(op_shapes::row("attention_forward", op_shapes::heads_shape(B, T, NH, HS, {out, qkv}))
                 .cost(2.0 * B * NH * T * T * HS,
                       4.0 * B * NH * T + (op_shapes::bytes_of(qkv) * 3 + op_shapes::bytes_of(out)) * B * T * NH * HS),
             [=](Backend& b) { b.attention_forward(out, lse, qkv, B, T, NH, HS); });
}

inline void ForwardingBackend::attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out,
                                                  const float* lse, int B, int T, int NH, int HS) {
    dispatch(op_shapes::row("attention_backward", op_shapes::heads_shape(B, T, NH, HS, {dqkv, dout, qkv, out}))
                 .cost(5.0 * B * NH * T * T * HS,
                       4.0 * B * NH * T + (op_shapes::bytes_of(dqkv) * 3 + op_shapes::bytes_of(dout) +
                                           op_shapes::bytes_of(qkv) * 3 + op_shapes::bytes_of(out)) *
                                              B * T * NH * HS),
             [=](Backend& b) { b.attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS); });
}

inline void ForwardingBackend::gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) {
    dispatch(op_shapes::row("gelu_forward", fmt::format("n {}{}{}", n, tanh_approx ? ", tanh" : ", erf",
                                                        op_shapes::storage({out, inp})))
                 .cost(10.0 * n, (op_shapes::bytes_of(inp) + op_shapes::bytes_of(out)) * n),
             [=](Backend& b) { b.gelu_forward(out, inp, n, tanh_approx); });
}

inline void ForwardingBackend::gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n,
                                             bool tanh_approx) {
    dispatch(
        op_shapes::row("gelu_backward", fmt::format("n {}{}{}", n, tanh_approx ? ", tanh" : ", erf",
                                                    op_shapes::storage({dinp, inp, dout})))
            .cost(15.0 * n, (op_shapes::bytes_of(inp) + op_shapes::bytes_of(dinp) + op_shapes::bytes_of(dout)) * n),
        [=](Backend& b) { b.gelu_backward(dinp, inp, dout, n, tanh_approx); });
}

inline void ForwardingBackend::swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) {
    dispatch(op_shapes::row("swiglu_forward", fmt::format("N {}, H {}{}", N, H, op_shapes::storage({out, inp})))
                 .cost(6.0 * N * H, (2 * op_shapes::bytes_of(inp) + op_shapes::bytes_of(out)) * N * H),
             [=](Backend& b) { b.swiglu_forward(out, inp, N, H); });
}

inline void ForwardingBackend::swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) {
    dispatch(
        op_shapes::row("swiglu_backward", fmt::format("N {}, H {}{}", N, H, op_shapes::storage({dinp, inp, dout})))
            .cost(10.0 * N * H,
                  (2 * op_shapes::bytes_of(inp) + 2 * op_shapes::bytes_of(dinp) + op_shapes::bytes_of(dout)) * N * H),
        [=](Backend& b) { b.swiglu_backward(dinp, inp, dout, N, H); });
}

inline void ForwardingBackend::residual_forward(float* out, const float* a, const float* b_, size_t n) {
    dispatch(op_shapes::row("residual_forward", fmt::format("n {}", n)).cost(1.0 * n, 12.0 * n),
             [=](Backend& b) { b.residual_forward(out, a, b_, n); });
}

inline void ForwardingBackend::classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets,
                                                           int N, int V, float dloss_scale, bool compute_grad,
                                                           float z_loss_multiplier, float* z_losses) {
    dispatch(
        op_shapes::row("classifier_forward_backward",
                       fmt::format("N {}, V {}{}{}{}", N, V, compute_grad ? "" : ", no gradient",
                                   z_loss_multiplier > 0.0f ? ", z-loss" : "", op_shapes::storage({logits})))
            .cost((compute_grad ? 6.0 : 4.0) * N * V, op_shapes::bytes_of(logits) * N * V * (compute_grad ? 2 : 1)),
        [=](Backend& b) {
            b.classifier_forward_backward(logits, losses, targets, N, V, dloss_scale, compute_grad, z_loss_multiplier,
                                          z_losses);
        });
}

inline void ForwardingBackend::adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                                            float beta1, float beta2, float eps, float weight_decay, long step,
                                            float grad_scale, uint16_t* param_bf16) {
    dispatch(op_shapes::row("adamw_update", fmt::format("n {}{}", n, param_bf16 != nullptr ? ", bf16 copy" : ""))
                 .cost(15.0 * n, 28.0 * n + (param_bf16 ? 2.0 * n : 0)),
             [=](Backend& b) {
                 b.adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                                param_bf16);
             });
}

inline void ForwardingBackend::adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1,
                                                  float beta2, float eps, long step, float grad_scale) {
    size_t n = 0;
    bool bf16 = false;
    for (const AdamwRange& r : ranges) n += r.n, bf16 = bf16 || r.param_bf16 != nullptr;
    OpCall call = op_shapes::row("adamw_update_multi",
                                 fmt::format("{} ranges, n {}{}", ranges.size(), n, bf16 ? ", bf16 copies" : ""));
    for (const AdamwRange& r : ranges) {
        call.costs.push_back({"adamw_update", 15.0 * r.n, 28.0 * r.n + (r.param_bf16 ? 2.0 * r.n : 0)});
    }
    dispatch(call, [=](Backend& b) { b.adamw_update_multi(ranges, lr, beta1, beta2, eps, step, grad_scale); });
}

inline double ForwardingBackend::squared_norm(const float* x, size_t n) {
    double result = 0.0;
    dispatch(op_shapes::row("squared_norm", fmt::format("n {}", n)).cost(2.0 * n, 4.0 * n),
             [=, &result](Backend& b) { result = b.squared_norm(x, n); });
    return result;
}

inline double ForwardingBackend::squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) {
    size_t n = 0;
    for (const auto& r : ranges) n += r.second;
    OpCall call = op_shapes::row("squared_norm_multi", fmt::format("{} ranges, n {}", ranges.size(), n));
    for (const auto& r : ranges) call.costs.push_back({"squared_norm", 2.0 * r.second, 4.0 * r.second});
    double result = 0.0;
    dispatch(call, [=, &result](Backend& b) { result = b.squared_norm_multi(ranges); });
    return result;
}

inline void ForwardingBackend::copy_device_to_device(void* dst, const void* src, size_t bytes) {
    dispatch(op_shapes::plain("copy_device_to_device").cost(0.0, 2.0 * bytes),
             [=](Backend& b) { b.copy_device_to_device(dst, src, bytes); });
}

inline void ForwardingBackend::fill_zero(void* ptr, size_t bytes) {
    dispatch(op_shapes::plain("fill_zero").cost(0.0, 1.0 * bytes), [=](Backend& b) { b.fill_zero(ptr, bytes); });
}

inline void ForwardingBackend::set_linear_precision(LinearPrecision p) {
    linear_ = p;
    dispatch(op_shapes::plain("set_linear_precision"), [=](Backend& b) { b.set_linear_precision(p); });
}
inline void ForwardingBackend::hold_weight(const float* w) {
    dispatch(op_shapes::plain("hold_weight"), [=](Backend& b) { b.hold_weight(w); });
}
inline void ForwardingBackend::alias_bf16(const float* w, const uint16_t* bf16, size_t n) {
    dispatch(op_shapes::plain("alias_bf16"), [=](Backend& b) { b.alias_bf16(w, bf16, n); });
}

inline void ForwardingBackend::rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS,
                                               float theta, int S) {
    dispatch(op_shapes::plain("rope_forward_at").cost(3.0 * N * (NH + KVH) * HS, 2 * 4.0 * N * (NH + KVH) * HS),
             [=](Backend& b) { b.rope_forward_at(qkv, positions, N, NH, KVH, HS, theta, S); });
}

inline void ForwardingBackend::attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache,
                                                    const int32_t* seqs, const int32_t* positions, int N, int NH,
                                                    int KVH, int HS, int S) {
    dispatch(op_shapes::plain("attention_with_cache")
                 .cost(4.0 * N * NH * HS * S, 4.0 * (2.0 * N * NH * HS * (1 + S) + 4.0 * N * KVH * HS)),
             [=](Backend& b) { b.attention_with_cache(out, qkv, kcache, vcache, seqs, positions, N, NH, KVH, HS, S); });
}

inline void ForwardingBackend::scale_inplace(float* x, size_t n, float s) {
    dispatch(op_shapes::plain("scale_inplace").cost(1.0 * n, 8.0 * n), [=](Backend& b) { b.scale_inplace(x, n, s); });
}

inline double ForwardingBackend::sum(const float* x, size_t n) {
    double result = 0.0;
    dispatch(op_shapes::plain("sum").cost(1.0 * n, 4.0 * n), [=, &result](Backend& b) { result = b.sum(x, n); });
    return result;
}

inline void ForwardingBackend::cast_float_to_bf16(uint16_t* out, const float* in, size_t n) {
    dispatch(op_shapes::plain("cast_float_to_bf16").cost(0.0, 6.0 * n),
             [=](Backend& b) { b.cast_float_to_bf16(out, in, n); });
}

inline void ForwardingBackend::cast_bf16_to_float(float* out, const uint16_t* in, size_t n) {
    dispatch(op_shapes::plain("cast_bf16_to_float").cost(0.0, 6.0 * n),
             [=](Backend& b) { b.cast_bf16_to_float(out, in, n); });
}

inline void ForwardingBackend::round_to_bf16(float* out, const float* in, size_t n) {
    dispatch(op_shapes::plain("round_to_bf16").cost(0.0, 8.0 * n), [=](Backend& b) { b.round_to_bf16(out, in, n); });
}

}  // namespace trainer
