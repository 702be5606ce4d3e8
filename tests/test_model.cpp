// The full model against PyTorch: loss and every parameter gradient of one global batch (with gradient
// accumulation) for the GPT-2 and OLMo shapes, against fixtures made by tests/make_fixtures.py in
// float64 from the same initial weights (loaded through the Hugging Face importer). Also: initialisation
// statistics and independence from the thread count, and the parameter layout's decay groups.
#include <omp.h>

#include <cmath>
#include <map>

#include "base/layout.h"
#include "core/data.h"
#include "core/hf_names.h"
#include "core/model.h"
#include "core/safetensors.h"
#include "kernels/backend.h"
#include "model_check.h"
#include "parallel/strategy.h"
#include "test_util.h"

using namespace trainer;
using test_util::check_against_fixture;
using test_util::fixture;
using test_util::fixture_config;

TEST_CASE("model: GPT-2 shape loss and gradients match the PyTorch fixture") { check_against_fixture("gpt2"); }

TEST_CASE("model: OLMo shape loss and gradients match the PyTorch fixture") { check_against_fixture("olmo"); }

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
