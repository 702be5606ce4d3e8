// A downstream task's JSONL (runs expanded, fuzz_common.h): read as an evaluator reads it, with a byte-level
// tokenizer for its text (the first input byte odd) or none, then every row laid out and the metrics computed, as
// an evaluation does. What the reader accepts must keep its promises: every row fits the instance, with at least
// one context token, and the metrics are within [0, 1] or NaN.
#include <cmath>

#include "core/data/downstream.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    constexpr int kSeqLen = 48, kVocab = 300;
    const bool text = size > 0 && data[0] % 2 == 1;
    const std::string path = fuzz::as_file(fuzz::expand(data, size), ".jsonl");
    const trainer::DownstreamEncoder bytes = fuzz::byte_ids;
    fuzz::expect_user_errors_only([&] {
        const trainer::DownstreamTask task = trainer::read_downstream_task(
            {path}, "fuzz", kSeqLen, kVocab, text ? bytes : trainer::DownstreamEncoder(), "no tokenizer here");
        const auto rows = trainer::downstream_rows(task, static_cast<int64_t>(task.examples.size()));
        std::vector<int32_t> tokens(kSeqLen);
        std::vector<double> loglik;
        for (const trainer::DownstreamRow& row : rows) {
            const auto [first, length] = trainer::lay_out_row(task, row, kSeqLen, 0, tokens.data());
            if (first < 0 || length < 1 || first + length > kSeqLen - 1 || first + length > task.longest) std::abort();
            loglik.push_back(-0.5 * length - 0.01 * row.candidate);
        }
        const trainer::DownstreamMetrics m = trainer::downstream_metrics(task, rows, loglik);
        for (const double x : {m.acc, m.len_norm, m.pmi_dc}) {
            if (!std::isnan(x) && (x < 0.0 || x > 1.0)) std::abort();
        }
    });
    return 0;
}
