// CPU offload (cpu_offload.optimizer_state, cpu_offload.parameters): on the CPU backend "host" and
// "device" are the same memory, but the offload path runs (host buffers, the copies down and up, AdamW
// through the host backend), so every strategy must give bitwise the losses, gradient norms and weights of
// the run without offload; checkpoints move between offloaded and resident runs and across rank counts;
// the memory summary moves the optimizer state (and the parameters) into the host categories; and the
// config checks refuse what cannot work before anything is allocated.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/plan/auto.h"
#include "core/plan/dry_run.h"
#include "core/plan/host_memory.h"
#include "core/plan/plan.h"
#include "test_util.h"

using namespace trainer;

namespace {

const std::string kOptimizer = "cpu_offload.optimizer_state=true";
const std::string kParameters = "cpu_offload.parameters=true";

std::vector<std::string> base_args(const std::string& metrics, const std::string& steps = "4") {
    return {"--config",       "configs/tiny.json",
            "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
            "--max-duration", steps,
            "--set",          "device_train_microbatch_size=2",
            "--metrics-file", metrics};
}

void require_ok(const test_util::RunResult& r) {
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
}

// Losses and gradient norms bitwise equal, step by step.
void check_same_steps(const std::vector<Json>& ref, const std::vector<Json>& got) {
    REQUIRE(got.size() == ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
        CAPTURE(i);
        CHECK(got[i]["step"] == ref[i]["step"]);
        CHECK(got[i]["loss"].get<double>() == ref[i]["loss"].get<double>());
        CHECK(got[i]["grad_norm"].get<double>() == ref[i]["grad_norm"].get<double>());
    }
}

}  // namespace

TEST_CASE("cpu offload: every strategy gives bitwise the losses of no offload") {
    test_util::TempDir dir;
    struct Case {
        int ranks;
        std::vector<std::string> strategy;
        bool parameters;  // also cpu_offload.parameters
    };
    const std::vector<std::string> full_shard = {"--strategy",          "fsdp",    "--sharding-strategy", "FULL_SHARD",
                                                 "--wrapping-strategy", "by_block"};
    std::vector<std::string> full_shard_fp32 = full_shard;
    full_shard_fp32.insert(full_shard_fp32.end(), {"--set", "fsdp.precision=fp32"});
    std::vector<std::string> micro_batch = full_shard;
    micro_batch.insert(micro_batch.end(), {"--set", "fsdp.grad_sync_mode=micro_batch"});
    const std::vector<Case> cases = {
        {1, {}, false},
        {2, {"--strategy", "ddp"}, false},
        {2, {"--strategy", "ddp", "--set", "ddp.grad_sync_mode=micro_batch"}, false},
        {2, {"--strategy", "fsdp", "--sharding-strategy", "NO_SHARD"}, false},
        {2, full_shard, false},
        {2, full_shard, true},
        {2, full_shard_fp32, true},
        {2, micro_batch, true},
        {1, full_shard, true},
        {1, full_shard_fp32, true},
        {2,
         {"--strategy", "fsdp", "--sharding-strategy", "SHARD_GRAD_OP", "--wrapping-strategy", "by_block_and_size"},
         true},
        {2,
         {"--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--wrapping-strategy", "by_block", "--set",
          "fsdp.hybrid_sharding_num_model_replicas=2"},
         true},
    };
    int run = 0;
    for (const Case& c : cases) {
        auto train = [&](const std::vector<std::string>& offload) {
            const std::string metrics = dir.path("m" + std::to_string(run++) + ".jsonl");
            std::vector<std::string> args = base_args(metrics);
            args.insert(args.end(), c.strategy.begin(), c.strategy.end());
            for (const std::string& o : offload) args.insert(args.end(), {"--set", o});
            const auto r = c.ranks == 1 ? test_util::run_trainer(args) : test_util::launch(c.ranks, args);
            INFO(r.out << r.err);
            REQUIRE(r.exit_code == 0);
            REQUIRE((offload.empty() || r.out.find("cpu offload:") != std::string::npos));
            return metrics;
        };
        CAPTURE(c.ranks, c.strategy, c.parameters);
        const std::string ref = train({});
        const std::string got = train(c.parameters ? std::vector<std::string>{kOptimizer, kParameters}
                                                   : std::vector<std::string>{kOptimizer});
        check_same_steps(test_util::read_metrics(ref), test_util::read_metrics(got));
        // Where the state went: the moments (and with `parameters` the shards) left the device.
        const Json mem = test_util::read_summary(got)["peak_memory_bytes"];
        const Json ref_mem = test_util::read_summary(ref)["peak_memory_bytes"];
        CAPTURE(mem.dump(), ref_mem.dump());
        CHECK(mem["optimizer_state"].get<int64_t>() == 0);
        CHECK(mem["host_optimizer_state"].get<int64_t>() == ref_mem["optimizer_state"].get<int64_t>());
        CHECK(mem["host_gradients"].get<int64_t>() > 0);
        CHECK(mem["host_parameters"].get<int64_t>() > 0);
        CHECK(mem["host_total"].get<int64_t>() > 0);
        CHECK(ref_mem["host_total"].get<int64_t>() == 0);
        if (c.parameters) CHECK(mem["parameters"].get<int64_t>() == 0);
    }
}

TEST_CASE("cpu offload: checkpoints resume with and without offload and across ranks") {
    // 4 steps with a checkpoint at 2, stopped there under one placement and resumed under another: the
    // losses, gradient norms and final weights are bitwise those of the same two legs without offload
    // (and, on the same ranks, of an uninterrupted run).
    test_util::TempDir dir;
    const std::vector<std::string> fsdp = {"--strategy", "fsdp",  "--wrapping-strategy",
                                           "by_block",   "--set", "fsdp.precision=fp32"};
    const std::vector<std::string> optimizer = {"--set", kOptimizer};
    const std::vector<std::string> both = {"--set", kOptimizer, "--set", kParameters};
    auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
        a.insert(a.end(), b.begin(), b.end());
        return a;
    };
    auto resident = [](const std::vector<std::string>& a) {  // the same arguments without the offload
        std::vector<std::string> out;
        for (size_t i = 0; i < a.size(); ++i) {
            if (a[i] == "--set" && i + 1 < a.size() && (a[i + 1] == kOptimizer || a[i + 1] == kParameters)) {
                ++i;
                continue;
            }
            out.push_back(a[i]);
        }
        return out;
    };
    struct Leg {
        int ranks;
        std::vector<std::string> extra;
    };
    // Two legs; returns the metrics rows and the final weights.
    auto two_legs = [&](const std::string& name, const Leg& first, const Leg& second) {
        auto args = [&](const Leg& leg, const std::string& steps) {
            std::vector<std::string> a = base_args(dir.path(name + ".jsonl"), steps);
            a.insert(a.end(), {"--save-folder", dir.path(name), "--set", "save_interval=2"});
            return with(a, leg.extra);
        };
        auto run = [&](int ranks, const std::vector<std::string>& a) {
            require_ok(ranks == 1 ? test_util::run_trainer(a) : test_util::launch(ranks, a));
        };
        run(first.ranks, args(first, "2"));
        run(second.ranks, with(args(second, "4"), {"--load-path", "latest"}));
        const auto rows = test_util::read_metrics(dir.path(name + ".jsonl"));
        REQUIRE(rows.size() == 4);
        return std::make_pair(rows, test_util::exported(dir.path(name + "/step4"), dir.path(name + ".safetensors")));
    };
    require_ok(test_util::launch(2, with(base_args(dir.path("ref.jsonl")), fsdp)));
    const auto uninterrupted = test_util::read_metrics(dir.path("ref.jsonl"));
    const std::vector<std::pair<Leg, Leg>> legs = {
        {{2, with(fsdp, both)}, {2, fsdp}},            // written offloaded, resumed resident
        {{2, fsdp}, {2, with(fsdp, both)}},            // and the other way
        {{2, with(fsdp, both)}, {1, optimizer}},       // resharded: FSDP on 2 ranks -> single, offloaded
        {{1, optimizer}, {2, with(fsdp, optimizer)}},  // single offloaded -> FSDP on 2 ranks
        {{2, {"--strategy", "ddp"}}, {1, optimizer}},  // DDP resident -> single offloaded
    };
    int n = 0;
    for (const auto& [first, second] : legs) {
        const std::string name = "leg" + std::to_string(n++);
        CAPTURE(name, first.extra, second.extra);
        const auto got = two_legs(name, first, second);
        const auto want =
            two_legs(name + "_resident", {first.ranks, resident(first.extra)}, {second.ranks, resident(second.extra)});
        check_same_steps(want.first, got.first);
        test_util::check_same_weights(want.second, got.second, 0.0);
        if (first.ranks == 2 && second.ranks == 2) check_same_steps(uninterrupted, got.first);
    }
}

TEST_CASE("cpu offload: bad combinations are refused before allocation") {
    test_util::TempDir dir;
    auto refused = [&](const std::vector<std::string>& extra, const std::vector<std::string>& env,
                       const std::string& expect) {
        std::vector<std::string> a = base_args(dir.path("m.jsonl"));
        a.insert(a.end(), extra.begin(), extra.end());
        const auto r = test_util::run_trainer(a, env);
        INFO(r.out << r.err);
        CHECK(r.exit_code != 0);
        CHECK(r.err.find(expect) != std::string::npos);
    };
    refused({"--set", kParameters}, {}, "cpu_offload.parameters: true needs cpu_offload.optimizer_state: true");
    refused({"--set", kOptimizer, "--set", kParameters}, {}, "needs distributed_strategy fsdp");
    refused({"--strategy", "fsdp", "--sharding-strategy", "NO_SHARD", "--set", kOptimizer, "--set", kParameters}, {},
            "NO_SHARD keeps full replicas");
    // tiny.json's state is ~0.6 MiB of parameters: 16 bytes each offloaded does not fit in 1 MB.
    refused({"--set", kOptimizer}, {"TRAINER_HOST_MEMORY_BYTES=1000000"}, "(cpu_offload's state ");
}

TEST_CASE("cpu offload: the host check reads a memory cgroup's limit under v1 and v2") {
    test_util::TempDir d;
    const std::string root = d.path() + "/sys", proc = d.path() + "/cgroup";
    auto write = [](const std::string& path, const std::string& text) {
        std::filesystem::create_directories(std::filesystem::path(path).parent_path());
        std::ofstream(path) << text;
    };
    // v2: "0::/path", memory.max - memory.current; "max" is no limit.
    write(proc, "0::/job.slice/step\n");
    write(root + "/job.slice/step/memory.max", "1000000\n");
    write(root + "/job.slice/step/memory.current", "400000\n");
    CHECK(cgroup_memory_left(proc, root) == 600000);
    CHECK(cgroup_memory(proc, root).limit == 1000000);  // what distributed_strategy auto plans the node by
    write(root + "/job.slice/step/memory.max", "max\n");
    CHECK(cgroup_memory_left(proc, root) == -1);
    // v1: the memory controller's line, limit_in_bytes - usage_in_bytes; ~2^63 is no limit.
    write(proc, "9:pids:/x\n4:cpu,memory:/docker/abc\n1:name=systemd:/\n");
    write(root + "/memory/docker/abc/memory.limit_in_bytes", "2000000\n");
    write(root + "/memory/docker/abc/memory.usage_in_bytes", "2500000\n");
    CHECK(cgroup_memory_left(proc, root) == 0);  // over the limit already: nothing left
    CHECK(cgroup_memory(proc, root).limit == 2000000);
    write(root + "/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
    CHECK(cgroup_memory_left(proc, root) == -1);
    // Nothing to read.
    CHECK(cgroup_memory_left(d.path() + "/missing", root) == -1);
}
