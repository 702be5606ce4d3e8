// Evaluation during training (see evaluate.h).
#include "core/run/evaluate.h"

#include <algorithm>
#include <chrono>
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
        double votes[stop::kVotes] = {};
        stop::vote(votes);
        strategy.all_reduce_sum(votes, stop::kVotes);
        if (const int sig = stop::agreed(votes)) {
            *stop_signal = sig;
            return std::numeric_limits<double>::quiet_NaN();
        }
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

int run_evaluators(const TrainConfig& config, const std::vector<std::unique_ptr<TokenDataset>>& data, Model& model,
                   Strategy& strategy, long step, Json& record, ProgressBar& bar) {
    const auto t0 = std::chrono::steady_clock::now();
    Json all = Json::object();
    for (size_t i = 0; i < data.size(); ++i) {
        const trace::Span span("eval", "eval " + config.evaluators[i].label);
        int sig = 0;
        const double v = evaluate(*data[i], config.evaluators[i], model, strategy, config.device_eval_batch_size, &sig);
        if (sig != 0) {
            bar.clear();
            std::printf("step %ld | eval %s interrupted by %s\n", step, config.evaluators[i].label.c_str(),
                        stop::signal_name(sig));
            record["eval_interrupted_by"] = stop::signal_name(sig);
            return sig;
        }
        all[config.evaluators[i].label] = v;
        if (i == 0) record["val_loss"] = v;
        bar.clear();
        std::printf("step %ld | eval %s | loss %.4f\n", step, config.evaluators[i].label.c_str(), v);
    }
    if (data.size() > 1) record["val_losses"] = all;
    record["eval_time_ms"] = seconds_since(t0) * 1e3;
    return 0;
}

}  // namespace trainer
