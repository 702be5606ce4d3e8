// Text in and out of token ids (see text_codec.h).
#include "core/data/text_codec.h"

#include "base/common.h"
#include "core/data/bpe.h"
#include "core/data/tokenizer.h"

namespace trainer {

TextCodec::TextCodec(std::optional<Tokenizer> tokenizer, const std::string& dir, int eos, int model_vocab,
                     const std::string& what, const std::string& no_text)
    : tokenizer_(tokenizer), eos_(eos), no_text_(no_text) {
    if (tokenizer && *tokenizer != Tokenizer::kBytes) bpe_ = BpeTokenizer::load(*tokenizer, dir);
    if (vocab_size() > model_vocab) {
        user_error("{} {}: its {} ids do not fit the model's vocab_size {} (the tokenizer the data was made with?)",
                   what, choice_name(*tokenizer), vocab_size(), model_vocab);
    }
    // A vocabulary less than half the model's is not the one the model was trained with (bytes, the default, on a
    // 50,000-id model): its text would be another tokenizer's ids read as these, garbage with exit 0.
    if (has_text() && 2L * vocab_size() < model_vocab) {
        user_error(
            "{} {}: its {} ids are fewer than half the model's vocab_size {}, so the model was trained with another "
            "tokenizer; name that one (bytes, gpt2, cl100k, dolma2), or none to give and take token ids",
            what, choice_name(*tokenizer), vocab_size(), model_vocab);
    }
}
TextCodec::~TextCodec() = default;
int TextCodec::vocab_size() const {
    if (!has_text()) return 0;
    return bpe_ ? bpe_->vocab_size() : kByteVocabSize;
}
std::vector<int32_t> TextCodec::encode(const std::string& text, const std::string& what) const {
    if (!has_text()) user_error("{}: {}", what, no_text_);
    return bpe_ ? bpe_->encode(text, what) : byte_encode(text);
}
std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
    if (!has_text()) {
        std::string out;
        for (int32_t id : ids) out += std::to_string(id) + " ";
        return out;
    }
    return bpe_ ? bpe_->decode(ids) : byte_decode(ids, eos_);
}

}  // namespace trainer
