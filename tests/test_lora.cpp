// LoRA (lora.*): the adapters' kernels against finite differences, the adapted model against its base with the
// adapters merged into the weights (the update PEFT and LitGPT define: W + (alpha / r) B A), a frozen base that
// holds no gradient and no optimizer state and never changes, and every strategy training as the single process
// with dropout on, a checkpoint of the adapters resumed on another world size.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "base/lora.h"
#include "core/optimizer.h"
#include "core/weights/peft.h"
#include "kernels/cpu/ops.h"
#include "kernels/forwarding_backend.h"
#include "model_check.h"
#include "parallel/comm/communicator.h"
#include "parallel/strategy/packed_unit.h"
#include "parallel/strategy/wrap_policy.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::fixture;
using test_util::TempDir;

namespace {

// Deterministic values in [-1, 1).
std::vector<double> pseudo(size_t n, uint64_t seed) {
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<double>(mix64(seed * 7919 + i) >> 11) * 0x1.0p-52 - 1.0;
    return v;
}

// The fixture's config with LoRA (rank 4) on `targets` (empty: every module of its shape), `dropout`.
TrainConfig lora_config(const std::string& name, double dropout, std::vector<std::string> targets = {}) {
    Json doc = read_config_file(fixture(name + "_tiny.json"));
    doc["data"]["paths"] = Json::array({fixture(name + "_tiny_tokens.u16")});
    doc["lora"]["enabled"] = true;
    doc["lora"]["r"] = 4;
    doc["lora"]["alpha"] = 6.0;
    doc["lora"]["dropout"] = dropout;
    if (targets.empty()) targets = lora_module_names(validate_config(doc).model);
    doc["lora"]["targets"] = targets;
    return validate_config(doc);
}

// The CPU backend, keeping the regions alias_bf16 names (which the CUDA backend's GEMMs read instead of casting).
// With `gemms_read`, it answers gemms_read_aliases() as the CUDA backend in amp_bf16 does, and its GEMMs read an
// aliased weight from the bf16 words alone (widened into a scratch); device memory comes filled with NaN, so anything
// else reading a weight a replica left unwritten computes NaN.
class AliasWatch final : public ForwardingBackend {
   public:
    explicit AliasWatch(Backend& inner, bool gemms_read = false) : ForwardingBackend(inner), gemms_read_(gemms_read) {}
    void alias_bf16(const float* w, const uint16_t* bf16, size_t n) override {
        if (bf16 != nullptr) {
            CHECK(aliases.count(w) == 0);
            aliases[w] = {bf16, n};
            return;
        }
        // CHECK, not REQUIRE: this runs in the strategy's destructor too.
        CHECK(aliases.count(w) == 1);
        if (aliases.count(w) == 1) CHECK(aliases[w].second == n);
        aliases.erase(w);
    }
    bool gemms_read_aliases() const override { return gemms_read_; }
    void* alloc(size_t bytes) override {
        void* p = inner().alloc(bytes);
        if (gemms_read_ && p != nullptr)
            std::memset(p, 0xff, bytes);  // NaN floats (the CPU device memory is host memory)
        return p;
    }
    void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                        int N) override {
        ForwardingBackend::matmul_forward(out, inp, read(weight, size_t(N) * K), bias, M, K, N);
    }
    void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                         const float* weight, int M, int K, int N, bool accumulate_dinp) override {
        ForwardingBackend::matmul_backward(dinp, dweight, dbias, dout, inp, read(weight, size_t(N) * K), M, K, N,
                                           accumulate_dinp);
    }
    void matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                 const float* bias, int M, int K, int N, float* scratch) override {
        ForwardingBackend::matmul_residual_forward(out, resid, inp, read(weight, size_t(N) * K), bias, M, K, N,
                                                   scratch);
    }
    void matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight, const float* bias,
                             int M, int K, int N, bool tanh_approx) override {
        ForwardingBackend::matmul_gelu_forward(pre, out, inp, read(weight, size_t(N) * K), bias, M, K, N, tanh_approx);
    }
    void matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias, GemmOperand dout,
                              GemmOperand act, const float* weight, GemmOperand pre, int M, int K, int N,
                              bool tanh_approx) override {
        ForwardingBackend::matmul_gelu_backward(dpre, dact, dweight, dbias, dout, act, read(weight, size_t(N) * K), pre,
                                                M, K, N, tanh_approx);
    }
    std::map<const float*, std::pair<const uint16_t*, size_t>> aliases;
    long aliased_reads = 0;

   private:
    // A GEMM's weight: with gemms_read, an aliased one widened from its words alone.
    const float* read(const float* w, size_t n) {
        if (!gemms_read_) return w;
        for (const auto& [at, words] : aliases) {
            if (w < at || w + n > at + words.second) continue;
            scratch_.resize(n);
            cpu::cast_bf16_to_float(scratch_.data(), words.first + (w - at), n);
            ++aliased_reads;
            return scratch_.data();
        }
        return w;
    }
    bool gemms_read_;
    std::vector<float> scratch_;
};

std::vector<float> download(Backend& backend, const float* p, size_t n) {
    std::vector<float> v(n);
    backend.copy_device_to_host(v.data(), p, n * sizeof(float));
    return v;
}

// Llama's fixture with LoRA's default targets (rank 4, dropout 0.1) under amp_fp8: the CPU's run of the mixed-precision
// path, whose GEMMs read bf16 weights on CUDA.
TrainConfig llama_amp_fp8_lora() {
    Json doc = read_config_file(fixture("llama_tiny.json"));
    doc["precision"] = "amp_fp8";
    doc["data"]["paths"] = Json::array({fixture("llama_tiny_tokens.u16")});
    doc["lora"] = {{"enabled", true}, {"r", 4}, {"alpha", 6.0}, {"dropout", 0.1}};
    return validate_config(doc);
}

// Three optimizer steps of two micro-batches each (the dropout keyed by step and instance): their losses.
std::vector<double> train_three_steps(const TrainConfig& config, const ParamLayout& layout, Backend& backend,
                                      Strategy& strategy) {
    const long L = config.model.max_sequence_length, micro = config.device_train_microbatch_size;
    Model model(config, layout, &backend, &strategy, static_cast<int>(micro));
    AdamW optimizer(config, layout, &backend);
    TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
    std::vector<int32_t> tokens(micro * L);
    std::vector<int64_t> instances(micro);
    std::vector<double> losses;
    for (long step = 1; step <= 3; ++step) {
        const LossSums sums = accumulate_gradients(strategy, model, 2, static_cast<int>(micro), 0.01f, [&](long k) {
            for (long i = 0; i < micro; ++i) {
                instances[i] = (step * 2 + k) * micro + i;
                data.read_instance(instances[i], tokens.data() + i * L);
            }
            MicroBatchTokens mb(tokens.data());
            mb.step_key = lora_step_key(config.seed, step), mb.instances = instances.data();
            return mb;
        });
        losses.push_back(sums.ce);
        optimizer.step(strategy, step, 3);
    }
    return losses;
}

// `init_from`'s base as `config`'s frozen storage gives it back to compute (round_trip_frozen), written to `out` as a
// model's safetensors file: the base a run of plain LoRA trains on to equal `config`'s.
void write_round_tripped_base(const TrainConfig& config, const std::string& init_from, const std::string& out) {
    TrainConfig base = config;
    base.init_from = init_from;
    const ParamLayout layout(base);
    std::vector<std::vector<float>> units;
    fill_lora_base(base, layout, units);
    round_trip_frozen(layout, units);
    TrainConfig plain = config;
    plain.lora = LoraConfig{};
    units.resize(ParamLayout(plain).units().size());
    const auto tensors = to_hf_tensors(plain, ParamLayout(plain), units);
    std::vector<TensorRef> refs;
    for (const auto& [name, t] : tensors) refs.push_back({name, t.shape, t.data.data()});
    write_safetensors(out, refs, {});
}

}  // namespace

TEST_CASE("lora: the kernels' gradients match finite differences in float64 with dropout and strided outputs") {
    const int M = 6, K = 7, r = 3, n = 4, ld = 9;  // the adapted columns are 4 of a row of 9
    const double scale = 1.7;
    for (const float p : {0.0f, 0.3f}) {
        CAPTURE(p);
        std::vector<uint64_t> keys(M);
        for (int m = 0; m < M; ++m) keys[m] = lora_row_key(lora_step_key(11, 3), 40 + m / 3, m % 3);
        std::vector<double> x = pseudo(M * K, 1), A = pseudo(r * K, 2), B = pseudo(n * r, 3), R = pseudo(M * ld, 4);
        std::vector<double> work(M * (K + 2 * r));
        // The loss: sum of R times the output (the base's part is a constant, left 0).
        auto loss = [&](const std::vector<double>& xx, const std::vector<double>& AA, const std::vector<double>& BB) {
            std::vector<double> out(M * ld, 0.0);
            cpu::lora_forward<double>(out.data(), ld, xx.data(), AA.data(), BB.data(), M, K, r, n, scale, p,
                                      keys.data(), 5, work.data());
            double s = 0.0;
            for (size_t i = 0; i < out.size(); ++i) s += R[i] * out[i];
            return s;
        };
        std::vector<double> dx(M * K, 0.25), dA(r * K, 0.5), dB(n * r, -0.5);  // gradients accumulate: offsets
        const std::vector<double> dx0 = dx, dA0 = dA, dB0 = dB;
        cpu::lora_backward<double>(dx.data(), dA.data(), dB.data(), R.data(), ld, x.data(), A.data(), B.data(), M, K, r,
                                   n, scale, p, keys.data(), 5, work.data());
        const double h = 1e-6;
        auto check = [&](std::vector<double>& v, const std::vector<double>& got, const std::vector<double>& base,
                         const char* what) {
            for (size_t i = 0; i < v.size(); ++i) {
                const double keep = v[i];
                v[i] = keep + h;
                const double up = loss(x, A, B);
                v[i] = keep - h;
                const double down = loss(x, A, B);
                v[i] = keep;
                const double fd = (up - down) / (2 * h);
                CAPTURE(what, i, fd, got[i] - base[i]);
                CHECK(std::fabs(got[i] - base[i] - fd) <= 1e-7 * std::max(1.0, std::fabs(fd)));
            }
        };
        check(x, dx, dx0, "dinp");
        check(A, dA, dA0, "dA");
        check(B, dB, dB0, "dB");
        // The columns outside the adapted ones are left alone.
        std::vector<double> out(M * ld, 2.0);
        cpu::lora_forward<double>(out.data(), ld, x.data(), A.data(), B.data(), M, K, r, n, scale, p, keys.data(), 5,
                                  work.data());
        for (int m = 0; m < M; ++m) {
            for (int j = n; j < ld; ++j) CHECK(out[m * ld + j] == 2.0);
        }
    }
}

TEST_CASE("lora: dropout masks drop p of the channels and depend on their key only") {
    const float p = 0.25f;
    const uint32_t t = lora_dropout_threshold(p);
    long dropped = 0, same = 0, total = 0;
    for (uint32_t row = 0; row < 200; ++row) {
        const uint64_t key = lora_row_key(lora_step_key(6198, 7), row / 17, row % 17);
        for (uint32_t k = 0; k < 500; ++k) {
            const bool keep = lora_dropout_keep(key, 3, k, t);
            dropped += keep ? 0 : 1;
            same += keep == lora_dropout_keep(key, 4, k, t) ? 1 : 0;  // another adapter: another mask
            ++total;
        }
    }
    const double rate = static_cast<double>(dropped) / total;
    CAPTURE(rate, same, total);
    CHECK(std::fabs(rate - p) < 0.01);
    // Two independent masks agree where both keep or both drop: p^2 + (1-p)^2 = 0.625 of the channels.
    CHECK(std::fabs(static_cast<double>(same) / total - 0.625) < 0.01);
    CHECK(lora_row_key(lora_step_key(1, 2), 3, 4) != lora_row_key(lora_step_key(1, 3), 3, 4));
    CHECK(lora_dropout_threshold(0.0f) == 0u);
}

TEST_CASE("lora: targets are Hugging Face module names and refused by name where the model has none") {
    Json doc = read_config_file(fixture("olmo_tiny.json"));
    doc["data"]["paths"] = Json::array({fixture("olmo_tiny_tokens.u16")});
    doc["lora"]["enabled"] = true;
    CHECK(validate_config(doc).lora.targets == std::vector<std::string>{"q_proj", "v_proj"});  // LitGPT's default
    doc["lora"]["targets"] = {"q_proj", "c_attn"};
    REQUIRE_THROWS_WITH(validate_config(doc), Contains("lora.targets[1]: \"c_attn\"") && Contains("q_proj, k_proj"));
    doc["lora"]["targets"] = {"v_proj", "v_proj"};
    REQUIRE_THROWS_WITH(validate_config(doc), Contains("lora.targets[1]: \"v_proj\" is lora.targets[0] too"));
    // An untied LM head takes an adapter; a tied one (the embedding) is refused by name.
    doc["lora"]["targets"] = {"q_proj", "lm_head"};
    const TrainConfig head = validate_config(doc);
    REQUIRE(lora_head_module(head.model, head.lora.targets));
    CHECK(lora_head_module(head.model, head.lora.targets)->rows() == head.model.embedding_size);
    CHECK(lora_modules(head.model, head.lora.targets).size() == 1);  // the block modules: q_proj
    CHECK(lora_module_names(head.model).back() == "lm_head");
    Json tied = doc;
    tied["model"]["weight_tying"] = true;
    REQUIRE_THROWS_WITH(validate_config(tied),
                        Contains("lora.targets[1]: \"lm_head\" is the token embedding here (model.weight_tying)"));
    doc["lora"]["targets"] = nullptr;
    doc["lora"]["enabled"] = false;
    doc["lora"]["init_from"] = "adapter";
    REQUIRE_THROWS_WITH(validate_config(doc), Contains("lora.init_from: \"adapter\" but lora.enabled is false"));
    const TrainConfig gpt2 = test_util::fixture_config("gpt2");
    CHECK(lora_default_targets(gpt2.model) == std::vector<std::string>{"c_attn"});
    CHECK(lora_module_names(gpt2.model) == std::vector<std::string>{"c_attn", "c_proj", "c_fc", "mlp.c_proj"});
}

// tests/make_fixtures.py's LoRA fixtures (PyTorch, float64): every module of the GPT-2, OLMo-2 and Llama shapes
// adapted, the adapters read in PEFT's names through lora.init_from; the loss and every adapter's gradient of the first
// global batch within 1e-5, and the gradients back in PEFT's names.
TEST_CASE("lora: loss and every adapter gradient match PyTorch's fixtures in PEFT's names") {
    for (const std::string name : {"gpt2", "olmo2", "llama"}) {
        CAPTURE(name);
        const Json expected = Json::parse(test_util::read_file(fixture(name + "_tiny_lora_expected.json")));
        Json doc = read_config_file(fixture(name + "_tiny.json"));
        doc["data"]["paths"] = Json::array({fixture(name + "_tiny_tokens.u16")});
        doc["lora"] = {{"enabled", true},
                       {"r", expected["r"]},
                       {"alpha", expected["alpha"]},
                       {"dropout", 0.0},
                       {"targets", expected["targets"]},
                       {"init_from", fixture(name + "_tiny_lora_adapter.safetensors")}};
        const TrainConfig config = validate_config(doc);
        auto backend = make_backend(Device::kCpu);
        const ParamLayout layout(config);
        auto strategy = make_single_strategy(backend.get(), layout);
        const std::string init = fixture(name + "_tiny_init.safetensors");
        const auto init_tensors = read_safetensors(init);
        load_initial_params(config, layout, *strategy, &init_tensors, init);

        const double loss = test_util::global_batch0_loss(config, layout, *backend, *strategy);
        const double ref = expected["loss_step1"].get<double>();
        CAPTURE(loss, ref);
        CHECK(std::fabs(loss - ref) <= 1e-5 * ref);

        std::vector<std::vector<float>> grads(layout.num_units());
        for (int u = 0; u < layout.num_units(); ++u) {  // the adapters' units: the blocks', then the LM head's
            if (!layout.units()[u].frozen)
                grads[u] = download(*backend, strategy->unit_grads(u), layout.units()[u].numel);
        }
        // Every module of the shape, the untied LM head's included (OLMo-2's and Llama's).
        CHECK((layout.head_adapter_unit() >= 0) == (name != "gpt2"));
        const auto ours = to_peft_tensors(config, layout, grads);
        const auto theirs = read_safetensors(fixture(name + "_tiny_lora_grads.safetensors"));
        REQUIRE(ours.size() == theirs.size());
        for (const auto& [tname, t] : ours) {
            CAPTURE(tname);
            REQUIRE(theirs.count(tname) == 1);
            const Tensor& r = theirs.at(tname);
            REQUIRE(r.shape == t.shape);
            double scale = 0.0, err = 0.0;
            for (size_t i = 0; i < r.data.size(); ++i) {
                scale = std::max(scale, static_cast<double>(std::fabs(r.data[i])));
                err = std::max(err, static_cast<double>(std::fabs(t.data[i] - r.data[i])));
            }
            CAPTURE(err, scale);
            CHECK(scale > 0.0);
            CHECK(err <= 1e-5 * scale);
        }
    }
}

// The adapted model, every module adapted with B != 0, against the base model whose weights are W + scaling B A: the
// same loss, and each adapter's gradients are the merged weight's gradient dW (its rows) projected: dB = scaling dW
// A^T, dA = scaling B^T dW. Covers where each module's update enters (the fused att_proj's rows, the residual
// stream, before SwiGLU or GELU, norm_after's sublayer outputs) forward and backward.
TEST_CASE("lora: the adapted model's loss and gradients equal its base's with the adapters merged") {
    for (const std::string name : {"olmo", "olmo2", "llama", "gpt2"}) {
        CAPTURE(name);
        const TrainConfig config = lora_config(name, 0.0);
        TrainConfig merged_config = config;
        merged_config.lora = LoraConfig{};
        auto backend = make_backend(Device::kCpu);
        const ParamLayout layout(config), merged_layout(merged_config);
        const std::vector<LoraModule> modules = lora_modules(config.model, config.lora.targets);
        const double scaling = config.lora.scaling();

        // Base from the fixture; adapters random, B included (PEFT starts B at 0: the merge would be trivial).
        const auto init = read_safetensors(fixture(name + "_tiny_init.safetensors"));
        std::vector<std::vector<float>> units(layout.num_units());
        for (int u = 0; u < layout.num_units(); ++u) {
            units[u].resize(layout.units()[u].numel);
            init_unit_params(config, layout.units()[u], units[u].data());
        }
        from_hf_tensors(config, layout, init, "init", units);
        for (int l = 0; l < layout.num_layers(); ++l) {
            const std::vector<double> v = pseudo(units[layout.adapter_unit(l)].size(), 100 + l);
            for (size_t i = 0; i < v.size(); ++i) units[layout.adapter_unit(l)][i] = static_cast<float>(0.2 * v[i]);
        }
        // Merged: W[rows] += scaling B A, in double.
        std::vector<std::vector<float>> merged(units.begin(), units.begin() + merged_layout.num_units());
        auto param = [&](const ParamLayout& lay, std::vector<std::vector<float>>& us, const std::string& pname) {
            int u = -1;
            const ParamSpec* spec = nullptr;
            REQUIRE(lay.find(pname, &u, &spec));
            return std::make_pair(us[u].data() + spec->offset, spec);
        };
        const char* linear_names[] = {"att_proj", "attn_out", "ff_proj", "ff_out"};
        const int r = config.lora.r;
        for (int l = 0; l < layout.num_layers(); ++l) {
            for (const LoraModule& mod : modules) {
                const std::string p = fmt::format("transformer.blocks.{}.", l);
                float* W = param(merged_layout, merged, p + linear_names[int(mod.linear)] + ".weight").first;
                const float* A = param(layout, units, p + mod.name + ".lora_A.weight").first;
                const float* B = param(layout, units, p + mod.name + ".lora_B.weight").first;
                for (int64_t i = 0; i < mod.rows(); ++i) {
                    for (int64_t k = 0; k < mod.in; ++k) {
                        double s = 0.0;
                        for (int j = 0; j < r; ++j) s += double(B[i * r + j]) * A[j * mod.in + k];
                        W[(mod.row_begin + i) * mod.in + k] += static_cast<float>(scaling * s);
                    }
                }
            }
        }

        // One micro-batch through each.
        const long L = config.model.max_sequence_length, micro = config.device_train_microbatch_size;
        TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
        std::vector<int32_t> tokens(micro * L);
        for (long i = 0; i < micro; ++i) data.read_instance(i, tokens.data() + i * L);
        const float dscale = static_cast<float>(1.0 / (micro * (L - 1)));
        auto run = [&](const TrainConfig& c, const ParamLayout& lay, const std::vector<std::vector<float>>& us,
                       std::unique_ptr<Strategy>& strategy) {
            strategy = make_single_strategy(backend.get(), lay);
            for (int u = 0; u < lay.num_units(); ++u) strategy->load_full_unit_params(u, us[u].data());
            strategy->params_loaded();
            Model model(c, lay, backend.get(), strategy.get(), static_cast<int>(micro));
            strategy->zero_grads();
            return model.forward_backward(tokens.data(), static_cast<int>(micro), dscale).ce;
        };
        std::unique_ptr<Strategy> s_lora, s_merged;
        const double loss = run(config, layout, units, s_lora),
                     ref = run(merged_config, merged_layout, merged, s_merged);
        CAPTURE(loss, ref);
        CHECK(std::fabs(loss - ref) <= 1e-5 * std::fabs(ref));

        for (int u = 0; u < merged_layout.num_units(); ++u) CHECK(s_lora->unit_grads(u) == nullptr);  // frozen
        for (int l = 0; l < layout.num_layers(); ++l) {
            const int au = layout.adapter_unit(l);
            std::vector<std::vector<float>> g(layout.num_units()), dw(merged_layout.num_units());
            g[au] = download(*backend, s_lora->unit_grads(au), layout.units()[au].numel);
            const int bu = merged_layout.block_unit(l);
            dw[bu] = download(*backend, s_merged->unit_grads(bu), merged_layout.units()[bu].numel);
            for (const LoraModule& mod : modules) {
                CAPTURE(l, mod.name);
                const std::string p = fmt::format("transformer.blocks.{}.", l);
                const float* dW = param(merged_layout, dw, p + linear_names[int(mod.linear)] + ".weight").first +
                                  mod.row_begin * mod.in;
                const float* A = param(layout, units, p + mod.name + ".lora_A.weight").first;
                const float* B = param(layout, units, p + mod.name + ".lora_B.weight").first;
                const float* dA = param(layout, g, p + mod.name + ".lora_A.weight").first;
                const float* dB = param(layout, g, p + mod.name + ".lora_B.weight").first;
                double err = 0.0, scale = 0.0;
                for (int64_t i = 0; i < mod.rows(); ++i) {
                    for (int j = 0; j < r; ++j) {
                        double s = 0.0;
                        for (int64_t k = 0; k < mod.in; ++k) s += double(dW[i * mod.in + k]) * A[j * mod.in + k];
                        err = std::max(err, std::fabs(dB[i * r + j] - scaling * s));
                        scale = std::max(scale, std::fabs(scaling * s));
                    }
                }
                for (int j = 0; j < r; ++j) {
                    for (int64_t k = 0; k < mod.in; ++k) {
                        double s = 0.0;
                        for (int64_t i = 0; i < mod.rows(); ++i) s += double(B[i * r + j]) * dW[i * mod.in + k];
                        err = std::max(err, std::fabs(dA[j * mod.in + k] - scaling * s));
                        scale = std::max(scale, std::fabs(scaling * s));
                    }
                }
                CAPTURE(err, scale);
                CHECK(scale > 0.0);
                CHECK(err <= 1e-4 * scale);
            }
        }
    }
}

TEST_CASE("lora: training moves only the adapters; the base stays bitwise with no gradient or optimizer state") {
    const TrainConfig config = lora_config("olmo", 0.1);
    auto backend = make_backend(Device::kCpu);
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    load_initial_params(config, layout, *strategy, nullptr, "");
    std::vector<std::vector<float>> before(layout.num_units());
    for (int u = 0; u < layout.num_units(); ++u)
        before[u] = download(*backend, strategy->unit_params(u), layout.units()[u].numel);
    size_t owned = 0;
    for (const ShardView& v : strategy->owned_shards()) {
        CHECK_FALSE(layout.units()[v.unit].frozen);
        owned += v.end - v.begin;
    }
    CHECK(owned == layout.trainable_numel());
    size_t adapters = 0;  // r (in + rows) a module and block, and the LM head's
    for (const LoraModule& mod : lora_modules(config.model, config.lora.targets))
        adapters += static_cast<size_t>(config.lora.r * (mod.in + mod.rows()) * config.model.n_layers);
    if (const auto head = lora_head_module(config.model, config.lora.targets))
        adapters += static_cast<size_t>(config.lora.r * (head->in + head->rows()));
    CHECK(layout.trainable_numel() == adapters);

    train_three_steps(config, layout, *backend, *strategy);
    for (int u = 0; u < layout.num_units(); ++u) {
        const std::vector<float> after = download(*backend, strategy->unit_params(u), layout.units()[u].numel);
        CAPTURE(layout.units()[u].name);
        if (layout.units()[u].frozen) {
            CHECK(std::memcmp(after.data(), before[u].data(), after.size() * sizeof(float)) == 0);
        } else {
            CHECK(after != before[u]);
        }
    }
}

// A strategy's LoRA run against the single process: the loss of every step within 1e-5, dropout on.
TEST_CASE("lora: every strategy trains as the single process with dropout on; a checkpoint resumes on another world") {
    TempDir dir;
    const std::vector<std::string> targets = {"q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"};
    const std::vector<std::string> base = {"--config",    fixture("olmo_tiny.json"),
                                           "--init-from", fixture("olmo_tiny_init.safetensors"),
                                           "--set",       "lora.enabled=true",
                                           "--set",       "lora.dropout=0.2",
                                           "--set",       "lora.r=4",
                                           "--set",       "lora.alpha=6",
                                           "--set",       "lora.targets=" + Json(targets).dump(),
                                           "--set",       "optimizer.learning_rate=0.02",
                                           "--set",       "fsdp.precision=fp32"};
    auto with = [&](const std::string& metrics, const std::vector<std::string>& more) {
        std::vector<std::string> a = base;
        a.insert(a.end(), {"--metrics-file", metrics});
        a.insert(a.end(), more.begin(), more.end());
        return a;
    };
    auto ok = [](const test_util::RunResult& r) {
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
    };
    const std::string ref_metrics = dir.path("single.jsonl");
    ok(test_util::run_trainer(with(ref_metrics, {"--max-duration", "4"})));
    const std::vector<Json> ref = test_util::read_metrics(ref_metrics);
    REQUIRE(ref.size() == 4);
    CHECK(ref.back()["loss"].get<double>() < ref.front()["loss"].get<double>());
    const Json summary = test_util::read_summary(ref_metrics);
    const auto& peak = summary["peak_memory_bytes"];
    CAPTURE(peak.dump());
    // The memory report: the base as frozen parameters, and gradients and moments for the adapters alone.
    const ParamLayout layout(lora_config("olmo", 0.2, targets));
    const auto trained = static_cast<int64_t>(4 * layout.trainable_numel());
    CHECK(peak["frozen_parameters"].get<int64_t>() == static_cast<int64_t>(4 * layout.total_numel()) - trained);
    CHECK(peak["parameters"].get<int64_t>() == trained);
    CHECK(peak["gradients"].get<int64_t>() == trained);
    CHECK(peak["optimizer_state"].get<int64_t>() == 2 * trained);

    struct Case {
        int nproc;
        std::vector<std::string> flags;
    };
    // One wrap policy a mode, every policy on FULL_SHARD.
    std::vector<Case> cases = {
        {2, {"--strategy", "ddp", "--set", "ddp.grad_sync_mode=micro_batch"}},
        {4, {"--strategy", "ddp"}},
        {2,
         {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=SHARD_GRAD_OP", "--set",
          "fsdp.wrapping_strategy=by_block"}},
        {2,
         {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=NO_SHARD", "--set",
          "fsdp.wrapping_strategy=one_in_two"}},
        {4,
         {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=HYBRID_SHARD", "--set",
          "fsdp.hybrid_sharding_num_model_replicas=2", "--set", "activation_checkpointing=whole_layer"}},
        {4,
         {"--strategy", "fsdp", "--set", "fsdp.wrapping_strategy=by_block", "--set",
          "activation_checkpointing=fine_grained", "--set", "cpu_offload.optimizer_state=true", "--set",
          "cpu_offload.parameters=true"}},
    };
    for (const char* wrap : {"null", "by_block", "by_block_and_size", "by_block_group", "by_block_group_and_size",
                             "size_based", "one_in_two", "one_in_three", "one_in_four", "one_in_five"}) {
        cases.push_back({2,
                         {"--strategy", "fsdp", "--set", fmt::format("fsdp.wrapping_strategy={}", wrap), "--set",
                          "fsdp.block_group_size=2", "--set", "fsdp.min_num_params=5000"}});
    }
    for (size_t i = 0; i < cases.size(); ++i) {
        const std::string metrics = dir.path(fmt::format("case{}.jsonl", i));
        CAPTURE(i, fmt::format("{}", fmt::join(cases[i].flags, " ")));
        std::vector<std::string> flags = cases[i].flags;
        flags.insert(flags.end(), {"--max-duration", "4"});
        ok(test_util::launch(cases[i].nproc, with(metrics, flags)));
        test_util::check_losses(ref, test_util::read_metrics(metrics));
    }

    // Mixed-precision FSDP keeps a frozen shard as its bf16 rounding alone: 2 bytes a parameter, no fp32 master.
    const std::string mixed = dir.path("mixed.jsonl");
    ok(test_util::launch(2,
                         with(mixed, {"--strategy", "fsdp", "--max-duration", "2", "--set", "fsdp.precision=mixed"})));
    const size_t base_numel = layout.total_numel() - layout.trainable_numel();
    CHECK(test_util::read_summary(mixed)["peak_memory_bytes"]["frozen_parameters"].get<int64_t>() ==
          static_cast<int64_t>(2 * ((base_numel + 1) / 2)));

    // Saved at step 2 by FSDP on 2 ranks (the adapters only: no base weights in the checkpoint), resumed alone.
    const std::string saves = dir.path("saves"), part = dir.path("part.jsonl"), resumed = dir.path("resumed.jsonl");
    ok(test_util::launch(2, with(part, {"--strategy", "fsdp", "--set", "save_folder=" + saves, "--set",
                                        "save_interval=2", "--max-duration", "2"})));
    size_t bytes = 0;
    for (const auto& e : std::filesystem::directory_iterator(saves + "/step2")) bytes += e.file_size();
    CAPTURE(bytes);
    CHECK(bytes < 200 * 1024);  // adapters and moments: 3 x 4 bytes x their 2,560; the base is 41,600 parameters
    ok(test_util::run_trainer(with(resumed, {"--max-duration", "4", "--set", "load_path=" + saves + "/step2"})));
    test_util::check_losses(ref, test_util::read_metrics(resumed), 2);
}

namespace {

// The float32 values of a .npy file trainer logits wrote.
std::vector<float> npy_floats(const std::string& path) {
    const std::string bytes = test_util::read_file(path);
    const size_t header = 10 + static_cast<unsigned char>(bytes[8]) + 256 * static_cast<unsigned char>(bytes[9]);
    std::vector<float> v((bytes.size() - header) / 4);
    std::memcpy(v.data(), bytes.data() + header, v.size() * 4);
    return v;
}

}  // namespace

TEST_CASE("lora: export writes PEFT's adapter and the merged model whose logits equal the adapted model's") {
    TempDir dir;
    const std::vector<std::string> lora = {
        "--config",    fixture("olmo_tiny.json"),
        "--init-from", fixture("olmo_tiny_init.safetensors"),
        "--set",       "lora.enabled=true",
        "--set",       "lora.r=4",
        "--set",       "lora.targets=[\"q_proj\",\"v_proj\",\"o_proj\",\"up_proj\",\"down_proj\",\"lm_head\"]",
        "--set",       "optimizer.learning_rate=0.05"};
    auto run = [&](std::vector<std::string> args, const std::vector<std::string>& more) {
        args.insert(args.end(), more.begin(), more.end());
        const auto r = test_util::run_trainer(args);
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        return r;
    };
    const std::string saves = dir.path("saves"), ckpt = saves + "/step3";
    run(lora, {"--max-duration", "3", "--set", "save_folder=" + saves});
    run(lora, {"logits", "--load-path", ckpt, "--instances", "2", "-o", dir.path("adapted.npy")});
    const std::vector<float> adapted = npy_floats(dir.path("adapted.npy"));
    run({"logits", "--config", fixture("olmo_tiny.json"), "--init-from", fixture("olmo_tiny_init.safetensors")},
        {"--instances", "2", "-o", dir.path("base.npy")});
    CHECK(npy_floats(dir.path("base.npy")) != adapted);  // the adapters moved the model

    // Merged: W + scaling B A as plain Hugging Face weights, read by a run without LoRA.
    run({"export", "--checkpoint", ckpt, "--merge-lora", "-o", dir.path("merged.safetensors")}, {});
    run({"logits", "--config", fixture("olmo_tiny.json"), "--init-from", dir.path("merged.safetensors")},
        {"--instances", "2", "-o", dir.path("merged.npy")});
    const std::vector<float> merged = npy_floats(dir.path("merged.npy"));
    REQUIRE(merged.size() == adapted.size());
    test_util::check_close(merged, adapted, 1e-5);
    // Generation with the KV cache goes through the same adapters (the blocks' and the LM head's): greedy, the adapted
    // model writes the merged model's tokens.
    const std::vector<std::string> greedy = {"--tokenizer",      "none",  "--prompt-ids",     "5, 17, 3",
                                             "--prompt-ids",     "40",    "--max-new-tokens", "10",
                                             "--no-stop-at-eos", "--json"};
    const auto ids = [](const std::string& out) {
        std::vector<Json> v;
        std::stringstream ss(out);
        std::string line;
        while (std::getline(ss, line)) {
            if (line.empty()) continue;
            const Json j = Json::parse(line);
            if (j.contains("ids")) v.push_back(j["ids"]);
        }
        return v;
    };
    std::vector<std::string> gen_lora = {"generate"};
    gen_lora.insert(gen_lora.end(), lora.begin(), lora.end());
    gen_lora.insert(gen_lora.end(), {"--load-path", ckpt});
    const auto from_lora = ids(run(gen_lora, greedy).out);
    const auto from_merged = ids(
        run({"generate", "--config", fixture("olmo_tiny.json"), "--init-from", dir.path("merged.safetensors")}, greedy)
            .out);
    REQUIRE(from_lora.size() == 2);
    CHECK(from_lora == from_merged);

    // The PEFT adapter: PEFT's names and config keys, and read back by lora.init_from to the same logits.
    const std::string adapter = dir.path("adapter");
    const auto r = run({"export", "--checkpoint", ckpt, "--adapter", "-o", adapter}, {});
    CHECK_THAT(r.out, Contains("PEFT LoRA adapter"));
    const auto tensors = read_safetensors(adapter + "/adapter_model.safetensors");
    CHECK(tensors.size() == 2 * 5 * 2 + 2);  // 5 modules in each of 2 blocks, and the LM head
    CHECK(tensors.at("base_model.model.lm_head.lora_B.weight").shape == std::vector<int64_t>{96, 4});
    CHECK(tensors.at("base_model.model.lm_head.lora_A.weight").shape == std::vector<int64_t>{4, 32});
    CHECK(tensors.count("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight") == 1);
    CHECK(tensors.at("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").shape ==
          std::vector<int64_t>{32, 4});
    CHECK(tensors.at("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight").shape == std::vector<int64_t>{4, 32});
    const Json cfg = Json::parse(test_util::read_file(adapter + "/adapter_config.json"));
    CHECK(cfg["peft_type"] == "LORA");
    CHECK(cfg["task_type"] == "CAUSAL_LM");
    CHECK(cfg["r"] == 4);
    CHECK(cfg["lora_alpha"] == 16.0);
    CHECK(cfg["target_modules"] == Json({"q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"}));
    CHECK(cfg["fan_in_fan_out"] == false);
    CHECK(cfg["bias"] == "none");
    run(lora, {"logits", "--set", "lora.init_from=" + adapter, "--instances", "2", "-o", dir.path("reread.npy")});
    CHECK(npy_floats(dir.path("reread.npy")) == adapted);

    // Refusals: a LoRA checkpoint needs a mode; a mode needs a LoRA checkpoint; an adapter of another rank.
    const auto none = test_util::run_trainer({"export", "--checkpoint", ckpt, "-o", dir.path("x.safetensors")});
    CHECK(none.exit_code != 0);
    CHECK_THAT(none.err, Contains("give --adapter") && Contains("--merge-lora"));
    const auto both =
        test_util::run_trainer({"export", "--checkpoint", ckpt, "--adapter", "--merge-lora", "-o", dir.path("both")});
    CHECK(both.exit_code != 0);
    CHECK_THAT(both.err, Contains("give one of --adapter"));
    // An adapter directory is written new and whole: one that exists is kept as it was.
    const std::string kept = test_util::read_file(adapter + "/adapter_config.json");
    const auto again = test_util::run_trainer({"export", "--checkpoint", ckpt, "--adapter", "-o", adapter});
    CHECK(again.exit_code == 1);
    CHECK_THAT(again.err, Contains(adapter + " already exists"));
    CHECK(test_util::read_file(adapter + "/adapter_config.json") == kept);
    // Nothing is written into a checkpoint's folder, whichever form.
    for (const std::string& into : {ckpt + "/adapter", ckpt + "/model.safetensors"}) {
        CAPTURE(into);
        const auto inside = test_util::run_trainer(
            {"export", "--checkpoint", ckpt, into.back() == 'r' ? "--adapter" : "--merge-lora", "-o", into});
        CHECK(inside.exit_code == 1);
        CHECK_THAT(inside.err, Contains("is a checkpoint's folder"));
        CHECK_FALSE(std::filesystem::exists(into));
    }
    const auto other = test_util::run_trainer(
        {"--config", fixture("olmo_tiny.json"), "--max-duration", "1", "--set", "lora.enabled=true", "--set",
         "lora.r=8", "--set", "lora.targets=[\"q_proj\",\"v_proj\",\"o_proj\",\"up_proj\",\"down_proj\",\"lm_head\"]",
         "--set", "lora.init_from=" + adapter});
    CHECK(other.exit_code != 0);
    CHECK_THAT(other.err, Contains("its r is 4, this run's lora.r is 8"));
    // An adapter whose values are not finite is refused by tensor and element, as a base is.
    auto tensors_nan = read_safetensors(adapter + "/adapter_model.safetensors");
    const std::string poisoned = tensors_nan.begin()->first;
    tensors_nan.begin()->second.data.at(1) = std::nanf("");
    std::vector<TensorRef> nan_refs;
    for (const auto& [name, t] : tensors_nan) nan_refs.push_back({name, t.shape, t.data.data()});
    write_safetensors(dir.path("nan.safetensors"), nan_refs, {});
    const auto nan = test_util::run_trainer(
        {"--config", fixture("olmo_tiny.json"), "--max-duration", "1", "--set", "lora.enabled=true", "--set",
         "lora.r=4", "--set", "lora.targets=[\"q_proj\",\"v_proj\",\"o_proj\",\"up_proj\",\"down_proj\",\"lm_head\"]",
         "--set", "lora.init_from=" + dir.path("nan.safetensors")});
    CHECK(nan.exit_code == 1);
    CHECK_THAT(nan.err, Contains("lora.init_from " + dir.path("nan.safetensors") + ": tensor \"" + poisoned +
                                 "\" holds nan at element 1; the weights must be finite"));
    // An adapter_config.json of other types, or not an object, refused by name (no JSON library message).
    const std::string original = test_util::read_file(adapter + "/adapter_config.json");
    for (const auto& [text, error] : std::vector<std::pair<std::string, std::string>>{
             {R"({"peft_type": 5})", "adapter_config.json: peft_type is 5; expected a string"},
             {R"({"peft_type": "LORA", "lora_alpha": "16"})", "lora_alpha is \"16\"; expected a number"},
             {R"({"use_dora": "no"})", "use_dora is \"no\"; expected true or false"},
             {R"([1, 2])", "adapter_config.json: expected a JSON object, got [1,2]"}}) {
        CAPTURE(text);
        test_util::write_file(adapter + "/adapter_config.json", text);
        const auto typed = test_util::run_trainer(
            {"--config", fixture("olmo_tiny.json"), "--max-duration", "1", "--set", "lora.enabled=true", "--set",
             "lora.r=4", "--set",
             "lora.targets=[\"q_proj\",\"v_proj\",\"o_proj\",\"up_proj\",\"down_proj\",\"lm_head\"]", "--set",
             "lora.init_from=" + adapter});
        CHECK(typed.exit_code == 1);
        CHECK_THAT(typed.err, Contains("lora.init_from " + adapter) && Contains(error));
        CHECK_THAT(typed.err, !Contains("json.exception"));
    }
    test_util::write_file(adapter + "/adapter_config.json", original);
    run({"--config", fixture("olmo_tiny.json"), "--max-duration", "1", "--set", "save_folder=" + dir.path("plain")},
        {});
    const auto plain = test_util::run_trainer(
        {"export", "--checkpoint", dir.path("plain") + "/step1", "--adapter", "-o", dir.path("y")});
    CHECK(plain.exit_code != 0);
    CHECK_THAT(plain.err, Contains("is no LoRA fine-tune's"));
}

TEST_CASE("lora: a fine-tune's checkpoint records its base and resuming on another base is refused") {
    TempDir dir;
    const std::vector<std::string> run = {"--config", fixture("olmo_tiny.json"),         "--set", "lora.enabled=true",
                                          "--set",    "save_folder=" + dir.path("saves")};
    auto with = [&](std::vector<std::string> more) {
        more.insert(more.begin(), run.begin(), run.end());
        return test_util::run_trainer(more);
    };
    const auto first = with({"--init-from", fixture("olmo_tiny_init.safetensors"), "--max-duration", "2"});
    INFO(first.out << first.err);
    REQUIRE(first.exit_code == 0);
    const Json meta = Json::parse(test_util::read_file(dir.path("saves") + "/step2/metadata.json"));
    CHECK_THAT(meta["lora_base"].get<std::string>(), Contains("tensors of checksum "));
    CHECK_THAT(first.out, !Contains("without --init-from"));
    // A fine-tune of no base trains, and says that its base is random.
    const auto random = test_util::run_trainer({"--config", fixture("olmo_tiny.json"), "--set", "lora.enabled=true",
                                                "--set", "save_folder=null", "--max-duration", "1"});
    INFO(random.out << random.err);
    CHECK(random.exit_code == 0);
    CHECK_THAT(random.out, Contains("note: lora.enabled without --init-from: the frozen base is the untrained "
                                    "initialisation of seed 4321"));
    // The same base resumes; the seed's initialisation instead of it, or another file, does not.
    const auto same = with(
        {"--init-from", fixture("olmo_tiny_init.safetensors"), "--max-duration", "3", "--set", "load_path=latest"});
    INFO(same.out << same.err);
    CHECK(same.exit_code == 0);
    const auto other = with({"--max-duration", "4", "--set", "load_path=latest"});
    CHECK(other.exit_code != 0);
    CHECK_THAT(other.err, Contains("a LoRA fine-tune of a base that is tensors of checksum") &&
                              Contains("is the initialisation of seed 4321"));
}

TEST_CASE("lora: a checkpoint resumes and is read for inference only with the adapter keys it was trained with") {
    TempDir dir;
    const std::vector<std::string> run = {
        "--config", fixture("olmo_tiny.json"), "--init-from", fixture("olmo_tiny_init.safetensors"),
        "--set",    "lora.enabled=true",       "--set",       "save_folder=" + dir.path("saves")};
    auto with = [&](std::vector<std::string> more) {
        more.insert(more.begin(), run.begin(), run.end());
        return test_util::run_trainer(more);
    };
    const auto first = with({"--max-duration", "2", "--set", "save_safetensors=true", "--set", "save_interval=1"});
    INFO(first.out << first.err);
    REQUIRE(first.exit_code == 0);
    // save_safetensors: a fine-tune's checkpoint holds its PEFT adapter (what export --adapter writes), not the base.
    const std::string step2 = dir.path("saves") + "/step2";
    CHECK_FALSE(std::filesystem::exists(step2 + "/model.safetensors"));
    REQUIRE(
        test_util::run_trainer({"export", "--checkpoint", step2, "--adapter", "-o", dir.path("adapter")}).exit_code ==
        0);
    for (const char* file : {"/adapter_model.safetensors", "/adapter_config.json"}) {
        CAPTURE(file);
        CHECK(test_util::read_file(step2 + file) == test_util::read_file(dir.path("adapter") + file));
    }
    CHECK(test_util::read_file(dir.path("saves") + "/step1/adapter_model.safetensors") !=
          test_util::read_file(step2 + "/adapter_model.safetensors"));
    const auto from_folder = with(
        {"--max-duration", "1", "--set", "lora.init_from=" + step2, "--set", "save_folder=" + dir.path("from_folder")});
    INFO(from_folder.out << from_folder.err);
    CHECK(from_folder.exit_code == 0);
    // Each of these would load: the adapters' sizes are the same (k_proj's are v_proj's here), or only the scale
    // differs. Each is another model, refused by its key.
    for (const auto& [set, key] :
         std::vector<std::pair<std::string, std::string>>{{"lora.targets=[\"q_proj\",\"k_proj\"]", "lora.targets"},
                                                          {"lora.alpha=64", "lora.alpha"},
                                                          {"lora.use_rslora=true", "lora.use_rslora"},
                                                          {"lora.quantize=nf4", "lora.quantize"},
                                                          {"lora.r=4", "lora.r"},
                                                          {"lora.enabled=false", "lora.enabled"}}) {
        CAPTURE(set);
        const auto resumed = with({"--max-duration", "3", "--set", "load_path=latest", "--set", set});
        CHECK(resumed.exit_code == 1);
        CHECK_THAT(resumed.err, Contains("checkpoint ") && Contains(key + " is ") &&
                                    Contains("in the checkpoint but") && !Contains("units"));
        const auto inferred = test_util::run_trainer({"logits", "--config", fixture("olmo_tiny.json"), "--init-from",
                                                      fixture("olmo_tiny_init.safetensors"), "--set",
                                                      "lora.enabled=true", "--load-path", dir.path("saves") + "/step2",
                                                      "--instances", "1", "-o", dir.path("logits.npy"), "--set", set});
        CHECK(inferred.exit_code == 1);
        CHECK_THAT(inferred.err, Contains(key + " is ") && Contains("in the checkpoint but"));
    }
    // The same targets in another order are the same adapters; dropout is a training choice.
    const auto reordered = with({"--max-duration", "3", "--set", "load_path=latest", "--set",
                                 "lora.targets=[\"v_proj\",\"q_proj\"]", "--set", "lora.dropout=0.2"});
    INFO(reordered.out << reordered.err);
    CHECK(reordered.exit_code == 0);
    // A pre-training checkpoint is a base to fine-tune from (init_from), not a fine-tune to resume.
    const auto plain = test_util::run_trainer(
        {"--config", fixture("olmo_tiny.json"), "--max-duration", "1", "--set", "save_folder=" + dir.path("plain")});
    REQUIRE(plain.exit_code == 0);
    const auto onto = with({"--max-duration", "2", "--set", "load_path=" + dir.path("plain") + "/step1", "--set",
                            "save_folder=" + dir.path("onto")});
    CHECK(onto.exit_code == 1);
    CHECK_THAT(onto.err, Contains("lora.enabled is false in the checkpoint but true") && Contains("init_from"));
}

TEST_CASE("qlora: a frozen unit's packed form holds its block Linear weights in NF4 and unpacks to their round trip") {
    const TrainConfig config = lora_config("llama", 0.0);
    const ParamLayout layout(config);
    auto backend = make_backend(Device::kCpu);
    for (const bool dq : {false, true})
        for (const int u : {layout.embedding_unit(), layout.block_unit(1), layout.head_unit()}) {
            const Unit& unit = layout.units()[u];
            CAPTURE(unit.name, dq);
            const PackedUnit pack(unit, FrozenForm::kNf4, dq);
            std::vector<float> values(unit.numel);
            init_unit_params(config, unit, values.data());
            for (size_t i = 0; i < values.size(); ++i) values[i] += 0.01f * static_cast<float>(i % 7);  // norms too
            std::vector<float> packed(pack.floats());
            pack.pack(values.data(), reinterpret_cast<uint8_t*>(packed.data()));
            std::vector<float> unpacked(unit.numel);
            pack.unpack(*backend, unpacked.data(), reinterpret_cast<const uint8_t*>(packed.data()));
            std::vector<float> expected = values;
            pack.round_trip(expected.data());
            CHECK(std::memcmp(unpacked.data(), expected.data(), unpacked.size() * sizeof(float)) == 0);
            size_t linear = 0;
            for (const ParamSpec& p : unit.params) linear += nf4_stored(p) ? p.numel : 0;
            CHECK(pack.nf4_numel() == linear);
            if (linear == 0) {
                CHECK(pack.bytes() == 4 * unit.numel);  // nothing quantized: the unit as it is
                CHECK(unpacked == values);
                continue;
            }
            CAPTURE(pack.nf4_bytes(), linear);
            // Small tensors pay their padding and per-tensor words: 0.57 and 0.53 bytes a parameter here.
            CHECK(static_cast<double>(pack.nf4_bytes()) <= (dq ? 0.53 : 0.57) * static_cast<double>(linear));
            CHECK(pack.bytes() == pack.nf4_bytes() + 4 * (unit.numel - linear));
            CHECK(unpacked != values);  // quantized
        }
    // A 4096 x 4096 weight: 0.5625 bytes a parameter, 0.5159 double-quantized (QLoRA's figures).
    Unit big{"block.0", {}, 0};
    ParamSpec w;
    w.name = "transformer.blocks.0.att_proj.weight", w.shape = {4096, 4096}, w.numel = 4096u * 4096u, w.layer = 0;
    big.params.push_back(w), big.numel = w.numel;
    CHECK(PackedUnit(big, FrozenForm::kNf4).nf4_bytes() == w.numel / 2 + 4 * w.numel / 64);
    const double per =
        static_cast<double>(PackedUnit(big, FrozenForm::kNf4, true).nf4_bytes()) / static_cast<double>(w.numel);
    CAPTURE(per);
    CHECK(per < 0.5160);
    CHECK(per > 0.5156);
}

TEST_CASE("lora: a frozen unit's bf16 forms hold its Linear weights or every parameter in bf16 and unpack to them") {
    // GPT-2's shape: Linear biases, affine norms and a tied head (the head unit holds no Linear weight).
    auto backend = make_backend(Device::kCpu);
    for (const std::string name : {"gpt2", "llama"}) {
        const TrainConfig config = lora_config(name, 0.0);
        const ParamLayout layout(config);
        for (const FrozenForm form : {FrozenForm::kBf16Linears, FrozenForm::kBf16})
            for (int u = 0; u < layout.num_units(); ++u) {
                const Unit& unit = layout.units()[u];
                if (!unit.frozen) continue;
                CAPTURE(name, unit.name, form == FrozenForm::kBf16);
                const PackedUnit pack(unit, form);
                std::vector<float> values(unit.numel);
                init_unit_params(config, unit, values.data());
                for (size_t i = 0; i < values.size(); ++i) values[i] += 0.01f * static_cast<float>(i % 7);  // norms
                std::vector<float> packed(pack.floats());
                pack.pack(values.data(), reinterpret_cast<uint8_t*>(packed.data()));
                std::vector<float> unpacked(unit.numel);
                pack.unpack(*backend, unpacked.data(), reinterpret_cast<const uint8_t*>(packed.data()));
                // Each parameter: its bf16 rounding (to nearest even) where stored in bf16, else bitwise itself.
                size_t narrow = 0, bytes = 0;
                for (const ParamSpec& p : unit.params) {
                    const bool bf16 = form == FrozenForm::kBf16 || bf16_linear_stored(p);
                    CHECK(bf16_linear_stored(p) == (p.kind == ParamKind::kLinearWeight));
                    std::vector<float> expected(values.begin() + p.offset, values.begin() + p.offset + p.numel);
                    if (bf16) cpu::round_to_bf16(expected.data(), expected.data(), p.numel), narrow += p.numel;
                    CAPTURE(p.name);
                    CHECK(std::memcmp(unpacked.data() + p.offset, expected.data(), p.numel * sizeof(float)) == 0);
                    if (bf16 && p.numel > 8)
                        CHECK_FALSE(std::equal(expected.begin(), expected.end(), values.begin() + p.offset));
                }
                std::vector<float> tripped = values;
                pack.round_trip(tripped.data());
                CHECK(tripped == unpacked);
                // 2 bytes a bf16 value, 4 an fp32 one, each run of parameters 4-byte aligned.
                bytes = pack.bytes();
                CHECK(bytes >= 2 * narrow + 4 * (unit.numel - narrow));
                CHECK(bytes <= 2 * narrow + 4 * (unit.numel - narrow) + 2 * unit.params.size());
                CHECK(pack.narrower() == (narrow > 0));
                CHECK(pack.nf4_numel() == 0);
            }
        // Which form each strategy keeps: QLoRA's NF4 first, bf16 parameters, then amp's bf16 GEMM operands.
        Unit frozen = layout.units()[layout.block_unit(0)];
        CHECK(frozen_form(frozen, false) == FrozenForm::kFp32);  // fp32 precision
        frozen.bf16_gemms = true;
        CHECK(frozen_form(frozen, false) == FrozenForm::kBf16Linears);
        CHECK(frozen_form(frozen, true) == FrozenForm::kBf16);
        frozen.nf4 = true;
        CHECK(frozen_form(frozen, true) == FrozenForm::kNf4);
        CHECK(frozen_form(layout.units()[layout.num_units() - 1], true) == FrozenForm::kFp32);  // an adapter unit
    }
}

// QLoRA against LoRA on the base its NF4 storage gives back (a safetensors file of the round-tripped weights): the same
// run, step by step, under every strategy; the frozen memory is the packed forms'; the merged export is that model.
TEST_CASE("qlora: training equals LoRA on the round-tripped base under every strategy with NF4 shards on the wire") {
    for (const bool dq : {false, true}) {
        CAPTURE(dq);
        TempDir dir;
        const TrainConfig config = lora_config("olmo", 0.1, {"q_proj", "v_proj", "down_proj"});
        const ParamLayout layout(config);
        TrainConfig nf4 = config;
        nf4.lora.nf4 = true, nf4.lora.double_quant = dq;
        // The fixture's base, round-tripped through NF4.
        write_round_tripped_base(nf4, fixture("olmo_tiny_init.safetensors"), dir.path("round_tripped.safetensors"));

        const std::vector<std::string> common = {"--config",       fixture("olmo_tiny.json"),
                                                 "--max-duration", "3",
                                                 "--set",          "lora.enabled=true",
                                                 "--set",          "lora.r=4",
                                                 "--set",          "lora.alpha=6",
                                                 "--set",          "lora.dropout=0.1",
                                                 "--set",          "lora.targets=[\"q_proj\",\"v_proj\",\"down_proj\"]",
                                                 "--set",          "optimizer.learning_rate=0.02",
                                                 "--set",          "fsdp.precision=fp32"};
        auto run = [&](int nproc, const std::string& name, std::vector<std::string> more) {
            std::vector<std::string> a = common;
            a.insert(a.end(), {"--metrics-file", dir.path(name)});
            a.insert(a.end(), more.begin(), more.end());
            const auto r = nproc == 1 ? test_util::run_trainer(a) : test_util::launch(nproc, a);
            INFO(r.out << r.err);
            REQUIRE(r.exit_code == 0);
            return test_util::read_metrics(dir.path(name));
        };
        const std::vector<std::string> qlora = {
            "--init-from", fixture("olmo_tiny_init.safetensors"),
            "--set",       "lora.quantize=nf4",
            "--set",       dq ? "lora.double_quant=true" : "lora.double_quant=false"};
        const auto lora = run(1, "lora.jsonl", {"--init-from", dir.path("round_tripped.safetensors")});
        const auto single = run(1, "qlora.jsonl", qlora);
        test_util::check_losses(lora, single);
        // The frozen memory: the packed forms (NF4 block weights, the rest fp32), 0.5625 bytes a quantized parameter.
        size_t packed = 0;
        for (const Unit& u : layout.units()) packed += u.frozen ? PackedUnit(u, FrozenForm::kNf4, dq).bytes() : 0;
        CHECK(
            test_util::read_summary(dir.path("qlora.jsonl"))["peak_memory_bytes"]["frozen_parameters"].get<size_t>() ==
            packed);
        const std::vector<std::pair<int, std::vector<std::string>>> cases = {
            {2, {"--strategy", "ddp"}},
            {2, {"--strategy", "fsdp", "--set", "fsdp.wrapping_strategy=by_block", "--set", "fsdp.precision=mixed"}},
            {2, {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=SHARD_GRAD_OP"}},
            {4,
             {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=HYBRID_SHARD", "--set",
              "fsdp.hybrid_sharding_num_model_replicas=2", "--set", "fsdp.wrapping_strategy=by_block"}},
            {2,
             {"--strategy", "fsdp", "--set", "cpu_offload.optimizer_state=true", "--set", "cpu_offload.parameters=true",
              "--set", "activation_checkpointing=whole_layer"}},
        };
        for (size_t i = 0; i < cases.size(); ++i) {
            if (dq && i != 1 && i != 3) continue;  // double quantization: the unpacking, under two FSDP modes
            CAPTURE(i);
            std::vector<std::string> more = qlora;
            more.insert(more.end(), cases[i].second.begin(), cases[i].second.end());
            // Mixed precision rounds the adapters' gathered copies to bf16: near, not equal.
            test_util::check_losses(single, run(cases[i].first, fmt::format("case{}.jsonl", i), more), 0,
                                    i == 1 ? 2e-3 : 1e-5);
        }

        // The merged export of a QLoRA checkpoint is the model it trained: its logits.
        const std::string saves = dir.path("saves");
        std::vector<std::string> save = qlora;
        save.insert(save.end(), {"--set", "save_folder=" + saves});
        run(1, "saved.jsonl", save);
        std::vector<std::string> logits = common;
        logits.insert(logits.begin(), "logits");
        logits.insert(logits.end(),
                      {"--set", "lora.quantize=nf4", "--set", dq ? "lora.double_quant=true" : "lora.double_quant=false",
                       "--load-path", saves + "/step3", "--instances", "2", "-o", dir.path("q.npy")});
        REQUIRE(test_util::run_trainer(logits).exit_code == 0);
        REQUIRE(test_util::run_trainer(
                    {"export", "--checkpoint", saves + "/step3", "--merge-lora", "-o", dir.path("merged.safetensors")})
                    .exit_code == 0);
        REQUIRE(test_util::run_trainer({"logits", "--config", fixture("olmo_tiny.json"), "--init-from",
                                        dir.path("merged.safetensors"), "--instances", "2", "-o", dir.path("m.npy")})
                    .exit_code == 0);
        test_util::check_close(npy_floats(dir.path("m.npy")), npy_floats(dir.path("q.npy")), 1e-5);
    }
}

// Under bf16 GEMMs (amp_bf16 on CUDA, amp_fp8 here: the CPU's emulation of its recipe) the frozen Linear weights are
// kept as bf16, the value those GEMMs read: compute sees exactly their rounding and every other parameter as loaded;
// the sharded strategies train as DDP on the same ranks (amp_fp8's per-tensor scales of the loss gradients, which
// carry 1 / world, make its runs differ a little between world sizes); the frozen memory is the packed forms'.
TEST_CASE("lora: under amp_fp8 the frozen Linear weights are kept in bf16 and every strategy trains the same") {
    TempDir dir;
    const TrainConfig config = llama_amp_fp8_lora();
    const ParamLayout layout(config);
    for (const Unit& u : layout.units()) CHECK(u.bf16_gemms == u.frozen);
    CHECK_FALSE(ParamLayout(lora_config("llama", 0.1)).units().front().bf16_gemms);  // fp32: kept as it is

    // What a replica's compute reads while a hook holds a frozen unit: the base with its Linear weights rounded.
    std::vector<std::vector<float>> expected;
    fill_lora_base(config, layout, expected);
    round_trip_frozen(layout, expected);
    // Its bf16 parts named to the backend as the words of the Linear weights (the GEMMs' reads on CUDA), until
    // released.
    auto cpu = make_backend(Device::kCpu);
    AliasWatch backend(*cpu);
    auto strategy = make_single_strategy(&backend, layout);
    load_initial_params(config, layout, *strategy, nullptr, "");
    size_t frozen_bytes = 0, rounded = 0;
    for (int u = 0; u < layout.num_units(); ++u) {
        const Unit& unit = layout.units()[u];
        if (!unit.frozen) continue;
        CAPTURE(unit.name);
        frozen_bytes += PackedUnit(unit, FrozenForm::kBf16Linears).bytes();
        strategy->before_forward(u);
        const float* params = strategy->unit_params(u);
        const std::vector<float> seen = download(backend, params, unit.numel);
        std::vector<int> named(unit.numel, 0);
        for (const auto& [w, words] : backend.aliases) {
            const auto at = static_cast<size_t>(w - params);
            REQUIRE(at + words.second <= unit.numel);
            std::vector<uint16_t> bits(words.second);
            backend.copy_device_to_host(bits.data(), words.first, bits.size() * 2);
            std::vector<float> wide(bits.size());
            cpu::cast_bf16_to_float(wide.data(), bits.data(), bits.size());
            CHECK(std::memcmp(wide.data(), seen.data() + at, wide.size() * sizeof(float)) == 0);
            for (size_t i = at; i < at + words.second; ++i) ++named[i];
        }
        for (const ParamSpec& p : unit.params) {
            CAPTURE(p.name);
            const int want = bf16_linear_stored(p) ? 1 : 0;
            CHECK(std::all_of(named.begin() + p.offset, named.begin() + p.offset + p.numel,
                              [&](int k) { return k == want; }));
        }
        strategy->after_forward(u);
        CHECK(backend.aliases.empty());
        CHECK(std::memcmp(seen.data(), expected[u].data(), seen.size() * sizeof(float)) == 0);
        for (const ParamSpec& p : unit.params) rounded += bf16_linear_stored(p) ? p.numel : 0;
    }
    const size_t base_numel = layout.total_numel() - layout.trainable_numel();
    CHECK(rounded > base_numel / 2);  // the blocks' and the LM head's weights: most of the base
    CHECK(frozen_bytes < 4 * base_numel - 2 * rounded + 64);

    // The fixture's base and the same base with its Linear weights rounded (a safetensors file) train alike.
    write_round_tripped_base(config, fixture("llama_tiny_init.safetensors"), dir.path("rounded.safetensors"));

    auto run = [&](int nproc, const std::string& name, std::vector<std::string> more) {
        std::vector<std::string> a = {"--config",       fixture("llama_tiny.json"),
                                      "--max-duration", "3",
                                      "--precision",    "amp_fp8",
                                      "--metrics-file", dir.path(name),
                                      "--set",          "lora.enabled=true",
                                      "--set",          "lora.r=4",
                                      "--set",          "lora.alpha=6",
                                      "--set",          "lora.dropout=0.1",
                                      "--set",          "optimizer.learning_rate=0.02",
                                      "--set",          "fsdp.precision=fp32"};
        a.insert(a.end(), more.begin(), more.end());
        if (std::find(a.begin(), a.end(), "--init-from") == a.end())
            a.insert(a.end(), {"--init-from", fixture("llama_tiny_init.safetensors")});
        const auto r = nproc == 1 ? test_util::run_trainer(a) : test_util::launch(nproc, a);
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        return test_util::read_metrics(dir.path(name));
    };
    auto frozen_memory = [&](const std::string& name) {
        return test_util::read_summary(dir.path(name))["peak_memory_bytes"]["frozen_parameters"].get<size_t>();
    };
    const auto single = run(1, "single.jsonl", {});
    CHECK(frozen_memory("single.jsonl") == frozen_bytes);
    test_util::check_losses(single, run(1, "rounded.jsonl", {"--init-from", dir.path("rounded.safetensors")}), 0, 0.0);

    const auto ddp = run(2, "ddp.jsonl", {"--strategy", "ddp"});
    CHECK(frozen_memory("ddp.jsonl") == frozen_bytes);
    const std::vector<std::vector<std::string>> cases = {
        {"--strategy", "fsdp", "--set", "fsdp.wrapping_strategy=by_block"},
        {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=SHARD_GRAD_OP", "--set",
         "activation_checkpointing=whole_layer"},
        {"--strategy", "fsdp", "--set", "cpu_offload.parameters=true", "--set", "cpu_offload.optimizer_state=true"},
    };
    for (size_t i = 0; i < cases.size(); ++i) {
        CAPTURE(i);
        test_util::check_losses(ddp, run(2, fmt::format("case{}.jsonl", i), cases[i]));
    }
    // NO_SHARD with bf16 parameters keeps every frozen parameter as bf16 (the norms too, as its compute reads them),
    // and rounds the adapters' compute copies: near (0.3% apart by step 3 here, at FP8's scales), not equal.
    const auto mixed =
        run(2, "mixed.jsonl",
            {"--strategy", "fsdp", "--set", "fsdp.sharding_strategy=NO_SHARD", "--set", "fsdp.precision=mixed"});
    test_util::check_losses(ddp, mixed, 0, 1e-2);
    size_t all_bf16 = 0;
    for (const Unit& u : layout.units()) all_bf16 += u.frozen ? PackedUnit(u, FrozenForm::kBf16).bytes() : 0;
    CHECK(frozen_memory("mixed.jsonl") == all_bf16);
    CHECK(all_bf16 < frozen_bytes);
}

// Where the GEMMs read a replica's bf16 Linear weights from their words alone (the CUDA backend in amp_bf16 and
// amp_fp8), the replica does not widen them: nothing else reads them, which a backend whose memory starts as NaN and
// whose GEMMs read only the words holds here, training bitwise as the replica that widens every weight.
TEST_CASE(
    "lora: where the GEMMs read the bf16 words a replica leaves its Linear weights unwidened and trains the same") {
    const TrainConfig config = llama_amp_fp8_lora();
    const ParamLayout layout(config);
    struct Trained {
        std::vector<double> losses;
        std::vector<std::vector<float>> adapters;
        long aliased_reads = 0;
    };
    auto train = [&](bool gemms_read) {
        auto cpu = make_backend(Device::kCpu);
        AliasWatch backend(*cpu, gemms_read);
        auto strategy = make_single_strategy(&backend, layout);
        load_initial_params(config, layout, *strategy, nullptr, "");
        if (gemms_read) {  // the first unit held: its Linear weights never written (NaN), the rest as loaded
            const int u = layout.block_unit(0);
            strategy->before_forward(u);
            const std::vector<float> seen = download(backend, strategy->unit_params(u), layout.units()[u].numel);
            strategy->after_forward(u);
            for (const ParamSpec& p : layout.units()[u].params) {
                CAPTURE(p.name);
                const auto nan = [](float x) { return std::isnan(x); };
                const auto first = seen.begin() + static_cast<std::ptrdiff_t>(p.offset);
                const auto last = first + static_cast<std::ptrdiff_t>(p.numel);
                if (bf16_linear_stored(p)) {
                    CHECK(std::all_of(first, last, nan));
                } else {
                    CHECK(std::none_of(first, last, nan));
                }
            }
        }
        Trained t;
        t.losses = train_three_steps(config, layout, backend, *strategy);
        for (int u = 0; u < layout.num_units(); ++u) {
            if (!layout.units()[u].frozen)
                t.adapters.push_back(download(backend, strategy->unit_params(u), layout.units()[u].numel));
        }
        t.aliased_reads = backend.aliased_reads;
        return t;
    };
    const Trained widened = train(false), words = train(true);
    CHECK(widened.aliased_reads == 0);
    CHECK(words.aliased_reads > 0);
    CHECK(std::none_of(words.losses.begin(), words.losses.end(), [](double x) { return std::isnan(x); }));
    CHECK(words.losses == widened.losses);
    CHECK(words.adapters == widened.adapters);
}

// Trained units too: FSDP's gathered units under bf16 parameters (mixed), gathered or alone, FSDP's packed frozen base
// under amp_fp8 with fp32 parameters, NO_SHARD's mixed compute copies, and QLoRA's NF4 base dequantized straight into
// words (FSDP and a replica), each run once with the GEMMs reading fp32 and once reading the named words (AliasWatch:
// memory NaN until written), must train bitwise alike.
TEST_CASE(
    "bf16 words: where the GEMMs read them FSDP's gathered units and NO_SHARD's mixed copies place their Linear "
    "weights as words and train the same") {
    Json doc = read_config_file(fixture("llama_tiny.json"));
    doc["data"]["paths"] = Json::array({fixture("llama_tiny_tokens.u16")});
    const TrainConfig plain = validate_config(doc);
    const TrainConfig lora = llama_amp_fp8_lora();
    doc["precision"] = "amp_fp8";
    doc["lora"] = {{"enabled", true},     {"r", 4}, {"alpha", 6.0}, {"dropout", 0.1}, {"quantize", "nf4"},
                   {"double_quant", true}};
    const TrainConfig qlora = validate_config(doc);
    struct Case {
        std::string name;
        const TrainConfig* config;
        bool fsdp, alone, bf16_params;
        ShardingStrategy sharding;
    };
    const std::vector<Case> cases = {
        {"FULL_SHARD mixed", &plain, true, false, true, ShardingStrategy::kFullShard},
        {"SHARD_GRAD_OP mixed", &plain, true, false, true, ShardingStrategy::kShardGradOp},
        {"FULL_SHARD mixed alone", &plain, true, true, true, ShardingStrategy::kFullShard},
        {"FULL_SHARD LoRA amp_fp8 fp32 parameters", &lora, true, false, false, ShardingStrategy::kFullShard},
        {"NO_SHARD mixed", &plain, false, false, true, ShardingStrategy::kNoShard},
        {"FULL_SHARD QLoRA amp_fp8", &qlora, true, false, false, ShardingStrategy::kFullShard},
        {"DDP QLoRA amp_fp8", &qlora, false, false, false, ShardingStrategy::kNoShard},
    };
    for (const Case& k : cases) {
        CAPTURE(k.name);
        TrainConfig config = *k.config;
        config.fsdp.sharding_strategy = k.sharding;
        config.fsdp.wrapping_strategy = WrappingStrategy::kByBlock;
        const ParamLayout layout(config);
        struct Trained {
            std::vector<double> losses;
            std::vector<std::vector<float>> shards;
            std::vector<float> block;  // block 0's compute copy as a hook sees it, before training
            std::map<const float*, std::pair<const uint16_t*, size_t>> named;  // its names then
            const float* block_at = nullptr;
            long aliased_reads = 0;
            size_t left_named = 0;  // names the strategy left behind
        };
        auto train = [&](bool gemms_read) {
            auto cpu = make_backend(Device::kCpu);
            AliasWatch backend(*cpu, gemms_read);
            auto local = make_local_communicator(&backend);
            std::unique_ptr<Strategy> strategy;
            WirePrecision precision;
            precision.bf16_params = k.bf16_params;
            if (k.fsdp) {
                FsdpOptions o;
                o.groups = fsdp_unit_groups(layout, config.fsdp);
                o.keep_params_for_step = k.sharding == ShardingStrategy::kShardGradOp;
                o.precision = precision;
                o.in_place_when_alone = k.alone;  // else a group of one gathers as many ranks do
                strategy = make_fsdp_strategy(&backend, layout, local.get(), local.get(), nullptr, o, "fsdp");
            } else {
                strategy = make_ddp_strategy(&backend, layout, local.get(), false, "fsdp", precision, {});
            }
            load_initial_params(config, layout, *strategy, nullptr, "");
            Trained t;
            const int u = layout.block_unit(0);
            strategy->begin_forward(false);
            strategy->before_forward(u);
            t.block_at = strategy->unit_params(u);
            t.block = download(backend, t.block_at, layout.units()[u].numel);
            t.named = backend.aliases;
            strategy->after_forward(u);
            strategy->after_optimizer_step();  // nothing kept from the look (SHARD_GRAD_OP, alone)
            t.losses = train_three_steps(config, layout, backend, *strategy);
            for (const ShardView& v : strategy->owned_shards())
                t.shards.push_back(download(backend, v.param, v.end - v.begin));
            t.aliased_reads = backend.aliased_reads;
            strategy.reset();
            t.left_named = backend.aliases.size();
            return t;
        };
        const Trained widened = train(false), words = train(true);
        CHECK(widened.named.empty());
        CHECK(widened.aliased_reads == 0);
        CHECK(words.aliased_reads > 0);
        CHECK(words.left_named == 0);
        CHECK(std::none_of(words.losses.begin(), words.losses.end(), [](double x) { return std::isnan(x); }));
        CHECK(words.losses == widened.losses);
        CHECK(words.shards == widened.shards);

        // Block 0 in a hook: each run of Linear weights as its words, in the head of the run's own region and named
        // there; the rest as widened.
        const Unit& block = layout.units()[layout.block_unit(0)];
        std::vector<uint16_t> seen(block.numel);  // each element's word as the names give it
        std::vector<int> named(block.numel, 0);
        for (const auto& [w, n] : words.named) {
            const auto at = static_cast<size_t>(w - words.block_at);
            REQUIRE(at + n.second <= block.numel);
            CHECK(n.first == reinterpret_cast<const uint16_t*>(w));  // in the region itself
            std::memcpy(seen.data() + at, words.block.data() + at, 2 * n.second);
            for (size_t i = at; i < at + n.second; ++i) ++named[i];
        }
        size_t linears = 0;
        for (const ParamSpec& p : block.params) {
            CAPTURE(p.name);
            const auto first = named.begin() + static_cast<std::ptrdiff_t>(p.offset);
            const auto* want = widened.block.data() + p.offset;
            if (!bf16_linear_stored(p)) {
                CHECK(std::all_of(first, first + static_cast<std::ptrdiff_t>(p.numel), [](int c) { return c == 0; }));
                CHECK(std::memcmp(words.block.data() + p.offset, want, p.numel * sizeof(float)) == 0);
                continue;
            }
            ++linears;
            CHECK(std::all_of(first, first + static_cast<std::ptrdiff_t>(p.numel), [](int c) { return c == 1; }));
            std::vector<uint16_t> expected(p.numel);
            cpu::cast_float_to_bf16(expected.data(), want, p.numel);
            CHECK(std::equal(expected.begin(), expected.end(), seen.begin() + static_cast<std::ptrdiff_t>(p.offset)));
        }
        CHECK(linears >= 4);  // q, k, v as one or three, o, the MLP's
    }
}
