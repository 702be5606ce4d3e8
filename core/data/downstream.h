// Multiple-choice tasks for downstream evaluation, as OLMo's in-loop evaluators score them: each candidate answer's
// log-likelihood under the model, compared across the candidates (docs/downstream.md has the format and the metrics'
// definitions; core/run/evaluate.h runs them during training).
//
// A task is one or more JSONL files, one example a line (blank lines skipped):
//   {"context": C, "continuations": [A, B, ...], "label": k}   a context and its candidate continuations
//   {"contexts": [C1, C2, ...], "continuation": A, "label": k}  candidate contexts sharing one continuation
//                                                                (WinoGrande's partial scoring)
// with k the 0-based index of the right candidate and, optionally, "unconditioned_context": U, the context pmi_dc
// scores each continuation under instead (OLMo's "Answer:"), or "unconditioned_contexts": [U1, U2, ...], one a
// candidate (OLMo's WinoGrande: the options); every example of a task has one of them, or none does. Each of C, A, U
// is text (a string, tokenized with the run's tokenizer), token ids (an array of integers), or both
// ({"ids": [...], "text": "..."}: the ids are scored and the text gives the lengths len_norm and bpb divide by).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

struct DownstreamExample {
    std::vector<std::vector<int32_t>> contexts;       // one, or one a candidate (the contexts form)
    std::vector<std::vector<int32_t>> continuations;  // one a candidate, or one (the contexts form)
    std::vector<std::vector<int32_t>> unconditioned;  // pmi_dc's context: none, one, or one a candidate
    // Each continuation's characters (Unicode code points) and UTF-8 bytes, a leading space excluded; empty where a
    // continuation was given as ids alone.
    std::vector<double> chars, bytes;
    int label = 0;
    int candidates() const { return static_cast<int>(contexts.size() > 1 ? contexts.size() : continuations.size()); }
    const std::vector<int32_t>& context(int c) const { return contexts.size() > 1 ? contexts[c] : contexts[0]; }
    const std::vector<int32_t>& continuation(int c) const {
        return continuations.size() > 1 ? continuations[c] : continuations[0];
    }
    const std::vector<int32_t>& unconditioned_of(int c) const {
        return unconditioned.size() > 1 ? unconditioned[c] : unconditioned[0];
    }
    double chars_of(int c) const { return chars.size() > 1 ? chars[c] : chars[0]; }
    double bytes_of(int c) const { return bytes.size() > 1 ? bytes[c] : bytes[0]; }
};

struct DownstreamTask {
    std::vector<DownstreamExample> examples;
    bool pmi = false;      // every example has an unconditioned context: pmi_dc
    bool lengths = false;  // every continuation's text is known: len_norm and bpb
    int longest = 0;       // the longest row laid out (lay_out_row), in tokens: its context as cut, its continuation
};

// What tokenizes a task's text, or null where the run has no tokenizer for text (`no_text` then says why).
using DownstreamEncoder = std::function<std::vector<int32_t>(const std::string& text)>;

// Reads the task's files in order. Every example must fit instances of `seq_len` tokens: a continuation of at most
// seq_len - 1 tokens (a context cut from the left to make room for it keeps at least one token); token ids below
// `vocab`. A UserError naming `what` (the evaluator), the file and the line, with the reason, for an unreadable or
// empty file, a line that is not UTF-8 or not a JSON object of this form, a label out of range, an empty context or
// continuation, a continuation that does not fit, an id out of range, or text without a tokenizer.
DownstreamTask read_downstream_task(const std::vector<std::string>& paths, const std::string& what, int seq_len,
                                    int vocab, const DownstreamEncoder& encode, const std::string& no_text);

// One scored sequence: candidate `candidate` of example `example` after its context, or (unconditioned) after the
// example's unconditioned context.
struct DownstreamRow {
    int64_t example = 0;
    int32_t candidate = 0;
    bool unconditioned = false;
};

// The rows of the first `examples` examples, each example's candidates in order, then their unconditioned rows.
std::vector<DownstreamRow> downstream_rows(const DownstreamTask& task, int64_t examples);

// Writes a row's sequence into tokens[0, seq_len): the context's last tokens that leave room for the continuation,
// the continuation, then `pad` to the end. Returns the first position whose next token is the continuation's first
// and the continuation's length: positions first .. first + length - 1 predict it.
std::pair<int, int> lay_out_row(const DownstreamTask& task, const DownstreamRow& row, int seq_len, int32_t pad,
                                int32_t* tokens);

// OLMo's metrics over the examples of `rows` from each row's log-likelihood (the sum of its continuation's token
// log-probabilities): acc, len_norm and pmi_dc are the share of examples whose highest-scoring candidate is the
// label (the first highest on a tie, as torch.argmax), scored by the log-likelihood, by it per character, and by its
// ratio to the unconditioned one; bpb is the mean over examples of the right candidate's negative log-likelihood in
// bits per UTF-8 byte. A metric the task cannot give (len_norm and bpb without text, pmi_dc without unconditioned
// contexts) is NaN.
struct DownstreamMetrics {
    int64_t examples = 0;
    double acc = 0.0, len_norm = 0.0, pmi_dc = 0.0, bpb = 0.0;
};
DownstreamMetrics downstream_metrics(const DownstreamTask& task, const std::vector<DownstreamRow>& rows,
                                     const std::vector<double>& loglik);

}  // namespace trainer
