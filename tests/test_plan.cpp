// Dry runs (core/plan/dry_run.h): the peak memory a dry run of one step predicts, by category, is what the real
// run's accounting measures (rank 0 of the same world), under every strategy, precision, grad_sync mode,
// activation checkpointing policy and CPU offload; and the step's events are the ops and collectives the
// strategy issues; the time model overlaps and queues collectives as the strategy issues them; and `trainer
// plan` prints a dry run and a predicted step time per candidate configuration.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/config.h"
#include "base/files.h"
#include "base/layout.h"
#include "core/plan/auto.h"
#include "core/plan/dry_run.h"
#include "core/plan/host_memory.h"
#include "core/plan/plan.h"
#include "core/plan/step_parts.h"
#include "core/plan/step_time.h"
#include "test_util.h"

using namespace trainer;

namespace {

// tiny.json on the fixture tokens with `sets` applied ("key=value", as --set takes them), then `keys`.
TrainConfig tiny_with(const std::vector<std::string>& sets, const Json& keys = Json::object()) {
    Json doc = Json::parse(test_util::read_file(test_util::source_dir() + "/configs/tiny.json"));
    doc["data"]["paths"] = Json::array({test_util::fixture("olmo_tiny_tokens.u16")});
    for (const std::string& s : sets) apply_override(doc, s);
    for (const auto& [key, value] : keys.items()) set_config_value(doc, key, value);
    return validate_config(doc);
}

}  // namespace

TEST_CASE("dry run: predicted peak memory by category is the measured accounting") {
    test_util::TempDir dir;
    const std::vector<std::string> fsdp = {"distributed_strategy=fsdp", "fsdp.wrapping_strategy=by_block"};
    auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
        a.insert(a.end(), b.begin(), b.end());
        return a;
    };
    struct Case {
        int ranks;
        std::vector<std::string> sets;
        // Gloo's worker thread grows its reduce-scatter scratch when it runs the collective, which in a real run may
        // fall while a gather's buffer is alive (QLoRA's packed wires): the communication peak is then the dry
        // run's plus up to that scratch (4 KiB here), not equal.
        bool gloo_overlap = false;
    };
    const std::vector<Case> cases = {
        {1, {}},
        {1, {"activation_checkpointing=whole_layer"}},
        {1, {"cpu_offload.optimizer_state=true"}},
        {2, {"distributed_strategy=ddp"}},
        {2, {"distributed_strategy=ddp", "cpu_offload.optimizer_state=true", "activation_checkpointing=fine_grained"}},
        {2, fsdp},
        {2, with(fsdp, {"fsdp.grad_sync_mode=micro_batch"})},
        {2, with(fsdp, {"fsdp.precision=fp32", "activation_checkpointing=one_in_two"})},
        {2, with(fsdp, {"fsdp.precision=pure"})},
        {2, with(fsdp, {"cpu_offload.optimizer_state=true", "cpu_offload.parameters=true"})},
        {2,
         {"distributed_strategy=fsdp", "fsdp.sharding_strategy=SHARD_GRAD_OP",
          "fsdp.wrapping_strategy=by_block_and_size"}},
        {2, {"distributed_strategy=fsdp", "fsdp.sharding_strategy=NO_SHARD"}},
        {2,
         {"distributed_strategy=fsdp", "fsdp.sharding_strategy=HYBRID_SHARD", "fsdp.wrapping_strategy=by_block",
          "fsdp.hybrid_sharding_num_model_replicas=2"}},
        {1, fsdp},
        // save_async: the host snapshot each writing rank keeps for its checkpoints (all of it on one rank, a
        // shard each under FULL_SHARD).
        {1, {"save_interval=1"}},
        {2, with(fsdp, {"save_interval=1"})},
        // OLMo-2's block (the norms after the sublayers, QK-norm, the z-loss) with a recompute under FULL_SHARD.
        {2, with(fsdp, {"model.layer_norm_type=rms", "model.layer_norm_with_affine=true", "model.norm_after=true",
                        "model.attention_layer_norm=true", "softmax_auxiliary_loss=true",
                        "activation_checkpointing=one_in_two"})},
        // Grouped-query attention (att_proj's narrower output and its gradient in the arena) with the QK-norm's
        // narrower k, under FULL_SHARD with a recompute.
        {2, with(fsdp, {"model.n_kv_heads=1", "model.layer_norm_type=rms", "model.attention_layer_norm=true",
                        "activation_checkpointing=whole_layer"})},
        // LoRA: the frozen base (fp32 replicas, bf16-only FSDP shards, offloaded shards), the adapters' state and
        // scratch, dropout's row keys.
        {2, {"distributed_strategy=ddp", "lora.enabled=true", "lora.targets=[\"q_proj\",\"down_proj\"]"}},
        {2, with(fsdp, {"lora.enabled=true", "activation_checkpointing=whole_layer"})},
        {2, with(fsdp, {"lora.enabled=true", "cpu_offload.optimizer_state=true", "cpu_offload.parameters=true"})},
        // Under bf16 GEMMs (amp_fp8 here) the frozen Linear weights in bf16: a replica's unpacked copy (kept for the
        // next unit), FSDP's packed shards with fp32 parameters; NO_SHARD mixed's every parameter in bf16.
        {1, {"lora.enabled=true", "precision=amp_fp8"}},
        {2, {"distributed_strategy=ddp", "lora.enabled=true", "precision=amp_fp8"}},
        {2, with(fsdp, {"lora.enabled=true", "precision=amp_fp8", "fsdp.precision=fp32"}), true},
        {2,
         {"distributed_strategy=fsdp", "fsdp.sharding_strategy=NO_SHARD", "lora.enabled=true",
          "model.weight_tying=true"}},
        // QLoRA: NF4-packed frozen units (a replica unpacked a unit at a time; packed shards on the wire).
        {2, {"distributed_strategy=ddp", "lora.enabled=true", "lora.quantize=nf4"}},
        {2, with(fsdp, {"lora.enabled=true", "lora.quantize=nf4"}), true},
    };
    int k = 0;
    for (const Case& c : cases) {
        std::vector<std::string> sets = with(c.sets, {"device_train_microbatch_size=2", "max_duration=2"});
        if (std::find(sets.begin(), sets.end(), "save_interval=1") != sets.end())
            sets.push_back("save_folder=" + dir.path("ck" + std::to_string(k)));
        CAPTURE(c.ranks, sets);
        const std::string metrics = dir.path("m" + std::to_string(k++) + ".jsonl");
        std::vector<std::string> args = {"--config",       "configs/tiny.json",
                                         "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                         "--metrics-file", metrics};
        for (const std::string& s : sets) args.insert(args.end(), {"--set", s});
        const auto run = c.ranks == 1 ? test_util::run_trainer(args) : test_util::launch(c.ranks, args);
        INFO(run.out << run.err);
        REQUIRE(run.exit_code == 0);
        const Json measured = test_util::read_summary(metrics)["peak_memory_bytes_per_rank"][0];

        RankEnv env;
        env.world_size = env.local_world_size = c.ranks;
        const DryRunStep dry = dry_run_step(tiny_with(sets), env, Device::kCpu);
        for (int m = 0; m < kNumMemCategories; ++m) {
            const char* name = mem_category_name(static_cast<MemCategory>(m));
            CAPTURE(name);
            if (c.gloo_overlap && static_cast<MemCategory>(m) == MemCategory::kCommunication) {
                CHECK(measured[name].get<int64_t>() >= dry.peak[m]);
                CHECK(measured[name].get<int64_t>() <= dry.peak[m] + 8192);
                continue;
            }
            CHECK(dry.peak[m] == measured[name].get<int64_t>());
        }
        // The totals' high-water marks: the Gloo communicator grows its reduce-scatter buffer when its worker
        // thread runs the collective, so in a real run that allocation lands at a moment that varies against
        // the compute thread's (the dry run takes it when the collective is issued).
        const double total = measured["total"].get<double>();
        CHECK(std::abs(static_cast<double>(dry.total_peak) - total) <= 0.02 * total);
        CHECK(dry.host_peak == measured["host_total"].get<int64_t>());
    }
}

TEST_CASE("dry run: amp_bf16 on a GPU stores the activations only GEMMs read in bf16") {
    // The norms' outputs, qkv, attention's output, the MLP activation and (SwiGLU) the ff_proj output of every
    // block, the final norm's output, and the backward's gradients of qkv, attention's output, the ff_proj output
    // and the MLP activation (GemmOperand, kernels/backend.h) take half the floats of their 64-byte aligned slots;
    // the head's bf16 logits chunk shares the backward's slots as before; nothing else moves.
    RankEnv env;
    const TrainConfig fp32 = tiny_with({"device_train_microbatch_size=4", "precision=fp32"});
    const TrainConfig amp = tiny_with({"device_train_microbatch_size=4", "precision=amp_bf16"});
    auto activations = [&](const TrainConfig& c, Device d) {
        return dry_run_step(c, env, d).peak[static_cast<int>(MemCategory::kActivations)];
    };
    const ModelConfig& m = amp.model;
    const size_t N = static_cast<size_t>(std::max(amp.device_train_microbatch_size, amp.device_eval_batch_size)) *
                     (m.max_sequence_length - 1);
    REQUIRE(m.activation_type == ActivationType::kSwiglu);
    const size_t NC = N * m.d_model, NH = N * m.ff_hidden_size(), NP = N * m.ff_proj_size();
    auto slot = [](size_t floats) { return static_cast<int64_t>((floats + 15) / 16 * 16 * sizeof(float)); };
    auto saved = [&](size_t n) { return slot(n) - slot((n + 1) / 2); };
    const int64_t expected = m.n_layers * (3 * saved(NC) + saved(3 * NC) + saved(NH) + saved(NP)) + saved(NC) +
                             saved(3 * NC) + saved(NC) + saved(NP) + saved(NH);
    CHECK(activations(fp32, Device::kCuda) - activations(amp, Device::kCuda) == expected);
    // kernels.bf16_activations false keeps them in fp32 (cast per GEMM), as the CPU backend, the reference, does.
    const TrainConfig wide =
        tiny_with({"device_train_microbatch_size=4", "precision=amp_bf16", "kernels.bf16_activations=false"});
    CHECK(activations(wide, Device::kCuda) == activations(fp32, Device::kCuda));
    CHECK(activations(amp, Device::kCpu) == activations(fp32, Device::kCpu));
    CHECK(activations(fp32, Device::kCpu) == activations(fp32, Device::kCuda));
}

TEST_CASE("dry run: the events are the step's ops and collectives") {
    // DDP on 2 ranks, one micro-batch: every unit's gradients all-reduced once, the loss and the norm summed;
    // FULL_SHARD by_block: a reduce-scatter per FSDP unit and gathers around forward and backward.
    RankEnv env;
    env.world_size = env.local_world_size = 2;
    auto count = [](const DryRunStep& d, const std::string& what) {
        int n = 0;
        for (const StepEvent& e : d.events) n += e.what == what && e.kind != StepEvent::kWait ? 1 : 0;
        return n;
    };
    const TrainConfig ddp = tiny_with({"distributed_strategy=ddp", "device_train_microbatch_size=4"});
    const DryRunStep d = dry_run_step(ddp, env, Device::kCpu);
    int units = 0;  // with parameters (tiny's head, tied and without an affine norm, has none)
    const ParamLayout layout(ddp);
    for (const Unit& u : layout.units()) units += u.numel > 0 ? 1 : 0;
    CHECK(count(d, "all_reduce") == units + 1);  // + the loss (the norm is local for replicas)
    CHECK(count(d, "matmul_forward") > 0);
    CHECK(count(d, "adamw_update") > 0);
    double flops = 0.0;
    for (const StepEvent& e : d.events) flops += e.flops;
    CHECK(flops > 0.0);

    const TrainConfig fsdp =
        tiny_with({"distributed_strategy=fsdp", "fsdp.wrapping_strategy=by_block", "device_train_microbatch_size=4"});
    const DryRunStep f = dry_run_step(fsdp, env, Device::kCpu);
    CHECK(count(f, "reduce_scatter") == fsdp.model.n_layers + 1);  // the blocks and the root
    CHECK(count(f, "all_gather") >= 2 * fsdp.model.n_layers + 1);  // each block twice, the root once
    CHECK(count(f, "all_reduce") == 2);                            // the loss and the gradient norm
}

TEST_CASE("time model: collectives overlap later ops and queue on their communicator") {
    // Ops of 1 ms (1 GFLOP at 1 TFLOP/s), collectives of 1 ms (1 MB shards over 1 GB/s between 2 ranks).
    Hardware hw;
    hw.fp32_flops = 1e12, hw.bandwidth = 1e12, hw.gemm_efficiency = 1.0, hw.memory_efficiency = 1.0;
    hw.op_overhead = 0.0, hw.intra = {1e9, 0.0};
    const int a = 0, b = 0;  // two communicators
    auto op = [](double ms) {
        StepEvent e;
        e.what = "matmul_forward", e.flops = ms * 1e9;
        return e;
    };
    auto issue = [](uint64_t id, const void* channel) {
        StepEvent e;
        e.kind = StepEvent::kIssue, e.what = "all_gather", e.bytes = 1e6, e.group_size = 2, e.id = id;
        e.channel = channel;
        return e;
    };
    auto wait = [](uint64_t id) {
        StepEvent e;
        e.kind = StepEvent::kWait, e.id = id;
        return e;
    };
    DryRunStep step;
    // 1 ms op; a gather issued, 0.5 ms of ops beside it, then waited for: 0.5 ms exposed.
    step.events = {op(1.0), issue(1, &a), op(0.5), wait(1)};
    step.optimizer_begin = step.events.size();
    StepTime t = predict_step_time(step, hw, nullptr, false);
    CHECK(t.total == Approx(2.0e-3));
    CHECK(t.compute == Approx(1.5e-3));
    CHECK(t.exposed_comm == Approx(0.5e-3));
    // Two gathers on one communicator run one after the other; on two, side by side.
    step.events = {issue(2, &a), issue(3, &a), wait(3)};
    step.optimizer_begin = step.events.size();
    CHECK(predict_step_time(step, hw, nullptr, false).total == Approx(2.0e-3));
    step.events = {issue(4, &a), issue(5, &b), wait(4), wait(5)};
    step.optimizer_begin = step.events.size();
    CHECK(predict_step_time(step, hw, nullptr, false).total == Approx(1.0e-3));
    // On a CPU a collective shares the cores with the compute: at half the link's speed (2 ms), half of that
    // taken from the compute, so the op after the issue ends at 2 ms, with the collective.
    hw.comm_compute_share = 0.5;
    step.events = {issue(6, &a), op(1.0), wait(6)};
    step.optimizer_begin = 1;  // the op is the optimizer's
    t = predict_step_time(step, hw, nullptr, false);
    CHECK(t.total == Approx(2.0e-3));
    CHECK(t.optimizer == Approx(1.0e-3));
    step.events = {issue(7, &a), op(0.5), wait(7)};  // a shorter op: 1.5 ms, then the wait to 2 ms
    step.optimizer_begin = step.events.size();
    t = predict_step_time(step, hw, nullptr, false);
    CHECK(t.total == Approx(2.0e-3));
    CHECK(t.exposed_comm == Approx(1.5e-3));  // the issue's 1 ms of cycles and the 0.5 ms wait
    // A calibration entry replaces the roofline, scaled by the work and the step factor.
    Calibration cal;
    cal.entries.push_back({"matmul_forward", 2e9, 0.0, 4e-3});
    cal.step_scale = 1.5;
    step.events = {op(1.0)};
    step.optimizer_begin = 1;
    CHECK(predict_step_time(step, hw, &cal, false).total == Approx(1.5 * 2e-3));
}

TEST_CASE("time model: collectives across nodes that run at once share a node's link") {
    // A 1 MB all-gather of 2 ranks across nodes: 1 ms over a 1 GB/s link.
    Hardware hw;
    hw.inter = {1e9, 0.0};
    auto gather = [](int node_flows) {
        StepEvent issue;
        issue.kind = StepEvent::kIssue, issue.what = "all_gather", issue.bytes = 1e6, issue.group_size = 2;
        issue.id = 1, issue.spans_nodes = true, issue.node_flows = node_flows;
        StepEvent wait;
        wait.kind = StepEvent::kWait, wait.id = 1;
        DryRunStep step;
        step.events = {issue, wait};
        step.optimizer_begin = step.events.size();
        return step;
    };
    // A link a rank (GPU entries: a NIC a GPU): nothing shared.
    CHECK(predict_step_time(gather(2), hw, nullptr, false).total == Approx(1.0e-3));
    // One link a node: two of the node's groups at once take twice as long; two links carry them side by side.
    hw.inter_node_links = 1;
    CHECK(predict_step_time(gather(1), hw, nullptr, false).total == Approx(1.0e-3));
    CHECK(predict_step_time(gather(2), hw, nullptr, false).total == Approx(2.0e-3));
    hw.inter_node_links = 2;
    CHECK(predict_step_time(gather(2), hw, nullptr, false).total == Approx(1.0e-3));

    // Which groups those are, on 2 nodes of 2 ranks: HYBRID_SHARD's replica groups (one rank a node: two at once
    // on each node) and not its shards within the node or a group of every rank.
    RankEnv env;
    env.world_size = 4, env.local_world_size = 2;
    using Kinds = std::set<std::pair<int, int>>;  // the collectives' (group size, node_flows; 0: within a node)
    auto flows = [&](const std::vector<std::string>& sets) {
        Kinds kinds;
        for (const StepEvent& e : dry_run_step(tiny_with(sets), env, Device::kCpu).events) {
            if (e.kind == StepEvent::kIssue) kinds.insert({e.group_size, e.spans_nodes ? e.node_flows : 0});
        }
        return kinds;
    };
    CHECK(flows({"distributed_strategy=fsdp", "fsdp.sharding_strategy=HYBRID_SHARD",
                 "fsdp.hybrid_sharding_num_model_replicas=2"}) == Kinds{{2, 0}, {2, 2}, {4, 1}});
    CHECK(flows({"distributed_strategy=fsdp"}) == Kinds{{4, 1}});
    CHECK(flows({"distributed_strategy=ddp"}) == Kinds{{4, 1}});
}

TEST_CASE("time model: a GEMM op's fixed cost (FP8's at its peak) and attention's share by head size on Hopper") {
    // One op of each kind on the h100-sxm entry: the GEMM pays op_overhead and gemm_overhead beside its FLOPs at
    // the GEMM share, attention its FLOPs at the share for the model's heads, a memory-bound op its bytes.
    Hardware hw = *find_hardware("h100-sxm");
    REQUIRE(hw.gemm_overhead > 0.0);
    REQUIRE(hw.attention_efficiency_64 > 0.0);
    REQUIRE(hw.attention_efficiency_64 < hw.attention_efficiency);
    auto one = [&](const char* what, double flops, double bytes) {
        StepEvent e;
        e.what = what, e.flops = flops, e.bytes = bytes;
        DryRunStep step;
        step.events = {e};
        step.optimizer_begin = 1;
        return predict_step_time(step, hw, nullptr, true).total;
    };
    CHECK(one("matmul_forward", 1e11, 0.0) ==
          Approx(1e11 / (hw.bf16_flops * hw.gemm_efficiency) + hw.op_overhead + hw.gemm_overhead));
    CHECK(one("matmul_backward", 1e11, 0.0) == Approx(one("matmul_forward", 1e11, 0.0)));
    // amp_fp8's GEMMs at the entry's FP8 peak; their casts are memory-bound ops of their own.
    REQUIRE(hw.fp8_flops == Approx(2.0 * hw.bf16_flops).epsilon(1e-3));
    CHECK(one("matmul_fp8_forward", 1e11, 0.0) ==
          Approx(1e11 / (hw.fp8_flops * hw.gemm_efficiency) + hw.op_overhead + hw.gemm_overhead));
    CHECK(one("fp8_cast", 0.0, 1e9) == Approx(1e9 / (hw.bandwidth * hw.memory_efficiency) + hw.op_overhead));
    CHECK(one("gelu_forward", 0.0, 1e9) == Approx(1e9 / (hw.bandwidth * hw.memory_efficiency) + hw.op_overhead));
    CHECK(one("attention_forward", 1e11, 0.0) ==
          Approx(1e11 / (hw.bf16_flops * hw.attention_efficiency) + hw.op_overhead));
    // The attention share: the entry's at heads of 128 and above, its heads-of-64 share at 64 and below (not
    // extrapolated), geometric in between; an entry without a heads-of-64 share has one share.
    const double e128 = hw.attention_efficiency, e64 = hw.attention_efficiency_64;
    CHECK(attention_efficiency_at(hw, 128) == e128);
    CHECK(attention_efficiency_at(hw, 256) == e128);
    CHECK(attention_efficiency_at(hw, 64) == Approx(e64));
    CHECK(attention_efficiency_at(hw, 32) == Approx(e64));
    CHECK(attention_efficiency_at(hw, 96) == Approx(e128 * std::pow(e64 / e128, std::log2(128.0 / 96.0))));
    const Hardware a100 = *find_hardware("a100-40gb");
    CHECK(attention_efficiency_at(a100, 64) == a100.attention_efficiency);
    CHECK(a100.gemm_overhead == 0.0);
    // The plan takes the share for the config's heads; a hardware file whose two shares are one takes it at
    // every size.
    test_util::TempDir dir;
    const std::string flat128 = test_util::edited_hardware(
                          dir.path("flat128.json"), "h100-sxm",
                          {{"name", "flat128"}, {"attention_efficiency", e128}, {"attention_efficiency_64", e128}}),
                      flat64 = test_util::edited_hardware(
                          dir.path("flat64.json"), "h100-sxm",
                          {{"name", "flat64"}, {"attention_efficiency", e64}, {"attention_efficiency_64", e64}});
    auto compute_ms = [&](const std::string& hardware) {
        const std::vector<std::string> gpt2 = {"plan",
                                               "--all",
                                               "--config",
                                               "configs/gpt2_124m.json",
                                               "--device",
                                               "cuda",
                                               "--hardware",
                                               hardware,
                                               "--json",
                                               "--set",
                                               "precision=amp_bf16",
                                               "--set",
                                               "device_train_microbatch_size=16",
                                               "--set",
                                               "global_train_batch_size=16"};
        return test_util::config_row(gpt2, {})["predicted_compute_ms"].get<double>();
    };
    const double at64 = compute_ms("h100-sxm"), at128_share = compute_ms(flat128), at64_share = compute_ms(flat64);
    CHECK(at64 == Approx(at64_share).epsilon(1e-9));  // GPT-2's heads of 64 take the entry's heads-of-64 share
    CHECK(at64 > at128_share + 1.0);                  // ms: 12 layers of attention at 0.22 of the peak instead of 0.38
}

TEST_CASE("time model: CPU offload's copies queue on the host link and its optimizer runs at the host's bandwidth") {
    // Ops of 1 ms; copies of 1 MB over a 1 GB/s host link (1 ms); host ops of 2 MB at 1 GB/s (2 ms).
    Hardware hw;
    hw.fp32_flops = 1e12, hw.bandwidth = 1e12, hw.gemm_efficiency = 1.0, hw.memory_efficiency = 1.0;
    hw.op_overhead = 0.0, hw.host_link = {1e9, 0.0}, hw.host_bandwidth = 1e9;
    auto op = [](double ms) {
        StepEvent e;
        e.what = "matmul_forward", e.flops = ms * 1e9;
        return e;
    };
    auto host_op = [] {
        StepEvent e;
        e.what = "adamw_update", e.bytes = 2e6, e.on_host = true;
        return e;
    };
    auto copy = [](uint64_t ticket) {
        StepEvent e;
        e.kind = StepEvent::kCopy, e.what = "copy_async", e.bytes = 1e6, e.id = ticket;
        return e;
    };
    auto wait = [](uint64_t ticket) {
        StepEvent e;
        e.kind = StepEvent::kCopyWait, e.what = "host_wait", e.id = ticket;
        return e;
    };
    DryRunStep step;
    // The backward: a gradient copy down beside 0.5 ms of ops, then waited for (0.5 ms exposed); the
    // optimizer: the host's 2 ms, then the parameters' copy up, which the step waits for (1 ms). A wait for
    // a copy the step did not make (the previous step's upload) costs nothing.
    step.events = {wait(99), op(1.0), copy(1), op(0.5), wait(1)};
    step.optimizer_begin = step.events.size();
    step.events.push_back(host_op());
    step.events.push_back(copy(2));
    StepTime t = predict_step_time(step, hw, nullptr, false);
    CHECK(t.compute == Approx(1.5e-3));
    CHECK(t.exposed_comm == Approx(0.5e-3));
    CHECK(t.optimizer == Approx(3.0e-3));
    CHECK(t.total == Approx(5.0e-3));
    // Two copies share the one queue (the backend's copy stream): the second lands 2 ms after the issue.
    step.events = {copy(3), copy(4), wait(4)};
    step.optimizer_begin = step.events.size();
    CHECK(predict_step_time(step, hw, nullptr, false).total == Approx(2.0e-3));
    // Without a host link and host bandwidth (the CPU entry: host memory is the device's), a copy is a memory
    // op of the device (1 MB at 1 TB/s), its waits cost nothing, and the host ops cost what the device's do.
    hw.host_link = {}, hw.host_bandwidth = 0.0;
    step.events = {op(1.0), copy(5), wait(5)};
    step.optimizer_begin = step.events.size();
    step.events.push_back(host_op());
    t = predict_step_time(step, hw, nullptr, false);
    CHECK(t.total == Approx(1.0e-3 + 1e-6 + 2e-6));
    CHECK(t.exposed_comm == 0.0);
}

TEST_CASE("dry run: CPU offload on a GPU sends the gradients down and updates on the host and the parameters up") {
    // tiny.json alone on a GPU with its optimizer state offloaded: the device takes the gradients' norm,
    // the host updates each shard (AdamW: p, g, m, v read, p, m, v written: 28 bytes a parameter) as its
    // gradients come down (4 bytes a parameter over the link, the next shard's copy beside this shard's
    // update), and each unit's parameters go up on the same copy queue (4 bytes).
    const TrainConfig c = tiny_with({"cpu_offload.optimizer_state=true", "device_train_microbatch_size=4"});
    RankEnv env;
    const DryRunStep d = dry_run_step(c, env, Device::kCuda);
    const ParamLayout layout(c);
    int units = 0;
    for (const Unit& u : layout.units()) units += u.numel > 0 ? 1 : 0;
    int copies = 0, waits = 0;
    double host_bytes = 0.0;
    for (const StepEvent& e : d.events) {
        copies += e.kind == StepEvent::kCopy ? 1 : 0;
        waits += e.kind == StepEvent::kCopyWait ? 1 : 0;
        if (e.on_host) host_bytes += e.bytes;
    }
    CHECK(copies == 2 * units);  // each unit's gradients down (one chunk each) and parameters up
    CHECK(waits >= units);       // the host waits for each chunk of gradients
    const double P = static_cast<double>(layout.total_numel());
    CHECK(host_bytes == Approx(28.0 * P));
    Hardware hw = *find_hardware("h100-sxm");
    hw.op_overhead = 0.0;
    const double norm = 4.0 * P / (hw.bandwidth * hw.memory_efficiency);  // on the device
    // A link far faster than the host: the copies down hide behind the updates, and the time is the host's.
    hw.host_link = {1e15, 0.0}, hw.host_bandwidth = 1e9;
    CHECK(predict_step_time(d, hw, nullptr, false).optimizer == Approx(norm + 28.0 * P / 1e9).epsilon(1e-3));
    // A host far faster than the link: the time is the copies', every byte down and up.
    hw.host_link = {1e9, 0.0}, hw.host_bandwidth = 1e15;
    CHECK(predict_step_time(d, hw, nullptr, false).optimizer == Approx(norm + 8.0 * P / 1e9).epsilon(1e-3));
    // Without offload: no copy, nothing on the host.
    const DryRunStep plain = dry_run_step(tiny_with({"device_train_microbatch_size=4"}), env, Device::kCuda);
    for (const StepEvent& e : plain.events) {
        CHECK(e.kind != StepEvent::kCopy);
        CHECK(!e.on_host);
    }
}

TEST_CASE("plan: every candidate row is a dry run and --device-memory marks what fits") {
    // tiny.json on 2 ranks: the config's own row, then DDP and the FSDP modes with their variants; each row's
    // prediction is the dry run of its configuration, and the fits column follows the device peak. Op times
    // come from a calibration of this machine.
    test_util::TempDir dir;
    const std::string cal = dir.path("cal.json");
    const auto bench =
        test_util::run_trainer({"bench-kernels", "--config", "configs/tiny.json", "--set",
                                "device_train_microbatch_size=2", "--reps", "2", "--calibration-out", cal});
    INFO(bench.out << bench.err);
    REQUIRE(bench.exit_code == 0);
    const std::vector<std::string> base = {"plan",
                                           "--all",
                                           "--config",
                                           "configs/tiny.json",
                                           "--nproc-per-node",
                                           "2",
                                           "--set",
                                           "device_train_microbatch_size=2",
                                           "--set",
                                           "distributed_strategy=ddp",
                                           "--calibration",
                                           cal,
                                           "--json"};
    const auto r = test_util::run_trainer(base);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<Json> rows;
    std::stringstream ss(r.out);
    for (std::string line; std::getline(ss, line);) rows.push_back(Json::parse(line));
    REQUIRE(rows.size() > 10);
    CHECK(rows[0]["is_config"].get<bool>());
    RankEnv env;
    env.world_size = env.local_world_size = 2;
    int64_t smallest = INT64_MAX, largest = 0;
    bool saw_offload = false, saw_checkpointing = false;
    for (const Json& row : rows) {
        CAPTURE(row.dump());
        CHECK(row["fits"].is_null());
        CHECK(row["predicted_step_ms"].get<double>() > 0.0);
        CHECK(row["predicted_tokens_per_second_per_device"].get<double>() > 0.0);
        const DryRunStep dry =
            dry_run_step(tiny_with({"device_train_microbatch_size=2"}, row["config"]), env, Device::kCpu);
        CHECK(row["predicted_peak_bytes"]["total"].get<int64_t>() == dry.total_peak);
        CHECK(row["predicted_peak_bytes"]["activations"].get<int64_t>() ==
              dry.peak[static_cast<int>(MemCategory::kActivations)]);
        smallest = std::min(smallest, dry.total_peak);
        largest = std::max(largest, dry.total_peak);
        saw_offload |= row["config"]["cpu_offload.parameters"].get<bool>();
        saw_checkpointing |= row["config"]["activation_checkpointing"] == "whole_layer";
    }
    CHECK(saw_offload);
    CHECK(saw_checkpointing);
    // A device memory between the smallest and the largest peak: some rows fit, some do not.
    const double gib = (smallest + largest) / 2.0 / (1024.0 * 1024.0 * 1024.0);
    std::vector<std::string> args = base;
    args.insert(args.end(), {"--device-memory", std::to_string(gib)});
    const auto m = test_util::run_trainer(args);
    REQUIRE(m.exit_code == 0);
    int fit = 0, not_fit = 0;
    std::stringstream ms(m.out);
    for (std::string line; std::getline(ms, line);) {
        const Json row = Json::parse(line);
        const bool fits = row["fits"].get<bool>();
        CHECK(fits == (row["predicted_peak_bytes"]["total"].get<double>() <= gib * 1024.0 * 1024.0 * 1024.0));
        (fits ? fit : not_fit) += 1;
    }
    CHECK(fit > 0);
    CHECK(not_fit > 0);
}

TEST_CASE("plan: unknown hardware and a CPU plan without op times are refused") {
    const auto unknown =
        test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware", "tpu-v9"});
    CHECK(unknown.exit_code != 0);
    CHECK(unknown.err.find("plan --hardware tpu-v9: unknown; expected one of a10, a100-40gb, a100-40gb-pcie") !=
          std::string::npos);
    const auto cpu = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json"});
    CHECK(cpu.exit_code != 0);
    CHECK(cpu.err.find("needs --calibration FILE") != std::string::npos);
    // A GPU entry needs none: the rooflines of its spec sheet.
    const auto gpu =
        test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware", "a100-40gb"});
    INFO(gpu.out << gpu.err);
    CHECK(gpu.exit_code == 0);
    CHECK(gpu.out.find("hardware a100-40gb") != std::string::npos);
    // The same GPU without NVLink: its GPUs talk over PCIe at a tenth of the bus bandwidth.
    const auto pcie =
        test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware", "a100-40gb-pcie"});
    INFO(pcie.out << pcie.err);
    CHECK(pcie.exit_code == 0);
    CHECK(pcie.out.find("links within a node 20 GB/s, 15 us") != std::string::npos);
}

TEST_CASE("plan: a GPU's driver name picks its hardware entry and a GPU without one gets none") {
    // The names nvidia-smi and cudaGetDeviceProperties report.
    const std::vector<std::pair<const char*, const char*>> known = {
        {"NVIDIA H100 80GB HBM3", "h100-sxm"},       {"NVIDIA H200", "h200"},
        {"NVIDIA A100-SXM4-40GB", "a100-40gb"},      {"NVIDIA A100-SXM4-80GB", "a100-80gb"},
        {"NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"}, {"NVIDIA A10", "a10"},
        {"NVIDIA GeForce RTX 4090", "rtx-4090"}};
    for (const auto& [name, entry] : known) {
        CAPTURE(name);
        const Hardware* hw = hardware_for_gpu(name);
        REQUIRE(hw != nullptr);
        CHECK(hw->name == entry);
    }
    // Other rooflines, clocks or links than any entry's: none, rather than a wrong one.
    for (const char* name : {"NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100 80GB PCIe",
                             "NVIDIA L40S", "NVIDIA A10G", "NVIDIA GeForce RTX 4080"}) {
        CAPTURE(name);
        CHECK(hardware_for_gpu(name) == nullptr);
    }
}

TEST_CASE("plan: a hardware file copied and edited moves what its fields should") {
    // OLMo-1B under DDP with an all-reduce per micro-batch on 4 ranks of an A100 node: the link sets the
    // exposed communication, the GEMMs' share the compute.
    test_util::TempDir dir;
    const auto a100 = [&](const std::string& name, const Json& changes) {
        Json named = changes;
        named["name"] = name;
        return test_util::edited_hardware(dir.path(name + ".json"), "a100-40gb", named);
    };
    auto row = [&](const std::string& hardware, const std::vector<std::string>& extra = {}) {
        return test_util::config_row(
            test_util::olmo_1b_on_4_a100s({"--strategy", "ddp", "--set", "ddp.grad_sync_mode=micro_batch", "--set",
                                           "global_train_batch_size=16", "--set", "device_train_microbatch_size=2"},
                                          hardware),
            extra);
    };
    const Json entry = row("a100-40gb");
    const Json copy = row(a100("copy", Json::object()));
    CHECK(copy["predicted_step_ms"].get<double>() == entry["predicted_step_ms"].get<double>());
    const Json slow_link = row(a100("slow_link", {{"intra_node", {{"bandwidth_gbs", 0.5}, {"latency_us", 50}}}}));
    const Json slow_gemm = row(a100("slow_gemm", {{"gemm_efficiency", 0.1}}));
    CHECK(slow_link["predicted_compute_ms"].get<double>() ==
          Approx(entry["predicted_compute_ms"].get<double>()).epsilon(1e-9));
    CHECK(slow_link["predicted_exposed_comm_ms"].get<double>() >
          10 * entry["predicted_exposed_comm_ms"].get<double>() + 0.01);
    CHECK(slow_gemm["predicted_compute_ms"].get<double>() > 3 * entry["predicted_compute_ms"].get<double>());
    // The table's header says which links it used; plan.hardware takes a file as --hardware does.
    const std::string slow_inter = a100("slow_inter", {{"inter_node", {{"bandwidth_gbs", 3}, {"latency_us", 20}}}});
    const auto table = test_util::run_trainer(
        {"plan", "--all", "--config", "configs/tiny.json", "--set", "plan.hardware=" + slow_inter});
    INFO(table.out << table.err);
    CHECK(table.out.find("hardware slow_inter (") != std::string::npos);
    CHECK(table.out.find("links within a node 230 GB/s, 10 us, between nodes 3 GB/s, 20 us") != std::string::npos);
    // A bad field is refused naming the file and the field; an unknown name lists the entries.
    const auto bad = test_util::run_trainer(
        {"plan", "--all", "--config", "configs/tiny.json", "--hardware", a100("bad", {{"gemm_efficiency", 1.5}})});
    CHECK(bad.exit_code == 1);
    CHECK(bad.err.find("hardware file " + dir.path("bad.json") + ": gemm_efficiency: 1.5; expected a number in") !=
          std::string::npos);
    const auto unknown =
        test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware", "h300"});
    CHECK(unknown.exit_code == 1);
    CHECK(unknown.err.find("plan --hardware h300: unknown; expected one of a10, a100-40gb, a100-40gb-pcie, a100-80gb, "
                           "cpu, h100-sxm, h200, rtx-4090") != std::string::npos);
    const auto wrong_format = test_util::run_trainer(
        {"plan", "--all", "--config", "configs/tiny.json", "--hardware", a100("format", {{"format", 5}})});
    CHECK(wrong_format.exit_code == 1);
    CHECK(wrong_format.err.find("format.json: expected an object with \"format\": \"trainer-hardware\"") !=
          std::string::npos);
    const auto missing_field = test_util::run_trainer(
        {"plan", "--all", "--config", "configs/tiny.json", "--hardware", a100("missing", {{"memory_gib", nullptr}})});
    CHECK(missing_field.err.find("missing.json: memory_gib: required, not set") != std::string::npos);
    // CPU offload's side: the host link and the host's memory move the offloaded optimizer, nothing else.
    const std::vector<std::string> offload = {"--set", "cpu_offload.optimizer_state=true", "--set",
                                              "ddp.grad_sync_mode=batch"};
    const Json host = row("a100-40gb", offload);
    const std::string slow_host_file = a100(
        "slow_host", {{"host_memory_bandwidth_gbs", 1}, {"host_link", {{"bandwidth_gbs", 1}, {"latency_us", 10}}}});
    const Json slow_host = row(slow_host_file, offload);
    CHECK(slow_host["predicted_compute_ms"].get<double>() ==
          Approx(host["predicted_compute_ms"].get<double>()).epsilon(1e-9));
    CHECK(slow_host["predicted_optimizer_ms"].get<double>() > 20 * host["predicted_optimizer_ms"].get<double>());
    const auto host_table =
        test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware",
                                a100("host12", {{"host_link", {{"bandwidth_gbs", 12}, {"latency_us", 10}}}}), "--set",
                                "cpu_offload.optimizer_state=true"});
    INFO(host_table.out << host_table.err);
    CHECK(host_table.out.find("CPU offload: host link 12 GB/s, host memory 35.88 GB/s a rank") != std::string::npos);
}

TEST_CASE("plan: a world the config cannot split is refused with the reason") {
    // tiny.json's global batch of 8 does not split over 3 ranks of micro-batch 4, in any configuration.
    const auto r = test_util::run_trainer(
        {"plan", "--all", "--config", "configs/tiny.json", "--nproc-per-node", "3", "--hardware", "h100-sxm"});
    CHECK(r.exit_code != 0);
    CHECK(r.err.find("no configuration runs on 3 rank(s)") != std::string::npos);
    CHECK(r.err.find("global_train_batch_size 8 is not a multiple") != std::string::npos);
}

TEST_CASE("plan: distributed_strategy auto trains with the recommendation and shards what DDP cannot fit") {
    test_util::TempDir dir;
    const std::string cal = dir.path("cal.json");
    const auto bench = test_util::run_trainer(
        {"bench-kernels", "--config", "configs/tiny.json", "--threads", "1", "--reps", "2", "--calibration-out", cal});
    REQUIRE(bench.exit_code == 0);
    // tiny.json widened and deepened until its state, not its activations, decides what fits.
    const std::vector<std::string> common = {"--config", "configs/tiny.json", "--set", "model.d_model=128",
                                             "--set",    "model.n_layers=8",  "--set", "plan.calibration=" + cal};
    // The plan's rows on 2 ranks: the smallest peak of the replicas (DDP, NO_SHARD, with every lever) and of the
    // sharded configurations; a device memory between them leaves only sharded ones.
    std::vector<std::string> plan_args = {"plan", "--all", "--nproc-per-node", "2", "--json"};
    plan_args.insert(plan_args.end(), common.begin(), common.end());
    const auto plan = test_util::run_trainer(plan_args);
    INFO(plan.out << plan.err);
    REQUIRE(plan.exit_code == 0);
    double replica = 1e30, sharded = 1e30;
    std::stringstream ss(plan.out);
    for (std::string line; std::getline(ss, line);) {
        const Json row = Json::parse(line);
        const Json& c = row["config"];
        const bool shards = c["distributed_strategy"] == "fsdp" && c["fsdp.sharding_strategy"] != "NO_SHARD";
        double& low = shards ? sharded : replica;
        low = std::min(low, row["predicted_peak_bytes"]["total"].get<double>());
    }
    REQUIRE(sharded < replica);
    const double gib = (sharded + replica) / 2.0 / (1024.0 * 1024.0 * 1024.0);
    for (const bool limited : {false, true}) {
        CAPTURE(limited);
        const std::string metrics = dir.path(limited ? "limited.jsonl" : "free.jsonl");
        std::vector<std::string> args = {"--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                         "--max-duration", "2",
                                         "--strategy",     "auto",
                                         "--metrics-file", metrics};
        args.insert(args.end(), common.begin(), common.end());
        if (limited) args.insert(args.end(), {"--set", "plan.device_memory_gib=" + std::to_string(gib)});
        const auto r = test_util::launch(2, args);
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        CHECK(r.out.find(limited ? fmt::format("distributed_strategy auto (plan on cpu, {:.1f} GiB a device): ", gib)
                                 : "distributed_strategy auto (plan on cpu): ") != std::string::npos);
        CHECK(r.out.find("because the fastest predicted") != std::string::npos);
        // The run is the chosen configuration: its summary's memory is the plan's row's.
        const Json summary = test_util::read_summary(metrics);
        CHECK(summary["final_step"] == 2);
        if (limited) {
            const bool sharded_run = r.out.find("strategy fsdp FULL_SHARD") != std::string::npos ||
                                     r.out.find("strategy fsdp SHARD_GRAD_OP") != std::string::npos;
            CHECK(sharded_run);
            CHECK(summary["peak_memory_bytes"]["total"].get<double>() <= gib * 1024.0 * 1024.0 * 1024.0);
        }
    }
}

TEST_CASE("plan: kernels.cuda_graphs stays on the rows that can replay their micro-batches") {
    // The single strategy without offload replays; FSDP and offload rows run without graphs (the config checks
    // refuse them), so the plan turns the key off there rather than refusing the rows. On 2 ranks the config as
    // given (single) cannot run and the others carry no graphs.
    const std::vector<std::string> graphs = {"plan",     "--all",
                                             "--config", "configs/tiny.json",
                                             "--set",    "device_train_microbatch_size=2",
                                             "--set",    "plan.hardware=h100-sxm",
                                             "--set",    "kernels.cuda_graphs=true",
                                             "--json"};
    const auto rows = [&](const std::vector<std::string>& extra) { return test_util::plan_rows(graphs, extra); };
    int replaying = 0;
    for (const Json& row : rows({})) {
        CAPTURE(row["config"].dump());
        const Json& c = row["config"];
        const bool can = c["distributed_strategy"] == "single" && !c["cpu_offload.optimizer_state"].get<bool>();
        CHECK(c["kernels.cuda_graphs"].get<bool>() == can);
        replaying += can ? 1 : 0;
    }
    CHECK(replaying == 2);  // null and whole_layer checkpointing
    for (const Json& row : rows({"--nproc-per-node", "2"})) {
        CHECK_FALSE(row["is_config"].get<bool>());
        CHECK_FALSE(row["config"]["kernels.cuda_graphs"].get<bool>());
    }
}

TEST_CASE("plan: --host-memory marks the offload rows whose host state does not fit and auto plans by the node's") {
    // tiny.json on one CPU rank, its step times from the H100 entry (no calibration needed): the offload rows
    // need less device memory than the others, so a device memory between the two leaves only offload rows.
    const double kGiB = 1024.0 * 1024.0 * 1024.0;
    const std::vector<std::string> common = {
        "--config", "configs/tiny.json", "--set", "device_train_microbatch_size=2", "--set", "plan.hardware=h100-sxm"};
    const auto plan = [&](const std::vector<std::string>& extra) {
        std::vector<std::string> args = {"plan", "--all"};
        args.insert(args.end(), common.begin(), common.end());
        args.insert(args.end(), extra.begin(), extra.end());
        const auto r = test_util::run_trainer(args);
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        return r.out;
    };
    const auto rows = [](const std::string& out) {
        std::vector<Json> v;
        std::stringstream ss(out);
        for (std::string line; std::getline(ss, line);) v.push_back(Json::parse(line));
        return v;
    };
    double resident = 1e30, offloaded = 1e30, host = 1e30;
    for (const Json& row : rows(plan({"--json"}))) {
        const bool offload = row["config"]["cpu_offload.optimizer_state"].get<bool>();
        const double device = row["predicted_peak_bytes"]["total"].get<double>();
        (offload ? offloaded : resident) = std::min(offload ? offloaded : resident, device);
        if (offload) host = std::min(host, row["host_bytes_per_node"].get<double>());
        if (!offload) CHECK(row["host_bytes_per_node"].get<int64_t>() == 0);
    }
    REQUIRE(offloaded < resident);
    REQUIRE(host > 0.0);
    const std::string device_gib = std::to_string((offloaded + resident) / 2.0 / kGiB);
    const std::string host_gib = std::to_string(host / 2.0 / kGiB);
    // The host memory below every offload row's state: nothing fits, and the table says it is the host's.
    for (const Json& row : rows(plan({"--json", "--device-memory", device_gib, "--host-memory", host_gib}))) {
        CAPTURE(row.dump());
        CHECK_FALSE(row["fits"].get<bool>());
        CHECK_FALSE(row["recommended"].get<bool>());
    }
    const std::string table = plan({"--device-memory", device_gib, "--host-memory", host_gib});
    CHECK(table.find(" no (host) |") != std::string::npos);
    CHECK(table.find("GiB of host memory a node: the smallest, ") != std::string::npos);
    CHECK(table.find("GiB of host memory on a node > ") != std::string::npos);
    // Host memory enough: an offload row is recommended.
    bool offload_recommended = false;
    for (const Json& row : rows(plan({"--json", "--device-memory", device_gib, "--host-memory", "1000"}))) {
        if (row["recommended"].get<bool>())
            offload_recommended = row["config"]["cpu_offload.optimizer_state"].get<bool>();
    }
    CHECK(offload_recommended);
    // distributed_strategy auto takes the node's host memory (TRAINER_HOST_MEMORY_BYTES stands in for it):
    // where it is too small, auto refuses up front instead of choosing an offload the node cannot hold.
    test_util::TempDir dir;
    std::vector<std::string> train = {"--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                      "--max-duration", "1",
                                      "--strategy",     "auto",
                                      "--metrics-file", dir.path("m.jsonl"),
                                      "--set",          "plan.device_memory_gib=" + device_gib};
    train.insert(train.end(), common.begin(), common.end());
    const auto refused = test_util::run_trainer(train, {"TRAINER_HOST_MEMORY_BYTES=1000"});
    INFO(refused.out << refused.err);
    CHECK(refused.exit_code != 0);
    CHECK(refused.err.find("distributed_strategy auto: nothing fits in") != std::string::npos);
    CHECK(refused.err.find("of host memory on a node >") != std::string::npos);
    const auto chosen = test_util::run_trainer(train, {"TRAINER_HOST_MEMORY_BYTES=100000000000"});
    INFO(chosen.out << chosen.err);
    CHECK(chosen.exit_code == 0);
    CHECK(chosen.out.find(fmt::format("distributed_strategy auto (plan on h100-sxm, {:.1f} GiB a device): ",
                                      std::stod(device_gib))) != std::string::npos);
    CHECK(chosen.out.find("offload") != std::string::npos);
}

TEST_CASE("plan: op times measured by several ranks at once carry their sharing of the cores") {
    // A calibration of copies alone (every op at the copy speed), measured by one rank and by 4 ranks at once with
    // one thread each: for 4 one-thread ranks the first slows every op by the node's oversubscription, the second
    // already holds it.
    test_util::TempDir dir;
    auto file = [&](int ranks) {
        const std::string path = dir.path(fmt::format("cal_r{}.json", ranks));
        write_text_file(path,
                        fmt::format(R"({{"format": "trainer-calibration", "bandwidth": 1e10, "threads": 1,
                                        "ranks_per_node": {}, "ops": []}})",
                                    ranks),
                        "test calibration");
        return path;
    };
    const std::vector<std::string> args = {"plan",       "--config",  "configs/tiny.json",
                                           "--strategy", "ddp",       "--nproc-per-node",
                                           "4",          "--set",     "device_train_microbatch_size=2",
                                           "--set",      "threads=1", "--json"};
    const double alone = test_util::config_row(args, {"--calibration", file(1)})["predicted_compute_ms"].get<double>();
    const double together =
        test_util::config_row(args, {"--calibration", file(4)})["predicted_compute_ms"].get<double>();
    const double cores = std::max(1u, std::thread::hardware_concurrency());
    CHECK(alone / together == Approx(std::max(1.0, 4.0 / cores)).epsilon(1e-9));
    // Measured by 2 ranks of a 2-core machine, planned for a node of 1 core (a network lab's, on that machine):
    // the times hold no oversubscription of their own machine, so one rank on the node runs them as measured.
    const std::string two = dir.path("cal_two.json");
    write_text_file(two,
                    R"({"format": "trainer-calibration", "bandwidth": 1e10, "threads": 1, "ranks_per_node": 2,
                        "cores": 2, "ops": []})",
                    "test calibration");
    const std::string one_core =
        test_util::edited_hardware(dir.path("one_core.json"), "cpu", {{"name", "one_core"}, {"cores", 1}});
    const std::vector<std::string> lab = {"plan",       "--config",  "configs/tiny.json",
                                          "--strategy", "ddp",       "--nproc-per-node",
                                          "1",          "--set",     "device_train_microbatch_size=2",
                                          "--set",      "threads=1", "--json",
                                          "--hardware", one_core};
    const double on_two = test_util::config_row(lab, {"--calibration", two})["predicted_compute_ms"].get<double>();
    const double on_one = test_util::config_row(lab, {"--calibration", file(1)})["predicted_compute_ms"].get<double>();
    CHECK(on_two == Approx(on_one).epsilon(1e-9));
    const std::string bad = dir.path("bad.json");
    write_text_file(bad, R"({"format": "trainer-calibration", "ranks_per_node": 0, "ops": []})", "test calibration");
    const auto r = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--calibration", bad});
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("calibration " + bad + ": ranks_per_node: expected at least 1") != std::string::npos);
    // Fields of another type, a document that is not an object, an entry that is not one: refused by name.
    const struct {
        std::string text, error;
    } refused[] = {
        {R"({"format": "trainer-calibration", "bandwidth": "fast", "ops": []})",
         "bandwidth is \"fast\"; expected a number"},
        {R"({"format": "trainer-calibration", "threads": 1.5, "ops": []})", "threads is 1.5; expected an integer"},
        {R"({"format": "trainer-calibration", "cores": 1e30, "ops": []})", "cores is 1e+30; expected an integer"},
        {R"({"format": "trainer-calibration", "cores": 123456789012, "ops": []})",
         "cores: 123456789012; expected a count up to 2^24"},
        {R"({"format": ["trainer-calibration"], "ops": []})", "format is [\"trainer-calibration\"]; expected a string"},
        {R"([1, 2])", "not a file of trainer bench-kernels --calibration-out"},
        {R"({"format": "trainer-calibration", "ops": [3]})", "ops[0]: expected a JSON object, got 3"},
        {R"({"format": "trainer-calibration", "ops": [{"op": "x", "seconds": "1"}]})",
         "ops[0]: seconds is \"1\"; expected a number"},
    };
    for (const auto& c : refused) {
        CAPTURE(c.text);
        write_text_file(bad, c.text, "test calibration");
        const auto rr =
            test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--calibration", bad});
        CHECK(rr.exit_code == 1);
        CHECK(rr.err.find("calibration " + bad) != std::string::npos);
        CHECK(rr.err.find(c.error) != std::string::npos);
        CHECK(rr.err.find("json.exception") == std::string::npos);
    }
}

using Catch::Matchers::Contains;

TEST_CASE(
    "plan: the default output is one screen of the recommendation and each strategy's fastest and --all every row") {
    const std::vector<std::string> args = {
        "plan", "--config", "configs/olmo_1b.json", "--device", "cuda", "--nproc-per-node", "8"};
    const auto r = test_util::run_trainer(args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<std::string> lines;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    CHECK(lines.size() <= 25);
    size_t widest = 0, rows = 0;
    for (const std::string& line : lines) {
        widest = std::max(widest, line.size());
        rows += line.rfind("| ddp", 0) == 0 || line.rfind("| fsdp", 0) == 0 || line.rfind("| -> ", 0) == 0 ? 1 : 0;
    }
    CHECK(widest <= 160);
    CHECK_THAT(lines[0], Contains("52 configurations dry-run") && Contains("do not fit in"));
    CHECK_THAT(r.out, Contains("| -> ") && Contains("recommended: ") && Contains("--all"));
    for (const char* strategy : {"| ddp", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
        CHECK_THAT(r.out, Contains(strategy));
    CHECK(rows >= 4);
    CHECK(rows <= 12);
    std::vector<std::string> all = args;
    all.push_back("--all");
    const auto full = test_util::run_trainer(all);
    REQUIRE(full.exit_code == 0);
    size_t full_rows = 0;
    std::istringstream fin(full.out);
    for (std::string line; std::getline(fin, line);)
        full_rows += line.rfind("| ddp", 0) == 0 || line.rfind("| fsdp", 0) == 0 || line.rfind("| -> ", 0) == 0 ? 1 : 0;
    CHECK(full_rows == 52);
    CHECK_THAT(full.out, Contains("| gradients | optimizer state |"));
    for (const std::string& out : {r.out, full.out}) CHECK_THAT(out, Contains("where its predicted step goes ("));
}

TEST_CASE(
    "plan: a predicted step is split by the part of the step that runs each op and FP8 moves only its Linear layers") {
    // Each part holds the ops the model's spans put in it (core/plan/step_parts.h): together the compute's ops and
    // the optimizer's, so no less than the compute and no more than it and the optimizer step. amp_fp8 changes the
    // blocks' Linear layers alone (faster at the FP8 peak, their casts in them), every other part staying the same.
    std::map<std::string, std::map<std::string, double>> parts;  // precision -> part -> ms
    for (const char* precision : {"amp_bf16", "amp_fp8"}) {
        CAPTURE(precision);
        const auto r = test_util::run_trainer({"plan", "--config", "configs/olmo_1b.json", "--device", "cuda",
                                               "--nproc-per-node", "8", "--json", "--precision", precision});
        INFO(r.err);
        REQUIRE(r.exit_code == 0);
        int rows = 0;
        std::istringstream in(r.out);
        for (std::string line; std::getline(in, line);) {
            const trainer::Json row = trainer::Json::parse(line);
            double sum = 0.0;
            for (const auto& [part, ms] : row["predicted_parts_ms"].items()) {
                CHECK(std::find(trainer::step_part_order().begin(), trainer::step_part_order().end(), part) !=
                      trainer::step_part_order().end());
                CHECK(ms.get<double>() > 0.0);
                sum += ms.get<double>();
            }
            const double compute = row["predicted_compute_ms"].get<double>();
            CHECK(sum >= compute * (1 - 1e-9));
            CHECK(sum <= (compute + row["predicted_optimizer_ms"].get<double>()) * (1 + 1e-9));
            CHECK(sum <= row["predicted_step_ms"].get<double>() * (1 + 1e-9));
            const trainer::Json& c = row["config"];
            if (c["distributed_strategy"] == "ddp" && c["ddp.grad_sync_mode"] == "batch" &&
                c["activation_checkpointing"].is_null() && !c["cpu_offload.optimizer_state"].get<bool>()) {
                for (const auto& [part, ms] : row["predicted_parts_ms"].items()) parts[precision][part] = ms;
                ++rows;
            }
        }
        CHECK(rows == 1);
        const std::map<std::string, double>& p = parts[precision];
        // OLMo-1B: the GEMMs are most of the step, attention and the head a share each.
        CHECK(p.at("Linear layers") > p.at("attention") + p.at("head and loss"));
        CHECK(p.at("attention") > 0.0);
        CHECK(p.at("head and loss") > 0.0);
        CHECK(p.at("embedding") > 0.0);
        CHECK(p.at("optimizer") > 0.0);
    }
    for (const auto& [part, ms] : parts["amp_bf16"]) {
        CAPTURE(part);
        if (part == "Linear layers") {
            CHECK(parts["amp_fp8"].at(part) < 0.9 * ms);
        } else {
            CHECK(parts["amp_fp8"].at(part) == Approx(ms).epsilon(1e-12));
        }
    }
}

TEST_CASE("plan: each op is put in the part of the step its spans and its name say") {
    using trainer::StepSpan, trainer::step_part;
    const auto in = [](const char* category, const char* name) { return trainer::step_span(category, name); };
    CHECK(in("forward", "forward block.3") == StepSpan::kBlock);
    CHECK(in("recompute", "recompute block.12") == StepSpan::kBlock);
    CHECK(in("backward", "head forward+backward") == StepSpan::kHead);
    CHECK(in("forward", "forward head") == StepSpan::kHead);
    CHECK(in("backward", "backward embedding") == StepSpan::kEmbedding);
    CHECK(in("optimizer", "optimizer step") == StepSpan::kOptimizer);
    CHECK(in("micro-batch", "micro-batch 3") == StepSpan::kOther);
    CHECK(in("comm", "finish backward") == StepSpan::kOther);
    trainer::StepSpans spans;
    CHECK(spans.where() == StepSpan::kOther);
    spans.begin("micro-batch", "micro-batch 0");
    spans.begin("backward", "backward block.1");
    spans.begin("comm", "reduce_scatter");  // says nothing: the block's
    CHECK(spans.where() == StepSpan::kBlock);
    spans.end();
    spans.end();
    CHECK(spans.where() == StepSpan::kOther);
    for (const auto& [op, part] :
         std::vector<std::pair<const char*, const char*>>{{"matmul_fp8_backward", "Linear layers"},
                                                          {"fp8_cast", "Linear layers"},
                                                          {"matmul_residual_forward", "Linear layers"},
                                                          {"attention_backward", "attention"},
                                                          {"rope_forward", "attention"},
                                                          {"kv_heads_expand", "attention"},
                                                          {"lora_forward", "LoRA adapters"},
                                                          {"cast_bf16_to_float", "copies and casts"},
                                                          {"copy_device_to_device", "copies and casts"},
                                                          {"fill_zero", "copies and casts"},
                                                          {"swiglu_backward", "norms and pointwise ops"},
                                                          {"layernorm_forward", "norms and pointwise ops"},
                                                          {"qk_norm_forward", "norms and pointwise ops"}}) {
        CAPTURE(op);
        CHECK(step_part(StepSpan::kBlock, op) == part);
    }
    CHECK(step_part(StepSpan::kHead, "matmul_forward") == "head and loss");
    CHECK(step_part(StepSpan::kEmbedding, "embedding_backward") == "embedding");
    CHECK(step_part(StepSpan::kOptimizer, "fill_zero") == "optimizer");
    CHECK(step_part(StepSpan::kOther, "adamw_update_multi") == "optimizer");
    CHECK(step_part(StepSpan::kOther, "squared_norm_multi") == "optimizer");
    CHECK(step_part(StepSpan::kOther, "fill_zero") == "other");
    // Every place and op lands in one of the parts the tables print.
    for (const StepSpan where :
         {StepSpan::kOther, StepSpan::kEmbedding, StepSpan::kBlock, StepSpan::kHead, StepSpan::kOptimizer}) {
        for (const char* op : {"matmul_forward", "sum", "lora_backward", "embedding_forward", "unknown_op"})
            CHECK(trainer::step_part_index(where, op) < trainer::step_part_order().size());
    }
    CHECK(trainer::describe_step_parts({{"attention", 0.25}, {"Linear layers", 0.5}}, 1.0) ==
          "Linear layers 50.0%; attention 25.0%");
}
