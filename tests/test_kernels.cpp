// Tests of the CPU kernels (kernels/cpu/ops.h), the reference every CUDA kernel is later held to.
// Every backward is checked against central finite differences of L = sum(out * R) in double, on
// small odd shapes so that no loop bound happens to be a multiple of a block or vector width; every
// forward against a naive reference; float against double where the kernel reduces (attention,
// classifier); and bitwise determinism where threads share a reduction.
// Tolerances for finite differences are 1e-6 + 1e-5 |ref|: in double the truncation error (h^2) and
// the rounding error (eps |L| / h) of a central difference with h = 1e-6 are both below 1e-8.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/element.h"

namespace cpu = trainer::cpu;

namespace {

using Vec = std::vector<double>;
using VecF = std::vector<float>;

constexpr double kFdStep = 1e-6;
constexpr double kFdAtol = 1e-6;
constexpr double kFdRtol = 1e-5;

Vec random_vec(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> dist(lo, hi);
    Vec v(n);
    for (double& x : v) x = dist(rng);
    return v;
}

// Doubles that are exactly representable in float, so float and double kernels see the same input.
Vec random_float_exact(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
    Vec v = random_vec(rng, n, lo, hi);
    for (double& x : v) x = static_cast<double>(static_cast<float>(x));
    return v;
}

VecF to_float(const Vec& v) { return VecF(v.begin(), v.end()); }

double dot(const Vec& a, const Vec& b) {
    double s = 0.0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

Vec minus(const Vec& a, const Vec& b) {
    Vec d(a.size());
    for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
    return d;
}

// Checks |got - ref| <= atol + rtol |ref| element by element; on failure reports how many elements
// are off and the first one as (index, ref, got).
template <typename A, typename B>
void check_close(const std::string& what, const A& ref, const B& got, double atol, double rtol) {
    REQUIRE(ref.size() == got.size());
    size_t bad = 0;
    size_t first = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double r = static_cast<double>(ref[i]);
        const double g = static_cast<double>(got[i]);
        if (!(std::fabs(g - r) <= atol + rtol * std::fabs(r))) {
            if (bad == 0) first = i;
            ++bad;
        }
    }
    if (bad != 0) {
        FAIL_CHECK(fmt::format("{}: {} of {} elements off; first at index {}: ref {:.17g} got {:.17g}", what, bad,
                               ref.size(), first, static_cast<double>(ref[first]), static_cast<double>(got[first])));
    } else {
        SUCCEED(what);
    }
}

// Bitwise equality, reporting the first differing element.
template <typename A>
void check_bitwise(const std::string& what, const A& a, const A& b) {
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], sizeof(a[i])) != 0) {
            FAIL_CHECK(fmt::format("{}: first difference at index {}: {:.9g} vs {:.9g}", what, i,
                                   static_cast<double>(a[i]), static_cast<double>(b[i])));
            return;
        }
    }
    SUCCEED(what);
}

// d loss / d x[i] for every i by central differences; x is perturbed in place and restored.
// The thousands of tiny forward calls run on one thread: on a shared CI machine each OpenMP wake-up
// can wait for a time slice, which made these loops take seconds. The analytic gradients they are
// compared with still run on every thread.
Vec numeric_grad(Vec& x, const std::function<double()>& loss) {
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    Vec g(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        const double saved = x[i];
        x[i] = saved + kFdStep;
        const double up = loss();
        x[i] = saved - kFdStep;
        const double down = loss();
        x[i] = saved;
        g[i] = (up - down) / (2.0 * kFdStep);
    }
    omp_set_num_threads(threads);
    return g;
}

void check_fd(const std::string& what, const Vec& fd, const Vec& analytic) {
    check_close(what, fd, analytic, kFdAtol, kFdRtol);
}

// ---- naive references ----

// Causal attention with the full T x T softmax, straight from the definition.
void naive_attention(Vec& out, Vec& lse, const Vec& qkv, int B, int T, int NH, int HS) {
    const int C = NH * HS;
    out.assign(static_cast<size_t>(B) * T * C, 0.0);
    lse.assign(static_cast<size_t>(B) * NH * T, 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
    for (int b = 0; b < B; ++b) {
        for (int h = 0; h < NH; ++h) {
            for (int i = 0; i < T; ++i) {
                const double* q = &qkv[(static_cast<size_t>(b) * T + i) * 3 * C + h * HS];
                Vec s(T, -std::numeric_limits<double>::infinity());
                double m = -std::numeric_limits<double>::infinity();
                for (int j = 0; j <= i; ++j) {
                    const double* k = &qkv[(static_cast<size_t>(b) * T + j) * 3 * C + C + h * HS];
                    double acc = 0.0;
                    for (int d = 0; d < HS; ++d) acc += q[d] * k[d];
                    s[j] = acc * scale;
                    m = std::max(m, s[j]);
                }
                double sum = 0.0;
                for (int j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
                lse[(static_cast<size_t>(b) * NH + h) * T + i] = m + std::log(sum);
                for (int j = 0; j <= i; ++j) {
                    const double p = std::exp(s[j] - m) / sum;
                    const double* v = &qkv[(static_cast<size_t>(b) * T + j) * 3 * C + 2 * C + h * HS];
                    for (int d = 0; d < HS; ++d) out[(static_cast<size_t>(b) * T + i) * C + h * HS + d] += p * v[d];
                }
            }
        }
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
TEST_CASE("kernels: gemm matches a naive product for every transpose and partition") {
    std::mt19937_64 rng(1);
    const int saved = cpu::gemm_partition();
    // A product too small to cut, then one cut into tiles with short last ones (67 = 4 x 16 + 3 rows).
    struct Case {
        int M, N, K, partition;
    };
    for (const Case c :
         {Case{7, 9, 13, 1}, Case{67, 83, 61, 1}, Case{67, 83, 61, 2}, Case{67, 83, 61, 5}, Case{67, 83, 61, 16}}) {
        const int M = c.M, N = c.N, K = c.K;
        cpu::set_gemm_partition(c.partition);
        const int pad = 3;  // leading dimensions larger than the logical width
        for (int ta = 0; ta < 2; ++ta) {
            for (int tb = 0; tb < 2; ++tb) {
                const int a_rows = ta ? K : M, a_cols = ta ? M : K;
                const int b_rows = tb ? N : K, b_cols = tb ? K : N;
                const int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
                const Vec A = random_vec(rng, static_cast<size_t>(a_rows) * lda);
                const Vec Bm = random_vec(rng, static_cast<size_t>(b_rows) * ldb);
                Vec Cm = random_vec(rng, static_cast<size_t>(M) * ldc);
                Vec ref = Cm;
                const double alpha = 0.7, beta = 0.3;
                for (int i = 0; i < M; ++i) {
                    for (int j = 0; j < N; ++j) {
                        double acc = 0.0;
                        for (int k = 0; k < K; ++k) {
                            const double a =
                                ta ? A[static_cast<size_t>(k) * lda + i] : A[static_cast<size_t>(i) * lda + k];
                            const double b =
                                tb ? Bm[static_cast<size_t>(j) * ldb + k] : Bm[static_cast<size_t>(k) * ldb + j];
                            acc += a * b;
                        }
                        ref[static_cast<size_t>(i) * ldc + j] =
                            alpha * acc + beta * Cm[static_cast<size_t>(i) * ldc + j];
                    }
                }
                cpu::gemm<double>(ta, tb, M, N, K, alpha, A.data(), lda, Bm.data(), ldb, beta, Cm.data(), ldc);
                check_close(
                    fmt::format("gemm {}x{}x{} partition {} trans_a={} trans_b={}", M, N, K, c.partition, ta, tb), ref,
                    Cm, 1e-12, 1e-13);
            }
        }
    }
    cpu::set_gemm_partition(saved);
}

TEST_CASE("kernels: a gemm gives the same bits on any thread count for its partition") {
    // OpenBLAS's own threading sums differently per thread count on most of its x86 kernel sets (Haswell's and
    // Zen's among them); the tiles keep the bits whatever runs them. This process has the kernels OpenBLAS picked
    // (SkylakeX's sum alike anyway); the shared node test runs the trainer on Haswell's.
    std::mt19937_64 rng(2);
    const int saved_partition = cpu::gemm_partition(), saved_threads = omp_get_max_threads();
    const int M = 200, N = 190, K = 150;
    for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
            const VecF A = to_float(random_vec(rng, static_cast<size_t>(M) * K));
            const VecF Bm = to_float(random_vec(rng, static_cast<size_t>(K) * N));
            const VecF C0 = to_float(random_vec(rng, static_cast<size_t>(M) * N));
            for (int partition : {2, 4}) {
                cpu::set_gemm_partition(partition);
                VecF first;
                for (int threads = 1; threads <= partition; ++threads) {
                    omp_set_num_threads(threads);
                    VecF Cm = C0;
                    cpu::gemm<float>(ta, tb, M, N, K, 1.0f, A.data(), ta ? M : K, Bm.data(), tb ? K : N, 1.0f,
                                     Cm.data(), N);
                    if (threads == 1)
                        first = Cm;
                    else
                        check_bitwise(
                            fmt::format("trans_a={} trans_b={} partition {} on {} threads", ta, tb, partition, threads),
                            first, Cm);
                }
            }
        }
    }
    omp_set_num_threads(saved_threads);
    cpu::set_gemm_partition(saved_partition);
}

TEST_CASE("kernels: matmul backward matches finite differences") {
    struct Case {
        int M, K, N, with_bias, accumulate;
    };
    // N = 70 spans two of the 64-column blocks of the dbias column sums.
    for (const Case cs : {Case{7, 13, 9, 0, 0}, Case{7, 13, 9, 0, 1}, Case{7, 13, 9, 1, 0}, Case{7, 13, 9, 1, 1},
                          Case{5, 3, 70, 1, 1}}) {
        const int M = cs.M, K = cs.K, N = cs.N, with_bias = cs.with_bias, accumulate = cs.accumulate;
        CAPTURE(M, K, N, with_bias, accumulate);
        std::mt19937_64 rng(2 + 2 * with_bias + accumulate + N);
        Vec inp = random_vec(rng, static_cast<size_t>(M) * K);
        Vec weight = random_vec(rng, static_cast<size_t>(N) * K);
        Vec bias = random_vec(rng, N);
        const Vec R = random_vec(rng, static_cast<size_t>(M) * N);
        const double* bias_ptr = with_bias ? bias.data() : nullptr;
        Vec out(static_cast<size_t>(M) * N);
        auto loss = [&]() {
            cpu::matmul_forward<double>(out.data(), inp.data(), weight.data(), bias_ptr, M, K, N);
            return dot(out, R);
        };
        // Start every gradient from random values: parameter gradients accumulate, and dinp does
        // when asked to.
        const Vec dinp0 = random_vec(rng, inp.size());
        const Vec dweight0 = random_vec(rng, weight.size());
        const Vec dbias0 = random_vec(rng, bias.size());
        Vec dinp = dinp0, dweight = dweight0, dbias = dbias0;
        cpu::matmul_backward<double>(dinp.data(), dweight.data(), with_bias ? dbias.data() : nullptr, R.data(),
                                     inp.data(), weight.data(), M, K, N, accumulate != 0);
        check_fd("dinp", numeric_grad(inp, loss), accumulate ? minus(dinp, dinp0) : dinp);
        check_fd("dweight", numeric_grad(weight, loss), minus(dweight, dweight0));
        if (with_bias) {
            check_fd("dbias", numeric_grad(bias, loss), minus(dbias, dbias0));
        } else {
            check_bitwise("dbias untouched", dbias, dbias0);
        }
        // A null dinp skips the input gradient and leaves the parameter gradients unchanged.
        Vec dweight_only = dweight0;
        cpu::matmul_backward<double>(nullptr, dweight_only.data(), nullptr, R.data(), inp.data(), weight.data(), M, K,
                                     N, false);
        check_close("dweight without dinp", dweight, dweight_only, 0.0, 0.0);
    }
}

TEST_CASE("kernels: embedding forward and backward match finite differences") {
    const int T = 5, N = 15, C = 13, V = 23;
    const std::vector<int32_t> tokens = {3, 7, 3, 22, 0, 7, 7, 3, 1, 5, 22, 9, 3, 0, 11};  // repeats on purpose
    for (int with_wpe = 0; with_wpe < 2; ++with_wpe) {
        CAPTURE(with_wpe);
        std::mt19937_64 rng(10 + with_wpe);
        Vec wte = random_vec(rng, static_cast<size_t>(V) * C);
        Vec wpe = random_vec(rng, static_cast<size_t>(T) * C);
        const Vec R = random_vec(rng, static_cast<size_t>(N) * C);
        const double* wpe_ptr = with_wpe ? wpe.data() : nullptr;
        Vec out(static_cast<size_t>(N) * C);
        cpu::embedding_forward<double>(out.data(), tokens.data(), wte.data(), wpe_ptr, N, T, C);
        Vec ref(out.size());
        for (int n = 0; n < N; ++n) {
            for (int c = 0; c < C; ++c) {
                ref[static_cast<size_t>(n) * C + c] = wte[static_cast<size_t>(tokens[n]) * C + c] +
                                                      (with_wpe ? wpe[static_cast<size_t>(n % T) * C + c] : 0.0);
            }
        }
        check_close("embedding forward", ref, out, 0.0, 0.0);
        auto loss = [&]() {
            cpu::embedding_forward<double>(out.data(), tokens.data(), wte.data(), wpe_ptr, N, T, C);
            return dot(out, R);
        };
        const Vec dwte0 = random_vec(rng, wte.size());
        const Vec dwpe0 = random_vec(rng, wpe.size());
        Vec dwte = dwte0, dwpe = dwpe0;
        cpu::embedding_backward<double>(dwte.data(), with_wpe ? dwpe.data() : nullptr, R.data(), tokens.data(), N, T,
                                        C);
        check_fd("dwte", numeric_grad(wte, loss), minus(dwte, dwte0));
        if (with_wpe) {
            check_fd("dwpe", numeric_grad(wpe, loss), minus(dwpe, dwpe0));
        } else {
            check_bitwise("dwpe untouched", dwpe, dwpe0);
        }
    }
}

// The norm of one row as the definition says (LayerNorm, or RMSNorm without the mean), in double.
void naive_norm_row(const double* x, double* y, double* mean, double* rstd, const double* w, const double* b, int C,
                    double eps, bool rms) {
    double m = 0.0, var = 0.0;
    if (!rms) {
        for (int c = 0; c < C; ++c) m += x[c];
        m /= C;
    }
    for (int c = 0; c < C; ++c) var += std::pow(x[c] - m, 2);
    var /= C;
    *mean = m;
    *rstd = 1.0 / std::sqrt(var + eps);
    for (int c = 0; c < C; ++c) {
        y[c] = (x[c] - m) * *rstd;
        if (w) y[c] *= w[c];
        if (b) y[c] += b[c];
    }
}

TEST_CASE("kernels: layernorm and rmsnorm backward (from the input and from the output) match finite differences") {
    const int C = 13;
    const float eps = 1e-5f;
    // variant 0: weight and bias (GPT-2), 1: weight only (OLMo-2's RMSNorm), 2: non-parametric (OLMo). N = 75
    // rows span three of the fixed row chunks whose partial dweight/dbias sums are reduced at the end.
    struct Case {
        int variant, N;
    };
    for (const bool rms : {false, true}) {
        for (const Case cs : {Case{0, 7}, Case{1, 7}, Case{2, 7}, Case{0, 75}}) {
            const int variant = cs.variant, N = cs.N;
            CAPTURE(rms, variant, N);
            std::mt19937_64 rng(20 + variant + N + (rms ? 100 : 0));
            Vec inp = random_vec(rng, static_cast<size_t>(N) * C, -2.0, 3.0);
            Vec weight = random_vec(rng, C, 0.5, 1.5);
            Vec bias = random_vec(rng, C);
            const Vec R = random_vec(rng, static_cast<size_t>(N) * C);
            const double* w = variant <= 1 ? weight.data() : nullptr;
            const double* bptr = variant == 0 ? bias.data() : nullptr;
            Vec out(inp.size()), mean(N), rstd(N);
            double* mean_p = rms ? nullptr : mean.data();  // RMSNorm has no mean to save
            cpu::layernorm_forward<double>(out.data(), mean_p, rstd.data(), inp.data(), w, bptr, N, C, eps, rms);
            Vec ref_out(out.size()), ref_mean(N), ref_rstd(N);
            for (int n = 0; n < N; ++n) {
                naive_norm_row(&inp[static_cast<size_t>(n) * C], &ref_out[static_cast<size_t>(n) * C], &ref_mean[n],
                               &ref_rstd[n], w, bptr, C, eps, rms);
            }
            check_close("norm out", ref_out, out, 1e-13, 1e-12);
            if (!rms) check_close("layernorm mean", ref_mean, mean, 1e-13, 1e-12);
            check_close("norm rstd", ref_rstd, rstd, 1e-13, 1e-12);

            auto loss = [&]() {
                cpu::layernorm_forward<double>(out.data(), mean_p, rstd.data(), inp.data(), w, bptr, N, C, eps, rms);
                return dot(out, R);
            };
            loss();
            // All three gradients accumulate into what is already there.
            const Vec dinp0 = random_vec(rng, inp.size());
            const Vec dweight0 = random_vec(rng, C);
            const Vec dbias0 = random_vec(rng, C);
            Vec dinp = dinp0, dweight = dweight0, dbias = dbias0;
            cpu::layernorm_backward<double>(dinp.data(), w ? dweight.data() : nullptr, bptr ? dbias.data() : nullptr,
                                            R.data(), inp.data(), w, mean_p, rstd.data(), N, C, rms);
            check_fd("dinp", numeric_grad(inp, loss), minus(dinp, dinp0));
            if (w) check_fd("dweight", numeric_grad(weight, loss), minus(dweight, dweight0));
            if (bptr) check_fd("dbias", numeric_grad(bias, loss), minus(dbias, dbias0));
            if (variant == 2) {
                // Without weight or bias the output is the normalised input: the backward from it (what the model
                // runs for OLMo's norms) adds the same gradient, without the input or the mean.
                loss();
                Vec from_out = dinp0;
                cpu::norm_backward_from_output<double>(from_out.data(), R.data(), out.data(), rstd.data(), N, C, rms);
                check_close("dinp from the output", dinp, from_out, 1e-13, 1e-12);
                check_fd("dinp from the output", numeric_grad(inp, loss), minus(from_out, dinp0));
            }
        }
    }
}

TEST_CASE("kernels: the norm after a sublayer adds to the residual and its backward overwrites dinp") {
    const int N = 37, C = 11;  // N spans two row chunks
    const float eps = 1e-6f;
    for (const bool rms : {false, true}) {
        for (const bool affine : {false, true}) {
            CAPTURE(rms, affine);
            std::mt19937_64 rng(40 + (rms ? 1 : 0) + (affine ? 2 : 0));
            Vec inp = random_vec(rng, static_cast<size_t>(N) * C, -2.0, 3.0);
            const Vec resid = random_vec(rng, inp.size());
            Vec weight = random_vec(rng, C, 0.5, 1.5), bias = random_vec(rng, C);
            const double* w = affine ? weight.data() : nullptr;
            const double* b = affine ? bias.data() : nullptr;
            const Vec R = random_vec(rng, inp.size());
            Vec out(inp.size()), mean(N), rstd(N);
            double* mean_p = rms ? nullptr : mean.data();
            cpu::norm_residual_forward<double>(out.data(), resid.data(), mean_p, rstd.data(), inp.data(), w, b, N, C,
                                               eps, rms);
            Vec ref(inp.size());
            for (int n = 0; n < N; ++n) {
                double m, rs;
                naive_norm_row(&inp[static_cast<size_t>(n) * C], &ref[static_cast<size_t>(n) * C], &m, &rs, w, b, C,
                               eps, rms);
            }
            for (size_t i = 0; i < ref.size(); ++i) ref[i] += resid[i];
            check_close("resid + norm(inp)", ref, out, 1e-13, 1e-12);
            // In place on the residual (out == resid), the same values.
            Vec inplace = resid;
            cpu::norm_residual_forward<double>(inplace.data(), inplace.data(), mean_p, rstd.data(), inp.data(), w, b, N,
                                               C, eps, rms);
            check_close("in place", out, inplace, 0.0, 0.0);

            auto loss = [&]() {
                cpu::norm_residual_forward<double>(out.data(), resid.data(), mean_p, rstd.data(), inp.data(), w, b, N,
                                                   C, eps, rms);
                return dot(out, R);
            };
            loss();
            Vec dinp = random_vec(rng, inp.size());  // overwritten: what was there must not matter
            const Vec dweight0 = random_vec(rng, C), dbias0 = random_vec(rng, C);
            Vec dweight = dweight0, dbias = dbias0;
            cpu::norm_residual_backward<double>(dinp.data(), affine ? dweight.data() : nullptr,
                                                affine ? dbias.data() : nullptr, R.data(), inp.data(), w, mean_p,
                                                rstd.data(), N, C, rms);
            check_fd("dinp", numeric_grad(inp, loss), dinp);
            if (affine) {
                check_fd("dweight", numeric_grad(weight, loss), minus(dweight, dweight0));
                check_fd("dbias", numeric_grad(bias, loss), minus(dbias, dbias0));
            }
        }
    }
}

TEST_CASE("kernels: QK-norm on q and k in place and its in-place backward match finite differences") {
    const int N = 35, C = 9;
    const float eps = 1e-6f;
    for (const int KV : {C, 3}) {  // k as wide as q, and narrower (grouped-query attention)
        for (const bool rms : {false, true}) {
            for (const int affine : {0, 1, 2}) {  // none, weight, weight + bias
                CAPTURE(KV, rms, affine);
                const int W = C + 2 * KV, Wqk = C + KV;
                std::mt19937_64 rng(50 + (rms ? 10 : 0) + affine + KV);
                Vec qkv = random_vec(rng, static_cast<size_t>(N) * W, -2.0, 2.0);
                Vec qw = random_vec(rng, C, 0.5, 1.5), qb = random_vec(rng, C), kw = random_vec(rng, KV, 0.5, 1.5),
                    kb = random_vec(rng, KV);
                const double* qwp = affine >= 1 ? qw.data() : nullptr;
                const double* qbp = affine == 2 ? qb.data() : nullptr;
                const double* kwp = affine >= 1 ? kw.data() : nullptr;
                const double* kbp = affine == 2 ? kb.data() : nullptr;
                const Vec R = random_vec(rng, qkv.size());
                Vec out(qkv.size()), qk(static_cast<size_t>(N) * Wqk), mean(2 * N), rstd(2 * N);
                double* mean_p = rms ? nullptr : mean.data();
                out = qkv;
                cpu::qk_norm_forward<double>(out.data(), qk.data(), mean_p, rstd.data(), qwp, qbp, kwp, kbp, N, C, KV,
                                             eps, rms);
                Vec ref = qkv;
                for (int n = 0; n < N; ++n) {
                    double m, rs;
                    const size_t row = static_cast<size_t>(n) * W;
                    naive_norm_row(&qkv[row], &ref[row], &m, &rs, qwp, qbp, C, eps, rms);
                    naive_norm_row(&qkv[row + C], &ref[row + C], &m, &rs, kwp, kbp, KV, eps, rms);
                    for (int c = 0; c < Wqk; ++c) REQUIRE(qk[static_cast<size_t>(n) * Wqk + c] == qkv[row + c]);
                }
                check_close("normed q, k and untouched v", ref, out, 1e-13, 1e-12);

                auto loss = [&]() {
                    out = qkv;
                    cpu::qk_norm_forward<double>(out.data(), qk.data(), mean_p, rstd.data(), qwp, qbp, kwp, kbp, N, C,
                                                 KV, eps, rms);
                    return dot(out, R);
                };
                loss();
                Vec dqkv = R;  // in place: d(out) becomes d(qkv)
                const Vec gq0 = random_vec(rng, C), gk0 = random_vec(rng, KV);
                Vec dqw = gq0, dqb = gq0, dkw = gk0, dkb = gk0;
                cpu::qk_norm_backward<double>(dqkv.data(), qwp ? dqw.data() : nullptr, qbp ? dqb.data() : nullptr,
                                              kwp ? dkw.data() : nullptr, kbp ? dkb.data() : nullptr, qk.data(), qwp,
                                              kwp, mean_p, rstd.data(), N, C, KV, rms);
                check_fd("dqkv", numeric_grad(qkv, loss), dqkv);
                if (qwp) {
                    check_fd("dq_weight", numeric_grad(qw, loss), minus(dqw, gq0));
                    check_fd("dk_weight", numeric_grad(kw, loss), minus(dkw, gk0));
                }
                if (qbp) {
                    check_fd("dq_bias", numeric_grad(qb, loss), minus(dqb, gq0));
                    check_fd("dk_bias", numeric_grad(kb, loss), minus(dkb, gk0));
                }
            }
        }
    }
}

TEST_CASE("kernels: shared key/value heads expand to every query head and their gradients sum back") {
    const int N = 7, NH = 6, KVH = 2, HS = 4, C = NH * HS, KV = KVH * HS, W = C + 2 * KV;
    std::mt19937_64 rng(77);
    Vec inp = random_vec(rng, static_cast<size_t>(N) * W);
    Vec out(static_cast<size_t>(N) * 3 * C);
    cpu::kv_heads_expand<double>(out.data(), inp.data(), N, NH, KVH, HS);
    for (int n = 0; n < N; ++n) {
        for (int h = 0; h < NH; ++h) {
            for (int d = 0; d < HS; ++d) {
                const size_t o = static_cast<size_t>(n) * 3 * C + h * HS + d, i = static_cast<size_t>(n) * W;
                // HF's repeat_kv order: query heads 0, 1, 2 share key/value head 0; 3, 4, 5 head 1.
                REQUIRE(out[o] == inp[i + h * HS + d]);
                REQUIRE(out[o + C] == inp[i + C + (h / 3) * HS + d]);
                REQUIRE(out[o + 2 * C] == inp[i + C + KV + (h / 3) * HS + d]);
            }
        }
    }
    // The reduce is the expand's transpose: <expand(x), y> = <x, reduce(y)> for every x and y.
    const Vec y = random_vec(rng, out.size());
    Vec dinp(inp.size());
    cpu::kv_heads_reduce<double>(dinp.data(), y.data(), N, NH, KVH, HS);
    CHECK(std::abs(dot(out, y) - dot(inp, dinp)) < 1e-12 * std::abs(dot(out, y)) + 1e-12);
    check_fd("kv_heads_reduce",
             numeric_grad(inp,
                          [&] {
                              cpu::kv_heads_expand<double>(out.data(), inp.data(), N, NH, KVH, HS);
                              return dot(out, y);
                          }),
             dinp);
    // With one key/value head per query head both are copies.
    Vec same(static_cast<size_t>(N) * 3 * C);
    cpu::kv_heads_expand<double>(same.data(), out.data(), N, NH, NH, HS);
    CHECK(same == out);
}

TEST_CASE("kernels: rope forward matches the rotate half formula") {
    const int B = 2, T = 11, NH = 3, HS = 6, C = NH * HS;
    const float theta = 10000.0f;
    std::mt19937_64 rng(30);
    const Vec qkv = random_float_exact(rng, static_cast<size_t>(B) * T * 3 * C);
    Vec ref = qkv;
    for (int b = 0; b < B; ++b) {
        for (int t = 0; t < T; ++t) {
            for (int head = 0; head < 2 * NH; ++head) {  // q heads then k heads
                double* x = &ref[(static_cast<size_t>(b) * T + t) * 3 * C + head * HS];
                const double* x0 = &qkv[(static_cast<size_t>(b) * T + t) * 3 * C + head * HS];
                for (int i = 0; i < HS / 2; ++i) {
                    const double angle = t / std::pow(static_cast<double>(theta), 2.0 * i / HS);
                    x[i] = x0[i] * std::cos(angle) - x0[i + HS / 2] * std::sin(angle);
                    x[i + HS / 2] = x0[i + HS / 2] * std::cos(angle) + x0[i] * std::sin(angle);
                }
            }
        }
    }
    Vec got = qkv;
    cpu::rope_forward<double>(got.data(), B, T, NH, HS, theta);
    check_close("rope double", ref, got, 1e-14, 1e-13);
    // fp32 angles (as OLMo computes them) differ from double ones by about t ulp(inv_freq).
    VecF got_f = to_float(qkv);
    cpu::rope_forward<float>(got_f.data(), B, T, NH, HS, theta);
    check_close("rope float", ref, got_f, 1e-6, 1e-5);
}

TEST_CASE("kernels: rope backward matches finite differences") {
    const int B = 2, T = 11, NH = 3, HS = 6;
    for (const float theta : {10000.0f, 7.0f}) {  // a small theta makes every pair rotate far
        CAPTURE(theta);
        std::mt19937_64 rng(31);
        Vec qkv = random_vec(rng, static_cast<size_t>(B) * T * 3 * NH * HS);
        const Vec R = random_vec(rng, qkv.size());
        Vec work(qkv.size());
        auto loss = [&]() {
            work = qkv;
            cpu::rope_forward<double>(work.data(), B, T, NH, HS, theta);
            return dot(work, R);
        };
        Vec dqkv = R;
        cpu::rope_backward<double>(dqkv.data(), B, T, NH, HS, theta);
        check_fd("dqkv", numeric_grad(qkv, loss), dqkv);
    }
}

TEST_CASE("kernels: attention forward matches a naive full softmax") {
    struct Shape {
        int B, T, NH, HS;
    };
    // T = 1, T inside one block, T spanning blocks with a ragged tail; generic and specialised HS.
    for (const Shape s : {Shape{1, 1, 2, 6}, Shape{2, 11, 3, 6}, Shape{2, 37, 3, 6}, Shape{1, 37, 2, 64},
                          Shape{1, 19, 1, 32}, Shape{1, 17, 1, 128}}) {
        CAPTURE(s.B, s.T, s.NH, s.HS);
        std::mt19937_64 rng(40 + s.T + s.HS);
        const Vec qkv = random_vec(rng, static_cast<size_t>(s.B) * s.T * 3 * s.NH * s.HS, -2.0, 2.0);
        Vec ref_out, ref_lse;
        naive_attention(ref_out, ref_lse, qkv, s.B, s.T, s.NH, s.HS);
        Vec out(ref_out.size()), lse(ref_lse.size());
        cpu::attention_forward<double>(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.HS);
        check_close("attention out", ref_out, out, 1e-13, 1e-12);
        check_close("attention lse", ref_lse, lse, 1e-13, 1e-12);
    }
}

TEST_CASE("kernels: attention backward matches finite differences") {
    struct Shape {
        int B, T, NH, HS;
    };
    // T = 35 and 37 span two 32-query blocks (dK and dV gather across blocks); HS = 32 takes the
    // compile-time head size path, HS = 6 the run-time one.
    for (const Shape s : {Shape{2, 19, 3, 6}, Shape{1, 37, 2, 6}, Shape{1, 35, 1, 32}}) {
        CAPTURE(s.B, s.T, s.NH, s.HS);
        std::mt19937_64 rng(50 + s.HS);
        const size_t C = static_cast<size_t>(s.NH) * s.HS;
        Vec qkv = random_vec(rng, static_cast<size_t>(s.B) * s.T * 3 * C, -1.5, 1.5);
        const Vec R = random_vec(rng, static_cast<size_t>(s.B) * s.T * C);
        Vec out(R.size()), lse(static_cast<size_t>(s.B) * s.NH * s.T);
        auto loss = [&]() {
            cpu::attention_forward<double>(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.HS);
            return dot(out, R);
        };
        loss();
        Vec dqkv(qkv.size(), std::numeric_limits<double>::quiet_NaN());  // must be fully overwritten
        cpu::attention_backward<double>(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH,
                                        s.HS);
        check_fd("dqkv", numeric_grad(qkv, loss), dqkv);
    }
}

TEST_CASE("kernels: attention float matches double") {
    const int B = 2, T = 67, NH = 2, HS = 64;
    const size_t C = static_cast<size_t>(NH) * HS;
    std::mt19937_64 rng(60);
    const Vec qkv = random_float_exact(rng, static_cast<size_t>(B) * T * 3 * C, -2.0, 2.0);
    const Vec R = random_float_exact(rng, static_cast<size_t>(B) * T * C);
    Vec out(R.size()), lse(static_cast<size_t>(B) * NH * T), dqkv(qkv.size());
    cpu::attention_forward<double>(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
    cpu::attention_backward<double>(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), B, T, NH, HS);
    const VecF qkv_f = to_float(qkv), R_f = to_float(R);
    VecF out_f(out.size()), lse_f(lse.size()), dqkv_f(dqkv.size());
    cpu::attention_forward<float>(out_f.data(), lse_f.data(), qkv_f.data(), B, T, NH, HS);
    cpu::attention_backward<float>(dqkv_f.data(), R_f.data(), qkv_f.data(), out_f.data(), lse_f.data(), B, T, NH, HS);
    check_close("out", out, out_f, 1e-6, 1e-5);
    check_close("lse", lse, lse_f, 1e-6, 1e-5);
    check_close("dqkv", dqkv, dqkv_f, 1e-6, 1e-5);
}

TEST_CASE("kernels: gelu backward matches finite differences") {
    const size_t n = 37;
    for (int tanh_approx = 0; tanh_approx < 2; ++tanh_approx) {
        CAPTURE(tanh_approx);
        std::mt19937_64 rng(70 + tanh_approx);
        Vec inp = random_vec(rng, n, -4.0, 4.0);
        const Vec R = random_vec(rng, n);
        Vec out(n);
        cpu::gelu_forward<double>(out.data(), inp.data(), n, tanh_approx != 0);
        Vec ref(n);
        for (size_t i = 0; i < n; ++i) {
            const double x = inp[i];
            ref[i] =
                tanh_approx
                    ? 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)))
                    : 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
        }
        check_close("gelu forward", ref, out, 1e-15, 1e-14);
        const Vec out_of_place = out;
        auto loss = [&]() {
            cpu::gelu_forward<double>(out.data(), inp.data(), n, tanh_approx != 0);
            return dot(out, R);
        };
        Vec dinp(n);
        cpu::gelu_backward<double>(dinp.data(), inp.data(), R.data(), n, tanh_approx != 0);
        check_fd("dinp", numeric_grad(inp, loss), dinp);
        // In place: out == inp forward, dinp == dout backward.
        Vec inplace = inp;
        cpu::gelu_forward<double>(inplace.data(), inplace.data(), n, tanh_approx != 0);
        check_close("gelu forward in place", out_of_place, inplace, 0.0, 0.0);
        Vec dinplace = R;
        cpu::gelu_backward<double>(dinplace.data(), inp.data(), dinplace.data(), n, tanh_approx != 0);
        check_close("gelu backward in place", dinp, dinplace, 0.0, 0.0);
    }
}

TEST_CASE("kernels: float activations match double") {
    // The float paths use element.h's vectorisable exp/erfc approximations, the double paths libm.
    const int N = 37, H = 61;
    const size_t n = static_cast<size_t>(N) * H;
    std::mt19937_64 rng(75);
    const Vec x = random_float_exact(rng, 2 * n, -6.0, 6.0);
    const Vec g = random_float_exact(rng, 2 * n);
    const VecF xf = to_float(x), gf = to_float(g);
    for (int tanh_approx = 0; tanh_approx < 2; ++tanh_approx) {
        CAPTURE(tanh_approx);
        Vec out(n), dinp(n);
        VecF out_f(n), dinp_f(n);
        cpu::gelu_forward<double>(out.data(), x.data(), n, tanh_approx != 0);
        cpu::gelu_forward<float>(out_f.data(), xf.data(), n, tanh_approx != 0);
        cpu::gelu_backward<double>(dinp.data(), x.data(), g.data(), n, tanh_approx != 0);
        cpu::gelu_backward<float>(dinp_f.data(), xf.data(), gf.data(), n, tanh_approx != 0);
        check_close("gelu forward", out, out_f, 1e-6, 1e-5);
        check_close("gelu backward", dinp, dinp_f, 1e-6, 1e-5);
    }
    Vec out(n), dinp(2 * n);
    VecF out_f(n), dinp_f(2 * n);
    cpu::swiglu_forward<double>(out.data(), x.data(), N, H);
    cpu::swiglu_forward<float>(out_f.data(), xf.data(), N, H);
    cpu::swiglu_backward<double>(dinp.data(), x.data(), g.data(), N, H);
    cpu::swiglu_backward<float>(dinp_f.data(), xf.data(), gf.data(), N, H);
    check_close("swiglu forward", out, out_f, 1e-6, 1e-5);
    check_close("swiglu backward", dinp, dinp_f, 1e-6, 1e-5);
}

TEST_CASE("kernels: swiglu backward matches finite differences") {
    const int N = 7, H = 9;
    std::mt19937_64 rng(80);
    Vec inp = random_vec(rng, static_cast<size_t>(N) * 2 * H, -4.0, 4.0);
    const Vec R = random_vec(rng, static_cast<size_t>(N) * H);
    Vec out(R.size());
    cpu::swiglu_forward<double>(out.data(), inp.data(), N, H);
    Vec ref(out.size());
    for (int n = 0; n < N; ++n) {
        for (int j = 0; j < H; ++j) {
            const double x = inp[static_cast<size_t>(n) * 2 * H + j];
            const double g = inp[static_cast<size_t>(n) * 2 * H + H + j];
            ref[static_cast<size_t>(n) * H + j] = x * g / (1.0 + std::exp(-g));
        }
    }
    check_close("swiglu forward", ref, out, 1e-15, 1e-14);
    auto loss = [&]() {
        cpu::swiglu_forward<double>(out.data(), inp.data(), N, H);
        return dot(out, R);
    };
    Vec dinp(inp.size(), std::numeric_limits<double>::quiet_NaN());  // must be fully overwritten
    cpu::swiglu_backward<double>(dinp.data(), inp.data(), R.data(), N, H);
    check_fd("dinp", numeric_grad(inp, loss), dinp);
}

TEST_CASE("kernels: residual add and scale") {
    const size_t n = 1001;
    std::mt19937_64 rng(90);
    Vec a = random_vec(rng, n), b = random_vec(rng, n);
    Vec ref(n);
    for (size_t i = 0; i < n; ++i) ref[i] = a[i] + b[i];
    Vec out(n);
    cpu::residual_forward<double>(out.data(), a.data(), b.data(), n);
    check_close("residual", ref, out, 0.0, 0.0);
    // out may alias either input (the residual stream is updated in place).
    Vec a2 = a;
    cpu::residual_forward<double>(a2.data(), a2.data(), b.data(), n);
    check_close("residual aliasing a", ref, a2, 0.0, 0.0);
    Vec b2 = b;
    cpu::residual_forward<double>(b2.data(), a.data(), b2.data(), n);
    check_close("residual aliasing b", ref, b2, 0.0, 0.0);
    VecF x = to_float(a);
    cpu::scale_inplace<float>(x.data(), n, 0.25f);
    for (size_t i = 0; i < n; ++i) ref[i] = static_cast<double>(static_cast<float>(a[i]) * 0.25f);
    check_close("scale", ref, x, 0.0, 0.0);
}

TEST_CASE("kernels: classifier matches finite differences") {
    const int N = 7, V = 23;
    const std::vector<int32_t> targets = {3, 0, 22, -1, 7, 7, 15};  // row 3 is ignored
    const double scale = 1.0 / 6.0;                                 // 1 / (counted targets)
    std::mt19937_64 rng(100);
    Vec logits = random_vec(rng, static_cast<size_t>(N) * V, -3.0, 3.0);
    // Forward only: losses against logsumexp - logit, and the logits left exactly as they were.
    Vec losses(N, std::numeric_limits<double>::quiet_NaN());
    Vec untouched = logits;
    cpu::classifier_forward_backward<double>(untouched.data(), losses.data(), targets.data(), N, V, scale, false, 0.0,
                                             nullptr);
    check_close("logits unchanged without grad", logits, untouched, 0.0, 0.0);
    Vec ref_losses(N, 0.0);
    for (int n = 0; n < N; ++n) {
        if (targets[n] < 0) continue;
        double sum = 0.0;
        for (int j = 0; j < V; ++j) sum += std::exp(logits[static_cast<size_t>(n) * V + j]);
        ref_losses[n] = std::log(sum) - logits[static_cast<size_t>(n) * V + targets[n]];
    }
    check_close("losses", ref_losses, losses, 1e-14, 1e-13);

    Vec work(logits.size());
    auto loss = [&]() {
        work = logits;
        cpu::classifier_forward_backward<double>(work.data(), losses.data(), targets.data(), N, V, scale, false, 0.0,
                                                 nullptr);
        double total = 0.0;
        for (int n = 0; n < N; ++n) total += losses[n] * scale;
        return total;
    };
    Vec dlogits = logits;
    Vec losses_g(N);
    cpu::classifier_forward_backward<double>(dlogits.data(), losses_g.data(), targets.data(), N, V, scale, true, 0.0,
                                             nullptr);
    check_close("losses with grad", ref_losses, losses_g, 1e-14, 1e-13);
    check_fd("dlogits", numeric_grad(logits, loss), dlogits);
    for (int j = 0; j < V; ++j) REQUIRE(dlogits[3 * static_cast<size_t>(V) + j] == 0.0);
}

TEST_CASE("kernels: classifier with the z-loss matches finite differences of CE + z logsumexp^2") {
    const int N = 6, V = 19;
    const std::vector<int32_t> targets = {3, -1, 18, 0, 7, 7};  // row 1 is ignored
    const double scale = 1.0 / 5.0, z = 0.05;                   // a large z, so its gradient is far above the FD error
    std::mt19937_64 rng(105);
    Vec logits = random_vec(rng, static_cast<size_t>(N) * V, -3.0, 4.0);
    Vec work(logits.size()), losses(N), zl(N);
    Vec ref_z(N, 0.0);
    for (int n = 0; n < N; ++n) {
        if (targets[n] < 0) continue;
        double sum = 0.0;
        for (int j = 0; j < V; ++j) sum += std::exp(logits[static_cast<size_t>(n) * V + j]);
        ref_z[n] = z * std::log(sum) * std::log(sum);
    }
    work = logits;
    cpu::classifier_forward_backward<double>(work.data(), losses.data(), targets.data(), N, V, scale, false, z,
                                             zl.data());
    check_close("z-losses", ref_z, zl, 1e-14, 1e-13);
    auto loss = [&]() {
        work = logits;
        cpu::classifier_forward_backward<double>(work.data(), losses.data(), targets.data(), N, V, scale, false, z,
                                                 zl.data());
        double total = 0.0;
        for (int n = 0; n < N; ++n) total += (losses[n] + zl[n]) * scale;
        return total;
    };
    Vec dlogits = logits;
    cpu::classifier_forward_backward<double>(dlogits.data(), losses.data(), targets.data(), N, V, scale, true, z,
                                             zl.data());
    check_fd("dlogits with the z-loss", numeric_grad(logits, loss), dlogits);
    for (int j = 0; j < V; ++j) REQUIRE(dlogits[static_cast<size_t>(V) + j] == 0.0);
    // Without a z-loss the gradient is bitwise the plain classifier's.
    Vec plain = logits, zero = logits;
    cpu::classifier_forward_backward<double>(plain.data(), losses.data(), targets.data(), N, V, scale, true, 0.0,
                                             nullptr);
    cpu::classifier_forward_backward<double>(zero.data(), losses.data(), targets.data(), N, V, scale, true, 0.0,
                                             zl.data());
    check_bitwise("z = 0 changes nothing", plain, zero);
}

TEST_CASE("kernels: classifier float matches double") {
    const int N = 5, V = 5003;  // V spans several online-softmax chunks with a ragged tail
    const std::vector<int32_t> targets = {17, 5002, 0, -1, 2500};
    std::mt19937_64 rng(110);
    const Vec logits = random_float_exact(rng, static_cast<size_t>(N) * V, -8.0, 8.0);
    Vec d = logits, losses(N);
    cpu::classifier_forward_backward<double>(d.data(), losses.data(), targets.data(), N, V, 0.25, true, 0.0, nullptr);
    VecF f = to_float(logits), losses_f(N);
    cpu::classifier_forward_backward<float>(f.data(), losses_f.data(), targets.data(), N, V, 0.25f, true, 0.0f,
                                            nullptr);
    check_close("losses", losses, losses_f, 1e-6, 1e-5);
    // dlogits are ~1e-4 each: an absolute floor would hide relative errors, so use (almost) none.
    check_close("dlogits", d, f, 1e-12, 1e-5);
}

TEST_CASE("kernels: adamw matches a double reimplementation of torch AdamW") {
    const size_t n = 1003;
    const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.7f;
    std::mt19937_64 rng(120);
    const Vec p0 = random_float_exact(rng, n);
    VecF p = to_float(p0), m(n, 0.0f), v(n, 0.0f);
    Vec rp = p0, rm(n, 0.0), rv(n, 0.0);
    for (long step = 1; step <= 3; ++step) {
        Vec grad = random_float_exact(rng, n, -2.0, 2.0);
        grad[0] = 0.0;  // a parameter with no gradient yet still decays
        const VecF grad_f = to_float(grad);
        cpu::adamw_update(p.data(), grad_f.data(), m.data(), v.data(), n, lr, beta1, beta2, eps, wd, step, grad_scale);
        const double b1 = beta1, b2 = beta2;
        const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
        for (size_t i = 0; i < n; ++i) {
            const double g = grad[i] * static_cast<double>(grad_scale);
            rp[i] *= 1.0 - static_cast<double>(lr) * wd;
            rm[i] = b1 * rm[i] + (1.0 - b1) * g;
            rv[i] = b2 * rv[i] + (1.0 - b2) * g * g;
            rp[i] -= (static_cast<double>(lr) / bc1) * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + eps);
        }
        CAPTURE(step);
        check_close("param", rp, p, 1e-6, 1e-5);
        check_close("exp_avg", rm, m, 1e-7, 1e-5);
        check_close("exp_avg_sq", rv, v, 1e-8, 1e-5);
    }
}

TEST_CASE("kernels: adamw bf16 copy-out is the updated parameters rounded and leaves the update unchanged") {
    const size_t n = 517;
    std::mt19937_64 rng(121);
    const VecF p0 = to_float(random_float_exact(rng, n)), grad = to_float(random_float_exact(rng, n, -2.0, 2.0));
    VecF p = p0, m(n, 0.0f), v(n, 0.0f), q = p0, qm(n, 0.0f), qv(n, 0.0f);
    std::vector<uint16_t> copy(n, 0xffff), want(n);
    cpu::adamw_update(p.data(), grad.data(), m.data(), v.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 0.7f);
    cpu::adamw_update(q.data(), grad.data(), qm.data(), qv.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 0.7f,
                      copy.data());
    CHECK(p == q);  // the copy-out pass updates exactly as the plain one
    CHECK(m == qm);
    CHECK(v == qv);
    cpu::cast_float_to_bf16(want.data(), q.data(), n);
    CHECK(copy == want);
}

TEST_CASE("kernels: squared norm matches a naive sum") {
    std::mt19937_64 rng(130);
    for (const size_t n : {size_t(0), size_t(5), size_t(3 * 65536 + 12345)}) {
        CAPTURE(n);
        const Vec x = random_float_exact(rng, n, -3.0, 3.0);
        double ref = 0.0;
        for (const double xi : x) ref += xi * xi;
        const VecF xf = to_float(x);
        check_close("double", Vec{ref}, Vec{cpu::squared_norm<double>(x.data(), n)}, 1e-300, 1e-12);
        check_close("float", Vec{ref}, Vec{cpu::squared_norm<float>(xf.data(), n)}, 1e-300, 1e-12);
    }
}

TEST_CASE("kernels: the CPU backend computes on fp32 activations and refuses bf16 GEMM operands") {
    // The reference stores every activation in fp32 (the model asks the backend, backend.h's GemmOperand).
    auto backend = trainer::make_cpu_backend();
    CHECK_FALSE(backend->gemm_operands_bf16());
    std::vector<float> out(4), w(4, 1.0f), x(4, 2.0f);
    std::vector<uint16_t> x16(4, 0x4000);  // 2.0 in bf16
    backend->matmul_forward(out.data(), x.data(), w.data(), nullptr, 2, 2, 2);
    CHECK(out[0] == 4.0f);
    CHECK_THROWS(
        backend->matmul_forward(out.data(), trainer::GemmOperand::in_bf16(x16.data()), w.data(), nullptr, 2, 2, 2));
}

TEST_CASE("kernels: the CPU backend's activity window counts its ops' time on its own thread and not the host's gaps") {
    auto backend = trainer::make_cpu_backend();
    const int n = 256;
    std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), w(a.size(), 0.25f), out(a.size());
    const auto t0 = std::chrono::steady_clock::now();
    backend->begin_activity();
    backend->matmul_forward(out.data(), a.data(), w.data(), nullptr, n, n, n);
    std::this_thread::sleep_for(std::chrono::milliseconds(60));  // the host busy elsewhere: no op runs
    // Ops on another thread (a communicator's worker) are not this window's.
    std::vector<float> out2(out.size());
    const auto o0 = std::chrono::steady_clock::now();
    std::thread other([&] {
        for (int i = 0; i < 20; ++i) backend->matmul_forward(out2.data(), a.data(), w.data(), nullptr, n, n, n);
    });
    other.join();
    const double other_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - o0).count();
    backend->scale_inplace(out.data(), out.size(), 0.5f);
    const trainer::Backend::Activity act = backend->end_activity();
    const double window = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(act.measured);
    CHECK(act.wait_s < 0.0);  // the host's waits are the strategy's to time
    CHECK(act.busy_s > 0.0);
    CHECK(act.busy_s < window - 0.06 - 0.9 * other_s);
    // Outside a window nothing is counted, and a second window starts from zero.
    backend->matmul_forward(out.data(), a.data(), w.data(), nullptr, n, n, n);
    backend->begin_activity();
    const double empty = backend->end_activity().busy_s;
    CHECK(empty == 0.0);
    CHECK_THROWS(backend->end_activity());
}

TEST_CASE("kernels: cast rounds to nearest even and keeps specials") {
    struct Case {
        uint32_t in;
        uint16_t out;
    };
    const std::vector<Case> cases = {
        {0x3F800000u, 0x3F80u},  // 1.0
        {0x3F808000u, 0x3F80u},  // halfway, even below: down
        {0x3F818000u, 0x3F82u},  // halfway, odd below: up
        {0x3F808001u, 0x3F81u},  // just above halfway: up
        {0x3F807FFFu, 0x3F80u},  // just below halfway: down
        {0xBF818000u, 0xBF82u},  // negative halfway, odd: away from zero
        {0x7F800000u, 0x7F80u},  // +inf
        {0xFF800000u, 0xFF80u},  // -inf
        {0x7F7FFFFFu, 0x7F80u},  // FLT_MAX rounds up to inf
        {0x00000001u, 0x0000u},  // smallest subnormal rounds to zero
        {0x80000000u, 0x8000u},  // -0
        {0x7FC00000u, 0x7FC0u},  // quiet NaN
    };
    std::vector<float> in(cases.size());
    for (size_t i = 0; i < cases.size(); ++i) std::memcpy(&in[i], &cases[i].in, sizeof(float));
    std::vector<uint16_t> out(cases.size());
    cpu::cast_float_to_bf16(out.data(), in.data(), in.size());
    for (size_t i = 0; i < cases.size(); ++i) {
        INFO(fmt::format("input 0x{:08X}: expected 0x{:04X}, got 0x{:04X}", cases[i].in, cases[i].out, out[i]));
        CHECK(out[i] == cases[i].out);
    }
    // Signalling NaNs, whose payload would truncate to an infinity, come out as quiet NaNs.
    for (const uint32_t bits : {0x7F800001u, 0xFF800001u, 0x7FBFFFFFu}) {
        float f;
        std::memcpy(&f, &bits, sizeof f);
        uint16_t h = 0;
        cpu::cast_float_to_bf16(&h, &f, 1);
        INFO(fmt::format("input 0x{:08X} gave 0x{:04X}", bits, h));
        CHECK((h & 0x7F80u) == 0x7F80u);
        CHECK((h & 0x0040u) != 0u);
    }
    // Every bf16 value survives bf16 -> float -> bf16; NaNs stay NaN.
    std::vector<uint16_t> all(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    std::vector<float> wide(all.size());
    cpu::cast_bf16_to_float(wide.data(), all.data(), all.size());
    std::vector<uint16_t> back(all.size());
    cpu::cast_float_to_bf16(back.data(), wide.data(), wide.size());
    size_t bad = 0;
    for (size_t i = 0; i < all.size(); ++i) {
        const bool is_nan = (all[i] & 0x7F80u) == 0x7F80u && (all[i] & 0x007Fu) != 0u;
        const bool ok = is_nan ? std::isnan(wide[i]) && std::isnan(trainer::bf16_to_float(back[i])) : back[i] == all[i];
        if (!ok && bad++ == 0) FAIL_CHECK(fmt::format("round trip of 0x{:04X} gave 0x{:04X}", all[i], back[i]));
    }
    CHECK(bad == 0);
    // round_to_bf16 is the cast there and back, in one pass, and in place too.
    std::vector<uint16_t> half(in.size());
    cpu::cast_float_to_bf16(half.data(), in.data(), in.size());
    std::vector<float> want(in.size()), rounded(in.size());
    cpu::cast_bf16_to_float(want.data(), half.data(), half.size());
    cpu::round_to_bf16(rounded.data(), in.data(), in.size());
    CHECK(std::memcmp(want.data(), rounded.data(), want.size() * sizeof(float)) == 0);
    cpu::round_to_bf16(in.data(), in.data(), in.size());
    CHECK(std::memcmp(want.data(), in.data(), want.size() * sizeof(float)) == 0);
}

TEST_CASE("kernels: backward kernels are bitwise deterministic") {
    std::mt19937_64 rng(140);
    SECTION("attention backward") {
        const int B = 2, T = 67, NH = 4, HS = 64;
        const size_t C = static_cast<size_t>(NH) * HS;
        const VecF qkv = to_float(random_vec(rng, static_cast<size_t>(B) * T * 3 * C, -2.0, 2.0));
        const VecF dout = to_float(random_vec(rng, static_cast<size_t>(B) * T * C));
        VecF out(dout.size()), lse(static_cast<size_t>(B) * NH * T);
        cpu::attention_forward<float>(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
        VecF d1(qkv.size()), d2(qkv.size());
        cpu::attention_backward<float>(d1.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, HS);
        cpu::attention_backward<float>(d2.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, HS);
        check_bitwise("dqkv", d1, d2);
    }
    SECTION("embedding backward") {
        const int T = 31, N = 4 * 31, C = 200, V = 17;  // few tokens: many rows hit the same dwte row
        std::vector<int32_t> tokens(N);
        for (int n = 0; n < N; ++n) tokens[n] = static_cast<int32_t>((n * 7 + n / 5) % V);
        const VecF dout = to_float(random_vec(rng, static_cast<size_t>(N) * C));
        VecF dwte1(static_cast<size_t>(V) * C, 0.0f), dwpe1(static_cast<size_t>(T) * C, 0.0f);
        VecF dwte2 = dwte1, dwpe2 = dwpe1;
        cpu::embedding_backward<float>(dwte1.data(), dwpe1.data(), dout.data(), tokens.data(), N, T, C);
        cpu::embedding_backward<float>(dwte2.data(), dwpe2.data(), dout.data(), tokens.data(), N, T, C);
        check_bitwise("dwte", dwte1, dwte2);
        check_bitwise("dwpe", dwpe1, dwpe2);
        // Channel ownership makes the result independent of the thread count as well.
        const int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        VecF dwte3(dwte1.size(), 0.0f), dwpe3(dwpe1.size(), 0.0f);
        cpu::embedding_backward<float>(dwte3.data(), dwpe3.data(), dout.data(), tokens.data(), N, T, C);
        omp_set_num_threads(threads);
        check_bitwise("dwte one thread", dwte1, dwte3);
        check_bitwise("dwpe one thread", dwpe1, dwpe3);
    }
    SECTION("classifier") {
        const int N = 9, V = 3001;
        std::vector<int32_t> targets(N);
        for (int n = 0; n < N; ++n) targets[n] = (n * 331) % V;
        const VecF logits = to_float(random_vec(rng, static_cast<size_t>(N) * V, -6.0, 6.0));
        VecF a = logits, b = logits, la(N), lb(N), za(N), zb(N);
        cpu::classifier_forward_backward<float>(a.data(), la.data(), targets.data(), N, V, 1.0f / N, true, 1e-4f,
                                                za.data());
        cpu::classifier_forward_backward<float>(b.data(), lb.data(), targets.data(), N, V, 1.0f / N, true, 1e-4f,
                                                zb.data());
        check_bitwise("losses", la, lb);
        check_bitwise("z-losses", za, zb);
        check_bitwise("dlogits", a, b);
    }
}
