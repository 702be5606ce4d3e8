// `trainer bench-kernels`: every Backend op of one training step at a config's shapes, timed on the
// configured device and set against the roofline of that device (see bench_kernels.h).
#include "core/plan/bench_kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/layout.h"
#include "core/metrics.h"
#include "core/model.h"
#include "core/optimizer.h"
#include "core/plan/dry_run.h"
#include "core/plan/step_time.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/rank_env.h"
#include "parallel/setup.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

struct Op {
    std::string name;
    std::function<void(Backend&)> run;  // one call of the op on the buffers, through the given backend
    bool calibrates = true;             // an op training runs (not a ceiling): an entry of --calibration-out
};

// Mean seconds per call of `f` over `reps` calls after two warm-up calls, the device drained around them.
double time_op(Backend& backend, const std::function<void()>& f, int reps) {
    f();
    f();
    backend.synchronize();
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) f();
    backend.synchronize();
    return seconds_since(t0) / reps;
}

// The buffers and the ops of one training step at a config's shapes on a backend, each op a call through a
// given backend on those buffers (the ops hold the object: it outlives them).
class StepOps {
   public:
    StepOps(const TrainConfig& config, Backend& be) : config(config), be(be), m(config.model), layout(config) {
        shapes();
        buffers();
        add_gemms();
        add_norms();
        add_rest();
    }
    StepOps(const StepOps&) = delete;
    StepOps& operator=(const StepOps&) = delete;

    std::vector<Op> ops;
    int B = 0, T = 0, C = 0, NH = 0, HS = 0, P = 0, H = 0, V = 0, N = 0, R = 0;
    bool op16 = false;  // GemmOperands in bf16, as training keeps them on this backend

   private:
    void shapes() {
        B = static_cast<int>(config.device_train_microbatch_size), T = static_cast<int>(m.max_sequence_length - 1);
        C = m.d_model, NH = m.n_heads, HS = m.head_size(), P = m.ff_proj_size(), H = m.ff_hidden_size();
        V = m.embedding_size, N = B * T;
        // The head's chunk of rows, as the model sizes it.
        R = Model::head_chunk_rows(m, B, be.gemm_operands_bf16());
        NC = static_cast<size_t>(N) * C;
        NHh = static_cast<size_t>(N) * H;
        block_numel = layout.units()[layout.block_unit(0)].numel;
        op16 = be.gemm_operands_bf16();
        swiglu = m.activation_type == ActivationType::kSwiglu;
    }

    // Uniform in [0, 1).
    double next_unit() {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        return static_cast<double>(lcg >> 11) * 0x1.0p-53;
    }

    DeviceBuffer buf(size_t floats) {
        DeviceBuffer b(&be, std::max<size_t>(floats, 1) * sizeof(float), MemCategory::kOther);
        for (size_t at = 0; at < b.bytes(); at += pattern_dev.bytes()) {
            be.copy_device_to_device(static_cast<char*>(b.data()) + at, pattern_dev.data(),
                                     std::min(pattern_dev.bytes(), b.bytes() - at));
        }
        return b;
    }

    // A GemmOperand activation as training stores it on this backend: the fp32 buffer, or a bf16 copy in `half`.
    GemmOperand operand(DeviceBuffer& f, size_t n, DeviceBuffer& half) {
        if (!op16) return f.f32();
        half = DeviceBuffer(&be, n * sizeof(uint16_t), MemCategory::kOther);
        be.cast_float_to_bf16(half.bf16(), f.f32(), n);
        return GemmOperand::in_bf16(half.bf16());
    }

    void buffers() {
        // Contents: pseudo-random values in [0.001, 0.1), not zeros (zeros hide nothing here but can run faster
        // than real data: a bf16 GEMM was seen 13% faster on zeros on an H200), positive so that the variances,
        // lse values and moments the ops read are valid. One pattern uploaded, then tiled.
        std::vector<float> pattern(size_t{1} << 16);
        for (float& v : pattern) v = static_cast<float>(0.001 + 0.099 * next_unit());
        pattern_dev = DeviceBuffer(&be, pattern.size() * sizeof(float), MemCategory::kOther);
        be.copy_host_to_device(pattern_dev.data(), pattern.data(), pattern_dev.bytes());
        const size_t c = C, p = P, h = H, v = V, n = N;
        x = buf(NC), y = buf(NC), dx = buf(NC), mean = buf(n), rstd = buf(n), lnw = buf(c), lnb = buf(c);
        dlnw = buf(c), dlnb = buf(c);
        qkv = buf(3 * NC), dqkv = buf(3 * NC), att = buf(NC), lse = buf(static_cast<size_t>(B) * NH * T);
        w_qkv = buf(3 * c * c), dw_qkv = buf(3 * c * c), w_fc = buf(p * c), dw_fc = buf(p * c);
        w_out = buf(c * h), dw_out = buf(c * h), fch = buf(n * p), dfch = buf(n * p), fact = buf(n * h);
        dfact = buf(n * h), wte = buf(v * c), dwte = buf(v * c), logits = buf(static_cast<size_t>(R) * v);
        losses = buf(n);
        // Tokens and targets drawn log-uniformly over the vocabulary (P(k) ~ 1/(k+1), Zipf's law of text: the
        // most frequent id takes ln 2 / ln V of the positions, 6% at V = 50304), so the embedding backward's
        // groups of equal tokens are as long as in training rather than one group of every row.
        std::vector<int32_t> token_ids(2 * n);
        for (int32_t& id : token_ids) {
            const double r = std::exp(next_unit() * std::log(static_cast<double>(V) + 1.0)) - 1.0;
            id = static_cast<int32_t>(std::min<double>(r, V - 1));
        }
        tokens = DeviceBuffer(&be, token_ids.size() * sizeof(int32_t), MemCategory::kOther);
        be.copy_host_to_device(tokens.data(), token_ids.data(), tokens.bytes());
        param = buf(block_numel), grad = buf(block_numel), m1 = buf(block_numel), m2 = buf(block_numel);
        // The GemmOperand activations (the norms' and attention's outputs, the MLP activation) as training
        // stores them on this backend: bf16 copies where it keeps them so (amp_bf16 on CUDA).
        xo = operand(x, NC, x16), yo = operand(y, NC, y16), atto = operand(att, NC, att16);
        facto = operand(fact, NHh, fact16), qkvo = operand(qkv, 3 * NC, qkv16);
        // The gradients training keeps in the same storage: those only a GEMM or a bf16 kernel reads next (the
        // attention's and the MLP's), and the head's logits chunk.
        datt = buf(NC);
        dqkvo = operand(dqkv, 3 * NC, dqkv16), datto = operand(datt, NC, datt16);
        dfcho = operand(dfch, n * p, dfch16), dfacto = operand(dfact, NHh, dfact16);
        logitso = operand(logits, static_cast<size_t>(R) * v, logits16);
        // The ff_proj output (SwiGLU's input, GELU's pre-activation), stored like the other operands.
        fcho = operand(fch, n * p, fch16);
    }

    // Each GEMM's ceiling where the backend has one for its shape (CUDA): the peers' bf16 Linear at the same
    // shape, bf16 in and out with no epilogue (Backend::linear_bf16_reference_*).
    bool ceiling_forward(Backend& be_, int M, int K, int Nn) {
        return be_.linear_bf16_reference_forward(ref_out.bf16(), ref_in.bf16(), ref_w.bf16(), M, K, Nn);
    }
    bool ceiling_backward(Backend& be_, int M, int K, int Nn) {
        return be_.linear_bf16_reference_backward(ref_din.bf16(), ref_dw.bf16(), ref_dout.bf16(), ref_in.bf16(),
                                                  ref_w.bf16(), M, K, Nn);
    }

    void add_gemms() {
        // The blocks' Linear layers carry a bias where the model has them (GPT-2), as training runs them: its
        // gradient is a column sum of every GEMM's output gradient.
        const size_t widest = std::max<size_t>(3 * static_cast<size_t>(C), P);
        gemm_bias = buf(widest), gemm_dbias = buf(widest);
        bias = m.include_bias ? gemm_bias.f32() : nullptr;
        dbias = m.include_bias ? gemm_dbias.f32() : nullptr;
        // The blocks' four GEMMs and the head's, as training runs them.
        struct GemmRows {
            std::string what;
            int M, K, N;
            GemmOperand out, in;
            float* w;
            GemmOperand dout, din;
            float *dw, *b, *db;
        };
        const std::vector<GemmRows> gemms = {
            {"att_proj GEMM", N, C, 3 * C, qkvo, xo, w_qkv.f32(), dqkvo, dx.f32(), dw_qkv.f32(), bias, dbias},
            {"attn_out GEMM", N, C, C, y.f32(), atto, w_qkv.f32(), x.f32(), datto, dw_qkv.f32(), bias, dbias},
            {"ff_proj GEMM", N, C, P, fcho, xo, w_fc.f32(), dfcho, dx.f32(), dw_fc.f32(), bias, dbias},
            {"ff_out GEMM", N, H, C, y.f32(), facto, w_out.f32(), x.f32(), dfacto, dw_out.f32(), bias, dbias},
            {"LM head GEMM (one chunk)", R, C, V, logitso, xo, wte.f32(), logitso, dx.f32(), dwte.f32(), nullptr,
             nullptr}};
        // Each GEMM's ceiling where the backend has one for its shape (CUDA): the peers' bf16 Linear at the same shape,
        // bf16 in and out with no epilogue (Backend::linear_bf16_reference_*), from bf16 buffers shared by every shape.
        size_t most_mk = 0, most_nk = 0, most_mn = 0;
        for (const GemmRows& g : gemms) {
            const size_t gm = g.M, gk = g.K, gn = g.N;
            most_mk = std::max(most_mk, gm * gk), most_nk = std::max(most_nk, gn * gk),
            most_mn = std::max(most_mn, gm * gn);
        }
        const bool ceilings = be.has_linear_bf16_reference();
        if (ceilings) {
            const DeviceBuffer wide = buf(std::max({most_mk, most_nk, most_mn}));
            auto bf16_buf = [&](size_t n) {
                DeviceBuffer half(&be, std::max<size_t>(n, 1) * sizeof(uint16_t), MemCategory::kOther);
                be.cast_float_to_bf16(half.bf16(), wide.f32(), n);
                return half;
            };
            ref_in = bf16_buf(most_mk), ref_w = bf16_buf(most_nk), ref_out = bf16_buf(most_mn);
            ref_dout = bf16_buf(most_mn), ref_din = bf16_buf(most_mk), ref_dw = bf16_buf(most_nk);
        }
        for (const GemmRows& g : gemms) {
            // The ceiling of a shape runs once here (its first warm-up): where the backend has no GEMM for it, no row.
            const bool ceiling = ceilings && ceiling_forward(be, g.M, g.K, g.N) && ceiling_backward(be, g.M, g.K, g.N);
            ops.push_back(
                {g.what + " forward", [g](Backend& be_) { be_.matmul_forward(g.out, g.in, g.w, g.b, g.M, g.K, g.N); }});
            if (ceiling) {
                ops.push_back({g.what + " forward, bf16 Linear (ceiling)",
                               [this, g](Backend& be_) { ceiling_forward(be_, g.M, g.K, g.N); }, false});
            }
            ops.push_back({g.what + " backward", [g](Backend& be_) {
                               be_.matmul_backward(g.din, g.dw, g.db, g.dout, g.in, g.w, g.M, g.K, g.N, false);
                           }});
            if (ceiling) {
                ops.push_back({g.what + " backward, bf16 Linear (ceiling)",
                               [this, g](Backend& be_) { ceiling_backward(be_, g.M, g.K, g.N); }, false});
            }
        }
    }

    void add_norms() {
        const float* w = m.layer_norm_with_affine ? lnw.f32() : nullptr;
        float* dw = m.layer_norm_with_affine ? dlnw.f32() : nullptr;
        const NormKind kind = m.rms_norm() ? NormKind::kRms : NormKind::kLayerNorm;
        const float eps = static_cast<float>(m.layer_norm_eps);
        const char* norm_name = m.rms_norm() ? "rmsnorm" : "layernorm";
        // The norms as the model runs them: before each sublayer, or after it (norm_after: the sublayer's output
        // normed and added to the residual stream), and the QK-norm on q and k. The final norm before the head is
        // a plain one in either case (with norm_after, the only plain one).
        if (m.norm_after) {
            ops.push_back({fmt::format("{} + residual forward", norm_name), [=](Backend& b) {
                               b.norm_residual_forward(y.f32(), x.f32(), mean.f32(), rstd.f32(), atto, w, nullptr, N, C,
                                                       eps, kind);
                           }});
            ops.push_back({fmt::format("{} + residual backward", norm_name), [=](Backend& b) {
                               b.norm_residual_backward(datto, dw, nullptr, x.f32(), atto, w, mean.f32(), rstd.f32(), N,
                                                        C, kind);
                           }});
        }
        const char* which = m.norm_after ? " (final norm)" : "";
        ops.push_back({fmt::format("{} forward{}", norm_name, which), [=](Backend& b) {
                           b.layernorm_forward(yo, mean.f32(), rstd.f32(), x.f32(), w, nullptr, N, C, eps, kind);
                       }});
        if (m.norm_backward_from_output()) {  // as the model runs it
            ops.push_back({fmt::format("{} backward from its output{}", norm_name, which), [=](Backend& b) {
                               b.norm_backward_from_output(dx.f32(), y.f32(), yo, rstd.f32(), N, C, kind);
                           }});
        } else {
            ops.push_back({fmt::format("{} backward{}", norm_name, which), [=](Backend& b) {
                               b.layernorm_backward(dx.f32(), dw, nullptr, y.f32(), x.f32(), w, mean.f32(), rstd.f32(),
                                                    N, C, kind);
                           }});
        }
        if (m.attention_layer_norm) {
            qk = buf(2 * NC);
            qk_stats = buf(4 * static_cast<size_t>(N));
            qko = operand(qk, 2 * NC, qk16);
            const float* qw = m.qk_norm_has_weight() ? lnw.f32() : nullptr;
            float* dqw = m.qk_norm_has_weight() ? dlnw.f32() : nullptr;
            float* dkw = m.qk_norm_has_weight() ? dlnb.f32() : nullptr;
            ops.push_back({"qk_norm forward", [=](Backend& b) {
                               float* st = qk_stats.f32();
                               b.qk_norm_forward(qkvo, qko, st, st + 2 * N, qw, nullptr, qw, nullptr, N, C, eps, kind);
                           }});
            ops.push_back({"qk_norm backward", [=](Backend& b) {
                               float* st = qk_stats.f32();
                               b.qk_norm_backward(dqkvo, dqw, nullptr, dkw, nullptr, qko, qw, qw, st, st + 2 * N, N, C,
                                                  kind);
                           }});
        }
    }

    void add_rest() {
        const float theta = static_cast<float>(m.rope_theta);
        if (m.rope) {
            ops.push_back({"rope forward", [=](Backend& b) { b.rope_forward(qkvo, B, T, NH, HS, theta); }});
            ops.push_back({"rope backward", [=](Backend& b) { b.rope_backward(dqkvo, B, T, NH, HS, theta); }});
        }
        ops.push_back(
            {"attention forward", [=](Backend& b) { b.attention_forward(atto, lse.f32(), qkvo, B, T, NH, HS); }});
        ops.push_back({"attention backward",
                       [=](Backend& b) { b.attention_backward(dqkvo, datto, qkvo, atto, lse.f32(), B, T, NH, HS); }});
        if (swiglu) {
            ops.push_back({"swiglu forward", [=](Backend& b) { b.swiglu_forward(facto, fcho, N, H); }});
            ops.push_back({"swiglu backward", [=](Backend& b) { b.swiglu_backward(dfcho, fcho, dfacto, N, H); }});
        } else {
            const bool tanh_gelu = m.activation_type == ActivationType::kGeluTanh;
            // What training runs: the ff_proj GEMM and the GELU together (one GEMM with the GELU epilogue on the
            // CUDA backend where cuBLASLt allows; the two ops elsewhere).
            ops.push_back({"ff_proj GEMM + gelu forward", [=](Backend& b) {
                               b.matmul_gelu_forward(fcho, facto, xo, w_fc.f32(), bias, N, C, P, tanh_gelu);
                           }});
            ops.push_back({"gelu forward", [=](Backend& b) { b.gelu_forward(facto, fcho, NHh, tanh_gelu); }});
            ops.push_back({"gelu backward", [=](Backend& b) { b.gelu_backward(dfcho, fcho, dfacto, NHh, tanh_gelu); }});
            // And its backward: ff_out's and the GELU's together (on CUDA one GEMM with the DGELU epilogue).
            ops.push_back({"ff_out GEMM + gelu backward", [=](Backend& b) {
                               b.matmul_gelu_backward(dfcho, dfacto, dw_out.f32(), dbias, x.f32(), facto, w_out.f32(),
                                                      fcho, N, H, C, tanh_gelu);
                           }});
        }
        ops.push_back({"residual add", [=](Backend& b) { b.residual_forward(y.f32(), x.f32(), dx.f32(), NC); }});
        const float z_loss = static_cast<float>(config.z_loss_multiplier);
        ops.push_back({"classifier (one chunk)", [=](Backend& b) {
                           b.classifier_forward_backward(logitso, losses.f32(), tokens.i32() + N, R, V, 1e-3f, true,
                                                         z_loss, z_loss > 0.0f ? dx.f32() : nullptr);
                       }});
        ops.push_back({"embedding forward",
                       [=](Backend& b) { b.embedding_forward(x.f32(), tokens.i32(), wte.f32(), nullptr, N, T, C); }});
        ops.push_back({"embedding backward",
                       [=](Backend& b) { b.embedding_backward(dwte.f32(), nullptr, x.f32(), tokens.i32(), N, T, C); }});
        ops.push_back({"adamw (one block)", [=](Backend& b) {
                           b.adamw_update(param.f32(), grad.f32(), m1.f32(), m2.f32(), block_numel, 1e-4f, 0.9f, 0.95f,
                                          1e-8f, 0.1f, 1, 1.0f);
                       }});
        // As the optimizer takes the gradient norm: one multi-range pass (the CUDA backend's vectorised kernel).
        ops.push_back({"squared norm (one block)", [=](Backend& b) {
                           (void)b.squared_norm_multi({{grad.f32(), block_numel}});
                       }});
    }

    const TrainConfig& config;
    Backend& be;
    const ModelConfig& m;
    const ParamLayout layout;
    size_t NC = 0, NHh = 0, block_numel = 0;
    bool swiglu = false;
    uint64_t lcg = 0x9E3779B97F4A7C15ull;
    DeviceBuffer pattern_dev, x, y, dx, mean, rstd, lnw, lnb, dlnw, dlnb, qkv, dqkv, att, lse, w_qkv, dw_qkv, w_fc,
        dw_fc, w_out, dw_out, fch, dfch, fact, dfact, wte, dwte, logits, losses, tokens, param, grad, m1, m2, datt;
    DeviceBuffer x16, y16, att16, fact16, fch16, qkv16, dqkv16, datt16, dfch16, dfact16, logits16;
    GemmOperand xo, yo, atto, facto, qkvo, dqkvo, datto, dfcho, dfacto, logitso, fcho;
    DeviceBuffer gemm_bias, gemm_dbias;
    float *bias = nullptr, *dbias = nullptr;
    DeviceBuffer ref_in, ref_w, ref_out, ref_dout, ref_din, ref_dw;  // the ceilings' bf16 operands
    DeviceBuffer qk, qk16, qk_stats;
    GemmOperand qko;
};

// The ops a step of `config` runs that no row of `ops` runs: every compute op a dry run of one step issues (copies,
// fills, casts, reductions to the host and waits are priced by their bytes, not by a row), less the ops the rows
// issue through the dry backend. A new op in the model then fails here, in every bench-kernels run and its test,
// instead of going unmeasured.
std::vector<std::string> ops_without_rows(const TrainConfig& config, Device device, const std::vector<Op>& ops,
                                          bool operands_bf16) {
    static const std::set<std::string> by_bytes = {
        "fill_zero",           "copy",      "copy_async",   "copy_device_to_device", "copy_device_to_host",
        "copy_host_to_device", "host_wait", "device_wait",  "cast_float_to_bf16",    "cast_bf16_to_float",
        "round_to_bf16",       "sum",       "scale_inplace"};
    std::set<std::string> rows;
    auto dry = make_dry_backend([&rows](const OpCost& c) { rows.insert(c.op); }, operands_bf16);
    for (const Op& op : ops) op.run(*dry);
    TrainConfig one = config;
    one.global_train_batch_size = config.device_train_microbatch_size;
    one.distributed_strategy = DistributedStrategy::kSingle;
    std::set<std::string> missing;
    for (const StepEvent& e : dry_run_step(one, RankEnv{}, device).events) {
        if (e.kind == StepEvent::kOp && !by_bytes.count(e.what) && !rows.count(e.what)) missing.insert(e.what);
    }
    return {missing.begin(), missing.end()};
}

}  // namespace

std::vector<std::string> ops_without_bench_rows(const TrainConfig& config, Device device) {
    auto dry = make_dry_backend({}, gemm_operands_bf16_for(config, device));
    const StepOps step_ops(config, *dry);
    return ops_without_rows(config, device, step_ops.ops, step_ops.op16);
}

int run_kernel_bench(const TrainConfig& config, int reps, const std::string& calibration_out) {
    const Device device = check_device_config(config);
    // Under a launcher every rank runs the same benchmark at the same time, each on its own GPU or its share of
    // the cores, so the op times hold what the ranks of a node do to one another (CPU ranks sharing the cores
    // and the memory bus); rank 0 alone prints and writes, with its node's rank count in the calibration.
    const RankEnv env = detect_rank_env();
    silence_stdout_unless_rank0(env);
    const int threads = configure_threads(config.threads);
    auto backend_ptr = make_backend(device, backend_options(config, env.local_rank));
    Backend& be = *backend_ptr;
    const ModelConfig& m = config.model;
    const ParamLayout layout(config);
    StepOps step_ops(config, be);
    const std::vector<Op>& ops = step_ops.ops;
    const int B = step_ops.B, T = step_ops.T, C = step_ops.C, NH = step_ops.NH, HS = step_ops.HS, P = step_ops.P,
              H = step_ops.H, V = step_ops.V, N = step_ops.N, R = step_ops.R;
    const bool op16 = step_ops.op16;
    if (const std::vector<std::string> missing = ops_without_rows(config, device, ops, op16); !missing.empty()) {
        TRAINER_CHECK(false, "bench-kernels has no row for {}, which a step of this config runs (add it to StepOps)",
                      fmt::join(missing, ", "));
    }

    // Rooflines: the device's peak as training's MFU counts it (the backend's, or peak_flops_per_device);
    // bandwidth stated by the backend where it knows it, and measured by a device-to-device copy as well.
    const bool bf16 = config.precision == Precision::kAmpBf16;
    std::string flops_how, bw_how;
    double peak = be.peak_flops(bf16, &flops_how);
    if (config.peak_flops_per_device) {
        peak = *config.peak_flops_per_device, flops_how = "configured peak_flops_per_device";
    }
    if (peak <= 0.0) {
        user_error("bench-kernels: the peak FLOP/s of this device is unknown ({}); set peak_flops_per_device",
                   flops_how);
    }
    double bw = be.peak_bandwidth(&bw_how);
    {
        const size_t bytes = size_t(256) << 20;
        DeviceBuffer a(&be, bytes, MemCategory::kOther), b(&be, bytes, MemCategory::kOther);
        be.fill_zero(a.data(), bytes);
        const double t = time_op(
            be, [&] { be.copy_device_to_device(b.data(), a.data(), bytes); }, 5);
        const double copy_bw = 2.0 * bytes / t;
        if (bw <= 0.0) bw = copy_bw, bw_how = "measured copy";
        std::printf(
            "device %s (%s): FLOP roof %.1f TFLOP/s (%s); bandwidth roof %.0f GB/s (%s); copy measured "
            "%.0f GB/s\n",
            be.name().c_str(), choice_name(config.precision), peak / 1e12, flops_how.c_str(), bw / 1e9, bw_how.c_str(),
            copy_bw / 1e9);
    }
    std::printf(
        "shape: micro-batch %d x T %d, d_model %d, %d heads of %d, ff %d -> %d, vocab %d (head chunk %d rows)\n", B, T,
        C, NH, HS, P, H, V, R);
    std::printf(
        "roofline time = max(FLOPs / FLOP roof, bytes / bandwidth roof); bytes = each input read and output "
        "written once, at fp32; above 100%%: the op's working set stays in cache, faster than the memory roof\n\n");
    std::printf(
        "| op | time us | TFLOP/s | GB/s | bound | roofline us | %% of roofline |\n|---|---|---|---|---|---|---|\n");
    // Each op's FLOPs and bytes: what the dry backend (the plan's cost model) reports for the same call.
    std::vector<OpCost> costs;
    auto dry = make_dry_backend([&costs](const OpCost& c) { costs.push_back(c); }, op16);
    Calibration measured;  // what --calibration-out writes
    measured.bandwidth = bw;
    for (const Op& op : ops) {
        costs.clear();
        op.run(*dry);
        double flops = 0.0, bytes = 0.0;
        for (const OpCost& c : costs) flops += c.flops, bytes += c.bytes;
        const double t = time_op(
            be, [&] { op.run(be); }, reps);
        const double t_flops = flops / peak, t_bytes = bytes / bw, roof = std::max(t_flops, t_bytes);
        std::printf("| %s | %.1f | %.2f | %.0f | %s | %.1f | %.0f%% |\n", op.name.c_str(), t * 1e6, flops / t / 1e12,
                    bytes / t / 1e9, t_flops > t_bytes ? "compute" : "memory", roof * 1e6, 100.0 * roof / t);
        // A calibration entry per single-op row (a fused pair is also measured as its two ops).
        if (costs.size() == 1 && op.calibrates) measured.entries.push_back({costs[0].op, flops, bytes, t});
    }
    if (!calibration_out.empty()) {
        // The ops in a step run slower than alone (caches shared with the rest of the step, the allocator,
        // the hooks): one real optimizer step of one micro-batch, timed, against the same step predicted
        // from the ops just measured, gives the factor the plan scales every op by.
        TrainConfig one = config;
        one.global_train_batch_size = config.device_train_microbatch_size;
        one.distributed_strategy = DistributedStrategy::kSingle;
        RankEnv alone;
        Hardware none;  // no links (one process), no rooflines: every op has an entry or the copy bandwidth
        const double predicted = predict_step_time(dry_run_step(one, alone, device), none, &measured, false).total;
        double step_seconds = 0.0;
        {
            auto strategy = make_single_strategy(&be, layout);
            load_initial_params(one, layout, *strategy, nullptr, "");
            Model model(one, layout, &be, strategy.get(), B);
            AdamW optimizer(one, layout, &be);
            const std::vector<int32_t> zeros(static_cast<size_t>(B) * m.max_sequence_length, 0);
            const float scale = 1.0f / static_cast<float>(N);
            auto step = [&] {
                accumulate_gradients(*strategy, model, 1, B, scale, [&](long) { return zeros.data(); });
                optimizer.step(*strategy, 1, 1);
            };
            step_seconds = time_op(be, step, 2);
        }
        const double step_scale = step_seconds / predicted;
        Json calibration_ops = Json::array();
        for (const Calibration::Entry& e : measured.entries) {
            calibration_ops.push_back({{"op", e.op}, {"flops", e.flops}, {"bytes", e.bytes}, {"seconds", e.seconds}});
        }
        std::printf("\none optimizer step of one micro-batch: %.1f ms measured, %.1f ms from the ops alone (x%.3f)\n",
                    step_seconds * 1e3, predicted * 1e3, step_scale);
        const Json file = {{"format", "trainer-calibration"},
                           {"step_scale", step_scale},
                           {"device", be.name()},
                           {"precision", choice_name(config.precision)},
                           {"threads", threads},
                           {"ranks_per_node", env.local_world_size},
                           {"peak_flops", peak},
                           {"bandwidth", bw},
                           {"ops", calibration_ops}};
        if (env.rank == 0) {
            write_text_file(calibration_out, file.dump(1), "--calibration-out");
            std::printf("\ncalibration written to %s (trainer plan --calibration)\n", calibration_out.c_str());
        }
    }
    return 0;
}

}  // namespace trainer
