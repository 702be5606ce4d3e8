// The training run: wires config -> backend -> data -> layout -> strategy -> model -> optimizer, then
// runs the step loop with logging, evaluation and checkpoints.
#pragma once

#include "core/config.h"

namespace trainer {

// Runs a training job described by a validated config; returns the process exit code. User errors
// throw UserError (printed by main as one `error:` line).
int run_training(const TrainConfig& config);

// Sets the OpenMP and BLAS thread counts (0: one per available core); returns the count used.
int configure_threads(int threads);

}  // namespace trainer
