// Config validation: every shipped config validates; unknown keys suggest the closest key; wrong types,
// out-of-range values and inconsistent batch sizes are refused naming the key, the value and what is
// allowed; --set overrides are typed by the schema; configs/README.md lists every key.
#include <filesystem>
#include <set>

#include "base/common.h"
#include "base/config.h"
#include "base/config_schema.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;

namespace {

Json minimal() {
    return Json::parse(R"({
        "model": {"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 90, "max_sequence_length": 17},
        "global_train_batch_size": 8, "device_train_microbatch_size": 2, "max_duration": 20,
        "data": {"paths": ["x.bin"]}
    })");
}

}  // namespace

TEST_CASE("config: every shipped config validates") {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator(test_util::source_dir() + "/configs")) {
        if (entry.path().extension() != ".json") continue;
        CAPTURE(entry.path().string());
        const TrainConfig c = validate_config(read_config_file(entry.path().string()));
        CHECK(c.global_train_batch_size % c.device_train_microbatch_size == 0);
        ++n;
    }
    CHECK(n >= 5);
    const TrainConfig olmo1b = validate_config(read_config_file(test_util::source_dir() + "/configs/olmo_1b.json"));
    CHECK(olmo1b.model.ff_proj_size() == 16384);
    CHECK(olmo1b.model.ff_hidden_size() == 8192);
    const TrainConfig olmo7b = validate_config(read_config_file(test_util::source_dir() + "/configs/olmo_7b.json"));
    CHECK(olmo7b.model.ff_hidden_size() == 11008);
    CHECK(olmo7b.total_steps(1 << 30) == static_cast<long>(std::ceil(2e12 / (2048.0 * 2048.0))));
}

TEST_CASE("config: defaults follow OLMo") {
    const TrainConfig c = validate_config(minimal());
    CHECK(c.model.embedding_size == 90);
    CHECK(c.model.bias_for_layer_norm == c.model.include_bias);
    CHECK(c.optimizer.beta2 == 0.95);
    CHECK(c.device_eval_batch_size == 2);
    CHECK(c.data.seed == c.seed);
    CHECK(c.distributed_strategy == DistributedStrategy::kSingle);
    CHECK(c.fsdp.sharding_strategy == ShardingStrategy::kFullShard);
    CHECK(c.fsdp.wrapping_strategy == WrappingStrategy::kNull);
}

TEST_CASE("config: unknown keys suggest the closest key") {
    Json d = minimal();
    d["optimizer"] = {{"learning_rat", 1e-3}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("optimizer.learning_rat") && Contains("optimizer.learning_rate"));
    d = minimal();
    d["learning_rate"] = 1e-3;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("did you mean \"optimizer.learning_rate\""));
    d = minimal();
    d["model"]["n_head"] = 4;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("model.n_heads"));
    d = minimal();
    d["evaluators"] = Json::parse(R"([{"lable": "v", "data": {"paths": ["v.bin"]}}])");
    REQUIRE_THROWS_WITH(validate_config(d), Contains("evaluators[0].lable") && Contains("evaluators[].label"));
    // A word of a key of the same object beats the same word in another section (optimizer.name).
    d = minimal();
    d["data"]["sources"] = Json::parse(R"([{"name": "a", "target_ratio": 1.0, "paths": ["a.bin"]}])");
    REQUIRE_THROWS_WITH(validate_config(d), Contains("did you mean \"data.sources[].source_name\""));
    Json e = minimal();
    REQUIRE_THROWS_WITH(apply_override(e, "model.dmodel=64"), Contains("model.d_model"));
}

TEST_CASE("config: wrong types and out-of-range values name the key and what is allowed") {
    Json d = minimal();
    d["model"]["d_model"] = "big";
    REQUIRE_THROWS_WITH(validate_config(d), Contains("model.d_model") && Contains("\"big\"") && Contains("integer"));
    d = minimal();
    d["model"]["activation_type"] = "relu";
    REQUIRE_THROWS_WITH(validate_config(d), Contains("\"relu\"") && Contains("swiglu, gelu or gelu_tanh"));
    d = minimal();
    d["optimizer"] = {{"betas", {0.9, 1.5}}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("optimizer.betas") && Contains("[0, 1)"));
    d = minimal();
    d["model"]["n_layers"] = 0;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("model.n_layers") && Contains("out of range"));
    d = minimal();
    d["fsdp"] = {{"sharding_strategy", "FULL"}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("fsdp.sharding_strategy: \"FULL\"; expected FULL_SHARD"));
    d = minimal();
    d["model"]["n_heads"] = 5;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("model.n_heads: 5 does not divide model.d_model 32"));
    d = minimal();
    d["model"]["embedding_size"] = 64;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("model.embedding_size"));
    d = minimal();
    d.erase("max_duration");
    REQUIRE_THROWS_WITH(validate_config(d), Contains("max_duration: required"));
    d = minimal();
    d["data"]["paths"] = Json::array();
    REQUIRE_THROWS_WITH(validate_config(d), Contains("config data.paths: [] is empty; expected at least one file"));
    d = minimal();
    d["lora"] = {{"enabled", true}, {"targets", Json::array()}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("config lora.targets: [] is empty; expected at least one entry, "
                                                     "or null") &&
                                                !Contains("file"));
    d = minimal();
    d["lora"] = {{"enabled", true}, {"alpha", 0}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("config lora.alpha: 0 scales every adapter's update by 0"));
    d = minimal();
    d["max_duration"] = "12 parsecs";
    REQUIRE_THROWS_WITH(validate_config(d), Contains("max_duration") && Contains("\"12 parsecs\""));
}

TEST_CASE("config: the decay keys belong to wsd alone and inverse square roots need a warmup") {
    Json d = minimal();
    d["scheduler"] = {{"name", "cosine_with_warmup"}, {"t_decay", 10}};
    REQUIRE_THROWS_WITH(validate_config(d),
                        Contains("scheduler.t_decay") && Contains("cosine_with_warmup does not read it"));
    d["scheduler"] = {{"name", "wsd"}, {"t_decay", 10}, {"decay_fraction", 0.2}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("one of them, not both"));
    d["scheduler"] = {{"name", "wsd"}, {"t_decay", 10}, {"t_max", 20}, {"t_warmup", 15}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("begin before the warmup of 15 ends"));
    d["scheduler"] = {{"name", "wsd"}, {"decay_shape", "sqrt"}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("scheduler.decay_shape") && Contains("linear or 1-sqrt"));
    d["scheduler"] = {{"name", "max_scheduler"}, {"t_warmup", 0}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("max_scheduler needs t_warmup >= 1"));
    d["scheduler"] = {{"name", "wsd"}, {"t_warmup", 2}, {"decay_fraction", 0.5}, {"decay_shape", "1-sqrt"}};
    CHECK_NOTHROW(validate_config(d));
    // With t_max null the decay ends at the run's last step, known once the run's length is: refused before the run.
    const test_util::RunResult r = test_util::run_trainer(
        {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration", "20",
         "--set", "scheduler.name=wsd", "--set", "scheduler.t_warmup=10", "--set", "scheduler.t_decay=15"});
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.err, Contains("config scheduler.t_decay: 15 steps of decay ending at the run's last step 20 "
                               "(scheduler.t_max null) begin before the warmup of 10 ends"));
}

TEST_CASE("config: a mixture of sources is refused with data.paths or ratios that do not sum to 1") {
    const Json two = Json::parse(R"([{"source_name": "web", "target_ratio": 0.7, "paths": ["a.bin"]},
                                     {"source_name": "code", "target_ratio": 0.3, "paths": ["b.bin", "c.bin"]}])");
    Json d = minimal();
    d["data"]["sources"] = two;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("data.paths and data.sources: set one"));
    d["data"].erase("paths");
    const TrainConfig c = validate_config(d);
    REQUIRE(c.data.sources.size() == 2);
    CHECK(c.data.sources[1].paths == std::vector<std::string>{"b.bin", "c.bin"});
    CHECK(c.data.sources[1].max_repetition_ratio == 1.0);
    d["data"]["sources"][1]["target_ratio"] = 0.2;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("the ratios sum to 0.9; expected 1"));
    d["data"]["sources"][1]["target_ratio"] = 0.3;
    d["data"]["sources"][1]["source_name"] = "web";
    REQUIRE_THROWS_WITH(validate_config(d), Contains("data.sources[1].source_name: web names data.sources[0] too"));
    d["data"]["sources"] = two;
    d["data"]["sources"][0].erase("target_ratio");
    REQUIRE_THROWS_WITH(validate_config(d), Contains("data.sources[0].target_ratio: required"));
    d["data"]["sources"] = two;
    d["data"]["sources"][0]["weight"] = 1;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("data.sources[0].weight"));
    d["data"]["sources"] = two;
    d["max_duration"] = "2ep";
    REQUIRE_THROWS_WITH(validate_config(d), Contains("counts epochs, which a mixture of sources does not have"));
    d = minimal();
    d["data"].erase("paths");
    REQUIRE_THROWS_WITH(validate_config(d), Contains("data.paths: required, not set (or data.sources"));
}

TEST_CASE("config: inconsistent batch sizes are refused") {
    Json d = minimal();
    d["global_train_batch_size"] = 10;
    d["device_train_microbatch_size"] = 4;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("global_train_batch_size: 10 is not a multiple of "
                                                     "device_train_microbatch_size 4"));
    d = minimal();
    d["eval_interval"] = 5;
    REQUIRE_THROWS_WITH(validate_config(d), Contains("no evaluators"));
}

TEST_CASE("config: set overrides are typed by the schema") {
    Json d = minimal();
    apply_override(d, "optimizer.learning_rate=3e-4");
    apply_override(d, "model.rope=true");
    apply_override(d, "model.mlp_hidden_size=null");
    apply_override(d, "data.paths=a.bin,b.bin");
    apply_override(d, "max_duration=2e6T");
    apply_override(d, "optimizer.betas=[0.8,0.9]");
    const TrainConfig c = validate_config(d);
    CHECK(c.optimizer.learning_rate == 3e-4);
    CHECK(c.model.rope);
    CHECK(c.data.paths == std::vector<std::string>{"a.bin", "b.bin"});
    CHECK(c.total_steps(1000) == static_cast<long>(std::ceil(2e6 / (8.0 * 17))));
    CHECK(c.optimizer.beta1 == 0.8);
    REQUIRE_THROWS_WITH(apply_override(d, "model.d_model=12.5"), Contains("is not an integer"));
    REQUIRE_THROWS_WITH(apply_override(d, "model.rope=yes"), Contains("true or false"));
    REQUIRE_THROWS_WITH(apply_override(d, "seed"), Contains("expected key.path=value"));
    REQUIRE_THROWS_WITH(apply_override(d, "model.d_model=null"), Contains("null is not allowed"));
    // "tokenizer" is tokenizer.identifier's short form, as in a config file.
    apply_override(d, "tokenizer=gpt2");
    CHECK(d["tokenizer"]["identifier"] == "gpt2");
    // A JSON string literal, as a config file spells it, is its string: not a path with quotes in it.
    apply_override(d, "data.paths=\"c,d.bin\"");
    apply_override(d, "run_name=\"quoted\"");
    apply_override(d, "save_folder=plain");
    const TrainConfig q = validate_config(d);
    CHECK(q.data.paths == std::vector<std::string>{"c,d.bin"});
    CHECK(q.run_name == "quoted");
    CHECK(q.save_folder == std::optional<std::string>("plain"));
    REQUIRE_THROWS_WITH(apply_override(d, "run_name=\"open"), Contains("--set value \"open"));
    REQUIRE_THROWS_WITH(apply_override(d, "data.paths=\"a\" \"b\""), Contains("--set value"));
}

TEST_CASE("config: durations in steps tokens and epochs") {
    Json d = minimal();
    d["max_duration"] = "3ep";
    CHECK(validate_config(d).total_steps(100) == 3 * (100 / 8));
    d["max_duration"] = "1360T";
    CHECK(validate_config(d).total_steps(100) == 10);
    d["max_duration"] = 7;
    CHECK(validate_config(d).total_steps(100) == 7);
    // Parsed once, into its unit and value; every malformed or unbounded form is refused by name when read.
    const Duration tokens = Duration::parse("2e12T");
    CHECK(tokens.unit == Duration::Unit::kTokens);
    CHECK(tokens.value == 2e12);
    CHECK(Duration::parse("1.5ep").unit == Duration::Unit::kEpochs);
    CHECK(Duration::parse("1000").unit == Duration::Unit::kSteps);
    for (const char* bad : {"", "T", "ep", "-5", "0", "1.5", "abc", "10 steps", "inf", "nanT", "2e16"}) {
        INFO(bad);
        REQUIRE_THROWS_WITH(Duration::parse(bad), Contains("config max_duration"));
    }
    d["max_duration"] = "1e30T";  // 1e30 tokens of 136 a step: past 1e15 steps, refused before any data is read
    REQUIRE_THROWS_WITH(validate_config(d), Contains("expected at most 1e15"));
    d["max_duration"] = "1e30ep";  // epochs: bounded once the data's size is known
    const TrainConfig epochs = validate_config(d);
    REQUIRE_THROWS_WITH(epochs.total_steps(100), Contains("expected at most 1e15"));
}

TEST_CASE(
    "config: memmap_dtype and the sample's tokenizer are read as their enums and other spellings refused by key") {
    Json d = minimal();
    CHECK(validate_config(d).data.memmap_dtype == TokenDtype::kUint16);
    CHECK_FALSE(validate_config(d).sample.tokenizer);  // null: the run's
    d["data"]["memmap_dtype"] = "uint32";
    d["sample"] = {{"tokenizer", "dolma2"}};
    d["evaluators"] = Json::array({{{"label", "v"}, {"data", {{"paths", {"v.bin"}}, {"memmap_dtype", "uint32"}}}}});
    const TrainConfig c = validate_config(d);
    CHECK(c.data.memmap_dtype == TokenDtype::kUint32);
    CHECK(c.evaluators.at(0).memmap_dtype == TokenDtype::kUint32);
    CHECK(c.sample.tokenizer == Tokenizer::kDolma2);
    Json bad = d;
    bad["data"]["memmap_dtype"] = "int32";
    REQUIRE_THROWS_WITH(validate_config(bad), Contains("data.memmap_dtype") && Contains("int32") && Contains("uint16"));
    bad = d;
    bad["evaluators"][0]["data"]["memmap_dtype"] = "u16";
    REQUIRE_THROWS_WITH(validate_config(bad), Contains("evaluators[0].data.memmap_dtype") && Contains("u16"));
    bad = d;
    bad["sample"]["tokenizer"] = "neox";
    REQUIRE_THROWS_WITH(validate_config(bad), Contains("sample.tokenizer") && Contains("neox") && Contains("cl100k"));
}

TEST_CASE("config: tokenizer.identifier names the run's tokenizer by ours or by a Hugging Face or OLMo name") {
    Json d = minimal();
    const TrainConfig plain = validate_config(d);
    CHECK(plain.tokenizer.identifier == "bytes");
    CHECK(plain.tokenizer.known == Tokenizer::kBytes);
    for (const auto& [identifier, tokenizer] :
         std::vector<std::pair<std::string, Tokenizer>>{{"gpt2", Tokenizer::kGpt2},
                                                        {"openai-community/gpt2", Tokenizer::kGpt2},
                                                        {"cl100k_base", Tokenizer::kCl100k},
                                                        {"allenai/dolma2-tokenizer", Tokenizer::kDolma2},
                                                        {"tokenizers/allenai_dolma2.json", Tokenizer::kDolma2}}) {
        CAPTURE(identifier);
        d["tokenizer"] = {{"identifier", identifier}};
        const TrainConfig c = validate_config(d);
        CHECK(c.tokenizer.known == tokenizer);
        CHECK(c.tokenizer.identifier == choice_name(tokenizer));  // kept by its short name
        CHECK(c.tokenizer.require(std::nullopt, "x") == tokenizer);
        CHECK(c.tokenizer.require(Tokenizer::kBytes, "x") == Tokenizer::kBytes);  // a key of its own wins
    }
    // The short form, and the config written back in the long one.
    d["tokenizer"] = "cl100k";
    const TrainConfig c = validate_config(d);
    CHECK(c.tokenizer.known == Tokenizer::kCl100k);
    CHECK(config_json(c)["tokenizer"] == Json{{"identifier", "cl100k"}});
    // One the trainer does not have is kept, and refused by name where text is needed.
    d["tokenizer"] = "EleutherAI/gpt-neox-20b";
    const TrainConfig neox = validate_config(d);
    CHECK_FALSE(neox.tokenizer.known);
    CHECK(neox.tokenizer.identifier == "EleutherAI/gpt-neox-20b");
    REQUIRE_THROWS_WITH(neox.tokenizer.require(std::nullopt, "config sample.prompt"),
                        Contains("config sample.prompt needs text tokenized, and config tokenizer.identifier "
                                 "\"EleutherAI/gpt-neox-20b\" is a tokenizer the trainer does not have"));
    CHECK(neox.tokenizer.require(Tokenizer::kGpt2, "x") == Tokenizer::kGpt2);
    d["tokenizer"] = {{"identifier", 7}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("tokenizer.identifier"));
    d["tokenizer"] = {{"identifer", "gpt2"}};
    REQUIRE_THROWS_WITH(validate_config(d), Contains("tokenizer.identifer") && Contains("tokenizer.identifier"));
}

namespace {

// The object keys of a document, as dotted paths (list items as "[]").
void key_paths(const Json& j, const std::string& at, std::set<std::string>& out) {
    if (j.is_object()) {
        for (auto it = j.begin(); it != j.end(); ++it) key_paths(it.value(), at + "." + it.key(), out);
    } else if (j.is_array()) {
        for (const Json& item : j) key_paths(item, at + "[]", out);
    }
    out.insert(at);
}

}  // namespace

TEST_CASE("config: the JSON made from the typed fields holds every key and reads back as the same config") {
    std::vector<Json> docs;
    for (const std::string dir : {"/configs", "/tests/fixtures"}) {
        for (const auto& e : std::filesystem::directory_iterator(test_util::source_dir() + dir)) {
            if (e.path().extension() != ".json" || e.path().filename().string().find("expected") != std::string::npos)
                continue;
            const Json doc = read_config_file(e.path().string());
            if (doc.contains("model")) docs.push_back(doc);
        }
    }
    // Every section set: a mixture with a filter, evaluators, wsd, the z-loss, saving and the plan's files.
    Json full = minimal();
    full["data"] = Json::parse(R"({"sources": [{"source_name": "a", "paths": ["a.bin"], "target_ratio": 0.25},
        {"source_name": "b", "paths": ["b.bin"], "target_ratio": 0.75, "max_repetition_ratio": 2}],
        "instance_filter": {"repetition_max_period": 13, "repetition_max_count": 32}, "seed": 7})");
    full["evaluators"] = Json::parse(R"([{"label": "v", "data": {"paths": ["v.bin"]}, "subset_num_batches": 3}])");
    full["eval_interval"] = 5;
    full["scheduler"] =
        Json::parse(R"({"name": "wsd", "t_warmup": 2, "decay_fraction": 0.2, "decay_shape": "1-sqrt"})");
    full["softmax_auxiliary_loss"] = true;
    full["auxiliary_loss_multiplier"] = 1e-4;
    full["max_duration"] = "2e5T";
    full["save_folder"] = "ck";
    full["plan"] = Json::parse(R"({"hardware": "h200", "device_memory_gib": 80})");
    docs.push_back(full);
    REQUIRE(docs.size() > 10);
    for (const Json& doc : docs) {
        INFO(doc.dump());
        const TrainConfig c = validate_config(doc);
        const Json made = config_json(c);
        std::set<std::string> want, got;
        key_paths(trainer::complete_config_document(doc), "", want);
        key_paths(made, "", got);
        CHECK(got == want);
        CHECK(config_json(validate_config(made)) == made);
    }
}

TEST_CASE("config: configs README lists every key") {
    const std::string readme = test_util::read_file(test_util::source_dir() + "/configs/README.md");
    const std::string table = config_keys_markdown();
    CHECK(readme.find(table) != std::string::npos);  // regenerate with: trainer config-keys
}
