// The full model against PyTorch: loss and every parameter gradient of one global batch (with gradient
// accumulation) for the GPT-2, OLMo, OLMo-2 and Llama (grouped-query attention) shapes, against fixtures made by
// tests/make_fixtures.py in float64 from the same initial weights (loaded through the Hugging Face importer). Also:
// initialisation statistics and independence from the thread count, and the parameter layout's decay groups.
#include <omp.h>

#include <cmath>
#include <map>

#include "base/layout.h"
#include "core/data/data.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "core/weights/hf_names.h"
#include "core/weights/safetensors.h"
#include "kernels/backend.h"
#include "model_check.h"
#include "parallel/strategy/strategy.h"
#include "test_util.h"

using namespace trainer;
using test_util::check_against_fixture;
using test_util::fixture;
using test_util::fixture_config;

TEST_CASE("model: GPT-2 shape loss and gradients match the PyTorch fixture") { check_against_fixture("gpt2"); }

TEST_CASE("model: OLMo shape loss and gradients match the PyTorch fixture") { check_against_fixture("olmo"); }

// RMSNorm after the sublayers, QK-norm, the z-loss.
TEST_CASE("model: OLMo-2 shape loss and gradients match the PyTorch fixture") { check_against_fixture("olmo2"); }

// Grouped-query attention: 4 query heads sharing 2 key/value heads; RMSNorm with weights before the sublayers.
TEST_CASE("model: Llama shape loss and gradients match the PyTorch fixture") { check_against_fixture("llama"); }

// Multi-query attention (one key/value head) with QK-norm: k_norm is one head wide.
TEST_CASE("model: OLMo-2 shape with one key/value head matches the PyTorch fixture") {
    check_against_fixture("olmo2mqa");
}

TEST_CASE("model: layout units and OLMo decay groups") {
    const TrainConfig olmo = fixture_config("olmo");
    const ParamLayout layout(olmo);
    REQUIRE(layout.num_units() == 2 + olmo.model.n_layers);
    CHECK(layout.units()[0].name == "embedding");
    CHECK(layout.units().back().name == "head");
    int u = 0;
    const ParamSpec* p = nullptr;
    REQUIRE(layout.find("transformer.blocks.1.ff_proj.weight", &u, &p));
    CHECK(u == 2);
    CHECK(p->decay);
    CHECK(p->shape == std::vector<int64_t>{88, 32});
    REQUIRE(layout.find("transformer.wte.weight", &u, &p));
    CHECK_FALSE(p->decay);
    REQUIRE(layout.find("transformer.ff_out.weight", &u, &p));  // untied head: a Linear, decayed
    CHECK(p->decay);
    const TrainConfig gpt2 = fixture_config("gpt2");
    const ParamLayout gl(gpt2);
    REQUIRE(gl.find("transformer.blocks.0.attn_norm.bias", &u, &p));
    CHECK_FALSE(p->decay);
    // Segments alternate decay flags and tile the unit exactly.
    const auto segs = gl.decay_segments(1);
    CHECK(segs.front().begin == 0);
    CHECK(segs.back().end == gl.units()[1].numel);
    for (size_t i = 1; i < segs.size(); ++i) {
        CHECK(segs[i].begin == segs[i - 1].end);
        CHECK(segs[i].decay != segs[i - 1].decay);
    }
    // Tied GPT-2: wpe is not a matmul parameter, wte is (it is the head).
    CHECK(gl.matmul_numel() == gl.total_numel() - static_cast<size_t>(17 * 32));
}

TEST_CASE("model: mitchell init is truncated with the right scale and independent of threads") {
    const TrainConfig config = fixture_config("olmo");
    const ParamLayout layout(config);
    const Unit& block = layout.units()[2];  // block 1: outputs scaled by 1/sqrt(2 * 2)
    std::vector<float> a(block.numel), b(block.numel);
    omp_set_num_threads(1);
    init_unit_params(config, block, a.data());
    omp_set_num_threads(2);
    init_unit_params(config, block, b.data());
    CHECK(a == b);
    for (const auto& p : block.params) {
        const double fan_in = static_cast<double>(p.shape[1]);
        double std = 1.0 / std::sqrt(fan_in);
        if (p.name.find("attn_out") != std::string::npos || p.name.find("ff_out") != std::string::npos) {
            std /= std::sqrt(4.0);
        }
        double s2 = 0.0, maxabs = 0.0;
        for (size_t i = 0; i < p.numel; ++i) {
            const double x = a[p.offset + i];
            s2 += x * x;
            maxabs = std::max(maxabs, std::fabs(x));
        }
        const double measured = std::sqrt(s2 / static_cast<double>(p.numel));
        CAPTURE(p.name, measured, std);
        CHECK(maxabs <= 3.0 * std * (1 + 1e-6));
        // A normal truncated at 3 sigma has a std of 0.986 sigma; allow sampling noise on ~1-3K values.
        CHECK(std::fabs(measured / std - 0.986) < 0.06);
    }
    // A different seed gives different weights.
    TrainConfig other = config;
    other.seed += 1;
    std::vector<float> c(block.numel);
    init_unit_params(other, block, c.data());
    CHECK(c != a);
}

TEST_CASE("model: an instance kept out (the instance filter) adds no loss and no gradient") {
    // Micro-batch of 4 with instance 1 kept out against the three others run one by one, on the OLMo-2 shape
    // (its z-loss must skip the instance too).
    const TrainConfig config = fixture_config("olmo2");
    const int L = config.model.max_sequence_length;
    TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
    std::vector<int32_t> tokens(4 * static_cast<size_t>(L));
    for (int i = 0; i < 4; ++i) data.read_instance(i, tokens.data() + static_cast<size_t>(i) * L);
    auto backend = make_backend(Device::kCpu);
    const ParamLayout layout(config);
    const auto init = read_safetensors(fixture("olmo2_tiny_init.safetensors"));
    auto grads_of = [&](Strategy& s) {
        std::vector<std::vector<float>> g(layout.num_units());
        for (int u = 0; u < layout.num_units(); ++u) {
            g[u].resize(layout.units()[u].numel);
            backend->copy_device_to_host(g[u].data(), s.unit_grads(u), g[u].size() * sizeof(float));
        }
        return g;
    };
    auto masked = make_single_strategy(backend.get(), layout);
    load_initial_params(config, layout, *masked, &init, "init");
    Model m1(config, layout, backend.get(), masked.get(), 4);
    masked->zero_grads();
    const uint8_t keep[4] = {1, 0, 1, 1};
    const LossSums got = m1.forward_backward(tokens.data(), 4, 0.125f, keep);
    auto single = make_single_strategy(backend.get(), layout);
    load_initial_params(config, layout, *single, &init, "init");
    Model m2(config, layout, backend.get(), single.get(), 1);
    single->zero_grads();
    LossSums want;
    for (int i : {0, 2, 3}) want += m2.forward_backward(tokens.data() + static_cast<size_t>(i) * L, 1, 0.125f);
    CHECK(got.ce == Approx(want.ce).epsilon(1e-6));
    CHECK(got.z == Approx(want.z).epsilon(1e-6));
    CHECK(got.z > 0.0);
    // The same sums in another order and grouping (GEMMs of 4 instances against 1, three accumulations against
    // one): fp32 rounding, judged against each tensor's scale as the fixture checks judge (model_check.h).
    const auto a = grads_of(*masked), b = grads_of(*single);
    for (size_t u = 0; u < a.size(); ++u) {
        float scale = 0.0f;
        for (float x : b[u]) scale = std::max(scale, std::fabs(x));
        for (size_t i = 0; i < a[u].size(); ++i) {
            CAPTURE(u, i, a[u][i], b[u][i], scale);
            REQUIRE(std::fabs(a[u][i] - b[u][i]) <= 1e-4 * (scale + std::fabs(b[u][i])));
        }
    }
}
