// The byte tokenizer and the data preparation that writes token files for the trainer (the BPE
// tokenizers, gpt2 and cl100k, are in bpe.h; prepare_data_bpe writes their token files).
//
// Byte tokenizer: token ids 0..255 are the bytes themselves; the EOS id follows each document
// (default 256, so the vocabulary is 257). It needs no vocabulary file, which makes it the tokenizer
// of the tests, the golden loss curve and any corpus that is not yet tokenized.
//
// prepare_data_bytes writes one token file from whole input files, each input file one document:
// bytes of document 1, EOS, bytes of document 2, EOS, ... in one of the layouts TokenFile reads
// (raw memmap, .npy version 1.0, llm.c shard). It writes OUTPUT.tmp and renames it over OUTPUT, so a
// failure never leaves a half-written OUTPUT (an existing OUTPUT is replaced: it is regenerated).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/data/bpe.h"
#include "core/data/data.h"

namespace trainer {

// The byte tokenizer's EOS id and vocabulary size with that EOS.
constexpr int kByteEosTokenId = 256;
constexpr int kByteVocabSize = 257;

// Token ids of `text`: one per byte, 0..255. No EOS is added.
std::vector<int32_t> byte_encode(const std::string& text);

// Text of `ids`: ids 0..255 become their byte, `eos_token_id` becomes "<|endoftext|>" and any other
// id "<|N|>" (a sampled id the byte tokenizer does not know, shown rather than dropped).
std::string byte_decode(const std::vector<int32_t>& ids, int eos_token_id = kByteEosTokenId);

// Token ids written as numbers separated by spaces, commas or brackets ("[1, 2, 3]", "1 2 3"); anything else is a
// UserError naming `what` (the flag it came from) and the text.
std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what);

// What prepare_data_bytes wrote.
struct PrepareDataSummary {
    int64_t documents = 0;      // input files
    int64_t tokens = 0;         // token ids written, EOS included
    int64_t bytes_written = 0;  // size of the output file, header included
    std::string output;         // the output path
    std::string format;         // "raw", "npy" or "llmc"
    TokenDtype dtype = TokenDtype::kUint16;

    // One line for the log: "wrote OUT (npy, uint16): 3 documents, 1234 tokens, 2596 bytes".
    std::string to_string() const;
};

// prepare-data's output, checked before any work: refused when it is one of the inputs (its text would be
// replaced by its tokens), and when it exists unless `overwrite` (prepare-data --overwrite), naming it.
void check_prepare_output(const std::vector<std::string>& inputs, const std::string& output, bool overwrite);

// Tokenizes each input file with the byte tokenizer into one token file at `output`.
// `format` is "raw", "npy" or "llmc"; llmc requires uint16 and at most INT32_MAX tokens.
// UserError, before anything is written, when there are no inputs, an input is missing or not a
// regular file (named), the format or EOS id is not allowed (EOS must be >= 256 and fit `dtype`);
// UserError naming the path on any read or write failure, with OUTPUT.tmp removed.
PrepareDataSummary prepare_data_bytes(const std::vector<std::string>& inputs, const std::string& output,
                                      TokenDtype dtype, const std::string& format, int eos_token_id = kByteEosTokenId);

// Tokenizes each input file with a BPE tokenizer (gpt2, cl100k; bpe.h) into one token file at `output`,
// the documents encoded `threads` at a time (0: one per core) and written in input order, each followed by
// `eos_token_id`. The same checks as prepare_data_bytes; UserError when the tokenizer's ids do not fit
// `dtype`, or naming the input and byte offset of invalid UTF-8.
PrepareDataSummary prepare_data_bpe(const std::vector<std::string>& inputs, const std::string& output, TokenDtype dtype,
                                    const std::string& format, int eos_token_id, const BpeTokenizer& tokenizer,
                                    int threads);

// prepare-data --instruct (core/data/instruct.h): JSONL instruction records rendered through `chat_template` ("tulu"
// or a file), each text piece encoded by `encode`, laid out as instances of seq_len tokens (each example padded to
// one with pad_id, or packed), written to `output` (`format`, `dtype`) and their label mask to `output`.mask (one
// byte a token, OLMo's raw boolean memmap). Both files are written beside their names and renamed into place at
// the end. UserError naming the file and line of a bad record. Returns the summary line.
struct InstructOptions {
    int64_t seq_len = 0;
    std::string chat_template = "tulu";
    bool pack = false, train_on_prompt = false;
    int pad_id = -1;  // -1: the EOS id
};
std::string prepare_instruct_data(const std::vector<std::string>& inputs, const std::string& output, TokenDtype dtype,
                                  const std::string& format, int eos_token_id,
                                  const std::function<std::vector<int32_t>(const std::string&)>& encode,
                                  const InstructOptions& options);

}  // namespace trainer
