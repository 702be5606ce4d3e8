// Hostile and mistaken input gets a refusal naming what is wrong, never a crash or unbounded memory: the
// JSON reading policy (nesting depth, value count, keys written twice) on configs, checkpoint metadata and
// safetensors headers; YAML aliases and interpolations that multiply; text that is not UTF-8 where it
// would reach a checkpoint's JSON; numbers no run can hold. Each case runs the trainer binary, so a crash
// shows as its signal.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "base/config.h"
#include "core/weights/checkpoint.h"
#include "core/weights/safetensors.h"
#include "test_util.h"

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

using Args = std::vector<std::string>;

Args tiny(const Args& extra) {
    Args a = {"--config", "configs/tiny.json",       "--data", test_util::fixture("olmo_tiny_tokens.u16"),
              "--set",    "console_log_interval=100"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
}

std::string nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// One line of the message: a refusal, not a crash, and short enough to read.
void check_refused(const test_util::RunResult& r, const std::string& says, int exit_code = 1) {
    CAPTURE(r.out, r.err);
    CHECK(r.exit_code == exit_code);
    CHECK_THAT(r.err, Contains(says));
    CHECK(r.err.size() < 1000);
}

}  // namespace

TEST_CASE("input bounds: a JSON config nested 100000 deep is refused at its depth") {
    test_util::TempDir dir;
    const std::string path = dir.path("deep.json");
    test_util::write_file(path, "{\"run_name\": " + nested(100000) + "}");
    check_refused(test_util::run_trainer({"--config", path}), "nest deeper than 64 levels");
    // --set takes JSON for lists: the same policy (60000 deep: one argument holds at most 128 KiB).
    check_refused(test_util::run_trainer(tiny({"--set", "data.paths=" + nested(60000)})), "nest deeper than 64");
}

TEST_CASE("input bounds: checkpoint metadata nested 100000 deep is refused at its depth") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run");
    REQUIRE(test_util::run_trainer(tiny({"--max-duration", "1", "--save-folder", folder})).exit_code == 0);
    const std::string meta_path = folder + "/step1/metadata.json";
    trainer::Json meta = trainer::Json::parse(test_util::read_file(meta_path));
    std::string text = meta.dump();
    text.insert(text.size() - 1, ",\"extra\": " + nested(100000));
    test_util::write_file(meta_path, text);
    check_refused(test_util::run_trainer(
                      tiny({"--max-duration", "2", "--save-folder", folder, "--load-path", folder + "/step1"})),
                  "nest deeper than 64 levels");
}

TEST_CASE("input bounds: a key written twice is refused in configs and safetensors headers") {
    test_util::TempDir dir;
    const std::string config = dir.path("twice.json");
    test_util::write_file(config, "{\"run_name\": \"a\", \"seed\": 1, \"seed\": 2}");
    check_refused(test_util::run_trainer({"--config", config}), "the key \"seed\" appears twice");

    // Two tensors named "a": nlohmann keeps the last one silently.
    const std::string header =
        R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    bytes += header + std::string(8, '\0');
    const std::string st = dir.path("twice.safetensors");
    test_util::write_file(st, bytes);
    CHECK_THROWS_WITH(trainer::read_safetensors(st), Contains("the key \"a\" appears twice"));
}

TEST_CASE("input bounds: YAML aliases that multiply are refused at a bound on values") {
    // Nine levels of nine aliases: 9^9 values from 300 bytes (grew without bound, then bad_alloc).
    test_util::TempDir dir;
    std::string yaml = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n";
    for (int i = 1; i < 10; ++i) {
        yaml += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
        for (int k = 0; k < 9; ++k) yaml += (k ? ", *a" : "*a") + std::to_string(i - 1);
        yaml += "]\n";
    }
    const std::string path = dir.path("bomb.yaml");
    test_util::write_file(path, yaml);
    check_refused(test_util::run_trainer({"--config", path}), "expands to more than 1048576 values");

    // Interpolations that double a text at each level, and that copy a list into lists of it.
    std::string doubling = "b0: xxxxxxxx\n";
    for (int i = 1; i < 40; ++i)
        doubling +=
            "b" + std::to_string(i) + ": \"${b" + std::to_string(i - 1) + "}${b" + std::to_string(i - 1) + "}\"\n";
    test_util::write_file(path, doubling);
    check_refused(test_util::run_trainer({"--config", path}), "interpolation makes a text longer than");
    std::string copies = "c0: [x, x, x, x, x, x, x, x, x]\n";
    for (int i = 1; i < 10; ++i) {
        copies += "c" + std::to_string(i) + ": [";
        for (int k = 0; k < 9; ++k) copies += std::string(k ? ", " : "") + "\"${c" + std::to_string(i - 1) + "}\"";
        copies += "]\n";
    }
    test_util::write_file(path, copies);
    check_refused(test_util::run_trainer({"--config", path}), "interpolations copy more than");
}

TEST_CASE("input bounds: text that is not UTF-8 is refused by key before any step (JSON holds only UTF-8)") {
    test_util::TempDir dir;
    check_refused(test_util::run_trainer(
                      tiny({"--max-duration", "1", "--save-folder", dir.path("a"), "--set", "run_name=ab\xff"})),
                  "config run_name: not valid UTF-8");
    const std::string bad_folder = dir.path("b\xfe");
    check_refused(test_util::run_trainer(tiny({"--max-duration", "1", "--save-folder", bad_folder})),
                  "config save_folder: not valid UTF-8");
    CHECK_FALSE(fs::exists(bad_folder));
    CHECK(trainer::invalid_utf8_path(trainer::Json{{"a", {{"b", trainer::Json::array({"ok", "\xc0\x80"})}}}}) ==
          std::optional<std::string>("a.b[1]"));
    CHECK_FALSE(trainer::invalid_utf8_path(trainer::Json{{"a", "\xc3\xa9"}}).has_value());
}

TEST_CASE("input bounds: numbers no run can hold are named as such") {
    check_refused(test_util::run_trainer(tiny({"--set", "optimizer.learning_rate=inf"})),
                  "config optimizer.learning_rate: inf is not a finite number");
    check_refused(test_util::run_trainer(tiny({"--set", "max_duration=1e300"})), "expected at most 1e15");
    check_refused(test_util::run_trainer(tiny({"--set", "max_duration=1e300T"})), "expected at most 1e15");
    // A flag's bound in words, not the 309 digits of the largest double (a usage error: exit 2).
    check_refused(test_util::run_trainer({"plan", "--config", "configs/tiny.json", "--nnodes", "0"}),
                  "--nnodes: expected a positive number", 2);
}

TEST_CASE("input bounds: messages name the mistake and the way out") {
    test_util::TempDir dir;
    SECTION("weights that are not finite in --init-from are named, not blamed on the learning rate") {
        const float values[2] = {1.0f, std::numeric_limits<float>::quiet_NaN()};
        trainer::write_safetensors(dir.path("w.safetensors"), {{"wte.weight", {2}, values}}, {});
        const auto r = test_util::run_trainer(tiny({"--max-duration", "1", "--init-from", dir.path("w.safetensors")}));
        check_refused(r, "tensor \"wte.weight\" holds nan at element 1; the weights must be finite");
    }
    SECTION("--load-path given a save folder points at latest and its newest checkpoint") {
        const std::string folder = dir.path("run");
        REQUIRE(
            test_util::run_trainer(tiny({"--max-duration", "2", "--save-folder", folder, "--set", "save_interval=1"}))
                .exit_code == 0);
        check_refused(test_util::run_trainer(tiny({"--max-duration", "3", "--load-path", folder})),
                      "a save folder, not a checkpoint (it holds 2 of them, the newest " + folder +
                          "/step2); resume with --load-path latest --save-folder " + folder);
        // A corrupt newest checkpoint named by its path: the refusal names the newest one that verifies and the
        // resume that reaches it; a damaged metadata.json too.
        test_util::write_file(folder + "/step2/rank0.bin", "garbage");
        check_refused(test_util::run_trainer(
                          tiny({"--max-duration", "3", "--save-folder", folder, "--load-path", folder + "/step2"})),
                      "the newest checkpoint before it that verifies is " + folder +
                          "/step1: resume with --load-path latest --save-folder " + folder);
        const std::string meta = test_util::read_file(folder + "/step2/metadata.json");
        test_util::write_file(folder + "/step2/metadata.json", "{\"format\": ");
        check_refused(test_util::run_trainer(
                          tiny({"--max-duration", "3", "--save-folder", folder, "--load-path", folder + "/step2"})),
                      "the newest checkpoint before it that verifies is " + folder + "/step1");
        test_util::write_file(folder + "/step2/metadata.json", meta);
        // Resuming from latest (a requeue, a restart) moves the corrupt one aside, kept, and resumes from step1.
        const auto r =
            test_util::run_trainer(tiny({"--max-duration", "3", "--save-folder", folder, "--load-path", "latest"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.err, Contains("moved aside as " + folder + "/.step2.corrupt-"));
        CHECK_THAT(r.out, Contains("resumed from " + folder + "/step1"));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{1, 3});  // step2 aside, step3 new
        bool kept = false;
        for (const auto& e : fs::directory_iterator(folder)) {
            kept = kept || e.path().filename().string().rfind(".step2.corrupt-", 0) == 0;
        }
        CHECK(kept);
    }
    SECTION("trainer launch without -- says where the ranks' arguments go") {
        check_refused(test_util::run_trainer({"launch", "--nproc-per-node", "1", "--config", "configs/tiny.json"}),
                      "\"--config\" is not an option of trainer launch; the ranks' arguments follow \"--\"", 2);
    }
    SECTION("save_interval without save_folder is a training matter: trainer logits runs") {
        const auto r = test_util::run_trainer(
            tiny({"logits", "--instances", "1", "-o", dir.path("l.npy"), "--set", "save_interval=5"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        check_refused(test_util::run_trainer(tiny({"--max-duration", "1", "--set", "save_interval=5"})),
                      "config save_interval: 5 but save_folder is not set");
    }
    SECTION("tokenizer files are found from the binary, not the working directory") {
        const std::string cmd = "cd /tmp && env -u TRAINER_TOKENIZERS '" + test_util::trainer_binary() +
                                "' tokenize --tokenizer gpt2 '" + test_util::fixture("tokenizer_stress.txt") +
                                "' > /dev/null 2>&1";
        CHECK(std::system(cmd.c_str()) == 0);
    }
    SECTION("nodes launched with different --nproc-per-node name the disagreement at once") {
        const std::string port = test_util::free_port();
        const Args run = tiny({"--max-duration", "2", "--strategy", "ddp", "--set", "global_train_batch_size=16",
                               "--set", "device_train_microbatch_size=2", "--set", "distributed_timeout_seconds=60"});
        auto node = [&](int node_rank, int nproc) {
            return test_util::start_node(2, node_rank, nproc, port, run,
                                         dir.path("node" + std::to_string(node_rank) + ".log"));
        };
        const auto t0 = std::chrono::steady_clock::now();
        const pid_t a = node(0, 2), b = node(1, 1);
        CHECK(test_util::wait_exit_code(a) == 1);
        CHECK(test_util::wait_exit_code(b) == 1);
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));  // not the 60 s timeout
        for (const char* log : {"node0.log", "node1.log"}) {
            const std::string text = test_util::read_file(dir.path(log));
            INFO(text);
            CHECK_THAT(text, Contains("rank 0 has WORLD_SIZE 4 and LOCAL_WORLD_SIZE 2, rank 1 on host"));
            CHECK_THAT(text, Contains("were the nodes launched with different --nproc-per-node or --nnodes?"));
        }
    }
}
