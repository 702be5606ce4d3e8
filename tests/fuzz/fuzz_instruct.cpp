// Instruction data (trainer prepare-data --instruct; runs expanded, fuzz_common.h): each line rendered through the
// Tulu template, or through a chat template read from the input itself (the first byte odd: the input's first line
// is the template file, the rest the records), with a byte-level tokenizer; then the examples laid out one an
// instance and packed. What is accepted must keep its promises: a mask as long as the ids, instances of exactly
// seq_len tokens, and no more tokens in the loss than the examples had.
#include "core/data/instruct.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    constexpr int kEos = 256, kPad = 257;
    constexpr int64_t kSeqLen = 40;
    std::string input = fuzz::expand(data, size);
    const trainer::TextEncoder bytes = fuzz::byte_ids;
    fuzz::expect_user_errors_only([&] {
        trainer::ChatTemplate chat = trainer::tulu_chat_template();
        if (size > 0 && data[0] % 2 == 1) {
            const size_t end = input.find('\n');
            chat = trainer::read_chat_template(fuzz::as_file(input.substr(0, end), ".json"));
            input = end == std::string::npos ? std::string() : input.substr(end + 1);
        }
        std::vector<trainer::InstructExample> examples;
        int64_t in_loss = 0, line = 0;
        size_t at = 0;
        while (at <= input.size()) {
            size_t end = input.find('\n', at);
            if (end == std::string::npos) end = input.size();
            const std::string record = input.substr(at, end - at);
            at = end + 1;
            ++line;
            if (record.find_first_not_of(" \t\r") == std::string::npos) continue;
            for (const bool on_prompt : {false, true}) {
                trainer::InstructExample e = trainer::render_instruct_record(record, chat, bytes, kEos, on_prompt,
                                                                             "line " + std::to_string(line));
                if (e.in_loss.size() != e.ids.size()) std::abort();
                if (!on_prompt) {
                    for (const uint8_t m : e.in_loss) in_loss += m;
                    examples.push_back(std::move(e));
                }
            }
        }
        for (const bool pack : {false, true}) {
            const trainer::InstructLayout l = trainer::lay_out_examples(examples, kSeqLen, pack, kPad);
            if (l.tokens.size() != l.mask.size() || int64_t(l.tokens.size()) != l.instances * kSeqLen) std::abort();
            if (l.tokens_in_loss > in_loss || l.examples != int64_t(examples.size())) std::abort();
        }
    });
    return 0;
}
