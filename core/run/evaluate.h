// Evaluation during training: each loss evaluator's mean loss over its first batches, and each downstream
// evaluator's multiple-choice scores, split across the ranks.
#pragma once

#include <memory>
#include <vector>

#include "base/config.h"
#include "base/json.h"
#include "core/data/downstream.h"

namespace trainer {

class Backend;
class Model;
class ParamLayout;
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

// The downstream tasks' longest row (tasks[i] null where evaluator i is not downstream); 0 without one.
int downstream_longest(const std::vector<std::unique_ptr<DownstreamTask>>& tasks);

// The instance length downstream evaluation runs at: the tasks' longest row (tasks[i] null where evaluator i is not
// downstream) rounded up to a multiple of 64, at most model.max_sequence_length; 0 without a downstream evaluator.
// A row's scores do not depend on the positions after it (attention is causal), so a model built for this length
// scores the rows as the full one does, at the cost of their own length (a 2,048-token model scores a 60-token
// question in a 64-token instance, as OLMo pads its batches to their longest row).
long downstream_length(const TrainConfig& config, const std::vector<std::unique_ptr<DownstreamTask>>& tasks);

// Each row's log-likelihood (the sum of its continuation's token log-probabilities, in double, in position order),
// the same on every rank and every world size: the rows go in global batches of up to `batch` (rows b*batch ..), batch
// k on rank k % W, each padded with `pad`, so a batch holds the same rows whatever the world size; every rank runs as
// many forwards (one past its share runs a row of batch 0 and keeps nothing), and the results are summed over the
// ranks, where exactly one rank has each row. A stop agreed between forwards sets *stop_signal and returns {}.
std::vector<double> score_downstream_rows(const DownstreamTask& task, const std::vector<DownstreamRow>& rows,
                                          Model& model, Strategy& strategy, long batch, int32_t pad, int* stop_signal);

// A downstream evaluator's metrics over its first examples (all, or subset_num_batches x `batch`).
DownstreamMetrics evaluate_downstream(const DownstreamTask& task, const EvaluatorConfig& ev, Model& model,
                                      Strategy& strategy, long batch, int32_t pad, int* stop_signal);

// Every evaluator of the run at `step`, in order (sets[i] for an lm evaluator, tasks[i] for a downstream one, scored by
// `downstream_model`, built for downstream_length): on the
// console and in the step's record, an lm evaluator's loss (val_loss: the first's; val_losses: each one's where there
// are several) and a downstream one's metrics (downstream: {label: {acc, len_norm, pmi_dc, bpb, examples}}, those the
// task can give); eval_time_ms. Returns the stop signal the ranks agreed on between evaluation batches, or 0 (the
// record says which evaluator it interrupted).
int run_evaluators(const TrainConfig& config, const std::vector<std::unique_ptr<TokenDataset>>& sets,
                   const std::vector<std::unique_ptr<DownstreamTask>>& tasks, Model& model, Model& downstream_model,
                   Strategy& strategy, long step, Json& record, ProgressBar& bar);

// A training run's evaluation: its evaluators over the run's data (the loss sets and the downstream tasks, kept by
// reference), with the training model, and the model the downstream tasks are scored with: one on the same parameters
// built for downstream_length where that is shorter than max_sequence_length (its activations for
// device_eval_batch_size rows of that length), else the training model.
class RunEvaluation {
   public:
    RunEvaluation(const TrainConfig& config, const std::vector<std::unique_ptr<TokenDataset>>& sets,
                  const std::vector<std::unique_ptr<DownstreamTask>>& tasks, const ParamLayout& layout,
                  Backend* backend, Strategy& strategy, Model& model);
    ~RunEvaluation();
    // The run header's line on the downstream tasks' length; "" without downstream evaluators.
    std::string describe() const;
    // run_evaluators at `step`.
    int run(long step, Json& record, ProgressBar& bar);

   private:
    const TrainConfig& config_;
    const std::vector<std::unique_ptr<TokenDataset>>& sets_;
    const std::vector<std::unique_ptr<DownstreamTask>>& tasks_;
    Strategy& strategy_;
    Model& model_;
    TrainConfig downstream_config_;            // the config downstream_model_ is built for (it holds a reference)
    std::unique_ptr<Model> downstream_model_;  // null: the tasks score in the training model's instances
};

}  // namespace trainer
