// Instruction data for fine-tuning (trainer prepare-data --instruct): JSONL records rendered through a chat template
// into token ids and a label mask (1 where a token is a target in the loss), laid out as instances of a fixed
// length.
//
// Records, one JSON object a line (blank lines skipped):
//  * chat: {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}, rendered turn by turn
//    through a ChatTemplate;
//  * Alpaca: {"instruction": "...", "input": "..." (optional, may be empty), "output": "..."}, rendered with the
//    Stanford Alpaca prompt (LitGPT's), the output and EOS after it.
// Only the assistant turns (their content, EOS and what follows it in the turn) and Alpaca's output and EOS are in
// the loss, unless train_on_prompt puts every token of the example in it. Each text piece is tokenized on its own
// (the prompt and the answer never share a token across their boundary).
//
// Layout: by default each example is one instance, padded with pad_id to the length (mask 0 on the padding), as
// OLMo's SFT data is; with `pack`, consecutive examples share an instance while they fit, never one split across
// two (the rest of an instance padded). An example longer than an instance is cut to it, and counted.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace trainer {

// How each role's turn is written: prefix + content (+ EOS) + suffix, or suffix_if_last for the conversation's last
// turn.
struct ChatTemplate {
    struct Turn {
        std::string prefix, suffix, suffix_if_last;
        bool eos = false;  // the EOS token after the content
    };
    std::string name;
    std::map<std::string, Turn> roles;  // by role: system, user, assistant
};

// Tulu's and OLMo-2-instruct's template: "<|system|>\n", "<|user|>\n" and "<|assistant|>\n" before the content, a
// newline after a system or user turn, EOS after an assistant turn and a newline unless it is the last.
ChatTemplate tulu_chat_template();
// A template from a JSON file: {"system": {"prefix": "...", "suffix": "..."}, "user": {...}, "assistant": {"prefix":
// "...", "suffix": "...", "suffix_if_last": "...", "eos": true}}; every role needs an entry, keys other than these are
// refused; suffix_if_last defaults to suffix, eos to false. UserError naming the file and key.
ChatTemplate read_chat_template(const std::string& path);
// "tulu" (the default) or a file's path.
ChatTemplate chat_template_named(const std::string& name_or_path);

// One example as token ids with their mask.
struct InstructExample {
    std::vector<int32_t> ids;
    std::vector<uint8_t> in_loss;
};

// A text piece's token ids (the tokenizer's encode, no EOS added).
using TextEncoder = std::function<std::vector<int32_t>(const std::string& text)>;

// Renders one JSONL record; `where` names it in errors ("file.jsonl line 3").
InstructExample render_instruct_record(const std::string& json_line, const ChatTemplate& chat,
                                       const TextEncoder& encode, int eos_id, bool train_on_prompt,
                                       const std::string& where);

struct InstructLayout {
    std::vector<int32_t> tokens;  // instances x seq_len
    std::vector<uint8_t> mask;    // the same length
    int64_t instances = 0, examples = 0, truncated = 0, tokens_in_loss = 0, example_tokens = 0;
    int64_t emptied = 0;        // cut examples left with no token in the loss (their answers were past the cut)
    double efficiency() const;  // tokens of examples over the instances' tokens
};
// The examples as instances of seq_len tokens: one each, padded, or packed.
InstructLayout lay_out_examples(const std::vector<InstructExample>& examples, int64_t seq_len, bool pack, int pad_id);

}  // namespace trainer
