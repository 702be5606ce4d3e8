// The training run: preflight (every check that can refuse the run) -> build (backend, layout, the
// parallel World and its strategy, model, optimizer) -> the step loop with logging, evaluation and
// checkpoints -> the summary.
#pragma once

#include "base/config.h"

namespace trainer {

// Runs a training job described by a validated config; returns the process exit code. User errors
// throw UserError (printed by main as one `error:` line).
int run_training(const TrainConfig& config);

}  // namespace trainer
