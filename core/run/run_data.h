// The data a training run reads: the training tokens (data.paths, or a mixture's sources), each evaluator's, the
// order the instances come in step by step, and the run's length in steps; all of it opened and checked before
// anything large is allocated. Then, step by step, the micro-batches a rank reads of it (StepBatches).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "core/data/data.h"
#include "core/data/downstream.h"
#include "core/data/mixture.h"
#include "core/model/model.h"

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

// A step's global batch as this rank reads it: the batch's instances in the run's order, the tokens in its loss, this
// rank's slice of the instances, and each micro-batch's tokens, instance-filter keeps and label masks, read into
// buffers kept from step to step.
class StepBatches {
   public:
    StepBatches(const TrainConfig& config, const RunData& data);

    // Step `step`'s global batch (1-based) and this rank's slice of it.
    void begin(long step, int rank, int world);
    // The global batch's tokens in the loss: every predicted position, or with label masks the instances' targets in
    // the loss (positions 1 to L - 1), which every rank counts alike from the whole batch's masks, with no collective.
    double tokens_in_loss() const { return tokens_in_loss_; }
    // Micro-batch k (0-based) of this rank's slice: its tokens, which instances the instance filter keeps, its label
    // masks (where the data has them) and LoRA's dropout keys.
    MicroBatchTokens micro_batch(long k);
    // The instances the instance filter masked in this step's micro-batches so far, this rank.
    double masked() const { return masked_; }
    bool has_label_masks() const { return !label_mask_.empty(); }

   private:
    const TrainConfig& config_;
    const RunData& data_;
    long L_, micro_;
    uint64_t step_key_ = 0;
    double tokens_in_loss_ = 0.0, masked_ = 0.0;
    std::vector<int64_t> global_, local_;
    std::vector<int32_t> tokens_;
    std::vector<uint8_t> keep_;        // per instance of a micro-batch: 0 where the instance filter masks it
    std::vector<uint8_t> label_mask_;  // a micro-batch's label masks (data.label_mask_paths), empty without
};

}  // namespace trainer
