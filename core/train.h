// The training run: wires config -> backend -> data -> layout -> strategy -> model -> optimizer, then
// runs the step loop with logging, evaluation and checkpoints.
#pragma once

#include "base/config.h"
#include "kernels/backend.h"

namespace trainer {

// Runs a training job described by a validated config; returns the process exit code. User errors
// throw UserError (printed by main as one `error:` line).
int run_training(const TrainConfig& config);

// The device a config trains on ("auto" resolved) after checking what it can run there: amp_bf16, NCCL
// and cuDNN attention need the GPU, Gloo carries host memory, attention kernels' head-size limits.
// UserError naming the key otherwise.
std::string check_device_supported(const TrainConfig& config, int world_size);

// How the config asks the backend to compute (precision, attention kernels), on GPU `local_rank`.
BackendOptions backend_options(const TrainConfig& config, int local_rank);

// Sets the OpenMP and BLAS thread counts (0: one per available core); returns the count used.
int configure_threads(int threads);

}  // namespace trainer
