// FSDP against the single process: every wrap policy x sharding mode x grad_sync mode on 2, 3 and 4 ranks, each
// on a tied or an untied head (6 steps: losses to 1e-5 relative, final parameters to 1e-5), HYBRID_SHARD, and the bf16
// wire precisions (mixed, pure: within 1e-2 of fp32 and bitwise repeatable). Plus the wrap policies' units.
#include <cmath>
#include <filesystem>

#include "base/layout.h"
#include "parallel/strategy/wrap_policy.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::exported;
using test_util::launch;
using test_util::read_metrics;
using test_util::run_trainer;
using test_util::TempDir;

namespace {

std::vector<std::vector<int>> groups_for(const std::string& policy, int n_layers, bool tied, int group_size = 1,
                                         long min_params = 100000000) {
    Json doc = Json::parse(test_util::read_file(test_util::source_dir() + "/configs/tiny.json"));
    doc["model"]["n_layers"] = n_layers;
    doc["model"]["weight_tying"] = tied;
    TrainConfig c = validate_config(doc);
    c.fsdp.wrapping_strategy = parse_choice<WrappingStrategy>(policy).value();
    c.fsdp.block_group_size = group_size;
    c.fsdp.min_num_params = min_params;
    return fsdp_unit_groups(ParamLayout(c), c.fsdp);
}

using G = std::vector<std::vector<int>>;

// The model of the matrix: tiny.json with 5 blocks (so every one_in_N and block group differs), 6 steps of
// 24 sequences in micro-batches of 2 (6, 4 and 3 accumulation steps on 2, 3 and 4 ranks).
enum class Flavour { kOlmoTied, kOlmoUntied, kGpt2 };

std::vector<std::string> matrix_base(Flavour f) {
    std::vector<std::string> a = {"--config",       "configs/tiny.json",
                                  "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                  "--max-duration", "6",
                                  "--set",          "model.n_layers=5",
                                  "--set",          "model.d_model=32",
                                  "--set",          "global_train_batch_size=24",
                                  "--set",          "device_train_microbatch_size=2",
                                  "--set",          "save_interval=0",
                                  "--threads",      "1"};
    // One thread in the single process and in every rank: the CPU GEMMs' tiles follow a run's starting thread count
    // (kernels/cpu/ops.h: gemm_partition), and a 2-thread reference against 1-thread ranks added its last-bit
    // differences to the reduction order's (HYBRID_SHARD's GPT-2 run on OpenBLAS's Zen kernels under the sanitizers:
    // an attention bias 1.2x past the 1e-5 tolerance; on one thread each, 0.6x).
    // kOlmoTied is OLMo-1B's shape: tied head, parameter-free norms (the head unit holds nothing).
    // kOlmoUntied: the LM head is its own unit (OLMo-7B's shape). kGpt2: tied, affine norms, biases, wpe.
    std::vector<const char*> sets;
    if (f == Flavour::kOlmoUntied) sets = {"model.weight_tying=false"};
    if (f == Flavour::kGpt2) {
        sets = {"model.include_bias=true", "model.layer_norm_with_affine=true", "model.rope=false",
                "model.activation_type=gelu"};
    }
    for (const char* s : sets) a.insert(a.end(), {"--set", s});
    return a;
}

std::vector<std::string> with_out(std::vector<std::string> a, const std::string& dir) {
    a.insert(a.end(), {"--metrics-file", dir + "/m.jsonl", "--save-folder", dir + "/ck"});
    return a;
}

struct Reference {
    std::vector<Json> losses;
    std::map<std::string, Tensor> weights;
};

Reference single_run(const std::vector<std::string>& base, const std::string& dir) {
    const auto r = run_trainer(with_out(base, dir));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    return {read_metrics(dir + "/m.jsonl"), exported(dir + "/ck/step6", dir + ".safetensors")};
}

// The largest parameter difference over the whole model, relative to the model's largest magnitude.
double model_relative_error(const std::map<std::string, Tensor>& ref, const std::map<std::string, Tensor>& got) {
    double max_abs = 0, max_err = 0;
    for (const auto& [name, t] : ref) {
        const std::vector<float>& g = got.at(name).data;
        REQUIRE(g.size() == t.data.size());
        for (size_t i = 0; i < g.size(); ++i) {
            max_abs = std::max(max_abs, static_cast<double>(std::fabs(t.data[i])));
            max_err = std::max(max_err, static_cast<double>(std::fabs(t.data[i] - g[i])));
        }
    }
    return max_err / max_abs;
}

// Launches `world` ranks with `extra` flags and checks losses and final weights against `ref` to `rel`:
// fp32 runs per tensor (check_same_weights); bf16 runs (rel > 1e-5) over the whole model, since AdamW moves
// a small tensor (a bias) by as much as a large one and bf16 rounding shows there in relative terms.
void check_run(const Reference& ref, const std::vector<std::string>& base, const std::vector<std::string>& extra,
               int world, const std::string& dir, double rel = 1e-5) {
    auto args = with_out(base, dir);
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = launch(world, args);
    std::string what;
    for (const auto& e : extra) what += e + " ";
    INFO("world " << world << ": " << what << "\n" << r.out << r.err);
    REQUIRE(r.exit_code == 0);
    test_util::check_losses(ref.losses, read_metrics(dir + "/m.jsonl"), 0, rel);
    const auto got = exported(dir + "/ck/step6", dir + ".safetensors");
    if (rel <= 1e-5) {
        test_util::check_same_weights(ref.weights, got, rel);
    } else {
        CHECK(model_relative_error(ref.weights, got) <= rel);
    }
}

}  // namespace

TEST_CASE("fsdp: wrap policies group the units as OLMo does") {
    // Units: 0 embedding, 1..5 blocks, 6 head.
    CHECK(groups_for("null", 5, true) == G{{0, 1, 2, 3, 4, 5, 6}});
    CHECK(groups_for("by_block", 5, true) == G{{0, 6}, {1}, {2}, {3}, {4}, {5}});
    // Tied: the head unit is ln_f alone and stays in the root; untied it holds ff_out and is wrapped.
    CHECK(groups_for("by_block_and_size", 5, true) == G{{6}, {0}, {1}, {2}, {3}, {4}, {5}});
    CHECK(groups_for("by_block_and_size", 5, false) == G{{}, {0}, {1}, {2}, {3}, {4}, {5}, {6}});
    CHECK(groups_for("by_block_group", 5, true, 2) == G{{0, 6}, {1, 2}, {3, 4}, {5}});
    CHECK(groups_for("by_block_group_and_size", 5, false, 3) == G{{}, {0}, {1, 2, 3}, {4, 5}, {6}});
    CHECK(groups_for("one_in_two", 5, true) == G{{0, 2, 4, 6}, {1}, {3}, {5}});
    CHECK(groups_for("one_in_three", 5, true) == G{{0, 2, 3, 5, 6}, {1}, {4}});
    CHECK(groups_for("one_in_five", 5, true) == G{{0, 2, 3, 4, 5, 6}, {1}});
    // size_based (PyTorch's recursion over the units): tiny.json blocks hold 4 * 64^2 + 64 * 512 + 256 * 64 =
    // 65536 parameters, the embedding 320 * 64 = 20480.
    CHECK(groups_for("size_based", 5, true, 1, 60000) == G{{0, 6}, {1}, {2}, {3}, {4}, {5}});
    CHECK(groups_for("size_based", 5, true, 1, 100000) == G{{0, 6}, {1, 2, 3, 4, 5}});
    CHECK(groups_for("size_based", 5, true, 1, 20000) == G{{6}, {0}, {1}, {2}, {3}, {4}, {5}});
    CHECK(groups_for("size_based", 5, true, 1, 1000000) == G{{0, 1, 2, 3, 4, 5, 6}});
    CHECK_THROWS_WITH(groups_for("by_block_group", 5, true, 1),
                      Contains("\"by_block_group\" needs fsdp.block_group_size > 1"));
}

TEST_CASE("fsdp: every wrap policy sharding mode and grad_sync mode on 2 3 and 4 ranks matches the single process",
          "[heavy]") {
    TempDir dir;
    const std::vector<std::string> policies = {
        "null",       "by_block",   "by_block_and_size", "by_block_group", "by_block_group_and_size",
        "size_based", "one_in_two", "one_in_three",      "one_in_four",    "one_in_five"};
    // Half the 2 x 10 x 2 x 2 combinations of flavour, policy, sharding and grad_sync mode, chosen so that each
    // (policy, sharding, mode) runs once, on one of the two flavours, and each flavour meets every policy in both
    // sharding and both grad_sync modes and every (sharding, mode) pair: 40 runs where all 80 took 83 s of the suite.
    int run = 0;
    for (bool tied : {true, false}) {
        const auto base = matrix_base(tied ? Flavour::kOlmoTied : Flavour::kOlmoUntied);
        const Reference ref = single_run(base, dir.path(tied ? "single_tied" : "single_untied"));
        for (size_t p = 0; p < policies.size(); ++p) {
            const std::string& policy = policies[p];
            for (const std::string sharding : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
                for (const std::string mode : {"batch", "micro_batch"}) {
                    if ((p + (sharding == "FULL_SHARD") + (mode == "batch") + tied) % 2 != 0) continue;
                    // Every combination runs on one world size; the sizes rotate so each policy meets 2, 3 and 4.
                    const int world = 2 + run % 3;
                    std::vector<std::string> extra = {"--strategy",
                                                      "fsdp",
                                                      "--sharding-strategy",
                                                      sharding,
                                                      "--set",
                                                      "fsdp.precision=fp32",
                                                      "--set",
                                                      "fsdp.grad_sync_mode=" + mode,
                                                      "--set",
                                                      "fsdp.block_group_size=2",
                                                      "--set",
                                                      "fsdp.min_num_params=30000"};
                    if (policy != "null") extra.insert(extra.end(), {"--wrapping-strategy", policy});
                    // Untied runs alternate the prefetch knobs, so both settings of each are covered.
                    if (!tied && run % 2 == 1) {
                        extra.insert(extra.end(),
                                     {"--set", "fsdp.forward_prefetch=false", "--set", "fsdp.limit_all_gathers=false"});
                    }
                    check_run(ref, base, extra, world,
                              dir.path("run" + std::to_string(tied) + "_" + std::to_string(run)));
                    ++run;
                }
            }
        }
    }
}

TEST_CASE("fsdp: HYBRID_SHARD and NO_SHARD match the single process and HYBRID replicas past the first write nothing") {
    TempDir dir;
    const auto base = matrix_base(Flavour::kGpt2);
    const Reference ref = single_run(base, dir.path("single"));
    int run = 0;
    for (const std::string mode : {"batch", "micro_batch"}) {
        // 4 ranks as 2 replicas of 2 shards; 4 replicas of 1 (shard groups of one); NO_SHARD on 3.
        const std::string out = dir.path("hybrid" + std::to_string(run++));
        check_run(ref, base,
                  {"--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--wrapping-strategy", "by_block",
                   "--set", "fsdp.precision=fp32", "--set", "fsdp.hybrid_sharding_num_model_replicas=2", "--set",
                   "fsdp.grad_sync_mode=" + mode},
                  4, out);
        CHECK(std::filesystem::exists(out + "/ck/step6/rank1.bin"));
        CHECK_FALSE(std::filesystem::exists(out + "/ck/step6/rank2.bin"));
        check_run(ref, base,
                  {"--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--set", "fsdp.precision=fp32", "--set",
                   "fsdp.hybrid_sharding_num_model_replicas=4", "--set", "fsdp.grad_sync_mode=" + mode},
                  4, dir.path("hybrid" + std::to_string(run++)));
        check_run(ref, base,
                  {"--strategy", "fsdp", "--sharding-strategy", "NO_SHARD", "--set", "fsdp.precision=fp32", "--set",
                   "fsdp.grad_sync_mode=" + mode},
                  3, dir.path("noshard" + std::to_string(run++)));
    }
}

TEST_CASE("fsdp: HYBRID_SHARD over two launcher nodes shards within each node and replicates across them") {
    TempDir dir;
    const auto base = matrix_base(Flavour::kOlmoTied);
    const Reference ref = single_run(base, dir.path("single"));
    // Two `trainer launch` nodes of 2 ranks on this machine: replicas default to one per node.
    const std::string out = dir.path("nodes");
    std::vector<std::string> args = with_out(base, out);
    args.insert(args.end(), {"--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--wrapping-strategy",
                             "by_block", "--set", "fsdp.precision=fp32"});
    test_util::launch_nodes(2, 2, args, dir.path("node"));
    test_util::check_losses(ref.losses, read_metrics(out + "/m.jsonl"));
    test_util::check_same_weights(ref.weights, exported(out + "/ck/step6", out + ".safetensors"));
    // Node 0's two ranks hold the shards; node 1's replicas write nothing.
    CHECK(std::filesystem::exists(out + "/ck/step6/rank1.bin"));
    CHECK_FALSE(std::filesystem::exists(out + "/ck/step6/rank2.bin"));
}

TEST_CASE("fsdp: mixed and pure precision stay within 1e-2 of fp32 and repeat bitwise", "[heavy]") {
    TempDir dir;
    const auto base = matrix_base(Flavour::kGpt2);
    const Reference ref = single_run(base, dir.path("single"));
    const std::vector<std::vector<std::string>> strategies = {
        {"--sharding-strategy", "FULL_SHARD", "--wrapping-strategy", "by_block"},
        {"--sharding-strategy", "SHARD_GRAD_OP", "--wrapping-strategy", "by_block_and_size"},
        {"--sharding-strategy", "NO_SHARD"},
        {"--sharding-strategy", "HYBRID_SHARD", "--set", "fsdp.hybrid_sharding_num_model_replicas=2"},
    };
    int run = 0;
    for (const auto& s : strategies) {
        for (const std::string precision : {"mixed", "pure"}) {
            std::vector<std::string> extra = {"--strategy", "fsdp", "--set", "fsdp.precision=" + precision};
            extra.insert(extra.end(), s.begin(), s.end());
            const int world = s[1] == "HYBRID_SHARD" ? 4 : 2;
            const std::string a = dir.path("p" + std::to_string(run++)), b = dir.path("p" + std::to_string(run++));
            check_run(ref, base, extra, world, a, 1e-2);
            check_run(ref, base, extra, world, b, 1e-2);
            // Run to run: bitwise the same losses, and bf16 really changed something against fp32.
            const auto la = read_metrics(a + "/m.jsonl"), lb = read_metrics(b + "/m.jsonl");
            bool differs_from_fp32 = false;
            for (size_t i = 0; i < la.size(); ++i) {
                CHECK(la[i]["loss"].get<double>() == lb[i]["loss"].get<double>());
                CHECK(la[i]["grad_norm"].get<double>() == lb[i]["grad_norm"].get<double>());
                differs_from_fp32 |= la[i]["loss"].get<double>() != ref.losses[i]["loss"].get<double>();
            }
            CHECK(differs_from_fp32);
        }
    }
}

TEST_CASE("fsdp: memory: FULL_SHARD on 4 ranks of cpu_bench keeps a quarter of the DDP state plus two units",
          "[heavy]") {
    TempDir dir;
    const std::string tokens = dir.path("tokens.bin");
    REQUIRE(run_trainer({"prepare-data", test_util::source_dir() + "/README.md",
                         test_util::source_dir() + "/docs/gpus.md", "-o", tokens})
                .exit_code == 0);
    const std::vector<std::string> base = {"--config",       "configs/cpu_bench.json",
                                           "--data",         tokens,
                                           "--max-duration", "2",
                                           "--set",          "device_train_microbatch_size=2",
                                           "--set",          "model.max_sequence_length=64"};
    auto run = [&](const std::string& name, std::vector<std::string> extra) {
        auto args = base;
        args.insert(args.end(), {"--metrics-file", dir.path(name + ".jsonl")});
        args.insert(args.end(), extra.begin(), extra.end());
        const auto r = launch(4, args);
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        return test_util::read_summary(dir.path(name + ".jsonl"))["peak_memory_bytes_per_rank"];
    };
    const Json ddp = run("ddp", {"--strategy", "ddp"});
    const Json fs = run("fs", {"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD", "--wrapping-strategy",
                               "by_block_and_size", "--set", "fsdp.precision=fp32"});
    // The two largest FSDP units of cpu_bench: the tied embedding (50304 x 512) and a block (4 x 512^2 +
    // 512 x 4096 + 2048 x 512), both multiples of 4 (no padding).
    const double two_units = 4.0 * (50304.0 * 512 + 4 * 512.0 * 512 + 512.0 * 4096 + 2048.0 * 512);
    auto state = [](const Json& m) {
        return m["parameters"].get<double>() + m["gradients"].get<double>() + m["optimizer_state"].get<double>();
    };
    REQUIRE(ddp.size() == 4);
    REQUIRE(fs.size() == 4);
    for (int r = 0; r < 4; ++r) {
        CAPTURE(r, ddp[r].dump(), fs[r].dump());
        CHECK(state(fs[r]) <= state(ddp[r]) / 4 + two_units);
        CHECK(fs[r]["gathered_units"].get<double>() <= two_units);
        // The accounting counts touched memory: the process holds at least that much, and FULL_SHARD's
        // saving shows in the resident set too.
        CHECK(fs[r]["resident"].get<double>() >= fs[r]["total"].get<double>());
        CHECK(ddp[r]["resident"].get<double>() >= ddp[r]["total"].get<double>());
        CHECK(fs[r]["resident"].get<double>() < ddp[r]["resident"].get<double>());
        // What no category counts (libraries, OpenBLAS's buffers, the pool's cached blocks) stays small.
        for (const Json* m : {&ddp[r], &fs[r]}) {
            const double total = (*m)["total"].get<double>();
            CHECK((*m)["unaccounted"].get<double>() <= std::max(0.1 * total, 100.0 * 1048576));
        }
    }
}
