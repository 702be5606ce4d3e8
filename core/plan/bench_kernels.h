// `trainer bench-kernels`: times every Backend op of one training step at a config's shapes (its
// micro-batch, sequence, width, heads, MLP and vocabulary) on the configured device and precision, and
// prints a markdown table: time per call, achieved FLOP/s and bytes/s, and the share of the device's
// roofline (max of FLOPs over the FLOP peak and compulsory bytes over the bandwidth) each op reaches.
#pragma once

#include <string>
#include <vector>

#include "base/config.h"

namespace trainer {

// Runs the benchmark (each op `reps` times after two warm-up calls); returns the process exit code. With
// `calibration_out`, also writes the measured time of each op with its FLOPs and bytes there (JSON), for
// `trainer plan --calibration`.
int run_kernel_bench(const TrainConfig& config, int reps, const std::string& calibration_out = "");

// The compute ops a step of `config` on `device` runs (a dry run of it) that bench-kernels has no row for; empty
// when every one is timed. run_kernel_bench refuses to run with any (an internal error naming them).
std::vector<std::string> ops_without_bench_rows(const TrainConfig& config, Device device);

}  // namespace trainer
