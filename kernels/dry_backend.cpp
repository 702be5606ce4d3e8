// The dry backend (see backend.h): the shapes of a step's work without the work. Costs count fp32 storage:
// FLOPs as the kernels' arithmetic (a multiply-add is 2), bytes as each operand read once and each result
// written once (parameter gradients, which accumulate, are read and written).
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "kernels/backend.h"

namespace trainer {
namespace {

class DryBackend final : public Backend {
   public:
    DryBackend(std::function<void(const OpCost&)> observer, bool gemm_operands_bf16)
        : observer_(std::move(observer)), gemm_operands_bf16_(gemm_operands_bf16) {}
    std::string name() const override { return "dry"; }
    bool gemm_operands_bf16() const override { return gemm_operands_bf16_; }

    // Addresses no one dereferences: distinct, 64-byte aligned, far from anything mapped.
    void* alloc(size_t bytes) override {
        const uintptr_t p = next_;
        next_ += (bytes + 63) / 64 * 64 + 64;
        return reinterpret_cast<void*>(p);
    }
    void free(void*) override {}
    void* alloc_host(size_t bytes) override { return alloc(bytes); }
    void free_host(void*) override {}
    void copy_host_to_device(void*, const void*, size_t bytes) override { note("copy_host_to_device", 0, bytes); }
    void copy_device_to_host(void*, const void*, size_t bytes) override { note("copy_device_to_host", 0, bytes); }
    void copy_device_to_device(void*, const void*, size_t bytes) override {
        note("copy_device_to_device", 0, 2.0 * bytes);
    }
    void copy_any(void*, const void*, size_t bytes) override { note("copy", 0, bytes); }
    uint64_t copy_async(void*, const void*, size_t bytes) override {
        note("copy_async", 0, bytes, ++tickets_);
        return tickets_;
    }
    void host_wait(uint64_t ticket) override {
        if (ticket != 0) note("host_wait", 0, 0, ticket);
    }
    void device_wait(uint64_t ticket) override {
        if (ticket != 0) note("device_wait", 0, 0, ticket);
    }
    void fill_zero(void*, size_t bytes) override { note("fill_zero", 0, bytes); }

    void matmul_forward(GemmOperand out, GemmOperand inp, const float*, const float* bias, int M, int K,
                        int N) override {
        const double m = M, k = K, n = N;
        note("matmul_forward", 2 * m * k * n, size(inp) * m * k + size(out) * m * n + 4 * (n * k + (bias ? n : 0)));
    }
    void matmul_backward(GemmOperand dinp, float*, float* dbias, GemmOperand dout, GemmOperand inp, const float*, int M,
                         int K, int N, bool) override {
        const double m = M, k = K, n = N;
        const bool has_dinp = dinp.p != nullptr;
        const double flops = 2 * m * k * n * (has_dinp ? 2 : 1) + (dbias ? m * n : 0);
        note("matmul_backward", flops,
             size(inp) * m * k + size(dout) * m * n + (has_dinp ? size(dinp) * m * k : 0) +
                 4 * (3 * n * k + (dbias ? 2 * n : 0)));
    }
    bool linear_bf16_reference_forward(uint16_t*, const uint16_t*, const uint16_t*, int M, int K, int N) override {
        const double m = M, k = K, n = N;
        note("linear_bf16_reference_forward", 2 * m * k * n, 2 * (m * k + n * k + m * n));
        return true;
    }
    bool linear_bf16_reference_backward(uint16_t*, uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int M,
                                        int K, int N) override {
        const double m = M, k = K, n = N;
        note("linear_bf16_reference_backward", 4 * m * k * n, 4 * (m * n + m * k + n * k));
        return true;
    }
    void embedding_forward(float*, const int32_t*, const float*, const float* wpe, int N, int, int C) override {
        const double nc = static_cast<double>(N) * C;
        note("embedding_forward", wpe ? nc : 0, 4 * nc * (wpe ? 3 : 2) + 4.0 * N);
    }
    void embedding_backward(float*, float* dwpe, const float*, const int32_t*, int N, int, int C) override {
        const double nc = static_cast<double>(N) * C;
        note("embedding_backward", nc * (dwpe ? 2 : 1), 4 * nc * (dwpe ? 5 : 3) + 4.0 * N);
    }
    void layernorm_forward(GemmOperand out, float*, float*, const float*, const float*, const float*, int N, int C,
                           float, NormKind) override {
        const double nc = static_cast<double>(N) * C;
        note("layernorm_forward", 8 * nc, (4 + size(out)) * nc + 8.0 * N);
    }
    void layernorm_backward(float*, float*, float*, const float*, const float*, const float*, const float*,
                            const float*, int N, int C, NormKind) override {
        const double nc = static_cast<double>(N) * C;
        note("layernorm_backward", 12 * nc, 4 * (4 * nc + 2.0 * N));
    }
    void norm_backward_from_output(float*, const float*, GemmOperand out, const float*, int N, int C,
                                   NormKind) override {
        const double nc = static_cast<double>(N) * C;
        note("norm_backward_from_output", 9 * nc, (12 + size(out)) * nc + 4.0 * N);
    }
    // The pre-norm's costs with the residual read and added (forward), dinp written not added (backward).
    void norm_residual_forward(float*, const float*, float*, float*, GemmOperand inp, const float*, const float*, int N,
                               int C, float, NormKind) override {
        const double nc = static_cast<double>(N) * C;
        note("norm_residual_forward", 9 * nc, (size(inp) + 8) * nc + 8.0 * N);
    }
    void norm_residual_backward(GemmOperand dinp, float*, float*, const float*, GemmOperand inp, const float*,
                                const float*, const float*, int N, int C, NormKind) override {
        const double nc = static_cast<double>(N) * C;
        note("norm_residual_backward", 12 * nc, (size(dinp) + size(inp) + 4) * nc + 8.0 * N);
    }
    // q and k (N(C+KV)) copied aside, then normalised in place.
    void qk_norm_forward(GemmOperand qkv, GemmOperand qk, float*, float*, const float*, const float*, const float*,
                         const float*, int N, int C, int KV, float, NormKind) override {
        const double nqk = static_cast<double>(N) * (C + KV);
        note("qk_norm_forward", 8 * nqk, (2 * size(qkv) + size(qk)) * nqk + 16.0 * N);
    }
    void qk_norm_backward(GemmOperand dqkv, float*, float*, float*, float*, GemmOperand qk, const float*, const float*,
                          const float*, const float*, int N, int C, int KV, NormKind) override {
        const double nqk = static_cast<double>(N) * (C + KV);
        note("qk_norm_backward", 12 * nqk, (2 * size(dqkv) + size(qk)) * nqk + 16.0 * N);
    }
    // Copies: the shared heads read once a row, every query head's written (expand); the transpose adds the group.
    void kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) override {
        const double n = static_cast<double>(N) * HS;
        note("kv_heads_expand", 0.0, size(inp) * n * (NH + 2 * KVH) + size(out) * n * 3 * NH);
    }
    void kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) override {
        const double n = static_cast<double>(N) * HS;
        note("kv_heads_reduce", 2.0 * n * NH, size(dout) * n * 3 * NH + size(dinp) * n * (NH + 2 * KVH));
    }
    void rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float) override {
        rope("rope_forward", static_cast<double>(B) * T, 2 * NH, HS, size(qkv));
    }
    void rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float) override {
        rope("rope_backward", static_cast<double>(B) * T, 2 * NH, HS, size(dqkv));
    }
    void rope_forward_at(float*, const int32_t*, int N, int NH, int KVH, int HS, float, int) override {
        rope("rope_forward_at", N, NH + KVH, HS, 4.0);
    }
    // The rows' k and v written, then each query against its sequence's cache: at most S keys a row (the dry run
    // knows no positions).
    void attention_with_cache(float*, const float*, float*, float*, const int32_t*, const int32_t*, int N, int NH,
                              int KVH, int HS, int S) override {
        const double nc = static_cast<double>(N) * NH * HS, nkv = static_cast<double>(N) * KVH * HS;
        note("attention_with_cache", 4.0 * nc * S, 4.0 * (nc + 2 * nkv + 2 * nkv + 2.0 * nc * S + nc));
    }
    // Causal: half the T x T scores; the backward recomputes the probabilities (QK^T) besides its three GEMMs.
    void attention_forward(GemmOperand out, float*, GemmOperand qkv, int B, int T, int NH, int HS) override {
        const double btc = static_cast<double>(B) * T * NH * HS;
        note("attention_forward", 2.0 * B * NH * static_cast<double>(T) * T * HS,
             4.0 * B * NH * T + size(qkv) * 3 * btc + size(out) * btc);
    }
    void attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out, const float*, int B,
                            int T, int NH, int HS) override {
        const double btc = static_cast<double>(B) * T * NH * HS;
        note("attention_backward", 5.0 * B * NH * static_cast<double>(T) * T * HS,
             4.0 * B * NH * T + size(dqkv) * 3 * btc + size(dout) * btc + size(qkv) * 3 * btc + size(out) * btc);
    }
    void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool) override {
        note("gelu_forward", 10.0 * n, (size(inp) + size(out)) * n);
    }
    void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool) override {
        note("gelu_backward", 15.0 * n, (size(inp) + size(dinp) + size(dout)) * n);
    }
    void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) override {
        const double nh = static_cast<double>(N) * H;
        note("swiglu_forward", 6 * nh, (2 * size(inp) + size(out)) * nh);
    }
    void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) override {
        const double nh = static_cast<double>(N) * H;
        note("swiglu_backward", 10 * nh, (2 * size(inp) + 2 * size(dinp) + size(dout)) * nh);
    }
    void residual_forward(float*, const float*, const float*, size_t n) override {
        note("residual_forward", 1.0 * n, 12.0 * n);
    }
    void scale_inplace(float*, size_t n, float) override { note("scale_inplace", 1.0 * n, 8.0 * n); }
    void classifier_forward_backward(GemmOperand logits, float*, const int32_t*, int N, int V, float, bool compute_grad,
                                     float, float*) override {
        const double nv = static_cast<double>(N) * V;
        note("classifier_forward_backward", (compute_grad ? 6 : 4) * nv, size(logits) * nv * (compute_grad ? 2 : 1));
    }
    void adamw_update(float*, const float*, float*, float*, size_t n, float, float, float, float, float, long, float,
                      uint16_t* param_bf16) override {
        note("adamw_update", 15.0 * n, 28.0 * n + (param_bf16 ? 2.0 * n : 0));
    }
    double squared_norm(const float*, size_t n) override {
        note("squared_norm", 2.0 * n, 4.0 * n);
        return 0.0;
    }
    double sum(const float*, size_t n) override {
        note("sum", 1.0 * n, 4.0 * n);
        return 0.0;
    }
    void cast_float_to_bf16(uint16_t*, const float*, size_t n) override { note("cast_float_to_bf16", 0, 6.0 * n); }
    void cast_bf16_to_float(float*, const uint16_t*, size_t n) override { note("cast_bf16_to_float", 0, 6.0 * n); }
    void round_to_bf16(float*, const float*, size_t n) override { note("round_to_bf16", 0, 8.0 * n); }

   private:
    static double size(GemmOperand x) { return x.bf16 ? 2.0 : 4.0; }  // bytes an element
    // `heads` heads of HS channels rotated in each of `rows` rows (q's and k's; v untouched).
    void rope(const char* op, double rows, int heads, int HS, double element_bytes) {
        const double qk = rows * heads * HS;
        note(op, 3 * qk, 2 * element_bytes * qk);
    }
    void note(const char* op, double flops, double bytes, uint64_t ticket = 0) {
        if (observer_) observer_({op, flops, bytes, ticket});
    }
    std::function<void(const OpCost&)> observer_;
    bool gemm_operands_bf16_;
    uintptr_t next_ = uintptr_t(1) << 44;
    uint64_t tickets_ = 0;  // copy_async's, from 1
};

}  // namespace

std::unique_ptr<Backend> make_dry_backend(std::function<void(const OpCost&)> observer, bool gemm_operands_bf16) {
    return std::make_unique<DryBackend>(std::move(observer), gemm_operands_bf16);
}

}  // namespace trainer
