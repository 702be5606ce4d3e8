// One optimizer step as the training loop runs it and the plan's dry run prices it, written once: the rank's
// micro-batches forward and backward (the strategy reducing the gradients), the step's exchange of named values
// between the ranks (the loss sums, then whatever the caller reserves: stop votes, checkpoint votes, compute
// times), then the optimizer. The trace spans are the same in both, so a predicted step draws beside a measured one.
#pragma once

#include <functional>
#include <string>

#include "core/model/model.h"
#include "core/optimizer.h"
#include "core/run/exchange.h"

namespace trainer {

class Backend;
class Strategy;

struct StepPlan {
    long step = 1, total_steps = 1;  // 1-based; the optimizer's schedule reads them
    long accumulation = 1;           // micro-batches of this rank
    int micro = 1;                   // instances in each
    float dloss_scale = 1.0f;        // the loss gradient's scale (world / the global batch's predicted tokens)
    std::string label = "step";      // the step span's name in a trace
    bool dry = false;                // the plan's dry run: its collectives carry sizes, not values
    // Micro-batch k's tokens (0-based k).
    std::function<MicroBatchTokens(long k)> micro_batch;
    // Reserves and fills this rank's slots of the exchange beyond the loss sums ("loss": cross-entropy, z-loss).
    std::function<void(RankExchange&)> fill;
    // Reads the exchange's sums before the optimizer runs (the loop stops a diverged run here).
    std::function<void(const RankExchange&)> after_exchange;
};

// The slots every step of the loop exchanges beside the loss sums, in the loop and in the dry run alike: the
// instances the instance filter masked, and the ranks' votes on a stop request (base/stop.h).
struct StepSlots {
    RankExchange::Slot masked, stop_votes;
};
StepSlots reserve_step_slots(RankExchange& exchange);

// Runs the step; the exchange holds every rank's sums afterwards ("loss" first), the result is the optimizer's.
OptimizerStepResult run_step(Strategy& strategy, Model& model, AdamW& optimizer, Backend& backend,
                             RankExchange& exchange, const StepPlan& plan);

}  // namespace trainer
