// kernels.cuda_graphs on the CPU: a micro-batch's forward and backward recorded once and replayed (kernels/graph.h)
// by the recording backend (recording_backend.h), which refuses while recording what the CUDA backend refuses.
// Training through replays gives bitwise the losses, gradient norms and weights of the eager run, for the GPT-2,
// OLMo and OLMo-2 shapes and under activation checkpointing: every input of the recorded work is on the
// device and the same each time, and nothing the replays skip (the model's and the strategy's host code)
// matters. Also the runner's order (eager, recorded, replayed), recording again after memory is freed, and the
// error of a recording that needs the host. The config checks refuse graphs where they cannot run.
#include <memory>
#include <string>
#include <vector>

#include "base/layout.h"
#include "core/data/data.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "core/optimizer.h"
#include "kernels/backend.h"
#include "kernels/graph.h"
#include "model_check.h"
#include "parallel/launch/rank_env.h"
#include "parallel/setup.h"
#include "parallel/strategy/strategy.h"
#include "recording_backend.h"
#include "test_util.h"

using namespace trainer;
using test_util::fixture_config;
using test_util::RecordingBackend;

namespace {

struct Trained {
    std::vector<double> losses, grad_norms;
    std::vector<std::vector<float>> params;  // every unit's, after the last step
    long launches = 0, captures = 0;
};

// `steps` optimizer steps of 2 micro-batches of 2 instances each (different tokens every micro-batch), single
// strategy, on `backend`.
Trained train(const TrainConfig& config, Backend* backend, int steps) {
    const ParamLayout layout(config);
    const int L = config.model.max_sequence_length, micro = 2, accumulation = 2;
    TokenDataset data(config.data.paths, TokenDtype::kUint16, L, config.model.vocab_size);
    auto strategy = make_single_strategy(backend, layout);
    load_initial_params(config, layout, *strategy, nullptr, "");
    Model model(config, layout, backend, strategy.get(), micro);
    AdamW adamw(config, layout, backend);
    std::vector<int32_t> tokens(static_cast<size_t>(micro) * L);
    const float dloss_scale = 1.0f / static_cast<float>(micro * accumulation * (L - 1));
    Trained t;
    long next = 0;
    for (long step = 1; step <= steps; ++step) {
        const LossSums sums = accumulate_gradients(*strategy, model, accumulation, micro, dloss_scale, [&](long) {
            for (int i = 0; i < micro; ++i) {
                data.read_instance(next++ % data.num_instances(), tokens.data() + static_cast<size_t>(i) * L);
            }
            return MicroBatchTokens(tokens.data());
        });
        t.losses.push_back(sums.ce + sums.z);
        t.grad_norms.push_back(adamw.step(*strategy, step, steps).grad_norm);
    }
    for (int u = 0; u < layout.num_units(); ++u) {
        t.params.emplace_back(layout.units()[u].numel);
        strategy->before_forward(u);  // a packed frozen unit (LoRA's base) is widened while held
        backend->copy_device_to_host(t.params.back().data(), strategy->unit_params(u),
                                     t.params.back().size() * sizeof(float));
        strategy->after_forward(u);
    }
    t.launches = model.graphs().launches();
    t.captures = model.graphs().captures();
    return t;
}

}  // namespace

TEST_CASE("cuda graphs: training through recorded micro-batches is bitwise the eager run") {
    struct Case {
        const char* shape;
        ActivationCheckpointing ac;
    };
    for (const Case& c :
         {Case{"gpt2", ActivationCheckpointing::kNull}, Case{"olmo", ActivationCheckpointing::kNull},
          Case{"olmo2", ActivationCheckpointing::kNull}, Case{"olmo", ActivationCheckpointing::kWholeLayer},
          Case{"olmo", ActivationCheckpointing::kFineGrained}, Case{"olmo2", ActivationCheckpointing::kOneInTwo}}) {
        CAPTURE(c.shape, choice_name(c.ac));
        TrainConfig config = fixture_config(c.shape);
        config.activation_checkpointing = c.ac;
        const int steps = 3;
        auto plain = make_backend(Device::kCpu);
        const Trained eager = train(config, plain.get(), steps);
        config.kernels_cuda_graphs = true;
        RecordingBackend recording(make_backend(Device::kCpu));
        const Trained graphed = train(config, &recording, steps);
        CHECK(eager.launches == 0);
        // Micro-batch 1 eager, 2 recorded and launched, 3 to 6 launched: the weights changed twice since.
        CHECK(graphed.captures == 1);
        CHECK(graphed.launches == 2 * steps - 1);
        CHECK(recording.launches() == graphed.launches);
        CHECK(graphed.losses == eager.losses);
        CHECK(graphed.grad_norms == eager.grad_norms);
        CHECK(graphed.params == eager.params);
    }
}

TEST_CASE("cuda graphs: a LoRA base kept packed (bf16 under amp_fp8 and NF4) replays bitwise its eager run") {
    // The replica widens each packed unit into a buffer it keeps for the next one: the recording allocates nothing.
    for (const bool nf4 : {false, true}) {
        CAPTURE(nf4);
        Json doc = read_config_file(test_util::fixture("llama_tiny.json"));
        doc["data"]["paths"] = Json::array({test_util::fixture("llama_tiny_tokens.u16")});
        doc["lora"] = {{"enabled", true}, {"r", 4}, {"quantize", nf4 ? "nf4" : "none"}};
        if (!nf4) doc["precision"] = "amp_fp8";
        TrainConfig config = validate_config(doc);
        auto plain = make_backend(Device::kCpu);
        const Trained eager = train(config, plain.get(), 3);
        config.kernels_cuda_graphs = true;
        RecordingBackend recording(make_backend(Device::kCpu));
        const Trained graphed = train(config, &recording, 3);
        CHECK(graphed.captures == 1);
        CHECK(graphed.launches == 5);
        CHECK(graphed.losses == eager.losses);
        CHECK(graphed.grad_norms == eager.grad_norms);
        CHECK(graphed.params == eager.params);
    }
}

TEST_CASE("cuda graphs: the runner runs eagerly then records then replays and records again after memory is freed") {
    RecordingBackend backend(make_backend(Device::kCpu));
    float* x = static_cast<float*>(backend.alloc(4 * sizeof(float)));
    backend.fill_zero(x, 4 * sizeof(float));
    float* one = static_cast<float*>(backend.alloc(4 * sizeof(float)));
    const float ones[4] = {1, 1, 1, 1};
    backend.copy_host_to_device(one, ones, sizeof ones);
    GraphRunner runner(&backend, true);
    int bodies = 0;
    const auto body = [&] {
        ++bodies;
        backend.residual_forward(x, x, one, 4);  // x += 1 each time the work runs
    };
    const auto value = [&] {
        float h[4];
        backend.copy_device_to_host(h, x, sizeof h);
        return h[3];
    };
    runner.run(7, body);  // eager
    CHECK(value() == 1.0f);
    runner.run(7, body);  // recorded, then launched
    CHECK(value() == 2.0f);
    runner.run(7, body);  // launched: the body's host code does not run
    runner.run(7, body);
    CHECK(value() == 4.0f);
    CHECK(bodies == 2);
    CHECK(runner.captures() == 1);
    CHECK(runner.launches() == 3);
    // Another key is its own recording.
    runner.run(8, body);
    CHECK(bodies == 3);
    CHECK(value() == 5.0f);
    // Freeing memory drops the recordings: the next run of each key is eager, then recorded again.
    backend.free(backend.alloc(16));
    runner.run(7, body);
    runner.run(7, body);
    runner.run(7, body);
    CHECK(bodies == 5);
    CHECK(runner.captures() == 2);
    CHECK(value() == 8.0f);
    // Disabled, or on a backend that cannot record: always eager.
    GraphRunner off(&backend, false);
    auto cpu = make_backend(Device::kCpu);
    GraphRunner cannot(cpu.get(), true);
    CHECK_FALSE(off.enabled());
    CHECK_FALSE(cannot.enabled());
    for (int i = 0; i < 3; ++i) off.run(7, body);
    CHECK(bodies == 8);
    backend.free(one);
    backend.free(x);
}

TEST_CASE("cuda graphs: a recording that needs the host stops the run with what it needed") {
    RecordingBackend backend(make_backend(Device::kCpu));
    float* x = static_cast<float*>(backend.alloc(4 * sizeof(float)));
    backend.fill_zero(x, 4 * sizeof(float));
    GraphRunner runner(&backend, true);
    const auto body = [&] {
        backend.scale_inplace(x, 4, 2.0f);
        (void)backend.sum(x, 4);
    };
    runner.run(1, body);
    std::string message;
    try {
        runner.run(1, body);
    } catch (const UserError& e) {
        message = e.what();
    }
    CHECK(message.find("kernels.cuda_graphs") != std::string::npos);
    CHECK(message.find("a sum returned to the host while recording") != std::string::npos);
    // The backend is usable afterwards: nothing was recorded, nothing is being recorded.
    CHECK(backend.sum(x, 4) == 0.0);
    const auto allocating = [&] { backend.free(backend.alloc(8)); };
    GraphRunner second(&backend, true);
    second.run(2, allocating);
    CHECK_THROWS_WITH(second.run(2, allocating), Catch::Matchers::Contains("allocating device memory while recording"));
    backend.free(x);
}

TEST_CASE("cuda graphs: the config checks refuse graphs where they cannot run") {
    TrainConfig c = fixture_config("olmo");
    c.kernels_cuda_graphs = true;
    CHECK_THROWS_WITH(resolve_compute(c), Catch::Matchers::Contains("kernels.cuda_graphs records CUDA work"));
    RankEnv two;
    two.world_size = 2;
    two.local_world_size = 2;
    c.distributed_strategy = DistributedStrategy::kDdp;
    CHECK_THROWS_WITH(check_parallel_config(c, two, Device::kCuda),
                      Catch::Matchers::Contains("distributed_strategy \"ddp\" runs collectives"));
    c.distributed_strategy = DistributedStrategy::kSingle;
    c.cpu_offload.optimizer_state = true;
    CHECK_THROWS_WITH(check_parallel_config(c, RankEnv{}, Device::kCuda),
                      Catch::Matchers::Contains("kernels.cuda_graphs with cpu_offload"));
}
