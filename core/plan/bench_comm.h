// `trainer bench-comm`: the links of the launched world, measured. Every rank times all-reduce, reduce-scatter
// and all-gather of fp32 buffers from 4 KiB up, over the collectives a run of the config would use (NCCL on
// GPUs, Gloo on the CPU), on the world's group and, on several nodes, on each node's own group; a bandwidth
// and a latency per ring step are fitted to each collective's times (ring_cost in core/plan/step_time.h, the model
// the plan times collectives with), and --calibration-out writes them for `trainer plan --comm-calibration`
// (plan.comm_calibration), in place of the hardware entry's links. So a plan on a machine whose links no
// entry describes (GPUs on PCIe through host memory, a slow network) predicts from what the links do.
#pragma once

#include <string>
#include <vector>

#include "base/config.h"
#include "core/plan/step_time.h"

namespace trainer {

// One measured collective: its group ("intra" or "inter"), kind, the bytes as a dry run reports them (a
// reduce-scatter's or all-gather's shard, an all-reduce's buffer), the group's size, and the seconds a call
// took (the mean of back-to-back calls, averaged over the ranks; the fastest of three trials).
struct CommSample {
    std::string group, kind;
    double bytes = 0.0;
    int group_size = 0;
    double seconds = 0.0;
};

// The link that fits the samples of one kind and group: seconds = steps x latency + bytes / bandwidth
// (ring_cost), least squares with each time's noise taken as a few percent of it plus its latency part, so the
// small calls settle the latency and the large ones the bandwidth. A latency that fits below 0 is 0, the
// bandwidth then refitted alone. UserError where the times do not grow with the bytes (no bandwidth fits).
Link fit_link(const std::vector<CommSample>& samples);

struct CommBenchOptions {
    size_t max_bytes = 0;  // the largest buffer; 0: 256 MiB on CUDA, 64 MiB on the CPU
    double seconds_per_size = 0.2;
    std::string calibration_out;  // where to write the fitted links (rank 0), empty: only print them
};
int run_comm_bench(const TrainConfig& config, const CommBenchOptions& options);

}  // namespace trainer
