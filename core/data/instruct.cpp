// Instruction data for fine-tuning (see instruct.h).
#include "core/data/instruct.h"

#include <algorithm>

#include "base/common.h"
#include "base/json.h"

namespace trainer {

ChatTemplate tulu_chat_template() {
    ChatTemplate t;
    t.name = "tulu";
    t.roles["system"] = {"<|system|>\n", "\n", "\n", false};
    t.roles["user"] = {"<|user|>\n", "\n", "\n", false};
    t.roles["assistant"] = {"<|assistant|>\n", "\n", "", true};
    return t;
}

ChatTemplate read_chat_template(const std::string& path) {
    const Json doc = read_json_file(path, "chat template");
    if (!doc.is_object()) user_error("chat template {}: {}; expected an object of roles", path, json_text(doc));
    ChatTemplate t;
    t.name = path;
    for (auto it = doc.begin(); it != doc.end(); ++it) {
        const std::string role = it.key();
        if (role != "system" && role != "user" && role != "assistant") {
            user_error("chat template {}: role \"{}\"; expected system, user and assistant", path, role);
        }
        const Json& v = it.value();
        if (!v.is_object()) user_error("chat template {}: {}: {}; expected an object", path, role, json_text(v));
        ChatTemplate::Turn turn;
        bool has_last = false;
        for (auto kv = v.begin(); kv != v.end(); ++kv) {
            const std::string& key = kv.key();
            const Json& x = kv.value();
            if (key == "eos") {
                if (!x.is_boolean())
                    user_error("chat template {}: {}.eos: {}; expected true or false", path, role, json_text(x));
                turn.eos = x.get<bool>();
                continue;
            }
            if (key != "prefix" && key != "suffix" && key != "suffix_if_last") {
                user_error("chat template {}: {}.{}: unknown; expected prefix, suffix, suffix_if_last and eos", path,
                           role, key);
            }
            if (!x.is_string())
                user_error("chat template {}: {}.{}: {}; expected a string", path, role, key, json_text(x));
            (key == "prefix"   ? turn.prefix
             : key == "suffix" ? turn.suffix
                               : turn.suffix_if_last) = x.get<std::string>();
            has_last = has_last || key == "suffix_if_last";
        }
        if (!has_last) turn.suffix_if_last = turn.suffix;
        t.roles[role] = turn;
    }
    for (const char* role : {"system", "user", "assistant"}) {
        if (t.roles.count(role) == 0) user_error("chat template {}: no \"{}\" entry; every role needs one", path, role);
    }
    return t;
}

ChatTemplate chat_template_named(const std::string& name_or_path) {
    return name_or_path == "tulu" ? tulu_chat_template() : read_chat_template(name_or_path);
}

namespace {

// The Stanford Alpaca prompt (LitGPT's Alpaca template), with and without an input.
std::string alpaca_prompt(const std::string& instruction, const std::string& input) {
    if (input.empty()) {
        return "Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n### Instruction:\n" +
               instruction + "\n\n### Response:\n";
    }
    return "Below is an instruction that describes a task, paired with an input that provides further context. "
           "Write a response that appropriately completes the request.\n\n### Instruction:\n" +
           instruction + "\n\n### Input:\n" + input + "\n\n### Response:\n";
}

std::string string_field(const Json& record, const char* key, const std::string& where, bool required) {
    if (!record.contains(key) || record[key].is_null()) {
        if (required) user_error("{}: no \"{}\"", where, key);
        return std::string();
    }
    if (!record[key].is_string()) user_error("{}: \"{}\" is {}; expected a string", where, key, json_text(record[key]));
    return record[key].get<std::string>();
}

}  // namespace

InstructExample render_instruct_record(const std::string& json_line, const ChatTemplate& chat,
                                       const TextEncoder& encode, int eos_id, bool train_on_prompt,
                                       const std::string& where) {
    const Json record = parse_json(json_line, where);
    if (!record.is_object())
        user_error("{}: {}; expected a JSON object (a chat or an Alpaca record)", where, json_text(record));
    InstructExample ex;
    const auto add_text = [&](const std::string& text, bool in_loss) {
        if (text.empty()) return;
        const std::vector<int32_t> ids = encode(text);
        ex.ids.insert(ex.ids.end(), ids.begin(), ids.end());
        ex.in_loss.insert(ex.in_loss.end(), ids.size(), in_loss || train_on_prompt ? 1 : 0);
    };
    const auto add_eos = [&](bool in_loss) {
        ex.ids.push_back(eos_id);
        ex.in_loss.push_back(in_loss || train_on_prompt ? 1 : 0);
    };
    if (record.contains("messages")) {
        const Json& messages = record["messages"];
        if (!messages.is_array() || messages.empty()) {
            user_error("{}: \"messages\" is {}; expected a list of {{\"role\", \"content\"}}", where,
                       json_text(messages));
        }
        bool any_answer = false;
        for (size_t i = 0; i < messages.size(); ++i) {
            const std::string at = fmt::format("{}: messages[{}]", where, i);
            if (!messages[i].is_object())
                user_error("{}: {}; expected {{\"role\", \"content\"}}", at, json_text(messages[i]));
            const std::string role = string_field(messages[i], "role", at, true);
            const std::string content = string_field(messages[i], "content", at, true);
            const auto turn = chat.roles.find(role);
            if (turn == chat.roles.end()) {
                user_error("{}: role \"{}\"; expected system, user or assistant (the {} chat template's)", at, role,
                           chat.name);
            }
            const bool answer = role == "assistant", last = i + 1 == messages.size();
            any_answer = any_answer || answer;
            add_text(turn->second.prefix, false);
            add_text(content, answer);
            if (turn->second.eos) add_eos(answer);
            add_text(last ? turn->second.suffix_if_last : turn->second.suffix, answer);
        }
        if (!any_answer && !train_on_prompt)
            user_error("{}: no assistant message: nothing of it would be in the loss", where);
    } else if (record.contains("instruction")) {
        const std::string instruction = string_field(record, "instruction", where, true);
        const std::string input = string_field(record, "input", where, false);
        const std::string output = string_field(record, "output", where, true);
        add_text(alpaca_prompt(instruction, input), false);
        add_text(output, true);
        add_eos(true);
    } else {
        user_error(
            "{}: neither \"messages\" (a chat record) nor \"instruction\" and \"output\" (an Alpaca record); its keys: "
            "{}",
            where, [&] {
                std::string keys;
                for (auto it = record.begin(); it != record.end(); ++it) keys += (keys.empty() ? "" : ", ") + it.key();
                return keys.empty() ? std::string("none") : keys;
            }());
    }
    return ex;
}

double InstructLayout::efficiency() const {
    return instances > 0 ? static_cast<double>(example_tokens) / static_cast<double>(tokens.size()) : 0.0;
}

InstructLayout lay_out_examples(const std::vector<InstructExample>& examples, int64_t seq_len, bool pack, int pad_id) {
    TRAINER_CHECK(seq_len >= 2, "instances of {} tokens", seq_len);
    InstructLayout out;
    int64_t used = seq_len;  // tokens of the open instance (seq_len: none open)
    const auto open_instance = [&] {
        out.tokens.insert(out.tokens.end(), static_cast<size_t>(seq_len), pad_id);
        out.mask.insert(out.mask.end(), static_cast<size_t>(seq_len), 0);
        ++out.instances;
        used = 0;
    };
    for (const InstructExample& ex : examples) {
        ++out.examples;
        int64_t n = static_cast<int64_t>(ex.ids.size());
        if (n > seq_len) n = seq_len, ++out.truncated;
        if (!pack || used + n > seq_len) open_instance();
        const size_t at = out.tokens.size() - static_cast<size_t>(seq_len - used);
        std::copy_n(ex.ids.begin(), n, out.tokens.begin() + static_cast<std::ptrdiff_t>(at));
        std::copy_n(ex.in_loss.begin(), n, out.mask.begin() + static_cast<std::ptrdiff_t>(at));
        used += n;
        out.example_tokens += n;
        int64_t in_loss = 0;
        for (int64_t i = 0; i < n; ++i) in_loss += ex.in_loss[static_cast<size_t>(i)];
        out.tokens_in_loss += in_loss;
        if (in_loss == 0 && n < static_cast<int64_t>(ex.ids.size())) ++out.emptied;
    }
    return out;
}

}  // namespace trainer
