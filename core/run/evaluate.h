// Evaluation during training: each evaluator's mean loss over its first batches, split across the ranks.
#pragma once

#include <memory>
#include <vector>

#include "base/config.h"
#include "base/json.h"

namespace trainer {

class Model;
class ProgressBar;
class Strategy;
class TokenDataset;

// Mean loss of one evaluator over its first batches (all of them, or subset_num_batches of `batch`
// instances), split across the ranks: rank r of W takes a contiguous 1/W of those instances in batches of
// up to `batch`, and the loss sums and predicted-token counts (with label masks, the tokens in the loss) are
// summed over the ranks. Every rank runs
// the same number of forwards (FSDP gathers inside them): one past its share runs its first instance
// again and adds nothing. Before each forward the ranks vote on a stop signal (base/stop.h) in one small
// all-reduce, so a stop does not wait for a whole validation set: on an agreed stop, *stop_signal is set
// and the result is NaN.
double evaluate(const TokenDataset& data, const EvaluatorConfig& ev, Model& model, Strategy& strategy, long batch,
                int* stop_signal);

// Every evaluator of the run at `step`, in order: its loss on the console and in the step's record (val_loss: the
// first's; val_losses: each one's where there are several; eval_time_ms). Returns the stop signal the ranks agreed
// on between evaluation batches, or 0 (the record says which evaluator it interrupted).
int run_evaluators(const TrainConfig& config, const std::vector<std::unique_ptr<TokenDataset>>& data, Model& model,
                   Strategy& strategy, long step, Json& record, ProgressBar& bar);

}  // namespace trainer
