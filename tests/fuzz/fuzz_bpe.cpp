// The BPE tokenizers (gpt2, cl100k, dolma2; their files from scripts/fetch_tokenizers.sh, found through
// TRAINER_TOKENIZERS): any bytes (runs expanded, fuzz_common.h) as a document. Valid UTF-8 must decode back to itself
// exactly (dolma2's added tokens included); invalid UTF-8 and cl100k's special tokens are refused with a UserError.
#include "core/data/bpe.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const auto gpt2 = trainer::BpeTokenizer::load(trainer::Tokenizer::kGpt2, trainer::default_tokenizer_dir());
    static const auto cl100k =
        trainer::BpeTokenizer::load(trainer::Tokenizer::kCl100k, trainer::default_tokenizer_dir());
    static const auto dolma2 =
        trainer::BpeTokenizer::load(trainer::Tokenizer::kDolma2, trainer::default_tokenizer_dir());
    const std::string text = fuzz::expand(data, size);  // long runs: a merge that rescans times out
    for (const auto* t : {gpt2.get(), cl100k.get(), dolma2.get()}) {
        fuzz::expect_user_errors_only([&] {
            const std::vector<int32_t> ids = t->encode(text, "fuzz input");
            for (int32_t id : ids) {
                if (id < 0 || id >= t->vocab_size()) std::abort();
            }
            if (t->decode(ids) != text) std::abort();  // byte-level BPE loses nothing
        });
    }
    return 0;
}
