// The full model against PyTorch fixtures (tests/make_fixtures.py): loss and every parameter gradient of
// one global batch, shared by the CPU model test and the GPU tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/layout.h"
#include "core/data/data.h"
#include "core/data/downstream.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "core/run/evaluate.h"
#include "core/weights/hf_names.h"
#include "core/weights/safetensors.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"
#include "test_util.h"

namespace test_util {
using namespace trainer;

inline trainer::TrainConfig fixture_config(const std::string& name) {
    Json doc = read_config_file(fixture(name + "_tiny.json"));
    doc["data"]["paths"] = Json::array({fixture(name + "_tiny_tokens.u16")});
    return validate_config(doc);
}

// The model of fixture `name` with its initial weights on `device` (fp32), one process.
struct FixtureModel {
    TrainConfig config;
    std::unique_ptr<Backend> backend;
    std::unique_ptr<ParamLayout> layout;
    std::unique_ptr<Strategy> strategy;
    explicit FixtureModel(const std::string& name, Device device = Device::kCpu)
        : config(fixture_config(name)), backend(make_backend(device)) {
        layout = std::make_unique<ParamLayout>(config);
        strategy = make_single_strategy(backend.get(), *layout);
        const std::string init = fixture(name + "_tiny_init.safetensors");
        const auto tensors = read_safetensors(init);
        load_initial_params(config, *layout, *strategy, &tensors, init);
    }
};

// Decoding with a KV cache on `device` gives the model's forward logits at every position (within `rel` of their
// largest magnitude): the fixture's first two sequences, their first 5 tokens as one call (a prompt), then one token
// each a call.
inline void check_decode_against_forward(const std::string& name, Device device, double rel) {
    FixtureModel m(name, device);
    const int L = m.config.model.max_sequence_length, T = L - 1, V = m.config.model.embedding_size;
    TokenDataset data(m.config.data.paths, TokenDtype::kUint16, L, m.config.model.vocab_size);
    std::vector<int32_t> tokens(2 * static_cast<size_t>(L));
    for (int i = 0; i < 2; ++i) data.read_instance(i, tokens.data() + static_cast<size_t>(i) * L);
    Model model(m.config, *m.layout, m.backend.get(), m.strategy.get(), 2);
    std::vector<float> want(2 * static_cast<size_t>(T) * V);
    model.forward_logits(tokens.data(), 2, [&](int r0, int rows, const float* logits) {
        std::copy_n(logits, static_cast<size_t>(rows) * V, want.begin() + static_cast<std::ptrdiff_t>(r0) * V);
    });
    Model::DecodeCache cache = model.make_decode_cache(2, T, 10);
    std::vector<float> got(want.size(), NAN);
    const auto sink_into = [&](const std::vector<int32_t>& seqs, const std::vector<int32_t>& pos) {
        return [&, seqs, pos](int row, int, const float* logits) {
            const size_t at = (static_cast<size_t>(seqs[row]) * T + pos[row]) * V;
            std::copy_n(logits, V, got.begin() + static_cast<std::ptrdiff_t>(at));
        };
    };
    std::vector<int32_t> tok, seqs, pos;
    for (int b = 0; b < 2; ++b) {
        for (int t = 0; t < 5; ++t) tok.push_back(tokens[b * L + t]), seqs.push_back(b), pos.push_back(t);
    }
    model.decode(cache, tok.data(), seqs.data(), pos.data(), 10, nullptr, sink_into(seqs, pos));
    for (int t = 5; t < T; ++t) {
        tok = {tokens[t], tokens[L + t]}, seqs = {0, 1}, pos = {t, t};
        model.decode(cache, tok.data(), seqs.data(), pos.data(), 2, nullptr, sink_into(seqs, pos));
    }
    double scale = 0.0, worst = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
        REQUIRE(std::isfinite(got[i]));
        scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
        worst = std::max(worst, static_cast<double>(std::fabs(got[i] - want[i])));
    }
    CAPTURE(worst, scale);
    CHECK(worst <= rel * scale);
}

// The mean loss of the fixture's global batch 0, its gradients accumulated into the strategy's (zeroed first), with
// the fixture's micro-batching.
inline double global_batch0_loss(const trainer::TrainConfig& config, const trainer::ParamLayout& layout,
                                 trainer::Backend& backend, trainer::Strategy& strategy) {
    const long micro = config.device_train_microbatch_size, G = config.global_train_batch_size;
    const long L = config.model.max_sequence_length;
    Model model(config, layout, &backend, &strategy, static_cast<int>(micro));
    TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
    std::vector<int32_t> tokens(micro * L);
    strategy.zero_grads();
    double loss = 0.0;
    const float scale = static_cast<float>(1.0 / (G * (L - 1)));
    for (long k = 0; k < G / micro; ++k) {
        for (long i = 0; i < micro; ++i) data.read_instance(k * micro + i, tokens.data() + i * L);
        loss += model.forward_backward(tokens.data(), static_cast<int>(micro), scale).ce;
    }
    return loss / static_cast<double>(G * (L - 1));
}

// Loss and gradients of global batch 0 with the fixture's micro-batching, in float32 on `device` (the
// CPU backend by default): the loss within `rel` of the float64 fixture, gradients within `grad_rel`
// (default: `rel`); `options` choose the backend's precision.
inline void check_against_fixture(const std::string& name, trainer::Device device = trainer::Device::kCpu,
                                  double rel = 1e-5, const trainer::BackendOptions& options = {},
                                  double grad_rel = 0.0) {
    if (grad_rel <= 0.0) grad_rel = rel;
    const TrainConfig config = fixture_config(name);
    const Json expected = Json::parse(test_util::read_file(fixture(name + "_tiny_expected.json")));
    auto backend = make_backend(device, options);
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    const std::string init = fixture(name + "_tiny_init.safetensors");
    const auto init_tensors = read_safetensors(init);
    load_initial_params(config, layout, *strategy, &init_tensors, init);

    const double loss = global_batch0_loss(config, layout, *backend, *strategy);
    const double ref_loss = expected["loss_step1"].get<double>();
    CAPTURE(loss, ref_loss);
    CHECK(std::fabs(loss - ref_loss) <= rel * std::fabs(ref_loss));

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
        // grad_rel (1e-5 in fp32) relative to the tensor's scale, element by element: float32 accumulation against a
        // float64 reference leaves errors near 1e-7 of the largest entries, so tiny entries are judged by the scale.
        double max_ref = 0.0, err2 = 0.0, ref2 = 0.0;
        for (float x : r.data) max_ref = std::max(max_ref, static_cast<double>(std::fabs(x)));
        for (size_t i = 0; i < r.data.size(); ++i) {
            const double d = static_cast<double>(t.data[i]) - r.data[i];
            err2 += d * d;
            ref2 += static_cast<double>(r.data[i]) * r.data[i];
            if (std::fabs(d) > grad_rel * max_ref + grad_rel * std::fabs(r.data[i])) {
                FAIL_CHECK(tname << "[" << i << "]: ref " << r.data[i] << ", got " << t.data[i]);
                break;
            }
        }
        CAPTURE(tname);
        CHECK(std::sqrt(err2 / std::max(ref2, 1e-300)) <= grad_rel);
    }
}

// A multiple-choice task on olmo_tiny's initial weights against PyTorch (tests/make_fixtures.py downstream: 18
// examples of ids, both forms, contexts cut from the left, unconditioned contexts, texts of 1- to 4-byte characters):
// each row's log-likelihood within `rel` of the float64 one (relative, at least 1 absolute), on `device`; with
// `same_argmax`, OLMo's metrics equal the fixture's exactly (the same argmax on every example) and bpb within `rel`.
inline void check_downstream_against_fixture(trainer::Device device, double rel, const trainer::BackendOptions& options,
                                             bool same_argmax) {
    const TrainConfig config = fixture_config("olmo");
    const Json expected = Json::parse(test_util::read_file(fixture("downstream_tiny_expected.json")));
    auto backend = make_backend(device, options);
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    const std::string init = fixture("olmo_tiny_init.safetensors");
    const auto init_tensors = read_safetensors(init);
    load_initial_params(config, layout, *strategy, &init_tensors, init);
    const int batch = 5;  // rows split across batches, the last one short
    Model model(config, layout, backend.get(), strategy.get(), batch);
    const DownstreamTask task =
        read_downstream_task({fixture("downstream_tiny.jsonl")}, "fixture", 17, 90, nullptr, "ids only");
    REQUIRE(task.examples.size() == expected["metrics"]["examples"].get<size_t>());
    REQUIRE(task.pmi);
    REQUIRE(task.lengths);
    const std::vector<DownstreamRow> rows = downstream_rows(task, static_cast<int64_t>(task.examples.size()));
    REQUIRE(rows.size() == expected["rows"].size());
    int sig = 0;
    const std::vector<double> ll = score_downstream_rows(task, rows, model, *strategy, batch, 89, &sig);
    REQUIRE(sig == 0);
    REQUIRE(ll.size() == rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
        const Json& want = expected["rows"][r];
        CAPTURE(r, want.dump());
        REQUIRE(rows[r].example == want["example"].get<int64_t>());
        REQUIRE(rows[r].candidate == want["candidate"].get<int>());
        REQUIRE(rows[r].unconditioned == want["unconditioned"].get<bool>());
        const double ref = want["loglik"].get<double>();
        CHECK(std::fabs(ll[r] - ref) <= rel * std::max(1.0, std::fabs(ref)));
    }
    if (!same_argmax) return;
    const DownstreamMetrics m = downstream_metrics(task, rows, ll);
    const Json& em = expected["metrics"];
    CHECK(m.acc == em["acc"].get<double>());
    CHECK(m.len_norm == em["len_norm"].get<double>());
    CHECK(m.pmi_dc == em["pmi_dc"].get<double>());
    CHECK(std::fabs(m.bpb - em["bpb"].get<double>()) <= rel * em["bpb"].get<double>());
}

}  // namespace test_util
