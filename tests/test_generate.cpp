// Generation: the decode path with a KV cache gives the training forward's logits at every position (a prompt of
// several tokens at once, then one token a step, three model shapes), sampling's rules (greedy, top-k, top-p,
// reproducible draws), the cache and the recomputed prefix continue alike, and `trainer generate` end to end with
// its refusals.
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "core/generate.h"
#include "model_check.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::fixture;
using test_util::fixture_config;

using Loaded = test_util::FixtureModel;

TEST_CASE("generate: the KV cache path gives the forward's logits at every position of every shape") {
    // OLMo (RoPE, SwiGLU, parameter-free LayerNorm), GPT-2 (learned positions, GELU, biases, affine LayerNorm),
    // OLMo-2 (RMSNorm after each sublayer, QK-norm, an untied head), Llama (grouped-query attention: a cache of
    // 2 heads for 4 query heads) and OLMo-2 with one key/value head.
    for (const std::string name : {"olmo", "gpt2", "olmo2", "llama", "olmo2mqa"}) {
        CAPTURE(name);
        test_util::check_decode_against_forward(name, Device::kCpu, 1e-5);
    }
}

TEST_CASE("generate: greedy takes the first most likely id and sampling keeps to top-k and top-p") {
    const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f, -1.0f, 0.5f};
    SamplingOptions greedy;
    CHECK(sample_token(logits.data(), 6, greedy, 0, 0) == 1);
    CHECK(sample_token(logits.data(), 4, greedy, 0, 0) == 1);
    SamplingOptions o;
    o.temperature = 1.0, o.seed = 9;
    std::map<int, int> counts;
    for (long step = 0; step < 4000; ++step) ++counts[sample_token(logits.data(), 6, o, 0, step)];
    CHECK(counts.size() == 6);
    // Probabilities e^x / sum: token 1 about 0.36 of the draws.
    double sum = 0.0;
    for (float x : logits) sum += std::exp(x);
    CHECK(std::fabs(counts[1] / 4000.0 - std::exp(3.0) / sum) < 0.03);
    // Reproducible: the same (seed, sequence, step) draws the same token.
    for (long step = 0; step < 50; ++step) {
        CHECK(sample_token(logits.data(), 6, o, 3, step) == sample_token(logits.data(), 6, o, 3, step));
    }
    o.top_k = 2;  // ids 1 and 2 only (the two 3.0s)
    std::set<int> seen;
    for (long step = 0; step < 200; ++step) seen.insert(sample_token(logits.data(), 6, o, 0, step));
    CHECK(seen == std::set<int>{1, 2});
    o.top_k = 0, o.top_p = 0.5;  // 1 and 2 hold 0.72 together, 1 alone 0.36: both needed to reach 0.5
    seen.clear();
    for (long step = 0; step < 200; ++step) seen.insert(sample_token(logits.data(), 6, o, 0, step));
    CHECK(seen == std::set<int>{1, 2});
    o.top_p = 0.3;  // 1 alone reaches 0.3
    seen.clear();
    for (long step = 0; step < 200; ++step) seen.insert(sample_token(logits.data(), 6, o, 0, step));
    CHECK(seen == std::set<int>{1});
}

TEST_CASE("generate: the cache and the recomputed prefix continue a batch of prompts alike") {
    Loaded m("olmo");
    Model model(m.config, *m.layout, m.backend.get(), m.strategy.get(), 0);
    const std::vector<std::vector<int32_t>> prompts = {{10, 20, 30}, {5}, {7, 8, 9, 10, 11, 12}};
    SamplingOptions o;
    const GenerationResult cached = generate_tokens(model, m.config.model, prompts, 10, o, -1, true);
    const GenerationResult recomputed = generate_tokens(model, m.config.model, prompts, 10, o, -1, false);
    CHECK(cached.tokens == recomputed.tokens);
    CHECK(cached.new_tokens == 30);
    o.temperature = 0.8, o.top_k = 50, o.seed = 4;
    CHECK(generate_tokens(model, m.config.model, prompts, 10, o, -1, true).tokens ==
          generate_tokens(model, m.config.model, prompts, 10, o, -1, false).tokens);
    // Greedy, a prompt alone continues as it does in the batch (a draw depends on the prompt's place in it).
    const GenerationResult alone = generate_tokens(model, m.config.model, {prompts[2]}, 10, {}, -1, true);
    CHECK(alone.tokens[0] == cached.tokens[2]);
    // The context is the model's: a prompt and its new tokens past max_sequence_length are refused.
    REQUIRE_THROWS_WITH(
        generate_tokens(model, m.config.model, prompts, m.config.model.max_sequence_length, o, -1, true),
        Contains("prompt 1 has 3 tokens") && Contains("above the model's max_sequence_length"));
}

TEST_CASE("generate: the command continues prompts from a checkpoint and refuses what it cannot do") {
    test_util::TempDir dir;
    // Trained on 2 ranks under FSDP with a sample every 5 steps (every rank gathers the units for it).
    const std::vector<std::string> train = {"--config",       "configs/tiny.json",
                                            "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                            "--threads",      "1",
                                            "--max-duration", "10",
                                            "--save-folder",  dir.path("ck"),
                                            "--strategy",     "fsdp",
                                            "--set",          "sample.interval=5",
                                            "--set",          "sample.prompt=The",
                                            "--set",          "sample.max_new_tokens=16",
                                            "--metrics-file", dir.path("m.jsonl")};
    const test_util::RunResult trained = test_util::launch(2, train);
    INFO(trained.out << trained.err);
    REQUIRE(trained.exit_code == 0);
    CHECK_THAT(trained.out, Contains("step 5 | sample: The"));
    CHECK_THAT(trained.out, Contains("step 10 | sample: The"));
    const auto rows = test_util::read_metrics(dir.path("m.jsonl"));
    REQUIRE(rows.size() == 10);
    CHECK(rows[4].contains("sample"));
    CHECK_FALSE(rows[3].contains("sample"));
    const std::vector<std::string> base = {"generate", "--config",    "configs/tiny.json",       "--threads",
                                           "1",        "--load-path", dir.path("ck") + "/latest"};
    auto with = [&](std::vector<std::string> extra) {
        std::vector<std::string> a = base;
        a.insert(a.end(), extra.begin(), extra.end());
        return test_util::run_trainer(a);
    };
    const test_util::RunResult r =
        with({"--prompt", "The Congress", "--prompt", "", "--max-new-tokens", "12", "--json", "--no-stop-at-eos"});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<Json> lines;
    std::stringstream ss(r.out);
    for (std::string line; std::getline(ss, line);) lines.push_back(Json::parse(line));
    REQUIRE(lines.size() == 3);
    CHECK(lines[0]["prompt_text"] == "The Congress");
    CHECK(lines[0]["ids"].size() == 12);
    CHECK(lines[1]["prompt_ids"] == Json::array({256}));  // an empty prompt starts after an EOS
    CHECK_THAT(r.err, !Contains("untrained"));
    // Without weights the model is its initialisation: allowed, and said.
    const test_util::RunResult untrained = test_util::run_trainer(
        {"generate", "--config", "configs/tiny.json", "--prompt", "The", "--max-new-tokens", "2"});
    CHECK(untrained.exit_code == 0);
    CHECK_THAT(untrained.err,
               Contains("note: generate: no --load-path or --init-from: the model is the untrained initialisation of "
                        "seed 7"));
    CHECK(lines[2]["new_tokens"] == 24);
    CHECK_THAT(r.err, Contains("generated 24 tokens for 2 prompts"));
    // Greedy is the same with and without the cache, and the same again.
    const test_util::RunResult again =
        with({"--prompt", "The Congress", "--max-new-tokens", "12", "--json", "--no-stop-at-eos", "--no-kv-cache"});
    REQUIRE(again.exit_code == 0);
    const auto first_line = [](const std::string& out) { return Json::parse(out.substr(0, out.find('\n'))); };
    CHECK(first_line(again.out)["ids"] == lines[0]["ids"]);
    const test_util::RunResult none = with({});
    CHECK(none.exit_code != 0);
    CHECK_THAT(none.err, Contains("no prompt; give --prompt TEXT"));
    const test_util::RunResult bad = with({"--prompt-ids", "1, 999"});
    CHECK(bad.exit_code != 0);
    CHECK_THAT(bad.err, Contains("id 999 is not below the model's vocab_size 257"));
    // A tokenizer whose ids would read past the embedding table, for generate and for samples while training (the
    // tokenizers' files come from scripts/fetch_tokenizers.sh, as the tokenizer tests need them).
    const test_util::RunResult wide = with({"--tokenizer", "gpt2", "--prompt", "x"});
    CHECK(wide.exit_code != 0);
    CHECK_THAT(wide.err, Contains("generate --tokenizer gpt2: its 50257 ids do not fit the model's vocab_size 257"));
    const test_util::RunResult sampling =
        test_util::run_trainer({"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"),
                                "--max-duration", "2", "--set", "sample.interval=1", "--set", "sample.tokenizer=gpt2"});
    CHECK(sampling.exit_code != 0);
    CHECK_THAT(sampling.err, Contains("config sample.tokenizer gpt2: its 50257 ids do not fit the model's vocab_size"));
    // The byte tokenizer (the run's, by default) on a model of a BPE vocabulary: its text would be garbage.
    const std::vector<std::string> bpe_sized = {"--set", "model.vocab_size=50304", "--set",
                                                "model.embedding_size=50304"};
    std::vector<std::string> generate_bpe_sized = {"generate", "--config", "configs/tiny.json", "--prompt", "x"};
    generate_bpe_sized.insert(generate_bpe_sized.end(), bpe_sized.begin(), bpe_sized.end());
    const test_util::RunResult narrow = test_util::run_trainer(generate_bpe_sized);
    CHECK(narrow.exit_code != 0);
    CHECK_THAT(narrow.err, Contains("config tokenizer.identifier bytes: its 257 ids are fewer than half the model's "
                                    "vocab_size 50304"));
    std::vector<std::string> sample_bpe_sized = {"--config",       "configs/tiny.json",
                                                 "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                                 "--max-duration", "2",
                                                 "--set",          "sample.interval=1",
                                                 "--set",          "sample.tokenizer=bytes"};
    sample_bpe_sized.insert(sample_bpe_sized.end(), bpe_sized.begin(), bpe_sized.end());
    const test_util::RunResult narrow_sample = test_util::run_trainer(sample_bpe_sized);
    CHECK(narrow_sample.exit_code != 0);
    CHECK_THAT(narrow_sample.err, Contains("config sample.tokenizer bytes: its 257 ids are fewer than half"));
    // The run's tokenizer one the trainer does not have (OLMo-1B's): text is refused by name, ids are taken.
    const test_util::RunResult neox = with({"--set", "tokenizer.identifier=EleutherAI/gpt-neox-20b", "--prompt", "x"});
    CHECK(neox.exit_code != 0);
    CHECK_THAT(neox.err, Contains("generate --prompt: config tokenizer.identifier \"EleutherAI/gpt-neox-20b\" is a "
                                  "tokenizer the trainer does not have; give the prompts as ids (--prompt-ids)"));
    const test_util::RunResult neox_ids = with(
        {"--set", "tokenizer.identifier=EleutherAI/gpt-neox-20b", "--prompt-ids", "84, 104", "--max-new-tokens", "2"});
    INFO(neox_ids.err);
    CHECK(neox_ids.exit_code == 0);
    std::vector<std::string> sample_neox = {
        "--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"),    "--max-duration", "2",
        "--set",    "sample.interval=1", "--set",  "tokenizer.identifier=EleutherAI/gpt-neox-20b"};
    const test_util::RunResult neox_sample = test_util::run_trainer(sample_neox);
    CHECK(neox_sample.exit_code != 0);
    CHECK_THAT(neox_sample.err, Contains("config sample.prompt needs text tokenized, and config tokenizer.identifier "
                                         "\"EleutherAI/gpt-neox-20b\" is a tokenizer the trainer does not have"));
    const test_util::RunResult huge = with({"--prompt", "x", "--max-new-tokens", "2147483647"});
    CHECK(huge.exit_code != 0);
    CHECK_THAT(huge.err, Contains("generate --max-new-tokens: 2147483647; a prompt and its new tokens must fit "
                                  "model.max_sequence_length 65"));
    {
        std::ofstream big(dir.path("big.txt"));
        big << std::string(2 << 20, 'a');
    }
    const test_util::RunResult long_file = with({"--prompt-file", dir.path("big.txt")});
    CHECK(long_file.exit_code != 0);
    CHECK_THAT(long_file.err, Contains("generate --prompt-file " + dir.path("big.txt") + ": 2097152 bytes"));
    // A NUL in the text (byte 0 of the byte tokenizer) does not end the printed line.
    const test_util::RunResult nul = with({"--prompt-ids", "84, 0, 84", "--max-new-tokens", "2"});
    INFO(nul.err);
    REQUIRE(nul.exit_code == 0);
    CHECK(nul.out.find(std::string("T\0T", 3)) != std::string::npos);
    const test_util::RunResult hot = with({"--prompt", "x", "--top-p", "0"});
    CHECK(hot.exit_code != 0);
    CHECK_THAT(hot.err, Contains("--top-p: 0; expected above 0"));
    // --tokenizer none: ids in and out (the Llama fixture's 90 ids fit no tokenizer), the same ids as with text.
    const test_util::RunResult ids = with({"--tokenizer", "none", "--prompt-ids", "84, 104, 101", "--max-new-tokens",
                                           "12", "--json", "--no-stop-at-eos"});
    INFO(ids.err);
    REQUIRE(ids.exit_code == 0);
    CHECK_FALSE(first_line(ids.out).contains("text"));
    CHECK(first_line(ids.out)["ids"] ==
          first_line(with({"--prompt", "The", "--max-new-tokens", "12", "--json", "--no-stop-at-eos"}).out)["ids"]);
    const test_util::RunResult llama = test_util::run_trainer(
        {"generate", "--config", fixture("llama_tiny.json"), "--init-from", fixture("llama_tiny_init.safetensors"),
         "--tokenizer", "none", "--prompt-ids", "1, 2, 3", "--max-new-tokens", "4", "--no-stop-at-eos"});
    INFO(llama.err);
    REQUIRE(llama.exit_code == 0);
    CHECK_THAT(llama.out, Contains("1 2 3 | "));
    const test_util::RunResult text = with({"--tokenizer", "none", "--prompt", "The"});
    CHECK(text.exit_code != 0);
    CHECK_THAT(text.err, Contains("--tokenizer none takes its prompts as ids (--prompt-ids)"));
}
