// Downstream (multiple-choice) evaluation: the task format, OLMo's metrics against PyTorch
// (tests/make_fixtures.py downstream), the same scores on every world size and strategy and after a resume, bad files
// refused before step 1, and OLMo's YAML entries.
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/data/downstream.h"
#include "core/data/tokenizer.h"
#include "core/tensorboard.h"
#include "model_check.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::fixture;
using test_util::TempDir;

namespace {

DownstreamTask read_task(const std::string& path, int seq_len = 17, int vocab = 257, bool text = true) {
    const DownstreamEncoder encode = [](const std::string& t) { return byte_encode(t); };
    return read_downstream_task({path}, "evaluators[0] (t)", seq_len, vocab, text ? encode : DownstreamEncoder(),
                                "no tokenizer here");
}

// The tiny OLMo fixture's init, tokens and one downstream evaluator over `task`, `steps` steps, metrics to `metrics`.
std::vector<std::string> tiny_with_task(const std::string& task, const std::string& steps, const std::string& metrics) {
    return {"--config",
            fixture("olmo_tiny.json"),
            "--init-from",
            fixture("olmo_tiny_init.safetensors"),
            "--max-duration",
            steps,
            "--metrics-file",
            metrics,
            "--threads",
            "1",
            "--set",
            "global_train_batch_size=12",
            "--set",
            "device_eval_batch_size=5",
            "--set",
            "eval_interval=2",
            "--set",
            "eval_on_startup=true",
            "--set",
            R"(evaluators=[{"label": "mc", "type": "downstream", "data": {"paths": [")" + task + R"("]}}])"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& more) {
    a.insert(a.end(), more.begin(), more.end());
    return a;
}

// Every metrics line (steps and events) that holds downstream scores, by step.
std::map<long, Json> downstream_by_step(const std::string& metrics) {
    std::map<long, Json> out;
    std::stringstream ss(test_util::read_file(metrics));
    std::string line;
    while (std::getline(ss, line)) {
        if (line.empty()) continue;
        const Json j = Json::parse(line);
        if (j.contains("downstream")) out[j["step"].get<long>()] = j["downstream"];
    }
    return out;
}

}  // namespace

TEST_CASE("downstream: examples are read in both forms with their lengths and cut from the left to fit") {
    TempDir dir;
    test_util::write_file(
        dir.path("t.jsonl"),
        "{\"context\": \"abcdefghijklmnopqrstuvwxyz\", \"continuations\": [\" caf\\u00e9\", \"xy\"], "
        "\"label\": 1, \"unconditioned_context\": \"Answer:\"}\n"
        "\n"
        "{\"contexts\": [[1, 2], {\"ids\": [3], \"text\": \"c\"}], \"continuation\": {\"ids\": [7, 8, "
        "9], \"text\": \" \\ud834\\udd1e\\u20ac\"}, \"label\": 0, \"unconditioned_contexts\": [[4], "
        "\"ab\"], \"id\": \"w1\"}\n");
    const DownstreamTask task = read_task(dir.path("t.jsonl"));
    REQUIRE(task.examples.size() == 2);
    CHECK(task.pmi);
    CHECK(task.lengths);
    const DownstreamExample& a = task.examples[0];
    CHECK(a.candidates() == 2);
    CHECK(a.label == 1);
    // " café": the leading space is not counted; é is one character of two bytes.
    CHECK(a.chars_of(0) == 4);
    CHECK(a.bytes_of(0) == 5);
    CHECK(a.chars_of(1) == 2);
    // The context is kept to its last seq_len - 1 = 16 tokens; a row keeps what leaves room for its continuation.
    CHECK(a.context(0).size() == 16);
    std::vector<int32_t> row(17);
    const auto [first, length] = lay_out_row(task, {0, 0, false}, 17, 256, row.data());
    CHECK(length == 6);  // " café" is 6 bytes
    CHECK(first == 10);  // 11 context tokens, the last one predicting the continuation's first
    CHECK(row[0] == 'p');
    CHECK(row[10] == 'z');
    CHECK(row[11] == ' ');
    CHECK(row[16] == 0xA9);  // é's second byte: the row is full
    const auto [ufirst, ulength] = lay_out_row(task, {0, 1, true}, 17, 256, row.data());
    CHECK(ufirst == 6);  // "Answer:" then "xy"
    CHECK(ulength == 2);
    CHECK(row[8] == 'y');
    CHECK(row[9] == 256);  // padding to the end
    CHECK(row[16] == 256);
    const DownstreamExample& b = task.examples[1];
    CHECK(b.candidates() == 2);
    CHECK(b.context(1) == std::vector<int32_t>{3});
    CHECK(b.continuation(1) == std::vector<int32_t>{7, 8, 9});
    CHECK(b.chars_of(0) == 2);  // a 4-byte and a 3-byte character after the space
    CHECK(b.bytes_of(0) == 7);
    // Its unconditioned contexts are one a candidate (OLMo's WinoGrande): candidate 1's is "ab".
    const auto [bfirst, blength] = lay_out_row(task, {1, 1, true}, 17, 256, row.data());
    CHECK(bfirst == 1);
    CHECK(blength == 3);
    CHECK((row[0] == 'a' && row[1] == 'b' && row[2] == 7 && row[4] == 9 && row[5] == 256));
    // The rows: each example's candidates, then their unconditioned rows.
    const std::vector<DownstreamRow> rows = downstream_rows(task, 2);
    REQUIRE(rows.size() == 8);
    CHECK((rows[2].example == 0 && rows[2].candidate == 0 && rows[2].unconditioned));
    CHECK((rows[4].example == 1 && rows[4].candidate == 0 && !rows[4].unconditioned));
}

TEST_CASE("downstream: acc len_norm pmi_dc and bpb follow OLMo's definitions with the first of equal scores") {
    TempDir dir;
    test_util::write_file(dir.path("t.jsonl"),
                          "{\"context\": \"q\", \"continuations\": [\" ab\", \" abcd\", \" x\"], \"label\": 1, "
                          "\"unconditioned_context\": \"A\"}\n"
                          "{\"context\": \"q\", \"continuations\": [\" ab\", \" cd\"], \"label\": 1, "
                          "\"unconditioned_context\": \"A\"}\n");
    const DownstreamTask task = read_task(dir.path("t.jsonl"));
    const std::vector<DownstreamRow> rows = downstream_rows(task, 2);
    REQUIRE(rows.size() == 10);
    // Example 0: conditioned -3, -4, -2.5; unconditioned -6, -4, -10. acc: candidate 2 (-2.5), wrong; len_norm: per
    // character -1.5, -1, -2.5: candidate 1, right; pmi_dc (the ratio): 0.5, 1, 0.25: candidate 1, right.
    // Example 1: a tie at -2 (the first, 0, is chosen: wrong everywhere); unconditioned -4, -4.
    const std::vector<double> ll = {-3, -4, -2.5, -6, -4, -10, -2, -2, -4, -4};
    const DownstreamMetrics m = downstream_metrics(task, rows, ll);
    CHECK(m.examples == 2);
    CHECK(m.acc == 0.0);
    CHECK(m.len_norm == 0.5);
    CHECK(m.pmi_dc == 0.5);
    // bpb: the right candidate's -ll / bytes / ln 2: (4 / 4 + 2 / 2) / 2 / ln 2.
    CHECK(std::fabs(m.bpb - 1.0 / std::log(2.0)) < 1e-15);
    // Without text (ids alone) there are no lengths: len_norm and bpb are not given; without unconditioned
    // contexts, no pmi_dc.
    test_util::write_file(dir.path("ids.jsonl"),
                          "{\"context\": [1], \"continuations\": [[2], [3, 4]], \"label\": 0}\n");
    const DownstreamTask ids = read_task(dir.path("ids.jsonl"));
    CHECK_FALSE(ids.lengths);
    CHECK_FALSE(ids.pmi);
    const DownstreamMetrics n = downstream_metrics(ids, downstream_rows(ids, 1), {-1.0, -3.0});
    CHECK(n.acc == 1.0);
    CHECK(std::isnan(n.len_norm));
    CHECK(std::isnan(n.bpb));
    CHECK(std::isnan(n.pmi_dc));
}

TEST_CASE("downstream: a tiny OLMo's log-likelihoods and metrics match PyTorch's over the same examples") {
    // fp32 on the CPU backend: every row within 1e-5 and the same argmax everywhere (tests/model_check.h).
    test_util::check_downstream_against_fixture(Device::kCpu, 1e-5, {}, true);
}

TEST_CASE("downstream: the scores are identical on 1 2 and 3 ranks under DDP and FSDP and after a resume") {
    TempDir dir;
    const std::string task = fixture("downstream_tiny.jsonl");
    // One process, 4 steps, scored at steps 0 (eval_on_startup), 2 and 4, saving at step 2.
    const auto one = test_util::run_trainer(
        with(tiny_with_task(task, "4", dir.path("one.jsonl")),
             {"--save-folder", dir.path("ck"), "--set", "save_interval=2", "--tensorboard-dir", dir.path("tb")}));
    INFO(one.out << one.err);
    REQUIRE(one.exit_code == 0);
    CHECK_THAT(one.out, Contains("step 0 | eval mc | acc ") && Contains("(18 examples)"));
    const auto ref = downstream_by_step(dir.path("one.jsonl"));
    REQUIRE(ref.size() == 3);
    REQUIRE(ref.at(0).contains("mc"));
    const Json& start = ref.at(0).at("mc");
    CHECK(start["examples"] == 18);
    for (const char* metric : {"acc", "len_norm", "pmi_dc", "bpb"}) CHECK(start.contains(metric));
    CHECK(ref.at(4) != ref.at(0));  // training changed the scores: the comparisons below could fail
    // TensorBoard has them under downstream/<label>/<metric>, at step 0 too.
    std::map<std::pair<long, std::string>, float> tb;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path("tb"))) {
        for (const TensorBoardScalar& v : read_tensorboard_scalars(entry.path().string()))
            tb[{v.step, v.tag}] = v.value;
    }
    for (const long step : {0L, 2L, 4L}) {
        for (const char* metric : {"acc", "len_norm", "pmi_dc", "bpb"}) {
            CAPTURE(step, metric);
            REQUIRE(tb.count({step, std::string("downstream/mc/") + metric}) == 1);
            CHECK(tb.at({step, std::string("downstream/mc/") + metric}) ==
                  static_cast<float>(ref.at(step).at("mc").at(metric).get<double>()));
        }
    }
    // 2 and 3 ranks, DDP and FSDP (fp32 parameters, FULL_SHARD and SHARD_GRAD_OP): the same weights at step 0 score
    // the same to the last digit.
    for (const auto& [ranks, strategy] : std::vector<std::pair<int, std::vector<std::string>>>{
             {2, {"--strategy", "ddp"}},
             {3, {"--strategy", "ddp"}},
             {2, {"--strategy", "fsdp", "--set", "fsdp.precision=fp32", "--set", "fsdp.sharding_strategy=FULL_SHARD"}},
             {3,
              {"--strategy", "fsdp", "--set", "fsdp.precision=fp32", "--set",
               "fsdp.sharding_strategy=SHARD_GRAD_OP"}}}) {
        CAPTURE(ranks, strategy);
        const std::string metrics = dir.path("w" + std::to_string(ranks) + strategy.back() + ".jsonl");
        const auto w =
            test_util::run_trainer(test_util::launch_args(ranks, with(tiny_with_task(task, "1", metrics), strategy)));
        INFO(w.out << w.err);
        REQUIRE(w.exit_code == 0);
        const auto got = downstream_by_step(metrics);
        REQUIRE(got.count(0) == 1);
        CHECK(got.at(0) == ref.at(0));
    }
    // Resumed from step 2's checkpoint: step 2 (eval_on_startup) and step 4 score as the first run did.
    const auto resumed = test_util::run_trainer(
        with(tiny_with_task(task, "4", dir.path("resumed.jsonl")), {"--load-path", dir.path("ck/step2")}));
    INFO(resumed.out << resumed.err);
    REQUIRE(resumed.exit_code == 0);
    const auto again = downstream_by_step(dir.path("resumed.jsonl"));
    REQUIRE(again.count(2) == 1);
    REQUIRE(again.count(4) == 1);
    CHECK(again.at(2) == ref.at(2));
    CHECK(again.at(4) == ref.at(4));
}

TEST_CASE("downstream: bad files end the run before step 1 with the file and line and the reason") {
    TempDir dir;
    const std::string good = R"({"context": [1, 2], "continuations": [[3], [4, 5]], "label": 0})";
    const auto refused = [&](const std::string& name, const std::string& text, const std::string& expected) {
        CAPTURE(name);
        test_util::write_file(dir.path(name), text);
        const auto r = test_util::run_trainer(tiny_with_task(dir.path(name), "2", dir.path(name + ".metrics")));
        CHECK(r.exit_code != 0);
        CHECK_THAT(r.err, Contains(expected));
        CHECK_THAT(r.out, !Contains("step 1/"));
        CHECK(test_util::read_file_if_exists(dir.path(name + ".metrics")).find("\"loss\"") == std::string::npos);
    };
    refused("empty.jsonl", "", "evaluators[0] (mc) file " + dir.path("empty.jsonl") + ": holds no example");
    refused("blank.jsonl", "\n  \n", "holds no example");
    refused("label.jsonl", good + "\n" + R"({"context": [1], "continuations": [[3], [4]], "label": 2})" + "\n",
            dir.path("label.jsonl") +
                " line 2: \"label\" is 2; expected the index of the right candidate, an integer "
                "from 0 to 1");
    refused("nolabel.jsonl", R"({"context": [1], "continuations": [[3], [4]]})", "\"label\" is missing");
    // 17 tokens of continuation: with one of context that is 18, past max_sequence_length 17.
    refused("long.jsonl",
            R"({"context": [1], "continuations": [[3], [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]], "label": 0})",
            "line 1: \"continuations[1]\" is 17 tokens; with at least one token of context before it, it must fit "
            "model.max_sequence_length 17 (at most 16 tokens)");
    refused("utf8.jsonl", good + "\n" + "{\"context\": \"caf\xe9\", \"continuations\": [[3], [4]], \"label\": 0}\n",
            dir.path("utf8.jsonl") + " line 2: not valid UTF-8 (byte 17 of the line)");
    refused("id.jsonl", R"({"context": [1], "continuations": [[3], [90]], "label": 0})",
            "\"continuations[1]\" holds 90; expected token ids, integers from 0 to model.vocab_size - 1 = 89");
    refused("json.jsonl", "{\"context\": [1], ", "line 1");
    refused("key.jsonl", R"({"context": [1], "choices": [[3], [4]], "label": 0})", "unknown key \"choices\"");
    refused("forms.jsonl", R"({"context": [1], "contexts": [[1]], "continuation": [3], "label": 0})",
            "expected either \"context\" with \"continuations\" or \"contexts\" with \"continuation\"");
    refused("empty_ctx.jsonl", R"({"context": [], "continuations": [[3], [4]], "label": 0})",
            "\"context\" is empty; every context and continuation has a token");
    refused("pmi.jsonl",
            good + "\n" + R"({"context": [1], "continuations": [[3], [4]], "label": 0, "unconditioned_context": [5]})",
            "line 2: has an \"unconditioned_context\" and " + dir.path("pmi.jsonl") + " line 1 has none");
    // Text needs a tokenizer the model's vocabulary fits: the byte tokenizer's 257 ids do not fit olmo_tiny's 90.
    refused("text.jsonl", R"({"context": "The", "continuations": [" cat", " dog"], "label": 0})",
            "config tokenizer.identifier bytes: its 257 ids do not fit the model's vocab_size 90");
    // A tokenizer the trainer does not have: text is refused by name, ids still run.
    const auto neox = test_util::run_trainer(with(tiny_with_task(dir.path("text.jsonl"), "1", dir.path("neox.jsonl")),
                                                  {"--set", "tokenizer.identifier=EleutherAI/gpt-neox-20b"}));
    CHECK(neox.exit_code != 0);
    CHECK_THAT(neox.err, Contains("\"context\" is text, and config tokenizer.identifier \"EleutherAI/gpt-neox-20b\" "
                                  "is a tokenizer the trainer does not have"));
    test_util::write_file(dir.path("ids.jsonl"), good + "\n");
    const auto ids = test_util::run_trainer(with(tiny_with_task(dir.path("ids.jsonl"), "1", dir.path("ids.metrics")),
                                                 {"--set", "tokenizer.identifier=EleutherAI/gpt-neox-20b"}));
    INFO(ids.out << ids.err);
    CHECK(ids.exit_code == 0);
    CHECK_THAT(ids.out, Contains("eval mc | acc ") && Contains("(1 example)"));
    // A downstream evaluator takes no label masks.
    const auto masks = test_util::run_trainer(with(
        tiny_with_task(dir.path("ids.jsonl"), "1", dir.path("m.metrics")),
        {"--set",
         R"(evaluators=[{"label": "mc", "type": "downstream", "data": {"paths": ["x"], "label_mask_paths": ["y"]}}])"}));
    CHECK(masks.exit_code != 0);
    CHECK_THAT(masks.err, Contains("config evaluators[0].data.label_mask_paths: a downstream evaluator scores"));
}

TEST_CASE("downstream: an OLMo YAML runs the downstream evaluators whose files exist and names the others") {
    TempDir dir;
    // OLMo's layout: downstream entries by label only, and a tokenizer the trainer does not have (ids still run).
    test_util::write_file(dir.path("tiny.yaml"), R"(run_name: tiny-olmo
seed: 6198
model:
  d_model: 32
  n_heads: 4
  n_layers: 2
  mlp_ratio: 4
  vocab_size: 90
  embedding_size: 96
  max_sequence_length: 17
optimizer:
  name: adamw
  learning_rate: 4.0e-3
scheduler:
  name: constant
tokenizer:
  identifier: tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json
  truncate_direction: right
global_train_batch_size: 8
device_train_microbatch_size: 2
max_duration: 2
eval_interval: 2
evaluators:
  - label: piqa
    type: downstream
  - label: hellaswag
    type: downstream
data:
  paths:
    - )" + fixture("olmo_tiny_tokens.u16") + "\n");
    std::filesystem::create_directories(dir.path("downstream"));
    test_util::write_file(dir.path("downstream/piqa.jsonl"),
                          R"({"context": [1, 2, 3], "continuations": [[4, 5], [6]], "label": 1})"
                          "\n");
    const auto r = test_util::run_trainer(
        {"--config", dir.path("tiny.yaml"), "--metrics-file", dir.path("m.jsonl"), "--threads", "1"},
        {"TRAINER_DOWNSTREAM_DIR=" + dir.path("downstream")});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("step 2 | eval piqa | acc "));
    CHECK_THAT(r.out, !Contains("eval hellaswag"));
    CHECK_THAT(r.err, Contains("downstream evaluators without their examples: hellaswag (" + dir.path("downstream") +
                               "/hellaswag.jsonl not found)"));
    CHECK_THAT(r.err, Contains("tokenizer.identifier \"tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json\" "
                               "is a tokenizer the trainer does not have"));
    const auto scored = downstream_by_step(dir.path("m.jsonl"));
    REQUIRE(scored.count(2) == 1);
    CHECK(scored.at(2).at("piqa").at("examples") == 1);
}

TEST_CASE("downstream: a model built for the rows' own length scores them as the full-length model does") {
    // olmo_tiny (RoPE: no parameter depends on the length) at 256 tokens, and the same parameters built for 64.
    TrainConfig config = test_util::fixture_config("olmo");
    config.model.max_sequence_length = 256;
    auto backend = make_backend(Device::kCpu, {});
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    const std::string init = fixture("olmo_tiny_init.safetensors");
    const auto init_tensors = read_safetensors(init);
    load_initial_params(config, layout, *strategy, &init_tensors, init);
    const DownstreamTask task =
        read_downstream_task({fixture("downstream_tiny.jsonl")}, "fixture", 256, 90, nullptr, "ids only");
    std::vector<std::unique_ptr<DownstreamTask>> tasks;
    tasks.push_back(nullptr);  // an lm evaluator's place
    tasks.push_back(std::make_unique<DownstreamTask>(task));
    CHECK(task.longest == 37);  // contexts of up to 30 ids and continuations of up to 8, none cut at 256
    CHECK(downstream_length(config, tasks) == 64);
    TrainConfig short_config = config;
    short_config.model.max_sequence_length = 64;
    Model full(config, layout, backend.get(), strategy.get(), 4);
    Model own(short_config, layout, backend.get(), strategy.get(), 4);
    const std::vector<DownstreamRow> rows = downstream_rows(task, static_cast<int64_t>(task.examples.size()));
    int sig = 0;
    const std::vector<double> a = score_downstream_rows(task, rows, full, *strategy, 4, 89, &sig);
    const std::vector<double> b = score_downstream_rows(task, rows, own, *strategy, 4, 89, &sig);
    REQUIRE(a.size() == rows.size());
    REQUIRE(b.size() == rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
        CAPTURE(r);
        CHECK(std::fabs(a[r] - b[r]) <= 1e-6 * std::fabs(a[r]));
    }
    // A run says which length it scores at; a task as long as the model scores in the training instances.
    TempDir dir;
    const auto run =
        test_util::run_trainer(with(tiny_with_task(fixture("downstream_tiny.jsonl"), "1", dir.path("m.jsonl")),
                                    {"--set", "model.max_sequence_length=128"}));
    INFO(run.out << run.err);
    REQUIRE(run.exit_code == 0);
    CHECK_THAT(run.out, Contains("downstream: rows of up to 37 tokens, scored in instances of 64 tokens, at their own "
                                 "length (the model's is 128)"));
    const auto same =
        test_util::run_trainer(tiny_with_task(fixture("downstream_tiny.jsonl"), "1", dir.path("n.jsonl")));
    CHECK_THAT(same.out, Contains("downstream: rows of up to 17 tokens, scored in the model's instances of 17 tokens"));
}
