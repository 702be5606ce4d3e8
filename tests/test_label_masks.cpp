// Label masks (OLMo's data.label_mask_paths): the mask files as OLMo writes them and their refusals, the loss as
// cross_entropy(ignore_index) over the same masks, no gradient from a masked target, and the same loss and
// tokens_in_loss on any world size and strategy.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/config.h"
#include "core/data/data.h"
#include "core/data/instruct.h"
#include "core/data/tokenizer.h"
#include "parallel/launch/rank_env.h"
#include "parallel/setup.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::fixture;
using test_util::TempDir;

namespace {

std::string bytes_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// A .npy file of `mask` as numpy writes a bool array (descr '|b1').
std::string npy_bool(const std::vector<uint8_t>& mask, const std::string& descr = "|b1") {
    return npy_header(descr.c_str(), {static_cast<int64_t>(mask.size())}) + bytes_of(mask);
}

// A pseudo-random mask of n tokens with about a third of them out of the loss.
std::vector<uint8_t> some_mask(size_t n, uint32_t seed) {
    std::vector<uint8_t> m(n);
    uint32_t x = seed;
    for (size_t i = 0; i < n; ++i) {
        x = x * 1664525u + 1013904223u;
        m[i] = (x >> 24) % 3 == 0 ? 0 : 1;
    }
    return m;
}

int64_t tokens_in(const std::string& path) { return TokenFile(path, TokenDtype::kUint16).num_tokens(); }

// The fixture's tiny OLMo model, its init and its tokens (17 tokens an instance, unshuffled), `steps` steps.
std::vector<std::string> olmo_tiny(const std::string& steps, const std::string& metrics) {
    return {"--config",       fixture("olmo_tiny.json"),
            "--init-from",    fixture("olmo_tiny_init.safetensors"),
            "--max-duration", steps,
            "--metrics-file", metrics,
            "--set",          "console_log_interval=1"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& more) {
    a.insert(a.end(), more.begin(), more.end());
    return a;
}

std::vector<Json> run_ok(const std::vector<std::string>& args, const std::string& metrics) {
    const auto r = test_util::run_trainer(args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    return test_util::read_metrics(metrics);
}

}  // namespace

TEST_CASE("label masks: mask files are read as OLMo writes them and refused by name where they do not fit") {
    TempDir dir;
    const std::string tokens = fixture("olmo_tiny_tokens.u16");
    const int64_t n = tokens_in(tokens);
    const std::vector<uint8_t> mask = some_mask(static_cast<size_t>(n), 7);
    test_util::write_file(dir.path("raw.mask"), bytes_of(mask));
    test_util::write_file(dir.path("mask.npy"), npy_bool(mask));
    const int L = 17;
    for (const std::string& file : {dir.path("raw.mask"), dir.path("mask.npy")}) {
        CAPTURE(file);
        const TokenDataset data({tokens}, TokenDtype::kUint16, L, 1000, "data.paths", {file});
        CHECK(data.has_label_masks());
        std::vector<uint8_t> got(L);
        for (const int64_t i : {int64_t{0}, int64_t{3}, data.num_instances() - 1}) {
            data.read_label_mask(i, got.data());
            CHECK(std::memcmp(got.data(), mask.data() + i * L, L) == 0);
        }
    }
    // No mask: every token a target.
    const TokenDataset plain({tokens}, TokenDtype::kUint16, L, 1000);
    CHECK_FALSE(plain.has_label_masks());
    std::vector<uint8_t> all(L, 0);
    plain.read_label_mask(2, all.data());
    CHECK(all == std::vector<uint8_t>(L, 1));

    const auto refused = [&](const std::vector<std::string>& masks, const std::string& expected) {
        CAPTURE(expected);
        try {
            const TokenDataset data({tokens}, TokenDtype::kUint16, L, 1000, "data.paths", masks);
            std::vector<uint8_t> got(L);
            for (int64_t i = 0; i < data.num_instances(); ++i) data.read_label_mask(i, got.data());
            FAIL("accepted");
        } catch (const UserError& e) {
            CHECK_THAT(std::string(e.what()), Contains(expected));
        }
    };
    std::vector<uint8_t> shorter(mask.begin(), mask.end() - 1);
    test_util::write_file(dir.path("short.mask"), bytes_of(shorter));
    refused({dir.path("short.mask")}, "config data.label_mask_paths[0]: the label mask file " + dir.path("short.mask") +
                                          " has " + std::to_string(n - 1) + " entries and its token file " + tokens +
                                          " has " + std::to_string(n) + " tokens; expected one a token");
    std::vector<uint8_t> two = mask;
    two[40] = 2;
    test_util::write_file(dir.path("two.mask"), bytes_of(two));
    refused({dir.path("two.mask")}, "label mask file " + dir.path("two.mask") +
                                        ": value 2 at token offset 40 (byte offset 40); expected 0 or 1 (a boolean)");
    test_util::write_file(dir.path("u2.npy"), npy_bool(mask, "<u2"));
    refused({dir.path("u2.npy")},
            "label mask file " + dir.path("u2.npy") + ": npy descr '<u2'; expected '|b1' (bool) or '|u1' (uint8)");
    refused({dir.path("missing.mask")}, "label mask file " + dir.path("missing.mask") + ": cannot open");
    refused({dir.path("raw.mask"), dir.path("raw.mask")},
            "config data.label_mask_paths: 2 files for the 1 token files of data.paths");
    // A mask that marks nothing of its file's instances (a 1 only past the last whole instance, where no instance
    // reads it) trains on nothing; one 1 anywhere in them is enough.
    std::vector<uint8_t> nothing(mask.size(), 0);
    nothing.back() = static_cast<uint8_t>(n % L != 0);
    test_util::write_file(dir.path("nothing.mask"), bytes_of(nothing));
    refused({dir.path("nothing.mask")}, "config data.label_mask_paths[0]: the label mask file " +
                                            dir.path("nothing.mask") + " marks no token of " + tokens +
                                            "'s instances for the loss (every byte 0)");
    nothing[static_cast<size_t>(L + 3)] = 1;
    test_util::write_file(dir.path("one.mask"), bytes_of(nothing));
    CHECK(TokenDataset({tokens}, TokenDtype::kUint16, L, 1000, "data.paths", {dir.path("one.mask")}).has_label_masks());

    // The config: one a token file, in its order; a mixture's are its sources'; not with CUDA graphs.
    const auto config_error = [&](const std::vector<std::string>& sets, const std::string& expected) {
        CAPTURE(expected);
        std::vector<std::string> a = {"--config", "configs/tiny.json", "--data", tokens, "--max-duration", "1"};
        for (const std::string& s : sets) a.insert(a.end(), {"--set", s});
        const auto r = test_util::run_trainer(a);
        CHECK(r.exit_code != 0);
        CHECK_THAT(r.err, Contains(expected));
    };
    config_error({"data.label_mask_paths=[\"" + dir.path("raw.mask") + "\", \"" + dir.path("raw.mask") + "\"]"},
                 "config data.label_mask_paths: 2 files for the 1 of data.paths; expected one label mask a token "
                 "file, in its order");
    // OLMo's YAML key maps to the same key, one file a token file.
    std::string yaml = test_util::read_file(fixture("olmo_1b_style.yaml"));
    const size_t at = yaml.find("  timeout: 0\n");
    REQUIRE(at != std::string::npos);
    yaml.insert(at, "  label_mask_paths:\n    - " + dir.path("raw.mask") + "\n");
    test_util::write_file(dir.path("olmo.yaml"), yaml);
    const auto shown = test_util::run_trainer(
        {"show-config", "--config", dir.path("olmo.yaml"), "--data", tokens, "--save-folder", dir.path("ck")});
    INFO(shown.err);
    REQUIRE(shown.exit_code == 0);
    CHECK(Json::parse(shown.out)["data"]["label_mask_paths"] == Json::array({dir.path("raw.mask")}));
    // CUDA graphs replay one loss scale, and masks change it every step: refused before anything runs (on a
    // GPU's config: the CPU refuses kernels.cuda_graphs on its own).
    Json doc = Json::parse(test_util::read_file(test_util::source_dir() + "/configs/tiny.json"));
    doc["data"]["paths"] = Json::array({tokens});
    doc["data"]["label_mask_paths"] = Json::array({dir.path("raw.mask")});
    doc["kernels"]["cuda_graphs"] = true;
    try {
        check_parallel_config(validate_config(doc), RankEnv{}, Device::kCuda);
        FAIL("kernels.cuda_graphs with label masks was accepted");
    } catch (const UserError& e) {
        CHECK_THAT(std::string(e.what()), Contains("kernels.cuda_graphs with label masks (data.label_mask_paths)"));
    }
}

TEST_CASE("label masks: the loss is cross_entropy(ignore_index) over the masks and its mean over the tokens in loss") {
    // Step 1 of the fixture model from its init on its first 8 instances: the metrics' loss and tokens_in_loss
    // against the cross-entropy of `trainer logits`' logits over the targets whose mask is 1.
    TempDir dir;
    const std::string tokens = fixture("olmo_tiny_tokens.u16");
    const std::vector<uint8_t> mask = some_mask(static_cast<size_t>(tokens_in(tokens)), 11);
    test_util::write_file(dir.path("m.mask"), bytes_of(mask));
    const auto rows = run_ok(
        with(olmo_tiny("1", dir.path("m.jsonl")), {"--set", "data.label_mask_paths=[\"" + dir.path("m.mask") + "\"]"}),
        dir.path("m.jsonl"));
    REQUIRE(rows.size() == 1);
    const auto lr = test_util::run_trainer({"logits", "--config", fixture("olmo_tiny.json"), "--init-from",
                                            fixture("olmo_tiny_init.safetensors"), "--instances", "8", "-o",
                                            dir.path("logits.npy")});
    INFO(lr.out << lr.err);
    REQUIRE(lr.exit_code == 0);
    const std::string bytes = test_util::read_file(dir.path("logits.npy"));
    const size_t header = 10 + static_cast<unsigned char>(bytes[8]) + 256 * static_cast<unsigned char>(bytes[9]);
    const Json cfg = Json::parse(test_util::read_file(fixture("olmo_tiny.json")));
    const int V = cfg["model"]["embedding_size"], L = cfg["model"]["max_sequence_length"];
    REQUIRE(cfg["global_train_batch_size"] == 8);
    REQUIRE(bytes.size() == header + 8 * static_cast<size_t>(L - 1) * V * 4);
    const TokenDataset data({tokens}, TokenDtype::kUint16, L, cfg["model"]["vocab_size"], "data.paths",
                            {dir.path("m.mask")});
    std::vector<int32_t> ids(L);
    std::vector<uint8_t> m(L);
    double total = 0.0;
    long in_loss = 0;
    for (int i = 0; i < 8; ++i) {
        data.read_instance(i, ids.data());
        data.read_label_mask(i, m.data());
        for (int t = 0; t < L - 1; ++t) {
            if (m[t + 1] == 0) continue;  // ignore_index: the target at position t is token t + 1
            std::vector<float> row(V);
            std::memcpy(row.data(), bytes.data() + header + ((static_cast<size_t>(i) * (L - 1) + t) * V) * 4, V * 4);
            double mx = row[0], sum = 0.0;
            for (int j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
            for (int j = 0; j < V; ++j) sum += std::exp(row[j] - mx);
            total += mx + std::log(sum) - row[ids[t + 1]];
            ++in_loss;
        }
    }
    REQUIRE(in_loss > 0);
    REQUIRE(in_loss < 8 * (L - 1));
    CHECK(rows[0]["tokens_in_loss"] == in_loss);
    const double loss = rows[0]["loss"];
    CHECK(std::fabs(loss - total / in_loss) <= 1e-5 * loss);
    // A mask of all ones is no mask: the same losses bit for bit as without one.
    test_util::write_file(dir.path("ones.mask"), std::string(static_cast<size_t>(tokens_in(tokens)), '\1'));
    const auto ones = run_ok(with(olmo_tiny("3", dir.path("ones.jsonl")),
                                  {"--set", "data.label_mask_paths=[\"" + dir.path("ones.mask") + "\"]"}),
                             dir.path("ones.jsonl"));
    const auto none = run_ok(olmo_tiny("3", dir.path("none.jsonl")), dir.path("none.jsonl"));
    test_util::check_losses(none, ones, 0, 0.0);
    CHECK(ones[0]["tokens_in_loss"] == 8 * (L - 1));
    CHECK_FALSE(none[0].contains("tokens_in_loss"));
}

TEST_CASE(
    "label masks: a masked target changes no gradient nor validation loss and both are the same on any world size") {
    TempDir dir;
    const std::string tokens = fixture("olmo_tiny_tokens.u16");
    const int64_t n = tokens_in(tokens);
    const int L = 17;
    // Every instance's last token is only a target (no position reads it): masked out, and changed in a copy of
    // the tokens, the run is the same bit for bit (its gradient norm and the losses after).
    std::vector<uint8_t> mask = some_mask(static_cast<size_t>(n), 5);
    std::string changed = test_util::read_file(tokens);
    for (int64_t i = L - 1; i < n; i += L) {
        mask[static_cast<size_t>(i)] = 0;
        changed[2 * static_cast<size_t>(i)] = static_cast<char>((changed[2 * static_cast<size_t>(i)] + 1) % 50);
        changed[2 * static_cast<size_t>(i) + 1] = 0;
    }
    test_util::write_file(dir.path("m.mask"), bytes_of(mask));
    test_util::write_file(dir.path("changed.u16"), changed);
    const std::string masks = "data.label_mask_paths=[\"" + dir.path("m.mask") + "\"]";
    // An evaluator over the same tokens with the same mask, after every step.
    const auto evaluator = [&](const std::string& file) {
        return std::vector<std::string>{"--set", "eval_interval=1", "--set",
                                        R"(evaluators=[{"label": "sft", "data": {"paths": [")" + file +
                                            R"("], "label_mask_paths": [")" + dir.path("m.mask") + R"("]}}])"};
    };
    const auto a = run_ok(with(olmo_tiny("3", dir.path("a.jsonl")), with({"--set", masks}, evaluator(tokens))),
                          dir.path("a.jsonl"));
    const auto b =
        run_ok(with(olmo_tiny("3", dir.path("b.jsonl")),
                    with({"--data", dir.path("changed.u16"), "--set", masks}, evaluator(dir.path("changed.u16")))),
               dir.path("b.jsonl"));
    REQUIRE(a.size() == 3);
    test_util::check_losses(a, b, 0, 0.0);
    for (size_t s = 0; s < a.size(); ++s) {
        CHECK(a[s]["grad_norm"] == b[s]["grad_norm"]);
        REQUIRE(a[s].contains("val_loss"));
        CHECK(a[s]["val_loss"] == b[s]["val_loss"]);
    }
    // The evaluator's mask is its loss's: without it the validation loss differs.
    const auto plain_eval = run_ok(with(olmo_tiny("1", dir.path("e.jsonl")),
                                        {"--set", masks, "--set", "eval_interval=1", "--set",
                                         R"(evaluators=[{"label": "sft", "data": {"paths": [")" + tokens + R"("]}}])"}),
                                   dir.path("e.jsonl"));
    CHECK(plain_eval[0]["val_loss"] != a[0]["val_loss"]);
    // Unmasked, the changed targets change the loss (the check above could not pass by reading nothing).
    const auto c = run_ok(olmo_tiny("1", dir.path("c.jsonl")), dir.path("c.jsonl"));
    const auto d =
        run_ok(with(olmo_tiny("1", dir.path("d.jsonl")), {"--data", dir.path("changed.u16")}), dir.path("d.jsonl"));
    CHECK(c[0]["loss"] != d[0]["loss"]);

    // 2 ranks under DDP and FULL_SHARD, 4 under SHARD_GRAD_OP (fp32 FSDP: mixed gathers bf16 parameters): the
    // single process's losses and tokens_in_loss.
    for (const auto& [ranks, strategy] : std::vector<std::pair<int, std::vector<std::string>>>{
             {2, {"--strategy", "ddp"}},
             {2, {"--strategy", "fsdp", "--set", "fsdp.precision=fp32", "--set", "fsdp.sharding_strategy=FULL_SHARD"}},
             {4,
              {"--strategy", "fsdp", "--set", "fsdp.precision=fp32", "--set",
               "fsdp.sharding_strategy=SHARD_GRAD_OP"}}}) {
        CAPTURE(ranks, strategy);
        const std::string metrics = dir.path("w" + std::to_string(ranks) + strategy.back() + ".jsonl");
        const auto w = run_ok(
            test_util::launch_args(
                ranks, with(with(olmo_tiny("3", metrics), with({"--set", masks, "--threads", "1"}, evaluator(tokens))),
                            strategy)),
            metrics);
        REQUIRE(w.size() == a.size());
        test_util::check_losses(a, w, 0, 1e-5);
        for (size_t s = 0; s < a.size(); ++s) {
            CHECK(w[s]["tokens_in_loss"] == a[s]["tokens_in_loss"]);
            CHECK(std::fabs(w[s]["val_loss"].get<double>() - a[s]["val_loss"].get<double>()) <=
                  1e-5 * a[s]["val_loss"].get<double>());
        }
    }
}

TEST_CASE("label masks: prepare-data --instruct renders chat and Alpaca records with only the answers in the loss") {
    // The byte tokenizer: a token is a byte, so the rendered text and its mask read back directly.
    const ChatTemplate tulu = tulu_chat_template();
    const TextEncoder bytes = [](const std::string& text) { return byte_encode(text); };
    const auto shown = [](const InstructExample& ex) {  // the text, and the text with what is out of the loss as '_'
        std::string text, loss;
        for (size_t i = 0; i < ex.ids.size(); ++i) {
            const std::string piece =
                ex.ids[i] == kByteEosTokenId ? "<E>" : std::string(1, static_cast<char>(ex.ids[i]));
            text += piece;
            loss += ex.in_loss[i] ? piece : std::string(piece.size(), '_');
        }
        return std::make_pair(text, loss);
    };
    const InstructExample chat = render_instruct_record(
        R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"}]})",
        tulu, bytes, kByteEosTokenId, false, "t line 1");
    const auto [text, loss] = shown(chat);
    CHECK(text == "<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n4<E>\n<|user|>\n3+3?\n<|assistant|>\n6<E>");
    CHECK(loss == std::string(49, '_') + "4<E>\n" + std::string(28, '_') + "6<E>");
    const auto [all_text, all_loss] = shown(render_instruct_record(
        R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})", tulu, bytes,
        kByteEosTokenId, true, "t line 2"));
    CHECK(all_loss == all_text);  // --train-on-prompt
    const auto [alpaca, alpaca_loss] =
        shown(render_instruct_record(R"({"instruction": "Reverse the word.", "input": "abc", "output": "cba"})", tulu,
                                     bytes, kByteEosTokenId, false, "t line 3"));
    CHECK(alpaca ==
          "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
          "response that appropriately completes the request.\n\n### Instruction:\nReverse the word.\n\n### "
          "Input:\nabc\n\n### Response:\ncba<E>");
    CHECK(alpaca_loss == std::string(alpaca.size() - 6, '_') + "cba<E>");
    const auto [plain, plain_loss] = shown(render_instruct_record(R"({"instruction": "Say hi.", "output": "hi"})", tulu,
                                                                  bytes, kByteEosTokenId, false, "t line 4"));
    CHECK(plain.rfind("Below is an instruction that describes a task. Write a response", 0) == 0);
    CHECK(plain_loss.substr(plain_loss.size() - 5) == "hi<E>");

    // A template from a file: each role's prefix, suffix, suffix_if_last and EOS; a role or key it lacks or does not
    // know is refused by name.
    TempDir dir;
    test_util::write_file(dir.path("t.json"), R"({"system": {"prefix": "S:"}, "user": {"prefix": "U:", "suffix": "|"},
        "assistant": {"prefix": "A:", "suffix": "|", "suffix_if_last": ".", "eos": true}})");
    const auto [mine, mine_loss] = shown(render_instruct_record(
        R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})",
        chat_template_named(dir.path("t.json")), bytes, kByteEosTokenId, false, "t line 5"));
    CHECK(mine == "U:q|A:a<E>.");
    CHECK(mine_loss == "______a<E>.");
    for (const auto& [text, expected] : std::vector<std::pair<std::string, std::string>>{
             {R"({"user": {}, "assistant": {}})", "no \"system\" entry"},
             {R"({"user": {}, "assistant": {}, "system": {}, "tool": {}})", "role \"tool\"; expected system"},
             {R"({"user": {"prefx": "U"}, "assistant": {}, "system": {}})", "user.prefx: unknown"}}) {
        test_util::write_file(dir.path("bad.json"), text);
        try {
            (void)chat_template_named(dir.path("bad.json"));
            FAIL("accepted " << text);
        } catch (const UserError& e) {
            CHECK_THAT(std::string(e.what()), Contains("chat template " + dir.path("bad.json") + ": " + expected));
        }
    }

    // Records that cannot be rendered are refused with their file and line.
    for (const auto& [line, expected] : std::vector<std::pair<std::string, std::string>>{
             {R"({"foo": 1})", "f line 9: neither \"messages\" (a chat record) nor \"instruction\" and \"output\""},
             {R"({"messages": [{"role": "robot", "content": "x"}]})",
              "f line 9: messages[0]: role \"robot\"; expected system, user or assistant"},
             {R"({"messages": [{"role": "user", "content": "x"}]})", "f line 9: no assistant message"},
             {R"({"instruction": "x"})", "f line 9: no \"output\""},
             {R"({"messages": [{"role": "user", "content": 3}]})", "f line 9: messages[0]: \"content\" is 3"},
             {"{not json", "f line 9"}}) {
        CAPTURE(line);
        try {
            (void)render_instruct_record(line, tulu, bytes, kByteEosTokenId, false, "f line 9");
            FAIL("rendered");
        } catch (const UserError& e) {
            CHECK_THAT(std::string(e.what()), Contains(expected));
        }
    }

    // One example an instance, padded with out-of-loss pad tokens; packed, several an instance and never one split.
    std::vector<InstructExample> examples(3);
    for (size_t i = 0; i < examples.size(); ++i) {
        examples[i].ids.assign(4 + i, static_cast<int32_t>(10 + i));
        examples[i].in_loss.assign(4 + i, 1);
    }
    const InstructLayout padded = lay_out_examples(examples, 8, false, 99);
    CHECK(padded.instances == 3);
    CHECK(padded.tokens == std::vector<int32_t>{10, 10, 10, 10, 99, 99, 99, 99, 11, 11, 11, 11,
                                                11, 99, 99, 99, 12, 12, 12, 12, 12, 12, 99, 99});
    CHECK(padded.mask == std::vector<uint8_t>{1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0});
    const InstructLayout packed = lay_out_examples(examples, 10, true, 99);
    CHECK(packed.instances == 2);  // 4 + 5 in the first, 6 alone
    CHECK(packed.tokens ==
          std::vector<int32_t>{10, 10, 10, 10, 11, 11, 11, 11, 11, 99, 12, 12, 12, 12, 12, 12, 99, 99, 99, 99});
    CHECK(packed.efficiency() == Approx(15.0 / 20.0));
    const InstructLayout cut = lay_out_examples(examples, 5, false, 99);
    CHECK(cut.truncated == 1);
}

TEST_CASE("label masks: prepare-data --instruct writes a token file and mask that train with the answers in the loss") {
    TempDir dir;
    std::string jsonl;
    for (int i = 0; i < 24; ++i) {
        jsonl +=
            fmt::format(
                R"({{"messages": [{{"role": "user", "content": "Count to {}."}}, {{"role": "assistant", "content": "{}"}}]}})",
                i % 7, std::string(static_cast<size_t>(i % 7 + 1), static_cast<char>('1' + i % 7))) +
            "\n";
        jsonl += fmt::format(R"({{"instruction": "Echo {}", "output": "{}"}})", i, i) + "\n";
    }
    test_util::write_file(dir.path("sft.jsonl"), jsonl);
    const auto prep = test_util::run_trainer(
        {"prepare-data", "--instruct", "--seq-len", "65", "--pack", dir.path("sft.jsonl"), "-o", dir.path("sft.bin")});
    INFO(prep.out << prep.err);
    REQUIRE(prep.exit_code == 0);
    CHECK_THAT(prep.out, Contains("48 examples in") && Contains("(packed)") &&
                             Contains("label mask " + dir.path("sft.bin.mask")));
    // Without --overwrite an existing output (or its mask) is refused; the flags of --instruct need it.
    const auto again = test_util::run_trainer(
        {"prepare-data", "--instruct", "--seq-len", "65", dir.path("sft.jsonl"), "-o", dir.path("sft.bin")});
    CHECK(again.exit_code != 0);
    CHECK_THAT(again.err, Contains("already exists"));
    const auto stray =
        test_util::run_trainer({"prepare-data", "--pack", dir.path("sft.jsonl"), "-o", dir.path("x.bin")});
    CHECK_THAT(stray.err, Contains("go with --instruct"));
    // A negative id or thread count is refused (not read as "the default"); --seq-len is named when missing.
    for (const auto& flag : {"--pad", "--eos", "--threads"}) {
        CAPTURE(flag);
        const auto negative = test_util::run_trainer({"prepare-data", "--instruct", "--seq-len", "65", flag, "-1",
                                                      dir.path("sft.jsonl"), "-o", dir.path("neg.bin")});
        CHECK(negative.exit_code != 0);
        CHECK_THAT(negative.err, Contains(flag));
        CHECK_FALSE(std::filesystem::exists(dir.path("neg.bin")));
    }
    const auto no_len =
        test_util::run_trainer({"prepare-data", "--instruct", dir.path("sft.jsonl"), "-o", dir.path("n.bin")});
    CHECK(no_len.exit_code != 0);
    CHECK_THAT(no_len.err, Contains("--seq-len is required"));
    // Examples whose answers are all cut away leave nothing in the loss: refused, and nothing written.
    test_util::write_file(dir.path("long.jsonl"),
                          R"({"instruction": ")" + std::string(200, 'a') + R"(", "output": "b"})" + "\n");
    const auto cut = test_util::run_trainer(
        {"prepare-data", "--instruct", "--seq-len", "32", dir.path("long.jsonl"), "-o", dir.path("cut.bin")});
    CHECK(cut.exit_code == 1);
    CHECK_THAT(cut.err, Contains("no token of the 1 examples is in the loss: 1 of them lost every answer token"));
    CHECK_FALSE(std::filesystem::exists(dir.path("cut.bin")));
    CHECK_FALSE(std::filesystem::exists(dir.path("cut.bin.mask")));
    // tiny.json (bytes, 65 tokens an instance) trains on it: tokens_in_loss is the batch's mask count.
    const std::string metrics = dir.path("m.jsonl");
    const auto rows =
        run_ok({"--config", "configs/tiny.json", "--data", dir.path("sft.bin"), "--max-duration", "2", "--metrics-file",
                metrics, "--set", "data.label_mask_paths=[\"" + dir.path("sft.bin.mask") + "\"]", "--set",
                "data.shuffle=false", "--set", "global_train_batch_size=4", "--set", "device_train_microbatch_size=4",
                "--set", "console_log_interval=1"},
               metrics);
    REQUIRE(rows.size() == 2);
    const TokenDataset data({dir.path("sft.bin")}, TokenDtype::kUint16, 65, 257, "data.paths",
                            {dir.path("sft.bin.mask")});
    std::vector<uint8_t> m(65);
    long want = 0;
    for (int i = 0; i < 4; ++i) {
        data.read_label_mask(i, m.data());
        for (int t = 1; t < 65; ++t) want += m[t];
    }
    CHECK(want > 0);
    CHECK(rows[0]["tokens_in_loss"] == want);
    CHECK(std::isfinite(rows[1]["loss"].get<double>()));
}
