// OLMo's YAML configs through `trainer show-config`: an OLMo-1B-style YAML resolves to configs/olmo_1b.json's
// settings and an OLMo2-1B-stage1-style one to configs/olmo2_1b.json's; interpolations (keys, oc.env, path.choose)
// resolve after --set overrides; OLMo-only structures map to the trainer's keys; the keys with no effect here are
// listed in one warning (an error with
// --strict); values the trainer cannot honour, URLs as training data and typos are refused by name.
#include "base/common.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::fixture;
using test_util::run_trainer;
using test_util::RunResult;
using test_util::TempDir;

namespace {

const std::string kYaml = fixture("olmo_1b_style.yaml");

// show-config of the fixture with `args` (data and save folder given), its environment `env`.
RunResult show(std::vector<std::string> args, const std::vector<std::string>& env = {}) {
    std::vector<std::string> a = {"show-config", "--config", kYaml, "--data", fixture("olmo_tiny_tokens.u16")};
    a.insert(a.end(), args.begin(), args.end());
    return run_trainer(a, env);
}

// Numbers compared by value (YAML's 10000.0 is JSON's 10000).
void check_same(const Json& a, const Json& b, const std::string& path) {
    CAPTURE(path);
    if (a.is_number() && b.is_number()) {
        CHECK(a.get<double>() == b.get<double>());
    } else if (a.is_object() && b.is_object()) {
        CHECK(a.size() == b.size());
        for (auto it = a.begin(); it != a.end(); ++it) {
            REQUIRE(b.contains(it.key()));
            check_same(it.value(), b[it.key()], path + "." + it.key());
        }
    } else if (a.is_array() && b.is_array()) {
        REQUIRE(a.size() == b.size());
        for (size_t i = 0; i < a.size(); ++i) check_same(a[i], b[i], path + "[" + std::to_string(i) + "]");
    } else {
        CHECK(a == b);
    }
}

void expect_error(const RunResult& r, const std::string& what) {
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains(what));
}

}  // namespace

TEST_CASE("olmo yaml: an OLMo-1B-style config resolves to configs/olmo_1b.json and names what has no effect") {
    TempDir dir;
    const RunResult r =
        show({"--save-folder", dir.path("ck")}, {"TRAINER_TEST_DATA=" + fixture("gpt2_tiny_tokens.u16")});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const Json got = Json::parse(r.out);
    const RunResult ref = run_trainer({"show-config", "--config", test_util::source_dir() + "/configs/olmo_1b.json",
                                       "--data", fixture("olmo_tiny_tokens.u16")});
    REQUIRE(ref.exit_code == 0);
    const Json want = Json::parse(ref.out);
    for (const char* k :
         {"model", "optimizer", "scheduler", "fsdp", "global_train_batch_size", "device_train_microbatch_size",
          "device_eval_batch_size", "max_duration", "max_grad_norm", "precision", "seed", "run_name"}) {
        check_same(want[k], got[k], k);
    }
    // Interpolations and OLMo's number forms.
    CHECK(got["max_duration"] == 739328);  // 739_328
    CHECK(got["eval_interval"] == 1000);   // ${save_interval}
    CHECK(got["device_eval_batch_size"] == 8);
    CHECK(got["save_folder"] == dir.path("ck"));  // the override won before path.choose ran
    // The local dataset became an evaluator of its own, with eval_subset_num_batches.
    REQUIRE(got["evaluators"].size() == 1);
    CHECK(got["evaluators"][0]["label"] == "local-a-validation");
    CHECK(got["evaluators"][0]["data"]["paths"][0] == fixture("gpt2_tiny_tokens.u16"));
    CHECK(got["evaluators"][0]["subset_num_batches"] == 3);
    // The run's tokenizer is OLMo's, which the trainer does not have: said by name on a line of its own.
    CHECK(got["tokenizer"]["identifier"] == "tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json");
    CHECK_THAT(r.err, Contains("tokenizer.identifier \"tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json\" "
                               "is a tokenizer the trainer does not have"));
    // Then one warning line naming what has no effect, the downstream evaluators with the files they looked for.
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 2);
    for (const char* k :
         {"warning: ", "wandb", "compile", "speed_monitor", "tokenizer.truncate_direction", "model.flash_attention",
          "model.init_device", "data.num_workers", "save_interval_unsharded",
          "downstream evaluators without their examples: piqa (data/downstream/piqa.jsonl not found), hellaswag "
          "(data/downstream/hellaswag.jsonl not found)",
          "evaluators small-ppl-validation (1 dataset at URLs"}) {
        CHECK_THAT(r.err, Contains(k));
    }
    // With their files in the downstream folder, they run: evaluators of type downstream on those files, with
    // eval_subset_num_batches.
    test_util::write_file(dir.path("piqa.jsonl"), R"({"context": [1], "continuations": [[2], [3]], "label": 0})");
    test_util::write_file(dir.path("hellaswag.jsonl"), R"({"context": [1], "continuations": [[2], [3]], "label": 1})");
    const RunResult found =
        show({"--save-folder", dir.path("ck")},
             {"TRAINER_TEST_DATA=" + fixture("gpt2_tiny_tokens.u16"), "TRAINER_DOWNSTREAM_DIR=" + dir.path("")});
    INFO(found.err);
    REQUIRE(found.exit_code == 0);
    const Json with_files = Json::parse(found.out);
    REQUIRE(with_files["evaluators"].size() == 3);
    CHECK(with_files["evaluators"][1]["label"] == "piqa");
    CHECK(with_files["evaluators"][1]["type"] == "downstream");
    CHECK(with_files["evaluators"][1]["data"]["paths"][0] == dir.path("") + "/piqa.jsonl");
    CHECK(with_files["evaluators"][1]["subset_num_batches"] == 3);
    CHECK(with_files["evaluators"][2]["label"] == "hellaswag");
    CHECK_THAT(found.err, !Contains("downstream evaluators"));
    // --strict makes them an error.
    expect_error(show({"--save-folder", dir.path("ck"), "--strict"}), "OLMo keys with no effect here (--strict): ");
}

TEST_CASE("olmo yaml: an OLMo2-1B-stage1-style config resolves to configs/olmo2_1b.json") {
    // OLMo-2's architecture keys, the z-loss, the instance filter with OLMo's defaults, t_max of 5e12 tokens (a
    // fraction of a step), and save_num_checkpoints_to_keep: 0 (the unsharded checkpoints' keys apply).
    TempDir dir;
    const std::vector<std::string> common = {"--data", fixture("olmo_tiny_tokens.u16"), "--save-folder",
                                             dir.path("ck")};
    std::vector<std::string> a = {"show-config", "--config", fixture("olmo2_1b_style.yaml")};
    a.insert(a.end(), common.begin(), common.end());
    const RunResult r = run_trainer(a);
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<std::string> b = {"show-config", "--config", test_util::source_dir() + "/configs/olmo2_1b.json"};
    b.insert(b.end(), common.begin(), common.end());
    const RunResult ref = run_trainer(b);
    REQUIRE(ref.exit_code == 0);
    check_same(Json::parse(ref.out), Json::parse(r.out), "");
    const Json got = Json::parse(r.out);
    CHECK(got["scheduler"]["t_max"].get<double>() == 5e12 / (512.0 * 4096.0));
    CHECK(got["save_interval"] == 1000);
    CHECK(got["save_num_checkpoints_to_keep"] == -1);
    CHECK(got["data"]["instance_filter"]["repetition_max_count"] == 32);
    for (const char* k :
         {"save_num_checkpoints_to_keep: 0 (sharded checkpoints off", "save_interval_ephemeral", "sharded_checkpointer",
          "fused_loss", "downstream evaluators without their examples: piqa (data/downstream/piqa.jsonl"}) {
        CHECK_THAT(r.err, Contains(k));
    }
    // An ephemeral interval that is not a multiple of the checkpoints' is refused: it would save more often.
    std::string text = test_util::read_file(fixture("olmo2_1b_style.yaml"));
    text.replace(text.find("save_interval_ephemeral: 1000"), 29, "save_interval_ephemeral: 250");
    test_util::write_file(dir.path("e.yaml"), text);
    std::vector<std::string> e = {"show-config", "--config", dir.path("e.yaml")};
    e.insert(e.end(), common.begin(), common.end());
    expect_error(run_trainer(e), "save_interval_ephemeral: 250; this trainer has no ephemeral checkpoints");
}

TEST_CASE("olmo yaml: interpolations resolve after the overrides from keys the environment and existing paths") {
    TempDir dir;
    // Without --save-folder, path.choose finds none of its paths: refused naming the key, as OLMo stops.
    expect_error(show({}), "save_folder: ${path.choose:...} found none of no_exist/checkpoints, /no/results");
    // A path the file system cannot look up (a name past its length limit) is one it did not find, not the
    // library's exception: that was an internal error (exit 70), found by fuzzing.
    const std::string too_long = "/tmp/" + std::string(5000, 'a');
    expect_error(show({}, {"TRAINER_TEST_SCRATCH=" + too_long}),
                 "save_folder: ${path.choose:...} found none of " + too_long + "/checkpoints, /no/results");
    // With the scratch folder present, it is chosen and SLURM_JOB_ID fills the rest.
    std::filesystem::create_directories(dir.path("scratch/checkpoints"));
    const RunResult r = show({}, {"TRAINER_TEST_SCRATCH=" + dir.path("scratch"), "SLURM_JOB_ID=4242",
                                  "TRAINER_TEST_DATA=" + fixture("gpt2_tiny_tokens.u16")});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(Json::parse(r.out)["save_folder"] == dir.path("scratch") + "/checkpoints/4242");
}

TEST_CASE("olmo yaml: values the trainer cannot honour URLs typos and bad YAML are refused by name") {
    TempDir dir;
    const std::string base = test_util::read_file(kYaml);
    auto with = [&](const std::string& from, const std::string& to, std::vector<std::string> extra = {}) {
        std::string text = base;
        const size_t at = text.find(from);
        REQUIRE(at != std::string::npos);
        text.replace(at, from.size(), to);
        test_util::write_file(dir.path("c.yaml"), text);
        std::vector<std::string> a = {"show-config", "--config", dir.path("c.yaml"), "--save-folder", dir.path("ck")};
        a.insert(a.end(), extra.begin(), extra.end());
        return run_trainer(a);
    };
    const std::vector<std::string> data = {"--data", fixture("olmo_tiny_tokens.u16")};
    expect_error(with("  alibi: false", "  alibi: true", data), "model.alibi: true; this trainer has no ALiBi");
    expect_error(with("  attention_dropout: 0.0", "  attention_dropout: 0.1", data),
                 "model.attention_dropout: 0.1; this trainer has no dropout");
    // multi_query_attention is one key/value head, as OLMo's effective_n_kv_heads; with n_kv_heads it must agree.
    const auto mqa = with("  multi_query_attention: false", "  multi_query_attention: true", data);
    INFO(mqa.err);
    REQUIRE(mqa.exit_code == 0);
    CHECK(Json::parse(mqa.out)["model"]["n_kv_heads"] == 1);
    expect_error(with("  multi_query_attention: false", "  multi_query_attention: true\n  n_kv_heads: 4", data),
                 "model.multi_query_attention: true and model.n_kv_heads: 4 disagree (it means n_kv_heads 1)");
    // Training data at URLs: refused with the hint to pass --data.
    expect_error(with("run_name: OLMo-1B", "run_name: OLMo-1B"),
                 "data.paths[0]: r2://olmo-data/preprocessed/olmo-mix/v1_5/gpt-neox-20b-pii-special/part-000-00000.npy "
                 "is a URL; this trainer reads local token files: download them and pass --data FILE");
    // A typo is refused with the closest key.
    expect_error(with("  d_model: 2048", "  d_modle: 2048", data), "did you mean \"model.d_model\"");
    expect_error(with("run_name: OLMo-1B", "run_name: [unclosed", data), "not valid YAML at line");
    // An integer beyond an int64 reads as a double, and one beyond a double (over 308 digits) as text: each refused
    // by the schema, by name (the second threw out of the reader, found by fuzzing).
    expect_error(with("  d_model: 2048", "  d_model: " + std::string(30, '9'), data),
                 "model.d_model: 1e+30 is out of range");
    expect_error(with("  d_model: 2048", "  d_model: " + std::string(400, '9'), data), "model.d_model: \"999999");
    expect_error(with("eval_interval: ${save_interval}", "eval_interval: ${save_intervall}", data),
                 "eval_interval: ${save_intervall} names no key of the config");
    // scheduler.units: tokens becomes steps of 2048 x 2048 tokens, fractional where they do not divide (OLMo
    // schedules on the tokens seen: the same formula).
    RunResult r = with("  t_warmup: 2000\n", "  units: tokens\n  t_warmup: 8388608000\n", data);
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(Json::parse(r.out)["scheduler"]["t_warmup"] == 2000);
    r = with("  t_warmup: 2000\n", "  units: tokens\n  t_warmup: 1000\n  t_max: 5e12\n", data);
    REQUIRE(r.exit_code == 0);
    CHECK(Json::parse(r.out)["scheduler"]["t_warmup"].get<double>() == 1000.0 / (2048.0 * 2048.0));
    CHECK(Json::parse(r.out)["scheduler"]["t_max"].get<double>() == 5e12 / (2048.0 * 2048.0));
}
