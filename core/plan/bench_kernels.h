// `trainer bench-kernels`: times every op a training step of a config runs, each distinct op and shape once, on
// the configured device and precision: the ops are recorded from a real step as the model issues them (an
// OpRecorder, core/plan/op_recorder.h), on the model cut to its first two blocks (every block runs the same ops),
// and counted by a dry run of the whole model's step. Prints a markdown table: the op and its shape, its calls a
// step, time per call, achieved FLOP/s and bytes/s, and the share of the device's roofline (max of FLOPs over the
// FLOP peak and compulsory bytes over the bandwidth) it reaches.
#pragma once

#include <string>
#include <vector>

#include "base/config.h"
#include "core/plan/op_recorder.h"

namespace trainer {

// Runs the benchmark (each op `reps` times after two warm-up calls); returns the process exit code. With
// `calibration_out`, also writes the measured time of each op with its FLOPs and bytes there (JSON), for
// `trainer plan --calibration`.
int run_kernel_bench(const TrainConfig& config, int reps, const std::string& calibration_out = "");

// The rows bench-kernels prints for `config` on `device`, untimed, from dry runs of the cut step and of the whole
// model's; an internal error names an op of the whole model's step that the cut step does not run, which
// bench-kernels could not time.
std::vector<RecordedOp> bench_kernel_rows(const TrainConfig& config, Device device);

}  // namespace trainer
