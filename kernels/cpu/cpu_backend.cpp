// The CPU backend: the Backend interface over the templated CPU kernels (instantiated for float) and host
// memory, large blocks from a caching pool (alloc).
#include <cblas.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "kernels/cpu/ops.h"

namespace trainer {
namespace {

// One line on the CPU GEMM library and kernel set in use, with a note when a faster one is available.
std::string cpu_blas_description() {
    const std::string core = openblas_get_corename();
    std::string text = "OpenBLAS " + core + " kernels";
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const bool core_avx512 = core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
    if (avx512 && !core_avx512) {
        const char* pinned = std::getenv("OPENBLAS_CORETYPE");
        // Pinned to a narrower set by the environment, or OpenBLAS's detection does not know this CPU model (a
        // new or virtual CPU falls back to its oldest x86-64 set, Prescott).
        text += pinned != nullptr
                    ? fmt::format(
                          " (note: this CPU has AVX-512 but OpenBLAS runs its {} kernels because "
                          "OPENBLAS_CORETYPE={}; unset it, or set SkylakeX, for its AVX-512 kernels)",
                          core, pinned)
                    : fmt::format(
                          " (note: this CPU has AVX-512 but OpenBLAS's detection does not know its model and "
                          "runs its {} kernels; OPENBLAS_CORETYPE=SkylakeX runs its AVX-512 kernels)",
                          core);
    }
#endif
    return text;
}

class CpuBackend final : public Backend {
   public:
    std::string name() const override { return "cpu"; }

    // The reference computes on fp32 activations only (gemm_operands_bf16() is false: the model never
    // hands it bf16 ones).
    static float* f32(GemmOperand x) {
        TRAINER_CHECK(!x.bf16, "the CPU backend was handed a bf16 activation");
        return x.f32();
    }
    // A producer's output amax (GemmOperand::amax), where the model asked for it.
    static void write_amax(GemmOperand out, size_t n) {
        if (out.amax != nullptr) *out.amax = cpu::fp8_amax(f32(out), n);
    }
    // An FP8 cast's operand given with its amax: the amax must be its values' now (a producer's, not stale), as the
    // CUDA backend takes it without looking; checked under kFp8 whether or not the shape has FP8 GEMMs, so that the
    // tiny test models check every amax the model passes.
    static void check_amax(GemmOperand x, size_t n, const char* what, int M, int K, int N) {
        if (x.amax == nullptr) return;
        const float want = cpu::fp8_amax(f32(x), n), got = *x.amax;
        TRAINER_CHECK(got == want || (std::isnan(got) && std::isnan(want)),
                      "amp_fp8: the {} of a Linear of {} x {} x {} came with amax {}, and its values' is {}", what, M,
                      K, N, got, want);
    }

    // Whether a Linear of M x K x N under the current precision emulates FP8: under kFp8 where the GPUs' FP8 GEMMs
    // take its shape (fp8_linear_shape); a block Linear they do not take runs in fp32 here as in bf16 there, said
    // once a shape as the CUDA backend says it.
    bool fp8_runs(const char* what, int M, int K, int N) {
        if (linear_ != LinearPrecision::kFp8) return false;
        if (fp8_linear_shape(K, N)) return true;
        if (fp8_fallbacks_.insert(std::make_tuple(M, N, K)).second) {
            std::fprintf(
                stderr,
                "warning: amp_fp8: the Linear %s of %d x %d x %d runs in fp32: the GPUs' FP8 GEMMs (cuBLASLt's) "
                "take K and N that are multiples of 16, so a GPU runs it in bf16\n",
                what, M, N, K);
        }
        return false;
    }

    ~CpuBackend() override {
        for (auto& [size, blocks] : cache_) {
            for (void* p : blocks) ::munmap(p, size);
        }
    }

    // The activity window: the host time of the ops the window's thread runs (ops on other threads, the
    // Gloo workers' reductions, are communication's). The host's waits for collectives are the strategy's
    // to time (wait_s stays negative).
    void begin_activity() override {
        TRAINER_CHECK(!activity_open_.load(std::memory_order_relaxed), "an activity window is already open");
        activity_thread_ = std::this_thread::get_id();
        busy_s_ = 0.0;
        activity_open_.store(true, std::memory_order_release);
    }
    Activity end_activity() override {
        TRAINER_CHECK(activity_open_.load(std::memory_order_relaxed) && std::this_thread::get_id() == activity_thread_,
                      "no activity window is open on this thread");
        activity_open_.store(false, std::memory_order_relaxed);
        Activity a;
        a.measured = true;
        a.busy_s = busy_s_;
        return a;
    }

    // Host memory kept as the GPU's stream-ordered pool keeps device memory: blocks of kPoolMin bytes or
    // more are mapped whole and, when freed, cached for the next allocation of that size (or of down to a
    // quarter of it). The strategies free and take again blocks of the same few sizes every step (FSDP's
    // gathered units, its gradient and wire buffers); through malloc they fragmented the heap or were
    // unmapped and faulted in again (glibc raises its mmap threshold after the first such free), 300-400 MiB
    // of resident memory on 4 ranks of cpu_bench that no category counted. Smaller blocks: aligned_alloc.
    void* alloc(size_t bytes) override {
        if (bytes >= kPoolMin) {
            const size_t size = (bytes + kPage - 1) / kPage * kPage;
            std::lock_guard<std::mutex> lock(mutex_);
            // The smallest cached block that fits, if at most four times the size: a block a step uses once
            // (a unit's bf16 wire buffer in its first gather) then serves smaller ones instead of idling.
            void* p = nullptr;
            size_t got = size;
            const auto it = cache_.lower_bound(size);
            if (it != cache_.end() && it->first <= 4 * size) {
                got = it->first;
                p = it->second.back();
                it->second.pop_back();
                if (it->second.empty()) cache_.erase(it);
            } else {
                p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                if (p == MAP_FAILED) user_error("out of host memory allocating {} bytes", bytes);
                pool_bytes_ += size;
            }
            pooled_[p] = got;
            return p;
        }
        const size_t rounded = (bytes + 63) / 64 * 64;
        void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
        if (!p) user_error("out of host memory allocating {} bytes", bytes);
        return p;
    }
    void free(void* ptr) override {
        if (ptr == nullptr) return;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            const auto it = pooled_.find(ptr);
            if (it != pooled_.end()) {
                cache_[it->second].push_back(ptr);
                pooled_.erase(it);
                return;
            }
        }
        std::free(ptr);
    }
    // The pool's high-water mark: every block it ever mapped (it returns none until it is destroyed).
    int64_t device_peak_bytes() const override {
        std::lock_guard<std::mutex> lock(mutex_);
        return static_cast<int64_t>(pool_bytes_);
    }
    // Empty units (a tied head without norm parameters) pass null pointers with 0 bytes: not memcpy's to see.
    void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
        const Busy busy(*this);
        copy(dst, src, bytes);
    }
    void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
        const Busy busy(*this);
        copy(dst, src, bytes);
    }
    void copy_device_to_device(void* dst, const void* src, size_t bytes) override {
        const Busy busy(*this);
        copy(dst, src, bytes);
    }
    void fill_zero(void* ptr, size_t bytes) override {
        const Busy busy(*this);
        if (bytes > 0) std::memset(ptr, 0, bytes);
    }
    double peak_flops(bool bf16, std::string* how) const override {
        (void)bf16;  // the CPU computes in fp32
        CpuPeak peak = cpu_peak_flops(omp_get_max_threads());
        if (how != nullptr) *how = std::move(peak.how);
        return peak.flops;
    }
    std::string library_description() const override { return cpu_blas_description(); }

    void set_linear_precision(LinearPrecision p) override { linear_ = p; }
    void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                        int N) override {
        const Busy busy(*this);
        if (linear_ == LinearPrecision::kFp8) check_amax(inp, size_t(M) * K, "input", M, K, N);
        if (fp8_runs("forward", M, K, N)) {
            cpu::fp8_linear_forward(f32(out), f32(inp), weight, bias, M, K, N, fp8_);
        } else {
            cpu::matmul_forward(f32(out), f32(inp), weight, bias, M, K, N);
        }
    }
    void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp) override {
        const Busy busy(*this);
        if (linear_ == LinearPrecision::kFp8) {
            check_amax(dout, size_t(M) * N, "output gradient", M, K, N);
            if (dweight != nullptr) check_amax(inp, size_t(M) * K, "input", M, K, N);
        }
        if (fp8_runs("backward", M, K, N)) {
            cpu::fp8_linear_backward(f32(dinp), dweight, dbias, f32(dout), f32(inp), weight, M, K, N, accumulate_dinp,
                                     fp8_);
        } else {
            cpu::matmul_backward(f32(dinp), dweight, dbias, f32(dout), f32(inp), weight, M, K, N, accumulate_dinp);
        }
    }
    bool has_lora() const override { return true; }
    bool has_nf4() const override { return true; }
    void nf4_dequantize(GemmOperand out, const uint8_t* codes, const float* absmax, size_t n) override {
        const Busy busy(*this);
        into(out, n, [&](float* values) { cpu::nf4_dequantize(values, codes, absmax, n); });
    }
    void nf4_dequantize_dq(GemmOperand out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                           const float* offset, size_t n) override {
        const Busy busy(*this);
        into(out, n, [&](float* values) { cpu::nf4_dequantize_dq(values, codes, absmax_codes, absmax2, offset, n); });
    }
    // n values that `make` writes as fp32, into `out`: in place, or (bf16 storage) each rounded once.
    template <typename Make>
    static void into(GemmOperand out, size_t n, Make make) {
        if (!out.bf16) return make(out.f32());
        std::vector<float> values(n);
        make(values.data());
        cpu::cast_float_to_bf16(out.b16(), values.data(), n);
    }
    void lora_forward(GemmOperand out, int ld_out, GemmOperand inp, const float* A, const float* B, int M, int K, int r,
                      int n, float scale, const LoraDropout& drop, float* work) override {
        const Busy busy(*this);
        cpu::lora_forward(f32(out), ld_out, f32(inp), A, B, M, K, r, n, scale, drop.p, drop.row_keys, drop.adapter,
                          work);
    }
    void lora_backward(GemmOperand dinp, float* dA, float* dB, GemmOperand dout, int ld_dout, GemmOperand inp,
                       const float* A, const float* B, int M, int K, int r, int n, float scale, const LoraDropout& drop,
                       float* work) override {
        const Busy busy(*this);
        cpu::lora_backward(f32(dinp), dA, dB, f32(dout), ld_dout, f32(inp), A, B, M, K, r, n, scale, drop.p,
                           drop.row_keys, drop.adapter, work);
    }
    void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T,
                           int C) override {
        const Busy busy(*this);
        cpu::embedding_forward(out, tokens, wte, wpe, N, T, C);
    }
    void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T,
                            int C) override {
        const Busy busy(*this);
        cpu::embedding_backward(dwte, dwpe, dout, tokens, N, T, C);
    }
    void layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp, const float* weight,
                           const float* bias, int N, int C, float eps, NormKind kind) override {
        const Busy busy(*this);
        cpu::layernorm_forward(f32(out), mean, rstd, inp, weight, bias, N, C, eps, kind == NormKind::kRms);
        write_amax(out, size_t(N) * C);
    }
    void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, int N, int C,
                            NormKind kind) override {
        const Busy busy(*this);
        cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, kind == NormKind::kRms);
    }
    void norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd, int N, int C,
                                   NormKind kind) override {
        const Busy busy(*this);
        cpu::norm_backward_from_output(dinp, dout, f32(out), rstd, N, C, kind == NormKind::kRms);
    }
    void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                               const float* weight, const float* bias, int N, int C, float eps,
                               NormKind kind) override {
        const Busy busy(*this);
        cpu::norm_residual_forward(out, resid, mean, rstd, f32(inp), weight, bias, N, C, eps, kind == NormKind::kRms);
    }
    void norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout, GemmOperand inp,
                                const float* weight, const float* mean, const float* rstd, int N, int C,
                                NormKind kind) override {
        const Busy busy(*this);
        cpu::norm_residual_backward(f32(dinp), dweight, dbias, dout, f32(inp), weight, mean, rstd, N, C,
                                    kind == NormKind::kRms);
    }
    void qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd, const float* q_weight,
                         const float* q_bias, const float* k_weight, const float* k_bias, int N, int C, int KV,
                         float eps, NormKind kind) override {
        const Busy busy(*this);
        cpu::qk_norm_forward(f32(qkv), f32(qk), mean, rstd, q_weight, q_bias, k_weight, k_bias, N, C, KV, eps,
                             kind == NormKind::kRms);
    }
    void qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                          GemmOperand qk, const float* q_weight, const float* k_weight, const float* mean,
                          const float* rstd, int N, int C, int KV, NormKind kind) override {
        const Busy busy(*this);
        cpu::qk_norm_backward(f32(dqkv), dq_weight, dq_bias, dk_weight, dk_bias, f32(qk), q_weight, k_weight, mean,
                              rstd, N, C, KV, kind == NormKind::kRms);
    }
    void kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) override {
        const Busy busy(*this);
        cpu::kv_heads_expand(f32(out), f32(inp), N, NH, KVH, HS);
    }
    void kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) override {
        const Busy busy(*this);
        cpu::kv_heads_reduce(f32(dinp), f32(dout), N, NH, KVH, HS);
    }
    void rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) override {
        const Busy busy(*this);
        cpu::rope_forward(f32(qkv), B, T, NH, HS, theta);
    }
    void rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) override {
        const Busy busy(*this);
        cpu::rope_backward(f32(dqkv), B, T, NH, HS, theta);
    }
    void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta,
                         int S) override {
        const Busy busy(*this);
        cpu::rope_forward_at(qkv, positions, N, NH, KVH, HS, theta, S);
    }
    void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                              const int32_t* positions, int N, int NH, int KVH, int HS, int S) override {
        const Busy busy(*this);
        cpu::attention_with_cache(out, qkv, kcache, vcache, seqs, positions, N, NH, KVH, HS, S);
    }
    void attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) override {
        const Busy busy(*this);
        cpu::attention_forward(f32(out), lse, f32(qkv), B, T, NH, HS);
    }
    void attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out, const float* lse,
                            int B, int T, int NH, int HS) override {
        const Busy busy(*this);
        cpu::attention_backward(f32(dqkv), f32(dout), f32(qkv), f32(out), lse, B, T, NH, HS);
    }
    void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) override {
        const Busy busy(*this);
        cpu::gelu_forward(f32(out), f32(inp), n, tanh_approx);
        write_amax(out, n);
    }
    void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) override {
        const Busy busy(*this);
        cpu::gelu_backward(f32(dinp), f32(inp), f32(dout), n, tanh_approx);
        write_amax(dinp, n);
    }
    void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) override {
        const Busy busy(*this);
        cpu::swiglu_forward(f32(out), f32(inp), N, H);
        write_amax(out, size_t(N) * H);
    }
    void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) override {
        const Busy busy(*this);
        cpu::swiglu_backward(f32(dinp), f32(inp), f32(dout), N, H);
        write_amax(dinp, size_t(N) * 2 * H);
    }
    void residual_forward(float* out, const float* a, const float* b, size_t n) override {
        const Busy busy(*this);
        cpu::residual_forward(out, a, b, n);
    }
    void scale_inplace(float* x, size_t n, float s) override {
        const Busy busy(*this);
        cpu::scale_inplace(x, n, s);
    }
    void classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                     float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                     float* z_losses) override {
        const Busy busy(*this);
        cpu::classifier_forward_backward(f32(logits), losses, targets, N, V, dloss_scale, compute_grad,
                                         z_loss_multiplier, z_losses);
    }
    void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, long step, float grad_scale, uint16_t* param_bf16) override {
        const Busy busy(*this);
        cpu::adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, param_bf16);
    }
    double squared_norm(const float* x, size_t n) override {
        const Busy busy(*this);
        return cpu::squared_norm(x, n);
    }
    double sum(const float* x, size_t n) override {
        const Busy busy(*this);
        double s = 0.0;
        for (size_t i = 0; i < n; ++i) s += x[i];
        return s;
    }
    void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) override {
        const Busy busy(*this);
        cpu::cast_float_to_bf16(out, in, n);
    }
    void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) override {
        const Busy busy(*this);
        cpu::cast_bf16_to_float(out, in, n);
    }
    void round_to_bf16(float* out, const float* in, size_t n) override {
        const Busy busy(*this);
        cpu::round_to_bf16(out, in, n);
    }

   private:
    // One op's host time, added to the open activity window when the op runs on the window's thread.
    class Busy {
       public:
        explicit Busy(CpuBackend& b)
            : b_(b.activity_open_.load(std::memory_order_acquire) && std::this_thread::get_id() == b.activity_thread_
                     ? &b
                     : nullptr) {
            if (b_ != nullptr) t0_ = std::chrono::steady_clock::now();
        }
        ~Busy() {
            if (b_ != nullptr)
                b_->busy_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
        }
        Busy(const Busy&) = delete;
        Busy& operator=(const Busy&) = delete;

       private:
        CpuBackend* b_;
        std::chrono::steady_clock::time_point t0_;
    };
    LinearPrecision linear_ = LinearPrecision::kDefault;  // set_linear_precision
    std::set<std::tuple<int, int, int>> fp8_fallbacks_;   // the Linear shapes said to run in fp32
    cpu::Fp8Scratch fp8_;                                 // amp_fp8: the block Linears' rounded operands
    std::atomic<bool> activity_open_{false};
    std::thread::id activity_thread_;
    double busy_s_ = 0.0;

    static constexpr size_t kPoolMin = size_t(1) << 20, kPage = 4096;
    mutable std::mutex mutex_;
    std::map<size_t, std::vector<void*>> cache_;  // freed pool blocks by size
    std::map<void*, size_t> pooled_;              // pool blocks in use and their sizes
    size_t pool_bytes_ = 0;  // mapped by the pool: its high-water mark too, as it unmaps only when destroyed

    static void copy(void* dst, const void* src, size_t bytes) {
        if (bytes > 0) std::memcpy(dst, src, bytes);
    }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace trainer
