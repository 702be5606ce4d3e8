// The data a training run reads: the training tokens (data.paths, or a mixture's sources), each evaluator's, the
// order the instances come in step by step, and the run's length in steps; all of it opened and checked before
// anything large is allocated.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "core/data/data.h"
#include "core/data/downstream.h"
#include "core/data/mixture.h"

namespace trainer {

struct RunData {
    std::unique_ptr<TokenDataset> train;
    std::vector<std::unique_ptr<TokenDataset>> evals;    // evaluators[i]'s where type lm (else null)
    std::vector<std::unique_ptr<DownstreamTask>> tasks;  // evaluators[i]'s where type downstream (else null)
    std::unique_ptr<BatchOrder> order;
    const MixtureOrder* mixture = nullptr;  // `order`, where data.sources is a mixture
    long total_steps = 0;
    std::string warmup_note;  // a warmup no shorter than the run: said in the run's header, not refused
};

RunData open_run_data(const TrainConfig& config);

}  // namespace trainer
