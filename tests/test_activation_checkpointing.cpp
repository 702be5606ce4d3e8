// Activation checkpointing (OLMo's activation_checkpointing): every policy gives bitwise the loss and the
// gradients of keeping everything (the recompute runs the forward's kernels on the same inputs), in
// process for one rank on the OLMo, GPT-2 and OLMo-2 flavours, and through the binary under every strategy on 2 ranks;
// and the activation arena shrinks as each policy promises.
#include <algorithm>
#include <string>
#include <vector>

#include "base/layout.h"
#include "base/memory.h"
#include "core/data/data.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"
#include "test_util.h"

using namespace trainer;

namespace {

const std::vector<std::string> kPolicies = {"whole_layer",  "one_in_two",   "one_in_three",  "one_in_four",
                                            "one_in_eight", "two_in_three", "three_in_four", "fine_grained"};

enum class Flavour { kOlmo, kGpt2, kOlmo2 };

// The OLMo-2 block's keys as --set overrides (RMSNorm with weights after each sublayer, QK-norm, z-loss).
const std::vector<std::string> kOlmo2Sets = {
    "--set", "model.layer_norm_type=rms",     "--set", "model.layer_norm_with_affine=true",
    "--set", "model.norm_after=true",         "--set", "model.attention_layer_norm=true",
    "--set", "model.layer_norm_eps=1e-6",     "--set", "softmax_auxiliary_loss=true",
    "--set", "auxiliary_loss_multiplier=1e-3"};

// tiny.json with 5 blocks (so the one_in_N policies differ) on the fixture tokens; GPT-2 style (learned
// positions, affine LayerNorm, biases, tanh GELU: the fused GEMM + GELU and its recompute) or OLMo-2 style
// (the norms after the sublayers, whose statistics and inputs the recompute must rebuild, and QK-norm).
TrainConfig config_for(const std::string& policy, Flavour flavour) {
    Json doc = Json::parse(test_util::read_file(test_util::source_dir() + "/configs/tiny.json"));
    doc["model"]["n_layers"] = 5;
    if (flavour == Flavour::kGpt2) {
        doc["model"]["rope"] = false;
        doc["model"]["layer_norm_with_affine"] = true;
        doc["model"]["include_bias"] = true;
        doc["model"]["activation_type"] = "gelu_tanh";
    }
    if (flavour == Flavour::kOlmo2) {
        for (size_t i = 1; i < kOlmo2Sets.size(); i += 2) apply_override(doc, kOlmo2Sets[i]);
    }
    doc["data"]["paths"] = Json::array({test_util::fixture("olmo_tiny_tokens.u16")});
    if (policy != "null") doc["activation_checkpointing"] = policy;
    return validate_config(doc);
}

struct Pass {
    double loss = 0.0;
    std::vector<std::vector<float>> grads;  // per unit
    int64_t activation_bytes = 0;           // the model's arena and its token buffer
};

// One global batch (2 micro-batches of 4) through forward and backward on one rank.
Pass run_pass(const TrainConfig& config) {
    auto backend = make_backend(Device::kCpu);
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    load_initial_params(config, layout, *strategy, nullptr, "");
    const int64_t before = memory_snapshot().current[static_cast<int>(MemCategory::kActivations)];
    const long micro = config.device_train_microbatch_size, G = config.global_train_batch_size;
    const long L = config.model.max_sequence_length;
    Model model(config, layout, backend.get(), strategy.get(), static_cast<int>(micro));
    Pass p;
    p.activation_bytes = memory_snapshot().current[static_cast<int>(MemCategory::kActivations)] - before;
    TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
    std::vector<int32_t> tokens(micro * L);
    strategy->zero_grads();
    strategy->begin_step(static_cast<int>(G / micro));
    for (long k = 0; k < G / micro; ++k) {
        strategy->begin_micro_batch(static_cast<int>(k));
        for (long i = 0; i < micro; ++i) data.read_instance(k * micro + i, tokens.data() + i * L);
        p.loss += model.forward_backward(tokens.data(), static_cast<int>(micro), 1.0f / (G * (L - 1))).ce;
    }
    strategy->finish_backward();
    for (int u = 0; u < layout.num_units(); ++u) {
        p.grads.emplace_back(layout.units()[u].numel);
        backend->copy_device_to_host(p.grads[u].data(), strategy->unit_grads(u), p.grads[u].size() * sizeof(float));
    }
    return p;
}

}  // namespace

TEST_CASE("activation checkpointing: every policy gives bitwise the loss and gradients of null on one rank") {
    for (const Flavour flavour : {Flavour::kOlmo, Flavour::kGpt2, Flavour::kOlmo2}) {
        const Pass ref = run_pass(config_for("null", flavour));
        for (const std::string& policy : kPolicies) {
            CAPTURE(static_cast<int>(flavour), policy);
            const Pass got = run_pass(config_for(policy, flavour));
            CHECK(got.loss == ref.loss);
            for (size_t u = 0; u < ref.grads.size(); ++u) {
                CAPTURE(u);
                CHECK(got.grads[u] == ref.grads[u]);
            }
        }
    }
}

TEST_CASE("activation checkpointing: the activation arena shrinks as each policy keeps less") {
    for (const Flavour flavour : {Flavour::kOlmo, Flavour::kGpt2, Flavour::kOlmo2}) {
        const TrainConfig null_config = config_for("null", flavour);
        auto bytes = [&](const std::string& policy) { return run_pass(config_for(policy, flavour)).activation_bytes; };
        const int64_t null_b = bytes("null"), whole = bytes("whole_layer"), fine = bytes("fine_grained");
        const int64_t half = bytes("one_in_two"), eighth = bytes("one_in_eight");
        CAPTURE(static_cast<int>(flavour), null_b, whole, fine, half, eighth);
        // The blocks' share of the arena: what null keeps beyond the head and the backward scratch, which every
        // policy keeps alike. whole_layer keeps 5 inputs and one block's working set.
        CHECK(whole < half);
        CHECK(half < eighth);
        CHECK(whole < fine);
        CHECK(fine < null_b);
        if (flavour == Flavour::kOlmo) {
            // OLMo's norms have neither weight nor bias: their backward reads their outputs, so a block that keeps
            // everything keeps neither its input nor resid_mid (the forward passes them through two stream
            // buffers over the backward's scratch). Recomputing one block of 5 then costs what the recompute
            // needs beyond such a block: the block's input, and resid_mid in the shared work plan.
            const int64_t stream = static_cast<int64_t>(null_config.device_train_microbatch_size) *
                                   (null_config.model.max_sequence_length - 1) * null_config.model.d_model *
                                   static_cast<int64_t>(sizeof(float));
            CHECK(eighth - null_b == 2 * stream);
            // fine_grained keeps the norms' outputs too, and streams its input as null does: of a null block it
            // drops only the MLP activation, which the one shared work plan holds for the recompute (where the
            // head's logits chunk does not already cover it).
            const int64_t activation = static_cast<int64_t>(null_config.device_train_microbatch_size) *
                                       (null_config.model.max_sequence_length - 1) *
                                       null_config.model.ff_hidden_size() * static_cast<int64_t>(sizeof(float));
            CHECK(null_b - fine >= 4 * activation);
            CHECK(null_b - fine <= 5 * activation);
        } else {
            CHECK(eighth <= null_b);  // one block of 5 recomputed: what it frees, the shared work plan takes back
            // One block kept whole (null) against its input alone: whole_layer saves (L - 1) blocks' worth, less
            // the inputs it keeps.
            const int64_t per_block = (null_b - whole) / 4;
            CHECK(per_block > 0);
            CHECK(null_b - half >= 2 * per_block);  // one_in_two recomputes blocks 0, 2 and 4 (a shared work plan)
        }
    }
}

TEST_CASE("activation checkpointing: every policy under every strategy on 2 ranks matches null bitwise", "[heavy]") {
    test_util::TempDir dir;
    std::vector<std::vector<std::string>> strategies = {
        {"--strategy", "ddp"},
        {"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD", "--wrapping-strategy", "by_block"},
        {"--strategy", "fsdp", "--sharding-strategy", "SHARD_GRAD_OP", "--wrapping-strategy", "by_block_and_size"},
        {"--strategy", "fsdp", "--sharding-strategy", "NO_SHARD"},
        {"--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--wrapping-strategy", "by_block", "--set",
         "fsdp.hybrid_sharding_num_model_replicas=2"},
    };
    // The OLMo-2 block under the strategy that re-gathers each unit for its recompute.
    std::vector<std::string> olmo2 = {"--strategy",          "fsdp",    "--sharding-strategy", "FULL_SHARD",
                                      "--wrapping-strategy", "by_block"};
    olmo2.insert(olmo2.end(), kOlmo2Sets.begin(), kOlmo2Sets.end());
    strategies.push_back(olmo2);
    int run = 0;
    for (const auto& strategy : strategies) {
        std::vector<std::string> base = {"--config",       "configs/tiny.json",
                                         "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                         "--max-duration", "3",
                                         "--set",          "model.n_layers=5",
                                         "--set",          "device_train_microbatch_size=2",
                                         "--set",          "fsdp.precision=fp32"};
        base.insert(base.end(), strategy.begin(), strategy.end());
        auto launch = [&](const std::string& policy) {
            const std::string metrics = dir.path("m" + std::to_string(run++) + ".jsonl");
            std::vector<std::string> args = base;
            args.insert(args.end(), {"--metrics-file", metrics});
            if (policy != "null") args.insert(args.end(), {"--set", "activation_checkpointing=" + policy});
            const auto r = test_util::launch(2, args);
            INFO(strategy[1] << " " << (strategy.size() > 3 ? strategy[3] : "") << " " << policy << "\n"
                             << r.out << r.err);
            REQUIRE(r.exit_code == 0);
            return test_util::read_metrics(metrics);
        };
        const auto ref = launch("null");
        for (const std::string& policy : kPolicies) test_util::check_losses(ref, launch(policy), 0, 0.0);
    }
}

TEST_CASE("activation checkpointing: a checkpoint resumes under another policy with the same losses") {
    // The policy changes what the arena keeps, never the state: 4 steps under whole_layer with a checkpoint
    // at step 2, resumed under null (and a null run resumed under fine_grained), continue the losses of an
    // uninterrupted null run bit for bit.
    test_util::TempDir dir;
    auto args = [&](const std::string& policy, const std::string& name) {
        std::vector<std::string> a = {"--config",       "configs/tiny.json",
                                      "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                      "--max-duration", "4",
                                      "--set",          "activation_checkpointing=" + policy,
                                      "--metrics-file", dir.path(name + ".jsonl"),
                                      "--save-folder",  dir.path(name),
                                      "--set",          "save_interval=2"};
        return a;
    };
    auto ok = [](const test_util::RunResult& r) {
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
    };
    ok(test_util::run_trainer(args("null", "ref")));
    const auto ref = test_util::read_metrics(dir.path("ref.jsonl"));
    for (const auto& [first, second] : {std::pair<std::string, std::string>{"whole_layer", "null"},
                                        std::pair<std::string, std::string>{"null", "fine_grained"}}) {
        CAPTURE(first, second);
        const std::string name = first + "_then_" + second;
        auto a = args(first, name);
        a[5] = "2";  // stop at the checkpoint
        ok(test_util::run_trainer(a));
        auto b = args(second, name);
        b.insert(b.end(), {"--load-path", "latest"});
        ok(test_util::run_trainer(b));
        const auto got = test_util::read_metrics(dir.path(name + ".jsonl"));
        REQUIRE(got.size() == 4);
        test_util::check_losses(ref, got, 0, 0.0);
    }
}
