// GPU kernel tests: each CUDA kernel against its CPU twin on odd shapes. Each family is one function that records
// its failures, every one naming the op, the shape it ran and the first mismatching element, and one line in the
// lists below; the end of this file makes each a Catch2 test case "gpu kernel: <what>" of gpu_tests. So a new family
// is written in this file alone. The CPU suite compiles this file too, onto the emulator of the CUDA execution model
// (tests/test_kernels_emulated.cpp, with TRAINER_SIMT_EMULATION): every family whose kernels are our own runs there
// against the same CPU twins. Left out there: the kernels of cuBLASLt, cuDNN and cub (the GEMMs, cuDNN's attention, the
// embedding's sort), and our flash attention's two cases (over a minute on the emulator; tests/test_flash_emulated.cpp
// runs its kernels on fewer shapes).
#ifndef TRAINER_SIMT_EMULATION
#include <cuda_runtime.h>
#endif
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "wgmma_tile.h"

// The families, listed once: X(function, what it checks, the emulated case's tags; [heavy]: too slow for the
// sanitizer pass). Our own kernels run on a GPU and on the CPU emulator (test_kernels_emulated.cpp makes a case
// "emulated kernel: <what>" of each).
#define TRAINER_OWN_KERNEL_FAMILIES(X)                                                                             \
    X(test_cast, "the bf16 casts and round_to_bf16 are bitwise the CPU's", "")                                     \
    X(test_residual_and_scale, "residual_forward and scale_inplace match the CPU", "")                             \
    X(test_gelu, "gelu_forward and gelu_backward (erf and tanh; fp32 and bf16) match the CPU", "")                 \
    X(test_swiglu, "swiglu_forward and swiglu_backward (fp32 and bf16) match the CPU", "")                         \
    X(test_adamw, "adamw_update and its bf16 copy-out match the CPU", "")                                          \
    X(test_norms, "squared_norm and sum match the CPU in double and repeat bitwise", "")                           \
    X(test_multi_tensor, "multi-tensor AdamW and squared norm over several ranges match the CPU", "")              \
    X(test_layernorm,                                                                                              \
      "layernorm_forward and layernorm_backward from the input and from the output (LayerNorm and RMSNorm) match " \
      "the CPU",                                                                                                   \
      "")                                                                                                          \
    X(test_norm_residual,                                                                                          \
      "norm_residual_forward and norm_residual_backward (norm_after; fp32 and bf16) match the CPU", "")            \
    X(test_qk_norm, "qk_norm_forward and its in-place backward (QK-norm; fp32 and bf16) match the CPU", "")        \
    X(test_rope, "rope_forward and rope_backward (fp32 and bf16) match the CPU", "")                               \
    X(test_classifier, "classifier_forward_backward (fp32 and bf16 logits; z-loss) matches the CPU", "")           \
    X(test_attention, "native attention forward and backward match the CPU", "")                                   \
    X(test_kv_cache, "rope at positions and attention with a KV cache match the CPU", "")                          \
    X(test_kv_heads, "shared key/value heads expand and reduce as the CPU does", "")                               \
    X(test_bias_gradient, "the bias gradient (fp32 and bf16 dout) matches the CPU and repeats bitwise", "")        \
    X(test_fp8_cast, "FP8 amax and cast-transpose (e4m3/e5m2 of fp32/bf16) are bitwise the CPU's", "")             \
    X(test_producer_amax,                                                                                          \
      "the norm and activation kernels' amax of their output (amp_fp8) is bitwise the FP8 amax pass's", "")        \
    X(test_nf4, "NF4 quantize and dequantize (fp32 and bf16; double quantized) are bitwise the CPU's", "")         \
    X(test_lora,                                                                                                   \
      "LoRA's forward and backward (fp32 and bf16 operands with dropout and strided outputs) match the CPU and "   \
      "repeat bitwise",                                                                                            \
      "")                                                                                                          \
    X(test_wgmma_tiles,                                                                                            \
      "Hopper's wgmma on a flash forward tile matches the CPU (compute capability 9.0 only on a GPU)", "")

// On a GPU only: the kernels of CUDA's libraries (cuBLASLt, cuDNN, cub), and our flash attention at shapes the
// emulator would take minutes over (tests/test_flash_emulated.cpp runs it at small ones).
#define TRAINER_GPU_ONLY_KERNEL_FAMILIES(X)                                                                            \
    X(test_attention_cudnn, "cuDNN attention forward and backward match the CPU at bf16 tolerance", "")                \
    X(test_attention_flash,                                                                                            \
      "our flash attention forward and backward match the CPU at bf16 tolerance and repeat bitwise", "")               \
    X(test_attention_flash_large, "our flash attention on 1024 blocks matches the native kernels and repeats bitwise", \
      "")
// The families that call CUDA's libraries (cuBLASLt, CUB): on a GPU, and in the emulated build (TRAINER_CUDA=EMULATED)
// against the emulator's stand-ins for those libraries, which check the calls' layouts, types and epilogues.
#define TRAINER_LIBRARY_KERNEL_FAMILIES(X)                                                                            \
    X(test_embedding, "embedding_forward matches and embedding_backward is bitwise the CPU's", "")                    \
    X(test_matmul, "fp32 matmul_forward and matmul_backward match the CPU", "")                                       \
    X(test_matmul_unaligned_bias_and_empty_k, "matmul_forward with a bias at a 4-byte offset and with K = 0", "")     \
    X(test_matmul_gelu, "matmul_gelu_forward (GELU epilogue and its fallback) matches the CPU", "")                   \
    X(test_matmul_gelu_backward, "the bf16 backward through the GELU (DGELU epilogue) matches the CPU", "")           \
    X(test_matmul_bf16, "bf16 matmul_forward (+ residual) and matmul_backward match the CPU on rounded operands", "") \
    X(test_matmul_fp8, "cuBLASLt's FP8 GEMMs (the forward and both gradients) match the CPU's FP8 emulation", "")

namespace {

// The failures of the family being run, and the shape it is at (the Where scopes, outermost first).
std::vector<std::string> g_failures;
std::vector<std::string> g_where;

// Names the shape a check runs at, for as long as it is in scope: Where at("N={} C={}", N, C).
class Where {
   public:
    template <typename... Args>
    explicit Where(fmt::format_string<Args...> f, Args&&... args) {
        g_where.push_back(fmt::format(f, std::forward<Args>(args)...));
    }
    ~Where() { g_where.pop_back(); }
    Where(const Where&) = delete;
    Where& operator=(const Where&) = delete;
};

void expect(bool ok, const std::string& what, const std::string& detail = "") {
    if (ok) return;
    std::string shape;
    for (const auto& w : g_where) shape += (shape.empty() ? "" : ", ") + w;
    g_failures.push_back(fmt::format("{} [{}]{}{}", what, shape, detail.empty() ? "" : ": ", detail));
}

// Device copies of host vectors, freed at scope exit.
template <typename T>
struct Dev {
    T* p = nullptr;
    size_t n = 0;
    explicit Dev(const std::vector<T>& h) : n(h.size()) {
        cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T));
        if (n) cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
    }
    explicit Dev(size_t count) : n(count) { cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)); }
    ~Dev() { cudaFree(p); }
    std::vector<T> host() const {
        std::vector<T> h(n);
        if (n) cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
        return h;
    }
};

std::vector<float> wave(size_t n, float scale, float phase) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = scale * std::sin(0.731f * static_cast<float>(i) + phase);
    return x;
}

// Elementwise fp32 tolerance (1e-6 + 1e-5 |ref|, docs/gpus.md "Tolerances"); a failure names the first
// mismatch.
void expect_close(const std::vector<float>& ref, const std::vector<float>& got, const char* what, double abs_tol = 1e-6,
                  double rel_tol = 1e-5) {
    if (ref.size() != got.size()) {
        expect(false, what, fmt::format("{} elements, expected {}", got.size(), ref.size()));
        return;
    }
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!(std::fabs(static_cast<double>(ref[i]) - got[i]) <= abs_tol + rel_tol * std::fabs(ref[i]))) {
            expect(false, what,
                   fmt::format("first mismatch at {} of {}: ref {:.9g} got {:.9g}", i, ref.size(), ref[i], got[i]));
            return;
        }
    }
}

// x rounded to bf16 (round to nearest even): the bf16 words and their fp32 values.
std::pair<std::vector<uint16_t>, std::vector<float>> bf16_rounded(const std::vector<float>& x) {
    std::vector<uint16_t> h(x.size());
    std::vector<float> r(x.size());
    trainer::cpu::cast_float_to_bf16(h.data(), x.data(), x.size());
    trainer::cpu::cast_bf16_to_float(r.data(), h.data(), x.size());
    return {h, r};
}

std::vector<float> bf16_widened(const std::vector<uint16_t>& h) {
    std::vector<float> r(h.size());
    trainer::cpu::cast_bf16_to_float(r.data(), h.data(), h.size());
    return r;
}

// Sizes that exercise the float4 body, the scalar tail and a misaligned start (offset 1).
const size_t kSizes[] = {1, 3, 4, 1001, 65539};

}  // namespace

namespace gpu_kernel_tests {

// Casts on odd sizes, bitwise equal to the CPU backend (same element function).
void test_cast() {
    // Offsets of 0 and 1 element: the vectorised (16-byte fp32, 8-byte bf16) and the scalar paths.
    for (size_t n : {1u, 7u, 1000u, 100003u}) {
        for (size_t off : {0u, 1u}) {
            const Where at("n={} offset={}", n, off);
            std::vector<float> x(n);
            for (size_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * i) * std::pow(10.0f, float(i % 9) - 4.0f);
            if (n > 3) x[1] = INFINITY, x[2] = -0.0f, x[3] = NAN;
            std::vector<uint16_t> ref(n), got(n);
            trainer::cpu::cast_float_to_bf16(ref.data(), x.data(), n);
            Dev<float> dx(n + off), dr(n + off);
            Dev<uint16_t> dy(n + off);
            cudaMemcpy(dx.p + off, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
            trainer::cuda::cast_float_to_bf16(dy.p + off, dx.p + off, n, nullptr);
            cudaMemcpy(got.data(), dy.p + off, n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
            expect(std::memcmp(ref.data(), got.data(), n * sizeof(uint16_t)) == 0,
                   "cast_float_to_bf16 matches the CPU");
            std::vector<float> rounded_ref(n), rounded(n);
            trainer::cpu::round_to_bf16(rounded_ref.data(), x.data(), n);
            trainer::cuda::round_to_bf16(dr.p + off, dx.p + off, n, nullptr);
            cudaMemcpy(rounded.data(), dr.p + off, n * sizeof(float), cudaMemcpyDeviceToHost);
            expect(std::memcmp(rounded_ref.data(), rounded.data(), n * sizeof(float)) == 0,
                   "round_to_bf16 matches the CPU");
            std::vector<float> back_ref(n), back(n);
            trainer::cpu::cast_bf16_to_float(back_ref.data(), ref.data(), n);
            trainer::cuda::cast_bf16_to_float(dx.p + off, dy.p + off, n, nullptr);
            cudaMemcpy(back.data(), dx.p + off, n * sizeof(float), cudaMemcpyDeviceToHost);
            expect(std::memcmp(back_ref.data(), back.data(), n * sizeof(float)) == 0,
                   "cast_bf16_to_float matches the CPU");
        }
    }
}

void test_residual_and_scale() {
    for (size_t n : kSizes) {
        for (size_t off : {0u, 1u}) {
            const Where at("n={} offset={}", n, off);
            const auto a = wave(n + off, 1.5f, 0.1f), b = wave(n + off, 0.7f, 2.0f);
            std::vector<float> ref(n + off, 0.0f);
            trainer::cpu::residual_forward(ref.data() + off, a.data() + off, b.data() + off, n);
            Dev<float> da(a), db(b), dout(n + off);
            trainer::cuda::residual_forward(dout.p + off, da.p + off, db.p + off, n, nullptr);
            auto got = dout.host();
            expect_close(std::vector<float>(ref.begin() + off, ref.end()),
                         std::vector<float>(got.begin() + off, got.end()), "residual_forward matches the CPU");
            auto x = a;
            trainer::cpu::scale_inplace(x.data() + off, n, 0.37f);
            trainer::cuda::scale_inplace(da.p + off, n, 0.37f, nullptr);
            got = da.host();
            expect_close(std::vector<float>(x.begin() + off, x.end()), std::vector<float>(got.begin() + off, got.end()),
                         "scale_inplace matches the CPU");
        }
    }
}

// A bf16 output (a GEMM operand) widened, against the fp32 CPU reference: within one bf16 step (2^-8
// relative) of it, the rounding plus the fp32 kernels' own differences.
// A bf16 result against the fp32 reference: one rounding (half a bf16 ulp, 1/256 relative) with room for
// fp32 reordering; other tolerances where a kernel rounds more than once.
void expect_close_bf16(const std::vector<float>& ref, const Dev<uint16_t>& got, const char* what, double abs_tol = 1e-6,
                       double rel_tol = 1.0 / 128) {
    std::vector<float> wide(got.n);
    const auto h = got.host();
    trainer::cpu::cast_bf16_to_float(wide.data(), h.data(), h.size());
    expect_close(ref, wide, what, abs_tol, rel_tol);
}

void test_gelu() {
    for (size_t n : kSizes) {
        for (bool tanh_approx : {false, true}) {
            const Where at("n={} tanh={}", n, tanh_approx);
            const auto x = wave(n, 4.0f, 0.3f), g = wave(n, 1.0f, 1.1f);
            std::vector<float> ref(n), dref(n);
            trainer::cpu::gelu_forward(ref.data(), x.data(), n, tanh_approx);
            trainer::cpu::gelu_backward(dref.data(), x.data(), g.data(), n, tanh_approx);
            Dev<float> dx(x), dg(g), dout(n), dd(n);
            trainer::cuda::gelu_forward(dout.p, dx.p, n, tanh_approx, nullptr);
            trainer::cuda::gelu_backward(dd.p, dx.p, dg.p, n, tanh_approx, nullptr);
            expect_close(ref, dout.host(), "gelu_forward matches the CPU");
            expect_close(dref, dd.host(), "gelu_backward matches the CPU");
            Dev<uint16_t> dout16(n);
            trainer::cuda::gelu_forward(dout16.p, dx.p, n, tanh_approx, nullptr);
            expect_close_bf16(ref, dout16, "gelu_forward matches the CPU rounded to bf16");
            // On bf16 gradients (amp_bf16): the CPU on the rounded dout, rounded once; and in place.
            const auto [g16, gr] = bf16_rounded(g);
            std::vector<float> rref(n);
            trainer::cpu::gelu_backward(rref.data(), x.data(), gr.data(), n, tanh_approx);
            Dev<uint16_t> dg16(g16), dd16(n);
            trainer::cuda::gelu_backward(dd16.p, dx.p, dg16.p, n, tanh_approx, nullptr);
            expect_close_bf16(rref, dd16, "gelu_backward matches the CPU rounded to bf16");
            trainer::cuda::gelu_backward(dg16.p, dx.p, dg16.p, n, tanh_approx, nullptr);
            expect(dg16.host() == dd16.host(), "gelu_backward in place gives the same bits");
            // On a bf16 pre-activation (the bf16 ff_proj output): the CPU on the rounded input, rounded once.
            const auto [x16, xr] = bf16_rounded(x);
            std::vector<float> fref(n), bref(n);
            trainer::cpu::gelu_forward(fref.data(), xr.data(), n, tanh_approx);
            trainer::cpu::gelu_backward(bref.data(), xr.data(), gr.data(), n, tanh_approx);
            Dev<uint16_t> dx16(x16), df16(n), dg16b(g16), db16(n);
            trainer::cuda::gelu_forward(df16.p, dx16.p, n, tanh_approx, nullptr);
            trainer::cuda::gelu_backward(db16.p, dx16.p, dg16b.p, n, tanh_approx, nullptr);
            expect_close_bf16(fref, df16, "gelu_forward from bf16 matches the CPU rounded to bf16");
            expect_close_bf16(bref, db16, "gelu_backward from bf16 matches the CPU rounded to bf16");
        }
    }
}

void test_swiglu() {
    for (int N : {1, 7, 33}) {
        for (int H : {1, 5, 64, 131}) {  // 64: whole 16-byte words a row (the vector kernels)
            const Where at("N={} H={}", N, H);
            const auto inp = wave(static_cast<size_t>(N) * 2 * H, 3.0f, 0.2f);
            const auto dout = wave(static_cast<size_t>(N) * H, 1.0f, 0.9f);
            std::vector<float> ref(static_cast<size_t>(N) * H), dref(inp.size());
            trainer::cpu::swiglu_forward(ref.data(), inp.data(), N, H);
            trainer::cpu::swiglu_backward(dref.data(), inp.data(), dout.data(), N, H);
            Dev<float> di(inp), dg(dout), dy(ref.size()), dd(inp.size());
            trainer::cuda::swiglu_forward(dy.p, di.p, N, H, nullptr);
            trainer::cuda::swiglu_backward(dd.p, di.p, dg.p, N, H, nullptr);
            expect_close(ref, dy.host(), "swiglu_forward matches the CPU");
            expect_close(dref, dd.host(), "swiglu_backward matches the CPU");
            Dev<uint16_t> dy16(ref.size());
            trainer::cuda::swiglu_forward(dy16.p, di.p, N, H, nullptr);
            expect_close_bf16(ref, dy16, "swiglu_forward matches the CPU rounded to bf16");
            // From a bf16 input (the ff_proj GEMM's bf16 output): the CPU on the rounded input.
            const auto [in16, inr] = bf16_rounded(inp);
            std::vector<float> rref(ref.size()), rdref(inp.size());
            trainer::cpu::swiglu_forward(rref.data(), inr.data(), N, H);
            trainer::cpu::swiglu_backward(rdref.data(), inr.data(), dout.data(), N, H);
            Dev<uint16_t> di16(in16), dyr16(ref.size());
            Dev<float> ddr(inp.size());
            trainer::cuda::swiglu_forward(dyr16.p, di16.p, N, H, nullptr);
            trainer::cuda::swiglu_backward(ddr.p, di16.p, dg.p, N, H, nullptr);
            expect_close_bf16(rref, dyr16, "swiglu_forward from bf16 matches the CPU rounded to bf16");
            expect_close(rdref, ddr.host(), "swiglu_backward from bf16 matches the CPU on the rounded input");
            // All bf16 (amp_bf16's gradients): the CPU on the rounded input and dout, rounded once.
            const auto [g16, gr] = bf16_rounded(dout);
            std::vector<float> bref(inp.size());
            trainer::cpu::swiglu_backward(bref.data(), inr.data(), gr.data(), N, H);
            Dev<uint16_t> dg16(g16), dd16(inp.size());
            trainer::cuda::swiglu_backward(dd16.p, di16.p, dg16.p, N, H, nullptr);
            expect_close_bf16(bref, dd16, "swiglu_backward on bf16 matches the CPU rounded to bf16");
        }
    }
}

void test_adamw() {
    for (size_t n : kSizes) {
        const Where at("n={}", n);
        auto p = wave(n, 0.5f, 0.0f), m = wave(n, 0.01f, 1.0f), v = wave(n, 0.001f, 2.0f);
        for (auto& e : v) e = std::fabs(e);
        const auto g = wave(n, 0.2f, 3.0f);
        Dev<float> dp(p), dg(g), dm(m), dv(v);
        Dev<uint16_t> dp16(n);
        for (long step = 1; step <= 3; ++step) {
            trainer::cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step,
                                       0.8f);
            // The last step also writes the bf16 copy-out.
            trainer::cuda::adamw_update(dp.p, dg.p, dm.p, dv.p, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.8f,
                                        step == 3 ? dp16.p : nullptr, nullptr);
        }
        const auto got = dp.host();
        std::vector<uint16_t> want16(n);
        trainer::cpu::cast_float_to_bf16(want16.data(), got.data(), n);
        expect(want16 == dp16.host(), "adamw_update's bf16 copy-out is the updated parameters rounded to bf16");
        expect_close(p, got, "adamw_update parameters match the CPU");
        expect_close(m, dm.host(), "adamw_update exp_avg matches the CPU");
        expect_close(v, dv.host(), "adamw_update exp_avg_sq matches the CPU");
    }
}

// Multi-tensor AdamW and squared norm over ranges of odd sizes (one chunk, several, a partial last one),
// each range with its own weight decay, one with the bf16 copy-out, one starting 4 bytes past an aligned
// address (the element-wise path; the others take 16-byte accesses): the same as the one-range kernels.
void test_multi_tensor() {
    const std::vector<size_t> sizes = {1, 4097, 10001, 3};
    const std::vector<size_t> offsets = {0, 1, 0, 0};  // elements before the range in its buffers
    const std::vector<float> decays = {0.1f, 0.0f, 0.1f, 0.05f};
    std::vector<std::vector<float>> p, g, m, v;
    for (size_t r = 0; r < sizes.size(); ++r) {
        p.push_back(wave(sizes[r], 0.5f, 0.1f * r));
        g.push_back(wave(sizes[r], 0.2f, 3.0f + r));
        m.push_back(wave(sizes[r], 0.01f, 1.0f + r));
        v.push_back(wave(sizes[r], 0.001f, 2.0f + r));
        for (auto& e : v.back()) e = std::fabs(e);
    }
    // A device copy of host vector h after `off` leading elements, and the range read back.
    auto padded = [](const std::vector<float>& h, size_t off) {
        std::vector<float> x(off, 0.0f);
        x.insert(x.end(), h.begin(), h.end());
        return new Dev<float>(x);
    };
    auto range_of = [&](const Dev<float>* d, size_t r) {
        const auto h = d->host();
        return std::vector<float>(h.begin() + static_cast<long>(offsets[r]), h.end());
    };
    std::vector<Dev<float>*> dp, dg, dm, dv;
    for (size_t r = 0; r < sizes.size(); ++r) {
        dp.push_back(padded(p[r], offsets[r])), dg.push_back(padded(g[r], offsets[r]));
        dm.push_back(padded(m[r], offsets[r])), dv.push_back(padded(v[r], offsets[r]));
    }
    Dev<uint16_t> d16(sizes[2]);
    std::vector<trainer::cuda::AdamwSegment> segs;
    std::vector<trainer::cuda::NormSegment> nsegs;
    size_t chunks = 0;
    const float lr = 1e-3f;
    for (size_t r = 0; r < sizes.size(); ++r) {
        const size_t o = offsets[r];
        segs.push_back({dp[r]->p + o, dg[r]->p + o, dm[r]->p + o, dv[r]->p + o, r == 2 ? d16.p : nullptr, sizes[r],
                        chunks, trainer::cuda::adamw_decay_factor(lr, decays[r])});
        nsegs.push_back({dg[r]->p + o, sizes[r], chunks});
        chunks += (sizes[r] + trainer::cuda::kAdamwChunk - 1) / trainer::cuda::kAdamwChunk;
    }
    Dev<uint8_t> dsegs(segs.size() * sizeof(segs[0])), dnsegs(nsegs.size() * sizeof(nsegs[0]));
    cudaMemcpy(dsegs.p, segs.data(), dsegs.n, cudaMemcpyHostToDevice);
    cudaMemcpy(dnsegs.p, nsegs.data(), dnsegs.n, cudaMemcpyHostToDevice);
    {
        const Where at("squared norm of 4 ranges");
        Dev<double> scratch(trainer::cuda::kNormScratchDoubles);
        double ref = 0.0;
        for (size_t r = 0; r < sizes.size(); ++r) ref += trainer::cpu::squared_norm(g[r].data(), sizes[r]);
        const auto* ns = reinterpret_cast<const trainer::cuda::NormSegment*>(dnsegs.p);
        const double got = trainer::cuda::squared_norm_multi(ns, 4, chunks, scratch.p, nullptr);
        const double again = trainer::cuda::squared_norm_multi(ns, 4, chunks, scratch.p, nullptr);
        expect(std::fabs(got - ref) <= 1e-12 * ref, "squared_norm_multi matches the CPU in double");
        expect(got == again, "squared_norm_multi is deterministic");
    }
    for (long step = 1; step <= 2; ++step) {
        const Where at("AdamW of 4 ranges, step {}", step);
        for (size_t r = 0; r < sizes.size(); ++r) {
            trainer::cpu::adamw_update(p[r].data(), g[r].data(), m[r].data(), v[r].data(), sizes[r], lr, 0.9f, 0.95f,
                                       1e-8f, decays[r], step, 0.7f);
        }
        // The one-range kernel on copies: the multi-tensor one must give the same bits.
        std::vector<std::vector<float>> single_p;
        for (size_t r = 0; r < sizes.size(); ++r) {
            Dev<float> cp(range_of(dp[r], r)), cg(g[r]), cm(range_of(dm[r], r)), cv(range_of(dv[r], r));
            trainer::cuda::adamw_update(cp.p, cg.p, cm.p, cv.p, sizes[r], lr, 0.9f, 0.95f, 1e-8f, decays[r], step, 0.7f,
                                        nullptr, nullptr);
            single_p.push_back(cp.host());
        }
        trainer::cuda::adamw_update_multi(reinterpret_cast<const trainer::cuda::AdamwSegment*>(dsegs.p), 4, chunks, lr,
                                          0.9f, 0.95f, 1e-8f, step, 0.7f, nullptr);
        for (size_t r = 0; r < sizes.size(); ++r) {
            const Where in("range {} (offset {})", r, offsets[r]);
            expect(range_of(dp[r], r) == single_p[r], "adamw_update_multi is bitwise adamw_update on each range");
            expect_close(p[r], range_of(dp[r], r), "adamw_update_multi parameters match the CPU");
            expect_close(m[r], range_of(dm[r], r), "adamw_update_multi exp_avg matches the CPU");
            expect_close(v[r], range_of(dv[r], r), "adamw_update_multi exp_avg_sq matches the CPU");
        }
        std::vector<uint16_t> want16(sizes[2]);
        const auto got2 = range_of(dp[2], 2);
        trainer::cpu::cast_float_to_bf16(want16.data(), got2.data(), sizes[2]);
        expect(want16 == d16.host(), "adamw_update_multi's bf16 copy-out is the updated parameters rounded");
    }
    for (size_t r = 0; r < sizes.size(); ++r) delete dp[r], delete dg[r], delete dm[r], delete dv[r];
}

void test_norms() {
    Dev<double> scratch(trainer::cuda::kNormScratchDoubles);
    for (size_t n : {size_t(0), size_t(1), size_t(1001), size_t(3000017)}) {
        const Where at("n={}", n);
        const auto x = wave(n, 2.0f, 0.4f);
        const double ref = trainer::cpu::squared_norm(x.data(), n);
        double ref_sum = 0.0;
        for (float e : x) ref_sum += e;
        Dev<float> dx(x);
        const double got = trainer::cuda::squared_norm(dx.p, n, scratch.p, nullptr);
        const double again = trainer::cuda::squared_norm(dx.p, n, scratch.p, nullptr);
        const double got_sum = trainer::cuda::sum(dx.p, n, scratch.p, nullptr);
        expect(std::fabs(got - ref) <= 1e-12 * std::fabs(ref) + 1e-300, "squared_norm matches the CPU in double");
        expect(got == again, "squared_norm is deterministic");
        expect(std::fabs(got_sum - ref_sum) <= 1e-9 * (std::fabs(ref) + 1.0), "sum matches the CPU in double");
    }
}

#if !defined(TRAINER_SIMT_EMULATION) || defined(TRAINER_SIMT_DEVICE)
void test_embedding() {
    struct Shape {
        int V, T, C, B;
    };
    // A few tokens repeated over a small micro-batch, and many tokens (some 1000 of them, a run of one or
    // more rows each) over a larger one with an odd width (the scalar path); a width that is a multiple of
    // 4 and wider than one block's 1024 channels (the 16-byte path, two blocks per run, runs of ~30 rows).
    for (const Shape sh : {Shape{37, 5, 67, 3}, Shape{1000, 64, 133, 4}, Shape{50, 128, 1032, 3}}) {
        for (bool with_wpe : {false, true}) {
            const int V = sh.V, T = sh.T, C = sh.C, N = sh.B * T;
            const Where at("V={} T={} C={} N={} wpe={}", V, T, C, N, with_wpe);
            std::vector<int32_t> tok(N);
            // Few distinct tokens (runs of many rows, whose order the sums must keep) and the largest id.
            for (int n = 0; n < N; ++n) tok[n] = (n * n * 7 + 3) % std::min(V, 13);
            if (N > 100) tok[100] = tok[3], tok[200] = V - 1;
            const auto wte = wave(static_cast<size_t>(V) * C, 1.0f, 0.1f),
                       wpe = wave(static_cast<size_t>(T) * C, 0.5f, 0.7f);
            const auto dout = wave(static_cast<size_t>(N) * C, 1.0f, 1.3f);
            std::vector<float> ref(static_cast<size_t>(N) * C), dwte = wave(wte.size(), 0.1f, 2.0f),
                                                                dwpe = wave(wpe.size(), 0.1f, 2.5f);
            Dev<int32_t> dt(tok);
            Dev<float> dwte_d(wte), dwpe_d(wpe), dout_d(dout), out_d(ref.size()), gwte(dwte), gwpe(dwpe);
            Dev<uint8_t> scratch(trainer::cuda::embedding_backward_scratch_bytes(N));
            trainer::cpu::embedding_forward(ref.data(), tok.data(), wte.data(), with_wpe ? wpe.data() : nullptr, N, T,
                                            C);
            trainer::cuda::embedding_forward(out_d.p, dt.p, dwte_d.p, with_wpe ? dwpe_d.p : nullptr, N, T, C, nullptr);
            expect_close(ref, out_d.host(), "embedding_forward matches the CPU");
            trainer::cpu::embedding_backward(dwte.data(), with_wpe ? dwpe.data() : nullptr, dout.data(), tok.data(), N,
                                             T, C);
            trainer::cuda::embedding_backward(gwte.p, with_wpe ? gwpe.p : nullptr, dout_d.p, dt.p, N, T, C, scratch.p,
                                              nullptr);
            // Same additions in the same (row) order: bitwise equal.
            expect(gwte.host() == dwte, "embedding_backward dwte is bitwise the CPU's");
            if (with_wpe) expect(gwpe.host() == dwpe, "embedding_backward dwpe is bitwise the CPU's");
        }
    }
}

#endif  // !TRAINER_SIMT_EMULATION || TRAINER_SIMT_DEVICE

void test_layernorm() {
    for (const bool rms : {false, true}) {
        for (int N : {1, 33, 70}) {
            // 64, 768, 1544, 2056: rows of whole 16-byte words (the vector kernels), the forward's rows held in
            // registers in up to 4 groups of 8 channels a lane (768: 3), in up to 8 (1544: 7), and not held (2056).
            for (int C : {1, 31, 64, 257, 768, 1544, 2056}) {
                if (C > 257 && N != 33) continue;             // the long rows once
                for (int affine = 0; affine < 3; ++affine) {  // none, weight, weight + bias
                    const Where at("rms={} N={} C={} affine={}", rms, N, C, affine);
                    const auto x = wave(static_cast<size_t>(N) * C, 2.0f, 0.2f), g = wave(x.size(), 1.0f, 0.5f);
                    const auto w = wave(C, 1.0f, 1.0f), b = wave(C, 0.3f, 1.5f);
                    const float* wp = affine >= 1 ? w.data() : nullptr;
                    const float* bp = affine == 2 ? b.data() : nullptr;
                    std::vector<float> y(x.size()), mean(N), rstd(N), dx = wave(x.size(), 0.5f, 3.0f);
                    std::vector<float> dw(C, 0.25f), db(C, -0.5f);
                    float* mean_h = rms ? nullptr : mean.data();  // RMSNorm saves no mean
                    trainer::cpu::layernorm_forward(y.data(), mean_h, rstd.data(), x.data(), wp, bp, N, C, 1e-5f, rms);
                    Dev<float> dxin(x), dg(g), dwt(w), dbs(b), dy(y.size()), dmean(N), drstd(N), ddx(dx), ddw(dw),
                        ddb(db);
                    Dev<float> scratch(trainer::cuda::layernorm_backward_scratch_floats(N, C));
                    float* mean_d = rms ? nullptr : dmean.p;
                    trainer::cuda::layernorm_forward(dy.p, mean_d, drstd.p, dxin.p, wp ? dwt.p : nullptr,
                                                     bp ? dbs.p : nullptr, N, C, 1e-5f, rms, nullptr);
                    expect_close(y, dy.host(), "layernorm_forward matches the CPU", 1e-5, 1e-4);
                    expect_close(rstd, drstd.host(), "layernorm rstd matches the CPU", 1e-5, 1e-4);
                    Dev<uint16_t> dy16(y.size());
                    Dev<float> dmean2(N), drstd2(N);
                    trainer::cuda::layernorm_forward(dy16.p, rms ? nullptr : dmean2.p, drstd2.p, dxin.p,
                                                     wp ? dwt.p : nullptr, bp ? dbs.p : nullptr, N, C, 1e-5f, rms,
                                                     nullptr);
                    expect_close_bf16(y, dy16, "layernorm_forward matches the CPU rounded to bf16");
                    expect_close(rstd, drstd2.host(), "layernorm_forward keeps the fp32 statistics", 1e-5, 1e-4);
                    trainer::cpu::layernorm_backward(dx.data(), wp ? dw.data() : nullptr, bp ? db.data() : nullptr,
                                                     g.data(), x.data(), wp, mean_h, rstd.data(), N, C, rms);
                    trainer::cuda::layernorm_backward(ddx.p, wp ? ddw.p : nullptr, bp ? ddb.p : nullptr, dg.p, dxin.p,
                                                      wp ? dwt.p : nullptr, mean_d, drstd.p, N, C, rms, scratch.p,
                                                      nullptr);
                    // Reductions over C (and over rows for dweight/dbias): the reduction tolerance
                    // (docs/gpus.md).
                    expect_close(dx, ddx.host(), "layernorm_backward dinp matches the CPU", 1e-5, 1e-4);
                    if (wp) expect_close(dw, ddw.host(), "layernorm_backward dweight matches the CPU", 1e-5, 1e-4);
                    if (bp) expect_close(db, ddb.host(), "layernorm_backward dbias matches the CPU", 1e-5, 1e-4);
                    if (affine == 0) {
                        // The backward from the norm's output (OLMo's norms), on the fp32 output and on the bf16 one
                        // the model keeps in amp_bf16, against the CPU on the same output.
                        const auto dx0 = wave(x.size(), 0.5f, 3.0f);
                        std::vector<float> want = dx0, want16 = dx0;
                        trainer::cpu::norm_backward_from_output(want.data(), g.data(), y.data(), rstd.data(), N, C,
                                                                rms);
                        Dev<float> dfrom(dx0), dfrom16(dx0);
                        trainer::cuda::norm_backward_from_output(dfrom.p, dg.p, dy.p, drstd.p, N, C, rms, nullptr);
                        expect_close(want, dfrom.host(), "norm_backward_from_output on fp32 matches the CPU", 1e-5,
                                     1e-4);
                        const auto y16 = bf16_widened(dy16.host());
                        trainer::cpu::norm_backward_from_output(want16.data(), g.data(), y16.data(), rstd.data(), N, C,
                                                                rms);
                        trainer::cuda::norm_backward_from_output(dfrom16.p, dg.p, dy16.p, drstd2.p, N, C, rms, nullptr);
                        expect_close(want16, dfrom16.host(), "norm_backward_from_output on bf16 matches the CPU", 1e-5,
                                     1e-4);
                    }
                }
            }
        }
    }
}

// The norm after a sublayer (norm_after): fp32 and bf16 inputs; the backward overwrites dinp (in the input's
// type) and adds into dweight/dbias. C = 2048 (OLMo-2 1B's width) takes the unfused backward.
void test_norm_residual() {
    for (const bool rms : {false, true}) {
        for (int N : {1, 33, 70}) {
            for (int C : {31, 64, 2048}) {
                for (const bool affine : {false, true}) {
                    const Where at("rms={} N={} C={} affine={}", rms, N, C, affine);
                    const size_t NC = static_cast<size_t>(N) * C;
                    const auto x = wave(NC, 2.0f, 0.2f), r = wave(NC, 1.0f, 0.9f), g = wave(NC, 1.0f, 0.5f);
                    const auto w = wave(C, 1.0f, 1.0f), b = wave(C, 0.3f, 1.5f);
                    const float* wp = affine ? w.data() : nullptr;
                    const float* bp = affine ? b.data() : nullptr;
                    Dev<float> dwt(w), dbs(b), dr(r), dg(g);
                    Dev<float> scratch(trainer::cuda::layernorm_backward_scratch_floats(N, C));
                    for (const bool bf16 : {false, true}) {
                        const Where at2("bf16 input={}", bf16);
                        // The CPU runs on the input the GPU reads (rounded to bf16 on the bf16 path).
                        auto [x16, xr] = bf16_rounded(x);
                        const std::vector<float>& xin = bf16 ? xr : x;
                        std::vector<float> out(NC), mean(N), rstd(N), dx(NC), dw(C, 0.25f), db(C, -0.5f);
                        float* mean_h = rms ? nullptr : mean.data();
                        trainer::cpu::norm_residual_forward(out.data(), r.data(), mean_h, rstd.data(), xin.data(), wp,
                                                            bp, N, C, 1e-6f, rms);
                        trainer::cpu::norm_residual_backward(dx.data(), wp ? dw.data() : nullptr,
                                                             bp ? db.data() : nullptr, g.data(), xin.data(), wp, mean_h,
                                                             rstd.data(), N, C, rms);
                        Dev<float> dout(NC), dmean(N), drstd(N), ddw(std::vector<float>(C, 0.25f)),
                            ddb(std::vector<float>(C, -0.5f));
                        float* mean_d = rms ? nullptr : dmean.p;
                        float* dw_d = wp ? ddw.p : nullptr;
                        float* db_d = bp ? ddb.p : nullptr;
                        if (bf16) {
                            Dev<uint16_t> dx16(x16), ddx16(NC);
                            trainer::cuda::norm_residual_forward(
                                dout.p, dr.p, mean_d, drstd.p, static_cast<const uint16_t*>(dx16.p),
                                wp ? dwt.p : nullptr, bp ? dbs.p : nullptr, N, C, 1e-6f, rms, nullptr);
                            trainer::cuda::norm_residual_backward(
                                ddx16.p, dw_d, db_d, dg.p, static_cast<const uint16_t*>(dx16.p), wp ? dwt.p : nullptr,
                                mean_d, drstd.p, N, C, rms, scratch.p, nullptr);
                            // A reduction over C in another order, then one rounding: the bf16 tolerance
                            // (docs/gpus.md).
                            expect_close_bf16(dx, ddx16, "norm_residual_backward's bf16 dinp matches the CPU rounded",
                                              1e-2, 1.6e-2);
                        } else {
                            Dev<float> dxin(x), ddx(wave(NC, 0.5f, 3.0f));  // overwritten: its contents must not matter
                            trainer::cuda::norm_residual_forward(
                                dout.p, dr.p, mean_d, drstd.p, static_cast<const float*>(dxin.p), wp ? dwt.p : nullptr,
                                bp ? dbs.p : nullptr, N, C, 1e-6f, rms, nullptr);
                            trainer::cuda::norm_residual_backward(
                                ddx.p, dw_d, db_d, dg.p, static_cast<const float*>(dxin.p), wp ? dwt.p : nullptr,
                                mean_d, drstd.p, N, C, rms, scratch.p, nullptr);
                            expect_close(dx, ddx.host(), "norm_residual_backward dinp matches the CPU", 1e-5, 1e-4);
                        }
                        expect_close(out, dout.host(), "norm_residual_forward matches the CPU", 1e-5, 1e-4);
                        expect_close(rstd, drstd.host(), "norm_residual_forward's rstd matches the CPU", 1e-5, 1e-4);
                        if (wp)
                            expect_close(dw, ddw.host(), "norm_residual_backward dweight matches the CPU", 1e-5, 1e-4);
                        if (bp)
                            expect_close(db, ddb.host(), "norm_residual_backward dbias matches the CPU", 1e-5, 1e-4);
                    }
                }
            }
        }
    }
}

// QK-norm on q and k inside qkv, fp32 and bf16: the forward in place with the inputs saved, the backward in
// place on dqkv (the fused kernel up to 1024 channels, the unfused one above, whose partials must be taken
// before dinp overwrites dout).
void test_qk_norm() {
    for (const bool rms : {false, true}) {
        for (int N : {1, 33}) {
            // C, KV: k as wide as q, and a quarter of it (grouped-query attention).
            for (const auto& [C, KV] : std::vector<std::pair<int, int>>{{31, 31}, {64, 64}, {64, 16}, {2048, 2048}}) {
                for (int affine = 0; affine < 3; ++affine) {
                    const Where at("rms={} N={} C={} KV={} affine={}", rms, N, C, KV, affine);
                    const int W = C + 2 * KV, Wqk = C + KV;
                    const size_t N3C = static_cast<size_t>(N) * W, N2C = static_cast<size_t>(N) * Wqk;
                    const auto qkv = wave(N3C, 2.0f, 0.4f), g = wave(N3C, 1.0f, 0.7f);
                    const auto qw = wave(C, 1.0f, 1.0f), qb = wave(C, 0.3f, 1.5f), kw = wave(KV, 1.0f, 2.0f),
                               kb = wave(KV, 0.3f, 2.5f);
                    const float* qwp = affine >= 1 ? qw.data() : nullptr;
                    const float* qbp = affine == 2 ? qb.data() : nullptr;
                    const float* kwp = affine >= 1 ? kw.data() : nullptr;
                    const float* kbp = affine == 2 ? kb.data() : nullptr;
                    Dev<float> dqw(qw), dqb(qb), dkw(kw), dkb(kb);
                    Dev<float> scratch(trainer::cuda::layernorm_backward_scratch_floats(N, C));
                    for (const bool bf16 : {false, true}) {
                        const Where at2("bf16={}", bf16);
                        auto [q16, qr] = bf16_rounded(qkv);
                        auto [g16, gr] = bf16_rounded(g);
                        std::vector<float> out = bf16 ? qr : qkv, dq = bf16 ? gr : g, qk(N2C), mean(2 * N), rstd(2 * N);
                        std::vector<float> gq(C, 0.25f), gqb(C, 0.5f), gk(KV, -0.25f), gkb(KV, 0.125f);
                        float* mean_h = rms ? nullptr : mean.data();
                        trainer::cpu::qk_norm_forward(out.data(), qk.data(), mean_h, rstd.data(), qwp, qbp, kwp, kbp, N,
                                                      C, KV, 1e-6f, rms);
                        trainer::cpu::qk_norm_backward(dq.data(), qwp ? gq.data() : nullptr, qbp ? gqb.data() : nullptr,
                                                       kwp ? gk.data() : nullptr, kbp ? gkb.data() : nullptr, qk.data(),
                                                       qwp, kwp, mean_h, rstd.data(), N, C, KV, rms);
                        Dev<float> dmean(2 * N), drstd(2 * N), dgq(std::vector<float>(C, 0.25f)),
                            dgqb(std::vector<float>(C, 0.5f)), dgk(std::vector<float>(KV, -0.25f)),
                            dgkb(std::vector<float>(KV, 0.125f));
                        float* mean_d = rms ? nullptr : dmean.p;
                        float* gq_d = qwp ? dgq.p : nullptr;
                        float* gqb_d = qbp ? dgqb.p : nullptr;
                        float* gk_d = kwp ? dgk.p : nullptr;
                        float* gkb_d = kbp ? dgkb.p : nullptr;
                        if (bf16) {
                            Dev<uint16_t> d_qkv(q16), d_qk(N2C), d_g(g16);
                            trainer::cuda::qk_norm_forward(d_qkv.p, d_qk.p, mean_d, drstd.p, qwp ? dqw.p : nullptr,
                                                           qbp ? dqb.p : nullptr, kwp ? dkw.p : nullptr,
                                                           kbp ? dkb.p : nullptr, N, C, KV, 1e-6f, rms, nullptr);
                            std::vector<uint16_t> saved = d_qk.host(), want(N2C);
                            for (int n = 0; n < N; ++n) {
                                std::copy_n(q16.begin() + static_cast<size_t>(n) * W, Wqk,
                                            want.begin() + static_cast<size_t>(n) * Wqk);
                            }
                            expect(saved == want, "qk_norm_forward saves q and k bitwise (bf16)");
                            expect_close_bf16(out, d_qkv, "qk_norm_forward (bf16) matches the CPU rounded");
                            trainer::cuda::qk_norm_backward(d_g.p, gq_d, gqb_d, gk_d, gkb_d,
                                                            static_cast<const uint16_t*>(d_qk.p), qwp ? dqw.p : nullptr,
                                                            kwp ? dkw.p : nullptr, mean_d, drstd.p, N, C, KV, rms,
                                                            scratch.p, nullptr);
                            expect_close_bf16(dq, d_g, "qk_norm_backward (bf16) matches the CPU rounded", 1e-2, 1.6e-2);
                        } else {
                            Dev<float> d_qkv(qkv), d_qk(N2C), d_g(g);
                            trainer::cuda::qk_norm_forward(d_qkv.p, d_qk.p, mean_d, drstd.p, qwp ? dqw.p : nullptr,
                                                           qbp ? dqb.p : nullptr, kwp ? dkw.p : nullptr,
                                                           kbp ? dkb.p : nullptr, N, C, KV, 1e-6f, rms, nullptr);
                            expect(d_qk.host() == qk, "qk_norm_forward saves q and k bitwise");
                            expect_close(out, d_qkv.host(), "qk_norm_forward matches the CPU (v untouched)", 1e-5,
                                         1e-4);
                            trainer::cuda::qk_norm_backward(d_g.p, gq_d, gqb_d, gk_d, gkb_d,
                                                            static_cast<const float*>(d_qk.p), qwp ? dqw.p : nullptr,
                                                            kwp ? dkw.p : nullptr, mean_d, drstd.p, N, C, KV, rms,
                                                            scratch.p, nullptr);
                            expect_close(dq, d_g.host(), "qk_norm_backward matches the CPU (dv untouched)", 1e-5, 1e-4);
                        }
                        expect_close(rstd, drstd.host(), "qk_norm_forward's rstd matches the CPU", 1e-5, 1e-4);
                        if (qwp) {
                            expect_close(gq, dgq.host(), "qk_norm_backward dq_weight matches the CPU", 1e-5, 1e-4);
                            expect_close(gk, dgk.host(), "qk_norm_backward dk_weight matches the CPU", 1e-5, 1e-4);
                        }
                        if (qbp) {
                            expect_close(gqb, dgqb.host(), "qk_norm_backward dq_bias matches the CPU", 1e-5, 1e-4);
                            expect_close(gkb, dgkb.host(), "qk_norm_backward dk_bias matches the CPU", 1e-5, 1e-4);
                        }
                    }
                }
            }
        }
    }
}

void test_rope() {
    for (int B : {1, 3}) {
        for (int HS : {2, 6, 64}) {
            const Where at("B={} T=11 NH=3 HS={}", B, HS);
            const int T = 11, NH = 3, C = NH * HS;
            auto qkv = wave(static_cast<size_t>(B) * T * 3 * C, 1.0f, 0.4f);
            std::vector<float> cos_t(static_cast<size_t>(T) * HS / 2), sin_t(cos_t.size());
            trainer::cpu::rope_table_f32(cos_t.data(), sin_t.data(), T, HS, 10000.0f);
            Dev<float> dq(qkv), dc(cos_t), ds(sin_t);
            {  // On a bf16 qkv (the att_proj GEMM's bf16 output): the CPU on the rounded input, rounded.
                auto [q16, qr] = bf16_rounded(qkv);
                Dev<uint16_t> dq16(q16);
                trainer::cpu::rope_forward(qr.data(), B, T, NH, HS, 10000.0f);
                trainer::cuda::rope_forward(dq16.p, dc.p, ds.p, B, T, NH, HS, nullptr);
                expect_close_bf16(qr, dq16, "rope_forward on bf16 matches the CPU rounded to bf16");
            }
            trainer::cpu::rope_forward(qkv.data(), B, T, NH, HS, 10000.0f);
            trainer::cuda::rope_forward(dq.p, dc.p, ds.p, B, T, NH, HS, nullptr);
            expect_close(qkv, dq.host(), "rope_forward matches the CPU");
            {  // The backward on a bf16 dqkv (the bf16 attentions' output).
                auto [d16, dr] = bf16_rounded(qkv);
                Dev<uint16_t> dd16(d16);
                trainer::cpu::rope_backward(dr.data(), B, T, NH, HS, 10000.0f);
                trainer::cuda::rope_backward(dd16.p, dc.p, ds.p, B, T, NH, HS, nullptr);
                expect_close_bf16(dr, dd16, "rope_backward on bf16 matches the CPU rounded to bf16");
            }
            trainer::cpu::rope_backward(qkv.data(), B, T, NH, HS, 10000.0f);
            trainer::cuda::rope_backward(dq.p, dc.p, ds.p, B, T, NH, HS, nullptr);
            expect_close(qkv, dq.host(), "rope_backward matches the CPU");
        }
    }
}

// The classifier over fp32 and bf16 logits, with and without the z-loss, against the CPU; every call run with the
// row held in shared memory (kernels.classifier_one_read) and read twice, which must give the same bits. V =
// 57,088 is the most fp32 logits an H100's block holds (and the emulator's); 57,096 is one word more, where
// the fp32 rows are read twice either way and the bf16 rows still fit.
void test_classifier() {
    for (int N : {1, 5, 17}) {
        for (int V : {1, 7, 1000, 50304, 57088, 57096}) {
            for (bool grad : {false, true}) {
                const Where at("N={} V={} grad={}", N, V, grad);
                auto logits = wave(static_cast<size_t>(N) * V, 6.0f, 0.3f);
                std::vector<int32_t> tgt(N);
                for (int n = 0; n < N; ++n) tgt[n] = n == 1 ? -1 : (n * 131) % V;  // row 1 ignored
                Dev<int32_t> dt(tgt);
                // Runs the classifier over device copies of `in` with each kernel; returns one_read's logits,
                // losses and z-losses after checking the other kernel's are the same bits.
                struct Result {
                    std::vector<float> logits, losses, z_losses;
                };
                auto run = [&](const auto& in, float z) {
                    using E = typename std::decay_t<decltype(in)>::value_type;
                    Result first;
                    for (bool one_read : {true, false}) {
                        Dev<E> dl(in);
                        Dev<float> dloss(N), dz(N);
                        if constexpr (std::is_same_v<E, uint16_t>) {
                            trainer::cuda::classifier_forward_backward(dl.p, dloss.p, dt.p, N, V, 0.01f, grad, z,
                                                                       z != 0.0f ? dz.p : nullptr, one_read, nullptr);
                        } else {
                            trainer::cuda::classifier_forward_backward(dl.p, dloss.p, dt.p, N, V, 0.01f, grad, z,
                                                                       z != 0.0f ? dz.p : nullptr, one_read, nullptr);
                        }
                        Result r;
                        const auto h = dl.host();
                        r.logits.resize(h.size());
                        if constexpr (std::is_same_v<E, uint16_t>) {
                            trainer::cpu::cast_bf16_to_float(r.logits.data(), h.data(), h.size());
                        } else {
                            r.logits = h;
                        }
                        r.losses = dloss.host();
                        if (z != 0.0f) r.z_losses = dz.host();
                        if (one_read) {
                            first = std::move(r);
                            continue;
                        }
                        const bool same =
                            std::memcmp(r.logits.data(), first.logits.data(), r.logits.size() * sizeof(float)) == 0 &&
                            r.losses == first.losses && r.z_losses == first.z_losses;
                        expect(same, fmt::format("classifier ({}, z-loss {}): the row held in shared memory and the "
                                                 "row read twice give the same bits",
                                                 sizeof(E) == 2 ? "bf16" : "fp32", z));
                    }
                    return first;
                };
                // bf16 logits (the LM head's bf16 output): the CPU on the rounded logits; dlogits rounded once.
                auto [l16, lr] = bf16_rounded(logits);
                std::vector<float> loss_r(N);
                trainer::cpu::classifier_forward_backward(lr.data(), loss_r.data(), tgt.data(), N, V, 0.01f, grad, 0.0f,
                                                          static_cast<float*>(nullptr));
                const Result r16 = run(l16, 0.0f);
                expect_close(loss_r, r16.losses, "classifier losses on bf16 logits match the CPU", 1e-5, 1e-4);
                if (grad) {
                    expect_close(lr, r16.logits, "classifier dlogits on bf16 match the CPU rounded to bf16", 1e-9,
                                 1.0 / 128);
                }
                // With the z-loss (a large multiplier, so its gradient term is well above the tolerance).
                std::vector<float> lz = logits, loss_z(N), z_ref(N);
                trainer::cpu::classifier_forward_backward(lz.data(), loss_z.data(), tgt.data(), N, V, 0.01f, grad,
                                                          0.05f, z_ref.data());
                const Result rz = run(logits, 0.05f);
                expect_close(z_ref, rz.z_losses, "classifier z-losses match the CPU", 1e-5, 1e-4);
                expect_close(loss_z, rz.losses, "classifier losses with the z-loss match the CPU", 1e-5, 1e-4);
                if (grad) expect_close(lz, rz.logits, "classifier dlogits with the z-loss match the CPU", 1e-9, 1e-4);
                const Result r32 = run(logits, 0.0f);  // before the CPU overwrites logits with its dlogits
                std::vector<float> loss(N);
                trainer::cpu::classifier_forward_backward(logits.data(), loss.data(), tgt.data(), N, V, 0.01f, grad,
                                                          0.0f, static_cast<float*>(nullptr));
                expect_close(loss, r32.losses, "classifier losses match the CPU", 1e-5, 1e-4);
                if (grad) expect_close(logits, r32.logits, "classifier dlogits match the CPU", 1e-9, 1e-4);
            }
        }
    }
}

void test_attention() {
    for (int B : {1, 2}) {
        for (int T : {1, 13, 130}) {
            for (int HS : {8, 40, 72, 128, 200, 256}) {  // 1, 2, 4 and 8 lanes per row; tiles of 32 and 16
                const Where at("B={} T={} NH=3 HS={}", B, T, HS);
                const int NH = 3, C = NH * HS;
                const auto qkv = wave(static_cast<size_t>(B) * T * 3 * C, 1.0f, 0.2f);
                const auto dout = wave(static_cast<size_t>(B) * T * C, 1.0f, 0.8f);
                std::vector<float> out(dout.size()), lse(static_cast<size_t>(B) * NH * T), dqkv(qkv.size());
                trainer::cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
                trainer::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                                                 HS);
                Dev<float> dq(qkv), dg(dout), dout_d(out.size()), dlse(lse.size()), ddq(qkv.size());
                Dev<float> scratch(trainer::cuda::attention_backward_scratch_floats(B, T, NH));
                trainer::cuda::attention_forward(dout_d.p, dlse.p, dq.p, B, T, NH, HS, nullptr);
                expect_close(out, dout_d.host(), "attention_forward out matches the CPU", 1e-5, 1e-4);
                expect_close(lse, dlse.host(), "attention_forward lse matches the CPU", 1e-5, 1e-4);
                trainer::cuda::attention_backward(ddq.p, dg.p, dq.p, dout_d.p, dlse.p, B, T, NH, HS, scratch.p,
                                                  nullptr);
                expect_close(dqkv, ddq.host(), "attention_backward matches the CPU", 1e-5, 1e-4);
            }
        }
    }
}

// Generation's ops (kv_cache.cu) against the CPU: RoPE at each row's position (the CPU's angles, from the same
// table), and attention with a KV cache over three sequences, first a prompt of several rows a
// sequence (causal among themselves), then one decode row each, the caches carried over between the calls; with a
// key/value head for every query head, and shared ones (grouped-query and multi-query attention).
void test_kv_cache() {
    struct Shape {
        int NH, KVH, HS;
    };
    for (const Shape sh : {Shape{3, 3, 8}, Shape{3, 3, 40}, Shape{3, 3, 64}, Shape{3, 3, 128}, Shape{3, 3, 256},
                           Shape{4, 2, 64}, Shape{6, 1, 40}}) {
        const int NH = sh.NH, KVH = sh.KVH, HS = sh.HS;
        const Where at("NH={} KVH={} HS={}", NH, KVH, HS);
        const int C = NH * HS, W = (NH + 2 * KVH) * HS, S = 40, seqs_n = 3;
        std::vector<int32_t> seqs, pos;
        const int prompt[seqs_n] = {5, 1, 33};
        for (int b = 0; b < seqs_n; ++b) {
            for (int t = 0; t < prompt[b]; ++t) seqs.push_back(b), pos.push_back(t);
        }
        const int N = static_cast<int>(seqs.size());
        auto qkv = wave(static_cast<size_t>(N) * W, 1.0f, 0.3f);
        std::vector<float> cos_t(static_cast<size_t>(S) * HS / 2), sin_t(cos_t.size());
        trainer::cpu::rope_table_f32(cos_t.data(), sin_t.data(), S, HS, 10000.0f);
        Dev<float> dq(qkv), dc(cos_t), ds(sin_t);
        Dev<int32_t> dseqs(seqs), dpos(pos);
        trainer::cpu::rope_forward_at(qkv.data(), pos.data(), N, NH, KVH, HS, 10000.0f, S);
        trainer::cuda::rope_forward_at(dq.p, dpos.p, dc.p, ds.p, N, NH, KVH, HS, nullptr);
        expect_close(qkv, dq.host(), "rope_forward_at matches the CPU");
        const size_t cache = static_cast<size_t>(seqs_n) * KVH * S * HS;
        std::vector<float> kc(cache, 0.0f), vc(cache, 0.0f), out(static_cast<size_t>(N) * C);
        Dev<float> dkc(kc), dvc(vc), dout(out.size());
        trainer::cpu::attention_with_cache(out.data(), qkv.data(), kc.data(), vc.data(), seqs.data(), pos.data(), N, NH,
                                           KVH, HS, S);
        trainer::cuda::attention_with_cache(dout.p, dq.p, dkc.p, dvc.p, dseqs.p, dpos.p, N, NH, KVH, HS, S, nullptr);
        expect_close(out, dout.host(), "attention_with_cache over prompts matches the CPU", 1e-5, 1e-5);
        expect_close(kc, dkc.host(), "the prompts' keys in the cache are the CPU's");
        // One decode row a sequence, at the position after its prompt.
        const std::vector<int32_t> step_seqs = {0, 1, 2}, step_pos = {5, 1, 33};
        const auto step = wave(static_cast<size_t>(seqs_n) * W, 0.7f, 0.9f);
        std::vector<float> step_out(static_cast<size_t>(seqs_n) * C);
        Dev<float> dstep(step), dstep_out(step_out.size());
        Dev<int32_t> dss(step_seqs), dsp(step_pos);
        trainer::cpu::attention_with_cache(step_out.data(), step.data(), kc.data(), vc.data(), step_seqs.data(),
                                           step_pos.data(), seqs_n, NH, KVH, HS, S);
        trainer::cuda::attention_with_cache(dstep_out.p, dstep.p, dkc.p, dvc.p, dss.p, dsp.p, seqs_n, NH, KVH, HS, S,
                                            nullptr);
        expect_close(step_out, dstep_out.host(), "attention_with_cache of a decode step matches the CPU", 1e-5, 1e-5);
    }
}

// kv_heads_expand of `inp` and kv_heads_reduce of `dout` on the device, in T's storage: (out, dinp) on the host.
template <typename T>
std::pair<std::vector<T>, std::vector<T>> kv_heads_on_device(const std::vector<T>& inp, const std::vector<T>& dout,
                                                             int N, int NH, int KVH, int HS) {
    Dev<T> d_inp(inp), d_out(dout.size()), d_dout(dout), d_dinp(inp.size());
    trainer::cuda::kv_heads_expand(d_out.p, d_inp.p, N, NH, KVH, HS, nullptr);
    trainer::cuda::kv_heads_reduce(d_dinp.p, d_dout.p, N, NH, KVH, HS, nullptr);
    return {d_out.host(), d_dinp.host()};
}

// Grouped-query attention's shared heads (kv_heads.cu) against the CPU: the expand copies bitwise, the reduce sums
// each group in the CPU's order (fp32: the same bits; bf16: the CPU's fp32 sums of the widened values, rounded).
void test_kv_heads() {
    struct Shape {
        int N, NH, KVH, HS;
    };
    for (const Shape sh : {Shape{5, 4, 2, 8}, Shape{33, 6, 1, 64}, Shape{7, 32, 8, 64}, Shape{3, 3, 3, 40}}) {
        const int N = sh.N, NH = sh.NH, KVH = sh.KVH, HS = sh.HS;
        const Where at("N={} NH={} KVH={} HS={}", N, NH, KVH, HS);
        const size_t narrow = static_cast<size_t>(N) * (NH + 2 * KVH) * HS, wide = static_cast<size_t>(N) * 3 * NH * HS;
        const auto on_cpu = [&](const std::vector<float>& inp, const std::vector<float>& dout) {
            std::vector<float> out(wide), dinp(narrow);
            trainer::cpu::kv_heads_expand(out.data(), inp.data(), N, NH, KVH, HS);
            trainer::cpu::kv_heads_reduce(dinp.data(), dout.data(), N, NH, KVH, HS);
            return std::make_pair(out, dinp);
        };
        const auto inp = wave(narrow, 1.0f, 0.6f), dout = wave(wide, 1.0f, 1.3f);
        const auto [out, dinp] = on_cpu(inp, dout);
        const auto [got_out, got_dinp] = kv_heads_on_device(inp, dout, N, NH, KVH, HS);
        expect(got_out == out, "kv_heads_expand copies the CPU's values bitwise");
        expect(got_dinp == dinp, "kv_heads_reduce sums as the CPU sums, bitwise");
        const auto [inp16, inpr] = bf16_rounded(inp);
        const auto [dout16, doutr] = bf16_rounded(dout);
        const auto [outr, dinpr] = on_cpu(inpr, doutr);
        const auto [got_out16, got_dinp16] = kv_heads_on_device(inp16, dout16, N, NH, KVH, HS);
        expect(got_out16 == bf16_rounded(outr).first, "kv_heads_expand (bf16) copies bitwise");
        expect(got_dinp16 == bf16_rounded(dinpr).first, "kv_heads_reduce (bf16) is the CPU's fp32 sums rounded once");
    }
}

// FP8 operands: the amax bitwise the CPU's (NaN kept), and the codes of x * fp8_scale(amax) row-major and
// transposed equal to element.h's fp8_encode, on shapes across the 32 x 32 tiles and on every bf16 value (with a
// scale of 1: the amax at the format's largest finite value). On compute capability 8.9 and newer the kernel converts
// with the hardware's cvt.rn.satfinite, so this holds the hardware to the CPU (and, through tests/test_fp8.cpp, to
// PyTorch's table); NaN inputs must give a NaN code, whose sign and payload may differ.
// NF4 storage: the codes and absmaxes bitwise the CPU's (partial last blocks, a block of zeros, a NaN), and the
// dequantized values bitwise the CPU's in fp32 and rounded once in bf16, with plain and double-quantized absmaxes.
void test_nf4() {
    for (const size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{130}, size_t{1000}}) {
        const Where at("n={}", n);
        std::vector<float> x = wave(n, 0.05f, 0.3f);
        if (n >= 192) {
            for (size_t i = 128; i < 192; ++i) x[i] = 0.0f;
            x[300] = NAN;
        }
        const size_t bytes = (n + 1) / 2, blocks = trainer::cpu::nf4_blocks(n);
        std::vector<uint8_t> ref_codes(bytes);
        std::vector<float> ref_absmax(blocks), ref_back(n);
        trainer::cpu::nf4_quantize(ref_codes.data(), ref_absmax.data(), x.data(), n);
        trainer::cpu::nf4_dequantize(ref_back.data(), ref_codes.data(), ref_absmax.data(), n);
        Dev<float> dx(x), absmax(blocks), back(n);
        Dev<uint8_t> codes(bytes);
        Dev<uint16_t> back16(n);
        trainer::cuda::nf4_quantize(codes.p, absmax.p, dx.p, n, nullptr);
        expect(codes.host() == ref_codes, "nf4_quantize's codes are the CPU's");
        const std::vector<float> got_absmax = absmax.host();
        expect(std::memcmp(got_absmax.data(), ref_absmax.data(), blocks * sizeof(float)) == 0,
               "nf4_quantize's absmaxes are the CPU's");
        trainer::cuda::nf4_dequantize(back.p, codes.p, absmax.p, n, nullptr);
        trainer::cuda::nf4_dequantize(back16.p, codes.p, absmax.p, n, nullptr);
        const std::vector<float> got = back.host();
        expect(std::memcmp(got.data(), ref_back.data(), n * sizeof(float)) == 0, "nf4_dequantize is the CPU's");
        const std::vector<uint16_t> got16 = back16.host();
        size_t bad = n;
        for (size_t i = 0; i < n && bad == n; ++i) {
            if (got16[i] != trainer::float_to_bf16(ref_back[i])) bad = i;
        }
        expect(bad == n, "nf4_dequantize into bf16 is the CPU's rounded once",
               bad == n ? "" : fmt::format("first mismatch at {}", bad));
        // Double-quantized absmaxes (QLoRA's): decoded and applied in one pass, bitwise the CPU's.
        std::vector<uint8_t> dq_codes(blocks);
        std::vector<float> absmax2(trainer::cpu::double_quant_blocks(blocks)), ref_dq(n);
        float offset = 0.0f;
        trainer::cpu::double_quantize(dq_codes.data(), absmax2.data(), &offset, ref_absmax.data(), blocks);
        trainer::cpu::nf4_dequantize_dq(ref_dq.data(), ref_codes.data(), dq_codes.data(), absmax2.data(), &offset, n);
        Dev<uint8_t> ddq(dq_codes), dcodes(ref_codes);
        Dev<float> dabs2(absmax2), doff(std::vector<float>{offset}), dq_out(n);
        trainer::cuda::nf4_dequantize_dq(dq_out.p, dcodes.p, ddq.p, dabs2.p, doff.p, n, nullptr);
        const std::vector<float> got_dq = dq_out.host();
        expect(std::memcmp(got_dq.data(), ref_dq.data(), n * sizeof(float)) == 0,
               "nf4_dequantize_dq (double-quantized absmaxes) is the CPU's");
        Dev<uint16_t> dq16(n);
        trainer::cuda::nf4_dequantize_dq(dq16.p, dcodes.p, ddq.p, dabs2.p, doff.p, n, nullptr);
        const std::vector<uint16_t> got_dq16 = dq16.host();
        bad = n;
        for (size_t i = 0; i < n && bad == n; ++i) {
            if (got_dq16[i] != trainer::float_to_bf16(ref_dq[i])) bad = i;
        }
        expect(bad == n, "nf4_dequantize_dq into bf16 is the CPU's rounded once",
               bad == n ? "" : fmt::format("first mismatch at {}", bad));
    }
}

// LoRA: the adapters' update and gradients against the CPU's (its BLAS products of the same operands, bf16 ones
// widened): fp32 results within expect_close's tolerance (the adapters' gradients with 1e-5 of their largest element
// added: sums over the rows), bf16 ones within one bf16 rounding of the CPU's fp32 value
// plus that tolerance; on odd sizes (rows not a multiple of the 32-column tiles, a rank not a multiple of the 8-sum
// chunks), the adapted columns a strided part of wider rows, with and without dropout; a second run bitwise the first.
void test_lora() {
    const int M = 37, K = 45, r = 11, n = 29, ld = 41;  // out's rows hold n adapted columns of 41
    const float scale = 1.3f;
    std::vector<uint64_t> keys(M);
    for (int m = 0; m < M; ++m) keys[m] = trainer::lora_row_key(trainer::lora_step_key(5, 2), m / 7, m % 7);
    const std::vector<float> x = wave(size_t(M) * K, 0.8f, 0.1f), A = wave(size_t(r) * K, 0.3f, 0.7f);
    const std::vector<float> B = wave(size_t(n) * r, 0.4f, 1.9f), y0 = wave(size_t(M) * ld, 0.5f, 2.3f);
    const std::vector<float> dy = wave(size_t(M) * ld, 0.6f, 0.4f), dx0 = wave(size_t(M) * K, 0.2f, 1.1f);
    const std::vector<float> dA0 = wave(size_t(r) * K, 0.1f, 0.3f), dB0 = wave(size_t(n) * r, 0.1f, 0.9f);
    Dev<uint64_t> dkeys(keys);
    Dev<float> dAw(A), dBw(B), work(size_t(M) * 2 * r);
    const auto bf16_close = [](const std::vector<float>& ref, const std::vector<uint16_t>& got, const char* what) {
        for (size_t i = 0; i < ref.size(); ++i) {
            const float g = trainer::bf16_to_float(got[i]);
            if (!(std::fabs(g - ref[i]) <= 1e-5 + 1e-5 * std::fabs(ref[i]) + std::fabs(ref[i]) / 256.0)) {
                expect(false, what, fmt::format("first mismatch at {}: ref {:.9g} got {:.9g}", i, ref[i], g));
                return;
            }
        }
    };
    for (const float p : {0.0f, 0.25f}) {
        for (const bool bf16 : {false, true}) {
            const Where at("p={} bf16={}", p, bf16);
            const trainer::cuda::LoraDropoutArgs drop{p, dkeys.p, 7};
            // The operands as stored: bf16 ones rounded, and the CPU reads their values.
            const auto [x16, xr] = bf16_rounded(x);
            const auto [y16, yr] = bf16_rounded(y0);
            const auto [dy16, dyr] = bf16_rounded(dy);
            const auto [dx16, dxr] = bf16_rounded(dx0);
            const std::vector<float>& xin = bf16 ? xr : x;
            std::vector<float> cpu_work(size_t(M) * (K + 2 * r));
            std::vector<float> ref_y = bf16 ? yr : y0, ref_dx = bf16 ? dxr : dx0, ref_dA = dA0, ref_dB = dB0;
            trainer::cpu::lora_forward(ref_y.data(), ld, xin.data(), A.data(), B.data(), M, K, r, n, scale, p,
                                       keys.data(), 7, cpu_work.data());
            trainer::cpu::lora_backward(ref_dx.data(), ref_dA.data(), ref_dB.data(), (bf16 ? dyr : dy).data(), ld,
                                        xin.data(), A.data(), B.data(), M, K, r, n, scale, p, keys.data(), 7,
                                        cpu_work.data());
            std::vector<std::vector<float>> runs_f;
            std::vector<std::vector<uint16_t>> runs_h;
            for (int run = 0; run < 2; ++run) {
                Dev<float> xf(x), yf(y0), dyf(dy), dxf(dx0), dA(dA0), dB(dB0);
                Dev<uint16_t> xh(x16), yh(y16), dyh(dy16), dxh(dx16);
                const void* xp = bf16 ? static_cast<const void*>(xh.p) : xf.p;
                void* yp = bf16 ? static_cast<void*>(yh.p) : yf.p;
                trainer::cuda::lora_forward(yp, bf16, ld, xp, bf16, dAw.p, dBw.p, M, K, r, n, scale, drop, work.p,
                                            nullptr);
                trainer::cuda::lora_backward(bf16 ? static_cast<void*>(dxh.p) : dxf.p, bf16, dA.p, dB.p,
                                             bf16 ? static_cast<const void*>(dyh.p) : dyf.p, bf16, ld, xp, bf16, dAw.p,
                                             dBw.p, M, K, r, n, scale, drop, work.p, nullptr);
                // Sums over the rows whose terms cancel: judged against the tensor's scale as well.
                const auto scaled = [](const std::vector<float>& v) {
                    double m = 0.0;
                    for (float e : v) m = std::max(m, static_cast<double>(std::fabs(e)));
                    return 1e-5 * m;
                };
                expect_close(ref_dA, dA.host(), "lora_backward's dA matches the CPU", scaled(ref_dA));
                expect_close(ref_dB, dB.host(), "lora_backward's dB matches the CPU", scaled(ref_dB));
                if (bf16) {
                    bf16_close(ref_y, yh.host(), "lora_forward into bf16 matches the CPU's rounded once");
                    bf16_close(ref_dx, dxh.host(), "lora_backward's bf16 input gradient matches the CPU's");
                    runs_h.push_back(yh.host()), runs_h.push_back(dxh.host());
                } else {
                    expect_close(ref_y, yf.host(), "lora_forward matches the CPU");
                    expect_close(ref_dx, dxf.host(), "lora_backward's input gradient matches the CPU");
                    runs_f.push_back(yf.host()), runs_f.push_back(dxf.host());
                }
                runs_f.push_back(dA.host()), runs_f.push_back(dB.host());
            }
            const size_t half_f = runs_f.size() / 2, half_h = runs_h.size() / 2;
            for (size_t i = 0; i < half_f; ++i) expect(runs_f[i] == runs_f[half_f + i], "LoRA repeats bitwise");
            for (size_t i = 0; i < half_h; ++i) expect(runs_h[i] == runs_h[half_h + i], "LoRA repeats bitwise (bf16)");
        }
    }
}

// amp_fp8's producer amax (Backend's GemmOperand::amax): the pre-norm's, SwiGLU's forward and backward and the bf16
// GELU kernels' amax of what they stored, bitwise the CPU's FP8 amax pass over it (NaN where a value is NaN), whatever
// the float held before the launch (it is zeroed on the stream), across vector and scalar kernels and partial warps.
void test_producer_amax() {
    const auto same = [](const std::vector<float>& stored, const Dev<float>& amax, const char* what) {
        const float want = trainer::cpu::fp8_amax(stored.data(), stored.size()), got = amax.host()[0];
        expect(std::memcmp(&want, &got, sizeof want) == 0 || (want != want && got != got), what,
               fmt::format("{} where the stored values' amax is {}", got, want));
    };
    const auto wide = [](const Dev<uint16_t>& d) { return bf16_widened(d.host()); };
    for (const bool nan : {false, true}) {
        // Layer norms over rows held in registers (64, 768) and not (2056), LayerNorm and RMSNorm with an affine.
        for (int C : {31, 64, 768, 2056}) {
            if (nan && C != 64) continue;  // a NaN at one shape a kernel
            for (const bool rms : {false, true}) {
                const int N = 9;
                const Where at("layernorm_forward C={} rms={} nan={}", C, rms, nan);
                auto x = wave(static_cast<size_t>(N) * C, 2.0f, 0.2f);
                if (nan) x[static_cast<size_t>(5) * C + 3] = NAN;
                const auto w = wave(C, 1.5f, 1.0f), b = wave(C, 0.3f, 1.5f);
                Dev<float> dx(x), dw(w), db(b), mean(N), rstd(N), amax(std::vector<float>{1e30f});
                Dev<float> y(x.size());
                Dev<uint16_t> y16(x.size());
                trainer::cuda::layernorm_forward(y.p, rms ? nullptr : mean.p, rstd.p, dx.p, dw.p, rms ? nullptr : db.p,
                                                 N, C, 1e-5f, rms, nullptr, amax.p);
                same(y.host(), amax, "layernorm_forward's amax (fp32)");
                trainer::cuda::layernorm_forward(y16.p, rms ? nullptr : mean.p, rstd.p, dx.p, dw.p,
                                                 rms ? nullptr : db.p, N, C, 1e-5f, rms, nullptr, amax.p);
                same(wide(y16), amax, "layernorm_forward's amax (bf16)");
            }
        }
        for (int N : {1, 7, 33}) {
            for (int H : {5, 64, 131}) {
                if (nan && (N != 7 || H != 64)) continue;
                const Where at("swiglu N={} H={} nan={}", N, H, nan);
                auto inp = wave(static_cast<size_t>(N) * 2 * H, 3.0f, 0.2f);
                if (nan) inp[inp.size() - 1] = NAN;  // a gate
                const auto dout = wave(static_cast<size_t>(N) * H, 1.0f, 0.9f);
                const auto [in16, inr] = bf16_rounded(inp);
                const auto [g16, gr] = bf16_rounded(dout);
                Dev<float> di(inp), dg(dout), y(dout.size()), d(inp.size()), amax(std::vector<float>{NAN});
                Dev<uint16_t> di16(in16), dg16(g16), y16(dout.size()), d16(inp.size());
                trainer::cuda::swiglu_forward(y.p, di.p, N, H, nullptr, amax.p);
                same(y.host(), amax, "swiglu_forward's amax (fp32)");
                trainer::cuda::swiglu_forward(y16.p, di.p, N, H, nullptr, amax.p);
                same(wide(y16), amax, "swiglu_forward's amax (fp32 to bf16)");
                trainer::cuda::swiglu_forward(y16.p, di16.p, N, H, nullptr, amax.p);
                same(wide(y16), amax, "swiglu_forward's amax (bf16)");
                trainer::cuda::swiglu_backward(d.p, di.p, dg.p, N, H, nullptr, amax.p);
                same(d.host(), amax, "swiglu_backward's amax (fp32)");
                trainer::cuda::swiglu_backward(d.p, di16.p, dg.p, N, H, nullptr, amax.p);
                same(d.host(), amax, "swiglu_backward's amax (bf16 input)");
                trainer::cuda::swiglu_backward(d16.p, di16.p, dg16.p, N, H, nullptr, amax.p);
                same(wide(d16), amax, "swiglu_backward's amax (bf16)");
            }
        }
        for (size_t n : {size_t{1}, size_t{37}, size_t{4099}}) {
            if (nan && n != 37) continue;
            for (const bool tanh : {false, true}) {
                const Where at("gelu n={} tanh={} nan={}", n, tanh, nan);
                auto x = wave(n, 4.0f, 0.3f);
                if (nan) x[n / 2] = NAN;
                const auto g = wave(n, 1.0f, 0.7f);
                const auto [x16, xr] = bf16_rounded(x);
                const auto [g16, gr] = bf16_rounded(g);
                Dev<float> dx(x), amax(std::vector<float>{-1.0f});
                Dev<uint16_t> dx16(x16), dg16(g16), y16(n);
                trainer::cuda::gelu_forward(y16.p, dx.p, n, tanh, nullptr, amax.p);
                same(wide(y16), amax, "gelu_forward's amax (fp32 to bf16)");
                trainer::cuda::gelu_forward(y16.p, dx16.p, n, tanh, nullptr, amax.p);
                same(wide(y16), amax, "gelu_forward's amax (bf16)");
                trainer::cuda::gelu_backward(y16.p, dx.p, dg16.p, n, tanh, nullptr, amax.p);
                same(wide(y16), amax, "gelu_backward's amax (fp32 input)");
                trainer::cuda::gelu_backward(y16.p, dx16.p, dg16.p, n, tanh, nullptr, amax.p);
                same(wide(y16), amax, "gelu_backward's amax (bf16)");
            }
        }
    }
}

void test_fp8_cast() {
    using trainer::Fp8Format;
    Dev<float> scratch(trainer::cuda::kNormBlocks), amax(1);
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        for (const auto& [rows, cols] :
             {std::pair{1, 1}, std::pair{3, 5}, std::pair{33, 31}, std::pair{64, 96}, std::pair{100, 257}}) {
            for (const bool bf16 : {false, true}) {
                const Where at("{} rows={} cols={} {} input", trainer::fp8_name(f), rows, cols, bf16 ? "bf16" : "fp32");
                const size_t n = static_cast<size_t>(rows) * cols;
                std::vector<float> x = wave(n, 3.0f, 0.4f);
                for (size_t i = 0; i < n; i += 7) x[i] *= 1e-3f;  // small values: the subnormals once scaled
                const auto [x16, x_rounded] = bf16_rounded(x);
                const std::vector<float>& in = bf16 ? x_rounded : x;
                const float ref_amax = trainer::cpu::fp8_amax(in.data(), n);
                Dev<float> dx(in);
                trainer::cuda::fp8_amax(amax.p, dx.p, n, scratch.p, nullptr);
                const float got_amax = amax.host()[0];
                expect(std::memcmp(&ref_amax, &got_amax, sizeof ref_amax) == 0, "fp8_amax matches the CPU",
                       fmt::format("{} against {}", got_amax, ref_amax));
                // Both layouts in one pass, with the descale; then the transposed copy alone.
                Dev<uint8_t> out(n), out_t(n), only_t(n);
                Dev<float> descale(1);
                if (bf16) {
                    Dev<uint16_t> dx16(x16);
                    Dev<float> amax16(1);
                    trainer::cuda::fp8_amax(amax16.p, dx16.p, n, scratch.p, nullptr);
                    const float got16 = amax16.host()[0];
                    expect(std::memcmp(&ref_amax, &got16, sizeof ref_amax) == 0, "fp8_amax of bf16 matches the CPU",
                           fmt::format("{} against {}", got16, ref_amax));
                    trainer::cuda::fp8_cast_transpose(out.p, out_t.p, dx16.p, rows, cols, amax.p, f, descale.p,
                                                      nullptr);
                    trainer::cuda::fp8_cast_transpose(nullptr, only_t.p, dx16.p, rows, cols, amax.p, f, nullptr,
                                                      nullptr);
                } else {
                    trainer::cuda::fp8_cast_transpose(out.p, out_t.p, dx.p, rows, cols, amax.p, f, descale.p, nullptr);
                    trainer::cuda::fp8_cast_transpose(nullptr, only_t.p, dx.p, rows, cols, amax.p, f, nullptr, nullptr);
                }
                const std::vector<uint8_t> got = out.host(), got_t = out_t.host(), got_only_t = only_t.host();
                const float scale = trainer::fp8_scale(ref_amax, f);
                size_t bad = n;
                for (size_t i = 0; i < n && bad == n; ++i) {
                    const uint8_t want = trainer::fp8_encode(in[i] * scale, f);
                    const size_t r = i / cols, c = i % cols;
                    if (got[i] != want || got_t[c * rows + r] != want || got_only_t[c * rows + r] != want) bad = i;
                }
                expect(bad == n, "fp8_cast_transpose matches the CPU row-major and transposed",
                       bad == n ? "" : fmt::format("first mismatch at {}", bad));
                // The transposed copy alone with its rows padded to a multiple of 16: zero codes past `rows`.
                const int padded = (rows + 15) / 16 * 16;
                Dev<uint8_t> pad_t(std::vector<uint8_t>(static_cast<size_t>(padded) * cols, 0xFF));
                if (bf16) {
                    Dev<uint16_t> dx16(x16);
                    trainer::cuda::fp8_cast_transpose(nullptr, pad_t.p, dx16.p, rows, cols, amax.p, f, nullptr, nullptr,
                                                      padded);
                } else {
                    trainer::cuda::fp8_cast_transpose(nullptr, pad_t.p, dx.p, rows, cols, amax.p, f, nullptr, nullptr,
                                                      padded);
                }
                const std::vector<uint8_t> got_pad = pad_t.host();
                size_t bad_pad = got_pad.size();
                for (size_t i = 0; i < got_pad.size() && bad_pad == got_pad.size(); ++i) {
                    const size_t c = i / padded, r = i % padded;
                    const uint8_t want = r < static_cast<size_t>(rows) ? got[r * cols + c] : 0;
                    if (got_pad[i] != want) bad_pad = i;
                }
                expect(bad_pad == got_pad.size(), "fp8_cast_transpose pads the transposed rows with zero codes",
                       bad_pad == got_pad.size() ? "" : fmt::format("first mismatch at {}", bad_pad));
                const float want_descale = 1.0f / scale, got_descale = descale.host()[0];
                expect(std::memcmp(&want_descale, &got_descale, sizeof want_descale) == 0,
                       "fp8_cast_transpose writes 1 / the scale",
                       fmt::format("{} against {}", got_descale, want_descale));
            }
        }
#ifndef TRAINER_SIMT_EMULATION
        // Every bf16 value, at a scale of 1: the hardware's conversions against the CPU's (on the emulator the kernel
        // converts with the CPU's own function, and tests/test_fp8.cpp covers every value).
        const Where at("{} every bf16 value", trainer::fp8_name(f));
        const auto same_code = [](float x, uint8_t want, uint8_t got, Fp8Format f) {
            if (x != x) return trainer::fp8_decode(got, f) != trainer::fp8_decode(got, f);
            return want == got;
        };
        std::vector<uint16_t> all(65536);
        for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
        Dev<uint16_t> dall(all);
        Dev<float> unit(std::vector<float>{trainer::fp8_spec(f).max_finite});
        Dev<uint8_t> codes(all.size());
        trainer::cuda::fp8_cast_transpose(codes.p, nullptr, dall.p, 256, 256, unit.p, f, nullptr, nullptr);
        const std::vector<uint8_t> got = codes.host();
        long mismatches = 0;
        size_t first = all.size();
        for (size_t i = 0; i < all.size(); ++i) {
            const float x = trainer::bf16_to_float(all[i]);
            if (!same_code(x, trainer::fp8_encode(x, f), got[i], f)) {
                ++mismatches;
                first = std::min(first, i);
            }
        }
        expect(mismatches == 0, "every bf16 value converts as the CPU does",
               fmt::format("{} mismatches, the first at bf16 {:#06x}", mismatches, first));
#endif
    }
    // A NaN anywhere: the amax is NaN (and the scale 1).
    Dev<float> with_nan(std::vector<float>{1.0f, NAN, -2.0f});
    trainer::cuda::fp8_amax(amax.p, with_nan.p, 3, scratch.p, nullptr);
    expect(std::isnan(amax.host()[0]), "fp8_amax keeps a NaN");
}

// A Linear layer's bias gradient (bias.cu): dbias += the column sums of an fp32 or bf16 dout, against the CPU's
// sums in double, for row counts across the 128-row chunks and column counts with and without 16-byte rows
// (and a dout at a 4-byte offset: the scalar path); the same bits from both paths and on a second run.
void test_bias_gradient() {
    for (int M : {1, 7, 130, 1000}) {
        for (int N : {3, 8, 40, 264}) {
            const Where at("M={} N={}", M, N);
            const auto g = wave(static_cast<size_t>(M) * N + 4, 1.0f, 2.1f);
            const auto [g16, gr] = bf16_rounded(g);
            const auto start = wave(N, 0.1f, 1.9f);
            // Reference sums in double of rows 0..M-1 of the dout starting at element `off`, added to `start`.
            const auto want = [&](const std::vector<float>& d, size_t off) {
                std::vector<float> r(N);
                for (int n = 0; n < N; ++n) {
                    double acc = 0.0;
                    for (int m = 0; m < M; ++m) acc += d[off + static_cast<size_t>(m) * N + n];
                    r[n] = static_cast<float>(start[n] + acc);
                }
                return r;
            };
            Dev<float> dg(g), scratch(trainer::cuda::bias_gradient_scratch_floats(M, N));
            Dev<uint16_t> dg16(g16);
            for (size_t off : {size_t(0), size_t(1)}) {
                const Where at_off("offset={}", off);
                Dev<float> a(start), b(start), c(start);
                trainer::cuda::bias_gradient(a.p, dg.p + off, M, N, scratch.p, nullptr);
                expect_close(want(g, off), a.host(), "bias_gradient of an fp32 dout matches the CPU", 1e-5, 1e-4);
                trainer::cuda::bias_gradient(b.p, dg16.p + off, M, N, scratch.p, nullptr);
                expect_close(want(gr, off), b.host(), "bias_gradient of a bf16 dout matches the CPU", 1e-5, 1e-4);
                trainer::cuda::bias_gradient(c.p, dg16.p + off, M, N, scratch.p, nullptr);
                expect(b.host() == c.host(), "bias_gradient repeats bitwise");
                if (off == 1) continue;
                // Vector loads (aligned rows) and scalar ones (the dout one element on): the same column sums in
                // the same order, so the same bits where the same values are summed.
                Dev<float> d(start), e(start);
                std::vector<float> shifted(g.size());
                for (size_t i = 0; i + 1 < g.size(); ++i) shifted[i + 1] = g[i];
                Dev<float> ds(shifted);
                trainer::cuda::bias_gradient(d.p, dg.p, M, N, scratch.p, nullptr);
                trainer::cuda::bias_gradient(e.p, ds.p + 1, M, N, scratch.p, nullptr);
                expect(d.host() == e.host(), "bias_gradient gives the same bits with and without vector loads");
            }
        }
    }
}

// Hopper's wgmma (wgmma_tile.h): S = Q K^T from shared memory and O = P V with P = S in bf16 from registers,
// against sums in double of the same bf16 operands (O's from the kernel's own S rounded to bf16, so that a last-bit
// difference of S cannot move a rounding). Compute capability 9.0 only (flash_attention_sm90_available).
void test_wgmma_tiles() {
    for (int head : {64, 128}) {
        for (int keys : {64, 128}) {
            const Where at("head={} keys={}", head, keys);
            const auto [q16, q] = bf16_rounded(wave(static_cast<size_t>(64) * head, 1.0f, 0.3f));
            const auto [k16, k] = bf16_rounded(wave(static_cast<size_t>(keys) * head, 1.0f, 1.7f));
            const auto [v16, v] = bf16_rounded(wave(static_cast<size_t>(keys) * head, 1.0f, 2.9f));
            std::vector<float> s(static_cast<size_t>(64) * keys), o(static_cast<size_t>(64) * head);
            trainer::cuda::wgmma_tile_products(head, keys, q16.data(), k16.data(), v16.data(), s.data(), o.data());
            std::vector<float> want_s(s.size()), want_o(o.size());
            for (int r = 0; r < 64; ++r) {
                for (int j = 0; j < keys; ++j) {
                    double acc = 0.0;
                    for (int c = 0; c < head; ++c) acc += double{q[r * head + c]} * k[j * head + c];
                    want_s[r * keys + j] = static_cast<float>(acc);
                }
            }
            const auto p = bf16_rounded(s).second;
            for (int r = 0; r < 64; ++r) {
                for (int c = 0; c < head; ++c) {
                    double acc = 0.0;
                    for (int j = 0; j < keys; ++j) acc += double{p[r * keys + j]} * v[j * head + c];
                    want_o[r * head + c] = static_cast<float>(acc);
                }
            }
            // fp32 sums of up to 128 products of magnitude at most 1 (S) and 128 (O): 1e-4 absolute, 1e-5 relative.
            expect_close(want_s, s, "wgmma S = Q K^T (K-major descriptors) matches the CPU", 1e-4, 1e-5);
            expect_close(want_o, o, "wgmma O = P V (P from registers, V N-major) matches the CPU", 1e-3, 1e-5);
        }
    }
}

#ifndef TRAINER_SIMT_EMULATION
// cuDNN's fused attention against the CPU on the same bf16-rounded qkv and dout: P is rounded to bf16
// inside cuDNN and its outputs are bf16, so the bf16 tolerance (docs/gpus.md) applies (lse is fp32).
void test_attention_cudnn() {
    trainer::cuda::CudnnAttention att;
    std::unique_ptr<Dev<uint8_t>> ws_buf;  // the workspace, grown as the plans ask (the backend's scratch)
    const trainer::cuda::CudnnAttention::Workspace ws = [&](size_t bytes) -> void* {
        if (!ws_buf || ws_buf->n < bytes) ws_buf = std::make_unique<Dev<uint8_t>>(bytes);
        return ws_buf->p;
    };
    for (int B : {1, 2}) {
        for (int T : {2, 37, 130}) {
            for (int HS : {16, 64, 128}) {
                const Where at("B={} T={} NH=3 HS={}", B, T, HS);
                const int NH = 3, C = NH * HS;
                const auto [qkv16, qkv] = bf16_rounded(wave(static_cast<size_t>(B) * T * 3 * C, 1.0f, 0.2f));
                const auto [dout16, dout] = bf16_rounded(wave(static_cast<size_t>(B) * T * C, 1.0f, 0.8f));
                std::vector<float> out(dout.size()), lse(static_cast<size_t>(B) * NH * T), dqkv(qkv.size());
                trainer::cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
                Dev<uint16_t> dq(qkv16), dg(dout16), dout_d(out.size()), ddq(qkv.size());
                Dev<float> dlse(lse.size());
                att.forward(dout_d.p, dlse.p, dq.p, B, T, NH, HS, ws, nullptr);
                const auto got_out = bf16_widened(dout_d.host());
                expect_close(out, got_out, "cuDNN attention forward out matches the CPU", 1e-2, 1.6e-2);
                expect_close(lse, dlse.host(), "cuDNN attention forward lse matches the CPU", 1e-4, 1e-4);
                // The backward takes cuDNN's own (bf16) output, as the backend passes it.
                trainer::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), got_out.data(), lse.data(), B, T,
                                                 NH, HS);
                att.backward(ddq.p, dg.p, dq.p, dout_d.p, dlse.p, B, T, NH, HS, ws, nullptr);
                expect_close(dqkv, bf16_widened(ddq.host()), "cuDNN attention backward matches the CPU", 1e-2, 1.6e-2);
            }
        }
    }
    cudaDeviceSynchronize();
}

// Our flash attention against the CPU on bf16-rounded qkv and dout (P rounded to bf16 before P V, bf16
// outputs: the bf16 tolerance (docs/gpus.md); lse is fp32), and run twice: bitwise the same (no atomics in its
// sums). T up to 300 spans several key tiles of 64 and query tiles of 32 and 64, with partial last tiles.
void test_attention_flash() {
    for (int B : {1, 2}) {
        for (int T : {2, 37, 64, 128, 130, 256, 300}) {
            for (int HS : {64, 128}) {
                const Where at("B={} T={} NH=3 HS={}", B, T, HS);
                const int NH = 3, C = NH * HS;
                const auto [qkv16, qkv] = bf16_rounded(wave(static_cast<size_t>(B) * T * 3 * C, 1.0f, 0.2f));
                const auto [dout16, dout] = bf16_rounded(wave(static_cast<size_t>(B) * T * C, 1.0f, 0.8f));
                std::vector<float> out(dout.size()), lse(static_cast<size_t>(B) * NH * T), dqkv(qkv.size());
                trainer::cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
                Dev<uint16_t> dq(qkv16), dg(dout16), dout_d(out.size()), ddq(qkv.size()), ddq2(qkv.size());
                Dev<float> dlse(lse.size()), dlse2(lse.size());
                Dev<uint8_t> scratch(trainer::cuda::flash_attention_backward_scratch_bytes(B, T, NH, HS));
                trainer::cuda::flash_attention_forward(dout_d.p, dlse.p, dq.p, B, T, NH, HS, nullptr);
                const auto got_out16 = dout_d.host();
                const auto got_out = bf16_widened(got_out16);
                expect_close(out, got_out, "flash attention forward out matches the CPU", 1e-2, 1.6e-2);
                expect_close(lse, dlse.host(), "flash attention forward lse matches the CPU", 1e-4, 1e-4);
                trainer::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), got_out.data(), lse.data(), B, T,
                                                 NH, HS);
                trainer::cuda::flash_attention_backward(ddq.p, dg.p, dq.p, dout_d.p, dlse.p, B, T, NH, HS, scratch.p,
                                                        nullptr);
                const auto got_dqkv16 = ddq.host();
                expect_close(dqkv, bf16_widened(got_dqkv16), "flash attention backward matches the CPU", 1e-2, 1.6e-2);
                // Determinism: the same inputs again give the same bits.
                trainer::cuda::flash_attention_forward(dout_d.p, dlse2.p, dq.p, B, T, NH, HS, nullptr);
                expect(dout_d.host() == got_out16 && dlse2.host() == dlse.host(),
                       "flash attention forward repeats bitwise");
                trainer::cuda::flash_attention_backward(ddq2.p, dg.p, dq.p, dout_d.p, dlse.p, B, T, NH, HS, scratch.p,
                                                        nullptr);
                expect(ddq2.host() == got_dqkv16, "flash attention backward repeats bitwise");
                // The mma.sync kernels on their own (flash_attention_forward and _backward run the wgmma ones on
                // compute capability 9.0), the backward from the same forward output.
                Dev<uint16_t> out80(out.size()), dq80(qkv.size());
                Dev<float> lse80(lse.size());
                trainer::cuda::flash_attention_forward_sm80(out80.p, lse80.p, dq.p, B, T, NH, HS, nullptr);
                expect_close(out, bf16_widened(out80.host()), "the mma.sync flash forward out matches the CPU", 1e-2,
                             1.6e-2);
                expect_close(lse, lse80.host(), "the mma.sync flash forward lse matches the CPU", 1e-4, 1e-4);
                trainer::cuda::flash_attention_backward_sm80(dq80.p, dg.p, dq.p, dout_d.p, dlse.p, B, T, NH, HS,
                                                             scratch.p, nullptr);
                expect_close(dqkv, bf16_widened(dq80.host()), "the mma.sync flash backward matches the CPU", 1e-2,
                             1.6e-2);
            }
        }
    }
}

// At a size where the blocks far outnumber those resident (B 4, 16 heads, T 1024: 512 forward blocks, 1,536
// backward ones), against the native fp32 CUDA kernels on the same bf16-rounded inputs (a CPU reference would be slow),
// at the bf16 tolerance, and bitwise repeatable.
void test_attention_flash_large() {
    const int B = 4, NH = 16, T = 1024;
    for (int HS : {64, 128}) {
        const Where at("B={} T={} NH={} HS={}", B, T, NH, HS);
        const int C = NH * HS;
        const auto [qkv16, qkv] = bf16_rounded(wave(static_cast<size_t>(B) * T * 3 * C, 1.0f, 0.2f));
        const auto [dout16, dout] = bf16_rounded(wave(static_cast<size_t>(B) * T * C, 1.0f, 0.8f));
        const size_t NC = static_cast<size_t>(B) * T * C, nlse = static_cast<size_t>(B) * NH * T;
        Dev<uint16_t> dq(qkv16), dg(dout16), fout(NC), fdq(3 * NC), fdq2(3 * NC);
        Dev<float> flse(nlse), nq(qkv), ng(dout), nout(NC), nlse_d(nlse), ndq(3 * NC);
        Dev<float> nscratch(trainer::cuda::attention_backward_scratch_floats(B, T, NH));
        Dev<uint8_t> fscratch(trainer::cuda::flash_attention_backward_scratch_bytes(B, T, NH, HS));
        trainer::cuda::flash_attention_forward(fout.p, flse.p, dq.p, B, T, NH, HS, nullptr);
        const auto got_out = bf16_widened(fout.host());
        // The native backward takes the flash output (as the CPU reference does in test_attention_flash).
        Dev<float> fout32(got_out);
        trainer::cuda::attention_forward(nout.p, nlse_d.p, nq.p, B, T, NH, HS, nullptr);
        expect_close(nout.host(), got_out, "flash attention forward out matches the native kernels", 1e-2, 1.6e-2);
        expect_close(nlse_d.host(), flse.host(), "flash attention lse matches the native kernels", 1e-4, 1e-4);
        Dev<uint16_t> out80(NC);
        Dev<float> lse80(nlse);
        trainer::cuda::flash_attention_forward_sm80(out80.p, lse80.p, dq.p, B, T, NH, HS, nullptr);
        expect_close(nout.host(), bf16_widened(out80.host()), "the mma.sync flash forward matches the native kernels",
                     1e-2, 1.6e-2);
        expect_close(nlse_d.host(), lse80.host(), "the mma.sync flash lse matches the native kernels", 1e-4, 1e-4);
        trainer::cuda::attention_backward(ndq.p, ng.p, nq.p, fout32.p, flse.p, B, T, NH, HS, nscratch.p, nullptr);
        trainer::cuda::flash_attention_backward(fdq.p, dg.p, dq.p, fout.p, flse.p, B, T, NH, HS, fscratch.p, nullptr);
        const auto got_dq = fdq.host();
        expect_close(ndq.host(), bf16_widened(got_dq), "flash attention backward matches the native kernels", 1e-2,
                     1.6e-2);
        trainer::cuda::flash_attention_backward(fdq2.p, dg.p, dq.p, fout.p, flse.p, B, T, NH, HS, fscratch.p, nullptr);
        expect(fdq2.host() == got_dq, "flash attention backward repeats bitwise over many blocks");
        trainer::cuda::flash_attention_backward_sm80(fdq2.p, dg.p, dq.p, fout.p, flse.p, B, T, NH, HS, fscratch.p,
                                                     nullptr);
        expect_close(ndq.host(), bf16_widened(fdq2.host()), "the mma.sync flash backward matches the native kernels",
                     1e-2, 1.6e-2);
    }
}
#endif  // TRAINER_SIMT_EMULATION

#if !defined(TRAINER_SIMT_EMULATION) || defined(TRAINER_SIMT_DEVICE)
void test_matmul() {
    trainer::cuda::Gemm gemm;
    for (int M : {1, 7, 130}) {
        for (int K : {1, 33}) {
            for (int N : {3, 65}) {
                for (bool with_bias : {false, true}) {
                    const Where at("M={} K={} N={} bias={}", M, K, N, with_bias);
                    const auto x = wave(static_cast<size_t>(M) * K, 1.0f, 0.1f),
                               w = wave(static_cast<size_t>(N) * K, 0.5f, 0.6f);
                    const auto b = wave(N, 0.3f, 1.2f), g = wave(static_cast<size_t>(M) * N, 1.0f, 2.1f);
                    std::vector<float> y(static_cast<size_t>(M) * N), dx = wave(x.size(), 0.2f, 0.3f);
                    std::vector<float> dw = wave(w.size(), 0.1f, 0.9f), db = wave(N, 0.1f, 1.9f);
                    Dev<float> dxin(x), dwt(w), dbs(b), dg(g), dy(y.size()), ddx(dx), ddw(dw), ddb(db);
                    trainer::cpu::matmul_forward(y.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, M, K, N);
                    trainer::cuda::matmul_forward(gemm, dy.p, dxin.p, dwt.p, with_bias ? dbs.p : nullptr, M, K, N,
                                                  nullptr);
                    expect_close(y, dy.host(), "matmul_forward matches the CPU", 1e-5, 1e-4);
                    for (bool acc : {false, true}) {
                        const Where acc_at("accumulate={}", acc);
                        trainer::cpu::matmul_backward(dx.data(), dw.data(), with_bias ? db.data() : nullptr, g.data(),
                                                      x.data(), w.data(), M, K, N, acc);
                        trainer::cuda::matmul_backward(gemm, ddx.p, ddw.p, dg.p, dxin.p, dwt.p, M, K, N, acc, nullptr);
                        if (with_bias) {
                            Dev<float> scratch(trainer::cuda::bias_gradient_scratch_floats(M, N));
                            trainer::cuda::bias_gradient(ddb.p, dg.p, M, N, scratch.p, nullptr);
                        }
                        expect_close(dx, ddx.host(), "matmul_backward dinp matches the CPU", 1e-5, 1e-4);
                        expect_close(dw, ddw.host(), "matmul_backward dweight matches the CPU", 1e-5, 1e-4);
                        if (with_bias)
                            expect_close(db, ddb.host(), "matmul_backward dbias matches the CPU", 1e-5, 1e-4);
                    }
                }
            }
        }
    }
}

// A bias at a 4-byte offset (where a unit's parameters sit) takes the separate bias pass rather than the
// epilogue's vector loads, and an empty product (K = 0) gives the bias alone, as on the CPU.
void test_matmul_unaligned_bias_and_empty_k() {
    trainer::cuda::Gemm gemm;
    const int M = 5, N = 12;
    for (int K : {16, 0}) {
        const Where at("M=5 K={} N=12", K);
        const auto x = wave(static_cast<size_t>(M) * K, 1.0f, 0.1f), w = wave(static_cast<size_t>(N) * K, 0.5f, 0.6f);
        const auto padded = wave(N + 1, 0.3f, 1.2f);
        std::vector<float> y(static_cast<size_t>(M) * N);
        if (K > 0) {
            trainer::cpu::matmul_forward(y.data(), x.data(), w.data(), padded.data() + 1, M, K, N);
        } else {  // every row is the bias (BLAS refuses K = 0 leading dimensions, so no CPU call)
            for (int r = 0; r < M; ++r) std::copy(padded.begin() + 1, padded.end(), y.begin() + r * N);
        }
        Dev<float> dxin(x), dwt(w), dbias(padded), dy(y.size());
        trainer::cuda::matmul_forward(gemm, dy.p, dxin.p, dwt.p, dbias.p + 1, M, K, N, nullptr);
        expect_close(y, dy.host(),
                     K == 0 ? "matmul_forward with K = 0 gives the bias"
                            : "matmul_forward with a bias at a 4-byte offset matches the CPU",
                     1e-5, 1e-4);
    }
}

// The Linear + tanh GELU forward: fused into cuBLASLt's GELU_AUX(_BIAS) epilogue where N % 8 == 0 and the
// bias is aligned, the unfused fallback otherwise; both against the CPU's GEMM then GELU, fp32 operands
// and bf16-rounded ones.
void test_matmul_gelu() {
    trainer::cuda::Gemm gemm;
    for (int M : {7, 130}) {
        for (int K : {16, 33}) {
            for (int N : {24, 20}) {
                for (int bias_mode : {0, 1, 2}) {  // none, aligned, at a 4-byte offset
                    for (bool bf16 : {false, true}) {
                        const Where at("M={} K={} N={} bias={} bf16={}", M, K, N, bias_mode, bf16);
                        auto x = wave(static_cast<size_t>(M) * K, 1.0f, 0.1f),
                             w = wave(static_cast<size_t>(N) * K, 0.5f, 0.6f);
                        const auto padded = wave(N + 1, 0.3f, 1.2f);
                        const auto [x16, xr] = bf16_rounded(x);
                        const auto [w16, wr] = bf16_rounded(w);
                        if (bf16) x = xr, w = wr;
                        const float* b = bias_mode == 0 ? nullptr : padded.data() + (bias_mode == 2 ? 1 : 0);
                        std::vector<float> pre(static_cast<size_t>(M) * N), out(pre.size());
                        trainer::cpu::matmul_forward(pre.data(), x.data(), w.data(), b, M, K, N);
                        trainer::cpu::gelu_forward(out.data(), pre.data(), pre.size(), true);
                        Dev<float> dx(x), dw(w), dbias(padded), dpre(pre.size()), dout(out.size());
                        Dev<uint16_t> dx16(x16), dw16(w16);
                        const float* db = bias_mode == 0 ? nullptr : dbias.p + (bias_mode == 2 ? 1 : 0);
                        if (bf16) {
                            trainer::cuda::matmul_gelu_forward(gemm, dpre.p, dout.p, dx16.p, dw16.p, db, M, K, N,
                                                               nullptr);
                        } else {
                            trainer::cuda::matmul_gelu_forward(gemm, dpre.p, dout.p, dx.p, dw.p, db, M, K, N, nullptr);
                        }
                        expect_close(pre, dpre.host(), "matmul_gelu_forward pre-activation matches the CPU", 1e-5,
                                     1e-4);
                        expect_close(out, dout.host(), "matmul_gelu_forward GELU matches the CPU", 1e-5, 1e-4);
                        if (!bf16 || bias_mode == 2) continue;
                        // pre and out in bf16 (amp_bf16's), the bias rounded to bf16: the CPU on the rounded
                        // bias, each output rounded once; where the epilogue cannot (N = 20: not a multiple
                        // of 8; or no such cuBLASLt kernel), false and nothing written.
                        std::vector<float> pre_r(pre.size()), out_r(pre.size());
                        const auto [b16, br] = bf16_rounded(padded);
                        trainer::cpu::matmul_forward(pre_r.data(), x.data(), w.data(), bias_mode ? br.data() : nullptr,
                                                     M, K, N);
                        trainer::cpu::gelu_forward(out_r.data(), pre_r.data(), pre_r.size(), true);
                        Dev<uint16_t> db16(b16), dpre16(pre.size()), dout16(pre.size());
                        const bool fused = trainer::cuda::matmul_gelu_forward(
                            gemm, dpre16.p, dout16.p, dx16.p, dw16.p, bias_mode ? db16.p : nullptr, M, K, N, nullptr);
                        if (N % 8 != 0) expect(!fused, "the bf16 GELU epilogue refuses N not a multiple of 8");
                        if (!fused) continue;
                        // the starting bf16 tolerance (docs/gpus.md), not one rounding's: on the H100
                        // cuBLASLt's epilogue rounds the product to bf16 before it adds the bias (3.5e-4 off, 2.9%, on
                        // a value of 0.012 left by cancellation) and takes the GELU of the rounded pre (1.2%).
                        expect_close_bf16(pre_r, dpre16, "bf16 matmul_gelu_forward pre matches the CPU rounded to bf16",
                                          1e-2, 1.6e-2);
                        expect_close_bf16(out_r, dout16,
                                          "bf16 matmul_gelu_forward GELU matches the CPU rounded to bf16", 1e-2,
                                          1.6e-2);
                    }
                }
            }
        }
    }
}

// bf16 GEMMs (amp_bf16) against the CPU GEMM on the same operands rounded to bf16: both accumulate in
// fp32, so the fp32 GEMM tolerance holds.
void test_matmul_bf16() {
    trainer::cuda::Gemm gemm;
    for (int M : {1, 7, 130}) {
        for (int K : {8, 40}) {  // bf16 rows of 16-byte multiples, as the model's channel counts are
            for (int N : {8, 72}) {
                const Where at("M={} K={} N={}", M, K, N);
                const auto x = wave(static_cast<size_t>(M) * K, 1.0f, 0.1f),
                           w = wave(static_cast<size_t>(N) * K, 0.5f, 0.6f);
                const auto b = wave(N, 0.3f, 1.2f), g = wave(static_cast<size_t>(M) * N, 1.0f, 2.1f);
                const auto [x16, xr] = bf16_rounded(x);
                const auto [w16, wr] = bf16_rounded(w);
                const auto [g16, gr] = bf16_rounded(g);
                std::vector<float> y(static_cast<size_t>(M) * N), dx(x.size(), 0.0f), dw(w.size(), 0.0f);
                trainer::cpu::matmul_forward(y.data(), xr.data(), wr.data(), b.data(), M, K, N);
                Dev<uint16_t> dx16(x16), dw16(w16), dg16(g16);
                Dev<float> dbias(b), dy(y.size()), ddx(dx), ddw(dw);
                trainer::cuda::matmul_forward(gemm, dy.p, dx16.p, dw16.p, dbias.p, M, K, N, nullptr);
                expect_close(y, dy.host(), "bf16 matmul_forward matches the CPU on rounded operands", 1e-5, 1e-4);
                // The bf16 output (no bias): the CPU's product rounded once.
                std::vector<float> y0(y.size());
                trainer::cpu::matmul_forward(y0.data(), xr.data(), wr.data(), static_cast<const float*>(nullptr), M, K,
                                             N);
                Dev<uint16_t> dy16(y.size());
                expect(trainer::cuda::matmul_forward(gemm, dy16.p, dx16.p, dw16.p, nullptr, M, K, N, nullptr),
                       "cuBLASLt runs the bf16-output GEMM");
                expect_close_bf16(y0, dy16, "bf16-output matmul_forward matches the CPU rounded to bf16");
                // resid + the product + bias in one GEMM (the residual add in the epilogue), into another buffer
                // and in place.
                const auto resid = wave(y.size(), 2.0f, 0.7f);
                std::vector<float> yr(y.size());
                for (size_t i = 0; i < y.size(); ++i) yr[i] = resid[i] + y[i];
                Dev<float> dres(resid), dres2(resid), dyr(y.size());
                expect(trainer::cuda::matmul_residual_forward(gemm, dyr.p, dres.p, dx16.p, dw16.p, dbias.p, M, K, N,
                                                              nullptr),
                       "cuBLASLt runs the residual GEMM");
                expect_close(yr, dyr.host(), "matmul_residual_forward matches the CPU", 1e-5, 1e-4);
                expect(trainer::cuda::matmul_residual_forward(gemm, dres2.p, dres2.p, dx16.p, dw16.p, dbias.p, M, K, N,
                                                              nullptr),
                       "cuBLASLt runs the residual GEMM in place");
                expect_close(yr, dres2.host(), "matmul_residual_forward in place matches the CPU", 1e-5, 1e-4);
                // With a bias, rounded to bf16 and added by the epilogue: the CPU with the rounded bias.
                const auto [b16, br] = bf16_rounded(b);
                std::vector<float> yb(y.size());
                trainer::cpu::matmul_forward(yb.data(), xr.data(), wr.data(), br.data(), M, K, N);
                Dev<uint16_t> db16(b16), dyb16(y.size());
                expect(trainer::cuda::matmul_forward(gemm, dyb16.p, dx16.p, dw16.p, db16.p, M, K, N, nullptr),
                       "cuBLASLt runs the bf16-output GEMM with its bias epilogue");
                expect_close_bf16(yb, dyb16, "bf16-output matmul_forward with a bias matches the CPU rounded to bf16");
                // The products use the rounded copies (the bias gradient is test_bias_gradient's).
                trainer::cpu::matmul_backward(dx.data(), dw.data(), static_cast<float*>(nullptr), gr.data(), xr.data(),
                                              wr.data(), M, K, N, false);
                expect(trainer::cuda::matmul_backward(gemm, ddx.p, nullptr, ddw.p, dg16.p, dx16.p, dw16.p, M, K, N,
                                                      false, nullptr),
                       "the fp32-dinp backward runs");
                expect_close(dx, ddx.host(), "bf16 matmul_backward dinp matches the CPU", 1e-5, 1e-4);
                expect_close(dw, ddw.host(), "bf16 matmul_backward dweight matches the CPU", 1e-5, 1e-4);
                // A bf16 dinp (amp_bf16's inner gradients): the CPU's product rounded once, dweight accumulates as
                // before.
                std::vector<float> dw2(w.size());
                for (size_t i = 0; i < dw.size(); ++i) dw2[i] = 2.0f * dw[i];
                Dev<uint16_t> ddx16(x.size());
                expect(trainer::cuda::matmul_backward(gemm, nullptr, ddx16.p, ddw.p, dg16.p, dx16.p, dw16.p, M, K, N,
                                                      false, nullptr),
                       "cuBLASLt runs the bf16-output backward GEMM");
                expect_close_bf16(dx, ddx16, "bf16 matmul_backward bf16 dinp matches the CPU rounded to bf16");
                expect_close(dw2, ddw.host(), "bf16 matmul_backward dweight accumulates", 1e-5, 1e-4);
                expect(!trainer::cuda::matmul_backward(gemm, nullptr, ddx16.p, ddw.p, dg16.p, dx16.p, dw16.p, M, K, N,
                                                       true, nullptr),
                       "a bf16 dinp refuses to accumulate");
            }
        }
    }
}

// amp_fp8's three GEMMs of a Linear on cuBLASLt's FP8 kernels, from codes cast on the GPU, against the CPU's emulation
// (kernels/cpu/fp8_linear.cpp: the same codes, dequantized, in an fp32 GEMM): the forward from e4m3 codes of x and w,
// the input gradient from e5m2 dy and w transposed, the weight gradient from dy and x transposed, accumulated. The
// codes are the same bits (test_fp8_cast); the products differ by the order of the sums and by the descale's
// multiplication (the CPU divides by the scale). Compute capability 8.9 and newer; elsewhere run_fp8 must refuse.
void test_matmul_fp8() {
    using trainer::Fp8Format;
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    const bool has_fp8 = major * 10 + minor >= 89;
    trainer::cuda::Gemm gemm;
    Dev<float> partials(trainer::cuda::kNormBlocks);
    // M (the tokens) need not be a multiple of 16: the weight gradient sums over it, padded with zero codes.
    for (const auto& [M, K, N] :
         {std::tuple{16, 32, 48}, std::tuple{130, 128, 96}, std::tuple{256, 64, 512}, std::tuple{7, 16, 16}}) {
        const Where at("M={} K={} N={}", M, K, N);
        const int Mp = (M + 15) / 16 * 16;
        const size_t mk = size_t(M) * K, nk = size_t(N) * K, mn = size_t(M) * N;
        const auto x = wave(mk, 1.0f, 0.1f), w = wave(nk, 0.05f, 0.6f), g = wave(mn, 1e-3f, 2.1f);
        Dev<float> dx(x), dw(w), dg(g), amax(3), descale(3);
        Dev<uint8_t> x8(mk), xt8(size_t(Mp) * K), w8(nk), wt8(nk), g8(mn), gt8(size_t(Mp) * N);
        const auto cast = [&](const Dev<float>& in, int rows, int cols, Fp8Format f, int slot, uint8_t* out,
                              uint8_t* out_t) {
            trainer::cuda::fp8_amax(amax.p + slot, in.p, size_t(rows) * cols, partials.p, nullptr);
            trainer::cuda::fp8_cast_transpose(out, out_t, in.p, rows, cols, amax.p + slot, f, descale.p + slot, nullptr,
                                              (rows + 15) / 16 * 16);
        };
        cast(dx, M, K, Fp8Format::kE4M3, 0, x8.p, xt8.p);
        cast(dw, N, K, Fp8Format::kE4M3, 1, w8.p, wt8.p);
        cast(dg, M, N, Fp8Format::kE5M2, 2, g8.p, gt8.p);
        using Matrix = trainer::cuda::Gemm::Fp8Matrix;
        const Matrix X{x8.p, Fp8Format::kE4M3, descale.p}, Xt{xt8.p, Fp8Format::kE4M3, descale.p},
            W{w8.p, Fp8Format::kE4M3, descale.p + 1}, Wt{wt8.p, Fp8Format::kE4M3, descale.p + 1},
            G{g8.p, Fp8Format::kE5M2, descale.p + 2}, Gt{gt8.p, Fp8Format::kE5M2, descale.p + 2};
        Dev<float> y(mn), dinp(mk), dweight(std::vector<float>(nk, 0.5f));
        const bool ran = gemm.run_fp8(M, N, K, X, W, 0.0f, y.p, false, nullptr, nullptr, nullptr);
        if (!has_fp8) {
            expect(!ran, "run_fp8 refuses below compute capability 8.9");
            continue;
        }
        expect(ran, "cuBLASLt runs the FP8 forward");
        expect(gemm.run_fp8(M, K, N, G, Wt, 0.0f, dinp.p, false, nullptr, nullptr, nullptr),
               "cuBLASLt runs the FP8 input gradient");
        expect(gemm.run_fp8(N, K, Mp, Gt, Xt, 1.0f, dweight.p, false, nullptr, nullptr, nullptr),
               "cuBLASLt runs the FP8 weight gradient");
        trainer::cpu::Fp8Scratch scratch;
        std::vector<float> ref_y(mn), ref_dinp(mk), ref_dweight(nk, 0.5f);
        trainer::cpu::fp8_linear_forward(ref_y.data(), x.data(), w.data(), nullptr, M, K, N, scratch);
        trainer::cpu::fp8_linear_backward(ref_dinp.data(), ref_dweight.data(), nullptr, g.data(), x.data(), w.data(), M,
                                          K, N, false, scratch);
        const auto scale_of = [](const std::vector<float>& v) {
            double m = 0.0;
            for (float a : v) m = std::max(m, std::fabs(static_cast<double>(a)));
            return m;
        };
        expect_close(ref_y, y.host(), "the FP8 forward matches the CPU's emulation", 1e-5 * scale_of(ref_y), 1e-4);
        expect_close(ref_dinp, dinp.host(), "the FP8 input gradient matches the CPU's emulation",
                     1e-5 * scale_of(ref_dinp), 1e-4);
        expect_close(ref_dweight, dweight.host(), "the FP8 weight gradient matches the CPU's emulation",
                     1e-5 * scale_of(ref_dweight), 1e-4);
        // The residual in the epilogue (beta 1 from c_in into another buffer), with an fp32 bias added by a pass of
        // its own: matmul_residual_forward's FP8 path.
        const auto bias = wave(N, 0.3f, 1.2f);
        const auto resid = wave(mn, 2.0f, 0.7f);
        std::vector<float> ref_yr(mn);
        trainer::cpu::fp8_linear_forward(ref_yr.data(), x.data(), w.data(), bias.data(), M, K, N, scratch);
        for (size_t i = 0; i < mn; ++i) ref_yr[i] += resid[i];
        Dev<float> dresid(resid), yr(mn), dbias(bias);
        expect(gemm.run_fp8(M, N, K, X, W, 1.0f, yr.p, false, dbias.p, dresid.p, nullptr),
               "cuBLASLt runs the FP8 forward with the residual in its epilogue");
        expect_close(ref_yr, yr.host(), "the FP8 forward + residual + fp32 bias matches the CPU's emulation",
                     1e-5 * scale_of(ref_yr), 1e-4);
        // A bf16 output with a bf16 bias from the epilogue; sizes not multiples of 16 are refused.
        const auto [b16, br] = bf16_rounded(bias);
        std::vector<float> ref_yb(mn);
        trainer::cpu::fp8_linear_forward(ref_yb.data(), x.data(), w.data(), br.data(), M, K, N, scratch);
        Dev<uint16_t> db16(b16), y16(mn);
        expect(gemm.run_fp8(M, N, K, X, W, 0.0f, y16.p, true, db16.p, nullptr, nullptr),
               "cuBLASLt runs the FP8 forward into bf16 with its bias");
        expect_close_bf16(ref_yb, y16, "the bf16 FP8 forward with a bias matches the CPU's rounded",
                          1e-3 * scale_of(ref_yb));
        if (K > 16) {
            expect(!gemm.run_fp8(M, N, K - 8, X, W, 0.0f, y.p, false, nullptr, nullptr, nullptr),
                   "run_fp8 refuses a K that is not a multiple of 16");
        }
    }
}

// The backward of a Linear after the tanh GELU in bf16 (GPT-2's ff_out): dpre = (dout @ weight) * gelu'(pre) in one
// GEMM with cuBLASLt's DGELU epilogue where K (the GELU's width) is a multiple of 8, else false and nothing written;
// dweight accumulates dout^T act. Against the CPU's GEMM and GELU backward on the bf16-rounded operands.
void test_matmul_gelu_backward() {
    trainer::cuda::Gemm gemm;
    for (int M : {7, 130}) {
        for (int K : {24, 20}) {
            for (int N : {16, 33}) {
                const Where at("M={} K={} N={}", M, K, N);
                const size_t mk = static_cast<size_t>(M) * K, nk = static_cast<size_t>(N) * K;
                const auto [dout16, doutr] = bf16_rounded(wave(static_cast<size_t>(M) * N, 1.0f, 0.3f));
                const auto [w16, wr] = bf16_rounded(wave(nk, 0.5f, 0.6f));
                const auto [pre16, prer] = bf16_rounded(wave(mk, 2.0f, 0.9f));
                std::vector<float> act(mk);
                trainer::cpu::gelu_forward(act.data(), prer.data(), mk, true);
                const auto [act16, actr] = bf16_rounded(act);
                std::vector<float> dact(mk), dpre(mk), dw(nk, 0.25f);
                trainer::cpu::matmul_backward(dact.data(), dw.data(), static_cast<float*>(nullptr), doutr.data(),
                                              actr.data(), wr.data(), M, K, N, false);
                trainer::cpu::gelu_backward(dpre.data(), prer.data(), dact.data(), mk, true);
                Dev<uint16_t> ddout(dout16), dw16(w16), dpre16(pre16), dact16(act16), got(mk);
                Dev<float> ddw(std::vector<float>(nk, 0.25f));
                const bool fused = trainer::cuda::matmul_backward_dgelu(gemm, got.p, ddw.p, ddout.p, dact16.p, dw16.p,
                                                                        dpre16.p, M, K, N, nullptr);
                if (K % 8 != 0) {
                    expect(!fused, "the DGELU epilogue refuses a GELU width not a multiple of 8");
                    expect_close(std::vector<float>(nk, 0.25f), ddw.host(), "a refused DGELU GEMM writes nothing", 0,
                                 0);
                    continue;
                }
                if (!fused) continue;  // no such cuBLASLt kernel: training runs the two ops (their checks above)
                // the starting bf16 tolerance (docs/gpus.md), as the forward's epilogue needs (cuBLASLt may
                // round the product before it applies the slope).
                expect_close_bf16(dpre, got, "bf16 matmul_backward_dgelu dpre matches the CPU rounded to bf16", 1e-2,
                                  1.6e-2);
                expect_close(dw, ddw.host(), "bf16 matmul_backward_dgelu dweight matches the CPU", 1e-5, 1e-4);
            }
        }
    }
}

#endif  // !TRAINER_SIMT_EMULATION || TRAINER_SIMT_DEVICE

std::vector<std::string> run(void (*family)()) {
    g_failures.clear();
    g_where.clear();
    family();
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess)
        g_failures.push_back(fmt::format("CUDA error after the checks: {}", cudaGetErrorString(err)));
    return std::move(g_failures);
}

}  // namespace gpu_kernel_tests

#ifndef TRAINER_SIMT_EMULATION
// gpu_tests' case of each family, so a failure names the op; each failed check is reported with its shape and
// first mismatching element.
#include <catch2/catch.hpp>

namespace {

void check(void (*family)()) {
    if (family == gpu_kernel_tests::test_wgmma_tiles && !trainer::cuda::flash_attention_sm90_available()) {
        WARN("skipped: wgmma is sm_90a code, and this device is not compute capability 9.0");
        return;
    }
    const std::vector<std::string> failures = gpu_kernel_tests::run(family);
    constexpr size_t kShown = 20;  // a kernel broken on every shape would otherwise flood the report
    for (size_t i = 0; i < failures.size() && i < kShown; ++i) FAIL_CHECK(failures[i]);
    if (failures.size() > kShown) FAIL_CHECK((failures.size() - kShown) << " more failed checks");
    CHECK(failures.empty());
}

}  // namespace

#define TRAINER_GPU_KERNEL_CASE(function, what, tags) \
    TEST_CASE("gpu kernel: " what) { check(gpu_kernel_tests::function); }
TRAINER_OWN_KERNEL_FAMILIES(TRAINER_GPU_KERNEL_CASE)
TRAINER_LIBRARY_KERNEL_FAMILIES(TRAINER_GPU_KERNEL_CASE)
TRAINER_GPU_ONLY_KERNEL_FAMILIES(TRAINER_GPU_KERNEL_CASE)
#endif  // TRAINER_SIMT_EMULATION
