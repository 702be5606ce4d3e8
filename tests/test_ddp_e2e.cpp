// Data-parallel runs against the single process (DDP, NO_SHARD, FULL_SHARD, SHARD_GRAD_OP): `trainer launch` with 2 and
// 3 ranks, DDP in both grad_sync modes and fsdp NO_SHARD, must give the single-process losses (1e-5 relative) and final
// parameters (1e-5 of the largest); a DDP checkpoint resumes on one process; and the strategy / world
// checks refuse what cannot run.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/weights/safetensors.h"
#include "parallel/launch/tcp_store.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::check_close;
using test_util::check_losses;
using test_util::checkpoint_params;
using test_util::exported;
using test_util::free_port;
using test_util::launch;
using test_util::run_trainer;
using test_util::TempDir;

namespace {

void compare_runs(const std::string& a_dir, const std::string& b_dir, size_t steps) {
    const auto a = test_util::read_metrics(a_dir + "/m.jsonl");
    REQUIRE(a.size() == steps);
    check_losses(a, test_util::read_metrics(b_dir + "/m.jsonl"));
    check_close(checkpoint_params(a_dir + "/ck/step" + std::to_string(steps)),
                checkpoint_params(b_dir + "/ck/step" + std::to_string(steps)));
}

std::vector<std::string> run_args(const std::vector<std::string>& base, const std::string& dir) {
    std::vector<std::string> a = base;
    for (const std::string& s :
         std::vector<std::string>{"--metrics-file", dir + "/m.jsonl", "--save-folder", dir + "/ck"}) {
        a.push_back(s);
    }
    return a;
}

}  // namespace

TEST_CASE("ddp: 2 ranks in both grad_sync modes and NO_SHARD match the single process") {
    TempDir dir;
    const std::vector<std::string> base = {"--config",       test_util::fixture("olmo_tiny.json"),
                                           "--init-from",    test_util::fixture("olmo_tiny_init.safetensors"),
                                           "--max-duration", "8"};
    auto single = run_trainer(run_args(base, dir.path("single")));
    REQUIRE(single.exit_code == 0);
    const std::vector<std::vector<std::string>> variants = {
        {"--strategy", "ddp", "--set", "ddp.grad_sync_mode=batch"},
        {"--strategy", "ddp", "--set", "ddp.grad_sync_mode=micro_batch"},
        {"--strategy", "fsdp", "--sharding-strategy", "NO_SHARD", "--set", "fsdp.precision=fp32", "--wrapping-strategy",
         "by_block_and_size"},
    };
    for (size_t v = 0; v < variants.size(); ++v) {
        const std::string out = dir.path("v" + std::to_string(v));
        auto args = run_args(base, out);
        args.insert(args.end(), variants[v].begin(), variants[v].end());
        const test_util::RunResult r = launch(2, args);
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        CHECK_THAT(r.out, Contains("[rank 0] step 8/8"));
        compare_runs(dir.path("single"), out, 8);
    }
}

// Grouped-query attention: the Llama fixture (4 query heads sharing 2 key/value heads), and OLMo-2's shape with one
// key/value head (QK-norm's k one head wide), on 2 ranks under DDP and FULL_SHARD.
TEST_CASE("ddp: shared key/value heads on 2 ranks under DDP and FULL_SHARD match the single process") {
    TempDir dir;
    for (const std::string name : {"llama", "olmo2mqa"}) {
        const std::vector<std::string> base = {"--config",       test_util::fixture(name + "_tiny.json"),
                                               "--init-from",    test_util::fixture(name + "_tiny_init.safetensors"),
                                               "--max-duration", "6"};
        REQUIRE(run_trainer(run_args(base, dir.path(name + "_single"))).exit_code == 0);
        const auto ref = exported(dir.path(name + "_single/ck/step6"), dir.path(name + "_single.safetensors"));
        const std::vector<std::vector<std::string>> variants = {
            {"--strategy", "ddp"},
            {"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD", "--set", "fsdp.precision=fp32",
             "--wrapping-strategy", "by_block"},
        };
        for (size_t v = 0; v < variants.size(); ++v) {
            const std::string out = dir.path(name + "_v" + std::to_string(v));
            auto args = run_args(base, out);
            args.insert(args.end(), variants[v].begin(), variants[v].end());
            const test_util::RunResult r = launch(2, args);
            INFO(name << " " << v << "\n" << r.out << r.err);
            REQUIRE(r.exit_code == 0);
            check_losses(test_util::read_metrics(dir.path(name + "_single/m.jsonl")),
                         test_util::read_metrics(out + "/m.jsonl"));
            test_util::check_same_weights(ref, exported(out + "/ck/step6", out + ".safetensors"));
        }
    }
}

TEST_CASE("ddp: 3 ranks match the single process and a DDP checkpoint resumes on one process") {
    TempDir dir;
    const std::vector<std::string> base = {"--config",       "configs/tiny.json",
                                           "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                           "--max-duration", "6",
                                           "--set",          "global_train_batch_size=12",
                                           "--set",          "device_train_microbatch_size=2",
                                           "--set",          "save_interval=3"};
    REQUIRE(run_trainer(run_args(base, dir.path("single"))).exit_code == 0);
    auto args = run_args(base, dir.path("ddp3"));
    args.insert(args.end(), {"--strategy", "ddp"});
    const test_util::RunResult r = launch(3, args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    compare_runs(dir.path("single"), dir.path("ddp3"), 6);
    // Resume the 3-rank run's step-3 checkpoint in one process: steps 4-6 continue the same stream.
    auto resume = base;
    resume.insert(resume.end(), {"--metrics-file", dir.path("resumed.jsonl"), "--save-folder", dir.path("resumed_ck"),
                                 "--load-path", dir.path("ddp3/ck/step3")});
    REQUIRE(run_trainer(resume).exit_code == 0);
    check_losses(test_util::read_metrics(dir.path("single/m.jsonl")),
                 test_util::read_metrics(dir.path("resumed.jsonl")), 3);
}

TEST_CASE("ddp: strategies that cannot run on this world are refused") {
    const std::vector<std::string> base = {
        "--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration", "2"};
    auto single = base;
    test_util::RunResult r = launch(2, single);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("distributed_strategy \"single\" runs one process, but trainer launch started 2"));
    auto odd = base;
    odd.insert(odd.end(),
               {"--strategy", "ddp", "--set", "global_train_batch_size=12", "--set", "device_train_microbatch_size=4"});
    r = launch(2, odd);  // 12 is not a multiple of 4 x 2... it is 1.5 micro-batches per rank
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("global_train_batch_size 12 is not a multiple of device_train_microbatch_size 4 x 2"));
    auto full = base;
    full.insert(full.end(), {"--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--set",
                             "fsdp.hybrid_sharding_num_model_replicas=3"});
    r = launch(2, full);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("fsdp.hybrid_sharding_num_model_replicas 3 does not divide the 2 ranks"));
}

TEST_CASE("fsdp: FULL_SHARD and SHARD_GRAD_OP on 2 and 3 ranks in both grad_sync modes match the single process") {
    TempDir dir;
    const std::vector<std::string> base = {"--config",       test_util::fixture("olmo_tiny.json"),
                                           "--init-from",    test_util::fixture("olmo_tiny_init.safetensors"),
                                           "--max-duration", "6",
                                           "--set",          "global_train_batch_size=24"};
    REQUIRE(run_trainer(run_args(base, dir.path("single"))).exit_code == 0);
    const auto ref = exported(dir.path("single/ck/step6"), dir.path("single.safetensors"));
    for (const std::string sharding : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
        for (const std::string mode : {"batch", "micro_batch"}) {
            for (int world : {2, 3}) {
                const std::string out = dir.path(sharding + "_" + mode + "_" + std::to_string(world));
                auto args = run_args(base, out);
                args.insert(args.end(),
                            {"--strategy", "fsdp", "--sharding-strategy", sharding, "--set", "fsdp.precision=fp32",
                             "--wrapping-strategy", "by_block_and_size", "--set", "fsdp.grad_sync_mode=" + mode});
                const test_util::RunResult r = launch(world, args);
                INFO(sharding << " " << mode << " " << world << "\n" << r.out << r.err);
                REQUIRE(r.exit_code == 0);
                check_losses(test_util::read_metrics(dir.path("single/m.jsonl")),
                             test_util::read_metrics(out + "/m.jsonl"));
                CHECK(std::filesystem::exists(out + "/ck/step6/rank" + std::to_string(world - 1) + ".bin"));
                // The summary carries every rank's peak memory; sharded parameters are 1/world of the model's
                // (up to the padding of each unit to a multiple of world).
                // Every step record carries every rank's peak memory so far, as the summary does.
                for (const Json& row : test_util::read_metrics(out + "/m.jsonl")) {
                    CHECK(row["peak_memory_bytes_per_rank"].size() == static_cast<size_t>(world));
                }
                const Json per_rank = test_util::read_summary(out + "/m.jsonl")["peak_memory_bytes_per_rank"];
                REQUIRE(per_rank.size() == static_cast<size_t>(world));
                const double full =
                    test_util::read_summary(dir.path("single/m.jsonl"))["peak_memory_bytes_per_rank"][0]["parameters"];
                for (const auto& m : per_rank) {
                    CHECK(m["parameters"].get<double>() <= full / world + 4.0 * 8 * world);
                    CHECK(m["parameters"].get<double>() >= full / world);
                }
                test_util::check_same_weights(ref, exported(out + "/ck/step6", out + ".safetensors"));
            }
        }
    }
}

TEST_CASE("fsdp: a FULL_SHARD checkpoint of 4 ranks resumes on 2 ranks DDP 3 ranks SHARD_GRAD_OP and one process") {
    TempDir dir;
    const std::vector<std::string> base = {"--config",       test_util::fixture("olmo_tiny.json"),
                                           "--init-from",    test_util::fixture("olmo_tiny_init.safetensors"),
                                           "--max-duration", "8",
                                           "--set",          "global_train_batch_size=12",
                                           "--set",          "device_train_microbatch_size=1",
                                           "--set",          "save_interval=4"};
    auto sharded = run_args(base, dir.path("fs4"));
    sharded.insert(sharded.end(),
                   {"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD", "--set", "fsdp.precision=fp32",
                    "--wrapping-strategy", "by_block", "--set", "save_safetensors=true"});
    REQUIRE(launch(4, sharded).exit_code == 0);
    // Rank 0's unsharded copy in the checkpoint folder holds exactly what `trainer export` assembles.
    const auto unsharded = read_safetensors(dir.path("fs4/ck/step8/model.safetensors"));
    const auto assembled = exported(dir.path("fs4/ck/step8"), dir.path("fs4.safetensors"));
    REQUIRE(unsharded.size() == assembled.size());
    for (const auto& [name, t] : assembled) CHECK(unsharded.at(name).data == t.data);
    // Steps 5-8 of the uninterrupted 4-rank run are what every resumed run must reproduce.
    const auto ref = test_util::read_metrics(dir.path("fs4/m.jsonl"));
    REQUIRE(ref.size() == 8);
    const std::vector<std::pair<int, std::vector<std::string>>> resumes = {
        {2, {"--strategy", "ddp"}},
        {3,
         {"--strategy", "fsdp", "--sharding-strategy", "SHARD_GRAD_OP", "--set", "fsdp.precision=fp32",
          "--wrapping-strategy", "by_block_and_size"}},
        {1, {}},
    };
    for (const auto& [world, flags] : resumes) {
        const std::string out = dir.path("resume" + std::to_string(world));
        auto args = run_args(base, out);
        args.insert(args.end(), {"--load-path", dir.path("fs4/ck/step4")});
        args.insert(args.end(), flags.begin(), flags.end());
        const test_util::RunResult r = world > 1 ? launch(world, args) : run_trainer(args);
        INFO(world << " ranks\n" << r.out << r.err);
        REQUIRE(r.exit_code == 0);
        check_losses(ref, test_util::read_metrics(out + "/m.jsonl"), 4);
    }
}

TEST_CASE("launchers: mpirun and a Slurm environment train the same run to the same losses") {
    TempDir dir;
    const std::vector<std::string> base = {"--config",       test_util::fixture("olmo_tiny.json"),
                                           "--init-from",    test_util::fixture("olmo_tiny_init.safetensors"),
                                           "--max-duration", "6",
                                           "--threads",      "1"};
    REQUIRE(run_trainer(run_args(base, dir.path("single"))).exit_code == 0);
    const auto ref = test_util::read_metrics(dir.path("single/m.jsonl"));
    auto check_same = [&](const std::string& metrics) { check_losses(ref, test_util::read_metrics(metrics)); };
    // OpenMPI (Debian's), as root in CI: the flags it needs are --allow-run-as-root and --oversubscribe.
    std::vector<std::string> mpi = {"/usr/bin/mpirun",
                                    "--allow-run-as-root",
                                    "--oversubscribe",
                                    "--bind-to",
                                    "none",
                                    "-np",
                                    "2",
                                    "-x",
                                    "MASTER_PORT=" + free_port(),
                                    test_util::trainer_binary()};
    for (const auto& a : run_args(base, dir.path("mpi"))) mpi.push_back(a);
    mpi.insert(mpi.end(), {"--strategy", "ddp"});
    REQUIRE(test_util::wait_exit_code(test_util::start_logged(mpi, dir.path("mpi.log"))) == 0);
    check_same(dir.path("mpi/m.jsonl"));
    // Slurm: what srun sets for 2 tasks on one node.
    std::vector<std::string> args = {test_util::trainer_binary()};
    for (const auto& a : run_args(base, dir.path("slurm"))) args.push_back(a);
    args.insert(args.end(), {"--strategy", "ddp"});
    const std::string port = free_port();
    std::vector<pid_t> pids;
    for (int r = 0; r < 2; ++r) {
        pids.push_back(test_util::start_logged(
            args, dir.path("slurm.log"),
            {"SLURM_PROCID=" + std::to_string(r), "SLURM_NTASKS=2", "SLURM_LOCALID=" + std::to_string(r),
             "SLURM_TASKS_PER_NODE=2", "SLURM_JOB_NODELIST=localhost", "MASTER_PORT=" + port}));
    }
    for (pid_t p : pids) CHECK(test_util::wait_exit_code(p) == 0);
    check_same(dir.path("slurm/m.jsonl"));
}

// Mixed precision gathers each rank's bf16 shard, which AdamW's copy-out keeps current; a resumed run must
// rebuild it from the loaded parameters, so steps 5-8 repeat the uninterrupted run's losses bit for bit.
TEST_CASE("fsdp: a mixed precision FULL_SHARD run resumed from its checkpoint repeats its losses bitwise") {
    TempDir dir;
    const std::vector<std::string> base = {"--config",
                                           test_util::fixture("olmo_tiny.json"),
                                           "--init-from",
                                           test_util::fixture("olmo_tiny_init.safetensors"),
                                           "--max-duration",
                                           "8",
                                           "--set",
                                           "global_train_batch_size=4",
                                           "--set",
                                           "device_train_microbatch_size=1",
                                           "--set",
                                           "save_interval=4",
                                           "--strategy",
                                           "fsdp",
                                           "--sharding-strategy",
                                           "FULL_SHARD",
                                           "--wrapping-strategy",
                                           "by_block",
                                           "--set",
                                           "fsdp.precision=mixed"};
    REQUIRE(launch(2, run_args(base, dir.path("full"))).exit_code == 0);
    const auto ref = test_util::read_metrics(dir.path("full/m.jsonl"));
    REQUIRE(ref.size() == 8);
    auto args = run_args(base, dir.path("resumed"));
    args.insert(args.end(), {"--load-path", dir.path("full/ck/step4")});
    const test_util::RunResult r = launch(2, args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    check_losses(ref, test_util::read_metrics(dir.path("resumed/m.jsonl")), 4, 0.0);
}

TEST_CASE("evaluation: split over 2 ranks under DDP and FULL_SHARD gives the single-process val_loss") {
    TempDir dir;
    const std::string data = test_util::fixture("olmo_tiny_tokens.u16");
    // 21 instances (7 batches of 3): shares of 10 and 11, the last batches partial, and a whole-set evaluator.
    const std::string evaluators = "evaluators=[{\"label\": \"part\", \"data\": {\"paths\": [\"" + data +
                                   "\"]}, \"subset_num_batches\": 7}, {\"label\": \"all\", \"data\": {\"paths\": [\"" +
                                   data + "\"]}}]";
    const std::vector<std::string> base = {"--config", test_util::fixture("olmo_tiny.json"), "--init-from",
                                           test_util::fixture("olmo_tiny_init.safetensors"), "--max-duration", "2",
                                           "--threads", "1", "--set", "eval_interval=1", "--set",
                                           "device_eval_batch_size=3", "--set", evaluators,
                                           // The ranks' training steps round differently; a learning rate
                                           // this small keeps the evaluated weights equal to far below 1e-6.
                                           "--set", "optimizer.learning_rate=1e-12"};
    auto val_losses = [&](const std::string& name) {
        std::vector<double> v;
        for (const auto& row : test_util::read_metrics(dir.path(name))) {
            for (const char* label : {"part", "all"}) v.push_back(row["val_losses"][label].get<double>());
        }
        return v;
    };
    auto with = [&](std::vector<std::string> extra, const std::string& metrics) {
        std::vector<std::string> a = base;
        extra.insert(extra.end(), {"--metrics-file", dir.path(metrics)});
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    auto r = run_trainer(with({}, "one.jsonl"));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const auto ref = val_losses("one.jsonl");
    REQUIRE(ref.size() == 4);
    for (const std::string strategy : {"ddp", "fsdp"}) {
        CAPTURE(strategy);
        // FSDP in fp32 (its default mixed precision computes on bf16-rounded weights).
        r = launch(2, with({"--strategy", strategy, "--set", "fsdp.precision=fp32", "--wrapping-strategy", "by_block"},
                           strategy + ".jsonl"));
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        const auto got = val_losses(strategy + ".jsonl");
        REQUIRE(got.size() == ref.size());
        for (size_t i = 0; i < ref.size(); ++i) {
            CAPTURE(i, got[i], ref[i]);
            CHECK(std::fabs(got[i] - ref[i]) <= 1e-6 * std::fabs(ref[i]));
        }
    }
}
