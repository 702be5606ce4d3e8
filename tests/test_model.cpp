// The full model against PyTorch: loss and every parameter gradient of one global batch (with gradient
// accumulation) for the GPT-2 and OLMo shapes, against fixtures made by tests/make_fixtures.py in
// float64 from the same initial weights (loaded through the Hugging Face importer). Also: initialisation
// statistics and independence from the thread count, and the parameter layout's decay groups.
#include <omp.h>

#include <cmath>
#include <map>

#include "core/data.h"
#include "core/hf_names.h"
#include "core/layout.h"
#include "core/model.h"
#include "core/safetensors.h"
#include "kernels/backend.h"
#include "parallel/strategy.h"
#include "test_util.h"

using namespace trainer;
using test_util::fixture;

namespace {

TrainConfig fixture_config(const std::string& name) {
    Json doc = read_config_file(fixture(name + "_tiny.json"));
    doc["data"]["paths"] = Json::array({fixture(name + "_tiny_tokens.u16")});
    return validate_config(doc);
}

// Loss and gradients of global batch 0 with the fixture's micro-batching, in float32 on the CPU backend.
void check_against_fixture(const std::string& name) {
    const TrainConfig config = fixture_config(name);
    const Json expected = Json::parse(test_util::read_file(fixture(name + "_tiny_expected.json")));
    auto backend = make_backend("cpu");
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    const std::string init = fixture(name + "_tiny_init.safetensors");
    const auto init_tensors = read_safetensors(init);
    load_initial_params(config, layout, *strategy, &init_tensors, init);

    const long micro = config.device_train_microbatch_size, G = config.global_train_batch_size;
    const long L = config.model.max_sequence_length;
    Model model(config, layout, backend.get(), strategy.get(), static_cast<int>(micro));
    TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
    std::vector<int32_t> tokens(micro * L);
    strategy->zero_grads();
    double loss = 0.0;
    const float scale = static_cast<float>(1.0 / (G * (L - 1)));
    for (long k = 0; k < G / micro; ++k) {
        for (long i = 0; i < micro; ++i) data.read_instance(k * micro + i, tokens.data() + i * L);
        loss += model.forward_backward(tokens.data(), static_cast<int>(micro), scale);
    }
    loss /= static_cast<double>(G * (L - 1));
    const double ref_loss = expected["loss_step1"].get<double>();
    CAPTURE(loss, ref_loss);
    CHECK(std::fabs(loss - ref_loss) <= 1e-5 * std::fabs(ref_loss));

    std::vector<std::vector<float>> grads(layout.num_units());
    for (int u = 0; u < layout.num_units(); ++u) {
        grads[u].resize(layout.units()[u].numel);
        backend->copy_device_to_host(grads[u].data(), strategy->unit_grads(u), grads[u].size() * sizeof(float));
    }
    const auto ours = to_hf_tensors(config, layout, grads);
    const auto ref = read_safetensors(fixture(name + "_tiny_grads.safetensors"));
    REQUIRE(ours.size() == ref.size());
    for (const auto& [tname, t] : ours) {
        REQUIRE(ref.count(tname) == 1);
        const Tensor& r = ref.at(tname);
        REQUIRE(r.shape == t.shape);
        // 1e-5 relative to the tensor's scale, element by element: float32 accumulation against a float64
        // reference leaves errors near 1e-7 of the largest entries, so tiny entries are judged by the scale.
        double max_ref = 0.0, err2 = 0.0, ref2 = 0.0;
        for (float x : r.data) max_ref = std::max(max_ref, static_cast<double>(std::fabs(x)));
        for (size_t i = 0; i < r.data.size(); ++i) {
            const double d = static_cast<double>(t.data[i]) - r.data[i];
            err2 += d * d;
            ref2 += static_cast<double>(r.data[i]) * r.data[i];
            if (std::fabs(d) > 1e-5 * max_ref + 1e-5 * std::fabs(r.data[i])) {
                FAIL_CHECK(tname << "[" << i << "]: ref " << r.data[i] << ", got " << t.data[i]);
                break;
            }
        }
        CAPTURE(tname);
        CHECK(std::sqrt(err2 / std::max(ref2, 1e-300)) <= 1e-5);
    }
}

}  // namespace

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
