// Multiple-choice tasks (see downstream.h).
#include "core/data/downstream.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/common.h"
#include "base/files.h"
#include "base/json.h"
#include "base/utf8.h"

namespace trainer {

namespace {

// A context or a continuation: its ids, and its text where it was given.
struct Piece {
    std::vector<int32_t> ids;
    bool has_text = false;
    std::string text;
};

std::vector<int32_t> read_ids(const Json& v, const std::string& where, const std::string& key, int vocab) {
    std::vector<int32_t> ids;
    for (const Json& id : v) {
        if (!id.is_number_integer() || id.get<long long>() < 0 || id.get<long long>() >= vocab) {
            user_error("{}: \"{}\" holds {}; expected token ids, integers from 0 to model.vocab_size - 1 = {}", where,
                       key, json_text(id), vocab - 1);
        }
        ids.push_back(static_cast<int32_t>(id.get<long long>()));
    }
    return ids;
}

Piece read_piece(const Json& v, const std::string& where, const std::string& key, int vocab,
                 const DownstreamEncoder& encode, const std::string& no_text) {
    Piece p;
    if (v.is_string()) {
        if (!encode) user_error("{}: \"{}\" is text, and {}", where, key, no_text);
        p.has_text = true;
        p.text = v.get<std::string>();
        p.ids = encode(p.text);
        for (const int32_t id : p.ids) {
            if (id < 0 || id >= vocab) {
                user_error("{}: \"{}\" tokenizes to id {}, not below model.vocab_size {}", where, key, id, vocab);
            }
        }
    } else if (v.is_array()) {
        p.ids = read_ids(v, where, key, vocab);
    } else if (v.is_object() && v.contains("ids") && v["ids"].is_array() && v.contains("text") &&
               v["text"].is_string() && v.size() == 2) {
        p.ids = read_ids(v["ids"], where, key + ".ids", vocab);
        p.has_text = true;
        p.text = v["text"].get<std::string>();
    } else {
        user_error(
            "{}: \"{}\" is {}; expected text (a string), token ids (an array of integers) or both "
            "({{\"ids\": [...], \"text\": \"...\"}})",
            where, key, json_text(v));
    }
    if (p.ids.empty()) user_error("{}: \"{}\" is empty; every context and continuation has a token", where, key);
    return p;
}

// Characters (code points) of valid UTF-8 text.
double code_points(const std::string& s) {
    double n = 0;
    for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
    return n;
}

// The last seq_len - 1 ids at most: as much of a context as any row can use.
std::vector<int32_t> tail(std::vector<int32_t> ids, int seq_len) {
    const size_t keep = static_cast<size_t>(seq_len - 1);
    if (ids.size() > keep) ids.erase(ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(keep));
    return ids;
}

DownstreamExample read_example(const std::string& line, const std::string& where, int seq_len, int vocab,
                               const DownstreamEncoder& encode, const std::string& no_text) {
    const Json record = parse_json(line, where);
    if (!record.is_object()) user_error("{}: {}; expected a JSON object (an example)", where, json_text(record));
    for (auto it = record.begin(); it != record.end(); ++it) {
        static const char* const kKeys[] = {"context",
                                            "continuations",
                                            "contexts",
                                            "continuation",
                                            "label",
                                            "unconditioned_context",
                                            "unconditioned_contexts",
                                            "id"};
        if (std::find(std::begin(kKeys), std::end(kKeys), it.key()) == std::end(kKeys)) {
            user_error(
                "{}: unknown key \"{}\"; an example has context and continuations, or contexts and continuation, "
                "with label, and optionally unconditioned_context (or unconditioned_contexts) and id",
                where, it.key());
        }
    }
    const bool has_context = record.contains("context"), has_contexts = record.contains("contexts");
    const bool has_continuation = record.contains("continuation");
    const bool has_continuations = record.contains("continuations");
    const bool one_context = has_context && has_continuations && !has_contexts && !has_continuation;
    const bool one_continuation = has_contexts && has_continuation && !has_context && !has_continuations;
    if (!one_context && !one_continuation) {
        user_error("{}: expected either \"context\" with \"continuations\" or \"contexts\" with \"continuation\"",
                   where);
    }
    DownstreamExample ex;
    std::vector<Piece> continuations;
    const auto list = [&](const char* key) -> const Json& {
        const Json& v = record[key];
        if (!v.is_array() || v.empty()) {
            user_error("{}: \"{}\" is {}; expected a non-empty array of candidates", where, key, json_text(v));
        }
        return v;
    };
    if (one_context) {
        ex.contexts.push_back(
            tail(read_piece(record["context"], where, "context", vocab, encode, no_text).ids, seq_len));
        const Json& v = list("continuations");
        for (size_t c = 0; c < v.size(); ++c) {
            continuations.push_back(
                read_piece(v[c], where, fmt::format("continuations[{}]", c), vocab, encode, no_text));
        }
    } else {
        const Json& v = list("contexts");
        for (size_t c = 0; c < v.size(); ++c) {
            ex.contexts.push_back(
                tail(read_piece(v[c], where, fmt::format("contexts[{}]", c), vocab, encode, no_text).ids, seq_len));
        }
        continuations.push_back(read_piece(record["continuation"], where, "continuation", vocab, encode, no_text));
    }
    bool text = true;
    for (size_t c = 0; c < continuations.size(); ++c) {
        const Piece& p = continuations[c];
        const std::string key = one_context ? fmt::format("continuations[{}]", c) : std::string("continuation");
        if (p.ids.size() > static_cast<size_t>(seq_len - 1)) {
            user_error(
                "{}: \"{}\" is {} tokens; with at least one token of context before it, it must fit "
                "model.max_sequence_length {} (at most {} tokens)",
                where, key, p.ids.size(), seq_len, seq_len - 1);
        }
        ex.continuations.push_back(p.ids);
        text = text && p.has_text;
        if (p.has_text) {
            const std::string scored = !p.text.empty() && p.text[0] == ' ' ? p.text.substr(1) : p.text;
            if (scored.empty()) {
                user_error("{}: \"{}\" has no text besides its leading space; len_norm and bpb divide by its length",
                           where, key);
            }
            ex.chars.push_back(code_points(scored));
            ex.bytes.push_back(static_cast<double>(scored.size()));
        }
    }
    if (!text) ex.chars.clear(), ex.bytes.clear();
    if (record.contains("unconditioned_context") && record.contains("unconditioned_contexts")) {
        user_error("{}: both \"unconditioned_context\" and \"unconditioned_contexts\"; give one", where);
    }
    if (record.contains("unconditioned_context")) {
        ex.unconditioned.push_back(tail(
            read_piece(record["unconditioned_context"], where, "unconditioned_context", vocab, encode, no_text).ids,
            seq_len));
    } else if (record.contains("unconditioned_contexts")) {
        const Json& v = list("unconditioned_contexts");
        if (static_cast<int>(v.size()) != ex.candidates()) {
            user_error("{}: \"unconditioned_contexts\" has {}; expected one a candidate, {}", where, v.size(),
                       ex.candidates());
        }
        for (size_t c = 0; c < v.size(); ++c) {
            ex.unconditioned.push_back(
                tail(read_piece(v[c], where, fmt::format("unconditioned_contexts[{}]", c), vocab, encode, no_text).ids,
                     seq_len));
        }
    }
    const Json& label = record.contains("label") ? record["label"] : Json();
    if (!label.is_number_integer() || label.get<long long>() < 0 || label.get<long long>() >= ex.candidates()) {
        user_error("{}: \"label\" is {}; expected the index of the right candidate, an integer from 0 to {}", where,
                   label.is_null() ? std::string("missing") : json_text(label), ex.candidates() - 1);
    }
    ex.label = static_cast<int>(label.get<long long>());
    return ex;
}

}  // namespace

DownstreamTask read_downstream_task(const std::vector<std::string>& paths, const std::string& what, int seq_len,
                                    int vocab, const DownstreamEncoder& encode, const std::string& no_text) {
    DownstreamTask task;
    std::string first_where;  // the first example's, for a task whose examples disagree on pmi_dc
    bool all_text = true;
    for (const std::string& path : paths) {
        const std::string text = read_file(path, what + " file");
        size_t begin = 0, before = task.examples.size();
        for (long line = 1; begin < text.size(); ++line) {
            size_t end = text.find('\n', begin);
            if (end == std::string::npos) end = text.size();
            const std::string_view record(text.data() + begin, end - begin);
            begin = end + 1;
            const std::string where = fmt::format("{} {} line {}", what, path, line);
            if (const size_t bad = invalid_utf8_offset(record); bad != std::string_view::npos) {
                user_error("{}: not valid UTF-8 (byte {} of the line); the examples are UTF-8 JSON", where, bad + 1);
            }
            if (record.find_first_not_of(" \t\r") == std::string_view::npos) continue;
            task.examples.push_back(read_example(std::string(record), where, seq_len, vocab, encode, no_text));
            const DownstreamExample& ex = task.examples.back();
            for (int c = 0; c < ex.candidates(); ++c) {
                const int n = static_cast<int>(ex.continuation(c).size());
                const auto row = [&](const std::vector<int32_t>& context) {
                    return std::min(static_cast<int>(context.size()), seq_len - n) + n;
                };
                task.longest = std::max(task.longest, row(ex.context(c)));
                if (!ex.unconditioned.empty()) task.longest = std::max(task.longest, row(ex.unconditioned_of(c)));
            }
            all_text = all_text && !ex.chars.empty();
            if (task.examples.size() == 1) {
                first_where = fmt::format("{} line {}", path, line);
                task.pmi = !ex.unconditioned.empty();
            } else if (task.pmi != !ex.unconditioned.empty()) {
                user_error(
                    "{}: {} \"unconditioned_context\" and {} {}; every example of a task has one (for pmi_dc) or "
                    "none does",
                    where, task.pmi ? "has no" : "has an", first_where, task.pmi ? "has one" : "has none");
            }
        }
        if (task.examples.size() == before) {
            user_error("{} file {}: holds no example (JSONL: one JSON object a line, docs/downstream.md)", what, path);
        }
    }
    task.lengths = all_text;
    return task;
}

std::vector<DownstreamRow> downstream_rows(const DownstreamTask& task, int64_t examples) {
    std::vector<DownstreamRow> rows;
    for (int64_t e = 0; e < examples; ++e) {
        const DownstreamExample& ex = task.examples[static_cast<size_t>(e)];
        for (int c = 0; c < ex.candidates(); ++c) rows.push_back({e, c, false});
        if (task.pmi) {
            for (int c = 0; c < ex.candidates(); ++c) rows.push_back({e, c, true});
        }
    }
    return rows;
}

std::pair<int, int> lay_out_row(const DownstreamTask& task, const DownstreamRow& row, int seq_len, int32_t pad,
                                int32_t* tokens) {
    const DownstreamExample& ex = task.examples[static_cast<size_t>(row.example)];
    const std::vector<int32_t>& context =
        row.unconditioned ? ex.unconditioned_of(row.candidate) : ex.context(row.candidate);
    const std::vector<int32_t>& continuation = ex.continuation(row.candidate);
    const int n = static_cast<int>(continuation.size());
    const int keep = std::min(static_cast<int>(context.size()), seq_len - n);  // the read checked n < seq_len
    std::copy(context.end() - keep, context.end(), tokens);
    std::copy(continuation.begin(), continuation.end(), tokens + keep);
    std::fill(tokens + keep + n, tokens + seq_len, pad);
    return {keep - 1, n};
}

DownstreamMetrics downstream_metrics(const DownstreamTask& task, const std::vector<DownstreamRow>& rows,
                                     const std::vector<double>& loglik) {
    constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
    DownstreamMetrics m;
    double right[3] = {0, 0, 0}, bits = 0;  // acc, len_norm, pmi_dc; bpb's sum
    // The first candidate of the highest score (torch.argmax's tie rule).
    const auto best = [](const std::vector<double>& s) {
        return static_cast<int>(std::max_element(s.begin(), s.end()) - s.begin());
    };
    for (size_t r = 0; r < rows.size();) {
        const DownstreamExample& ex = task.examples[static_cast<size_t>(rows[r].example)];
        const int k = ex.candidates();
        std::vector<double> ll(loglik.begin() + static_cast<std::ptrdiff_t>(r),
                               loglik.begin() + static_cast<std::ptrdiff_t>(r + k));
        right[0] += best(ll) == ex.label ? 1 : 0;
        if (task.lengths) {
            std::vector<double> per_char(k);
            for (int c = 0; c < k; ++c) per_char[c] = ll[c] / ex.chars_of(c);
            right[1] += best(per_char) == ex.label ? 1 : 0;
            bits += -ll[ex.label] / ex.bytes_of(ex.label) / std::log(2.0);
        }
        if (task.pmi) {
            std::vector<double> ratio(k);
            for (int c = 0; c < k; ++c) ratio[c] = ll[c] / loglik[r + k + c];
            right[2] += best(ratio) == ex.label ? 1 : 0;
        }
        r += static_cast<size_t>(task.pmi ? 2 * k : k);
        ++m.examples;
    }
    const double n = static_cast<double>(m.examples);
    m.acc = right[0] / n;
    m.len_norm = task.lengths ? right[1] / n : kNaN;
    m.bpb = task.lengths ? bits / n : kNaN;
    m.pmi_dc = task.pmi ? right[2] / n : kNaN;
    return m;
}

}  // namespace trainer
