// Text in and out of token ids for generation and the training run's sample (text_codec.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/choices.h"

namespace trainer {

class BpeTokenizer;

// The tokenizer the data was made with: the byte tokenizer (EOS `eos`), a BPE one (gpt2, cl100k, dolma2) from `dir`,
// or none (nullopt: ids in and out, for a vocabulary no tokenizer here makes).
class TextCodec {
   public:
    // For a model of `model_vocab` ids: a tokenizer whose ids do not all fit it is refused, naming `what` (the key or
    // flag that chose it), since its ids would read past the embedding table; so is one with fewer than half as many
    // ids (the byte tokenizer on a BPE model), which cannot be the tokenizer the model was trained with.
    // Without a tokenizer, encode refuses text saying `no_text` (why there is none).
    TextCodec(std::optional<Tokenizer> tokenizer, const std::string& dir, int eos, int model_vocab,
              const std::string& what,
              const std::string& no_text = "--tokenizer none takes its prompts as ids (--prompt-ids)");
    ~TextCodec();
    bool has_text() const { return tokenizer_.has_value(); }
    int vocab_size() const;  // 0 without text
    // Refused without text, naming `what`.
    std::vector<int32_t> encode(const std::string& text, const std::string& what) const;
    // Without text: the ids, each followed by a space.
    std::string decode(const std::vector<int32_t>& ids) const;

   private:
    std::optional<Tokenizer> tokenizer_;
    int eos_;
    std::string no_text_;
    std::unique_ptr<BpeTokenizer> bpe_;
};

}  // namespace trainer
