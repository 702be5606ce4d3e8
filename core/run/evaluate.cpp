// Evaluation during training (see evaluate.h).
#include "core/run/evaluate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "base/common.h"
#include "base/stop.h"
#include "base/trace.h"
#include "core/data/data.h"
#include "core/model/model.h"
#include "core/run/report.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

namespace {

// The ranks vote on a stop signal before an evaluation forward (one small all-reduce); true, with *stop_signal set,
// where they agree to stop.
bool stop_agreed(Strategy& strategy, int* stop_signal) {
    double votes[stop::kVotes] = {};
    stop::vote(votes);
    strategy.all_reduce_sum(votes, stop::kVotes);
    *stop_signal = stop::agreed(votes);
    return *stop_signal != 0;
}

}  // namespace

double evaluate(const TokenDataset& data, const EvaluatorConfig& ev, Model& model, Strategy& strategy, long batch,
                int* stop_signal) {
    const long L = data.seq_len();
    long instances = data.num_instances();
    if (ev.subset_num_batches > 0) instances = std::min(instances, ev.subset_num_batches * batch);
    const long world = strategy.world_size(), rank = strategy.rank();
    const long begin = instances * rank / world, end = instances * (rank + 1) / world;
    const long most = (instances + world - 1) / world;  // the largest share
    const long forwards = (most + batch - 1) / batch;
    std::vector<int32_t> tokens(static_cast<size_t>(batch) * L);
    std::vector<uint8_t> mask(data.has_label_masks() ? tokens.size() : 0);
    double sums[2] = {0.0, 0.0};  // loss, predicted tokens (with label masks: those in the loss)
    for (long b = 0; b < forwards; ++b) {
        if (stop_agreed(strategy, stop_signal)) return std::numeric_limits<double>::quiet_NaN();
        const long first = begin + b * batch;
        const int n = static_cast<int>(std::max(0L, std::min(batch, end - first)));
        if (n == 0) {
            data.read_instance(std::min(begin, instances - 1), tokens.data());
            (void)model.forward_loss(tokens.data(), 1);
            continue;
        }
        for (int i = 0; i < n; ++i) data.read_instance(first + i, tokens.data() + static_cast<size_t>(i) * L);
        if (mask.empty()) {
            sums[0] += model.forward_loss(tokens.data(), n);
            sums[1] += static_cast<double>(n) * (L - 1);
            continue;
        }
        for (int i = 0; i < n; ++i) {
            uint8_t* m = mask.data() + static_cast<size_t>(i) * L;
            data.read_label_mask(first + i, m);
            for (long t = 1; t < L; ++t) sums[1] += m[t];  // each position's target: tokens 1 to L - 1
        }
        sums[0] += model.forward_loss(tokens.data(), n, mask.data());
    }
    strategy.all_reduce_sum(sums, 2);
    return sums[1] > 0.0 ? sums[0] / sums[1] : 0.0;  // a set whose masks leave nothing in the loss: 0
}

int downstream_longest(const std::vector<std::unique_ptr<DownstreamTask>>& tasks) {
    int longest = 0;
    for (const auto& task : tasks) {
        if (task) longest = std::max(longest, task->longest);
    }
    return longest;
}

long downstream_length(const TrainConfig& config, const std::vector<std::unique_ptr<DownstreamTask>>& tasks) {
    const long longest = downstream_longest(tasks);
    if (longest == 0) return 0;
    return std::min<long>(config.model.max_sequence_length, (longest + 63) / 64 * 64);
}

std::vector<double> score_downstream_rows(const DownstreamTask& task, const std::vector<DownstreamRow>& rows,
                                          Model& model, Strategy& strategy, long batch, int32_t pad, int* stop_signal) {
    const int L = model.positions() + 1, T = model.positions();
    const long n = static_cast<long>(rows.size());
    const long world = strategy.world_size(), rank = strategy.rank();
    const long batches = (n + batch - 1) / batch;
    const long forwards = (batches + world - 1) / world;
    std::vector<int32_t> tokens(static_cast<size_t>(batch) * L);
    std::vector<float> losses(static_cast<size_t>(batch) * T);
    std::vector<double> loglik(static_cast<size_t>(n), 0.0);
    for (long f = 0; f < forwards; ++f) {
        if (stop_agreed(strategy, stop_signal)) return {};
        const long k = f * world + rank;  // this rank's global batch
        const long first = k * batch;
        const long count = k < batches ? std::min(batch, n - first) : 1;
        std::vector<std::pair<int, int>> spans(static_cast<size_t>(count));
        for (long i = 0; i < count; ++i) {
            const DownstreamRow& row = rows[static_cast<size_t>(k < batches ? first + i : 0)];
            spans[static_cast<size_t>(i)] = lay_out_row(task, row, L, pad, tokens.data() + static_cast<size_t>(i) * L);
        }
        model.forward_token_losses(tokens.data(), static_cast<int>(count), losses.data());
        if (k >= batches) continue;  // a forward to keep in step with the other ranks
        for (long i = 0; i < count; ++i) {
            const auto [start, length] = spans[static_cast<size_t>(i)];
            double sum = 0.0;
            for (int p = start; p < start + length; ++p) sum -= losses[static_cast<size_t>(i) * T + p];
            loglik[static_cast<size_t>(first + i)] = sum;
        }
    }
    // Exactly one rank holds each row (the others 0): the sum is that rank's value, bit for bit.
    for (long at = 0; at < n; at += 1L << 20) {
        strategy.all_reduce_sum(loglik.data() + at, static_cast<int>(std::min(n - at, 1L << 20)));
    }
    return loglik;
}

DownstreamMetrics evaluate_downstream(const DownstreamTask& task, const EvaluatorConfig& ev, Model& model,
                                      Strategy& strategy, long batch, int32_t pad, int* stop_signal) {
    int64_t examples = static_cast<int64_t>(task.examples.size());
    if (ev.subset_num_batches > 0) examples = std::min<int64_t>(examples, ev.subset_num_batches * batch);
    const std::vector<DownstreamRow> rows = downstream_rows(task, examples);
    const std::vector<double> loglik = score_downstream_rows(task, rows, model, strategy, batch, pad, stop_signal);
    if (*stop_signal != 0) return {};
    return downstream_metrics(task, rows, loglik);
}

int run_evaluators(const TrainConfig& config, const std::vector<std::unique_ptr<TokenDataset>>& sets,
                   const std::vector<std::unique_ptr<DownstreamTask>>& tasks, Model& model, Model& downstream_model,
                   Strategy& strategy, long step, Json& record, ProgressBar& bar) {
    const auto t0 = std::chrono::steady_clock::now();
    Json losses = Json::object(), downstream = Json::object();
    for (size_t i = 0; i < config.evaluators.size(); ++i) {
        const EvaluatorConfig& ev = config.evaluators[i];
        const trace::Span span("eval", "eval " + ev.label);
        int sig = 0;
        std::string line;
        if (ev.type == EvaluatorType::kDownstream) {
            const DownstreamMetrics m =
                evaluate_downstream(*tasks[i], ev, downstream_model, strategy, config.device_eval_batch_size,
                                    static_cast<int32_t>(config.model.eos_token_id), &sig);
            if (sig == 0) {
                Json scores = {{"acc", m.acc}};
                line = fmt::format("acc {:.4f}", m.acc);
                // The metrics the task can give (NaN: not given), in the console's order.
                for (const auto& [name, value] :
                     {std::pair{"len_norm", m.len_norm}, {"pmi_dc", m.pmi_dc}, {"bpb", m.bpb}}) {
                    if (std::isnan(value)) continue;
                    scores[name] = value;
                    line += fmt::format(" | {} {:.4f}", name, value);
                }
                scores["examples"] = m.examples;
                line += fmt::format(" ({} example{})", m.examples, m.examples == 1 ? "" : "s");
                downstream[ev.label] = scores;
            }
        } else {
            const double v = evaluate(*sets[i], ev, model, strategy, config.device_eval_batch_size, &sig);
            if (sig == 0) {
                if (losses.empty()) record["val_loss"] = v;
                losses[ev.label] = v;
                line = fmt::format("loss {:.4f}", v);
            }
        }
        bar.clear();
        if (sig != 0) {
            std::printf("step %ld | eval %s interrupted by %s\n", step, ev.label.c_str(), stop::signal_name(sig));
            record["eval_interrupted_by"] = stop::signal_name(sig);
            return sig;
        }
        std::printf("step %ld | eval %s | %s\n", step, ev.label.c_str(), line.c_str());
    }
    if (losses.size() > 1) record["val_losses"] = losses;
    if (!downstream.empty()) record["downstream"] = downstream;
    record["eval_time_ms"] = seconds_since(t0) * 1e3;
    return 0;
}

RunEvaluation::RunEvaluation(const TrainConfig& config, const std::vector<std::unique_ptr<TokenDataset>>& sets,
                             const std::vector<std::unique_ptr<DownstreamTask>>& tasks, const ParamLayout& layout,
                             Backend* backend, Strategy& strategy, Model& model)
    : config_(config), sets_(sets), tasks_(tasks), strategy_(strategy), model_(model) {
    const long length = downstream_length(config, tasks);
    if (length > 0 && length < config.model.max_sequence_length) {
        downstream_config_ = config;
        downstream_config_.model.max_sequence_length = length;
        downstream_model_ = std::make_unique<Model>(downstream_config_, layout, backend, &strategy,
                                                    static_cast<int>(config.device_eval_batch_size));
    }
}

RunEvaluation::~RunEvaluation() = default;

std::string RunEvaluation::describe() const {
    const int longest = downstream_longest(tasks_);
    if (longest == 0) return "";
    const long L = config_.model.max_sequence_length;
    return fmt::format("downstream: rows of up to {} tokens, scored {}", longest,
                       downstream_model_ ? fmt::format("in instances of {} tokens, at their own length (the model's "
                                                       "is {})",
                                                       downstream_model_->positions() + 1, L)
                                         : fmt::format("in the model's instances of {} tokens", L));
}

int RunEvaluation::run(long step, Json& record, ProgressBar& bar) {
    return run_evaluators(config_, sets_, tasks_, model_, downstream_model_ ? *downstream_model_ : model_, strategy_,
                          step, record, bar);
}

}  // namespace trainer
