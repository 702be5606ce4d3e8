// Evaluation during training: each evaluator's mean loss over its first batches, split across the ranks.
#pragma once

#include "base/config.h"

namespace trainer {

class Model;
class Strategy;
class TokenDataset;

// Mean loss of one evaluator over its first batches (all of them, or subset_num_batches of `batch`
// instances), split across the ranks: rank r of W takes a contiguous 1/W of those instances in batches of
// up to `batch`, and the loss sums and predicted-token counts are summed over the ranks. Every rank runs
// the same number of forwards (FSDP gathers inside them): one past its share runs its first instance
// again and adds nothing. Before each forward the ranks vote on a stop signal (base/stop.h) in one small
// all-reduce, so a stop does not wait for a whole validation set: on an agreed stop, *stop_signal is set
// and the result is NaN.
double evaluate(const TokenDataset& data, const EvaluatorConfig& ev, Model& model, Strategy& strategy, long batch,
                int* stop_signal);

}  // namespace trainer
